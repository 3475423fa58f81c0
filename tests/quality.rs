//! Compaction quality floors (tests/quality/harness.rs; `cargo run
//! --example quality` prints the full table): planted facts must survive
//! 40-turn agent conversations at every window and strategy, summaries
//! must carry what the previous one recorded, and an agent whose fixed
//! part nearly fills a 2k window (hermes-agent on llama.cpp at n_ctx 2048)
//! must complete its run.

#![allow(clippy::unwrap_used, clippy::expect_used)]

#[path = "quality/harness.rs"]
mod harness;

use harness::{facts_in, Scenario};
use serde_json::{json, Value};

/// Facts retained (of 8) at the last turn that the engine reaches today,
/// per window; a drop below fails the test.
const FLOORS: [(u64, usize, usize); 4] = [
    // (window, batch, micro)
    // Micro at 2k: its per-exchange summaries were all cut at a 102-token
    // cap and failed, so the batch fallback kept 8/8; now they are kept at
    // the batch reply cap and the tight prompt budget shortens the running
    // summary (7/8).
    (2_048, 8, 7),
    (4_096, 8, 8),
    (8_192, 8, 8),
    (32_768, 8, 8),
];

async fn check(micro: bool) {
    for (window, batch_floor, micro_floor) in FLOORS {
        let floor = if micro { micro_floor } else { batch_floor };
        let r = harness::run(Scenario::standard(window, micro)).await;
        assert_eq!(r.facts_planted, 8);
        assert!(
            r.facts_retained >= floor,
            "window {window} micro={micro}: {}/{} retained (floor {floor}), lost {:?}",
            r.facts_retained,
            r.facts_planted,
            r.lost
        );
        assert_eq!(r.failed_requests, 0, "window {window} micro={micro}");
        assert!(r.summariser_calls > 0, "window {window}: compaction ran");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batch_retention_floors() {
    check(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn micro_retention_floors() {
    check(true).await;
}

/// What summary N recorded reaches summary N+1's prompt, through the proxy
/// over many compactions (2k window: the prompt budget is tight and the
/// running summary has to be shortened).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_summary_prompt_carries_the_previous_summary_facts() {
    let r = harness::run(Scenario::standard(2_048, false)).await;
    let batch: Vec<&(String, String)> = r
        .summary_log
        .iter()
        .filter(|(p, _)| p.starts_with("You are a summarization agent"))
        .collect();
    assert!(batch.len() >= 5, "{} summary calls", batch.len());
    let mut checked = 0;
    for pair in batch.windows(2) {
        let (_, reply) = pair[0];
        let (next_prompt, _) = pair[1];
        if !next_prompt.contains("PREVIOUS SUMMARY") {
            continue;
        }
        for f in facts_in(reply) {
            assert!(next_prompt.contains(&f), "{f} dropped between summaries");
        }
        checked += 1;
    }
    assert!(checked >= 4, "{checked}");
}

/// hermes-agent's shape at n_ctx 2048: a ~1.1k-token system prompt plus
/// ~0.5k tokens of tools, `max_tokens` 256; its tool results overflow the
/// window from the second request on, when there is nothing to summarise.
// The agent's whole run (fixtures, rounds, checks) reads best in one place.
#[allow(clippy::too_many_lines)]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_small_window_agent_with_a_large_fixed_part_completes_its_run() {
    const WINDOW: u64 = 2_048;
    if std::env::var_os("QUALITY_DEBUG").is_some() {
        let _ = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
            .try_init();
    }
    let upstream = harness::Upstream::start(WINDOW).await;
    let toml = format!("[models.\"m\"]\ncontext_length = {WINDOW}\n");
    let proxy = harness::start_proxy(&upstream.url(), &toml).await;
    let system = format!(
        "You are Hermes, an autonomous agent. {}",
        "Follow the tool protocol exactly and report results. ".repeat(72)
    );
    let tools: Vec<Value> = (0..4)
        .map(|i| {
            json!({"type": "function", "function": {"name": format!("tool_{i}"),
                "description": "Runs one operation of the agent toolkit against the workspace and returns its output as text for the next step.",
                "parameters": {"type": "object", "properties": {
                    "path": {"type": "string", "description": "Workspace path"},
                    "query": {"type": "string", "description": "What to look for"}},
                    "required": ["path"]}}})
        })
        .collect();
    let fixed = (system.len() + serde_json::to_string(&tools).unwrap().len()) / 4;
    assert!((1_250..1_500).contains(&fixed), "fixed part {fixed} tokens");
    eprintln!("fixed part: {fixed} tokens");
    let mut messages = vec![
        json!({"role": "system", "content": system}),
        json!({"role": "user", "content": "Find the failing test in the repo and tell me why it fails."}),
    ];
    let mut statuses = Vec::new();
    for round in 0..4 {
        let body = json!({"model": "m", "messages": messages, "tools": tools, "max_tokens": 256});
        let (status, _) = harness::post(&proxy.url(), body.to_string().into_bytes()).await;
        statuses.push(status.as_u16());
        let id = format!("call_{round}");
        messages.push(json!({"role": "assistant", "content": null, "tool_calls": [{"id": id,
            "type": "function", "function": {"name": "tool_0", "arguments": format!("{{\"path\":\"tests/t{round}.py\"}}")}}]}));
        let out: String = (0..40)
            .map(|l| format!("tests/t{round}.py:{l}: assert value == {l}\n"))
            .collect();
        messages.push(json!({"role": "tool", "tool_call_id": id, "content": out}));
    }
    messages.push(
        json!({"role": "assistant", "content": "The test fails because value is off by one."}),
    );
    messages.push(json!({"role": "user", "content": "Thanks. Summarise the fix in one line."}));
    let body = json!({"model": "m", "messages": messages, "tools": tools, "max_tokens": 256});
    let (status, _) = harness::post(&proxy.url(), body.to_string().into_bytes()).await;
    statuses.push(status.as_u16());
    let seen = upstream.take_seen();
    if std::env::var_os("QUALITY_DEBUG").is_some() {
        for c in &seen.chats {
            let sizes: Vec<usize> = c.iter().map(|m| m.to_string().len() / 4).collect();
            eprintln!("sent {} msgs: {sizes:?}", c.len());
        }
        eprintln!("overflows: {}", seen.overflows);
    }
    assert!(statuses.iter().all(|s| *s == 200), "{statuses:?}");

    let last = seen.chats.last().expect("a chat request");
    assert_eq!(
        last[0]["content"], messages[0]["content"],
        "system prompt sent whole"
    );
    assert_eq!(last.last(), messages.last(), "newest ask sent whole");
    assert!(
        seen.tools.iter().all(|t| t.as_ref() == Some(&json!(tools))),
        "tools untouched"
    );
    let shortened = seen.chats.iter().flatten().any(|m| {
        m["content"]
            .as_str()
            .is_some_and(|c| c.contains("chars cut from the middle to fit the context window"))
    });
    assert!(shortened, "the last resort ran");
    // Tool-call pairing holds in every request sent.
    for chat in &seen.chats {
        let mut open: Vec<&str> = Vec::new();
        for m in chat {
            if let Some(calls) = m["tool_calls"].as_array() {
                open.extend(calls.iter().filter_map(|c| c["id"].as_str()));
            }
            if m["role"] == "tool" {
                let id = m["tool_call_id"].as_str().unwrap();
                assert!(open.contains(&id), "orphan tool result {id}");
            }
        }
    }
}
