//! A point where a test holds a running rewrite (after its first
//! copied entry), to show what writes do meanwhile without timing them;
//! and a full disk for the rewrites this thread runs (the one at open).

use std::cell::Cell;
use std::sync::{Condvar, Mutex, PoisonError};

thread_local! {
    static DISK_FULL: Cell<bool> = const { Cell::new(false) };
}

/// From now on, a rewrite run by this thread finds the disk full: its
/// temporary file's writes fail with `StorageFull` after half their bytes.
pub(super) fn set_disk_full(full: bool) {
    DISK_FULL.with(|d| d.set(full));
}

pub(super) fn disk_full() -> bool {
    DISK_FULL.with(Cell::get)
}

#[derive(Debug, Default)]
pub(super) struct Hold {
    /// (held, parked): the test holds rewrites; one is parked.
    state: Mutex<(bool, bool)>,
    changed: Condvar,
    /// How long every write's sync takes (ms): a slow disk.
    slow_sync: std::sync::atomic::AtomicU64,
}

impl Hold {
    /// Makes every sync of a write take `ms` longer.
    pub(super) fn set_slow_sync(&self, ms: u64) {
        self.slow_sync
            .store(ms, std::sync::atomic::Ordering::Relaxed);
    }

    /// Called before a write's sync.
    pub(super) fn sync_delay(&self) {
        let ms = self.slow_sync.load(std::sync::atomic::Ordering::Relaxed);
        if ms > 0 {
            std::thread::sleep(std::time::Duration::from_millis(ms));
        }
    }

    pub(super) fn set(&self, held: bool) {
        self.state.lock().unwrap_or_else(PoisonError::into_inner).0 = held;
        self.changed.notify_all();
    }

    /// Called by the rewrite: parks while held.
    pub(super) fn point(&self) {
        let mut s = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        while s.0 {
            s.1 = true;
            self.changed.notify_all();
            s = self.changed.wait(s).unwrap_or_else(PoisonError::into_inner);
        }
        s.1 = false;
    }

    /// Waits until a rewrite is parked.
    pub(super) fn wait_parked(&self) {
        let mut s = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        while !s.1 {
            s = self.changed.wait(s).unwrap_or_else(PoisonError::into_inner);
        }
    }
}
