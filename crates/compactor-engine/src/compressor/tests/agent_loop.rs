//! Agent loops at small windows (llama.cpp 2k–8k): one task, then many tool
//! rounds with large results and an occasional short follow-up. Compaction
//! must bring every request under the trigger, keep the newest user ask
//! verbatim (exactly once) and never orphan a tool call or result, also when
//! the active turn alone outgrows the tail and has to be split.

use std::collections::HashSet;
use std::sync::Arc;

use serde_json::{json, Value};

use crate::compressor::{CompressOptions, Compressor, Outcome};
use crate::config::CompactionConfig;
use crate::markers::{self, END_MARKER, SUMMARY_PREFIX, SUMMARY_PREFIX_COMPACT};
use crate::test_support::*;
use crate::tokens::{estimate_messages_tokens_rough, estimate_tools_tokens};
use crate::trigger::{Trigger, WindowSource};
use crate::view;

const WINDOWS: [u64; 3] = [2_048, 4_096, 8_192];
const MAX_TOKENS: u64 = 16;

fn load(name: &str) -> (Vec<Value>, Value) {
    // The repository's fixtures, which `tests/engine_props.rs` reads too.
    let path = format!(
        "{}/../../tests/fixtures/{name}.json",
        env!("CARGO_MANIFEST_DIR")
    );
    let body: Value = serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap();
    (
        body["messages"].as_array().unwrap().clone(),
        body["tools"].clone(),
    )
}

fn engine(window: u64) -> Compressor {
    let cfg = Arc::new(CompactionConfig::default());
    let trigger = Trigger::new(
        cfg.clone(),
        "llama",
        WindowSource::Known(window),
        Some(MAX_TOKENS),
    );
    Compressor::new(cfg, trigger)
}

#[derive(Clone, Copy, Debug)]
enum Kind {
    Fails,
    Long,
    Short,
}

const KINDS: [Kind; 3] = [Kind::Fails, Kind::Long, Kind::Short];

/// A summariser that ignores its token target by far.
fn long_summary() -> String {
    let mut s =
        String::from("## Historical Task Snapshot\nFix the stock drift.\n\n## Completed Actions\n");
    for i in 0..400 {
        s.push_str(&format!(
            "{i}. READ src/inventory/module_{i}.py — rounding happens before merge\n"
        ));
    }
    s
}

fn summariser(kind: Kind) -> Stub {
    match kind {
        Kind::Fails => Stub::err(plain("boom")),
        Kind::Long => Stub::ok(&long_summary()),
        Kind::Short => Stub::ok("## Historical Task Snapshot\nFix the stock drift.\n\n## Completed Actions\n1. READ files"),
    }
}

fn request_tokens(msgs: &[Value], tools: &Value) -> u64 {
    estimate_messages_tokens_rough(msgs) + estimate_tools_tokens(Some(tools))
}

/// Every call has its results right after it, every result its call.
fn check_tool_pairs(msgs: &[Value]) -> Result<(), String> {
    let mut open: HashSet<String> = HashSet::new();
    for (i, m) in msgs.iter().enumerate() {
        if view::is_role(m, "tool") {
            let id = m["tool_call_id"].as_str().unwrap_or_default().to_string();
            if !open.remove(&id) {
                return Err(format!("row {i}: tool result {id} without its call"));
            }
            continue;
        }
        if !open.is_empty() {
            return Err(format!("row {i}: calls {open:?} without results"));
        }
        if let Some(calls) = m.get("tool_calls").and_then(Value::as_array) {
            for c in calls {
                open.insert(c["id"].as_str().unwrap_or_default().to_string());
            }
        }
    }
    if open.is_empty() {
        Ok(())
    } else {
        Err(format!("calls {open:?} without results at the end"))
    }
}

/// The newest human-typed ask of the original conversation.
fn newest_ask(msgs: &[Value]) -> String {
    let i = view::last_real_user(msgs, 0).expect("a user ask");
    content_str(&msgs[i])
}

/// Invariants of one compacted request; `ask` is the newest user ask.
fn check_request(out: &[Value], ask: &str, ctx: &str) {
    if let Err(e) = check_tool_pairs(out) {
        panic!("{ctx}: {e}");
    }
    assert!(view::is_role(&out[0], "system"), "{ctx}: system first");
    let first_visible = out[1..]
        .iter()
        .find(|m| !view::is_alternation_exempt(m))
        .expect("a visible row");
    assert!(
        view::is_role(first_visible, "user"),
        "{ctx}: the first visible row after the system prompt is a user turn"
    );
    // No two user or two assistant turns side by side (raw neighbours).
    for w in out.windows(2) {
        let (a, b) = (view::role(&w[0]), view::role(&w[1]));
        assert!(
            !(a == b && (a == "user" || a == "assistant")),
            "{ctx}: {a}/{b} neighbours in {:?}",
            out.iter().map(view::role).collect::<Vec<_>>()
        );
    }
    let holders: Vec<usize> = out
        .iter()
        .enumerate()
        .filter(|(_, m)| content_str(m).contains(ask))
        .map(|(i, _)| i)
        .collect();
    assert_eq!(holders.len(), 1, "{ctx}: ask held by rows {holders:?}");
    let m = &out[holders[0]];
    assert!(view::is_role(m, "user"), "{ctx}: ask not in a user row");
    let text = content_str(m);
    assert_eq!(
        text.matches(ask).count(),
        1,
        "{ctx}: ask repeated in its row"
    );
    assert!(
        text == ask || text.ends_with(&format!("{END_MARKER}\n\n{ask}")),
        "{ctx}: ask not verbatim after the summary: {:?}",
        &text[text.len().saturating_sub(200)..]
    );
    assert!(
        out.iter().filter(|m| view::is_summary(m)).count() <= 1,
        "{ctx}: more than one summary row"
    );
}

#[test]
fn fixtures_fit_under_the_threshold_at_small_windows() {
    for name in ["agent_turn8", "agent_turn16", "agent_turn30"] {
        let (msgs, tools) = load(name);
        let ask = newest_ask(&msgs);
        for window in WINDOWS {
            for kind in KINDS {
                let ctx = format!("{name} @ {window} {kind:?}");
                let mut c = engine(window);
                let threshold = c.trigger.threshold_tokens();
                // A fixture under the trigger is compacted as a forced call.
                let force = request_tokens(&msgs, &tools) <= threshold;
                let s = summariser(kind);
                let opts = CompressOptions {
                    force,
                    ..Default::default()
                };
                let res = block_on(c.compress(&msgs, &s, opts));
                assert_eq!(res.outcome, Outcome::Compacted, "{ctx}");
                let after = request_tokens(&res.messages, &tools);
                assert!(after <= threshold, "{ctx}: {after} > threshold {threshold}");
                assert!(after + MAX_TOKENS <= window, "{ctx}: no room for the reply");
                check_request(&res.messages, &ask, &ctx);
            }
        }
    }
}

#[test]
fn summaries_are_bounded_by_the_window_and_use_the_compact_prefix() {
    let (msgs, _) = load("agent_turn30");
    for window in WINDOWS {
        for kind in KINDS {
            let mut c = engine(window);
            let cap =
                4 * crate::budget::summary_budget(u64::MAX / 8, c.trigger.max_summary_tokens());
            let s = summariser(kind);
            let res = block_on(c.compress(&msgs, &s, CompressOptions::default()));
            let si = res.summary_index.expect("a summary row");
            let text = content_str(&res.messages[si]);
            assert!(
                text.contains(SUMMARY_PREFIX_COMPACT),
                "{window} {kind:?}: compact prefix"
            );
            assert!(
                !text.contains(SUMMARY_PREFIX),
                "{window} {kind:?}: full prefix"
            );
            // The summary is bounded by its cap; the user's own messages
            // kept beside it by a budget of their own.
            let (body, said) = crate::user_messages::split(&markers::summary_body(&text));
            assert!(
                body.chars().count() as u64 <= cap,
                "{window} {kind:?}: body {} chars > cap {cap}",
                body.chars().count()
            );
            let said_tokens = crate::user_messages::tokens(&said);
            assert!(
                said_tokens <= c.trigger.user_messages_budget(),
                "{window} {kind:?}: user messages take {said_tokens}"
            );
        }
    }
}

#[test]
fn large_windows_keep_the_full_prefix() {
    let (msgs, _) = load("agent_turn30");
    let mut c = engine(128_000);
    c.trigger.set_threshold_tokens(1_000);
    let res = block_on(c.compress(&msgs, &summariser(Kind::Short), CompressOptions::default()));
    assert_eq!(res.outcome, Outcome::Compacted);
    let si = res.summary_index.expect("a summary row");
    assert!(content_str(&res.messages[si]).contains(SUMMARY_PREFIX));
}

/// A tool-call round of turn `t` with a `size`-char result.
fn round(t: usize, size: usize) -> [Value; 2] {
    let id = format!("call_{t:03}");
    let tools = ["list_dir", "read_file", "search_code", "run_command"];
    let tool = tools[t % 4];
    let mut out = String::new();
    let mut k = 0usize;
    while out.len() < size {
        k += 1;
        out.push_str(&format!(
            "src/inventory/mod{}.py:{}: update_stock(batch) # rounding happens before merge {t}\n",
            (t * 7 + k) % 9,
            (k * 13) % 90 + 10
        ));
    }
    out.truncate(size);
    [
        json!({"role": "assistant", "content": format!("Step {t}: I will {tool} to check the value."),
            "tool_calls": [{"id": id, "type": "function",
                "function": {"name": tool, "arguments": format!("{{\"path\":\"src/inventory/m{t}.py\"}}")}}]}),
        json!({"role": "tool", "tool_call_id": id, "content": out}),
    ]
}

const TASK: &str = "The nightly job reports that stock levels drift after bulk imports. \
Find the cause in the inventory service, fix it, and make sure the tests pass.";

/// Grows an agent conversation for 40 turns and compacts `previous output +
/// new messages` whenever the request crosses the threshold, as the proxy
/// does. Returns how many compactions ran and the largest request sent.
fn simulate(window: u64, kind: Kind, follow_up_every: usize) -> (usize, u64) {
    let (_, tools) = load("agent_turn8");
    let mut c = engine(window);
    let threshold = c.trigger.threshold_tokens();
    let s = summariser(kind);
    let mut convo = vec![
        msg(
            "system",
            "You are Forge, a careful coding agent. Use the tools.",
        ),
        msg("user", TASK),
    ];
    let mut compactions = 0;
    let mut largest = 0;
    for t in 1..=40 {
        convo.extend(round(t, 1_500 + (t * 389) % 1_500));
        if t % follow_up_every == 0 {
            convo.push(msg(
                "user",
                &format!(
                    "Follow-up {}: also keep an eye on the retry path {t}.",
                    t / follow_up_every
                ),
            ));
        }
        let ctx = format!("{window} {kind:?} every {follow_up_every} turn {t}");
        let ask = newest_ask_any(&convo);
        let before = request_tokens(&convo, &tools);
        if before > threshold {
            let res = block_on(c.compress(&convo, &s, CompressOptions::default()));
            if matches!(res.outcome, Outcome::NoOp(_)) {
                for m in &convo {
                    let tx = content_str(m);
                    eprintln!(
                        "DBG {} {} {:?} {}",
                        view::role(m),
                        tx.len(),
                        &tx[tx.len().saturating_sub(60)..],
                        crate::tokens::estimate_msg_budget_tokens(m, false)
                    );
                }
            }
            assert!(
                !matches!(res.outcome, Outcome::NoOp(_)),
                "{ctx}: no-op at {before} tokens over threshold {threshold}: {:?}",
                res.outcome
            );
            assert_eq!(res.outcome, Outcome::Compacted, "{ctx}");
            convo = res.messages;
            compactions += 1;
        }
        let after = request_tokens(&convo, &tools);
        largest = largest.max(after);
        assert!(
            after <= threshold,
            "{ctx}: request {after} > threshold {threshold}"
        );
        assert!(
            after + MAX_TOKENS <= window,
            "{ctx}: request {after} leaves no room"
        );
        check_request(&convo, &ask, &ctx);
    }
    (compactions, largest)
}

/// The newest ask, real or carried after a summary's END marker.
fn newest_ask_any(msgs: &[Value]) -> String {
    let i = msgs
        .iter()
        .rposition(crate::compressor::cut::is_ask_row)
        .expect("an ask");
    let text = content_str(&msgs[i]);
    match text.rfind(END_MARKER) {
        Some(p) => text[p + END_MARKER.len()..].trim().to_string(),
        None => text,
    }
}

#[test]
fn forty_turn_agent_loop_always_fits() {
    for window in WINDOWS {
        for kind in KINDS {
            for every in [6, 7] {
                let (n, largest) = simulate(window, kind, every);
                assert!(n >= 2, "{window} {kind:?}: only {n} compactions");
                println!("window {window} {kind:?} follow-up every {every}: {n} compactions, largest request {largest} tokens");
            }
        }
    }
}

#[test]
fn oversized_active_turn_is_split_between_rounds() {
    // One ask followed by many big rounds: the ask is the only user row, so
    // the last-user anchor alone would leave nothing to compact.
    let mut convo = vec![msg("system", "sys"), msg("user", TASK)];
    for t in 1..=6 {
        convo.extend(round(t, 2_000));
    }
    let mut c = engine(2_048);
    c.trigger.compression_count = 1;
    let res = block_on(c.compress(&convo, &summariser(Kind::Short), CompressOptions::default()));
    assert_eq!(res.outcome, Outcome::Compacted);
    let out = &res.messages;
    let roles: Vec<&str> = out.iter().map(view::role).collect();
    assert_eq!(&roles[..3], &["system", "user", "assistant"], "{roles:?}");
    let text = content_str(&out[1]);
    assert!(text.starts_with(SUMMARY_PREFIX_COMPACT));
    assert!(text.ends_with(&format!("{END_MARKER}\n\n{TASK}")));
    // The newest round is kept verbatim, result included (an agent shown a
    // stub of its latest result repeats the call); the oldest went into the
    // summary.
    assert_eq!(&out[out.len() - 2..], &convo[convo.len() - 2..]);
    assert!(res.kept_suffix >= 2);
    assert!(!out.iter().any(|m| m["tool_call_id"] == "call_001"));
    check_tool_pairs(out).unwrap();
    // Compacting again finds the earlier summary and keeps one carrier.
    let mut again = out.clone();
    for t in 7..=9 {
        again.extend(round(t, 2_000));
    }
    let res2 = block_on(c.compress(&again, &summariser(Kind::Fails), CompressOptions::default()));
    assert_eq!(res2.outcome, Outcome::Compacted);
    check_request(&res2.messages, TASK, "second split");
    assert!(res2.messages.iter().filter(|m| view::is_summary(m)).count() == 1);
}
