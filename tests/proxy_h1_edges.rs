//! HTTP/1 framing at the edges, both directions (issue 49): what an
//! upstream's odd framing does to the client's copy and to the pool, and
//! which requests are refused or cleaned before they go upstream. Each
//! test names the behaviour it replaced.

// Test code: a failed unwrap is a failed test. clippy.toml allows that in
// #[test] functions only, not in the helpers they share.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use support::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// An upstream that answers every request, on every connection, with the
/// same bytes, and leaves the connection open after it: whether the proxy
/// uses it again is the proxy's call. Counts the connections it accepted.
struct RawUpstream {
    addr: SocketAddr,
    connections: Arc<AtomicUsize>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for RawUpstream {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl RawUpstream {
    async fn start(response: Vec<u8>) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let connections = Arc::new(AtomicUsize::new(0));
        let count = Arc::clone(&connections);
        let response = Bytes::from(response);
        let task = tokio::spawn(async move {
            loop {
                let Ok((mut sock, _)) = listener.accept().await else {
                    return;
                };
                count.fetch_add(1, Ordering::SeqCst);
                let response = response.clone();
                tokio::spawn(async move {
                    let mut buf = Vec::new();
                    while skip_request(&mut sock, &mut buf).await {
                        if sock.write_all(&response).await.is_err() {
                            return;
                        }
                    }
                });
            }
        });
        RawUpstream {
            addr,
            connections,
            task,
        }
    }

    fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    fn connections(&self) -> usize {
        self.connections.load(Ordering::SeqCst)
    }
}

/// Reads one request (its head, and a body by its Content-Length) off
/// `sock`; false at the connection's end.
async fn skip_request(sock: &mut TcpStream, buf: &mut Vec<u8>) -> bool {
    let mut chunk = [0u8; 4096];
    loop {
        if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&buf[..end]).to_ascii_lowercase();
            let length: usize = head
                .lines()
                .find_map(|l| l.strip_prefix("content-length:"))
                .map_or(0, |v| v.trim().parse().unwrap());
            if buf.len() >= end + 4 + length {
                buf.drain(..end + 4 + length);
                return true;
            }
        }
        match sock.read(&mut chunk).await {
            Ok(0) | Err(_) => return false,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
        }
    }
}

/// One response off `conn`: its head (text) and its body, by its
/// Content-Length, else chunked, else to the close.
async fn read_one(conn: &mut TcpStream) -> (String, Vec<u8>) {
    let mut buf = Vec::new();
    let end = loop {
        if let Some(at) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break at + 4;
        }
        assert!(fill(conn, &mut buf).await > 0, "closed before a head");
    };
    let head = String::from_utf8_lossy(&buf[..end]).into_owned();
    let lower = head.to_ascii_lowercase();
    let field = |name: &str| {
        lower
            .lines()
            .find_map(|l| l.strip_prefix(name).map(|v| v.trim().to_owned()))
    };
    let mut body = buf.split_off(end);
    if let Some(n) = field("content-length:") {
        let n: usize = n.parse().unwrap();
        while body.len() < n {
            assert!(fill(conn, &mut body).await > 0, "closed inside a body");
        }
        body.truncate(n);
    } else if field("transfer-encoding:").is_some() {
        while !body.ends_with(b"0\r\n\r\n") {
            assert!(fill(conn, &mut body).await > 0, "closed inside chunks");
        }
        body = dechunk(&body);
    } else {
        while fill(conn, &mut body).await > 0 {}
    }
    (head, body)
}

/// Appends what `conn` has next to `buf`: how much (0 at its end).
async fn fill(conn: &mut TcpStream, buf: &mut Vec<u8>) -> usize {
    let mut chunk = [0u8; 4096];
    let n = tokio::time::timeout(Duration::from_secs(10), conn.read(&mut chunk))
        .await
        .expect("a response within 10 s")
        .unwrap();
    buf.extend_from_slice(&chunk[..n]);
    n
}

fn dechunk(mut wire: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    loop {
        let eol = wire.windows(2).position(|w| w == b"\r\n").unwrap();
        let size = usize::from_str_radix(std::str::from_utf8(&wire[..eol]).unwrap(), 16).unwrap();
        if size == 0 {
            return out;
        }
        out.extend_from_slice(&wire[eol + 2..eol + 2 + size]);
        wire = &wire[eol + 2 + size + 2..];
    }
}

async fn connect(proxy: &compactor::server::RunningServer) -> TcpStream {
    TcpStream::connect(proxy.addr).await.unwrap()
}

/// Sends `request` on a new connection and reads one response.
async fn exchange(proxy: &compactor::server::RunningServer, request: &[u8]) -> (String, Vec<u8>) {
    let mut conn = connect(proxy).await;
    conn.write_all(request).await.unwrap();
    read_one(&mut conn).await
}

fn error_code(body: &[u8]) -> String {
    let v: serde_json::Value = serde_json::from_slice(body).unwrap();
    assert!(
        v["error"]["message"]
            .as_str()
            .is_some_and(|m| !m.is_empty()),
        "{v}"
    );
    v["error"]["code"].as_str().unwrap().to_owned()
}

/// Defect 1: a Content-Length next to a Transfer-Encoding was forwarded
/// and the client's copy framed by it (CL 10, a 270-byte body: 10 bytes,
/// then a close). Now the length is dropped: the whole body, chunked.
#[tokio::test]
async fn a_length_next_to_a_transfer_encoding_does_not_frame_the_client_copy() {
    let body = "y".repeat(270);
    for te in ["chunked", "gzip, chunked"] {
        let up = RawUpstream::start(
            format!(
                "HTTP/1.1 200 OK\r\ncontent-length: 10\r\ntransfer-encoding: {te}\r\n\r\n{:x}\r\n{body}\r\n0\r\n\r\n",
                body.len()
            )
            .into_bytes(),
        )
        .await;
        let proxy = start_proxy(&up.url(), "").await;
        let (status, headers, got) = get(&format!("{}/v1/models", proxy.url())).await;
        assert_eq!(status, 200, "{te}");
        assert!(headers.get("content-length").is_none(), "{te}: {headers:?}");
        assert_eq!(got, body.as_bytes(), "{te}");
        // On the fast path too, read off the wire.
        let (head, got) = exchange(&proxy, b"GET /v1/models HTTP/1.1\r\nhost: x\r\n\r\n").await;
        assert!(head.starts_with("HTTP/1.1 200"), "{head}");
        assert!(
            !head.to_ascii_lowercase().contains("content-length"),
            "{head}"
        );
        assert_eq!(got, body.as_bytes(), "{te}");
    }
}

/// Defect 2: `Connection: close, keep-alive` kept the upstream connection
/// pooled (the later token undid `close`). Every request now opens its own.
#[tokio::test]
async fn an_upstream_close_is_not_undone_by_a_later_keep_alive() {
    for connection in [
        "connection: close, keep-alive\r\n",
        "connection: close\r\nconnection: keep-alive\r\n",
    ] {
        let up = RawUpstream::start(
            format!("HTTP/1.1 200 OK\r\n{connection}content-length: 2\r\n\r\nok").into_bytes(),
        )
        .await;
        let proxy = start_proxy(&up.url(), "").await;
        for _ in 0..3 {
            let (status, _, body) = get(&format!("{}/v1/models", proxy.url())).await;
            assert_eq!(status, 200);
            assert_eq!(body, "ok");
        }
        assert_eq!(up.connections(), 3, "{connection:?}");
    }
}

/// Defect 3: an HTTP/1.0 response with a Transfer-Encoding was framed by
/// its Content-Length (the chunk lines went to the client as body) and the
/// connection reused. Now it is faulty framing: a 502 in the OpenAI shape,
/// and the next request gets a new connection.
#[tokio::test]
async fn a_transfer_encoding_in_an_http10_response_is_a_502() {
    let up = RawUpstream::start(
        b"HTTP/1.0 200 OK\r\ntransfer-encoding: chunked\r\ncontent-length: 10\r\nconnection: keep-alive\r\n\r\n1\r\nx\r\n0\r\n\r\n"
            .to_vec(),
    )
    .await;
    let proxy = start_proxy(&up.url(), "").await;
    for _ in 0..2 {
        let (status, headers, body) = get(&format!("{}/v1/models", proxy.url())).await;
        assert_eq!(status, 502);
        assert_eq!(headers["content-type"], "application/json");
        assert_eq!(error_code(&body), "upstream_unreachable");
    }
    // The first connection was dropped, and a refused one is not retried
    // on another (a retry is for a connection closed before any answer).
    assert_eq!(up.connections(), 2);
}

/// Defect 6 (Content-Length): a zero-padded 20-digit length was a 400 on
/// passthrough and a 200 on chat; both routes now read it as hyper does
/// (1*DIGIT that fits a u64), on the fast path and on hyper's.
#[tokio::test]
async fn a_zero_padded_length_is_read_alike_on_every_route() {
    let up = MockUpstream::builder()
        .route("/echo", Reply::BodyDigest)
        .route(
            "/v1/chat/completions",
            Reply::Full {
                status: 200,
                headers: vec![("content-type", "application/json".into())],
                body: Bytes::from_static(
                    br#"{"id":"c","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":"hi"},"finish_reason":"stop"}]}"#,
                ),
            },
        )
        .run()
        .await;
    let proxy = start_proxy(&up.url(), "").await;
    let chat = br#"{"model":"m","messages":[{"role":"user","content":"hello there"}]}"#;
    for path in ["/echo", "/v1/chat/completions"] {
        // The fast path, and hyper's (a Connection: close is handed to it).
        for close in ["", "connection: close\r\n"] {
            let mut request = format!(
                "POST {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n{close}content-length: {:020}\r\n\r\n",
                chat.len()
            )
            .into_bytes();
            request.extend_from_slice(chat);
            let (head, body) = exchange(&proxy, &request).await;
            assert!(
                head.starts_with("HTTP/1.1 200"),
                "{path} {close:?}: {head}{}",
                String::from_utf8_lossy(&body)
            );
            let seen = up.last_request();
            assert_eq!(seen.body, &chat[..], "{path} {close:?}");
        }
    }
}

/// An upstream that records what reaches it, for the refusals below.
async fn recording_upstream() -> MockUpstream {
    MockUpstream::builder()
        .route("/echo", Reply::BodyDigest)
        .route("/", Reply::BodyDigest)
        .route("/*", Reply::BodyDigest)
        .run()
        .await
}

/// A 400 in the OpenAI shape that ends its connection.
fn assert_bad_request(what: &str, head: &str, body: &[u8]) {
    assert!(head.starts_with("HTTP/1."), "{what}: {head}");
    assert!(head[9..].starts_with("400"), "{what}: {head}");
    assert!(
        head.to_ascii_lowercase().contains("connection: close"),
        "{what}: {head}"
    );
    assert_eq!(error_code(body), "bad_request", "{what}");
}

/// Defect 5: `CONNECT host:443` went upstream as `CONNECT /` and the
/// client got no answer; `OPTIONS *` and `GET *` went out as `/*`. Now a
/// 400, and nothing reaches the upstream.
#[tokio::test]
async fn connect_and_asterisk_targets_are_400() {
    let up = recording_upstream().await;
    let proxy = start_proxy(&up.url(), "").await;
    for request in [
        "CONNECT api.openai.com:443 HTTP/1.1\r\nhost: api.openai.com:443\r\n\r\n",
        "OPTIONS * HTTP/1.1\r\nhost: x\r\n\r\n",
        "GET * HTTP/1.1\r\nhost: x\r\n\r\n",
        "POST * HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n\r\n{}",
        // hyper's path (a Connection: close is handed to it).
        "OPTIONS * HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n",
        "CONNECT api.openai.com:443 HTTP/1.0\r\n\r\n",
    ] {
        let (head, body) = exchange(&proxy, request.as_bytes()).await;
        assert_bad_request(request, &head, &body);
    }
    assert!(up.requests().is_empty(), "{:?}", up.requests());
}

/// Defect 6 (Host): an HTTP/1.1 request with no Host, two, or one with a
/// space in it was forwarded. RFC 9112 §3.2: 400, on both server paths.
/// HTTP/1.0 needs no Host, and a good one is served as before.
#[tokio::test]
async fn an_http11_request_needs_one_valid_host() {
    let up = recording_upstream().await;
    let proxy = start_proxy(&up.url(), "").await;
    for close in ["", "connection: close\r\n"] {
        for hosts in [
            "",
            "host: a\r\nhost: a\r\n",
            "host: a\r\nhost: b\r\n",
            "host: a b\r\n",
            "host: a/b\r\n",
        ] {
            let request = format!("GET /echo HTTP/1.1\r\n{hosts}{close}\r\n");
            let (head, body) = exchange(&proxy, request.as_bytes()).await;
            assert_bad_request(&request, &head, &body);
        }
    }
    assert!(up.requests().is_empty(), "{:?}", up.requests());
    for request in [
        "GET /echo HTTP/1.1\r\nhost: localhost:8080\r\n\r\n",
        "GET /echo HTTP/1.1\r\nhost: [::1]:8080\r\nconnection: close\r\n\r\n",
        "GET /echo HTTP/1.0\r\n\r\n",
    ] {
        let (head, _) = exchange(&proxy, request.as_bytes()).await;
        assert!(head.starts_with("HTTP/1."), "{request}: {head}");
        assert!(head[9..].starts_with("200"), "{request}: {head}");
    }
    assert_eq!(up.requests().len(), 3);
}

/// Defect 4: `Transfer_Encoding: chunked` and `Content_Length: 92` were
/// forwarded next to the framing compactor wrote (an upstream that reads
/// `_` as `-` would frame the body twice). Dropped by default on both
/// server paths, as nginx does; `[server] underscores_in_headers = true`
/// keeps them.
#[tokio::test]
async fn header_names_with_underscores_are_dropped_unless_configured() {
    let up = recording_upstream().await;
    for (toml, kept) in [
        ("", false),
        ("[server]\nunderscores_in_headers = true\n", true),
    ] {
        let proxy = start_proxy(&up.url(), toml).await;
        for close in ["", "connection: close\r\n"] {
            let request = format!(
                "POST /echo HTTP/1.1\r\nhost: x\r\n{close}Transfer_Encoding: chunked\r\nContent_Length: 92\r\nx-fine: 1\r\ncontent-length: 5\r\n\r\nhello"
            );
            let (head, _) = exchange(&proxy, request.as_bytes()).await;
            assert!(head.starts_with("HTTP/1.1 200"), "{head}");
            let seen = up.last_request();
            assert_eq!(seen.body, "hello");
            assert_eq!(seen.headers["x-fine"], "1");
            assert_eq!(seen.headers["content-length"], "5");
            for name in ["transfer_encoding", "content_length"] {
                assert_eq!(
                    seen.headers.contains_key(name),
                    kept,
                    "{name} {toml:?} {close:?}"
                );
            }
        }
    }
}

/// The fast path's handoffs to hyper are counted by reason: a chunked
/// upload counts under `transfer_encoding`, a served request under none.
#[tokio::test]
async fn a_chunked_request_counts_as_a_transfer_encoding_handoff() {
    let up = recording_upstream().await;
    let proxy = start_proxy(&up.url(), "").await;
    let count = |reason: &str| {
        let text = proxy.state.metrics.render(0, 0);
        let series = format!("compactor_h1_handoffs_total{{reason=\"{reason}\"}} ");
        text.lines()
            .find_map(|l| l.strip_prefix(series.as_str()))
            .unwrap_or_else(|| panic!("no {series} in\n{text}"))
            .parse::<u64>()
            .unwrap()
    };
    assert_eq!(count("transfer_encoding"), 0);
    let (head, _) = exchange(&proxy, b"GET /echo HTTP/1.1\r\nhost: x\r\n\r\n").await;
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    let (head, _) = exchange(
        &proxy,
        b"POST /echo HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
    )
    .await;
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    assert_eq!(up.last_request().body, "hello");
    assert_eq!(count("transfer_encoding"), 1);
    let total: u64 = [
        "http10",
        "expect",
        "upgrade",
        "connect",
        "connection_close",
        "h2",
        "malformed",
        "oversized",
        "slow",
    ]
    .into_iter()
    .map(count)
    .sum();
    assert_eq!(total, 0);
}
