//! What compactor remembers about one conversation.

use std::sync::{Arc, Mutex, Weak};

use serde_json::value::RawValue;

use crate::compaction::config::CompactionConfig;
use crate::compaction::tokens;
use crate::compaction::trigger::{Trigger, TriggerSnapshot, WindowSource};
use crate::compaction::Compressor;
use crate::request::ChainCache;
use crate::session::calibration::{Calibration, Cut, EngineScale, SentRequest};
use crate::usage::UsageReport;

use super::record::Record;

/// A response's usage, posted by the response tap when the body ends and
/// applied under the conversation lock by the next request (or the admin
/// view). The tap runs inside `poll_frame` and must not wait for the lock.
pub(crate) type Inbox = Arc<Mutex<Vec<Posted>>>;

/// One response's usage and the request it answered.
pub(crate) type Posted = (Arc<SentRequest>, UsageReport);

/// A reply whose prompt the upstream cut silently (see [`Cut`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Truncation {
    /// compactor's estimate of what it sent, real tokens.
    pub(crate) estimated: u64,
    /// What the upstream counted.
    pub(crate) counted: u64,
    /// How the count showed it.
    pub(crate) cut: Cut,
}

/// Content-free counters shown by the admin endpoint.
#[derive(Debug, Default, Clone, serde::Serialize)]
pub(crate) struct ConvStats {
    /// Chat requests seen.
    pub(crate) requests: u64,
    /// Committed compactions.
    pub(crate) compactions: u64,
    /// Compactions that used the deterministic fallback summary.
    pub(crate) fallback_compactions: u64,
    /// Compactions abandoned with the original messages forwarded.
    pub(crate) aborted: u64,
    /// Overflow errors answered by compacting and retrying.
    pub(crate) overflow_retries: u64,
    /// Rough tokens removed by compactions (before − after).
    pub(crate) tokens_saved: u64,
    /// Requests sent with a compaction record substituted.
    pub(crate) substituted: u64,
    /// Summary calls made by engine passes on the request path (committed
    /// or not).
    pub(crate) summary_calls: u64,
    /// Replies whose prompt the upstream truncated silently.
    pub(crate) truncations: u64,
}

/// One conversation's state; lives behind the session's async lock.
pub(crate) struct Conversation {
    /// The engine, created on the first request (it needs the model).
    pub(crate) compressor: Option<Compressor>,
    /// Rough → real calibration.
    pub(crate) calibration: Calibration,
    /// Hash chain of the client's history (only changed messages re-hashed).
    pub(crate) client_chain: ChainCache,
    /// Hash chain of what was sent (after substitution).
    pub(crate) sent_chain: ChainCache,
    /// The newest compaction record this conversation matched or made,
    /// weakly: the record store alone keeps records alive, so its byte
    /// bound holds (an evicted record is freed at once, not when every
    /// session that matched it lets go). See [`Conversation::record`].
    record: Option<Weak<Record>>,
    /// (hash of the raw `tools` bytes, their rough estimate).
    tools_estimate: Option<(u64, u64)>,
    /// Usage waiting to be applied.
    pub(crate) inbox: Inbox,
    /// The background pre-compaction started for this conversation.
    pub(crate) pending: Option<super::pending::Pending>,
    /// Counters.
    pub(crate) stats: ConvStats,
    /// Last action taken (`passthrough`, `compacted`, …).
    pub(crate) last_action: &'static str,
    /// The window of the last request in real tokens (the engine's own
    /// figure is in rough units, see [`EngineScale`]).
    pub(crate) real_window: Option<u64>,
    /// The store was asked for this conversation's state (once per entry).
    pub(crate) state_loaded: bool,
    /// What of the state was last read from or written to the store
    /// (trigger state, ratio in hundredths).
    pub(crate) state_written: Option<(Option<TriggerSnapshot>, Option<i64>)>,
    /// Stored trigger state waiting for the engine to be created.
    pub(crate) restored_trigger: Option<TriggerSnapshot>,
    /// The "no room under the trigger" warning was logged (once per
    /// conversation).
    pub(crate) no_room_noted: bool,
    /// The silent-truncation warning was logged (once per conversation).
    pub(crate) truncation_noted: bool,
    /// A reply was truncated since the last request: the next one is
    /// compacted whatever its estimate says.
    pub(crate) truncated: bool,
    /// Truncations found and not yet counted in the metrics and log (the
    /// admin view drains the inbox too).
    pub(crate) unreported: Vec<Truncation>,
    /// The last request's window was the default standing in while Ollama
    /// loads the model: usage waits for the next request, which learns the
    /// window it is judged against.
    pub(crate) window_loading: bool,
    /// The inspector's figures of the last turns and compactions.
    pub(crate) inspect: super::inspect::TurnLog,
    /// The session key as the response header's value, built on the
    /// first response that exposes it (see [`Conversation::session_value`]).
    session_value: Option<http::HeaderValue>,
}

impl Default for Conversation {
    fn default() -> Self {
        Self {
            compressor: None,
            calibration: Calibration::new(),
            client_chain: ChainCache::new(),
            sent_chain: ChainCache::new(),
            record: None,
            tools_estimate: None,
            inbox: Arc::default(),
            pending: None,
            stats: ConvStats::default(),
            last_action: "passthrough",
            real_window: None,
            state_loaded: false,
            state_written: None,
            restored_trigger: None,
            no_room_noted: false,
            truncation_noted: false,
            truncated: false,
            unreported: Vec::new(),
            window_loading: false,
            inspect: super::inspect::TurnLog::default(),
            session_value: None,
        }
    }
}

impl Conversation {
    /// The newest record this conversation matched or made, while the
    /// record store still holds it.
    pub(crate) fn record(&self) -> Option<Arc<Record>> {
        self.record.as_ref().and_then(Weak::upgrade)
    }

    /// Remembers `record` (weakly) as the conversation's newest.
    pub(crate) fn set_record(&mut self, record: Option<&Arc<Record>>) {
        self.record = record.map(Arc::downgrade);
    }

    /// The engine for `model` with the current window and output
    /// reservation; created on first use, updated (cheaply) afterwards.
    pub(crate) fn compressor(
        &mut self,
        cfg: &Arc<CompactionConfig>,
        model: &str,
        base_url: &str,
        window: u64,
        max_tokens: Option<u64>,
    ) -> &mut Compressor {
        let comp = self.compressor.get_or_insert_with(|| {
            let trigger = Trigger::new(
                Arc::clone(cfg),
                model,
                WindowSource::Known(window),
                max_tokens,
            )
            .with_base_url(base_url);
            Compressor::new(Arc::clone(cfg), trigger)
        });
        if let Some(snap) = self.restored_trigger.take() {
            comp.trigger_mut().restore(snap);
        }
        // A model switch resets the trigger's state (another model, another
        // window and tokenizer). Window and output reservation go in separately:
        // they move with the calibration scale and the client's max_tokens,
        // which must not wipe the deferral and strike state.
        comp.trigger_mut().update_model(model, None, base_url, None);
        comp.trigger_mut().set_max_tokens(max_tokens);
        comp.trigger_mut().set_context_length(window);
        comp
    }

    /// Call before estimating a request for `model`: another model has
    /// another tokenizer, so the old real/rough ratio and real count would
    /// mislead the first estimate after a switch.
    pub(crate) fn note_model(&mut self, model: &str) {
        if self
            .compressor
            .as_ref()
            .is_some_and(|c| c.trigger().model() != model)
        {
            self.calibration.reset();
        }
    }

    /// Real → rough conversion for the engine, from the calibration.
    pub(crate) fn engine_scale(&self) -> EngineScale {
        self.calibration.engine_scale()
    }

    /// `key` (this conversation's) as the session header's value. Built
    /// once: formatting, checking and copying the 32 digits cost every
    /// response ~400 instructions; a clone shares them.
    pub(crate) fn session_value(
        &mut self,
        key: crate::session::key::SessionKey,
    ) -> Option<http::HeaderValue> {
        if self.session_value.is_none() {
            self.session_value = http::HeaderValue::from_bytes(&key.hex()).ok();
        }
        self.session_value.clone()
    }

    /// Applies usage posted by finished responses, judged against the
    /// window of the conversation's last request (the admin view's drain).
    pub(crate) fn drain_inbox(&mut self) {
        // Judged against a window about to be learned, a truncation would
        // be taken for a calibration point.
        if self.window_loading {
            return;
        }
        let posted = self.take_posted();
        self.apply_posted(posted, self.real_window);
    }

    /// Usage posted by finished responses, taken out of the inbox.
    pub(crate) fn take_posted(&self) -> Vec<Posted> {
        std::mem::take(&mut *crate::sync::lock(&self.inbox))
    }

    /// Applies `posted`: the calibration learns from the real figures and
    /// hands the trigger the same usage in the engine's rough units, except
    /// from a reply the upstream truncated (judged against `window`), which
    /// is kept in [`Self::unreported`] instead and makes the next request
    /// compact. Returns the most a truncating upstream was seen to hold
    /// when that is less than `window`: the window it really has.
    pub(crate) fn apply_posted(&mut self, posted: Vec<Posted>, window: Option<u64>) -> Option<u64> {
        let mut cut = Vec::new();
        let mut held: Option<u64> = None;
        for (sent, report) in posted {
            let Some(usage) = report.effective() else {
                continue;
            };
            if let Some(prompt) = usage.prompt_tokens {
                let id = super::inspect::sent_id(sent.hashes.len(), sent.hashes.last().copied());
                self.inspect.usage(id, prompt, usage.cached_tokens);
                if let Some(c) = self.calibration.cut(&sent, prompt, window) {
                    if let Cut::FellShort { held: h } = c {
                        let below = window.is_none_or(|w| h < w);
                        held = held.max(Some(h).filter(|_| below));
                    }
                    cut.push(Truncation {
                        estimated: sent.estimated_tokens,
                        counted: prompt,
                        cut: c,
                    });
                    continue;
                }
            }
            let engine_usage = self.calibration.learn(sent, usage);
            if let Some(comp) = self.compressor.as_mut() {
                comp.trigger_mut().update_from_response(&engine_usage);
            }
        }
        self.stats.truncations += cut.len() as u64;
        self.truncated |= !cut.is_empty();
        self.unreported.extend(cut);
        held
    }

    /// Rough estimate of the `tools` array, cached by its raw bytes.
    pub(crate) fn tools_overhead(&mut self, tools: Option<&RawValue>) -> u64 {
        let Some(raw) = tools else {
            return 0;
        };
        let h = xxhash_rust::xxh3::xxh3_64(raw.get().as_bytes());
        if let Some((hash, est)) = self.tools_estimate {
            if hash == h {
                return est;
            }
        }
        let est = serde_json::from_str::<serde_json::Value>(raw.get())
            .map(|v| tokens::estimate_tools_tokens(Some(&v)))
            .unwrap_or_else(|_| tokens::estimate_text_tokens(raw.get()));
        self.tools_estimate = Some((h, est));
        est
    }
}

/// The rough per-message estimator used for calibration: the engine's own
/// tail-walk estimator, so trigger and tail agree (two estimators would
/// let the trigger fire on a history the tail then judges small).
pub(crate) fn rough_message_tokens(m: &RawValue) -> u64 {
    match serde_json::from_str::<serde_json::Value>(m.get()) {
        Ok(v) => rough_value_tokens(&v),
        Err(_) => tokens::estimate_text_tokens(m.get()),
    }
}

/// [`rough_message_tokens`] of a parsed message (a codec's decode hands
/// it the values it holds: `ApiRequest::parse_with`).
pub(crate) fn rough_value_tokens(v: &serde_json::Value) -> u64 {
    tokens::estimate_msg_budget_tokens(v, true)
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_decodes_estimates_are_the_estimates_of_its_messages() {
        use crate::codec::{Api, ApiRequest};
        let messages = r#"{"model":"m","system":[{"type":"text","text":"Be brief."}],"messages":[
          {"role":"user","content":[{"type":"text","text":"read a.rs"}]},
          {"role":"assistant","content":[{"type":"thinking","thinking":"t","signature":"s"},{"type":"tool_use","id":"a","name":"Read","input":{"p":1.5}}]},
          {"role":"user","content":[{"type":"tool_result","tool_use_id":"a","content":"fn a() {}"}]}]}"#;
        let responses = r#"{"model":"m","instructions":"Be brief.","input":[
          {"role":"user","content":[{"type":"input_text","text":"read a.rs"}]},
          {"type":"function_call","call_id":"c","name":"f","arguments":"{}"},
          {"type":"function_call_output","call_id":"c","output":"fn a() {}"}]}"#;
        for (api, body) in [(Api::Messages, messages), (Api::Responses, responses)] {
            let r = ApiRequest::parse_with(
                api,
                body.as_bytes().to_vec(),
                Some(super::rough_value_tokens),
            )
            .unwrap();
            let rough = r.rough().unwrap();
            let again: Vec<u64> = r
                .messages()
                .iter()
                .map(|m| super::rough_message_tokens(m))
                .collect();
            assert_eq!(rough, again.as_slice(), "{api:?}");
            assert!(ApiRequest::parse(api, body.as_bytes().to_vec())
                .unwrap()
                .rough()
                .is_none());
        }
    }

    #[test]
    fn the_conversation_does_not_keep_an_evicted_record_alive() {
        use std::time::Duration;
        let store = crate::chat::record::RecordStore::new(Duration::from_secs(60), 1);
        let raw = |s: &str| serde_json::value::RawValue::from_string(s.to_owned()).expect("raw");
        let mut conv = super::Conversation::default();
        let first = store.insert(
            1,
            crate::chat::record::Record::new(1, 11, vec![raw("1")], 1, 1),
        );
        conv.set_record(Some(&first));
        drop(first);
        assert!(conv.record().is_some());
        // A second record evicts the first (max 1): nothing holds it.
        store.insert(
            1,
            crate::chat::record::Record::new(1, 22, vec![raw("2")], 1, 1),
        );
        assert!(conv.record().is_none());
    }
}
