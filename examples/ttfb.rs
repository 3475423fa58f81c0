//! Time to first SSE byte, for the load benchmark.
//!
//! `cargo run --example ttfb -- URL [N]` sends N sequential streaming chat
//! requests over one keep-alive connection and prints p50/p99 of the time
//! from sending the request to the first body frame, and of the whole stream.

use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

fn pct(sorted: &[Duration], p: f64) -> f64 {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted
        .get(i)
        .map(|d| d.as_secs_f64() * 1e6)
        .unwrap_or(f64::NAN)
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), BoxError> {
    let mut args = std::env::args().skip(1);
    let url = args.next().ok_or("usage: ttfb URL [N]")?;
    let n: usize = args.next().and_then(|v| v.parse().ok()).unwrap_or(500);
    let client: Client<_, Full<Bytes>> = Client::builder(TokioExecutor::new()).build_http();
    let body = Bytes::from_static(
        br#"{"model":"bench","stream":true,"messages":[{"role":"user","content":"hi"}]}"#,
    );
    let (mut first, mut total) = (Vec::with_capacity(n), Vec::with_capacity(n));
    for i in 0..n + 20 {
        let req = http::Request::post(url.as_str())
            .header("content-type", "application/json")
            .body(Full::new(body.clone()))?;
        let start = Instant::now();
        let resp = client.request(req).await?;
        let mut b = resp.into_body();
        let mut ttfb = None;
        while let Some(frame) = b.frame().await {
            if frame?.data_ref().is_some_and(|d| !d.is_empty()) && ttfb.is_none() {
                ttfb = Some(start.elapsed());
            }
        }
        // The first 20 requests warm up the pools.
        if i >= 20 {
            first.push(ttfb.ok_or("empty stream")?);
            total.push(start.elapsed());
        }
    }
    first.sort();
    total.sort();
    println!(
        "{{\"n\":{n},\"ttfb_p50_us\":{:.1},\"ttfb_p99_us\":{:.1},\"stream_p50_us\":{:.1},\"stream_p99_us\":{:.1}}}",
        pct(&first, 0.5),
        pct(&first, 0.99),
        pct(&total, 0.5),
        pct(&total, 0.99)
    );
    Ok(())
}
