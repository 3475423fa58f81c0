//! Phase 1 of a compaction: tool-output pruning without any LLM call.
//! Cheap, deterministic work first: identical tool outputs
//! are deduplicated, old tool results become one-line summaries, oversized
//! tool-call arguments are shrunk inside their JSON, old images are retired,
//! and a protected tail that is still too large is demoted under pressure.

use std::collections::HashMap;

use serde_json::Value;
use xxhash_rust::xxh3::xxh3_128;

use super::args::{truncate_tool_call_args_json, DEFAULT_MAX_LEAF_CHARS};
use super::tool_summary::summarize_tool_result;
use super::view;

/// Tool outputs shorter than this are never pruned or deduplicated.
pub(crate) const PRUNE_MIN_CHARS: usize = 200;
/// Tool-call arguments are shrunk only above this size.
pub(crate) const ARGS_SHRINK_MIN_CHARS: usize = 500;
/// Rows at the very end that the pressure pass never rewrites.
pub(crate) const PRESSURE_KEEP_RECENT_MESSAGES: usize = 3;
/// Image-bearing tool results (newest first) that keep their images.
pub(crate) const KEEP_RECENT_TOOL_IMAGES: usize = 3;

/// Replacement for an older copy of an identical tool output.
pub(crate) const DUPLICATE_TOOL_OUTPUT: &str =
    "[Duplicate tool output — same content as a more recent call]";
/// Replacement for an image part of an old tool result.
pub(crate) const SCREENSHOT_REMOVED: &str = "[screenshot removed to save context]";
/// Placeholder the salvage pass leaves in cleared tool bodies.
pub(crate) const OLD_TOOL_OUTPUT_CLEARED: &str = "[Old tool output cleared to save context space]";

/// How much of the conversation the pruning passes protect.
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct PruneParams {
    /// Count floor of the protected tail.
    pub(crate) protect_tail_count: usize,
    /// Token budget of the protected tail; `None` protects by count only.
    pub(crate) protect_tail_tokens: Option<u64>,
    /// Soft ceiling of the protected tail for the pressure pass (pass 4);
    /// `None` disables the pass.
    pub(crate) soft_ceiling: Option<u64>,
    /// Minimum size of a tool output worth summarising (200; 8,000 on the
    /// proactive path).
    pub(crate) min_prune_chars: usize,
    /// The pressure pass leaves the newest tool result alone when it costs
    /// at most this many tokens (`None`: the last resort demotes
    /// it too). Small windows set it: an agent whose just-returned result is
    /// replaced by a one-line stub repeats the call, turn after turn.
    pub(crate) keep_newest_tool_max: Option<u64>,
}

impl PruneParams {
    /// Count-only protection with the default prune floor.
    // Only tests build count-only parameters.
    #[cfg(test)]
    pub(super) fn by_count(protect_tail_count: usize) -> Self {
        Self {
            protect_tail_count,
            protect_tail_tokens: None,
            soft_ceiling: None,
            min_prune_chars: PRUNE_MIN_CHARS,
            keep_newest_tool_max: None,
        }
    }
}

/// Tool name and arguments of every call, by call id.
fn call_map(msgs: &[Value]) -> HashMap<&str, (&str, &str)> {
    let mut map = HashMap::new();
    for m in msgs {
        if let Some(calls) = view::tool_calls(m) {
            for tc in calls {
                let f = tc.get("function");
                let name = f
                    .and_then(|f| f.get("name"))
                    .and_then(Value::as_str)
                    .unwrap_or("tool");
                let args = f
                    .and_then(|f| f.get("arguments"))
                    .and_then(Value::as_str)
                    .unwrap_or("");
                for id in view::call_ids(tc) {
                    map.insert(id, (name, args));
                }
            }
        }
    }
    map
}

/// First row of the protected tail.
pub(crate) fn prune_boundary(msgs: &[Value], p: &PruneParams, costs: Option<&[u64]>) -> usize {
    let n = msgs.len();
    match p.protect_tail_tokens {
        None => n.saturating_sub(p.protect_tail_count),
        Some(budget) => {
            let owned;
            let costs = match costs {
                Some(c) => c,
                None => {
                    owned = super::tail::row_costs(msgs);
                    &owned
                }
            };
            let mut acc: u64 = 0;
            let mut boundary = n;
            for i in (0..n).rev() {
                acc = acc.saturating_add(costs[i]);
                boundary = i;
                if acc > budget {
                    break;
                }
            }
            let floor = p
                .protect_tail_count
                .min(n)
                .min(super::tail::MAX_TAIL_MESSAGE_FLOOR);
            boundary.min(n - floor)
        }
    }
}

fn is_stub(s: &str) -> bool {
    s.starts_with('[') && s.contains(" chars)") && s.len() < 400
}

fn set_content(m: &mut Value, c: Value) {
    if let Some(o) = m.as_object_mut() {
        o.insert("content".to_string(), c);
        o.remove("api_content");
    }
}

/// Replaces image parts of a list content with a text stub. True if changed.
fn strip_images(m: &mut Value, stub: &str) -> bool {
    let Some(Value::Array(parts)) = m.get_mut("content") else {
        return false;
    };
    let mut changed = false;
    for p in parts.iter_mut() {
        if view::is_image_part(p) {
            *p = serde_json::json!({"type": "text", "text": stub});
            changed = true;
        }
    }
    if changed {
        if let Some(o) = m.as_object_mut() {
            o.remove("api_content");
        }
    }
    changed
}

/// One-line summary for a tool row, if it is worth summarising.
fn demote_tool_row(
    m: &Value,
    calls: &HashMap<&str, (&str, &str)>,
    min_chars: usize,
) -> Option<String> {
    let content = m.get("content")?.as_str()?;
    if content.is_empty()
        || content == DUPLICATE_TOOL_OUTPUT
        || content == OLD_TOOL_OUTPUT_CLEARED
        || content.starts_with("[screenshot removed")
        || is_stub(content)
        || content.chars().count() <= min_chars
    {
        return None;
    }
    let (name, args) = view::result_id(m)
        .and_then(|id| calls.get(id).copied())
        .unwrap_or(("tool", ""));
    Some(summarize_tool_result(name, args, content))
}

/// Shrinks large tool-call arguments of an assistant row. True if changed.
fn shrink_args(m: &mut Value) -> bool {
    let mut changed = false;
    if let Some(Value::Array(calls)) = m.get_mut("tool_calls") {
        for tc in calls.iter_mut() {
            let Some(f) = tc.get_mut("function") else {
                continue;
            };
            let Some(Value::String(args)) = f.get_mut("arguments") else {
                continue;
            };
            if args.len() <= ARGS_SHRINK_MIN_CHARS {
                continue;
            }
            let shrunk = truncate_tool_call_args_json(args, DEFAULT_MAX_LEAF_CHARS);
            if shrunk.len() < args.len() {
                *args = shrunk;
                changed = true;
            }
        }
    }
    if changed {
        if let Some(o) = m.as_object_mut() {
            o.remove("api_content");
        }
    }
    changed
}

/// Runs pruning passes 1–4 and returns the rewritten conversation and the
/// number of rows changed. Rows that are not changed are copied unchanged.
pub(super) fn prune_old_tool_results(msgs: &[Value], p: &PruneParams) -> (Vec<Value>, usize) {
    let mut out: Vec<Value> = msgs.to_vec();
    let n = out.len();
    if n == 0 {
        return (out, 0);
    }
    let costs = p.protect_tail_tokens.map(|_| super::tail::row_costs(msgs));
    let boundary = prune_boundary(msgs, p, costs.as_deref());
    let calls = call_map(msgs);
    let mut changed = vec![false; n];

    // Pass 1: dedup identical tool outputs (lossless, ignores the boundary).
    let mut seen = std::collections::HashSet::new();
    for i in (0..n).rev() {
        if !view::is_role(&out[i], "tool") {
            continue;
        }
        let Some(s) = out[i].get("content").and_then(Value::as_str) else {
            continue;
        };
        if s.chars().count() < PRUNE_MIN_CHARS {
            continue;
        }
        if !seen.insert(xxh3_128(s.as_bytes())) {
            set_content(
                &mut out[i],
                Value::String(DUPLICATE_TOOL_OUTPUT.to_string()),
            );
            changed[i] = true;
        }
    }

    // Pass 2 and 3: rows before the boundary.
    for i in 0..boundary.min(n) {
        if view::is_role(&out[i], "tool") {
            if strip_images(&mut out[i], SCREENSHOT_REMOVED) {
                changed[i] = true;
            }
            if let Some(line) = demote_tool_row(&out[i], &calls, p.min_prune_chars) {
                set_content(&mut out[i], Value::String(line));
                changed[i] = true;
            }
        } else if view::has_tool_calls(&out[i]) && shrink_args(&mut out[i]) {
            changed[i] = true;
        }
    }

    // Pass 3.5: only the newest few tool images survive, tail included.
    let mut kept_images = 0;
    for i in (0..n).rev() {
        if view::is_role(&out[i], "tool") && view::has_image(&out[i]) {
            if kept_images < KEEP_RECENT_TOOL_IMAGES {
                kept_images += 1;
            } else if strip_images(&mut out[i], SCREENSHOT_REMOVED) {
                changed[i] = true;
            }
        }
    }

    // Pass 4: pressure demotion inside an oversized protected tail.
    if let (Some(soft), Some(_)) = (p.soft_ceiling, p.protect_tail_tokens) {
        pressure_pass(
            &mut out,
            &mut changed,
            boundary,
            soft,
            p.keep_newest_tool_max,
            &calls,
        );
    }

    let count = changed.iter().filter(|c| **c).count();
    (out, count)
}

fn pressure_pass(
    out: &mut [Value],
    changed: &mut [bool],
    boundary: usize,
    soft: u64,
    keep_newest_max: Option<u64>,
    calls: &HashMap<&str, (&str, &str)>,
) {
    let n = out.len();
    if boundary >= n {
        return;
    }
    let newest_asst = super::tokens::newest_assistant_index(out);
    let mut costs = super::tail::row_costs(out);
    let mut region: u64 = costs[boundary..].iter().sum();
    if region <= soft {
        return;
    }
    let keep_newest = (boundary..n)
        .rev()
        .find(|&i| view::is_role(&out[i], "tool"))
        .is_some_and(|i| keep_newest_max.is_some_and(|max| costs[i] <= max));
    let mut demote = |out: &mut [Value], changed: &mut [bool], i: usize, region: &mut u64| {
        let did = if view::is_role(&out[i], "tool") {
            match demote_tool_row(&out[i], calls, PRUNE_MIN_CHARS) {
                Some(line) => {
                    set_content(&mut out[i], Value::String(line));
                    true
                }
                None => false,
            }
        } else {
            view::has_tool_calls(&out[i]) && shrink_args(&mut out[i])
        };
        if did {
            changed[i] = true;
            let c = super::tokens::estimate_msg_budget_tokens(&out[i], Some(i) == newest_asst);
            *region = region.saturating_sub(costs[i]).saturating_add(c);
            costs[i] = c;
        }
        did
    };
    // 1. Oldest protected rows first, stopping as soon as the region fits.
    let stop = n.saturating_sub(PRESSURE_KEEP_RECENT_MESSAGES);
    for i in boundary..stop {
        if demote(out, changed, i, &mut region) && region <= soft {
            return;
        }
    }
    // 2. Every protected tool row except the newest tool result.
    let newest_tool = (boundary..n)
        .rev()
        .find(|&i| view::is_role(&out[i], "tool"));
    for i in boundary..n {
        if Some(i) != newest_tool {
            demote(out, changed, i, &mut region);
        }
    }
    if region <= soft {
        return;
    }
    // 3. Last resort: the newest one as well, unless it is small enough to
    // keep.
    if let Some(i) = newest_tool {
        if keep_newest {
            return;
        }
        demote(out, changed, i, &mut region);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn call(id: &str) -> Value {
        json!({"role": "assistant", "content": null, "tool_calls": [{"id": id, "type": "function",
            "function": {"name": "read_file", "arguments": format!("{{\"path\":\"/x/{id}\"}}")}}]})
    }
    fn result(id: &str, content: Value) -> Value {
        json!({"role": "tool", "tool_call_id": id, "content": content})
    }

    #[test]
    fn older_identical_outputs_are_deduplicated_even_in_the_tail() {
        let body = "same ".repeat(100);
        let msgs = vec![
            call("a"),
            result("a", json!(body)),
            call("b"),
            result("b", json!(body)),
        ];
        let (out, n) = prune_old_tool_results(&msgs, &PruneParams::by_count(10));
        assert_eq!(n, 1);
        assert_eq!(out[1]["content"], DUPLICATE_TOOL_OUTPUT);
        assert_eq!(out[3]["content"], json!(body));
    }

    #[test]
    fn old_results_become_one_line_summaries_and_tail_stays() {
        let msgs = vec![
            call("a"),
            result("a", json!("x".repeat(1_000))),
            json!({"role": "user", "content": "next"}),
            call("b"),
            result("b", json!("y".repeat(1_000))),
        ];
        let (out, n) = prune_old_tool_results(&msgs, &PruneParams::by_count(2));
        assert_eq!(n, 1);
        let line = out[1]["content"].as_str().unwrap();
        assert!(
            line.starts_with("[read_file]") && line.contains("/x/a"),
            "{line}"
        );
        assert_eq!(out[4]["content"], json!("y".repeat(1_000)));
    }

    #[test]
    fn only_the_newest_three_tool_images_survive() {
        let img = json!([{"type": "text", "text": "shot"}, {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]);
        let mut msgs = Vec::new();
        for i in 0..5 {
            let id = format!("c{i}");
            msgs.push(call(&id));
            msgs.push(result(&id, img.clone()));
        }
        let (out, _) = prune_old_tool_results(&msgs, &PruneParams::by_count(100));
        let with_images = out.iter().filter(|m| view::has_image(m)).count();
        assert_eq!(with_images, KEEP_RECENT_TOOL_IMAGES);
        assert!(!view::has_image(&out[1]) && view::has_image(&out[9]));
    }

    #[test]
    fn pressure_pass_can_keep_the_newest_result() {
        let mut msgs = vec![json!({"role": "user", "content": "go"})];
        for i in 0..3 {
            let id = format!("c{i}");
            msgs.push(call(&id));
            msgs.push(result(&id, json!(format!("{i}{}", "z".repeat(2_000)))));
        }
        let base = PruneParams {
            protect_tail_count: 20,
            protect_tail_tokens: Some(100_000),
            soft_ceiling: Some(100),
            min_prune_chars: PRUNE_MIN_CHARS,
            keep_newest_tool_max: None,
        };
        let (out, _) = prune_old_tool_results(&msgs, &base);
        assert_ne!(out[6], msgs[6], "reference last resort demotes it");
        let keep = PruneParams {
            keep_newest_tool_max: Some(1_000),
            ..base
        };
        let (out, _) = prune_old_tool_results(&msgs, &keep);
        assert_eq!(out[6], msgs[6]);
        assert_ne!(out[4], msgs[4], "older results are still demoted");
        let too_big = PruneParams {
            keep_newest_tool_max: Some(10),
            ..base
        };
        let (out, _) = prune_old_tool_results(&msgs, &too_big);
        assert_ne!(out[6], msgs[6]);
    }

    #[test]
    fn pressure_pass_demotes_an_oversized_protected_tail() {
        let mut msgs = vec![json!({"role": "user", "content": "go"})];
        for i in 0..6 {
            let id = format!("c{i}");
            msgs.push(call(&id));
            msgs.push(result(&id, json!(format!("{i}{}", "z".repeat(4_000)))));
        }
        msgs.push(json!({"role": "assistant", "content": "done"}));
        let p = PruneParams {
            protect_tail_count: 20,
            protect_tail_tokens: Some(100_000),
            soft_ceiling: Some(3_000),
            min_prune_chars: PRUNE_MIN_CHARS,
            keep_newest_tool_max: None,
        };
        let (out, n) = prune_old_tool_results(&msgs, &p);
        assert!(n > 0);
        let total: u64 = super::super::tail::row_costs(&out).iter().sum();
        assert!(total <= 3_000, "{total}");
        // The user's ask is never rewritten.
        assert_eq!(out[0], msgs[0]);
    }
}
