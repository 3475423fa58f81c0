//! Background pre-compaction (`[compaction] background`).
//!
//! Once a conversation's estimate passes `background_threshold_percent` of
//! the trigger, the same engine pass the trigger would run is started on a
//! snapshot of what was sent, off the request path: one per conversation,
//! at most `background_max_concurrent` across all of them. Its result is a
//! candidate record (the client prefix it stands for and its replacement).
//!
//! The turn that crosses the trigger commits the candidate at once when the
//! history still starts with that prefix and the result fits under the
//! trigger; if the pass is still running it waits for it at most as long as
//! an inline compaction may take (`summary_timeout_secs`); otherwise (failed,
//! stale, diverged) the candidate is dropped and the inline compaction runs
//! as without this feature. The pass is a task of its own: a client leaving
//! never cancels it, and a dropped candidate is freed with its task.
//!
//! [`turn`] is where a request's compaction meets the pending pass, before
//! [`super::compact`] would run one inline; what the conversation holds of
//! a pass in flight is [`super::pending::Pending`].

use std::sync::Arc;
use std::time::Duration;

use http::HeaderMap;
use serde_json::value::RawValue;
use tokio::time::Instant;

use crate::compaction::compressor::micro::MicroState;
use crate::compaction::compressor::Carry;
use crate::compaction::config::Strategy;
use crate::compaction::trigger::{Trigger, WindowSource};
use crate::compaction::MicroOutcome;
use crate::compaction::{Compressor, Outcome};
use crate::request::message_hashes;
use crate::upstream::Upstream;

use super::conversation::{rough_message_tokens, Conversation};
use super::decide::Decision;
use super::engine::{
    engine_input, map_back, run_engine, Booked, Caller, CompactionDone, History, Turn,
};
use super::inspect::CompactionNote;
use super::pending::{continues, Candidate, MicroCut, Pending};
use super::record::Record;
use super::summarise::{HttpSummariser, SummaryTarget};
use super::ChatState;

/// What the engine needs of one turn, owned by the background task.
struct Snapshot {
    api: crate::codec::Api,
    /// Ollama's `options.num_ctx` of the turn.
    num_ctx: Option<u64>,
    original: Vec<Box<RawValue>>,
    client_hashes: Vec<u128>,
    outgoing: Vec<Box<RawValue>>,
    record: Option<Arc<Record>>,
    model: String,
    headers: HeaderMap,
    credential_query: Option<String>,
    engine_window: u64,
    max_out_rough: Option<u64>,
    est_rough: u64,
    /// What the conversation's compressor carries (taken by the job's).
    carry: Option<Carry>,
    /// Set for a micro pass: the conversation's rolling micro state.
    micro: Option<MicroState>,
}

/// Sizes the caller already worked out for the trigger.
pub(super) struct Due {
    pub(crate) est_rough: u64,
    pub(crate) threshold: u64,
    pub(crate) engine_window: u64,
    pub(crate) max_out_rough: Option<u64>,
}

/// Drops a pending pre-compaction whose snapshot this history no longer
/// continues (the client edited or started over).
fn discard_if_diverged(chat: &ChatState, conv: &mut Conversation, hashes: &[u128]) {
    let stale = conv
        .pending
        .as_ref()
        .is_some_and(|p| !continues(hashes, p.snap_len, p.snap_hash));
    if stale {
        conv.pending = None;
        chat.metrics.chat.precompaction("discarded");
    }
}

/// Whether this turn's estimate is past the soft threshold
/// (`background_threshold_percent` of the trigger).
fn past_soft_threshold(chat: &ChatState, due: &Due) -> bool {
    let soft = due.threshold as f64 * chat.compaction.background_threshold_percent / 100.0;
    due.est_rough as f64 >= soft
}

/// Starts a pre-compaction when this turn is past the soft threshold and
/// none is running for the conversation (and a global slot is free).
fn maybe_start(
    chat: &ChatState,
    upstream: &Arc<Upstream>,
    conv: &mut Conversation,
    from: (&Caller<'_>, &History<'_>),
    due: &Due,
    base: &Base<'_>,
) {
    if !past_soft_threshold(chat, due) {
        return;
    }
    if conv.pending.as_ref().is_some_and(|p| p.micro) {
        // Past the soft threshold the batch compaction is what comes next.
        conv.pending = None;
        chat.metrics.chat.precompaction("discarded");
    }
    spawn(chat, upstream, conv, from, due, base, false);
}

/// Starts the micro pass a later turn will need (the next exchange, see
/// [`crate::compaction::Compressor::micro_compact_ahead`]), on `base`, what
/// this turn sends: below the soft threshold (above it the slot is left to
/// the batch compaction that will soon be due).
fn maybe_start_micro(
    chat: &ChatState,
    upstream: &Arc<Upstream>,
    conv: &mut Conversation,
    from: (&Caller<'_>, &History<'_>),
    due: &Due,
    base: &Base<'_>,
) {
    if chat.compaction.strategy != Strategy::Micro || past_soft_threshold(chat, due) {
        return;
    }
    if conv.pending.as_ref().is_some_and(|p| !p.micro) {
        // Micro passes brought the conversation back under the soft
        // threshold: the batch compaction it was prepared for is not coming.
        conv.pending = None;
        chat.metrics.chat.precompaction("discarded");
    }
    if conv.pending.is_some() {
        return;
    }
    // Only when there is an exchange to absorb: a pass with nothing to do
    // would hold the slot for no candidate.
    let Some((rows, values)) = engine_input(
        &chat.compaction,
        base.outgoing,
        base.record,
        due.engine_window,
    ) else {
        return;
    };
    let has_cut = rows.is_whole()
        && conv
            .compressor
            .as_mut()
            .and_then(|c| c.micro_cut(&values, true))
            .is_some();
    drop(values);
    if has_cut {
        spawn(chat, upstream, conv, from, due, base, true);
    }
}

/// What a pre-compaction starts from: the messages sent and the record
/// they substitute.
struct Base<'a> {
    pub(crate) outgoing: &'a [Box<RawValue>],
    pub(crate) record: Option<&'a Arc<Record>>,
}

/// Starts the pass on `base` for the caller and client history of `from`.
fn spawn(
    chat: &ChatState,
    upstream: &Arc<Upstream>,
    conv: &mut Conversation,
    (c, h): (&Caller<'_>, &History<'_>),
    due: &Due,
    base: &Base<'_>,
    micro: bool,
) {
    let cfg = Arc::clone(&chat.compaction);
    if !cfg.background || conv.pending.is_some() {
        return;
    }
    let Some(&snap_hash) = h.client_hashes.last() else {
        return;
    };
    let Ok(permit) = Arc::clone(&chat.background).try_acquire_owned() else {
        return;
    };
    let Some(comp) = conv.compressor.as_ref() else {
        return;
    };
    let snap = Snapshot {
        api: c.api,
        num_ctx: c.num_ctx,
        original: h.original.to_vec(),
        client_hashes: h.client_hashes.to_vec(),
        outgoing: base.outgoing.to_vec(),
        record: base.record.cloned(),
        model: c.model.to_owned(),
        headers: c.client.headers.clone(),
        credential_query: c.client.query.map(str::to_owned),
        engine_window: due.engine_window,
        max_out_rough: due.max_out_rough,
        est_rough: due.est_rough,
        carry: Some(comp.carry()),
        micro: micro.then(|| comp.micro_state().clone()),
    };
    let job = Job {
        cfg,
        upstream: Arc::clone(upstream),
        endpoint: chat.summary_endpoint.clone(),
        label: chat.upstream_label.clone(),
        firm_retries: Arc::clone(&chat.firm_retries),
    };
    let handle = tokio::spawn(async move {
        let candidate = job.run(snap).await;
        drop(permit);
        candidate
    });
    chat.metrics.chat.precompaction("started");
    conv.pending = Some(Pending {
        snap_len: h.client_hashes.len(),
        snap_hash,
        micro,
        handle,
    });
}

/// Whether the pending pre-compaction is a micro pass.
fn pending_is_micro(conv: &Conversation) -> bool {
    conv.pending.as_ref().is_some_and(|p| p.micro)
}

/// The pending candidate for this compaction turn, if usable: it waits for
/// a running pass at most `summary_timeout_secs`.
async fn take(
    chat: &ChatState,
    conv: &mut Conversation,
    client_hashes: &[u128],
) -> Option<Candidate> {
    let mut p = conv.pending.take()?;
    let started = Instant::now();
    let limit = Duration::from_secs(chat.compaction.summary_timeout_secs.max(1));
    let done = tokio::time::timeout(limit, &mut p.handle).await;
    chat.metrics
        .chat
        .precompaction_wait
        .observe(started.elapsed());
    let usable = match done {
        Ok(Ok(Some(c))) => {
            let k = c.record.k;
            continues(client_hashes, k, c.record.prefix_hash).then_some(c)
        }
        // Failed, panicked, or slower than an inline compaction (the task
        // finishes on its own and its result is dropped).
        _ => None,
    };
    if usable.is_none() {
        chat.metrics.chat.precompaction("discarded");
    }
    usable
}

/// Whether `send` (the candidate substituted) fits under the trigger: a
/// candidate cut for a shorter history may no longer be enough.
fn fits(send: &[Box<RawValue>], threshold: u64) -> bool {
    let rough: u64 = send.iter().map(|m| rough_message_tokens(m)).sum();
    rough < threshold
}

/// What the background task shares with the chat state.
struct Job {
    cfg: Arc<crate::compaction::config::CompactionConfig>,
    upstream: Arc<Upstream>,
    endpoint: Option<crate::config::UpstreamBase>,
    label: String,
    firm_retries: Arc<super::summarise::FirmRetries>,
}

impl Job {
    /// A compressor of the job's own, seeded with the conversation's
    /// running summary (and micro state, for a micro pass).
    fn compressor(&self, s: &mut Snapshot) -> Compressor {
        let trigger = Trigger::new(
            Arc::clone(&self.cfg),
            &s.model,
            WindowSource::Known(s.engine_window),
            s.max_out_rough,
        )
        .with_base_url(&self.label);
        let cfg = Arc::clone(&self.cfg);
        match s.carry.take() {
            Some(carry) => Compressor::resumed(cfg, trigger, carry, s.micro.take()),
            None => Compressor::new(cfg, trigger),
        }
    }

    /// The engine pass over the snapshot.
    async fn run(self, mut s: Snapshot) -> Option<Candidate> {
        let cfg = Arc::clone(&self.cfg);
        let micro = s.micro.is_some();
        let mut comp = self.compressor(&mut s);
        let (rows, values) = engine_input(&cfg, &s.outgoing, s.record.as_ref(), s.engine_window)?;
        // A micro cut is checked against the turn's own rows: the engine
        // must have been given all of them.
        let cut = if micro {
            if !rows.is_whole() {
                return None;
            }
            Some(comp.micro_cut(&values, true)?)
        } else {
            None
        };
        let started = std::time::Instant::now();
        let summariser = HttpSummariser::new(
            &self.upstream,
            SummaryTarget::configured(
                &cfg,
                self.endpoint.as_ref(),
                &self.upstream,
                s.model.clone(),
            ),
            &s.headers,
            comp.trigger_mut().summariser_budgets().into(),
        )
        .with_credential_query(s.credential_query.as_deref())
        .speaking(s.api)
        .loading(s.num_ctx)
        .learning(&self.firm_retries);
        let mut result = if micro {
            micro_ahead(&mut comp, &values, &summariser).await
        } else {
            // A candidate is a summary, never the last resort: that is decided
            // by the turn that needs the request to fit.
            run_engine(
                &mut comp,
                &values,
                &summariser,
                (false, false),
                s.est_rough,
                None,
            )
            .await
        };
        drop(values);
        rows.adjust(&mut result);
        if result.outcome != Outcome::Compacted {
            return None;
        }
        let (_, record) = map_back(
            &s.original,
            &s.client_hashes,
            &s.outgoing,
            s.record.as_ref(),
            &result,
        );
        let micro = match cut {
            Some((start, end)) => Some(MicroCut {
                start,
                end,
                prefix_hash: *message_hashes(s.outgoing.get(..end)?).last()?,
                state: comp.micro_state().clone(),
            }),
            None => None,
        };
        Some(Candidate {
            record: record?,
            micro,
            carry: comp.into_carry(),
            fallback_used: result.fallback_used,
            feasibility_skip: result.feasibility_skip,
            tokens_before: result.tokens_before,
            tokens_after: result.tokens_after,
            summary_calls: summariser.calls(),
            summariser_ms: u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX),
        })
    }
}

/// The look-ahead micro pass, in the engine pass's shape; anything but an
/// absorbed exchange (a defrag alone, a failure) is no candidate.
async fn micro_ahead(
    comp: &mut Compressor,
    values: &[serde_json::Value],
    summariser: &HttpSummariser<'_>,
) -> CompactionDone {
    let r = comp.micro_compact_ahead(values, summariser).await;
    let absorbed = r.micro_outcome() == Some(MicroOutcome::Absorbed);
    CompactionDone {
        label: r.label(),
        outcome: if absorbed {
            r.outcome()
        } else {
            Outcome::Rejected
        },
        fallback_used: r.fallback_used(),
        feasibility_skip: r.feasibility_skip(),
        tokens_before: r.tokens_before(),
        tokens_after: r.tokens_after(),
        kept_suffix: r.kept_suffix(),
        messages: r.into_messages(),
    }
}

/// After a micro pass on this turn, the pre-compaction of the next one
/// starts from what this turn sends.
pub(super) fn start_after_micro(
    chat: &ChatState,
    upstream: &Arc<Upstream>,
    conv: &mut Conversation,
    t: &Turn<'_>,
    due: &Due,
    booked: &Booked,
) {
    let base = match booked {
        Booked::Compacted(send, Some(rec)) | Booked::Substituted(send, rec) => Base {
            outgoing: send,
            record: Some(rec),
        },
        // Sent without a record of its own: nothing to start from.
        Booked::Compacted(_, None) => return,
        Booked::Aborted | Booked::Nothing => Base {
            outgoing: t.history.outgoing,
            record: t.history.record,
        },
    };
    let from = (&t.caller, &t.history);
    // Past the soft threshold the batch compaction is what will be due.
    maybe_start(chat, upstream, conv, from, due, &base);
    maybe_start_micro(chat, upstream, conv, from, due, &base);
}

/// Pre-compaction on this turn: below the trigger, maybe start one; at the
/// trigger, commit the pending one if it is usable (`None`: go on inline).
pub(super) async fn turn(
    chat: &ChatState,
    upstream: &Arc<Upstream>,
    conv: &mut Conversation,
    t: &Turn<'_>,
    d: &Decision,
    due: &Due,
) -> Option<Booked> {
    let h = &t.history;
    discard_if_diverged(chat, conv, h.client_hashes);
    if d.micro_pass {
        return micro_from_pending(chat, conv, h, due).await;
    }
    if !d.wanted {
        let base = Base {
            outgoing: h.outgoing,
            record: h.record,
        };
        let from = (&t.caller, h);
        maybe_start(chat, upstream, conv, from, due, &base);
        maybe_start_micro(chat, upstream, conv, from, due, &base);
        return None;
    }
    if pending_is_micro(conv) {
        // A micro pass is not the batch compaction this turn needs.
        conv.pending = None;
        chat.metrics.chat.precompaction("discarded");
        return None;
    }
    let c = take(chat, conv, h.client_hashes).await?;
    let send = c.record.applied_to(h.original);
    if !fits(&send, d.threshold) {
        chat.metrics.chat.precompaction("discarded");
        return None;
    }
    let saved = c.tokens_before.saturating_sub(c.tokens_after);
    conv.stats.compactions += 1;
    conv.stats.fallback_compactions += u64::from(c.fallback_used);
    conv.stats.tokens_saved += saved;
    conv.stats.overflow_retries += u64::from(d.force && t.weight.overflow);
    conv.stats.summary_calls += c.summary_calls;
    conv.inspect.note = Some(CompactionNote {
        summariser_ms: c.summariser_ms,
        summary_calls: c.summary_calls,
        fallback: c.fallback_used,
        from_pending: true,
        micro: false,
    });
    chat.metrics.chat.compaction("compacted", saved, None);
    chat.metrics.chat.precompaction("used");
    if let Some(comp) = conv.compressor.as_mut() {
        comp.adopt(c.carry, c.fallback_used, c.feasibility_skip, c.tokens_after);
    }
    Some(commit_pending(
        chat,
        conv,
        h,
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
    h: &History<'_>,
    due: &Due,
) -> Option<Booked> {
    if !pending_is_micro(conv) {
        return None;
    }
    let (start, end) = {
        let comp = conv.compressor.as_mut()?;
        let (rows, values) =
            engine_input(&chat.compaction, h.outgoing, h.record, due.engine_window)?;
        if !rows.is_whole() {
            return None;
        }
        comp.micro_cut(&values, false)?
    };
    let c = take(chat, conv, h.client_hashes).await?;
    let covers = c.micro.as_ref().is_some_and(|m| {
        m.start == start
            && m.end == end
            && h.outgoing
                .get(..end)
                .and_then(|rows| message_hashes(rows).last().copied())
                == Some(m.prefix_hash)
    });
    let Some(cut) = c.micro.filter(|_| covers) else {
        chat.metrics.chat.precompaction("discarded");
        return None;
    };
    let send = c.record.applied_to(h.original);
    let saved = c.tokens_before.saturating_sub(c.tokens_after);
    conv.stats.compactions += 1;
    conv.stats.tokens_saved += saved;
    conv.stats.summary_calls += c.summary_calls;
    conv.inspect.note = Some(CompactionNote {
        summariser_ms: c.summariser_ms,
        summary_calls: c.summary_calls,
        fallback: c.fallback_used,
        from_pending: true,
        micro: true,
    });
    chat.metrics
        .chat
        .compaction(MicroOutcome::Absorbed.as_str(), saved, None);
    chat.metrics.chat.precompaction("used");
    if let Some(comp) = conv.compressor.as_mut() {
        comp.set_micro_state(cut.state);
    }
    Some(commit_pending(
        chat,
        conv,
        h,
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
    h: &History<'_>,
    (tokens_before, tokens_after): (u64, u64),
    record: Record,
    send: Vec<Box<RawValue>>,
    strategy: &'static str,
) -> Booked {
    tracing::info!(
        session = %h.key,
        strategy,
        messages_before = h.outgoing.len(),
        messages_after = send.len(),
        tokens_before,
        tokens_after,
        "compaction from a pre-compaction"
    );
    let rec = chat.commit_record(h.cred, record);
    conv.set_record(Some(&rec));
    Booked::Compacted(send, Some(rec))
}
