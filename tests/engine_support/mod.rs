//! Shared helpers for the engine's integration tests: the scripted
//! summariser and compressor builders the engine's unit tests use too (one
//! file, `crates/compactor-engine/src/test_support.rs`), and what only
//! these suites need.
#![allow(dead_code)]

use compactor::compaction::{
    declare_summary, is_summary, CompactionConfig, Compressor, Strategy, Summariser, SummaryError,
    SummaryErrorKind, SummaryReply, SummaryRequest, Trigger, WindowSource,
};
use std::sync::Arc;

#[path = "../../crates/compactor-engine/src/test_support.rs"]
mod shared;
pub use shared::*;

/// The reads of a wire message these suites check the engine's output with
/// (the same rules as the engine's own, which are not its API).
pub mod view {
    use serde_json::Value;

    /// The message's role, or `""`.
    pub fn role(m: &Value) -> &str {
        m.get("role").and_then(Value::as_str).unwrap_or("")
    }

    /// True when the message has the given role.
    pub fn is_role(m: &Value, r: &str) -> bool {
        role(m) == r
    }

    /// The non-empty `tool_calls` array of an assistant row.
    pub fn tool_calls(m: &Value) -> Option<&Vec<Value>> {
        m.get("tool_calls")
            .and_then(Value::as_array)
            .filter(|a| !a.is_empty())
    }

    /// The id a tool result answers.
    pub fn result_id(m: &Value) -> Option<&str> {
        m.get("tool_call_id")
            .or_else(|| m.get("call_id"))
            .and_then(Value::as_str)
    }
}

/// A compressor over a known window and output reservation; `f` edits the
/// defaults.
pub fn compressor_reserving(
    model: &str,
    window: u64,
    max_tokens: u64,
    f: impl FnOnce(&mut CompactionConfig),
) -> Compressor {
    let mut cfg = CompactionConfig::default();
    f(&mut cfg);
    let cfg = Arc::new(cfg);
    let trigger = Trigger::new(
        cfg.clone(),
        model,
        WindowSource::Known(window),
        Some(max_tokens),
    );
    Compressor::new(cfg, trigger)
}

/// Sets the trigger's counters as a conversation restored from the store
/// carries them (`Trigger::restore`): the public way to start a compressor
/// that has compacted `compactions` times before, with `strikes`
/// ineffective compactions standing.
pub fn restored(c: &mut Compressor, compactions: u32, strikes: u32) {
    let mut snap = c.trigger().snapshot();
    snap.compression_count = compactions;
    snap.ineffective_compression_count = strikes;
    c.trigger_mut().restore(snap);
}
