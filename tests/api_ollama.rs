//! Ollama's native chat (`POST /api/chat`) through compactor against the
//! scripted Ollama (tests/support/ollama.rs), which loads a model on its
//! first request and truncates a prompt over its window silently: bytes
//! unchanged when nothing is compacted, the window Ollama really uses
//! (learned after the first answer, or the request's `num_ctx`), no
//! request truncated, and a truncation that does happen counted, not
//! learned from, and compacted away.

// Test code: a failed unwrap is a failed test (the helpers too).
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use serde_json::{json, Value};
use support::chat::{action, admin_view, assert_tool_pairs, metric, post_path, session_of};
use support::ollama::{OllamaMock, OllamaSettings};
use support::start_proxy;

const TOKEN: &str = "secret";
const TOOLS: &str = r#"[{"type":"function","function":{"name":"get_weather","description":"The weather in a city","parameters":{"type":"object","properties":{"city":{"type":"string"}},"required":["city"]}}}]"#;

fn config(extra: &str) -> String {
    format!("{extra}[admin]\ntoken = \"{TOKEN}\"\n")
}

/// A chat as the `ollama` libraries send it: a system prompt, the tools,
/// user turns of about `turn_tokens` tokens, the assistant's answers.
struct Chat {
    messages: Vec<Value>,
    turn_tokens: usize,
}

impl Chat {
    fn new(turn_tokens: usize) -> Self {
        Self {
            messages: vec![
                json!({"role":"system","content":"You are a release assistant. Answer briefly."}),
            ],
            turn_tokens,
        }
    }

    fn ask(&mut self, i: usize) {
        let line =
            format!("Turn {i}: the deploy log of run {i} says step {i} passed in {i} seconds. ");
        let text = line.repeat(self.turn_tokens * 4 / line.len() + 1);
        self.messages.push(json!({"role":"user","content":text}));
    }

    fn body(&self, extra: &str) -> Vec<u8> {
        let messages = serde_json::to_string(&self.messages).unwrap();
        format!("{{\"model\":\"llama3.2\",\"messages\":{messages},\"tools\":{TOOLS}{extra}}}")
            .into_bytes()
    }

    /// Adds the assistant's message of an `/api/chat` reply (streamed or
    /// not) to the chat.
    fn answer(&mut self, reply: &[u8]) {
        let mut content = String::new();
        let mut calls = None;
        for line in reply.split(|b| *b == b'\n').filter(|l| !l.is_empty()) {
            let v: Value = serde_json::from_slice(line).unwrap();
            content.push_str(v["message"]["content"].as_str().unwrap_or_default());
            if let Some(c) = v["message"].get("tool_calls") {
                calls = Some(c.clone());
            }
        }
        let mut m = json!({"role":"assistant","content":content});
        if let Some(c) = calls {
            m["tool_calls"] = c;
        }
        self.messages.push(m);
    }
}

async fn send(proxy: &str, body: Vec<u8>) -> (http::HeaderMap, bytes::Bytes) {
    let (status, headers, reply) = post_path(proxy, "/api/chat", body, &[]).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&reply));
    (headers, reply)
}

#[tokio::test]
async fn a_chat_that_fits_passes_through_byte_for_byte_streamed_or_not() {
    let mock = OllamaMock::start(OllamaSettings::default()).await;
    let proxy = start_proxy(&mock.url(), &config("")).await;
    for extra in ["", ",\"stream\":false"] {
        let mut chat = Chat::new(40);
        chat.ask(1);
        chat.messages
            .push(json!({"role":"user","content":"and the weather?"}));
        for turn in 0..2 {
            let body = chat.body(extra);
            let (headers, reply) = send(&proxy.url(), body.clone()).await;
            assert_eq!(action(&headers), "passthrough");
            assert_eq!(mock.last().body.as_ref(), body.as_slice());
            // The reply is the upstream's: the same request sent directly
            // gets the same bytes (NDJSON lines, or one object).
            let (_, _, direct) = post_path(&mock.url(), "/api/chat", body, &[]).await;
            assert_eq!(reply, direct, "{extra}");
            let ndjson = extra.is_empty();
            assert_eq!(reply.iter().filter(|b| **b == b'\n').count() > 1, ndjson);
            chat.answer(&reply);
            if turn == 0 {
                // The tool call comes back in Ollama's shape; its result goes
                // next, as the libraries send it.
                let call = &chat.messages.last().unwrap()["tool_calls"][0];
                assert_eq!(call["function"]["arguments"]["city"], "Tokyo");
                chat.messages
                    .push(json!({"role":"tool","content":"sunny, 21 C","tool_name":"get_weather"}));
            }
        }
        // The count was read from the reply's last object.
        let key = session_of(&mock_headers(&proxy.url(), &chat, extra).await);
        let (_, view) = admin_view(&proxy.url(), TOKEN, &key).await;
        let counted = mock.conversations().last().unwrap().kept;
        assert_eq!(view["last_real_prompt_tokens"], counted, "{view}");
    }
}

/// The headers of one more request of `chat` (its session).
async fn mock_headers(proxy: &str, chat: &Chat, extra: &str) -> http::HeaderMap {
    send(proxy, chat.body(extra)).await.0
}

/// 30 turns of ~400 tokens at Ollama's 4,096 default, the model loaded by
/// the first request: every request within the window, system prompt and
/// tools in each, tool pairs whole.
async fn a_long_chat_is_compacted_before_ollama_would_truncate(extra: &str) {
    let mock = OllamaMock::start(OllamaSettings::default()).await;
    let proxy = start_proxy(&mock.url(), &config("")).await;
    let mut chat = Chat::new(400);
    let mut compacted = 0;
    let mut key = String::new();
    for i in 1..=30 {
        chat.ask(i);
        let (headers, reply) = send(&proxy.url(), chat.body(extra)).await;
        compacted += usize::from(action(&headers) == "compacted");
        key = session_of(&headers);
        chat.answer(&reply);
        let seen = mock.last();
        assert_eq!(
            seen.dropped, 0,
            "turn {i}: {} of {} tokens",
            seen.sent, seen.window
        );
        let sent = seen.json();
        assert_eq!(sent["messages"][0], chat.messages[0], "turn {i}");
        assert_eq!(sent["tools"], serde_json::from_str::<Value>(TOOLS).unwrap());
        assert_tool_pairs(&openai_shaped(&sent["messages"]));
    }
    assert!(compacted >= 2, "{compacted} compactions");
    let (_, view) = admin_view(&proxy.url(), TOKEN, &key).await;
    assert_eq!(view["window"], 4096, "{view}");
    assert_eq!(view["truncations"], 0);
    // Summaries were asked on Ollama's own route.
    let summaries = mock.summaries();
    assert!(!summaries.is_empty());
    assert!(summaries
        .iter()
        .all(|s| s.path == "/api/chat" && s.json()["stream"] == false));
}

/// Ollama's tool messages pair by position: give them the ids the checker
/// reads (a call's id is its place; a result answers the oldest open call).
fn openai_shaped(messages: &Value) -> Vec<Value> {
    let mut open: Vec<String> = Vec::new();
    let mut out = Vec::new();
    for (i, m) in messages.as_array().unwrap().iter().enumerate() {
        let mut m = m.clone();
        if let Some(calls) = m["tool_calls"].as_array_mut() {
            open.clear();
            for (k, c) in calls.iter_mut().enumerate() {
                let id = format!("{i}-{k}");
                c["id"] = json!(id);
                open.push(id);
            }
        }
        if m["role"] == "tool" {
            m["tool_call_id"] = json!(if open.is_empty() {
                "orphan".to_owned()
            } else {
                open.remove(0)
            });
        }
        out.push(m);
    }
    out
}

#[tokio::test]
async fn a_long_streamed_chat_is_compacted_before_ollama_would_truncate() {
    a_long_chat_is_compacted_before_ollama_would_truncate("").await;
}

#[tokio::test]
async fn a_long_chat_is_compacted_before_ollama_would_truncate_not_streamed() {
    a_long_chat_is_compacted_before_ollama_would_truncate(",\"stream\":false").await;
}

#[tokio::test]
async fn a_requests_num_ctx_is_its_window_and_its_summary_asks_for_it_too() {
    let mock = OllamaMock::start(OllamaSettings::default()).await;
    let proxy = start_proxy(&mock.url(), &config("")).await;
    let mut chat = Chat::new(400);
    let extra = ",\"options\":{\"num_ctx\":6144,\"temperature\":0.1},\"keep_alive\":\"10m\"";
    let mut key = String::new();
    for i in 1..=24 {
        chat.ask(i);
        let (headers, reply) = send(&proxy.url(), chat.body(extra)).await;
        key = session_of(&headers);
        chat.answer(&reply);
        let seen = mock.last();
        assert_eq!((seen.window, seen.dropped), (6144, 0), "turn {i}");
        // Members compactor does not change keep their bytes.
        let text = String::from_utf8(seen.body.to_vec()).unwrap();
        assert!(text.ends_with(&format!("\"tools\":{TOOLS}{extra}}}")));
    }
    let (_, view) = admin_view(&proxy.url(), TOKEN, &key).await;
    assert_eq!(view["window"], 6144, "{view}");
    let summaries = mock.summaries();
    assert!(!summaries.is_empty());
    for s in summaries {
        assert_eq!(s.json()["options"]["num_ctx"], 6144);
        assert_eq!(
            s.window, 6144,
            "the summary made Ollama load another window"
        );
    }
}

#[tokio::test]
async fn a_silent_truncation_is_counted_not_learned_and_compacted_away() {
    let mock = OllamaMock::start(OllamaSettings::default()).await;
    let proxy = start_proxy(&mock.url(), &config("")).await;
    // A resumed chat of ~5,000 tokens: nothing is loaded yet, compactor
    // takes its 8,192 default, and Ollama (4,096) cuts it.
    let mut chat = Chat::new(400);
    for i in 1..=12 {
        chat.ask(i);
        chat.messages
            .push(json!({"role":"assistant","content":format!("Run {i} passed.")}));
    }
    chat.ask(13);
    let (headers, reply) = send(&proxy.url(), chat.body("")).await;
    assert_eq!(action(&headers), "passthrough");
    assert!(mock.last().dropped > 0, "the mock did not truncate");
    let key = session_of(&headers);
    // The view waits for the window: the cut count is not taken for a
    // calibration point before it is known.
    let (_, view) = admin_view(&proxy.url(), TOKEN, &key).await;
    assert_eq!(view["usage_reports"], 0, "{view}");
    chat.answer(&reply);
    chat.ask(14);
    let (headers, reply) = send(&proxy.url(), chat.body("")).await;
    assert_eq!(action(&headers), "compacted");
    assert_eq!(mock.last().dropped, 0);
    chat.answer(&reply);
    let series = "compactor_truncations_total{api=\"ollama\"}";
    assert_eq!(metric(&proxy.url(), series).await, 1.0);
    let (_, view) = admin_view(&proxy.url(), TOKEN, &key).await;
    assert_eq!(view["truncations"], 1, "{view}");
    assert_eq!(view["window"], 4096);
    // The truncated count taught nothing: the one report learned is the
    // compacted request's.
    assert_eq!(view["usage_reports"], 1, "{view}");
}

#[tokio::test]
async fn on_v1_a_count_that_shrinks_as_the_chat_grows_is_a_truncation() {
    // An upstream that says nothing of its window and cuts at 4,096, in
    // front of a compactor that believes 16,384.
    let mock = OllamaMock::start(OllamaSettings {
        ps: false,
        ..OllamaSettings::default()
    })
    .await;
    let proxy = start_proxy(&mock.url(), &config("default_context_length = 16384\n")).await;
    let mut messages = vec![json!({"role":"system","content":"Be brief."})];
    let mut key = String::new();
    let mut saw_compaction_after_cut = false;
    let mut cut_seen = false;
    for i in 1..=60 {
        // Short turns, and one long paste early on: once Ollama drops the
        // paste, the count shrinks while the chat grows.
        let words = if i == 2 { 1200 } else { 80 };
        messages.push(json!({"role":"user","content":"word ".repeat(words)}));
        let body = json!({"model":"llama3.2","messages":messages}).to_string();
        let (status, headers, reply) =
            post_path(&proxy.url(), "/v1/chat/completions", body.into_bytes(), &[]).await;
        assert_eq!(status, 200);
        key = session_of(&headers);
        if cut_seen && action(&headers) == "compacted" {
            saw_compaction_after_cut = true;
            assert_eq!(mock.last().dropped, 0, "turn {i}");
            break;
        }
        cut_seen |= mock.last().dropped > 0;
        let v: Value = serde_json::from_slice(&reply).unwrap();
        messages.push(v["choices"][0]["message"].clone());
    }
    assert!(cut_seen, "the mock never truncated");
    assert!(saw_compaction_after_cut, "no compaction after the cut");
    let (_, view) = admin_view(&proxy.url(), TOKEN, &key).await;
    assert!(view["truncations"].as_u64().unwrap() >= 1, "{view}");
    // What the upstream held is the window now.
    assert!(view["window"].as_u64().unwrap() <= 4096, "{view}");
    assert!(metric(&proxy.url(), "compactor_truncations_total{api=\"chat\"}").await >= 1.0);
}

#[tokio::test]
async fn compactors_own_errors_on_api_chat_are_in_ollamas_shape() {
    // Nothing listens there: compactor answers itself.
    let proxy = start_proxy("http://127.0.0.1:9", &config("")).await;
    let chat = Chat::new(10);
    let (status, _, body) = post_path(&proxy.url(), "/api/chat", chat.body(""), &[]).await;
    assert_eq!(status, 502);
    let v: Value = serde_json::from_slice(&body).unwrap();
    assert!(v["error"].is_string(), "{v}");
}

#[tokio::test]
async fn a_count_that_stays_put_while_turns_are_added_is_a_truncation() {
    // Ollama drops the fewest old messages that make the prompt fit: turn
    // after turn its count sits just under 4,096 while ~400 tokens were
    // added. Nothing tells compactor the window.
    let mock = OllamaMock::start(OllamaSettings {
        ps: false,
        ..OllamaSettings::default()
    })
    .await;
    let proxy = start_proxy(&mock.url(), &config("default_context_length = 16384\n")).await;
    let mut chat = Chat::new(400);
    let mut cut_at = None;
    let mut key = String::new();
    for i in 1..=30 {
        chat.ask(i);
        let (headers, reply) = send(&proxy.url(), chat.body("")).await;
        key = session_of(&headers);
        chat.answer(&reply);
        let seen = mock.last();
        match cut_at {
            None if seen.dropped > 0 => cut_at = Some(i),
            None => {}
            Some(at) => {
                // The turn after the first cut is compacted, within the window.
                assert_eq!(i, at + 1);
                assert_eq!(action(&headers), "compacted");
                assert_eq!(seen.dropped, 0);
                break;
            }
        }
    }
    assert!(cut_at.is_some(), "the mock never truncated");
    let (_, view) = admin_view(&proxy.url(), TOKEN, &key).await;
    assert_eq!(view["truncations"], 1, "{view}");
    assert!(view["window"].as_u64().unwrap() <= 4096, "{view}");
}
