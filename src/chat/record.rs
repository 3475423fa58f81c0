//! Compaction records: the stable prefixes that make compaction a substitution
//! rather than a one-time rewrite.
//!
//! Chat APIs are stateless: the client re-sends its full, uncompacted history
//! on every turn. A record says "the first `k` original messages, whose chained
//! hash is `prefix_hash`, are sent upstream as `replacement`". Because the
//! replacement bytes never change, upstream prompt caches keep hitting between
//! compactions.
//!
//! Records are content-addressed by (credential fingerprint, prefix hash), so a
//! conversation that forks, retries or arrives without a session header still
//! finds the compaction made for the history it shares.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, PoisonError, RwLock, RwLockReadGuard, RwLockWriteGuard};
use std::time::Duration;

use dashmap::DashMap;
use serde_json::value::RawValue;
use tokio::time::Instant;

use crate::session::store::{LruIndex, LruSlot};

pub(crate) use crate::config::DEFAULT_MAX_RECORD_BYTES;

/// What one record costs besides its replacement's JSON text: the record
/// itself, its map slot and index entry.
const RECORD_OVERHEAD: usize = 256;
/// What each replacement message costs besides its text (the box).
const MESSAGE_OVERHEAD: usize = std::mem::size_of::<Box<RawValue>>();

/// One compaction's substitution.
#[derive(Debug)]
pub struct Record {
    /// How many leading original messages the replacement stands for.
    pub k: usize,
    /// Chained hash of those `k` original messages.
    pub prefix_hash: u128,
    /// The messages sent upstream instead, byte-identical every time.
    pub replacement: Vec<Box<RawValue>>,
    /// Rough token estimate of the replacement (saves re-estimating it).
    pub(crate) replacement_tokens: u64,
    /// Rough token estimate of the `k` originals it replaced.
    pub(crate) original_tokens: u64,
    /// Which replacement rows carry compactor's summary: the only messages
    /// the engine may treat as its own summaries on later compactions.
    /// `None` (a record stored before this was kept) means every
    /// replacement row may: all of them are compactor's output.
    summary_rows: Option<Vec<usize>>,
    /// What the record costs in memory, counted against the byte bound.
    footprint: usize,
    /// Last use and place in the store's recency index.
    slot: LruSlot,
}

impl Record {
    pub fn new(
        k: usize,
        prefix_hash: u128,
        replacement: Vec<Box<RawValue>>,
        original_tokens: u64,
        replacement_tokens: u64,
    ) -> Self {
        let footprint = RECORD_OVERHEAD
            + replacement
                .iter()
                .map(|m| m.get().len() + MESSAGE_OVERHEAD)
                .sum::<usize>();
        Self {
            k,
            prefix_hash,
            replacement,
            replacement_tokens,
            original_tokens,
            summary_rows: None,
            footprint,
            slot: LruSlot::new(0),
        }
    }

    /// Sets which replacement rows carry a summary (out-of-range rows are
    /// ignored).
    #[must_use]
    pub(crate) fn with_summary_rows(mut self, mut rows: Vec<usize>) -> Self {
        rows.retain(|&i| i < self.replacement.len());
        self.footprint += rows.len() * std::mem::size_of::<usize>();
        self.summary_rows = Some(rows);
        self
    }

    /// The replacement rows that carry a summary.
    pub(crate) fn summary_rows(&self) -> Box<dyn Iterator<Item = usize> + '_> {
        match &self.summary_rows {
            Some(rows) => Box::new(rows.iter().copied()),
            None => Box::new(0..self.replacement.len()),
        }
    }

    /// [`Self::summary_rows`] as stored (`None`: every row).
    pub(crate) fn stored_summary_rows(&self) -> Option<&[usize]> {
        self.summary_rows.as_deref()
    }

    /// What is sent for a client history the record matches: the
    /// replacement, then the client's messages after the first `k` as they
    /// came.
    pub(crate) fn applied_to(&self, original: &[Box<RawValue>]) -> Vec<Box<RawValue>> {
        self.replacement
            .iter()
            .chain(original.get(self.k..).unwrap_or(&[]))
            .cloned()
            .collect()
    }

    /// Total bytes held by the replacement's JSON text.
    pub(crate) fn bytes(&self) -> usize {
        self.replacement.iter().map(|m| m.get().len()).sum()
    }

    /// What the record costs in memory (the replacement and bookkeeping);
    /// the store's byte bound counts this.
    // Only tests read it.
    #[cfg(test)]
    pub(crate) fn footprint(&self) -> usize {
        self.footprint
    }
}

/// Key of a record: (credential fingerprint, prefix hash).
pub(crate) type RecordKey = (u128, u128);

/// Bounded, content-addressed store of compaction records: at most `max`
/// records and `max_bytes` of [`Record::footprint`], the least recently
/// used going first when either bound is crossed (amortised O(log n), see
/// [`LruIndex`]); records idle for the TTL are dropped.
pub struct RecordStore {
    map: DashMap<RecordKey, Arc<Record>>,
    /// How many records there are of each prefix length `k`. A lookup
    /// probes only these lengths: probing every prefix would cost one map
    /// lookup per message of the history on every request, most of all
    /// before the first compaction, when there is nothing to find.
    /// A read lock on the hot path: lookups never wait for each other.
    lengths: RwLock<BTreeMap<usize, usize>>,
    lru: LruIndex<RecordKey>,
    /// Sum of the footprints of the records in the map.
    bytes: AtomicUsize,
    epoch: Instant,
    ttl: Duration,
    max: usize,
    max_bytes: usize,
}

impl RecordStore {
    /// A store of at most `max` records and [`DEFAULT_MAX_RECORD_BYTES`].
    pub fn new(ttl: Duration, max: usize) -> Self {
        Self {
            map: DashMap::new(),
            lengths: RwLock::new(BTreeMap::new()),
            lru: LruIndex::default(),
            bytes: AtomicUsize::new(0),
            epoch: Instant::now(),
            ttl,
            max: max.max(1),
            max_bytes: DEFAULT_MAX_RECORD_BYTES,
        }
    }

    /// Sets the byte bound (`[session] max_record_bytes`).
    #[must_use]
    pub fn with_max_bytes(mut self, max_bytes: usize) -> Self {
        self.max_bytes = max_bytes.max(1);
        self
    }

    fn tick(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    fn ttl_ms(&self) -> u64 {
        u64::try_from(self.ttl.as_millis()).unwrap_or(u64::MAX)
    }

    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// Bytes the records hold now (sum of [`Record::footprint`]).
    pub fn bytes(&self) -> usize {
        self.bytes.load(Ordering::Relaxed)
    }

    /// Store a record; evicts the least recently used ones while either
    /// bound is exceeded. A record larger than the whole byte bound is not
    /// kept (the returned `Arc` is then not in the store).
    pub fn insert(&self, cred: u128, record: Record) -> Arc<Record> {
        record.slot.touch(self.tick());
        let record = Arc::new(record);
        if record.footprint > self.max_bytes {
            return record;
        }
        let key = (cred, record.prefix_hash);
        self.bytes.fetch_add(record.footprint, Ordering::Relaxed);
        *self.lengths_mut().entry(record.k).or_insert(0) += 1;
        if let Some(old) = self.map.insert(key, Arc::clone(&record)) {
            self.dropped(&old);
        }
        self.lru.file(key, &record.slot);
        self.evict_lru();
        record
    }

    /// The longest prefix of `hashes` (element i = chained hash of messages
    /// 0..=i) that has a record for this credential. `hint` is the session's
    /// newest record: only lengths longer than it are probed before it, so
    /// the common case is one lookup, and a longer record another session
    /// of the credential made for the same history still wins.
    pub fn lookup(
        &self,
        cred: u128,
        hashes: &[u128],
        hint: Option<&Arc<Record>>,
    ) -> Option<Arc<Record>> {
        // An empty history has no prefix to match (and `1..=0` is an
        // inverted range, which `BTreeMap::range` panics on).
        if hashes.is_empty() {
            return None;
        }
        let hint = hint.filter(|rec| {
            rec.k > 0 && rec.k <= hashes.len() && hashes[rec.k - 1] == rec.prefix_hash
        });
        if let Some(rec) = hint {
            if let Some(found) = self.longest_in(cred, hashes, rec.k + 1) {
                return Some(found);
            }
            if let Some(found) = self.touch(cred, rec.prefix_hash, rec.k) {
                return Some(found);
            }
        }
        self.longest_in(cred, hashes, 1)
    }

    /// The longest record of `hashes` covering at least `shortest` messages.
    fn longest_in(&self, cred: u128, hashes: &[u128], shortest: usize) -> Option<Arc<Record>> {
        if shortest > hashes.len() {
            return None;
        }
        // Longest first: a later compaction covers more of the history.
        // Copied out so no map lock is ever taken under the lengths lock.
        let lengths: Vec<usize> = self
            .lengths()
            .range(shortest..=hashes.len())
            .rev()
            .map(|(k, _)| *k)
            .collect();
        lengths
            .into_iter()
            .find_map(|k| self.touch(cred, hashes[k - 1], k))
    }

    fn lengths(&self) -> RwLockReadGuard<'_, BTreeMap<usize, usize>> {
        // Every update leaves the map consistent: a poisoned lock's data is good.
        self.lengths.read().unwrap_or_else(PoisonError::into_inner)
    }

    fn lengths_mut(&self) -> RwLockWriteGuard<'_, BTreeMap<usize, usize>> {
        self.lengths.write().unwrap_or_else(PoisonError::into_inner)
    }

    /// Books a record that was removed from the map: its length, its bytes
    /// and its place in the recency index.
    fn dropped(&self, old: &Record) {
        self.uncount(old.k);
        self.bytes.fetch_sub(old.footprint, Ordering::Relaxed);
        self.lru.forget(&old.slot);
    }

    /// Forgets one record of length `k` (it was removed from the map).
    fn uncount(&self, k: usize) {
        let mut lengths = self.lengths_mut();
        if let Some(n) = lengths.get_mut(&k) {
            *n -= 1;
            if *n == 0 {
                lengths.remove(&k);
            }
        }
    }

    /// Removes `rec` if it is still the record under `key`.
    fn remove(&self, key: &RecordKey, rec: &Arc<Record>) -> bool {
        match self.map.remove_if(key, |_, v| Arc::ptr_eq(v, rec)) {
            Some((_, old)) => {
                self.dropped(&old);
                true
            }
            None => false,
        }
    }

    fn is_expired(&self, rec: &Record, now: u64) -> bool {
        now.saturating_sub(rec.slot.last_used()) > self.ttl_ms()
    }

    fn touch(&self, cred: u128, hash: u128, k: usize) -> Option<Arc<Record>> {
        let rec = self.map.get(&(cred, hash)).map(|r| Arc::clone(r.value()))?;
        if rec.k != k {
            return None;
        }
        let now = self.tick();
        if self.is_expired(&rec, now) {
            self.remove(&(cred, hash), &rec);
            return None;
        }
        rec.slot.touch(now);
        Some(rec)
    }

    /// Drop records idle longer than the TTL.
    pub(crate) fn sweep(&self) {
        let now = self.tick();
        let mut dropped = Vec::new();
        self.map.retain(|_, r| {
            let keep = !self.is_expired(r, now);
            if !keep {
                dropped.push(Arc::clone(r));
            }
            keep
        });
        for r in &dropped {
            self.uncount(r.k);
            self.bytes.fetch_sub(r.footprint, Ordering::Relaxed);
        }
        self.lru.forget_all(dropped.iter().map(|r| &r.slot));
    }

    fn over_bounds(&self) -> bool {
        self.map.len() > self.max || self.bytes() > self.max_bytes
    }

    fn evict_lru(&self) {
        while self.over_bounds() {
            let oldest = self.lru.pop_oldest(
                |k| self.map.get(k).map(|r| Arc::clone(r.value())),
                |r: &Arc<Record>| &r.slot,
            );
            let Some((key, rec)) = oldest else { break };
            // Replaced meanwhile (then not removed): the new record is
            // filed and counted on its own.
            self.remove(&key, &rec);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn raw(s: &str) -> Box<RawValue> {
        RawValue::from_string(s.to_string()).unwrap()
    }

    #[test]
    fn lookup_finds_longest_matching_prefix() {
        let store = RecordStore::new(Duration::from_secs(60), 10);
        let hashes = [11u128, 22, 33, 44, 55];
        store.insert(1, Record::new(2, 22, vec![raw("{\"a\":1}")], 10, 2));
        store.insert(1, Record::new(4, 44, vec![raw("{\"b\":2}")], 20, 2));
        let hit = store.lookup(1, &hashes, None).unwrap();
        assert_eq!(hit.k, 4);
        // A forked history sharing only the first two messages finds the older record.
        let fork = [11u128, 22, 99, 98];
        assert_eq!(store.lookup(1, &fork, None).unwrap().k, 2);
        // Other credentials never see it.
        assert!(store.lookup(2, &hashes, None).is_none());
    }

    #[test]
    fn empty_history_finds_nothing_and_does_not_panic() {
        let store = RecordStore::new(Duration::from_secs(60), 10);
        assert!(store.lookup(1, &[], None).is_none());
        let rec = store.insert(1, Record::new(2, 22, vec![raw("1")], 1, 1));
        assert!(store.lookup(1, &[], None).is_none());
        assert!(store.lookup(1, &[], Some(&rec)).is_none());
        assert!(store.lookup(2, &[], Some(&rec)).is_none());
        // A record of length 0 never matches (there is no prefix hash).
        store.insert(1, Record::new(0, 0, vec![], 0, 0));
        assert!(store.lookup(1, &[], None).is_none());
        assert!(store.lookup(1, &[0], None).is_none());
    }

    #[test]
    fn hint_must_still_match_the_history() {
        let store = RecordStore::new(Duration::from_secs(60), 10);
        let rec = store.insert(1, Record::new(2, 22, vec![raw("1")], 1, 1));
        assert!(store.lookup(1, &[11, 23, 33], Some(&rec)).is_none());
        assert_eq!(store.lookup(1, &[11, 22, 33], Some(&rec)).unwrap().k, 2);
    }

    /// The lengths index always matches what the map holds.
    fn assert_lengths_match(store: &RecordStore) {
        let mut actual = BTreeMap::new();
        for e in store.map.iter() {
            *actual.entry(e.value().k).or_insert(0) += 1;
        }
        assert_eq!(*store.lengths(), actual);
    }

    #[test]
    fn lengths_index_follows_insert_replace_and_evict() {
        let store = RecordStore::new(Duration::from_secs(60), 3);
        store.insert(1, Record::new(2, 22, vec![], 0, 0));
        store.insert(1, Record::new(4, 44, vec![], 0, 0));
        store.insert(2, Record::new(4, 44, vec![], 0, 0));
        assert_lengths_match(&store);
        // Same key again: replaced, not counted twice.
        store.insert(1, Record::new(4, 44, vec![], 0, 0));
        assert_lengths_match(&store);
        // Over the bound: one record is evicted, and its length with it.
        store.insert(3, Record::new(7, 77, vec![], 0, 0));
        assert_eq!(store.len(), 3);
        assert_lengths_match(&store);
    }

    #[test]
    fn lengths_index_follows_expiry_and_sweep() {
        let store = RecordStore::new(Duration::from_millis(20), 10);
        store.insert(1, Record::new(2, 22, vec![], 0, 0));
        store.insert(1, Record::new(5, 55, vec![], 0, 0));
        store.insert(2, Record::new(5, 55, vec![], 0, 0));
        std::thread::sleep(Duration::from_millis(60));
        // Both of credential 1's records have expired: the lookup drops them.
        assert!(store.lookup(1, &[11, 22, 33, 44, 55], None).is_none());
        assert_eq!(store.len(), 1);
        assert_lengths_match(&store);
        store.sweep();
        assert!(store.is_empty());
        assert!(store.lengths().is_empty());
    }

    /// A record of about `kib` KiB.
    fn sized(hash: u128, kib: usize) -> Record {
        let text = format!("\"{}\"", "x".repeat(kib * 1024));
        Record::new(1, hash, vec![raw(&text)], 0, 0)
    }

    #[test]
    fn records_are_bounded_by_bytes_least_recently_used_first() {
        // Room for about three 100 KiB records, whatever the count bound.
        let store = RecordStore::new(Duration::from_secs(60), 1000).with_max_bytes(350 * 1024);
        for h in 1..=3 {
            store.insert(1, sized(h, 100));
        }
        assert_eq!(store.len(), 3);
        // Use 1, so 2 is the least recently used.
        std::thread::sleep(Duration::from_millis(3));
        assert!(store.lookup(1, &[1], None).is_some());
        store.insert(1, sized(4, 100));
        assert_eq!(store.len(), 3);
        assert!(store.lookup(1, &[2], None).is_none(), "2 was evicted");
        for h in [1, 3, 4] {
            assert!(store.lookup(1, &[h], None).is_some(), "{h} kept");
        }
        assert!(store.bytes() <= 350 * 1024);
        // A big record pushes out as many as it needs.
        store.insert(2, sized(9, 300));
        assert_eq!(store.len(), 1);
        assert!(store.bytes() <= 350 * 1024);
        // One larger than the whole bound is not kept at all.
        let huge = store.insert(3, sized(10, 400));
        assert_eq!(huge.k, 1);
        assert!(store.lookup(3, &[10], None).is_none());
        assert_eq!(store.len(), 1);
        assert_lengths_match(&store);
        assert_bytes_match(&store);
    }

    /// The byte count always matches what the map holds.
    fn assert_bytes_match(store: &RecordStore) {
        let actual: usize = store.map.iter().map(|e| e.value().footprint()).sum();
        assert_eq!(store.bytes(), actual);
        assert_eq!(store.lru.len(), store.map.len());
    }

    #[test]
    fn bytes_follow_insert_replace_expiry_and_sweep() {
        let store = RecordStore::new(Duration::from_millis(30), 10);
        store.insert(1, sized(1, 1));
        store.insert(1, sized(2, 2));
        assert_bytes_match(&store);
        // Replaced under the same key: counted once, the new size.
        store.insert(1, sized(2, 5));
        assert_eq!(store.len(), 2);
        assert_bytes_match(&store);
        assert!(store.bytes() > 6 * 1024);
        std::thread::sleep(Duration::from_millis(60));
        assert!(store.lookup(1, &[1], None).is_none());
        assert_bytes_match(&store);
        store.sweep();
        assert_eq!(store.bytes(), 0);
        assert_bytes_match(&store);
    }

    #[test]
    fn default_byte_bound_applies() {
        let store = RecordStore::new(Duration::from_secs(60), 10);
        assert_eq!(store.max_bytes, DEFAULT_MAX_RECORD_BYTES);
        assert_eq!(store.with_max_bytes(0).max_bytes, 1);
    }

    /// Records examined while inserting `n` records into a full store of
    /// `size`, after `touched` of the held ones were looked up again.
    /// Returns (examined, evicted).
    fn work_of_inserts_when_full(size: usize, touched: usize, n: u128) -> (u64, usize) {
        let store = RecordStore::new(Duration::from_secs(3600), size);
        for h in 0..size as u128 {
            store.insert(1, Record::new(1, h, vec![], 0, 0));
        }
        // Ticks are milliseconds: let them move so the lookups count as uses.
        std::thread::sleep(Duration::from_millis(3));
        for h in 0..touched as u128 {
            assert!(store.lookup(1, &[h], None).is_some());
        }
        let before = store.lru.examined();
        for h in 0..n {
            store.insert(1, Record::new(1, size as u128 + h, vec![], 0, 0));
        }
        assert_eq!(store.len(), size);
        let evicted = (0..n as usize)
            .filter(|&h| store.lookup(1, &[h as u128], None).is_none())
            .count();
        (store.lru.examined() - before, evicted)
    }

    /// Inserting into a full store examines one record per eviction,
    /// whatever the store's size, plus at most one re-filing per record
    /// used since it was filed: eviction never scans the records. (The time
    /// this costs is measured in `benches/state.rs`.)
    #[test]
    fn eviction_work_does_not_grow_with_the_store() {
        for size in [512, 32 * 512] {
            assert_eq!(work_of_inserts_when_full(size, 0, 100), (100, 100));
            let (examined, evicted) = work_of_inserts_when_full(size, 300, 100);
            // The 300 looked-up records outlive 100 untouched ones.
            assert_eq!(evicted, 0, "store of {size}");
            assert!(
                examined <= 100 + 300,
                "store of {size}: {examined} examined"
            );
        }
    }

    #[test]
    fn a_longer_record_wins_over_the_hint() {
        let store = RecordStore::new(Duration::from_secs(60), 8);
        let short = store.insert(1, Record::new(2, 22, vec![], 0, 0));
        store.insert(1, Record::new(4, 44, vec![], 0, 0));
        let hashes = [11, 22, 33, 44, 55];
        let found = store.lookup(1, &hashes, Some(&short)).unwrap();
        assert_eq!(found.k, 4, "another session's longer record");
        // Without a longer one, the hint is what is found.
        let found = store.lookup(1, &hashes[..3], Some(&short)).unwrap();
        assert_eq!(found.k, 2);
        // Another credential's longer record is never seen.
        store.insert(2, Record::new(5, 55, vec![], 0, 0));
        assert_eq!(store.lookup(1, &hashes, Some(&short)).unwrap().k, 4);
    }

    #[test]
    fn lru_eviction_bounds_the_store() {
        let store = RecordStore::new(Duration::from_secs(60), 2);
        store.insert(1, Record::new(1, 1, vec![], 0, 0));
        store.insert(1, Record::new(1, 2, vec![], 0, 0));
        store.insert(1, Record::new(1, 3, vec![], 0, 0));
        assert_eq!(store.len(), 2);
    }
}
