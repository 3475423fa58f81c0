//! Ported compress-pipeline tests (tests/REFERENCE_PARITY.md maps them). The
//! patched LLM call is the scripted [`Stub`] summariser; summary metadata is
//! `CompressResult::summary_index`; per-call figures are read from the
//! returned `CompressResult`. The tests that call one of the compressor's
//! steps or set its private state are unit tests in the crate
//! (`crates/compactor-engine/src/compressor/tests.rs` and the leaf modules' `tests.rs`).

// Test helpers panic on bad fixtures: that is a failed test, as in a #[test].
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod engine_support;

use compactor::compaction::{
    AbortReason, AuxModelFailure, CompressOptions, CompressResult, Compressor, Outcome,
    SummaryFailureKind, SummaryReply, END_MARKER, SUMMARY_PREFIX,
};
use engine_support::*;
use serde_json::{json, Value};

fn run(c: &mut Compressor, msgs: &[Value], s: &Stub) -> Vec<Value> {
    block_on(c.compress(msgs, s, CompressOptions::default())).into_messages()
}

fn run_res(c: &mut Compressor, msgs: &[Value], s: &Stub) -> CompressResult {
    block_on(c.compress(msgs, s, CompressOptions::default()))
}

fn run_forced_res(c: &mut Compressor, msgs: &[Value], s: &Stub) -> CompressResult {
    block_on(c.compress(
        msgs,
        s,
        CompressOptions {
            force: true,
            current_tokens: Some(999_999),
            ..Default::default()
        },
    ))
}

fn res_failure_kind(r: &CompressResult) -> Option<SummaryFailureKind> {
    r.summary_failure().map(|f| f.kind())
}

fn aux_model(f: Option<&AuxModelFailure>) -> Option<&str> {
    f.map(|f| f.model())
}

fn aux_error(f: Option<&AuxModelFailure>) -> Option<&str> {
    f.map(|f| f.error())
}

// ---------------------------------------------------------------------------- TestCompress

fn persisted_msgs() -> Vec<Value> {
    (0..10)
        .map(|i| {
            json!({"role": if i % 2 == 0 {"user"} else {"assistant"}, "content": format!("m{i}"), "_db_persisted": true})
        })
        .collect()
}

#[test]
fn compress_strips_db_persisted_from_assembled_messages() {
    let mut c = fixture();
    let msgs = persisted_msgs();
    let out = run(&mut c, &msgs, &Stub::err(no_provider()));
    assert!(out.len() < msgs.len());
    assert!(out.iter().all(|m| m.get("_db_persisted").is_none()));
}

#[test]
fn compress_terminal_sweep_strips_markers_even_if_a_copy_site_leaks() {
    // Rust has no per-site copy helper to neuter; the invariant is that the
    // terminal sweep strips the marker from every row, including the merged
    // carrier and every verbatim tail row.
    let mut c = fixture();
    let mut msgs = persisted_msgs();
    msgs.insert(
        0,
        json!({"role": "system", "content": "s", "_db_persisted": true}),
    );
    let res = block_on(c.compress(&msgs, &Stub::err(no_provider()), CompressOptions::default()));
    assert_eq!(res.outcome(), Outcome::Compacted);
    assert!(res.messages().len() < msgs.len());
    assert!(res
        .messages()
        .iter()
        .all(|m| m.get("_db_persisted").is_none()));
}

// ---------------------------------------------------------- TestGenerateSummaryNoneContent

#[test]
fn none_content_in_system_message_compress() {
    let mut c = compressor(2, 2);
    let mut msgs = vec![json!({"role": "system", "content": null})];
    msgs.extend(alternating(10, "msg "));
    let out = run(&mut c, &msgs, &Stub::err(no_provider()));
    assert!(out.len() < msgs.len());
}

const MISSING_KEY: &str = "Provider 'opencode-zen' is set in config.yaml but no API key was found. Set the OPENCODE-ZEN_API_KEY environment variable, or switch to a different provider with hermes model.";

// ------------------------------------------------------------------- TestAuthFailureAborts

#[test]
fn out_of_extra_usage_400_aborts_instead_of_dropping_context() {
    let mut c = compressor(2, 2);
    let msgs = alternating(12, "msg ");
    let s = Stub::err(status(
        400,
        "Error code: 400 - {'error': {'message': 'out of extra usage'}}",
    ));
    let res = run_forced_res(&mut c, &msgs, &s);
    assert_eq!(res.messages(), msgs);
    assert_eq!(res_failure_kind(&res), Some(SummaryFailureKind::Auth));
    assert!(res.abort_reason().is_some());
    assert!(!res.fallback_used());
}

#[test]
fn missing_provider_api_key_preserves_original_messages() {
    let mut c = compressor(2, 2);
    let msgs = alternating(12, "msg ");
    let s = Stub::err(plain(MISSING_KEY));
    let res = block_on(c.compress(
        &msgs,
        &s,
        CompressOptions {
            force: true,
            current_tokens: Some(999_999),
            ..Default::default()
        },
    ));
    assert_eq!(res.messages(), msgs);
    assert_eq!(res.outcome(), Outcome::Aborted(AbortReason::AuthFailure));
    let err = res.summary_failure().unwrap().error().to_string();
    assert!(
        MISSING_KEY.starts_with(err.trim_end_matches("...")),
        "{err}"
    );
    assert_eq!(res_failure_kind(&res), Some(SummaryFailureKind::Auth));
    assert!(res.abort_reason().is_some());
    assert!(!res.fallback_used());
    assert_eq!(res.dropped_count(), 0);
}

#[test]
fn quota_402_with_retry_uses_existing_fallback() {
    let mut c = compressor(2, 2);
    let msgs = alternating(12, "msg ");
    let s = Stub::err(status(
        402,
        "quota exceeded, please retry after the window resets",
    ));
    let res = run_forced_res(&mut c, &msgs, &s);
    assert_ne!(res.messages(), msgs);
    assert_ne!(res_failure_kind(&res), Some(SummaryFailureKind::Auth));
    assert!(res.abort_reason().is_none());
    assert!(res.fallback_used());
}

// ------------------------------------------- TestAuxModelFallbackSurfacedToCallers

#[test]
fn compress_exposes_aux_failure_fields_after_successful_fallback() {
    let mut c = compressor_with("main-model", 100_000, |c| {
        c.summary_model = Some("broken-aux-model".into());
        c.protect_first_n = 2;
        c.protect_last_n = 2;
    });
    let s = Stub::seq(vec![
        Err(status(400, "400 provider rejected configured model")),
        Ok(SummaryReply::text("summary via main")),
    ]);
    let res = run_res(&mut c, &seven(), &s);
    let out = res.messages().to_vec();
    assert!(!res.fallback_used());
    assert_eq!(aux_model(res.aux_model_failure()), Some("broken-aux-model"));
    assert!(aux_error(res.aux_model_failure()).unwrap().contains("400"));
    assert!(out
        .iter()
        .any(|m| content_str(m).contains("summary via main")));
}

// -------------------------------------- TestSummaryFailureTrackingForGatewayWarning

#[test]
fn compress_records_fallback_and_dropped_count_on_summary_failure() {
    let mut c = compressor(2, 2);
    let res = run_res(&mut c, &seven(), &Stub::err(plain("404 model not found")));
    let out = res.messages().to_vec();
    assert!(res.fallback_used());
    assert!(res.dropped_count() > 0);
    assert!(res.summary_failure().is_some());
    assert!(res.abort_reason().is_none());
    assert!(out
        .iter()
        .any(|m| content_str(m).contains("Summary generation was unavailable")));
}

#[test]
fn summary_failure_fallback_preserves_tool_paths_and_redacts_secret_context() {
    let mut c = compressor(1, 1);
    let secret = format!("ghp_{}", "a".repeat(36));
    let msgs = vec![
        msg("system", "sys"),
        msg(
            "user",
            &format!("Fix /tmp/project/app.py and never leak {secret}"),
        ),
        json!({"role": "assistant", "content": "I will inspect it.", "tool_calls": [
            {"id": "call-1", "function": {"name": "read_file", "arguments": "{\"path\":\"/tmp/project/app.py\"}"}}]}),
        json!({"role": "tool", "tool_call_id": "call-1", "content": format!("read /tmp/project/app.py with token {secret}")}),
        msg("assistant", "Found the bug in /tmp/project/app.py"),
        msg("user", "Patch it after this"),
        msg("assistant", "Ready to patch"),
        msg("user", "current live request should stay in tail"),
    ];
    let out = run(&mut c, &msgs, &Stub::err(plain("timeout")));
    let fallback = out
        .iter()
        .map(content_str)
        .find(|t| t.contains("Summary generation was unavailable"))
        .expect("fallback summary present");
    assert!(fallback.contains("Called tool(s): read_file"), "{fallback}");
    assert!(fallback.contains("/tmp/project/app.py"));
    assert!(!fallback.contains(&secret));
    assert!(!fallback.contains("ghp_"));
}

// --------------------------------------------------------- TestAbortOnSummaryFailure

fn abort_compressor() -> Compressor {
    compressor_with("test", 100_000, |c| {
        c.protect_first_n = 2;
        c.protect_last_n = 2;
        c.abort_on_summary_failure = true;
    })
}

#[test]
fn compress_aborts_and_preserves_messages_on_summary_failure() {
    let mut c = abort_compressor();
    let msgs = seven();
    let res = run_res(&mut c, &msgs, &Stub::err(plain("404 model not found")));
    let out = res.messages().to_vec();
    assert!(res.abort_reason().is_some());
    assert!(res.summary_failure().is_some());
    assert!(!res.fallback_used());
    assert_eq!(res.dropped_count(), 0);
    assert_eq!(out, msgs);
    assert!(!out
        .iter()
        .any(|m| content_str(m).contains("Summary generation was unavailable")));
}

// ------------------------------------------------------------------ TestCompressWithClient

fn summary_row(out: &[Value]) -> &Value {
    out.iter()
        .find(|m| content_str(m).starts_with(SUMMARY_PREFIX))
        .expect("a row starting with the summary prefix")
}

#[test]
fn user_role_summary_carries_end_marker() {
    let mut c = compressor(2, 2);
    let msgs = alternating(8, "msg ");
    let out = run(&mut c, &msgs, &Stub::ok("summary text"));
    let s = summary_row(&out);
    assert_eq!(s["role"], "user");
    let t = content_str(s);
    assert!(t.contains("END OF CONTEXT SUMMARY"));
    assert!(t
        .trim_end()
        .ends_with("respond to the message below, not the summary above ---"));
}

#[test]
fn assistant_role_summary_carries_end_marker() {
    let mut c = compressor(2, 2);
    let msgs = vec![
        msg("system", "system prompt"),
        msg("user", "msg 1"),
        msg("user", "msg 2"),
        msg("assistant", "msg 3"),
        msg("user", "msg 4"),
        msg("user", "msg 5"),
        msg("assistant", "msg 6"),
        msg("user", "msg 7"),
    ];
    let out = run(
        &mut c,
        &msgs,
        &Stub::ok("[CONTEXT SUMMARY]: stuff happened"),
    );
    let s = summary_row(&out);
    assert_eq!(s["role"], "assistant");
    let t = content_str(s);
    assert!(t.contains("END OF CONTEXT SUMMARY"));
    assert!(t
        .trim_end()
        .ends_with("respond to the message below, not the summary above ---"));
}

#[test]
fn summary_role_avoids_consecutive_user_messages() {
    let mut c = compressor(2, 2);
    let out = run(
        &mut c,
        &alternating(8, "msg "),
        &Stub::ok("[CONTEXT SUMMARY]: stuff happened"),
    );
    let rows: Vec<&Value> = out
        .iter()
        .filter(|m| content_str(m).starts_with(SUMMARY_PREFIX))
        .collect();
    assert_eq!(rows.len(), 1);
    assert_eq!(rows[0]["role"], "user");
}

fn nine_with_user_tail(sixth: Value) -> Vec<Value> {
    vec![
        msg("system", "system prompt"),
        msg("user", "msg 1"),
        msg("assistant", "msg 2"),
        msg("user", "msg 3"),
        msg("assistant", "msg 4"),
        msg("user", "msg 5"),
        sixth,
        msg("assistant", "msg 7"),
        msg("user", "msg 8"),
    ]
}

#[test]
fn double_collision_merges_summary_into_tail() {
    let mut c = compressor(2, 3);
    let msgs = nine_with_user_tail(msg("user", "msg 6"));
    let out = run(&mut c, &msgs, &Stub::ok("summary text"));
    for w in out.windows(2) {
        let (a, b) = (
            w[0]["role"].as_str().unwrap(),
            w[1]["role"].as_str().unwrap(),
        );
        if ["user", "assistant"].contains(&a) && ["user", "assistant"].contains(&b) {
            assert_ne!(a, b, "consecutive {a}");
        }
    }
    let first_tail: Vec<&Value> = out
        .iter()
        .filter(|m| content_str(m).contains("msg 6"))
        .collect();
    assert_eq!(first_tail.len(), 1);
    assert!(content_str(first_tail[0]).contains("summary text"));
}

#[test]
fn merge_into_tail_end_marker_is_last() {
    let mut c = compressor(2, 3);
    let msgs = nine_with_user_tail(
        json!({"role": "user", "content": [{"type": "text", "text": "PRESERVED_TAIL_CONTENT"}]}),
    );
    let res = block_on(c.compress(&msgs, &Stub::ok("SUMMARY_BODY"), CompressOptions::default()));
    let merged = &res.messages()[res.summary_index().unwrap()];
    let text = content_str(merged);
    let end = END_MARKER.trim();
    assert!(text.contains("PRESERVED_TAIL_CONTENT"));
    assert!(text.contains("SUMMARY_BODY"));
    assert!(text.contains(end));
    assert!(text.find("PRESERVED_TAIL_CONTENT") < text.find("SUMMARY_BODY"));
    assert!(text.find("SUMMARY_BODY") < text.find(end));
    assert!(text.trim_end().ends_with(end));
}

// ------------------------------------------------------------ TestSummaryTargetRatio

#[test]
fn protect_first_n_0_preserves_only_system_prompt() {
    let mut c = compressor(0, 2);
    let mut msgs = vec![msg("system", "System prompt")];
    msgs.extend(alternating(8, "msg "));
    let out = run(&mut c, &msgs, &Stub::err(no_provider()));
    assert_eq!(out[0]["role"], "system");
    assert!(content_str(&out[0]).starts_with("System prompt"));
    assert_ne!(content_str(&out[1]), "msg 0");
    assert_eq!(
        content_str(out.last().unwrap()),
        content_str(msgs.last().unwrap())
    );
}

// ---------------------------------------------------- TestTokenBudgetTailProtection

#[test]
fn small_conversation_still_compresses() {
    let mut c = compressor_with("test/model", 200_000, |c| {
        c.threshold_percent = 0.5;
        c.protect_first_n = 2;
        c.protect_last_n = 20;
    });
    let msgs = alternating(9, "Message ");
    let res = block_on(c.compress(
        &msgs,
        &Stub::ok("Summary of conversation"),
        CompressOptions {
            current_tokens: Some(90_000),
            ..Default::default()
        },
    ));
    assert!(res.messages().len() < msgs.len());
}

// ---------------------------------------------------------- TestCooldownReentryAbort

#[test]
fn network_failure_cooldown_reentry_still_aborts() {
    let mut c = compressor(2, 2);
    let msgs = alternating(12, "msg ");
    let first = run_forced_res(&mut c, &msgs, &Stub::err(connection()));
    assert_eq!(first.messages(), msgs);
    assert!(first.abort_reason().is_some());
    assert_eq!(res_failure_kind(&first), Some(SummaryFailureKind::Network));
    let s = Stub::ok("should not be called");
    let res = block_on(c.compress(
        &msgs,
        &s,
        CompressOptions {
            current_tokens: Some(999_999),
            ..Default::default()
        },
    ));
    assert_eq!(res.messages(), msgs);
    assert_eq!(s.calls(), 0, "the cooldown holds the retry");
    assert!(res.abort_reason().is_some());
    assert!(!res.fallback_used());
}

#[test]
fn auth_failure_cooldown_reentry_still_aborts() {
    let mut c = compressor(2, 2);
    let msgs = alternating(12, "msg ");
    let first = run_forced_res(
        &mut c,
        &msgs,
        &Stub::err(status(401, "Error code: 401 - invalid api key")),
    );
    assert_eq!(first.messages(), msgs);
    assert!(first.abort_reason().is_some());
    assert_eq!(res_failure_kind(&first), Some(SummaryFailureKind::Auth));
    let res = block_on(c.compress(
        &msgs,
        &Stub::ok("x"),
        CompressOptions {
            current_tokens: Some(999_999),
            ..Default::default()
        },
    ));
    assert_eq!(res.messages(), msgs);
    assert!(res.abort_reason().is_some());
    assert!(!res.fallback_used());
}

// --------------------------------------------------------- TestDoubleCompactionSummaryRole

#[test]
fn double_compaction_summary_must_be_user_when_only_system_protected() {
    let mut c = compressor(2, 2);
    restored(&mut c, 1, 0);
    let mut msgs = vec![msg("system", "You are a helpful assistant.")];
    for i in 1..=6 {
        msgs.push(msg(
            if i % 2 == 1 { "user" } else { "assistant" },
            &format!("msg {i}"),
        ));
    }
    let out = run(&mut c, &msgs, &Stub::ok("summary of earlier turns"));
    assert_eq!(out[0]["role"], "system");
    let non_system: Vec<&Value> = out.iter().filter(|m| m["role"] != "system").collect();
    assert!(!non_system.is_empty());
    assert_eq!(non_system[0]["role"], "user");
}

#[test]
fn restart_handoff_without_system_still_starts_with_user() {
    let mut c = compressor(3, 2);
    let msgs = vec![
        summary_msg("user", &format!("{SUMMARY_PREFIX}\nold persisted summary")),
        msg("assistant", "handoff acknowledged"),
        msg("user", "new work after restart"),
        msg("assistant", "new answer after restart"),
        msg("user", "more new work after restart"),
        msg("assistant", "more new answer after restart"),
        msg("user", "tail request"),
        msg("assistant", "tail answer"),
    ];
    let out = run(&mut c, &msgs, &Stub::ok("summary of resumed turns"));
    assert_eq!(out[0]["role"], "user");
    assert!(content_str(&out[0]).contains("summary of resumed turns"));
}

#[test]
fn double_compaction_user_tail_merges_into_tail() {
    let mut c = compressor(2, 2);
    restored(&mut c, 1, 0);
    let mut msgs = vec![msg("system", "You are a helpful assistant.")];
    for i in 1..=7 {
        msgs.push(msg(
            if i % 2 == 1 { "user" } else { "assistant" },
            &format!("msg {i}"),
        ));
    }
    let res = block_on(c.compress(
        &msgs,
        &Stub::ok("summary of earlier turns"),
        CompressOptions::default(),
    ));
    let out = &res.messages();
    let carrier = &out[res.summary_index().unwrap()];
    assert!(
        content_str(carrier).contains("msg 5"),
        "summary merged into the tail row"
    );
    let non_system: Vec<&Value> = out.iter().filter(|m| m["role"] != "system").collect();
    assert_eq!(non_system[0]["role"], "user");
    assert!(out
        .iter()
        .any(|m| content_str(m).contains("summary of earlier turns")));
}
