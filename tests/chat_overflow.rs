//! Overflow retry and window discovery through the proxy.

mod support;

use serde_json::json;
use support::chat::*;

const TOKEN: &str = "admin-secret";
const AUTH: (&str, &str) = ("authorization", "Bearer user-key");

/// No window configured, discovery finds nothing, large default.
fn unknown_window() -> String {
    format!("default_context_length = 100000\n[admin]\ntoken = \"{TOKEN}\"\n")
}

/// Grows a conversation against a mock enforcing a 2048 window until the
/// first overflow; checks the retry and returns the number of turns run.
async fn retry_on_overflow(style: OverflowStyle, stream: bool) {
    let mock = ChatMock::start(Settings {
        window: Some(2048),
        overflow: style,
        ..Settings::default()
    })
    .await;
    let proxy = start_proxy(&mock.url(), &unknown_window()).await;
    let url = proxy.url();
    let mut conv = Conversation::new(600);
    let mut retried = false;
    let mut posts = 0.0;
    for _ in 0..25 {
        let before = mock.chats().len();
        let sent = conv.ask();
        posts += 1.0;
        let (status, headers, body) = post_chat(&url, chat_body("m", &sent, stream), &[AUTH]).await;
        conv.answer();
        assert_eq!(status, 200, "{style:?}: {}", String::from_utf8_lossy(&body));
        let chats = &mock.chats()[before..];
        match action(&headers) {
            "retried" => {
                assert!(!retried, "only the first overflow needs a retry");
                retried = true;
                assert_eq!(chats.len(), 2, "one failed attempt, one retry");
                assert!(chats[0].overflowed);
                assert!(!chats[1].overflowed);
                assert!(chats[1].messages().len() < sent.len());
                assert_eq!(chats[1].messages().last(), sent.last());
                assert_tool_pairs(&chats[1].messages());
                let text = String::from_utf8_lossy(&body);
                assert!(!text.contains("error"), "client saw the overflow: {text}");
                if stream {
                    assert!(text.ends_with("data: [DONE]\n\n"), "{text}");
                    // The retry prepares the request the first attempt
                    // edited: it still asks for usage, and still hides it.
                    assert!(chats[1].body_text().contains("\"include_usage\":true"));
                    assert!(
                        !text.contains("prompt_tokens"),
                        "usage reached the client: {text}"
                    );
                }
            }
            other => {
                let other = if substituted(&headers) {
                    "substituted"
                } else {
                    other
                };
                assert_eq!(chats.len(), 1, "{other}");
                assert!(!chats[0].overflowed, "{other}: overflow reached the client");
                if !retried {
                    assert_eq!(other, "passthrough");
                } else {
                    // The learned window makes compaction proactive.
                    assert!(other == "compacted" || other == "substituted", "{other}");
                }
            }
        }
        if retried && conv.turns > 16 {
            break;
        }
    }
    assert!(retried, "{style:?}: the window was never exceeded");
    assert_eq!(
        metric(&url, "compactor_overflow_retries_total").await,
        1.0,
        "{style:?}"
    );
    assert_eq!(
        metric(&url, "compactor_chat_requests_total{action=\"retried\"}").await,
        1.0
    );
    // One decode per request: the retry prepares the same decoded request.
    assert_eq!(
        metric(&url, "compactor_request_decodes_total{pool=\"inline\"}").await,
        posts
    );
}

#[tokio::test]
async fn llamacpp_overflow_is_retried() {
    retry_on_overflow(OverflowStyle::LlamaCpp, false).await;
}

#[tokio::test]
async fn llamacpp_overflow_is_retried_streaming() {
    retry_on_overflow(OverflowStyle::LlamaCpp, true).await;
}

#[tokio::test]
async fn openai_overflow_is_retried() {
    retry_on_overflow(OverflowStyle::OpenAi, false).await;
}

#[tokio::test]
async fn in_band_sse_overflow_is_retried() {
    retry_on_overflow(OverflowStyle::InBandSse, true).await;
}

/// An in-band overflow after a comment: the comment has gone out (and with
/// it the head), yet the retry still happens, inside the same stream, and
/// the client sees the comment, then the retry's answer, never the error.
#[tokio::test]
async fn in_band_sse_overflow_after_a_comment_is_retried_in_the_stream() {
    let mock = ChatMock::start(Settings {
        window: Some(2048),
        overflow: OverflowStyle::InBandSseAfterComment,
        ..Settings::default()
    })
    .await;
    let proxy = start_proxy(&mock.url(), &unknown_window()).await;
    let url = proxy.url();
    let mut conv = Conversation::new(600);
    for _ in 0..25 {
        let before = mock.chats().len();
        let sent = conv.ask();
        let (status, _headers, body) = post_chat(&url, chat_body("m", &sent, true), &[AUTH]).await;
        conv.answer();
        assert_eq!(status, 200);
        let chats = &mock.chats()[before..];
        if !chats[0].overflowed {
            continue;
        }
        assert_eq!(chats.len(), 2, "one failed attempt, one retry");
        assert!(!chats[1].overflowed);
        assert!(chats[1].messages().len() < sent.len());
        let text = String::from_utf8_lossy(&body);
        assert!(text.starts_with(": PROCESSING\n\n"), "{text}");
        assert!(!text.contains("error"), "client saw the overflow: {text}");
        assert!(
            !text.contains("prompt_tokens"),
            "usage reached the client: {text}"
        );
        assert!(text.ends_with("data: [DONE]\n\n"), "{text}");
        assert_eq!(metric(&url, "compactor_overflow_retries_total").await, 1.0);
        assert_eq!(
            metric(&url, "compactor_chat_requests_total{action=\"retried\"}").await,
            1.0
        );
        return;
    }
    panic!("the window was never exceeded");
}

#[tokio::test]
async fn overflow_compaction_cannot_fix_passes_the_upstream_error() {
    for style in [OverflowStyle::LlamaCpp, OverflowStyle::OpenAi] {
        let mock = ChatMock::start(Settings {
            window: Some(2048),
            overflow: style,
            ..Settings::default()
        })
        .await;
        let proxy = start_proxy(&mock.url(), &unknown_window()).await;
        // The system prompt alone overflows: it is never shortened, so
        // nothing (not even the last resort) can make the request fit.
        let huge = "word ".repeat(4000);
        let messages = vec![
            json!({"role":"system","content":huge}),
            json!({"role":"user","content":"hello"}),
        ];
        let (status, _headers, body) =
            post_chat(&proxy.url(), chat_body("m", &messages, false), &[AUTH]).await;
        let chats = mock.chats();
        assert_eq!(status, 400, "{style:?}");
        let prompt = chats[0].prompt_tokens;
        let expected = match style {
            OverflowStyle::OpenAi => openai_overflow(prompt, 2048),
            _ => llamacpp_overflow(prompt, 2048),
        };
        assert_eq!(String::from_utf8_lossy(&body), expected);
        assert!(chats.iter().all(|c| c.overflowed));
        // Nothing to compact in [system, user]: no retry is attempted.
        assert_eq!(chats.len(), 1, "{style:?}");
        assert!(mock.summaries().is_empty());
    }
}

/// An upstream whose template renders the tool schemas in a few tokens
/// (the mock counts the messages alone) while the estimate counts them in
/// full: by the estimate even the last resort cannot make the request fit,
/// yet the upstream's refusal proves the original does not. The retry cuts
/// the rows as far as they go and the upstream judges: here it answers.
#[tokio::test]
async fn overflow_retry_cuts_as_far_as_it_goes_when_the_estimate_says_nothing_fits() {
    let mock = ChatMock::start(Settings {
        window: Some(2048),
        ..Settings::default()
    })
    .await;
    let proxy = start_proxy(&mock.url(), &unknown_window()).await;
    let schema = json!({"type": "object", "properties": {"path": {"type": "string", "description": "d ".repeat(3000)}}});
    let tools = json!([{"type": "function", "function": {"name": "read_file", "description": "Read a file", "parameters": schema}}]);
    let log: String = (1..400)
        .map(|i| format!("{i:03} shard {} ok\n", i % 17))
        .collect();
    let ask = format!("Here is the log:\n{log}\nWhat failed?");
    let messages = vec![
        json!({"role": "system", "content": "You are a careful agent. ".repeat(160)}),
        json!({"role": "user", "content": ask}),
    ];
    let body = json!({"model": "m", "messages": messages, "tools": tools});
    let (status, headers, reply) =
        post_chat(&proxy.url(), serde_json::to_vec(&body).unwrap(), &[AUTH]).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&reply));
    assert_eq!(action(&headers), "retried");
    let chats = mock.chats();
    assert_eq!(chats.len(), 2, "the refused original, then the cut retry");
    assert!(chats[0].overflowed && !chats[1].overflowed);
    let sent = chats[1].messages();
    assert_eq!(sent[0], messages[0], "the system prompt is never cut");
    let cut = sent[1]["content"].as_str().unwrap();
    assert!(
        cut.contains("chars cut from the middle to fit the context window"),
        "{cut}"
    );
    assert!(
        cut.ends_with("What failed?"),
        "the ask at the end of the message is kept: {cut}"
    );
    assert_eq!(
        chats[1].json()["tools"],
        tools,
        "tools are sent as they came"
    );
    assert!(
        mock.summaries().is_empty(),
        "nothing to summarise in [system, user]"
    );
}

#[tokio::test]
async fn discovered_window_makes_compaction_proactive() {
    let mock = ChatMock::start(Settings {
        window: Some(2048),
        props_n_ctx: Some(2048),
        ..Settings::default()
    })
    .await;
    let proxy = start_proxy(&mock.url(), &unknown_window()).await;
    let url = proxy.url();
    let mut compacted = 0;
    // Two conversations on the same model: the window is discovered once.
    for session in ["a", "b"] {
        let mut conv = Conversation::new(600);
        for _ in 0..14 {
            let sent = conv.ask();
            let (status, headers, _) = post_chat(
                &url,
                chat_body("m", &sent, false),
                &[AUTH, ("x-session-id", session)],
            )
            .await;
            conv.answer();
            assert_eq!(status, 200);
            assert_ne!(action(&headers), "retried");
            compacted += usize::from(action(&headers) == "compacted");
        }
    }
    assert!(compacted > 0);
    assert!(
        mock.chats().iter().all(|c| !c.overflowed),
        "no overflow reached the upstream limit"
    );
    assert_eq!(mock.props_hits(), 1, "discovery once per (upstream, model)");
    // The probe presents the client's credential and nothing else of its.
    let probe = mock
        .seen()
        .into_iter()
        .find(|s| s.path == "/props")
        .expect("the /props probe was recorded");
    assert_eq!(probe.headers.get(AUTH.0).unwrap(), AUTH.1);
    assert!(probe.headers.get("x-session-id").is_none());
}

/// A history that compaction shrinks, under a system prompt too big for
/// the window on its own: the retry still overflows and the client gets the
/// upstream's error for the retried request.
#[tokio::test]
async fn retry_that_still_overflows_returns_the_second_error() {
    let mock = ChatMock::start(Settings {
        window: Some(2048),
        ..Settings::default()
    })
    .await;
    let proxy = start_proxy(&mock.url(), &unknown_window()).await;
    let mut conv = Conversation::new(600);
    for _ in 0..5 {
        let sent = conv.ask();
        let (st, _, _) = post_chat(&proxy.url(), chat_body("m", &sent, false), &[AUTH]).await;
        assert_eq!(st, 200);
        conv.answer();
    }
    // A system prompt too big for the window on its own: it is never
    // shortened, so neither compaction nor the last resort can make it fit.
    let mut sent = conv.messages.clone();
    sent[0] = json!({"role":"system","content":"word ".repeat(9000)});
    sent.push(json!({"role":"user","content":"and now?"}));
    let before = mock.chats().len();
    let (status, _, body) = post_chat(&proxy.url(), chat_body("m", &sent, false), &[AUTH]).await;
    let chats = mock.chats()[before..].to_vec();
    assert_eq!(status, 400);
    assert!(chats.iter().all(|c| c.overflowed));
    assert_eq!(chats.len(), 2, "one retry, with the history compacted");
    assert!(chats[1].messages().len() < sent.len());
    let last = chats.last().unwrap();
    assert_eq!(
        String::from_utf8_lossy(&body),
        llamacpp_overflow(last.prompt_tokens, 2048)
    );
    // The newest user message is never cut.
    assert_eq!(last.messages().last(), sent.last());
}

#[tokio::test]
async fn overflow_with_an_aborting_summariser_passes_the_error() {
    let mock = ChatMock::start(Settings {
        window: Some(2048),
        summary: SummaryMode::Status(401),
        ..Settings::default()
    })
    .await;
    let proxy = start_proxy(&mock.url(), &unknown_window()).await;
    let mut conv = Conversation::new(600);
    for _ in 0..20 {
        let sent = conv.ask();
        let before = mock.chats().len();
        let (status, headers, body) =
            post_chat(&proxy.url(), chat_body("m", &sent, false), &[AUTH]).await;
        conv.answer();
        if status == 200 {
            continue;
        }
        assert_eq!(status, 400);
        let chats = mock.chats()[before..].to_vec();
        assert_eq!(chats.len(), 1, "no retry without a compaction");
        assert_eq!(
            chats[0].body.as_ref(),
            chat_body("m", &sent, false).as_slice()
        );
        assert_eq!(
            String::from_utf8_lossy(&body),
            llamacpp_overflow(chats[0].prompt_tokens, 2048)
        );
        assert!(!mock.summaries().is_empty());
        assert_ne!(action(&headers), "retried");
        return;
    }
    panic!("never overflowed");
}

#[tokio::test]
async fn unreachable_upstream_is_a_502() {
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = closed.local_addr().unwrap().port();
    drop(closed);
    let proxy = start_proxy(&format!("http://127.0.0.1:{port}"), "").await;
    let body = chat_body("m", &[json!({"role":"user","content":"hi"})], false);
    let (status, _, body) = post_chat(&proxy.url(), body, &[AUTH]).await;
    assert_eq!(status, 502);
    let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert!(v["error"]["message"].is_string());
}

#[tokio::test]
async fn admin_view_counts_the_retry() {
    let mock = ChatMock::start(Settings {
        window: Some(2048),
        ..Settings::default()
    })
    .await;
    let proxy = start_proxy(&mock.url(), &unknown_window()).await;
    let mut conv = Conversation::new(600);
    for _ in 0..12 {
        let sent = conv.ask();
        let (st, h, _) = post_chat(
            &proxy.url(),
            chat_body("m", &sent, false),
            &[AUTH, ("x-session-id", "r")],
        )
        .await;
        conv.answer();
        assert_eq!(st, 200);
        if action(&h) == "retried" {
            let (_, view) = admin_view(&proxy.url(), TOKEN, &session_of(&h)).await;
            assert_eq!(view["stats"]["overflow_retries"], json!(1), "{view}");
            assert_eq!(view["window"], json!(2048), "learned from n_ctx: {view}");
            return;
        }
    }
    panic!("no retry");
}

/// A client resuming a long conversation compactor has never seen.
fn long_history(turns: usize) -> Vec<serde_json::Value> {
    let mut conv = Conversation::new(600);
    for _ in 0..turns {
        conv.ask();
        conv.answer();
    }
    conv.ask()
}

#[tokio::test]
async fn resumed_long_history_with_a_known_window_is_compacted_up_front() {
    let mock = ChatMock::start(Settings {
        window: Some(2048),
        ..Settings::default()
    })
    .await;
    let proxy = start_proxy(&mock.url(), "[models.\"m\"]\ncontext_length = 2048\n").await;
    let sent = long_history(30);
    for stream in [false, true] {
        let before = mock.chats().len();
        let (status, headers, body) =
            post_chat(&proxy.url(), chat_body("m", &sent, stream), &[AUTH]).await;
        assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
        // The second time the record made the first time is substituted.
        let expected = if stream { "passthrough" } else { "compacted" };
        assert_eq!(action(&headers), expected);
        // `x-compactor-replaced` counts an earlier turn's record, not the
        // compaction this turn made.
        assert_eq!(replaced(&headers) > 0, stream);
        let chats = mock.chats()[before..].to_vec();
        assert_eq!(chats.len(), 1);
        assert!(!chats[0].overflowed);
        assert_eq!(chats[0].messages().last(), sent.last());
        assert_tool_pairs(&chats[0].messages());
    }
}

#[tokio::test]
async fn resumed_long_history_with_an_unknown_window_is_retried() {
    let mock = ChatMock::start(Settings {
        window: Some(2048),
        ..Settings::default()
    })
    .await;
    let proxy = start_proxy(&mock.url(), &unknown_window()).await;
    let sent = long_history(30);
    let (status, headers, body) =
        post_chat(&proxy.url(), chat_body("m", &sent, true), &[AUTH]).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    assert_eq!(action(&headers), "retried");
    let chats = mock.chats();
    assert_eq!(chats.len(), 2);
    assert!(chats[0].overflowed && !chats[1].overflowed);
    assert_tool_pairs(&chats[1].messages());
}

/// After a compaction, a system prompt too big for the window: the
/// proactive compaction cannot make it fit and neither can a forced one,
/// so compactor passes the upstream's error on instead of resending the
/// same request (the recorded substitution alone is no reason to retry).
#[tokio::test]
async fn no_identical_retry_when_forced_compaction_has_nothing_left() {
    let mock = ChatMock::start(Settings {
        window: Some(2048),
        ..Settings::default()
    })
    .await;
    let proxy = start_proxy(&mock.url(), "[models.\"m\"]\ncontext_length = 2048\n").await;
    let mut conv = Conversation::new(600);
    let mut compacted = false;
    for _ in 0..12 {
        let sent = conv.ask();
        let (st, h, _) = post_chat(&proxy.url(), chat_body("m", &sent, false), &[AUTH]).await;
        conv.answer();
        assert_eq!(st, 200);
        compacted |= action(&h) == "compacted";
    }
    assert!(compacted);
    // A system prompt too big for the window on its own: it is never
    // shortened, so neither compaction nor the last resort can make it fit.
    let mut sent = conv.messages.clone();
    sent[0] = json!({"role":"system","content":"word ".repeat(9000)});
    sent.push(json!({"role":"user","content":"and now?"}));
    let before = mock.chats().len();
    let (status, _, body) = post_chat(&proxy.url(), chat_body("m", &sent, false), &[AUTH]).await;
    let chats = mock.chats()[before..].to_vec();
    assert_eq!(status, 400);
    if chats.len() == 2 {
        assert!(
            chats[0].body != chats[1].body,
            "the retry resent the same request"
        );
    }
    let last = chats.last().unwrap();
    assert_eq!(
        String::from_utf8_lossy(&body),
        llamacpp_overflow(last.prompt_tokens, 2048)
    );
}

#[tokio::test]
async fn old_llamacpp_in_band_error_field_is_retried() {
    retry_on_overflow(OverflowStyle::InBandErrorField, true).await;
}
