//! Asking the upstream how big its context window is.
//!
//! Probes, in order (paths are relative to the upstream base URL; the
//! [`UpstreamGet`] implementation, `chat::Discovery` over
//! `Upstream::get_json`, joins them):
//! 1. llama.cpp `GET /props`: `default_generation_settings.n_ctx` is the
//!    per-slot window (what `exceed_context_size_error` enforces); with
//!    `total_slots > 1`, `GET /slots` is asked too and the smallest slot
//!    wins. Router mode is tried as `/props?model=<id>`.
//! 2. `GET /v1/models`, then `GET /models`: vLLM `max_model_len`, or
//!    OpenRouter-style `context_length` / `top_provider.context_length`
//!    (the smaller), for the entry whose `id` is the model. llama.cpp's
//!    `meta.n_ctx_train` is the training maximum, not the runtime window,
//!    and is ignored.
//! 3. Ollama `GET /api/ps`: `context_length` of the loaded model (the
//!    allocated window, which Ollama silently truncates to). A model not
//!    listed is not loaded yet ([`Miss::NotLoaded`]): the window cache asks
//!    again once the model has answered.

use serde_json::Value;

/// A failed probe; discovery treats it like "no answer".
#[derive(Debug, thiserror::Error)]
pub(crate) enum GetError {
    /// Transport failure or timeout.
    #[error("upstream request failed: {0}")]
    Transport(String),
    /// The body was not JSON.
    #[error("upstream answered with invalid JSON")]
    InvalidJson,
}

/// A JSON GET against the upstream. `Ok(None)` for a non-success status.
#[async_trait::async_trait]
pub(crate) trait UpstreamGet: Send + Sync {
    /// GETs `path` (relative to the upstream base, may carry a query).
    async fn get_json(&self, path: &str) -> Result<Option<Value>, GetError>;
}

/// Which probe found the window.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum DiscoverySource {
    /// llama.cpp `/props` (per slot).
    LlamaCppProps,
    /// llama.cpp `/slots` (smallest slot).
    LlamaCppSlots,
    /// vLLM `max_model_len`.
    VllmMaxModelLen,
    /// OpenRouter-style `context_length`.
    ContextLength,
    /// Ollama `/api/ps` `context_length`.
    OllamaPs,
}

/// A discovered window.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Discovered {
    /// Tokens.
    pub(crate) window: u64,
    /// Where it came from.
    pub(crate) source: DiscoverySource,
}

fn positive(v: Option<&Value>) -> Option<u64> {
    v.and_then(Value::as_u64).filter(|n| *n > 0)
}

/// Percent-encodes a model id for a query string.
fn encode_query(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'~') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

async fn get(up: &dyn UpstreamGet, path: &str) -> Option<Value> {
    // A failing probe is just a missing answer: the next source is tried.
    up.get_json(path).await.ok().flatten()
}

async fn from_props(up: &dyn UpstreamGet, model: &str) -> Option<Discovered> {
    let mut props = get(up, "/props").await;
    let n_ctx = |p: &Option<Value>| {
        positive(
            p.as_ref()
                .and_then(|p| p.pointer("/default_generation_settings/n_ctx")),
        )
    };
    if n_ctx(&props).is_none() && !model.is_empty() {
        props = get(up, &format!("/props?model={}", encode_query(model))).await;
    }
    let per_slot = n_ctx(&props)?;
    let slots = positive(props.as_ref().and_then(|p| p.get("total_slots"))).unwrap_or(1);
    if slots > 1 {
        let smallest = get(up, "/slots").await.and_then(|v| {
            v.as_array()?
                .iter()
                .filter_map(|s| positive(s.get("n_ctx")))
                .min()
        });
        if let Some(s) = smallest.filter(|s| *s < per_slot) {
            return Some(Discovered {
                window: s,
                source: DiscoverySource::LlamaCppSlots,
            });
        }
    }
    Some(Discovered {
        window: per_slot,
        source: DiscoverySource::LlamaCppProps,
    })
}

fn from_model_list(list: &Value, model: &str) -> Option<Discovered> {
    let entries = list
        .get("data")
        .or_else(|| list.get("models"))
        .and_then(Value::as_array)
        .or_else(|| list.as_array())?;
    let entry = entries
        .iter()
        .find(|e| e.get("id").and_then(Value::as_str) == Some(model))
        .or_else(|| {
            // A server that serves exactly one model (vLLM, llama.cpp) may be
            // addressed by any name.
            (entries.len() == 1).then(|| &entries[0])
        })?;
    if let Some(n) = positive(entry.get("max_model_len")) {
        return Some(Discovered {
            window: n,
            source: DiscoverySource::VllmMaxModelLen,
        });
    }
    let model_level = positive(entry.get("context_length"));
    // The routed provider may have a smaller window than the model.
    let provider = positive(entry.pointer("/top_provider/context_length"));
    let window = match (model_level, provider) {
        (Some(a), Some(b)) => a.min(b),
        (a, b) => a.or(b)?,
    };
    Some(Discovered {
        window,
        source: DiscoverySource::ContextLength,
    })
}

fn from_ollama_ps(ps: &Value, model: &str) -> Option<Discovered> {
    let models = ps.get("models")?.as_array()?;
    // Ollama names carry an implicit `:latest` tag.
    let matches = |e: &Value, field: &str| {
        e.get(field)
            .and_then(Value::as_str)
            .is_some_and(|n| n == model || n.strip_suffix(":latest") == Some(model))
    };
    let entry = models
        .iter()
        .find(|e| matches(e, "name") || matches(e, "model"))?;
    Some(Discovered {
        window: positive(entry.get("context_length"))?,
        source: DiscoverySource::OllamaPs,
    })
}

/// Why no probe found the window.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Miss {
    /// No source answered for the model.
    Unknown,
    /// Ollama answered `/api/ps` without the model: it is not loaded yet,
    /// and Ollama loads it on the first request to it, at a window no
    /// probe can see before then (`/api/show` gives the model's maximum,
    /// which Ollama does not allocate unless asked).
    NotLoaded,
}

/// Runs the probes for `model`.
pub(crate) async fn discover(up: &dyn UpstreamGet, model: &str) -> Result<Discovered, Miss> {
    if let Some(d) = from_props(up, model).await {
        return Ok(d);
    }
    for path in ["/v1/models", "/models"] {
        if let Some(d) = get(up, path).await.and_then(|l| from_model_list(&l, model)) {
            return Ok(d);
        }
    }
    let Some(ps) = get(up, "/api/ps").await else {
        return Err(Miss::Unknown);
    };
    match from_ollama_ps(&ps, model) {
        Some(d) => Ok(d),
        None if ps.get("models").is_some_and(Value::is_array) => Err(Miss::NotLoaded),
        None => Err(Miss::Unknown),
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use serde_json::json;
    use std::collections::HashMap;
    use std::sync::Mutex;

    /// Fake upstream: path → JSON (absent = 404); records the paths asked.
    #[derive(Default)]
    pub(crate) struct FakeUpstream {
        pub(crate) routes: HashMap<String, Value>,
        pub(crate) asked: Mutex<Vec<String>>,
        pub(crate) fail: bool,
    }

    impl FakeUpstream {
        pub(crate) fn with(routes: &[(&str, Value)]) -> Self {
            Self {
                routes: routes
                    .iter()
                    .map(|(k, v)| ((*k).to_owned(), v.clone()))
                    .collect(),
                ..Self::default()
            }
        }
        pub(crate) fn asked(&self) -> Vec<String> {
            self.asked.lock().unwrap().clone()
        }
    }

    #[async_trait::async_trait]
    impl UpstreamGet for FakeUpstream {
        async fn get_json(&self, path: &str) -> Result<Option<Value>, GetError> {
            self.asked.lock().unwrap().push(path.to_owned());
            if self.fail {
                return Err(GetError::Transport("refused".into()));
            }
            Ok(self.routes.get(path).cloned())
        }
    }

    pub(crate) fn llamacpp_props(n_ctx: u64, slots: u64) -> Value {
        json!({"default_generation_settings":{"id":0,"id_task":-1,"n_ctx":n_ctx,"speculative":false,"is_processing":false,
          "params":{"n_predict":-1,"n_keep":0,"n_discard":0,"stream":true,"max_tokens":-1}},
         "total_slots":slots,
         "model_path":"../models/Meta-Llama-3.1-8B-Instruct-Q4_K_M.gguf",
         "chat_template":"...","modalities":{"vision":false},"build_info":"b1-abc","is_sleeping":false})
    }

    fn llamacpp_models() -> Value {
        json!({"object":"list","data":[{"id":"../models/Meta-Llama-3.1-8B-Instruct-Q4_K_M.gguf","object":"model",
          "created":1735142223,"owned_by":"llamacpp",
          "meta":{"vocab_type":2,"n_vocab":128256,"n_ctx_train":131072,"n_embd":4096,"n_params":8030261312u64,"size":4912898304u64}}]})
    }

    #[tokio::test]
    async fn llamacpp_props_per_slot() {
        let up = FakeUpstream::with(&[
            ("/props", llamacpp_props(4096, 1)),
            ("/v1/models", llamacpp_models()),
        ]);
        let d = discover(&up, "anything").await.unwrap();
        assert_eq!(
            d,
            Discovered {
                window: 4096,
                source: DiscoverySource::LlamaCppProps
            }
        );
        assert_eq!(up.asked(), vec!["/props"]);
    }

    #[tokio::test]
    async fn llamacpp_multi_slot_takes_smallest_slot() {
        let up = FakeUpstream::with(&[
            ("/props", llamacpp_props(8192, 4)),
            (
                "/slots",
                json!([{"id":0,"n_ctx":8192},{"id":1,"n_ctx":2048},{"id":2,"n_ctx":8192}]),
            ),
        ]);
        let d = discover(&up, "m").await.unwrap();
        assert_eq!(
            d,
            Discovered {
                window: 2048,
                source: DiscoverySource::LlamaCppSlots
            }
        );
        // Without /slots (disabled on the server) the per-slot value stands.
        let up = FakeUpstream::with(&[("/props", llamacpp_props(8192, 4))]);
        assert_eq!(discover(&up, "m").await.unwrap().window, 8192);
    }

    #[tokio::test]
    async fn llamacpp_training_context_is_not_a_window() {
        let up = FakeUpstream::with(&[("/v1/models", llamacpp_models())]);
        assert_eq!(discover(&up, "x").await, Err(Miss::Unknown));
    }

    #[tokio::test]
    async fn llamacpp_router_mode() {
        let up = FakeUpstream::with(&[("/props?model=org%2Fm%3Aq4", llamacpp_props(2048, 1))]);
        assert_eq!(discover(&up, "org/m:q4").await.unwrap().window, 2048);
    }

    #[tokio::test]
    async fn vllm_max_model_len() {
        let up = FakeUpstream::with(&[(
            "/v1/models",
            json!({"object":"list","data":[
                {"id":"Qwen/Qwen2.5-7B-Instruct-AWQ","object":"model","created":1700000000,"owned_by":"vllm","root":"Qwen/Qwen2.5-7B-Instruct-AWQ","parent":null,"max_model_len":4096,"permission":[]},
                {"id":"other","object":"model","max_model_len":32768}]}),
        )]);
        let d = discover(&up, "Qwen/Qwen2.5-7B-Instruct-AWQ").await.unwrap();
        assert_eq!(
            d,
            Discovered {
                window: 4096,
                source: DiscoverySource::VllmMaxModelLen
            }
        );
        assert_eq!(discover(&up, "other").await.unwrap().window, 32768);
        // With several models, an unknown name finds nothing.
        assert_eq!(discover(&up, "nope").await, Err(Miss::Unknown));
    }

    #[tokio::test]
    async fn openrouter_context_length() {
        let list = json!({"data":[
            {"id":"openai/gpt-4","canonical_slug":"openai/gpt-4","context_length":8192,
             "top_provider":{"context_length":8192,"max_completion_tokens":4096,"is_moderated":true}},
            {"id":"meta/llama","context_length":131072,"top_provider":{"context_length":32768}},
            {"id":"x/y","context_length":65536,"top_provider":{"context_length":null}}]});
        let up = FakeUpstream::with(&[("/models", list)]);
        let d = discover(&up, "openai/gpt-4").await.unwrap();
        assert_eq!(
            d,
            Discovered {
                window: 8192,
                source: DiscoverySource::ContextLength
            }
        );
        assert_eq!(discover(&up, "meta/llama").await.unwrap().window, 32768);
        assert_eq!(discover(&up, "x/y").await.unwrap().window, 65536);
        assert!(up.asked().contains(&"/v1/models".to_owned()));
    }

    #[tokio::test]
    async fn ollama_api_ps() {
        let up = FakeUpstream::with(&[
            (
                "/v1/models",
                json!({"object":"list","data":[{"id":"gemma3:latest","object":"model","created":1,"owned_by":"library"},{"id":"qwen3:8b","object":"model"}]}),
            ),
            (
                "/api/ps",
                json!({"models":[{"name":"gemma3:latest","model":"gemma3:latest","size":6591830464u64,"size_vram":5333539264u64,"context_length":4096}]}),
            ),
        ]);
        let d = discover(&up, "gemma3").await.unwrap();
        assert_eq!(
            d,
            Discovered {
                window: 4096,
                source: DiscoverySource::OllamaPs
            }
        );
        assert_eq!(discover(&up, "gemma3:latest").await.unwrap().window, 4096);
        // Not loaded: nothing known yet, and said so.
        assert_eq!(discover(&up, "qwen3:8b").await, Err(Miss::NotLoaded));
    }

    #[tokio::test]
    async fn failures_give_none() {
        let up = FakeUpstream {
            fail: true,
            ..FakeUpstream::default()
        };
        assert_eq!(discover(&up, "m").await, Err(Miss::Unknown));
        let up = FakeUpstream::with(&[
            ("/props", json!({"error":"nope"})),
            ("/v1/models", json!({"data":"x"})),
            ("/api/ps", json!({"error":"nope"})),
        ]);
        assert_eq!(discover(&up, "m").await, Err(Miss::Unknown));
    }
}
