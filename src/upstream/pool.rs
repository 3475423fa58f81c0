//! The upstream connection pool: HTTP/1.1 connections (plain or TLS) made
//! with hyper's connection API, kept idle per origin and handed back the
//! moment a response body ends.
//!
//! It replaces hyper-util's legacy `Client`, which for every request hashed
//! the origin with SipHash twice (checkout and return), took its pool's
//! mutex twice, and spawned a task that waited for the connection to be
//! ready again before returning it (a task allocation and a schedule per
//! request). Here a connection goes back from the response body's
//! end-of-stream, on the thread that read it: no task, no hash (a serving
//! thread's [`Upstream`](super::Upstream) has a pool of its own, holding a
//! connection or two per origin: a scan compares the origin's bytes).
//!
//! A connection has no task either: the request waiting for its response
//! head, then the response body being read, drive it ([`drive`]). An idle
//! one is driven when a checkout or the reaper looks at it, which is when
//! a close the upstream sent meanwhile is read.
//!
//! What the legacy client did that matters is kept: a request whose pooled
//! connection turned out closed before the request was written is sent
//! again on a new connection (hyper hands the request back); idle
//! connections older than the idle timeout are never used, and a reaper
//! drops them (and those the upstream closed) while nothing asks; the URI
//! goes out in origin form.

use std::future::{poll_fn, Future};
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::uri::{Authority, PathAndQuery, Scheme};
use http::{HeaderMap, Request, Response, Uri};
use http_body::{Body, Frame, SizeHint};
use hyper::body::Incoming;
use hyper::client::conn::http1;
use hyper_rustls::{HttpsConnector, MaybeHttpsStream};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioIo;
use tokio::time::Instant;
use tower_service::Service;

use super::body::ProxyReqBody;
use super::keepalive::{announced_timeout, idle_within};
use crate::error::BoxError;
use crate::sync::lock;

type Sender = http1::SendRequest<ProxyReqBody>;
/// The connection's I/O half: hyper's HTTP/1 state machine over the socket.
type Conn = http1::Connection<MaybeHttpsStream<TokioIo<tokio::net::TcpStream>>, ProxyReqBody>;

/// A connection: the handle requests go in by, and the state machine that
/// writes them and reads the responses. No task of its own: whoever waits
/// on it (the request, then its response body) drives it (see [`drive`]).
struct Link {
    tx: Sender,
    // Boxed: hyper's state machine is kilobytes, and a response body that
    // held it inline had it copied with every move of the response.
    conn: Option<Box<Conn>>,
}

/// Polls `conn` (writes what is queued, reads what arrived, hands a
/// response head or body frame to its receiver); `None` once it ended.
/// Driving a connection on the task that waits on it costs no task, no
/// wake-up and no scheduler turn per frame: hyper's connection task took
/// one of each for every frame of a response, and a proxy that gathers a
/// burst of frames had to yield once per frame for that task to decode the
/// next one.
fn drive(conn: &mut Option<Box<Conn>>, cx: &mut Context<'_>) {
    if let Some(c) = conn {
        if let Poll::Ready(r) = Pin::new(&mut **c).poll(cx) {
            if let Err(e) = r {
                tracing::debug!(error = %e, "upstream connection ended with an error");
            }
            *conn = None;
        }
    }
}

/// A request that got no response head from the pool.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ClientError {
    /// No connection could be made (refused, DNS, TLS, connect timeout).
    #[error("client error (Connect)")]
    Connect(#[source] BoxError),
    /// The connection failed while the request went out or before the
    /// response head came back.
    #[error("client error (SendRequest)")]
    Send(#[source] hyper::Error),
    /// The request URI has no scheme or authority (a bug: every caller
    /// joins it onto a base).
    #[error("client error (request URI is not absolute)")]
    NotAbsolute,
}

impl ClientError {
    /// Whether no connection was made.
    pub(crate) fn is_connect(&self) -> bool {
        matches!(self, ClientError::Connect(_))
    }
}

/// Where a connection goes: scheme and authority.
#[derive(Clone)]
struct Origin {
    scheme: Scheme,
    authority: Authority,
}

impl Origin {
    fn of(uri: &Uri) -> Option<Origin> {
        Some(Origin {
            scheme: uri.scheme()?.clone(),
            authority: uri.authority()?.clone(),
        })
    }

    fn is(&self, other: &Origin) -> bool {
        self.scheme == other.scheme && self.authority == other.authority
    }
}

/// An idle connection.
struct Idle {
    origin: Origin,
    link: Link,
    since: Instant,
}

impl Idle {
    /// Whether it may still be used at `now`: not idle for `idle` or
    /// longer, and not closed. It is driven once here, so a close that
    /// arrived while it idled is read now.
    fn usable(&mut self, now: Instant, idle: Duration) -> bool {
        if now.saturating_duration_since(self.since) >= idle {
            return false;
        }
        let mut cx = Context::from_waker(std::task::Waker::noop());
        drive(&mut self.link.conn, &mut cx);
        !self.link.ended()
    }
}

impl Link {
    /// Whether it can take no request any more: the upstream closed it, or
    /// it failed.
    fn ended(&self) -> bool {
        self.conn.is_none() || self.tx.is_closed()
    }
}

/// What the pool's mutex guards.
#[derive(Default)]
struct Conns {
    /// Oldest first: a checkout takes the newest (the least likely to have
    /// been closed by the upstream), the reaper drops from the front.
    idle: Vec<Idle>,
    /// A reaper task is running.
    reaping: bool,
}

/// The idle connections and the idle timeout, shared with the response
/// bodies that give their connection back.
struct Shared {
    conns: Mutex<Conns>,
    /// The idle timeout in force, in nanoseconds.
    idle_ns: AtomicU64,
}

impl Shared {
    fn idle(&self) -> Duration {
        Duration::from_nanos(self.idle_ns.load(Ordering::Relaxed))
    }

    /// The newest usable idle connection to `origin`; expired and closed
    /// ones met on the way are dropped (which closes them).
    fn checkout(&self, origin: &Origin) -> Option<Link> {
        let idle = self.idle();
        let now = Instant::now();
        let mut conns = lock(&self.conns);
        let mut end = conns.idle.len();
        while let Some(pos) = conns.idle[..end].iter().rposition(|c| c.origin.is(origin)) {
            let c = &mut conns.idle[pos];
            if !c.usable(now, idle) {
                conns.idle.remove(pos);
                end = pos;
                continue;
            }
            if c.link.tx.is_ready() {
                return Some(conns.idle.remove(pos).link);
            }
            // Not ready for another request (a response it did not finish
            // reading): left to idle out.
            end = pos;
        }
        None
    }

    /// Takes `link` back as idle and makes sure a reaper will drop it once
    /// it has idled out.
    fn give_back(self: &Arc<Self>, origin: Origin, link: Link) {
        if link.ended() {
            return;
        }
        let mut conns = lock(&self.conns);
        conns.idle.push(Idle {
            origin,
            link,
            since: Instant::now(),
        });
        if !conns.reaping {
            if let Ok(rt) = tokio::runtime::Handle::try_current() {
                conns.reaping = true;
                rt.spawn(reap(Arc::downgrade(self)));
            }
        }
    }

    /// Drops the expired and closed idle connections; whether any is left
    /// (when none is, the reaper stops, under the same lock).
    fn prune(&self) -> bool {
        let idle = self.idle();
        let now = Instant::now();
        let mut conns = lock(&self.conns);
        conns.idle.retain_mut(|c| c.usable(now, idle));
        conns.reaping = !conns.idle.is_empty();
        conns.reaping
    }
}

/// Closes idle connections that idled out while no request asked for one,
/// as the legacy pool's timer did: a connection is not held open past the
/// idle timeout for an upstream to close under a later request. Runs while
/// there are idle connections, waking once per idle timeout.
async fn reap(shared: Weak<Shared>) {
    loop {
        let Some(idle) = shared.upgrade().map(|s| s.idle()) else {
            return;
        };
        tokio::time::sleep(idle.max(Duration::from_millis(10))).await;
        match shared.upgrade() {
            Some(s) if s.prune() => {}
            _ => return,
        }
    }
}

/// The pool: the connector, the idle connections and the idle timeout
/// (the configured one, or the shorter one an upstream announced).
pub(crate) struct Pool {
    connector: HttpsConnector<HttpConnector>,
    shared: Arc<Shared>,
    configured: Duration,
    /// The first announcement shorter than `configured` (it decides).
    learned: OnceLock<Duration>,
}

impl Pool {
    /// A pool connecting with `connector`, dropping connections idle for
    /// `idle`.
    pub(crate) fn new(connector: HttpsConnector<HttpConnector>, idle: Duration) -> Self {
        Pool {
            connector,
            shared: Arc::new(Shared {
                conns: Mutex::new(Conns::default()),
                idle_ns: AtomicU64::new(nanos(idle)),
            }),
            configured: idle,
            learned: OnceLock::new(),
        }
    }

    /// The idle timeout connections are pooled with now.
    #[cfg(test)]
    pub(crate) fn idle(&self) -> Duration {
        self.shared.idle()
    }

    /// Reads a response's `Keep-Alive` header: a timeout the configured
    /// idle does not stay under lowers the idle timeout of every connection
    /// from then on (once; the first announcement decides).
    pub(crate) fn learn(&self, headers: &HeaderMap) {
        if self.learned.get().is_some() {
            return;
        }
        let Some(announced) = announced_timeout(headers) else {
            return;
        };
        let idle = idle_within(announced);
        if idle >= self.configured {
            return;
        }
        self.learned.get_or_init(|| {
            tracing::info!(
                announced_secs = announced.as_secs(),
                idle_ms = idle.as_millis() as u64,
                configured_ms = self.configured.as_millis() as u64,
                "upstream announces a shorter keep-alive; pooled connections idle less"
            );
            self.shared.idle_ns.store(nanos(idle), Ordering::Relaxed);
            idle
        });
    }

    /// Sends `req` (an absolute URI) on an idle connection to its origin,
    /// or a new one. A pooled connection found closed before the request
    /// was written gets the request back from hyper: it goes out once more
    /// on a new connection.
    pub(crate) async fn request(
        &self,
        mut req: Request<ProxyReqBody>,
    ) -> Result<Response<UpstreamBody>, ClientError> {
        let origin = Origin::of(req.uri()).ok_or(ClientError::NotAbsolute)?;
        let target = std::mem::take(req.uri_mut());
        *req.uri_mut() = origin_form(&target);
        let (mut link, reused) = match self.shared.checkout(&origin) {
            Some(link) => (link, true),
            None => (self.connect(&target).await?, false),
        };
        let resp = match send(&mut link, req).await {
            Ok(resp) => resp,
            Err(mut e) => match e.take_message() {
                Some(req) if reused => {
                    tracing::debug!(error = %e.error(), "pooled upstream connection closed before the request went out; sending it on a new one");
                    link = self.connect(&target).await?;
                    send(&mut link, req)
                        .await
                        .map_err(|e| ClientError::Send(e.into_error()))?
                }
                _ => return Err(ClientError::Send(e.into_error())),
            },
        };
        let (parts, body) = resp.into_parts();
        let mut body = UpstreamBody {
            inner: body,
            lease: Some(Lease {
                shared: Arc::clone(&self.shared),
                origin,
                link,
            }),
        };
        if body.inner.is_end_stream() {
            body.give_back();
        }
        Ok(Response::from_parts(parts, body))
    }

    /// A new connection to `target`'s origin.
    async fn connect(&self, target: &Uri) -> Result<Link, ClientError> {
        let mut connector = self.connector.clone();
        poll_fn(|cx| connector.poll_ready(cx))
            .await
            .map_err(ClientError::Connect)?;
        let io = connector
            .call(target.clone())
            .await
            .map_err(ClientError::Connect)?;
        let (tx, conn) = http1::Builder::new()
            .handshake(io)
            .await
            .map_err(|e| ClientError::Connect(Box::new(e)))?;
        Ok(Link {
            tx,
            conn: Some(Box::new(conn)),
        })
    }
}

/// Sends `req` on `link`, driving the connection until the response head
/// arrives (or the connection fails, which fails the send).
async fn send(
    link: &mut Link,
    req: Request<ProxyReqBody>,
) -> Result<Response<Incoming>, hyper::client::conn::TrySendError<Request<ProxyReqBody>>> {
    let Link { tx, conn } = link;
    let mut sent = std::pin::pin!(tx.try_send_request(req));
    poll_fn(|cx| {
        drive(conn, cx);
        sent.as_mut().poll(cx)
    })
    .await
}

fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

/// `target`'s path and query alone, as an HTTP/1.1 request line carries
/// them to an origin server.
fn origin_form(target: &Uri) -> Uri {
    let pq = match target.path_and_query() {
        Some(pq) if pq.as_str().starts_with('/') => pq.clone(),
        Some(pq) if pq.as_str() == "*" => pq.clone(),
        _ => PathAndQuery::from_static("/"),
    };
    Uri::from(pq)
}

/// The connection a response came on, returned to the pool when its body
/// ends.
struct Lease {
    shared: Arc<Shared>,
    origin: Origin,
    link: Link,
}

/// An upstream response body. Frames are the connection's, untouched; at
/// the end of the stream the connection goes back to the pool. Dropped
/// before its end, it takes the connection with it (hyper closes one whose
/// response was not read to the end).
pub struct UpstreamBody {
    inner: Incoming,
    lease: Option<Lease>,
}

impl std::fmt::Debug for UpstreamBody {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UpstreamBody")
            .field("pooled", &self.lease.is_some())
            .finish_non_exhaustive()
    }
}

impl UpstreamBody {
    fn give_back(&mut self) {
        if let Some(lease) = self.lease.take() {
            lease.shared.give_back(lease.origin, lease.link);
        }
    }
}

impl Body for UpstreamBody {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        let mut polled = Pin::new(&mut self.inner).poll_frame(cx);
        if polled.is_pending() {
            // The frame is decoded here: polling the body told the
            // connection it is wanted, driving it hands it over.
            if let Some(lease) = self.lease.as_mut() {
                drive(&mut lease.link.conn, cx);
                polled = Pin::new(&mut self.inner).poll_frame(cx);
            }
        }
        match &polled {
            Poll::Ready(None) => self.give_back(),
            Poll::Ready(Some(Ok(_))) if self.inner.is_end_stream() => self.give_back(),
            Poll::Ready(Some(Err(_))) => self.lease = None,
            _ => {}
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::{TcpListener, TcpStream};

    fn pool() -> Pool {
        let config = crate::config::Config::default();
        Pool::new(
            crate::upstream::client::connector(&config).unwrap(),
            Duration::from_secs(30),
        )
    }

    fn get(addr: std::net::SocketAddr) -> Request<ProxyReqBody> {
        let mut req = Request::new(super::super::body::boxed(http_body_util::Empty::new()));
        *req.uri_mut() = format!("http://{addr}/x").parse().unwrap();
        req.headers_mut()
            .insert(http::header::HOST, addr.to_string().parse().unwrap());
        req
    }

    /// The whole body of a GET through `pool`.
    async fn body_of(pool: &Pool, addr: std::net::SocketAddr) -> Bytes {
        let resp = pool.request(get(addr)).await.unwrap();
        let body = http_body_util::BodyExt::collect(resp.into_body()).await;
        body.unwrap().to_bytes()
    }

    /// Reads a request and answers it with `body`.
    async fn answer(s: &mut TcpStream, body: &str) {
        assert!(read_head(s).await);
        let resp = format!(
            "HTTP/1.1 200 OK\r\ncontent-length: {}\r\n\r\n{body}",
            body.len()
        );
        s.write_all(resp.as_bytes()).await.unwrap();
    }

    /// Reads one request head (the requests here have no body).
    async fn read_head(s: &mut TcpStream) -> bool {
        let mut head = Vec::new();
        let mut b = [0u8; 1];
        while !head.ends_with(b"\r\n\r\n") {
            match s.read(&mut b).await {
                Ok(1) => head.push(b[0]),
                _ => return false,
            }
        }
        true
    }

    #[tokio::test]
    async fn frames_already_received_come_out_without_waiting_for_another_task() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (sent_tx, sent_rx) = tokio::sync::oneshot::channel();
        tokio::spawn(async move {
            let (mut s, _) = listener.accept().await.unwrap();
            assert!(read_head(&mut s).await);
            let mut resp = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n".to_vec();
            for i in 0..10 {
                resp.extend_from_slice(format!("2\r\n{i}\n\r\n").as_bytes());
            }
            // Ten chunks in one write; the end of the body comes later.
            s.write_all(&resp).await.unwrap();
            sent_tx.send(()).unwrap();
            tokio::time::sleep(Duration::from_millis(200)).await;
            s.write_all(b"0\r\n\r\n").await.unwrap();
            tokio::time::sleep(Duration::from_millis(200)).await;
        });
        let pool = pool();
        let resp = pool.request(get(addr)).await.unwrap();
        sent_rx.await.unwrap();
        tokio::time::sleep(Duration::from_millis(50)).await;
        let mut body = std::pin::pin!(resp.into_body());
        let mut cx = Context::from_waker(std::task::Waker::noop());
        let mut got = Vec::new();
        // With its connection on a task of its own, every frame after the
        // first needed that task to run: a Pending between any two.
        while let Poll::Ready(Some(Ok(frame))) = body.as_mut().poll_frame(&mut cx) {
            got.extend_from_slice(&frame.into_data().unwrap());
        }
        let want: Vec<u8> = (0..10)
            .flat_map(|i| format!("{i}\n").into_bytes())
            .collect();
        assert_eq!(got, want, "all ten frames, one poll after another");
    }

    #[tokio::test]
    async fn a_connection_goes_back_to_the_pool_and_is_used_again() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let server = tokio::spawn(async move {
            let (mut s, _) = listener.accept().await.unwrap();
            for body in ["one", "two", "six"] {
                answer(&mut s, body).await;
            }
            // A second connection would wait here for ever: the test fails
            // on its timeout instead.
        });
        let pool = pool();
        for want in ["one", "two", "six"] {
            assert_eq!(&body_of(&pool, addr).await[..], want.as_bytes());
        }
        tokio::time::timeout(Duration::from_secs(5), server)
            .await
            .unwrap()
            .unwrap();
    }

    #[tokio::test]
    async fn an_idle_connection_the_upstream_closed_is_not_used() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (closed_tx, closed_rx) = tokio::sync::oneshot::channel();
        let server = tokio::spawn(async move {
            // The first connection answers one request, then the upstream
            // closes it while it idles in the pool.
            let (mut first, _) = listener.accept().await.unwrap();
            answer(&mut first, "ok").await;
            tokio::time::sleep(Duration::from_millis(50)).await;
            drop(first);
            closed_tx.send(()).unwrap();
            let (mut second, _) = listener.accept().await.unwrap();
            answer(&mut second, "new").await;
            tokio::time::sleep(Duration::from_millis(100)).await;
        });
        let pool = pool();
        assert_eq!(&body_of(&pool, addr).await[..], b"ok");
        closed_rx.await.unwrap();
        tokio::time::sleep(Duration::from_millis(50)).await;
        // The close is read before the request is written (at checkout, or
        // when hyper hands the request back): it goes on a new connection.
        assert_eq!(&body_of(&pool, addr).await[..], b"new");
        server.await.unwrap();
    }

    #[test]
    fn the_request_line_carries_the_path_and_query_only() {
        let uri = |s: &str| origin_form(&s.parse().unwrap()).to_string();
        assert_eq!(
            uri("https://h:1/v1/chat/completions?x=1"),
            "/v1/chat/completions?x=1"
        );
        assert_eq!(uri("http://h:1"), "/");
    }

    #[test]
    fn a_shorter_announcement_lowers_the_idle_timeout_once() {
        let config = crate::config::Config::default();
        let connector = crate::upstream::client::connector(&config).unwrap();
        let pool = Pool::new(connector, Duration::from_secs(4));
        let headers = |v: &'static str| {
            let mut h = HeaderMap::new();
            h.insert("keep-alive", http::HeaderValue::from_static(v));
            h
        };
        pool.learn(&headers("timeout=10"));
        assert_eq!(
            pool.idle(),
            Duration::from_secs(4),
            "a longer one changes nothing"
        );
        pool.learn(&HeaderMap::new());
        assert_eq!(pool.idle(), Duration::from_secs(4));
        pool.learn(&headers("timeout=2"));
        assert_eq!(pool.idle(), Duration::from_millis(1500));
        pool.learn(&headers("timeout=1"));
        assert_eq!(
            pool.idle(),
            Duration::from_millis(1500),
            "the first one decides"
        );
    }
}
