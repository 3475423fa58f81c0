//! Pure threshold and budget math.
//!
//! For windows of 64k and more the numbers are the classic fixed ones.
//! Below that the fixed floors (64,000-token trigger,
//! 2,000-token summary floor) would not fit, so each floor is clamped by a
//! fraction of the real window: small windows (2k–32k, usual for llama.cpp)
//! get a trigger below the usable window and a tail + summary that fit under
//! the trigger with room for the reply.

use super::config::{sanitize_percent, CompactionConfig};

/// The absolute floor of the trigger on windows that can afford it.
pub(crate) const MINIMUM_CONTEXT_LENGTH: u64 = 64_000;
/// Trigger ratio used when the 64k floor would exceed the usable window.
pub(crate) const MIN_WINDOW_TRIGGER_RATIO: f64 = 0.85;
/// Windows below this get the small-context percent floor.
pub(crate) const SMALL_CONTEXT_WINDOW: u64 = 512_000;
/// Raise-only percent floor for windows below [`SMALL_CONTEXT_WINDOW`].
pub(crate) const SMALL_CONTEXT_PERCENT_FLOOR: f64 = 0.75;
/// Per-compaction summary budget floor: below it a summary loses the
/// structure that makes it worth having.
pub(crate) const SUMMARY_BUDGET_FLOOR: u64 = 2_000;
/// Fraction of the middle the summary budget aims for.
pub(crate) const SUMMARY_MIDDLE_RATIO: f64 = 0.20;
/// Upper bound of `max_summary_tokens`.
pub(crate) const MAX_SUMMARY_TOKENS_CAP: u64 = 10_000;
/// `max_summary_tokens` as a fraction of the window.
pub(crate) const MAX_SUMMARY_WINDOW_RATIO: f64 = 0.05;
/// The tail budget never exceeds this fraction of the window.
pub(crate) const TAIL_WINDOW_CAP_RATIO: f64 = 0.20;
/// The tail walk may overshoot its budget by this factor (soft ceiling).
pub(crate) const SOFT_CEILING_FACTOR: f64 = 1.5;
/// Lean tail mode: fraction of the window.
// Only the ported tests use it: the proxy demotes its tail by pruning instead (lean mode).
#[cfg(test)]
pub(crate) const LEAN_TAIL_WINDOW_RATIO: f64 = 0.025;
/// Lean tail mode: floor (clamped for small windows, see [`lean_tail_token_budget`]).
// Only the ported tests use it: see `lean_tail_token_budget`.
#[cfg(test)]
pub(crate) const LEAN_TAIL_FLOOR: u64 = 10_000;
/// Lean tail mode: ceiling.
// Only the ported tests use it: see `lean_tail_token_budget`.
#[cfg(test)]
pub(crate) const LEAN_TAIL_CEILING: u64 = 25_000;
/// Window assumed when nothing else is known: the binary's documented
/// `default_context_length`, llama.cpp's common small window. Guessing
/// small costs an early compaction; guessing large costs an overflow round
/// trip on every request until the real window is learned.
pub const DEFAULT_CONTEXT_LENGTH: u64 = 8_192;

fn floor_mul(n: u64, f: f64) -> u64 {
    // Truncation toward zero, so budgets never round up past a cap.
    let v = (n as f64 * f).floor();
    if v <= 0.0 {
        0
    } else {
        v as u64
    }
}

/// Trigger in tokens.
///
/// The usable input is `window − max_tokens` (the whole window when the
/// reservation leaves nothing). The ratio trigger is floored at 64,000 tokens,
/// but never above 85% of the usable window, and never equal to it.
/// `cap` (the absolute `threshold_tokens`) then applies, itself
/// bounded by the window. The result is at least 1.
pub(crate) fn compute_threshold_tokens(
    window: u64,
    max_tokens: Option<u64>,
    percent: f64,
    cap: Option<u64>,
) -> u64 {
    let window = window.max(1);
    let percent = sanitize_percent(percent);
    let reserve = max_tokens.unwrap_or(0);
    let eff = if reserve >= window {
        window
    } else {
        window - reserve
    };

    let pct = floor_mul(eff, percent);
    let mut floored = pct.max(MINIMUM_CONTEXT_LENGTH);
    let cap85 = floor_mul(eff, MIN_WINDOW_TRIGGER_RATIO);
    if floored > pct && floored > cap85 {
        floored = pct.max(cap85);
    }
    let ratio_trigger = if floored >= eff {
        cap85.min(eff.saturating_sub(1)).max(1)
    } else {
        floored.max(1)
    };
    match cap.filter(|&c| c > 0) {
        Some(c) => ratio_trigger.min(c.min(window)).max(1),
        None => ratio_trigger,
    }
}

/// The usable input: the window less the reply reservation (the whole
/// window when the reservation leaves nothing).
pub(crate) fn usable_window(window: u64, max_tokens: Option<u64>) -> u64 {
    let window = window.max(1);
    match max_tokens {
        Some(r) if r < window => window - r,
        _ => window,
    }
}

/// The trigger once the fixed part of a request is known (its instructions
/// and tools, which no compaction makes smaller): the classic trigger `t0`
/// keeps its share of the room *above* the fixed part. With nothing fixed
/// it is `t0`; the larger the fixed part, the larger that share (up to the
/// whole room as the fixed part nears the window): Codex's ~6,300 tokens
/// of instructions and tools in an 8,192 window move it from 6,963 to
/// 8,126, so a compaction has room to make rather than cutting at a
/// trigger the fixed part alone nearly reaches.
/// Always below `usable`.
pub(crate) fn threshold_over_fixed(t0: u64, usable: u64, fixed: u64) -> u64 {
    if fixed == 0 || usable <= 1 || t0 >= usable {
        return t0;
    }
    let fixed = fixed.min(usable);
    // The larger the fixed part, the closer the trigger comes to the
    // window: a request under the trigger is sent as it is, so the room
    // above it only makes compactions come sooner, and with instructions
    // taking most of the window that room is most of what a compaction
    // could make (issue: Codex at 8k compacted on every turn).
    let share = t0 as f64 / usable as f64;
    let share = share + (1.0 - share) * (fixed as f64 / usable as f64);
    let raised = fixed as f64 + (usable - fixed) as f64 * share;
    (raised.floor() as u64).clamp(t0, usable - 1)
}

/// What the history (everything but the fixed part) may take after a
/// compaction: `ratio` of the room between the fixed part and the trigger.
pub(crate) fn history_target(threshold: u64, fixed: u64, ratio: f64) -> u64 {
    let ratio = if ratio.is_finite() {
        ratio.clamp(0.05, 0.95)
    } else {
        super::config::DEFAULT_TARGET_RATIO
    };
    floor_mul(threshold.saturating_sub(fixed), ratio)
}

/// A history target under this leaves no room to compact into: the fixed
/// part fills the window, and compaction can only cut.
pub(crate) const NO_ROOM_TOKENS: u64 = 64;

/// Share of the window the user's own messages may take next to a summary.
pub(crate) const USER_MESSAGES_WINDOW_RATIO: f64 = 0.04;
/// Floor and ceiling of that budget.
pub(crate) const USER_MESSAGES_MIN: u64 = 32;
/// Ceiling of the user messages' budget.
pub(crate) const USER_MESSAGES_MAX: u64 = 4_000;

/// Tokens the user's own messages may take next to a summary: 4% of the
/// window (32 to 4,000), at most a fifth of the history target.
pub(crate) fn user_messages_budget(window: u64, history_target: u64) -> u64 {
    floor_mul(window, USER_MESSAGES_WINDOW_RATIO)
        .clamp(USER_MESSAGES_MIN, USER_MESSAGES_MAX)
        .min(history_target / 5)
}

/// Threshold percent for `model` at `window`: the longest `model_thresholds`
/// key contained in the model name overrides the configured percent, then
/// windows below 512k raise it to at least 0.75 (a higher value wins).
pub(crate) fn effective_percent(cfg: &CompactionConfig, model: &str, window: u64) -> f64 {
    let base = model_override(cfg, model).unwrap_or(cfg.threshold_percent);
    apply_small_window_floor(sanitize_percent(base), window)
}

/// The longest `model_thresholds` key that is a substring of `model`
/// (case-insensitive), if any. Ties go to the lexicographically first key so
/// the choice is deterministic.
pub(crate) fn model_override(cfg: &CompactionConfig, model: &str) -> Option<f64> {
    let lower = model.to_ascii_lowercase();
    let mut best: Option<(usize, f64)> = None;
    for (key, &pct) in &cfg.model_thresholds {
        if key.is_empty() || !lower.contains(&key.to_ascii_lowercase()) {
            continue;
        }
        if best.is_none_or(|(len, _)| key.len() > len) {
            best = Some((key.len(), pct));
        }
    }
    best.map(|(_, p)| p)
}

/// Raise-only 0.75 floor for windows below 512k.
pub(crate) fn apply_small_window_floor(percent: f64, window: u64) -> f64 {
    if window < SMALL_CONTEXT_WINDOW {
        percent.max(SMALL_CONTEXT_PERCENT_FLOOR)
    } else {
        percent
    }
}

/// Tail token budget: `floor(threshold × ratio)`, reduced to at most 20% of the
/// window, at least 1. `ratio` is clamped to [0.10, 0.80].
pub(crate) fn tail_token_budget(threshold: u64, window: u64, ratio: f64) -> u64 {
    let ratio = super::config::clamp_ratio(ratio);
    floor_mul(threshold, ratio)
        .min(floor_mul(window, TAIL_WINDOW_CAP_RATIO))
        .max(1)
}

/// Lean-mode tail budget (not used by the engine's default path): `clamp(2.5% of window, 10,000, 25,000)`, reduced to 20% of
/// the window. The 10,000 floor is itself clamped to 10% of the window so a
/// small window keeps room for head, summary and reply.
// Only the ported tests use it: the proxy demotes its tail by pruning instead.
#[cfg(test)]
pub(crate) fn lean_tail_token_budget(window: u64) -> u64 {
    let floor = LEAN_TAIL_FLOOR.min(floor_mul(window, 0.10));
    floor_mul(window, LEAN_TAIL_WINDOW_RATIO)
        .clamp(floor, LEAN_TAIL_CEILING.max(floor))
        .min(floor_mul(window, TAIL_WINDOW_CAP_RATIO))
        .max(1)
}

/// Upper bound of one summary: `min(5% of window, 10,000)`, at least 1.
pub(crate) fn max_summary_tokens(window: u64) -> u64 {
    floor_mul(window, MAX_SUMMARY_WINDOW_RATIO).clamp(1, MAX_SUMMARY_TOKENS_CAP)
}

/// [`max_summary_tokens`] further limited to a quarter of the trigger.
///
/// Sizing the summary from the window alone is not enough: when a large
/// output reservation or a low absolute cap makes the trigger small, a
/// window-sized summary could approach the trigger itself and re-fire
/// compaction at once. The clamp only binds when the trigger is below
/// 4 × `max_summary_tokens(window)`, which never happens at ≥ 64k windows
/// without a reservation or cap.
pub(crate) fn max_summary_tokens_for(window: u64, threshold: u64) -> u64 {
    max_summary_tokens(window).min((threshold / 4).max(1))
}

/// Summary target for one compaction: `max(floor, min(20% of middle, max_summary))`.
///
/// The floor is 2,000 tokens, which wins even over a lower cap. For
/// small windows that floor alone could exceed the trigger, so it is clamped
/// to `2 × max_summary` (10% of the window whenever `max_summary` comes from
/// [`max_summary_tokens`]); from 20k windows up the floor applies unchanged.
pub(crate) fn summary_budget(middle_tokens: u64, max_summary: u64) -> u64 {
    let floor = SUMMARY_BUDGET_FLOOR
        .min(max_summary.saturating_mul(2))
        .max(1);
    floor.max(floor_mul(middle_tokens, SUMMARY_MIDDLE_RATIO).min(max_summary))
}

/// Soft ceiling of the tail walk: 1.5 × budget, capped at 20% of the window,
/// never below the budget itself.
pub(crate) fn soft_tail_ceiling(budget: u64, window: u64) -> u64 {
    let soft = floor_mul(budget, SOFT_CEILING_FACTOR).min(floor_mul(window, TAIL_WINDOW_CAP_RATIO));
    soft.max(budget)
}

/// The request's `max_tokens` /
/// `max_completion_tokens`: a positive integer is an output reservation;
/// anything else (absent, null, zero, negative, fractional, non-numeric)
/// means none, so the threshold math never sees garbage. Numeric strings
/// are accepted: some clients send them.
// Only the ported tests use it: the proxy reads the reservation with the request
// (`ChatRequest::max_output_tokens`, the codec).
#[cfg(test)]
pub(crate) fn coerce_max_tokens(v: Option<&serde_json::Value>) -> Option<u64> {
    use serde_json::Value;
    match v? {
        Value::Number(n) => {
            if let Some(u) = n.as_u64() {
                (u > 0).then_some(u)
            } else if let Some(f) = n.as_f64() {
                (f.is_finite() && f >= 1.0 && f.fract() == 0.0 && f <= u64::MAX as f64)
                    .then_some(f as u64)
            } else {
                None
            }
        }
        Value::String(s) => s.trim().parse::<u64>().ok().filter(|&u| u > 0),
        _ => None,
    }
}

/// The budgets derived from one (config, model, window, reservation).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
// Only tests use it: the budgets one by one are the trigger's.
#[cfg(test)]
pub(crate) struct Budgets {
    /// Context window in tokens.
    pub(crate) window: u64,
    /// Prompt size at which compaction triggers.
    pub(crate) threshold_tokens: u64,
    /// Tokens the protected tail aims for.
    pub(crate) tail_token_budget: u64,
    /// Upper bound of one summary in tokens.
    pub(crate) max_summary_tokens: u64,
}

#[cfg(test)]
impl Budgets {
    /// Derive every budget from the raw config (per-model override, small
    /// window floor, trigger math, cap), whenever the model or window changes.
    pub(crate) fn compute(
        cfg: &CompactionConfig,
        model: &str,
        window: u64,
        max_tokens: Option<u64>,
    ) -> Budgets {
        let window = window.max(1);
        let percent = effective_percent(cfg, model, window);
        let threshold_tokens =
            compute_threshold_tokens(window, max_tokens, percent, cfg.threshold_tokens_cap());
        Budgets {
            window,
            threshold_tokens,
            tail_token_budget: tail_token_budget(
                threshold_tokens,
                window,
                cfg.effective_summary_target_ratio(),
            ),
            max_summary_tokens: max_summary_tokens_for(window, threshold_tokens),
        }
    }

    /// Soft ceiling of the tail walk for these budgets.
    pub(crate) fn soft_tail_ceiling(&self) -> u64 {
        soft_tail_ceiling(self.tail_token_budget, self.window)
    }

    /// Summary target for a middle of `middle_tokens`.
    pub(crate) fn summary_budget(&self, middle_tokens: u64) -> u64 {
        summary_budget(middle_tokens, self.max_summary_tokens)
    }
}

/// Below this window a summary call gets a wire reply cap; at and above it
/// the reply is left to the model (a hard cap once produced empty summaries
/// from reasoning models, and such windows are not at risk of overflow).
pub(crate) const SUMMARY_REPLY_CAP_WINDOW: u64 = MINIMUM_CONTEXT_LENGTH;
/// Characters per token the summariser's prompt budget is counted at
/// (conservative: prompts quote code and tool output).
pub(crate) const SUMMARY_PROMPT_CHARS_PER_TOKEN: u64 = 3;
/// Tokens kept free in a summary call's window for the chat template.
pub(crate) const SUMMARY_CALL_MARGIN: u64 = 64;

/// Prompt budget and reply cap of one summary call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SummariserBudgets {
    /// Characters of prompt the summariser reads.
    pub(crate) prompt_chars: usize,
    /// Wire `max_tokens` of the reply; `None` = no cap.
    pub(crate) reply_tokens: Option<u32>,
}

impl From<SummariserBudgets> for (usize, Option<u32>) {
    fn from(b: SummariserBudgets) -> Self {
        (b.prompt_chars, b.reply_tokens)
    }
}

/// The summariser's budgets at `window` with trigger `threshold`.
///
/// The reply cap follows `summary_target_ratio` of the trigger (the share
/// of the compacted request the summary may take, the same share the tail
/// gets), and is never below 1.25 × the largest summary target, so a model
/// that writes what it is asked for is not cut off. It is at most a third of
/// the window; the prompt gets the rest of the window (at 3 chars/token),
/// at most the 160,000-char reference input cap. Windows of 64k and more
/// keep the reference: 160,000 chars and no wire cap.
///
/// With the default ratio (0.20) and no reply reservation (trigger = 85% of
/// the window below 64k, 75% at 128k):
///
/// | window | largest summary target | reply cap (was) | prompt budget |
/// |---:|---:|---:|---:|
/// | 2,048 | 204 | 348 (102) | 4,908 chars |
/// | 4,096 | 409 | 696 (204) | 10,008 chars |
/// | 8,192 | 819 | 1,392 (409) | 20,208 chars |
/// | 32,768 | 2,000 | 5,570 (1,638) | 81,402 chars |
/// | 131,072 | 6,553 | none (none) | 160,000 chars |
///
/// A reservation lowers the trigger and with it the cap (2,048 with
/// `max_tokens` 256: 304), never below 1.25 × the target.
pub(crate) fn summariser_budgets(window: u64, threshold: u64, ratio: f64) -> SummariserBudgets {
    const REFERENCE_CHARS: usize = super::summariser::DEFAULT_PROMPT_BUDGET_CHARS;
    let window = window.max(1);
    if window >= SUMMARY_REPLY_CAP_WINDOW {
        return SummariserBudgets {
            prompt_chars: REFERENCE_CHARS,
            reply_tokens: None,
        };
    }
    let max_summary = max_summary_tokens_for(window, threshold);
    let largest_target = summary_budget(u64::MAX / 8, max_summary);
    let share = floor_mul(threshold, super::config::clamp_ratio(ratio));
    let reply = share
        .max(largest_target + largest_target / 4)
        .min(window / 3)
        .max(1);
    let prompt_tokens = window
        .saturating_sub(reply + SUMMARY_CALL_MARGIN)
        .max(window / 4);
    let chars =
        usize::try_from(prompt_tokens * SUMMARY_PROMPT_CHARS_PER_TOKEN).unwrap_or(REFERENCE_CHARS);
    SummariserBudgets {
        prompt_chars: chars.min(REFERENCE_CHARS),
        reply_tokens: u32::try_from(reply).ok(),
    }
}

#[cfg(test)]
mod tests;
