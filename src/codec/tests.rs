#![allow(clippy::unwrap_used)]

use super::*;

const BODY: &str = r#"{"model":"m", "temperature":0.70,"system":[{"type":"text","text":"S","cache_control":{"type":"ephemeral"}}],"max_tokens":64,"messages":[{"role":"user","content":[{"type":"text","text":"hi"}]}],"metadata":{"user_id":"u"}}"#;

#[test]
fn parses_a_messages_body() {
    let r = ApiRequest::parse(Api::Messages, BODY.as_bytes().to_vec()).unwrap();
    assert_eq!(r.messages().len(), 2);
}

#[test]
fn parses_the_integration_body() {
    let body = r#"{"model":"m", "temperature":0.70,"x_unknown":{"b":1,"a":[1, 2]},"system":[{"type":"text","text":"You are Claude Code.","cache_control":{"type":"ephemeral"}},{"type":"text","text":"Be careful."}],"max_tokens":64,"messages":[{"role":"user","content":[{"type":"text","text":"Step 1","cache_control":{"type":"ephemeral"}}]}],"metadata":{"user_id":"u"}}"#;
    let r = ApiRequest::parse(Api::Messages, body.as_bytes().to_vec());
    assert!(r.is_ok(), "{r:?}");
}
