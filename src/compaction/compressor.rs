//! The compress pipeline: head protection, tool-output pruning, tail cut,
//! handoff rehydration, summary generation with failure handling, assembly,
//! sanitising and the final size check.
//!
//! A compaction either commits (a strictly smaller conversation) or leaves
//! the input exactly as it was: aborted, no-op and rejected results return the
//! input messages unchanged. The phases only decide; the compressor's own
//! state (running summary, cooldowns, counters, the standing failure) is
//! changed once, at the end, according to the outcome, so no early return
//! needs a rollback.

use std::sync::Arc;

use serde_json::Value;

use super::assemble;
use super::config::CompactionConfig;
use super::fallback::{build_fallback_body_capped, build_fallback_summary};
use super::instructions::is_instructions;
use super::last_resort::Fit;
use super::markers::{self, Handoff};
use super::micro::{MicroPass, MicroState};
use super::prune::{self, PruneParams};
use super::redact::redact_secrets;
use super::sanitize::sanitize_tool_pairs;
use super::serialize::{
    self, bound_summary_input, build_summary_prompt, chunk_for_budget, serialize_for_summary,
    PromptParts, SummaryInvalid, SUMMARY_INPUT_MAX_CHARS,
};
use super::summariser::{Summariser, SummaryError, SummaryErrorKind, SummaryReply, SummaryRequest};
use super::tail::{self, TailParams};
use super::tokens;
use super::trigger::{truncate_error_text, FailureClass, Trigger};
use super::truncated;
use super::user_messages;
use super::view;

/// Rows after the head a conversation needs before it is worth compacting.
pub const MIN_ROWS_AFTER_HEAD: usize = 4;
/// Extra rows after `protect_first_n` probed for an earlier handoff.
pub const HANDOFF_PROBE_EXTRA: usize = 4;
/// Feasibility skip: the middle must be under this share of the threshold.
pub const FEASIBILITY_MIDDLE_RATIO: f64 = 0.10;
/// Most summary calls one compaction makes when it has to chunk.
pub const MAX_SUMMARY_CHUNKS: usize = 8;
/// Salvage caps a standalone summary at this many characters.
pub const SALVAGE_SUMMARY_MAX_CHARS: usize = 8_000;
/// Salvage keeps this many newest tool bodies.
pub const SALVAGE_KEEP_TOOL_RESULTS: usize = 2;
/// Auto focus: this many newest user turns…
pub const AUTO_FOCUS_TURNS: usize = 3;
/// …each clipped to this many characters…
pub const AUTO_FOCUS_TURN_CHARS: usize = 260;
/// …and this many in total.
pub const AUTO_FOCUS_TOTAL_CHARS: usize = 700;

/// Options of one `compress` call.
#[derive(Clone, Debug, Default)]
pub struct CompressOptions {
    /// Manual or overflow-forced compaction: clears the cooldown and the
    /// structural backoff, and never takes the feasibility skip.
    pub force: bool,
    /// The caller's token figure for the request (telemetry only).
    pub current_tokens: Option<u64>,
    /// Run the summary call even during a cooldown, without clearing it
    /// (provider-proven overflow recovery).
    pub bypass_cooldown: bool,
    /// What the summary should focus on.
    pub focus_topic: Option<String>,
    /// Today's date (`YYYY-MM-DD`) for temporal anchoring in the summary
    /// prompt; the engine has no clock of its own.
    pub today: Option<String>,
    /// Rough tokens the messages must fit into to be sent at all (window
    /// minus reply reservation and tools). When the call leaves them larger
    /// (nothing to compact, or not enough), the largest messages are
    /// shortened as a last resort ([`super::last_resort`]).
    pub fit_tokens: Option<u64>,
    /// How firmly the last resort aims at `fit_tokens`.
    pub fit: Fit,
    /// Rough tokens a compacted result's messages should settle under (the
    /// caller's mark between the compaction target and the trigger): a
    /// result above it would be compacted again on the next turn, so its
    /// largest messages are shortened in the same pass when that reaches
    /// it ([`super::last_resort`]).
    pub settle_tokens: Option<u64>,
}

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
    pub fn as_str(self) -> &'static str {
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
    pub messages_before: usize,
    /// Rows in the output.
    pub messages_after: usize,
    /// Protected head rows.
    pub head_rows: usize,
    /// Estimated tokens of the summarised middle.
    pub middle_tokens: u64,
    /// Rows changed by the pruning passes.
    pub pruned_rows: usize,
    /// Summary calls made (including a retry on the main model).
    pub summary_calls: u32,
    /// Chunks the middle was summarised in (1 = a single prompt).
    pub chunk_count: usize,
    /// Rows the last resort shortened to make the request fit (0 = none).
    pub last_resort_rows: usize,
    /// Rows of the oldest exchanges the last resort dropped when even
    /// shortening could not fit the window.
    pub last_resort_dropped: usize,
    /// Failure class name, when the attempt did not go cleanly.
    pub failure_class: Option<&'static str>,
    /// The caller's token figure, if given.
    pub current_tokens: Option<u64>,
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
fn worst(
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
    fn new(kind: SummaryFailureKind, class: FailureClass, error: &str) -> Self {
        Self {
            kind,
            class,
            error: truncate_error_text(error),
        }
    }

    fn from_error(e: &SummaryError) -> Self {
        let info = classify_error(e);
        Self::new(info.kind, info.class, &e.to_string())
    }

    fn invalid(inv: &SummaryInvalid) -> Self {
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

/// One summary generation: the summary, or how it failed, and what it cost.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SummaryAttempt {
    /// The summary to place (prefix and body), when it succeeded.
    pub summary: Option<String>,
    /// Its body alone: the next running summary.
    pub body: Option<String>,
    /// The failure, when it failed. Neither this nor `summary` is set when
    /// a live cooldown held the call.
    pub failure: Option<SummaryFailure>,
    /// A distinct summary model failed and the main model was tried.
    pub aux_model_failure: Option<AuxModelFailure>,
    /// Summary calls made (including a retry on the main model).
    pub calls: u32,
    /// Chunks the input was summarised in.
    pub chunks: usize,
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

/// Text of a reply's content (string or list of text parts).
fn reply_text(reply: &SummaryReply) -> Option<String> {
    match reply.content.as_ref()? {
        Value::Null => None,
        Value::String(s) => Some(s.clone()),
        other => Some(view::content_text(other)),
    }
}

/// The per-conversation compaction engine.
pub struct Compressor {
    /// Configuration shared by all conversations.
    pub cfg: Arc<CompactionConfig>,
    /// Trigger, budgets, cooldowns and breakers.
    pub trigger: Trigger,
    /// Body of the running summary (no prefix, no END marker).
    pub previous_summary: Option<String>,
    /// Whether the running summary is grounded in a real user turn.
    pub summary_has_user_turn: bool,
    /// Summary model; `None` = the main model.
    pub summary_model: Option<String>,
    /// A distinct summary model failed and the main model took over.
    pub summary_model_fallen_back: bool,
    /// The worst terminal summary failure since the last successful summary.
    /// It outlives the call that saw it: a later call that returns early on
    /// the cooldown must still abort rather than fall through to a fallback
    /// summary that would drop context.
    pub terminal_failure: Option<SummaryFailureKind>,
    /// Micro-compaction state.
    pub micro: MicroState,
    /// The rows whose summary was last rejected as not smaller: asking for
    /// the same summary again (on the overflow retry, or a turn or two
    /// later) would be rejected again, at the price of the summary calls.
    rejected: Option<RejectedRows>,
}

/// Rows a summary was rejected for, and how many more passes remember it.
#[derive(Clone, Copy, Debug)]
struct RejectedRows {
    hash: u64,
    passes_left: u8,
}

/// Passes (the overflow retry, the next turns) that skip the summary of
/// rows it was rejected for.
const REJECTED_ROWS_PASSES: u8 = 3;

/// A hash of the rows to summarise.
fn rows_hash(rows: &[Value]) -> u64 {
    let mut h = xxhash_rust::xxh3::Xxh3::new();
    for r in rows {
        h.update(r.to_string().as_bytes());
        h.update(&[0]);
    }
    h.digest()
}

/// The running summary a compaction works from and keeps if it commits.
#[derive(Clone, Debug)]
struct SummaryState {
    previous: Option<String>,
    has_user_turn: bool,
    /// The summary lands in the conversation: it carries the user's own
    /// messages ([`user_messages`]). A summary made on its own does not.
    keep_said: bool,
}

/// The rows one compaction works on, decided before any summary call.
struct Cut {
    /// The input after pruning and blank-echo removal.
    working: Vec<Value>,
    /// First summarised row.
    start: usize,
    /// First row kept after the summary.
    end: usize,
    /// The ask of an oversized active turn, carried verbatim after the
    /// summary while the rounds before `end` are summarised.
    split_ask: Option<usize>,
    /// The input before pruning, row for row with `working`: a pruned tool
    /// output reaches the summariser as its one-line stub plus the salient
    /// lines of the original (the facts the stub would lose).
    unpruned: Option<Vec<Value>>,
}

impl Cut {
    /// The rows to summarise, earlier summaries unwrapped to their bodies
    /// (those are in the running summary already).
    fn middle(&self) -> Vec<Value> {
        (self.start..self.end)
            .filter(|&i| Some(i) != self.split_ask)
            .filter_map(|i| {
                let row = markers::strip_handoff(&self.working[i])?;
                Some(match self.unpruned.as_ref().map(|u| &u[i]) {
                    Some(raw) if raw != &self.working[i] && view::is_role(raw, "tool") => {
                        with_salient_lines(row, raw, SalientUse::Summariser)
                    }
                    _ => row,
                })
            })
            .collect()
    }
}

/// `body` with its task snapshot grounded in the newest real user ask of
/// `turns` (or the note that there is none).
fn ground(body: &str, turns: &[Value], no_user_turns: bool) -> String {
    let ask = turns
        .iter()
        .rev()
        .find(|m| view::is_real_user(m))
        .map(view::text);
    let grounding = match (&ask, no_user_turns) {
        (Some(a), _) => serialize::Grounding::UserAsk(a),
        (None, true) => serialize::Grounding::NoUserInSession,
        (None, false) => serialize::Grounding::NoUserInWindow,
    };
    serialize::ground_task_snapshot_with(body, grounding)
}

/// Where a pruned tool output's salient lines go.
#[derive(Clone, Copy)]
enum SalientUse {
    /// The summariser's input: up to six lines with any fact in them.
    Summariser,
    /// A pruned row that stays in the request: up to three `key: value`,
    /// error or decision lines, so its facts outlive the stub.
    Kept,
}

/// `pruned` (a tool row whose output became a stub) with the salient lines
/// of its original output appended, when it has any.
fn with_salient_lines(mut pruned: Value, raw: &Value, to: SalientUse) -> Value {
    let (max, min_score) = match to {
        SalientUse::Summariser => (6, 2),
        SalientUse::Kept => (3, 3),
    };
    let lines = super::salient::salient_lines_min(&view::text(raw), max, min_score);
    if lines.is_empty() {
        return pruned;
    }
    let stub = view::text(&pruned);
    if let Some(o) = pruned.as_object_mut() {
        let text = format!(
            "{stub}\nKey lines of the original output:\n{}",
            lines.join("\n")
        );
        o.insert("content".into(), Value::String(text));
    }
    pruned
}

/// What one compress call has decided so far. Nothing of it touches the
/// compressor until [`Compressor::finish`] applies it, so every early
/// return leaves the state exactly as the outcome says.
struct Pass {
    force: bool,
    tokens_before: u64,
    tel: CompressTelemetry,
    attempt: Option<SummaryAttempt>,
    feasibility_skip: bool,
    fallback_used: bool,
    /// The running summary to keep: set when the call commits, and when the
    /// window turned out to hold only earlier summaries (what the handoff
    /// scan adopted from the wire stands then).
    keep_state: Option<SummaryState>,
    /// [`CompressOptions::fit_tokens`].
    fit_tokens: Option<u64>,
    /// [`CompressOptions::settle_tokens`].
    settle_tokens: Option<u64>,
    /// The summary was skipped: it was rejected for the same rows before.
    repeated_rejection: bool,
    /// [`CompressOptions::fit`].
    fit: Fit,
}

/// How a compress call ends.
enum Ending {
    Unchanged(Outcome),
    Compacted {
        messages: Vec<Value>,
        summary_index: Option<usize>,
        tokens_after: u64,
        dropped_count: usize,
    },
}

impl Pass {
    fn into_result(self, messages: &[Value], ending: Ending) -> CompressResult {
        let (summary_failure, aux_model_failure) = self
            .attempt
            .map_or((None, None), |a| (a.failure, a.aux_model_failure));
        let mut tel = self.tel;
        match ending {
            Ending::Compacted {
                messages: out,
                summary_index,
                tokens_after,
                dropped_count,
            } => {
                tel.messages_after = out.len();
                CompressResult {
                    kept_suffix: common_suffix(messages, &out),
                    messages: out,
                    outcome: Outcome::Compacted,
                    summary_index,
                    fallback_used: self.fallback_used,
                    feasibility_skip: self.feasibility_skip,
                    dropped_count,
                    tokens_before: self.tokens_before,
                    tokens_after,
                    summary_failure,
                    aux_model_failure,
                    micro: None,
                    telemetry: tel,
                }
            }
            Ending::Unchanged(outcome) => {
                if let Outcome::NoOp(reason) = outcome {
                    tel.failure_class = Some(reason.as_str());
                }
                tel.messages_after = messages.len();
                CompressResult {
                    messages: messages.to_vec(),
                    outcome,
                    summary_index: None,
                    fallback_used: false,
                    feasibility_skip: self.feasibility_skip,
                    dropped_count: 0,
                    tokens_before: self.tokens_before,
                    tokens_after: self.tokens_before,
                    kept_suffix: messages.len(),
                    summary_failure,
                    aux_model_failure,
                    micro: None,
                    telemetry: tel,
                }
            }
        }
    }
}

impl Compressor {
    /// A compressor for one conversation.
    pub fn new(cfg: Arc<CompactionConfig>, trigger: Trigger) -> Self {
        let summary_model = cfg.summary_model.clone().filter(|m| !m.is_empty());
        Self {
            cfg,
            trigger,
            previous_summary: None,
            summary_has_user_turn: true,
            summary_model,
            summary_model_fallen_back: false,
            terminal_failure: None,
            micro: MicroState::default(),
            rejected: None,
        }
    }

    /// Whether the summary of the rows hashed `hash` was rejected in a
    /// recent pass (and counts this pass against the memory); any other
    /// rows forget it.
    fn rejected_before(&mut self, hash: u64) -> bool {
        match &mut self.rejected {
            Some(r) if r.hash == hash && r.passes_left > 0 => {
                r.passes_left -= 1;
                true
            }
            _ => {
                self.rejected = None;
                false
            }
        }
    }

    /// `/new`: forget everything about the session.
    pub fn reset_session(&mut self) {
        self.trigger.reset_session();
        self.previous_summary = None;
        self.summary_has_user_turn = true;
        self.terminal_failure = None;
        self.micro = MicroState::default();
    }

    /// The standing terminal failure that forbids a fallback, if any.
    pub fn terminal_abort_reason(&self) -> Option<AbortReason> {
        self.terminal_failure?
            .abort_reason(self.cfg.abort_on_degraded_summary)
    }

    /// `protect_first_n` after decay: 0 once a compaction happened, a
    /// summary is in memory, or a handoff sits near the start (the head it
    /// would protect was summarised already).
    pub fn effective_protect_first_n(&self, msgs: &[Value]) -> usize {
        if self.trigger.compression_count >= 1 || self.previous_summary.is_some() {
            return 0;
        }
        let sys = usize::from(msgs.first().is_some_and(is_instructions));
        let probe_end = (sys + self.cfg.protect_first_n + HANDOFF_PROBE_EXTRA).min(msgs.len());
        if msgs[sys.min(probe_end)..probe_end]
            .iter()
            .any(view::is_summary)
        {
            return 0;
        }
        self.cfg.protect_first_n
    }

    /// Rows of the protected head: the system prompt (if first) plus the
    /// effective `protect_first_n`.
    pub fn protect_head_size(&self, msgs: &[Value]) -> usize {
        let sys = usize::from(msgs.first().is_some_and(is_instructions));
        (sys + self.effective_protect_first_n(msgs)).min(msgs.len())
    }

    /// The head of one compress call: relaxed to the system prompt alone
    /// when a small window cannot afford more (see [`Compressor::cut`]).
    fn head_size(&self, msgs: &[Value], relax: bool) -> usize {
        if relax {
            minimal_head_size(msgs).min(self.protect_head_size(msgs))
        } else {
            self.protect_head_size(msgs)
        }
    }

    /// Tail-cut parameters from the current budgets.
    pub fn tail_params(&mut self) -> TailParams {
        let budget = self.trigger.tail_token_budget();
        let window = self.trigger.context_length();
        TailParams {
            budget,
            soft_ceiling: super::budget::soft_tail_ceiling(budget, window),
            protect_last_n: self.cfg.protect_last_n,
            min_tail_user_messages: self.cfg.min_tail_user_messages,
            // The tail's own oversized-active-turn rule moves the ask into the
            // summary; compress splits such a turn itself instead
            // ([`split_active_turn`]) so the ask stays verbatim.
            allow_split_turn: false,
        }
    }

    /// The tail cut with the current budgets (or an explicit budget).
    pub fn find_tail_cut_by_tokens(
        &mut self,
        msgs: &[Value],
        head_end: usize,
        token_budget: Option<u64>,
    ) -> usize {
        let mut p = self.tail_params();
        if let Some(b) = token_budget {
            p.budget = b;
            p.soft_ceiling = super::budget::soft_tail_ceiling(b, self.trigger.context_length());
        }
        tail::find_tail_cut_by_tokens(msgs, head_end, &p)
    }

    /// Switches summaries to the main model after a distinct summary model
    /// failed, and clears the cooldown so the retry is not held back by the
    /// failure of a model that is no longer used.
    pub fn fallback_to_main_for_compression(&mut self) {
        self.summary_model = None;
        self.summary_model_fallen_back = true;
        self.trigger.clear_failure_cooldown();
    }

    fn distinct_summary_model(&self) -> bool {
        self.summary_model
            .as_deref()
            .is_some_and(|m| !m.is_empty() && m != self.trigger.model())
    }

    fn auto_focus(turns: &[Value]) -> Option<String> {
        let mut lines = Vec::new();
        let mut total = 0;
        for m in turns.iter().rev().filter(|m| view::is_real_user(m)) {
            if lines.len() >= AUTO_FOCUS_TURNS {
                break;
            }
            let t = redact_secrets(&view::text(m));
            let t: String = t.split_whitespace().collect::<Vec<_>>().join(" ");
            let t: String = t.chars().take(AUTO_FOCUS_TURN_CHARS).collect();
            if total + t.len() > AUTO_FOCUS_TOTAL_CHARS {
                break;
            }
            total += t.len();
            lines.push(format!("- {t}"));
        }
        (!lines.is_empty()).then(|| format!("Recent user focus:\n{}", lines.join("\n")))
    }

    /// The running summary without its section of the user's own words,
    /// and what of them the new summary keeps: the section's and those of
    /// `turns` compete for their own budget (the summary's is not touched),
    /// oldest first. Nothing when `state` does not keep them.
    fn user_messages(
        &mut self,
        state: &SummaryState,
        turns: &[Value],
    ) -> (Option<String>, Vec<String>) {
        let (previous, mut said) = match state.previous.as_deref() {
            Some(p) => {
                let (body, kept) = user_messages::split(p);
                (Some(body).filter(|b| !b.trim().is_empty()), kept)
            }
            None => (None, Vec::new()),
        };
        if !state.keep_said {
            return (state.previous.clone(), Vec::new());
        }
        said.extend(user_messages::of_turns(turns));
        let budget = self.trigger.user_messages_budget();
        (previous, user_messages::select(&said, budget))
    }

    /// Applies what a summary attempt taught: the model switch, the
    /// cooldown and the standing failure, or the success that clears them.
    fn apply_attempt(&mut self, a: &SummaryAttempt) {
        if a.aux_model_failure.is_some() {
            self.fallback_to_main_for_compression();
        }
        if let Some(f) = &a.failure {
            let secs = self.trigger.note_summary_failure(f.class, &f.error);
            // Class and kind only: the error text may quote the provider.
            tracing::warn!(
                cooldown_secs = secs,
                class = ?f.class,
                kind = ?f.kind,
                "summary generation failed"
            );
            if f.kind.is_terminal() {
                self.terminal_failure = worst(self.terminal_failure, Some(f.kind));
            }
        } else if a.summary.is_some() {
            self.trigger.note_summary_success();
            self.terminal_failure = None;
        }
    }

    /// Generates the summary of `turns` on its own (outside a compaction)
    /// and keeps it as the running summary when it succeeds. Long input is
    /// summarised in rolling chunks that each fit the summariser's prompt
    /// budget; a live cooldown returns an empty attempt.
    pub async fn generate_summary(
        &mut self,
        s: &dyn Summariser,
        turns: &[Value],
        focus_topic: Option<&str>,
    ) -> SummaryAttempt {
        let state = SummaryState {
            previous: self.previous_summary.clone(),
            has_user_turn: self.summary_has_user_turn,
            keep_said: false,
        };
        let a = self
            .attempt_summary(s, turns, &state, focus_topic, false, None)
            .await;
        self.apply_attempt(&a);
        if let Some(body) = &a.body {
            self.previous_summary = Some(body.clone());
        }
        a
    }

    /// One summary generation from `state`'s running summary. Touches no
    /// compressor state but the trigger's cached budgets: the caller applies
    /// the attempt.
    async fn attempt_summary(
        &mut self,
        s: &dyn Summariser,
        turns: &[Value],
        state: &SummaryState,
        focus_topic: Option<&str>,
        bypass_cooldown: bool,
        today: Option<&str>,
    ) -> SummaryAttempt {
        let mut out = SummaryAttempt::default();
        if !bypass_cooldown && self.trigger.cooldown_active() {
            return out;
        }
        let middle_tokens: u64 = turns
            .iter()
            .map(|m| tokens::estimate_msg_budget_tokens(m, false))
            .sum();
        let target =
            super::budget::summary_budget(middle_tokens, self.trigger.max_summary_tokens());
        let focus = focus_topic
            .map(str::to_owned)
            .or_else(|| Self::auto_focus(turns));
        let no_user_turns = !turns.iter().any(view::is_real_user) && !state.has_user_turn;
        // The user's own words are kept verbatim beside the summary, in a
        // budget of their own: the summariser never sees the section, only
        // the summary it belongs to.
        let (previous, said) = self.user_messages(state, turns);
        let compact = s.prompt_budget_chars() < serialize::COMPACT_PROMPT_BELOW_CHARS;
        let (chunks, prev_cap) = plan_chunks(
            turns,
            previous.as_deref(),
            focus.as_deref(),
            (s.prompt_budget_chars(), compact),
        );
        out.chunks = chunks.len();

        let mut model = if self.distinct_summary_model() {
            self.summary_model.clone()
        } else {
            None
        };
        let mut fallen_back = self.summary_model_fallen_back;
        let mut running = previous;
        let n = chunks.len();
        for (i, text) in chunks.iter().enumerate() {
            let prev = running
                .as_deref()
                .map(|p| bound_running_summary(p, prev_cap));
            let prompt = build_summary_prompt(&PromptParts {
                turns: text,
                previous_summary: prev.as_deref(),
                focus_topic: focus.as_deref(),
                target_tokens: target,
                today,
                no_user_turns,
                chunk: (n > 1).then_some((i, n)),
                compact,
                user_messages_kept: !said.is_empty(),
            });
            let call = SummaryCall {
                prompt,
                no_user_session: no_user_turns,
                target_tokens: target,
                max_body_chars: max_summary_body_chars(target, self.trigger.context_length()),
                budget_chars: s.prompt_budget_chars(),
                keep_cut: !self.cfg.abort_on_degraded_summary,
                max_tokens: None,
                temperature: None,
            };
            match call.run(s, &mut model, &mut fallen_back, &mut out).await {
                Ok(body) => running = Some(body),
                Err(f) => {
                    out.failure = Some(f);
                    return out;
                }
            }
        }
        let Some(body) = running else {
            return out;
        };
        let window = self.trigger.context_length();
        let body = clip_summary_for_window(ground(&body, turns, no_user_turns), target, window);
        let body = user_messages::render(&body, &said);
        out.summary = Some(markers::normalize_summary_prefix_with(
            markers::summary_prefix_for(window),
            &body,
        ));
        out.body = Some(body);
        out
    }

    /// Runs one compaction of `messages`: cut, summarise (or fall back),
    /// assemble, check the candidate is smaller. State is committed once,
    /// at the end, according to the outcome. Instruction rows are never
    /// part of it ([`super::instructions`]).
    pub async fn compress(
        &mut self,
        messages: &[Value],
        s: &dyn Summariser,
        mut opts: CompressOptions,
    ) -> CompressResult {
        let Some((history, pinned)) = super::instructions::pin(messages) else {
            return self.compress_history(messages, s, opts).await;
        };
        opts.fit_tokens = opts.fit_tokens.map(|f| f.saturating_sub(pinned.tokens()));
        opts.settle_tokens = opts
            .settle_tokens
            .map(|f| f.saturating_sub(pinned.tokens()));
        let r = self.compress_history(&history, s, opts).await;
        pinned.restore(messages, r)
    }

    /// [`Compressor::compress`] of a conversation whose only instruction
    /// row, if any, is the first.
    async fn compress_history(
        &mut self,
        messages: &[Value],
        s: &dyn Summariser,
        opts: CompressOptions,
    ) -> CompressResult {
        let tokens_before = tokens::estimate_messages_tokens_rough(messages);
        let mut pass = Pass {
            force: opts.force,
            tokens_before,
            tel: CompressTelemetry {
                messages_before: messages.len(),
                current_tokens: opts.current_tokens,
                ..Default::default()
            },
            attempt: None,
            feasibility_skip: false,
            fallback_used: false,
            keep_state: None,
            fit_tokens: opts.fit_tokens,
            settle_tokens: opts.settle_tokens,
            repeated_rejection: false,
            fit: opts.fit,
        };
        let cut = match self.cut(messages, &mut pass.tel) {
            Ok(cut) => cut,
            Err(reason) => {
                return self.finish(messages, pass, Ending::Unchanged(Outcome::NoOp(reason)))
            }
        };
        let state = self.adopt_handoffs(&cut.working);
        let middle = cut.middle();
        if middle.is_empty() {
            pass.keep_state = Some(state);
            let ending = Ending::Unchanged(Outcome::NoOp(NoOpReason::EmptyPostHandoffWindow));
            return self.finish(messages, pass, ending);
        }
        let rows = rows_hash(&middle);
        if self.rejected_before(rows) {
            // Straight to what a rejection leads to (the last resort when
            // the request must fit), without the calls or another strike.
            pass.repeated_rejection = true;
            pass.tel.failure_class = Some("rejected_before");
            return self.finish(messages, pass, Ending::Unchanged(Outcome::Rejected));
        }
        let summary = match self
            .summarise_middle(s, &middle, &state, &opts, &mut pass)
            .await
        {
            Ok(summary) => summary,
            Err(reason) => {
                return self.finish(messages, pass, Ending::Unchanged(Outcome::Aborted(reason)))
            }
        };
        let ending =
            self.assemble_candidate(messages, &cut, &summary.0, tokens_before, &mut pass.tel);
        if matches!(ending, Ending::Unchanged(Outcome::Rejected)) {
            self.rejected = Some(RejectedRows {
                hash: rows,
                passes_left: REJECTED_ROWS_PASSES,
            });
        }
        if matches!(ending, Ending::Compacted { .. }) {
            pass.keep_state = Some(SummaryState {
                previous: Some(summary.1),
                has_user_turn: state.has_user_turn,
                keep_said: true,
            });
        }
        self.finish(messages, pass, ending)
    }

    /// Head, pruning and tail cut: the rows to summarise, or why there are
    /// none.
    fn cut(&mut self, messages: &[Value], tel: &mut CompressTelemetry) -> Result<Cut, NoOpReason> {
        let n = messages.len();
        let small = self.trigger.context_length() < STRICT_SUMMARY_WINDOW;
        // A small window cannot afford a protected head of whole tool
        // rounds: an agent's first rounds would leave too few rows to
        // compact (a no-op, then an overflow). The head shrinks to the
        // system prompt; an oversized active turn then carries the task.
        let relax_head = small && n <= self.protect_head_size(messages) + MIN_ROWS_AFTER_HEAD;
        let head_size = self.head_size(messages, relax_head);
        tel.head_rows = head_size;
        if n <= head_size + MIN_ROWS_AFTER_HEAD {
            return Err(NoOpReason::InsufficientMessages);
        }
        // Prune old tool outputs first (no LLM).
        let tp = self.tail_params();
        // Small windows keep an agent's newest tool result whole when it
        // takes at most half the trigger: the split keeps its round, and a
        // stub in its place would make the model repeat the call.
        let keep_newest_tool_max = small.then(|| self.trigger.threshold_tokens() / 2);
        let (pruned, pruned_rows) = prune::prune_old_tool_results(
            messages,
            &PruneParams {
                protect_tail_count: self.cfg.protect_last_n,
                protect_tail_tokens: Some(tp.budget),
                soft_ceiling: Some(tp.soft_ceiling),
                min_prune_chars: prune::PRUNE_MIN_CHARS,
                keep_newest_tool_max,
            },
        );
        tel.pruned_rows = pruned_rows;
        let working = remove_blank_echoes(pruned);
        // Pruning never touches user rows, so the same echo removal on the
        // raw input keeps the rows aligned (checked by length).
        let unpruned = (pruned_rows > 0)
            .then(|| remove_blank_echoes(messages.to_vec()))
            .filter(|u| u.len() == working.len());
        // The head is measured on the working list (a removed blank echo
        // shifts rows) and never ends inside a tool group.
        let mut start = self.head_size(&working, relax_head);
        while start < working.len() && view::is_role(&working[start], "tool") {
            start += 1;
        }
        if start >= working.len() {
            return Err(NoOpReason::NoCompressibleWindow);
        }
        let (start, end, split_ask) = choose_cut(&working, start, &tp, small);
        tracing::debug!(
            rows = n,
            head = head_size,
            relax_head,
            start,
            end,
            split = split_ask.is_some(),
            "cut"
        );
        if start >= end {
            return Err(NoOpReason::NoCompressibleWindow);
        }
        let mut working = working;
        if let Some(raw) = &unpruned {
            keep_salient_lines(&mut working, raw, start..end, split_ask);
        }
        Ok(Cut {
            working,
            start,
            end,
            split_ask,
            unpruned,
        })
    }

    /// The running summary after the handoff scan over the whole transcript
    /// (after the system row): the compressor's own, else the bodies of the
    /// earlier summaries on the wire.
    fn adopt_handoffs(&self, working: &[Value]) -> SummaryState {
        let sys = usize::from(working.first().is_some_and(is_instructions));
        let bodies: Vec<String> = working
            .iter()
            .skip(sys)
            .filter_map(|m| match markers::classify_handoff(m) {
                Handoff::None => None,
                Handoff::Standalone { body, .. } | Handoff::Merged { body, .. } => Some(body),
            })
            .collect();
        let previous = if bodies.is_empty() {
            // A summary in memory without any handoff on the wire belongs to
            // another conversation (the client started over or switched).
            None
        } else {
            self.previous_summary
                .clone()
                .map(|p| with_micro_summary(p, working))
                .or_else(|| Some(bodies.join("\n\n")))
        };
        // Provenance: a real user row decides; without one, an earlier
        // summary decides by its sentinel; a fresh session without user rows
        // has none, and no user intent may be attributed to it.
        let has_user_turn = working.iter().any(view::is_real_user)
            || previous
                .as_deref()
                .is_some_and(|p| !p.contains(markers::NO_USER_SENTINEL));
        SummaryState {
            previous,
            has_user_turn,
            keep_said: self.cfg.keep_user_messages,
        }
    }

    /// The summary of `middle` as `(summary, body)`: the summariser's, or
    /// the deterministic fallback when it was skipped or failed and no
    /// abort applies.
    async fn summarise_middle(
        &mut self,
        s: &dyn Summariser,
        middle: &[Value],
        state: &SummaryState,
        opts: &CompressOptions,
        pass: &mut Pass,
    ) -> Result<(String, String), AbortReason> {
        let middle_tokens: u64 = middle
            .iter()
            .map(|m| tokens::estimate_msg_budget_tokens(m, false))
            .sum();
        pass.tel.middle_tokens = middle_tokens;
        // A conversation that compacted ineffectively before and whose
        // middle is tiny is not worth a summary call.
        let threshold = self.trigger.threshold_tokens();
        pass.feasibility_skip = !opts.force
            && self.trigger.ineffective_compression_count >= 1
            && (middle_tokens as f64) < threshold as f64 * FEASIBILITY_MIDDLE_RATIO;
        let why = if pass.feasibility_skip {
            pass.tel.failure_class = Some("feasibility_skip");
            "feasibility skip: the summarised window was too small for an LLM call".to_string()
        } else {
            // A forced call clears the cooldown (at commit), so it is not
            // held by it.
            let bypass = opts.bypass_cooldown || opts.force;
            let a = self
                .attempt_summary(
                    s,
                    middle,
                    state,
                    opts.focus_topic.as_deref(),
                    bypass,
                    opts.today.as_deref(),
                )
                .await;
            pass.tel.summary_calls = a.calls;
            pass.tel.chunk_count = a.chunks;
            if a.aux_model_failure.is_some() {
                pass.tel.failure_class = Some("aux_model_fallback");
            }
            if let Some(f) = &a.failure {
                pass.tel.failure_class = Some(f.kind.class_name());
            }
            let done = a.summary.clone().zip(a.body.clone());
            let why = a.failure.as_ref().map_or_else(
                || "summary unavailable (cooldown)".to_string(),
                |f| f.error.clone(),
            );
            let standing = worst(
                self.terminal_failure,
                a.failure
                    .as_ref()
                    .map(|f| f.kind)
                    .filter(|k| k.is_terminal()),
            );
            pass.attempt = Some(a);
            if let Some(done) = done {
                return Ok(done);
            }
            let reason = standing
                .and_then(|k| k.abort_reason(self.cfg.abort_on_degraded_summary))
                .or(self
                    .cfg
                    .abort_on_summary_failure
                    .then_some(AbortReason::SummaryFailed));
            if let Some(r) = reason {
                return Err(r);
            }
            why
        };
        self.fallback_summary(middle, middle_tokens, state, &why, pass)
    }

    /// The deterministic fallback summary, sized for the window.
    fn fallback_summary(
        &mut self,
        middle: &[Value],
        middle_tokens: u64,
        state: &SummaryState,
        why: &str,
        pass: &mut Pass,
    ) -> Result<(String, String), AbortReason> {
        let window = self.trigger.context_length();
        let target =
            super::budget::summary_budget(middle_tokens, self.trigger.max_summary_tokens());
        let (previous, said) = self.user_messages(state, middle);
        let prev = previous.as_deref();
        let fb = match fallback_body_cap(target, window) {
            Some(cap) => format!(
                "{}\n{}",
                markers::SUMMARY_PREFIX,
                build_fallback_body_capped(middle, prev, why, cap)
            ),
            None => build_fallback_summary(middle, prev, why),
        };
        let body = user_messages::render(&markers::summary_body(&fb), &said);
        if body.trim().is_empty() {
            pass.tel.failure_class = Some("deterministic_fallback_invalid");
            return Err(AbortReason::FallbackInvalid);
        }
        pass.fallback_used = true;
        let summary =
            markers::normalize_summary_prefix_with(markers::summary_prefix_for(window), &body);
        Ok((summary, body))
    }

    /// Head + summary + tail, sanitised, and the check that the candidate
    /// is smaller than the input (salvaged once if it is not).
    fn assemble_candidate(
        &mut self,
        messages: &[Value],
        cut: &Cut,
        summary: &str,
        tokens_before: u64,
        tel: &mut CompressTelemetry,
    ) -> Ending {
        let working = &cut.working;
        let wn = working.len();
        let head: Vec<Value> = working[..cut.start]
            .iter()
            .filter_map(markers::strip_handoff)
            .collect();
        // A handoff inside the tail is unwrapped in place (its body is in the
        // running summary); the tail is not advanced past it, which could
        // summarise the live ask that a user-leading merge carries.
        let tail_rows: Vec<Value> = cut
            .split_ask
            .into_iter()
            .chain(cut.end.min(wn)..wn)
            .filter_map(|i| markers::strip_handoff(&working[i]))
            .collect();
        let asm = if cut.split_ask.is_some() {
            assemble::assemble_split_turn(head, summary, tail_rows)
        } else {
            assemble::assemble(head, summary, tail_rows)
        };
        let mut out = sanitize_tool_pairs(asm.messages);
        let mut summary_index = locate_summary(&out, asm.summary_index);
        // A split turn carries its ask verbatim; restating it would duplicate
        // the user's text.
        if cut.split_ask.is_none() {
            if let Some(si) = summary_index {
                assemble::reappend_inflight_task(&mut out, si, messages);
            }
            assemble::ensure_user_turn(&mut out, messages);
        }
        strip_historical_media(&mut out);
        for m in out.iter_mut() {
            if let Some(o) = m.as_object_mut() {
                o.remove("_db_persisted");
            }
        }

        // The candidate must be strictly smaller than the input.
        let n = messages.len();
        let threshold = self.trigger.threshold_tokens();
        let mut tokens_after = tokens::estimate_messages_tokens_rough(&out);
        tracing::debug!(
            tokens_before,
            tokens_after,
            rows_before = n,
            rows_after = out.len(),
            "candidate"
        );
        if !is_progress(tokens_before, tokens_after, n, out.len(), threshold) {
            salvage(&mut out, summary_index);
            tokens_after = tokens::estimate_messages_tokens_rough(&out);
            let user_ok = out.iter().any(|m| view::is_role(m, "user"));
            if !is_progress(tokens_before, tokens_after, n, out.len(), threshold) || !user_ok {
                tel.failure_class = Some("rejected_not_smaller");
                return Ending::Unchanged(Outcome::Rejected);
            }
            summary_index = locate_summary(&out, summary_index.unwrap_or(0));
        }
        Ending::Compacted {
            messages: out,
            summary_index,
            tokens_after,
            dropped_count: cut.end - cut.start - usize::from(cut.split_ask.is_some()),
        }
    }

    /// Commits what the call decided, once, and builds its result.
    fn finish(&mut self, messages: &[Value], mut pass: Pass, ending: Ending) -> CompressResult {
        let ending = last_resort(messages, ending, &mut pass);
        if pass.force {
            self.trigger.clear_failure_cooldown();
            self.trigger.clear_structural_backoff();
        }
        if let Some(a) = &pass.attempt {
            self.apply_attempt(a);
        }
        if pass.feasibility_skip {
            self.trigger.prellm_skip_count = self.trigger.prellm_skip_count.saturating_add(1);
        }
        match &ending {
            Ending::Compacted { .. } => {
                self.commit_state(pass.keep_state.take());
                self.trigger.compression_count = self.trigger.compression_count.saturating_add(1);
                self.micro = MicroState::default();
            }
            Ending::Unchanged(Outcome::NoOp(_)) => {
                // Nothing to compact is a backoff, not a strike: the
                // conversation is fine, it just has to grow first.
                self.trigger.set_structural_backoff();
                self.commit_state(pass.keep_state.take());
            }
            Ending::Unchanged(Outcome::Rejected) if !pass.repeated_rejection => {
                self.trigger.record_rejected_compaction()
            }
            Ending::Unchanged(Outcome::Rejected) => {}
            // The chat path logs the one line per compaction, outcome included.
            Ending::Unchanged(Outcome::Aborted(_) | Outcome::Compacted) => {}
        }
        pass.into_result(messages, ending)
    }

    fn commit_state(&mut self, state: Option<SummaryState>) {
        if let Some(st) = state {
            self.previous_summary = st.previous;
            self.summary_has_user_turn = st.has_user_turn;
        }
    }
}

/// The last resort of a call whose messages still do not fit
/// `pass.fit_tokens`: nothing was compacted (or not enough), so the
/// largest messages are shortened ([`super::last_resort::shrink_to_fit`]).
/// An abort stays an abort; a request that cannot fit stays as it was.
fn last_resort(messages: &[Value], ending: Ending, pass: &mut Pass) -> Ending {
    let ending = fit_window(messages, ending, pass);
    settle(ending, pass)
}

/// A compacted result still above `pass.settle_tokens` would be compacted
/// again on the next turn: its largest messages are shortened now, when
/// that reaches the mark.
fn settle(ending: Ending, pass: &mut Pass) -> Ending {
    let (
        Some(mark),
        Ending::Compacted {
            messages: out,
            tokens_after,
            ..
        },
    ) = (pass.settle_tokens, &ending)
    else {
        return ending;
    };
    if *tokens_after <= mark {
        return ending;
    }
    let Some(shrunk) = super::last_resort::shrink_to_fit(out, mark, Fit::IfReachable) else {
        return ending;
    };
    tracing::info!(
        rows = shrunk.rows,
        settle_tokens = mark,
        "compacted result over its mark; largest messages shortened in the same pass"
    );
    pass.tel.last_resort_rows += shrunk.rows;
    let Ending::Compacted {
        summary_index,
        dropped_count,
        ..
    } = ending
    else {
        return ending;
    };
    Ending::Compacted {
        tokens_after: tokens::estimate_messages_tokens_rough(&shrunk.messages),
        messages: shrunk.messages,
        summary_index,
        dropped_count,
    }
}

/// The window step of [`last_resort`].
fn fit_window(messages: &[Value], ending: Ending, pass: &mut Pass) -> Ending {
    let Some(fit) = pass.fit_tokens else {
        return ending;
    };
    let (base, summary_index, dropped_count) = match &ending {
        Ending::Unchanged(Outcome::NoOp(_) | Outcome::Rejected) => (messages, None, 0),
        Ending::Compacted {
            messages: out,
            summary_index,
            tokens_after,
            dropped_count,
        } if *tokens_after > fit => (out.as_slice(), *summary_index, *dropped_count),
        _ => return ending,
    };
    let shrunk = match super::last_resort::shrink_to_fit(base, fit, Fit::IfReachable) {
        Some(s) => s,
        None => match super::last_resort::drop_oldest_exchanges(base, fit) {
            Some(d) => {
                tracing::warn!(
                    dropped_rows = d.rows,
                    rows = d.shrunk.rows,
                    fit_tokens = fit,
                    "not even the shortened messages fit the window; oldest exchanges dropped"
                );
                pass.tel.last_resort_dropped = d.rows;
                d.shrunk
            }
            None if pass.fit == Fit::Insist => {
                match super::last_resort::shrink_to_fit(base, fit, Fit::Insist) {
                    Some(s) => s,
                    None => return ending,
                }
            }
            None => return ending,
        },
    };
    tracing::warn!(
        rows = shrunk.rows,
        fit_tokens = fit,
        "nothing left to compact; largest messages shortened to fit the window"
    );
    pass.tel.last_resort_rows = shrunk.rows;
    // Rows dropped before it move the summary.
    let summary_index = summary_index.and_then(|i| locate_summary(&shrunk.messages, i));
    Ending::Compacted {
        tokens_after: tokens::estimate_messages_tokens_rough(&shrunk.messages),
        messages: shrunk.messages,
        summary_index,
        dropped_count: dropped_count + pass.tel.last_resort_dropped,
    }
}

/// The running batch summary plus the rolling summary of the newest micro
/// marker on the wire: a micro pass absorbs exchanges after the last batch
/// compaction, so what it recorded is in no batch summary yet and would be
/// lost with its marker.
fn with_micro_summary(previous: String, working: &[Value]) -> String {
    let rolling = working
        .iter()
        .rev()
        .find(|m| super::micro::is_micro_marker(m))
        .and_then(|m| match markers::classify_handoff(m) {
            Handoff::Standalone { body, .. } | Handoff::Merged { body, .. } => Some(body),
            Handoff::None => None,
        });
    match rolling {
        Some(r) if !r.trim().is_empty() && !previous.contains(r.trim()) => {
            format!("{previous}\n\n{r}")
        }
        _ => previous,
    }
}

/// One summary prompt, sent with the retry on the main model. Batch and
/// micro summaries both go through it, so a reply cut at the reply limit is
/// handled the same way on either path.
pub(super) struct SummaryCall {
    pub(super) prompt: String,
    /// The session has no user turns: a reply attributing anything to a
    /// user is invented and counts as a refusal.
    pub(super) no_user_session: bool,
    /// The summary's token target (for the firmer retry instruction).
    pub(super) target_tokens: u64,
    /// Longest body kept unclipped: a longer one is retried like a cut one.
    pub(super) max_body_chars: usize,
    /// The summariser's prompt budget: the retry's longer prompt must fit.
    pub(super) budget_chars: usize,
    /// A reply cut at the reply limit is kept (cut at its last complete
    /// line) rather than failed; off under `abort_on_degraded_summary`.
    pub(super) keep_cut: bool,
    /// Wire `max_tokens` and temperature (micro summaries set them; batch
    /// summaries leave the cap to the summariser's budgets).
    pub(super) max_tokens: Option<u32>,
    pub(super) temperature: Option<f32>,
}

/// A checked reply: its body, and whether it was cut at the reply limit.
struct Checked {
    body: String,
    cut: bool,
}

impl SummaryCall {
    /// Sends the prompt; a summary cut at the reply limit is retried once
    /// with a firmer length instruction when the prompt budget has room,
    /// and otherwise (or when the retry is cut too) kept cut at its last
    /// complete line.
    pub(super) async fn run(
        &self,
        s: &dyn Summariser,
        model: &mut Option<String>,
        fallen_back: &mut bool,
        out: &mut SummaryAttempt,
    ) -> Result<String, SummaryFailure> {
        let first = self.send(&self.prompt, s, model, fallen_back, out).await?;
        let too_long = |c: &Checked| c.body.chars().count() > self.max_body_chars;
        if !first.cut && !too_long(&first) {
            return Ok(first.body);
        }
        if !s.firm_retry_useful() {
            // This model's retries never came back within the cap: the cut
            // summary is kept at its last complete line.
            return Ok(first.body);
        }
        let Some(firm) =
            truncated::firm_prompt(&self.prompt, self.target_tokens, self.budget_chars)
        else {
            return Ok(first.body);
        };
        tracing::info!(
            cut = first.cut,
            "summary over its length; retrying once with a firmer length instruction"
        );
        let second = self.send(&firm, s, model, fallen_back, out).await;
        if let Ok(c) = &second {
            s.note_firm_retry(!c.cut && !too_long(c));
        }
        match second {
            // A complete retry wins; of two cut ones, the one that kept more.
            Ok(second) if !second.cut || (first.cut && second.body.len() >= first.body.len()) => {
                Ok(second.body)
            }
            _ => Ok(first.body),
        }
    }

    /// Sends `prompt` on `model` (`None` = the main model). A distinct
    /// summary model that fails is recorded in `out` and the prompt is
    /// retried once on the main model, which later prompts then use too.
    async fn send(
        &self,
        prompt: &str,
        s: &dyn Summariser,
        model: &mut Option<String>,
        fallen_back: &mut bool,
        out: &mut SummaryAttempt,
    ) -> Result<Checked, SummaryFailure> {
        loop {
            let req = SummaryRequest {
                model: model.clone(),
                prompt: prompt.to_owned(),
                max_tokens: self.max_tokens,
                temperature: self.temperature,
            };
            out.calls += 1;
            let failure = match s.summarise(req).await {
                Ok(reply) => match self.check(&reply) {
                    Ok(checked) => return Ok(checked),
                    Err(f) => f,
                },
                Err(e) => SummaryFailure::from_error(&e),
            };
            if !*fallen_back {
                if let Some(m) = model.take() {
                    tracing::warn!("summary model failed; retrying once on the main model");
                    out.aux_model_failure = Some(AuxModelFailure {
                        model: m,
                        error: failure.error,
                    });
                    *fallen_back = true;
                    continue;
                }
            }
            return Err(failure);
        }
    }

    /// The cleaned, validated body of a reply. A reply cut at the reply
    /// limit is kept up to its last complete line when `keep_cut` allows
    /// (a truncation failure when nothing complete is left).
    fn check(&self, reply: &SummaryReply) -> Result<Checked, SummaryFailure> {
        let text = reply_text(reply);
        let cut = reply.finish_reason.as_deref() == Some("length") && self.keep_cut;
        let finish = if cut {
            None
        } else {
            reply.finish_reason.as_deref()
        };
        let body = serialize::validate_summary_reply(
            text.as_deref(),
            finish,
            reply.refusal.as_deref(),
            reply.reasoning.as_deref(),
        )
        .map_err(|inv| SummaryFailure::invalid(&inv))?;
        let body = if cut {
            truncated::cut_at_last_line(&body)
                .ok_or_else(|| SummaryFailure::invalid(&serialize::SummaryInvalid::Truncated))?
        } else {
            body
        };
        if self.no_user_session && serialize::attributes_to_user(&body) {
            return Err(SummaryFailure::new(
                SummaryFailureKind::Other,
                FailureClass::Other,
                "summary attributed text to a user in a session without user turns",
            ));
        }
        Ok(Checked { body, cut })
    }
}

/// The summary input as prompts that each fit a summariser of `budget`
/// characters: one when everything fits, else rolling chunks (bounded in
/// number); with the cap on the running summary quoted in each prompt.
fn plan_chunks(
    turns: &[Value],
    previous: Option<&str>,
    focus: Option<&str>,
    (budget, compact): (usize, bool),
) -> (Vec<String>, usize) {
    let overhead = serialize::prompt_overhead_chars(focus, compact);
    let each = serialize::serialize_each(turns);
    let serialized = serialize::join_serialized(&each);
    let prev_len = previous.map_or(0, |p| p.chars().count().min(SUMMARY_INPUT_MAX_CHARS));
    let turns_len = serialized.chars().count().min(SUMMARY_INPUT_MAX_CHARS);
    if overhead + prev_len + turns_len <= budget {
        return (vec![serialized], SUMMARY_INPUT_MAX_CHARS);
    }
    let room = budget.saturating_sub(overhead).max(1_000);
    // The running summary is quoted whole (what summary N recorded must
    // reach summary N+1) unless it alone would take most of the room; the
    // chunks get the rest.
    let prev_cap = prev_len.clamp(room / 3, room * 2 / 3).max(500);
    let per_chunk = room.saturating_sub(prev_cap).max(500);
    // A small summariser is one call per compaction while every message
    // keeps a useful excerpt: each summary call of a small local model
    // costs seconds to minutes and holds its only slot.
    if compact {
        if let Some(one) = condensed(&each, per_chunk) {
            return (vec![one], prev_cap);
        }
    }
    let mut parts: Vec<String> = chunk_for_budget(turns, per_chunk)
        .iter()
        .map(|c| bound_summary_input(&serialize_for_summary(c), per_chunk))
        .collect();
    if parts.len() > MAX_SUMMARY_CHUNKS {
        // Bounded like a single prompt's input: keep the oldest and the
        // newest parts and drop the middle, so one compaction cannot turn
        // into dozens of summary calls.
        let head = MAX_SUMMARY_CHUNKS * 3 / 8;
        let tail_n = MAX_SUMMARY_CHUNKS - head;
        let keep_tail = parts.split_off(parts.len() - tail_n);
        parts.truncate(head);
        parts.extend(keep_tail);
    }
    (parts, prev_cap)
}

/// No message is condensed below this many characters for a single call.
const CONDENSED_MIN_CHARS: usize = 400;

/// The serialized messages joined within `room` characters by bounding
/// each to one cap (the largest that fits; short messages stay whole), or
/// `None` when that cap would be under [`CONDENSED_MIN_CHARS`].
fn condensed(each: &[String], room: usize) -> Option<String> {
    let sep = 2 * each.len().saturating_sub(1);
    let room = room.checked_sub(sep)?;
    let mut lens: Vec<usize> = each.iter().map(|m| m.chars().count()).collect();
    lens.sort_unstable();
    // The largest cap c with sum(min(len, c)) <= room.
    let (mut used, mut cap) = (0usize, None);
    for (i, &len) in lens.iter().enumerate() {
        let rest = lens.len() - i;
        if used + len * rest > room {
            cap = Some((room - used) / rest);
            break;
        }
        used += len;
    }
    let parts: Vec<String> = match cap {
        None => each.to_vec(),
        Some(c) if c >= CONDENSED_MIN_CHARS => {
            each.iter().map(|m| bound_summary_input(m, c)).collect()
        }
        Some(_) => return None,
    };
    Some(serialize::join_serialized(&parts))
}

/// Pruned tool rows outside `middle` (they stay in the request) get the
/// salient lines of their original output.
fn keep_salient_lines(
    working: &mut [Value],
    raw: &[Value],
    middle: std::ops::Range<usize>,
    split_ask: Option<usize>,
) {
    for (i, row) in working.iter_mut().enumerate() {
        if (middle.contains(&i) && Some(i) != split_ask)
            || !view::is_role(row, "tool")
            || *row == raw[i]
        {
            continue;
        }
        *row = with_salient_lines(row.clone(), &raw[i], SalientUse::Kept);
    }
}

/// The tail cut and the oversized-active-turn split over `working` from
/// `start`: `(start, end, split_ask)`.
fn choose_cut(
    working: &[Value],
    start: usize,
    tp: &TailParams,
    small: bool,
) -> (usize, usize, Option<usize>) {
    let normal_end = bridged_tail_cut(working, start, tp);
    // Large windows keep the whole protected head: only an ask after it is
    // carried.
    let ask_from = if small {
        minimal_head_size(working)
    } else {
        start
    };
    let mut split = split_active_turn(working, ask_from, tp, small.then_some(start));
    if split.is_none() && small {
        split = forced_split(working, start, normal_end, tp);
    }
    // At small windows the ask may sit in the protected head (an agent's
    // only task): the head then ends before it, so the ask is carried
    // after the summary instead of being restated.
    let start = split.map_or(start, |(ask, _)| start.min(ask));
    let end = split.map_or(normal_end, |(_, keep_from)| keep_from);
    (start, end, split.map(|(ask, _)| ask))
}

/// The ordinary cut: tail by tokens, then the bridge rule (an actionable
/// user row must not sit in the slot where a role collision would merge
/// the summary into it).
fn bridged_tail_cut(working: &[Value], start: usize, tp: &TailParams) -> usize {
    let mut end = tail::find_tail_cut_by_tokens(working, start, tp);
    if let Some(u) = view::last_real_user(working, start) {
        if end == u && u > 0 {
            let mut b = u - 1;
            while b > 0 && view::is_role(&working[b], "tool") {
                b -= 1;
            }
            if b > start && view::is_role(&working[b], "assistant") {
                end = b;
            }
        }
    }
    end
}

/// The split of last resort at small windows: pruning may have shrunk the
/// active turn under the ceiling while the ordinary cut finds nothing but
/// earlier summaries to compact, so splitting the turn is the only way
/// forward. (The caller's trigger also counts `tools`, which this estimate
/// does not see, so there is no threshold test here.)
fn forced_split(
    working: &[Value],
    start: usize,
    normal_end: usize,
    tp: &TailParams,
) -> Option<(usize, usize)> {
    let nothing = working[start..normal_end.max(start)]
        .iter()
        .all(|m| markers::strip_handoff(m).is_none());
    if !nothing {
        return None;
    }
    let min_head = minimal_head_size(working);
    split_active_turn(working, min_head, tp, Some(usize::MAX)).or_else(|| {
        // The ask's own turn cannot be cut (one round), but the rows before
        // it can go: the bridge rule kept them out of the middle only to
        // keep the summary off the ask, and the split assembly puts it in
        // front of the ask instead.
        let ask = (min_head..working.len())
            .rev()
            .find(|&i| is_ask_row(&working[i]))?;
        let before = working[start.min(ask)..ask]
            .iter()
            .any(|m| markers::strip_handoff(m).is_some());
        before.then_some((ask, ask + 1))
    })
}

/// Summaries longer than this many times their token target are clipped.
pub const SUMMARY_OVERSHOOT_FACTOR: u64 = 2;

/// Clips a summary body that ignored its "Target ~N tokens" guidance by more
/// than [`SUMMARY_OVERSHOOT_FACTOR`]. On small windows an over-long summary
/// would not fit; the grounded task snapshot comes first and is kept.
pub fn clip_summary(body: String, target_tokens: u64) -> String {
    let max_chars = usize::try_from(
        target_tokens
            .saturating_mul(SUMMARY_OVERSHOOT_FACTOR)
            .saturating_mul(tokens::CHARS_PER_TOKEN),
    )
    .unwrap_or(usize::MAX);
    if body.chars().count() <= max_chars {
        return body;
    }
    let mut clipped: String = body.chars().take(max_chars).collect();
    clipped.push_str("\n...[summary clipped to fit the context window]");
    clipped
}

/// Below this window (the 64k trigger floor) summary bodies are held to
/// their budget exactly; at and above it the looser overshoot cap applies.
pub const STRICT_SUMMARY_WINDOW: u64 = super::budget::MINIMUM_CONTEXT_LENGTH;

/// [`clip_summary`] sized for the window: below [`STRICT_SUMMARY_WINDOW`]
/// the body is clipped to the summary budget itself (`target` × 4 chars), so
/// head + summary + tail stay under a small window's trigger and the running
/// summary cannot grow across compactions.
pub fn clip_summary_for_window(body: String, target_tokens: u64, window: u64) -> String {
    if window >= STRICT_SUMMARY_WINDOW {
        return clip_summary(body, target_tokens);
    }
    let max_chars = usize::try_from(target_tokens.saturating_mul(tokens::CHARS_PER_TOKEN))
        .unwrap_or(usize::MAX);
    clip_chars(body, max_chars)
}

/// Clips `body` to at most `max_chars` characters, clip note included.
fn clip_chars(body: String, max_chars: usize) -> String {
    const NOTE: &str = "\n...[summary clipped to fit the context window]";
    if body.chars().count() <= max_chars {
        return body;
    }
    if let Some(fit) = super::salient::fit_lines(&body, max_chars, NOTE.trim_start()) {
        return fit;
    }
    let keep = max_chars.saturating_sub(NOTE.chars().count());
    let mut clipped: String = body.chars().take(keep).collect();
    if let Some(nl) = clipped.rfind('\n').filter(|&nl| nl >= clipped.len() / 2) {
        clipped.truncate(nl);
    }
    clipped.push_str(NOTE);
    clipped
}

/// The running summary quoted in a summary prompt, within `cap` chars:
/// shortened by lines (facts kept over narrative), else cut in the middle.
fn bound_running_summary(previous: &str, cap: usize) -> String {
    super::salient::fit_lines(previous, cap, "[earlier summary shortened to fit]")
        .unwrap_or_else(|| bound_summary_input(previous, cap))
}

/// Longest summary body [`clip_summary_for_window`] leaves whole.
pub fn max_summary_body_chars(target_tokens: u64, window: u64) -> usize {
    let factor = if window >= STRICT_SUMMARY_WINDOW {
        SUMMARY_OVERSHOOT_FACTOR
    } else {
        1
    };
    usize::try_from(
        target_tokens
            .saturating_mul(factor)
            .saturating_mul(tokens::CHARS_PER_TOKEN),
    )
    .unwrap_or(usize::MAX)
}

/// Character cap of a deterministic fallback body: the summary budget
/// (× 4 chars) below [`STRICT_SUMMARY_WINDOW`], `None` (the standard
/// 8,000-char cap) at and above it.
pub fn fallback_body_cap(target_tokens: u64, window: u64) -> Option<usize> {
    if window >= STRICT_SUMMARY_WINDOW {
        return None;
    }
    let cap = usize::try_from(target_tokens.saturating_mul(tokens::CHARS_PER_TOKEN))
        .unwrap_or(usize::MAX);
    Some(cap.min(super::fallback::FALLBACK_MAX_CHARS))
}

/// The smallest head: the system prompt, if first.
pub fn minimal_head_size(msgs: &[Value]) -> usize {
    usize::from(msgs.first().is_some_and(is_instructions))
}

/// True for the row that carries the newest user ask: a real user row, or a
/// user row holding an earlier summary with the ask after its END marker
/// (the shape a split active turn leaves behind).
pub fn is_ask_row(m: &Value) -> bool {
    view::is_real_user(m)
        || (view::is_role(m, "user")
            && matches!(
                markers::classify_handoff(m),
                Handoff::Standalone { live: Some(_), .. }
            ))
}

/// Oversized active turn: when the
/// newest ask at or after `start` is followed by tool rounds costing more than
/// the soft ceiling, returns `(ask, keep_from)`: the rounds from `keep_from`
/// on (the newest that fit, at least one) stay verbatim and the rounds
/// between the ask and `keep_from` are summarised. `keep_from` always starts
/// a round (a non-tool row), so a call is never parted from its results.
///
/// `eager_head_end` (small windows): also split when the ask is at or before
/// this row, where the ordinary cut would either leave it in the head or
/// summarise it, and restate it afterwards, spending its tokens twice.
pub fn split_active_turn(
    msgs: &[Value],
    start: usize,
    p: &TailParams,
    eager_head_end: Option<usize>,
) -> Option<(usize, usize)> {
    let n = msgs.len();
    let ask = (start..n).rev().find(|&i| is_ask_row(&msgs[i]))?;
    if !msgs[ask + 1..].iter().any(view::has_tool_calls) {
        return None;
    }
    let costs = tail::row_costs(msgs);
    let ask_cost = markers::strip_handoff(&msgs[ask])
        .map_or(0, |m| tokens::estimate_msg_budget_tokens(&m, false));
    let soft = p.soft_ceiling.max(p.budget);
    let rounds: u64 = costs[ask + 1..].iter().sum();
    let eager = eager_head_end.is_some_and(|h| ask <= h);
    if ask_cost.saturating_add(rounds) <= soft && !eager {
        return None;
    }
    let starts: Vec<usize> = (ask + 1..n)
        .filter(|&i| !view::is_role(&msgs[i], "tool"))
        .collect();
    let mut keep_from = *starts.last()?;
    let mut acc = ask_cost.saturating_add(costs[keep_from..].iter().sum::<u64>());
    for &g in starts.iter().rev().skip(1) {
        let add: u64 = costs[g..keep_from].iter().sum();
        if acc.saturating_add(add) > soft {
            break;
        }
        acc = acc.saturating_add(add);
        keep_from = g;
    }
    if eager && keep_from <= ask + 1 {
        // Everything fits once pruned, but the call is over the trigger:
        // the oldest round is summarised so the ask is not restated.
        keep_from = starts.get(1).copied().unwrap_or(keep_from);
    }
    (keep_from > ask + 1).then_some((ask, keep_from))
}

/// Whether a candidate is smaller than its input. At or over the trigger
/// threshold (every automatic compaction) only fewer tokens count: a
/// token-neutral rewrite would re-fire on the next request. Below it (manual
/// or forced calls on short chats) fewer rows also count, which is the
/// guard against "messages N→N" loops.
pub fn is_progress(
    tokens_before: u64,
    tokens_after: u64,
    rows_before: usize,
    rows_after: usize,
    threshold: u64,
) -> bool {
    tokens_after < tokens_before || (tokens_before < threshold && rows_after < rows_before)
}

/// Removes blank user echoes right after the latest actionable user row,
/// when an assistant row follows them. A blank row not followed by an
/// assistant may be a deliberate alternation placeholder and stays.
pub fn remove_blank_echoes(mut msgs: Vec<Value>) -> Vec<Value> {
    let Some(u) = view::last_real_user(&msgs, 0) else {
        return msgs;
    };
    let mut end = u + 1;
    while end < msgs.len() && view::is_role(&msgs[end], "user") && view::is_blank(&msgs[end]) {
        end += 1;
    }
    if end > u + 1 && end < msgs.len() && view::is_role(&msgs[end], "assistant") {
        msgs.drain(u + 1..end);
    }
    msgs
}

/// Where the summary carrier ended up after sanitising removed rows.
fn locate_summary(out: &[Value], hint: usize) -> Option<usize> {
    if out.get(hint).is_some_and(view::is_summary) {
        return Some(hint);
    }
    out.iter().position(view::is_summary)
}

/// Number of trailing rows `a` and `b` share (the `kept_suffix` of a result).
pub fn common_suffix(a: &[Value], b: &[Value]) -> usize {
    a.iter()
        .rev()
        .zip(b.iter().rev())
        .take_while(|(x, y)| x == y)
        .count()
}

/// Images in rows before the newest image-bearing user row are replaced by
/// a text stub: they were seen already and cost thousands of tokens each.
fn strip_historical_media(out: &mut [Value]) {
    let Some(newest) = out
        .iter()
        .rposition(|m| view::is_role(m, "user") && view::has_image(m))
    else {
        return;
    };
    for m in out[..newest].iter_mut() {
        if !view::is_role(m, "user") || !view::has_image(m) {
            continue;
        }
        if let Some(Value::Array(parts)) = m.get_mut("content") {
            for p in parts.iter_mut() {
                if view::is_image_part(p) {
                    *p = serde_json::json!({"type": "text", "text": "[Attached image — stripped after compression]"});
                }
            }
        }
        if let Some(o) = m.as_object_mut() {
            o.remove("api_content");
        }
    }
}

/// Mechanical shrinking of a candidate that is not smaller than its input:
/// drop thinking from older assistants, clear old tool
/// bodies, cap a standalone summary.
fn salvage(out: &mut [Value], summary_index: Option<usize>) {
    let newest_asst = view::last_assistant(out);
    for (i, m) in out.iter_mut().enumerate() {
        if Some(i) != newest_asst && view::is_role(m, "assistant") {
            if let Some(o) = m.as_object_mut() {
                o.remove("reasoning");
                o.remove("reasoning_content");
                o.remove("reasoning_details");
            }
        }
    }
    let mut kept = 0;
    for m in out.iter_mut().rev() {
        if !view::is_role(m, "tool") {
            continue;
        }
        let long = m
            .get("content")
            .and_then(Value::as_str)
            .is_some_and(|c| c.chars().count() > prune::PRUNE_MIN_CHARS);
        if !long {
            continue;
        }
        if kept < SALVAGE_KEEP_TOOL_RESULTS {
            kept += 1;
            continue;
        }
        if let Some(o) = m.as_object_mut() {
            o.insert(
                "content".into(),
                Value::String(prune::OLD_TOOL_OUTPUT_CLEARED.to_string()),
            );
            o.remove("api_content");
        }
    }
    if let Some(si) = summary_index {
        if let Some(Value::String(c)) = out[si].get("content").cloned() {
            if matches!(
                markers::classify_handoff(&out[si]),
                Handoff::Standalone { live: None, .. }
            ) && c.chars().count() > SALVAGE_SUMMARY_MAX_CHARS
            {
                let body = markers::summary_body(&c);
                let keep = SALVAGE_SUMMARY_MAX_CHARS
                    .saturating_sub(markers::SUMMARY_PREFIX.len() + markers::END_MARKER.len() + 64);
                let body: String = body.chars().take(keep).collect();
                let text = markers::standalone_content(&markers::normalize_summary_prefix(
                    &format!("{body}\n...[summary truncated]"),
                ));
                if let Some(o) = out[si].as_object_mut() {
                    o.insert("content".into(), Value::String(text));
                }
            }
        }
    }
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

    #[test]
    fn progress_rule() {
        assert!(is_progress(100, 99, 10, 10, 50));
        assert!(
            !is_progress(100, 100, 10, 5, 50),
            "over threshold: tokens must drop"
        );
        assert!(
            is_progress(40, 45, 10, 5, 50),
            "under threshold: fewer rows count"
        );
        assert!(!is_progress(40, 45, 10, 10, 50));
    }

    #[test]
    fn small_windows_clip_to_the_budget_itself() {
        let body = format!("HEAD {}", "x".repeat(10_000));
        let small = clip_summary_for_window(body.clone(), 100, 2_048);
        assert!(small.starts_with("HEAD "));
        assert!(small.chars().count() <= 400, "{}", small.chars().count());
        let large = clip_summary_for_window(body, 100, 128_000);
        assert!(large.chars().count() > 400 && large.chars().count() < 900);
        assert_eq!(fallback_body_cap(204, 2_048), Some(816));
        assert_eq!(fallback_body_cap(2_000, 128_000), None);
    }

    fn round(i: usize, result_chars: usize) -> [Value; 2] {
        [
            serde_json::json!({"role": "assistant", "content": null,
                "tool_calls": [{"id": format!("c{i}"), "function": {"name": "f", "arguments": "{}"}}]}),
            serde_json::json!({"role": "tool", "tool_call_id": format!("c{i}"), "content": "r".repeat(result_chars)}),
        ]
    }

    fn params(budget: u64) -> TailParams {
        TailParams {
            budget,
            soft_ceiling: budget,
            protect_last_n: 20,
            min_tail_user_messages: 1,
            allow_split_turn: false,
        }
    }

    #[test]
    fn split_cuts_between_rounds_and_keeps_the_newest() {
        let mut msgs = vec![
            serde_json::json!({"role": "system", "content": "s"}),
            serde_json::json!({"role": "user", "content": "ask"}),
        ];
        for i in 0..5 {
            msgs.extend(round(i, 800));
        }
        // Each round costs ~230 tokens: 500 keeps the two newest.
        let (ask, keep) = split_active_turn(&msgs, 1, &params(500), None).unwrap();
        assert_eq!(ask, 1);
        assert_eq!(keep, msgs.len() - 4);
        assert!(view::has_tool_calls(&msgs[keep]));
        // A ceiling below one round still keeps the newest round whole.
        let (_, keep) = split_active_turn(&msgs, 1, &params(10), None).unwrap();
        assert_eq!(keep, msgs.len() - 2);
        // A turn that fits is not split, unless eager and the ask is in the head.
        assert_eq!(split_active_turn(&msgs, 1, &params(100_000), None), None);
        assert_eq!(
            split_active_turn(&msgs, 1, &params(100_000), Some(4)),
            Some((1, 4))
        );
        // One round only: nothing inside the turn to summarise.
        let short: Vec<Value> = msgs[..4].to_vec();
        assert_eq!(split_active_turn(&short, 1, &params(10), None), None);
    }

    #[test]
    fn a_summary_carrying_the_ask_is_an_ask_row() {
        let carried = markers::prepend_summary(
            &Value::String("do it".into()),
            &markers::normalize_summary_prefix("B"),
        );
        let declared = |content: &Value| {
            let mut m = serde_json::json!({"role": "user", "content": content});
            markers::declare_summary(&mut m);
            m
        };
        assert!(is_ask_row(&declared(&carried)));
        let bare = markers::standalone_content(&markers::normalize_summary_prefix("B"));
        assert!(!is_ask_row(&declared(&Value::String(bare))));
        assert!(!is_ask_row(
            &serde_json::json!({"role": "assistant", "content": "x"})
        ));
    }

    #[test]
    fn clip_summary_keeps_the_head() {
        let body = format!("HEAD {}", "x".repeat(10_000));
        let out = clip_summary(body, 100);
        assert!(out.starts_with("HEAD "));
        assert!(out.chars().count() < 900);
        assert_eq!(clip_summary("short".into(), 100), "short");
    }
}
