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

/// The text of every real user message of `turns`, oldest first.
pub(crate) fn of_turns(turns: &[Value]) -> Vec<String> {
    turns
        .iter()
        .filter(|m| view::is_real_user(m))
        .map(view::text)
        .map(|t| t.trim().to_owned())
        .filter(|t| !t.is_empty())
        .collect()
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

/// `text` cut to about `budget` tokens: its start and its end around a
/// marker saying how much was left out.
fn excerpt(text: &str, budget: u64) -> String {
    let chars: Vec<char> = text.chars().collect();
    let keep = usize::try_from(
        budget
            .saturating_sub(12)
            .saturating_mul(tokens::CHARS_PER_TOKEN),
    )
    .unwrap_or(usize::MAX);
    if chars.len() <= keep {
        return text.to_owned();
    }
    let head = keep * 2 / 3;
    let tail = keep - head;
    let start: String = chars[..head].iter().collect();
    let end: String = chars[chars.len() - tail..].iter().collect();
    format!(
        "{} […{} chars of this message left out…] {}",
        start.trim_end(),
        chars.len() - keep,
        end.trim_start()
    )
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
