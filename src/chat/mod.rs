//! The chat-completions brain: what happens to `POST /v1/chat/completions`
//! between the client and the upstream (design §1, §2, §8).
//!
//! - [`handler`]: the walk of one request (substitute, estimate, compact,
//!   send, retry on overflow, tap usage on the way back).
//! - [`conversation`]: per-conversation state behind the session lock.
//! - [`record`]: compaction records, the stable prefixes.
//! - [`summarise`]: the summariser as an HTTP call to the upstream.
//! - [`admin`]: the content-free session view.
//! - [`metrics`]: chat-path metrics.

pub mod admin;
pub mod conversation;
pub mod handler;
pub mod metrics;
pub mod record;
pub mod summarise;

use std::sync::Arc;
use std::time::Duration;

use http::HeaderMap;
use serde_json::Value;

use crate::compaction::config::CompactionConfig;
use crate::config::Config;
use crate::proxy::upstream::UpstreamClient;
use crate::session::key::SessionKeyer;
use crate::session::store::{SessionStore, StoreLimits};
use crate::window::cache::{WindowCache, WindowConfig};
use crate::window::discover::{GetError, UpstreamGet};

use conversation::Conversation;
use record::RecordStore;

/// Everything the chat path shares across requests.
pub struct ChatState {
    /// Engine configuration (`[compaction]`).
    pub compaction: Arc<CompactionConfig>,
    /// Session key derivation.
    pub keyer: SessionKeyer,
    /// Conversations.
    pub sessions: SessionStore<Conversation>,
    /// Compaction records.
    pub records: RecordStore,
    /// Context windows per (upstream, model).
    pub windows: WindowCache,
    /// The upstream base as a string (window cache key, trigger base URL).
    pub upstream_label: String,
    /// Chat-path metrics.
    pub metrics: metrics::ChatMetrics,
}

/// Invalid chat-path configuration.
#[derive(Debug, thiserror::Error)]
pub enum ChatConfigError {
    /// `[session] headers` has a bad entry.
    #[error("invalid config: key `session.headers`: {0}")]
    SessionHeaders(String),
    /// `[compaction] summary_endpoint` is not a usable base URL.
    #[error("invalid config: key `compaction.summary_endpoint`: {0}")]
    SummaryEndpoint(String),
}

impl ChatState {
    /// Builds the chat state from the validated proxy configuration.
    pub fn from_config(cfg: &Config) -> Result<Self, ChatConfigError> {
        let compaction = cfg.compaction.clone();
        // Checked here, not at use: a typo must not silently send summary
        // calls (with the client's credentials) to the main upstream.
        if let Some(ep) = &compaction.summary_endpoint {
            crate::config::UpstreamBase::parse(ep).map_err(ChatConfigError::SummaryEndpoint)?;
        }
        let keyer = SessionKeyer::new(&cfg.session.headers)
            .map_err(|e| ChatConfigError::SessionHeaders(e.0))?;
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
        Ok(Self {
            compaction: Arc::new(compaction),
            keyer,
            sessions: SessionStore::new(limits),
            // Records outlive sessions a little: a conversation resumed
            // without its session header still finds its compaction.
            records: RecordStore::new(cfg.session.ttl, cfg.session.max_sessions.max(1))
                .with_max_bytes(cfg.session.max_record_bytes),
            windows,
            upstream_label: format!(
                "{}://{}{}",
                cfg.upstream.scheme, cfg.upstream.authority, cfg.upstream.path_prefix
            ),
            metrics: metrics::ChatMetrics::default(),
        })
    }

    /// Drops idle sessions and records; run periodically.
    pub fn sweep(&self) {
        self.sessions.sweep(tokio::time::Instant::now());
        self.records.sweep();
    }
}

/// Window discovery over the pooled client, with the client's credentials.
pub struct Discovery<'a> {
    /// The pooled client.
    pub client: &'a UpstreamClient,
    /// Upstream base.
    pub base: &'a crate::config::UpstreamBase,
    /// The client's request headers: only their credential headers are
    /// presented (some upstreams guard `/v1/models`), picked out when a
    /// probe runs, not on every request.
    pub client_headers: &'a HeaderMap,
    /// Per-probe timeout.
    pub timeout: Duration,
}

#[async_trait::async_trait]
impl UpstreamGet for Discovery<'_> {
    async fn get_json(&self, path: &str) -> Result<Option<Value>, GetError> {
        use http_body_util::{BodyExt, Empty};
        let uri: http::Uri = path
            .parse()
            .map_err(|e: http::uri::InvalidUri| GetError::Transport(e.to_string()))?;
        let uri = crate::proxy::upstream::join_uri(self.base, &uri)
            .map_err(|e| GetError::Transport(e.to_string()))?;
        let mut req = http::Request::new(crate::proxy::body::boxed(Empty::<bytes::Bytes>::new()));
        *req.uri_mut() = uri;
        *req.headers_mut() = crate::session::key::credential_headers(self.client_headers);
        if let Ok(host) = http::HeaderValue::from_str(self.base.authority.as_str()) {
            req.headers_mut().insert(http::header::HOST, host);
        }
        let fut = async {
            let resp = self
                .client
                .request(req)
                .await
                .map_err(|e| GetError::Transport(e.to_string()))?;
            if !resp.status().is_success() {
                return Ok(None);
            }
            let body = http_body_util::Limited::new(resp.into_body(), 4 << 20)
                .collect()
                .await
                .map_err(|e| GetError::Transport(e.to_string()))?
                .to_bytes();
            serde_json::from_slice(&body)
                .map(Some)
                .map_err(|_| GetError::InvalidJson)
        };
        match tokio::time::timeout(self.timeout, fut).await {
            Ok(r) => r,
            Err(_) => Err(GetError::Transport("timed out".into())),
        }
    }
}
