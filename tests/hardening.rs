//! Hardening regressions seen from outside: requests that used to panic a
//! request task or otherwise misbehave once state exists.

mod support;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use serde_json::{json, Value};
use support::chat::*;

const ALICE: (&str, &str) = ("authorization", "Bearer alice");

fn config() -> String {
    "[models.\"m\"]\ncontext_length = 2048\n".to_owned()
}

/// POSTs a chat body to `url` exactly (path and query) with `headers`.
async fn post_to(url: &str, body: Vec<u8>, headers: &[(&str, &str)]) -> (u16, http::HeaderMap) {
    let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build_http::<Full<Bytes>>();
    let mut req = http::Request::post(url)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body)))
        .expect("request");
    for (k, v) in headers {
        req.headers_mut().append(
            http::HeaderName::from_bytes(k.as_bytes()).expect("header name"),
            v.parse().expect("header value"),
        );
    }
    let resp = client.request(req).await.expect("response");
    let (parts, body) = resp.into_parts();
    body.collect().await.expect("body");
    (parts.status.as_u16(), parts.headers)
}

/// Runs a conversation until its first compaction (so a record exists).
async fn to_first_compaction(url: &str, headers: &[(&str, &str)]) {
    let mut conv = Conversation::new(600);
    for _ in 0..20 {
        let sent = conv.ask();
        let (st, h, _) = post_chat(url, chat_body("m", &sent, false), headers).await;
        assert_eq!(st, 200);
        if action(&h) == "compacted" {
            return;
        }
        conv.answer();
    }
    panic!("no compaction");
}

#[tokio::test]
async fn empty_messages_after_a_compaction_get_the_upstream_answer() {
    let mock = ChatMock::start(Settings::default()).await;
    let proxy = start_proxy(&mock.url(), &config()).await;
    let url = proxy.url();
    to_first_compaction(&url, &[ALICE, ("x-session-id", "a")]).await;
    let chats = mock.chats().len();
    // Same credential and session, then another session, then no session
    // header at all: every lookup path sees an empty history.
    for headers in [
        &[ALICE, ("x-session-id", "a")][..],
        &[ALICE, ("x-session-id", "b")][..],
        &[ALICE][..],
    ] {
        for stream in [false, true] {
            let mut body = json!({"model": "m", "messages": []});
            if stream {
                body["stream"] = json!(true);
            }
            let (st, _, reply) = post_chat(&url, serde_json::to_vec(&body).unwrap(), headers).await;
            assert_eq!(st, 200, "{headers:?} stream={stream}");
            assert!(
                !reply.is_empty(),
                "{headers:?} stream={stream}: empty reply"
            );
            if !stream {
                let v: Value = serde_json::from_slice(&reply).unwrap();
                assert_eq!(v["object"], "chat.completion", "{v}");
            } else {
                assert!(reply.ends_with(b"data: [DONE]\n\n"), "{reply:?}");
            }
        }
    }
    assert_eq!(mock.chats().len(), chats + 6);
    // The proxy still serves the conversation afterwards.
    let mut conv = Conversation::new(10);
    let (st, _, _) = post_chat(&url, chat_body("m", &conv.ask(), false), &[ALICE]).await;
    assert_eq!(st, 200);
}

/// Credentials sent as `?key=` scope records: another key's request with
/// the same history and session id compacts on its own instead of being
/// handed the first key's summary.
#[tokio::test]
async fn query_keys_do_not_share_records() {
    let mock = ChatMock::start(Settings::default()).await;
    let proxy = start_proxy(&mock.url(), &config()).await;
    let alice = format!("{}/v1/chat/completions?key=alice", proxy.url());
    let bob = format!("{}/v1/chat/completions?key=bob", proxy.url());
    let session = [("x-session-id", "shared")];
    let mut conv = Conversation::new(600);
    let mut sent = Vec::new();
    for _ in 0..20 {
        sent = conv.ask();
        let (st, h) = post_to(&alice, chat_body("m", &sent, false), &session).await;
        assert_eq!(st, 200);
        if action(&h) == "compacted" {
            break;
        }
        conv.answer();
    }
    let summaries = mock.summaries().len();
    assert!(summaries > 0, "alice never compacted");
    // Alice again: her record is substituted, no new summary.
    let (_, h) = post_to(&alice, chat_body("m", &sent, false), &session).await;
    assert!(substituted(&h), "{}", action(&h));
    assert_eq!(mock.summaries().len(), summaries);
    // Bob, same history and session id: never alice's record.
    let (st, h) = post_to(&bob, chat_body("m", &sent, false), &session).await;
    assert_eq!(st, 200);
    assert!(!substituted(&h), "bob was handed alice's compaction");
    assert_eq!(action(&h), "compacted");
    assert!(mock.summaries().len() > summaries);
}

#[test]
fn hash_chain_helpers_accept_an_empty_history() {
    use compactor::request::{
        common_prefix_len, extend_message_hashes, message_hashes, ChainCache,
    };
    assert!(message_hashes(&[]).is_empty());
    let mut chain = Vec::new();
    extend_message_hashes(&mut chain, &[]);
    assert!(chain.is_empty());
    let mut cache = ChainCache::new();
    assert!(cache.chain(&[]).is_empty());
    assert_eq!(common_prefix_len(&[], &[]), 0);
    assert_eq!(common_prefix_len(&[1], &[]), 0);
    let req = compactor::request::ChatRequest::parse(br#"{"messages":[]}"#.to_vec()).unwrap();
    assert!(req.messages().is_empty());
}
