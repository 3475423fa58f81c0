//! Assembly of the compacted conversation, with its user-turn guarantee:
//! head + summary + tail, with the summary's role
//! chosen so that no two user or two assistant rows end up side by side, and
//! merged into the first tail row when neither role fits.

use serde_json::{json, Value};

use super::markers::{self, END_MARKER, INFLIGHT_HEADER};
use super::view;

/// User message appended when a conversation has no human-authored turn at
/// all, so strict chat templates ("No user query found") accept it.
pub(super) const NO_USER_TURN_MARKER: &str =
    "Continue from the compressed conversation context above. \
This marker exists because no human user turn was available.";

/// Where the summary went.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Placement {
    /// A message of its own with this role.
    Standalone(&'static str),
    /// Prepended to the first user row of the tail (the summary had to be the
    /// user turn and the tail already starts with one).
    MergeUserLeading,
    /// Wrapped around the first tail row, whose old content is kept as
    /// delimited prior context before the summary.
    MergeIntoTail,
}

/// The assembled conversation and the index of the row carrying the summary.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Assembled {
    /// The messages to send.
    pub(crate) messages: Vec<Value>,
    /// Index of the summary carrier in `messages`.
    pub(crate) summary_index: usize,
    /// How the summary was placed.
    pub(crate) placement: Placement,
}

fn role_kind(m: &Value) -> Option<&'static str> {
    match view::role(m) {
        "user" => Some("user"),
        "assistant" => Some("assistant"),
        "system" | "developer" => Some("system"),
        "tool" => Some("tool"),
        _ => None,
    }
}

/// Roles next to the gap, raw and as strict alternation checks see them.
struct Neighbours {
    raw_head: Option<&'static str>,
    vis_head: Option<&'static str>,
    raw_tail: Option<&'static str>,
    vis_tail: Option<&'static str>,
}

impl Neighbours {
    fn of(head: &[Value], tail: &[Value]) -> Self {
        Self {
            raw_head: head.last().and_then(role_kind),
            vis_head: head
                .iter()
                .rev()
                .find(|m| !view::is_alternation_exempt(m))
                .and_then(role_kind),
            raw_tail: tail.first().and_then(role_kind),
            vis_tail: tail
                .iter()
                .find(|m| !view::is_alternation_exempt(m))
                .and_then(role_kind),
        }
    }

    fn conflicts(&self, role: &str) -> bool {
        [self.raw_head, self.vis_head, self.raw_tail, self.vis_tail].contains(&Some(role))
    }
}

/// True when the summary must be a user message: it would be the first
/// visible message (Anthropic/Bedrock move the system prompt out), or
/// no user text survives in head and tail ("No user query found").
pub(crate) fn must_force_user(head: &[Value], tail: &[Value]) -> bool {
    let only_system_head = head
        .last()
        .map(|m| role_kind(m) == Some("system"))
        .unwrap_or(true);
    let user_survives = head
        .iter()
        .chain(tail.iter())
        .any(|m| view::is_role(m, "user") && !view::is_blank(m));
    only_system_head || !user_survives
}

/// Chooses where the summary goes.
pub(crate) fn choose_placement(head: &[Value], tail: &[Value]) -> Placement {
    let forced = must_force_user(head, tail);
    let nb = Neighbours::of(head, tail);
    let preferred = if forced || matches!(nb.vis_head, None | Some("assistant" | "tool")) {
        "user"
    } else {
        "assistant"
    };
    if !nb.conflicts(preferred) {
        return Placement::Standalone(preferred);
    }
    let flipped = if preferred == "user" {
        "assistant"
    } else {
        "user"
    };
    if !forced && nb.vis_head.is_some() && !nb.conflicts(flipped) {
        return Placement::Standalone(flipped);
    }
    if tail.is_empty() {
        return Placement::Standalone(preferred);
    }
    if forced {
        // The summary must lead as a user turn. Merge only into a user row
        // right at the boundary; merging into a later one would make an
        // assistant row the first visible message.
        if nb.raw_tail == Some("user") {
            Placement::MergeUserLeading
        } else {
            Placement::Standalone(preferred)
        }
    } else {
        Placement::MergeIntoTail
    }
}

fn set_content(m: &mut Value, c: Value) {
    if let Some(o) = m.as_object_mut() {
        o.insert("content".to_string(), c);
        // The sidecar would replace the merged content on the wire.
        o.remove("api_content");
    }
}

/// Joins head, summary and tail. `summary` is the prefixed summary text
/// (prefix + body), without the END marker.
pub(crate) fn assemble(head: Vec<Value>, summary: &str, tail: Vec<Value>) -> Assembled {
    let placement = choose_placement(&head, &tail);
    let mut messages = head;
    let base = messages.len();
    let summary_index = match placement {
        Placement::Standalone(role) => {
            let mut row = json!({"role": role, "content": markers::standalone_content(summary)});
            markers::declare_summary(&mut row);
            messages.push(row);
            messages.extend(tail);
            base
        }
        Placement::MergeUserLeading => {
            messages.extend(tail);
            let idx = base;
            let merged = markers::prepend_summary(
                messages[idx].get("content").unwrap_or(&Value::Null),
                summary,
            );
            set_content(&mut messages[idx], merged);
            markers::declare_summary(&mut messages[idx]);
            idx
        }
        Placement::MergeIntoTail => {
            messages.extend(tail);
            let idx = base;
            let merged = markers::merge_after_prior(
                messages[idx].get("content").unwrap_or(&Value::Null),
                summary,
            );
            set_content(&mut messages[idx], merged);
            markers::declare_summary(&mut messages[idx]);
            idx
        }
    };
    Assembled {
        messages,
        summary_index,
        placement,
    }
}

/// Assembly for a split active turn: `tail` starts with the newest user ask
/// (already stripped of any earlier summary) followed by the kept tool
/// rounds. The summary is prepended to that ask, giving one user row
/// `summary + END + blank line + ask` (the forced user-leading shape), unless
/// the head already ends in a visible user turn: then a user-leading merge
/// would put two user turns side by side, and the ordinary placement (a
/// standalone assistant summary before the untouched ask) is used.
pub(crate) fn assemble_split_turn(head: Vec<Value>, summary: &str, tail: Vec<Value>) -> Assembled {
    let nb = Neighbours::of(&head, &[]);
    let head_user = nb.raw_head == Some("user") || nb.vis_head == Some("user");
    let tail_user = tail.first().is_some_and(|m| view::is_role(m, "user"));
    if head_user || !tail_user {
        return assemble(head, summary, tail);
    }
    let mut messages = head;
    let idx = messages.len();
    messages.extend(tail);
    let merged = markers::prepend_summary(
        messages[idx].get("content").unwrap_or(&Value::Null),
        summary,
    );
    set_content(&mut messages[idx], merged);
    markers::declare_summary(&mut messages[idx]);
    Assembled {
        messages,
        summary_index: idx,
        placement: Placement::MergeUserLeading,
    }
}

/// True when a real user row follows the summary carrier, or the carrier has
/// live content after its END marker (the user-leading merge).
fn live_user_after(messages: &[Value], summary_index: usize) -> bool {
    if messages[summary_index + 1..].iter().any(view::is_real_user) {
        return true;
    }
    let text = view::text(&messages[summary_index]);
    text.rfind(END_MARKER)
        .map(|p| !text[p + END_MARKER.len()..].trim().is_empty())
        .unwrap_or(false)
}

/// Re-appends the newest real user ask when it went into the head or the
/// summary and is still unfinished: without it, the summary prefix
/// tells the model to act only on user messages after it, and there are none.
/// Returns true when something was added.
pub(crate) fn reappend_inflight_task(
    messages: &mut Vec<Value>,
    summary_index: usize,
    original: &[Value],
) -> bool {
    let Some(u) = view::last_real_user(original, 0) else {
        return false;
    };
    let finished = original.last().is_some_and(|m| {
        view::is_role(m, "assistant") && !view::is_blank(m) && !view::has_tool_calls(m)
    });
    if finished || summary_index >= messages.len() || live_user_after(messages, summary_index) {
        return false;
    }
    let ask = strip_inflight_header(&view::text(&original[u]));
    let copy = format!("{INFLIGHT_HEADER}\n{ask}");
    append_user_text(messages, &copy);
    true
}

fn strip_inflight_header(text: &str) -> String {
    let mut t = text.trim_start();
    while let Some(rest) = t.strip_prefix(INFLIGHT_HEADER) {
        t = rest.trim_start();
    }
    t.to_string()
}

/// Appends user text, merged into a trailing user row rather than creating a
/// user/user pair.
fn append_user_text(messages: &mut Vec<Value>, text: &str) {
    let last_visible_user = messages
        .iter()
        .rev()
        .find(|m| !view::is_alternation_exempt(m))
        .is_some_and(|m| view::is_role(m, "user"));
    let last_is_user = messages.last().is_some_and(|m| view::is_role(m, "user"));
    if last_is_user
        || (last_visible_user && messages.last().is_some_and(|m| !view::is_role(m, "tool")))
    {
        if let Some(last) = messages.iter_mut().rev().find(|m| view::is_role(m, "user")) {
            let c = last.get("content").cloned().unwrap_or(Value::Null);
            let merged = match c {
                Value::Array(mut parts) => {
                    parts.push(json!({"type": "text", "text": format!("\n\n{text}")}));
                    Value::Array(parts)
                }
                Value::String(s) if !s.is_empty() => Value::String(format!("{s}\n\n{text}")),
                _ => Value::String(text.to_string()),
            };
            set_content(last, merged);
            return;
        }
    }
    messages.push(json!({"role": "user", "content": text}));
}

/// The caller's guarantee: some real user row survives. The newest one
/// from the original is re-inserted when none does; a fixed marker is used
/// when the conversation never had one. Returns true when something was added.
pub(super) fn ensure_user_turn(messages: &mut Vec<Value>, original: &[Value]) -> bool {
    if messages
        .iter()
        .any(|m| view::is_real_user(m) || view::text(m).contains(NO_USER_TURN_MARKER))
    {
        return false;
    }
    match view::last_real_user(original, 0) {
        Some(u) => append_user_text(messages, &view::text(&original[u])),
        None => append_user_text(messages, NO_USER_TURN_MARKER),
    }
    true
}

#[cfg(test)]
mod tests;
