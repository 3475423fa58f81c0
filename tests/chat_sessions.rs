//! Sessions, the admin view and concurrent requests of one session.

mod support;

use std::time::Duration;

use serde_json::json;
use support::chat::*;

const TOKEN: &str = "admin-secret";

fn config() -> String {
    format!("[admin]\ntoken = \"{TOKEN}\"\n[models.\"m\"]\ncontext_length = 2048\n")
}

fn history() -> Vec<serde_json::Value> {
    vec![
        json!({"role":"system","content":SYSTEM_PROMPT}),
        json!({"role":"user","content":"hello"}),
    ]
}

/// How many turns of [`Conversation::new(600)`] pass before the first
/// compaction (a dry run on a separate proxy in front of `mock`).
async fn turns_before_compaction(mock: &ChatMock, headers: &[(&str, &str)]) -> usize {
    let probe = start_proxy(&mock.url(), &config()).await;
    let mut c = Conversation::new(600);
    for i in 0..20 {
        let sent = c.ask();
        let (_, h, _) = post_chat(&probe.url(), chat_body("m", &sent, false), headers).await;
        c.answer();
        if action(&h) == "compacted" {
            assert!(i > 0, "compacted on the first turn");
            return i;
        }
    }
    panic!("no compaction in 20 turns");
}

#[tokio::test]
async fn credentials_never_share_a_session() {
    let mock = ChatMock::start(Settings::default()).await;
    let proxy = start_proxy(&mock.url(), &config()).await;
    let url = proxy.url();
    let body = chat_body("m", &history(), false);
    let (_, h1, _) = post_chat(
        &url,
        body.clone(),
        &[("authorization", "Bearer alice"), ("x-session-id", "same")],
    )
    .await;
    let (_, h2, _) = post_chat(
        &url,
        body.clone(),
        &[("authorization", "Bearer bob"), ("x-session-id", "same")],
    )
    .await;
    let (_, h1b, _) = post_chat(
        &url,
        body.clone(),
        &[("authorization", "Bearer alice"), ("x-session-id", "same")],
    )
    .await;
    let (_, h3, _) = post_chat(
        &url,
        body,
        &[("authorization", "Bearer alice"), ("x-session-id", "other")],
    )
    .await;
    assert_ne!(session_of(&h1), session_of(&h2));
    assert_eq!(session_of(&h1), session_of(&h1b));
    assert_ne!(session_of(&h1), session_of(&h3));
    // The key never contains the credential.
    for h in [&h1, &h2, &h3] {
        let k = session_of(h);
        assert!(!k.contains("alice") && !k.contains("bob"));
    }
    let (st, view) = admin_view(&url, TOKEN, &session_of(&h1)).await;
    assert_eq!(st, 200);
    assert_eq!(view["stats"]["requests"], json!(2), "{view}");
    let (_, view) = admin_view(&url, TOKEN, &session_of(&h2)).await;
    assert_eq!(view["stats"]["requests"], json!(1), "{view}");
}

#[tokio::test]
async fn fingerprint_fallback_is_stable_across_turns() {
    let mock = ChatMock::start(Settings::default()).await;
    let proxy = start_proxy(&mock.url(), &config()).await;
    let url = proxy.url();
    let auth = [("authorization", "Bearer k")];
    let mut conv = Conversation::new(600);
    let mut keys = Vec::new();
    // Far enough to compact: the key must survive the substitution too.
    for _ in 0..10 {
        let sent = conv.ask();
        let (status, h, _) = post_chat(&url, chat_body("m", &sent, false), &auth).await;
        conv.answer();
        assert_eq!(status, 200);
        keys.push(session_of(&h));
    }
    assert!(keys.windows(2).all(|w| w[0] == w[1]), "{keys:?}");
    let (_, view) = admin_view(&url, TOKEN, &keys[0]).await;
    assert!(
        view["stats"]["compactions"].as_u64().unwrap() >= 1,
        "{view}"
    );
    // Another conversation (different first user message) is another session.
    let other = vec![
        json!({"role":"system","content":SYSTEM_PROMPT}),
        json!({"role":"user","content":"a different task"}),
    ];
    let (_, h, _) = post_chat(&url, chat_body("m", &other, false), &auth).await;
    assert_ne!(session_of(&h), keys[0]);
}

#[tokio::test]
async fn admin_view_needs_the_token() {
    let mock = ChatMock::start(Settings::default()).await;
    let proxy = start_proxy(&mock.url(), &config()).await;
    let url = proxy.url();
    let (_, h, _) = post_chat(&url, chat_body("m", &history(), false), &[]).await;
    let key = session_of(&h);
    let path = format!("{url}/_compactor/sessions/{key}");
    let (st, _, _) = get_with(&path, &[]).await;
    assert_eq!(st, 401);
    let (st, _, _) = get_with(&path, &[("authorization", "Bearer wrong")]).await;
    assert_eq!(st, 401);
    let (st, view) = admin_view(&url, TOKEN, &key).await;
    assert_eq!(st, 200);
    assert_eq!(view["session"], json!(key));
    // Content-free: nothing of the conversation shows.
    assert!(!view.to_string().contains("hello"));
    let (st, _) = admin_view(&url, TOKEN, "0123456789abcdef0123456789abcdef").await;
    assert_eq!(st, 404);
    let (st, _) = admin_view(&url, TOKEN, "not-a-key").await;
    assert_eq!(st, 404);
}

#[tokio::test]
async fn admin_view_is_off_without_a_token() {
    let mock = ChatMock::start(Settings::default()).await;
    let proxy = start_proxy(&mock.url(), "").await;
    let (_, h, _) = post_chat(&proxy.url(), chat_body("m", &history(), false), &[]).await;
    let (st, _) = admin_view(&proxy.url(), "anything", &session_of(&h)).await;
    assert_eq!(st, 403);
}

#[tokio::test]
async fn concurrent_requests_compact_once() {
    let mock = ChatMock::start(Settings {
        // Keeps the first compaction running while the others arrive.
        summary_delay: Duration::from_millis(300),
        ..Settings::default()
    })
    .await;
    let proxy = start_proxy(&mock.url(), &config()).await;
    let url = proxy.url();
    let headers = [("authorization", "Bearer k"), ("x-session-id", "busy")];
    let mut conv = Conversation::new(600);
    // Grow to just below the threshold: the next turn compacts.
    let n_before = turns_before_compaction(&mock, &headers).await;
    for _ in 0..n_before {
        let sent = conv.ask();
        let (_, h, _) = post_chat(&url, chat_body("m", &sent, false), &headers).await;
        conv.answer();
        assert_eq!(action(&h), "passthrough");
    }
    let summaries_before = mock.summaries().len();
    let chats_before = mock.chats().len();
    let sent = conv.ask();
    let body = chat_body("m", &sent, false);
    let mut tasks = Vec::new();
    for _ in 0..4 {
        let (url, body) = (url.clone(), body.clone());
        tasks.push(tokio::spawn(async move {
            post_chat(
                &url,
                body,
                &[("authorization", "Bearer k"), ("x-session-id", "busy")],
            )
            .await
        }));
    }
    let mut key = String::new();
    let mut actions = Vec::new();
    for t in tasks {
        let (st, h, _) = t.await.unwrap();
        assert_eq!(st, 200);
        assert!(compacted_or_substituted(&h), "{}", action(&h));
        actions.push(action(&h).to_owned());
        key = session_of(&h);
    }
    // The first through the lock compacts; the others find its record.
    actions.sort();
    assert_eq!(
        actions,
        ["compacted", "passthrough", "passthrough", "passthrough"]
    );
    let summaries: Vec<_> = mock.summaries()[summaries_before..].to_vec();
    assert!(!summaries.is_empty());
    let mut prompts: Vec<_> = summaries.iter().map(|s| s.body.clone()).collect();
    prompts.sort();
    prompts.dedup();
    assert_eq!(prompts.len(), summaries.len(), "no summary was asked twice");
    let (_, view) = admin_view(&url, TOKEN, &key).await;
    assert_eq!(view["stats"]["compactions"], json!(1), "{view}");
    // All four went out as the same compacted request.
    let chats = &mock.chats()[chats_before..];
    assert_eq!(chats.len(), 4);
    assert!(chats.iter().all(|c| c.body == chats[0].body));
    assert!(chats[0].messages().len() < sent.len());
}

#[tokio::test]
async fn a_client_leaving_during_compaction_leaves_state_usable() {
    let mock = ChatMock::start(Settings::default()).await;
    let proxy = start_proxy(&mock.url(), &config()).await;
    let url = proxy.url();
    let headers = [("authorization", "Bearer k"), ("x-session-id", "gone")];
    let mut conv = Conversation::new(600);
    // Grow until the next turn would compact, with the summariser slowed
    // down from then on so the client can give up mid-compaction.
    let mut gave_up = false;
    for _ in 0..20 {
        let sent = conv.ask();
        let body = chat_body("m", &sent, false);
        mock.update(|s| s.summary_delay = Duration::from_secs(5));
        let summaries = mock.summaries().len();
        let attempt = tokio::time::timeout(
            Duration::from_millis(300),
            post_chat(&url, body.clone(), &headers),
        )
        .await;
        mock.update(|s| s.summary_delay = Duration::ZERO);
        match attempt {
            Ok((st, _, _)) => {
                assert_eq!(st, 200);
                assert_eq!(mock.summaries().len(), summaries);
            }
            Err(_) => {
                gave_up = true;
                assert!(mock.summaries().len() > summaries, "it was summarising");
                // The same turn again: the compaction the client left ran
                // to completion and was recorded; this request waited for
                // it and sends its record (no second summary). At this
                // window one compaction may summarise its middle in several
                // chunks, which arrive after the client left; a second
                // summary of the same middle would repeat a prompt.
                let (st, h, _) = post_chat(&url, body, &headers).await;
                assert_eq!(st, 200);
                assert!(compacted_or_substituted(&h), "{}", action(&h));
                let mut prompts: Vec<_> = mock.summaries()[summaries..]
                    .iter()
                    .map(|s| s.body.clone())
                    .collect();
                let asked = prompts.len();
                prompts.sort();
                prompts.dedup();
                assert_eq!(prompts.len(), asked, "summarised again");
                let seen = mock.last_chat().messages();
                assert!(seen.len() < sent.len());
                assert_tool_pairs(&seen);
                break;
            }
        }
        conv.answer();
    }
    assert!(gave_up, "never reached a compaction");
    // And the conversation carries on with the record.
    conv.answer();
    let sent = conv.ask();
    let (st, h, _) = post_chat(&url, chat_body("m", &sent, false), &headers).await;
    assert_eq!(st, 200);
    assert!(substituted(&h), "{}", action(&h));
}

/// A client that gives up while its turn is being compacted does not throw
/// the summary away: the compaction finishes, is recorded, and the next
/// turn substitutes it without another summary call.
#[tokio::test]
async fn a_compaction_the_client_left_is_recorded_for_the_next_turn() {
    let mock = ChatMock::start(Settings::default()).await;
    let proxy = start_proxy(&mock.url(), &config()).await;
    let url = proxy.url();
    let headers = [("authorization", "Bearer k"), ("x-session-id", "left")];
    let mut conv = Conversation::new(600);
    mock.update(|s| s.summary_delay = Duration::from_millis(800));
    let mut left = false;
    for _ in 0..20 {
        let sent = conv.ask();
        let summaries = mock.summaries().len();
        let attempt = tokio::time::timeout(
            Duration::from_millis(200),
            post_chat(&url, chat_body("m", &sent, false), &headers),
        )
        .await;
        conv.answer();
        if attempt.is_err() {
            assert!(mock.summaries().len() > summaries, "it was summarising");
            left = true;
            break;
        }
    }
    assert!(left, "never reached a compaction");
    // Let the abandoned compaction finish on its own.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let summaries = mock.summaries().len();
    let sent = conv.ask();
    let (st, h, _) = post_chat(&url, chat_body("m", &sent, false), &headers).await;
    assert_eq!(st, 200);
    assert!(substituted(&h), "{}", action(&h));
    assert_eq!(
        mock.summaries().len(),
        summaries,
        "the next turn summarised again"
    );
    assert!(mock.last_chat().messages().len() < sent.len());
}

/// A history far beyond the window (the engine sees its head and newest
/// rows only) still compacts into a record that stands for the whole
/// prefix: the next turn substitutes it.
#[tokio::test]
async fn a_huge_history_compacts_and_its_record_serves_the_next_turn() {
    let mock = ChatMock::start(Settings::default()).await;
    let proxy = start_proxy(&mock.url(), &config()).await;
    let url = proxy.url();
    let headers = [("authorization", "Bearer k"), ("x-session-id", "huge")];
    let mut sent = vec![json!({"role":"system","content":"s"})];
    for i in 0..20_000 {
        let role = if i % 2 == 0 { "user" } else { "assistant" };
        sent.push(json!({"role":role,"content":format!("hi {i}")}));
    }
    let (st, h, _) = post_chat(&url, chat_body("m", &sent, false), &headers).await;
    assert_eq!(st, 200);
    assert_eq!(action(&h), "compacted");
    let first = mock.last_chat().messages();
    assert!(first.len() < 1_000, "{}", first.len());
    assert_eq!(first.last(), sent.last());
    assert_tool_pairs(&first);
    sent.push(json!({"role":"assistant","content":"answer"}));
    sent.push(json!({"role":"user","content":"and now?"}));
    let summaries = mock.summaries().len();
    let (st, h, _) = post_chat(&url, chat_body("m", &sent, false), &headers).await;
    assert_eq!(st, 200);
    assert!(compacted_or_substituted(&h), "{}", action(&h));
    let next = mock.last_chat().messages();
    assert!(next.len() < 1_000, "{}", next.len());
    assert_eq!(next.last(), sent.last());
    if substituted(&h) {
        assert_eq!(mock.summaries().len(), summaries);
    }
}

/// Many conversations at once: each upstream request carries only its own
/// conversation's messages (no record or state crosses sessions).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn parallel_conversations_do_not_mix() {
    let mock = ChatMock::start(Settings::default()).await;
    let proxy = start_proxy(&mock.url(), &config()).await;
    let url = proxy.url();
    let mut tasks = Vec::new();
    for c in 0..8 {
        let url = url.clone();
        tasks.push(tokio::spawn(async move {
            let mut conv = Conversation::new(600);
            conv.messages[0] = json!({"role":"system","content":format!("conversation-{c}")});
            let auth = format!("Bearer user-{}", c % 3);
            for _ in 0..12 {
                conv.ask();
                let tagged = json!({"role":"user","content":format!("[c{c}] step {}", conv.turns)});
                *conv.messages.last_mut().unwrap() = tagged;
                let sent = conv.messages.clone();
                let (st, _, _) = post_chat(
                    &url,
                    chat_body("m", &sent, c % 2 == 0),
                    &[("authorization", auth.as_str())],
                )
                .await;
                assert_eq!(st, 200);
                conv.answer();
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let chats = mock.chats();
    assert_eq!(chats.len(), 8 * 12);
    let mut compacted = 0;
    for c in &chats {
        let msgs = c.messages();
        let owner = msgs[0]["content"].as_str().unwrap().to_owned();
        assert!(owner.starts_with("conversation-"));
        let tag = format!("[c{}]", owner.trim_start_matches("conversation-"));
        // Every user step in the request belongs to the same conversation.
        for m in msgs.iter().filter(|m| m["role"] == "user") {
            let text = m["content"].as_str().unwrap();
            if text.starts_with("[c") {
                assert!(text.starts_with(&tag), "{owner} got {text}");
            }
        }
        compacted += usize::from(msgs.len() < 2 + 4 * 11 && msgs.len() > 2);
    }
    assert!(compacted > 0);
    for s in mock.summaries() {
        let text = s.body_text();
        let owners: std::collections::BTreeSet<_> = (0..8)
            .filter(|c| text.contains(&format!("[c{c}]")))
            .collect();
        assert!(
            owners.len() <= 1,
            "a summary mixed conversations {owners:?}"
        );
    }
}

/// The built-in `[session] headers` (no `[session]` table at all): two
/// Claude Code subagents share the parent's session id and differ by agent
/// id, so they must be two conversations; the parent is a third.
#[tokio::test]
async fn default_headers_keep_claude_code_subagents_apart() {
    let mock = ChatMock::start(Settings::default()).await;
    let proxy = start_proxy(&mock.url(), "").await;
    let url = proxy.url();
    let body = chat_body("m", &history(), false);
    let parent = [("x-claude-code-session-id", "u1")];
    let agent_a = [
        ("x-claude-code-session-id", "u1"),
        ("x-claude-code-agent-id", "a"),
    ];
    let agent_b = [
        ("x-claude-code-session-id", "u1"),
        ("x-claude-code-agent-id", "b"),
    ];
    let (_, hp, _) = post_chat(&url, body.clone(), &parent).await;
    let (_, ha, _) = post_chat(&url, body.clone(), &agent_a).await;
    let (_, hb, _) = post_chat(&url, body.clone(), &agent_b).await;
    let (_, ha2, _) = post_chat(&url, body, &agent_a).await;
    assert_ne!(session_of(&ha), session_of(&hb));
    assert_ne!(session_of(&hp), session_of(&ha));
    assert_ne!(session_of(&hp), session_of(&hb));
    assert_eq!(session_of(&ha), session_of(&ha2));
}

#[tokio::test]
async fn admin_view_answers_while_a_compaction_holds_the_conversation() {
    let mock = ChatMock::start(Settings::default()).await;
    let proxy = start_proxy(&mock.url(), &config()).await;
    let url = proxy.url();
    let headers = [("authorization", "Bearer k"), ("x-session-id", "held")];
    let mut conv = Conversation::new(600);
    let mut key = String::new();
    // Up to the turn before the first compaction.
    let n_before = turns_before_compaction(&mock, &headers).await;
    for _ in 0..n_before {
        let sent = conv.ask();
        let (_, h, _) = post_chat(&url, chat_body("m", &sent, false), &headers).await;
        conv.answer();
        key = session_of(&h);
    }
    let (st, before) = admin_view(&url, TOKEN, &key).await;
    assert_eq!(st, 200);
    assert_eq!(before["busy"], json!(false), "{before}");
    // The compacting turn's summary call now hangs far longer than the view may wait.
    mock.update(|s| s.summary_delay = Duration::from_secs(60));
    let summaries_before = mock.summaries().len();
    let sent = conv.ask();
    let compacting = tokio::spawn({
        let url = url.clone();
        async move { post_chat(&url, chat_body("m", &sent, false), &headers).await }
    });
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while mock.summaries().len() == summaries_before {
        assert!(
            tokio::time::Instant::now() < deadline,
            "no summary call started"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let (st, during) = tokio::time::timeout(Duration::from_secs(10), admin_view(&url, TOKEN, &key))
        .await
        .expect("the view waited for the compaction");
    assert_eq!(st, 200);
    assert_eq!(during["busy"], json!(true), "{during}");
    // The last view rendered before, not an empty one.
    assert_eq!(during["stats"], before["stats"], "{during}");
    compacting.abort();
}
