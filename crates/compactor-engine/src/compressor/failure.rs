//! What a failed summary call forbids: the abort reasons of a compaction
//! and the standing failure that outlives its call. The failure itself,
//! and its classification, is [`crate::summary_failure`].

use crate::summary_failure::SummaryFailureKind;

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

// The abort policy is the compressor's, so it is written here, next to the
// reasons it returns, rather than with the failure kinds.
impl SummaryFailureKind {
    /// The abort a standing failure of this kind forces. Auth/quota and
    /// network failures always abort: a fallback summary would throw the
    /// context away for a problem a retry cannot fix. Degraded summaries
    /// (truncated, empty, overloaded) abort only when configured to;
    /// otherwise the deterministic fallback takes over.
    pub(crate) fn abort_reason(self, abort_on_degraded: bool) -> Option<AbortReason> {
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

/// A distinct summary model that failed before the main model took over.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AuxModelFailure {
    /// The summary model that failed.
    pub(crate) model: String,
    /// Its error text (≤ 220 chars).
    pub(crate) error: String,
}

impl AuxModelFailure {
    /// The summary model that failed.
    pub fn model(&self) -> &str {
        &self.model
    }

    /// Its error text (≤ 220 chars).
    pub fn error(&self) -> &str {
        &self.error
    }
}
