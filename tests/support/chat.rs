//! A scripted OpenAI/llama.cpp-shaped chat upstream on `127.0.0.1:0` for the
//! in-flight compaction tests.
//!
//! It records every request it receives (path, headers, raw body), answers
//! `POST /v1/chat/completions` as JSON or SSE (honouring
//! `stream_options.include_usage` the way OpenAI does: `"usage":null` on every
//! chunk plus a final `choices: []` usage chunk), optionally adds llama.cpp
//! `timings`, reports `prompt_tokens` = bytes of the `messages` JSON / 4,
//! recognises summariser calls (one user message starting with the
//! summariser preamble) and answers them as scripted, enforces an optional
//! context window with the overflow error shape of choice, and answers
//! `/props` with an `n_ctx` when told to (404 otherwise, like `/v1/models`).
//!
//! Settings live behind a mutex so a test can change them between turns.

// Test code: a failed unwrap is a failed test. clippy.toml allows that in
// #[test] functions only, not in the helpers they share.
#![allow(clippy::unwrap_used, clippy::expect_used)]
#![allow(dead_code)]

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, Request, Response, StatusCode};
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full};
use hyper::body::{Frame, Incoming};
use serde_json::{json, Value};
use tokio::net::TcpListener;
use tokio::sync::mpsc;

type MockBody = UnsyncBoxBody<Bytes, Infallible>;

/// How the summariser prompt starts (crates/compactor-engine/src/serialize.rs PREAMBLE).
pub const SUMMARY_PROMPT_START: &str = "You are a summarization agent";
/// How micro-compaction prompts start (crates/compactor-engine/src/compressor/micro.rs).
/// How a summary asked after the conversation opens.
pub const IN_CONTEXT_PROMPT_START: &str = "You are a summarization agent now.";
pub const MICRO_PROMPT_START: &str = "You are a conversation summarization assistant";

/// Fixed id/created so rendered responses are reproducible byte for byte.
pub const COMPLETION_ID: &str = "chatcmpl-mock";
pub const CREATED: u64 = 1_700_000_000;

/// The error shape used when a request exceeds the mock's window.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OverflowStyle {
    /// HTTP 400 `exceed_context_size_error` with `n_ctx` and `n_prompt_tokens`.
    LlamaCpp,
    /// HTTP 400 OpenAI `context_length_exceeded` wording.
    OpenAi,
    /// HTTP 200 `text/event-stream` whose first event is `data: {"error":..}`
    /// (llama.cpp shape) for streaming requests; 400 llama.cpp otherwise.
    InBandSse,
    /// [`OverflowStyle::InBandSse`] after a `: PROCESSING` comment and a
    /// pause (OpenRouter's shape): the proxy has committed the head and
    /// forwarded the comment when the error arrives.
    InBandSseAfterComment,
    /// Late-2024 llama.cpp in streaming mode: HTTP 200 and an SSE line
    /// `error: {...}` (an `error` field, not `data`), no `n_ctx`.
    InBandErrorField,
}

/// How summary calls are answered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SummaryMode {
    /// 200 with this content.
    Reply(String),
    /// An error status with an OpenAI-shaped error body.
    Status(u16),
    /// 200 with empty content.
    Empty,
    /// This status with this body.
    Body(u16, String),
}

/// What the mock does; changeable while it runs.
#[derive(Debug, Clone)]
pub struct Settings {
    /// Enforced context window (prompt tokens >= window → overflow error).
    pub window: Option<u64>,
    /// Error shape for overflows.
    pub overflow: OverflowStyle,
    /// Summary call answers.
    pub summary: SummaryMode,
    /// Delay before answering a summary call.
    pub summary_delay: Duration,
    /// Summary calls for these models get a 404 `model_not_found`.
    pub missing_models: Vec<String>,
    /// `/props` answers `default_generation_settings.n_ctx` = this; 404 if None.
    pub props_n_ctx: Option<u64>,
    /// Add llama.cpp `timings` to responses.
    pub timings: bool,
    /// Never report `usage` (a provider that ignores `include_usage`).
    pub omit_usage: bool,
    /// Bytes of `messages` JSON per reported token (4 by default; code-heavy
    /// text under a real tokenizer is denser).
    pub bytes_per_token: f64,
    /// Content deltas of a streamed (or joined for JSON) answer.
    pub deltas: Vec<String>,
    /// Split SSE bodies into frames of this many bytes (events cut across
    /// frames); whole events per frame when None.
    pub frame_bytes: Option<usize>,
    /// Serve llama.cpp's `/apply-template` and `/tokenize`, counting as the
    /// chat completions do.
    pub tokenizer: bool,
    /// Every ASCII digit of `messages` is a token of its own, the rest 4
    /// bytes a token (Gemma's tokenizer splits numbers into digits).
    pub digits_are_tokens: bool,
    /// The prompt counts the `tools` JSON too (4 bytes a token), as the
    /// upstream behind `tests/fixtures/agent-cases` counted; otherwise only
    /// `messages` count.
    pub tools_count: bool,
    /// Every request must present this key (`x-goog-api-key`, `?key=`
    /// or a bearer token), else 401, as Google's endpoints answer.
    pub require_key: Option<String>,
}

impl Default for Settings {
    fn default() -> Self {
        Self {
            window: None,
            overflow: OverflowStyle::LlamaCpp,
            summary: SummaryMode::Reply(default_summary()),
            summary_delay: Duration::ZERO,
            missing_models: Vec::new(),
            props_n_ctx: None,
            timings: false,
            omit_usage: false,
            bytes_per_token: 4.0,
            deltas: vec!["Hel".into(), "lo".into(), " there".into()],
            frame_bytes: None,
            tokenizer: false,
            digits_are_tokens: false,
            tools_count: false,
            require_key: None,
        }
    }
}

/// The scripted summary text (a valid checkpoint shape).
pub fn default_summary() -> String {
    "## Historical Task Snapshot\n\"continue\"\n\n## Governing User Outcome\nMOCK-SUMMARY keep working.\n\n## Current Subtask\nNone.".into()
}

/// What kind of request the mock saw.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Chat,
    Summary,
    Other,
    /// Answered 401: no key (see [`Settings::require_key`]).
    Rejected,
}

/// One recorded request.
#[derive(Debug, Clone)]
pub struct Seen {
    pub path: String,
    /// The query string, as sent.
    pub query: Option<String>,
    pub headers: HeaderMap,
    pub body: Bytes,
    pub kind: Kind,
    /// `prompt_tokens` the mock computed (chat and summary calls).
    pub prompt_tokens: u64,
    /// Whether it was answered with an overflow error.
    pub overflowed: bool,
}

impl Seen {
    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap()
    }
    pub fn messages(&self) -> Vec<Value> {
        self.json()["messages"].as_array().unwrap().clone()
    }
}

struct Shared {
    settings: Mutex<Settings>,
    seen: Mutex<Vec<Seen>>,
    props_hits: AtomicUsize,
}

/// A running chat mock.
pub struct ChatMock {
    pub addr: SocketAddr,
    shared: Arc<Shared>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for ChatMock {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// `prompt_tokens` the mock reports: bytes of the compact `messages` JSON / 4.
pub fn prompt_tokens_of(body: &Value) -> u64 {
    let msgs = body.get("messages").cloned().unwrap_or(Value::Null);
    (serde_json::to_string(&msgs).map(|s| s.len()).unwrap_or(0) / 4) as u64
}

/// Tokens of `text` when each ASCII digit is one and the rest are 4 bytes
/// a token.
fn digit_dense_tokens(text: &str) -> u64 {
    let digits = text.bytes().filter(u8::is_ascii_digit).count();
    ((text.len() - digits) / 4 + digits) as u64
}

pub fn completion_tokens(deltas: &[String]) -> u64 {
    deltas.iter().map(|d| d.len() as u64).sum::<u64>() / 4 + 1
}

fn is_summary_call(body: &Value) -> bool {
    let Some(msgs) = body.get("messages").and_then(Value::as_array) else {
        return false;
    };
    let alone = msgs.len() == 1
        && msgs[0]["role"] == "user"
        && msgs[0]["content"].as_str().is_some_and(|c| {
            c.starts_with(SUMMARY_PROMPT_START) || c.starts_with(MICRO_PROMPT_START)
        });
    alone || is_in_context_summary(body)
}

/// A summary asked after the conversation itself: its last user message
/// ends with the ask (appended to its text, or a text part of its own).
pub fn is_in_context_summary(body: &Value) -> bool {
    let Some(last) = body
        .get("messages")
        .and_then(Value::as_array)
        .and_then(|m| m.last())
    else {
        return false;
    };
    let text = match &last["content"] {
        Value::String(s) => s.clone(),
        Value::Array(parts) => parts
            .last()
            .and_then(|p| p["text"].as_str())
            .unwrap_or_default()
            .to_owned(),
        _ => String::new(),
    };
    last["role"] == "user"
        && text
            .split("\n\n")
            .any(|para| para.starts_with(IN_CONTEXT_PROMPT_START))
}

fn usage_json(prompt: u64, completion: u64) -> String {
    format!(
        "{{\"prompt_tokens\":{prompt},\"completion_tokens\":{completion},\"total_tokens\":{}}}",
        prompt + completion
    )
}

fn timings_json(prompt: u64, completion: u64) -> String {
    // llama.cpp: prompt_n = tokens evaluated, cache_n = tokens reused.
    let cache = prompt / 2;
    format!(
        "{{\"cache_n\":{cache},\"prompt_n\":{},\"prompt_ms\":1.5,\"predicted_n\":{completion},\"predicted_ms\":2.5}}",
        prompt - cache
    )
}

/// The SSE body the mock sends for a streamed answer, as one byte string.
/// `include_usage` follows OpenAI: `"usage":null` on every chunk and a final
/// `choices: []` chunk with the usage; `timings` goes on the last chunk, as
/// llama.cpp does.
pub fn render_sse(
    model: &str,
    deltas: &[String],
    include_usage: bool,
    prompt: u64,
    timings: bool,
) -> Vec<u8> {
    let completion = completion_tokens(deltas);
    let usage_null = if include_usage { ",\"usage\":null" } else { "" };
    let head = format!(
        "{{\"id\":\"{COMPLETION_ID}\",\"object\":\"chat.completion.chunk\",\"created\":{CREATED},\"model\":{}",
        json!(model)
    );
    let mut out = String::new();
    let mut push = |choices: String, extra: &str| {
        out.push_str(&format!(
            "data: {head},\"system_fingerprint\":\"fp_mock\",\"choices\":{choices}{extra}{usage_null}}}\n\n"
        ));
    };
    push(
        "[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"\"},\"logprobs\":null,\"finish_reason\":null}]".into(),
        "",
    );
    for d in deltas {
        push(
            format!(
                "[{{\"index\":0,\"delta\":{{\"content\":{}}},\"logprobs\":null,\"finish_reason\":null}}]",
                json!(d)
            ),
            "",
        );
    }
    let finish_timings = if timings && !include_usage {
        format!(",\"timings\":{}", timings_json(prompt, completion))
    } else {
        String::new()
    };
    push(
        "[{\"index\":0,\"delta\":{},\"logprobs\":null,\"finish_reason\":\"stop\"}]".into(),
        &finish_timings,
    );
    if include_usage {
        let t = if timings {
            format!(",\"timings\":{}", timings_json(prompt, completion))
        } else {
            String::new()
        };
        out.push_str(&format!(
            "data: {head},\"system_fingerprint\":\"fp_mock\",\"choices\":[]{t},\"usage\":{}}}\n\n",
            usage_json(prompt, completion)
        ));
    }
    out.push_str("data: [DONE]\n\n");
    out.into_bytes()
}

/// The JSON body the mock sends for a non-streamed answer.
pub fn render_json(
    model: &str,
    content: &str,
    prompt: u64,
    completion: u64,
    timings: bool,
) -> Vec<u8> {
    render_json_full(model, content, prompt, completion, timings, true)
}

/// [`render_json`] with or without the `usage` member.
pub fn render_json_full(
    model: &str,
    content: &str,
    prompt: u64,
    completion: u64,
    timings: bool,
    usage: bool,
) -> Vec<u8> {
    let usage = if usage {
        format!(",\"usage\":{}", usage_json(prompt, completion))
    } else {
        String::new()
    };
    let t = if timings {
        format!(",\"timings\":{}", timings_json(prompt, completion))
    } else {
        String::new()
    };
    format!(
        "{{\"id\":\"{COMPLETION_ID}\",\"object\":\"chat.completion\",\"created\":{CREATED},\"model\":{},\"choices\":[{{\"index\":0,\"message\":{{\"role\":\"assistant\",\"content\":{}}},\"finish_reason\":\"stop\"}}]{usage}{t}}}",
        json!(model),
        json!(content),
    )
    .into_bytes()
}

/// The llama.cpp overflow error body.
pub fn llamacpp_overflow(prompt: u64, n_ctx: u64) -> String {
    format!(
        "{{\"error\":{{\"code\":400,\"message\":\"request ({prompt} tokens) exceeds the available context size ({n_ctx} tokens), try increasing it\",\"type\":\"exceed_context_size_error\",\"n_prompt_tokens\":{prompt},\"n_ctx\":{n_ctx}}}}}"
    )
}

/// The late-2024 llama.cpp overflow error object (no numbers).
pub fn old_llamacpp_overflow() -> String {
    "{\"code\":400,\"message\":\"the request exceeds the available context size. try increasing the context size or enable context shift\",\"type\":\"invalid_request_error\"}".into()
}

/// The OpenAI overflow error body.
pub fn openai_overflow(prompt: u64, n_ctx: u64) -> String {
    format!(
        "{{\"error\":{{\"message\":\"This model's maximum context length is {n_ctx} tokens. However, your messages resulted in {prompt} tokens. Please reduce the length of the messages.\",\"type\":\"invalid_request_error\",\"param\":\"messages\",\"code\":\"context_length_exceeded\"}}}}"
    )
}

impl ChatMock {
    pub async fn start(settings: Settings) -> ChatMock {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let shared = Arc::new(Shared {
            settings: Mutex::new(settings),
            seen: Mutex::default(),
            props_hits: AtomicUsize::new(0),
        });
        let task = super::serve_mock(listener, Arc::clone(&shared), serve);
        ChatMock { addr, shared, task }
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Changes the settings for the following requests.
    pub fn update(&self, f: impl FnOnce(&mut Settings)) {
        f(&mut self.shared.settings.lock().unwrap());
    }

    pub fn seen(&self) -> Vec<Seen> {
        self.shared.seen.lock().unwrap().clone()
    }

    /// Chat completions that were not summary calls.
    pub fn chats(&self) -> Vec<Seen> {
        self.seen()
            .into_iter()
            .filter(|s| s.kind == Kind::Chat)
            .collect()
    }

    pub fn summaries(&self) -> Vec<Seen> {
        self.seen()
            .into_iter()
            .filter(|s| s.kind == Kind::Summary)
            .collect()
    }

    pub fn last_chat(&self) -> Seen {
        self.chats().pop().expect("no chat request seen")
    }

    /// Requests to `/props`.
    pub fn props_hits(&self) -> usize {
        self.shared.props_hits.load(Ordering::SeqCst)
    }
}

/// Whether a request carries `key` the ways Google's endpoints take it.
fn presents_key(parts: &http::request::Parts, key: &str) -> bool {
    let header = |name: &str| parts.headers.get(name).and_then(|v| v.to_str().ok());
    header("x-goog-api-key") == Some(key)
        || header("authorization") == Some(&format!("Bearer {key}"))
        || parts
            .uri
            .query()
            .is_some_and(|q| q.split('&').any(|p| p == format!("key={key}")))
}

// One match over every scripted path and failure mode of the mock; split up it
// would scatter the script the tests read against.
#[allow(clippy::too_many_lines)]
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
    if let Some(key) = &settings.require_key {
        if !presents_key(&parts, key) {
            shared.seen.lock().unwrap().push(Seen {
                path: path.clone(),
                query: parts.uri.query().map(str::to_owned),
                headers: parts.headers.clone(),
                body: body.clone(),
                kind: Kind::Rejected,
                prompt_tokens: 0,
                overflowed: false,
            });
            return Ok(json_reply(
                401,
                "{\"error\":{\"code\":401,\"message\":\"API key not valid\",\"status\":\"UNAUTHENTICATED\"}}".into(),
            ));
        }
    }
    let record = |kind: Kind, prompt: u64, overflowed: bool| {
        shared.seen.lock().unwrap().push(Seen {
            path: path.clone(),
            query: parts.uri.query().map(str::to_owned),
            headers: parts.headers.clone(),
            body: body.clone(),
            kind,
            prompt_tokens: prompt,
            overflowed,
        });
    };
    if path == "/props" {
        shared.props_hits.fetch_add(1, Ordering::SeqCst);
        record(Kind::Other, 0, false);
        return Ok(match settings.props_n_ctx {
            Some(n) => json_reply(
                200,
                format!("{{\"default_generation_settings\":{{\"n_ctx\":{n}}},\"total_slots\":1}}"),
            ),
            None => json_reply(404, "{\"error\":{\"code\":404,\"message\":\"File Not Found\",\"type\":\"not_found_error\"}}".into()),
        });
    }
    if settings.tokenizer && (path == "/apply-template" || path == "/tokenize") {
        record(Kind::Other, 0, false);
        let v: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
        return Ok(if path == "/apply-template" {
            // The "template" is the messages' JSON: /tokenize then counts
            // what a chat completion of them would report.
            let prompt = serde_json::to_string(&v["messages"]).unwrap_or_default();
            json_reply(200, json!({ "prompt": prompt }).to_string())
        } else {
            let content = v["content"].as_str().unwrap_or_default();
            let n = if settings.digits_are_tokens {
                digit_dense_tokens(content) as usize
            } else {
                (content.len() as f64 / settings.bytes_per_token) as usize
            };
            json_reply(200, json!({ "tokens": vec![0; n] }).to_string())
        });
    }
    if path != "/v1/chat/completions" {
        record(Kind::Other, 0, false);
        return Ok(json_reply(
            404,
            "{\"error\":{\"message\":\"not found\"}}".into(),
        ));
    }
    let Ok(v) = serde_json::from_slice::<Value>(&body) else {
        record(Kind::Other, 0, false);
        return Ok(json_reply(
            400,
            "{\"error\":{\"message\":\"bad json\"}}".into(),
        ));
    };
    let model = v["model"].as_str().unwrap_or("unknown").to_owned();
    let mut prompt = if settings.digits_are_tokens {
        digit_dense_tokens(&serde_json::to_string(&v["messages"]).unwrap_or_default())
    } else if settings.bytes_per_token == 4.0 {
        prompt_tokens_of(&v)
    } else {
        (prompt_tokens_of(&v) as f64 * 4.0 / settings.bytes_per_token) as u64
    };
    if settings.tools_count {
        prompt += (serde_json::to_string(&v["tools"]).map_or(0, |t| t.len()) / 4) as u64;
    }
    if is_summary_call(&v) && settings.bytes_per_token != 4.0 {
        // The summariser's own instructions are English prose (4 bytes per
        // token); only the quoted turns have the conversation's density.
        let text = v["messages"][0]["content"].as_str().unwrap_or_default();
        let turns = text
            .find("TURNS TO")
            .map(|start| {
                let end = text
                    .find("\n\nUse exactly this structure")
                    .unwrap_or(text.len());
                end.saturating_sub(start)
            })
            .unwrap_or(0);
        let prose = text.len() - turns;
        prompt = (prose as f64 / 4.0 + turns as f64 / settings.bytes_per_token) as u64;
    }
    if is_summary_call(&v) {
        // The summariser runs on the same server: same window (the prompt
        // plus the reply cap it asks for must fit, as in llama.cpp, where
        // the prompt alone is checked and the reply is cut at the window).
        if let Some(n_ctx) = settings.window {
            if prompt >= n_ctx {
                record(Kind::Summary, prompt, true);
                return Ok(json_reply(400, llamacpp_overflow(prompt, n_ctx)));
            }
        }
        record(Kind::Summary, prompt, false);
        if !settings.summary_delay.is_zero() {
            tokio::time::sleep(settings.summary_delay).await;
        }
        if settings.missing_models.contains(&model) {
            return Ok(json_reply(404, format!("{{\"error\":{{\"message\":\"The model `{model}` does not exist\",\"type\":\"invalid_request_error\",\"code\":\"model_not_found\"}}}}")));
        }
        return Ok(match &settings.summary {
            SummaryMode::Body(code, body) => json_reply(*code, body.clone()),
            SummaryMode::Reply(text) => json_reply(200, String::from_utf8(render_json(&model, text, prompt, 50, false)).unwrap()),
            SummaryMode::Empty => json_reply(200, String::from_utf8(render_json(&model, "", prompt, 0, false)).unwrap()),
            SummaryMode::Status(401) => json_reply(401, "{\"error\":{\"message\":\"Incorrect API key provided\",\"type\":\"invalid_request_error\",\"code\":\"invalid_api_key\"}}".into()),
            SummaryMode::Status(code) => json_reply(*code, "{\"error\":{\"message\":\"The server had an error while processing your request\",\"type\":\"server_error\"}}".into()),
        });
    }
    let stream = v["stream"].as_bool().unwrap_or(false);
    if let Some(n_ctx) = settings.window {
        if prompt >= n_ctx {
            record(Kind::Chat, prompt, true);
            return Ok(match settings.overflow {
                OverflowStyle::LlamaCpp => json_reply(400, llamacpp_overflow(prompt, n_ctx)),
                OverflowStyle::OpenAi => json_reply(400, openai_overflow(prompt, n_ctx)),
                OverflowStyle::InBandSse if stream => sse_reply(
                    format!("data: {}\n\n", llamacpp_overflow(prompt, n_ctx)).into_bytes(),
                    None,
                ),
                OverflowStyle::InBandSse => json_reply(400, llamacpp_overflow(prompt, n_ctx)),
                OverflowStyle::InBandSseAfterComment if stream => paced_sse_reply(vec![
                    b": PROCESSING\n\n".to_vec(),
                    format!("data: {}\n\n", llamacpp_overflow(prompt, n_ctx)).into_bytes(),
                ]),
                OverflowStyle::InBandSseAfterComment => {
                    json_reply(400, llamacpp_overflow(prompt, n_ctx))
                }
                OverflowStyle::InBandErrorField if stream => sse_reply(
                    format!("error: {}\n\n", old_llamacpp_overflow()).into_bytes(),
                    None,
                ),
                OverflowStyle::InBandErrorField => {
                    json_reply(400, format!("{{\"error\":{}}}", old_llamacpp_overflow()))
                }
            });
        }
    }
    record(Kind::Chat, prompt, false);
    if stream {
        let include_usage = v
            .pointer("/stream_options/include_usage")
            .and_then(Value::as_bool)
            .unwrap_or(false);
        let include_usage = include_usage && !settings.omit_usage;
        let bytes = render_sse(
            &model,
            &settings.deltas,
            include_usage,
            prompt,
            settings.timings,
        );
        Ok(sse_reply(bytes, settings.frame_bytes))
    } else {
        let content: String = settings.deltas.concat();
        let completion = completion_tokens(&settings.deltas);
        Ok(json_reply(
            200,
            String::from_utf8(render_json_full(
                &model,
                &content,
                prompt,
                completion,
                settings.timings,
                !settings.omit_usage,
            ))
            .unwrap(),
        ))
    }
}

fn json_reply(status: u16, body: String) -> Response<MockBody> {
    let mut resp = Response::new(Full::new(Bytes::from(body)).boxed_unsync());
    *resp.status_mut() = StatusCode::from_u16(status).unwrap();
    resp.headers_mut()
        .insert("content-type", "application/json".parse().unwrap());
    resp
}

/// Streams `events`, 300 ms apart: each arrives at the proxy on its own.
fn paced_sse_reply(events: Vec<Vec<u8>>) -> Response<MockBody> {
    let (tx, rx) = mpsc::channel::<Bytes>(4);
    tokio::spawn(async move {
        for (i, e) in events.into_iter().enumerate() {
            if i > 0 {
                tokio::time::sleep(Duration::from_millis(300)).await;
            }
            if tx.send(Bytes::from(e)).await.is_err() {
                return;
            }
        }
    });
    let mut resp = Response::new(ChanBody(rx).boxed_unsync());
    resp.headers_mut()
        .insert("content-type", "text/event-stream".parse().unwrap());
    resp
}

/// Streams `bytes` event by event (or in `frame_bytes` slices).
fn sse_reply(bytes: Vec<u8>, frame_bytes: Option<usize>) -> Response<MockBody> {
    let frames: Vec<Bytes> = match frame_bytes {
        Some(n) => bytes.chunks(n.max(1)).map(Bytes::copy_from_slice).collect(),
        None => {
            let text = String::from_utf8(bytes).unwrap();
            text.split_inclusive("\n\n")
                .map(|s| Bytes::from(s.to_owned()))
                .collect()
        }
    };
    let (tx, rx) = mpsc::channel::<Bytes>(4);
    tokio::spawn(async move {
        for f in frames {
            if tx.send(f).await.is_err() {
                return;
            }
            tokio::task::yield_now().await;
        }
    });
    let body = ChanBody(rx).boxed_unsync();
    let mut resp = Response::new(body);
    resp.headers_mut()
        .insert("content-type", "text/event-stream".parse().unwrap());
    resp
}

struct ChanBody(mpsc::Receiver<Bytes>);

impl hyper::body::Body for ChanBody {
    type Data = Bytes;
    type Error = Infallible;
    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        self.0.poll_recv(cx).map(|o| o.map(|b| Ok(Frame::data(b))))
    }
}

// ------------------------------------------------------------ conversations

/// A deterministic agent conversation: a system prompt, then turns of
/// user → assistant tool call → tool output → assistant text.
pub struct Conversation {
    pub messages: Vec<Value>,
    pub turns: usize,
    pub tool_output_bytes: usize,
}

pub const SYSTEM_PROMPT: &str =
    "You are a careful coding agent. Follow the user's instructions exactly.";

impl Conversation {
    pub fn new(tool_output_bytes: usize) -> Self {
        Self {
            messages: vec![json!({"role":"system","content":SYSTEM_PROMPT})],
            turns: 0,
            tool_output_bytes,
        }
    }

    /// The user message of turn `i`.
    pub fn user(i: usize) -> Value {
        json!({"role":"user","content":format!("Step {i}: please inspect file_{i}.rs and report what you find.")})
    }

    /// Appends a user message; returns the history to send.
    pub fn ask(&mut self) -> Vec<Value> {
        self.turns += 1;
        self.messages.push(Self::user(self.turns));
        self.messages.clone()
    }

    /// Appends the assistant's tool round and answer for the current turn.
    pub fn answer(&mut self) {
        let i = self.turns;
        let id = format!("call_{i}");
        let line = format!("line {i}: fn item_{i}() {{ let value = {i}; }}\n");
        let mut output = String::new();
        while output.len() < self.tool_output_bytes {
            output.push_str(&line);
        }
        self.messages.push(json!({"role":"assistant","content":null,"tool_calls":[{"id":id,"type":"function","function":{"name":"read_file","arguments":format!("{{\"path\":\"file_{i}.rs\"}}")}}]}));
        self.messages
            .push(json!({"role":"tool","tool_call_id":id,"content":output}));
        self.messages
            .push(json!({"role":"assistant","content":format!("file_{i}.rs defines item_{i}.")}));
    }
}

/// A chat request body with `messages` and the model.
pub fn chat_body(model: &str, messages: &[Value], stream: bool) -> Vec<u8> {
    let mut v = json!({"model": model, "messages": messages, "max_tokens": 64});
    if stream {
        v["stream"] = json!(true);
    }
    serde_json::to_vec(&v).unwrap()
}

/// Checks that every `tool` message answers a `tool_calls` id of an earlier
/// assistant message and every call has its answer.
pub fn assert_tool_pairs(messages: &[Value]) {
    let mut open: Vec<String> = Vec::new();
    for m in messages {
        if let Some(calls) = m["tool_calls"].as_array() {
            for c in calls {
                open.push(c["id"].as_str().unwrap().to_owned());
            }
        }
        if m["role"] == "tool" {
            let id = m["tool_call_id"].as_str().unwrap();
            let pos = open.iter().position(|o| o == id);
            assert!(pos.is_some(), "orphan tool message {id}");
            open.remove(pos.unwrap());
        }
    }
    assert!(open.is_empty(), "tool calls without results: {open:?}");
}

// ------------------------------------------------------------ client side

type ClientBody = UnsyncBoxBody<Bytes, Infallible>;

// One starter for every suite; re-exported for the chat tests' glob import.
#[allow(unused_imports)]
pub use super::start_proxy;

async fn send(
    method: &str,
    url: &str,
    body: Vec<u8>,
    headers: &[(&str, &str)],
) -> (StatusCode, HeaderMap, Bytes) {
    let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build_http::<ClientBody>();
    let mut req = Request::new(Full::new(Bytes::from(body)).boxed_unsync());
    *req.method_mut() = method.parse().unwrap();
    *req.uri_mut() = url.parse().unwrap();
    for (k, v) in headers {
        req.headers_mut().append(
            http::HeaderName::from_bytes(k.as_bytes()).unwrap(),
            v.parse().unwrap(),
        );
    }
    if method == "POST" {
        req.headers_mut()
            .insert("content-type", "application/json".parse().unwrap());
    }
    let resp = client.request(req).await.unwrap();
    let (parts, body) = resp.into_parts();
    let bytes = body.collect().await.unwrap().to_bytes();
    (parts.status, parts.headers, bytes)
}

/// POSTs a chat completion through compactor and reads the whole answer.
pub async fn post_chat(
    proxy: &str,
    body: Vec<u8>,
    headers: &[(&str, &str)],
) -> (StatusCode, HeaderMap, Bytes) {
    send(
        "POST",
        &format!("{proxy}/v1/chat/completions"),
        body,
        headers,
    )
    .await
}

/// POSTs `body` to `path` of compactor and reads the whole answer.
pub async fn post_path(
    proxy: &str,
    path: &str,
    body: Vec<u8>,
    headers: &[(&str, &str)],
) -> (StatusCode, HeaderMap, Bytes) {
    send("POST", &format!("{proxy}{path}"), body, headers).await
}

/// GET with headers.
pub async fn get_with(url: &str, headers: &[(&str, &str)]) -> (StatusCode, HeaderMap, Bytes) {
    send("GET", url, Vec::new(), headers).await
}

/// `x-compactor-action` of a response.
pub fn action(h: &HeaderMap) -> &str {
    h.get("x-compactor-action")
        .map(|v| v.to_str().unwrap())
        .unwrap_or("<none>")
}

/// `x-compactor-session` of a response.
pub fn session_of(h: &HeaderMap) -> String {
    h.get("x-compactor-session")
        .expect("x-compactor-session header")
        .to_str()
        .unwrap()
        .to_owned()
}

/// The admin session view.
pub async fn admin_view(proxy: &str, token: &str, key: &str) -> (StatusCode, Value) {
    let auth = format!("Bearer {token}");
    let (status, _, body) = get_with(
        &format!("{proxy}/_compactor/sessions/{key}"),
        &[("authorization", &auth)],
    )
    .await;
    (status, serde_json::from_slice(&body).unwrap_or(Value::Null))
}

/// The value of one metric line (`name{labels}` exactly as rendered).
pub async fn metric(proxy: &str, series: &str) -> f64 {
    let (_, _, body) = get_with(&format!("{proxy}/_compactor/metrics"), &[]).await;
    let text = String::from_utf8(body.to_vec()).unwrap();
    text.lines()
        .find_map(|l| {
            l.strip_prefix(series)
                .and_then(|rest| rest.strip_prefix(' '))
                .map(|v| v.trim().parse::<f64>().unwrap())
        })
        .unwrap_or(0.0)
}

impl Seen {
    /// The body as text.
    pub fn body_text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
}

/// `x-compactor-replaced`: client messages a recorded replacement stood
/// for (0 when absent).
pub fn replaced(h: &HeaderMap) -> usize {
    h.get("x-compactor-replaced")
        .map(|v| v.to_str().unwrap().parse().unwrap())
        .unwrap_or(0)
}

/// Sent with a recorded compaction substituted and no new compaction.
pub fn substituted(h: &HeaderMap) -> bool {
    action(h) == "passthrough" && replaced(h) > 0
}

/// A new compaction ran, or a recorded one was substituted.
pub fn compacted_or_substituted(h: &HeaderMap) -> bool {
    action(h) == "compacted" || substituted(h)
}
