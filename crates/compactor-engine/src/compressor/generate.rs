//! Summary generation from a running summary: the chunk plan that fits the
//! summariser's prompt budget, the prompts, the grounding of the task
//! snapshot, the user's own words kept beside it, and what an attempt
//! teaches the compressor (model switch, cooldown, standing failure).

use serde_json::Value;

use super::clip::{clip_summary_for_window, max_summary_body_chars, STRICT_SUMMARY_WINDOW};
use super::failure::worst;
use super::summary_call::{SummaryAttempt, SummaryCall};
use super::Compressor;
use crate::markers;
use crate::redact::redact_secrets;
use crate::serialize::{
    self, bound_summary_input, build_in_context_prompt, build_summary_prompt, chunk_for_budget,
    serialize_for_summary, PromptParts, SUMMARY_INPUT_MAX_CHARS,
};
use crate::summariser::{InContextAsk, Summariser};
use crate::tokens;
use crate::user_messages;
use crate::view;

/// Auto focus: this many newest user turns…
pub(super) const AUTO_FOCUS_TURNS: usize = 3;
/// …each clipped to this many characters…
pub(super) const AUTO_FOCUS_TURN_CHARS: usize = 260;
/// …and this many in total.
pub(super) const AUTO_FOCUS_TOTAL_CHARS: usize = 700;

/// Most summary calls one compaction makes when it has to chunk.
pub(super) const MAX_SUMMARY_CHUNKS: usize = 8;

/// The running summary a compaction works from and keeps if it commits.
#[derive(Clone, Debug)]
pub(super) struct SummaryState {
    pub(super) previous: Option<String>,
    pub(super) has_user_turn: bool,
    /// The summary lands in the conversation: it carries the user's own
    /// messages ([`user_messages`]). A summary made on its own does not.
    pub(super) keep_said: bool,
    /// Messages at the end of the compacted history kept after the summary,
    /// when a summary may be asked after the rest of it
    /// ([`crate::InContextAsk`]); `None` for one made on its own.
    pub(super) kept_after: Option<usize>,
}

/// The ask of `parts` for a summariser shown the conversation itself, when
/// the compaction keeps `kept_after` messages after its summary and one
/// prompt holds the whole middle (a chunk summarises only part of it).
fn in_context_ask(parts: &PromptParts<'_>, kept_after: Option<usize>) -> Option<InContextAsk> {
    let keep_last = kept_after.filter(|_| parts.chunk.is_none())?;
    let target = u32::try_from(parts.target_tokens).unwrap_or(u32::MAX);
    Some(InContextAsk {
        keep_last,
        min_reply: target.saturating_add(target / 4),
        prompt: build_in_context_prompt(&PromptParts {
            turns: "",
            ..parts.clone()
        }),
    })
}

/// Share of a strictly budgeted summary body (small windows) the quote of
/// the user's ask may take: at 4,096 tokens the whole ~1,600-character
/// budget went to a 1,400-character quote of a pasted log, and the clip
/// cut away everything the summariser wrote (a fact stated in turn 1
/// among it).
const SNAPSHOT_SHARE_DIVISOR: usize = 4;

/// `body` with its task snapshot grounded in the newest real user ask of
/// `turns` (or the note that there is none), the ask quoted in at most a
/// quarter of `max_body_chars` when the window holds the body to it.
fn ground(
    body: &str,
    turns: &[Value],
    no_user_turns: bool,
    max_body_chars: Option<usize>,
) -> String {
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
    let cap = max_body_chars.map_or(serialize::TASK_SNAPSHOT_MAX_CHARS, |m| {
        (m / SNAPSHOT_SHARE_DIVISOR).clamp(120, serialize::TASK_SNAPSHOT_MAX_CHARS)
    });
    serialize::ground_task_snapshot_capped(body, grounding, cap)
}

impl Compressor {
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
    pub(super) fn user_messages(
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
    pub(super) fn apply_attempt(&mut self, a: &SummaryAttempt) {
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
    // Only tests use it: a pass summarises through `attempt_summary`.
    #[cfg(test)]
    pub(crate) async fn generate_summary(
        &mut self,
        s: &dyn Summariser,
        turns: &[Value],
        focus_topic: Option<&str>,
    ) -> SummaryAttempt {
        let state = SummaryState {
            previous: self.previous_summary.clone(),
            has_user_turn: self.summary_has_user_turn,
            keep_said: false,
            kept_after: None,
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
    pub(super) async fn attempt_summary(
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
            crate::budget::summary_budget(middle_tokens, self.trigger.max_summary_tokens());
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

        let mut model = (self.summary_model.clone()).filter(|_| self.distinct_summary_model());
        let mut fallen_back = self.summary_model_fallen_back;
        let mut running = previous;
        let n = chunks.len();
        for (i, text) in chunks.iter().enumerate() {
            let prev = running
                .as_deref()
                .map(|p| bound_running_summary(p, prev_cap));
            let parts = PromptParts {
                turns: text,
                previous_summary: prev.as_deref(),
                focus_topic: focus.as_deref(),
                target_tokens: target,
                today,
                no_user_turns,
                chunk: (n > 1).then_some((i, n)),
                compact,
                user_messages_kept: !said.is_empty(),
            };
            let call = SummaryCall {
                prompt: build_summary_prompt(&parts),
                in_context: in_context_ask(&parts, state.kept_after),
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
        let strict =
            (window < STRICT_SUMMARY_WINDOW).then(|| max_summary_body_chars(target, window));
        let grounded = ground(&body, turns, no_user_turns, strict);
        let body = clip_summary_for_window(grounded, target, window);
        let body = user_messages::render(&body, &said);
        out.summary = Some(markers::normalize_summary_prefix_with(
            markers::summary_prefix_for(window),
            &body,
        ));
        out.body = Some(body);
        out
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

/// The running summary quoted in a summary prompt, within `cap` chars:
/// shortened by lines (facts kept over narrative), else cut in the middle.
fn bound_running_summary(previous: &str, cap: usize) -> String {
    crate::salient::fit_lines(previous, cap, "[earlier summary shortened to fit]")
        .unwrap_or_else(|| bound_summary_input(previous, cap))
}
