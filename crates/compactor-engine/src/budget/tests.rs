//! Budget arithmetic: the classic numbers at 64k and more, small windows,
//! the fixed part, and the invariants over any window (proptest).

use std::sync::Arc;

use super::*;
use crate::budget;
use crate::trigger::{Trigger, WindowSource};

fn cfg_with(f: impl FnOnce(&mut CompactionConfig)) -> Arc<CompactionConfig> {
    let mut c = CompactionConfig::default();
    f(&mut c);
    Arc::new(c)
}

fn trig(cfg: Arc<CompactionConfig>, model: &str, window: u64) -> Trigger {
    Trigger::new(cfg, model, WindowSource::Known(window), None)
}

fn pct(p: f64) -> Arc<CompactionConfig> {
    cfg_with(|c| c.threshold_percent = p)
}

#[test]
fn summariser_budgets_follow_the_trigger() {
    // (window, reply cap, prompt chars) with the default ratio, no reservation.
    let cfg = CompactionConfig::default();
    let ratio = cfg.effective_summary_target_ratio();
    let at = |w: u64| {
        let t = Budgets::compute(&cfg, "m", w, None).threshold_tokens;
        summariser_budgets(w, t, ratio)
    };
    for (w, reply) in [(2048u64, 348u32), (4096, 696), (8192, 1392), (32_768, 5570)] {
        let b = at(w);
        assert_eq!(b.reply_tokens, Some(reply), "{w}");
        // The prompt (at 3 chars/token) plus the reply fit the window.
        assert!(
            b.prompt_chars as u64 / 3 + u64::from(reply) <= w,
            "{w}: {b:?}"
        );
        // The reply holds the largest summary target with room to spare.
        let ms = max_summary_tokens_for(w, Budgets::compute(&cfg, "m", w, None).threshold_tokens);
        assert!(
            u64::from(reply) >= summary_budget(u64::MAX / 8, ms) * 5 / 4,
            "{w}"
        );
    }
    assert_eq!(
        at(131_072),
        SummariserBudgets {
            prompt_chars: 160_000,
            reply_tokens: None
        }
    );
    // A larger ratio gives the summary a larger share.
    let t = Budgets::compute(&cfg, "m", 8192, None).threshold_tokens;
    assert!(summariser_budgets(8192, t, 0.4).reply_tokens > at(8192).reply_tokens);
}

/// The trigger keeps its share of the room above the fixed part.
#[test]
fn the_trigger_follows_the_fixed_part() {
    let t0 = compute_threshold_tokens(8_192, None, 0.75, None);
    assert_eq!(t0, 6_963);
    assert_eq!(threshold_over_fixed(t0, 8_192, 0), t0);
    // Codex: ~6,300 tokens of instructions and tools.
    let t = threshold_over_fixed(t0, 8_192, 6_300);
    assert_eq!(t, 8_126);
    // Half the room above the fixed part is the history target: at
    // 500 tokens a turn, two turns pass before the next compaction.
    let h = history_target(t, 6_300, 0.5);
    assert_eq!(h, 913);
    assert!(6_300 + h + 500 < t && 6_300 + h + 1_000 >= t);
    // A fixed part past the window: just under it, never at or over.
    assert_eq!(threshold_over_fixed(t0, 8_192, 20_000), 8_191);
    // Small fixed parts barely move it.
    assert!(threshold_over_fixed(t0, 8_192, 400) < t0 + 150);
}

#[test]
fn the_user_messages_budget_follows_the_window() {
    assert_eq!(user_messages_budget(2_048, 10_000), 81);
    assert_eq!(user_messages_budget(8_192, 10_000), 327);
    assert_eq!(user_messages_budget(32_768, 100_000), 1_310);
    assert_eq!(user_messages_budget(1_000_000, 1_000_000), 4_000);
    // Never more than a fifth of what the history may take.
    assert_eq!(user_messages_budget(8_192, 800), 160);
}

#[test]
fn worked_examples_from_notes() {
    assert_eq!(
        compute_threshold_tokens(1_000_000, Some(32_000), 0.50, None),
        484_000
    );
    assert_eq!(
        compute_threshold_tokens(200_000, Some(80_000), 0.75, None),
        90_000
    );
    assert_eq!(compute_threshold_tokens(64_000, None, 0.75, None), 54_400);
    assert_eq!(compute_threshold_tokens(80_000, None, 0.75, None), 64_000);
    assert_eq!(compute_threshold_tokens(128_000, None, 0.75, None), 96_000);
}

#[test]
fn reservation_covering_window_uses_whole_window() {
    assert_eq!(
        compute_threshold_tokens(64_000, Some(64_000), 0.5, None),
        compute_threshold_tokens(64_000, None, 0.5, None)
    );
}

#[test]
fn degenerate_windows_stay_positive_and_below_window() {
    for w in [1u64, 2, 3, 10, 100] {
        let t = compute_threshold_tokens(w, None, 0.5, None);
        assert!(t >= 1);
        assert!(t < w || w == 1, "w={w} t={t}");
    }
}

#[test]
fn summary_budget_reference_floor_above_40k() {
    // 32k window: max_summary 1,600 but the 2,000 floor still wins.
    assert_eq!(summary_budget(1_000, max_summary_tokens(32_000)), 2_000);
    assert_eq!(summary_budget(100_000, max_summary_tokens(200_000)), 10_000);
    assert_eq!(summary_budget(30_000, max_summary_tokens(200_000)), 6_000);
    // 2k window: the floor is clamped to 10% of the window.
    assert_eq!(summary_budget(0, max_summary_tokens(2_048)), 204);
}

// ================================================================ not ported: our own

/// Windows of 64k and more: exactly the classic fixed numbers.
// A table of cases: its length is the cases, not logic.
#[allow(clippy::too_many_lines)]
#[test]
fn reference_numbers_hold_at_64k_and_above() {
    struct Case {
        name: &'static str,
        window: u64,
        max_tokens: Option<u64>,
        percent: f64,
        threshold: u64,
        tail: u64,
        max_summary: u64,
    }
    let cases = [
        Case {
            name: "64k",
            window: 64_000,
            max_tokens: None,
            percent: 0.50,
            threshold: 54_400,
            tail: 10_880,
            max_summary: 3_200,
        },
        Case {
            name: "80k",
            window: 80_000,
            max_tokens: None,
            percent: 0.50,
            threshold: 64_000,
            tail: 12_800,
            max_summary: 4_000,
        },
        Case {
            name: "100k@0.85",
            window: 100_000,
            max_tokens: None,
            percent: 0.85,
            threshold: 85_000,
            tail: 17_000,
            max_summary: 5_000,
        },
        Case {
            name: "100k",
            window: 100_000,
            max_tokens: None,
            percent: 0.50,
            threshold: 75_000,
            tail: 15_000,
            max_summary: 5_000,
        },
        Case {
            name: "128k",
            window: 128_000,
            max_tokens: None,
            percent: 0.50,
            threshold: 96_000,
            tail: 19_200,
            max_summary: 6_400,
        },
        Case {
            name: "200k-80k",
            window: 200_000,
            max_tokens: Some(80_000),
            percent: 0.50,
            threshold: 90_000,
            tail: 18_000,
            max_summary: 10_000,
        },
        Case {
            name: "1M-32k",
            window: 1_000_000,
            max_tokens: Some(32_000),
            percent: 0.50,
            threshold: 484_000,
            tail: 96_800,
            max_summary: 10_000,
        },
        Case {
            name: "1M",
            window: 1_000_000,
            max_tokens: None,
            percent: 0.50,
            threshold: 500_000,
            tail: 100_000,
            max_summary: 10_000,
        },
    ];
    for case in cases {
        let cfg = pct(case.percent);
        let b = Budgets::compute(&cfg, "m", case.window, case.max_tokens);
        assert_eq!(b.threshold_tokens, case.threshold, "{}", case.name);
        assert_eq!(b.tail_token_budget, case.tail, "{}", case.name);
        assert_eq!(b.max_summary_tokens, case.max_summary, "{}", case.name);
        // The 2,000-token summary floor applies unchanged.
        assert_eq!(b.summary_budget(0), 2_000, "{}", case.name);
    }
}

/// Small windows: the trigger stays below the usable window, and tail +
/// summary fit under the trigger with room to spare for the head and reply.
#[test]
fn small_windows_fit_with_room_for_reply() {
    for window in [2_048u64, 4_096, 8_192, 32_768] {
        for max_tokens in [None, Some(window / 8), Some(window / 4)] {
            for percent in [0.5, 0.85, 1.0] {
                let cfg = pct(percent);
                let b = Budgets::compute(&cfg, "llama", window, max_tokens);
                let reply = max_tokens.unwrap_or(0);
                let case = format!("window={window} max_tokens={max_tokens:?} percent={percent}");
                assert!(b.threshold_tokens < window - reply, "{case}: {b:?}");
                // Even a huge middle yields a summary within the window's share.
                let summary = b.summary_budget(10 * window);
                let soft_tail = b.soft_tail_ceiling();
                assert!(summary <= window / 10, "{case}: summary {summary}");
                assert!(soft_tail <= window / 5, "{case}: soft tail {soft_tail}");
                // Compacted: summary + (soft) tail leave at least half the
                // trigger for the head and further growth.
                assert!(
                    summary + soft_tail <= b.threshold_tokens / 2,
                    "{case}: {b:?}"
                );
                // Compacted size + reply fits the window.
                assert!(summary + soft_tail + reply < window, "{case}");
            }
        }
    }
}

#[test]
fn small_window_summary_floor_is_clamped() {
    // The fixed 2,000 floor would exceed a 2k window's trigger.
    let b = Budgets::compute(&CompactionConfig::default(), "m", 2_048, None);
    assert_eq!(b.threshold_tokens, 1_740);
    assert_eq!(b.max_summary_tokens, 102);
    assert_eq!(b.summary_budget(0), 204);
    assert_eq!(b.tail_token_budget, 348);
    // At 32k the fixed floor applies again.
    let b = Budgets::compute(&CompactionConfig::default(), "m", 32_768, None);
    assert_eq!(b.summary_budget(0), 2_000);
}

#[test]
fn tail_budget_and_soft_ceiling_rules() {
    // 20% window cap and 1.5x soft ceiling capped at 20% of the window.
    assert_eq!(tail_token_budget(500_000, 1_000_000, 0.2), 100_000);
    assert_eq!(tail_token_budget(500_000, 1_000_000, 0.8), 200_000); // capped at 20% of window
    assert_eq!(tail_token_budget(100_000, 1_000_000, 0.01), 10_000); // ratio clamped to 0.10
    assert_eq!(soft_tail_ceiling(10_000, 1_000_000), 15_000);
    assert_eq!(soft_tail_ceiling(10_000, 60_000), 12_000);
    assert_eq!(soft_tail_ceiling(20_000, 60_000), 20_000); // never below the budget
    assert_eq!(summary_budget(50_000, 10_000), 10_000);
    assert_eq!(summary_budget(5_000, 3_200), 2_000);
    assert_eq!(max_summary_tokens(1_000_000), 10_000);
    assert_eq!(budget::lean_tail_token_budget(1_000_000), 25_000);
    assert_eq!(budget::lean_tail_token_budget(200_000), 10_000);
    assert_eq!(budget::lean_tail_token_budget(8_192), 819);
}

#[test]
fn model_thresholds_longest_key_wins_and_small_window_floor_raises_only() {
    let cfg = cfg_with(|c| {
        c.model_thresholds.insert("gpt".into(), 0.60);
        c.model_thresholds.insert("gpt-5.5".into(), 0.90);
        c.model_thresholds.insert("claude".into(), 0.40);
    });
    assert_eq!(
        budget::effective_percent(&cfg, "openai/GPT-5.5-codex", 1_000_000),
        0.90
    );
    assert_eq!(budget::effective_percent(&cfg, "gpt-4o", 1_000_000), 0.60);
    assert_eq!(budget::effective_percent(&cfg, "claude-x", 1_000_000), 0.40);
    assert_eq!(budget::effective_percent(&cfg, "claude-x", 200_000), 0.75);
    assert_eq!(budget::effective_percent(&cfg, "gpt-5.5", 200_000), 0.90);
    assert_eq!(budget::effective_percent(&cfg, "other", 1_000_000), 0.50);
}

// ---------------------------------------------------------------- budget invariants (proptest)

mod props {
    use super::*;
    use proptest::prelude::*;

    fn cfg(percent: f64, cap: Option<u64>) -> CompactionConfig {
        CompactionConfig {
            threshold_percent: percent,
            threshold_tokens: cap,
            ..CompactionConfig::default()
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2_000))]

        /// Any window, reservation, percent and cap: a positive trigger below
        /// the usable input, a tail within the trigger, a soft ceiling within
        /// [tail, max(tail, 20% window)], and a summary far below the trigger.
        #[test]
        fn budgets_are_coherent(
            window in 256u64..4_000_000,
            reserve_frac in prop::option::of(0.0f64..0.95),
            percent in 0.01f64..1.0,
            cap in prop::option::of(1u64..2_000_000),
            middle in 0u64..10_000_000,
        ) {
            let max_tokens = reserve_frac.map(|f| (window as f64 * f) as u64);
            let b = Budgets::compute(&cfg(percent, cap), "m", window, max_tokens);
            let eff = window - max_tokens.unwrap_or(0);
            prop_assert!(b.threshold_tokens >= 1);
            prop_assert!(b.threshold_tokens < eff, "{b:?} eff={eff}");
            prop_assert!(b.tail_token_budget <= b.threshold_tokens);
            prop_assert!(b.tail_token_budget <= window / 5);
            let soft = b.soft_tail_ceiling();
            prop_assert!(soft >= b.tail_token_budget);
            prop_assert!(soft <= b.tail_token_budget.max(window / 5));
            let summary = b.summary_budget(middle);
            prop_assert!(summary >= 1);
            prop_assert!(summary <= window / 10 || summary <= 2_000, "{summary} {b:?}");
            // Without a user cap, what a compaction keeps (summary + soft
            // tail) fits under the trigger, so it cannot re-fire at once.
            if cap.is_none() {
                prop_assert!(summary + soft < b.threshold_tokens, "{summary}+{soft} {b:?}");
            }
        }

        /// Small windows with a sane reservation: compacted size + reply fit.
        #[test]
        fn small_windows_leave_room_for_reply(
            window in 1_024u64..65_536,
            reserve_frac in prop::option::of(0.0f64..0.5),
            percent in 0.05f64..1.0,
        ) {
            let max_tokens = reserve_frac.map(|f| (window as f64 * f) as u64);
            let b = Budgets::compute(&cfg(percent, None), "m", window, max_tokens);
            let summary = b.summary_budget(u64::MAX / 8);
            let soft = b.soft_tail_ceiling();
            let reply = max_tokens.unwrap_or(0);
            prop_assert!(b.threshold_tokens + reply < window || reply == 0 && b.threshold_tokens < window);
            prop_assert!(summary + soft + reply < window);
            prop_assert!(summary + soft <= b.threshold_tokens / 2 + b.threshold_tokens / 4);
        }

        /// Trigger math is monotonic in the window for a fixed percent and
        /// no reservation (a bigger window never triggers earlier).
        #[test]
        fn threshold_monotonic_in_window(w in 256u64..2_000_000, d in 1u64..100_000, percent in 0.5f64..1.0) {
            let a = compute_threshold_tokens(w, None, percent, None);
            let b = compute_threshold_tokens(w + d, None, percent, None);
            prop_assert!(b >= a, "w={w} d={d} a={a} b={b}");
        }
    }
}

#[test]
fn summary_cap_clamped_only_when_trigger_is_small() {
    // Huge reservation: the usable input is 10k of a 1M window.
    let b = Budgets::compute(&CompactionConfig::default(), "m", 1_000_000, Some(990_000));
    assert_eq!(b.threshold_tokens, 8_500);
    assert_eq!(b.max_summary_tokens, 2_125);
    assert_eq!(b.summary_budget(1_000_000), 2_125);
    // A low user cap.
    let cfg = cfg_with(|c| c.threshold_tokens = Some(20_000));
    let b = Budgets::compute(&cfg, "m", 1_000_000, None);
    assert_eq!(b.threshold_tokens, 20_000);
    assert_eq!(b.max_summary_tokens, 5_000);
    // The same through the Trigger.
    let mut t = trig(cfg, "m", 1_000_000);
    assert_eq!(t.max_summary_tokens(), 5_000);
    // The classic numbers otherwise.
    let b = Budgets::compute(&CompactionConfig::default(), "m", 1_000_000, None);
    assert_eq!(b.max_summary_tokens, 10_000);
}
