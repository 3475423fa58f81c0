//! What the user said survives a compaction.
//!
//! A summary, above all a small model's, loses or paraphrases the user's
//! own words: asked at the end of a 24-turn session for a vault path, a
//! port and a code the user gave in its first turns, a 270M model answered
//! 3/3 with those exchanges in context and 0/3 after its summaries. So the
//! user's messages of the replaced part are kept verbatim in a section of
//! the summary message, within a budget sized to the window (like Codex,
//! which carries the user's messages next to its summary; the reference
//! micro-compaction never absorbs a user turn). The summary describes the
//! assistant's work and the tool output.
//!
//! Short messages (statements, constraints, asks) come first, newest
//! first; long ones (a pasted log) are excerpted with a visible marker and
//! fill what is left. The section is carried from one compaction to the
//! next: [`split`] takes it out of an earlier summary before the summariser
//! sees that summary, and its messages compete for the budget again,
//! older than the new ones.

use serde_json::Value;

use super::{tokens, view};

/// Heading of the section (never written by the summariser: it is taken
/// out of the summary it is shown).
pub(super) const HEADING: &str = "## What the user said (verbatim)";

/// A message longer than this share of the budget is excerpted.
const EXCERPT_SHARE: u64 = 3;
/// No excerpt is shorter than this many tokens.
const MIN_EXCERPT_TOKENS: u64 = 24;

/// `body` without its section, and the messages the section kept (oldest
/// first).
pub(super) fn split(body: &str) -> (String, Vec<String>) {
    let Some(at) = find_heading(body) else {
        return (body.to_owned(), Vec::new());
    };
    let rest = &body[at + HEADING.len()..];
    let mut kept: Vec<String> = Vec::new();
    // Where the section ends: text after it (a rolling summary appended to
    // this one) is part of the summary.
    let mut end = rest.len();
    let mut offset = 0;
    for line in rest.split_inclusive('\n') {
        let text = line.trim_end_matches(['\n', '\r']);
        if let Some(item) = text.strip_prefix("- ") {
            kept.push(item.to_owned());
        } else if let (Some(cont), Some(last)) = (text.strip_prefix("  "), kept.last_mut()) {
            last.push('\n');
            last.push_str(cont);
        } else if !text.trim().is_empty() {
            end = offset;
            break;
        }
        offset += line.len();
    }
    let before = body[..at].trim_end();
    let after = rest[end..].trim();
    let summary = if after.is_empty() {
        before.to_owned()
    } else {
        format!("{before}\n\n{after}")
    };
    (summary, kept)
}

fn find_heading(body: &str) -> Option<usize> {
    let at = body.rfind(HEADING)?;
    (at == 0 || body[..at].ends_with('\n')).then_some(at)
}

/// The text of every real user message of `turns`, oldest first: what the
/// user wrote, without the reminders an agent puts in the user's message.
pub(crate) fn of_turns(turns: &[Value]) -> Vec<String> {
    turns
        .iter()
        .filter(|m| view::is_real_user(m))
        .map(|m| without_reminders(&view::text(m)))
        .filter(|t| !t.is_empty())
        .collect()
}

/// Opening and closing tags of an agent's reminder inside a user message.
const REMINDER: (&str, &str) = ("<system-reminder>", "</system-reminder>");

/// `text` without its `<system-reminder>` blocks, trimmed. Claude Code and
/// qwen-code put reminder parts (dates, tool lists, file notes) before the
/// user's own text part in one user message; the agent wrote them, not the
/// user, and with them a one-line ask weighed like a pasted log and was
/// left out of the section.
fn without_reminders(text: &str) -> String {
    let (open, close) = REMINDER;
    if !text.contains(open) {
        return text.trim().to_owned();
    }
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(at) = rest.find(open) {
        out.push_str(&rest[..at]);
        match rest[at..].find(close) {
            Some(end) => rest = &rest[at + end + close.len()..],
            // An unclosed reminder runs to the end.
            None => rest = "",
        }
    }
    out.push_str(rest);
    out.trim().to_owned()
}

/// The messages to keep of `candidates` (oldest first) within `budget`
/// rough tokens, oldest first: the first short messages the user wrote (the
/// task and its constraints as first stated) in up to half the budget, then
/// whole short messages newest first, then excerpts of long ones newest
/// first, in what is left. Newest first alone let every compaction push the
/// oldest out: a section carried through ten compactions held only the last
/// ten asks, never the vault path the user gave in turn one.
pub(crate) fn select(candidates: &[String], budget: u64) -> Vec<String> {
    if budget == 0 {
        return Vec::new();
    }
    let cap = (budget / EXCERPT_SHARE).max(MIN_EXCERPT_TOKENS);
    let mut chosen: Vec<(usize, String)> = Vec::new();
    let mut left = budget.saturating_sub(heading_tokens());
    let mut seen = std::collections::HashSet::new();
    let fresh: Vec<usize> = (0..candidates.len())
        .rev()
        .filter(|&i| seen.insert(candidates[i].as_str()))
        .collect();
    let mut first_share = left / 2;
    for &i in fresh.iter().rev() {
        let cost = item_tokens(&candidates[i]);
        if cost > cap {
            continue;
        }
        if cost > first_share {
            break;
        }
        first_share -= cost;
        left -= cost;
        chosen.push((i, candidates[i].clone()));
    }
    let first = chosen.len();
    for long in [false, true] {
        for &i in &fresh {
            if chosen[..first].iter().any(|(j, _)| *j == i) {
                continue;
            }
            let text = &candidates[i];
            let cost = item_tokens(text);
            if (cost > cap) != long {
                continue;
            }
            let item = if long {
                excerpt(text, cap.min(left))
            } else {
                text.clone()
            };
            let cost = item_tokens(&item);
            if cost <= left && cost >= MIN_EXCERPT_TOKENS.min(item_tokens(text)) {
                left -= cost;
                chosen.push((i, item));
            }
        }
    }
    chosen.sort_by_key(|(i, _)| *i);
    chosen.into_iter().map(|(_, t)| t).collect()
}

/// Rough tokens of one kept message, its list marker included.
fn item_tokens(text: &str) -> u64 {
    tokens::estimate_text_tokens(text) + 2
}

/// Lines above which a message is a paste (a log, a file) rather than a
/// statement.
const STATEMENT_MAX_LINES: usize = 3;

/// What stands between the kept sentences of an excerpted statement.
const GAP: &str = " […] ";

/// `text` cut to about `budget` tokens. A statement keeps its sentences
/// that carry facts (numbers, paths, names, codes), whole and in order: a
/// 200-character message cut in its middle lost the vault path the user
/// gave in it. A paste, or a statement without such sentences, keeps its
/// start and its end around a marker saying how much was left out. A cut
/// that would leave out less than twice its marker is no saving: the text
/// stays whole (a 66-character cut was once replaced by a 60-character
/// marker).
fn excerpt(text: &str, budget: u64) -> String {
    if text.lines().count() <= STATEMENT_MAX_LINES {
        if let Some(facts) = fact_sentences(text, budget) {
            return facts;
        }
    }
    let chars: Vec<char> = text.chars().collect();
    let keep = usize::try_from(
        budget
            .saturating_sub(12)
            .saturating_mul(tokens::CHARS_PER_TOKEN),
    )
    .unwrap_or(usize::MAX);
    let left_out = chars.len().saturating_sub(keep);
    let marker = format!(" […{left_out} chars of this message left out…] ");
    if left_out <= 2 * marker.chars().count() {
        return text.to_owned();
    }
    let head = keep * 2 / 3;
    let tail = keep - head;
    let start: String = chars[..head].iter().collect();
    let end: String = chars[chars.len() - tail..].iter().collect();
    format!("{}{marker}{}", start.trim_end(), end.trim_start())
}

/// The sentences of `text` that carry a fact, in order, within `budget`
/// tokens, joined by [`GAP`] where others were left out; `None` when no
/// sentence carries one, or when every one does (nothing to choose by), or
/// when not even the first fits.
fn fact_sentences(text: &str, budget: u64) -> Option<String> {
    let sentences = sentences(text);
    let facts = sentences.iter().filter(|s| has_fact(s)).count();
    if facts == 0 || facts == sentences.len() {
        return None;
    }
    let mut out = String::new();
    let mut gap = false;
    for s in &sentences {
        if !has_fact(s) {
            gap = true;
            continue;
        }
        let piece = if out.is_empty() && !gap {
            s.to_string()
        } else if gap {
            format!("{}{s}", GAP.trim_start())
        } else {
            format!(" {s}")
        };
        if tokens::estimate_text_tokens(&out) + tokens::estimate_text_tokens(&piece) > budget {
            break;
        }
        out.push_str(&piece);
        gap = false;
    }
    if out.is_empty() {
        return None;
    }
    if gap || !text.trim_end().ends_with(out.trim_end()) {
        out.push_str(GAP.trim_end());
    }
    Some(out)
}

/// `text` split after each `.`, `?`, `!` or `;` followed by a space, and at
/// line ends; pieces trimmed, empty ones dropped.
fn sentences(text: &str) -> Vec<&str> {
    let mut out = Vec::new();
    for line in text.lines() {
        let mut start = 0;
        let bytes = line.as_bytes();
        for i in 0..bytes.len() {
            let ends = matches!(bytes[i], b'.' | b'?' | b'!' | b';')
                && bytes.get(i + 1).is_some_and(|b| *b == b' ');
            if ends {
                out.push(line[start..=i].trim());
                start = i + 1;
            }
        }
        out.push(line[start..].trim());
    }
    out.retain(|s| !s.is_empty());
    out
}

/// Whether a sentence names something exact: a number, a path or URL, an
/// identifier (`a_b`, `a.b`, `a@b`, `a-1`), a code in capitals, or quoted
/// text.
fn has_fact(sentence: &str) -> bool {
    sentence.split_whitespace().any(|word| {
        let w =
            word.trim_matches(|c: char| matches!(c, ',' | '.' | ';' | ':' | '!' | '?' | '(' | ')'));
        w.chars().any(|c| c.is_ascii_digit())
            || w.contains(['/', '\\', '_', '@', '`', '"'])
            || (w.contains('.') && w.chars().filter(|c| c.is_alphabetic()).count() >= 2)
            || (w.len() >= 3 && w.chars().all(|c| c.is_ascii_uppercase() || c == '-'))
    })
}

/// Rough tokens the section holding `kept` takes (at most the budget
/// [`select`] was given).
// Only tests measure a section after the fact.
#[cfg(test)]
pub(super) fn tokens(kept: &[String]) -> u64 {
    if kept.is_empty() {
        return 0;
    }
    heading_tokens() + kept.iter().map(|k| item_tokens(k)).sum::<u64>()
}

fn heading_tokens() -> u64 {
    tokens::estimate_text_tokens(HEADING) + 2
}

/// `body` followed by the section holding `kept` (unchanged when there is
/// nothing to keep).
pub(crate) fn render(body: &str, kept: &[String]) -> String {
    if kept.is_empty() {
        return body.to_owned();
    }
    let mut out = String::with_capacity(body.len() + kept.iter().map(String::len).sum::<usize>());
    out.push_str(body.trim_end());
    out.push_str("\n\n");
    out.push_str(HEADING);
    out.push('\n');
    for item in kept {
        let mut lines = item.lines();
        out.push_str("- ");
        out.push_str(lines.next().unwrap_or(""));
        out.push('\n');
        for l in lines {
            out.push_str("  ");
            out.push_str(l);
            out.push('\n');
        }
    }
    out.truncate(out.trim_end().len());
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn s(v: &[&str]) -> Vec<String> {
        v.iter().map(|t| (*t).to_owned()).collect()
    }

    #[test]
    fn the_section_round_trips() {
        let kept = s(&[
            "The vault is at /srv/vault-7.",
            "line one\n  indented\nline three",
        ]);
        let body = render("## Summary\nthings happened", &kept);
        assert!(body.starts_with("## Summary\nthings happened\n\n"));
        let (rest, back) = split(&body);
        assert_eq!(rest, "## Summary\nthings happened");
        assert_eq!(back, kept);
        assert_eq!(split("no section"), ("no section".to_owned(), Vec::new()));
        // Text appended after the section (a rolling summary) stays.
        let (rest, back) = split(&format!("{body}\n\nrolling: step 9 done"));
        assert_eq!(rest, "## Summary\nthings happened\n\nrolling: step 9 done");
        assert_eq!(back, kept);
        assert_eq!(render("b", &[]), "b");
    }

    /// Claude Code's reminder parts before the user's own text part: the
    /// ask is the user's message, the reminders are not.
    #[test]
    fn reminders_are_the_agents_not_the_users() {
        let reminder = format!(
            "<system-reminder>\n{}\n</system-reminder>",
            "The following tools are available: read, write, grep. ".repeat(40)
        );
        let turns = vec![
            json!({"role": "user", "content": [
                {"type": "text", "text": reminder},
                {"type": "text", "text": "<system-reminder>Today is 2026-12-07.</system-reminder>"},
                {"type": "text", "text": "Use port 8443 for the admin API."}
            ]}),
            json!({"role": "user", "content": reminder}),
        ];
        let said = of_turns(&turns);
        assert_eq!(said, s(&["Use port 8443 for the admin API."]));
        // Kept whole: a short statement once the reminders are gone.
        assert_eq!(select(&said, 60), said);
        assert_eq!(without_reminders("a <system-reminder>x"), "a");
    }

    /// A statement too long for the budget keeps its sentences with facts
    /// whole; a paste keeps its start and end; a cut that would save less
    /// than its marker is not made.
    #[test]
    fn an_excerpt_keeps_the_facts_and_saves_more_than_it_costs() {
        let statement = "Before we start: the deploy key lives in the vault at /srv/vault-7/deploy. Please be careful with the staging cluster, it is shared with another team and they get upset. Always run the whole test suite first, then ask me before you push anything.";
        let ex = excerpt(statement, 24);
        assert!(ex.contains("/srv/vault-7/deploy"), "{ex}");
        assert!(ex.starts_with("Before we start:"), "{ex}");
        assert!(ex.ends_with("[…]"), "{ex}");
        assert!(tokens::estimate_text_tokens(&ex) < tokens::estimate_text_tokens(statement));
        // A cut of a few characters is not made.
        let near = "x".repeat(150);
        assert_eq!(excerpt(&near, 45), near);
        // A paste is cut in its middle, its start and end kept.
        let paste = format!("log:\n{}done?", "step ok\n".repeat(100));
        let ex = excerpt(&paste, 40);
        assert!(
            ex.starts_with("log:") && ex.ends_with("done?") && ex.contains("left out"),
            "{ex}"
        );
        // Nothing exact in it: start and end.
        let prose = "please be careful with everything. ".repeat(10);
        assert!(excerpt(&prose, 20).contains("left out"));
    }

    #[test]
    fn user_rows_only() {
        let turns = vec![
            json!({"role": "user", "content": "port 8443"}),
            json!({"role": "assistant", "content": "ok"}),
            json!({"role": "tool", "tool_call_id": "c", "content": "out"}),
            json!({"role": "user", "content": [{"type": "text", "text": "code K-19"}]}),
        ];
        assert_eq!(of_turns(&turns), s(&["port 8443", "code K-19"]));
    }

    /// Three short facts early on, then long pasted logs: the facts stay,
    /// the logs are excerpted in what is left.
    #[test]
    fn short_statements_win_over_pasted_logs() {
        let log = format!(
            "here is the log:\n{}\nwhat failed?",
            "ERROR disk full at 12:00\n".repeat(80)
        );
        let mut c = s(&[
            "My vault is /srv/vault-7.",
            "Use port 8443.",
            "The code is K-19.",
        ]);
        for _ in 0..20 {
            c.push(log.clone());
        }
        let kept = select(&c, 122);
        for f in ["/srv/vault-7", "8443", "K-19"] {
            assert!(kept.iter().any(|k| k.contains(f)), "{f} lost: {kept:?}");
        }
        assert!(tokens(&kept) <= 122, "{}", tokens(&kept));
        // An excerpt is marked, keeps its start and its end.
        let ex = kept
            .iter()
            .find(|k| k.contains("left out"))
            .expect("an excerpt");
        assert!(
            ex.starts_with("here is the log:") && ex.ends_with("what failed?"),
            "{ex}"
        );
        // Oldest first, and a repeated message once.
        assert!(kept[0].contains("vault"));
        assert_eq!(kept.iter().filter(|k| k.contains("left out")).count(), 1);
    }

    #[test]
    fn the_first_and_the_newest_when_the_budget_is_short() {
        let c: Vec<String> = (0..50)
            .map(|i| format!("fact number {i} is {}", i * 7))
            .collect();
        let kept = select(&c, 60);
        assert!(kept
            .first()
            .is_some_and(|k| k.starts_with("fact number 0 ")));
        assert!(kept.last().is_some_and(|k| k.starts_with("fact number 49")));
        // The middle gives way.
        assert!(!kept.iter().any(|k| k.starts_with("fact number 25 ")));
        assert!(tokens(&kept) <= 60, "{}", tokens(&kept));
        assert!(select(&c, 0).is_empty());
    }

    /// Carried through many compactions (each time older than the new
    /// messages), the first statements stay.
    #[test]
    fn the_first_statements_survive_being_carried() {
        let mut kept: Vec<String> = Vec::new();
        for round in 0..10 {
            let mut c = kept.clone();
            for i in 0..4 {
                c.push(format!(
                    "Step {}: look at src/module_{}.rs.",
                    round * 4 + i,
                    round * 4 + i
                ));
            }
            if round == 0 {
                c.insert(1, "Remember: the admin port is 48213.".to_owned());
            }
            kept = select(&c, 100);
        }
        assert!(kept.iter().any(|k| k.contains("48213")), "{kept:?}");
        assert!(kept.iter().any(|k| k.contains("Step 39")), "{kept:?}");
    }
}
