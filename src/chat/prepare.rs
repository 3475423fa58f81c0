//! What to send for one request, decided under the conversation lock, in
//! six steps, each a function taking the parts it needs: load (state,
//! window, posted usage) → substitute the recorded prefix → size up →
//! decide and compact → record the turn → build the body.

use std::borrow::Cow;
use std::sync::Arc;

use bytes::Bytes;
use serde_json::value::RawValue;

use crate::codec::ApiRequest;
use crate::session::calibration::{Basis, Cut, Estimate, SentRequest};
use crate::session::key::SessionKey;
use crate::session::store::Entry;
use crate::upstream::Upstream;
use crate::usage::inject::{plan_usage, UsagePlan};
use crate::window::cache::WindowSource;
use crate::window::overflow::Overflow;

use super::compact::compact_if_due;
use super::conversation::{rough_message_tokens, Conversation, Inbox};
use super::engine::{Booked, Caller, History, Turn, Weight};
use super::inspect::TurnInput;
use super::record::Record;
use super::{ChatState, Client, Discovery};

/// Timeout of the window discovery probes.
const DISCOVERY_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

/// What compactor did to a request (`x-compactor-action`). Defined where
/// it is decided; the walk only turns it into `Retried`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// No compaction ran: the messages went as the client sent them, or with
    /// an earlier compaction's recorded prefix substituted (see
    /// [`REPLACED_HEADER`](super::walk::REPLACED_HEADER)); `include_usage`
    /// may have been added.
    Passthrough,
    /// A compaction ran for this request and its result was sent.
    Compacted,
    /// Compacted and retried after an upstream overflow error.
    Retried,
    /// A compaction was attempted and abandoned; the original messages went.
    Aborted,
}

impl Action {
    /// Header value and metric label.
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Action::Passthrough => "passthrough",
            Action::Compacted => "compacted",
            Action::Retried => "retried",
            Action::Aborted => "aborted",
        }
    }
}

/// A request ready to send.
pub(super) struct Prepared {
    pub(crate) body: Bytes,
    pub(crate) action: Action,
    /// Client messages replaced by a compaction record (0 = none).
    pub(crate) replaced: usize,
    pub(crate) plan: UsagePlan,
    pub(crate) sent: Arc<SentRequest>,
    pub(crate) inbox: Inbox,
    /// A compaction was committed while preparing this request (not only a
    /// recorded one substituted).
    pub(crate) fresh_compaction: bool,
    /// Calibrated prompt estimate of `body`.
    pub(crate) est_tokens: u64,
    /// The session key's response header value, when headers are exposed.
    pub(crate) session_value: Option<http::HeaderValue>,
}

/// The messages about to go upstream and where they came from.
struct Outgoing<'a> {
    /// The client's own chain of message hashes.
    client_hashes: Vec<u128>,
    /// What would be sent: the client's messages, or a recorded replacement
    /// followed by the rest of them.
    messages: Cow<'a, [Box<RawValue>]>,
    /// `messages` differ from the client's (the body must be rebuilt).
    changed: bool,
    /// The record substituted (then the one a compaction made), held for
    /// the request: the conversation keeps only a weak reference.
    record: Option<Arc<Record>>,
}

/// What every step reads of the request, and never changes.
#[derive(Clone, Copy)]
struct Ask<'a> {
    model: &'a str,
    client: Client<'a>,
    key: SessionKey,
    cred: u128,
    /// Set on the retry after an upstream overflow error.
    overflow: Option<&'a Overflow>,
    /// The window the request sets itself (Ollama's `options.num_ctx`).
    num_ctx: Option<u64>,
}

/// What the request weighs before anything is compacted.
#[derive(Clone, Copy)]
struct Sizing {
    /// Rough estimate of the tools (part of the fixed cost).
    overhead: u64,
    window: u64,
    max_out: Option<u64>,
}

/// Decides what to send, under the conversation lock: load → substitute →
/// size up → decide and compact → record → build. `overflow` is set on the
/// retry after an upstream overflow error: learn the window and force a
/// compaction.
pub(super) async fn prepare(
    chat: &ChatState,
    upstream: &Arc<Upstream>,
    entry: &Arc<Entry<Conversation>>,
    client: Client<'_>,
    creq: &mut ApiRequest,
    (key, cred, id_kind): (SessionKey, u128, &'static str),
    overflow: Option<&Overflow>,
) -> Prepared {
    // A retry prepares the request the first preparation edited.
    creq.rewind();
    // Owned: the request is edited below while the model is still used.
    let model = creq.model().map(Cow::into_owned).unwrap_or_default();
    let ask = Ask {
        model: &model,
        client,
        key,
        cred,
        overflow,
        num_ctx: creq.requested_window(),
    };
    let mut guard = entry.lock().await;
    let conv: &mut Conversation = &mut guard;
    let window = load(chat, upstream, conv, creq, &ask).await;
    // Moved out, not copied: the history is the bulk of the body, and the
    // original bytes still go upstream unless `with_messages` runs below.
    // Put back once the body is built, for a retry.
    let original: Vec<Box<RawValue>> = creq.take_messages();
    let raw = (creq.raw_hashes(), creq.canonical());
    let mut out = substitute(chat, conv, cred, &original, raw).await;
    let sizing = sizing(conv, creq, window);
    let sized = size_up(chat, upstream, client, conv, creq, &out, sizing).await;
    let before = (out.messages.len(), sized.0.tokens);
    let (action, est) = decide_and_compact(
        chat,
        upstream,
        conv,
        creq,
        &ask,
        (&original, &mut out),
        (sized, sizing),
    )
    .await;
    let seen = Inspected {
        labels: (creq.api().label(), ask.model, id_kind),
        window,
        rows: (before.0, out.messages.len()),
        est_before: before.1,
        substituted: out.record.is_some() && action != Action::Compacted,
        overflow_retry: overflow.is_some(),
    };
    record(chat, conv, &ask, &seen, &est, action);
    let mut prepared = build(creq, conv, out, est, action);
    if chat.expose_headers {
        prepared.session_value = conv.session_value(key);
    }
    creq.restore_messages(original);
    prepared
}

/// Step 1: the conversation's state (from the store once), the window, and
/// the usage responses posted since the last request, judged against it.
async fn load(
    chat: &ChatState,
    upstream: &Upstream,
    conv: &mut Conversation,
    creq: &ApiRequest,
    ask: &Ask<'_>,
) -> u64 {
    super::persist::load(chat, conv, ask.key).await;
    let posted = conv.take_posted();
    if !posted.is_empty() {
        // A model Ollama loads on its first request has a window now.
        chat.windows.answered(&chat.upstream_label, ask.model);
    }
    let (mut window, loading) = resolve_window(chat, upstream, ask).await;
    conv.window_loading = loading;
    if let Some(held) = conv.apply_posted(posted, Some(window)) {
        // A silent truncation below the window believed: what the upstream
        // held is the window it has (the request's own num_ctx aside).
        if ask.num_ctx.is_none() {
            chat.windows
                .learn_limit(&chat.upstream_label, ask.model, held);
            window = held;
        }
    }
    report_truncations(chat, conv, creq.api().label(), ask.key, window);
    conv.note_model(ask.model);
    conv.stats.requests += u64::from(ask.overflow.is_none());
    window
}

/// What the request weighs against `window` besides its messages.
fn sizing(conv: &mut Conversation, creq: &ApiRequest, window: u64) -> Sizing {
    Sizing {
        overhead: conv.tools_overhead(creq.get_raw("tools")),
        window,
        // A reply cap the window cannot hold is no reservation the upstream
        // makes: no request with it could be answered otherwise (Claude Code
        // asks for 32,000 in front of an 8k llama.cpp, which caps the reply
        // at what is left). Counted, it made every request "not fit" and
        // compact.
        max_out: creq.max_output_tokens().filter(|&m| m < window),
    }
}

/// Step 4: the trigger's decision and the compaction it asks for (or a
/// recorded one another replica made), folded into `out`; the action
/// and the estimate of what is now sent. A recorded prefix is a
/// substitution, not a compaction: the action stays `passthrough` and
/// `x-compactor-replaced` says how many client messages it stood for.
async fn decide_and_compact(
    chat: &ChatState,
    upstream: &Arc<Upstream>,
    conv: &mut Conversation,
    creq: &ApiRequest,
    ask: &Ask<'_>,
    (original, out): (&[Box<RawValue>], &mut Outgoing<'_>),
    ((est, margin), sizing): ((Estimate, u64), Sizing),
) -> (Action, Estimate) {
    // On the heap: inline, the turn (224 bytes) is held across the await
    // below and takes the boxed preparation past the allocator's per-thread
    // cache (1,032 bytes), into its slow path, once a request.
    let turn = Box::new(Turn {
        caller: Caller {
            api: creq.api(),
            num_ctx: ask.num_ctx,
            model: ask.model,
            client: ask.client,
            tools: creq.get_raw("tools"),
        },
        history: History {
            key: ask.key,
            cred: ask.cred,
            original,
            client_hashes: &out.client_hashes,
            outgoing: &out.messages,
            outgoing_rough: &est.sent.rough,
            record: out.record.as_ref(),
        },
        weight: Weight {
            est_tokens: est.tokens,
            est_margin: margin,
            max_out: sizing.max_out,
            window: sizing.window,
            tools_tokens: real_tools_tokens(conv, sizing.overhead),
            tools_rough: sizing.overhead,
            overflow: ask.overflow.is_some(),
            overflow_counted: ask.overflow.and_then(|o| o.prompt_tokens.or(o.requested)),
            truncated: std::mem::take(&mut conv.truncated),
        },
    });
    let booked = compact_if_due(chat, upstream, conv, &turn).await;
    drop(turn);
    let (messages, record, action) = match booked {
        Booked::Compacted(messages, record) => (messages, record, Action::Compacted),
        Booked::Substituted(messages, record) => (messages, Some(record), Action::Passthrough),
        Booked::Aborted => return (Action::Aborted, est),
        Booked::Nothing => return (Action::Passthrough, est),
    };
    if record.is_some() {
        out.record = record;
    }
    out.messages = Cow::Owned(messages);
    out.changed = true;
    (action, reestimate(conv, &out.messages, sizing.overhead))
}

/// Step 5: the turn in the inspector's ring, the conversation's state to
/// the store (written behind), the debug line.
fn record(
    chat: &ChatState,
    conv: &mut Conversation,
    ask: &Ask<'_>,
    seen: &Inspected<'_>,
    est: &Estimate,
    action: Action,
) {
    conv.last_action = action.as_str();
    record_turn(chat, conv, seen, est, action);
    super::persist::save(chat, conv, ask.key);
    tracing::debug!(
        session = %ask.key,
        action = action.as_str(),
        messages = seen.rows.1,
        estimated_prompt = est.tokens,
        basis = ?est.basis,
        window = seen.window,
        "chat request prepared"
    );
}

/// What the inspector's turn record needs besides the estimate.
struct Inspected<'a> {
    /// API, model and session id source labels.
    labels: (&'static str, &'a str, &'static str),
    window: u64,
    rows: (usize, usize),
    est_before: u64,
    substituted: bool,
    overflow_retry: bool,
}

/// Records the turn's figures for the inspector: one push into the
/// conversation's bounded ring, under the lock already held.
fn record_turn(
    chat: &ChatState,
    conv: &mut Conversation,
    t: &Inspected<'_>,
    est: &Estimate,
    action: Action,
) {
    let (api, model, id_kind) = t.labels;
    conv.inspect.identify(api, model, id_kind);
    let scale = conv.engine_scale().factor();
    let figures = TurnInput {
        est: est.tokens,
        window: t.window,
        trigger: conv.compressor.as_ref().and_then(|c| {
            let rough = c.trigger().cached_threshold_tokens()?;
            Some((rough as f64 * scale).round() as u64)
        }),
        sent: &est.sent.hashes,
        rows: t.rows,
        est_before: t.est_before,
        compacted: None,
        aborted: action == Action::Aborted,
        substituted: t.substituted,
        overflow_retry: t.overflow_retry,
    };
    conv.inspect
        .record(&figures, super::inspect::now_ms(), chat.turn_history);
}

/// Step 3: the request's estimate and how far it may be short: calibrated, a
/// conversation's first request near the window counted by the upstream's
/// tokenizer, and so is any request within a tenth of the window's edge,
/// where the margin alone would decide whether it fits.
async fn size_up(
    chat: &ChatState,
    upstream: &Upstream,
    client: Client<'_>,
    conv: &mut Conversation,
    creq: &ApiRequest,
    out: &Outgoing<'_>,
    sizing: Sizing,
) -> (Estimate, u64) {
    let Sizing {
        overhead,
        window,
        max_out,
    } = sizing;
    let mut est = estimate(conv, out, overhead, creq.rough());
    // The counts are boxed: they run on a conversation's first turns and
    // near the window's edge, and their state (an upstream call) inline
    // would be part of every request's preparation, copied as it is boxed.
    if first_count_due(&est, window) {
        let counting = (overhead, est.clone());
        if let Some(counted) =
            Box::pin(count_now(chat, upstream, client, conv, creq, out, counting)).await
        {
            est = counted;
        }
    }
    let mut margin = super::decide::estimate_margin(&est);
    if super::decide::count_due(&est, window, max_out.unwrap_or(0)) {
        let counting = (overhead, est.clone());
        if let Some(counted) =
            Box::pin(count_now(chat, upstream, client, conv, creq, out, counting)).await
        {
            est = counted;
            margin = est.tokens / 100;
        }
    }
    (est, margin)
}

/// The request counted by the upstream's tokenizer, when it has one: the
/// count calibrates the conversation and the estimate is made again (now
/// the real count itself).
async fn count_now(
    chat: &ChatState,
    upstream: &Upstream,
    client: Client<'_>,
    conv: &mut Conversation,
    creq: &ApiRequest,
    out: &Outgoing<'_>,
    (overhead, est): (u64, Estimate),
) -> Option<Estimate> {
    let model = creq.model().unwrap_or_default();
    // Counted in the chat shape the tokenizer endpoints take: a Responses
    // or Messages tool list as it is makes them refuse the whole count.
    let tools = creq.chat_tools();
    let tokenizer = &chat.tokenizer;
    let counted = super::count::count(
        tokenizer,
        upstream,
        client,
        &model,
        &out.messages,
        tools.as_deref(),
    )
    .await;
    let real = counted?;
    conv.calibration.observe(Arc::clone(&est.sent), real);
    Some(estimate(conv, out, overhead, creq.rough()))
}

/// A conversation's first request (nothing calibrates it yet) whose rough
/// estimate is at least half the window: near enough to the trigger that
/// chars/4 may decide wrong, so the upstream's tokenizer is asked.
fn first_count_due(est: &Estimate, window: u64) -> bool {
    est.basis == Basis::Uncalibrated && est.tokens.saturating_mul(2) >= window
}

/// The estimate of messages the preparation changed.
fn reestimate(conv: &mut Conversation, messages: &[Box<RawValue>], overhead: u64) -> Estimate {
    let sent_hashes = conv.sent_chain.chain(messages).to_vec();
    conv.calibration
        .estimate(messages, sent_hashes, overhead, rough_message_tokens)
}

/// The tools' rough estimate in the upstream's tokens, by the conversation's
/// calibrated real/rough ratio: the last resort's budget subtracts them from
/// the real window, and an upstream whose template renders tool schemas
/// compactly (or not at all) would otherwise leave no room for the messages.
fn real_tools_tokens(conv: &Conversation, rough: u64) -> u64 {
    match conv.calibration.ratio() {
        Some(r) if r.is_finite() && r > 0.0 => (rough as f64 * r).ceil() as u64,
        _ => rough,
    }
}

/// The context window for `model`: the one the request itself sets
/// (Ollama's `options.num_ctx`, what Ollama loads the model with), else
/// learned from the overflow first when there is one, then looked up (or
/// discovered once) in the window cache; and whether it is the default
/// standing in while Ollama loads the model ([`WindowSource::Loading`]).
async fn resolve_window(chat: &ChatState, upstream: &Upstream, ask: &Ask<'_>) -> (u64, bool) {
    if let Some(of) = ask.overflow {
        chat.learn_window(ask.model, of);
    }
    if let Some(n) = ask.num_ctx {
        return (n, false);
    }
    let discovery = Discovery {
        upstream,
        client_headers: ask.client.headers,
        credential_query: ask.client.query,
        timeout: DISCOVERY_TIMEOUT,
    };
    let r = chat
        .windows
        .resolve(&chat.upstream_label, ask.model, &discovery)
        .await;
    (r.tokens, r.source == WindowSource::Loading)
}

/// Counts the truncations the conversation found since the last request
/// and warns of them, once per conversation (content-free).
fn report_truncations(
    chat: &ChatState,
    conv: &mut Conversation,
    api: &'static str,
    key: SessionKey,
    window: u64,
) {
    let found = std::mem::take(&mut conv.unreported);
    for t in found {
        chat.metrics.chat.truncation(api);
        if !conv.truncation_noted {
            conv.truncation_noted = true;
            tracing::warn!(
                session = %key,
                api,
                estimated_prompt = t.estimated,
                counted_prompt = t.counted,
                window,
                fell_short = matches!(t.cut, Cut::FellShort { .. }),
                "the upstream cut a prompt over its window silently: its count is not calibrated on, \
                 and the conversation is compacted before its next request (warned once per conversation)"
            );
        }
    }
}

/// Step 2: substitutes the longest recorded compaction of this history.
async fn substitute<'a>(
    chat: &ChatState,
    conv: &mut Conversation,
    cred: u128,
    original: &'a [Box<RawValue>],
    (raw, canonical): (&[u64], bool),
) -> Outgoing<'a> {
    let client_hashes = conv
        .client_chain
        .chain_hashed(original, raw, canonical)
        .to_vec();
    let hint = conv.record();
    let record = chat.find_record(cred, &client_hashes, hint.as_ref()).await;
    conv.set_record(record.as_ref());
    if record.is_some() {
        conv.stats.substituted += 1;
    }
    let messages = match &record {
        Some(r) => Cow::Owned(r.applied_to(original)),
        None => Cow::Borrowed(original),
    };
    Outgoing {
        client_hashes,
        messages,
        changed: record.is_some(),
        record,
    }
}

/// Step 3's estimate of what would be sent (calibrated by real usage).
/// `decoded` holds the decode's own estimate of each client message, when
/// the codec made them.
fn estimate(
    conv: &mut Conversation,
    out: &Outgoing<'_>,
    overhead: u64,
    decoded: Option<&[u64]>,
) -> Estimate {
    let (sent_hashes, decoded) = match &out.messages {
        // Sending the client's own history: its chain is already computed.
        Cow::Borrowed(_) => {
            conv.sent_chain.clone_from(&conv.client_chain);
            (out.client_hashes.clone(), decoded)
        }
        Cow::Owned(o) => (conv.sent_chain.chain(o).to_vec(), None),
    };
    let rough = |i: usize, m: &RawValue| match decoded.and_then(|d| d.get(i)) {
        Some(&r) => r,
        None => rough_message_tokens(m),
    };
    conv.calibration
        .estimate_indexed(&out.messages, sent_hashes, overhead, rough)
}

/// Step 6: the body to send; re-serialised only when the messages changed
/// (the usage plan may still add `stream_options`).
fn build(
    creq: &mut ApiRequest,
    conv: &Conversation,
    out: Outgoing<'_>,
    est: Estimate,
    action: Action,
) -> Prepared {
    // An earlier compaction's record sent in place of the client's
    // messages, counted in the client's own messages; a turn that
    // compacts says so in its action instead.
    let replaced = out
        .record
        .as_ref()
        .filter(|_| out.changed && action != Action::Compacted)
        .map_or(0, |r| creq.wire_count(r.k));
    if out.changed {
        creq.with_messages(out.messages.into_owned());
    }
    let plan = match creq.chat_mut() {
        Some(chat) => plan_usage(chat),
        // Anthropic and Responses streams always carry their usage.
        None => UsagePlan {
            stream: creq.stream(),
            client_wants_usage: true,
            forced: false,
        },
    };
    Prepared {
        body: creq.to_bytes(),
        action,
        replaced,
        plan,
        sent: est.sent,
        inbox: Arc::clone(&conv.inbox),
        fresh_compaction: action == Action::Compacted,
        est_tokens: est.tokens,
        session_value: None,
    }
}
