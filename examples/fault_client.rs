//! Load client for scripts/fault_load.sh: opens N concurrent streaming chat
//! requests through compactor against examples/fault_upstream.rs and checks
//! every stream byte for byte against what the upstream sent.
//!
//! `cargo run --example fault_client -- PROXY_URL [N] [TIMEOUT_SECS] [MODE]`
//!
//! `MODE` is `stream` (the default, below), `silent` or `slow_upload`
//! (connection-level modes, see examples/fault_modes).
//!
//! Request `id` carries `x-fault-id: id`, so both ends derive the same plan
//! (examples/fault_common). Compactor always asks the upstream for usage on
//! streaming requests; for clients that did not ask (two in three here) the
//! expected bytes are the upstream's with the usage hidden, as
//! `compactor::usage::hide::UsageHider` does it.
//!
//! Outcomes (one `name count` line each on stdout, then latency lines):
//! - `ok`: complete and identical;
//! - `lost`: no response, an error status, a timeout, or a stream that
//!   ended early (cleanly or not) although the upstream sent it whole;
//! - `corrupted`: bytes that are not what the upstream sent (or a prefix);
//! - `reset_propagated`: the upstream aborted, the client got a prefix and
//!   an error (correct);
//! - `reset_masked`: the upstream aborted but the client saw a clean end
//!   (a silent truncation);
//! - `reset_status`: the upstream aborted before compactor sent the
//!   response head, and the client got a 5xx (correct);
//! - `hung_up`: the client hung up on purpose (prefix checked: a wrong
//!   prefix counts as corrupted).

#[path = "fault_common/mod.rs"]
mod fault_common;
#[path = "fault_modes/mod.rs"]
mod fault_modes;

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Bytes of aborted streams: what the upstream sent before aborting, and
/// what of it reached the client.
static RESET_SENT: AtomicU64 = AtomicU64::new(0);
static RESET_DELIVERED: AtomicU64 = AtomicU64::new(0);

use bytes::{Bytes, BytesMut};
use fault_common::{client_wants_usage, plan, reader, Fault, Reader};
use http::Request;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Outcome {
    Ok,
    Lost,
    Corrupted,
    ResetPropagated,
    ResetMasked,
    ResetStatus,
    HungUp,
}

impl Outcome {
    const ALL: [Outcome; 7] = [
        Outcome::Ok,
        Outcome::Lost,
        Outcome::Corrupted,
        Outcome::ResetPropagated,
        Outcome::ResetMasked,
        Outcome::ResetStatus,
        Outcome::HungUp,
    ];

    fn name(self) -> &'static str {
        match self {
            Outcome::Ok => "ok",
            Outcome::Lost => "lost",
            Outcome::Corrupted => "corrupted",
            Outcome::ResetPropagated => "reset_propagated",
            Outcome::ResetMasked => "reset_masked",
            Outcome::ResetStatus => "reset_status",
            Outcome::HungUp => "hung_up",
        }
    }
}

/// What the client should receive for request `id` if nothing is lost.
fn expected(id: u64) -> (Vec<u8>, bool) {
    let p = plan(id, true);
    let full = p.full();
    let bytes = if client_wants_usage(id) {
        full
    } else {
        let mut h = compactor::usage::hide::UsageHider::new();
        let mut out = BytesMut::new();
        h.push(&full, &mut out);
        h.finish(&mut out);
        out.to_vec()
    };
    (bytes, matches!(p.fault, Fault::Reset(_)))
}

fn body(id: u64) -> Bytes {
    let mut v = serde_json::json!({
        "model": "fault-model",
        "stream": true,
        "messages": [
            {"role": "system", "content": "You are a test."},
            {"role": "user", "content": format!("request {id}")}
        ]
    });
    if client_wants_usage(id) {
        v["stream_options"] = serde_json::json!({"include_usage": true});
    }
    Bytes::from(v.to_string())
}

type HttpClient = Client<hyper_util::client::legacy::connect::HttpConnector, Full<Bytes>>;

// One request's whole life (send, read, verify, classify) reads best top to bottom.
#[allow(clippy::too_many_lines)]
async fn one(client: HttpClient, url: String, id: u64) -> (Outcome, Duration) {
    let started = Instant::now();
    let req = Request::post(&url)
        .header("content-type", "application/json")
        .header("authorization", "Bearer fault-load")
        .header("x-session-id", format!("fault-{id}"))
        .header("x-fault-id", id.to_string())
        .body(Full::new(body(id)));
    let Ok(req) = req else {
        return (Outcome::Lost, started.elapsed());
    };
    let verbose = std::env::var_os("FAULT_VERBOSE").is_some();
    let resp = match client.request(req).await {
        Ok(r) => r,
        Err(e) => {
            if verbose {
                eprintln!("id {id}: lost, no response: {e}");
            }
            return (Outcome::Lost, started.elapsed());
        }
    };
    let (want, upstream_reset) = expected(id);
    if !resp.status().is_success() {
        if upstream_reset && resp.status().is_server_error() {
            // Aborted before compactor sent the head: an error status is
            // the honest answer.
            return (Outcome::ResetStatus, started.elapsed());
        }
        if verbose {
            eprintln!(
                "id {id}: lost, status {} fault {:?}",
                resp.status(),
                plan(id, true).fault
            );
        }
        return (Outcome::Lost, started.elapsed());
    }
    let behaviour = reader(id);
    let mut got = Vec::with_capacity(want.len());
    let mut body = resp.into_body();
    let mut frames = 0usize;
    let mut errored = false;
    loop {
        match body.frame().await {
            Some(Ok(f)) => {
                if let Some(d) = f.data_ref() {
                    got.extend_from_slice(d);
                }
                frames += 1;
                match behaviour {
                    Reader::HangUp(n) if frames >= n => {
                        let outcome = if want.starts_with(&got) {
                            Outcome::HungUp
                        } else {
                            Outcome::Corrupted
                        };
                        return (outcome, started.elapsed());
                    }
                    Reader::Slow(d) if frames <= 50 => tokio::time::sleep(d).await,
                    _ => {}
                }
            }
            Some(Err(_)) => {
                errored = true;
                break;
            }
            None => break,
        }
    }
    let outcome = if !want.starts_with(&got) {
        Outcome::Corrupted
    } else if upstream_reset {
        RESET_SENT.fetch_add(plan(id, true).sent().len() as u64, Ordering::Relaxed);
        RESET_DELIVERED.fetch_add(got.len() as u64, Ordering::Relaxed);
        if errored {
            Outcome::ResetPropagated
        } else {
            Outcome::ResetMasked
        }
    } else if errored || got.len() != want.len() {
        Outcome::Lost
    } else {
        Outcome::Ok
    };
    if outcome != Outcome::Ok && std::env::var_os("FAULT_VERBOSE").is_some() {
        eprintln!(
            "id {id}: {} fault {:?} reader {behaviour:?} got {} of {} bytes, error {errored}",
            outcome.name(),
            plan(id, true).fault,
            got.len(),
            want.len()
        );
    }
    (outcome, started.elapsed())
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

#[tokio::main]
async fn main() {
    let mut args = std::env::args().skip(1);
    let proxy = args
        .next()
        .unwrap_or_else(|| "http://127.0.0.1:4000".into());
    let n: u64 = args.next().and_then(|s| s.parse().ok()).unwrap_or(1000);
    let timeout = Duration::from_secs(args.next().and_then(|s| s.parse().ok()).unwrap_or(60));
    let mode = args.next().unwrap_or_else(|| "stream".into());
    if mode != "stream" {
        let addr = proxy
            .trim_start_matches("http://")
            .trim_end_matches('/')
            .to_string();
        if !fault_modes::run(&mode, &addr, n, timeout).await {
            eprintln!("unknown mode {mode}");
            std::process::exit(64);
        }
        return;
    }
    let url = format!("{}/v1/chat/completions", proxy.trim_end_matches('/'));
    let client: HttpClient = Client::builder(TokioExecutor::new())
        .pool_max_idle_per_host(0)
        .build_http();
    let started = Instant::now();
    let tasks: Vec<_> = (0..n)
        .map(|id| {
            let (client, url) = (client.clone(), url.clone());
            tokio::spawn(async move {
                match tokio::time::timeout(timeout, one(client, url, id)).await {
                    Ok(r) => r,
                    Err(_) => (Outcome::Lost, timeout),
                }
            })
        })
        .collect();
    let mut counts = std::collections::BTreeMap::new();
    let mut ok_times = Vec::new();
    for t in tasks {
        let (outcome, took) = t.await.unwrap_or((Outcome::Lost, Duration::ZERO));
        *counts.entry(outcome).or_insert(0u64) += 1;
        if outcome == Outcome::Ok {
            ok_times.push(took);
        }
    }
    ok_times.sort_unstable();
    for o in Outcome::ALL {
        println!("{} {}", o.name(), counts.get(&o).copied().unwrap_or(0));
    }
    println!("requests {n}");
    println!(
        "reset_bytes {}/{}",
        RESET_DELIVERED.load(Ordering::Relaxed),
        RESET_SENT.load(Ordering::Relaxed)
    );
    println!("wall_ms {}", started.elapsed().as_millis());
    println!("ok_p50_ms {}", percentile(&ok_times, 0.5).as_millis());
    println!("ok_p99_ms {}", percentile(&ok_times, 0.99).as_millis());
}
