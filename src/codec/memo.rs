//! Decodings of recent conversations, resumed instead of redone.
//!
//! An agent resends its whole conversation on every turn with a message or
//! two added. The chat path reads that in time proportional to the bytes
//! (skimmed, hashed); a Messages or Responses body is decoded message by
//! message into the engine's chat shape through `serde_json::Value`, some
//! 300 instructions a byte: on a 170 KB conversation 15× the chat path's
//! whole request. So each decode is kept, keyed by a hash chain over the
//! wire messages it consumed (and the API and system member before them),
//! and the next request whose wire messages start with the same bytes
//! takes it over and decodes only what follows; the longer decode is then
//! kept in its place, moved there when its request is dropped (no copy).
//!
//! Content-addressed, an entry is never stale; bounded by the bytes it
//! holds ([`MEMO_BYTES`]), the least recently used going first. Only
//! decodes that succeeded are kept, so a request the codec refuses is
//! refused by a full decode with its usual error.

use std::collections::VecDeque;
use std::sync::{LazyLock, Mutex};

use serde_json::value::RawValue;
use xxhash_rust::xxh3::{xxh3_128, Xxh3};

use super::{Api, WireMap};

/// What the kept decodings may hold together (engine bytes, roughly).
pub(super) const MEMO_BYTES: usize = 32 << 20;

/// A decode that consumed the first `wire_len` wire messages of a body:
/// the engine messages and the map it had made by then (`map.wire` empty).
#[derive(Debug)]
pub(super) struct Prefix {
    pub(super) wire_len: usize,
    pub(super) out: Vec<Box<RawValue>>,
    pub(super) map: WireMap,
    bytes: usize,
}

/// Kept decodings, within a byte budget.
pub(super) struct Memo {
    entries: Mutex<Entries>,
    budget: usize,
}

#[derive(Default)]
struct Entries {
    /// Least recently used first.
    list: VecDeque<(u128, Prefix)>,
    bytes: usize,
}

static GLOBAL: LazyLock<Memo> = LazyLock::new(|| Memo::new(MEMO_BYTES));

/// The process's memo.
pub(super) fn global() -> &'static Memo {
    &GLOBAL
}

/// Element `k` identifies the decode's input up to wire message `k`
/// (exclusive): the API, whether rough estimates are made, the system
/// member's bytes, then each wire message by the 64-bit hash and length
/// of its bytes (one pass at memory speed, like the chat path's own hash of
/// each message).
pub(super) fn chain(
    api: Api,
    rough: bool,
    system: Option<&RawValue>,
    wire: &[Box<RawValue>],
) -> Vec<u128> {
    let mut h = Xxh3::new();
    h.update(&[api as u8, u8::from(rough)]);
    let system = system.map_or("", RawValue::get).as_bytes();
    h.update(&(system.len() as u64).to_le_bytes());
    h.update(system);
    let mut prev = h.digest128();
    let mut out = Vec::with_capacity(wire.len() + 1);
    out.push(prev);
    for w in wire {
        let b = w.get().as_bytes();
        let mut link = [0u8; 32];
        link[..16].copy_from_slice(&prev.to_le_bytes());
        link[16..24].copy_from_slice(&crate::request::raw_hash(w).to_le_bytes());
        link[24..].copy_from_slice(&(b.len() as u64).to_le_bytes());
        prev = xxh3_128(&link);
        out.push(prev);
    }
    out
}

impl Memo {
    pub(super) fn new(budget: usize) -> Memo {
        Memo {
            entries: Mutex::new(Entries::default()),
            budget,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Entries> {
        // Every update leaves the list whole: a panic elsewhere while
        // the lock was held cannot have left it half changed.
        self.entries.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Takes out the longest kept decode whose input is a prefix of
    /// `chain`'s: the request that resumes it keeps its own longer decode
    /// in its place ([`Self::store`]).
    pub(super) fn take(&self, chain: &[u128]) -> Option<Prefix> {
        let mut entries = self.lock();
        let found = entries
            .list
            .iter()
            .enumerate()
            .filter(|(_, (key, p))| chain.get(p.wire_len) == Some(key))
            .max_by_key(|(_, (_, p))| p.wire_len)
            .map(|(i, _)| i)?;
        let (_, prefix) = entries.list.remove(found)?;
        entries.bytes -= prefix.bytes;
        Some(prefix)
    }

    /// Keeps the decode of the first `wire_len` wire messages (`out`, and
    /// its `map`) under `key`, the most recently used.
    pub(super) fn store(&self, key: u128, wire_len: usize, out: Vec<Box<RawValue>>, map: WireMap) {
        let bytes = out.iter().map(|m| m.get().len() + 64).sum::<usize>() + 256;
        if bytes > self.budget / 4 {
            return;
        }
        let prefix = Prefix {
            wire_len,
            out,
            map,
            bytes,
        };
        let mut entries = self.lock();
        if entries.list.iter().any(|(k, _)| *k == key) {
            return;
        }
        entries.bytes += bytes;
        entries.list.push_back((key, prefix));
        while entries.bytes > self.budget {
            let Some((_, p)) = entries.list.pop_front() else {
                break;
            };
            entries.bytes -= p.bytes;
        }
    }

    /// The bytes the kept decodings hold now.
    #[cfg(test)]
    pub(super) fn held_bytes(&self) -> usize {
        self.lock().bytes
    }
}
