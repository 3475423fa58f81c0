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

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use dashmap::mapref::entry::Entry as MapEntry;
use dashmap::DashMap;
use tokio::time::Instant;

use super::key::SessionKey;

/// One session: its state behind an async lock, and when it was last used.
#[derive(Debug)]
pub struct Entry<T> {
    state: tokio::sync::Mutex<T>,
    /// Milliseconds since the store's epoch.
    last_used: AtomicU64,
}

impl<T> Entry<T> {
    fn new(state: T, tick: u64) -> Self {
        Self {
            state: tokio::sync::Mutex::new(state),
            last_used: AtomicU64::new(tick),
        }
    }

    /// The per-session lock.
    pub fn state(&self) -> &tokio::sync::Mutex<T> {
        &self.state
    }

    /// Locks the session state.
    pub async fn lock(&self) -> tokio::sync::MutexGuard<'_, T> {
        self.state.lock().await
    }

    fn tick(&self) -> u64 {
        self.last_used.load(Ordering::Relaxed)
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
    pub fn get_or_create(&self, key: SessionKey, init: impl FnOnce() -> T) -> Arc<Entry<T>> {
        let now = self.tick_at(Instant::now());
        // `init` runs under the shard lock: it must be cheap (it is a
        // constructor of empty state).
        let (entry, created) = match self.map.entry(key) {
            MapEntry::Occupied(mut o) => {
                if self.is_expired(o.get(), now) {
                    self.expired.fetch_add(1, Ordering::Relaxed);
                    let fresh = Arc::new(Entry::new(init(), now));
                    o.insert(fresh.clone());
                    (fresh, true)
                } else {
                    o.get().last_used.store(now, Ordering::Relaxed);
                    (o.get().clone(), false)
                }
            }
            MapEntry::Vacant(v) => {
                let fresh = Arc::new(Entry::new(init(), now));
                v.insert(fresh.clone());
                (fresh, true)
            }
        };
        if created && self.map.len() > self.limits.max_sessions {
            self.evict_lru(Some(key));
        }
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
                self.expired.fetch_add(1, Ordering::Relaxed);
            }
            return None;
        }
        found.last_used.store(now, Ordering::Relaxed);
        Some(found)
    }

    /// Like [`Self::get`] but does not mark the session used (admin views).
    pub fn peek(&self, key: &SessionKey) -> Option<Arc<Entry<T>>> {
        let now = self.tick_at(Instant::now());
        let found = self.map.get(key).map(|e| e.value().clone())?;
        (!self.is_expired(&found, now)).then_some(found)
    }

    /// Removes a session.
    pub fn remove(&self, key: &SessionKey) -> bool {
        self.map.remove(key).is_some()
    }

    /// Drops every session idle for at least the TTL at `now`. Returns how
    /// many were removed.
    pub fn sweep(&self, now: Instant) -> usize {
        let now_tick = self.tick_at(now);
        let before = self.map.len();
        self.map.retain(|_, e| !self.is_expired(e, now_tick));
        let removed = before.saturating_sub(self.map.len());
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
    pub fn evicted_lru(&self) -> u64 {
        self.evicted_lru.load(Ordering::Relaxed)
    }

    /// Sessions dropped for idleness so far.
    pub fn expired(&self) -> u64 {
        self.expired.load(Ordering::Relaxed)
    }

    /// The configured limits.
    pub fn limits(&self) -> StoreLimits {
        self.limits
    }

    /// Evicts least-recently-used sessions until the count limit holds.
    /// Sessions somebody is holding right now (an `Arc` outside the map) are
    /// passed over while idle ones exist. One O(n) scan; it runs only when a
    /// new session pushes the store over its limit.
    fn evict_lru(&self, keep: Option<SessionKey>) {
        let excess = self.map.len().saturating_sub(self.limits.max_sessions);
        if excess == 0 {
            return;
        }
        let mut candidates: Vec<(bool, u64, SessionKey)> = self
            .map
            .iter()
            .filter(|e| Some(*e.key()) != keep)
            .map(|e| (Arc::strong_count(e.value()) > 1, e.value().tick(), *e.key()))
            .collect();
        // Idle before busy, then oldest first.
        candidates.sort_unstable_by_key(|&(busy, tick, _)| (busy, tick));
        for (_, _, key) in candidates.into_iter().take(excess) {
            if self.map.remove(&key).is_some() {
                self.evicted_lru.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    /// Keys of all sessions held (for admin listings).
    pub fn keys(&self) -> Vec<SessionKey> {
        self.map.iter().map(|e| *e.key()).collect()
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
