//! The in-memory index of the log: where each live entry is, and what the
//! decisions that read no record need (lengths for `may_have`, sizes and
//! last uses for eviction and expiry, the bytes the bound counts).
//! Rebuilt by the scan at open.

use std::collections::{BTreeMap, BTreeSet, HashMap};

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
    /// Last use, unix ms (changed through [`Index::set_touched`], which
    /// keeps the records' age order).
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

/// A live entry the bound or the TTL may drop, by what it is keyed by.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(super) enum Ref {
    Record(Key),
    State(u128),
}

/// Bytes in each measure the bound judges (see `evict.rs`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(super) struct Usage {
    /// Records by their size, states and windows by their frames.
    pub(super) counted: u64,
    /// States' frames.
    pub(super) states: u64,
    /// Frames in the file (and, for a whole index, its header).
    pub(super) live: u64,
}

impl Usage {
    pub(super) fn record(size: usize, frame: u64) -> Self {
        Self {
            counted: size as u64,
            states: 0,
            live: frame,
        }
    }

    pub(super) fn state(frame: u64) -> Self {
        Self {
            counted: frame,
            states: frame,
            live: frame,
        }
    }

    pub(super) fn window(frame: u64) -> Self {
        Self {
            counted: frame,
            states: 0,
            live: frame,
        }
    }

    pub(super) fn plus(self, o: Self) -> Self {
        Self {
            counted: self.counted.saturating_add(o.counted),
            states: self.states.saturating_add(o.states),
            live: self.live.saturating_add(o.live),
        }
    }

    pub(super) fn minus(self, o: Self) -> Self {
        Self {
            counted: self.counted.saturating_sub(o.counted),
            states: self.states.saturating_sub(o.states),
            live: self.live.saturating_sub(o.live),
        }
    }
}

#[derive(Debug, Default)]
pub(super) struct Index {
    pub(super) meta: HashMap<Key, Meta>,
    pub(super) states: HashMap<u128, StateMeta>,
    /// Learned windows by (upstream, model): few and small, kept whole.
    pub(super) windows: BTreeMap<(String, String), u64>,
    /// Records per prefix length.
    pub(super) lengths: BTreeMap<usize, usize>,
    /// Bytes the records hold (by [`crate::store::StoredRecord::size`]).
    pub(super) bytes: usize,
    /// Records least recently used first: (last use, key).
    record_ages: BTreeSet<(u64, Key)>,
    /// States oldest first: (written, session).
    state_ages: BTreeSet<(u64, u128)>,
    /// Bytes the states' frames take.
    states_bytes: u64,
    /// Bytes the windows' frames take.
    windows_bytes: u64,
    /// Bytes the live frames take in the file.
    disk: u64,
}

impl Index {
    pub(super) fn add(&mut self, key: Key, m: Meta) {
        self.remove(&key);
        *self.lengths.entry(m.k).or_insert(0) += 1;
        self.bytes += m.size;
        self.disk += m.at.len;
        self.record_ages.insert((m.touched, key));
        self.meta.insert(key, m);
    }

    /// Sets a record's last use; its meta, to note more.
    pub(super) fn set_touched(&mut self, key: &Key, at: u64) -> Option<&mut Meta> {
        let m = self.meta.get_mut(key)?;
        self.record_ages.remove(&(m.touched, *key));
        self.record_ages.insert((at, *key));
        m.touched = at;
        Some(m)
    }

    pub(super) fn remove(&mut self, key: &Key) -> Option<Meta> {
        let old = self.meta.remove(key)?;
        self.bytes = self.bytes.saturating_sub(old.size);
        self.disk = self.disk.saturating_sub(old.at.len);
        self.record_ages.remove(&(old.touched, *key));
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
        self.states_bytes += s.at.len;
        self.state_ages.insert((s.written, session));
        self.states.insert(session, s);
    }

    pub(super) fn remove_state(&mut self, session: u128) -> Option<StateMeta> {
        let old = self.states.remove(&session)?;
        self.disk = self.disk.saturating_sub(old.at.len);
        self.states_bytes = self.states_bytes.saturating_sub(old.at.len);
        self.state_ages.remove(&(old.written, session));
        Some(old)
    }

    pub(super) fn set_window(&mut self, upstream: String, model: String, tokens: u64) {
        let len = window_len(&upstream, &model);
        if self.windows.insert((upstream, model), tokens).is_none() {
            self.disk += len;
            self.windows_bytes += len;
        }
    }

    /// Drops a record or a state.
    pub(super) fn drop_entry(&mut self, r: Ref) {
        match r {
            Ref::Record(key) => {
                self.remove(&key);
            }
            Ref::State(session) => {
                self.remove_state(session);
            }
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

    /// What the live entries take in each measure of the bound.
    pub(super) fn usage(&self) -> Usage {
        Usage {
            counted: self.bytes as u64 + self.states_bytes + self.windows_bytes,
            states: self.states_bytes,
            live: self.live(),
        }
    }

    /// The records, least recently used first: (last use, key).
    pub(super) fn records_by_age(&self) -> impl Iterator<Item = (u64, Key)> + '_ {
        self.record_ages.iter().copied()
    }

    /// The states, oldest first: (written, session).
    pub(super) fn states_by_age(&self) -> impl Iterator<Item = (u64, u128)> + '_ {
        self.state_ages.iter().copied()
    }

    /// What one live entry takes (nothing: not live).
    pub(super) fn cost(&self, r: Ref) -> Usage {
        match r {
            Ref::Record(key) => self
                .meta
                .get(&key)
                .map_or(Usage::default(), |m| Usage::record(m.size, m.at.len)),
            Ref::State(s) => self
                .states
                .get(&s)
                .map_or(Usage::default(), |m| Usage::state(m.at.len)),
        }
    }
}

/// Least file size a rewrite aims to leave room for, so that a small
/// bound is not rewritten on every write.
pub(super) const MIN_ROOM: u64 = 64 << 10;

/// When the file is rewritten, and how large it may grow.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Bounds {
    /// A rewrite starts once the file reaches this.
    pub(super) start: u64,
    /// No write makes the file longer than this.
    pub(super) hard: u64,
}

/// The bounds of a file whose live entries take `live` bytes, everything
/// it keeps bounded by `max_bytes`: the file stays within 1.5× the bound
/// (or 1.25× its live entries, at least 64 KiB more, when those come
/// near: `evict.rs` keeps them within 1.2× the bound, so that happens only
/// under a bound of about 128 KiB). A rewrite starts halfway between the
/// live entries and that limit: the other half is the room that writes
/// made during it may take.
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
pub(super) mod tests {
    use super::*;

    /// A record's index entry of `size` bytes, last used at `touched`.
    pub(in crate::store::file) fn meta(k: usize, size: usize, touched: u64) -> Meta {
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
    fn bounds_leave_half_the_room_to_writes_during_a_rewrite() {
        let b = bounds(4 << 20, 4 << 20);
        assert_eq!(b.hard, 6 << 20);
        assert_eq!(b.start, 5 << 20);
        let small = bounds(1000, 500);
        assert_eq!(small.hard, 500 + MIN_ROOM);
    }
}
