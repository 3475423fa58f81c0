//! The compaction engine of the compactor proxy: decides when and how a
//! chat conversation's `messages` array (OpenAI's chat shape, as
//! [`serde_json::Value`]s) is compacted to fit a model's context window.
//! Deterministic and free of I/O: its one asynchronous edge is the
//! [`Summariser`] trait, the model call that writes a summary, which the
//! caller implements. The proxy embeds it; nothing here knows of HTTP.
//!
//! # What a caller does
//!
//! 1. Once: a [`CompactionConfig`] ([`Default`], deserialised, or
//!    [`CompactionConfig::from_table`] from a TOML table), in an `Arc`.
//! 2. Per conversation: a [`Trigger`] for its model and window
//!    ([`Trigger::new`] with [`WindowSource::Known`]) and a [`Compressor`]
//!    owning it ([`Compressor::new`]). Both keep state from turn to turn;
//!    [`Trigger::snapshot`] / [`Trigger::restore`] carry what matters over a
//!    restart ([`TriggerSnapshot`]).
//! 3. Per request: ask `compressor.trigger_mut().should_compress(..)` with
//!    the prompt's token count; when it fires, call [`Compressor::compress`]
//!    (or [`Compressor::micro_compact`] for [`Strategy::Micro`]) with the
//!    messages, the summariser and [`CompressOptions`], and send
//!    [`CompressResult::messages`]. The call commits the compressor's own
//!    state once, at its end. On [`Outcome::Compacted`] record it:
//!    `trigger_mut().record_completed_compaction(fallback_used,
//!    feasibility_skip, tokens_after)`.
//! 4. Per reply: feed the upstream's [`Usage`] to
//!    [`Trigger::update_from_response`], which is how the trigger learns
//!    the real token counts and judges whether the last compaction worked.
//!
//! A summary call that fails (an `Err` from [`Summariser::summarise`]: no
//! provider, a timeout, a refusal) never fails the pass: the engine writes a
//! deterministic summary of what it dropped instead
//! ([`CompressResult::fallback_used`]) and the trigger cools down. When even
//! a compaction leaves the messages larger than [`CompressOptions::fit_tokens`],
//! the largest are shortened as a last resort ([`Fit`]).
//!
//! [`CompressResult::kept_suffix`] says how many trailing input messages
//! were sent unchanged, so the replacement prefix of a compaction is
//! `messages[..messages.len() - kept_suffix]` standing for
//! `input[..input.len() - kept_suffix]`. A summary row is one that
//! [`declare_summary`] marked ([`is_summary`]); its text alone never makes
//! it one.
//!
//! # Example
//!
//! A summariser that answers with a fixed text stands in for a model call;
//! a forced compaction of a 40-message conversation replaces its middle
//! with one summary row:
//!
//! ```
//! use std::sync::Arc;
//!
//! use compactor_engine::{
//!     is_summary, CompactionConfig, CompressOptions, Compressor, Outcome, Summariser,
//!     SummaryError, SummaryReply, SummaryRequest, Trigger, WindowSource,
//! };
//! use serde_json::{json, Value};
//!
//! /// The model that writes summaries: here, always the same text.
//! struct Fixed;
//!
//! #[async_trait::async_trait]
//! impl Summariser for Fixed {
//!     async fn summarise(&self, _req: SummaryRequest) -> Result<SummaryReply, SummaryError> {
//!         Ok(SummaryReply::text("The user asked about files 0-35; all were read."))
//!     }
//! }
//!
//! let cfg = Arc::new(CompactionConfig::default());
//! let trigger = Trigger::new(cfg.clone(), "my-model", WindowSource::Known(32_000), None);
//! let mut compressor = Compressor::new(cfg, trigger);
//!
//! let mut messages: Vec<Value> = vec![json!({"role": "system", "content": "You are terse."})];
//! for i in 0..40 {
//!     let role = if i % 2 == 0 { "user" } else { "assistant" };
//!     messages.push(json!({"role": role, "content": format!("turn {i}: {}", "words ".repeat(50))}));
//! }
//!
//! // Any executor will do: the engine only awaits the summariser.
//! let rt = tokio::runtime::Builder::new_current_thread().build()?;
//! let opts = CompressOptions { force: true, ..Default::default() };
//! let result = rt.block_on(compressor.compress(&messages, &Fixed, opts));
//!
//! assert_eq!(result.outcome(), Outcome::Compacted);
//! assert!(result.messages().len() < messages.len());
//! assert!(result.messages().iter().any(is_summary));
//! assert!(!result.fallback_used());
//! // The system prompt and the latest turns are sent as they were.
//! assert_eq!(result.messages()[0], messages[0]);
//! assert_eq!(result.messages().last(), messages.last());
//! compressor.trigger_mut().record_completed_compaction(
//!     result.fallback_used(),
//!     result.feasibility_skip(),
//!     result.tokens_after(),
//! );
//! # Ok::<(), std::io::Error>(())
//! ```
//!
//! # Surface
//!
//! What this file re-exports, nothing else:
//! - [`Compressor`] (one per conversation), [`CompressOptions`], [`Fit`],
//!   and what a pass returns: [`CompressResult`] (read-only), [`Outcome`],
//!   [`AbortReason`], [`NoOpReason`], [`AuxModelFailure`],
//!   [`CompressTelemetry`], [`MicroOutcome`], [`MicroTelemetry`];
//! - [`Trigger`] (when to compact; what real usage says), [`Usage`],
//!   [`WindowSource`], [`TriggerSnapshot`] (what outlives a process);
//! - [`CompactionConfig`], [`Strategy`], [`InvalidSetting`];
//! - the [`Summariser`] trait and its [`SummaryRequest`], [`InContextAsk`],
//!   [`SummaryReply`], [`SummaryError`] ([`SummaryErrorKind`],
//!   [`SummaryFailureKind`]);
//! - the rough token estimates, [`declare_summary`] / [`is_summary`], and
//!   the texts a summary is framed by;
//! - for a caller that runs passes apart from the conversation (the proxy's
//!   background pre-compaction): [`Carry`], [`MicroState`],
//!   [`Compressor::resumed`], [`Compressor::adopt`],
//!   [`Compressor::micro_compact_ahead`]; and for one that shortens a
//!   prompt a provider rejected: [`fit_budget`] with [`FitInputs`].
//!
//! Inside, the modules import only downward in the `[compactor-engine]`
//! order of the repository's `scripts/layers.txt` (checked by
//! `scripts/check_layers.sh`): `compressor` (a folder of one file per step
//! of a pass, the `micro` strategy and the `instructions` pinning among
//! them); the trigger side `trigger`, `budget`, `config`; the steps
//! `prune`, `fallback`, `assemble`, `last_resort`, `user_messages`,
//! `sanitize`, `tail`, `truncated`, `salient`, `tool_summary`, `args`; the
//! leaves `summariser`, `summary_failure`, `serialize`, `tokens`, `view`,
//! `markers`, `redact`.

// What is `pub` here is the engine's surface: the types and functions
// re-exported below. Everything else is the crate's, and these lints keep
// it so, and documented.
#![warn(unreachable_pub, missing_docs)]

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

pub use budget::{SummariserBudgets, DEFAULT_CONTEXT_LENGTH};
pub use compressor::micro::{MicroOutcome, MicroState, MicroTelemetry};
pub use compressor::{
    AbortReason, AuxModelFailure, Carry, CompressOptions, CompressResult, CompressTelemetry,
    Compressor, NoOpReason, Outcome,
};
pub use config::{CompactionConfig, InvalidSetting, Strategy};
pub use last_resort::{fit_budget, Fit, FitInputs};
pub use markers::{
    declare_summary, is_declared_summary, undeclare_summary, END_MARKER, INFLIGHT_HEADER,
    NO_USER_SENTINEL, SUMMARY_PREFIX,
};
pub use summariser::{InContextAsk, Summariser, SummaryError, SummaryReply, SummaryRequest};
pub use summary_failure::{SummaryErrorKind, SummaryFailureKind};
pub use tokens::{
    estimate_messages_tokens_rough, estimate_msg_budget_tokens, estimate_request_tokens_rough,
    estimate_text_tokens, estimate_tools_tokens,
};
pub use trigger::{Trigger, TriggerSnapshot, TriggerStatus, Usage, WindowSource};
pub use truncated::CUT_MARKER;
pub use view::is_summary;
