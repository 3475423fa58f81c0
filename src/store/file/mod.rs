//! The embedded backend: one owner-only, append-only log file of
//! checksummed entries, compactor's own, and an index of it in memory.
//!
//! Every change is an entry appended at the end and made durable
//! (`sync_data`) before the call returns: a record put (with the deletes
//! of the records and states it evicts), the last uses noted since the last sweep, a
//! learned window, a conversation state, deletes. The index (rebuilt by a
//! scan at open) says where each live entry is, so [`Store::may_have`],
//! [`Store::touch`] and a sweep read nothing, and a read is one positioned
//! read whose checksum is checked. All file I/O runs on tokio's blocking
//! pool, never on an async worker.
//!
//! The file is bounded, everything it keeps counted: records by their
//! size, conversation states and learned windows by their bytes in the
//! file. A put first drops the least recently used records and states
//! until the new entry fits `max_bytes`, states taking at most a quarter
//! of it (the policy and why: `evict.rs`), and a rewrite copies the live
//! entries into a new file while writes go on (see `rewrite.rs` and
//! `gate.rs`), so the file stays within 1.5× the bound, running and after
//! a restart (under a bound of about 128 KiB, within its live entries
//! plus 64 KiB).
//!
//! Nothing in a file can make a call or the open panic: a file that is
//! damaged or not ours is moved aside and a fresh one started with every
//! entry that checks (see `open.rs`); a record damaged after open is a
//! `Corrupt` error and leaves the index.
//!
//! Files: `frame.rs` (the bytes), `entry.rs` (payloads), `index.rs`,
//! `evict.rs` (what the bound drops), `scan.rs` (open's read), `open.rs`,
//! `rewrite.rs` (the rewrite), `gate.rs` (writes paced by it), `room.rs`
//! (every write), `calls.rs`, `disk.rs` (lock, renames, moving aside),
//! `inner.rs` (what they share).

mod calls;
mod disk;
mod entry;
mod evict;
mod frame;
mod gate;
mod index;
mod inner;
mod open;
mod rewrite;
mod room;
mod scan;
#[cfg(test)]
mod tests;
#[cfg(test)]
mod tests_bound;
#[cfg(test)]
mod tests_damage;
#[cfg(test)]
mod tests_hook;
#[cfg(test)]
mod tests_path;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::{Store, StoreError, StoredRecord};

pub use disk::OpenError;
use inner::{Inner, Settings};

/// The file store.
pub struct FileStore {
    inner: Arc<Inner>,
    /// Learned windows as read at open.
    windows: Vec<(String, String, u64)>,
    /// Where a damaged or foreign file was kept at open.
    moved_aside: Option<PathBuf>,
}

impl std::fmt::Debug for FileStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FileStore")
            .field("path", &self.inner.path)
            .finish_non_exhaustive()
    }
}

impl FileStore {
    /// Opens (or creates) the file and rebuilds the index; a damaged file
    /// or one that is not ours is moved aside and a fresh one started
    /// ([`FileStore::moved_aside`]). Blocking: call it at start-up, before
    /// serving. Fails only when the file cannot be used at all (held by
    /// another process, no permission, I/O).
    pub fn open(path: &Path, ttl: Duration, max_bytes: usize) -> Result<Self, OpenError> {
        let settings = Settings {
            ttl_ms: u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX),
            max_bytes,
        };
        let opened = open::open(path, settings)?;
        let windows = opened
            .inner
            .shared()
            .index
            .windows
            .iter()
            .map(|((u, m), t)| (u.clone(), m.clone(), *t))
            .collect();
        Ok(Self {
            inner: opened.inner,
            windows,
            moved_aside: opened.moved_aside,
        })
    }

    /// How long a write may wait for a running rewrite's progress
    /// before it is refused (default 200 ms; keep it under the store's
    /// call timeout).
    pub fn set_write_wait(&self, wait: Duration) {
        let ms = u64::try_from(wait.as_millis()).unwrap_or(u64::MAX);
        self.inner.write_wait_ms.store(ms, Ordering::Relaxed);
    }

    /// Where a damaged or foreign file was moved at open.
    pub fn moved_aside(&self) -> Option<&Path> {
        self.moved_aside.as_deref()
    }

    /// Records held.
    pub fn len(&self) -> usize {
        self.inner.shared().index.meta.len()
    }

    /// Whether no record is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bytes the records hold (by [`StoredRecord::size`]).
    pub fn bytes(&self) -> usize {
        self.inner.shared().index.bytes
    }

    /// Size of the file on disk.
    pub fn file_len(&self) -> u64 {
        std::fs::metadata(&self.inner.path).map_or(0, |m| m.len())
    }

    /// Whether a rewrite is running.
    pub fn rewriting(&self) -> bool {
        self.inner.gate.get().rewriting
    }

    /// Runs the write `f` on the blocking pool, unless [`MAX_QUEUED`]
    /// writes are already waiting there: then it is refused at once (the
    /// caller keeps the record in memory). A disk slower than the writes
    /// would otherwise hold a blocking thread for each of them, every one
    /// still to run long after its caller's timeout gave up on it.
    async fn write<F>(&self, f: F) -> Result<(), StoreError>
    where
        F: FnOnce(&Arc<Inner>) -> Result<(), StoreError> + Send + 'static,
    {
        let queued = self.inner.queued.fetch_add(1, Ordering::AcqRel);
        let slot = Slot(Arc::clone(&self.inner));
        if queued >= MAX_QUEUED {
            self.inner
                .counters
                .queue_full
                .fetch_add(1, Ordering::Relaxed);
            return Err(StoreError::Backend(format!(
                "{MAX_QUEUED} writes already queued for the store file; the record stays in memory"
            )));
        }
        // Dropped with this call (its caller's timeout): a write not yet
        // started is not made. One already running is finished: its
        // entry is whole and the index knows it.
        let gave_up = Arc::new(AtomicBool::new(false));
        let mut given_up = GivenUp {
            flag: Arc::clone(&gave_up),
            armed: true,
        };
        let done = self
            .blocking(move |inner| {
                let _slot = slot;
                if gave_up.load(Ordering::Acquire) {
                    inner.counters.abandoned.fetch_add(1, Ordering::Relaxed);
                    return Err(StoreError::Timeout);
                }
                f(inner)
            })
            .await;
        given_up.armed = false;
        done
    }

    /// Runs `f` on the blocking pool.
    async fn blocking<T, F>(&self, f: F) -> Result<T, StoreError>
    where
        T: Send + 'static,
        F: FnOnce(&Arc<Inner>) -> Result<T, StoreError> + Send + 'static,
    {
        let inner = Arc::clone(&self.inner);
        tokio::task::spawn_blocking(move || f(&inner))
            .await
            .map_err(|e| inner::backend("task", e))?
    }
}

/// Writes that may wait for the disk at once; more are refused. With
/// group commit a sync takes every write queued, so this is about how
/// many a sync may take, not how many run.
const MAX_QUEUED: usize = 32;

/// One admitted write, until it is done (or dropped unrun).
struct Slot(Arc<Inner>);

/// Sets `flag` when the call it belongs to is dropped before it ended.
struct GivenUp {
    flag: Arc<AtomicBool>,
    armed: bool,
}

impl Drop for GivenUp {
    fn drop(&mut self) {
        if self.armed {
            self.flag.store(true, Ordering::Release);
        }
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.queued.fetch_sub(1, Ordering::AcqRel);
    }
}

impl Drop for FileStore {
    /// A running rewrite gives up, and the calls in flight end, before
    /// the store is gone: the file's lock is released when this returns,
    /// so the same file can be opened again right away.
    fn drop(&mut self) {
        self.inner.closing.store(true, Ordering::Release);
        let deadline = Instant::now() + Duration::from_secs(10);
        self.inner.gate.wait_idle(deadline);
        while Arc::strong_count(&self.inner) > 1 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}

#[async_trait::async_trait]
impl Store for FileStore {
    fn name(&self) -> &'static str {
        "file"
    }

    fn keyer_secret(&self) -> Option<u64> {
        Some(self.inner.secret)
    }

    fn may_have(&self, len: usize) -> bool {
        self.inner
            .shared()
            .index
            .lengths
            .first_key_value()
            .is_some_and(|(k, _)| *k <= len)
    }

    fn touch(&self, cred: u128, prefix_hash: u128) {
        let mut shared = self.inner.shared();
        if let Some(m) = shared
            .index
            .set_touched(&(cred, prefix_hash), inner::now_ms())
        {
            m.dirty = true;
        }
    }

    async fn find(&self, cred: u128, hashes: &[u128]) -> Result<Option<StoredRecord>, StoreError> {
        // Located in memory: a miss costs no trip to the blocking pool.
        let Some((key, at, file)) = calls::locate(&self.inner, cred, hashes) else {
            return Ok(None);
        };
        self.blocking(move |inner| calls::read_record(inner, key, at, &file).map(Some))
            .await
    }

    async fn put(&self, cred: u128, record: StoredRecord) -> Result<(), StoreError> {
        self.write(move |inner| calls::put(inner, cred, &record))
            .await
    }

    fn windows(&self) -> Vec<(String, String, u64)> {
        self.windows.clone()
    }

    async fn put_window(&self, upstream: &str, model: &str, tokens: u64) -> Result<(), StoreError> {
        let (u, m) = (upstream.to_owned(), model.to_owned());
        self.write(move |inner| calls::put_window(inner, &u, &m, tokens))
            .await
    }

    async fn sweep(&self) -> Result<(), StoreError> {
        self.write(calls::sweep).await
    }

    async fn get_state(&self, session: u128) -> Result<Option<Vec<u8>>, StoreError> {
        self.blocking(move |inner| calls::get_state(inner, session))
            .await
    }

    async fn put_state(&self, session: u128, state: Vec<u8>) -> Result<(), StoreError> {
        self.write(move |inner| calls::put_state(inner, session, &state))
            .await
    }
}
