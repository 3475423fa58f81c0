//! `[compaction]` from TOML and from proxy.toml's table: defaults, the
//! percent scale, errors that name the key, the redacted key.

use super::*;
use crate::budget::Budgets;

fn toml_cfg(src: &str) -> CompactionConfig {
    toml::from_str(src).unwrap()
}

#[test]
fn config_toml_defaults_and_unknown_keys() {
    let c = toml_cfg("");
    assert_eq!(c.threshold_percent, 0.50);
    assert_eq!(c.protect_first_n, 3);
    assert_eq!(c.protect_last_n, 20);
    assert_eq!(c.min_tail_user_messages, 1);
    assert_eq!(c.summary_target_ratio, 0.20);
    assert!(!c.abort_on_summary_failure);
    assert_eq!(c.strategy, Strategy::Batch);
    assert!(c.charge_stale_thinking);
    let c = toml_cfg(
        "strategy = \"micro\"\nsummary_target_ratio = 0.95\n[model_thresholds]\n\"qwen2.5:7b\" = 0.8\n",
    );
    assert_eq!(c.strategy, Strategy::Micro);
    assert_eq!(c.effective_summary_target_ratio(), 0.80);
    assert_eq!(c.model_thresholds.get("qwen2.5:7b"), Some(&0.8));
    assert!(toml::from_str::<CompactionConfig>("bogus = 1").is_err());
}

// ---------------------------------------------------------------- config from proxy.toml

fn table(src: &str) -> toml::Table {
    toml::from_str(src).unwrap()
}

#[test]
fn from_table_defaults_and_percent_scale() {
    let c = CompactionConfig::from_table(&toml::Table::new()).unwrap();
    assert_eq!(c.threshold_percent, 0.50);
    assert_eq!(c.summary_timeout_secs, 600);
    assert_eq!(c.micro_every_n_turns, 1);
    // `75` (integer percent, as a user may write it) means 0.75.
    let c = CompactionConfig::from_table(&table(
        "threshold_percent = 75\nstrategy = \"micro\"\n[model_thresholds]\nbig = 90\n",
    ))
    .unwrap();
    assert_eq!(c.effective_threshold_percent(), 0.75);
    let b = Budgets::compute(&c, "m", 1_000_000, None);
    assert_eq!(b.threshold_tokens, 750_000);
    let b = Budgets::compute(&c, "big-one", 1_000_000, None);
    assert_eq!(b.threshold_tokens, 900_000);
}

#[test]
fn from_table_errors_name_the_key() {
    for (src, key) in [
        ("threshold_percent = \"x\"", "threshold_percent"),
        ("bogus = 1", "bogus"),
        // Knobs the proxy has no use for are refused, not ignored: a typo'd
        // or foreign setting must not pass silently.
        ("max_attempts = 3", "max_attempts"),
        (
            "summary_idle_timeout_secs = 60",
            "summary_idle_timeout_secs",
        ),
        ("protect_first_n = -1", "protect_first_n"),
        ("strategy = \"sometimes\"", "strategy"),
        ("threshold_percent = 0", "threshold_percent"),
        ("threshold_percent = 150", "threshold_percent"),
        ("summary_timeout_secs = 0", "summary_timeout_secs"),
        ("micro_every_n_turns = 0", "micro_every_n_turns"),
    ] {
        let err = CompactionConfig::from_table(&table(src)).unwrap_err();
        assert_eq!(err.key.as_deref(), Some(key), "{src}: {err}");
        assert!(
            err.to_string().contains(&format!("compaction.{key}")),
            "{err}"
        );
    }
    let err = CompactionConfig::from_table(&table("[model_thresholds]\nx = -1\n")).unwrap_err();
    assert_eq!(err.key.as_deref(), Some("model_thresholds.\"x\""));
}

#[test]
fn config_debug_never_prints_summary_key() {
    let c = CompactionConfig::from_table(&table(
        "summary_api_key = \"sk-very-secret\"\nsummary_endpoint = \"http://127.0.0.1:9\"",
    ))
    .unwrap();
    assert_eq!(c.summary_api_key.as_deref(), Some("sk-very-secret"));
    let dbg = format!("{c:?}");
    assert!(!dbg.contains("sk-very-secret"), "{dbg}");
    assert!(dbg.contains("<redacted>"));
    assert!(dbg.contains("http://127.0.0.1:9"));
}
