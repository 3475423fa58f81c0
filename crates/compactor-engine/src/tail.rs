//! The tail cut: which suffix of the conversation is kept
//! verbatim. Everything between the head and the cut is summarised.
//!
//! The cut is sized by tokens (not message count) so large tool outputs cannot
//! pin the whole conversation, then moved by anchors that keep the latest
//! real user ask, the latest visible assistant reply and whole tool groups on
//! the tail side.

use serde_json::Value;

use super::tokens;
use super::view;

/// The count floor of the tail never exceeds this many rows, however large
/// `protect_last_n` is configured.
pub(crate) const MAX_TAIL_MESSAGE_FLOOR: usize = 8;
/// The smallest count floor the tail gets when there is room for it.
pub(crate) const MIN_TAIL_MESSAGE_FLOOR: usize = 3;
/// An active user ask longer than this many characters is never moved into
/// the summary by the oversized-active-turn exception.
pub(crate) const SPLIT_TURN_MAX_USER_CHARS: usize = 1_400;

/// Inputs of one tail-cut computation.
#[derive(Clone, Copy, Debug)]
pub(crate) struct TailParams {
    /// Tail token budget.
    pub(crate) budget: u64,
    /// Soft ceiling of the first walk (1.5 × budget, bounded by the window).
    pub(crate) soft_ceiling: u64,
    /// Configured `protect_last_n` (a soft floor capped at 8).
    pub(crate) protect_last_n: usize,
    /// How many real user rows the tail must hold (1 = the latest only).
    pub(crate) min_tail_user_messages: usize,
    /// Batch compaction may split an oversized active turn; micro may not.
    pub(crate) allow_split_turn: bool,
}

/// Per-row token costs, the newest assistant charged for its thinking, the
/// rest not (stale thinking is not replayed on the wire).
pub(crate) fn row_costs(msgs: &[Value]) -> Vec<u64> {
    let newest = tokens::newest_assistant_index(msgs);
    msgs.iter()
        .enumerate()
        .map(|(i, m)| tokens::estimate_msg_budget_tokens(m, Some(i) == newest))
        .collect()
}

/// The count floor of the tail for `available` compressible rows.
pub(crate) fn min_tail_floor(protect_last_n: usize, available: usize) -> usize {
    if available <= 1 {
        return 0;
    }
    MIN_TAIL_MESSAGE_FLOOR
        .max(protect_last_n.min(MAX_TAIL_MESSAGE_FLOOR))
        .min(MIN_TAIL_MESSAGE_FLOOR.max(available.saturating_sub(2)))
        .min(available)
}

/// Walks back from the newest row adding costs; stops before the row that
/// would exceed `limit` once `floor` rows are kept. Returns the cut.
fn walk(costs: &[u64], head_end: usize, limit: u64, floor: usize) -> usize {
    let n = costs.len();
    let mut acc: u64 = 0;
    let mut cut = n;
    for i in (head_end..n).rev() {
        let kept = n - cut;
        if acc.saturating_add(costs[i]) > limit && kept >= floor {
            break;
        }
        acc = acc.saturating_add(costs[i]);
        cut = i;
    }
    cut
}

/// Computes the tail cut for `msgs` whose first `head_end` rows are the
/// protected head. The result is in `head_end + 1 ..= msgs.len()`.
pub(crate) fn find_tail_cut_by_tokens(msgs: &[Value], head_end: usize, p: &TailParams) -> usize {
    let costs = row_costs(msgs);
    find_tail_cut_with_costs(msgs, &costs, head_end, p)
}

/// [`find_tail_cut_by_tokens`] with precomputed per-row costs.
pub(crate) fn find_tail_cut_with_costs(
    msgs: &[Value],
    costs: &[u64],
    head_end: usize,
    p: &TailParams,
) -> usize {
    let n = msgs.len();
    if head_end >= n {
        return n;
    }
    let min_tail = min_tail_floor(p.protect_last_n, n - head_end);
    let soft = p.soft_ceiling.max(p.budget);
    // A generous soft ceiling needs no count floor; a floor would only drag
    // oversized rows into the tail.
    let walk_floor = if soft >= (min_tail as u64).saturating_mul(10) {
        0
    } else {
        min_tail
    };
    let mut cut = walk(costs, head_end, soft, walk_floor);
    if cut <= head_end {
        // Everything fits under the soft ceiling: walk again with the raw
        // budget so a useful middle exists (otherwise an N→N no-op loop).
        cut = walk(costs, head_end, p.budget, walk_floor);
    }
    if cut <= head_end {
        cut = n.saturating_sub(min_tail).max(head_end + 1);
    }
    cut = align_backward(msgs, cut);

    let split_turn = p.allow_split_turn && oversized_active_turn(msgs, costs, head_end, cut, soft);
    if !split_turn {
        cut = ensure_last_user_message_in_tail(msgs, cut, head_end);
        cut = ensure_last_assistant_in_tail(msgs, cut, head_end);
    }
    if p.min_tail_user_messages > 1 {
        cut = ensure_last_n_user_messages_in_tail(msgs, cut, head_end, p.min_tail_user_messages);
    }
    align_forward(msgs, cut.max(head_end + 1)).min(n)
}

/// Moves `cut` back so a tool group (assistant with tool calls + its results)
/// is not split across the boundary.
pub(crate) fn align_backward(msgs: &[Value], cut: usize) -> usize {
    let n = msgs.len();
    if cut == 0 || cut > n {
        return cut;
    }
    let mut i = cut;
    while i > 0 && view::is_role(&msgs[i - 1], "tool") {
        i -= 1;
    }
    let splits_group = i < cut || (cut < n && view::is_role(&msgs[cut], "tool"));
    if splits_group && i > 0 && view::has_tool_calls(&msgs[i - 1]) {
        return i - 1;
    }
    cut
}

/// Moves `cut` forward past tool rows, so a raised cut never leaves tool
/// results at the start of the tail without their call.
pub(crate) fn align_forward(msgs: &[Value], mut cut: usize) -> usize {
    while cut < msgs.len() && view::is_role(&msgs[cut], "tool") {
        cut += 1;
    }
    cut
}

/// End (exclusive) of the turn pair starting at the user row `user_idx`:
/// the user, the assistant reply and that reply's tool rows.
pub(crate) fn find_turn_pair_end(msgs: &[Value], user_idx: usize) -> usize {
    let n = msgs.len();
    let mut j = user_idx + 1;
    if j < n && view::is_role(&msgs[j], "assistant") {
        j += 1;
        while j < n && view::is_role(&msgs[j], "tool") {
            j += 1;
        }
    }
    j.min(n)
}

/// Last-user anchor: the newest real user row stays in the tail. If
/// that row is the first compressible one, clamping would summarise it without
/// its reply (a finished ask recorded as pending), so the cut is
/// pushed past the whole turn pair instead.
pub(super) fn ensure_last_user_message_in_tail(
    msgs: &[Value],
    cut: usize,
    head_end: usize,
) -> usize {
    let Some(last_user) = view::last_real_user(msgs, head_end) else {
        return cut;
    };
    if last_user >= cut {
        return cut;
    }
    if last_user > head_end {
        return last_user;
    }
    find_turn_pair_end(msgs, last_user).max(head_end + 1)
}

/// Index of the newest visible assistant reply (non-empty text, not a
/// summary carrier); falls back to the newest assistant of any kind.
pub(crate) fn last_visible_assistant(msgs: &[Value]) -> Option<usize> {
    msgs.iter()
        .rposition(|m| view::is_role(m, "assistant") && !view::is_blank(m) && !view::is_summary(m))
        .or_else(|| view::last_assistant(msgs))
}

/// Last-assistant anchor: the user's last visible reply must not
/// vanish into the summary.
pub(crate) fn ensure_last_assistant_in_tail(msgs: &[Value], cut: usize, head_end: usize) -> usize {
    match last_visible_assistant(msgs) {
        Some(a) if a >= head_end && a < cut => align_backward(msgs, a).max(head_end + 1),
        _ => cut,
    }
}

/// N-user anchor: the tail holds the `n` newest real user rows (or all of them
/// when fewer exist). Blank echoes, handoffs and synthetic rows do not count.
/// Never re-aligned backward: a user row is already a clean boundary.
pub(super) fn ensure_last_n_user_messages_in_tail(
    msgs: &[Value],
    cut: usize,
    head_end: usize,
    n: usize,
) -> usize {
    if n == 0 {
        return cut;
    }
    let mut seen = 0;
    let mut target = None;
    for i in (head_end..msgs.len()).rev() {
        if view::is_real_user(&msgs[i]) {
            seen += 1;
            target = Some(i);
            if seen == n {
                break;
            }
        }
    }
    match target {
        Some(t) => cut.min(t).max(head_end + 1),
        None => cut,
    }
}

/// Oversized-active-turn exception: when the active turn alone is
/// larger than the soft ceiling and already ran tools, the aligned mid-turn cut
/// is kept and the (short) user ask goes into the summary, where the
/// deterministic task snapshot records it.
fn oversized_active_turn(
    msgs: &[Value],
    costs: &[u64],
    head_end: usize,
    cut: usize,
    soft: u64,
) -> bool {
    let Some(u) = view::last_real_user(msgs, head_end) else {
        return false;
    };
    if u >= cut
        || costs[u] > soft
        || view::text(&msgs[u]).chars().count() > SPLIT_TURN_MAX_USER_CHARS
    {
        return false;
    }
    if !msgs[u..cut].iter().any(view::has_tool_calls) {
        return false;
    }
    let from_user: u64 = costs[u..].iter().sum();
    from_user > soft
}

#[cfg(test)]
mod tests;
