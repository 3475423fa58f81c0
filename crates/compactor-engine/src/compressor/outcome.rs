//! What a pass returns: the result of a batch compaction or a micro pass,
//! its outcome class and its content-free accounting. It needs only the
//! failure a result carries, so every step (the instruction pinning and the
//! micro pass included) can build one without importing another step.

use serde_json::Value;

use super::failure::{AbortReason, AuxModelFailure};
use crate::summary_failure::SummaryFailure;

/// Why nothing was compacted (a structural no-op, not a failure).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NoOpReason {
    /// Too few rows after the head.
    InsufficientMessages,
    /// The tail covers everything after the head.
    NoCompressibleWindow,
    /// The window held only earlier summaries.
    EmptyPostHandoffWindow,
    /// A micro pass found no complete exchange to absorb.
    NothingToAbsorb,
}

impl NoOpReason {
    /// Telemetry name.
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Self::InsufficientMessages => "insufficient_messages",
            Self::NoCompressibleWindow => "no_compressible_window",
            Self::EmptyPostHandoffWindow => "empty_post_handoff_window",
            Self::NothingToAbsorb => "nothing_to_absorb",
        }
    }
}

/// Result class of a `compress` call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// A smaller conversation was produced.
    Compacted,
    /// The summary failed in a way that must not lose context.
    Aborted(AbortReason),
    /// Nothing to compact.
    NoOp(NoOpReason),
    /// The candidate was not smaller than the input, even after salvage.
    Rejected,
}

/// Content-free accounting of one attempt (one log line's worth).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct CompressTelemetry {
    /// Rows in the input.
    pub(crate) messages_before: usize,
    /// Rows in the output.
    pub(crate) messages_after: usize,
    /// Protected head rows.
    pub(crate) head_rows: usize,
    /// Estimated tokens of the summarised middle.
    pub(crate) middle_tokens: u64,
    /// Rows changed by the pruning passes.
    pub(crate) pruned_rows: usize,
    /// Summary calls made (including a retry on the main model).
    pub(crate) summary_calls: u32,
    /// Chunks the middle was summarised in (1 = a single prompt).
    pub(crate) chunk_count: usize,
    /// Rows the last resort shortened to make the request fit (0 = none).
    pub(crate) last_resort_rows: usize,
    /// Rows of the oldest exchanges the last resort dropped when even
    /// shortening could not fit the window.
    pub(crate) last_resort_dropped: usize,
    /// Failure class name, when the attempt did not go cleanly.
    pub(crate) failure_class: Option<&'static str>,
    /// The caller's token figure, if given.
    pub(crate) current_tokens: Option<u64>,
}

/// What `compress` (or a micro pass) produced.
#[derive(Clone, Debug, PartialEq)]
pub struct CompressResult {
    /// The conversation to send (the input itself unless `Compacted`).
    pub(crate) messages: Vec<Value>,
    /// Result class.
    pub(crate) outcome: Outcome,
    /// Index of the row carrying the summary.
    pub(crate) summary_index: Option<usize>,
    /// The deterministic fallback summary was used.
    pub(crate) fallback_used: bool,
    /// The LLM call was skipped by the feasibility check.
    pub(crate) feasibility_skip: bool,
    /// Rows of the input that went into the summary.
    pub(crate) dropped_count: usize,
    /// Rough estimate of the input.
    pub(crate) tokens_before: u64,
    /// Rough estimate of `messages`.
    pub(crate) tokens_after: u64,
    /// How many trailing input rows `messages` ends with unchanged: the
    /// output is `replacement + input[input.len() - kept_suffix..]`.
    pub(crate) kept_suffix: usize,
    /// This call's failed summary attempt, if it made one that failed.
    pub(crate) summary_failure: Option<SummaryFailure>,
    /// A distinct summary model failed in this call and the main model
    /// took over (the caller may want to warn about the configuration).
    pub(crate) aux_model_failure: Option<AuxModelFailure>,
    /// What a micro pass did (`None` for a batch compaction).
    pub(crate) micro: Option<MicroPass>,
    /// Content-free accounting.
    pub(crate) telemetry: CompressTelemetry,
}

impl CompressTelemetry {
    /// Rows the last resort shortened to make the request fit (0 = none).
    pub fn last_resort_rows(&self) -> usize {
        self.last_resort_rows
    }

    /// Rows of the oldest exchanges the last resort dropped when even
    /// shortening could not fit the window.
    pub fn last_resort_dropped(&self) -> usize {
        self.last_resort_dropped
    }
}

// Read-only: a result is what one pass decided, so nothing outside the
// engine builds or edits one.
impl CompressResult {
    /// The conversation to send (the input itself unless `Compacted`).
    pub fn messages(&self) -> &[Value] {
        &self.messages
    }

    /// The conversation to send, owned.
    pub fn into_messages(self) -> Vec<Value> {
        self.messages
    }

    /// Result class.
    pub fn outcome(&self) -> Outcome {
        self.outcome
    }

    /// Index of the row carrying the summary.
    pub fn summary_index(&self) -> Option<usize> {
        self.summary_index
    }

    /// The deterministic fallback summary was used.
    pub fn fallback_used(&self) -> bool {
        self.fallback_used
    }

    /// The LLM call was skipped by the feasibility check.
    pub fn feasibility_skip(&self) -> bool {
        self.feasibility_skip
    }

    /// Rows of the input that went into the summary.
    pub fn dropped_count(&self) -> usize {
        self.dropped_count
    }

    /// Rough estimate of the input.
    pub fn tokens_before(&self) -> u64 {
        self.tokens_before
    }

    /// Rough estimate of `messages`.
    pub fn tokens_after(&self) -> u64 {
        self.tokens_after
    }

    /// How many trailing input rows `messages` ends with unchanged: the
    /// output is `replacement + input[input.len() - kept_suffix..]`.
    pub fn kept_suffix(&self) -> usize {
        self.kept_suffix
    }

    /// This call's failed summary attempt, if it made one that failed.
    pub fn summary_failure(&self) -> Option<&SummaryFailure> {
        self.summary_failure.as_ref()
    }

    /// A distinct summary model failed in this call and the main model
    /// took over (the caller may want to warn about the configuration).
    pub fn aux_model_failure(&self) -> Option<&AuxModelFailure> {
        self.aux_model_failure.as_ref()
    }

    /// What a micro pass did (`None` for a batch compaction).
    pub fn micro_outcome(&self) -> Option<MicroOutcome> {
        self.micro.as_ref().map(|m| m.outcome)
    }

    /// A micro pass's accounting (`None` for a batch compaction or a no-op).
    pub fn micro_telemetry(&self) -> Option<&MicroTelemetry> {
        self.micro.as_ref().and_then(|m| m.telemetry.as_ref())
    }

    /// Content-free accounting.
    pub fn telemetry(&self) -> &CompressTelemetry {
        &self.telemetry
    }

    /// Why the call was abandoned, if it was.
    pub fn abort_reason(&self) -> Option<AbortReason> {
        match self.outcome {
            Outcome::Aborted(r) => Some(r),
            _ => None,
        }
    }

    /// Whether a smaller conversation was committed.
    // Only tests use it: the proxy matches the outcome.
    #[cfg(test)]
    pub(crate) fn made_progress(&self) -> bool {
        self.outcome == Outcome::Compacted
    }

    /// Short name of what happened, for metrics and log lines.
    pub fn label(&self) -> &'static str {
        if let Some(m) = &self.micro {
            return m.outcome.as_str();
        }
        match self.outcome {
            Outcome::Compacted => "compacted",
            Outcome::Aborted(_) => "aborted",
            Outcome::NoOp(_) => "noop",
            Outcome::Rejected => "rejected",
        }
    }
}

/// Number of trailing rows `a` and `b` share (the `kept_suffix` of a result).
pub(super) fn common_suffix(a: &[Value], b: &[Value]) -> usize {
    a.iter()
        .rev()
        .zip(b.iter().rev())
        .take_while(|(x, y)| x == y)
        .count()
}

/// What one micro pass did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MicroOutcome {
    /// One exchange was absorbed into the rolling summary.
    Absorbed,
    /// Nothing to do (disabled, too short, no complete exchange).
    NoOp,
    /// Only the rolling summary was rewritten compactly.
    Defrag,
    /// The defrag call failed; the old summary was kept.
    DefragFailed,
    /// The summary call failed; the next pass retries.
    SummarizeFailed,
    /// The exchange failed repeatedly and was skipped.
    ExchangeSkipped,
}

impl MicroOutcome {
    /// Telemetry name.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Absorbed => "absorbed",
            Self::NoOp => "noop",
            Self::Defrag => "defrag",
            Self::DefragFailed => "defrag_failed",
            Self::SummarizeFailed => "summarize_failed",
            Self::ExchangeSkipped => "exchange_skipped",
        }
    }
}

/// Content-free accounting of one micro pass (one JSON log line).
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct MicroTelemetry {
    /// Always `"micro_compaction"`.
    pub event: &'static str,
    /// What the pass did.
    pub outcome: &'static str,
    /// Rows before.
    pub(crate) messages_before: usize,
    /// Rows after.
    pub messages_after: usize,
    /// Rough tokens before.
    pub(crate) tokens_before: u64,
    /// Rough tokens after.
    pub tokens_after: u64,
    /// `after − before` (negative = shrank).
    pub tokens_delta: i64,
    /// Tokens of the absorbed exchange.
    pub exchange_tokens: u64,
    /// Tokens of the rolling summary.
    pub(crate) rolling_summary_tokens: u64,
    /// Cursor after the pass.
    pub(crate) cursor: Option<usize>,
    /// Absorbing passes so far.
    pub passes_total: u32,
    /// Tokens saved so far.
    pub tokens_saved_total: i64,
    /// Cached trigger threshold; `None` when the window is not resolved yet
    /// (telemetry never forces a window probe).
    pub threshold_tokens: Option<u64>,
    /// Cached context window.
    pub(crate) context_limit: Option<u64>,
    /// `tokens_after / threshold × 100`, when the threshold is cached.
    pub occupancy_pct: Option<f64>,
}

/// What a micro pass did, carried by its [`CompressResult`].
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct MicroPass {
    /// What happened.
    pub(crate) outcome: MicroOutcome,
    /// The pass's accounting (`None` for a no-op).
    pub(crate) telemetry: Option<MicroTelemetry>,
}
