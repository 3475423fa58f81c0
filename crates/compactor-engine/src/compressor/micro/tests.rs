//! Micro-compaction's white-box tests: the ported micro tests that read or
//! set its rolling state (cursor, passes, failures, the rolling summary),
//! the configuration it runs under, or build its telemetry record by hand
//! (tests/REFERENCE_PARITY.md maps them; tests/engine_micro.rs has the rest).

use std::sync::Arc;

use serde_json::Value;

use super::*;
use crate::compressor::Compressor;
use crate::config::{CompactionConfig, Strategy};
use crate::test_support::*;
use crate::trigger::WindowSource;
use crate::truncated::CUT_MARKER;
use crate::view::is_summary;

fn pass(c: &mut Compressor, msgs: &[Value], s: &Stub) -> Vec<Value> {
    block_on(c.micro_compact(msgs, s)).messages
}

#[test]
fn disabled_is_a_no_op() {
    let mut c = micro();
    std::sync::Arc::make_mut(&mut c.cfg).strategy = Strategy::Batch;
    let msgs = conversation(6);
    assert_eq!(pass(&mut c, &msgs, &Stub::ok("ROLLING SUMMARY")), msgs);
}

#[test]
fn cursor_advances_across_successive_turns() {
    let mut c = micro();
    let s = Stub::ok("ROLLING SUMMARY");
    let first = pass(&mut c, &conversation(8), &s);
    let after_first = c.micro.cursor.unwrap();
    let second = pass(&mut c, &first, &s);
    assert!(after_first > 0);
    assert!(c.micro.cursor.unwrap() >= after_first);
    assert_eq!(markers(&second).len(), 1);
}

#[test]
fn user_messages_are_never_absorbed() {
    let mut c = micro();
    let s = Stub::ok("ROLLING SUMMARY");
    let mut msgs = conversation(10);
    let originals: Vec<String> = msgs
        .iter()
        .filter(|m| m["role"] == "user")
        .map(content_str)
        .collect();
    for _ in 0..5 {
        msgs = pass(&mut c, &msgs, &s);
    }
    let surviving: Vec<String> = msgs
        .iter()
        .filter(|m| m["role"] == "user" && !is_summary(m))
        .map(content_str)
        .collect();
    assert_eq!(surviving, originals);
    assert!(c.micro.passes >= 5);
}

#[test]
fn summarizer_failure_leaves_conversation_intact() {
    let mut c = micro();
    let msgs = conversation(6);
    let out = pass(&mut c, &msgs, &Stub::err(plain("boom")));
    assert_eq!(out, msgs);
    assert_eq!(c.micro.consecutive_failures, 1);
}

#[test]
fn poison_exchange_is_skipped_after_repeated_failures() {
    let mut c = micro();
    let msgs = conversation(6);
    let s = Stub::err(plain("boom"));
    let mut last = MicroOutcome::NoOp;
    for _ in 0..MICRO_COMPACT_MAX_CONSECUTIVE_FAILURES {
        last = block_on(c.micro_compact(&msgs, &s)).micro.unwrap().outcome;
    }
    assert_eq!(last, MicroOutcome::ExchangeSkipped);
    assert!(c.micro.cursor.unwrap() > 0);
    assert_eq!(c.micro.consecutive_failures, 0);
}

#[test]
fn emitter_never_forces_window_resolution() {
    let cfg = Arc::new(CompactionConfig::default());
    let trigger = Trigger::new(cfg, "test-model", WindowSource::Known(40_960), None);
    let t = MicroTelemetry::new(
        &trigger,
        &MicroState::default(),
        MicroOutcome::Absorbed,
        10,
        9,
        500,
        400,
        0,
    );
    t.emit();
    assert_eq!(
        trigger.window_resolutions(),
        0,
        "telemetry forced window resolution"
    );
    assert_eq!(t.occupancy_pct, None);
    assert_eq!(t.threshold_tokens, None);
}

#[test]
fn cumulative_savings_accumulate_across_passes() {
    let mut c = micro();
    let s = Stub::ok("ROLLING SUMMARY");
    let mut msgs = conversation(10);
    for _ in 0..4 {
        msgs = pass(&mut c, &msgs, &s);
    }
    assert_eq!(c.micro.passes, 4);
    assert!(
        c.micro.tokens_saved_total > 0,
        "{}",
        c.micro.tokens_saved_total
    );
}

#[test]
fn defrag_triggers_once_the_rolling_summary_grows() {
    let mut c = micro();
    c.micro.rolling_summary = "x".repeat(40_000);
    assert!(c.needs_defrag());
    let out = pass(
        &mut c,
        &conversation(8),
        &Stub::ok("FRESH DEFRAGGED SUMMARY"),
    );
    assert_eq!(c.micro.rolling_summary, "FRESH DEFRAGGED SUMMARY");
    let mk = markers(&out);
    assert_eq!(mk.len(), 1);
    assert!(content_str(mk[0]).contains("FRESH DEFRAGGED SUMMARY"));
}

const CUT: &str = "- build_id: B7-1234\n- tag: REL-42\n- half a li";

#[test]
fn a_cut_exchange_summary_is_kept_at_its_last_complete_line() {
    let mut c = micro();
    let s = Stub::reply(cut_reply(CUT));
    let r = block_on(c.micro_compact(&conversation(6), &s));
    assert_eq!(
        r.micro.unwrap().outcome,
        MicroOutcome::Absorbed,
        "not a failure"
    );
    assert_eq!(c.micro.consecutive_failures, 0);
    let text = marker_text(&r.messages);
    assert!(text.contains("- tag: REL-42"), "{text}");
    assert!(!text.contains("half a li"), "the partial line goes: {text}");
    assert!(text.contains(CUT_MARKER), "marked as cut: {text}");
    assert!(c.micro.rolling_summary.contains(CUT_MARKER));
}

#[test]
fn abort_on_degraded_summary_treats_a_cut_exchange_summary_as_a_failure() {
    let mut c = micro();
    std::sync::Arc::make_mut(&mut c.cfg).abort_on_degraded_summary = true;
    let msgs = conversation(6);
    let r = block_on(c.micro_compact(&msgs, &Stub::reply(cut_reply(CUT))));
    assert_eq!(r.micro.unwrap().outcome, MicroOutcome::SummarizeFailed);
    assert_eq!(r.messages, msgs);
}

#[test]
fn a_batch_compaction_over_a_micro_marker_carries_its_rolling_summary() {
    let mut c = micro();
    let msgs = conversation(8);
    let absorbed = pass(&mut c, &msgs, &Stub::ok("- micro fact: M-77"));
    assert!(!markers(&absorbed).is_empty());
    // A batch summary exists from before the micro pass.
    c.previous_summary = Some("- batch fact: B-11".into());
    let s = Stub::ok("## Historical Task Snapshot\nnew");
    let r = block_on(c.compress(
        &absorbed,
        &s,
        crate::compressor::CompressOptions {
            force: true,
            ..Default::default()
        },
    ));
    assert!(s.calls() >= 1, "{:?}", r.outcome);
    let prompt = s.request(0).prompt;
    assert!(prompt.contains("B-11"), "the batch summary");
    assert!(prompt.contains("M-77"), "the micro rolling summary");
}
