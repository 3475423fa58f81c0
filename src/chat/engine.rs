//! The engine glue the inline pass ([`super::compact`]) and the pending
//! one ([`super::background`]) share: the turn as both see it, the rows the
//! engine is given, one engine pass, and its result mapped back onto the
//! client's history as a record.

use std::sync::Arc;

use serde_json::value::RawValue;
use serde_json::Value;

use crate::codec::Api;
use crate::compaction::config::CompactionConfig;
use crate::compaction::last_resort::Fit;
use crate::compaction::markers;
use crate::compaction::{CompressOptions, Compressor, Outcome};
use crate::session::key::SessionKey;

use super::conversation::rough_message_tokens;
use super::record::Record;
use super::summarise::HttpSummariser;

/// A bounded engine pass keeps this many rows beyond the protected head at
/// the start, and at least this many beyond twice `protect_last_n` at the
/// end.
const BOUND_HEAD_EXTRA: usize = 64;
/// A bounded engine pass is given the newest rows worth this many windows.
const BOUND_TAIL_WINDOWS: u64 = 4;

/// One request as the compaction steps see it: who sent it, the history
/// it carries, and what it weighs against its window. A step takes the
/// part it reads; only the steps that run a pass (or start one) take all.
pub(super) struct Turn<'a> {
    pub(super) caller: Caller<'a>,
    pub(super) history: History<'a>,
    pub(super) weight: Weight,
}

/// Who sent the request: a summary call speaks its API, to its model, with
/// its credentials.
pub(super) struct Caller<'a> {
    pub(super) api: Api,
    /// Ollama's `options.num_ctx` (the window the request loads the model
    /// with), asked with the summary too.
    pub(super) num_ctx: Option<u64>,
    pub(super) model: &'a str,
    pub(super) client: super::Client<'a>,
    /// The request's `tools` as the client sent them (a summary asked after
    /// the conversation sends them again, for the prompt cache).
    pub(super) tools: Option<&'a RawValue>,
}

/// The conversation as the request carries it, and whose it is.
pub(super) struct History<'a> {
    pub(super) key: SessionKey,
    /// The credential its records are addressed by.
    pub(super) cred: u128,
    /// The client's messages and their chain.
    pub(super) original: &'a [Box<RawValue>],
    pub(super) client_hashes: &'a [u128],
    /// What would be sent (after substitution): what the engine is given.
    pub(super) outgoing: &'a [Box<RawValue>],
    /// The estimate's rough size of each of `outgoing`.
    pub(super) outgoing_rough: &'a [u64],
    /// The record substituted into `outgoing`, if any.
    pub(super) record: Option<&'a Arc<Record>>,
}

/// What the request weighs against its window, in real tokens unless
/// said otherwise.
#[derive(Clone, Copy)]
pub(super) struct Weight {
    /// Calibrated prompt estimate of `outgoing`.
    pub(super) est_tokens: u64,
    /// How far `est_tokens` may be short ([`super::decide::estimate_margin`]).
    pub(super) est_margin: u64,
    /// The request's output cap.
    pub(super) max_out: Option<u64>,
    /// The context window.
    pub(super) window: u64,
    /// Estimate of the request's `tools` (part of the fixed cost), real
    /// tokens once the conversation is calibrated.
    pub(super) tools_tokens: u64,
    /// The same, rough (the engine's units).
    pub(super) tools_rough: u64,
    /// This is the retry after an upstream overflow.
    pub(super) overflow: bool,
    /// The prompt size the upstream counted in that overflow, if it said.
    pub(super) overflow_counted: Option<u64>,
    /// The upstream cut the conversation's last reply's prompt silently.
    pub(super) truncated: bool,
}

/// What a booked pass leaves the request with.
pub(super) enum Booked {
    /// Send these messages instead (the compaction is recorded: the new
    /// record, unless it could not be mapped onto the client's history).
    Compacted(Vec<Box<RawValue>>, Option<Arc<Record>>),
    /// Another replica's record covers more of this history: send this
    /// instead (a substitution, no compaction here).
    Substituted(Vec<Box<RawValue>>, Arc<Record>),
    /// The compaction was abandoned; the messages go as they were.
    Aborted,
    /// Nothing to change.
    Nothing,
}

/// What the engine's last resort aims at in a pass that must be sent.
#[derive(Clone, Copy)]
pub(super) struct LastResort {
    /// Rough tokens the messages must fit for the request to fit the window.
    pub(super) window: u64,
    /// How firmly.
    pub(super) fit: Fit,
    /// Rough tokens a compacted result's messages should settle under.
    pub(super) settle: Option<u64>,
}

/// One engine pass over `values`: a micro pass (one exchange absorbed) or
/// a batch compaction, reported in one shape.
pub(super) async fn run_engine(
    comp: &mut Compressor,
    values: &[Value],
    summariser: &HttpSummariser<'_>,
    (micro_pass, force): (bool, bool),
    current_tokens: u64,
    fit: Option<LastResort>,
) -> CompactionDone {
    comp.judge_by_history(values);
    let r = if micro_pass {
        comp.micro_compact(values, summariser).await
    } else {
        comp.compress(
            values,
            summariser,
            CompressOptions {
                force,
                current_tokens: Some(current_tokens),
                bypass_cooldown: force,
                fit_tokens: fit.map(|f| f.window),
                fit: fit.map(|f| f.fit).unwrap_or_default(),
                settle_tokens: fit.and_then(|f| f.settle),
                ..CompressOptions::default()
            },
        )
        .await
    };
    CompactionDone {
        label: r.label(),
        outcome: r.outcome(),
        fallback_used: r.fallback_used(),
        feasibility_skip: r.feasibility_skip(),
        tokens_before: r.tokens_before(),
        tokens_after: r.tokens_after(),
        kept_suffix: r.kept_suffix(),
        messages: r.into_messages(),
    }
}

/// The rows of the outgoing history the engine works on.
///
/// All of them, unless the history is far larger than the window: then the
/// head and the newest rows worth [`BOUND_TAIL_WINDOWS`] windows. The engine
/// keeps at most a window's worth of tail and summarises a bounded input
/// (its chunks drop the middle of anything longer), so the rows in between
/// could only be dropped anyway; parsing every one of 100,000 messages into
/// a JSON tree (and the engine's copies of those) is what made a 4 MB body
/// take 350 MB. The skipped rows are compacted away unsummarised: the
/// replacement still stands for the whole prefix.
pub(super) struct EngineRows {
    /// Rows `..head_end` and `tail_start..` go to the engine.
    head_end: usize,
    tail_start: usize,
    /// Rows from `tail_start` to the end.
    tail_len: usize,
    /// Rough tokens of the skipped rows.
    skipped_tokens: u64,
}

impl EngineRows {
    pub(super) fn of(
        outgoing: &[Box<RawValue>],
        head: usize,
        window: u64,
        min_tail: usize,
    ) -> Self {
        let n = outgoing.len();
        let whole = Self {
            head_end: n,
            tail_start: n,
            tail_len: 0,
            skipped_tokens: 0,
        };
        if n <= head + min_tail {
            return whole;
        }
        // Byte-based (chars/4 and a little per row): no parsing.
        let rough = |m: &RawValue| (m.get().len() / 4) as u64 + 4;
        let budget = window.max(1).saturating_mul(BOUND_TAIL_WINDOWS);
        let mut acc = 0u64;
        let mut tail_start = n;
        while tail_start > head {
            let t = rough(&outgoing[tail_start - 1]);
            if acc + t > budget && n - tail_start >= min_tail {
                break;
            }
            acc += t;
            tail_start -= 1;
        }
        if tail_start <= head {
            return whole;
        }
        let skipped_tokens = outgoing[head..tail_start].iter().map(|m| rough(m)).sum();
        tracing::info!(
            messages = n,
            skipped = tail_start - head,
            "history far beyond the window: the engine gets its head and newest rows"
        );
        Self {
            head_end: head,
            tail_start,
            tail_len: n - tail_start,
            skipped_tokens,
        }
    }

    /// Every row goes to the engine.
    pub(super) fn is_whole(&self) -> bool {
        self.tail_start <= self.head_end
    }

    /// Where row `i` of the whole history is in the engine's input, if it
    /// is given to the engine.
    fn position(&self, i: usize) -> Option<usize> {
        if i < self.head_end {
            Some(i)
        } else if i >= self.tail_start.max(self.head_end) {
            Some(self.head_end + (i - self.tail_start.max(self.head_end)))
        } else {
            None
        }
    }

    pub(super) fn iter<'a>(
        &self,
        outgoing: &'a [Box<RawValue>],
    ) -> impl Iterator<Item = &'a Box<RawValue>> {
        outgoing[..self.head_end]
            .iter()
            .chain(&outgoing[self.tail_start.max(self.head_end)..])
    }

    /// Maps a pass over the bounded rows back onto the whole history: the
    /// kept suffix cannot reach past the newest rows, and the skipped rows
    /// count as compacted away.
    pub(super) fn adjust(&self, result: &mut CompactionDone) {
        if self.tail_start <= self.head_end {
            return;
        }
        result.kept_suffix = result.kept_suffix.min(self.tail_len);
        result.tokens_before += self.skipped_tokens;
    }
}

/// The rows the engine works on (see [`EngineRows`]), parsed, with the
/// summary rows of the substituted `record` (it fills `outgoing`'s start)
/// declared as such and nothing else: a declaration a client sent is
/// removed, so only a record can make a message compactor's summary.
pub(super) fn engine_input(
    cfg: &CompactionConfig,
    outgoing: &[Box<RawValue>],
    record: Option<&Arc<Record>>,
    engine_window: u64,
) -> Option<(EngineRows, Vec<Value>)> {
    let rows = EngineRows::of(
        outgoing,
        cfg.protect_first_n + BOUND_HEAD_EXTRA,
        engine_window,
        cfg.protect_last_n.saturating_mul(2) + BOUND_HEAD_EXTRA,
    );
    let mut values = rows
        .iter(outgoing)
        .map(|m| serde_json::from_str::<Value>(m.get()))
        .collect::<Result<Vec<Value>, _>>()
        .ok()?;
    for v in &mut values {
        markers::undeclare_summary(v);
    }
    for i in record.into_iter().flat_map(|r| r.summary_rows()) {
        if let Some(v) = rows.position(i).and_then(|p| values.get_mut(p)) {
            markers::declare_summary(v);
        }
    }
    Some((rows, values))
}

/// A compaction attempt, batch or micro, in one shape.
pub(super) struct CompactionDone {
    pub(super) messages: Vec<Value>,
    pub(super) outcome: Outcome,
    pub(super) fallback_used: bool,
    pub(super) feasibility_skip: bool,
    pub(super) tokens_before: u64,
    pub(super) tokens_after: u64,
    pub(super) kept_suffix: usize,
    pub(super) label: &'static str,
}

/// Maps a committed pass back onto the client's history: what to send and
/// the record (none when it cannot be mapped).
///
/// The engine compacted `outgoing` = `old replacement (r) + original[k_old..]`
/// and kept its last `kept_suffix` rows. Mapped back onto the client's own
/// history, the new record stands for `original[..k_new]`.
pub(super) fn map_back(
    original: &[Box<RawValue>],
    client_hashes: &[u128],
    outgoing: &[Box<RawValue>],
    old: Option<&Arc<Record>>,
    result: &CompactionDone,
) -> (Vec<Box<RawValue>>, Option<Record>) {
    let (r, k_old, old_rep): (usize, usize, &[Box<RawValue>]) = match old {
        Some(rec) => (rec.replacement.len(), rec.k, &rec.replacement),
        None => (0, 0, &[]),
    };
    let kept = result
        .kept_suffix
        .min(outgoing.len())
        .min(result.messages.len());
    let replaced_out = outgoing.len() - kept;
    let new_head = &result.messages[..result.messages.len() - kept];
    // The engine's declarations say which rows are summaries; they are
    // recorded beside the replacement, never sent.
    let mut summary_rows: Vec<usize> = Vec::new();
    let mut replacement: Vec<Box<RawValue>> = Vec::with_capacity(new_head.len());
    for v in new_head {
        let mut v = v.clone();
        if markers::undeclare_summary(&mut v) {
            summary_rows.push(replacement.len());
        }
        replacement.extend(to_raw(&v));
    }
    let k_new = if replaced_out >= r {
        k_old + (replaced_out - r)
    } else {
        let carried = old.into_iter().flat_map(|rec| rec.summary_rows());
        let base = replacement.len();
        summary_rows.extend(
            carried
                .filter(|&j| j >= replaced_out)
                .map(|j| base + j - replaced_out),
        );
        replacement.extend(old_rep[replaced_out..].iter().cloned());
        k_old
    };
    let send: Vec<Box<RawValue>> = replacement
        .iter()
        .cloned()
        .chain(original.get(k_new..).unwrap_or(&[]).iter().cloned())
        .collect();
    if k_new >= 1
        && k_new <= client_hashes.len()
        && replacement.len() == new_head.len() + r.saturating_sub(replaced_out)
    {
        let replacement_tokens: u64 = replacement.iter().map(|m| rough_message_tokens(m)).sum();
        let original_tokens: u64 = original[..k_new]
            .iter()
            .map(|m| rough_message_tokens(m))
            .sum();
        let record = Record::new(
            k_new,
            client_hashes[k_new - 1],
            replacement,
            original_tokens,
            replacement_tokens,
        )
        .with_summary_rows(summary_rows);
        return (send, Some(record));
    }
    (send, None)
}

fn to_raw(v: &Value) -> Option<Box<RawValue>> {
    serde_json::value::to_raw_value(v).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    const WINDOW: u64 = 10_000;

    fn rows(n: usize) -> Vec<Box<RawValue>> {
        (0..n)
            .map(|i| to_raw(&serde_json::json!({"role":"user","content":format!("hi {i}")})))
            .map(|r| r.expect("raw"))
            .collect()
    }

    #[test]
    fn the_engine_gets_the_head_and_the_newest_rows_of_a_huge_history() {
        let out = rows(10_000);
        let r = EngineRows::of(&out, 10, 100, 20);
        assert_eq!(r.head_end, 10);
        assert!(r.tail_len >= 20 && r.tail_len < 100, "{}", r.tail_len);
        assert_eq!(r.tail_start + r.tail_len, out.len());
        assert!(r.skipped_tokens > 0);
        let given: Vec<&str> = r.iter(&out).map(|m| m.get()).collect();
        assert_eq!(given.len(), 10 + r.tail_len);
        assert_eq!(given[9], out[9].get());
        assert_eq!(given[10], out[r.tail_start].get());
        // Within a few windows: all of it.
        let small = rows(300);
        let r = EngineRows::of(&small, 10, 1_000, 20);
        assert_eq!(r.iter(&small).count(), small.len());
        assert_eq!(r.skipped_tokens, 0);
    }

    /// Only a record declares summary rows: a declaration a client put on
    /// its own message is removed, a record's summary rows are declared.
    #[test]
    fn the_engine_input_declares_the_record_summary_rows_only() {
        let cfg = CompactionConfig::default();
        let mut row = serde_json::json!({"role":"user","content":"forged"});
        markers::declare_summary(&mut row);
        let mut out = rows(4);
        out[2] = to_raw(&row).expect("raw");
        let (_, values) = engine_input(&cfg, &out, None, WINDOW).expect("input");
        assert!(!values.iter().any(markers::is_declared_summary));
        let record =
            Arc::new(Record::new(2, 1, out[..2].to_vec(), 0, 0).with_summary_rows(vec![1]));
        let (_, values) = engine_input(&cfg, &out, Some(&record), WINDOW).expect("input");
        let declared: Vec<bool> = values.iter().map(markers::is_declared_summary).collect();
        assert_eq!(declared, [false, true, false, false]);
    }
}
