//! The admin API, behind the admin token: `GET /_compactor/sessions` (the
//! conversations, most recently active first, with their figures) and
//! `GET /_compactor/sessions/{key}` (one conversation: its figures, the
//! ring of its last turns and compactions). Content-free unless the operator
//! opted in (`[admin] show_content`). The inspector page (`super::ui`) is a
//! client of these two.

use std::sync::OnceLock;

use bytes::Bytes;
use http::{header, HeaderMap, HeaderValue, Request, Response, StatusCode};
use serde_json::{json, Map, Value};

use crate::chat::conversation::Conversation;
use crate::chat::record::Record;
use crate::chat::ChatState;
use crate::error::{error_response, full_body, ProxyBody};
use crate::session::key::SessionKey;

/// Path prefix of the session view.
pub const SESSIONS_PREFIX: &str = "/_compactor/sessions/";

/// How long the view waits for a conversation's lock before it answers
/// from the last view it rendered.
const LOCK_WAIT: std::time::Duration = std::time::Duration::from_millis(100);

/// Conversations listed when the request does not say (`?limit=`).
const DEFAULT_LIST_LIMIT: usize = 200;
/// Most conversations one list answers.
const MAX_LIST_LIMIT: usize = 2000;

/// Members of a rendered view the list leaves out (the list carries the
/// figures, not the rings or the content).
const LIST_OMITS: [&str; 6] = [
    "turn_figures",
    "compaction_figures",
    "content",
    "trigger",
    "stats",
    "record",
];

/// What the admin endpoints need of the configuration.
#[derive(Debug, Clone, Copy)]
pub struct Admin<'a> {
    /// `[admin] token`; `None`: the admin API is off.
    pub token: Option<&'a str>,
    /// `[admin] show_content`.
    pub show_content: bool,
}

/// The admin token check every admin endpoint makes: `Err` is the answer
/// (403 when no token is configured, 401 when the presented one is missing
/// or wrong).
pub fn authorize(
    admin_token: Option<&str>,
    headers: &HeaderMap,
) -> Result<(), Box<Response<ProxyBody>>> {
    let Some(token) = admin_token else {
        return Err(Box::new(error_response(
            StatusCode::FORBIDDEN,
            "the admin API needs an admin token ([admin] token)",
            "permission_error",
            "admin_disabled",
        )));
    };
    let presented = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "));
    if !presented.is_some_and(|p| tokens_match(p.as_bytes(), token.as_bytes())) {
        return Err(Box::new(error_response(
            StatusCode::UNAUTHORIZED,
            "missing or wrong admin token",
            "authentication_error",
            "invalid_admin_token",
        )));
    }
    Ok(())
}

/// Serves the session view; `path` starts with [`SESSIONS_PREFIX`].
pub async fn session_view<B>(
    admin: Admin<'_>,
    chat: &ChatState,
    req: &Request<B>,
) -> Response<ProxyBody> {
    if let Err(denied) = authorize(admin.token, req.headers()) {
        return *denied;
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
            let view = render(&key, &mut conv, admin.show_content);
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

/// Serves `GET /_compactor/sessions[?limit=N]`: the most recently active
/// conversations first, each with its figures. Never waits for a lock: a
/// conversation being compacted is answered from its last rendered view,
/// marked `busy`.
pub async fn sessions_list<B>(
    admin: Admin<'_>,
    chat: &ChatState,
    req: &Request<B>,
) -> Response<ProxyBody> {
    if let Err(denied) = authorize(admin.token, req.headers()) {
        return *denied;
    }
    let limit = req
        .uri()
        .query()
        .and_then(|q| {
            q.split('&')
                .find_map(|kv| kv.strip_prefix("limit="))
                .and_then(|v| v.parse::<usize>().ok())
        })
        .unwrap_or(DEFAULT_LIST_LIMIT)
        .min(MAX_LIST_LIMIT);
    let mut rows = Vec::new();
    for (key, entry, idle) in chat.sessions.recent(limit) {
        let idle_ms = u64::try_from(idle.as_millis()).unwrap_or(u64::MAX);
        let mut r = match entry.state().try_lock() {
            Ok(mut conv) => {
                let r = row(&key, &mut conv);
                entry.merge_snapshot(&r);
                with_busy(Value::Object(r), false)
            }
            Err(_) => {
                let kept = entry.snapshot().and_then(|v| match v {
                    Value::Object(mut o) => {
                        // The list carries the figures, not the ring.
                        for k in LIST_OMITS {
                            o.remove(k);
                        }
                        Some(o)
                    }
                    _ => None,
                });
                let r = kept.unwrap_or_else(|| {
                    let mut o = Map::new();
                    o.insert("session".into(), key.to_string().into());
                    o
                });
                with_busy(Value::Object(r), true)
            }
        };
        if let Some(o) = r.as_object_mut() {
            o.insert("idle_ms".into(), idle_ms.into());
        }
        rows.push(r);
    }
    let body = json!({
        "sessions": rows,
        "total": chat.sessions.len(),
        "limit": limit,
        "show_content": admin.show_content,
    });
    json_response(StatusCode::OK, body.to_string())
}

/// `view` with `busy`: whether the conversation was locked (compacting)
/// and the view is the last one rendered before, possibly only its key.
fn with_busy(mut view: Value, busy: bool) -> Value {
    if let Some(o) = view.as_object_mut() {
        o.insert("busy".to_owned(), Value::Bool(busy));
    }
    view
}

/// One conversation's figures, as the list shows them (the view shows them
/// too, with more). Drains the usage inbox first, so the last real prompt
/// count is the newest the upstream reported.
fn row(key: &SessionKey, conv: &mut Conversation) -> Map<String, Value> {
    conv.drain_inbox();
    let trigger = conv.compressor.as_ref().map(|c| c.trigger().status());
    // The engine works in rough units; show real tokens at the top level.
    let scale = conv.engine_scale().factor();
    let real = |rough: u64| (rough as f64 * scale).round() as u64;
    // The threshold was derived for the engine window of its own time: in
    // real tokens it is that window's share of the real one, not the
    // threshold times a scale the drain above may just have moved (a
    // trigger of 35,815 was shown against a window of 30,000).
    let threshold =
        trigger
            .as_ref()
            .and_then(|t| match (t.threshold_tokens, t.window, conv.real_window) {
                (Some(th), Some(w), Some(real_w)) if w > 0 => {
                    Some((u128::from(th) * u128::from(real_w) / u128::from(w)) as u64)
                }
                (th, _, _) => th.map(real),
            });
    let calibration = conv.calibration.snapshot();
    let mut o = match conv.inspect.summary() {
        Value::Object(o) => o,
        _ => Map::new(),
    };
    let s = &conv.stats;
    let fields = json!({
        "session": key.to_string(),
        "window": conv.real_window.or(trigger.as_ref().and_then(|t| t.window)),
        "threshold_tokens": threshold,
        "last_real_prompt_tokens": calibration.last_real_prompt_tokens,
        "last_action": conv.last_action,
        "requests": s.requests,
        "compactions": s.compactions,
        "fallback_compactions": s.fallback_compactions,
        "summary_calls": s.summary_calls,
        "overflow_retries": s.overflow_retries,
        "truncations": s.truncations,
        "aborted": s.aborted,
        "tokens_saved": real(s.tokens_saved),
    });
    if let Value::Object(f) = fields {
        o.extend(f);
    }
    o
}

/// The view of one conversation: its figures, the ring of its turns and
/// compactions, and (only with `show_content`) what its record holds.
fn render(key: &SessionKey, conv: &mut Conversation, show_content: bool) -> Value {
    let mut o = row(key, conv);
    let trigger = conv.compressor.as_ref().map(|c| c.trigger().status());
    let calibration = conv.calibration.snapshot();
    let record = conv.record();
    let summary = record.as_ref().map(|r| {
        json!({
            "replaced_messages": r.k,
            "replacement_messages": r.replacement.len(),
            "replacement_bytes": r.bytes(),
            "original_tokens": r.original_tokens,
            "replacement_tokens": r.replacement_tokens,
        })
    });
    let more = json!({
        "engine_scale": conv.engine_scale().factor(),
        "estimate_error": calibration.last_estimate_error,
        "calibration_ratio": calibration.ratio,
        "usage_reports": calibration.observations,
        "stats": conv.stats,
        "record": summary,
        "trigger": trigger,
        "turn_figures": conv.inspect.turns_json(),
        "compaction_figures": conv.inspect.compactions_json(),
        "content": if show_content { record.as_deref().map(content) } else { None },
    });
    if let Value::Object(m) = more {
        o.extend(m);
    }
    Value::Object(o)
}

/// What a compaction record holds, for an operator who opted in: which of
/// the client's messages it replaced, and the text of its summary rows.
fn content(r: &Record) -> Value {
    let rows: Vec<usize> = r.summary_rows().collect();
    let summaries: Vec<Value> = rows
        .iter()
        .filter_map(|&i| r.replacement.get(i))
        .map(|m| {
            let v: Value = serde_json::from_str(m.get()).unwrap_or(Value::Null);
            let text = match v.get("content") {
                Some(Value::String(s)) => s.clone(),
                Some(other) => other.to_string(),
                None => m.get().to_owned(),
            };
            json!({ "role": v.get("role"), "text": text })
        })
        .collect();
    json!({
        "replaced": { "from": 0, "to": r.k },
        "replacement_rows": r.replacement.len(),
        "summary_rows": rows,
        "summaries": summaries,
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

/// The Content-Security-Policy of every admin and inspector response: the
/// page runs only its own scripts and styles and talks only to its origin.
pub const CSP: &str = "default-src 'none'; script-src 'self'; style-src 'self'; \
    img-src 'self' data:; connect-src 'self'; base-uri 'none'; form-action 'none'; \
    frame-ancestors 'none'";

/// Headers every admin and inspector response carries: never cached (the
/// figures are live and behind a token), a restrictive CSP, no sniffing, no
/// referrer.
pub fn guard(resp: &mut Response<ProxyBody>) {
    let h = resp.headers_mut();
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    h.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(CSP),
    );
    h.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    h.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("no-referrer"),
    );
    h.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
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
