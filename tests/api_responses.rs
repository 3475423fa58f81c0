//! OpenAI Responses (`POST /v1/responses`) through compactor against the
//! scripted Responses upstream: usage, compaction with calls and their
//! outputs paired, overflow retry (HTTP and `response.failed`), and the
//! requests that depend on server-side state passing through untouched.

// Test code: a failed unwrap is a failed test (the helpers too).
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use serde_json::value::RawValue;
use serde_json::{json, Value};
use support::apis::*;
use support::chat::{action, metric, post_path, start_proxy};

const AUTH: (&str, &str) = ("authorization", "Bearer sk-test");
const SESSION: (&str, &str) = ("session-id", "codex-1");

fn config(extra: &str) -> String {
    format!("[models.\"m\"]\ncontext_length = 2048\n{extra}")
}

/// A Codex-like item list: user message → reasoning → function_call →
/// function_call_output → assistant message, per turn.
struct Conv {
    items: Vec<Value>,
    turns: usize,
}

impl Conv {
    fn new() -> Self {
        Self {
            items: vec![
                json!({"type":"message","role":"developer","content":[{"type":"input_text","text":"Sandbox: workspace-write."}]}),
            ],
            turns: 0,
        }
    }

    fn ask(&mut self) -> Vec<Value> {
        self.turns += 1;
        let i = self.turns;
        self.items.push(json!({"type":"message","role":"user","content":[{"type":"input_text","text":format!("Step {i}: inspect file_{i}.rs and report.")}]}));
        self.items.clone()
    }

    fn answer(&mut self) {
        let i = self.turns;
        let id = format!("call_{i}");
        let line = format!("line {i}: fn item_{i}() {{ let value = {i}; }}\n");
        let output = line.repeat(600 / line.len() + 1);
        self.items.push(json!({"type":"reasoning","id":format!("rs_{i}"),"summary":[],"encrypted_content":format!("enc{i}")}));
        self.items.push(json!({"type":"function_call","call_id":id,"name":"shell","arguments":format!("{{\"cmd\":\"cat file_{i}.rs\"}}")}));
        self.items
            .push(json!({"type":"function_call_output","call_id":id,"output":output}));
        self.items.push(json!({"type":"message","role":"assistant","content":[{"type":"output_text","text":format!("file_{i}.rs defines item_{i}.")}]}));
    }
}

fn body(items: &[Value], stream: bool) -> Vec<u8> {
    let input = serde_json::to_string(items).unwrap();
    let stream = if stream { ",\"stream\":true" } else { "" };
    format!(
        "{{\"model\":\"m\", \"instructions\":\"You are Codex.\",\"temperature\":0.70,\"x_unknown\":{{\"b\":1,\"a\":[1, 2]}},\"input\":{input},\"store\":false,\"max_output_tokens\":64{stream},\"prompt_cache_key\":\"pck\"}}"
    )
    .into_bytes()
}

fn top_level(body: &[u8]) -> Vec<(String, String)> {
    let map: indexmap::IndexMap<String, Box<RawValue>> = serde_json::from_slice(body).unwrap();
    map.into_iter()
        .filter(|(k, _)| k != "input")
        .map(|(k, v)| (k, v.get().to_owned()))
        .collect()
}

fn ty(v: &Value) -> &str {
    v["type"].as_str().unwrap_or("message")
}

/// Every output answers an earlier call, every call is answered, and a
/// reasoning item is never left in front of anything but a call or an
/// assistant message.
fn assert_valid(body: &Value) {
    let items = body["input"].as_array().unwrap();
    let mut open: Vec<&str> = Vec::new();
    for (i, it) in items.iter().enumerate() {
        match ty(it) {
            "function_call" => open.push(it["call_id"].as_str().unwrap()),
            "function_call_output" => {
                let id = it["call_id"].as_str().unwrap();
                let p = open.iter().position(|o| *o == id);
                assert!(p.is_some(), "output {id} without its call");
                open.remove(p.unwrap());
            }
            "reasoning" => {
                let next = items.get(i + 1).expect("reasoning is followed");
                assert!(
                    ty(next) == "function_call" || next["role"] == "assistant",
                    "reasoning before {next}"
                );
            }
            _ => {}
        }
    }
    assert!(open.is_empty(), "calls without outputs: {open:?}");
}

async fn compaction_keeps_the_request_valid(stream: bool) {
    let mock = ApiMock::start(ApiSettings::default()).await;
    let proxy = start_proxy(&mock.url(), &config("")).await;
    let mut conv = Conv::new();
    for _ in 0..20 {
        let sent = body(&conv.ask(), stream);
        let (status, headers, resp) = post_path(
            &proxy.url(),
            "/v1/responses",
            sent.clone(),
            &[AUTH, SESSION],
        )
        .await;
        conv.answer();
        assert_eq!(status, 200, "{}", String::from_utf8_lossy(&resp));
        let seen = mock.last();
        if action(&headers) != "compacted" {
            assert_eq!(seen.body.as_ref(), sent.as_slice());
            continue;
        }
        let got = seen.json();
        let client: Value = serde_json::from_slice(&sent).unwrap();
        let (got_items, client_items) = (
            got["input"].as_array().unwrap(),
            client["input"].as_array().unwrap(),
        );
        assert!(got_items.len() < client_items.len());
        assert_valid(&got);
        assert_eq!(top_level(&seen.body), top_level(&sent));
        assert_eq!(got_items.last(), client_items.last());
        // The developer message opens the list as the client sent it.
        assert_eq!(got_items[0], client_items[0]);
        let sums = mock.summaries();
        assert!(!sums.is_empty());
        assert!(sums.iter().all(|s| s.path == "/v1/responses"));
        assert!(sums.iter().all(|s| s.json()["max_output_tokens"].is_u64()));
        return;
    }
    panic!("no compaction in 20 turns");
}

#[tokio::test]
async fn compaction_keeps_the_request_valid_json() {
    compaction_keeps_the_request_valid(false).await;
}

#[tokio::test]
async fn compaction_keeps_the_request_valid_streaming() {
    compaction_keeps_the_request_valid(true).await;
}

#[tokio::test]
async fn usage_is_read_from_json_and_from_the_stream() {
    for stream in [false, true] {
        let mock = ApiMock::start(ApiSettings::default()).await;
        let proxy = start_proxy(&mock.url(), &config("")).await;
        let sent = body(&Conv::new().ask(), stream);
        let (status, _, resp) = post_path(&proxy.url(), "/v1/responses", sent, &[AUTH]).await;
        assert_eq!(status, 200);
        if stream {
            assert!(String::from_utf8_lossy(&resp).contains("event: response.completed"));
        }
        let prompt = mock.last().prompt_tokens;
        assert!(prompt > 0);
        assert_eq!(
            metric(&proxy.url(), "compactor_upstream_prompt_tokens_total").await,
            prompt as f64,
            "stream={stream}"
        );
    }
}

async fn overflow_is_retried(stream: bool, failed_event: bool) {
    let mock = ApiMock::start(ApiSettings {
        window: Some(2048),
        failed_event,
        ..ApiSettings::default()
    })
    .await;
    let proxy = start_proxy(&mock.url(), "default_context_length = 100000\n").await;
    let mut conv = Conv::new();
    for _ in 0..25 {
        let before = mock.conversations().len();
        let sent = body(&conv.ask(), stream);
        let (status, headers, resp) = post_path(
            &proxy.url(),
            "/v1/responses",
            sent.clone(),
            &[AUTH, SESSION],
        )
        .await;
        conv.answer();
        assert_eq!(status, 200, "{}", String::from_utf8_lossy(&resp));
        let text = String::from_utf8_lossy(&resp).into_owned();
        assert!(
            !text.contains("response.failed"),
            "the client saw the failure"
        );
        let seen = &mock.conversations()[before..];
        if action(&headers) == "retried" {
            assert_eq!(seen.len(), 2, "one failed attempt, one retry");
            assert!(seen[0].overflowed && !seen[1].overflowed);
            assert_valid(&seen[1].json());
            assert_eq!(top_level(&seen[1].body), top_level(&sent));
            assert_eq!(
                metric(&proxy.url(), "compactor_overflow_retries_total").await,
                1.0
            );
            return;
        }
        assert!(
            seen.iter().all(|s| !s.overflowed),
            "overflow reached the client"
        );
    }
    panic!("never overflowed");
}

#[tokio::test]
async fn http_overflow_is_retried() {
    overflow_is_retried(false, false).await;
}

#[tokio::test]
async fn response_failed_event_is_retried() {
    overflow_is_retried(true, true).await;
}

#[tokio::test]
async fn server_side_state_passes_through_untouched() {
    let mock = ApiMock::start(ApiSettings::default()).await;
    let proxy = start_proxy(&mock.url(), &config("")).await;
    // A history far over the window: compacted if compactor owned it.
    let mut conv = Conv::new();
    for _ in 0..12 {
        conv.ask();
        conv.answer();
    }
    let long = conv.ask();
    let mut with_previous: Value = serde_json::from_slice(&body(&long, false)).unwrap();
    with_previous["previous_response_id"] = json!("resp_0");
    let mut with_reference = long.clone();
    with_reference.insert(1, json!({"type":"item_reference","id":"msg_0"}));
    let mut stored: Value = serde_json::from_slice(&body(&with_reference, false)).unwrap();
    stored["store"] = json!(true);
    for sent in [
        serde_json::to_vec(&with_previous).unwrap(),
        serde_json::to_vec(&stored).unwrap(),
        br#"{"model":"m","input":"a plain string input","max_output_tokens":8}"#.to_vec(),
    ] {
        let before = mock.seen().len();
        let (status, headers, _) = post_path(
            &proxy.url(),
            "/v1/responses",
            sent.clone(),
            &[AUTH, SESSION],
        )
        .await;
        assert_eq!(status, 200);
        assert_eq!(
            mock.seen().len(),
            before + 1,
            "one request, no summary call"
        );
        assert_eq!(mock.last().body.as_ref(), sent.as_slice());
        assert_eq!(action(&headers), "<none>", "not compactor's conversation");
    }
    // The same history without the reference is compactor's to compact.
    let (_, headers, _) = post_path(
        &proxy.url(),
        "/v1/responses",
        body(&long, false),
        &[AUTH, SESSION],
    )
    .await;
    assert_eq!(action(&headers), "compacted");
}

/// Codex 0.169 sends no `instructions`: its base prompt and its
/// permissions block are `developer` items at the head of `input`, and a
/// permissions change arrives as another one mid-session. Every request the
/// upstream gets carries each of them verbatim, in order; none reaches a
/// summary call; later turns reuse the record.
#[tokio::test]
async fn codex_developer_items_are_instructions_never_history() {
    let mock = ApiMock::start(ApiSettings::default()).await;
    let proxy = start_proxy(&mock.url(), &config("")).await;
    let dev = |tag: &str| json!({"type":"message","role":"developer","content":[{"type":"input_text","text":format!("<{tag}> rule set {tag}: never push to main.")}]});
    let mut conv = Conv::new();
    conv.items = vec![
        dev("base-prompt-1"),
        dev("permissions-2"),
        json!({"type":"message","role":"user","content":[{"type":"input_text","text":"<environment_context>cwd=/w</environment_context>"}]}),
    ];
    let (mut compacted, mut reused) = (0, 0);
    for turn in 0..24 {
        if turn == 5 {
            conv.items.push(dev("permissions-update-3"));
        }
        let sent = body(&conv.ask(), false).into_iter().collect::<Vec<u8>>();
        // No `instructions` member, as Codex sends it.
        let sent: Vec<u8> = {
            let mut v: indexmap::IndexMap<String, Value> = serde_json::from_slice(&sent).unwrap();
            v.shift_remove("instructions");
            serde_json::to_vec(&v).unwrap()
        };
        let (status, headers, resp) = post_path(
            &proxy.url(),
            "/v1/responses",
            sent.clone(),
            &[AUTH, SESSION],
        )
        .await;
        conv.answer();
        assert_eq!(status, 200, "{}", String::from_utf8_lossy(&resp));
        let got = mock.last().json();
        assert_valid(&got);
        let devs: Vec<&Value> = got["input"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|i| i["role"] == "developer")
            .collect();
        let expected: Vec<Value> = conv
            .items
            .iter()
            .filter(|i| i["role"] == "developer")
            .cloned()
            .collect();
        assert_eq!(
            devs.into_iter().cloned().collect::<Vec<_>>(),
            expected,
            "turn {turn}"
        );
        // The head stays the head.
        assert_eq!(got["input"][0], conv.items[0]);
        assert_eq!(got["input"][1], conv.items[1]);
        match action(&headers) {
            "compacted" => compacted += 1,
            "passthrough" if support::chat::replaced(&headers) > 0 => reused += 1,
            _ => {}
        }
        for s in mock.summaries() {
            assert!(
                !s.text().contains("never push to main"),
                "instructions summarised"
            );
        }
    }
    assert!(
        compacted >= 1 && reused >= 1,
        "compacted {compacted}, reused {reused}"
    );
}
