//! Micro-benchmarks of the state building blocks: SSE usage scanning and
//! usage hiding throughput, the message hash chain, the calibrated
//! estimate of a growing conversation, eviction from full stores of two
//! sizes, and the admin token comparison.
//!
//! `cargo bench --bench state`; the timing comparisons the unit tests do
//! not make (they count the work instead) are `eviction_by_size` (a new
//! session or record in a full store of 512 vs 16,384: O(log n) keeps them
//! close, a scan would make the larger ~32x) and `admin_token` (a 256 KiB
//! secret against a presented token of equal length, one byte longer, and
//! differing in the first or the last byte: all alike).

// Test code: a failed unwrap is a failed test. clippy.toml allows that in
// #[test] functions only, not in the helpers they share.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::hint::black_box;

use bytes::BytesMut;
use compactor::chat::record::{Record, RecordStore};
use compactor::request::{message_hashes, ChainCache, ChatRequest};
use compactor::server::admin::tokens_match;
use compactor::session::calibration::Calibration;
use compactor::session::store::{SessionStore, StoreLimits};
use compactor::session::SessionKey;
use compactor::usage::hide::UsageHider;
use compactor::usage::{BodyKind, UsageExtractor};
use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use serde_json::value::RawValue;

/// An OpenAI-shaped stream with include_usage: `n` content chunks.
fn stream(n: usize) -> Vec<u8> {
    let mut s = String::new();
    for i in 0..n {
        s.push_str(&format!(
            "data: {{\"id\":\"chatcmpl-123\",\"object\":\"chat.completion.chunk\",\"created\":1694268190,\"model\":\"gpt-4o-mini\",\"system_fingerprint\":\"fp_44709d6fcb\",\"choices\":[{{\"index\":0,\"delta\":{{\"content\":\"token{i} \"}},\"logprobs\":null,\"finish_reason\":null}}],\"usage\":null,\"obfuscation\":\"r4N7vQ2m\"}}\n\n"
        ));
    }
    s.push_str("data: {\"id\":\"chatcmpl-123\",\"object\":\"chat.completion.chunk\",\"created\":1694268190,\"model\":\"gpt-4o-mini\",\"choices\":[],\"usage\":{\"prompt_tokens\":9,\"completion_tokens\":12,\"total_tokens\":21}}\n\ndata: [DONE]\n\n");
    s.into_bytes()
}

fn conversation(n: usize) -> Vec<Box<RawValue>> {
    (0..n)
        .map(|i| {
            let role = if i % 2 == 0 { "user" } else { "assistant" };
            let text = format!("message {i} ").repeat(20);
            RawValue::from_string(serde_json::json!({"role": role, "content": text}).to_string())
                .unwrap()
        })
        .collect()
}

fn bench_sse(c: &mut Criterion) {
    let s = stream(2000);
    let mut g = c.benchmark_group("sse");
    g.throughput(Throughput::Bytes(s.len() as u64));
    g.bench_function("usage_scan_16k_frames", |b| {
        b.iter(|| {
            let mut e = UsageExtractor::new(BodyKind::Sse);
            for f in s.chunks(16 * 1024) {
                e.feed(black_box(f));
            }
            e.finish();
            black_box(e.report())
        })
    });
    g.bench_function("usage_scan_64b_frames", |b| {
        b.iter(|| {
            let mut e = UsageExtractor::new(BodyKind::Sse);
            for f in s.chunks(64) {
                e.feed(black_box(f));
            }
            e.finish();
            black_box(e.report())
        })
    });
    g.bench_function("hide_usage_16k_frames", |b| {
        b.iter(|| {
            let mut h = UsageHider::new();
            let mut out = BytesMut::with_capacity(s.len());
            for f in s.chunks(16 * 1024) {
                h.push(black_box(f), &mut out);
            }
            h.finish(&mut out);
            black_box(out.len())
        })
    });
    g.finish();
}

fn bench_hashes(c: &mut Criterion) {
    let conv = conversation(1000);
    let bytes: usize = conv.iter().map(|m| m.get().len()).sum();
    let mut g = c.benchmark_group("hash_chain");
    g.throughput(Throughput::Bytes(bytes as u64));
    g.bench_function("1000_messages", |b| {
        b.iter(|| black_box(message_hashes(black_box(&conv))))
    });
    // The usual turn: 1,000 messages resent byte for byte plus two new ones.
    let next = conversation(1002);
    g.bench_function("cached_1000_plus_2", |b| {
        b.iter_batched(
            || {
                let mut cache = ChainCache::new();
                cache.chain(&conv);
                cache
            },
            |mut cache| black_box(cache.chain(black_box(&next)).len()),
            criterion::BatchSize::SmallInput,
        )
    });
    g.finish();

    let body = serde_json::json!({"model": "m", "stream": true, "messages": conv}).to_string();
    c.bench_function("request/parse_1000_messages", |b| {
        b.iter(|| black_box(ChatRequest::parse(black_box(body.clone().into_bytes())).unwrap()))
    });

    // A turn that extends a 1,000-message conversation by two messages.
    let longer = conversation(1002);
    let h1000 = message_hashes(&conv);
    let h1002 = message_hashes(&longer);
    let est = |m: &RawValue| m.get().len() as u64 / 4;
    c.bench_function("calibration/estimate_extension_1000", |b| {
        b.iter_batched(
            || {
                let mut cal = Calibration::new();
                let e = cal.estimate(&conv, h1000.clone(), 0, est);
                cal.observe(e.sent, 50_000);
                // The chain is the caller's to hand over, made before.
                (cal, h1002.clone())
            },
            |(mut cal, h1002)| black_box(cal.estimate(&longer, h1002, 0, est).tokens),
            criterion::BatchSize::SmallInput,
        )
    });
}

/// A full store of 10,000 sessions: a request for a known session against
/// one for a new session (which evicts the least recently used one).
fn bench_stores(c: &mut Criterion) {
    const N: u128 = 10_000;
    let mut g = c.benchmark_group("session_store_10k");
    let store: SessionStore<u64> = SessionStore::new(StoreLimits {
        ttl: std::time::Duration::from_secs(3600),
        max_sessions: N as usize,
    });
    for i in 0..N {
        store.get_or_create(SessionKey::from_u128(i), || 0);
    }
    let mut next = N;
    g.bench_function("insert_when_full", |b| {
        b.iter(|| {
            next += 1;
            black_box(store.get_or_create(SessionKey::from_u128(next), || 0))
        })
    });
    let mut i = 0u128;
    g.bench_function("lookup_known", |b| {
        b.iter(|| {
            // Known keys: the newest 10,000 inserted above.
            i = (i + 1) % N;
            black_box(store.get_or_create(SessionKey::from_u128(next - i), || 0))
        })
    });
    g.finish();

    let mut g = c.benchmark_group("record_store_10k");
    let records = RecordStore::new(std::time::Duration::from_secs(3600), N as usize);
    for h in 0..N {
        records.insert(1, Record::new(1, h, Vec::new(), 0, 0));
    }
    let mut next = N;
    g.bench_function("insert_when_full", |b| {
        b.iter(|| {
            next += 1;
            black_box(records.insert(1, Record::new(1, next, Vec::new(), 0, 0)))
        })
    });
    let mut i = 0u128;
    g.bench_function("lookup_known", |b| {
        b.iter(|| {
            i = (i + 1) % N;
            black_box(records.lookup(1, &[next - i], None))
        })
    });
    g.finish();
}

/// A new session / record in full stores of two sizes.
fn bench_eviction_by_size(c: &mut Criterion) {
    let mut g = c.benchmark_group("eviction_by_size");
    for size in [512u128, 16_384] {
        let store: SessionStore<u64> = SessionStore::new(StoreLimits {
            ttl: std::time::Duration::from_secs(3600),
            max_sessions: size as usize,
        });
        for i in 0..size {
            store.get_or_create(SessionKey::from_u128(i), || 0);
        }
        let mut next = size;
        g.bench_function(format!("session_insert_when_full/{size}"), |b| {
            b.iter(|| {
                next += 1;
                black_box(store.get_or_create(SessionKey::from_u128(next), || 0))
            })
        });
        let records = RecordStore::new(std::time::Duration::from_secs(3600), size as usize);
        for h in 0..size {
            records.insert(1, Record::new(1, h, Vec::new(), 0, 0));
        }
        let mut next = size;
        g.bench_function(format!("record_insert_when_full/{size}"), |b| {
            b.iter(|| {
                next += 1;
                black_box(records.insert(1, Record::new(1, next, Vec::new(), 0, 0)))
            })
        });
    }
    g.finish();
}

/// The admin token comparison: neither length nor the first differing
/// byte should change its cost.
fn bench_admin_token(c: &mut Criterion) {
    let secret = vec![b'a'; 256 * 1024];
    let equal = secret.clone();
    let mut first = secret.clone();
    first[0] = b'b';
    let mut last = secret.clone();
    *last.last_mut().unwrap() = b'b';
    let longer = [secret.as_slice(), b"a"].concat();
    let mut g = c.benchmark_group("admin_token");
    for (name, presented) in [
        ("equal", &equal),
        ("differs_first_byte", &first),
        ("differs_last_byte", &last),
        ("one_byte_longer", &longer),
    ] {
        g.bench_function(name, |b| {
            b.iter(|| black_box(tokens_match(black_box(presented), &secret)))
        });
    }
    g.finish();
}

criterion_group!(
    benches,
    bench_sse,
    bench_hashes,
    bench_stores,
    bench_eviction_by_size,
    bench_admin_token
);
criterion_main!(benches);
