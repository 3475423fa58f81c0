//! The one Prometheus text registry, with fixed metric names: the transport
//! series here, the chat path's in [`chat`].
//!
//! Counters are atomics; labelled counters keep their (few, bounded) label
//! sets in a short-lived mutex-protected map. Everything is recorded once per
//! request (at the logging phase), never per body chunk.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

pub mod chat;
pub mod store;

pub(crate) use chat::ChatMetrics;
pub(crate) use store::StoreMetrics;

/// Metric names (one place, so dashboards and tests agree).
pub mod names {
    /// Requests by route and status.
    pub(crate) const REQUESTS_TOTAL: &str = "compactor_requests_total";
    /// Request body bytes received from clients.
    pub(crate) const REQUEST_BYTES_TOTAL: &str = "compactor_request_bytes_total";
    /// Response body bytes sent to clients.
    pub(crate) const RESPONSE_BYTES_TOTAL: &str = "compactor_response_bytes_total";
    /// Errors compactor produced, by code.
    pub(crate) const PROXY_ERRORS_TOTAL: &str = "compactor_proxy_errors_total";
    /// Streams ended because the upstream went idle.
    pub(crate) const IDLE_TIMEOUTS_TOTAL: &str = "compactor_stream_idle_timeouts_total";
    /// Time until the upstream's response head.
    pub(crate) const UPSTREAM_WAIT_SECONDS: &str = "compactor_upstream_wait_seconds";
    /// Time compactor added to the response head (total − upstream wait).
    pub(crate) const PROXY_OVERHEAD_SECONDS: &str = "compactor_proxy_overhead_seconds";
    /// Requests currently in flight.
    pub(crate) const IN_FLIGHT: &str = "compactor_requests_in_flight";
    /// Client connections currently open.
    pub(crate) const CONNECTIONS_OPEN: &str = "compactor_connections_open";
    /// The connection cap in force: `limits.max_connections` clamped to
    /// what the open-file limit allows.
    pub(crate) const MAX_CONNECTIONS: &str = "compactor_max_connections";
    /// Client connections refused at `limits.max_connections`.
    pub(crate) const CONNECTIONS_REJECTED_TOTAL: &str = "compactor_connections_rejected_total";
    /// Client connections closed after `timeouts.client_idle_secs`.
    pub(crate) const IDLE_CONNECTION_CLOSES_TOTAL: &str = "compactor_idle_connection_closes_total";
    /// Request bodies cut by `timeouts.body_read_secs`.
    pub(crate) const BODY_READ_TIMEOUTS_TOTAL: &str = "compactor_body_read_timeouts_total";
    /// Chat request body bytes buffered right now.
    pub(crate) const BUFFERED_BODY_BYTES: &str = "compactor_buffered_body_bytes";
    /// Requests refused at `limits.max_buffered_body_bytes`.
    pub(crate) const BODY_BUDGET_REJECTIONS_TOTAL: &str = "compactor_body_budget_rejections_total";
    /// Requests sent again after the upstream closed a pooled connection
    /// before answering.
    pub(crate) const UPSTREAM_RETRIES_TOTAL: &str = "compactor_upstream_unsent_retries_total";
    /// Chat request bodies of 1 MiB or more dropped before they were read
    /// whole (each asks the allocator to give the memory back).
    pub(crate) const ABANDONED_BODIES_TOTAL: &str = "compactor_abandoned_large_bodies_total";
    /// Client connections compactor's HTTP/1.1 server handed to hyper's,
    /// by the reason (`Handoff`).
    pub(crate) const H1_HANDOFFS_TOTAL: &str = "compactor_h1_handoffs_total";
}

/// Why compactor's HTTP/1.1 server (`server::h1`) handed a connection to
/// hyper's, for the rest of it: each is a label of
/// `compactor_h1_handoffs_total`. A rise in one says which requests pay
/// hyper's cost (or which clients send odd messages).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Handoff {
    /// An HTTP/1.0 request (or another version).
    Http10,
    /// A `Transfer-Encoding` (a chunked upload).
    TransferEncoding,
    /// An `Expect` (`100-continue`).
    Expect,
    /// An `Upgrade`.
    Upgrade,
    /// A `CONNECT`.
    Connect,
    /// `Connection: close`.
    ConnectionClose,
    /// HTTP/2 prior knowledge (the client preface).
    H2,
    /// A head httparse, `http` or the length rule refuses.
    Malformed,
    /// Over 64 header fields, or a message over 256 KiB.
    Oversized,
    /// The rest of a message did not come within 200 ms.
    Slow,
}

impl Handoff {
    /// Every reason, in the order they are rendered.
    pub(crate) const ALL: [Handoff; 10] = [
        Handoff::Http10,
        Handoff::TransferEncoding,
        Handoff::Expect,
        Handoff::Upgrade,
        Handoff::Connect,
        Handoff::ConnectionClose,
        Handoff::H2,
        Handoff::Malformed,
        Handoff::Oversized,
        Handoff::Slow,
    ];

    /// The metric label.
    pub(crate) fn label(self) -> &'static str {
        match self {
            Handoff::Http10 => "http10",
            Handoff::TransferEncoding => "transfer_encoding",
            Handoff::Expect => "expect",
            Handoff::Upgrade => "upgrade",
            Handoff::Connect => "connect",
            Handoff::ConnectionClose => "connection_close",
            Handoff::H2 => "h2",
            Handoff::Malformed => "malformed",
            Handoff::Oversized => "oversized",
            Handoff::Slow => "slow",
        }
    }
}

/// Fixed-bucket histogram (seconds).
#[derive(Debug)]
pub(crate) struct Histogram {
    bounds: &'static [f64],
    buckets: Vec<AtomicU64>,
    count: AtomicU64,
    sum_nanos: AtomicU64,
}

/// Buckets for sub-millisecond overhead up to a few ms.
pub(crate) const OVERHEAD_BUCKETS: &[f64] = &[
    0.000_01, 0.000_025, 0.000_05, 0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.05,
    0.1,
];
/// Buckets for upstream latency, ms to minutes (local models are slow).
pub(crate) const UPSTREAM_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0,
];

impl Histogram {
    /// A histogram with the given upper bounds (ascending).
    pub(crate) fn new(bounds: &'static [f64]) -> Self {
        Histogram {
            bounds,
            buckets: bounds.iter().map(|_| AtomicU64::new(0)).collect(),
            count: AtomicU64::new(0),
            sum_nanos: AtomicU64::new(0),
        }
    }

    /// Records one observation.
    pub(crate) fn observe(&self, d: Duration) {
        let secs = d.as_secs_f64();
        if let Some(i) = self.bounds.iter().position(|b| secs <= *b) {
            if let Some(b) = self.buckets.get(i) {
                b.fetch_add(1, Ordering::Relaxed);
            }
        }
        self.count.fetch_add(1, Ordering::Relaxed);
        let nanos = u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
        self.sum_nanos.fetch_add(nanos, Ordering::Relaxed);
    }

    /// Number of observations.
    pub(crate) fn count(&self) -> u64 {
        self.count.load(Ordering::Relaxed)
    }

    /// Appends this histogram in Prometheus text format.
    pub(crate) fn render_to(&self, out: &mut String, name: &str, help: &str) {
        let _ = writeln!(out, "# HELP {name} {help}");
        let _ = writeln!(out, "# TYPE {name} histogram");
        let mut cumulative = 0u64;
        for (b, c) in self.bounds.iter().zip(&self.buckets) {
            cumulative += c.load(Ordering::Relaxed);
            let _ = writeln!(out, "{name}_bucket{{le=\"{b}\"}} {cumulative}");
        }
        let count = self.count();
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {count}");
        let sum = self.sum_nanos.load(Ordering::Relaxed) as f64 / 1e9;
        let _ = writeln!(out, "{name}_sum {sum}");
        let _ = writeln!(out, "{name}_count {count}");
    }
}

/// The process-wide metrics registry.
#[derive(Debug)]
pub struct Metrics {
    requests: Mutex<BTreeMap<(&'static str, u16), u64>>,
    errors: Mutex<BTreeMap<&'static str, u64>>,
    request_bytes: AtomicU64,
    response_bytes: AtomicU64,
    idle_timeouts: AtomicU64,
    in_flight: AtomicU64,
    connections_open: AtomicU64,
    connections_rejected: AtomicU64,
    max_connections: AtomicU64,
    idle_connection_closes: AtomicU64,
    body_read_timeouts: AtomicU64,
    /// Chat request body bytes buffered right now (the byte budget's
    /// running total: reserved as chunks arrive, released per request).
    pub(crate) buffered_body_bytes: AtomicU64,
    body_budget_rejections: AtomicU64,
    upstream_retries: AtomicU64,
    abandoned_bodies: AtomicU64,
    /// By [`Handoff`], in the order of [`Handoff::ALL`].
    h1_handoffs: [AtomicU64; Handoff::ALL.len()],
    /// Time until the upstream's response head.
    pub(crate) upstream_wait: Histogram,
    /// Time compactor added before the response head.
    pub(crate) proxy_overhead: Histogram,
    /// The chat path's series.
    pub(crate) chat: ChatMetrics,
    /// The store's counters and its backend's name, once it is open.
    store: Mutex<Option<(Arc<StoreMetrics>, &'static str)>>,
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics {
            requests: Mutex::new(BTreeMap::new()),
            errors: Mutex::new(BTreeMap::new()),
            request_bytes: AtomicU64::new(0),
            response_bytes: AtomicU64::new(0),
            idle_timeouts: AtomicU64::new(0),
            in_flight: AtomicU64::new(0),
            connections_open: AtomicU64::new(0),
            connections_rejected: AtomicU64::new(0),
            max_connections: AtomicU64::new(0),
            idle_connection_closes: AtomicU64::new(0),
            body_read_timeouts: AtomicU64::new(0),
            buffered_body_bytes: AtomicU64::new(0),
            body_budget_rejections: AtomicU64::new(0),
            upstream_retries: AtomicU64::new(0),
            abandoned_bodies: AtomicU64::new(0),
            h1_handoffs: [const { AtomicU64::new(0) }; Handoff::ALL.len()],
            upstream_wait: Histogram::new(UPSTREAM_BUCKETS),
            proxy_overhead: Histogram::new(OVERHEAD_BUCKETS),
            chat: ChatMetrics::default(),
            store: Mutex::new(None),
        }
    }
}

impl Metrics {
    /// Counts one finished request. `route` must be a fixed label.
    pub(crate) fn record_request(
        &self,
        route: &'static str,
        status: u16,
        bytes_in: u64,
        bytes_out: u64,
    ) {
        if let Ok(mut m) = self.requests.lock() {
            *m.entry((route, status)).or_insert(0) += 1;
        }
        self.request_bytes.fetch_add(bytes_in, Ordering::Relaxed);
        self.response_bytes.fetch_add(bytes_out, Ordering::Relaxed);
    }

    /// Counts an error compactor produced.
    pub(crate) fn record_error(&self, code: &'static str) {
        if let Ok(mut m) = self.errors.lock() {
            *m.entry(code).or_insert(0) += 1;
        }
    }

    /// Counts a connection handed to hyper's server, by why.
    pub(crate) fn record_h1_handoff(&self, why: Handoff) {
        self.h1_handoffs[why as usize].fetch_add(1, Ordering::Relaxed);
    }

    /// Counts a stream ended by the idle timeout.
    pub(crate) fn record_idle_timeout(&self) {
        self.idle_timeouts.fetch_add(1, Ordering::Relaxed);
    }

    /// A client connection was accepted and is served; returns how many
    /// are open now (pair with [`Metrics::connection_closed`]).
    pub(crate) fn connection_opened(&self) -> u64 {
        self.connections_open.fetch_add(1, Ordering::Relaxed) + 1
    }

    /// A served client connection closed.
    pub(crate) fn connection_closed(&self) {
        let _ = self
            .connections_open
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |v| v.checked_sub(1));
    }

    /// Client connections open now.
    /// Sets the connection cap in force (once, at start).
    pub(crate) fn set_max_connections(&self, cap: u64) {
        self.max_connections.store(cap, Ordering::Relaxed);
    }

    pub fn connections_open(&self) -> u64 {
        self.connections_open.load(Ordering::Relaxed)
    }

    /// Counts a connection refused at the cap.
    pub(crate) fn record_connection_rejected(&self) {
        self.connections_rejected.fetch_add(1, Ordering::Relaxed);
    }

    /// Counts a client connection closed for idleness.
    pub(crate) fn record_idle_connection_close(&self) {
        self.idle_connection_closes.fetch_add(1, Ordering::Relaxed);
    }

    /// Counts a request body cut by the body read timeout.
    pub(crate) fn record_body_read_timeout(&self) {
        self.body_read_timeouts.fetch_add(1, Ordering::Relaxed);
    }

    /// Counts a request refused at the buffered-body budget.
    pub(crate) fn record_body_budget_rejection(&self) {
        self.body_budget_rejections.fetch_add(1, Ordering::Relaxed);
    }

    /// Counts a large chat request body dropped before its end.
    pub(crate) fn record_abandoned_body(&self) {
        self.abandoned_bodies.fetch_add(1, Ordering::Relaxed);
    }

    /// Counts a request replayed after a keep-alive race.
    pub(crate) fn record_upstream_retry(&self) {
        self.upstream_retries.fetch_add(1, Ordering::Relaxed);
    }

    /// A request started (pair with [`Metrics::request_finished`]).
    pub(crate) fn request_started(&self) {
        self.in_flight.fetch_add(1, Ordering::Relaxed);
    }

    /// A request finished.
    pub(crate) fn request_finished(&self) {
        let _ = self
            .in_flight
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |v| v.checked_sub(1));
    }

    /// Requests counted for a route and status (tests, admin).
    // Only tests read it: the registry renders the counters.
    #[cfg(test)]
    pub(crate) fn requests(&self, route: &str, status: u16) -> u64 {
        self.requests
            .lock()
            .map(|m| {
                m.iter()
                    .filter(|((r, s), _)| *r == route && *s == status)
                    .map(|(_, v)| *v)
                    .sum()
            })
            .unwrap_or(0)
    }

    /// Renders every series in the Prometheus text exposition format;
    /// `sessions` and `records` are the live gauges of the chat state.
    pub fn render(&self, sessions: usize, records: usize) -> String {
        let mut text = self.render_proxy();
        text.push_str(&self.chat.render(sessions, records));
        let store = crate::sync::lock(&self.store).clone();
        if let Some((store, backend)) = store {
            store.render_to(&mut text, backend);
        }
        text
    }

    /// Makes the open store's counters part of every render (the last
    /// store registered wins: there is one per process).
    pub(crate) fn register_store(&self, store: Arc<StoreMetrics>, backend: &'static str) {
        *crate::sync::lock(&self.store) = Some((store, backend));
    }

    /// The transport series (requests, errors, bytes, latencies).
    fn render_proxy(&self) -> String {
        let mut out = String::with_capacity(2048);
        let _ = writeln!(
            out,
            "# HELP {} Requests by route and status.",
            names::REQUESTS_TOTAL
        );
        let _ = writeln!(out, "# TYPE {} counter", names::REQUESTS_TOTAL);
        if let Ok(m) = self.requests.lock() {
            for ((route, status), v) in m.iter() {
                let _ = writeln!(
                    out,
                    "{}{{route=\"{route}\",status=\"{status}\"}} {v}",
                    names::REQUESTS_TOTAL
                );
            }
        }
        let _ = writeln!(
            out,
            "# HELP {} Errors produced by compactor.",
            names::PROXY_ERRORS_TOTAL
        );
        let _ = writeln!(out, "# TYPE {} counter", names::PROXY_ERRORS_TOTAL);
        if let Ok(m) = self.errors.lock() {
            for (code, v) in m.iter() {
                let _ = writeln!(out, "{}{{code=\"{code}\"}} {v}", names::PROXY_ERRORS_TOTAL);
            }
        }
        let _ = writeln!(
            out,
            "# HELP {} Client connections handed to hyper's HTTP server, by reason.",
            names::H1_HANDOFFS_TOTAL
        );
        let _ = writeln!(out, "# TYPE {} counter", names::H1_HANDOFFS_TOTAL);
        for why in Handoff::ALL {
            let _ = writeln!(
                out,
                "{}{{reason=\"{}\"}} {}",
                names::H1_HANDOFFS_TOTAL,
                why.label(),
                self.h1_handoffs[why as usize].load(Ordering::Relaxed)
            );
        }
        for (name, help, kind, v) in self.plain_series() {
            let _ = writeln!(out, "# HELP {name} {help}");
            let _ = writeln!(out, "# TYPE {name} {kind}");
            let _ = writeln!(out, "{name} {}", v.load(Ordering::Relaxed));
        }
        self.upstream_wait.render_to(
            &mut out,
            names::UPSTREAM_WAIT_SECONDS,
            "Time until the upstream response head.",
        );
        self.proxy_overhead.render_to(
            &mut out,
            names::PROXY_OVERHEAD_SECONDS,
            "Time compactor added before the response head (total minus upstream wait).",
        );
        out
    }

    /// The single-value series: (name, help, type, value).
    fn plain_series(&self) -> [(&'static str, &'static str, &'static str, &AtomicU64); 13] {
        [
        (
            names::REQUEST_BYTES_TOTAL,
            "Request body bytes received.",
            "counter",
            &self.request_bytes,
        ),
        (
            names::RESPONSE_BYTES_TOTAL,
            "Response body bytes sent.",
            "counter",
            &self.response_bytes,
        ),
        (
            names::IDLE_TIMEOUTS_TOTAL,
            "Streams ended by the idle timeout.",
            "counter",
            &self.idle_timeouts,
        ),
        (
            names::IN_FLIGHT,
            "Requests in flight.",
            "gauge",
            &self.in_flight,
        ),
        (
            names::CONNECTIONS_OPEN,
            "Client connections open.",
            "gauge",
            &self.connections_open,
        ),
        (
            names::MAX_CONNECTIONS,
            "The connection cap in force (limits.max_connections clamped to the open-file limit).",
            "gauge",
            &self.max_connections,
        ),
        (
            names::CONNECTIONS_REJECTED_TOTAL,
            "Client connections refused at limits.max_connections.",
            "counter",
            &self.connections_rejected,
        ),
        (
            names::IDLE_CONNECTION_CLOSES_TOTAL,
            "Client connections closed after timeouts.client_idle_secs.",
            "counter",
            &self.idle_connection_closes,
        ),
        (
            names::BODY_READ_TIMEOUTS_TOTAL,
            "Request bodies cut by timeouts.body_read_secs.",
            "counter",
            &self.body_read_timeouts,
        ),
        (
            names::BUFFERED_BODY_BYTES,
            "Chat request body bytes buffered now.",
            "gauge",
            &self.buffered_body_bytes,
        ),
        (
            names::BODY_BUDGET_REJECTIONS_TOTAL,
            "Requests refused at limits.max_buffered_body_bytes.",
            "counter",
            &self.body_budget_rejections,
        ),
        (
            names::UPSTREAM_RETRIES_TOTAL,
            "Requests sent again after the upstream closed a pooled connection before answering.",
            "counter",
            &self.upstream_retries,
        ),
        (
            names::ABANDONED_BODIES_TOTAL,
            "Chat request bodies of 1 MiB or more dropped before they were read whole.",
            "counter",
            &self.abandoned_bodies,
        ),
    ]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn handoffs_are_counted_by_reason() {
        let m = Metrics::default();
        m.record_h1_handoff(Handoff::TransferEncoding);
        m.record_h1_handoff(Handoff::TransferEncoding);
        m.record_h1_handoff(Handoff::Slow);
        let text = m.render(0, 0);
        assert!(text.contains("# TYPE compactor_h1_handoffs_total counter"));
        assert!(text.contains("compactor_h1_handoffs_total{reason=\"transfer_encoding\"} 2"));
        assert!(text.contains("compactor_h1_handoffs_total{reason=\"slow\"} 1"));
        assert!(text.contains("compactor_h1_handoffs_total{reason=\"h2\"} 0"));
        for (i, why) in Handoff::ALL.into_iter().enumerate() {
            assert_eq!(why as usize, i, "{why:?}: ALL is in declaration order");
        }
    }

    #[test]
    fn render_counts_and_histograms() {
        let m = Metrics::default();
        m.record_request("passthrough", 200, 10, 20);
        m.record_request("passthrough", 200, 1, 2);
        m.record_request("chat", 502, 0, 5);
        m.record_error("upstream_unreachable");
        m.proxy_overhead.observe(Duration::from_micros(200));
        m.proxy_overhead.observe(Duration::from_secs(1));
        let text = m.render_proxy();
        assert!(text.contains("compactor_requests_total{route=\"passthrough\",status=\"200\"} 2"));
        assert!(text.contains("compactor_requests_total{route=\"chat\",status=\"502\"} 1"));
        assert!(text.contains("compactor_request_bytes_total 11"));
        assert!(text.contains("compactor_response_bytes_total 27"));
        assert!(text.contains("compactor_proxy_errors_total{code=\"upstream_unreachable\"} 1"));
        assert!(text.contains("compactor_proxy_overhead_seconds_bucket{le=\"0.00025\"} 1"));
        assert!(text.contains("compactor_proxy_overhead_seconds_bucket{le=\"+Inf\"} 2"));
        assert!(text.contains("compactor_proxy_overhead_seconds_count 2"));
        assert_eq!(m.requests("passthrough", 200), 2);
    }

    #[test]
    fn the_open_stores_counters_are_part_of_the_render() {
        let m = Metrics::default();
        assert!(!m.render(0, 0).contains("compactor_store_writes_total"));
        let store = Arc::new(StoreMetrics::default());
        m.register_store(Arc::clone(&store), "file");
        StoreMetrics::bump(&store.writes);
        let text = m.render(0, 0);
        assert!(
            text.contains("# TYPE compactor_store_writes_total counter"),
            "{text}"
        );
        assert!(
            text.contains("compactor_store_writes_total{backend=\"file\"} 1"),
            "{text}"
        );
    }

    #[test]
    fn in_flight_never_underflows() {
        let m = Metrics::default();
        m.request_finished();
        m.request_started();
        assert!(m.render_proxy().contains("compactor_requests_in_flight 1"));
    }
}
