//! The compress pipeline (reference §3): head protection, tool-output
//! pruning, tail cut, handoff rehydration, summary generation with failure
//! handling, assembly, sanitising and the final size check.
//!
//! A compaction either commits (a strictly smaller conversation) or leaves
//! the input exactly as it was: aborted, no-op and rejected results return the
//! input messages unchanged.

use std::sync::Arc;

use serde_json::Value;

use super::assemble::{self, Placement};
use super::config::CompactionConfig;
use super::fallback::{build_fallback_body_capped, build_fallback_summary};
use super::markers::{self, Handoff};
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
    /// Reference failure class name, when the attempt did not go cleanly.
    pub failure_class: Option<&'static str>,
    /// The caller's token figure, if given.
    pub current_tokens: Option<u64>,
}

/// What `compress` produced.
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
    /// Content-free accounting.
    pub telemetry: CompressTelemetry,
}

/// A summary failure after classification.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FailureInfo {
    /// Cooldown class.
    pub class: FailureClass,
    /// Access or quota failure (abort).
    pub auth: bool,
    /// Network or stream failure (abort).
    pub network: bool,
    /// Overloaded provider (abort).
    pub overload: bool,
}

fn lower_contains_any(hay: &str, needles: &[&str]) -> bool {
    needles.iter().any(|n| hay.contains(n))
}

/// The leading instructions row: `system`, or `developer` (its successor
/// for OpenAI reasoning models; assembly already treats it as system).
fn is_instructions(m: &Value) -> bool {
    view::is_role(m, "system") || view::is_role(m, "developer")
}

/// Access/quota test of reference §3.14: a rate limit is transient; auth
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

/// Classifies a failed summary call (reference §3.9).
pub fn classify_error(e: &SummaryError) -> FailureInfo {
    let m = e.message.to_lowercase();
    let mut info = FailureInfo {
        class: FailureClass::Other,
        auth: false,
        network: false,
        overload: false,
    };
    if e.kind == SummaryErrorKind::NoProvider {
        info.class = FailureClass::NoProvider;
        return info;
    }
    if is_access_or_quota_error(e.status, &e.message) {
        info.auth = true;
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
        info.network = true;
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
        info.overload = true;
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

fn failure_class_name(f: &FailureInfo, invalid: Option<&SummaryInvalid>) -> &'static str {
    match invalid {
        Some(SummaryInvalid::Empty) => return "summary_empty_content_failure",
        Some(SummaryInvalid::Truncated) => return "summary_truncated_failure",
        Some(SummaryInvalid::Refusal) => return "summary_generation_failed",
        None => {}
    }
    if f.auth {
        "summary_auth_failure"
    } else if f.network {
        "summary_network_failure"
    } else if f.overload {
        "summary_overload_failure"
    } else {
        "summary_generation_failed"
    }
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
    /// Error text of the last failed summary attempt (≤ 220 chars).
    pub last_summary_error: Option<String>,
    /// Terminal flag: access/quota failure. Survives until a summary succeeds.
    pub last_summary_auth_failure: bool,
    /// Terminal flag: network failure. Survives until a summary succeeds.
    pub last_summary_network_failure: bool,
    /// Terminal flag: truncated summary.
    pub last_summary_truncated_failure: bool,
    /// Terminal flag: empty summary.
    pub last_summary_empty_failure: bool,
    /// Terminal flag: overloaded provider.
    pub last_summary_overload_failure: bool,
    /// The distinct summary model that failed in this call, if any.
    pub last_aux_model_failure_model: Option<String>,
    /// Its error text (≤ 220 chars).
    pub last_aux_model_failure_error: Option<String>,
    /// The last call aborted (input returned unchanged).
    pub last_compress_aborted: bool,
    /// The last call used the deterministic fallback.
    pub last_summary_fallback_used: bool,
    /// Rows the last call summarised.
    pub last_summary_dropped_count: usize,
    /// The last call took the feasibility skip.
    pub last_feasibility_skip: bool,
    /// The last call committed a smaller conversation.
    pub last_compression_made_progress: bool,
    /// Micro-compaction state.
    pub micro: super::micro::MicroState,
}

struct SummaryOutcome {
    summary: Option<String>,
    calls: u32,
    chunks: usize,
    failure: Option<&'static str>,
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
            last_summary_error: None,
            last_summary_auth_failure: false,
            last_summary_network_failure: false,
            last_summary_truncated_failure: false,
            last_summary_empty_failure: false,
            last_summary_overload_failure: false,
            last_aux_model_failure_model: None,
            last_aux_model_failure_error: None,
            last_compress_aborted: false,
            last_summary_fallback_used: false,
            last_summary_dropped_count: 0,
            last_feasibility_skip: false,
            last_compression_made_progress: false,
            micro: super::micro::MicroState::default(),
        }
    }

    /// `/new`: forget everything about the session.
    pub fn reset_session(&mut self) {
        self.trigger.reset_session();
        self.previous_summary = None;
        self.summary_has_user_turn = true;
        self.clear_terminal_flags();
        self.last_summary_error = None;
        self.last_aux_model_failure_model = None;
        self.last_aux_model_failure_error = None;
        self.micro = super::micro::MicroState::default();
    }

    fn clear_terminal_flags(&mut self) {
        self.last_summary_auth_failure = false;
        self.last_summary_network_failure = false;
        self.last_summary_truncated_failure = false;
        self.last_summary_empty_failure = false;
        self.last_summary_overload_failure = false;
    }

    /// The terminal failure that forbids a destructive fallback, if any.
    ///
    /// Auth/quota and network failures always abort (design §11). Truncated,
    /// empty and overloaded summaries abort only with
    /// `abort_on_degraded_summary`; otherwise they get the deterministic
    /// fallback, as issue 5 and the v-A reference specify.
    pub fn terminal_abort_reason(&self) -> Option<AbortReason> {
        if self.last_summary_auth_failure {
            Some(AbortReason::AuthFailure)
        } else if self.last_summary_network_failure {
            Some(AbortReason::NetworkFailure)
        } else if !self.cfg.abort_on_degraded_summary {
            None
        } else if self.last_summary_truncated_failure {
            Some(AbortReason::TruncatedSummary)
        } else if self.last_summary_empty_failure {
            Some(AbortReason::EmptySummary)
        } else if self.last_summary_overload_failure {
            Some(AbortReason::Overloaded)
        } else {
            None
        }
    }

    /// `protect_first_n` after decay: 0 once a compaction happened, a
    /// summary is in memory, or a handoff sits near the start (#11996).
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
    /// failed: records the failure for the caller's warning and clears the
    /// cooldown so the retry can run at once.
    pub fn fallback_to_main_for_compression(&mut self, error: &str) {
        self.last_aux_model_failure_model = self.summary_model.take();
        self.last_aux_model_failure_error = Some(truncate_error_text(error));
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

    /// One summary call with the fallback-to-main retry. `Ok(body)` is the
    /// cleaned, validated body; `Err` carries the failure already recorded.
    async fn call_once(
        &mut self,
        s: &dyn Summariser,
        prompt: String,
        calls: &mut u32,
        no_user_session: bool,
    ) -> Result<String, &'static str> {
        loop {
            let model = if self.distinct_summary_model() {
                self.summary_model.clone()
            } else {
                None
            };
            let req = SummaryRequest {
                model: model.clone(),
                prompt: prompt.clone(),
                max_tokens: None,
                temperature: None,
            };
            *calls += 1;
            let (err_text, info, invalid) = match s.summarise(req).await {
                Ok(reply) => {
                    let text = reply_text(&reply);
                    match serialize::validate_summary_reply(
                        text.as_deref(),
                        reply.finish_reason.as_deref(),
                        reply.refusal.as_deref(),
                        reply.reasoning.as_deref(),
                    ) {
                        // Provenance: a session without user turns must not
                        // get a summary that attributes anything to a user
                        // (#64650); that reply is treated as a refusal.
                        Ok(body) if no_user_session && serialize::attributes_to_user(&body) => {
                            let info = FailureInfo {
                                class: FailureClass::Other,
                                auth: false,
                                network: false,
                                overload: false,
                            };
                            (
                                "summary attributed text to a user in a session without user turns"
                                    .to_string(),
                                info,
                                Some(SummaryInvalid::Refusal),
                            )
                        }
                        Ok(body) => return Ok(body),
                        Err(inv) => {
                            let class = match inv {
                                SummaryInvalid::Empty => FailureClass::EmptyContent,
                                SummaryInvalid::Truncated => FailureClass::Truncated,
                                SummaryInvalid::Refusal => FailureClass::Other,
                            };
                            let info = FailureInfo {
                                class,
                                auth: false,
                                network: false,
                                overload: false,
                            };
                            (inv.to_string(), info, Some(inv))
                        }
                    }
                }
                Err(e) => (e.to_string(), classify_error(&e), None),
            };
            if model.is_some() && !self.summary_model_fallen_back {
                tracing::warn!("summary model failed; retrying once on the main model");
                self.fallback_to_main_for_compression(&err_text);
                continue;
            }
            let name = failure_class_name(&info, invalid.as_ref());
            self.record_failure(info, invalid.as_ref(), &err_text);
            return Err(name);
        }
    }

    fn record_failure(&mut self, info: FailureInfo, invalid: Option<&SummaryInvalid>, err: &str) {
        let secs = self.trigger.note_summary_failure(info.class, err);
        // Class and status only: the error text may quote the provider.
        tracing::warn!(
            cooldown_secs = secs,
            class = ?info.class,
            invalid = ?invalid,
            auth = info.auth,
            network = info.network,
            "summary generation failed"
        );
        self.last_summary_error = Some(truncate_error_text(err));
        if info.auth {
            self.last_summary_auth_failure = true;
        }
        if info.network {
            self.last_summary_network_failure = true;
        }
        if info.overload {
            self.last_summary_overload_failure = true;
        }
        match invalid {
            Some(SummaryInvalid::Empty) => self.last_summary_empty_failure = true,
            Some(SummaryInvalid::Truncated) => self.last_summary_truncated_failure = true,
            _ => {}
        }
    }

    /// Generates the summary of `turns` (reference §3.8-§3.9): `Some(prefix +
    /// body)` on success, `None` on failure or during a cooldown. Long input
    /// is summarised in rolling chunks that each fit the summariser's prompt
    /// budget.
    pub async fn generate_summary(
        &mut self,
        s: &dyn Summariser,
        turns: &[Value],
        focus_topic: Option<&str>,
    ) -> Option<String> {
        self.generate_summary_inner(s, turns, focus_topic, false, None)
            .await
            .summary
    }

    async fn generate_summary_inner(
        &mut self,
        s: &dyn Summariser,
        turns: &[Value],
        focus_topic: Option<&str>,
        bypass_cooldown: bool,
        today: Option<&str>,
    ) -> SummaryOutcome {
        let mut out = SummaryOutcome {
            summary: None,
            calls: 0,
            chunks: 0,
            failure: None,
        };
        if !bypass_cooldown && self.trigger.cooldown_active() {
            return out;
        }
        let middle_tokens: u64 = turns
            .iter()
            .map(|m| tokens::estimate_msg_budget_tokens(m, false))
            .sum();
        let max_summary = self.trigger.max_summary_tokens();
        let target = super::budget::summary_budget(middle_tokens, max_summary);
        let auto = if focus_topic.is_none() {
            Self::auto_focus(turns)
        } else {
            None
        };
        let focus = focus_topic.map(str::to_owned).or(auto);
        let no_user_turns = !turns.iter().any(view::is_real_user) && !self.summary_has_user_turn;

        let budget = s.prompt_budget_chars();
        let overhead = serialize::prompt_overhead_chars(focus.as_deref());
        let serialized = serialize_for_summary(turns);
        let prev_len = self
            .previous_summary
            .as_deref()
            .map_or(0, |p| p.chars().count().min(SUMMARY_INPUT_MAX_CHARS));
        let turns_len = serialized.chars().count().min(SUMMARY_INPUT_MAX_CHARS);

        let fits = overhead + prev_len + turns_len <= budget;
        let chunks: Vec<String> = if fits {
            vec![serialized]
        } else {
            let room = budget.saturating_sub(overhead).max(1_000);
            let per_chunk = (room - room / 3).max(500);
            let mut parts: Vec<String> = chunk_for_budget(turns, per_chunk)
                .iter()
                .map(|c| bound_summary_input(&serialize_for_summary(c), per_chunk))
                .collect();
            if parts.len() > MAX_SUMMARY_CHUNKS {
                // Bounded like the reference's single-prompt input: keep the
                // oldest and the newest parts, drop the middle (#96603: an
                // unbounded digest loop made 28 calls).
                let head = MAX_SUMMARY_CHUNKS * 3 / 8;
                let tail_n = MAX_SUMMARY_CHUNKS - head;
                let keep_tail = parts.split_off(parts.len() - tail_n);
                parts.truncate(head);
                parts.extend(keep_tail);
            }
            parts
        };
        out.chunks = chunks.len();
        // In chunked mode the running summary gets a third of the room, the
        // chunk the rest, so every prompt fits the summariser.
        let prev_cap = if fits {
            SUMMARY_INPUT_MAX_CHARS
        } else {
            (budget.saturating_sub(overhead) / 3).max(500)
        };

        let mut running = self.previous_summary.clone();
        let n = chunks.len();
        for (i, text) in chunks.iter().enumerate() {
            let prev = running.as_deref().map(|p| bound_summary_input(p, prev_cap));
            let prompt = build_summary_prompt(&PromptParts {
                turns: text,
                previous_summary: prev.as_deref(),
                focus_topic: focus.as_deref(),
                target_tokens: target,
                today,
                no_user_turns,
                chunk: (n > 1).then_some((i, n)),
            });
            match self
                .call_once(s, prompt, &mut out.calls, no_user_turns)
                .await
            {
                Ok(body) => running = Some(body),
                Err(name) => {
                    out.failure = Some(name);
                    return out;
                }
            }
        }
        let Some(body) = running else {
            return out;
        };
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
        let window = self.trigger.context_length();
        let body = clip_summary_for_window(
            serialize::ground_task_snapshot_with(&body, grounding),
            target,
            window,
        );
        self.trigger.note_summary_success();
        self.clear_terminal_flags();
        self.last_summary_error = None;
        self.previous_summary = Some(body.clone());
        out.summary = Some(markers::normalize_summary_prefix_with(
            markers::summary_prefix_for(window),
            &body,
        ));
        out
    }

    /// Runs one compaction of `messages` (reference §3).
    pub async fn compress(
        &mut self,
        messages: &[Value],
        s: &dyn Summariser,
        opts: CompressOptions,
    ) -> CompressResult {
        // Per-call flags. The terminal failure flags are deliberately kept:
        // a cooldown early-return does not set them again, and forgetting
        // them would fall through to a destructive fallback (#29559).
        self.last_summary_fallback_used = false;
        self.last_summary_dropped_count = 0;
        self.last_feasibility_skip = false;
        self.last_summary_error = None;
        self.last_aux_model_failure_model = None;
        self.last_aux_model_failure_error = None;
        self.last_compress_aborted = false;
        self.last_compression_made_progress = false;

        let tokens_before = tokens::estimate_messages_tokens_rough(messages);
        let mut tel = CompressTelemetry {
            messages_before: messages.len(),
            current_tokens: opts.current_tokens,
            ..Default::default()
        };
        if opts.force {
            self.trigger.clear_failure_cooldown();
            self.trigger.clear_structural_backoff();
        }

        let n = messages.len();
        // A small window cannot afford a protected head of
        // whole tool rounds: an agent's first rounds would leave too few rows
        // to compact (a no-op, then an overflow). The head shrinks to the
        // system prompt; an oversized active turn then carries the task.
        let relax_head = self.trigger.context_length() < STRICT_SUMMARY_WINDOW
            && n <= self.protect_head_size(messages) + MIN_ROWS_AFTER_HEAD;
        let head_of = |c: &Self, msgs: &[Value]| {
            if relax_head {
                minimal_head_size(msgs).min(c.protect_head_size(msgs))
            } else {
                c.protect_head_size(msgs)
            }
        };
        let head_size = head_of(self, messages);
        tel.head_rows = head_size;
        if n <= head_size + MIN_ROWS_AFTER_HEAD {
            return self.no_op(
                messages,
                NoOpReason::InsufficientMessages,
                tokens_before,
                tel,
            );
        }
        // Phase 1: prune tool outputs (no LLM).
        let tp = self.tail_params();
        // Small windows keep an agent's newest tool result whole when it
        // takes at most half the trigger: the split keeps its round, and a
        // stub in its place would make the model repeat the call.
        let keep_newest_tool_max = (self.trigger.context_length() < STRICT_SUMMARY_WINDOW)
            .then(|| self.trigger.threshold_tokens() / 2);
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
        let wn = working.len();
        // The head is measured on the working list (a removed blank echo
        // shifts rows) and never ends inside a tool group.
        let mut compress_start = head_of(self, &working);
        while compress_start < wn && view::is_role(&working[compress_start], "tool") {
            compress_start += 1;
        }
        if compress_start >= wn {
            return self.no_op(
                messages,
                NoOpReason::NoCompressibleWindow,
                tokens_before,
                tel,
            );
        }

        // An active turn too large for the tail is cut inside, between tool
        // rounds; its ask is carried verbatim after the summary.
        // The ordinary cut: tail by tokens, then the bridge rule (an
        // actionable user row must not sit in the slot where a role collision
        // would merge the summary into it).
        let mut normal_end = tail::find_tail_cut_by_tokens(&working, compress_start, &tp);
        if let Some(u) = view::last_real_user(&working, compress_start) {
            if normal_end == u && u > 0 {
                let mut b = u - 1;
                if view::is_role(&working[b], "tool") {
                    while b > 0 && view::is_role(&working[b], "tool") {
                        b -= 1;
                    }
                }
                if b > compress_start && view::is_role(&working[b], "assistant") {
                    normal_end = b;
                }
            }
        }
        let small = self.trigger.context_length() < STRICT_SUMMARY_WINDOW;
        // Large windows keep the reference's protected head: only an ask
        // after it is carried.
        let ask_from = if small {
            minimal_head_size(&working)
        } else {
            compress_start
        };
        let mut split = split_active_turn(&working, ask_from, &tp, small.then_some(compress_start));
        if split.is_none() && small {
            // Pruning may have shrunk the active turn under the ceiling while
            // the ordinary cut finds nothing but earlier summaries to
            // compact: splitting the turn is the only way forward. (The
            // caller's trigger also counts `tools`, which this estimate does
            // not see, so no threshold test here.)
            let nothing = working[compress_start..normal_end.max(compress_start)]
                .iter()
                .all(|m| markers::strip_handoff(m).is_none());
            if nothing {
                let min_head = minimal_head_size(&working);
                split =
                    split_active_turn(&working, min_head, &tp, Some(usize::MAX)).or_else(|| {
                        // The ask's own turn cannot be cut (one round), but the
                        // rows before it can go: the bridge rule kept them out of
                        // the middle only to keep the summary off the ask, and
                        // the split assembly puts it in front of the ask instead.
                        let ask = (min_head..wn).rev().find(|&i| is_ask_row(&working[i]))?;
                        let before = working[compress_start.min(ask)..ask]
                            .iter()
                            .any(|m| markers::strip_handoff(m).is_some());
                        before.then_some((ask, ask + 1))
                    });
            }
        }
        // At small windows the ask may sit in the protected head (an agent's
        // only task): the head then ends before it, so the ask is carried
        // after the summary instead of being restated.
        if let Some((ask, _)) = split {
            compress_start = compress_start.min(ask);
        }
        let compress_end = match split {
            Some((_, keep_from)) => keep_from,
            None => normal_end,
        };
        let split_ask = split.map(|(ask, _)| ask);
        if compress_start >= compress_end {
            return self.no_op(
                messages,
                NoOpReason::NoCompressibleWindow,
                tokens_before,
                tel,
            );
        }

        // Handoff scan over the whole transcript (after the system row).
        let snapshot = (self.previous_summary.clone(), self.summary_has_user_turn);
        let sys = usize::from(is_instructions(&working[0]));
        let mut handoff_bodies = Vec::new();
        for m in working.iter().skip(sys) {
            match markers::classify_handoff(m) {
                Handoff::None => {}
                Handoff::Standalone { body, .. } | Handoff::Merged { body, .. } => {
                    handoff_bodies.push(body);
                }
            }
        }
        if handoff_bodies.is_empty() {
            // A summary in memory without any handoff on the wire belongs to
            // another conversation (#38788).
            self.previous_summary = None;
        } else if self.previous_summary.is_none() {
            self.previous_summary = Some(handoff_bodies.join("\n\n"));
        }
        let has_real_user = working.iter().any(view::is_real_user);
        // Provenance: a real user row decides; without one, an earlier
        // summary decides by its sentinel; a fresh session without user rows
        // has none (no user intent may be attributed, #64650).
        self.summary_has_user_turn = has_real_user
            || self
                .previous_summary
                .as_deref()
                .is_some_and(|p| !p.contains(markers::NO_USER_SENTINEL));
        // A handoff inside the tail is unwrapped in place (its body is in the
        // running summary); the tail is not advanced past it, which could
        // summarise the live ask that a user-leading merge carries.
        let tail_start = compress_end;
        let middle: Vec<Value> = (compress_start..compress_end)
            .filter(|&i| Some(i) != split_ask)
            .filter_map(|i| markers::strip_handoff(&working[i]))
            .collect();
        if middle.is_empty() {
            return self.no_op(
                messages,
                NoOpReason::EmptyPostHandoffWindow,
                tokens_before,
                tel,
            );
        }
        let middle_tokens: u64 = middle
            .iter()
            .map(|m| tokens::estimate_msg_budget_tokens(m, false))
            .sum();
        tel.middle_tokens = middle_tokens;

        // Summary, or the feasibility skip.
        let threshold = self.trigger.threshold_tokens();
        let skip = !opts.force
            && self.trigger.ineffective_compression_count >= 1
            && (middle_tokens as f64) < threshold as f64 * FEASIBILITY_MIDDLE_RATIO;
        let summary = if skip {
            self.last_feasibility_skip = true;
            self.trigger.prellm_skip_count = self.trigger.prellm_skip_count.saturating_add(1);
            tel.failure_class = Some("feasibility_skip");
            None
        } else {
            let so = self
                .generate_summary_inner(
                    s,
                    &middle,
                    opts.focus_topic.as_deref(),
                    opts.bypass_cooldown,
                    opts.today.as_deref(),
                )
                .await;
            tel.summary_calls = so.calls;
            tel.chunk_count = so.chunks;
            if self.last_aux_model_failure_model.is_some() {
                tel.failure_class = Some("aux_model_fallback");
            }
            if so.failure.is_some() {
                tel.failure_class = so.failure;
            }
            so.summary
        };

        let summary = match summary {
            Some(s) => s,
            None => {
                if !skip {
                    let reason = self.terminal_abort_reason().or(self
                        .cfg
                        .abort_on_summary_failure
                        .then_some(AbortReason::SummaryFailed));
                    if let Some(r) = reason {
                        self.previous_summary = snapshot.0;
                        self.summary_has_user_turn = snapshot.1;
                        return self.abort(messages, r, tokens_before, tel);
                    }
                }
                let why = if skip {
                    "feasibility skip: the summarised window was too small for an LLM call"
                } else {
                    self.last_summary_error
                        .as_deref()
                        .unwrap_or("summary unavailable (cooldown)")
                };
                let why = why.to_string();
                let window = self.trigger.context_length();
                let target =
                    super::budget::summary_budget(middle_tokens, self.trigger.max_summary_tokens());
                let fb = match fallback_body_cap(target, window) {
                    Some(cap) => format!(
                        "{}\n{}",
                        markers::SUMMARY_PREFIX,
                        build_fallback_body_capped(
                            &middle,
                            self.previous_summary.as_deref(),
                            &why,
                            cap
                        )
                    ),
                    None => build_fallback_summary(&middle, self.previous_summary.as_deref(), &why),
                };
                let body = markers::summary_body(&fb);
                if body.trim().is_empty() {
                    self.previous_summary = snapshot.0;
                    self.summary_has_user_turn = snapshot.1;
                    tel.failure_class = Some("deterministic_fallback_invalid");
                    return self.abort(messages, AbortReason::FallbackInvalid, tokens_before, tel);
                }
                self.last_summary_fallback_used = true;
                self.previous_summary = Some(body);
                markers::normalize_summary_prefix_with(markers::summary_prefix_for(window), &fb)
            }
        };

        // Assembly.
        let head: Vec<Value> = working[..compress_start]
            .iter()
            .filter_map(markers::strip_handoff)
            .collect();
        let tail_rows: Vec<Value> = split_ask
            .into_iter()
            .chain(tail_start.min(wn)..wn)
            .filter_map(|i| markers::strip_handoff(&working[i]))
            .collect();
        let asm = if split_ask.is_some() {
            assemble::assemble_split_turn(head, &summary, tail_rows)
        } else {
            assemble::assemble(head, &summary, tail_rows)
        };
        let mut out = sanitize_tool_pairs(asm.messages);
        let mut summary_index = locate_summary(&out, asm.summary_index, asm.placement);
        // A split turn carries its ask verbatim; restating it would duplicate
        // the user's text.
        if split_ask.is_none() {
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
        let mut tokens_after = tokens::estimate_messages_tokens_rough(&out);
        if !is_progress(tokens_before, tokens_after, n, out.len(), threshold) {
            salvage(&mut out, summary_index);
            tokens_after = tokens::estimate_messages_tokens_rough(&out);
            let user_ok = out.iter().any(|m| view::is_role(m, "user"));
            if !is_progress(tokens_before, tokens_after, n, out.len(), threshold) || !user_ok {
                self.previous_summary = snapshot.0;
                self.summary_has_user_turn = snapshot.1;
                self.trigger.record_rejected_compaction();
                tel.failure_class = Some("rejected_not_smaller");
                return self.finish_unchanged(messages, Outcome::Rejected, tokens_before, tel);
            }
            summary_index = locate_summary(&out, summary_index.unwrap_or(0), asm.placement);
        }

        self.last_summary_dropped_count =
            compress_end - compress_start - usize::from(split_ask.is_some());
        self.last_compression_made_progress = true;
        self.trigger.compression_count = self.trigger.compression_count.saturating_add(1);
        self.micro = super::micro::MicroState::default();
        tel.messages_after = out.len();
        let kept_suffix = common_suffix(messages, &out);
        tracing::info!(
            messages_before = tel.messages_before,
            messages_after = tel.messages_after,
            tokens_before,
            tokens_after,
            fallback = self.last_summary_fallback_used,
            "compaction committed"
        );
        CompressResult {
            messages: out,
            outcome: Outcome::Compacted,
            summary_index,
            fallback_used: self.last_summary_fallback_used,
            feasibility_skip: self.last_feasibility_skip,
            dropped_count: self.last_summary_dropped_count,
            tokens_before,
            tokens_after,
            kept_suffix,
            telemetry: tel,
        }
    }

    fn no_op(
        &mut self,
        messages: &[Value],
        reason: NoOpReason,
        tokens_before: u64,
        mut tel: CompressTelemetry,
    ) -> CompressResult {
        // Nothing to compact is a backoff, not a strike (lesson 3).
        self.trigger.set_structural_backoff();
        tel.failure_class = Some(match reason {
            NoOpReason::InsufficientMessages => "insufficient_messages",
            NoOpReason::NoCompressibleWindow => "no_compressible_window",
            NoOpReason::EmptyPostHandoffWindow => "empty_post_handoff_window",
        });
        self.finish_unchanged(messages, Outcome::NoOp(reason), tokens_before, tel)
    }

    fn abort(
        &mut self,
        messages: &[Value],
        reason: AbortReason,
        tokens_before: u64,
        tel: CompressTelemetry,
    ) -> CompressResult {
        self.last_compress_aborted = true;
        self.last_summary_fallback_used = false;
        self.last_summary_dropped_count = 0;
        tracing::warn!(?reason, "compaction aborted; messages forwarded unchanged");
        self.finish_unchanged(messages, Outcome::Aborted(reason), tokens_before, tel)
    }

    fn finish_unchanged(
        &mut self,
        messages: &[Value],
        outcome: Outcome,
        tokens_before: u64,
        mut tel: CompressTelemetry,
    ) -> CompressResult {
        tel.messages_after = messages.len();
        CompressResult {
            messages: messages.to_vec(),
            outcome,
            summary_index: None,
            fallback_used: false,
            feasibility_skip: self.last_feasibility_skip,
            dropped_count: 0,
            tokens_before,
            tokens_after: tokens_before,
            kept_suffix: messages.len(),
            telemetry: tel,
        }
    }
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

/// Below this window (the reference's 64k trigger floor) summary bodies are
/// held to their budget exactly; at and above it the reference caps apply.
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
    let keep = max_chars.saturating_sub(NOTE.chars().count());
    let mut clipped: String = body.chars().take(keep).collect();
    clipped.push_str(NOTE);
    clipped
}

/// Character cap of a deterministic fallback body: the summary budget
/// (× 4 chars) below [`STRICT_SUMMARY_WINDOW`], `None` (the reference's
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
    usize::from(msgs.first().is_some_and(|m| view::is_role(m, "system")))
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

/// Oversized active turn (§3.5 step 7, #80449, kept verbatim here): when the
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
/// reference's guard against "messages N→N" loops (#40803).
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
/// when an assistant row follows them (§3.4). A blank row not followed by an
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
fn locate_summary(out: &[Value], hint: usize, placement: Placement) -> Option<usize> {
    if out.get(hint).is_some_and(view::is_summary) {
        return Some(hint);
    }
    let _ = placement;
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

/// Mechanical shrinking of a candidate that is not smaller than its input
/// (§3.15 salvage): drop thinking from older assistants, clear old tool
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
        assert!(!t.network && !t.auth);
        assert_eq!(err(Http, Some(504), "gateway").class, FailureClass::Timeout);
        assert_eq!(
            err(Http, None, "request timed out").class,
            FailureClass::Timeout
        );
        assert_eq!(err(Decode, None, "bad body").class, FailureClass::Decode);
        let n = err(Network, None, "connection refused");
        assert!(n.network);
        assert_eq!(n.class, FailureClass::StreamClosed);
        assert!(err(Http, None, "peer closed connection without sending").network);
        let o = err(Http, Some(529), "Overloaded");
        assert!(o.overload);
        assert_eq!(
            err(Http, Some(404), "no such model").class,
            FailureClass::ModelNotFound
        );
        assert_eq!(err(Http, Some(500), "boom").class, FailureClass::Other);
        assert!(err(Http, Some(401), "nope").auth);
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
        assert!(is_ask_row(
            &serde_json::json!({"role": "user", "content": carried})
        ));
        let bare = markers::standalone_content(&markers::normalize_summary_prefix("B"));
        assert!(!is_ask_row(
            &serde_json::json!({"role": "user", "content": bare})
        ));
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
