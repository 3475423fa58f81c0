//! Metrics of the chat path: compactions by outcome, tokens saved,
//! summariser latency, overflow retries, substitutions, real prompt tokens.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use crate::metrics::{Histogram, UPSTREAM_BUCKETS};

/// Metric names.
pub mod names {
    /// Compaction attempts by outcome.
    pub(crate) const COMPACTIONS_TOTAL: &str = "compactor_compactions_total";
    /// Rough tokens removed by committed compactions.
    pub(crate) const TOKENS_SAVED_TOTAL: &str = "compactor_tokens_saved_total";
    /// Summariser call latency (whole compaction attempt).
    pub(crate) const SUMMARISER_SECONDS: &str = "compactor_summariser_seconds";
    /// Overflow errors answered by compacting and retrying.
    pub(crate) const OVERFLOW_RETRIES_TOTAL: &str = "compactor_overflow_retries_total";
    /// Chat requests by action (`x-compactor-action`).
    pub(crate) const CHAT_ACTIONS_TOTAL: &str = "compactor_chat_requests_total";
    /// Real prompt tokens reported by the upstream.
    pub(crate) const UPSTREAM_PROMPT_TOKENS_TOTAL: &str = "compactor_upstream_prompt_tokens_total";
    /// Live sessions.
    pub(crate) const SESSIONS: &str = "compactor_sessions";
    /// Live compaction records.
    pub(crate) const RECORDS: &str = "compactor_compaction_records";
    /// Background pre-compactions by event (`started`, `used`, `discarded`).
    pub(crate) const PRECOMPACTIONS_TOTAL: &str = "compactor_precompactions_total";
    /// Time a compaction turn waited for its pre-compaction.
    pub(crate) const PRECOMPACTION_WAIT_SECONDS: &str = "compactor_precompaction_wait_seconds";
    /// Conversation requests the API's codec could not map (forwarded
    /// untouched), by API, reason, member and role.
    pub(crate) const UNMAPPED_TOTAL: &str = "compactor_unmapped_requests_total";
    /// Conversation bodies parsed and decoded, by where the work ran.
    pub(crate) const DECODES_TOTAL: &str = "compactor_request_decodes_total";
    /// Replies whose prompt the upstream cut silently, by API.
    pub(crate) const TRUNCATIONS_TOTAL: &str = "compactor_truncations_total";
}

/// Where a request body was parsed and decoded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum DecodePool {
    /// In the request's own task, on an async worker (small bodies).
    Inline,
    /// On the blocking pool (large bodies): the async workers stay free.
    Blocking,
}

impl DecodePool {
    fn label(self) -> &'static str {
        match self {
            DecodePool::Inline => "inline",
            DecodePool::Blocking => "blocking",
        }
    }
}

/// Labels of one unmapped request: API, reason, member, role.
type UnmappedKey = (&'static str, &'static str, &'static str, &'static str);

/// Chat-path metrics registry.
#[derive(Debug)]
pub(crate) struct ChatMetrics {
    compactions: Mutex<BTreeMap<&'static str, u64>>,
    actions: Mutex<BTreeMap<&'static str, u64>>,
    tokens_saved: AtomicU64,
    overflow_retries: AtomicU64,
    prompt_tokens: AtomicU64,
    /// Decodes inline and on the blocking pool.
    decodes: [AtomicU64; 2],
    /// Duration of compaction attempts that called the summariser.
    pub(crate) summariser: Histogram,
    precompactions: Mutex<BTreeMap<&'static str, u64>>,
    /// Time compaction turns waited for a pre-compaction.
    pub(crate) precompaction_wait: Histogram,
    unmapped: Mutex<BTreeMap<UnmappedKey, u64>>,
    truncations: Mutex<BTreeMap<&'static str, u64>>,
}

impl Default for ChatMetrics {
    fn default() -> Self {
        Self {
            compactions: Mutex::default(),
            actions: Mutex::default(),
            tokens_saved: AtomicU64::new(0),
            overflow_retries: AtomicU64::new(0),
            prompt_tokens: AtomicU64::new(0),
            decodes: Default::default(),
            summariser: Histogram::new(UPSTREAM_BUCKETS),
            precompactions: Mutex::default(),
            precompaction_wait: Histogram::new(UPSTREAM_BUCKETS),
            unmapped: Mutex::default(),
            truncations: Mutex::default(),
        }
    }
}

fn bump(map: &Mutex<BTreeMap<&'static str, u64>>, key: &'static str) {
    *crate::sync::lock(map).entry(key).or_default() += 1;
}

fn read(map: &Mutex<BTreeMap<&'static str, u64>>) -> BTreeMap<&'static str, u64> {
    crate::sync::lock(map).clone()
}

impl ChatMetrics {
    /// A background pre-compaction event (`started`, `used`, `discarded`).
    pub(crate) fn precompaction(&self, event: &'static str) {
        bump(&self.precompactions, event);
    }

    /// One compaction attempt with its outcome label and, when committed,
    /// the tokens it saved and how long it took.
    pub(crate) fn compaction(&self, outcome: &'static str, saved: u64, took: Option<Duration>) {
        bump(&self.compactions, outcome);
        self.tokens_saved.fetch_add(saved, Ordering::Relaxed);
        if let Some(d) = took {
            self.summariser.observe(d);
        }
    }

    /// One chat request by the action taken.
    pub(crate) fn action(&self, action: &'static str) {
        bump(&self.actions, action);
    }

    /// One conversation request forwarded untouched because its codec
    /// could not map it.
    pub(crate) fn unmapped(&self, key: UnmappedKey) {
        *crate::sync::lock(&self.unmapped).entry(key).or_default() += 1;
    }

    /// One reply whose prompt the upstream truncated silently, by API.
    pub(crate) fn truncation(&self, api: &'static str) {
        bump(&self.truncations, api);
    }

    /// One overflow retry.
    pub(crate) fn overflow_retry(&self) {
        self.overflow_retries.fetch_add(1, Ordering::Relaxed);
    }

    /// One request body parsed and decoded, in `pool`.
    pub(crate) fn decoded(&self, pool: DecodePool) {
        self.decodes[pool as usize].fetch_add(1, Ordering::Relaxed);
    }

    /// Bodies decoded in `pool` so far.
    pub(crate) fn decodes(&self, pool: DecodePool) -> u64 {
        self.decodes[pool as usize].load(Ordering::Relaxed)
    }

    /// Real prompt tokens reported by the upstream.
    pub(crate) fn prompt_tokens(&self, n: u64) {
        self.prompt_tokens.fetch_add(n, Ordering::Relaxed);
    }

    fn render_unmapped(&self, out: &mut String) {
        let unmapped = crate::sync::lock(&self.unmapped).clone();
        let name = names::UNMAPPED_TOTAL;
        let _ = writeln!(
            out,
            "# HELP {name} Conversation requests forwarded untouched: their codec could not map them."
        );
        let _ = writeln!(out, "# TYPE {name} counter");
        for ((api, reason, member, role), v) in unmapped {
            let _ = writeln!(
                out,
                "{name}{{api=\"{api}\",reason=\"{reason}\",member=\"{member}\",role=\"{role}\"}} {v}"
            );
        }
    }

    fn render_decodes(&self, out: &mut String) {
        let name = names::DECODES_TOTAL;
        let _ = writeln!(
            out,
            "# HELP {name} Conversation request bodies parsed and decoded, by where.\n# TYPE {name} counter"
        );
        for pool in [DecodePool::Inline, DecodePool::Blocking] {
            let _ = writeln!(
                out,
                "{name}{{pool=\"{}\"}} {}",
                pool.label(),
                self.decodes(pool)
            );
        }
    }

    /// Prometheus text, with the live gauges passed in.
    pub(crate) fn render(&self, sessions: usize, records: usize) -> String {
        let mut out = String::new();
        let _ = writeln!(
            out,
            "# HELP {} Compaction attempts by outcome.",
            names::COMPACTIONS_TOTAL
        );
        let _ = writeln!(out, "# TYPE {} counter", names::COMPACTIONS_TOTAL);
        for (k, v) in read(&self.compactions) {
            let _ = writeln!(out, "{}{{outcome=\"{k}\"}} {v}", names::COMPACTIONS_TOTAL);
        }
        let _ = writeln!(
            out,
            "# HELP {} Chat requests by action.",
            names::CHAT_ACTIONS_TOTAL
        );
        let _ = writeln!(out, "# TYPE {} counter", names::CHAT_ACTIONS_TOTAL);
        for (k, v) in read(&self.actions) {
            let _ = writeln!(out, "{}{{action=\"{k}\"}} {v}", names::CHAT_ACTIONS_TOTAL);
        }
        // Every family's HELP/TYPE is written, samples or not, so a
        // dashboard or alert can tell an unknown name from a quiet one.
        let name = names::PRECOMPACTIONS_TOTAL;
        let _ = writeln!(out, "# HELP {name} Background pre-compactions by event.");
        let _ = writeln!(out, "# TYPE {name} counter");
        for (k, v) in read(&self.precompactions) {
            let _ = writeln!(out, "{name}{{event=\"{k}\"}} {v}");
        }
        self.render_unmapped(&mut out);
        let name = names::TRUNCATIONS_TOTAL;
        let _ = writeln!(
            out,
            "# HELP {name} Replies whose prompt the upstream truncated silently, by API."
        );
        let _ = writeln!(out, "# TYPE {name} counter");
        for (k, v) in read(&self.truncations) {
            let _ = writeln!(out, "{name}{{api=\"{k}\"}} {v}");
        }
        for (name, help, v) in [
            (
                names::TOKENS_SAVED_TOTAL,
                "Rough tokens removed by compactions.",
                &self.tokens_saved,
            ),
            (
                names::OVERFLOW_RETRIES_TOTAL,
                "Overflow errors answered by compacting and retrying.",
                &self.overflow_retries,
            ),
            (
                names::UPSTREAM_PROMPT_TOKENS_TOTAL,
                "Prompt tokens the upstream reported.",
                &self.prompt_tokens,
            ),
        ] {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} counter\n{name} {}",
                v.load(Ordering::Relaxed)
            );
        }
        self.render_decodes(&mut out);
        for (name, help, v) in [
            (names::SESSIONS, "Live sessions.", sessions),
            (names::RECORDS, "Live compaction records.", records),
        ] {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} gauge\n{name} {v}");
        }
        self.summariser.render_to(
            &mut out,
            names::SUMMARISER_SECONDS,
            "Duration of compaction attempts that called the summariser.",
        );
        self.precompaction_wait.render_to(
            &mut out,
            names::PRECOMPACTION_WAIT_SECONDS,
            "Time compaction turns waited for a background pre-compaction.",
        );
        out
    }
}
