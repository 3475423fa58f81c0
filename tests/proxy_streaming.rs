//! Streaming in both directions: SSE frames arrive while the upstream still
//! generates, client disconnects cancel the upstream, 100 MB bodies stream
//! through, an idle upstream ends the stream, graceful shutdown drains.

// Test code: a failed unwrap is a failed test. clippy.toml allows that in
// #[test] functions only, not in the helpers they share.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::time::Duration;

use bytes::Bytes;
use http_body_util::BodyExt;
use hyper::body::Frame;
use support::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const FIRST: &str = "data: {\"choices\":[{\"delta\":{\"content\":\"first\"}}]}\n\n";
const LAST: &str = "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":3}}\n\ndata: [DONE]\n\n";

fn held(release: &Release) -> Reply {
    Reply::Held {
        status: 200,
        headers: vec![("content-type", "text/event-stream".into())],
        first: vec![Bytes::from_static(FIRST.as_bytes())],
        release: release.clone(),
        rest: vec![Bytes::from_static(LAST.as_bytes())],
    }
}

/// Reads frames until `want` bytes arrived (bounded in time).
async fn read_at_least(body: &mut hyper::body::Incoming, want: usize) -> Vec<u8> {
    let mut got = Vec::new();
    while got.len() < want {
        let frame = tokio::time::timeout(Duration::from_secs(10), body.frame())
            .await
            .expect("frame did not arrive while upstream holds the stream")
            .expect("body ended early")
            .unwrap();
        if let Some(d) = frame.data_ref() {
            got.extend_from_slice(d);
        }
    }
    got
}

#[tokio::test]
async fn first_sse_event_arrives_before_upstream_finishes() {
    let release = Release::new();
    let up = MockUpstream::builder()
        .route("/v1/chat/completions", held(&release))
        .run()
        .await;
    let proxy = start_proxy(&up.url(), "").await;
    let req = request(
        "POST",
        &format!("{}/v1/chat/completions", proxy.url()),
        full(r#"{"stream":true}"#),
    );
    // Bounded: a buffering proxy would never send the head while held.
    let resp = tokio::time::timeout(Duration::from_secs(10), client().request(req))
        .await
        .expect("response head not forwarded while the upstream still generates")
        .unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.headers()["content-type"], "text/event-stream");
    let mut body = resp.into_body();
    // The upstream is still holding the rest: this only passes if compactor
    // forwards frames as they arrive.
    let first = read_at_least(&mut body, FIRST.len()).await;
    assert_eq!(first, FIRST.as_bytes());
    assert_eq!(up.cancelled(), 0);

    release.release();
    let rest = body.collect().await.unwrap().to_bytes();
    assert_eq!(rest, LAST.as_bytes());
}

#[tokio::test]
async fn request_body_streams_to_upstream() {
    // The upstream answers only after the whole body; the test feeds the
    // body in pieces and checks the upstream saw every byte in order.
    let up = MockUpstream::builder()
        .route("/upload", Reply::BodyDigest)
        .run()
        .await;
    let proxy = start_proxy(&up.url(), "").await;
    let (tx, body) = channel_request_body();
    let req = request("POST", &format!("{}/upload", proxy.url()), body);
    let pending = tokio::spawn(async move { fetch(req).await });
    let mut expected = Vec::new();
    for i in 0..20u8 {
        let piece = vec![i; 1000 + i as usize];
        expected.extend_from_slice(&piece);
        tx.send(Ok(Frame::data(Bytes::from(piece)))).await.unwrap();
    }
    drop(tx);
    let (status, _, _) = pending.await.unwrap();
    assert_eq!(status, 200);
    let seen = up.last_request();
    assert_eq!(seen.body, expected);
    assert_eq!(seen.headers["transfer-encoding"], "chunked");
}

/// A generation that runs for about 20 s unless cancelled: `FIRST` at
/// once, then another event every 50 ms. A test waiting (at most 10 s) for
/// its cancellation fails if compactor never cancels.
fn long_generation() -> Reply {
    let mut chunks = vec![(Duration::ZERO, Bytes::from_static(FIRST.as_bytes()))];
    chunks.extend((0..400).map(|_| {
        (
            Duration::from_millis(50),
            Bytes::from_static(FIRST.as_bytes()),
        )
    }));
    Reply::Chunks {
        status: 200,
        headers: vec![("content-type", "text/event-stream".into())],
        chunks,
    }
}

/// Waits until the upstream saw its stream cancelled and its connection
/// closed, and compactor freed the request.
async fn assert_cancelled(up: &MockUpstream, proxy: &compactor::server::RunningServer) {
    let observed = up
        .wait_for(Duration::from_secs(10), |u| {
            u.cancelled() == 1 && u.closed_connections() == 1
        })
        .await;
    assert!(
        observed,
        "upstream did not see the cancel: cancelled={} closed={}",
        up.cancelled(),
        up.closed_connections()
    );
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while !proxy
        .state
        .metrics
        .render(0, 0)
        .contains("compactor_requests_in_flight 0")
    {
        assert!(
            tokio::time::Instant::now() < deadline,
            "in-flight count leaked"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// A client that hangs up mid-stream cancels the upstream generation. A
/// hang-up is noticed on the first write that fails (compactor serves
/// HTTP/1 with half-close allowed, so a read EOF alone is not an abort):
/// the generation goes on producing events, and the next ones cannot be
/// written.
#[tokio::test]
async fn client_disconnect_cancels_upstream() {
    let up = MockUpstream::builder()
        .route("/v1/chat/completions", long_generation())
        .run()
        .await;
    let proxy = start_proxy(&up.url(), "").await;
    let req = request(
        "POST",
        &format!("{}/v1/chat/completions", proxy.url()),
        full(r#"{"stream":true}"#),
    );
    let resp = client().request(req).await.unwrap();
    let mut body = resp.into_body();
    let _ = read_at_least(&mut body, FIRST.len()).await;
    assert_eq!(up.cancelled(), 0);
    assert_eq!(up.closed_connections(), 0);
    // Client hangs up mid-stream.
    drop(body);
    assert_cancelled(&up, &proxy).await;
}

#[tokio::test]
async fn large_response_streams_identically() {
    const TOTAL: u64 = 100 * 1024 * 1024;
    let up = MockUpstream::builder()
        .route(
            "/big",
            Reply::Generated {
                status: 200,
                total: TOTAL,
                chunk: 256 * 1024,
            },
        )
        .run()
        .await;
    let proxy = start_proxy(&up.url(), "").await;
    let direct = client()
        .request(request("GET", &format!("{}/big", up.url()), empty()))
        .await
        .unwrap();
    let direct = digest_body(direct.into_body()).await;
    let via = client()
        .request(request("GET", &format!("{}/big", proxy.url()), empty()))
        .await
        .unwrap();
    assert_eq!(via.status(), 200);
    let via = digest_body(via.into_body()).await;
    assert_eq!(direct.0, TOTAL);
    assert_eq!(via, direct);
}

#[tokio::test]
async fn large_request_streams_identically() {
    const TOTAL: u64 = 100 * 1024 * 1024;
    const CHUNK: usize = 256 * 1024;
    let up = MockUpstream::builder()
        .route("/upload", Reply::BodyDigest)
        .run()
        .await;
    let proxy = start_proxy(&up.url(), "max_body_bytes = 209715200\n").await;
    let (tx, body) = channel_request_body();
    let req = request("POST", &format!("{}/upload", proxy.url()), body);
    let pending = tokio::spawn(async move { fetch(req).await });
    let mut hasher = xxhash_rust::xxh3::Xxh3::new();
    let mut offset = 0u64;
    while offset < TOTAL {
        let n = (CHUNK as u64).min(TOTAL - offset);
        let bytes: Vec<u8> = (offset..offset + n).map(pattern_byte).collect();
        hasher.update(&bytes);
        offset += n;
        tx.send(Ok(Frame::data(Bytes::from(bytes)))).await.unwrap();
    }
    drop(tx);
    let (status, _, body) = pending.await.unwrap();
    assert_eq!(status, 200);
    let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(v["len"], TOTAL);
    assert_eq!(
        v["xxh3"].as_str().unwrap(),
        format!("{:032x}", hasher.digest128())
    );
}

#[tokio::test]
async fn idle_upstream_ends_the_stream() {
    let release = Release::new(); // never released
    let up = MockUpstream::builder()
        .route("/v1/chat/completions", held(&release))
        .run()
        .await;
    let proxy = start_proxy(&up.url(), "[timeouts]\nidle_secs = 1\n").await;
    let req = request(
        "POST",
        &format!("{}/v1/chat/completions", proxy.url()),
        full("{}"),
    );
    let resp = client().request(req).await.unwrap();
    assert_eq!(resp.status(), 200);
    let mut body = resp.into_body();
    let first = read_at_least(&mut body, FIRST.len()).await;
    assert_eq!(first, FIRST.as_bytes());
    // Next read must end (with an error: the stream was cut, not completed).
    let end = tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            match body.frame().await {
                Some(Ok(_)) => continue,
                Some(Err(_)) => return "error",
                None => return "eof",
            }
        }
    })
    .await
    .expect("stream was not ended by the idle timeout");
    assert_eq!(end, "error", "a cut stream must not look complete");
    assert!(
        up.wait_for(Duration::from_secs(10), |u| u.cancelled() == 1)
            .await,
        "upstream stream was not dropped"
    );
    let text = proxy.state.metrics.render(0, 0);
    assert!(
        text.contains("compactor_stream_idle_timeouts_total 1"),
        "{text}"
    );
}

#[tokio::test]
async fn graceful_shutdown_lets_in_flight_stream_finish() {
    let release = Release::new();
    let up = MockUpstream::builder()
        .route("/v1/chat/completions", held(&release))
        .run()
        .await;
    let proxy = start_proxy(&up.url(), "[timeouts]\nshutdown_grace_secs = 30\n").await;
    let addr = proxy.addr;
    let req = request(
        "POST",
        &format!("http://{addr}/v1/chat/completions"),
        full("{}"),
    );
    let resp = client().request(req).await.unwrap();
    let mut body = resp.into_body();
    let _ = read_at_least(&mut body, FIRST.len()).await;

    let shutdown = tokio::spawn(proxy.shutdown());
    // New connections are refused once the listener is dropped.
    let refused = async {
        loop {
            if tokio::net::TcpStream::connect(addr).await.is_err() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(10), refused)
        .await
        .expect("listener still accepting after shutdown");
    assert!(
        !shutdown.is_finished(),
        "shutdown did not wait for the stream"
    );

    release.release();
    let rest = body.collect().await.unwrap().to_bytes();
    assert_eq!(rest, LAST.as_bytes());
    tokio::time::timeout(Duration::from_secs(10), shutdown)
        .await
        .expect("shutdown did not complete after the stream ended")
        .unwrap();
}

/// A shutdown closes a keep-alive connection idling between requests at
/// once, and makes the response in flight on another the last on its
/// connection: `Connection: close`, then the connection ends.
#[tokio::test]
async fn shutdown_closes_idle_connections_and_busy_ones_after_their_response() {
    let release = Release::new();
    let answer = || Reply::Full {
        status: 200,
        headers: vec![("content-type", "application/json".into())],
        body: Bytes::from_static(b"{}"),
    };
    let up = MockUpstream::builder()
        .route("/v1/models", answer())
        .route(
            "/slow",
            Reply::AfterRelease {
                release: release.clone(),
                then: Box::new(answer()),
            },
        )
        .run()
        .await;
    let proxy = start_proxy(&up.url(), "[timeouts]\nshutdown_grace_secs = 30\n").await;
    let addr = proxy.addr;
    let get = |path: &str| format!("GET {path} HTTP/1.1\r\nhost: x\r\n\r\n");

    // Answered, and kept alive: it idles, waiting for a next request.
    let mut idle = tokio::net::TcpStream::connect(addr).await.unwrap();
    idle.write_all(get("/v1/models").as_bytes()).await.unwrap();
    let head = read_response(&mut idle).await.to_ascii_lowercase();
    assert!(head.starts_with("http/1.1 200"), "{head}");
    assert!(!head.contains("connection: close"), "{head}");
    // Two requests answered on it before: the wait is the same each time.
    idle.write_all(get("/v1/models").as_bytes()).await.unwrap();
    read_response(&mut idle).await;

    // Its request is upstream, its response head not come yet.
    let mut busy = tokio::net::TcpStream::connect(addr).await.unwrap();
    busy.write_all(get("/slow").as_bytes()).await.unwrap();
    let asked = up
        .wait_for(Duration::from_secs(10), |u| {
            u.requests().iter().any(|r| r.uri.path() == "/slow")
        })
        .await;
    assert!(asked, "the slow request did not reach the upstream");

    let shutdown = tokio::spawn(proxy.shutdown());
    let mut rest = [0u8; 64];
    let n = tokio::time::timeout(Duration::from_secs(10), idle.read(&mut rest))
        .await
        .expect("the idle connection was not closed")
        .unwrap();
    assert_eq!(n, 0, "an idle connection got bytes, not its end");
    assert!(
        !shutdown.is_finished(),
        "shutdown did not wait for the busy one"
    );

    release.release();
    let head = read_response(&mut busy).await.to_ascii_lowercase();
    assert!(head.starts_with("http/1.1 200"), "{head}");
    assert!(head.contains("connection: close"), "{head}");
    let n = tokio::time::timeout(Duration::from_secs(10), busy.read(&mut rest))
        .await
        .expect("the connection stayed open after its last response")
        .unwrap();
    assert_eq!(n, 0);
    tokio::time::timeout(Duration::from_secs(10), shutdown)
        .await
        .expect("shutdown did not complete")
        .unwrap();
}

/// A client that hangs up while the upstream has not answered yet cancels
/// the upstream request once the upstream answers: the first writes of the
/// response fail. Before that, a hang-up cannot be told from a half-close
/// (both are a read EOF), and a half-closed client is owed its response,
/// so the wait for the head is bounded by `timeouts.first_byte_secs`, not
/// cut short by the EOF. A compaction the request started finishes and is
/// recorded either way (it runs detached).
#[tokio::test]
async fn client_disconnect_before_response_head_cancels_upstream() {
    let release = Release::new();
    let up = MockUpstream::builder()
        .route(
            "/v1/chat/completions",
            Reply::AfterRelease {
                release: release.clone(),
                then: Box::new(long_generation()),
            },
        )
        .run()
        .await;
    let proxy = start_proxy(&up.url(), "").await;
    let addr = proxy.url().trim_start_matches("http://").to_string();
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    s.write_all(
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: 15\r\n\r\n{\"stream\":true}",
    )
    .await
    .unwrap();
    assert!(
        up.wait_for(Duration::from_secs(10), |u| u.requests().len() == 1)
            .await
    );
    assert!(proxy
        .state
        .metrics
        .render(0, 0)
        .contains("compactor_requests_in_flight 1"));
    // The client goes away before any byte of the response.
    drop(s);
    release.release();
    assert_cancelled(&up, &proxy).await;
}

#[tokio::test]
async fn upstream_dying_mid_stream_ends_client_stream_the_same_way() {
    let up = MockUpstream::builder()
        .route(
            "/v1/chat/completions",
            Reply::Broken {
                first: vec![Bytes::from_static(FIRST.as_bytes())],
            },
        )
        .run()
        .await;
    let proxy = start_proxy(&up.url(), "").await;
    for base in [up.url(), proxy.url()] {
        let req = request("POST", &format!("{base}/v1/chat/completions"), full("{}"));
        let resp = client().request(req).await.unwrap();
        assert_eq!(resp.status(), 200);
        let mut body = resp.into_body();
        let mut got = Vec::new();
        let ended_with_error = tokio::time::timeout(Duration::from_secs(10), async {
            loop {
                match body.frame().await {
                    Some(Ok(f)) => {
                        got.extend_from_slice(f.data_ref().map(|d| &d[..]).unwrap_or(&[]))
                    }
                    Some(Err(_)) => return true,
                    None => return false,
                }
            }
        })
        .await
        .unwrap();
        assert!(ended_with_error, "{base}: truncated stream looked complete");
        assert_eq!(got, FIRST.as_bytes(), "{base}");
    }
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(proxy
        .state
        .metrics
        .render(0, 0)
        .contains("compactor_requests_in_flight 0"));
}

#[tokio::test]
async fn client_abort_mid_upload_cancels_upstream_request() {
    use tokio::io::AsyncWriteExt;
    let up = MockUpstream::builder()
        .route("/upload", Reply::BodyDigest)
        .run()
        .await;
    let proxy = start_proxy(&up.url(), "").await;
    let mut s = tokio::net::TcpStream::connect(proxy.addr).await.unwrap();
    // Larger than the passthrough bodies held for a replay (1 MiB): streamed.
    s.write_all(b"POST /upload HTTP/1.1\r\nHost: x\r\nContent-Length: 2000000\r\n\r\n0123456789")
        .await
        .unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while !proxy
        .state
        .metrics
        .render(0, 0)
        .contains("compactor_requests_in_flight 1")
    {
        assert!(
            tokio::time::Instant::now() < deadline,
            "request never started"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // Give the proxy time to open the upstream request and stream the prefix.
    tokio::time::sleep(Duration::from_millis(100)).await;
    drop(s);
    assert!(
        up.wait_for(Duration::from_secs(10), |u| u.closed_connections() == 1)
            .await,
        "upstream upload was not cancelled"
    );
    // The upstream never saw a complete body.
    assert!(up.requests().iter().all(|r| r.body_len < 2_000_000));
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while !proxy
        .state
        .metrics
        .render(0, 0)
        .contains("compactor_requests_in_flight 0")
    {
        assert!(
            tokio::time::Instant::now() < deadline,
            "in-flight count leaked"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

const PROCESSING: &str = ": PROCESSING\n\n";

/// An upstream still reading a long prompt: 200 `text/event-stream`, then
/// `: PROCESSING` every 200 ms until `go` is notified (bounded at 15 s),
/// then the generation.
async fn processing_upstream(go: std::sync::Arc<tokio::sync::Notify>) -> (String, Task) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let task = serve_mock(listener, go, |go, req| async move {
        let (tx, body) = channel_request_body();
        let chat = req.uri().path() == "/v1/chat/completions";
        tokio::spawn(async move {
            if !chat {
                return;
            }
            for _ in 0..75 {
                let comment = Frame::data(Bytes::from_static(PROCESSING.as_bytes()));
                if tx.send(Ok(comment)).await.is_err() {
                    return;
                }
                let tick = tokio::time::sleep(Duration::from_millis(200));
                tokio::select! {
                    () = go.notified() => break,
                    () = tick => {}
                }
            }
            for event in [FIRST, LAST] {
                let _ = tx
                    .send(Ok(Frame::data(Bytes::from_static(event.as_bytes()))))
                    .await;
            }
        });
        let mut resp = hyper::Response::new(body);
        if chat {
            resp.headers_mut()
                .insert("content-type", "text/event-stream".parse().unwrap());
        } else {
            *resp.status_mut() = hyper::StatusCode::NOT_FOUND;
        }
        Ok::<_, std::convert::Infallible>(resp)
    });
    (url, Task(task))
}

/// Aborts the mock's accept loop with the test.
struct Task(tokio::task::JoinHandle<()>);

impl Drop for Task {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// A streamed chat request is held back until its first data event (an
/// in-band overflow error can still be retried), but the comments an
/// upstream sends meanwhile reach the client as they arrive: the upstream
/// sends its first data event only once the client has seen a comment.
#[tokio::test]
async fn comments_before_the_first_event_reach_the_client_while_held_back() {
    let go = std::sync::Arc::new(tokio::sync::Notify::new());
    let (up, _task) = processing_upstream(std::sync::Arc::clone(&go)).await;
    let proxy = start_proxy(&up, "").await;
    // The client asks for usage itself: nothing is hidden from its stream.
    let chat = r#"{"model":"m","stream":true,"stream_options":{"include_usage":true},"messages":[{"role":"user","content":"hello"}]}"#;
    let req = request(
        "POST",
        &format!("{}/v1/chat/completions", proxy.url()),
        full(chat),
    );
    // Bounded only so a proxy that holds the comments back fails instead
    // of waiting for ever: the upstream sends no data event until `go`.
    let resp = tokio::time::timeout(Duration::from_secs(10), client().request(req))
        .await
        .expect("no response head while the upstream sends comments")
        .unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.headers()["content-type"], "text/event-stream");
    assert!(resp.headers().get("content-length").is_none());
    let mut body = resp.into_body();
    let first = read_at_least(&mut body, PROCESSING.len()).await;
    assert!(first.starts_with(PROCESSING.as_bytes()), "{first:?}");
    assert!(!String::from_utf8_lossy(&first).contains("data:"));
    go.notify_one();
    let rest = body.collect().await.unwrap().to_bytes();
    let mut all = first;
    all.extend_from_slice(&rest);
    // The same bytes in the same order: comments, then the generation.
    let mut text = String::from_utf8(all).unwrap();
    while let Some(after) = text.strip_prefix(PROCESSING) {
        text = after.to_owned();
    }
    assert_eq!(text, format!("{FIRST}{LAST}"));
}

/// Waits (bounded) until the proxy's metrics contain `line`.
async fn metrics_show(proxy: &compactor::server::RunningServer, line: &str) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let text = proxy.state.metrics.render(0, 0);
        if text.lines().any(|l| l == line) {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "no `{line}`: {text}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Sends `sent` bytes of a chat body declared as `declared`, waits until the
/// proxy has buffered them, and hangs up.
async fn abandon_chat_upload(
    proxy: &compactor::server::RunningServer,
    declared: usize,
    sent: usize,
) {
    let mut s = tokio::net::TcpStream::connect(proxy.addr).await.unwrap();
    let head = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {declared}\r\n\r\n"
    );
    s.write_all(head.as_bytes()).await.unwrap();
    s.write_all(&vec![b' '; sent]).await.unwrap();
    metrics_show(proxy, &format!("compactor_buffered_body_bytes {sent}")).await;
    drop(s);
    metrics_show(proxy, "compactor_requests_in_flight 0").await;
}

/// A large chat body dropped mid-upload asks the allocator to give its
/// memory back (counted); a small one does not.
#[tokio::test]
async fn abandoned_large_chat_upload_gives_memory_back() {
    let up = MockUpstream::builder().run().await;
    let proxy = start_proxy(&up.url(), "").await;
    abandon_chat_upload(&proxy, 1 << 20, 100_000).await;
    metrics_show(&proxy, "compactor_abandoned_large_bodies_total 0").await;
    abandon_chat_upload(&proxy, 31_000_000, 2 << 20).await;
    metrics_show(&proxy, "compactor_abandoned_large_bodies_total 1").await;
    // Nothing reached the upstream.
    assert!(up.requests().is_empty());
}
