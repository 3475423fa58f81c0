//! A fast mock OpenAI-compatible upstream for load benchmarks.
//!
//! `cargo run --example mock_upstream -- [ADDR] [DELAY_MS]`
//!
//! - `POST /v1/chat/completions` with `"stream":true` in the body: an SSE
//!   stream of 20 content events, a usage event and `[DONE]`, one frame per
//!   event (`?gap_ms=N` waits N ms between events; with
//!   `"model":"fingerprint"` each chunk carries a `system_fingerprint`);
//!   otherwise a fixed JSON completion (Content-Length).
//! - `GET /json`, `GET /sse`: the same replies without a request body.
//!
//! `DELAY_MS` delays every response head (simulates upstream think time).
//! Prints `listening on <addr>` once bound.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full};
use hyper::body::{Body, Frame, Incoming};
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::net::TcpListener;

type BoxError = Box<dyn std::error::Error + Send + Sync>;
type Out = UnsyncBoxBody<Bytes, BoxError>;

const JSON: &str = r#"{"id":"chatcmpl-bench","object":"chat.completion","created":1764460800,"model":"bench","choices":[{"index":0,"message":{"role":"assistant","content":"Hello from the mock upstream. This reply is a fixed size."},"finish_reason":"stop"}],"usage":{"prompt_tokens":42,"completion_tokens":12,"total_tokens":54}}"#;

/// The stream's events; `fingerprint`: each chunk carries a
/// `system_fingerprint`, as OpenAI's and llama.cpp's do.
fn sse_events(fingerprint: bool) -> VecDeque<Bytes> {
    let fp = if fingerprint {
        "\"system_fingerprint\":\"fp_bench\","
    } else {
        ""
    };
    let mut v: VecDeque<Bytes> = (0..20)
        .map(|i| {
            Bytes::from(format!(
                "data: {{\"id\":\"chatcmpl-bench\",\"object\":\"chat.completion.chunk\",{fp}\"choices\":[{{\"index\":0,\"delta\":{{\"content\":\"tok{i} \"}},\"finish_reason\":null}}]}}\n\n"
            ))
        })
        .collect();
    v.push_back(Bytes::from_static(
        b"data: {\"id\":\"chatcmpl-bench\",\"object\":\"chat.completion.chunk\",\"choices\":[],\"usage\":{\"prompt_tokens\":42,\"completion_tokens\":20,\"total_tokens\":62}}\n\n",
    ));
    v.push_back(Bytes::from_static(b"data: [DONE]\n\n"));
    v
}

/// Yields one frame per event, optionally sleeping between them.
struct Events {
    events: VecDeque<Bytes>,
    gap: Duration,
    sleep: Option<Pin<Box<tokio::time::Sleep>>>,
}

impl Body for Events {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        if let Some(s) = self.sleep.as_mut() {
            if s.as_mut().poll(cx).is_pending() {
                return Poll::Pending;
            }
            self.sleep = None;
        }
        match self.events.pop_front() {
            None => Poll::Ready(None),
            Some(b) => {
                if !self.gap.is_zero() && !self.events.is_empty() {
                    self.sleep = Some(Box::pin(tokio::time::sleep(self.gap)));
                }
                Poll::Ready(Some(Ok(Frame::data(b))))
            }
        }
    }
}

use std::future::Future;

async fn handle(req: Request<Incoming>, delay: Duration) -> Result<Response<Out>, Infallible> {
    let path = req.uri().path().to_owned();
    let gap = req
        .uri()
        .query()
        .and_then(|q| q.strip_prefix("gap_ms="))
        .and_then(|v| v.parse::<u64>().ok())
        .map(Duration::from_millis)
        .unwrap_or(Duration::ZERO);
    let body = req
        .into_body()
        .collect()
        .await
        .map(|c| c.to_bytes())
        .unwrap_or_default();
    if !delay.is_zero() {
        tokio::time::sleep(delay).await;
    }
    let stream = path == "/sse"
        || (path == "/v1/chat/completions"
            && memchr::memmem::find(&body, b"\"stream\":true").is_some());
    let resp = if stream {
        Response::builder()
            .header("content-type", "text/event-stream")
            .header("cache-control", "no-cache")
            .body(
                Events {
                    events: sse_events(
                        memchr::memmem::find(&body, b"\"model\":\"fingerprint\"").is_some(),
                    ),
                    gap,
                    sleep: None,
                }
                .boxed_unsync(),
            )
    } else {
        Response::builder()
            .header("content-type", "application/json")
            .body(
                Full::new(Bytes::from_static(JSON.as_bytes()))
                    .map_err(|e| match e {})
                    .boxed_unsync(),
            )
    };
    Ok(resp.unwrap_or_else(|_| {
        Response::new(
            Full::new(Bytes::new())
                .map_err(|e| match e {})
                .boxed_unsync(),
        )
    }))
}

fn main() -> Result<(), BoxError> {
    let mut args = std::env::args().skip(1);
    let addr = args.next().unwrap_or_else(|| "127.0.0.1:0".to_owned());
    let delay = Duration::from_millis(args.next().and_then(|d| d.parse().ok()).unwrap_or(0));
    // One worker: the mock should be cheap, leaving CPU to the system under test.
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?;
    rt.block_on(async move {
        let listener = TcpListener::bind(&addr).await?;
        println!("listening on {}", listener.local_addr()?);
        loop {
            let (stream, _) = listener.accept().await?;
            stream.set_nodelay(true)?;
            tokio::spawn(async move {
                let svc = service_fn(move |req| handle(req, delay));
                let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                    .serve_connection(TokioIo::new(stream), svc)
                    .await;
            });
        }
    })
}
