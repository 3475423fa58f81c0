//! A held-back stream whose head has gone out: the upstream answered 200
//! `text/event-stream` and sent SSE comments (`: PROCESSING`, keep-alives)
//! before its first data event.
//!
//! Holding the whole start back would keep those comments from a client
//! until the first token, up to `first_byte_secs`: a client whose read
//! timeout is shorter than the model's time to first token would give up,
//! where a direct connection keeps it alive. So the head is committed as
//! soon as a comment arrives, the comments flow as they come, and only the
//! data events stay held until the start is decided.
//!
//! An in-band overflow error (200 + SSE `error` as the first event) is still
//! retried: nothing but comments has reached the client, so the retry's
//! stream can follow them. While the retry is prepared (a compaction, a
//! summary call) and sent, compactor writes its own `: keep-alive` comment
//! every [`KEEP_ALIVE`]. What a committed head cannot change: its status and
//! headers are the first answer's (`x-compactor-action` says what the first
//! attempt was; the retry shows in `compactor_chat_requests_total
//! {action="retried"}` and the log). A retry that cannot help or does not
//! answer 200 `text/event-stream` leaves the client with the first answer's
//! own bytes, the overflow error included, as without compactor.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::request::Parts;
use http::{header, HeaderMap, Response};
use http_body::{Body, Frame};

use crate::error::{BoxError, ProxyBody};
use crate::session::key::SessionKey;
use crate::upstream::{headers, Upstream, UpstreamBody};
use crate::usage::peek::{HoldBack, Peek, PrefixedBody, Stop};
use crate::usage::{BodyKind, StreamStart};
use crate::window::overflow::{parse_overflow_event, OverflowKind};

use super::prepare::Action;
use super::prepare::Prepared;
use super::respond::{self as walk, HeldBody};
use super::{worker, ChatState};

/// How often compactor's own keep-alive comment is written while an
/// overflow retry is prepared and sent (well under common client read
/// timeouts of 30 s and more).
pub(crate) const KEEP_ALIVE: Duration = Duration::from_secs(10);

/// compactor's keep-alive: a whole SSE comment, which every client ignores.
const KEEP_ALIVE_LINE: &[u8] = b": keep-alive\n\n";

/// What an overflow retry needs, owned by the stream.
pub(super) struct Retry {
    pub(crate) chat: Arc<ChatState>,
    pub(crate) upstream: Arc<Upstream>,
    /// The client's request (method, URI).
    pub(crate) parts: Parts,
    pub(crate) client_headers: Arc<HeaderMap>,
    /// Taken by the retry; released with the stream otherwise.
    pub(crate) job: Option<Box<worker::Job>>,
    pub(crate) key: SessionKey,
    /// This answer is not a retry's (one retry per request).
    pub(crate) allowed: bool,
}

/// Commits the head of `head`'s stream, whose start `peek` is still
/// holding back (led by comment lines), prepared as `prepared`.
pub(super) fn commit(
    mut head: http::response::Parts,
    peek: Peek<UpstreamBody>,
    limit: HoldBack,
    prepared: Prepared,
    retry: Retry,
) -> Response<ProxyBody> {
    headers::strip_hop_by_hop(&mut head.headers);
    // A retry's stream may follow: the first answer's length would lie.
    head.headers.remove(header::CONTENT_LENGTH);
    walk::mark_head(&retry.chat, &mut head.headers, &prepared);
    let state = State::Holding(Box::new(Holding {
        peek,
        limit,
        headers: head.headers.clone(),
        prepared,
        retry,
    }));
    let body = Flowing {
        step: Some(Box::pin(advance(state))),
        rest: None,
    };
    Response::from_parts(head, http_body_util::BodyExt::boxed_unsync(body))
}

/// The start being held back after the head went out.
struct Holding {
    peek: Peek<UpstreamBody>,
    limit: HoldBack,
    /// The committed head's headers (what kind of body follows).
    headers: HeaderMap,
    prepared: Prepared,
    retry: Retry,
}

/// An overflow retry under way, the first answer kept to fall back on.
struct Retrying {
    run: Pin<Box<dyn Future<Output = Option<Answer>> + Send>>,
    first: Holding,
}

/// The retry's answer and what it was prepared as.
type Answer = (Response<UpstreamBody>, Prepared);

enum State {
    Holding(Box<Holding>),
    Retrying(Box<Retrying>),
}

/// One step of the held phase: bytes for the client now, or the body that
/// carries the rest.
enum Step {
    Emit(Bytes, State),
    Rest(ProxyBody),
}

type StepFuture = Pin<Box<dyn Future<Output = Step> + Send>>;

async fn advance(state: State) -> Step {
    match state {
        State::Holding(h) => hold(h).await,
        State::Retrying(r) => retrying(r).await,
    }
}

/// Reads on until comments lead what is held (they go out) or the start is
/// decided: content is released with everything after it, an overflow
/// error starts the retry.
async fn hold(mut h: Box<Holding>) -> Step {
    loop {
        if let Some(comments) = h.peek.take_comments() {
            return Step::Emit(comments, State::Holding(h));
        }
        if h.peek.read(walk::MAX_STREAM_PEEK, h.limit, true).await == Stop::Comments {
            continue;
        }
        let overflow = match h.peek.start() {
            StreamStart::Error(payload) if h.retry.allowed => parse_overflow_event(payload),
            _ => None,
        };
        let Some(of) = overflow.filter(|of| of.kind == OverflowKind::Prompt) else {
            return Step::Rest(release(*h));
        };
        let Some(mut job) = h.retry.job.take() else {
            return Step::Rest(release(*h));
        };
        h.retry.allowed = false;
        walk::begin_retry(
            &h.retry.chat,
            &mut job,
            of,
            h.prepared.est_tokens,
            h.retry.key,
        );
        let run = Box::pin(retry(
            Arc::clone(&h.retry.upstream),
            h.retry.parts.clone(),
            Arc::clone(&h.retry.client_headers),
            job,
        ));
        return retrying(Box::new(Retrying { run, first: *h })).await;
    }
}

/// The first answer as it stands (held frames, then the rest), finished.
fn release(h: Holding) -> ProxyBody {
    let Holding {
        peek,
        mut headers,
        prepared,
        mut retry,
        ..
    } = h;
    if let Some(job) = retry.job.take() {
        worker::release(job);
    }
    let peeked = peek.into_peeked();
    finish(
        &retry,
        http::StatusCode::OK,
        &mut headers,
        peeked.body,
        &prepared,
    )
}

/// [`walk::finish_body`] for a head that went out already: `headers` only
/// tell the body's kind.
fn finish(
    retry: &Retry,
    status: http::StatusCode,
    headers: &mut HeaderMap,
    body: HeldBody,
    prepared: &Prepared,
) -> ProxyBody {
    walk::finish_body(
        &retry.chat,
        &retry.upstream,
        status,
        headers,
        body,
        prepared,
    )
}

/// Waits for the retry, writing a keep-alive every [`KEEP_ALIVE`]: the
/// retry's stream when it answers 200 `text/event-stream`, else the first
/// answer.
async fn retrying(mut r: Box<Retrying>) -> Step {
    tokio::select! {
        answer = &mut r.run => Step::Rest(splice(r.first, answer)),
        () = tokio::time::sleep(KEEP_ALIVE) => Step::Emit(
            Bytes::from_static(KEEP_ALIVE_LINE),
            State::Retrying(r),
        ),
    }
}

fn splice(first: Holding, answer: Option<Answer>) -> ProxyBody {
    let Some((resp, prepared)) = answer else {
        return release(first);
    };
    let (mut parts, body) = resp.into_parts();
    let kind = BodyKind::from_content_type(
        parts
            .headers
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok()),
    );
    if !parts.status.is_success() || kind != BodyKind::Sse {
        // A status or a body the committed head cannot carry.
        return release(first);
    }
    let body = PrefixedBody::new(Default::default(), body, false);
    finish(
        &first.retry,
        parts.status,
        &mut parts.headers,
        body,
        &prepared,
    )
}

/// Prepares the retry (a forced compaction) and sends it; `None` when the
/// compaction could not help or either step failed.
async fn retry(
    upstream: Arc<Upstream>,
    parts: Parts,
    client_headers: Arc<HeaderMap>,
    job: Box<worker::Job>,
) -> Option<Answer> {
    let (retry, job) = worker::run(job).await.ok()?;
    worker::release(job);
    if !retry.fresh_compaction {
        // A recorded substitution alone would resend the same overflowing
        // request: the client gets the upstream's own error.
        return None;
    }
    // The router logged the upstream wait with the head, before this
    // retry inside the stream: its wait is not counted.
    let resp = walk::send(&upstream, &parts, &client_headers, retry.body.clone(), None)
        .await
        .ok()?;
    let prepared = Prepared {
        action: Action::Retried,
        ..retry
    };
    Some((resp, prepared))
}

/// The committed stream's body: the held phase's steps, then the rest.
struct Flowing {
    step: Option<StepFuture>,
    rest: Option<ProxyBody>,
}

impl Body for Flowing {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        loop {
            if let Some(rest) = self.rest.as_mut() {
                return Pin::new(rest).poll_frame(cx);
            }
            let Some(step) = self.step.as_mut() else {
                return Poll::Ready(None);
            };
            match step.as_mut().poll(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Step::Emit(bytes, next)) => {
                    self.step = Some(Box::pin(advance(next)));
                    return Poll::Ready(Some(Ok(Frame::data(bytes))));
                }
                Poll::Ready(Step::Rest(body)) => {
                    self.step = None;
                    self.rest = Some(body);
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.rest.as_ref().is_some_and(Body::is_end_stream)
    }
}
