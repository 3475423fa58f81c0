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
    let record = conv.record().map(|r| {
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

/// Compares a presented token with the configured one without an early
/// exit: neither a differing byte nor a differing length ends the loop
/// sooner. The loop runs over the presented bytes only (the secret's bytes
/// are read cyclically), so its duration depends on what the caller sent,
/// never on the secret's length or content.
fn constant_time_eq(presented: &[u8], secret: &[u8]) -> bool {
    // Lengths differ ⇒ some bit of the xor is set; folded in, not branched on.
    let len_diff = (presented.len() ^ secret.len()) as u64;
    let mut diff = len_diff | u64::from(secret.is_empty());
    let n = secret.len().max(1);
    for (i, &p) in presented.iter().enumerate() {
        let s = secret.get(i % n).copied().unwrap_or(0);
        diff |= u64::from(std::hint::black_box(p ^ s));
    }
    std::hint::black_box(diff) == 0
}

#[cfg(test)]
mod tests {
    use super::constant_time_eq;
    use std::time::{Duration, Instant};

    #[test]
    fn token_comparison() {
        assert!(constant_time_eq(b"abc", b"abc"));
        assert!(!constant_time_eq(b"abc", b"abd"));
        assert!(!constant_time_eq(b"abc", b"abcd"));
        assert!(!constant_time_eq(b"abcd", b"abc"));
        assert!(!constant_time_eq(b"", b"abc"));
        assert!(
            !constant_time_eq(b"abcabc", b"abc"),
            "cyclic read is not a match"
        );
        // An empty secret never matches (config rejects it anyway).
        assert!(!constant_time_eq(b"", b""));
        assert!(!constant_time_eq(b"x", b""));
    }

    /// Fastest of a few runs of `f` (the minimum filters scheduler noise).
    fn fastest(mut f: impl FnMut() -> bool) -> Duration {
        (0..15)
            .map(|_| {
                let t = Instant::now();
                std::hint::black_box(f());
                t.elapsed()
            })
            .min()
            .unwrap_or_default()
    }

    /// A presented token of the wrong length costs as much to reject as one
    /// of the right length: the length is not checked first.
    #[test]
    #[ignore = "a timing measurement, not a pass/fail test (run with --ignored); benches/state.rs measures the stores"]
    fn wrong_length_is_not_rejected_early() {
        let secret = vec![b'a'; 256 * 1024];
        let same_len = vec![b'b'; secret.len()];
        let longer = vec![b'b'; secret.len() + 1];
        let right = fastest(|| constant_time_eq(&same_len, &secret));
        let wrong = fastest(|| constant_time_eq(&longer, &secret));
        // An early return makes `wrong` thousands of times faster; a
        // branch-free loop makes both about equal.
        assert!(
            wrong * 8 >= right,
            "length mismatch rejected in {wrong:?}, equal length in {right:?}"
        );
    }
}
