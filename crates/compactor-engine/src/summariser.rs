//! The summariser boundary: the only asynchronous part of the engine.
//!
//! The proxy implements [`Summariser`] with a non-streaming chat completion to
//! the upstream; tests implement it with scripted replies. The engine never
//! sends a wire `max_tokens` for batch summaries (reasoning models returned
//! empty or truncated summaries under a hard cap), so `max_tokens` is only set
//! by micro-compaction.

use crate::summary_failure::SummaryFailure;

/// The error of a summary call: the one failure type, under the name the
/// [`Summariser`] trait and its implementations know it by.
pub type SummaryError = SummaryFailure;

/// Default prompt budget of a summariser, in characters of prompt text.
///
/// The 160,000-char summary input cap (about 40 K tokens): the most one
/// summary call reads, whatever the summariser could take.
pub(crate) const DEFAULT_PROMPT_BUDGET_CHARS: usize = 160_000;

/// The model that writes summaries.
#[async_trait::async_trait]
pub trait Summariser: Send + Sync {
    /// Runs one summary call. A failure is classified when it is built
    /// (its origin, status and error `type`/`code`).
    async fn summarise(&self, req: SummaryRequest) -> Result<SummaryReply, SummaryError>;

    /// How many characters of prompt the summariser accepts. When the text to
    /// summarise does not fit, the engine summarises in rolling chunks.
    fn prompt_budget_chars(&self) -> usize {
        DEFAULT_PROMPT_BUDGET_CHARS
    }

    /// Whether a summary cut at its reply cap is worth one more call with a
    /// firmer length instruction. A model that does not follow length
    /// instructions is cut again and the retry doubles the calls; a
    /// summariser that learns this per model answers `false` for it.
    fn firm_retry_useful(&self) -> bool {
        true
    }

    /// What a firmer retry gave: a summary within the cap (`true`) or one
    /// cut again.
    fn note_firm_retry(&self, _within_cap: bool) {}
}

/// One summary call.
#[derive(Clone, Debug, PartialEq)]
pub struct SummaryRequest {
    /// `None` means "the conversation's own (main) model".
    pub model: Option<String>,
    /// The whole prompt, sent as a single user message.
    pub prompt: String,
    /// The same ask for a summariser shown the conversation itself: sent
    /// after the conversation's own messages instead of `prompt`, when the
    /// summariser can (the conversation's upstream and model, room in the
    /// window), so the upstream's prompt cache serves all but the ask.
    pub in_context: Option<InContextAsk>,
    /// Wire `max_tokens`; only micro-compaction sets it.
    pub max_tokens: Option<u32>,
    /// Sampling temperature; only micro-compaction sets it.
    pub temperature: Option<f32>,
}

/// A summary ask sent after the conversation itself ([`SummaryRequest::in_context`]).
#[derive(Clone, Debug, PartialEq)]
pub struct InContextAsk {
    /// The instructions, without the turns: the summariser reads them above.
    pub prompt: String,
    /// Messages at the end of the compacted history kept after the summary:
    /// the ask follows the messages before them, which a prompt cache holds
    /// from the conversation's earlier requests.
    pub keep_last: usize,
    /// The smallest reply cap the ask may go with (the summary's target
    /// and a quarter): the conversation it follows fills the window, so
    /// a cap that leaves the ask no room is lowered to what fits, down to
    /// this, rather than losing the cache to a prompt of its own.
    pub min_reply: u32,
}

/// What the summariser answered.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SummaryReply {
    /// `message.content` as returned: a string, a list of parts, or null.
    pub content: Option<serde_json::Value>,
    /// `choices[0].finish_reason`.
    pub finish_reason: Option<String>,
    /// `message.refusal`, when the provider reports one.
    pub refusal: Option<String>,
    /// `message.reasoning` / `reasoning_content` (used when content is empty).
    pub reasoning: Option<String>,
}

impl SummaryReply {
    /// A reply whose content is the given text and that finished normally.
    pub fn text(s: impl Into<String>) -> Self {
        Self {
            content: Some(serde_json::Value::String(s.into())),
            finish_reason: Some("stop".to_string()),
            refusal: None,
            reasoning: None,
        }
    }
}
