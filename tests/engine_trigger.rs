//! Ported trigger/calibration tests (tests/REFERENCE_PARITY.md maps them)
//! plus compactor's own tests of the
//! budget math at small windows, cooldowns and breakers.
//!
//! The window a fixture would patch in is a [`WindowSource`]; attributes a
//! test sets directly map to the `Trigger`'s public fields or its `set_*`
//! pins.

// Test helpers panic on bad fixtures: that is a failed test, as in a #[test].
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;
use std::time::Duration;

use compactor::compaction::budget::{
    self, coerce_max_tokens, compute_threshold_tokens, max_summary_tokens, soft_tail_ceiling,
    summary_budget, tail_token_budget, Budgets, MINIMUM_CONTEXT_LENGTH,
};
use compactor::compaction::config::{CompactionConfig, Strategy};
use compactor::compaction::trigger::{
    cooldown_for, seed_preflight, truncate_error_text, FailureClass, Trigger, TriggerSnapshot,
    Usage, WindowSource,
};
use serde_json::json;

fn cfg_with(f: impl FnOnce(&mut CompactionConfig)) -> Arc<CompactionConfig> {
    let mut c = CompactionConfig::default();
    f(&mut c);
    Arc::new(c)
}

/// The ported `compressor` fixture: model "test/model", threshold 0.85,
/// protect 2/2, window 100,000, resolved.
fn compressor() -> Trigger {
    let cfg = cfg_with(|c| {
        c.threshold_percent = 0.85;
        c.protect_first_n = 2;
        c.protect_last_n = 2;
    });
    let mut t = Trigger::new(cfg, "test/model", WindowSource::Known(100_000), None);
    let _ = t.context_length();
    t
}

fn trig(cfg: Arc<CompactionConfig>, model: &str, window: u64) -> Trigger {
    Trigger::new(cfg, model, WindowSource::Known(window), None)
}

fn pct(p: f64) -> Arc<CompactionConfig> {
    cfg_with(|c| c.threshold_percent = p)
}

fn usage(p: u64, c: u64, t: u64) -> Usage {
    Usage {
        prompt_tokens: Some(p),
        completion_tokens: Some(c),
        total_tokens: Some(t),
        ..Default::default()
    }
}

// ---------------------------------------------------------------- TestShouldCompress

#[test]
fn below_threshold() {
    let mut c = compressor();
    c.last_prompt_tokens = 50_000;
    assert!(!c.should_compress(None));
}

#[test]
fn above_threshold() {
    let mut c = compressor();
    c.last_prompt_tokens = 90_000;
    assert!(c.should_compress(None));
}

#[test]
fn explicit_tokens() {
    let mut c = compressor();
    assert!(c.should_compress(Some(90_000)));
    assert!(!c.should_compress(Some(50_000)));
}

// ---------------------------------------------------------------- TestUpdateFromResponse

#[test]
fn updates_fields() {
    let mut c = compressor();
    c.awaiting_real_usage_after_compression = true;
    c.last_compression_rough_tokens = 90_000;
    c.update_from_response(&usage(5_000, 1_000, 6_000));
    assert_eq!(c.last_prompt_tokens, 5_000);
    assert_eq!(c.last_completion_tokens, 1_000);
    assert_eq!(c.last_total_tokens, 6_000);
    assert_eq!(c.last_real_prompt_tokens, 5_000);
    assert_eq!(c.last_rough_tokens_when_real_prompt_fit, 90_000);
    assert!(!c.awaiting_real_usage_after_compression);
}

#[test]
fn missing_fields_default_zero() {
    let mut c = compressor();
    c.last_prompt_tokens = 1234;
    c.update_from_response(&Usage::default());
    assert_eq!(c.last_prompt_tokens, 0);
    assert_eq!(c.last_completion_tokens, 0);
    assert_eq!(c.last_total_tokens, 0);
}

// ---------------------------------------------------------------- TestPreflightDeferral

#[test]
fn does_not_defer_when_rough_growth_is_large() {
    let mut c = compressor();
    c.set_threshold_tokens(85_000);
    c.last_real_prompt_tokens = 50_000;
    c.last_rough_tokens_when_real_prompt_fit = 90_000;
    assert!(!c.should_defer_preflight_to_real_usage(100_000));
}

#[test]
fn defers_immediately_after_compaction_with_stale_real_prompt() {
    // The stale pre-compaction real value is over the threshold; the
    // awaiting flag must still force deferral.
    let mut c = compressor();
    c.set_threshold_tokens(85_000);
    c.last_real_prompt_tokens = 120_000;
    c.awaiting_real_usage_after_compression = true;
    assert!(c.should_defer_preflight_to_real_usage(95_000));
}

// ---------------------------------------------------------------- TestCompress (trigger parts)

#[test]
fn threshold_below_window_at_minimum_ctx() {
    // At the 64k minimum the floored trigger used to equal the window.
    let t = compute_threshold_tokens(MINIMUM_CONTEXT_LENGTH, None, 0.50, None);
    assert!(t < MINIMUM_CONTEXT_LENGTH);
    assert_eq!(t, 54_400);
}

#[test]
fn max_tokens_coercion_treats_non_int_as_no_reservation() {
    // Whatever JSON a client puts in `max_tokens` must coerce to a
    // reservation or to none, never to garbage.
    assert_eq!(coerce_max_tokens(None), None);
    assert_eq!(coerce_max_tokens(Some(&json!(null))), None);
    assert_eq!(coerce_max_tokens(Some(&json!(0))), None);
    assert_eq!(coerce_max_tokens(Some(&json!(-5))), None);
    assert_eq!(coerce_max_tokens(Some(&json!("nope"))), None);
    assert_eq!(coerce_max_tokens(Some(&json!(1.5))), None);
    assert_eq!(coerce_max_tokens(Some(&json!(true))), None);
    assert_eq!(coerce_max_tokens(Some(&json!({"a": 1}))), None);
    assert_eq!(coerce_max_tokens(Some(&json!(65536))), Some(65_536));
    assert_eq!(coerce_max_tokens(Some(&json!(4096.0))), Some(4_096));
    // A coerced reservation flows into a sane threshold.
    let mut c = Trigger::new(
        Arc::new(CompactionConfig::default()),
        "m",
        WindowSource::Known(200_000),
        coerce_max_tokens(Some(&json!(1))),
    );
    assert_eq!(c.max_tokens(), Some(1));
    let t = c.threshold_tokens();
    assert!(t > 0 && t < 200_000);
    assert_eq!(t, 149_999); // floor((200,000 − 1) × 0.75)
}

// ---------------------------------------------------------------- TestSummaryTargetRatio

#[test]
fn default_threshold_floored_at_75_percent_below_512k() {
    let mut c = trig(Arc::new(CompactionConfig::default()), "test", 100_000);
    let _ = c.context_length();
    assert_eq!(c.threshold_percent(), 0.75);
    assert_eq!(c.threshold_tokens(), 75_000);
}

// ---------------------------------------------------------------- TestUpdateModelBudgets

#[test]
fn tail_budget_recalculated() {
    let mut c = trig(pct(0.50), "model-a", 200_000);
    let old_tail = c.tail_token_budget();
    let old_max_summary = c.max_summary_tokens();
    c.update_model("model-b", Some(32_000), "", None);
    assert_ne!(c.tail_token_budget(), old_tail);
    assert!(c.tail_token_budget() < old_tail);
    assert_ne!(c.max_summary_tokens(), old_max_summary);
}

#[test]
fn budgets_proportional() {
    let mut c = trig(pct(0.50), "model-a", 100_000);
    c.update_model("model-b", Some(10_000), "", None);
    let th = c.threshold_tokens();
    assert_eq!(c.tail_token_budget(), (th as f64 * 0.20).floor() as u64);
    assert_eq!(
        c.max_summary_tokens(),
        ((10_000f64 * 0.05) as u64).min(4_000)
    );
}

// ---------------------------------------------------------------- TestUpdateModelResetsCalibration

fn big_model() -> Trigger {
    trig(pct(0.50), "big-model", 200_000)
}

#[test]
fn real_usage_state_cleared() {
    let mut c = big_model();
    c.last_prompt_tokens = 120_000;
    c.last_real_prompt_tokens = 120_000;
    c.last_rough_tokens_when_real_prompt_fit = 130_000;
    c.last_compression_rough_tokens = 130_000;
    c.awaiting_real_usage_after_compression = true;
    c.ineffective_compression_count = 2;

    c.update_model("small-model", Some(65_536), "", None);

    assert_eq!(c.last_prompt_tokens, 0);
    assert_eq!(c.last_real_prompt_tokens, 0);
    assert_eq!(c.last_rough_tokens_when_real_prompt_fit, 0);
    assert_eq!(c.last_compression_rough_tokens, 0);
    assert!(!c.awaiting_real_usage_after_compression);
    assert_eq!(c.ineffective_compression_count, 0);
}

#[test]
fn defer_no_longer_suppresses_after_switch() {
    // The old model's "it fit" must not defer preflight on a smaller model.
    let mut c = big_model();
    c.last_real_prompt_tokens = 50_000;
    c.last_rough_tokens_when_real_prompt_fit = 90_000;
    c.set_threshold_tokens(85_000);
    assert!(c.should_defer_preflight_to_real_usage(93_000));

    c.update_model("small-model", Some(65_536), "", None);
    let th = c.threshold_tokens();
    assert_eq!(th, 55_705);
    assert!(!c.should_defer_preflight_to_real_usage(th + 5_000));
}

// ---------------------------------------------------------------- TestThresholdTokensCap

fn toml_cfg(src: &str) -> CompactionConfig {
    toml::from_str(src).unwrap()
}

#[test]
fn no_cap_uses_ratio_only() {
    let mut c = trig(pct(0.50), "model-a", 1_000_000);
    let _ = c.context_length();
    assert_eq!(c.threshold_tokens(), 500_000);
    assert_eq!(c.threshold_tokens_cap(), None);
}

#[test]
fn invalid_cap_treated_as_none() {
    // The cap arrives from TOML.
    for src in [
        "threshold_percent = 0.5\nthreshold_tokens = 0",
        "threshold_percent = 0.5\nthreshold_tokens = -100",
        "threshold_percent = 0.5\nthreshold_tokens = \"not-a-number\"",
        "threshold_percent = 0.5\nthreshold_tokens = 0.0",
    ] {
        let cfg = toml_cfg(src);
        assert_eq!(cfg.threshold_tokens, None, "{src}");
        let mut c = trig(Arc::new(cfg), "model-a", 1_000_000);
        assert_eq!(c.threshold_tokens_cap(), None);
        assert_eq!(c.threshold_tokens(), 500_000, "{src}");
    }
    // And a valid one is kept.
    assert_eq!(
        toml_cfg("threshold_tokens = 200000").threshold_tokens,
        Some(200_000)
    );
}

#[test]
fn should_compress_fires_at_cap_below_ratio_threshold() {
    let cfg = cfg_with(|c| {
        c.threshold_percent = 0.50;
        c.threshold_tokens = Some(200_000);
    });
    let mut c = trig(cfg, "model-a", 1_000_000);
    assert!(!c.should_compress(Some(150_000)));
    assert!(c.should_compress(Some(200_000)));
    assert!(c.should_compress(Some(250_000)));
}

#[test]
fn default_config_disabled_and_no_behavior_change() {
    // DEFAULT_CONFIG → CompactionConfig::default() (and an empty TOML table).
    assert_eq!(CompactionConfig::default().threshold_tokens, None);
    assert_eq!(toml_cfg("").threshold_tokens, None);

    let mut baseline = trig(pct(0.50), "model-a", 1_000_000);
    let mut none = trig(
        cfg_with(|c| {
            c.threshold_percent = 0.5;
            c.threshold_tokens = None;
        }),
        "model-a",
        1_000_000,
    );
    let mut zero = trig(
        Arc::new(toml_cfg("threshold_percent = 0.5\nthreshold_tokens = 0")),
        "model-a",
        1_000_000,
    );
    let b = baseline.threshold_tokens();
    assert_eq!(none.threshold_tokens(), b);
    assert_eq!(zero.threshold_tokens(), b);

    baseline.update_model("model-b", Some(200_000), "", None);
    none.update_model("model-b", Some(200_000), "", None);
    zero.update_model("model-b", Some(200_000), "", None);
    let b = baseline.threshold_tokens();
    assert_eq!(b, 150_000);
    assert_eq!(none.threshold_tokens(), b);
    assert_eq!(zero.threshold_tokens(), b);
}

// ---------------------------------------------------------------- TestLazyContextResolution

mod capture {
    use std::sync::{Arc, Mutex};
    use tracing::field::{Field, Visit};
    use tracing_subscriber::layer::{Context, Layer};

    /// Records the `message` of every event.
    #[derive(Clone, Default)]
    pub struct Messages(pub Arc<Mutex<Vec<String>>>);

    struct MsgVisitor(String);
    impl Visit for MsgVisitor {
        fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
            if field.name() == "message" {
                self.0 = format!("{value:?}");
            }
        }
    }

    impl<S: tracing::Subscriber> Layer<S> for Messages {
        fn on_event(&self, event: &tracing::Event<'_>, _ctx: Context<'_, S>) {
            let mut v = MsgVisitor(String::new());
            event.record(&mut v);
            self.0.lock().unwrap().push(v.0);
        }
    }

    impl Messages {
        pub fn count(&self, needle: &str) -> usize {
            self.0
                .lock()
                .unwrap()
                .iter()
                .filter(|m| m.contains(needle))
                .count()
        }
    }
}

#[test]
fn init_does_not_probe_when_not_quiet() {
    use tracing_subscriber::layer::SubscriberExt;

    let msgs = capture::Messages::default();
    let subscriber = tracing_subscriber::registry().with(msgs.clone());
    tracing::subscriber::with_default(subscriber, || {
        // The proxy resolves the window before it builds the trigger; the
        // trigger resolves its budgets (and logs them) on first need.
        let mut c = Trigger::new(
            Arc::new(CompactionConfig::default()),
            "test/model",
            WindowSource::Known(200_000),
            None,
        );
        // No resolution and no init log at construction time.
        assert_eq!(c.window_resolutions(), 0);
        assert_eq!(c.cached_threshold_tokens(), None);
        assert_eq!(msgs.count("Context compressor initialized"), 0);

        assert_eq!(c.context_length(), 200_000);
        assert_eq!(c.window_resolutions(), 1);
        assert_eq!(msgs.count("Context compressor initialized"), 1);

        // Later access neither re-resolves nor re-logs.
        let _ = c.context_length();
        let _ = c.threshold_tokens();
        let _ = c.tail_token_budget();
        assert_eq!(msgs.count("Context compressor initialized"), 1);
        assert_eq!(c.window_resolutions(), 1);
    });
}

#[test]
fn lazy_window_resolved_by_threshold_access_first() {
    // Whatever reads the window first triggers the single resolution.
    let mut c = Trigger::new(
        Arc::new(CompactionConfig::default()),
        "m",
        WindowSource::Known(100_000),
        None,
    );
    assert_eq!(c.window_resolutions(), 0);
    assert!(!c.should_compress(Some(10)));
    assert_eq!(c.window_resolutions(), 1);
    assert_eq!(c.threshold_tokens(), 75_000);
    assert_eq!(c.window_resolutions(), 1);
}

#[test]
fn config_context_length_skips_network_probe() {
    // config_context_length → a Known window: nothing to resolve.
    let mut c = Trigger::new(
        Arc::new(CompactionConfig::default()),
        "test/model",
        WindowSource::Known(200_000),
        None,
    );
    assert_eq!(c.context_length(), 200_000);
    // A window learned before first use replaces the one the trigger was
    // built with: it is the one resolved, once.
    let mut c = Trigger::new(
        Arc::new(CompactionConfig::default()),
        "test/model",
        WindowSource::Known(1),
        None,
    );
    c.set_context_length(200_000);
    assert_eq!(c.context_length(), 200_000);
    assert_eq!(c.window_resolutions(), 1);
    assert_eq!(c.threshold_tokens(), 150_000);
}

// ---------------------------------------------------------------- TestPreflightSentinelGuard

#[test]
fn sentinel_preserved_after_compression() {
    let mut c = compressor();
    c.last_prompt_tokens = -1;
    assert_eq!(seed_preflight(c.last_prompt_tokens, 250_000), -1);
}

#[test]
fn real_value_still_revises_upward() {
    let mut c = compressor();
    c.last_prompt_tokens = 10_000;
    assert_eq!(seed_preflight(c.last_prompt_tokens, 50_000), 50_000);
    // ...but never downward.
    assert_eq!(seed_preflight(c.last_prompt_tokens, 5_000), 10_000);
}

// ---------------------------------------------------------------- TestContextLengthSetterCoherence

#[test]
fn same_value_reassignment_preserves_threshold_override() {
    let mut c = trig(Arc::new(CompactionConfig::default()), "test", 200_000);
    let _ = c.context_length();
    c.set_threshold_tokens(42_000);
    c.set_tail_token_budget(8_400);
    c.set_context_length(200_000);
    assert_eq!(c.threshold_tokens(), 42_000);
    assert_eq!(c.tail_token_budget(), 8_400);
}

#[test]
fn new_value_assignment_refloors_and_invalidates() {
    let mut c = trig(Arc::new(CompactionConfig::default()), "test", 1_000_000);
    let _ = c.context_length();
    assert_eq!(c.threshold_percent(), 0.50);
    c.set_context_length(200_000);
    assert_eq!(c.threshold_percent(), 0.75);
    assert_eq!(c.threshold_tokens(), 150_000);
}

// ---------------------------------------------------------------- TestPreLlmFeasibilityCheck (trigger parts)

#[test]
fn skip_count_resets_on_session_reset() {
    let mut c = compressor();
    c.prellm_skip_count = 5;
    c.ineffective_compression_count = 2;
    c.reset_session();
    assert_eq!(c.prellm_skip_count, 0);
    assert_eq!(c.ineffective_compression_count, 0);
}

#[test]
fn skip_count_resets_on_bind_session_state() {
    // bind_session_state(None, "s-new") → restoring an empty persisted row.
    let mut c = compressor();
    c.prellm_skip_count = 5;
    c.restore(TriggerSnapshot::default());
    assert_eq!(c.prellm_skip_count, 0);
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

#[test]
fn update_model_rederives_from_raw_config_percent() {
    let cfg = cfg_with(|c| {
        c.model_thresholds.insert("big".into(), 0.90);
    });
    let mut t = trig(cfg, "big-model", 1_000_000);
    assert_eq!(t.threshold_tokens(), 900_000);
    t.update_model("plain", Some(1_000_000), "", None);
    assert_eq!(t.threshold_percent(), 0.50);
    assert_eq!(t.threshold_tokens(), 500_000);
    // A pinned override does not survive a model change.
    t.set_threshold_tokens(1_000);
    t.update_model("plain2", None, "", Some(100_000));
    assert_eq!(t.threshold_tokens(), 450_000);
}

#[test]
fn config_toml_defaults_and_unknown_keys() {
    let c = toml_cfg("");
    assert_eq!(c.threshold_percent, 0.50);
    assert_eq!(c.protect_first_n, 3);
    assert_eq!(c.protect_last_n, 20);
    assert_eq!(c.min_tail_user_messages, 1);
    assert_eq!(c.summary_target_ratio, 0.20);
    assert!(!c.abort_on_summary_failure);
    assert_eq!(c.strategy, Strategy::Batch);
    assert!(c.charge_stale_thinking);
    let c = toml_cfg(
        "strategy = \"micro\"\nsummary_target_ratio = 0.95\n[model_thresholds]\n\"qwen2.5:7b\" = 0.8\n",
    );
    assert_eq!(c.strategy, Strategy::Micro);
    assert_eq!(c.effective_summary_target_ratio(), 0.80);
    assert_eq!(c.model_thresholds.get("qwen2.5:7b"), Some(&0.8));
    assert!(toml::from_str::<CompactionConfig>("bogus = 1").is_err());
}

// ---------------------------------------------------------------- cooldowns

#[test]
fn cooldown_classes_and_ladders() {
    assert_eq!(cooldown_for(FailureClass::NoProvider, 1), 600);
    assert_eq!(cooldown_for(FailureClass::Timeout, 0), 60);
    assert_eq!(cooldown_for(FailureClass::Timeout, 1), 60);
    assert_eq!(cooldown_for(FailureClass::Timeout, 2), 300);
    assert_eq!(cooldown_for(FailureClass::Timeout, 3), 900);
    assert_eq!(cooldown_for(FailureClass::Timeout, 9), 900);
    assert_eq!(cooldown_for(FailureClass::Truncated, 2), 300);
    assert_eq!(cooldown_for(FailureClass::HostStall, 1), 120);
    assert_eq!(cooldown_for(FailureClass::HostStall, 2), 300);
    for c in [
        FailureClass::Decode,
        FailureClass::StreamClosed,
        FailureClass::EmptyContent,
    ] {
        assert_eq!(cooldown_for(c, 1), 30);
    }
    for c in [
        FailureClass::Other,
        FailureClass::Auth,
        FailureClass::Overloaded,
        FailureClass::ModelNotFound,
    ] {
        assert_eq!(cooldown_for(c, 3), 60);
    }
}

#[tokio::test(start_paused = true)]
async fn cooldown_blocks_then_expires_with_clock() {
    let mut t = compressor();
    t.set_failure_cooldown(30, "stream closed");
    assert_eq!(t.cooldown_remaining(), Some(Duration::from_secs(30)));
    assert!(!t.should_compress(Some(90_000)));
    assert_eq!(t.block_reason().as_deref(), Some("cooldown:30"));
    tokio::time::advance(Duration::from_millis(29_500)).await;
    assert_eq!(t.block_reason().as_deref(), Some("cooldown:1"));
    tokio::time::advance(Duration::from_millis(500)).await;
    assert_eq!(t.cooldown_remaining(), None);
    assert!(t.should_compress(Some(90_000)));
}

#[tokio::test(start_paused = true)]
async fn new_cooldown_never_shortens_live_one() {
    let mut t = compressor();
    t.set_failure_cooldown(900, "timeout");
    t.set_failure_cooldown(30, "decode");
    assert_eq!(t.cooldown_remaining(), Some(Duration::from_secs(900)));
    assert_eq!(t.cooldown_error(), Some("timeout"));
    // A longer one extends it.
    t.set_failure_cooldown(1_000, "no provider");
    assert_eq!(t.cooldown_remaining(), Some(Duration::from_secs(1_000)));
    // After expiry a short one applies again.
    tokio::time::advance(Duration::from_secs(1_001)).await;
    t.set_failure_cooldown(30, "decode");
    assert_eq!(t.cooldown_remaining(), Some(Duration::from_secs(30)));
    t.clear_failure_cooldown();
    assert_eq!(t.cooldown_remaining(), None);
}

#[tokio::test(start_paused = true)]
async fn timeout_ladder_advances_and_success_resets() {
    let mut t = compressor();
    assert_eq!(
        t.note_summary_failure(FailureClass::Timeout, "timed out"),
        60
    );
    tokio::time::advance(Duration::from_secs(61)).await;
    assert_eq!(
        t.note_summary_failure(FailureClass::Timeout, "timed out"),
        300
    );
    tokio::time::advance(Duration::from_secs(301)).await;
    assert_eq!(
        t.note_summary_failure(FailureClass::Timeout, "timed out"),
        900
    );
    // Truncation has its own counter.
    assert_eq!(
        t.note_summary_failure(FailureClass::Truncated, "length"),
        60
    );
    assert_eq!(t.cooldown_remaining(), Some(Duration::from_secs(900)));
    t.note_summary_success();
    assert_eq!(t.cooldown_remaining(), None);
    assert_eq!(
        t.note_summary_failure(FailureClass::Timeout, "timed out"),
        60
    );
    assert_eq!(t.truncated_failures(), 0);
}

#[test]
fn error_text_truncated_to_220_chars() {
    let long = "é".repeat(500);
    let cut = truncate_error_text(&long);
    assert_eq!(cut.chars().count(), 220);
    assert!(cut.ends_with("..."));
    assert_eq!(truncate_error_text("short"), "short");
    let mut t = compressor();
    t.set_failure_cooldown(60, &long);
    assert_eq!(t.cooldown_error().map(|e| e.chars().count()), Some(220));
}

// ---------------------------------------------------------------- breakers

#[tokio::test(start_paused = true)]
async fn ineffective_strikes_from_real_usage_trip_breaker_and_probe_recovers() {
    let mut t = compressor(); // threshold 85,000
    for _ in 0..2 {
        t.record_completed_compaction(false, false, 60_000);
        assert_eq!(t.last_prompt_tokens, -1);
        assert!(t.awaiting_real_usage_after_compression);
        t.update_from_response(&usage(90_000, 10, 90_010)); // still over → strike
        assert!(!t.awaiting_real_usage_after_compression);
    }
    assert_eq!(t.ineffective_compression_count, 2);
    assert!(!t.should_compress(Some(95_000)));
    assert_eq!(t.block_reason().as_deref(), Some("ineffective"));
    let deadline = t.recovery_deadline().unwrap();
    tokio::time::advance(Duration::from_secs(299)).await;
    assert!(t.is_blocked());
    assert_eq!(t.recovery_deadline(), Some(deadline)); // not re-armed while waiting
    tokio::time::advance(Duration::from_secs(1)).await;
    // Probe: counters drop to 1 and one attempt is allowed.
    assert!(t.should_compress(Some(95_000)));
    assert_eq!(t.ineffective_compression_count, 1);
    assert_eq!(t.recovery_deadline(), None);
    // The probe fails too → tripped again, a fresh 300 s window.
    t.record_completed_compaction(false, false, 60_000);
    t.update_from_response(&usage(90_000, 0, 0));
    assert_eq!(t.ineffective_compression_count, 2);
    assert!(t.is_blocked());
}

#[test]
fn effective_compaction_clears_strikes() {
    let mut t = compressor();
    t.ineffective_compression_count = 1;
    t.record_completed_compaction(false, false, 40_000);
    t.update_from_response(&usage(40_000, 10, 40_010));
    assert_eq!(t.ineffective_compression_count, 0);
    assert_eq!(t.last_rough_tokens_when_real_prompt_fit, 40_000);
    // A reading over the threshold without a pending verdict is no strike.
    t.update_from_response(&usage(90_000, 0, 0));
    assert_eq!(t.ineffective_compression_count, 0);
}

#[test]
fn below_threshold_reading_clears_strikes_not_streak() {
    let mut t = compressor();
    t.ineffective_compression_count = 1;
    t.fallback_streak = 1;
    t.update_from_response(&usage(1_000, 0, 0));
    assert_eq!(t.ineffective_compression_count, 0);
    assert_eq!(t.fallback_streak, 1);
}

#[test]
fn fallback_streak_trips_and_skip_is_neutral() {
    let mut t = compressor();
    t.record_completed_compaction(true, false, 1);
    assert_eq!(t.fallback_streak, 1);
    t.record_completed_compaction(true, true, 1); // feasibility skip: unchanged
    t.record_completed_compaction(false, true, 1);
    assert_eq!(t.fallback_streak, 1);
    t.record_completed_compaction(true, false, 1);
    assert_eq!(t.fallback_streak, 2);
    assert!(t.breaker_tripped());
    assert_eq!(t.block_reason().as_deref(), Some("ineffective"));
    t.record_completed_compaction(false, false, 1);
    assert_eq!(t.fallback_streak, 0);
    assert_eq!(t.block_reason(), None);
    assert_eq!(t.recovery_deadline(), None); // disarmed once no longer tripped
}

#[test]
fn rejected_compaction_is_a_strike() {
    let mut t = compressor();
    t.record_rejected_compaction();
    t.record_rejected_compaction();
    assert_eq!(t.ineffective_compression_count, 2);
    assert!(t.is_blocked());
}

#[tokio::test(start_paused = true)]
async fn recovery_deadline_far_in_future_is_rearmed() {
    let mut t = compressor();
    t.fallback_streak = 2;
    // Persisted deadline from a clock that has since jumped back.
    let far = std::time::SystemTime::now() + Duration::from_secs(10_000);
    let ms = far
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64;
    t.restore(TriggerSnapshot {
        fallback_streak: 2,
        recovery_deadline_unix_ms: Some(ms),
        ..Default::default()
    });
    assert!(t.is_blocked());
    let d = t.recovery_deadline().unwrap();
    let rem = d.duration_since(tokio::time::Instant::now());
    assert_eq!(rem, Duration::from_secs(300));
}

#[tokio::test(start_paused = true)]
async fn structural_backoff_blocks_300s_without_strike() {
    let mut t = compressor();
    t.set_structural_backoff();
    assert_eq!(t.ineffective_compression_count, 0);
    assert_eq!(t.block_reason().as_deref(), Some("structural_backoff:300"));
    assert!(!t.should_compress(Some(90_000)));
    tokio::time::advance(Duration::from_secs(300)).await;
    assert!(t.should_compress(Some(90_000)));
    // A committed compaction clears it; so does an explicit clear.
    t.set_structural_backoff();
    t.record_completed_compaction(false, false, 1);
    assert_eq!(t.structural_backoff_remaining(), None);
    t.set_structural_backoff();
    t.clear_structural_backoff();
    assert_eq!(t.block_reason(), None);
}

#[test]
fn model_switch_clears_cooldown_and_streak_but_same_route_keeps_them() {
    let mut t = compressor();
    t.update_model("test/model", None, "http://a", None); // establish route
    t.set_failure_cooldown(300, "timeout");
    t.fallback_streak = 1;
    t.ineffective_compression_count = 1;
    t.prellm_skip_count = 3;
    // Same route, new window: calibration and strikes reset, cooldown/streak stay.
    t.update_model("test/model", Some(50_000), "http://a", None);
    assert_eq!(t.ineffective_compression_count, 0);
    assert_eq!(t.prellm_skip_count, 0);
    assert_eq!(t.fallback_streak, 1);
    assert!(t.cooldown_remaining().is_some());
    // Runtime change (model): cooldown and streak belong to the failed route.
    t.update_model("other/model", None, "http://a", None);
    assert_eq!(t.fallback_streak, 0);
    assert_eq!(t.cooldown_remaining(), None);
    // Runtime change (base URL) too.
    t.set_failure_cooldown(300, "timeout");
    t.update_model("other/model", None, "http://b", None);
    assert_eq!(t.cooldown_remaining(), None);
}

#[test]
fn provider_omitting_usage_disables_deferral() {
    let mut t = compressor();
    t.set_threshold_tokens(85_000);
    t.last_real_prompt_tokens = 50_000;
    t.last_rough_tokens_when_real_prompt_fit = 90_000;
    assert!(t.should_defer_preflight_to_real_usage(91_000));
    t.update_from_response(&Usage::default());
    assert!(t.provider_omits_usage);
    assert!(!t.should_defer_preflight_to_real_usage(91_000));
    // Below threshold never defers; usage coming back re-enables it.
    assert!(!t.should_defer_preflight_to_real_usage(1_000));
    t.update_from_response(&usage(50_000, 0, 0));
    assert!(!t.provider_omits_usage);
}

#[test]
fn deferral_raises_baseline_within_tolerance() {
    let mut t = compressor();
    t.set_threshold_tokens(85_000); // tolerance max(4,096, 4,250) = 4,250
    t.last_real_prompt_tokens = 50_000;
    t.last_rough_tokens_when_real_prompt_fit = 86_000;
    assert!(t.should_defer_preflight_to_real_usage(90_250));
    assert_eq!(t.last_rough_tokens_when_real_prompt_fit, 90_250);
    assert!(!t.should_defer_preflight_to_real_usage(94_501));
}

// ---------------------------------------------------------------- persistence

#[tokio::test(start_paused = true)]
async fn snapshot_restore_round_trip_carries_cooldown() {
    let mut a = compressor();
    a.set_failure_cooldown(999, "timeout");
    a.ineffective_compression_count = 1;
    a.fallback_streak = 1;
    a.compression_count = 4;
    a.prellm_skip_count = 7;
    let snap = a.snapshot();
    assert_eq!(snap.cooldown_error.as_deref(), Some("timeout"));
    let text = serde_json::to_string(&snap).unwrap();
    let back: TriggerSnapshot = serde_json::from_str(&text).unwrap();
    assert_eq!(back, snap);

    // 100 s pass on the wall clock while the process is down.
    let mut back = back;
    back.cooldown_until_unix_ms = back.cooldown_until_unix_ms.map(|ms| ms - 100_000);
    let mut b = compressor();
    b.prellm_skip_count = 2;
    b.restore(back);
    let rem = b.cooldown_remaining().unwrap();
    assert!(
        rem <= Duration::from_secs(899) && rem >= Duration::from_secs(898),
        "{rem:?}"
    );
    assert_eq!(b.cooldown_error(), Some("timeout"));
    assert_eq!(b.ineffective_compression_count, 1);
    assert_eq!(b.fallback_streak, 1);
    assert_eq!(b.compression_count, 4);
    assert_eq!(b.prellm_skip_count, 0);

    // A cleared cooldown persists as none.
    b.clear_failure_cooldown();
    assert_eq!(b.snapshot().cooldown_until_unix_ms, None);
    assert_eq!(b.snapshot().cooldown_error, None);
}

#[tokio::test(start_paused = true)]
async fn restore_without_cooldown_keeps_live_local_one() {
    let mut t = compressor();
    t.set_failure_cooldown(60, "decode");
    t.restore(TriggerSnapshot::default());
    assert_eq!(t.cooldown_remaining(), Some(Duration::from_secs(60)));
}

#[test]
fn reset_session_clears_everything_per_session() {
    let mut t = compressor();
    t.set_failure_cooldown(60, "x");
    t.set_structural_backoff();
    t.record_completed_compaction(true, false, 10);
    t.fallback_streak = 2;
    t.compression_count = 3;
    t.last_real_prompt_tokens = 5;
    let _ = t.block_reason();
    t.reset_session();
    assert_eq!(t.block_reason(), None);
    assert_eq!(t.fallback_streak, 0);
    assert_eq!(t.compression_count, 0);
    assert_eq!(t.last_prompt_tokens, 0);
    assert_eq!(t.last_real_prompt_tokens, 0);
    assert!(!t.awaiting_real_usage_after_compression);
    assert!(!t.verify_pending());
    assert_eq!(t.recovery_deadline(), None);
    // The window and budgets survive.
    assert_eq!(t.threshold_tokens(), 85_000);
}

#[test]
fn trigger_is_send_and_sync() {
    fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<Trigger>();
    assert_send_sync::<TriggerSnapshot>();
    assert_send_sync::<CompactionConfig>();
}

// ---------------------------------------------------------------- config from proxy.toml

fn table(src: &str) -> toml::Table {
    toml::from_str(src).unwrap()
}

#[test]
fn from_table_defaults_and_percent_scale() {
    let c = CompactionConfig::from_table(&toml::Table::new()).unwrap();
    assert_eq!(c.threshold_percent, 0.50);
    assert_eq!(c.summary_timeout_secs, 600);
    assert_eq!(c.micro_every_n_turns, 1);
    // `75` (integer percent, as a user may write it) means 0.75.
    let c = CompactionConfig::from_table(&table(
        "threshold_percent = 75\nstrategy = \"micro\"\n[model_thresholds]\nbig = 90\n",
    ))
    .unwrap();
    assert_eq!(c.effective_threshold_percent(), 0.75);
    let b = Budgets::compute(&c, "m", 1_000_000, None);
    assert_eq!(b.threshold_tokens, 750_000);
    let b = Budgets::compute(&c, "big-one", 1_000_000, None);
    assert_eq!(b.threshold_tokens, 900_000);
}

#[test]
fn from_table_errors_name_the_key() {
    for (src, key) in [
        ("threshold_percent = \"x\"", "threshold_percent"),
        ("bogus = 1", "bogus"),
        // Knobs the proxy has no use for are refused, not ignored: a typo'd
        // or foreign setting must not pass silently.
        ("max_attempts = 3", "max_attempts"),
        (
            "summary_idle_timeout_secs = 60",
            "summary_idle_timeout_secs",
        ),
        ("protect_first_n = -1", "protect_first_n"),
        ("strategy = \"sometimes\"", "strategy"),
        ("threshold_percent = 0", "threshold_percent"),
        ("threshold_percent = 150", "threshold_percent"),
        ("summary_timeout_secs = 0", "summary_timeout_secs"),
        ("micro_every_n_turns = 0", "micro_every_n_turns"),
    ] {
        let err = CompactionConfig::from_table(&table(src)).unwrap_err();
        assert_eq!(err.key.as_deref(), Some(key), "{src}: {err}");
        assert!(
            err.to_string().contains(&format!("compaction.{key}")),
            "{err}"
        );
    }
    let err = CompactionConfig::from_table(&table("[model_thresholds]\nx = -1\n")).unwrap_err();
    assert_eq!(err.key.as_deref(), Some("model_thresholds.\"x\""));
}

#[test]
fn config_debug_never_prints_summary_key() {
    let c = CompactionConfig::from_table(&table(
        "summary_api_key = \"sk-very-secret\"\nsummary_endpoint = \"http://127.0.0.1:9\"",
    ))
    .unwrap();
    assert_eq!(c.summary_api_key.as_deref(), Some("sk-very-secret"));
    let dbg = format!("{c:?}");
    assert!(!dbg.contains("sk-very-secret"), "{dbg}");
    assert!(dbg.contains("<redacted>"));
    assert!(dbg.contains("http://127.0.0.1:9"));
}

// ---------------------------------------------------------------- per-request inputs

#[test]
fn update_model_without_change_is_a_no_op() {
    let mut t = Trigger::new(
        Arc::new(CompactionConfig::default()),
        "m",
        WindowSource::Known(100_000),
        None,
    )
    .with_base_url("http://up");
    t.last_real_prompt_tokens = 50_000;
    t.ineffective_compression_count = 1;
    t.set_failure_cooldown(60, "x");
    t.update_model("m", None, "http://up", None);
    t.update_model("m", Some(100_000), "http://up", None);
    assert_eq!(t.last_real_prompt_tokens, 50_000);
    assert_eq!(t.ineffective_compression_count, 1);
    assert!(t.cooldown_active());
    // A real change still resets.
    t.update_model("m", Some(90_000), "http://up", None);
    assert_eq!(t.last_real_prompt_tokens, 0);
    assert!(t.cooldown_active()); // same route: cooldown kept
}

#[test]
fn set_max_tokens_rederives_threshold_and_keeps_calibration() {
    let mut t = trig(Arc::new(CompactionConfig::default()), "m", 200_000);
    assert_eq!(t.threshold_tokens(), 150_000);
    t.last_real_prompt_tokens = 42;
    t.fallback_streak = 1;
    t.set_max_tokens(Some(80_000));
    assert_eq!(t.threshold_tokens(), 90_000);
    assert_eq!(t.tail_token_budget(), 18_000);
    assert_eq!(t.last_real_prompt_tokens, 42);
    assert_eq!(t.fallback_streak, 1);
    t.set_max_tokens(Some(0)); // zero = no reservation
    assert_eq!(t.max_tokens(), None);
    assert_eq!(t.threshold_tokens(), 150_000);
    // A pinned threshold survives an unchanged reservation.
    t.set_threshold_tokens(1_234);
    t.set_max_tokens(None);
    assert_eq!(t.threshold_tokens(), 1_234);
}

#[test]
fn status_is_content_free_and_never_resolves() {
    let mut t = Trigger::new(
        Arc::new(CompactionConfig::default()),
        "m",
        WindowSource::Known(100_000),
        None,
    );
    let s = t.status();
    assert_eq!(t.window_resolutions(), 0, "status never resolves");
    assert_eq!(s.window, None);
    assert_eq!(s.threshold_tokens, None);
    assert_eq!(s.model, "m");

    let _ = t.threshold_tokens();
    t.set_failure_cooldown(30, "secret-bearing error text sk-123");
    t.fallback_streak = 2;
    let _ = t.block_reason();
    let s = t.status();
    assert_eq!(s.window, Some(100_000));
    assert_eq!(s.threshold_tokens, Some(75_000));
    assert_eq!(s.cooldown_remaining_secs, Some(30));
    assert_eq!(s.fallback_streak, 2);
    let json = serde_json::to_string(&s).unwrap();
    assert!(!json.contains("sk-123"), "{json}");
    // The breaker arms only when no cooldown blocks first.
    assert_eq!(s.recovery_probe_in_secs, None);
    t.clear_failure_cooldown();
    let _ = t.block_reason();
    assert_eq!(t.status().recovery_probe_in_secs, Some(300));
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
