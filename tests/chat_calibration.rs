//! Upstreams whose tokenizer is denser than the rough chars/4 estimate:
//! calibration must carry into the engine's budgets.

mod support;

use support::chat::*;

const TOKEN: &str = "admin-secret";
const AUTH: (&str, &str) = ("authorization", "Bearer k");

fn config() -> String {
    format!("[admin]\ntoken = \"{TOKEN}\"\n[models.\"m\"]\ncontext_length = 2048\n")
}

/// Twice as many real tokens as the rough estimate (dense code, CJK text).
#[tokio::test]
async fn dense_tokenizer_stays_inside_the_window() {
    for stream in [false, true] {
        let mock = ChatMock::start(Settings {
            window: Some(2048),
            bytes_per_token: 2.0,
            ..Settings::default()
        })
        .await;
        let proxy = start_proxy(&mock.url(), &config()).await;
        let mut conv = Conversation::new(600);
        let mut key = String::new();
        for _ in 0..25 {
            let sent = conv.ask();
            let (st, h, body) =
                post_chat(&proxy.url(), chat_body("m", &sent, stream), &[AUTH]).await;
            conv.answer();
            assert_eq!(
                st,
                200,
                "turn {} ({}): {}",
                conv.turns,
                action(&h),
                String::from_utf8_lossy(&body)
            );
            assert_ne!(action(&h), "retried", "turn {}", conv.turns);
            key = session_of(&h);
        }
        let overflowed = mock.chats().iter().filter(|c| c.overflowed).count();
        assert_eq!(overflowed, 0, "stream={stream}");
        let summary_overflows = mock.summaries().iter().filter(|c| c.overflowed).count();
        assert_eq!(summary_overflows, 0, "stream={stream}");
        let (_, view) = admin_view(&proxy.url(), TOKEN, &key).await;
        let ratio = view["calibration_ratio"].as_f64().unwrap();
        assert!((1.8..2.2).contains(&ratio), "{view}");
        assert_eq!(view["window"], serde_json::json!(2048), "{view}");
        assert_eq!(view["engine_scale"], serde_json::json!(2.0), "{view}");
        let threshold = view["threshold_tokens"].as_u64().unwrap();
        assert!(threshold > 1024 && threshold < 2048, "{view}");
    }
}

/// A tokenizer so dense the window can hardly hold a compacted request:
/// some turns fail with the upstream's own error, but compactor never sends
/// the same overflowing request twice.
#[tokio::test]
async fn a_retry_is_never_the_same_request() {
    let mock = ChatMock::start(Settings {
        window: Some(2048),
        bytes_per_token: 1.5,
        ..Settings::default()
    })
    .await;
    let proxy = start_proxy(&mock.url(), &config()).await;
    let mut conv = Conversation::new(600);
    for _ in 0..25 {
        let before = mock.chats().len();
        let sent = conv.ask();
        let (st, h, body) = post_chat(&proxy.url(), chat_body("m", &sent, false), &[AUTH]).await;
        conv.answer();
        let chats = mock.chats()[before..].to_vec();
        assert!(chats.len() <= 2);
        if chats.len() == 2 {
            assert!(chats[0].body != chats[1].body, "turn {}", conv.turns);
        }
        if st != 200 {
            let last = chats.last().unwrap();
            assert_eq!(st, 400);
            assert_eq!(
                String::from_utf8_lossy(&body),
                llamacpp_overflow(last.prompt_tokens, 2048),
                "{}",
                action(&h)
            );
        }
    }
}

/// A model switch forgets the old model's calibration: the first request
/// to the new model is judged by its own size, not by the old tokenizer.
#[tokio::test]
async fn model_switch_resets_calibration() {
    let mock = ChatMock::start(Settings {
        bytes_per_token: 2.0,
        ..Settings::default()
    })
    .await;
    let proxy = start_proxy(
        &mock.url(),
        &format!("{}[models.\"m2\"]\ncontext_length = 2048\n", config()),
    )
    .await;
    let headers = [AUTH, ("x-session-id", "switch")];
    let mut conv = Conversation::new(600);
    for _ in 0..4 {
        let sent = conv.ask();
        let (st, h, _) = post_chat(&proxy.url(), chat_body("m", &sent, false), &headers).await;
        conv.answer();
        assert_eq!(st, 200);
        assert_eq!(action(&h), "passthrough");
    }
    // The new model counts 4 bytes per token: the history is ~1050 tokens,
    // far below its threshold, but ~2100 by the old model's ratio.
    mock.update(|s| s.bytes_per_token = 4.0);
    let sent = conv.ask();
    let (st, h, _) = post_chat(&proxy.url(), chat_body("m2", &sent, false), &headers).await;
    assert_eq!(st, 200);
    assert_eq!(action(&h), "passthrough");
    assert!(mock.summaries().is_empty());
    let (_, view) = admin_view(&proxy.url(), TOKEN, &session_of(&h)).await;
    let ratio = view["calibration_ratio"].as_f64().unwrap();
    assert!((0.9..1.1).contains(&ratio), "{view}");
}

/// A first request near the window, whose text tokenizes denser than
/// chars/4: with the upstream's tokenizer it is counted before it is sent
/// and compacted up front; without, it overflows once and is retried.
#[tokio::test]
async fn a_first_request_is_counted_by_the_upstream_tokenizer() {
    for tokenizer in [false, true] {
        let mock = ChatMock::start(Settings {
            window: Some(4096),
            bytes_per_token: 2.5,
            tokenizer,
            ..Settings::default()
        })
        .await;
        let proxy = start_proxy(&mock.url(), "[models.\"m\"]\ncontext_length = 4096\n").await;
        // Under the trigger by chars/4 (about 3,000 of 4,096), over the
        // window by the upstream's count (2.5 bytes a token: about 4,800).
        let mut conv = Conversation::new(600);
        let mut sent = conv.ask();
        while prompt_tokens_of(&serde_json::json!({ "messages": sent })) < 2_900 {
            conv.answer();
            sent = conv.ask();
        }
        let (st, h, body) = post_chat(&proxy.url(), chat_body("m", &sent, false), &[AUTH]).await;
        assert_eq!(st, 200, "{}", String::from_utf8_lossy(&body));
        let chats = mock.chats();
        let asked = |path: &str| mock.seen().iter().filter(|s| s.path == path).count();
        assert_eq!(asked("/apply-template"), 1, "the tokenizer was looked for");
        if tokenizer {
            assert_eq!(action(&h), "compacted");
            assert_eq!(chats.len(), 1, "sent once, inside the window");
            assert!(!chats[0].overflowed);
        } else {
            assert_eq!(action(&h), "retried", "uncounted, it overflowed first");
            assert_eq!(chats.len(), 2);
            // An upstream without a tokenizer is not asked again.
            let other = Conversation::new(700).ask();
            post_chat(&proxy.url(), chat_body("m", &other, false), &[AUTH]).await;
            assert_eq!((asked("/apply-template"), asked("/tokenize")), (1, 1));
        }
    }
}

/// A calibrated conversation of prose, far from the window's edge by the
/// estimate, whose next turn pastes a log of digits (each a token of its
/// own, as Gemma counts them): the estimate prices the paste by the prose's
/// ratio at a quarter of its cost. With the upstream's tokenizer the turn is
/// counted and compacted before it is sent; without, it overflows once and
/// is retried.
#[tokio::test]
async fn a_dense_paste_far_from_the_edge_by_the_estimate_is_counted() {
    for tokenizer in [true, false] {
        let mock = ChatMock::start(Settings {
            window: Some(4096),
            tokenizer,
            digits_are_tokens: true,
            ..Settings::default()
        })
        .await;
        let proxy = start_proxy(&mock.url(), "[models.\"m\"]\ncontext_length = 4096\n").await;
        let system =
            serde_json::json!({"role": "system", "content": "Keep to the rules. ".repeat(250)});
        let mut history = vec![system];
        for i in 0..8 {
            history.push(serde_json::json!({"role": "user", "content": format!("step {i}: {}", "check the next file. ".repeat(24))}));
            let (st, h, _) =
                post_chat(&proxy.url(), chat_body("m", &history, false), &[AUTH]).await;
            assert_eq!(st, 200);
            assert_eq!(action(&h), "passthrough", "step {i}");
            history.push(serde_json::json!({"role": "assistant", "content": "Checked."}));
        }
        let before = prompt_tokens_of(&serde_json::json!({ "messages": history }));
        // Under the trigger (~3,070) with the paste's estimate added, over
        // the window with its real count.
        assert!(
            (2_300..2_500).contains(&before),
            "{before} tokens of prose before the paste"
        );
        // 1,800 digits: ~530 tokens by the prose's ratio, ~1,880 real.
        let log = "481516234223\n".repeat(150);
        history.push(serde_json::json!({"role": "user", "content": format!("the log:\n{log}")}));
        let (st, h, body) = post_chat(&proxy.url(), chat_body("m", &history, false), &[AUTH]).await;
        assert_eq!(st, 200, "{}", String::from_utf8_lossy(&body));
        let last = mock.chats().last().cloned().unwrap();
        assert!(!last.overflowed, "the answered request fits");
        if tokenizer {
            assert_eq!(action(&h), "compacted", "counted, compacted up front");
            assert!(
                mock.chats().iter().all(|c| !c.overflowed),
                "a request overflowed"
            );
        } else {
            assert_eq!(action(&h), "retried", "uncounted, it overflowed first");
        }
    }
}

/// A calibrated conversation whose instructions fill most of the window:
/// once a request comes within a tenth of the window's edge, where the
/// estimate's margin decides whether it fits, the upstream's tokenizer
/// counts it; an upstream without one is asked once and never again.
#[tokio::test]
async fn a_request_near_the_window_edge_is_counted_by_the_upstream_tokenizer() {
    for tokenizer in [true, false] {
        let mock = ChatMock::start(Settings {
            window: Some(4096),
            tokenizer,
            ..Settings::default()
        })
        .await;
        let proxy = start_proxy(&mock.url(), "[models.\"m\"]\ncontext_length = 4096\n").await;
        let counted = || mock.seen().iter().filter(|s| s.path == "/tokenize").count();
        let system =
            serde_json::json!({"role": "system", "content": "Keep to the rules. ".repeat(560)});
        let mut history = vec![system];
        let mut near_edge = 0;
        for i in 0..14 {
            history.push(serde_json::json!({"role": "user", "content": format!("step {i}: {}", "check the next file. ".repeat(24))}));
            let tokens = prompt_tokens_of(&serde_json::json!({ "messages": history }));
            let before = counted();
            let (st, _, body) =
                post_chat(&proxy.url(), chat_body("m", &history, false), &[AUTH]).await;
            assert_eq!(st, 200, "{}", String::from_utf8_lossy(&body));
            // Clearly near the edge (within 7%) or clearly far (under 80%);
            // between the two the estimate's own error decides.
            if i > 0 && tokens * 100 >= 4096 * 93 && tokens < 4096 {
                near_edge += 1;
                if tokenizer {
                    assert_eq!(
                        counted(),
                        before + 1,
                        "turn {i} ({tokens} tokens) not counted"
                    );
                }
            } else if i > 0 && tokens * 10 < 4096 * 8 {
                assert_eq!(
                    counted(),
                    before,
                    "turn {i} ({tokens} tokens) counted far from the edge"
                );
            }
            history.push(serde_json::json!({"role": "assistant", "content": "Checked."}));
        }
        assert!(near_edge > 0, "the conversation never came near the edge");
        assert!(
            mock.chats().iter().all(|c| !c.overflowed),
            "a request overflowed"
        );
        if !tokenizer {
            assert_eq!(
                counted(),
                1,
                "an upstream without a tokenizer is asked once"
            );
        }
    }
}

/// The admin view right after the first real usage moved the scale: its
/// trigger is the one the request was judged by, in real tokens, under
/// the window (it was shown as the old rough threshold times the new
/// scale, over the window).
#[tokio::test]
async fn the_admin_trigger_stays_under_the_window_when_the_scale_moves() {
    let mock = ChatMock::start(Settings {
        bytes_per_token: 2.0,
        ..Settings::default()
    })
    .await;
    let proxy = start_proxy(&mock.url(), &config()).await;
    let mut conv = Conversation::new(600);
    let sent = conv.ask();
    let (st, h, _) = post_chat(&proxy.url(), chat_body("m", &sent, false), &[AUTH]).await;
    assert_eq!(st, 200);
    let (_, view) = admin_view(&proxy.url(), TOKEN, &session_of(&h)).await;
    assert!(view["engine_scale"].as_f64().unwrap() > 1.5, "{view}");
    let threshold = view["threshold_tokens"].as_u64().unwrap();
    assert!(threshold < 2048, "{view}");
    assert_eq!(
        view["turn_figures"][0]["trigger_tokens"],
        view["threshold_tokens"]
    );
}
