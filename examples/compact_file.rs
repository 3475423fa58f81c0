//! Runs the engine once over a request body from a file and prints what it
//! did (content-free), for diagnosing compaction on real conversations:
//! `cargo run --example compact_file -- body.json 2048`
use std::sync::Arc;

use compactor::compaction::{
    estimate_msg_budget_tokens, CompactionConfig, CompressOptions, Compressor, Summariser,
    SummaryError, SummaryErrorKind, SummaryReply, SummaryRequest, Trigger, WindowSource,
};
use serde_json::Value;

struct Failing;

#[async_trait::async_trait]
impl Summariser for Failing {
    async fn summarise(&self, _req: SummaryRequest) -> Result<SummaryReply, SummaryError> {
        Err(SummaryError::new(
            SummaryErrorKind::Http,
            Some(500),
            "stub failure",
        ))
    }
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let body: Value = serde_json::from_slice(&std::fs::read(&args[1])?)?;
    let window: u64 = args.get(2).map(|s| s.parse()).transpose()?.unwrap_or(2048);
    let msgs = body["messages"].as_array().cloned().unwrap_or_default();
    let cfg = Arc::new(CompactionConfig::default());
    let trigger = Trigger::new(cfg.clone(), "m", WindowSource::Known(window), Some(16));
    let mut c = Compressor::new(cfg, trigger);
    println!(
        "threshold {} tail budget {} max summary {}",
        c.trigger_mut().threshold_tokens(),
        c.trigger_mut().tail_token_budget(),
        c.trigger_mut().max_summary_tokens()
    );
    let r = c
        .compress(&msgs, &Failing, CompressOptions::default())
        .await;
    println!(
        "outcome {:?} fallback {} before {} after {} msgs {} -> {} kept_suffix {}",
        r.outcome(),
        r.fallback_used(),
        r.tokens_before(),
        r.tokens_after(),
        msgs.len(),
        r.messages().len(),
        r.kept_suffix()
    );
    for m in r.messages() {
        let len = serde_json::to_string(m)?.len();
        let tokens = estimate_msg_budget_tokens(m, true);
        println!(
            "  {:9} {:6} chars {:5} tokens",
            m["role"].as_str().unwrap_or("?"),
            len,
            tokens
        );
    }
    Ok(())
}
