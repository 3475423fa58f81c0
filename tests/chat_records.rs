//! Compaction records seen from outside: retries, forks, edits, other
//! sessions and credentials; summary call headers; odd bodies.

mod support;

use serde_json::{json, Value};
use support::chat::*;

const TOKEN: &str = "admin-secret";
const ALICE: (&str, &str) = ("authorization", "Bearer alice");

fn config(extra: &str) -> String {
    format!("[admin]\ntoken = \"{TOKEN}\"\n[models.\"m\"]\ncontext_length = 2048\n{extra}")
}

/// Runs a conversation until its first compaction; returns the history
/// that was compacted (last sent) and the conversation.
async fn to_first_compaction(url: &str, headers: &[(&str, &str)]) -> (Conversation, Vec<Value>) {
    let mut conv = Conversation::new(600);
    for _ in 0..20 {
        let sent = conv.ask();
        let (st, h, _) = post_chat(url, chat_body("m", &sent, false), headers).await;
        assert_eq!(st, 200);
        if action(&h) == "compacted" {
            return (conv, sent);
        }
        conv.answer();
    }
    panic!("no compaction");
}

#[tokio::test]
async fn a_retried_turn_is_sent_identically_without_a_new_summary() {
    let mock = ChatMock::start(Settings::default()).await;
    let proxy = start_proxy(&mock.url(), &config("")).await;
    let url = proxy.url();
    let (_conv, sent) = to_first_compaction(&url, &[ALICE, ("x-session-id", "a")]).await;
    let first = mock.last_chat();
    let calls = mock.summaries().len();
    // The client did not get (or did not like) the answer and sends it again.
    let (st, h, _) = post_chat(
        &url,
        chat_body("m", &sent, false),
        &[ALICE, ("x-session-id", "a")],
    )
    .await;
    assert_eq!(st, 200);
    assert!(substituted(&h), "{}", action(&h));
    assert_eq!(mock.summaries().len(), calls);
    assert_eq!(mock.last_chat().body, first.body);
}

#[tokio::test]
async fn records_are_found_by_content_not_session() {
    let mock = ChatMock::start(Settings::default()).await;
    let proxy = start_proxy(&mock.url(), &config("")).await;
    let url = proxy.url();
    let (_conv, sent) = to_first_compaction(&url, &[ALICE, ("x-session-id", "a")]).await;
    let first = mock.last_chat();
    let calls = mock.summaries().len();
    // Same credential, another session id (e.g. a resumed client): the
    // record made for this history is reused.
    let (_, h, _) = post_chat(
        &url,
        chat_body("m", &sent, false),
        &[ALICE, ("x-session-id", "b")],
    )
    .await;
    assert!(substituted(&h), "{}", action(&h));
    assert_eq!(mock.summaries().len(), calls);
    assert_eq!(mock.last_chat().body, first.body);
    // Another credential never sees it: its own compaction runs.
    let bob = [("authorization", "Bearer bob"), ("x-session-id", "a")];
    let (_, h, _) = post_chat(&url, chat_body("m", &sent, false), &bob).await;
    assert_eq!(action(&h), "compacted");
    assert!(
        mock.summaries().len() > calls,
        "bob's request needs its own summary"
    );
    let bob_summary = mock.summaries().last().unwrap().headers["authorization"].clone();
    assert_eq!(bob_summary, "Bearer bob");
}

#[tokio::test]
async fn an_edited_history_drops_the_record() {
    let mock = ChatMock::start(Settings::default()).await;
    let proxy = start_proxy(&mock.url(), &config("")).await;
    let url = proxy.url();
    let hdr = [ALICE, ("x-session-id", "a")];
    let (mut conv, _sent) = to_first_compaction(&url, &hdr).await;
    conv.answer();
    // The client rewrites its first user message (say, it compacted itself
    // or the user edited it) and carries on.
    let mut edited = conv.ask();
    edited[1] = json!({"role":"user","content":"Step 1: a different request altogether."});
    let calls = mock.summaries().len();
    let (st, h, _) = post_chat(&url, chat_body("m", &edited, false), &hdr).await;
    assert_eq!(st, 200);
    let seen = mock.last_chat().messages();
    // Judged on its own: still over the threshold, so a fresh compaction;
    // the edited message is not silently replaced by the old summary.
    assert!(mock.summaries().len() > calls, "{}", action(&h));
    let summary_prompt: String = mock.summaries()[calls..]
        .iter()
        .map(|s| s.body_text())
        .collect();
    assert!(
        summary_prompt.contains("a different request altogether") || seen.contains(&edited[1]),
        "the edited message is summarised or kept"
    );
    assert_eq!(seen.last(), edited.last());
    assert_tool_pairs(&seen);
}

#[tokio::test]
async fn a_fork_shares_the_common_record() {
    let mock = ChatMock::start(Settings::default()).await;
    let proxy = start_proxy(&mock.url(), &config("")).await;
    let url = proxy.url();
    let hdr = [ALICE, ("x-session-id", "a")];
    let (mut conv, _sent) = to_first_compaction(&url, &hdr).await;
    let compacted = mock.last_chat().messages();
    conv.answer();
    let next = conv.ask();
    // A fork: same history, a different newest user message.
    let mut fork = next.clone();
    *fork.last_mut().unwrap() = json!({"role":"user","content":"Actually, stop and summarise."});
    let calls = mock.summaries().len();
    for (history, session) in [(&next, "a"), (&fork, "fork")] {
        let (st, h, _) = post_chat(
            &url,
            chat_body("m", history, false),
            &[ALICE, ("x-session-id", session)],
        )
        .await;
        assert_eq!(st, 200);
        assert!(substituted(&h), "{session}: {}", action(&h));
        let seen = mock.last_chat().messages();
        assert_eq!(seen.last(), history.last());
        // Same replacement in front of both.
        let summary = compacted
            .iter()
            .position(|m| {
                m["content"]
                    .as_str()
                    .is_some_and(|c| c.contains("[COMPACTOR CONTEXT HANDOFF"))
            })
            .unwrap();
        assert_eq!(seen[..=summary], compacted[..=summary]);
    }
    assert_eq!(mock.summaries().len(), calls);
}

#[tokio::test]
async fn summary_calls_carry_credentials_not_session_headers() {
    let mock = ChatMock::start(Settings::default()).await;
    let proxy = start_proxy(&mock.url(), &config("")).await;
    let hdr = [
        ALICE,
        ("x-session-id", "a"),
        ("openai-organization", "org-1"),
    ];
    to_first_compaction(&proxy.url(), &hdr).await;
    let s = mock.summaries();
    assert!(!s.is_empty());
    for call in &s {
        assert_eq!(call.headers["authorization"], "Bearer alice");
        assert_eq!(call.headers["openai-organization"], "org-1");
        assert!(call.headers.get("x-session-id").is_none());
        let body = call.json();
        assert_eq!(body["model"], "m");
        assert_eq!(body["stream"], json!(false));
    }
}

#[tokio::test]
async fn summary_key_and_model_from_config() {
    let mock = ChatMock::start(Settings::default()).await;
    let proxy = start_proxy(
        &mock.url(),
        &config("[compaction]\nsummary_api_key = \"sk-summary\"\nsummary_model = \"small\"\n"),
    )
    .await;
    to_first_compaction(&proxy.url(), &[ALICE]).await;
    let s = mock.summaries();
    assert!(!s.is_empty());
    for call in &s {
        assert_eq!(call.headers["authorization"], "Bearer sk-summary");
        assert_eq!(call.json()["model"], "small");
    }
}

#[tokio::test]
async fn streaming_compaction_still_hides_usage() {
    let mock = ChatMock::start(Settings {
        timings: true,
        ..Settings::default()
    })
    .await;
    let proxy = start_proxy(&mock.url(), &config("")).await;
    let url = proxy.url();
    let mut conv = Conversation::new(600);
    let mut compacted = 0;
    for _ in 0..14 {
        let sent = conv.ask();
        let (st, h, body) = post_chat(&url, chat_body("m", &sent, true), &[ALICE]).await;
        conv.answer();
        assert_eq!(st, 200);
        let seen = mock.last_chat();
        let expected = render_sse(
            "m",
            &Settings::default().deltas,
            false,
            seen.prompt_tokens,
            true,
        );
        assert_eq!(
            String::from_utf8_lossy(&body),
            String::from_utf8_lossy(&expected)
        );
        compacted += usize::from(compacted_or_substituted(&h));
        let (_, view) = admin_view(&url, TOKEN, &session_of(&h)).await;
        assert_eq!(view["last_real_prompt_tokens"], json!(seen.prompt_tokens));
    }
    assert!(compacted > 0);
}

#[tokio::test]
async fn explicit_include_usage_false_is_hidden_again() {
    let mock = ChatMock::start(Settings::default()).await;
    let proxy = start_proxy(&mock.url(), "").await;
    let body = br#"{"model":"m","stream":true,"stream_options":{"include_usage":false,"x":1},"messages":[{"role":"user","content":"hi"}]}"#;
    let (st, _, resp) = post_chat(&proxy.url(), body.to_vec(), &[]).await;
    assert_eq!(st, 200);
    let seen = mock.last_chat();
    assert_eq!(
        seen.json()["stream_options"],
        json!({"include_usage": true, "x": 1})
    );
    let expected = render_sse(
        "m",
        &Settings::default().deltas,
        false,
        seen.prompt_tokens,
        false,
    );
    assert_eq!(resp.as_ref(), expected.as_slice());
}

#[tokio::test]
async fn bodies_compactor_cannot_read_are_forwarded_as_is() {
    let mock = ChatMock::start(Settings::default()).await;
    let proxy = start_proxy(&mock.url(), "").await;
    for body in [
        &b"{not json"[..],
        br#"{"model":"m","messages":"not an array"}"#,
        br#"{"model":"m"}"#,
    ] {
        let (_, _, _) = post_chat(&proxy.url(), body.to_vec(), &[]).await;
        assert_eq!(mock.seen().last().unwrap().body.as_ref(), body);
    }
}

#[tokio::test]
async fn timings_alone_calibrate() {
    let mock = ChatMock::start(Settings {
        timings: true,
        omit_usage: true,
        ..Settings::default()
    })
    .await;
    let proxy = start_proxy(&mock.url(), &config("")).await;
    for stream in [false, true] {
        let history = vec![json!({"role":"user","content":format!("hi {stream}")})];
        let (st, h, _) = post_chat(&proxy.url(), chat_body("m", &history, stream), &[ALICE]).await;
        assert_eq!(st, 200);
        let (_, view) = admin_view(&proxy.url(), TOKEN, &session_of(&h)).await;
        assert_eq!(
            view["last_real_prompt_tokens"],
            json!(mock.last_chat().prompt_tokens),
            "{view}"
        );
    }
}

#[tokio::test]
async fn provider_without_usage_still_stays_inside_the_window() {
    for stream in [false, true] {
        let mock = ChatMock::start(Settings {
            omit_usage: true,
            window: Some(2048),
            ..Settings::default()
        })
        .await;
        let proxy = start_proxy(&mock.url(), &config("")).await;
        let mut conv = Conversation::new(600);
        let mut compacted = 0;
        for _ in 0..24 {
            let sent = conv.ask();
            let (st, h, body) =
                post_chat(&proxy.url(), chat_body("m", &sent, stream), &[ALICE]).await;
            conv.answer();
            assert_eq!(
                st,
                200,
                "turn {}: {}",
                conv.turns,
                String::from_utf8_lossy(&body)
            );
            assert_ne!(action(&h), "aborted");
            compacted += usize::from(mock.last_chat().messages().len() < sent.len());
        }
        assert!(compacted > 0);
        // Without real usage the rough estimate alone keeps it inside.
        assert!(
            mock.chats().iter().all(|c| !c.overflowed),
            "stream={stream}"
        );
    }
}

#[tokio::test]
async fn micro_strategy_keeps_conversations_going() {
    let mock = ChatMock::start(Settings {
        window: Some(2048),
        ..Settings::default()
    })
    .await;
    let proxy = start_proxy(&mock.url(), &config("[compaction]\nstrategy = \"micro\"\n")).await;
    let mut conv = Conversation::new(600);
    let mut compacted = 0;
    for _ in 0..20 {
        let sent = conv.ask();
        let (st, h, body) = post_chat(&proxy.url(), chat_body("m", &sent, false), &[ALICE]).await;
        conv.answer();
        assert_eq!(
            st,
            200,
            "turn {}: {}",
            conv.turns,
            String::from_utf8_lossy(&body)
        );
        let seen = mock.last_chat().messages();
        assert_eq!(seen.last(), sent.last());
        assert_eq!(seen[0], sent[0]);
        assert_tool_pairs(&seen);
        compacted += usize::from(compacted_or_substituted(&h));
    }
    assert!(compacted > 0);
    assert!(mock.chats().iter().all(|c| !c.overflowed));
}

#[test]
fn a_bad_summary_endpoint_is_a_config_error() {
    for bad in ["localhost:8081", "ftp://example.com", "not a url"] {
        let text = format!(
            "listen = \"127.0.0.1:0\"\nupstream = \"http://127.0.0.1:9\"\n[compaction]\nsummary_endpoint = \"{bad}\"\n"
        );
        // Rejected with the rest of the configuration, before anything starts.
        let err =
            compactor::config::Config::from_toml_str(&text, &compactor::config::MapEnv::default())
                .unwrap_err();
        assert!(err.to_string().contains("summary_endpoint"), "{bad}: {err}");
        assert_eq!(err.keys(), ["compaction.summary_endpoint"], "{bad}: {err}");
    }
}

/// Clients re-serialise their history each turn; key order and whitespace
/// may change. The record still matches (canonical hashing).
#[tokio::test]
async fn a_reformatted_history_still_matches_its_record() {
    let mock = ChatMock::start(Settings::default()).await;
    let proxy = start_proxy(&mock.url(), &config("")).await;
    let url = proxy.url();
    let hdr = [ALICE, ("x-session-id", "a")];
    let (_conv, sent) = to_first_compaction(&url, &hdr).await;
    let first = mock.last_chat();
    let calls = mock.summaries().len();
    // Same messages, keys reversed and spaced out.
    let msgs: Vec<String> = sent
        .iter()
        .map(|m| {
            let obj = m.as_object().unwrap();
            let fields: Vec<String> = obj
                .iter()
                .rev()
                .map(|(k, v)| format!("{} : {}", json!(k), v))
                .collect();
            format!("{{ {} }}", fields.join(" , "))
        })
        .collect();
    let body = format!(
        "{{\"model\":\"m\",\"max_tokens\":64,\"messages\":[ {} ]}}",
        msgs.join(", ")
    );
    let (st, h, _) = post_chat(&url, body.into_bytes(), &hdr).await;
    assert_eq!(st, 200);
    assert!(substituted(&h), "{}", action(&h));
    assert_eq!(mock.summaries().len(), calls, "no new summary");
    let before: Vec<Value> = first.messages();
    let now: Vec<Value> = mock.last_chat().messages();
    assert_eq!(before, now, "same content sent");
}

#[tokio::test]
async fn a_developer_message_is_kept_like_a_system_prompt() {
    let mock = ChatMock::start(Settings::default()).await;
    let proxy = start_proxy(&mock.url(), &config("")).await;
    let mut conv = Conversation::new(600);
    conv.messages[0] = json!({"role":"developer","content":"Developer rules: be terse."});
    for _ in 0..12 {
        let sent = conv.ask();
        let (st, h, _) = post_chat(&proxy.url(), chat_body("m", &sent, false), &[ALICE]).await;
        conv.answer();
        assert_eq!(st, 200);
        let seen = mock.last_chat().messages();
        assert_eq!(seen[0], sent[0], "{}", action(&h));
        assert_eq!(seen.last(), sent.last());
        assert_tool_pairs(&seen);
    }
    assert!(!mock.summaries().is_empty());
}

#[tokio::test]
async fn content_part_arrays_survive_compaction() {
    let mock = ChatMock::start(Settings::default()).await;
    let proxy = start_proxy(&mock.url(), &config("")).await;
    let mut conv = Conversation::new(600);
    let image = format!("data:image/png;base64,{}", "iVBORw0KGgo".repeat(40));
    for _ in 0..14 {
        let mut sent = conv.ask();
        let i = conv.turns;
        *sent.last_mut().unwrap() = json!({"role":"user","name":"dev","content":[
            {"type":"text","text":format!("Step {i}: look at this screenshot too.")},
            {"type":"image_url","image_url":{"url":image,"detail":"low"}}
        ]});
        conv.messages.pop();
        conv.messages.push(sent.last().unwrap().clone());
        let (st, h, _) = post_chat(&proxy.url(), chat_body("m", &sent, false), &[ALICE]).await;
        conv.answer();
        assert_eq!(st, 200);
        let seen = mock.last_chat().messages();
        assert_eq!(seen.last(), sent.last(), "{}", action(&h));
        assert_eq!(seen[0], sent[0]);
        assert_tool_pairs(&seen);
    }
    assert!(!mock.summaries().is_empty());
    // No image bytes go into a summary prompt of its own; a summary asked
    // after the conversation sends the conversation's messages (its images
    // as the client sent them to this upstream, for the prompt cache).
    for s in mock.summaries() {
        if is_in_context_summary(&s.json()) {
            let asked = s.messages();
            let chats = mock.chats();
            let earlier = chats.iter().any(|c| {
                let m = c.messages();
                m.len() >= asked.len() && m[..asked.len() - 1] == asked[..asked.len() - 1]
            });
            assert!(earlier, "an in-context summary of messages never sent");
        } else {
            assert!(!s.body_text().contains("iVBORw0KGgoiVBORw0KGgo"));
        }
    }
}

/// Runs session `a` until it has compacted twice; returns every history it
/// sent, in order.
async fn to_second_compaction(url: &str) -> Vec<Vec<Value>> {
    let hdr = [ALICE, ("x-session-id", "a")];
    let mut conv = Conversation::new(600);
    let mut sent = Vec::new();
    let mut compactions = 0;
    for _ in 0..60 {
        let history = conv.ask();
        let (st, h, _) = post_chat(url, chat_body("m", &history, false), &hdr).await;
        assert_eq!(st, 200);
        sent.push(history);
        if action(&h) == "compacted" {
            compactions += 1;
            if compactions == 2 {
                return sent;
            }
        }
        conv.answer();
    }
    panic!("fewer than two compactions");
}

/// Session `b` replays `a`'s turns: every turn finds the longest record
/// of the history (whichever session wrote it), so no summary is asked
/// again, and the last turn gets the second compaction's record.
async fn replay_without_summaries(url: &str, mock: &ChatMock, sent: &[Vec<Value>], longest: usize) {
    let calls = mock.summaries().len();
    let hdr = [ALICE, ("x-session-id", "b")];
    let mut last_replaced = 0;
    for history in sent {
        let (st, h, _) = post_chat(url, chat_body("m", history, false), &hdr).await;
        assert_eq!(st, 200);
        assert_ne!(
            action(&h),
            "compacted",
            "turn of {} messages",
            history.len()
        );
        last_replaced = replaced(&h);
    }
    assert_eq!(mock.summaries().len(), calls, "b asked for summaries again");
    assert_eq!(last_replaced, longest, "the longer record is substituted");
}

#[tokio::test]
async fn a_second_session_gets_the_longest_record_of_the_history() {
    let mock = ChatMock::start(Settings::default()).await;
    let proxy = start_proxy(&mock.url(), &config("")).await;
    let url = proxy.url();
    let sent = to_second_compaction(&url).await;
    // What `a`'s last turn replaced, asked again of `a` (a retry).
    let (_, h, _) = post_chat(
        &url,
        chat_body("m", sent.last().unwrap(), false),
        &[ALICE, ("x-session-id", "a")],
    )
    .await;
    let longest = replaced(&h);
    assert!(longest > 0);
    replay_without_summaries(&url, &mock, &sent, longest).await;
}

#[tokio::test]
async fn the_longest_record_is_found_in_the_store_after_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let store = format!(
        "[store]\npath = \"{}\"\n",
        dir.path().join("state.log").display()
    );
    let mock = ChatMock::start(Settings::default()).await;
    let proxy = start_proxy(&mock.url(), &config(&store)).await;
    let sent = to_second_compaction(&proxy.url()).await;
    let (_, h, _) = post_chat(
        &proxy.url(),
        chat_body("m", sent.last().unwrap(), false),
        &[ALICE, ("x-session-id", "a")],
    )
    .await;
    let longest = replaced(&h);
    assert!(longest > 0);
    // Let the background writes land, then start again on the same file:
    // memory is empty, the store holds both records.
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    proxy.shutdown().await;
    let proxy = start_proxy(&mock.url(), &config(&store)).await;
    replay_without_summaries(&proxy.url(), &mock, &sent, longest).await;
}
