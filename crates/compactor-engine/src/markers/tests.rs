//! Marker texts, summary prefixes and the handoff classifier.

use super::*;
use crate::markers;
use crate::test_support::summary_msg;

fn declared(mut m: Value) -> Value {
    declare_summary(&mut m);
    m
}

#[test]
fn compact_prefix_is_recognised_and_stripped() {
    assert!(SUMMARY_PREFIX_COMPACT.chars().count() <= 520);
    assert!(SUMMARY_PREFIX_COMPACT.starts_with(SUMMARY_HEADLINE));
    assert_eq!(summary_prefix_for(2_048), SUMMARY_PREFIX_COMPACT);
    assert_eq!(summary_prefix_for(16_384), SUMMARY_PREFIX);
    let s = standalone_content(&normalize_summary_prefix_with(
        SUMMARY_PREFIX_COMPACT,
        "BODY",
    ));
    assert_eq!(summary_body(&s), "BODY");
    let c = prepend_summary(
        &json!("do it"),
        &normalize_summary_prefix_with(SUMMARY_PREFIX_COMPACT, "B"),
    );
    match classify_handoff(&declared(json!({"role": "user", "content": c}))) {
        Handoff::Standalone { body, live } => {
            assert_eq!(body, "B");
            assert_eq!(live, Some(json!("do it")));
        }
        other => panic!("unexpected {other:?}"),
    }
    // Re-normalising swaps one prefix for the other without stacking.
    let full =
        normalize_summary_prefix(&normalize_summary_prefix_with(SUMMARY_PREFIX_COMPACT, "X"));
    assert_eq!(full, format!("{SUMMARY_PREFIX}\nX"));
}

#[test]
fn end_marker_phrases() {
    assert!(END_MARKER.contains("END OF CONTEXT SUMMARY"));
    assert!(END_MARKER.ends_with("respond to the message below, not the summary above ---"));
    assert!(SUMMARY_PREFIX.contains("Tools remain fully active"));
    assert!(SUMMARY_PREFIX.starts_with(SUMMARY_HEADLINE));
}

#[test]
fn standalone_round_trip() {
    let s = standalone_content(&normalize_summary_prefix("BODY"));
    assert_eq!(
        classify_text(&s),
        TextHandoff::Standalone {
            body: "BODY".into(),
            live: None
        }
    );
    assert_eq!(
        strip_handoff(&declared(json!({"role": "user", "content": s}))),
        None
    );
}

#[test]
fn prepended_summary_keeps_live_request() {
    let c = prepend_summary(&json!("do the thing"), &normalize_summary_prefix("B"));
    let msg = declared(json!({"role": "user", "content": c, "api_content": "stale"}));
    assert_eq!(
        strip_handoff(&msg),
        Some(json!({"role": "user", "content": "do the thing"}))
    );
    assert_eq!(summary_body(c.as_str().unwrap()), "B");
}

#[test]
fn merged_round_trip_string() {
    let c = merge_after_prior(&json!("old text\nline 2"), &normalize_summary_prefix("SUM"));
    let msg = declared(json!({"role": "assistant", "content": c}));
    match classify_handoff(&msg) {
        Handoff::Merged { prior, body, live } => {
            assert_eq!(prior, json!("old text\nline 2"));
            assert_eq!(body, "SUM");
            assert_eq!(live, None);
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(
        strip_handoff(&msg),
        Some(json!({"role": "assistant", "content": "old text\nline 2"}))
    );
}

#[test]
fn merged_round_trip_list() {
    let old = json!([{"type": "text", "text": "PRESERVED"}, {"type": "image_url", "image_url": {"url": "http://x"}}]);
    let c = merge_after_prior(&old, &normalize_summary_prefix("SUM"));
    let msg = declared(json!({"role": "user", "content": c}));
    match classify_handoff(&msg) {
        Handoff::Merged { prior, body, .. } => {
            assert_eq!(prior, old);
            assert_eq!(body, "SUM");
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn list_standalone_with_live_parts() {
    let c = prepend_summary(
        &json!([{"type": "text", "text": "live ask"}]),
        &normalize_summary_prefix("S"),
    );
    let msg = declared(json!({"role": "user", "content": c}));
    assert_eq!(
        strip_handoff(&msg),
        Some(json!({"role": "user", "content": [{"type": "text", "text": "live ask"}]}))
    );
}

/// The exact shape of a merged tail that once broke classification.
#[test]
fn spec_merged_shape_detected_and_stripped() {
    let merged = format!(
            "{PRIOR_HEADER}\nold tail content here\n\n{MERGE_DELIMITER}\n\n{SUMMARY_PREFIX}\nTHE_SUMMARY_BODY\n\n{END_MARKER}"
        );
    assert!(is_handoff(&declared(
        json!({"role": "user", "content": merged})
    )));
    assert_eq!(summary_body(&merged), "THE_SUMMARY_BODY");
    let standalone = format!("{SUMMARY_PREFIX}\nSTANDALONE_BODY\n\n{END_MARKER}");
    assert!(is_handoff(&declared(
        json!({"role": "user", "content": standalone})
    )));
    assert_eq!(summary_body(&standalone), "STANDALONE_BODY");
}

#[test]
fn legacy_prefix_recognised() {
    assert!(is_handoff(&declared(
        json!({"role": "user", "content": "[CONTEXT SUMMARY]: old stuff"})
    )));
    assert_eq!(summary_body("[CONTEXT SUMMARY]: old stuff"), "old stuff");
    assert!(!is_handoff(&declared(
        json!({"role": "user", "content": "hello [CONTEXT SUMMARY]"})
    )));
}

#[test]
fn headerless_merge_needs_exactly_one_delimiter() {
    let one = format!("x\n\n{MERGE_DELIMITER}\n\n{SUMMARY_PREFIX}\nB\n\n{END_MARKER}");
    assert!(matches!(classify_text(&one), TextHandoff::Merged { .. }));
    let two = format!("{one}\n{MERGE_DELIMITER}\n\n{SUMMARY_PREFIX}\nC");
    assert_eq!(classify_text(&two), TextHandoff::None);
}

#[test]
fn neutralized_markers_no_longer_classify() {
    let body = format!("quote: {END_MARKER} and {MERGE_DELIMITER}");
    let n = neutralize_reserved_markers(&body);
    assert!(!n.contains(END_MARKER));
    assert!(!n.contains(MERGE_DELIMITER));
    let s = standalone_content(&normalize_summary_prefix(&n));
    assert_eq!(summary_body(&s), n);
}

#[test]
fn non_summary_untouched() {
    let msg = json!({"role": "user", "content": "plain", "api_content": "keep"});
    assert_eq!(strip_handoff(&msg), Some(msg.clone()));
    assert_eq!(
        classify_handoff(&declared(json!({"role": "tool"}))),
        Handoff::None
    );
}

/// Only a declaration makes a summary: the same text in a message
/// nobody declared is ordinary content, and stripping a declared row
/// leaves no declaration behind.
#[test]
fn text_alone_is_not_a_summary() {
    let text = standalone_content(&normalize_summary_prefix("FORGED"));
    let plain = json!({"role": "user", "content": text});
    assert_eq!(classify_handoff(&plain), Handoff::None);
    assert!(!is_handoff(&plain));
    assert_eq!(strip_handoff(&plain), Some(plain.clone()));
    let merged = merge_after_prior(&json!("mine"), &normalize_summary_prefix("S"));
    let mut row = declared(json!({"role": "assistant", "content": merged}));
    assert_eq!(
        strip_handoff(&row),
        Some(json!({"role": "assistant", "content": "mine"}))
    );
    assert!(undeclare_summary(&mut row));
    assert!(!is_declared_summary(&row) && !undeclare_summary(&mut row));
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

#[test]
fn merged_tail_summary_still_detected_and_stripped() {
    use crate::markers::{classify_handoff, summary_body, Handoff, MERGE_DELIMITER, PRIOR_HEADER};
    let merged = format!(
        "{PRIOR_HEADER}\nold tail content here\n\n{MERGE_DELIMITER}\n\n{SUMMARY_PREFIX}\nTHE_SUMMARY_BODY\n\n{END_MARKER}"
    );
    assert!(!matches!(
        classify_handoff(&summary_msg("user", &merged)),
        Handoff::None
    ));
    assert_eq!(summary_body(&merged), "THE_SUMMARY_BODY");
    let standalone = format!("{SUMMARY_PREFIX}\nSTANDALONE_BODY\n\n{END_MARKER}");
    assert!(!matches!(
        classify_handoff(&summary_msg("user", &standalone)),
        Handoff::None
    ));
    assert_eq!(summary_body(&standalone), "STANDALONE_BODY");
}
