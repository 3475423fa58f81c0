//! Read-only helpers over wire messages (`serde_json::Value` objects), shared
//! by the pipeline modules. Nothing here allocates per character.

use serde_json::Value;

use super::markers::{self, Handoff};

/// Content prefixes of user-role rows that an agent runtime injects (todo
/// snapshots, truncation notices, background-process reports, model-switch
/// notes) rather than a human writes. They never anchor the tail, the task
/// snapshot or a fallback summary's "latest ask".
const SYNTHETIC_USER_PREFIXES: &[&str] = &[
    "[Your active task list was preserved",
    "[System:",
    "[SYSTEM:",
    "[System note:",
    "[Background process",
    "[background process",
    "[Note: model was just switched",
    "[IMPORTANT: Background",
    "[Note from compactor",
    // compactor's own stand-in for a missing user turn (assemble.rs).
    "Continue from the compressed conversation context above.",
];

/// The message's role, or `""`.
pub(super) fn role(m: &Value) -> &str {
    m.get("role").and_then(Value::as_str).unwrap_or("")
}

/// True when the message has the given role.
pub(super) fn is_role(m: &Value, r: &str) -> bool {
    role(m) == r
}

/// The non-empty `tool_calls` array of an assistant row.
pub(super) fn tool_calls(m: &Value) -> Option<&Vec<Value>> {
    m.get("tool_calls")
        .and_then(Value::as_array)
        .filter(|a| !a.is_empty())
}

/// True for an assistant row that carries at least one tool call.
pub(crate) fn has_tool_calls(m: &Value) -> bool {
    is_role(m, "assistant") && tool_calls(m).is_some()
}

/// Every id spelling of one tool call (`id`, `call_id`, `response_item_id`).
pub(crate) fn call_ids(tc: &Value) -> impl Iterator<Item = &str> {
    ["id", "call_id", "response_item_id"]
        .into_iter()
        .filter_map(move |k| tc.get(k).and_then(Value::as_str))
        .filter(|s| !s.is_empty())
}

/// The id a tool result answers.
pub(super) fn result_id(m: &Value) -> Option<&str> {
    m.get("tool_call_id")
        .or_else(|| m.get("call_id"))
        .and_then(Value::as_str)
}

/// Concatenated text of the content: the string itself, or the text parts of
/// a list joined with a space. Null and other shapes give an empty string.
pub(super) fn text(m: &Value) -> String {
    content_text(m.get("content").unwrap_or(&Value::Null))
}

/// The text of a content value, for matching and classification: the
/// string itself, or the text parts of a list joined with a space (media
/// and other parts contribute nothing). See `serialize::render_content` for
/// the rendering a reader gets.
pub(super) fn content_text(c: &Value) -> String {
    match c {
        Value::String(s) => s.clone(),
        Value::Array(parts) => {
            let mut out = String::new();
            for p in parts {
                if let Some(t) = part_text(p) {
                    if !out.is_empty() {
                        out.push(' ');
                    }
                    out.push_str(t);
                }
            }
            out
        }
        _ => String::new(),
    }
}

/// The text of one content part, if it is a text part.
pub(crate) fn part_text(p: &Value) -> Option<&str> {
    match p {
        Value::String(s) => Some(s),
        Value::Object(o) => o.get("text").and_then(Value::as_str),
        _ => None,
    }
}

/// True for an image-bearing content part.
pub(crate) fn is_image_part(p: &Value) -> bool {
    matches!(
        p.get("type").and_then(Value::as_str),
        Some("image_url" | "input_image" | "image")
    )
}

/// True when the message's content holds at least one image part.
pub(crate) fn has_image(m: &Value) -> bool {
    m.get("content")
        .and_then(Value::as_array)
        .is_some_and(|parts| parts.iter().any(is_image_part))
}

/// True when the content carries no text and no non-text parts.
pub(crate) fn is_blank(m: &Value) -> bool {
    match m.get("content") {
        None | Some(Value::Null) => true,
        Some(Value::String(s)) => s.trim().is_empty(),
        Some(Value::Array(parts)) => parts
            .iter()
            .all(|p| part_text(p).is_some_and(|t| t.trim().is_empty())),
        Some(_) => false,
    }
}

/// True when the row is a compaction handoff (standalone or merged summary).
pub fn is_summary(m: &Value) -> bool {
    !matches!(markers::classify_handoff(m), Handoff::None)
}

/// True for user rows injected by a runtime rather than typed by a human:
/// flagged by a private `_…synthetic: true` key (agent runtimes mark their
/// own rows so; a client may still carry the flag), opened by a known
/// runtime prefix, or a compaction handoff.
pub(super) fn is_synthetic_user(m: &Value) -> bool {
    if !is_role(m, "user") {
        return false;
    }
    let flagged = m.as_object().is_some_and(|o| {
        o.iter().any(|(k, v)| {
            k.starts_with('_') && k.ends_with("synthetic") && v.as_bool() == Some(true)
        })
    });
    if flagged {
        return true;
    }
    let t = text(m);
    let t = t.trim_start();
    SYNTHETIC_USER_PREFIXES.iter().any(|p| t.starts_with(p)) || markers::is_handoff(m)
}

/// A user row a human wrote: not blank, not synthetic, not a summary carrier.
pub(super) fn is_real_user(m: &Value) -> bool {
    is_role(m, "user") && !is_blank(m) && !is_synthetic_user(m) && !is_summary(m)
}

/// Index of the newest real user row at or after `from`.
pub(super) fn last_real_user(msgs: &[Value], from: usize) -> Option<usize> {
    (from..msgs.len()).rev().find(|&i| is_real_user(&msgs[i]))
}

/// Index of the newest assistant row (any kind).
pub(crate) fn last_assistant(msgs: &[Value]) -> Option<usize> {
    msgs.iter().rposition(|m| is_role(m, "assistant"))
}

/// True for rows that strict alternation checks do not see: tool results and
/// assistant rows that only carry tool calls.
pub(super) fn is_alternation_exempt(m: &Value) -> bool {
    is_role(m, "tool") || has_tool_calls(m)
}
