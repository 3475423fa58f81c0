//! Deterministic fallback summary: what replaces the
//! compacted turns when the summariser failed and the failure is not one
//! that aborts. Built locally from the dropped turns, strictly redacted,
//! capped at 8,000 characters, or at the summary budget of a small window
//! ([`build_fallback_body_capped`]), so repeated fallbacks cannot grow. The latest user ask is recorded exactly once,
//! as history: repeating it under "in progress" / "pending" headings made
//! the model answer it again.

use super::markers::{HISTORICAL_TASK_HEADING, SUMMARY_PREFIX};
use super::redact::redact_secrets;
use super::serialize::{py_quote, render_content};
use super::tool_summary::summarize_tool_result;
use super::view::is_synthetic_user;
use regex::Regex;
use serde_json::Value;
use std::collections::HashMap;
use std::sync::LazyLock;

/// Cap of the whole fallback summary (prefix included).
pub(crate) const FALLBACK_MAX_CHARS: usize = 8_000;
/// Cap of each dropped turn's text.
pub(super) const TURN_MAX_CHARS: usize = 700;
/// Phrase every fallback carries so callers and users can tell it apart
/// from a model-written summary.
pub(crate) const FALLBACK_NOTICE: &str = "Summary generation was unavailable";

const MAX_ACTIONS: usize = 12;
const MAX_BLOCKED: usize = 5;
const MAX_FILES: usize = 12;
const MAX_LAST_TURNS: usize = 8;
const MAX_TOOL_NAMES: usize = 6;
const TRUNCATED_TAIL: &str = "\n...[fallback summary truncated]";

static ERROR_WORDS: LazyLock<Option<Regex>> = LazyLock::new(|| {
    Regex::new(r"(?i)error|failed|exception|traceback|timeout|timed out|fatal").ok()
});
static PATH_LIKE: LazyLock<Option<Regex>> = LazyLock::new(|| {
    Regex::new(concat!(
        r"(?:~|\.{1,2})?(?:/[A-Za-z0-9_.@+\-]+){2,}",
        r"|[A-Za-z0-9_\-][A-Za-z0-9_.\-]*(?:/[A-Za-z0-9_.\-]+)+\.[A-Za-z0-9]{1,8}\b"
    ))
    .ok()
});

/// Redacted, whitespace-collapsed text capped at `max` chars.
fn clean(text: &str, max: usize) -> String {
    let t = redact_secrets(text)
        .split_whitespace()
        .collect::<Vec<_>>()
        .join(" ");
    if t.chars().count() <= max {
        return t;
    }
    let mut out: String = t.chars().take(max).collect();
    out.push_str(" ...[truncated]");
    out
}

/// Asks and actions over 600 chars keep 420 head + " ... " + 160 tail.
fn shorten(text: &str) -> String {
    let n = text.chars().count();
    if n <= 600 {
        return text.to_string();
    }
    let head: String = text.chars().take(420).collect();
    let tail: String = text.chars().skip(n - 160).collect();
    format!("{head} ... {tail}")
}

fn role(m: &Value) -> &str {
    m.get("role").and_then(Value::as_str).unwrap_or("")
}

fn tool_calls(m: &Value) -> &[Value] {
    match m.get("tool_calls") {
        Some(Value::Array(a)) => a,
        _ => &[],
    }
}

fn call_name(call: &Value) -> String {
    call.get("function")
        .unwrap_or(call)
        .get("name")
        .and_then(Value::as_str)
        .unwrap_or("?")
        .to_string()
}

fn call_args(call: &Value) -> String {
    match call.get("function").unwrap_or(call).get("arguments") {
        Some(Value::String(s)) => s.clone(),
        None | Some(Value::Null) => String::new(),
        Some(v) => v.to_string(),
    }
}

fn call_ids(call: &Value) -> impl Iterator<Item = &str> {
    ["id", "call_id"]
        .into_iter()
        .filter_map(|k| call.get(k).and_then(Value::as_str))
}

fn called_tools_line(calls: &[Value]) -> String {
    let mut names: Vec<String> = Vec::new();
    for c in calls {
        let n = call_name(c);
        if !names.contains(&n) {
            names.push(n);
        }
    }
    let extra = names.len().saturating_sub(MAX_TOOL_NAMES);
    names.truncate(MAX_TOOL_NAMES);
    let mut line = format!("Called tool(s): {}", names.join(", "));
    if extra > 0 {
        line.push_str(&format!(" (+{extra} more)"));
    }
    line
}

fn push_unique(list: &mut Vec<String>, item: String, max: usize) {
    if list.len() < max && !item.is_empty() && !list.contains(&item) {
        list.push(item);
    }
}

fn collect_paths(text: &str, files: &mut Vec<String>) {
    let Some(re) = &*PATH_LIKE else { return };
    for m in re.find_iter(text) {
        // Skip URL paths (`https://host/x`) and mid-word matches.
        let before = text[..m.start()].chars().next_back();
        if before.is_some_and(|c| c == ':' || c == '/' || c.is_alphanumeric()) {
            continue;
        }
        let p = m.as_str().trim_end_matches(['.', ',', ')', ':']);
        if p.contains("[REDACTED") {
            continue;
        }
        push_unique(files, p.to_string(), MAX_FILES);
    }
}

/// Lead-in of a snapshot carried over from the previous summary; stripped
/// when carrying it again so repeated fallbacks do not nest it.
const CARRIED_SNAPSHOT_LEAD: &str =
    "No new user request in the compacted turns. From the previous summary (reference only):";

fn previous_snapshot_line(previous: &str) -> Option<String> {
    let start = previous.find(HISTORICAL_TASK_HEADING)? + HISTORICAL_TASK_HEADING.len();
    let rest = &previous[start..];
    let end = rest.find("\n## ").unwrap_or(rest.len());
    let mut line = rest[..end].trim();
    while let Some(r) = line.strip_prefix(CARRIED_SNAPSHOT_LEAD) {
        line = r.trim_start();
    }
    let t = clean(line, 1_400);
    (!t.is_empty()).then_some(t)
}

/// What the fallback extracts from the dropped turns.
#[derive(Default)]
struct Facts {
    last_ask: Option<String>,
    actions: Vec<String>,
    blocked: Vec<String>,
    files: Vec<String>,
    last_turns: Vec<String>,
}

fn extract(dropped: &[Value]) -> Facts {
    let mut f = Facts::default();
    let mut calls_by_id: HashMap<&str, (String, String)> = HashMap::new();
    for m in dropped {
        for c in tool_calls(m) {
            for id in call_ids(c) {
                calls_by_id.insert(id, (call_name(c), call_args(c)));
            }
        }
    }
    let mut actions: Vec<String> = Vec::new();
    for m in dropped {
        let text = render_content(m.get("content"));
        match role(m) {
            "user" => f.note_user(m, &text),
            "assistant" => f.note_assistant(m, &text, &mut actions),
            "tool" => f.note_tool(m, &text, &calls_by_id, &mut actions),
            other => {
                if !text.trim().is_empty() {
                    f.last_turns.push(format!(
                        "{}: {}",
                        other.to_uppercase(),
                        clean(&text, TURN_MAX_CHARS)
                    ));
                }
            }
        }
    }
    let skip = actions.len().saturating_sub(MAX_ACTIONS);
    f.actions = actions.into_iter().skip(skip).collect();
    let skip = f.last_turns.len().saturating_sub(MAX_LAST_TURNS);
    f.last_turns.drain(..skip);
    f
}

impl Facts {
    fn note_user(&mut self, m: &Value, text: &str) {
        let synthetic = is_synthetic_user(m);
        if !synthetic && !text.trim().is_empty() {
            self.last_ask = Some(shorten(&clean(text, usize::MAX)));
        }
        collect_paths(&redact_secrets(text), &mut self.files);
        let label = if synthetic {
            "INTERNAL CONTEXT"
        } else {
            "USER"
        };
        self.last_turns
            .push(format!("{label}: {}", clean(text, TURN_MAX_CHARS)));
    }

    fn note_assistant(&mut self, m: &Value, text: &str, actions: &mut Vec<String>) {
        let calls = tool_calls(m);
        for c in calls {
            if let Ok(Value::Object(args)) = serde_json::from_str::<Value>(&call_args(c)) {
                for key in ["path", "workdir", "file_path", "output_path"] {
                    if let Some(p) = args.get(key).and_then(Value::as_str) {
                        push_unique(&mut self.files, clean(p, 300), MAX_FILES);
                    }
                }
            }
        }
        collect_paths(&redact_secrets(text), &mut self.files);
        let cleaned = clean(text, TURN_MAX_CHARS);
        if calls.is_empty() {
            if !cleaned.is_empty() {
                actions.push(shorten(&cleaned));
            }
            self.last_turns.push(format!("ASSISTANT: {cleaned}"));
        } else {
            let line = called_tools_line(calls);
            actions.push(line.clone());
            let names = line.trim_start_matches("Called tool(s): ");
            let sep = if cleaned.is_empty() { "" } else { " — " };
            self.last_turns
                .push(format!("ASSISTANT: tool calls: {names}{sep}{cleaned}"));
        }
    }

    fn note_tool(
        &mut self,
        m: &Value,
        text: &str,
        calls_by_id: &HashMap<&str, (String, String)>,
        actions: &mut Vec<String>,
    ) {
        let id = m.get("tool_call_id").and_then(Value::as_str).unwrap_or("");
        let (name, args) = calls_by_id
            .get(id)
            .cloned()
            .unwrap_or_else(|| ("tool".to_string(), String::new()));
        actions.push(shorten(&clean(
            &summarize_tool_result(&name, &args, text),
            TURN_MAX_CHARS,
        )));
        if ERROR_WORDS.as_ref().is_some_and(|re| re.is_match(text))
            && self.blocked.len() < MAX_BLOCKED
        {
            self.blocked.push(clean(text, 500));
        }
        collect_paths(&redact_secrets(text), &mut self.files);
        self.last_turns
            .push(format!("TOOL: {}", clean(text, TURN_MAX_CHARS)));
    }
}

/// The fallback body (no prefix): the five leading sections, then optional
/// sections in priority order as long as the whole summary (prefix
/// included) stays within [`FALLBACK_MAX_CHARS`].
pub(crate) fn build_fallback_body(
    dropped: &[Value],
    previous_summary: Option<&str>,
    reason: &str,
) -> String {
    build_fallback_body_capped(
        dropped,
        previous_summary,
        reason,
        FALLBACK_MAX_CHARS.saturating_sub(SUMMARY_PREFIX.chars().count() + 1),
    )
}

/// Bodies capped below this many characters use the short required
/// sections: the five "Unknown" sections alone would fill a small window's
/// whole summary budget.
pub(crate) const COMPACT_FALLBACK_BELOW_CHARS: usize = 4_000;

/// [`build_fallback_body`] capped at `max_chars` characters (the summary
/// budget of a small window). The previous-summary snapshot is quoted within
/// the same cap, so repeated fallbacks cannot grow.
pub(crate) fn build_fallback_body_capped(
    dropped: &[Value],
    previous_summary: Option<&str>,
    reason: &str,
    max_chars: usize,
) -> String {
    let f = extract(dropped);
    let n = dropped.len();
    let compact = max_chars < COMPACT_FALLBACK_BELOW_CHARS;
    let reason = clean(reason, if compact { 120 } else { 220 });
    let snapshot = match (
        &f.last_ask,
        previous_summary.and_then(previous_snapshot_line),
    ) {
        (Some(ask), _) => format!(
            "User asked: {}\nHistorical only; the messages after this summary take precedence.",
            py_quote(ask)
        ),
        (None, Some(prev)) => format!("{CARRIED_SNAPSHOT_LEAD} {prev}"),
        (None, None) => "No user request in the compacted turns.".to_string(),
    };
    let required = if compact {
        format!(
            "{HISTORICAL_TASK_HEADING}\n{snapshot}\n\n\
## Constraints & Preferences\n- {FALLBACK_NOTICE} ({reason}); assembled locally from {n} compacted messages, secrets redacted. Verify the current state before acting."
        )
    } else {
        format!(
        "{HISTORICAL_TASK_HEADING}\n{snapshot}\n\n\
## Governing User Outcome\nUnknown from deterministic fallback — do not infer one; follow the user messages after this summary.\n\n\
## Current Subtask\nUnknown from deterministic fallback.\n\n\
## Latest User Correction\nUnknown from deterministic fallback.\n\n\
## Next Outcome-Relevant Step (Reference Only)\nNone. Do not answer the recorded ask again; respond to the messages after this summary.\n\n\
## Constraints & Preferences\n- {FALLBACK_NOTICE} ({reason}), so this summary was assembled locally from {n} compacted messages without a model. Secrets were redacted and details may be missing: verify the current state before acting."
        )
    };
    let mut optional = Vec::new();
    // The previous summary is carried whole (it is compact already), and
    // shortened by lines only when it alone would not fit; then the salient
    // lines of the dropped turns. Both go first to the cap.
    let room = max_chars.saturating_sub(required.chars().count() + 2);
    if let Some(prev) = previous_section(previous_summary, room) {
        optional.push((4, prev));
    }
    let room = room.saturating_sub(optional.first().map_or(0, |(_, t)| t.chars().count() + 2));
    if let Some(facts) = key_facts_section(dropped, room) {
        optional.push((0, facts));
    }
    optional.extend(optional_sections(&f, n, &reason, compact));
    fit_sections(required, optional, max_chars)
}

/// The optional sections as `(canonical position, text)`, in the priority
/// order they are offered to the cap.
fn optional_sections(f: &Facts, n: usize, reason: &str, compact: bool) -> Vec<(usize, String)> {
    let numbered = |items: &[String]| {
        items
            .iter()
            .enumerate()
            .map(|(i, a)| format!("{}. {a}", i + 1))
            .collect::<Vec<_>>()
            .join("\n")
    };
    let bullets = |items: &[String]| {
        items
            .iter()
            .map(|a| format!("- {a}"))
            .collect::<Vec<_>>()
            .join("\n")
    };
    let mut optional: Vec<(usize, String)> = Vec::new();
    if !compact {
        optional.push((
            6,
            format!("## Critical Context\nBest-effort fallback for {n} compacted messages. Reason: {reason}."),
        ));
    }
    if !f.actions.is_empty() {
        optional.push((0, format!("## Completed Actions\n{}", numbered(&f.actions))));
    }
    if !f.blocked.is_empty() {
        optional.push((1, format!("## Blocked\n{}", bullets(&f.blocked))));
    }
    if !f.files.is_empty() {
        optional.push((2, format!("## Relevant Files\n{}", bullets(&f.files))));
    }
    if !f.last_turns.is_empty() {
        optional.push((
            3,
            format!("## Last Dropped Turns\n{}", f.last_turns.join("\n")),
        ));
    }
    optional.push((
        5,
        "## Active State\nUnknown — check the working tree and running processes before acting."
            .to_string(),
    ));
    optional
}

const PREVIOUS_HEADING: &str = "## Previous Summary Snapshot (carried whole)";
const KEY_FACTS_HEADING: &str = "## Key Facts From The Compacted Turns";
/// Most salient lines the fallback lists from the dropped turns.
pub(crate) const MAX_KEY_FACTS: usize = 16;

/// The previous summary, quoted, within `room` characters: whole when it
/// fits, else shortened by lines (facts before narrative).
fn previous_section(previous: Option<&str>, room: usize) -> Option<String> {
    let p = redact_secrets(previous?.trim());
    if p.is_empty() {
        return None;
    }
    // Lines quoted by an earlier fallback are not quoted twice.
    let quoted = p
        .lines()
        .map(|l| {
            let l = l.trim_start_matches("> ");
            if l.is_empty() {
                ">".to_string()
            } else {
                format!("> {l}")
            }
        })
        .collect::<Vec<_>>()
        .join("\n");
    let text = format!("{PREVIOUS_HEADING}\n{quoted}");
    super::salient::fit_lines(&text, room, "> [earlier summary shortened to fit]")
}

/// The salient lines of the dropped turns (asks, decisions, identifiers,
/// paths, errors, `key: value` facts), newest kept when they do not all fit.
fn key_facts_section(dropped: &[Value], room: usize) -> Option<String> {
    let text: String = dropped
        .iter()
        .map(|m| render_content(m.get("content")))
        .collect::<Vec<_>>()
        .join("\n");
    let lines = super::salient::salient_lines_min(&text, MAX_KEY_FACTS * 4, 2);
    let mut used = KEY_FACTS_HEADING.chars().count();
    let mut kept: Vec<String> = Vec::new();
    for l in lines.iter().rev().take(MAX_KEY_FACTS) {
        let cost = l.chars().count() + 3;
        if used + cost > room {
            break;
        }
        used += cost;
        kept.push(format!("- {l}"));
    }
    kept.reverse();
    (!kept.is_empty()).then(|| format!("{KEY_FACTS_HEADING}\n{}", kept.join("\n")))
}

/// Appends the optional sections that fit `budget` to `required`, in their
/// canonical order, and truncates the whole if `required` alone is over.
fn fit_sections(mut required: String, optional: Vec<(usize, String)>, budget: usize) -> String {
    let mut used = required.chars().count();
    let mut chosen: Vec<(usize, String)> = Vec::new();
    for (pos, text) in optional {
        let len = text.chars().count() + 2;
        if used + len <= budget {
            used += len;
            chosen.push((pos, text));
        }
    }
    chosen.sort_by_key(|(pos, _)| *pos);
    for (_, text) in chosen {
        required.push_str("\n\n");
        required.push_str(&text);
    }
    if required.chars().count() > budget {
        let keep = budget.saturating_sub(TRUNCATED_TAIL.len());
        required = required.chars().take(keep).collect();
        required.push_str(TRUNCATED_TAIL);
    }
    required
}

/// The deterministic fallback summary, prefixed with
/// [`SUMMARY_PREFIX`] (the caller appends the END marker like for any
/// summary): task snapshot with the latest real user ask recorded once,
/// completed actions (≤ 12, tool calls by name, tool results as one-line
/// summaries), blocked errors (≤ 5), relevant files (≤ 12, from path
/// arguments and path-looking text), the last 8 dropped turns, a quoted
/// previous-summary snapshot (≤ 3,000 chars) and the failure reason. All
/// text is strictly redacted; the total is ≤ 8,000 chars.
pub(super) fn build_fallback_summary(
    dropped: &[Value],
    previous_summary: Option<&str>,
    reason: &str,
) -> String {
    format!(
        "{SUMMARY_PREFIX}\n{}",
        build_fallback_body(dropped, previous_summary, reason)
    )
}

#[cfg(test)]
mod tests;
