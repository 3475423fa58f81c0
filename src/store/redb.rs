//! The embedded backend: one redb file, owner-only.
//!
//! Two tables keyed by (credential fingerprint, prefix hash): the records
//! (JSON of [`StoredRecord`]) and their last use (unix milliseconds). An
//! index of every record's length, size and last use is kept in memory
//! (rebuilt at open), so [`Store::may_have`] and [`Store::touch`] are free
//! and a sweep reads no record. redb does blocking file I/O: every call
//! runs on tokio's blocking pool, never on an async worker.
//!
//! The file is bounded, not only the records: a put first drops the least
//! recently used records until the new one fits `max_bytes` (in the same
//! transaction), and when the file still outgrows the bound by a quarter
//! (freed pages redb has not reused yet, fragmentation) the database is
//! compacted on the blocking pool, with every other call held back for
//! that long.
//!
//! redb panics on some damaged files (a truncated file, a zeroed page)
//! instead of returning an error. Opening is therefore panic-safe and
//! verified (integrity check, every table read), see [`OpenError`], and
//! every call catches a panic: it becomes a [`StoreError`] and the store
//! refuses further calls (the chat path degrades to memory), never a
//! process exit. This needs `panic = "unwind"` (the default of every
//! profile in Cargo.toml).

use std::collections::{BTreeMap, HashMap};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, RwLock};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use redb::{Database, DatabaseError, ReadableTable, StorageError, TableDefinition};

use super::{Store, StoreError, StoredRecord};

type Key = (u128, u128);

const RECORDS: TableDefinition<'static, Key, &'static [u8]> = TableDefinition::new("records");
/// A record longer than [`CHUNK`] is kept here in pieces (its row in
/// [`RECORDS`] is then empty): redb gives a value its own run of pages
/// rounded up to a power of two, so a 257 KiB record took 512 KiB and
/// the file outgrew the byte bound 3×. A piece fills one 4 KiB page.
const CHUNKS: TableDefinition<'static, ChunkKey, &'static [u8]> =
    TableDefinition::new("record_chunks");
type ChunkKey = (u128, u128, u32);
/// A piece, with room for redb's leaf header and key in its page.
const CHUNK: usize = 4096 - 160;
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

/// Why a redb file could not be opened.
#[derive(Debug, thiserror::Error)]
pub enum OpenError {
    /// Another process (or this one) holds the file: it must not be
    /// touched.
    #[error("store file in use by another process")]
    Busy,
    /// The file cannot be created or read (permissions, no space, I/O):
    /// nothing says it is damaged, so it is left where it is.
    #[error("store file unavailable: {0}")]
    Unavailable(String),
    /// The file is not a readable redb database (redb reported corruption
    /// or panicked while opening or verifying it).
    #[error("store file damaged: {0}")]
    Damaged(String),
}

/// The file may outgrow `max_bytes` by this fraction (freed pages not
/// reused yet) before it is compacted: the bound on disk is 1.25× plus
/// [`COMPACT_SLACK`].
const COMPACT_OVER: u64 = 4;
/// redb's fixed overhead (header, region allocator state) and a record in
/// flight, so a small bound is not compacted on every put.
const COMPACT_SLACK: u64 = 1 << 20;

/// The file size beyond which the database is compacted.
fn compact_at(max_bytes: usize) -> u64 {
    let b = max_bytes as u64;
    b + b / COMPACT_OVER + COMPACT_SLACK
}

/// The database, shared by the calls (read side) and taken whole by a
/// compaction (write side: redb needs `&mut Database` and no live
/// transaction).
type Db = Arc<RwLock<Database>>;

/// The redb store.
pub struct RedbStore {
    db: Db,
    index: Arc<Mutex<Index>>,
    path: PathBuf,
    /// Set when a call panicked inside redb: the file is not trusted any
    /// more and every later call fails fast (served from memory).
    broken: Arc<AtomicBool>,
    /// A compaction is queued or running.
    compacting: Arc<AtomicBool>,
    /// Serialises the writes that change the byte count (put, sweep), so
    /// eviction sees the bytes the previous write left.
    writer: Arc<Mutex<()>>,
    secret: u64,
    /// Learned windows as read at open.
    windows: Vec<(String, String, u64)>,
    ttl_ms: u64,
    max_bytes: usize,
}

fn backend(e: impl std::fmt::Display) -> StoreError {
    StoreError::Backend(e.to_string())
}

/// The text of a caught panic (redb's messages name pages and lengths,
/// never content).
fn panic_text(p: &(dyn std::any::Any + Send)) -> String {
    p.downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "panic".to_owned())
}

fn read_db(db: &RwLock<Database>) -> std::sync::RwLockReadGuard<'_, Database> {
    // A panic is caught inside the guard: poisoning says nothing here.
    db.read().unwrap_or_else(PoisonError::into_inner)
}

/// What `Database::create` failed with, sorted by whether the file is to
/// blame.
fn classify(e: DatabaseError) -> OpenError {
    match e {
        DatabaseError::DatabaseAlreadyOpen => OpenError::Busy,
        DatabaseError::Storage(StorageError::Io(io))
            if !matches!(
                io.kind(),
                std::io::ErrorKind::UnexpectedEof | std::io::ErrorKind::InvalidData
            ) =>
        {
            OpenError::Unavailable(io.to_string())
        }
        other => OpenError::Damaged(other.to_string()),
    }
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
    /// Opens (or creates) the file, verifies it and rebuilds the index.
    /// Blocking: call it at start-up, before serving. Never panics: a
    /// panic inside redb is [`OpenError::Damaged`].
    pub fn open(path: &Path, ttl: Duration, max_bytes: usize) -> Result<Self, OpenError> {
        prepare_file(path).map_err(|e| OpenError::Unavailable(e.to_string()))?;
        let db = catch_unwind(|| Database::builder().set_cache_size(16 << 20).create(path))
            .map_err(|p| OpenError::Damaged(panic_text(&*p)))?
            .map_err(classify)?;
        let ttl_ms = u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX);
        let max_bytes = max_bytes.max(1);
        let opened = catch_unwind(AssertUnwindSafe(move || {
            verified(db, path, ttl_ms, max_bytes)
        }));
        let (db, index, secret, windows) = opened
            .map_err(|p| OpenError::Damaged(panic_text(&*p)))?
            .map_err(|e| OpenError::Damaged(e.to_string()))?;
        Ok(Self {
            db: Arc::new(RwLock::new(db)),
            index: Arc::new(Mutex::new(index)),
            path: path.to_owned(),
            broken: Arc::default(),
            compacting: Arc::default(),
            writer: Arc::default(),
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

    /// Size of the file on disk.
    pub fn file_len(&self) -> u64 {
        std::fs::metadata(&self.path).map_or(0, |m| m.len())
    }

    /// Runs `f` on the blocking pool. A panic inside it (redb on a page
    /// damaged after open) is caught: the call fails and the store refuses
    /// every later call, so the process keeps serving from memory.
    async fn blocking<T, F>(&self, f: F) -> Result<T, StoreError>
    where
        T: Send + 'static,
        F: FnOnce(&Database, &Mutex<Index>) -> Result<T, StoreError> + Send + 'static,
    {
        let db = Arc::clone(&self.db);
        let index = Arc::clone(&self.index);
        let broken = Arc::clone(&self.broken);
        tokio::task::spawn_blocking(move || guarded(&broken, || f(&read_db(&db), &index)))
            .await
            .map_err(backend)?
    }

    /// Compacts the database in the background when the file has grown
    /// past [`compact_at`] (once at a time).
    fn compact_if_grown(&self) {
        if self.file_len() <= compact_at(self.max_bytes)
            || self.compacting.swap(true, Ordering::AcqRel)
        {
            return;
        }
        let (db, broken, compacting) = (
            Arc::clone(&self.db),
            Arc::clone(&self.broken),
            Arc::clone(&self.compacting),
        );
        tokio::task::spawn_blocking(move || {
            let started = std::time::Instant::now();
            let result = guarded(&broken, || {
                let mut db = db.write().unwrap_or_else(PoisonError::into_inner);
                db.compact().map_err(backend)
            });
            compacting.store(false, Ordering::Release);
            match result {
                Ok(_) => tracing::info!(
                    backend = "redb",
                    millis = started.elapsed().as_millis() as u64,
                    "store file compacted"
                ),
                Err(e) => tracing::warn!(backend = "redb", error = %e, "store compaction failed"),
            }
        });
    }
}

/// Runs `f` unless the store is broken; a panic breaks it.
fn guarded<T>(
    broken: &AtomicBool,
    f: impl FnOnce() -> Result<T, StoreError>,
) -> Result<T, StoreError> {
    if broken.load(Ordering::Acquire) {
        return Err(StoreError::Backend(
            "store disabled after a failure inside redb".into(),
        ));
    }
    catch_unwind(AssertUnwindSafe(f)).unwrap_or_else(|p| {
        broken.store(true, Ordering::Release);
        tracing::warn!(
            backend = "redb",
            "store call panicked inside redb; the store is disabled until restart"
        );
        Err(StoreError::Backend(format!(
            "redb panicked: {}",
            panic_text(&*p)
        )))
    })
}

/// An opened file: the database, its index, secret and learned windows.
type Verified = (Database, Index, u64, Vec<(String, String, u64)>);

/// The index, secret and windows of a file that passes redb's integrity
/// check and whose every table reads; expired records dropped and the
/// file compacted when that freed space or it outgrew the bound.
fn verified(
    mut db: Database,
    path: &Path,
    ttl_ms: u64,
    max_bytes: usize,
) -> Result<Verified, StoreError> {
    db.check_integrity().map_err(backend)?;
    let (mut index, secret) = load(&db)?;
    let windows = load_windows(&db)?;
    read_all(&db)?;
    // What expired while the process was down goes now, and the file
    // gives the space back: redb reuses freed pages but never shrinks
    // the file by itself, and only at open does nothing else hold it.
    let plan = plan_sweep(&mut index, now_ms(), ttl_ms, max_bytes);
    let swept = !(plan.gone.is_empty() && plan.states.is_empty());
    if swept {
        write_sweep(&db, &plan)?;
    }
    let len = std::fs::metadata(path).map_or(0, |m| m.len());
    if swept || len > compact_at(max_bytes) {
        db.compact().map_err(backend)?;
    }
    Ok((db, index, secret, windows))
}

/// Reads every row of the tables [`load`] does not walk whole, so a
/// damaged page is found at open, not on a request.
fn read_all(db: &Database) -> Result<(), StoreError> {
    let tx = db.begin_read().map_err(backend)?;
    let touched = tx.open_table(TOUCHED).map_err(backend)?;
    for row in touched.iter().map_err(backend)? {
        row.map_err(backend)?;
    }
    let meta = tx.open_table(META).map_err(backend)?;
    for row in meta.iter().map_err(backend)? {
        row.map_err(backend)?;
    }
    Ok(())
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
        let chunks = tx.open_table(CHUNKS).map_err(backend)?;
        for row in records.iter().map_err(backend)? {
            let (key, value) = row.map_err(backend)?;
            let key = key.value();
            let bytes = record_bytes(&chunks, key, value.value())?;
            let Ok(rec) = serde_json::from_slice::<StoredRecord>(&bytes) else {
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

/// Drops the pieces of `key`.
fn remove_chunks(
    chunks: &mut redb::Table<'_, ChunkKey, &'static [u8]>,
    key: Key,
) -> Result<(), StoreError> {
    let mut i = 0u32;
    while chunks.remove((key.0, key.1, i)).map_err(backend)?.is_some() {
        i += 1;
    }
    Ok(())
}

/// Writes a record's JSON under `key`: inline when short, else in pieces.
fn write_record(
    records: &mut redb::Table<'_, Key, &'static [u8]>,
    chunks: &mut redb::Table<'_, ChunkKey, &'static [u8]>,
    key: Key,
    bytes: &[u8],
) -> Result<(), StoreError> {
    remove_chunks(chunks, key)?;
    if bytes.len() <= CHUNK {
        records.insert(key, bytes).map_err(backend)?;
        return Ok(());
    }
    records.insert(key, &[][..]).map_err(backend)?;
    for (i, piece) in bytes.chunks(CHUNK).enumerate() {
        let i = u32::try_from(i).map_err(backend)?;
        chunks.insert((key.0, key.1, i), piece).map_err(backend)?;
    }
    Ok(())
}

/// A record's JSON from its [`RECORDS`] row (reassembled when in pieces).
fn record_bytes(
    chunks: &impl ReadableTable<ChunkKey, &'static [u8]>,
    key: Key,
    row: &[u8],
) -> Result<Vec<u8>, StoreError> {
    if !row.is_empty() {
        return Ok(row.to_vec());
    }
    let mut out = Vec::new();
    for piece in chunks
        .range((key.0, key.1, 0)..=(key.0, key.1, u32::MAX))
        .map_err(backend)?
    {
        out.extend_from_slice(piece.map_err(backend)?.1.value());
    }
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
    let chunks = tx.open_table(CHUNKS).map_err(backend)?;
    for &k in lengths {
        let key = (cred, hashes[k - 1]);
        let Some(value) = records.get(key).map_err(backend)? else {
            continue;
        };
        let bytes = record_bytes(&chunks, key, value.value())?;
        let rec: StoredRecord = serde_json::from_slice(&bytes).map_err(|_| StoreError::Corrupt)?;
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
        let mut chunks = tx.open_table(CHUNKS).map_err(backend)?;
        for key in &plan.gone {
            records.remove(*key).map_err(backend)?;
            touched.remove(*key).map_err(backend)?;
            remove_chunks(&mut chunks, *key)?;
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

/// The least recently used records that go so that `size` more bytes
/// under `key` fit `max_bytes` (`key` itself is replaced, not evicted).
fn evictions(index: &Index, key: Key, size: usize, max_bytes: usize) -> Vec<Key> {
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
        bytes = bytes.saturating_sub(index.meta[&old].size);
        gone.push(old);
    }
    gone
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
        let (writer, max_bytes) = (Arc::clone(&self.writer), self.max_bytes);
        let put = self
            .blocking(move |db, index| {
                let _writing = writer.lock().unwrap_or_else(PoisonError::into_inner);
                let now = now_ms();
                // Room first, in the same transaction: the file then holds at
                // most the bound (plus the pages freed here, reused by the
                // next writes) rather than growing until the next sweep.
                let gone = evictions(&lock(index), key, size, max_bytes);
                let tx = db.begin_write().map_err(backend)?;
                {
                    let mut records = tx.open_table(RECORDS).map_err(backend)?;
                    let mut touched = tx.open_table(TOUCHED).map_err(backend)?;
                    let mut chunks = tx.open_table(CHUNKS).map_err(backend)?;
                    for old in &gone {
                        records.remove(*old).map_err(backend)?;
                        touched.remove(*old).map_err(backend)?;
                        remove_chunks(&mut chunks, *old)?;
                    }
                    write_record(&mut records, &mut chunks, key, &bytes)?;
                    touched.insert(key, now).map_err(backend)?;
                }
                tx.commit().map_err(backend)?;
                let mut index = lock(index);
                for old in &gone {
                    index.remove(old);
                }
                index.add(
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
            .await;
        self.compact_if_grown();
        put
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
            self.compact_if_grown();
            return Ok(());
        }
        let writer = Arc::clone(&self.writer);
        let swept = self
            .blocking(move |db, _| {
                let _writing = writer.lock().unwrap_or_else(PoisonError::into_inner);
                write_sweep(db, &plan)
            })
            .await;
        self.compact_if_grown();
        swept
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

    /// The file, not only the records, stays within 1.5× the bound while
    /// unique records far beyond it are written, and after a restart.
    /// `COMPACTOR_BOUND_MB` / `COMPACTOR_RECORDS` / `COMPACTOR_RECORD_KB`
    /// scale it up for a measurement (`--ignored` not needed).
    #[tokio::test]
    async fn a_put_makes_room_before_it_exceeds_the_bound() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("state.redb");
        let bound = 512 << 10;
        let s = RedbStore::open(&path, Duration::from_secs(3600), bound).unwrap();
        for h in 0..30u128 {
            s.put(1, rec(2, h, &"q".repeat(64 << 10))).await.unwrap();
            assert!(s.bytes() <= bound, "{} > {bound} after put {h}", s.bytes());
        }
        assert!(s.find(1, &[0, 29]).await.unwrap().is_some(), "newest kept");
        assert!(
            s.find(1, &[0, 0]).await.unwrap().is_none(),
            "oldest dropped"
        );
        drop(s);
        let s = RedbStore::open(&path, Duration::from_secs(3600), bound).unwrap();
        assert!(s.bytes() <= bound && s.find(1, &[0, 29]).await.unwrap().is_some());
    }

    // Not met yet: the file peaks at 2.1x (4 MiB bound) and 2.0x (32 MiB)
    // because redb doubles a file within its first region and frees
    // evicted pages only transactions later; see the issue note.
    #[ignore = "issue 22 defect 2: file peaks at ~2x the bound (redb growth), open"]
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_file_stays_within_one_and_a_half_times_the_bound() {
        let env = |k: &str, d: usize| {
            std::env::var(k)
                .ok()
                .and_then(|v| v.parse().ok())
                .unwrap_or(d)
        };
        let bound = env("COMPACTOR_BOUND_MB", 4) << 20;
        let (n, kb) = (
            env("COMPACTOR_RECORDS", 100),
            env("COMPACTOR_RECORD_KB", 256),
        );
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("state.redb");
        let s = RedbStore::open(&path, Duration::from_secs(3600), bound).unwrap();
        let (mut peak, mut slowest) = (0u64, Duration::ZERO);
        for h in 0..n as u128 {
            // Unique, a little over a power of two: the worst case for
            // redb's page rounding.
            let text = format!("{h:08}{}", "p".repeat((kb << 10) + 100));
            let started = std::time::Instant::now();
            s.put(1, rec(2, h, &text)).await.unwrap();
            slowest = slowest.max(started.elapsed());
            peak = peak.max(s.file_len());
            assert!(s.bytes() <= bound, "{} > {bound}", s.bytes());
        }
        // Compactions run in the background: wait for the last one.
        while s.compacting.load(Ordering::Acquire) {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let live = s.len();
        let running = s.file_len();
        drop(s);
        let s = RedbStore::open(&path, Duration::from_secs(3600), bound).unwrap();
        let restarted = s.file_len();
        eprintln!(
            "bound {bound} records {n}x{kb}KiB live {live} file peak {peak} end {running} \
             after restart {restarted} slowest put {slowest:?}"
        );
        let limit = bound as u64 * 3 / 2;
        assert!(peak <= limit, "peak {peak} > {limit}");
        assert!(restarted <= limit, "after restart {restarted} > {limit}");
        assert!(live > 0 && s.len() == live);
        assert!(
            s.find(1, &[0, n as u128 - 1]).await.unwrap().is_some(),
            "newest kept"
        );
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
