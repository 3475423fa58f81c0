//! Per-conversation trigger and calibration state: when to compact, the
//! failure cooldowns, and the fields that survive a restart.
//!
//! One [`Trigger`] lives in each conversation's state.
//! It answers "should this conversation be compacted now?" from the real
//! `prompt_tokens` the upstream reported, judges whether the last compaction
//! worked once the next real usage arrives, and holds the breakers that stop
//! a compaction loop: failure cooldowns, the anti-thrash breaker with its
//! recovery probe, and the structural backoff.
//!
//! Deadlines are `tokio::time::Instant`s: outside a runtime they read the
//! system's monotonic clock, and tests pause and advance tokio's clock
//! instead of carrying a clock of their own. Only [`TriggerSnapshot`]
//! speaks wall-clock time, so a deadline means the same after a restart.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use super::budget::{self, DEFAULT_CONTEXT_LENGTH};
use super::config::CompactionConfig;

mod breakers;
mod persist;
#[cfg(test)]
mod tests;

use super::summary_failure::FailureClass;
pub use persist::{TriggerSnapshot, TriggerStatus};

/// Anti-thrash recovery probe delay (persisted as a wall-clock deadline).
pub(crate) const RECOVERY_PROBE_SECS: u64 = 300;
/// Backoff after a structural no-op (nothing to compress); no strike.
pub(crate) const STRUCTURAL_BACKOFF_SECS: u64 = 300;
/// Cooldown when no summary provider is configured.
pub(crate) const NO_PROVIDER_COOLDOWN_SECS: u64 = 600;
/// Ladder for timeouts and truncated summaries, by consecutive count.
pub(crate) const TIMEOUT_LADDER_SECS: [u64; 3] = [60, 300, 900];
/// Cooldown for JSON-decode, stream-closed and empty-content failures.
pub(crate) const SHORT_COOLDOWN_SECS: u64 = 30;
/// Cooldown for any other transient failure.
pub(crate) const DEFAULT_COOLDOWN_SECS: u64 = 60;
/// Minimum cooldown after a host stall (the idle window).
pub(crate) const HOST_STALL_MIN_COOLDOWN_SECS: u64 = 120;
/// Strikes or fallback streak at which automatic compaction is blocked.
pub(crate) const BREAKER_TRIP: u32 = 2;
/// Deferral tolerance floor: rough growth allowed over the baseline that fit.
// Only tests use it: see `Trigger::should_defer_preflight_to_real_usage`.
#[cfg(test)]
pub(crate) const DEFER_TOLERANCE_MIN_TOKENS: u64 = 4_096;
/// Deferral tolerance as a fraction of the threshold.
// Only tests use it: see `Trigger::should_defer_preflight_to_real_usage`.
#[cfg(test)]
pub(crate) const DEFER_TOLERANCE_RATIO: f64 = 0.05;

/// Token usage as the upstream reported it (`usage` object): what the
/// trigger learns from (missing fields count as 0; the cached part is not
/// used). Defined here, where it is consumed, so the engine depends on
/// nothing of its caller's; the proxy's usage parser fills it in.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Usage {
    /// `prompt_tokens` (the whole prompt, cached part included).
    pub prompt_tokens: Option<u64>,
    /// `completion_tokens`.
    pub completion_tokens: Option<u64>,
    /// `total_tokens`.
    pub total_tokens: Option<u64>,
    /// `prompt_tokens_details.cached_tokens`.
    pub cached_tokens: Option<u64>,
}

/// Where the context window comes from. The proxy resolves the window
/// (config table, learned value, `/props` probe) before it builds a
/// trigger, so the window is always known; the trigger still logs its
/// budgets once, on first need (never in [`Trigger::new`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WindowSource {
    /// The window is known (config table, learned value, probe); 0 means
    /// unknown ([`DEFAULT_CONTEXT_LENGTH`] assumed).
    Known(u64),
}

/// Per-conversation trigger, calibration and breaker state.
///
/// Derived budgets are computed lazily from the window. The counters are
/// the engine's own: outside it they are read and carried through
/// [`Trigger::snapshot`] and [`Trigger::restore`].
pub struct Trigger {
    cfg: Arc<CompactionConfig>,
    model: String,
    base_url: String,
    max_tokens: Option<u64>,
    window: Option<u64>,
    threshold_percent: Option<f64>,
    threshold: Option<u64>,
    tail_budget: Option<u64>,
    max_summary: Option<u64>,
    window_resolutions: u32,
    /// The request's fixed part (instructions and tools), engine units.
    fixed: u64,

    /// Last prompt tokens for the trigger: 0 = no real usage yet, −1 = just compacted.
    pub(crate) last_prompt_tokens: i64,
    /// Last reported completion tokens.
    pub(crate) last_completion_tokens: u64,
    /// Last reported total tokens.
    pub(crate) last_total_tokens: u64,
    /// Last positive real `prompt_tokens`.
    pub(crate) last_real_prompt_tokens: u64,
    /// Rough estimate of the request whose real prompt fit under the threshold.
    pub(crate) last_rough_tokens_when_real_prompt_fit: u64,
    /// Rough estimate of the request right after the last compaction.
    pub(crate) last_compression_rough_tokens: u64,
    /// A compaction committed and no real usage has arrived since.
    pub(crate) awaiting_real_usage_after_compression: bool,
    /// Ineffective-compaction strikes (breaker trips at 2).
    pub(crate) ineffective_compression_count: u32,
    /// Consecutive fallback summaries (breaker trips at 2).
    pub(crate) fallback_streak: u32,
    /// Feasibility skips in this session (observability only).
    pub(crate) prellm_skip_count: u32,
    /// Committed compactions; the compressor's finalization increments it.
    pub(crate) compression_count: u32,
    /// The upstream answered without usage; estimates are then the only signal.
    pub(crate) provider_omits_usage: bool,

    cooldown_until: Option<Instant>,
    cooldown_error: Option<String>,
    structural_backoff_until: Option<Instant>,
    recovery_deadline: Option<Instant>,
    verify_pending: bool,
    timeout_failures: u32,
    truncated_failures: u32,
}

impl fmt::Debug for Trigger {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Trigger")
            .field("model", &self.model)
            .field("window", &self.window)
            .field("threshold", &self.threshold)
            .field("last_prompt_tokens", &self.last_prompt_tokens)
            .field("strikes", &self.ineffective_compression_count)
            .field("streak", &self.fallback_streak)
            .field("compression_count", &self.compression_count)
            .finish_non_exhaustive()
    }
}

impl Trigger {
    /// A fresh trigger. Never resolves a lazy window.
    pub fn new(
        cfg: Arc<CompactionConfig>,
        model: &str,
        window: WindowSource,
        max_tokens: Option<u64>,
    ) -> Self {
        let WindowSource::Known(w) = window;
        let known = Some(w);
        let mut t = Self {
            cfg,
            model: model.to_owned(),
            base_url: String::new(),
            max_tokens: max_tokens.filter(|&m| m > 0),
            window: None,
            threshold_percent: None,
            threshold: None,
            tail_budget: None,
            max_summary: None,
            window_resolutions: 0,
            fixed: 0,
            last_prompt_tokens: 0,
            last_completion_tokens: 0,
            last_total_tokens: 0,
            last_real_prompt_tokens: 0,
            last_rough_tokens_when_real_prompt_fit: 0,
            last_compression_rough_tokens: 0,
            awaiting_real_usage_after_compression: false,
            ineffective_compression_count: 0,
            fallback_streak: 0,
            prellm_skip_count: 0,
            compression_count: 0,
            provider_omits_usage: false,
            cooldown_until: None,
            cooldown_error: None,
            structural_backoff_until: None,
            recovery_deadline: None,
            verify_pending: false,
            timeout_failures: 0,
            truncated_failures: 0,
        };
        // A known window is stored without the first-resolution log: that
        // line is emitted on first use, like a lazy one.
        t.window = known.map(sanitize_window);
        t
    }

    /// Record the upstream base URL the conversation goes to (builder form),
    /// so a later [`Trigger::update_model`] can tell a route change.
    pub fn with_base_url(mut self, base_url: &str) -> Self {
        self.base_url = base_url.to_owned();
        self
    }

    /// The configuration.
    // Only tests use it.
    #[cfg(test)]
    pub(crate) fn config(&self) -> &Arc<CompactionConfig> {
        &self.cfg
    }

    /// Current model name.
    pub fn model(&self) -> &str {
        &self.model
    }

    /// The output reservation in use.
    // Only tests use it.
    #[cfg(test)]
    pub(crate) fn max_tokens(&self) -> Option<u64> {
        self.max_tokens
    }

    /// The configured absolute cap, `None` when disabled.
    pub(crate) fn threshold_tokens_cap(&self) -> Option<u64> {
        self.cfg.threshold_tokens_cap()
    }

    /// Context window, resolving a lazy source on first call (once).
    pub(crate) fn context_length(&mut self) -> u64 {
        if let Some(w) = self.window {
            if self.window_resolutions > 0 {
                return w;
            }
        }
        self.resolve_window()
    }

    /// The window if already resolved; never probes.
    pub(crate) fn cached_context_length(&self) -> Option<u64> {
        self.window
    }

    /// 0 before the window is first resolved, 1 after (later changes through
    /// [`Trigger::set_context_length`] are not resolutions).
    // Only tests use it.
    #[cfg(test)]
    pub(crate) fn window_resolutions(&self) -> u32 {
        self.window_resolutions
    }

    fn resolve_window(&mut self) -> u64 {
        let w = match self.window {
            Some(w) => w,
            None => {
                tracing::warn!(
                    fallback = DEFAULT_CONTEXT_LENGTH,
                    "context window unknown; assuming default"
                );
                sanitize_window(0)
            }
        };
        self.window = Some(w);
        self.window_resolutions = self.window_resolutions.saturating_add(1);
        let threshold = self.threshold_tokens();
        let tail = self.tail_token_budget();
        let percent = self.threshold_percent();
        tracing::info!(
            window = w,
            threshold_tokens = threshold,
            tail_token_budget = tail,
            threshold_percent = percent,
            "Context compressor initialized"
        );
        w
    }

    /// Set the window (learned from an overflow error, a usage callback, a
    /// probe). The same value is a no-op, which keeps runtime overrides of the
    /// derived budgets; a new value re-floors the percent and invalidates the
    /// cached threshold, tail budget and summary cap.
    pub fn set_context_length(&mut self, window: u64) {
        let window = sanitize_window(window);
        if self.window == Some(window) {
            return;
        }
        self.window = Some(window);
        self.invalidate_budgets();
        if self.window_resolutions == 0 {
            self.resolve_window();
        }
    }

    /// Set the output reservation of the current request (from
    /// `budget::coerce_max_tokens`); `None` means no reservation. A change
    /// re-derives the threshold, tail budget and summary cap but, unlike
    /// [`Trigger::update_model`], keeps calibration and breakers: clients
    /// vary `max_tokens` from request to request.
    pub fn set_max_tokens(&mut self, max_tokens: Option<u64>) {
        let max_tokens = max_tokens.filter(|&m| m > 0);
        if max_tokens == self.max_tokens {
            return;
        }
        self.max_tokens = max_tokens;
        self.threshold = None;
        self.tail_budget = None;
        self.max_summary = None;
    }

    fn invalidate_budgets(&mut self) {
        self.threshold_percent = None;
        self.threshold = None;
        self.tail_budget = None;
        self.max_summary = None;
    }

    /// Effective threshold percent (per-model override, small-window floor).
    pub(crate) fn threshold_percent(&mut self) -> f64 {
        if let Some(p) = self.threshold_percent {
            return p;
        }
        let w = self.context_length();
        let p = budget::effective_percent(&self.cfg, &self.model, w);
        self.threshold_percent = Some(p);
        p
    }

    /// Sets the request's fixed part: what no compaction makes smaller (its
    /// instruction rows and tools), in engine units. The trigger and the
    /// budgets of what a compaction leaves follow it
    /// (`budget::threshold_over_fixed`, [`Trigger::history_target`]).
    pub fn set_fixed_tokens(&mut self, fixed: u64) {
        if fixed == self.fixed {
            return;
        }
        self.fixed = fixed;
        self.threshold = None;
        self.tail_budget = None;
        self.max_summary = None;
    }

    /// A compaction was committed and no real usage has arrived since.
    pub fn awaiting_real_usage(&self) -> bool {
        self.awaiting_real_usage_after_compression
    }

    /// Sets what [`Trigger::awaiting_real_usage`] says, as a committed
    /// compaction does, for the proxy's tests of its decision (`test-util`).
    #[cfg(feature = "test-util")]
    #[doc(hidden)]
    pub fn set_awaiting_real_usage(&mut self, awaiting: bool) {
        self.awaiting_real_usage_after_compression = awaiting;
    }

    /// The fixed part last set (0 = unknown or none).
    pub fn fixed_tokens(&self) -> u64 {
        self.fixed
    }

    /// Compaction trigger in tokens. With a fixed part it keeps the
    /// classic trigger's share of the room above it; an absolute
    /// `threshold_tokens` cap is the operator's word and stays as set.
    pub fn threshold_tokens(&mut self) -> u64 {
        if let Some(t) = self.threshold {
            return t;
        }
        let w = self.context_length();
        let p = self.threshold_percent();
        let cap = self.threshold_tokens_cap();
        let t0 = budget::compute_threshold_tokens(w, self.max_tokens, p, cap);
        let t = match cap {
            Some(_) => t0,
            None => budget::threshold_over_fixed(
                t0,
                budget::usable_window(w, self.max_tokens),
                self.fixed,
            ),
        };
        self.threshold = Some(t);
        t
    }

    /// What the history (all but the fixed part) may take after a
    /// compaction: `target_ratio` of the room between the fixed part and
    /// the trigger.
    pub fn history_target(&mut self) -> u64 {
        let t = self.threshold_tokens();
        budget::history_target(t, self.fixed, self.cfg.target_ratio)
    }

    /// The fixed part leaves no room to compact into: compaction can only
    /// cut.
    pub fn no_room(&mut self) -> bool {
        self.fixed > 0 && self.history_target() < budget::NO_ROOM_TOKENS
    }

    /// Tokens the user's own messages may take next to a summary (0 when
    /// `keep_user_messages` is off).
    pub(crate) fn user_messages_budget(&mut self) -> u64 {
        if !self.cfg.keep_user_messages {
            return 0;
        }
        let h = self.history_target();
        budget::user_messages_budget(self.context_length(), h)
    }

    /// The threshold if already computed or pinned; never resolves the window.
    pub fn cached_threshold_tokens(&self) -> Option<u64> {
        self.threshold
    }

    /// Pin the threshold (runtime correction or test), without resolving the window.
    pub fn set_threshold_tokens(&mut self, t: u64) {
        self.threshold = Some(t.max(1));
    }

    /// Tail token budget (from the current threshold).
    pub fn tail_token_budget(&mut self) -> u64 {
        if let Some(t) = self.tail_budget {
            return t;
        }
        let threshold = self.threshold_tokens();
        let w = self.context_length();
        let mut t =
            budget::tail_token_budget(threshold, w, self.cfg.effective_summary_target_ratio());
        if self.fixed > 0 {
            // Half the history target: the summary and the user's messages
            // take the rest.
            t = t.min((self.history_target() / 2).max(1));
        }
        self.tail_budget = Some(t);
        t
    }

    /// Pin the tail budget (runtime correction or test).
    pub fn set_tail_token_budget(&mut self, t: u64) {
        self.tail_budget = Some(t.max(1));
    }

    /// Upper bound of one summary in tokens (see `budget::max_summary_tokens_for`).
    pub fn max_summary_tokens(&mut self) -> u64 {
        if let Some(m) = self.max_summary {
            return m;
        }
        let threshold = self.threshold_tokens();
        let mut m = budget::max_summary_tokens_for(self.context_length(), threshold);
        if self.fixed > 0 {
            // A summary target is up to twice this (the budget's floor):
            // about 30% of the history target.
            m = m.min((self.history_target() * 15 / 100).max(16));
        }
        self.max_summary = Some(m);
        m
    }

    /// Prompt budget and reply cap of a summary call (see
    /// `budget::summariser_budgets`).
    pub fn summariser_budgets(&mut self) -> budget::SummariserBudgets {
        /// The smallest reply cap sized by the room: a summary's sections
        /// and a few lines of each.
        const MIN_REPLY_CAP: u32 = 128;
        let threshold = self.threshold_tokens();
        let mut b = budget::summariser_budgets(
            self.context_length(),
            threshold,
            self.cfg.effective_summary_target_ratio(),
        );
        if self.fixed > 0 && !self.no_room() {
            // With a fixed part the summary is sized by the room above it, not
            // by the window: a cap from the window let a small model write
            // 1,600 tokens (30 s on two cores) of a summary that could keep
            // at most ~150. 1.25 × the largest summary asked for, as above,
            // never under what a usable summary takes. Without room the
            // window's cap stays: the summary is then what makes room (a
            // 20-token cap left hermes-agent at 2k no summary at all).
            let largest = budget::summary_budget(u64::MAX / 8, self.max_summary_tokens());
            let cap = u32::try_from(largest + largest / 4).unwrap_or(u32::MAX);
            b.reply_tokens = b.reply_tokens.map(|r| r.min(cap.max(MIN_REPLY_CAP)));
        }
        b
    }
}

fn sanitize_window(w: u64) -> u64 {
    if w == 0 {
        DEFAULT_CONTEXT_LENGTH
    } else {
        w
    }
}

fn ceil_secs(d: Duration) -> u64 {
    let s = d.as_secs();
    if d.subsec_nanos() > 0 {
        s + 1
    } else {
        s
    }
}
