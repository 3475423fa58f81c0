//! What goes: expired records and states (at a sweep), and the least
//! recently used records and conversation states the byte bound drops,
//! records and states together.
//!
//! The bound (`[session] max_record_bytes`, B) counts everything the file
//! keeps: records by [`crate::store::StoredRecord::size`] (as the memory
//! and Redis stores count them), states and learned windows by the bytes
//! of their frames. A write that would take that past B first drops the
//! least recently used records and states (a record's age is its last
//! use, a state's when it was written, as its expiry is) in the same
//! append; windows are few and small and never dropped.
//!
//! States take at most a quarter of B: beyond it a state write drops the
//! oldest states, not records. Every new conversation writes a state, one
//! turn is enough, while a record is made only by a compaction and saves
//! a summary call and the upstream's prompt cache: without the share a
//! burst of short conversations would push every record out.
//!
//! The live entries' frames take a little more than the bound counts (the
//! header; each record's frame, 40 bytes and 4 per text beyond its size).
//! They are kept within 1.2×B as well (1.5×B less 64 KiB, when that is
//! less), so that the room a rewrite leaves to writes (a quarter of the
//! live entries, at least 64 KiB: [`super::index::bounds`]) never takes
//! the file past 1.5×B. Under a bound of 128 KiB those 64 KiB are more
//! than half the bound: there the file may take 64 KiB beyond its live
//! entries, which the bound keeps within B and a few frames.

use std::collections::HashSet;

use super::entry::Key;
use super::index::{Index, Ref, Usage, MIN_ROOM};

/// States take at most this share of the bound (1/4).
const STATE_SHARE: u64 = 4;

/// How far each measure may go.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Limits {
    /// Records, states and windows together: the bound.
    counted: u64,
    /// States alone.
    pub(super) states: u64,
    /// The live entries' bytes in the file (`u64::MAX`: no limit beyond
    /// the bound, for bounds too small to keep a file within 1.5×).
    live: u64,
}

impl Limits {
    pub(super) fn new(max_bytes: usize) -> Self {
        let b = max_bytes as u64;
        // The largest live entries whose file's hard limit is 1.5×B.
        let live = (b + b / 5).min((b + b / 2).saturating_sub(MIN_ROOM));
        Self {
            counted: b,
            states: b / STATE_SHARE,
            live: if live >= b { live } else { u64::MAX },
        }
    }

    fn fits(&self, u: Usage) -> bool {
        u.counted <= self.counted && u.states <= self.states && u.live <= self.live
    }
}

/// Appends to `gone` the least recently used records and states that go
/// so that `add` more bytes fit the bound, once the entries already in
/// `gone` are dropped. `keep`, the entry a write replaces, is never one
/// of them and its bytes are not counted.
///
/// The index keeps records and states in age order: each entry dropped
/// costs O(log n), however many there are (a quarter of a 256 MiB bound
/// holds some 200,000 states).
pub(super) fn lru(
    index: &Index,
    limits: &Limits,
    add: Usage,
    keep: Option<Ref>,
    gone: &mut Vec<Ref>,
) {
    let skip: HashSet<Ref> = gone.iter().copied().chain(keep).collect();
    let mut u = skip
        .iter()
        .fold(index.usage(), |u, r| u.minus(index.cost(*r)))
        .plus(add);
    if limits.fits(u) {
        return;
    }
    let states = || {
        index
            .states_by_age()
            .map(|(at, s)| (at, Ref::State(s)))
            .filter(|(_, r)| !skip.contains(r))
    };
    let mut dropped = Vec::new();
    for (_, r) in states() {
        if u.states <= limits.states {
            break;
        }
        u = u.minus(index.cost(r));
        dropped.push(r);
    }
    if !limits.fits(u) {
        let records = index
            .records_by_age()
            .map(|(at, k)| (at, Ref::Record(k)))
            .filter(|(_, r)| !skip.contains(r));
        // The states dropped for the share are the first ones.
        let states = states().skip(dropped.len());
        for (_, r) in oldest_first(records, states) {
            if limits.fits(u) {
                break;
            }
            u = u.minus(index.cost(r));
            dropped.push(r);
        }
    }
    gone.append(&mut dropped);
}

/// Two sequences in age order merged, oldest first.
fn oldest_first(
    a: impl Iterator<Item = (u64, Ref)>,
    b: impl Iterator<Item = (u64, Ref)>,
) -> impl Iterator<Item = (u64, Ref)> {
    let (mut a, mut b) = (a.peekable(), b.peekable());
    std::iter::from_fn(move || match (a.peek(), b.peek()) {
        (Some(x), Some(y)) if y < x => b.next(),
        (Some(_), _) => a.next(),
        _ => b.next(),
    })
}

/// What one sweep removes and writes.
#[derive(Debug, Default)]
pub(super) struct SweepPlan {
    /// Records dropped (expired, or over the byte bound).
    pub(super) gone: Vec<Key>,
    /// Last uses to write.
    pub(super) dirty: Vec<(Key, u64)>,
    /// Conversation states dropped (expired, or over the byte bound).
    pub(super) states: Vec<u128>,
}

/// What a sweep at `now` drops (expired records and states first, then
/// the least recently used while over the byte bound: [`lru`]) and
/// which last uses it writes. Reads the index only: [`apply_sweep`]
/// changes it once the plan is written.
pub(super) fn plan_sweep(index: &Index, now: u64, ttl_ms: u64, max_bytes: usize) -> SweepPlan {
    let expired = |at: u64| now.saturating_sub(at) > ttl_ms;
    let records = index.records_by_age().take_while(|(at, _)| expired(*at));
    let states = index.states_by_age().take_while(|(at, _)| expired(*at));
    let mut dropped: Vec<Ref> = records
        .map(|(_, k)| Ref::Record(k))
        .chain(states.map(|(_, s)| Ref::State(s)))
        .collect();
    lru(
        index,
        &Limits::new(max_bytes),
        Usage::default(),
        None,
        &mut dropped,
    );
    let (gone, states) = split(&dropped);
    let gone_set: HashSet<&Key> = gone.iter().collect();
    let dirty = index
        .meta
        .iter()
        .filter(|(k, m)| m.dirty && !gone_set.contains(k))
        .map(|(k, m)| (*k, m.touched))
        .collect();
    SweepPlan {
        gone,
        dirty,
        states,
    }
}

/// Records and states apart, each in the order given.
pub(super) fn split(refs: &[Ref]) -> (Vec<Key>, Vec<u128>) {
    let mut records = Vec::new();
    let mut states = Vec::new();
    for r in refs {
        match *r {
            Ref::Record(k) => records.push(k),
            Ref::State(s) => states.push(s),
        }
    }
    (records, states)
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

#[cfg(test)]
mod tests {
    use super::super::index::tests::meta;
    use super::super::index::{Loc, Meta, StateMeta};
    use super::*;

    fn record(i: &mut Index, h: u128, size: usize, touched: u64) {
        i.add((1, h), meta(1, size, touched));
    }

    fn state(i: &mut Index, s: u128, len: u64, written: u64) {
        let at = Loc { offset: 64, len };
        i.put_state(s, StateMeta { written, at });
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
    fn records_and_states_go_least_recently_used_first() {
        let limits = Limits::new(1 << 20);
        let mut i = Index::default();
        record(&mut i, 1, 400 << 10, 10);
        state(&mut i, 7, 100 << 10, 20);
        record(&mut i, 2, 400 << 10, 30);
        state(&mut i, 8, 100 << 10, 40);
        let mut gone = Vec::new();
        lru(
            &i,
            &limits,
            Usage::record(30 << 10, 30 << 10),
            None,
            &mut gone,
        );
        assert_eq!(gone, vec![Ref::Record((1, 1))]);
        let mut gone = Vec::new();
        lru(
            &i,
            &limits,
            Usage::record(500 << 10, 500 << 10),
            None,
            &mut gone,
        );
        assert_eq!(gone, vec![Ref::Record((1, 1)), Ref::State(7)]);
        // The entry a write replaces is not dropped for it.
        let mut gone = Vec::new();
        let add = Usage::record(430 << 10, 430 << 10);
        lru(&i, &limits, add, Some(Ref::Record((1, 1))), &mut gone);
        assert_eq!(gone, vec![Ref::State(7)]);
    }

    #[test]
    fn states_beyond_their_share_drop_the_oldest_states_not_records() {
        let limits = Limits::new(1 << 20);
        assert_eq!(limits.states, 256 << 10);
        let mut i = Index::default();
        record(&mut i, 1, 100 << 10, 1);
        for s in 0..4u128 {
            state(&mut i, s, 64 << 10, 10 + s as u64);
        }
        let mut gone = Vec::new();
        lru(
            &i,
            &limits,
            Usage::state(1000),
            Some(Ref::State(9)),
            &mut gone,
        );
        assert_eq!(gone, vec![Ref::State(0)], "the record is older, yet kept");
    }

    #[test]
    fn the_live_bytes_stay_within_a_fifth_over_the_bound() {
        let b = 1 << 20;
        let limits = Limits::new(b);
        assert_eq!(limits.live, (b + b / 5) as u64);
        // Small bounds: the 64 KiB least room decides, no live limit.
        assert_eq!(Limits::new(3000).live, u64::MAX);
        // Records whose frames take far more than their size.
        let mut i = Index::default();
        for h in 0..4u128 {
            let at = Loc {
                offset: 64,
                len: 400 << 10,
            };
            let m = Meta {
                k: 1,
                size: 100,
                touched: h as u64,
                dirty: false,
                at,
            };
            i.add((1, h), m);
        }
        let mut gone = Vec::new();
        lru(&i, &limits, Usage::default(), None, &mut gone);
        assert_eq!(gone, vec![Ref::Record((1, 0))]);
    }
}
