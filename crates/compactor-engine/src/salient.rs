//! Salient lines: the lines of a text worth keeping when the text itself
//! cannot be kept — `key: value` facts, errors, identifiers, paths, asks
//! and decisions. Used by the deterministic fallback (the dropped turns'
//! facts) and for pruned tool outputs in the summariser's input (the facts
//! a one-line stub would lose).

use std::sync::LazyLock;

use regex::Regex;

use super::redact::redact_secrets;

/// Longest line kept (longer ones are cut with an ellipsis).
pub(crate) const SALIENT_LINE_MAX_CHARS: usize = 160;

static KEY_VALUE: LazyLock<Option<Regex>> =
    LazyLock::new(|| Regex::new(r"^\s*[-*]?\s*[A-Za-z_][A-Za-z0-9_.\-]{0,40}\s*[:=]\s*\S").ok());
static ERROR: LazyLock<Option<Regex>> = LazyLock::new(|| {
    Regex::new(r"(?i)\b(error|failed|failure|exception|traceback|panic|fatal|denied)\b").ok()
});
static DECISION: LazyLock<Option<Regex>> = LazyLock::new(|| {
    Regex::new(
        r"(?i)\b(decision|decided|we will|we'll|must|never|always|constraint|do not|don't|require[sd]?)\b",
    )
    .ok()
});
static IDENTIFIER: LazyLock<Option<Regex>> = LazyLock::new(|| {
    Regex::new(r"\b(?:[A-Z][A-Za-z]*[-_]?[0-9][A-Za-z0-9\-_]{2,}|[0-9a-f]{8,}|v?\d+\.\d+\.\d+)\b")
        .ok()
});
static PATH: LazyLock<Option<Regex>> = LazyLock::new(|| {
    Regex::new(r"(?:/[A-Za-z0-9_.\-]+){2,}|[A-Za-z0-9_\-]+/[A-Za-z0-9_./\-]+\.[A-Za-z0-9]{1,8}\b")
        .ok()
});

fn hit(re: &LazyLock<Option<Regex>>, line: &str) -> bool {
    re.as_ref().is_some_and(|r| r.is_match(line))
}

/// How salient one line is (0 = not at all).
pub(crate) fn score(line: &str) -> u32 {
    let mut s = 0;
    if hit(&KEY_VALUE, line) {
        s += 3;
    }
    if hit(&ERROR, line) || hit(&DECISION, line) {
        s += 3;
    }
    if hit(&IDENTIFIER, line) {
        s += 3;
    }
    if hit(&PATH, line) {
        s += 1;
    }
    s
}

fn shorten(line: &str) -> String {
    let t = line.split_whitespace().collect::<Vec<_>>().join(" ");
    if t.chars().count() <= SALIENT_LINE_MAX_CHARS {
        return t;
    }
    let mut out: String = t.chars().take(SALIENT_LINE_MAX_CHARS).collect();
    out.push('…');
    out
}

/// The at most `max_lines` most salient distinct lines of `text` (redacted,
/// whitespace-collapsed, each at most [`SALIENT_LINE_MAX_CHARS`]), in their
/// original order. Ties go to the earlier line.
// Only tests ask without a minimum score.
#[cfg(test)]
pub(super) fn salient_lines(text: &str, max_lines: usize) -> Vec<String> {
    salient_lines_min(text, max_lines, 1)
}

/// [`salient_lines`] of at least `min_score` (see [`score`]).
pub(crate) fn salient_lines_min(text: &str, max_lines: usize, min_score: u32) -> Vec<String> {
    let mut seen = std::collections::HashSet::new();
    let mut scored: Vec<(u32, usize, String)> = Vec::new();
    for (i, raw) in text.lines().enumerate() {
        let line = shorten(&redact_secrets(raw));
        if line.is_empty() || !seen.insert(line.clone()) {
            continue;
        }
        let s = score(&line);
        if s >= min_score.max(1) {
            scored.push((s, i, line));
        }
    }
    scored.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
    scored.truncate(max_lines);
    scored.sort_by_key(|(_, i, _)| *i);
    scored.into_iter().map(|(_, _, l)| l).collect()
}

/// `text` within `max_chars`, cut by lines rather than by position: the
/// first section (the task snapshot) and the headings stay, then the most
/// salient lines (newer first among equals) as long as they fit, in their
/// original order. `None` when even the first section does not fit.
pub(crate) fn fit_lines(text: &str, max_chars: usize, marker: &str) -> Option<String> {
    if text.chars().count() <= max_chars {
        return Some(text.to_owned());
    }
    let lines: Vec<&str> = text.lines().collect();
    let is_heading = |l: &str| l.trim_start().starts_with('#');
    // The first section: up to (not including) the second heading.
    let first_end = lines
        .iter()
        .enumerate()
        .skip(1)
        .find(|(_, l)| is_heading(l))
        .map_or(lines.len(), |(i, _)| i);
    let cost = |l: &str| l.chars().count() + 1;
    let mut used = marker.chars().count() + 1;
    let mut keep = vec![false; lines.len()];
    for (i, l) in lines.iter().enumerate() {
        if i < first_end || is_heading(l) {
            keep[i] = true;
            used += cost(l);
        }
    }
    if used > max_chars {
        return None;
    }
    let mut order: Vec<(u32, usize)> = (0..lines.len())
        .filter(|&i| !keep[i] && !lines[i].trim().is_empty())
        .map(|i| (score(lines[i]), i))
        .collect();
    order.sort_by(|a, b| b.cmp(a));
    for (_, i) in order {
        if used + cost(lines[i]) <= max_chars {
            keep[i] = true;
            used += cost(lines[i]);
        }
    }
    let mut out: Vec<&str> = Vec::new();
    for (i, l) in lines.iter().enumerate() {
        // A heading whose section lost every line goes too.
        let empty_section = is_heading(l)
            && i >= first_end
            && !lines[i + 1..]
                .iter()
                .zip(&keep[i + 1..])
                .take_while(|(n, _)| !is_heading(n))
                .any(|(n, k)| *k && !n.trim().is_empty());
        if keep[i] && !empty_section {
            out.push(l);
        }
    }
    let mut s = out.join("\n");
    s.push('\n');
    s.push_str(marker);
    Some(s)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn facts_outrank_noise() {
        let text = "config.toml:\nbuild_id: B7-1234\nsrc/a.rs:1: fn a() {}\nsrc/a.rs:1: fn a() {}\nplain words here\nError: disk full\n";
        let lines = salient_lines(text, 2);
        assert_eq!(lines, vec!["build_id: B7-1234", "Error: disk full"]);
        let all = salient_lines(text, 10);
        assert_eq!(all.len(), 3, "{all:?}");
        assert!(!all.iter().any(|l| l.contains("plain")));
    }

    #[test]
    fn fit_lines_keeps_facts_over_narrative() {
        let text = "## Snapshot\nUser asked: go\n\n## Progress\n- looked at things\n- ID-7 is FACT-01-0001\n- looked at more things\n- build_id: B-2\n\n## Empty\n- filler filler filler";
        let out = fit_lines(text, 100, "[cut]").unwrap();
        assert!(out.chars().count() <= 100, "{out}");
        assert!(out.starts_with("## Snapshot\nUser asked: go"), "{out}");
        assert!(
            out.contains("FACT-01-0001") && out.contains("build_id: B-2"),
            "{out}"
        );
        assert!(
            !out.contains("looked at") && !out.contains("## Empty"),
            "{out}"
        );
        assert!(out.ends_with("[cut]"));
        assert_eq!(fit_lines("short", 80, "[cut]").as_deref(), Some("short"));
        assert_eq!(fit_lines(&"x".repeat(100), 80, "[cut]"), None);
    }

    #[test]
    fn secrets_are_redacted() {
        let key = format!("sk-{}", "a".repeat(40));
        let lines = salient_lines(&format!("api_key: {key}"), 3);
        assert_eq!(lines.len(), 1);
        assert!(!lines[0].contains(&key), "{lines:?}");
    }
}
