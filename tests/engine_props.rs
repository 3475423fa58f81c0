//! Property tests over generated tool-using conversations: whatever the
//! shape, a compaction never orphans a tool call or result, never creates
//! user/user or assistant/assistant neighbours, keeps the system prompt and
//! the newest user text verbatim, and only commits when strictly smaller.

// Test helpers panic on bad fixtures: that is a failed test, as in a #[test].
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod engine_support;

use compactor::compaction::{
    estimate_messages_tokens_rough, is_summary, CompressOptions, MicroOutcome, Outcome,
    Strategy as EngineStrategy, END_MARKER, INFLIGHT_HEADER,
};
use engine_support::*;
use proptest::prelude::*;
use serde_json::{json, Value};
use std::collections::HashSet;

#[derive(Clone, Debug)]
struct Turn {
    user_words: usize,
    rounds: Vec<Vec<usize>>, // per round, result sizes of each parallel call
    reply_words: usize,
}

fn turn() -> impl Strategy<Value = Turn> {
    (
        1usize..40,
        prop::collection::vec(
            prop::collection::vec(prop_oneof![0usize..150, 150usize..3000], 1..4),
            0..3,
        ),
        1usize..60,
    )
        .prop_map(|(user_words, rounds, reply_words)| Turn {
            user_words,
            rounds,
            reply_words,
        })
}

fn words(n: usize, seed: usize) -> String {
    (0..n)
        .map(|i| format!("w{}", (i * 7 + seed) % 97))
        .collect::<Vec<_>>()
        .join(" ")
}

fn build(system: bool, turns: &[Turn], ends_with_user: bool) -> Vec<Value> {
    let mut v = Vec::new();
    if system {
        v.push(msg("system", "You are a careful assistant."));
    }
    let mut id = 0;
    for (t, turn) in turns.iter().enumerate() {
        v.push(msg(
            "user",
            &format!("ask {t}: {}", words(turn.user_words, t)),
        ));
        for round in &turn.rounds {
            let ids: Vec<String> = round
                .iter()
                .map(|_| {
                    id += 1;
                    format!("call_{id}")
                })
                .collect();
            let calls: Vec<Value> = ids
                .iter()
                .map(|i| json!({"id": i, "type": "function", "function": {"name": "read_file", "arguments": format!("{{\"path\":\"/src/{i}.rs\"}}")}}))
                .collect();
            v.push(json!({"role": "assistant", "content": null, "tool_calls": calls}));
            for (i, size) in ids.iter().zip(round) {
                v.push(json!({"role": "tool", "tool_call_id": i, "content": "r".repeat(*size)}));
            }
        }
        v.push(msg(
            "assistant",
            &format!("reply {t}: {}", words(turn.reply_words, t + 3)),
        ));
    }
    if ends_with_user {
        v.push(msg("user", "final question: what changed?"));
    }
    v
}

/// The newest user text survives unchanged in a user row: as the whole
/// content, as the live text after a summary's END marker (a split active
/// turn or a user-leading merge: the summary precedes it in the same row),
/// or restated after the in-flight header.
fn carries_newest(out: &[Value], newest: &str) -> bool {
    out.iter()
        .filter(|m| view::is_role(m, "user"))
        .map(content_str)
        .any(|t| {
            t == newest
                || t.ends_with(&format!("{END_MARKER}\n\n{newest}"))
                || t.ends_with(&format!("{INFLIGHT_HEADER}\n{newest}"))
        })
}

fn same_role_pairs(msgs: &[Value]) -> usize {
    msgs.windows(2)
        .filter(|w| {
            let (a, b) = (view::role(&w[0]), view::role(&w[1]));
            a == b && (a == "user" || a == "assistant")
        })
        .count()
}

fn check_tool_pairs(msgs: &[Value]) -> Result<(), String> {
    let mut open: HashSet<String> = HashSet::new();
    let mut answered: HashSet<String> = HashSet::new();
    let mut calls: Vec<String> = Vec::new();
    for m in msgs {
        if let Some(tc) = view::tool_calls(m) {
            for c in tc {
                let id = c["id"].as_str().unwrap_or("").to_string();
                open.insert(id.clone());
                calls.push(id);
            }
        } else if view::is_role(m, "tool") {
            let id = view::result_id(m).unwrap_or("").to_string();
            if !open.contains(&id) {
                return Err(format!("orphan tool result {id}"));
            }
            answered.insert(id);
        }
    }
    for c in calls {
        if !answered.contains(&c) {
            return Err(format!("tool call {c} without a result"));
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, .. ProptestConfig::default() })]

    #[test]
    fn compaction_invariants(
        system in any::<bool>(),
        turns in prop::collection::vec(turn(), 3..14),
        ends_with_user in any::<bool>(),
        first in 0usize..4,
        last in 1usize..10,
        tail_budget in 40u64..2_000,
        fail in any::<bool>(),
        compacted_before in any::<bool>(),
    ) {
        let input = build(system, &turns, ends_with_user);
        let tokens_before = estimate_messages_tokens_rough(&input);
        let mut c = compressor_with("prop-model", 100_000, |c| {
            c.protect_first_n = first;
            c.protect_last_n = last;
        });
        // Every automatic compaction runs at or over the threshold.
        c.trigger_mut().set_threshold_tokens(tokens_before.saturating_sub(1).max(1));
        c.trigger_mut().set_tail_token_budget(tail_budget);
        if compacted_before {
            restored(&mut c, 1, 0);
        }
        let s = if fail { Stub::err(plain("boom")) } else { Stub::ok("## Historical Task Snapshot\nsummary") };
        let res = block_on(c.compress(&input, &s, CompressOptions::default()));
        let out = &res.messages();

        match res.outcome() {
            Outcome::Compacted => {
                prop_assert!(res.tokens_after() < tokens_before, "not smaller: {} >= {}", res.tokens_after(), tokens_before);
                prop_assert_eq!(res.tokens_after(), estimate_messages_tokens_rough(out));
            }
            _ => prop_assert_eq!(out, &input),
        }
        if let Err(e) = check_tool_pairs(out) {
            prop_assert!(false, "{}", e);
        }
        prop_assert_eq!(same_role_pairs(&input), 0);
        prop_assert_eq!(same_role_pairs(out), 0, "same-role neighbours in {:?}", out.iter().map(view::role).collect::<Vec<_>>());
        if system {
            prop_assert_eq!(&out[0], &input[0]);
        }
        let newest = input.iter().rev().find(|m| view::is_role(m, "user")).map(content_str).unwrap();
        prop_assert!(carries_newest(out, &newest), "newest user text changed: {:?}",
            out.iter().filter(|m| view::is_role(m, "user")).map(content_str).collect::<Vec<_>>());
        // The suffix bookkeeping the proxy relies on is exact.
        let k = res.kept_suffix();
        prop_assert_eq!(&out[out.len() - k..], &input[input.len() - k..]);
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, .. ProptestConfig::default() })]

    /// The proxy's life cycle: compact, let the conversation grow, compact
    /// again. Each round keeps the invariants and at most one summary row.
    #[test]
    fn repeated_compactions_keep_one_summary(
        rounds in prop::collection::vec(prop::collection::vec(turn(), 3..8), 2..4),
        first in 0usize..4,
        tail_budget in 40u64..1_500,
    ) {
        let mut c = compressor_with("prop-model", 100_000, |c| {
            c.protect_first_n = first;
            c.protect_last_n = 3;
        });
        c.trigger_mut().set_tail_token_budget(tail_budget);
        let mut convo: Vec<Value> = Vec::new();
        for (r, turns) in rounds.iter().enumerate() {
            let mut fresh = build(r == 0, turns, false);
            // Keep ids unique across rounds.
            for m in fresh.iter_mut() {
                if let Some(calls) = m.get_mut("tool_calls").and_then(Value::as_array_mut) {
                    for tc in calls { tc["id"] = json!(format!("r{r}_{}", tc["id"].as_str().unwrap())); }
                }
                if let Some(id) = m.get("tool_call_id").and_then(Value::as_str).map(str::to_owned) {
                    m["tool_call_id"] = json!(format!("r{r}_{id}"));
                }
            }
            if convo.last().is_some_and(|m| view::is_role(m, "assistant")) {
                convo.extend(fresh);
            } else {
                convo.extend(fresh.into_iter().skip_while(|m| !view::is_role(m, "user")).skip(1));
            }
            let before = estimate_messages_tokens_rough(&convo);
            c.trigger_mut().set_threshold_tokens(before.saturating_sub(1).max(1));
            let s = Stub::ok(&format!("## Historical Task Snapshot\nround {r}"));
            let res = block_on(c.compress(&convo, &s, CompressOptions { force: true, ..Default::default() }));
            if let Err(e) = check_tool_pairs(res.messages()) {
                prop_assert!(false, "{}", e);
            }
            prop_assert!(res.messages().iter().filter(|m| is_summary(m)).count() <= 1);
            if res.outcome() == Outcome::Compacted {
                prop_assert!(res.tokens_after() < before);
                prop_assert_eq!(same_role_pairs(res.messages()), 0);
            }
            convo = res.into_messages();
        }
    }
}

fn arb_leaf() -> impl Strategy<Value = Value> {
    prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        "[a-z ]{0,30}".prop_map(Value::from),
        "\\PC{0,300}".prop_map(Value::from),
    ]
}

fn arb_message() -> impl Strategy<Value = Value> {
    let role = prop_oneof![
        Just("user"),
        Just("assistant"),
        Just("tool"),
        Just("system"),
        Just("developer"),
        Just("weird")
    ];
    let content = prop_oneof![
        arb_leaf(),
        prop::collection::vec(
            prop_oneof![
                "\\PC{0,80}".prop_map(|t| json!({"type": "text", "text": t})),
                Just(
                    json!({"type": "image_url", "image_url": {"url": "data:image/png;base64,AA"}})
                ),
                arb_leaf(),
            ],
            0..4
        )
        .prop_map(Value::from),
    ];
    let calls = prop::option::of(prop::collection::vec(
        ("[a-c]{1,2}", "\\PC{0,600}").prop_map(|(id, args)| {
            json!({"id": id, "type": "function", "function": {"name": "f", "arguments": args}})
        }),
        0..3,
    ));
    (role, content, calls, prop::option::of("[a-c]{1,2}")).prop_map(|(r, c, calls, tcid)| {
        let mut m = json!({"role": r, "content": c});
        if let Some(calls) = calls {
            m["tool_calls"] = Value::from(calls);
        }
        if let Some(id) = tcid {
            m["tool_call_id"] = Value::from(id);
        }
        m
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 128, .. ProptestConfig::default() })]

    /// Arbitrary (even malformed) message arrays never make the engine
    /// panic, and anything not committed comes back unchanged.
    #[test]
    fn arbitrary_messages_never_panic(
        msgs in prop::collection::vec(prop_oneof![9 => arb_message(), 1 => arb_leaf()], 0..40),
        force in any::<bool>(),
        fail in any::<bool>(),
        budget in 1u64..500,
    ) {
        let mut c = compressor(2, 2);
        c.trigger_mut().set_tail_token_budget(budget);
        let s = if fail { Stub::err(plain("boom")) } else { Stub::ok("sum") };
        let res = block_on(c.compress(&msgs, &s, CompressOptions { force, ..Default::default() }));
        if res.outcome() != Outcome::Compacted {
            prop_assert_eq!(&res.messages(), &msgs);
        }
        let mut m = compressor_with("prop-model", 40_960, |c| {
            c.strategy = EngineStrategy::Micro;
            c.protect_first_n = 1;
        });
        m.trigger_mut().set_tail_token_budget(budget);
        for _ in 0..3 {
            let r = block_on(m.micro_compact(&msgs, &s));
            if r.micro_outcome() != Some(MicroOutcome::Absorbed) {
                prop_assert_eq!(&r.messages(), &msgs);
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, .. ProptestConfig::default() })]

    /// Small windows: a committed compaction of a conversation over the
    /// trigger leaves room for the reply inside the window.
    #[test]
    fn small_window_compaction_fits(
        window in prop_oneof![Just(2_048u64), Just(4_096), Just(8_192), Just(32_768)],
        turns in prop::collection::vec(turn(), 3..80),
        ends_with_user in any::<bool>(),
    ) {
        let max_tokens = window / 8;
        let mut c = compressor_reserving("llama", window, max_tokens, |_| {});
        let threshold = c.trigger_mut().threshold_tokens();
        let input = build(true, &turns, ends_with_user);
        let before = estimate_messages_tokens_rough(&input);
        prop_assume!(before >= threshold);
        let s = Stub::ok("## Historical Task Snapshot\nsummary of the work").with_budget(((window - max_tokens) * 3) as usize);
        let res = block_on(c.compress(&input, &s, CompressOptions { force: true, ..Default::default() }));
        if res.outcome() == Outcome::Compacted {
            prop_assert!(res.tokens_after() + max_tokens <= window,
                "window {}: {} + {} does not fit", window, res.tokens_after(), max_tokens);
        }
    }

    /// Small windows, agent shape: one ask followed by many tool rounds (the
    /// active turn outgrows the tail and is split). Pairs, alternation and
    /// the ask's text hold, and the call never gives up with a no-op.
    #[test]
    fn small_window_agent_turn_invariants(
        window in prop_oneof![Just(2_048u64), Just(4_096), Just(8_192)],
        turns in prop::collection::vec(turn(), 1..6),
        rounds in prop::collection::vec(prop::collection::vec(200usize..3_000, 1..3), 2..14),
        compacted_before in any::<bool>(),
    ) {
        let mut c = compressor_reserving("llama", window, 16, |_| {});
        if compacted_before {
            restored(&mut c, 1, 0);
        }
        let mut input = build(true, &turns, false);
        let ask = "agent ask: find the drift and fix it";
        input.push(msg("user", ask));
        let mut id = 0;
        for round in &rounds {
            let ids: Vec<String> = round.iter().map(|_| { id += 1; format!("agent_{id}") }).collect();
            let calls: Vec<Value> = ids.iter()
                .map(|i| json!({"id": i, "type": "function", "function": {"name": "read_file", "arguments": "{}"}}))
                .collect();
            input.push(json!({"role": "assistant", "content": "step", "tool_calls": calls}));
            for (i, size) in ids.iter().zip(round) {
                input.push(json!({"role": "tool", "tool_call_id": i, "content": "r".repeat(*size)}));
            }
        }
        let s = Stub::err(plain("boom"));
        let res = block_on(c.compress(&input, &s, CompressOptions::default()));
        let out = &res.messages();
        prop_assert!(!matches!(res.outcome(), Outcome::NoOp(_)), "{:?}", res.outcome());
        if let Err(e) = check_tool_pairs(out) {
            prop_assert!(false, "{}", e);
        }
        prop_assert_eq!(same_role_pairs(out), 0, "same-role neighbours in {:?}", out.iter().map(view::role).collect::<Vec<_>>());
        prop_assert!(carries_newest(out, ask));
        let holders = out.iter().filter(|m| content_str(m).contains(ask)).count();
        prop_assert_eq!(holders, 1, "ask held by {} rows", holders);
    }
}
