//! One batch compaction from cut to commit: the summary of the middle (or
//! the deterministic fallback, or an abort), the assembled candidate and
//! its size check, the last resort of a request that must fit, and the one
//! commit of the compressor's state at the end.

use serde_json::Value;

use super::clip::fallback_body_cap;
use super::cut::Cut;
use super::failure::{worst, AbortReason};
use super::generate::SummaryState;
use super::instructions::is_instructions;
use super::micro::MicroState;
use super::outcome::{common_suffix, CompressResult, CompressTelemetry, NoOpReason, Outcome};
use super::salvage::{is_progress, locate_summary, salvage, strip_historical_media};
use super::summary_call::SummaryAttempt;
use super::{CompressOptions, Compressor};
use crate::assemble;
use crate::fallback::{build_fallback_body_capped, build_fallback_summary};
use crate::last_resort::Fit;
use crate::markers::{self, Handoff};
use crate::sanitize::sanitize_tool_pairs;
use crate::summariser::Summariser;
use crate::tokens;
use crate::user_messages;
use crate::view;

/// Feasibility skip: the middle must be under this share of the threshold.
pub(super) const FEASIBILITY_MIDDLE_RATIO: f64 = 0.10;

/// Rows a summary was rejected for, and how many more passes remember it.
#[derive(Clone, Copy, Debug)]
pub(super) struct RejectedRows {
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

    /// Runs one compaction of `messages`: cut, summarise (or fall back),
    /// assemble, check the candidate is smaller. State is committed once,
    /// at the end, according to the outcome. Instruction rows are never
    /// part of it (`compressor::instructions`).
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
        let mut state = self.adopt_handoffs(&cut.working);
        state.kept_after = Some(cut.working.len() - cut.end);
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
                kept_after: None,
            });
        }
        self.finish(messages, pass, ending)
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
            kept_after: None,
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
            crate::budget::summary_budget(middle_tokens, self.trigger.max_summary_tokens());
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
/// largest messages are shortened ([`crate::last_resort::shrink_to_fit`]).
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
    let Some(shrunk) = crate::last_resort::shrink_to_fit(out, mark, Fit::IfReachable) else {
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
    let shrunk = match crate::last_resort::shrink_to_fit(base, fit, Fit::IfReachable) {
        Some(s) => s,
        None => match crate::last_resort::drop_oldest_exchanges(base, fit) {
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
                match crate::last_resort::shrink_to_fit(base, fit, Fit::Insist) {
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
