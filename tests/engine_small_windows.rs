//! Our own tests (not ported): small windows (llama.cpp 2k–32k) and chunked
//! summarising when the middle does not fit the summariser's prompt budget.

// Test helpers panic on bad fixtures: that is a failed test, as in a #[test].
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod engine_support;

use compactor::compaction::compressor::{CompressOptions, Outcome};
use compactor::compaction::serialize::prompt_overhead_chars;
use compactor::compaction::summariser::SummaryReply;
use compactor::compaction::tokens::estimate_request_tokens_rough;
use compactor::compaction::trigger::{Trigger, WindowSource};
use engine_support::*;
use serde_json::{json, Value};
use std::sync::Arc;

/// A tool-using conversation of roughly `target_tokens` rough tokens.
fn conversation(target_tokens: u64) -> Vec<Value> {
    let mut v = vec![msg("system", "You are a coding assistant. Be brief.")];
    let mut i = 0;
    while estimate_request_tokens_rough(&v, None) < target_tokens {
        v.push(msg(
            "user",
            &format!("step {i}: please check file src/mod{i}.rs for problems"),
        ));
        v.push(json!({"role": "assistant", "content": null, "tool_calls": [{"id": format!("c{i}"), "type": "function",
            "function": {"name": "read_file", "arguments": format!("{{\"path\":\"src/mod{i}.rs\"}}")}}]}));
        v.push(json!({"role": "tool", "tool_call_id": format!("c{i}"), "content": format!("fn f{i}() {{ {} }}", "let x = 1; ".repeat(12))}));
        v.push(msg(
            "assistant",
            &format!("src/mod{i}.rs looks fine; nothing to change in f{i}."),
        ));
        i += 1;
    }
    v.push(msg("user", "now summarise what you found"));
    v
}

fn fits_after_compaction(window: u64) {
    let max_tokens = window / 8;
    let mut c = compressor_with("llama", window, |_| {});
    c.trigger = Trigger::new(
        c.cfg.clone(),
        "llama",
        WindowSource::Known(window),
        Some(max_tokens),
    );
    let threshold = c.trigger.threshold_tokens();
    assert!(
        threshold < window - max_tokens,
        "threshold {threshold} must leave room for the reply"
    );
    let msgs = conversation(threshold * 3 / 2);
    let before = estimate_request_tokens_rough(&msgs, None);
    assert!(before >= threshold);
    // A summariser on the same small window: its prompt budget is the usable
    // window in characters (≈ 3 chars per token to stay on the safe side).
    let budget = ((window - max_tokens) * 3) as usize;
    let s = Stub::ok(
        "## Historical Task Snapshot\nchecked files\n\n## Completed Actions\n1. READ src — fine",
    )
    .with_budget(budget);
    let res = block_on(c.compress(
        &msgs,
        &s,
        CompressOptions {
            force: true,
            ..Default::default()
        },
    ));
    assert_eq!(res.outcome, Outcome::Compacted, "window {window}");
    let after = estimate_request_tokens_rough(&res.messages, None);
    assert!(
        after + max_tokens <= window,
        "window {window}: {after} tokens + {max_tokens} reply do not fit"
    );
    assert!(
        after < threshold,
        "window {window}: compacted {after} not under threshold {threshold}"
    );
    let limit = budget;
    let reqs = s.requests.lock().unwrap().clone();
    assert!(!reqs.is_empty());
    for r in &reqs {
        assert!(
            r.prompt.chars().count() <= limit,
            "window {window}: prompt {} > {limit}",
            r.prompt.len()
        );
    }
    // The newest user ask is kept verbatim.
    assert_eq!(
        content_str(res.messages.last().unwrap()),
        "now summarise what you found"
    );
}

#[test]
fn compaction_fits_2048_window() {
    fits_after_compaction(2_048);
}

#[test]
fn compaction_fits_4096_window() {
    fits_after_compaction(4_096);
}

#[test]
fn compaction_fits_8192_window() {
    fits_after_compaction(8_192);
}

#[test]
fn compaction_fits_32768_window() {
    fits_after_compaction(32_768);
}

#[test]
fn long_middle_is_summarised_in_rolling_chunks_within_budget() {
    let mut c = compressor(1, 2);
    let mut msgs = vec![msg("system", "sys")];
    for i in 0..60 {
        msgs.push(msg("user", &format!("question {i} {}", "q".repeat(900))));
        msgs.push(msg("assistant", &format!("answer {i} {}", "a".repeat(900))));
    }
    let budget = prompt_overhead_chars(None, false) + 12_000;
    let s = Stub::seq(
        (0..40)
            .map(|k| Ok(SummaryReply::text(format!("RUNNING-{k}"))))
            .collect(),
    )
    .with_budget(budget);
    let res = block_on(c.compress(
        &msgs,
        &s,
        CompressOptions {
            force: true,
            ..Default::default()
        },
    ));
    assert_eq!(res.outcome, Outcome::Compacted);
    let reqs = s.requests.lock().unwrap().clone();
    assert!(reqs.len() > 1, "the middle must be chunked");
    assert!(reqs.len() <= 8, "chunking is bounded");
    for r in &reqs {
        assert!(
            r.prompt.chars().count() <= budget,
            "{} > {budget}",
            r.prompt.chars().count()
        );
        assert_eq!(r.max_tokens, None);
    }
    // Rolling: every later chunk updates the running summary of the previous one.
    for (k, r) in reqs.iter().enumerate().skip(1) {
        assert!(
            r.prompt.contains(&format!("RUNNING-{}", k - 1)),
            "chunk {k} lacks the running summary"
        );
    }
    let last = format!("RUNNING-{}", reqs.len() - 1);
    assert!(content_str(&res.messages[res.summary_index.unwrap()]).contains(&last));
}

#[test]
fn unchunked_when_middle_fits() {
    let mut c = compressor(1, 2);
    let s = Stub::ok("one summary");
    let msgs = alternating(12, "msg ");
    block_on(c.compress(
        &msgs,
        &s,
        CompressOptions {
            force: true,
            ..Default::default()
        },
    ));
    assert_eq!(s.calls(), 1);
}

#[test]
fn arc_config_is_shared() {
    // The trigger and the compressor read the same config.
    let c = compressor(1, 2);
    assert!(Arc::ptr_eq(&c.cfg, c.trigger.config()));
}

#[test]
fn large_previous_summary_is_bounded_to_the_summariser_budget() {
    let mut c = compressor(1, 2);
    c.previous_summary = Some(format!("PREV {}", "p".repeat(50_000)));
    let mut msgs = vec![
        msg("system", "sys"),
        summary_msg(
            "user",
            &format!("{}\nold", compactor::compaction::markers::SUMMARY_PREFIX),
        ),
    ];
    msgs.extend(alternating(12, "turn "));
    let budget = prompt_overhead_chars(None, false) + 6_000;
    let s = Stub::ok("sum").with_budget(budget);
    let res = block_on(c.compress(
        &msgs,
        &s,
        CompressOptions {
            force: true,
            ..Default::default()
        },
    ));
    assert_eq!(res.outcome, Outcome::Compacted);
    for r in s.requests.lock().unwrap().iter() {
        assert!(
            r.prompt.chars().count() <= budget,
            "{} > {budget}",
            r.prompt.chars().count()
        );
        assert!(r.prompt.contains("PREV"));
    }
}

#[test]
fn verbose_summariser_still_fits_a_2048_window() {
    let window = 2_048;
    let max_tokens = 256;
    let mut c = compressor_with("llama", window, |_| {});
    c.trigger = Trigger::new(
        c.cfg.clone(),
        "llama",
        WindowSource::Known(window),
        Some(max_tokens),
    );
    let threshold = c.trigger.threshold_tokens();
    let msgs = conversation(threshold * 3 / 2);
    // The model ignores "Target ~N tokens" and writes ~2,500 tokens.
    let s = Stub::ok(&format!(
        "## Historical Task Snapshot\nx\n\n## Completed Actions\n{}",
        "did a thing. ".repeat(800)
    ));
    let res = block_on(c.compress(
        &msgs,
        &s,
        CompressOptions {
            force: true,
            ..Default::default()
        },
    ));
    assert_eq!(res.outcome, Outcome::Compacted);
    let after = estimate_request_tokens_rough(&res.messages, None);
    assert!(
        after + max_tokens <= window,
        "{after} + {max_tokens} > {window}"
    );
}
