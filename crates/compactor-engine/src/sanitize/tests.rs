//! Tool-pair sanitising and role alternation.

use super::*;
use serde_json::json;

#[test]
fn orphan_result_is_dropped_and_valid_pair_kept() {
    let msgs = vec![
        json!({"role":"user","content":"go"}),
        json!({"role":"tool","tool_call_id":"gone","content":"x"}),
        json!({"role":"assistant","content":null,"tool_calls":[{"id":"a","function":{"name":"f","arguments":"{}"}}]}),
        json!({"role":"tool","tool_call_id":"a","content":"ok"}),
        json!({"role":"assistant","content":"done"}),
    ];
    let out = sanitize_tool_pairs(msgs);
    assert_eq!(out.len(), 4);
    assert_eq!(out[2]["tool_call_id"], "a");
}

#[test]
fn trailing_inflight_assistant_keeps_its_calls() {
    let msgs = vec![
        json!({"role":"user","content":"go"}),
        json!({"role":"assistant","content":null,"tool_calls":[{"id":"a","function":{"name":"f","arguments":"{}"}}]}),
    ];
    let out = sanitize_tool_pairs(msgs.clone());
    assert_eq!(out, msgs);
}

// ------------------------------------------------------------ TestCompressWithClient

#[test]
fn sanitizer_matches_responses_call_id_when_id_differs() {
    use crate::sanitize::sanitize_tool_pairs;
    let msgs = vec![
        json!({"role": "assistant", "content": "", "tool_calls": [{"id": "fc_123", "call_id": "call_123",
            "response_item_id": "fc_123", "type": "function", "function": {"name": "search_files", "arguments": "{}"}}]}),
        json!({"role": "tool", "tool_call_id": "call_123", "content": "result"}),
    ];
    let out = sanitize_tool_pairs(msgs);
    let ids: Vec<&str> = out
        .iter()
        .filter(|m| m["role"] == "tool")
        .map(|m| m["tool_call_id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, vec!["call_123"]);
}
