//! Routing and the transparent forwarding path.
//!
//! Every request except compactor's own `/_compactor/*` endpoints goes to the
//! upstream unchanged (hop-by-hop headers aside); `POST /v1/chat/completions`
//! goes through [`chat::handle`], where compaction plugs in.

pub mod body;
pub mod chat;
pub mod coalesce;
pub mod headers;
pub mod upstream;

use std::convert::Infallible;
use std::error::Error as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::request::Parts;
use http::{header, HeaderValue, Method, Request, Response, StatusCode, Version};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use tokio::time::Instant;

use crate::app::AppState;
use crate::error::{error_response, full_body, BoxError, ProxyBody, ProxyError};
use body::{BodyLimitExceeded, Eos, IdleTimeoutBody, LimitedBody, ObservedBody, ProxyReqBody};

/// Exact path intercepted for compaction.
pub const CHAT_COMPLETIONS_PATH: &str = "/v1/chat/completions";
/// Prefix of compactor's own endpoints (never forwarded).
pub const ADMIN_PREFIX: &str = "/_compactor/";

/// Which handler serves a request; also the `route` metric label.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Route {
    /// `GET /_compactor/health`.
    Health,
    /// `GET /_compactor/metrics`.
    Metrics,
    /// `GET /_compactor/sessions/{key}`.
    Session,
    /// Any other `/_compactor/*` path.
    Admin,
    /// `POST /v1/chat/completions`.
    Chat,
    /// Everything else: forwarded untouched.
    Passthrough,
}

impl Route {
    /// Classifies a request by method and path only.
    pub fn of(method: &Method, path: &str) -> Route {
        if let Some(rest) = path.strip_prefix(ADMIN_PREFIX) {
            return match (method, rest) {
                (&Method::GET, "health") => Route::Health,
                (&Method::GET, "metrics") => Route::Metrics,
                (&Method::GET, r) if r.starts_with("sessions/") => Route::Session,
                _ => Route::Admin,
            };
        }
        if method == Method::POST && path == CHAT_COMPLETIONS_PATH {
            Route::Chat
        } else {
            Route::Passthrough
        }
    }

    /// Fixed metric label.
    pub fn label(self) -> &'static str {
        match self {
            Route::Health => "health",
            Route::Metrics => "metrics",
            Route::Session => "session",
            Route::Admin => "admin",
            Route::Chat => "chat",
            Route::Passthrough => "passthrough",
        }
    }
}

/// Per-request accounting shared between the handler, [`send_upstream`] and
/// the end-of-stream log line; travels in the request extensions.
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
    upstream_called: std::sync::atomic::AtomicBool,
}

impl RequestStats {
    fn new() -> Self {
        RequestStats {
            start: Instant::now(),
            bytes_in: Arc::new(AtomicU64::new(0)),
            upstream_wait_ns: AtomicU64::new(0),
            upstream_called: std::sync::atomic::AtomicBool::new(false),
        }
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

/// The hyper service entry point: route, dispatch, observe.
pub async fn handle(
    state: Arc<AppState>,
    req: Request<Incoming>,
) -> Result<Response<ProxyBody>, Infallible> {
    let stats = Arc::new(RequestStats::new());
    let in_flight = InFlight::new(Arc::clone(&state.metrics));
    let method = req.method().clone();
    let path = req.uri().path().to_owned();
    let route = Route::of(&method, &path);

    let resp = match route {
        Route::Health => health(),
        Route::Metrics => metrics(&state),
        Route::Session => crate::chat::admin::session_view(Arc::clone(&state), &req).await,
        Route::Admin => error_response(
            StatusCode::NOT_FOUND,
            "unknown compactor endpoint",
            "invalid_request_error",
            "not_found",
        ),
        Route::Chat | Route::Passthrough => match limit_request(&state, req, &stats) {
            Err(e) => error_reply(&state, &e),
            Ok(req) if route == Route::Chat => chat::handle(Arc::clone(&state), req).await,
            Ok(req) => forward(&state, req).await,
        },
    };

    let upstream_wait = stats.upstream_wait();
    if let Some(wait) = upstream_wait {
        state.metrics.upstream_wait.observe(wait);
        let overhead = stats.start.elapsed().saturating_sub(wait);
        state.metrics.proxy_overhead.observe(overhead);
    }

    let status = resp.status();
    let (parts, body) = resp.into_parts();
    let metrics = Arc::clone(&state.metrics);
    let on_eos = Box::new(move |eos: Eos, bytes_out: u64| {
        drop(in_flight);
        let bytes_in = stats.bytes_in.load(Ordering::Relaxed);
        metrics.record_request(route.label(), status.as_u16(), bytes_in, bytes_out);
        let upstream_ms = upstream_wait.map(millis);
        tracing::info!(
            %method,
            path = %path,
            route = route.label(),
            status = status.as_u16(),
            bytes_in,
            bytes_out,
            upstream_ms,
            total_ms = millis(stats.start.elapsed()),
            eos = eos.as_str(),
            "request"
        );
    });
    let body = ObservedBody::new(coalesce::CoalesceBody::new(body), on_eos).boxed_unsync();
    Ok(Response::from_parts(parts, body))
}

/// Counts a request in flight until dropped: also when the client goes away
/// before the response head and hyper drops the handler future.
struct InFlight(Arc<crate::metrics::Metrics>);

impl InFlight {
    fn new(metrics: Arc<crate::metrics::Metrics>) -> Self {
        metrics.request_started();
        InFlight(metrics)
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.request_finished();
    }
}

/// Milliseconds with microsecond resolution, for log lines.
fn millis(d: Duration) -> f64 {
    (d.as_secs_f64() * 1e6).round() / 1e3
}

/// Rejects a declared oversize body up front and wraps the body so the
/// limit is also enforced while streaming (chunked uploads).
fn limit_request(
    state: &AppState,
    req: Request<Incoming>,
    stats: &Arc<RequestStats>,
) -> Result<Request<ProxyReqBody>, ProxyError> {
    let limit = state.config.max_body_bytes;
    let declared = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok());
    if declared.is_some_and(|n| n > limit) {
        return Err(ProxyError::BodyTooLarge { limit });
    }
    let (mut parts, body) = req.into_parts();
    parts.extensions.insert(Arc::clone(stats));
    let body = LimitedBody::new(body, limit, Arc::clone(&stats.bytes_in)).boxed_unsync();
    Ok(Request::from_parts(parts, body))
}

/// Forwards a request and streams the response back; errors become
/// OpenAI-shaped responses.
pub async fn forward(state: &AppState, req: Request<ProxyReqBody>) -> Response<ProxyBody> {
    let (parts, body) = req.into_parts();
    match send_upstream(state, &parts, body).await {
        Ok(resp) => stream_response(state, resp),
        Err(e) => error_reply(state, &e),
    }
}

/// Builds the error response for `e`, counting and logging it.
pub fn error_reply(state: &AppState, e: &ProxyError) -> Response<ProxyBody> {
    state.metrics.record_error(e.code());
    match e.source_kind() {
        crate::error::ErrorSource::Upstream => {
            tracing::warn!(code = e.code(), error = %e, "upstream failure")
        }
        crate::error::ErrorSource::Client => {
            tracing::info!(code = e.code(), error = %e, "request rejected")
        }
        crate::error::ErrorSource::Internal => {
            tracing::error!(code = e.code(), error = %e, "internal error")
        }
    }
    e.to_response()
}

/// Sends one request to the upstream: URI joined onto the base, hop-by-hop
/// headers removed, Host set to the upstream's, the first-byte timeout
/// applied. Reusable by the chat path (and its retry).
pub async fn send_upstream(
    state: &AppState,
    parts: &Parts,
    body: ProxyReqBody,
) -> Result<Response<Incoming>, ProxyError> {
    let upstream = &state.config.upstream;
    let uri = upstream::join_uri(upstream, &parts.uri)
        .map_err(|e| ProxyError::BadRequest(format!("cannot build upstream URI: {e}")))?;
    let mut headers = parts.headers.clone();
    headers::prepare_request_headers(&mut headers);
    // hyper already answered any `Expect: 100-continue` on our side.
    headers.remove(header::EXPECT);
    let host = HeaderValue::from_str(upstream.authority.as_str())
        .map_err(|e| ProxyError::Internal(format!("upstream host header: {e}")))?;
    headers.insert(header::HOST, host);

    let mut req = Request::new(body);
    *req.method_mut() = parts.method.clone();
    *req.uri_mut() = uri;
    *req.version_mut() = Version::HTTP_11;
    *req.headers_mut() = headers;

    let timeout = state.config.timeouts.first_byte;
    let sent = Instant::now();
    let result = tokio::time::timeout(timeout, state.client.request(req)).await;
    if let Some(stats) = parts.extensions.get::<Arc<RequestStats>>() {
        stats.add_upstream_wait(sent.elapsed());
    }
    match result {
        Err(_) => Err(ProxyError::FirstByteTimeout(timeout.as_secs())),
        Ok(Ok(resp)) => Ok(resp),
        Ok(Err(e)) => Err(classify_client_error(state, &e)),
    }
}

/// Maps a client error to what the caller should see: our body limit → 413,
/// connect timeout → 504, client body failure → 400, anything else → 502.
fn classify_client_error(state: &AppState, e: &hyper_util::client::legacy::Error) -> ProxyError {
    let mut source: Option<&(dyn std::error::Error + 'static)> = e.source();
    let mut timed_out = false;
    let mut body_error = false;
    while let Some(s) = source {
        if let Some(limit) = s.downcast_ref::<BodyLimitExceeded>() {
            return ProxyError::BodyTooLarge { limit: limit.limit };
        }
        if let Some(io) = s.downcast_ref::<std::io::Error>() {
            timed_out |= io.kind() == std::io::ErrorKind::TimedOut;
        }
        if let Some(h) = s.downcast_ref::<hyper::Error>() {
            // A user error with a cause is the request body stream failing.
            body_error |= h.is_user() && h.source().is_some() && !e.is_connect();
        }
        source = s.source();
    }
    if e.is_connect() && timed_out {
        return ProxyError::ConnectTimeout(state.config.timeouts.connect.as_secs());
    }
    if body_error {
        // A failing client upload (reset mid-body) is the client's fault.
        return ProxyError::ClientBody(error_chain(e));
    }
    ProxyError::UpstreamUnreachable(error_chain(e))
}

/// `outer: inner: innermost`, one line, no content.
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut source = e.source();
    while let Some(inner) = source {
        s.push_str(": ");
        s.push_str(&inner.to_string());
        source = inner.source();
    }
    s
}

/// Turns the upstream response into ours: status and headers as sent (minus
/// hop-by-hop), body streamed frame by frame with the idle timeout.
pub fn stream_response(state: &AppState, resp: Response<Incoming>) -> Response<ProxyBody> {
    let (mut parts, body) = resp.into_parts();
    headers::strip_hop_by_hop(&mut parts.headers);
    let metrics = Arc::clone(&state.metrics);
    let idle = state.config.timeouts.idle;
    let on_timeout = Box::new(move || {
        metrics.record_idle_timeout();
        tracing::warn!(idle_secs = idle.as_secs(), "upstream idle, ending stream");
    });
    let body = IdleTimeoutBody::new(body, idle, on_timeout).boxed_unsync();
    Response::from_parts(parts, body)
}

/// Turns a request-body read error (e.g. from collecting a
/// [`ProxyReqBody`]) into the matching [`ProxyError`].
pub fn body_read_error(e: &BoxError) -> ProxyError {
    match e.downcast_ref::<BodyLimitExceeded>() {
        Some(l) => ProxyError::BodyTooLarge { limit: l.limit },
        None => ProxyError::ClientBody(error_chain(e.as_ref())),
    }
}

fn health() -> Response<ProxyBody> {
    let mut resp = Response::new(full_body(Bytes::from_static(b"{\"status\":\"ok\"}")));
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    resp
}

fn metrics(state: &AppState) -> Response<ProxyBody> {
    let mut text = state.metrics.render();
    text.push_str(
        &state
            .chat
            .metrics
            .render(state.chat.sessions.len(), state.chat.records.len()),
    );
    let mut resp = Response::new(full_body(Bytes::from(text)));
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"),
    );
    resp
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn routes() {
        assert_eq!(Route::of(&Method::GET, "/_compactor/health"), Route::Health);
        assert_eq!(
            Route::of(&Method::GET, "/_compactor/metrics"),
            Route::Metrics
        );
        assert_eq!(Route::of(&Method::POST, "/_compactor/health"), Route::Admin);
        assert_eq!(
            Route::of(&Method::GET, "/_compactor/sessions/x"),
            Route::Session
        );
        assert_eq!(
            Route::of(&Method::POST, "/v1/chat/completions"),
            Route::Chat
        );
        assert_eq!(
            Route::of(&Method::GET, "/v1/chat/completions"),
            Route::Passthrough
        );
        assert_eq!(
            Route::of(&Method::POST, "/v1/completions"),
            Route::Passthrough
        );
        assert_eq!(Route::of(&Method::GET, "/health"), Route::Passthrough);
    }

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
