//! Recognising context-overflow errors across upstreams and reading the
//! numbers they carry.
//!
//! Matching uses the HTTP status, structured fields (`error.code`,
//! `error.type`, `metadata.error_type`, llama.cpp's `n_ctx` /
//! `n_prompt_tokens`) and the whole body text, because some gateways wrap the
//! provider's error as a JSON string inside `metadata.raw`. Rate-limit and
//! quota errors are never overflow, whatever else they say.

use std::sync::LazyLock;

use regex::Regex;
use serde::Deserialize;
use serde_json::Value;

/// What kind of overflow.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum OverflowKind {
    /// The prompt does not fit: compaction helps.
    Prompt,
    /// The prompt fits but the requested output budget does not (vLLM's
    /// `'max_tokens' ... is too large`): lowering `max_tokens` helps.
    OutputBudget,
}

/// A recognised overflow.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Overflow {
    /// The context window the upstream enforces, when it said.
    pub(crate) limit: Option<u64>,
    /// The size of the request as the upstream counted it (prompt plus
    /// requested output where the wording includes it), when it said.
    pub(crate) requested: Option<u64>,
    /// Prompt tokens alone, when the wording separates them.
    pub(crate) prompt_tokens: Option<u64>,
    /// What would cure it.
    pub(crate) kind: OverflowKind,
}

/// Statuses that never mean overflow: auth, payment, not found, rate limit.
const NEVER: &[u16] = &[401, 402, 403, 404, 429];

/// Case-insensitive markers of rate-limit and quota errors.
const RATE_OR_QUOTA: &[&str] = &[
    "rate limit",
    "rate_limit",
    "ratelimit",
    "too many requests",
    "quota",
    "tokens per min",
    "requests per min",
    "tokens per day",
    "requests per day",
    "(tpm)",
    "(rpm)",
    "billing",
    "out of credits",
    "insufficient credits",
];

fn re(pattern: &str) -> Option<Regex> {
    Regex::new(pattern).ok()
}

/// Phrases that on their own identify an overflow: the wordings the known
/// providers and servers use for a prompt over the window.
static OVERFLOW_TEXT: LazyLock<Option<Regex>> = LazyLock::new(|| {
    re(
        r"(?i)context[_ ]length[_ ]exceeded|exceed_context_size_error|maximum context length is \d+|exceeds the available context size|exceeds the context window|context length is only \d+|prompt is too long|input is too long for requested model|input token count.*exceeds the maximum|maximum prompt length is \d+|reduce the length of the messages|exceeds the limit of \d+|greater than the context length|context window exceeds limit|exceeded model token limit|too large for model with \d+ maximum context length|input length.*exceeds.*context length|prompt too long; exceeded (?:max )?context length|the prompt is longer than the context length|must be <= \d+\. given: \d+ .?inputs.? tokens|token limit exceeded|too many tokens|max_tokens_exceeded|token_limit_exceeded|larger than the max context size|the request exceeds the available context size",
    )
});

/// vLLM: the output budget, not the prompt, is too large.
static OUTPUT_BUDGET: LazyLock<Option<Regex>> =
    LazyLock::new(|| re(r"(?i)'max_tokens' or 'max_completion_tokens' is too large: (\d+)"));

/// (pattern, which capture group is the window)
static LIMIT_PATTERNS: LazyLock<Vec<Regex>> = LazyLock::new(|| {
    [
        r"(?i)maximum context length is (\d+)",
        r"(?i)context length is only (\d+)",
        r"(?i)available context size \((\d+) tokens?\)",
        r"(?i)tokens? > (\d+) maximum",
        r"(?i)exceed context limit: \d+ \+ \d+ > (\d+)",
        r"(?i)must be <= (\d+)",
        r"(?i)exceeds the limit of (\d+)",
        r"(?i)maximum prompt length is (\d+)",
        r"(?i)too large for model with (\d+) maximum context length",
        r"(?i)context window of (\d+)",
    ]
    .iter()
    .filter_map(|p| re(p))
    .collect()
});

static REQUESTED_PATTERNS: LazyLock<Vec<Regex>> = LazyLock::new(|| {
    [
        r"(?i)for a total of (?:at least )?(\d+) tokens",
        r"(?i)you requested (?:about )?(\d+) tokens",
        r"(?i)resulted in (\d+) tokens",
        r"(?i)request \((\d+) tokens?\) exceeds",
        r"(?i)prompt is too long: (\d+) tokens",
    ]
    .iter()
    .filter_map(|p| re(p))
    .collect()
});

static PROMPT_PATTERNS: LazyLock<Vec<Regex>> = LazyLock::new(|| {
    [
        r"(?i)\((\d+) in the messages",
        r"(?i)prompt contains (?:at least )?(\d+) input tokens",
        r"(?i)your request has (\d+) input tokens",
        r"(?i)you passed (\d+) input tokens",
        r"(?i)given: (\d+) .?inputs.? tokens",
        r"(?i)request \((\d+) tokens?\) exceeds",
        r"(?i)resulted in (\d+) tokens",
        r"(?i)prompt is too long: (\d+) tokens",
        r"(?i)exceed context limit: (\d+) \+",
    ]
    .iter()
    .filter_map(|p| re(p))
    .collect()
});

fn first_number(patterns: &[Regex], text: &str) -> Option<u64> {
    patterns.iter().find_map(|r| {
        r.captures(text)
            .and_then(|c| c.get(1))
            .and_then(|m| m.as_str().parse().ok())
    })
}

#[derive(Deserialize)]
struct Envelope {
    error: Option<Value>,
    // vLLM's old shape has no `error` wrapper.
    #[serde(rename = "type")]
    kind: Option<Value>,
    code: Option<Value>,
}

fn structured(body: &[u8]) -> (bool, Option<u64>, Option<u64>) {
    let Ok(env) = serde_json::from_slice::<Envelope>(body) else {
        return (false, None, None);
    };
    let err = env.error.unwrap_or(Value::Null);
    let field = |v: &Value, k: &str| v.get(k).and_then(Value::as_str).map(str::to_owned);
    let is_ctx = |s: Option<String>| {
        s.is_some_and(|s| s == "context_length_exceeded" || s == "exceed_context_size_error")
    };
    let signal = is_ctx(field(&err, "code"))
        || is_ctx(field(&err, "type"))
        || is_ctx(err.get("metadata").and_then(|m| field(m, "error_type")))
        || is_ctx(
            env.kind
                .as_ref()
                .and_then(|v| v.as_str().map(str::to_owned)),
        )
        || is_ctx(
            env.code
                .as_ref()
                .and_then(|v| v.as_str().map(str::to_owned)),
        );
    let n_ctx = err.get("n_ctx").and_then(Value::as_u64);
    let n_prompt = err.get("n_prompt_tokens").and_then(Value::as_u64);
    (signal, n_ctx, n_prompt)
}

/// Recognises an overflow error response (`status` as received; use 200
/// for a payload found inside a stream).
pub(crate) fn parse_overflow(status: u16, body: &[u8]) -> Option<Overflow> {
    if NEVER.contains(&status) {
        return None;
    }
    let text = String::from_utf8_lossy(body);
    let lower = text.to_ascii_lowercase();
    if RATE_OR_QUOTA.iter().any(|m| lower.contains(m)) {
        return None;
    }
    let (signal, n_ctx, n_prompt) = structured(body);
    let output_budget = OUTPUT_BUDGET.as_ref().is_some_and(|r| r.is_match(&text));
    let text_match = OVERFLOW_TEXT.as_ref().is_some_and(|r| r.is_match(&text));
    let bare_413 = status == 413 && lower.contains("request entity too large");
    if !(signal || text_match || output_budget || bare_413 || n_ctx.is_some()) {
        return None;
    }
    let prompt_tokens = n_prompt.or_else(|| first_number(&PROMPT_PATTERNS, &text));
    Some(Overflow {
        limit: n_ctx.or_else(|| first_number(&LIMIT_PATTERNS, &text)),
        requested: n_prompt
            .or_else(|| first_number(&REQUESTED_PATTERNS, &text))
            .or(prompt_tokens),
        prompt_tokens,
        kind: if output_budget {
            OverflowKind::OutputBudget
        } else {
            OverflowKind::Prompt
        },
    })
}

/// Recognises an overflow in an in-stream error payload (an SSE `error`
/// event or a `data: {"error":..}` chunk).
pub(crate) fn parse_overflow_event(payload: &[u8]) -> Option<Overflow> {
    parse_overflow(200, payload)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ov(status: u16, body: &str) -> Option<Overflow> {
        parse_overflow(status, body.as_bytes())
    }

    #[test]
    fn openai_wordings() {
        let o = ov(400, r#"{"error":{"message":"This model's maximum context length is 4097 tokens. However, your messages resulted in 4294 tokens. Please reduce the length of the messages.","type":"invalid_request_error","param":"messages","code":"context_length_exceeded"}}"#).unwrap();
        assert_eq!(
            (o.limit, o.requested, o.prompt_tokens),
            (Some(4097), Some(4294), Some(4294))
        );
        let o = ov(400, r#"{"error":{"message":"This model's maximum context length is 4096 tokens. However, you requested 4118 tokens (3118 in the messages, 1000 in the completion). Please reduce the length of the messages or completion.","type":"invalid_request_error","param":"messages","code":"context_length_exceeded"}}"#).unwrap();
        assert_eq!(
            (o.limit, o.requested, o.prompt_tokens),
            (Some(4096), Some(4118), Some(3118))
        );
        assert_eq!(o.kind, OverflowKind::Prompt);
        let o = parse_overflow_event(br#"{"type":"error","sequence_number":2,"error":{"type":"invalid_request_error","code":"context_length_exceeded","message":"Your input exceeds the context window of this model. Please adjust your input and try again.","param":"input"}}"#).unwrap();
        assert_eq!((o.limit, o.requested), (None, None));
    }

    #[test]
    fn llamacpp_wordings() {
        let o = ov(400, r#"{"error":{"code":400,"message":"request (13392 tokens) exceeds the available context size (8192 tokens), try increasing it","type":"exceed_context_size_error","n_prompt_tokens":13392,"n_ctx":8192}}"#).unwrap();
        assert_eq!(
            (o.limit, o.requested, o.prompt_tokens),
            (Some(8192), Some(13392), Some(13392))
        );
        // Structured fields win over the text.
        let o = ov(400, r#"{"error":{"code":400,"message":"the request exceeds the available context size, try increasing it","type":"exceed_context_size_error","n_prompt_tokens":5000,"n_ctx":4096}}"#).unwrap();
        assert_eq!((o.limit, o.requested), (Some(4096), Some(5000)));
        // Late-2024 in-stream `error:` field, no numbers.
        let o = parse_overflow_event(br#"{"code":400,"message":"the request exceeds the available context size. try increasing the context size or enable context shift","type":"invalid_request_error"}"#).unwrap();
        assert_eq!(o.limit, None);
    }

    #[test]
    fn vllm_wordings() {
        let o = ov(400, r#"{"object":"error","message":"This model's maximum context length is 8192 tokens. However, you requested 9100 tokens (8100 in the messages, 1000 in the completion). Please reduce the length of the messages or completion.","type":"BadRequestError","param":null,"code":400}"#).unwrap();
        assert_eq!(
            (o.limit, o.requested, o.prompt_tokens),
            (Some(8192), Some(9100), Some(8100))
        );
        let o = ov(400, r#"{"error":{"message":"This model's maximum context length is 32768 tokens. However, your request has 66511 input tokens. Please reduce the length of the input messages. (parameter=input_tokens, value=66511)","type":"BadRequestError","param":"input_tokens","code":400}}"#).unwrap();
        assert_eq!((o.limit, o.prompt_tokens), (Some(32768), Some(66511)));
        let o = ov(400, r#"{"error":{"message":"This model's maximum context length is 262144 tokens. However, you requested 0 output tokens and your prompt contains at least 262145 input tokens, for a total of at least 262145 tokens. Please reduce the length of the input prompt or the number of requested output tokens. (parameter=input_tokens, value=262145)","type":"BadRequestError","param":"input_tokens","code":400}}"#).unwrap();
        assert_eq!(
            (o.limit, o.requested, o.prompt_tokens),
            (Some(262144), Some(262145), Some(262145))
        );
        let o = ov(400, r#"{"error":{"message":"You passed 9000 input tokens and requested 1000 output tokens. However, the model's context length is only 8192 tokens, resulting in a maximum input length of 7192 tokens. Please reduce the length of the input prompt.","type":"BadRequestError","param":"input_tokens","code":400}}"#).unwrap();
        assert_eq!((o.limit, o.prompt_tokens), (Some(8192), Some(9000)));
        let o = ov(400, r#"{"error":{"message":"'max_tokens' or 'max_completion_tokens' is too large: 8000. This model's maximum context length is 4096 tokens and your request has 2778 input tokens (8000 > 4096 - 2778).","type":"BadRequestError","param":null,"code":400}}"#).unwrap();
        assert_eq!(o.kind, OverflowKind::OutputBudget);
        assert_eq!((o.limit, o.prompt_tokens), (Some(4096), Some(2778)));
    }

    #[test]
    fn openrouter_wordings() {
        let o = ov(400, r#"{"error":{"code":400,"message":"This endpoint's maximum context length is 32768 tokens. However, you requested about 42832 tokens (42832 of text input). Please reduce the length of either one, or use the \"middle-out\" transform to compress your prompt automatically."}}"#).unwrap();
        assert_eq!((o.limit, o.requested), (Some(32768), Some(42832)));
        // Wrapped provider error with a 502 status.
        let o = ov(502, r#"{"error":{"message":"Provider returned error: This model's maximum context length is 16000 tokens. However, you requested 17165 tokens (13069 in the messages, 4096 in the completion).","code":502,"metadata":{"provider_name":"DeepInfra","raw":{}}}}"#).unwrap();
        assert_eq!(
            (o.limit, o.requested, o.prompt_tokens),
            (Some(16000), Some(17165), Some(13069))
        );
        // Real text inside a JSON string in metadata.raw.
        let o = ov(400, r#"{"error":{"message":"Provider returned error","code":400,"metadata":{"raw":"{\"error\":{\"message\":\"This model's maximum context length is 131072 tokens. However, you requested 0 output tokens and your prompt contains at least 140000 input tokens, for a total of at least 140000 tokens.\"}}"}}}"#).unwrap();
        assert_eq!((o.limit, o.requested), (Some(131072), Some(140000)));
        // Typed error without numbers.
        let o = ov(400, r#"{"error":{"code":400,"message":"The combined input and output tokens exceed the model's context window","metadata":{"error_type":"context_length_exceeded"}}}"#).unwrap();
        assert_eq!(o.limit, None);
    }

    #[test]
    fn ollama_anthropic_tgi_and_others() {
        assert!(ov(400, r#"{"error":{"message":"the prompt is longer than the context length currently available to the model; try a shorter prompt"}}"#).is_some());
        assert!(ov(
            500,
            r#"{"error":"prompt too long; exceeded max context length by 12 tokens"}"#
        )
        .is_some());
        let o = ov(400, r#"{"type":"error","error":{"type":"invalid_request_error","message":"prompt is too long: 213462 tokens > 200000 maximum"}}"#).unwrap();
        assert_eq!((o.limit, o.requested), (Some(200000), Some(213462)));
        let o = ov(422, r#"{"error":"Input validation error: `inputs` tokens + `max_new_tokens` must be <= 4096. Given: 4000 `inputs` tokens and 500 `max_new_tokens`","error_type":"validation"}"#).unwrap();
        assert_eq!((o.limit, o.prompt_tokens), (Some(4096), Some(4000)));
        assert!(ov(400, r#"{"error":{"message":"Trying to keep the first 5000 tokens when context the overflows. However, the model is loaded with context length of 4096 which is greater than the context length"}}"#).is_some());
        assert!(ov(413, "<html>413 Request Entity Too Large</html>").is_some());
    }

    #[test]
    fn rate_limits_and_quotas_are_not_overflow() {
        for (status, body) in [
            (
                429,
                r#"{"error":{"message":"Rate limit reached for gpt-4o on tokens per min (TPM): Limit 30000, Used 29000, Requested 4000.","type":"tokens","code":"rate_limit_exceeded"}}"#,
            ),
            (
                400,
                r#"{"error":{"message":"Request too large for gpt-4 in organization org-x on tokens per min (TPM): Limit 10000, Requested 12000. The input or output tokens must be reduced in order to run successfully.","type":"tokens","code":"rate_limit_exceeded"}}"#,
            ),
            (
                429,
                r#"{"error":{"message":"You exceeded your current quota, please check your plan and billing details.","type":"insufficient_quota","code":"insufficient_quota"}}"#,
            ),
            (
                200,
                r#"{"id":"gen-abc123","error":{"code":429,"message":"Rate limit exceeded","metadata":{"error_type":"rate_limit_exceeded"}}}"#,
            ),
            (
                400,
                r#"{"error":{"message":"Quota exceeded: token limit exceeded for this month"}}"#,
            ),
            (
                402,
                r#"{"error":{"message":"Insufficient credits. This request requires more tokens than your maximum context length is 4096 tokens"}}"#,
            ),
            (401, r#"{"error":{"message":"Incorrect API key provided"}}"#),
        ] {
            assert_eq!(ov(status, body), None, "{body}");
        }
    }

    #[test]
    fn unrelated_errors_are_not_overflow() {
        for body in [
            r#"{"error":{"message":"Invalid parameter: messages with role 'tool' must be a response to a preceeding message with 'tool_calls'.","type":"invalid_request_error","param":"messages.[3].role","code":null}}"#,
            r#"{"error":{"code":503,"message":"Loading model","type":"unavailable_error"}}"#,
            r#"{"error":{"message":"The model `gpt-9` does not exist","type":"invalid_request_error","code":"model_not_found"}}"#,
            "not json at all",
            "",
        ] {
            assert_eq!(ov(400, body), None, "{body}");
        }
    }
}
