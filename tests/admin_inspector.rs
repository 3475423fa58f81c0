//! The inspector's API: `GET /_compactor/sessions` (the list), the ring of
//! turn figures in `GET /_compactor/sessions/{key}`, the content opt-in, the
//! page and the headers every admin answer carries.

mod support;

use std::time::Duration;

use serde_json::{json, Value};
use support::chat::*;

const TOKEN: &str = "admin-secret";

fn config(extra: &str) -> String {
    format!("[admin]\ntoken = \"{TOKEN}\"\n{extra}\n[models.\"m\"]\ncontext_length = 2048\n")
}

async fn list(url: &str, token: Option<&str>, query: &str) -> (u16, http::HeaderMap, Value) {
    let auth = token.map(|t| format!("Bearer {t}"));
    let headers: Vec<(&str, &str)> = auth
        .as_deref()
        .map(|a| vec![("authorization", a)])
        .unwrap_or_default();
    let (st, h, body) = get_with(&format!("{url}/_compactor/sessions{query}"), &headers).await;
    (
        st.as_u16(),
        h,
        serde_json::from_slice(&body).unwrap_or(Value::Null),
    )
}

fn keys(v: &Value) -> Vec<String> {
    v["sessions"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|s| s["session"].as_str())
        .map(str::to_owned)
        .collect()
}

/// Plays `turns` turns of a conversation under `session`; returns its key
/// and the actions.
async fn play(url: &str, session: &str, turns: usize) -> (String, Vec<String>) {
    let headers = [("authorization", "Bearer k"), ("x-session-id", session)];
    let mut c = Conversation::new(600);
    let mut key = String::new();
    let mut actions = Vec::new();
    for _ in 0..turns {
        let sent = c.ask();
        let (st, h, _) = post_chat(url, chat_body("m", &sent, false), &headers).await;
        assert_eq!(st, 200);
        c.answer();
        key = session_of(&h);
        actions.push(action(&h).to_owned());
    }
    (key, actions)
}

#[tokio::test]
async fn the_list_is_most_recent_first_bounded_and_needs_the_token() {
    let mock = ChatMock::start(Settings::default()).await;
    let proxy = start_proxy(&mock.url(), &config("")).await;
    let url = proxy.url();
    let (a, _) = play(&url, "a", 1).await;
    let (b, _) = play(&url, "b", 2).await;
    tokio::time::sleep(Duration::from_millis(5)).await;
    let (c, _) = play(&url, "c", 1).await;
    tokio::time::sleep(Duration::from_millis(5)).await;
    // `a` again: now the most recent.
    let (a2, _) = play(&url, "a", 1).await;
    assert_eq!(a, a2);

    let (st, h, v) = list(&url, Some(TOKEN), "").await;
    assert_eq!(st, 200, "{v}");
    assert_eq!(keys(&v), [a.clone(), c.clone(), b.clone()]);
    assert_eq!(v["total"], 3);
    assert_eq!(h["cache-control"], "no-store");
    assert!(h["content-security-policy"]
        .to_str()
        .unwrap()
        .contains("default-src 'none'"));
    let row = &v["sessions"][2];
    assert_eq!(row["api"], "chat");
    assert_eq!(row["model"], "m");
    assert_eq!(row["id_kind"], "header");
    assert_eq!(row["turns"], 2);
    assert_eq!(row["window"], 2048);
    assert_eq!(row["busy"], false);
    assert!(
        row["last_real_prompt_tokens"].as_u64().unwrap() > 0,
        "{row}"
    );
    assert_eq!(row["prefix_stable_share"], 1.0, "{row}");
    assert!(row.get("turn_figures").is_none(), "the list has no ring");

    let (_, _, v) = list(&url, Some(TOKEN), "?limit=2").await;
    assert_eq!(keys(&v), [a, c]);

    for token in [None, Some("wrong"), Some("admin-secre")] {
        let (st, h, v) = list(&url, token, "").await;
        assert_eq!(st, 401, "{token:?}");
        assert!(v.get("sessions").is_none());
        assert_eq!(h["cache-control"], "no-store");
    }
}

#[tokio::test]
async fn the_list_is_off_without_a_token() {
    let mock = ChatMock::start(Settings::default()).await;
    let proxy = start_proxy(&mock.url(), "").await;
    play(&proxy.url(), "a", 1).await;
    let (st, _, v) = list(&proxy.url(), Some("anything"), "").await;
    assert_eq!(st, 403);
    assert!(v.get("sessions").is_none());
}

#[tokio::test]
async fn the_view_has_one_figure_per_turn_and_the_compaction() {
    let mock = ChatMock::start(Settings::default()).await;
    let proxy = start_proxy(&mock.url(), &config("")).await;
    let url = proxy.url();
    let (key, actions) = play(&url, "long", 12).await;
    let first = actions
        .iter()
        .position(|a| a == "compacted")
        .expect("compacted");
    let (st, v) = admin_view(&url, TOKEN, &key).await;
    assert_eq!(st, 200);
    let turns = v["turn_figures"].as_array().unwrap();
    assert_eq!(turns.len(), 12);
    assert_eq!(v["turns"], 12);
    assert_eq!(turns[first]["compacted"], true, "{}", turns[first]);
    assert_eq!(
        turns.iter().filter(|t| t["compacted"] == true).count(),
        actions.iter().filter(|a| *a == "compacted").count()
    );
    // Every turn but the last has its real prompt count (the last one's
    // usage is drained by the view itself).
    assert!(turns
        .iter()
        .all(|t| t["real_prompt_tokens"].as_u64().is_some()));
    assert!(turns.iter().all(|t| t["window"] == 2048));
    let c = &v["compaction_figures"][0];
    assert_eq!(c["turn"], first as u64 + 1);
    assert_eq!(c["source"], "inline");
    assert!(c["summary_calls"].as_u64().unwrap() >= 1, "{c}");
    assert!(c["rows_after"].as_u64() < c["rows_before"].as_u64(), "{c}");
    assert!(
        c["tokens_after"].as_u64() < c["tokens_before"].as_u64(),
        "{c}"
    );
    assert!(v["summary_calls"].as_u64().unwrap() >= 1);
    // Content-free by default.
    assert_eq!(v["content"], Value::Null);
    assert!(!v.to_string().contains("MOCK-SUMMARY"));
    assert!(!v.to_string().contains("file_1.rs"));
}

#[tokio::test]
async fn content_shows_only_with_show_content() {
    let mock = ChatMock::start(Settings::default()).await;
    let proxy = start_proxy(&mock.url(), &config("show_content = true")).await;
    let url = proxy.url();
    let (key, actions) = play(&url, "long", 12).await;
    assert!(actions.iter().any(|a| a == "compacted"));
    let (_, v) = admin_view(&url, TOKEN, &key).await;
    let content = &v["content"];
    assert!(content["replaced"]["to"].as_u64().unwrap() > 0, "{content}");
    let text = content["summaries"][0]["text"].as_str().unwrap();
    assert!(text.contains("MOCK-SUMMARY"), "{text}");
    let (_, _, listed) = list(&url, Some(TOKEN), "").await;
    assert!(listed["sessions"][0].get("content").is_none());
    assert_eq!(listed["show_content"], true);
    // Still only with the token.
    let (st, _, body) = get_with(&format!("{url}/_compactor/sessions/{key}"), &[]).await;
    assert_eq!(st, 401);
    assert!(!String::from_utf8_lossy(&body).contains("MOCK-SUMMARY"));
}

#[tokio::test]
async fn the_list_does_not_wait_for_a_compacting_conversation() {
    let mock = ChatMock::start(Settings::default()).await;
    let proxy = start_proxy(&mock.url(), &config("")).await;
    let url = proxy.url();
    // Find how many turns pass before the compaction, then hold it.
    let (_, actions) = play(&url, "probe", 14).await;
    let n = actions.iter().position(|a| a == "compacted").unwrap();
    let (_, _, _) = list(&url, Some(TOKEN), "").await; // a snapshot of "probe"
    mock.update(|s| s.summary_delay = Duration::from_secs(3));
    // Another credential: the probe's records are not this one's.
    let headers = [("authorization", "Bearer k2"), ("x-session-id", "slow")];
    let mut c = Conversation::new(600);
    for _ in 0..n {
        let sent = c.ask();
        post_chat(&url, chat_body("m", &sent, false), &headers).await;
        c.answer();
    }
    let (_, _, before) = list(&url, Some(TOKEN), "").await;
    assert_eq!(before["sessions"][0]["turns"], n as u64);
    let summaries_before = mock.summaries().len();
    let sent = c.ask();
    let (u, body) = (url.clone(), chat_body("m", &sent, false));
    let compacting = tokio::spawn(async move {
        post_chat(
            &u,
            body,
            &[("authorization", "Bearer k2"), ("x-session-id", "slow")],
        )
        .await
    });
    // The summary call is held; the list answers at once, from the snapshot.
    for _ in 0..500 {
        if mock.summaries().len() > summaries_before {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(mock.summaries().len() > summaries_before, "no summary call");
    let (st, _, during) = tokio::time::timeout(Duration::from_secs(2), list(&url, Some(TOKEN), ""))
        .await
        .expect("the list waited for the compaction");
    assert_eq!(st, 200);
    let row = &during["sessions"][0];
    assert_eq!(row["busy"], true, "{row}");
    assert_eq!(row["turns"], n as u64, "the last figures kept: {row}");
    let (_, h, _) = compacting.await.unwrap();
    assert_eq!(action(&h), "compacted");
    let (_, _, after) = list(&url, Some(TOKEN), "").await;
    assert_eq!(after["sessions"][0]["busy"], false);
    assert_eq!(after["sessions"][0]["turns"], n as u64 + 1);
    assert_eq!(after["sessions"][0]["compactions"], 1);
}

#[tokio::test]
async fn the_page_is_served_with_a_strict_policy_and_says_when_it_is_off() {
    let mock = ChatMock::start(Settings::default()).await;
    let on = start_proxy(&mock.url(), &config("")).await;
    let off = start_proxy(&mock.url(), "").await;
    let (st, h, body) = get_with(&format!("{}/_compactor/ui", on.url()), &[]).await;
    assert_eq!(st, 200);
    let page = String::from_utf8_lossy(&body);
    assert!(page.contains("/_compactor/ui/app.js"));
    assert_eq!(h["cache-control"], "no-store");
    let csp = h["content-security-policy"].to_str().unwrap();
    for part in [
        "default-src 'none'",
        "script-src 'self'",
        "connect-src 'self'",
    ] {
        assert!(csp.contains(part), "{csp}");
    }
    assert!(!csp.contains("unsafe-inline"));
    let (st, h, _) = get_with(
        &format!("{}/_compactor/ui/vendor/uPlot.iife.min.js", on.url()),
        &[],
    )
    .await;
    assert_eq!(st, 200);
    assert!(h["content-type"]
        .to_str()
        .unwrap()
        .starts_with("text/javascript"));
    let (st, _, body) = get_with(&format!("{}/_compactor/ui", off.url()), &[]).await;
    assert_eq!(st, 200);
    let page = String::from_utf8_lossy(&body);
    assert!(page.contains("inspector is disabled") && page.contains("[admin]"));
    assert!(!page.contains("app.js"));
    let _ = json!(null);
}
