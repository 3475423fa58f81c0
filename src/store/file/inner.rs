//! What the calls, the rewrite and the open share: the index with the
//! file it points into, the writer's end of the file, the gate.
//!
//! Lock order: `writer`, then `shared`; the gate's lock is taken alone.
//! The index and the file handle are under one lock so that a reader's
//! offset and the file it reads it from always belong together (a
//! rewrite swaps both at once).

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use crate::store::StoreError;

use super::frame::{self, Kind};
use super::gate::Gate;
use super::index::{Index, Loc};

/// The index and the file its offsets are in.
pub(super) struct Shared {
    pub(super) index: Index,
    pub(super) file: Arc<File>,
}

/// The appending end.
pub(super) struct Writer {
    pub(super) file: Arc<File>,
    /// Length of the file's good part: where the next frame goes.
    pub(super) end: u64,
}

/// The settings a store is opened with.
#[derive(Debug, Clone, Copy)]
pub(super) struct Settings {
    pub(super) ttl_ms: u64,
    pub(super) max_bytes: usize,
}

/// Content-free counts of what the store did, for logs and tests.
#[derive(Debug, Default)]
pub(super) struct Counters {
    /// Rewrites swapped in (those at open too).
    pub(super) rewrites: AtomicU64,
    /// Writes made while a rewrite was copying.
    pub(super) written_while_rewriting: AtomicU64,
    /// Writes that waited for a rewrite's progress.
    pub(super) paced: AtomicU64,
    /// Writes refused because the file was at its bound.
    pub(super) refused: AtomicU64,
    /// `fdatasync` calls made for writes (a group's writes share one).
    pub(super) syncs: AtomicU64,
    /// Write calls refused because as many were already queued.
    pub(super) queue_full: AtomicU64,
    /// Write calls not made: their caller gave up while they were queued.
    pub(super) abandoned: AtomicU64,
}

pub(super) struct Inner {
    pub(super) path: PathBuf,
    pub(super) shared: Mutex<Shared>,
    pub(super) writer: Mutex<Writer>,
    /// The writer's end, readable without its lock (the rewrite polls it).
    pub(super) end: AtomicU64,
    pub(super) gate: Gate,
    pub(super) syncs: Syncs,
    /// Write calls admitted and not yet done (see `FileStore::admit`).
    pub(super) queued: AtomicUsize,
    pub(super) secret: u64,
    pub(super) ttl_ms: u64,
    pub(super) max_bytes: usize,
    /// How long a write may wait for a rewrite's progress (ms).
    pub(super) write_wait_ms: AtomicU64,
    pub(super) counters: Counters,
    /// The store was dropped: a running rewrite gives up.
    pub(super) closing: AtomicBool,
    /// After a failed rewrite, none is tried before this.
    pub(super) retry_at: Mutex<Option<Instant>>,
    #[cfg(test)]
    pub(super) hold: super::tests_hook::Hold,
}

/// Every update leaves the guarded value consistent: a poisoned lock's
/// data is good.
pub(super) use crate::sync::lock;

pub(super) fn backend(op: &str, e: impl std::fmt::Display) -> StoreError {
    StoreError::Backend(format!("{op}: {e}"))
}

pub(super) fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

impl Inner {
    pub(super) fn new(
        path: PathBuf,
        file: File,
        end: u64,
        index: Index,
        secret: u64,
        settings: Settings,
    ) -> Self {
        let file = Arc::new(file);
        Self {
            path,
            shared: Mutex::new(Shared {
                index,
                file: Arc::clone(&file),
            }),
            writer: Mutex::new(Writer { file, end }),
            end: AtomicU64::new(end),
            gate: Gate::default(),
            syncs: Syncs::default(),
            queued: AtomicUsize::new(0),
            secret,
            ttl_ms: settings.ttl_ms,
            max_bytes: settings.max_bytes.max(1),
            write_wait_ms: AtomicU64::new(200),
            counters: Counters::default(),
            closing: AtomicBool::new(false),
            retry_at: Mutex::new(None),
            #[cfg(test)]
            hold: super::tests_hook::Hold::default(),
        }
    }

    pub(super) fn shared(&self) -> MutexGuard<'_, Shared> {
        lock(&self.shared)
    }

    pub(super) fn writer(&self) -> MutexGuard<'_, Writer> {
        lock(&self.writer)
    }

    pub(super) fn write_wait(&self) -> Duration {
        Duration::from_millis(self.write_wait_ms.load(Ordering::Relaxed))
    }

    /// Reads the frame at `at` and checks it is a whole frame of `kind`;
    /// `Corrupt` otherwise. `file` is the one `at` was taken with.
    pub(super) fn read(file: &File, at: Loc, kind: Kind) -> Result<Vec<u8>, StoreError> {
        let len = usize::try_from(at.len).map_err(|_| StoreError::Corrupt)?;
        let mut buf = vec![0u8; len];
        file.read_exact_at(&mut buf, at.offset)
            .map_err(|e| backend("read", e))?;
        match frame::open(&buf) {
            Some((k, _)) if k == kind => Ok(buf),
            _ => Err(StoreError::Corrupt),
        }
    }
}

impl Writer {
    /// Writes `parts` at the end, not yet durable ([`Inner::durable`] makes
    /// them so, one sync for every write that queued meanwhile). A failed
    /// write is cut off again, so the file never holds half an entry that
    /// a later one would follow.
    pub(super) fn write(&mut self, parts: &[&[u8]]) -> std::io::Result<u64> {
        let at = self.end;
        let mut pos = at;
        let written = parts.iter().try_for_each(|p| {
            self.file.write_all_at(p, pos)?;
            pos += p.len() as u64;
            Ok(())
        });
        if let Err(e) = written {
            // Best effort: the scan at the next open cuts a torn tail too.
            let _ = self.file.set_len(at);
            return Err(e);
        }
        self.end = pos;
        Ok(at)
    }
}

/// Group commit: how far each file is durable.
///
/// A write appends under the writer's lock and then waits, without it,
/// for a sync that covers its end: the first waiter syncs for all the
/// writes made by then, the others wait for that one sync. Under load
/// that is one `fdatasync` for a group instead of one per write, each
/// behind the writer's lock.
#[derive(Debug, Default)]
pub(super) struct Syncs {
    state: Mutex<SyncState>,
    done: Condvar,
}

#[derive(Debug, Default)]
struct SyncState {
    /// Bumped when a rewrite swaps a new file in (synced whole).
    file: u64,
    /// The file's bytes below this are durable.
    synced: u64,
    /// A sync covering the bytes below this failed.
    failed: u64,
    /// A sync is running.
    running: bool,
}

impl Syncs {
    /// The file the writes go to now (called under the writer's lock).
    pub(super) fn file(&self) -> u64 {
        lock(&self.state).file
    }

    /// A rewrite swapped in a file durable up to `end` (under the writer's
    /// lock): every write waiting on the old file is in it.
    pub(super) fn swapped(&self, end: u64) {
        let mut s = lock(&self.state);
        s.file += 1;
        s.synced = end;
        s.failed = 0;
        self.done.notify_all();
    }
}

impl Inner {
    /// Returns once the bytes below `end` of the writes' file `gen` (the
    /// handle `file`) are durable: synced by this call or by another's.
    pub(super) fn durable(&self, gen: u64, end: u64, file: &File) -> std::io::Result<()> {
        let mut s = lock(&self.syncs.state);
        loop {
            if s.file != gen || s.synced >= end {
                return Ok(());
            }
            if s.failed >= end {
                return Err(std::io::Error::other("sync of the store file failed"));
            }
            if s.running {
                s = self
                    .syncs
                    .done
                    .wait(s)
                    .unwrap_or_else(std::sync::PoisonError::into_inner);
                continue;
            }
            s.running = true;
            // Every write made by now is covered: they all wrote before
            // they published their end.
            let target = self.end.load(Ordering::Acquire).max(end);
            drop(s);
            #[cfg(test)]
            self.hold.sync_delay();
            let synced = file.sync_data();
            self.counters.syncs.fetch_add(1, Ordering::Relaxed);
            s = lock(&self.syncs.state);
            s.running = false;
            if s.file == gen {
                match &synced {
                    Ok(()) => s.synced = s.synced.max(target),
                    Err(_) => s.failed = s.failed.max(target),
                }
            }
            self.syncs.done.notify_all();
            synced?;
        }
    }
}
