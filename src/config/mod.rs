//! Configuration: `proxy.toml` + `COMPACTOR_*` environment overrides +
//! the command line's [`Overrides`] (`--upstream`, `--listen`), each over
//! the one before.
//!
//! Two stages, so every problem can be reported with the key that caused it:
//! [`RawConfig`] mirrors the file (serde, `deny_unknown_fields`, defaults), and
//! [`Config`] is the validated, strongly typed result the rest of the crate uses.
//! Environment lookups go through [`EnvSource`] so tests never touch the real
//! process environment.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use http::Uri;
use serde::Deserialize;

mod raw;
#[cfg(test)]
mod tests;
mod validate;

pub(crate) use raw::DEFAULT_MAX_RECORD_BYTES;
use raw::{ModelConfig, RawConfig, DEFAULT_TURN_HISTORY};
use validate::parse_error;

/// Default listen address (loopback: exposing the proxy is an explicit choice).
pub(crate) const DEFAULT_LISTEN: &str = "127.0.0.1:4000";
/// Default upstream: llama.cpp server's default address.
pub(crate) const DEFAULT_UPSTREAM: &str = "http://127.0.0.1:8080";
/// Default request body limit (32 MiB): long agent histories are big, but bounded.
pub(crate) const DEFAULT_MAX_BODY_BYTES: u64 = 32 * 1024 * 1024;
/// Default config file looked up in the working directory when `--config` is absent.
pub(crate) const DEFAULT_CONFIG_FILE: &str = "proxy.toml";

/// Session-id headers looked up in order: one list, kept next to the rule
/// syntax (`a+b`) it uses.
pub(crate) use crate::session::key::DEFAULT_SESSION_HEADERS;

/// Why a configuration could not be loaded. `Display` is always one line.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The config file could not be read.
    #[error("cannot read config file {path}: {source}")]
    Io {
        /// The file that was attempted.
        path: PathBuf,
        /// The underlying I/O error.
        #[source]
        source: std::io::Error,
    },
    /// The file is not valid TOML or does not match the schema.
    #[error("invalid config{origin}: key `{key}`: {message}")]
    Parse {
        /// ` in <file>` or empty.
        origin: String,
        /// Dotted key path as far as it could be determined.
        key: String,
        /// The parser's message (single line).
        message: String,
    },
    /// One or more values are syntactically fine but invalid.
    #[error("invalid config{origin}: {}", join_problems(.problems))]
    Invalid {
        /// ` in <file>` or empty.
        origin: String,
        /// (key, message) pairs, all problems found.
        problems: Vec<(String, String)>,
    },
}

impl ConfigError {
    /// One invalid value found after validation (while building state).
    pub(crate) fn invalid(key: &str, message: impl Into<String>) -> Self {
        ConfigError::Invalid {
            origin: String::new(),
            problems: vec![(key.to_owned(), message.into())],
        }
    }

    /// Keys named by this error (for tests and tooling).
    pub fn keys(&self) -> Vec<&str> {
        match self {
            ConfigError::Io { .. } => Vec::new(),
            ConfigError::Parse { key, .. } => vec![key.as_str()],
            ConfigError::Invalid { problems, .. } => {
                problems.iter().map(|(k, _)| k.as_str()).collect()
            }
        }
    }
}

fn join_problems(problems: &[(String, String)]) -> String {
    problems
        .iter()
        .map(|(k, m)| format!("key `{k}`: {m}"))
        .collect::<Vec<_>>()
        .join("; ")
}

/// Source of `COMPACTOR_*` overrides; the real one reads the process environment.
pub trait EnvSource {
    /// Value of the variable, if set (and valid unicode).
    fn get(&self, key: &str) -> Option<String>;
}

/// Reads the real process environment.
#[derive(Debug, Default, Clone, Copy)]
pub struct ProcessEnv;

impl EnvSource for ProcessEnv {
    fn get(&self, key: &str) -> Option<String> {
        std::env::var(key).ok()
    }
}

/// An env source backed by a map (tests, embedding).
#[derive(Debug, Default, Clone)]
pub struct MapEnv(pub(crate) BTreeMap<String, String>);

impl MapEnv {
    /// Builds from `(key, value)` pairs.
    // Only tests build an environment from pairs.
    #[cfg(test)]
    pub(crate) fn from_pairs<'a>(pairs: impl IntoIterator<Item = (&'a str, &'a str)>) -> Self {
        MapEnv(
            pairs
                .into_iter()
                .map(|(k, v)| (k.to_owned(), v.to_owned()))
                .collect(),
        )
    }
}

impl EnvSource for MapEnv {
    fn get(&self, key: &str) -> Option<String> {
        self.0.get(key).cloned()
    }
}

/// Settings given on the command line (`compactor --upstream URL --listen
/// ADDR`): applied over the file and the `COMPACTOR_*` environment, then
/// validated with the rest (a bad value is named by its key).
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Overrides {
    /// `--listen`: the `listen` key.
    pub listen: Option<String>,
    /// `--upstream`: the `upstream` key.
    pub upstream: Option<String>,
}

/// Log output format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    /// Human-readable lines.
    #[default]
    Text,
    /// One JSON object per line.
    Json,
}

/// Validated `[limits]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Limits {
    /// Open client connections at most.
    pub(crate) max_connections: usize,
    /// Chat request body bytes buffered at once, all requests together.
    pub(crate) max_buffered_body_bytes: u64,
}

/// Validated timeouts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Timeouts {
    /// TCP (+TLS) connect.
    pub(crate) connect: Duration,
    /// Request sent → response head received.
    pub(crate) first_byte: Duration,
    /// Silence between response body frames.
    pub(crate) idle: Duration,
    /// Shutdown grace period.
    pub(crate) shutdown_grace: Duration,
    /// Request head → end of the request body.
    pub(crate) body_read: Duration,
    /// Client connection without a request and without bytes.
    pub(crate) client_idle: Duration,
    /// Idle pooled upstream connections are dropped after this.
    pub upstream_pool_idle: Duration,
}

/// Validated session settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct SessionConfig {
    /// Lower-cased header names, in lookup order.
    pub(crate) headers: Vec<String>,
    /// Idle TTL.
    pub(crate) ttl: Duration,
    /// Maximum sessions.
    pub(crate) max_sessions: usize,
    /// Bound on the bytes of all compaction records (least recently used
    /// evicted first).
    pub(crate) max_record_bytes: usize,
}

/// The upstream base URL, split for joining.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UpstreamBase {
    /// `http` or `https`.
    pub(crate) scheme: http::uri::Scheme,
    /// `host[:port]` exactly as configured; also the Host header sent upstream.
    pub(crate) authority: http::uri::Authority,
    /// Path prefix without trailing slash (`""` or e.g. `/api`).
    pub(crate) path_prefix: String,
}

/// `scheme://authority/prefix`: logs and the window cache key.
impl std::fmt::Display for UpstreamBase {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{}://{}{}",
            self.scheme, self.authority, self.path_prefix
        )
    }
}

impl UpstreamBase {
    /// Whether the upstream speaks TLS.
    // Only tests read it.
    #[cfg(test)]
    pub(crate) fn is_https(&self) -> bool {
        self.scheme == http::uri::Scheme::HTTPS
    }

    /// Parses and checks an upstream base URL.
    pub(crate) fn parse(s: &str) -> Result<Self, String> {
        let uri: Uri = s
            .parse()
            .map_err(|e| format!("not a valid URL ({e}): {s:?}"))?;
        let scheme = uri
            .scheme()
            .cloned()
            .ok_or_else(|| format!("must start with http:// or https://: {s:?}"))?;
        if scheme != http::uri::Scheme::HTTP && scheme != http::uri::Scheme::HTTPS {
            return Err(format!("scheme must be http or https: {s:?}"));
        }
        let authority = uri
            .authority()
            .cloned()
            .ok_or_else(|| format!("missing host: {s:?}"))?;
        if authority.as_str().contains('@') {
            return Err("credentials in the upstream URL are not supported".to_owned());
        }
        if uri.query().is_some() {
            return Err(format!("must not carry a query string: {s:?}"));
        }
        let path_prefix = uri.path().trim_end_matches('/').to_owned();
        Ok(UpstreamBase {
            scheme,
            authority,
            path_prefix,
        })
    }
}

/// The validated configuration.
#[derive(Debug, Clone)]
pub struct Config {
    /// Listen address (port 0 = ephemeral).
    pub(crate) listen: SocketAddr,
    /// Upstream base URL.
    pub(crate) upstream: UpstreamBase,
    /// Extra trusted root CA PEM file.
    pub(crate) upstream_ca_file: Option<PathBuf>,
    /// Request body limit.
    pub max_body_bytes: u64,
    /// Timeouts.
    pub timeouts: Timeouts,
    /// Connection and buffering caps.
    pub(crate) limits: Limits,
    /// Sessions.
    pub(crate) session: SessionConfig,
    /// The engine's settings (`[compaction]`), validated.
    pub(crate) compaction: crate::compaction::config::CompactionConfig,
    /// `compaction.summary_endpoint`, parsed once: where summary calls go
    /// instead of the upstream.
    pub(crate) summary_endpoint: Option<UpstreamBase>,
    /// Per-model settings.
    pub(crate) models: BTreeMap<String, ModelConfig>,
    /// Fallback context length.
    pub(crate) default_context_length: Option<u64>,
    /// Admin bearer token.
    pub(crate) admin_token: Option<String>,
    /// `[admin] show_content`.
    pub(crate) admin_show_content: bool,
    /// `[admin] turn_history`.
    pub(crate) admin_turn_history: usize,
    /// Add `x-compactor-*` response headers.
    pub expose_headers: bool,
    /// `[server] underscores_in_headers`: forward request header fields
    /// whose name has an `_` (off: dropped, as nginx does, so that
    /// `Content_Length` or `Transfer_Encoding` can not reach an upstream
    /// that reads `_` as `-` next to the framing compactor wrote).
    pub(crate) underscores_in_headers: bool,
    /// Log format.
    pub log_format: LogFormat,
    /// Where records outlive the process (`[store]`).
    pub store: crate::store::StoreConfig,
}

impl Default for Config {
    fn default() -> Self {
        // Built-in defaults are validated by a unit test, so this cannot fail
        // in practice; fall back field by field anyway to stay panic-free.
        match RawConfig::default().validate("") {
            Ok(c) => c,
            Err(_) => Config {
                listen: SocketAddr::from(([127, 0, 0, 1], 4000)),
                upstream: UpstreamBase {
                    scheme: http::uri::Scheme::HTTP,
                    authority: http::uri::Authority::from_static("127.0.0.1:8080"),
                    path_prefix: String::new(),
                },
                upstream_ca_file: None,
                max_body_bytes: DEFAULT_MAX_BODY_BYTES,
                timeouts: Timeouts {
                    connect: Duration::from_secs(10),
                    first_byte: Duration::from_secs(600),
                    idle: Duration::from_secs(300),
                    shutdown_grace: Duration::from_secs(30),
                    body_read: Duration::from_secs(60),
                    client_idle: Duration::from_secs(60),
                    upstream_pool_idle: Duration::from_secs(1),
                },
                limits: Limits {
                    max_connections: 4096,
                    max_buffered_body_bytes: 512 << 20,
                },
                session: SessionConfig {
                    headers: Vec::new(),
                    ttl: Duration::from_secs(3600),
                    max_sessions: 10_000,
                    max_record_bytes: DEFAULT_MAX_RECORD_BYTES,
                },
                compaction: crate::compaction::config::CompactionConfig::default(),
                summary_endpoint: None,
                models: BTreeMap::new(),
                default_context_length: None,
                admin_token: None,
                admin_show_content: false,
                admin_turn_history: DEFAULT_TURN_HISTORY,
                expose_headers: true,
                underscores_in_headers: false,
                log_format: LogFormat::Text,
                store: crate::store::StoreConfig::default(),
            },
        }
    }
}

impl Config {
    /// Loads the configuration the binary uses: `path` if given (must exist),
    /// else `./proxy.toml` if present, else defaults; then env overrides.
    pub fn load(path: Option<&Path>, env: &dyn EnvSource) -> Result<Config, ConfigError> {
        Self::load_with(path, env, &Overrides::default())
    }

    /// [`Config::load`], then the command line's `flags` over the file and
    /// the environment.
    pub fn load_with(
        path: Option<&Path>,
        env: &dyn EnvSource,
        flags: &Overrides,
    ) -> Result<Config, ConfigError> {
        let (text, origin) = match path {
            Some(p) => (read(p)?, Some(p.to_path_buf())),
            None => {
                let p = Path::new(DEFAULT_CONFIG_FILE);
                if p.is_file() {
                    (read(p)?, Some(p.to_path_buf()))
                } else {
                    (String::new(), None)
                }
            }
        };
        let origin = origin
            .map(|p| format!(" in {}", p.display()))
            .unwrap_or_default();
        Self::parse(&text, env, flags, &origin)
    }

    /// Parses TOML text and applies env overrides (no filesystem access for
    /// the config itself).
    pub fn from_toml_str(text: &str, env: &dyn EnvSource) -> Result<Config, ConfigError> {
        Self::parse(text, env, &Overrides::default(), "")
    }

    /// File text, then `env`, then `flags`; validated as a whole.
    fn parse(
        text: &str,
        env: &dyn EnvSource,
        flags: &Overrides,
        origin: &str,
    ) -> Result<Config, ConfigError> {
        let mut raw: RawConfig = toml::from_str(text).map_err(|e| parse_error(&e, text, origin))?;
        raw.apply_env(env, origin)?;
        raw.apply_flags(flags);
        raw.validate(origin)
    }
}

fn read(path: &Path) -> Result<String, ConfigError> {
    std::fs::read_to_string(path).map_err(|source| ConfigError::Io {
        path: path.to_path_buf(),
        source,
    })
}
