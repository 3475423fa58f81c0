//! Usage tap and hider over real hyper bodies: a mock upstream on
//! 127.0.0.1:0 streams recorded-shape transcripts frame by frame, and the
//! client side wraps the `Incoming` body the way the proxy will.

// Test code: a failed unwrap is a failed test. clippy.toml allows that in
// #[test] functions only, not in the helpers they share.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use compactor::upstream::body::{Eos, TapBody};
use compactor::usage::hide::HideUsageBody;
use compactor::usage::{BodyKind, PromptSource, TapOutcome, UsageObserver};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use support::{MockUpstream, Reply};

const OPENAI_WITH: &[u8] = include_bytes!("fixtures/sse/openai_with_usage.sse");
const OPENAI_WITHOUT: &[u8] = include_bytes!("fixtures/sse/openai_without_usage.sse");
const LLAMA_WITH: &[u8] = include_bytes!("fixtures/sse/llamacpp_with_usage.sse");
const LLAMA_WITHOUT: &[u8] = include_bytes!("fixtures/sse/llamacpp_without_usage.sse");
const JSON: &[u8] = include_bytes!("fixtures/json/openai_response.json");

/// SSE split into frames of `size` bytes with a pause between them.
fn sse(body: &'static [u8], size: usize) -> Reply {
    let chunks = body
        .chunks(size)
        .enumerate()
        .map(|(i, c)| {
            let pause = if i == 0 { 0 } else { 1 };
            (Duration::from_millis(pause), Bytes::from_static(c))
        })
        .collect();
    Reply::Chunks {
        status: 200,
        headers: vec![("content-type", "text/event-stream".to_owned())],
        chunks,
    }
}

/// The recorded transcripts, one path each; JSON with Content-Length.
async fn mock_upstream() -> MockUpstream {
    MockUpstream::builder()
        .route("/openai", sse(OPENAI_WITH, 37))
        .route("/llama", sse(LLAMA_WITH, 101))
        .route("/llama-plain", sse(LLAMA_WITHOUT, 64))
        .route(
            "/json",
            Reply::Full {
                status: 200,
                headers: vec![("content-type", "application/json".to_owned())],
                body: Bytes::from_static(JSON),
            },
        )
        .run()
        .await
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
    let mock = mock_upstream().await;
    let addr = mock.addr;
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
    let mock = mock_upstream().await;
    let addr = mock.addr;
    let (bytes, sink) = fetch(addr, "/openai", false).await;
    assert_eq!(&bytes[..], OPENAI_WITH);
    assert_eq!(
        sink.lock().unwrap()[0].report.prompt_tokens(),
        Some((9, PromptSource::Usage))
    );
}

#[tokio::test]
async fn timings_fallback_over_the_wire() {
    let mock = mock_upstream().await;
    let addr = mock.addr;
    let (bytes, sink) = fetch(addr, "/llama-plain", false).await;
    assert_eq!(&bytes[..], LLAMA_WITHOUT);
    assert_eq!(
        sink.lock().unwrap()[0].report.prompt_tokens(),
        Some((75, PromptSource::Timings))
    );
}

#[tokio::test]
async fn content_length_json_completes() {
    let mock = mock_upstream().await;
    let addr = mock.addr;
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
    let mock = mock_upstream().await;
    let addr = mock.addr;
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
