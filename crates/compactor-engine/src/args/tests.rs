//! JSON-valid argument shrinking: the ported cases and compactor's own.

use super::*;
use crate::args;
use serde_json::{json, Value};

#[test]
fn key_order_kept() {
    let args = format!(r#"{{"zeta":"{}","alpha":1}}"#, "q".repeat(600));
    let out = truncate_tool_call_args_json(&args, 200);
    assert!(out.starts_with(r#"{"zeta":""#), "{out}");
    assert!(out.ends_with(r#","alpha":1}"#), "{out}");
    let parsed: serde_json::Value = serde_json::from_str(&out).unwrap();
    let z = parsed["zeta"].as_str().unwrap();
    assert!(z.starts_with(&"q".repeat(200)));
    assert!(!z.starts_with(&"q".repeat(201)));
    assert!(z.ends_with(TRUNCATION_TAG));
    assert!(z.contains("400 of 600 chars omitted"));
}

#[test]
fn invalid_json_returned_unchanged() {
    let bad = format!("{{\"a\": \"{}", "x".repeat(1000));
    assert_eq!(truncate_tool_call_args_json(&bad, 200), bad);
}

#[test]
fn nothing_to_shrink_returns_original_bytes() {
    // Spacing would change on a re-serialisation; it must not.
    let args = "{ \"a\" : \"short\",   \"b\": [1, 2] }";
    assert_eq!(truncate_tool_call_args_json(args, 200), args);
}

#[test]
fn already_truncated_leaf_is_stable() {
    let args = format!(r#"{{"c":"{}"}}"#, "w".repeat(1000));
    let once = truncate_tool_call_args_json(&args, 200);
    let twice = truncate_tool_call_args_json(&once, 200);
    assert_eq!(once, twice);
}

#[test]
fn leaf_not_replaced_unless_it_saves_bytes() {
    // 220 chars: over the limit, but the marker is longer than the saving.
    let args = format!(r#"{{"c":"{}"}}"#, "w".repeat(220));
    assert_eq!(truncate_tool_call_args_json(&args, 200), args);
}

#[test]
fn nested_and_unicode_leaves() {
    let long = "é".repeat(400);
    let args = format!(r#"{{"outer":{{"list":["{long}", 5, true, null]}}}}"#);
    let out = truncate_tool_call_args_json(&args, 200);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let s = v["outer"]["list"][0].as_str().unwrap();
    assert!(s.starts_with(&"é".repeat(200)));
    assert!(!out.contains("\\u00e9"));
    assert_eq!(v["outer"]["list"][1], 5);
    assert_eq!(v["outer"]["list"][2], true);
    assert!(v["outer"]["list"][3].is_null());
}

#[test]
fn numbers_round_trip_exactly() {
    let args = format!(
        r#"{{"f":1.5,"big":18446744073709551615,"neg":-3,"s":"{}"}}"#,
        "a".repeat(900)
    );
    let out = truncate_tool_call_args_json(&args, 200);
    assert!(out.contains(r#""f":1.5"#));
    assert!(out.contains(r#""big":18446744073709551615"#));
    assert!(out.contains(r#""neg":-3"#));
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
