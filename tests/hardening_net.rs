//! Network hardening: every wait on the upstream or the client is bounded,
//! connections and buffered bodies are capped, pooled keep-alive races are
//! retried, half-closed clients are answered and bytes received before an
//! upstream failure reach the client.
//!
//! The faulty peers are tiny raw TCP servers and clients, so stalls, resets
//! and half-closes can be scripted byte by byte. Timeouts are configured
//! short (1–2 s) and the tests assert outcomes under generous outer bounds.

// Test code: a failed setup step should panic the test.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use http_body_util::BodyExt;
use serde_json::json;
use support::chat::*;
use support::start_proxy;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// Outer bound for anything that must not hang.
const BOUND: Duration = Duration::from_secs(15);

// ------------------------------------------------------------ raw peers

/// Starts a raw upstream: `handle` runs once per accepted connection.
async fn raw_upstream<F, Fut>(handle: F) -> String
where
    F: Fn(TcpStream, usize) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = ()> + Send + 'static,
{
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let handle = Arc::new(handle);
    let count = Arc::new(AtomicUsize::new(0));
    tokio::spawn(async move {
        while let Ok((s, _)) = listener.accept().await {
            let n = count.fetch_add(1, Ordering::Relaxed);
            tokio::spawn(handle(s, n));
        }
    });
    format!("http://{addr}")
}

/// Reads one request (head and Content-Length body); `None` on EOF.
async fn read_request(s: &mut TcpStream) -> Option<Vec<u8>> {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 8192];
    loop {
        if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&buf[..end]).to_ascii_lowercase();
            let len = head
                .lines()
                .find_map(|l| l.strip_prefix("content-length:"))
                .map_or(0, |v| v.trim().parse::<usize>().unwrap());
            while buf.len() < end + 4 + len {
                let n = s.read(&mut chunk).await.ok()?;
                if n == 0 {
                    return None;
                }
                buf.extend_from_slice(&chunk[..n]);
            }
            return Some(buf);
        }
        let n = s.read(&mut chunk).await.ok()?;
        if n == 0 {
            return None;
        }
        buf.extend_from_slice(&chunk[..n]);
    }
}

const SSE_HEAD: &[u8] =
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n";

fn chunk(data: &[u8]) -> Vec<u8> {
    let mut out = format!("{:x}\r\n", data.len()).into_bytes();
    out.extend_from_slice(data);
    out.extend_from_slice(b"\r\n");
    out
}

const JSON_OK: &[u8] =
    b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}";

/// A raw client: connects and writes `bytes`.
async fn raw_client(proxy: &str, bytes: &[u8]) -> TcpStream {
    let addr = proxy.trim_start_matches("http://");
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(bytes).await.unwrap();
    s
}

/// Reads until EOF, error or `BOUND`; returns what arrived.
async fn read_all(s: &mut TcpStream) -> Vec<u8> {
    let mut out = Vec::new();
    let _ = tokio::time::timeout(BOUND, async {
        let mut chunk = [0u8; 8192];
        loop {
            match s.read(&mut chunk).await {
                Ok(0) | Err(_) => break,
                Ok(n) => out.extend_from_slice(&chunk[..n]),
            }
        }
    })
    .await;
    out
}

/// Whether the peer closes `s` (EOF or reset) within `BOUND`.
async fn closed_within_bound(s: &mut TcpStream) -> bool {
    tokio::time::timeout(BOUND, async {
        let mut chunk = [0u8; 1024];
        loop {
            match s.read(&mut chunk).await {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
        }
    })
    .await
    .is_ok()
}

fn stream_body() -> Vec<u8> {
    chat_body("m", &[json!({"role": "user", "content": "hi"})], true)
}

fn plain_body() -> Vec<u8> {
    chat_body("m", &[json!({"role": "user", "content": "hi"})], false)
}

/// POSTs a chat body with hyper's client; returns status and the body bytes
/// that arrived before the end or an error, all within `BOUND`.
async fn post_partial(proxy: &str, path: &str, body: Vec<u8>) -> (u16, Vec<u8>, bool) {
    post_partial_after(proxy, path, body, Duration::ZERO).await
}

/// [`post_partial`], reading the body only after `pause` (a slow client).
async fn post_partial_after(
    proxy: &str,
    path: &str,
    body: Vec<u8>,
    pause: Duration,
) -> (u16, Vec<u8>, bool) {
    let client = support::client();
    let mut req = support::request("POST", &format!("{proxy}{path}"), support::full(body));
    req.headers_mut()
        .insert("content-type", "application/json".parse().unwrap());
    let fut = async {
        let resp = client.request(req).await.unwrap();
        let status = resp.status().as_u16();
        tokio::time::sleep(pause).await;
        let mut body = resp.into_body();
        let mut got = Vec::new();
        let mut errored = false;
        while let Some(f) = body.frame().await {
            match f {
                Ok(f) => {
                    if let Some(d) = f.data_ref() {
                        got.extend_from_slice(d);
                    }
                }
                Err(_) => {
                    errored = true;
                    break;
                }
            }
        }
        (status, got, errored)
    };
    tokio::time::timeout(BOUND, fut)
        .await
        .expect("the client must not wait without bound")
}

/// Known window (no discovery requests to the raw upstreams), short
/// upstream timeouts.
const SHORT: &str =
    "[models.\"m\"]\ncontext_length = 100000\n[timeouts]\nfirst_byte_secs = 2\nidle_secs = 1\n";
/// Known window only.
const MODEL: &str = "[models.\"m\"]\ncontext_length = 100000\n";

// ------------------------------------------------------- 1. hold-back

#[tokio::test]
async fn stream_head_then_silence_is_bounded() {
    let up = raw_upstream(|mut s, _| async move {
        read_request(&mut s).await;
        s.write_all(SSE_HEAD).await.unwrap();
        tokio::time::sleep(Duration::from_secs(60)).await;
    })
    .await;
    let proxy = start_proxy(&up, SHORT).await;
    let (status, _, _) = post_partial(&proxy.url(), "/v1/chat/completions", stream_body()).await;
    assert!(status == 200 || status == 504, "{status}");
}

#[tokio::test]
async fn error_head_and_partial_body_then_silence_forwards_the_bytes() {
    let up = raw_upstream(|mut s, _| async move {
        read_request(&mut s).await;
        s.write_all(
            b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\ncontent-length: 100\r\n\r\n{\"error\":{\"mess",
        )
        .await
        .unwrap();
        tokio::time::sleep(Duration::from_secs(60)).await;
    })
    .await;
    let proxy = start_proxy(&up, SHORT).await;
    for body in [stream_body(), plain_body()] {
        let (status, got, _) = post_partial(&proxy.url(), "/v1/chat/completions", body).await;
        assert_eq!(status, 400);
        assert_eq!(got, b"{\"error\":{\"mess");
    }
}

#[tokio::test]
async fn keep_alive_comments_only_are_released_after_the_deadline() {
    let up = raw_upstream(|mut s, _| async move {
        read_request(&mut s).await;
        s.write_all(SSE_HEAD).await.unwrap();
        for _ in 0..200 {
            if s.write_all(&chunk(b": keep-alive\n\n")).await.is_err() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    })
    .await;
    let proxy = start_proxy(&up, SHORT).await;
    let client = support::client();
    let mut req = support::request(
        "POST",
        &format!("{}/v1/chat/completions", proxy.url()),
        support::full(stream_body()),
    );
    req.headers_mut()
        .insert("content-type", "application/json".parse().unwrap());
    let got = tokio::time::timeout(BOUND, async {
        let resp = client.request(req).await.unwrap();
        assert_eq!(resp.status(), 200);
        let mut body = resp.into_body();
        let f = body.frame().await.unwrap().unwrap();
        f.into_data().unwrap()
    })
    .await
    .expect("held back without bound");
    assert!(got.starts_with(b": keep-alive"), "{got:?}");
}

#[tokio::test]
async fn upstream_failure_during_hold_back_forwards_its_bytes() {
    let up = raw_upstream(|mut s, _| async move {
        read_request(&mut s).await;
        s.write_all(SSE_HEAD).await.unwrap();
        s.write_all(&chunk(b": ping\n\n")).await.unwrap();
        // Closed mid-chunked-body: the proxy sees the body fail.
    })
    .await;
    let proxy = start_proxy(&up, SHORT).await;
    let (status, got, errored) =
        post_partial(&proxy.url(), "/v1/chat/completions", stream_body()).await;
    assert_eq!(status, 200);
    assert_eq!(got, b": ping\n\n");
    assert!(errored, "the cut must be visible to the client");
}

// ------------------------------------------------- 2. slow clients

#[tokio::test]
async fn a_partial_chat_body_times_out_with_408() {
    let up = raw_upstream(|mut s, _| async move {
        while read_request(&mut s).await.is_some() {
            s.write_all(JSON_OK).await.unwrap();
        }
    })
    .await;
    let proxy = start_proxy(&up, &format!("{MODEL}[timeouts]\nbody_read_secs = 1\n")).await;
    let mut s = raw_client(
        &proxy.url(),
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: 1000\r\n\r\n{\"model\":",
    )
    .await;
    let got = read_all(&mut s).await;
    let text = String::from_utf8_lossy(&got);
    assert!(text.starts_with("HTTP/1.1 408"), "{text}");
    assert!(text.contains("\"error\""), "{text}");
    assert!(metric(&proxy.url(), "compactor_body_read_timeouts_total").await >= 1.0);
}

#[tokio::test]
async fn silent_and_idle_keep_alive_connections_are_closed() {
    let up = raw_upstream(|_, _| async {}).await;
    let proxy = start_proxy(&up, "[timeouts]\nclient_idle_secs = 1\n").await;
    // Never a byte: hyper-util's version sniffing must not wait forever.
    let mut silent = raw_client(&proxy.url(), b"").await;
    assert!(closed_within_bound(&mut silent).await);
    // One request, then a keep-alive gap.
    let mut s = raw_client(
        &proxy.url(),
        b"GET /_compactor/health HTTP/1.1\r\nhost: x\r\n\r\n",
    )
    .await;
    let mut head = [0u8; 12];
    s.read_exact(&mut head).await.unwrap();
    assert_eq!(&head, b"HTTP/1.1 200");
    assert!(closed_within_bound(&mut s).await);
    assert!(metric(&proxy.url(), "compactor_idle_connection_closes_total").await >= 2.0);
}

#[tokio::test]
async fn a_streaming_response_is_not_an_idle_connection() {
    let up = raw_upstream(|mut s, _| async move {
        read_request(&mut s).await;
        s.write_all(SSE_HEAD).await.unwrap();
        // Silent upstream for longer than client_idle_secs, then content.
        tokio::time::sleep(Duration::from_millis(2500)).await;
        let _ = s
            .write_all(&chunk(
                b"data: {\"choices\":[{\"delta\":{\"content\":\"x\"}}]}\n\ndata: [DONE]\n\n",
            ))
            .await;
        let _ = s.write_all(b"0\r\n\r\n").await;
        tokio::time::sleep(Duration::from_secs(5)).await;
    })
    .await;
    let proxy = start_proxy(
        &up,
        &format!("{MODEL}[timeouts]\nclient_idle_secs = 1\nfirst_byte_secs = 10\nidle_secs = 10\n"),
    )
    .await;
    let (status, got, errored) =
        post_partial(&proxy.url(), "/v1/chat/completions", stream_body()).await;
    assert_eq!(status, 200);
    assert!(!errored);
    assert!(String::from_utf8_lossy(&got).contains("[DONE]"));
}

#[tokio::test]
async fn connections_beyond_the_cap_get_503_and_health_keeps_working() {
    let up = raw_upstream(|_, _| async {}).await;
    let proxy = start_proxy(&up, "[limits]\nmax_connections = 4\n").await;
    let mut held = Vec::new();
    for _ in 0..4 {
        held.push(raw_client(&proxy.url(), b"").await);
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut s = raw_client(
        &proxy.url(),
        b"GET /_compactor/health HTTP/1.1\r\nhost: x\r\n\r\n",
    )
    .await;
    let text = String::from_utf8_lossy(&read_all(&mut s).await).to_ascii_lowercase();
    assert!(text.starts_with("http/1.1 503"), "{text}");
    assert!(text.contains("retry-after:"), "{text}");
    held.truncate(1);
    // Under the cap again: health answers.
    let mut ok = false;
    for _ in 0..50 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let mut s = raw_client(
            &proxy.url(),
            b"GET /_compactor/health HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n",
        )
        .await;
        if read_all(&mut s).await.starts_with(b"HTTP/1.1 200") {
            ok = true;
            break;
        }
    }
    assert!(ok, "health checks must be served under the cap");
    drop(held);
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(metric(&proxy.url(), "compactor_connections_rejected_total").await >= 1.0);
    assert!(metric(&proxy.url(), "compactor_connections_open").await >= 1.0);
}

#[tokio::test]
async fn buffered_bodies_beyond_the_budget_get_503() {
    let up = raw_upstream(|mut s, _| async move {
        while read_request(&mut s).await.is_some() {
            s.write_all(JSON_OK).await.unwrap();
        }
    })
    .await;
    let proxy = start_proxy(
        &up,
        &format!("{MODEL}[limits]\nmax_buffered_body_bytes = 100000\n"),
    )
    .await;
    // 80 kB of a 90 kB chat body, held.
    let mut head = b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: 90000\r\n\r\n".to_vec();
    head.extend(std::iter::repeat_n(b' ', 80_000));
    let _held = raw_client(&proxy.url(), &head).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(metric(&proxy.url(), "compactor_buffered_body_bytes").await >= 80_000.0);
    let mut body = plain_body();
    body.extend(std::iter::repeat_n(b' ', 50_000));
    let client = support::client();
    let mut req = support::request(
        "POST",
        &format!("{}/v1/chat/completions", proxy.url()),
        support::full(body),
    );
    req.headers_mut()
        .insert("content-type", "application/json".parse().unwrap());
    let resp = client.request(req).await.unwrap();
    assert_eq!(resp.status(), 503);
    assert!(resp.headers().contains_key("retry-after"));
    let v: serde_json::Value =
        serde_json::from_slice(&resp.into_body().collect().await.unwrap().to_bytes()).unwrap();
    assert!(v["error"]["message"].is_string(), "{v}");
    assert!(metric(&proxy.url(), "compactor_body_budget_rejections_total").await >= 1.0);
    // A small one still fits.
    let (st, _, _) = post_chat(&proxy.url(), plain_body(), &[]).await;
    assert_eq!(st, 200);
}

// ------------------------------------------------- 3. keep-alive race

/// Answers the first request of each connection, then reads the next one
/// and closes without answering: what a request sent on a connection the
/// upstream just closed for idleness sees.
async fn one_per_connection_upstream() -> String {
    raw_upstream(|mut s, _| async move {
        if read_request(&mut s).await.is_some() {
            s.write_all(JSON_OK).await.unwrap();
        }
        read_request(&mut s).await;
    })
    .await
}

#[tokio::test]
async fn a_request_on_a_just_closed_pooled_connection_is_retried() {
    let up = one_per_connection_upstream().await;
    let proxy = start_proxy(&up, MODEL).await;
    for i in 0..6 {
        let (st, _, _) = support::get(&format!("{}/v1/models", proxy.url())).await;
        assert_eq!(st, 200, "passthrough GET #{i}");
        let (st, _, _) = post_chat(&proxy.url(), plain_body(), &[]).await;
        assert_eq!(st, 200, "chat #{i}");
    }
}

#[test]
fn pool_idle_timeout_is_configurable() {
    let text = "listen = \"127.0.0.1:0\"\nupstream = \"http://127.0.0.1:9\"\n[timeouts]\nupstream_pool_idle_secs = 2\n";
    let c = compactor::config::Config::from_toml_str(text, &compactor::config::MapEnv::default())
        .unwrap();
    assert_eq!(c.timeouts.upstream_pool_idle, Duration::from_secs(2));
    let d = compactor::config::Config::default();
    assert!(d.timeouts.upstream_pool_idle < Duration::from_secs(5));
}

// ------------------------------------------------------ 4. half-close

/// A client that shuts its write side once its request is sent (a FIN
/// after a complete request, not an abort) gets its response, on a
/// forwarded route and on the chat route, while the upstream takes its
/// time to answer.
#[tokio::test]
async fn a_half_closed_client_gets_its_response() {
    let up = raw_upstream(|mut s, _| async move {
        read_request(&mut s).await;
        tokio::time::sleep(Duration::from_millis(300)).await;
        let _ = s.write_all(JSON_OK).await;
    })
    .await;
    let proxy = start_proxy(&up, "").await;
    let chat = r#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#;
    let chat_request = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{chat}",
        chat.len()
    );
    for request in [
        b"GET /v1/models HTTP/1.1\r\nhost: x\r\n\r\n".as_slice(),
        chat_request.as_bytes(),
    ] {
        let mut s = raw_client(&proxy.url(), request).await;
        s.shutdown().await.unwrap();
        let got = read_all(&mut s).await;
        assert!(
            got.starts_with(b"HTTP/1.1 200") && got.ends_with(b"{}"),
            "{}",
            String::from_utf8_lossy(&got)
        );
    }
}

// ------------------------------------------- 5. reset mid-stream

/// Sends `events` SSE events of 1 kB in quick bursts, then closes the
/// connection mid-body. Returns the payload bytes it wrote.
async fn burst_then_close(s: &mut TcpStream, events: usize) -> usize {
    read_request(s).await;
    s.write_all(SSE_HEAD).await.unwrap();
    let mut event = b"data: {\"choices\":[{\"delta\":{\"content\":\"".to_vec();
    event.extend(std::iter::repeat_n(b'x', 100));
    event.extend_from_slice(b"\"}}]}\n\n");
    let mut sent = 0;
    let mut burst = Vec::new();
    for i in 0..events {
        burst.extend(chunk(&event));
        sent += event.len();
        if i % 20 == 19 && i + 20 < events {
            s.write_all(&burst).await.unwrap();
            burst.clear();
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    }
    s.write_all(&burst).await.unwrap();
    s.flush().await.unwrap();
    sent
}

#[tokio::test]
async fn bytes_before_an_upstream_failure_reach_the_client() {
    let sent = Arc::new(AtomicUsize::new(0));
    let sent2 = Arc::clone(&sent);
    let up = raw_upstream(move |mut s, _| {
        let sent = Arc::clone(&sent2);
        async move {
            let n = burst_then_close(&mut s, 2000).await;
            sent.store(n, Ordering::SeqCst);
        }
    })
    .await;
    let proxy = start_proxy(&up, MODEL).await;
    for path in ["/v1/completions", "/v1/chat/completions"] {
        for pause in [0, 1500] {
            let pause = Duration::from_millis(pause);
            let (status, got, errored) =
                post_partial_after(&proxy.url(), path, stream_body(), pause).await;
            assert_eq!(status, 200);
            assert!(errored, "{path}: the cut must be visible");
            assert_eq!(got.len(), sent.load(Ordering::SeqCst), "{path}: bytes lost");
        }
    }
}

// ------------------------------------------ 6. summary credentials

#[test]
fn a_foreign_summary_endpoint_needs_its_own_key() {
    let parse = |compaction: &str| {
        let text = format!(
            "listen = \"127.0.0.1:0\"\nupstream = \"http://127.0.0.1:9/v1\"\n[compaction]\n{compaction}"
        );
        compactor::config::Config::from_toml_str(&text, &compactor::config::MapEnv::default())
    };
    let err = parse("summary_endpoint = \"http://other.example:8080\"\n").unwrap_err();
    assert_eq!(err.keys(), ["compaction.summary_api_key"], "{err}");
    assert!(err.to_string().contains("summary_api_key"), "{err}");
    // Same scheme and authority: the client's key goes where it would anyway.
    parse("summary_endpoint = \"http://127.0.0.1:9/other\"\n").unwrap();
    parse("summary_endpoint = \"http://other.example:8080\"\nsummary_api_key = \"sk-s\"\n")
        .unwrap();
    // Another port or scheme is another origin.
    assert!(parse("summary_endpoint = \"http://127.0.0.1:10\"\n").is_err());
    assert!(parse("summary_endpoint = \"https://127.0.0.1:9\"\n").is_err());
}

/// Half-close allowed does not keep dead connections: a client that closes
/// an idle keep-alive connection frees it at once, long before the idle
/// timeout would.
#[tokio::test]
async fn a_closed_keep_alive_connection_is_freed() {
    let up = raw_upstream(|_, _| async {}).await;
    let proxy = start_proxy(&up, "[timeouts]\nclient_idle_secs = 600\n").await;
    let mut s = raw_client(
        &proxy.url(),
        b"GET /_compactor/health HTTP/1.1\r\nhost: x\r\n\r\n",
    )
    .await;
    let mut buf = [0u8; 1024];
    let n = s.read(&mut buf).await.unwrap();
    assert!(buf[..n].starts_with(b"HTTP/1.1 200"));
    assert_eq!(proxy.state.metrics.connections_open(), 1);
    drop(s);
    let mut freed = false;
    for _ in 0..100 {
        if proxy.state.metrics.connections_open() == 0 {
            freed = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(freed, "connection still open after the client closed it");
}

/// A small passthrough POST body (Content-Length up to 1 MiB) is held, so
/// the keep-alive race is retried for it as for chat bodies: before, it was
/// streamed and the race was a 502.
#[tokio::test]
async fn a_small_passthrough_post_on_a_just_closed_pooled_connection_is_retried() {
    let up = one_per_connection_upstream().await;
    let proxy = start_proxy(&up, MODEL).await;
    let body = br#"{"model":"m","input":"hello"}"#;
    for i in 0..6 {
        let mut req = support::request(
            "POST",
            &format!("{}/v1/embeddings", proxy.url()),
            support::full(&body[..]),
        );
        req.headers_mut()
            .insert("content-type", "application/json".parse().unwrap());
        let (st, _, _) = support::fetch(req).await;
        assert_eq!(st, 200, "passthrough POST #{i}");
    }
    let text = proxy.state.metrics.render(0, 0);
    assert!(
        !text.contains("compactor_upstream_unsent_retries_total 0"),
        "the race never happened: {text}"
    );
}
