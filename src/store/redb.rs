//! The embedded backend: one redb file, owner-only.
//!
//! Two tables keyed by (credential fingerprint, prefix hash): the records
//! (JSON of [`StoredRecord`]) and their last use (unix milliseconds). An
//! index of every record's length, size and last use is kept in memory
//! (rebuilt at open), so [`Store::may_have`] and [`Store::touch`] are free
//! and a sweep reads no record. redb does blocking file I/O: every call
//! runs on tokio's blocking pool, never on an async worker.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use redb::{Database, ReadableTable, TableDefinition};

use super::{Store, StoreError, StoredRecord};

type Key = (u128, u128);

const RECORDS: TableDefinition<'static, Key, &'static [u8]> = TableDefinition::new("records");
const TOUCHED: TableDefinition<'static, Key, u64> = TableDefinition::new("touched");
/// Learned windows: `upstream` NUL `model` → tokens.
const WINDOWS: TableDefinition<'static, &'static str, u64> = TableDefinition::new("windows");
const META: TableDefinition<'static, &'static str, u64> = TableDefinition::new("meta");
/// Conversation state by session key: last write (unix ms, 8 bytes LE)
/// followed by the state as put.
const STATES: TableDefinition<'static, u128, &'static [u8]> = TableDefinition::new("states");
/// Under [`META`]: the keyer secret, made at the file's first open.
const SECRET: &str = "keyer_secret";

/// What the in-memory index knows of one stored record.
#[derive(Debug, Clone, Copy)]
struct Meta {
    k: usize,
    size: usize,
    touched: u64,
    /// Used since its last use was written.
    dirty: bool,
}

#[derive(Debug, Default)]
struct Index {
    meta: HashMap<Key, Meta>,
    /// Conversation states and when each was last written.
    states: HashMap<u128, u64>,
    /// Records per prefix length.
    lengths: BTreeMap<usize, usize>,
    bytes: usize,
}

impl Index {
    fn add(&mut self, key: Key, m: Meta) {
        if let Some(old) = self.meta.insert(key, m) {
            self.uncount(&old);
        }
        *self.lengths.entry(m.k).or_insert(0) += 1;
        self.bytes += m.size;
    }

    fn remove(&mut self, key: &Key) {
        if let Some(old) = self.meta.remove(key) {
            self.uncount(&old);
        }
    }

    fn uncount(&mut self, m: &Meta) {
        self.bytes = self.bytes.saturating_sub(m.size);
        if let Some(n) = self.lengths.get_mut(&m.k) {
            *n -= 1;
            if *n == 0 {
                self.lengths.remove(&m.k);
            }
        }
    }
}

/// The redb store.
pub struct RedbStore {
    db: Arc<Database>,
    index: Arc<Mutex<Index>>,
    secret: u64,
    /// Learned windows as read at open.
    windows: Vec<(String, String, u64)>,
    ttl_ms: u64,
    max_bytes: usize,
}

fn backend(e: impl std::fmt::Display) -> StoreError {
    StoreError::Backend(e.to_string())
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

fn lock(index: &Mutex<Index>) -> MutexGuard<'_, Index> {
    // Every update leaves the index consistent: a poisoned lock's data is good.
    index.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Creates the directory (0700) and the file (0600) before redb opens it.
fn prepare_file(path: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        if !dir.exists() {
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(dir)?;
        }
    }
    std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o600)
        .open(path)?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))
}

impl RedbStore {
    /// Opens (or creates) the file and rebuilds the index. Blocking: call
    /// it at start-up, before serving.
    pub fn open(path: &Path, ttl: Duration, max_bytes: usize) -> Result<Self, StoreError> {
        prepare_file(path).map_err(backend)?;
        let mut db = Database::builder()
            .set_cache_size(16 << 20)
            .create(path)
            .map_err(backend)?;
        let (mut index, secret) = load(&db)?;
        let windows = load_windows(&db)?;
        let ttl_ms = u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX);
        let max_bytes = max_bytes.max(1);
        // What expired while the process was down goes now, and the file
        // gives the space back: redb reuses freed pages but never shrinks
        // the file by itself, and only at open does nothing else hold it.
        let plan = plan_sweep(&mut index, now_ms(), ttl_ms, max_bytes);
        if !(plan.gone.is_empty() && plan.states.is_empty()) {
            write_sweep(&db, &plan)?;
            db.compact().map_err(backend)?;
        }
        Ok(Self {
            db: Arc::new(db),
            index: Arc::new(Mutex::new(index)),
            secret,
            windows,
            ttl_ms,
            max_bytes,
        })
    }

    /// Records held (in the index).
    pub fn len(&self) -> usize {
        lock(&self.index).meta.len()
    }

    /// Whether no record is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bytes the records hold (by [`StoredRecord::size`]).
    pub fn bytes(&self) -> usize {
        lock(&self.index).bytes
    }

    async fn blocking<T, F>(&self, f: F) -> Result<T, StoreError>
    where
        T: Send + 'static,
        F: FnOnce(&Database, &Mutex<Index>) -> Result<T, StoreError> + Send + 'static,
    {
        let db = Arc::clone(&self.db);
        let index = Arc::clone(&self.index);
        tokio::task::spawn_blocking(move || f(&db, &index))
            .await
            .map_err(backend)?
    }
}

/// Rebuilds the index and reads (or makes) the keyer secret.
fn load(db: &Database) -> Result<(Index, u64), StoreError> {
    let tx = db.begin_write().map_err(backend)?;
    let mut index = Index::default();
    let secret;
    {
        let mut meta = tx.open_table(META).map_err(backend)?;
        let found = meta.get(SECRET).map_err(backend)?.map(|v| v.value());
        secret = match found {
            Some(s) => s,
            None => {
                use std::hash::{BuildHasher, Hasher};
                let s = std::collections::hash_map::RandomState::new()
                    .build_hasher()
                    .finish();
                meta.insert(SECRET, s).map_err(backend)?;
                s
            }
        };
    }
    {
        // Opened in a write transaction so a new file gets its tables.
        let states = tx.open_table(STATES).map_err(backend)?;
        for row in states.iter().map_err(backend)? {
            let (key, value) = row.map_err(backend)?;
            index.states.insert(key.value(), written_at(value.value()));
        }
        let records = tx.open_table(RECORDS).map_err(backend)?;
        let touched = tx.open_table(TOUCHED).map_err(backend)?;
        for row in records.iter().map_err(backend)? {
            let (key, value) = row.map_err(backend)?;
            let key = key.value();
            let Ok(rec) = serde_json::from_slice::<StoredRecord>(value.value()) else {
                continue;
            };
            let when = touched.get(key).map_err(backend)?.map_or(0, |v| v.value());
            index.add(
                key,
                Meta {
                    k: rec.k,
                    size: rec.size(),
                    touched: when,
                    dirty: false,
                },
            );
        }
    }
    tx.commit().map_err(backend)?;
    Ok((index, secret))
}

fn window_key(upstream: &str, model: &str) -> String {
    format!("{upstream}\0{model}")
}

fn load_windows(db: &Database) -> Result<Vec<(String, String, u64)>, StoreError> {
    let tx = db.begin_write().map_err(backend)?;
    let mut out = Vec::new();
    {
        let table = tx.open_table(WINDOWS).map_err(backend)?;
        for row in table.iter().map_err(backend)? {
            let (key, tokens) = row.map_err(backend)?;
            if let Some((u, m)) = key.value().split_once('\0') {
                out.push((u.to_owned(), m.to_owned(), tokens.value()));
            }
        }
    }
    tx.commit().map_err(backend)?;
    Ok(out)
}

/// Reads the longest match among `lengths` (longest first).
fn read_longest(
    db: &Database,
    cred: u128,
    hashes: &[u128],
    lengths: &[usize],
) -> Result<Option<StoredRecord>, StoreError> {
    let tx = db.begin_read().map_err(backend)?;
    let records = tx.open_table(RECORDS).map_err(backend)?;
    for &k in lengths {
        let Some(value) = records.get((cred, hashes[k - 1])).map_err(backend)? else {
            continue;
        };
        let rec: StoredRecord =
            serde_json::from_slice(value.value()).map_err(|_| StoreError::Corrupt)?;
        if rec.k == k {
            return Ok(Some(rec));
        }
    }
    Ok(None)
}

/// The write time in front of a stored state.
fn written_at(value: &[u8]) -> u64 {
    value
        .get(..8)
        .and_then(|b| <[u8; 8]>::try_from(b).ok())
        .map_or(0, u64::from_le_bytes)
}

/// What one sweep removes and writes.
struct SweepPlan {
    /// Records dropped (expired, or over the byte bound).
    gone: Vec<Key>,
    /// Last uses to write.
    dirty: Vec<(Key, u64)>,
    /// Conversation states expired.
    states: Vec<u128>,
}

/// Carries out a sweep plan in one transaction.
fn write_sweep(db: &Database, plan: &SweepPlan) -> Result<(), StoreError> {
    let tx = db.begin_write().map_err(backend)?;
    {
        let mut records = tx.open_table(RECORDS).map_err(backend)?;
        let mut touched = tx.open_table(TOUCHED).map_err(backend)?;
        for key in &plan.gone {
            records.remove(*key).map_err(backend)?;
            touched.remove(*key).map_err(backend)?;
        }
        for (key, when) in &plan.dirty {
            touched.insert(*key, *when).map_err(backend)?;
        }
        let mut states = tx.open_table(STATES).map_err(backend)?;
        for key in &plan.states {
            states.remove(*key).map_err(backend)?;
        }
    }
    tx.commit().map_err(backend)
}

/// What a sweep at `now` drops (expired first, then the least recently
/// used while over the byte bound) and which last uses it writes.
fn plan_sweep(index: &mut Index, now: u64, ttl_ms: u64, max_bytes: usize) -> SweepPlan {
    let mut gone: Vec<Key> = index
        .meta
        .iter()
        .filter(|(_, m)| now.saturating_sub(m.touched) > ttl_ms)
        .map(|(k, _)| *k)
        .collect();
    for key in &gone {
        index.remove(key);
    }
    if index.bytes > max_bytes {
        let mut by_age: Vec<(u64, Key)> = index.meta.iter().map(|(k, m)| (m.touched, *k)).collect();
        by_age.sort_unstable();
        for (_, key) in by_age {
            if index.bytes <= max_bytes {
                break;
            }
            index.remove(&key);
            gone.push(key);
        }
    }
    let dirty = index
        .meta
        .iter_mut()
        .filter(|(_, m)| m.dirty)
        .map(|(k, m)| {
            m.dirty = false;
            (*k, m.touched)
        })
        .collect();
    let states: Vec<u128> = index
        .states
        .iter()
        .filter(|(_, at)| now.saturating_sub(**at) > ttl_ms)
        .map(|(k, _)| *k)
        .collect();
    for k in &states {
        index.states.remove(k);
    }
    SweepPlan {
        gone,
        dirty,
        states,
    }
}

#[async_trait::async_trait]
impl Store for RedbStore {
    fn name(&self) -> &'static str {
        "redb"
    }

    fn keyer_secret(&self) -> Option<u64> {
        Some(self.secret)
    }

    fn may_have(&self, len: usize) -> bool {
        lock(&self.index)
            .lengths
            .first_key_value()
            .is_some_and(|(k, _)| *k <= len)
    }

    fn touch(&self, cred: u128, prefix_hash: u128) {
        if let Some(m) = lock(&self.index).meta.get_mut(&(cred, prefix_hash)) {
            m.touched = now_ms();
            m.dirty = true;
        }
    }

    async fn find(&self, cred: u128, hashes: &[u128]) -> Result<Option<StoredRecord>, StoreError> {
        if hashes.is_empty() {
            return Ok(None);
        }
        // Longest first: a later compaction covers more of the history.
        let lengths: Vec<usize> = lock(&self.index)
            .lengths
            .range(1..=hashes.len())
            .rev()
            .map(|(k, _)| *k)
            .collect();
        if lengths.is_empty() {
            return Ok(None);
        }
        let hashes = hashes.to_vec();
        let ttl_ms = self.ttl_ms;
        self.blocking(move |db, index| {
            let found = read_longest(db, cred, &hashes, &lengths)?;
            let Some(rec) = found else { return Ok(None) };
            let mut index = lock(index);
            let key = (cred, rec.prefix_hash);
            let now = now_ms();
            match index.meta.get_mut(&key) {
                Some(m) if now.saturating_sub(m.touched) <= ttl_ms => {
                    m.touched = now;
                    m.dirty = true;
                    Ok(Some(rec))
                }
                // Expired (the sweep drops it) or dropped meanwhile.
                _ => Ok(None),
            }
        })
        .await
    }

    async fn put(&self, cred: u128, record: StoredRecord) -> Result<(), StoreError> {
        let bytes = serde_json::to_vec(&record).map_err(backend)?;
        let size = record.size();
        if size > self.max_bytes {
            return Ok(());
        }
        let key = (cred, record.prefix_hash);
        let k = record.k;
        self.blocking(move |db, index| {
            let now = now_ms();
            let tx = db.begin_write().map_err(backend)?;
            {
                let mut records = tx.open_table(RECORDS).map_err(backend)?;
                records.insert(key, bytes.as_slice()).map_err(backend)?;
                let mut touched = tx.open_table(TOUCHED).map_err(backend)?;
                touched.insert(key, now).map_err(backend)?;
            }
            tx.commit().map_err(backend)?;
            lock(index).add(
                key,
                Meta {
                    k,
                    size,
                    touched: now,
                    dirty: false,
                },
            );
            Ok(())
        })
        .await
    }

    fn windows(&self) -> Vec<(String, String, u64)> {
        self.windows.clone()
    }

    async fn put_window(&self, upstream: &str, model: &str, tokens: u64) -> Result<(), StoreError> {
        let key = window_key(upstream, model);
        self.blocking(move |db, _| {
            let tx = db.begin_write().map_err(backend)?;
            tx.open_table(WINDOWS)
                .map_err(backend)?
                .insert(key.as_str(), tokens)
                .map_err(backend)?;
            tx.commit().map_err(backend)
        })
        .await
    }

    async fn sweep(&self) -> Result<(), StoreError> {
        let plan = plan_sweep(
            &mut lock(&self.index),
            now_ms(),
            self.ttl_ms,
            self.max_bytes,
        );
        if plan.gone.is_empty() && plan.dirty.is_empty() && plan.states.is_empty() {
            return Ok(());
        }
        self.blocking(move |db, _| write_sweep(db, &plan)).await
    }

    async fn get_state(&self, session: u128) -> Result<Option<Vec<u8>>, StoreError> {
        let ttl_ms = self.ttl_ms;
        self.blocking(move |db, _| {
            let tx = db.begin_read().map_err(backend)?;
            let table = tx.open_table(STATES).map_err(backend)?;
            let Some(v) = table.get(session).map_err(backend)? else {
                return Ok(None);
            };
            let v = v.value();
            if now_ms().saturating_sub(written_at(v)) > ttl_ms {
                return Ok(None);
            }
            Ok(v.get(8..).map(<[u8]>::to_vec))
        })
        .await
    }

    async fn put_state(&self, session: u128, state: Vec<u8>) -> Result<(), StoreError> {
        self.blocking(move |db, index| {
            let now = now_ms();
            let mut value = now.to_le_bytes().to_vec();
            value.extend_from_slice(&state);
            let tx = db.begin_write().map_err(backend)?;
            tx.open_table(STATES)
                .map_err(backend)?
                .insert(session, value.as_slice())
                .map_err(backend)?;
            tx.commit().map_err(backend)?;
            lock(index).states.insert(session, now);
            Ok(())
        })
        .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(k: usize, h: u128, text: &str) -> StoredRecord {
        StoredRecord {
            k,
            prefix_hash: h,
            replacement: vec![text.to_owned()],
            original_tokens: 100,
            replacement_tokens: 10,
            summary_rows: None,
        }
    }

    fn open(path: &Path) -> RedbStore {
        RedbStore::open(path, Duration::from_secs(60), 1 << 20).unwrap()
    }

    #[tokio::test]
    async fn records_survive_reopen_and_stay_scoped_by_credential() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sub/state.redb");
        {
            let s = open(&path);
            assert!(!s.may_have(10));
            s.put(1, rec(2, 22, "{\"a\":\"é\"}")).await.unwrap();
            s.put(1, rec(4, 44, "{\"b\":2}")).await.unwrap();
            assert!(s.may_have(2) && !s.may_have(1));
        }
        let secret = open(&path).keyer_secret();
        let s = open(&path);
        assert_eq!(s.keyer_secret(), secret, "the secret outlives the process");
        assert_eq!(s.len(), 2);
        let hit = s.find(1, &[11, 22, 33, 44, 55]).await.unwrap().unwrap();
        assert_eq!(hit, rec(4, 44, "{\"b\":2}"));
        assert_eq!(s.find(1, &[11, 22, 99]).await.unwrap().unwrap().k, 2);
        assert!(s.find(2, &[11, 22, 33, 44]).await.unwrap().is_none());
        assert!(s.find(1, &[]).await.unwrap().is_none());
    }

    #[tokio::test]
    async fn learned_windows_survive_reopen() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("state.redb");
        {
            let s = open(&path);
            assert!(s.windows().is_empty());
            s.put_window("http://u:1", "m", 4096).await.unwrap();
            s.put_window("http://u:1", "m", 8192).await.unwrap();
        }
        assert_eq!(
            open(&path).windows(),
            vec![("http://u:1".into(), "m".into(), 8192)]
        );
    }

    #[tokio::test]
    async fn file_is_owner_only() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("new/state.redb");
        let _s = open(&path);
        let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode(&path), 0o600);
        assert_eq!(mode(path.parent().unwrap()), 0o700);
    }

    #[tokio::test]
    async fn a_second_process_cannot_share_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("state.redb");
        let _s = open(&path);
        assert!(RedbStore::open(&path, Duration::from_secs(60), 1 << 20).is_err());
    }

    #[tokio::test]
    async fn conversation_state_survives_reopen_and_expires() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("state.redb");
        {
            let s = open(&path);
            assert_eq!(s.get_state(7).await.unwrap(), None);
            s.put_state(7, b"one".to_vec()).await.unwrap();
            s.put_state(7, b"two".to_vec()).await.unwrap();
        }
        {
            let s = open(&path);
            assert_eq!(s.get_state(7).await.unwrap().as_deref(), Some(&b"two"[..]));
            assert_eq!(s.get_state(8).await.unwrap(), None);
        }
        std::thread::sleep(Duration::from_millis(250));
        // Reopened with a TTL shorter than the time since the write.
        let s = RedbStore::open(&path, Duration::from_millis(200), 1 << 20).unwrap();
        assert_eq!(s.get_state(7).await.unwrap(), None, "expired");
        assert!(lock(&s.index).states.is_empty(), "dropped at open");
    }

    #[tokio::test]
    async fn the_file_shrinks_at_open_after_many_records_expired() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("state.redb");
        {
            let s = RedbStore::open(&path, Duration::from_millis(200), 64 << 20).unwrap();
            let text = "y".repeat(4000);
            for h in 0..2000u128 {
                s.put(h % 7, rec(3, h, &text)).await.unwrap();
            }
            s.put_state(1, vec![b'z'; 1000]).await.unwrap();
        }
        let full = std::fs::metadata(&path).unwrap().len();
        assert!(full > 8 << 20, "{full}");
        std::thread::sleep(Duration::from_millis(250));
        let s = RedbStore::open(&path, Duration::from_millis(200), 64 << 20).unwrap();
        assert!(s.is_empty());
        let after = std::fs::metadata(&path).unwrap().len();
        assert!(after < full / 4, "{full} → {after}");
        drop(s);
        // And the shrunk file is a good one.
        let s = RedbStore::open(&path, Duration::from_secs(60), 1 << 20).unwrap();
        s.put(1, rec(1, 1, "{}")).await.unwrap();
        assert!(s.find(1, &[1]).await.unwrap().is_some());
    }

    #[tokio::test]
    async fn sweep_drops_expired_and_bounds_bytes_oldest_first() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("state.redb");
        let s = RedbStore::open(&path, Duration::from_millis(200), 3000).unwrap();
        for h in 1..=3u128 {
            s.put(1, rec(1, h, &"x".repeat(900))).await.unwrap();
            std::thread::sleep(Duration::from_millis(3));
        }
        s.touch(1, 1);
        s.put(1, rec(1, 4, &"x".repeat(900))).await.unwrap();
        s.sweep().await.unwrap();
        assert!(s.bytes() <= 3000);
        assert!(s.find(1, &[2]).await.unwrap().is_none(), "oldest dropped");
        assert!(s.find(1, &[1]).await.unwrap().is_some(), "touched kept");
        std::thread::sleep(Duration::from_millis(250));
        assert!(s.find(1, &[1]).await.unwrap().is_none(), "expired");
        s.sweep().await.unwrap();
        assert!(s.is_empty());
        drop(s);
        assert!(open(&path).is_empty(), "the sweep reached the file");
    }
}
