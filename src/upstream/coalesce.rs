//! Hands hyper every response frame that is already available in one go,
//! so it writes them with one `writev` instead of one per frame.
//!
//! hyper's HTTP/1 client decodes a response body one frame at a time, the
//! next only once the previous one was taken. Forwarded as is, an SSE burst
//! the upstream wrote in one segment (22 events from a fast server, or a
//! backlog after a slow reader) costs one flush, one syscall and one client
//! wake-up per event, where the upstream itself paid one. [`CoalesceBody`]
//! takes frames while the inner body has them ready and releases what it
//! gathered at the first `Pending`.
//!
//! The upstream connection is driven by the body that reads it
//! (`upstream::pool`), so a `Pending` here means the socket has nothing
//! more: everything gathered goes out then, and nothing is held while the
//! upstream is idle. (When hyper's connection ran as a task of its own, the
//! body had to yield a scheduler turn per frame for that task to decode the
//! next one.)
//!
//! The first data frame goes out at once, with the response head in the
//! same write (a stream's time to first byte is not held up). Bytes and
//! frame boundaries are unchanged: the frames come out one by one, back to
//! back.

use std::collections::VecDeque;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use pin_project_lite::pin_project;

/// At most this many bytes are gathered before they are released.
const MAX_GATHER_BYTES: usize = 64 << 10;
/// At most this many frames are gathered. The server writes flattened
/// (`server::serve_on`): a batch is one `write` whatever its frame count.
const MAX_GATHER_FRAMES: usize = 64;
/// Frames room is made for when gathering begins (a typical burst fits).
const GATHER_RESERVE: usize = 32;

pin_project! {
    /// See the module docs.
    pub(crate) struct CoalesceBody<B: Body> {
        #[pin]
        inner: B,
        queue: VecDeque<Result<Frame<Bytes>, B::Error>>,
        queued_bytes: usize,
        // Releasing `queue` to hyper; the inner body is not polled meanwhile.
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
            queue: VecDeque::new(),
            queued_bytes: 0,
            draining: false,
            inner_done: false,
            started: false,
        }
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
                if let Some(item) = this.queue.pop_front() {
                    if let Ok(f) = &item {
                        *this.queued_bytes -= f.data_ref().map_or(0, Bytes::len);
                    }
                    return Poll::Ready(Some(item));
                }
                *this.draining = false;
            }
            if *this.inner_done {
                return Poll::Ready(None);
            }
            let item = match this.inner.as_mut().poll_frame(cx) {
                Poll::Pending if this.queue.is_empty() => return Poll::Pending,
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
            let data_len = match &item {
                Ok(f) => f.data_ref().map(Bytes::len),
                Err(_) => None,
            };
            // The first frame goes with the head; errors, trailers and the
            // final frame end the gathering, and a frame as large as the
            // cap gains nothing from it.
            let gather = *this.started
                && data_len.is_some_and(|n| n < MAX_GATHER_BYTES)
                && !this.inner.is_end_stream();
            *this.started |= data_len.is_some();
            if this.queue.is_empty() && !gather {
                return Poll::Ready(Some(item));
            }
            if this.queue.capacity() == 0 {
                // Reserved once: growing 0 → 4 → 8 → 16 → 32 cost an SSE
                // response four reallocations (~3,000 instructions).
                this.queue.reserve(GATHER_RESERVE);
            }
            this.queue.push_back(item);
            *this.queued_bytes += data_len.unwrap_or(0);
            if !gather
                || this.queue.len() >= MAX_GATHER_FRAMES
                || *this.queued_bytes >= MAX_GATHER_BYTES
            {
                *this.draining = true;
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.queue.is_empty() && (self.inner_done || self.inner.is_end_stream())
    }

    fn size_hint(&self) -> SizeHint {
        let inner = self.inner.size_hint();
        let queued = self.queued_bytes as u64;
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
    fn a_burst_comes_out_back_to_back_with_no_pending_between() {
        let (out, wakes) = run(body(vec![data("lead"), data("b"), data("c")], false), 5);
        // The first frame goes at once; the rest are gathered until the
        // inner body has nothing more, then released one poll after another.
        assert_eq!(out, ["lead", "b", "c", P, P]);
        assert_eq!(wakes, 0, "no self-wake: nothing is waited for");
    }

    #[test]
    fn a_frame_leaves_at_the_first_pending() {
        let items = vec![data("lead"), data("first"), None, None];
        let (out, _) = run(body(items, false), 4);
        assert_eq!(out, ["lead", "first", P, P]);
    }

    #[test]
    fn paced_frames_are_not_held() {
        let items = vec![data("lead"), data("a"), None, data("b"), None];
        let (out, wakes) = run(body(items, false), 5);
        assert_eq!(out, ["lead", "a", "b", P, P]);
        assert_eq!(wakes, 0);
    }

    #[test]
    fn the_last_frame_and_the_end_are_not_delayed() {
        let (out, _) = run(body(vec![data("lead"), data("a"), data("z")], true), 4);
        assert_eq!(out, ["lead", "a", "z", "<end>"]);
        let (out, _) = run(body(vec![data("only")], true), 2);
        assert_eq!(out, ["only", "<end>"]);
    }

    #[test]
    fn an_error_comes_after_the_frames_before_it() {
        let items = vec![data("lead"), data("a"), Some(Err("boom")), data("x")];
        let (out, _) = run(body(items, false), 3);
        assert_eq!(out, ["lead", "a", "<error>"]);
    }

    #[test]
    fn trailers_pass_in_order() {
        let trailers = Some(Ok(Frame::trailers(http::HeaderMap::new())));
        let (out, _) = run(body(vec![data("lead"), data("a"), trailers], true), 4);
        assert_eq!(out, ["lead", "a", "<trailers>", "<end>"]);
    }

    #[test]
    fn gathering_stops_at_the_frame_cap() {
        let items: Vec<_> = std::iter::once(data("lead"))
            .chain((0..MAX_GATHER_FRAMES + 4).map(|_| data("x")))
            .chain(std::iter::once(None))
            .collect();
        let mut b = body(items, false);
        let wakes = Arc::new(CountWakes(Mutex::new(0)));
        assert_eq!(poll_once(&mut b, &wakes), "lead");
        assert_eq!(poll_once(&mut b, &wakes), "x");
        // The cap released the first batch with frames still ready.
        assert_eq!(b.queue.len(), MAX_GATHER_FRAMES - 1);
        let rest: Vec<_> = (0..MAX_GATHER_FRAMES + 4)
            .map(|_| poll_once(&mut b, &wakes))
            .collect();
        assert!(rest[..MAX_GATHER_FRAMES + 3].iter().all(|s| s == "x"));
        assert_eq!(rest[MAX_GATHER_FRAMES + 3], P);
    }

    #[test]
    fn a_large_frame_goes_straight_through() {
        let big: &'static str = Box::leak("y".repeat(MAX_GATHER_BYTES).into_boxed_str());
        let (out, wakes) = run(body(vec![data("lead"), data(big), None], false), 3);
        assert_eq!(out[1].len(), MAX_GATHER_BYTES);
        assert_eq!(out[2], P);
        assert_eq!(wakes, 0);
    }

    #[test]
    fn end_of_stream_and_size_hint_account_for_queued_bytes() {
        let mut b = body(vec![data("lead"), data("abc"), data("de")], true);
        let wakes = Arc::new(CountWakes(Mutex::new(0)));
        assert_eq!(poll_once(&mut b, &wakes), "lead");
        assert_eq!(poll_once(&mut b, &wakes), "abc");
        // "de" is gathered and the inner body has ended.
        assert!(!b.is_end_stream());
        assert_eq!(b.size_hint().lower(), 2);
        assert_eq!(poll_once(&mut b, &wakes), "de");
        assert!(b.is_end_stream());
    }
}
