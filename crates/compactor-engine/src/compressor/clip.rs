//! Length caps of a summary body: the overshoot clip, the exact budget of
//! small windows, and the cap of the deterministic fallback.

use crate::tokens;

/// Summaries longer than this many times their token target are clipped.
pub(super) const SUMMARY_OVERSHOOT_FACTOR: u64 = 2;

/// Clips a summary body that ignored its "Target ~N tokens" guidance by more
/// than [`SUMMARY_OVERSHOOT_FACTOR`]. On small windows an over-long summary
/// would not fit; the grounded task snapshot comes first and is kept.
pub(super) fn clip_summary(body: String, target_tokens: u64) -> String {
    let max_chars = usize::try_from(
        target_tokens
            .saturating_mul(SUMMARY_OVERSHOOT_FACTOR)
            .saturating_mul(tokens::CHARS_PER_TOKEN),
    )
    .unwrap_or(usize::MAX);
    if body.chars().count() <= max_chars {
        return body;
    }
    let mut clipped: String = body.chars().take(max_chars).collect();
    clipped.push_str("\n...[summary clipped to fit the context window]");
    clipped
}

/// Below this window (the 64k trigger floor) summary bodies are held to
/// their budget exactly; at and above it the looser overshoot cap applies.
pub(super) const STRICT_SUMMARY_WINDOW: u64 = crate::budget::MINIMUM_CONTEXT_LENGTH;

/// [`clip_summary`] sized for the window: below [`STRICT_SUMMARY_WINDOW`]
/// the body is clipped to the summary budget itself (`target` × 4 chars), so
/// head + summary + tail stay under a small window's trigger and the running
/// summary cannot grow across compactions.
pub(super) fn clip_summary_for_window(body: String, target_tokens: u64, window: u64) -> String {
    if window >= STRICT_SUMMARY_WINDOW {
        return clip_summary(body, target_tokens);
    }
    let max_chars = usize::try_from(target_tokens.saturating_mul(tokens::CHARS_PER_TOKEN))
        .unwrap_or(usize::MAX);
    clip_chars(body, max_chars)
}

/// Clips `body` to at most `max_chars` characters, clip note included.
fn clip_chars(body: String, max_chars: usize) -> String {
    const NOTE: &str = "\n...[summary clipped to fit the context window]";
    if body.chars().count() <= max_chars {
        return body;
    }
    if let Some(fit) = crate::salient::fit_lines(&body, max_chars, NOTE.trim_start()) {
        return fit;
    }
    let keep = max_chars.saturating_sub(NOTE.chars().count());
    let mut clipped: String = body.chars().take(keep).collect();
    if let Some(nl) = clipped.rfind('\n').filter(|&nl| nl >= clipped.len() / 2) {
        clipped.truncate(nl);
    }
    clipped.push_str(NOTE);
    clipped
}

/// Longest summary body [`clip_summary_for_window`] leaves whole.
pub(super) fn max_summary_body_chars(target_tokens: u64, window: u64) -> usize {
    let factor = if window >= STRICT_SUMMARY_WINDOW {
        SUMMARY_OVERSHOOT_FACTOR
    } else {
        1
    };
    usize::try_from(
        target_tokens
            .saturating_mul(factor)
            .saturating_mul(tokens::CHARS_PER_TOKEN),
    )
    .unwrap_or(usize::MAX)
}

/// Character cap of a deterministic fallback body: the summary budget
/// (× 4 chars) below [`STRICT_SUMMARY_WINDOW`], `None` (the standard
/// 8,000-char cap) at and above it.
pub(super) fn fallback_body_cap(target_tokens: u64, window: u64) -> Option<usize> {
    if window >= STRICT_SUMMARY_WINDOW {
        return None;
    }
    let cap = usize::try_from(target_tokens.saturating_mul(tokens::CHARS_PER_TOKEN))
        .unwrap_or(usize::MAX);
    Some(cap.min(crate::fallback::FALLBACK_MAX_CHARS))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn small_windows_clip_to_the_budget_itself() {
        let body = format!("HEAD {}", "x".repeat(10_000));
        let small = clip_summary_for_window(body.clone(), 100, 2_048);
        assert!(small.starts_with("HEAD "));
        assert!(small.chars().count() <= 400, "{}", small.chars().count());
        let large = clip_summary_for_window(body, 100, 128_000);
        assert!(large.chars().count() > 400 && large.chars().count() < 900);
        assert_eq!(fallback_body_cap(204, 2_048), Some(816));
        assert_eq!(fallback_body_cap(2_000, 128_000), None);
    }

    #[test]
    fn clip_summary_keeps_the_head() {
        let body = format!("HEAD {}", "x".repeat(10_000));
        let out = clip_summary(body, 100);
        assert!(out.starts_with("HEAD "));
        assert!(out.chars().count() < 900);
        assert_eq!(clip_summary("short".into(), 100), "short");
    }
}
