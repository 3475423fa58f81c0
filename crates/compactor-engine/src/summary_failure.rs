//! One failed summary call, described once: where it failed, what the
//! upstream said (HTTP status, the OpenAI error `type` and `code`, its
//! message) and, classified when the failure is built, what it means for
//! the compaction ([`SummaryFailureKind`]) and for the cooldown
//! ([`FailureClass`]).
//!
//! Classification reads the typed parts first: the transport category,
//! the status and the error `type`/`code` that OpenAI-compatible and
//! Anthropic upstreams put in their error bodies. The message is read only
//! for the few answers whose meaning real upstreams give in words alone
//! (the `words` module below, each check with the upstream it is for).

use crate::serialize::SummaryInvalid;

/// Why a summary attempt failed, for choosing its cooldown.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum FailureClass {
    /// No summary provider configured: 600 s.
    NoProvider,
    /// HTTP 408/429/502/504 or a timeout: 60 → 300 → 900 s ladder.
    Timeout,
    /// `finish_reason = length`: the same ladder on its own counter.
    Truncated,
    /// Progress-aware host stall: the timeout ladder rung, at least 120 s.
    // No failure is classified so today (a stalled summariser ends in a
    // timeout); the ladder keeps its rung, which a test pins.
    #[allow(dead_code)]
    HostStall,
    /// Response body was not JSON: 30 s.
    Decode,
    /// Stream or connection closed early: 30 s.
    StreamClosed,
    /// Empty summary content: 30 s.
    EmptyContent,
    /// Access or quota failure (the compressor aborts): 60 s.
    Auth,
    /// Model not found (on the main model already): 60 s.
    ModelNotFound,
    /// Provider overloaded: 60 s.
    Overloaded,
    /// Anything else transient: 60 s.
    Other,
}

/// Stored error texts are cut to this many characters (217 + "...").
pub(crate) const ERROR_TEXT_MAX_CHARS: usize = 220;

/// Cut an error text to 220 characters (217 + "...").
pub(crate) fn truncate_error_text(err: &str) -> String {
    if err.chars().count() <= ERROR_TEXT_MAX_CHARS {
        return err.to_owned();
    }
    let mut s: String = err.chars().take(ERROR_TEXT_MAX_CHARS - 3).collect();
    s.push_str("...");
    s
}

/// Where a summary call failed: on the way to the summariser or back
/// (transport), or in what it answered (the reply).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SummaryErrorKind {
    /// The upstream answered with an HTTP error status.
    Http,
    /// Connection refused / reset / DNS: nothing usable came back.
    Network,
    /// The call timed out.
    Timeout,
    /// The body was not the JSON we expected (e.g. an HTML 502 page).
    Decode,
    /// The connection closed before the body was complete.
    StreamClosed,
    /// No summary provider is configured at all.
    NoProvider,
    /// A reply came back but cannot become a summary.
    Reply(SummaryInvalid),
    /// A reply attributed words to a user in a session without user turns.
    InventedUser,
}

/// What a failed summary call means for the compaction. Declared worst
/// first: when several failures pile up before a success, the first in
/// this order decides whether a later call aborts.
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
    /// [`crate::Compressor::terminal_failure`]).
    pub(crate) fn is_terminal(self) -> bool {
        self != Self::Other
    }

    /// Telemetry class name.
    pub(crate) fn class_name(self) -> &'static str {
        match self {
            Self::Auth => "summary_auth_failure",
            Self::Network => "summary_network_failure",
            Self::Truncated => "summary_truncated_failure",
            Self::Empty => "summary_empty_content_failure",
            Self::Overloaded => "summary_overload_failure",
            Self::Other => "summary_generation_failed",
        }
    }
}

/// A failed summary call.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct SummaryFailure {
    /// What it means for the compaction (abort or fall back).
    pub(crate) kind: SummaryFailureKind,
    /// Cooldown class.
    pub(crate) class: FailureClass,
    /// Where it failed.
    pub(crate) origin: SummaryErrorKind,
    /// HTTP status, when there was one.
    pub(crate) status: Option<u16>,
    /// The error body's `error.type` (OpenAI, Anthropic), when it had one.
    pub(crate) error_type: Option<String>,
    /// The error body's `error.code` (OpenAI), when it had one.
    pub(crate) code: Option<String>,
    /// Provider or transport message (never contains conversation content).
    pub(crate) message: String,
    /// The message as recorded and shown (≤ 220 chars).
    pub(crate) error: String,
}

impl SummaryFailure {
    /// What it means for the compaction (abort or fall back).
    pub fn kind(&self) -> SummaryFailureKind {
        self.kind
    }

    /// Where it failed.
    pub fn origin(&self) -> SummaryErrorKind {
        self.origin
    }

    /// The message as recorded and shown (≤ 220 chars).
    pub fn error(&self) -> &str {
        &self.error
    }

    /// A failure of the given origin, classified.
    pub fn new(origin: SummaryErrorKind, status: Option<u16>, message: impl Into<String>) -> Self {
        Self::classified(origin, status, None, None, message.into())
    }

    /// An HTTP error with a status code and no typed error body.
    pub fn http(status: u16, message: impl Into<String>) -> Self {
        Self::new(SummaryErrorKind::Http, Some(status), message)
    }

    /// An HTTP error answer with the `type` and `code` of its error body.
    pub fn http_error(
        status: u16,
        message: impl Into<String>,
        error_type: Option<String>,
        code: Option<String>,
    ) -> Self {
        let origin = SummaryErrorKind::Http;
        Self::classified(origin, Some(status), error_type, code, message.into())
    }

    /// A reply that cannot become a summary.
    pub(crate) fn invalid(inv: &SummaryInvalid) -> Self {
        Self::new(SummaryErrorKind::Reply(*inv), None, inv.to_string())
    }

    /// A reply that attributed words to a user the session does not have.
    pub(crate) fn invented_user() -> Self {
        Self::new(
            SummaryErrorKind::InventedUser,
            None,
            "summary attributed text to a user in a session without user turns",
        )
    }

    fn classified(
        origin: SummaryErrorKind,
        status: Option<u16>,
        error_type: Option<String>,
        code: Option<String>,
        message: String,
    ) -> Self {
        let codes = [error_type.as_deref(), code.as_deref()];
        let (kind, class) = classify(origin, status, &codes, &message);
        Self {
            kind,
            class,
            origin,
            status,
            error_type,
            code,
            error: truncate_error_text(&message),
            message,
        }
    }

    /// Whether the upstream refused the credential or its quota for good
    /// (see [`is_access_or_quota_error`]).
    // Only tests use it: the pass reads the failure's kind.
    #[cfg(test)]
    pub(crate) fn is_access_or_quota(&self) -> bool {
        let codes = [self.error_type.as_deref(), self.code.as_deref()];
        access_or_quota(self.status, &codes, &self.message)
    }
}

/// Error `type`/`code` values of an exhausted quota or balance (OpenAI's
/// 429 `insufficient_quota`, Anthropic's `billing_error`).
const QUOTA_CODES: &[&str] = &["insufficient_quota", "billing_error", "quota_exceeded"];
/// Rate limits: transient, whatever the status.
const RATE_LIMIT_CODES: &[&str] = &["rate_limit_exceeded", "rate_limit_error"];
/// A rejected or missing credential.
const AUTH_CODES: &[&str] = &[
    "invalid_api_key",
    "authentication_error",
    "permission_error",
    "permission_denied",
];
/// The provider is overloaded (Anthropic's 529 `overloaded_error`).
const OVERLOAD_CODES: &[&str] = &["overloaded_error", "overloaded"];
/// The model does not exist here.
const NOT_FOUND_CODES: &[&str] = &["model_not_found", "not_found_error"];

fn has_code(codes: &[Option<&str>], wanted: &[&str]) -> bool {
    codes.iter().flatten().any(|c| wanted.contains(c))
}

/// What a failure means, from its origin, status, error codes and, where
/// upstreams say it only in words, its message.
fn classify(
    origin: SummaryErrorKind,
    status: Option<u16>,
    codes: &[Option<&str>],
    message: &str,
) -> (SummaryFailureKind, FailureClass) {
    use SummaryErrorKind as O;
    use SummaryFailureKind as K;
    match origin {
        O::NoProvider => return (K::Other, FailureClass::NoProvider),
        O::Reply(SummaryInvalid::Empty) => return (K::Empty, FailureClass::EmptyContent),
        O::Reply(SummaryInvalid::Truncated) => return (K::Truncated, FailureClass::Truncated),
        O::Reply(SummaryInvalid::Refusal | SummaryInvalid::Echo) | O::InventedUser => {
            return (K::Other, FailureClass::Other)
        }
        _ => {}
    }
    if access_or_quota(status, codes, message) {
        return (K::Auth, FailureClass::Auth);
    }
    if matches!(origin, O::Network | O::StreamClosed) {
        (K::Network, FailureClass::StreamClosed)
    } else if origin == O::Timeout || matches!(status, Some(408 | 429 | 502 | 504)) {
        (K::Other, FailureClass::Timeout)
    } else if origin == O::Decode {
        (K::Other, FailureClass::Decode)
    } else if status == Some(529) || has_code(codes, OVERLOAD_CODES) || words::overloaded(message) {
        (K::Overloaded, FailureClass::Overloaded)
    } else if matches!(status, Some(404 | 503)) || has_code(codes, NOT_FOUND_CODES) {
        (K::Other, FailureClass::ModelNotFound)
    } else {
        (K::Other, FailureClass::Other)
    }
}

/// Access/quota test: a rate limit is transient; a rejected or missing
/// credential, 401/402/403 and an exhausted quota are not.
fn access_or_quota(status: Option<u16>, codes: &[Option<&str>], message: &str) -> bool {
    let permanent_quota = has_code(codes, QUOTA_CODES) || words::out_of_credit(message);
    // OpenAI answers an exhausted quota with 429 `insufficient_quota`: a 429
    // is a rate limit only when it is not that (a retry hint in the text
    // still makes it transient).
    let rate_limited = (status == Some(429) && !permanent_quota)
        || has_code(codes, RATE_LIMIT_CODES)
        || words::retry_hint(message);
    if rate_limited {
        return false;
    }
    if has_code(codes, AUTH_CODES) || words::no_credential(message) {
        return true;
    }
    if matches!(status, Some(401..=403)) {
        return true;
    }
    permanent_quota
}

/// Access/quota test of an error known only by its status and message
/// (error bodies carry their `type`/`code` in [`SummaryFailure`]): an
/// error code written into the message (`HTTP 429 insufficient_quota: …`,
/// the form the proxy's summariser reports) counts as that code.
// Only the ported tests use it: a failure is classified from its status and error
// body (`SummaryFailure::is_access_or_quota`).
#[cfg(test)]
pub(crate) fn is_access_or_quota_error(status: Option<u16>, message: &str) -> bool {
    let code = message
        .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .find(|w| {
            [QUOTA_CODES, RATE_LIMIT_CODES, AUTH_CODES]
                .iter()
                .any(|set| set.contains(w))
        });
    access_or_quota(status, &[code], message)
}

/// The message checks that stay: each covers answers whose meaning real
/// upstreams give only in words (no telling status, no error code).
mod words {
    fn any(message: &str, needles: &[&str]) -> bool {
        let m = message.to_lowercase();
        needles.iter().any(|n| m.contains(n))
    }

    /// An exhausted balance: Anthropic answers a used-up Claude
    /// subscription with a 400 `invalid_request_error` saying "out of extra
    /// usage"; credit-based gateways answer 400 or 402 "out of credits" /
    /// "out of funds" with no code of their own.
    pub(super) fn out_of_credit(message: &str) -> bool {
        any(
            message,
            &["out of funds", "out of credit", "out of extra usage"],
        )
    }

    /// A refusal that passes: windowed plans answer 402/403 with "retry
    /// after" or "the window resets" in the text and no rate-limit code or
    /// 429; some gateways say "rate limit" under other statuses.
    pub(super) fn retry_hint(message: &str) -> bool {
        any(
            message,
            &[
                "rate limit",
                "ratelimit",
                "too many requests",
                "retry after",
                "retry-after",
                "try again",
                "window resets",
            ],
        )
    }

    /// A missing or rejected key reported without a 401: gateways and
    /// provider wrappers that check the key before calling the model answer
    /// in words ("no API key was found", "invalid api key"), some with a
    /// 400 or no status at all.
    pub(super) fn no_credential(message: &str) -> bool {
        any(
            message,
            &[
                "no api key was found",
                "no api key found",
                "no credentials were found",
                "invalid api key",
            ],
        )
    }

    /// Overload: OpenAI answers it with a 503 `server_error` whose only
    /// telling part is the wording ("currently overloaded", "at capacity").
    pub(super) fn overloaded(message: &str) -> bool {
        any(message, &["overloaded", "at capacity", "over capacity"])
    }
}

#[cfg(test)]
mod tests;
