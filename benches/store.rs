//! What a turn costs with each store backend, per part of the record path:
//! - passthrough: the history misses in memory and `may_have` says the
//!   store cannot hold a match (no store call);
//! - substitution: the record is found in memory (plus the store's `touch`);
//! - cold lookup: a memory miss read through from the state file (after a restart:
//!   once per conversation), on the blocking pool, or from Redis on
//!   loopback (also the look-up a replica makes before it compacts);
//! - write: a record put (in the background, after a compaction).
//!
//! The Redis figures need `redis-server` (`scripts/install_prereqs.sh`);
//! the bench starts its own on a free loopback port.
//!
//! `cargo bench --bench store`

// Test code: a failed unwrap is a failed test. clippy.toml allows that in
// #[test] functions only, not in the helpers they share.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::hint::black_box;
use std::sync::Arc;
use std::time::Duration;

use compactor::chat::record::{Record, RecordStore};
use compactor::store::file::FileStore;
use compactor::store::redis::RedisStore;
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

/// A `redis-server` of the bench's own, killed on drop.
struct Redis(std::process::Child, u16);

impl Redis {
    fn start() -> Self {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let child = std::process::Command::new("redis-server")
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no"])
            .stdout(std::process::Stdio::null())
            .spawn()
            .expect("redis-server (install it with scripts/install_prereqs.sh)");
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            std::thread::sleep(Duration::from_millis(20));
        }
        Self(child, port)
    }
}

impl Drop for Redis {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[allow(clippy::too_many_lines)] // one bench group, one backend after the other
fn bench_turns(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let hashes: Vec<u128> = (1..=HISTORY as u128).collect();
    let ttl = Duration::from_secs(3600);
    let dir = tempfile::tempdir().unwrap();
    let file = Arc::new(FileStore::open(&dir.path().join("state.log"), ttl, 256 << 20).unwrap());
    let stored = StoredRecord {
        k: K,
        prefix_hash: hashes[K - 1],
        replacement: replacement(),
        original_tokens: 10_000,
        replacement_tokens: 1_000,
        summary_rows: None,
    };
    let server = Redis::start();
    let url = format!("redis://127.0.0.1:{}/0", server.1);
    let redis = Arc::new(RedisStore::open(&url, ttl, 256 << 20).unwrap());
    rt.block_on(async {
        use compactor::store::Store;
        file.put(1, stored.clone()).await.unwrap();
        redis.put(1, stored.clone()).await.unwrap();
    });
    let mem = StoreHandle::new(Arc::new(Memory), Duration::from_secs(1));
    let disk = StoreHandle::new(file, Duration::from_secs(1));
    let shared = StoreHandle::new(redis, Duration::from_secs(1));

    let mut g = c.benchmark_group("turn");
    // Passthrough: nothing in memory, and the store holds no record as
    // short as this history (credential 2's fresh conversation of 100).
    let empty = RecordStore::new(ttl, 10_000);
    let backends = [("memory", &mem), ("file", &disk), ("redis", &shared)];
    for (name, h) in backends {
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
    for (name, h) in backends {
        g.bench_function(format!("substitution/{name}"), |b| {
            b.iter(|| {
                let rec = hot.lookup(1, black_box(&hashes), None).unwrap();
                h.touch(1, rec.prefix_hash);
                black_box(rec.k)
            });
        });
    }
    // Cold lookup: read through from the store.
    for (name, h) in [("file", &disk), ("redis", &shared)] {
        g.bench_function(format!("cold_lookup/{name}"), |b| {
            b.iter(|| rt.block_on(async { black_box(h.find(1, &hashes).await.unwrap().k) }));
        });
    }
    // A record write (after a compaction, off the request path).
    for (name, h) in [("file", &disk), ("redis", &shared)] {
        g.bench_function(format!("write/{name}"), |b| {
            b.iter(|| rt.block_on(h.put(1, stored.clone())));
        });
    }
    g.finish();
    drop(server);
}

criterion_group!(benches, bench_turns);
criterion_main!(benches);
