//! Fewer, cheaper summary calls, and what the user said survives:
//! - a summary rejected as not smaller is not asked again for the same
//!   rows, and a pass that must fit falls through to the last resort;
//! - a summariser whose model never keeps to the firmer length instruction
//!   gets no such retries;
//! - a small summariser gets the lean prompt, and one call while every
//!   message keeps a useful excerpt;
//! - a fixed part (instructions, tools) moves the trigger and sizes what a
//!   compaction leaves;
//! - the user's own messages are kept verbatim beside the summary, across
//!   compactions.
#![allow(clippy::unwrap_used, clippy::expect_used)]

// Test code: a failed unwrap is a failed test (the helpers too).

mod engine_support;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use compactor::compaction::{
    estimate_messages_tokens_rough, CompressOptions, Fit, Outcome, Summariser, SummaryError,
    SummaryReply, SummaryRequest,
};
use engine_support::*;
use serde_json::{json, Value};

fn agent(rounds: usize, out_chars: usize) -> Vec<Value> {
    let mut m = vec![msg("system", "You are an agent.")];
    for i in 0..rounds {
        m.extend(read_round(i, out_chars));
    }
    m.push(msg("user", "what next?"));
    m
}

/// A summary longer than the rows it replaces is rejected; the same rows
/// are not summarised again on the retry, which goes to the last resort.
#[test]
fn a_summary_rejected_for_the_same_rows_is_not_asked_again() {
    let mut c = compressor_with("m", 8_192, |c| c.protect_first_n = 0);
    // A system prompt near the trigger and short rows: any summary is
    // longer than the rows it would replace.
    let mut msgs = vec![msg("system", &"rule ".repeat(5_600))];
    msgs.extend(alternating(24, "r"));
    msgs.push(msg(
        "user",
        &format!("now read this log {}", "line\n".repeat(400)),
    ));
    let huge = "x ".repeat(20_000);
    let s = Stub::ok(&huge);
    let first = block_on(c.compress(&msgs, &s, CompressOptions::default()));
    assert_eq!(first.outcome(), Outcome::Rejected);
    let calls = s.calls();
    assert!(calls >= 1);
    // The overflow retry: same rows, forced, must fit. No summary call; the
    // last resort cuts instead.
    let rough = estimate_messages_tokens_rough(&msgs);
    let retry = block_on(c.compress(
        &msgs,
        &s,
        CompressOptions {
            force: true,
            bypass_cooldown: true,
            fit_tokens: Some(rough * 2 / 3),
            fit: Fit::Insist,
            ..CompressOptions::default()
        },
    ));
    assert_eq!(s.calls(), calls, "the rejected summary was asked again");
    assert_eq!(retry.outcome(), Outcome::Compacted, "no last resort");
    assert!(retry.tokens_after() < rough);
    // Other rows are summarised as usual.
    let mut more = msgs.clone();
    more.splice(1..1, alternating(6, "earlier "));
    let forced = CompressOptions {
        force: true,
        ..CompressOptions::default()
    };
    block_on(c.compress(&more, &s, forced));
    assert!(s.calls() > calls);
}

/// A window whose instructions fill most of it: the summary of the
/// earlier rounds is rejected (longer than they are) and shortening every
/// row to its floor still leaves the request over the window, so the pass
/// that must fit drops the oldest whole rounds instead of sending a request
/// it estimates over the window (refused by the upstream, then failed).
#[test]
fn a_pass_that_must_fit_drops_the_oldest_rounds_when_shortening_is_not_enough() {
    let mut c = compressor_with("m", 2_048, |c| c.protect_first_n = 0);
    let mut msgs = vec![msg("system", &"rule ".repeat(1_200))];
    for i in 0..6 {
        msgs.extend(read_round(i, 120));
    }
    msgs.push(msg("user", "step 9: read file_9.rs"));
    let s = Stub::ok(&"x ".repeat(20_000));
    let first = block_on(c.compress(&msgs, &s, CompressOptions::default()));
    assert_eq!(first.outcome(), Outcome::Rejected, "the summary is longer");
    // Every row is under the last resort's floor: only dropping can fit.
    let system = estimate_messages_tokens_rough(&msgs[..1]);
    let fit = system + 120;
    let r = block_on(c.compress(
        &msgs,
        &s,
        CompressOptions {
            force: true,
            bypass_cooldown: true,
            fit_tokens: Some(fit),
            ..CompressOptions::default()
        },
    ));
    assert_eq!(r.outcome(), Outcome::Compacted, "left over the window");
    assert!(r.tokens_after() <= fit, "{} > {fit}", r.tokens_after());
    assert!(
        r.telemetry().last_resort_dropped() >= 4,
        "{:?}",
        r.telemetry()
    );
    assert_eq!(r.telemetry().last_resort_dropped() % 4, 0, "whole rounds");
    assert_eq!(r.messages()[0], msgs[0], "instructions kept");
    assert_eq!(r.messages().last(), msgs.last(), "the newest ask kept");
    assert_eq!(
        r.messages()[1],
        msgs[1 + r.telemetry().last_resort_dropped()],
        "oldest first"
    );
    for (i, m) in r.messages().iter().enumerate() {
        if let Some(id) = m.get("tool_call_id") {
            assert_eq!(r.messages()[i - 1]["tool_calls"][0]["id"], *id, "pairing");
        }
    }
}

/// A summariser that replies cut at the cap and says whether firmer
/// retries are still worth it.
struct Cut {
    useful: AtomicBool,
    calls: AtomicUsize,
    noted: AtomicUsize,
}

#[async_trait::async_trait]
impl Summariser for Cut {
    async fn summarise(&self, _req: SummaryRequest) -> Result<SummaryReply, SummaryError> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        Ok(SummaryReply {
            content: Some(json!("## Historical Task Snapshot\nread the files\n## Completed Actions\n1. read file_0.rs\n2. rea")),
            finish_reason: Some("length".into()),
            refusal: None,
            reasoning: None,
        })
    }
    fn prompt_budget_chars(&self) -> usize {
        100_000
    }
    fn firm_retry_useful(&self) -> bool {
        self.useful.load(Ordering::SeqCst)
    }
    fn note_firm_retry(&self, within_cap: bool) {
        assert!(!within_cap);
        self.noted.fetch_add(1, Ordering::SeqCst);
    }
}

#[test]
fn no_firmer_retry_for_a_model_that_never_keeps_to_it() {
    for useful in [true, false] {
        let mut c = compressor_with("m", 8_192, |c| c.protect_first_n = 0);
        let s = Cut {
            useful: AtomicBool::new(useful),
            calls: AtomicUsize::new(0),
            noted: AtomicUsize::new(0),
        };
        let r = block_on(c.compress(&agent(8, 400), &s, CompressOptions::default()));
        assert_eq!(r.outcome(), Outcome::Compacted);
        let (calls, noted) = (s.calls.into_inner(), s.noted.into_inner());
        if useful {
            assert_eq!((calls, noted), (2, 1), "one call and one firmer retry");
        } else {
            assert_eq!((calls, noted), (1, 0), "the cut summary is kept");
        }
    }
}

/// At a 2k window the full prompt's scaffolding (~4,000 chars) left ~900
/// chars of a 4,908-char budget for the turns: six calls for one
/// compaction. The lean prompt and excerpts of long outputs make it one.
#[test]
fn a_small_summariser_gets_the_lean_prompt_and_one_call() {
    let mut c = compressor_with("m", 2_048, |c| c.protect_first_n = 0);
    let msgs = agent(6, 1_600);
    let s = Stub::ok(
        "## Historical Task Snapshot\nwhat next?\n## Completed Actions\n1. read the files",
    )
    .with_budget(4_908);
    let r = block_on(c.compress(&msgs, &s, CompressOptions::default()));
    assert_eq!(r.outcome(), Outcome::Compacted);
    assert_eq!(s.calls(), 1, "one summary call");
    let p = s.request(0).prompt;
    assert!(p.chars().count() <= 4_908, "{} chars", p.chars().count());
    assert!(p.contains("## Active State") && !p.contains("## Governing User Outcome"));
    // Every summarised round is in the one prompt, long outputs excerpted.
    for i in 0..3 {
        assert!(
            p.contains(&format!("read file_{i}.rs")),
            "round {i} missing"
        );
    }
    // A large summariser keeps the full prompt.
    let mut big = compressor_with("m", 200_000, |c| c.protect_first_n = 0);
    let s = Stub::ok("summary");
    let mut long = agent(60, 4_000);
    long.push(msg("user", "and now?"));
    let r = block_on(big.compress(
        &long,
        &s,
        CompressOptions {
            force: true,
            ..Default::default()
        },
    ));
    assert_eq!(r.outcome(), Outcome::Compacted);
    assert!(s
        .last_request()
        .prompt
        .contains("## Governing User Outcome"));
}

/// With a fixed part of 75% of the window the trigger moves toward the
/// window, and the compaction leaves the history at most its target.
#[test]
fn a_large_fixed_part_moves_the_trigger_and_sizes_the_result() {
    let mut c = compressor_with("m", 8_192, |c| c.protect_first_n = 0);
    let classic = c.trigger_mut().threshold_tokens();
    let system = msg("system", &"rule. ".repeat(4_100));
    let fixed = estimate_messages_tokens_rough(std::slice::from_ref(&system));
    c.trigger_mut().set_fixed_tokens(fixed);
    let t = c.trigger_mut().threshold_tokens();
    assert!(t > classic, "{t} vs {classic}");
    let target = fixed + c.trigger_mut().history_target();
    assert!(target < t);
    let mut msgs = vec![system];
    msgs.extend(agent(12, 400).into_iter().skip(1));
    let s = Stub::ok(
        "## Historical Task Snapshot\nwhat next?\n## Completed Actions\n1. read the files",
    );
    let r = block_on(c.compress(&msgs, &s, CompressOptions::default()));
    assert_eq!(r.outcome(), Outcome::Compacted);
    assert_eq!(r.messages()[0], msgs[0], "instructions kept");
    assert!(r.tokens_after() < t, "{} >= trigger {t}", r.tokens_after());
}
