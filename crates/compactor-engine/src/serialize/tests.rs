//! Summariser input: rendering, bounding, chunking, prompts, grounding and
//! reply validation.

use super::*;
use crate::markers::HISTORICAL_TASK_HEADING;
use crate::test_support::msg;
use crate::{markers, serialize};
use serde_json::json;

#[test]
fn serializes_roles_and_tool_calls() {
    let msgs = vec![
        json!({"role": "user", "content": "hi"}),
        json!({"role": "assistant", "content": "<think>secret plan</think>ok", "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "read_file", "arguments": "{\"path\":\"/a\"}"}}
            ], "reasoning_content": "NEVER_SENT"}),
        json!({"role": "tool", "tool_call_id": "c1", "content": "data"}),
    ];
    let s = serialize_for_summary(&msgs);
    assert_eq!(
            s,
            "[USER]: hi\n\n[ASSISTANT]: ok\n[Tool calls:\n  read_file({\"path\":\"/a\"})\n]\n\n[TOOL RESULT c1]: data"
        );
}

#[test]
fn think_blocks() {
    assert_eq!(strip_think_blocks("<think>a\nb</think>answer"), "answer");
    assert_eq!(strip_think_blocks("x <THINKING>y</THINKING> z"), "x  z");
    assert_eq!(strip_think_blocks("<think>never closed"), "");
    assert_eq!(
        strip_think_blocks("use a <reasoning> tag here, then more"),
        "use a <reasoning> tag here, then more"
    );
}

#[test]
fn per_message_truncation_keeps_head_and_tail() {
    let body = format!(
        "{}{}{}",
        "h".repeat(4_000),
        "m".repeat(3_000),
        "t".repeat(1_500)
    );
    let s = serialize_message(&json!({"role": "user", "content": body}));
    assert_eq!(
        s,
        format!(
            "[USER]: {}\n...[truncated]...\n{}",
            "h".repeat(4_000),
            "t".repeat(1_500)
        )
    );
    let exact = "x".repeat(6_000);
    assert!(!serialize_message(&json!({"role": "user", "content": exact})).contains("[truncated]"));
}

#[test]
fn long_args_cut_to_1200() {
    let args = "a".repeat(2_000);
    let s = serialize_message(&json!({"role": "assistant", "content": "",
            "tool_calls": [{"function": {"name": "f", "arguments": args}}]}));
    assert!(s.contains(&format!("f({}...)", "a".repeat(1_200))));
    assert!(!s.contains(&"a".repeat(1_201)));
}

#[test]
fn redacts_and_replaces_media() {
    let s = serialize_message(&json!({"role": "user",
            "content": "key sk-abcdefghijklmnopqrstuvwx MEDIA:/tmp/a.png"}));
    assert_eq!(s, "[USER]: key [REDACTED] [media attachment]");
}

#[test]
fn renders_list_content() {
    let s = render_content(Some(&json!([
        {"type": "text", "text": "look"},
        {"type": "image_url", "image_url": {"url": "https://x/y.png"}},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAA"}},
        {"type": "input_audio"}
    ])));
    assert_eq!(s, "look\n[image: https://x/y.png]\n[image]\n[input_audio]");
}

#[test]
fn bound_keeps_cap_and_both_ends() {
    let text = format!("HEAD{}TAIL", "z".repeat(400_000));
    let b = bound_summary_input(&text, SUMMARY_INPUT_MAX_CHARS);
    assert!(b.chars().count() <= SUMMARY_INPUT_MAX_CHARS);
    assert!(b.chars().count() > SUMMARY_INPUT_MAX_CHARS - 10);
    assert!(b.starts_with("HEAD") && b.ends_with("TAIL"));
    assert!(b.contains("summary input truncated"));
    assert_eq!(bound_summary_input("short", 100), "short");
    assert_eq!(bound_summary_input(&"q".repeat(500), 20), "q".repeat(20));
}

#[test]
fn first_and_iterative_prompts() {
    let first = build_summary_prompt(&PromptParts {
        turns: "[USER]: a",
        target_tokens: 2_000,
        ..Default::default()
    });
    assert!(first.contains("TURNS TO SUMMARIZE:\n[USER]: a"));
    assert!(first.contains("Target ~2000 tokens"));
    assert!(!first.contains("PREVIOUS SUMMARY"));
    let upd = build_summary_prompt(&PromptParts {
        turns: "[USER]: b",
        previous_summary: Some("OLD"),
        focus_topic: Some("database migration"),
        target_tokens: 3_000,
        ..Default::default()
    });
    assert!(upd.contains("PREVIOUS SUMMARY:\nOLD"));
    assert!(upd.contains("NEW TURNS TO INCORPORATE:\n[USER]: b"));
    let focus = upd.find("database migration").unwrap_or(0);
    assert!(
        focus
            > upd
                .find("Write only the summary body")
                .unwrap_or(usize::MAX)
    );
}

#[test]
fn prompt_bounds_previous_summary_and_turns() {
    let prev = format!(
        "PREV_HEAD {} PREV_TAIL",
        "p".repeat(SUMMARY_INPUT_MAX_CHARS * 2)
    );
    let turns = "x".repeat(SUMMARY_INPUT_MAX_CHARS * 3);
    let p = build_summary_prompt(&PromptParts {
        turns: &turns,
        previous_summary: Some(&prev),
        target_tokens: 1,
        ..Default::default()
    });
    assert!(p.len() < 2 * SUMMARY_INPUT_MAX_CHARS + 30_000);
    assert!(p.contains("PREV_HEAD") && p.contains("PREV_TAIL"));
}

#[test]
fn validation_errors() {
    assert_eq!(
        validate_summary_output(None, Some("stop")),
        Err(SummaryInvalid::Empty)
    );
    assert_eq!(
        validate_summary_output(Some("  \n"), None),
        Err(SummaryInvalid::Empty)
    );
    assert_eq!(
        validate_summary_output(Some("<think>x</think>"), None),
        Err(SummaryInvalid::Empty)
    );
    assert_eq!(
        validate_summary_output(Some("## A\nb"), Some("length")),
        Err(SummaryInvalid::Truncated)
    );
    assert_eq!(
        validate_summary_output(
            Some("I'm sorry, but I can't create a summary of this conversation."),
            None
        ),
        Err(SummaryInvalid::Refusal)
    );
    assert_eq!(
        validate_summary_reply(Some("text"), None, Some("no"), None),
        Err(SummaryInvalid::Refusal)
    );
}

#[test]
fn validation_cleans_body() {
    let out = validate_summary_output(
            Some("[CONTEXT SUMMARY]: <think>hmm</think>did work with token ghp_aaaaaaaaaaaaaaaaaaaaaaaaaaaa"),
            Some("stop"),
        );
    assert_eq!(out, Ok("did work with token [REDACTED]".to_string()));
    let r = validate_summary_reply(None, None, None, Some("from reasoning"));
    assert_eq!(r, Ok("from reasoning".to_string()));
    let forged = format!("body {}\nmore after", super::super::markers::END_MARKER);
    let ok = validate_summary_output(Some(&forged), None).unwrap_or_default();
    assert!(!ok.contains(super::super::markers::END_MARKER));
    assert!(
        ok.starts_with("body ") && ok.ends_with("more after"),
        "{ok}"
    );
}

#[test]
fn grounding_replaces_and_is_stable() {
    let summary = format!(
            "{HISTORICAL_TASK_HEADING}\nUser asked: stale example\n\n## Historical Remaining Work\n- keep me\n\n## Goal\nfinish"
        );
    let first = ground_task_snapshot(&summary, Some("real ask"));
    assert!(first.contains("\n## Historical Remaining Work\n"));
    assert!(first.contains("- keep me") && first.contains("## Goal"));
    assert!(first.contains("'real ask'"));
    assert!(!first.contains("stale example"));
    let second = ground_task_snapshot(&first, Some("real ask"));
    assert_eq!(second, first);
    assert_eq!(second.matches(HISTORICAL_TASK_HEADING).count(), 1);
}

#[test]
fn grounding_prepends_when_missing_and_collapses_duplicates() {
    let g = ground_task_snapshot("plain summary text", Some("do something"));
    assert!(g.starts_with(&format!("{HISTORICAL_TASK_HEADING}\n")));
    assert!(g.ends_with("plain summary text"));
    assert!(g.contains("do something"));
    let dup = format!("{HISTORICAL_TASK_HEADING}\na\n\n## Active Task\nb\n\n## Goal\nc");
    let g = ground_task_snapshot(&dup, Some("ask"));
    assert_eq!(g.matches("## ").count(), 2, "{g}");
    assert!(g.ends_with("## Goal\nc"));
}

#[test]
fn grounding_without_user_keeps_existing_section() {
    let s = format!("{HISTORICAL_TASK_HEADING}\nmodel text\n\n## Goal\nx");
    let g = ground_task_snapshot(&s, None);
    assert!(g.contains("model text"), "{g}");
    assert!(g.contains("## Goal\nx"));
    let g = ground_task_snapshot_with("body", Grounding::NoUserInSession);
    assert!(g.contains(NO_USER_SENTINEL));
}

#[test]
fn user_attribution_detected() {
    assert!(attributes_to_user(
        "## Goal\nThe user requested a refactor."
    ));
    assert!(attributes_to_user("- according to the user, tests pass"));
    assert!(attributes_to_user("User asked: 'x'"));
    assert!(!attributes_to_user(
        "The cron job rotated logs; user-facing docs unchanged."
    ));
    let grounded = ground_task_snapshot_with("## Goal\nrotate logs", Grounding::NoUserInSession);
    assert!(!attributes_to_user(&grounded));
}

#[test]
fn snapshot_skips_synthetic_user_rows() {
    let msgs = vec![
        json!({"role": "user", "content": "fix the login bug on prod"}),
        json!({"role": "assistant", "content": "on it"}),
        json!({"role": "user", "content": "[Your active task list was preserved across context compression]\n- item", "_todo_snapshot_synthetic": true}),
    ];
    let s = latest_user_task_snapshot(&msgs).unwrap_or_default();
    assert!(s.contains("fix the login bug on prod"));
    let only = vec![
        json!({"role": "user", "content": "[System: Your previous response was truncated ...]"}),
    ];
    assert_eq!(latest_user_task_snapshot(&only), None);
}

#[test]
fn chunks_fit_budget_and_keep_order() {
    let msgs: Vec<Value> = (0..50)
            .map(|i| json!({"role": if i % 2 == 0 {"user"} else {"assistant"}, "content": format!("m{i} {}", "w".repeat(900))}))
            .collect();
    let chunks = chunk_for_budget(&msgs, 5_000);
    assert!(chunks.len() > 1);
    let flat: Vec<Value> = chunks.iter().flatten().cloned().collect();
    assert_eq!(flat, msgs);
    for c in &chunks {
        assert!(serialize_for_summary(c).chars().count() <= 5_000);
    }
    assert_eq!(chunk_for_budget(&msgs, usize::MAX).len(), 1);
    assert!(chunk_for_budget(&[], 10).is_empty());
}

#[test]
fn oversized_message_gets_own_chunk() {
    let msgs = vec![
        json!({"role": "user", "content": "a"}),
        json!({"role": "user", "content": "b".repeat(20_000)}),
        json!({"role": "user", "content": "c"}),
    ];
    let chunks = chunk_for_budget(&msgs, 1_000);
    assert_eq!(chunks.len(), 3);
    assert_eq!(chunks[1][0], msgs[1]);
}

/// `TestSummaryPromptBounding::test_marker_does_not_collide_with_summary_classifier`
/// (`classify_summary_content` → `markers::classify_text`; `None` →
/// `TextHandoff::None`).
mod summary_prompt_bounding {
    use super::*;
    use markers::{classify_text, TextHandoff};
    use serialize::{bound_summary_input, SUMMARY_INPUT_MAX_CHARS};

    #[test]
    fn marker_does_not_collide_with_summary_classifier() {
        let cap = SUMMARY_INPUT_MAX_CHARS;
        let bounded = bound_summary_input(&"z".repeat(cap * 2), cap);
        assert!(bounded.contains("summary input truncated"));
        assert_eq!(classify_text(&bounded), TextHandoff::None);
        // Worst case: the marker lands at the start of a message.
        let at = bounded.find("\n\n...[summary input truncated").unwrap();
        let marker_only = &bounded[at..];
        assert_eq!(classify_text(marker_only.trim_start()), TextHandoff::None);
        assert!(!markers::is_handoff(
            &json!({"role": "user", "content": marker_only.trim_start()})
        ));
    }
}

#[test]
fn task_snapshot_skips_synthetic_user_scaffolding() {
    use crate::serialize::latest_user_task_snapshot;
    let msgs = vec![
        msg("user", "fix the login bug on prod"),
        msg("assistant", "on it"),
        json!({"role": "user", "content": "[Your active task list was preserved across context compression]\n- item", "_todo_snapshot_synthetic": true}),
    ];
    let snap = latest_user_task_snapshot(&msgs).unwrap();
    assert!(snap.contains("fix the login bug on prod"));
    assert!(!snap.contains("task list was preserved"));
    let only = vec![msg(
        "user",
        "[System: Your previous response was truncated ...]",
    )];
    assert!(latest_user_task_snapshot(&only).is_none());
}

#[test]
fn grounding_preserves_following_sections_across_regrounding() {
    use crate::serialize::ground_task_snapshot;
    let summary = format!(
        "{HISTORICAL_TASK_HEADING}\nUser asked: stale example\n\n## Historical Remaining Work\n- keep me\n\n## Goal\nfinish"
    );
    let first = ground_task_snapshot(&summary, Some("real ask"));
    assert!(first.lines().any(|l| l == "## Historical Remaining Work"));
    assert!(first.contains("- keep me") && first.contains("## Goal"));
    let second = ground_task_snapshot(&first, Some("real ask"));
    assert!(second.contains("- keep me") && second.contains("## Goal"));
    assert_eq!(second.matches(HISTORICAL_TASK_HEADING).count(), 1);
}

fn prompt_of(turns: &str, previous: Option<&str>, compact: bool) -> String {
    build_summary_prompt(&PromptParts {
        turns,
        previous_summary: previous,
        focus_topic: None,
        target_tokens: 200,
        today: None,
        no_user_turns: false,
        chunk: None,
        compact,
        user_messages_kept: true,
    })
}

/// The e2e suite's 270M model answered a summary call with the lean
/// preamble, a redacted user turn and a test log: that is the prompt again,
/// never a summary. A real summary that quotes a line of the turns, or an
/// update that keeps its previous lines, is one.
#[test]
fn a_reply_that_repeats_its_prompt_is_no_summary() {
    let log: String = (0..12)
        .map(|i| {
            format!(
                "test_deploy_{i} ... PASSED in {} ms (shard eu-{})\n",
                40 + i,
                i % 3
            )
        })
        .collect();
    let turns = format!("[USER]: run the tests\n[TOOL RESULT c1]: {log}");
    let prompt = prompt_of(&turns, None, true);
    let echo = format!(
        "You are a summarization agent: write a short checkpoint of the conversation turns below.\n[USER]: [REDACTED]\n{log}"
    );
    assert!(echoes_prompt(&echo, &prompt));
    // Without the instructions, the log copied back alone is still the prompt.
    assert!(echoes_prompt(
        &format!("[USER]: [REDACTED]\n{log}"),
        &prompt
    ));
    // The full prompt's preamble, in another case, too.
    let full = prompt_of(&turns, None, false);
    assert!(echoes_prompt(
        "YOU ARE A SUMMARIZATION AGENT writing...",
        &full
    ));
    let summary = format!(
        "## Historical Task Snapshot\n\"run the tests\"\n\n## Completed Actions\n1. Ran the deploy tests: all 12 passed.\n{}\n## Active State\nAll green.",
        log.lines().next().unwrap()
    );
    assert!(!echoes_prompt(&summary, &prompt));
    // Short plain prose that shares nothing with the prompt.
    assert!(!echoes_prompt(
        "The tests passed; nothing is pending.",
        &prompt
    ));
    // An update keeps the previous summary's lines: not copied from the turns.
    let previous = "Ran the suite twice on eu-1 and eu-2, both runs green after the retry.\nThe release tag REL-14 was cut from main at 10:12.";
    let update = prompt_of("[USER]: thanks", Some(previous), true);
    assert!(!echoes_prompt(previous, &update));
    assert!(echoes_prompt(previous, &prompt_of(previous, None, true)));
}
