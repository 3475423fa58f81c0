//! Context windows per (upstream, model): discovery from the upstream
//! ([`discover`](mod@discover)), overflow-error recognition ([`overflow`]) and the lazy
//! cache that combines them with the config table ([`cache`]).

pub(crate) mod cache;
pub mod discover;
pub(crate) mod overflow;

pub use cache::{Resolved, WindowCache, WindowConfig, WindowSource};
pub use discover::{discover, Discovered, DiscoverySource, GetError, UpstreamGet};
pub use overflow::{parse_overflow, parse_overflow_event, Overflow, OverflowKind};
