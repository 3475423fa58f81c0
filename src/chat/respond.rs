//! The response side the walk and a held-back stream ([`super::held`])
//! share: sending a prepared body, booking an overflow retry, the body the
//! client gets (usage tapped, the unasked usage chunk hidden) and
//! compactor's own response headers.

use std::sync::Arc;

use bytes::Bytes;
use http::request::Parts;
use http::{header, HeaderMap, HeaderName, HeaderValue, Response};

use crate::error::{ProxyBody, ProxyError};
use crate::session::key::SessionKey;
use crate::upstream::body::TapBody;
use crate::upstream::coalesce::CoalesceBody;
use crate::upstream::{headers, RequestStats, Upstream, UpstreamBody};
use crate::usage::hide::HideUsageBody;
use crate::usage::{BodyKind, TapOutcome, UsageObserver};
use crate::window::overflow::Overflow;

use super::prepare::Prepared;
use super::{worker, ChatState};

/// Response header naming what compactor did.
pub const ACTION_HEADER: &str = "x-compactor-action";
/// Response header carrying the opaque session key.
pub const SESSION_HEADER: &str = "x-compactor-session";
/// Response header: how many leading client messages were sent as their
/// recorded compacted replacement (absent when none).
pub const REPLACED_HEADER: &str = "x-compactor-replaced";

// Names checked once: a name given as a string is validated on every insert.
static ACTION_NAME: HeaderName = HeaderName::from_static(ACTION_HEADER);
static SESSION_NAME: HeaderName = HeaderName::from_static(SESSION_HEADER);
static REPLACED_NAME: HeaderName = HeaderName::from_static(REPLACED_HEADER);

/// A stream's start is held up to this size while looking for an in-band
/// overflow error.
pub(super) const MAX_STREAM_PEEK: usize = 64 << 10;

/// Sends `body` upstream with the client's headers (Content-Length fixed);
/// `parts` gives the method and URI; `stats`, when given, count the wait.
pub(super) async fn send(
    upstream: &Upstream,
    parts: &Parts,
    client_headers: &HeaderMap,
    body: Bytes,
    stats: Option<&RequestStats>,
) -> Result<Response<UpstreamBody>, ProxyError> {
    // The usage tap and hider read the response: a compressed body would
    // hide the usage from calibration and leave the forced usage chunk in
    // front of a client that never asked for it (SDKs send gzip by default).
    // (The client's Transfer-Encoding, hop-by-hop, never goes upstream.)
    let set = [
        (
            header::ACCEPT_ENCODING,
            HeaderValue::from_static("identity"),
        ),
        (header::CONTENT_LENGTH, length_value(body.len())),
    ];
    upstream
        .send_bytes_with(parts, client_headers, &set, body, stats)
        .await
}

/// A Content-Length value in one allocation of its digits: `http`'s
/// `From<usize>` builds it in a growable buffer, then a shared one (two).
fn length_value(n: usize) -> HeaderValue {
    let mut buf = [0; 20];
    let digits = crate::http1::decimal(n as u64, &mut buf);
    HeaderValue::from_bytes(digits).unwrap_or_else(|_| HeaderValue::from(n))
}

/// Books an overflow retry about to be prepared (the window bounded, the
/// retry counted and logged).
pub(super) fn begin_retry(
    chat: &ChatState,
    job: &mut worker::Job,
    mut of: Overflow,
    sent_estimate: u64,
    key: SessionKey,
) {
    bound_window(&mut of, sent_estimate);
    chat.metrics.chat.overflow_retry();
    tracing::info!(
        session = %key,
        limit = of.limit,
        requested = of.requested,
        "upstream context overflow; compacting and retrying"
    );
    job.overflow = Some(of);
}

/// An overflow error without numbers still bounds the window: what was just
/// sent (`sent_estimate` tokens) did not fit. Learning that bound makes later
/// compactions proactive instead of one overflow (and retry) every few turns.
fn bound_window(of: &mut Overflow, sent_estimate: u64) {
    if of.limit.is_none() {
        of.limit = Some(
            of.requested
                .or(of.prompt_tokens)
                .unwrap_or(sent_estimate)
                .max(1),
        );
    }
}

/// A response whose start has been read: the held frames go back in front.
pub(super) type HeldBody = crate::usage::peek::PrefixedBody<UpstreamBody>;

/// The body of a response as the client gets it: usage tapped into the
/// conversation's inbox (and the usage chunk it did not ask for hidden),
/// under the idle timeout. `headers` (the response's) lose what no longer
/// holds: hop-by-hop headers, a length the hider changes. Counts the action.
pub(super) fn finish_body(
    chat: &ChatState,
    upstream: &Upstream,
    status: http::StatusCode,
    headers: &mut HeaderMap,
    body: HeldBody,
    prepared: &Prepared,
) -> ProxyBody {
    chat.metrics.chat.action(prepared.action.as_str());
    headers::strip_hop_by_hop(headers);
    let kind = BodyKind::from_content_type(
        headers
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok()),
    );
    let success = status.is_success();
    let mut observer = UsageObserver::new(kind, |_: TapOutcome| {}).ignoring_start();
    // Error bodies carry no usage worth calibrating on.
    if success {
        let (inbox, sent) = (Arc::clone(&prepared.inbox), Arc::clone(&prepared.sent));
        let metrics = Arc::clone(&chat.metrics);
        observer = observer.on_usage(Box::new(move |report| {
            if let Some((prompt, _)) = report.prompt_tokens() {
                metrics.chat.prompt_tokens(prompt);
            }
            crate::sync::lock(&inbox).push((sent, report));
        }));
    }
    // Gathered next to the upstream's body: what the tap and the hider
    // above pass on comes back to back, and a usage chunk the hider drops
    // is not mistaken for the upstream going quiet.
    let tapped = TapBody::new(CoalesceBody::new(body), observer);
    if prepared.plan.hide_usage() && success && kind == BodyKind::Sse {
        // The hidden chunk changes the length.
        headers.remove(header::CONTENT_LENGTH);
        upstream.idle_timeout(HideUsageBody::new(tapped))
    } else {
        upstream.idle_timeout(tapped)
    }
}

/// compactor's own response headers (when exposed): what it did, the
/// session key, how many messages a record replaced.
pub(super) fn mark_head(chat: &ChatState, headers: &mut HeaderMap, prepared: &Prepared) {
    if !chat.expose_headers {
        return;
    }
    headers.insert(
        ACTION_NAME.clone(),
        HeaderValue::from_static(prepared.action.as_str()),
    );
    // Set by the preparation whenever headers are exposed.
    if let Some(v) = prepared.session_value.clone() {
        headers.insert(SESSION_NAME.clone(), v);
    }
    if prepared.replaced > 0 {
        headers.insert(REPLACED_NAME.clone(), HeaderValue::from(prepared.replaced));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn length_values_are_what_http_writes() {
        for n in [0, 7, 10, 99, 4096, 123_456_789, usize::MAX] {
            assert_eq!(length_value(n), HeaderValue::from(n), "{n}");
        }
    }
}
