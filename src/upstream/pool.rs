//! The upstream connection pool: HTTP/1.1 connections (plain or TLS),
//! spoken to by compactor's own client ([`super::h1`]), kept idle per origin
//! and handed back the moment a response body ends.
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
//! head, then the response body being read, read and write its socket. An
//! idle one is read (without waiting) when a checkout or the reaper looks
//! at it, which is when a close the upstream sent meanwhile is seen.
//!
//! What the legacy client did that matters is kept: idle connections older
//! than the idle timeout are never used, and a reaper drops them (and those
//! the upstream closed) while nothing asks; the URI goes out in origin
//! form. A request that meets a connection the upstream closed just then
//! fails as unsent (no response byte came back), and
//! [`Upstream`](super::Upstream) sends it once more on a new connection.

use std::future::poll_fn;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::uri::{Authority, Scheme};
use http::{HeaderMap, Method, Response, Uri};
use http_body::{Body, Frame, SizeHint};
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioIo;
use tokio::time::Instant;
use tower_service::Service;

use super::body::ProxyReqBody;
use super::h1::{self, Reading};
use super::headers::RequestHeaders;
use super::keepalive::{announced_timeout, idle_within};
use crate::config::UpstreamBase;
use crate::error::BoxError;
use crate::sync::lock;

/// A connection, boxed: its TLS state is kilobytes, and a response body
/// that held it inline had it copied with every move of the response.
type Link = Box<h1::Conn>;

/// A request that got no response head from the pool.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ClientError {
    /// No connection could be made (refused, DNS, TLS, connect timeout).
    #[error("client error (Connect)")]
    Connect(#[source] BoxError),
    /// The connection failed while the request went out or before the
    /// response head came back.
    #[error("client error (SendRequest)")]
    Send(#[source] h1::Error),
}

impl ClientError {
    /// Whether no connection was made.
    pub(crate) fn is_connect(&self) -> bool {
        matches!(self, ClientError::Connect(_))
    }
}

/// Where a connection goes: scheme and authority.
#[derive(Clone)]
pub(crate) struct Origin {
    scheme: Scheme,
    authority: Authority,
}

impl Origin {
    /// The origin of an upstream base URL.
    pub(crate) fn of(base: &UpstreamBase) -> Origin {
        Origin {
            scheme: base.scheme.clone(),
            authority: base.authority.clone(),
        }
    }

    /// The URI a connector is asked to connect to.
    fn uri(&self) -> Result<Uri, http::Error> {
        Uri::builder()
            .scheme(self.scheme.clone())
            .authority(self.authority.clone())
            .path_and_query("/")
            .build()
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
    /// longer, and not closed. Its socket is read once here (without
    /// waiting), so a close that arrived while it idled is seen now.
    fn usable(&mut self, now: Instant, idle: Duration) -> bool {
        now.saturating_duration_since(self.since) < idle && self.link.is_usable()
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
            let usable = conns.idle[pos].usable(now, idle);
            let c = conns.idle.remove(pos);
            if usable {
                return Some(c.link);
            }
            end = pos;
        }
        None
    }

    /// Takes `link` back as idle and makes sure a reaper will drop it once
    /// it has idled out.
    fn give_back(self: &Arc<Self>, origin: Origin, link: Link) {
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

    /// Sends a request for `target` (origin-form: path and query) on an
    /// idle connection to `origin`, or a new one, and waits for the
    /// response head.
    pub(crate) async fn request(
        &self,
        method: &Method,
        origin: &Origin,
        target: &str,
        headers: &RequestHeaders<'_>,
        body: ProxyReqBody,
    ) -> Result<Response<UpstreamBody>, ClientError> {
        let (head, framing) =
            h1::encode_head(method, target, headers, &body).map_err(ClientError::Send)?;
        let mut conn = match self.shared.checkout(origin) {
            Some(conn) => conn,
            None => self.connect(origin).await?,
        };
        let h1::Head {
            response,
            decoder,
            keep_alive,
        } = conn
            .send(head, framing, body, method)
            .await
            .map_err(ClientError::Send)?;
        let mut body = UpstreamBody {
            reading: Some(Reading::new(conn, decoder, keep_alive)),
            shared: Arc::clone(&self.shared),
            origin: origin.clone(),
            end_owed: false,
        };
        if body.reading.as_ref().is_some_and(Reading::is_done) {
            body.finish();
        }
        Ok(response.map(|()| body))
    }

    /// A new connection to `origin`.
    async fn connect(&self, origin: &Origin) -> Result<Link, ClientError> {
        let target = origin.uri().map_err(|e| ClientError::Connect(e.into()))?;
        let mut connector = self.connector.clone();
        poll_fn(|cx| connector.poll_ready(cx))
            .await
            .map_err(ClientError::Connect)?;
        let io = connector.call(target).await.map_err(ClientError::Connect)?;
        Ok(Box::new(h1::Conn::new(TokioIo::new(io))))
    }
}

fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

/// An upstream response body: frames cut out of what the connection read,
/// untouched. At the end of the stream the connection goes back to the
/// pool when it may carry another request; dropped before its end, the
/// body takes the connection with it (closed).
pub struct UpstreamBody {
    /// `None` once the body ended.
    reading: Option<Reading>,
    shared: Arc<Shared>,
    origin: Origin,
    /// The connection went back with the last data frame, but the end is
    /// not said until the next poll: a body that says it ended with its
    /// first frame gets a `Content-Length` from hyper's server, which a
    /// chunked or close-delimited response did not have.
    end_owed: bool,
}

impl std::fmt::Debug for UpstreamBody {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UpstreamBody")
            .field("reading", &self.reading.is_some())
            .finish_non_exhaustive()
    }
}

impl UpstreamBody {
    /// The body ended: its connection goes back to the pool, or is closed.
    fn finish(&mut self) {
        if let Some(reading) = self.reading.take() {
            if reading.reusable() {
                self.shared.give_back(self.origin.clone(), reading.conn);
            }
        }
    }
}

impl Body for UpstreamBody {
    type Data = Bytes;
    type Error = h1::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, h1::Error>>> {
        let Some(reading) = self.reading.as_mut() else {
            self.end_owed = false;
            return Poll::Ready(None);
        };
        let polled = reading.poll_frame(cx);
        let done = reading.is_done();
        match &polled {
            Poll::Ready(None) => self.finish(),
            Poll::Ready(Some(Ok(_))) if done => {
                self.end_owed = true;
                self.finish()
            }
            Poll::Ready(Some(Err(_))) => self.reading = None,
            _ => {}
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.reading.is_none() && !self.end_owed
    }

    fn size_hint(&self) -> SizeHint {
        if self.end_owed {
            // Unknown, as the end is not said yet (see `end_owed`).
            return SizeHint::default();
        }
        self.reading
            .as_ref()
            .map_or(SizeHint::with_exact(0), |r| r.decoder.size_hint())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::Request;
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

    /// `req` through `pool`, its headers as they are (Host included).
    async fn send(
        pool: &Pool,
        req: Request<ProxyReqBody>,
    ) -> Result<Response<UpstreamBody>, ClientError> {
        let (parts, body) = req.into_parts();
        let headers = RequestHeaders {
            fields: &parts.headers,
            set: &[],
            host: parts.headers.get(http::header::HOST),
            underscores: true,
        };
        let origin = Origin {
            scheme: parts.uri.scheme().unwrap().clone(),
            authority: parts.uri.authority().unwrap().clone(),
        };
        let target = parts.uri.path_and_query().unwrap().as_str();
        pool.request(&parts.method, &origin, target, &headers, body)
            .await
    }

    /// The whole body of a GET through `pool`.
    async fn body_of(pool: &Pool, addr: std::net::SocketAddr) -> Bytes {
        let resp = send(pool, get(addr)).await.unwrap();
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

    /// The body of a GET answered with `first` in one write (read by the
    /// time this returns), then `later` 200 ms after.
    async fn body_read_in_one_write(first: Vec<u8>, later: &'static [u8]) -> UpstreamBody {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (sent_tx, sent_rx) = tokio::sync::oneshot::channel();
        tokio::spawn(async move {
            let (mut s, _) = listener.accept().await.unwrap();
            assert!(read_head(&mut s).await);
            s.write_all(&first).await.unwrap();
            sent_tx.send(()).unwrap();
            tokio::time::sleep(Duration::from_millis(200)).await;
            s.write_all(later).await.unwrap();
            tokio::time::sleep(Duration::from_millis(200)).await;
        });
        let resp = send(&pool(), get(addr)).await.unwrap();
        sent_rx.await.unwrap();
        tokio::time::sleep(Duration::from_millis(50)).await;
        resp.into_body()
    }

    #[tokio::test]
    async fn frames_already_received_come_out_without_waiting_for_another_task() {
        let mut resp = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n".to_vec();
        for i in 0..10 {
            resp.extend_from_slice(format!("2\r\n{i}\n\r\n").as_bytes());
        }
        // Ten chunks in one write; the end of the body comes later.
        let body = body_read_in_one_write(resp, b"0\r\n\r\n").await;
        let mut body = std::pin::pin!(body);
        let mut cx = Context::from_waker(std::task::Waker::noop());
        let mut got = Vec::new();
        let mut frames = 0;
        // With its connection on a task of its own, every frame after the
        // first needed that task to run: a Pending between any two.
        while let Poll::Ready(Some(Ok(frame))) = body.as_mut().poll_frame(&mut cx) {
            got.extend_from_slice(&frame.into_data().unwrap());
            frames += 1;
        }
        let want: Vec<u8> = (0..10)
            .flat_map(|i| format!("{i}\n").into_bytes())
            .collect();
        assert_eq!(got, want, "all ten chunks without waiting");
        assert_eq!(frames, 1, "the chunks read together leave as one frame");
    }

    #[tokio::test]
    async fn a_chunked_body_read_whole_says_its_end_only_after_its_last_frame() {
        // Head, one chunk and the last chunk in one write: read whole.
        let resp = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n";
        let body = body_read_in_one_write(resp.to_vec(), b"").await;
        let mut body = std::pin::pin!(body);
        let mut cx = Context::from_waker(std::task::Waker::noop());
        let Poll::Ready(Some(Ok(frame))) = body.as_mut().poll_frame(&mut cx) else {
            panic!("the chunk was read with the head");
        };
        assert_eq!(&frame.into_data().unwrap()[..], b"abc");
        // hyper's server writes a response head from these: an end or an
        // exact size here would give the client a Content-Length that the
        // upstream's chunked response did not have.
        assert!(!body.is_end_stream(), "the end is said on the next poll");
        assert_eq!(body.size_hint().exact(), None);
        assert!(matches!(
            body.as_mut().poll_frame(&mut cx),
            Poll::Ready(None)
        ));
        assert!(body.is_end_stream());
        assert_eq!(body.size_hint().exact(), Some(0));
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

    /// A request body that never yields (a client upload that stalls).
    struct Stalled;

    impl Body for Stalled {
        type Data = Bytes;
        type Error = std::convert::Infallible;

        fn poll_frame(
            self: Pin<&mut Self>,
            _: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
            Poll::Pending
        }
    }

    fn post(addr: std::net::SocketAddr, body: ProxyReqBody) -> Request<ProxyReqBody> {
        let mut req = get(addr);
        *req.method_mut() = http::Method::POST;
        *req.body_mut() = body;
        req
    }

    /// An upstream whose first connection reads a request head and sends
    /// `first` (left open), and whose second connection answers `second`:
    /// a test that the pool does not use the first connection again.
    fn upstream_not_reused(
        first: &'static [u8],
        second: &'static str,
    ) -> (std::net::SocketAddr, tokio::task::JoinHandle<TcpStream>) {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        listener.set_nonblocking(true).unwrap();
        let addr = listener.local_addr().unwrap();
        let server = tokio::spawn(async move {
            let listener = TcpListener::from_std(listener).unwrap();
            let (mut s, _) = listener.accept().await.unwrap();
            assert!(read_head(&mut s).await);
            s.write_all(first).await.unwrap();
            let (mut again, _) = listener.accept().await.unwrap();
            answer(&mut again, second).await;
            s
        });
        (addr, server)
    }

    #[tokio::test]
    async fn an_answer_that_comes_before_the_whole_request_is_read_and_the_connection_dropped() {
        // The upstream refuses after the head, before the body: the
        // request was not written to the end, its connection is not reused.
        let (addr, server) = upstream_not_reused(
            b"HTTP/1.1 413 Payload Too Large\r\ncontent-length: 3\r\n\r\nbig",
            "ok",
        );
        let pool = pool();
        let resp = send(&pool, post(addr, super::super::body::boxed(Stalled)))
            .await
            .unwrap();
        assert_eq!(resp.status(), http::StatusCode::PAYLOAD_TOO_LARGE);
        let body = http_body_util::BodyExt::collect(resp.into_body()).await;
        assert_eq!(&body.unwrap().to_bytes()[..], b"big");
        assert_eq!(&body_of(&pool, addr).await[..], b"ok");
        tokio::time::timeout(Duration::from_secs(5), server)
            .await
            .unwrap()
            .unwrap();
    }

    #[tokio::test]
    async fn a_streamed_body_goes_out_chunked_and_trailers_come_back() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let server = tokio::spawn(async move {
            let (mut s, _) = listener.accept().await.unwrap();
            let mut got = Vec::new();
            let mut b = [0u8; 1024];
            while !got.ends_with(b"0\r\n\r\n") {
                let n = s.read(&mut b).await.unwrap();
                assert!(n > 0, "request cut short: {got:?}");
                got.extend_from_slice(&b[..n]);
            }
            s.write_all(
                b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n2\r\nok\r\n0\r\nx-usage: 5\r\n\r\n",
            )
            .await
            .unwrap();
            String::from_utf8(got).unwrap()
        });
        let (tx, rx) = tokio::sync::mpsc::channel::<Bytes>(2);
        let body = Chan(rx);
        let pool = pool();
        let sending = tokio::spawn(async move {
            let resp = send(&pool, post(addr, super::super::body::boxed(body)))
                .await
                .unwrap();
            http_body_util::BodyExt::collect(resp.into_body())
                .await
                .unwrap()
        });
        tx.send(Bytes::from_static(b"{\"a\":")).await.unwrap();
        tokio::time::sleep(Duration::from_millis(20)).await;
        tx.send(Bytes::from_static(b"1}")).await.unwrap();
        drop(tx);
        let collected = sending.await.unwrap();
        assert_eq!(collected.trailers().unwrap()["x-usage"], "5");
        assert_eq!(&collected.to_bytes()[..], b"ok");
        let request = server.await.unwrap();
        assert!(
            request.contains("transfer-encoding: chunked\r\n\r\n"),
            "{request}"
        );
        assert!(
            request.ends_with("5\r\n{\"a\":\r\n2\r\n1}\r\n0\r\n\r\n"),
            "{request}"
        );
    }

    /// Frames from a channel, as a client's upload arrives.
    struct Chan(tokio::sync::mpsc::Receiver<Bytes>);

    impl Body for Chan {
        type Data = Bytes;
        type Error = std::convert::Infallible;

        fn poll_frame(
            mut self: Pin<&mut Self>,
            cx: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
            self.0.poll_recv(cx).map(|b| b.map(|b| Ok(Frame::data(b))))
        }
    }

    #[tokio::test]
    async fn a_response_that_says_close_is_not_pooled() {
        let (addr, server) = upstream_not_reused(
            b"HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-length: 3\r\n\r\none",
            "two",
        );
        let pool = pool();
        assert_eq!(&body_of(&pool, addr).await[..], b"one");
        assert_eq!(&body_of(&pool, addr).await[..], b"two");
        tokio::time::timeout(Duration::from_secs(5), server)
            .await
            .unwrap()
            .unwrap();
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
