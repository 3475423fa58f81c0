//! Our own tests (not ported): small windows (llama.cpp 2k–32k) and chunked
//! summarising when the middle does not fit the summariser's prompt budget.
#![allow(clippy::unwrap_used, clippy::expect_used)]

// Test helpers panic on bad fixtures: that is a failed test, as in a #[test].

mod engine_support;

use compactor::compaction::{estimate_request_tokens_rough, CompressOptions, Outcome};
use engine_support::*;
use serde_json::{json, Value};

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
    let mut c = compressor_reserving("llama", window, max_tokens, |_| {});
    let threshold = c.trigger_mut().threshold_tokens();
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
    assert_eq!(res.outcome(), Outcome::Compacted, "window {window}");
    let after = estimate_request_tokens_rough(res.messages(), None);
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
        content_str(res.messages().last().unwrap()),
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
fn verbose_summariser_still_fits_a_2048_window() {
    let window = 2_048;
    let max_tokens = 256;
    let mut c = compressor_reserving("llama", window, max_tokens, |_| {});
    let threshold = c.trigger_mut().threshold_tokens();
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
    assert_eq!(res.outcome(), Outcome::Compacted);
    let after = estimate_request_tokens_rough(res.messages(), None);
    assert!(
        after + max_tokens <= window,
        "{after} + {max_tokens} > {window}"
    );
}

/// At 4,096 tokens the summary body is held to ~1,600 characters; the
/// quote of the user's newest compacted ask (here a pasted log) took all
/// of it, and the clip cut away everything the summariser wrote.
#[test]
fn a_pasted_ask_leaves_room_for_what_the_summariser_wrote() {
    let window = 4_096;
    let mut c = compressor_reserving("llama", window, 256, |_| {});
    let threshold = c.trigger_mut().threshold_tokens();
    let paste =
        "2026-12-07 10:00:01 deploy step passed, artefact uploaded to the bucket; ".repeat(30);
    let mut msgs = vec![msg("system", "You are a release assistant. Be brief.")];
    let mut i = 0;
    while estimate_request_tokens_rough(&msgs, None) < threshold * 3 / 2 {
        msgs.push(msg("user", &format!("run {i}: {paste}")));
        msgs.push(msg("assistant", &format!("Run {i} passed.")));
        i += 1;
    }
    msgs.push(msg("user", "which key did I give you?"));
    let done: String = (0..8)
        .map(|k| {
            format!("{k}. Checked run {k}'s deploy log: every step passed, artefact uploaded.\n")
        })
        .collect();
    let s = Stub::ok(&format!(
        "## Historical Task Snapshot\nx\n\n## Key Facts\nFACT: the deploy key is cobalt.\n\n## Completed Actions\n{done}"
    ));
    let res = block_on(c.compress(
        &msgs,
        &s,
        CompressOptions {
            force: true,
            ..Default::default()
        },
    ));
    assert_eq!(res.outcome(), Outcome::Compacted);
    let summary: String = res
        .messages()
        .iter()
        .map(content_str)
        .filter(|t| t.contains("Historical Task Snapshot"))
        .collect();
    assert!(summary.contains("deploy key is cobalt"), "{summary}");
    // The ask is still quoted, shorter.
    assert!(summary.contains("User asked"), "{summary}");
}
