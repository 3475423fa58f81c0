//! Compaction quality harness: long agent conversations with planted facts,
//! run through compactor (in-process) in front of a scripted upstream whose
//! summariser behaves like a model with a reply cap.
//!
//! The upstream answers normal turns with a fixed assistant reply and
//! `usage.prompt_tokens` ≈ chars/4 of the request's messages, rejects a
//! request whose prompt plus `max_tokens` exceeds its window (the llama.cpp
//! 400), and answers summariser calls (recognised by the engine's summary
//! prompts) with a summary that copies every `FACT-…` token it is shown, in
//! order, one line each after a short prose opening, cut at the request's
//! `max_tokens` (4 chars per token) with `finish_reason: "length"`.
//!
//! Everything is deterministic: the conversation, the replies and the
//! figures depend only on the scenario.
//!
//! Used by `tests/quality.rs` (floors) and `examples/quality.rs` (the table).

#![allow(dead_code)]

// The one mock-server loop and compactor launcher of the test suites.
#[path = "../support/mod.rs"]
pub mod support;

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

type Body = UnsyncBoxBody<Bytes, Infallible>;

/// How a summary asked after the conversation opens (serialize.rs).
const IN_CONTEXT_START: &str = "You are a summarization agent now.";

/// The text of a message: its string content, or its text parts joined.
fn text_of(m: &Value) -> String {
    match &m["content"] {
        Value::String(s) => s.clone(),
        Value::Array(parts) => parts
            .iter()
            .filter_map(|p| p["text"].as_str())
            .collect::<Vec<_>>()
            .join("\n"),
        _ => String::new(),
    }
}

/// How the engine's summary prompts start (serialize.rs PREAMBLE, micro.rs).
const SUMMARY_STARTS: [&str; 2] = [
    "You are a summarization agent",
    "You are a conversation summarization assistant",
];

/// One benchmark run.
#[derive(Clone, Copy, Debug)]
pub struct Scenario {
    /// The upstream's (and the configured) context window, tokens.
    pub window: u64,
    /// `true` = the micro strategy, else batch.
    pub micro: bool,
    /// Agent turns (one user ask, one tool round, one answer each).
    pub turns: usize,
    /// A fact is planted every this many turns.
    pub fact_every: usize,
}

impl Scenario {
    /// The standard run: 40 turns, a fact every five.
    pub fn standard(window: u64, micro: bool) -> Self {
        Self {
            window,
            micro,
            turns: 40,
            fact_every: 5,
        }
    }

    /// Tool output size: scaled with the window so every window compacts.
    fn tool_chars(&self) -> usize {
        usize::try_from(self.window / 8).unwrap_or(4096).max(200)
    }

    /// The client's `max_tokens`.
    fn max_tokens(&self) -> u64 {
        (self.window / 8).min(256)
    }
}

/// The figures of one run.
#[derive(Clone, Debug, Default)]
pub struct Report {
    pub facts_planted: usize,
    /// Planted facts present in the last request the upstream received.
    pub facts_retained: usize,
    /// Which facts were lost (ids).
    pub lost: Vec<String>,
    pub summariser_calls: usize,
    /// Sum of `prompt_tokens` of the chat requests the upstream received.
    pub tokens_sent: u64,
    /// Chat requests whose messages extend the previous request's messages
    /// unchanged (a prompt-cache hit), over all chat requests but the first.
    pub prefix_stable: f64,
    /// Client requests that did not get a 200.
    pub failed_requests: usize,
    pub chat_requests: usize,
    /// `(prompt, reply)` of every summary call.
    pub summary_log: Vec<(String, String)>,
}

#[derive(Default)]
pub struct Seen {
    /// The messages of every chat request, in order.
    pub chats: Vec<Vec<Value>>,
    pub summaries: usize,
    /// `(prompt, reply)` of every summary call, in order.
    pub summary_log: Vec<(String, String)>,
    pub tokens: u64,
    /// Chat requests answered with the overflow error.
    pub overflows: usize,
    /// Tools of every chat request.
    pub tools: Vec<Option<Value>>,
}

/// The scripted upstream.
pub struct Upstream {
    addr: SocketAddr,
    shared: Arc<Shared>,
    task: tokio::task::JoinHandle<()>,
}

/// What the upstream's connections share.
struct Shared {
    seen: Mutex<Seen>,
    window: u64,
}

impl Drop for Upstream {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Upstream {
    pub async fn start(window: u64) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let shared = Arc::new(Shared {
            seen: Mutex::default(),
            window,
        });
        let task = support::serve_mock(listener, Arc::clone(&shared), serve);
        Self { addr, shared, task }
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// What the upstream has seen so far (taken out).
    pub fn take_seen(&self) -> Seen {
        std::mem::take(&mut *self.shared.seen.lock().expect("lock"))
    }
}

fn reply(status: u16, body: String) -> Response<Body> {
    let mut resp = Response::new(Full::new(Bytes::from(body)).boxed_unsync());
    *resp.status_mut() = StatusCode::from_u16(status).unwrap_or(StatusCode::OK);
    resp.headers_mut().insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("application/json"),
    );
    resp
}

fn completion(content: &str, finish: &str, prompt: u64, completion: u64) -> String {
    json!({
        "id": "chatcmpl-quality",
        "object": "chat.completion",
        "created": 1_700_000_000u64,
        "model": "m",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": finish}],
        "usage": {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion},
    })
    .to_string()
}

/// Every `FACT-…` token of `text`, in order of first appearance.
pub fn facts_in(text: &str) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    let mut rest = text;
    while let Some(i) = rest.find("FACT-") {
        let tail = &rest[i..];
        let end = tail
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '-'))
            .unwrap_or(tail.len());
        let f = tail[..end].trim_end_matches('-').to_owned();
        if !out.contains(&f) {
            out.push(f);
        }
        rest = &tail[end.max(5)..];
    }
    out
}

/// The step number of a line that mentions `Step N:` / `step N`.
fn step_of(line: &str) -> Option<u32> {
    let lower = line.to_ascii_lowercase();
    let i = lower.find("step ")?;
    let digits: String = lower[i + 5..]
        .chars()
        .take_while(char::is_ascii_digit)
        .collect();
    digits.parse().ok()
}

/// What the scripted summariser writes for `prompt`, cut at `max_tokens`.
///
/// Like a model that keeps what it is shown: a short opening, then, in the
/// order they appear in the prompt (running summary first, then the new
/// turns), one line per step the conversation went through and one per
/// `FACT-…` value. Told that an earlier answer was cut off (the engine's
/// firmer retry), it writes the facts only. The reply is cut at
/// `max_tokens` × 4 characters with `finish_reason: "length"`.
pub fn scripted_summary(prompt: &str, max_tokens: Option<u64>) -> (String, bool) {
    let terse = prompt.contains("cut off at the reply limit");
    let mut text = String::from(
        "## Historical Task Snapshot\nThe user is running a long multi-step agent task over a code base; \
         the assistant reads files with tools and reports what it finds.\n\n## Progress and Facts\n",
    );
    let mut seen_steps = std::collections::HashSet::new();
    let mut seen_facts = std::collections::HashSet::new();
    for line in prompt.lines() {
        let facts = facts_in(line);
        for f in &facts {
            if seen_facts.insert(f.clone()) {
                text.push_str(&format!("- recorded value {f} (keep exactly)\n"));
            }
        }
        if terse || !facts.is_empty() {
            continue;
        }
        if let Some(n) = step_of(line) {
            if seen_steps.insert(n) {
                text.push_str(&format!(
                    "- step {n} done: looked at src/module_{n}.rs, nothing to change\n"
                ));
            }
        }
    }
    text.push_str("\n## Current Subtask\nContinue with the next step the user asks for.\n");
    match max_tokens.and_then(|m| usize::try_from(m.saturating_mul(4)).ok()) {
        Some(cap) if text.len() > cap => {
            let mut cut = cap;
            while !text.is_char_boundary(cut) {
                cut -= 1;
            }
            text.truncate(cut);
            (text, true)
        }
        _ => (text, false),
    }
}

async fn serve(shared: Arc<Shared>, req: Request<Incoming>) -> Result<Response<Body>, Infallible> {
    let (seen, window) = (&shared.seen, shared.window);
    let path = req.uri().path().to_owned();
    let body = req
        .into_body()
        .collect()
        .await
        .map(|c| c.to_bytes())
        .unwrap_or_default();
    let Ok(v) = serde_json::from_slice::<Value>(&body) else {
        return Ok(reply(404, "{\"error\":{\"message\":\"not found\"}}".into()));
    };
    // `HARNESS_TOKENIZER=1`: llama.cpp's tokenizer endpoints, counting as
    // the chat answers do.
    if std::env::var_os("HARNESS_TOKENIZER").is_some() {
        if path == "/apply-template" {
            let messages = serde_json::to_string(&v["messages"]).unwrap_or_default();
            let tools = v.get("tools").map(Value::to_string).unwrap_or_default();
            let prompt = format!("{messages}{tools}");
            return Ok(reply(200, json!({ "prompt": prompt }).to_string()));
        }
        if path == "/tokenize" {
            let n = v["content"].as_str().map_or(0, str::len) / 4;
            return Ok(reply(200, json!({ "tokens": vec![0; n] }).to_string()));
        }
    }
    let messages = v["messages"].as_array().cloned().unwrap_or_default();
    let prompt = (serde_json::to_string(&messages).map_or(0, |s| s.len()) / 4) as u64
        + (v.get("tools").map_or(0, |t| t.to_string().len()) / 4) as u64;
    let max_tokens = v["max_tokens"].as_u64();
    if prompt + max_tokens.unwrap_or(0) > window {
        if let Ok(mut s) = seen.lock() {
            s.overflows += 1;
        }
        let err = json!({"error": {"code": 400, "type": "exceed_context_size_error",
            "message": format!("request ({prompt} tokens) exceeds the available context size ({window} tokens), try increasing it"),
            "n_prompt_tokens": prompt, "n_ctx": window}});
        return Ok(reply(400, err.to_string()));
    }
    let first = messages
        .first()
        .and_then(|m| m["content"].as_str())
        .unwrap_or_default();
    // A summary asked after the conversation: the summariser reads the
    // whole conversation it is shown, as a model would.
    let in_context = messages.last().is_some_and(|m| {
        text_of(m)
            .split("\n\n")
            .any(|p| p.starts_with(IN_CONTEXT_START))
    });
    let shown = if in_context {
        messages.iter().map(text_of).collect::<Vec<_>>().join("\n")
    } else {
        first.to_owned()
    };
    if in_context || (messages.len() == 1 && SUMMARY_STARTS.iter().any(|s| first.starts_with(s))) {
        let first = shown.as_str();
        let (text, cut) = scripted_summary(first, max_tokens);
        if std::env::var_os("QUALITY_DUMP").is_some() {
            eprintln!("=== SUMMARY PROMPT (max_tokens {max_tokens:?}, cut {cut})\n{first}\n=== REPLY\n{text}");
        }
        if let Ok(mut s) = seen.lock() {
            s.summaries += 1;
            s.summary_log.push((first.to_owned(), text.clone()));
        }
        let finish = if cut { "length" } else { "stop" };
        let done = (text.len() / 4) as u64;
        return Ok(reply(200, completion(&text, finish, prompt, done)));
    }
    if let Ok(mut s) = seen.lock() {
        s.chats.push(messages);
        s.tools.push(v.get("tools").cloned());
        s.tokens += prompt;
    }
    Ok(reply(
        200,
        completion("Done; moving on.", "stop", prompt, 4),
    ))
}

/// The planted fact of turn `i`, if any: `(id, where it goes)`.
fn fact_of(sc: &Scenario, i: usize) -> Option<(String, usize)> {
    i.is_multiple_of(sc.fact_every).then(|| {
        let k = i / sc.fact_every;
        (
            format!("FACT-{k:02}-{:04}", (k * 7919 + 17) % 10_000),
            k % 3,
        )
    })
}

const SYSTEM: &str = "You are a careful coding agent working in a repository. Use the tools to \
read files, run commands and edit code. Follow the user's instructions exactly and keep \
track of every constraint they give you.";

/// The client side: builds the conversation turn by turn.
struct Client {
    messages: Vec<Value>,
}

impl Client {
    fn user(&mut self, sc: &Scenario, i: usize) {
        let mut text = format!("Step {i}: look at src/module_{i}.rs and tell me what to change.");
        if let Some((f, 1)) = fact_of(sc, i) {
            text.push_str(&format!(
                " Constraint: the release tag must stay {f}; never change it."
            ));
        }
        self.messages.push(json!({"role": "user", "content": text}));
    }

    fn tool_round(&mut self, sc: &Scenario, i: usize) {
        let id = format!("call_{i}");
        let mut out = String::new();
        if let Some((f, 0)) = fact_of(sc, i) {
            out.push_str(&format!("config.toml:\nbuild_id: {f}\n"));
        }
        let line = format!(
            "src/module_{i}.rs:{}: fn step_{i}() {{ let v = {i}; }}\n",
            i + 1
        );
        while out.len() < sc.tool_chars() {
            out.push_str(&line);
        }
        self.messages
            .push(json!({"role": "assistant", "content": null, "tool_calls": [
            {"id": id, "type": "function", "function": {"name": "read_file",
             "arguments": format!("{{\"path\":\"src/module_{i}.rs\"}}")}}]}));
        self.messages
            .push(json!({"role": "tool", "tool_call_id": id, "content": out}));
    }

    fn answer(&mut self, sc: &Scenario, i: usize, upstream_text: &str) {
        let mut text = format!("module_{i}: {upstream_text}");
        if let Some((f, 2)) = fact_of(sc, i) {
            text.push_str(&format!(" Decision: we deploy with migration id {f}."));
        }
        self.messages
            .push(json!({"role": "assistant", "content": text}));
    }
}

/// Compactor's TOML for a scenario (after `listen` and `upstream`).
pub fn proxy_toml(sc: &Scenario) -> String {
    let strategy = if sc.micro { "micro" } else { "batch" };
    format!(
        "[models.\"m\"]\ncontext_length = {}\n[compaction]\nstrategy = \"{strategy}\"\n",
        sc.window
    )
}

/// Starts compactor in front of `upstream` with `toml` after `listen` and
/// `upstream`.
pub async fn start_proxy(upstream: &str, toml: &str) -> compactor::server::RunningServer {
    support::start_proxy(upstream, toml).await
}

/// POSTs a chat completion through compactor (session `quality`).
pub async fn post(url: &str, body: Vec<u8>) -> (StatusCode, Value) {
    let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build_http::<Body>();
    let mut req = Request::new(Full::new(Bytes::from(body)).boxed_unsync());
    *req.method_mut() = http::Method::POST;
    *req.uri_mut() = format!("{url}/v1/chat/completions").parse().expect("uri");
    let h = req.headers_mut();
    h.insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("application/json"),
    );
    h.insert(
        http::header::AUTHORIZATION,
        http::HeaderValue::from_static("Bearer k"),
    );
    h.insert("x-session-id", http::HeaderValue::from_static("quality"));
    let resp = client.request(req).await.expect("request");
    let status = resp.status();
    let bytes = resp
        .into_body()
        .collect()
        .await
        .map(|c| c.to_bytes())
        .unwrap_or_default();
    (
        status,
        serde_json::from_slice(&bytes).unwrap_or(Value::Null),
    )
}

/// Whether `prev` is a prefix of `next`.
fn extends(prev: &[Value], next: &[Value]) -> bool {
    prev.len() <= next.len() && prev.iter().zip(next).all(|(a, b)| a == b)
}

/// Runs one scenario end to end.
pub async fn run(sc: Scenario) -> Report {
    let upstream = Upstream::start(sc.window).await;
    let proxy = start_proxy(&upstream.url(), &proxy_toml(&sc)).await;
    let url = proxy.url();
    let mut client = Client {
        messages: vec![json!({"role": "system", "content": SYSTEM})],
    };
    let mut planted = Vec::new();
    let mut failed = 0;
    for i in 0..sc.turns {
        if let Some((f, _)) = fact_of(&sc, i) {
            planted.push(f);
        }
        client.user(&sc, i);
        client.tool_round(&sc, i);
        let body =
            json!({"model": "m", "messages": client.messages, "max_tokens": sc.max_tokens()});
        let (status, v) = post(&url, body.to_string().into_bytes()).await;
        if status != StatusCode::OK {
            failed += 1;
        }
        let text = v
            .pointer("/choices/0/message/content")
            .and_then(Value::as_str)
            .unwrap_or("(no answer)")
            .to_owned();
        client.answer(&sc, i, &text);
    }
    let seen = upstream.take_seen();
    let last = seen
        .chats
        .last()
        .map(|m| serde_json::to_string(m).unwrap_or_default())
        .unwrap_or_default();
    if std::env::var_os("QUALITY_DUMP_FINAL").is_some() {
        for m in seen.chats.last().into_iter().flatten() {
            let c = m["content"].as_str().unwrap_or("").replace('\n', " | ");
            eprintln!("{}: {}", m["role"], c.chars().take(300).collect::<String>());
        }
    }
    let lost: Vec<String> = planted
        .iter()
        .filter(|f| !last.contains(f.as_str()))
        .cloned()
        .collect();
    let stable = seen
        .chats
        .windows(2)
        .filter(|w| extends(&w[0], &w[1]))
        .count();
    let pairs = seen.chats.len().saturating_sub(1).max(1);
    drop(proxy);
    Report {
        facts_planted: planted.len(),
        facts_retained: planted.len() - lost.len(),
        lost,
        summariser_calls: seen.summaries,
        tokens_sent: seen.tokens,
        prefix_stable: stable as f64 / pairs as f64,
        failed_requests: failed,
        chat_requests: seen.chats.len(),
        summary_log: seen.summary_log,
    }
}

/// The standard matrix: windows × strategies.
pub const WINDOWS: [u64; 4] = [2048, 4096, 8192, 32_768];

/// A markdown table of reports.
pub fn table(rows: &[(Scenario, Report)]) -> String {
    let mut out = String::from(
        "| window | strategy | facts retained | summariser calls | tokens sent | prefix-stable | failed requests |\n|---:|---|---:|---:|---:|---:|---:|\n",
    );
    for (sc, r) in rows {
        out.push_str(&format!(
            "| {} | {} | {}/{} | {} | {} | {:.0}% | {} |\n",
            sc.window,
            if sc.micro { "micro" } else { "batch" },
            r.facts_retained,
            r.facts_planted,
            r.summariser_calls,
            r.tokens_sent,
            r.prefix_stable * 100.0,
            r.failed_requests,
        ));
    }
    out
}
