//! How a summary call failed, what that means for the compaction (abort
//! or fall back) and for the cooldown, and the abort reasons it leads to.

use crate::compaction::serialize::SummaryInvalid;
use crate::compaction::summariser::{SummaryError, SummaryErrorKind};
use crate::compaction::trigger::{truncate_error_text, FailureClass};

/// Why a compaction was abandoned with the input unchanged.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AbortReason {
    /// 401/402/403 or a permanent quota marker: the credential is broken.
    AuthFailure,
    /// The summary call could not reach the provider.
    NetworkFailure,
    /// The summary was cut off (`finish_reason = length`).
    TruncatedSummary,
    /// The summary came back empty.
    EmptySummary,
    /// The provider is overloaded.
    Overloaded,
    /// `abort_on_summary_failure` is set and the summary failed.
    SummaryFailed,
    /// The deterministic fallback itself was unusable.
    FallbackInvalid,
}

/// How a summary attempt failed. Declared worst first: when several
/// failures pile up before a success, the first in this order decides
/// whether a later call aborts.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum SummaryFailureKind {
    /// Access or quota failure: the credential is broken.
    Auth,
    /// The provider could not be reached or closed the stream.
    Network,
    /// The summary was cut off.
    Truncated,
    /// The summary came back empty.
    Empty,
    /// The provider is overloaded.
    Overloaded,
    /// Anything else (timeouts, refusals, unknown models…).
    Other,
}

impl SummaryFailureKind {
    /// Whether this failure outlives its call (see
    /// [`Compressor::terminal_failure`]).
    pub fn is_terminal(self) -> bool {
        self != Self::Other
    }

    /// Telemetry class name.
    pub fn class_name(self) -> &'static str {
        match self {
            Self::Auth => "summary_auth_failure",
            Self::Network => "summary_network_failure",
            Self::Truncated => "summary_truncated_failure",
            Self::Empty => "summary_empty_content_failure",
            Self::Overloaded => "summary_overload_failure",
            Self::Other => "summary_generation_failed",
        }
    }

    /// The abort a standing failure of this kind forces. Auth/quota and
    /// network failures always abort: a fallback summary would throw the
    /// context away for a problem a retry cannot fix. Degraded summaries
    /// (truncated, empty, overloaded) abort only when configured to;
    /// otherwise the deterministic fallback takes over.
    pub fn abort_reason(self, abort_on_degraded: bool) -> Option<AbortReason> {
        match self {
            Self::Auth => Some(AbortReason::AuthFailure),
            Self::Network => Some(AbortReason::NetworkFailure),
            Self::Other => None,
            _ if !abort_on_degraded => None,
            Self::Truncated => Some(AbortReason::TruncatedSummary),
            Self::Empty => Some(AbortReason::EmptySummary),
            Self::Overloaded => Some(AbortReason::Overloaded),
        }
    }
}

/// The worse of two standing failures.
pub(super) fn worst(
    a: Option<SummaryFailureKind>,
    b: Option<SummaryFailureKind>,
) -> Option<SummaryFailureKind> {
    match (a, b) {
        (Some(x), Some(y)) => Some(x.min(y)),
        (x, None) => x,
        (None, y) => y,
    }
}

/// A failed summary attempt.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SummaryFailure {
    /// What kind of failure.
    pub kind: SummaryFailureKind,
    /// Cooldown class.
    pub class: FailureClass,
    /// Error text (≤ 220 chars).
    pub error: String,
}

impl SummaryFailure {
    pub(super) fn new(kind: SummaryFailureKind, class: FailureClass, error: &str) -> Self {
        Self {
            kind,
            class,
            error: truncate_error_text(error),
        }
    }

    pub(super) fn from_error(e: &SummaryError) -> Self {
        let info = classify_error(e);
        Self::new(info.kind, info.class, &e.to_string())
    }

    pub(super) fn invalid(inv: &SummaryInvalid) -> Self {
        let (kind, class) = match inv {
            SummaryInvalid::Empty => (SummaryFailureKind::Empty, FailureClass::EmptyContent),
            SummaryInvalid::Truncated => (SummaryFailureKind::Truncated, FailureClass::Truncated),
            SummaryInvalid::Refusal => (SummaryFailureKind::Other, FailureClass::Other),
        };
        Self::new(kind, class, &inv.to_string())
    }
}

/// A distinct summary model that failed before the main model took over.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AuxModelFailure {
    /// The summary model that failed.
    pub model: String,
    /// Its error text (≤ 220 chars).
    pub error: String,
}

/// A summary failure after classification.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FailureInfo {
    /// Cooldown class.
    pub class: FailureClass,
    /// What it means for the compaction (abort or fall back).
    pub kind: SummaryFailureKind,
}

fn lower_contains_any(hay: &str, needles: &[&str]) -> bool {
    needles.iter().any(|n| hay.contains(n))
}

/// Access/quota test: a rate limit is transient; auth
/// failures, missing keys, 401/402/403 and permanent quota markers are not.
pub fn is_access_or_quota_error(status: Option<u16>, message: &str) -> bool {
    let m = message.to_lowercase();
    let permanent_quota = lower_contains_any(
        &m,
        &[
            "insufficient_quota",
            "quota exceeded",
            "quota_exceeded",
            "out of funds",
            "out of credits",
            "out of credit",
            "out of extra usage",
        ],
    );
    // OpenAI answers an exhausted quota with 429 `insufficient_quota`: a 429
    // is a rate limit only when it carries no permanent quota marker (a
    // retry hint in the text still makes it transient).
    let rate_limited = (status == Some(429) && !permanent_quota)
        || lower_contains_any(
            &m,
            &[
                "rate limit",
                "rate_limit",
                "ratelimit",
                "too many requests",
                "retry after",
                "retry-after",
                "try again",
                "window resets",
            ],
        );
    if rate_limited {
        return false;
    }
    if lower_contains_any(
        &m,
        &[
            "no api key was found",
            "no api key found",
            "no credentials were found",
            "invalid api key",
            "invalid_api_key",
            "authentication",
            "unauthorized",
        ],
    ) {
        return true;
    }
    if matches!(status, Some(401..=403)) {
        return true;
    }
    permanent_quota
}

/// Classifies a failed summary call.
pub fn classify_error(e: &SummaryError) -> FailureInfo {
    let m = e.message.to_lowercase();
    let mut info = FailureInfo {
        class: FailureClass::Other,
        kind: SummaryFailureKind::Other,
    };
    if e.kind == SummaryErrorKind::NoProvider {
        info.class = FailureClass::NoProvider;
        return info;
    }
    if is_access_or_quota_error(e.status, &e.message) {
        info.kind = SummaryFailureKind::Auth;
        info.class = FailureClass::Auth;
        return info;
    }
    let stream_closed = e.kind == SummaryErrorKind::StreamClosed
        || lower_contains_any(
            &m,
            &[
                "incomplete chunked read",
                "peer closed",
                "unexpected eof",
                "response ended prematurely",
                "remoteprotocolerror",
            ],
        );
    if e.kind == SummaryErrorKind::Network || stream_closed {
        info.kind = SummaryFailureKind::Network;
        info.class = FailureClass::StreamClosed;
    } else if e.kind == SummaryErrorKind::Timeout
        || matches!(e.status, Some(408 | 429 | 502 | 504))
        || m.contains("timeout")
        || m.contains("timed out")
    {
        info.class = FailureClass::Timeout;
    } else if e.kind == SummaryErrorKind::Decode || m.contains("expecting value") {
        info.class = FailureClass::Decode;
    } else if lower_contains_any(&m, &["overloaded", "at capacity", "over capacity"])
        || e.status == Some(529)
    {
        info.kind = SummaryFailureKind::Overloaded;
        info.class = FailureClass::Overloaded;
    } else if matches!(e.status, Some(404 | 503))
        || lower_contains_any(
            &m,
            &[
                "model_not_found",
                "model not found",
                "does not exist",
                "no available channel",
            ],
        )
    {
        info.class = FailureClass::ModelNotFound;
    }
    info
}

#[cfg(test)]
mod tests {
    use super::*;

    fn err(kind: SummaryErrorKind, status: Option<u16>, msg: &str) -> FailureInfo {
        classify_error(&SummaryError::new(kind, status, msg))
    }

    #[test]
    fn access_and_quota_classification() {
        assert!(is_access_or_quota_error(Some(401), "bad key"));
        assert!(is_access_or_quota_error(Some(403), "forbidden"));
        assert!(is_access_or_quota_error(None, "insufficient_quota"));
        assert!(is_access_or_quota_error(
            Some(400),
            "You are out of credits"
        ));
        assert!(!is_access_or_quota_error(Some(429), "rate limit reached"));
        assert!(is_access_or_quota_error(
            Some(429),
            "HTTP 429 insufficient_quota: You exceeded your current quota, please check your plan and billing details."
        ));
        assert!(!is_access_or_quota_error(
            Some(402),
            "quota exceeded, retry after 60s"
        ));
        assert!(!is_access_or_quota_error(Some(500), "internal error"));
    }

    #[test]
    fn failure_classes_and_terminal_flags() {
        use SummaryErrorKind::*;
        assert_eq!(err(NoProvider, None, "x").class, FailureClass::NoProvider);
        let t = err(Timeout, None, "deadline");
        assert_eq!(t.class, FailureClass::Timeout);
        assert_eq!(t.kind, SummaryFailureKind::Other);
        assert_eq!(err(Http, Some(504), "gateway").class, FailureClass::Timeout);
        assert_eq!(
            err(Http, None, "request timed out").class,
            FailureClass::Timeout
        );
        assert_eq!(err(Decode, None, "bad body").class, FailureClass::Decode);
        let n = err(Network, None, "connection refused");
        assert_eq!(n.kind, SummaryFailureKind::Network);
        assert_eq!(n.class, FailureClass::StreamClosed);
        assert_eq!(
            err(Http, None, "peer closed connection without sending").kind,
            SummaryFailureKind::Network
        );
        let o = err(Http, Some(529), "Overloaded");
        assert_eq!(o.kind, SummaryFailureKind::Overloaded);
        assert_eq!(
            err(Http, Some(404), "no such model").class,
            FailureClass::ModelNotFound
        );
        assert_eq!(err(Http, Some(500), "boom").class, FailureClass::Other);
        assert_eq!(err(Http, Some(401), "nope").kind, SummaryFailureKind::Auth);
    }
}
