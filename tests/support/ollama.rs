//! A scripted Ollama on `127.0.0.1:0`, as Ollama's documentation and its
//! issues (#4967, #3839, #14259) describe it:
//!
//! - `POST /api/chat`: streams NDJSON by default (one object a line, the
//!   last with `done: true`, `prompt_eval_count`, `eval_count`), one JSON
//!   object with `"stream": false`; `POST /v1/chat/completions` in OpenAI's
//!   shape (`options.num_ctx` is ignored there, as Ollama does);
//! - a model is loaded by its first request, at the request's
//!   `options.num_ctx` or the default window, and only then listed by
//!   `GET /api/ps` with that `context_length`;
//! - a prompt over the loaded window is answered 200 all the same: the
//!   oldest messages are dropped (system messages kept, the last message
//!   always), as `server/prompt.go` `chatPrompt` does, and the count is of
//!   what was kept;
//! - summary calls (one user message opening with compactor's summariser
//!   preamble) get the scripted summary.
//!
//! A prompt's tokens are the bytes of its `tools` and messages JSON / 4.

#![allow(clippy::unwrap_used, clippy::expect_used)]
#![allow(dead_code)]

use std::collections::HashMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use serde_json::{json, Value};
use tokio::net::TcpListener;

use super::chat::{default_summary, MICRO_PROMPT_START, SUMMARY_PROMPT_START};

type MockBody = UnsyncBoxBody<Bytes, Infallible>;

/// What the mock does; changeable while it runs.
#[derive(Debug, Clone)]
pub struct OllamaSettings {
    /// The window a model is loaded with when its request sets none.
    pub default_window: u64,
    /// Serve `GET /api/ps` (404 when off: an upstream that truncates
    /// silently and says nothing of its window).
    pub ps: bool,
    /// Summary text.
    pub summary: String,
}

impl Default for OllamaSettings {
    fn default() -> Self {
        Self {
            default_window: 4096,
            ps: true,
            summary: default_summary(),
        }
    }
}

/// One recorded request.
#[derive(Debug, Clone)]
pub struct OllamaSeen {
    pub path: String,
    pub body: Bytes,
    pub summary: bool,
    /// Prompt tokens sent.
    pub sent: u64,
    /// Prompt tokens kept (what the reply counts).
    pub kept: u64,
    /// Messages dropped from the front.
    pub dropped: usize,
    /// The window the model was loaded with for this request.
    pub window: u64,
}

impl OllamaSeen {
    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap()
    }
}

struct Shared {
    settings: Mutex<OllamaSettings>,
    seen: Mutex<Vec<OllamaSeen>>,
    /// Loaded models and their windows.
    loaded: Mutex<HashMap<String, u64>>,
}

/// A running mock.
pub struct OllamaMock {
    pub addr: SocketAddr,
    shared: Arc<Shared>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for OllamaMock {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl OllamaMock {
    pub async fn start(settings: OllamaSettings) -> OllamaMock {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let shared = Arc::new(Shared {
            settings: Mutex::new(settings),
            seen: Mutex::default(),
            loaded: Mutex::default(),
        });
        let task = super::serve_mock(listener, Arc::clone(&shared), serve);
        OllamaMock { addr, shared, task }
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub fn seen(&self) -> Vec<OllamaSeen> {
        self.shared.seen.lock().unwrap().clone()
    }

    /// Conversation requests (not summary calls).
    pub fn conversations(&self) -> Vec<OllamaSeen> {
        self.seen().into_iter().filter(|s| !s.summary).collect()
    }

    pub fn summaries(&self) -> Vec<OllamaSeen> {
        self.seen().into_iter().filter(|s| s.summary).collect()
    }

    pub fn last(&self) -> OllamaSeen {
        self.conversations().pop().expect("no conversation request")
    }
}

/// Ollama's names carry an implicit `:latest`.
fn base_name(model: &str) -> String {
    model.strip_suffix(":latest").unwrap_or(model).to_owned()
}

fn tokens(tools: &Value, messages: &[Value]) -> u64 {
    let tools = if tools.is_null() {
        0
    } else {
        tools.to_string().len()
    };
    let msgs: usize = messages.iter().map(|m| m.to_string().len() + 1).sum();
    ((tools + msgs) / 4) as u64
}

/// `chatPrompt`: from the front, the first start whose rendering (with
/// the system messages before it) fits; the last message at least.
/// Returns (kept tokens, messages dropped).
fn truncate(tools: &Value, messages: &[Value], window: u64) -> (u64, usize) {
    let n = messages.len();
    for i in 0..n {
        let mut kept: Vec<Value> = messages[..i]
            .iter()
            .filter(|m| m["role"] == "system")
            .cloned()
            .collect();
        kept.extend_from_slice(&messages[i..]);
        let t = tokens(tools, &kept);
        if t <= window || i + 1 == n {
            let dropped = i - (kept.len() - (n - i));
            // The runner cuts what still does not fit from the front.
            return (t.min(window), dropped);
        }
    }
    (0, 0)
}

fn is_summary(messages: &[Value]) -> bool {
    messages.len() == 1
        && messages[0]["role"] == "user"
        && messages[0]["content"].as_str().is_some_and(|c| {
            c.starts_with(SUMMARY_PROMPT_START) || c.starts_with(MICRO_PROMPT_START)
        })
}

fn reply(status: u16, ct: &str, body: String) -> Response<MockBody> {
    let mut resp = Response::new(Full::new(Bytes::from(body)).boxed_unsync());
    *resp.status_mut() = StatusCode::from_u16(status).unwrap();
    resp.headers_mut()
        .insert("content-type", ct.parse().unwrap());
    resp
}

/// The answer to a conversation request: a tool call when the last
/// message asks for the weather and tools are given, else fixed text.
fn answer(messages: &[Value], tools: &Value) -> (String, Option<Value>) {
    let asks = messages.last().is_some_and(|m| {
        m["role"] == "user" && m["content"].as_str().is_some_and(|c| c.contains("weather"))
    });
    if asks && tools.is_array() {
        let call = json!([{"function":{"name":"get_weather","arguments":{"city":"Tokyo"}}}]);
        return (String::new(), Some(call));
    }
    ("Noted, carry on.".to_owned(), None)
}

const CREATED: &str = "2026-12-07T10:00:00.000000Z";

fn ollama_chat(
    model: &Value,
    text: &str,
    calls: Option<Value>,
    counts: (u64, u64),
    stream: bool,
) -> Response<MockBody> {
    let (prompt, eval) = counts;
    let mut message = json!({"role": "assistant", "content": text});
    if let Some(c) = calls {
        message["tool_calls"] = c;
    }
    let done = |message: Value| {
        json!({"model": model, "created_at": CREATED, "message": message, "done_reason": "stop",
            "done": true, "total_duration": 1000, "load_duration": 10, "prompt_eval_count": prompt,
            "prompt_eval_duration": 100, "eval_count": eval, "eval_duration": 200})
    };
    if !stream {
        return reply(
            200,
            "application/json; charset=utf-8",
            done(message).to_string(),
        );
    }
    let mut lines = String::new();
    for word in text.split_inclusive(' ') {
        let chunk = json!({"model": model, "created_at": CREATED,
            "message": {"role": "assistant", "content": word}, "done": false});
        lines.push_str(&format!("{chunk}\n"));
    }
    if let Some(c) = message.get("tool_calls") {
        let chunk = json!({"model": model, "created_at": CREATED,
            "message": {"role": "assistant", "content": "", "tool_calls": c}, "done": false});
        lines.push_str(&format!("{chunk}\n"));
    }
    let last = done(json!({"role": "assistant", "content": ""}));
    lines.push_str(&format!("{last}\n"));
    reply(200, "application/x-ndjson", lines)
}

fn openai_chat(model: &Value, text: &str, counts: (u64, u64)) -> Response<MockBody> {
    let (prompt, eval) = counts;
    let body = json!({"id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": prompt, "completion_tokens": eval, "total_tokens": prompt + eval}});
    reply(200, "application/json", body.to_string())
}

async fn serve(
    shared: Arc<Shared>,
    req: Request<Incoming>,
) -> Result<Response<MockBody>, Infallible> {
    let (parts, body) = req.into_parts();
    let body = body
        .collect()
        .await
        .map(|c| c.to_bytes())
        .unwrap_or_default();
    let path = parts.uri.path().to_owned();
    let settings = shared.settings.lock().unwrap().clone();
    if path == "/api/ps" {
        if !settings.ps {
            return Ok(reply(404, "text/plain", "404 page not found".into()));
        }
        let models: Vec<Value> = shared
            .loaded
            .lock()
            .unwrap()
            .iter()
            .map(|(name, n)| json!({"name": format!("{name}:latest"), "model": format!("{name}:latest"),
                "size": 1, "digest": "d", "expires_at": CREATED, "size_vram": 1, "context_length": n}))
            .collect();
        return Ok(reply(
            200,
            "application/json",
            json!({ "models": models }).to_string(),
        ));
    }
    if path != "/api/chat" && path != "/v1/chat/completions" {
        return Ok(reply(404, "text/plain", "404 page not found".into()));
    }
    let Ok(v) = serde_json::from_slice::<Value>(&body) else {
        return Ok(reply(
            400,
            "application/json",
            json!({"error": "invalid character"}).to_string(),
        ));
    };
    let native = path == "/api/chat";
    let model = v["model"].clone();
    let name = base_name(model.as_str().unwrap_or_default());
    let messages = v["messages"].as_array().cloned().unwrap_or_default();
    let tools = v["tools"].clone();
    let asked = v
        .pointer("/options/num_ctx")
        .and_then(Value::as_u64)
        .filter(|_| native);
    let window = {
        let mut loaded = shared.loaded.lock().unwrap();
        let w = asked
            .or_else(|| loaded.get(&name).copied())
            .unwrap_or(settings.default_window);
        loaded.insert(name, w);
        w
    };
    let sent = tokens(&tools, &messages);
    let summary = is_summary(&messages);
    let (kept, dropped) = truncate(&tools, &messages, window);
    shared.seen.lock().unwrap().push(OllamaSeen {
        path: path.clone(),
        body: body.clone(),
        summary,
        sent,
        kept,
        dropped,
        window,
    });
    let (text, calls) = if summary {
        (settings.summary.clone(), None)
    } else {
        answer(&messages, &tools)
    };
    let counts = (kept, 7);
    if native {
        let stream = v["stream"].as_bool().unwrap_or(true);
        return Ok(ollama_chat(&model, &text, calls, counts, stream));
    }
    Ok(openai_chat(&model, &text, counts))
}
