//! Step 3 of the walk: whether a request is compacted, and how (a batch
//! compaction, a micro pass, forced). Free of I/O, so it is tested without
//! a conversation (the trigger keeps its own counters).

use crate::compaction::trigger::Trigger;
use crate::session::calibration::{Basis, Estimate};

/// "Fits the window" needs the estimate plus 1/10 of it (see [`decide`]),
/// unless the upstream counted most of the request (see
/// [`estimate_margin`]).
pub(super) const ESTIMATE_MARGIN_DIVISOR: u64 = 10;

/// How far the estimate of a request may be short of the real count. An
/// estimate that shares a prefix with a request the upstream counted is
/// that real count plus the calibrated estimate of what changed since (the
/// messages added, the counted ones no longer sent): only that part is
/// uncertain, so a third of it is margin (the added part is priced by the
/// conversation's own marginal ratio; a misjudged one costs an overflow
/// retry, not a lost request), and at least 1% of the whole, at most the
/// tenth that anything else keeps: at an 8k window with a 6k fixed part the
/// tenth alone took ~750 tokens, more than a turn, and every turn compacted
/// again because the last one "did not fit". Near the window's edge the
/// upstream's tokenizer, when it has one, settles it instead
/// (`prepare::size_up`).
pub(super) fn estimate_margin(est: &Estimate) -> u64 {
    margin(est.tokens, est.basis)
}

fn margin(tokens: u64, basis: Basis) -> u64 {
    let whole = tokens / ESTIMATE_MARGIN_DIVISOR;
    match basis {
        Basis::Incremental { uncounted, .. } => (uncounted / 3).max(tokens / 100).min(whole),
        _ => whole,
    }
}

/// How many times its calibrated estimate a newly added part may really
/// cost: a pasted log of digits, hashes or hex tokenizes up to four times
/// denser than the conversation's prose-calibrated ratio prices it (Gemma
/// splits every digit into a token of its own), and a little more where
/// the ratio is below one. hermes-agent on an 8k llama.cpp: a turn added
/// ~600 estimated tokens that were 2,300 real, and a request the estimate
/// put under the trigger reached the upstream at 8,314 of 8,192.
pub(super) const DENSE_ADDITION_FACTOR: u64 = 5;

/// Whether the upstream's tokenizer, when it has one, settles a request
/// before it is sent: when it is under the window by the estimate (over it,
/// it is compacted anyway) but could be over it by its error: within a
/// tenth of the estimate, or within [`DENSE_ADDITION_FACTOR`] times what
/// changed since the upstream's last count.
pub(super) fn count_due(est: &Estimate, window: u64, reply: u64) -> bool {
    let tokens = est.tokens;
    if tokens + reply >= window {
        return false;
    }
    let added = match est.basis {
        Basis::Incremental { uncounted, .. } => uncounted,
        _ => 0,
    };
    let error =
        (tokens / ESTIMATE_MARGIN_DIVISOR).max(added.saturating_mul(DENSE_ADDITION_FACTOR - 1));
    tokens + error + reply >= window
}

/// Whether request number `requests` (1-based) is a micro-compaction turn.
pub(super) fn conv_turn_due(requests: u64, every_n: u32) -> bool {
    requests.is_multiple_of(u64::from(every_n.max(1)))
}

/// What a request's size looks like to the trigger.
pub(super) struct Sizes {
    /// Calibrated prompt estimate, real tokens.
    pub(super) est_real: u64,
    /// How far it may be short, real tokens.
    pub(super) margin: u64,
    /// The same in the engine's rough units.
    pub(super) est_rough: u64,
    /// The request's output cap, real tokens.
    pub(super) max_out: Option<u64>,
    /// The context window, real tokens.
    pub(super) window: u64,
}

/// Whether and how a request is compacted.
pub(super) struct Decision {
    /// The trigger's threshold (rough units), for the log line.
    pub(super) threshold: u64,
    /// Why it is compacted, for the log line: `overflow` (the upstream
    /// refused it), `window` (it does not fit with its margin and reply),
    /// `trigger` (over the trigger), `micro` (a micro pass's turn), or `""`.
    pub(super) reason: &'static str,
    /// A batch compaction runs.
    pub(super) wanted: bool,
    /// A micro pass runs instead (strategy `micro`, its turn, no batch).
    pub(super) micro_pass: bool,
    /// The compaction must happen now (after an overflow, no cooldown).
    pub(super) force: bool,
}

/// The trigger decision, free of I/O (the trigger keeps its own counters).
pub(super) fn decide(trigger: &mut Trigger, s: Sizes, overflow: bool, micro_due: bool) -> Decision {
    let threshold = trigger.threshold_tokens();
    // The estimate is calibrated but still char-based: a tool output of
    // file listings tokenizes denser than prose. Near the window's edge a
    // few percent decide between an answer and an overflow round trip, so
    // "fits" keeps a margin.
    let fits_window = s.est_real + s.margin + s.max_out.unwrap_or(0) < s.window;
    // Right after a compaction the rough figure is not trusted until the
    // upstream reports real usage (the engine's deferral), unless the request
    // would not even fit the window.
    let defer = trigger.awaiting_real_usage() && fits_window;
    // After an overflow the compaction must happen. It clears a failure
    // cooldown only when none is running: a summariser that just failed is
    // not asked again, the engine uses its deterministic fallback.
    let force = overflow && trigger.cooldown_remaining().is_none();
    // A request that cannot fit the window is compacted even while the
    // trigger is blocked (cooldown, breaker): forwarding it can only fail.
    let must = overflow || !fits_window;
    let wanted = must
        || (!defer
            && s.est_rough >= threshold
            && trigger.should_compress(Some(s.est_rough as i64)));
    // Micro-compaction is per turn (every Nth turn, whatever the size); over the threshold the batch compaction still runs, since
    // absorbing one exchange per request cannot keep up with a full window.
    let micro_pass = !wanted && !overflow && micro_due;
    let reason = if overflow {
        "overflow"
    } else if !fits_window {
        "window"
    } else if wanted {
        "trigger"
    } else if micro_pass {
        "micro"
    } else {
        ""
    };
    Decision {
        threshold,
        reason,
        wanted,
        micro_pass,
        force,
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::compaction::config::CompactionConfig;
    use crate::compaction::trigger::WindowSource;

    const WINDOW: u64 = 10_000;

    fn trigger() -> Trigger {
        let cfg = Arc::new(CompactionConfig::default());
        Trigger::new(cfg, "m", WindowSource::Known(WINDOW), None)
    }

    fn sizes(est: u64) -> Sizes {
        Sizes {
            est_real: est,
            margin: est / ESTIMATE_MARGIN_DIVISOR,
            est_rough: est,
            max_out: None,
            window: WINDOW,
        }
    }

    /// The trigger's threshold for [`WINDOW`].
    fn threshold() -> u64 {
        decide(&mut trigger(), sizes(0), false, false).threshold
    }

    fn estimate(tokens: u64, basis: Basis) -> Estimate {
        Estimate {
            tokens,
            rough_total: tokens,
            basis,
            newly_estimated: 1,
            sent: Arc::default(),
        }
    }

    fn inc(uncounted: u64) -> Basis {
        Basis::Incremental {
            reused: 10,
            uncounted,
        }
    }

    #[test]
    fn a_large_change_near_the_window_is_counted_and_a_small_one_is_not() {
        // hermes-agent at 8,192: 5,900 counted, ~600 estimated added (2,300
        // real): far under the tenth's band, but five times the addition
        // reaches the window.
        assert!(count_due(&estimate(6_500, inc(600)), 8_192, 0));
        // The same request with a one-line addition stays uncounted.
        assert!(!count_due(&estimate(6_000, inc(100)), 8_192, 0));
        // Within a tenth of the estimate is counted whatever was added, and
        // the reply cap counts as part of the request.
        assert!(count_due(&estimate(7_500, Basis::Ratio), 8_192, 0));
        assert!(!count_due(&estimate(6_500, Basis::Ratio), 8_192, 0));
        assert!(count_due(&estimate(6_500, Basis::Ratio), 8_192, 1_100));
        // Over the window by the estimate: compacted without a count.
        assert!(!count_due(&estimate(8_192, inc(600)), 8_192, 0));
        // A rewritten message counts what it removed as well as what it
        // added: 6,000 after dropping 500 and adding 100 is uncertain by 600.
        assert!(count_due(&estimate(6_000, inc(600)), 8_192, 0));
        assert!(!count_due(&estimate(6_000, inc(50)), 8_192, 0));
    }

    #[test]
    fn below_the_threshold_nothing_runs_and_above_it_a_batch_does() {
        let th = threshold();
        assert!(
            th + th / ESTIMATE_MARGIN_DIVISOR < WINDOW,
            "test needs a fitting threshold"
        );
        let d = decide(&mut trigger(), sizes(th - 1), false, false);
        assert!(!d.wanted && !d.micro_pass && !d.force);
        let d = decide(&mut trigger(), sizes(th), false, false);
        assert!(d.wanted && !d.micro_pass && !d.force);
        assert_eq!(d.reason, "trigger");
        // Under the trigger but not fitting with its margin: the window.
        let s = Sizes {
            margin: WINDOW,
            ..sizes(th - 1)
        };
        assert_eq!(decide(&mut trigger(), s, false, false).reason, "window");
        assert_eq!(
            decide(&mut trigger(), sizes(10), true, false).reason,
            "overflow"
        );
        assert_eq!(
            decide(&mut trigger(), sizes(10), false, true).reason,
            "micro"
        );
        assert_eq!(decide(&mut trigger(), sizes(10), false, false).reason, "");
    }

    #[test]
    fn deferral_holds_unless_the_request_cannot_fit() {
        let th = threshold();
        let mut t = trigger();
        t.set_awaiting_real_usage(true);
        assert!(!decide(&mut t, sizes(th), false, false).wanted);
        // Estimate plus its margin over the window: compacted anyway.
        let d = decide(&mut t, sizes(WINDOW - WINDOW / 20), false, false);
        assert!(d.wanted && !d.force);
        // The output cap counts towards fitting too.
        let s = Sizes {
            max_out: Some(WINDOW / 2),
            ..sizes(th)
        };
        assert!(decide(&mut t, s, false, false).wanted);
    }

    #[test]
    fn only_what_the_upstream_did_not_count_is_uncertain() {
        // 7,400 counted, 550 added: a third of the addition.
        assert_eq!(margin(7_950, inc(550)), 183);
        // Never under 1% of the whole, never over the tenth.
        assert_eq!(margin(8_000, inc(10)), 80);
        assert_eq!(margin(8_000, inc(7_900)), 800);
        // qwen-code's rewritten reminder at 9,300 (rewritten-history case):
        // 8,511 estimated; its last user message rewritten (~816 tokens
        // before, ~787 now: 29) and a turn added (~680): ~709 changed. The
        // tenth (851) made it "not fit" and compact under its trigger; what
        // changed does not.
        assert!(8_511 + margin(8_511, inc(709)) < 9_300);
        assert!(8_511 + margin(8_511, Basis::Ratio) >= 9_300);
        // Sharing nothing with a counted request: the tenth.
        assert_eq!(margin(7_950, Basis::Ratio), 795);
        assert_eq!(margin(7_950, Basis::Uncalibrated), 795);
    }

    #[test]
    fn an_overflow_forces_a_compaction_whatever_the_size() {
        let d = decide(&mut trigger(), sizes(10), true, true);
        assert!(d.wanted && d.force && !d.micro_pass);
    }

    #[test]
    fn a_micro_pass_runs_on_its_turn_below_the_threshold_only() {
        let th = threshold();
        let d = decide(&mut trigger(), sizes(10), false, true);
        assert!(d.micro_pass && !d.wanted);
        let d = decide(&mut trigger(), sizes(th), false, true);
        assert!(d.wanted && !d.micro_pass);
        assert!(!decide(&mut trigger(), sizes(10), false, false).micro_pass);
    }
}
