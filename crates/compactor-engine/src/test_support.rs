//! Shared helpers of the engine's tests that drive a whole compressor: a
//! scripted summariser standing in for the ported tests' patched LLM call,
//! and compressor builders mirroring their fixtures. One file for both
//! sides: the engine's unit tests include it as a module of the crate,
//! the proxy's `tests/engine_support` by `#[path]`; either parent
//! provides the engine's public names it reads through `super::`.
#![allow(dead_code, unreachable_pub)]

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use serde_json::{json, Value};

use super::{
    declare_summary, is_summary, CompactionConfig, Compressor, Strategy, Summariser, SummaryError,
    SummaryErrorKind, SummaryReply, SummaryRequest, Trigger, WindowSource,
};

/// One scripted answer.
pub type Answer = Result<SummaryReply, SummaryError>;

/// A summariser that plays back scripted answers (the last one repeats) and
/// records every request.
pub struct Stub {
    script: Mutex<VecDeque<Answer>>,
    last: Mutex<Option<Answer>>,
    pub requests: Mutex<Vec<SummaryRequest>>,
    pub budget: usize,
}

impl Stub {
    pub fn seq(answers: Vec<Answer>) -> Self {
        Self {
            script: Mutex::new(answers.into()),
            last: Mutex::new(None),
            requests: Mutex::new(Vec::new()),
            budget: 160_000,
        }
    }
    pub fn ok(text: &str) -> Self {
        Self::seq(vec![Ok(SummaryReply::text(text))])
    }
    pub fn reply(r: SummaryReply) -> Self {
        Self::seq(vec![Ok(r)])
    }
    pub fn err(e: SummaryError) -> Self {
        Self::seq(vec![Err(e)])
    }
    pub fn with_budget(mut self, chars: usize) -> Self {
        self.budget = chars;
        self
    }
    pub fn calls(&self) -> usize {
        self.requests.lock().unwrap().len()
    }
    pub fn request(&self, i: usize) -> SummaryRequest {
        self.requests.lock().unwrap()[i].clone()
    }
    pub fn last_request(&self) -> SummaryRequest {
        self.requests.lock().unwrap().last().cloned().unwrap()
    }
}

#[async_trait::async_trait]
impl Summariser for Stub {
    async fn summarise(&self, req: SummaryRequest) -> Result<SummaryReply, SummaryError> {
        self.requests.lock().unwrap().push(req);
        let next = self.script.lock().unwrap().pop_front();
        match next {
            Some(a) => {
                *self.last.lock().unwrap() = Some(a.clone());
                a
            }
            None => self
                .last
                .lock()
                .unwrap()
                .clone()
                .unwrap_or_else(|| Ok(SummaryReply::text("summary"))),
        }
    }
    fn prompt_budget_chars(&self) -> usize {
        self.budget
    }
}

// Provider errors as the summariser reports them.

/// `RuntimeError("no provider")`: no summary provider configured.
pub fn no_provider() -> SummaryError {
    SummaryError::new(SummaryErrorKind::NoProvider, None, "no provider")
}
/// `Exception(msg)` without a status.
pub fn plain(msg: &str) -> SummaryError {
    SummaryError::new(SummaryErrorKind::Http, None, msg)
}
/// `StubProviderError(msg, status_code=status)`.
pub fn status(code: u16, msg: &str) -> SummaryError {
    SummaryError::http(code, msg)
}
/// `ConnectionError("Connection error.")`.
pub fn connection() -> SummaryError {
    SummaryError::new(SummaryErrorKind::Network, None, "Connection error.")
}
/// `json.JSONDecodeError("Expecting value", "<!DOCTYPE html>…", 0)`.
pub fn json_decode() -> SummaryError {
    SummaryError::new(
        SummaryErrorKind::Decode,
        None,
        "Expecting value: line 1 column 1 (char 0)",
    )
}
/// A premature close of the response stream (a connection error).
pub fn stream_closed(msg: &str) -> SummaryError {
    SummaryError::new(SummaryErrorKind::StreamClosed, None, msg)
}
/// A reply whose `message.content` is null.
pub fn null_content() -> SummaryReply {
    SummaryReply {
        content: Some(Value::Null),
        finish_reason: Some("stop".into()),
        refusal: None,
        reasoning: None,
    }
}

/// A compressor over a known window; `f` edits the defaults.
pub fn compressor_with(
    model: &str,
    window: u64,
    f: impl FnOnce(&mut CompactionConfig),
) -> Compressor {
    let mut cfg = CompactionConfig::default();
    f(&mut cfg);
    let cfg = Arc::new(cfg);
    let trigger = Trigger::new(cfg.clone(), model, WindowSource::Known(window), None);
    Compressor::new(cfg, trigger)
}

/// `ContextCompressor(model="test", quiet_mode=True, protect_first_n=a, protect_last_n=b)` at 100k.
pub fn compressor(first: usize, last: usize) -> Compressor {
    compressor_with("test", 100_000, |c| {
        c.protect_first_n = first;
        c.protect_last_n = last;
    })
}

/// The ported `compressor` fixture: model "test/model", 100k window,
/// threshold 0.85, protect_first_n=2, protect_last_n=2.
pub fn fixture() -> Compressor {
    compressor_with("test/model", 100_000, |c| {
        c.threshold_percent = 0.85;
        c.protect_first_n = 2;
        c.protect_last_n = 2;
    })
}

pub fn msg(role: &str, content: &str) -> Value {
    json!({"role": role, "content": content})
}

/// A row that is compactor's own summary, declared as the proxy declares
/// the summary rows of a compaction record (text alone does not make one).
pub fn summary_msg(role: &str, content: &str) -> Value {
    let mut m = msg(role, content);
    declare_summary(&mut m);
    m
}

/// `[{"role": "user" if i % 2 == 0 else "assistant", "content": f"msg {i}"} for i in range(n)]`
pub fn alternating(n: usize, prefix: &str) -> Vec<Value> {
    (0..n)
        .map(|i| {
            msg(
                if i % 2 == 0 { "user" } else { "assistant" },
                &format!("{prefix}{i}"),
            )
        })
        .collect()
}

/// The text of a message's content: the string itself, or the text parts of
/// a list joined with a space (as the engine reads it).
pub fn content_str(m: &Value) -> String {
    match m.get("content").unwrap_or(&Value::Null) {
        Value::String(s) => s.clone(),
        Value::Array(parts) => {
            let mut out = String::new();
            for p in parts {
                let text = match p {
                    Value::String(s) => Some(s.as_str()),
                    Value::Object(o) => o.get("text").and_then(Value::as_str),
                    _ => None,
                };
                if let Some(t) = text {
                    if !out.is_empty() {
                        out.push(' ');
                    }
                    out.push_str(t);
                }
            }
            out
        }
        _ => String::new(),
    }
}

pub fn block_on<F: std::future::Future>(f: F) -> F::Output {
    tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap()
        .block_on(f)
}

/// The micro-compaction suites' compressor: a 40,960-token window at 75 %,
/// one message protected at the head, two at the tail.
pub fn micro() -> Compressor {
    compressor_with("test-model", 40_960, |c| {
        c.threshold_percent = 0.75;
        c.protect_first_n = 1;
        c.protect_last_n = 2;
        c.strategy = Strategy::Micro;
    })
}

/// A system prompt and `exchanges` question/answer pairs of ~100 tokens.
pub fn conversation(exchanges: usize) -> Vec<Value> {
    let mut v = vec![msg("system", "system prompt")];
    for i in 0..exchanges {
        v.push(msg("user", &format!("question {i}")));
        v.push(msg("assistant", &format!("answer {i} {}", "z".repeat(400))));
    }
    v
}

/// The summary markers among `msgs`.
pub fn markers(msgs: &[Value]) -> Vec<&Value> {
    msgs.iter().filter(|m| is_summary(m)).collect()
}

/// A system prompt and seven alternating user/assistant messages.
pub fn eight_with_system() -> Vec<Value> {
    let mut v = vec![msg("system", "sys")];
    for i in 1..=7 {
        v.push(msg(
            if i % 2 == 1 { "user" } else { "assistant" },
            &format!("msg {i}"),
        ));
    }
    v
}

/// The reference suite's seven-message fixture (after its system prompt).
pub fn seven() -> Vec<Value> {
    eight_with_system()
}

/// An assistant `terminal` call `id` and its result of `size` characters.
pub fn tool_round(id: &str, size: usize) -> [Value; 2] {
    [
        json!({"role": "assistant", "content": null, "tool_calls": [{"id": id, "type": "function",
            "function": {"name": "terminal", "arguments": format!("{{\"command\":\"make {id}\"}}")}}]}),
        json!({"role": "tool", "tool_call_id": id, "content": format!("{id}: {}", "o".repeat(size))}),
    ]
}

/// A cron job's session: no user message at all, eight tool rounds.
pub fn no_user_session() -> Vec<Value> {
    let mut msgs = vec![msg("system", "nightly job: rotate logs")];
    for i in 0..8 {
        msgs.extend(tool_round(&format!("c{i}"), 300));
        msgs.push(msg("assistant", &format!("rotated host {i}")));
    }
    msgs
}

/// Exchange `i` of a coding agent: the user asks, the assistant reads a
/// file of about `out_chars` characters and answers.
pub fn read_round(i: usize, out_chars: usize) -> Vec<Value> {
    let id = format!("c{i}");
    vec![
        msg("user", &format!("step {i}: read file_{i}.rs")),
        json!({"role": "assistant", "content": null, "tool_calls": [{"id": id, "type": "function", "function": {"name": "read", "arguments": format!("{{\"path\":\"file_{i}.rs\"}}")}}]}),
        json!({"role": "tool", "tool_call_id": id, "content": format!("fn f{i}() {{}}\n").repeat(out_chars / 12)}),
        msg("assistant", &format!("file_{i}.rs defines f{i}.")),
    ]
}

/// A summary reply the model cut at its token limit.
pub fn cut_reply(text: &str) -> SummaryReply {
    SummaryReply {
        content: Some(Value::String(text.into())),
        finish_reason: Some("length".into()),
        refusal: None,
        reasoning: None,
    }
}

/// The text of the first summary marker among `msgs`, or `""`.
pub fn marker_text(msgs: &[Value]) -> String {
    markers(msgs)
        .first()
        .map(|m| content_str(m))
        .unwrap_or_default()
}
