//! Rough token estimates: the ported replay-budget cases and compactor's own.

use super::*;
use crate::tokens;
use serde_json::json;

#[test]
fn ascii_is_ceil_len_over_4() {
    assert_eq!(estimate_text_tokens(""), 0);
    assert_eq!(estimate_text_tokens("a"), 1);
    assert_eq!(estimate_text_tokens("abcd"), 1);
    assert_eq!(estimate_text_tokens("abcde"), 2);
}

#[test]
fn cjk_counts_one_token_per_codepoint() {
    assert_eq!(estimate_text_tokens("你好世界"), 4);
    // Cyrillic: 2 bytes per char → 8 bytes → 2 tokens.
    assert_eq!(estimate_text_tokens("привет"), 3);
    assert_eq!(estimate_text_tokens("ab你"), 2);
}

/// The byte-level scan must agree with a per-char classification.
#[test]
fn fast_scan_matches_per_char_count() {
    fn naive(s: &str) -> u64 {
        let (mut bytes, mut cjk) = (0u64, 0u64);
        for c in s.chars() {
            if is_cjk(c as u32) {
                cjk += 1;
            } else {
                bytes += c.len_utf8() as u64;
            }
        }
        cjk + bytes.div_ceil(4)
    }
    for s in [
        "plain",
        "日本語のテキスト and ascii",
        "한국어 텍스트",
        "Привет, мир! Ελληνικά العربية",
        "emoji 😀🎉 and 𠀀𠀁 (CJK ext B) ＡＢＣ full-width",
        "mixed ä ö ü 中 文 ß ∑ ≠ →",
    ] {
        assert_eq!(estimate_text_tokens(s), naive(s), "{s}");
    }
}

#[test]
fn compact_json_length_matches_serde() {
    let v = json!({"a": [1, 2, {"b": null, "c": true, "d": "xy"}], "e": -12, "f": false});
    let mut c = Counter::default();
    c.add_json(&v);
    let s = serde_json::to_string(&v).unwrap_or_default();
    assert_eq!(c.bytes, s.len() as u64);
}

#[test]
fn tool_call_envelope_is_charged_not_only_args() {
    let call = json!({"id": "call_1", "type": "function",
            "function": {"name": "read_file", "arguments": "{\"path\":\"/a\"}"}});
    let msg = json!({"role": "assistant", "content": null, "tool_calls": [call.clone()]});
    // String escapes are not charged: the model reads the unescaped text.
    let env = serde_json::to_string(&call)
        .unwrap_or_default()
        .replace("\\\"", "\"");
    assert_eq!(
        estimate_msg_budget_tokens(&msg, true),
        MESSAGE_OVERHEAD_TOKENS + estimate_text_tokens(&env)
    );
}

#[test]
fn list_content_counts_text_chars_and_image_price() {
    let msg = json!({"role": "user", "content": [
        {"type": "text", "text": "abcdefgh"},
        {"type": "image_url", "image_url": {"url": "data:..."}}
    ]});
    assert_eq!(
        estimate_msg_budget_tokens(&msg, true),
        10 + 2 + IMAGE_TOKEN_PRICE
    );
}

#[test]
fn unknown_parts_are_not_free() {
    let msg = json!({"role": "user", "content": [
        {"type": "input_audio", "input_audio": {"data": "A".repeat(4_000), "format": "wav"}}
    ]});
    assert!(estimate_msg_budget_tokens(&msg, true) > 1_000);
}

#[test]
fn wire_shadow_drops_sidecar_private_keys_and_duplicate_reasoning() {
    let plain = json!({"role": "assistant", "content": "x", "reasoning_content": "think"});
    let noisy = json!({"role": "assistant", "content": "x", "reasoning_content": "think",
            "reasoning": "think", "_private": "zzzzzzzzzzzzzzzzzzzz", "reasoning_details": [{"text": "zzzzzzzzzzzz"}]});
    assert_eq!(
        estimate_messages_tokens_rough(std::slice::from_ref(&plain)),
        estimate_messages_tokens_rough(&[noisy])
    );
    let exact = serde_json::to_string(&plain).unwrap_or_default();
    assert_eq!(
        estimate_messages_tokens_rough(&[plain]),
        estimate_text_tokens(&exact)
    );
}

#[test]
fn wire_shadow_substitutes_string_sidecar() {
    let with =
        json!({"role": "user", "content": "short", "api_content": "a much longer wire text here"});
    let wire = json!({"role": "user", "content": "a much longer wire text here"});
    assert_eq!(
        estimate_messages_tokens_rough(&[with]),
        estimate_messages_tokens_rough(&[wire])
    );
}

#[test]
fn stale_thinking_only_kept_on_newest_assistant() {
    let big = "deliberation ".repeat(400);
    let msgs = vec![
        json!({"role": "user", "content": "q"}),
        json!({"role": "assistant", "content": "a", "reasoning_content": big}),
        json!({"role": "user", "content": "q"}),
        json!({"role": "assistant", "content": "a", "reasoning_content": big}),
    ];
    let full = estimate_messages_tokens_rough_with(&msgs, true);
    let lean = estimate_messages_tokens_rough_with(&msgs, false);
    assert!(full > lean + 1_000);
    assert!(lean > 1_000);
}

#[test]
fn images_priced_in_wire_estimate() {
    let msg = json!({"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": format!("data:image/png;base64,{}", "A".repeat(100_000))}}
    ]});
    let t = estimate_messages_tokens_rough(&[msg]);
    assert!((IMAGE_TOKEN_PRICE..IMAGE_TOKEN_PRICE + 100).contains(&t));
}

#[test]
fn tools_add_name_description_and_parameters() {
    let tools = json!([{"type": "function", "function": {"name": "abcd", "description": "efgh",
            "parameters": {"type": "object"}}}]);
    // 4 + 4 + len({"type":"object"}) = 8 + 17 = 25 chars → 7 tokens.
    assert_eq!(estimate_tools_tokens(Some(&tools)), 7);
    assert_eq!(estimate_request_tokens_rough(&[], Some(&tools)), 7);
    assert_eq!(estimate_tools_tokens(None), 0);
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
