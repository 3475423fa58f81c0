//! Summary quality rules of the engine: cut summaries are kept (or retried
//! once with a firmer length), iterative summaries carry what earlier ones
//! recorded, and the last resort shortens messages when nothing is left to
//! compact.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod engine_support;

use std::sync::Mutex;

use compactor::compaction::{
    estimate_messages_tokens_rough, is_summary, CompressOptions, Fit, Outcome, Summariser,
    SummaryError, SummaryReply, SummaryRequest, CUT_MARKER,
};
use engine_support::*;
use serde_json::{json, Value};

const CUT: &str = "## Historical Task Snapshot\nfix the build\n\n## Critical Context\n- build_id: B7-1234\n- tag: REL-42\n- half a li";

fn summary_text(msgs: &[Value]) -> String {
    msgs.iter()
        .find(|m| is_summary(m))
        .map(content_str)
        .unwrap_or_default()
}

#[test]
fn a_cut_summary_is_retried_once_with_a_firmer_length() {
    let msgs = alternating(12, "m");
    let mut c = compressor(2, 2);
    let s = Stub::seq(vec![
        Ok(cut_reply(CUT)),
        Ok(SummaryReply::text(
            "## Historical Task Snapshot\nfix the build\n\n## Critical Context\n- build_id: B7-1234",
        )),
    ]);
    let res = block_on(c.compress(&msgs, &s, CompressOptions::default()));
    assert_eq!(res.outcome(), Outcome::Compacted);
    assert!(!res.fallback_used(), "a cut summary is not thrown away");
    assert_eq!(s.calls(), 2, "one retry");
    let retry = s.request(1).prompt;
    assert!(retry.starts_with(&s.request(0).prompt));
    assert!(
        retry.contains("cut off at the reply limit"),
        "firmer instruction"
    );
    let text = summary_text(res.messages());
    assert!(text.contains("build_id: B7-1234") && !text.contains(CUT_MARKER));
    assert!(res.summary_failure().is_none());
}

#[test]
fn a_cut_summary_is_kept_at_its_last_complete_line_when_the_retry_is_cut_too() {
    let msgs = alternating(12, "m");
    let mut c = compressor(2, 2);
    let s = Stub::reply(cut_reply(CUT));
    let res = block_on(c.compress(&msgs, &s, CompressOptions::default()));
    assert_eq!(res.outcome(), Outcome::Compacted);
    assert!(!res.fallback_used());
    assert_eq!(s.calls(), 2);
    let text = summary_text(res.messages());
    assert!(text.contains("- tag: REL-42"), "{text}");
    assert!(!text.contains("half a li"), "the partial line goes: {text}");
    assert!(text.contains(CUT_MARKER), "marked as cut: {text}");
}

#[test]
fn without_room_for_the_firmer_prompt_the_cut_summary_is_kept_without_retry() {
    let msgs = alternating(12, "m");
    let mut c = compressor(2, 2);
    // A prompt budget that holds the prompt but not the extra instruction.
    let probe = Stub::ok("x").with_budget(20_000);
    block_on(compressor(2, 2).compress(&msgs, &probe, CompressOptions::default()));
    let len = probe.request(0).prompt.chars().count();
    let s = Stub::reply(cut_reply(CUT)).with_budget(len + 10);
    let res = block_on(c.compress(&msgs, &s, CompressOptions::default()));
    assert_eq!(res.outcome(), Outcome::Compacted);
    assert!(!res.fallback_used());
    assert_eq!(s.calls(), 1, "no room for the retry");
    assert!(summary_text(res.messages()).contains(CUT_MARKER));
}

#[test]
fn abort_on_degraded_summary_still_treats_a_cut_summary_as_a_failure() {
    let msgs = alternating(12, "m");
    let mut c = compressor_with("test", 100_000, |cfg| {
        cfg.protect_first_n = 2;
        cfg.protect_last_n = 2;
        cfg.abort_on_degraded_summary = true;
    });
    let res = block_on(c.compress(
        &msgs,
        &Stub::reply(cut_reply(CUT)),
        CompressOptions::default(),
    ));
    assert!(
        matches!(res.outcome(), Outcome::Aborted(_)),
        "{:?}",
        res.outcome()
    );
}

/// A summariser that writes every `FACT-…` token of its prompt, one per
/// line, like a model that keeps what it is shown.
struct Copier {
    prompts: Mutex<Vec<String>>,
}

fn facts(text: &str) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for w in text.split(|c: char| !(c.is_ascii_alphanumeric() || c == '-')) {
        if w.starts_with("FACT-") && !out.iter().any(|f| f == w) {
            out.push(w.to_owned());
        }
    }
    out
}

#[async_trait::async_trait]
impl Summariser for Copier {
    async fn summarise(&self, req: SummaryRequest) -> Result<SummaryReply, SummaryError> {
        self.prompts.lock().unwrap().push(req.prompt.clone());
        let mut body =
            String::from("## Historical Task Snapshot\nwork on the repo\n\n## Critical Context\n");
        for f in facts(&req.prompt) {
            body.push_str(&format!("- value {f}\n"));
        }
        Ok(SummaryReply::text(body))
    }
}

#[test]
fn iterative_summaries_keep_what_earlier_ones_said() {
    let mut c = compressor_with("test", 8_192, |cfg| {
        cfg.protect_first_n = 1;
        cfg.protect_last_n = 2;
    });
    let s = Copier {
        prompts: Mutex::default(),
    };
    let mut conv = vec![msg("system", "sys"), msg("user", "start")];
    let mut planted = Vec::new();
    let mut summaries: Vec<String> = Vec::new();
    let mut calls_after: Vec<usize> = Vec::new();
    for round in 0..5 {
        for i in 0..6 {
            let f = format!("FACT-{round}{i}");
            conv.push(msg("assistant", &format!("noted {f} {}", "x".repeat(400))));
            conv.push(msg(
                "user",
                &format!("next {round}.{i} {}", "y".repeat(400)),
            ));
            planted.push(f);
        }
        let res = block_on(c.compress(
            &conv,
            &s,
            CompressOptions {
                force: true,
                ..Default::default()
            },
        ));
        assert_eq!(res.outcome(), Outcome::Compacted, "round {round}");
        summaries.push(summary_text(res.messages()));
        calls_after.push(s.prompts.lock().unwrap().len());
        conv = res.into_messages();
    }
    let prompts = s.prompts.lock().unwrap().clone();
    assert!(prompts.len() >= 5);
    // What summary N recorded reaches summary N+1's prompt.
    for (n, summary) in summaries.iter().enumerate().take(summaries.len() - 1) {
        // The first prompt of the next compaction.
        let next_prompt = &prompts[calls_after[n]];
        assert!(next_prompt.contains("PREVIOUS SUMMARY"), "{next_prompt}");
        for f in facts(summary) {
            assert!(
                next_prompt.contains(&f),
                "{f} of summary {n} missing from the next prompt"
            );
        }
    }
    // And, nothing being superseded, the output: every fact that left the
    // live conversation is in the last summary.
    let last = summaries.last().unwrap();
    let live: String = conv.iter().map(content_str).collect();
    for f in &planted {
        assert!(live.contains(f.as_str()), "{f} lost");
    }
    assert!(facts(last).len() >= planted.len() - 12, "{last}");
}

fn overflowing() -> Vec<Value> {
    vec![
        msg("system", &"S".repeat(4_000)),
        msg("user", "read the file"),
        json!({"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "read", "arguments": "{\"path\":\"a.rs\"}"}}]}),
        json!({"role": "tool", "tool_call_id": "c1", "content": format!("HEAD{}TAIL", "x".repeat(6_000))}),
    ]
}

#[test]
fn nothing_to_compact_shrinks_the_largest_message_as_a_last_resort() {
    let msgs = overflowing();
    let fit = estimate_messages_tokens_rough(&msgs) - 800;
    // Without a fit budget there is nothing to do.
    let mut c = compressor_with("test", 2_048, |_| {});
    let res = block_on(c.compress(&msgs, &Stub::ok("s"), CompressOptions::default()));
    assert!(
        matches!(res.outcome(), Outcome::NoOp(_)),
        "{:?}",
        res.outcome()
    );
    // With one, the tool output is cut in the middle.
    let mut c = compressor_with("test", 2_048, |_| {});
    let res = block_on(c.compress(
        &msgs,
        &Stub::ok("s"),
        CompressOptions {
            fit_tokens: Some(fit),
            ..Default::default()
        },
    ));
    assert_eq!(res.outcome(), Outcome::Compacted);
    assert!(res.tokens_after() <= fit);
    assert_eq!(res.telemetry().last_resort_rows(), 1);
    assert_eq!(res.messages()[0], msgs[0], "system prompt kept");
    assert_eq!(res.messages()[1], msgs[1], "the ask kept");
    let tool = content_str(&res.messages()[3]);
    assert!(tool.starts_with("HEAD") && tool.ends_with("TAIL") && tool.contains("chars cut"));
    assert_eq!(res.messages()[3]["tool_call_id"], "c1");
    // A budget below the system prompt cannot be met: nothing changes.
    let mut c = compressor_with("test", 2_048, |_| {});
    let res = block_on(c.compress(
        &msgs,
        &Stub::ok("s"),
        CompressOptions {
            fit_tokens: Some(100),
            ..Default::default()
        },
    ));
    assert_ne!(res.outcome(), Outcome::Compacted);
    assert_eq!(res.messages(), msgs);
}

#[test]
fn an_upstream_refusal_makes_the_last_resort_cut_even_an_out_of_reach_budget() {
    let msgs = overflowing();
    // The budget is below the system prompt: by the estimate nothing can
    // fit, but after the upstream refused the request the rows are cut as
    // far as they go and sent.
    let mut c = compressor_with("test", 2_048, |_| {});
    let res = block_on(c.compress(
        &msgs,
        &Stub::ok("s"),
        CompressOptions {
            fit_tokens: Some(100),
            fit: Fit::Insist,
            ..Default::default()
        },
    ));
    assert_eq!(res.outcome(), Outcome::Compacted);
    assert_eq!(res.telemetry().last_resort_rows(), 1, "the tool output");
    assert_eq!(res.messages()[0], msgs[0], "system prompt kept");
    assert_eq!(res.messages()[1], msgs[1], "the short ask kept");
    let tool = content_str(&res.messages()[3]);
    assert!(tool.starts_with("HEAD") && tool.ends_with("TAIL") && tool.contains("chars cut"));
    assert!(
        tool.chars().count() < 400,
        "cut to the floor: {} chars",
        tool.chars().count()
    );
    assert!(res.tokens_after() < res.tokens_before());
}
