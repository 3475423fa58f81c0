//! Where and how often a conversation body is parsed and decoded
//! (issue 22, big bodies): once per request, the overflow retry included,
//! and a large body on the blocking pool, never on the async workers.
//!
//! One test in its own binary: it reads the process-wide decode count
//! (`compactor::codec::decodes`), which tests running beside it would move.

// Test code: a failed unwrap is a failed test (the helpers too).
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use serde_json::{json, Value};
use support::apis::*;
use support::chat::{action, metric, post_path, start_proxy};

const KEY: (&str, &str) = ("x-api-key", "sk-ant-test");
const SESSION: (&str, &str) = ("x-claude-code-session-id", "decode");

/// A Messages body of `turns` user/assistant pairs of about 600 bytes each.
fn messages_body(model: &str, turns: usize, tag: &str) -> Vec<u8> {
    let mut messages = Vec::new();
    for i in 0..turns {
        let text = format!("{tag} turn {i}: ") + &"lorem ipsum dolor sit amet ".repeat(22);
        messages.push(json!({"role":"user","content":[{"type":"text","text":text}]}));
        messages.push(json!({"role":"assistant","content":[{"type":"text","text":text}]}));
    }
    messages.push(json!({"role":"user","content":"and now?"}));
    let body = json!({"model":model,"max_tokens":64,"system":"Be brief.","messages":messages});
    serde_json::to_vec(&body).unwrap()
}

fn inline() -> &'static str {
    "compactor_request_decodes_total{pool=\"inline\"}"
}

fn blocking() -> &'static str {
    "compactor_request_decodes_total{pool=\"blocking\"}"
}

#[tokio::test]
async fn a_request_is_decoded_once_and_a_large_one_off_the_async_workers() {
    // An upstream window the conversation outgrows; compactor does not know
    // it, so the first request past it overflows and is retried.
    let mock = ApiMock::start(ApiSettings {
        window: Some(2048),
        ..ApiSettings::default()
    })
    .await;
    let proxy = start_proxy(
        &mock.url(),
        "default_context_length = 100000\n[models.\"big\"]\ncontext_length = 100000000\n",
    )
    .await;
    let url = proxy.url();
    let start = compactor::codec::decodes();
    let mut posts = 0;
    let mut retried = false;
    for turns in 1..30 {
        let (status, headers, _) = post_path(
            &url,
            "/v1/messages",
            messages_body("m", turns, "small"),
            &[KEY, SESSION],
        )
        .await;
        posts += 1;
        assert_eq!(status, 200);
        if action(&headers) == "retried" {
            retried = true;
            break;
        }
    }
    assert!(retried, "the window was never exceeded");
    assert_eq!(
        compactor::codec::decodes() - start,
        posts,
        "one decode per request, the retry included"
    );
    assert_eq!(metric(&url, inline()).await, posts as f64);
    assert_eq!(metric(&url, blocking()).await, 0.0);

    // A body of more than 1 MiB is decoded on the blocking pool, and still
    // goes as the client's bytes when nothing changes.
    mock.update(|s| s.window = None);
    // A model whose window it fits, so nothing is compacted.
    let big = messages_body("big", 1000, "big");
    assert!(big.len() > 1 << 20);
    let before = mock.conversations().len();
    let (status, headers, _) = post_path(
        &url,
        "/v1/messages",
        big.clone(),
        &[KEY, ("x-claude-code-session-id", "big")],
    )
    .await;
    assert_eq!(status, 200);
    assert_eq!(action(&headers), "passthrough");
    let seen = &mock.conversations()[before..];
    assert_eq!(seen.len(), 1);
    assert_eq!(seen[0].body.as_ref(), big.as_slice(), "byte for byte");
    assert_eq!(metric(&url, blocking()).await, 1.0);
    assert_eq!(metric(&url, inline()).await, posts as f64);
    assert_eq!(compactor::codec::decodes() - start, posts + 1);
    let _: Value = seen[0].json();
}
