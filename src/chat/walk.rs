//! The walk of one `POST /v1/chat/completions`:
//!
//! read the body (bounded) → parse (on failure forward the original bytes) →
//! session → `prepare` under the session lock (substitute
//! the recorded prefix → estimate → decide → compact → build the body) →
//! send → on an overflow error before any byte reached the client: learn the
//! window, force a compaction, retry once → [`finish`]: tap usage on the way
//! back (hiding the usage chunk the client did not ask for).
//!
//! The session lock is held while deciding and compacting, never while the
//! response streams.

use std::sync::Arc;

use bytes::Bytes;
use http::request::Parts;
use http::{header, HeaderMap, Request, Response};

use crate::codec::{Api, ApiRequest};
use crate::error::{ErrorShape, ProxyBody};
use crate::session::key::{SessionHints, SessionKey};
use crate::upstream::body::ProxyReqBody;
use crate::upstream::{body_read_error, RequestStats, Upstream, UpstreamBody};
use crate::usage::peek::{peek_start, HoldBack, Peek, Stop};
use crate::usage::{BodyKind, StreamStart};
use crate::window::overflow::{parse_overflow, parse_overflow_event, Overflow, OverflowKind};

use super::conversation::Conversation;
use super::prepare::Prepared;
use super::respond::{begin_retry, finish_body, mark_head, send, HeldBody, MAX_STREAM_PEEK};
pub use super::respond::{ACTION_HEADER, REPLACED_HEADER, SESSION_HEADER};
use super::{held, worker, ChatState};

// Still `chat::walk::Action` for the crate's users: the walk writes it
// into the response header.
pub use super::prepare::Action;

/// Error bodies up to this size are read to look for an overflow.
const MAX_ERROR_PEEK: usize = 256 << 10;
/// The error shape of `api`'s clients.
pub(crate) fn error_shape(api: Api) -> ErrorShape {
    match api {
        Api::Messages => ErrorShape::Anthropic,
        Api::Ollama => ErrorShape::Ollama,
        Api::Chat | Api::Responses => ErrorShape::OpenAi,
    }
}

/// Handles one conversation request of `api` (chat completions, Anthropic
/// Messages, OpenAI Responses): the same walk, the API's codec.
pub async fn handle_api(
    api: Api,
    chat: &Arc<ChatState>,
    upstream: &Arc<Upstream>,
    req: Request<ProxyReqBody>,
    stats: &RequestStats,
) -> Response<ProxyBody> {
    let (mut parts, body) = req.into_parts();
    // A compressed body cannot be read without decoding it: forward untouched.
    // The rare branches' awaits are boxed: inline, their state would be
    // part of every request's future, copied each time it moves.
    if parts.headers.contains_key(header::CONTENT_ENCODING) {
        return Box::pin(upstream.forward(Request::from_parts(parts, body), stats)).await;
    }
    let seen = Some(Arc::clone(&stats.bytes_in));
    let guard = worker::BodyGuard::new(&chat.metrics, seen);
    let bytes = match crate::upstream::body::whole(body).await {
        Ok(b) => b,
        Err(e) => return upstream.error_reply_in(error_shape(api), &body_read_error(&e)),
    };
    guard.complete();
    // Once per request: a retry prepares the same decoded request again.
    let creq = match worker::decode(chat, api, bytes.clone()).await {
        Ok(creq) => creq,
        Err(e) => return Box::pin(unmapped(chat, upstream, api, (parts, bytes), &e, stats)).await,
    };
    let (job, client_headers, key) = job_for(chat, upstream, &mut parts, creq, bytes.len());
    let (mut prepared, mut job) = match worker::run(job).await {
        Ok(done) => done,
        Err(e) => return upstream.error_reply_in(error_shape(api), &e),
    };
    let mut retried = false;
    loop {
        let body = prepared.body.clone();
        let resp = match send(upstream, &parts, &client_headers, body, Some(stats)).await {
            Ok(r) => r,
            Err(e) => return upstream.error_reply_in(error_shape(api), &e),
        };
        let limit = hold_back(upstream);
        let (resp, overflow) = match inspect(resp, prepared.plan.stream, limit).await {
            Inspected::Held(resp, overflow) => (resp, overflow),
            Inspected::Flowing(head, peek) => {
                // Comments came before the first data event: the head goes
                // out now and they flow; an in-band overflow is still
                // retried, inside the stream.
                let retry = held::Retry {
                    chat: Arc::clone(chat),
                    upstream: Arc::clone(upstream),
                    parts,
                    client_headers,
                    job: Some(job),
                    key,
                    allowed: !retried,
                };
                return held::commit(head, peek, limit, prepared, retry);
            }
        };
        match overflow {
            Some(of) if !retried && of.kind == OverflowKind::Prompt => {
                retried = true;
                begin_retry(chat, &mut job, of, prepared.est_tokens, key);
                let retry;
                (retry, job) = match worker::run(job).await {
                    Ok(done) => done,
                    Err(e) => return upstream.error_reply_in(error_shape(api), &e),
                };
                if !retry.fresh_compaction {
                    // Compaction could not help (a recorded substitution
                    // alone would resend the same overflowing request): the
                    // client gets the upstream's own error.
                    worker::release(job);
                    return finish(chat, upstream, resp, &prepared);
                }
                prepared = Prepared {
                    action: Action::Retried,
                    ..retry
                };
            }
            _ => {
                // No retry from here on: the decoded request goes before
                // the response streams.
                worker::release(job);
                return finish(chat, upstream, resp, &prepared);
            }
        }
    }
}

/// The preparation job of a decoded request: its session (key, credential,
/// where the id came from) and the client's headers, moved out of `parts`
/// and shared with the detached preparations rather than copied for each.
fn job_for(
    chat: &Arc<ChatState>,
    upstream: &Arc<Upstream>,
    parts: &mut Parts,
    creq: ApiRequest,
    body_len: usize,
) -> (Box<worker::Job>, Arc<HeaderMap>, SessionKey) {
    let (session_id, cache_key) = (creq.session_id(), creq.prompt_cache_key());
    let model = creq.model();
    let hints = SessionHints {
        session_id: session_id.as_deref(),
        prompt_cache_key: cache_key.as_deref(),
        model: model.as_deref(),
        messages: creq.messages(),
        raw_hashes: Some(creq.raw_hashes()),
    };
    let (key, source, cred) = chat.keyer.derive_hints(&parts.headers, &parts.uri, &hints);
    let cred = cred.as_u128();
    let entry = chat.sessions.get_or_create(key, Conversation::default);
    let client_headers = Arc::new(std::mem::take(&mut parts.headers));

    // A preparation that waits goes on in a task of its own: a client
    // leaving mid-compaction does not cancel the compaction (its record
    // serves the next turn).
    let job = Box::new(worker::Job {
        chat: Arc::clone(chat),
        upstream: Arc::clone(upstream),
        entry,
        client_headers: Arc::clone(&client_headers),
        credential_query: crate::session::key::credential_query_of(&parts.uri),
        creq,
        key: (key, cred),
        id_kind: source.label(),
        overflow: None,
        body_len,
    });
    (job, client_headers, key)
}

/// A request its codec cannot map (or one that depends on state the
/// upstream keeps): the upstream answers it, and the operator can see why
/// it was not compacted (logged content-free, and counted).
async fn unmapped(
    chat: &ChatState,
    upstream: &Upstream,
    api: Api,
    (parts, bytes): (Parts, Bytes),
    e: &crate::codec::DecodeError,
    stats: &RequestStats,
) -> Response<ProxyBody> {
    let (reason, member, role) = e.labels();
    chat.metrics
        .chat
        .unmapped((api.label(), reason, member, role));
    tracing::info!(
        api = api.label(),
        reason,
        member,
        role,
        "request forwarded untouched: its codec cannot map it (no compaction)"
    );
    send_plain(upstream, api, parts, bytes, stats).await
}

/// Forwards bytes we could not parse exactly as received.
async fn send_plain(
    upstream: &Upstream,
    api: Api,
    parts: Parts,
    bytes: Bytes,
    stats: &RequestStats,
) -> Response<ProxyBody> {
    match upstream.send_bytes(&parts, bytes, Some(stats)).await {
        Ok(resp) => upstream.stream_response(resp),
        Err(e) => upstream.error_reply_in(error_shape(api), &e),
    }
}

/// How long a response start may be held back from now: the idle timeout
/// between frames, the first-byte timeout overall. The hold-back is
/// compactor's own wait, so the upstream's timeouts bound it.
fn hold_back(upstream: &Upstream) -> HoldBack {
    let t = upstream.timeouts();
    HoldBack {
        idle: t.idle,
        deadline: crate::clock::from_now(t.first_byte),
    }
}

/// What [`inspect`] read of a response.
// One per response, moved straight on: boxing either variant only adds an
// allocation.
#[allow(clippy::large_enum_variant)]
enum Inspected {
    /// Its start (or all of it), held back, and the overflow it reported.
    Held(Response<HeldBody>, Option<Overflow>),
    /// A stream (200, `text/event-stream`) whose start is undecided but
    /// led by comment lines: they should reach the client now.
    Flowing(http::response::Parts, Peek<UpstreamBody>),
}

/// Reads the start of the response: the whole error body (bounded) for an
/// error status, the first events of a stream; reports an overflow that
/// arrived before any content. Bounded by `limit`: what arrived by then is
/// released, and a body failing meanwhile is forwarded up to the failure.
async fn inspect(resp: Response<UpstreamBody>, stream: bool, limit: HoldBack) -> Inspected {
    let (parts, body) = resp.into_parts();
    let status = parts.status;
    let ct = parts
        .headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok());
    let kind = BodyKind::from_content_type(ct);
    if !status.is_success() {
        // The whole error body (bounded), whatever its content type.
        let peeked = peek_start(body, BodyKind::Json, MAX_ERROR_PEEK, limit).await;
        let overflow = match peeked.start {
            StreamStart::Undecided => None,
            _ => parse_overflow(status.as_u16(), &peeked.body.held_bytes()),
        };
        return Inspected::Held(Response::from_parts(parts, peeked.body), overflow);
    }
    if stream && kind == BodyKind::Sse {
        let mut peek = Peek::new(body, kind);
        if peek.read(MAX_STREAM_PEEK, limit, true).await == Stop::Comments {
            return Inspected::Flowing(parts, peek);
        }
        let peeked = peek.into_peeked();
        let overflow = match &peeked.start {
            StreamStart::Error(payload) => parse_overflow_event(payload),
            _ => None,
        };
        return Inspected::Held(Response::from_parts(parts, peeked.body), overflow);
    }
    let body = crate::usage::peek::PrefixedBody::new(Default::default(), body, false);
    Inspected::Held(Response::from_parts(parts, body), None)
}

/// Turns the upstream response into ours: usage tap (and hider), idle
/// timeout, compactor headers.
fn finish(
    chat: &ChatState,
    upstream: &Upstream,
    resp: Response<HeldBody>,
    prepared: &Prepared,
) -> Response<ProxyBody> {
    let (mut parts, body) = resp.into_parts();
    let body = finish_body(
        chat,
        upstream,
        parts.status,
        &mut parts.headers,
        body,
        prepared,
    );
    mark_head(chat, &mut parts.headers, prepared);
    Response::from_parts(parts, body)
}
