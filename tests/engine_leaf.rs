//! Reference tests for the engine's pure leaf functions, ported from the
//! spec (`test_context_compressor.py`, `test_replay_budget_accounting.py`).
//! Module names follow the reference test classes; test names are the
//! reference names minus `test_`.

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

/// `test_replay_budget_accounting.py::test_api_content_matches_wire_substitution_without_mutation`,
/// one test per parametrised case.
///
/// The reference compares against `substitute_api_content` (the agent's own
/// wire transform). The proxy has no such transform: the rule the estimator
/// mirrors is "a non-empty string `api_content` on a user/assistant row is
/// what the model reads; anything else is ignored". Each case therefore
/// states the wire content the spec's substitution yields.
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

    /// The Python default argument is `charge_stale_thinking=True`; here the
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
