//! The connection-level modes of examples/fault_client.rs (raw TCP, no
//! upstream involved):
//! - `silent`: N connections that never send a byte. Each should be closed
//!   by compactor's idle-connection timeout or, beyond the connection cap,
//!   answered with a 503 and closed; none may stay open.
//! - `slow_upload`: N chat requests whose bodies arrive in a quick first
//!   part and then a byte trickle. Each should get a 408 (the body-read
//!   timeout) or, when the bodies buffered at once exceed the budget, a 503
//!   with `Retry-After`; none may go unanswered.
//!
//! Meanwhile a prober asks `GET /_compactor/health` every 100 ms on a fresh
//! connection: it must always be answered (200 under the cap, the raw 503
//! above it), never time out.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// How long a health check may take before it counts as failed.
const HEALTH_TIMEOUT: Duration = Duration::from_secs(5);

/// Counts by outcome name, printed as `name count` lines.
pub type Counts = BTreeMap<&'static str, u64>;

/// Reads what the server sends until it closes, errors, or `limit` passes.
/// Returns the bytes and whether the server closed (EOF or reset).
async fn read_until_close(s: &mut TcpStream, limit: Duration) -> (Vec<u8>, bool) {
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    let read = tokio::time::timeout(limit, async {
        loop {
            match s.read(&mut buf).await {
                Ok(0) | Err(_) => return true,
                Ok(n) => got.extend_from_slice(&buf[..n]),
            }
        }
    })
    .await;
    (got, read.unwrap_or(false))
}

/// The status code and whether a `retry-after` header came with it.
fn status_of(head: &[u8]) -> Option<(u16, bool)> {
    let text = String::from_utf8_lossy(head).to_ascii_lowercase();
    let code = text.strip_prefix("http/1.1 ")?.get(..3)?.parse().ok()?;
    Some((code, text.contains("\r\nretry-after:")))
}

/// Health-check results: counts by status and the slowest answer.
#[derive(Default)]
pub struct Health {
    pub ok: u64,
    pub refused: u64,
    pub failed: u64,
    pub max: Duration,
}

async fn health_once(addr: &str) -> Result<(u16, Duration), ()> {
    let started = Instant::now();
    let check = async {
        let mut s = TcpStream::connect(addr).await.map_err(|_| ())?;
        s.write_all(b"GET /_compactor/health HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
            .await
            .map_err(|_| ())?;
        let (got, _) = read_until_close(&mut s, HEALTH_TIMEOUT).await;
        status_of(&got).map(|(c, _)| c).ok_or(())
    };
    let code = tokio::time::timeout(HEALTH_TIMEOUT, check)
        .await
        .map_err(|_| ())??;
    Ok((code, started.elapsed()))
}

/// Probes health every 100 ms until `stop` is set.
async fn probe_health(addr: String, stop: Arc<AtomicBool>) -> Health {
    let mut h = Health::default();
    while !stop.load(Ordering::Relaxed) {
        match health_once(&addr).await {
            Ok((200, took)) => {
                h.ok += 1;
                h.max = h.max.max(took);
            }
            Ok((503, took)) => {
                h.refused += 1;
                h.max = h.max.max(took);
            }
            _ => {
                h.failed += 1;
                h.max = h.max.max(HEALTH_TIMEOUT);
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    h
}

/// One silent connection's outcome.
async fn silent_one(addr: String, timeout: Duration) -> &'static str {
    let Ok(mut s) = TcpStream::connect(&addr).await else {
        return "connect_failed";
    };
    let (got, closed) = read_until_close(&mut s, timeout).await;
    match (status_of(&got), closed) {
        (Some((503, true)), true) => "refused_503_retry_after",
        (Some((503, false)), true) => "refused_503_no_retry_after",
        (None, true) if got.is_empty() => "closed_idle",
        (_, true) => "closed_other",
        (_, false) => "still_open",
    }
}

/// One slow upload's outcome: `first` bytes at once, then a byte every
/// `trickle`, of a body announced as `len` bytes.
async fn slow_upload_one(
    addr: String,
    first: usize,
    len: usize,
    trickle: Duration,
    timeout: Duration,
) -> &'static str {
    let Ok(s) = TcpStream::connect(&addr).await else {
        return "connect_failed";
    };
    let (mut rd, mut wr) = s.into_split();
    let head = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\nauthorization: Bearer slow\r\ncontent-length: {len}\r\n\r\n"
    );
    let writer = tokio::spawn(async move {
        // A JSON string that is never closed: the body is useless to the
        // server until all of it arrives.
        let mut body = b"{\"model\":\"m\",\"messages\":[{\"role\":\"user\",\"content\":\"".to_vec();
        body.resize(first.max(body.len()), b'x');
        if wr.write_all(head.as_bytes()).await.is_err() || wr.write_all(&body).await.is_err() {
            return;
        }
        let mut sent = body.len();
        while sent < len {
            tokio::time::sleep(trickle).await;
            if wr.write_all(b"x").await.is_err() {
                return;
            }
            sent += 1;
        }
    });
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    let answered = tokio::time::timeout(timeout, async {
        while !got.windows(4).any(|w| w == b"\r\n\r\n") {
            match rd.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => got.extend_from_slice(&buf[..n]),
            }
        }
    })
    .await
    .is_ok();
    writer.abort();
    match (status_of(&got), answered) {
        (Some((408, _)), _) => "status_408",
        (Some((503, true)), _) => "status_503_retry_after",
        (Some((503, false)), _) => "status_503_no_retry_after",
        (Some(_), _) => "status_other",
        (None, true) => "closed_without_status",
        (None, false) => "no_answer",
    }
}

/// Runs `mode` with `n` connections against `addr` (host:port); prints
/// `name count` lines, the health results and the wall time.
pub async fn run(mode: &str, addr: &str, n: u64, timeout: Duration) -> bool {
    let stop = Arc::new(AtomicBool::new(false));
    let prober = tokio::spawn(probe_health(addr.to_string(), Arc::clone(&stop)));
    let started = Instant::now();
    let tasks: Vec<tokio::task::JoinHandle<&'static str>> = match mode {
        "silent" => (0..n)
            .map(|_| tokio::spawn(silent_one(addr.to_string(), timeout)))
            .collect(),
        "slow_upload" => (0..n)
            .map(|_| {
                tokio::spawn(slow_upload_one(
                    addr.to_string(),
                    256 * 1024,
                    1024 * 1024,
                    Duration::from_millis(200),
                    timeout,
                ))
            })
            .collect(),
        _ => return false,
    };
    let mut counts = Counts::new();
    for t in tasks {
        let outcome = t.await.unwrap_or("task_failed");
        *counts.entry(outcome).or_insert(0) += 1;
    }
    let wall = started.elapsed();
    stop.store(true, Ordering::Relaxed);
    let health = prober.await.unwrap_or_default();
    let after = health_once(addr).await.map(|(c, _)| c).unwrap_or(0);
    println!("requests {n}");
    for (name, count) in &counts {
        println!("{name} {count}");
    }
    println!("health_200 {}", health.ok);
    println!("health_503 {}", health.refused);
    println!("health_failed {}", health.failed);
    println!("health_max_ms {}", health.max.as_millis());
    println!("health_after {after}");
    println!("wall_ms {}", wall.as_millis());
    true
}
