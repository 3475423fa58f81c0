//! Bounded in-memory session store.
//!
//! A `DashMap` of `Arc<Entry<T>>`; each entry has its own async lock (held
//! while deciding and compacting, never while streaming) and a last-used
//! tick. Bounded by an idle TTL (checked on access and by [`SessionStore::sweep`],
//! which the owner calls from a periodic task) and by a maximum count,
//! evicting the least recently used idle entries.
//!
//! Map guards never outlive a synchronous block: every method clones the
//! `Arc` out and drops the guard before returning, so nothing here can hold
//! a shard lock across an `.await`.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use dashmap::mapref::entry::Entry as MapEntry;
use dashmap::DashMap;
use tokio::time::Instant;

use super::key::SessionKey;
use crate::sync::lock;

// ------------------------------------------------------------------ LRU index

/// What an item kept in an [`LruIndex`] carries: its last use, lock-free,
/// and where the index files it.
#[derive(Debug)]
pub(crate) struct LruSlot {
    /// Unique per item (ties between equal ticks go by age).
    id: u64,
    /// Last use, in the owner's ticks. Touching an item is one relaxed
    /// store: known items never take the index lock.
    last_used: AtomicU64,
    /// The tick the item is filed under in the index; written under the
    /// index lock. Never more than `last_used`.
    indexed: AtomicU64,
    /// The item left its map: never (re-)filed again. Written under the
    /// index lock.
    gone: AtomicBool,
}

/// Ids of [`LruSlot`]s, unique in the process.
static NEXT_SLOT_ID: AtomicU64 = AtomicU64::new(0);

impl LruSlot {
    /// A slot for a new item last used at `tick` (not filed yet: see
    /// [`LruIndex::file`]).
    pub(crate) fn new(tick: u64) -> Self {
        Self {
            id: NEXT_SLOT_ID.fetch_add(1, Ordering::Relaxed),
            last_used: AtomicU64::new(tick),
            indexed: AtomicU64::new(tick),
            gone: AtomicBool::new(false),
        }
    }

    /// The last use.
    pub(crate) fn last_used(&self) -> u64 {
        self.last_used.load(Ordering::Relaxed)
    }

    /// Marks a use at `tick`.
    pub(crate) fn touch(&self, tick: u64) {
        self.last_used.store(tick, Ordering::Relaxed);
    }
}

/// Recency order of the items of a map, for O(log n) eviction of the least
/// recently used one, with lock-free touches.
///
/// The index files each item under the tick of its last use *as of when it
/// was filed*; a touch only updates the item's own atomic. To find the
/// least recently used item, [`Self::pop_oldest`] takes the first filed
/// item and, when it has been used since it was filed, files it again under
/// its real last use and looks at the next one. Since a filed tick never
/// exceeds the item's real last use, the first item whose filed tick is
/// still its last use is the least recently used of all. Each touch costs
/// at most one re-filing, so eviction is amortised O(log n), and the hot
/// path of a known item (one atomic store) takes no lock at all.
///
/// Lock order: the index lock is never held while calling back into the
/// owner's map, so map shard locks may be held while calling in here.
#[derive(Debug)]
pub(crate) struct LruIndex<K> {
    order: Mutex<BTreeMap<(u64, u64), K>>,
    /// Filed items [`Self::pop_oldest`] has taken out and looked at, ever:
    /// the work eviction does, as a count rather than a time, so its bound
    /// can be checked deterministically.
    examined: AtomicU64,
}

impl<K> Default for LruIndex<K> {
    fn default() -> Self {
        Self {
            order: Mutex::new(BTreeMap::new()),
            examined: AtomicU64::new(0),
        }
    }
}

impl<K: Copy> LruIndex<K> {
    /// Files an item (once it is in its map) under its last use.
    pub(crate) fn file(&self, key: K, slot: &LruSlot) {
        let mut order = lock(&self.order);
        if slot.gone.load(Ordering::Relaxed) {
            return;
        }
        let tick = slot.last_used();
        slot.indexed.store(tick, Ordering::Relaxed);
        order.insert((tick, slot.id), key);
    }

    /// Forgets an item that left its map.
    pub(crate) fn forget(&self, slot: &LruSlot) {
        let mut order = lock(&self.order);
        slot.gone.store(true, Ordering::Relaxed);
        order.remove(&(slot.indexed.load(Ordering::Relaxed), slot.id));
    }

    /// Forgets several items under one lock (sweeps).
    pub(crate) fn forget_all<'a>(&self, slots: impl IntoIterator<Item = &'a LruSlot>) {
        let mut order = lock(&self.order);
        for slot in slots {
            slot.gone.store(true, Ordering::Relaxed);
            order.remove(&(slot.indexed.load(Ordering::Relaxed), slot.id));
        }
    }

    /// Items filed (live ones, give or take a concurrent insert or removal).
    // Only tests read it.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        lock(&self.order).len()
    }

    /// Filed items looked at by [`Self::pop_oldest`] so far.
    // Only tests read it.
    #[cfg(test)]
    pub(crate) fn examined(&self) -> u64 {
        self.examined.load(Ordering::Relaxed)
    }

    /// Takes the least recently used item out of the index. `resolve`
    /// finds the item currently in the map under a key, `slot_of` its slot.
    /// The item is still in the map: the caller removes it (then calls
    /// [`Self::forget`]) or files it again.
    pub(crate) fn pop_oldest<T>(
        &self,
        resolve: impl Fn(&K) -> Option<T>,
        slot_of: impl Fn(&T) -> &LruSlot,
    ) -> Option<(K, T)> {
        loop {
            let ((tick, id), key) = lock(&self.order).pop_first()?;
            self.examined.fetch_add(1, Ordering::Relaxed);
            let Some(item) = resolve(&key) else {
                continue; // Left the map meanwhile.
            };
            let slot = slot_of(&item);
            if slot.id != id {
                continue; // Another item under the same key now.
            }
            if slot.last_used() > tick {
                // Used since it was filed: file it under its real last use.
                self.file(key, slot);
                continue;
            }
            return Some((key, item));
        }
    }
}

// ------------------------------------------------------------------ sessions

/// One session: its state behind an async lock, and when it was last used.
#[derive(Debug)]
pub struct Entry<T> {
    state: tokio::sync::Mutex<T>,
    /// Milliseconds since the store's epoch, and the recency index's slot.
    slot: LruSlot,
    /// The last view a reader rendered of `state`: what a reader that must
    /// not wait (the admin view while a compaction holds the lock for its
    /// summary calls) answers with instead.
    snapshot: Mutex<Option<serde_json::Value>>,
}

impl<T> Entry<T> {
    fn new(state: T, slot: LruSlot) -> Self {
        Self {
            state: tokio::sync::Mutex::new(state),
            slot,
            snapshot: Mutex::new(None),
        }
    }

    /// The last view stored by [`Entry::set_snapshot`].
    pub(crate) fn snapshot(&self) -> Option<serde_json::Value> {
        crate::sync::lock(&self.snapshot).clone()
    }

    /// Keeps `view` for readers that find the state locked.
    pub(crate) fn set_snapshot(&self, view: serde_json::Value) {
        *crate::sync::lock(&self.snapshot) = Some(view);
    }

    /// Merges the members of `part` into the kept view (or keeps `part` as
    /// the view when there is none): a reader that renders only some of the
    /// view refreshes those members and leaves the rest.
    pub(crate) fn merge_snapshot(&self, part: &serde_json::Map<String, serde_json::Value>) {
        let mut kept = crate::sync::lock(&self.snapshot);
        match kept.as_mut().and_then(serde_json::Value::as_object_mut) {
            Some(view) => {
                for (k, v) in part {
                    view.insert(k.clone(), v.clone());
                }
            }
            None => *kept = Some(serde_json::Value::Object(part.clone())),
        }
    }

    /// The per-session lock.
    pub(crate) fn state(&self) -> &tokio::sync::Mutex<T> {
        &self.state
    }

    /// Locks the session state.
    pub async fn lock(&self) -> tokio::sync::MutexGuard<'_, T> {
        self.state.lock().await
    }

    fn tick(&self) -> u64 {
        self.slot.last_used()
    }
}

/// Store limits.
#[derive(Debug, Clone, Copy)]
pub struct StoreLimits {
    /// Idle time after which a session is forgotten.
    pub ttl: Duration,
    /// Maximum number of sessions kept.
    pub max_sessions: usize,
}

impl Default for StoreLimits {
    fn default() -> Self {
        Self {
            ttl: Duration::from_secs(3600),
            max_sessions: 10_000,
        }
    }
}

/// Bounded map from [`SessionKey`] to per-session state.
#[derive(Debug)]
pub struct SessionStore<T> {
    map: DashMap<SessionKey, Arc<Entry<T>>>,
    /// Recency order, for eviction at the count limit.
    lru: LruIndex<SessionKey>,
    limits: StoreLimits,
    epoch: Instant,
    evicted_lru: AtomicU64,
    expired: AtomicU64,
}

impl<T> SessionStore<T> {
    /// An empty store. Uses `tokio::time::Instant`, so paused test time
    /// drives expiry.
    pub fn new(limits: StoreLimits) -> Self {
        Self {
            map: DashMap::new(),
            lru: LruIndex::default(),
            limits: StoreLimits {
                max_sessions: limits.max_sessions.max(1),
                ..limits
            },
            epoch: Instant::now(),
            evicted_lru: AtomicU64::new(0),
            expired: AtomicU64::new(0),
        }
    }

    fn tick_at(&self, now: Instant) -> u64 {
        u64::try_from(now.saturating_duration_since(self.epoch).as_millis()).unwrap_or(u64::MAX)
    }

    fn ttl_ms(&self) -> u64 {
        u64::try_from(self.limits.ttl.as_millis()).unwrap_or(u64::MAX)
    }

    fn is_expired(&self, entry: &Entry<T>, now_tick: u64) -> bool {
        now_tick.saturating_sub(entry.tick()) >= self.ttl_ms()
    }

    /// The session for `key`, creating it with `init` when absent or
    /// expired. Marks it used.
    ///
    /// A known session costs a map lookup and an atomic store; a new one
    /// also files it in the recency index and, at the count limit, evicts
    /// the least recently used idle session in amortised O(log n).
    pub fn get_or_create(&self, key: SessionKey, init: impl FnOnce() -> T) -> Arc<Entry<T>> {
        let now = self.tick_at(Instant::now());
        // `init` runs under the shard lock: it must be cheap (it is a
        // constructor of empty state).
        let (entry, replaced) = match self.map.entry(key) {
            MapEntry::Occupied(mut o) => {
                if self.is_expired(o.get(), now) {
                    self.expired.fetch_add(1, Ordering::Relaxed);
                    let fresh = Arc::new(Entry::new(init(), LruSlot::new(now)));
                    let old = o.insert(fresh.clone());
                    (fresh, Some(old))
                } else {
                    o.get().slot.touch(now);
                    return o.get().clone();
                }
            }
            MapEntry::Vacant(v) => {
                let fresh = Arc::new(Entry::new(init(), LruSlot::new(now)));
                v.insert(fresh.clone());
                (fresh, None)
            }
        };
        if let Some(old) = replaced {
            self.lru.forget(&old.slot);
        }
        if self.map.len() > self.limits.max_sessions {
            self.evict_lru(key);
        }
        self.lru.file(key, &entry.slot);
        entry
    }

    /// The session for `key` if present and not expired. Marks it used.
    pub fn get(&self, key: &SessionKey) -> Option<Arc<Entry<T>>> {
        let now = self.tick_at(Instant::now());
        let found = self.map.get(key).map(|e| e.value().clone())?;
        if self.is_expired(&found, now) {
            // Only remove the entry we judged, not one re-created meanwhile.
            if self
                .map
                .remove_if(key, |_, v| Arc::ptr_eq(v, &found))
                .is_some()
            {
                self.lru.forget(&found.slot);
                self.expired.fetch_add(1, Ordering::Relaxed);
            }
            return None;
        }
        found.slot.touch(now);
        Some(found)
    }

    /// Like [`Self::get`] but does not mark the session used (admin views).
    pub fn peek(&self, key: &SessionKey) -> Option<Arc<Entry<T>>> {
        let now = self.tick_at(Instant::now());
        let found = self.map.get(key).map(|e| e.value().clone())?;
        (!self.is_expired(&found, now)).then_some(found)
    }

    /// Removes a session.
    // Only tests read it.
    #[cfg(test)]
    pub(crate) fn remove(&self, key: &SessionKey) -> bool {
        match self.map.remove(key) {
            Some((_, old)) => {
                self.lru.forget(&old.slot);
                true
            }
            None => false,
        }
    }

    /// Drops every session idle for at least the TTL at `now`. Returns how
    /// many were removed.
    pub fn sweep(&self, now: Instant) -> usize {
        let now_tick = self.tick_at(now);
        let mut dropped = Vec::new();
        self.map.retain(|_, e| {
            let keep = !self.is_expired(e, now_tick);
            if !keep {
                dropped.push(Arc::clone(e));
            }
            keep
        });
        self.lru.forget_all(dropped.iter().map(|e| &e.slot));
        let removed = dropped.len();
        self.expired.fetch_add(removed as u64, Ordering::Relaxed);
        removed
    }

    /// Number of sessions held (expired ones count until swept or touched).
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// Whether the store is empty.
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// Sessions evicted for the count limit so far.
    // Only tests read it.
    #[cfg(test)]
    pub(crate) fn evicted_lru(&self) -> u64 {
        self.evicted_lru.load(Ordering::Relaxed)
    }

    /// Sessions dropped for idleness so far.
    // Only tests read it.
    #[cfg(test)]
    pub(crate) fn expired(&self) -> u64 {
        self.expired.load(Ordering::Relaxed)
    }

    /// Evicts least-recently-used sessions until the count limit holds,
    /// never `keep` (the session just created). Sessions somebody is
    /// holding right now (an `Arc` outside the map) are passed over while
    /// idle ones exist, and filed again afterwards; the oldest of them goes
    /// only when every other session is busy. Each step is an O(log n)
    /// index pop, so the cost is bounded by the sessions in flight, not by
    /// the sessions held.
    fn evict_lru(&self, keep: SessionKey) {
        let mut busy: Vec<(SessionKey, Arc<Entry<T>>)> = Vec::new();
        while self.map.len() > self.limits.max_sessions {
            let Some((key, entry)) = self
                .lru
                .pop_oldest(|k| self.map.get(k).map(|e| e.value().clone()), |e| &e.slot)
            else {
                break;
            };
            // One reference in the map, one here: any other is a user.
            if key == keep || Arc::strong_count(&entry) > 2 {
                busy.push((key, entry));
                continue;
            }
            self.evict(&key, &entry);
        }
        let mut busy = busy.into_iter().filter(|(k, _)| *k != keep).peekable();
        if self.map.len() > self.limits.max_sessions {
            // Only busy sessions are left: the oldest of them goes.
            if let Some((key, entry)) = busy.next() {
                self.evict(&key, &entry);
            }
        }
        for (key, entry) in busy {
            self.lru.file(key, &entry.slot);
        }
    }

    fn evict(&self, key: &SessionKey, entry: &Arc<Entry<T>>) {
        if self
            .map
            .remove_if(key, |_, v| Arc::ptr_eq(v, entry))
            .is_some()
        {
            self.lru.forget(&entry.slot);
            self.evicted_lru.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// The `limit` most recently used live sessions, most recent first,
    /// with how long each has been idle (admin listings; never marks a
    /// session used). Reads only the entries' lock-free last-use ticks.
    pub(crate) fn recent(&self, limit: usize) -> Vec<(SessionKey, Arc<Entry<T>>, Duration)> {
        let now = self.tick_at(Instant::now());
        let mut all: Vec<(u64, SessionKey, Arc<Entry<T>>)> = self
            .map
            .iter()
            .filter(|e| !self.is_expired(e.value(), now))
            .map(|e| (e.value().tick(), *e.key(), Arc::clone(e.value())))
            .collect();
        // Most recent first; equal ticks by key, so the order is stable.
        let order = |a: &(u64, SessionKey, _), b: &(u64, SessionKey, _)| {
            b.0.cmp(&a.0).then(a.1.as_u128().cmp(&b.1.as_u128()))
        };
        if limit < all.len() {
            all.select_nth_unstable_by(limit, order);
            all.truncate(limit);
        }
        all.sort_unstable_by(order);
        all.into_iter()
            .map(|(tick, k, e)| (k, e, Duration::from_millis(now.saturating_sub(tick))))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(i: u128) -> SessionKey {
        SessionKey::from_u128(i)
    }

    fn store(ttl_secs: u64, max: usize) -> SessionStore<u32> {
        SessionStore::new(StoreLimits {
            ttl: Duration::from_secs(ttl_secs),
            max_sessions: max,
        })
    }

    #[tokio::test(start_paused = true)]
    async fn get_or_create_returns_the_same_entry() {
        let s = store(60, 10);
        let a = s.get_or_create(key(1), || 7);
        *a.lock().await += 1;
        let b = s.get_or_create(key(1), || 0);
        assert!(Arc::ptr_eq(&a, &b));
        assert_eq!(*b.lock().await, 8);
        assert_eq!(s.len(), 1);
        assert!(s.get(&key(2)).is_none());
    }

    #[tokio::test(start_paused = true)]
    async fn recent_lists_by_last_use_bounded_without_touching() {
        let s = store(60, 10);
        for i in 1..=4 {
            s.get_or_create(key(i), || 0);
            tokio::time::advance(Duration::from_secs(1)).await;
        }
        // Key 2 used last; key 1 the longest ago.
        s.get(&key(2));
        tokio::time::advance(Duration::from_secs(1)).await;
        let order = |v: Vec<(SessionKey, Arc<Entry<u32>>, Duration)>| {
            v.into_iter().map(|(k, _, _)| k).collect::<Vec<_>>()
        };
        assert_eq!(order(s.recent(10)), [key(2), key(4), key(3), key(1)]);
        assert_eq!(order(s.recent(2)), [key(2), key(4)]);
        assert!(s.recent(0).is_empty());
        let idle: Vec<u64> = s.recent(10).iter().map(|r| r.2.as_secs()).collect();
        assert_eq!(idle, [1, 2, 3, 5]);
        // Listing is no use: the order is unchanged, and key 1 still expires.
        assert_eq!(order(s.recent(1)), [key(2)]);
        tokio::time::advance(Duration::from_secs(55)).await;
        assert_eq!(order(s.recent(10)), [key(2), key(4), key(3)]);
    }

    #[tokio::test]
    async fn merge_snapshot_refreshes_members_and_keeps_the_rest() {
        let s = store(60, 10);
        let e = s.get_or_create(key(1), || 0);
        let part = |v: serde_json::Value| v.as_object().cloned().unwrap();
        e.merge_snapshot(&part(serde_json::json!({"a": 1})));
        assert_eq!(e.snapshot(), Some(serde_json::json!({"a": 1})));
        e.set_snapshot(serde_json::json!({"a": 1, "turns": [1, 2]}));
        e.merge_snapshot(&part(serde_json::json!({"a": 2, "b": 3})));
        assert_eq!(
            e.snapshot(),
            Some(serde_json::json!({"a": 2, "b": 3, "turns": [1, 2]}))
        );
    }

    #[tokio::test(start_paused = true)]
    async fn ttl_checked_on_access() {
        let s = store(60, 10);
        s.get_or_create(key(1), || 1);
        tokio::time::advance(Duration::from_secs(59)).await;
        assert!(s.get(&key(1)).is_some(), "touched at 59 s");
        tokio::time::advance(Duration::from_secs(59)).await;
        assert!(s.get(&key(1)).is_some(), "59 s after the last touch");
        tokio::time::advance(Duration::from_secs(60)).await;
        assert!(s.peek(&key(1)).is_none());
        assert!(s.get(&key(1)).is_none());
        assert_eq!(s.len(), 0);
        assert_eq!(s.expired(), 1);
        // Re-creating after expiry starts fresh.
        s.get_or_create(key(2), || 5);
        tokio::time::advance(Duration::from_secs(61)).await;
        let e = s.get_or_create(key(2), || 9);
        assert_eq!(*e.lock().await, 9);
    }

    #[tokio::test(start_paused = true)]
    async fn sweep_removes_only_idle_sessions() {
        let s = store(60, 10);
        s.get_or_create(key(1), || 1);
        tokio::time::advance(Duration::from_secs(30)).await;
        s.get_or_create(key(2), || 2);
        tokio::time::advance(Duration::from_secs(31)).await;
        assert_eq!(s.sweep(Instant::now()), 1);
        assert!(s.peek(&key(1)).is_none());
        assert!(s.peek(&key(2)).is_some());
        assert_eq!(s.sweep(Instant::now() + Duration::from_secs(30)), 1);
        assert!(s.is_empty());
    }

    #[tokio::test(start_paused = true)]
    async fn lru_eviction_at_capacity() {
        let s = store(3600, 3);
        for i in 1..=3 {
            s.get_or_create(key(i), || i as u32);
            tokio::time::advance(Duration::from_secs(1)).await;
        }
        // Touch 1 so 2 becomes the least recently used.
        assert!(s.get(&key(1)).is_some());
        tokio::time::advance(Duration::from_secs(1)).await;
        s.get_or_create(key(4), || 4);
        assert_eq!(s.len(), 3);
        assert!(s.peek(&key(2)).is_none());
        for i in [1, 3, 4] {
            assert!(s.peek(&key(i)).is_some(), "{i}");
        }
        assert_eq!(s.evicted_lru(), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn busy_sessions_are_evicted_last() {
        let s = store(3600, 2);
        let held = s.get_or_create(key(1), || 1);
        tokio::time::advance(Duration::from_secs(1)).await;
        s.get_or_create(key(2), || 2);
        tokio::time::advance(Duration::from_secs(1)).await;
        s.get_or_create(key(3), || 3);
        // 1 is the oldest but in use, so the idle 2 goes.
        assert!(s.peek(&key(1)).is_some());
        assert!(s.peek(&key(2)).is_none());
        drop(held);
    }

    /// The index files exactly the sessions the map holds.
    fn assert_index_matches(s: &SessionStore<u32>) {
        assert_eq!(s.lru.len(), s.map.len());
    }

    #[tokio::test(start_paused = true)]
    async fn eviction_order_is_exact_lru() {
        // A model of LRU next to the store: the same victims, every time.
        let s = store(3600, 8);
        let mut model: Vec<u128> = Vec::new(); // least recent first
        let mut next = 0u128;
        for step in 0..400u32 {
            tokio::time::advance(Duration::from_millis(3)).await;
            // Mostly touch a known session (in a scrambled order), else create one.
            if step % 3 != 0 && !model.is_empty() {
                let k = model[(step as usize * 7919) % model.len()];
                assert!(s.get(&key(k)).is_some());
                model.retain(|&m| m != k);
                model.push(k);
            } else {
                next += 1;
                s.get_or_create(key(next), || 0);
                model.push(next);
                if model.len() > 8 {
                    let victim = model.remove(0);
                    assert!(s.peek(&key(victim)).is_none(), "step {step}: {victim} kept");
                }
            }
            assert_eq!(s.len(), model.len());
            for &k in &model {
                assert!(s.peek(&key(k)).is_some(), "step {step}: {k} evicted");
            }
        }
        assert_index_matches(&s);
    }

    #[tokio::test(start_paused = true)]
    async fn index_follows_removal_expiry_and_sweep() {
        let s = store(60, 100);
        for i in 0..50 {
            s.get_or_create(key(i), || 0);
        }
        assert_index_matches(&s);
        assert!(s.remove(&key(1)));
        assert!(!s.remove(&key(1)));
        assert_index_matches(&s);
        tokio::time::advance(Duration::from_secs(61)).await;
        // Expired on access, re-created after expiry, swept.
        assert!(s.get(&key(2)).is_none());
        s.get_or_create(key(3), || 1);
        assert_index_matches(&s);
        assert_eq!(s.sweep(Instant::now()), 47);
        assert_eq!(s.len(), 1);
        assert_index_matches(&s);
        // Churn below the limit never grows the index past the map.
        for round in 0..20u128 {
            for i in 0..50 {
                s.get_or_create(key(1000 + round * 50 + i), || 0);
            }
            tokio::time::advance(Duration::from_secs(61)).await;
            s.sweep(Instant::now());
            assert_index_matches(&s);
        }
    }

    /// Many threads creating, touching and removing sessions at the limit:
    /// the bound holds and the index keeps exactly the sessions held.
    #[test]
    fn concurrent_churn_at_the_limit_keeps_bound_and_index() {
        let s = Arc::new(store(3600, 64));
        let threads: Vec<_> = (0..4u128)
            .map(|t| {
                let s = Arc::clone(&s);
                std::thread::spawn(move || {
                    for i in 0..3000u128 {
                        let k = key(t * 1_000_000 + i);
                        let held = s.get_or_create(k, || 0);
                        // Revisit an earlier key of this thread now and then.
                        if i % 3 == 0 {
                            s.get(&key(t * 1_000_000 + i / 2));
                        }
                        if i % 7 == 0 {
                            s.remove(&k);
                        }
                        drop(held);
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        assert!(s.len() <= 64, "{} sessions", s.len());
        assert_index_matches(&s);
        assert!(s.evicted_lru() > 0);
    }

    /// Filed sessions examined while creating `n` new sessions in a full
    /// store of `size`, after `touched` of the held sessions were used again
    /// since they were filed. Returns (examined, evicted).
    async fn work_of_new_sessions_when_full(size: usize, touched: usize, n: u128) -> (u64, u64) {
        let s = store(3600, size);
        for i in 0..size as u128 {
            s.get_or_create(key(i), || 0);
        }
        tokio::time::advance(Duration::from_millis(5)).await;
        for i in 0..touched as u128 {
            s.get(&key(i));
        }
        let before = (s.lru.examined(), s.evicted_lru());
        for i in 0..n {
            s.get_or_create(key(size as u128 + i), || 0);
        }
        assert_eq!(s.len(), size);
        assert_index_matches(&s);
        (s.lru.examined() - before.0, s.evicted_lru() - before.1)
    }

    /// A new session in a full store examines one filed session per
    /// eviction, whatever the store's size (each examination is one
    /// O(log n) B-tree pop); a session used since it was filed adds at most
    /// one re-filing, once. Sorting or scanning the sessions would examine
    /// all of them per eviction. (The time this costs is measured in
    /// `benches/state.rs`.)
    #[tokio::test(start_paused = true)]
    async fn eviction_work_does_not_grow_with_the_store() {
        for size in [512, 32 * 512] {
            let (examined, evicted) = work_of_new_sessions_when_full(size, 0, 100).await;
            assert_eq!((examined, evicted), (100, 100), "store of {size}");
            // The 300 oldest were used again: re-filed once each, then the
            // eviction continues with the untouched ones.
            let (examined, evicted) = work_of_new_sessions_when_full(size, 300, 100).await;
            assert_eq!(evicted, 100, "store of {size}");
            assert!(
                examined <= 100 + 300,
                "store of {size}: {examined} examined"
            );
        }
    }

    #[tokio::test]
    async fn concurrent_access_shares_one_entry() {
        let s = Arc::new(store(3600, 100));
        let mut tasks = Vec::new();
        for _ in 0..8 {
            let s = s.clone();
            tasks.push(tokio::spawn(async move {
                for _ in 0..100 {
                    let e = s.get_or_create(key(1), || 0);
                    *e.lock().await += 1;
                    tokio::task::yield_now().await;
                }
            }));
        }
        for t in tasks {
            t.await.unwrap();
        }
        assert_eq!(*s.get(&key(1)).unwrap().lock().await, 800);
    }
}
