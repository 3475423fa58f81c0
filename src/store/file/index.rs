//! The in-memory index of the log: where each live entry is, and what the
//! decisions that read no record need (lengths for `may_have`, sizes and
//! last uses for eviction and expiry). Rebuilt by the scan at open.

use std::collections::{BTreeMap, HashMap, HashSet};

use super::entry::{window_len, Key};
use super::frame::HEADER_LEN;

/// A frame in the file: where it starts and its whole length.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Loc {
    pub(super) offset: u64,
    pub(super) len: u64,
}

/// What the index knows of one stored record.
#[derive(Debug, Clone, Copy)]
pub(super) struct Meta {
    pub(super) k: usize,
    /// [`crate::store::StoredRecord::size`]: what the byte bound counts.
    pub(super) size: usize,
    /// Last use, unix ms.
    pub(super) touched: u64,
    /// Used since its last use was written.
    pub(super) dirty: bool,
    pub(super) at: Loc,
}

/// A conversation state: when it was written, and where.
#[derive(Debug, Clone, Copy)]
pub(super) struct StateMeta {
    pub(super) written: u64,
    pub(super) at: Loc,
}

#[derive(Debug, Default)]
pub(super) struct Index {
    pub(super) meta: HashMap<Key, Meta>,
    pub(super) states: HashMap<u128, StateMeta>,
    /// Learned windows by (upstream, model): few and small, kept whole.
    pub(super) windows: BTreeMap<(String, String), u64>,
    /// Records per prefix length.
    pub(super) lengths: BTreeMap<usize, usize>,
    /// Bytes the records hold (the byte bound's measure).
    pub(super) bytes: usize,
    /// Bytes the live frames take in the file.
    disk: u64,
}

impl Index {
    pub(super) fn add(&mut self, key: Key, m: Meta) {
        self.remove(&key);
        *self.lengths.entry(m.k).or_insert(0) += 1;
        self.bytes += m.size;
        self.disk += m.at.len;
        self.meta.insert(key, m);
    }

    pub(super) fn remove(&mut self, key: &Key) -> Option<Meta> {
        let old = self.meta.remove(key)?;
        self.bytes = self.bytes.saturating_sub(old.size);
        self.disk = self.disk.saturating_sub(old.at.len);
        if let Some(n) = self.lengths.get_mut(&old.k) {
            *n -= 1;
            if *n == 0 {
                self.lengths.remove(&old.k);
            }
        }
        Some(old)
    }

    pub(super) fn put_state(&mut self, session: u128, s: StateMeta) {
        self.remove_state(session);
        self.disk += s.at.len;
        self.states.insert(session, s);
    }

    pub(super) fn remove_state(&mut self, session: u128) -> Option<StateMeta> {
        let old = self.states.remove(&session)?;
        self.disk = self.disk.saturating_sub(old.at.len);
        Some(old)
    }

    pub(super) fn set_window(&mut self, upstream: String, model: String, tokens: u64) {
        let len = window_len(&upstream, &model);
        if self.windows.insert((upstream, model), tokens).is_none() {
            self.disk += len;
        }
    }

    /// Bytes a file holding only the live entries takes.
    pub(super) fn live(&self) -> u64 {
        HEADER_LEN as u64 + self.disk
    }

    /// Changes the location of a record (after a rewrite).
    pub(super) fn relocate(&mut self, key: &Key, offset: u64) {
        if let Some(m) = self.meta.get_mut(key) {
            m.at.offset = offset;
        }
    }
}

/// The least recently used records that go so that `size` more bytes
/// under `key` fit `max_bytes` (`key` itself is replaced, not evicted).
pub(super) fn evictions(index: &Index, key: Key, size: usize, max_bytes: usize) -> Vec<Key> {
    let replaced = index.meta.get(&key).map_or(0, |m| m.size);
    let mut bytes = index.bytes - replaced.min(index.bytes);
    if bytes + size <= max_bytes {
        return Vec::new();
    }
    let mut by_age: Vec<(u64, Key)> = index
        .meta
        .iter()
        .filter(|(k, _)| **k != key)
        .map(|(k, m)| (m.touched, *k))
        .collect();
    by_age.sort_unstable();
    let mut gone = Vec::new();
    for (_, old) in by_age {
        if bytes + size <= max_bytes {
            break;
        }
        bytes = bytes.saturating_sub(index.meta.get(&old).map_or(0, |m| m.size));
        gone.push(old);
    }
    gone
}

/// What one sweep removes and writes.
#[derive(Debug, Default)]
pub(super) struct SweepPlan {
    /// Records dropped (expired, or over the byte bound).
    pub(super) gone: Vec<Key>,
    /// Last uses to write.
    pub(super) dirty: Vec<(Key, u64)>,
    /// Conversation states expired.
    pub(super) states: Vec<u128>,
}

/// What a sweep at `now` drops (expired first, then the least recently
/// used while over the byte bound) and which last uses it writes. Reads
/// the index only: [`apply_sweep`] changes it once the plan is written.
pub(super) fn plan_sweep(index: &Index, now: u64, ttl_ms: u64, max_bytes: usize) -> SweepPlan {
    let expired = |at: u64| now.saturating_sub(at) > ttl_ms;
    let mut by_age: Vec<(u64, Key)> = index.meta.iter().map(|(k, m)| (m.touched, *k)).collect();
    by_age.sort_unstable();
    let mut bytes = index.bytes;
    let mut gone = Vec::new();
    for (touched, key) in by_age {
        if !expired(touched) && bytes <= max_bytes {
            break;
        }
        bytes = bytes.saturating_sub(index.meta.get(&key).map_or(0, |m| m.size));
        gone.push(key);
    }
    let dropped: HashSet<&Key> = gone.iter().collect();
    let dirty = index
        .meta
        .iter()
        .filter(|(k, m)| m.dirty && !dropped.contains(k))
        .map(|(k, m)| (*k, m.touched))
        .collect();
    let states = index
        .states
        .iter()
        .filter(|(_, s)| expired(s.written))
        .map(|(k, _)| *k)
        .collect();
    SweepPlan {
        gone,
        dirty,
        states,
    }
}

/// Applies a written sweep plan to the index.
pub(super) fn apply_sweep(index: &mut Index, plan: &SweepPlan) {
    for key in &plan.gone {
        index.remove(key);
    }
    for (key, at) in &plan.dirty {
        // A use after the plan was made stays dirty for the next sweep.
        if let Some(m) = index.meta.get_mut(key).filter(|m| m.touched == *at) {
            m.dirty = false;
        }
    }
    for s in &plan.states {
        index.remove_state(*s);
    }
}

/// Least file size a rewrite aims to leave room for, so that a small
/// bound is not rewritten on every write.
const MIN_ROOM: u64 = 64 << 10;

/// When the file is rewritten, and how large it may grow.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Bounds {
    /// A rewrite starts once the file reaches this.
    pub(super) start: u64,
    /// No write makes the file longer than this.
    pub(super) hard: u64,
}

/// The bounds of a file whose live entries take `live` bytes, the records
/// bounded by `max_bytes`: the file stays within 1.5× the bound (or 1.25×
/// its live entries plus 64 KiB, when those alone come near: conversation
/// states are not counted by the bound, nor a frame's own bytes). A
/// rewrite starts halfway between the live entries and that limit:
/// the other half is the room that writes made during it may take.
pub(super) fn bounds(max_bytes: usize, live: u64) -> Bounds {
    let b = max_bytes as u64;
    let hard = b
        .saturating_add(b / 2)
        .max(live.saturating_add((live / 4).max(MIN_ROOM)));
    Bounds {
        start: live + (hard - live) / 2,
        hard,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn meta(k: usize, size: usize, touched: u64) -> Meta {
        Meta {
            k,
            size,
            touched,
            dirty: false,
            at: Loc {
                offset: 32,
                len: size as u64 + 100,
            },
        }
    }

    #[test]
    fn counts_follow_adds_and_removes() {
        let mut i = Index::default();
        i.add((1, 1), meta(2, 100, 5));
        i.add((1, 2), meta(2, 50, 6));
        i.add((1, 1), meta(3, 10, 7));
        assert_eq!((i.bytes, i.live()), (60, HEADER_LEN as u64 + 260));
        assert_eq!(i.lengths.get(&2), Some(&1));
        i.remove(&(1, 2));
        assert_eq!((i.bytes, i.lengths.len()), (10, 1));
        i.set_window("u".into(), "m".into(), 1);
        i.set_window("u".into(), "m".into(), 2);
        assert_eq!(i.live(), HEADER_LEN as u64 + 110 + window_len("u", "m"));
    }

    #[test]
    fn a_sweep_plan_drops_expired_then_oldest_over_the_bound() {
        let mut i = Index::default();
        i.add((1, 1), meta(1, 100, 10));
        i.add((1, 2), meta(1, 100, 500));
        i.add((1, 3), meta(1, 100, 900));
        i.meta.get_mut(&(1, 3)).unwrap().dirty = true;
        let plan = plan_sweep(&i, 1000, 600, 100);
        assert_eq!(plan.gone, vec![(1, 1), (1, 2)]);
        assert_eq!(plan.dirty, vec![((1, 3), 900)]);
        apply_sweep(&mut i, &plan);
        assert_eq!((i.meta.len(), i.bytes), (1, 100));
        assert!(!i.meta[&(1, 3)].dirty);
    }

    #[test]
    fn bounds_leave_half_the_room_to_writes_during_a_rewrite() {
        let b = bounds(4 << 20, 4 << 20);
        assert_eq!(b.hard, 6 << 20);
        assert_eq!(b.start, 5 << 20);
        let small = bounds(1000, 500);
        assert_eq!(small.hard, 500 + MIN_ROOM);
    }
}
