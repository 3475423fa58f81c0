//! What a pass returns: the result of a batch compaction or a micro pass,
//! its outcome class and its content-free accounting. It needs only the
//! failure a result carries, so every step (the instruction pinning and the
//! micro pass included) can build one without importing another step.

use serde_json::Value;

use super::failure::{AbortReason, AuxModelFailure};
use crate::compaction::summary_failure::SummaryFailure;

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
    pub last_resort_rows: usize,
    /// Rows of the oldest exchanges the last resort dropped when even
    /// shortening could not fit the window.
    pub last_resort_dropped: usize,
    /// Failure class name, when the attempt did not go cleanly.
    pub(crate) failure_class: Option<&'static str>,
    /// The caller's token figure, if given.
    pub(crate) current_tokens: Option<u64>,
}

/// What `compress` (or a micro pass) produced.
#[derive(Clone, Debug, PartialEq)]
pub struct CompressResult {
    /// The conversation to send (the input itself unless `Compacted`).
    pub messages: Vec<Value>,
    /// Result class.
    pub outcome: Outcome,
    /// Index of the row carrying the summary.
    pub summary_index: Option<usize>,
    /// The deterministic fallback summary was used.
    pub fallback_used: bool,
    /// The LLM call was skipped by the feasibility check.
    pub feasibility_skip: bool,
    /// Rows of the input that went into the summary.
    pub dropped_count: usize,
    /// Rough estimate of the input.
    pub tokens_before: u64,
    /// Rough estimate of `messages`.
    pub tokens_after: u64,
    /// How many trailing input rows `messages` ends with unchanged: the
    /// output is `replacement + input[input.len() - kept_suffix..]`.
    pub kept_suffix: usize,
    /// This call's failed summary attempt, if it made one that failed.
    pub summary_failure: Option<SummaryFailure>,
    /// A distinct summary model failed in this call and the main model
    /// took over (the caller may want to warn about the configuration).
    pub aux_model_failure: Option<AuxModelFailure>,
    /// What a micro pass did (`None` for a batch compaction).
    pub micro: Option<MicroPass>,
    /// Content-free accounting.
    pub telemetry: CompressTelemetry,
}

impl CompressResult {
    /// Why the call was abandoned, if it was.
    pub fn abort_reason(&self) -> Option<AbortReason> {
        match self.outcome {
            Outcome::Aborted(r) => Some(r),
            _ => None,
        }
    }

    /// Whether a smaller conversation was committed.
    pub fn made_progress(&self) -> bool {
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
pub fn common_suffix(a: &[Value], b: &[Value]) -> usize {
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
    pub(crate) fn as_str(self) -> &'static str {
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
pub struct MicroPass {
    /// What happened.
    pub outcome: MicroOutcome,
    /// The pass's accounting (`None` for a no-op).
    pub telemetry: Option<MicroTelemetry>,
}
