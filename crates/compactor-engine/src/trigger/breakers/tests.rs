//! Cooldowns, their ladders and the breakers (compactor's own tests).

use std::time::Duration;

use super::super::tests::{compressor, usage};
use super::super::{TriggerSnapshot, Usage};
use super::{cooldown_for, truncate_error_text, FailureClass};

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
