//! Hands the client's server every response byte that is already available
//! in one go: the data frames ready back to back leave as one frame, one
//! chunk, one write.
//!
//! The upstream client (`upstream::h1`) already joins the body data one
//! read of the socket brought; when the socket has more by the time that
//! frame is taken (an SSE burst larger than a read, or one that arrived in
//! several segments), the body stack above (usage tap, usage hider, idle
//! timeout) and the server's chunk framing (`server::h1`, or hyper's server
//! on a connection `server::h1` handed over) would still run once per read.
//! [`CoalesceBody`] takes frames while the inner body has them ready and
//! releases what it gathered, joined, at the first `Pending`. A frame
//! released alone is the upstream client's own buffer (no copy).
//!
//! The upstream connection is read by the body that reads it
//! (`upstream::pool`), so a `Pending` here means the socket has nothing
//! more: everything gathered goes out then, and nothing is held while the
//! upstream is idle. A paced stream (a model generating tokens) leaves
//! frame by frame as it arrives.
//!
//! The first data frame goes out at once, with the response head in the
//! same write (a stream's time to first byte is not held up). The bytes are
//! unchanged and in order (an error or trailers come after the data before
//! them); only HTTP/1.1 chunk boundaries, which are the hop's own framing,
//! may differ from the upstream's.

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::{Bytes, BytesMut};
use http_body::{Body, Frame, SizeHint};
use pin_project_lite::pin_project;

/// At most this many bytes are gathered before they are released.
const MAX_GATHER_BYTES: usize = 64 << 10;

pin_project! {
    /// See the module docs.
    pub(crate) struct CoalesceBody<B: Body> {
        #[pin]
        inner: B,
        // The first frame gathered, while it is the only one.
        lone: Option<Bytes>,
        // Two or more gathered frames, joined.
        joined: BytesMut,
        // An error or trailers that ended the gathering: after the data.
        // Boxed: rare, and inline it made every response's boxed body
        // stack (`upstream::idle_timeout`) ~90 bytes larger; a hidden
        // stream's was past the 1,032 bytes glibc's per-thread cache serves.
        tail: Option<Box<Result<Frame<Bytes>, B::Error>>>,
        // Releasing what was gathered; the inner body is not polled meanwhile.
        draining: bool,
        inner_done: bool,
        // The first data frame has gone out.
        started: bool,
    }
}

impl<B: Body> CoalesceBody<B> {
    /// Wraps `inner`.
    pub fn new(inner: B) -> Self {
        CoalesceBody {
            inner,
            lone: None,
            joined: BytesMut::new(),
            tail: None,
            draining: false,
            inner_done: false,
            started: false,
        }
    }

    fn gathered(&self) -> usize {
        self.lone.as_ref().map_or(0, Bytes::len) + self.joined.len()
    }
}

impl<B> Body for CoalesceBody<B>
where
    B: Body<Data = Bytes>,
{
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
        let mut this = self.project();
        loop {
            if *this.draining {
                if let Some(lone) = this.lone.take() {
                    return Poll::Ready(Some(Ok(Frame::data(lone))));
                }
                if !this.joined.is_empty() {
                    return Poll::Ready(Some(Ok(Frame::data(this.joined.split().freeze()))));
                }
                if let Some(tail) = this.tail.take() {
                    return Poll::Ready(Some(*tail));
                }
                *this.draining = false;
            }
            if *this.inner_done {
                return Poll::Ready(None);
            }
            let empty = this.lone.is_none() && this.joined.is_empty();
            let item = match this.inner.as_mut().poll_frame(cx) {
                Poll::Pending if empty => return Poll::Pending,
                Poll::Pending => {
                    // Nothing more has arrived: what was gathered goes.
                    *this.draining = true;
                    continue;
                }
                Poll::Ready(None) => {
                    *this.inner_done = true;
                    *this.draining = true;
                    continue;
                }
                Poll::Ready(Some(item)) => item,
            };
            let data = match item {
                Ok(frame) => match frame.into_data() {
                    Ok(data) => data,
                    Err(frame) => {
                        // Trailers end the gathering, after the data.
                        *this.tail = Some(Box::new(Ok(frame)));
                        *this.draining = true;
                        continue;
                    }
                },
                Err(e) => {
                    *this.tail = Some(Box::new(Err(e)));
                    *this.draining = true;
                    continue;
                }
            };
            // The first frame goes with the head, and a frame as large as
            // the cap gains nothing from gathering.
            let first = !*this.started;
            *this.started = true;
            if empty && (first || data.len() >= MAX_GATHER_BYTES) {
                return Poll::Ready(Some(Ok(Frame::data(data))));
            }
            if empty {
                *this.lone = Some(data);
            } else {
                if let Some(lone) = this.lone.take() {
                    this.joined.reserve(lone.len() + data.len());
                    this.joined.extend_from_slice(&lone);
                }
                this.joined.extend_from_slice(&data);
            }
            let gathered = this.lone.as_ref().map_or(0, Bytes::len) + this.joined.len();
            if gathered >= MAX_GATHER_BYTES || this.inner.is_end_stream() {
                *this.draining = true;
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.gathered() == 0
            && self.tail.is_none()
            && (self.inner_done || self.inner.is_end_stream())
    }

    fn size_hint(&self) -> SizeHint {
        let inner = self.inner.size_hint();
        let queued = self.gathered() as u64;
        let mut hint = SizeHint::new();
        hint.set_lower(inner.lower() + queued);
        if let Some(upper) = inner.upper() {
            hint.set_upper(upper + queued);
        }
        hint
    }
}

#[cfg(test)]
mod tests {
    use std::collections::VecDeque;
    use std::sync::{Arc, Mutex};
    use std::task::Wake;

    use super::*;

    /// One step of a [`Script`]: `Some(item)` is ready, `None` is one
    /// `Pending`.
    type Step = Option<Result<Frame<Bytes>, &'static str>>;

    /// A body fed by the test; ends when the script runs out and `end` is
    /// set.
    struct Script {
        items: Arc<Mutex<VecDeque<Step>>>,
        end: bool,
    }

    impl Body for Script {
        type Data = Bytes;
        type Error = &'static str;

        fn poll_frame(
            self: Pin<&mut Self>,
            _cx: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Bytes>, &'static str>>> {
            let mut items = self.items.lock().unwrap();
            match items.pop_front() {
                Some(Some(item)) => Poll::Ready(Some(item)),
                Some(None) => Poll::Pending,
                None if self.end => Poll::Ready(None),
                None => Poll::Pending,
            }
        }

        fn is_end_stream(&self) -> bool {
            self.end && self.items.lock().unwrap().is_empty()
        }
    }

    struct CountWakes(Mutex<usize>);

    impl Wake for CountWakes {
        fn wake(self: Arc<Self>) {
            *self.0.lock().unwrap() += 1;
        }
    }

    /// What one poll gave: `Some(text)` for data, `"<pending>"`,
    /// `"<end>"`, `"<error>"`, `"<trailers>"`.
    fn poll_once(body: &mut Pin<Box<CoalesceBody<Script>>>, waker: &Arc<CountWakes>) -> String {
        let waker = std::task::Waker::from(Arc::clone(waker));
        let mut cx = Context::from_waker(&waker);
        match body.as_mut().poll_frame(&mut cx) {
            Poll::Pending => "<pending>".to_owned(),
            Poll::Ready(None) => "<end>".to_owned(),
            Poll::Ready(Some(Err(_))) => "<error>".to_owned(),
            Poll::Ready(Some(Ok(f))) => match f.into_data() {
                Ok(d) => String::from_utf8(d.to_vec()).unwrap(),
                Err(_) => "<trailers>".to_owned(),
            },
        }
    }

    fn data(s: &'static str) -> Step {
        Some(Ok(Frame::data(Bytes::from_static(s.as_bytes()))))
    }

    fn body(items: Vec<Step>, end: bool) -> Pin<Box<CoalesceBody<Script>>> {
        Box::pin(CoalesceBody::new(Script {
            items: Arc::new(Mutex::new(items.into())),
            end,
        }))
    }

    fn run(mut b: Pin<Box<CoalesceBody<Script>>>, polls: usize) -> (Vec<String>, usize) {
        let wakes = Arc::new(CountWakes(Mutex::new(0)));
        let out = (0..polls).map(|_| poll_once(&mut b, &wakes)).collect();
        let n = *wakes.0.lock().unwrap();
        (out, n)
    }

    const P: &str = "<pending>";

    #[test]
    fn a_burst_comes_out_joined_in_one_frame() {
        let (out, wakes) = run(body(vec![data("lead"), data("b"), data("c")], false), 4);
        // The first frame goes at once; the rest are gathered until the
        // inner body has nothing more, then released as one.
        assert_eq!(out, ["lead", "bc", P, P]);
        assert_eq!(wakes, 0, "no self-wake: nothing is waited for");
    }

    #[test]
    fn a_frame_leaves_at_the_first_pending_as_the_same_buffer() {
        let first = Bytes::from_static(b"first");
        let items = vec![data("lead"), Some(Ok(Frame::data(first.clone()))), None];
        let mut b = body(items, false);
        let wakes = Arc::new(CountWakes(Mutex::new(0)));
        assert_eq!(poll_once(&mut b, &wakes), "lead");
        let waker = std::task::Waker::from(Arc::clone(&wakes));
        let mut cx = Context::from_waker(&waker);
        let Poll::Ready(Some(Ok(f))) = b.as_mut().poll_frame(&mut cx) else {
            panic!("the gathered frame is released at the first Pending");
        };
        assert_eq!(
            f.into_data().unwrap().as_ptr(),
            first.as_ptr(),
            "not copied"
        );
        assert_eq!(poll_once(&mut b, &wakes), P);
    }

    #[test]
    fn paced_frames_are_not_held() {
        let items = vec![data("lead"), data("a"), None, data("b"), None];
        let (out, wakes) = run(body(items, false), 5);
        assert_eq!(out, ["lead", "a", "b", P, P]);
        assert_eq!(wakes, 0);
    }

    #[test]
    fn the_last_frames_and_the_end_are_not_delayed() {
        let mut b = body(vec![data("lead"), data("a"), data("z")], true);
        let wakes = Arc::new(CountWakes(Mutex::new(0)));
        assert_eq!(poll_once(&mut b, &wakes), "lead");
        assert_eq!(poll_once(&mut b, &wakes), "az");
        assert!(b.is_end_stream());
        let (out, _) = run(body(vec![data("only")], true), 2);
        assert_eq!(out, ["only", "<end>"]);
    }

    #[test]
    fn an_error_comes_after_the_frames_before_it() {
        let items = vec![
            data("lead"),
            data("a"),
            data("b"),
            Some(Err("boom")),
            data("x"),
        ];
        let (out, _) = run(body(items, false), 3);
        assert_eq!(out, ["lead", "ab", "<error>"]);
    }

    #[test]
    fn trailers_pass_in_order() {
        let trailers = Some(Ok(Frame::trailers(http::HeaderMap::new())));
        let items = vec![data("lead"), data("a"), data("b"), trailers];
        let mut b = body(items, true);
        let wakes = Arc::new(CountWakes(Mutex::new(0)));
        assert_eq!(poll_once(&mut b, &wakes), "lead");
        assert_eq!(poll_once(&mut b, &wakes), "ab");
        assert!(!b.is_end_stream(), "the trailers are still to come");
        assert_eq!(poll_once(&mut b, &wakes), "<trailers>");
        assert!(b.is_end_stream());
    }

    #[test]
    fn gathering_stops_at_the_byte_cap() {
        let half: &'static str = Box::leak("x".repeat(MAX_GATHER_BYTES / 2).into_boxed_str());
        let items = vec![data("lead"), data(half), data(half), data(half), None];
        let (out, _) = run(body(items, false), 4);
        assert_eq!(out[1].len(), MAX_GATHER_BYTES, "two halves fill the cap");
        assert_eq!(out[2].len(), MAX_GATHER_BYTES / 2);
        assert_eq!(out[3], P);
    }

    #[test]
    fn a_large_frame_goes_straight_through() {
        let big: &'static str = Box::leak("y".repeat(MAX_GATHER_BYTES).into_boxed_str());
        let (out, wakes) = run(body(vec![data("lead"), data(big), None], false), 3);
        assert_eq!(out[1].len(), MAX_GATHER_BYTES);
        assert_eq!(out[2], P);
        assert_eq!(wakes, 0);
    }
}
