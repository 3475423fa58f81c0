//! `GET /_compactor/sessions/{key}`: a content-free view of one
//! conversation, behind the admin token.

use bytes::Bytes;
use http::{header, HeaderValue, Request, Response, StatusCode};
use serde_json::json;

use crate::chat::ChatState;
use crate::error::{error_response, full_body, ProxyBody};
use crate::session::key::SessionKey;

/// Path prefix of the session view.
pub const SESSIONS_PREFIX: &str = "/_compactor/sessions/";

/// Serves the session view; `path` starts with [`SESSIONS_PREFIX`].
pub async fn session_view<B>(
    admin_token: Option<&str>,
    chat: &ChatState,
    req: &Request<B>,
) -> Response<ProxyBody> {
    let Some(token) = admin_token else {
        return error_response(
            StatusCode::FORBIDDEN,
            "the session view needs an admin token ([admin] token)",
            "permission_error",
            "admin_disabled",
        );
    };
    let presented = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "));
    if !presented.is_some_and(|p| constant_time_eq(p.as_bytes(), token.as_bytes())) {
        return error_response(
            StatusCode::UNAUTHORIZED,
            "missing or wrong admin token",
            "authentication_error",
            "invalid_admin_token",
        );
    }
    let raw = req.uri().path().trim_start_matches(SESSIONS_PREFIX);
    let Some(key) = SessionKey::parse_hex(raw) else {
        return not_found();
    };
    let Some(entry) = chat.sessions.peek(&key) else {
        return not_found();
    };
    let mut conv = entry.lock().await;
    conv.drain_inbox();
    let trigger = conv.compressor.as_ref().map(|c| c.trigger.status());
    // The engine works in rough units; show real tokens at the top level.
    let scale = conv.engine_scale().factor();
    let threshold = trigger
        .as_ref()
        .and_then(|t| t.threshold_tokens)
        .map(|t| (t as f64 * scale).round() as u64);
    let calibration = conv.calibration.snapshot();
    let record = conv.record.as_ref().map(|r| {
        json!({
            "replaced_messages": r.k,
            "replacement_messages": r.replacement.len(),
            "replacement_bytes": r.bytes(),
            "original_tokens": r.original_tokens,
            "replacement_tokens": r.replacement_tokens,
        })
    });
    let body = json!({
        "session": key.to_string(),
        "window": conv.real_window.or(trigger.as_ref().and_then(|t| t.window)),
        "threshold_tokens": threshold,
        "engine_scale": scale,
        "last_real_prompt_tokens": calibration.last_real_prompt_tokens,
        "estimate_error": calibration.last_estimate_error,
        "calibration_ratio": calibration.ratio,
        "usage_reports": calibration.observations,
        "last_action": conv.last_action,
        "stats": conv.stats,
        "record": record,
        "trigger": trigger,
    });
    json_response(StatusCode::OK, body.to_string())
}

/// A JSON response compactor writes itself.
fn json_response(status: StatusCode, body: String) -> Response<ProxyBody> {
    let mut resp = Response::new(full_body(Bytes::from(body)));
    *resp.status_mut() = status;
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    resp
}

fn not_found() -> Response<ProxyBody> {
    error_response(
        StatusCode::NOT_FOUND,
        "no such session",
        "invalid_request_error",
        "session_not_found",
    )
}

/// Compares without an early exit, so response time leaks nothing about the token.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[cfg(test)]
mod tests {
    use super::constant_time_eq;

    #[test]
    fn token_comparison() {
        assert!(constant_time_eq(b"abc", b"abc"));
        assert!(!constant_time_eq(b"abc", b"abd"));
        assert!(!constant_time_eq(b"abc", b"abcd"));
    }
}
