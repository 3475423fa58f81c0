//! Transparent forwarding: bodies, statuses and headers identical to going
//! direct; hop-by-hop headers removed; URI joining; Host policy.

// Test code: a failed unwrap is a failed test. clippy.toml allows that in
// #[test] functions only, not in the helpers they share.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::time::Duration;

use bytes::Bytes;
use support::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const SSE: &str = "data: {\"id\":\"c1\",\"choices\":[{\"delta\":{\"content\":\"Hel\"}}]}\n\n\
data: {\"id\":\"c1\",\"choices\":[{\"delta\":{\"content\":\"lo\"}}]}\r\n\r\n\
: keep-alive comment\n\n\
data: [DONE]\n\n";

fn binary() -> Bytes {
    Bytes::from((0..=255u8).cycle().take(70_000).collect::<Vec<u8>>())
}

// The route table of the scripted upstream: one entry per case the tests use.
#[allow(clippy::too_many_lines)]
async fn upstream() -> MockUpstream {
    MockUpstream::builder()
        .route(
            "/v1/models",
            Reply::Full {
                status: 200,
                headers: vec![("content-type", "application/json".into())],
                body: Bytes::from_static(br#"{"object":"list","data":[{"id":"m","x":0.70}]}"#),
            },
        )
        .route(
            "/v1/chat/completions",
            Reply::Chunks {
                status: 200,
                headers: vec![
                    ("content-type", "text/event-stream".into()),
                    ("cache-control", "no-cache".into()),
                ],
                chunks: SSE
                    .as_bytes()
                    .chunks(17)
                    .map(|c| (Duration::ZERO, Bytes::copy_from_slice(c)))
                    .collect(),
            },
        )
        .route(
            "/bin",
            Reply::Full {
                status: 200,
                headers: vec![("content-type", "application/octet-stream".into())],
                body: binary(),
            },
        )
        .route(
            "/missing",
            Reply::Full {
                status: 404,
                headers: vec![("content-type", "application/json".into())],
                body: Bytes::from_static(br#"{"error":{"message":"no such model","code":"model_not_found"}}"#),
            },
        )
        .route(
            "/teapot",
            Reply::Full {
                status: 418,
                headers: vec![("x-reason", "short and stout".into())],
                body: Bytes::from_static(b"I'm a teapot"),
            },
        )
        .route(
            "/overflow",
            Reply::Full {
                status: 400,
                headers: vec![("content-type", "application/json".into())],
                body: Bytes::from_static(br#"{"error":{"code":400,"message":"the request exceeds the available context size","type":"exceed_context_size_error","n_ctx":4096}}"#),
            },
        )
        .route(
            "/busy",
            Reply::Chunks {
                status: 503,
                headers: vec![("retry-after", "3".into())],
                chunks: vec![(Duration::ZERO, Bytes::from_static(b"over")), (Duration::from_millis(5), Bytes::from_static(b"loaded"))],
            },
        )
        .route(
            "/multi",
            Reply::Full {
                status: 200,
                headers: vec![
                    ("set-cookie", "a=1; Path=/".into()),
                    ("set-cookie", "b=2; Path=/".into()),
                    ("x-multi", "one".into()),
                    ("x-multi", "two".into()),
                    ("x-ratelimit-remaining-requests", "99".into()),
                ],
                body: Bytes::from_static(b"ok"),
            },
        )
        .route(
            "/hop",
            Reply::Full {
                status: 200,
                headers: vec![
                    ("connection", "x-upstream-private, keep-alive".into()),
                    ("x-upstream-private", "secret".into()),
                    ("keep-alive", "timeout=5".into()),
                    ("proxy-authenticate", "Basic realm=x".into()),
                    ("proxy-connection", "keep-alive".into()),
                    ("trailer", "x-checksum".into()),
                    ("x-end-to-end", "kept".into()),
                ],
                body: Bytes::from_static(b"hop"),
            },
        )
        .route("/echo", Reply::BodyDigest)
        .run()
        .await
}

/// Every scripted reply is identical (status, headers except Date, body
/// bytes) through compactor and direct.
#[tokio::test]
async fn responses_identical_to_direct() {
    let up = upstream().await;
    let proxy = start_proxy(&up.url(), "").await;
    let cases = [
        ("GET", "/v1/models"),
        ("POST", "/v1/chat/completions"),
        ("GET", "/bin"),
        ("GET", "/missing"),
        ("GET", "/teapot"),
        ("POST", "/overflow"),
        ("GET", "/busy"),
        ("GET", "/multi"),
        ("GET", "/nowhere"),
    ];
    for (method, path) in cases {
        let direct = fetch(request(method, &format!("{}{path}", up.url()), empty())).await;
        let via = fetch(request(method, &format!("{}{path}", proxy.url()), empty())).await;
        assert_eq!(via.0, direct.0, "status of {path}");
        assert_eq!(via.2, direct.2, "body of {path}");
        assert_eq!(
            comparable_headers(&via.1),
            comparable_headers(&direct.1),
            "headers of {path}"
        );
    }
    // Sanity: the cases really differ from each other.
    let sse = fetch(request(
        "POST",
        &format!("{}/v1/chat/completions", proxy.url()),
        empty(),
    ))
    .await;
    assert_eq!(sse.2, Bytes::from_static(SSE.as_bytes()));
    assert_eq!(sse.1["transfer-encoding"], "chunked");
    let bin = get(&format!("{}/bin", proxy.url())).await;
    assert_eq!(bin.2, binary());
    assert_eq!(bin.1["content-length"], "70000");
}

#[tokio::test]
async fn multi_valued_headers_preserved_both_ways() {
    let up = upstream().await;
    let proxy = start_proxy(&up.url(), "").await;
    let mut req = request("GET", &format!("{}/multi", proxy.url()), empty());
    let h = req.headers_mut();
    h.append("x-client-multi", "a".parse().unwrap());
    h.append("x-client-multi", "b".parse().unwrap());
    h.insert("authorization", "Bearer sk-test".parse().unwrap());
    h.insert("x-session-id", "s1".parse().unwrap());
    let (status, headers, _) = fetch(req).await;
    assert_eq!(status, 200);
    let cookies: Vec<_> = headers.get_all("set-cookie").iter().collect();
    assert_eq!(cookies, vec!["a=1; Path=/", "b=2; Path=/"]);
    let multi: Vec<_> = headers.get_all("x-multi").iter().collect();
    assert_eq!(multi, vec!["one", "two"]);
    assert_eq!(headers["x-ratelimit-remaining-requests"], "99");

    let seen = up.last_request();
    let multi: Vec<_> = seen.headers.get_all("x-client-multi").iter().collect();
    assert_eq!(multi, vec!["a", "b"]);
    assert_eq!(seen.headers["authorization"], "Bearer sk-test");
    assert_eq!(seen.headers["x-session-id"], "s1");
}

#[tokio::test]
async fn hop_by_hop_removed_from_response() {
    let up = upstream().await;
    let proxy = start_proxy(&up.url(), "").await;
    // Direct, the upstream really sends them (so the test can fail).
    let (_, direct, _) = get(&format!("{}/hop", up.url())).await;
    assert!(direct.contains_key("x-upstream-private"));
    assert!(direct.contains_key("proxy-authenticate"));

    let (status, headers, body) = get(&format!("{}/hop", proxy.url())).await;
    assert_eq!(status, 200);
    assert_eq!(body, "hop");
    for name in [
        "x-upstream-private",
        "keep-alive",
        "proxy-authenticate",
        "proxy-connection",
        "trailer",
    ] {
        assert!(!headers.contains_key(name), "{name} leaked to client");
    }
    assert!(
        headers
            .get_all("connection")
            .iter()
            .all(|v| !v.to_str().unwrap().contains("x-upstream-private")),
        "upstream Connection leaked"
    );
    assert_eq!(headers["x-end-to-end"], "kept");
}

/// Raw HTTP/1.1 so the test controls every request header.
async fn raw_request(addr: std::net::SocketAddr, head: &str, body: &[u8]) -> String {
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    s.write_all(head.as_bytes()).await.unwrap();
    s.write_all(body).await.unwrap();
    let mut out = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut out))
        .await
        .unwrap()
        .unwrap();
    String::from_utf8_lossy(&out).into_owned()
}

#[tokio::test]
async fn hop_by_hop_removed_from_request_and_host_set() {
    let up = upstream().await;
    let proxy = start_proxy(&up.url(), "").await;
    let head = "POST /echo HTTP/1.1\r\n\
Host: client-chosen.example\r\n\
Connection: close, x-client-private\r\n\
X-Client-Private: secret\r\n\
Keep-Alive: timeout=9\r\n\
TE: trailers\r\n\
Proxy-Authorization: Basic Zm9vOmJhcg==\r\n\
Proxy-Connection: keep-alive\r\n\
Upgrade: websocket\r\n\
X-End-To-End: yes\r\n\
Content-Length: 5\r\n\r\n";
    let resp = raw_request(proxy.addr, head, b"hello").await;
    assert!(resp.starts_with("HTTP/1.1 200"), "{resp}");
    let seen = up.last_request();
    for name in [
        "x-client-private",
        "keep-alive",
        "te",
        "proxy-authorization",
        "proxy-connection",
        "upgrade",
    ] {
        assert!(!seen.headers.contains_key(name), "{name} reached upstream");
    }
    assert!(!seen
        .headers
        .get_all("connection")
        .iter()
        .any(|v| v.to_str().unwrap().contains("x-client-private")));
    assert_eq!(seen.headers["x-end-to-end"], "yes");
    assert_eq!(seen.headers["host"], up.addr.to_string());
    assert_eq!(seen.body, "hello");
}

#[tokio::test]
async fn absolute_form_uri_cannot_choose_upstream() {
    let up = upstream().await;
    let proxy = start_proxy(&up.url(), "").await;
    let head = "GET http://169.254.169.254/v1/models?probe=1 HTTP/1.1\r\n\
Host: 169.254.169.254\r\nConnection: close\r\n\r\n";
    let resp = raw_request(proxy.addr, head, b"").await;
    assert!(resp.starts_with("HTTP/1.1 200"), "{resp}");
    assert!(resp.contains("\"object\":\"list\""));
    let seen = up.last_request();
    assert_eq!(seen.uri.path(), "/v1/models");
    assert_eq!(seen.uri.query(), Some("probe=1"));
    assert_eq!(seen.headers["host"], up.addr.to_string());
}

#[tokio::test]
async fn path_prefix_and_query_joined() {
    let up = MockUpstream::builder()
        .route("/api/v1/chat/completions", Reply::BodyDigest)
        .route("/api/v1/models", Reply::BodyDigest)
        .run()
        .await;
    let proxy = start_proxy(&format!("{}/api/", up.url()), "").await;
    let (status, _, _) = fetch(request(
        "POST",
        &format!("{}/v1/chat/completions", proxy.url()),
        full("{}"),
    ))
    .await;
    assert_eq!(status, 200);
    assert_eq!(up.last_request().uri.path(), "/api/v1/chat/completions");

    let q = "a=1&b=two%20words&c=%E2%9C%93&empty=&a=3";
    let (status, _, _) = get(&format!("{}/v1/models?{q}", proxy.url())).await;
    assert_eq!(status, 200);
    let seen = up.last_request();
    assert_eq!(seen.uri.path(), "/api/v1/models");
    assert_eq!(seen.uri.query(), Some(q));
}

#[tokio::test]
async fn methods_and_request_bodies_forwarded_verbatim() {
    let up = upstream().await;
    let proxy = start_proxy(&up.url(), "").await;
    let payload =
        Bytes::from_static(br#"{"model":"m","temperature":0.70,"n":18446744073709551616123}"#);
    for method in ["POST", "PUT", "PATCH", "DELETE"] {
        let mut req = request(
            method,
            &format!("{}/echo", proxy.url()),
            full(payload.clone()),
        );
        req.headers_mut()
            .insert("content-type", "application/json".parse().unwrap());
        let (status, _, body) = fetch(req).await;
        assert_eq!(status, 200, "{method}");
        let seen = up.last_request();
        assert_eq!(seen.method.as_str(), method);
        assert_eq!(seen.body, payload, "{method} body changed");
        assert_eq!(seen.headers["content-length"], payload.len().to_string());
        let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(v["len"], payload.len());
    }
}

#[tokio::test]
async fn health_and_metrics_are_local() {
    let up = upstream().await;
    let proxy = start_proxy(&up.url(), "").await;
    let (status, headers, body) = get(&format!("{}/_compactor/health", proxy.url())).await;
    assert_eq!(status, 200);
    assert_eq!(headers["content-type"], "application/json");
    assert_eq!(body, r#"{"status":"ok"}"#);

    let _ = get(&format!("{}/v1/models", proxy.url())).await;
    let _ = get(&format!("{}/missing", proxy.url())).await;
    // The log/metrics phase runs when the body ends; give it a moment.
    tokio::time::sleep(Duration::from_millis(50)).await;
    let (status, _, body) = get(&format!("{}/_compactor/metrics", proxy.url())).await;
    assert_eq!(status, 200);
    let text = String::from_utf8(body.to_vec()).unwrap();
    assert!(
        text.contains("compactor_requests_total{route=\"passthrough\",status=\"200\"} 1"),
        "{text}"
    );
    assert!(
        text.contains("compactor_requests_total{route=\"passthrough\",status=\"404\"} 1"),
        "{text}"
    );
    assert!(
        text.contains("compactor_requests_total{route=\"health\",status=\"200\"} 1"),
        "{text}"
    );
    assert!(
        text.contains("compactor_proxy_overhead_seconds_count 2"),
        "{text}"
    );
    // Neither ever reached the upstream.
    assert!(up
        .requests()
        .iter()
        .all(|r| !r.uri.path().starts_with("/_compactor")));

    let (status, _, body) = get(&format!("{}/_compactor/nope", proxy.url())).await;
    assert_eq!(status, 404);
    let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(v["error"]["code"], "not_found");
}

#[tokio::test]
async fn http2_client_is_served() {
    let up = upstream().await;
    let proxy = start_proxy(&up.url(), "").await;
    let h2: hyper_util::client::legacy::Client<_, TestBody> =
        hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
            .http2_only(true)
            .build_http();
    let resp = h2
        .request(request(
            "POST",
            &format!("{}/v1/chat/completions", proxy.url()),
            full("{}"),
        ))
        .await
        .unwrap();
    assert_eq!(resp.version(), http::Version::HTTP_2);
    assert_eq!(resp.status(), 200);
    let body = http_body_util::BodyExt::collect(resp.into_body())
        .await
        .unwrap()
        .to_bytes();
    assert_eq!(body, Bytes::from_static(SSE.as_bytes()));
    let seen = up.last_request();
    assert_eq!(seen.headers["host"], up.addr.to_string());
}
