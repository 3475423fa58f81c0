//! A body wrapper that forwards every frame untouched and lets an
//! [`Observer`] look at the data on the side.

use std::pin::Pin;
use std::task::{Context, Poll};

use http_body::{Body, Frame, SizeHint};
use pin_project_lite::pin_project;

/// How a tapped body ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Eos {
    /// The body ended normally (end of data, trailers, or `is_end_stream`).
    Complete,
    /// The inner body returned an error.
    Error,
    /// The body was dropped before its end (the client went away).
    Cancelled,
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
    /// Forwards the frames of `B` untouched and reports them to `O`.
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

impl<B, O: Observer> TapBody<B, O> {
    /// Wraps `inner`.
    pub fn new(inner: B, observer: O) -> Self {
        Self {
            inner,
            observer: Some(observer),
        }
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
        match polled {
            Some(Ok(frame)) => {
                if let (Some(data), Some(o)) = (frame.data_ref(), this.observer.as_mut()) {
                    o.on_data(data.as_ref());
                }
                // hyper stops polling a body that says it has ended (e.g. a
                // Content-Length body after its last frame), so the end must
                // be reported here rather than on a `None` that never comes.
                if this.inner.is_end_stream() {
                    if let Some(o) = this.observer.take() {
                        o.on_eos(Eos::Complete);
                    }
                }
                Poll::Ready(Some(Ok(frame)))
            }
            Some(Err(e)) => {
                if let Some(o) = this.observer.take() {
                    o.on_eos(Eos::Error);
                }
                Poll::Ready(Some(Err(e)))
            }
            None => {
                if let Some(o) = this.observer.take() {
                    o.on_eos(Eos::Complete);
                }
                Poll::Ready(None)
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
pub(crate) mod tests {
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
