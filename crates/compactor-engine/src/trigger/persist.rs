//! What of a trigger outlives its process ([`TriggerSnapshot`]), its
//! content-free view ([`TriggerStatus`]) and the session reset.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};
use tokio::time::Instant;

use super::{budget, ceil_secs, Trigger};
use crate::summary_failure::truncate_error_text;

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
    pub max_tokens: Option<u64>,
    /// Last prompt tokens (0 = none, −1 = just compacted).
    pub last_prompt_tokens: i64,
    /// Last positive real prompt tokens.
    pub last_real_prompt_tokens: u64,
    /// Committed compactions.
    pub compression_count: u32,
    /// Ineffective-compaction strikes.
    pub ineffective_compression_count: u32,
    /// Consecutive fallback summaries.
    pub fallback_streak: u32,
    /// Summary calls skipped since the usage was last forgotten (new
    /// session, model or window): the middle was under a tenth of the
    /// threshold after an ineffective compaction (`feasibility_skip`).
    pub prellm_skip_count: u32,
    /// Seconds left on the failure cooldown.
    pub cooldown_remaining_secs: Option<u64>,
    /// Seconds left on the structural backoff.
    pub structural_backoff_remaining_secs: Option<u64>,
    /// Seconds until the anti-thrash recovery probe, if armed.
    pub recovery_probe_in_secs: Option<u64>,
    /// Waiting for real usage after a compaction.
    pub awaiting_real_usage: bool,
    /// The upstream's last response had no usage.
    pub provider_omits_usage: bool,
    /// The request's fixed part (instructions and tools), engine units.
    pub fixed_tokens: u64,
    /// What the history may take after a compaction, if computed.
    pub history_target: Option<u64>,
    /// The fixed part leaves no room to compact into: compaction can only
    /// cut.
    pub no_room: bool,
}

impl Trigger {
    /// `/new`-style reset: every per-session field, including counters,
    /// cooldowns, backoffs, calibration and the skip count. The
    /// window, model and derived budgets are kept.
    // Only tests use it: the proxy has no `/new` (a new conversation is a new
    // history, hence a new record chain).
    #[cfg(test)]
    pub(crate) fn reset_session(&mut self) {
        self.forget_usage();
        self.fallback_streak = 0;
        self.compression_count = 0;
        self.provider_omits_usage = false;
        self.clear_failure_cooldown();
        self.structural_backoff_until = None;
        self.recovery_deadline = None;
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

fn unix_ms(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH)
        .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
        .unwrap_or(0)
}
