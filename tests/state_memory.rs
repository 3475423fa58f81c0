//! Measures the heap cost of idle sessions with a counting allocator.
//! Run with `cargo test --test state_memory -- --nocapture` to see numbers.

// A counting global allocator cannot be written without `unsafe impl
// GlobalAlloc`; it only forwards to `System`. The crate itself stays free of
// unsafe code (`unsafe_code = "deny"` in Cargo.toml).
#![allow(unsafe_code)]

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicIsize, Ordering};
use std::time::Duration;

use compactor::request::message_hashes;
use compactor::session::calibration::Calibration;
use compactor::session::{SessionKey, SessionStore, StoreLimits};
use serde_json::value::RawValue;

struct Counting;

static LIVE: AtomicIsize = AtomicIsize::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        LIVE.fetch_add(layout.size() as isize, Ordering::Relaxed);
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size() as isize, Ordering::Relaxed);
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        LIVE.fetch_add(
            new_size as isize - layout.size() as isize,
            Ordering::Relaxed,
        );
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

const N: usize = 10_000;

fn limits() -> StoreLimits {
    StoreLimits {
        ttl: Duration::from_secs(3600),
        max_sessions: N * 2,
    }
}

fn per_session<T>(make: impl Fn(usize) -> T) -> (f64, SessionStore<T>) {
    let before = LIVE.load(Ordering::Relaxed);
    let store = SessionStore::new(limits());
    for i in 0..N {
        let state = make(i);
        store.get_or_create(SessionKey::from_u128(i as u128 * 7919 + 1), || state);
    }
    let after = LIVE.load(Ordering::Relaxed);
    ((after - before) as f64 / N as f64, store)
}

#[tokio::test(flavor = "current_thread")]
async fn bytes_per_idle_session() {
    // Store overhead alone (unit state).
    let (unit, s1) = per_session(|_| ());
    drop(s1);
    // An uncalibrated session.
    let (empty_cal, s2) = per_session(|_| Calibration::new());
    drop(s2);
    // A calibrated session that last sent a 40-message conversation.
    let conv: Vec<Box<RawValue>> = (0..40)
        .map(|i| {
            RawValue::from_string(format!(r#"{{"role":"user","content":"message {i}"}}"#)).unwrap()
        })
        .collect();
    let hashes = message_hashes(&conv);
    let (cal40, s3) = per_session(|_| {
        let mut c = Calibration::new();
        let e = c.estimate(&conv, hashes.clone(), 0, |m| m.get().len() as u64 / 4);
        c.observe(e.sent, 500);
        c
    });
    let e = s3
        .get(&SessionKey::from_u128(1))
        .expect("session present")
        .lock()
        .await
        .ratio();
    assert!(e.is_some());
    drop(s3);

    println!("bytes per idle session: store+unit {unit:.0}, +Calibration (empty) {empty_cal:.0}, +Calibration (40 msgs sent) {cal40:.0}");
    // Budget: the map entry, Arc, async mutex and tick stay small; the
    // calibration adds ~24 bytes per message of the last request.
    assert!(unit < 256.0, "store overhead {unit}");
    assert!(empty_cal < 384.0, "empty calibration {empty_cal}");
    assert!(
        cal40 < empty_cal + 40.0 * 24.0 + 256.0,
        "calibrated {cal40}"
    );
}
