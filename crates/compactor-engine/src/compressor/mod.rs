//! The compress pipeline: head protection, tool-output pruning, tail cut,
//! handoff rehydration, summary generation with failure handling, assembly,
//! sanitising and the final size check.
//!
//! A compaction either commits (a strictly smaller conversation) or leaves
//! the input exactly as it was: aborted, no-op and rejected results return the
//! input messages unchanged. The phases only decide; the compressor's own
//! state (running summary, cooldowns, counters, the standing failure) is
//! changed once, at the end, according to the outcome, so no early return
//! needs a rollback.
//!
//! One file per step, children of this one and in this order of use:
//! `instructions` (the pass runs without the instruction rows), `cut`
//! (head, pruning, tail cut), `generate` and `summary_call` (the summary
//! and its calls), `failure` (how a call failed and what that forbids),
//! `batch` (one compaction from cut to commit), `salvage` (the size rule
//! and the shrinking of a candidate that misses it), `clip` (summary
//! length caps), `outcome` (what a pass returns) and `micro` (the micro
//! strategy, driven by the same compressor).
//!
//! Each imports only the files after it in the `[compactor-engine/compressor]`
//! order of `scripts/layers.txt`: `batch`, `cut`, `generate`, `micro`,
//! `salvage`, then `instructions`, `clip`, `summary_call`, `outcome`,
//! `failure`.

mod batch;
mod clip;
mod cut;
mod failure;
mod generate;
pub(crate) mod instructions;
pub(crate) mod micro;
mod outcome;
mod salvage;
mod summary_call;

use std::sync::Arc;

use serde_json::Value;

use crate::config::CompactionConfig;
use crate::last_resort::Fit;
use crate::tail::TailParams;
use crate::trigger::Trigger;
use crate::view;

use crate::summary_failure::SummaryFailureKind;
use batch::RejectedRows;
use cut::minimal_head_size;
pub use failure::{AbortReason, AuxModelFailure};
use instructions::is_instructions;
use micro::MicroState;
pub use outcome::{CompressResult, CompressTelemetry, NoOpReason, Outcome};

/// Extra rows after `protect_first_n` probed for an earlier handoff.
pub(crate) const HANDOFF_PROBE_EXTRA: usize = 4;

/// Options of one `compress` call.
#[derive(Clone, Debug, Default)]
pub struct CompressOptions {
    /// Manual or overflow-forced compaction: clears the cooldown and the
    /// structural backoff, and never takes the feasibility skip.
    pub force: bool,
    /// The caller's token figure for the request (telemetry only).
    pub current_tokens: Option<u64>,
    /// Run the summary call even during a cooldown, without clearing it
    /// (provider-proven overflow recovery).
    pub bypass_cooldown: bool,
    /// What the summary should focus on.
    pub focus_topic: Option<String>,
    /// Today's date (`YYYY-MM-DD`) for temporal anchoring in the summary
    /// prompt; the engine has no clock of its own.
    pub today: Option<String>,
    /// Rough tokens the messages must fit into to be sent at all (window
    /// minus reply reservation and tools). When the call leaves them larger
    /// (nothing to compact, or not enough), the largest messages are
    /// shortened as a last resort (`super::last_resort`).
    pub fit_tokens: Option<u64>,
    /// How firmly the last resort aims at `fit_tokens`.
    pub fit: Fit,
    /// Rough tokens a compacted result's messages should settle under (the
    /// caller's mark between the compaction target and the trigger): a
    /// result above it would be compacted again on the next turn, so its
    /// largest messages are shortened in the same pass when that reaches
    /// it (`super::last_resort`).
    pub settle_tokens: Option<u64>,
}

/// What a compressor carries from pass to pass: its running summary and
/// the summary model in use. A pass run apart from the conversation (the
/// background pre-compaction) starts from the conversation's and hands its
/// own back.
#[derive(Clone, Debug)]
pub struct Carry {
    previous_summary: Option<String>,
    summary_has_user_turn: bool,
    summary_model: Option<String>,
    summary_model_fallen_back: bool,
    compression_count: u32,
}

/// The per-conversation compaction engine.
pub struct Compressor {
    /// Configuration shared by all conversations.
    pub(crate) cfg: Arc<CompactionConfig>,
    /// Trigger, budgets, cooldowns and breakers.
    pub(crate) trigger: Trigger,
    /// Body of the running summary (no prefix, no END marker).
    pub(crate) previous_summary: Option<String>,
    /// Whether the running summary is grounded in a real user turn.
    pub(crate) summary_has_user_turn: bool,
    /// Summary model; `None` = the main model.
    pub(crate) summary_model: Option<String>,
    /// A distinct summary model failed and the main model took over.
    pub(crate) summary_model_fallen_back: bool,
    /// The worst terminal summary failure since the last successful summary.
    /// It outlives the call that saw it: a later call that returns early on
    /// the cooldown must still abort rather than fall through to a fallback
    /// summary that would drop context.
    pub(crate) terminal_failure: Option<SummaryFailureKind>,
    /// Micro-compaction state.
    pub(crate) micro: MicroState,
    /// The rows whose summary was last rejected as not smaller: asking for
    /// the same summary again (on the overflow retry, or a turn or two
    /// later) would be rejected again, at the price of the summary calls.
    rejected: Option<RejectedRows>,
}

impl Compressor {
    /// A compressor for one conversation.
    pub fn new(cfg: Arc<CompactionConfig>, trigger: Trigger) -> Self {
        let summary_model = cfg.summary_model.clone().filter(|m| !m.is_empty());
        Self {
            cfg,
            trigger,
            previous_summary: None,
            summary_has_user_turn: true,
            summary_model,
            summary_model_fallen_back: false,
            terminal_failure: None,
            micro: MicroState::default(),
            rejected: None,
        }
    }

    /// What this compressor carries into a pass of another (the
    /// background pre-compaction's).
    pub fn carry(&self) -> Carry {
        Carry {
            previous_summary: self.previous_summary.clone(),
            summary_has_user_turn: self.summary_has_user_turn,
            summary_model: self.summary_model.clone(),
            summary_model_fallen_back: self.summary_model_fallen_back,
            compression_count: self.trigger.compression_count,
        }
    }

    /// What a pass apart from the conversation's left (the candidate it
    /// hands back).
    pub fn into_carry(self) -> Carry {
        Carry {
            compression_count: self.trigger.compression_count,
            previous_summary: self.previous_summary,
            summary_has_user_turn: self.summary_has_user_turn,
            summary_model: self.summary_model,
            summary_model_fallen_back: self.summary_model_fallen_back,
        }
    }

    /// A compressor for a pass apart from the conversation's (the
    /// background pre-compaction, a task of its own): it resumes `carry`
    /// and, for a micro pass, the conversation's micro state.
    pub fn resumed(
        cfg: Arc<CompactionConfig>,
        trigger: Trigger,
        carry: Carry,
        micro: Option<MicroState>,
    ) -> Self {
        let mut c = Self::new(cfg, trigger);
        c.previous_summary = carry.previous_summary;
        c.summary_has_user_turn = carry.summary_has_user_turn;
        c.summary_model = carry.summary_model;
        c.summary_model_fallen_back = carry.summary_model_fallen_back;
        c.trigger.compression_count = carry.compression_count;
        if let Some(m) = micro {
            c.micro = m;
        }
        c
    }

    /// The conversation takes the batch compaction a pass apart from it
    /// made (`pass`, what that pass left): its running summary, one
    /// compaction more, a fresh micro state, and the trigger told as after
    /// a pass of its own. The summary model in use stays the
    /// conversation's.
    pub fn adopt(
        &mut self,
        pass: Carry,
        fallback_used: bool,
        feasibility_skip: bool,
        tokens_after: u64,
    ) {
        self.previous_summary = pass.previous_summary;
        self.summary_has_user_turn = pass.summary_has_user_turn;
        self.trigger.compression_count = self.trigger.compression_count.saturating_add(1);
        self.micro = MicroState::default();
        self.trigger
            .record_completed_compaction(fallback_used, feasibility_skip, tokens_after);
    }

    /// The micro strategy's rolling state.
    pub fn micro_state(&self) -> &MicroState {
        &self.micro
    }

    /// Takes the micro state a micro pass apart from the conversation left.
    pub fn set_micro_state(&mut self, state: MicroState) {
        self.micro = state;
    }

    /// The conversation's trigger: when to compact, and what the last
    /// compaction left.
    pub fn trigger(&self) -> &Trigger {
        &self.trigger
    }

    /// The trigger, to feed it the upstream's usage, a compaction's
    /// outcome or a restored snapshot.
    pub fn trigger_mut(&mut self) -> &mut Trigger {
        &mut self.trigger
    }

    /// Judges "first compaction" by the history about to be compacted, not
    /// by this compressor's past: a history that carries no summary row was
    /// never compacted (another chat with the same opening, or the client's
    /// own history again after it diverged from the record), so the count
    /// of compactions and the running summary of the earlier one are
    /// forgotten and its head is protected as a first compaction's is.
    /// aider's chats from one credential share one fingerprint (its system
    /// prompt and few-shot head are fixed): the second chat's first
    /// compaction was treated as a later one and dropped the few-shot head.
    pub fn judge_by_history(&mut self, msgs: &[Value]) {
        if !msgs.iter().any(view::is_summary) {
            self.trigger.compression_count = 0;
            self.previous_summary = None;
        }
    }

    /// `protect_first_n` after decay: 0 once a compaction happened, a
    /// summary is in memory, or a handoff sits near the start (the head it
    /// would protect was summarised already).
    pub(crate) fn effective_protect_first_n(&self, msgs: &[Value]) -> usize {
        if self.trigger.compression_count >= 1 || self.previous_summary.is_some() {
            return 0;
        }
        let sys = usize::from(msgs.first().is_some_and(is_instructions));
        let probe_end = (sys + self.cfg.protect_first_n + HANDOFF_PROBE_EXTRA).min(msgs.len());
        if msgs[sys.min(probe_end)..probe_end]
            .iter()
            .any(view::is_summary)
        {
            return 0;
        }
        self.cfg.protect_first_n
    }

    /// Rows of the protected head: the system prompt (if first) plus the
    /// effective `protect_first_n`.
    pub(crate) fn protect_head_size(&self, msgs: &[Value]) -> usize {
        let sys = usize::from(msgs.first().is_some_and(is_instructions));
        (sys + self.effective_protect_first_n(msgs)).min(msgs.len())
    }

    /// The head of one compress call: relaxed to the system prompt alone
    /// when a small window cannot afford more (see [`Compressor::cut`]).
    fn head_size(&self, msgs: &[Value], relax: bool) -> usize {
        if relax {
            minimal_head_size(msgs).min(self.protect_head_size(msgs))
        } else {
            self.protect_head_size(msgs)
        }
    }

    /// Tail-cut parameters from the current budgets.
    pub(crate) fn tail_params(&mut self) -> TailParams {
        let budget = self.trigger.tail_token_budget();
        let window = self.trigger.context_length();
        TailParams {
            budget,
            soft_ceiling: crate::budget::soft_tail_ceiling(budget, window),
            protect_last_n: self.cfg.protect_last_n,
            min_tail_user_messages: self.cfg.min_tail_user_messages,
            // The tail's own oversized-active-turn rule moves the ask into the
            // summary; compress splits such a turn itself instead
            // ([`split_active_turn`]) so the ask stays verbatim.
            allow_split_turn: false,
        }
    }

    /// The tail cut with the current budgets (or an explicit budget).
    // Only tests use it.
    #[cfg(test)]
    pub(crate) fn find_tail_cut_by_tokens(
        &mut self,
        msgs: &[Value],
        head_end: usize,
        token_budget: Option<u64>,
    ) -> usize {
        let mut p = self.tail_params();
        if let Some(b) = token_budget {
            p.budget = b;
            p.soft_ceiling = crate::budget::soft_tail_ceiling(b, self.trigger.context_length());
        }
        crate::tail::find_tail_cut_by_tokens(msgs, head_end, &p)
    }

    /// Switches summaries to the main model after a distinct summary model
    /// failed, and clears the cooldown so the retry is not held back by the
    /// failure of a model that is no longer used.
    pub(crate) fn fallback_to_main_for_compression(&mut self) {
        self.summary_model = None;
        self.summary_model_fallen_back = true;
        self.trigger.clear_failure_cooldown();
    }

    fn distinct_summary_model(&self) -> bool {
        self.summary_model
            .as_deref()
            .is_some_and(|m| !m.is_empty() && m != self.trigger.model())
    }
}

#[cfg(test)]
mod tests;
