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
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};
use tokio::time::Instant;

use super::budget::{self, DEFAULT_CONTEXT_LENGTH};
use super::config::CompactionConfig;
// At their old paths: the cooldown ladder below is chosen by them.
pub use super::summary_failure::{truncate_error_text, FailureClass, ERROR_TEXT_MAX_CHARS};

/// Anti-thrash recovery probe delay (persisted as a wall-clock deadline).
pub const RECOVERY_PROBE_SECS: u64 = 300;
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
pub const DEFER_TOLERANCE_MIN_TOKENS: u64 = 4_096;
/// Deferral tolerance as a fraction of the threshold.
pub const DEFER_TOLERANCE_RATIO: f64 = 0.05;

/// Token usage as the upstream reported it (`usage` object): what the
/// trigger learns from (missing fields count as 0; the cached part is not
/// used). Defined here, where it is consumed, so the engine depends on
/// nothing above it; the usage parser (`crate::usage`) fills it in.
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

/// Cooldown in seconds for a failure of `class`; `consecutive` is the number
/// of consecutive failures of that ladder including this one (0 counts as 1).
pub fn cooldown_for(class: FailureClass, consecutive: u32) -> u64 {
    let rung = {
        let i = consecutive.clamp(1, TIMEOUT_LADDER_SECS.len() as u32) as usize - 1;
        TIMEOUT_LADDER_SECS[i]
    };
    match class {
        FailureClass::NoProvider => NO_PROVIDER_COOLDOWN_SECS,
        FailureClass::Timeout | FailureClass::Truncated => rung,
        FailureClass::HostStall => rung.max(HOST_STALL_MIN_COOLDOWN_SECS),
        FailureClass::Decode | FailureClass::StreamClosed | FailureClass::EmptyContent => {
            SHORT_COOLDOWN_SECS
        }
        FailureClass::Auth
        | FailureClass::ModelNotFound
        | FailureClass::Overloaded
        | FailureClass::Other => DEFAULT_COOLDOWN_SECS,
    }
}

/// Preflight display seed guard: a preflight estimate may
/// raise `last_prompt_tokens` but never overwrite the −1 "just compacted"
/// sentinel (or any negative value).
pub fn seed_preflight(last_prompt_tokens: i64, preflight: u64) -> i64 {
    let pre = i64::try_from(preflight).unwrap_or(i64::MAX);
    if last_prompt_tokens >= 0 && pre > last_prompt_tokens {
        pre
    } else {
        last_prompt_tokens
    }
}

/// The per-session fields that survive a restart: cooldown,
/// strikes, streak, recovery deadline, compaction count. Times are wall-clock
/// milliseconds since the Unix epoch.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct TriggerSnapshot {
    /// Failure cooldown deadline, if one is live.
    pub cooldown_until_unix_ms: Option<u64>,
    /// Error text behind the cooldown (already truncated).
    pub cooldown_error: Option<String>,
    /// Ineffective-compaction strikes.
    pub ineffective_compression_count: u32,
    /// Consecutive fallback summaries.
    pub fallback_streak: u32,
    /// Anti-thrash recovery deadline, if armed.
    pub recovery_deadline_unix_ms: Option<u64>,
    /// Committed compactions in this conversation.
    pub compression_count: u32,
}

/// Content-free view of a trigger for the admin endpoint and logs. Built
/// from cached values only: reading it never resolves the window.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct TriggerStatus {
    /// Model name.
    pub model: String,
    /// Context window, if resolved.
    pub window: Option<u64>,
    /// Compaction trigger, if computed.
    pub threshold_tokens: Option<u64>,
    /// Output reservation in use.
    pub(crate) max_tokens: Option<u64>,
    /// Last prompt tokens (0 = none, −1 = just compacted).
    pub(crate) last_prompt_tokens: i64,
    /// Last positive real prompt tokens.
    pub(crate) last_real_prompt_tokens: u64,
    /// Committed compactions.
    pub(crate) compression_count: u32,
    /// Ineffective-compaction strikes.
    pub(crate) ineffective_compression_count: u32,
    /// Consecutive fallback summaries.
    pub fallback_streak: u32,
    /// Feasibility skips.
    pub(crate) prellm_skip_count: u32,
    /// Seconds left on the failure cooldown.
    pub cooldown_remaining_secs: Option<u64>,
    /// Seconds left on the structural backoff.
    pub(crate) structural_backoff_remaining_secs: Option<u64>,
    /// Seconds until the anti-thrash recovery probe, if armed.
    pub recovery_probe_in_secs: Option<u64>,
    /// Waiting for real usage after a compaction.
    pub(crate) awaiting_real_usage: bool,
    /// The upstream's last response had no usage.
    pub(crate) provider_omits_usage: bool,
    /// The request's fixed part (instructions and tools), engine units.
    pub(crate) fixed_tokens: u64,
    /// What the history may take after a compaction, if computed.
    pub(crate) history_target: Option<u64>,
    /// The fixed part leaves no room to compact into: compaction can only
    /// cut.
    pub(crate) no_room: bool,
}

/// Per-conversation trigger, calibration and breaker state.
///
/// The counters are `pub` so callers and tests can read and set them
/// directly; derived budgets are computed lazily from the window.
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
    pub last_prompt_tokens: i64,
    /// Last reported completion tokens.
    pub last_completion_tokens: u64,
    /// Last reported total tokens.
    pub last_total_tokens: u64,
    /// Last positive real `prompt_tokens`.
    pub last_real_prompt_tokens: u64,
    /// Rough estimate of the request whose real prompt fit under the threshold.
    pub last_rough_tokens_when_real_prompt_fit: u64,
    /// Rough estimate of the request right after the last compaction.
    pub last_compression_rough_tokens: u64,
    /// A compaction committed and no real usage has arrived since.
    pub awaiting_real_usage_after_compression: bool,
    /// Ineffective-compaction strikes (breaker trips at 2).
    pub ineffective_compression_count: u32,
    /// Consecutive fallback summaries (breaker trips at 2).
    pub fallback_streak: u32,
    /// Feasibility skips in this session (observability only).
    pub prellm_skip_count: u32,
    /// Committed compactions; the compressor's finalization increments it.
    pub compression_count: u32,
    /// The upstream answered without usage; estimates are then the only signal.
    pub provider_omits_usage: bool,

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
    pub fn config(&self) -> &Arc<CompactionConfig> {
        &self.cfg
    }

    /// Current model name.
    pub fn model(&self) -> &str {
        &self.model
    }

    /// Current upstream base URL (as given to [`Trigger::update_model`]).
    pub fn base_url(&self) -> &str {
        &self.base_url
    }

    /// The output reservation in use.
    pub fn max_tokens(&self) -> Option<u64> {
        self.max_tokens
    }

    /// The configured absolute cap, `None` when disabled.
    pub fn threshold_tokens_cap(&self) -> Option<u64> {
        self.cfg.threshold_tokens_cap()
    }

    /// Context window, resolving a lazy source on first call (once).
    pub fn context_length(&mut self) -> u64 {
        if let Some(w) = self.window {
            if self.window_resolutions > 0 {
                return w;
            }
        }
        self.resolve_window()
    }

    /// The window if already resolved; never probes.
    pub fn cached_context_length(&self) -> Option<u64> {
        self.window
    }

    /// 0 before the window is first resolved, 1 after (later changes through
    /// [`Trigger::set_context_length`] are not resolutions).
    pub fn window_resolutions(&self) -> u32 {
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
    /// [`budget::coerce_max_tokens`]); `None` means no reservation. A change
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
    pub fn threshold_percent(&mut self) -> f64 {
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
    /// ([`budget::threshold_over_fixed`], [`Trigger::history_target`]).
    pub fn set_fixed_tokens(&mut self, fixed: u64) {
        if fixed == self.fixed {
            return;
        }
        self.fixed = fixed;
        self.threshold = None;
        self.tail_budget = None;
        self.max_summary = None;
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
    pub fn user_messages_budget(&mut self) -> u64 {
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

    /// Upper bound of one summary in tokens (see [`budget::max_summary_tokens_for`]).
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
    /// [`budget::summariser_budgets`]).
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

    /// Pin the summary cap (runtime correction or test).
    pub fn set_max_summary_tokens(&mut self, m: u64) {
        self.max_summary = Some(m.max(1));
    }

    /// All budgets as one value (resolves the window).
    pub fn budgets(&mut self) -> budget::Budgets {
        budget::Budgets {
            window: self.context_length(),
            threshold_tokens: self.threshold_tokens(),
            tail_token_budget: self.tail_token_budget(),
            max_summary_tokens: self.max_summary_tokens(),
        }
    }

    /// Whether automatic compaction should run at `prompt_tokens` (default:
    /// `last_prompt_tokens`). False below the threshold; false when blocked,
    /// with a warning, because a silently blocked session grows into the
    /// provider's hard limit.
    pub fn should_compress(&mut self, prompt_tokens: Option<i64>) -> bool {
        let tokens = prompt_tokens.unwrap_or(self.last_prompt_tokens);
        if tokens <= 0 {
            return false;
        }
        let threshold = self.threshold_tokens();
        if (tokens as u64) < threshold {
            return false;
        }
        match self.block_reason() {
            Some(reason) => {
                tracing::warn!(
                    tokens,
                    threshold,
                    reason = %reason,
                    "over compaction threshold but automatic compaction is blocked"
                );
                false
            }
            None => true,
        }
    }

    /// Whether either anti-thrash counter reached the trip point.
    pub fn breaker_tripped(&self) -> bool {
        self.ineffective_compression_count >= BREAKER_TRIP || self.fallback_streak >= BREAKER_TRIP
    }

    /// Whether automatic compaction is blocked (see [`Trigger::block_reason`]).
    pub fn is_blocked(&mut self) -> bool {
        self.block_reason().is_some()
    }

    /// Why automatic compaction is blocked, if it is: `"cooldown:<s>"`,
    /// `"structural_backoff:<s>"` (remaining seconds, rounded up) or
    /// `"ineffective"`. A tripped breaker arms a 300 s recovery
    /// deadline on first evaluation; once it passes, both counters drop to at
    /// most 1 and one probe attempt is allowed.
    pub fn block_reason(&mut self) -> Option<String> {
        if let Some(rem) = self.cooldown_remaining() {
            return Some(format!("cooldown:{}", ceil_secs(rem)));
        }
        if let Some(rem) = self.structural_backoff_remaining() {
            return Some(format!("structural_backoff:{}", ceil_secs(rem)));
        }
        if !self.breaker_tripped() {
            self.recovery_deadline = None;
            return None;
        }
        let now = Instant::now();
        let window = Duration::from_secs(RECOVERY_PROBE_SECS);
        match self.recovery_deadline {
            Some(deadline) if now >= deadline => {
                self.ineffective_compression_count = self.ineffective_compression_count.min(1);
                self.fallback_streak = self.fallback_streak.min(1);
                self.recovery_deadline = None;
                tracing::info!(
                    "anti-thrash recovery window elapsed; allowing one probe compaction"
                );
                None
            }
            // A deadline beyond one window (restored from a wall clock that
            // has since jumped back) is re-armed.
            Some(deadline) if deadline <= now + window => Some("ineffective".to_owned()),
            _ => {
                self.recovery_deadline = Some(now + window);
                Some("ineffective".to_owned())
            }
        }
    }

    /// The armed anti-thrash recovery deadline.
    pub fn recovery_deadline(&self) -> Option<Instant> {
        self.recovery_deadline
    }

    /// Whether the next real usage will judge the last compaction.
    pub fn verify_pending(&self) -> bool {
        self.verify_pending
    }

    /// Record the upstream's usage for the last request. Positive prompt
    /// tokens become the real reading; a reading below the threshold clears
    /// the strikes (not the fallback streak). If a compaction awaits its
    /// verdict, a reading still at or over the threshold is a strike
    /// (incompressible system prompt + tool schemas). The verify and
    /// awaiting flags are always cleared, even when usage is missing.
    pub fn update_from_response(&mut self, usage: &Usage) {
        let prompt = usage.prompt_tokens.unwrap_or(0);
        self.last_prompt_tokens = i64::try_from(prompt).unwrap_or(i64::MAX);
        self.last_completion_tokens = usage.completion_tokens.unwrap_or(0);
        self.last_total_tokens = usage.total_tokens.unwrap_or(0);
        self.provider_omits_usage = usage.prompt_tokens.is_none();
        if prompt > 0 {
            self.last_real_prompt_tokens = prompt;
            let threshold = self.threshold_tokens();
            let fits = prompt < threshold;
            if fits {
                self.ineffective_compression_count = 0;
                if self.awaiting_real_usage_after_compression {
                    self.last_rough_tokens_when_real_prompt_fit =
                        self.last_compression_rough_tokens;
                }
            }
            if self.verify_pending {
                if fits {
                    self.ineffective_compression_count = 0;
                } else {
                    self.ineffective_compression_count =
                        self.ineffective_compression_count.saturating_add(1);
                    tracing::warn!(
                        prompt_tokens = prompt,
                        threshold,
                        strikes = self.ineffective_compression_count,
                        "compaction was ineffective: real prompt still over threshold \
                         (incompressible system prompt + tool schemas may exceed it)"
                    );
                }
            }
        }
        self.verify_pending = false;
        self.awaiting_real_usage_after_compression = false;
    }

    /// Whether a preflight compaction triggered by the rough estimate `rough`
    /// should wait one request for real usage: right after a compaction, or
    /// while the rough figure grew only a little, the real count is the
    /// better judge and costs nothing but one request. Defer when over the threshold and either a compaction
    /// awaits its real usage, or the last real reading fit and `rough` grew by
    /// at most `max(4,096, 5% of threshold)` over the rough baseline that fit
    /// (the baseline is then raised). Never defers when the provider omits
    /// usage (the estimate is the only signal then) outside the awaiting case.
    pub fn should_defer_preflight_to_real_usage(&mut self, rough: u64) -> bool {
        let threshold = self.threshold_tokens();
        if rough < threshold {
            return false;
        }
        if self.awaiting_real_usage_after_compression {
            return true;
        }
        if self.provider_omits_usage {
            return false;
        }
        let real = self.last_real_prompt_tokens;
        let baseline = self.last_rough_tokens_when_real_prompt_fit;
        if real == 0 || real >= threshold || baseline == 0 {
            return false;
        }
        let tolerance = ((threshold as f64 * DEFER_TOLERANCE_RATIO).floor() as u64)
            .max(DEFER_TOLERANCE_MIN_TOKENS);
        if rough <= baseline.saturating_add(tolerance) {
            self.last_rough_tokens_when_real_prompt_fit = baseline.max(rough);
            true
        } else {
            false
        }
    }

    /// The conversation's model, window, upstream or reservation changed.
    /// Budgets are re-derived from the raw config (so leaving an overridden
    /// model restores the configured percent), all real-usage calibration is
    /// zeroed (0, not −1) and strikes reset. A runtime change (model
    /// or base URL) also resets the fallback streak and clears the failure
    /// cooldown: cooldowns belong to the failed route. `window`/`max_tokens`
    /// replace the current values only when given. A call that changes
    /// nothing is a no-op, so calling it on every request is safe.
    pub fn update_model(
        &mut self,
        model: &str,
        window: Option<u64>,
        base_url: &str,
        max_tokens: Option<u64>,
    ) {
        let runtime_changed = model != self.model || base_url != self.base_url;
        let window_same = window.is_none_or(|w| Some(sanitize_window(w)) == self.window);
        let max_same = max_tokens.is_none_or(|m| Some(m).filter(|&m| m > 0) == self.max_tokens);
        if !runtime_changed && window_same && max_same {
            return;
        }
        self.model = model.to_owned();
        self.base_url = base_url.to_owned();
        if let Some(m) = max_tokens {
            self.max_tokens = Some(m).filter(|&m| m > 0);
        }
        match window {
            Some(w) => {
                let w = sanitize_window(w);
                let first = self.window_resolutions == 0;
                self.window = Some(w);
                self.invalidate_budgets();
                if first {
                    self.resolve_window();
                }
            }
            None => self.invalidate_budgets(),
        }

        self.last_prompt_tokens = 0;
        self.last_completion_tokens = 0;
        self.last_total_tokens = 0;
        self.last_real_prompt_tokens = 0;
        self.last_rough_tokens_when_real_prompt_fit = 0;
        self.last_compression_rough_tokens = 0;
        self.awaiting_real_usage_after_compression = false;
        self.ineffective_compression_count = 0;
        self.prellm_skip_count = 0;
        self.verify_pending = false;
        if runtime_changed {
            self.fallback_streak = 0;
            self.clear_failure_cooldown();
            self.timeout_failures = 0;
            self.truncated_failures = 0;
        }
    }

    /// A compaction was committed and sent. Sets the −1 sentinel, awaits
    /// real usage with `rough_after` (rough estimate of the compacted request)
    /// as its baseline, arms the verdict and clears the structural backoff. A
    /// fallback summary extends the fallback streak, a healthy summary resets
    /// it, and a feasibility skip leaves it unchanged (it proves nothing about
    /// the summariser). `compression_count` is not touched here: the
    /// compressor's finalization increments it.
    pub fn record_completed_compaction(
        &mut self,
        used_fallback: bool,
        feasibility_skip: bool,
        rough_after: u64,
    ) {
        self.last_prompt_tokens = -1;
        self.awaiting_real_usage_after_compression = true;
        self.last_compression_rough_tokens = rough_after;
        self.verify_pending = true;
        self.structural_backoff_until = None;
        if feasibility_skip {
            return;
        }
        if used_fallback {
            self.fallback_streak = self.fallback_streak.saturating_add(1);
            tracing::warn!(
                streak = self.fallback_streak,
                "compaction used the deterministic fallback summary"
            );
        } else {
            self.fallback_streak = 0;
        }
    }

    /// A compaction candidate was rejected (not smaller than its input even
    /// after salvage): one strike.
    pub fn record_rejected_compaction(&mut self) {
        self.ineffective_compression_count = self.ineffective_compression_count.saturating_add(1);
    }

    /// Start a failure cooldown of `secs`. A live cooldown is never shortened
    /// (the deadline is the later of the two); the error text (first 220
    /// chars) follows the deadline that wins.
    pub fn set_failure_cooldown(&mut self, secs: u64, error: &str) {
        let deadline = Instant::now() + Duration::from_secs(secs);
        match self.cooldown_until {
            Some(existing) if existing >= deadline && self.cooldown_remaining().is_some() => {}
            _ => {
                self.cooldown_until = Some(deadline);
                self.cooldown_error = Some(truncate_error_text(error));
            }
        }
    }

    /// Clear the failure cooldown.
    pub fn clear_failure_cooldown(&mut self) {
        self.cooldown_until = None;
        self.cooldown_error = None;
    }

    /// Time left on a live failure cooldown.
    pub fn cooldown_remaining(&self) -> Option<Duration> {
        let until = self.cooldown_until?;
        let now = Instant::now();
        (until > now).then(|| until - now)
    }

    /// Whether a failure cooldown is live.
    pub fn cooldown_active(&self) -> bool {
        self.cooldown_remaining().is_some()
    }

    /// The monotonic cooldown deadline, live or expired.
    pub fn cooldown_until(&self) -> Option<Instant> {
        self.cooldown_until
    }

    /// Error text behind the current cooldown.
    pub fn cooldown_error(&self) -> Option<&str> {
        self.cooldown_error.as_deref()
    }

    /// Record a failed summary attempt of `class`: advances that class's
    /// ladder counter and sets the matching cooldown (never shortening a live
    /// one). Returns the cooldown chosen, in seconds.
    pub fn note_summary_failure(&mut self, class: FailureClass, error: &str) -> u64 {
        let consecutive = match class {
            FailureClass::Timeout | FailureClass::HostStall => {
                self.timeout_failures = self.timeout_failures.saturating_add(1);
                self.timeout_failures
            }
            FailureClass::Truncated => {
                self.truncated_failures = self.truncated_failures.saturating_add(1);
                self.truncated_failures
            }
            _ => 1,
        };
        let secs = cooldown_for(class, consecutive);
        self.set_failure_cooldown(secs, error);
        secs
    }

    /// A summary succeeded: the ladders restart and the cooldown clears.
    pub fn note_summary_success(&mut self) {
        self.timeout_failures = 0;
        self.truncated_failures = 0;
        self.clear_failure_cooldown();
    }

    /// Consecutive timeout-class failures (ladder position).
    pub fn timeout_failures(&self) -> u32 {
        self.timeout_failures
    }

    /// Consecutive truncated-summary failures (ladder position).
    pub fn truncated_failures(&self) -> u32 {
        self.truncated_failures
    }

    /// Nothing to compress: back off 300 s without a strike (in memory only).
    pub fn set_structural_backoff(&mut self) {
        self.structural_backoff_until =
            Some(Instant::now() + Duration::from_secs(STRUCTURAL_BACKOFF_SECS));
    }

    /// Clear the structural backoff (forced compaction, committed compaction).
    pub fn clear_structural_backoff(&mut self) {
        self.structural_backoff_until = None;
    }

    /// Time left on a live structural backoff.
    pub fn structural_backoff_remaining(&self) -> Option<Duration> {
        let until = self.structural_backoff_until?;
        let now = Instant::now();
        (until > now).then(|| until - now)
    }

    /// `/new`-style reset: every per-session field, including counters,
    /// cooldowns, backoffs, calibration and the skip count. The
    /// window, model and derived budgets are kept.
    pub fn reset_session(&mut self) {
        self.last_prompt_tokens = 0;
        self.last_completion_tokens = 0;
        self.last_total_tokens = 0;
        self.last_real_prompt_tokens = 0;
        self.last_rough_tokens_when_real_prompt_fit = 0;
        self.last_compression_rough_tokens = 0;
        self.awaiting_real_usage_after_compression = false;
        self.ineffective_compression_count = 0;
        self.fallback_streak = 0;
        self.prellm_skip_count = 0;
        self.compression_count = 0;
        self.provider_omits_usage = false;
        self.clear_failure_cooldown();
        self.structural_backoff_until = None;
        self.recovery_deadline = None;
        self.verify_pending = false;
        self.timeout_failures = 0;
        self.truncated_failures = 0;
    }

    /// Content-free status from cached values (never resolves the window).
    pub fn status(&self) -> TriggerStatus {
        let now = Instant::now();
        let target = self
            .threshold
            .map(|t| budget::history_target(t, self.fixed, self.cfg.target_ratio));
        TriggerStatus {
            model: self.model.clone(),
            window: self.window.filter(|_| self.window_resolutions > 0),
            threshold_tokens: self.threshold,
            max_tokens: self.max_tokens,
            last_prompt_tokens: self.last_prompt_tokens,
            last_real_prompt_tokens: self.last_real_prompt_tokens,
            compression_count: self.compression_count,
            ineffective_compression_count: self.ineffective_compression_count,
            fallback_streak: self.fallback_streak,
            prellm_skip_count: self.prellm_skip_count,
            cooldown_remaining_secs: self.cooldown_remaining().map(ceil_secs),
            structural_backoff_remaining_secs: self.structural_backoff_remaining().map(ceil_secs),
            recovery_probe_in_secs: self
                .recovery_deadline
                .map(|d| ceil_secs(d.saturating_duration_since(now))),
            awaiting_real_usage: self.awaiting_real_usage_after_compression,
            provider_omits_usage: self.provider_omits_usage,
            fixed_tokens: self.fixed,
            history_target: target,
            no_room: self.fixed > 0 && target.is_some_and(|h| h < budget::NO_ROOM_TOKENS),
        }
    }

    /// The fields to persist for this conversation.
    pub fn snapshot(&self) -> TriggerSnapshot {
        let (now, wall) = (Instant::now(), SystemTime::now());
        let cooldown_until_unix_ms = self.cooldown_remaining().map(|rem| unix_ms(wall + rem));
        TriggerSnapshot {
            cooldown_until_unix_ms,
            cooldown_error: cooldown_until_unix_ms.and(self.cooldown_error.clone()),
            ineffective_compression_count: self.ineffective_compression_count,
            fallback_streak: self.fallback_streak,
            recovery_deadline_unix_ms: self
                .recovery_deadline
                .map(|d| unix_ms(wall + d.saturating_duration_since(now))),
            compression_count: self.compression_count,
        }
    }

    /// Load persisted state. Counters,
    /// recovery deadline and compaction count are taken from the snapshot; a
    /// live persisted cooldown replaces the local one, while a snapshot
    /// without one keeps a live local cooldown (a failed write must not
    /// reopen the thrash window). The feasibility-skip count restarts at 0.
    pub fn restore(&mut self, snap: TriggerSnapshot) {
        let (now, wall) = (Instant::now(), SystemTime::now());
        if let Some(ms) = snap.cooldown_until_unix_ms {
            let until = UNIX_EPOCH + Duration::from_millis(ms);
            match until.duration_since(wall) {
                Ok(rem) if !rem.is_zero() => {
                    self.cooldown_until = Some(now + rem);
                    self.cooldown_error = snap.cooldown_error.map(|e| truncate_error_text(&e));
                }
                _ => {
                    if !self.cooldown_active() {
                        self.clear_failure_cooldown();
                    }
                }
            }
        }
        self.ineffective_compression_count = snap.ineffective_compression_count;
        self.fallback_streak = snap.fallback_streak;
        // A deadline that has passed is due now.
        self.recovery_deadline = snap.recovery_deadline_unix_ms.map(|ms| {
            let until = UNIX_EPOCH + Duration::from_millis(ms);
            now + until.duration_since(wall).unwrap_or_default()
        });
        self.compression_count = snap.compression_count;
        self.prellm_skip_count = 0;
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

fn unix_ms(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH)
        .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
        .unwrap_or(0)
}
