//! Holding back the start of a streamed response until it is known whether
//! it begins with content or with an error, so an overflow error sent
//! in-band (HTTP 200 + SSE `error`) can still be retried before the client
//! has seen a byte.
//!
//! Trade-off for the caller: SSE keep-alive comments sent while the upstream
//! processes a long prompt are held too; bound the wait with a timeout (and
//! the buffer with `max_bytes`) and forward what was held when it expires.

use std::collections::VecDeque;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use http_body_util::BodyExt;
use pin_project_lite::pin_project;
use tokio::time::Instant;

use super::{BodyKind, StreamStart, UsageExtractor};

/// The held start of a response and the rest of it.
pub struct Peeked<B: Body> {
    /// How the response started (`Undecided` when the cap or the end came
    /// first).
    pub start: StreamStart,
    /// The body with the held frames put back in front.
    pub body: PrefixedBody<B>,
}

/// How long the start of a response may be held back: at most `idle`
/// between two frames and until `deadline` overall. When either expires
/// the hold-back stops and what arrived is released (the caller's own
/// timeouts govern the rest of the body).
#[derive(Debug, Clone, Copy)]
pub struct HoldBack {
    /// Longest wait for the next frame.
    pub idle: Duration,
    /// When holding back stops, whatever has arrived.
    pub deadline: Instant,
}

/// Reads `body` until its start is decided, it ends, it fails, more than
/// `max_bytes` are held or `limit` expires. Never fails: an error of the
/// body is handed over after the held frames, so the client gets the
/// upstream's bytes and then sees the cut.
pub async fn peek_start<B>(
    mut body: B,
    kind: BodyKind,
    max_bytes: usize,
    limit: HoldBack,
) -> Peeked<B>
where
    B: Body<Data = Bytes> + Unpin,
{
    let mut ex = UsageExtractor::new(kind);
    let mut held = VecDeque::new();
    let mut bytes = 0usize;
    let mut ended = false;
    let mut error = None;
    while *ex.start() == StreamStart::Undecided && bytes <= max_bytes {
        let until = limit.deadline.min(Instant::now() + limit.idle);
        let Ok(next) = tokio::time::timeout_at(until, body.frame()).await else {
            break;
        };
        match next {
            Some(Ok(frame)) => {
                if let Some(d) = frame.data_ref() {
                    ex.feed(d);
                    bytes += d.len();
                }
                held.push_back(frame);
                if body.is_end_stream() {
                    ended = true;
                    break;
                }
            }
            Some(Err(e)) => {
                error = Some(e);
                break;
            }
            None => {
                ended = true;
                break;
            }
        }
    }
    if ended {
        ex.finish();
    }
    let mut body = PrefixedBody::new(held, body, ended);
    body.error = error;
    Peeked {
        start: ex.start().clone(),
        body,
    }
}

pin_project! {
    /// Yields the held frames, then the inner body (or the error it failed
    /// with while the frames were held).
    pub struct PrefixedBody<B: Body> {
        prefix: VecDeque<Frame<Bytes>>,
        #[pin]
        inner: B,
        inner_done: bool,
        error: Option<B::Error>,
    }
}

impl<B: Body> PrefixedBody<B> {
    /// `prefix` first, then `inner` (skipped when `inner_done`).
    pub fn new(prefix: VecDeque<Frame<Bytes>>, inner: B, inner_done: bool) -> Self {
        Self {
            prefix,
            inner,
            inner_done,
            error: None,
        }
    }

    /// The held frames' data, concatenated (e.g. an error payload to parse).
    pub fn held_bytes(&self) -> Vec<u8> {
        let mut out = Vec::new();
        for f in &self.prefix {
            if let Some(d) = f.data_ref() {
                out.extend_from_slice(d);
            }
        }
        out
    }
}

impl<B> Body for PrefixedBody<B>
where
    B: Body<Data = Bytes>,
{
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
        let this = self.project();
        if let Some(f) = this.prefix.pop_front() {
            return Poll::Ready(Some(Ok(f)));
        }
        if let Some(e) = this.error.take() {
            *this.inner_done = true;
            return Poll::Ready(Some(Err(e)));
        }
        if *this.inner_done {
            return Poll::Ready(None);
        }
        this.inner.poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.prefix.is_empty()
            && self.error.is_none()
            && (self.inner_done || self.inner.is_end_stream())
    }

    fn size_hint(&self) -> SizeHint {
        let held: u64 = self
            .prefix
            .iter()
            .filter_map(|f| f.data_ref().map(|d| d.len() as u64))
            .sum();
        if self.inner_done {
            return SizeHint::with_exact(held);
        }
        let inner = self.inner.size_hint();
        let mut h = SizeHint::new();
        h.set_lower(inner.lower().saturating_add(held));
        if let Some(u) = inner.upper() {
            h.set_upper(u.saturating_add(held));
        }
        h
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::upstream::body::tap_tests::MockBody;
    use crate::window::parse_overflow_event;

    fn unbounded() -> HoldBack {
        HoldBack {
            idle: Duration::from_secs(3600),
            deadline: Instant::now() + Duration::from_secs(3600),
        }
    }

    fn frames(parts: &[&'static [u8]]) -> MockBody {
        MockBody::new(
            parts
                .iter()
                .map(|p| Some(Ok(Frame::data(Bytes::from_static(p)))))
                .collect(),
        )
    }

    #[tokio::test]
    async fn content_start_releases_everything_in_order() {
        let parts: [&'static [u8]; 4] = [
            b": ping\n\n",
            b"data: {\"choices\":[{\"delta\":{\"role\":\"assistant\"}}]}\n\n",
            b"data: {\"choices\":[{\"delta\":{\"content\":\"Hi\"}}]}\n\n",
            b"data: [DONE]\n\n",
        ];
        let p = peek_start(frames(&parts), BodyKind::Sse, 1 << 20, unbounded()).await;
        assert_eq!(p.start, StreamStart::Content);
        // Only up to the first content event was read.
        assert_eq!(p.body.prefix.len(), 3);
        let all = p.body.collect().await.unwrap().to_bytes();
        assert_eq!(&all[..], parts.concat().as_slice());
    }

    #[tokio::test]
    async fn in_band_overflow_is_caught_before_release() {
        let parts: [&'static [u8]; 2] = [
            b": ping\n\n",
            b"data: {\"error\":{\"code\":400,\"message\":\"request (5000 tokens) exceeds the available context size (4096 tokens), try increasing it\",\"type\":\"exceed_context_size_error\",\"n_prompt_tokens\":5000,\"n_ctx\":4096}}\n\n",
        ];
        let p = peek_start(frames(&parts), BodyKind::Sse, 1 << 20, unbounded()).await;
        let StreamStart::Error(payload) = &p.start else {
            panic!("{:?}", p.start)
        };
        let o = parse_overflow_event(payload).unwrap();
        assert_eq!((o.limit, o.requested), (Some(4096), Some(5000)));
    }

    #[tokio::test]
    async fn cap_and_end_leave_it_undecided() {
        let parts: [&'static [u8]; 2] = [b": a\n\n", b": b\n\n"];
        let p = peek_start(frames(&parts), BodyKind::Sse, 3, unbounded()).await;
        assert_eq!(p.start, StreamStart::Undecided);
        assert_eq!(p.body.collect().await.unwrap().to_bytes(), parts.concat());
        let p = peek_start(
            frames(&[b"data: x\n\n"]),
            BodyKind::Sse,
            1 << 20,
            unbounded(),
        )
        .await;
        assert_eq!(p.start, StreamStart::Undecided);
        assert!(!p.body.is_end_stream());
        assert_eq!(p.body.held_bytes(), b"data: x\n\n");
    }
}
