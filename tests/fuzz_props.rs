//! Bounded property runs of the fuzz targets' invariants (fuzz/checks.rs):
//! the request parser and the messages replacement, the SSE scanner and
//! the usage hider, and the record lookup, on generated inputs that are
//! mostly well-formed (so the deep paths run) and on arbitrary bytes.

#[path = "../fuzz/checks.rs"]
mod checks;

use proptest::prelude::*;
use serde_json::{json, Value};

fn config() -> ProptestConfig {
    ProptestConfig {
        cases: 256,
        failure_persistence: None,
        ..ProptestConfig::default()
    }
}

// ------------------------------------------------------------------ request

fn ws() -> impl Strategy<Value = &'static str> {
    prop_oneof![Just(""), Just(" "), Just("\n  "), Just("\t"), Just("\r\n")]
}

fn scalar() -> impl Strategy<Value = String> {
    prop_oneof![
        Just("0.70".to_owned()),
        Just("18446744073709551616123".to_owned()),
        Just("-1e-7".to_owned()),
        Just("null".to_owned()),
        Just("true".to_owned()),
        Just("\"caf\\u00e9 \\\"q\\\" ]}\"".to_owned()),
        Just("{\"messages\":[1,2],\"b\":[{}]}".to_owned()),
        Just("[ ]".to_owned()),
        "[a-z\\[\\]{}:,]{0,8}"
            .prop_map(|s| serde_json::to_string(&s).expect("a string serialises")),
    ]
}

fn message() -> impl Strategy<Value = String> {
    prop_oneof![
        "[a-zA-Z ]{0,12}".prop_map(|c| json!({"role": "user", "content": c}).to_string()),
        Just(r#"{ "content" : null , "role":"assistant", "tool_calls":[{"id":"c"}] }"#.to_owned()),
        Just(r#"{"role":"tool","content":"]\"[","tool_call_id":"c"}"#.to_owned()),
        Just("\"not an object\"".to_owned()),
        Just("[]".to_owned()),
    ]
}

prop_compose! {
    /// A request body: other members around `messages` (spelled plainly or
    /// with an escape), any whitespace, and how many messages it has.
    fn body()(others in proptest::collection::vec(("[a-z_]{1,6}", scalar()), 0..5),
              at in 0usize..6,
              msgs in proptest::collection::vec(message(), 0..5),
              escaped in any::<bool>(),
              w in ws(), w2 in ws(), stream in any::<bool>())
              -> (String, usize) {
        let mut seen = std::collections::HashSet::new();
        let mut members: Vec<String> = others
            .into_iter()
            .filter(|(k, _)| !matches!(k.as_str(), "messages" | "stream" | "stream_options"))
            .filter(|(k, _)| seen.insert(k.clone()))
            .map(|(k, v)| format!("{w}\"{k}\"{w2}:{w}{v}"))
            .collect();
        let key = if escaped { "m\\u0065ssages" } else { "messages" };
        let array = format!("[{w}{}{w2}]", msgs.join(&format!("{w},{w2}")));
        members.insert(at.min(members.len()), format!("{w2}\"{key}\"{w}:{w2}{array}"));
        members.push(format!("\"stream\":{stream}"));
        (format!("{w}{{{}{w}}}{w2}", members.join(",")), msgs.len())
    }
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn request_replacement_keeps_every_byte_outside_messages((text, n) in body()) {
        let parsed = compactor::request::ChatRequest::parse(text.clone().into_bytes());
        prop_assert!(parsed.is_ok(), "{text}");
        prop_assert_eq!(parsed.unwrap().messages().len(), n);
        checks::request(text.as_bytes());
    }

    #[test]
    fn request_parser_takes_any_bytes(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
        checks::request(&bytes);
    }

    #[test]
    fn request_parser_takes_mangled_bodies((text, _) in body(), at in any::<prop::sample::Index>(), byte in any::<u8>()) {
        let mut bytes = text.into_bytes();
        let i = at.index(bytes.len());
        bytes[i] = byte;
        checks::request(&bytes);
        bytes.truncate(i);
        checks::request(&bytes);
    }
}

// ---------------------------------------------------------------------- SSE

/// One event of an OpenAI-shaped stream and whether the hider drops it.
fn sse_event() -> impl Strategy<Value = String> {
    prop_oneof![
        "[a-z ]{0,8}".prop_map(|t| format!(
            r#"data: {{"id":"c","choices":[{{"index":0,"delta":{{"content":"{t}"}},"finish_reason":null}}],"usage":null}}"#
        )),
        "[a-z ]{0,8}".prop_map(|t| format!(
            r#"data: {{"usage":null, "id":"c","choices":[{{"delta":{{"content":"{t}"}}}}]}}"#
        )),
        Just(r#"data: {"id":"c","choices":[{"index":0,"delta":{},"finish_reason":"stop"}],"usage":null}"#.to_owned()),
        (0u32..100).prop_map(|p| format!(
            r#"data: {{"id":"c","choices":[],"usage":{{"prompt_tokens":{p},"completion_tokens":3}}}}"#
        )),
        Just(r#"data: {"id":"c","choices":[{"finish_reason":"stop","delta":{}}],"usage":{"prompt_tokens":5}}"#.to_owned()),
        Just(r#"data:{"usage" : { "total_tokens" : 1 } , "choices" : [ ] }"#.to_owned()),
        Just(": keep-alive".to_owned()),
        Just("event: ping\ndata: {}".to_owned()),
        Just(r#"error: {"message":"usage"}"#.to_owned()),
        Just("data: [DONE]".to_owned()),
    ]
}

fn eol() -> impl Strategy<Value = &'static str> {
    prop_oneof![Just("\n"), Just("\r\n"), Just("\r")]
}

prop_compose! {
    fn sse_stream()(events in proptest::collection::vec((sse_event(), eol()), 0..12),
                    unterminated in any::<bool>()) -> Vec<u8> {
        let mut out = String::new();
        for (i, (e, nl)) in events.iter().enumerate() {
            out.push_str(&e.replace('\n', nl));
            out.push_str(nl);
            if !(unterminated && i + 1 == events.len()) {
                out.push_str(nl);
            }
        }
        out.into_bytes()
    }
}

/// What a client that did not ask for usage should see of one data event:
/// `None` for a usage-only chunk, else the event without its `usage` member.
fn expected_data(data: &[u8]) -> Option<Vec<u8>> {
    let Ok(Value::Object(mut m)) = serde_json::from_slice::<Value>(data) else {
        return Some(data.to_vec());
    };
    let usage = m.remove("usage");
    let choices_empty = m
        .get("choices")
        .and_then(Value::as_array)
        .is_some_and(Vec::is_empty);
    if choices_empty && usage.as_ref().is_some_and(|u| !u.is_null()) {
        return None;
    }
    Some(serde_json::to_vec(&Value::Object(m)).expect("a value serialises"))
}

/// Data events as comparable values (JSON objects compared as values).
fn normalised(events: &[checks::Event]) -> Vec<(Option<Vec<u8>>, Vec<u8>, bool)> {
    events
        .iter()
        .map(|(name, data, err)| {
            let data = match serde_json::from_slice::<Value>(data) {
                Ok(v @ Value::Object(_)) => serde_json::to_vec(&v).expect("a value serialises"),
                _ => data.clone(),
            };
            (name.clone(), data, *err)
        })
        .collect()
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn hider_output_is_the_input_minus_usage(stream in sse_stream(), cuts in proptest::collection::vec(0usize..2000, 0..6)) {
        checks::sse(&stream, &cuts);
        let parts = checks::split(&stream, &cuts);
        let out = checks::hide(&parts);
        // Valid SSE whose events are the input's minus the hidden usage.
        let want: Vec<checks::Event> = checks::scan(&[&stream])
            .into_iter()
            .filter_map(|(name, data, err)| {
                if err { return Some((name, data, err)); }
                expected_data(&data).map(|d| (name, d, err))
            })
            .collect();
        let got = checks::scan(&[&out]);
        prop_assert_eq!(normalised(&got), normalised(&want),
            "\n in: {}\nout: {}", String::from_utf8_lossy(&stream), String::from_utf8_lossy(&out));
        // Nothing is left with a usage member.
        for (_, data, err) in &got {
            if let (false, Ok(Value::Object(m))) = (*err, serde_json::from_slice::<Value>(data)) {
                prop_assert!(!m.contains_key("usage"));
            }
        }
    }

    #[test]
    fn sse_takes_any_bytes(stream in proptest::collection::vec(any::<u8>(), 0..512),
                           cuts in proptest::collection::vec(0usize..600, 0..6)) {
        checks::sse(&stream, &cuts);
    }

    #[test]
    fn sse_takes_mangled_streams(stream in sse_stream(), at in any::<prop::sample::Index>(),
                                 byte in prop_oneof![Just(b'\n'), Just(b'\r'), Just(b'"'), Just(b'{'), Just(b':'), any::<u8>()],
                                 cuts in proptest::collection::vec(0usize..2000, 0..6)) {
        let mut stream = stream;
        if !stream.is_empty() {
            let i = at.index(stream.len());
            stream[i] = byte;
        }
        checks::sse(&stream, &cuts);
    }
}

// ------------------------------------------------------------------ records

proptest! {
    #![proptest_config(config())]

    #[test]
    fn record_lookup_finds_the_longest_recorded_prefix(ops in proptest::collection::vec(any::<u8>(), 0..400)) {
        checks::records(&ops);
    }
}
