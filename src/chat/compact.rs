//! Steps 3 and 4 of the walk: decide whether this request is compacted
//! (the pure [`decide`]), run the engine, and book the pass (stats, metrics,
//! the one log line, the record).

use std::sync::Arc;
use std::time::Duration;

use serde_json::value::RawValue;
use serde_json::Value;
use tokio::time::Instant;

use crate::codec::Api;
use crate::compaction::config::{CompactionConfig, Strategy};
use crate::compaction::last_resort::{self, Fit};
use crate::compaction::markers;
use crate::compaction::micro::MicroOutcome;
use crate::compaction::trigger::Trigger;
use crate::compaction::{CompressOptions, Compressor, Outcome};
use crate::request::message_hashes;
use crate::session::calibration::{Basis, Estimate};
use crate::session::key::SessionKey;
use crate::upstream::Upstream;

use super::background;
use super::conversation::{rough_message_tokens, Conversation};
use super::inspect::CompactionNote;
use super::record::Record;
use super::shared;
use super::summarise::{HttpSummariser, SummaryTarget};
use super::ChatState;

/// "Fits the window" needs the estimate plus 1/10 of it (see [`decide`]),
/// unless the upstream counted all but the newest messages (see
/// [`estimate_margin`]).
const ESTIMATE_MARGIN_DIVISOR: u64 = 10;

/// How far the estimate of a request may be short of the real count. An
/// estimate that extends a request the upstream counted is that real count
/// plus the calibrated estimate of what was added: only the added part is
/// uncertain, so a third of it is margin (the added part is priced by the
/// conversation's own marginal ratio; a misjudged one costs an overflow
/// retry, not a lost request), and at least 1% of the whole, at most the
/// tenth that anything else keeps: at an 8k window with a 6k fixed part the
/// tenth alone took ~750 tokens, more than a turn, and every turn compacted
/// again because the last one "did not fit". Near the window's edge the
/// upstream's tokenizer, when it has one, settles it instead
/// (`prepare::size_up`).
pub(super) fn estimate_margin(est: &Estimate, last_real: Option<u64>) -> u64 {
    margin(est.tokens, est.basis, last_real)
}

fn margin(tokens: u64, basis: Basis, last_real: Option<u64>) -> u64 {
    let whole = tokens / ESTIMATE_MARGIN_DIVISOR;
    match (basis, last_real) {
        (Basis::Incremental { .. }, Some(real)) if real <= tokens => {
            ((tokens - real) / 3).max(tokens / 100).min(whole)
        }
        _ => whole,
    }
}

/// A bounded engine pass keeps this many rows beyond the protected head at
/// the start, and at least this many beyond twice `protect_last_n` at the
/// end.
const BOUND_HEAD_EXTRA: usize = 64;
/// A bounded engine pass is given the newest rows worth this many windows.
const BOUND_TAIL_WINDOWS: u64 = 4;

/// One request as the compaction steps see it.
pub(super) struct Turn<'a> {
    /// The API the request speaks (summaries are asked in it too).
    pub api: Api,
    pub key: SessionKey,
    pub cred: u128,
    pub model: &'a str,
    /// The client (the summariser presents its credentials).
    pub client: super::Client<'a>,
    /// The client's messages and their chain.
    pub original: &'a [Box<RawValue>],
    pub client_hashes: &'a [u128],
    /// What would be sent (after substitution): what the engine is given.
    pub outgoing: &'a [Box<RawValue>],
    /// The record substituted into `outgoing`, if any.
    pub record: Option<&'a Arc<Record>>,
    /// Calibrated prompt estimate of `outgoing`, real tokens.
    pub est_tokens: u64,
    /// The request's output cap, real tokens.
    pub max_out: Option<u64>,
    /// The context window, real tokens.
    pub window: u64,
    /// Estimate of the request's `tools` (part of the fixed cost), real
    /// tokens once the conversation is calibrated.
    pub tools_tokens: u64,
    /// The same, rough (the engine's units).
    pub tools_rough: u64,
    /// This is the retry after an upstream overflow.
    pub overflow: bool,
    /// The prompt size the upstream counted in that overflow, if it said.
    pub overflow_counted: Option<u64>,
    /// How far `est_tokens` may be short ([`estimate_margin`]).
    pub est_margin: u64,
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
    let scale = conv.engine_scale();
    conv.real_window = Some(t.window);
    let engine_window = scale.to_rough(t.window);
    let est_rough = scale.to_rough(t.est_tokens);
    let micro_due = cfg.strategy == Strategy::Micro
        && conv_turn_due(conv.stats.requests, cfg.micro_every_n_turns);
    let noted = conv.no_room_noted;
    let comp = conv.compressor(
        &cfg,
        t.model,
        &chat.upstream_label,
        engine_window,
        t.max_out.map(|m| scale.to_rough(m)),
    );
    let no_room = measure_fixed_part(&mut comp.trigger, t, est_rough, noted);
    let d = decide(
        &mut comp.trigger,
        Sizes {
            est_real: t.est_tokens,
            margin: t.est_margin,
            est_rough,
            max_out: t.max_out,
            window: t.window,
        },
        t.overflow,
        micro_due,
    );
    conv.no_room_noted |= no_room;
    // The awaits below are boxed: a claim and an engine pass run on few
    // turns, a background turn only when configured. Inline, their state
    // would be part of every request's preparation, which is boxed whole:
    // each byte copied, and kilobytes are past the allocator's fast path.
    //
    // Across replicas: before a batch compaction (inline or committing a
    // pre-compaction), another replica's record may already cover this.
    let held = if d.wanted {
        match Box::pin(shared::claim(chat, t)).await {
            shared::Claim::Found(rec) => return substitute_peer(conv, t, rec),
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
            max_out_rough: t.max_out.map(|m| scale.to_rough(m)),
        };
        booked = Box::pin(background_turn(chat, upstream, conv, t, &d, &bg)).await;
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
        start_after_micro(chat, upstream, conv, t, due, &booked);
    }
    booked
}

/// Measures the request's fixed part when the estimate is near the
/// trigger (it moves the trigger and sizes what a compaction leaves; far
/// below the trigger nothing depends on it). Returns whether it leaves no
/// room, warning once per conversation (`noted`: already warned).
fn measure_fixed_part(trigger: &mut Trigger, t: &Turn<'_>, est_rough: u64, noted: bool) -> bool {
    if est_rough < trigger.threshold_tokens() / 2 {
        return false;
    }
    trigger.set_fixed_tokens(fixed_part(t));
    let no_room = trigger.no_room();
    if no_room && !noted {
        tracing::warn!(
            session = %t.key,
            fixed_tokens = trigger.fixed_tokens(),
            threshold = trigger.threshold_tokens(),
            window = t.window,
            "the instructions and tools leave no room under the trigger: compaction can only cut"
        );
    }
    no_room
}

/// The request's fixed part in rough tokens: its tools and every
/// instruction row (never compacted, so never made smaller).
fn fixed_part(t: &Turn<'_>) -> u64 {
    t.outgoing
        .iter()
        .filter(|m| crate::request::is_instruction_message(m))
        .map(|m| rough_message_tokens(m))
        .fold(t.tools_rough, u64::saturating_add)
}

/// Sends another replica's record in place of a compaction here.
fn substitute_peer(conv: &mut Conversation, t: &Turn<'_>, rec: Arc<Record>) -> Booked {
    let send = rec
        .replacement
        .iter()
        .chain(t.original.get(rec.k..).unwrap_or(&[]))
        .cloned()
        .collect();
    conv.set_record(Some(&rec));
    conv.stats.substituted += 1;
    Booked::Substituted(send, rec)
}

/// After a micro pass on this turn, the pre-compaction of the next one
/// starts from what this turn sends.
fn start_after_micro(
    chat: &ChatState,
    upstream: &Arc<Upstream>,
    conv: &mut Conversation,
    t: &Turn<'_>,
    due: &background::Due,
    booked: &Booked,
) {
    let base = match booked {
        Booked::Compacted(send, Some(rec)) | Booked::Substituted(send, rec) => background::Base {
            outgoing: send,
            record: Some(rec),
        },
        // Sent without a record of its own: nothing to start from.
        Booked::Compacted(_, None) => return,
        Booked::Aborted | Booked::Nothing => background::Base {
            outgoing: t.outgoing,
            record: t.record,
        },
    };
    // Past the soft threshold the batch compaction is what will be due.
    background::maybe_start(chat, upstream, conv, t, due, &base);
    background::maybe_start_micro(chat, upstream, conv, t, due, &base);
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
    let Some(comp) = conv.compressor.as_mut() else {
        return Booked::Nothing;
    };
    let Some((rows, values)) = engine_input(&cfg, t.outgoing, t.record, engine_window) else {
        return Booked::Nothing;
    };
    let summariser = HttpSummariser::new(
        upstream,
        SummaryTarget::configured(
            &cfg,
            chat.summary_endpoint.as_ref(),
            upstream,
            t.model.to_owned(),
        ),
        t.client.headers,
        comp.trigger.summariser_budgets().into(),
    )
    .with_credential_query(t.client.query)
    .speaking(t.api)
    .learning(&chat.firm_retries);
    // After an overflow the upstream's refusal is proof the messages do
    // not fit, whatever the estimate says the last resort can reach.
    let fit = if t.overflow {
        Fit::Insist
    } else {
        Fit::IfReachable
    };
    let last_resort = LastResort {
        window: fit_budget(&values, t),
        fit,
        settle: settle_mark(&mut comp.trigger, t.tools_rough),
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

/// Pre-compaction on this turn: below the trigger, maybe start one; at the
/// trigger, commit the pending one if it is usable (`None`: go on inline).
async fn background_turn(
    chat: &ChatState,
    upstream: &Arc<Upstream>,
    conv: &mut Conversation,
    t: &Turn<'_>,
    d: &Decision,
    due: &background::Due,
) -> Option<Booked> {
    background::discard_if_diverged(chat, conv, t.client_hashes);
    if d.micro_pass {
        return micro_from_pending(chat, conv, t, due).await;
    }
    if !d.wanted {
        let base = background::Base {
            outgoing: t.outgoing,
            record: t.record,
        };
        background::maybe_start(chat, upstream, conv, t, due, &base);
        background::maybe_start_micro(chat, upstream, conv, t, due, &base);
        return None;
    }
    if background::pending_is_micro(conv) {
        // A micro pass is not the batch compaction this turn needs.
        conv.pending = None;
        chat.metrics.chat.precompaction("discarded");
        return None;
    }
    let c = background::take(chat, conv, t).await?;
    let send = c.record.applied_to(t.original);
    if !background::fits(&send, d.threshold) {
        chat.metrics.chat.precompaction("discarded");
        return None;
    }
    let saved = c.tokens_before.saturating_sub(c.tokens_after);
    conv.stats.compactions += 1;
    conv.stats.fallback_compactions += u64::from(c.fallback_used);
    conv.stats.tokens_saved += saved;
    conv.stats.overflow_retries += u64::from(d.force);
    conv.inspect.note = Some(CompactionNote {
        fallback: c.fallback_used,
        from_pending: true,
        ..CompactionNote::default()
    });
    chat.metrics.chat.compaction("compacted", saved, None);
    chat.metrics.chat.precompaction("used");
    if let Some(comp) = conv.compressor.as_mut() {
        comp.previous_summary = c.previous_summary;
        comp.summary_has_user_turn = c.has_user_turn;
        comp.trigger.compression_count = comp.trigger.compression_count.saturating_add(1);
        comp.micro = Default::default();
        comp.trigger.record_completed_compaction(
            c.fallback_used,
            c.feasibility_skip,
            c.tokens_after,
        );
    }
    Some(commit_pending(
        chat,
        conv,
        t,
        (c.tokens_before, c.tokens_after),
        c.record,
        send,
        "batch",
    ))
}

/// A micro turn served by the pending micro pass: committed when it
/// absorbed exactly the exchange this turn's own pass would (same rows up
/// to its end), else discarded (`None`: the pass runs inline). While this
/// turn has nothing to absorb, the pending pass is kept for a later turn.
async fn micro_from_pending(
    chat: &ChatState,
    conv: &mut Conversation,
    t: &Turn<'_>,
    due: &background::Due,
) -> Option<Booked> {
    if !background::pending_is_micro(conv) {
        return None;
    }
    let (start, end) = {
        let comp = conv.compressor.as_mut()?;
        let (rows, values) =
            engine_input(&chat.compaction, t.outgoing, t.record, due.engine_window)?;
        if !rows.is_whole() {
            return None;
        }
        comp.micro_cut(&values, false)?
    };
    let c = background::take(chat, conv, t).await?;
    let covers = c.micro.as_ref().is_some_and(|m| {
        m.start == start
            && m.end == end
            && t.outgoing
                .get(..end)
                .and_then(|rows| message_hashes(rows).last().copied())
                == Some(m.prefix_hash)
    });
    let Some(cut) = c.micro.filter(|_| covers) else {
        chat.metrics.chat.precompaction("discarded");
        return None;
    };
    let send = c.record.applied_to(t.original);
    let saved = c.tokens_before.saturating_sub(c.tokens_after);
    conv.stats.compactions += 1;
    conv.stats.tokens_saved += saved;
    conv.inspect.note = Some(CompactionNote {
        from_pending: true,
        micro: true,
        ..CompactionNote::default()
    });
    chat.metrics
        .chat
        .compaction(MicroOutcome::Absorbed.as_str(), saved, None);
    chat.metrics.chat.precompaction("used");
    if let Some(comp) = conv.compressor.as_mut() {
        comp.micro = cut.state;
    }
    Some(commit_pending(
        chat,
        conv,
        t,
        (c.tokens_before, c.tokens_after),
        c.record,
        send,
        "micro",
    ))
}

/// Commits a pending pre-compaction a turn is served by: one log line,
/// the record stored, the conversation pointed at it.
fn commit_pending(
    chat: &ChatState,
    conv: &mut Conversation,
    t: &Turn<'_>,
    (tokens_before, tokens_after): (u64, u64),
    record: Record,
    send: Vec<Box<RawValue>>,
    strategy: &'static str,
) -> Booked {
    tracing::info!(
        session = %t.key,
        strategy,
        messages_before = t.outgoing.len(),
        messages_after = send.len(),
        tokens_before,
        tokens_after,
        "compaction from a pre-compaction"
    );
    let rec = chat.commit_record(t.cred, record);
    conv.set_record(Some(&rec));
    Booked::Compacted(send, Some(rec))
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
            conv.stats.overflow_retries += u64::from(p.force);
            chat.metrics
                .chat
                .compaction(result.label, saved, summariser_took);
            let (new_outgoing, record) = commit_record(chat, conv, t, result);
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
                session = %t.key,
                outcome = result.label,
                reason,
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

/// What the messages may take for the request to fit at all: the engine's
/// last resort shortens messages down to it.
fn fit_budget(values: &[Value], t: &Turn<'_>) -> u64 {
    last_resort::fit_budget(
        values,
        last_resort::FitInputs {
            estimate: t.est_tokens,
            counted: t.overflow_counted,
            tools: t.tools_tokens,
            window: t.window,
            max_out: t.max_out.unwrap_or(0),
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

/// Whether request number `requests` (1-based) is a micro-compaction turn.
fn conv_turn_due(requests: u64, every_n: u32) -> bool {
    requests % u64::from(every_n.max(1)) == 0
}

/// What a request's size looks like to the trigger.
struct Sizes {
    /// Calibrated prompt estimate, real tokens.
    est_real: u64,
    /// How far it may be short, real tokens.
    margin: u64,
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
    let fits_window = s.est_real + s.margin + s.max_out.unwrap_or(0) < s.window;
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

/// What the engine's last resort aims at in a pass that must be sent.
#[derive(Clone, Copy)]
pub(super) struct LastResort {
    /// Rough tokens the messages must fit for the request to fit the window.
    window: u64,
    /// How firmly.
    fit: Fit,
    /// Rough tokens a compacted result's messages should settle under.
    settle: Option<u64>,
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
        messages: r.messages,
        outcome: r.outcome,
        fallback_used: r.fallback_used,
        feasibility_skip: r.feasibility_skip,
        tokens_before: r.tokens_before,
        tokens_after: r.tokens_after,
        kept_suffix: r.kept_suffix,
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

/// Stores the record of a committed compaction and returns what to send.
fn commit_record(
    chat: &ChatState,
    conv: &mut Conversation,
    t: &Turn<'_>,
    result: &CompactionDone,
) -> (Vec<Box<RawValue>>, Option<Arc<Record>>) {
    let (send, record) = map_back(t.original, t.client_hashes, t.outgoing, t.record, result);
    let Some(record) = record else {
        return (send, None);
    };
    let rec = chat.commit_record(t.cred, record);
    conv.set_record(Some(&rec));
    (send, Some(rec))
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
    use crate::compaction::config::CompactionConfig;
    use crate::compaction::trigger::WindowSource;

    const WINDOW: u64 = 10_000;

    fn trigger() -> Trigger {
        let cfg = Arc::new(CompactionConfig::default());
        Trigger::new(cfg, "m", WindowSource::Known(WINDOW), None)
    }

    fn sizes(est: u64) -> Sizes {
        Sizes {
            est_real: est,
            margin: est / ESTIMATE_MARGIN_DIVISOR,
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

    #[test]
    fn only_what_the_upstream_did_not_count_is_uncertain() {
        let inc = Basis::Incremental { reused: 10 };
        // 7,400 counted, 550 added: a third of the addition.
        assert_eq!(margin(7_950, inc, Some(7_400)), 183);
        // Never under 1% of the whole, never over the tenth.
        assert_eq!(margin(8_000, inc, Some(7_990)), 80);
        assert_eq!(margin(8_000, inc, Some(100)), 800);
        // Not extending a counted request: the tenth.
        assert_eq!(margin(7_950, Basis::Ratio, Some(7_400)), 795);
        assert_eq!(margin(7_950, Basis::Uncalibrated, None), 795);
        assert_eq!(margin(7_950, inc, None), 795);
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
