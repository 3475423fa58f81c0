//! Hands hyper every response frame that is already available in one go,
//! so it writes them with one `writev` instead of one per frame.
//!
//! hyper's client delivers a response body one frame at a time: its
//! connection task decodes the next chunk only after the previous one was
//! taken. Forwarded as is, an SSE burst the upstream wrote in one segment
//! (22 events from a fast server, or a backlog after a slow reader) costs
//! one flush, one syscall and one client wake-up per event, where the
//! upstream itself paid one. [`CoalesceBody`] takes a frame, gives the
//! producer a scheduler turn to deliver the next, and releases what it
//! gathered once nothing more is ready.
//!
//! The first data frame goes out at once, with the response head in the
//! same write (a stream's time to first byte is not held up). Every later
//! frame is gathered, the frames of a paced stream (a model generating
//! tokens) too: on the thread-per-core runtime the binary runs
//! (`server::cores`) the producer lives on the same thread, so the yield is
//! a push onto the local run queue, not a syscall, and a lone frame leaves
//! one scheduler turn later. Telling a burst from a paced stream by the
//! time between frames did not work under load: with 64 connections on a
//! thread, the turn the producer needs to decode the next frame of a burst
//! took longer than any gap worth calling a burst, and an SSE response of
//! 22 events went out in 22 writes.
//!
//! "Nothing more is ready" needs two `Pending`s of the inner body in a row:
//! when a body returns `Pending` and there was nothing to flush, hyper's
//! HTTP/1 dispatcher polls it once more within the same task poll, before
//! the producer could run. One `Pending` after a yield proves nothing.
//!
//! Bytes and frame boundaries are unchanged: the frames come out one by
//! one, back to back. Nothing is held while the upstream is idle: once the
//! producer has had its turn and has nothing more, everything gathered goes
//! out.

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
/// Consecutive `Pending`s of the inner body that release the gathered
/// frames (see the module docs).
const IDLE_POLLS_TO_RELEASE: u8 = 2;

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
        // Consecutive `Pending`s of the inner body while frames are queued.
        idle_polls: u8,
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
            idle_polls: 0,
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
                    *this.idle_polls += 1;
                    if *this.idle_polls >= IDLE_POLLS_TO_RELEASE {
                        // The producer had its turn and has nothing more.
                        *this.draining = true;
                        continue;
                    }
                    cx.waker().wake_by_ref();
                    return Poll::Pending;
                }
                Poll::Ready(None) => {
                    *this.inner_done = true;
                    *this.draining = true;
                    continue;
                }
                Poll::Ready(Some(item)) => item,
            };
            *this.idle_polls = 0;
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
                continue;
            }
            // One scheduler turn for the producer (hyper's client connection
            // task, woken when this frame was taken) to decode the next one.
            cx.waker().wake_by_ref();
            return Poll::Pending;
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
    fn a_burst_comes_out_back_to_back_once_the_producer_is_idle() {
        let (out, wakes) = run(body(vec![data("lead"), data("b"), data("c")], false), 7);
        // The first frame goes at once. Each gathered frame and the first
        // idle poll cost one self-wake; the second idle poll releases the
        // burst with no Pending between its frames.
        assert_eq!(out, ["lead", P, P, P, "b", "c", P]);
        assert_eq!(wakes, 3);
    }

    #[test]
    fn one_idle_poll_does_not_release() {
        // A producer that is slow by one poll still gets batched.
        let items = vec![data("lead"), data("a"), None, data("b")];
        let (out, _) = run(body(items, false), 7);
        assert_eq!(out, ["lead", P, P, P, P, "a", "b"]);
    }

    #[test]
    fn a_lone_frame_is_released_when_the_producer_stays_idle() {
        let items = vec![data("lead"), data("first"), None, None, None];
        let (out, _) = run(body(items, false), 5);
        assert_eq!(out, ["lead", P, P, "first", P]);
    }

    #[test]
    fn paced_frames_each_leave_after_the_producer_had_its_turn() {
        let items = vec![data("lead"), data("a"), None, None, data("b"), None, None];
        let (out, wakes) = run(body(items, false), 7);
        assert_eq!(out, ["lead", P, P, "a", P, P, "b"]);
        assert_eq!(wakes, 4);
    }

    #[test]
    fn the_last_frame_and_the_end_are_not_delayed() {
        let (out, wakes) = run(body(vec![data("lead"), data("a"), data("z")], true), 5);
        assert_eq!(out, ["lead", P, "a", "z", "<end>"]);
        assert_eq!(wakes, 1);
        let (out, wakes) = run(body(vec![data("only")], true), 2);
        assert_eq!(out, ["only", "<end>"]);
        assert_eq!(wakes, 0);
    }

    #[test]
    fn an_error_comes_after_the_frames_before_it() {
        let items = vec![data("lead"), data("a"), Some(Err("boom")), data("x")];
        let (out, _) = run(body(items, false), 4);
        assert_eq!(out, ["lead", P, "a", "<error>"]);
    }

    #[test]
    fn trailers_pass_in_order() {
        let trailers = Some(Ok(Frame::trailers(http::HeaderMap::new())));
        let (out, _) = run(body(vec![data("lead"), data("a"), trailers], true), 5);
        assert_eq!(out, ["lead", P, "a", "<trailers>", "<end>"]);
    }

    #[test]
    fn gathering_stops_at_the_frame_cap() {
        let items: Vec<_> = std::iter::once(data("lead"))
            .chain((0..MAX_GATHER_FRAMES + 4).map(|_| data("x")))
            .collect();
        let (out, wakes) = run(body(items, false), MAX_GATHER_FRAMES + 2);
        // MAX-1 yields, then the MAX-th frame releases the batch at once.
        assert_eq!(wakes, MAX_GATHER_FRAMES - 1);
        assert_eq!(out[0], "lead");
        assert!(out[1..MAX_GATHER_FRAMES].iter().all(|s| s == P));
        assert_eq!(out[MAX_GATHER_FRAMES], "x");
        assert_eq!(out[MAX_GATHER_FRAMES + 1], "x");
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
        assert_eq!(poll_once(&mut b, &wakes), P);
        assert!(!b.is_end_stream());
        assert_eq!(b.size_hint().lower(), 3);
        assert_eq!(poll_once(&mut b, &wakes), "abc");
        assert_eq!(poll_once(&mut b, &wakes), "de");
        assert!(b.is_end_stream());
    }
}
