//! `proxy.toml` as written: one struct per table, serde's defaults and
//! `deny_unknown_fields`, and the `COMPACTOR_*` overrides and the command
//! line's flags applied to it before anything is checked.

use std::collections::BTreeMap;
use std::path::PathBuf;

use serde::Deserialize;

use super::{
    ConfigError, EnvSource, LogFormat, Overrides, DEFAULT_LISTEN, DEFAULT_MAX_BODY_BYTES,
    DEFAULT_SESSION_HEADERS, DEFAULT_UPSTREAM,
};

/// `proxy.toml` as written (before validation).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub(crate) struct RawConfig {
    /// Listen address.
    pub(crate) listen: String,
    /// Upstream base URL (may carry a path prefix).
    pub(crate) upstream: String,
    /// Extra PEM root CA(s) trusted for an https upstream.
    pub(crate) upstream_ca_file: Option<PathBuf>,
    /// Request body limit in bytes.
    pub(crate) max_body_bytes: u64,
    /// Timeouts.
    pub(crate) timeouts: RawTimeouts,
    /// Connection and buffering caps.
    pub(crate) limits: RawLimits,
    /// Session identification and bounds.
    pub(crate) session: RawSession,
    /// Engine settings, validated into [`crate::compaction::config::CompactionConfig`].
    pub(crate) compaction: toml::Table,
    /// Per-model settings.
    pub(crate) models: BTreeMap<String, ModelConfig>,
    /// Context length used when nothing else is known.
    pub(crate) default_context_length: Option<u64>,
    /// Admin API.
    pub(crate) admin: AdminConfig,
    /// Response header policy.
    pub(crate) headers: HeadersConfig,
    /// How client requests are read.
    pub(crate) server: ServerConfig,
    /// Logging.
    pub(crate) log: LogConfig,
    /// Where records outlive the process.
    pub(crate) store: crate::store::config::RawStore,
}

impl Default for RawConfig {
    fn default() -> Self {
        RawConfig {
            listen: DEFAULT_LISTEN.to_owned(),
            upstream: DEFAULT_UPSTREAM.to_owned(),
            upstream_ca_file: None,
            max_body_bytes: DEFAULT_MAX_BODY_BYTES,
            timeouts: RawTimeouts::default(),
            limits: RawLimits::default(),
            session: RawSession::default(),
            compaction: toml::Table::new(),
            models: BTreeMap::new(),
            default_context_length: None,
            admin: AdminConfig::default(),
            headers: HeadersConfig::default(),
            server: ServerConfig::default(),
            log: LogConfig::default(),
            store: crate::store::config::RawStore::default(),
        }
    }
}

/// `[timeouts]`, all in whole seconds.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub(crate) struct RawTimeouts {
    /// TCP (+TLS) connect to the upstream.
    pub(crate) connect_secs: u64,
    /// From sending the request to the upstream's response head.
    pub(crate) first_byte_secs: u64,
    /// Maximum silence between two response body frames.
    pub(crate) idle_secs: u64,
    /// How long in-flight requests may run after SIGINT/SIGTERM.
    pub(crate) shutdown_grace_secs: u64,
    /// From the request head to the end of a request body compactor reads
    /// whole (chat) or forwards (passthrough).
    pub(crate) body_read_secs: u64,
    /// A client connection with no request in flight and no request bytes
    /// for this long is closed (also before its first request).
    pub(crate) client_idle_secs: u64,
    /// How long an idle pooled upstream connection is kept for reuse.
    pub(crate) upstream_pool_idle_secs: u64,
}

impl Default for RawTimeouts {
    fn default() -> Self {
        // Generous: a slow local model can take minutes before its first token.
        RawTimeouts {
            connect_secs: 10,
            first_byte_secs: 600,
            idle_secs: 300,
            shutdown_grace_secs: 30,
            body_read_secs: 60,
            client_idle_secs: 60,
            // Below the keep-alive of common upstream servers (gunicorn 2 s,
            // uvicorn / vLLM and cpp-httplib / llama.cpp 5 s): a connection
            // the upstream is about to close is not reused.
            upstream_pool_idle_secs: 1,
        }
    }
}

/// Default bound on the bytes all compaction records hold together (256 MiB).
pub(crate) const DEFAULT_MAX_RECORD_BYTES: usize = 256 << 20;

/// `[limits]`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub(crate) struct RawLimits {
    /// Open client connections at most; beyond it: 503 and close.
    pub(crate) max_connections: usize,
    /// Request body bytes buffered at once across all chat requests;
    /// beyond it: 503.
    pub(crate) max_buffered_body_bytes: u64,
}

impl Default for RawLimits {
    fn default() -> Self {
        RawLimits {
            max_connections: 4096,
            max_buffered_body_bytes: 512 << 20,
        }
    }
}

/// `[session]`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub(crate) struct RawSession {
    /// Header names carrying a session id, first present wins.
    pub(crate) headers: Vec<String>,
    /// Idle time after which a session is forgotten.
    pub(crate) ttl_secs: u64,
    /// Maximum number of sessions held.
    pub(crate) max_sessions: usize,
    /// Bound on the bytes all compaction records hold together.
    pub(crate) max_record_bytes: usize,
}

impl Default for RawSession {
    fn default() -> Self {
        RawSession {
            headers: DEFAULT_SESSION_HEADERS
                .iter()
                .map(|s| (*s).to_owned())
                .collect(),
            ttl_secs: 3600,
            max_sessions: 10_000,
            max_record_bytes: DEFAULT_MAX_RECORD_BYTES,
        }
    }
}

/// `[models."<name>"]`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct ModelConfig {
    /// Context window in tokens.
    pub(crate) context_length: u64,
}

/// `[admin]`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub(crate) struct AdminConfig {
    /// Bearer token for `/_compactor/sessions*` and `/_compactor/ui`; admin
    /// API and inspector disabled when absent.
    pub(crate) token: Option<String>,
    /// Whether the admin API shows the content of compaction records (the
    /// summary text). Off: everything it answers is content-free.
    pub(crate) show_content: bool,
    /// Turns whose figures each conversation keeps for the inspector.
    pub(crate) turn_history: usize,
}

/// Default `[admin] turn_history`.
pub(crate) const DEFAULT_TURN_HISTORY: usize = 200;
/// Largest `[admin] turn_history`.
pub(crate) const MAX_TURN_HISTORY: usize = 10_000;

impl Default for AdminConfig {
    fn default() -> Self {
        AdminConfig {
            token: None,
            show_content: false,
            turn_history: DEFAULT_TURN_HISTORY,
        }
    }
}

/// `[headers]`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub(crate) struct HeadersConfig {
    /// Whether `x-compactor-*` response headers are added.
    pub(crate) expose: bool,
}

impl Default for HeadersConfig {
    fn default() -> Self {
        HeadersConfig { expose: true }
    }
}

/// `[server]`.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub(crate) struct ServerConfig {
    /// Whether request header fields whose name has an `_` are forwarded
    /// (nginx's `underscores_in_headers`; off: they are dropped).
    pub(crate) underscores_in_headers: bool,
}

/// `[log]`.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub(crate) struct LogConfig {
    /// `text` or `json`.
    pub(crate) format: LogFormat,
}

impl RawConfig {
    /// Applies `COMPACTOR_*` overrides. Unparseable values are reported under
    /// the env variable's name.
    /// The command line's settings, over the file's and the environment's.
    pub(super) fn apply_flags(&mut self, flags: &Overrides) {
        if let Some(v) = &flags.listen {
            self.listen.clone_from(v);
        }
        if let Some(v) = &flags.upstream {
            self.upstream.clone_from(v);
        }
    }

    pub(super) fn apply_env(
        &mut self,
        env: &dyn EnvSource,
        origin: &str,
    ) -> Result<(), ConfigError> {
        let mut problems = Vec::new();
        if let Some(v) = env.get("COMPACTOR_LISTEN") {
            self.listen = v;
        }
        if let Some(v) = env.get("COMPACTOR_UPSTREAM") {
            self.upstream = v;
        }
        if let Some(v) = env.get("COMPACTOR_UPSTREAM_CA_FILE") {
            self.upstream_ca_file = (!v.is_empty()).then(|| PathBuf::from(v));
        }
        self.store.apply_env(
            env.get("COMPACTOR_STORE_BACKEND"),
            env.get("COMPACTOR_STORE_PATH"),
        );
        self.store.apply_url_env(env.get("COMPACTOR_STORE_URL"));
        if let Some(v) = env.get("COMPACTOR_ADMIN_TOKEN") {
            self.admin.token = (!v.is_empty()).then_some(v);
        }
        let mut num = |name: &str, slot: &mut u64| {
            if let Some(v) = env.get(name) {
                match v.trim().parse::<u64>() {
                    Ok(n) => *slot = n,
                    Err(e) => problems.push((name.to_owned(), format!("{e}: {v:?}"))),
                }
            }
        };
        num("COMPACTOR_MAX_BODY_BYTES", &mut self.max_body_bytes);
        num("COMPACTOR_CONNECT_SECS", &mut self.timeouts.connect_secs);
        num(
            "COMPACTOR_FIRST_BYTE_SECS",
            &mut self.timeouts.first_byte_secs,
        );
        num("COMPACTOR_IDLE_SECS", &mut self.timeouts.idle_secs);
        num(
            "COMPACTOR_SHUTDOWN_GRACE_SECS",
            &mut self.timeouts.shutdown_grace_secs,
        );
        if let Some(v) = env.get("COMPACTOR_DEFAULT_CONTEXT_LENGTH") {
            match v.trim().parse::<u64>() {
                Ok(n) => self.default_context_length = Some(n),
                Err(e) => problems.push((
                    "COMPACTOR_DEFAULT_CONTEXT_LENGTH".to_owned(),
                    format!("{e}: {v:?}"),
                )),
            }
        }
        if let Some(v) = env.get("COMPACTOR_LOG_FORMAT") {
            match v.trim().to_ascii_lowercase().as_str() {
                "text" => self.log.format = LogFormat::Text,
                "json" => self.log.format = LogFormat::Json,
                _ => problems.push((
                    "COMPACTOR_LOG_FORMAT".to_owned(),
                    format!("expected \"text\" or \"json\", got {v:?}"),
                )),
            }
        }
        let mut flag = |name: &str, slot: &mut bool| {
            env_flag(env, name, slot, &mut problems);
        };
        flag("COMPACTOR_EXPOSE_HEADERS", &mut self.headers.expose);
        let underscores = &mut self.server.underscores_in_headers;
        flag("COMPACTOR_UNDERSCORES_IN_HEADERS", underscores);
        if problems.is_empty() {
            Ok(())
        } else {
            Err(ConfigError::Invalid {
                origin: origin.to_owned(),
                problems,
            })
        }
    }
}

/// Sets `slot` from the boolean env variable `name`, if set; a value that
/// is no boolean is a problem reported under its name.
fn env_flag(
    env: &dyn EnvSource,
    name: &str,
    slot: &mut bool,
    problems: &mut Vec<(String, String)>,
) {
    if let Some(v) = env.get(name) {
        match v.trim().to_ascii_lowercase().as_str() {
            "1" | "true" | "yes" | "on" => *slot = true,
            "0" | "false" | "no" | "off" => *slot = false,
            _ => problems.push((
                name.to_owned(),
                format!("expected true or false, got {v:?}"),
            )),
        }
    }
}
