//! Errors compactor itself produces: 502 unreachable, 504 slow upstream,
//! 413 oversize body (declared and streamed), all in OpenAI's error shape.

// Test code: a failed unwrap is a failed test. clippy.toml allows that in
// #[test] functions only, not in the helpers they share.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::time::Duration;

use bytes::Bytes;
use hyper::body::Frame;
use support::*;
use tokio::io::AsyncWriteExt;

fn assert_openai_error(body: &Bytes, code: &str) -> serde_json::Value {
    let v: serde_json::Value = serde_json::from_slice(body).unwrap();
    let err = &v["error"];
    assert_eq!(err["code"], code, "{v}");
    assert!(
        err["message"].as_str().is_some_and(|m| !m.is_empty()),
        "{v}"
    );
    assert!(err["type"].is_string(), "{v}");
    v
}

#[tokio::test]
async fn upstream_down_is_502() {
    // A port that was just free: nothing listens there.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    drop(listener);
    let proxy = start_proxy(&format!("http://{addr}"), "").await;
    for (method, path) in [("GET", "/v1/models"), ("POST", "/v1/chat/completions")] {
        let (status, headers, body) = fetch(request(
            method,
            &format!("{}{path}", proxy.url()),
            full("{}"),
        ))
        .await;
        assert_eq!(status, 502, "{path}");
        assert_eq!(headers["content-type"], "application/json");
        let v = assert_openai_error(&body, "upstream_unreachable");
        assert_eq!(v["error"]["type"], "upstream_error");
    }
    tokio::time::sleep(Duration::from_millis(50)).await;
    let text = proxy.state.metrics.render(0, 0);
    assert!(
        text.contains("compactor_proxy_errors_total{code=\"upstream_unreachable\"} 2"),
        "{text}"
    );
    assert!(
        text.contains("compactor_requests_total{route=\"chat\",status=\"502\"} 1"),
        "{text}"
    );
}

#[tokio::test]
async fn slow_upstream_is_504() {
    let up = MockUpstream::builder()
        .route("/v1/chat/completions", Reply::Hang)
        .run()
        .await;
    let proxy = start_proxy(&up.url(), "[timeouts]\nfirst_byte_secs = 1\n").await;
    let (status, _, body) = fetch(request(
        "POST",
        &format!("{}/v1/chat/completions", proxy.url()),
        full("{}"),
    ))
    .await;
    assert_eq!(status, 504);
    assert_openai_error(&body, "upstream_timeout");
    assert_eq!(up.requests().len(), 1, "request reached the upstream");
    // The abandoned upstream request was dropped.
    assert!(
        up.wait_for(Duration::from_secs(10), |u| u.closed_connections() == 1)
            .await
    );
}

/// Timeouts past what a clock instant can hold (`u64::MAX` seconds, an
/// operator's "never") are deadlines 30 years on: adding one to the clock
/// panicked the task that armed it — the first-byte timeout on the chat
/// path (the hold-back) and on the passthrough path (the attempt), the
/// upstream's idle timeout between a body's frames, the client's idle
/// timeout between a connection's requests, the request body's read
/// deadline.
#[tokio::test]
async fn a_timeout_past_the_clocks_range_is_no_timeout() {
    let reply = || Reply::Full {
        status: 200,
        headers: vec![("content-type", "application/json".into())],
        body: Bytes::from_static(br#"{"choices":[],"usage":{"prompt_tokens":3}}"#),
    };
    let up = MockUpstream::builder()
        .route("/v1/chat/completions", reply())
        .route("/v1/models", reply())
        // A body that makes the proxy wait between frames: the idle timer
        // is armed.
        .route(
            "/v1/slow",
            Reply::Chunks {
                status: 200,
                headers: vec![],
                chunks: vec![
                    (Duration::ZERO, Bytes::from_static(b"one ")),
                    (Duration::from_millis(50), Bytes::from_static(b"two")),
                ],
            },
        )
        .run()
        .await;
    let never = u64::MAX;
    let proxy = start_proxy(
        &up.url(),
        &format!(
            "[timeouts]\nfirst_byte_secs = {never}\nidle_secs = {never}\nclient_idle_secs = {never}\nbody_read_secs = {never}\n"
        ),
    )
    .await;
    let chat = r#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#;
    let (status, _, body) = fetch(request(
        "POST",
        &format!("{}/v1/chat/completions", proxy.url()),
        full(chat),
    ))
    .await;
    assert_eq!(status, 200, "{body:?}");
    let (status, _, _) = fetch(request(
        "GET",
        &format!("{}/v1/models", proxy.url()),
        full(""),
    ))
    .await;
    assert_eq!(status, 200);
    let (status, _, body) = get(&format!("{}/v1/slow", proxy.url())).await;
    assert_eq!(
        (status, &body[..]),
        (hyper::StatusCode::OK, &b"one two"[..])
    );
    // The client's idle timer is armed between a connection's requests:
    // a second request on the same connection is answered.
    let addr = proxy.url().trim_start_matches("http://").to_owned();
    let mut conn = tokio::net::TcpStream::connect(addr).await.unwrap();
    for _ in 0..2 {
        conn.write_all(b"GET /v1/models HTTP/1.1\r\nhost: x\r\n\r\n")
            .await
            .unwrap();
        let head = read_response(&mut conn).await;
        assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    }
}

#[tokio::test]
async fn declared_oversize_body_is_413_without_contacting_upstream() {
    let up = MockUpstream::builder()
        .route("/v1/chat/completions", Reply::BodyDigest)
        .run()
        .await;
    let proxy = start_proxy(&up.url(), "max_body_bytes = 1000\n").await;
    let ok = fetch(request(
        "POST",
        &format!("{}/v1/chat/completions", proxy.url()),
        full(vec![b'a'; 1000]),
    ))
    .await;
    assert_eq!(ok.0, 200, "exactly the limit is allowed");
    let (status, _, body) = fetch(request(
        "POST",
        &format!("{}/v1/chat/completions", proxy.url()),
        full(vec![b'a'; 1001]),
    ))
    .await;
    assert_eq!(status, 413);
    let v = assert_openai_error(&body, "request_too_large");
    assert_eq!(v["error"]["type"], "invalid_request_error");
    assert_eq!(up.requests().len(), 1, "oversize request was forwarded");
}

#[tokio::test]
async fn streamed_oversize_body_is_413() {
    let up = MockUpstream::builder()
        .route("/upload", Reply::BodyDigest)
        .run()
        .await;
    let proxy = start_proxy(&up.url(), "max_body_bytes = 10000\n").await;
    let (tx, body) = channel_request_body();
    let req = request("POST", &format!("{}/upload", proxy.url()), body);
    let pending = tokio::spawn(async move { fetch(req).await });
    // No Content-Length: the limit can only be enforced while streaming.
    for _ in 0..5 {
        if tx
            .send(Ok(Frame::data(Bytes::from(vec![b'x'; 4000]))))
            .await
            .is_err()
        {
            break;
        }
    }
    drop(tx);
    let (status, _, body) = tokio::time::timeout(Duration::from_secs(10), pending)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(status, 413);
    assert_openai_error(&body, "request_too_large");
    // The upstream never received a complete over-limit body.
    assert!(up.requests().iter().all(|r| r.body_len <= 10_000));
}

#[tokio::test]
async fn connect_timeout_is_504() {
    // A listener that never accepts, with its accept queue filled: Linux
    // drops further SYNs, so a new connect hangs until compactor gives up.
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let listener = socket.listen(1).unwrap();
    let addr = listener.local_addr().unwrap();
    let mut fillers = Vec::new();
    for _ in 0..8 {
        match tokio::time::timeout(
            Duration::from_millis(200),
            tokio::net::TcpStream::connect(addr),
        )
        .await
        {
            Ok(Ok(s)) => fillers.push(s),
            _ => break, // queue full: connects now hang
        }
    }
    let proxy = start_proxy(&format!("http://{addr}"), "[timeouts]\nconnect_secs = 1\n").await;
    let (status, _, body) = tokio::time::timeout(
        Duration::from_secs(20),
        fetch(request(
            "GET",
            &format!("{}/v1/models", proxy.url()),
            empty(),
        )),
    )
    .await
    .expect("connect timeout not applied");
    assert_eq!(status, 504, "{}", String::from_utf8_lossy(&body));
    assert_openai_error(&body, "upstream_connect_timeout");
    drop(listener);
}
