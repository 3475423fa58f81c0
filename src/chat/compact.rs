//! Step 4 of the walk: the compaction a request's decision
//! ([`super::decide`]) asks for, run inline or served by the pending
//! pre-compaction ([`super::background`]), and booked (stats, metrics, the
//! one log line, the record).

use std::sync::Arc;
use std::time::Duration;

use serde_json::value::RawValue;
use serde_json::Value;
use tokio::time::Instant;

use crate::codec::Api;
use crate::compaction::config::Strategy;
use crate::compaction::last_resort::{self, Fit};
use crate::compaction::trigger::Trigger;
use crate::compaction::Outcome;
use crate::upstream::Upstream;

use super::background;
use super::conversation::{rough_message_tokens, Conversation};
use super::decide::{conv_turn_due, decide, Decision, Sizes, ESTIMATE_MARGIN_DIVISOR};
use super::engine::{
    engine_input, map_back, run_engine, Booked, CompactionDone, History, LastResort, Turn, Weight,
};
use super::inspect::CompactionNote;
use super::record::Record;
use super::shared;
use super::summarise::{HttpSummariser, InContext, SummaryTarget};
use super::ChatState;

/// How an engine pass went, for [`book_pass`].
struct PassStats {
    micro_pass: bool,
    force: bool,
    /// The trigger's threshold (rough units).
    threshold: u64,
    /// Why the pass ran ([`Decision::reason`]).
    reason: &'static str,
    /// Real tokens one rough token is worth (the log line is in real ones).
    scale: f64,
    summariser_calls: u64,
    /// Of those, the calls asked after the conversation (prompt cache).
    in_context_calls: u64,
    took: Duration,
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
    upstream: &Arc<Upstream>,
    conv: &mut Conversation,
    t: &Turn<'_>,
) -> Booked {
    let cfg = Arc::clone(&chat.compaction);
    let (h, w) = (&t.history, &t.weight);
    let scale = conv.engine_scale();
    conv.real_window = Some(w.window);
    let engine_window = scale.to_rough(w.window);
    let est_rough = scale.to_rough(w.est_tokens);
    let micro_due = cfg.strategy == Strategy::Micro
        && conv_turn_due(conv.stats.requests, cfg.micro_every_n_turns);
    let noted = conv.no_room_noted;
    let comp = conv.compressor(
        &cfg,
        t.caller.model,
        &chat.upstream_label,
        engine_window,
        w.max_out.map(|m| scale.to_rough(m)),
    );
    let no_room = measure_fixed_part(comp.trigger_mut(), h, w, (est_rough, noted));
    let d = judge(comp.trigger_mut(), w, est_rough, micro_due);
    conv.no_room_noted |= no_room;
    // The awaits below are boxed: a claim and an engine pass run on few
    // turns, a background turn only when configured. Inline, their state
    // would be part of every request's preparation, which is boxed whole:
    // each byte copied, and kilobytes are past the allocator's fast path.
    //
    // Across replicas: before a batch compaction (inline or committing a
    // pre-compaction), another replica's record may already cover this.
    let held = if d.wanted {
        match Box::pin(shared::claim(chat, h)).await {
            shared::Claim::Found(rec) => return substitute_peer(conv, h.original, rec),
            shared::Claim::Owned(held) => Some(held),
            shared::Claim::Alone => None,
        }
    } else {
        None
    };
    let mut booked = None;
    let mut due = None;
    if cfg.background {
        let bg = background::Due {
            est_rough,
            threshold: d.threshold,
            engine_window,
            max_out_rough: w.max_out.map(|m| scale.to_rough(m)),
        };
        booked = Box::pin(background::turn(chat, upstream, conv, t, &d, &bg)).await;
        due = Some(bg);
    }
    let booked = match booked {
        Some(b) => b,
        None if !(d.wanted || d.micro_pass) => Booked::Nothing,
        None => {
            Box::pin(compact_now(
                chat,
                upstream,
                conv,
                t,
                &d,
                (engine_window, est_rough),
            ))
            .await
        }
    };
    if let Some(held) = held {
        let record = match &booked {
            Booked::Compacted(_, rec) => rec.as_ref(),
            _ => None,
        };
        shared::release(chat, held, record);
    }
    if let Some(due) = due.as_ref().filter(|_| d.micro_pass) {
        background::start_after_micro(chat, upstream, conv, t, due, &booked);
    }
    booked
}

/// Measures the request's fixed part when the estimate (`est_rough`) is
/// near the trigger (it moves the trigger and sizes what a compaction
/// leaves; far below the trigger nothing depends on it). Returns whether it
/// leaves no room, warning once per conversation (`noted`: already warned).
fn measure_fixed_part(
    trigger: &mut Trigger,
    h: &History<'_>,
    w: &Weight,
    (est_rough, noted): (u64, bool),
) -> bool {
    if est_rough < trigger.threshold_tokens() / 2 {
        return false;
    }
    trigger.set_fixed_tokens(fixed_part(h.outgoing, w.tools_rough));
    let no_room = trigger.no_room();
    if no_room && !noted {
        tracing::warn!(
            session = %h.key,
            fixed_tokens = trigger.fixed_tokens(),
            threshold = trigger.threshold_tokens(),
            window = w.window,
            "the instructions and tools leave no room under the trigger: compaction can only cut"
        );
    }
    no_room
}

/// The request's fixed part in rough tokens: its tools and every
/// instruction row (never compacted, so never made smaller).
fn fixed_part(outgoing: &[Box<RawValue>], tools_rough: u64) -> u64 {
    outgoing
        .iter()
        .filter(|m| crate::request::is_instruction_message(m))
        .map(|m| rough_message_tokens(m))
        .fold(tools_rough, u64::saturating_add)
}

/// Sends another replica's record in place of a compaction here, on the
/// client's `original` messages.
fn substitute_peer(
    conv: &mut Conversation,
    original: &[Box<RawValue>],
    rec: Arc<Record>,
) -> Booked {
    let send = rec
        .replacement
        .iter()
        .chain(original.get(rec.k..).unwrap_or(&[]))
        .cloned()
        .collect();
    conv.set_record(Some(&rec));
    conv.stats.substituted += 1;
    Booked::Substituted(send, rec)
}

/// Step 4: the engine pass the decision asked for, booked.
async fn compact_now(
    chat: &ChatState,
    upstream: &Arc<Upstream>,
    conv: &mut Conversation,
    t: &Turn<'_>,
    d: &Decision,
    (engine_window, est_rough): (u64, u64),
) -> Booked {
    let cfg = Arc::clone(&chat.compaction);
    let (c, h, w) = (&t.caller, &t.history, &t.weight);
    let conv_scale = conv.engine_scale().factor();
    let Some(comp) = conv.compressor.as_mut() else {
        return Booked::Nothing;
    };
    let Some((rows, values)) = engine_input(&cfg, h.outgoing, h.record, engine_window) else {
        return Booked::Nothing;
    };
    let summariser = HttpSummariser::new(
        upstream,
        SummaryTarget::configured(
            &cfg,
            chat.summary_endpoint.as_ref(),
            upstream,
            c.model.to_owned(),
        ),
        c.client.headers,
        comp.trigger_mut().summariser_budgets().into(),
    )
    .with_credential_query(c.client.query)
    .speaking(c.api)
    .loading(c.num_ctx)
    .learning(&chat.firm_retries);
    let summariser = match c.api {
        Api::Chat if cfg.summary_in_context => summariser.after(InContext {
            messages: h.outgoing,
            rough: h.outgoing_rough,
            tools: c.tools,
            // No margin: what the ask follows was counted by the upstream
            // (the previous request, or the most of it), and what the
            // estimate may miss of the new messages is not sent with it.
            room: w.window as i64 - w.est_tokens as i64,
            scale: conv_scale,
        }),
        _ => summariser,
    };
    // After an overflow the upstream's refusal is proof the messages do
    // not fit, whatever the estimate says the last resort can reach.
    let fit = if w.overflow || w.truncated {
        Fit::Insist
    } else {
        Fit::IfReachable
    };
    let last_resort = LastResort {
        window: fit_budget(&values, w),
        fit,
        settle: settle_mark(comp.trigger_mut(), w.tools_rough),
    };
    let started = Instant::now();
    let mut result = run_engine(
        comp,
        &values,
        &summariser,
        (d.micro_pass, d.force),
        est_rough,
        Some(last_resort),
    )
    .await;
    drop(values);
    let took = started.elapsed();
    rows.adjust(&mut result);
    // The batch trigger's deferral and strike rules judge batch
    // compactions only; a micro pass is routine.
    if result.outcome == Outcome::Compacted && !d.micro_pass {
        comp.trigger_mut().record_completed_compaction(
            result.fallback_used,
            result.feasibility_skip,
            result.tokens_after,
        );
    }
    let stats = PassStats {
        micro_pass: d.micro_pass,
        force: d.force,
        threshold: d.threshold,
        reason: d.reason,
        scale: conv_scale,
        summariser_calls: summariser.calls(),
        in_context_calls: summariser.in_context_calls(),
        took,
    };
    book_pass(chat, conv, (h, w), &stats, &result)
}

impl PassStats {
    /// `rough` engine tokens in real ones.
    fn real(&self, rough: u64) -> u64 {
        (rough as f64 * self.scale).round() as u64
    }
}

/// The trigger's decision for the turn weighing `w`. A silent truncation
/// is an overflow the upstream did not report: the conversation is
/// compacted now, as after an overflow error.
fn judge(trigger: &mut Trigger, w: &Weight, est_rough: u64, micro_due: bool) -> Decision {
    let sizes = Sizes {
        est_real: w.est_tokens,
        margin: w.est_margin,
        est_rough,
        max_out: w.max_out,
        window: w.window,
    };
    let mut d = decide(trigger, sizes, w.overflow || w.truncated, micro_due);
    if w.truncated && !w.overflow {
        d.reason = "truncated";
    }
    d
}

/// Books a finished engine pass: conversation stats, metrics and the log
/// line; a committed compaction also becomes a record. Synchronous: the
/// pass itself (the summariser's I/O) is over.
fn book_pass(
    chat: &ChatState,
    conv: &mut Conversation,
    (h, w): (&History<'_>, &Weight),
    p: &PassStats,
    result: &CompactionDone,
) -> Booked {
    let summariser_took = (p.summariser_calls > 0).then_some(p.took);
    conv.stats.summary_calls += p.summariser_calls;
    match result.outcome {
        Outcome::Compacted => {
            let saved = result.tokens_before.saturating_sub(result.tokens_after);
            conv.inspect.note = Some(CompactionNote {
                summariser_ms: u64::try_from(p.took.as_millis()).unwrap_or(u64::MAX),
                summary_calls: p.summariser_calls,
                fallback: result.fallback_used,
                from_pending: false,
                micro: p.micro_pass,
            });
            conv.stats.compactions += 1;
            conv.stats.fallback_compactions += u64::from(result.fallback_used);
            conv.stats.tokens_saved += saved;
            conv.stats.overflow_retries += u64::from(p.force && w.overflow);
            chat.metrics
                .chat
                .compaction(result.label, saved, summariser_took);
            let (new_outgoing, record) = commit_record(chat, conv, h, result);
            let saved_real = p.real(saved);
            // Every figure in real tokens: the estimate before and after, the
            // trigger it was judged against, the window.
            tracing::info!(
                session = %h.key,
                outcome = result.label,
                reason = p.reason,
                fallback = result.fallback_used,
                messages_before = h.outgoing.len(),
                messages_after = new_outgoing.len(),
                estimated_prompt = w.est_tokens,
                estimated_after = w.est_tokens.saturating_sub(saved_real),
                saved = saved_real,
                trigger = p.real(p.threshold),
                window = w.window,
                summariser_calls = p.summariser_calls,
                in_context = p.in_context_calls,
                summariser_ms = p.took.as_millis() as u64,
                "compaction"
            );
            Booked::Compacted(new_outgoing, record)
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
            let reason = match other {
                Outcome::Aborted(r) => Some(format!("{r:?}")),
                Outcome::NoOp(r) => Some(format!("{r:?}")),
                _ => None,
            };
            tracing::info!(
                session = %h.key,
                outcome = result.label,
                reason = p.reason,
                why_not = reason,
                messages = h.outgoing.len(),
                estimated_prompt = w.est_tokens,
                trigger = p.real(p.threshold),
                window = w.window,
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

/// What the messages may take for the request to fit at all: the engine's
/// last resort shortens messages down to it.
fn fit_budget(values: &[Value], w: &Weight) -> u64 {
    last_resort::fit_budget(
        values,
        last_resort::FitInputs {
            estimate: w.est_tokens,
            counted: w.overflow_counted,
            tools: w.tools_tokens,
            window: w.window,
            max_out: w.max_out.unwrap_or(0),
            margin_divisor: ESTIMATE_MARGIN_DIVISOR,
        },
    )
}

/// Where a compaction's messages should settle: halfway between its
/// target (the fixed part plus the history target) and the trigger, less
/// the tools. A result over the trigger would be compacted again on the
/// next turn; one just under it, on the turn after. `None` until the fixed
/// part is known.
fn settle_mark(trigger: &mut Trigger, tools_rough: u64) -> Option<u64> {
    let fixed = trigger.fixed_tokens();
    if fixed == 0 {
        return None;
    }
    let target = fixed.saturating_add(trigger.history_target());
    let mark = target / 2 + trigger.threshold_tokens() / 2;
    Some(mark.saturating_sub(tools_rough))
}

/// Stores the record of a committed compaction and returns what to send.
fn commit_record(
    chat: &ChatState,
    conv: &mut Conversation,
    h: &History<'_>,
    result: &CompactionDone,
) -> (Vec<Box<RawValue>>, Option<Arc<Record>>) {
    let (send, record) = map_back(h.original, h.client_hashes, h.outgoing, h.record, result);
    let Some(record) = record else {
        return (send, None);
    };
    let rec = chat.commit_record(h.cred, record);
    conv.set_record(Some(&rec));
    (send, Some(rec))
}
