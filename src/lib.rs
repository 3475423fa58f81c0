//! compactor: a transparent OpenAI-compatible reverse proxy that compacts
//! long conversations in flight.
//!
//! Layers, highest first, each using only the ones after it (the order of
//! `scripts/layers.txt`):
//!
//! - [`server`]: shared state, accept loop, routing, health, metrics and the
//!   admin session view; [`cli`], the binary's arguments.
//! - [`chat`]: the walk of one chat completion (substitute, estimate,
//!   decide, compact, send, retry, tap usage).
//! - [`usage`]: reading and hiding usage in response bodies.
//! - [`upstream`]: HTTP plumbing: the one [`upstream::Upstream`], body
//!   wrappers, header policy, error replies.
//! - [`telemetry`] and [`config`].
//! - Support: [`session`] (keys, the session store, calibration),
//!   [`store`] (what outlives a process), [`metrics`].
//! - Leaves: `window`, [`compaction`] (the engine, its own crate
//!   `compactor-engine` in `crates/`: deterministic, no I/O; async only at
//!   the `Summariser` trait, its one edge), [`codec`] (each API's request mapped onto the engine's
//!   conversation and back), [`request`], `skim` (a validating skim of a
//!   JSON object's members), `error`, `http1` (the HTTP/1 wire rules both
//!   directions share), [`sync`], `civil`.
//!
//! `ARCHITECTURE.md` has the walk of a request and the module map;
//! `scripts/layers.txt` writes the order down and `scripts/check_layers.sh`
//! keeps the imports to it (no cycle, no import up the order).

pub mod chat;
pub(crate) mod civil;
pub mod cli;
pub(crate) mod clock;
pub mod codec;
pub mod compaction;
pub mod config;
pub(crate) mod error;
pub(crate) mod http1;
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
pub(crate) mod window;
