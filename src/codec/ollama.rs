//! Ollama's native chat (`POST /api/chat`) ↔ the engine's conversation.
//!
//! Ollama's messages are nearly chat completions' already, one engine
//! message each:
//! - `content` (a string) stays; `images` (base64, no media type) become
//!   `image_url` parts after a text part, so the engine counts and
//!   describes them as images;
//! - an assistant's `thinking` is its `reasoning_content`;
//! - `tool_calls` carry their `arguments` as an object: the engine gets
//!   them as a JSON string, and an `id` (the client's, else a stable one
//!   made from the call's place, `ollama-<message>-<call>`);
//! - a `tool` message names its call by `tool_call_id` when the client
//!   sent one, else it is the next unanswered call of the latest assistant
//!   turn (the one of its `tool_name` first): the pairing the engine keeps
//!   whole.
//!
//! Encoding sends kept messages as the client's bytes. What the engine
//! wrote or changed goes back in Ollama's shape, a tool call or result
//! from its original message (only `arguments` / `content` replaced), so
//! `tool_name`, ids and unknown fields stay; made-up ids never go out.

use serde_json::value::RawValue;
use serde_json::{json, Map, Value};

use crate::request::ChatRequest;

use super::{to_raw, Api, DecodeError, Decoded, Piece, Resume, WireMap};

/// Prefix of the ids made for calls the client sent without one.
const MADE_ID: &str = "ollama-";
/// The data URL prefix an image becomes (Ollama sends no media type).
const IMAGE_PREFIX: &str = "data:image;base64,";

/// Decodes the `messages` of `creq` (`creq` itself carries nothing else
/// the engine reads: Ollama's system prompt is a message).
pub(super) fn decode(
    _creq: &ChatRequest,
    wire: Vec<Box<RawValue>>,
    map: WireMap,
) -> Result<Decoded, DecodeError> {
    let (resume, mut out, mut map) = Resume::new(Api::Ollama, None, &wire, map);
    // The calls of the latest assistant turn not yet answered, in order.
    let mut open: Vec<(String, String)> = Vec::new();
    // Where a later request may resume: after a user or system message,
    // past which no tool result pairs with a call before it.
    let mut cut = (resume.start, out.len());
    for (i, w) in wire.iter().enumerate().skip(resume.start) {
        let v: Value =
            serde_json::from_str(w.get()).map_err(|_| DecodeError::Unsupported("message"))?;
        let (engine, role) = decode_message(v, i, &mut map, &mut open)?;
        map.wire_roles.push(role);
        map.push(&mut out, i..i + 1, vec![engine]);
        if matches!(role, "user" | "system") {
            cut = (i + 1, out.len());
        }
    }
    let keep = resume.keep(cut, &out);
    map.wire = wire;
    Ok((out, map, keep))
}

fn str_of<'v>(o: &'v Map<String, Value>, key: &str) -> Option<&'v str> {
    o.get(key).and_then(Value::as_str)
}

fn decode_message(
    v: Value,
    i: usize,
    map: &mut WireMap,
    open: &mut Vec<(String, String)>,
) -> Result<(Value, &'static str), DecodeError> {
    let Value::Object(mut o) = v else {
        return Err(DecodeError::Unsupported("message"));
    };
    // Ollama reads roles case-insensitively.
    let role = str_of(&o, "role").map(str::to_ascii_lowercase);
    let role: &'static str = match role.as_deref() {
        Some("system") => "system",
        Some("user") => "user",
        Some("assistant") => "assistant",
        Some("tool") => "tool",
        r => {
            return Err(DecodeError::UnsupportedRole {
                member: "messages",
                role: super::role_label(r),
            })
        }
    };
    let text = match o.remove("content") {
        None | Some(Value::Null) => String::new(),
        Some(Value::String(s)) => s,
        Some(_) => return Err(DecodeError::Unsupported("content")),
    };
    if role == "tool" {
        let id = result_id(&o, i, map, open);
        map.results.insert(id.clone(), (i, None));
        return Ok((
            json!({"role": "tool", "tool_call_id": id, "content": text}),
            role,
        ));
    }
    let mut m = Map::new();
    m.insert("role".to_owned(), Value::String(role.to_owned()));
    m.insert("content".to_owned(), content_of(text, o.get("images"))?);
    if let Some(t) = str_of(&o, "thinking").filter(|t| !t.is_empty()) {
        m.insert("reasoning_content".to_owned(), Value::String(t.to_owned()));
    }
    if let Some(calls) = o.get("tool_calls").filter(|c| !c.is_null()) {
        let Value::Array(calls) = calls else {
            return Err(DecodeError::Unsupported("tool_calls"));
        };
        open.clear();
        let mut out = Vec::with_capacity(calls.len());
        for (k, call) in calls.iter().enumerate() {
            let (id, name, chat) = call_of(call, i, k)?;
            map.calls.insert(id.clone(), (i, Some(k)));
            open.push((id, name));
            out.push(chat);
        }
        if !out.is_empty() {
            m.insert("tool_calls".to_owned(), Value::Array(out));
        }
    }
    Ok((Value::Object(m), role))
}

/// The engine's content: the text, or a text part and one image part per
/// image.
fn content_of(text: String, images: Option<&Value>) -> Result<Value, DecodeError> {
    let images = match images {
        None | Some(Value::Null) => return Ok(Value::String(text)),
        Some(Value::Array(a)) if a.is_empty() => return Ok(Value::String(text)),
        Some(Value::Array(a)) => a,
        Some(_) => return Err(DecodeError::Unsupported("images")),
    };
    let mut parts = vec![json!({"type": "text", "text": text})];
    for img in images {
        let Value::String(b64) = img else {
            return Err(DecodeError::Unsupported("images"));
        };
        parts.push(
            json!({"type": "image_url", "image_url": {"url": format!("{IMAGE_PREFIX}{b64}")}}),
        );
    }
    Ok(Value::Array(parts))
}

/// One Ollama tool call as (id, name, the engine's call).
fn call_of(call: &Value, i: usize, k: usize) -> Result<(String, String, Value), DecodeError> {
    let f = call
        .get("function")
        .and_then(Value::as_object)
        .ok_or(DecodeError::Unsupported("tool_calls"))?;
    let name = str_of(f, "name").unwrap_or_default().to_owned();
    let arguments = match f.get("arguments") {
        None | Some(Value::Null) => "{}".to_owned(),
        Some(Value::String(s)) => s.clone(),
        Some(a) => a.to_string(),
    };
    let id = match call.get("id").and_then(Value::as_str) {
        Some(id) if !id.is_empty() => id.to_owned(),
        _ => format!("{MADE_ID}{i}-{k}"),
    };
    let chat = json!({
        "id": id,
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    });
    Ok((id, name, chat))
}

/// The call a tool message answers: its `tool_call_id` when the client
/// sent one, else the latest turn's next open call (of its `tool_name`
/// first); a result that answers none gets an id of its own.
fn result_id(
    o: &Map<String, Value>,
    i: usize,
    map: &WireMap,
    open: &mut Vec<(String, String)>,
) -> String {
    if let Some(id) = str_of(o, "tool_call_id").filter(|id| !id.is_empty()) {
        open.retain(|(c, _)| c != id);
        if map.calls.contains_key(id) {
            return id.to_owned();
        }
    }
    let name = str_of(o, "tool_name").or_else(|| str_of(o, "name"));
    let at = name
        .and_then(|n| open.iter().position(|(_, c)| c == n))
        .or_else(|| (!open.is_empty()).then_some(0));
    match at {
        Some(at) => open.remove(at).0,
        None => format!("{MADE_ID}{i}-result"),
    }
}

/// Encodes what is to be sent as the `messages` array.
pub(super) fn encode(map: &WireMap, outgoing: &[Box<RawValue>]) -> Vec<Box<RawValue>> {
    map.pieces(outgoing)
        .into_iter()
        .filter_map(|piece| match piece {
            Piece::Wire(w, _) => Some(w.to_owned()),
            Piece::Engine(m, _) => {
                let v = serde_json::from_str::<Value>(m.get()).ok()?;
                to_raw(&convert(map, v))
            }
        })
        .collect()
}

/// The wire message `w`, parsed.
fn wire_message(map: &WireMap, w: usize) -> Option<Map<String, Value>> {
    match serde_json::from_str(map.wire.get(w)?.get()).ok()? {
        Value::Object(o) => Some(o),
        _ => None,
    }
}

/// One engine message in Ollama's shape.
fn convert(map: &WireMap, v: Value) -> Value {
    let Value::Object(mut m) = v else {
        return v;
    };
    let role = match str_of(&m, "role") {
        Some("developer") => "system".to_owned(),
        Some(r) => r.to_owned(),
        None => "user".to_owned(),
    };
    let (text, images) = split_content(m.remove("content"));
    if role == "tool" {
        let id = str_of(&m, "tool_call_id").unwrap_or_default();
        return tool_result(map, id, text);
    }
    let mut o = Map::new();
    o.insert("role".to_owned(), Value::String(role));
    o.insert("content".to_owned(), Value::String(text));
    if !images.is_empty() {
        o.insert("images".to_owned(), Value::Array(images));
    }
    if let Some(Value::String(t)) = m.remove("reasoning_content") {
        if !t.is_empty() {
            o.insert("thinking".to_owned(), Value::String(t));
        }
    }
    if let Some(Value::Array(calls)) = m.remove("tool_calls") {
        let calls: Vec<Value> = calls.iter().map(|c| tool_call(map, c)).collect();
        o.insert("tool_calls".to_owned(), Value::Array(calls));
    }
    Value::Object(o)
}

/// The engine's content as Ollama's text and images.
fn split_content(content: Option<Value>) -> (String, Vec<Value>) {
    let parts = match content {
        None | Some(Value::Null) => return (String::new(), Vec::new()),
        Some(Value::String(s)) => return (s, Vec::new()),
        Some(Value::Array(p)) => p,
        Some(other) => return (other.to_string(), Vec::new()),
    };
    let mut texts = Vec::new();
    let mut images = Vec::new();
    for p in parts {
        if let Some(t) = p.get("text").and_then(Value::as_str) {
            texts.push(t.to_owned());
        } else if let Some(url) = p.pointer("/image_url/url").and_then(Value::as_str) {
            let b64 = url.split_once("base64,").map_or(url, |(_, b)| b);
            images.push(Value::String(b64.to_owned()));
        }
    }
    (texts.join("\n"), images)
}

/// A call in Ollama's shape: the client's own with the engine's
/// arguments, or a new one.
fn tool_call(map: &WireMap, tc: &Value) -> Value {
    let id = tc.get("id").and_then(Value::as_str).unwrap_or_default();
    let f = tc.get("function");
    let arguments = f
        .and_then(|f| f.get("arguments"))
        .and_then(Value::as_str)
        .and_then(|a| serde_json::from_str::<Value>(a).ok())
        .filter(Value::is_object)
        .unwrap_or_else(|| json!({}));
    let original = map.calls.get(id).and_then(|&(w, k)| {
        let mut msg = wire_message(map, w)?;
        match msg.remove("tool_calls")? {
            Value::Array(mut calls) => {
                k.and_then(|k| (k < calls.len()).then(|| calls.swap_remove(k)))
            }
            _ => None,
        }
    });
    match original {
        Some(mut call) => {
            if let Some(f) = call.get_mut("function").and_then(Value::as_object_mut) {
                f.insert("arguments".to_owned(), arguments);
            }
            call
        }
        None => {
            let name = f
                .and_then(|f| f.get("name"))
                .cloned()
                .unwrap_or(Value::Null);
            let mut call = json!({"function": {"name": name, "arguments": arguments}});
            if !id.is_empty() && !id.starts_with(MADE_ID) {
                call["id"] = Value::String(id.to_owned());
            }
            call
        }
    }
}

/// A tool result in Ollama's shape: the client's own message with the
/// engine's content, or a new one naming its call's tool.
fn tool_result(map: &WireMap, id: &str, text: String) -> Value {
    if let Some(mut msg) = map.results.get(id).and_then(|&(w, _)| wire_message(map, w)) {
        msg.insert("content".to_owned(), Value::String(text));
        return Value::Object(msg);
    }
    let mut o = Map::new();
    o.insert("role".to_owned(), Value::String("tool".to_owned()));
    o.insert("content".to_owned(), Value::String(text));
    let name = map.calls.get(id).and_then(|&(w, k)| {
        let msg = wire_message(map, w)?;
        let call = msg.get("tool_calls")?.get(k?)?;
        call.pointer("/function/name")?.as_str().map(str::to_owned)
    });
    if let Some(name) = name {
        o.insert("tool_name".to_owned(), Value::String(name));
    }
    if !id.is_empty() && !id.starts_with(MADE_ID) {
        o.insert("tool_call_id".to_owned(), Value::String(id.to_owned()));
    }
    Value::Object(o)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use serde_json::{json, Value};

    use super::super::{Api, ApiRequest};

    const CHAT: &str = r#"{"model":"llama3.2","keep_alive":"5m","messages":[
 {"role":"system","content":"Be brief."},
 {"role":"user","content":"what is in this picture, and the weather in Tokyo?","images":["iVBORw0KGgo="]},
 {"role":"assistant","content":"","thinking":"look it up","tool_calls":[{"function":{"name":"get_weather","arguments":{"city":"Tokyo"}}},{"function":{"name":"get_time","arguments":{"tz":"JST"}}}]},
 {"role":"tool","content":"09:00","tool_name":"get_time"},
 {"role":"tool","content":"sunny, 21 C","tool_name":"get_weather"},
 {"role":"Assistant","content":"A cat; sunny in Tokyo."}],"options":{"num_ctx":4096,"num_predict":256,"temperature":0.2},"stream":true,"think":false}"#;

    fn values(r: &ApiRequest) -> Vec<Value> {
        r.messages()
            .iter()
            .map(|m| serde_json::from_str(m.get()).unwrap())
            .collect()
    }

    /// The body `r` sends with the engine's `rows`.
    fn sent(r: &mut ApiRequest, rows: &[Value]) -> Value {
        let out = rows
            .iter()
            .map(|v| serde_json::value::to_raw_value(v).unwrap())
            .collect();
        r.with_messages(out);
        serde_json::from_slice(&r.to_bytes()).unwrap()
    }

    #[test]
    fn ollama_messages_become_chat_rows_with_their_pairs() {
        let r = ApiRequest::parse(Api::Ollama, CHAT.as_bytes().to_vec()).unwrap();
        let rows = values(&r);
        assert_eq!(rows.len(), 6);
        assert_eq!(rows[0], json!({"role":"system","content":"Be brief."}));
        // The image is an image part, so the engine counts it as one.
        assert_eq!(rows[1]["content"][1]["type"], "image_url");
        assert_eq!(rows[2]["reasoning_content"], "look it up");
        let calls = rows[2]["tool_calls"].as_array().unwrap();
        assert_eq!(calls[0]["function"]["arguments"], "{\"city\":\"Tokyo\"}");
        // Results without ids pair by their tool's name, not their order.
        assert_eq!(rows[3]["tool_call_id"], calls[1]["id"]);
        assert_eq!(rows[4]["tool_call_id"], calls[0]["id"]);
        assert_eq!(rows[5]["role"], "assistant");
        assert_eq!(r.max_output_tokens(), Some(256));
        assert_eq!(r.requested_window(), Some(4096));
        assert!(r.stream());
    }

    #[test]
    fn results_pair_in_order_without_names_and_by_id_with_them() {
        let body = r#"{"model":"m","messages":[
 {"role":"user","content":"go"},
 {"role":"assistant","content":"","tool_calls":[{"id":"c1","function":{"name":"f","arguments":{}}},{"id":"c2","function":{"name":"f","arguments":{}}}]},
 {"role":"tool","content":"second","tool_call_id":"c2"},
 {"role":"tool","content":"first"}]}"#;
        let r = ApiRequest::parse(Api::Ollama, body.as_bytes().to_vec()).unwrap();
        let rows = values(&r);
        assert_eq!(rows[2]["tool_call_id"], "c2");
        assert_eq!(rows[3]["tool_call_id"], "c1");
        // No `stream` member: Ollama streams by default.
        assert!(r.stream());
        assert_eq!(r.requested_window(), None);
        let off = body.replace("\"model\":\"m\"", "\"model\":\"m\",\"stream\":false");
        assert!(!ApiRequest::parse(Api::Ollama, off.into_bytes())
            .unwrap()
            .stream());
    }

    #[test]
    fn unchanged_ollama_rows_encode_to_the_client_bytes() {
        let mut r = ApiRequest::parse(Api::Ollama, CHAT.as_bytes().to_vec()).unwrap();
        let rows = r.take_messages();
        r.with_messages(rows);
        assert_eq!(r.to_bytes(), CHAT.replace("\n ", "").as_bytes());
    }

    #[test]
    fn rewritten_ollama_rows_keep_their_fields_and_never_send_made_up_ids() {
        let mut r = ApiRequest::parse(Api::Ollama, CHAT.as_bytes().to_vec()).unwrap();
        let mut rows = values(&r);
        r.take_messages();
        // The engine: a summary replaces the user turn, one tool output is
        // pruned, one call's arguments shortened.
        rows[1] = json!({"role":"user","content":"SUMMARY"});
        rows[4]["content"] = json!("[pruned]");
        rows[2]["tool_calls"][1]["function"]["arguments"] = json!("{}");
        let body = sent(&mut r, &rows);
        let msgs = body["messages"].as_array().unwrap();
        assert_eq!(msgs[1], json!({"role":"user","content":"SUMMARY"}));
        assert_eq!(
            msgs[2]["tool_calls"],
            json!([{"function":{"name":"get_weather","arguments":{"city":"Tokyo"}}},{"function":{"name":"get_time","arguments":{}}}])
        );
        assert_eq!(msgs[2]["thinking"], "look it up");
        assert_eq!(
            msgs[4],
            json!({"role":"tool","content":"[pruned]","tool_name":"get_weather"})
        );
        // Kept rows and every other member: the client's bytes.
        let text = String::from_utf8(r.to_bytes().to_vec()).unwrap();
        assert!(text.contains(r#"{"role":"tool","content":"09:00","tool_name":"get_time"}"#));
        assert!(text.ends_with(r#"],"options":{"num_ctx":4096,"num_predict":256,"temperature":0.2},"stream":true,"think":false}"#));
        assert!(!text.contains("ollama-"));
    }

    #[test]
    fn a_summary_row_with_an_image_part_goes_back_as_images() {
        let mut r = ApiRequest::parse(Api::Ollama, CHAT.as_bytes().to_vec()).unwrap();
        let mut rows = values(&r);
        r.take_messages();
        rows[1]["content"][0]["text"] = json!("shorter");
        let body = sent(&mut r, &rows);
        assert_eq!(
            body["messages"][1],
            json!({"role":"user","content":"shorter","images":["iVBORw0KGgo="]})
        );
    }

    #[test]
    fn shapes_ollama_does_not_have_are_not_decoded() {
        for body in [
            r#"{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"x"}]}]}"#,
            r#"{"model":"m","messages":[{"role":"critic","content":"x"}]}"#,
            r#"{"model":"m","messages":[{"role":"user","content":"x","images":"y"}]}"#,
        ] {
            assert!(
                ApiRequest::parse(Api::Ollama, body.as_bytes().to_vec()).is_err(),
                "{body}"
            );
        }
    }
}
