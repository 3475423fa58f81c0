//! Errors compactor itself produces, and the single place that turns them
//! into responses in the client's API's error shape: OpenAI's
//! (`{"error":{"message","type","code"}}`), on Anthropic's Messages
//! route Anthropic's (`{"type":"error","error":{"type","message"}}`), on
//! Ollama's `/api/chat` Ollama's (`{"error":"message"}`).
//!
//! Upstream error responses are never built here: they pass through untouched.

use bytes::Bytes;
use http::{header, HeaderValue, Response, StatusCode};
use http_body_util::{BodyExt, Full};

/// `Retry-After` of a 503 for a capacity limit, in seconds.
pub(crate) const RETRY_AFTER_SECS: &str = "1";

/// Boxed error used in body types.
pub(crate) type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The response body type of every compactor response.
pub(crate) type ProxyBody = http_body_util::combinators::UnsyncBoxBody<Bytes, BoxError>;

/// Which side caused a failure (decides status, metric label and log level).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ErrorSource {
    /// The client sent something we refuse.
    Client,
    /// The upstream failed or was too slow.
    Upstream,
    /// A bug or resource problem inside compactor.
    Internal,
}

/// A failure of the proxy path before the response head reached the client.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ProxyError {
    /// The upstream could not be reached (refused, DNS, TLS, reset).
    #[error("upstream unreachable: {0}")]
    UpstreamUnreachable(String),
    /// Connecting to the upstream took longer than `timeouts.connect_secs`.
    #[error("upstream connect timed out after {0} s")]
    ConnectTimeout(u64),
    /// No response head within `timeouts.first_byte_secs`.
    #[error("upstream sent no response within {0} s")]
    FirstByteTimeout(u64),
    /// The request body exceeds `max_body_bytes`.
    #[error("request body exceeds the limit of {limit} bytes")]
    BodyTooLarge {
        /// The configured limit.
        limit: u64,
    },
    /// The client's request body failed while being read.
    #[error("client request body failed: {0}")]
    ClientBody(String),
    /// The request body did not arrive within `timeouts.body_read_secs`.
    #[error("request body not received within {0} s")]
    BodyReadTimeout(u64),
    /// A capacity limit of compactor was reached; retry later.
    #[error("compactor is at capacity: {0}")]
    Overloaded(String),
    /// Something inside compactor failed.
    #[error("internal error: {0}")]
    Internal(String),
    /// A request no HTTP/1.1 server may serve as sent (RFC 9112 §3.2: its
    /// Host), or one only a forward proxy serves (`CONNECT`, `*`).
    #[error("bad request: {0}")]
    BadRequest(&'static str),
}

/// Which API's error body a client reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) enum ErrorShape {
    /// `{"error": {"message", "type", "code"}}` (chat completions,
    /// Responses, every other route).
    #[default]
    OpenAi,
    /// `{"type": "error", "error": {"type", "message"}}` (Messages).
    Anthropic,
    /// `{"error": "message"}` (Ollama's `/api/chat`).
    Ollama,
}

impl ProxyError {
    /// HTTP status sent to the client.
    pub(crate) fn status(&self) -> StatusCode {
        match self {
            ProxyError::UpstreamUnreachable(_) => StatusCode::BAD_GATEWAY,
            ProxyError::ConnectTimeout(_) | ProxyError::FirstByteTimeout(_) => {
                StatusCode::GATEWAY_TIMEOUT
            }
            ProxyError::BodyTooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            ProxyError::ClientBody(_) | ProxyError::BadRequest(_) => StatusCode::BAD_REQUEST,
            ProxyError::BodyReadTimeout(_) => StatusCode::REQUEST_TIMEOUT,
            ProxyError::Overloaded(_) => StatusCode::SERVICE_UNAVAILABLE,
            ProxyError::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    /// Who is to blame.
    pub(crate) fn source_kind(&self) -> ErrorSource {
        match self {
            ProxyError::UpstreamUnreachable(_)
            | ProxyError::ConnectTimeout(_)
            | ProxyError::FirstByteTimeout(_) => ErrorSource::Upstream,
            ProxyError::BodyTooLarge { .. }
            | ProxyError::ClientBody(_)
            | ProxyError::BodyReadTimeout(_)
            | ProxyError::BadRequest(_) => ErrorSource::Client,
            ProxyError::Internal(_) | ProxyError::Overloaded(_) => ErrorSource::Internal,
        }
    }

    /// OpenAI `error.type`.
    pub(crate) fn error_type(&self) -> &'static str {
        match self.source_kind() {
            ErrorSource::Client => "invalid_request_error",
            ErrorSource::Upstream => "upstream_error",
            ErrorSource::Internal => "server_error",
        }
    }

    /// OpenAI `error.code` (stable, machine-readable; also the metric label).
    pub(crate) fn code(&self) -> &'static str {
        match self {
            ProxyError::UpstreamUnreachable(_) => "upstream_unreachable",
            ProxyError::ConnectTimeout(_) => "upstream_connect_timeout",
            ProxyError::FirstByteTimeout(_) => "upstream_timeout",
            ProxyError::BodyTooLarge { .. } => "request_too_large",
            ProxyError::ClientBody(_) => "client_body_error",
            ProxyError::BodyReadTimeout(_) => "request_body_timeout",
            ProxyError::Overloaded(_) => "overloaded",
            ProxyError::Internal(_) => "internal_error",
            ProxyError::BadRequest(_) => "bad_request",
        }
    }

    /// Anthropic's `error.type` for this error's status.
    pub(crate) fn anthropic_type(&self) -> &'static str {
        match self.status().as_u16() {
            413 => "request_too_large",
            503 => "overloaded_error",
            504 => "timeout_error",
            400..=499 => "invalid_request_error",
            _ => "api_error",
        }
    }

    /// The OpenAI-shaped error response for this error.
    // Only tests build a response from a borrowed error.
    #[cfg(test)]
    pub(crate) fn to_response(&self) -> Response<ProxyBody> {
        self.to_response_in(ErrorShape::OpenAi)
    }

    /// The error response for this error, in `shape`.
    pub(crate) fn to_response_in(&self, shape: ErrorShape) -> Response<ProxyBody> {
        let mut resp = match shape {
            ErrorShape::OpenAi => error_response(
                self.status(),
                &self.to_string(),
                self.error_type(),
                self.code(),
            ),
            ErrorShape::Anthropic => json_response(
                self.status(),
                &anthropic_error(self.anthropic_type(), &self.to_string()),
            ),
            ErrorShape::Ollama => json_response(
                self.status(),
                &serde_json::json!({ "error": self.to_string() }).to_string(),
            ),
        };
        if matches!(self, ProxyError::Overloaded(_)) {
            resp.headers_mut().insert(
                header::RETRY_AFTER,
                HeaderValue::from_static(RETRY_AFTER_SECS),
            );
        }
        resp
    }
}

/// Builds `{"error":{"message","type","code"}}` with the given status.
pub(crate) fn error_response(
    status: StatusCode,
    message: &str,
    error_type: &str,
    code: &str,
) -> Response<ProxyBody> {
    let body = serde_json::json!({
        "error": { "message": message, "type": error_type, "code": code }
    })
    .to_string();
    json_response(status, &body)
}

/// Anthropic's error body.
fn anthropic_error(error_type: &str, message: &str) -> String {
    serde_json::json!({
        "type": "error",
        "error": { "type": error_type, "message": message }
    })
    .to_string()
}

fn json_response(status: StatusCode, body: &str) -> Response<ProxyBody> {
    let mut resp = Response::new(full_body(Bytes::from(body.to_owned())));
    *resp.status_mut() = status;
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    resp
}

/// A complete in-memory body as a [`ProxyBody`].
pub(crate) fn full_body(bytes: Bytes) -> ProxyBody {
    Full::new(bytes)
        .map_err(|never| match never {})
        .boxed_unsync()
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn json_of(resp: Response<ProxyBody>) -> serde_json::Value {
        let bytes = resp.into_body().collect().await.unwrap().to_bytes();
        serde_json::from_slice(&bytes).unwrap()
    }

    #[tokio::test]
    async fn statuses_and_shape() {
        let cases = [
            (
                ProxyError::UpstreamUnreachable("refused".into()),
                502,
                "upstream_unreachable",
            ),
            (
                ProxyError::ConnectTimeout(1),
                504,
                "upstream_connect_timeout",
            ),
            (ProxyError::FirstByteTimeout(2), 504, "upstream_timeout"),
            (
                ProxyError::BodyTooLarge { limit: 3 },
                413,
                "request_too_large",
            ),
            (ProxyError::Internal("x".into()), 500, "internal_error"),
            (ProxyError::BadRequest("why"), 400, "bad_request"),
        ];
        for (err, status, code) in cases {
            let resp = err.to_response();
            assert_eq!(resp.status().as_u16(), status);
            assert_eq!(resp.headers()[header::CONTENT_TYPE], "application/json");
            let v = json_of(resp).await;
            assert_eq!(v["error"]["code"], code);
            assert_eq!(v["error"]["message"], err.to_string());
            assert!(v["error"]["type"].is_string());
        }
    }

    #[tokio::test]
    async fn anthropic_shape() {
        let cases = [
            (
                ProxyError::BodyTooLarge { limit: 3 },
                413,
                "request_too_large",
            ),
            (
                ProxyError::ClientBody("x".into()),
                400,
                "invalid_request_error",
            ),
            (ProxyError::FirstByteTimeout(2), 504, "timeout_error"),
            (
                ProxyError::UpstreamUnreachable("r".into()),
                502,
                "api_error",
            ),
            (ProxyError::Overloaded("b".into()), 503, "overloaded_error"),
        ];
        for (err, status, kind) in cases {
            let resp = err.to_response_in(ErrorShape::Anthropic);
            assert_eq!(resp.status().as_u16(), status);
            let v = json_of(resp).await;
            assert_eq!(v["type"], "error");
            assert_eq!(v["error"]["type"], kind);
            assert_eq!(v["error"]["message"], err.to_string());
            assert!(v["error"].get("code").is_none());
        }
    }

    #[tokio::test]
    async fn ollama_clients_get_ollamas_error_shape() {
        let err = ProxyError::FirstByteTimeout(2);
        let resp = err.to_response_in(ErrorShape::Ollama);
        assert_eq!(resp.status().as_u16(), 504);
        let v = json_of(resp).await;
        assert_eq!(v, serde_json::json!({ "error": err.to_string() }));
    }
}
