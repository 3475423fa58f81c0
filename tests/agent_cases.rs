//! Request bodies recorded from real coding agents (`tests/fixtures/agent-cases`,
//! see its README) replayed through the proxy: each is a case where an
//! earlier build spent more than the work needs.

// Test code: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::path::PathBuf;

use support::apis::{ApiMock, ApiSettings};
use support::chat::*;

const AUTH: (&str, &str) = ("authorization", "Bearer k");

fn case(path: &str) -> Vec<u8> {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/agent-cases")
        .join(path);
    std::fs::read(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

/// qwen-code rewrites its previous user message every turn (a date
/// reminder dropped from it). The turn after a counted request shares all
/// but that message and what follows with it: only the changed part is
/// uncertain, so a request under its trigger is sent as it is, not
/// compacted for the margin a request nothing of which was counted needs.
#[tokio::test]
async fn a_rewritten_earlier_message_does_not_compact_under_the_trigger() {
    let mock = ChatMock::start(Settings::default()).await;
    let proxy = start_proxy(
        &mock.url(),
        "[models.\"zoo-model\"]\ncontext_length = 9300\n",
    )
    .await;
    let r1 = case("rewritten-history/r1.json");
    let (st, h, _) = post_chat(&proxy.url(), r1, &[AUTH]).await;
    assert_eq!((st.as_u16(), action(&h)), (200, "passthrough"));
    let rewrite = case("rewritten-history/r2_rewrite.json");
    let (st, h, _) = post_chat(&proxy.url(), rewrite.clone(), &[AUTH]).await;
    assert_eq!(st, 200);
    assert_eq!(
        action(&h),
        "passthrough",
        "the rewritten turn was compacted"
    );
    // What went upstream is the client's body, byte for byte.
    assert_eq!(mock.last_chat().body, rewrite);
    assert!(mock.summaries().is_empty());
}

/// qwen-code's memory sub-agent sends the agent's own `prompt_cache_key`
/// with another system prompt and other tools: two conversations, each
/// the same session across its own turns.
#[tokio::test]
async fn a_sub_agent_under_the_agents_cache_key_is_its_own_conversation() {
    let mock = ApiMock::start(ApiSettings::default()).await;
    let proxy = start_proxy(&mock.url(), "").await;
    let mut main = Vec::new();
    let mut sub = Vec::new();
    for turn in 1..=3 {
        for (name, keys) in [("main", &mut main), ("sub", &mut sub)] {
            let body = case(&format!("shared-cache-key/{name}_{turn}.json"));
            let (st, h, b) = post_path(&proxy.url(), "/v1/responses", body, &[AUTH]).await;
            assert_eq!(st, 200, "{name}_{turn}: {}", String::from_utf8_lossy(&b));
            keys.push(session_of(&h));
        }
    }
    assert!(main.iter().all(|k| *k == main[0]), "{main:?}");
    assert!(sub.iter().all(|k| *k == sub[0]), "{sub:?}");
    assert_ne!(main[0], sub[0]);
}

/// Plays `first` (an aider chat's opening request) on, a pasted log per
/// turn, until a turn is compacted; returns the messages that went
/// upstream for that turn.
async fn play_until_compacted(
    proxy: &str,
    mock: &ChatMock,
    first: &[u8],
) -> Vec<serde_json::Value> {
    let body: serde_json::Value = serde_json::from_slice(first).unwrap();
    let mut messages = body["messages"].as_array().unwrap().clone();
    for turn in 0..16 {
        let (st, h, b) = post_chat(proxy, chat_body("zoo-model", &messages, false), &[AUTH]).await;
        assert_eq!(st, 200, "{}", String::from_utf8_lossy(&b));
        if action(&h) == "compacted" {
            return mock.last_chat().messages();
        }
        messages.push(
            serde_json::json!({"role": "assistant", "content": format!("Noted part {turn}.")}),
        );
        let log: String = (0..60)
            .map(|i| {
                format!(
                    "build[{turn}] step {i}: compiled unit_{i}.c in {} ms\n",
                    10 + i * turn
                )
            })
            .collect();
        messages.push(
            serde_json::json!({"role": "user", "content": format!("Next part of the log:\n{log}")}),
        );
    }
    panic!("no turn was compacted");
}

/// Two aider chats from one credential and model share one fingerprint
/// (aider's system prompt and few-shot head are fixed). The second chat's
/// first compaction is a first compaction all the same: its history
/// carries no summary, so its protected head (the few-shot exchange) is
/// kept as the first chat's was.
#[tokio::test]
async fn a_second_chat_with_the_same_opening_keeps_its_head() {
    let mock = ChatMock::start(Settings::default()).await;
    let proxy = start_proxy(
        &mock.url(),
        "[models.\"zoo-model\"]\ncontext_length = 8192\n",
    )
    .await;
    for chat in ["aider_chat_A.json", "aider_chat_B.json"] {
        let first = case(&format!("aider-two-chats/{chat}"));
        let opening: serde_json::Value = serde_json::from_slice(&first).unwrap();
        let head = &opening["messages"].as_array().unwrap()[..4];
        let sent = play_until_compacted(&proxy.url(), &mock, &first).await;
        assert_eq!(&sent[..4], head, "{chat}: the protected head was not kept");
    }
}

/// One recorded request: its path, its extra headers and its body.
type Recorded = (String, Vec<(String, String)>, Vec<u8>);

/// The requests of the opencode case in order, with their headers.
fn opencode_requests() -> Vec<Recorded> {
    (0..7)
        .map(|i| {
            let path =
                String::from_utf8(case(&format!("opencode-over-mark/req{i:02}.path"))).unwrap();
            let headers = String::from_utf8(case(&format!("opencode-over-mark/req{i:02}.hdr")))
                .unwrap()
                .lines()
                .filter_map(|l| l.split_once(": "))
                .map(|(n, v)| (n.to_owned(), v.to_owned()))
                .collect();
            (
                path.trim().to_owned(),
                headers,
                case(&format!("opencode-over-mark/req{i:02}.json")),
            )
        })
        .collect()
}

/// opencode at a 16,000-token window (fixed part ~7.7k, a ~1.5k paste a
/// turn): a compaction lands at its target, so the next one is turns
/// away, never on the next turn. Its recorded turns are played, then the
/// session goes on with pastes of the same size.
#[tokio::test]
async fn one_compaction_buys_several_turns() {
    let mock = ChatMock::start(Settings {
        tools_count: true,
        ..Settings::default()
    })
    .await;
    let proxy = start_proxy(
        &mock.url(),
        "[models.\"zoo-model\"]\ncontext_length = 16000\n",
    )
    .await;
    let mut actions = Vec::new();
    let mut last = serde_json::Value::Null;
    for (path, headers, body) in opencode_requests() {
        let mut h: Vec<(&str, &str)> = headers
            .iter()
            .map(|(n, v)| (n.as_str(), v.as_str()))
            .collect();
        h.push(AUTH);
        let (st, hd, b) = post_path(&proxy.url(), &path, body.clone(), &h).await;
        assert_eq!(st, 200, "{}", String::from_utf8_lossy(&b));
        actions.push(action(&hd).to_owned());
        last = serde_json::from_slice(&body).unwrap();
    }
    let paste = last["messages"].as_array().unwrap().last().unwrap()["content"].clone();
    let session = opencode_requests()[1].1.clone();
    let mut h: Vec<(&str, &str)> = session
        .iter()
        .map(|(n, v)| (n.as_str(), v.as_str()))
        .collect();
    h.push(AUTH);
    for turn in 0..8 {
        let msgs = last["messages"].as_array_mut().unwrap();
        msgs.push(
            serde_json::json!({"role": "assistant", "content": format!("Read part {turn}.")}),
        );
        let text = paste
            .as_str()
            .map(|p| format!("{turn}: {p}"))
            .unwrap_or_default();
        msgs.push(serde_json::json!({"role": "user", "content": text}));
        let body = serde_json::to_vec(&last).unwrap();
        let (st, hd, b) = post_path(&proxy.url(), "/v1/chat/completions", body, &h).await;
        assert_eq!(st, 200, "{}", String::from_utf8_lossy(&b));
        actions.push(action(&hd).to_owned());
    }
    let compacted: Vec<usize> = (0..actions.len())
        .filter(|&i| actions[i] == "compacted")
        .collect();
    assert!(!compacted.is_empty(), "{actions:?}");
    assert!(
        compacted.windows(2).all(|w| w[1] - w[0] >= 3),
        "compactions too close: {actions:?}"
    );
    assert!(mock.chats().iter().all(|c| !c.overflowed));
}
