//! One failed summary call: its classification by status and error type.

use super::*;

fn err(kind: SummaryErrorKind, status: Option<u16>, msg: &str) -> SummaryFailure {
    SummaryFailure::new(kind, status, msg)
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
fn typed_error_bodies_classify_without_their_words() {
    let typed = |status, t: &str, c: Option<&str>| {
        SummaryFailure::http_error(status, "x", Some(t.into()), c.map(Into::into))
    };
    let quota = typed(429, "insufficient_quota", Some("insufficient_quota"));
    assert_eq!(quota.kind, SummaryFailureKind::Auth);
    assert!(quota.is_access_or_quota());
    let limited = typed(429, "requests", Some("rate_limit_exceeded"));
    assert_eq!(limited.kind, SummaryFailureKind::Other);
    assert_eq!(limited.class, FailureClass::Timeout);
    assert!(!limited.is_access_or_quota());
    // A rate limit under a status that would otherwise be an auth failure.
    assert_eq!(
        typed(403, "rate_limit_error", None).kind,
        SummaryFailureKind::Other
    );
    assert_eq!(
        typed(400, "invalid_request_error", Some("invalid_api_key")).kind,
        SummaryFailureKind::Auth
    );
    let over = typed(529, "overloaded_error", None);
    assert_eq!(over.kind, SummaryFailureKind::Overloaded);
    assert_eq!(
        typed(400, "invalid_request_error", Some("model_not_found")).class,
        FailureClass::ModelNotFound
    );
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
        err(Http, Some(408), "request timed out").class,
        FailureClass::Timeout
    );
    assert_eq!(err(Decode, None, "bad body").class, FailureClass::Decode);
    let n = err(Network, None, "connection refused");
    assert_eq!(n.kind, SummaryFailureKind::Network);
    assert_eq!(n.class, FailureClass::StreamClosed);
    assert_eq!(
        err(StreamClosed, None, "peer closed connection without sending").kind,
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
    let empty = SummaryFailure::invalid(&SummaryInvalid::Empty);
    assert_eq!(
        (empty.kind, empty.class),
        (SummaryFailureKind::Empty, FailureClass::EmptyContent)
    );
    let cut = SummaryFailure::invalid(&SummaryInvalid::Truncated);
    assert_eq!(cut.class, FailureClass::Truncated);
    assert_eq!(
        SummaryFailure::invented_user().kind,
        SummaryFailureKind::Other
    );
}

const MISSING_KEY: &str = "Provider 'opencode-zen' is set in config.yaml but no API key was found. Set the OPENCODE-ZEN_API_KEY environment variable, or switch to a different provider with hermes model.";

#[test]
fn missing_provider_api_key_is_terminal_access_failure() {
    assert!(is_access_or_quota_error(None, MISSING_KEY));
}
