//! What the inspector (`/_compactor/ui`, `GET /_compactor/sessions`) shows
//! of one conversation: a bounded ring of the figures of its last turns and
//! of its last compactions, and a few running totals. Content-free: counts,
//! sizes, times and flags only; never message text.
//!
//! Pure and synchronous: the preparation writes a turn under the
//! conversation lock (one push into a ring that stops growing at its
//! bound), the usage drained from the inbox fills in the real figures, and
//! the admin endpoints read it. It lives in the [`super::conversation::Conversation`],
//! so it is evicted with the session.

use std::collections::VecDeque;
use std::time::{SystemTime, UNIX_EPOCH};

use serde_json::{json, Value};

/// Compactions kept per conversation (they are rare next to turns).
pub(crate) const MAX_COMPACTIONS: usize = 32;

/// A figure not known (yet): no real usage reported, no trigger computed.
const UNKNOWN: u32 = u32::MAX;

/// Turn flags.
mod flag {
    pub(crate) const COMPACTED: u8 = 1;
    pub(crate) const FALLBACK: u8 = 1 << 1;
    pub(crate) const OVERFLOW_RETRY: u8 = 1 << 2;
    pub(crate) const ABORTED: u8 = 1 << 3;
    pub(crate) const BACKGROUND: u8 = 1 << 4;
    pub(crate) const SUBSTITUTED: u8 = 1 << 5;
    /// The prefix sent the turn before was sent again, byte for byte.
    pub(crate) const PREFIX_STABLE: u8 = 1 << 6;
    /// There was a turn before to compare with.
    pub(crate) const PREFIX_COMPARED: u8 = 1 << 7;
}

/// One turn's figures (40 bytes: see the size test).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct TurnFigures {
    /// When it was prepared, Unix milliseconds.
    at_ms: u64,
    /// Calibrated estimate of what was sent, real tokens.
    est: u32,
    /// Real prompt tokens the upstream reported ([`UNKNOWN`] until then).
    real: u32,
    /// Prompt tokens the upstream served from its cache ([`UNKNOWN`]: not
    /// reported).
    cached: u32,
    /// Context window, real tokens.
    window: u32,
    /// Trigger threshold, real tokens ([`UNKNOWN`] before it is computed).
    trigger: u32,
    /// Matches the usage reported later to this turn ([`sent_id`]).
    id: u32,
    flags: u8,
}

/// One committed compaction's figures.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct CompactionFigures {
    at_ms: u64,
    /// The conversation's turn number it served (1-based).
    turn: u64,
    rows_before: u32,
    rows_after: u32,
    /// Calibrated estimates before and after, real tokens.
    tokens_before: u32,
    tokens_after: u32,
    /// Time spent in the engine pass, summary calls included (0 for a
    /// pending pass committed: it ran off the request path).
    summariser_ms: u32,
    summary_calls: u16,
    fallback: bool,
    /// Committed from a background pre-compaction (else inline).
    from_pending: bool,
    /// Micro-compaction (else a batch summary).
    micro: bool,
}

/// What the compaction step tells the preparation about a pass it
/// committed (the preparation knows the rows and estimates).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct CompactionNote {
    pub(crate) summariser_ms: u64,
    pub(crate) summary_calls: u64,
    pub(crate) fallback: bool,
    pub(crate) from_pending: bool,
    pub(crate) micro: bool,
}

/// What the preparation knows of a turn once it is decided.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct TurnInput<'a> {
    /// Calibrated estimate of what is sent, real tokens.
    pub(crate) est: u64,
    pub(crate) window: u64,
    /// Trigger threshold, real tokens.
    pub(crate) trigger: Option<u64>,
    /// The chained hashes of the messages sent.
    pub(crate) sent: &'a [u128],
    /// Client rows before a compaction, rows sent after it.
    pub(crate) rows: (usize, usize),
    /// Estimate before the compaction (for the compaction's figures).
    pub(crate) est_before: u64,
    pub(crate) compacted: Option<CompactionNote>,
    pub(crate) aborted: bool,
    pub(crate) substituted: bool,
    /// The retry after an upstream overflow (the same turn again).
    pub(crate) overflow_retry: bool,
}

/// The ring and the totals of one conversation.
#[derive(Debug, Default)]
pub(crate) struct TurnLog {
    turns: VecDeque<TurnFigures>,
    compactions: VecDeque<CompactionFigures>,
    /// Turns recorded, ever.
    seq: u64,
    /// API label, model and where the session id came from.
    api: &'static str,
    model: String,
    id_kind: &'static str,
    /// What the previous turn sent: message count, chained hash of the last.
    prev_sent: Option<(usize, u128)>,
    stable_turns: u64,
    compared_turns: u64,
    /// Turns whose usage the upstream reported, and those of them with a
    /// nonzero cache figure; cached prompt tokens in all.
    usage_turns: u64,
    cache_hit_turns: u64,
    cached_tokens: u64,
    last_activity_ms: u64,
    /// Set by the compaction step, taken by [`TurnLog::record`].
    pub(crate) note: Option<CompactionNote>,
}

/// Saturating conversion for the 32-bit figures.
fn u32_of(n: u64) -> u32 {
    u32::try_from(n).unwrap_or(UNKNOWN - 1)
}

/// The id matching a request's usage to its turn: the low bits of the
/// chained hash of the last message sent, mixed with the count.
pub(crate) fn sent_id(len: usize, last: Option<u128>) -> u32 {
    let h = last.unwrap_or(0);
    (h as u32) ^ ((h >> 64) as u32) ^ (len as u32).rotate_left(16)
}

/// Now, Unix milliseconds.
pub(crate) fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

impl TurnLog {
    /// Notes who is talking: the conversation's API, model and session id
    /// source (the model string is copied only when it changes).
    pub(crate) fn identify(&mut self, api: &'static str, model: &str, id_kind: &'static str) {
        self.api = api;
        self.id_kind = id_kind;
        if self.model != model {
            model.clone_into(&mut self.model);
        }
    }

    /// Records a prepared turn at `at_ms`, keeping at most `cap` turns. An
    /// overflow retry updates the turn it retries instead of adding one.
    pub(crate) fn record(&mut self, t: &TurnInput<'_>, at_ms: u64, cap: usize) {
        let note = self.note.take().or(t.compacted);
        let mut flags = 0;
        if note.is_some() {
            flags |= flag::COMPACTED;
        }
        if note.is_some_and(|n| n.fallback) {
            flags |= flag::FALLBACK;
        }
        if note.is_some_and(|n| n.from_pending) {
            flags |= flag::BACKGROUND;
        }
        if t.aborted {
            flags |= flag::ABORTED;
        }
        if t.substituted {
            flags |= flag::SUBSTITUTED;
        }
        let id = sent_id(t.sent.len(), t.sent.last().copied());
        let figures = TurnFigures {
            at_ms,
            est: u32_of(t.est),
            real: UNKNOWN,
            cached: UNKNOWN,
            window: u32_of(t.window),
            trigger: t.trigger.map_or(UNKNOWN, u32_of),
            id,
            flags,
        };
        self.last_activity_ms = at_ms;
        let retried = t.overflow_retry && !self.turns.is_empty();
        if retried {
            if let Some(last) = self.turns.back_mut() {
                // The retry's figures replace the refused request's; it
                // stays marked as retried, its earlier marks kept.
                let kept = last.flags & !(flag::PREFIX_STABLE | flag::PREFIX_COMPARED);
                *last = TurnFigures {
                    flags: figures.flags | kept | flag::OVERFLOW_RETRY,
                    ..figures
                };
            }
        } else {
            self.seq += 1;
            let mut figures = figures;
            if let Some((len, last)) = self.prev_sent {
                figures.flags |= flag::PREFIX_COMPARED;
                self.compared_turns += 1;
                if prefix_stable(len, last, t.sent) {
                    figures.flags |= flag::PREFIX_STABLE;
                    self.stable_turns += 1;
                }
            }
            push_bounded(&mut self.turns, figures, cap);
        }
        if let Some(&h) = t.sent.last() {
            self.prev_sent = Some((t.sent.len(), h));
        }
        if let Some(n) = note {
            let c = CompactionFigures {
                at_ms,
                turn: self.seq,
                rows_before: u32_of(t.rows.0 as u64),
                rows_after: u32_of(t.rows.1 as u64),
                tokens_before: u32_of(t.est_before),
                tokens_after: u32_of(t.est),
                summariser_ms: u32_of(n.summariser_ms),
                summary_calls: u16::try_from(n.summary_calls).unwrap_or(u16::MAX),
                fallback: n.fallback,
                from_pending: n.from_pending,
                micro: n.micro,
            };
            push_bounded(&mut self.compactions, c, MAX_COMPACTIONS);
        }
    }

    /// The upstream's usage for the request sent with `id`: fills in the
    /// newest turn of that id still without it.
    pub(crate) fn usage(&mut self, id: u32, prompt: u64, cached: Option<u64>) {
        self.usage_turns += 1;
        if let Some(c) = cached {
            self.cached_tokens = self.cached_tokens.saturating_add(c);
            self.cache_hit_turns += u64::from(c > 0);
        }
        // Usage comes back in order, a few turns late at most.
        if let Some(t) = self
            .turns
            .iter_mut()
            .rev()
            .take(8)
            .find(|t| t.id == id && t.real == UNKNOWN)
        {
            t.real = u32_of(prompt);
            t.cached = cached.map_or(UNKNOWN, u32_of);
        }
    }

    /// Turns recorded, ever (the ring keeps the last ones).
    // Only tests read it.
    #[cfg(test)]
    pub(crate) fn turns_total(&self) -> u64 {
        self.seq
    }

    /// When the last turn was prepared, Unix milliseconds (0: never).
    // Only tests read it.
    #[cfg(test)]
    pub(crate) fn last_activity_ms(&self) -> u64 {
        self.last_activity_ms
    }

    /// Turns kept.
    // Only tests read it.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.turns.len()
    }

    /// Heap bytes the ring holds (what it costs besides the struct).
    // Only tests read it.
    #[cfg(test)]
    pub(crate) fn heap_bytes(&self) -> usize {
        self.turns.capacity() * std::mem::size_of::<TurnFigures>()
            + self.compactions.capacity() * std::mem::size_of::<CompactionFigures>()
            + self.model.capacity()
    }

    /// The summary figures of the list endpoint.
    pub(crate) fn summary(&self) -> Value {
        let share = |n: u64, of: u64| (of > 0).then(|| n as f64 / of as f64);
        json!({
            "api": none_if_empty(self.api),
            "model": none_if_empty(&self.model),
            "id_kind": none_if_empty(self.id_kind),
            "turns": self.seq,
            "prefix_stable_share": share(self.stable_turns, self.compared_turns),
            "usage_reports": self.usage_turns,
            "cache_hit_turns": self.cache_hit_turns,
            "cached_tokens": self.cached_tokens,
            "last_cached_tokens": self.turns.iter().rev()
                .find(|t| t.cached != UNKNOWN).map(|t| t.cached),
            "last_activity_ms": (self.last_activity_ms > 0).then_some(self.last_activity_ms),
        })
    }

    /// Every kept turn, oldest first, numbered from the conversation's
    /// start.
    pub(crate) fn turns_json(&self) -> Value {
        let first = self.seq + 1 - self.turns.len() as u64;
        let opt = |v: u32| (v != UNKNOWN).then_some(v);
        Value::Array(
            self.turns
                .iter()
                .enumerate()
                .map(|(i, t)| {
                    json!({
                        "turn": first + i as u64,
                        "at_ms": t.at_ms,
                        "est_tokens": t.est,
                        "real_prompt_tokens": opt(t.real),
                        "cached_tokens": opt(t.cached),
                        "window": t.window,
                        "trigger_tokens": opt(t.trigger),
                        "compacted": t.flags & flag::COMPACTED != 0,
                        "fallback": t.flags & flag::FALLBACK != 0,
                        "background": t.flags & flag::BACKGROUND != 0,
                        "overflow_retry": t.flags & flag::OVERFLOW_RETRY != 0,
                        "aborted": t.flags & flag::ABORTED != 0,
                        "substituted": t.flags & flag::SUBSTITUTED != 0,
                        "prefix_stable": (t.flags & flag::PREFIX_COMPARED != 0)
                            .then_some(t.flags & flag::PREFIX_STABLE != 0),
                    })
                })
                .collect(),
        )
    }

    /// Every kept compaction, oldest first.
    pub(crate) fn compactions_json(&self) -> Value {
        Value::Array(
            self.compactions
                .iter()
                .map(|c| {
                    json!({
                        "turn": c.turn,
                        "at_ms": c.at_ms,
                        "rows_before": c.rows_before,
                        "rows_after": c.rows_after,
                        "tokens_before": c.tokens_before,
                        "tokens_after": c.tokens_after,
                        "summariser_ms": c.summariser_ms,
                        "summary_calls": c.summary_calls,
                        "fallback": c.fallback,
                        "source": if c.from_pending { "pending" } else { "inline" },
                        "strategy": if c.micro { "micro" } else { "batch" },
                    })
                })
                .collect(),
        )
    }
}

fn none_if_empty(s: &str) -> Option<&str> {
    (!s.is_empty()).then_some(s)
}

/// Whether what was sent before (`len` messages, the last hashing to
/// `last`) is the start of what is sent now, byte for byte: the hashes are
/// chained, so one equal hash at the same place means an equal prefix.
fn prefix_stable(len: usize, last: u128, now: &[u128]) -> bool {
    len >= 1 && now.get(len - 1) == Some(&last)
}

/// A ring push: at `cap`, the oldest goes; below it, the buffer grows in
/// steps no larger than `cap` (no power-of-two overshoot past the bound).
fn push_bounded<T>(ring: &mut VecDeque<T>, item: T, cap: usize) {
    let cap = cap.max(1);
    while ring.len() >= cap {
        ring.pop_front();
    }
    if ring.len() == ring.capacity() {
        let want = (ring.capacity() * 2).clamp(4, cap);
        ring.reserve_exact(want - ring.len());
    }
    ring.push_back(item);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn turn(sent: &[u128], est: u64) -> TurnInput<'_> {
        TurnInput {
            est,
            window: 1000,
            trigger: Some(750),
            sent,
            rows: (sent.len(), sent.len()),
            est_before: est,
            ..TurnInput::default()
        }
    }

    #[test]
    fn a_turn_record_is_a_few_dozen_bytes() {
        assert_eq!(std::mem::size_of::<TurnFigures>(), 40);
        assert!(std::mem::size_of::<CompactionFigures>() <= 48);
    }

    #[test]
    fn the_ring_keeps_the_last_n_turns_and_their_numbers() {
        let mut log = TurnLog::default();
        let chain: Vec<u128> = (1..=50).collect();
        for i in 1..=30usize {
            log.record(&turn(&chain[..i], i as u64 * 10), i as u64, 8);
        }
        assert_eq!(log.len(), 8);
        assert_eq!(log.turns_total(), 30);
        let turns = log.turns_json();
        let numbers: Vec<u64> = turns
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t["turn"].as_u64().unwrap())
            .collect();
        assert_eq!(numbers, (23..=30).collect::<Vec<_>>());
        assert_eq!(turns[7]["est_tokens"], 300);
        // The buffer never grew past the bound.
        assert!(log.turns.capacity() <= 8, "{}", log.turns.capacity());
        assert_eq!(log.last_activity_ms(), 30);
    }

    #[test]
    fn the_buffer_grows_with_the_conversation_up_to_the_bound() {
        let mut log = TurnLog::default();
        let chain = [1u128];
        log.record(&turn(&chain, 1), 1, 200);
        assert!(log.heap_bytes() <= 4 * 40 + 8, "{}", log.heap_bytes());
        for i in 0..500 {
            log.record(&turn(&chain, 1), i, 200);
        }
        assert_eq!(log.turns.capacity(), 200);
    }

    #[test]
    fn prefix_stability_compares_with_what_the_turn_before_sent() {
        let mut log = TurnLog::default();
        log.record(&turn(&[1, 2], 10), 1, 10);
        log.record(&turn(&[1, 2, 3, 4], 20), 2, 10); // extends: stable
        log.record(&turn(&[9, 4], 5), 3, 10); // compacted: changed
        log.record(&turn(&[9, 4, 5], 6), 4, 10); // stable again
        let t = log.turns_json();
        let stable: Vec<Value> = t
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t["prefix_stable"].clone())
            .collect();
        assert_eq!(
            stable,
            [Value::Null, true.into(), false.into(), true.into()]
        );
        let share = log.summary()["prefix_stable_share"].as_f64().unwrap();
        assert!((share - 2.0 / 3.0).abs() < 1e-9);
    }

    #[test]
    fn usage_fills_in_its_own_turn_and_the_cache_counts() {
        let mut log = TurnLog::default();
        let (a, b) = ([1u128, 2], [1u128, 2, 3]);
        log.record(&turn(&a, 10), 1, 10);
        log.record(&turn(&b, 20), 2, 10);
        // Usage of the first turn arrives after the second was sent.
        log.usage(sent_id(a.len(), a.last().copied()), 11, Some(0));
        log.usage(sent_id(b.len(), b.last().copied()), 22, Some(8));
        // Usage of no kept turn changes no turn.
        log.usage(sent_id(7, Some(77)), 99, None);
        let t = log.turns_json();
        assert_eq!(t[0]["real_prompt_tokens"], 11);
        assert_eq!(t[0]["cached_tokens"], 0);
        assert_eq!(t[1]["real_prompt_tokens"], 22);
        assert_eq!(t[1]["cached_tokens"], 8);
        let s = log.summary();
        assert_eq!(s["usage_reports"], 3);
        assert_eq!(s["cache_hit_turns"], 1);
        assert_eq!(s["cached_tokens"], 8);
        assert_eq!(s["last_cached_tokens"], 8);
    }

    #[test]
    fn a_compaction_and_an_overflow_retry_mark_one_turn() {
        let mut log = TurnLog::default();
        log.record(&turn(&[1, 2, 3], 900), 1, 10);
        // The upstream refused it; the retry compacts.
        log.note = Some(CompactionNote {
            summariser_ms: 1500,
            summary_calls: 2,
            fallback: true,
            ..CompactionNote::default()
        });
        let retry = TurnInput {
            rows: (3, 2),
            est_before: 900,
            overflow_retry: true,
            ..turn(&[7, 3], 300)
        };
        log.record(&retry, 2, 10);
        assert_eq!(log.turns_total(), 1);
        let t = &log.turns_json()[0];
        assert_eq!(t["est_tokens"], 300);
        assert_eq!(t["compacted"], true);
        assert_eq!(t["overflow_retry"], true);
        assert_eq!(t["fallback"], true);
        let c = &log.compactions_json()[0];
        assert_eq!(c["turn"], 1);
        assert_eq!(c["rows_before"], 3);
        assert_eq!(c["rows_after"], 2);
        assert_eq!(c["tokens_before"], 900);
        assert_eq!(c["tokens_after"], 300);
        assert_eq!(c["summariser_ms"], 1500);
        assert_eq!(c["summary_calls"], 2);
        assert_eq!(c["source"], "inline");
        assert!(log.note.is_none(), "the note is taken once");
        log.record(&turn(&[7, 3, 4], 310), 3, 10);
        assert_eq!(log.turns_json()[1]["compacted"], false);
    }

    #[test]
    fn compactions_are_bounded_and_pending_ones_say_so() {
        let mut log = TurnLog::default();
        for i in 0..(MAX_COMPACTIONS as u64 + 5) {
            log.note = Some(CompactionNote {
                from_pending: true,
                micro: true,
                ..CompactionNote::default()
            });
            log.record(&turn(&[u128::from(i)], 1), i, 10);
        }
        let c = log.compactions_json();
        assert_eq!(c.as_array().unwrap().len(), MAX_COMPACTIONS);
        assert_eq!(c[0]["turn"], 6);
        assert_eq!(c[0]["source"], "pending");
        assert_eq!(c[0]["strategy"], "micro");
        assert_eq!(log.turns_json()[9]["background"], true);
    }

    #[test]
    fn identify_keeps_the_labels_and_the_model() {
        let mut log = TurnLog::default();
        assert_eq!(log.summary()["api"], Value::Null);
        log.identify("messages", "claude", "header");
        let s = log.summary();
        assert_eq!(s["api"], "messages");
        assert_eq!(s["model"], "claude");
        assert_eq!(s["id_kind"], "header");
    }
}
