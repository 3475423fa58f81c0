//! One summary prompt sent to the summariser: the retry on the main model
//! when a distinct summary model fails, the firmer retry of a reply cut at
//! its length, and the check of what came back.

use serde_json::Value;

use super::failure::AuxModelFailure;
use crate::serialize;
use crate::summariser::{InContextAsk, Summariser, SummaryReply, SummaryRequest};
use crate::summary_failure::SummaryFailure;
use crate::truncated;
use crate::view;

/// One summary generation: the summary, or how it failed, and what it cost.
#[derive(Clone, Debug, Default, PartialEq)]
pub(crate) struct SummaryAttempt {
    /// The summary to place (prefix and body), when it succeeded.
    pub(crate) summary: Option<String>,
    /// Its body alone: the next running summary.
    pub(crate) body: Option<String>,
    /// The failure, when it failed. Neither this nor `summary` is set when
    /// a live cooldown held the call.
    pub(crate) failure: Option<SummaryFailure>,
    /// A distinct summary model failed and the main model was tried.
    pub(crate) aux_model_failure: Option<AuxModelFailure>,
    /// Summary calls made (including a retry on the main model).
    pub(crate) calls: u32,
    /// Chunks the input was summarised in.
    pub(crate) chunks: usize,
}

/// Text of a reply's content (string or list of text parts).
fn reply_text(reply: &SummaryReply) -> Option<String> {
    match reply.content.as_ref()? {
        Value::Null => None,
        Value::String(s) => Some(s.clone()),
        other => Some(view::content_text(other)),
    }
}

/// One summary prompt, sent with the retry on the main model. Batch and
/// micro summaries both go through it, so a reply cut at the reply limit is
/// handled the same way on either path.
pub(super) struct SummaryCall {
    pub(super) prompt: String,
    /// The same ask for a summariser shown the conversation itself (see
    /// [`SummaryRequest::in_context`]); never for a firmer retry or a
    /// distinct summary model.
    pub(super) in_context: Option<InContextAsk>,
    /// The session has no user turns: a reply attributing anything to a
    /// user is invented and counts as a refusal.
    pub(super) no_user_session: bool,
    /// The summary's token target (for the firmer retry instruction).
    pub(super) target_tokens: u64,
    /// Longest body kept unclipped: a longer one is retried like a cut one.
    pub(super) max_body_chars: usize,
    /// The summariser's prompt budget: the retry's longer prompt must fit.
    pub(super) budget_chars: usize,
    /// A reply cut at the reply limit is kept (cut at its last complete
    /// line) rather than failed; off under `abort_on_degraded_summary`.
    pub(super) keep_cut: bool,
    /// Wire `max_tokens` and temperature (micro summaries set them; batch
    /// summaries leave the cap to the summariser's budgets).
    pub(super) max_tokens: Option<u32>,
    pub(super) temperature: Option<f32>,
}

/// A checked reply: its body, and whether it was cut at the reply limit.
struct Checked {
    body: String,
    cut: bool,
}

impl SummaryCall {
    /// Sends the prompt; a summary cut at the reply limit is retried once
    /// with a firmer length instruction when the prompt budget has room,
    /// and otherwise (or when the retry is cut too) kept cut at its last
    /// complete line.
    pub(super) async fn run(
        &self,
        s: &dyn Summariser,
        model: &mut Option<String>,
        fallen_back: &mut bool,
        out: &mut SummaryAttempt,
    ) -> Result<String, SummaryFailure> {
        let first = self.send(&self.prompt, s, model, fallen_back, out).await?;
        let too_long = |c: &Checked| c.body.chars().count() > self.max_body_chars;
        if !first.cut && !too_long(&first) {
            return Ok(first.body);
        }
        if !s.firm_retry_useful() {
            // This model's retries never came back within the cap: the cut
            // summary is kept at its last complete line.
            return Ok(first.body);
        }
        let Some(firm) =
            truncated::firm_prompt(&self.prompt, self.target_tokens, self.budget_chars)
        else {
            return Ok(first.body);
        };
        tracing::info!(
            cut = first.cut,
            "summary over its length; retrying once with a firmer length instruction"
        );
        let second = self.send(&firm, s, model, fallen_back, out).await;
        if let Ok(c) = &second {
            s.note_firm_retry(!c.cut && !too_long(c));
        }
        match second {
            // A complete retry wins; of two cut ones, the one that kept more.
            Ok(second) if !second.cut || (first.cut && second.body.len() >= first.body.len()) => {
                Ok(second.body)
            }
            _ => Ok(first.body),
        }
    }

    /// Sends `prompt` on `model` (`None` = the main model). A distinct
    /// summary model that fails is recorded in `out` and the prompt is
    /// retried once on the main model, which later prompts then use too.
    async fn send(
        &self,
        prompt: &str,
        s: &dyn Summariser,
        model: &mut Option<String>,
        fallen_back: &mut bool,
        out: &mut SummaryAttempt,
    ) -> Result<Checked, SummaryFailure> {
        loop {
            let in_context = self
                .in_context
                .as_ref()
                .filter(|_| model.is_none() && prompt == self.prompt)
                .cloned();
            let req = SummaryRequest {
                model: model.clone(),
                prompt: prompt.to_owned(),
                in_context,
                max_tokens: self.max_tokens,
                temperature: self.temperature,
            };
            out.calls += 1;
            let failure = match s.summarise(req).await {
                Ok(reply) => match self.check(&reply, prompt) {
                    Ok(checked) => return Ok(checked),
                    Err(f) => f,
                },
                Err(e) => e,
            };
            if !*fallen_back {
                if let Some(m) = model.take() {
                    tracing::warn!("summary model failed; retrying once on the main model");
                    out.aux_model_failure = Some(AuxModelFailure {
                        model: m,
                        error: failure.error,
                    });
                    *fallen_back = true;
                    continue;
                }
            }
            return Err(failure);
        }
    }

    /// The cleaned, validated body of a reply to `prompt`. A reply cut at
    /// the reply limit is kept up to its last complete line when `keep_cut`
    /// allows (a truncation failure when nothing complete is left); one that
    /// repeats the prompt fails.
    fn check(&self, reply: &SummaryReply, prompt: &str) -> Result<Checked, SummaryFailure> {
        let text = reply_text(reply);
        let cut = reply.finish_reason.as_deref() == Some("length") && self.keep_cut;
        let finish = if cut {
            None
        } else {
            reply.finish_reason.as_deref()
        };
        let body = serialize::validate_summary_reply(
            text.as_deref(),
            finish,
            reply.refusal.as_deref(),
            reply.reasoning.as_deref(),
        )
        .map_err(|inv| SummaryFailure::invalid(&inv))?;
        let body = if cut {
            truncated::cut_at_last_line(&body)
                .ok_or_else(|| SummaryFailure::invalid(&serialize::SummaryInvalid::Truncated))?
        } else {
            body
        };
        if serialize::echoes_prompt(&body, prompt) {
            return Err(SummaryFailure::invalid(&serialize::SummaryInvalid::Echo));
        }
        if self.no_user_session && serialize::attributes_to_user(&body) {
            return Err(SummaryFailure::invented_user());
        }
        Ok(Checked { body, cut })
    }
}
