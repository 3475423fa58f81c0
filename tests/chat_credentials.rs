//! Side calls made for a client (summary, token count) present the
//! credential the client authenticated with, in the form it used: an
//! upstream that takes Google-style keys (`x-goog-api-key`, `?key=`)
//! answers them as it answers the client.

mod support;

use support::chat::*;

const KEY: &str = "goog-secret-1";

fn config() -> String {
    "[models.\"m\"]\ncontext_length = 2048\n".to_owned()
}

/// Runs a conversation until it is compacted; the mock refuses any request
/// without the key. Returns the mock for inspection.
async fn compacts_with(path: &str, headers: &[(&str, &str)]) -> ChatMock {
    let mock = ChatMock::start(Settings {
        require_key: Some(KEY.into()),
        tokenizer: true,
        ..Settings::default()
    })
    .await;
    let proxy = start_proxy(&mock.url(), &config()).await;
    let mut conv = Conversation::new(600);
    let mut compacted = false;
    for _ in 0..20 {
        let sent = conv.ask();
        let (status, h, _) =
            post_path(&proxy.url(), path, chat_body("m", &sent, false), headers).await;
        assert_eq!(status, 200, "the client's own request is accepted");
        conv.answer();
        if action(&h) == "compacted" {
            compacted = true;
            break;
        }
    }
    let rejected: Vec<String> = mock
        .seen()
        .into_iter()
        .filter(|s| s.kind == Kind::Rejected)
        .map(|s| s.path)
        .collect();
    assert!(
        rejected.is_empty(),
        "side calls without the key: {rejected:?}"
    );
    assert!(compacted, "no compaction in 20 turns");
    assert!(!mock.summaries().is_empty());
    mock
}

#[tokio::test]
async fn a_client_keyed_by_x_goog_api_key_is_summarised_as_itself() {
    let mock = compacts_with("/v1/chat/completions", &[("x-goog-api-key", KEY)]).await;
    for s in mock.summaries() {
        assert_eq!(s.headers.get("x-goog-api-key").unwrap(), KEY);
    }
}

#[tokio::test]
async fn a_client_keyed_by_the_query_is_summarised_as_itself() {
    let path = format!("/v1/chat/completions?alt=json&key={KEY}");
    let mock = compacts_with(&path, &[]).await;
    let summaries = mock.summaries();
    assert!(summaries.iter().all(|s| s.path == "/v1/chat/completions"));
    // Only the credential parameter is copied onto the side calls.
    let key = format!("key={KEY}");
    for s in summaries {
        assert_eq!(s.query.as_deref(), Some(key.as_str()));
    }
    // Token counts (when the window's edge is near) present it the same way.
    for s in mock.seen() {
        if s.path == "/apply-template" || s.path == "/tokenize" {
            assert_eq!(s.query.as_deref(), Some(key.as_str()));
        }
    }
}
