//! Tool-pair sanitising after the splice.
//!
//! Providers reject a tool result whose call is gone ("No tool call found for
//! function call output") and an assistant tool call without a result
//! ("tool call result does not follow tool call"). So orphans on both sides
//! are removed. Stub results are never inserted: a later repair pass keyed on
//! a different id spelling silently dropped them and re-exposed the orphan.

use std::collections::HashSet;

use serde_json::Value;

use super::view;

/// Content given to an assistant row that lost all its tool calls and had no
/// text, so the row stays a valid, non-empty message.
pub(crate) const TOOL_CALL_REMOVED: &str = "(tool call removed)";

/// Removes tool results without a surviving call and tool calls without a
/// result. The final row, when it is an assistant with tool calls, is the
/// in-flight turn whose results the client has not appended yet; it is left
/// alone.
pub(super) fn sanitize_tool_pairs(mut msgs: Vec<Value>) -> Vec<Value> {
    let inflight = msgs
        .last()
        .filter(|m| view::has_tool_calls(m))
        .map(|_| msgs.len() - 1);

    let mut call_ids: HashSet<String> = HashSet::new();
    for m in &msgs {
        if let Some(calls) = view::tool_calls(m) {
            for tc in calls {
                call_ids.extend(view::call_ids(tc).map(str::to_owned));
            }
        }
    }
    msgs.retain(|m| {
        !view::is_role(m, "tool") || view::result_id(m).is_some_and(|id| call_ids.contains(id))
    });

    let result_ids: HashSet<String> = msgs
        .iter()
        .filter(|m| view::is_role(m, "tool"))
        .filter_map(|m| view::result_id(m).map(str::to_owned))
        .collect();
    let last = msgs.len().saturating_sub(1);
    for (i, m) in msgs.iter_mut().enumerate() {
        if Some(i) == inflight && i == last {
            continue;
        }
        strip_orphan_calls(m, &result_ids);
    }
    msgs
}

fn strip_orphan_calls(m: &mut Value, result_ids: &HashSet<String>) {
    let Some(obj) = m.as_object_mut() else { return };
    let Some(Value::Array(calls)) = obj.get_mut("tool_calls") else {
        return;
    };
    let before = calls.len();
    calls.retain(|tc| view::call_ids(tc).any(|id| result_ids.contains(id)));
    if calls.len() == before && before > 0 {
        return;
    }
    if calls.is_empty() {
        obj.remove("tool_calls");
        let empty = match obj.get("content") {
            None | Some(Value::Null) => true,
            Some(Value::String(s)) => s.trim().is_empty(),
            Some(Value::Array(a)) => a.is_empty(),
            Some(_) => false,
        };
        if empty {
            obj.insert(
                "content".to_string(),
                Value::String(TOOL_CALL_REMOVED.to_string()),
            );
        }
    }
    obj.remove("api_content");
}

#[cfg(test)]
mod tests;
