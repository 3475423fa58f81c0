//! A pre-compaction in flight, as its conversation holds it: the history it
//! was started on, its task, and the candidate record the task yields. The
//! pass itself (start, take, commit) is [`super::background`]'s; this is
//! what the [`super::conversation::Conversation`] keeps between turns.

use tokio::task::JoinHandle;

use crate::compaction::compressor::micro::MicroState;
use crate::compaction::compressor::Carry;

use super::record::Record;

/// A pre-compaction started for a conversation.
pub(crate) struct Pending {
    /// Length of the client history snapshotted and its chain hash: a
    /// history that no longer continues it makes the candidate stale.
    pub(super) snap_len: usize,
    pub(super) snap_hash: u128,
    /// A micro pass (else a batch compaction).
    pub(super) micro: bool,
    pub(super) handle: JoinHandle<Option<Candidate>>,
}

/// A finished pre-compaction, not yet committed.
pub(super) struct Candidate {
    pub(crate) record: Record,
    /// Set for a micro pass: the exchange it absorbed.
    pub(crate) micro: Option<MicroCut>,
    /// What the pass's compressor left (its running summary).
    pub(crate) carry: Carry,
    pub(crate) fallback_used: bool,
    pub(crate) feasibility_skip: bool,
    pub(crate) tokens_before: u64,
    pub(crate) tokens_after: u64,
    /// Summary calls the pass made and its time (the inspector's
    /// compaction row, as an inline pass reports them).
    pub(crate) summary_calls: u64,
    pub(crate) summariser_ms: u64,
}

/// The exchange a background micro pass absorbed, and the state it left.
pub(super) struct MicroCut {
    /// `start..end` of the outgoing messages the pass was given.
    pub(crate) start: usize,
    pub(crate) end: usize,
    /// Chain hash of those messages up to `end`: the pass is valid for a
    /// turn whose outgoing messages start with the same rows.
    pub(crate) prefix_hash: u128,
    pub(crate) state: MicroState,
}

/// Whether `hashes` still start with the `len` messages whose chain ends in
/// `hash` (a snapshot's history, a candidate's prefix).
pub(super) fn continues(hashes: &[u128], len: usize, hash: u128) -> bool {
    len >= 1 && hashes.len() >= len && hashes[len - 1] == hash
}
