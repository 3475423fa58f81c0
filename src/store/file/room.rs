//! Every write goes through [`append`]: under the writer's lock, within the
//! file's bound, durable before the call returns (one sync for the writes
//! that queued behind one another: see `inner::Syncs`).

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use crate::store::StoreError;

use super::gate::GateState;
use super::index::{bounds, Index};
use super::inner::{backend, Inner, Writer};
use super::rewrite;

/// Whether `len` more bytes may be appended now.
enum Room {
    Now,
    /// After the gate changes from this.
    Later(GateState),
    /// Not while the file is at its bound and no rewrite can run.
    Never,
}

fn room(inner: &Arc<Inner>, w: &Writer, len: u64) -> Room {
    let gate = inner.gate.get();
    if gate.rewriting {
        return if w.end + len <= gate.allowed_end {
            Room::Now
        } else {
            Room::Later(gate)
        };
    }
    let live = inner.shared().index.live();
    if w.end + len <= bounds(inner.max_bytes, live).hard {
        return Room::Now;
    }
    if rewrite::maybe_start(inner, w, Some(len)) {
        Room::Later(inner.gate.get())
    } else {
        Room::Never
    }
}

fn full() -> StoreError {
    StoreError::Backend("store file at its bound; the record stays in memory".into())
}

/// Appends the frames `build` makes from the index (small ones, rebuilt
/// should the write have to wait) followed by `big` (a frame made before,
/// off the lock), then hands `apply` the offset they start at to update
/// the index, all under the writer's lock. A write that would take the
/// file past its bound waits for a running rewrite's progress, at most
/// the store's write wait; then it is refused (counted, and served from
/// memory by the caller), so the file never outgrows its bound.
pub(super) fn append<T>(
    inner: &Arc<Inner>,
    big: &[u8],
    mut build: impl FnMut(&Index) -> (Vec<u8>, T),
    apply: impl FnOnce(&mut Index, T, u64),
) -> Result<(), StoreError> {
    let deadline = Instant::now() + inner.write_wait();
    let mut waited = false;
    loop {
        let mut w = inner.writer();
        let (small, made) = build(&inner.shared().index);
        if small.is_empty() && big.is_empty() {
            return Ok(());
        }
        let len = (small.len() + big.len()) as u64;
        let seen = match room(inner, &w, len) {
            Room::Now => {
                let rewriting = inner.gate.get().rewriting;
                let at = w.write(&[&small, big]).map_err(|e| backend("write", e))?;
                inner.end.store(w.end, Ordering::Release);
                // In the index before it is durable, so that a rewrite
                // swapping files before the sync relocates it too; a
                // reader finding it meanwhile reads a checked frame.
                apply(&mut inner.shared().index, made, at);
                if rewriting {
                    bump(&inner.counters.written_while_rewriting);
                }
                rewrite::maybe_start(inner, &w, None);
                let (gen, end, file) = (inner.syncs.file(), w.end, Arc::clone(&w.file));
                drop(w);
                return inner
                    .durable(gen, end, &file)
                    .map_err(|e| backend("sync", e));
            }
            Room::Later(seen) => seen,
            Room::Never => {
                bump(&inner.counters.refused);
                return Err(full());
            }
        };
        drop(w);
        if !waited {
            waited = true;
            bump(&inner.counters.paced);
        }
        if !inner.gate.wait(seen, deadline) {
            bump(&inner.counters.refused);
            return Err(full());
        }
    }
}

fn bump(c: &std::sync::atomic::AtomicU64) {
    c.fetch_add(1, Ordering::Relaxed);
}
