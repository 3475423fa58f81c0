//! `[store]`: where records outlive the process.
//!
//! ```toml
//! [store]
//! backend = "file"          # "memory" | "file" | "redis" ("redb": an alias of
//!                           # "file"); unset: the binary uses the file, an
//!                           # embedding program (and the tests) memory
//! path = "/var/lib/compactor/state.log"    # the file; implies backend = "file"
//! url = "redis://:pass@cache:6379/0"       # redis:// or rediss://; implies "redis"
//! timeout_ms = 250          # a slower store call counts as failed
//! ```
//!
//! `COMPACTOR_STORE_BACKEND`, `COMPACTOR_STORE_PATH` and
//! `COMPACTOR_STORE_URL` override them. The
//! store's TTL and byte bound are the memory's: `[session] ttl_secs` and
//! `max_record_bytes`.

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;

/// Default per-call store timeout.
pub(crate) const DEFAULT_TIMEOUT_MS: u64 = 250;

/// `[store]` as written.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RawStore {
    /// `memory`, `file` (or its old name `redb`) or `redis`.
    pub backend: Option<String>,
    /// The state file.
    pub(crate) path: Option<PathBuf>,
    /// The Redis/Valkey URL (`redis://[user:pass@]host:port/db`, `rediss://`).
    pub(crate) url: Option<String>,
    /// Per-call timeout in milliseconds.
    pub(crate) timeout_ms: Option<u64>,
}

impl RawStore {
    /// Applies `COMPACTOR_STORE_BACKEND` / `COMPACTOR_STORE_PATH` (an empty
    /// value unsets).
    pub(crate) fn apply_env(&mut self, backend: Option<String>, path: Option<String>) {
        if let Some(b) = backend {
            self.backend = (!b.trim().is_empty()).then_some(b);
        }
        if let Some(p) = path {
            self.path = (!p.trim().is_empty()).then(|| PathBuf::from(p));
        }
    }

    /// Applies `COMPACTOR_STORE_URL` (an empty value unsets).
    pub(crate) fn apply_url_env(&mut self, url: Option<String>) {
        if let Some(u) = url {
            self.url = (!u.trim().is_empty()).then_some(u);
        }
    }

    /// Validates into a [`StoreConfig`]; `Err((key, message))` names the
    /// offending key.
    pub(crate) fn validate(
        &self,
        ttl: Duration,
        max_bytes: usize,
    ) -> Result<StoreConfig, (String, String)> {
        let timeout_ms = self.timeout_ms.unwrap_or(DEFAULT_TIMEOUT_MS);
        if timeout_ms == 0 {
            return Err(("store.timeout_ms".into(), "must be positive".into()));
        }
        if let Some(url) = &self.url {
            if let Err(e) = super::resp::RedisUrl::parse(url) {
                return Err(("store.url".into(), e.to_string()));
            }
        }
        let backend = self.backend.as_deref().map(str::trim);
        let backend_is_redb = backend == Some("redb");
        match (backend, &self.url) {
            (None | Some("redis"), Some(url)) => {
                return Ok(StoreConfig {
                    backend: StoreBackend::Redis(url.clone()),
                    explicit: true,
                    redb_alias: false,
                    ttl,
                    max_bytes,
                    timeout: Duration::from_millis(timeout_ms),
                })
            }
            (Some("redis"), None) => {
                return Err((
                    "store.url".into(),
                    "backend \"redis\" needs a url (redis://host:port)".into(),
                ))
            }
            _ => {}
        }
        let (backend, explicit) = match (backend, &self.path) {
            (None, None) => (StoreBackend::Memory, false),
            (Some("memory"), _) => (StoreBackend::Memory, true),
            (None | Some("file" | "redb"), Some(p)) => (StoreBackend::File(p.clone()), true),
            (Some("file" | "redb"), None) => match default_path() {
                Some(p) => (StoreBackend::File(p), true),
                None => {
                    return Err((
                        "store.path".into(),
                        "no state directory (set XDG_STATE_HOME or HOME, or store.path)".into(),
                    ))
                }
            },
            (Some(other), _) => {
                return Err((
                    "store.backend".into(),
                    format!("expected \"memory\", \"file\" or \"redis\", got {other:?}"),
                ))
            }
        };
        Ok(StoreConfig {
            backend,
            explicit,
            redb_alias: backend_is_redb,
            ttl,
            max_bytes,
            timeout: Duration::from_millis(timeout_ms),
        })
    }
}

/// Which backend.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StoreBackend {
    /// Nothing outlives the process.
    Memory,
    /// The embedded append-only log file.
    File(PathBuf),
    /// A Redis/Valkey server (the URL, credentials included: never logged).
    Redis(String),
}

/// Validated `[store]`.
#[derive(Debug, Clone)]
pub struct StoreConfig {
    /// The backend.
    pub backend: StoreBackend,
    /// Whether the backend was chosen (by `backend`, `path` or their env
    /// variables) rather than left to the default.
    pub explicit: bool,
    /// The backend was named by its old name, `redb` (logged at open).
    pub redb_alias: bool,
    /// Idle time after which a record is dropped.
    pub ttl: Duration,
    /// Bound on the bytes the records hold together.
    pub max_bytes: usize,
    /// Per-call timeout.
    pub timeout: Duration,
}

impl Default for StoreConfig {
    fn default() -> Self {
        Self {
            backend: StoreBackend::Memory,
            explicit: false,
            redb_alias: false,
            ttl: Duration::from_secs(3600),
            max_bytes: 256 << 20,
            timeout: Duration::from_millis(DEFAULT_TIMEOUT_MS),
        }
    }
}

impl StoreConfig {
    /// The binary's default: the state file under the user's state directory
    /// unless a backend was chosen. Stays memory when there is no state
    /// directory.
    pub fn use_binary_default(&mut self) {
        if self.explicit {
            return;
        }
        if let Some(p) = default_path() {
            self.backend = StoreBackend::File(p);
        }
    }
}

/// `$XDG_STATE_HOME/compactor/state.log`, else
/// `~/.local/state/compactor/state.log` (a `state.redb` of the backend
/// before it, beside it, is left as it is).
pub(crate) fn default_path() -> Option<PathBuf> {
    default_path_from(
        std::env::var_os("XDG_STATE_HOME").map(PathBuf::from),
        std::env::var_os("HOME").map(PathBuf::from),
    )
}

fn default_path_from(xdg: Option<PathBuf>, home: Option<PathBuf>) -> Option<PathBuf> {
    let base = xdg.filter(|p| p.is_absolute()).or_else(|| {
        home.filter(|h| !h.as_os_str().is_empty())
            .map(|h| h.join(".local/state"))
    })?;
    Some(base.join("compactor").join(Path::new("state.log")))
}

#[cfg(test)]
mod tests {
    use super::*;

    const TTL: Duration = Duration::from_secs(60);

    #[test]
    fn unset_is_memory_and_not_explicit() {
        let c = RawStore::default().validate(TTL, 10).unwrap();
        assert_eq!(c.backend, StoreBackend::Memory);
        assert!(!c.explicit);
        assert_eq!(c.timeout, Duration::from_millis(DEFAULT_TIMEOUT_MS));
    }

    #[test]
    fn path_implies_the_file_and_memory_wins_over_the_binary_default() {
        let raw = RawStore {
            path: Some("/tmp/x.log".into()),
            ..RawStore::default()
        };
        let c = raw.validate(TTL, 10).unwrap();
        assert_eq!(c.backend, StoreBackend::File("/tmp/x.log".into()));
        assert!(!c.redb_alias);
        let mut m = RawStore {
            backend: Some("memory".into()),
            ..RawStore::default()
        }
        .validate(TTL, 10)
        .unwrap();
        m.use_binary_default();
        assert_eq!(m.backend, StoreBackend::Memory);
    }

    #[test]
    fn redb_is_an_alias_of_the_file_backend() {
        let raw = RawStore {
            backend: Some("redb".into()),
            path: Some("/tmp/old.redb".into()),
            ..RawStore::default()
        };
        let c = raw.validate(TTL, 10).unwrap();
        assert_eq!(c.backend, StoreBackend::File("/tmp/old.redb".into()));
        assert!(c.redb_alias && c.explicit);
        let raw = RawStore {
            backend: Some("file".into()),
            path: Some("/tmp/s.log".into()),
            ..RawStore::default()
        };
        let c = raw.validate(TTL, 10).unwrap();
        assert_eq!(c.backend, StoreBackend::File("/tmp/s.log".into()));
        assert!(!c.redb_alias);
    }

    #[test]
    fn bad_values_name_their_key() {
        let raw = RawStore {
            backend: Some("etcd".into()),
            ..RawStore::default()
        };
        assert_eq!(raw.validate(TTL, 10).unwrap_err().0, "store.backend");
        let raw = RawStore {
            timeout_ms: Some(0),
            ..RawStore::default()
        };
        assert_eq!(raw.validate(TTL, 10).unwrap_err().0, "store.timeout_ms");
    }

    #[test]
    fn url_implies_redis_and_is_checked() {
        let raw = RawStore {
            url: Some("redis://:pw@127.0.0.1:6390/2".into()),
            ..RawStore::default()
        };
        let c = raw.validate(TTL, 10).unwrap();
        assert_eq!(
            c.backend,
            StoreBackend::Redis("redis://:pw@127.0.0.1:6390/2".into())
        );
        let raw = RawStore {
            url: Some("http://x".into()),
            ..RawStore::default()
        };
        assert_eq!(raw.validate(TTL, 10).unwrap_err().0, "store.url");
        let raw = RawStore {
            backend: Some("redis".into()),
            ..RawStore::default()
        };
        assert_eq!(raw.validate(TTL, 10).unwrap_err().0, "store.url");
        let mut raw = RawStore::default();
        raw.apply_url_env(Some("rediss://h".into()));
        assert!(matches!(
            raw.validate(TTL, 10).unwrap().backend,
            StoreBackend::Redis(_)
        ));
    }

    #[test]
    fn env_overrides_and_empty_unsets() {
        let mut raw = RawStore {
            backend: Some("redb".into()),
            ..RawStore::default()
        };
        raw.apply_env(Some(String::new()), Some("/tmp/y.log".into()));
        assert_eq!(raw.backend, None);
        assert_eq!(raw.path, Some("/tmp/y.log".into()));
    }

    #[test]
    fn default_path_prefers_xdg_state_home() {
        assert_eq!(
            default_path_from(Some("/s".into()), Some("/h".into())),
            Some(PathBuf::from("/s/compactor/state.log"))
        );
        assert_eq!(
            default_path_from(Some("rel".into()), Some("/h".into())),
            Some(PathBuf::from("/h/.local/state/compactor/state.log"))
        );
        assert_eq!(default_path_from(None, None), None);
    }
}
