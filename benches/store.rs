//! What a turn costs with each store backend, per part of the record path:
//! - passthrough: the history misses in memory and `may_have` says the
//!   store cannot hold a match (no store call);
//! - substitution: the record is found in memory (plus the store's `touch`);
//! - cold lookup: a memory miss read through from redb (after a restart:
//!   once per conversation), on the blocking pool.
//!
//! `cargo bench --bench store`

// Test code: a failed unwrap is a failed test. clippy.toml allows that in
// #[test] functions only, not in the helpers they share.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::hint::black_box;
use std::sync::Arc;
use std::time::Duration;

use compactor::chat::record::{Record, RecordStore};
use compactor::store::redb::RedbStore;
use compactor::store::{Memory, StoreHandle, StoredRecord};
use criterion::{criterion_group, criterion_main, Criterion};
use serde_json::value::RawValue;

const HISTORY: usize = 200;
const K: usize = 150;

fn replacement() -> Vec<String> {
    (0..10)
        .map(|i| {
            serde_json::json!({"role":"user","content":format!("summary {i} ").repeat(50)})
                .to_string()
        })
        .collect()
}

fn bench_turns(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let hashes: Vec<u128> = (1..=HISTORY as u128).collect();
    let ttl = Duration::from_secs(3600);
    let dir = tempfile::tempdir().unwrap();
    let redb = Arc::new(RedbStore::open(&dir.path().join("s.redb"), ttl, 256 << 20).unwrap());
    let stored = StoredRecord {
        k: K,
        prefix_hash: hashes[K - 1],
        replacement: replacement(),
        original_tokens: 10_000,
        replacement_tokens: 1_000,
        summary_rows: None,
    };
    rt.block_on(async {
        use compactor::store::Store;
        redb.put(1, stored.clone()).await.unwrap();
    });
    let mem = StoreHandle::new(Arc::new(Memory), Duration::from_secs(1));
    let disk = StoreHandle::new(redb, Duration::from_secs(1));

    let mut g = c.benchmark_group("turn");
    // Passthrough: nothing in memory, and the store holds no record as
    // short as this history (credential 2's fresh conversation of 100).
    let empty = RecordStore::new(ttl, 10_000);
    for (name, h) in [("memory", &mem), ("redb", &disk)] {
        g.bench_function(format!("passthrough/{name}"), |b| {
            b.iter(|| {
                let hit = empty.lookup(2, black_box(&hashes[..100]), None);
                black_box(hit.is_none() && !h.may_have(100))
            });
        });
    }
    // Substitution: the record is in memory.
    let hot = RecordStore::new(ttl, 10_000);
    let raw: Vec<Box<RawValue>> = stored
        .replacement
        .iter()
        .map(|s| RawValue::from_string(s.clone()).unwrap())
        .collect();
    hot.insert(1, Record::new(K, hashes[K - 1], raw, 10_000, 1_000));
    for (name, h) in [("memory", &mem), ("redb", &disk)] {
        g.bench_function(format!("substitution/{name}"), |b| {
            b.iter(|| {
                let rec = hot.lookup(1, black_box(&hashes), None).unwrap();
                h.touch(1, rec.prefix_hash);
                black_box(rec.k)
            });
        });
    }
    // Cold lookup: read through from redb.
    g.bench_function("cold_lookup/redb", |b| {
        b.iter(|| rt.block_on(async { black_box(disk.find(1, &hashes).await.unwrap().k) }));
    });
    g.finish();
}

criterion_group!(benches, bench_turns);
criterion_main!(benches);
