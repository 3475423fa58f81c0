//! The trigger's tests: the ported trigger/calibration tests
//! (tests/REFERENCE_PARITY.md maps them), persistence and the per-request
//! inputs. White-box, like the reference: a test sets a counter the
//! reference sets as an attribute, and reads it back.

use std::sync::Arc;
use std::time::Duration;

use serde_json::json;

use super::breakers::seed_preflight;
use super::{Trigger, TriggerSnapshot, Usage, WindowSource};
use crate::budget::{coerce_max_tokens, compute_threshold_tokens, MINIMUM_CONTEXT_LENGTH};
use crate::config::CompactionConfig;

pub(super) fn cfg_with(f: impl FnOnce(&mut CompactionConfig)) -> Arc<CompactionConfig> {
    let mut c = CompactionConfig::default();
    f(&mut c);
    Arc::new(c)
}

/// The ported `compressor` fixture: model "test/model", threshold 0.85,
/// protect 2/2, window 100,000, resolved.
pub(super) fn compressor() -> Trigger {
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

pub(super) fn usage(p: u64, c: u64, t: u64) -> Usage {
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
    pub(super) struct Messages(pub(super) Arc<Mutex<Vec<String>>>);

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
        pub(super) fn count(&self, needle: &str) -> usize {
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
