//! The chat-completions path: what happens to `POST /v1/chat/completions`
//! between the client and the upstream.
//!
//! Each file imports only files below it in this list (the `[chat]`
//! order of `scripts/layers.txt`, which `scripts/check_layers.sh` enforces):
//!
//! - [`walk`]: the walk of one request (read, prepare, send, retry on
//!   overflow, tap usage on the way back).
//! - `held`: a stream whose head went out on SSE comments before its first
//!   data event (comments flow; an in-band overflow retried in the stream).
//! - `respond`: the response side both share (send, book a retry, the
//!   client's body, compactor's headers).
//! - `worker`: where `prepare` runs (once it has to wait, a task of its
//!   own that a leaving client does not cancel; large bodies on the
//!   blocking pool).
//! - `prepare`: what to send, in named steps: substitute the recorded
//!   prefix → estimate → decide → compact → build the body.
//! - `compact`: the compaction a decision asks for, inline or served by
//!   the pending pass, and its booking (stats, metrics, one log line, the
//!   record).
//! - `background`: pre-compaction off the request path
//!   (`[compaction] background`): started, taken, committed.
//! - `shared`: one summary per compaction across replicas (the store's
//!   lock).
//! - `engine`: the engine glue both passes share (the turn, the rows the
//!   engine is given, one pass, its result as a record).
//! - `decide`: whether a request is compacted (pure).
//! - `persist`: a conversation's state to and from the store.
//! - [`conversation`]: per-conversation state behind the session lock.
//! - `pending`: a pre-compaction in flight, as a conversation holds it.
//! - `durable`: records through the [`crate::store`] (find, commit).
//! - [`record`]: compaction records, the stable prefixes.
//! - [`inspect`]: the inspector's figures of a conversation.
//! - [`summarise`]: the summariser as a JSON POST through the upstream.
//! - `count`: the upstream's own tokenizer near the window's edge.
//!
//! It takes what it needs, [`ChatState`] and the [`Upstream`], never the
//! whole server.

mod background;
mod compact;
pub(crate) mod conversation;
mod count;
mod decide;
mod durable;
mod engine;
mod held;
pub(crate) mod inspect;
mod pending;
mod persist;
mod prepare;
pub mod record;
mod respond;
mod shared;
pub(crate) mod summarise;
pub mod walk;
mod worker;

use std::sync::Arc;
use std::time::Duration;

use http::HeaderMap;
use serde_json::Value;

use crate::compaction::config::CompactionConfig;
use crate::config::{Config, ConfigError, UpstreamBase};
use crate::metrics::Metrics;
use crate::session::key::SessionKeyer;
use crate::session::store::{SessionStore, StoreLimits};
use crate::store::StoreHandle;
use crate::upstream::{FetchError, Upstream};
use crate::window::cache::{WindowCache, WindowConfig};
use crate::window::discover::{GetError, UpstreamGet};

use conversation::Conversation;
use record::RecordStore;

/// Everything the chat path shares across requests.
pub struct ChatState {
    /// Engine configuration (`[compaction]`).
    pub(crate) compaction: Arc<CompactionConfig>,
    /// Session key derivation.
    pub(crate) keyer: SessionKeyer,
    /// Conversations.
    pub(crate) sessions: SessionStore<Conversation>,
    /// Compaction records (the hot cache in front of `store`).
    pub(crate) records: RecordStore,
    /// What outlives the process (`[store]`).
    pub(crate) store: StoreHandle,
    /// Context windows per (upstream, model).
    pub(crate) windows: WindowCache,
    /// The upstream base as a string (window cache key, trigger base URL).
    pub(crate) upstream_label: String,
    /// Where summary calls go when not to the upstream.
    pub(crate) summary_endpoint: Option<UpstreamBase>,
    /// Add `x-compactor-*` response headers.
    pub(crate) expose_headers: bool,
    /// The metrics registry (chat series under `metrics.chat`).
    pub(crate) metrics: Arc<Metrics>,
    /// Permits for preparing large bodies at once (see `worker`): each
    /// holds its body several times over while it is parsed and compacted.
    pub(crate) heavy: Arc<tokio::sync::Semaphore>,
    /// Permits for background pre-compactions (`background_max_concurrent`).
    pub(crate) background: Arc<tokio::sync::Semaphore>,
    /// What firmer-length summary retries gave, per model.
    pub(crate) firm_retries: Arc<summarise::FirmRetries>,
    /// The upstream's tokenizer endpoint, once found (or found absent).
    pub(crate) tokenizer: count::Tokenizer,
    /// Turns kept per conversation for the inspector (`[admin] turn_history`).
    pub(crate) turn_history: usize,
}

impl ChatState {
    /// Builds the chat state from the validated proxy configuration.
    pub(crate) fn from_config(cfg: &Config, metrics: Arc<Metrics>) -> Result<Self, ConfigError> {
        let compaction = cfg.compaction.clone();
        let store = crate::store::open(&cfg.store);
        metrics.register_store(Arc::clone(&store.health), store.name());
        // Records are keyed by credential fingerprints: a store that keeps
        // records keeps the secret they are hashed with.
        let keyer = match store.keyer_secret() {
            Some(secret) => SessionKeyer::with_secret(&cfg.session.headers, secret),
            None => SessionKeyer::new(&cfg.session.headers),
        }
        .map_err(|e| ConfigError::invalid("session.headers", e.to_string()))?;
        let limits = StoreLimits {
            ttl: cfg.session.ttl,
            max_sessions: cfg.session.max_sessions,
        };
        // Without `default_context_length`, the cache's own default applies
        // (llama.cpp's common small window; a learned window replaces it).
        let defaults = WindowConfig::default();
        let windows = WindowCache::new(WindowConfig {
            models: cfg
                .models
                .iter()
                .map(|(k, v)| (k.clone(), v.context_length))
                .collect(),
            default_window: cfg
                .default_context_length
                .unwrap_or(defaults.default_window),
            ..defaults
        });
        // Windows learned before a restart (the store read them at open).
        for (upstream, model, tokens) in store.windows() {
            windows.learn_limit(&upstream, &model, tokens);
        }
        Ok(Self {
            compaction: Arc::new(compaction),
            keyer,
            sessions: SessionStore::new(limits),
            // Records outlive sessions a little: a conversation resumed
            // without its session header still finds its compaction.
            records: RecordStore::new(cfg.session.ttl, cfg.session.max_sessions.max(1))
                .with_max_bytes(cfg.session.max_record_bytes),
            store,
            windows,
            upstream_label: cfg.upstream.to_string(),
            summary_endpoint: cfg.summary_endpoint.clone(),
            expose_headers: cfg.expose_headers,
            metrics,
            heavy: Arc::new(tokio::sync::Semaphore::new(heavy_permits())),
            background: Arc::new(tokio::sync::Semaphore::new(
                cfg.compaction.background_max_concurrent.max(1),
            )),
            firm_retries: Arc::default(),
            tokenizer: count::Tokenizer::default(),
            turn_history: cfg.admin_turn_history,
        })
    }

    /// Drops idle sessions and records; run periodically.
    pub(crate) fn sweep(&self) {
        self.sessions.sweep(tokio::time::Instant::now());
        self.records.sweep();
        worker::trim_if_due();
        if self.store.name() != "memory" {
            if let Ok(rt) = tokio::runtime::Handle::try_current() {
                let store = self.store.clone();
                rt.spawn(async move { store.sweep().await });
            }
        }
    }
}

/// Large bodies prepared at once: half the cores (at least one), so the
/// async workers keep a core for everything else.
fn heavy_permits() -> usize {
    std::thread::available_parallelism().map_or(1, |n| (n.get() / 2).max(1))
}

/// Largest discovery answer read.
const MAX_PROBE_BYTES: usize = 4 << 20;

/// The client as side calls made for it (summary, token count, window
/// discovery) present it: its request headers (only the credentials and a
/// few routing headers are copied from them) and the credential parameters
/// of its query ([`crate::session::key::credential_query`]), each in the
/// form the client used.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Client<'a> {
    /// The client's request headers.
    pub(crate) headers: &'a HeaderMap,
    /// `key=…` (and the like) of the client's query, as written.
    pub(crate) query: Option<&'a str>,
}

/// Window discovery through the upstream, with the client's credentials.
pub(crate) struct Discovery<'a> {
    /// The upstream.
    pub(crate) upstream: &'a Upstream,
    /// The client's request headers: only their credential headers are
    /// presented (some upstreams guard `/v1/models`), picked out when a
    /// probe runs, not on every request.
    pub(crate) client_headers: &'a HeaderMap,
    /// The client's credential query parameters, presented as written.
    pub(crate) credential_query: Option<&'a str>,
    /// Per-probe timeout.
    pub(crate) timeout: Duration,
}

#[async_trait::async_trait]
impl UpstreamGet for Discovery<'_> {
    async fn get_json(&self, path: &str) -> Result<Option<Value>, GetError> {
        let headers = crate::session::key::credential_headers(self.client_headers);
        let path = match self.credential_query {
            Some(q) if !path.contains('?') => std::borrow::Cow::Owned(format!("{path}?{q}")),
            Some(q) => std::borrow::Cow::Owned(format!("{path}&{q}")),
            None => std::borrow::Cow::Borrowed(path),
        };
        self.upstream
            .get_json(&path, headers, MAX_PROBE_BYTES, self.timeout)
            .await
            .map_err(|e| match e {
                FetchError::InvalidJson => GetError::InvalidJson,
                other => GetError::Transport(other.to_string()),
            })
    }
}
