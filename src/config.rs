//! Configuration: `proxy.toml` + `COMPACTOR_*` environment overrides.
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

/// Default listen address (loopback: exposing the proxy is an explicit choice).
pub const DEFAULT_LISTEN: &str = "127.0.0.1:4000";
/// Default upstream: llama.cpp server's default address.
pub const DEFAULT_UPSTREAM: &str = "http://127.0.0.1:8080";
/// Default request body limit (32 MiB): long agent histories are big, but bounded.
pub const DEFAULT_MAX_BODY_BYTES: u64 = 32 * 1024 * 1024;
/// Default config file looked up in the working directory when `--config` is absent.
pub const DEFAULT_CONFIG_FILE: &str = "proxy.toml";

/// Session-id headers looked up in order: one list, kept next to the rule
/// syntax (`a+b`) it uses.
pub use crate::session::key::DEFAULT_SESSION_HEADERS;

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
    pub fn invalid(key: &str, message: impl Into<String>) -> Self {
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
pub struct MapEnv(pub BTreeMap<String, String>);

impl MapEnv {
    /// Builds from `(key, value)` pairs.
    pub fn from_pairs<'a>(pairs: impl IntoIterator<Item = (&'a str, &'a str)>) -> Self {
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

/// `proxy.toml` as written (before validation).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RawConfig {
    /// Listen address.
    pub listen: String,
    /// Upstream base URL (may carry a path prefix).
    pub upstream: String,
    /// Extra PEM root CA(s) trusted for an https upstream.
    pub upstream_ca_file: Option<PathBuf>,
    /// Request body limit in bytes.
    pub max_body_bytes: u64,
    /// Timeouts.
    pub timeouts: RawTimeouts,
    /// Connection and buffering caps.
    pub limits: RawLimits,
    /// Session identification and bounds.
    pub session: RawSession,
    /// Engine settings, validated into [`crate::compaction::config::CompactionConfig`].
    pub compaction: toml::Table,
    /// Per-model settings.
    pub models: BTreeMap<String, ModelConfig>,
    /// Context length used when nothing else is known.
    pub default_context_length: Option<u64>,
    /// Admin API.
    pub admin: AdminConfig,
    /// Response header policy.
    pub headers: HeadersConfig,
    /// Logging.
    pub log: LogConfig,
    /// Where records outlive the process.
    pub store: crate::store::config::RawStore,
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
            log: LogConfig::default(),
            store: crate::store::config::RawStore::default(),
        }
    }
}

/// `[timeouts]`, all in whole seconds.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RawTimeouts {
    /// TCP (+TLS) connect to the upstream.
    pub connect_secs: u64,
    /// From sending the request to the upstream's response head.
    pub first_byte_secs: u64,
    /// Maximum silence between two response body frames.
    pub idle_secs: u64,
    /// How long in-flight requests may run after SIGINT/SIGTERM.
    pub shutdown_grace_secs: u64,
    /// From the request head to the end of a request body compactor reads
    /// whole (chat) or forwards (passthrough).
    pub body_read_secs: u64,
    /// A client connection with no request in flight and no request bytes
    /// for this long is closed (also before its first request).
    pub client_idle_secs: u64,
    /// How long an idle pooled upstream connection is kept for reuse.
    pub upstream_pool_idle_secs: u64,
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
pub const DEFAULT_MAX_RECORD_BYTES: usize = 256 << 20;

/// `[limits]`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RawLimits {
    /// Open client connections at most; beyond it: 503 and close.
    pub max_connections: usize,
    /// Request body bytes buffered at once across all chat requests;
    /// beyond it: 503.
    pub max_buffered_body_bytes: u64,
}

impl Default for RawLimits {
    fn default() -> Self {
        RawLimits {
            max_connections: 4096,
            max_buffered_body_bytes: 512 << 20,
        }
    }
}

/// Validated `[limits]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Open client connections at most.
    pub max_connections: usize,
    /// Chat request body bytes buffered at once, all requests together.
    pub max_buffered_body_bytes: u64,
}

/// `[session]`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RawSession {
    /// Header names carrying a session id, first present wins.
    pub headers: Vec<String>,
    /// Idle time after which a session is forgotten.
    pub ttl_secs: u64,
    /// Maximum number of sessions held.
    pub max_sessions: usize,
    /// Bound on the bytes all compaction records hold together.
    pub max_record_bytes: usize,
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
pub struct ModelConfig {
    /// Context window in tokens.
    pub context_length: u64,
}

/// `[admin]`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AdminConfig {
    /// Bearer token for `/_compactor/sessions*` and `/_compactor/ui`; admin
    /// API and inspector disabled when absent.
    pub token: Option<String>,
    /// Whether the admin API shows the content of compaction records (the
    /// summary text). Off: everything it answers is content-free.
    pub show_content: bool,
    /// Turns whose figures each conversation keeps for the inspector.
    pub turn_history: usize,
}

/// Default `[admin] turn_history`.
pub const DEFAULT_TURN_HISTORY: usize = 200;
/// Largest `[admin] turn_history`.
pub const MAX_TURN_HISTORY: usize = 10_000;

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
pub struct HeadersConfig {
    /// Whether `x-compactor-*` response headers are added.
    pub expose: bool,
}

impl Default for HeadersConfig {
    fn default() -> Self {
        HeadersConfig { expose: true }
    }
}

/// `[log]`.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LogConfig {
    /// `text` or `json`.
    pub format: LogFormat,
}

/// Validated timeouts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Timeouts {
    /// TCP (+TLS) connect.
    pub connect: Duration,
    /// Request sent → response head received.
    pub first_byte: Duration,
    /// Silence between response body frames.
    pub idle: Duration,
    /// Shutdown grace period.
    pub shutdown_grace: Duration,
    /// Request head → end of the request body.
    pub body_read: Duration,
    /// Client connection without a request and without bytes.
    pub client_idle: Duration,
    /// Idle pooled upstream connections are dropped after this.
    pub upstream_pool_idle: Duration,
}

/// Validated session settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SessionConfig {
    /// Lower-cased header names, in lookup order.
    pub headers: Vec<String>,
    /// Idle TTL.
    pub ttl: Duration,
    /// Maximum sessions.
    pub max_sessions: usize,
    /// Bound on the bytes of all compaction records (least recently used
    /// evicted first).
    pub max_record_bytes: usize,
}

/// The upstream base URL, split for joining.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UpstreamBase {
    /// `http` or `https`.
    pub scheme: http::uri::Scheme,
    /// `host[:port]` exactly as configured; also the Host header sent upstream.
    pub authority: http::uri::Authority,
    /// Path prefix without trailing slash (`""` or e.g. `/api`).
    pub path_prefix: String,
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
    pub fn is_https(&self) -> bool {
        self.scheme == http::uri::Scheme::HTTPS
    }

    /// Parses and checks an upstream base URL.
    pub fn parse(s: &str) -> Result<Self, String> {
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
    pub listen: SocketAddr,
    /// Upstream base URL.
    pub upstream: UpstreamBase,
    /// Extra trusted root CA PEM file.
    pub upstream_ca_file: Option<PathBuf>,
    /// Request body limit.
    pub max_body_bytes: u64,
    /// Timeouts.
    pub timeouts: Timeouts,
    /// Connection and buffering caps.
    pub limits: Limits,
    /// Sessions.
    pub session: SessionConfig,
    /// The engine's settings (`[compaction]`), validated.
    pub compaction: crate::compaction::config::CompactionConfig,
    /// `compaction.summary_endpoint`, parsed once: where summary calls go
    /// instead of the upstream.
    pub summary_endpoint: Option<UpstreamBase>,
    /// Per-model settings.
    pub models: BTreeMap<String, ModelConfig>,
    /// Fallback context length.
    pub default_context_length: Option<u64>,
    /// Admin bearer token.
    pub admin_token: Option<String>,
    /// `[admin] show_content`.
    pub admin_show_content: bool,
    /// `[admin] turn_history`.
    pub admin_turn_history: usize,
    /// Add `x-compactor-*` response headers.
    pub expose_headers: bool,
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
        Self::parse(&text, env, &origin)
    }

    /// Parses TOML text and applies env overrides (no filesystem access for
    /// the config itself).
    pub fn from_toml_str(text: &str, env: &dyn EnvSource) -> Result<Config, ConfigError> {
        Self::parse(text, env, "")
    }

    fn parse(text: &str, env: &dyn EnvSource, origin: &str) -> Result<Config, ConfigError> {
        let mut raw: RawConfig = toml::from_str(text).map_err(|e| parse_error(&e, text, origin))?;
        raw.apply_env(env, origin)?;
        raw.validate(origin)
    }
}

fn read(path: &Path) -> Result<String, ConfigError> {
    std::fs::read_to_string(path).map_err(|source| ConfigError::Io {
        path: path.to_path_buf(),
        source,
    })
}

/// Turns a toml/serde error into one line naming the dotted key.
fn parse_error(e: &toml::de::Error, text: &str, origin: &str) -> ConfigError {
    let message = e.message().replace('\n', " ").trim().to_owned();
    let field = unknown_field_name(&message);
    let (section, line_key) = match e.span() {
        Some(span) => locate(text, span.start),
        None => (String::new(), None),
    };
    let leaf = field.or(line_key).unwrap_or_default();
    let key = match (section.is_empty(), leaf.is_empty()) {
        (true, true) => "<document>".to_owned(),
        (true, false) => leaf,
        (false, true) => section,
        (false, false) => format!("{section}.{leaf}"),
    };
    let line = e
        .span()
        .map(|s| text[..s.start.min(text.len())].matches('\n').count() + 1);
    let message = match line {
        Some(l) => format!("{message} (line {l})"),
        None => message,
    };
    ConfigError::Parse {
        origin: origin.to_owned(),
        key,
        message,
    }
}

/// `unknown field `x`, expected …` → `x`.
fn unknown_field_name(message: &str) -> Option<String> {
    let rest = message.strip_prefix("unknown field `")?;
    let end = rest.find('`')?;
    Some(rest[..end].to_owned())
}

/// Finds the `[table]` header in effect at `offset` and the key on that line.
fn locate(text: &str, offset: usize) -> (String, Option<String>) {
    let offset = offset.min(text.len());
    let before = &text[..offset];
    let line_start = before.rfind('\n').map(|i| i + 1).unwrap_or(0);
    let line_end = text[offset..]
        .find('\n')
        .map(|i| offset + i)
        .unwrap_or(text.len());
    let line = text[line_start..line_end].trim();
    let mut section = String::new();
    for l in before.lines() {
        let t = l.trim();
        if t.starts_with('[') {
            section = t
                .trim_start_matches('[')
                .split(']')
                .next()
                .unwrap_or_default()
                .trim()
                .to_owned();
        }
    }
    if line.starts_with('[') {
        let header = line
            .trim_start_matches('[')
            .split(']')
            .next()
            .unwrap_or_default()
            .trim()
            .to_owned();
        return (header, None);
    }
    let key = line
        .split('=')
        .next()
        .map(|k| k.trim().trim_matches('"').to_owned())
        .filter(|k| !k.is_empty() && !k.starts_with('#'));
    (section, key)
}

impl RawConfig {
    /// Applies `COMPACTOR_*` overrides. Unparseable values are reported under
    /// the env variable's name.
    fn apply_env(&mut self, env: &dyn EnvSource, origin: &str) -> Result<(), ConfigError> {
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
        if let Some(v) = env.get("COMPACTOR_EXPOSE_HEADERS") {
            match v.trim().to_ascii_lowercase().as_str() {
                "1" | "true" | "yes" | "on" => self.headers.expose = true,
                "0" | "false" | "no" | "off" => self.headers.expose = false,
                _ => problems.push((
                    "COMPACTOR_EXPOSE_HEADERS".to_owned(),
                    format!("expected true or false, got {v:?}"),
                )),
            }
        }
        if problems.is_empty() {
            Ok(())
        } else {
            Err(ConfigError::Invalid {
                origin: origin.to_owned(),
                problems,
            })
        }
    }

    /// Checks every value, collecting all problems.
    pub fn validate(self, origin: &str) -> Result<Config, ConfigError> {
        let mut problems = Problems::default();
        let listen = self.check_listen(&mut problems);
        let upstream = match UpstreamBase::parse(self.upstream.trim()) {
            Ok(u) => Some(u),
            Err(m) => {
                problems.bad("upstream", m);
                None
            }
        };
        self.check_limits(&mut problems);
        let headers = self.check_session_headers(&mut problems);
        let (compaction, summary_endpoint) =
            check_compaction(&self.compaction, upstream.as_ref(), &mut problems);
        let store = self
            .store
            .validate(
                Duration::from_secs(self.session.ttl_secs),
                self.session.max_record_bytes,
            )
            .map_err(|(key, m)| problems.bad(&key, m))
            .ok();
        if matches!(&self.admin.token, Some(t) if t.trim().is_empty()) {
            problems.bad("admin.token", "must not be empty (omit it to disable)");
        }
        if !(1..=MAX_TURN_HISTORY).contains(&self.admin.turn_history) {
            problems.bad(
                "admin.turn_history",
                format!("must be between 1 and {MAX_TURN_HISTORY}"),
            );
        }

        match (listen, upstream) {
            (Some(listen), Some(upstream)) if problems.0.is_empty() => {
                let store = store.unwrap_or_default();
                let t = &self.timeouts;
                Ok(Config {
                    compaction: compaction.unwrap_or_default(),
                    summary_endpoint,
                    listen,
                    upstream,
                    upstream_ca_file: self.upstream_ca_file,
                    max_body_bytes: self.max_body_bytes,
                    timeouts: Timeouts {
                        connect: Duration::from_secs(t.connect_secs),
                        first_byte: Duration::from_secs(t.first_byte_secs),
                        idle: Duration::from_secs(t.idle_secs),
                        shutdown_grace: Duration::from_secs(t.shutdown_grace_secs),
                        body_read: Duration::from_secs(t.body_read_secs),
                        client_idle: Duration::from_secs(t.client_idle_secs),
                        upstream_pool_idle: Duration::from_secs(t.upstream_pool_idle_secs),
                    },
                    limits: Limits {
                        max_connections: self.limits.max_connections,
                        max_buffered_body_bytes: self.limits.max_buffered_body_bytes,
                    },
                    session: SessionConfig {
                        headers,
                        ttl: Duration::from_secs(self.session.ttl_secs),
                        max_sessions: self.session.max_sessions,
                        max_record_bytes: self.session.max_record_bytes,
                    },
                    models: self.models,
                    default_context_length: self.default_context_length,
                    admin_token: self.admin.token,
                    admin_show_content: self.admin.show_content,
                    admin_turn_history: self.admin.turn_history,
                    expose_headers: self.headers.expose,
                    log_format: self.log.format,
                    store,
                })
            }
            _ => Err(ConfigError::Invalid {
                origin: origin.to_owned(),
                problems: problems.0,
            }),
        }
    }

    fn check_listen(&self, problems: &mut Problems) -> Option<SocketAddr> {
        let parsed = self.listen.trim().parse::<SocketAddr>().ok();
        if parsed.is_none() {
            problems.bad(
                "listen",
                format!(
                    "expected host:port with an IP address, got {:?}",
                    self.listen
                ),
            );
        }
        parsed
    }

    /// Sizes, timeouts, counts: the values that must be positive.
    fn check_limits(&self, problems: &mut Problems) {
        if let Some(p) = &self.upstream_ca_file {
            if !p.is_file() {
                problems.bad("upstream_ca_file", format!("no such file: {}", p.display()));
            }
        }
        let t = &self.timeouts;
        let s = &self.session;
        for (k, zero) in [
            ("max_body_bytes", self.max_body_bytes == 0),
            ("timeouts.connect_secs", t.connect_secs == 0),
            ("timeouts.first_byte_secs", t.first_byte_secs == 0),
            ("timeouts.idle_secs", t.idle_secs == 0),
            ("timeouts.body_read_secs", t.body_read_secs == 0),
            ("timeouts.client_idle_secs", t.client_idle_secs == 0),
            (
                "timeouts.upstream_pool_idle_secs",
                t.upstream_pool_idle_secs == 0,
            ),
            ("limits.max_connections", self.limits.max_connections == 0),
            (
                "limits.max_buffered_body_bytes",
                self.limits.max_buffered_body_bytes == 0,
            ),
            ("session.ttl_secs", s.ttl_secs == 0),
            ("session.max_sessions", s.max_sessions == 0),
            ("session.max_record_bytes", s.max_record_bytes == 0),
            (
                "default_context_length",
                self.default_context_length == Some(0),
            ),
        ] {
            if zero {
                problems.bad(k, "must be greater than 0");
            }
        }
        for (name, m) in &self.models {
            if m.context_length == 0 {
                problems.bad(
                    &format!("models.\"{name}\".context_length"),
                    "must be greater than 0",
                );
            }
        }
    }

    /// Each entry is `name` or `name+other` (see [`DEFAULT_SESSION_HEADERS`]),
    /// stored lowercased.
    fn check_session_headers(&self, problems: &mut Problems) -> Vec<String> {
        let mut headers = Vec::with_capacity(self.session.headers.len());
        for h in &self.session.headers {
            match crate::session::key::HeaderRule::parse(h.trim()) {
                Ok(rule) => headers.push(match rule.combine_with {
                    Some(other) => format!("{}+{other}", rule.name),
                    None => rule.name.as_str().to_owned(),
                }),
                Err(_) => {
                    problems.bad("session.headers", format!("not a valid header name: {h:?}"))
                }
            }
        }
        headers
    }
}

/// The engine's own table, its problem reported under `compaction.<key>`.
/// The engine stays free of the proxy's config types (it is a leaf), so its
/// error is folded into [`ConfigError::Invalid`] here, at the one boundary.
fn check_compaction(
    table: &toml::Table,
    upstream: Option<&UpstreamBase>,
    problems: &mut Problems,
) -> (
    Option<crate::compaction::config::CompactionConfig>,
    Option<UpstreamBase>,
) {
    let parsed = match crate::compaction::config::CompactionConfig::from_table(table) {
        Ok(c) => c,
        Err(e) => {
            let key = e
                .key
                .as_deref()
                .map_or("compaction".to_owned(), |k| format!("compaction.{k}"));
            problems.bad(&key, e.message);
            return (None, None);
        }
    };
    // Checked here, not at use: a typo must not silently send summary calls
    // (with the client's credentials) to the main upstream.
    let endpoint =
        parsed
            .summary_endpoint
            .as_deref()
            .and_then(|ep| match UpstreamBase::parse(ep) {
                Ok(base) => Some(base),
                Err(m) => {
                    problems.bad("compaction.summary_endpoint", m);
                    None
                }
            });
    // Without a key of its own, the summary call carries the client's
    // credential: only acceptable when it goes to the upstream's own host.
    if let (Some(ep), None) = (&endpoint, &parsed.summary_api_key) {
        let same_origin =
            upstream.is_some_and(|u| u.scheme == ep.scheme && u.authority == ep.authority);
        if !same_origin {
            problems.bad(
                "compaction.summary_api_key",
                "required when compaction.summary_endpoint is not on the upstream's host \
                 (the client's own key would be sent there)",
            );
        }
    }
    (Some(parsed), endpoint)
}

/// (key, message) pairs collected while validating.
#[derive(Default)]
struct Problems(Vec<(String, String)>);

impl Problems {
    fn bad(&mut self, key: &str, message: impl Into<String>) {
        self.0.push((key.to_owned(), message.into()));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<Config, ConfigError> {
        Config::from_toml_str(text, &MapEnv::default())
    }

    #[test]
    fn defaults_when_empty() {
        let c = parse("").unwrap();
        assert_eq!(c.listen, "127.0.0.1:4000".parse::<SocketAddr>().unwrap());
        assert_eq!(c.upstream.authority.as_str(), "127.0.0.1:8080");
        assert_eq!(c.upstream.path_prefix, "");
        assert!(!c.upstream.is_https());
        assert_eq!(c.max_body_bytes, 32 * 1024 * 1024);
        assert_eq!(c.timeouts.connect, Duration::from_secs(10));
        assert_eq!(c.timeouts.first_byte, Duration::from_secs(600));
        assert_eq!(c.timeouts.idle, Duration::from_secs(300));
        assert_eq!(c.timeouts.shutdown_grace, Duration::from_secs(30));
        assert_eq!(c.session.headers[0], "x-session-id");
        assert_eq!(c.session.headers.len(), DEFAULT_SESSION_HEADERS.len());
        assert_eq!(c.session.ttl, Duration::from_secs(3600));
        assert_eq!(c.session.max_sessions, 10_000);
        assert!(c.expose_headers);
        assert_eq!(c.log_format, LogFormat::Text);
        assert!(c.admin_token.is_none());
        assert_eq!(
            c.compaction.threshold_percent,
            crate::compaction::config::CompactionConfig::default().threshold_percent
        );
        // Config::default() is the same thing.
        assert_eq!(Config::default().listen, c.listen);
    }

    #[test]
    fn full_file_parses() {
        let c = parse(
            r#"
listen = "0.0.0.0:9000"
upstream = "https://openrouter.ai/api/"
max_body_bytes = 1024
default_context_length = 8192
[timeouts]
connect_secs = 1
first_byte_secs = 2
idle_secs = 3
shutdown_grace_secs = 0
[session]
headers = ["X-My-Session"]
ttl_secs = 5
max_sessions = 6
[compaction]
threshold_percent = 75
strategy = "micro"
[models."gpt-4o"]
context_length = 128000
[admin]
token = "s3cret"
[headers]
expose = false
[log]
format = "json"
"#,
        )
        .unwrap();
        assert_eq!(c.listen.port(), 9000);
        assert!(c.upstream.is_https());
        assert_eq!(c.upstream.authority.as_str(), "openrouter.ai");
        assert_eq!(c.upstream.path_prefix, "/api");
        assert_eq!(c.max_body_bytes, 1024);
        assert_eq!(c.timeouts.idle, Duration::from_secs(3));
        assert_eq!(c.timeouts.shutdown_grace, Duration::ZERO);
        assert_eq!(c.session.headers, vec!["x-my-session".to_owned()]);
        assert!((c.compaction.effective_threshold_percent() - 0.75).abs() < 1e-9);
        assert_eq!(
            c.compaction.strategy,
            crate::compaction::config::Strategy::Micro
        );
        assert_eq!(c.models["gpt-4o"].context_length, 128_000);
        assert_eq!(c.default_context_length, Some(8192));
        assert_eq!(c.admin_token.as_deref(), Some("s3cret"));
        assert!(!c.expose_headers);
        assert_eq!(c.log_format, LogFormat::Json);
    }

    #[test]
    fn env_overrides_file() {
        let env = MapEnv::from_pairs([
            ("COMPACTOR_LISTEN", "127.0.0.1:0"),
            ("COMPACTOR_UPSTREAM", "http://llama:8080/prefix"),
            ("COMPACTOR_IDLE_SECS", "7"),
            ("COMPACTOR_LOG_FORMAT", "json"),
        ]);
        let c = Config::from_toml_str(
            "listen = \"127.0.0.1:1\"\nupstream = \"http://a:1\"\n",
            &env,
        )
        .unwrap();
        assert_eq!(c.listen.port(), 0);
        assert_eq!(c.upstream.authority.as_str(), "llama:8080");
        assert_eq!(c.upstream.path_prefix, "/prefix");
        assert_eq!(c.timeouts.idle, Duration::from_secs(7));
        assert_eq!(c.log_format, LogFormat::Json);
    }

    #[test]
    fn store_section_env_and_bounds() {
        use crate::store::StoreBackend;
        // Unset: memory here (the binary switches to the file), with the
        // session's TTL and byte bound.
        let c = parse("[session]\nttl_secs = 90\nmax_record_bytes = 4096\n").unwrap();
        assert_eq!(c.store.backend, StoreBackend::Memory);
        assert!(!c.store.explicit);
        assert_eq!(c.store.ttl, Duration::from_secs(90));
        assert_eq!(c.store.max_bytes, 4096);
        let c = parse("[store]\npath = \"/tmp/s.log\"\ntimeout_ms = 5\n").unwrap();
        assert_eq!(c.store.backend, StoreBackend::File("/tmp/s.log".into()));
        assert_eq!(c.store.timeout, Duration::from_millis(5));
        let env = MapEnv::from_pairs([("COMPACTOR_STORE_BACKEND", "memory")]);
        let c = Config::from_toml_str("[store]\nbackend = \"file\"\n", &env).unwrap();
        assert_eq!(c.store.backend, StoreBackend::Memory);
        assert!(c.store.explicit);
        let e = parse("[store]\nbackend = \"etcd\"\n").unwrap_err();
        assert_eq!(e.keys(), vec!["store.backend"]);
        let env = MapEnv::from_pairs([("COMPACTOR_STORE_URL", "redis://:pw@cache:6380/1")]);
        let c = Config::from_toml_str("", &env).unwrap();
        assert_eq!(
            c.store.backend,
            StoreBackend::Redis("redis://:pw@cache:6380/1".into())
        );
        let e = parse("[store]\nurl = \"cache:6379\"\n").unwrap_err();
        assert_eq!(e.keys(), vec!["store.url"]);
        assert!(!format!("{e}").contains("pw"));
    }

    #[test]
    fn bad_env_value_names_variable() {
        let env = MapEnv::from_pairs([("COMPACTOR_IDLE_SECS", "soon")]);
        let e = Config::from_toml_str("", &env).unwrap_err();
        assert_eq!(e.keys(), vec!["COMPACTOR_IDLE_SECS"]);
        assert!(e.to_string().contains("COMPACTOR_IDLE_SECS"));
    }

    #[test]
    fn unknown_top_level_key_is_named() {
        let e = parse("listen = \"127.0.0.1:1\"\nlisten_port = 3\n").unwrap_err();
        assert_eq!(e.keys(), vec!["listen_port"]);
        let s = e.to_string();
        assert!(s.contains("`listen_port`"), "{s}");
        assert!(s.contains("line 2"), "{s}");
        assert!(!s.contains('\n'), "one line: {s}");
    }

    #[test]
    fn unknown_nested_key_is_named_with_its_table() {
        let e = parse("[timeouts]\nconnect_secs = 1\nconect = 2\n").unwrap_err();
        assert_eq!(e.keys(), vec!["timeouts.conect"]);
        let e = parse("[models.\"m\"]\ncontext_len = 2\n").unwrap_err();
        assert_eq!(e.keys(), vec!["models.\"m\".context_len"]);
    }

    #[test]
    fn wrong_type_is_named() {
        let e = parse("[timeouts]\nidle_secs = \"ten\"\n").unwrap_err();
        assert_eq!(e.keys(), vec!["timeouts.idle_secs"]);
        let e = parse("[log]\nformat = \"xml\"\n").unwrap_err();
        assert_eq!(e.keys(), vec!["log.format"]);
    }

    #[test]
    fn invalid_values_all_reported() {
        let e = parse(
            "listen = \"localhost\"\nupstream = \"ftp://x\"\nmax_body_bytes = 0\n[timeouts]\nidle_secs = 0\n",
        )
        .unwrap_err();
        assert_eq!(
            e.keys(),
            vec!["listen", "upstream", "max_body_bytes", "timeouts.idle_secs"]
        );
        assert!(!e.to_string().contains('\n'));
    }

    #[test]
    fn upstream_parsing() {
        assert!(UpstreamBase::parse("http://h:1/?q=1").is_err());
        assert!(UpstreamBase::parse("h:1").is_err());
        assert!(UpstreamBase::parse("http://user:pw@h/").is_err());
        let u = UpstreamBase::parse("http://h:1///").unwrap();
        assert_eq!(u.path_prefix, "");
        let u = UpstreamBase::parse("https://h/a/b/").unwrap();
        assert_eq!(u.path_prefix, "/a/b");
    }

    /// The shipped proxy.toml parses, and every documented (commented) key
    /// is a real key with a value of the right type and the stated default.
    #[test]
    fn shipped_proxy_toml_documents_real_keys() {
        let text = include_str!("../proxy.toml");
        let c = parse(text).unwrap();
        assert_eq!(c.listen, Config::default().listen);
        let re =
            regex::Regex::new(r"^# ([a-z_]+ = .+|\[models\..+\]|context_length = .+)$").unwrap();
        let uncommented: String = text
            .lines()
            .map(|l| match re.captures(l) {
                Some(c) => c[1].to_owned(),
                None => l.to_owned(),
            })
            .collect::<Vec<_>>()
            .join("\n");
        let raw: RawConfig = toml::from_str(&uncommented).unwrap();
        let d = RawConfig::default();
        assert_eq!(raw.listen, d.listen);
        assert_eq!(raw.upstream, d.upstream);
        assert_eq!(raw.max_body_bytes, d.max_body_bytes);
        assert_eq!(raw.timeouts.connect_secs, d.timeouts.connect_secs);
        assert_eq!(raw.timeouts.first_byte_secs, d.timeouts.first_byte_secs);
        assert_eq!(raw.timeouts.idle_secs, d.timeouts.idle_secs);
        assert_eq!(
            raw.timeouts.shutdown_grace_secs,
            d.timeouts.shutdown_grace_secs
        );
        assert_eq!(raw.session.headers, d.session.headers);
        assert_eq!(raw.session.ttl_secs, d.session.ttl_secs);
        assert_eq!(raw.session.max_sessions, d.session.max_sessions);
        assert_eq!(raw.headers.expose, d.headers.expose);
        assert_eq!(raw.log.format, d.log.format);
        assert!(raw.admin.token.is_some());
        assert!(raw.upstream_ca_file.is_some());
        assert!(raw.default_context_length.is_some());
        assert_eq!(raw.models.len(), 1);
        // The documented [compaction] keys are real and show the defaults.
        let engine =
            crate::compaction::config::CompactionConfig::from_table(&raw.compaction).unwrap();
        let de = crate::compaction::config::CompactionConfig::default();
        assert!(raw.compaction.len() >= 10, "{:?}", raw.compaction);
        assert_eq!(engine.threshold_percent, de.threshold_percent);
        assert_eq!(engine.threshold_tokens, de.threshold_tokens);
        assert_eq!(engine.protect_first_n, de.protect_first_n);
        assert_eq!(engine.protect_last_n, de.protect_last_n);
        assert_eq!(engine.min_tail_user_messages, de.min_tail_user_messages);
        assert_eq!(engine.summary_target_ratio, de.summary_target_ratio);
        assert_eq!(engine.strategy, de.strategy);
        assert_eq!(engine.abort_on_summary_failure, de.abort_on_summary_failure);
        assert_eq!(
            engine.abort_on_degraded_summary,
            de.abort_on_degraded_summary
        );
        assert_eq!(engine.summary_timeout_secs, de.summary_timeout_secs);
    }

    #[test]
    fn max_record_bytes_default_value_and_validation() {
        let c = parse("").unwrap();
        assert_eq!(c.session.max_record_bytes, 256 << 20);
        let c = parse("[session]\nmax_record_bytes = 1048576\n").unwrap();
        assert_eq!(c.session.max_record_bytes, 1 << 20);
        let e = parse("[session]\nmax_record_bytes = 0\n").unwrap_err();
        assert_eq!(e.keys(), vec!["session.max_record_bytes"]);
        // proxy.toml documents the default.
        let doc = format!("# max_record_bytes = {}", 256 << 20);
        assert!(include_str!("../proxy.toml").contains(&doc));
    }

    #[test]
    fn admin_inspector_keys_defaults_values_and_validation() {
        let c = parse("").unwrap();
        assert!(!c.admin_show_content);
        assert_eq!(c.admin_turn_history, 200);
        let c = parse("[admin]\ntoken = \"t\"\nshow_content = true\nturn_history = 5\n").unwrap();
        assert!(c.admin_show_content);
        assert_eq!(c.admin_turn_history, 5);
        for bad in ["0", "10001"] {
            let e = parse(&format!("[admin]\nturn_history = {bad}\n")).unwrap_err();
            assert_eq!(e.keys(), vec!["admin.turn_history"], "{bad}");
        }
        assert!(parse("[admin]\nshow_content = \"yes\"\n").is_err());
        // proxy.toml documents both defaults.
        let doc = include_str!("../proxy.toml");
        assert!(doc.contains("# show_content = false"));
        assert!(doc.contains("# turn_history = 200"));
    }

    #[test]
    fn missing_ca_file_is_reported() {
        let e = parse("upstream_ca_file = \"/nonexistent/ca.pem\"\n").unwrap_err();
        assert_eq!(e.keys(), vec!["upstream_ca_file"]);
    }
}
