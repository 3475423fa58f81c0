//! Holding back the start of a streamed response until it is known whether
//! it begins with content or with an error, so an overflow error sent
//! in-band (HTTP 200 + SSE `error`) can still be retried before the client
//! has seen a data event.
//!
//! SSE comment lines (`: PROCESSING`, keep-alives an upstream sends while
//! it reads a long prompt) are not held: [`Peek::take_comments`] splits the
//! whole comment lines at the front of what is held off, so the caller can
//! forward them as they arrive. The bytes the client finally sees are the
//! same bytes in the same order; only their split into frames differs.
//! The wait is bounded by a timeout (and the buffer by `max_bytes`): what
//! was held is forwarded when it expires.

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
pub(crate) struct Peeked<B: Body> {
    /// How the response started (`Undecided` when the cap or the end came
    /// first).
    pub(crate) start: StreamStart,
    /// The body with the held frames put back in front.
    pub(crate) body: PrefixedBody<B>,
}

/// How long the start of a response may be held back: at most `idle`
/// between two frames and until `deadline` overall. When either expires
/// the hold-back stops and what arrived is released (the caller's own
/// timeouts govern the rest of the body).
#[derive(Debug, Clone, Copy)]
pub(crate) struct HoldBack {
    /// Longest wait for the next frame.
    pub(crate) idle: Duration,
    /// When holding back stops, whatever has arrived.
    pub(crate) deadline: Instant,
}

/// Why [`Peek::read`] returned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Stop {
    /// Held off no longer: the start is decided, the body ended or failed,
    /// the cap was passed or the time is up.
    Done,
    /// Whole comment lines lead what is held ([`Peek::take_comments`]).
    Comments,
}

/// A response start being read: the frames held so far and the body.
pub(crate) struct Peek<B: Body> {
    body: B,
    ex: UsageExtractor,
    held: VecDeque<Frame<Bytes>>,
    bytes: usize,
    ended: bool,
    error: Option<B::Error>,
}

impl<B> Peek<B>
where
    B: Body<Data = Bytes> + Unpin,
{
    /// Starts reading `body` as `kind`.
    pub(crate) fn new(body: B, kind: BodyKind) -> Self {
        Self {
            body,
            ex: UsageExtractor::new(kind),
            held: VecDeque::new(),
            bytes: 0,
            ended: false,
            error: None,
        }
    }

    /// Reads until the start is decided, the body ends, it fails, more than
    /// `max_bytes` are held or `limit` expires; with `comments`, also as
    /// soon as comment lines lead what is held. Never fails: an error of
    /// the body is handed over after the held frames.
    pub(crate) async fn read(&mut self, max_bytes: usize, limit: HoldBack, comments: bool) -> Stop {
        while !self.is_done(max_bytes) {
            if comments && comment_prefix_len(&self.held) > 0 {
                return Stop::Comments;
            }
            let until = limit.deadline.min(crate::clock::from_now(limit.idle));
            let Ok(next) = tokio::time::timeout_at(until, self.body.frame()).await else {
                break;
            };
            match next {
                Some(Ok(frame)) => {
                    if let Some(d) = frame.data_ref() {
                        self.ex.feed_start(d);
                        self.bytes += d.len();
                    }
                    self.held.push_back(frame);
                    if self.body.is_end_stream() {
                        self.end();
                    }
                }
                Some(Err(e)) => {
                    self.error = Some(e);
                }
                None => self.end(),
            }
        }
        // Nothing is held off any more: comments are released with the
        // rest, not split off.
        Stop::Done
    }

    fn is_done(&self, max_bytes: usize) -> bool {
        *self.ex.start() != StreamStart::Undecided
            || self.bytes > max_bytes
            || self.ended
            || self.error.is_some()
    }

    fn end(&mut self) {
        self.ended = true;
        self.ex.finish();
    }

    /// How the response started so far.
    pub(crate) fn start(&self) -> &StreamStart {
        self.ex.start()
    }

    /// Splits off the whole comment lines (and blank lines) at the front of
    /// what is held; `None` when none lead it.
    pub(crate) fn take_comments(&mut self) -> Option<Bytes> {
        let mut want = comment_prefix_len(&self.held);
        if want == 0 {
            return None;
        }
        let mut out = Vec::with_capacity(want);
        while want > 0 {
            let Some(front) = self.held.front_mut() else {
                break;
            };
            let Some(d) = front.data_mut() else {
                // Trailers are never in front of data.
                break;
            };
            if d.len() <= want {
                want -= d.len();
                out.extend_from_slice(d);
                self.held.pop_front();
            } else {
                out.extend_from_slice(&d.split_to(want));
                want = 0;
            }
        }
        self.bytes = self.bytes.saturating_sub(out.len());
        Some(Bytes::from(out))
    }

    /// The held frames in front of the rest of the body.
    pub(crate) fn into_peeked(self) -> Peeked<B> {
        let start = self.ex.start().clone();
        let mut body = PrefixedBody::new(self.held, self.body, self.ended);
        body.error = self.error;
        Peeked { start, body }
    }
}

/// Length of the whole SSE comment lines (`:` to the line's end) and blank
/// lines at the front of `frames`. A line is whole only once its end is
/// seen; a `\r` at the end of what arrived waits for the byte after it (it
/// may be the first half of `\r\n`).
fn comment_prefix_len(frames: &VecDeque<Frame<Bytes>>) -> usize {
    let bytes = frames
        .iter()
        .filter_map(Frame::data_ref)
        .flat_map(|d| d.iter().copied());
    let (mut pos, mut whole) = (0usize, 0usize);
    let mut at_start = true;
    let mut after_cr = false;
    for b in bytes {
        if after_cr {
            after_cr = false;
            whole = pos;
            at_start = true;
            if b == b'\n' {
                pos += 1;
                whole = pos;
                continue;
            }
        }
        if at_start && b != b':' && b != b'\n' && b != b'\r' {
            break;
        }
        at_start = false;
        pos += 1;
        match b {
            b'\n' => {
                whole = pos;
                at_start = true;
            }
            b'\r' => after_cr = true,
            _ => {}
        }
    }
    whole
}

/// Reads `body` until its start is decided, it ends, it fails, more than
/// `max_bytes` are held or `limit` expires. Never fails: an error of the
/// body is handed over after the held frames, so the client gets the
/// upstream's bytes and then sees the cut.
pub(crate) async fn peek_start<B>(
    body: B,
    kind: BodyKind,
    max_bytes: usize,
    limit: HoldBack,
) -> Peeked<B>
where
    B: Body<Data = Bytes> + Unpin,
{
    let mut peek = Peek::new(body, kind);
    peek.read(max_bytes, limit, false).await;
    peek.into_peeked()
}

pin_project! {
    /// Yields the held frames, then the inner body (or the error it failed
    /// with while the frames were held).
    pub(crate) struct PrefixedBody<B: Body> {
        prefix: VecDeque<Frame<Bytes>>,
        #[pin]
        inner: B,
        inner_done: bool,
        error: Option<B::Error>,
    }
}

impl<B: Body> PrefixedBody<B> {
    /// `prefix` first, then `inner` (skipped when `inner_done`).
    pub(crate) fn new(prefix: VecDeque<Frame<Bytes>>, inner: B, inner_done: bool) -> Self {
        Self {
            prefix,
            inner,
            inner_done,
            error: None,
        }
    }

    /// The held frames' data, concatenated (e.g. an error payload to parse).
    pub(crate) fn held_bytes(&self) -> Vec<u8> {
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
            // Not exact: hyper's server would frame a chunked response
            // with a Content-Length the upstream did not send.
            let mut hint = SizeHint::new();
            hint.set_lower(held);
            return hint;
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
    use crate::window::overflow::parse_overflow_event;

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

    fn held(parts: &[&'static [u8]]) -> VecDeque<Frame<Bytes>> {
        parts
            .iter()
            .map(|p| Frame::data(Bytes::from_static(p)))
            .collect()
    }

    #[test]
    fn comment_prefix_is_whole_comment_and_blank_lines() {
        assert_eq!(comment_prefix_len(&held(&[b": a\n\n: b\n"])), 9);
        // Across frames, CRLF, a bare CR line end.
        assert_eq!(
            comment_prefix_len(&held(&[b": PROC", b"ESSING\r", b"\n\r\n"])),
            16
        );
        assert_eq!(comment_prefix_len(&held(&[b": a\r: b\r\n"])), 9);
        // Not yet whole: no line end, or a CR that may be half of CRLF.
        assert_eq!(comment_prefix_len(&held(&[b": a"])), 0);
        assert_eq!(comment_prefix_len(&held(&[b": a\n: b\r"])), 4);
        // Any field line ends the prefix, even one sharing a frame.
        assert_eq!(comment_prefix_len(&held(&[b": a\ndata: x\n\n"])), 4);
        assert_eq!(comment_prefix_len(&held(&[b"event: e\n: a\n"])), 0);
        assert_eq!(comment_prefix_len(&held(&[b"data: x\n\n: a\n"])), 0);
    }

    #[tokio::test]
    async fn comments_are_split_off_and_the_rest_stays_held() {
        let parts: [&'static [u8]; 3] = [
            b": PROCESSING\n\n",
            b": PROCESSING\n\ndata: {\"choices\":[{\"delta\"",
            b":{\"content\":\"Hi\"}}]}\n\ndata: [DONE]\n\n",
        ];
        let mut peek = Peek::new(frames(&parts), BodyKind::Sse);
        assert_eq!(peek.read(1 << 20, unbounded(), true).await, Stop::Comments);
        let mut out = peek.take_comments().unwrap().to_vec();
        assert_eq!(out, b": PROCESSING\n\n");
        assert_eq!(peek.take_comments(), None);
        assert_eq!(peek.read(1 << 20, unbounded(), true).await, Stop::Comments);
        // The comment in front of the data event's start goes, not the data.
        out.extend_from_slice(&peek.take_comments().unwrap());
        assert_eq!(out, b": PROCESSING\n\n: PROCESSING\n\n");
        assert_eq!(peek.read(1 << 20, unbounded(), true).await, Stop::Done);
        assert_eq!(*peek.start(), StreamStart::Content);
        let rest = peek.into_peeked().body.collect().await.unwrap().to_bytes();
        out.extend_from_slice(&rest);
        assert_eq!(out, parts.concat());
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
