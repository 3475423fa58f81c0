//! compactor: a transparent OpenAI-compatible reverse proxy that compacts
//! long conversations in flight.
//!
//! Layers, each using only the ones below it:
//!
//! - [`server`]: shared state, accept loop, routing, health, metrics and the
//!   admin session view.
//! - [`chat`]: the walk of one chat completion (substitute, estimate,
//!   decide, compact, send, retry, tap usage).
//! - [`upstream`]: HTTP plumbing: the one [`upstream::Upstream`], body
//!   wrappers, header policy, error replies.
//! - Support: [`usage`] (reading and hiding usage in response bodies),
//!   [`session`] (keys, the session store, calibration), [`config`],
//!   [`metrics`], [`telemetry`].
//! - Pure leaves: [`compaction`] (the engine, synchronous, no I/O),
//!   [`window`], [`store`], [`request`], [`codec`] (each API's request
//!   mapped onto the engine's conversation and back), [`error`], [`sync`],
//!   `skim` (a validating skim of a JSON object's members).
//!
//! `ARCHITECTURE.md` has the walk of a request and the module map;
//! `scripts/check_layers.sh` keeps the imports free of cycles.

pub mod chat;
pub mod civil;
pub mod cli;
pub mod codec;
pub mod compaction;
pub mod config;
pub mod error;
pub mod metrics;
pub mod request;
pub mod server;
pub mod session;
mod skim;
pub mod store;
pub mod sync;
pub mod telemetry;
pub mod upstream;
pub mod usage;
pub mod window;
