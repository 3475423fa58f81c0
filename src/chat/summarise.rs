//! The summariser the proxy uses: one non-streaming call POSTed through the
//! [`Upstream`] (to the upstream or a configured summary endpoint), with the
//! client's own credentials unless a summary key is configured. The call is
//! in the conversation's own API when it goes to the upstream (an Anthropic
//! Messages conversation is summarised by a `/v1/messages` call, a
//! Responses one by `/v1/responses`); a configured summary endpoint is
//! always asked for a chat completion.
//!
//! Failures are mapped onto [`SummaryError`], which classifies them: HTTP
//! status, the error body's `type`/`code` and the provider's message for
//! error answers, `Network` when
//! nothing came back, `Timeout`, `Decode` for a body that is not a chat
//! completion, `StreamClosed` for a cut-off body.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{header, HeaderMap, HeaderValue};
use serde_json::value::RawValue;
use serde_json::{json, Value};

use crate::codec::Api;
use crate::compaction::config::CompactionConfig;
use crate::compaction::tokens::estimate_text_tokens;
use crate::compaction::{
    InContextAsk, Summariser, SummaryError, SummaryErrorKind, SummaryReply, SummaryRequest,
};
use crate::config::UpstreamBase;
use crate::upstream::{FetchError, Upstream};

/// Headers copied from the client's request onto the summary call: the
/// credentials and the few routing headers gateways need. Nothing else (in
/// particular no content-length or session headers) carries over.
const FORWARDED: &[&str] = &[
    "authorization",
    "api-key",
    "x-api-key",
    "x-goog-api-key",
    "anthropic-version",
    "anthropic-beta",
    "openai-organization",
    "openai-project",
    "http-referer",
    "x-title",
];

/// Largest summary response body read.
const MAX_REPLY_BYTES: usize = 4 << 20;

/// Output cap of an Anthropic summary call when the engine sets none
/// (`max_tokens` is required there).
const MESSAGES_DEFAULT_MAX_TOKENS: u32 = 4096;

/// The conversation a summary may be asked after, as the upstream last
/// saw it (see [`SummaryRequest::in_context`]): its messages and tools are
/// sent again, byte for byte where the client's bytes are kept, with the
/// ask appended to its last user message, so an upstream's prompt cache
/// (llama.cpp's slot, the clouds' prefix caches) serves everything but the
/// ask. A prompt of its own made the upstream evaluate every replaced
/// token again, and after it the conversation's own prefix too.
#[derive(Clone, Copy)]
pub(crate) struct InContext<'a> {
    /// The messages as they go upstream (a recorded prefix substituted).
    pub(crate) messages: &'a [Box<RawValue>],
    /// The rough size of each of `messages`.
    pub(crate) rough: &'a [u64],
    /// The request's `tools`.
    pub(crate) tools: Option<&'a RawValue>,
    /// Real tokens the window leaves after the whole request (its
    /// estimate, no margin: what the ask follows was counted by the
    /// upstream), negative when the request is over it (the messages kept
    /// after the summary are not sent with the ask: their room is the
    /// ask's too).
    pub(crate) room: i64,
    /// Real tokens a rough token is worth.
    pub(crate) scale: f64,
}

/// Where the summary call goes and as whom.
pub(crate) struct SummaryTarget<'a> {
    /// The summary endpoint, or the upstream's own base.
    pub(crate) base: &'a UpstreamBase,
    /// The model named when the engine asks for none.
    pub(crate) main_model: String,
    /// The configured summary key, replacing the client's credentials.
    pub(crate) api_key: Option<&'a str>,
    /// Deadline of one whole call.
    pub(crate) timeout: Duration,
}

impl<'a> SummaryTarget<'a> {
    /// The configured target: `endpoint` when set, else the upstream itself.
    pub(crate) fn configured(
        cfg: &'a CompactionConfig,
        endpoint: Option<&'a UpstreamBase>,
        upstream: &'a Upstream,
        main_model: String,
    ) -> Self {
        SummaryTarget {
            base: endpoint.unwrap_or(upstream.base()),
            main_model,
            api_key: cfg.summary_api_key.as_deref(),
            timeout: Duration::from_secs(cfg.summary_timeout_secs.max(1)),
        }
    }
}

/// Summary calls for one request.
pub(crate) struct HttpSummariser<'a> {
    upstream: &'a Upstream,
    base: &'a UpstreamBase,
    main_model: String,
    headers: HeaderMap,
    timeout: Duration,
    prompt_budget_chars: usize,
    /// Upper bound on the reply, so prompt + reply fit the summariser's
    /// window. `None` leaves the length to the model (batch summaries are
    /// not capped on the wire for large windows).
    max_reply_tokens: Option<u32>,
    calls: AtomicU64,
    /// The API of the summary call.
    api: Api,
    /// The summary call goes to the upstream (not a summary endpoint).
    to_upstream: bool,
    /// The configured summary key, for APIs that take it in another header.
    api_key: Option<String>,
    /// The client's credential query parameters (`key=…`), as it sent them.
    credential_query: Option<String>,
    /// What firmer retries gave for this summariser's models.
    firm_retries: Option<Arc<FirmRetries>>,
    /// The conversation an ask may follow ([`InContext`]).
    context: Option<InContext<'a>>,
    /// Calls asked after the conversation.
    in_context_calls: AtomicU64,
    /// Ollama: the conversation's `options.num_ctx`, sent again, so the
    /// summary call does not make Ollama load the model at another size.
    num_ctx: Option<u64>,
}

/// Per (summary target, model): whether the firmer-length retry of a
/// summary cut at its reply cap ever comes back within the cap. Against a
/// model that ignores length instructions every summary is cut, every
/// retry is cut again, and the retries double the summary calls; after
/// [`FirmRetries::GIVE_UP_AFTER`] such retries and none within the cap,
/// that model's cut summaries are kept at their last complete line without
/// one.
#[derive(Debug, Default)]
pub(crate) struct FirmRetries {
    seen: dashmap::DashMap<String, (u32, u32)>,
}

impl FirmRetries {
    /// Retries cut again, with none within the cap, before giving up.
    pub(crate) const GIVE_UP_AFTER: u32 = 2;

    fn key(base: &str, model: &str) -> String {
        format!("{base}\u{0}{model}")
    }

    /// Whether a retry is still worth a call for `model` at `base`.
    pub(crate) fn useful(&self, base: &str, model: &str) -> bool {
        self.seen
            .get(&Self::key(base, model))
            .is_none_or(|e| e.1 > 0 || e.0 < Self::GIVE_UP_AFTER)
    }

    /// One retry's result.
    pub(crate) fn note(&self, base: &str, model: &str, within_cap: bool) {
        let mut e = self.seen.entry(Self::key(base, model)).or_default();
        if within_cap {
            e.1 += 1;
        } else {
            e.0 += 1;
            if e.0 == Self::GIVE_UP_AFTER && e.1 == 0 {
                tracing::info!(
                    retries = e.0,
                    "summaries of this model stay cut at their reply cap: no more firmer-length retries for it"
                );
            }
        }
    }
}

impl<'a> HttpSummariser<'a> {
    /// A summariser that sends to `target` with the credentials found in
    /// `client_headers` (or the target's key when one is configured).
    pub(crate) fn new(
        upstream: &'a Upstream,
        target: SummaryTarget<'a>,
        client_headers: &HeaderMap,
        (prompt_budget_chars, max_reply_tokens): (usize, Option<u32>),
    ) -> Self {
        let mut headers = HeaderMap::new();
        for name in FORWARDED {
            for v in client_headers.get_all(*name) {
                headers.append(*name, v.clone());
            }
        }
        if let Some(key) = target.api_key {
            headers.remove(header::AUTHORIZATION);
            headers.remove("api-key");
            headers.remove("x-api-key");
            headers.remove("x-goog-api-key");
            if let Ok(v) = HeaderValue::from_str(&format!("Bearer {key}")) {
                headers.insert(header::AUTHORIZATION, v);
            }
        }
        // `configured` hands out the upstream's own base when no summary
        // endpoint is set.
        let to_upstream = std::ptr::eq(target.base, upstream.base());
        Self {
            api: Api::Chat,
            to_upstream,
            api_key: target.api_key.map(str::to_owned),
            upstream,
            base: target.base,
            main_model: target.main_model,
            headers,
            timeout: target.timeout,
            prompt_budget_chars,
            max_reply_tokens,
            calls: AtomicU64::new(0),
            firm_retries: None,
            credential_query: None,
            context: None,
            in_context_calls: AtomicU64::new(0),
            num_ctx: None,
        }
    }

    /// On Ollama's chat: the window the conversation's requests load the
    /// model with (`options.num_ctx`), asked with the summary too.
    pub(crate) fn loading(mut self, num_ctx: Option<u64>) -> Self {
        self.num_ctx = num_ctx;
        self
    }

    /// Asks summaries after `context` when a request carries an in-context
    /// ask, goes to the upstream on the main model in chat completions, and
    /// fits the room the window leaves (see [`InContext`]).
    pub(crate) fn after(mut self, context: InContext<'a>) -> Self {
        self.context = Some(context);
        self
    }

    /// Calls that were asked after the conversation.
    pub(crate) fn in_context_calls(&self) -> u64 {
        self.in_context_calls.load(Ordering::Relaxed)
    }

    /// The wire `max_tokens` of a request.
    fn reply_cap(&self, req: &SummaryRequest) -> Option<u32> {
        match (req.max_tokens, self.max_reply_tokens) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// The body of `req` asked after the conversation, when it can be.
    fn in_context_body(&self, req: &SummaryRequest) -> Option<String> {
        let ask = req.in_context.as_ref()?;
        let ctx = self.context.as_ref()?;
        if self.api != Api::Chat || !self.to_upstream || req.model.is_some() {
            return None;
        }
        let cap = self.reply_cap(req).unwrap_or(MESSAGES_DEFAULT_MAX_TOKENS);
        ask_after(ctx, ask, &self.main_model, cap, req.temperature)
    }

    /// Presents the client's credential query parameters (see
    /// [`crate::session::key::credential_query`]) on the summary call, as
    /// the client sent them: a client that authenticates by `?key=` is
    /// summarised as itself. A configured summary key replaces them.
    pub(crate) fn with_credential_query(mut self, query: Option<&str>) -> Self {
        if self.api_key.is_none() {
            self.credential_query = query.map(str::to_owned);
        }
        self
    }

    /// Learns (and follows) whether firmer-length retries help this
    /// target's models.
    pub(crate) fn learning(mut self, firm_retries: &Arc<FirmRetries>) -> Self {
        self.firm_retries = Some(Arc::clone(firm_retries));
        self
    }

    /// Asks summaries in the conversation's `api` when they go to the
    /// upstream (a summary endpoint keeps chat completions).
    pub(crate) fn speaking(mut self, api: Api) -> Self {
        if self.to_upstream {
            self.api = api;
        }
        if self.api == Api::Messages {
            if let Some(v) = self
                .api_key
                .as_deref()
                .and_then(|k| HeaderValue::from_str(k).ok())
            {
                self.headers.insert("x-api-key", v);
            }
        }
        self
    }

    /// Summary calls made so far.
    pub(crate) fn calls(&self) -> u64 {
        self.calls.load(Ordering::Relaxed)
    }

    fn body(&self, req: &SummaryRequest) -> Value {
        let model = req.model.as_deref().unwrap_or(&self.main_model);
        let mut body = match self.api {
            Api::Chat | Api::Messages | Api::Ollama => json!({
                "model": model,
                "messages": [{"role": "user", "content": req.prompt}],
                "stream": false,
            }),
            Api::Responses => json!({
                "model": model,
                "input": [{"type": "message", "role": "user", "content": req.prompt}],
                "stream": false,
                "store": false,
            }),
        };
        let max_tokens = self.reply_cap(req);
        if self.api == Api::Ollama {
            return self.ollama_options(body, max_tokens, req.temperature);
        }
        let max_key = match self.api {
            Api::Chat | Api::Messages | Api::Ollama => "max_tokens",
            Api::Responses => "max_output_tokens",
        };
        let max_tokens = match self.api {
            Api::Messages => Some(max_tokens.unwrap_or(MESSAGES_DEFAULT_MAX_TOKENS)),
            _ => max_tokens,
        };
        if let Some(m) = max_tokens {
            body[max_key] = json!(m);
        }
        if let Some(t) = req.temperature {
            body["temperature"] = json!(t);
        }
        body
    }

    /// Ollama takes the reply cap and temperature in `options`, with the
    /// conversation's `num_ctx`.
    fn ollama_options(&self, mut body: Value, cap: Option<u32>, temperature: Option<f32>) -> Value {
        let mut options = serde_json::Map::new();
        if let Some(n) = self.num_ctx {
            options.insert("num_ctx".to_owned(), json!(n));
        }
        if let Some(m) = cap {
            options.insert("num_predict".to_owned(), json!(m));
        }
        if let Some(t) = temperature {
            options.insert("temperature".to_owned(), json!(t));
        }
        if !options.is_empty() {
            body["options"] = Value::Object(options);
        }
        body
    }

    async fn call(&self, req: SummaryRequest) -> Result<SummaryReply, SummaryError> {
        let bytes = match self.in_context_body(&req) {
            Some(body) => {
                self.in_context_calls.fetch_add(1, Ordering::Relaxed);
                Bytes::from(body)
            }
            None => Bytes::from(self.body(&req).to_string()),
        };
        self.calls.fetch_add(1, Ordering::Relaxed);
        let (status, body) = self
            .upstream
            .post_json_query(
                self.base,
                match self.api {
                    Api::Chat => "/v1/chat/completions",
                    Api::Messages => "/v1/messages",
                    Api::Responses => "/v1/responses",
                    Api::Ollama => "/api/chat",
                },
                self.credential_query.as_deref(),
                self.headers.clone(),
                bytes,
                MAX_REPLY_BYTES,
            )
            .await
            .map_err(|e| match e {
                FetchError::Body { status, message } => SummaryError::new(
                    SummaryErrorKind::StreamClosed,
                    Some(status.as_u16()),
                    message,
                ),
                FetchError::Uri(m) => SummaryError::new(SummaryErrorKind::NoProvider, None, m),
                FetchError::Timeout => {
                    SummaryError::new(SummaryErrorKind::Timeout, None, "summary call timed out")
                }
                other => SummaryError::new(SummaryErrorKind::Network, None, other.to_string()),
            })?;
        if !status.is_success() {
            let (error_type, code) = error_codes(&body);
            return Err(SummaryError::http_error(
                status.as_u16(),
                error_message(&body, status.as_u16()),
                error_type,
                code,
            ));
        }
        match self.api {
            Api::Chat => parse_reply(&body),
            Api::Messages => parse_messages_reply(&body),
            Api::Responses => parse_responses_reply(&body),
            Api::Ollama => parse_ollama_reply(&body),
        }
    }
}

#[async_trait::async_trait]
impl Summariser for HttpSummariser<'_> {
    async fn summarise(&self, req: SummaryRequest) -> Result<SummaryReply, SummaryError> {
        match tokio::time::timeout(self.timeout, self.call(req)).await {
            Ok(r) => r,
            Err(_) => Err(SummaryError::new(
                SummaryErrorKind::Timeout,
                None,
                format!("summary call timed out after {}s", self.timeout.as_secs()),
            )),
        }
    }

    fn prompt_budget_chars(&self) -> usize {
        self.prompt_budget_chars
    }

    fn firm_retry_useful(&self) -> bool {
        self.firm_retries
            .as_ref()
            .is_none_or(|f| f.useful(&self.base.to_string(), &self.main_model))
    }

    fn note_firm_retry(&self, within_cap: bool) {
        if let Some(f) = &self.firm_retries {
            f.note(&self.base.to_string(), &self.main_model, within_cap);
        }
    }
}

/// A chat completion body asking `ask` after the conversation of `ctx`
/// (see [`InContext`]), when the ask and a reply of `cap` tokens fit the
/// room its window leaves.
/// What the ask and its reply are counted at against the room: the
/// upstream counted what they follow, not them.
const ASK_SLACK: f64 = 1.1;

fn ask_after(
    ctx: &InContext<'_>,
    ask: &InContextAsk,
    model: &str,
    cap: u32,
    temperature: Option<f32>,
) -> Option<String> {
    let shown = ctx.messages.len().checked_sub(ask.keep_last)?;
    let not_sent: u64 = ctx.rough.get(shown..).map_or(0, |r| r.iter().sum());
    // The reply the room leaves after the ask (rough units, as the cap is
    // counted with them), a tenth kept back for what the estimates of the
    // ask and the reply may miss: the cap, or less down to the ask's
    // minimum.
    let fits = ((ctx.room as f64 / ctx.scale + not_sent as f64) / ASK_SLACK
        - estimate_text_tokens(&ask.prompt) as f64)
        .floor();
    let cap = if f64::from(cap) <= fits {
        cap
    } else if fits >= f64::from(ask.min_reply) {
        fits as u32
    } else {
        return None;
    };
    let ask = ask.prompt.as_str();
    let (last, before) = ctx.messages[..shown].split_last()?;
    let mut out = String::with_capacity(
        ctx.messages
            .iter()
            .map(|m| m.get().len() + 1)
            .sum::<usize>()
            + ask.len()
            + ctx.tools.map_or(0, |t| t.get().len())
            + 128,
    );
    out.push_str("{\"model\":");
    out.push_str(&json!(model).to_string());
    out.push_str(",\"messages\":[");
    for m in before {
        out.push_str(m.get());
        out.push(',');
    }
    // Appended to the last user message, where there is one: its text and
    // everything before it stay as the upstream saw them, and roles still
    // alternate for templates that insist (Gemma's).
    let mut last_v: Value = serde_json::from_str(last.get()).ok()?;
    if append_ask(&mut last_v, ask) {
        out.push_str(&last_v.to_string());
    } else {
        out.push_str(last.get());
        out.push(',');
        out.push_str(&json!({"role": "user", "content": ask}).to_string());
    }
    out.push(']');
    if let Some(tools) = ctx.tools {
        // The tools stay for the cache (templates render them before the
        // messages); the reply must be text.
        out.push_str(",\"tools\":");
        out.push_str(tools.get());
        out.push_str(",\"tool_choice\":\"none\"");
    }
    out.push_str(&format!(",\"stream\":false,\"max_tokens\":{cap}"));
    if let Some(t) = temperature {
        out.push_str(&format!(",\"temperature\":{}", json!(t)));
    }
    out.push('}');
    Some(out)
}

/// `ask` appended to `m` when it is a user message: after its text (two
/// blank lines between), or as a text part after its parts.
fn append_ask(m: &mut Value, ask: &str) -> bool {
    if m.get("role").and_then(Value::as_str) != Some("user") {
        return false;
    }
    match m.get_mut("content") {
        Some(Value::String(text)) => {
            text.push_str("\n\n");
            text.push_str(ask);
            true
        }
        Some(Value::Array(parts)) => {
            parts.push(json!({"type": "text", "text": ask}));
            true
        }
        _ => false,
    }
}

/// The provider's own message of an error answer, else a generic one.
fn error_message(body: &[u8], status: u16) -> String {
    let parsed: Option<Value> = serde_json::from_slice(body).ok();
    let msg = parsed.as_ref().and_then(|v| {
        v.pointer("/error/message")
            .or_else(|| v.get("message"))
            .or_else(|| v.get("error"))
            .and_then(Value::as_str)
            .map(str::to_owned)
    });
    let code = parsed
        .as_ref()
        .and_then(|v| {
            v.pointer("/error/code")
                .or_else(|| v.pointer("/error/type"))
        })
        .map(|c| c.to_string().trim_matches('"').to_owned());
    match (msg, code) {
        (Some(m), Some(c)) => format!("HTTP {status} {c}: {m}"),
        (Some(m), None) => format!("HTTP {status}: {m}"),
        _ => format!("HTTP {status}"),
    }
}

/// The `error.type` and `error.code` of an error answer (OpenAI's shape,
/// Anthropic's `type` alone): what the engine classifies the failure by.
fn error_codes(body: &[u8]) -> (Option<String>, Option<String>) {
    let Ok(v) = serde_json::from_slice::<Value>(body) else {
        return (None, None);
    };
    // A string, or a number (llama.cpp's `code: 400`) written as one.
    let field = |p: &str| {
        v.pointer(p)
            .filter(|c| !c.is_null())
            .map(|c| c.as_str().map_or_else(|| c.to_string(), str::to_owned))
    };
    (field("/error/type"), field("/error/code"))
}

/// `choices[0]` of a chat completion as a [`SummaryReply`].
pub(crate) fn parse_reply(body: &[u8]) -> Result<SummaryReply, SummaryError> {
    let v: Value = serde_json::from_slice(body).map_err(|e| {
        SummaryError::new(
            SummaryErrorKind::Decode,
            None,
            format!("summary response is not JSON: {e}"),
        )
    })?;
    let choice = v.pointer("/choices/0").ok_or_else(|| {
        SummaryError::new(
            SummaryErrorKind::Decode,
            None,
            "summary response has no choices",
        )
    })?;
    let message = choice.get("message");
    let text = |key: &str| {
        message
            .and_then(|m| m.get(key))
            .and_then(Value::as_str)
            .filter(|s| !s.is_empty())
            .map(str::to_owned)
    };
    Ok(SummaryReply {
        content: message.and_then(|m| m.get("content")).cloned(),
        finish_reason: choice
            .get("finish_reason")
            .and_then(Value::as_str)
            .map(str::to_owned),
        refusal: text("refusal"),
        reasoning: text("reasoning_content").or_else(|| text("reasoning")),
    })
}

fn decode_error(message: &str) -> SummaryError {
    SummaryError::new(SummaryErrorKind::Decode, None, message.to_owned())
}

/// The text parts (`key` = `type`) of a list of content blocks, joined.
fn joined_text(blocks: &[Value], key: &str) -> Option<String> {
    let texts: Vec<&str> = blocks
        .iter()
        .filter(|b| b.get("type").and_then(Value::as_str) == Some(key))
        .filter_map(|b| b.get("text").and_then(Value::as_str))
        .collect();
    (!texts.is_empty()).then(|| texts.concat())
}

/// An Anthropic message as a [`SummaryReply`]: the text blocks joined,
/// `stop_reason: "max_tokens"` as the truncation (`length`).
pub(crate) fn parse_messages_reply(body: &[u8]) -> Result<SummaryReply, SummaryError> {
    let v: Value = serde_json::from_slice(body)
        .map_err(|e| decode_error(&format!("summary response is not JSON: {e}")))?;
    let blocks = v
        .get("content")
        .and_then(Value::as_array)
        .ok_or_else(|| decode_error("summary response has no content"))?;
    let finish_reason = v
        .get("stop_reason")
        .and_then(Value::as_str)
        .map(|r| match r {
            "max_tokens" => "length",
            "refusal" => "content_filter",
            "tool_use" => "tool_calls",
            _ => "stop",
        });
    let thinking: Vec<&str> = blocks
        .iter()
        .filter_map(|b| b.get("thinking").and_then(Value::as_str))
        .collect();
    Ok(SummaryReply {
        content: joined_text(blocks, "text").map(Value::String),
        finish_reason: finish_reason.map(str::to_owned),
        refusal: None,
        reasoning: (!thinking.is_empty()).then(|| thinking.concat()),
    })
}

/// An Ollama `/api/chat` reply as a [`SummaryReply`]: `message.content`,
/// `done_reason: "length"` for a reply cut at `num_predict`.
pub(crate) fn parse_ollama_reply(body: &[u8]) -> Result<SummaryReply, SummaryError> {
    let v: Value = serde_json::from_slice(body)
        .map_err(|e| decode_error(&format!("summary response is not JSON: {e}")))?;
    let message = v
        .get("message")
        .filter(|m| m.is_object())
        .ok_or_else(|| decode_error("summary response has no message"))?;
    let finish_reason = match v.get("done_reason").and_then(Value::as_str) {
        Some("length") => "length",
        _ => "stop",
    };
    Ok(SummaryReply {
        content: message.get("content").cloned(),
        finish_reason: Some(finish_reason.to_owned()),
        refusal: None,
        reasoning: message
            .get("thinking")
            .and_then(Value::as_str)
            .filter(|s| !s.is_empty())
            .map(str::to_owned),
    })
}

/// A Responses response as a [`SummaryReply`]: the `output_text` parts of
/// its message items, `status: "incomplete"` for `max_output_tokens` as the
/// truncation (`length`).
pub(crate) fn parse_responses_reply(body: &[u8]) -> Result<SummaryReply, SummaryError> {
    let v: Value = serde_json::from_slice(body)
        .map_err(|e| decode_error(&format!("summary response is not JSON: {e}")))?;
    let output = v
        .get("output")
        .and_then(Value::as_array)
        .ok_or_else(|| decode_error("summary response has no output"))?;
    let mut text = String::new();
    let mut refusal = None;
    for item in output {
        for part in item
            .get("content")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
        {
            match part.get("type").and_then(Value::as_str) {
                Some("output_text") => {
                    text.push_str(part.get("text").and_then(Value::as_str).unwrap_or(""));
                }
                Some("refusal") => {
                    refusal = part
                        .get("refusal")
                        .and_then(Value::as_str)
                        .map(str::to_owned);
                }
                _ => {}
            }
        }
    }
    let incomplete = v.get("status").and_then(Value::as_str) == Some("incomplete");
    let finish_reason = if incomplete {
        match v
            .pointer("/incomplete_details/reason")
            .and_then(Value::as_str)
        {
            Some("content_filter") => "content_filter",
            _ => "length",
        }
    } else {
        "stop"
    };
    Ok(SummaryReply {
        content: (!text.is_empty()).then_some(Value::String(text)),
        finish_reason: Some(finish_reason.to_owned()),
        refusal,
        reasoning: None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn raw(v: Value) -> Box<RawValue> {
        serde_json::value::to_raw_value(&v).unwrap()
    }

    /// An ask whose cap is never lowered.
    fn ask(prompt: &str, keep_last: usize) -> InContextAsk {
        InContextAsk {
            prompt: prompt.to_owned(),
            keep_last,
            min_reply: u32::MAX,
        }
    }

    fn body_of(ctx: &InContext<'_>, a: &InContextAsk, cap: u32) -> Option<Value> {
        ask_after(ctx, a, "m", cap, None).map(|b| serde_json::from_str(&b).unwrap())
    }

    /// The conversation's messages before those kept after the summary,
    /// and its tools, go again as they were, the ask after the last user
    /// message's text; a last message of another role gets the ask as a
    /// user message of its own; without room, no body.
    #[test]
    fn an_ask_after_the_conversation_keeps_its_prefix() {
        let messages = vec![
            raw(json!({"role": "system", "content": "rules"})),
            raw(json!({"role": "user", "content": "the log"})),
            raw(json!({"role": "assistant", "content": "read it"})),
            raw(json!({"role": "user", "content": "now this"})),
        ];
        let rough = [10, 100, 10, 300];
        let tools = raw(json!([{"type": "function", "function": {"name": "read"}}]));
        let ctx = InContext {
            messages: &messages,
            rough: &rough,
            tools: Some(&tools),
            room: 1_000,
            scale: 1.0,
        };
        // The last two are kept after the summary: the ask follows the two
        // before them.
        let body = body_of(&ctx, &ask("SUMMARISE", 2), 500).unwrap();
        assert_eq!(
            body["messages"][0],
            json!({"role": "system", "content": "rules"})
        );
        assert_eq!(body["messages"][1]["content"], "the log\n\nSUMMARISE");
        assert_eq!(body["messages"].as_array().unwrap().len(), 2);
        assert_eq!(body["tools"], serde_json::to_value(&*tools).unwrap());
        assert_eq!(body["tool_choice"], "none");
        assert_eq!(
            (body["max_tokens"].as_u64(), body["stream"].as_bool()),
            (Some(500), Some(false))
        );
        // The earlier messages are the client's bytes.
        let text = ask_after(&ctx, &ask("S", 2), "m", 500, None).unwrap();
        assert!(text.contains(messages[0].get()));
        // An assistant message last: the ask follows as a user message.
        let body = body_of(&ctx, &ask("S", 1), 10).unwrap();
        assert_eq!(body["messages"][3], json!({"role": "user", "content": "S"}));
        // Parts: the ask is a text part of its own.
        let parts = vec![raw(
            json!({"role": "user", "content": [{"type": "text", "text": "a"}]}),
        )];
        let ctx_parts = InContext {
            messages: &parts,
            rough: &[1],
            tools: None,
            ..ctx
        };
        let body = body_of(&ctx_parts, &ask("S", 0), 10).unwrap();
        assert_eq!(
            body["messages"][0]["content"][1],
            json!({"type": "text", "text": "S"})
        );
        assert!(body.get("tools").is_none() && body.get("tool_choice").is_none());
        // The ask and its reply must fit the room, which the messages kept
        // after the summary (not sent with the ask) add to, at the scale.
        assert!(body_of(&ctx, &ask("S", 0), 1_001).is_none());
        assert!(body_of(&ctx, &ask("S", 1), 1_150).is_some());
        assert!(body_of(&ctx, &ask("S", 1), 1_200).is_none());
        let dense = InContext { scale: 2.0, ..ctx };
        assert!(body_of(&dense, &ask("S", 0), 600).is_none());
        assert!(body_of(&dense, &ask("S", 0), 400).is_some());
        // A request over its window: the kept messages must make room for
        // the ask, the reply and the overshoot.
        let over = InContext { room: -200, ..ctx };
        assert!(body_of(&over, &ask("S", 1), 80).is_some());
        assert!(body_of(&over, &ask("S", 1), 95).is_none());
        // Nothing before the kept messages: nothing to ask after.
        assert!(body_of(&ctx, &ask("S", 5), 10).is_none());
    }

    /// A conversation at its window's edge leaves the ask less than its
    /// cap: the cap is lowered to what fits, down to the ask's minimum.
    #[test]
    fn an_ask_lowers_its_cap_to_fit_down_to_its_minimum() {
        let messages = vec![
            raw(json!({"role": "user", "content": "the log"})),
            raw(json!({"role": "assistant", "content": "read it"})),
            raw(json!({"role": "user", "content": "now this"})),
        ];
        let ctx = InContext {
            messages: &messages,
            rough: &[100, 10, 300],
            tools: None,
            room: -100,
            scale: 1.0,
        };
        // 300 kept after the summary, 100 over the window, an ask of ~1:
        // 180 left for the reply (a tenth kept back).
        let lowered = InContextAsk {
            min_reply: 150,
            ..ask("S", 1)
        };
        let body = body_of(&ctx, &lowered, 1_000).unwrap();
        assert_eq!(body["max_tokens"], 180);
        assert_eq!(body_of(&ctx, &lowered, 120).unwrap()["max_tokens"], 120);
        let strict = InContextAsk {
            min_reply: 250,
            ..ask("S", 1)
        };
        assert!(body_of(&ctx, &strict, 1_000).is_none());
    }

    #[test]
    fn firmer_retries_stop_per_model_after_two_cut_again() {
        let f = FirmRetries::default();
        assert!(f.useful("http://u", "small"));
        f.note("http://u", "small", false);
        assert!(f.useful("http://u", "small"), "one is not enough");
        f.note("http://u", "small", false);
        assert!(!f.useful("http://u", "small"));
        // Per model and per target.
        assert!(f.useful("http://u", "large"));
        assert!(f.useful("http://other", "small"));
        // A model whose retry once came back within the cap keeps them.
        f.note("http://u", "large", true);
        for _ in 0..5 {
            f.note("http://u", "large", false);
        }
        assert!(f.useful("http://u", "large"));
    }

    #[test]
    fn parses_an_anthropic_message() {
        let r = parse_messages_reply(
            br###"{"type":"message","role":"assistant","content":[{"type":"thinking","thinking":"hm"},{"type":"text","text":"## Sum"},{"type":"text","text":"mary"}],"stop_reason":"end_turn"}"###,
        )
        .unwrap();
        assert_eq!(r.content, Some(Value::String("## Summary".into())));
        assert_eq!(r.finish_reason.as_deref(), Some("stop"));
        assert_eq!(r.reasoning.as_deref(), Some("hm"));
        let cut = parse_messages_reply(
            br###"{"content":[{"type":"text","text":"## S"}],"stop_reason":"max_tokens"}"###,
        )
        .unwrap();
        assert_eq!(cut.finish_reason.as_deref(), Some("length"));
        let e = parse_messages_reply(br#"{"type":"error"}"#).unwrap_err();
        assert_eq!(e.origin(), SummaryErrorKind::Decode);
    }

    #[test]
    fn parses_a_responses_response() {
        let r = parse_responses_reply(
            br###"{"status":"completed","output":[{"type":"reasoning","summary":[]},{"type":"message","role":"assistant","content":[{"type":"output_text","text":"## Summary"}]}]}"###,
        )
        .unwrap();
        assert_eq!(r.content, Some(Value::String("## Summary".into())));
        assert_eq!(r.finish_reason.as_deref(), Some("stop"));
        let cut = parse_responses_reply(
            br###"{"status":"incomplete","incomplete_details":{"reason":"max_output_tokens"},"output":[{"type":"message","content":[{"type":"output_text","text":"## S"}]}]}"###,
        )
        .unwrap();
        assert_eq!(cut.finish_reason.as_deref(), Some("length"));
        assert!(parse_responses_reply(br#"{"object":"list"}"#).is_err());
    }

    #[test]
    fn parses_a_chat_completion() {
        let r = parse_reply(
            br###"{"choices":[{"index":0,"message":{"role":"assistant","content":"## Summary","reasoning_content":"hm"},"finish_reason":"stop"}]}"###,
        )
        .unwrap();
        assert_eq!(r.content, Some(Value::String("## Summary".into())));
        assert_eq!(r.finish_reason.as_deref(), Some("stop"));
        assert_eq!(r.reasoning.as_deref(), Some("hm"));
    }

    #[test]
    fn html_error_page_is_a_decode_error() {
        let e = parse_reply(b"<html>502 Bad Gateway</html>").unwrap_err();
        assert_eq!(e.origin(), SummaryErrorKind::Decode);
        let e = parse_reply(br#"{"object":"list"}"#).unwrap_err();
        assert_eq!(e.origin(), SummaryErrorKind::Decode);
    }

    #[test]
    fn error_message_keeps_the_providers_words() {
        let m = error_message(
            br#"{"error":{"message":"You exceeded your current quota","type":"insufficient_quota","code":"insufficient_quota"}}"#,
            429,
        );
        assert!(
            m.contains("insufficient_quota") && m.contains("exceeded your current quota"),
            "{m}"
        );
        assert_eq!(error_message(b"nope", 500), "HTTP 500");
        assert_eq!(
            error_codes(br#"{"error":{"message":"m","type":"insufficient_quota","code":"insufficient_quota"}}"#),
            (Some("insufficient_quota".into()), Some("insufficient_quota".into()))
        );
        assert_eq!(
            error_codes(
                br#"{"type":"error","error":{"type":"overloaded_error","message":"Overloaded"}}"#
            ),
            (Some("overloaded_error".into()), None)
        );
        assert_eq!(error_codes(b"<html>"), (None, None));
    }
}
