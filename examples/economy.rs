//! What a compaction buys: turns per compaction, summary calls, prefix
//! stability, refused requests and wall time for agent-shaped conversations
//! (a fixed part of instructions and tools taking 30 % or 75 % of the
//! window, ~500-token turns of a tool round each, three short facts the user
//! states in the first turns).
//!
//! ```sh
//! # the deterministic scripted upstream of the quality harness, 2k/4k/8k
//! cargo run --release --example economy
//! # a real llama.cpp server (its n_ctx is the window)
//! ECONOMY_UPSTREAM=http://127.0.0.1:8080 ECONOMY_WINDOW=4096 cargo run --release --example economy
//! ```
//!
//! `ECONOMY_TURNS` (default 20), `ECONOMY_SHARES` (default `0.3,0.75`),
//! `ECONOMY_COMPACTION` (more `[compaction]` keys, `;`-separated, e.g.
//! `keep_user_messages = false`), `ECONOMY_TRACE=1` (a line per turn),
//! `ECONOMY_LOG=1` (compactor's log).
//! compactor runs in-process on its defaults but for the window; a recording
//! hop between it and the upstream sees every request it sends.

#[path = "../tests/quality/harness.rs"]
mod harness;

use std::convert::Infallible;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use bytes::Bytes;
use http::{HeaderMap, Request, Response, StatusCode};
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioIo};
use serde_json::{json, Value};
use tokio::net::TcpListener;

type Body = UnsyncBoxBody<Bytes, Infallible>;

/// The three things the user says early and needs at the end.
const FACTS: [&str; 3] = [
    "the vault lives at /srv/vault-7731",
    "the admin port is 48213",
    "the deploy code is KESTREL-5529",
];

/// One request compactor sent upstream.
struct Sent {
    summary: bool,
    messages: Vec<Value>,
    status: u16,
    prompt_tokens: Option<u64>,
}

/// A forwarding hop that records what passes.
struct Tap {
    url: String,
    sent: Arc<Mutex<Vec<Sent>>>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Tap {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn start_tap(upstream: String) -> Tap {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let url = format!("http://{}", listener.local_addr().expect("addr"));
    let sent: Arc<Mutex<Vec<Sent>>> = Arc::default();
    let client: Client<_, Body> = Client::builder(TokioExecutor::new()).build_http();
    let (rec, up) = (Arc::clone(&sent), Arc::new(upstream));
    let task = tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let (rec, up, client) = (Arc::clone(&rec), Arc::clone(&up), client.clone());
            tokio::spawn(async move {
                let svc =
                    service_fn(move |req| forward(req, rec.clone(), up.clone(), client.clone()));
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), svc)
                    .await;
            });
        }
    });
    Tap { url, sent, task }
}

async fn forward(
    req: Request<Incoming>,
    rec: Arc<Mutex<Vec<Sent>>>,
    upstream: Arc<String>,
    client: Client<hyper_util::client::legacy::connect::HttpConnector, Body>,
) -> Result<Response<Body>, Infallible> {
    let (parts, body) = req.into_parts();
    let body = body
        .collect()
        .await
        .map(|c| c.to_bytes())
        .unwrap_or_default();
    let path = parts.uri.path_and_query().map_or("/", |p| p.as_str());
    let mut out = Request::new(Full::new(body.clone()).boxed_unsync());
    *out.method_mut() = parts.method.clone();
    *out.uri_mut() = format!("{upstream}{path}").parse().expect("uri");
    *out.headers_mut() = parts.headers.clone();
    out.headers_mut().remove(http::header::HOST);
    let Ok(resp) = client.request(out).await else {
        return Ok(Response::builder()
            .status(502)
            .body(Full::new(Bytes::new()).boxed_unsync())
            .expect("response"));
    };
    let (rparts, rbody) = resp.into_parts();
    let rbytes = rbody
        .collect()
        .await
        .map(|c| c.to_bytes())
        .unwrap_or_default();
    if parts.uri.path().ends_with("/chat/completions") {
        let v: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
        let messages = v["messages"].as_array().cloned().unwrap_or_default();
        let first = messages
            .first()
            .and_then(|m| m["content"].as_str())
            .unwrap_or("");
        let r: Value = serde_json::from_slice(&rbytes).unwrap_or(Value::Null);
        let sent = Sent {
            summary: messages.len() == 1 && harness_summary(first),
            messages,
            status: rparts.status.as_u16(),
            prompt_tokens: r.pointer("/usage/prompt_tokens").and_then(Value::as_u64),
        };
        compactor::sync::lock(&rec).push(sent);
    }
    Ok(Response::from_parts(
        rparts,
        Full::new(rbytes).boxed_unsync(),
    ))
}

fn harness_summary(first: &str) -> bool {
    first.starts_with("You are a summarization agent")
        || first.starts_with("You are a conversation summarization assistant")
}

/// The fixed part: a system prompt and tool schemas of about `tokens`
/// (chars / 4), four fifths prose, one fifth schemas.
fn fixed_part(tokens: u64) -> (Value, Value) {
    let chars = usize::try_from(tokens * 4).unwrap_or(0);
    let rule = "Follow the repository's conventions, run the tests before you answer, never \
                touch files outside the work tree, and report what you changed. ";
    let mut system = String::from("You are a coding agent working in a repository.\n");
    while system.len() < chars * 4 / 5 {
        system.push_str(rule);
    }
    let mut tools = Vec::new();
    let mut size = 0;
    let mut i = 0;
    while size < chars / 5 {
        let t = json!({"type": "function", "function": {"name": format!("tool_{i}"),
            "description": "Reads or edits one file of the work tree and returns its text.",
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}});
        size += t.to_string().len();
        tools.push(t);
        i += 1;
    }
    (
        json!({"role": "system", "content": system}),
        Value::Array(tools),
    )
}

/// Turn `i`: the user's ask (a fact in turns 1–3, the question at the end),
/// a tool round of ~450 tokens.
fn turn(messages: &mut Vec<Value>, i: usize, last: bool) {
    let ask = if last {
        "Before we finish: what are the vault path, the admin port and the deploy code I gave you?"
            .to_owned()
    } else if let Some(f) = FACTS.get(i.wrapping_sub(1)) {
        format!("Step {i}: look at src/module_{i}.rs. Remember: {f}.")
    } else {
        format!("Step {i}: look at src/module_{i}.rs and tell me what to change.")
    };
    messages.push(json!({"role": "user", "content": ask}));
    let id = format!("call_{i}");
    let line = format!(
        "src/module_{i}.rs:{}: fn step_{i}() {{ let v = {i}; }}\n",
        i + 1
    );
    let output = line.repeat(1_800 / line.len());
    messages.push(
        json!({"role": "assistant", "content": null, "tool_calls": [{"id": id,
        "type": "function", "function": {"name": "tool_0",
        "arguments": format!("{{\"path\":\"src/module_{i}.rs\"}}")}}]}),
    );
    messages.push(json!({"role": "tool", "tool_call_id": id, "content": output}));
}

async fn post(url: &str, body: Value) -> (StatusCode, HeaderMap, Value) {
    let client: Client<_, Body> = Client::builder(TokioExecutor::new()).build_http();
    let mut req = Request::new(Full::new(Bytes::from(body.to_string())).boxed_unsync());
    *req.method_mut() = http::Method::POST;
    *req.uri_mut() = format!("{url}/v1/chat/completions").parse().expect("uri");
    let h = req.headers_mut();
    h.insert(
        http::header::CONTENT_TYPE,
        "application/json".parse().expect("hv"),
    );
    h.insert(http::header::AUTHORIZATION, "Bearer k".parse().expect("hv"));
    h.insert("x-session-id", "economy".parse().expect("hv"));
    let resp = client.request(req).await.expect("request");
    let (parts, body) = resp.into_parts();
    let bytes = body
        .collect()
        .await
        .map(|c| c.to_bytes())
        .unwrap_or_default();
    (
        parts.status,
        parts.headers,
        serde_json::from_slice(&bytes).unwrap_or(Value::Null),
    )
}

#[derive(Default)]
struct Row {
    window: u64,
    share: f64,
    fixed_real: Option<u64>,
    turns: usize,
    failed: usize,
    compactions: usize,
    summary_calls: usize,
    refused: usize,
    prefix_stable: f64,
    facts_kept: usize,
    seconds: f64,
}

impl Row {
    fn turns_per_compaction(&self) -> String {
        match self.compactions {
            0 => "–".into(),
            n => format!("{:.1}", self.turns as f64 / n as f64),
        }
    }

    fn per(&self, a: usize, b: usize) -> String {
        match b {
            0 => "–".into(),
            b => format!("{:.1}", a as f64 / b as f64),
        }
    }
}

async fn run(upstream: &str, window: u64, share: f64, turns: usize) -> Row {
    let tap = start_tap(upstream.to_owned()).await;
    let sc = harness::Scenario::standard(window, false);
    let mut toml = harness::proxy_toml(&sc);
    // `ECONOMY_COMPACTION="keep_user_messages = false"`: more `[compaction]` keys.
    if let Ok(extra) = std::env::var("ECONOMY_COMPACTION") {
        toml.push_str(&extra.replace(';', "\n"));
        toml.push('\n');
    }
    let proxy = harness::start_proxy(&tap.url, &toml).await;
    let (system, tools) = fixed_part((window as f64 * share) as u64);
    let mut messages = vec![system];
    let mut row = Row {
        window,
        share,
        turns,
        ..Row::default()
    };
    let started = Instant::now();
    for i in 0..turns {
        turn(&mut messages, i, i + 1 == turns);
        let body = json!({"model": "m", "messages": messages, "tools": tools, "max_tokens": 16});
        let (status, headers, v) = post(&proxy.url(), body).await;
        if status != StatusCode::OK {
            row.failed += 1;
        }
        if headers
            .get("x-compactor-action")
            .is_some_and(|a| a == "compacted" || a == "retried")
        {
            row.compactions += 1;
        }
        if std::env::var_os("ECONOMY_TRACE").is_some() {
            eprintln!(
                "turn {i}: {status} {:?} prompt_tokens {:?}",
                headers.get("x-compactor-action"),
                v.pointer("/usage/prompt_tokens")
            );
        }
        let text = v
            .pointer("/choices/0/message/content")
            .and_then(Value::as_str);
        messages.push(json!({"role": "assistant", "content": format!("module_{i}: {}", text.unwrap_or("(no answer)"))}));
    }
    row.seconds = started.elapsed().as_secs_f64();
    let sent = std::mem::take(&mut *compactor::sync::lock(&tap.sent));
    tally(&mut row, &sent);
    drop(proxy);
    row
}

/// The row's figures from what compactor sent upstream.
fn tally(row: &mut Row, sent: &[Sent]) {
    let chats: Vec<&Sent> = sent.iter().filter(|s| !s.summary).collect();
    row.summary_calls = sent.iter().filter(|s| s.summary).count();
    row.refused = chats.iter().filter(|s| s.status == 400).count();
    row.fixed_real = chats.first().and_then(|s| s.prompt_tokens);
    let answered: Vec<&&Sent> = chats.iter().filter(|s| s.status == 200).collect();
    let stable = answered
        .windows(2)
        .filter(|w| {
            w[0].messages.len() <= w[1].messages.len()
                && w[0]
                    .messages
                    .iter()
                    .zip(&w[1].messages)
                    .all(|(a, b)| a == b)
        })
        .count();
    row.prefix_stable = stable as f64 / answered.len().saturating_sub(1).max(1) as f64;
    let last = answered
        .last()
        .map(|s| Value::Array(s.messages.clone()).to_string())
        .unwrap_or_default();
    row.facts_kept = FACTS.iter().filter(|f| last.contains(*f)).count();
}

fn env<T: std::str::FromStr>(name: &str) -> Option<T> {
    std::env::var(name).ok().and_then(|v| v.parse().ok())
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    // `ECONOMY_LOG=1`: compactor's own log lines (to stdout, RUST_LOG filters).
    let _log = std::env::var_os("ECONOMY_LOG")
        .map(|_| compactor::telemetry::init(compactor::config::LogFormat::Text));
    let turns: usize = env("ECONOMY_TURNS").unwrap_or(20);
    let shares: Vec<f64> = std::env::var("ECONOMY_SHARES")
        .unwrap_or_else(|_| "0.3,0.75".into())
        .split(',')
        .filter_map(|s| s.trim().parse().ok())
        .collect();
    let external = std::env::var("ECONOMY_UPSTREAM").ok();
    let windows: Vec<u64> = match (&external, env::<u64>("ECONOMY_WINDOW")) {
        (_, Some(w)) => vec![w],
        (None, None) => vec![2048, 4096, 8192],
        (Some(_), None) => panic!("ECONOMY_WINDOW: the real upstream's n_ctx"),
    };
    println!(
        "| window | fixed part | turns | compactions | turns per compaction | summary calls | per compaction | per 10 turns | prefix-stable | refused upstream | failed | user facts kept | s per 10 turns |\n|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    );
    for &window in &windows {
        for &share in &shares {
            let scripted;
            let upstream = match &external {
                Some(u) => u.clone(),
                None => {
                    scripted = harness::Upstream::start(window).await;
                    scripted.url()
                }
            };
            let r = run(&upstream, window, share, turns).await;
            let fixed = match r.fixed_real {
                Some(t) => format!("{:.0} % (first request {t} tokens)", r.share * 100.0),
                None => format!("{:.0} %", r.share * 100.0),
            };
            println!(
                "| {} | {fixed} | {} | {} | {} | {} | {} | {} | {:.0} % | {} | {} | {}/3 | {:.1} |",
                r.window,
                r.turns,
                r.compactions,
                r.turns_per_compaction(),
                r.summary_calls,
                r.per(r.summary_calls, r.compactions),
                r.per(r.summary_calls * 10, r.turns),
                r.prefix_stable * 100.0,
                r.refused,
                r.failed,
                r.facts_kept,
                r.seconds * 10.0 / r.turns as f64,
            );
        }
    }
}
