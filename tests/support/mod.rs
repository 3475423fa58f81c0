//! Test support, one module for every proxy and chat suite: an in-process
//! scripted mock upstream on `127.0.0.1:0` ([`chat`] has the chat-shaped one),
//! a compactor launcher and a small HTTP client.
//!
//! The mock answers each path with a scripted [`Reply`]: full bodies, chunked
//! bodies with delays, streams held open until the test releases them, large
//! generated bodies, or no answer at all. It records every request (headers,
//! body length and hash) and counts cancelled streams and closed connections.

// Test code: a failed unwrap is a failed test. clippy.toml allows that in
// #[test] functions only, not in the helpers they share.
#![allow(clippy::unwrap_used, clippy::expect_used)]
#![allow(dead_code)]

pub mod apis;
pub mod chat;
pub mod ollama;
pub mod redis;

use std::collections::HashMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue, Method, Request, Response, StatusCode, Uri};
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full};
use hyper::body::{Frame, Incoming};
use hyper::service::service_fn;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::net::TcpListener;
use tokio::sync::{mpsc, Notify};
use xxhash_rust::xxh3::Xxh3;

pub type BoxError = Box<dyn std::error::Error + Send + Sync>;
pub type TestBody = UnsyncBoxBody<Bytes, BoxError>;

/// Request bodies up to this size are kept in full; larger ones only hashed.
const KEEP_BODY_MAX: u64 = 8 * 1024 * 1024;

/// How the mock answers a path.
#[derive(Clone)]
pub enum Reply {
    /// Content-Length body.
    Full {
        status: u16,
        headers: Vec<(&'static str, String)>,
        body: Bytes,
    },
    /// Chunked body: each chunk sent after its delay.
    Chunks {
        status: u16,
        headers: Vec<(&'static str, String)>,
        chunks: Vec<(Duration, Bytes)>,
    },
    /// Sends `first`, waits until [`Release::release`] (or forever), then `rest`.
    Held {
        status: u16,
        headers: Vec<(&'static str, String)>,
        first: Vec<Bytes>,
        release: Release,
        rest: Vec<Bytes>,
    },
    /// `total` deterministic bytes ([`pattern_byte`]) in `chunk`-sized frames,
    /// chunked (no Content-Length).
    Generated {
        status: u16,
        total: u64,
        chunk: usize,
    },
    /// Sends `first` (chunked), then breaks the connection mid-body.
    Broken { first: Vec<Bytes> },
    /// Never sends a response head.
    Hang,
    /// Sends no response head until [`Release::release`], then answers as
    /// `then`.
    AfterRelease { release: Release, then: Box<Reply> },
    /// Replies `{"len":N,"xxh3":"…"}` about the request body it consumed.
    BodyDigest,
}

/// A latch the test opens to let a [`Reply::Held`] stream continue.
#[derive(Clone, Default)]
pub struct Release(Arc<Notify>);

impl Release {
    pub fn new() -> Self {
        Self::default()
    }
    pub fn release(&self) {
        self.0.notify_one();
    }
}

/// The byte at `offset` of a [`Reply::Generated`] body.
pub fn pattern_byte(offset: u64) -> u8 {
    (offset.wrapping_mul(2_654_435_761) >> 13) as u8
}

/// One recorded request.
#[derive(Debug, Clone)]
pub struct Recorded {
    pub method: Method,
    pub uri: Uri,
    pub headers: HeaderMap,
    pub body: Bytes,
    pub body_len: u64,
    pub body_xxh3: u128,
}

#[derive(Default)]
struct Shared {
    routes: Mutex<HashMap<String, Reply>>,
    requests: Mutex<Vec<Recorded>>,
    cancelled: AtomicUsize,
    closed: AtomicUsize,
    event: Notify,
}

/// A running mock upstream.
pub struct MockUpstream {
    pub addr: SocketAddr,
    shared: Arc<Shared>,
    task: tokio::task::JoinHandle<()>,
    scheme: &'static str,
}

impl Drop for MockUpstream {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Builder for [`MockUpstream`].
#[derive(Default)]
pub struct MockBuilder {
    routes: HashMap<String, Reply>,
    tls: Option<Arc<rustls::ServerConfig>>,
}

impl MockUpstream {
    pub fn builder() -> MockBuilder {
        MockBuilder::default()
    }

    /// `http://127.0.0.1:port` (or https://localhost:port with TLS).
    pub fn url(&self) -> String {
        match self.scheme {
            "https" => format!("https://localhost:{}", self.addr.port()),
            _ => format!("http://{}", self.addr),
        }
    }

    pub fn requests(&self) -> Vec<Recorded> {
        self.shared.requests.lock().unwrap().clone()
    }

    pub fn last_request(&self) -> Recorded {
        self.requests().pop().expect("no request recorded")
    }

    pub fn cancelled(&self) -> usize {
        self.shared.cancelled.load(Ordering::SeqCst)
    }

    pub fn closed_connections(&self) -> usize {
        self.shared.closed.load(Ordering::SeqCst)
    }

    /// Waits (bounded) until `cond` holds; returns whether it did.
    pub async fn wait_for(&self, within: Duration, cond: impl Fn(&Self) -> bool) -> bool {
        let deadline = tokio::time::Instant::now() + within;
        loop {
            let notified = self.shared.event.notified();
            if cond(self) {
                return true;
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                return cond(self);
            }
        }
    }
}

impl MockBuilder {
    pub fn route(mut self, path: &str, reply: Reply) -> Self {
        self.routes.insert(path.to_owned(), reply);
        self
    }

    /// Serve TLS with this certificate chain and key.
    pub fn tls(mut self, config: rustls::ServerConfig) -> Self {
        self.tls = Some(Arc::new(config));
        self
    }

    pub async fn run(self) -> MockUpstream {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let shared = Arc::new(Shared::default());
        *shared.routes.lock().unwrap() = self.routes;
        let tls = self.tls.clone();
        let scheme = if tls.is_some() { "https" } else { "http" };
        let sh = Arc::clone(&shared);
        let task = tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    continue;
                };
                let _ = stream.set_nodelay(true);
                let sh = Arc::clone(&sh);
                let tls = tls.clone();
                tokio::spawn(async move {
                    let svc_shared = Arc::clone(&sh);
                    let service = service_fn(move |req| serve(Arc::clone(&svc_shared), req));
                    let builder = hyper::server::conn::http1::Builder::new();
                    let result = match tls {
                        Some(cfg) => {
                            let acceptor = tokio_rustls::TlsAcceptor::from(cfg);
                            match acceptor.accept(stream).await {
                                Ok(s) => builder
                                    .serve_connection(TokioIo::new(s), service)
                                    .await
                                    .map_err(|e| e.to_string()),
                                Err(e) => Err(e.to_string()),
                            }
                        }
                        None => builder
                            .serve_connection(TokioIo::new(stream), service)
                            .await
                            .map_err(|e| e.to_string()),
                    };
                    let _ = result;
                    sh.closed.fetch_add(1, Ordering::SeqCst);
                    sh.event.notify_waiters();
                });
            }
        });
        MockUpstream {
            addr,
            shared,
            task,
            scheme,
        }
    }
}

// One match over every scripted reply kind; split up it would scatter the
// script the tests read against.
#[allow(clippy::too_many_lines)]
async fn serve(
    shared: Arc<Shared>,
    req: Request<Incoming>,
) -> Result<Response<TestBody>, Infallible> {
    let (parts, mut body) = req.into_parts();
    let mut hasher = Xxh3::new();
    let mut kept = Vec::new();
    let mut len = 0u64;
    while let Some(frame) = body.frame().await {
        let Ok(frame) = frame else { break };
        if let Some(d) = frame.data_ref() {
            hasher.update(d);
            len += d.len() as u64;
            if len <= KEEP_BODY_MAX {
                kept.extend_from_slice(d);
            }
        }
    }
    let digest = hasher.digest128();
    shared.requests.lock().unwrap().push(Recorded {
        method: parts.method.clone(),
        uri: parts.uri.clone(),
        headers: parts.headers.clone(),
        body: if len <= KEEP_BODY_MAX {
            Bytes::from(kept)
        } else {
            Bytes::new()
        },
        body_len: len,
        body_xxh3: digest,
    });
    shared.event.notify_waiters();

    let reply = shared.routes.lock().unwrap().get(parts.uri.path()).cloned();
    let Some(reply) = reply else {
        return Ok(respond(404, &[], full(Bytes::from_static(b"no route"))));
    };
    let reply = match reply {
        Reply::AfterRelease { release, then } => {
            release.0.notified().await;
            *then
        }
        other => other,
    };
    Ok(match reply {
        Reply::Full {
            status,
            headers,
            body,
        } => respond(status, &headers, full(body)),
        Reply::Chunks {
            status,
            headers,
            chunks,
        } => {
            let (tx, body) = channel_body();
            let sh = Arc::clone(&shared);
            tokio::spawn(async move {
                for (delay, chunk) in chunks {
                    if !delay.is_zero() {
                        tokio::time::sleep(delay).await;
                    }
                    if tx.send(Ok(Frame::data(chunk))).await.is_err() {
                        mark_cancelled(&sh);
                        return;
                    }
                }
            });
            respond(status, &headers, body)
        }
        Reply::Held {
            status,
            headers,
            first,
            release,
            rest,
        } => {
            let (tx, body) = channel_body();
            let sh = Arc::clone(&shared);
            tokio::spawn(async move {
                for chunk in first {
                    if tx.send(Ok(Frame::data(chunk))).await.is_err() {
                        mark_cancelled(&sh);
                        return;
                    }
                }
                tokio::select! {
                    () = release.0.notified() => {}
                    () = tx.closed() => {
                        mark_cancelled(&sh);
                        return;
                    }
                }
                for chunk in rest {
                    if tx.send(Ok(Frame::data(chunk))).await.is_err() {
                        mark_cancelled(&sh);
                        return;
                    }
                }
            });
            respond(status, &headers, body)
        }
        Reply::Generated {
            status,
            total,
            chunk,
        } => {
            let (tx, body) = channel_body();
            let sh = Arc::clone(&shared);
            tokio::spawn(async move {
                let mut offset = 0u64;
                while offset < total {
                    let n = (chunk as u64).min(total - offset);
                    let bytes: Vec<u8> = (offset..offset + n).map(pattern_byte).collect();
                    offset += n;
                    if tx.send(Ok(Frame::data(Bytes::from(bytes)))).await.is_err() {
                        mark_cancelled(&sh);
                        return;
                    }
                }
            });
            respond(status, &[], body)
        }
        Reply::Broken { first } => {
            let (tx, body) = channel_body();
            tokio::spawn(async move {
                for chunk in first {
                    if tx.send(Ok(Frame::data(chunk))).await.is_err() {
                        return;
                    }
                }
                let _ = tx.send(Err("upstream died".into())).await;
            });
            respond(200, &[("content-type", "text/event-stream".into())], body)
        }
        Reply::Hang | Reply::AfterRelease { .. } => {
            std::future::pending::<()>().await;
            unreachable!()
        }
        Reply::BodyDigest => {
            let json = format!("{{\"len\":{len},\"xxh3\":\"{digest:032x}\"}}");
            respond(
                200,
                &[("content-type", "application/json".to_owned())],
                full(Bytes::from(json)),
            )
        }
    })
}

fn mark_cancelled(shared: &Shared) {
    shared.cancelled.fetch_add(1, Ordering::SeqCst);
    shared.event.notify_waiters();
}

type FrameTx = mpsc::Sender<Result<Frame<Bytes>, BoxError>>;

fn channel_body() -> (FrameTx, TestBody) {
    let (tx, rx) = mpsc::channel::<Result<Frame<Bytes>, BoxError>>(1);
    (tx, ChannelBody(rx).boxed_unsync())
}

/// A body fed frame by frame from a channel; dropping it closes the channel,
/// which is how the mock notices a cancelled stream.
pub struct ChannelBody(mpsc::Receiver<Result<Frame<Bytes>, BoxError>>);

impl hyper::body::Body for ChannelBody {
    type Data = Bytes;
    type Error = BoxError;
    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        self.0.poll_recv(cx)
    }
}

/// A request body the test feeds through the returned sender.
pub fn channel_request_body() -> (FrameTx, TestBody) {
    channel_body()
}

pub fn full(b: impl Into<Bytes>) -> TestBody {
    Full::new(b.into()).map_err(|e| match e {}).boxed_unsync()
}

pub fn empty() -> TestBody {
    full(Bytes::new())
}

fn respond(status: u16, headers: &[(&'static str, String)], body: TestBody) -> Response<TestBody> {
    let mut resp = Response::new(body);
    *resp.status_mut() = StatusCode::from_u16(status).unwrap();
    for (k, v) in headers {
        resp.headers_mut().append(
            HeaderName::from_static(k),
            HeaderValue::from_str(v).unwrap(),
        );
    }
    resp
}

// ---------------------------------------------------------------- compactor

/// Accepts HTTP/1 connections on `listener` for a mock upstream, each
/// request answered by `serve(state, request)`, until the task is aborted.
pub fn serve_mock<S, F, Fut, B>(
    listener: TcpListener,
    state: Arc<S>,
    serve: F,
) -> tokio::task::JoinHandle<()>
where
    S: Send + Sync + 'static,
    F: Fn(Arc<S>, Request<Incoming>) -> Fut + Copy + Send + Sync + 'static,
    Fut: std::future::Future<Output = Result<Response<B>, Infallible>> + Send + 'static,
    B: hyper::body::Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                continue;
            };
            let state = Arc::clone(&state);
            tokio::spawn(async move {
                let svc = service_fn(move |req| serve(Arc::clone(&state), req));
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), svc)
                    .await;
            });
        }
    })
}

/// Starts compactor in-process in front of `upstream` with extra TOML.
pub async fn start_proxy(upstream: &str, extra_toml: &str) -> compactor::server::RunningServer {
    let text = format!("listen = \"127.0.0.1:0\"\nupstream = \"{upstream}\"\n{extra_toml}");
    let config =
        compactor::config::Config::from_toml_str(&text, &compactor::config::MapEnv::default())
            .unwrap();
    compactor::server::start(config).await.unwrap()
}

// ---------------------------------------------------------------- client

pub type TestClient = Client<HttpConnector, TestBody>;

pub fn client() -> TestClient {
    Client::builder(TokioExecutor::new()).build_http()
}

pub fn request(method: &str, url: &str, body: TestBody) -> Request<TestBody> {
    let mut req = Request::new(body);
    *req.method_mut() = Method::from_bytes(method.as_bytes()).unwrap();
    *req.uri_mut() = url.parse().unwrap();
    req
}

/// Sends and collects the whole response.
pub async fn fetch(req: Request<TestBody>) -> (StatusCode, HeaderMap, Bytes) {
    let resp = client().request(req).await.unwrap();
    let (parts, body) = resp.into_parts();
    let bytes = body.collect().await.unwrap().to_bytes();
    (parts.status, parts.headers, bytes)
}

pub async fn get(url: &str) -> (StatusCode, HeaderMap, Bytes) {
    fetch(request("GET", url, empty())).await
}

/// Headers as comparable (name, value) pairs, without `date` (time-dependent).
pub fn comparable_headers(h: &HeaderMap) -> Vec<(String, Vec<u8>)> {
    let mut v: Vec<_> = h
        .iter()
        .filter(|(k, _)| *k != http::header::DATE)
        .map(|(k, v)| (k.as_str().to_owned(), v.as_bytes().to_vec()))
        .collect();
    v.sort();
    v
}

/// Streams a response body into a hash without holding it: (len, xxh3).
pub async fn digest_body(body: Incoming) -> (u64, u128) {
    let mut body = body;
    let mut h = Xxh3::new();
    let mut len = 0u64;
    while let Some(frame) = body.frame().await {
        let frame = frame.unwrap();
        if let Some(d) = frame.data_ref() {
            h.update(d);
            len += d.len() as u64;
        }
    }
    (len, h.digest128())
}

/// Installs the ring provider once for test-side rustls users.
pub fn install_crypto() {
    let _ = rustls::crypto::ring::default_provider().install_default();
}

/// One response's head (as text) from `conn`, its body (by its length)
/// read past.
pub async fn read_response(conn: &mut tokio::net::TcpStream) -> String {
    let mut buf = Vec::new();
    let head_end = loop {
        if let Some(at) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break at + 4;
        }
        read_into(conn, &mut buf, "before a response head").await;
    };
    let head = String::from_utf8_lossy(&buf[..head_end]).into_owned();
    let length: usize = head
        .lines()
        .find_map(|l| {
            let (name, value) = l.split_once(':')?;
            name.eq_ignore_ascii_case("content-length")
                .then(|| value.trim().parse().ok())?
        })
        .expect("a content-length");
    while buf.len() < head_end + length {
        read_into(conn, &mut buf, "inside a body").await;
    }
    head
}

/// What `conn` has next, appended to `buf`; its end is a failure `at`.
async fn read_into(conn: &mut tokio::net::TcpStream, buf: &mut Vec<u8>, at: &str) {
    let mut chunk = [0u8; 4096];
    let n = tokio::io::AsyncReadExt::read(conn, &mut chunk)
        .await
        .unwrap();
    assert!(n > 0, "connection closed {at}");
    buf.extend_from_slice(&chunk[..n]);
}
