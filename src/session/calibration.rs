//! Calibrating the rough token estimate with the real usage the upstream
//! reports.
//!
//! Per session we keep what was last sent (per-message rough estimates and
//! the hash chain) and the real `prompt_tokens` the upstream reported for it.
//! The next estimate is then:
//! - when the new request shares a prefix with that one (its chain starts
//!   with some of the sent chain): last real count + ratio × (rough estimate
//!   of the messages after the shared prefix − that of the counted ones it
//!   no longer carries, and any change in the non-message overhead). An
//!   agent that rewrites its previous user message every turn (qwen-code and
//!   aider move a date or a reminder) then costs only what it changed;
//! - otherwise: ratio × rough estimate of the whole request;
//!
//! where ratio = real / rough of the last observation, clamped to
//! [`MIN_RATIO`, `MAX_RATIO`]. Per-message rough estimates of the previous
//! request are reused for the shared prefix, so the work per request is
//! proportional to what is new.

use std::sync::Arc;

use serde_json::value::RawValue;

use crate::compaction::trigger::Usage;
use crate::request::common_prefix_len;

/// Smallest accepted real/rough ratio.
pub(crate) const MIN_RATIO: f64 = 0.25;
/// Largest accepted real/rough ratio.
pub(crate) const MAX_RATIO: f64 = 4.0;
/// Smallest growth (rough tokens) between two observations that yields a
/// marginal ratio; smaller steps are too noisy.
const MIN_MARGINAL_ROUGH: i64 = 32;

/// What one request carried, as far as estimation is concerned.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SentRequest {
    /// Chained message hashes ([`crate::request::message_hashes`]).
    pub(crate) hashes: Vec<u128>,
    /// Rough estimate per message.
    pub(crate) rough: Vec<u64>,
    /// Rough estimate of everything that is not a message (tools, schema,
    /// template overhead), as the caller computes it.
    pub(crate) overhead: u64,
    /// The calibrated estimate made for it.
    pub(crate) estimated_tokens: u64,
}

impl SentRequest {
    /// Sum of the per-message estimates plus the overhead.
    pub(crate) fn rough_total(&self) -> u64 {
        self.rough
            .iter()
            .fold(self.overhead, |acc, r| acc.saturating_add(*r))
    }
}

/// How a reply's prompt count shows that the upstream cut the prompt it
/// was sent, silently (Ollama drops the oldest messages of a prompt over
/// its loaded window and answers 200; LM Studio's overflow policies do the
/// same). Such a count is no calibration point: taken as one, it teaches
/// that tokens got cheaper, and every truncation makes the next estimate
/// smaller still.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Cut {
    /// compactor's estimate of what it sent is over the window, and the
    /// upstream counted no more than the window.
    OverWindow,
    /// The request extends the last one counted, yet the count grew by
    /// less than half of what the calibrated estimate says was added (or
    /// fell): the upstream holds at most `held`, whatever window compactor
    /// believed. Ollama drops the fewest old messages that make a prompt
    /// fit, so turn after turn its count stays just under its window while
    /// each turn adds hundreds of tokens.
    FellShort {
        /// The most the upstream was seen to hold: the window it has.
        held: u64,
    },
}

/// How an estimate was made.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Basis {
    /// No real usage yet: the plain rough estimate.
    Uncalibrated,
    /// ratio × rough estimate of the whole request.
    Ratio,
    /// Last real count plus the calibrated estimate of what changed since:
    /// `reused` leading messages were already counted by the upstream.
    Incremental {
        /// Messages covered by the last real count.
        reused: usize,
        /// The calibrated size (real tokens) of what the last count does not
        /// cover: the messages added after the shared prefix, the counted
        /// ones no longer sent, and any change in the overhead. Only this
        /// part of the estimate is uncertain.
        uncounted: u64,
    },
}

/// One estimate, with what the caller should remember having sent.
#[derive(Debug, Clone)]
pub struct Estimate {
    /// Calibrated prompt-token estimate.
    pub tokens: u64,
    /// Uncalibrated rough estimate of the whole request.
    pub rough_total: u64,
    /// How `tokens` was derived.
    pub basis: Basis,
    /// Messages whose rough estimate was computed for this call (the rest
    /// came from the previous request).
    pub newly_estimated: usize,
    /// Hand this to [`Calibration::observe`] with the real usage.
    pub sent: Arc<SentRequest>,
}

/// Content-free view for the admin endpoint, and what of the calibration
/// outlives the process (see [`Calibration::restore`]).
#[derive(Debug, Clone, Copy, PartialEq, Default, serde::Serialize, serde::Deserialize)]
#[serde(default)]
pub(crate) struct CalibrationSnapshot {
    /// Real `prompt_tokens` of the last observed request.
    pub(crate) last_real_prompt_tokens: Option<u64>,
    /// Current real/rough ratio.
    pub(crate) ratio: Option<f64>,
    /// estimate/real − 1 of the last observed request.
    pub(crate) last_estimate_error: Option<f64>,
    /// Real usage reports taken.
    pub(crate) observations: u64,
}

#[derive(Debug, Clone)]
struct Observation {
    sent: Arc<SentRequest>,
    real_prompt: u64,
}

/// Per-session calibration state.
#[derive(Debug, Clone, Default)]
pub struct Calibration {
    last: Option<Observation>,
    /// The most recent request estimated (maybe not yet observed); its
    /// per-message estimates are reused by the next call.
    recent: Option<Arc<SentRequest>>,
    ratio: Option<f64>,
    /// real/rough of what was added between two consecutive observations
    /// of one growing conversation. The whole-request ratio mixes in the
    /// non-message overhead (tool schemas a template may render in fewer
    /// tokens, chat-template scaffolding), so the marginal ratio prices new
    /// messages better once it is known.
    marginal: Option<f64>,
    last_error: Option<f64>,
    observations: u64,
}

/// The calibration maths alone: `last_real` is the real count of the
/// previous request when the new one extends it, `new_rough` the rough
/// estimate of what was added since (may be negative when the non-message
/// overhead shrank).
pub(crate) fn calibrated(
    last_real: Option<u64>,
    ratio: f64,
    rough_total: u64,
    new_rough: i64,
) -> u64 {
    let ratio = ratio.clamp(MIN_RATIO, MAX_RATIO);
    match last_real {
        Some(real) => {
            let add = (ratio * new_rough as f64).round();
            if add >= 0.0 {
                real.saturating_add(add as u64)
            } else {
                real.saturating_sub((-add) as u64)
            }
        }
        None => (ratio * rough_total as f64).round() as u64,
    }
}

/// What changed between a counted request and a new one, in rough tokens.
struct Change {
    /// Leading messages the two share.
    reused: usize,
    /// Rough tokens added minus those dropped (overhead included).
    net: i64,
    /// The part the count does not vouch for, in rough tokens: each message
    /// after the shared prefix that stands where a counted one stood costs
    /// the difference of their sizes (a rewritten message is mostly its old
    /// text again, priced by the same ratio: the errors of pricing what left
    /// and what came back cancel rather than add); the messages beyond the
    /// shorter of the two, and any overhead change, cost their whole size.
    moved: u64,
}

/// The change from `obs` to `sent` when they share at least their first
/// message: the counted prefix is kept and only the rest is priced again,
/// so a rewritten message costs what it changed, not the whole request.
fn changed_since(obs: &Observation, sent: &SentRequest) -> Option<Change> {
    let before = &obs.sent;
    let k = common_prefix_len(&before.hashes, &sent.hashes)
        .min(before.rough.len())
        .min(sent.rough.len());
    if k == 0 {
        return None;
    }
    let (old, new) = (&before.rough[k..], &sent.rough[k..]);
    let dropped: u64 = old.iter().sum();
    let added: u64 = new.iter().sum();
    let aligned = old.len().min(new.len());
    let rewritten: u64 = old.iter().zip(new).map(|(a, b)| a.abs_diff(*b)).sum();
    let beyond: u64 = old[aligned..].iter().chain(&new[aligned..]).sum();
    let overhead = sent.overhead as i64 - before.overhead as i64;
    Some(Change {
        reused: k,
        net: added as i64 - dropped as i64 + overhead,
        moved: rewritten + beyond + overhead.unsigned_abs(),
    })
}

impl Calibration {
    /// Fresh state (no observations).
    pub fn new() -> Self {
        Self::default()
    }

    /// The current real/rough ratio, if any real usage was seen.
    pub fn ratio(&self) -> Option<f64> {
        self.ratio
    }

    /// Real `prompt_tokens` of the last observed request.
    pub(crate) fn last_real_prompt(&self) -> Option<u64> {
        self.last.as_ref().map(|o| o.real_prompt)
    }

    /// Relative error of the last observed estimate: estimate/real − 1.
    // Only tests read it.
    #[cfg(test)]
    pub(crate) fn last_error(&self) -> Option<f64> {
        self.last_error
    }

    /// Number of real usage reports taken.
    // Only tests read it.
    #[cfg(test)]
    pub(crate) fn observations(&self) -> u64 {
        self.observations
    }

    /// Content-free summary (admin endpoint).
    pub(crate) fn snapshot(&self) -> CalibrationSnapshot {
        CalibrationSnapshot {
            last_real_prompt_tokens: self.last_real_prompt(),
            ratio: self.ratio,
            last_estimate_error: self.last_error,
            observations: self.observations,
        }
    }

    /// Takes the ratio, the last error and the observation count of a
    /// snapshot (a restart): estimates are priced by the ratio until the
    /// next real usage. The last observation itself is not restored: its
    /// per-message estimates are gone with the process.
    pub(crate) fn restore(&mut self, snap: &CalibrationSnapshot) {
        self.ratio = snap.ratio.map(|r| r.clamp(MIN_RATIO, MAX_RATIO));
        self.last_error = snap.last_estimate_error;
        self.observations = snap.observations;
    }

    /// Forgets everything (model switch: old calibration must not suppress
    /// what a different tokenizer needs).
    pub(crate) fn reset(&mut self) {
        *self = Self::default();
    }

    /// Estimates the prompt tokens of `messages` (with chain `hashes`, same
    /// length) plus `overhead`. `rough` is the engine's per-message
    /// estimator; it runs only for messages not shared with the previous
    /// request. The estimate is remembered so the next call can reuse it.
    pub fn estimate<F>(
        &mut self,
        messages: &[Box<RawValue>],
        hashes: Vec<u128>,
        overhead: u64,
        rough: F,
    ) -> Estimate
    where
        F: Fn(&RawValue) -> u64,
    {
        self.estimate_indexed(messages, hashes, overhead, |_, m| rough(m))
    }

    /// [`Self::estimate`]; `rough` is also told the index of the message
    /// in `messages` (for estimates made beforehand).
    pub(crate) fn estimate_indexed<F>(
        &mut self,
        messages: &[Box<RawValue>],
        mut hashes: Vec<u128>,
        overhead: u64,
        rough: F,
    ) -> Estimate
    where
        F: Fn(usize, &RawValue) -> u64,
    {
        let n = messages.len().min(hashes.len());
        // Taken, not copied: the remembered request keeps the caller's chain.
        hashes.truncate(n);
        // Reuse per-message estimates from whichever remembered request
        // shares the longer prefix.
        let mut reuse: (usize, Option<&SentRequest>) = (0, None);
        for cand in [self.recent.as_deref(), self.last.as_ref().map(|o| &*o.sent)]
            .into_iter()
            .flatten()
        {
            let l = common_prefix_len(&cand.hashes, &hashes).min(cand.rough.len());
            if l > reuse.0 {
                reuse = (l, Some(cand));
            }
        }
        let mut per_msg = Vec::with_capacity(n);
        if let (l, Some(src)) = reuse {
            per_msg.extend_from_slice(&src.rough[..l]);
        }
        let newly_estimated = n - per_msg.len();
        for (i, m) in messages.iter().enumerate().take(n).skip(per_msg.len()) {
            per_msg.push(rough(i, m));
        }
        let mut sent = SentRequest {
            hashes,
            rough: per_msg,
            overhead,
            estimated_tokens: 0,
        };
        let rough_total = sent.rough_total();
        let ratio = self.ratio.unwrap_or(1.0);
        let (tokens, basis) = match self
            .last
            .as_ref()
            .map(|obs| (obs, changed_since(obs, &sent)))
        {
            Some((obs, Some(change))) => {
                let ratio = self.marginal.unwrap_or(ratio).clamp(MIN_RATIO, MAX_RATIO);
                let uncounted = (ratio * change.moved as f64).round() as u64;
                (
                    calibrated(Some(obs.real_prompt), ratio, rough_total, change.net),
                    Basis::Incremental {
                        reused: change.reused,
                        uncounted,
                    },
                )
            }
            _ if self.ratio.is_some() => (calibrated(None, ratio, rough_total, 0), Basis::Ratio),
            _ => (rough_total, Basis::Uncalibrated),
        };
        sent.estimated_tokens = tokens;
        let sent = Arc::new(sent);
        self.recent = Some(sent.clone());
        Estimate {
            tokens,
            rough_total,
            basis,
            newly_estimated,
            sent,
        }
    }

    /// Whether `real_prompt`, reported for `sent`, is a count of a prompt
    /// the upstream cut (judged before it is learned from, against
    /// `window` and the last count). Falling short within a fiftieth of the
    /// last count (at least 32 tokens) is a template's or tokenizer's
    /// noise, not a cut; so is a count that grew by half of the estimate
    /// of what was added or more (a calibrated estimate is not off by 2×).
    pub(crate) fn cut(
        &self,
        sent: &SentRequest,
        real_prompt: u64,
        window: Option<u64>,
    ) -> Option<Cut> {
        if real_prompt == 0 {
            return None;
        }
        if window.is_some_and(|w| w > 0 && sent.estimated_tokens > w && real_prompt <= w) {
            return Some(Cut::OverWindow);
        }
        let obs = self.last.as_ref()?;
        let before = &obs.sent.hashes;
        let extends = !before.is_empty()
            && sent.hashes.len() > before.len()
            && common_prefix_len(before, &sent.hashes) == before.len();
        let added = sent.estimated_tokens.saturating_sub(obs.real_prompt);
        let slack = (obs.real_prompt / 50).max(32);
        let short = real_prompt + slack < obs.real_prompt + added / 2;
        (extends && short).then_some(Cut::FellShort {
            held: obs.real_prompt.max(real_prompt),
        })
    }

    /// Records the real `prompt_tokens` reported for `sent`. Readings of 0
    /// are ignored (some upstreams report 0 on a cache hit).
    pub fn observe(&mut self, sent: Arc<SentRequest>, real_prompt: u64) {
        if real_prompt == 0 {
            return;
        }
        let rough = sent.rough_total();
        if rough > 0 {
            self.ratio = Some((real_prompt as f64 / rough as f64).clamp(MIN_RATIO, MAX_RATIO));
        }
        if sent.estimated_tokens > 0 {
            self.last_error = Some(sent.estimated_tokens as f64 / real_prompt as f64 - 1.0);
        }
        if let Some(prev) = &self.last {
            let extends = !prev.sent.hashes.is_empty()
                && common_prefix_len(&prev.sent.hashes, &sent.hashes) == prev.sent.hashes.len();
            let grown = rough as i64 - prev.sent.rough_total() as i64;
            let real_grown = real_prompt as i64 - prev.real_prompt as i64;
            if extends && grown >= MIN_MARGINAL_ROUGH && real_grown > 0 {
                self.marginal =
                    Some((real_grown as f64 / grown as f64).clamp(MIN_RATIO, MAX_RATIO));
            }
        }
        self.observations += 1;
        self.last = Some(Observation { sent, real_prompt });
    }

    /// The one place real usage is learned from: the calibration takes the
    /// real prompt size of `sent`, and returns the same usage in the
    /// engine's rough units (by the scale just learned) for the trigger,
    /// which judges thresholds in those units.
    pub(crate) fn learn(&mut self, sent: Arc<SentRequest>, usage: Usage) -> Usage {
        if let Some(prompt) = usage.prompt_tokens {
            self.observe(sent, prompt);
        }
        let scale = self.engine_scale();
        let prompt = usage.prompt_tokens.map(|p| scale.to_rough(p));
        Usage {
            prompt_tokens: prompt,
            completion_tokens: usage.completion_tokens,
            total_tokens: prompt
                .map(|p| p + usage.completion_tokens.unwrap_or(0))
                .or(usage.total_tokens),
            cached_tokens: usage.cached_tokens,
        }
    }

    /// Real → rough conversion for the engine, from the current ratio.
    pub(crate) fn engine_scale(&self) -> EngineScale {
        EngineScale::from_ratio(self.ratio)
    }
}

/// How many real tokens one rough (chars/4) token is worth, for handing
/// real figures to the engine, which budgets in rough units.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct EngineScale(f64);

impl EngineScale {
    /// Ratios this close to 1 are noise (and a rough estimate that
    /// overshoots only makes compaction earlier): no scaling.
    const NOISE: f64 = 1.1;
    /// Largest scale applied.
    const MAX: f64 = 4.0;

    /// From the calibrated real/rough ratio, quantised to 1/8 so small
    /// drifts do not recompute the engine's budgets every turn.
    pub(crate) fn from_ratio(ratio: Option<f64>) -> Self {
        match ratio {
            Some(r) if r.is_finite() && r > Self::NOISE => {
                Self(((r.min(Self::MAX) * 8.0).round() / 8.0).max(1.0))
            }
            _ => Self(1.0),
        }
    }

    /// The factor.
    pub(crate) fn factor(self) -> f64 {
        self.0
    }

    /// Real tokens → rough tokens.
    pub(crate) fn to_rough(self, real: u64) -> u64 {
        (real as f64 / self.0).floor() as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::request::message_hashes;
    use std::cell::Cell;

    fn msgs(texts: &[&str]) -> Vec<Box<RawValue>> {
        texts
            .iter()
            .map(|t| RawValue::from_string(serde_json::to_string(t).unwrap()).unwrap())
            .collect()
    }

    /// Rough estimator for tests: string length (the JSON text minus quotes).
    fn len_est(m: &RawValue) -> u64 {
        m.get().len() as u64 - 2
    }

    #[test]
    fn pure_maths() {
        assert_eq!(calibrated(None, 1.5, 1000, 0), 1500);
        assert_eq!(calibrated(Some(800), 0.5, 9999, 100), 850);
        assert_eq!(calibrated(Some(800), 0.5, 9999, -100), 750);
        assert_eq!(calibrated(None, 100.0, 10, 0), 40, "clamped to MAX_RATIO");
        assert_eq!(calibrated(None, 0.0, 100, 0), 25, "clamped to MIN_RATIO");
        assert_eq!(calibrated(Some(10), 1.0, 0, -50), 0);
    }

    #[test]
    fn uncalibrated_then_ratio_then_incremental() {
        let mut c = Calibration::new();
        let t1 = msgs(&["aaaaaaaaaa", "bbbbbbbbbb"]); // 20 rough
        let e1 = c.estimate(&t1, message_hashes(&t1), 0, len_est);
        assert_eq!((e1.tokens, e1.basis), (20, Basis::Uncalibrated));
        // The upstream says 30: ratio 1.5.
        c.observe(e1.sent.clone(), 30);
        assert_eq!(c.ratio(), Some(1.5));
        assert_eq!(c.last_error(), Some(20.0 / 30.0 - 1.0));

        // Next turn extends: 30 real + 1.5 × 10 new.
        let t2 = msgs(&["aaaaaaaaaa", "bbbbbbbbbb", "cccc", "dddddd"]);
        let e2 = c.estimate(&t2, message_hashes(&t2), 0, len_est);
        assert_eq!(
            e2.basis,
            Basis::Incremental {
                reused: 2,
                uncounted: 15
            }
        );
        assert_eq!(e2.tokens, 45);
        assert_eq!(e2.rough_total, 30);

        // A request that shares nothing with the counted one (another
        // opening): ratio × rough.
        let t3 = msgs(&["XXXXXXXXXX", "bbbbbbbbbb", "cccc"]);
        let e3 = c.estimate(&t3, message_hashes(&t3), 0, len_est);
        assert_eq!(e3.basis, Basis::Ratio);
        assert_eq!(e3.tokens, 36); // 1.5 × 24
    }

    #[test]
    fn a_count_the_upstream_cut_is_told_from_one_it_did_not() {
        let mut c = Calibration::new();
        let long = "x".repeat(4_000);
        let t1 = msgs(&[&long, &long]); // 8,000 rough
        let e1 = c.estimate(&t1, message_hashes(&t1), 0, len_est);
        // Over a 4,096 window by the estimate, counted within it: cut.
        assert_eq!(c.cut(&e1.sent, 4_000, Some(4_096)), Some(Cut::OverWindow));
        // Counted over the window, or a window the estimate fits: no cut.
        assert_eq!(c.cut(&e1.sent, 8_100, Some(4_096)), None);
        assert_eq!(c.cut(&e1.sent, 4_000, Some(16_384)), None);
        assert_eq!(c.cut(&e1.sent, 0, Some(4_096)), None);
        c.observe(e1.sent.clone(), 8_000);
        // The next request extends it and counts far fewer: cut, whatever
        // the window; a few tokens fewer is a template's noise.
        let t2 = msgs(&[&long, &long, "more"]);
        let e2 = c.estimate(&t2, message_hashes(&t2), 0, len_est);
        assert_eq!(
            c.cut(&e2.sent, 4_000, None),
            Some(Cut::FellShort { held: 8_000 })
        );
        assert_eq!(c.cut(&e2.sent, 7_990, None), None);
        // A turn of ~1,000 tokens added and the count barely moved: the
        // upstream dropped what it could not hold (Ollama turn by turn).
        let turn = "t".repeat(1_000);
        let t4 = msgs(&[&long, &long, &turn]);
        let e4 = c.estimate(&t4, message_hashes(&t4), 0, len_est);
        assert_eq!(e4.tokens, 9_000);
        assert_eq!(
            c.cut(&e4.sent, 8_010, None),
            Some(Cut::FellShort { held: 8_010 })
        );
        // Half of it counted or more: an estimate off, not a cut.
        assert_eq!(c.cut(&e4.sent, 8_600, None), None);
        // A request that does not extend it (a compacted one) may count
        // fewer.
        let t3 = msgs(&["summary", "more"]);
        let e3 = c.estimate(&t3, message_hashes(&t3), 0, len_est);
        assert_eq!(c.cut(&e3.sent, 10, None), None);
    }

    /// qwen-code and aider rewrite their previous user message every turn
    /// (a date or a reminder moved): the counted prefix before it still
    /// holds, and only the rewritten message and what follows are priced
    /// again, so the uncertain part is what changed, not the request.
    #[test]
    fn a_rewritten_message_costs_what_it_changed() {
        let mut c = Calibration::new();
        let system = "s".repeat(4_000);
        let t1 = msgs(&[&system, "first ask", &"log ".repeat(200)]);
        let e1 = c.estimate(&t1, message_hashes(&t1), 0, len_est);
        c.observe(e1.sent.clone(), e1.tokens * 2);
        // The next turn drops a reminder from the last user message (100
        // rough fewer) and adds an answer and a new ask.
        let rewritten = "log ".repeat(175);
        let t2 = msgs(&[&system, "first ask", &rewritten, "answer", "second ask"]);
        let e2 = c.estimate(&t2, message_hashes(&t2), 0, len_est);
        let dropped = 800;
        let added = 700 + 6 + 10;
        // The rewritten message costs its change in size (100), the answer
        // and the new ask their whole size (16).
        assert_eq!(
            e2.basis,
            Basis::Incremental {
                reused: 2,
                uncounted: 2 * (100 + 16)
            }
        );
        assert_eq!(e2.tokens, e1.tokens * 2 + 2 * added - 2 * dropped);
        // The whole-request ratio gives the same figure here; what differs
        // is that only 232 of its 9,450 tokens are uncertain.
        assert_eq!(e2.tokens, 9_450);
        // A message that is longer now than the one it replaces costs the
        // difference too, and one dropped from the end its whole size.
        let t3 = msgs(&[&system, "first ask", &"log ".repeat(180)]);
        let e3 = c.estimate(&t3, message_hashes(&t3), 0, len_est);
        assert_eq!(
            e3.basis,
            Basis::Incremental {
                reused: 2,
                uncounted: 2 * 80
            }
        );
    }

    #[test]
    fn overhead_changes_are_counted() {
        let mut c = Calibration::new();
        let t1 = msgs(&["aaaaaaaaaa"]);
        let e1 = c.estimate(&t1, message_hashes(&t1), 100, len_est);
        c.observe(e1.sent, 220); // ratio 2
        let t2 = msgs(&["aaaaaaaaaa", "bb"]);
        let e2 = c.estimate(&t2, message_hashes(&t2), 50, len_est);
        // 220 + 2 × (2 new − 50 overhead removed)
        assert_eq!(e2.tokens, 124);
    }

    #[test]
    fn only_new_messages_are_estimated() {
        let mut c = Calibration::new();
        let calls = Cell::new(0u32);
        let counting = |m: &RawValue| {
            calls.set(calls.get() + 1);
            len_est(m)
        };
        let t1 = msgs(&["a", "b", "c"]);
        let e1 = c.estimate(&t1, message_hashes(&t1), 0, counting);
        assert_eq!((calls.get(), e1.newly_estimated), (3, 3));
        // Even before usage arrives, the next request reuses the estimates.
        let t2 = msgs(&["a", "b", "c", "d", "e"]);
        let e2 = c.estimate(&t2, message_hashes(&t2), 0, counting);
        assert_eq!((calls.get(), e2.newly_estimated), (5, 2));
        c.observe(e2.sent.clone(), 10);
        // A fork that shares two messages re-estimates only its own part.
        let t3 = msgs(&["a", "b", "z"]);
        let e3 = c.estimate(&t3, message_hashes(&t3), 0, counting);
        assert_eq!((calls.get(), e3.newly_estimated), (6, 1));
    }

    #[test]
    fn zero_usage_ignored_and_reset_forgets() {
        let mut c = Calibration::new();
        let t = msgs(&["abcd"]);
        let e = c.estimate(&t, message_hashes(&t), 0, len_est);
        c.observe(e.sent.clone(), 0);
        assert_eq!(c.ratio(), None);
        assert_eq!(c.observations(), 0);
        c.observe(e.sent, 8);
        assert_eq!(c.ratio(), Some(2.0));
        let snap = serde_json::to_value(c.snapshot()).unwrap();
        assert_eq!(snap["last_real_prompt_tokens"], 8);
        assert_eq!(snap["observations"], 1);
        c.reset();
        assert_eq!((c.ratio(), c.last_real_prompt()), (None, None));
    }

    #[test]
    fn ratio_is_clamped() {
        let mut c = Calibration::new();
        let t = msgs(&["abcd"]);
        let e = c.estimate(&t, message_hashes(&t), 0, len_est);
        c.observe(e.sent, 1_000_000);
        assert_eq!(c.ratio(), Some(MAX_RATIO));
    }

    #[test]
    fn incremental_estimate_tracks_a_growing_conversation() {
        // Simulated upstream whose tokenizer counts 1.3 tokens per rough
        // unit plus 7 per message: after one observation the incremental
        // estimate of the next turn is within a few percent.
        let real = |m: &[Box<RawValue>]| -> u64 {
            m.iter()
                .map(|x| (len_est(x) as f64 * 1.3).round() as u64 + 7)
                .sum()
        };
        let mut c = Calibration::new();
        let mut history: Vec<String> = vec!["system prompt ".repeat(20)];
        for turn in 0..20 {
            history.push(format!("user turn {turn} ").repeat(5 + turn % 7));
            history.push(format!("assistant reply {turn} ").repeat(9 + turn % 5));
            let refs: Vec<&str> = history.iter().map(String::as_str).collect();
            let m = msgs(&refs);
            let e = c.estimate(&m, message_hashes(&m), 0, len_est);
            let actual = real(&m);
            if turn > 0 {
                let err = (e.tokens as f64 - actual as f64).abs() / actual as f64;
                assert!(err < 0.03, "turn {turn}: est {} real {actual}", e.tokens);
                assert!(matches!(e.basis, Basis::Incremental { .. }));
            }
            c.observe(e.sent, actual);
        }
    }

    /// The whole-request ratio of a first report mixes in overhead that the
    /// upstream renders cheaply (tool schemas); once two reports of one
    /// growing conversation exist, new messages are priced at the marginal
    /// ratio between them.
    #[test]
    fn marginal_ratio_prices_new_messages() {
        let mut c = Calibration::new();
        let a = msgs(&["aaaaaaaaaa"]);
        // 10 rough for the message + 1000 rough of overhead, real only 60.
        let e1 = c.estimate(&a, message_hashes(&a), 1000, len_est);
        c.observe(e1.sent, 60);
        let b = msgs(&["aaaaaaaaaa", &"b".repeat(200)]);
        let e2 = c.estimate(&b, message_hashes(&b), 1000, len_est);
        // Real growth of 400 for 200 rough: marginal ratio 2.
        c.observe(e2.sent, 460);
        let d = msgs(&["aaaaaaaaaa", &"b".repeat(200), &"c".repeat(100)]);
        let e3 = c.estimate(&d, message_hashes(&d), 1000, len_est);
        assert_eq!(e3.tokens, 460 + 200);
    }
}

#[cfg(test)]
mod engine_scale_tests {
    use super::*;
    use crate::request::message_hashes;

    #[test]
    fn engine_scale_ignores_noise_and_quantises() {
        assert_eq!(EngineScale::from_ratio(None).factor(), 1.0);
        assert_eq!(EngineScale::from_ratio(Some(1.05)).factor(), 1.0);
        assert_eq!(EngineScale::from_ratio(Some(0.5)).factor(), 1.0);
        assert_eq!(EngineScale::from_ratio(Some(2.03)).factor(), 2.0);
        assert_eq!(EngineScale::from_ratio(Some(1.6)).factor(), 1.625);
        assert_eq!(EngineScale::from_ratio(Some(9.0)).factor(), 4.0);
        assert_eq!(EngineScale::from_ratio(Some(f64::NAN)).factor(), 1.0);
        assert_eq!(EngineScale::from_ratio(Some(2.0)).to_rough(2048), 1024);
    }

    #[test]
    fn learn_hands_the_trigger_real_usage_in_rough_units() {
        let mut cal = Calibration::new();
        let msgs: Vec<Box<RawValue>> = vec![RawValue::from_string("\"xxxxxxxx\"".into()).unwrap()];
        let hashes = message_hashes(&msgs);
        let est = cal.estimate(&msgs, hashes.clone(), 0, |_| 1000);
        let usage = Usage {
            prompt_tokens: Some(2000),
            completion_tokens: Some(10),
            total_tokens: Some(2010),
            cached_tokens: Some(5),
        };
        let engine = cal.learn(est.sent, usage);
        // Real is twice the rough estimate: the trigger sees rough units.
        assert_eq!(cal.engine_scale().factor(), 2.0);
        assert_eq!(engine.prompt_tokens, Some(1000));
        assert_eq!(engine.total_tokens, Some(1010));
        assert_eq!(engine.completion_tokens, Some(10));
        assert_eq!(engine.cached_tokens, Some(5));
        // No prompt figure: nothing learned, the rest passes through.
        let mut fresh = Calibration::new();
        let e = fresh.learn(
            cal.estimate(&msgs, hashes.clone(), 0, |_| 1000).sent,
            Usage {
                total_tokens: Some(7),
                ..Usage::default()
            },
        );
        assert_eq!(fresh.ratio(), None);
        assert_eq!(e.prompt_tokens, None);
        assert_eq!(e.total_tokens, Some(7));
    }
}
