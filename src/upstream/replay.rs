//! A streamed request body that can be sent again while the upstream has
//! not answered and little of it went out.
//!
//! The keep-alive race (an upstream closing a pooled connection just as a
//! request goes out on it) ends before any response byte, in the upstream
//! client's "connection closed before message completed"
//! (`upstream::h1::Error::Incomplete`) or a write that met the closed
//! socket (reset, broken pipe): the upstream never answered, and the
//! request is sent once more on a new connection (`super::unsent` decides).
//! A held body ([`super::Upstream::send_bytes`]) is simply sent again. A
//! streamed one (a chunked upload, a body over
//! [`super::REPLAYABLE_BODY_BYTES`]) is not held: it is *leased* to the
//! upstream client, which writes it while it reads the response, and the
//! frames that went out are kept, up to [`KEEP_BYTES`] and within the
//! process-wide buffered-body budget, until the response head arrives. A
//! second lease sends the kept frames, then goes on reading the client's
//! body where the first stopped (the client's stream stays with the
//! [`Replay`], not with the failed attempt's request, which was dropped).
//! Past the cap, or once the upstream answered, nothing is kept and no
//! replay is offered.

use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};

use super::body::{boxed, ByteBudget, ProxyReqBody};
use crate::error::BoxError;
use crate::sync::lock;

/// How much of a streamed body is kept for a replay: the race is decided on
/// the request's first write, long before a megabyte went out.
pub(crate) const KEEP_BYTES: u64 = 1 << 20;

/// The client's body and what of it went out, shared by the leases.
struct Shared {
    /// The client's body, read by the current lease.
    inner: ProxyReqBody,
    /// Frames the current and earlier leases sent, while `keeping`.
    kept: Vec<Frame<Bytes>>,
    /// Bytes in `kept`, reserved in `budget`.
    kept_bytes: u64,
    /// Still keeping: no frame was dropped and the upstream has not
    /// answered.
    keeping: bool,
    /// Which lease may read (a dropped request's lease must not).
    generation: u64,
    budget: ByteBudget,
}

impl Shared {
    /// Stops keeping and gives the kept bytes back to the budget.
    fn release(&mut self) {
        self.keeping = false;
        self.kept = Vec::new();
        self.budget
            .used
            .buffered_body_bytes
            .fetch_sub(self.kept_bytes, Ordering::Relaxed);
        self.kept_bytes = 0;
    }

    /// Keeps `frame` if the cap and the budget allow, else stops keeping.
    fn keep(&mut self, frame: &Frame<Bytes>) {
        if !self.keeping {
            return;
        }
        let len = frame.data_ref().map_or(0, |d| d.len() as u64);
        let used = &self.budget.used.buffered_body_bytes;
        if self.kept_bytes + len > KEEP_BYTES
            || used.fetch_add(len, Ordering::Relaxed) + len > self.budget.max
        {
            if self.kept_bytes + len <= KEEP_BYTES {
                used.fetch_sub(len, Ordering::Relaxed);
            }
            self.release();
            return;
        }
        self.kept_bytes += len;
        if let Some(d) = frame.data_ref() {
            self.kept.push(Frame::data(d.clone()));
        } else if let Some(t) = frame.trailers_ref() {
            self.kept.push(Frame::trailers(t.clone()));
        }
    }
}

impl Drop for Shared {
    fn drop(&mut self) {
        self.release();
    }
}

/// A streamed body that can be leased to the upstream client more than once.
pub(crate) struct Replay {
    shared: Arc<Mutex<Shared>>,
}

impl Replay {
    /// Takes the client's body; its frames count in `budget` while kept.
    pub(crate) fn new(inner: ProxyReqBody, budget: ByteBudget) -> Self {
        Replay {
            shared: Arc::new(Mutex::new(Shared {
                inner,
                kept: Vec::new(),
                kept_bytes: 0,
                keeping: true,
                generation: 0,
                budget,
            })),
        }
    }

    /// The body for the first attempt.
    pub(crate) fn first(&self) -> ProxyReqBody {
        boxed(Lease {
            shared: Arc::clone(&self.shared),
            generation: 0,
            replayed: 0,
        })
    }

    /// The body for a second attempt, if every byte that went out was kept.
    pub(crate) fn again(&self) -> Option<ProxyReqBody> {
        let mut shared = lock(&self.shared);
        if !shared.keeping {
            return None;
        }
        shared.generation += 1;
        Some(boxed(Lease {
            shared: Arc::clone(&self.shared),
            generation: shared.generation,
            replayed: 0,
        }))
    }

    /// The upstream answered: the body will not be sent again.
    pub(crate) fn answered(&self) {
        lock(&self.shared).release();
    }
}

/// The error a lease gives once a newer lease replaced it.
#[derive(Debug, thiserror::Error)]
#[error("request body taken over by a retry")]
struct Superseded;

/// One attempt's view of the body: the kept frames first, then the rest of
/// the client's body.
struct Lease {
    shared: Arc<Mutex<Shared>>,
    generation: u64,
    /// Kept frames this lease has sent.
    replayed: usize,
}

impl Body for Lease {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let shared = Arc::clone(&self.shared);
        let mut shared = lock(&shared);
        if shared.generation != self.generation {
            return Poll::Ready(Some(Err(Box::new(Superseded))));
        }
        if let Some(frame) = shared.kept.get(self.replayed) {
            let frame = match frame.data_ref() {
                Some(d) => Frame::data(d.clone()),
                None => Frame::trailers(frame.trailers_ref().cloned().unwrap_or_default()),
            };
            self.replayed += 1;
            return Poll::Ready(Some(Ok(frame)));
        }
        let polled = Pin::new(&mut shared.inner).poll_frame(cx);
        if let Poll::Ready(Some(Ok(frame))) = &polled {
            shared.keep(frame);
            // What is kept is what this lease sent: a replay starts after it.
            self.replayed = shared.kept.len();
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        let shared = lock(&self.shared);
        self.replayed >= shared.kept.len() && shared.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        let shared = lock(&self.shared);
        let pending: u64 = shared
            .kept
            .iter()
            .skip(self.replayed)
            .filter_map(|f| f.data_ref().map(|d| d.len() as u64))
            .sum();
        let inner = shared.inner.size_hint();
        let mut hint = SizeHint::new();
        hint.set_lower(inner.lower() + pending);
        if let Some(upper) = inner.upper() {
            hint.set_upper(upper + pending);
        }
        hint
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metrics::Metrics;
    use http_body_util::BodyExt;

    fn budget(max: u64) -> ByteBudget {
        ByteBudget {
            used: Arc::new(Metrics::default()),
            max,
        }
    }

    /// A body of `chunks`, one frame each, never an end hint.
    struct Chunks(std::collections::VecDeque<Bytes>);

    impl Body for Chunks {
        type Data = Bytes;
        type Error = BoxError;

        fn poll_frame(
            mut self: Pin<&mut Self>,
            _: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
            Poll::Ready(self.0.pop_front().map(|c| Ok(Frame::data(c))))
        }
    }

    fn streamed(chunks: &[&'static str]) -> ProxyReqBody {
        boxed(Chunks(
            chunks
                .iter()
                .map(|c| Bytes::from_static(c.as_bytes()))
                .collect(),
        ))
    }

    async fn next_data(body: &mut ProxyReqBody) -> Option<Bytes> {
        body.frame().await.map(|f| f.unwrap().into_data().unwrap())
    }

    #[tokio::test]
    async fn a_second_lease_sends_what_went_out_then_the_rest() {
        let b = budget(1 << 20);
        let replay = Replay::new(streamed(&["ab", "cd", "ef"]), b.clone());
        let mut first = replay.first();
        assert_eq!(next_data(&mut first).await.unwrap(), "ab");
        assert_eq!(next_data(&mut first).await.unwrap(), "cd");
        assert_eq!(b.used.buffered_body_bytes.load(Ordering::Relaxed), 4);
        let second = replay.again().unwrap();
        assert!(
            first.frame().await.unwrap().is_err(),
            "the old lease is superseded"
        );
        let all = second.collect().await.unwrap().to_bytes();
        assert_eq!(all, "abcdef");
        replay.answered();
        assert_eq!(b.used.buffered_body_bytes.load(Ordering::Relaxed), 0);
        assert!(replay.again().is_none(), "answered: no replay");
    }

    #[tokio::test]
    async fn past_the_cap_or_the_budget_nothing_is_kept() {
        let big: &'static str = Box::leak("x".repeat(KEEP_BYTES as usize).into_boxed_str());
        let b = budget(1 << 30);
        let replay = Replay::new(streamed(&["a", big]), b.clone());
        let body = replay.first().collect().await.unwrap().to_bytes();
        assert_eq!(body.len(), KEEP_BYTES as usize + 1, "streamed whole");
        assert!(replay.again().is_none());
        assert_eq!(b.used.buffered_body_bytes.load(Ordering::Relaxed), 0);

        let tight = budget(3);
        let replay = Replay::new(streamed(&["ab", "cd"]), tight.clone());
        let body = replay.first().collect().await.unwrap().to_bytes();
        assert_eq!(body, "abcd");
        assert!(replay.again().is_none(), "the budget ran out");
        assert_eq!(tight.used.buffered_body_bytes.load(Ordering::Relaxed), 0);
    }

    #[tokio::test]
    async fn dropping_the_replay_releases_the_budget() {
        let b = budget(1 << 20);
        let replay = Replay::new(streamed(&["abc", "d"]), b.clone());
        let mut first = replay.first();
        next_data(&mut first).await;
        assert_eq!(b.used.buffered_body_bytes.load(Ordering::Relaxed), 3);
        drop(first);
        drop(replay);
        assert_eq!(b.used.buffered_body_bytes.load(Ordering::Relaxed), 0);
    }
}
