//! Anthropic Messages ↔ the engine's conversation.
//!
//! - top-level `system` (a string or text blocks) ↔ the leading system
//!   message;
//! - a user message ↔ one `tool` message per `tool_result` block (in
//!   order), then a user message with the other blocks;
//! - an assistant message ↔ one assistant message: its `tool_use` blocks as
//!   `tool_calls`, every other block (`text`, `thinking`,
//!   `redacted_thinking`, ...) kept as a content part, so thinking stays
//!   with its turn.
//!
//! Encoding sends kept messages as the client's bytes. What the engine wrote
//! is converted back, each tool call and result from its original block
//! (only `input` / `content` replaced, `cache_control` and `is_error`
//! kept); then neighbours of the same role are merged (Anthropic
//! alternates user and assistant, and a `tool` row is a user message
//! there), and `cache_control` markers beyond Anthropic's four are dropped
//! from converted messages.

use std::borrow::Cow;

use serde::Deserialize;
use serde_json::value::RawValue;
use serde_json::{json, Map, Value};

use crate::request::ChatRequest;

use super::{to_raw, Api, DecodeError, Decoded, Piece, Resume, WireMap};

/// Anthropic's limit of `cache_control` breakpoints per request.
pub(crate) const MAX_CACHE_CONTROL: usize = 4;

/// Decodes the wire messages (and the `system` member) of `creq`.
pub(super) fn decode(
    creq: &ChatRequest,
    wire: Vec<Box<RawValue>>,
    map: WireMap,
) -> Result<Decoded, DecodeError> {
    let system = creq.get_raw("system");
    let (resume, mut out, mut map) = Resume::new(Api::Messages, system, &wire, map);
    if !resume.resumed {
        if let Some(sys) = system {
            let v: Value =
                serde_json::from_str(sys.get()).map_err(|_| DecodeError::Unsupported("system"))?;
            match &v {
                Value::String(s) if s.is_empty() => {}
                Value::Array(a) if a.is_empty() => {}
                Value::String(_) | Value::Array(_) => {
                    map.system_cc = count_cache_control(&v);
                    map.push_system(&mut out, json!({"role": "system", "content": v}));
                }
                Value::Null => {}
                _ => return Err(DecodeError::Unsupported("system")),
            }
        }
    }
    for (i, w) in wire.iter().enumerate().skip(resume.start) {
        let v: Value =
            serde_json::from_str(w.get()).map_err(|_| DecodeError::Unsupported("message"))?;
        let role = super::role_label(v.get("role").and_then(Value::as_str));
        let engine = decode_message(v, i, &mut map)?;
        map.wire_roles.push(role);
        map.push(&mut out, i..i + 1, engine);
    }
    let keep = resume.keep((wire.len(), out.len()), &out);
    map.wire = wire;
    Ok((out, map, keep))
}

fn block_type(b: &Value) -> &str {
    b.get("type").and_then(Value::as_str).unwrap_or("")
}

fn decode_message(v: Value, i: usize, map: &mut WireMap) -> Result<Vec<Value>, DecodeError> {
    let Value::Object(mut o) = v else {
        return Err(DecodeError::Unsupported("message"));
    };
    let role = match o.get("role").and_then(Value::as_str) {
        Some(r @ ("user" | "assistant")) => r.to_owned(),
        // Claude Code sends its environment block as a system message
        // inside `messages`: instructions, kept as they are where they
        // stand (the engine never summarises or shortens them).
        Some(r @ ("system" | "developer")) => {
            let role = r.to_owned();
            return instructions_row(role, o.remove("content"));
        }
        r => {
            return Err(DecodeError::UnsupportedRole {
                member: "messages",
                role: super::role_label(r),
            })
        }
    };
    let content = o.remove("content").unwrap_or(Value::Null);
    let blocks = match content {
        Value::String(s) => return Ok(vec![json!({"role": role, "content": s})]),
        Value::Array(b) => b,
        _ => return Err(DecodeError::Unsupported("content")),
    };
    if role == "user" {
        let mut rows = Vec::new();
        let mut rest = Vec::new();
        for (b, block) in blocks.into_iter().enumerate() {
            if block_type(&block) != "tool_result" {
                rest.push(block);
                continue;
            }
            let id = block
                .get("tool_use_id")
                .and_then(Value::as_str)
                .ok_or(DecodeError::Unsupported("tool_result"))?
                .to_owned();
            let content = block
                .get("content")
                .cloned()
                .unwrap_or(Value::String(String::new()));
            map.results.insert(id.clone(), (i, Some(b)));
            rows.push(json!({"role": "tool", "tool_call_id": id, "content": content}));
        }
        if !rest.is_empty() || rows.is_empty() {
            rows.push(json!({"role": "user", "content": rest}));
        }
        return Ok(rows);
    }
    let mut calls = Vec::new();
    let mut rest = Vec::new();
    for (b, block) in blocks.into_iter().enumerate() {
        if block_type(&block) != "tool_use" {
            rest.push(block);
            continue;
        }
        let id = block
            .get("id")
            .and_then(Value::as_str)
            .ok_or(DecodeError::Unsupported("tool_use"))?
            .to_owned();
        let name = block.get("name").cloned().unwrap_or(Value::Null);
        let input = block.get("input").cloned().unwrap_or_else(|| json!({}));
        map.calls.insert(id.clone(), (i, Some(b)));
        calls.push(json!({
            "id": id,
            "type": "function",
            "function": {"name": name, "arguments": input.to_string()},
        }));
    }
    let content = if rest.is_empty() {
        Value::Null
    } else {
        Value::Array(rest)
    };
    let mut m = json!({"role": "assistant", "content": content});
    if !calls.is_empty() {
        m["tool_calls"] = Value::Array(calls);
    }
    Ok(vec![m])
}

/// A system message inside `messages`, as the engine's instruction row.
fn instructions_row(role: String, content: Option<Value>) -> Result<Vec<Value>, DecodeError> {
    match content {
        Some(c @ (Value::String(_) | Value::Array(_))) => {
            Ok(vec![json!({"role": role, "content": c})])
        }
        _ => Err(DecodeError::Unsupported("content")),
    }
}

/// Encodes what is to be sent: the new `system` member when the engine
/// changed the system message, and the `messages` array.
pub(super) fn encode(
    map: &WireMap,
    outgoing: &[Box<RawValue>],
) -> (Option<Box<RawValue>>, Vec<Box<RawValue>>) {
    let mut system: Vec<Value> = Vec::new();
    let mut system_changed = false;
    let mut rows: Vec<Row<'_>> = Vec::with_capacity(outgoing.len());
    for piece in map.pieces(outgoing) {
        match piece {
            Piece::Wire(w, k) => rows.push(Row::Wire(w, map.wire_roles.get(k).copied())),
            Piece::Engine(m, client_system) => {
                let Ok(v) = serde_json::from_str::<Value>(m.get()) else {
                    continue;
                };
                if matches!(super::role(&v), "system" | "developer") {
                    system_changed |= !client_system;
                    system.push(v);
                    continue;
                }
                rows.extend(convert(map, v).into_iter().map(Row::New));
            }
        }
    }
    let mut rows = merge_same_role(rows);
    let system = (system_changed || system.len() > 1).then(|| system_member(system));
    let kept = rows
        .iter()
        .filter_map(|r| match r {
            Row::Wire(w, _) => Some(count_cache_control_raw(w)),
            Row::New(_) => None,
        })
        .sum::<usize>()
        + match &system {
            Some(v) => count_cache_control(v),
            None => map.system_cc,
        };
    let mut budget = MAX_CACHE_CONTROL.saturating_sub(kept);
    // The newest breakpoints cache the most: keep those, drop from the front.
    for row in rows.iter_mut().rev() {
        if let Row::New(v) = row {
            strip_cache_control(v, &mut budget);
        }
    }
    let wire = rows
        .into_iter()
        .filter_map(|r| match r {
            Row::Wire(w, _) => Some(w.to_owned()),
            Row::New(v) => to_raw(&v),
        })
        .collect();
    (system.as_ref().and_then(to_raw), wire)
}

/// One message of the encoded list.
enum Row<'a> {
    /// A client message, and its role when the decode recorded it.
    Wire(&'a RawValue, Option<&'static str>),
    New(Value),
}

#[derive(Deserialize)]
struct RoleOnly<'a> {
    #[serde(borrow)]
    role: Option<Cow<'a, str>>,
}

impl Row<'_> {
    fn role(&self) -> Cow<'static, str> {
        match self {
            Row::Wire(_, Some(role)) => Cow::Borrowed(role),
            Row::Wire(w, None) => Cow::Owned(
                serde_json::from_str::<RoleOnly<'_>>(w.get())
                    .ok()
                    .and_then(|r| r.role)
                    .map(Cow::into_owned)
                    .unwrap_or_default(),
            ),
            Row::New(v) => Cow::Owned(super::role(v).to_owned()),
        }
    }

    fn into_value(self) -> Value {
        match self {
            Row::Wire(w, _) => serde_json::from_str(w.get()).unwrap_or(Value::Null),
            Row::New(v) => v,
        }
    }
}

/// Merges neighbours of the same role into one message: tool results
/// first in a user message (Anthropic wants them right after the call).
fn merge_same_role(rows: Vec<Row<'_>>) -> Vec<Row<'_>> {
    let mut out: Vec<Row<'_>> = Vec::with_capacity(rows.len());
    let mut last_role = Cow::Borrowed("");
    for row in rows {
        let role = row.role();
        // Instructions stand where the client put them, each as it was.
        let instructions = matches!(role.as_ref(), "system" | "developer");
        if role != last_role || out.is_empty() || instructions {
            last_role = role;
            out.push(row);
            continue;
        }
        let Some(prev) = out.pop() else {
            continue;
        };
        let mut blocks = blocks_of(prev.into_value());
        blocks.extend(blocks_of(row.into_value()));
        if role == "user" {
            // Stable: results keep their order, and so does the rest.
            blocks.sort_by_key(|b| block_type(b) != "tool_result");
        }
        out.push(Row::New(json!({"role": role, "content": blocks})));
    }
    out
}

/// A message's content as blocks.
fn blocks_of(m: Value) -> Vec<Value> {
    match m.get("content") {
        Some(Value::String(s)) if s.is_empty() => Vec::new(),
        Some(Value::String(s)) => vec![json!({"type": "text", "text": s})],
        Some(Value::Array(a)) => a.clone(),
        _ => Vec::new(),
    }
}

/// Content parts of an engine message as Anthropic blocks (a bare string
/// part becomes a text block).
fn parts_as_blocks(content: &Value) -> Vec<Value> {
    match content {
        Value::String(s) if s.is_empty() => Vec::new(),
        Value::String(s) => vec![json!({"type": "text", "text": s})],
        Value::Array(parts) => parts
            .iter()
            .map(|p| match p {
                Value::String(s) => json!({"type": "text", "text": s}),
                other => other.clone(),
            })
            .collect(),
        _ => Vec::new(),
    }
}

/// One engine message the engine wrote or changed, as Anthropic messages.
fn convert(map: &WireMap, v: Value) -> Vec<Value> {
    let content = v.get("content").cloned().unwrap_or(Value::Null);
    match super::role(&v) {
        "assistant" => {
            let calls = v.get("tool_calls").and_then(Value::as_array);
            if let (Value::String(s), None) = (&content, calls) {
                if !s.is_empty() {
                    return vec![json!({"role": "assistant", "content": s})];
                }
            }
            let mut blocks = parts_as_blocks(&content);
            // A summary merged into this turn must not go in front of its
            // thinking: Anthropic wants an assistant turn to open with it.
            blocks.sort_by_key(|b| !matches!(block_type(b), "thinking" | "redacted_thinking"));
            for tc in calls.into_iter().flatten() {
                blocks.push(tool_use(map, tc));
            }
            if blocks.is_empty() {
                // Anthropic refuses an empty assistant turn.
                blocks.push(json!({"type": "text", "text": "(no content)"}));
            }
            vec![json!({"role": "assistant", "content": blocks})]
        }
        "tool" => vec![json!({"role": "user", "content": [tool_result(map, &v, content)]})],
        _ => match content {
            Value::String(s) => vec![json!({"role": "user", "content": s})],
            other => vec![json!({"role": "user", "content": parts_as_blocks(&other)})],
        },
    }
}

fn tool_use(map: &WireMap, tc: &Value) -> Value {
    let id = tc.get("id").and_then(Value::as_str).unwrap_or_default();
    let f = tc.get("function");
    let input = f
        .and_then(|f| f.get("arguments"))
        .and_then(Value::as_str)
        .and_then(|a| serde_json::from_str::<Value>(a).ok())
        .filter(Value::is_object)
        .unwrap_or_else(|| json!({}));
    match map.original(false, id) {
        Some(mut block) => {
            block["input"] = input;
            block
        }
        None => json!({
            "type": "tool_use",
            "id": id,
            "name": f.and_then(|f| f.get("name")).cloned().unwrap_or(Value::Null),
            "input": input,
        }),
    }
}

fn tool_result(map: &WireMap, v: &Value, content: Value) -> Value {
    let id = v
        .get("tool_call_id")
        .and_then(Value::as_str)
        .unwrap_or_default();
    match map.original(true, id) {
        Some(mut block) => {
            block["content"] = content;
            block
        }
        None => json!({"type": "tool_result", "tool_use_id": id, "content": content}),
    }
}

/// The `system` member for the engine's system messages.
fn system_member(system: Vec<Value>) -> Value {
    let all_strings = system
        .iter()
        .all(|m| matches!(m.get("content"), Some(Value::String(_))));
    if all_strings {
        let texts: Vec<&str> = system
            .iter()
            .filter_map(|m| m.get("content").and_then(Value::as_str))
            .collect();
        return Value::String(texts.join("\n\n"));
    }
    Value::Array(
        system
            .iter()
            .flat_map(|m| parts_as_blocks(m.get("content").unwrap_or(&Value::Null)))
            .collect(),
    )
}

const CACHE_CONTROL: &str = "cache_control";

/// `cache_control` keys anywhere in `v`.
pub(crate) fn count_cache_control(v: &Value) -> usize {
    match v {
        Value::Object(o) => {
            usize::from(o.get(CACHE_CONTROL).is_some_and(|c| !c.is_null()))
                + o.iter()
                    .filter(|(k, _)| k.as_str() != CACHE_CONTROL)
                    .map(|(_, c)| count_cache_control(c))
                    .sum::<usize>()
        }
        Value::Array(a) => a.iter().map(count_cache_control).sum(),
        _ => 0,
    }
}

fn count_cache_control_raw(w: &RawValue) -> usize {
    // Most messages carry none: parse only those that might.
    if !w.get().contains("\"cache_control\"") {
        return 0;
    }
    serde_json::from_str::<Value>(w.get())
        .map(|v| count_cache_control(&v))
        .unwrap_or(0)
}

/// Keeps the last `budget` markers of `v` (walked back to front), drops the
/// rest.
fn strip_cache_control(v: &mut Value, budget: &mut usize) {
    match v {
        Value::Object(o) => {
            for (k, c) in o.iter_mut().rev() {
                if k != CACHE_CONTROL {
                    strip_cache_control(c, budget);
                }
            }
            strip_here(o, budget);
        }
        Value::Array(a) => {
            for c in a.iter_mut().rev() {
                strip_cache_control(c, budget);
            }
        }
        _ => {}
    }
}

fn strip_here(o: &mut Map<String, Value>, budget: &mut usize) {
    if o.get(CACHE_CONTROL).is_none_or(Value::is_null) {
        return;
    }
    if *budget > 0 {
        *budget -= 1;
    } else {
        o.remove(CACHE_CONTROL);
    }
}

/// Claude Code's session id in `metadata.user_id`: the `session_id` of the
/// JSON string it sends now, the `_session_<uuid>` suffix of the older
/// form, else the whole value.
pub(super) fn metadata_session(metadata: &RawValue) -> Option<String> {
    #[derive(Deserialize)]
    struct Metadata {
        user_id: Option<String>,
    }
    #[derive(Deserialize)]
    struct UserId {
        session_id: Option<String>,
    }
    let user_id = serde_json::from_str::<Metadata>(metadata.get())
        .ok()?
        .user_id
        .filter(|s| !s.is_empty())?;
    if let Ok(UserId {
        session_id: Some(s),
    }) = serde_json::from_str::<UserId>(&user_id)
    {
        if !s.is_empty() {
            return Some(s);
        }
    }
    if let Some((_, s)) = user_id.rsplit_once("_session_") {
        if !s.is_empty() {
            return Some(s.to_owned());
        }
    }
    Some(user_id)
}
