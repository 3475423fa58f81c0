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

// ------------------------------------------------------------------ HTTP/1

/// A header field line a response or request may carry, the framing ones
/// and their odd spellings often.
fn field_line() -> impl Strategy<Value = String> {
    prop_oneof![
        Just("content-length: 5\r\n".to_owned()),
        Just("Content-Length: 0005\r\n".to_owned()),
        Just("content-length: 5, 5\r\n".to_owned()),
        Just("content-length: 3\r\n".to_owned()),
        Just("content-length: +5\r\n".to_owned()),
        Just("content-length: 18446744073709551616\r\n".to_owned()),
        Just("transfer-encoding: chunked\r\n".to_owned()),
        Just("Transfer-Encoding: gzip, chunked\r\n".to_owned()),
        Just("transfer-encoding: gzip\r\n".to_owned()),
        Just("connection: close, keep-alive\r\n".to_owned()),
        Just("connection: keep-alive\r\n".to_owned()),
        Just("Connection: Upgrade\r\n".to_owned()),
        Just("upgrade: websocket\r\n".to_owned()),
        Just("expect: 100-continue\r\n".to_owned()),
        Just("te: trailers\r\n".to_owned()),
        Just("host: x\r\n".to_owned()),
        Just("x_under: 1\r\n".to_owned()),
        Just("bad header\r\n".to_owned()),
        "[a-z-]{1,8}: [ -~]{0,12}\r\n",
    ]
}

prop_compose! {
    /// A response: a status line, fields, and a body that may or may not
    /// match them (chunked, sized, or cut).
    fn response_wire()(version in prop_oneof![Just("1.1"), Just("1.0")],
                       status in prop_oneof![Just(200u16), Just(204), Just(304), Just(100), Just(404)],
                       fields in proptest::collection::vec(field_line(), 0..5),
                       body in prop_oneof![
                           Just("5\r\nhello\r\n0\r\n\r\n".to_owned()),
                           Just("3;x=y\r\nabc\r\n0\r\nx-t: 1\r\n\r\n".to_owned()),
                           Just("hello".to_owned()),
                           Just("hel".to_owned()),
                           "[ -~\r\n]{0,40}",
                       ])
                       -> Vec<u8> {
        let mut wire = format!("HTTP/{version} {status} X\r\n{}\r\n{body}", fields.concat());
        if status == 100 {
            wire.push_str("HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok");
        }
        wire.into_bytes()
    }
}

prop_compose! {
    /// A request head (and body) the fast path or hyper serves, or one of
    /// the odd ones it hands over.
    fn request_wire()(method in prop_oneof![Just("GET"), Just("POST"), Just("CONNECT"), Just("OPTIONS"), Just("get")],
                      target in prop_oneof![Just("/a?b=1"), Just("*"), Just("http://x/y"), Just("x:443"), Just("/a b")],
                      version in prop_oneof![Just("1.1"), Just("1.0"), Just("2.0")],
                      fields in proptest::collection::vec(field_line(), 0..5),
                      body in "[a-z]{0,8}")
                      -> Vec<u8> {
        format!("{method} {target} HTTP/{version}\r\n{}\r\n{body}", fields.concat()).into_bytes()
    }
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn responses_decode_the_same_whatever_the_reads(wire in response_wire(),
                                                    flags in any::<u8>(),
                                                    cuts in any::<[u8; 4]>()) {
        let mut data = vec![flags];
        data.extend_from_slice(&cuts);
        data.extend_from_slice(&wire);
        checks::response(&data);
    }

    #[test]
    fn the_response_decoder_takes_any_bytes(data in proptest::collection::vec(any::<u8>(), 0..600)) {
        checks::response(&data);
    }

    #[test]
    fn the_fast_path_frames_requests_as_httparse_and_the_rules(wire in request_wire()) {
        checks::request_head(&wire);
    }

    #[test]
    fn the_fast_path_takes_any_bytes(data in proptest::collection::vec(any::<u8>(), 0..600),
                                     head in request_wire(), at in any::<prop::sample::Index>(), byte in any::<u8>()) {
        checks::request_head(&data);
        let mut mangled = head;
        let i = at.index(mangled.len());
        mangled[i] = byte;
        checks::request_head(&mangled);
    }
}

/// The cases the rules changed for (issue 49), as fixed inputs.
#[test]
fn http1_edge_cases_hold_the_checks() {
    for wire in [
        &b"\x00\x05\x05\x05\x05HTTP/1.1 200 OK\r\ncontent-length: 10\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n"[..],
        b"\x02\x01\x01\x01\x01HTTP/1.1 200 OK\r\nconnection: close, keep-alive\r\ncontent-length: 2\r\n\r\nok",
        b"\x00\x01\x01\x01\x01HTTP/1.0 200 OK\r\ntransfer-encoding: chunked\r\ncontent-length: 5\r\n\r\n1\r\nx\r\n0\r\n\r\n",
    ] {
        checks::response(wire);
    }
    for wire in [
        &b"POST /a HTTP/1.1\r\nhost: x\r\ncontent-length: 00000000000000000003\r\n\r\nabc"[..],
        b"POST /a HTTP/1.1\r\ncontent-length: 3, 3\r\n\r\nabc",
        b"GET /a HTTP/1.1\r\nconnection: keep-alive, close\r\n\r\n",
        b"OPTIONS * HTTP/1.1\r\nhost: x\r\n\r\n",
        b"CONNECT x:443 HTTP/1.1\r\nhost: x:443\r\n\r\n",
        b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
    ] {
        checks::request_head(wire);
    }
}
