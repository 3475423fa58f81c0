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

// What is `pub` here is the engine's surface: the types and functions
// re-exported below. Everything else is the crate's, and this lint keeps it
// so.
#![warn(unreachable_pub)]

mod args;
mod assemble;
pub(crate) mod budget;
pub(crate) mod compressor;
pub(crate) mod config;
mod fallback;
pub(crate) mod last_resort;
pub(crate) mod markers;
mod prune;
mod redact;
mod salient;
mod sanitize;
mod serialize;
pub(crate) mod summariser;
pub(crate) mod summary_failure;
mod tail;
#[cfg(test)]
pub(crate) mod test_support;
#[cfg(test)]
mod tests;
pub(crate) mod tokens;
mod tool_summary;
pub(crate) mod trigger;
mod truncated;
mod user_messages;
mod view;

pub use compressor::micro::{MicroOutcome, MicroTelemetry};
pub use compressor::{
    AbortReason, AuxModelFailure, CompressOptions, CompressResult, CompressTelemetry, Compressor,
    NoOpReason, Outcome,
};
pub use config::{CompactionConfig, Strategy};
pub use last_resort::Fit;
pub use markers::{declare_summary, END_MARKER, INFLIGHT_HEADER, NO_USER_SENTINEL, SUMMARY_PREFIX};
pub use summariser::{Summariser, SummaryError, SummaryReply, SummaryRequest};
pub use summary_failure::{SummaryErrorKind, SummaryFailureKind};
pub use tokens::{
    estimate_messages_tokens_rough, estimate_msg_budget_tokens, estimate_request_tokens_rough,
};
pub use trigger::{Trigger, TriggerSnapshot, Usage, WindowSource};
pub use truncated::CUT_MARKER;
pub use view::is_summary;
