//! One summary per compaction across replicas that share a store: a
//! compaction takes a lock with expiry in the store before its summary call.
//! The replica that gets it summarises and writes the record, then releases
//! the lock; another replica that wants to compact the same history waits
//! (at most the summary timeout) for that record to appear and uses it, or
//! else compacts itself. A store that is not shared needs no lock (the
//! conversation lock already serialises one process), only one read before
//! a compaction for a longer record written before a restart.

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use super::engine::History;
use super::record::Record;
use super::ChatState;

/// How often a waiting replica looks for the owner's record.
const POLL: Duration = Duration::from_millis(50);
/// The lock outlives the wait a little: the owner still writes its record
/// after its last summary call.
const LOCK_SLACK: Duration = Duration::from_secs(5);

/// What a compaction does about the other replicas.
pub(super) enum Claim {
    /// A record longer than the one substituted is in the store (another
    /// replica's, or written before a restart): use it instead of compacting.
    Found(Arc<Record>),
    /// This replica holds the lock: compact, then [`release`] it.
    Owned(Held),
    /// Compact alone: the store is not shared, failed, or the owner's
    /// record did not come in time.
    Alone,
}

/// A held compaction lock.
pub(super) struct Held {
    cred: u128,
    name: u128,
    token: u64,
}

fn token() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    std::collections::hash_map::RandomState::new()
        .build_hasher()
        .finish()
}

/// Claims the compaction of this turn's history (named by the chained hash
/// of all its messages). While another replica holds the lock, this one
/// polls for the owner's record and for the lock: an owner whose
/// compaction failed releases it without a record, and then this replica
/// takes over instead of waiting out the summary timeout.
pub(super) async fn claim(chat: &ChatState, h: &History<'_>) -> Claim {
    let Some(&name) = h.client_hashes.last() else {
        return Claim::Alone;
    };
    let have = h.record.map_or(0, |r| r.k);
    if !chat.store.shared() {
        return alone(chat, h, have).await;
    }
    let wait = Duration::from_secs(chat.compaction.summary_timeout_secs.max(1));
    let token = token();
    let deadline = crate::clock::from_now(wait);
    loop {
        match chat
            .store
            .try_lock(h.cred, name, token, wait + LOCK_SLACK)
            .await
        {
            None => return Claim::Alone,
            Some(true) => {
                // The owner before us may have finished between our look and our lock.
                if let Some(rec) = newer(chat, h, have).await {
                    chat.store.unlock(h.cred, name, token).await;
                    return Claim::Found(rec);
                }
                return Claim::Owned(Held {
                    cred: h.cred,
                    name,
                    token,
                });
            }
            Some(false) => {}
        }
        if let Some(rec) = newer(chat, h, have).await {
            return Claim::Found(rec);
        }
        if Instant::now() >= deadline {
            tracing::info!(session = %h.key, "no record from the lock owner in time; compacting here");
            return Claim::Alone;
        }
        tokio::time::sleep(POLL).await;
    }
}

/// A store of this process alone: memory holds what the store does, but
/// only from when a history reached it (after a restart, a session adopts
/// the first record of its history from the store, and from then on finds
/// that one in memory). So before a compaction, one read asks the store
/// for a longer record of the same credential's history, which another
/// session wrote before the restart.
async fn alone(chat: &ChatState, h: &History<'_>, have: usize) -> Claim {
    if chat.store.name() == "memory" || !chat.store.may_have(h.client_hashes.len()) {
        return Claim::Alone;
    }
    match longer_stored(chat, h, have).await {
        Some(rec) => Claim::Found(rec),
        None => Claim::Alone,
    }
}

/// A stored record of this history longer than the `have` substituted,
/// another replica's (counted as such).
async fn newer(chat: &ChatState, h: &History<'_>, have: usize) -> Option<Arc<Record>> {
    let rec = longer_stored(chat, h, have).await?;
    chat.store.health.peer_record();
    Some(rec)
}

/// A stored record of this history longer than the `have` substituted.
async fn longer_stored(chat: &ChatState, h: &History<'_>, have: usize) -> Option<Arc<Record>> {
    let stored = chat.store.find(h.cred, h.client_hashes).await?;
    if stored.k <= have {
        return None;
    }
    chat.adopt_record(h.cred, h.client_hashes, stored)
}

/// Writes the owner's record (when the compaction made one) and then
/// releases the lock, in the background: a waiting replica must find the
/// record once the lock is gone.
pub(super) fn release(chat: &ChatState, held: Held, record: Option<&Arc<Record>>) {
    let store = chat.store.clone();
    let stored = record.map(|r| super::durable::to_stored(r));
    tokio::spawn(async move {
        if let Some(s) = stored {
            store.put(held.cred, s).await;
        }
        store.unlock(held.cred, held.name, held.token).await;
    });
}
