//! The store's calls as blocking functions (the caller runs them on
//! tokio's blocking pool): reads are one positioned read and a checksum,
//! writes one append and one `sync_data`.

use std::fs::File;
use std::sync::Arc;

use crate::store::{StoreError, StoredRecord};

use super::entry::{self, window_len, Key};
use super::evict::{apply_sweep, lru, plan_sweep, split, Limits, SweepPlan};
use super::frame::{self, Kind};
use super::index::{Index, Loc, Meta, Ref, StateMeta, Usage};
use super::inner::{backend, now_ms, Inner};
use super::room::append;

/// The longest live record of `cred` matching `hashes`, located without
/// I/O: the record to read and the file to read it from.
pub(super) fn locate(inner: &Inner, cred: u128, hashes: &[u128]) -> Option<(Key, Loc, Arc<File>)> {
    if hashes.is_empty() {
        return None;
    }
    let now = now_ms();
    let shared = inner.shared();
    let index = &shared.index;
    // Longest first: a later compaction covers more of the history.
    let (key, at) = index
        .lengths
        .range(1..=hashes.len())
        .rev()
        .find_map(|(&k, _)| {
            let key = (cred, *hashes.get(k - 1)?);
            let m = index.meta.get(&key)?;
            let live = m.k == k && now.saturating_sub(m.touched) <= inner.ttl_ms;
            live.then_some((key, m.at))
        })?;
    Some((key, at, Arc::clone(&shared.file)))
}

/// Reads the record [`locate`] found. A frame that does not check (or is
/// not that record) is `Corrupt` and leaves the index.
pub(super) fn read_record(
    inner: &Inner,
    key: Key,
    at: Loc,
    file: &File,
) -> Result<StoredRecord, StoreError> {
    let decoded = Inner::read(file, at, Kind::RecordPut).and_then(|bytes| {
        frame::open(&bytes)
            .and_then(|(_, payload)| entry::record(payload))
            .filter(|(k, _, _)| *k == key)
            .map(|(_, _, rec)| rec)
            .ok_or(StoreError::Corrupt)
    });
    let mut shared = inner.shared();
    match decoded {
        Ok(rec) => {
            if let Some(m) = shared.index.set_touched(&key, now_ms()) {
                m.dirty = true;
            }
            Ok(rec)
        }
        Err(StoreError::Corrupt) => {
            if shared.index.meta.get(&key).is_some_and(|m| m.at == at) {
                shared.index.remove(&key);
            }
            tracing::warn!(backend = "file", path = %inner.path.display(), offset = at.offset,
                "store record damaged on disk: dropped");
            Err(StoreError::Corrupt)
        }
        Err(e) => Err(e),
    }
}

/// The deletes of the entries that go so that `add` fits the bound
/// (`keep`: the entry the write replaces), and what they are.
fn make_room(
    inner: &Inner,
    index: &Index,
    add: Usage,
    keep: Option<Ref>,
) -> (Vec<u8>, (Vec<Ref>, u64)) {
    let mut gone = Vec::new();
    lru(index, &Limits::new(inner.max_bytes), add, keep, &mut gone);
    let (records, states) = split(&gone);
    let mut small = Vec::new();
    entry::delete_records(&mut small, &records);
    entry::delete_states(&mut small, &states);
    let before = small.len() as u64;
    (small, (gone, before))
}

/// Stores a record after dropping the least recently used records and
/// states it needs room from (in the same write).
pub(super) fn put(inner: &Arc<Inner>, cred: u128, record: &StoredRecord) -> Result<(), StoreError> {
    let size = record.size();
    if size > inner.max_bytes {
        return Ok(());
    }
    let key = (cred, record.prefix_hash);
    let now = now_ms();
    let mut frame = Vec::with_capacity(size + 256);
    entry::put_record(&mut frame, cred, now, record).map_err(|e| backend("encode", e))?;
    let len = frame.len() as u64;
    let k = record.k;
    let add = Usage::record(size, len);
    append(
        inner,
        &frame,
        |index| make_room(inner, index, add, Some(Ref::Record(key))),
        |index, (gone, before), at| {
            for old in gone {
                index.drop_entry(old);
            }
            let at = Loc {
                offset: at + before,
                len,
            };
            let meta = Meta {
                k,
                size,
                touched: now,
                dirty: false,
                at,
            };
            index.add(key, meta);
        },
    )
}

/// Drops expired records and states and the least recently used ones
/// over the bound, and writes the last uses noted since the last sweep.
pub(super) fn sweep(inner: &Arc<Inner>) -> Result<(), StoreError> {
    let now = now_ms();
    append(
        inner,
        &[],
        |index| {
            let plan = plan_sweep(index, now, inner.ttl_ms, inner.max_bytes);
            let mut small = Vec::new();
            entry::delete_records(&mut small, &plan.gone);
            entry::touches(&mut small, &plan.dirty);
            entry::delete_states(&mut small, &plan.states);
            (small, plan)
        },
        |index, plan, _| apply_sweep(index, &plan),
    )
}

/// Writes a sweep already made in the index (the deletes and last uses
/// of `plan`): applying it again changes nothing.
pub(super) fn write_sweep(inner: &Arc<Inner>, plan: &SweepPlan) -> Result<(), StoreError> {
    append(
        inner,
        &[],
        |_| {
            let mut small = Vec::new();
            entry::delete_records(&mut small, &plan.gone);
            entry::touches(&mut small, &plan.dirty);
            entry::delete_states(&mut small, &plan.states);
            (small, ())
        },
        |index, (), _| apply_sweep(index, plan),
    )
}

/// Stores a learned window; a new one first drops the least recently used
/// records and states it needs room from.
pub(super) fn put_window(
    inner: &Arc<Inner>,
    upstream: &str,
    model: &str,
    tokens: u64,
) -> Result<(), StoreError> {
    let mut frame = Vec::new();
    entry::window(&mut frame, upstream, model, tokens).map_err(|e| backend("encode", e))?;
    let key = (upstream.to_owned(), model.to_owned());
    let add = Usage::window(window_len(upstream, model));
    let (u, m) = key.clone();
    append(
        inner,
        &frame,
        |index| {
            let known = index.windows.contains_key(&key);
            make_room(
                inner,
                index,
                if known { Usage::default() } else { add },
                None,
            )
        },
        |index, (gone, _), _| {
            for old in gone {
                index.drop_entry(old);
            }
            index.set_window(u, m, tokens);
        },
    )
}

pub(super) fn get_state(inner: &Inner, session: u128) -> Result<Option<Vec<u8>>, StoreError> {
    let (at, file) = {
        let shared = inner.shared();
        let Some(s) = shared.index.states.get(&session) else {
            return Ok(None);
        };
        if now_ms().saturating_sub(s.written) > inner.ttl_ms {
            return Ok(None);
        }
        (s.at, Arc::clone(&shared.file))
    };
    let state = Inner::read(&file, at, Kind::StatePut).and_then(|bytes| {
        frame::open(&bytes)
            .and_then(|(_, payload)| entry::state(payload))
            .filter(|(s, _, _)| *s == session)
            .map(|(_, _, state)| state.to_vec())
            .ok_or(StoreError::Corrupt)
    });
    if matches!(state, Err(StoreError::Corrupt)) {
        let mut shared = inner.shared();
        if shared
            .index
            .states
            .get(&session)
            .is_some_and(|s| s.at == at)
        {
            shared.index.remove_state(session);
        }
    }
    state.map(Some)
}

/// Stores a conversation's state after dropping the oldest states beyond
/// their share of the bound, then the least recently used records and
/// states it needs room from (in the same write). A state larger than
/// that share is not kept, nor the one it replaces.
pub(super) fn put_state(inner: &Arc<Inner>, session: u128, state: &[u8]) -> Result<(), StoreError> {
    let now = now_ms();
    let mut frame = Vec::with_capacity(state.len() + 64);
    entry::put_state(&mut frame, session, now, state).map_err(|e| backend("encode", e))?;
    let len = frame.len() as u64;
    if len > Limits::new(inner.max_bytes).states {
        return delete_state(inner, session);
    }
    append(
        inner,
        &frame,
        |index| make_room(inner, index, Usage::state(len), Some(Ref::State(session))),
        |index, (gone, before), at| {
            for old in gone {
                index.drop_entry(old);
            }
            let at = Loc {
                offset: at + before,
                len,
            };
            index.put_state(session, StateMeta { written: now, at });
        },
    )
}

/// Deletes a conversation's state, if there is one.
fn delete_state(inner: &Arc<Inner>, session: u128) -> Result<(), StoreError> {
    append(
        inner,
        &[],
        |index| {
            let mut small = Vec::new();
            if index.states.contains_key(&session) {
                entry::delete_states(&mut small, &[session]);
            }
            (small, ())
        },
        |index, (), _| {
            index.remove_state(session);
        },
    )
}
