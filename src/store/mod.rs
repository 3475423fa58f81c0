//! What must outlive a process: compaction records (credential-scoped,
//! content-addressed by the chained hash of the `k` original messages), the
//! secret credential fingerprints are hashed with, and learned context
//! windows.
//!
//! The chat path keeps its in-memory [`crate::chat::record::RecordStore`]
//! as the hot cache in front of a [`Store`]: a committed record is written
//! through (in the background), and a lookup that misses in memory reads
//! through only when [`Store::may_have`] says a record could match a
//! history that long. A passthrough turn of a conversation that was never
//! compacted therefore costs no store round trip.
//!
//! Backends:
//! - [`Memory`]: nothing outlives the process (the behaviour before stores).
//! - [`file::FileStore`]: an embedded append-only log file, the binary's
//!   default (a damaged file is moved aside and a fresh one started; the
//!   file stays within 1.5× the byte bound).
//! - [`redis::RedisStore`]: Redis or Valkey, shared by several replicas.
//!
//! A store that fails or is slow degrades the request to memory only: the
//! request passes through, the failure is logged (content-free) and counted
//! in [`StoreMetrics`] (rendered by the metrics registry).

pub mod config;
pub mod file;
pub mod recover;
pub mod redis;
pub mod resp;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

pub use crate::metrics::store::StoreMetrics;
pub use config::{StoreBackend, StoreConfig};

/// One record as stored: the figures and the replacement's raw JSON text,
/// byte for byte.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct StoredRecord {
    /// How many leading original messages the replacement stands for.
    pub k: usize,
    /// Chained hash of those `k` messages.
    pub prefix_hash: u128,
    /// The replacement messages, each a JSON text.
    pub replacement: Vec<String>,
    /// Rough token estimate of the `k` originals.
    pub original_tokens: u64,
    /// Rough token estimate of the replacement.
    pub replacement_tokens: u64,
    /// Which replacement rows carry a summary; absent in records stored
    /// before it was kept (then every row may).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub summary_rows: Option<Vec<usize>>,
}

impl StoredRecord {
    /// Bytes the record takes in a store (its texts and a fixed overhead).
    pub fn size(&self) -> usize {
        64 + self.replacement.iter().map(String::len).sum::<usize>()
    }
}

/// Why a store call failed.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The backend reported an error.
    #[error("store backend: {0}")]
    Backend(String),
    /// The call took longer than the store's timeout.
    #[error("store call timed out")]
    Timeout,
    /// A stored value could not be decoded.
    #[error("stored value undecodable")]
    Corrupt,
}

/// A backend for what must outlive a process.
#[async_trait::async_trait]
pub trait Store: Send + Sync {
    /// Backend name for logs and metrics (`memory`, `file`, `redis`).
    fn name(&self) -> &'static str;

    /// The secret that credential fingerprints and session keys are hashed
    /// with, kept by the store so that records keyed by a fingerprint are
    /// found again after a restart (and by every replica). `None`: the
    /// process picks its own (nothing outlives it anyway).
    fn keyer_secret(&self) -> Option<u64> {
        None
    }

    /// Whether a record could match a history of `len` messages. Local and
    /// cheap (no I/O): a lookup goes to the store only when this says yes.
    fn may_have(&self, len: usize) -> bool;

    /// Notes that a record was used from memory, so the store's idle
    /// time follows real use. Local and cheap (no I/O on the request path:
    /// a backend writes such uses in its sweep).
    fn touch(&self, _cred: u128, _prefix_hash: u128) {}

    /// The longest record of this credential whose prefix hash matches
    /// `hashes` (element i = chained hash of messages 0..=i).
    async fn find(&self, cred: u128, hashes: &[u128]) -> Result<Option<StoredRecord>, StoreError>;

    /// Stores (or replaces) a record.
    async fn put(&self, cred: u128, record: StoredRecord) -> Result<(), StoreError>;

    /// Drops expired records and enforces the byte bound.
    async fn sweep(&self) -> Result<(), StoreError>;

    /// The learned context windows (upstream, model, tokens) the store
    /// held when it was opened. No I/O.
    fn windows(&self) -> Vec<(String, String, u64)> {
        Vec::new()
    }

    /// Stores a learned context window of (upstream, model).
    async fn put_window(
        &self,
        _upstream: &str,
        _model: &str,
        _tokens: u64,
    ) -> Result<(), StoreError> {
        Ok(())
    }

    /// Whether several processes share this store: then a compaction takes
    /// [`Store::try_lock`] before its summary call, so that one replica
    /// summarises and the others use its record.
    fn shared(&self) -> bool {
        false
    }

    /// Takes the lock of the compaction of (`cred`, `prefix_hash`) for
    /// `ttl`, as `token`; `false`: another owner holds it. A store that is
    /// not shared has nothing to lock against.
    async fn try_lock(
        &self,
        _cred: u128,
        _prefix_hash: u128,
        _token: u64,
        _ttl: Duration,
    ) -> Result<bool, StoreError> {
        Ok(true)
    }

    /// Releases the lock if `token` still owns it.
    async fn unlock(&self, _cred: u128, _prefix_hash: u128, _token: u64) -> Result<(), StoreError> {
        Ok(())
    }

    /// The state a conversation (by session key) left, as it was put.
    async fn get_state(&self, _session: u128) -> Result<Option<Vec<u8>>, StoreError> {
        Ok(None)
    }

    /// Stores a conversation's state (replacing the previous one); it
    /// expires after the idle TTL like a record, and a store may drop it
    /// sooner to keep its byte bound (the file store does: a state is a
    /// cache, its loss a conversation's calibration starting afresh).
    async fn put_state(&self, _session: u128, _state: Vec<u8>) -> Result<(), StoreError> {
        Ok(())
    }
}

/// Nothing outlives the process: every call is free and finds nothing.
#[derive(Debug, Default)]
pub struct Memory;

#[async_trait::async_trait]
impl Store for Memory {
    fn name(&self) -> &'static str {
        "memory"
    }
    fn may_have(&self, _len: usize) -> bool {
        false
    }
    async fn find(&self, _: u128, _: &[u128]) -> Result<Option<StoredRecord>, StoreError> {
        Ok(None)
    }
    async fn put(&self, _: u128, _: StoredRecord) -> Result<(), StoreError> {
        Ok(())
    }
    async fn sweep(&self) -> Result<(), StoreError> {
        Ok(())
    }
}

/// A store with its timeout and counters: what the chat path holds.
#[derive(Clone)]
pub struct StoreHandle {
    store: Arc<dyn Store>,
    timeout: Duration,
    /// The counters.
    pub(crate) health: Arc<StoreMetrics>,
    /// Failed calls since the last that succeeded, writes and reads apart.
    failing: Arc<[AtomicU64; 2]>,
}

/// What a call does, for its failures' log: a full disk or a store gone
/// fails every write (or every call) until it is back, and one WARN per
/// call would flood the log; one WARN when failures start, one INFO with
/// their count when a call of the same kind succeeds again.
#[derive(Debug, Clone, Copy)]
enum CallKind {
    Write = 0,
    Read = 1,
}

impl CallKind {
    fn of(op: &str) -> Self {
        match op {
            "put" | "put_window" | "put_state" | "sweep" | "lock" | "unlock" => Self::Write,
            _ => Self::Read,
        }
    }
}

impl std::fmt::Debug for StoreHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StoreHandle")
            .field("backend", &self.store.name())
            .field("timeout", &self.timeout)
            .finish_non_exhaustive()
    }
}

impl StoreHandle {
    /// Wraps a store; calls longer than `timeout` count as failed.
    pub fn new(store: Arc<dyn Store>, timeout: Duration) -> Self {
        let health = Arc::new(StoreMetrics::default());
        health.up.store(true, Ordering::Relaxed);
        Self {
            store,
            timeout,
            health,
            failing: Arc::default(),
        }
    }

    /// The memory-only handle (nothing outlives the process).
    pub fn memory() -> Self {
        Self::new(Arc::new(Memory), Duration::from_secs(1))
    }

    /// The backend's name.
    pub fn name(&self) -> &'static str {
        self.store.name()
    }

    /// See [`Store::may_have`].
    pub fn may_have(&self, len: usize) -> bool {
        self.store.may_have(len)
    }

    /// See [`Store::keyer_secret`].
    pub fn keyer_secret(&self) -> Option<u64> {
        self.store.keyer_secret()
    }

    /// See [`Store::touch`].
    pub fn touch(&self, cred: u128, prefix_hash: u128) {
        self.store.touch(cred, prefix_hash);
    }

    /// Reads through: `None` on a miss and on a failure (then logged and
    /// counted: the request goes on from memory).
    pub async fn find(&self, cred: u128, hashes: &[u128]) -> Option<StoredRecord> {
        match tokio::time::timeout(self.timeout, self.store.find(cred, hashes)).await {
            Ok(Ok(Some(r))) => {
                self.succeeded("find");
                StoreMetrics::bump(&self.health.read_hits);
                Some(r)
            }
            Ok(Ok(None)) => {
                self.succeeded("find");
                StoreMetrics::bump(&self.health.read_misses);
                None
            }
            Ok(Err(e)) => self.degraded("find", &e),
            Err(_) => self.degraded("find", &StoreError::Timeout),
        }
    }

    /// Writes through; a failure is logged and counted (the record stays in
    /// memory).
    pub async fn put(&self, cred: u128, record: StoredRecord) {
        match tokio::time::timeout(self.timeout, self.store.put(cred, record)).await {
            Ok(Ok(())) => {
                self.succeeded("put");
                StoreMetrics::bump(&self.health.writes);
            }
            Ok(Err(e)) => {
                self.degraded::<()>("put", &e);
            }
            Err(_) => {
                self.degraded::<()>("put", &StoreError::Timeout);
            }
        }
    }

    /// Writes through in the background (the caller does not wait).
    pub(crate) fn put_in_background(&self, cred: u128, record: StoredRecord) {
        let this = self.clone();
        tokio::spawn(async move { this.put(cred, record).await });
    }

    /// See [`Store::windows`].
    pub fn windows(&self) -> Vec<(String, String, u64)> {
        self.store.windows()
    }

    /// Stores a learned window in the background; a failure is logged and
    /// counted.
    pub(crate) fn put_window_in_background(&self, upstream: &str, model: &str, tokens: u64) {
        let this = self.clone();
        let (upstream, model) = (upstream.to_owned(), model.to_owned());
        tokio::spawn(async move {
            let put = this.store.put_window(&upstream, &model, tokens);
            this.bounded("put_window", put).await;
        });
    }

    /// See [`Store::shared`].
    pub(crate) fn shared(&self) -> bool {
        self.store.shared()
    }

    /// Whether anything outlives the process (not the memory backend).
    pub(crate) fn persistent(&self) -> bool {
        self.store.name() != "memory"
    }

    /// See [`Store::try_lock`]; `None` when the store failed (counted).
    pub(crate) async fn try_lock(
        &self,
        cred: u128,
        prefix_hash: u128,
        token: u64,
        ttl: Duration,
    ) -> Option<bool> {
        let call = self.store.try_lock(cred, prefix_hash, token, ttl);
        self.bounded("lock", call).await
    }

    /// See [`Store::unlock`]; a failure is counted (the lock then expires).
    pub(crate) async fn unlock(&self, cred: u128, prefix_hash: u128, token: u64) {
        let call = self.store.unlock(cred, prefix_hash, token);
        self.bounded("unlock", call).await;
    }

    /// A conversation's stored state; `None` on a miss or a failure.
    pub(crate) async fn get_state(&self, session: u128) -> Option<Vec<u8>> {
        self.bounded("get_state", self.store.get_state(session))
            .await
            .flatten()
    }

    /// Stores a conversation's state in the background.
    pub(crate) fn put_state_in_background(&self, session: u128, state: Vec<u8>) {
        let this = self.clone();
        tokio::spawn(async move {
            let call = this.store.put_state(session, state);
            this.bounded("put_state", call).await;
        });
    }

    /// One call under the timeout; a failure is logged and counted.
    async fn bounded<T>(
        &self,
        op: &'static str,
        call: impl std::future::Future<Output = Result<T, StoreError>>,
    ) -> Option<T> {
        match tokio::time::timeout(self.timeout, call).await {
            Ok(Ok(v)) => {
                self.succeeded(op);
                Some(v)
            }
            Ok(Err(e)) => self.degraded(op, &e),
            Err(_) => self.degraded(op, &StoreError::Timeout),
        }
    }

    /// Sweeps the store; a failure is logged and counted.
    pub async fn sweep(&self) {
        // A sweep may walk the whole store: it gets a longer budget.
        match tokio::time::timeout(self.timeout * 20, self.store.sweep()).await {
            Ok(Ok(())) => self.succeeded("sweep"),
            Ok(Err(e)) => {
                self.degraded::<()>("sweep", &e);
            }
            Err(_) => {
                self.degraded::<()>("sweep", &StoreError::Timeout);
            }
        }
    }

    /// Counts a failed call; logs it only when it starts a run of
    /// failures of its kind (every one is counted in the metrics).
    fn degraded<T>(&self, op: &'static str, e: &StoreError) -> Option<T> {
        StoreMetrics::bump(&self.health.degraded);
        let kind = CallKind::of(op);
        let before = self.failing[kind as usize].fetch_add(1, Ordering::Relaxed);
        if before == 0 {
            tracing::warn!(backend = self.store.name(), op, error = %e,
                "store call failed; serving from memory (further failures of its kind are \
                 counted, not logged, until one succeeds)");
        } else {
            tracing::debug!(backend = self.store.name(), op, error = %e, "store call failed");
        }
        None
    }

    /// Ends a run of failures of `op`'s kind, if one was going on.
    fn succeeded(&self, op: &'static str) {
        let kind = CallKind::of(op);
        let failed = self.failing[kind as usize].swap(0, Ordering::Relaxed);
        if failed > 0 {
            tracing::info!(
                backend = self.store.name(),
                op,
                failed_calls = failed,
                "store calls succeed again"
            );
        }
    }
}

/// Opens the configured store. A damaged file is moved aside and a fresh
/// one started (counted in the recoveries); a store that cannot be opened
/// at all degrades to memory (logged): the proxy still serves.
pub fn open(cfg: &StoreConfig) -> StoreHandle {
    let mut recovered = false;
    let mut up = true;
    let store: Arc<dyn Store> = match &cfg.backend {
        StoreBackend::Memory => Arc::new(Memory),
        StoreBackend::File(path) => {
            if cfg.redb_alias {
                tracing::info!(backend = "file", path = %path.display(),
                    "store backend \"redb\" is now the file backend");
            }
            match file::FileStore::open(path, cfg.ttl, cfg.max_bytes) {
                Ok(s) => {
                    recovered = s.moved_aside().is_some();
                    // A write paced by a compaction gives up before the
                    // call's timeout would count it as slow.
                    s.set_write_wait(cfg.timeout * 4 / 5);
                    tracing::info!(backend = "file", path = %path.display(), "store opened");
                    Arc::new(s)
                }
                Err(e) => {
                    tracing::warn!(backend = "file", error = %e,
                        "store cannot be opened; records are kept in memory only");
                    up = false;
                    Arc::new(Memory)
                }
            }
        }
        StoreBackend::Redis(url) => match redis::RedisStore::open(url, cfg.ttl, cfg.max_bytes) {
            Ok(s) => {
                tracing::info!(backend = "redis", "store opened");
                Arc::new(s)
            }
            Err(e) => {
                tracing::warn!(backend = "redis", error = %e,
                    "store cannot be opened; records are kept in memory only");
                up = false;
                Arc::new(Memory)
            }
        },
    };
    let handle = StoreHandle::new(store, cfg.timeout);
    handle.health.up.store(up, Ordering::Relaxed);
    let _ = handle.health.configured.set(match cfg.backend {
        StoreBackend::Memory => "memory",
        StoreBackend::File(_) => "file",
        StoreBackend::Redis(_) => "redis",
    });
    if recovered {
        StoreMetrics::bump(&handle.health.recoveries);
    }
    handle
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicBool;
    use std::sync::Mutex;

    /// A store whose writes fail while `full` (a full disk).
    #[derive(Default)]
    struct Filling {
        full: AtomicBool,
    }

    #[async_trait::async_trait]
    impl Store for Filling {
        fn name(&self) -> &'static str {
            "file"
        }
        fn may_have(&self, _len: usize) -> bool {
            true
        }
        async fn find(&self, _: u128, _: &[u128]) -> Result<Option<StoredRecord>, StoreError> {
            Ok(None)
        }
        async fn put(&self, _: u128, _: StoredRecord) -> Result<(), StoreError> {
            if self.full.load(Ordering::Relaxed) {
                return Err(StoreError::Backend("write: no space left on device".into()));
            }
            Ok(())
        }
        async fn sweep(&self) -> Result<(), StoreError> {
            Ok(())
        }
    }

    /// The log lines written while it is the default subscriber.
    #[derive(Clone, Default)]
    struct Lines(Arc<Mutex<Vec<u8>>>);

    impl std::io::Write for Lines {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for Lines {
        type Writer = Self;
        fn make_writer(&'a self) -> Self {
            self.clone()
        }
    }

    impl Lines {
        fn take(&self) -> Vec<String> {
            let bytes = std::mem::take(&mut *self.0.lock().unwrap());
            String::from_utf8(bytes)
                .unwrap()
                .lines()
                .map(str::to_owned)
                .collect()
        }
    }

    fn record() -> StoredRecord {
        StoredRecord {
            k: 1,
            prefix_hash: 1,
            replacement: vec!["x".into()],
            original_tokens: 1,
            replacement_tokens: 1,
            summary_rows: None,
        }
    }

    /// Issue 49: a full disk logged one WARN per failed write.
    #[tokio::test]
    async fn a_run_of_failed_writes_logs_one_warn_and_one_info_when_it_ends() {
        let lines = Lines::default();
        let subscriber = tracing_subscriber::fmt()
            .with_ansi(false)
            .without_time()
            .with_max_level(tracing::Level::INFO)
            .with_writer(lines.clone())
            .finish();
        let _default = tracing::subscriber::set_default(subscriber);
        let store = Arc::new(Filling::default());
        let handle = StoreHandle::new(Arc::clone(&store) as Arc<dyn Store>, Duration::from_secs(5));
        store.full.store(true, Ordering::Relaxed);
        for _ in 0..50 {
            handle.put(1, record()).await;
        }
        // Reads go on meanwhile: they neither end the run nor log.
        assert!(handle.find(1, &[1]).await.is_none());
        let during = lines.take();
        assert_eq!(during.len(), 1, "{during:#?}");
        assert!(during[0].contains("WARN") && during[0].contains("no space left"));
        store.full.store(false, Ordering::Relaxed);
        handle.put(1, record()).await;
        handle.put(1, record()).await;
        let after = lines.take();
        assert_eq!(after.len(), 1, "{after:#?}");
        assert!(after[0].contains("INFO") && after[0].contains("failed_calls=50"));
        assert_eq!(handle.health.degraded.load(Ordering::Relaxed), 50);
        // A second run is logged again.
        store.full.store(true, Ordering::Relaxed);
        handle.put(1, record()).await;
        handle.put(1, record()).await;
        assert_eq!(lines.take().len(), 1);
    }

    /// A store that could not be opened was one WARN at start, then
    /// indistinguishable from the memory backend in the metrics.
    #[test]
    fn a_store_that_could_not_open_is_down_in_the_metrics() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("state.log");
        // Any store that cannot be opened: here a link, refused.
        std::os::unix::fs::symlink(dir.path().join("elsewhere"), &path).unwrap();
        let cfg = StoreConfig {
            backend: StoreBackend::File(path),
            ..StoreConfig::default()
        };
        let handle = open(&cfg);
        assert_eq!(handle.name(), "memory");
        let text = handle.health.render(handle.name());
        assert!(
            text.contains("# TYPE compactor_store_up gauge\n")
                && text.contains("compactor_store_up{backend=\"memory\",configured=\"file\"} 0"),
            "{text}"
        );
        let ok = open(&StoreConfig {
            backend: StoreBackend::File(dir.path().join("good.log")),
            ..StoreConfig::default()
        });
        let text = ok.health.render(ok.name());
        assert!(
            text.contains("compactor_store_up{backend=\"file\",configured=\"file\"} 1"),
            "{text}"
        );
        let memory = open(&StoreConfig::default()).health.render("memory");
        assert!(memory.contains("compactor_store_up{backend=\"memory\",configured=\"memory\"} 1"));
    }
}
