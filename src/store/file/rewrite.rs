//! The rewrite of the live entries into a new file, renamed over the old
//! one, while writes go on.
//!
//! 1. Under the writer's lock (no I/O): the live entries, the learned
//!    windows and the file's end are noted (the snapshot).
//! 2. Without any lock: each entry still live is read, checked, given its
//!    latest last use and written to `<name>.compact`; then what was
//!    appended since the snapshot is copied as it is, in rounds, until
//!    little is left. Writes append to the old file meanwhile, paced by
//!    the gate only when they would outrun the copy.
//! 3. Under the writer's lock: the last appended bytes are copied, the new
//!    file is made durable and renamed over the path, the directory
//!    synced, and the index's offsets and the file handle swapped.
//!
//! The temporary file holds the live entries plus what is appended during
//! the copy: at most the file's hard bound, so the directory holds up to
//! twice that while a rewrite runs, and one file again after it. A
//! rewrite given up (an I/O error, the store closing) removes it.

use std::collections::HashMap;
use std::fs::File;
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::store::StoreError;

use super::disk;
use super::entry::{self, Key, TOUCHED_AT};
use super::frame::{self, Kind};
use super::gate::allowance;
use super::index::{bounds, Index, Loc, Ref};
use super::inner::{lock, Inner, Writer};

/// The temporary file is synced (and the gate moved on) every sixteenth
/// of the copy, between these: the progress writes are paced by is
/// progress on the disk, in steps small enough that a waiting write waits
/// for little of it.
const SYNC_STEP: (u64, u64) = (64 << 10, 2 << 20);
/// Appended bytes left over that the final step copies under the lock.
const FINAL_TAIL: u64 = 1 << 20;
/// Copy rounds of appended bytes before the final step takes what is left.
const MAX_ROUNDS: u32 = 8;
/// After a failed rewrite, the next is not tried sooner.
const RETRY_AFTER: Duration = Duration::from_secs(10);
/// A rewrite that would free less than this is not worth its I/O.
const MIN_GARBAGE: u64 = 64 << 10;

#[derive(Debug, thiserror::Error)]
pub(super) enum RewriteError {
    #[error("{op}: {source}")]
    Io {
        op: &'static str,
        source: std::io::Error,
    },
    #[error("store closing")]
    Closing,
}

fn io(op: &'static str) -> impl FnOnce(std::io::Error) -> RewriteError {
    move |source| RewriteError::Io { op, source }
}

/// What a rewrite copies, taken under the writer's lock.
struct Snapshot {
    file: Arc<File>,
    /// Live entries in file order.
    entries: Vec<(Ref, Loc)>,
    windows: Vec<(String, String, u64)>,
    /// The file's end: what lies beyond is copied as it is.
    end: u64,
    /// How far the file may grow during the copy.
    room: u64,
    /// Bytes the copy is expected to write (live entries plus the room).
    planned: u64,
}

/// What a rewrite did.
#[derive(Debug)]
pub(super) struct Report {
    pub(super) before: u64,
    pub(super) after: u64,
    /// Entries found damaged while copying (dropped).
    pub(super) dropped: usize,
    pub(super) millis: u64,
}

/// The temporary file being written.
struct Out {
    file: File,
    buf: Vec<u8>,
    /// Bytes written (buffered or not).
    len: u64,
    synced: u64,
    /// Bytes of the plan done: copied, or found dropped since the
    /// snapshot (an entry evicted meanwhile needs no copy: it is progress
    /// too, or the gate would stall short of its room).
    done: u64,
}

impl Out {
    fn write(&mut self, bytes: &[u8]) -> Result<u64, RewriteError> {
        let at = self.len;
        self.buf.extend_from_slice(bytes);
        self.len += bytes.len() as u64;
        if self.buf.len() >= 1 << 20 {
            self.flush()?;
        }
        Ok(at)
    }

    fn flush(&mut self) -> Result<(), RewriteError> {
        #[cfg(test)]
        if super::tests_hook::disk_full() {
            // As a full disk does: part of the bytes land, then ENOSPC.
            let _ = self.file.write_all(&self.buf[..self.buf.len() / 2]);
            let full = std::io::Error::new(std::io::ErrorKind::StorageFull, "disk full (test)");
            return Err(io("write")(full));
        }
        self.file.write_all(&self.buf).map_err(io("write"))?;
        self.buf.clear();
        Ok(())
    }

    fn sync(&mut self) -> Result<(), RewriteError> {
        self.flush()?;
        self.file.sync_data().map_err(io("sync"))?;
        self.synced = self.len;
        Ok(())
    }
}

/// Starts a rewrite on the blocking pool when [`worth_starting`] says
/// so. `need`: the length of a write that finds no room. Called under the
/// writer's lock. `true` when a rewrite runs (started here or before).
pub(super) fn maybe_start(inner: &Arc<Inner>, w: &Writer, need: Option<u64>) -> bool {
    if inner.gate.get().rewriting {
        return true;
    }
    if inner.closing.load(Ordering::Acquire)
        || lock(&inner.retry_at).is_some_and(|at| Instant::now() < at)
    {
        return false;
    }
    let live = inner.shared().index.live();
    if !worth_starting(inner.max_bytes, live, w.end, need) {
        return false;
    }
    let snap = snapshot(inner, w);
    let inner = Arc::clone(inner);
    let job = move || finish_run(&inner, snap);
    match tokio::runtime::Handle::try_current() {
        Ok(rt) => drop(rt.spawn_blocking(job)),
        Err(_) => drop(std::thread::spawn(job)),
    }
    true
}

/// Whether a file of `end` bytes, `live` of them live, is rewritten now.
///
/// Unasked, once it reaches its start bound: that is half the room to its
/// hard bound past the live entries, at least 32 KiB of garbage, so a
/// small bound is not rewritten on every write. A write that finds no
/// room asks for a rewrite whenever there is garbage and reclaiming it
/// makes room for that write (or frees a worthwhile amount anyway): a
/// small bound's hard bound is the live entries plus 64 KiB, so waiting
/// for [`MIN_GARBAGE`] there would refuse every write for good.
fn worth_starting(max_bytes: usize, live: u64, end: u64, need: Option<u64>) -> bool {
    let garbage = end.saturating_sub(live);
    let b = bounds(max_bytes, live);
    match need {
        None => end >= b.start && garbage > 0,
        Some(len) => garbage > 0 && (garbage >= MIN_GARBAGE || live + len <= b.hard),
    }
}

/// Rewrites now, in this thread (at open: nothing else runs).
pub(super) fn now(inner: &Inner) -> Result<Report, RewriteError> {
    let snap = snapshot(inner, &inner.writer());
    run(inner, snap)
}

/// No rewrite is tried for a while: one just failed, and what failed it
/// (a full disk, most often) takes time to go away.
pub(super) fn put_off(inner: &Inner) {
    *lock(&inner.retry_at) = Some(Instant::now() + RETRY_AFTER);
}

/// Runs a rewrite and logs what came of it.
fn finish_run(inner: &Inner, snap: Snapshot) {
    match &run(inner, snap) {
        Ok(r) => {
            tracing::info!(backend = "file", path = %inner.path.display(), before = r.before,
                after = r.after, damaged_entries = r.dropped, millis = r.millis,
                "store file rewritten");
        }
        Err(RewriteError::Closing) => {}
        Err(e) => {
            put_off(inner);
            tracing::warn!(backend = "file", path = %inner.path.display(), error = %e,
                "store rewrite failed; retried in 10 s");
        }
    }
}

fn snapshot(inner: &Inner, w: &Writer) -> Snapshot {
    let shared = inner.shared();
    let index = &shared.index;
    let mut entries: Vec<(Ref, Loc)> = index
        .meta
        .iter()
        .map(|(k, m)| (Ref::Record(*k), m.at))
        .chain(index.states.iter().map(|(s, m)| (Ref::State(*s), m.at)))
        .collect();
    entries.sort_unstable_by_key(|(_, at)| at.offset);
    let windows = index
        .windows
        .iter()
        .map(|((u, m), t)| (u.clone(), m.clone(), *t))
        .collect();
    let live = index.live();
    let room = bounds(inner.max_bytes, live).hard.saturating_sub(w.end);
    inner.gate.begin(allowance(w.end, room, 0, live + room));
    Snapshot {
        file: Arc::clone(&w.file),
        entries,
        windows,
        end: w.end,
        room,
        planned: live + room,
    }
}

fn run(inner: &Inner, snap: Snapshot) -> Result<Report, RewriteError> {
    let started = Instant::now();
    let swapped = match disk::create_temp(&inner.path, &snap.file) {
        Ok(file) => {
            let copied = copy_and_swap(inner, &snap, file);
            if copied.is_err() {
                // Ours: made new by this rewrite (a name not made here is
                // never removed as if it were).
                let _ = std::fs::remove_file(disk::temp_path(&inner.path));
            }
            copied
        }
        Err(e) => Err(io("create")(e)),
    };
    if swapped.is_err() {
        // A swap ends the rewrite under the writer's lock; a failure
        // ends it here (no other can have started meanwhile).
        inner.gate.end();
    }
    swapped.map(|(after, dropped)| Report {
        before: snap.end,
        after,
        dropped,
        millis: u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX),
    })
}

/// The three steps after the snapshot; the new file's length and the
/// entries found damaged.
fn copy_and_swap(inner: &Inner, snap: &Snapshot, file: File) -> Result<(u64, usize), RewriteError> {
    let mut out = Out {
        file,
        buf: Vec::with_capacity(2 << 20),
        len: 0,
        synced: 0,
        done: 0,
    };
    let (moved, dropped) = copy(inner, snap, &mut out)?;
    let from = copy_tail(inner, snap, &mut out)?;
    Ok((swap(inner, snap, out, from, &moved)?, dropped))
}

/// Moves the gate on after a sync of the temporary file.
fn progress(inner: &Inner, snap: &Snapshot, out: &mut Out) -> Result<(), RewriteError> {
    if inner.closing.load(Ordering::Acquire) {
        return Err(RewriteError::Closing);
    }
    if out.len - out.synced >= (snap.planned / 16).clamp(SYNC_STEP.0, SYNC_STEP.1) {
        out.sync()?;
        let allowed = allowance(snap.end, snap.room, out.done, snap.planned);
        inner.gate.allow(allowed);
    }
    Ok(())
}

/// Where each copied entry was and is now: (old offset, new offset).
type Moved = HashMap<Ref, (u64, u64)>;

/// Writes the header, the windows and every entry of the snapshot that is
/// still live; returns where they went and how many were damaged.
fn copy(inner: &Inner, snap: &Snapshot, out: &mut Out) -> Result<(Moved, usize), RewriteError> {
    let mut frames = frame::header(inner.secret).to_vec();
    for (u, m, t) in &snap.windows {
        // A window's names came from a config or a URL: never 4 GiB.
        let _ = entry::window(&mut frames, u, m, *t);
    }
    out.write(&frames)?;
    out.done += frames.len() as u64;
    let mut moved = Moved::with_capacity(snap.entries.len());
    let mut dropped = 0;
    for batch in snap.entries.chunks(256) {
        for (&(r, at), live) in batch.iter().zip(still_live(inner, batch)) {
            out.done += at.len;
            let Some(touched) = live else { continue };
            match copy_entry(&snap.file, r, at, touched) {
                Ok(bytes) => {
                    moved.insert(r, (at.offset, out.write(&bytes)?));
                }
                Err(StoreError::Corrupt) => dropped += 1,
                Err(e) => {
                    return Err(RewriteError::Io {
                        op: "read",
                        source: std::io::Error::other(e.to_string()),
                    })
                }
            }
            #[cfg(test)]
            inner.hold.point();
            progress(inner, snap, out)?;
        }
    }
    Ok((moved, dropped))
}

/// For each entry of `batch`, whether it is still live where the
/// snapshot saw it: a record with its latest last use.
fn still_live(inner: &Inner, batch: &[(Ref, Loc)]) -> Vec<Option<u64>> {
    let shared = inner.shared();
    let index = &shared.index;
    batch
        .iter()
        .map(|&(r, at)| match r {
            Ref::Record(k) => index.meta.get(&k).filter(|m| m.at == at).map(|m| m.touched),
            Ref::State(s) => index.states.get(&s).filter(|m| m.at == at).map(|_| 0),
        })
        .collect()
}

/// One entry's frame as the new file holds it: checked, a record's last
/// use brought up to date (uses are otherwise written only at a sweep).
fn copy_entry(file: &File, r: Ref, at: Loc, touched: u64) -> Result<Vec<u8>, StoreError> {
    match r {
        Ref::State(_) => Inner::read(file, at, Kind::StatePut),
        Ref::Record(_) => {
            let mut bytes = Inner::read(file, at, Kind::RecordPut)?;
            let field = frame::payload_mut(&mut bytes)
                .and_then(|p| p.get_mut(TOUCHED_AT..TOUCHED_AT + 8))
                .ok_or(StoreError::Corrupt)?;
            field.copy_from_slice(&touched.to_le_bytes());
            frame::reseal(&mut bytes);
            Ok(bytes)
        }
    }
}

/// Copies the old file's bytes `from..to` as they are.
fn copy_raw(file: &File, from: u64, to: u64, out: &mut Out) -> Result<(), RewriteError> {
    let mut buf = vec![0u8; 1 << 20];
    let mut pos = from;
    while pos < to {
        let n = usize::try_from(to - pos).map_or(buf.len(), |left| left.min(buf.len()));
        let chunk = &mut buf[..n];
        file.read_exact_at(chunk, pos).map_err(io("read"))?;
        out.write(chunk)?;
        pos += n as u64;
    }
    Ok(())
}

/// Copies what was appended since the snapshot, in rounds, until what is
/// left is small; returns where the copy stopped.
fn copy_tail(inner: &Inner, snap: &Snapshot, out: &mut Out) -> Result<u64, RewriteError> {
    let mut from = snap.end;
    for _ in 0..MAX_ROUNDS {
        let end = inner.end.load(Ordering::Acquire);
        if end.saturating_sub(from) <= FINAL_TAIL {
            break;
        }
        copy_raw(&snap.file, from, end, out)?;
        out.done += end - from;
        from = end;
        progress(inner, snap, out)?;
    }
    Ok(from)
}

/// The final step, under the writer's lock: the last appended bytes, the
/// rename, the swap. Returns the new file's length.
fn swap(
    inner: &Inner,
    snap: &Snapshot,
    mut out: Out,
    from: u64,
    moved: &Moved,
) -> Result<u64, RewriteError> {
    let mut w = inner.writer();
    // The tail's place in the new file: appended bytes keep their order.
    let base = out.len - (from - snap.end);
    copy_raw(&snap.file, from, w.end, &mut out)?;
    out.sync()?;
    disk::rename_temp(&inner.path, &out.file).map_err(io("rename"))?;
    if let Err(e) = disk::sync_dir(&inner.path) {
        // The rename is done; only its durability is in doubt.
        tracing::warn!(backend = "file", path = %inner.path.display(), error = %e,
            "store directory sync failed");
    }
    let file = Arc::new(out.file);
    let mut shared = inner.shared();
    relocate(&mut shared.index, snap.end, base, moved);
    shared.file = Arc::clone(&file);
    drop(shared);
    w.file = file;
    w.end = out.len;
    inner.syncs.swapped(out.len);
    inner.end.store(out.len, Ordering::Release);
    inner.counters.rewrites.fetch_add(1, Ordering::Relaxed);
    // Still under the writer's lock: the next write sees the new file's
    // bounds, not the old file's allowance.
    inner.gate.end();
    Ok(out.len)
}

/// New offsets: an entry appended after the snapshot moved with the tail,
/// one copied moved where it was copied to, any other (found damaged
/// while copying) is gone.
fn relocate(index: &mut Index, end: u64, base: u64, moved: &Moved) {
    let new = |r: Ref, off: u64| match moved.get(&r) {
        _ if off >= end => Some(off - end + base),
        Some(&(old, new)) if old == off => Some(new),
        _ => None,
    };
    let mut gone = Vec::new();
    let records: Vec<(Key, u64)> = index.meta.iter().map(|(k, m)| (*k, m.at.offset)).collect();
    for (key, off) in records {
        match new(Ref::Record(key), off) {
            Some(to) => index.relocate(&key, to),
            None => gone.push(key),
        }
    }
    for key in &gone {
        index.remove(key);
    }
    let states: Vec<(u128, u64)> = index
        .states
        .iter()
        .map(|(s, m)| (*s, m.at.offset))
        .collect();
    for (s, off) in states {
        match new(Ref::State(s), off) {
            Some(to) => {
                if let Some(m) = index.states.get_mut(&s) {
                    m.at.offset = to;
                }
            }
            None => {
                index.remove_state(s);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_write_without_room_asks_for_a_rewrite_whenever_garbage_makes_room() {
        // The state issue 49 found a store wedged in, restarts included:
        // 38 bytes under its hard bound, 65,498 bytes of garbage.
        let (bound, live) = (200 << 10, 250_000);
        let hard = bounds(bound, live).hard;
        assert_eq!(hard, live + (64 << 10));
        let end = hard - 38;
        assert!(worth_starting(bound, live, end, Some(1000)));
        assert!(worth_starting(bound, live, end, None), "past the start");
        // Nothing to reclaim, or nothing that makes room: no rewrite.
        assert!(!worth_starting(bound, live, live, Some(1000)));
        assert!(!worth_starting(bound, live, live + 10, Some(hard)));
        // Under the start bound, unasked: none yet.
        assert!(!worth_starting(bound, live, live + 1000, None));
    }
}
