//! The rows a compaction works on: head, tail cut, the split of an
//! oversized active turn, blank echoes.

use super::*;
use crate::test_support::msg;

fn round(i: usize, result_chars: usize) -> [Value; 2] {
    [
        serde_json::json!({"role": "assistant", "content": null,
                "tool_calls": [{"id": format!("c{i}"), "function": {"name": "f", "arguments": "{}"}}]}),
        serde_json::json!({"role": "tool", "tool_call_id": format!("c{i}"), "content": "r".repeat(result_chars)}),
    ]
}

fn params(budget: u64) -> TailParams {
    TailParams {
        budget,
        soft_ceiling: budget,
        protect_last_n: 20,
        min_tail_user_messages: 1,
        allow_split_turn: false,
    }
}

#[test]
fn split_cuts_between_rounds_and_keeps_the_newest() {
    let mut msgs = vec![
        serde_json::json!({"role": "system", "content": "s"}),
        serde_json::json!({"role": "user", "content": "ask"}),
    ];
    for i in 0..5 {
        msgs.extend(round(i, 800));
    }
    // Each round costs ~230 tokens: 500 keeps the two newest.
    let (ask, keep) = split_active_turn(&msgs, 1, &params(500), None).unwrap();
    assert_eq!(ask, 1);
    assert_eq!(keep, msgs.len() - 4);
    assert!(view::has_tool_calls(&msgs[keep]));
    // A ceiling below one round still keeps the newest round whole.
    let (_, keep) = split_active_turn(&msgs, 1, &params(10), None).unwrap();
    assert_eq!(keep, msgs.len() - 2);
    // A turn that fits is not split, unless eager and the ask is in the head.
    assert_eq!(split_active_turn(&msgs, 1, &params(100_000), None), None);
    assert_eq!(
        split_active_turn(&msgs, 1, &params(100_000), Some(4)),
        Some((1, 4))
    );
    // One round only: nothing inside the turn to summarise.
    let short: Vec<Value> = msgs[..4].to_vec();
    assert_eq!(split_active_turn(&short, 1, &params(10), None), None);
}

#[test]
fn a_summary_carrying_the_ask_is_an_ask_row() {
    let carried = markers::prepend_summary(
        &Value::String("do it".into()),
        &markers::normalize_summary_prefix("B"),
    );
    let declared = |content: &Value| {
        let mut m = serde_json::json!({"role": "user", "content": content});
        markers::declare_summary(&mut m);
        m
    };
    assert!(is_ask_row(&declared(&carried)));
    let bare = markers::standalone_content(&markers::normalize_summary_prefix("B"));
    assert!(!is_ask_row(&declared(&Value::String(bare))));
    assert!(!is_ask_row(
        &serde_json::json!({"role": "assistant", "content": "x"})
    ));
}

#[test]
fn blank_echo_after_latest_ask_is_removed_only_when_an_assistant_follows() {
    let msgs = vec![
        msg("user", "real"),
        msg("user", ""),
        msg("user", "  "),
        msg("assistant", "ok"),
    ];
    let out = remove_blank_echoes(msgs);
    assert_eq!(out.len(), 2);
    let keep = vec![msg("user", "real"), msg("user", "")];
    assert_eq!(
        remove_blank_echoes(keep.clone()),
        keep,
        "a trailing blank may be a placeholder"
    );
}
