//! The summariser the proxy uses: one non-streaming chat completion POSTed
//! through the [`Upstream`] (to the upstream or a configured summary
//! endpoint), with the client's own credentials unless a summary key is
//! configured.
//!
//! Failures are mapped onto [`SummaryError`] so the engine can classify them:
//! HTTP status and the provider's message for error answers, `Network` when
//! nothing came back, `Timeout`, `Decode` for a body that is not a chat
//! completion, `StreamClosed` for a cut-off body.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http::{header, HeaderMap, HeaderValue};
use serde_json::{json, Value};

use crate::compaction::config::CompactionConfig;
use crate::compaction::{Summariser, SummaryError, SummaryErrorKind, SummaryReply, SummaryRequest};
use crate::config::UpstreamBase;
use crate::upstream::{FetchError, Upstream};

/// Headers copied from the client's request onto the summary call: the
/// credentials and the few routing headers gateways need. Nothing else (in
/// particular no content-length or session headers) carries over.
const FORWARDED: &[&str] = &[
    "authorization",
    "api-key",
    "x-api-key",
    "openai-organization",
    "openai-project",
    "http-referer",
    "x-title",
];

/// Largest summary response body read.
const MAX_REPLY_BYTES: usize = 4 << 20;

/// Where the summary call goes and as whom.
pub struct SummaryTarget<'a> {
    /// The summary endpoint, or the upstream's own base.
    pub base: &'a UpstreamBase,
    /// The model named when the engine asks for none.
    pub main_model: String,
    /// The configured summary key, replacing the client's credentials.
    pub api_key: Option<&'a str>,
    /// Deadline of one whole call.
    pub timeout: Duration,
}

impl<'a> SummaryTarget<'a> {
    /// The configured target: `endpoint` when set, else the upstream itself.
    pub fn configured(
        cfg: &'a CompactionConfig,
        endpoint: Option<&'a UpstreamBase>,
        upstream: &'a Upstream,
        main_model: String,
    ) -> Self {
        SummaryTarget {
            base: endpoint.unwrap_or(upstream.base()),
            main_model,
            api_key: cfg.summary_api_key.as_deref(),
            timeout: Duration::from_secs(cfg.summary_timeout_secs.max(1)),
        }
    }
}

/// Summary calls for one request.
pub struct HttpSummariser<'a> {
    upstream: &'a Upstream,
    base: &'a UpstreamBase,
    main_model: String,
    headers: HeaderMap,
    timeout: Duration,
    prompt_budget_chars: usize,
    /// Upper bound on the reply, so prompt + reply fit the summariser's
    /// window. `None` leaves the length to the model (batch summaries are
    /// not capped on the wire for large windows).
    max_reply_tokens: Option<u32>,
    calls: AtomicU64,
}

impl<'a> HttpSummariser<'a> {
    /// A summariser that sends to `target` with the credentials found in
    /// `client_headers` (or the target's key when one is configured).
    pub fn new(
        upstream: &'a Upstream,
        target: SummaryTarget<'a>,
        client_headers: &HeaderMap,
        (prompt_budget_chars, max_reply_tokens): (usize, Option<u32>),
    ) -> Self {
        let mut headers = HeaderMap::new();
        for name in FORWARDED {
            for v in client_headers.get_all(*name) {
                headers.append(*name, v.clone());
            }
        }
        if let Some(key) = target.api_key {
            headers.remove(header::AUTHORIZATION);
            headers.remove("api-key");
            headers.remove("x-api-key");
            if let Ok(v) = HeaderValue::from_str(&format!("Bearer {key}")) {
                headers.insert(header::AUTHORIZATION, v);
            }
        }
        Self {
            upstream,
            base: target.base,
            main_model: target.main_model,
            headers,
            timeout: target.timeout,
            prompt_budget_chars,
            max_reply_tokens,
            calls: AtomicU64::new(0),
        }
    }

    /// Summary calls made so far.
    pub fn calls(&self) -> u64 {
        self.calls.load(Ordering::Relaxed)
    }

    fn body(&self, req: &SummaryRequest) -> Value {
        let mut body = json!({
            "model": req.model.as_deref().unwrap_or(&self.main_model),
            "messages": [{"role": "user", "content": req.prompt}],
            "stream": false,
        });
        let max_tokens = match (req.max_tokens, self.max_reply_tokens) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        if let Some(m) = max_tokens {
            body["max_tokens"] = json!(m);
        }
        if let Some(t) = req.temperature {
            body["temperature"] = json!(t);
        }
        body
    }

    async fn call(&self, req: SummaryRequest) -> Result<SummaryReply, SummaryError> {
        let bytes = Bytes::from(self.body(&req).to_string());
        self.calls.fetch_add(1, Ordering::Relaxed);
        let (status, body) = self
            .upstream
            .post_json(
                self.base,
                "/v1/chat/completions",
                self.headers.clone(),
                bytes,
                MAX_REPLY_BYTES,
            )
            .await
            .map_err(|e| match e {
                FetchError::Body { status, message } => SummaryError::new(
                    SummaryErrorKind::StreamClosed,
                    Some(status.as_u16()),
                    message,
                ),
                FetchError::Uri(m) => SummaryError::new(SummaryErrorKind::NoProvider, None, m),
                FetchError::Timeout => {
                    SummaryError::new(SummaryErrorKind::Timeout, None, "summary call timed out")
                }
                other => SummaryError::new(SummaryErrorKind::Network, None, other.to_string()),
            })?;
        if !status.is_success() {
            return Err(SummaryError::http(
                status.as_u16(),
                error_message(&body, status.as_u16()),
            ));
        }
        parse_reply(&body)
    }
}

#[async_trait::async_trait]
impl Summariser for HttpSummariser<'_> {
    async fn summarise(&self, req: SummaryRequest) -> Result<SummaryReply, SummaryError> {
        match tokio::time::timeout(self.timeout, self.call(req)).await {
            Ok(r) => r,
            Err(_) => Err(SummaryError::new(
                SummaryErrorKind::Timeout,
                None,
                format!("summary call timed out after {}s", self.timeout.as_secs()),
            )),
        }
    }

    fn prompt_budget_chars(&self) -> usize {
        self.prompt_budget_chars
    }
}

/// The provider's own message of an error answer, else a generic one.
fn error_message(body: &[u8], status: u16) -> String {
    let parsed: Option<Value> = serde_json::from_slice(body).ok();
    let msg = parsed.as_ref().and_then(|v| {
        v.pointer("/error/message")
            .or_else(|| v.get("message"))
            .or_else(|| v.get("error"))
            .and_then(Value::as_str)
            .map(str::to_owned)
    });
    let code = parsed
        .as_ref()
        .and_then(|v| {
            v.pointer("/error/code")
                .or_else(|| v.pointer("/error/type"))
        })
        .map(|c| c.to_string().trim_matches('"').to_owned());
    match (msg, code) {
        (Some(m), Some(c)) => format!("HTTP {status} {c}: {m}"),
        (Some(m), None) => format!("HTTP {status}: {m}"),
        _ => format!("HTTP {status}"),
    }
}

/// `choices[0]` of a chat completion as a [`SummaryReply`].
pub fn parse_reply(body: &[u8]) -> Result<SummaryReply, SummaryError> {
    let v: Value = serde_json::from_slice(body).map_err(|e| {
        SummaryError::new(
            SummaryErrorKind::Decode,
            None,
            format!("summary response is not JSON: {e}"),
        )
    })?;
    let choice = v.pointer("/choices/0").ok_or_else(|| {
        SummaryError::new(
            SummaryErrorKind::Decode,
            None,
            "summary response has no choices",
        )
    })?;
    let message = choice.get("message");
    let text = |key: &str| {
        message
            .and_then(|m| m.get(key))
            .and_then(Value::as_str)
            .filter(|s| !s.is_empty())
            .map(str::to_owned)
    };
    Ok(SummaryReply {
        content: message.and_then(|m| m.get("content")).cloned(),
        finish_reason: choice
            .get("finish_reason")
            .and_then(Value::as_str)
            .map(str::to_owned),
        refusal: text("refusal"),
        reasoning: text("reasoning_content").or_else(|| text("reasoning")),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_a_chat_completion() {
        let r = parse_reply(
            br###"{"choices":[{"index":0,"message":{"role":"assistant","content":"## Summary","reasoning_content":"hm"},"finish_reason":"stop"}]}"###,
        )
        .unwrap();
        assert_eq!(r.content, Some(Value::String("## Summary".into())));
        assert_eq!(r.finish_reason.as_deref(), Some("stop"));
        assert_eq!(r.reasoning.as_deref(), Some("hm"));
    }

    #[test]
    fn html_error_page_is_a_decode_error() {
        let e = parse_reply(b"<html>502 Bad Gateway</html>").unwrap_err();
        assert_eq!(e.kind, SummaryErrorKind::Decode);
        let e = parse_reply(br#"{"object":"list"}"#).unwrap_err();
        assert_eq!(e.kind, SummaryErrorKind::Decode);
    }

    #[test]
    fn error_message_keeps_the_providers_words() {
        let m = error_message(
            br#"{"error":{"message":"You exceeded your current quota","type":"insufficient_quota","code":"insufficient_quota"}}"#,
            429,
        );
        assert!(
            m.contains("insufficient_quota") && m.contains("exceeded your current quota"),
            "{m}"
        );
        assert_eq!(error_message(b"nope", 500), "HTTP 500");
    }
}
