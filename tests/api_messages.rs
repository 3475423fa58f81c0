//! Anthropic Messages (`POST /v1/messages`) through compactor against the
//! scripted Anthropic upstream: usage, compaction with a valid request
//! shape, overflow retry, passthrough and session keys.

// Test code: a failed unwrap is a failed test (the helpers too).
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use serde_json::value::RawValue;
use serde_json::{json, Value};
use support::apis::*;
use support::chat::{action, metric, post_path, replaced, session_of, start_proxy};

const KEY: (&str, &str) = ("x-api-key", "sk-ant-test");
const VERSION: (&str, &str) = ("anthropic-version", "2023-06-01");
const SESSION: (&str, &str) = ("x-claude-code-session-id", "c0ffee");

fn config(extra: &str) -> String {
    format!("[models.\"m\"]\ncontext_length = 2048\n{extra}")
}

/// A Claude Code-like conversation: system blocks with cache markers, then
/// turns of user text → assistant thinking + text + tool_use → user
/// tool_result → assistant text.
struct Conv {
    messages: Vec<Value>,
    turns: usize,
}

const SYSTEM: &str = r#"[{"type":"text","text":"You are Claude Code.","cache_control":{"type":"ephemeral"}},{"type":"text","text":"Be careful."}]"#;

impl Conv {
    fn new() -> Self {
        Self {
            messages: Vec::new(),
            turns: 0,
        }
    }

    fn ask(&mut self) -> Vec<Value> {
        self.turns += 1;
        let i = self.turns;
        self.messages.push(json!({"role":"user","content":[{"type":"text","text":format!("Step {i}: inspect file_{i}.rs and report.")}]}));
        // Claude Code marks the newest user turn for caching.
        let mut sent = self.messages.clone();
        if let Some(last) = sent.last_mut() {
            last["content"][0]["cache_control"] = json!({"type":"ephemeral"});
        }
        sent
    }

    fn answer(&mut self) {
        let i = self.turns;
        let id = format!("toolu_{i}");
        let line = format!("line {i}: fn item_{i}() {{ let value = {i}; }}\n");
        let output = line.repeat(600 / line.len() + 1);
        self.messages.push(json!({"role":"assistant","content":[
            {"type":"thinking","thinking":format!("I should read file_{i}.rs."),"signature":format!("sig{i}")},
            {"type":"text","text":"Reading it."},
            {"type":"tool_use","id":id,"name":"Read","input":{"path":format!("file_{i}.rs")}}]}));
        self.messages.push(json!({"role":"user","content":[{"type":"tool_result","tool_use_id":id,"content":output}]}));
        self.messages.push(json!({"role":"assistant","content":[{"type":"text","text":format!("file_{i}.rs defines item_{i}.")}]}));
    }
}

/// A body with members compactor must not touch, oddly formatted.
fn body(messages: &[Value], stream: bool) -> Vec<u8> {
    let msgs = serde_json::to_string(messages).unwrap();
    let stream = if stream { ",\"stream\":true" } else { "" };
    format!(
        "{{\"model\":\"m\", \"temperature\":0.70,\"x_unknown\":{{\"b\":1,\"a\":[1, 2]}},\"system\":{SYSTEM},\"max_tokens\":64,\"messages\":{msgs}{stream},\"metadata\":{{\"user_id\":\"u\"}}}}"
    )
    .into_bytes()
}

fn top_level(body: &[u8]) -> Vec<(String, String)> {
    let map: indexmap::IndexMap<String, Box<RawValue>> = serde_json::from_slice(body).unwrap();
    map.into_iter()
        .filter(|(k, _)| k != "messages")
        .map(|(k, v)| (k, v.get().to_owned()))
        .collect()
}

fn cache_markers(v: &Value) -> usize {
    match v {
        Value::Object(o) => {
            usize::from(o.contains_key("cache_control"))
                + o.values().map(cache_markers).sum::<usize>()
        }
        Value::Array(a) => a.iter().map(cache_markers).sum(),
        _ => 0,
    }
}

fn blocks(m: &Value) -> Vec<Value> {
    match &m["content"] {
        Value::String(s) => vec![json!({"type":"text","text":s})],
        Value::Array(a) => a.clone(),
        _ => Vec::new(),
    }
}

fn ids(m: &Value, ty: &str, key: &str) -> Vec<String> {
    blocks(m)
        .iter()
        .filter(|b| b["type"] == ty)
        .map(|b| b[key].as_str().unwrap().to_owned())
        .collect()
}

/// What Anthropic checks: user first, strict alternation, every tool_use
/// answered by a tool_result in the very next (user) message, results
/// first there and never without their call, at most 4 cache markers.
fn assert_valid(body: &Value) {
    let msgs = body["messages"].as_array().unwrap();
    assert_eq!(msgs[0]["role"], "user", "first message is a user turn");
    for (i, m) in msgs.iter().enumerate() {
        let role = m["role"].as_str().unwrap();
        assert!(role == "user" || role == "assistant", "role {role}");
        if i > 0 {
            assert_ne!(msgs[i - 1]["role"], m["role"], "alternation at {i}");
        }
        let results = ids(m, "tool_result", "tool_use_id");
        if !results.is_empty() {
            let calls = if i > 0 {
                ids(&msgs[i - 1], "tool_use", "id")
            } else {
                vec![]
            };
            for r in &results {
                assert!(calls.contains(r), "tool_result {r} without its tool_use");
            }
            let b = blocks(m);
            let first_other = b.iter().position(|b| b["type"] != "tool_result");
            if let Some(p) = first_other {
                assert!(
                    b[p..].iter().all(|b| b["type"] != "tool_result"),
                    "results first"
                );
            }
        }
        let calls = ids(m, "tool_use", "id");
        if !calls.is_empty() {
            let next = msgs.get(i + 1).expect("tool_use is answered");
            let answered = ids(next, "tool_result", "tool_use_id");
            for c in &calls {
                assert!(answered.contains(c), "tool_use {c} unanswered");
            }
        }
    }
    let markers = cache_markers(&body["messages"]) + cache_markers(&body["system"]);
    assert!(markers <= 4, "{markers} cache_control markers");
}

async fn until_compacted(
    stream: bool,
) -> (ApiMock, compactor::server::RunningServer, Conv, Vec<u8>) {
    let mock = ApiMock::start(ApiSettings::default()).await;
    let proxy = start_proxy(&mock.url(), &config("")).await;
    let mut conv = Conv::new();
    for _ in 0..20 {
        let sent = body(&conv.ask(), stream);
        let (status, headers, resp) = post_path(
            &proxy.url(),
            "/v1/messages",
            sent.clone(),
            &[KEY, VERSION, SESSION],
        )
        .await;
        conv.answer();
        assert_eq!(status, 200, "{}", String::from_utf8_lossy(&resp));
        if action(&headers) == "compacted" {
            return (mock, proxy, conv, sent);
        }
        // Below the threshold the client's bytes go as they are.
        assert_eq!(mock.last().body.as_ref(), sent.as_slice());
    }
    panic!("no compaction in 20 turns");
}

async fn compaction_keeps_the_request_valid(stream: bool) {
    let (mock, proxy, mut conv, sent) = until_compacted(stream).await;
    let seen = mock.last();
    let got = seen.json();
    let client: Value = serde_json::from_slice(&sent).unwrap();
    assert!(
        got["messages"].as_array().unwrap().len() < client["messages"].as_array().unwrap().len()
    );
    assert_valid(&got);
    // Every member but `messages` is the client's bytes, in order: the
    // system blocks with their cache marker included.
    assert_eq!(top_level(&seen.body), top_level(&sent));
    // The newest turns are the client's own messages, byte for byte.
    let client_msgs = client["messages"].as_array().unwrap();
    let last = serde_json::to_string(client_msgs.last().unwrap()).unwrap();
    assert!(seen.text().contains(&last), "newest message kept verbatim");
    assert_eq!(
        got["messages"].as_array().unwrap().last(),
        client_msgs.last()
    );
    // The summary was asked in the same API, with the client's headers.
    let sums = mock.summaries();
    assert!(!sums.is_empty());
    for s in &sums {
        assert_eq!(s.path, "/v1/messages");
        assert!(s.json()["max_tokens"].as_u64().is_some());
        assert_eq!(s.headers["anthropic-version"], VERSION.1);
        assert_eq!(s.headers["x-api-key"], KEY.1);
    }
    // Thinking stays with its assistant turn wherever a tool_use is kept,
    // and opens it (also where the summary was merged into the turn).
    for m in got["messages"].as_array().unwrap() {
        if !ids(m, "tool_use", "id").is_empty() {
            assert_eq!(blocks(m)[0]["type"], "thinking", "{m}");
        }
    }
    // Later turns substitute the record: the compacted prefix goes as the
    // same bytes each time (Anthropic's prompt cache keeps hitting).
    let mut prefixes = Vec::new();
    for _ in 0..2 {
        let sent = body(&conv.ask(), stream);
        let (status, headers, _) =
            post_path(&proxy.url(), "/v1/messages", sent, &[KEY, VERSION, SESSION]).await;
        conv.answer();
        assert_eq!(status, 200);
        if action(&headers) != "passthrough" {
            return;
        }
        assert!(replaced(&headers) > 0);
        let got = mock.last().json();
        assert_valid(&got);
        prefixes.push(got["messages"][0].clone());
    }
    assert_eq!(prefixes[0], prefixes[1]);
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
        let mut conv = Conv::new();
        let sent = body(&conv.ask(), stream);
        let (status, _, resp) =
            post_path(&proxy.url(), "/v1/messages", sent, &[KEY, SESSION]).await;
        assert_eq!(status, 200);
        let text = String::from_utf8_lossy(&resp);
        if stream {
            assert!(text.ends_with("event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n"));
        }
        let prompt = mock.last().prompt_tokens;
        let (input, creation, read) = anthropic_split(prompt);
        assert!(creation > 0 && read > 0 && input < prompt);
        // The prompt is input + cache creation + cache read.
        assert_eq!(
            metric(&proxy.url(), "compactor_upstream_prompt_tokens_total").await,
            prompt as f64,
            "stream={stream}"
        );
    }
}

#[tokio::test]
async fn overflow_is_learned_and_retried() {
    for stream in [false, true] {
        let mock = ApiMock::start(ApiSettings {
            window: Some(2048),
            ..ApiSettings::default()
        })
        .await;
        let proxy = start_proxy(&mock.url(), "default_context_length = 100000\n").await;
        let mut conv = Conv::new();
        let mut retried = false;
        for _ in 0..25 {
            let before = mock.conversations().len();
            let sent = body(&conv.ask(), stream);
            let (status, headers, resp) =
                post_path(&proxy.url(), "/v1/messages", sent.clone(), &[KEY, SESSION]).await;
            conv.answer();
            assert_eq!(status, 200, "{}", String::from_utf8_lossy(&resp));
            let seen = &mock.conversations()[before..];
            if action(&headers) == "retried" {
                assert_eq!(seen.len(), 2, "one failed attempt, one retry");
                assert!(seen[0].overflowed && !seen[1].overflowed);
                assert_eq!(seen[0].body.as_ref(), sent.as_slice());
                assert_valid(&seen[1].json());
                assert_eq!(top_level(&seen[1].body), top_level(&sent));
                retried = true;
                break;
            }
            assert!(
                seen.iter().all(|s| !s.overflowed),
                "overflow reached the client"
            );
        }
        assert!(retried, "stream={stream}: never overflowed");
        assert_eq!(
            metric(&proxy.url(), "compactor_overflow_retries_total").await,
            1.0
        );
    }
}

#[tokio::test]
async fn count_tokens_and_headers_pass_through() {
    let mock = ApiMock::start(ApiSettings::default()).await;
    let proxy = start_proxy(&mock.url(), &config("")).await;
    let beta = ("anthropic-beta", "prompt-caching-2024-07-31");
    let sent = body(&Conv::new().ask(), false);
    let (status, _, resp) = post_path(
        &proxy.url(),
        "/v1/messages/count_tokens",
        sent.clone(),
        &[KEY, VERSION, beta],
    )
    .await;
    assert_eq!(status, 200);
    let seen = mock.seen().pop().unwrap();
    assert_eq!(seen.path, "/v1/messages/count_tokens");
    assert_eq!(seen.body.as_ref(), sent.as_slice());
    let counted: Value = serde_json::from_slice(&resp).unwrap();
    assert_eq!(counted["input_tokens"].as_u64(), Some(seen.prompt_tokens));
    let (status, _, _) = post_path(
        &proxy.url(),
        "/v1/messages",
        sent.clone(),
        &[KEY, VERSION, beta],
    )
    .await;
    assert_eq!(status, 200);
    let seen = mock.last();
    assert_eq!(seen.body.as_ref(), sent.as_slice());
    for (k, v) in [KEY, VERSION, beta] {
        assert_eq!(seen.headers[k], v, "{k}");
    }
}

#[tokio::test]
async fn claude_code_session_ids_key_conversations() {
    let mock = ApiMock::start(ApiSettings::default()).await;
    let proxy = start_proxy(&mock.url(), &config("")).await;
    let msgs = Conv::new().ask();
    let with_user = |user_id: &str| {
        let mut v: Value = serde_json::from_slice(&body(&msgs, false)).unwrap();
        v["metadata"]["user_id"] = json!(user_id);
        serde_json::to_vec(&v).unwrap()
    };
    let key = |b: Vec<u8>, h: Vec<(&'static str, &'static str)>| {
        let url = proxy.url();
        async move {
            let (status, headers, _) = post_path(&url, "/v1/messages", b, &h).await;
            assert_eq!(status, 200);
            session_of(&headers)
        }
    };
    let json_id = |s: &str| json!({"device_id":"d","account_uuid":"a","session_id":s}).to_string();
    let a = key(with_user(&json_id("s-a")), vec![KEY]).await;
    let a_again = key(with_user(&json_id("s-a")), vec![KEY]).await;
    let b = key(with_user(&json_id("s-b")), vec![KEY]).await;
    assert_eq!(a, a_again);
    assert_ne!(
        a, b,
        "metadata.user_id's session_id separates conversations"
    );
    // The older form ends in `_session_<id>`.
    let old = key(with_user("user_h_account_x_session_s-a"), vec![KEY]).await;
    assert_eq!(old, a);
    // The header wins over the body; the agent id separates subagents.
    let h1 = key(with_user(&json_id("s-a")), vec![KEY, SESSION]).await;
    let h2 = key(with_user(&json_id("s-b")), vec![KEY, SESSION]).await;
    assert_eq!(h1, h2);
    let sub = key(
        with_user(&json_id("s-a")),
        vec![KEY, SESSION, ("x-claude-code-agent-id", "agent-1")],
    )
    .await;
    assert_ne!(sub, h1);
    // x-api-key is the credential: another key, another conversation.
    let other = key(
        with_user(&json_id("s-a")),
        vec![("x-api-key", "sk-ant-other")],
    )
    .await;
    assert_ne!(other, a);
}

/// Claude Code's environment block: a system message inside `messages`,
/// right after the first user message.
const ENV_BLOCK: &str = "# Environment (env-block-7731)\nWorking directory: /home/user/project\nPlatform: linux\nToday's date: 2026-12-02";

fn with_env_block(mut msgs: Vec<Value>) -> Vec<Value> {
    msgs.insert(1, json!({"role": "system", "content": ENV_BLOCK}));
    msgs
}

/// Claude Code's system message inside `messages` is accepted: the
/// conversation is compacted, and every request the upstream gets carries
/// the block verbatim, after the first message (or next to the summary
/// that replaced it), never in the summary. The top-level `system` keeps
/// its bytes.
#[tokio::test]
async fn claude_code_system_message_in_messages_is_kept_where_it_stands() {
    let mock = ApiMock::start(ApiSettings::default()).await;
    let proxy = start_proxy(&mock.url(), &config("")).await;
    let env_row = serde_json::to_string(&json!({"role": "system", "content": ENV_BLOCK})).unwrap();
    let mut conv = Conv::new();
    let mut compacted = 0;
    let mut reused = 0;
    for turn in 0..24 {
        let sent = body(&with_env_block(conv.ask()), false);
        let (status, headers, resp) = post_path(
            &proxy.url(),
            "/v1/messages",
            sent.clone(),
            &[KEY, VERSION, SESSION],
        )
        .await;
        conv.answer();
        assert_eq!(status, 200, "{}", String::from_utf8_lossy(&resp));
        let seen = mock.last();
        assert_eq!(top_level(&seen.body), top_level(&sent), "turn {turn}");
        let got = seen.json();
        let msgs = got["messages"].as_array().unwrap();
        let env: Vec<usize> = (0..msgs.len())
            .filter(|&i| msgs[i]["role"] == "system")
            .collect();
        assert_eq!(env.len(), 1, "turn {turn}: one system message in {got}");
        // Where it stood: after the first message, or, once that message is
        // in the summary, next to the summary; never after a kept turn.
        assert!(
            env[0] <= 1,
            "turn {turn}: the environment block moved: {}",
            serde_json::to_string_pretty(&got["messages"]).unwrap()
        );
        assert!(seen.text().contains(&env_row), "turn {turn}: its bytes");
        match action(&headers) {
            "compacted" => {
                compacted += 1;
                // The compaction turn says so; the header counts records
                // substituted from earlier turns.
                assert_eq!(replaced(&headers), 0);
            }
            "passthrough" if replaced(&headers) > 0 => {
                reused += 1;
                let client: Value = serde_json::from_slice(&sent).unwrap();
                assert!(replaced(&headers) < client["messages"].as_array().unwrap().len());
            }
            _ => {}
        }
        for s in mock.summaries() {
            let t = s.text();
            assert!(!t.contains("env-block-7731"), "env block summarised: {t}");
        }
    }
    assert!(compacted >= 1, "never compacted");
    assert!(reused >= 1, "no later turn reused a record");
}

/// compactor's own errors on the Messages route are in Anthropic's shape.
#[tokio::test]
async fn compactor_errors_on_messages_are_in_anthropic_shape() {
    let mock = ApiMock::start(ApiSettings::default()).await;
    let proxy = start_proxy(
        &mock.url(),
        &format!("max_body_bytes = 2000\n{}", config("")),
    )
    .await;
    let big = body(
        &[json!({"role": "user", "content": "x".repeat(4000)})],
        false,
    );
    let (status, _, resp) = post_path(&proxy.url(), "/v1/messages", big.clone(), &[KEY]).await;
    assert_eq!(status, 413);
    let v: Value = serde_json::from_slice(&resp).unwrap();
    assert_eq!(v["type"], "error", "{v}");
    assert_eq!(v["error"]["type"], "request_too_large");
    assert!(v["error"]["message"].is_string());
    // The chat route keeps OpenAI's shape.
    let (status, _, resp) = post_path(&proxy.url(), "/v1/chat/completions", big, &[]).await;
    assert_eq!(status, 413);
    let v: Value = serde_json::from_slice(&resp).unwrap();
    assert_eq!(v["error"]["code"], "request_too_large", "{v}");
    // An unreachable upstream, the same.
    let dead = start_proxy("http://127.0.0.1:9", &config("")).await;
    let small = body(&Conv::new().ask(), false);
    let (status, _, resp) = post_path(&dead.url(), "/v1/messages", small, &[KEY]).await;
    assert_eq!(status, 502);
    let v: Value = serde_json::from_slice(&resp).unwrap();
    assert_eq!(
        (v["type"].as_str(), v["error"]["type"].as_str()),
        (Some("error"), Some("api_error"))
    );
}

/// A request the codec cannot map is forwarded as its bytes, and counted
/// by member and role (never by what the client wrote there).
#[tokio::test]
async fn an_unmapped_request_is_forwarded_and_counted() {
    let mock = ApiMock::start(ApiSettings::default()).await;
    let proxy = start_proxy(&mock.url(), &config("")).await;
    let mut msgs = Conv::new().ask();
    msgs.push(json!({"role": "secret-role-text", "content": "x"}));
    let sent = body(&msgs, false);
    let (status, headers, _) = post_path(&proxy.url(), "/v1/messages", sent.clone(), &[KEY]).await;
    assert_eq!(status, 200);
    assert_eq!(mock.last().body.as_ref(), sent.as_slice());
    assert!(headers.get("x-compactor-action").is_none());
    let series = "compactor_unmapped_requests_total{api=\"messages\",reason=\"unsupported_role\",member=\"messages\",role=\"other\"}";
    assert_eq!(metric(&proxy.url(), series).await, 1.0);
    let (_, _, text) =
        support::chat::get_with(&format!("{}/_compactor/metrics", proxy.url()), &[]).await;
    assert!(!String::from_utf8_lossy(&text).contains("secret-role-text"));
}

/// The turn of a conversation's first compaction with `max_tokens` set to `cap`.
async fn first_compaction_with_cap(cap: u64) -> usize {
    let mock = ApiMock::start(ApiSettings::default()).await;
    let proxy = start_proxy(&mock.url(), &config("")).await;
    let mut conv = Conv::new();
    for turn in 1..=20 {
        let sent = String::from_utf8(body(&conv.ask(), false))
            .unwrap()
            .replace("\"max_tokens\":64", &format!("\"max_tokens\":{cap}"))
            .into_bytes();
        let (status, headers, resp) =
            post_path(&proxy.url(), "/v1/messages", sent, &[KEY, VERSION, SESSION]).await;
        conv.answer();
        assert_eq!(status, 200, "{}", String::from_utf8_lossy(&resp));
        if action(&headers) == "compacted" {
            return turn;
        }
    }
    panic!("no compaction in 20 turns");
}

/// Claude Code asks for 32,000 output tokens whatever the window; an
/// upstream that answers it (llama.cpp caps the reply at what is left)
/// reserves nothing, so the cap must not make every request "not fit".
#[tokio::test]
async fn a_reply_cap_larger_than_the_window_reserves_nothing() {
    let small = first_compaction_with_cap(64).await;
    assert!(small > 2, "compacted at turn {small}");
    assert_eq!(first_compaction_with_cap(32_000).await, small);
}
