//! The summariser the proxy uses: one non-streaming chat completion to the
//! upstream (or a configured summary endpoint), with the client's own
//! credentials unless a summary key is configured (design §6).
//!
//! Failures are mapped onto [`SummaryError`] so the engine can classify them
//! the way the reference does: HTTP status and the provider's message for
//! error answers, `Network` when nothing came back, `Timeout`, `Decode` for a
//! body that is not a chat completion, `StreamClosed` for a cut-off body.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{header, HeaderMap, HeaderValue, Method, Request, Uri};
use http_body_util::{BodyExt, Full};
use serde_json::{json, Value};

use crate::compaction::{Summariser, SummaryError, SummaryErrorKind, SummaryReply, SummaryRequest};
use crate::config::UpstreamBase;
use crate::proxy::body::boxed;
use crate::proxy::headers;
use crate::proxy::upstream::{join_uri, UpstreamClient};

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

/// Summary calls for one request.
pub struct HttpSummariser {
    client: UpstreamClient,
    base: UpstreamBase,
    main_model: String,
    headers: HeaderMap,
    timeout: Duration,
    prompt_budget_chars: usize,
    /// Upper bound on the reply, so prompt + reply fit the summariser's
    /// window. `None` leaves the length to the model (the reference never
    /// caps batch summaries on the wire).
    max_reply_tokens: Option<u32>,
    calls: Arc<std::sync::atomic::AtomicU64>,
}

impl HttpSummariser {
    /// A summariser that sends to `base` with the credentials found in
    /// `client_headers` (or `api_key` when one is configured).
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        client: UpstreamClient,
        base: UpstreamBase,
        main_model: String,
        client_headers: &HeaderMap,
        api_key: Option<&str>,
        timeout: Duration,
        (prompt_budget_chars, max_reply_tokens): (usize, Option<u32>),
    ) -> Self {
        let mut headers = HeaderMap::new();
        for name in FORWARDED {
            for v in client_headers.get_all(*name) {
                headers.append(*name, v.clone());
            }
        }
        if let Some(key) = api_key {
            headers.remove(header::AUTHORIZATION);
            headers.remove("api-key");
            headers.remove("x-api-key");
            if let Ok(v) = HeaderValue::from_str(&format!("Bearer {key}")) {
                headers.insert(header::AUTHORIZATION, v);
            }
        }
        headers.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        headers.insert(header::ACCEPT, HeaderValue::from_static("application/json"));
        Self {
            client,
            base,
            main_model,
            headers,
            timeout,
            prompt_budget_chars,
            max_reply_tokens,
            calls: Arc::default(),
        }
    }

    /// Summary calls made so far.
    pub fn calls(&self) -> u64 {
        self.calls.load(std::sync::atomic::Ordering::Relaxed)
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
        let uri: Uri = join_uri(&self.base, &Uri::from_static("/v1/chat/completions"))
            .map_err(|e| SummaryError::new(SummaryErrorKind::NoProvider, None, e.to_string()))?;
        let bytes = Bytes::from(self.body(&req).to_string());
        let mut request = Request::new(boxed(Full::new(bytes)));
        *request.method_mut() = Method::POST;
        *request.uri_mut() = uri;
        *request.headers_mut() = self.headers.clone();
        if let Ok(host) = HeaderValue::from_str(self.base.authority.as_str()) {
            request.headers_mut().insert(header::HOST, host);
        }
        headers::prepare_request_headers(request.headers_mut());
        self.calls
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);

        let resp = self.client.request(request).await.map_err(|e| {
            SummaryError::new(
                SummaryErrorKind::Network,
                None,
                crate::proxy::error_chain(&e),
            )
        })?;
        let status = resp.status();
        let body = http_body_util::Limited::new(resp.into_body(), MAX_REPLY_BYTES)
            .collect()
            .await
            .map_err(|e| {
                SummaryError::new(
                    SummaryErrorKind::StreamClosed,
                    Some(status.as_u16()),
                    e.to_string(),
                )
            })?
            .to_bytes();
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
impl Summariser for HttpSummariser {
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
