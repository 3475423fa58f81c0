//! Shared helpers of the engine's unit tests that drive a whole compressor:
//! a scripted summariser standing in for the ported tests' patched LLM call,
//! and compressor builders mirroring their fixtures (the same helpers as
//! `tests/engine_support`, for the tests that need the engine's insides).
#![allow(dead_code)]

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use serde_json::{json, Value};

use super::compressor::Compressor;
use super::config::CompactionConfig;
use super::markers;
use super::summariser::{Summariser, SummaryError, SummaryReply, SummaryRequest};
use super::summary_failure::SummaryErrorKind;
use super::trigger::{Trigger, WindowSource};
use super::view;

/// One scripted answer.
pub(crate) type Answer = Result<SummaryReply, SummaryError>;

/// A summariser that plays back scripted answers (the last one repeats) and
/// records every request.
pub(crate) struct Stub {
    script: Mutex<VecDeque<Answer>>,
    last: Mutex<Option<Answer>>,
    pub(crate) requests: Mutex<Vec<SummaryRequest>>,
    pub(crate) budget: usize,
}

impl Stub {
    pub(crate) fn seq(answers: Vec<Answer>) -> Self {
        Self {
            script: Mutex::new(answers.into()),
            last: Mutex::new(None),
            requests: Mutex::new(Vec::new()),
            budget: 160_000,
        }
    }
    pub(crate) fn ok(text: &str) -> Self {
        Self::seq(vec![Ok(SummaryReply::text(text))])
    }
    pub(crate) fn reply(r: SummaryReply) -> Self {
        Self::seq(vec![Ok(r)])
    }
    pub(crate) fn err(e: SummaryError) -> Self {
        Self::seq(vec![Err(e)])
    }
    pub(crate) fn with_budget(mut self, chars: usize) -> Self {
        self.budget = chars;
        self
    }
    pub(crate) fn calls(&self) -> usize {
        self.requests.lock().unwrap().len()
    }
    pub(crate) fn request(&self, i: usize) -> SummaryRequest {
        self.requests.lock().unwrap()[i].clone()
    }
    pub(crate) fn last_request(&self) -> SummaryRequest {
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
pub(crate) fn no_provider() -> SummaryError {
    SummaryError::new(SummaryErrorKind::NoProvider, None, "no provider")
}
/// `Exception(msg)` without a status.
pub(crate) fn plain(msg: &str) -> SummaryError {
    SummaryError::new(SummaryErrorKind::Http, None, msg)
}
/// `StubProviderError(msg, status_code=status)`.
pub(crate) fn status(code: u16, msg: &str) -> SummaryError {
    SummaryError::http(code, msg)
}
/// `ConnectionError("Connection error.")`.
pub(crate) fn connection() -> SummaryError {
    SummaryError::new(SummaryErrorKind::Network, None, "Connection error.")
}
/// `json.JSONDecodeError("Expecting value", "<!DOCTYPE html>…", 0)`.
pub(crate) fn json_decode() -> SummaryError {
    SummaryError::new(
        SummaryErrorKind::Decode,
        None,
        "Expecting value: line 1 column 1 (char 0)",
    )
}
/// A premature close of the response stream (a connection error).
pub(crate) fn stream_closed(msg: &str) -> SummaryError {
    SummaryError::new(SummaryErrorKind::StreamClosed, None, msg)
}
/// A reply whose `message.content` is null.
pub(crate) fn null_content() -> SummaryReply {
    SummaryReply {
        content: Some(Value::Null),
        finish_reason: Some("stop".into()),
        refusal: None,
        reasoning: None,
    }
}

/// A compressor over a known window; `f` edits the defaults.
pub(crate) fn compressor_with(
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
pub(crate) fn compressor(first: usize, last: usize) -> Compressor {
    compressor_with("test", 100_000, |c| {
        c.protect_first_n = first;
        c.protect_last_n = last;
    })
}

/// The ported `compressor` fixture: model "test/model", 100k window,
/// threshold 0.85, protect_first_n=2, protect_last_n=2.
pub(crate) fn fixture() -> Compressor {
    compressor_with("test/model", 100_000, |c| {
        c.threshold_percent = 0.85;
        c.protect_first_n = 2;
        c.protect_last_n = 2;
    })
}

pub(crate) fn msg(role: &str, content: &str) -> Value {
    json!({"role": role, "content": content})
}

/// A row that is compactor's own summary, declared as the proxy declares
/// the summary rows of a compaction record (text alone does not make one).
pub(crate) fn summary_msg(role: &str, content: &str) -> Value {
    let mut m = msg(role, content);
    markers::declare_summary(&mut m);
    m
}

/// `[{"role": "user" if i % 2 == 0 else "assistant", "content": f"msg {i}"} for i in range(n)]`
pub(crate) fn alternating(n: usize, prefix: &str) -> Vec<Value> {
    (0..n)
        .map(|i| {
            msg(
                if i % 2 == 0 { "user" } else { "assistant" },
                &format!("{prefix}{i}"),
            )
        })
        .collect()
}

pub(crate) fn content_str(m: &Value) -> String {
    view::text(m)
}

pub(crate) fn block_on<F: std::future::Future>(f: F) -> F::Output {
    tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap()
        .block_on(f)
}
