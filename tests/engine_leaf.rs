//! Ported tests of the engine's pure leaf functions (tests/REFERENCE_PARITY.md
//! maps each to its origin). Module names follow the original test classes;
//! test names are the original names minus `test_`.

// Test helpers panic on bad fixtures: that is a failed test, as in a #[test].
#![allow(clippy::unwrap_used, clippy::expect_used)]

use compactor::compaction::{args, markers, serialize, tokens, tool_summary};
use serde_json::{json, Value};

/// `TestSummarizeToolResultWebExtract`
mod summarize_tool_result_web_extract {
    use super::*;

    // >200 chars so the pruning pass actually summarizes.
    fn content() -> String {
        "x".repeat(500)
    }

    #[test]
    fn single_dict_url_is_unwrapped_not_stringified() {
        let a = json!({"urls": [{"url": "https://example.com/a", "title": "A"}]}).to_string();
        let summary = tool_summary::summarize_tool_result("web_extract", &a, &content());
        assert_eq!(summary, "[web_extract] https://example.com/a (500 chars)");
        assert!(!summary.contains('{'));
    }

    #[test]
    fn href_key_is_unwrapped() {
        let a = json!({"urls": [{"href": "https://example.com/h"}]}).to_string();
        let summary = tool_summary::summarize_tool_result("web_extract", &a, &content());
        assert_eq!(summary, "[web_extract] https://example.com/h (500 chars)");
    }
}

/// `TestTruncateToolCallArgsJson` (`test_pass3_emits_valid_json_for_downstream_provider`
/// belongs to the pipeline's prune tests).
mod truncate_tool_call_args_json {
    use super::*;

    fn shrink(s: &str) -> String {
        args::truncate_tool_call_args_json(s, args::DEFAULT_MAX_LEAF_CHARS)
    }

    #[test]
    fn shrunken_args_remain_valid_json() {
        let original = json!({
            "path": "~/.hermes/skills/shopping/browser-setup-notes.md",
            "content": format!("# Shopping Browser Setup Notes\n\n{}", "abc ".repeat(400)),
        })
        .to_string();
        assert!(original.len() > 500);
        let shrunk = shrink(&original);
        let parsed: Value = serde_json::from_str(&shrunk).unwrap();
        assert_eq!(
            parsed["path"],
            "~/.hermes/skills/shopping/browser-setup-notes.md"
        );
        assert!(parsed["content"]
            .as_str()
            .unwrap()
            .ends_with("...[truncated]"));
        assert!(shrunk.len() < original.len());
    }

    #[test]
    fn non_string_leaves_preserved() {
        let payload = json!({
            "retries": 3,
            "enabled": true,
            "timeout": null,
            "items": [1, 2, 3],
            "note": "z".repeat(500),
        })
        .to_string();
        let parsed: Value = serde_json::from_str(&shrink(&payload)).unwrap();
        assert_eq!(parsed["retries"], 3);
        assert_eq!(parsed["enabled"], true);
        assert!(parsed["timeout"].is_null());
        assert_eq!(parsed["items"], json!([1, 2, 3]));
        assert!(parsed["note"].as_str().unwrap().ends_with("...[truncated]"));
    }
}

/// `TestSummaryPrefixNormalization` (`ContextCompressor._with_summary_prefix`
/// → `markers::normalize_summary_prefix`).
mod summary_prefix_normalization {
    use super::*;
    use markers::{normalize_summary_prefix, SUMMARY_PREFIX};

    #[test]
    fn legacy_prefix_is_replaced() {
        let summary = normalize_summary_prefix("[CONTEXT SUMMARY]: did work");
        assert_eq!(summary, format!("{SUMMARY_PREFIX}\ndid work"));
    }

    #[test]
    fn existing_new_prefix_is_not_duplicated() {
        let summary = normalize_summary_prefix(&format!("{SUMMARY_PREFIX}\ndid work"));
        assert_eq!(summary, format!("{SUMMARY_PREFIX}\ndid work"));
    }
}

/// `TestSummaryPromptBounding::test_marker_does_not_collide_with_summary_classifier`
/// (`classify_summary_content` → `markers::classify_text`; `None` →
/// `TextHandoff::None`).
mod summary_prompt_bounding {
    use super::*;
    use markers::{classify_text, TextHandoff};
    use serialize::{bound_summary_input, SUMMARY_INPUT_MAX_CHARS};

    #[test]
    fn marker_does_not_collide_with_summary_classifier() {
        let cap = SUMMARY_INPUT_MAX_CHARS;
        let bounded = bound_summary_input(&"z".repeat(cap * 2), cap);
        assert!(bounded.contains("summary input truncated"));
        assert_eq!(classify_text(&bounded), TextHandoff::None);
        // Worst case: the marker lands at the start of a message.
        let at = bounded.find("\n\n...[summary input truncated").unwrap();
        let marker_only = &bounded[at..];
        assert_eq!(classify_text(marker_only.trim_start()), TextHandoff::None);
        assert!(!markers::is_handoff(
            &json!({"role": "user", "content": marker_only.trim_start()})
        ));
    }
}

/// The ported `api_content_matches_wire_substitution_without_mutation`, one
/// test per parametrised case.
///
/// The original compares against an agent-side wire transform. The proxy
/// has no such transform: the rule the estimator
/// mirrors is "a non-empty string `api_content` on a user/assistant row is
/// what the model reads; anything else is ignored". Each case therefore
/// states the wire content that substitution yields.
mod api_content_matches_wire_substitution_without_mutation {
    use super::*;

    fn check(message: Value, expected_wire_content: &str) {
        let original = message.clone();
        let t = tokens::estimate_msg_budget_tokens(&message, true);
        assert_eq!(t, tokens::estimate_text_tokens(expected_wire_content) + 10);
        assert_eq!(message, original);
    }

    #[test]
    fn user_sidecar() {
        check(
            json!({"role": "user", "content": "clean", "api_content": "wire user"}),
            "wire user",
        );
    }

    #[test]
    fn assistant_sidecar() {
        check(
            json!({"role": "assistant", "content": "clean", "api_content": "wire assistant"}),
            "wire assistant",
        );
    }

    #[test]
    fn system_role() {
        check(
            json!({"role": "system", "content": "clean", "api_content": "ignored"}),
            "clean",
        );
    }

    #[test]
    fn tool_role() {
        check(
            json!({"role": "tool", "content": "clean", "api_content": "ignored"}),
            "clean",
        );
    }

    #[test]
    fn empty_sidecar() {
        check(
            json!({"role": "user", "content": "clean", "api_content": ""}),
            "clean",
        );
    }

    #[test]
    fn non_string_sidecar() {
        check(
            json!({"role": "user", "content": "clean", "api_content": ["ignored"]}),
            "clean",
        );
    }
}

fn big_thinking() -> String {
    "deliberation ".repeat(400)
}

fn assistant(thinking: bool, codex: bool) -> Value {
    let mut msg = json!({"role": "assistant", "content": "done"});
    if thinking {
        msg["reasoning"] = json!(big_thinking());
        msg["reasoning_content"] = json!(big_thinking());
    }
    if codex {
        msg["codex_reasoning_items"] =
            json!([{"type": "reasoning", "encrypted_content": "x".repeat(4000)}]);
    }
    msg
}

/// `TestChargeStaleThinking`
mod charge_stale_thinking {
    use super::*;
    use tokens::estimate_msg_budget_tokens as est;

    #[test]
    fn stale_turn_thinking_not_charged() {
        let msg = assistant(true, false);
        let full = est(&msg, true);
        let stale = est(&msg, false);
        assert!(stale < full);
        assert!(full - stale > 300);
    }

    #[test]
    fn codex_sidecar_is_not_thinking_text() {
        let msg = assistant(false, true);
        let full = est(&msg, true);
        let stale = est(&msg, false);
        assert_eq!(stale, full);
        let bare = est(&json!({"role": "assistant", "content": "done"}), false);
        assert!(stale < bare + 100);
    }

    /// Stale thinking is charged by default; here the
    /// flag is explicit and its default lives in the config
    /// (`charge_stale_thinking: true`), mirrored by
    /// `tokens::DEFAULT_CHARGE_STALE_THINKING`.
    #[test]
    fn default_is_conservative_full_charge() {
        let msg = assistant(true, false);
        assert_eq!(
            est(&msg, tokens::DEFAULT_CHARGE_STALE_THINKING),
            est(&msg, true)
        );
        assert_ne!(est(&msg, true), est(&msg, false));
    }

    #[test]
    fn reasoning_details_text_skipped_on_stale_path() {
        let msg = json!({
            "role": "assistant",
            "content": "done",
            "reasoning_details": [{"type": "reasoning.text", "text": "long plan ".repeat(300)}],
        });
        assert!(est(&msg, false) < est(&msg, true));
    }
}

/// `TestKeyPartition`
mod key_partition {
    use super::*;
    use std::collections::BTreeSet;
    use tokens::{ALWAYS_REPLAYED_BUDGET_KEYS, NEWEST_TURN_ONLY_BUDGET_KEYS, REPLAY_BUDGET_KEYS};

    #[test]
    fn partition_covers_replay_budget_keys_exactly() {
        let always: BTreeSet<_> = ALWAYS_REPLAYED_BUDGET_KEYS.iter().collect();
        let newest: BTreeSet<_> = NEWEST_TURN_ONLY_BUDGET_KEYS.iter().collect();
        let all: BTreeSet<_> = REPLAY_BUDGET_KEYS.iter().collect();
        assert_eq!(always.union(&newest).cloned().collect::<BTreeSet<_>>(), all);
        assert!(always.is_disjoint(&newest));
    }

    #[test]
    fn codex_fields_are_always_replayed_class() {
        assert!(ALWAYS_REPLAYED_BUDGET_KEYS.contains(&"codex_reasoning_items"));
        assert!(ALWAYS_REPLAYED_BUDGET_KEYS.contains(&"codex_message_items"));
    }
}

/// Property tests over the leaf functions (our own, not ported).
mod leaf_properties {
    use super::*;
    use markers::{
        classify_handoff, merge_after_prior, normalize_summary_prefix, prepend_summary,
        standalone_content, strip_handoff, summary_body, Handoff,
    };
    use proptest::prelude::*;

    fn json_value() -> impl Strategy<Value = Value> {
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::Bool),
            any::<i64>().prop_map(|n| json!(n)),
            "[a-z é\"\\\\\n]{0,400}".prop_map(Value::String),
        ];
        leaf.prop_recursive(3, 24, 4, |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
                prop::collection::btree_map("[a-z]{1,6}", inner, 0..4)
                    .prop_map(|m| Value::Object(m.into_iter().collect())),
            ]
        })
    }

    /// Strips every string leaf to compare shapes.
    fn shape(v: &Value) -> Value {
        match v {
            Value::String(_) => json!("s"),
            Value::Array(a) => Value::Array(a.iter().map(shape).collect()),
            Value::Object(o) => {
                Value::Object(o.iter().map(|(k, x)| (k.clone(), shape(x))).collect())
            }
            other => other.clone(),
        }
    }

    /// A row declared compactor's summary (as a record declares it).
    fn declared(mut m: Value) -> Value {
        markers::declare_summary(&mut m);
        m
    }

    /// Text a user could type: never starts with a marker.
    fn text() -> impl Strategy<Value = String> {
        "[A-Za-z0-9 .,\n]{1,200}".prop_filter("non-blank", |s| !s.trim().is_empty())
    }

    proptest! {
        #[test]
        fn args_shrink_keeps_valid_json_and_shape(v in json_value()) {
            let src = v.to_string();
            let out = args::truncate_tool_call_args_json(&src, 50);
            let parsed: Value = serde_json::from_str(&out).unwrap();
            prop_assert_eq!(shape(&parsed), shape(&v));
            prop_assert!(out.len() <= src.len());
            if out != src {
                prop_assert!(out.contains("...[truncated]"));
            }
        }

        #[test]
        fn bounded_input_fits_and_keeps_both_ends(len in 0usize..20_000, cap in 200usize..5_000) {
            let text: String = (0..len).map(|i| char::from(b'a' + (i % 26) as u8)).collect();
            let out = serialize::bound_summary_input(&text, cap);
            prop_assert!(out.chars().count() <= cap.max(len.min(cap)));
            if len <= cap {
                prop_assert_eq!(out, text);
            } else {
                let head: String = text.chars().take(20).collect();
                let tail: String = text.chars().skip(len - 20).collect();
                prop_assert!(out.starts_with(&head));
                prop_assert!(out.ends_with(&tail));
                prop_assert!(matches!(markers::classify_text(&out), markers::TextHandoff::None));
            }
        }

        #[test]
        fn standalone_summary_round_trips(body in text()) {
            let s = standalone_content(&normalize_summary_prefix(&body));
            prop_assert_eq!(summary_body(&s), body.trim());
            prop_assert_eq!(strip_handoff(&declared(json!({"role": "user", "content": s}))), None);
        }

        #[test]
        fn merged_summary_unwraps_to_prior(prior in text(), body in text()) {
            let c = merge_after_prior(&json!(prior.clone()), &normalize_summary_prefix(&body));
            let msg = declared(json!({"role": "user", "content": c}));
            match classify_handoff(&msg) {
                Handoff::Merged { prior: p, body: b, live } => {
                    prop_assert_eq!(p, json!(prior.clone()));
                    prop_assert_eq!(b, body.trim());
                    prop_assert_eq!(live, None);
                }
                other => prop_assert!(false, "not merged: {:?}", other),
            }
            prop_assert_eq!(strip_handoff(&msg), Some(json!({"role": "user", "content": prior})));
        }

        #[test]
        fn prepended_summary_keeps_live_request(live in text(), body in text()) {
            let c = prepend_summary(&json!(live.clone()), &normalize_summary_prefix(&body));
            let msg = declared(json!({"role": "user", "content": c}));
            prop_assert_eq!(
                strip_handoff(&msg),
                Some(json!({"role": "user", "content": live.trim()}))
            );
        }

        #[test]
        fn plain_text_is_never_a_handoff(t in text()) {
            let msg = json!({"role": "user", "content": t});
            prop_assert!(!markers::is_handoff(&msg));
        }

        #[test]
        fn chunks_partition_turns_and_fit(
            sizes in prop::collection::vec(1usize..3_000, 0..40),
            budget in 500usize..8_000,
        ) {
            let turns: Vec<Value> = sizes
                .iter()
                .enumerate()
                .map(|(i, n)| json!({"role": if i % 2 == 0 {"user"} else {"assistant"}, "content": "x".repeat(*n)}))
                .collect();
            let chunks = serialize::chunk_for_budget(&turns, budget);
            let flat: Vec<Value> = chunks.iter().flatten().cloned().collect();
            prop_assert_eq!(&flat, &turns);
            for c in &chunks {
                prop_assert!(!c.is_empty());
                if c.len() > 1 {
                    prop_assert!(serialize::serialize_for_summary(c).chars().count() <= budget);
                }
            }
        }

        /// Arbitrary text mixed with marker fragments never panics the
        /// classifier, and stripping is stable (a stripped row is no longer a
        /// handoff, or is left exactly as it was).
        #[test]
        fn classifier_total_on_marker_soup(
            pieces in prop::collection::vec(prop_oneof![
                Just(markers::SUMMARY_PREFIX.to_string()),
                Just(markers::SUMMARY_HEADLINE.to_string()),
                Just(markers::END_MARKER.to_string()),
                Just(markers::PRIOR_HEADER.to_string()),
                Just(markers::MERGE_DELIMITER.to_string()),
                Just("\n\n".to_string()),
                "[a-zé 中\n]{0,30}",
            ], 0..8),
            as_list in any::<bool>(),
        ) {
            let text: String = pieces.concat();
            let content = if as_list {
                json!([{"type": "text", "text": text.clone()}, {"type": "image_url", "image_url": {"url": "http://i"}}])
            } else {
                json!(text.clone())
            };
            // Undeclared, no text is a summary; declared, the text decides.
            let plain = json!({"role": "user", "content": content});
            prop_assert!(!markers::is_handoff(&plain));
            prop_assert_eq!(strip_handoff(&plain), Some(plain.clone()));
            let msg = declared(plain);
            let _ = summary_body(&text);
            match strip_handoff(&msg) {
                None => prop_assert!(markers::is_handoff(&msg)),
                Some(out) => {
                    if !markers::is_handoff(&msg) {
                        prop_assert_eq!(out, msg);
                    }
                }
            }
        }

        #[test]
        fn redaction_is_idempotent_and_total(t in "[ -~\n]{0,300}", secret in "[A-Za-z0-9]{36}") {
            let once = compactor::compaction::redact::redact_secrets(&t);
            prop_assert_eq!(compactor::compaction::redact::redact_secrets(&once), once.clone());
            let with = format!("{t} ghp_{secret} {t}");
            let r = compactor::compaction::redact::redact_secrets(&with);
            let token = format!("ghp_{secret}");
            prop_assert!(!r.contains(&token));
        }

        #[test]
        fn estimates_are_monotonic_in_content(a in "[a-z ]{0,500}", b in "[a-z ]{0,500}") {
            let short = json!({"role": "user", "content": a.clone()});
            let long = json!({"role": "user", "content": format!("{a}{b}")});
            prop_assert!(tokens::estimate_msg_budget_tokens(&short, true) <= tokens::estimate_msg_budget_tokens(&long, true));
            prop_assert!(tokens::estimate_messages_tokens_rough(&[short]) <= tokens::estimate_messages_tokens_rough(&[long]));
        }
    }
}
