//! Routing: compactor's own `/_compactor/*` endpoints are answered here;
//! `POST /v1/chat/completions`, `POST /v1/messages` (Anthropic) and
//! `POST /v1/responses` go through [`crate::chat::walk::handle_api`] with
//! their codec; every other request (`/v1/messages/count_tokens` too) goes
//! to the upstream unchanged (hop-by-hop headers aside).
//! Every response is observed on its way out (metrics, one log line).

use std::convert::Infallible;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use bytes::Bytes;
use http::{header, HeaderValue, Method, Request, Response, StatusCode, Version};
use http_body_util::BodyExt;

use super::AppState;
use crate::codec::Api;
use crate::error::{error_response, full_body, BoxError, ProxyBody, ProxyError};
use crate::metrics::Metrics;
use crate::upstream::body::{
    observed, ByteBudget, Eos, FlushBeforeError, LimitedBody, ProxyReqBody,
};
use crate::upstream::{replayable_len, RequestStats};

/// Exact path intercepted for compaction.
pub const CHAT_COMPLETIONS_PATH: &str = "/v1/chat/completions";
/// Anthropic Messages, intercepted for compaction.
pub const MESSAGES_PATH: &str = "/v1/messages";
/// OpenAI Responses, intercepted for compaction.
pub const RESPONSES_PATH: &str = "/v1/responses";
/// Ollama's native chat, intercepted for compaction (the rest of `/api/`
/// is forwarded untouched).
pub const OLLAMA_CHAT_PATH: &str = "/api/chat";
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
    /// `GET /_compactor/sessions`: the conversations.
    Sessions,
    /// `GET /_compactor/ui` and its assets: the inspector page.
    Ui,
    /// Any other `/_compactor/*` path.
    Admin,
    /// `POST /v1/chat/completions`.
    Chat,
    /// `POST /v1/messages`.
    Messages,
    /// `POST /v1/responses`.
    Responses,
    /// `POST /api/chat` (Ollama).
    Ollama,
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
                (&Method::GET, "sessions") => Route::Sessions,
                (&Method::GET, r) if r.starts_with("sessions/") => Route::Session,
                (&Method::GET, r) if r == "ui" || r.starts_with("ui/") => Route::Ui,
                _ => Route::Admin,
            };
        }
        if method != Method::POST {
            return Route::Passthrough;
        }
        match path {
            CHAT_COMPLETIONS_PATH => Route::Chat,
            MESSAGES_PATH => Route::Messages,
            RESPONSES_PATH => Route::Responses,
            OLLAMA_CHAT_PATH => Route::Ollama,
            _ => Route::Passthrough,
        }
    }

    /// The API of a conversation route (its body is read whole).
    pub fn api(self) -> Option<Api> {
        match self {
            Route::Chat => Some(Api::Chat),
            Route::Messages => Some(Api::Messages),
            Route::Responses => Some(Api::Responses),
            Route::Ollama => Some(Api::Ollama),
            _ => None,
        }
    }

    /// Fixed metric label.
    pub fn label(self) -> &'static str {
        match self {
            Route::Health => "health",
            Route::Metrics => "metrics",
            Route::Session => "session",
            Route::Sessions => "sessions",
            Route::Ui => "ui",
            Route::Admin => "admin",
            Route::Chat => "chat",
            Route::Messages => "messages",
            Route::Responses => "responses",
            Route::Ollama => "ollama",
            Route::Passthrough => "passthrough",
        }
    }
}

/// Routes, dispatches and observes a request on a served connection (read
/// by [`super::h1`] with its body whole, or by hyper): `active` marks the
/// connection busy until the response body ends (idle timeout).
pub async fn handle_on<B>(
    state: Arc<AppState>,
    req: Request<B>,
    active: Option<super::conn::Active>,
) -> Result<Response<ProxyBody>, Infallible>
where
    B: http_body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    let in_flight = InFlight::new(Arc::clone(&state.metrics));
    let method = req.method().clone();
    // The request's own URI kept, not its path copied: a clone shares the
    // bytes the server read it from.
    let uri = req.uri().clone();
    let path = uri.path();
    let route = Route::of(&method, path);
    // Chat bodies and small passthrough bodies are read whole: their bytes
    // count against the budget.
    let buffered = route.api().is_some()
        || (route == Route::Passthrough && replayable_len(req.headers()).is_some());
    let stats = Arc::new(if buffered {
        RequestStats::with_budget(Arc::clone(&state.metrics))
    } else {
        RequestStats::default()
    });
    let upstream = &state.upstream;

    let resp = match route {
        // Rare: the check runs again to say why.
        _ if refused(&req).is_some() => refusal(upstream, route, &req),
        Route::Health => health(),
        Route::Metrics => metrics(&state),
        Route::Session | Route::Sessions | Route::Ui => {
            let admin = super::admin::Admin {
                token: state.config.admin_token.as_deref(),
                show_content: state.config.admin_show_content,
            };
            let mut resp = match route {
                Route::Session => super::admin::session_view(admin, &state.chat, &req).await,
                Route::Sessions => super::admin::sessions_list(admin, &state.chat, &req).await,
                _ => super::ui::serve(path, admin.token.is_some()),
            };
            super::admin::guard(&mut resp);
            resp
        }
        Route::Admin => error_response(
            StatusCode::NOT_FOUND,
            "unknown compactor endpoint",
            "invalid_request_error",
            "not_found",
        ),
        Route::Chat | Route::Messages | Route::Responses | Route::Ollama | Route::Passthrough => {
            match (limit_request(&state, req, &stats), route.api()) {
                (Err(e), api) => upstream.error_reply_in(
                    api.map(crate::chat::walk::error_shape).unwrap_or_default(),
                    &e,
                ),
                (Ok(req), Some(api)) => {
                    crate::chat::walk::handle_api(api, &state.chat, upstream, req, &stats).await
                }
                (Ok(req), None) => upstream.forward(req, &stats).await,
            }
        }
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
        drop(active);
        let bytes_in = stats.bytes_in.load(Ordering::Relaxed);
        metrics.record_request(route.label(), status.as_u16(), bytes_in, bytes_out);
        crate::telemetry::request::log(&crate::telemetry::request::RequestLine {
            method: method.as_str(),
            path: uri.path(),
            route: route.label(),
            status: status.as_u16(),
            bytes_in,
            bytes_out,
            upstream_us: upstream_wait.map(crate::telemetry::request::micros),
            total_us: crate::telemetry::request::micros(stats.start.elapsed()),
            eos: eos.as_str(),
        });
    });
    // Frames gathered by the coalescer (`upstream::coalesce`, next to the
    // upstream's body) must be written before an error.
    let body = observed(FlushBeforeError::new(body), on_eos).boxed_unsync();
    Ok(Response::from_parts(parts, body))
}

/// Why a request is answered 400 before it is routed: an HTTP/1.1
/// request's Host fields (RFC 9112 §3.2: none, several, or a value that is
/// no host), and the request targets only a forward proxy serves: a
/// `CONNECT` (its authority-form target would go upstream as `/`, the
/// client waiting for a tunnel) and the asterisk form (`OPTIONS *`, which
/// would go upstream as `/*`). nginx answers these 400 too (405 for some
/// methods with `*`); one status for all keeps it simple.
fn refused<B>(req: &Request<B>) -> Option<&'static str> {
    if req.method() == Method::CONNECT {
        return Some("CONNECT is not served: compactor is not a forward proxy");
    }
    if req.uri().path() == "*" {
        return Some("an asterisk-form request target (*) is not served");
    }
    if req.version() == Version::HTTP_11 {
        return crate::http1::host_problem(req.headers());
    }
    None
}

/// The 400 for a [`refused`] request, in its route's error shape.
fn refusal<B>(
    upstream: &crate::upstream::Upstream,
    route: Route,
    req: &Request<B>,
) -> Response<ProxyBody> {
    let why = refused(req).unwrap_or("refused");
    let shape = route.api().map(crate::chat::walk::error_shape);
    let mut resp = upstream.error_reply_in(shape.unwrap_or_default(), &ProxyError::BadRequest(why));
    // What follows such a request on its connection can not be trusted to
    // be the next request (a tunnel's bytes, a request framed for another
    // host): the connection ends with it.
    resp.headers_mut()
        .insert(header::CONNECTION, HeaderValue::from_static("close"));
    resp
}

/// Counts a request in flight until dropped: also when the client goes away
/// before the response head and hyper drops the handler future.
struct InFlight(Arc<Metrics>);

impl InFlight {
    fn new(metrics: Arc<Metrics>) -> Self {
        metrics.request_started();
        InFlight(metrics)
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.request_finished();
    }
}

/// Rejects a declared oversize body up front and wraps the body so the
/// limit is also enforced while streaming (chunked uploads).
fn limit_request<B>(
    state: &AppState,
    req: Request<B>,
    stats: &Arc<RequestStats>,
) -> Result<Request<ProxyReqBody>, ProxyError>
where
    B: http_body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    let limit = state.config.max_body_bytes;
    let declared = crate::http1::declared_length(req.headers());
    if declared.is_some_and(|n| n > limit) {
        return Err(ProxyError::BodyTooLarge { limit });
    }
    let (parts, body) = req.into_parts();
    let secs = state.config.timeouts.body_read;
    let mut body = LimitedBody::new(body, limit, Arc::clone(&stats.bytes_in))
        .with_deadline(crate::clock::deadline(stats.start, secs), secs.as_secs());
    if stats.is_budgeted() {
        body = body.with_budget(ByteBudget {
            used: Arc::clone(&state.metrics),
            max: state.config.limits.max_buffered_body_bytes,
        });
    }
    let body = body.boxed_unsync();
    Ok(Request::from_parts(parts, body))
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
    let text = state
        .metrics
        .render(state.chat.sessions.len(), state.chat.records.len());
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
    fn route_labels_are_written_quoted_as_they_are() {
        // The request log line writes a label between quotes without
        // escaping it (telemetry::request::label), as `Debug` would.
        let every = [
            Route::Health,
            Route::Metrics,
            Route::Session,
            Route::Sessions,
            Route::Ui,
            Route::Admin,
            Route::Chat,
            Route::Messages,
            Route::Responses,
            Route::Ollama,
            Route::Passthrough,
        ];
        for r in every {
            // Fails to compile when a route is added: add it above.
            match r {
                Route::Health
                | Route::Metrics
                | Route::Session
                | Route::Sessions
                | Route::Ui
                | Route::Admin
                | Route::Chat
                | Route::Messages
                | Route::Responses
                | Route::Ollama
                | Route::Passthrough => {}
            }
            let l = r.label();
            assert_eq!(format!("{l:?}"), format!("\"{l}\""));
        }
    }

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
        assert_eq!(Route::of(&Method::POST, "/v1/messages"), Route::Messages);
        assert_eq!(
            Route::of(&Method::GET, "/_compactor/sessions"),
            Route::Sessions
        );
        assert_eq!(Route::of(&Method::GET, "/_compactor/ui"), Route::Ui);
        assert_eq!(Route::of(&Method::GET, "/_compactor/ui/app.js"), Route::Ui);
        assert_eq!(Route::of(&Method::GET, "/_compactor/uix"), Route::Admin);
        assert_eq!(
            Route::of(&Method::POST, "/_compactor/sessions"),
            Route::Admin
        );
        assert_eq!(
            Route::of(&Method::POST, "/v1/messages/count_tokens"),
            Route::Passthrough
        );
        assert_eq!(Route::of(&Method::POST, "/v1/responses"), Route::Responses);
        assert_eq!(Route::of(&Method::POST, "/api/chat"), Route::Ollama);
        // The rest of Ollama's API is forwarded untouched.
        for path in ["/api/generate", "/api/embed", "/api/pull", "/api/chat/x"] {
            assert_eq!(Route::of(&Method::POST, path), Route::Passthrough);
        }
        assert_eq!(Route::of(&Method::GET, "/api/chat"), Route::Passthrough);
        assert_eq!(
            Route::of(&Method::GET, "/v1/responses/resp_1"),
            Route::Passthrough
        );
    }
}
