//! Context windows per (upstream, model): discovery from the upstream
//! ([`discover`](mod@discover)), overflow-error recognition ([`overflow`]) and the lazy
//! cache that combines them with the config table ([`cache`]).

pub(crate) mod cache;
pub(crate) mod discover;
pub(crate) mod overflow;
