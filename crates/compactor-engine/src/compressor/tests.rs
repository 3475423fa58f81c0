//! The compressor's white-box tests: the ported pipeline tests that call
//! one of its steps (`generate_summary`, the head size) or set and read the
//! state it keeps between passes (the running summary, the summary model,
//! the standing failure, the trigger's counters), as the reference does with
//! its private attributes (tests/REFERENCE_PARITY.md maps them).

use std::time::Duration;

use serde_json::{json, Value};

use super::summary_call::SummaryAttempt;
use super::*;
use crate::assemble::NO_USER_TURN_MARKER;
use crate::markers::{HISTORICAL_TASK_HEADING, SUMMARY_PREFIX};
use crate::summariser::SummaryReply;
use crate::test_support::*;

mod agent_loop;
mod budgets;

fn run_res(c: &mut Compressor, msgs: &[Value], s: &Stub) -> CompressResult {
    block_on(c.compress(msgs, s, CompressOptions::default()))
}

fn failure_kind(a: &SummaryAttempt) -> Option<SummaryFailureKind> {
    a.failure.as_ref().map(|f| f.kind)
}

fn aux_model(f: &Option<AuxModelFailure>) -> Option<&str> {
    f.as_ref().map(|f| f.model.as_str())
}

fn aux_error(f: &Option<AuxModelFailure>) -> Option<&str> {
    f.as_ref().map(|f| f.error.as_str())
}

// ---------------------------------------------------------------------------- TestCompress

#[test]
fn protect_first_n_decays_after_first_compression() {
    let mut c = compressor_with("test", 100_000, |c| c.protect_first_n = 3);
    let mut msgs = vec![msg("system", "sys")];
    msgs.extend(alternating(10, "m"));
    assert_eq!(c.trigger.compression_count, 0);
    assert_eq!(c.effective_protect_first_n(&msgs), 3);
    assert_eq!(c.protect_head_size(&msgs), 4);
    c.trigger.compression_count = 1;
    assert_eq!(c.effective_protect_first_n(&msgs), 0);
    assert_eq!(c.protect_head_size(&msgs), 1);
}

// ------------------------------------------------- TestGenerateSummaryNoneContent

#[test]
fn none_content_does_not_crash() {
    let mut c = compressor(3, 20);
    let turns = vec![
        msg("user", "do something"),
        json!({"role": "assistant", "content": null, "tool_calls": [{"function": {"name": "search"}}]}),
        json!({"role": "tool", "content": "result"}),
        json!({"role": "assistant", "content": null}),
        msg("user", "thanks"),
    ];
    let s = Stub::ok("[CONTEXT SUMMARY]: tool calls happened");
    let out = block_on(c.generate_summary(&s, &turns, None))
        .summary
        .unwrap();
    assert!(out.starts_with(SUMMARY_PREFIX));
    assert!(out.contains("tool calls happened"));
}

// ------------------------------------------------------- TestNonStringContent

fn do_something() -> Vec<Value> {
    vec![msg("user", "do something"), msg("assistant", "ok")]
}

#[test]
fn none_content_treated_as_failure_not_empty_summary() {
    let mut c = compressor(3, 20);
    let s = Stub::reply(null_content());
    let attempt = block_on(c.generate_summary(&s, &do_something(), None));
    assert!(attempt.summary.is_none());
    assert!(c.trigger.cooldown_remaining().is_some());
    assert_eq!(failure_kind(&attempt), Some(SummaryFailureKind::Empty));
}

#[test]
fn string_message_coerced_to_summary_content() {
    let mut c = compressor(3, 20);
    let s = Stub::ok("plain summary text");
    let out = block_on(c.generate_summary(&s, &do_something(), None))
        .summary
        .unwrap();
    assert!(
        out.starts_with(&format!("{SUMMARY_PREFIX}\n{HISTORICAL_TASK_HEADING}\n")),
        "{out}"
    );
    assert!(out.contains("do something"));
    assert!(out.ends_with("plain summary text"));
}

// --------------------------------------------------- TestSummaryFailureCooldown

#[test]
fn summary_failure_enters_cooldown_and_skips_retry() {
    let mut c = compressor(3, 20);
    let s = Stub::err(plain("boom"));
    let first = block_on(c.generate_summary(&s, &do_something(), None)).summary;
    let second = block_on(c.generate_summary(&s, &do_something(), None)).summary;
    assert!(first.is_none() && second.is_none());
    assert_eq!(s.calls(), 1);
}

// --------------------------------------------------------- TestAuthFailureAborts

fn auth_err(code: u16) -> crate::summariser::SummaryError {
    status(
        code,
        &format!("Error code: {code} - {{'status': 401, 'message': 'Your API key is invalid, blocked or out of funds.'}}"),
    )
}

#[test]
fn also_flags_auth_failure_403() {
    let mut c = compressor(3, 20);
    let s = Stub::err(auth_err(403));
    let attempt = block_on(c.generate_summary(&s, &alternating(10, "msg "), None));
    assert_eq!(failure_kind(&attempt), Some(SummaryFailureKind::Auth));
}

#[test]
fn generate_summary_flags_network_failure() {
    let mut c = compressor(3, 20);
    let s = Stub::err(connection());
    let attempt = block_on(c.generate_summary(&s, &alternating(10, "msg "), None));
    assert!(attempt.summary.is_none());
    assert_eq!(failure_kind(&attempt), Some(SummaryFailureKind::Network));
    assert_ne!(failure_kind(&attempt), Some(SummaryFailureKind::Auth));
}

// -------------------------------------------------- TestSummaryFallbackToMainModel

fn with_summary_model(main: &str, aux: &str) -> crate::compressor::Compressor {
    let aux = aux.to_string();
    compressor_with(main, 100_000, move |c| c.summary_model = Some(aux))
}

#[test]
fn model_not_found_404_falls_back_to_main_and_succeeds() {
    let mut c = with_summary_model("main-model", "broken-aux-model");
    let s = Stub::seq(vec![
        Err(status(404, "404 model_not_found: no such model")),
        Ok(SummaryReply::text("summary via main model")),
    ]);
    let attempt = block_on(c.generate_summary(&s, &do_something(), None));
    let out = attempt.summary.clone();
    assert_eq!(s.calls(), 2);
    assert_eq!(s.request(0).model.as_deref(), Some("broken-aux-model"));
    assert_eq!(s.request(1).model, None);
    assert!(out.unwrap().contains("summary via main model"));
    assert_eq!(
        aux_model(&attempt.aux_model_failure),
        Some("broken-aux-model")
    );
    assert!(aux_error(&attempt.aux_model_failure)
        .unwrap()
        .contains("404"));
}

#[test]
fn no_fallback_when_summary_model_equals_main_model() {
    let mut c = with_summary_model("main-model", "main-model");
    let s = Stub::err(plain("500 internal error"));
    let out = block_on(c.generate_summary(&s, &do_something(), None)).summary;
    assert_eq!(s.calls(), 1);
    assert!(out.is_none());
    assert!(!c.summary_model_fallen_back);
}

#[test]
fn json_decode_error_falls_back_to_main_and_succeeds() {
    let mut c = with_summary_model("main-model", "aux-via-broken-proxy");
    let s = Stub::seq(vec![
        Err(json_decode()),
        Ok(SummaryReply::text("summary via main model")),
    ]);
    let attempt = block_on(c.generate_summary(&s, &do_something(), None));
    let out = attempt.summary.clone();
    assert_eq!(s.calls(), 2);
    assert_eq!(s.request(0).model.as_deref(), Some("aux-via-broken-proxy"));
    assert_eq!(s.request(1).model, None);
    assert!(out.unwrap().contains("summary via main model"));
    assert_eq!(
        aux_model(&attempt.aux_model_failure),
        Some("aux-via-broken-proxy")
    );
    assert!(
        aux_error(&attempt.aux_model_failure)
            .unwrap()
            .chars()
            .count()
            <= 220
    );
}

// --------------------------------------------------- TestStreamingClosedFallback

#[test]
fn incomplete_chunked_read_falls_back_to_main() {
    let mut c = with_summary_model("main-model", "aux-stream-model");
    let s = Stub::seq(vec![
        Err(stream_closed(
            "RemoteProtocolError: incomplete chunked read",
        )),
        Ok(SummaryReply::text("summary via main model")),
    ]);
    let out = block_on(c.generate_summary(&s, &do_something(), None)).summary;
    assert_eq!(s.calls(), 2);
    assert_eq!(s.request(0).model.as_deref(), Some("aux-stream-model"));
    assert_eq!(s.request(1).model, None);
    assert!(out.unwrap().contains("summary via main model"));
}

#[tokio::test(start_paused = true)]
async fn streaming_closed_on_main_uses_short_cooldown() {
    let mut c = compressor_with("main-model", 100_000, |_| {});
    let s = Stub::err(stream_closed(
        "RemoteProtocolError: response ended prematurely",
    ));
    let out = c.generate_summary(&s, &do_something(), None).await.summary;
    assert!(out.is_none());
    // tokio's clock is paused: exactly the 30 s short cooldown remains.
    assert_eq!(
        c.trigger.cooldown_remaining(),
        Some(Duration::from_secs(30))
    );
}

// --------------------------------------------------- TestAuxModelFallbackSurfacedToCallers

#[test]
fn compress_clears_aux_failure_fields_at_start_of_next_call() {
    let mut c = compressor_with("main-model", 100_000, |c| {
        c.summary_model = Some("broken-aux-model".into());
        c.protect_first_n = 2;
        c.protect_last_n = 2;
    });
    let s = Stub::seq(vec![
        Err(status(400, "400 aux model busted")),
        Ok(SummaryReply::text("summary via main")),
    ]);
    let first = run_res(&mut c, &seven(), &s);
    assert_eq!(
        aux_model(&first.aux_model_failure),
        Some("broken-aux-model")
    );
    c.previous_summary = None;
    let next = run_res(&mut c, &seven(), &Stub::ok("summary via main"));
    assert_eq!(aux_model(&next.aux_model_failure), None);
    assert_eq!(aux_error(&next.aux_model_failure), None);
}

// --------------------------------------------------------- TestAbortOnSummaryFailure

fn abort_compressor() -> crate::compressor::Compressor {
    compressor_with("test", 100_000, |c| {
        c.protect_first_n = 2;
        c.protect_last_n = 2;
        c.abort_on_summary_failure = true;
    })
}

#[test]
fn aux_fallback_clears_persisted_session_cooldown_before_retry() {
    // Session DB → the trigger snapshot the proxy persists per conversation.
    let mut c = abort_compressor();
    c.trigger.set_failure_cooldown(999, "timeout");
    let persisted = c.trigger.snapshot();
    c.trigger.restore(persisted);
    assert!(c.trigger.cooldown_remaining().is_some());
    c.summary_model = Some("aux/model".into());
    c.fallback_to_main_for_compression();
    assert_eq!(c.summary_model, None);
    assert!(c.trigger.cooldown_remaining().is_none());
    assert!(c.trigger.snapshot().cooldown_until_unix_ms.is_none());
}

#[test]
fn success_clears_persisted_session_cooldown() {
    let mut c = abort_compressor();
    c.trigger.set_failure_cooldown(999, "timeout");
    let persisted = c.trigger.snapshot();
    c.trigger.restore(persisted);
    // A persisted cooldown outlives the restart; a bypassing
    // (provider-proven) call must still run and then clear it.
    let msgs = seven();
    let s = Stub::ok("summary text");
    let res = block_on(c.compress(
        &msgs,
        &s,
        CompressOptions {
            current_tokens: Some(999_999),
            bypass_cooldown: true,
            ..Default::default()
        },
    ));
    assert!(s.calls() >= 1);
    assert!(res.abort_reason().is_none());
    assert!(res.messages.len() < msgs.len());
    assert!(c.trigger.snapshot().cooldown_until_unix_ms.is_none());
}

// ------------------------------------------------------------------ TestSummaryTargetRatio

#[test]
fn protect_first_n_semantics_stable_without_system_prompt() {
    let c = compressor(0, 2);
    let msgs = alternating(10, "msg ");
    assert_eq!(c.protect_head_size(&msgs), 0);
    let c = compressor(3, 2);
    assert_eq!(c.protect_head_size(&msgs), 3);
}

// ------------------------------------------------------------ TestSummaryPromptBounding

#[test]
fn iterative_update_path_is_bounded() {
    use crate::serialize::SUMMARY_INPUT_MAX_CHARS as CAP;
    let mut c = compressor_with("test", 272_000, |_| {});
    c.previous_summary = Some(format!("PREV_HEAD {} PREV_TAIL", "p".repeat(CAP * 2)));
    let turns: Vec<Value> = (0..80)
        .map(|i| msg("user", &format!("turn-{i}-{}", "x".repeat(6000))))
        .collect();
    // One call must take the whole bounded prompt: the stub declares exactly
    // the bound the test asserts as its window.
    let s = Stub::ok("updated summary").with_budget(2 * CAP + 30_000);
    let summary = block_on(c.generate_summary(&s, &turns, None))
        .summary
        .unwrap();
    assert_eq!(s.calls(), 1);
    let prompt = s.last_request().prompt;
    assert!(summary.starts_with(SUMMARY_PREFIX));
    assert!(prompt.chars().count() < 2 * CAP + 30_000);
    assert!(prompt.contains("PREV_HEAD"));
    assert!(prompt.contains("PREV_TAIL"));
    assert!(prompt.contains("summary input truncated"));
    assert_eq!(
        s.last_request().max_tokens,
        None,
        "batch summaries never cap max_tokens"
    );
}

// -------------------------------------------------------- TestPreLlmFeasibilityCheck

fn pairs(n: usize, content: &str) -> Vec<Value> {
    let mut v = vec![msg("system", "system prompt")];
    for i in 0..n {
        v.push(msg("user", &format!("question {i}")));
        v.push(msg("assistant", content));
    }
    v
}

#[test]
fn skip_does_not_increment_strike_counter() {
    let mut c = fixture();
    c.trigger.ineffective_compression_count = 1;
    let s = Stub::ok("LLM summary");
    block_on(c.compress(&pairs(10, "short reply"), &s, CompressOptions::default()));
    assert_eq!(c.trigger.ineffective_compression_count, 1);
    assert!(c.trigger.prellm_skip_count >= 1);
    assert_eq!(s.calls(), 0);
}

#[test]
fn skip_does_not_trip_abort_on_stale_auth_failure() {
    let mut c = fixture();
    c.trigger.ineffective_compression_count = 1;
    c.terminal_failure = Some(SummaryFailureKind::Auth);
    let s = Stub::ok("LLM summary");
    let res = block_on(c.compress(&pairs(10, "short reply"), &s, CompressOptions::default()));
    assert_eq!(res.outcome, Outcome::Compacted);
    assert!(!res.messages.is_empty());
    assert_eq!(s.calls(), 0);
}

#[test]
fn skip_does_not_trip_abort_on_stale_network_failure() {
    let mut c = fixture();
    c.trigger.ineffective_compression_count = 1;
    c.terminal_failure = Some(SummaryFailureKind::Network);
    let s = Stub::ok("LLM summary");
    let res = block_on(c.compress(&pairs(10, "short reply"), &s, CompressOptions::default()));
    assert_eq!(res.outcome, Outcome::Compacted);
    assert!(!res.messages.is_empty());
    assert_eq!(s.calls(), 0);
}

#[test]
fn no_skip_when_force_true() {
    let mut c = fixture();
    c.trigger.ineffective_compression_count = 1;
    let s = Stub::ok("LLM summary");
    block_on(c.compress(
        &pairs(10, "short reply"),
        &s,
        CompressOptions {
            force: true,
            ..Default::default()
        },
    ));
    assert_eq!(s.calls(), 1);
    assert_eq!(c.trigger.prellm_skip_count, 0);
}

#[test]
fn no_skip_when_no_prior_strikes() {
    let mut c = fixture();
    c.trigger.ineffective_compression_count = 0;
    let s = Stub::ok("LLM summary");
    block_on(c.compress(&pairs(10, "short reply"), &s, CompressOptions::default()));
    assert_eq!(s.calls(), 1);
    assert_eq!(c.trigger.prellm_skip_count, 0);
}

#[test]
fn skip_fires_on_fat_tail_small_middle() {
    let mut c = fixture();
    c.trigger.ineffective_compression_count = 1;
    let mut msgs = vec![msg("system", "system prompt")];
    for i in 0..6 {
        msgs.push(msg("user", &format!("early question {i}")));
        msgs.push(msg("assistant", "brief answer"));
    }
    for i in 0..4 {
        msgs.push(msg("user", &format!("recent request {i}")));
        msgs.push(msg(
            "assistant",
            &format!("big result {}", "x".repeat(20_000)),
        ));
    }
    let s = Stub::ok("LLM summary");
    let res = block_on(c.compress(&msgs, &s, CompressOptions::default()));
    assert_eq!(s.calls(), 0);
    assert_eq!(c.trigger.prellm_skip_count, 1);
    assert!(res.feasibility_skip);
    assert!(res.messages.len() < msgs.len());
}

#[test]
fn boundary_accounting_skip_does_not_feed_fallback_streak() {
    let mut c = fixture();
    c.trigger.ineffective_compression_count = 1;
    let msgs = pairs(10, "short reply");
    for _ in 0..2 {
        let s = Stub::ok("LLM summary");
        let res = block_on(c.compress(&msgs, &s, CompressOptions::default()));
        assert_eq!(s.calls(), 0);
        assert!(res.made_progress());
        c.trigger.record_completed_compaction(
            res.fallback_used,
            res.feasibility_skip,
            res.tokens_after,
        );
        c.previous_summary = None;
        c.trigger.compression_count = 0;
    }
    assert_eq!(c.trigger.prellm_skip_count, 2);
    assert_eq!(c.trigger.fallback_streak, 0);
    assert!(!c.trigger.breaker_tripped());
}

#[test]
fn boundary_accounting_skip_does_not_reset_fallback_streak() {
    let mut c = fixture();
    c.trigger.record_completed_compaction(true, false, 0);
    assert_eq!(c.trigger.fallback_streak, 1);
    c.trigger.record_completed_compaction(true, true, 0);
    assert_eq!(c.trigger.fallback_streak, 1);
}

#[test]
fn real_fallback_still_feeds_streak() {
    let mut c = fixture();
    c.trigger.ineffective_compression_count = 1;
    let msgs = pairs(10, &"filler ".repeat(3000));
    let res = block_on(c.compress(&msgs, &Stub::err(plain("boom")), CompressOptions::default()));
    assert!(!res.feasibility_skip);
    assert!(res.fallback_used);
    c.trigger.record_completed_compaction(
        res.fallback_used,
        res.feasibility_skip,
        res.tokens_after,
    );
    assert_eq!(c.trigger.fallback_streak, 1);
}

// ---------------------------------------------------------------- behaviour beyond the reference
// (tests/engine_behaviour.rs has the rest: these read or set the state the
// compressor keeps between passes)

#[test]
fn insufficient_messages_is_a_structural_no_op_without_strike() {
    let mut c = compressor(3, 2);
    let msgs = alternating(6, "m");
    let res = block_on(c.compress(&msgs, &Stub::ok("s"), CompressOptions::default()));
    assert_eq!(res.outcome, Outcome::NoOp(NoOpReason::InsufficientMessages));
    assert_eq!(res.messages, msgs);
    assert_eq!(c.trigger.ineffective_compression_count, 0);
    assert!(c
        .trigger
        .block_reason()
        .is_some_and(|r| r.starts_with("structural_backoff")));
}

#[test]
fn summary_in_memory_without_handoff_on_the_wire_is_discarded() {
    let mut c = compressor(1, 2);
    c.previous_summary = Some("FOREIGN-SESSION-SUMMARY".into());
    let mut msgs = vec![msg("system", "sys")];
    msgs.extend(alternating(10, "m"));
    let s = Stub::ok("fresh");
    block_on(c.compress(&msgs, &s, CompressOptions::default()));
    assert!(!s.last_request().prompt.contains("FOREIGN-SESSION-SUMMARY"));
}

#[test]
fn abort_rolls_back_the_rehydrated_summary() {
    let mut c = compressor(0, 2);
    let mut msgs = vec![
        msg("system", "sys"),
        summary_msg("user", &format!("{SUMMARY_PREFIX}\nOLD")),
    ];
    for i in 0..8 {
        msgs.push(msg(
            if i % 2 == 0 { "assistant" } else { "user" },
            &format!("turn {i}"),
        ));
    }
    assert!(c.previous_summary.is_none());
    let res = block_on(c.compress(&msgs, &Stub::err(connection()), CompressOptions::default()));
    assert_eq!(
        res.outcome,
        Outcome::Aborted(crate::compressor::AbortReason::NetworkFailure)
    );
    assert_eq!(res.messages, msgs);
    assert!(
        c.previous_summary.is_none(),
        "an aborted attempt is a true no-op"
    );
}

#[test]
fn no_user_marker_is_added_once_and_never_counts_as_a_user() {
    let mut c = compressor(1, 2);
    let first = block_on(c.compress(
        &no_user_session(),
        &Stub::ok("Rotated."),
        CompressOptions::default(),
    ));
    let marker_rows = |m: &[Value]| {
        m.iter()
            .filter(|r| content_str(r).contains(NO_USER_TURN_MARKER))
            .count()
    };
    assert_eq!(marker_rows(&first.messages), 1);
    assert!(!first.messages.iter().any(view::is_real_user));
    let mut grown = first.messages.clone();
    for i in 20..28 {
        grown.extend(tool_round(&format!("c{i}"), 300));
        grown.push(msg("assistant", &format!("rotated host {i}")));
    }
    let second = block_on(c.compress(
        &grown,
        &Stub::ok("Rotated more."),
        CompressOptions {
            force: true,
            ..Default::default()
        },
    ));
    assert_eq!(second.outcome, Outcome::Compacted);
    assert_eq!(marker_rows(&second.messages), 1);
}
