//! Usage tap and hider over real hyper bodies: a mock upstream on
//! 127.0.0.1:0 streams recorded-shape transcripts frame by frame, and the
//! client side wraps the `Incoming` body the way the proxy will.

// Test code: a failed unwrap is a failed test. clippy.toml allows that in
// #[test] functions only, not in the helpers they share.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::convert::Infallible;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use compactor::upstream::body::{Eos, TapBody};
use compactor::usage::hide::HideUsageBody;
use compactor::usage::{BodyKind, PromptSource, TapOutcome, UsageObserver};
use http_body::{Body, Frame};
use http_body_util::{BodyExt, Full};
use hyper::service::service_fn;
use hyper::{Request, Response};
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::net::TcpListener;
use tokio::sync::mpsc;

/// Server body fed from a channel, so the test controls frame timing.
struct ChannelBody(mpsc::Receiver<Bytes>);

impl Body for ChannelBody {
    type Data = Bytes;
    type Error = Infallible;
    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        self.0.poll_recv(cx).map(|o| o.map(|b| Ok(Frame::data(b))))
    }
}

enum Reply {
    /// SSE, split into frames of this size with a pause between them.
    Sse(&'static [u8], usize),
    /// JSON with Content-Length.
    Json(&'static [u8]),
}

async fn mock_upstream(reply: fn(&str) -> Reply) -> std::net::SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let Ok((sock, _)) = listener.accept().await else {
                return;
            };
            tokio::spawn(async move {
                let svc = service_fn(move |req: Request<hyper::body::Incoming>| async move {
                    let path = req.uri().path().to_owned();
                    let resp: Response<
                        http_body_util::combinators::UnsyncBoxBody<Bytes, Infallible>,
                    > = match reply(&path) {
                        Reply::Json(b) => Response::builder()
                            .header("content-type", "application/json")
                            .body(Full::new(Bytes::from_static(b)).boxed_unsync())
                            .unwrap(),
                        Reply::Sse(b, n) => {
                            let (tx, rx) = mpsc::channel(4);
                            tokio::spawn(async move {
                                for c in b.chunks(n) {
                                    if tx.send(Bytes::from_static(c)).await.is_err() {
                                        return;
                                    }
                                    tokio::time::sleep(Duration::from_millis(1)).await;
                                }
                            });
                            Response::builder()
                                .header("content-type", "text/event-stream")
                                .body(ChannelBody(rx).boxed_unsync())
                                .unwrap()
                        }
                    };
                    Ok::<_, Infallible>(resp)
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(sock), svc)
                    .await;
            });
        }
    });
    addr
}

const OPENAI_WITH: &[u8] = include_bytes!("fixtures/sse/openai_with_usage.sse");
const OPENAI_WITHOUT: &[u8] = include_bytes!("fixtures/sse/openai_without_usage.sse");
const LLAMA_WITH: &[u8] = include_bytes!("fixtures/sse/llamacpp_with_usage.sse");
const LLAMA_WITHOUT: &[u8] = include_bytes!("fixtures/sse/llamacpp_without_usage.sse");
const JSON: &[u8] = include_bytes!("fixtures/json/openai_response.json");

fn replies(path: &str) -> Reply {
    match path {
        "/openai" => Reply::Sse(OPENAI_WITH, 37),
        "/llama" => Reply::Sse(LLAMA_WITH, 101),
        "/llama-plain" => Reply::Sse(LLAMA_WITHOUT, 64),
        _ => Reply::Json(JSON),
    }
}

type Sink = Arc<Mutex<Vec<TapOutcome>>>;

async fn fetch(addr: std::net::SocketAddr, path: &str, hide: bool) -> (Bytes, Sink) {
    let client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
    let resp = client
        .get(format!("http://{addr}{path}").parse().unwrap())
        .await
        .unwrap();
    let kind = BodyKind::from_content_type(
        resp.headers()
            .get("content-type")
            .and_then(|v| v.to_str().ok()),
    );
    let sink: Sink = Arc::default();
    let s2 = sink.clone();
    let obs = UsageObserver::new(kind, move |o| s2.lock().unwrap().push(o));
    let tapped = TapBody::new(resp.into_body(), obs);
    let bytes = if hide {
        HideUsageBody::new(tapped)
            .collect()
            .await
            .unwrap()
            .to_bytes()
    } else {
        tapped.collect().await.unwrap().to_bytes()
    };
    (bytes, sink)
}

#[tokio::test]
async fn forced_usage_is_read_and_hidden() {
    let addr = mock_upstream(replies).await;
    for (path, without, prompt) in [
        ("/openai", OPENAI_WITHOUT, 9),
        ("/llama", LLAMA_WITHOUT, 75),
    ] {
        let (bytes, sink) = fetch(addr, path, true).await;
        assert_eq!(&bytes[..], without, "{path}");
        let got = sink.lock().unwrap();
        assert_eq!(got.len(), 1);
        assert_eq!(got[0].eos, Eos::Complete);
        assert_eq!(
            got[0].report.prompt_tokens(),
            Some((prompt, PromptSource::Usage))
        );
    }
}

#[tokio::test]
async fn client_asked_usage_passes_untouched() {
    let addr = mock_upstream(replies).await;
    let (bytes, sink) = fetch(addr, "/openai", false).await;
    assert_eq!(&bytes[..], OPENAI_WITH);
    assert_eq!(
        sink.lock().unwrap()[0].report.prompt_tokens(),
        Some((9, PromptSource::Usage))
    );
}

#[tokio::test]
async fn timings_fallback_over_the_wire() {
    let addr = mock_upstream(replies).await;
    let (bytes, sink) = fetch(addr, "/llama-plain", false).await;
    assert_eq!(&bytes[..], LLAMA_WITHOUT);
    assert_eq!(
        sink.lock().unwrap()[0].report.prompt_tokens(),
        Some((75, PromptSource::Timings))
    );
}

#[tokio::test]
async fn content_length_json_completes() {
    let addr = mock_upstream(replies).await;
    let (bytes, sink) = fetch(addr, "/json", false).await;
    assert_eq!(&bytes[..], JSON);
    let got = sink.lock().unwrap();
    assert_eq!(got[0].eos, Eos::Complete);
    assert_eq!(
        got[0].report.prompt_tokens(),
        Some((1117, PromptSource::Usage))
    );
}

#[tokio::test]
async fn client_going_away_is_cancelled() {
    let addr = mock_upstream(replies).await;
    let client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
    let resp = client
        .get(format!("http://{addr}/openai").parse().unwrap())
        .await
        .unwrap();
    let sink: Sink = Arc::default();
    let s2 = sink.clone();
    let obs = UsageObserver::new(BodyKind::Sse, move |o| s2.lock().unwrap().push(o));
    let mut tapped = TapBody::new(resp.into_body(), obs);
    let first = tapped.frame().await.unwrap().unwrap();
    assert!(first.is_data());
    drop(tapped);
    let got = sink.lock().unwrap();
    assert_eq!(got.len(), 1);
    assert_eq!(got[0].eos, Eos::Cancelled);
    assert_eq!(got[0].report.usage, None);
}
