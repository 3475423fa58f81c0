//! The compaction engine: decides when and how a conversation's `messages`
//! array is compacted. Pure and synchronous except for the summariser trait.
//!
//! Its surface is what this file re-exports, nothing else:
//! - [`Compressor`] (one per conversation: [`Compressor::compress`],
//!   [`Compressor::micro_compact`], its [`Trigger`]), [`CompressOptions`],
//!   [`Fit`], and what a pass returns: [`CompressResult`] (read-only),
//!   [`Outcome`], [`AbortReason`], [`NoOpReason`], [`CompressTelemetry`],
//!   [`MicroOutcome`], [`MicroTelemetry`];
//! - [`Trigger`] (when to compact; what real usage says), [`Usage`],
//!   [`WindowSource`], [`TriggerSnapshot`] (what outlives a process);
//! - [`CompactionConfig`], [`Strategy`];
//! - the [`Summariser`] trait and its [`SummaryRequest`], [`SummaryReply`],
//!   [`SummaryError`] ([`SummaryErrorKind`], [`SummaryFailureKind`]);
//! - the rough token estimates, [`declare_summary`] / [`is_summary`] (only
//!   a record makes a row a summary), and the texts a summary is framed by.
//!
//! The crate's chat path also uses a few `pub(crate)` calls (the background
//! pass's [`Compressor`] hand-over, the last resort's budget, the token
//! estimates of a raw message). Inside, the modules import only downward in
//! the `[compaction]` order of `scripts/layers.txt`: `compressor` (a folder
//! of one file per step of a pass, the `micro` strategy and the
//! `instructions` pinning among them); the trigger side `trigger`, `budget`,
//! `config`; the steps `prune`, `fallback`, `assemble`, `last_resort`,
//! `user_messages`, `sanitize`, `tail`, `truncated`, `salient`,
//! `tool_summary`, `args`; the leaves `summariser`, `summary_failure`,
//! `serialize`, `tokens`, `view`, `markers`, `redact`.
//!
//! Per request the proxy asks `compressor.trigger_mut().should_compress(..)`;
//! when it fires it calls [`Compressor::compress`] (or
//! [`Compressor::micro_compact`] for the micro strategy) with its
//! [`Summariser`] and sends [`CompressResult::messages`]. The call commits
//! the compressor's own state once, at its end; on `Outcome::Compacted` the
//! caller records `trigger.record_completed_compaction(fallback_used,
//! feasibility_skip, tokens_after)`. [`CompressResult::kept_suffix`] says
//! how many trailing input messages were sent unchanged, so the replacement
//! prefix of a compaction record is `messages[..messages.len() -
//! kept_suffix]` standing for `input[..input.len() - kept_suffix]`.

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
pub use summariser::{InContextAsk, Summariser, SummaryError, SummaryReply, SummaryRequest};
pub use summary_failure::{SummaryErrorKind, SummaryFailureKind};
pub use tokens::{
    estimate_messages_tokens_rough, estimate_msg_budget_tokens, estimate_request_tokens_rough,
};
pub use trigger::{Trigger, TriggerSnapshot, Usage, WindowSource};
pub use truncated::CUT_MARKER;
pub use view::is_summary;
