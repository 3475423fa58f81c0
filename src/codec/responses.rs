//! OpenAI Responses (without server-side state) ↔ the engine's
//! conversation.
//!
//! - `instructions` ↔ the leading system message (never rewritten: a
//!   changed system message goes into `input` as a message item);
//! - a `message` item ↔ a message (`input_text` / `output_text` parts as
//!   text parts, other parts kept as they are);
//! - a run of call items (`function_call`, and any `*_call` with a
//!   `call_id`), with the assistant message right before it ↔ one
//!   assistant message with `tool_calls`;
//! - a `*_call_output` item ↔ a `tool` message;
//! - `reasoning` items, and items of other types, go with the item that
//!   follows them (so a reasoning item stays with its call).
//!
//! `previous_response_id`, a `conversation`, or an `item_reference` in the
//! input mean the upstream holds part of the conversation: such requests
//! are not compacted.

use serde_json::value::RawValue;
use serde_json::{json, Value};

use crate::request::ChatRequest;

use super::{to_raw, Api, DecodeError, Decoded, Keep, Piece, Resume, WireMap};

fn item_type(v: &Value) -> &str {
    match v.get("type").and_then(Value::as_str) {
        Some(t) => t,
        // An "easy" input message has a role and no type.
        None if v.get("role").is_some() => "message",
        None => "",
    }
}

fn is_call(v: &Value) -> bool {
    let t = item_type(v);
    t == "function_call" || (t.ends_with("_call") && v.get("call_id").is_some())
}

fn is_output(v: &Value) -> bool {
    item_type(v).ends_with("_call_output") && v.get("call_id").is_some()
}

fn is_set(raw: Option<&RawValue>) -> bool {
    raw.is_some_and(|r| r.get().trim() != "null")
}

/// Decodes the `input` items (and `instructions`) of `creq`.
pub(super) fn decode(
    creq: &ChatRequest,
    wire: Vec<Box<RawValue>>,
    map: WireMap,
) -> Result<Decoded, DecodeError> {
    if is_set(creq.get_raw("previous_response_id")) || is_set(creq.get_raw("conversation")) {
        return Err(DecodeError::ServerState);
    }
    // Each item parsed as the walk reaches it and dropped once the walk is
    // past it: parsed all at once, a body of 200,000 text parts held them
    // all as `Value`s together, ~200 MB touched afresh per request (46,000
    // page faults against chat's 4,000 for the same conversation). A
    // request this walk refuses is walked again the strict way, whose
    // checks come in their documented order, so it is refused for the same
    // reason as before. The walk resumes after the longest kept decode of
    // a prefix of these items (`memo`).
    let fresh = WireMap {
        rough_fn: map.rough_fn,
        ..WireMap::default()
    };
    let instructions = creq.get_raw("instructions");
    let (resume, mut out, kept) = Resume::new(Api::Responses, instructions, &wire, fresh);
    let mut items = Items::lazy(&wire, resume.start);
    let walked = walk(creq, &mut items, &mut out, kept, !resume.resumed);
    match walked {
        Ok((map, cut)) => {
            let keep = resume.keep(cut, &out);
            Ok(finish(out, map, wire, keep))
        }
        Err(_) => {
            let mut items = Items::strict(&wire)?;
            let mut out = Vec::with_capacity(wire.len() + 1);
            let (map, _) = walk(creq, &mut items, &mut out, map, true)?;
            Ok(finish(out, map, wire, None))
        }
    }
}

fn finish(
    out: Vec<Box<RawValue>>,
    mut map: WireMap,
    wire: Vec<Box<RawValue>>,
    keep: Option<Keep>,
) -> Decoded {
    map.wire = wire;
    (out, map, keep)
}

/// The wire items as `Value`s, items `base..base + window.len()` at hand.
struct Items<'w> {
    wire: &'w [Box<RawValue>],
    window: std::collections::VecDeque<Value>,
    base: usize,
}

impl<'w> Items<'w> {
    /// Parsed when first read, forgotten once passed; items before
    /// `start` are never read.
    fn lazy(wire: &'w [Box<RawValue>], start: usize) -> Self {
        Self {
            wire,
            window: std::collections::VecDeque::new(),
            base: start,
        }
    }

    /// All parsed up front, then checked for server-side state.
    fn strict(wire: &'w [Box<RawValue>]) -> Result<Self, DecodeError> {
        let window: std::collections::VecDeque<Value> = wire
            .iter()
            .map(|w| serde_json::from_str(w.get()))
            .collect::<Result<_, _>>()
            .map_err(|_| DecodeError::Unsupported("item"))?;
        if window.iter().any(|v| item_type(v) == "item_reference") {
            return Err(DecodeError::ServerState);
        }
        Ok(Self {
            wire,
            window,
            base: 0,
        })
    }

    fn len(&self) -> usize {
        self.wire.len()
    }

    /// Item `i` (never one before the last [`Self::forget_before`]).
    fn get(&mut self, i: usize) -> Result<&mut Value, DecodeError> {
        while self.base + self.window.len() <= i {
            let w = &self.wire[self.base + self.window.len()];
            let v: Value =
                serde_json::from_str(w.get()).map_err(|_| DecodeError::Unsupported("item"))?;
            if item_type(&v) == "item_reference" {
                return Err(DecodeError::ServerState);
            }
            self.window.push_back(v);
        }
        self.window
            .get_mut(i - self.base)
            .ok_or(DecodeError::Unsupported("item"))
    }

    /// The walk will not read items before `i` again.
    fn forget_before(&mut self, i: usize) {
        while self.base < i && self.window.pop_front().is_some() {
            self.base += 1;
        }
    }
}

/// The decoding walk over `items` (see the module docs), from the first
/// item `items` holds (with the `instructions` member first when `head`);
/// with the map, the last place a later request's decode may resume from
/// (wire items, engine messages by then): not after trailing items joined
/// to the last group, nor after an assistant message, which call items
/// that follow would join.
fn walk(
    creq: &ChatRequest,
    items: &mut Items<'_>,
    out: &mut Vec<Box<RawValue>>,
    mut map: WireMap,
    head: bool,
) -> Result<(WireMap, (usize, usize)), DecodeError> {
    let instructions = creq
        .get_raw("instructions")
        .filter(|_| head)
        .and_then(|r| serde_json::from_str::<Value>(r.get()).ok());
    if let Some(Value::String(s)) = instructions {
        if !s.is_empty() {
            map.push_system(out, json!({"role": "system", "content": s}));
        }
    }
    let mut pending: Option<usize> = None;
    let mut cut = (items.base, out.len());
    let mut i = items.base;
    let len = items.len();
    while i < len {
        items.forget_before(pending.unwrap_or(i));
        let v = items.get(i)?;
        let start = pending.unwrap_or(i);
        if is_output(v) {
            // Taken, not cloned: an item is read once.
            let mut v = std::mem::take(v);
            let id = str_field(&v, "call_id").to_owned();
            map.results.insert(id.clone(), (i, None));
            let content = output_content(v.get_mut("output").map(Value::take));
            map.push(
                out,
                start..i + 1,
                vec![json!({"role": "tool", "tool_call_id": id, "content": content})],
            );
            pending = None;
            i += 1;
            cut = (i, out.len());
            continue;
        }
        let message = item_type(v) == "message";
        if !message && !is_call(v) {
            // Reasoning and unknown items travel with what follows them.
            pending.get_or_insert(i);
            i += 1;
            continue;
        }
        let mut m = if message {
            message_to_engine(std::mem::take(v))?
        } else {
            json!({"role": "assistant", "content": null})
        };
        let mut j = if message { i + 1 } else { i };
        let mut calls = Vec::new();
        // Call items that follow an assistant message join it: the place
        // after one is no cut.
        let open_ended = super::role(&m) == "assistant";
        if open_ended {
            while j < len && is_call(items.get(j)?) {
                let call = items.get(j)?;
                let id = str_field(call, "call_id").to_owned();
                map.calls.insert(id, (j, None));
                calls.push(call_to_engine(call));
                j += 1;
            }
        }
        if !calls.is_empty() {
            m["tool_calls"] = Value::Array(calls);
        }
        map.push(out, start..j, vec![m]);
        pending = None;
        i = j;
        if !open_ended {
            cut = (i, out.len());
        }
    }
    if let Some(p) = pending {
        // Trailing items join the last group.
        match map.groups.last_mut() {
            Some(g) if g.wire.end == p => g.wire.end = len,
            _ => return Err(DecodeError::Unsupported("input")),
        }
    }
    Ok((map, cut))
}

fn str_field<'a>(v: &'a Value, k: &str) -> &'a str {
    v.get(k).and_then(Value::as_str).unwrap_or_default()
}

fn message_to_engine(mut v: Value) -> Result<Value, DecodeError> {
    let role = match v.get("role").and_then(Value::as_str) {
        Some(r @ ("user" | "assistant" | "system" | "developer")) => r.to_owned(),
        r => {
            return Err(DecodeError::UnsupportedRole {
                member: "input",
                role: super::role_label(r),
            })
        }
    };
    let content = match v.get_mut("content").map(Value::take) {
        Some(s @ Value::String(_)) => s,
        Some(Value::Array(parts)) => Value::Array(parts.into_iter().map(part_to_engine).collect()),
        _ => return Err(DecodeError::Unsupported("content")),
    };
    Ok(json!({"role": role, "content": content}))
}

/// An `input_text` / `output_text` part as the engine's
/// `{"type":"text","text":…}`; others as they are. Rewritten in place: a
/// body of 100,000s of parts would otherwise allocate each one twice.
fn part_to_engine(mut p: Value) -> Value {
    if !matches!(item_type(&p), "input_text" | "output_text") {
        return p;
    }
    if let Value::Object(o) = &mut p {
        if o.contains_key("text") {
            o.retain(|k, _| k == "type" || k == "text");
            if let Some(t) = o.get_mut("type") {
                *t = Value::String("text".to_owned());
            }
        }
    }
    p
}

fn output_content(output: Option<Value>) -> Value {
    match output {
        Some(s @ Value::String(_)) => s,
        Some(Value::Array(parts)) => Value::Array(parts.into_iter().map(part_to_engine).collect()),
        Some(other) => Value::String(other.to_string()),
        None => Value::String(String::new()),
    }
}

fn call_to_engine(v: &Value) -> Value {
    let name = v
        .get("name")
        .and_then(Value::as_str)
        .unwrap_or_else(|| item_type(v));
    let arguments = match v.get("arguments").or_else(|| v.get("input")) {
        Some(Value::String(s)) => s.clone(),
        Some(other) => other.to_string(),
        None => v
            .get("action")
            .map_or_else(|| "{}".to_owned(), Value::to_string),
    };
    json!({
        "id": str_field(v, "call_id"),
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    })
}

/// Encodes what is to be sent as `input` items. `instructions` is never
/// rewritten (the first member is `None`).
pub(super) fn encode(
    map: &WireMap,
    outgoing: &[Box<RawValue>],
) -> (Option<Box<RawValue>>, Vec<Box<RawValue>>) {
    let mut items = Vec::with_capacity(outgoing.len());
    for piece in map.pieces(outgoing) {
        match piece {
            Piece::Wire(w, _) => items.push(w.to_owned()),
            // `instructions` carries it, untouched.
            Piece::Engine(_, true) => {}
            Piece::Engine(m, false) => {
                let Ok(v) = serde_json::from_str::<Value>(m.get()) else {
                    continue;
                };
                items.extend(convert(map, &v).iter().filter_map(to_raw));
            }
        }
    }
    (None, items)
}

fn parts_to_wire(content: &Value, role: &str) -> Value {
    let text_type = if role == "assistant" {
        "output_text"
    } else {
        "input_text"
    };
    match content {
        Value::Array(parts) => Value::Array(
            parts
                .iter()
                .map(|p| match (p, item_type(p)) {
                    (Value::String(s), _) => json!({"type": text_type, "text": s}),
                    (_, "text") => json!({"type": text_type, "text": p.get("text")}),
                    _ => p.clone(),
                })
                .collect(),
        ),
        Value::String(s) => Value::String(s.clone()),
        _ => Value::String(String::new()),
    }
}

fn blank(content: &Value) -> bool {
    match content {
        Value::String(s) => s.trim().is_empty(),
        Value::Array(a) => a.is_empty(),
        _ => true,
    }
}

/// One engine message the engine wrote or changed, as input items.
fn convert(map: &WireMap, v: &Value) -> Vec<Value> {
    let role = super::role(v);
    let content = v.get("content").cloned().unwrap_or(Value::Null);
    if role == "tool" {
        let id = str_field(v, "tool_call_id");
        let output = match &content {
            Value::String(s) => Value::String(s.clone()),
            other => parts_to_wire(other, "user"),
        };
        return vec![match map.original(true, id) {
            Some(mut item) => {
                item["output"] = output;
                item
            }
            None => json!({"type": "function_call_output", "call_id": id, "output": output}),
        }];
    }
    let mut out = Vec::new();
    if !blank(&content) || v.get("tool_calls").is_none() {
        let role = if role.is_empty() { "user" } else { role };
        out.push(
            json!({"type": "message", "role": role, "content": parts_to_wire(&content, role)}),
        );
    }
    for tc in v
        .get("tool_calls")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        out.push(call_to_wire(map, tc));
    }
    out
}

fn call_to_wire(map: &WireMap, tc: &Value) -> Value {
    let id = str_field(tc, "id");
    let f = tc.get("function");
    let arguments = f
        .and_then(|f| f.get("arguments"))
        .cloned()
        .unwrap_or_else(|| Value::String("{}".to_owned()));
    match map.original(false, id) {
        Some(mut item) => {
            // Only a string field the engine may have shortened changes.
            for key in ["arguments", "input"] {
                if item.get(key).is_some_and(Value::is_string) {
                    item[key] = arguments;
                    break;
                }
            }
            item
        }
        None => json!({
            "type": "function_call",
            "call_id": id,
            "name": f.and_then(|f| f.get("name")).cloned().unwrap_or(Value::Null),
            "arguments": arguments,
        }),
    }
}
