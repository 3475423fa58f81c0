//! The payload of each kind of frame, all integers little-endian.
//!
//! - record put: credential (u128), prefix hash (u128), last use (unix ms,
//!   u64), `k` (u64), [`StoredRecord::size`] (u64), original and
//!   replacement tokens (u64 each), the summary rows (u32 count, `u32::MAX`
//!   for none, then u32 each), the replacement texts (u32 count, then u32
//!   length and the UTF-8 bytes each). Binary rather than JSON: the texts
//!   are JSON themselves, and escaping every quote of a 1 MB text again
//!   cost more than the write.
//! - record delete: keys (u128 + u128) one after the other.
//! - touches: (key, last use u64) one after the other.
//! - window: tokens (u64), upstream length (u32), upstream, model.
//! - state put: session key (u128), written (unix ms, u64), the state.
//! - state delete: session keys (u128) one after the other.
//!
//! Decoding takes untrusted bytes (their checksum held, but the file may
//! not be ours): counts are checked against the bytes left before
//! anything is allocated, and nothing panics.

use crate::store::StoredRecord;

use super::frame::{self, Kind, TooLong};

/// A record's key: (credential fingerprint, prefix hash).
pub(super) type Key = (u128, u128);

/// Where in a record put's payload its last use is, to rewrite it when the
/// record is copied by a rewrite.
pub(super) const TOUCHED_AT: usize = 32;
/// Deletes and touches are split into frames of at most this many keys, so
/// no sweep makes a frame beyond a few MB.
const BATCH: usize = 65_536;

/// What the scan at open needs of an entry (a record's texts are not
/// decoded: only a read decodes them).
#[derive(Debug)]
pub(super) enum Entry {
    Record {
        key: Key,
        touched: u64,
        k: usize,
        size: usize,
    },
    RecordDeletes(Vec<Key>),
    Touches(Vec<(Key, u64)>),
    Window {
        upstream: String,
        model: String,
        tokens: u64,
    },
    State {
        session: u128,
        written: u64,
    },
    StateDeletes(Vec<u128>),
}

/// Appends a record put frame.
pub(super) fn put_record(
    out: &mut Vec<u8>,
    cred: u128,
    touched: u64,
    r: &StoredRecord,
) -> Result<(), TooLong> {
    frame::push(out, Kind::RecordPut, |o| {
        o.extend_from_slice(&cred.to_le_bytes());
        o.extend_from_slice(&r.prefix_hash.to_le_bytes());
        for v in [touched, r.k as u64, r.size() as u64] {
            o.extend_from_slice(&v.to_le_bytes());
        }
        o.extend_from_slice(&r.original_tokens.to_le_bytes());
        o.extend_from_slice(&r.replacement_tokens.to_le_bytes());
        match &r.summary_rows {
            None => o.extend_from_slice(&u32::MAX.to_le_bytes()),
            Some(rows) => {
                o.extend_from_slice(&len32(rows.len()).to_le_bytes());
                for &row in rows {
                    o.extend_from_slice(&len32(row).to_le_bytes());
                }
            }
        }
        o.extend_from_slice(&len32(r.replacement.len()).to_le_bytes());
        for text in &r.replacement {
            o.extend_from_slice(&len32(text.len()).to_le_bytes());
            o.extend_from_slice(text.as_bytes());
        }
    })
}

/// A count as written: a count beyond u32 makes the payload too long
/// anyway (the frame is refused), so saturating is never read back.
fn len32(n: usize) -> u32 {
    u32::try_from(n).unwrap_or(u32::MAX - 1)
}

/// Decodes a record put payload whole: its key, last use and record.
pub(super) fn record(payload: &[u8]) -> Option<(Key, u64, StoredRecord)> {
    let mut c = Cursor(payload);
    let key = (c.u128()?, c.u128()?);
    let touched = c.u64()?;
    let k = usize::try_from(c.u64()?).ok()?;
    let _size = c.u64()?;
    let original_tokens = c.u64()?;
    let replacement_tokens = c.u64()?;
    let summary_rows = match c.u32()? {
        u32::MAX => None,
        n => Some(
            (0..c.count(n, 4)?)
                .map(|_| c.u32().and_then(|r| usize::try_from(r).ok()))
                .collect::<Option<Vec<usize>>>()?,
        ),
    };
    let n = c.u32()?;
    let mut replacement = Vec::with_capacity(c.count(n, 4)?);
    for _ in 0..n {
        let len = usize::try_from(c.u32()?).ok()?;
        replacement.push(String::from_utf8(c.take(len)?.to_vec()).ok()?);
    }
    if !c.0.is_empty() {
        return None;
    }
    let rec = StoredRecord {
        k,
        prefix_hash: key.1,
        replacement,
        original_tokens,
        replacement_tokens,
        summary_rows,
    };
    Some((key, touched, rec))
}

/// Appends record delete frames for `keys`.
pub(super) fn delete_records(out: &mut Vec<u8>, keys: &[Key]) {
    for batch in keys.chunks(BATCH) {
        // A batch is 2 MiB at most: never too long.
        let _ = frame::push(out, Kind::RecordDelete, |o| {
            for (cred, hash) in batch {
                o.extend_from_slice(&cred.to_le_bytes());
                o.extend_from_slice(&hash.to_le_bytes());
            }
        });
    }
}

/// Appends touches frames for `uses`.
pub(super) fn touches(out: &mut Vec<u8>, uses: &[(Key, u64)]) {
    for batch in uses.chunks(BATCH) {
        let _ = frame::push(out, Kind::Touches, |o| {
            for ((cred, hash), at) in batch {
                o.extend_from_slice(&cred.to_le_bytes());
                o.extend_from_slice(&hash.to_le_bytes());
                o.extend_from_slice(&at.to_le_bytes());
            }
        });
    }
}

/// Appends a window frame.
pub(super) fn window(
    out: &mut Vec<u8>,
    upstream: &str,
    model: &str,
    tokens: u64,
) -> Result<(), TooLong> {
    frame::push(out, Kind::Window, |o| {
        o.extend_from_slice(&tokens.to_le_bytes());
        o.extend_from_slice(&len32(upstream.len()).to_le_bytes());
        o.extend_from_slice(upstream.as_bytes());
        o.extend_from_slice(model.as_bytes());
    })
}

/// Bytes a window's frame takes.
pub(super) fn window_len(upstream: &str, model: &str) -> u64 {
    (frame::OVERHEAD + 12 + upstream.len() + model.len()) as u64
}

/// Appends a state put frame.
pub(super) fn put_state(
    out: &mut Vec<u8>,
    session: u128,
    written: u64,
    state: &[u8],
) -> Result<(), TooLong> {
    frame::push(out, Kind::StatePut, |o| {
        o.extend_from_slice(&session.to_le_bytes());
        o.extend_from_slice(&written.to_le_bytes());
        o.extend_from_slice(state);
    })
}

/// Decodes a state put payload: session key, written, state.
pub(super) fn state(payload: &[u8]) -> Option<(u128, u64, &[u8])> {
    let mut c = Cursor(payload);
    Some((c.u128()?, c.u64()?, c.0))
}

/// Appends state delete frames for `sessions`.
pub(super) fn delete_states(out: &mut Vec<u8>, sessions: &[u128]) {
    for batch in sessions.chunks(BATCH) {
        let _ = frame::push(out, Kind::StateDelete, |o| {
            for s in batch {
                o.extend_from_slice(&s.to_le_bytes());
            }
        });
    }
}

/// What the scan keeps of a verified frame; `None`: its payload does not
/// decode (a frame that checks but is not what its kind says).
pub(super) fn parse(kind: Kind, payload: &[u8]) -> Option<Entry> {
    let mut c = Cursor(payload);
    Some(match kind {
        Kind::RecordPut => {
            let key = (c.u128()?, c.u128()?);
            let touched = c.u64()?;
            let k = usize::try_from(c.u64()?).ok()?;
            let size = usize::try_from(c.u64()?).ok()?;
            Entry::Record {
                key,
                touched,
                k,
                size,
            }
        }
        Kind::RecordDelete => Entry::RecordDeletes(c.all(32, |c| Some((c.u128()?, c.u128()?)))?),
        Kind::Touches => Entry::Touches(c.all(40, |c| Some(((c.u128()?, c.u128()?), c.u64()?)))?),
        Kind::Window => {
            let tokens = c.u64()?;
            let len = usize::try_from(c.u32()?).ok()?;
            let upstream = String::from_utf8(c.take(len)?.to_vec()).ok()?;
            let model = String::from_utf8(c.0.to_vec()).ok()?;
            Entry::Window {
                upstream,
                model,
                tokens,
            }
        }
        Kind::StatePut => Entry::State {
            session: c.u128()?,
            written: c.u64()?,
        },
        Kind::StateDelete => Entry::StateDeletes(c.all(16, Cursor::u128)?),
    })
}

/// Reads integers off the front of a payload.
struct Cursor<'a>(&'a [u8]);

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        let (head, rest) = self.0.split_at_checked(n)?;
        self.0 = rest;
        Some(head)
    }

    fn u32(&mut self) -> Option<u32> {
        Some(u32::from_le_bytes(self.take(4)?.try_into().ok()?))
    }

    fn u64(&mut self) -> Option<u64> {
        Some(u64::from_le_bytes(self.take(8)?.try_into().ok()?))
    }

    fn u128(&mut self) -> Option<u128> {
        Some(u128::from_le_bytes(self.take(16)?.try_into().ok()?))
    }

    /// `n` items of at least `each` bytes, if the bytes left can hold them
    /// (so a damaged count never allocates beyond the payload).
    fn count(&self, n: u32, each: usize) -> Option<usize> {
        let n = usize::try_from(n).ok()?;
        (n.checked_mul(each)? <= self.0.len()).then_some(n)
    }

    /// The rest as items of exactly `each` bytes.
    fn all<T>(&mut self, each: usize, item: impl Fn(&mut Self) -> Option<T>) -> Option<Vec<T>> {
        if !self.0.len().is_multiple_of(each) {
            return None;
        }
        let mut out = Vec::with_capacity(self.0.len() / each);
        while !self.0.is_empty() {
            out.push(item(self)?);
        }
        Some(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(rows: Option<Vec<usize>>) -> StoredRecord {
        StoredRecord {
            k: 3,
            prefix_hash: 7 << 100,
            replacement: vec!["{\"a\":\"é\"}".into(), String::new()],
            original_tokens: 100,
            replacement_tokens: 10,
            summary_rows: rows,
        }
    }

    fn payload(f: &[u8]) -> (Kind, Vec<u8>) {
        let (kind, p) = frame::open(f).unwrap();
        (kind, p.to_vec())
    }

    #[test]
    fn a_record_reads_back_as_it_was_put() {
        for rows in [None, Some(vec![]), Some(vec![0, 1])] {
            let mut out = Vec::new();
            put_record(&mut out, 5, 1234, &rec(rows.clone())).unwrap();
            let (kind, p) = payload(&out);
            assert_eq!(kind, Kind::RecordPut);
            let (key, touched, back) = record(&p).unwrap();
            assert_eq!((key, touched), ((5, 7 << 100), 1234));
            assert_eq!(back, rec(rows));
            match parse(kind, &p).unwrap() {
                Entry::Record { key, k, size, .. } => {
                    assert_eq!((key.0, k, size), (5, 3, rec(None).size()));
                }
                e => panic!("{e:?}"),
            }
            // Every shorter payload is refused, none panics.
            for cut in 0..p.len() {
                assert!(record(&p[..cut]).is_none(), "{cut}");
            }
        }
    }

    #[test]
    fn batches_states_and_windows_read_back() {
        let mut out = Vec::new();
        delete_records(&mut out, &[(1, 2), (3, 4)]);
        let (kind, p) = payload(&out);
        assert!(matches!(parse(kind, &p), Some(Entry::RecordDeletes(k)) if k == [(1, 2), (3, 4)]));
        let mut out = Vec::new();
        touches(&mut out, &[((1, 2), 9)]);
        let (kind, p) = payload(&out);
        assert!(matches!(parse(kind, &p), Some(Entry::Touches(t)) if t == [((1, 2), 9)]));
        let mut out = Vec::new();
        window(&mut out, "http://u:1", "m", 8192).unwrap();
        assert_eq!(out.len() as u64, window_len("http://u:1", "m"));
        let (kind, p) = payload(&out);
        assert!(matches!(parse(kind, &p),
            Some(Entry::Window { upstream, model, tokens: 8192 }) if upstream == "http://u:1" && model == "m"));
        let mut out = Vec::new();
        put_state(&mut out, 8, 77, b"st").unwrap();
        let (_, p) = payload(&out);
        assert_eq!(state(&p), Some((8, 77, &b"st"[..])));
        let mut out = Vec::new();
        delete_states(&mut out, &[8, 9]);
        let (kind, p) = payload(&out);
        assert!(matches!(parse(kind, &p), Some(Entry::StateDeletes(s)) if s == [8, 9]));
        assert!(parse(Kind::StateDelete, &[0; 15]).is_none());
    }

    #[test]
    fn a_huge_count_is_refused_without_allocating() {
        let mut p = vec![0u8; 72];
        p.extend_from_slice(&u32::MAX.to_le_bytes()); // no summary rows
        p.extend_from_slice(&(u32::MAX - 1).to_le_bytes()); // 4 G texts
        assert!(record(&p).is_none());
    }
}
