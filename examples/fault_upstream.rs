//! A mock OpenAI-compatible upstream that streams SSE with injected faults,
//! for scripts/fault_load.sh.
//!
//! `cargo run --example fault_upstream -- [ADDR]` (default 127.0.0.1:0)
//!
//! `POST /v1/chat/completions` with an `x-fault-id: N` header streams the
//! frames of `fault_common::plan(N, usage)` (usage: the body it received
//! asks for `include_usage`), misbehaving as the plan says: slow drip,
//! a stall, or an aborted connection after some frames.
//! `GET /_fault/stats` answers counters as one JSON line: requests, streams
//! finished, streams reset on purpose, streams whose reader went away.
//! Prints `listening on <addr>` once bound.

#[path = "fault_common/mod.rs"]
mod fault_common;

use std::collections::VecDeque;
use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use fault_common::{plan, Fault, Rng};
use http::{Request, Response, StatusCode};
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full};
use hyper::body::{Body, Frame, Incoming};
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::net::TcpListener;

type BoxError = Box<dyn std::error::Error + Send + Sync>;
type Out = UnsyncBoxBody<Bytes, BoxError>;

#[derive(Default)]
struct Stats {
    requests: AtomicU64,
    finished: AtomicU64,
    resets: AtomicU64,
    reader_gone: AtomicU64,
}

/// The frames still to send, each with the pause before it.
struct Stream {
    frames: VecDeque<(Duration, Bytes)>,
    /// Error out once the frames run out (an aborted connection).
    reset: bool,
    sleep: Option<Pin<Box<tokio::time::Sleep>>>,
    done: bool,
    stats: Arc<Stats>,
}

impl Drop for Stream {
    fn drop(&mut self) {
        if !self.done {
            self.stats.reader_gone.fetch_add(1, Ordering::Relaxed);
        }
    }
}

impl Body for Stream {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = &mut *self;
        if let Some(s) = this.sleep.as_mut() {
            if s.as_mut().poll(cx).is_pending() {
                return Poll::Pending;
            }
            this.sleep = None;
        } else if let Some((pause, _)) = this.frames.front() {
            if !pause.is_zero() {
                this.sleep = Some(Box::pin(tokio::time::sleep(*pause)));
                return Pin::new(this).poll_frame(cx);
            }
        }
        match this.frames.pop_front() {
            Some((_, frame)) => Poll::Ready(Some(Ok(Frame::data(frame)))),
            None => {
                this.done = true;
                if this.reset {
                    this.stats.resets.fetch_add(1, Ordering::Relaxed);
                    Poll::Ready(Some(Err("injected reset".into())))
                } else {
                    this.stats.finished.fetch_add(1, Ordering::Relaxed);
                    Poll::Ready(None)
                }
            }
        }
    }
}

fn stream_for(id: u64, usage: bool, stats: Arc<Stats>) -> Stream {
    let p = plan(id, usage);
    let mut rng = Rng::new(id ^ 0xD819);
    let mut frames: VecDeque<(Duration, Bytes)> = VecDeque::new();
    let (take, reset) = match p.fault {
        Fault::Reset(n) => (n, true),
        _ => (p.frames.len(), false),
    };
    let middle = p.frames.len() / 2;
    for (i, f) in p.frames.into_iter().take(take).enumerate() {
        match p.fault {
            Fault::Drip => {
                let mut at = 0;
                while at < f.len() {
                    let n = (1 + rng.below(7) as usize).min(f.len() - at);
                    frames.push_back((Duration::from_millis(rng.below(2)), f.slice(at..at + n)));
                    at += n;
                }
            }
            Fault::Stall(d) if i == middle => frames.push_back((d, f)),
            _ => frames.push_back((Duration::ZERO, f)),
        }
    }
    Stream {
        frames,
        reset,
        sleep: None,
        done: false,
        stats,
    }
}

fn text(status: StatusCode, body: String) -> Response<Out> {
    let mut r = Response::new(
        Full::new(Bytes::from(body))
            .map_err(|e| match e {})
            .boxed_unsync(),
    );
    *r.status_mut() = status;
    r
}

async fn handle(req: Request<Incoming>, stats: Arc<Stats>) -> Result<Response<Out>, Infallible> {
    if req.uri().path() == "/_fault/stats" {
        let s = &stats;
        let line = format!(
            "{{\"requests\":{},\"finished\":{},\"resets\":{},\"reader_gone\":{}}}\n",
            s.requests.load(Ordering::Relaxed),
            s.finished.load(Ordering::Relaxed),
            s.resets.load(Ordering::Relaxed),
            s.reader_gone.load(Ordering::Relaxed)
        );
        return Ok(text(StatusCode::OK, line));
    }
    if req.uri().path() != "/v1/chat/completions" {
        // Window discovery (`/v1/models`, `/props`): nothing to tell.
        return Ok(text(StatusCode::NOT_FOUND, "not found\n".into()));
    }
    stats.requests.fetch_add(1, Ordering::Relaxed);
    let id = req
        .headers()
        .get("x-fault-id")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    let Some(id) = id else {
        return Ok(text(StatusCode::BAD_REQUEST, "x-fault-id missing\n".into()));
    };
    let body = match req.into_body().collect().await {
        Ok(b) => b.to_bytes(),
        Err(_) => return Ok(text(StatusCode::BAD_REQUEST, "body\n".into())),
    };
    let usage = memchr_usage(&body);
    let mut r = Response::new(stream_for(id, usage, stats).boxed_unsync());
    r.headers_mut()
        .insert("content-type", "text/event-stream".parse().expect("static"));
    Ok(r)
}

/// The request asks for usage in the stream.
fn memchr_usage(body: &[u8]) -> bool {
    let Ok(v) = serde_json::from_slice::<serde_json::Value>(body) else {
        return false;
    };
    v["stream_options"]["include_usage"] == serde_json::Value::Bool(true)
}

#[tokio::main]
async fn main() -> std::io::Result<()> {
    let addr = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "127.0.0.1:0".into());
    let listener = TcpListener::bind(&addr).await?;
    println!("listening on {}", listener.local_addr()?);
    let stats = Arc::new(Stats::default());
    loop {
        let (tcp, _) = listener.accept().await?;
        let stats = stats.clone();
        tokio::spawn(async move {
            let svc = service_fn(move |req| handle(req, stats.clone()));
            let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                .serve_connection(TokioIo::new(tcp), svc)
                .await;
        });
    }
}
