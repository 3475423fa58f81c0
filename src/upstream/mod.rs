//! HTTP plumbing towards the upstream: the one [`Upstream`] (pooled client,
//! base URL, timeouts, metrics) every upstream request goes through, the body
//! wrappers, the hop-by-hop header policy and the error replies.
//!
//! Three callers: the forwarder ([`Upstream::forward`], [`Upstream::send`]),
//! the summariser ([`Upstream::post_json`]) and window discovery
//! ([`Upstream::get_json`]). Nothing here knows about chat or compaction.

pub mod body;
pub mod client;
pub mod coalesce;
pub mod h1;
pub mod headers;
mod keepalive;
mod pool;
mod replay;

use std::error::Error as _;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::request::Parts;
use http::{
    header, HeaderMap, HeaderName, HeaderValue, Method, Request, Response, StatusCode, Uri,
};
use http_body_util::{BodyExt, Empty, Full};
use serde_json::Value;
use tokio::time::Instant;

use crate::config::{Config, Timeouts, UpstreamBase};
use crate::error::{BoxError, ErrorShape, ErrorSource, ProxyBody, ProxyError};
use crate::metrics::Metrics;
use body::{
    boxed, BodyBudgetExceeded, BodyLimitExceeded, BodyReadTimeout, ByteBudget, IdleTimeoutBody,
    ProxyReqBody,
};
use client::{request_target, UpstreamSetupError};
pub(crate) use pool::UpstreamBody;
use pool::{ClientError, Origin, Pool};
use replay::Replay;

/// Passthrough request bodies up to this size (by their Content-Length) are
/// read whole before they go upstream, so a keep-alive race can be retried.
pub(crate) const REPLAYABLE_BODY_BYTES: u64 = 1 << 20;

/// The declared length of a body [`Upstream::forward`] reads whole: a
/// Content-Length from 1 to [`REPLAYABLE_BODY_BYTES`] (a chunked body's
/// size is unknown until its end: streamed).
pub(crate) fn replayable_len(headers: &HeaderMap) -> Option<u64> {
    crate::http1::declared_length(headers).filter(|n| (1..=REPLAYABLE_BODY_BYTES).contains(n))
}

/// Per-request accounting shared between the router, the upstream's
/// attempts and the end-of-stream log line. Handed to them, not carried in
/// the request's extensions: a first extension cost each request three
/// allocations (the value, the map, its table) and their frees.
#[derive(Debug)]
pub struct RequestStats {
    /// When the request head was received.
    pub start: Instant,
    /// Request body bytes read from the client so far.
    pub bytes_in: Arc<AtomicU64>,
    /// Nanoseconds spent waiting for upstream response heads (summed over
    /// attempts, so a retry is accounted for).
    upstream_wait_ns: AtomicU64,
    /// Whether the upstream was contacted at all.
    upstream_called: AtomicBool,
    /// Where `bytes_in` was reserved (chat bodies): released on drop.
    budget: Option<Arc<Metrics>>,
}

impl Drop for RequestStats {
    fn drop(&mut self) {
        if let Some(m) = &self.budget {
            let n = self.bytes_in.load(Ordering::Relaxed);
            m.buffered_body_bytes.fetch_sub(n, Ordering::Relaxed);
        }
    }
}

impl Default for RequestStats {
    fn default() -> Self {
        RequestStats {
            start: Instant::now(),
            bytes_in: Arc::new(AtomicU64::new(0)),
            upstream_wait_ns: AtomicU64::new(0),
            upstream_called: AtomicBool::new(false),
            budget: None,
        }
    }
}

impl RequestStats {
    /// Whether `bytes_in` are reserved in the buffered-body budget.
    pub fn is_budgeted(&self) -> bool {
        self.budget.is_some()
    }

    /// Stats whose `bytes_in` are reserved in `metrics`' buffered-body
    /// budget while the request lives (see `LimitedBody::with_budget`).
    pub fn with_budget(metrics: Arc<Metrics>) -> Self {
        let mut stats = RequestStats::default();
        stats.budget = Some(metrics);
        stats
    }

    /// Adds time spent waiting for the upstream.
    pub fn add_upstream_wait(&self, d: Duration) {
        let ns = u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
        self.upstream_wait_ns.fetch_add(ns, Ordering::Relaxed);
        self.upstream_called.store(true, Ordering::Relaxed);
    }

    /// Time spent waiting for the upstream so far, if it was contacted.
    pub fn upstream_wait(&self) -> Option<Duration> {
        self.upstream_called
            .load(Ordering::Relaxed)
            .then(|| Duration::from_nanos(self.upstream_wait_ns.load(Ordering::Relaxed)))
    }
}

/// A side request (summary call, window probe) that got no usable answer.
#[derive(Debug, thiserror::Error)]
pub enum FetchError {
    /// The target URI could not be built.
    #[error("cannot build the request URI: {0}")]
    Uri(String),
    /// Nothing came back (refused, DNS, TLS, reset).
    #[error("request failed: {0}")]
    Transport(String),
    /// The head came back but the body broke off.
    #[error("response body failed after HTTP {status}: {message}")]
    Body {
        /// The status of the head that did arrive.
        status: StatusCode,
        /// Cause.
        message: String,
    },
    /// No complete answer within the timeout.
    #[error("timed out")]
    Timeout,
    /// The body was not JSON.
    #[error("answer is not JSON")]
    InvalidJson,
}

/// The upstream: pooled client, base URL, timeouts and the metrics that
/// count what it does.
pub struct Upstream {
    pool: Pool,
    /// `limits.max_buffered_body_bytes`: what a streamed body may keep for
    /// a replay counts against it.
    budget_max: u64,
    base: UpstreamBase,
    /// The base's scheme and authority: where requests' connections go.
    origin: Origin,
    /// The Host header sent upstream, built once.
    host: HeaderValue,
    timeouts: Timeouts,
    /// `[server] underscores_in_headers`: forward client fields named with
    /// an `_` ([`headers::RequestHeaders::underscores`]).
    underscores: bool,
    metrics: Arc<Metrics>,
}

impl std::fmt::Debug for Upstream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Upstream")
            .field("base", &self.base)
            .finish_non_exhaustive()
    }
}

impl Upstream {
    /// Builds the pooled client for `config`'s upstream.
    pub fn new(config: &Config, metrics: Arc<Metrics>) -> Result<Self, UpstreamSetupError> {
        let pool = Pool::new(
            client::connector(config)?,
            config.timeouts.upstream_pool_idle,
        );
        let host =
            host_header(&config.upstream).map_err(|e| UpstreamSetupError::Host(e.to_string()))?;
        Ok(Upstream {
            pool,
            budget_max: config.limits.max_buffered_body_bytes,
            base: config.upstream.clone(),
            origin: Origin::of(&config.upstream),
            host,
            timeouts: config.timeouts,
            underscores: config.underscores_in_headers,
            metrics,
        })
    }

    /// The upstream base URL.
    pub(crate) fn base(&self) -> &UpstreamBase {
        &self.base
    }

    /// The configured timeouts.
    pub(crate) fn timeouts(&self) -> &Timeouts {
        &self.timeouts
    }

    /// The metrics registry.
    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.metrics
    }

    /// Forwards a request and streams the response back; errors become
    /// OpenAI-shaped responses.
    /// `stats` count the wait for the response head.
    pub async fn forward(
        &self,
        req: Request<ProxyReqBody>,
        stats: &RequestStats,
    ) -> Response<ProxyBody> {
        let (parts, body) = req.into_parts();
        let stats = Some(stats);
        let sent = if http_body::Body::is_end_stream(&body) {
            // Nothing to stream: replayable, so a keep-alive race is retried.
            self.send_bytes(&parts, Bytes::new(), stats).await
        } else if replayable_len(&parts.headers).is_some() {
            // Small enough to hold (the router reserved it in the body
            // budget): read whole, it can be sent again when the upstream
            // closed the pooled connection just as it went out.
            match self::body::whole(body).await {
                Ok(b) => self.send_bytes(&parts, b, stats).await,
                Err(e) => return self.error_reply(&body_read_error(&e)),
            }
        } else {
            self.send_streamed(&parts, body, stats).await
        };
        match sent {
            Ok(resp) => self.stream_response(resp),
            Err(e) => self.error_reply(&e),
        }
    }

    /// Sends one client request with a streamed body upstream (URI joined
    /// onto the base, hop-by-hop headers removed, Host set to the
    /// upstream's, the first-byte timeout applied). The frames that went
    /// out are kept until the upstream answers ([`replay`]), so the
    /// keep-alive race is retried for it too, as long as little of it went
    /// out.
    async fn send_streamed(
        &self,
        parts: &Parts,
        body: ProxyReqBody,
        stats: Option<&RequestStats>,
    ) -> Result<Response<UpstreamBody>, ProxyError> {
        let budget = ByteBudget {
            used: Arc::clone(&self.metrics),
            max: self.budget_max,
        };
        let replay = Replay::new(body, budget);
        let result = match self
            .attempt(parts, &parts.headers, &[], replay.first(), stats)
            .await
        {
            Err(Attempt::Client(e)) if unsent(&e) => match replay.again() {
                Some(body) => {
                    self.metrics.record_upstream_retry();
                    tracing::debug!(error = %error_chain(&e), "upstream closed the connection before answering; replaying the streamed body once");
                    self.attempt(parts, &parts.headers, &[], body, stats).await
                }
                None => Err(Attempt::Client(e)),
            },
            r => r,
        };
        replay.answered();
        result.map_err(|e| self.attempt_error(e))
    }

    /// [`Upstream::send`] for a body held in memory (chat bodies, bodiless
    /// requests): a request that never reached the upstream (a pooled
    /// connection it closed just then; no response byte came back) is sent
    /// once more, on another connection.
    pub(crate) async fn send_bytes(
        &self,
        parts: &Parts,
        body: Bytes,
        stats: Option<&RequestStats>,
    ) -> Result<Response<UpstreamBody>, ProxyError> {
        self.send_bytes_with(parts, &parts.headers, &[], body, stats)
            .await
    }

    /// [`Upstream::send_bytes`] with the client's header `fields` (not
    /// those of `parts`, whose method and URI are used) and
    /// `set` written in place of theirs of the same names
    /// ([`headers::RequestHeaders`]).
    pub(crate) async fn send_bytes_with(
        &self,
        parts: &Parts,
        fields: &HeaderMap,
        set: &[(HeaderName, HeaderValue)],
        body: Bytes,
        stats: Option<&RequestStats>,
    ) -> Result<Response<UpstreamBody>, ProxyError> {
        match self
            .attempt(parts, fields, set, boxed(Full::new(body.clone())), stats)
            .await
        {
            Err(Attempt::Client(e)) if unsent(&e) => {
                self.metrics.record_upstream_retry();
                tracing::debug!(error = %error_chain(&e), "upstream closed the connection before answering; retrying once");
                self.attempt(parts, fields, set, boxed(Full::new(body)), stats)
                    .await
                    .map_err(|e| self.attempt_error(e))
            }
            r => r.map_err(|e| self.attempt_error(e)),
        }
    }

    /// One request upstream: `parts`' method and URI with the client's
    /// header `fields` and `set` ([`headers::RequestHeaders`]: hop-by-hop ones
    /// left out, the upstream's Host).
    async fn attempt(
        &self,
        parts: &Parts,
        fields: &HeaderMap,
        set: &[(HeaderName, HeaderValue)],
        body: ProxyReqBody,
        stats: Option<&RequestStats>,
    ) -> Result<Response<UpstreamBody>, Attempt> {
        let target = request_target(&self.base, &parts.uri);
        let headers = headers::RequestHeaders {
            fields,
            set,
            host: Some(&self.host),
            underscores: self.underscores,
        };
        let timeout = self.timeouts.first_byte;
        let sent = Instant::now();
        // The deadline from `sent`: `timeout` would read the clock again.
        let result = tokio::time::timeout_at(
            crate::clock::deadline(sent, timeout),
            self.pool
                .request(&parts.method, &self.origin, &target, &headers, body),
        )
        .await;
        if let Some(stats) = stats {
            stats.add_upstream_wait(sent.elapsed());
        }
        match result {
            Err(_) => Err(Attempt::Failed(ProxyError::FirstByteTimeout(
                timeout.as_secs(),
            ))),
            Ok(Ok(resp)) => {
                self.pool.learn(resp.headers());
                Ok(resp)
            }
            Ok(Err(e)) => Err(Attempt::Client(e)),
        }
    }

    fn attempt_error(&self, e: Attempt) -> ProxyError {
        match e {
            Attempt::Failed(e) => e,
            Attempt::Client(e) => self.classify_client_error(&e),
        }
    }

    /// Turns the upstream response into ours: status and headers as sent
    /// (minus hop-by-hop), body streamed frame by frame with the idle timeout.
    pub(crate) fn stream_response(&self, resp: Response<UpstreamBody>) -> Response<ProxyBody> {
        let (mut parts, body) = resp.into_parts();
        headers::strip_hop_by_hop(&mut parts.headers);
        Response::from_parts(parts, self.idle_timeout(coalesce::CoalesceBody::new(body)))
    }

    /// Wraps a response body in the idle timeout (counted and logged when
    /// it fires) and boxes it.
    pub(crate) fn idle_timeout<B>(&self, body: B) -> ProxyBody
    where
        B: http_body::Body<Data = Bytes> + Send + 'static,
        B::Error: Into<BoxError>,
    {
        let metrics = Arc::clone(&self.metrics);
        let idle = self.timeouts.idle;
        let on_timeout = move || {
            metrics.record_idle_timeout();
            tracing::warn!(idle_secs = idle.as_secs(), "upstream idle, ending stream");
        };
        IdleTimeoutBody::new(body, idle, on_timeout).boxed_unsync()
    }

    /// Builds the error response for `e`, counting and logging it.
    pub(crate) fn error_reply(&self, e: &ProxyError) -> Response<ProxyBody> {
        self.error_reply_in(ErrorShape::OpenAi, e)
    }

    /// [`Upstream::error_reply`] in the client's API's error shape.
    pub(crate) fn error_reply_in(&self, shape: ErrorShape, e: &ProxyError) -> Response<ProxyBody> {
        self.metrics.record_error(e.code());
        match e {
            ProxyError::BodyReadTimeout(_) => self.metrics.record_body_read_timeout(),
            ProxyError::Overloaded(_) => self.metrics.record_body_budget_rejection(),
            _ => {}
        }
        match e.source_kind() {
            ErrorSource::Upstream => {
                tracing::warn!(code = e.code(), error = %e, "upstream failure")
            }
            ErrorSource::Client => {
                tracing::info!(code = e.code(), error = %e, "request rejected")
            }
            ErrorSource::Internal => {
                tracing::error!(code = e.code(), error = %e, "internal error")
            }
        }
        e.to_response_in(shape)
    }

    /// GETs `path` (relative to the upstream base, may carry a query) with
    /// `headers`, reading at most `limit` bytes of JSON. `Ok(None)` for a
    /// non-success status.
    pub(crate) async fn get_json(
        &self,
        path: &str,
        headers: HeaderMap,
        limit: usize,
        timeout: Duration,
    ) -> Result<Option<Value>, FetchError> {
        let uri: Uri = path
            .parse()
            .map_err(|e: http::uri::InvalidUri| FetchError::Uri(e.to_string()))?;
        let fetch = async {
            let (status, body) = self
                .exchange(
                    &self.base,
                    Method::GET,
                    &uri,
                    headers,
                    boxed(Empty::new()),
                    limit,
                )
                .await?;
            if !status.is_success() {
                return Ok(None);
            }
            serde_json::from_slice(&body)
                .map(Some)
                .map_err(|_| FetchError::InvalidJson)
        };
        tokio::time::timeout(timeout, fetch)
            .await
            .map_err(|_| FetchError::Timeout)?
    }

    /// POSTs a JSON `body` to `path` under `base` (the upstream's, or another
    /// endpoint sharing the pool) and reads at most `limit` bytes of the
    /// answer, whatever its status. No timeout of its own: the caller's
    /// deadline covers the whole call.
    pub async fn post_json(
        &self,
        base: &UpstreamBase,
        path: &'static str,
        headers: HeaderMap,
        body: Bytes,
        limit: usize,
    ) -> Result<(StatusCode, Bytes), FetchError> {
        self.post_json_query(base, path, None, headers, body, limit)
            .await
    }

    /// [`Self::post_json`] with a query string (as written, without `?`):
    /// the client's `?key=` credential on a side call made for it.
    pub(crate) async fn post_json_query(
        &self,
        base: &UpstreamBase,
        path: &'static str,
        query: Option<&str>,
        mut headers: HeaderMap,
        body: Bytes,
        limit: usize,
    ) -> Result<(StatusCode, Bytes), FetchError> {
        headers.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        headers.insert(header::ACCEPT, HeaderValue::from_static("application/json"));
        let uri = match query.filter(|q| !q.is_empty()) {
            None => Uri::from_static(path),
            Some(q) => format!("{path}?{q}")
                .parse::<Uri>()
                .map_err(|e| FetchError::Uri(e.to_string()))?,
        };
        self.exchange(
            base,
            Method::POST,
            &uri,
            headers,
            boxed(Full::new(body)),
            limit,
        )
        .await
    }

    /// One side request to `base`: hop-by-hop headers dropped, Host set, the
    /// whole (bounded) body read.
    async fn exchange(
        &self,
        base: &UpstreamBase,
        method: Method,
        uri: &Uri,
        headers: HeaderMap,
        body: ProxyReqBody,
        limit: usize,
    ) -> Result<(StatusCode, Bytes), FetchError> {
        let target = request_target(base, uri);
        let host = host_header(base).ok();
        let outgoing = headers::RequestHeaders {
            fields: &headers,
            set: &[],
            host: host.as_ref(),
            // compactor's own side requests: every field is its own.
            underscores: true,
        };
        let resp = self
            .pool
            .request(&method, &Origin::of(base), &target, &outgoing, body)
            .await
            .map_err(|e| FetchError::Transport(error_chain(&e)))?;
        self.pool.learn(resp.headers());
        let status = resp.status();
        let body = http_body_util::Limited::new(resp.into_body(), limit)
            .collect()
            .await
            .map_err(|e| FetchError::Body {
                status,
                message: e.to_string(),
            })?
            .to_bytes();
        Ok((status, body))
    }

    /// Maps a client error to what the caller should see: our body limit →
    /// 413, connect timeout → 504, client body failure → 400, else → 502.
    fn classify_client_error(&self, e: &ClientError) -> ProxyError {
        let mut source: Option<&(dyn std::error::Error + 'static)> = e.source();
        let mut timed_out = false;
        let mut body_error = false;
        while let Some(s) = source {
            if let Some(limit) = s.downcast_ref::<BodyLimitExceeded>() {
                return ProxyError::BodyTooLarge { limit: limit.limit };
            }
            if let Some(t) = s.downcast_ref::<BodyReadTimeout>() {
                return ProxyError::BodyReadTimeout(t.0);
            }
            if let Some(io) = s.downcast_ref::<std::io::Error>() {
                timed_out |= io.kind() == std::io::ErrorKind::TimedOut;
            }
            if let Some(h) = s.downcast_ref::<h1::Error>() {
                body_error |= h.is_request_body() && !e.is_connect();
            }
            source = s.source();
        }
        if e.is_connect() && timed_out {
            return ProxyError::ConnectTimeout(self.timeouts.connect.as_secs());
        }
        if body_error {
            // A failing client upload (reset mid-body) is the client's fault.
            return ProxyError::ClientBody(error_chain(e));
        }
        ProxyError::UpstreamUnreachable(error_chain(e))
    }
}

/// One upstream attempt that got no response head.
enum Attempt {
    /// Already mapped (timeout, bad URI).
    Failed(ProxyError),
    /// The client failed; [`unsent`] tells whether a replay is safe.
    Client(ClientError),
}

/// Whether the request failed before any response byte came back because
/// the connection closed under it: the client's "connection closed before
/// message completed", a request canceled before it was written, or a write
/// that met a closed socket (broken pipe, reset: the upstream had closed
/// the connection, its kernel answered our bytes with a reset). That is the
/// keep-alive race with an upstream closing idle connections. Connect
/// errors are not (nothing was pooled; a new connection would fail the same
/// way), nor is a failing client body.
fn unsent(e: &ClientError) -> bool {
    if e.is_connect() {
        return false;
    }
    let mut source: Option<&(dyn std::error::Error + 'static)> = e.source();
    while let Some(s) = source {
        if let Some(h) = s.downcast_ref::<h1::Error>() {
            if h.is_incomplete_message() {
                return true;
            }
            if h.is_request_body() {
                return false;
            }
        }
        if let Some(io) = s.downcast_ref::<std::io::Error>() {
            return matches!(
                io.kind(),
                std::io::ErrorKind::BrokenPipe | std::io::ErrorKind::ConnectionReset
            );
        }
        source = s.source();
    }
    false
}

fn host_header(base: &UpstreamBase) -> Result<HeaderValue, http::header::InvalidHeaderValue> {
    HeaderValue::from_str(base.authority.as_str())
}

/// `outer: inner: innermost`, one line, no content.
pub(crate) fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut source = e.source();
    while let Some(inner) = source {
        s.push_str(": ");
        s.push_str(&inner.to_string());
        source = inner.source();
    }
    s
}

/// Turns a request-body read error (e.g. from collecting a
/// [`ProxyReqBody`]) into the matching [`ProxyError`].
pub(crate) fn body_read_error(e: &BoxError) -> ProxyError {
    if let Some(l) = e.downcast_ref::<BodyLimitExceeded>() {
        return ProxyError::BodyTooLarge { limit: l.limit };
    }
    if let Some(t) = e.downcast_ref::<BodyReadTimeout>() {
        return ProxyError::BodyReadTimeout(t.0);
    }
    if let Some(b) = e.downcast_ref::<BodyBudgetExceeded>() {
        return ProxyError::Overloaded(b.to_string());
    }
    ProxyError::ClientBody(error_chain(e.as_ref()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn body_read_error_maps_limit() {
        let e: BoxError = Box::new(BodyLimitExceeded { limit: 5 });
        assert!(matches!(
            body_read_error(&e),
            ProxyError::BodyTooLarge { limit: 5 }
        ));
        let e: BoxError = "reset".into();
        assert!(matches!(body_read_error(&e), ProxyError::ClientBody(_)));
    }
}
