//! Background pre-compaction benchmark: the compaction turn's added latency
//! inline and with `[compaction] background = true`, and the share of
//! compactions served from a pending record.
//!
//! `cargo run --release --example bench_background`
//!
//! An in-process mock upstream answers chat turns at once and summary
//! calls after 2 s; a 40-turn conversation is sent with 3 s and with 50 ms
//! between turns. `SCALE=0.1` shrinks every time (summary delay, gaps) for
//! a quick run; `TURNS=N` changes the turn count; `STRATEGY=micro` runs the
//! micro strategy (every turn a micro pass; a pending pass is the next
//! exchange absorbed ahead).

// A benchmark binary: a failed unwrap is a failed run.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::convert::Infallible;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioIo};
use serde_json::{json, Value};
use tokio::net::TcpListener;

const SUMMARY: &str = "## Historical Task Snapshot\n\"continue\"\n\n## Governing User Outcome\nMOCK-SUMMARY keep working.\n\n## Current Subtask\nNone.";

fn reply(content: &str, prompt: u64) -> String {
    json!({
        "id": "x", "object": "chat.completion", "model": "m",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": prompt, "completion_tokens": 10, "total_tokens": prompt + 10}
    })
    .to_string()
}

async fn mock(
    req: Request<Incoming>,
    delay: Duration,
) -> Result<Response<Full<Bytes>>, Infallible> {
    let body = req
        .into_body()
        .collect()
        .await
        .map(|c| c.to_bytes())
        .unwrap_or_default();
    let v: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    let msgs = v["messages"].as_array().cloned().unwrap_or_default();
    // The benchmark's own turns start with a system message: a lone user
    // message is the summariser.
    let summary = msgs.len() == 1 && msgs[0]["role"] == "user";
    let text = if summary {
        tokio::time::sleep(delay).await;
        reply(SUMMARY, body.len() as u64 / 4)
    } else {
        reply("ok, next step", body.len() as u64 / 4)
    };
    Ok(Response::builder()
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(text)))
        .unwrap())
}

async fn start_mock(delay: Duration) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                continue;
            };
            tokio::spawn(async move {
                let svc = service_fn(move |r| mock(r, delay));
                let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                    .serve_connection(TokioIo::new(stream), svc)
                    .await;
            });
        }
    });
    format!("http://{addr}")
}

struct Run {
    compactions: usize,
    used: f64,
    compaction_ms: Vec<f64>,
    other_ms: Vec<f64>,
}

async fn run(
    background: bool,
    gap: Duration,
    delay: Duration,
    turns: usize,
    strategy: &str,
) -> Run {
    let upstream = start_mock(delay).await;
    let toml = format!(
        "listen = \"127.0.0.1:0\"\nupstream = \"{upstream}\"\n[models.\"m\"]\ncontext_length = 4096\n[compaction]\nstrategy = \"{strategy}\"\nbackground = {background}\nbackground_threshold_percent = 60\n"
    );
    let cfg =
        compactor::config::Config::from_toml_str(&toml, &compactor::config::MapEnv::default())
            .unwrap();
    let proxy = compactor::server::start(cfg).await.unwrap();
    let url = proxy.url();
    let client: Client<_, Full<Bytes>> = Client::builder(TokioExecutor::new()).build_http();
    let mut msgs = vec![json!({"role":"system","content":"You are a coding agent."})];
    let filler = "lorem ipsum dolor sit amet, consectetur adipiscing elit. ".repeat(8);
    let mut out = Run {
        compactions: 0,
        used: 0.0,
        compaction_ms: vec![],
        other_ms: vec![],
    };
    for i in 0..turns {
        msgs.push(json!({"role":"user","content":format!("step {i}: {filler}")}));
        let body = json!({"model":"m","messages":msgs}).to_string();
        let req = Request::post(format!("{url}/v1/chat/completions"))
            .header("content-type", "application/json")
            .header("x-session-id", "bench")
            .body(Full::new(Bytes::from(body)))
            .unwrap();
        let t = Instant::now();
        let resp = client.request(req).await.unwrap();
        let action = resp
            .headers()
            .get("x-compactor-action")
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
            .to_owned();
        let _ = resp.into_body().collect().await;
        let ms = t.elapsed().as_secs_f64() * 1000.0;
        if action == "compacted" {
            out.compactions += 1;
            out.compaction_ms.push(ms);
        } else {
            out.other_ms.push(ms);
        }
        msgs.push(json!({"role":"assistant","content":format!("done {i}: {filler}")}));
        tokio::time::sleep(gap).await;
    }
    let req = Request::get(format!("{url}/_compactor/metrics"))
        .body(Full::new(Bytes::new()))
        .unwrap();
    let text = client
        .request(req)
        .await
        .unwrap()
        .into_body()
        .collect()
        .await
        .unwrap()
        .to_bytes();
    out.used = String::from_utf8_lossy(&text)
        .lines()
        .find_map(|l| l.strip_prefix("compactor_precompactions_total{event=\"used\"} "))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0.0);
    proxy.shutdown().await;
    out
}

fn mean(v: &[f64]) -> f64 {
    if v.is_empty() {
        0.0
    } else {
        v.iter().sum::<f64>() / v.len() as f64
    }
}

#[tokio::main]
async fn main() {
    let scale: f64 = std::env::var("SCALE")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(1.0);
    let turns: usize = std::env::var("TURNS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(40);
    let strategy = std::env::var("STRATEGY").unwrap_or_else(|_| "batch".into());
    let delay = Duration::from_secs_f64(2.0 * scale);
    println!("strategy {strategy}, summary delay {delay:?}, {turns} turns");
    println!(
        "{:<11} {:>8} {:>12} {:>12} {:>22} {:>16}",
        "mode", "gap", "compactions", "from pending", "compaction turn (ms)", "other turn (ms)"
    );
    for gap in [
        Duration::from_secs_f64(3.0 * scale),
        Duration::from_millis(50),
    ] {
        for background in [false, true] {
            let r = run(background, gap, delay, turns, &strategy).await;
            println!(
                "{:<11} {:>8} {:>12} {:>12} {:>22.1} {:>16.1}",
                if background { "background" } else { "inline" },
                format!("{}ms", gap.as_millis()),
                r.compactions,
                r.used,
                mean(&r.compaction_ms),
                mean(&r.other_ms),
            );
        }
    }
}
