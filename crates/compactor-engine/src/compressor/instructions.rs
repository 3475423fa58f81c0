//! Instructions are not history.
//!
//! An agent's `system` and `developer` messages are its instructions: the
//! base prompt, sandbox and approval rules, the environment block Claude
//! Code puts inside `messages`, a permissions update Codex sends halfway
//! through a session. Summarising one loses rules the model must follow,
//! and shortening one cuts them in half; neither makes the conversation
//! meaningfully smaller, since the agent sends them again on every turn.
//!
//! So every pass of the engine works on the conversation *without* them
//! ([`pin`]): the leading message stays the pass's head, the other
//! instruction rows are taken out, and the result is put back together
//! ([`Pinned::restore`]): rows the pass kept are the client's rows in
//! their places, instructions included. Instructions that stood among the
//! head rows the pass kept go back there, in their places; those from the
//! part that was replaced go next to the summary that stands for the rows
//! around them: after it when it is a row of its own, before it when it
//! was merged into a kept row.

use serde_json::Value;

use super::outcome::{CompressResult, Outcome};
use crate::markers::{self, Handoff};
use crate::tokens;
use crate::view;

/// `system` or `developer`: an instruction row.
pub(crate) fn is_instructions(m: &Value) -> bool {
    view::is_role(m, "system") || view::is_role(m, "developer")
}

/// The instruction rows taken out of a conversation for one pass.
#[derive(Debug)]
pub(crate) struct Pinned {
    /// Where each row of the pass's input stood in the conversation.
    index: Vec<usize>,
    /// The rows taken out, with their place in the conversation (ascending).
    rows: Vec<(usize, Value)>,
    /// Rough tokens of `rows`.
    tokens: u64,
}

/// Takes every instruction row out of `messages` but a leading first one;
/// `None` when there is none to take (the pass then runs on `messages`).
pub(crate) fn pin(messages: &[Value]) -> Option<(Vec<Value>, Pinned)> {
    let first = messages.first().is_some_and(is_instructions);
    let from = usize::from(first);
    if !messages[from.min(messages.len())..]
        .iter()
        .any(is_instructions)
    {
        return None;
    }
    let mut reduced = Vec::with_capacity(messages.len());
    let mut index = Vec::with_capacity(messages.len());
    let mut rows = Vec::new();
    for (i, m) in messages.iter().enumerate() {
        if i >= from && is_instructions(m) {
            rows.push((i, m.clone()));
        } else {
            reduced.push(m.clone());
            index.push(i);
        }
    }
    let tokens = rows
        .iter()
        .map(|(_, m)| tokens::estimate_messages_tokens_rough(std::slice::from_ref(m)))
        .sum();
    Some((
        reduced,
        Pinned {
            index,
            rows,
            tokens,
        },
    ))
}

impl Pinned {
    /// Rough tokens of the rows taken out.
    pub(crate) fn tokens(&self) -> u64 {
        self.tokens
    }

    /// Where row `i` of the pass's input stands in the conversation (the
    /// input's length maps to the conversation's).
    pub(crate) fn to_original(&self, i: usize) -> usize {
        match self.index.get(i) {
            Some(&o) => o,
            None => self.index.len() + self.rows.len(),
        }
    }

    /// The pass's result over the whole conversation `original`.
    pub(crate) fn restore(&self, original: &[Value], mut r: CompressResult) -> CompressResult {
        if r.outcome != Outcome::Compacted {
            r.messages = original.to_vec();
            r.kept_suffix = original.len();
            r.tokens_before += self.tokens;
            r.tokens_after += self.tokens;
            r.telemetry.messages_before = original.len();
            r.telemetry.messages_after = original.len();
            return r;
        }
        let n = self.index.len();
        let kept = r.kept_suffix.min(n).min(r.messages.len());
        let replaced = n - kept;
        // Everything after the last replaced row is the client's, in place.
        let cut = match replaced {
            0 => 0,
            k => self.index[k - 1] + 1,
        };
        let old_prefix = r.messages.len() - kept;
        let summary = r.summary_index.filter(|&s| s < old_prefix);
        // The head the pass kept as it was: the instructions among its rows
        // go back between them, the others next to the summary.
        let head = r.messages[..summary.unwrap_or(old_prefix)]
            .iter()
            .zip(
                original
                    .iter()
                    .enumerate()
                    .filter(|(i, _)| self.index.binary_search(i).is_ok()),
            )
            .take_while(|(out, (_, orig))| out == orig)
            .count();
        let head_end = match self.index.get(head) {
            Some(&o) if head < replaced => o,
            _ => cut,
        };
        // A summary row of its own stands for the rows it replaced, and the
        // instructions that stood among them follow it, as an agent's
        // instructions follow the turn they came with (Claude Code's
        // environment block after the first user message). A summary merged
        // into a kept row is followed by that row's content: they go first.
        let after = summary.is_some_and(|s| {
            matches!(
                markers::classify_handoff(&r.messages[s]),
                Handoff::Standalone { live: None, .. }
            )
        });
        let at = summary.map_or(old_prefix, |s| s + usize::from(after));
        let moved = self
            .rows
            .iter()
            .filter(|(i, _)| (head_end..cut).contains(i))
            .map(|(_, m)| m.clone());
        let mut messages = Vec::with_capacity(r.messages.len() + self.rows.len());
        messages.extend(original[..head_end].iter().cloned());
        messages.extend(r.messages[head..at].iter().cloned());
        let before_moved = messages.len();
        messages.extend(moved);
        let moved_n = messages.len() - before_moved;
        messages.extend(r.messages[at..old_prefix].iter().cloned());
        let new_prefix = messages.len();
        let summary_index = summary.map(|s| {
            let s = head_end + (s - head);
            if after {
                s
            } else {
                s + moved_n
            }
        });
        messages.extend(original[cut..].iter().cloned());
        // A summary row among the kept ones (an earlier one) moves with
        // the client's rows around it.
        let kept_summary = r
            .summary_index
            .filter(|&s| s >= old_prefix)
            .map(|s| new_prefix + self.to_original(replaced + (s - old_prefix)) - cut);
        r.summary_index = summary_index.or(kept_summary);
        r.messages = messages;
        r.kept_suffix = original.len() - cut;
        r.tokens_before += self.tokens;
        r.tokens_after += self.tokens;
        r.telemetry.messages_before = original.len();
        r.telemetry.messages_after = r.messages.len();
        r
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::compressor::CompressTelemetry;
    use serde_json::json;

    fn m(role: &str, text: &str) -> Value {
        json!({"role": role, "content": text})
    }

    fn compacted(
        messages: Vec<Value>,
        kept_suffix: usize,
        summary: Option<usize>,
    ) -> CompressResult {
        CompressResult {
            messages,
            outcome: Outcome::Compacted,
            summary_index: summary,
            fallback_used: false,
            feasibility_skip: false,
            dropped_count: 0,
            tokens_before: 100,
            tokens_after: 50,
            kept_suffix,
            summary_failure: None,
            aux_model_failure: None,
            micro: None,
            telemetry: CompressTelemetry::default(),
        }
    }

    #[test]
    fn nothing_to_pin_without_instructions_after_the_first_row() {
        let conv = [m("system", "s"), m("user", "u"), m("assistant", "a")];
        assert!(pin(&conv).is_none());
        assert!(pin(&[]).is_none());
    }

    /// Codex: two developer messages lead, a third arrives mid-session.
    #[test]
    fn a_pass_sees_no_instruction_but_the_first_and_gets_them_all_back() {
        let conv = vec![
            m("developer", "base"),
            m("developer", "perms"),
            m("user", "u1"),
            m("assistant", "a1"),
            m("developer", "perms v2"),
            m("user", "u2"),
            m("assistant", "a2"),
            m("system", "env"),
            m("user", "u3"),
        ];
        let (reduced, pinned) = pin(&conv).expect("pinned");
        assert_eq!(
            reduced,
            vec![
                m("developer", "base"),
                m("user", "u1"),
                m("assistant", "a1"),
                m("user", "u2"),
                m("assistant", "a2"),
                m("user", "u3"),
            ]
        );
        assert_eq!(pinned.to_original(3), 5);
        assert_eq!(pinned.to_original(reduced.len()), conv.len());
        // The pass replaced u1..a2 by a summary and kept u3.
        let out = vec![
            m("developer", "base"),
            m("user", "SUMMARY"),
            m("user", "u3"),
        ];
        let r = pinned.restore(&conv, compacted(out, 1, Some(1)));
        assert_eq!(
            r.messages,
            vec![
                m("developer", "base"),
                m("developer", "perms"),
                m("developer", "perms v2"),
                m("user", "SUMMARY"),
                m("system", "env"),
                m("user", "u3"),
            ]
        );
        assert_eq!(r.summary_index, Some(3));
        // The env row stood between the last replaced row and u3: it is
        // part of the client's own suffix.
        assert_eq!(r.kept_suffix, 2);
        assert_eq!(r.tokens_before, 100 + pinned.tokens());
    }

    /// Claude Code: its environment block is a system message right
    /// after the first user message; a first compaction keeps a head.
    #[test]
    fn an_instruction_among_the_kept_head_stays_in_its_place() {
        let conv = vec![
            m("system", "base"),
            m("user", "u1"),
            m("system", "env"),
            m("assistant", "a1"),
            m("user", "u2"),
            m("assistant", "a2"),
            m("user", "u3"),
            m("assistant", "a3"),
            m("user", "u4"),
        ];
        let (reduced, pinned) = pin(&conv).expect("pinned");
        assert_eq!(reduced.len(), 8);
        let out = vec![
            m("system", "base"),
            m("user", "u1"),
            m("assistant", "a1"),
            m("user", "SUMMARY"),
            m("user", "u4"),
        ];
        let r = pinned.restore(&conv, compacted(out, 1, Some(3)));
        assert_eq!(
            r.messages,
            vec![
                m("system", "base"),
                m("user", "u1"),
                m("system", "env"),
                m("assistant", "a1"),
                m("user", "SUMMARY"),
                m("user", "u4"),
            ]
        );
        assert_eq!(r.summary_index, Some(4));
        assert_eq!(r.kept_suffix, 1);
    }

    #[test]
    fn an_unchanged_pass_gives_back_the_conversation_itself() {
        let conv = vec![m("user", "u1"), m("system", "note"), m("user", "u2")];
        let (reduced, pinned) = pin(&conv).expect("pinned");
        assert_eq!(reduced.len(), 2);
        let mut r = compacted(reduced, 2, None);
        r.outcome = Outcome::Rejected;
        let r = pinned.restore(&conv, r);
        assert_eq!(r.messages, conv);
        assert_eq!(r.kept_suffix, conv.len());
    }

    #[test]
    fn without_a_leading_instruction_every_instruction_is_pinned() {
        let conv = vec![
            m("user", "u1"),
            m("assistant", "a1"),
            m("system", "note"),
            m("user", "u2"),
            m("assistant", "a2"),
            m("user", "u3"),
        ];
        let (reduced, pinned) = pin(&conv).expect("pinned");
        assert!(!reduced.iter().any(is_instructions));
        // u1..u2 replaced (summary first), a2, u3 kept.
        let out = vec![m("user", "SUMMARY"), m("assistant", "a2"), m("user", "u3")];
        let r = pinned.restore(&conv, compacted(out, 2, Some(0)));
        assert_eq!(
            r.messages,
            vec![
                m("system", "note"),
                m("user", "SUMMARY"),
                m("assistant", "a2"),
                m("user", "u3"),
            ]
        );
        assert_eq!(r.summary_index, Some(1));
        assert_eq!(r.kept_suffix, 2);
    }
}
