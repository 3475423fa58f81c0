//! Body wrappers: request size limit, idle timeout between frames, and an
//! end-of-stream observer for the per-request log line.
//!
//! Every wrapper forwards frames untouched and delegates `is_end_stream` and
//! `size_hint`, so hyper keeps streaming (and Content-Length) behaviour.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{Buf, Bytes};
use http_body::{Body, Frame, SizeHint};
use http_body_util::BodyExt;
use pin_project_lite::pin_project;
use tokio::time::{Instant, Sleep};

use crate::error::BoxError;

/// The request body type sent upstream.
pub type ProxyReqBody = http_body_util::combinators::UnsyncBoxBody<Bytes, BoxError>;

/// The request body grew past `max_body_bytes` while streaming.
#[derive(Debug, thiserror::Error)]
#[error("request body exceeds the limit of {limit} bytes")]
pub struct BodyLimitExceeded {
    /// The configured limit.
    pub limit: u64,
}

/// The upstream sent nothing for longer than `timeouts.idle_secs`.
#[derive(Debug, thiserror::Error)]
#[error("upstream idle for more than {0:?}")]
pub struct IdleTimeout(pub Duration);

pin_project! {
    /// Counts bytes into a shared counter and fails once `limit` is exceeded.
    pub struct LimitedBody<B> {
        #[pin]
        inner: B,
        limit: u64,
        seen: Arc<AtomicU64>,
    }
}

impl<B> LimitedBody<B> {
    /// Wraps `inner`; `seen` receives the running byte count.
    pub fn new(inner: B, limit: u64, seen: Arc<AtomicU64>) -> Self {
        LimitedBody { inner, limit, seen }
    }
}

impl<B> Body for LimitedBody<B>
where
    B: Body,
    B::Data: Buf,
    B::Error: Into<BoxError>,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = self.project();
        match this.inner.poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => {
                let frame = frame.map_data(|mut d| d.copy_to_bytes(d.remaining()));
                if let Some(d) = frame.data_ref() {
                    let len = d.len() as u64;
                    let total = this.seen.fetch_add(len, Ordering::Relaxed) + len;
                    if total > *this.limit {
                        return Poll::Ready(Some(Err(Box::new(BodyLimitExceeded {
                            limit: *this.limit,
                        }))));
                    }
                }
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(Some(Err(e))) => Poll::Ready(Some(Err(e.into()))),
            Poll::Ready(None) => Poll::Ready(None),
            Poll::Pending => Poll::Pending,
        }
    }

    #[inline]
    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    #[inline]
    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

pin_project! {
    /// Ends the stream with an [`IdleTimeout`] error when the upstream sends
    /// nothing for `idle`. An error (not a clean end) so the client can tell
    /// the response was cut short: hyper aborts the chunked encoding / h2
    /// stream. Only time spent waiting on the upstream counts: a slow reader
    /// (backpressure, nobody polling) never trips it.
    pub struct IdleTimeoutBody<B> {
        #[pin]
        inner: B,
        idle: Duration,
        waiting: bool,
        #[pin]
        sleep: Sleep,
        on_timeout: Option<Box<dyn FnOnce() + Send>>,
    }
}

impl<B> IdleTimeoutBody<B> {
    /// Wraps `inner`; `on_timeout` runs once if the timeout fires.
    pub fn new(inner: B, idle: Duration, on_timeout: Box<dyn FnOnce() + Send>) -> Self {
        IdleTimeoutBody {
            inner,
            idle,
            waiting: false,
            sleep: tokio::time::sleep(idle),
            on_timeout: Some(on_timeout),
        }
    }
}

impl<B> Body for IdleTimeoutBody<B>
where
    B: Body,
    B::Error: Into<BoxError>,
{
    type Data = B::Data;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<B::Data>, BoxError>>> {
        let mut this = self.project();
        match this.inner.poll_frame(cx) {
            Poll::Ready(r) => {
                *this.waiting = false;
                Poll::Ready(r.map(|r| r.map_err(Into::into)))
            }
            Poll::Pending => {
                if !*this.waiting {
                    // The timer is armed only when a wait really starts, so
                    // frames that are already buffered cost no timer update.
                    *this.waiting = true;
                    this.sleep.as_mut().reset(Instant::now() + *this.idle);
                }
                match this.sleep.poll(cx) {
                    Poll::Ready(()) => {
                        if let Some(f) = this.on_timeout.take() {
                            f();
                        }
                        Poll::Ready(Some(Err(Box::new(IdleTimeout(*this.idle)))))
                    }
                    Poll::Pending => Poll::Pending,
                }
            }
        }
    }

    #[inline]
    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    #[inline]
    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// How a response body ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Eos {
    /// All bytes (and trailers, if any) were delivered.
    Complete,
    /// The body produced an error (upstream reset, idle timeout).
    Error,
    /// The body was dropped before its end: the client went away.
    Cancelled,
}

impl Eos {
    /// Short label for logs.
    pub fn as_str(self) -> &'static str {
        match self {
            Eos::Complete => "complete",
            Eos::Error => "error",
            Eos::Cancelled => "cancelled",
        }
    }
}

/// Called exactly once when a response body ends: (how, bytes delivered).
pub type OnEos = Box<dyn FnOnce(Eos, u64) + Send>;

pin_project! {
    /// Counts delivered bytes and reports the end of the stream exactly once.
    pub struct ObservedBody<B> {
        #[pin]
        inner: B,
        bytes: u64,
        on_eos: Option<OnEos>,
    }

    impl<B> PinnedDrop for ObservedBody<B> {
        fn drop(this: Pin<&mut Self>) {
            let this = this.project();
            if let Some(f) = this.on_eos.take() {
                f(Eos::Cancelled, *this.bytes);
            }
        }
    }
}

impl<B: Body> ObservedBody<B> {
    /// Wraps `inner`. An already-empty body is reported complete immediately,
    /// because hyper may never poll it.
    pub fn new(inner: B, on_eos: OnEos) -> Self {
        let mut on_eos = Some(on_eos);
        if inner.is_end_stream() {
            if let Some(f) = on_eos.take() {
                f(Eos::Complete, 0);
            }
        }
        ObservedBody {
            inner,
            bytes: 0,
            on_eos,
        }
    }
}

impl<B> Body for ObservedBody<B>
where
    B: Body,
    B::Data: Buf,
{
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<B::Data>, B::Error>>> {
        let mut this = self.project();
        let result = this.inner.as_mut().poll_frame(cx);
        let eos = match &result {
            Poll::Pending => return result,
            Poll::Ready(None) => Some(Eos::Complete),
            Poll::Ready(Some(Err(_))) => Some(Eos::Error),
            Poll::Ready(Some(Ok(frame))) => {
                if let Some(d) = frame.data_ref() {
                    // remaining(), not chunk().len(): Buf may be non-contiguous.
                    *this.bytes += d.remaining() as u64;
                }
                // hyper stops polling a Content-Length body once it reports
                // end of stream, so the end must be detected here.
                if frame.is_trailers() || this.inner.is_end_stream() {
                    Some(Eos::Complete)
                } else {
                    None
                }
            }
        };
        if let Some(e) = eos {
            if let Some(f) = this.on_eos.take() {
                f(e, *this.bytes);
            }
        }
        result
    }

    #[inline]
    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    #[inline]
    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// Boxes any body with `Bytes`-convertible data into a [`ProxyReqBody`].
pub fn boxed<B>(body: B) -> ProxyReqBody
where
    B: Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    body.map_err(Into::into).boxed_unsync()
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::Full;
    use std::sync::Mutex;
    use tokio::sync::mpsc;

    /// A body fed by the test through a channel.
    struct ChanBody(mpsc::UnboundedReceiver<Result<Frame<Bytes>, BoxError>>);

    impl Body for ChanBody {
        type Data = Bytes;
        type Error = BoxError;
        fn poll_frame(
            mut self: Pin<&mut Self>,
            cx: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
            self.0.poll_recv(cx)
        }
    }

    fn chan() -> (
        mpsc::UnboundedSender<Result<Frame<Bytes>, BoxError>>,
        ChanBody,
    ) {
        let (tx, rx) = mpsc::unbounded_channel();
        (tx, ChanBody(rx))
    }

    type Polled<B> = Poll<Option<Result<Frame<<B as Body>::Data>, <B as Body>::Error>>>;
    type EosLog = Arc<Mutex<Vec<(Eos, u64)>>>;

    fn poll_once<B: Body + Unpin>(b: &mut B) -> Polled<B> {
        let waker = std::task::Waker::noop();
        let mut cx = Context::from_waker(waker);
        Pin::new(b).poll_frame(&mut cx)
    }

    fn recorder() -> (EosLog, OnEos) {
        let log = Arc::new(Mutex::new(Vec::new()));
        let l = Arc::clone(&log);
        (log, Box::new(move |e, n| l.lock().unwrap().push((e, n))))
    }

    #[tokio::test]
    async fn limited_body_counts_and_fails_past_limit() {
        let seen = Arc::new(AtomicU64::new(0));
        let mut b = LimitedBody::new(Full::new(Bytes::from_static(b"12345")), 5, seen.clone());
        assert!(matches!(poll_once(&mut b), Poll::Ready(Some(Ok(_)))));
        assert_eq!(seen.load(Ordering::Relaxed), 5);

        let seen = Arc::new(AtomicU64::new(0));
        let mut b = LimitedBody::new(Full::new(Bytes::from_static(b"123456")), 5, seen);
        match poll_once(&mut b) {
            Poll::Ready(Some(Err(e))) => {
                assert_eq!(e.downcast_ref::<BodyLimitExceeded>().unwrap().limit, 5)
            }
            _ => panic!("expected limit error"),
        }
    }

    #[tokio::test(start_paused = true)]
    async fn idle_timeout_counts_only_time_spent_waiting() {
        let (tx, inner) = chan();
        let fired = Arc::new(AtomicU64::new(0));
        let f = Arc::clone(&fired);
        let mut b = Box::pin(IdleTimeoutBody::new(
            inner,
            Duration::from_secs(10),
            Box::new(move || {
                f.fetch_add(1, Ordering::Relaxed);
            }),
        ));
        assert!(poll_once(&mut b).is_pending());
        tokio::time::advance(Duration::from_secs(5)).await;
        tx.send(Ok(Frame::data(Bytes::from_static(b"a")))).unwrap();
        assert!(matches!(poll_once(&mut b), Poll::Ready(Some(Ok(_)))));
        // Nobody polls for a long time (slow reader): not an upstream stall.
        tokio::time::advance(Duration::from_secs(60)).await;
        assert!(poll_once(&mut b).is_pending());
        tokio::time::advance(Duration::from_secs(9)).await;
        assert!(poll_once(&mut b).is_pending());
        tokio::time::advance(Duration::from_secs(2)).await;
        match poll_once(&mut b) {
            Poll::Ready(Some(Err(e))) => assert!(e.downcast_ref::<IdleTimeout>().is_some()),
            other => panic!("expected idle timeout, got {:?}", other.map(|_| ())),
        }
        assert_eq!(fired.load(Ordering::Relaxed), 1);
        drop(tx);
    }

    #[tokio::test]
    async fn observed_body_reports_each_end_once() {
        // Content-Length style: ends via is_end_stream after the data frame.
        let (log, on) = recorder();
        let mut b = ObservedBody::new(Full::new(Bytes::from_static(b"abc")), on);
        assert!(matches!(poll_once(&mut b), Poll::Ready(Some(Ok(_)))));
        drop(b);
        assert_eq!(*log.lock().unwrap(), vec![(Eos::Complete, 3)]);

        // Dropped mid-stream: cancelled.
        let (log, on) = recorder();
        let (tx, inner) = chan();
        let mut b = ObservedBody::new(inner, on);
        tx.send(Ok(Frame::data(Bytes::from_static(b"ab")))).unwrap();
        assert!(matches!(poll_once(&mut b), Poll::Ready(Some(Ok(_)))));
        assert!(poll_once(&mut b).is_pending());
        drop(b);
        assert_eq!(*log.lock().unwrap(), vec![(Eos::Cancelled, 2)]);

        // Error from upstream.
        let (log, on) = recorder();
        let (tx, inner) = chan();
        let mut b = ObservedBody::new(inner, on);
        tx.send(Err("reset".into())).unwrap();
        assert!(matches!(poll_once(&mut b), Poll::Ready(Some(Err(_)))));
        drop(b);
        assert_eq!(*log.lock().unwrap(), vec![(Eos::Error, 0)]);

        // Empty body: complete at construction (hyper may never poll it).
        let (log, on) = recorder();
        let b = ObservedBody::new(http_body_util::Empty::<Bytes>::new(), on);
        assert_eq!(*log.lock().unwrap(), vec![(Eos::Complete, 0)]);
        drop(b);
        assert_eq!(log.lock().unwrap().len(), 1);
    }
}
