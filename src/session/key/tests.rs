//! Session keys: credential fingerprints, session ids from headers, body and
//! opening, and the keyed hash.

use super::*;
use http::HeaderValue;

#[test]
fn credential_query_keeps_only_credential_pairs_as_written() {
    assert_eq!(
        credential_query("alt=sse&key=AIza%2Fx&k%65y=2&beta=1").as_deref(),
        Some("key=AIza%2Fx&k%65y=2")
    );
    assert_eq!(credential_query("alt=sse&beta"), None);
    assert_eq!(credential_query(""), None);
}

#[test]
fn credential_headers_keeps_only_credentials() {
    let h = headers(&[
        ("authorization", "Bearer a"),
        ("x-api-key", "k1"),
        ("x-api-key", "k2"),
        ("api-key", "az"),
        ("x-session-id", "s"),
        ("content-type", "application/json"),
    ]);
    let out = credential_headers(&h);
    assert_eq!(out.len(), 4);
    let values =
        |n: &str| -> Vec<&str> { out.get_all(n).iter().map(|v| v.to_str().unwrap()).collect() };
    assert_eq!(values("authorization"), ["Bearer a"]);
    assert_eq!(values("x-api-key"), ["k1", "k2"]);
    assert_eq!(values("api-key"), ["az"]);
}

#[test]
fn opening_memo_answers_what_a_parse_answers() {
    // More messages than slots: some share a slot and evict each other.
    let memo = OpeningMemo::default();
    let messages: Vec<Box<RawValue>> = (0..3 * OPENING_SLOTS)
        .map(|i| {
            let role = if i % 3 == 0 { "system" } else { "user" };
            let text = format!(r#"{{"role":"{role}","content":"m{i}"}}"#);
            RawValue::from_string(text).unwrap()
        })
        .collect();
    for _ in 0..2 {
        for m in &messages {
            assert_eq!(memo.describe(m, None), Opening::of(m));
        }
    }
    assert!(memo.describe(&messages[0], None).is_system);
    assert!(!memo.describe(&messages[1], None).is_system);
    // Reformatted: another slot, the same canonical hash.
    let spaced = RawValue::from_string(r#"{ "content": "m0", "role": "system" }"#.into()).unwrap();
    assert_eq!(
        memo.describe(&spaced, None),
        memo.describe(&messages[0], None)
    );
}

fn keyer() -> SessionKeyer {
    SessionKeyer::with_secret(DEFAULT_SESSION_HEADERS, 42).unwrap()
}

fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
    let mut h = HeaderMap::new();
    for (k, v) in pairs {
        h.append(
            HeaderName::from_bytes(k.as_bytes()).unwrap(),
            HeaderValue::from_str(v).unwrap(),
        );
    }
    h
}

fn req(body: &str) -> ChatRequest {
    ChatRequest::parse(body.as_bytes().to_vec()).unwrap()
}

const CONV: &str =
    r#"{"model":"m","messages":[{"role":"system","content":"S"},{"role":"user","content":"U1"}]}"#;
const CONV_LATER: &str = r#"{"model":"m","messages":[{"role":"system","content":"S"},{"role":"user","content":"U1"},{"role":"assistant","content":"A1"},{"role":"user","content":"U2"}]}"#;

#[test]
fn each_header_source_in_precedence_order() {
    let k = keyer();
    let r = req(CONV);
    let auth = ("authorization", "Bearer sk-1");
    for name in [
        "x-session-id",
        "session-id",
        "thread-id",
        "x-session-affinity",
        "x-opencode-session",
    ] {
        let (_, src) = k.derive(&headers(&[auth, (name, "abc")]), &r);
        assert_eq!(src, SessionSource::Header(name.to_owned()));
    }
    // Earlier entries win over later ones.
    let (_, src) = k.derive(
        &headers(&[auth, ("thread-id", "t"), ("session-id", "s")]),
        &r,
    );
    assert_eq!(src, SessionSource::Header("session-id".to_owned()));
    // Empty values are skipped.
    let (_, src) = k.derive(
        &headers(&[auth, ("x-session-id", ""), ("thread-id", "t")]),
        &r,
    );
    assert_eq!(src, SessionSource::Header("thread-id".to_owned()));
}

#[test]
fn claude_code_agent_id_separates_subagents() {
    let k = keyer();
    let r = req(CONV);
    let parent = headers(&[("x-claude-code-session-id", "u1")]);
    let sub_a = headers(&[
        ("x-claude-code-session-id", "u1"),
        ("x-claude-code-agent-id", "a"),
    ]);
    let sub_b = headers(&[
        ("x-claude-code-session-id", "u1"),
        ("x-claude-code-agent-id", "b"),
    ]);
    let (kp, src) = k.derive(&parent, &r);
    assert_eq!(
        src,
        SessionSource::Header("x-claude-code-session-id+x-claude-code-agent-id".to_owned())
    );
    let (ka, _) = k.derive(&sub_a, &r);
    let (kb, _) = k.derive(&sub_b, &r);
    assert_ne!(kp, ka);
    assert_ne!(ka, kb);
    assert_eq!(ka, k.derive(&sub_a, &req(CONV_LATER)).0);
    // A session id that contains the separator of a joined pair is
    // another conversation than that pair.
    let joined = headers(&[("x-claude-code-session-id", "u1:a")]);
    assert_ne!(k.derive(&joined, &r).0, ka);
    let split = headers(&[
        ("x-claude-code-session-id", "u1:"),
        ("x-claude-code-agent-id", "a"),
    ]);
    assert_ne!(k.derive(&split, &r).0, ka);
}

/// qwen-code's memory sub-agent sends the agent's own `prompt_cache_key`
/// with another system prompt (shared-cache-key case): two conversations,
/// each stable across its own turns, under any explicit id.
#[test]
fn one_id_with_other_instructions_is_another_conversation() {
    let k = keyer();
    let sub = CONV.replace("\"S\"", "\"memory agent\"");
    let sub_later = CONV_LATER.replace("\"S\"", "\"memory agent\"");
    for (h, body_id) in [
        (headers(&[("x-session-id", "s1")]), ""),
        (headers(&[("x-claude-code-session-id", "u1")]), ""),
        (headers(&[]), r#""prompt_cache_key":"p","#),
        (headers(&[]), r#""session_id":"s1","#),
    ] {
        let with_id = |body: &str| req(&body.replacen('{', &format!("{{{body_id}"), 1));
        let main = k.derive(&h, &with_id(CONV)).0;
        assert_eq!(main, k.derive(&h, &with_id(CONV_LATER)).0, "{body_id}");
        let other = k.derive(&h, &with_id(&sub)).0;
        assert_ne!(main, other, "{body_id}");
        assert_eq!(other, k.derive(&h, &with_id(&sub_later)).0, "{body_id}");
    }
}

#[test]
fn body_fields_then_fingerprint() {
    let k = keyer();
    let h = headers(&[("authorization", "Bearer x")]);
    let (ks, src) = k.derive(
        &h,
        &req(r#"{"session_id":"s1","prompt_cache_key":"p","messages":[]}"#),
    );
    assert_eq!(src, SessionSource::BodySessionId);
    let (kp, src) = k.derive(&h, &req(r#"{"prompt_cache_key":"p","messages":[]}"#));
    assert_eq!(src, SessionSource::BodyPromptCacheKey);
    assert_ne!(ks, kp);
    // The header id and the body id name the same session.
    let (kh, _) = k.derive(
        &headers(&[("authorization", "Bearer x"), ("x-session-id", "s1")]),
        &req(r#"{"messages":[]}"#),
    );
    assert_eq!(kh, ks);
    let (_, src) = k.derive(&h, &req(CONV));
    assert_eq!(src, SessionSource::Fingerprint);
}

#[test]
fn fingerprint_is_stable_across_turns_and_separates_conversations() {
    let k = keyer();
    let h = headers(&[("authorization", "Bearer x")]);
    let first = k.derive(&h, &req(CONV)).0;
    assert_eq!(first, k.derive(&h, &req(CONV_LATER)).0);
    // Formatting differences do not matter.
    let reformatted = r#"{ "messages": [ {"content":"S","role":"system"}, {"content":"U1","role":"user"} ], "model": "m" }"#;
    assert_eq!(first, k.derive(&h, &req(reformatted)).0);
    let other_user = CONV.replace("U1", "U9");
    assert_ne!(first, k.derive(&h, &req(&other_user)).0);
    let other_system = CONV.replace("\"S\"", "\"S2\"");
    assert_ne!(first, k.derive(&h, &req(&other_system)).0);
    let other_model = CONV.replace("\"m\"", "\"m2\"");
    assert_ne!(first, k.derive(&h, &req(&other_model)).0);
    let developer = CONV.replace("system", "developer");
    assert_ne!(first, k.derive(&h, &req(&developer)).0);
    // A fingerprint never collides with an explicit id space.
    assert_ne!(
        first,
        k.derive(
            &headers(&[("authorization", "Bearer x"), ("x-session-id", "m")]),
            &req(CONV)
        )
        .0
    );
}

#[test]
fn credentials_never_share_a_key() {
    let k = keyer();
    let r = req(CONV);
    let a = k.derive(
        &headers(&[("authorization", "Bearer A"), ("x-session-id", "s")]),
        &r,
    );
    let b = k.derive(
        &headers(&[("authorization", "Bearer B"), ("x-session-id", "s")]),
        &r,
    );
    let none = k.derive(&headers(&[("x-session-id", "s")]), &r);
    let api_key = k.derive(
        &headers(&[("api-key", "Bearer A"), ("x-session-id", "s")]),
        &r,
    );
    let x_api_key = k.derive(&headers(&[("x-api-key", "A"), ("x-session-id", "s")]), &r);
    let keys = [a.0, b.0, none.0, api_key.0, x_api_key.0];
    for i in 0..keys.len() {
        for j in i + 1..keys.len() {
            assert_ne!(keys[i], keys[j], "{i} vs {j}");
        }
    }
    // Fingerprint fallback is scoped by credential too.
    assert_ne!(
        k.derive(&headers(&[("authorization", "Bearer A")]), &r).0,
        k.derive(&headers(&[("authorization", "Bearer B")]), &r).0
    );
    // Same credential, same id: same key.
    assert_eq!(
        a.0,
        k.derive(
            &headers(&[("authorization", "Bearer A"), ("x-session-id", "s")]),
            &req(CONV_LATER)
        )
        .0
    );
}

#[test]
fn every_credential_header_scopes_sessions() {
    let k = keyer();
    let r = req(CONV);
    let with = |name: &str, value: &str| {
        let h = headers(&[(name, value), ("x-session-id", "s")]);
        (k.derive(&h, &r).0, k.credential(&h))
    };
    let none = k.derive(&headers(&[("x-session-id", "s")]), &r).0;
    for name in ["authorization", "api-key", "x-api-key", "x-goog-api-key"] {
        let (a, ca) = with(name, "A");
        let (b, cb) = with(name, "B");
        assert_ne!(a, b, "{name}: two credentials, one session");
        assert_ne!(ca, cb, "{name}: two credentials, one record scope");
        assert_ne!(a, none, "{name}: scoped like a request without one");
    }
    // The same value under two header names is two credentials.
    assert_ne!(with("x-goog-api-key", "A").1, with("api-key", "A").1);
    // Discovery presents the Google key too.
    let h = headers(&[("x-goog-api-key", "g"), ("x-session-id", "s")]);
    let out = credential_headers(&h);
    assert_eq!(out.len(), 1);
    assert_eq!(out["x-goog-api-key"], "g");
}

#[test]
fn credentials_in_the_query_scope_sessions_and_records() {
    let k = keyer();
    let r = req(CONV);
    let h = headers(&[("x-session-id", "s")]);
    let at = |uri: &str| {
        let uri: http::Uri = uri.parse().unwrap();
        let (key, _, cred) = k.derive_with_credential(&h, &uri, &r);
        (key, cred)
    };
    let bare = at("/v1/chat/completions");
    assert_eq!(bare, (k.derive(&h, &r).0, k.credential(&h)));
    let a = at("/v1/chat/completions?key=A");
    let b = at("/v1/chat/completions?key=B");
    assert_ne!(a, b);
    assert_ne!(a.0, bare.0);
    assert_ne!(a.1, bare.1);
    // Other parameters are not credentials; the key's position does not matter.
    assert_eq!(at("/v1/chat/completions?api-version=2024-10-01&key=A"), a);
    assert_eq!(at("/v1/chat/completions?key=A&alt=sse"), a);
    assert_eq!(at("/v1/chat/completions?api-version=1"), bare);
    // An escaped name is still the key parameter.
    assert_eq!(at("/v1/chat/completions?k%65y=A"), a);
    assert_eq!(
        at("/v1/chat/completions?k%65Y=A"),
        at("/v1/chat/completions?keY=A")
    );
    for name in ["api-key", "api_key", "access_token"] {
        let q = at(&format!("/v1/chat/completions?{name}=A"));
        assert_ne!(q, bare, "{name}");
        assert_ne!(q, a, "{name} and key are different parameters");
    }
    // A query key and a header key with the same value stay apart, and
    // both together differ from either alone.
    let uri: http::Uri = "/v1/chat/completions?key=A".parse().unwrap();
    let hk = headers(&[("x-goog-api-key", "A"), ("x-session-id", "s")]);
    let header_only = k.credential(&hk);
    let both = k.derive_with_credential(&hk, &uri, &r).2;
    assert_ne!(header_only, a.1);
    assert_ne!(both, a.1);
    assert_ne!(both, header_only);
    // Two `key` parameters: both count, in order.
    assert_ne!(at("/v1/chat/completions?key=A&key=B"), a);
    assert_ne!(
        at("/v1/chat/completions?key=A&key=B"),
        at("/v1/chat/completions?key=B&key=A")
    );
}

#[test]
fn param_names_decode_like_a_query_parser_does() {
    assert_eq!(&*decode_param_name(b"key"), b"key");
    assert_eq!(&*decode_param_name(b"k%65y"), b"key");
    assert_eq!(&*decode_param_name(b"api%5fkey"), b"api_key");
    assert_eq!(&*decode_param_name(b"a+b"), b"a b");
    // Malformed escapes stay as written (and never panic at the end).
    assert_eq!(&*decode_param_name(b"k%6"), b"k%6");
    assert_eq!(&*decode_param_name(b"%"), b"%");
    assert_eq!(&*decode_param_name(b"%zz"), b"%zz");
    assert_eq!(&*decode_param_name("%é".as_bytes()), "%é".as_bytes());
}

#[test]
fn fingerprints_do_not_print_credentials() {
    let k = keyer();
    let uri: http::Uri = "/v1/chat/completions?key=sk-secret".parse().unwrap();
    let h = headers(&[("x-goog-api-key", "sk-goog")]);
    let (key, _, cred) = k.derive_with_credential(&h, &uri, &req(CONV));
    let printed = format!("{key} {key:?} {cred:?}");
    assert!(!printed.contains("secret") && !printed.contains("goog"));
}

#[test]
fn secret_changes_keys_and_hex_round_trips() {
    let r = req(CONV);
    let h = headers(&[("authorization", "Bearer A")]);
    let a = keyer().derive(&h, &r).0;
    let b = SessionKeyer::with_secret(DEFAULT_SESSION_HEADERS, 43)
        .unwrap()
        .derive(&h, &r)
        .0;
    assert_ne!(a, b);
    let hex = a.to_string();
    assert_eq!(hex.len(), 32);
    assert!(!hex.contains("sk-") && !hex.contains('A'));
    assert_eq!(SessionKey::parse_hex(&hex), Some(a));
    assert_eq!(SessionKey::parse_hex("xyz"), None);
}

#[test]
fn hex_is_the_display_form() {
    for v in [0, 1, 0xabc, u128::MAX, u128::MAX / 3, 1 << 127] {
        let k = SessionKey::from_u128(v);
        assert_eq!(k.hex().as_slice(), k.to_string().as_bytes(), "{v:x}");
    }
}

#[test]
fn custom_header_list() {
    let k = SessionKeyer::with_secret(&["x-conversation-id", "x-a+x-b"], 1).unwrap();
    let r = req(CONV);
    let (_, src) = k.derive(
        &headers(&[("x-session-id", "ignored"), ("x-conversation-id", "c")]),
        &r,
    );
    assert_eq!(src, SessionSource::Header("x-conversation-id".to_owned()));
    let (_, src) = k.derive(&headers(&[("x-session-id", "ignored")]), &r);
    assert_eq!(src, SessionSource::Fingerprint);
    assert!(SessionKeyer::with_secret(&["bad header"], 1).is_err());
}

#[test]
fn present_names_are_found_in_one_look() {
    let h = headers(&[
        ("x-api-key", "k1"),
        ("content-type", "application/json"),
        ("x-api-key", "k2"),
        ("authorization", "Bearer a"),
    ]);
    assert_eq!(present(&h, &CREDENTIAL_HEADERS), 0b101);
    assert_eq!(present(&HeaderMap::new(), &CREDENTIAL_HEADERS), 0);
}

/// The fingerprint hashes the credential headers in their fixed order, all
/// values of each, whatever order the request sent them in: fingerprints
/// stored by earlier versions still match (this is the hash as it was
/// computed before the one-look scan of the names).
#[test]
fn credential_fingerprint_input_is_unchanged() {
    let keyer = SessionKeyer::with_secret(&["x-session-id"], 7).unwrap();
    let reference = |h: &HeaderMap, query: Option<&str>| {
        let mut x = Xxh3::with_seed(7);
        x.update(b"compactor-credential");
        let mut part = |tag: u8, name: &[u8], value: &[u8]| {
            x.update(&[tag]);
            x.update(&(name.len() as u64).to_le_bytes());
            x.update(name);
            x.update(&(value.len() as u64).to_le_bytes());
            x.update(value);
        };
        for name in &CREDENTIAL_HEADERS {
            for v in h.get_all(name) {
                part(b'h', name.as_str().as_bytes(), v.as_bytes());
            }
        }
        for (name, value) in query.into_iter().flat_map(credential_params) {
            part(b'q', &name, value);
        }
        CredentialFingerprint(x.digest128())
    };
    let cases = [
        headers(&[]),
        headers(&[("content-type", "application/json")]),
        headers(&[("authorization", "Bearer a")]),
        headers(&[
            ("x-goog-api-key", "g"),
            ("x-api-key", "k1"),
            ("api-key", "az"),
            ("x-api-key", "k2"),
            ("authorization", "Bearer a"),
        ]),
    ];
    for h in &cases {
        for query in [None, Some("key=AIza&alt=sse")] {
            assert_eq!(keyer.credential_of(h, query), reference(h, query));
        }
    }
}
