//! Compaction records: the stable prefixes that make compaction a substitution
//! rather than a one-time rewrite (design §2).
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
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use dashmap::DashMap;
use serde_json::value::RawValue;
use tokio::time::Instant;

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
    pub replacement_tokens: u64,
    /// Rough token estimate of the `k` originals it replaced.
    pub original_tokens: u64,
    last_used: AtomicU64,
}

impl Record {
    pub fn new(
        k: usize,
        prefix_hash: u128,
        replacement: Vec<Box<RawValue>>,
        original_tokens: u64,
        replacement_tokens: u64,
    ) -> Self {
        Self {
            k,
            prefix_hash,
            replacement,
            replacement_tokens,
            original_tokens,
            last_used: AtomicU64::new(0),
        }
    }

    /// Total bytes held by the replacement (what a record costs in memory).
    pub fn bytes(&self) -> usize {
        self.replacement.iter().map(|m| m.get().len()).sum()
    }
}

/// Key of a record: (credential fingerprint, prefix hash).
pub type RecordKey = (u128, u128);

/// Bounded, content-addressed store of compaction records.
pub struct RecordStore {
    map: DashMap<RecordKey, Arc<Record>>,
    /// How many records there are of each prefix length `k`. A lookup
    /// probes only these lengths: probing every prefix would cost one map
    /// lookup per message of the history on every request, most of all
    /// before the first compaction, when there is nothing to find.
    lengths: Mutex<BTreeMap<usize, usize>>,
    epoch: Instant,
    ttl: Duration,
    max: usize,
}

impl RecordStore {
    pub fn new(ttl: Duration, max: usize) -> Self {
        Self {
            map: DashMap::new(),
            lengths: Mutex::new(BTreeMap::new()),
            epoch: Instant::now(),
            ttl,
            max: max.max(1),
        }
    }

    fn tick(&self) -> u64 {
        self.epoch.elapsed().as_millis() as u64
    }

    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// Store a record; evicts the least recently used one when full.
    pub fn insert(&self, cred: u128, record: Record) -> Arc<Record> {
        record.last_used.store(self.tick(), Ordering::Relaxed);
        let record = Arc::new(record);
        let replaced = self
            .map
            .insert((cred, record.prefix_hash), Arc::clone(&record));
        if let Some(old) = replaced {
            self.uncount(old.k);
        }
        *self.lengths().entry(record.k).or_insert(0) += 1;
        if self.map.len() > self.max {
            self.evict_lru();
        }
        record
    }

    /// The longest prefix of `hashes` (element i = chained hash of messages
    /// 0..=i) that has a record for this credential. `hint` is the session's
    /// newest record, checked first so the common case is one lookup.
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
        if let Some(rec) = hint {
            if rec.k > 0 && rec.k <= hashes.len() && hashes[rec.k - 1] == rec.prefix_hash {
                if let Some(found) = self.touch(cred, rec.prefix_hash, rec.k) {
                    return Some(found);
                }
            }
        }
        // Longest first: a later compaction covers more of the history.
        // Copied out so no map lock is ever taken under the lengths lock.
        let lengths: Vec<usize> = self
            .lengths()
            .range(1..=hashes.len())
            .rev()
            .map(|(k, _)| *k)
            .collect();
        lengths
            .into_iter()
            .find_map(|k| self.touch(cred, hashes[k - 1], k))
    }

    fn lengths(&self) -> MutexGuard<'_, BTreeMap<usize, usize>> {
        crate::sync::lock(&self.lengths)
    }

    /// Forgets one record of length `k` (it was removed from the map).
    fn uncount(&self, k: usize) {
        let mut lengths = self.lengths();
        if let Some(n) = lengths.get_mut(&k) {
            *n -= 1;
            if *n == 0 {
                lengths.remove(&k);
            }
        }
    }

    fn remove(&self, key: &RecordKey) {
        if let Some((_, old)) = self.map.remove(key) {
            self.uncount(old.k);
        }
    }

    fn touch(&self, cred: u128, hash: u128, k: usize) -> Option<Arc<Record>> {
        let rec = self.map.get(&(cred, hash)).map(|r| Arc::clone(r.value()))?;
        if rec.k != k {
            return None;
        }
        let now = self.tick();
        if now.saturating_sub(rec.last_used.load(Ordering::Relaxed)) > self.ttl.as_millis() as u64 {
            self.remove(&(cred, hash));
            return None;
        }
        rec.last_used.store(now, Ordering::Relaxed);
        Some(rec)
    }

    /// Drop records idle longer than the TTL.
    pub fn sweep(&self) {
        let now = self.tick();
        let ttl = self.ttl.as_millis() as u64;
        let mut dropped = Vec::new();
        self.map.retain(|_, r| {
            let keep = now.saturating_sub(r.last_used.load(Ordering::Relaxed)) <= ttl;
            if !keep {
                dropped.push(r.k);
            }
            keep
        });
        for k in dropped {
            self.uncount(k);
        }
    }

    fn evict_lru(&self) {
        while self.map.len() > self.max {
            let oldest = self
                .map
                .iter()
                .min_by_key(|e| e.value().last_used.load(Ordering::Relaxed))
                .map(|e| *e.key());
            match oldest {
                Some(k) => self.remove(&k),
                None => break,
            }
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

    #[test]
    fn lru_eviction_bounds_the_store() {
        let store = RecordStore::new(Duration::from_secs(60), 2);
        store.insert(1, Record::new(1, 1, vec![], 0, 0));
        store.insert(1, Record::new(1, 2, vec![], 0, 0));
        store.insert(1, Record::new(1, 3, vec![], 0, 0));
        assert_eq!(store.len(), 2);
    }
}
