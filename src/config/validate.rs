//! `proxy.toml` checked: every value of the raw file validated into the
//! typed [`Config`], every problem collected under the key that caused it,
//! and a TOML error turned into one line that names its key.

use std::net::SocketAddr;
use std::time::Duration;

use super::raw::{RawConfig, MAX_TURN_HISTORY};
use super::{Config, ConfigError, Limits, SessionConfig, Timeouts, UpstreamBase};

/// Turns a toml/serde error into one line naming the dotted key.
pub(super) fn parse_error(e: &toml::de::Error, text: &str, origin: &str) -> ConfigError {
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
        if let Some(name) = table_name(l.trim()) {
            section = name;
        }
    }
    if let Some(header) = table_name(line) {
        return (header, None);
    }
    let key = line
        .split('=')
        .next()
        .map(|k| k.trim().trim_matches('"').to_owned())
        .filter(|k| !k.is_empty() && !k.starts_with('#'));
    (section, key)
}

/// The name of a `[table]` header line, `None` for any other line.
fn table_name(line: &str) -> Option<String> {
    line.starts_with('[').then(|| {
        line.trim_start_matches('[')
            .split(']')
            .next()
            .unwrap_or_default()
            .trim()
            .to_owned()
    })
}

impl RawConfig {
    /// Checks every value, collecting all problems.
    pub(crate) fn validate(self, origin: &str) -> Result<Config, ConfigError> {
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
                    underscores_in_headers: self.server.underscores_in_headers,
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
