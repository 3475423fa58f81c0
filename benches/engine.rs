//! Engine benchmarks: the per-request decision when nothing needs compacting
//! (estimate + trigger check) and a full batch compaction with a stub
//! summariser, on 10 / 100 / 1,000 / 5,000 messages; and the two rough
//! estimates of 1,000 messages (`estimate_1000`: the wire-size estimate
//! against the per-message budget walk).

use std::hint::black_box;
use std::sync::Arc;

use compactor::compaction::{
    estimate_messages_tokens_rough, estimate_msg_budget_tokens, estimate_request_tokens_rough,
    CompactionConfig, CompressOptions, Compressor, Summariser, SummaryError, SummaryReply,
    SummaryRequest, Trigger, WindowSource,
};
use criterion::{criterion_group, criterion_main, BatchSize, BenchmarkId, Criterion};
use serde_json::{json, Value};

struct Instant;

#[async_trait::async_trait]
impl Summariser for Instant {
    async fn summarise(&self, _req: SummaryRequest) -> Result<SummaryReply, SummaryError> {
        Ok(SummaryReply::text(
            "## Historical Task Snapshot\nchecked the files\n\n## Completed Actions\n1. READ src — fine",
        ))
    }
}

/// A tool-using conversation of exactly `n` messages.
fn conversation(n: usize) -> Vec<Value> {
    let mut v = vec![json!({"role": "system", "content": "You are a coding assistant."})];
    let mut i = 0;
    while v.len() < n {
        let id = format!("call_{i}");
        v.push(json!({"role": "user", "content": format!("step {i}: check src/mod{i}.rs and report problems")}));
        v.push(json!({"role": "assistant", "content": null, "tool_calls": [{"id": id, "type": "function",
            "function": {"name": "read_file", "arguments": format!("{{\"path\":\"src/mod{i}.rs\"}}")}}]}));
        v.push(json!({"role": "tool", "tool_call_id": id, "content": format!("fn f{i}() {{ {} }}", "let x = 1; ".repeat(40))}));
        v.push(json!({"role": "assistant", "content": format!("src/mod{i}.rs looks fine; f{i} needs no change.")}));
        i += 1;
    }
    v.truncate(n);
    if v.last()
        .is_some_and(|m| m["role"] == "assistant" && m.get("tool_calls").is_some())
    {
        v.pop();
    }
    v
}

fn compressor(window: u64) -> Compressor {
    let cfg = Arc::new(CompactionConfig::default());
    let t = Trigger::new(
        cfg.clone(),
        "bench-model",
        WindowSource::Known(window),
        Some(4_096),
    );
    Compressor::new(cfg, t)
}

fn bench(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .expect("a current-thread runtime builds");
    let sizes = [10usize, 100, 1_000, 5_000];

    let mut g = c.benchmark_group("decision_no_compaction");
    for &n in &sizes {
        let msgs = conversation(n);
        let mut comp = compressor(10_000_000);
        g.bench_with_input(BenchmarkId::from_parameter(n), &msgs, |b, msgs| {
            b.iter(|| {
                let est = estimate_request_tokens_rough(black_box(msgs), None);
                let fire = comp.trigger_mut().should_compress(Some(est as i64));
                black_box((est, fire))
            })
        });
    }
    g.finish();

    let mut g = c.benchmark_group("compaction_stub_summariser");
    g.sample_size(10);
    for &n in &sizes {
        let msgs = conversation(n);
        let est = estimate_request_tokens_rough(&msgs, None);
        g.bench_with_input(BenchmarkId::from_parameter(n), &msgs, |b, msgs| {
            b.iter_batched(
                || {
                    let mut comp = compressor(1_000_000);
                    comp.trigger_mut()
                        .set_threshold_tokens(est.saturating_sub(1).max(1));
                    comp
                },
                |mut comp| {
                    let res =
                        rt.block_on(comp.compress(msgs, &Instant, CompressOptions::default()));
                    black_box(res.messages().len())
                },
                BatchSize::SmallInput,
            )
        });
    }
    g.finish();
}

/// 1,000 messages of a tool-using conversation with long texts.
fn estimate_input() -> Vec<Value> {
    (0..1_000)
        .map(|i| match i % 3 {
            0 => json!({"role": "user", "content": format!("question {i} {}", "word ".repeat(100))}),
            1 => json!({"role": "assistant", "content": "calling", "tool_calls": [
                {"id": format!("c{i}"), "type": "function",
                 "function": {"name": "read_file", "arguments": format!("{{\"path\":\"/src/f{i}.rs\"}}")}}]}),
            _ => json!({"role": "tool", "tool_call_id": format!("c{}", i - 1), "content": "line of output\n".repeat(60)}),
        })
        .collect()
}

fn bench_estimates(c: &mut Criterion) {
    let msgs = estimate_input();
    let mut g = c.benchmark_group("estimate_1000");
    g.bench_function("wire", |b| {
        b.iter(|| black_box(estimate_messages_tokens_rough(black_box(&msgs))))
    });
    g.bench_function("budget_walk", |b| {
        b.iter(|| {
            black_box(
                msgs.iter()
                    .map(|m| estimate_msg_budget_tokens(m, true))
                    .sum::<u64>(),
            )
        })
    });
    g.finish();
}

criterion_group!(benches, bench, bench_estimates);
criterion_main!(benches);
