//! The last resort when nothing is left to compact: the fixed part of a
//! request (system prompt, tools, newest turn) plus the rest does not fit,
//! so the largest individual messages are shortened in their middle, with
//! a visible marker, until the request fits.
//!
//! No row is removed, so tool-call pairing is kept as it was. The system
//! prompt (or developer message) leading the list is never shortened; the
//! newest user message and the running summary only when nothing else is
//! left to shorten. When even that cannot make the messages fit by the
//! estimate, the oldest whole exchanges (then the oldest continuations of
//! the newest ask) are dropped
//! ([`drop_oldest_exchanges`]) rather than send a request estimated over
//! the window; when not even that fits, nothing is changed (the upstream
//! answers the request as it is), unless the upstream has already refused
//! them as too long ([`Fit::Insist`]): then they are cut as far as they go
//! and sent, since the estimate, not the upstream, may be wrong about how
//! they tokenize.

use serde_json::Value;

use super::tokens;
use super::view;

/// No message is shortened below this many characters.
pub(crate) const LAST_RESORT_MIN_CHARS: usize = 240;

fn marker(cut: usize) -> String {
    format!("\n…[{cut} chars cut from the middle to fit the context window]…\n")
}

/// Characters of the text a row carries (string content, or the text
/// parts of a content list).
fn text_len(m: &Value) -> usize {
    match m.get("content") {
        Some(Value::String(s)) => s.chars().count(),
        Some(Value::Array(parts)) => parts
            .iter()
            .filter_map(|p| p.get("text").and_then(Value::as_str))
            .map(|t| t.chars().count())
            .max()
            .unwrap_or(0),
        _ => 0,
    }
}

/// `text` cut to about `keep` characters: 45% head, 55% tail around the
/// marker.
fn middle_cut(text: &str, keep: usize) -> String {
    let n = text.chars().count();
    if n <= keep {
        return text.to_owned();
    }
    let head = keep * 45 / 100;
    let tail = keep - head;
    let start: String = text.chars().take(head).collect();
    let end: String = text.chars().skip(n - tail).collect();
    format!("{start}{}{end}", marker(n - keep))
}

/// Shortens the text of `m` (its largest text part) to about `keep` chars.
fn shorten(m: &mut Value, keep: usize) {
    match m.get_mut("content") {
        Some(Value::String(s)) => *s = middle_cut(s, keep),
        Some(Value::Array(parts)) => {
            let largest = parts
                .iter_mut()
                .filter(|p| p.get("text").and_then(Value::as_str).is_some())
                .max_by_key(|p| p.get("text").and_then(Value::as_str).map_or(0, str::len));
            if let Some(p) = largest {
                let t = p.get("text").and_then(Value::as_str).unwrap_or("");
                let cut = middle_cut(t, keep);
                p["text"] = Value::String(cut);
            }
        }
        _ => {}
    }
}

/// What the last resort did.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Shrunk {
    /// The messages, shortened.
    pub(crate) messages: Vec<Value>,
    /// Rows shortened.
    pub(crate) rows: usize,
}

/// How firmly the last resort (shortening the largest messages when a
/// compaction leaves too much) aims at its budget.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Fit {
    /// Shorten only when the estimate says the budget can be met.
    #[default]
    IfReachable,
    /// The upstream refused these messages as too long: its count proves
    /// they do not fit, while the estimate is char-based and can be far off
    /// in either part (a dense log tokenizes at 2.5 characters a token,
    /// prose at 4.5; a template may render the tool schemas in a handful of
    /// tokens). Shorten as far as the rows go even when the estimate says
    /// the budget cannot be met; the upstream judges the result.
    Insist,
}

/// `messages` with their largest messages shortened until the rough
/// estimate is at most `budget` tokens; `None` when they fit already, or
/// cannot be made to fit and `fit` does not insist (or nothing could be
/// shortened).
pub(crate) fn shrink_to_fit(messages: &[Value], budget: u64, fit: Fit) -> Option<Shrunk> {
    let mut out = messages.to_vec();
    if tokens::estimate_messages_tokens_rough(&out) <= budget {
        return None;
    }
    let system = out
        .first()
        .is_some_and(|m| view::is_role(m, "system") || view::is_role(m, "developer"));
    let newest_user = out.iter().rposition(view::is_real_user);
    let mut shrunk = vec![false; out.len()];
    // Rows that would not get shorter (at their floor already): passed
    // over, while smaller rows may still be cut.
    let mut spent = vec![false; out.len()];
    let mut fits = false;
    // First everything but the newest ask and the summary; then those too.
    'passes: for last_pass in [false, true] {
        loop {
            let total = tokens::estimate_messages_tokens_rough(&out);
            if total <= budget {
                fits = true;
                break 'passes;
            }
            let candidate = (usize::from(system)..out.len())
                .filter(|&i| !spent[i])
                .filter(|&i| last_pass || (Some(i) != newest_user && !view::is_summary(&out[i])))
                .map(|i| (text_len(&out[i]), i))
                .filter(|&(len, _)| len > LAST_RESORT_MIN_CHARS)
                .max();
            let Some((len, i)) = candidate else {
                break;
            };
            let over_chars = usize::try_from(budget.abs_diff(total))
                .unwrap_or(usize::MAX)
                .saturating_mul(usize::try_from(tokens::CHARS_PER_TOKEN).unwrap_or(4));
            let keep = len
                .saturating_sub(over_chars + marker(len).chars().count())
                .max(LAST_RESORT_MIN_CHARS);
            shorten(&mut out[i], keep);
            if text_len(&out[i]) >= len {
                // Could not shorten it (marker longer than the cut): stop
                // offering this row.
                spent[i] = true;
                continue;
            }
            shrunk[i] = true;
        }
    }
    let rows = shrunk.iter().filter(|s| **s).count();
    (fits || (fit == Fit::Insist && rows > 0)).then_some(Shrunk {
        messages: out,
        rows,
    })
}

/// The window step when even shortening every row cannot fit `messages`
/// in `budget` (a small window whose instructions fill most of it holds
/// about one turn, and a summary of the rest would not fit either): the
/// fewest oldest whole exchanges are dropped (each from a real user row to
/// the next) for [`shrink_to_fit`] to reach the budget with what is left.
/// The leading rows before the first exchange (instructions, a summary)
/// and the newest ask always stay; an exchange holds its tool calls with
/// their results, so pairing is kept. When dropping every earlier exchange
/// is not enough, the oldest continuations of the newest ask go too (a
/// runtime's "continue" turns after a reply cut at `max_tokens`), the
/// newest one kept ([`drop_continuations`]). `None` when even that is not
/// enough.
pub(crate) fn drop_oldest_exchanges(messages: &[Value], budget: u64) -> Option<Dropped> {
    let newest_user = messages.iter().rposition(view::is_real_user)?;
    let starts: Vec<usize> = (0..newest_user)
        .filter(|&i| view::is_real_user(&messages[i]))
        .collect();
    if let Some(d) = drop_exchanges_before(messages, &starts, newest_user, budget) {
        return Some(d);
    }
    // Not even the newest ask's turn fits: without the earlier exchanges,
    // its oldest continuations go too.
    let first = starts.first().copied().unwrap_or(newest_user);
    let d = drop_continuations(&without(messages, first, newest_user), first, budget)?;
    Some(Dropped {
        rows: d.rows + (newest_user - first),
        ..d
    })
}

/// The oldest continuations after the ask at `ask` dropped, the fewest
/// that fit. A continuation is what a runtime's synthetic user row (hermes'
/// "[System: Your previous response was truncated … Continue …]") closes:
/// the partial answer, its tool rounds and that row. Dropping the first
/// `j` keeps the ask followed by an assistant row, so roles still
/// alternate and every tool result stays with its call (a synthetic row
/// followed by another user row is no place to cut); the newest
/// continuation (the row the model answers) always stays.
fn drop_continuations(messages: &[Value], ask: usize, budget: u64) -> Option<Dropped> {
    let ends: Vec<usize> = (ask + 1..messages.len())
        .filter(|&i| view::is_synthetic_user(&messages[i]))
        .filter(|&i| {
            !messages
                .get(i + 1)
                .is_some_and(|m| view::is_role(m, "user"))
        })
        .collect();
    let droppable = ends.len().checked_sub(1)?;
    let (j, shrunk) = fewest(droppable, |j| {
        fit_without(messages, ask + 1, ends[j - 1] + 1, budget)
    })?;
    Some(Dropped {
        shrunk,
        rows: ends[j - 1] - ask,
    })
}

/// The smallest `k` in `1..=n` for which `attempt` fits, with its result,
/// by bisection: `attempt` drops the first `k` of something from the
/// front, and more dropped never fits worse. `None` when nothing fits,
/// and when there is nothing to drop (`n == 0`: `attempt(0)` is never
/// tried, its callers index the `k - 1`th row).
fn fewest(n: usize, attempt: impl Fn(usize) -> Option<Shrunk>) -> Option<(usize, Shrunk)> {
    if n == 0 {
        return None;
    }
    let (mut lo, mut hi) = (1, n);
    let mut best = Some(hi).zip(attempt(hi))?;
    while lo < hi {
        let mid = lo + (hi - lo) / 2;
        match attempt(mid) {
            Some(s) => {
                best = (mid, s);
                hi = mid;
            }
            None => lo = mid + 1,
        }
    }
    Some(best)
}

/// `messages` without the rows `from..to`.
fn without(messages: &[Value], from: usize, to: usize) -> Vec<Value> {
    let mut rest = messages[..from].to_vec();
    rest.extend_from_slice(&messages[to..]);
    rest
}

/// `messages` without the rows `from..to`, shortened as far as they must
/// be to fit `budget`; `None` when they cannot.
fn fit_without(messages: &[Value], from: usize, to: usize, budget: u64) -> Option<Shrunk> {
    let rest = without(messages, from, to);
    if tokens::estimate_messages_tokens_rough(&rest) <= budget {
        return Some(Shrunk {
            messages: rest,
            rows: 0,
        });
    }
    shrink_to_fit(&rest, budget, Fit::IfReachable)
}

/// [`drop_oldest_exchanges`] before the newest ask: the exchanges starting
/// at `starts`, the fewest that fit.
fn drop_exchanges_before(
    messages: &[Value],
    starts: &[usize],
    newest_user: usize,
    budget: u64,
) -> Option<Dropped> {
    let first = *starts.first()?;
    // Dropping the first k exchanges keeps messages[..first] and
    // messages[end(k)..].
    let end = |k: usize| starts.get(k).copied().unwrap_or(newest_user);
    let (k, shrunk) = fewest(starts.len(), |k| {
        fit_without(messages, first, end(k), budget)
    })?;
    Some(Dropped {
        shrunk,
        rows: end(k) - first,
    })
}

/// What [`drop_oldest_exchanges`] did.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Dropped {
    /// The rest, shortened as far as it had to be.
    pub(crate) shrunk: Shrunk,
    /// Rows dropped.
    pub(crate) rows: usize,
}

/// What [`fit_budget`] works from.
#[derive(Clone, Copy, Debug, Default)]
pub struct FitInputs {
    /// The caller's (calibrated) estimate of the whole prompt, tools
    /// included, in the upstream's tokens.
    pub estimate: u64,
    /// The upstream's own count of the prompt, when it just rejected it.
    pub counted: Option<u64>,
    /// Tokens of the tools (and other non-message parts) in the prompt.
    pub tools: u64,
    /// The context window.
    pub window: u64,
    /// The reply reservation (`max_tokens`).
    pub max_out: u64,
    /// The estimate is trusted to within 1/`margin_divisor`.
    pub margin_divisor: u64,
}

/// The rough-token budget `messages` must be shortened to for the request
/// to fit: their own rough size scaled by how much of the window the
/// messages may take over how much they take now (by the caller's estimate
/// or, higher, the upstream's count), with the caller's margin.
/// `u64::MAX` when they fit already.
pub fn fit_budget(messages: &[Value], f: FitInputs) -> u64 {
    let usable = f.window.saturating_sub(f.max_out);
    let usable = usable - usable / f.margin_divisor.max(2);
    let taken = f.estimate.max(f.counted.unwrap_or(0));
    if taken <= usable {
        return u64::MAX;
    }
    let allowed = usable.saturating_sub(f.tools);
    let now = taken.saturating_sub(f.tools).max(1);
    let rough = tokens::estimate_messages_tokens_rough(messages);
    u64::try_from(u128::from(rough) * u128::from(allowed) / u128::from(now)).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn msgs() -> Vec<Value> {
        vec![
            json!({"role": "system", "content": "S".repeat(4_000)}),
            json!({"role": "user", "content": "read the file"}),
            json!({"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "read", "arguments": "{}"}}]}),
            json!({"role": "tool", "tool_call_id": "c1", "content": format!("HEAD{}TAIL", "x".repeat(8_000))}),
            json!({"role": "user", "content": format!("now fix it {}", "u".repeat(600))}),
        ]
    }

    #[test]
    fn fewest_finds_the_smallest_drop_that_fits_and_tries_none_when_there_is_nothing_to_drop() {
        let tried = std::cell::RefCell::new(Vec::new());
        let fits_from = |from: usize| {
            let tried = &tried;
            move |k: usize| {
                tried.borrow_mut().push(k);
                (k >= from).then(|| Shrunk {
                    messages: Vec::new(),
                    rows: k,
                })
            }
        };
        assert!(fewest(0, fits_from(0)).is_none());
        assert!(tried.borrow().is_empty(), "nothing to drop: no attempt");
        for n in 1..=9 {
            for from in 1..=n {
                let (k, s) = fewest(n, fits_from(from)).expect("dropping all fits");
                assert_eq!((k, s.rows), (from, from), "n={n}");
            }
            assert!(fewest(n, fits_from(n + 1)).is_none(), "n={n}");
        }
        assert!(tried.borrow().iter().all(|&k| k >= 1));
    }

    #[test]
    fn the_largest_non_system_row_is_cut_in_the_middle() {
        let m = msgs();
        let before = tokens::estimate_messages_tokens_rough(&m);
        let budget = before - 1_000;
        let s = shrink_to_fit(&m, budget, Fit::IfReachable).expect("fits after shrinking");
        assert!(tokens::estimate_messages_tokens_rough(&s.messages) <= budget);
        assert_eq!(s.rows, 1);
        assert_eq!(s.messages[0], m[0], "system prompt untouched");
        assert_eq!(s.messages[4], m[4], "newest ask untouched");
        let tool = s.messages[3]["content"].as_str().unwrap();
        assert!(tool.starts_with("HEAD") && tool.ends_with("TAIL"));
        assert!(tool.contains("chars cut from the middle to fit the context window"));
        assert_eq!(s.messages.len(), m.len(), "no row removed: pairing kept");
        assert_eq!(s.messages[3]["tool_call_id"], "c1");
    }

    #[test]
    fn the_budget_scales_the_messages_by_the_room_they_have() {
        let m = msgs();
        let rough = tokens::estimate_messages_tokens_rough(&m);
        let f = FitInputs {
            estimate: 3_000,
            counted: None,
            tools: 500,
            window: 3_300,
            max_out: 100,
            margin_divisor: 10,
        };
        // usable 3,200 - 320 = 2,880; messages may take 2,380 of their 2,500.
        assert_eq!(fit_budget(&m, f), rough * 2_380 / 2_500);
        // The upstream counted more than estimated: its count decides.
        let counted = FitInputs {
            counted: Some(3_500),
            ..f
        };
        assert_eq!(fit_budget(&m, counted), rough * 2_380 / 3_000);
        let fits = FitInputs {
            estimate: 1_000,
            ..f
        };
        assert_eq!(fit_budget(&m, fits), u64::MAX);
    }

    #[test]
    fn the_newest_ask_is_cut_last_and_impossible_fits_change_nothing() {
        let m = msgs();
        let system_only = tokens::estimate_messages_tokens_rough(&m[..1]);
        // Room for the system prompt and little else: the ask is cut too.
        let s = shrink_to_fit(&m, system_only + 250, Fit::IfReachable).expect("fits");
        assert!(s.messages[4]["content"]
            .as_str()
            .unwrap()
            .contains("chars cut"));
        assert_eq!(s.messages[0], m[0]);
        // Not even the system prompt fits: nothing to do.
        assert_eq!(shrink_to_fit(&m, system_only / 2, Fit::IfReachable), None);
        // Already fits: nothing to do, insisting or not.
        assert_eq!(shrink_to_fit(&m, u64::MAX, Fit::IfReachable), None);
        assert_eq!(shrink_to_fit(&m, u64::MAX, Fit::Insist), None);
    }

    #[test]
    fn insisting_cuts_every_row_as_far_as_it_goes_when_the_budget_is_out_of_reach() {
        let m = msgs();
        let system_only = tokens::estimate_messages_tokens_rough(&m[..1]);
        let s = shrink_to_fit(&m, system_only / 2, Fit::Insist).expect("cut anyway");
        assert_eq!(s.rows, 2, "the tool output and the newest ask");
        assert_eq!(s.messages[0], m[0], "system prompt untouched");
        assert_eq!(s.messages[1], m[1], "rows at or under the floor untouched");
        for i in [3, 4] {
            let text = s.messages[i]["content"].as_str().unwrap();
            assert!(text.contains("chars cut"), "row {i} cut");
            let floor = LAST_RESORT_MIN_CHARS + marker(text.chars().count()).chars().count();
            assert!(text.chars().count() <= floor + 8, "row {i} at the floor");
        }
        assert_eq!(s.messages.len(), m.len(), "no row removed: pairing kept");
        assert_eq!(s.messages[3]["tool_call_id"], "c1");
        // Nothing but the system prompt and short rows: nothing to cut.
        let short = vec![m[0].clone(), m[1].clone()];
        assert_eq!(shrink_to_fit(&short, system_only / 2, Fit::Insist), None);
    }

    /// Instructions filling most of the budget and three earlier exchanges
    /// with tool calls before the newest ask and its tool round.
    fn small_window() -> Vec<Value> {
        let mut m = vec![json!({"role": "system", "content": "S".repeat(4_000)})];
        for i in 0..3 {
            m.push(json!({"role": "user", "content": format!("step {i} {}", "u".repeat(200))}));
            m.push(json!({"role": "assistant", "content": null, "tool_calls": [{"id": format!("c{i}"), "type": "function", "function": {"name": "read", "arguments": "{}"}}]}));
            m.push(json!({"role": "tool", "tool_call_id": format!("c{i}"), "content": "x".repeat(1_500)}));
            m.push(json!({"role": "assistant", "content": format!("done {i}")}));
        }
        m.push(json!({"role": "user", "content": format!("now {}", "n".repeat(200))}));
        m.push(json!({"role": "assistant", "content": null, "tool_calls": [{"id": "c9", "type": "function", "function": {"name": "read", "arguments": "{}"}}]}));
        m.push(json!({"role": "tool", "tool_call_id": "c9", "content": "y".repeat(1_500)}));
        m
    }

    #[test]
    fn exchanges_are_dropped_oldest_first_when_shortening_cannot_fit() {
        let m = small_window();
        let system = tokens::estimate_messages_tokens_rough(&m[..1]);
        let budget = system + 400;
        assert_eq!(
            shrink_to_fit(&m, budget, Fit::IfReachable),
            None,
            "shortening alone"
        );
        let d = drop_oldest_exchanges(&m, budget).expect("fits without old exchanges");
        let out = &d.shrunk.messages;
        assert!(tokens::estimate_messages_tokens_rough(out) <= budget);
        assert_eq!(out[0], m[0], "instructions kept");
        assert!(
            d.rows > 0 && d.rows.is_multiple_of(4),
            "whole exchanges: {}",
            d.rows
        );
        assert_eq!(out.len(), m.len() - d.rows);
        // The newest ask and its round are what is left after the kept
        // exchanges, and every tool result still follows its call.
        let ask = out.iter().rposition(view::is_real_user).unwrap();
        assert!(view::text(&out[ask]).starts_with("now "));
        assert_eq!(out[ask + 2]["tool_call_id"], "c9");
        for (i, r) in out.iter().enumerate() {
            if let Some(id) = r.get("tool_call_id") {
                assert_eq!(out[i - 1]["tool_calls"][0]["id"], *id);
            }
        }
        // The fewest: with one more exchange kept it would not fit.
        let more = d.rows - 4;
        let mut kept = m[..1].to_vec();
        kept.extend_from_slice(&m[1 + more..]);
        assert_eq!(shrink_to_fit(&kept, budget, Fit::IfReachable), None);
        // Below what the newest round alone can be cut to: nothing.
        assert_eq!(drop_oldest_exchanges(&m, system), None);
    }

    /// hermes-agent's run at a 2,048-token window: instructions filling
    /// most of it, the pasted log (the one real ask), then answers cut at
    /// `max_tokens`, each followed by hermes' synthetic "continue" row.
    fn continued_ask() -> Vec<Value> {
        let cont = "[System: Your previous response was truncated by the output length limit. \
                    Continue exactly where you left off.]";
        let mut m = vec![
            json!({"role": "system", "content": "S".repeat(4_000)}),
            json!({"role": "user", "content": format!("log {}", "l".repeat(2_000))}),
        ];
        for i in 0..3 {
            m.push(
                json!({"role": "assistant", "content": format!("part {i} {}", "a".repeat(1_000))}),
            );
            m.push(json!({"role": "user", "content": cont}));
        }
        m
    }

    /// `m` with every row after the instructions cut to its floor.
    fn at_floor(m: &[Value]) -> Vec<Value> {
        let mut floor = m.to_vec();
        for r in &mut floor[1..] {
            shorten(r, LAST_RESORT_MIN_CHARS);
        }
        floor
    }

    #[test]
    fn the_oldest_continuations_of_the_ask_go_when_nothing_else_fits() {
        let m = continued_ask();
        let newest = m.len() - 2;
        // Room for the instructions, the ask and the newest continuation
        // at their floors, not for every continuation at its floor.
        let floor = at_floor(&m);
        let newest_only = [&floor[..2], &floor[newest..]].concat();
        let budget = tokens::estimate_messages_tokens_rough(&newest_only) + 10;
        assert!(tokens::estimate_messages_tokens_rough(&floor) > budget);
        assert_eq!(shrink_to_fit(&m, budget, Fit::IfReachable), None);

        let d = drop_oldest_exchanges(&m, budget).expect("fits without old continuations");
        let out = &d.shrunk.messages;
        assert!(tokens::estimate_messages_tokens_rough(out) <= budget);
        assert_eq!(
            d.rows, 4,
            "the two oldest continuations, answer and row each"
        );
        assert_eq!(out.len(), m.len() - 4);
        assert_eq!(out[0], m[0], "instructions kept");
        assert!(view::text(&out[1]).starts_with("log "), "the ask kept");
        assert!(
            view::text(&out[2]).starts_with("part 2 "),
            "the newest answer kept"
        );
        assert_eq!(out[3], m[newest + 1], "the newest continue row kept");
        for pair in out[1..].windows(2) {
            assert_ne!(pair[0]["role"], pair[1]["role"], "roles alternate");
        }
        // Room for no continuation at all: nothing, the newest one stays.
        let ask_only = tokens::estimate_messages_tokens_rough(&floor[..2]);
        assert_eq!(drop_oldest_exchanges(&m, ask_only), None);
        // One continuation, the newest: nothing to drop, and no panic (a
        // bisection over no candidates once underflowed here in a CI run).
        let one = &m[..4];
        assert_eq!(drop_oldest_exchanges(one, ask_only), None);
        // A continue row followed by another user row is no place to cut:
        // the ask would be followed by a user row. With room for all but
        // the oldest pair, the cut moves past the note after it.
        let mut two = m.clone();
        let note = json!({"role": "user", "content": "[System note: a background task ended]"});
        two.insert(4, note);
        let floor = at_floor(&two);
        let without_oldest = [&floor[..2], &floor[4..]].concat();
        let budget = tokens::estimate_messages_tokens_rough(&without_oldest) + 10;
        let d = drop_oldest_exchanges(&two, budget).expect("fits cut after the note");
        let out = &d.shrunk.messages;
        assert_eq!(d.rows, 3, "the oldest pair and the note");
        assert!(view::text(&out[2]).starts_with("part 1 "));
        for pair in out[1..].windows(2) {
            assert_ne!(pair[0]["role"], pair[1]["role"], "roles alternate");
        }
    }
}
