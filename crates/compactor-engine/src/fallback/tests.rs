//! The deterministic fallback summary.

use super::*;
use crate::test_support::msg;
use serde_json::json;
use serde_json::Value;

fn secret() -> String {
    format!("ghp_{}", "a".repeat(36))
}

fn session() -> Vec<Value> {
    let s = secret();
    vec![
        json!({"role": "user", "content": format!("Fix /tmp/project/app.py and never leak {s}")}),
        json!({"role": "assistant", "content": "I will inspect it.", "tool_calls": [
            {"id": "call-1", "function": {"name": "read_file", "arguments": "{\"path\":\"/tmp/project/app.py\"}"}}
        ]}),
        json!({"role": "tool", "tool_call_id": "call-1", "content": format!("read /tmp/project/app.py with token {s}")}),
        json!({"role": "assistant", "content": "Found the bug in /tmp/project/app.py"}),
        json!({"role": "user", "content": "Patch it after this"}),
        json!({"role": "assistant", "content": "Ready to patch"}),
    ]
}

#[test]
fn keeps_tool_paths_and_redacts() {
    let f = build_fallback_summary(&session(), None, "timeout");
    assert!(f.starts_with(SUMMARY_PREFIX));
    assert!(f.contains(FALLBACK_NOTICE));
    assert!(f.contains("Called tool(s): read_file"));
    assert!(f.contains("/tmp/project/app.py"));
    assert!(f.contains("[read_file] read /tmp/project/app.py from line 1"));
    assert!(!f.contains(&secret()));
    assert!(!f.contains("ghp_"));
}

#[test]
fn redacts_keys_bearer_and_url_credentials() {
    let msgs = vec![
        json!({"role": "user", "content": "use sk-proj-ABCDEFGHIJKLMNOPQRSTUV and https://bob:hunter2@git.example.com/r"}),
        json!({"role": "tool", "tool_call_id": "x", "content": "Authorization: Bearer abcdefghijklmnop123"}),
    ];
    let f = build_fallback_summary(
        &msgs,
        Some("prev with password=hunter2"),
        "failed: api_key=zzzzzzzzzzzz",
    );
    for leaked in [
        "ABCDEFGHIJKLMNOP",
        "hunter2",
        "abcdefghijklmnop123",
        "zzzzzzzzzzzz",
    ] {
        assert!(!f.contains(leaked), "{leaked} leaked");
    }
    assert!(f.contains("[REDACTED]"));
}

#[test]
fn latest_ask_recorded_once() {
    let ask = "PLEASE_COMPUTE_THE_ARITHMETIC_CHAIN_XYZ";
    let msgs = vec![
        json!({"role": "user", "content": ask}),
        json!({"role": "assistant", "content": "working on it"}),
    ];
    let f = build_fallback_summary(&msgs, None, "provider down");
    assert_eq!(f.matches(&format!("User asked: '{ask}'")).count(), 1);
    // The raw text may appear once more, only in the verbatim transcript.
    assert_eq!(f.matches(ask).count(), 2);
    assert!(f.contains(&format!("USER: {ask}")));
}

#[test]
fn capped_at_8000_chars() {
    let msgs: Vec<Value> = (0..200)
            .flat_map(|i| {
                [
                    json!({"role": "user", "content": format!("ask {i} {}", "u".repeat(3_000))}),
                    json!({"role": "assistant", "content": "x".repeat(2_000), "tool_calls": [
                        {"id": format!("c{i}"), "function": {"name": "terminal", "arguments": "{\"command\":\"make\"}"}}]}),
                    json!({"role": "tool", "tool_call_id": format!("c{i}"), "content": format!("error: failed {}", "e".repeat(5_000))}),
                ]
            })
            .collect();
    let prev = "p".repeat(20_000);
    let f = build_fallback_summary(&msgs, Some(&prev), "timeout");
    assert!(
        f.chars().count() <= FALLBACK_MAX_CHARS,
        "{}",
        f.chars().count()
    );
    assert!(f.contains(FALLBACK_NOTICE));
    assert!(f.contains("User asked: 'ask 199"));
}

#[test]
fn capped_body_does_not_grow_across_fallbacks() {
    let round = |i: usize| {
        vec![
            json!({"role": "assistant", "content": format!("step {i}"), "tool_calls": [
                    {"id": format!("c{i}"), "function": {"name": "read_file", "arguments": format!("{{\"path\":\"src/m{i}.py\"}}")}}]}),
            json!({"role": "tool", "tool_call_id": format!("c{i}"), "content": "z".repeat(2_000)}),
        ]
    };
    let first: Vec<Value> = std::iter::once(json!({"role": "user", "content": "fix the drift"}))
        .chain((0..4).flat_map(round))
        .collect();
    let cap = 816;
    let mut prev = build_fallback_body_capped(&first, None, "boom", cap);
    assert!(prev.chars().count() <= cap, "{}", prev.chars().count());
    assert!(prev.contains("fix the drift"));
    for k in 1..12 {
        let dropped: Vec<Value> = (k * 4..k * 4 + 4).flat_map(round).collect();
        let next = build_fallback_body_capped(&dropped, Some(&prev), "boom", cap);
        assert!(
            next.chars().count() <= cap,
            "round {k}: {}",
            next.chars().count()
        );
        // The task is carried forward once, not nested.
        assert!(next.contains("fix the drift"), "round {k}: task lost");
        assert_eq!(
            next.matches("From the previous summary").count(),
            1,
            "round {k}"
        );
        prev = next;
    }
    // Large caps keep the full layout.
    let full = build_fallback_body_capped(&first, None, "boom", 7_000);
    assert!(full.contains("## Governing User Outcome"));
    assert!(!prev.contains("## Governing User Outcome"));
}

#[test]
fn blocked_and_limits() {
    let mut msgs = Vec::new();
    for i in 0..20 {
        msgs.push(json!({"role": "assistant", "content": null, "tool_calls": [
                {"id": format!("c{i}"), "function": {"name": "terminal", "arguments": format!("{{\"command\":\"run {i}\"}}")}}]}));
        msgs.push(json!({"role": "tool", "tool_call_id": format!("c{i}"), "content": format!("Traceback: boom {i}")}));
    }
    let f = build_fallback_body(&msgs, None, "x");
    let blocked = f.split("## Blocked\n").nth(1).unwrap_or("");
    let blocked = blocked.split("\n\n").next().unwrap_or("");
    assert_eq!(blocked.lines().count(), 5);
    let actions = f.split("## Completed Actions\n").nth(1).unwrap_or("");
    let actions = actions.split("\n\n").next().unwrap_or("");
    assert_eq!(actions.lines().count(), 12);
    assert!(f.contains("No user request in the compacted turns."));
}

#[test]
fn previous_snapshot_used_when_window_has_no_ask() {
    let prev = format!("{HISTORICAL_TASK_HEADING}\nUser asked: 'old thing'\n\n## Goal\nx");
    let msgs = vec![json!({"role": "assistant", "content": "did stuff"})];
    let f = build_fallback_body(&msgs, Some(&prev), "x");
    assert!(f.contains("From the previous summary (reference only): User asked: 'old thing'"));
    assert!(f.contains("## Previous Summary Snapshot"));
}

#[test]
fn synthetic_user_rows_are_not_asks() {
    let msgs = vec![
        json!({"role": "user", "content": "real ask"}),
        json!({"role": "user", "content": "[System: note]"}),
    ];
    let f = build_fallback_body(&msgs, None, "x");
    assert!(f.contains("User asked: 'real ask'"));
    assert!(f.contains("INTERNAL CONTEXT: [System: note]"));
}

#[test]
fn carries_the_previous_summary_whole_and_the_dropped_facts() {
    let prev: String = (0..30)
        .map(|i| format!("- earlier fact FACT-{i:02} recorded\n"))
        .collect();
    let dropped = vec![
        json!({"role": "user", "content": "Constraint: never change the tag REL-42."}),
        json!({"role": "tool", "tool_call_id": "c1", "content": "noise line\nbuild_id: B7-1234\nmore noise"}),
        json!({"role": "assistant", "content": "Decision: we deploy with id MIG-77."}),
    ];
    // Longer than the old 3,000-char (or half-the-cap) snapshot limit.
    assert!(prev.len() > 816 / 2);
    let body = build_fallback_body_capped(&dropped, Some(&prev), "boom", 2_400);
    for i in 0..30 {
        assert!(
            body.contains(&format!("FACT-{i:02}")),
            "fact {i} lost:\n{body}"
        );
    }
    for f in ["REL-42", "build_id: B7-1234", "MIG-77"] {
        assert!(body.contains(f), "{f} lost:\n{body}");
    }
    assert!(body.chars().count() <= 2_400);
    // A previous summary larger than the cap is shortened, never overflows it.
    let body = build_fallback_body_capped(&dropped, Some(&prev.repeat(10)), "boom", 1_200);
    assert!(body.chars().count() <= 1_200, "{}", body.chars().count());
}

// ---------------------------------------------------------------- TestCompress

#[test]
fn fallback_summary_does_not_triplicate_latest_user_ask() {
    let ask = "PLEASE_COMPUTE_THE_ARITHMETIC_CHAIN_XYZ";
    let turns = vec![msg("user", ask), msg("assistant", "working on it")];
    let summary = build_fallback_summary(&turns, None, "provider down");
    let line = format!("User asked: '{ask}'");
    assert!(summary.contains(ask));
    assert!(summary.matches(&line).count() <= 1, "{summary}");
}
