//! Counting a request's real prompt tokens with the upstream's own
//! tokenizer, for a conversation's first request: before any answer has
//! calibrated the rough estimate, a long first request near the window is
//! otherwise judged by chars/4, and one that tokenizes denser overflows
//! once and is retried (on llama.cpp, a whole prompt evaluation thrown
//! away).
//!
//! - llama.cpp: `POST /apply-template` (the chat template applied to the
//!   messages and tools) then `POST /tokenize` of that prompt;
//! - vLLM: `POST /tokenize` with the chat request's `messages` (its `count`).
//!
//! Which one the upstream has is learned once (a 404 or 405 from both
//! means neither: never asked again); every count is bounded by
//! [`COUNT_TIMEOUT`], and a failed one only means the rough estimate stands.

use std::sync::atomic::{AtomicU8, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http::HeaderMap;
use serde_json::value::RawValue;
use serde_json::Value;

use crate::upstream::Upstream;

/// The longest a count may take (both calls).
pub(crate) const COUNT_TIMEOUT: Duration = Duration::from_secs(3);
/// Largest answer read (a token list of a long prompt).
const MAX_ANSWER_BYTES: usize = 16 << 20;

/// What the upstream offers to count tokens with.
#[derive(Debug, Default)]
pub(crate) struct Tokenizer(AtomicU8);

const UNKNOWN: u8 = 0;
const LLAMA_CPP: u8 = 1;
const VLLM: u8 = 2;
const NONE: u8 = 3;

impl Tokenizer {
    /// The upstream was found to have no tokenizer endpoint.
    pub(crate) fn absent(&self) -> bool {
        self.0.load(Ordering::Relaxed) == NONE
    }

    /// Which endpoint answered, as a label (for the admin view and tests).
    pub(crate) fn label(&self) -> &'static str {
        match self.0.load(Ordering::Relaxed) {
            LLAMA_CPP => "llama.cpp",
            VLLM => "vllm",
            NONE => "none",
            _ => "unknown",
        }
    }
}

/// How one attempt went.
enum Answer {
    Count(u64),
    /// The endpoint does not exist (404/405).
    Missing,
    /// Anything else: try again on a later conversation.
    Failed,
}

/// The real prompt tokens of `messages` (and `tools`) for `model`, by the
/// upstream's tokenizer; `None` when it has none or the count failed.
pub(crate) async fn count(
    tokenizer: &Tokenizer,
    upstream: &Upstream,
    client: super::Client<'_>,
    model: &str,
    messages: &[Box<RawValue>],
    tools: Option<&RawValue>,
) -> Option<u64> {
    if tokenizer.absent() {
        return None;
    }
    let headers = crate::session::key::credential_headers(client.headers);
    let auth = (&headers, client.query);
    let attempt = async {
        let known = tokenizer.0.load(Ordering::Relaxed);
        if known != VLLM {
            match llama_cpp(upstream, auth, messages, tools).await {
                Answer::Count(n) => return (LLAMA_CPP, Some(n)),
                Answer::Failed => return (known, None),
                Answer::Missing if known == LLAMA_CPP => return (known, None),
                Answer::Missing => {}
            }
        }
        match vllm(upstream, auth, model, messages, tools).await {
            Answer::Count(n) => (VLLM, Some(n)),
            Answer::Missing if known == UNKNOWN => (NONE, None),
            _ => (known, None),
        }
    };
    let (learned, n) = tokio::time::timeout(COUNT_TIMEOUT, attempt)
        .await
        .unwrap_or((UNKNOWN, None));
    if learned != UNKNOWN {
        tokenizer.0.store(learned, Ordering::Relaxed);
    }
    tracing::debug!(
        tokenizer = tokenizer.label(),
        counted = n,
        "first request counted"
    );
    n
}

/// `{"messages": [..], "tools": .., <extra>}` from raw parts.
fn body(messages: &[Box<RawValue>], tools: Option<&RawValue>, extra: &str) -> Bytes {
    let mut out =
        String::with_capacity(messages.iter().map(|m| m.get().len() + 1).sum::<usize>() + 64);
    out.push_str("{\"messages\":[");
    for (i, m) in messages.iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        out.push_str(m.get());
    }
    out.push(']');
    if let Some(t) = tools {
        out.push_str(",\"tools\":");
        out.push_str(t.get());
    }
    out.push_str(extra);
    out.push('}');
    Bytes::from(out)
}

/// The credential headers and query parameters presented as the client.
type Auth<'a> = (&'a HeaderMap, Option<&'a str>);

async fn post(
    upstream: &Upstream,
    (headers, query): Auth<'_>,
    path: &'static str,
    body: Bytes,
) -> Result<Value, Answer> {
    let (status, bytes) = upstream
        .post_json_query(
            upstream.base(),
            path,
            query,
            headers.clone(),
            body,
            MAX_ANSWER_BYTES,
        )
        .await
        .map_err(|_| Answer::Failed)?;
    if matches!(status.as_u16(), 404 | 405) {
        return Err(Answer::Missing);
    }
    if !status.is_success() {
        return Err(Answer::Failed);
    }
    serde_json::from_slice(&bytes).map_err(|_| Answer::Failed)
}

async fn llama_cpp(
    upstream: &Upstream,
    auth: Auth<'_>,
    messages: &[Box<RawValue>],
    tools: Option<&RawValue>,
) -> Answer {
    let prompt = match post(upstream, auth, "/apply-template", body(messages, tools, "")).await {
        Ok(v) => match v.get("prompt").and_then(Value::as_str) {
            Some(p) => p.to_owned(),
            None => return Answer::Failed,
        },
        Err(a) => return a,
    };
    let req = serde_json::json!({"content": prompt, "add_special": true}).to_string();
    match post(upstream, auth, "/tokenize", Bytes::from(req)).await {
        Ok(v) => v
            .get("tokens")
            .and_then(Value::as_array)
            .map_or(Answer::Failed, |t| Answer::Count(t.len() as u64)),
        Err(a) => a,
    }
}

async fn vllm(
    upstream: &Upstream,
    auth: Auth<'_>,
    model: &str,
    messages: &[Box<RawValue>],
    tools: Option<&RawValue>,
) -> Answer {
    let model = serde_json::to_string(model).unwrap_or_else(|_| "\"\"".into());
    let extra = format!(",\"model\":{model},\"add_generation_prompt\":true");
    match post(upstream, auth, "/tokenize", body(messages, tools, &extra)).await {
        Ok(v) => v
            .get("count")
            .and_then(Value::as_u64)
            .map_or(Answer::Failed, Answer::Count),
        Err(a) => a,
    }
}
