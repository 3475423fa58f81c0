//! Compaction settings (`[compaction]` in `proxy.toml`) and their defaults.
//!
//! Values are stored as configured; the accessors
//! (`effective_*`) apply the clamps the engine relies on so a bad config can
//! never produce nonsensical budgets.

use std::collections::BTreeMap;

use serde::{Deserialize, Deserializer};

use super::tokens;

/// Default trigger ratio: 0.85 left too little room for the reply and the
/// summary call on busy agent turns.
pub(crate) const DEFAULT_THRESHOLD_PERCENT: f64 = 0.50;
/// Default number of leading non-system messages protected on the first compaction.
pub(crate) const DEFAULT_PROTECT_FIRST_N: usize = 3;
/// Default soft tail floor in messages (capped at 8 by the tail walk).
pub(crate) const DEFAULT_PROTECT_LAST_N: usize = 20;
/// Default summary/tail sizing ratio.
pub(crate) const DEFAULT_SUMMARY_TARGET_RATIO: f64 = 0.20;
/// Lower clamp of `summary_target_ratio`.
pub(crate) const MIN_SUMMARY_TARGET_RATIO: f64 = 0.10;
/// Upper clamp of `summary_target_ratio`.
pub(crate) const MAX_SUMMARY_TARGET_RATIO: f64 = 0.80;
/// Default hard ceiling of a summary call.
pub(crate) const DEFAULT_SUMMARY_TIMEOUT_SECS: u64 = 600;
/// Default share of the room between the fixed part (instructions, tools)
/// and the trigger that a compaction leaves the history: half, so the
/// conversation can grow for several turns before the next compaction.
pub(crate) const DEFAULT_TARGET_RATIO: f64 = 0.5;

/// The first bad setting of a `[compaction]` table. The engine knows
/// nothing of the proxy's `ConfigError`, the one configuration error a
/// user sees; the proxy's config layer turns this into one of its problems
/// (a key under `compaction.`).
#[derive(Debug, thiserror::Error)]
#[error("invalid setting compaction{}: {message}", key.as_deref().map(|k| format!(".{k}")).unwrap_or_default())]
pub struct InvalidSetting {
    /// The offending key inside `[compaction]`, when known.
    pub key: Option<String>,
    /// What is wrong with it.
    pub message: String,
}

impl InvalidSetting {
    fn new(key: &str, message: impl Into<String>) -> Self {
        Self {
            key: Some(key.to_owned()),
            message: message.into(),
        }
    }
}

/// Which compaction strategy runs when a conversation crosses its threshold.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Strategy {
    /// One summary of the whole middle per compaction (the default).
    #[default]
    Batch,
    /// Rolling per-exchange summaries (off by default upstream: breaks the prompt cache every turn).
    Micro,
}

/// Settings of the compaction engine. Every field has a default, so an
/// empty `[compaction]` table equals [`CompactionConfig::default`].
#[derive(Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CompactionConfig {
    /// Trigger as a fraction of the usable window (raised to 0.75 below 512k
    /// windows). Values in (1, 100] are read as percentages (`75` = 0.75).
    pub threshold_percent: f64,
    /// Absolute trigger cap in tokens; `None` = ratio only. Zero, negative or
    /// non-numeric values deserialise to `None`: an invalid cap is no cap.
    #[serde(deserialize_with = "de_positive_cap")]
    pub threshold_tokens: Option<u64>,
    /// Leading non-system messages kept verbatim on the first compaction.
    pub protect_first_n: usize,
    /// Soft tail floor in messages (the tail walk caps it at 8).
    pub protect_last_n: usize,
    /// Newest real user messages the tail must contain.
    pub min_tail_user_messages: usize,
    /// Tail/summary sizing ratio; see `CompactionConfig::effective_summary_target_ratio`.
    pub summary_target_ratio: f64,
    /// Model-name substring → threshold percent (same scale rules as
    /// `threshold_percent`); the longest matching key wins.
    pub model_thresholds: BTreeMap<String, f64>,
    /// Abort (forward the original messages) instead of inserting a fallback summary.
    pub abort_on_summary_failure: bool,
    /// Also abort (rather than fall back) when the summary came back
    /// truncated, empty or from an overloaded provider. Off by default: small local models often run out of reply
    /// budget, and aborting then means the request overflows the window; the
    /// deterministic fallback keeps the conversation going.
    pub abort_on_degraded_summary: bool,
    /// Model used for summaries; `None` = the conversation's own model.
    pub summary_model: Option<String>,
    /// Base URL of a separate summary endpoint; `None` = the proxy's upstream.
    pub summary_endpoint: Option<String>,
    /// Bearer key for the summary endpoint; `None` = the client's own
    /// credentials. Never printed by `Debug`.
    pub summary_api_key: Option<String>,
    /// Hard ceiling of one summary call in seconds.
    pub summary_timeout_secs: u64,
    /// Ask a summary after the conversation itself when it goes to the
    /// conversation's own upstream and model and fits the window, so the
    /// upstream's prompt cache serves all but the ask (chat completions).
    pub summary_in_context: bool,
    /// Batch or micro compaction.
    pub strategy: Strategy,
    /// Charge reasoning of every assistant turn (not only the newest) in estimates.
    pub charge_stale_thinking: bool,
    /// Micro strategy: run on every Nth turn (1 = every turn).
    pub micro_every_n_turns: u32,
    /// Pre-compaction: summarise in the background once a conversation
    /// passes `background_threshold_percent` of the trigger, so the turn
    /// that crosses it commits the result instead of waiting for a summary.
    /// Off by default: on a single-slot server (llama.cpp `-np 1`) the
    /// background summary occupies the slot the conversation's own turns
    /// need, so each turn waits for it instead.
    pub background: bool,
    /// Where pre-compaction starts, in percent of the trigger threshold.
    pub background_threshold_percent: f64,
    /// Background summaries running at once, across all conversations.
    pub background_max_concurrent: usize,
    /// Where a compaction aims: the fixed part (instructions and tools)
    /// plus this share of the room between it and the trigger.
    pub target_ratio: f64,
    /// Keep the user's own messages of the replaced part verbatim next to
    /// the summary (within a budget sized to the window): a summary, above
    /// all a small model's, loses or paraphrases what the user said.
    pub keep_user_messages: bool,
}

impl std::fmt::Debug for CompactionConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CompactionConfig")
            .field("threshold_percent", &self.threshold_percent)
            .field("threshold_tokens", &self.threshold_tokens)
            .field("protect_first_n", &self.protect_first_n)
            .field("protect_last_n", &self.protect_last_n)
            .field("min_tail_user_messages", &self.min_tail_user_messages)
            .field("summary_target_ratio", &self.summary_target_ratio)
            .field("model_thresholds", &self.model_thresholds)
            .field("abort_on_summary_failure", &self.abort_on_summary_failure)
            .field("abort_on_degraded_summary", &self.abort_on_degraded_summary)
            .field("summary_model", &self.summary_model)
            .field("summary_endpoint", &self.summary_endpoint)
            .field(
                "summary_api_key",
                &self.summary_api_key.as_ref().map(|_| "<redacted>"),
            )
            .field("summary_timeout_secs", &self.summary_timeout_secs)
            .field("summary_in_context", &self.summary_in_context)
            .field("strategy", &self.strategy)
            .field("charge_stale_thinking", &self.charge_stale_thinking)
            .field("micro_every_n_turns", &self.micro_every_n_turns)
            .field("background", &self.background)
            .field(
                "background_threshold_percent",
                &self.background_threshold_percent,
            )
            .field("background_max_concurrent", &self.background_max_concurrent)
            .finish()
    }
}

impl Default for CompactionConfig {
    fn default() -> Self {
        Self {
            threshold_percent: DEFAULT_THRESHOLD_PERCENT,
            threshold_tokens: None,
            protect_first_n: DEFAULT_PROTECT_FIRST_N,
            protect_last_n: DEFAULT_PROTECT_LAST_N,
            min_tail_user_messages: 1,
            summary_target_ratio: DEFAULT_SUMMARY_TARGET_RATIO,
            model_thresholds: BTreeMap::new(),
            abort_on_summary_failure: false,
            abort_on_degraded_summary: false,
            summary_model: None,
            summary_endpoint: None,
            summary_api_key: None,
            summary_timeout_secs: DEFAULT_SUMMARY_TIMEOUT_SECS,
            summary_in_context: true,
            strategy: Strategy::Batch,
            charge_stale_thinking: tokens::DEFAULT_CHARGE_STALE_THINKING,
            micro_every_n_turns: 1,
            background: false,
            background_threshold_percent: 80.0,
            background_max_concurrent: 2,
            target_ratio: DEFAULT_TARGET_RATIO,
            keep_user_messages: true,
        }
    }
}

impl CompactionConfig {
    /// Build from the raw `[compaction]` table of `proxy.toml` (missing keys
    /// take their defaults; unknown keys and wrong types are errors naming
    /// the key), then check the values that have no safe reading.
    pub fn from_table(table: &toml::Table) -> Result<Self, InvalidSetting> {
        let parse = |t: toml::Table| -> Result<CompactionConfig, toml::de::Error> {
            toml::Value::Table(t).try_into()
        };
        let cfg = match parse(table.clone()) {
            Ok(cfg) => cfg,
            Err(e) => {
                // Type errors from a `Value` carry no key; find the culprit
                // by parsing one key at a time so the message names it.
                let culprit = table.iter().find_map(|(k, v)| {
                    let mut one = toml::Table::new();
                    one.insert(k.clone(), v.clone());
                    parse(one).err().map(|e| (k.clone(), e))
                });
                return Err(match culprit {
                    Some((k, e)) => InvalidSetting::new(&k, e.message().trim()),
                    None => InvalidSetting {
                        key: None,
                        message: e.message().trim().to_owned(),
                    },
                });
            }
        };
        cfg.validate()?;
        Ok(cfg)
    }

    /// Reject values the engine cannot interpret. Out-of-range ratios are
    /// clamped by the accessors instead.
    pub(crate) fn validate(&self) -> Result<(), InvalidSetting> {
        let pct_ok = |p: f64| p.is_finite() && p > 0.0 && p <= 100.0;
        if !pct_ok(self.threshold_percent) {
            return Err(InvalidSetting::new(
                "threshold_percent",
                format!(
                    "must be in (0, 1], or (1, 100] as a percentage; got {}",
                    self.threshold_percent
                ),
            ));
        }
        if let Some((k, v)) = self.model_thresholds.iter().find(|(_, &v)| !pct_ok(v)) {
            return Err(InvalidSetting::new(
                &format!("model_thresholds.\"{k}\""),
                format!("must be in (0, 1], or (1, 100] as a percentage; got {v}"),
            ));
        }
        if self.summary_timeout_secs == 0 {
            return Err(InvalidSetting::new(
                "summary_timeout_secs",
                "must be positive",
            ));
        }
        let bg = self.background_threshold_percent;
        if !(bg.is_finite() && bg > 0.0 && bg < 100.0) {
            return Err(InvalidSetting::new(
                "background_threshold_percent",
                format!("must be in (0, 100) (percent of the trigger); got {bg}"),
            ));
        }
        if self.background_max_concurrent == 0 {
            return Err(InvalidSetting::new(
                "background_max_concurrent",
                "must be at least 1",
            ));
        }
        let t = self.target_ratio;
        if !(t.is_finite() && t > 0.0 && t < 1.0) {
            return Err(InvalidSetting::new(
                "target_ratio",
                format!("must be in (0, 1) (share of the room under the trigger); got {t}"),
            ));
        }
        if self.micro_every_n_turns == 0 {
            return Err(InvalidSetting::new(
                "micro_every_n_turns",
                "must be at least 1",
            ));
        }
        Ok(())
    }

    /// `summary_target_ratio` clamped to [0.10, 0.80]; a non-finite value means the default.
    pub(crate) fn effective_summary_target_ratio(&self) -> f64 {
        clamp_ratio(self.summary_target_ratio)
    }

    /// `threshold_percent` made usable: non-finite or ≤ 0 means the default,
    /// above 1 means 1 (the trigger math keeps the result below the window).
    // Only tests use it: the engine's, and the proxy's through the
    // `test-util` feature.
    #[cfg(any(test, feature = "test-util"))]
    #[doc(hidden)]
    pub fn effective_threshold_percent(&self) -> f64 {
        sanitize_percent(self.threshold_percent)
    }

    /// The absolute cap, `None` when disabled.
    pub(crate) fn threshold_tokens_cap(&self) -> Option<u64> {
        self.threshold_tokens.filter(|&c| c > 0)
    }
}

/// Clamp a summary ratio to [0.10, 0.80]: outside it the tail either
/// vanishes or leaves nothing to summarise.
pub(crate) fn clamp_ratio(r: f64) -> f64 {
    if !r.is_finite() {
        return DEFAULT_SUMMARY_TARGET_RATIO;
    }
    r.clamp(MIN_SUMMARY_TARGET_RATIO, MAX_SUMMARY_TARGET_RATIO)
}

/// Make a threshold percent usable by the trigger math: values in (1, 100]
/// are percentages (`75` → 0.75), larger ones mean 1; non-finite or ≤ 0
/// means the default.
pub(crate) fn sanitize_percent(p: f64) -> f64 {
    if !p.is_finite() || p <= 0.0 {
        DEFAULT_THRESHOLD_PERCENT
    } else if p <= 1.0 {
        p
    } else if p <= 100.0 {
        p / 100.0
    } else {
        1.0
    }
}

/// Accept any TOML scalar for the cap; only a positive number enables it.
/// Zero, negative and non-numeric caps mean "no cap"
/// rather than failing, so a typo never disables compaction altogether.
fn de_positive_cap<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Raw {
        Int(i64),
        Float(f64),
        Str(String),
        Other(serde::de::IgnoredAny),
    }
    let raw = Option::<Raw>::deserialize(d)?;
    Ok(match raw {
        Some(Raw::Int(i)) if i > 0 => Some(i as u64),
        Some(Raw::Float(f)) if f.is_finite() && f >= 1.0 => Some(f.floor() as u64),
        Some(Raw::Str(s)) => s
            .trim()
            .parse::<i64>()
            .ok()
            .filter(|&i| i > 0)
            .map(|i| i as u64),
        _ => None,
    })
}

#[cfg(test)]
mod tests;
