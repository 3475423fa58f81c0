#![allow(clippy::unwrap_used)]

use serde_json::json;

use super::*;
use crate::request::raw_hash;

fn raw(v: &Value) -> Box<RawValue> {
    to_raw(v).unwrap()
}

fn values(list: &[Box<RawValue>]) -> Vec<Value> {
    list.iter()
        .map(|m| serde_json::from_str(m.get()).unwrap())
        .collect()
}

const MESSAGES: &str = r#"{"model":"m", "temperature":0.70,"system":[{"type":"text","text":"S","cache_control":{"type":"ephemeral"}}],"max_tokens":64,"messages":[
 {"role":"user","content":[{"type":"text","text":"hi"}]},
 {"role":"assistant","content":[{"type":"thinking","thinking":"t","signature":"s"},{"type":"tool_use","id":"a","name":"Read","input":{"p":1}},{"type":"tool_use","id":"b","name":"Read","input":{"p":2}}]},
 {"role":"user","content":[{"type":"tool_result","tool_use_id":"a","content":"A","cache_control":{"type":"ephemeral"}},{"type":"tool_result","tool_use_id":"b","content":"B","is_error":true},{"type":"text","text":"go on"}]},
 {"role":"assistant","content":"done"}],"metadata":{"user_id":"u"}}"#;

#[test]
fn anthropic_blocks_become_engine_rows() {
    let r = ApiRequest::parse(Api::Messages, MESSAGES.as_bytes().to_vec()).unwrap();
    let rows = values(r.messages());
    let roles: Vec<&str> = rows.iter().map(role).collect();
    assert_eq!(
        roles,
        [
            "system",
            "user",
            "assistant",
            "tool",
            "tool",
            "user",
            "assistant"
        ]
    );
    assert_eq!(
        rows[2]["tool_calls"][1]["function"]["arguments"],
        "{\"p\":2}"
    );
    assert_eq!(rows[2]["content"][0]["type"], "thinking");
    assert_eq!(rows[4]["tool_call_id"], "b");
    assert_eq!(rows[5]["content"], json!([{"type":"text","text":"go on"}]));
    assert_eq!(r.max_output_tokens(), Some(64));
    assert_eq!(r.session_id().as_deref(), Some("u"));
}

#[test]
fn unchanged_rows_encode_to_the_client_bytes() {
    for (api, body) in [(Api::Messages, MESSAGES), (Api::Responses, RESPONSES)] {
        let mut r = ApiRequest::parse(api, body.as_bytes().to_vec()).unwrap();
        let rows = r.take_messages();
        r.with_messages(rows);
        // Each element is the client's bytes; only the whitespace between
        // elements goes (the array is one splice).
        let spliced = body.replace("\n ", "");
        assert_eq!(r.to_bytes(), spliced.as_bytes(), "{api:?}");
    }
}

#[test]
fn anthropic_rewritten_rows_keep_their_blocks_and_alternate() {
    let mut r = ApiRequest::parse(Api::Messages, MESSAGES.as_bytes().to_vec()).unwrap();
    let mut rows = values(&r.take_messages());
    // The engine: a summary replaces the opening user turn, tool output
    // `a` is pruned, arguments of `b` shortened.
    rows[1] = json!({"role":"user","content":"SUMMARY"});
    rows[3]["content"] = json!("[pruned]");
    rows[2]["tool_calls"][1]["function"]["arguments"] = json!("{}");
    let out: Vec<Box<RawValue>> = rows.iter().map(raw).collect();
    r.with_messages(out);
    let body: Value = serde_json::from_slice(&r.to_bytes()).unwrap();
    let msgs = body["messages"].as_array().unwrap();
    assert_eq!(msgs.len(), 4);
    assert_eq!(msgs[0], json!({"role":"user","content":"SUMMARY"}));
    // The assistant turn: thinking first, original tool_use blocks.
    assert_eq!(msgs[1]["content"][0]["type"], "thinking");
    assert_eq!(msgs[1]["content"][2]["input"], json!({}));
    assert_eq!(msgs[1]["content"][1]["input"], json!({"p":1}));
    // Both results and the text in one user message, results first, each
    // from its original block (cache marker, is_error kept).
    let user = msgs[2]["content"].as_array().unwrap();
    assert_eq!(
        user[0],
        json!({"type":"tool_result","tool_use_id":"a","content":"[pruned]","cache_control":{"type":"ephemeral"}})
    );
    assert_eq!(user[1]["is_error"], true);
    assert_eq!(user[2], json!({"type":"text","text":"go on"}));
    assert_eq!(msgs[3], json!({"role":"assistant","content":"done"}));
    // The system member and every other member: the client's bytes.
    let text = String::from_utf8(r.to_bytes().to_vec()).unwrap();
    assert!(text.starts_with(r#"{"model":"m", "temperature":0.70,"system":[{"type":"text","text":"S","cache_control":{"type":"ephemeral"}}],"max_tokens":64,"messages":["#));
    assert!(text.ends_with(r#"],"metadata":{"user_id":"u"}}"#));
}

#[test]
fn anthropic_changed_system_rewrites_only_the_system_member() {
    let mut r = ApiRequest::parse(Api::Messages, MESSAGES.as_bytes().to_vec()).unwrap();
    let mut rows = r.take_messages();
    rows[0] = raw(&json!({"role":"system","content":"S2"}));
    r.with_messages(rows);
    let body: Value = serde_json::from_slice(&r.to_bytes()).unwrap();
    assert_eq!(body["system"], json!("S2"));
    assert_eq!(body["messages"].as_array().unwrap().len(), 4);
}

#[test]
fn anthropic_cache_markers_stay_within_four() {
    let mut r = ApiRequest::parse(Api::Messages, MESSAGES.as_bytes().to_vec()).unwrap();
    let rows = r.take_messages();
    // Five converted user turns with a marker each, after the kept ones
    // (the system's and the tool result's already count two).
    let mut out: Vec<Box<RawValue>> = rows.to_vec();
    for i in 0..5 {
        out.push(raw(&json!({"role":"assistant","content":format!("a{i}")})));
        out.push(raw(&json!({"role":"user","content":[{"type":"text","text":format!("u{i}"),"cache_control":{"type":"ephemeral"}}]})));
    }
    r.with_messages(out);
    let body: Value = serde_json::from_slice(&r.to_bytes()).unwrap();
    let total = anthropic::count_cache_control(&body);
    assert_eq!(total, anthropic::MAX_CACHE_CONTROL);
    // The newest markers are the ones kept.
    let msgs = body["messages"].as_array().unwrap();
    assert!(msgs.last().unwrap()["content"][0]
        .get("cache_control")
        .is_some());
    assert!(msgs[5]["content"][0].get("cache_control").is_none());
}

#[test]
fn claude_code_metadata_session_ids() {
    let m = |s: &str| anthropic::metadata_session(&raw(&json!({"user_id": s})));
    let modern = json!({"device_id":"d","account_uuid":"a","session_id":"s1"}).to_string();
    assert_eq!(m(&modern).as_deref(), Some("s1"));
    assert_eq!(m("user_abc_account_x_session_s2").as_deref(), Some("s2"));
    assert_eq!(m("plain").as_deref(), Some("plain"));
    assert_eq!(m(""), None);
}

const RESPONSES: &str = r#"{"model":"m","instructions":"I","input":[
 {"role":"user","content":"hi"},
 {"type":"reasoning","id":"rs_1","summary":[]},
 {"type":"function_call","call_id":"a","name":"f","arguments":"{\"x\":1}"},
 {"type":"function_call","call_id":"b","name":"f","arguments":"{}"},
 {"type":"function_call_output","call_id":"a","output":"A"},
 {"type":"function_call_output","call_id":"b","output":"B"},
 {"type":"web_search_call","id":"ws_1","status":"completed"},
 {"type":"message","role":"assistant","content":[{"type":"output_text","text":"done"}]},
 {"type":"reasoning","id":"rs_2","summary":[]}],"max_output_tokens":9,"prompt_cache_key":"k"}"#;

#[test]
fn responses_items_become_engine_rows() {
    let r = ApiRequest::parse(Api::Responses, RESPONSES.as_bytes().to_vec()).unwrap();
    let rows = values(r.messages());
    let roles: Vec<&str> = rows.iter().map(role).collect();
    assert_eq!(
        roles,
        ["system", "user", "assistant", "tool", "tool", "assistant"]
    );
    // Parallel calls are one assistant row (with the reasoning before them).
    assert_eq!(rows[2]["tool_calls"].as_array().unwrap().len(), 2);
    assert_eq!(rows[5]["content"], json!([{"type":"text","text":"done"}]));
    assert_eq!(r.max_output_tokens(), Some(9));
    assert_eq!(r.prompt_cache_key().as_deref(), Some("k"));
    assert_eq!(r.session_id(), None);
}

#[test]
fn responses_rewritten_rows_keep_their_items() {
    let mut r = ApiRequest::parse(Api::Responses, RESPONSES.as_bytes().to_vec()).unwrap();
    let mut rows = values(&r.take_messages());
    rows[1] = json!({"role":"user","content":"SUMMARY"});
    rows[3]["content"] = json!("[pruned]");
    r.with_messages(rows.iter().map(raw).collect());
    let body: Value = serde_json::from_slice(&r.to_bytes()).unwrap();
    let items = body["input"].as_array().unwrap();
    assert_eq!(body["instructions"], "I");
    assert_eq!(
        items[0],
        json!({"type":"message","role":"user","content":"SUMMARY"})
    );
    // The call group is the client's items, reasoning included.
    assert_eq!(items[1]["id"], "rs_1");
    assert_eq!(items[2]["call_id"], "a");
    assert_eq!(
        items[4],
        json!({"type":"function_call_output","call_id":"a","output":"[pruned]"})
    );
    // The web search item travels with the output before the message, the
    // trailing reasoning with the message.
    assert_eq!(items[6]["type"], "web_search_call");
    assert_eq!(items.last().unwrap()["id"], "rs_2");
    assert_eq!(items.len(), 9);
}

#[test]
fn responses_with_server_state_are_not_decoded() {
    for body in [
        r#"{"model":"m","previous_response_id":"resp_1","input":[{"role":"user","content":"hi"}]}"#,
        r#"{"model":"m","conversation":"conv_1","input":[{"role":"user","content":"hi"}]}"#,
        r#"{"model":"m","input":[{"type":"item_reference","id":"msg_1"},{"role":"user","content":"hi"}]}"#,
    ] {
        assert!(matches!(
            ApiRequest::parse(Api::Responses, body.as_bytes().to_vec()),
            Err(DecodeError::ServerState)
        ));
    }
    assert!(matches!(
        ApiRequest::parse(Api::Responses, br#"{"model":"m","input":"hi"}"#.to_vec()),
        Err(DecodeError::Parse(_))
    ));
    // `null` is no server state.
    let ok =
        r#"{"model":"m","previous_response_id":null,"input":[{"role":"user","content":"hi"}]}"#;
    assert!(ApiRequest::parse(Api::Responses, ok.as_bytes().to_vec()).is_ok());
}

#[test]
fn responses_refusals_keep_their_reason_whatever_item_the_walk_meets_first() {
    // The walk meets the unsupported role first; the item reference further
    // on is still what refuses the request, as when every item was parsed
    // before the walk.
    let body = r#"{"model":"m","input":[{"role":"tool","content":"x"},{"type":"item_reference","id":"msg_1"}]}"#;
    assert!(matches!(
        ApiRequest::parse(Api::Responses, body.as_bytes().to_vec()),
        Err(DecodeError::ServerState)
    ));
    let body =
        r#"{"model":"m","input":[{"role":"user","content":"hi"},{"role":"tool","content":"x"}]}"#;
    assert!(matches!(
        ApiRequest::parse(Api::Responses, body.as_bytes().to_vec()),
        Err(DecodeError::UnsupportedRole {
            member: "input",
            ..
        })
    ));
}

#[test]
fn decoded_messages_are_canonical_and_chain_as_the_client_chain_would() {
    let responses = r#"{"model":"m","instructions":"S","input":[
     {"role":"user","content":[{"type":"input_text","text":"hi \u00e9 \"q\""}]},
     {"type":"reasoning","id":"r","summary":[]},
     {"type":"function_call","call_id":"c","name":"f","arguments":"{\"z\":1,\"a\":2.50}"},
     {"type":"function_call_output","call_id":"c","output":"out"}]}"#;
    for (api, body) in [(Api::Messages, MESSAGES), (Api::Responses, responses)] {
        let r = ApiRequest::parse(api, body.as_bytes().to_vec()).unwrap();
        assert!(r.canonical());
        for (m, h) in r.messages().iter().zip(&r.map.engine_hashes) {
            let mut canonical = Vec::new();
            crate::request::write_canonical(
                &serde_json::from_str(m.get()).unwrap(),
                &mut canonical,
            );
            assert_eq!(m.get().as_bytes(), canonical.as_slice(), "{api:?}");
            assert_eq!(*h, message_hash(m));
        }
        // Hashed as they are, the chain is the one a parse would give.
        let mut cache = crate::request::ChainCache::new();
        assert_eq!(
            cache.chain_as(r.messages(), true),
            crate::request::message_hashes(r.messages()).as_slice()
        );
    }
    assert!(
        !ApiRequest::parse(Api::Chat, br#"{"messages":[]}"#.to_vec())
            .unwrap()
            .canonical()
    );
}

/// A rough estimate for the tests: the decode keeps one per engine message.
fn rough_len(v: &Value) -> u64 {
    v.to_string().len() as u64
}

/// Everything a decode gives the chat path, in a comparable form.
fn decoded_state(r: &ApiRequest) -> String {
    let mut calls: Vec<_> = r.map.calls.iter().collect();
    calls.sort();
    let mut results: Vec<_> = r.map.results.iter().collect();
    results.sort();
    let wire_counts: Vec<usize> = (0..=r.messages().len()).map(|k| r.wire_count(k)).collect();
    let engine: Vec<&str> = r.messages().iter().map(|m| m.get()).collect();
    format!(
        "{engine:?}\n{:?}\n{:?}\n{:?}\n{:?}\n{:?}\n{:?}\n{:?}\n{calls:?}\n{results:?}\n{wire_counts:?}",
        r.raw_hashes(),
        r.map.wire_roles,
        r.rough(),
        r.map.groups,
        r.map.engine_hashes,
        r.map.system_hash,
        r.map.system_cc,
    )
}

/// Decodes `body`, bypassing the memo when `reference`.
fn decode_for_test(api: Api, body: &str, reference: bool) -> (ApiRequest, Option<usize>) {
    BYPASS.set(reference);
    let r = ApiRequest::parse_with(api, body.as_bytes().to_vec(), Some(rough_len)).unwrap();
    BYPASS.set(false);
    (r, RESUMED_AT.get())
}

#[test]
fn a_decode_resumed_from_a_kept_prefix_equals_a_full_decode() {
    // A marker of this test's own, so no other test's decodes are resumed.
    let messages = [
        r#"{"role":"user","content":"memo-test: read a.rs"}"#,
        r#"{"role":"assistant","content":[{"type":"thinking","thinking":"t","signature":"s"},{"type":"tool_use","id":"m1","name":"Read","input":{"p":"a.rs"}},{"type":"tool_use","id":"m2","name":"Read","input":{"p":"b.rs"}}]}"#,
        r#"{"role":"user","content":[{"type":"tool_result","tool_use_id":"m1","content":"A","cache_control":{"type":"ephemeral"}},{"type":"tool_result","tool_use_id":"m2","content":"B"},{"type":"text","text":"go on"}]}"#,
        r#"{"role":"assistant","content":"done"}"#,
        r#"{"role":"system","content":"env: linux"}"#,
        r#"{"role":"user","content":[{"type":"text","text":"now b"}]}"#,
        r#"{"role":"assistant","content":[{"type":"tool_use","id":"m3","name":"Edit","input":{}}]}"#,
        r#"{"role":"user","content":[{"type":"tool_result","tool_use_id":"m3","content":[{"type":"text","text":"ok"}]}]}"#,
    ];
    let items = [
        r#"{"role":"user","content":"memo-test: read a.rs"}"#,
        r#"{"type":"message","role":"assistant","content":[{"type":"output_text","text":"reading"}]}"#,
        r#"{"type":"function_call","call_id":"r1","name":"read","arguments":"{\"p\":1}"}"#,
        r#"{"type":"function_call","call_id":"r2","name":"read","arguments":"{\"p\":2}"}"#,
        r#"{"type":"function_call_output","call_id":"r1","output":"A"}"#,
        r#"{"type":"function_call_output","call_id":"r2","output":[{"type":"input_text","text":"B"}]}"#,
        r#"{"type":"reasoning","id":"rs1","summary":[]}"#,
        r#"{"type":"function_call","call_id":"r3","name":"edit","arguments":"{}"}"#,
        r#"{"type":"function_call_output","call_id":"r3","output":"ok"}"#,
        r#"{"type":"message","role":"assistant","content":[{"type":"output_text","text":"done"}]}"#,
        r#"{"type":"message","role":"user","content":[{"type":"input_text","text":"thanks"}]}"#,
        r#"{"type":"reasoning","id":"rs2","summary":[]}"#,
    ];
    type BodyOf = fn(&str) -> String;
    let cases: [(Api, &[&str], BodyOf); 2] = [
        (Api::Messages, &messages, |list| {
            format!(r#"{{"model":"m","system":"You help.","max_tokens":9,"messages":[{list}]}}"#)
        }),
        (Api::Responses, &items, |list| {
            format!(r#"{{"model":"m","instructions":"You help.","input":[{list}]}}"#)
        }),
    ];
    for (api, list, body_of) in cases {
        let mut resumed = 0;
        for k in 1..=list.len() {
            let body = body_of(&list[..k].join(","));
            let (full, _) = decode_for_test(api, &body, true);
            let (memo, at) = decode_for_test(api, &body, false);
            assert_eq!(
                decoded_state(&memo),
                decoded_state(&full),
                "{api:?}, {k} items"
            );
            // The raw hashes read off the decode's own are the messages',
            // and the roles it recorded (Messages) the wire messages'.
            for r in [&full, &memo] {
                let made: Vec<u64> = r.messages().iter().map(|m| raw_hash(m)).collect();
                assert_eq!(r.raw_hashes(), made.as_slice(), "{api:?}, {k} items");
                if api == Api::Messages {
                    let roles: Vec<&str> = list[..k]
                        .iter()
                        .map(|m| {
                            role_label(serde_json::from_str::<Value>(m).unwrap()["role"].as_str())
                        })
                        .collect();
                    assert_eq!(r.map.wire_roles, roles, "{k} messages");
                }
            }
            // What an unchanged conversation sends is the client's body.
            let mut memo = memo;
            let rows = memo.messages().to_vec();
            memo.with_messages(rows);
            assert_eq!(memo.to_bytes(), body.as_bytes(), "{api:?}, {k} items");
            if let Some(at) = at {
                assert!(at <= k, "{api:?}: resumed at {at} of {k}");
                resumed += 1;
            }
        }
        // Every request after the first resumes: where a decode may not be
        // resumed from its end (Responses: after an assistant message, or
        // trailing reasoning), it is kept as it stood at its last cut.
        assert_eq!(resumed, list.len() - 1, "{api:?}");
    }
}

/// A Messages body of `n` alternating messages, each text led by `marker`
/// (a test's own: the memo is shared by the tests running at once).
fn messages_turn(marker: &str, n: usize) -> String {
    let list: Vec<String> = (0..n)
        .map(|i| {
            let role = if i % 2 == 0 { "user" } else { "assistant" };
            format!(r#"{{"role":"{role}","content":"{marker} {i}"}}"#)
        })
        .collect();
    format!(
        r#"{{"model":"m","max_tokens":9,"messages":[{}]}}"#,
        list.join(",")
    )
}

#[test]
fn messages_resume_where_the_previous_request_ended() {
    let turn = |n: usize| messages_turn("memo-resume", n);
    assert_eq!(decode_for_test(Api::Messages, &turn(3), false).1, None);
    assert_eq!(decode_for_test(Api::Messages, &turn(5), false).1, Some(3));
    assert_eq!(decode_for_test(Api::Messages, &turn(5), false).1, Some(5));
    assert_eq!(decode_for_test(Api::Messages, &turn(7), false).1, Some(5));
    // A different system member is a different conversation.
    let other = turn(5).replace(r#""max_tokens":9,"#, r#""system":"x","max_tokens":9,"#);
    assert_eq!(decode_for_test(Api::Messages, &other, false).1, None);
}

#[test]
fn a_decode_is_kept_once_its_request_is_dropped_with_its_messages() {
    let turn = |n: usize| messages_turn("memo-drop", n);
    let (first, at) = decode_for_test(Api::Messages, &turn(3), false);
    assert_eq!(at, None);
    // The first request is not done: its decode is not kept yet.
    let (mut second, at) = decode_for_test(Api::Messages, &turn(4), false);
    assert_eq!(at, None);
    // Dropped without its messages (taken, not put back): not kept.
    drop(second.take_messages());
    drop(second);
    assert_eq!(decode_for_test(Api::Messages, &turn(4), false).1, None);
    // That one was dropped whole (kept at 4), and now the first (at 3):
    // the longest is resumed.
    drop(first);
    assert_eq!(decode_for_test(Api::Messages, &turn(5), false).1, Some(4));
}

#[test]
fn the_memo_stays_within_its_budget_and_forgets_the_least_recent_first() {
    let memo = memo::Memo::new(64 * 1024);
    let out = |bytes: usize| vec![raw(&json!("x".repeat(bytes)))];
    for key in 0..40u128 {
        memo.store(key, 1, out(4000), WireMap::default());
        assert!(memo.held_bytes() <= 64 * 1024, "{}", memo.held_bytes());
    }
    let chain = |key: u128| [0, key];
    assert!(memo.take(&chain(0)).is_none(), "the oldest is gone");
    // 4,320 bytes an entry: 15 fit, keys 25 to 39. Used (taken over and
    // kept again), the oldest outlives the next one, which was not.
    assert!(memo.take(&chain(24)).is_none());
    assert!(memo.take(&chain(25)).is_some());
    assert!(
        memo.take(&chain(25)).is_none(),
        "taken over, until kept again"
    );
    memo.store(25, 1, out(4000), WireMap::default());
    memo.store(40, 1, out(4000), WireMap::default());
    assert!(memo.take(&chain(26)).is_none());
    assert!(memo.take(&chain(25)).is_some());
    assert!(memo.take(&chain(40)).is_some(), "the newest is kept");
    // An entry over a quarter of the budget is not kept at all.
    memo.store(500, 1, out(20_000), WireMap::default());
    assert!(memo.take(&chain(500)).is_none());
    // The longest kept prefix of the input is the one taken.
    memo.store(600, 1, out(10), WireMap::default());
    memo.store(601, 2, out(10), WireMap::default());
    assert_eq!(memo.take(&[0, 600, 601]).map(|p| p.wire_len), Some(2));
    assert_eq!(memo.take(&[0, 600, 601]).map(|p| p.wire_len), Some(1));
}
