//! Steps 3 and 4 of the walk: decide whether this request is compacted
//! (the pure [`decide`]), run the engine, and book the pass (stats, metrics,
//! the one log line, the record).

use std::sync::Arc;
use std::time::Duration;

use http::HeaderMap;
use serde_json::value::RawValue;
use serde_json::Value;
use tokio::time::Instant;

use crate::compaction::config::Strategy;
use crate::compaction::trigger::Trigger;
use crate::compaction::{CompressOptions, Compressor, Outcome};
use crate::session::key::SessionKey;
use crate::upstream::Upstream;

use super::conversation::{rough_message_tokens, Conversation};
use super::record::Record;
use super::summarise::{budgets_for_window, HttpSummariser, SummaryTarget};
use super::ChatState;

/// "Fits the window" needs the estimate plus 1/10 of it (see [`decide`]).
const ESTIMATE_MARGIN_DIVISOR: u64 = 10;

/// One request as the compaction steps see it.
pub(super) struct Turn<'a> {
    pub key: SessionKey,
    pub cred: u128,
    pub model: &'a str,
    /// The client's headers (the summariser presents their credentials).
    pub client_headers: &'a HeaderMap,
    /// The client's messages and their chain.
    pub original: &'a [Box<RawValue>],
    pub client_hashes: &'a [u128],
    /// What would be sent (after substitution): what the engine is given.
    pub outgoing: &'a [Box<RawValue>],
    /// Calibrated prompt estimate of `outgoing`, real tokens.
    pub est_tokens: u64,
    /// The request's output cap, real tokens.
    pub max_out: Option<u64>,
    /// The context window, real tokens.
    pub window: u64,
    /// This is the retry after an upstream overflow.
    pub overflow: bool,
}

/// How an engine pass went, for [`book_pass`].
struct PassStats {
    micro_pass: bool,
    force: bool,
    /// The trigger's threshold (rough units).
    threshold: u64,
    summariser_calls: u64,
    took: Duration,
}

/// What a booked pass leaves the request with.
pub(super) enum Booked {
    /// Send these messages instead (the compaction is recorded).
    Compacted(Vec<Box<RawValue>>),
    /// The compaction was abandoned; the messages go as they were.
    Aborted,
    /// Nothing to change.
    Nothing,
}

/// Steps 3 and 4: decides, and when due runs the engine under the lock.
///
/// The engine budgets (threshold, tail, summary, summariser prompt) in rough
/// chars/4 tokens. When the upstream's tokenizer is denser, every compaction
/// would land short of the real window, be judged ineffective and leave each
/// later turn to overflow. So the engine sees the window in rough units
/// (scaled by the calibrated real/rough ratio) and gets rough-unit figures;
/// the window check itself stays in real tokens.
pub(super) async fn compact_if_due(
    chat: &ChatState,
    upstream: &Upstream,
    conv: &mut Conversation,
    t: &Turn<'_>,
) -> Booked {
    let cfg = Arc::clone(&chat.compaction);
    let scale = conv.engine_scale();
    conv.real_window = Some(t.window);
    let engine_window = scale.to_rough(t.window);
    let est_rough = scale.to_rough(t.est_tokens);
    let micro_due = cfg.strategy == Strategy::Micro
        && conv_turn_due(conv.stats.requests, cfg.micro_every_n_turns);
    let comp = conv.compressor(
        &cfg,
        t.model,
        &chat.upstream_label,
        engine_window,
        t.max_out.map(|m| scale.to_rough(m)),
    );
    let d = decide(
        &mut comp.trigger,
        Sizes {
            est_real: t.est_tokens,
            est_rough,
            max_out: t.max_out,
            window: t.window,
        },
        t.overflow,
        micro_due,
    );
    if !(d.wanted || d.micro_pass) {
        return Booked::Nothing;
    }
    let Ok(values) = t
        .outgoing
        .iter()
        .map(|m| serde_json::from_str::<Value>(m.get()))
        .collect::<Result<Vec<Value>, _>>()
    else {
        return Booked::Nothing;
    };
    let summariser = HttpSummariser::new(
        upstream,
        SummaryTarget {
            base: chat.summary_endpoint.as_ref().unwrap_or(upstream.base()),
            main_model: t.model.to_owned(),
            api_key: cfg.summary_api_key.as_deref(),
            timeout: Duration::from_secs(cfg.summary_timeout_secs.max(1)),
        },
        t.client_headers,
        budgets_for_window(Some(engine_window), comp.trigger.max_summary_tokens()),
    );
    let started = Instant::now();
    let result = run_engine(comp, &values, &summariser, d.micro_pass, d.force, est_rough).await;
    let took = started.elapsed();
    // The batch trigger's deferral and strike rules judge batch
    // compactions only; a micro pass is routine.
    if result.outcome == Outcome::Compacted && !d.micro_pass {
        comp.trigger.record_completed_compaction(
            result.fallback_used,
            result.feasibility_skip,
            result.tokens_after,
        );
    }
    let stats = PassStats {
        micro_pass: d.micro_pass,
        force: d.force,
        threshold: d.threshold,
        summariser_calls: summariser.calls(),
        took,
    };
    book_pass(chat, conv, t, &stats, &result)
}

/// Books a finished engine pass: conversation stats, metrics and the log
/// line; a committed compaction also becomes a record. Synchronous: the
/// pass itself (the summariser's I/O) is over.
fn book_pass(
    chat: &ChatState,
    conv: &mut Conversation,
    t: &Turn<'_>,
    p: &PassStats,
    result: &CompactionDone,
) -> Booked {
    let summariser_took = (p.summariser_calls > 0).then_some(p.took);
    match result.outcome {
        Outcome::Compacted => {
            let saved = result.tokens_before.saturating_sub(result.tokens_after);
            conv.stats.compactions += 1;
            conv.stats.fallback_compactions += u64::from(result.fallback_used);
            conv.stats.tokens_saved += saved;
            conv.stats.overflow_retries += u64::from(p.force);
            chat.metrics
                .chat
                .compaction(result.label, saved, summariser_took);
            let new_outgoing = commit_record(
                chat,
                conv,
                t.cred,
                t.original,
                t.client_hashes,
                t.outgoing,
                result,
            );
            tracing::info!(
                session = %t.key,
                outcome = result.label,
                fallback = result.fallback_used,
                messages_before = t.outgoing.len(),
                messages_after = new_outgoing.len(),
                tokens_before = result.tokens_before,
                tokens_after = result.tokens_after,
                estimated_prompt = t.est_tokens,
                threshold = p.threshold,
                window = t.window,
                summariser_calls = p.summariser_calls,
                summariser_ms = p.took.as_millis() as u64,
                "compaction"
            );
            Booked::Compacted(new_outgoing)
        }
        // A micro pass with nothing to absorb is no event.
        Outcome::Rejected | Outcome::NoOp(_) if p.micro_pass && p.summariser_calls == 0 => {
            Booked::Nothing
        }
        other => {
            let aborted = matches!(other, Outcome::Aborted(_));
            if aborted {
                conv.stats.aborted += 1;
            }
            chat.metrics
                .chat
                .compaction(result.label, 0, summariser_took);
            tracing::info!(
                outcome = result.label,
                messages = t.outgoing.len(),
                estimated_prompt = t.est_tokens,
                threshold = p.threshold,
                window = t.window,
                summariser_calls = p.summariser_calls,
                summariser_ms = p.took.as_millis() as u64,
                "compaction not committed"
            );
            if aborted {
                Booked::Aborted
            } else {
                Booked::Nothing
            }
        }
    }
}

/// Whether request number `requests` (1-based) is a micro-compaction turn.
fn conv_turn_due(requests: u64, every_n: u32) -> bool {
    requests % u64::from(every_n.max(1)) == 0
}

/// What a request's size looks like to the trigger.
struct Sizes {
    /// Calibrated prompt estimate, real tokens.
    est_real: u64,
    /// The same in the engine's rough units.
    est_rough: u64,
    /// The request's output cap, real tokens.
    max_out: Option<u64>,
    /// The context window, real tokens.
    window: u64,
}

/// Whether and how a request is compacted.
struct Decision {
    /// The trigger's threshold (rough units), for the log line.
    threshold: u64,
    /// A batch compaction runs.
    wanted: bool,
    /// A micro pass runs instead (strategy `micro`, its turn, no batch).
    micro_pass: bool,
    /// The compaction must happen now (after an overflow, no cooldown).
    force: bool,
}

/// The trigger decision, free of I/O (the trigger keeps its own counters).
fn decide(trigger: &mut Trigger, s: Sizes, overflow: bool, micro_due: bool) -> Decision {
    let threshold = trigger.threshold_tokens();
    // The estimate is calibrated but still char-based: a tool output of
    // file listings tokenizes denser than prose. Near the window's edge a
    // few percent decide between an answer and an overflow round trip, so
    // "fits" keeps a margin.
    let fits_window =
        s.est_real + s.est_real / ESTIMATE_MARGIN_DIVISOR + s.max_out.unwrap_or(0) < s.window;
    // Right after a compaction the rough figure is not trusted until the
    // upstream reports real usage (the engine's deferral), unless the request
    // would not even fit the window.
    let defer = trigger.awaiting_real_usage_after_compression && fits_window;
    // After an overflow the compaction must happen. It clears a failure
    // cooldown only when none is running: a summariser that just failed is
    // not asked again, the engine uses its deterministic fallback.
    let force = overflow && trigger.cooldown_remaining().is_none();
    // A request that cannot fit the window is compacted even while the
    // trigger is blocked (cooldown, breaker): forwarding it can only fail.
    let must = overflow || !fits_window;
    let wanted = must
        || (!defer
            && s.est_rough >= threshold
            && trigger.should_compress(Some(s.est_rough as i64)));
    // Micro-compaction is per turn (every Nth turn, whatever the size); over the threshold the batch compaction still runs, since
    // absorbing one exchange per request cannot keep up with a full window.
    let micro_pass = !wanted && !overflow && micro_due;
    Decision {
        threshold,
        wanted,
        micro_pass,
        force,
    }
}

/// One engine pass over `values`: a micro pass (one exchange absorbed) or
/// a batch compaction, reported in one shape.
async fn run_engine(
    comp: &mut Compressor,
    values: &[Value],
    summariser: &HttpSummariser<'_>,
    micro_pass: bool,
    force: bool,
    current_tokens: u64,
) -> CompactionDone {
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
                ..CompressOptions::default()
            },
        )
        .await
    };
    CompactionDone {
        label: r.label(),
        messages: r.messages,
        outcome: r.outcome,
        fallback_used: r.fallback_used,
        feasibility_skip: r.feasibility_skip,
        tokens_before: r.tokens_before,
        tokens_after: r.tokens_after,
        kept_suffix: r.kept_suffix,
    }
}

/// A compaction attempt, batch or micro, in one shape.
struct CompactionDone {
    messages: Vec<Value>,
    outcome: Outcome,
    fallback_used: bool,
    feasibility_skip: bool,
    tokens_before: u64,
    tokens_after: u64,
    kept_suffix: usize,
    label: &'static str,
}

/// Stores the record of a committed compaction and returns what to send.
///
/// The engine compacted `outgoing` = `old replacement (r) + original[k_old..]`
/// and kept its last `kept_suffix` rows. Mapped back onto the client's own
/// history, the new record stands for `original[..k_new]`.
fn commit_record(
    chat: &ChatState,
    conv: &mut Conversation,
    cred: u128,
    original: &[Box<RawValue>],
    client_hashes: &[u128],
    outgoing: &[Box<RawValue>],
    result: &CompactionDone,
) -> Vec<Box<RawValue>> {
    let (r, k_old, old_rep): (usize, usize, &[Box<RawValue>]) = match &conv.record {
        Some(rec) => (rec.replacement.len(), rec.k, &rec.replacement),
        None => (0, 0, &[]),
    };
    let kept = result
        .kept_suffix
        .min(outgoing.len())
        .min(result.messages.len());
    let replaced_out = outgoing.len() - kept;
    let new_head = &result.messages[..result.messages.len() - kept];
    let mut replacement: Vec<Box<RawValue>> = new_head.iter().filter_map(to_raw).collect();
    let k_new = if replaced_out >= r {
        k_old + (replaced_out - r)
    } else {
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
        let rec = chat.records.insert(
            cred,
            Record::new(
                k_new,
                client_hashes[k_new - 1],
                replacement,
                original_tokens,
                replacement_tokens,
            ),
        );
        conv.record = Some(rec);
    }
    send
}

fn to_raw(v: &Value) -> Option<Box<RawValue>> {
    serde_json::value::to_raw_value(v).ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::compaction::config::CompactionConfig;
    use crate::compaction::trigger::{Clock, WindowSource};

    const WINDOW: u64 = 10_000;

    fn trigger() -> Trigger {
        let cfg = Arc::new(CompactionConfig::default());
        Trigger::new(cfg, "m", WindowSource::Known(WINDOW), None).with_clock(Clock::manual())
    }

    fn sizes(est: u64) -> Sizes {
        Sizes {
            est_real: est,
            est_rough: est,
            max_out: None,
            window: WINDOW,
        }
    }

    /// The trigger's threshold for [`WINDOW`].
    fn threshold() -> u64 {
        decide(&mut trigger(), sizes(0), false, false).threshold
    }

    #[test]
    fn below_the_threshold_nothing_runs_and_above_it_a_batch_does() {
        let th = threshold();
        assert!(
            th + th / ESTIMATE_MARGIN_DIVISOR < WINDOW,
            "test needs a fitting threshold"
        );
        let d = decide(&mut trigger(), sizes(th - 1), false, false);
        assert!(!d.wanted && !d.micro_pass && !d.force);
        let d = decide(&mut trigger(), sizes(th), false, false);
        assert!(d.wanted && !d.micro_pass && !d.force);
    }

    #[test]
    fn deferral_holds_unless_the_request_cannot_fit() {
        let th = threshold();
        let mut t = trigger();
        t.awaiting_real_usage_after_compression = true;
        assert!(!decide(&mut t, sizes(th), false, false).wanted);
        // Estimate plus its margin over the window: compacted anyway.
        let d = decide(&mut t, sizes(WINDOW - WINDOW / 20), false, false);
        assert!(d.wanted && !d.force);
        // The output cap counts towards fitting too.
        let s = Sizes {
            max_out: Some(WINDOW / 2),
            ..sizes(th)
        };
        assert!(decide(&mut t, s, false, false).wanted);
    }

    #[test]
    fn an_overflow_forces_a_compaction_whatever_the_size() {
        let d = decide(&mut trigger(), sizes(10), true, true);
        assert!(d.wanted && d.force && !d.micro_pass);
    }

    #[test]
    fn a_micro_pass_runs_on_its_turn_below_the_threshold_only() {
        let th = threshold();
        let d = decide(&mut trigger(), sizes(10), false, true);
        assert!(d.micro_pass && !d.wanted);
        let d = decide(&mut trigger(), sizes(th), false, true);
        assert!(d.wanted && !d.micro_pass);
        assert!(!decide(&mut trigger(), sizes(10), false, false).micro_pass);
    }
}
