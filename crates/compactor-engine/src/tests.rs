//! Property tests over the engine's leaf functions (args, serialize,
//! markers, redact, tokens): compactor's own, not ported.

use crate::{args, markers, serialize, tokens};
use serde_json::{json, Value};

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
            let once = crate::redact::redact_secrets(&t);
            prop_assert_eq!(crate::redact::redact_secrets(&once), once.clone());
            let with = format!("{t} ghp_{secret} {t}");
            let r = crate::redact::redact_secrets(&with);
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
