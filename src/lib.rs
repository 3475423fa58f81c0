//! compactor: a transparent OpenAI-compatible reverse proxy that compacts
//! long conversations in flight.
//!
//! - [`compaction`]: the pure, synchronous compaction engine (no I/O).
//! - [`proxy`], [`config`], [`app`]: the transparent async proxy around it.
//! - [`chat`]: the chat-completions path (substitution, compaction, retry).
//! - [`session`], [`usage`], [`window`]: per-conversation state, the usage tap
//!   and context-window resolution.

pub mod app;
pub mod chat;
pub mod cli;
pub mod compaction;
pub mod config;
pub mod error;
pub mod metrics;
pub mod proxy;
pub mod request;
pub mod session;
pub mod sync;
pub mod telemetry;
pub mod usage;
pub mod window;
