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
//! - [`response`]: the upstream response decoder never panics and does not
//!   depend on how the bytes are cut into reads or frames joined; what it
//!   forwards is framed one way (no Content-Length next to a
//!   Transfer-Encoding, a sized body as long as its length).
//! - [`request_head`]: the server's fast path and httparse with the wire
//!   rules read plainly frame a request's bytes the same (served with the
//!   same head, fields and body, waiting for more, or handed to hyper with
//!   the bytes untouched).

#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use bytes::BytesMut;
use compactor::chat::record::{Record, RecordStore};
use compactor::request::ChatRequest;
use compactor::server::{frame_request, Framed};
use compactor::upstream::h1::read_response;
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

/// Checks the upstream response decoder on arbitrary bytes: the first
/// byte picks a HEAD request and joined frames, the next four where the
/// reads end, the rest is the wire.
pub fn response(data: &[u8]) {
    let [flags, c1, c2, c3, c4, ..] = *data else {
        return;
    };
    let wire = &data[5..];
    let is_head = flags & 1 != 0;
    let cuts: Vec<usize> = [c1, c2, c3, c4]
        .iter()
        .map(|&c| usize::from(c) + 1)
        .collect();
    let whole = read_response(wire, is_head, &[], false);
    let cut = read_response(wire, is_head, &cuts, flags & 2 != 0);
    let (Ok(whole), Ok(cut)) = (whole, cut) else {
        return;
    };
    assert_eq!(whole.response().status(), cut.response().status());
    assert_eq!(whole.response().headers(), cut.response().headers());
    assert_eq!(whole.body, cut.body, "the body depends on the reads");
    assert_eq!(whole.trailers, cut.trailers);
    assert_eq!(whole.left, cut.left);
    assert_eq!(whole.keep_alive(), cut.keep_alive());
    let headers = whole.response().headers();
    let te = headers.contains_key("transfer-encoding");
    assert!(
        !(te && headers.contains_key("content-length")),
        "a length forwarded next to a transfer-encoding"
    );
    let status = whole.response().status().as_u16();
    let bodiless = is_head || status == 204 || status == 304;
    if bodiless {
        assert!(whole.body.is_empty());
    } else if let (false, Some(v)) = (te, headers.get("content-length")) {
        let n = plain_length(v.as_bytes()).expect("a forwarded length reads");
        assert_eq!(whole.body.len() as u64, n, "a sized body is its length");
    }
    let closes = headers
        .get_all("connection")
        .iter()
        .any(|v| list_has(v.as_bytes(), b"close"));
    if closes {
        assert!(!whole.keep_alive(), "kept after a close");
    }
}

/// A Content-Length value read plainly (RFC 9110 §8.6: 1*DIGIT, a list of
/// one repeated value tolerated): `str::parse` of each trimmed item of
/// digits, all equal.
pub fn plain_length(v: &[u8]) -> Option<u64> {
    let text = std::str::from_utf8(v).ok()?;
    let mut length = None;
    for item in text.split(',') {
        let item = item.trim_matches([' ', '\t']);
        if item.is_empty() || !item.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        let n: u64 = item.parse().ok()?;
        if length.is_some_and(|l| l != n) {
            return None;
        }
        length = Some(n);
    }
    length
}

/// Whether a comma-separated value lists `token` (any case).
fn list_has(v: &[u8], token: &[u8]) -> bool {
    v.split(|&b| b == b',')
        .any(|t| t.trim_ascii().eq_ignore_ascii_case(token))
}

/// The fast path's largest message and header count (server::h1).
const MAX_MESSAGE: usize = 256 * 1024;
const MAX_HEADERS: usize = 64;

/// What the fast path should make of `input`, by httparse and the rules.
fn expected_framing(input: &[u8]) -> Framed {
    let hyper = |why| Framed::Hyper(why, true);
    let mut fields = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut req = httparse::Request::new(&mut fields);
    let head = match req.parse(input) {
        Ok(httparse::Status::Complete(n)) => n,
        Ok(httparse::Status::Partial) if input.len() < MAX_MESSAGE => return Framed::Partial,
        Ok(httparse::Status::Partial) | Err(httparse::Error::TooManyHeaders) => {
            return hyper("oversized")
        }
        Err(_) if input.starts_with(b"PRI * HTTP/2.0") => return hyper("h2"),
        Err(_) => return hyper("malformed"),
    };
    if req.version != Some(1) {
        return hyper("http10");
    }
    let (Some(method), Some(path)) = (req.method, req.path) else {
        return hyper("malformed");
    };
    match http::Method::from_bytes(method.as_bytes()) {
        Ok(m) if m == http::Method::CONNECT => return hyper("connect"),
        Ok(_) => {}
        Err(_) => return hyper("malformed"),
    }
    let mut length = None;
    let mut out = Vec::new();
    for f in req.headers.iter() {
        if http::HeaderName::from_bytes(f.name.as_bytes()).is_err() {
            return hyper("malformed");
        }
        let name = f.name.to_ascii_lowercase();
        match name.as_str() {
            "content-length" => match plain_length(f.value) {
                Some(n) if length.is_none() => length = Some(n),
                _ => return hyper("malformed"),
            },
            "transfer-encoding" => return hyper("transfer_encoding"),
            "expect" => return hyper("expect"),
            "upgrade" => return hyper("upgrade"),
            "connection" if list_has(f.value, b"close") => return hyper("connection_close"),
            _ => {}
        }
        out.push((name, f.value.to_vec()));
    }
    let body = length.unwrap_or(0);
    let Some(total) = usize::try_from(body).ok().and_then(|b| b.checked_add(head)) else {
        return hyper("oversized");
    };
    if total > MAX_MESSAGE {
        return hyper("oversized");
    }
    if input.len() < total {
        return Framed::Partial;
    }
    let (Ok(target), true) = (
        http::Uri::try_from(path),
        out.iter()
            .all(|(_, v)| http::HeaderValue::from_bytes(v).is_ok()),
    ) else {
        return hyper("malformed");
    };
    Framed::Served {
        head,
        method: method.to_owned(),
        target: target.to_string(),
        fields: out,
        body: input[head..total].to_vec(),
    }
}

/// Checks the server's fast path against httparse and the rules read
/// plainly: the same framing, or both leave the bytes to hyper, for the
/// same reason.
pub fn request_head(input: &[u8]) {
    let mut ours = frame_request(input);
    let mut theirs = expected_framing(input);
    // A header map groups a name's values: compared as sets of fields.
    for framed in [&mut ours, &mut theirs] {
        if let Framed::Served { fields, .. } = framed {
            fields.sort();
        }
    }
    assert_eq!(ours, theirs, "{:?}", String::from_utf8_lossy(input));
}
