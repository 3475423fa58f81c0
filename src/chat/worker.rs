//! Where a request's preparation (and so its compaction) runs.
//!
//! `prepare` runs in a task of its own, and the client's request future
//! only awaits its handle: a client that goes away mid-compaction no
//! longer cancels it, so the summary it paid for is still committed as a
//! record and the next turn substitutes it instead of summarising again.
//!
//! A large body (≥ [`LARGE_BODY_BYTES`]) is prepared on the blocking pool,
//! never on the async workers: parsing, hashing, estimating and the
//! engine's passes over 100,000 messages take seconds of CPU that would
//! stall every other connection (health checks included). At most
//! [`ChatState::heavy`] permits of such preparations run at once, which
//! bounds the memory they hold together, and the allocator gives the freed
//! memory back to the system after each one ([`trim`]).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use http::HeaderMap;

use crate::codec::ApiRequest;
use crate::error::ProxyError;
use crate::session::key::SessionKey;
use crate::session::store::Entry;
use crate::upstream::Upstream;
use crate::window::overflow::Overflow;

use super::conversation::Conversation;
use super::prepare::{prepare, Prepared};
use super::ChatState;

/// Bodies from this size on are prepared on the blocking pool.
pub const LARGE_BODY_BYTES: usize = 1 << 20;

/// One preparation, owned so it can outlive the request.
pub(super) struct Job {
    pub chat: Arc<ChatState>,
    pub upstream: Arc<Upstream>,
    pub entry: Arc<Entry<Conversation>>,
    pub client_headers: Arc<HeaderMap>,
    pub creq: ApiRequest,
    pub key: (SessionKey, u128),
    pub overflow: Option<Overflow>,
    /// Size of the client's body.
    pub body_len: usize,
}

/// Runs `job` detached and waits for it. Dropping the returned future
/// (the client left) leaves the job running to completion. The job is
/// boxed for the same reason its preparation is (see [`run_job`]).
pub(super) async fn run(job: Box<Job>) -> Result<Prepared, ProxyError> {
    let handle = if job.body_len >= LARGE_BODY_BYTES {
        let rt = tokio::runtime::Handle::current();
        let heavy = Arc::clone(&job.chat.heavy);
        tokio::spawn(async move {
            // Queued large preparations wait here, holding only their
            // parsed request, not a blocking thread.
            let permit = heavy.acquire_owned().await.ok();
            let prepared = tokio::task::spawn_blocking(move || {
                let prepared = rt.block_on(run_job(job));
                trim();
                // What the response still holds (the body sent, the
                // client's bytes) is freed later: the next sweep trims again.
                TRIM_DUE.store(true, Ordering::Relaxed);
                prepared
            })
            .await;
            drop(permit);
            prepared
        })
    } else {
        tokio::spawn(async move { Ok(run_job(job).await) })
    };
    match handle.await {
        Ok(Ok(prepared)) => Ok(prepared),
        Ok(Err(e)) | Err(e) => match e.try_into_panic() {
            Ok(panic) => std::panic::resume_unwind(panic),
            Err(_) => Err(ProxyError::Internal("request preparation cancelled".into())),
        },
    }
}

async fn run_job(job: Box<Job>) -> Prepared {
    // Boxed: the preparation's state machine (compaction, summary calls)
    // is kilobytes, and a task moves its future by value as it is spawned
    // and stored; on the heap every such move is a pointer's.
    Box::pin(prepare(
        &job.chat,
        &job.upstream,
        &job.entry,
        &job.client_headers,
        job.creq,
        job.key,
        job.overflow,
    ))
    .await
}

/// A large preparation ran since the last [`trim_if_due`].
static TRIM_DUE: AtomicBool = AtomicBool::new(false);

/// Trims (see [`trim`]) when a large preparation ran since the last call;
/// run periodically (the session sweep).
pub fn trim_if_due() {
    if TRIM_DUE.swap(false, Ordering::Relaxed) {
        trim();
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
pub fn trim() {}
