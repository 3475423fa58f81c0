//! Per (upstream, model) context-window resolution, lazy and cached.
//!
//! Order: the config table (`[models."name"] context_length`) → what the
//! upstream last enforced in an overflow error (newest evidence: it corrects
//! a discovered upper bound such as OpenRouter's model-level
//! `context_length`, and follows a llama.cpp restart with another `-c`) →
//! discovery (run once on first need; a miss is remembered for a
//! negative-cache TTL, except a model Ollama has not loaded yet, asked
//! again once it has answered: [`WindowCache::answered`]) → the configured
//! default.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use dashmap::DashMap;
use tokio::time::Instant;

use super::discover::{discover, Discovered, DiscoverySource, Miss, UpstreamGet};
use super::overflow::{Overflow, OverflowKind};

/// Where a resolved window came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum WindowSource {
    /// The config table.
    Config,
    /// An overflow error's numbers.
    Learned,
    /// Upstream discovery.
    Discovered(DiscoverySource),
    /// The configured default.
    Default,
    /// The configured default while Ollama loads the model: its window is
    /// asked for again once the model has answered.
    Loading,
}

/// A resolved window.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Resolved {
    /// Tokens.
    pub(crate) tokens: u64,
    /// Where it came from.
    pub(crate) source: WindowSource,
}

/// Settings of the cache.
#[derive(Debug, Clone)]
pub(crate) struct WindowConfig {
    /// `[models."name"] context_length` entries.
    pub(crate) models: HashMap<String, u64>,
    /// Used when nothing else is known (defaults to
    /// [`DEFAULT_CONTEXT_LENGTH`](crate::compaction::budget::DEFAULT_CONTEXT_LENGTH)).
    pub(crate) default_window: u64,
    /// How long a failed discovery is not retried.
    pub(crate) negative_ttl: Duration,
    /// Whether to probe the upstream at all.
    pub(crate) discovery: bool,
}

impl Default for WindowConfig {
    fn default() -> Self {
        Self {
            models: HashMap::new(),
            default_window: crate::compaction::budget::DEFAULT_CONTEXT_LENGTH,
            negative_ttl: Duration::from_secs(300),
            discovery: true,
        }
    }
}

#[derive(Debug, Clone, Copy)]
enum Discovery {
    NotTried,
    Found(Discovered),
    Missing {
        retry_at: Instant,
    },
    /// Ollama has not loaded the model: asked again after its first answer.
    NotLoaded {
        retry_at: Instant,
    },
    /// The model answered since it was found not loaded: probe once more
    /// (a second miss waits for the TTL, so a name `/api/ps` never lists
    /// is not probed on every request).
    Recheck,
}

#[derive(Debug)]
struct Slot {
    discovery: tokio::sync::Mutex<Discovery>,
    /// Window learned from an overflow error; 0 = none.
    learned: AtomicU64,
}

/// The cache; cheap to share behind an `Arc`.
#[derive(Debug)]
pub(crate) struct WindowCache {
    cfg: WindowConfig,
    /// By `upstream \n model` ([`slot_key`]).
    slots: DashMap<String, Arc<Slot>>,
}

impl WindowCache {
    /// A cache with `cfg`.
    pub(crate) fn new(cfg: WindowConfig) -> Self {
        Self {
            cfg,
            slots: DashMap::new(),
        }
    }

    /// The slot of (`upstream`, `model`) when one was made.
    fn existing(&self, upstream: &str, model: &str) -> Option<Arc<Slot>> {
        slot_key(upstream, model, |key| {
            self.slots.get(key).map(|s| Arc::clone(s.value()))
        })
    }

    fn slot(&self, upstream: &str, model: &str) -> Arc<Slot> {
        // Looked up under a read lock with a key built in a reused buffer:
        // every request resolves its window, and an owned key and the map's
        // write lock for each cost more than the rest of the lookup.
        let found = self.existing(upstream, model);
        if let Some(slot) = found {
            return slot;
        }
        let mut key = String::with_capacity(upstream.len() + 1 + model.len());
        slot_key(upstream, model, |k| key.push_str(k));
        // Clone the Arc out so no map guard lives past this statement.
        self.slots
            .entry(key)
            .or_insert_with(|| {
                Arc::new(Slot {
                    discovery: tokio::sync::Mutex::new(Discovery::NotTried),
                    learned: AtomicU64::new(0),
                })
            })
            .value()
            .clone()
    }

    fn config_window(&self, model: &str) -> Option<Resolved> {
        self.cfg
            .models
            .get(model)
            .filter(|n| **n > 0)
            .map(|&tokens| Resolved {
                tokens,
                source: WindowSource::Config,
            })
    }

    fn learned(slot: &Slot) -> Option<Resolved> {
        match slot.learned.load(Ordering::Relaxed) {
            0 => None,
            tokens => Some(Resolved {
                tokens,
                source: WindowSource::Learned,
            }),
        }
    }

    fn default_window(&self) -> Resolved {
        Resolved {
            tokens: self.cfg.default_window,
            source: WindowSource::Default,
        }
    }

    /// The window for (`upstream`, `model`), probing the upstream through
    /// `up` the first time it is needed. Concurrent callers for the same key
    /// share one probe.
    pub(crate) async fn resolve(
        &self,
        upstream: &str,
        model: &str,
        up: &dyn UpstreamGet,
    ) -> Resolved {
        if let Some(r) = self.config_window(model) {
            return r;
        }
        let slot = self.slot(upstream, model);
        if let Some(r) = Self::learned(&slot) {
            return r;
        }
        if !self.cfg.discovery {
            return self.default_window();
        }
        let mut state = slot.discovery.lock().await;
        let now = Instant::now();
        let run = match *state {
            Discovery::NotTried | Discovery::Recheck => true,
            Discovery::Missing { retry_at } | Discovery::NotLoaded { retry_at } => now >= retry_at,
            Discovery::Found(_) => false,
        };
        if run {
            let recheck = matches!(*state, Discovery::Recheck);
            let retry_at = Instant::now() + self.cfg.negative_ttl;
            *state = match discover(up, model).await {
                Ok(d) => Discovery::Found(d),
                Err(Miss::NotLoaded) if !recheck => Discovery::NotLoaded { retry_at },
                Err(_) => Discovery::Missing { retry_at },
            };
        }
        let found = *state;
        drop(state);
        // An overflow may have been learned while the probe ran.
        if let Some(r) = Self::learned(&slot) {
            return r;
        }
        match found {
            Discovery::Found(d) => Resolved {
                tokens: d.window,
                source: WindowSource::Discovered(d.source),
            },
            Discovery::NotLoaded { .. } | Discovery::Recheck => Resolved {
                source: WindowSource::Loading,
                ..self.default_window()
            },
            _ => self.default_window(),
        }
    }

    /// What is known without any I/O (admin views): like
    /// [`Self::resolve`] but never probes.
    // Only tests use it.
    #[cfg(test)]
    pub(crate) fn known(&self, upstream: &str, model: &str) -> Resolved {
        if let Some(r) = self.config_window(model) {
            return r;
        }
        let Some(slot) = self.existing(upstream, model) else {
            return self.default_window();
        };
        if let Some(r) = Self::learned(&slot) {
            return r;
        }
        match slot.discovery.try_lock().map(|s| *s) {
            Ok(Discovery::Found(d)) => Resolved {
                tokens: d.window,
                source: WindowSource::Discovered(d.source),
            },
            _ => self.default_window(),
        }
    }

    /// The upstream answered a request for `model`: a model Ollama had not
    /// loaded is loaded now, at the window its requests will get, so the
    /// next resolve asks `/api/ps` again instead of using the default until
    /// the TTL ends. Never waits: a probe running right now decides.
    pub(crate) fn answered(&self, upstream: &str, model: &str) {
        let Some(slot) = self.existing(upstream, model) else {
            return;
        };
        let state = slot.discovery.try_lock();
        if let Ok(mut state) = state {
            if matches!(*state, Discovery::NotLoaded { .. }) {
                *state = Discovery::Recheck;
            }
        }
    }

    /// Learns from an overflow error. Returns the window learned, if the
    /// error stated one. An output-budget overflow still states the window.
    pub(crate) fn learn(&self, upstream: &str, model: &str, overflow: &Overflow) -> Option<u64> {
        let limit = overflow.limit.filter(|l| *l > 0)?;
        // Guard against reading a request size as the window.
        if overflow.kind == OverflowKind::Prompt
            && overflow.prompt_tokens.is_some_and(|p| p < limit)
            && overflow.requested.is_none_or(|r| r <= limit)
        {
            return None;
        }
        self.learn_limit(upstream, model, limit);
        Some(limit)
    }

    /// Records `limit` as the window the upstream enforces.
    pub(crate) fn learn_limit(&self, upstream: &str, model: &str, limit: u64) {
        if limit > 0 {
            self.slot(upstream, model)
                .learned
                .store(limit, Ordering::Relaxed);
        }
    }
}

/// Runs `f` with the slot key of (`upstream`, `model`): `upstream \n model`,
/// unambiguous because an upstream URL has no line feed. Built in a
/// buffer the thread keeps.
fn slot_key<T>(upstream: &str, model: &str, f: impl FnOnce(&str) -> T) -> T {
    thread_local! {
        static KEY: std::cell::RefCell<String> = const { std::cell::RefCell::new(String::new()) };
    }
    KEY.with(|k| match k.try_borrow_mut() {
        Ok(mut key) => {
            key.clear();
            key.push_str(upstream);
            key.push('\n');
            key.push_str(model);
            f(&key)
        }
        // Re-entered from `f` (it never is): a key of its own.
        Err(_) => f(&format!("{upstream}\n{model}")),
    })
}

#[cfg(test)]
mod tests {
    use super::super::discover::tests::{llamacpp_props, FakeUpstream};
    use super::super::overflow::parse_overflow;
    use super::*;
    use serde_json::json;

    fn cache(models: &[(&str, u64)]) -> WindowCache {
        WindowCache::new(WindowConfig {
            models: models.iter().map(|(k, v)| ((*k).to_owned(), *v)).collect(),
            default_window: 4000,
            negative_ttl: Duration::from_secs(60),
            discovery: true,
        })
    }

    #[tokio::test]
    async fn config_wins_and_never_probes() {
        let c = cache(&[("m", 32768)]);
        let up = FakeUpstream::with(&[("/props", llamacpp_props(4096, 1))]);
        let r = c.resolve("u", "m", &up).await;
        assert_eq!(
            r,
            Resolved {
                tokens: 32768,
                source: WindowSource::Config
            }
        );
        assert!(up.asked().is_empty());
    }

    #[tokio::test]
    async fn discovery_runs_once_and_is_cached() {
        let c = cache(&[]);
        let up = FakeUpstream::with(&[("/props", llamacpp_props(4096, 1))]);
        assert_eq!(c.known("u", "m").source, WindowSource::Default);
        for _ in 0..3 {
            let r = c.resolve("u", "m", &up).await;
            assert_eq!(r.tokens, 4096);
            assert_eq!(
                r.source,
                WindowSource::Discovered(DiscoverySource::LlamaCppProps)
            );
        }
        assert_eq!(up.asked(), vec!["/props"]);
        assert_eq!(c.known("u", "m").tokens, 4096);
        // Another upstream is resolved on its own.
        let other = FakeUpstream::with(&[(
            "/v1/models",
            json!({"data":[{"id":"m","max_model_len":2048}]}),
        )]);
        assert_eq!(c.resolve("u2", "m", &other).await.tokens, 2048);
    }

    #[tokio::test(start_paused = true)]
    async fn negative_cache_ttl() {
        let c = cache(&[]);
        let up = FakeUpstream::default();
        assert_eq!(c.resolve("u", "m", &up).await.source, WindowSource::Default);
        let probes = up.asked().len();
        assert!(probes > 0);
        c.resolve("u", "m", &up).await;
        assert_eq!(up.asked().len(), probes, "miss cached");
        tokio::time::advance(Duration::from_secs(61)).await;
        c.resolve("u", "m", &up).await;
        assert_eq!(up.asked().len(), 2 * probes, "retried after the TTL");
    }

    #[tokio::test]
    async fn learned_from_each_overflow_wording() {
        let cases: &[(&str, u64)] = &[
            (
                r#"{"error":{"message":"This model's maximum context length is 4097 tokens. However, your messages resulted in 4294 tokens.","type":"invalid_request_error","code":"context_length_exceeded"}}"#,
                4097,
            ),
            (
                r#"{"error":{"code":400,"message":"request (13392 tokens) exceeds the available context size (8192 tokens), try increasing it","type":"exceed_context_size_error","n_prompt_tokens":13392,"n_ctx":8192}}"#,
                8192,
            ),
            (
                r#"{"error":{"message":"This model's maximum context length is 262144 tokens. However, you requested 0 output tokens and your prompt contains at least 262145 input tokens, for a total of at least 262145 tokens.","type":"BadRequestError","param":"input_tokens","code":400}}"#,
                262144,
            ),
            (
                r#"{"error":{"code":400,"message":"This endpoint's maximum context length is 32768 tokens. However, you requested about 42832 tokens (42832 of text input)."}}"#,
                32768,
            ),
            (
                r#"{"object":"error","message":"You passed 9000 input tokens and requested 1000 output tokens. However, the model's context length is only 8192 tokens, resulting in a maximum input length of 7192 tokens.","type":"BadRequestError","code":400}"#,
                8192,
            ),
        ];
        for (body, want) in cases {
            let c = cache(&[]);
            let up = FakeUpstream::with(&[("/props", llamacpp_props(999_999, 1))]);
            let o = parse_overflow(400, body.as_bytes()).unwrap();
            assert_eq!(c.learn("u", "m", &o), Some(*want), "{body}");
            let r = c.resolve("u", "m", &up).await;
            assert_eq!(
                r,
                Resolved {
                    tokens: *want,
                    source: WindowSource::Learned
                }
            );
        }
        // No numbers: nothing learned.
        let c = cache(&[]);
        let o = parse_overflow(400, br#"{"error":{"code":"context_length_exceeded","message":"Your input exceeds the context window of this model."}}"#).unwrap();
        assert_eq!(c.learn("u", "m", &o), None);
        assert_eq!(c.known("u", "m").source, WindowSource::Default);
    }

    #[tokio::test]
    async fn learned_overrides_discovered_but_not_config() {
        let c = cache(&[("pinned", 100_000)]);
        let up = FakeUpstream::with(&[(
            "/models",
            json!({"data":[{"id":"m","context_length":131072}]}),
        )]);
        assert_eq!(c.resolve("u", "m", &up).await.tokens, 131072);
        c.learn_limit("u", "m", 32768);
        assert_eq!(c.resolve("u", "m", &up).await.tokens, 32768);
        c.learn_limit("u", "pinned", 1000);
        assert_eq!(
            c.resolve("u", "pinned", &up).await.source,
            WindowSource::Config
        );
    }

    #[tokio::test]
    async fn discovery_disabled_uses_default() {
        let c = WindowCache::new(WindowConfig {
            discovery: false,
            default_window: 2048,
            ..WindowConfig::default()
        });
        let up = FakeUpstream::with(&[("/props", llamacpp_props(4096, 1))]);
        assert_eq!(
            c.resolve("u", "m", &up).await,
            Resolved {
                tokens: 2048,
                source: WindowSource::Default
            }
        );
        assert!(up.asked().is_empty());
    }

    #[tokio::test]
    async fn concurrent_first_use_probes_once() {
        let c = Arc::new(cache(&[]));
        let up = Arc::new(FakeUpstream::with(&[("/props", llamacpp_props(4096, 1))]));
        let mut tasks = Vec::new();
        for _ in 0..8 {
            let (c, up) = (c.clone(), up.clone());
            tasks.push(tokio::spawn(async move {
                c.resolve("u", "m", &*up).await.tokens
            }));
        }
        for t in tasks {
            assert_eq!(t.await.unwrap(), 4096);
        }
        assert_eq!(up.asked(), vec!["/props"]);
    }

    fn ollama_ps(loaded: &[(&str, u64)]) -> FakeUpstream {
        let models: Vec<_> = loaded
            .iter()
            .map(|(name, n)| json!({"name": name, "model": name, "context_length": n}))
            .collect();
        FakeUpstream::with(&[("/api/ps", json!({ "models": models }))])
    }

    #[tokio::test]
    async fn a_model_ollama_loads_on_its_first_request_is_asked_again_after_it() {
        let c = cache(&[]);
        // The first request: Ollama has nothing loaded.
        let before = ollama_ps(&[]);
        let r = c.resolve("u", "llama3.2", &before).await;
        assert_eq!((r.tokens, r.source), (4000, WindowSource::Loading));
        // Loaded by that request, but nothing has answered yet: no probe.
        let after = ollama_ps(&[("llama3.2:latest", 4096)]);
        assert_eq!(c.resolve("u", "llama3.2", &after).await.tokens, 4000);
        assert!(after.asked().is_empty());
        // It answered: the next request asks `/api/ps` once more.
        c.answered("u", "llama3.2");
        let r = c.resolve("u", "llama3.2", &after).await;
        assert_eq!(r.tokens, 4096);
        assert_eq!(
            r.source,
            WindowSource::Discovered(DiscoverySource::OllamaPs)
        );
        assert!(after.asked().contains(&"/api/ps".to_owned()));
    }

    #[tokio::test]
    async fn a_name_ollama_never_lists_is_rechecked_once_not_per_answer() {
        let c = cache(&[]);
        let up = ollama_ps(&[("other:latest", 8192)]);
        assert_eq!(c.resolve("u", "m", &up).await.tokens, 4000);
        c.answered("u", "m");
        assert_eq!(c.resolve("u", "m", &up).await.tokens, 4000);
        let probes = up.asked().len();
        // Missed again after an answer: the TTL decides from now on.
        c.answered("u", "m");
        assert_eq!(c.resolve("u", "m", &up).await.tokens, 4000);
        assert_eq!(up.asked().len(), probes);
    }
}
