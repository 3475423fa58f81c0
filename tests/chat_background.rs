//! Background pre-compaction (`[compaction] background`): commit from the
//! pending record, discard on divergence, fallback to inline, single flight,
//! for both strategies; and an overflow retry that finds a matching pending
//! record uses it.

mod support;

use std::time::Duration;

use serde_json::json;
use support::chat::*;

fn config(extra: &str) -> String {
    format!(
        "[models.\"m\"]\ncontext_length = 2048\n[compaction]\nbackground = true\nbackground_threshold_percent = 40\n{extra}"
    )
}

const HEADERS: [(&str, &str); 2] = [("authorization", "Bearer k"), ("x-session-id", "bg")];

async fn started(url: &str) -> f64 {
    metric(url, "compactor_precompactions_total{event=\"started\"}").await
}

async fn used(url: &str) -> f64 {
    metric(url, "compactor_precompactions_total{event=\"used\"}").await
}

async fn discarded(url: &str) -> f64 {
    metric(url, "compactor_precompactions_total{event=\"discarded\"}").await
}

/// Turns until a pre-compaction starts; returns with its turn answered.
async fn grow_until_started(url: &str, conv: &mut Conversation) {
    for _ in 0..30 {
        let sent = conv.ask();
        let (st, h, _) = post_chat(url, chat_body("m", &sent, false), &HEADERS).await;
        assert_eq!(st, 200);
        assert_eq!(
            action(&h),
            "passthrough",
            "compacted before the soft threshold"
        );
        conv.answer();
        if started(url).await >= 1.0 {
            return;
        }
    }
    panic!("no pre-compaction started");
}

/// Asks until a turn compacts; returns the number of turns it took.
async fn until_compacted(url: &str, conv: &mut Conversation) -> usize {
    for i in 0..30 {
        let sent = conv.ask();
        let (st, h, _) = post_chat(url, chat_body("m", &sent, false), &HEADERS).await;
        assert_eq!(st, 200);
        conv.answer();
        if action(&h) == "compacted" {
            return i;
        }
    }
    panic!("never compacted");
}

#[tokio::test]
async fn the_compaction_turn_commits_the_pending_record_without_a_summary_call() {
    let mock = ChatMock::start(Settings::default()).await;
    // Started nearer the trigger than the other tests: a candidate cut for
    // a much shorter history (with the user's own messages kept beside its
    // summary) no longer fits a 2k trigger once the history has grown.
    let cfg = config("").replace(
        "background_threshold_percent = 40",
        "background_threshold_percent = 60",
    );
    let cfg = format!("[admin]\ntoken = \"admin-secret\"\n{cfg}");
    let proxy = start_proxy(&mock.url(), &cfg).await;
    let url = proxy.url();
    let mut conv = Conversation::new(600);
    grow_until_started(&url, &mut conv).await;
    // Let the background summary finish.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let summaries = mock.summaries().len();
    assert!(summaries >= 1, "the pre-compaction summarised");
    until_compacted(&url, &mut conv).await;
    assert!(used(&url).await >= 1.0, "the pending record was not used");
    assert_eq!(
        mock.summaries().len(),
        summaries,
        "the compaction turn summarised"
    );
    let seen = mock.last_chat().messages();
    assert_tool_pairs(&seen);
    // The conversation carries on with the record.
    let sent = conv.ask();
    let (st, h, _) = post_chat(&url, chat_body("m", &sent, false), &HEADERS).await;
    assert_eq!(st, 200);
    assert!(compacted_or_substituted(&h), "{}", action(&h));
    // The inspector's row of that compaction has the pass's own summary
    // calls, as an inline one has; so has the conversation's count.
    let (st, v) = admin_view(&url, "admin-secret", &session_of(&h)).await;
    assert_eq!(st, 200);
    let c = &v["compaction_figures"][0];
    assert_eq!(c["source"], "pending", "{c}");
    assert_eq!(c["summary_calls"].as_u64(), Some(summaries as u64), "{c}");
    assert!(c["summariser_ms"].as_u64().is_some(), "{c}");
    let per_row: u64 = v["compaction_figures"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["summary_calls"].as_u64().unwrap())
        .sum();
    assert_eq!(v["summary_calls"].as_u64(), Some(per_row), "{v}");
}

#[tokio::test]
async fn a_diverged_history_discards_the_pending_record() {
    let mock = ChatMock::start(Settings::default()).await;
    let proxy = start_proxy(&mock.url(), &config("")).await;
    let url = proxy.url();
    let mut conv = Conversation::new(600);
    grow_until_started(&url, &mut conv).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    // The client edits its history: the snapshot's prefix is gone.
    conv.messages[1] = json!({"role":"user","content":"an edited first question"});
    until_compacted(&url, &mut conv).await;
    assert!(discarded(&url).await >= 1.0);
    // Only a pre-compaction started after the edit may have been used.
    assert!(used(&url).await <= started(&url).await - discarded(&url).await);
}

#[tokio::test]
async fn a_failed_pre_compaction_falls_back_to_inline() {
    let mock = ChatMock::start(Settings::default()).await;
    mock.update(|s| s.summary = SummaryMode::Status(500));
    let proxy = start_proxy(&mock.url(), &config("")).await;
    let url = proxy.url();
    let mut conv = Conversation::new(600);
    grow_until_started(&url, &mut conv).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    mock.update(|s| s.summary = SummaryMode::Reply(default_summary()));
    let summaries = mock.summaries().len();
    until_compacted(&url, &mut conv).await;
    assert_eq!(used(&url).await, 0.0);
    assert!(mock.summaries().len() > summaries, "no inline summary");
}

#[tokio::test]
async fn one_pre_compaction_at_a_time_per_conversation() {
    let mock = ChatMock::start(Settings::default()).await;
    mock.update(|s| s.summary_delay = Duration::from_secs(2));
    let proxy = start_proxy(&mock.url(), &config("summary_timeout_secs = 5\n")).await;
    let url = proxy.url();
    let mut conv = Conversation::new(600);
    grow_until_started(&url, &mut conv).await;
    // More turns past the soft threshold while the first is running.
    for _ in 0..2 {
        let sent = conv.ask();
        let (st, h, _) = post_chat(&url, chat_body("m", &sent, false), &HEADERS).await;
        assert_eq!(st, 200);
        conv.answer();
        if action(&h) == "compacted" {
            break;
        }
    }
    assert_eq!(started(&url).await, 1.0);
    assert!(mock.summaries().len() <= 1, "{}", mock.summaries().len());
}

// ---------------------------------------------------------------- micro

fn micro_config(extra: &str) -> String {
    format!(
        "[models.\"m\"]\ncontext_length = 16384\n[compaction]\nstrategy = \"micro\"\nbackground = true\nbackground_threshold_percent = 90\nprotect_last_n = 4\nmin_tail_user_messages = 1\n{extra}"
    )
}

fn micro_summaries(mock: &ChatMock) -> usize {
    mock.summaries()
        .iter()
        .filter(|s| {
            let v: serde_json::Value = serde_json::from_slice(&s.body).unwrap_or_default();
            v["messages"][0]["content"]
                .as_str()
                .is_some_and(|c| c.starts_with(MICRO_PROMPT_START))
        })
        .count()
}

/// One turn: asks, checks the answer, adds the assistant's round.
async fn turn(url: &str, conv: &mut Conversation) -> String {
    let sent = conv.ask();
    let (st, h, _) = post_chat(url, chat_body("m", &sent, false), &HEADERS).await;
    assert_eq!(st, 200);
    conv.answer();
    action(&h).to_owned()
}

/// Turns (each a moment after the last, so a started pass can finish)
/// until a micro pre-compaction was used; returns the turns taken.
async fn until_used(url: &str, conv: &mut Conversation) -> usize {
    for i in 0..20 {
        turn(url, conv).await;
        if used(url).await >= 1.0 {
            return i;
        }
        tokio::time::sleep(Duration::from_millis(150)).await;
    }
    panic!("no micro pre-compaction was used");
}

#[tokio::test]
async fn micro_turns_commit_the_pending_pass_without_an_inline_summary() {
    let mock = ChatMock::start(Settings::default()).await;
    let proxy = start_proxy(&mock.url(), &micro_config("")).await;
    let url = proxy.url();
    let mut conv = Conversation::new(400);
    until_used(&url, &mut conv).await;
    // An exchange that leaves the tail on the turn that completes it can
    // only be absorbed inline; from now on the tail holds the next one.
    let (s0, st0, u0) = (
        micro_summaries(&mock),
        started(&url).await,
        used(&url).await,
    );
    for _ in 0..4 {
        tokio::time::sleep(Duration::from_millis(150)).await;
        assert_eq!(turn(&url, &mut conv).await, "compacted");
    }
    assert_eq!(
        used(&url).await - u0,
        4.0,
        "every micro turn used its pending pass"
    );
    // Every micro summary since was a pre-compaction's: none ran inline.
    assert_eq!(
        (micro_summaries(&mock) - s0) as f64,
        started(&url).await - st0
    );
    assert_eq!(discarded(&url).await, 0.0);
    let seen = mock.last_chat().messages();
    assert_tool_pairs(&seen);
    assert!(
        seen.iter()
            .any(|m| m["content"].as_str().is_some_and(|c| c.contains("[MICRO]"))),
        "the micro marker reached the upstream"
    );
}

#[tokio::test]
async fn a_diverged_history_discards_the_pending_micro_pass() {
    let mock = ChatMock::start(Settings::default()).await;
    mock.update(|s| s.summary_delay = Duration::from_millis(400));
    let proxy = start_proxy(&mock.url(), &micro_config("")).await;
    let url = proxy.url();
    let mut conv = Conversation::new(400);
    for _ in 0..30 {
        turn(&url, &mut conv).await;
        if started(&url).await >= 1.0 {
            break;
        }
    }
    assert!(started(&url).await >= 1.0);
    let before = micro_summaries(&mock);
    // The client edits its history while the pass runs.
    conv.messages[1] = json!({"role":"user","content":"an edited first question"});
    turn(&url, &mut conv).await;
    assert!(discarded(&url).await >= 1.0);
    assert_eq!(used(&url).await, 0.0);
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(micro_summaries(&mock) >= before);
}

#[tokio::test]
async fn a_failed_micro_pre_compaction_falls_back_to_inline() {
    let mock = ChatMock::start(Settings::default()).await;
    mock.update(|s| s.summary = SummaryMode::Status(500));
    let proxy = start_proxy(&mock.url(), &micro_config("")).await;
    let url = proxy.url();
    let mut conv = Conversation::new(400);
    for _ in 0..30 {
        turn(&url, &mut conv).await;
        if started(&url).await >= 1.0 {
            break;
        }
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    mock.update(|s| s.summary = SummaryMode::Reply(default_summary()));
    // The failed pass is dropped; a turn with an exchange to absorb runs
    // its pass inline.
    let mut inline = false;
    for _ in 0..10 {
        let s0 = micro_summaries(&mock);
        let a = turn(&url, &mut conv).await;
        if a == "compacted" && used(&url).await == 0.0 && micro_summaries(&mock) > s0 {
            inline = true;
            break;
        }
    }
    assert!(
        inline,
        "no inline micro pass after the failed pre-compaction"
    );
    assert!(discarded(&url).await >= 1.0);
}

#[tokio::test]
async fn one_micro_pre_compaction_at_a_time_per_conversation() {
    let mock = ChatMock::start(Settings::default()).await;
    mock.update(|s| s.summary_delay = Duration::from_secs(2));
    let proxy = start_proxy(&mock.url(), &micro_config("")).await;
    let url = proxy.url();
    let mut conv = Conversation::new(400);
    for _ in 0..30 {
        turn(&url, &mut conv).await;
        if started(&url).await >= 1.0 {
            break;
        }
    }
    // Quick turns while the pass runs: none starts another.
    for _ in 0..2 {
        turn(&url, &mut conv).await;
    }
    let s = started(&url).await;
    let settled = used(&url).await + discarded(&url).await;
    assert!(
        s - settled <= 1.0,
        "{s} started, {settled} used or discarded: more than one in flight"
    );
}

// ---------------------------------------------------------------- overflow

/// A window the upstream enforces below the configured one: the turn that
/// overflows is retried with a forced compaction, which takes the pending
/// pre-compaction when it still fits the learned window.
async fn overflow_retry_uses_the_pending_record(strategy: &str, extra: &str) {
    let mock = ChatMock::start(Settings {
        window: Some(3_000),
        ..Settings::default()
    })
    .await;
    let proxy = start_proxy(
        &mock.url(),
        &format!(
            "[models.\"m\"]\ncontext_length = 8192\n[compaction]\nstrategy = \"{strategy}\"\nbackground = true\nbackground_threshold_percent = 20\nthreshold_percent = 0.9\nprotect_last_n = 2\nmin_tail_user_messages = 1\nsummary_target_ratio = 0.1\n{extra}"
        ),
    )
    .await;
    let url = proxy.url();
    let mut conv = Conversation::new(600);
    let mut retried_turn = None;
    for _ in 0..40 {
        let summaries = mock.summaries().len();
        let a = turn(&url, &mut conv).await;
        if a == "retried" {
            retried_turn = Some(mock.summaries().len() - summaries);
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let inline_summaries = retried_turn.expect("the upstream never overflowed");
    assert!(
        used(&url).await >= 1.0,
        "the retry did not use the pending record"
    );
    assert_eq!(inline_summaries, 0, "the retry summarised inline");
}

#[tokio::test]
async fn an_overflow_retry_uses_the_pending_batch_record() {
    overflow_retry_uses_the_pending_record("batch", "").await;
}

#[tokio::test]
async fn an_overflow_retry_uses_the_pending_batch_record_under_micro() {
    // Micro passes rare enough that the history grows into the overflow.
    overflow_retry_uses_the_pending_record("micro", "micro_every_n_turns = 1000\n").await;
}
