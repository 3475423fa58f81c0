//! Ported micro-compaction tests (tests/REFERENCE_PARITY.md maps them). The
//! summary call is the scripted [`Stub`] summariser; the strategy switch is
//! `Strategy::Micro`; summary metadata rows are rows classified as
//! summaries; telemetry lines are the returned `MicroTelemetry` record. The
//! tests that read or set the micro state are unit tests in the crate
//! (`crates/compactor-engine/src/compressor/micro/tests.rs`).

// Test helpers panic on bad fixtures: that is a failed test, as in a #[test].
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod engine_support;

use compactor::compaction::{
    estimate_messages_tokens_rough, Compressor, MicroOutcome, SummaryReply, CUT_MARKER,
};
use engine_support::*;
use serde_json::Value;

fn pass(c: &mut Compressor, msgs: &[Value], s: &Stub) -> Vec<Value> {
    block_on(c.micro_compact(msgs, s)).into_messages()
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
fn protected_head_and_tail_survive() {
    let mut c = micro();
    let msgs = conversation(6);
    let out = pass(&mut c, &msgs, &Stub::ok("ROLLING SUMMARY"));
    assert_eq!(out[0], msgs[0]);
    assert_eq!(out.last(), msgs.last());
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
        .micro_telemetry()
        .cloned()
        .expect("one telemetry record per pass");
    assert_eq!(t.event, "micro_compaction");
    assert_eq!(t.outcome, "absorbed");
    assert_eq!(t.tokens_saved_total, -t.tokens_delta);
    assert_eq!(t.passes_total, 1);
    assert_eq!(t.messages_after, res.messages().len());
    assert!(t.exchange_tokens > 0);
    let blob = serde_json::to_string(&t).unwrap();
    assert!(!blob.contains("answer 0") && !blob.contains("question 0"));
}

#[test]
fn telemetry_reports_occupancy_without_forcing_resolution() {
    let mut c = micro();
    c.trigger_mut().set_threshold_tokens(10_000);
    let res = block_on(c.micro_compact(&conversation(8), &Stub::ok("ROLLING SUMMARY")));
    let t = res.micro_telemetry().cloned().unwrap();
    assert_eq!(t.threshold_tokens, Some(10_000));
    let expected = t.tokens_after as f64 / 10_000.0 * 100.0;
    assert!((t.occupancy_pct.unwrap() - expected).abs() <= 0.1);
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
fn micro_call_uses_capped_max_tokens_and_low_temperature() {
    let mut c = micro();
    let s = Stub::ok("ROLLING SUMMARY");
    pass(&mut c, &conversation(6), &s);
    let req = s.last_request();
    // min(1500, max_summary_tokens(40,960) = 2,048)
    assert_eq!(req.max_tokens, Some(1_500));
    assert_eq!(req.temperature, Some(0.1));
}

const CUT: &str = "- build_id: B7-1234\n- tag: REL-42\n- half a li";

#[test]
fn a_cut_exchange_summary_is_retried_once_with_a_firmer_length() {
    let mut c = micro();
    let s = Stub::seq(vec![
        Ok(cut_reply(CUT)),
        Ok(SummaryReply::text("- build_id: B7-1234\n- tag: REL-42")),
    ]);
    let r = block_on(c.micro_compact(&conversation(6), &s));
    assert_eq!(r.micro_outcome().unwrap(), MicroOutcome::Absorbed);
    assert_eq!(s.calls(), 2, "one retry");
    let retry = s.request(1);
    assert!(retry.prompt.starts_with(&s.request(0).prompt));
    assert!(retry.prompt.contains("cut off at the reply limit"));
    assert_eq!(retry.max_tokens, s.request(0).max_tokens, "same cap");
    let text = marker_text(r.messages());
    assert!(
        text.contains("tag: REL-42") && !text.contains(CUT_MARKER),
        "{text}"
    );
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
    assert!(marker_text(r.messages()).contains(CUT_MARKER));
}

#[test]
fn a_cut_exchange_summary_with_no_complete_line_is_a_failure() {
    let mut c = micro();
    let msgs = conversation(6);
    let s = Stub::reply(cut_reply("- half a li"));
    let r = block_on(c.micro_compact(&msgs, &s));
    assert_eq!(r.micro_outcome().unwrap(), MicroOutcome::SummarizeFailed);
    assert_eq!(r.messages(), msgs);
}
