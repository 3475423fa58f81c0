//! Ported compress-pipeline tests (tests/REFERENCE_PARITY.md maps them). The
//! patched LLM call is the scripted [`Stub`] summariser; summary metadata is
//! `CompressResult::summary_index`; per-call figures are read from the
//! returned `CompressResult` / `SummaryAttempt`.

// Test helpers panic on bad fixtures: that is a failed test, as in a #[test].
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod engine_support;

use compactor::compaction::compressor::{
    is_access_or_quota_error, AbortReason, AuxModelFailure, CompressOptions, CompressResult,
    Compressor, Outcome, SummaryAttempt, SummaryFailureKind,
};
use compactor::compaction::fallback::build_fallback_summary;
use compactor::compaction::markers::{END_MARKER, HISTORICAL_TASK_HEADING, SUMMARY_PREFIX};
use compactor::compaction::summariser::SummaryReply;
use engine_support::*;
use serde_json::{json, Value};
use std::time::Duration;

fn run(
    c: &mut compactor::compaction::compressor::Compressor,
    msgs: &[Value],
    s: &Stub,
) -> Vec<Value> {
    block_on(c.compress(msgs, s, CompressOptions::default())).messages
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

fn failure_kind(a: &SummaryAttempt) -> Option<SummaryFailureKind> {
    a.failure.as_ref().map(|f| f.kind)
}

fn res_failure_kind(r: &CompressResult) -> Option<SummaryFailureKind> {
    r.summary_failure.as_ref().map(|f| f.kind)
}

fn aux_model(f: &Option<AuxModelFailure>) -> Option<&str> {
    f.as_ref().map(|f| f.model.as_str())
}

fn aux_error(f: &Option<AuxModelFailure>) -> Option<&str> {
    f.as_ref().map(|f| f.error.as_str())
}

fn eight_with_system() -> Vec<Value> {
    let mut v = vec![msg("system", "sys")];
    for i in 1..=7 {
        v.push(msg(
            if i % 2 == 1 { "user" } else { "assistant" },
            &format!("msg {i}"),
        ));
    }
    v
}

// ---------------------------------------------------------------- TestCompress

#[test]
fn fallback_summary_does_not_triplicate_latest_user_ask() {
    let ask = "PLEASE_COMPUTE_THE_ARITHMETIC_CHAIN_XYZ";
    let turns = vec![msg("user", ask), msg("assistant", "working on it")];
    let summary = build_fallback_summary(&turns, None, "provider down");
    let line = format!("User asked: '{ask}'");
    assert!(summary.contains(ask));
    assert!(summary.matches(&line).count() <= 1, "{summary}");
}

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
    assert_eq!(res.outcome, Outcome::Compacted);
    assert!(res.messages.len() < msgs.len());
    assert!(res
        .messages
        .iter()
        .all(|m| m.get("_db_persisted").is_none()));
}

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

#[test]
fn none_content_in_system_message_compress() {
    let mut c = compressor(2, 2);
    let mut msgs = vec![json!({"role": "system", "content": null})];
    msgs.extend(alternating(10, "msg "));
    let out = run(&mut c, &msgs, &Stub::err(no_provider()));
    assert!(out.len() < msgs.len());
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

#[test]
fn task_snapshot_skips_synthetic_user_scaffolding() {
    use compactor::compaction::serialize::latest_user_task_snapshot;
    let msgs = vec![
        msg("user", "fix the login bug on prod"),
        msg("assistant", "on it"),
        json!({"role": "user", "content": "[Your active task list was preserved across context compression]\n- item", "_todo_snapshot_synthetic": true}),
    ];
    let snap = latest_user_task_snapshot(&msgs).unwrap();
    assert!(snap.contains("fix the login bug on prod"));
    assert!(!snap.contains("task list was preserved"));
    let only = vec![msg(
        "user",
        "[System: Your previous response was truncated ...]",
    )];
    assert!(latest_user_task_snapshot(&only).is_none());
}

#[test]
fn grounding_preserves_following_sections_across_regrounding() {
    use compactor::compaction::serialize::ground_task_snapshot;
    let summary = format!(
        "{HISTORICAL_TASK_HEADING}\nUser asked: stale example\n\n## Historical Remaining Work\n- keep me\n\n## Goal\nfinish"
    );
    let first = ground_task_snapshot(&summary, Some("real ask"));
    assert!(first.lines().any(|l| l == "## Historical Remaining Work"));
    assert!(first.contains("- keep me") && first.contains("## Goal"));
    let second = ground_task_snapshot(&first, Some("real ask"));
    assert!(second.contains("- keep me") && second.contains("## Goal"));
    assert_eq!(second.matches(HISTORICAL_TASK_HEADING).count(), 1);
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

fn auth_err(code: u16) -> compactor::compaction::summariser::SummaryError {
    status(
        code,
        &format!("Error code: {code} - {{'status': 401, 'message': 'Your API key is invalid, blocked or out of funds.'}}"),
    )
}

const MISSING_KEY: &str = "Provider 'opencode-zen' is set in config.yaml but no API key was found. Set the OPENCODE-ZEN_API_KEY environment variable, or switch to a different provider with hermes model.";

#[test]
fn missing_provider_api_key_is_terminal_access_failure() {
    assert!(is_access_or_quota_error(None, MISSING_KEY));
}

#[test]
fn out_of_extra_usage_400_aborts_instead_of_dropping_context() {
    let mut c = compressor(2, 2);
    let msgs = alternating(12, "msg ");
    let s = Stub::err(status(
        400,
        "Error code: 400 - {'error': {'message': 'out of extra usage'}}",
    ));
    let res = run_forced_res(&mut c, &msgs, &s);
    assert_eq!(res.messages, msgs);
    assert_eq!(res_failure_kind(&res), Some(SummaryFailureKind::Auth));
    assert!(res.abort_reason().is_some());
    assert!(!res.fallback_used);
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
    assert_eq!(res.messages, msgs);
    assert_eq!(res.outcome, Outcome::Aborted(AbortReason::AuthFailure));
    let err = res.summary_failure.clone().unwrap().error;
    assert!(
        MISSING_KEY.starts_with(err.trim_end_matches("...")),
        "{err}"
    );
    assert_eq!(res_failure_kind(&res), Some(SummaryFailureKind::Auth));
    assert!(res.abort_reason().is_some());
    assert!(!res.fallback_used);
    assert_eq!(res.dropped_count, 0);
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
    assert_ne!(res.messages, msgs);
    assert_ne!(res_failure_kind(&res), Some(SummaryFailureKind::Auth));
    assert!(res.abort_reason().is_none());
    assert!(res.fallback_used);
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

fn with_summary_model(main: &str, aux: &str) -> compactor::compaction::compressor::Compressor {
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

// ------------------------------------------- TestAuxModelFallbackSurfacedToCallers

fn seven() -> Vec<Value> {
    eight_with_system()
}

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
    let out = res.messages.clone();
    assert!(!res.fallback_used);
    assert_eq!(aux_model(&res.aux_model_failure), Some("broken-aux-model"));
    assert!(aux_error(&res.aux_model_failure).unwrap().contains("400"));
    assert!(out
        .iter()
        .any(|m| content_str(m).contains("summary via main")));
}

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

// -------------------------------------- TestSummaryFailureTrackingForGatewayWarning

#[test]
fn compress_records_fallback_and_dropped_count_on_summary_failure() {
    let mut c = compressor(2, 2);
    let res = run_res(&mut c, &seven(), &Stub::err(plain("404 model not found")));
    let out = res.messages.clone();
    assert!(res.fallback_used);
    assert!(res.dropped_count > 0);
    assert!(res.summary_failure.is_some());
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

fn abort_compressor() -> compactor::compaction::compressor::Compressor {
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
    let out = res.messages.clone();
    assert!(res.abort_reason().is_some());
    assert!(res.summary_failure.is_some());
    assert!(!res.fallback_used);
    assert_eq!(res.dropped_count, 0);
    assert_eq!(out, msgs);
    assert!(!out
        .iter()
        .any(|m| content_str(m).contains("Summary generation was unavailable")));
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

// ------------------------------------------------------------ TestCompressWithClient

#[test]
fn sanitizer_matches_responses_call_id_when_id_differs() {
    use compactor::compaction::sanitize::sanitize_tool_pairs;
    let msgs = vec![
        json!({"role": "assistant", "content": "", "tool_calls": [{"id": "fc_123", "call_id": "call_123",
            "response_item_id": "fc_123", "type": "function", "function": {"name": "search_files", "arguments": "{}"}}]}),
        json!({"role": "tool", "tool_call_id": "call_123", "content": "result"}),
    ];
    let out = sanitize_tool_pairs(msgs);
    let ids: Vec<&str> = out
        .iter()
        .filter(|m| m["role"] == "tool")
        .map(|m| m["tool_call_id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, vec!["call_123"]);
}

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
    let merged = &res.messages[res.summary_index.unwrap()];
    let text = content_str(merged);
    let end = END_MARKER.trim();
    assert!(text.contains("PRESERVED_TAIL_CONTENT"));
    assert!(text.contains("SUMMARY_BODY"));
    assert!(text.contains(end));
    assert!(text.find("PRESERVED_TAIL_CONTENT") < text.find("SUMMARY_BODY"));
    assert!(text.find("SUMMARY_BODY") < text.find(end));
    assert!(text.trim_end().ends_with(end));
}

#[test]
fn merged_tail_summary_still_detected_and_stripped() {
    use compactor::compaction::markers::{
        classify_handoff, summary_body, Handoff, MERGE_DELIMITER, PRIOR_HEADER,
    };
    let merged = format!(
        "{PRIOR_HEADER}\nold tail content here\n\n{MERGE_DELIMITER}\n\n{SUMMARY_PREFIX}\nTHE_SUMMARY_BODY\n\n{END_MARKER}"
    );
    assert!(!matches!(
        classify_handoff(&summary_msg("user", &merged)),
        Handoff::None
    ));
    assert_eq!(summary_body(&merged), "THE_SUMMARY_BODY");
    let standalone = format!("{SUMMARY_PREFIX}\nSTANDALONE_BODY\n\n{END_MARKER}");
    assert!(!matches!(
        classify_handoff(&summary_msg("user", &standalone)),
        Handoff::None
    ));
    assert_eq!(summary_body(&standalone), "STANDALONE_BODY");
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

#[test]
fn protect_first_n_semantics_stable_without_system_prompt() {
    let c = compressor(0, 2);
    let msgs = alternating(10, "msg ");
    assert_eq!(c.protect_head_size(&msgs), 0);
    let c = compressor(3, 2);
    assert_eq!(c.protect_head_size(&msgs), 3);
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
    assert!(res.messages.len() < msgs.len());
}

// ---------------------------------------------------------- TestCooldownReentryAbort

#[test]
fn network_failure_cooldown_reentry_still_aborts() {
    let mut c = compressor(2, 2);
    let msgs = alternating(12, "msg ");
    let first = run_forced_res(&mut c, &msgs, &Stub::err(connection()));
    assert_eq!(first.messages, msgs);
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
    assert_eq!(res.messages, msgs);
    assert_eq!(s.calls(), 0, "the cooldown holds the retry");
    assert!(res.abort_reason().is_some());
    assert!(!res.fallback_used);
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
    assert_eq!(first.messages, msgs);
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
    assert_eq!(res.messages, msgs);
    assert!(res.abort_reason().is_some());
    assert!(!res.fallback_used);
}

// --------------------------------------------------------- TestDoubleCompactionSummaryRole

#[test]
fn double_compaction_summary_must_be_user_when_only_system_protected() {
    let mut c = compressor(2, 2);
    c.trigger.compression_count = 1;
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
    c.trigger.compression_count = 1;
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
    let out = &res.messages;
    let carrier = &out[res.summary_index.unwrap()];
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

// ------------------------------------------------------------ TestSummaryPromptBounding

#[test]
fn iterative_update_path_is_bounded() {
    use compactor::compaction::serialize::SUMMARY_INPUT_MAX_CHARS as CAP;
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
