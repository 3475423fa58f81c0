//! The size rule a candidate must pass, and the mechanical shrinking of
//! one that misses it.

use serde_json::Value;

use crate::markers::{self, Handoff};
use crate::prune;
use crate::view;

/// Salvage caps a standalone summary at this many characters.
pub(super) const SALVAGE_SUMMARY_MAX_CHARS: usize = 8_000;
/// Salvage keeps this many newest tool bodies.
pub(super) const SALVAGE_KEEP_TOOL_RESULTS: usize = 2;

/// Whether a candidate is smaller than its input. At or over the trigger
/// threshold (every automatic compaction) only fewer tokens count: a
/// token-neutral rewrite would re-fire on the next request. Below it (manual
/// or forced calls on short chats) fewer rows also count, which is the
/// guard against "messages N→N" loops.
pub(super) fn is_progress(
    tokens_before: u64,
    tokens_after: u64,
    rows_before: usize,
    rows_after: usize,
    threshold: u64,
) -> bool {
    tokens_after < tokens_before || (tokens_before < threshold && rows_after < rows_before)
}

/// Where the summary carrier ended up after sanitising removed rows.
pub(super) fn locate_summary(out: &[Value], hint: usize) -> Option<usize> {
    if out.get(hint).is_some_and(view::is_summary) {
        return Some(hint);
    }
    out.iter().position(view::is_summary)
}

/// Images in rows before the newest image-bearing user row are replaced by
/// a text stub: they were seen already and cost thousands of tokens each.
pub(super) fn strip_historical_media(out: &mut [Value]) {
    let Some(newest) = out
        .iter()
        .rposition(|m| view::is_role(m, "user") && view::has_image(m))
    else {
        return;
    };
    for m in out[..newest].iter_mut() {
        if !view::is_role(m, "user") || !view::has_image(m) {
            continue;
        }
        if let Some(Value::Array(parts)) = m.get_mut("content") {
            for p in parts.iter_mut() {
                if view::is_image_part(p) {
                    *p = serde_json::json!({"type": "text", "text": "[Attached image — stripped after compression]"});
                }
            }
        }
        if let Some(o) = m.as_object_mut() {
            o.remove("api_content");
        }
    }
}

/// Mechanical shrinking of a candidate that is not smaller than its input:
/// drop thinking from older assistants, clear old tool
/// bodies, cap a standalone summary.
pub(super) fn salvage(out: &mut [Value], summary_index: Option<usize>) {
    let newest_asst = view::last_assistant(out);
    for (i, m) in out.iter_mut().enumerate() {
        if Some(i) != newest_asst && view::is_role(m, "assistant") {
            if let Some(o) = m.as_object_mut() {
                o.remove("reasoning");
                o.remove("reasoning_content");
                o.remove("reasoning_details");
            }
        }
    }
    let mut kept = 0;
    for m in out.iter_mut().rev() {
        if !view::is_role(m, "tool") {
            continue;
        }
        let long = m
            .get("content")
            .and_then(Value::as_str)
            .is_some_and(|c| c.chars().count() > prune::PRUNE_MIN_CHARS);
        if !long {
            continue;
        }
        if kept < SALVAGE_KEEP_TOOL_RESULTS {
            kept += 1;
            continue;
        }
        if let Some(o) = m.as_object_mut() {
            o.insert(
                "content".into(),
                Value::String(prune::OLD_TOOL_OUTPUT_CLEARED.to_string()),
            );
            o.remove("api_content");
        }
    }
    if let Some(si) = summary_index {
        if let Some(Value::String(c)) = out[si].get("content").cloned() {
            if matches!(
                markers::classify_handoff(&out[si]),
                Handoff::Standalone { live: None, .. }
            ) && c.chars().count() > SALVAGE_SUMMARY_MAX_CHARS
            {
                let body = markers::summary_body(&c);
                let keep = SALVAGE_SUMMARY_MAX_CHARS
                    .saturating_sub(markers::SUMMARY_PREFIX.len() + markers::END_MARKER.len() + 64);
                let body: String = body.chars().take(keep).collect();
                let text = markers::standalone_content(&markers::normalize_summary_prefix(
                    &format!("{body}\n...[summary truncated]"),
                ));
                if let Some(o) = out[si].as_object_mut() {
                    o.insert("content".into(), Value::String(text));
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn progress_rule() {
        assert!(is_progress(100, 99, 10, 10, 50));
        assert!(
            !is_progress(100, 100, 10, 5, 50),
            "over threshold: tokens must drop"
        );
        assert!(
            is_progress(40, 45, 10, 5, 50),
            "under threshold: fewer rows count"
        );
        assert!(!is_progress(40, 45, 10, 10, 50));
    }
}
