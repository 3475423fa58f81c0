//! Ported micro-compaction tests (tests/REFERENCE_PARITY.md maps them). The
//! summary call is the scripted [`Stub`] summariser; the strategy switch is
//! `Strategy::Micro`; summary metadata rows are rows classified as
//! summaries; telemetry lines are the returned `MicroTelemetry` record.

// Test helpers panic on bad fixtures: that is a failed test, as in a #[test].
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod engine_support;

use std::sync::Arc;

use compactor::compaction::compressor::Compressor;
use compactor::compaction::config::{CompactionConfig, Strategy};
use compactor::compaction::micro::{
    MicroOutcome, MicroState, MicroTelemetry, MICRO_COMPACT_MAX_CONSECUTIVE_FAILURES,
};
use compactor::compaction::summariser::SummaryReply;
use compactor::compaction::tokens::estimate_messages_tokens_rough;
use compactor::compaction::trigger::{Trigger, WindowSource};
use compactor::compaction::truncated::CUT_MARKER;
use compactor::compaction::view::is_summary;
use engine_support::*;
use serde_json::Value;

fn micro() -> Compressor {
    compressor_with("test-model", 40_960, |c| {
        c.threshold_percent = 0.75;
        c.protect_first_n = 1;
        c.protect_last_n = 2;
        c.strategy = Strategy::Micro;
    })
}

fn conversation(exchanges: usize) -> Vec<Value> {
    let mut v = vec![msg("system", "system prompt")];
    for i in 0..exchanges {
        v.push(msg("user", &format!("question {i}")));
        v.push(msg("assistant", &format!("answer {i} {}", "z".repeat(400))));
    }
    v
}

fn markers(msgs: &[Value]) -> Vec<&Value> {
    msgs.iter().filter(|m| is_summary(m)).collect()
}

fn pass(c: &mut Compressor, msgs: &[Value], s: &Stub) -> Vec<Value> {
    block_on(c.micro_compact(msgs, s)).messages
}

#[test]
fn absorbs_one_exchange_and_leaves_a_summary_marker() {
    let mut c = micro();
    let msgs = conversation(6);
    let out = pass(&mut c, &msgs, &Stub::ok("ROLLING SUMMARY"));
    assert!(msgs.iter().any(|m| content_str(m).contains("answer 0")));
    assert!(!out.iter().any(|m| content_str(m).contains("answer 0")));
    let mk = markers(&out);
    assert_eq!(mk.len(), 1);
    assert!(content_str(mk[0]).contains("ROLLING SUMMARY"));
    assert_eq!(mk[0]["role"], "user");
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
fn protected_head_and_tail_survive() {
    let mut c = micro();
    let msgs = conversation(6);
    let out = pass(&mut c, &msgs, &Stub::ok("ROLLING SUMMARY"));
    assert_eq!(out[0], msgs[0]);
    assert_eq!(out.last(), msgs.last());
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
fn short_conversation_is_untouched() {
    let mut c = micro();
    let msgs = vec![
        msg("system", "sys"),
        msg("user", "hi"),
        msg("assistant", "hello"),
    ];
    assert_eq!(pass(&mut c, &msgs, &Stub::ok("ROLLING SUMMARY")), msgs);
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

fn growing(n: usize) -> Stub {
    Stub::seq(
        (1..=n)
            .map(|k| {
                let words: Vec<String> = (0..k).map(|i| format!("ex{i}")).collect();
                Ok(SummaryReply::text(format!("SUMMARY {}", words.join(" "))))
            })
            .collect(),
    )
}

#[test]
fn repeated_compaction_shrinks_context_and_keeps_one_marker() {
    let mut c = micro();
    let s = growing(6);
    let mut msgs = conversation(12);
    let before = estimate_messages_tokens_rough(&msgs);
    for _ in 0..6 {
        msgs = pass(&mut c, &msgs, &s);
    }
    assert_eq!(markers(&msgs).len(), 1);
    assert!(estimate_messages_tokens_rough(&msgs) < before);
}

#[test]
fn emits_content_free_token_telemetry() {
    let mut c = micro();
    let msgs = conversation(8);
    let res = block_on(c.micro_compact(&msgs, &Stub::ok("ROLLING SUMMARY")));
    let t = res
        .micro
        .as_ref()
        .and_then(|m| m.telemetry.clone())
        .expect("one telemetry record per pass");
    assert_eq!(t.event, "micro_compaction");
    assert_eq!(t.outcome, "absorbed");
    assert_eq!(t.tokens_saved_total, -t.tokens_delta);
    assert_eq!(t.passes_total, 1);
    assert_eq!(t.messages_after, res.messages.len());
    assert!(t.exchange_tokens > 0);
    let blob = serde_json::to_string(&t).unwrap();
    assert!(!blob.contains("answer 0") && !blob.contains("question 0"));
}

#[test]
fn telemetry_reports_occupancy_without_forcing_resolution() {
    let mut c = micro();
    c.trigger.set_threshold_tokens(10_000);
    let res = block_on(c.micro_compact(&conversation(8), &Stub::ok("ROLLING SUMMARY")));
    let t = res.micro.and_then(|m| m.telemetry).unwrap();
    assert_eq!(t.threshold_tokens, Some(10_000));
    let expected = t.tokens_after as f64 / 10_000.0 * 100.0;
    assert!((t.occupancy_pct.unwrap() - expected).abs() <= 0.1);
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
fn first_pass_costs_marker_overhead_then_pays_it_back() {
    let mut c = micro();
    let s = Stub::ok("ROLLING SUMMARY");
    let mut msgs = conversation(10);
    let start = estimate_messages_tokens_rough(&msgs);
    msgs = pass(&mut c, &msgs, &s);
    let after_first = estimate_messages_tokens_rough(&msgs);
    for _ in 0..5 {
        msgs = pass(&mut c, &msgs, &s);
    }
    let after_many = estimate_messages_tokens_rough(&msgs);
    assert!(after_first > start, "expected one-time marker overhead");
    assert!(after_many < after_first, "later passes must recover it");
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

#[test]
fn micro_call_uses_capped_max_tokens_and_low_temperature() {
    let mut c = micro();
    let s = Stub::ok("ROLLING SUMMARY");
    pass(&mut c, &conversation(6), &s);
    let req = s.last_request();
    // min(1500, max_summary_tokens(40,960) = 2,048)
    assert_eq!(req.max_tokens, Some(1_500));
    assert_eq!(req.temperature, Some(0.1));
}

fn cut_reply(text: &str) -> SummaryReply {
    SummaryReply {
        content: Some(Value::String(text.into())),
        finish_reason: Some("length".into()),
        refusal: None,
        reasoning: None,
    }
}

const CUT: &str = "- build_id: B7-1234\n- tag: REL-42\n- half a li";

fn marker_text(msgs: &[Value]) -> String {
    markers(msgs)
        .first()
        .map(|m| content_str(m))
        .unwrap_or_default()
}

#[test]
fn a_cut_exchange_summary_is_retried_once_with_a_firmer_length() {
    let mut c = micro();
    let s = Stub::seq(vec![
        Ok(cut_reply(CUT)),
        Ok(SummaryReply::text("- build_id: B7-1234\n- tag: REL-42")),
    ]);
    let r = block_on(c.micro_compact(&conversation(6), &s));
    assert_eq!(r.micro.unwrap().outcome, MicroOutcome::Absorbed);
    assert_eq!(s.calls(), 2, "one retry");
    let retry = s.request(1);
    assert!(retry.prompt.starts_with(&s.request(0).prompt));
    assert!(retry.prompt.contains("cut off at the reply limit"));
    assert_eq!(retry.max_tokens, s.request(0).max_tokens, "same cap");
    let text = marker_text(&r.messages);
    assert!(
        text.contains("tag: REL-42") && !text.contains(CUT_MARKER),
        "{text}"
    );
}

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
fn without_room_for_the_firmer_prompt_the_cut_exchange_summary_is_kept_without_retry() {
    let probe = Stub::ok("x");
    pass(&mut micro(), &conversation(6), &probe);
    let len = probe.request(0).prompt.chars().count();
    let mut c = micro();
    let s = Stub::reply(cut_reply(CUT)).with_budget(len + 10);
    let r = block_on(c.micro_compact(&conversation(6), &s));
    assert_eq!(s.calls(), 1, "no room for the retry");
    assert!(marker_text(&r.messages).contains(CUT_MARKER));
}

#[test]
fn a_cut_exchange_summary_with_no_complete_line_is_a_failure() {
    let mut c = micro();
    let msgs = conversation(6);
    let s = Stub::reply(cut_reply("- half a li"));
    let r = block_on(c.micro_compact(&msgs, &s));
    assert_eq!(r.micro.unwrap().outcome, MicroOutcome::SummarizeFailed);
    assert_eq!(r.messages, msgs);
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
        compactor::compaction::compressor::CompressOptions {
            force: true,
            ..Default::default()
        },
    ));
    assert!(s.calls() >= 1, "{:?}", r.outcome);
    let prompt = s.request(0).prompt;
    assert!(prompt.contains("B-11"), "the batch summary");
    assert!(prompt.contains("M-77"), "the micro rolling summary");
}
