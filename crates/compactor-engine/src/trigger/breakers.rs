//! The trigger's decisions and breakers: whether to compact now, what real
//! usage says about the last compaction, the failure cooldowns and their
//! ladders, the anti-thrash breaker with its recovery probe, and the
//! structural backoff.

use std::time::Duration;

use tokio::time::Instant;

use super::{ceil_secs, sanitize_window, FailureClass, Trigger, Usage};
use super::{
    BREAKER_TRIP, DEFAULT_COOLDOWN_SECS, HOST_STALL_MIN_COOLDOWN_SECS, NO_PROVIDER_COOLDOWN_SECS,
    RECOVERY_PROBE_SECS, SHORT_COOLDOWN_SECS, STRUCTURAL_BACKOFF_SECS, TIMEOUT_LADDER_SECS,
};
use crate::summary_failure::truncate_error_text;

#[cfg(test)]
mod tests;

/// Cooldown in seconds for a failure of `class`; `consecutive` is the number
/// of consecutive failures of that ladder including this one (0 counts as 1).
pub(super) fn cooldown_for(class: FailureClass, consecutive: u32) -> u64 {
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
// Only the ported tests use it: the proxy sets no preflight display seed.
#[cfg(test)]
pub(super) fn seed_preflight(last_prompt_tokens: i64, preflight: u64) -> i64 {
    let pre = i64::try_from(preflight).unwrap_or(i64::MAX);
    if last_prompt_tokens >= 0 && pre > last_prompt_tokens {
        pre
    } else {
        last_prompt_tokens
    }
}

impl Trigger {
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
    pub(crate) fn breaker_tripped(&self) -> bool {
        self.ineffective_compression_count >= BREAKER_TRIP || self.fallback_streak >= BREAKER_TRIP
    }

    /// Whether automatic compaction is blocked (see [`Trigger::block_reason`]).
    // Only tests use it.
    #[cfg(test)]
    pub(crate) fn is_blocked(&mut self) -> bool {
        self.block_reason().is_some()
    }

    /// Why automatic compaction is blocked, if it is: `"cooldown:<s>"`,
    /// `"structural_backoff:<s>"` (remaining seconds, rounded up) or
    /// `"ineffective"`. A tripped breaker arms a 300 s recovery
    /// deadline on first evaluation; once it passes, both counters drop to at
    /// most 1 and one probe attempt is allowed.
    pub(crate) fn block_reason(&mut self) -> Option<String> {
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
    // Only tests use it.
    #[cfg(test)]
    pub(crate) fn recovery_deadline(&self) -> Option<Instant> {
        self.recovery_deadline
    }

    /// Whether the next real usage will judge the last compaction.
    // Only tests use it.
    #[cfg(test)]
    pub(crate) fn verify_pending(&self) -> bool {
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
    // Only tests use it: the proxy defers on `awaiting_real_usage_after_compression`
    // alone (`chat::decide`).
    #[cfg(test)]
    pub(crate) fn should_defer_preflight_to_real_usage(&mut self, rough: u64) -> bool {
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
        let tolerance = ((threshold as f64 * super::DEFER_TOLERANCE_RATIO).floor() as u64)
            .max(super::DEFER_TOLERANCE_MIN_TOKENS);
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

        self.forget_usage();
        if runtime_changed {
            self.fallback_streak = 0;
            self.clear_failure_cooldown();
            self.timeout_failures = 0;
            self.truncated_failures = 0;
        }
    }

    /// Forgets the usage seen and the verdicts drawn from it (a new model
    /// or window, a new session): counts from another runtime mean nothing
    /// here.
    pub(super) fn forget_usage(&mut self) {
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
    pub(crate) fn record_rejected_compaction(&mut self) {
        self.ineffective_compression_count = self.ineffective_compression_count.saturating_add(1);
    }

    /// Start a failure cooldown of `secs`. A live cooldown is never shortened
    /// (the deadline is the later of the two); the error text (first 220
    /// chars) follows the deadline that wins.
    pub(crate) fn set_failure_cooldown(&mut self, secs: u64, error: &str) {
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
    pub(crate) fn clear_failure_cooldown(&mut self) {
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
    pub(crate) fn cooldown_active(&self) -> bool {
        self.cooldown_remaining().is_some()
    }

    /// Error text behind the current cooldown.
    // Only tests use it.
    #[cfg(test)]
    pub(crate) fn cooldown_error(&self) -> Option<&str> {
        self.cooldown_error.as_deref()
    }

    /// Record a failed summary attempt of `class`: advances that class's
    /// ladder counter and sets the matching cooldown (never shortening a live
    /// one). Returns the cooldown chosen, in seconds.
    pub(crate) fn note_summary_failure(&mut self, class: FailureClass, error: &str) -> u64 {
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
    pub(crate) fn note_summary_success(&mut self) {
        self.timeout_failures = 0;
        self.truncated_failures = 0;
        self.clear_failure_cooldown();
    }

    /// Consecutive truncated-summary failures (ladder position).
    // Only tests use it.
    #[cfg(test)]
    pub(crate) fn truncated_failures(&self) -> u32 {
        self.truncated_failures
    }

    /// Nothing to compress: back off 300 s without a strike (in memory only).
    pub(crate) fn set_structural_backoff(&mut self) {
        self.structural_backoff_until =
            Some(Instant::now() + Duration::from_secs(STRUCTURAL_BACKOFF_SECS));
    }

    /// Clear the structural backoff (forced compaction, committed compaction).
    pub(crate) fn clear_structural_backoff(&mut self) {
        self.structural_backoff_until = None;
    }

    /// Time left on a live structural backoff.
    pub(crate) fn structural_backoff_remaining(&self) -> Option<Duration> {
        let until = self.structural_backoff_until?;
        let now = Instant::now();
        (until > now).then(|| until - now)
    }
}
