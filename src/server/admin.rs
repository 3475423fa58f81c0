//! `GET /_compactor/sessions/{key}`: a content-free view of one
//! conversation, behind the admin token.

use std::sync::OnceLock;

use bytes::Bytes;
use http::{header, HeaderValue, Request, Response, StatusCode};
use serde_json::json;

use crate::chat::conversation::Conversation;
use crate::chat::ChatState;
use crate::error::{error_response, full_body, ProxyBody};
use crate::session::key::SessionKey;

/// Path prefix of the session view.
pub const SESSIONS_PREFIX: &str = "/_compactor/sessions/";

/// How long the view waits for a conversation's lock before it answers
/// from the last view it rendered.
const LOCK_WAIT: std::time::Duration = std::time::Duration::from_millis(100);

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
    if !presented.is_some_and(|p| tokens_match(p.as_bytes(), token.as_bytes())) {
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
    // A compaction holds the lock through its summary calls (seconds to
    // minutes on a small server): past a short wait, which covers a request's
    // ordinary preparation, answer from the last view, marked busy.
    let body = match tokio::time::timeout(LOCK_WAIT, entry.lock()).await {
        Ok(mut conv) => {
            let view = render(&key, &mut conv);
            entry.set_snapshot(view.clone());
            with_busy(view, false)
        }
        Err(_) => with_busy(
            entry
                .snapshot()
                .unwrap_or_else(|| json!({ "session": key.to_string() })),
            true,
        ),
    };
    json_response(StatusCode::OK, body.to_string())
}

/// `view` with `busy`: whether the conversation was locked (compacting)
/// and the view is the last one rendered before, possibly only its key.
fn with_busy(mut view: serde_json::Value, busy: bool) -> serde_json::Value {
    if let Some(o) = view.as_object_mut() {
        o.insert("busy".to_owned(), serde_json::Value::Bool(busy));
    }
    view
}

/// The content-free view of one conversation.
fn render(key: &SessionKey, conv: &mut Conversation) -> serde_json::Value {
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
    json!({
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
    })
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

/// Whether a presented token equals the configured one, in time that
/// depends on neither the secret's length nor where the two first differ.
///
/// Both tokens are reduced to fixed-length HMAC-SHA-256 tags under a key
/// drawn once per process, and the two tags are compared with a
/// branch-free fold over all 32 bytes. Hashing the presented token costs
/// time in its own length only (the caller's input); hashing the secret
/// costs the same on every call; the fold always reads every byte. The
/// random key keeps the tags unpredictable, so even a leak of which tag
/// bytes differ would say nothing about the secret's bytes. An empty secret
/// never matches (the config refuses one anyway).
pub fn tokens_match(presented: &[u8], secret: &[u8]) -> bool {
    let key = token_key();
    let a = ring::hmac::sign(key, presented);
    let b = ring::hmac::sign(key, secret);
    let diff = a
        .as_ref()
        .iter()
        .zip(b.as_ref())
        .fold(u8::from(secret.is_empty()), |acc, (x, y)| {
            acc | std::hint::black_box(x ^ y)
        });
    std::hint::black_box(diff) == 0
}

/// The per-process HMAC key of [`tokens_match`].
fn token_key() -> &'static ring::hmac::Key {
    static KEY: OnceLock<ring::hmac::Key> = OnceLock::new();
    KEY.get_or_init(|| {
        let mut bytes = [0u8; 32];
        // Without an OS random source the tags are still compared without a
        // branch; only their unpredictability is lost.
        let _ = ring::rand::SecureRandom::fill(&ring::rand::SystemRandom::new(), &mut bytes);
        ring::hmac::Key::new(ring::hmac::HMAC_SHA256, &bytes)
    })
}

#[cfg(test)]
mod tests {
    use super::tokens_match;

    #[test]
    fn equal_tokens_match() {
        assert!(tokens_match(b"abc", b"abc"));
        let long = vec![b'z'; 64 * 1024];
        assert!(tokens_match(&long, &long.clone()));
    }

    #[test]
    fn a_differing_byte_anywhere_does_not_match() {
        let secret = b"s3cret-admin-token-0123456789";
        for i in 0..secret.len() {
            let mut p = secret.to_vec();
            p[i] ^= 1;
            assert!(!tokens_match(&p, secret), "byte {i} differs");
        }
    }

    #[test]
    fn different_lengths_and_common_prefixes_do_not_match() {
        assert!(!tokens_match(b"abc", b"abcd"));
        assert!(!tokens_match(b"abcd", b"abc"));
        assert!(!tokens_match(b"abcabc", b"abc"));
        assert!(!tokens_match(b"abc\0", b"abc"));
        assert!(!tokens_match(b"ab", b"abc"));
    }

    #[test]
    fn empty_tokens_never_match() {
        assert!(!tokens_match(b"", b"abc"));
        // An empty secret matches nothing, not even an empty token.
        assert!(!tokens_match(b"", b""));
        assert!(!tokens_match(b"x", b""));
    }
}
