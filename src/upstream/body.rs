//! Body wrappers: request size limit, idle timeout between frames, and the
//! one tap ([`TapBody`] + [`Observer`]) that sees the data go by and the end
//! of the stream: the usage observer and the per-request log line use it.
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
pub(crate) type ProxyReqBody = http_body_util::combinators::UnsyncBoxBody<Bytes, BoxError>;

/// The request body grew past `max_body_bytes` while streaming.
#[derive(Debug, thiserror::Error)]
#[error("request body exceeds the limit of {limit} bytes")]
pub(crate) struct BodyLimitExceeded {
    /// The configured limit.
    pub(crate) limit: u64,
}

/// The upstream sent nothing for longer than `timeouts.idle_secs`.
#[derive(Debug, thiserror::Error)]
#[error("upstream idle for more than {0:?}")]
pub(crate) struct IdleTimeout(pub Duration);

/// The request body did not arrive within `timeouts.body_read_secs`.
#[derive(Debug, thiserror::Error)]
#[error("request body not received within {0} s")]
pub(crate) struct BodyReadTimeout(pub u64);

/// Buffering this chunk would exceed `limits.max_buffered_body_bytes`.
#[derive(Debug, thiserror::Error)]
#[error("request bodies buffered by compactor exceed {0} bytes")]
pub(crate) struct BodyBudgetExceeded(pub u64);

/// The process-wide budget of buffered request body bytes: `used` is
/// reserved as chunks arrive and released by whoever owns the request.
#[derive(Debug, Clone)]
pub(crate) struct ByteBudget {
    /// The running total (also the metrics gauge).
    pub(crate) used: Arc<crate::metrics::Metrics>,
    /// The cap.
    pub(crate) max: u64,
}

pin_project! {
    /// Counts bytes into a shared counter and fails once `limit` is
    /// exceeded, when the body is not complete by `deadline`, or (with a
    /// budget) when the bytes buffered by all requests would exceed it.
    pub(crate) struct LimitedBody<B> {
        #[pin]
        inner: B,
        limit: u64,
        seen: Arc<AtomicU64>,
        deadline: Option<(Instant, u64)>,
        // Armed at the first wait only: a body already received costs no timer.
        #[pin]
        sleep: Option<Sleep>,
        budget: Option<ByteBudget>,
    }
}

impl<B> LimitedBody<B> {
    /// Wraps `inner`; `seen` receives the running byte count.
    pub fn new(inner: B, limit: u64, seen: Arc<AtomicU64>) -> Self {
        LimitedBody {
            inner,
            limit,
            seen,
            deadline: None,
            sleep: None,
            budget: None,
        }
    }

    /// Fails the body with [`BodyReadTimeout`] if it is not complete by
    /// `deadline` (`secs` is the configured value, for the message).
    pub fn with_deadline(mut self, deadline: Instant, secs: u64) -> Self {
        self.deadline = Some((deadline, secs));
        self
    }

    /// Reserves every chunk in `budget` (the caller releases `seen` bytes
    /// when the request is over).
    pub fn with_budget(mut self, budget: ByteBudget) -> Self {
        self.budget = Some(budget);
        self
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
        let mut this = self.project();
        match this.inner.poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => {
                let frame = frame.map_data(|mut d| d.copy_to_bytes(d.remaining()));
                if let Some(d) = frame.data_ref() {
                    let len = d.len() as u64;
                    if let Some(b) = this.budget {
                        let used = &b.used.buffered_body_bytes;
                        if used.fetch_add(len, Ordering::Relaxed) + len > b.max {
                            used.fetch_sub(len, Ordering::Relaxed);
                            return Poll::Ready(Some(Err(Box::new(BodyBudgetExceeded(b.max)))));
                        }
                    }
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
            Poll::Pending => {
                let Some((deadline, secs)) = *this.deadline else {
                    return Poll::Pending;
                };
                if this.sleep.is_none() {
                    this.sleep.set(Some(tokio::time::sleep_until(deadline)));
                }
                match this.sleep.as_pin_mut().map(|s| s.poll(cx)) {
                    Some(Poll::Ready(())) => {
                        Poll::Ready(Some(Err(Box::new(BodyReadTimeout(secs)))))
                    }
                    _ => Poll::Pending,
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

pin_project! {
    /// Ends the stream with an [`IdleTimeout`] error when the upstream sends
    /// nothing for `idle`. An error (not a clean end) so the client can tell
    /// the response was cut short: hyper aborts the chunked encoding / h2
    /// stream. Only time spent waiting on the upstream counts: a slow reader
    /// (backpressure, nobody polling) never trips it.
    pub(crate) struct IdleTimeoutBody<B, F> {
        #[pin]
        inner: B,
        idle: Duration,
        waiting: bool,
        // Built at the first wait: a response delivered without one (a
        // JSON reply read with its head) never touches the timer.
        #[pin]
        sleep: Option<Sleep>,
        // Generic, not boxed: no allocation of its own per response.
        on_timeout: Option<F>,
    }
}

impl<B, F: FnOnce()> IdleTimeoutBody<B, F> {
    /// Wraps `inner`; `on_timeout` runs once if the timeout fires.
    pub(crate) fn new(inner: B, idle: Duration, on_timeout: F) -> Self {
        IdleTimeoutBody {
            inner,
            idle,
            waiting: false,
            sleep: None,
            on_timeout: Some(on_timeout),
        }
    }
}

impl<B, F> Body for IdleTimeoutBody<B, F>
where
    B: Body,
    B::Error: Into<BoxError>,
    F: FnOnce(),
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
                    let deadline = crate::clock::from_now(*this.idle);
                    match this.sleep.as_mut().as_pin_mut() {
                        Some(sleep) => sleep.reset(deadline),
                        None => this.sleep.set(Some(tokio::time::sleep_until(deadline))),
                    }
                }
                let Some(sleep) = this.sleep.as_pin_mut() else {
                    return Poll::Pending;
                };
                match sleep.poll(cx) {
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

/// How long a body error is held back after data frames, so hyper can
/// write those frames out first (see [`FlushBeforeError`]).
const ERROR_FLUSH_GRACE: Duration = Duration::from_millis(200);

pin_project! {
    /// Delays an error that comes right after data frames: hyper's HTTP/1
    /// server stops at a body error without flushing what it buffered, so
    /// frames handed over in the same poll as the error never reach the
    /// client. The error is handed over after a `Pending` and a short grace
    /// instead, so the frames are written first. Costs one flag per frame.
    pub(crate) struct FlushBeforeError<B: Body> {
        #[pin]
        inner: B,
        // Data went out since the last `Pending`: hyper may not have
        // flushed it yet.
        unflushed: bool,
        held: Option<(B::Error, Pin<Box<Sleep>>)>,
    }
}

impl<B: Body> FlushBeforeError<B> {
    /// Wraps `inner`.
    pub fn new(inner: B) -> Self {
        FlushBeforeError {
            inner,
            unflushed: false,
            held: None,
        }
    }
}

impl<B: Body> Body for FlushBeforeError<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<B::Data>, B::Error>>> {
        let this = self.project();
        if let Some((_, sleep)) = this.held.as_mut() {
            if sleep.as_mut().poll(cx).is_pending() {
                return Poll::Pending;
            }
            return Poll::Ready(this.held.take().map(|(e, _)| Err(e)));
        }
        match this.inner.poll_frame(cx) {
            Poll::Ready(Some(Err(e))) if *this.unflushed => {
                let mut sleep = Box::pin(tokio::time::sleep(ERROR_FLUSH_GRACE));
                // Registers the timer: it wakes the task to hand over `e`.
                if sleep.as_mut().poll(cx).is_ready() {
                    return Poll::Ready(Some(Err(e)));
                }
                *this.held = Some((e, sleep));
                Poll::Pending
            }
            Poll::Ready(r) => {
                *this.unflushed = matches!(r, Some(Ok(_)));
                Poll::Ready(r)
            }
            Poll::Pending => {
                *this.unflushed = false;
                Poll::Pending
            }
        }
    }

    #[inline]
    fn is_end_stream(&self) -> bool {
        self.held.is_none() && self.inner.is_end_stream()
    }

    #[inline]
    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// How a body ended.
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

/// Side observer of a body. Implementations must be cheap and infallible:
/// they run inside `poll_frame` and can never fail the stream.
pub trait Observer {
    /// Called with every data frame, in order.
    fn on_data(&mut self, data: &[u8]);
    /// Called exactly once, when the body ends in whatever way.
    fn on_eos(self, eos: Eos);
}

pin_project! {
    /// Forwards the frames of `B` untouched and reports them to `O`: the
    /// data as it passes, and the end of the stream exactly once.
    pub struct TapBody<B, O: Observer> {
        #[pin]
        inner: B,
        observer: Option<O>,
    }

    impl<B, O: Observer> PinnedDrop for TapBody<B, O> {
        fn drop(this: Pin<&mut Self>) {
            if let Some(o) = this.project().observer.take() {
                o.on_eos(Eos::Cancelled);
            }
        }
    }
}

impl<B: Body, O: Observer> TapBody<B, O> {
    /// Wraps `inner`. An already-empty body is reported complete at once,
    /// because hyper may never poll it.
    pub fn new(inner: B, observer: O) -> Self {
        let mut observer = Some(observer);
        if inner.is_end_stream() {
            if let Some(o) = observer.take() {
                o.on_eos(Eos::Complete);
            }
        }
        Self { inner, observer }
    }
}

impl<B, O> Body for TapBody<B, O>
where
    B: Body,
    B::Data: AsRef<[u8]>,
    O: Observer,
{
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        let mut this = self.project();
        let polled = match this.inner.as_mut().poll_frame(cx) {
            Poll::Ready(p) => p,
            Poll::Pending => return Poll::Pending,
        };
        let eos = match &polled {
            Some(Ok(frame)) => {
                if let (Some(data), Some(o)) = (frame.data_ref(), this.observer.as_mut()) {
                    o.on_data(data.as_ref());
                }
                // hyper stops polling a body that says it has ended (e.g. a
                // Content-Length body after its last frame), so the end must
                // be reported here rather than on a `None` that never comes.
                (frame.is_trailers() || this.inner.is_end_stream()).then_some(Eos::Complete)
            }
            Some(Err(_)) => Some(Eos::Error),
            None => Some(Eos::Complete),
        };
        if let Some(e) = eos {
            if let Some(o) = this.observer.take() {
                o.on_eos(e);
            }
        }
        Poll::Ready(polled)
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

/// Called exactly once when a response body ends: (how, bytes delivered).
pub type OnEos = Box<dyn FnOnce(Eos, u64) + Send>;

/// An [`Observer`] counting delivered bytes for the per-request log line.
pub struct CountBytes {
    bytes: u64,
    on_eos: OnEos,
}

impl Observer for CountBytes {
    #[inline]
    fn on_data(&mut self, data: &[u8]) {
        self.bytes += data.len() as u64;
    }

    fn on_eos(self, eos: Eos) {
        (self.on_eos)(eos, self.bytes);
    }
}

/// A body whose end is reported with the bytes delivered.
pub type ObservedBody<B> = TapBody<B, CountBytes>;

/// Wraps `inner` so `on_eos` learns how it ended and how many bytes went.
pub fn observed<B: Body>(inner: B, on_eos: OnEos) -> ObservedBody<B> {
    TapBody::new(inner, CountBytes { bytes: 0, on_eos })
}

/// The most [`whole`] reserves ahead on a body's word (its size hint).
const MAX_PRESIZE_BYTES: usize = 64 << 20;

/// A body's data, whole (trailers dropped): a body of one frame is that
/// frame, the frames of a longer one copied together once.
/// `BodyExt::collect` gathers even a single frame in a queue it allocates
/// (one allocation a request on the chat path, whose bodies the server
/// reads whole).
pub(crate) async fn whole<B>(mut body: B) -> Result<Bytes, B::Error>
where
    B: Body<Data = Bytes> + Unpin,
{
    let mut first: Option<Bytes> = None;
    let mut more: Option<bytes::BytesMut> = None;
    while let Some(frame) = body.frame().await {
        let Ok(data) = frame?.into_data() else {
            continue;
        };
        if data.is_empty() {
            continue;
        }
        match (&first, &mut more) {
            (None, _) => first = Some(data),
            (Some(f), None) => {
                // Sized for what is still to come (a Content-Length body
                // says), so a large body is copied once, not regrown.
                let left = usize::try_from(body.size_hint().lower()).unwrap_or(usize::MAX);
                let mut m = bytes::BytesMut::with_capacity(
                    f.len() + data.len() + left.min(MAX_PRESIZE_BYTES),
                );
                m.extend_from_slice(f);
                m.extend_from_slice(&data);
                more = Some(m);
            }
            (Some(_), Some(m)) => m.extend_from_slice(&data),
        }
    }
    Ok(match (more, first) {
        (Some(m), _) => m.freeze(),
        (None, f) => f.unwrap_or_default(),
    })
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

    #[test]
    fn eos_labels_are_written_quoted_as_they_are() {
        // As the request log line writes them (telemetry::request::label).
        for e in [Eos::Complete, Eos::Error, Eos::Cancelled] {
            let l = e.as_str();
            assert_eq!(format!("{l:?}"), format!("\"{l}\""));
        }
    }

    #[tokio::test]
    async fn whole_is_what_collect_gives() {
        let cases: [&[&'static str]; 5] = [
            &[],
            &["one"],
            &["", "a", "", "bc", "d"],
            &["x", ""],
            &["", ""],
        ];
        for frames in cases {
            let body = || {
                let items = frames
                    .iter()
                    .map(|f| Some(Ok(Frame::data(Bytes::from_static(f.as_bytes())))))
                    .collect();
                tap_tests::MockBody::new(items)
            };
            let want = body().collect().await.unwrap().to_bytes();
            let got = whole(body()).await.unwrap();
            assert_eq!(got, want, "{frames:?}");
        }
        let one = Bytes::from_static(b"kept as it is");
        let got = whole(Full::new(one.clone())).await.unwrap();
        assert_eq!(got.as_ptr(), one.as_ptr(), "a single frame is not copied");
        let failing = tap_tests::MockBody::new(vec![
            Some(Ok(Frame::data(Bytes::from_static(b"a")))),
            Some(Err(std::io::Error::other("cut"))),
        ]);
        assert!(whole(failing).await.is_err());
    }
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
        let mut b = Box::pin(LimitedBody::new(
            Full::new(Bytes::from_static(b"12345")),
            5,
            seen.clone(),
        ));
        assert!(matches!(poll_once(&mut b), Poll::Ready(Some(Ok(_)))));
        assert_eq!(seen.load(Ordering::Relaxed), 5);

        let seen = Arc::new(AtomicU64::new(0));
        let mut b = Box::pin(LimitedBody::new(
            Full::new(Bytes::from_static(b"123456")),
            5,
            seen,
        ));
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
            move || {
                f.fetch_add(1, Ordering::Relaxed);
            },
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
        let mut b = observed(Full::new(Bytes::from_static(b"abc")), on);
        assert!(matches!(poll_once(&mut b), Poll::Ready(Some(Ok(_)))));
        drop(b);
        assert_eq!(*log.lock().unwrap(), vec![(Eos::Complete, 3)]);

        // Dropped mid-stream: cancelled.
        let (log, on) = recorder();
        let (tx, inner) = chan();
        let mut b = observed(inner, on);
        tx.send(Ok(Frame::data(Bytes::from_static(b"ab")))).unwrap();
        assert!(matches!(poll_once(&mut b), Poll::Ready(Some(Ok(_)))));
        assert!(poll_once(&mut b).is_pending());
        drop(b);
        assert_eq!(*log.lock().unwrap(), vec![(Eos::Cancelled, 2)]);

        // Error from upstream.
        let (log, on) = recorder();
        let (tx, inner) = chan();
        let mut b = observed(inner, on);
        tx.send(Err("reset".into())).unwrap();
        assert!(matches!(poll_once(&mut b), Poll::Ready(Some(Err(_)))));
        drop(b);
        assert_eq!(*log.lock().unwrap(), vec![(Eos::Error, 0)]);

        // Empty body: complete at construction (hyper may never poll it).
        let (log, on) = recorder();
        let b = observed(http_body_util::Empty::<Bytes>::new(), on);
        assert_eq!(*log.lock().unwrap(), vec![(Eos::Complete, 0)]);
        drop(b);
        assert_eq!(log.lock().unwrap().len(), 1);
    }
}

#[cfg(test)]
pub(crate) mod tap_tests {
    use super::*;
    use bytes::Bytes;
    use http_body_util::{BodyExt, Full};
    use std::sync::{Arc, Mutex};

    #[derive(Clone, Default)]
    pub(crate) struct Record(pub Arc<Mutex<(Vec<u8>, Vec<Eos>)>>);

    impl Observer for Record {
        fn on_data(&mut self, data: &[u8]) {
            self.0.lock().unwrap().0.extend_from_slice(data);
        }
        fn on_eos(self, eos: Eos) {
            self.0.lock().unwrap().1.push(eos);
        }
    }

    type Item = Result<Frame<Bytes>, std::io::Error>;

    /// Scripted body: yields its items in order, then ends. `None` items
    /// return `Pending` once (after waking the task), like a slow upstream.
    pub(crate) struct MockBody {
        items: std::collections::VecDeque<Option<Item>>,
    }

    impl MockBody {
        pub(crate) fn new(items: Vec<Option<Item>>) -> Self {
            Self {
                items: items.into(),
            }
        }
    }

    impl Body for MockBody {
        type Data = Bytes;
        type Error = std::io::Error;
        fn poll_frame(
            mut self: Pin<&mut Self>,
            cx: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Bytes>, std::io::Error>>> {
            match self.items.pop_front() {
                Some(Some(item)) => Poll::Ready(Some(item)),
                Some(None) => {
                    cx.waker().wake_by_ref();
                    Poll::Pending
                }
                None => Poll::Ready(None),
            }
        }
    }

    fn stream_body(items: Vec<Item>) -> MockBody {
        MockBody::new(items.into_iter().map(Some).collect())
    }

    #[tokio::test]
    async fn forwards_frames_and_reports_complete_once() {
        let rec = Record::default();
        let body = stream_body(vec![
            Ok(Frame::data(Bytes::from_static(b"ab"))),
            Ok(Frame::data(Bytes::from_static(b"cd"))),
        ]);
        let out = TapBody::new(body, rec.clone()).collect().await.unwrap();
        assert_eq!(out.to_bytes(), Bytes::from_static(b"abcd"));
        let g = rec.0.lock().unwrap();
        assert_eq!(g.0, b"abcd");
        assert_eq!(g.1, vec![Eos::Complete]);
    }

    #[tokio::test]
    async fn complete_via_is_end_stream() {
        let rec = Record::default();
        let mut tap = TapBody::new(Full::new(Bytes::from_static(b"{}")), rec.clone());
        let f = tap.frame().await.unwrap().unwrap();
        assert_eq!(f.into_data().unwrap(), Bytes::from_static(b"{}"));
        // Reported before anyone polls for the end, then dropping adds nothing.
        assert_eq!(rec.0.lock().unwrap().1, vec![Eos::Complete]);
        drop(tap);
        assert_eq!(rec.0.lock().unwrap().1, vec![Eos::Complete]);
    }

    #[tokio::test]
    async fn error_is_reported_once() {
        let rec = Record::default();
        let body = stream_body(vec![
            Ok(Frame::data(Bytes::from_static(b"x"))),
            Err(std::io::Error::other("boom")),
        ]);
        let mut tap = TapBody::new(body, rec.clone());
        assert!(tap.frame().await.unwrap().is_ok());
        assert!(tap.frame().await.unwrap().is_err());
        drop(tap);
        assert_eq!(rec.0.lock().unwrap().1, vec![Eos::Error]);
    }

    #[tokio::test]
    async fn drop_before_end_is_cancelled() {
        let rec = Record::default();
        let body = stream_body(vec![
            Ok(Frame::data(Bytes::from_static(b"x"))),
            Ok(Frame::data(Bytes::from_static(b"y"))),
        ]);
        let mut tap = TapBody::new(body, rec.clone());
        assert!(tap.frame().await.unwrap().is_ok());
        drop(tap);
        let g = rec.0.lock().unwrap();
        assert_eq!(g.0, b"x");
        assert_eq!(g.1, vec![Eos::Cancelled]);
    }

    #[tokio::test]
    async fn trailers_pass_through() {
        let rec = Record::default();
        let mut trailers = http::HeaderMap::new();
        trailers.insert("x-t", http::HeaderValue::from_static("1"));
        let body = stream_body(vec![
            Ok(Frame::data(Bytes::from_static(b"x"))),
            Ok(Frame::trailers(trailers)),
        ]);
        let collected = TapBody::new(body, rec.clone()).collect().await.unwrap();
        assert_eq!(collected.trailers().unwrap()["x-t"], "1");
        assert_eq!(rec.0.lock().unwrap().1, vec![Eos::Complete]);
    }
}
