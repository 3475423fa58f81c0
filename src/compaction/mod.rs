//! The compaction engine: decides when and how a conversation's `messages`
//! array is compacted. Pure and synchronous except for the summariser trait.
//!
//! File ownership while the engine is being built (see each file's header):
//! - trigger side: `config`, `budget`, `trigger`
//! - pure leaf functions: `tokens`, `tool_summary`, `args`, `redact`, `markers`,
//!   `serialize`, `fallback`
//! - pipeline: `summariser`, `tail`, `prune`, `assemble`, `sanitize`,
//!   `compressor`, `micro`

pub mod args;
pub mod assemble;
pub mod budget;
pub mod compressor;
pub mod config;
pub mod fallback;
pub mod markers;
pub mod micro;
pub mod prune;
pub mod redact;
pub mod sanitize;
pub mod serialize;
pub mod summariser;
pub mod tail;
pub mod tokens;
pub mod tool_summary;
pub mod trigger;
pub mod view;
