//! One-line summaries of old tool results: what the pruning
//! pass leaves in place of a large tool output, and what the deterministic
//! fallback lists as completed actions. Never fails: unknown tools and bad
//! arguments get a generic line.

use super::args::OrderedJson;
use indexmap::IndexMap;
use serde_json::Value;

type Args = IndexMap<String, OrderedJson>;

/// Formats `n` with thousands separators (`12,345`).
pub(crate) fn thousands(n: usize) -> String {
    let digits = n.to_string();
    let mut out = String::with_capacity(digits.len() + digits.len() / 3);
    for (i, ch) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(ch);
    }
    out
}

/// Number of lines of a tool output; 0 for blank output.
fn line_count(content: &str) -> usize {
    if content.trim().is_empty() {
        0
    } else {
        content.matches('\n').count() + 1
    }
}

/// Cuts `s` to at most `max` characters, ending with `…` when cut.
pub(crate) fn clip(s: &str, max: usize) -> String {
    if s.chars().count() <= max {
        return s.to_string();
    }
    let keep = max.saturating_sub(3);
    let mut out: String = s.chars().take(keep).collect();
    out.push_str("...");
    out
}

fn arg_str(args: &Args, key: &str) -> Option<String> {
    match args.get(key)? {
        OrderedJson::Null => None,
        other => Some(other.to_plain()),
    }
}

fn arg_or(args: &Args, key: &str, default: &str) -> String {
    arg_str(args, key).unwrap_or_else(|| default.to_string())
}

/// A URL argument, unwrapping `{url|href: …}` dicts that models forward
/// straight from web_search results.
fn url_of(v: &OrderedJson) -> Option<String> {
    match v {
        OrderedJson::String(s) => Some(s.clone()),
        OrderedJson::Object(o) => o
            .get("url")
            .or_else(|| o.get("href"))
            .and_then(OrderedJson::as_str)
            .map(str::to_string),
        OrderedJson::Null => None,
        other => Some(other.to_json()),
    }
}

fn json_field_str(content: &str, key: &str) -> Option<String> {
    let v: Value = serde_json::from_str(content).ok()?;
    match v.get(key)? {
        Value::String(s) => Some(s.clone()),
        Value::Null => None,
        other => Some(other.to_string()),
    }
}

/// One tool result and the figures every per-tool line may quote.
#[derive(Clone, Copy)]
struct ToolResult<'a> {
    tool_name: &'a str,
    args: &'a Args,
    content: &'a str,
    /// Result length in characters, with thousands separators.
    n: &'a str,
    lines: usize,
}

/// One-line summary of a tool result, following the per-tool formats of the
/// common agent tools (terminal, read_file, write_file, search_files, patch, browser_*,
/// web_search, web_extract, delegate_task, execute_code, skills, memory,
/// todo, clarify, cronjob, process…) with a generic `[name] k1=v k2=v (N chars
/// result)` fallback. Bad JSON arguments count as no arguments.
pub(super) fn summarize_tool_result(tool_name: &str, args_json: &str, content: &str) -> String {
    let args: Args = match OrderedJson::parse(args_json) {
        Ok(OrderedJson::Object(m)) => m,
        _ => Args::new(),
    };
    let n = thousands(content.chars().count());
    let lines = line_count(content);
    let call = ToolResult {
        tool_name,
        args: &args,
        content,
        n: &n,
        lines,
    };
    workspace_tool_summary(&call)
        .or_else(|| web_tool_summary(&call))
        .or_else(|| agent_tool_summary(&call))
        .or_else(|| common_tool_summary(tool_name, &args, content))
        .unwrap_or_else(|| {
            let mut parts = String::new();
            for (k, v) in args.iter().take(2) {
                parts.push_str(&format!("{k}={} ", clip(&v.to_plain(), 40)));
            }
            format!("[{tool_name}] {parts}({n} chars result)")
        })
}

/// Shell, file and code tools.
fn workspace_tool_summary(c: &ToolResult<'_>) -> Option<String> {
    let ToolResult {
        tool_name,
        args,
        content,
        n,
        lines,
    } = *c;
    let a = |k: &str| arg_str(args, k);
    match tool_name {
        "terminal" => Some({
            let cmd = clip(&a("command").unwrap_or_default(), 80);
            let exit = json_field_str(content, "exit_code").unwrap_or_else(|| "?".into());
            format!("[{tool_name}] ran `{cmd}` -> exit {exit}, {lines} lines output")
        }),
        "read_file" => Some(format!(
            "[read_file] read {} from line {} ({n} chars)",
            arg_or(args, "path", "?"),
            arg_or(args, "offset", "1")
        )),
        "write_file" => Some({
            let written = a("content")
                .map(|c| line_count(&c).to_string())
                .unwrap_or_else(|| "?".into());
            format!(
                "[write_file] wrote to {} ({written} lines)",
                arg_or(args, "path", "?")
            )
        }),
        "search_files" => Some({
            let total = json_field_str(content, "total_count").unwrap_or_else(|| "?".into());
            format!(
                "[search_files] {} search for '{}' in {} -> {total} matches",
                arg_or(args, "target", "content"),
                arg_or(args, "pattern", ""),
                arg_or(args, "path", ".")
            )
        }),
        "patch" => Some(format!(
            "[patch] {} in {} ({n} chars result)",
            arg_or(args, "mode", "replace"),
            arg_or(args, "path", "?")
        )),
        "execute_code" => Some({
            let code = a("code").unwrap_or_default().replace('\n', " ");
            let head: String = code.chars().take(60).collect();
            let more = if code.chars().count() > 60 { "..." } else { "" };
            format!("[execute_code] `{head}{more}` ({lines} lines output)")
        }),
        _ => None,
    }
}

/// Browser and web tools.
fn web_tool_summary(c: &ToolResult<'_>) -> Option<String> {
    let ToolResult {
        tool_name, args, n, ..
    } = *c;
    let a = |k: &str| arg_str(args, k);
    match tool_name {
        "browser_navigate" | "browser_click" | "browser_snapshot" | "browser_type"
        | "browser_scroll" | "browser_vision" => Some({
            let target = if let Some(u) = a("url") {
                format!("{u} ")
            } else if let Some(r) = a("ref") {
                format!("ref={r} ")
            } else {
                String::new()
            };
            format!("[{tool_name}] {target}({n} chars)")
        }),
        "web_search" => Some(format!(
            "[web_search] query='{}' ({n} chars result)",
            arg_or(args, "query", "")
        )),
        "web_extract" => Some({
            let urls: Vec<String> = match args.get("urls") {
                Some(OrderedJson::Array(list)) => list.iter().filter_map(url_of).collect(),
                Some(v) => url_of(v).into_iter().collect(),
                None => Vec::new(),
            };
            let first = urls.first().cloned().unwrap_or_else(|| "?".into());
            let more = if urls.len() > 1 {
                format!(" (+{} more)", urls.len() - 1)
            } else {
                String::new()
            };
            format!("[web_extract] {first}{more} ({n} chars)")
        }),
        _ => None,
    }
}

/// Agent-side tools: delegation, skills, memory, scheduling.
fn agent_tool_summary(c: &ToolResult<'_>) -> Option<String> {
    let ToolResult {
        tool_name,
        args,
        content,
        n,
        ..
    } = *c;
    let a = |k: &str| arg_str(args, k);
    match tool_name {
        "delegate_task" => Some(format!(
            "[delegate_task] '{}' ({n} chars result)",
            clip(&a("goal").unwrap_or_default(), 60)
        )),
        "skill_view" => Some({
            let name = arg_or(args, "name", "?");
            if content.chars().count() > SKILL_RELOAD_OVER_CHARS {
                format!("[skill_view] name={name} ({n} chars; body pruned, call skill_view again to reload it)")
            } else {
                format!("[skill_view] name={name} ({n} chars)")
            }
        }),
        "skills_list" | "skill_manage" => Some(format!(
            "[{tool_name}] name={} ({n} chars)",
            arg_or(args, "name", "?")
        )),
        "vision_analyze" => Some(format!(
            "[vision_analyze] '{}' ({n} chars)",
            clip(&a("question").unwrap_or_default(), 50)
        )),
        "memory" => Some(format!(
            "[memory] {} on {}",
            arg_or(args, "action", "?"),
            arg_or(args, "target", "?")
        )),
        "todo" => Some("[todo] updated task list".to_string()),
        "text_to_speech" => Some(format!("[text_to_speech] generated audio ({n} chars)")),
        "clarify" => Some(clarify_summary(content)),
        "cronjob" => Some(format!("[cronjob] {}", arg_or(args, "action", "?"))),
        "process" => Some(format!(
            "[process] {} session={}",
            arg_or(args, "action", "?"),
            arg_or(args, "session_id", "?")
        )),
        _ => None,
    }
}

/// skill_view bodies above this size get a reload hint in their summary.
const SKILL_RELOAD_OVER_CHARS: usize = 5_000;

/// A clarify result keeps the user's answer (it is the user's own words and
/// often decides the task), short enough that the line stays under the
/// 200-char prune floor and survives later passes. Timeouts and "no user"
/// sentinels are never quoted as if the user had said them.
fn clarify_summary(content: &str) -> String {
    const BASE: &str = "[clarify] asked user a question";
    let answer = match serde_json::from_str::<Value>(content) {
        Ok(Value::Object(o)) => ["answer", "response", "user_response", "result"]
            .iter()
            .find_map(|k| o.get(*k).and_then(Value::as_str).map(str::to_string)),
        Ok(Value::String(s)) => Some(s),
        Ok(_) => None,
        Err(_) => Some(content.to_string()),
    };
    let Some(answer) = answer.map(|a| a.split_whitespace().collect::<Vec<_>>().join(" ")) else {
        return BASE.to_string();
    };
    let lower = answer.to_ascii_lowercase();
    let sentinel = answer.is_empty()
        || [
            "timed out",
            "timeout",
            "no user",
            "no response",
            "not available",
            "unavailable",
        ]
        .iter()
        .any(|s| lower.contains(s));
    if sentinel {
        return BASE.to_string();
    }
    let quoted = serde_json::to_string(&clip(&answer, 120)).unwrap_or_default();
    format!("{BASE}; answer: {quoted}")
}

/// First present argument among `keys`; arrays of strings (argv-style
/// commands) are joined with spaces.
fn first_arg(args: &Args, keys: &[&str]) -> Option<String> {
    keys.iter().find_map(|k| match args.get(*k)? {
        OrderedJson::Null => None,
        OrderedJson::Array(items) if items.iter().all(|i| i.as_str().is_some()) => Some(
            items
                .iter()
                .filter_map(OrderedJson::as_str)
                .collect::<Vec<_>>()
                .join(" "),
        ),
        v => Some(v.to_plain()),
    })
}

const PATH_KEYS: &[&str] = &[
    "path",
    "file_path",
    "filePath",
    "filename",
    "file",
    "target_file",
];

/// Summaries for tool names common in other agents (shell, read/write/edit,
/// search, fetch), matched case-insensitively. A single agent only knows its
/// own tool names; a proxy sees every client's, and a one-line summary that
/// keeps the path or command is worth far more than the generic line.
fn common_tool_summary(name: &str, args: &Args, content: &str) -> Option<String> {
    let lower = name.to_ascii_lowercase();
    let n = thousands(content.chars().count());
    let lines = line_count(content);
    let path = || first_arg(args, PATH_KEYS).unwrap_or_else(|| "?".into());
    let line = match lower.as_str() {
        "bash" | "shell" | "sh" | "run_command" | "execute_command" | "run_terminal_cmd"
        | "exec" | "exec_command" | "local_shell" | "run_shell_command" => {
            let cmd = clip(
                &first_arg(args, &["command", "cmd", "script"]).unwrap_or_default(),
                80,
            );
            let exit = ["exit_code", "returncode", "exit_status"]
                .iter()
                .find_map(|k| json_field_str(content, k))
                .unwrap_or_else(|| "?".into());
            format!("[{name}] ran `{cmd}` -> exit {exit}, {lines} lines output")
        }
        "read" | "view" | "open_file" | "readfile" | "view_file" | "cat" => {
            format!("[{name}] read {} ({n} chars)", path())
        }
        "write" | "create_file" | "write_to_file" | "writefile" => {
            let written = first_arg(args, &["content", "contents", "file_text", "text"])
                .map(|c| line_count(&c).to_string())
                .unwrap_or_else(|| "?".into());
            format!("[{name}] wrote to {} ({written} lines)", path())
        }
        "edit"
        | "multiedit"
        | "edit_file"
        | "str_replace"
        | "str_replace_editor"
        | "str_replace_based_edit_tool"
        | "apply_patch"
        | "replace_in_file"
        | "apply_diff" => {
            let target = first_arg(args, PATH_KEYS);
            match target {
                Some(p) => format!("[{name}] edited {p} ({n} chars result)"),
                None => format!("[{name}] edit ({n} chars result)"),
            }
        }
        "grep" | "glob" | "search" | "ripgrep" | "find" | "grep_search" | "file_search"
        | "codebase_search" | "search_code" | "find_files" => {
            let pattern =
                first_arg(args, &["pattern", "query", "regex", "glob", "q"]).unwrap_or_default();
            let within = first_arg(args, &["path", "dir", "directory", "include"])
                .unwrap_or_else(|| ".".into());
            format!(
                "[{name}] search for '{}' in {within} ({n} chars result)",
                clip(&pattern, 80)
            )
        }
        "fetch" | "web_fetch" | "webfetch" | "fetch_url" | "http_get" | "browse" | "open_url" => {
            let url = first_arg(args, &["url", "uri", "href"]).unwrap_or_else(|| "?".into());
            format!("[{name}] {url} ({n} chars)")
        }
        _ => return None,
    };
    Some(line)
}

#[cfg(test)]
mod tests;
