//! Sessions end to end without the server: request parsing, keys, the
//! store and calibration across turns of two users' conversations.

// Test code: a failed unwrap is a failed test. clippy.toml allows that in
// #[test] functions only, not in the helpers they share.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use compactor::request::{ChainCache, ChatRequest};
use compactor::session::calibration::{Basis, Calibration};
use compactor::session::{SessionKeyer, SessionSource, SessionStore, StoreLimits};
use compactor::usage::inject::plan_usage;
use http::{HeaderMap, HeaderValue};
use serde_json::json;
use serde_json::value::RawValue;

#[derive(Default)]
struct State {
    calibration: Calibration,
    chain: ChainCache,
    turns: u32,
}

fn headers(auth: &str, session: Option<&str>) -> HeaderMap {
    let mut h = HeaderMap::new();
    h.insert("authorization", HeaderValue::from_str(auth).unwrap());
    if let Some(s) = session {
        h.insert("x-session-id", HeaderValue::from_str(s).unwrap());
    }
    h
}

fn body(history: &[serde_json::Value]) -> Vec<u8> {
    // Written by hand so `0.70` reaches the parser as the client wrote it.
    format!(
        r#"{{"model":"m","stream":true,"temperature":0.70,"messages":{}}}"#,
        serde_json::Value::from(history.to_vec())
    )
    .into_bytes()
}

fn rough(m: &RawValue) -> u64 {
    m.get().len() as u64 / 4 + 4
}

/// The upstream's "real" count in this simulation: 1.2 × rough + 3.
fn real(msgs: &[Box<RawValue>]) -> u64 {
    msgs.iter()
        .map(|m| (rough(m) as f64 * 1.2) as u64 + 3)
        .sum()
}

#[tokio::test(start_paused = true)]
async fn two_users_many_turns() {
    let keyer =
        SessionKeyer::with_secret(compactor::session::key::DEFAULT_SESSION_HEADERS, 7).unwrap();
    let store: SessionStore<State> = SessionStore::new(StoreLimits {
        ttl: Duration::from_secs(600),
        max_sessions: 100,
    });
    let mut histories = [
        vec![json!({"role":"system","content":"You are A."})],
        vec![json!({"role":"system","content":"You are B."})],
    ];
    // Same session header, different credentials.
    let auths = ["Bearer key-A", "Bearer key-B"];
    let mut keys = Vec::new();
    for turn in 0..6 {
        for (u, auth) in auths.iter().enumerate() {
            histories[u]
                .push(json!({"role":"user","content":format!("user {u} turn {turn} ").repeat(10)}));
            let mut req = ChatRequest::parse(body(&histories[u])).unwrap();
            let (key, source) = keyer.derive(&headers(auth, Some("shared-id")), &req);
            assert_eq!(source, SessionSource::Header("x-session-id".into()));
            if turn == 0 {
                keys.push(key);
            } else {
                assert_eq!(key, keys[u], "stable across turns");
            }
            let plan = plan_usage(&mut req);
            assert!(plan.forced);
            let out = String::from_utf8(req.to_bytes().to_vec()).unwrap();
            assert!(out.contains("\"temperature\":0.70"));
            assert!(out.ends_with(",\"stream_options\":{\"include_usage\":true}}"));

            let entry = store.get_or_create(key, State::default);
            let estimate = {
                let mut st = entry.lock().await;
                st.turns += 1;
                let msgs = req.messages().to_vec();
                let hashes = st.chain.chain(&msgs).to_vec();
                st.calibration.estimate(&msgs, hashes, 0, rough)
            };
            // ... the response streams without the lock held ...
            let actual = real(req.messages());
            if turn > 0 {
                assert!(matches!(estimate.basis, Basis::Incremental { .. }));
                let err = (estimate.tokens as f64 - actual as f64).abs() / actual as f64;
                assert!(
                    err < 0.05,
                    "user {u} turn {turn}: {} vs {actual}",
                    estimate.tokens
                );
            }
            entry
                .lock()
                .await
                .calibration
                .observe(estimate.sent, actual);
            histories[u].push(json!({"role":"assistant","content":format!("reply {turn}")}));
            tokio::time::advance(Duration::from_secs(30)).await;
        }
    }
    assert_ne!(keys[0], keys[1], "credentials isolate sessions");
    assert_eq!(store.len(), 2);
    for k in &keys {
        assert_eq!(store.peek(k).unwrap().lock().await.turns, 6);
    }
    // Idle past the TTL: swept.
    tokio::time::advance(Duration::from_secs(601)).await;
    assert_eq!(store.sweep(tokio::time::Instant::now()), 2);
    assert!(store.is_empty());
}
