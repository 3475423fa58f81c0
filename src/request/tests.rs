//! The byte-preserving request view: parsing, spans, splicing, the hash
//! chains; and its properties over arbitrary members (proptest).

use super::*;

fn raw(s: &str) -> Box<RawValue> {
    RawValue::from_string(s.to_owned()).unwrap()
}

const BODY: &str = r#"{"model":"gpt-4o", "temperature":0.70,"seed":18446744073709551616123,
  "x_unknown":{"b":1,"a":[1, 2]},"stream":true,"messages":[{"role":"system","content":"S"}, {"role":"user","content":"hi"}],"max_tokens":100}"#;

#[test]
fn unchanged_body_is_returned_as_is() {
    let r = ChatRequest::parse(BODY.as_bytes().to_vec()).unwrap();
    assert!(!r.is_modified());
    assert_eq!(r.to_bytes(), BODY.as_bytes());
}

#[test]
fn accessors_read_fields() {
    let r = ChatRequest::parse(BODY.as_bytes().to_vec()).unwrap();
    assert_eq!(r.model().as_deref(), Some("gpt-4o"));
    assert!(r.stream());
    assert_eq!(r.max_output_tokens(), Some(100));
    assert_eq!(r.messages().len(), 2);
    assert!(!r.client_wants_usage());
    assert_eq!(r.session_id(), None);
    let r2 = ChatRequest::parse(
            br#"{"messages":[],"max_tokens":5,"max_completion_tokens":7,"session_id":"s1","prompt_cache_key":"p1","stream_options":{"include_usage":true}}"#.to_vec(),
        )
        .unwrap();
    assert_eq!(r2.max_output_tokens(), Some(7));
    assert_eq!(r2.session_id().as_deref(), Some("s1"));
    assert_eq!(r2.prompt_cache_key().as_deref(), Some("p1"));
    assert!(r2.client_wants_usage());
    assert!(!r2.stream());
}

#[test]
fn replacing_messages_keeps_every_other_byte() {
    let mut r = ChatRequest::parse(BODY.as_bytes().to_vec()).unwrap();
    r.with_messages(vec![raw(r#"{"role":"user","content":"x"}"#)]);
    let out = String::from_utf8(r.to_bytes().to_vec()).unwrap();
    let expected = r#"{"model":"gpt-4o", "temperature":0.70,"seed":18446744073709551616123,
  "x_unknown":{"b":1,"a":[1, 2]},"stream":true,"messages":[{"role":"user","content":"x"}],"max_tokens":100}"#;
    assert_eq!(out, expected);
}

#[test]
fn include_usage_is_appended_when_streaming() {
    let mut r = ChatRequest::parse(BODY.as_bytes().to_vec()).unwrap();
    assert!(r.force_include_usage());
    let out = String::from_utf8(r.to_bytes().to_vec()).unwrap();
    let expected =
        BODY.strip_suffix('}').unwrap().to_owned() + r#","stream_options":{"include_usage":true}}"#;
    assert_eq!(out, expected);
    // Idempotent once set.
    let mut again = ChatRequest::parse(out.into_bytes()).unwrap();
    assert!(!again.force_include_usage());
}

#[test]
fn include_usage_merges_into_existing_options_in_place() {
    let body = r#"{"stream":true,"stream_options":{"include_obfuscation":false,"include_usage":false},"messages":[],"top_p":0.90}"#;
    let mut r = ChatRequest::parse(body.as_bytes().to_vec()).unwrap();
    assert!(r.force_include_usage());
    assert_eq!(
        String::from_utf8(r.to_bytes().to_vec()).unwrap(),
        r#"{"stream":true,"stream_options":{"include_obfuscation":false,"include_usage":true},"messages":[],"top_p":0.90}"#
    );
    let body = r#"{"stream":true,"stream_options":null,"messages":[]}"#;
    let mut r = ChatRequest::parse(body.as_bytes().to_vec()).unwrap();
    assert!(r.force_include_usage());
    assert_eq!(
        String::from_utf8(r.to_bytes().to_vec()).unwrap(),
        r#"{"stream":true,"stream_options":{"include_usage":true},"messages":[]}"#
    );
}

#[test]
fn include_usage_never_added_to_non_streaming() {
    for body in [r#"{"messages":[]}"#, r#"{"stream":false,"messages":[]}"#] {
        let mut r = ChatRequest::parse(body.as_bytes().to_vec()).unwrap();
        assert!(!r.force_include_usage());
        assert_eq!(r.to_bytes(), body.as_bytes());
    }
}

#[test]
fn both_changes_together() {
    let body = "{ \"messages\" : [ {\"role\":\"user\"} ] ,\n \"stream\": true }";
    let mut r = ChatRequest::parse(body.as_bytes().to_vec()).unwrap();
    r.with_messages(vec![raw("1"), raw("2")]);
    assert!(r.force_include_usage());
    assert_eq!(
        String::from_utf8(r.to_bytes().to_vec()).unwrap(),
        "{ \"messages\" : [1,2] ,\n \"stream\": true ,\"stream_options\":{\"include_usage\":true}}"
    );
}

#[test]
fn rewind_gives_back_the_clients_body_and_the_same_plan() {
    let body = r#"{"stream":true,"stream_options":{"include_usage":false},"messages":[{"role":"user"}],"model":"m"}"#;
    let mut r = ChatRequest::parse(body.as_bytes().to_vec()).unwrap();
    let taken = r.take_messages();
    r.with_messages(vec![raw("1")]);
    assert!(r.force_include_usage());
    r.set_member("added", raw("2"));
    assert_ne!(r.to_bytes(), body.as_bytes());
    r.rewind();
    assert!(!r.is_modified());
    assert_eq!(r.to_bytes(), body.as_bytes());
    assert!(
        !r.client_wants_usage(),
        "stream_options is the client's again"
    );
    assert!(r.get_raw("added").is_none());
    // A second preparation decides as the first did.
    r.with_messages(taken);
    assert!(r.force_include_usage());
    assert_eq!(
        String::from_utf8(r.to_bytes().to_vec()).unwrap(),
        r#"{"stream":true,"stream_options":{"include_usage":true},"messages":[{"role":"user"}],"model":"m"}"#
    );
}

#[test]
fn messages_span_is_the_whole_array_however_it_is_spaced() {
    for body in [
        r#"{"messages":[]}"#,
        r#"{"messages": [ ] ,"x":1}"#,
        "{\"a\":[1],\"messages\" :\n[\n {\"role\":\"user\"} ,\r\n\t\"s\"\n] }",
        r#"{"messages":[1],"b":{"messages":[2,3]}}"#,
    ] {
        let r = ChatRequest::parse(body.as_bytes().to_vec()).unwrap();
        let span = r.top.get("messages").unwrap().span.clone().unwrap();
        assert_eq!(
            Some(&span),
            raw_messages_span(body.as_bytes()).as_ref(),
            "{body}"
        );
        // Non-empty arrays are found from their elements, without the
        // second parse.
        let top: BorrowedTop<'_> = serde_json::from_str(body).unwrap();
        for (k, v) in top.0 {
            if let (true, TopValue::Messages(list)) = (k == "messages", v) {
                let around = span_around(body.as_bytes(), &list);
                assert_eq!(around, (!list.is_empty()).then_some(span.clone()));
            }
        }
    }
    let mut r = ChatRequest::parse(br#"{"messages": [ ] ,"x":1}"#.to_vec()).unwrap();
    r.with_messages(vec![raw("1")]);
    assert_eq!(&r.to_bytes()[..], br#"{"messages": [1] ,"x":1}"#);
    // An escaped key names `messages` too; its empty array is found.
    let body = r#"{"m\u0065ssages":[],"x":1}"#;
    let mut r = ChatRequest::parse(body.as_bytes().to_vec()).unwrap();
    r.with_messages(vec![raw("2")]);
    assert_eq!(&r.to_bytes()[..], br#"{"m\u0065ssages":[2],"x":1}"#);
}

#[test]
fn rejects_what_cannot_be_rewritten() {
    assert!(matches!(
        ChatRequest::parse(b"not json".to_vec()),
        Err(ParseError::NotObject(_))
    ));
    assert!(matches!(
        ChatRequest::parse(b"[1]".to_vec()),
        Err(ParseError::NotObject(_))
    ));
    assert!(matches!(
        ChatRequest::parse(br#"{"model":"m"}"#.to_vec()),
        Err(ParseError::MissingMessages)
    ));
    for not_array in [
        r#"{"messages":{}}"#,
        r#"{"messages":null}"#,
        r#"{"messages":"x"}"#,
    ] {
        assert!(matches!(
            ChatRequest::parse(not_array.as_bytes().to_vec()),
            Err(ParseError::MessagesNotArray(_))
        ));
    }
    assert!(matches!(
        ChatRequest::parse(br#"{"messages":[{"a":}]}"#.to_vec()),
        Err(ParseError::NotObject(_))
    ));
    assert!(matches!(
        ChatRequest::parse(br#"{"messages":[],"model":"a","model":"b"}"#.to_vec()),
        Err(ParseError::DuplicateKey)
    ));
}

#[test]
fn hashes_ignore_formatting_and_key_order() {
    let a = vec![
        raw(r#"{"role":"user","content":"hi"}"#),
        raw(r#"{"role":"assistant","content":"yo"}"#),
    ];
    let b = vec![
        raw(r#"{ "content": "hi", "role": "user" }"#),
        raw(r#"{"content":"yo","role":"assistant"}"#),
    ];
    assert_eq!(message_hashes(&a), message_hashes(&b));
    let c = vec![
        raw(r#"{"role":"user","content":"hi"}"#),
        raw(r#"{"role":"assistant","content":"YO"}"#),
    ];
    let (ha, hc) = (message_hashes(&a), message_hashes(&c));
    assert_eq!(ha[0], hc[0]);
    assert_ne!(ha[1], hc[1]);
    assert_eq!(common_prefix_len(&ha, &hc), 1);
    assert_eq!(common_prefix_len(&ha, &ha), 2);
}

#[test]
fn chain_cache_matches_full_computation() {
    let mut cache = ChainCache::new();
    let a = vec![raw(r#""x""#), raw(r#""y""#), raw(r#""z""#)];
    assert_eq!(cache.chain(&a), message_hashes(&a).as_slice());
    let b = vec![raw(r#""x""#), raw(r#""Y""#)];
    assert_eq!(cache.chain(&b), message_hashes(&b).as_slice());
    let c = vec![raw(r#""x""#), raw(r#""Y""#), raw(r#""w""#), raw(r#""v""#)];
    assert_eq!(cache.chain(&c), message_hashes(&c).as_slice());
    assert_eq!(cache.chain(&[]), &[] as &[u128]);
}

#[test]
fn a_chain_copied_over_another_continues_from_the_copy() {
    let a = vec![raw(r#""x""#), raw(r#""y""#), raw(r#""z""#)];
    let b = vec![raw(r#""p""#), raw(r#""q""#)];
    let mut from_a = ChainCache::new();
    from_a.chain(&a);
    let mut into = ChainCache::new();
    into.chain(&b);
    into.clone_from(&from_a);
    // The copy holds a's chain, not b's: it extends a's messages.
    let longer = vec![raw(r#""x""#), raw(r#""y""#), raw(r#""z""#), raw(r#""w""#)];
    assert_eq!(into.chain(&longer), message_hashes(&longer).as_slice());
    assert_eq!(into.clone().chain(&b), message_hashes(&b).as_slice());
}

#[test]
fn chain_depends_on_order_and_extends_incrementally() {
    let a = vec![raw(r#""x""#), raw(r#""y""#)];
    let b = vec![raw(r#""y""#), raw(r#""x""#)];
    assert_ne!(message_hashes(&a)[1], message_hashes(&b)[1]);
    let mut chain = message_hashes(&a[..1]);
    extend_message_hashes(&mut chain, &a[1..]);
    assert_eq!(chain, message_hashes(&a));
    assert_eq!(message_hash(&a[0]), message_hash(&raw(r#" "x" "#)));
}

mod prop {
    use super::*;
    use proptest::prelude::*;

    fn member_value() -> impl Strategy<Value = String> {
        prop_oneof![
            Just("0.70".to_owned()),
            Just("18446744073709551616123".to_owned()),
            Just("1e400".to_owned()),
            Just("-0.0".to_owned()),
            Just("null".to_owned()),
            Just("\"caf\\u00e9 \\\"q\\\"\"".to_owned()),
            Just("{ \"b\" : [1, 2.50, {}], \"a\":true }".to_owned()),
            "[a-z]{0,6}".prop_map(|s| format!("\"{s}\"")),
        ]
    }

    fn ws() -> impl Strategy<Value = &'static str> {
        prop_oneof![Just(""), Just(" "), Just("\n  "), Just("\t")]
    }

    prop_compose! {
        fn body()(members in proptest::collection::vec(("[a-z_]{1,8}", member_value(), ws()), 0..6),
                  msgs_at in 0usize..6, stream in any::<bool>(), w in ws())
                  -> (String, Vec<(String, String)>) {
            let mut seen = std::collections::HashSet::new();
            let mut list: Vec<(String, String)> = members
                .into_iter()
                .filter(|(k, _, _)| !matches!(k.as_str(), "messages" | "stream" | "stream_options"))
                .filter(|(k, _, _)| seen.insert(k.clone()))
                .map(|(k, v, _)| (k, v))
                .collect();
            let at = msgs_at.min(list.len());
            list.insert(at, ("messages".to_owned(), "[ {\"role\":\"user\",\"content\":\"hi\"} ]".to_owned()));
            list.push(("stream".to_owned(), stream.to_string()));
            let inner: Vec<String> = list.iter().map(|(k, v)| format!("{w}\"{k}\"{w}:{w}{v}")).collect();
            (format!("{{{}{w}}}", inner.join(",")), list)
        }
    }

    proptest! {
        #[test]
        fn untouched_members_survive_byte_for_byte((text, members) in body()) {
            let mut r = ChatRequest::parse(text.clone().into_bytes()).unwrap();
            prop_assert_eq!(r.to_bytes(), text.as_bytes());
            let streaming = r.stream();
            r.with_messages(vec![RawValue::from_string("{\"role\":\"user\",\"content\":\"new\"}".to_owned()).unwrap()]);
            let forced = r.force_include_usage();
            prop_assert_eq!(forced, streaming);
            let out = String::from_utf8(r.to_bytes().to_vec()).unwrap();
            // Still one valid JSON object ...
            let again = ChatRequest::parse(out.clone().into_bytes()).unwrap();
            prop_assert_eq!(again.messages().len(), 1);
            prop_assert_eq!(again.client_wants_usage(), streaming);
            // ... whose other members are the original raw texts, in order.
            let keys: Vec<&str> = again.top.keys().collect();
            let mut want: Vec<&str> = members.iter().map(|(k, _)| k.as_str()).collect();
            if streaming { want.push("stream_options"); }
            prop_assert_eq!(keys, want);
            for (k, v) in &members {
                if k != "messages" {
                    prop_assert_eq!(again.get_raw(k).unwrap().get(), v.as_str());
                }
            }
        }
    }
}
