//! The store's series: content-free counters of its calls, labelled by
//! backend. The store bumps them; the registry renders them with the rest
//! (see [`crate::metrics::Metrics::register_store`]).

use std::fmt::Write as _;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::OnceLock;

/// Metric names.
pub mod names {
    /// Records found in the store after a memory miss.
    pub(crate) const READ_HITS_TOTAL: &str = "compactor_store_read_hits_total";
    /// Store lookups that found nothing.
    pub(crate) const READ_MISSES_TOTAL: &str = "compactor_store_read_misses_total";
    /// Records written through.
    pub(crate) const WRITES_TOTAL: &str = "compactor_store_writes_total";
    /// Calls that failed or timed out.
    pub(crate) const DEGRADED_TOTAL: &str = "compactor_store_degraded_total";
    /// Compactions not run because another replica's record was found.
    pub(crate) const PEER_RECORDS_TOTAL: &str = "compactor_store_peer_records_total";
    /// Damaged store files moved aside at open.
    pub(crate) const RECOVERIES_TOTAL: &str = "compactor_store_recoveries_total";
    /// Whether the configured store opened.
    pub(crate) const UP: &str = "compactor_store_up";
}

/// Content-free counters of the store's calls.
#[derive(Debug, Default)]
pub struct StoreMetrics {
    /// Records found in the store after a memory miss.
    pub(crate) read_hits: AtomicU64,
    /// Store lookups that found nothing.
    pub(crate) read_misses: AtomicU64,
    /// Records written through.
    pub(crate) writes: AtomicU64,
    /// Calls that failed or timed out (the request went on from memory).
    pub(crate) degraded: AtomicU64,
    /// Compactions not run because another replica's record was found.
    pub(crate) peer_records: AtomicU64,
    /// Damaged store files moved aside at open (a fresh one was started).
    pub(crate) recoveries: AtomicU64,
    /// The configured store opened: 0 while a store that could not be
    /// opened is served by memory (visible beyond the one WARN at start).
    pub(crate) up: AtomicBool,
    /// The backend the configuration asked for (the series' `backend` is
    /// the one serving).
    pub(crate) configured: OnceLock<&'static str>,
}

impl StoreMetrics {
    /// Adds one to a counter of this set.
    pub(crate) fn bump(c: &AtomicU64) {
        c.fetch_add(1, Ordering::Relaxed);
    }

    /// Counts a compaction served by another replica's record.
    pub(crate) fn peer_record(&self) {
        Self::bump(&self.peer_records);
    }

    /// Prometheus text of the counters, labelled by backend.
    // Only tests read it: the registry renders the counters.
    #[cfg(test)]
    pub(crate) fn render(&self, backend: &str) -> String {
        let mut out = String::new();
        self.render_to(&mut out, backend);
        out
    }

    /// Appends the counters in Prometheus text format.
    pub(crate) fn render_to(&self, out: &mut String, backend: &str) {
        for (name, help, c) in [
            (
                names::READ_HITS_TOTAL,
                "Records read through from the store.",
                &self.read_hits,
            ),
            (
                names::READ_MISSES_TOTAL,
                "Store lookups that found nothing.",
                &self.read_misses,
            ),
            (
                names::WRITES_TOTAL,
                "Records written through to the store.",
                &self.writes,
            ),
            (
                names::DEGRADED_TOTAL,
                "Store calls that failed or timed out (served from memory).",
                &self.degraded,
            ),
            (
                names::PEER_RECORDS_TOTAL,
                "Compactions not run here because another replica's record was found.",
                &self.peer_records,
            ),
            (
                names::RECOVERIES_TOTAL,
                "Damaged store files moved aside at open (a fresh store was started).",
                &self.recoveries,
            ),
        ] {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} counter\n{name}{{backend=\"{backend}\"}} {}",
                c.load(Ordering::Relaxed)
            );
        }
        let name = names::UP;
        let configured = self.configured.get().copied().unwrap_or(backend);
        let _ = writeln!(
            out,
            "# HELP {name} Whether the configured store opened (0: it could not, records are \
             kept in memory only).\n# TYPE {name} gauge\n\
             {name}{{backend=\"{backend}\",configured=\"{configured}\"}} {}",
            u8::from(self.up.load(Ordering::Relaxed))
        );
    }
}
