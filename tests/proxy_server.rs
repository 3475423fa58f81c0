//! compactor's own HTTP/1.1 server (`server::h1`) in the running proxy:
//! the requests it serves and the ones it hands to hyper's server, on one
//! connection, answered as before. The framing rules themselves are held
//! to hyper's byte for byte in `server::h1::tests`.

// Test code: a failed setup step should panic the test.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::time::Duration;

use http_body_util::{BodyExt, Full};
use serde_json::json;
use support::chat::*;
use support::start_proxy;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const BOUND: Duration = Duration::from_secs(15);

/// Reads from `s` until `done` holds for what arrived (or EOF, or `BOUND`).
async fn read_until(s: &mut TcpStream, done: impl Fn(&str) -> bool) -> String {
    let mut out = Vec::new();
    let _ = tokio::time::timeout(BOUND, async {
        let mut chunk = [0u8; 8192];
        while !done(&String::from_utf8_lossy(&out)) {
            match s.read(&mut chunk).await {
                Ok(0) | Err(_) => break,
                Ok(n) => out.extend_from_slice(&chunk[..n]),
            }
        }
    })
    .await;
    String::from_utf8_lossy(&out).into_owned()
}

#[tokio::test]
async fn one_connection_served_here_then_by_hyper_answers_every_request() {
    let mock = ChatMock::start(Settings::default()).await;
    let proxy = start_proxy(&mock.url(), "").await;
    let mut s = TcpStream::connect(proxy.addr).await.unwrap();
    let body = chat_body("m", &[json!({"role": "user", "content": "hi"})], false);

    // Served here: a Content-Length chat request, then a health check.
    let mut first = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
        body.len()
    )
    .into_bytes();
    first.extend_from_slice(&body);
    first.extend_from_slice(b"GET /_compactor/health HTTP/1.1\r\nhost: x\r\n\r\n");
    s.write_all(&first).await.unwrap();
    let text = read_until(&mut s, |t| t.contains("{\"status\":\"ok\"}")).await;
    assert!(text.starts_with("HTTP/1.1 200 OK\r\n"), "{text}");
    assert_eq!(text.matches("HTTP/1.1 200 OK").count(), 2, "{text}");
    assert!(text.contains("\"choices\""), "{text}");
    assert_eq!(mock.chats().len(), 1);

    // A chunked upload is hyper's: the same chat, chunked, on the same
    // connection, then one more request hyper serves after it.
    let mut chunked = b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n".to_vec();
    chunked.extend_from_slice(format!("{:x}\r\n", body.len()).as_bytes());
    chunked.extend_from_slice(&body);
    chunked.extend_from_slice(b"\r\n0\r\n\r\nGET /_compactor/health HTTP/1.1\r\nhost: x\r\n\r\n");
    s.write_all(&chunked).await.unwrap();
    let text = read_until(&mut s, |t| t.contains("{\"status\":\"ok\"}")).await;
    assert_eq!(text.matches("HTTP/1.1 200 OK").count(), 2, "{text}");
    assert!(text.contains("\"choices\""), "{text}");
    assert_eq!(mock.chats().len(), 2);
    let chats = mock.chats();
    assert_eq!(
        chats[0].json(),
        chats[1].json(),
        "the same request upstream"
    );
}

#[tokio::test]
async fn a_malformed_request_gets_hypers_400() {
    let proxy = start_proxy("http://127.0.0.1:9", "").await;
    let mut s = TcpStream::connect(proxy.addr).await.unwrap();
    s.write_all(b"GET /_compactor/health HTTP/1.1\r\nhost: x\r\n\r\nGET / HTTP/1.1\r\nno colon here\r\n\r\n")
        .await
        .unwrap();
    let text = read_until(&mut s, |t| t.contains("400 Bad Request")).await;
    assert!(text.starts_with("HTTP/1.1 200 OK\r\n"), "{text}");
    assert!(text.contains("HTTP/1.1 400 Bad Request\r\n"), "{text}");
}

#[tokio::test]
async fn a_request_whose_body_trickles_in_is_answered() {
    let mock = ChatMock::start(Settings::default()).await;
    let proxy = start_proxy(&mock.url(), "").await;
    let body = chat_body("m", &[json!({"role": "user", "content": "hello"})], false);
    for pause_ms in [20, 400] {
        let mut s = TcpStream::connect(proxy.addr).await.unwrap();
        let head = format!(
            "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: {}\r\n\r\n",
            body.len()
        );
        s.write_all(head.as_bytes()).await.unwrap();
        s.write_all(&body[..10]).await.unwrap();
        // Within the wait the message is read whole here; past it, hyper
        // reads the rest.
        tokio::time::sleep(Duration::from_millis(pause_ms)).await;
        s.write_all(&body[10..]).await.unwrap();
        let text = read_until(&mut s, |t| t.contains("\"choices\"")).await;
        assert!(
            text.starts_with("HTTP/1.1 200 OK\r\n"),
            "{pause_ms} ms: {text}"
        );
    }
    assert_eq!(mock.chats().len(), 2);
}

#[tokio::test]
async fn http2_with_prior_knowledge_is_served_by_hyper() {
    let proxy = start_proxy("http://127.0.0.1:9", "").await;
    let stream = TcpStream::connect(proxy.addr).await.unwrap();
    let (mut send, conn) = hyper::client::conn::http2::handshake(
        hyper_util::rt::TokioExecutor::new(),
        hyper_util::rt::TokioIo::new(stream),
    )
    .await
    .unwrap();
    tokio::spawn(conn);
    let req = http::Request::get(format!("http://{}/_compactor/health", proxy.addr))
        .body(Full::new(bytes::Bytes::new()))
        .unwrap();
    let resp = tokio::time::timeout(BOUND, send.send_request(req))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.version(), http::Version::HTTP_2);
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(&body[..], b"{\"status\":\"ok\"}");
}
