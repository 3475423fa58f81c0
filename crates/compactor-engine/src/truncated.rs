//! Summaries that hit the reply cap (`finish_reason: "length"`).
//!
//! A cut summary is not thrown away: the engine retries once with a firmer
//! length instruction when the summariser's prompt budget has room for it,
//! and otherwise keeps what came back, cut at its last complete line and
//! marked as cut. Only a reply with no complete line left is a failure.

/// Appended to a summary that was cut at its last complete line.
pub const CUT_MARKER: &str = "[summary cut at the reply limit; later details may be missing]";

/// `body` (the cleaned text of a truncated reply) cut at its last complete
/// line, without a trailing section heading that lost its content, plus
/// [`CUT_MARKER`]; `None` when no complete line is left.
pub(super) fn cut_at_last_line(body: &str) -> Option<String> {
    let end = body.rfind('\n')?;
    let mut lines: Vec<&str> = body[..end].lines().collect();
    while lines
        .last()
        .is_some_and(|l| l.trim().is_empty() || l.trim_start().starts_with('#'))
    {
        lines.pop();
    }
    if lines.iter().all(|l| l.trim().is_empty()) {
        return None;
    }
    let mut out = lines.join("\n");
    out.push_str("\n\n");
    out.push_str(CUT_MARKER);
    Some(out)
}

/// The firmer length instruction of the one retry after a cut summary.
pub(crate) fn firm_instruction(target_tokens: u64) -> String {
    let words = target_tokens.saturating_mul(3) / 4;
    format!(
        "\n\nIMPORTANT: a previous answer to this request was cut off at the reply limit. \
         Keep the whole checkpoint under ~{target_tokens} tokens (about {words} words): short \
         bullet lines, the most important facts first (the user's asks and constraints, \
         decisions, identifiers, file paths, errors, exact values); drop narrative."
    )
}

/// The prompt of the retry, when it still fits `budget_chars`.
pub(crate) fn firm_prompt(prompt: &str, target_tokens: u64, budget_chars: usize) -> Option<String> {
    let extra = firm_instruction(target_tokens);
    (prompt.chars().count() + extra.chars().count() <= budget_chars)
        .then(|| format!("{prompt}{extra}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cuts_at_the_last_complete_line() {
        let cut = cut_at_last_line("## A\n- one\n- two\n## B\n- thr").unwrap();
        assert!(cut.starts_with("## A\n- one\n- two\n\n"), "{cut}");
        assert!(cut.ends_with(CUT_MARKER));
        assert!(!cut.contains("## B") && !cut.contains("thr"));
        assert_eq!(cut_at_last_line("## Partial summ"), None);
        assert_eq!(cut_at_last_line("## Heading\n- pa"), None);
    }

    #[test]
    fn the_retry_prompt_must_fit() {
        let p = "x".repeat(100);
        assert!(firm_prompt(&p, 300, 10_000).is_some_and(|f| f.contains("~300 tokens")));
        assert_eq!(firm_prompt(&p, 300, 150), None);
    }
}
