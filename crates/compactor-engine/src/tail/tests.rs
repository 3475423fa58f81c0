//! The protected tail: the ported tail-cut, pruning and sanitiser tests
//! (tests/REFERENCE_PARITY.md maps them) and compactor's own.

use super::*;
use crate::prune::{prune_old_tool_results, PruneParams};
use crate::sanitize::sanitize_tool_pairs;
use crate::test_support::*;
use crate::tokens::estimate_msg_budget_tokens;
use serde_json::{json, Value};

fn m(role: &str) -> Value {
    json!({"role": role, "content": "x"})
}

#[test]
fn min_tail_floor_rules() {
    assert_eq!(min_tail_floor(20, 100), 8);
    assert_eq!(min_tail_floor(2, 100), 3);
    assert_eq!(min_tail_floor(20, 6), 4);
    assert_eq!(min_tail_floor(20, 3), 3);
    assert_eq!(min_tail_floor(20, 2), 2);
    assert_eq!(min_tail_floor(20, 1), 0);
}

#[test]
fn alignment_keeps_tool_groups_whole() {
    let calls = json!({"role": "assistant", "content": null, "tool_calls": [{"id": "a"}]});
    let msgs = vec![m("user"), calls, m("tool"), m("tool"), m("assistant")];
    assert_eq!(align_backward(&msgs, 3), 1);
    assert_eq!(align_backward(&msgs, 4), 1);
    assert_eq!(align_backward(&msgs, 2), 1);
    assert_eq!(align_backward(&msgs, 1), 1);
    assert_eq!(align_forward(&msgs, 2), 4);
    assert_eq!(find_turn_pair_end(&msgs, 0), 4);
}

#[test]
fn cut_never_lands_in_the_head_or_past_the_end() {
    let msgs: Vec<Value> = (0..10)
        .map(|i| m(if i % 2 == 0 { "user" } else { "assistant" }))
        .collect();
    let p = TailParams {
        budget: 1,
        soft_ceiling: 1,
        protect_last_n: 0,
        min_tail_user_messages: 1,
        allow_split_turn: false,
    };
    for head in 0..9 {
        let cut = find_tail_cut_by_tokens(&msgs, head, &p);
        assert!(cut > head && cut <= msgs.len(), "head {head} cut {cut}");
    }
}

// ------------------------------------------------- TestTailBudgetCodexReplayFields

fn replay_conversation(hidden: Value) -> Vec<Value> {
    let mut v = vec![
        msg("system", "sys"),
        msg("user", "initial ask"),
        msg("assistant", "first answer"),
        msg("user", "older follow-up"),
        hidden,
    ];
    for i in 0..14 {
        v.push(msg(
            if i % 2 == 0 { "user" } else { "assistant" },
            &format!("tail visible message {i}"),
        ));
    }
    v
}

fn first1_last1() -> crate::compressor::Compressor {
    compressor_with("test/model", 100_000, |c| {
        c.protect_first_n = 1;
        c.protect_last_n = 1;
    })
}

#[test]
fn tail_cut_counts_codex_replay_and_reasoning_fields() {
    let mut c = first1_last1();
    let big = "x".repeat(5_000);
    let hidden = json!({
        "role": "assistant", "content": "ok",
        "reasoning": format!("summary {big}"),
        "reasoning_content": format!("scratchpad {big}"),
        "reasoning_details": [{"text": format!("details {big}")}],
        "codex_reasoning_items": [{"type": "reasoning", "encrypted_content": format!("enc_{big}")}],
        "codex_message_items": [{"type": "message", "role": "assistant",
            "content": [{"type": "output_text", "text": format!("reply {big}")}]}],
    });
    let msgs = replay_conversation(hidden);
    assert_eq!(c.find_tail_cut_by_tokens(&msgs, 1, Some(150)), 5);
    assert!(msgs[4]["codex_reasoning_items"][0]["encrypted_content"]
        .as_str()
        .unwrap()
        .starts_with("enc_"));
    assert!(msgs[4]["codex_message_items"][0]["content"][0]["text"]
        .as_str()
        .unwrap()
        .starts_with("reply "));
}

fn each_hidden_field(field: &str, value: Value) {
    let mut c = first1_last1();
    let mut hidden = json!({"role": "assistant", "content": "ok"});
    hidden[field] = value;
    let msgs = replay_conversation(hidden);
    assert_eq!(
        c.find_tail_cut_by_tokens(&msgs, 1, Some(150)),
        5,
        "field {field}"
    );
}

#[test]
fn tail_cut_counts_each_hidden_replay_field_reasoning() {
    each_hidden_field("reasoning", json!("x".repeat(5_000)));
}

#[test]
fn tail_cut_counts_each_hidden_replay_field_reasoning_content() {
    each_hidden_field("reasoning_content", json!("x".repeat(5_000)));
}

#[test]
fn tail_cut_counts_each_hidden_replay_field_reasoning_details() {
    each_hidden_field("reasoning_details", json!([{"text": "x".repeat(5_000)}]));
}

#[test]
fn tail_cut_counts_each_hidden_replay_field_codex_reasoning_items() {
    each_hidden_field(
        "codex_reasoning_items",
        json!([{"type": "reasoning", "encrypted_content": "x".repeat(5_000)}]),
    );
}

#[test]
fn tail_cut_counts_each_hidden_replay_field_codex_message_items() {
    each_hidden_field(
        "codex_message_items",
        json!([{"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "x".repeat(5_000)}]}]),
    );
}

// ---------------------------------------------------- TestTokenBudgetTailProtection

fn budget_compressor() -> crate::compressor::Compressor {
    compressor_with("test/model", 200_000, |c| {
        c.threshold_percent = 0.5;
        c.protect_first_n = 2;
        c.protect_last_n = 20;
    })
}

#[test]
fn tiny_budget_preserves_bounded_recent_turns() {
    let mut c = budget_compressor();
    c.trigger.set_tail_token_budget(10);
    let contents = [
        ("system", "sys"),
        ("user", "old start"),
        ("assistant", "old ack"),
        ("user", "middle work"),
        ("assistant", "middle ack"),
        ("user", "middle ask 2"),
        ("assistant", "middle answer 2"),
        ("user", "middle ask 3"),
        ("assistant", "middle answer 3"),
        ("user", "recent ask 1"),
        ("assistant", "recent answer 1"),
        ("user", "recent ask 2"),
        ("assistant", "recent answer 2"),
        ("user", "latest ask"),
    ];
    let msgs: Vec<Value> = contents.iter().map(|(r, t)| msg(r, t)).collect();
    let cut = c.find_tail_cut_by_tokens(&msgs, 1, None);
    assert!(msgs.len() - cut >= 8);
    assert_eq!(msgs[cut]["content"], "middle answer 2");
    assert_eq!(msgs.last().unwrap()["content"], "latest ask");
}

#[test]
fn prune_short_conv_protects_entire_tail() {
    let msgs = vec![
        json!({"role": "tool", "content": "x".repeat(5000), "tool_call_id": "c0"}),
        msg("assistant", "ack"),
        msg("user", "recent"),
        msg("assistant", "reply"),
    ];
    let (out, pruned) = prune_old_tool_results(
        &msgs,
        &PruneParams {
            protect_tail_count: 4,
            protect_tail_tokens: Some(1_000_000),
            ..PruneParams::by_count(4)
        },
    );
    assert_eq!(pruned, 0);
    assert_eq!(out[0]["content"], "x".repeat(5000));
}

#[test]
fn multimodal_message_accumulates_text_chars_not_block_count() {
    let mut c = budget_compressor();
    c.trigger.set_tail_token_budget(80);
    let msgs = vec![
        msg("user", "head1"),
        json!({"role": "user", "content": [
            {"type": "text", "text": "x".repeat(500)},
            {"type": "image_url", "image_url": {"url": "https://example.com/img.jpg"}}]}),
        msg("assistant", "tail1"),
        msg("user", "tail2"),
        msg("assistant", "tail3"),
        msg("user", "tail4"),
    ];
    let cut = c.find_tail_cut_by_tokens(&msgs, 0, None);
    assert!(msgs.len() - cut >= 4, "cut={cut}");
}

// ----------------------------------------------------------- TestTruncateToolCallArgsJson

#[test]
fn pass3_emits_valid_json_for_downstream_provider() {
    let huge = format!(
        "# Shopping Browser Setup Notes\n\n## Overview\n{}",
        "x ".repeat(400)
    );
    let args = serde_json::to_string(&json!({
        "path": "~/.hermes/skills/shopping/browser-setup-notes.md",
        "content": huge,
    }))
    .unwrap();
    assert!(args.len() > 500);
    let msgs = vec![
        msg("user", "please write two files"),
        json!({"role": "assistant", "content": null, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "write_file", "arguments": args}}]}),
        json!({"role": "tool", "tool_call_id": "call_1", "content": "{\"bytes_written\": 727}"}),
        msg("user", "ok"),
        msg("assistant", "done"),
    ];
    let (out, _) = prune_old_tool_results(&msgs, &PruneParams::by_count(2));
    let shrunk = out[1]["tool_calls"][0]["function"]["arguments"]
        .as_str()
        .unwrap();
    let parsed: Value = serde_json::from_str(shrunk).expect("valid JSON");
    assert_eq!(
        parsed["path"],
        "~/.hermes/skills/shopping/browser-setup-notes.md"
    );
    assert!(
        parsed["content"]
            .as_str()
            .unwrap()
            .ends_with("...[truncated]"),
        "{parsed}"
    );
}

// ------------------------------------------------------------- TestTurnPairPreservation

fn pair_compressor() -> crate::compressor::Compressor {
    compressor_with("test/model", 100_000, |c| {
        c.threshold_percent = 0.85;
        c.protect_first_n = 1;
        c.protect_last_n = 0;
    })
}

#[test]
fn user_in_compressed_region_pulled_back() {
    let msgs = vec![
        msg("user", "head"),
        msg("assistant", "hi"),
        msg("user", "do thing"),
        msg("assistant", "done"),
    ];
    assert!(ensure_last_user_message_in_tail(&msgs, 3, 0) <= 2);
}

#[test]
fn orphan_prevented_user_at_head_end() {
    let msgs = vec![
        msg("user", "first exchange"),
        msg("user", "THE ACTIVE ASK"),
        msg("assistant", "done"),
        json!({"role": "tool", "tool_call_id": "c1", "content": "toolout"}),
        msg("assistant", "final reply"),
    ];
    let r = ensure_last_user_message_in_tail(&msgs, 3, 1);
    assert_eq!(r, 4);
    assert_eq!(msgs[r]["role"], "assistant");
}

#[test]
fn no_orphan_after_full_compaction_cycle() {
    let mut c = pair_compressor();
    let mut msgs = vec![msg("user", "initial"), msg("assistant", "ok")];
    for i in 0..5 {
        msgs.push(msg("user", &format!("step {i}")));
        msgs.push(msg("assistant", &format!("done {i}")));
    }
    msgs.push(msg("user", "lights off please"));
    msgs.push(msg("assistant", "lights are off"));
    let cut = c.find_tail_cut_by_tokens(&msgs, 1, None);
    let tail = &msgs[cut..];
    if tail.first().is_some_and(|m| m["role"] == "user") {
        assert!(tail.len() >= 2 && tail[1]["role"] == "assistant");
    }
}

// -------------------------------------------------- TestSanitizerStripsOrphanedToolCalls

fn asst(out: &[Value]) -> &Value {
    out.iter().find(|m| m["role"] == "assistant").unwrap()
}

#[test]
fn sanitizer_strips_orphaned_tool_calls() {
    let out = sanitize_tool_pairs(vec![
        json!({"role": "assistant", "content": "", "tool_calls": [{"id": "tc_orphan", "function": {"name": "search", "arguments": "{}"}}]}),
        msg("user", "never mind"),
    ]);
    let a = asst(&out);
    assert!(a.get("tool_calls").is_none());
    assert!(!out.iter().any(|m| m["role"] == "tool"));
    assert_eq!(a["content"], "(tool call removed)");
}

#[test]
fn sanitizer_strips_orphaned_keeps_valid() {
    let out = sanitize_tool_pairs(vec![
        json!({"role": "assistant", "content": "", "tool_calls": [
            {"id": "tc_valid", "function": {"name": "read_file", "arguments": "{}"}},
            {"id": "tc_orphan", "function": {"name": "search", "arguments": "{}"}}]}),
        json!({"role": "tool", "tool_call_id": "tc_valid", "content": "file content"}),
    ]);
    let a = asst(&out);
    assert_eq!(a["tool_calls"].as_array().unwrap().len(), 1);
    assert_eq!(a["tool_calls"][0]["id"], "tc_valid");
    let tools: Vec<&Value> = out.iter().filter(|m| m["role"] == "tool").collect();
    assert_eq!(tools.len(), 1);
    assert_eq!(tools[0]["tool_call_id"], "tc_valid");
}

#[test]
fn sanitizer_strips_orphaned_preserves_text_content() {
    let out = sanitize_tool_pairs(vec![
        json!({"role": "assistant", "content": "Let me search for that.", "tool_calls": [{"id": "tc_orphan", "function": {"name": "search", "arguments": "{}"}}]}),
        msg("user", "thanks"),
    ]);
    let a = asst(&out);
    assert_eq!(a["content"], "Let me search for that.");
    assert!(a.get("tool_calls").is_none());
}

#[test]
fn sanitizer_strips_orphaned_with_call_id_mismatch() {
    let out = sanitize_tool_pairs(vec![
        json!({"role": "assistant", "content": "", "tool_calls": [{"id": "fc_abc", "call_id": "call_abc", "function": {"name": "search", "arguments": "{}"}}]}),
        msg("user", "next"),
    ]);
    assert!(asst(&out).get("tool_calls").is_none());
    assert!(!out.iter().any(|m| m["role"] == "tool"));
}

// ------------------------------------------------------------- TestMinTailUserMessages

fn n_user_compressor(n: usize, first: usize) -> crate::compressor::Compressor {
    compressor_with("test/model", 200_000, move |c| {
        c.threshold_percent = 0.5;
        c.protect_first_n = first;
        c.min_tail_user_messages = n;
    })
}

#[test]
fn n3_tool_group_integrity() {
    let mut c = n_user_compressor(3, 1);
    c.trigger.set_tail_token_budget(200);
    let msgs = vec![
        msg("user", "start"),
        json!({"role": "assistant", "content": null, "tool_calls": [{"function": {"name": "read_file", "arguments": "{}"}}]}),
        json!({"role": "tool", "content": "result content", "tool_call_id": "call_1"}),
        msg("user", "user 3rd last"),
        msg("assistant", "reply 3rd last"),
        msg("user", "user 2nd last"),
        msg("assistant", "reply 2nd last"),
        msg("user", "user last"),
        msg("assistant", "reply last"),
    ];
    let cut = c.find_tail_cut_by_tokens(&msgs, 1, None);
    let positions: Vec<usize> = msgs[..cut]
        .iter()
        .enumerate()
        .filter(|(_, m)| {
            (m["role"] == "assistant" || m["role"] == "tool")
                && (m.get("tool_calls").is_some() || m.get("tool_call_id").is_some())
        })
        .map(|(i, _)| i)
        .collect();
    if positions.len() >= 2 {
        assert_eq!(
            positions[positions.len() - 1] - positions[0],
            positions.len() - 1
        );
    }
    let users: Vec<&str> = msgs[cut..]
        .iter()
        .filter(|m| m["role"] == "user")
        .map(|m| m["content"].as_str().unwrap())
        .collect();
    for u in ["user 3rd last", "user 2nd last", "user last"] {
        assert!(users.contains(&u), "{u} missing: {users:?}");
    }
    assert!(cut >= 2);
}

#[test]
fn default_is_behavior_preserving() {
    let mut d = compressor_with("test/model", 200_000, |c| {
        c.threshold_percent = 0.5;
        c.protect_first_n = 2;
    });
    let mut e = n_user_compressor(1, 2);
    assert_eq!(d.cfg.min_tail_user_messages, 1);
    d.trigger.set_tail_token_budget(200);
    e.trigger.set_tail_token_budget(200);
    let mut msgs = vec![msg("user", "head msg"), msg("assistant", "head reply")];
    for i in 0..3 {
        msgs.push(msg("user", &format!("user {i}")));
        msgs.push(msg("assistant", &"X".repeat(4000)));
    }
    msgs.push(msg("user", "final user"));
    msgs.push(msg("assistant", "final reply"));
    assert_eq!(
        d.find_tail_cut_by_tokens(&msgs, 2, None),
        e.find_tail_cut_by_tokens(&msgs, 2, None)
    );
}

#[test]
fn blank_echo_does_not_count_toward_n() {
    let msgs = vec![
        msg("user", "head"),
        msg("assistant", "head reply"),
        msg("user", "real oldest"),
        msg("assistant", "reply oldest"),
        msg("user", "real middle"),
        msg("assistant", "reply middle"),
        msg("user", ""),
        msg("assistant", "reply to echo"),
        msg("user", "   "),
        msg("assistant", "another reply"),
        msg("user", "real latest"),
        msg("assistant", "final reply"),
    ];
    let r = ensure_last_n_user_messages_in_tail(&msgs, 10, 1, 3);
    assert_eq!(r, 2);
    let users: Vec<&str> = msgs[r..]
        .iter()
        .filter(|m| m["role"] == "user" && !m["content"].as_str().unwrap().trim().is_empty())
        .map(|m| m["content"].as_str().unwrap())
        .collect();
    for u in ["real oldest", "real middle", "real latest"] {
        assert!(users.contains(&u));
    }
}

#[test]
fn n_guarantee_wins_over_tail_token_budget_and_floor() {
    let mut c = n_user_compressor(3, 1);
    c.trigger.set_tail_token_budget(150);
    let mut msgs = vec![msg("user", "head"), msg("assistant", "head reply")];
    for i in [3, 2, 1] {
        msgs.push(msg("user", &format!("real {i}")));
        msgs.push(msg("assistant", &"B".repeat(6000)));
    }
    let cut = c.find_tail_cut_by_tokens(&msgs, 1, None);
    let tail = &msgs[cut..];
    let users: Vec<&str> = tail
        .iter()
        .filter(|m| m["role"] == "user")
        .map(|m| m["content"].as_str().unwrap())
        .collect();
    for u in ["real 1", "real 2", "real 3"] {
        assert!(users.contains(&u), "{users:?}");
    }
    let acc: u64 = tail
        .iter()
        .map(|m| estimate_msg_budget_tokens(m, true))
        .sum();
    assert!(acc > 150);
}

// --------------------------------------- test_replay_budget_accounting::TestTailCutBehavior

#[test]
fn stale_thinking_does_not_shrink_tail() {
    let mut c = compressor_with("claude-opus-5", 200_000, |_| {});
    let big = "deliberation ".repeat(400);
    let mut msgs = vec![msg("system", "sys")];
    for i in 0..30 {
        msgs.push(msg("user", &format!("question {i}")));
        msgs.push(json!({"role": "assistant", "content": format!("answer {i}"), "reasoning": big, "reasoning_content": big}));
    }
    let budget = 3_000u64;
    let cut = c.find_tail_cut_by_tokens(&msgs, 1, Some(budget));
    let soft = budget * 3 / 2;
    let mut acc = 0;
    let mut old_cut = msgs.len();
    for i in (1..msgs.len()).rev() {
        let t = estimate_msg_budget_tokens(&msgs[i], true);
        if acc + t > soft && msgs.len() - i >= 3 {
            break;
        }
        acc += t;
        old_cut = i;
    }
    assert!(
        cut < old_cut,
        "new cut {cut} must protect more than old {old_cut}"
    );
}
