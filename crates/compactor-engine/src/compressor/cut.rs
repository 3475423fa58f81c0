//! The rows one compaction works on: the head, tool-output pruning, the
//! tail cut with its bridge rule, and the split of an oversized active turn
//! whose ask is carried verbatim after the summary.

use serde_json::Value;

use super::clip::STRICT_SUMMARY_WINDOW;
use super::instructions::is_instructions;
use super::outcome::{CompressTelemetry, NoOpReason};
use super::Compressor;
use crate::markers::{self, Handoff};
use crate::prune::{self, PruneParams};
use crate::tail::{self, TailParams};
use crate::tokens;
use crate::view;

/// Rows after the head a conversation needs before it is worth compacting.
pub(super) const MIN_ROWS_AFTER_HEAD: usize = 4;

/// The rows one compaction works on, decided before any summary call.
pub(super) struct Cut {
    /// The input after pruning and blank-echo removal.
    pub(super) working: Vec<Value>,
    /// First summarised row.
    pub(super) start: usize,
    /// First row kept after the summary.
    pub(super) end: usize,
    /// The ask of an oversized active turn, carried verbatim after the
    /// summary while the rounds before `end` are summarised.
    pub(super) split_ask: Option<usize>,
    /// The input before pruning, row for row with `working`: a pruned tool
    /// output reaches the summariser as its one-line stub plus the salient
    /// lines of the original (the facts the stub would lose).
    pub(super) unpruned: Option<Vec<Value>>,
}

impl Cut {
    /// The rows to summarise, earlier summaries unwrapped to their bodies
    /// (those are in the running summary already).
    pub(super) fn middle(&self) -> Vec<Value> {
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
    let lines = crate::salient::salient_lines_min(&view::text(raw), max, min_score);
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

impl Compressor {
    /// Whether keeping the protected head verbatim would hold the result
    /// over its target: the rows it keeps past the instructions, with the
    /// tail the cut keeps, take the whole history target (what the history
    /// may take after a compaction, [`crate::Trigger::history_target`]).
    /// The head then yields: its rows are summarised with the middle, and
    /// the next compaction is turns away rather than one. opencode at a
    /// 16,000 window (fixed part ~7.7k, history target ~3.3k, a ~1.5k paste
    /// a turn): a head of two pastes plus the tail left the result ~1,400
    /// under the trigger, less than a turn, and the next turn compacted
    /// again. Judged only once the caller measured the fixed part: without
    /// it the target is not known.
    fn head_holds_result_high(&mut self, messages: &[Value]) -> bool {
        if self.trigger.fixed_tokens() == 0 {
            return false;
        }
        let full = self.protect_head_size(messages);
        let minimal = minimal_head_size(messages).min(full);
        if full <= minimal {
            return false;
        }
        let head = tokens::estimate_messages_tokens_rough(&messages[minimal..full]);
        head + self.trigger.tail_token_budget() > self.trigger.history_target()
    }

    /// Head, pruning and tail cut: the rows to summarise, or why there are
    /// none.
    pub(super) fn cut(
        &mut self,
        messages: &[Value],
        tel: &mut CompressTelemetry,
    ) -> Result<Cut, NoOpReason> {
        let n = messages.len();
        let small = self.trigger.context_length() < STRICT_SUMMARY_WINDOW;
        // A small window cannot afford a protected head of whole tool
        // rounds: an agent's first rounds would leave too few rows to
        // compact (a no-op, then an overflow). The head shrinks to the
        // system prompt; an oversized active turn then carries the task.
        let relax_head = (small && n <= self.protect_head_size(messages) + MIN_ROWS_AFTER_HEAD)
            || self.head_holds_result_high(messages);
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

/// The smallest head: the system prompt, if first.
pub(super) fn minimal_head_size(msgs: &[Value]) -> usize {
    usize::from(msgs.first().is_some_and(is_instructions))
}

/// True for the row that carries the newest user ask: a real user row, or a
/// user row holding an earlier summary with the ask after its END marker
/// (the shape a split active turn leaves behind).
pub(super) fn is_ask_row(m: &Value) -> bool {
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
pub(super) fn split_active_turn(
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

/// Removes blank user echoes right after the latest actionable user row,
/// when an assistant row follows them. A blank row not followed by an
/// assistant may be a deliberate alternation placeholder and stays.
pub(super) fn remove_blank_echoes(mut msgs: Vec<Value>) -> Vec<Value> {
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

#[cfg(test)]
mod tests;
