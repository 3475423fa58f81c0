//! Invariants of the three entry points that see untrusted bytes, shared by
//! the cargo-fuzz targets (fuzz/fuzz_targets/*.rs) and the bounded property
//! tests of the main suite (tests/fuzz_props.rs). Every check panics on a
//! violation; a check that returns found nothing wrong.
//!
//! - [`request`]: `ChatRequest::parse` never panics; an unmodified request
//!   gives back its bytes; replacing `messages` keeps every byte outside
//!   the array and the result parses again to the new messages.
//! - [`sse`]: the SSE scanner and the usage hider never panic and do not
//!   depend on how the stream is cut into frames; a stream without `usage`
//!   passes the hider untouched; the hider's output scans as SSE.
//! - [`records`]: record lookups never panic and find exactly the longest
//!   recorded prefix of the history for that credential; the store stays
//!   within its bounds.

#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use bytes::BytesMut;
use compactor::chat::record::{Record, RecordStore};
use compactor::request::ChatRequest;
use compactor::usage::hide::UsageHider;
use compactor::usage::sse::SseScanner;
use serde_json::value::RawValue;

/// The messages every replacement check puts in.
pub const NEW_MESSAGES: &str =
    r#"[{"role":"user","content":"new"},{"role":"assistant","content":"x"}]"#;

fn new_messages() -> Vec<Box<RawValue>> {
    serde_json::from_str(NEW_MESSAGES).unwrap()
}

/// Checks the request view on arbitrary bytes.
pub fn request(body: &[u8]) {
    let Ok(mut req) = ChatRequest::parse(body.to_vec()) else {
        return;
    };
    assert!(!req.is_modified());
    assert_eq!(&req.to_bytes()[..], body, "unmodified body changed");
    let before = req.messages().len();
    let streaming = req.stream();
    req.with_messages(new_messages());
    let out = req.to_bytes();
    assert_replaced_in_place(body, &out, before);
    let again = ChatRequest::parse(out.clone()).expect("replaced body parses");
    assert_eq!(again.messages().len(), 2);
    // Forcing usage on top keeps it a valid request with the same messages.
    let wanted = req.client_wants_usage();
    assert_eq!(req.force_include_usage(), streaming && !wanted);
    let with_usage = ChatRequest::parse(req.to_bytes()).expect("forced body parses");
    assert_eq!(with_usage.messages().len(), 2);
    if streaming {
        assert!(with_usage.client_wants_usage());
    }
}

/// `out` is `body` with one JSON array of `n` elements replaced by
/// [`NEW_MESSAGES`], every other byte as it was.
pub fn assert_replaced_in_place(body: &[u8], out: &[u8], n: usize) {
    let new = NEW_MESSAGES.as_bytes();
    let found = memchr::memmem::find_iter(out, new).any(|i| {
        let (head, tail) = (&out[..i], &out[i + new.len()..]);
        if head.len() + tail.len() > body.len() || !body.starts_with(head) || !body.ends_with(tail)
        {
            return false;
        }
        let old = &body[head.len()..body.len() - tail.len()];
        serde_json::from_slice::<Vec<&RawValue>>(old).is_ok_and(|v| v.len() == n)
    });
    assert!(
        found,
        "replacement is not an in-place splice of the messages array:\n  in:  {}\n  out: {}",
        String::from_utf8_lossy(body),
        String::from_utf8_lossy(out)
    );
}

/// One scanned event: (event name, data, came from an `error:` field).
pub type Event = (Option<Vec<u8>>, Vec<u8>, bool);

/// Scans `parts` in order, then finishes.
pub fn scan(parts: &[&[u8]]) -> Vec<Event> {
    let mut s = SseScanner::new();
    let mut events = Vec::new();
    let mut push = |e: compactor::usage::sse::SseEvent<'_>| {
        events.push((e.event.map(<[u8]>::to_vec), e.data.to_vec(), e.error_field));
    };
    for p in parts {
        s.feed(p, &mut push);
    }
    s.finish(&mut push);
    events
}

/// The hider's output for `parts`, fed in order.
pub fn hide(parts: &[&[u8]]) -> Vec<u8> {
    let mut h = UsageHider::new();
    let mut out = BytesMut::new();
    for p in parts {
        h.push(p, &mut out);
    }
    h.finish(&mut out);
    out.to_vec()
}

/// `stream` cut at `cuts` (clamped, sorted).
pub fn split<'a>(stream: &'a [u8], cuts: &[usize]) -> Vec<&'a [u8]> {
    let mut points: Vec<usize> = cuts.iter().map(|&c| c.min(stream.len())).collect();
    points.sort_unstable();
    let mut parts = Vec::with_capacity(points.len() + 1);
    let mut last = 0;
    for p in points {
        parts.push(&stream[last..p]);
        last = p;
    }
    parts.push(&stream[last..]);
    parts
}

/// Checks the scanner and the hider on an arbitrary stream and cut points.
pub fn sse(stream: &[u8], cuts: &[usize]) {
    let parts = split(stream, cuts);
    let whole = scan(&[stream]);
    assert_eq!(scan(&parts), whole, "scanner depends on frame cuts");
    let hidden = hide(&[stream]);
    assert_eq!(hide(&parts), hidden, "hider depends on frame cuts");
    if memchr::memmem::find(stream, b"\"usage\"").is_none() {
        assert_eq!(hidden, stream, "a stream without usage was changed");
    }
    // The hider only ever removes events or members: never more events
    // than came in, and every byte it emits came from the input, in order,
    // unless it moved a llama.cpp `timings` member.
    let after = scan(&[&hidden]);
    assert!(after.len() <= whole.len(), "hider added events");
    if memchr::memmem::find(stream, b"\"timings\"").is_none() {
        assert!(is_subsequence(&hidden, stream), "hider emitted new bytes");
    }
}

/// `small` is a subsequence of `big`.
fn is_subsequence(small: &[u8], big: &[u8]) -> bool {
    let mut it = big.iter();
    small.iter().all(|b| it.any(|c| c == b))
}

/// Chained hashes of a toy history: element i identifies items 0..=i.
pub fn chain(items: &[u8]) -> Vec<u128> {
    let mut prev = 0u128;
    items
        .iter()
        .map(|&b| {
            prev = prev.wrapping_mul(0x9E37_79B9_7F4A_7C15_F39C_C060_5CED_C835) ^ u128::from(b) ^ 1;
            prev
        })
        .collect()
}

/// Interprets `ops` as inserts and lookups on a record store, checking each
/// lookup against a brute-force model (no eviction: the bound is large), and
/// the bounds of a tiny store fed the same inserts.
pub fn records(ops: &[u8]) {
    let store = RecordStore::new(Duration::from_secs(3600), 1 << 20);
    let tiny = RecordStore::new(Duration::from_secs(3600), 3).with_max_bytes(2048);
    // The model: (cred, k, prefix hash) of every record, newest last.
    let mut model: Vec<(u128, usize, u128)> = Vec::new();
    let mut hint = None;
    for op in ops.chunks(4) {
        let [kind, cred, len, seed] = [0, 1, 2, 3].map(|i| op.get(i).copied().unwrap_or(0));
        let cred = u128::from(cred % 3);
        // Histories drawn from a small alphabet share prefixes often.
        let items: Vec<u8> = (0..usize::from(len % 12))
            .map(|i| (seed >> (i % 8)) & 1)
            .collect();
        let hashes = chain(&items);
        if kind % 2 == 0 && !hashes.is_empty() {
            let k = usize::from(seed) % hashes.len() + 1;
            let text = format!("\"{}\"", "r".repeat(usize::from(seed) * 4));
            let rep = vec![RawValue::from_string(text).unwrap()];
            let rec = Record::new(k, hashes[k - 1], rep, 1, 1);
            let tiny_rec = Record::new(k, hashes[k - 1], rec.replacement.clone(), 1, 1);
            hint = Some(store.insert(cred, rec));
            tiny.insert(cred, tiny_rec);
            model.retain(|&(c, _, h)| (c, h) != (cred, hashes[k - 1]));
            model.push((cred, k, hashes[k - 1]));
        } else {
            let use_hint = kind & 2 == 0;
            let got = store.lookup(cred, &hashes, hint.as_ref().filter(|_| use_hint));
            let matches = |c: u128, k: usize, h: u128| {
                c == cred && k >= 1 && k <= hashes.len() && hashes[k - 1] == h
            };
            // The longest recorded prefix of this credential's history
            // wins, whether the hint (the session's own record) matches or
            // not: another session's longer record is found too.
            let want = model
                .iter()
                .filter(|&&(c, k, h)| matches(c, k, h))
                .map(|&(_, k, _)| k)
                .max();
            assert_eq!(got.map(|r| r.k), want, "lookup of {items:?} for {cred}");
            tiny.lookup(cred, &hashes, None);
        }
        assert!(tiny.len() <= 3);
        assert!(tiny.bytes() <= 2048);
    }
    assert!(store.lookup(0, &[], hint.as_ref()).is_none());
}
