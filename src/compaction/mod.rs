//! The compaction engine: decides when and how a conversation's `messages`
//! array is compacted. Pure and synchronous except for the summariser trait.
//!
//! Modules by role:
//! - trigger side: `config`, `budget`, `trigger`
//! - pure leaf functions: `tokens`, `tool_summary`, `args`, `redact`, `markers`,
//!   `serialize`, `fallback`
//! - pipeline: `summariser`, `tail`, `prune`, `assemble`, `sanitize`, `view`,
//!   and `compressor`, a folder of one file per step of a pass (the
//!   `micro` strategy and the `instructions` pinning among them)
//!
//! Entry point: one [`Compressor`] per conversation (it owns that
//! conversation's [`trigger::Trigger`]). Per request the proxy asks
//! `compressor.trigger.should_compress(..)`; when it fires it calls
//! [`Compressor::compress`] (or [`Compressor::micro_compact`] for the micro
//! strategy) with its [`Summariser`] and sends `CompressResult::messages`.
//! The call commits the compressor's own state once, at its end; on
//! `Outcome::Compacted` the caller records
//! `trigger.record_completed_compaction(fallback_used, feasibility_skip,
//! tokens_after)`. `CompressResult::kept_suffix` says how many trailing input
//! messages were sent unchanged, so the replacement prefix of a compaction
//! record is `messages[..messages.len() - kept_suffix]` standing for
//! `input[..input.len() - kept_suffix]`.

pub mod args;
pub mod assemble;
pub mod budget;
pub mod compressor;
pub mod config;
pub mod fallback;
pub mod last_resort;
pub mod markers;
pub mod prune;
pub mod redact;
pub mod salient;
pub mod sanitize;
pub mod serialize;
pub mod summariser;
pub mod summary_failure;
pub mod tail;
#[cfg(test)]
pub(crate) mod test_support;
#[cfg(test)]
mod tests;
pub mod tokens;
pub mod tool_summary;
pub mod trigger;
pub mod truncated;
pub mod user_messages;
pub mod view;

// The compressor's own steps, at their old paths.
pub use compressor::{instructions, micro};

pub use compressor::{
    AbortReason, AuxModelFailure, CompressOptions, CompressResult, Compressor, NoOpReason, Outcome,
    SummaryAttempt, SummaryFailure, SummaryFailureKind,
};
pub use summariser::{Summariser, SummaryError, SummaryReply, SummaryRequest};
pub use summary_failure::SummaryErrorKind;
