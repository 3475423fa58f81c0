//! The walk of one `POST /v1/chat/completions` (design §1):
//!
//! read the body (bounded) → parse (on failure forward the original bytes) →
//! session → substitute the known compacted prefix → estimate (calibrated)
//! → compact when over the threshold → re-serialise only if something
//! changed → send → on an overflow error before any byte reached the client:
//! learn the window, force a compaction, retry once → tap usage on the way
//! back (hiding the usage chunk the client did not ask for).
//!
//! The session lock is held while deciding and compacting, never while the
//! response streams.

use std::borrow::Cow;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::request::Parts;
use http::{header, HeaderValue, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use serde_json::value::RawValue;
use serde_json::Value;
use tokio::time::Instant;

use crate::app::AppState;
use crate::compaction::config::Strategy;
use crate::compaction::last_resort;
use crate::compaction::trigger::Trigger;
use crate::compaction::{CompressOptions, Compressor, Outcome};
use crate::error::{full_body, ProxyBody};
use crate::proxy::body::{boxed, IdleTimeoutBody, ProxyReqBody};
use crate::proxy::{self, headers};
use crate::request::ChatRequest;
use crate::session::calibration::SentRequest;
use crate::session::key::SessionKey;
use crate::session::store::Entry;
use crate::usage::hide::HideUsageBody;
use crate::usage::inject::{plan_usage, UsagePlan};
use crate::usage::peek::peek_start;
use crate::usage::tap::TapBody;
use crate::usage::{BodyKind, StreamStart, TapOutcome, UsageObserver};
use crate::window::overflow::{parse_overflow, parse_overflow_event, Overflow, OverflowKind};

use super::conversation::{rough_message_tokens, Conversation};
use super::record::Record;
use super::summarise::HttpSummariser;
use super::{ChatState, Discovery};

/// Response header naming what compactor did.
pub const ACTION_HEADER: &str = "x-compactor-action";
/// Response header carrying the opaque session key.
pub const SESSION_HEADER: &str = "x-compactor-session";
/// Response header: how many leading client messages were sent as their
/// recorded compacted replacement (absent when none).
pub const REPLACED_HEADER: &str = "x-compactor-replaced";

/// Error bodies up to this size are read to look for an overflow.
const MAX_ERROR_PEEK: usize = 256 << 10;
/// A stream's start is held up to this size while looking for an in-band
/// overflow error.
const MAX_STREAM_PEEK: usize = 64 << 10;
/// "Fits the window" needs the estimate plus 1/10 of it (see `prepare`).
const ESTIMATE_MARGIN_DIVISOR: u64 = 10;
/// Timeout of the window discovery probes.
const DISCOVERY_TIMEOUT: Duration = Duration::from_secs(5);

/// What compactor did to a request (`x-compactor-action`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// No compaction ran: the messages went as the client sent them, or with
    /// an earlier compaction's recorded prefix substituted (see
    /// [`REPLACED_HEADER`]); `include_usage` may have been added.
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
    pub fn as_str(self) -> &'static str {
        match self {
            Action::Passthrough => "passthrough",
            Action::Compacted => "compacted",
            Action::Retried => "retried",
            Action::Aborted => "aborted",
        }
    }
}

/// A request ready to send.
struct Prepared {
    body: Bytes,
    action: Action,
    /// Client messages replaced by a compaction record (0 = none).
    replaced: usize,
    plan: UsagePlan,
    sent: Arc<SentRequest>,
    inbox: super::conversation::Inbox,
    /// A compaction was committed while preparing this request (not only a
    /// recorded one substituted).
    fresh_compaction: bool,
    /// Calibrated prompt estimate of `body`.
    est_tokens: u64,
}

/// Handles one chat completion request.
pub async fn handle(state: Arc<AppState>, req: Request<ProxyReqBody>) -> Response<ProxyBody> {
    let (parts, body) = req.into_parts();
    // A compressed body cannot be read without decoding it: forward untouched.
    if parts.headers.contains_key(header::CONTENT_ENCODING) {
        return proxy::forward(&state, Request::from_parts(parts, body)).await;
    }
    let bytes = match body.collect().await {
        Ok(c) => c.to_bytes(),
        Err(e) => return proxy::error_reply(&state, &proxy::body_read_error(&e)),
    };
    let Ok(creq) = ChatRequest::parse(bytes.clone()) else {
        // Not a chat request we understand: the upstream answers it.
        return send_plain(&state, parts, bytes).await;
    };
    let chat = &state.chat;
    let (key, _source, cred) = chat.keyer.derive_with_credential(&parts.headers, &creq);
    let cred = cred.as_u128();
    let entry = chat.sessions.get_or_create(key, Conversation::default);

    let mut prepared = prepare(&state, &entry, &parts, creq, (key, cred), None).await;
    let mut retried = false;
    loop {
        let resp = match send(&state, &parts, prepared.body.clone()).await {
            Ok(r) => r,
            Err(e) => return proxy::error_reply(&state, &e),
        };
        let outcome = inspect(resp, prepared.plan.stream).await;
        let (resp, overflow) = match outcome {
            Ok(x) => x,
            Err(e) => return proxy::error_reply(&state, &e),
        };
        match overflow {
            Some(mut of) if !retried && of.kind == OverflowKind::Prompt => {
                retried = true;
                if of.limit.is_none() {
                    // An error without numbers still bounds the window: what
                    // was just sent did not fit. Learning that bound makes
                    // later compactions proactive instead of one overflow
                    // (and retry) every few turns.
                    of.limit = Some(
                        of.requested
                            .or(of.prompt_tokens)
                            .unwrap_or(prepared.est_tokens)
                            .max(1),
                    );
                }
                chat.metrics.overflow_retry();
                tracing::info!(
                    session = %key,
                    limit = of.limit,
                    requested = of.requested,
                    "upstream context overflow; compacting and retrying"
                );
                let Ok(creq) = ChatRequest::parse(bytes.clone()) else {
                    return finish(&state, resp, &prepared, key);
                };
                let retry = prepare(&state, &entry, &parts, creq, (key, cred), Some(of)).await;
                if !retry.fresh_compaction {
                    // Compaction could not help (a recorded substitution
                    // alone would resend the same overflowing request): the
                    // client gets the upstream's own error.
                    return finish(&state, resp, &prepared, key);
                }
                prepared = Prepared {
                    action: Action::Retried,
                    ..retry
                };
            }
            _ => return finish(&state, resp, &prepared, key),
        }
    }
}

/// Decides what to send, under the conversation lock. `overflow` is set on
/// the retry after an upstream overflow error: learn the window and force a
/// compaction.
async fn prepare(
    state: &AppState,
    entry: &Arc<Entry<Conversation>>,
    parts: &Parts,
    mut creq: ChatRequest,
    (key, cred): (SessionKey, u128),
    overflow: Option<Overflow>,
) -> Prepared {
    let chat = &state.chat;
    let model = creq.model().unwrap_or_default();
    let mut guard = entry.lock().await;
    let conv: &mut Conversation = &mut guard;
    conv.drain_inbox();
    conv.note_model(&model);
    conv.stats.requests += u64::from(overflow.is_none());

    if let Some(of) = &overflow {
        chat.windows.learn(&chat.upstream_label, &model, of);
    }
    let discovery = Discovery {
        client: &state.client,
        base: &state.config.upstream,
        client_headers: &parts.headers,
        timeout: DISCOVERY_TIMEOUT,
    };
    let window = chat
        .windows
        .resolve(&chat.upstream_label, &model, &discovery)
        .await
        .tokens;

    // 1. Substitute the longest recorded compaction of this history.
    // Moved out, not copied: the history is the bulk of the body, and the
    // original bytes still go upstream unless `with_messages` runs below.
    let original: Vec<Box<RawValue>> = creq.take_messages();
    let client_hashes = conv.client_chain.chain(&original).to_vec();
    let record = chat
        .records
        .lookup(cred, &client_hashes, conv.record.as_ref());
    conv.record = record.clone();
    let mut outgoing: Cow<'_, [Box<RawValue>]> = match &record {
        Some(r) => Cow::Owned(
            r.replacement
                .iter()
                .chain(&original[r.k..])
                .cloned()
                .collect(),
        ),
        None => Cow::Borrowed(&original),
    };
    let mut changed = record.is_some();
    let mut fresh_compaction = false;
    // A recorded prefix is a substitution, not a compaction: the action
    // stays `passthrough` and `x-compactor-replaced` says how many of the
    // client's messages the recorded replacement stood for.
    let mut action = Action::Passthrough;
    if changed {
        conv.stats.substituted += 1;
    }

    // 2. Estimate what would be sent (calibrated by real usage).
    let max_out = creq.max_output_tokens();
    let overhead = conv.tools_overhead(creq.get_raw("tools"));
    let sent_hashes = match &outgoing {
        // Sending the client's own history: its chain is already computed.
        Cow::Borrowed(_) => {
            conv.sent_chain = conv.client_chain.clone();
            client_hashes.clone()
        }
        Cow::Owned(o) => conv.sent_chain.chain(o).to_vec(),
    };
    let mut est =
        conv.calibration
            .estimate(&outgoing, &sent_hashes, overhead, rough_message_tokens);

    // 3. Over the threshold? Compact under the lock.
    let cfg = Arc::clone(&chat.compaction);
    let turn = conv.stats.requests;
    // The engine budgets (threshold, tail, summary, summariser prompt) in
    // rough chars/4 tokens. When the upstream's tokenizer is denser, every
    // compaction would land short of the real window, be judged ineffective
    // and leave each later turn to overflow. So the engine sees the window
    // in rough units (scaled by the calibrated real/rough ratio) and gets
    // rough-unit figures; the window check itself stays in real tokens.
    let scale = conv.engine_scale();
    conv.real_window = Some(window);
    let engine_window = scale.to_rough(window);
    let engine_max_out = max_out.map(|m| scale.to_rough(m));
    let est_rough = scale.to_rough(est.tokens);
    let comp = conv.compressor(
        &cfg,
        &model,
        &chat.upstream_label,
        engine_window,
        engine_max_out,
    );
    let micro_due = cfg.strategy == Strategy::Micro && conv_turn_due(turn, cfg.micro_every_n_turns);
    let Decision {
        threshold,
        wanted,
        micro_pass,
        force,
    } = decide(
        &mut comp.trigger,
        Sizes {
            est_real: est.tokens,
            est_rough,
            max_out,
            window,
        },
        overflow.is_some(),
        micro_due,
    );
    if wanted || micro_pass {
        let values: Result<Vec<Value>, _> = outgoing
            .iter()
            .map(|m| serde_json::from_str::<Value>(m.get()))
            .collect();
        if let Ok(values) = values {
            let summariser = HttpSummariser::new(
                state.client.clone(),
                summary_base(state, &cfg),
                model.clone(),
                &parts.headers,
                cfg.summary_api_key.as_deref(),
                Duration::from_secs(cfg.summary_timeout_secs.max(1)),
                comp.trigger.summariser_budgets().into(),
            );
            let started = Instant::now();
            // What the messages may take for the request to fit at all
            // (the engine's last resort shortens messages down to it).
            let fit_rough = last_resort::fit_budget(
                &values,
                last_resort::FitInputs {
                    estimate: est.tokens,
                    counted: overflow
                        .as_ref()
                        .and_then(|o| o.prompt_tokens.or(o.requested)),
                    tools: overhead,
                    window,
                    max_out: max_out.unwrap_or(0),
                    margin_divisor: ESTIMATE_MARGIN_DIVISOR,
                },
            );
            let result = run_engine(
                comp,
                &values,
                &summariser,
                (micro_pass, force),
                est_rough,
                fit_rough,
            )
            .await;
            let took = started.elapsed();
            // The batch trigger's deferral and strike rules judge batch
            // compactions only; a micro pass is routine.
            if result.outcome == Outcome::Compacted && !micro_pass {
                comp.trigger.record_completed_compaction(
                    result.fallback_used,
                    result.feasibility_skip,
                    result.tokens_after,
                );
            }
            let booked = book_pass(
                chat,
                conv,
                &Pass {
                    key,
                    cred,
                    original: &original,
                    client_hashes: &client_hashes,
                    outgoing: &outgoing,
                    micro_pass,
                    force,
                    est_tokens: est.tokens,
                    threshold,
                    window,
                    summariser_calls: summariser.calls(),
                    took,
                },
                &result,
            );
            match booked {
                Booked::Compacted(new_outgoing) => {
                    outgoing = Cow::Owned(new_outgoing);
                    changed = true;
                    fresh_compaction = true;
                    action = Action::Compacted;
                    let sent_hashes = conv.sent_chain.chain(&outgoing).to_vec();
                    est = conv.calibration.estimate(
                        &outgoing,
                        &sent_hashes,
                        overhead,
                        rough_message_tokens,
                    );
                }
                Booked::Aborted => action = Action::Aborted,
                Booked::Nothing => {}
            }
        }
    }
    conv.last_action = action.as_str();
    tracing::debug!(
        session = %key,
        action = action.as_str(),
        messages = outgoing.len(),
        estimated_prompt = est.tokens,
        basis = ?est.basis,
        max_out,
        window,
        "chat request prepared"
    );

    let replaced = conv.record.as_ref().filter(|_| changed).map_or(0, |r| r.k);
    if changed {
        creq.with_messages(outgoing.into_owned());
    }
    let plan = plan_usage(&mut creq);
    Prepared {
        body: creq.to_bytes(),
        action,
        replaced,
        plan,
        sent: est.sent,
        inbox: Arc::clone(&conv.inbox),
        fresh_compaction,
        est_tokens: est.tokens,
    }
}

/// An engine pass over a request, as [`book_pass`] needs it.
struct Pass<'a> {
    key: SessionKey,
    cred: u128,
    /// The client's messages and their chain.
    original: &'a [Box<RawValue>],
    client_hashes: &'a [u128],
    /// What the engine was given.
    outgoing: &'a [Box<RawValue>],
    micro_pass: bool,
    force: bool,
    /// Calibrated prompt estimate before the pass, real tokens.
    est_tokens: u64,
    threshold: u64,
    window: u64,
    summariser_calls: u64,
    took: Duration,
}

/// What a booked pass leaves the request with.
enum Booked {
    /// Send these messages instead (the compaction is recorded).
    Compacted(Vec<Box<RawValue>>),
    /// The compaction was abandoned; the messages go as they were.
    Aborted,
    /// Nothing to change.
    Nothing,
}

/// Books a finished engine pass: conversation stats, metrics and the log
/// line; a committed compaction also becomes a record. Synchronous: the
/// pass itself (the summariser's I/O) is over.
fn book_pass(
    chat: &ChatState,
    conv: &mut Conversation,
    p: &Pass<'_>,
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
                .compaction(result.label, saved, summariser_took);
            let new_outgoing = commit_record(
                chat,
                conv,
                p.cred,
                p.original,
                p.client_hashes,
                p.outgoing,
                result,
            );
            tracing::info!(
                session = %p.key,
                outcome = result.label,
                fallback = result.fallback_used,
                messages_before = p.outgoing.len(),
                messages_after = new_outgoing.len(),
                tokens_before = result.tokens_before,
                tokens_after = result.tokens_after,
                estimated_prompt = p.est_tokens,
                threshold = p.threshold,
                window = p.window,
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
            chat.metrics.compaction(result.label, 0, summariser_took);
            tracing::info!(
                outcome = result.label,
                messages = p.outgoing.len(),
                estimated_prompt = p.est_tokens,
                threshold = p.threshold,
                window = p.window,
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
    // upstream reports real usage (reference deferral), unless the request
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
    // Micro-compaction is per turn (reference §4: every Nth turn, whatever
    // the size); over the threshold the batch compaction still runs, since
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
    summariser: &HttpSummariser,
    (micro_pass, force): (bool, bool),
    current_tokens: u64,
    fit_tokens: u64,
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
                fit_tokens: Some(fit_tokens),
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

/// Where summary calls go: the configured summary endpoint, else the upstream.
fn summary_base(
    state: &AppState,
    cfg: &crate::compaction::config::CompactionConfig,
) -> crate::config::UpstreamBase {
    cfg.summary_endpoint
        .as_deref()
        .and_then(|s| crate::config::UpstreamBase::parse(s).ok())
        .unwrap_or_else(|| state.config.upstream.clone())
}

/// Sends `body` upstream with the client's headers (Content-Length fixed).
async fn send(
    state: &AppState,
    parts: &Parts,
    body: Bytes,
) -> Result<Response<Incoming>, crate::error::ProxyError> {
    let mut parts = clone_parts(parts);
    parts.headers.remove(header::TRANSFER_ENCODING);
    // The usage tap and hider read the response: a compressed body would
    // hide the usage from calibration and leave the forced usage chunk in
    // front of a client that never asked for it (SDKs send gzip by default).
    parts.headers.insert(
        header::ACCEPT_ENCODING,
        HeaderValue::from_static("identity"),
    );
    parts
        .headers
        .insert(header::CONTENT_LENGTH, HeaderValue::from(body.len()));
    proxy::send_upstream(state, &parts, boxed(Full::new(body))).await
}

/// Forwards bytes we could not parse exactly as received.
async fn send_plain(state: &AppState, parts: Parts, bytes: Bytes) -> Response<ProxyBody> {
    match proxy::send_upstream(state, &parts, boxed(Full::new(bytes))).await {
        Ok(resp) => proxy::stream_response(state, resp),
        Err(e) => proxy::error_reply(state, &e),
    }
}

fn clone_parts(parts: &Parts) -> Parts {
    let mut req = Request::new(());
    *req.method_mut() = parts.method.clone();
    *req.uri_mut() = parts.uri.clone();
    *req.version_mut() = parts.version;
    *req.headers_mut() = parts.headers.clone();
    let (mut p, ()) = req.into_parts();
    // Request stats travel in the extensions (upstream wait accounting).
    if let Some(stats) = parts.extensions.get::<Arc<proxy::RequestStats>>() {
        p.extensions.insert(Arc::clone(stats));
    }
    p
}

/// A response whose start has been read: the held frames go back in front.
type HeldBody = crate::usage::peek::PrefixedBody<Incoming>;

/// Reads the start of the response: the whole error body (bounded) for an
/// error status, the first events of a stream; reports an overflow that
/// arrived before any content.
async fn inspect(
    resp: Response<Incoming>,
    stream: bool,
) -> Result<(Response<HeldBody>, Option<Overflow>), crate::error::ProxyError> {
    let (parts, body) = resp.into_parts();
    let status = parts.status;
    let ct = parts
        .headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok());
    let kind = BodyKind::from_content_type(ct);
    let map_err = |e: hyper::Error| crate::error::ProxyError::UpstreamUnreachable(e.to_string());
    if !status.is_success() {
        // The whole error body (bounded), whatever its content type.
        let peeked = peek_start(body, BodyKind::Json, MAX_ERROR_PEEK)
            .await
            .map_err(map_err)?;
        let overflow = match peeked.start {
            StreamStart::Undecided => None,
            _ => parse_overflow(status.as_u16(), &peeked.body.held_bytes()),
        };
        return Ok((Response::from_parts(parts, peeked.body), overflow));
    }
    if stream && kind == BodyKind::Sse {
        let peeked = peek_start(body, kind, MAX_STREAM_PEEK)
            .await
            .map_err(map_err)?;
        let overflow = match &peeked.start {
            StreamStart::Error(payload) => parse_overflow_event(payload),
            _ => None,
        };
        return Ok((Response::from_parts(parts, peeked.body), overflow));
    }
    let body = crate::usage::peek::PrefixedBody::new(Default::default(), body, false);
    Ok((Response::from_parts(parts, body), None))
}

/// Turns the upstream response into ours: usage tap (and hider), idle
/// timeout, compactor headers.
fn finish(
    state: &Arc<AppState>,
    resp: Response<HeldBody>,
    prepared: &Prepared,
    key: SessionKey,
) -> Response<ProxyBody> {
    let chat = &state.chat;
    chat.metrics.action(prepared.action.as_str());
    let (mut parts, body) = resp.into_parts();
    headers::strip_hop_by_hop(&mut parts.headers);
    let kind = BodyKind::from_content_type(
        parts
            .headers
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok()),
    );
    let success = parts.status.is_success();
    let mut observer = UsageObserver::new(kind, |_: TapOutcome| {});
    // Error bodies carry no usage worth calibrating on.
    if success {
        let (inbox, sent) = (Arc::clone(&prepared.inbox), Arc::clone(&prepared.sent));
        let state = Arc::clone(state);
        observer = observer.on_usage(Box::new(move |report| {
            if let Some((prompt, _)) = report.prompt_tokens() {
                state.chat.metrics.prompt_tokens(prompt);
            }
            crate::sync::lock(&inbox).push((sent, report));
        }));
    }
    let tapped = TapBody::new(body, observer);
    let idle = state.config.timeouts.idle;
    let metrics = Arc::clone(&state.metrics);
    let on_timeout = Box::new(move || {
        metrics.record_idle_timeout();
        tracing::warn!(idle_secs = idle.as_secs(), "upstream idle, ending stream");
    });
    let body: ProxyBody = if prepared.plan.hide_usage() && success && kind == BodyKind::Sse {
        // The hidden chunk changes the length.
        parts.headers.remove(header::CONTENT_LENGTH);
        IdleTimeoutBody::new(HideUsageBody::new(tapped), idle, on_timeout).boxed_unsync()
    } else {
        IdleTimeoutBody::new(tapped, idle, on_timeout).boxed_unsync()
    };
    if state.config.expose_headers {
        parts.headers.insert(
            ACTION_HEADER,
            HeaderValue::from_static(prepared.action.as_str()),
        );
        if let Ok(v) = HeaderValue::from_str(&key.to_string()) {
            parts.headers.insert(SESSION_HEADER, v);
        }
        if prepared.replaced > 0 {
            parts
                .headers
                .insert(REPLACED_HEADER, HeaderValue::from(prepared.replaced));
        }
    }
    Response::from_parts(parts, body)
}

/// A response compactor writes itself (admin views).
pub fn json_response(status: StatusCode, body: String) -> Response<ProxyBody> {
    let mut resp = Response::new(full_body(Bytes::from(body)));
    *resp.status_mut() = status;
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    resp
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
