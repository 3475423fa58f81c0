//! Where a request's preparation (and so its compaction) runs.
//!
//! `prepare` is polled once in the request's own task; one that has to
//! wait then runs in a task of its own, and the client's request future
//! only awaits its handle: a client that goes away mid-compaction does not
//! cancel it, so the summary it paid for is still committed as a record
//! and the next turn substitutes it instead of summarising again.
//!
//! A large body (≥ [`LARGE_BODY_BYTES`]) is prepared on the blocking pool,
//! never on the async workers: parsing, hashing, estimating and the
//! engine's passes over 100,000 messages take seconds of CPU that would
//! stall every other connection (health checks included). At most
//! [`ChatState::heavy`] permits of such preparations run at once, which
//! bounds the memory they hold together, and the allocator gives the freed
//! memory back to the system after each one ([`trim`]).

use std::future::{poll_fn, Future};
use std::sync::atomic::AtomicU64;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::Poll;
use std::time::Duration;

use http::HeaderMap;
use tokio::task::JoinError;

use bytes::Bytes;

use crate::codec::{Api, ApiRequest, DecodeError};
use crate::error::ProxyError;
use crate::metrics::chat::DecodePool;
use crate::metrics::Metrics;
use crate::session::key::SessionKey;
use crate::session::store::Entry;
use crate::upstream::Upstream;
use crate::window::overflow::Overflow;

use super::conversation::{rough_value_tokens, Conversation};
use super::prepare::{prepare, Prepared};
use super::ChatState;

/// Bodies from this size on are prepared on the blocking pool.
pub(crate) const LARGE_BODY_BYTES: usize = 1 << 20;

/// One preparation, owned so it can outlive the request.
pub(super) struct Job {
    pub(crate) chat: Arc<ChatState>,
    pub(crate) upstream: Arc<Upstream>,
    pub(crate) entry: Arc<Entry<Conversation>>,
    pub(crate) client_headers: Arc<HeaderMap>,
    /// The credential parameters of the client's query, as written.
    pub(crate) credential_query: Option<Arc<str>>,
    pub(crate) creq: ApiRequest,
    pub(crate) key: (SessionKey, u128),
    /// Where the session id came from ([`crate::session::key::SessionSource::label`]).
    pub(crate) id_kind: &'static str,
    pub(crate) overflow: Option<Overflow>,
    /// Size of the client's body.
    pub(crate) body_len: usize,
}

/// Parses and decodes a request body, once per request: a large one
/// (≥ [`LARGE_BODY_BYTES`]) on the blocking pool after a
/// [`ChatState::heavy`] permit, like its preparation. Decoding a Messages or
/// Responses body of 100,000s of blocks takes seconds of CPU; on an async
/// worker it would stall every connection that worker serves.
pub(super) async fn decode(
    chat: &ChatState,
    api: Api,
    bytes: Bytes,
) -> Result<ApiRequest, DecodeError> {
    if bytes.len() < LARGE_BODY_BYTES {
        chat.metrics.chat.decoded(DecodePool::Inline);
        return ApiRequest::parse_with(api, bytes, Some(rough_value_tokens));
    }
    let permit = Arc::clone(&chat.heavy).acquire_owned().await.ok();
    let metrics = Arc::clone(&chat.metrics);
    let decoded = tokio::task::spawn_blocking(move || {
        metrics.chat.decoded(DecodePool::Blocking);
        ApiRequest::parse_with(api, bytes, Some(rough_value_tokens))
    })
    .await;
    drop(permit);
    joined(decoded).unwrap_or(Err(DecodeError::Unsupported("request")))
}

/// Lets go of a job (its `Drop` frees a large body's decoded request on
/// the blocking pool).
pub(super) fn release(job: Box<Job>) {
    drop(job);
}

impl Drop for Job {
    /// A large body's decoded request (hundreds of thousands of engine
    /// messages, the codec's tables: millions of small allocations, and
    /// its decode moved into the codec's memo) is freed on the blocking
    /// pool wherever the job is let go: once its response is under way
    /// ([`release`]), but also on an early return (the upstream refused
    /// the connection) or with a request future dropped mid-wait (the
    /// client left). Freed inline, it held the async worker that dropped
    /// it, and every connection that worker serves, for as long.
    fn drop(&mut self) {
        if self.body_len >= LARGE_BODY_BYTES {
            free_off_runtime(std::mem::replace(&mut self.creq, ApiRequest::empty()));
        }
    }
}

/// Drops `value` on the blocking pool when there is a runtime to hand it
/// to, else here.
fn free_off_runtime<T: Send + 'static>(value: T) {
    #[cfg(test)]
    tests::HANDED_OFF.set(tests::HANDED_OFF.get() + 1);
    match tokio::runtime::Handle::try_current() {
        Ok(rt) => drop(rt.spawn_blocking(move || drop(value))),
        Err(_) => drop(value),
    }
}

/// What a preparation gives back: the body to send, and its job, whose
/// request (parsed and decoded once) a retry prepares again.
pub(super) type Done = (Prepared, Box<Job>);

/// Runs `job` and waits for it. Once the preparation has to wait (the
/// session lock, the store, a summary call), it goes on in a task of its
/// own: dropping the returned future (the client left) leaves it running
/// to completion.
pub(super) async fn run(job: Box<Job>) -> Result<Done, ProxyError> {
    if job.body_len >= LARGE_BODY_BYTES {
        return run_large(job).await;
    }
    // Boxed: once polled, the preparation may not move (a lock's waiter is
    // queued inside it), yet a pending one still goes to a task; on the
    // heap, handing it over moves a pointer.
    let mut prep = Box::pin(preparation(job));
    // Most preparations (lock free, state in memory, nothing due) finish
    // on their first poll: a task for them would cost a spawn and a wake
    // per request, and one that finished has nothing left to cancel.
    if let Poll::Ready(prepared) = poll_fn(|cx| Poll::Ready(prep.as_mut().poll(cx))).await {
        return Ok(prepared);
    }
    // The task's first poll registers its own wakers; the request's, left
    // from the poll above, only wake it once for nothing.
    joined(tokio::spawn(prep).await)
}

/// [`run`] for a large body: on the blocking pool, after a permit.
async fn run_large(job: Box<Job>) -> Result<Done, ProxyError> {
    let rt = tokio::runtime::Handle::current();
    let heavy = Arc::clone(&job.chat.heavy);
    let handle = tokio::spawn(async move {
        // Queued large preparations wait here, holding only their
        // parsed request, not a blocking thread.
        let permit = heavy.acquire_owned().await.ok();
        let prepared = tokio::task::spawn_blocking(move || {
            let prepared = rt.block_on(preparation(job));
            trim();
            // What the response still holds (the body sent, the
            // client's bytes) is freed later: the next sweep trims again.
            TRIM_DUE.store(true, Ordering::Relaxed);
            prepared
        })
        .await;
        drop(permit);
        prepared
    });
    joined(handle.await.and_then(|inner| inner))
}

/// The outcome of a detached preparation: its panic resumed here, a
/// cancelled one (runtime shutting down) an internal error.
fn joined<T>(result: Result<T, JoinError>) -> Result<T, ProxyError> {
    result.map_err(|e| match e.try_into_panic() {
        Ok(panic) => std::panic::resume_unwind(panic),
        Err(_) => ProxyError::Internal("request preparation cancelled".into()),
    })
}

async fn preparation(mut job: Box<Job>) -> Done {
    // Borrowed from the job, not moved into the preparation's state: every
    // byte of that state is copied as the state is boxed.
    let Job {
        chat,
        upstream,
        entry,
        client_headers,
        credential_query,
        creq,
        key,
        id_kind,
        overflow,
        ..
    } = &mut *job;
    let client = super::Client {
        headers: client_headers,
        query: credential_query.as_deref(),
    };
    let prepared = prepare(
        chat,
        upstream,
        entry,
        client,
        creq,
        (key.0, key.1, *id_kind),
        overflow.as_ref(),
    )
    .await;
    (prepared, job)
}

/// A trim for abandoned bodies is queued ([`BodyGuard`]).
static ABANDONED_TRIM_QUEUED: AtomicBool = AtomicBool::new(false);

/// A burst of abandoned bodies (clients that gave up together) is trimmed
/// once, this long after the first: `malloc_trim` walks every arena.
const ABANDONED_TRIM_DELAY: Duration = Duration::from_millis(250);

/// Watches a chat request body being read whole: dropped before
/// [`BodyGuard::complete`] (the client went away mid-upload, the read timed
/// out or hit a limit) after [`LARGE_BODY_BYTES`] or more arrived, it asks
/// the allocator to give the freed buffer back. glibc otherwise keeps it:
/// 20 clients abandoning 31 MB uploads left 546 MB resident until the next
/// large request happened to trim.
pub(super) struct BodyGuard {
    metrics: Arc<Metrics>,
    /// The body's bytes read so far (the request's `bytes_in`).
    seen: Option<Arc<AtomicU64>>,
}

impl BodyGuard {
    /// Watches the body whose bytes `seen` counts (none: nothing to watch).
    pub(crate) fn new(metrics: &Arc<Metrics>, seen: Option<Arc<AtomicU64>>) -> Self {
        Self {
            metrics: Arc::clone(metrics),
            seen,
        }
    }

    /// The body was read whole: its bytes are in use, nothing to give back.
    pub(crate) fn complete(mut self) {
        self.seen = None;
    }
}

impl Drop for BodyGuard {
    fn drop(&mut self) {
        let Some(seen) = &self.seen else {
            return;
        };
        if seen.load(Ordering::Relaxed) < LARGE_BODY_BYTES as u64 {
            return;
        }
        self.metrics.record_abandoned_body();
        // Whatever the queued trim runs too early to see, the next sweep
        // gives back.
        TRIM_DUE.store(true, Ordering::Relaxed);
        if ABANDONED_TRIM_QUEUED.swap(true, Ordering::AcqRel) {
            return;
        }
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            ABANDONED_TRIM_QUEUED.store(false, Ordering::Release);
            return;
        };
        // Off the async workers: a trim of a large heap takes milliseconds.
        rt.spawn(async {
            tokio::time::sleep(ABANDONED_TRIM_DELAY).await;
            // Cleared first: a body abandoned while this trim runs queues
            // the next one.
            ABANDONED_TRIM_QUEUED.store(false, Ordering::Release);
            let _ = tokio::task::spawn_blocking(trim).await;
        });
    }
}

/// A large preparation ran since the last [`trim_if_due`].
static TRIM_DUE: AtomicBool = AtomicBool::new(false);

/// Trims (see [`trim`]) when a large preparation ran since the last call;
/// run periodically (the session sweep, on an async worker): on the
/// blocking pool when there is one. `malloc_trim` walks every arena under
/// its lock and hands back each free page of a heap that large bodies
/// grew to hundreds of MB, while the blocking pool may be allocating in
/// the same arenas.
pub fn trim_if_due() {
    if TRIM_DUE.swap(false, Ordering::Relaxed) {
        match tokio::runtime::Handle::try_current() {
            Ok(rt) => drop(rt.spawn_blocking(trim)),
            Err(_) => trim(),
        }
    }
}

/// Returns the memory freed by a large preparation to the system: glibc
/// keeps freed heap pages in its arenas, so without this the peak of one
/// huge body stays resident for the life of the process.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
pub fn trim() {
    // SAFETY: `malloc_trim` only releases free memory held by the
    // allocator; it takes no pointers and is thread-safe in glibc.
    #[allow(unsafe_code)]
    unsafe {
        libc::malloc_trim(0);
    }
}

/// Other allocators return memory on their own.
#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
pub(crate) fn trim() {}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use std::cell::Cell;
    use std::sync::mpsc;
    use std::thread::ThreadId;

    use crate::session::key::SessionKey;

    use super::*;

    thread_local! {
        /// Values this thread handed to [`free_off_runtime`].
        pub(super) static HANDED_OFF: Cell<usize> = const { Cell::new(0) };
    }

    /// Tells which thread dropped it.
    struct Witness(mpsc::Sender<ThreadId>);

    impl Drop for Witness {
        fn drop(&mut self) {
            let _ = self.0.send(std::thread::current().id());
        }
    }

    fn current_thread() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap()
    }

    #[test]
    fn a_value_freed_off_the_runtime_is_dropped_on_another_thread() {
        let (tx, rx) = mpsc::channel();
        current_thread().block_on(async { free_off_runtime(Witness(tx)) });
        let dropped_on = rx.recv_timeout(Duration::from_secs(30)).unwrap();
        assert_ne!(dropped_on, std::thread::current().id());
        // Without a runtime there is no pool: dropped here.
        let (tx, rx) = mpsc::channel();
        free_off_runtime(Witness(tx));
        assert_eq!(rx.try_recv().unwrap(), std::thread::current().id());
    }

    fn job(body_len: usize) -> Box<Job> {
        let config = crate::config::Config::default();
        let metrics = Arc::new(crate::metrics::Metrics::default());
        let chat =
            Arc::new(super::super::ChatState::from_config(&config, Arc::clone(&metrics)).unwrap());
        let upstream = Arc::new(Upstream::new(&config, metrics).unwrap());
        let key = SessionKey::from_u128(7);
        let entry = chat.sessions.get_or_create(key, Conversation::default);
        let body = r#"{"model":"m","input":[{"role":"user","content":"hi"}]}"#;
        Box::new(Job {
            chat,
            upstream,
            entry,
            client_headers: Arc::new(HeaderMap::new()),
            credential_query: None,
            creq: ApiRequest::parse(Api::Responses, body).unwrap(),
            key: (key, 0),
            id_kind: "test",
            overflow: None,
            body_len,
        })
    }

    #[test]
    fn a_large_bodys_job_frees_its_request_off_the_runtime_wherever_dropped() {
        let rt = current_thread();
        let _in = rt.enter();
        for (len, handed) in [(LARGE_BODY_BYTES - 1, 0), (LARGE_BODY_BYTES, 1)] {
            let before = HANDED_OFF.get();
            // Dropped as an early return or a cancelled request drops it,
            // not through `release`.
            drop(job(len));
            assert_eq!(HANDED_OFF.get() - before, handed, "body of {len} bytes");
        }
    }
}
