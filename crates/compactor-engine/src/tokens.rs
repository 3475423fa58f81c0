//! Rough token estimation.
//!
//! One estimator serves the trigger (whole-request estimate) and the
//! tail/prune walks (per-message estimate): both are built on the same text
//! counter, so the two never disagree about which size class a conversation
//! is in (mismatched estimators make compaction
//! re-fire forever).
//!
//! The walks never re-serialise a message: they visit the `Value` tree and
//! count the bytes its compact JSON would occupy (minus string escapes, which
//! cost the model nothing), so estimating a 1,000-message conversation
//! allocates nothing.

use serde_json::Value;

/// Characters per token of the rough estimator.
pub(crate) const CHARS_PER_TOKEN: u64 = 4;

/// Fixed per-message overhead charged by [`estimate_msg_budget_tokens`].
pub(crate) const MESSAGE_OVERHEAD_TOKENS: u64 = 10;

/// Default of the `charge_stale_thinking` switch (the config's default): charge
/// thinking on every assistant row, the conservative choice for routes that
/// may replay old thinking.
pub(crate) const DEFAULT_CHARGE_STALE_THINKING: bool = true;

/// Flat token price of one image when no learned price is available.
pub(crate) const IMAGE_TOKEN_PRICE: u64 = 1_600;

/// Replay fields that providers receive on every retained turn, so they are
/// charged on every message. Encrypted payloads inside them
/// are blanked first: opaque ciphertext is priced only by real usage.
pub(crate) const ALWAYS_REPLAYED_BUDGET_KEYS: &[&str] =
    &["codex_reasoning_items", "codex_message_items"];

/// Thinking fields that reach the wire for at most the newest assistant turn;
/// older copies are charged only when `charge_thinking` is set.
// Only the ported tests use it: they pin the partition the estimator charges by.
#[cfg(test)]
pub(crate) const NEWEST_TURN_ONLY_BUDGET_KEYS: &[&str] =
    &["reasoning", "reasoning_content", "reasoning_details"];

/// Every replay field the per-message budget knows about. Invariant (pinned by
/// a test): exactly the disjoint union of [`ALWAYS_REPLAYED_BUDGET_KEYS`] and
/// [`NEWEST_TURN_ONLY_BUDGET_KEYS`].
// Only the ported tests use it: they pin the partition the estimator charges by.
#[cfg(test)]
pub(crate) const REPLAY_BUDGET_KEYS: &[&str] = &[
    "reasoning",
    "reasoning_content",
    "reasoning_details",
    "codex_reasoning_items",
    "codex_message_items",
];

/// Keys that never reach the provider and are dropped from the wire shadow.
const NON_WIRE_KEYS: &[&str] = &["api_content", "reasoning_details"];

/// Content-part types that are images.
const IMAGE_PART_TYPES: &[&str] = &["image_url", "input_image", "image"];

/// Accumulates text the way [`estimate_text_tokens`] prices it: CJK-class
/// codepoints cost one token each, every other byte a quarter token.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Counter {
    bytes: u64,
    cjk: u64,
}

impl Counter {
    fn add_str(&mut self, s: &str) {
        let b = s.as_bytes();
        self.bytes += b.len() as u64;
        if s.is_ascii() {
            return;
        }
        // Every CJK-class codepoint is at or above U+1100, i.e. a 3- or
        // 4-byte sequence, so only lead bytes >= 0xE0 need decoding; the
        // rest of the text is already counted by its bytes.
        let byte = |i: usize| u32::from(b.get(i).copied().unwrap_or(0) & 0x3F);
        let mut i = 0;
        while i < b.len() {
            let lead = b[i];
            if lead < 0xE0 {
                i += 1;
                continue;
            }
            let (cp, width) = if lead < 0xF0 {
                (
                    (u32::from(lead & 0x0F) << 12) | (byte(i + 1) << 6) | byte(i + 2),
                    3,
                )
            } else {
                (
                    (u32::from(lead & 0x07) << 18)
                        | (byte(i + 1) << 12)
                        | (byte(i + 2) << 6)
                        | byte(i + 3),
                    4,
                )
            };
            if is_cjk(cp) {
                self.cjk += 1;
                self.bytes -= width as u64;
            }
            i += width;
        }
    }

    fn add_bytes(&mut self, n: u64) {
        self.bytes += n;
    }

    fn tokens(self) -> u64 {
        self.cjk + self.bytes.div_ceil(CHARS_PER_TOKEN)
    }

    /// Adds the compact-JSON footprint of `v` (quotes, separators and keys
    /// included, escapes not).
    fn add_json(&mut self, v: &Value) {
        match v {
            Value::Null => self.add_bytes(4),
            Value::Bool(b) => self.add_bytes(if *b { 4 } else { 5 }),
            Value::Number(n) => self.add_bytes(number_len(n)),
            Value::String(s) => {
                self.add_bytes(2);
                self.add_str(s);
            }
            Value::Array(a) => {
                self.add_bytes(2 + a.len().saturating_sub(1) as u64);
                for x in a {
                    self.add_json(x);
                }
            }
            Value::Object(o) => {
                self.add_bytes(2 + o.len().saturating_sub(1) as u64);
                for (k, x) in o {
                    self.add_bytes(3);
                    self.add_str(k);
                    self.add_json(x);
                }
            }
        }
    }

    /// Like [`Counter::add_json`], but every `encrypted_content` string is
    /// counted as empty.
    fn add_json_blank_encrypted(&mut self, v: &Value) {
        match v {
            Value::Array(a) => {
                self.add_bytes(2 + a.len().saturating_sub(1) as u64);
                for x in a {
                    self.add_json_blank_encrypted(x);
                }
            }
            Value::Object(o) => {
                self.add_bytes(2 + o.len().saturating_sub(1) as u64);
                for (k, x) in o {
                    self.add_bytes(3);
                    self.add_str(k);
                    if k == "encrypted_content" && x.is_string() {
                        self.add_bytes(2);
                    } else {
                        self.add_json_blank_encrypted(x);
                    }
                }
            }
            other => self.add_json(other),
        }
    }
}

fn number_len(n: &serde_json::Number) -> u64 {
    if let Some(u) = n.as_u64() {
        digits(u)
    } else if let Some(i) = n.as_i64() {
        1 + digits(i.unsigned_abs())
    } else {
        // Floats are rare in messages; an approximate width is enough.
        8
    }
}

fn digits(mut u: u64) -> u64 {
    let mut d = 1;
    while u >= 10 {
        u /= 10;
        d += 1;
    }
    d
}

/// True for codepoints that tokenisers typically encode as one token each:
/// CJK ideographs, Hangul, Kana and full-width forms.
fn is_cjk(c: u32) -> bool {
    matches!(c,
        0x1100..=0x11FF        // Hangul Jamo
        | 0x2E80..=0x2FDF      // CJK radicals, Kangxi
        | 0x3000..=0x303F      // CJK symbols and punctuation
        | 0x3040..=0x30FF      // Hiragana, Katakana
        | 0x3100..=0x318F      // Bopomofo, Hangul compatibility Jamo
        | 0x31A0..=0x31FF      // Bopomofo ext, Katakana ext
        | 0x3200..=0x4DBF      // enclosed CJK, CJK ext A
        | 0x4E00..=0x9FFF      // CJK unified ideographs
        | 0xA960..=0xA97F      // Hangul Jamo ext A
        | 0xAC00..=0xD7FF      // Hangul syllables + Jamo ext B
        | 0xF900..=0xFAFF      // CJK compatibility ideographs
        | 0xFE30..=0xFE4F      // CJK compatibility forms
        | 0xFF00..=0xFFEF      // half/full-width forms
        | 0x20000..=0x3FFFF // CJK ext B..
    )
}

/// Rough token count of a text: empty → 0; ASCII →
/// `ceil(len / 4)`; otherwise one token per CJK-class codepoint plus
/// `ceil(utf8 bytes of the rest / 4)`.
pub fn estimate_text_tokens(text: &str) -> u64 {
    let mut c = Counter::default();
    c.add_str(text);
    c.tokens()
}

fn role(msg: &Value) -> &str {
    msg.get("role").and_then(Value::as_str).unwrap_or("")
}

/// The string `api_content` sidecar that replaces `content` on the wire: only
/// on user/assistant rows, only when it is a non-empty string (any other shape
/// would under-count if substituted, so it is ignored).
pub(crate) fn wire_sidecar(msg: &Value) -> Option<&str> {
    match role(msg) {
        "user" | "assistant" => match msg.get("api_content") {
            Some(Value::String(s)) if !s.is_empty() => Some(s.as_str()),
            _ => None,
        },
        _ => None,
    }
}

/// The content the provider receives for `msg`: the string sidecar when it
/// applies (see [`wire_sidecar`]), otherwise `content`.
pub(crate) fn wire_content(msg: &Value) -> Option<&Value> {
    if wire_sidecar(msg).is_some() {
        msg.get("api_content")
    } else {
        msg.get("content")
    }
}

fn is_image_part(part: &Value) -> bool {
    part.get("type")
        .and_then(Value::as_str)
        .is_some_and(|t| IMAGE_PART_TYPES.contains(&t))
}

fn non_empty_str(v: Option<&Value>) -> bool {
    matches!(v, Some(Value::String(s)) if !s.is_empty())
}

fn is_present(v: Option<&Value>) -> bool {
    match v {
        None | Some(Value::Null) => false,
        Some(Value::String(s)) => !s.is_empty(),
        Some(Value::Array(a)) => !a.is_empty(),
        Some(Value::Object(o)) => !o.is_empty(),
        Some(_) => true,
    }
}

/// Counts the thinking/text/summary strings of a `reasoning_details` array,
/// never the signed envelope.
fn add_reasoning_details_text(c: &mut Counter, v: &Value) {
    match v {
        Value::Array(a) => a.iter().for_each(|x| add_reasoning_details_text(c, x)),
        Value::Object(o) => {
            for key in ["thinking", "text", "summary"] {
                match o.get(key) {
                    Some(Value::String(s)) => c.add_str(s),
                    Some(nested @ (Value::Array(_) | Value::Object(_))) => {
                        add_reasoning_details_text(c, nested)
                    }
                    _ => {}
                }
            }
        }
        _ => {}
    }
}

fn add_text_or_json(c: &mut Counter, v: &Value) {
    match v {
        Value::String(s) => c.add_str(s),
        Value::Null => {}
        other => c.add_json(other),
    }
}

/// Per-message budget estimate used by the tail and prune walks: wire content (string sidecar on user/assistant rows) as text, list
/// content by characters with images at `IMAGE_TOKEN_PRICE × 4` characters
/// (other non-text parts by their JSON size),
/// `+10` overhead, each tool call as its whole compact-JSON envelope, Codex
/// replay items always (ciphertext blanked), and the thinking fields only when
/// `charge_thinking` (the newest assistant turn, or a route that replays old
/// thinking). `reasoning` is skipped when `reasoning_content` is non-empty, and
/// `reasoning_details` text counts only when neither is present.
pub fn estimate_msg_budget_tokens(msg: &Value, charge_thinking: bool) -> u64 {
    let mut tokens = MESSAGE_OVERHEAD_TOKENS;
    match wire_content(msg) {
        Some(Value::String(s)) => tokens += estimate_text_tokens(s),
        Some(Value::Array(parts)) => {
            let mut c = Counter::default();
            for part in parts {
                if is_image_part(part) {
                    c.add_bytes(IMAGE_TOKEN_PRICE * CHARS_PER_TOKEN);
                } else if let Some(t) = part.get("text").and_then(Value::as_str) {
                    c.add_str(t);
                } else if let Value::String(s) = part {
                    c.add_str(s);
                } else {
                    // Audio, files and unknown parts: their JSON size is a
                    // conservative stand-in (never zero).
                    c.add_json(part);
                }
            }
            tokens += c.tokens();
        }
        Some(Value::Null) | None => {}
        Some(other) => {
            let mut c = Counter::default();
            c.add_json(other);
            tokens += c.tokens();
        }
    }
    if let Some(Value::Array(calls)) = msg.get("tool_calls") {
        for call in calls {
            let mut c = Counter::default();
            c.add_json(call);
            tokens += c.tokens();
        }
    }
    for key in ALWAYS_REPLAYED_BUDGET_KEYS {
        if let Some(v) = msg.get(*key) {
            if is_present(Some(v)) {
                let mut c = Counter::default();
                c.add_json_blank_encrypted(v);
                tokens += c.tokens();
            }
        }
    }
    if charge_thinking {
        tokens += thinking_tokens(msg);
    }
    tokens
}

/// Tokens of the newest-turn-only thinking fields of `msg`.
fn thinking_tokens(msg: &Value) -> u64 {
    let mut c = Counter::default();
    let rc = msg.get("reasoning_content");
    let r = msg.get("reasoning");
    match (is_present(rc), rc, r) {
        // The same text often rides in both fields; charge it once.
        (true, Some(v), _) => add_text_or_json(&mut c, v),
        (_, _, Some(v)) if is_present(Some(v)) => add_text_or_json(&mut c, v),
        _ => {
            if let Some(d) = msg.get("reasoning_details") {
                add_reasoning_details_text(&mut c, d);
            }
        }
    }
    c.tokens()
}

/// Index of the newest assistant row, the only one whose thinking reaches the
/// wire on routes that do not replay old thinking.
pub(crate) fn newest_assistant_index(messages: &[Value]) -> Option<usize> {
    messages.iter().rposition(|m| role(m) == "assistant")
}

/// Estimate of the wire shadow of one message, as a
/// character/CJK counter plus the number of images found.
fn wire_shadow_counter(msg: &Value, keep_thinking: bool) -> (Counter, u64) {
    let mut c = Counter::default();
    let mut images = 0u64;
    let Some(obj) = msg.as_object() else {
        c.add_json(msg);
        return (c, 0);
    };
    let has_rc = non_empty_str(obj.get("reasoning_content"));
    let sidecar = wire_sidecar(msg);
    let mut fields = 0u64;
    for (k, v) in obj {
        if k.starts_with('_') || NON_WIRE_KEYS.contains(&k.as_str()) {
            continue;
        }
        if (k == "reasoning" && has_rc)
            || (!keep_thinking && (k == "reasoning" || k == "reasoning_content"))
        {
            continue;
        }
        fields += 1;
        c.add_bytes(3);
        c.add_str(k);
        match k.as_str() {
            "content" => match (sidecar, v) {
                (Some(s), _) => {
                    c.add_bytes(2);
                    c.add_str(s);
                }
                (None, Value::Array(parts)) => {
                    c.add_bytes(2 + parts.len().saturating_sub(1) as u64);
                    for part in parts {
                        if is_image_part(part) {
                            images += 1;
                            // A tiny placeholder stands in for the payload.
                            c.add_bytes(16);
                        } else if let Some(summary) = part
                            .get("_multimodal")
                            .and_then(|_| part.get("text_summary"))
                            .and_then(Value::as_str)
                        {
                            c.add_str(summary);
                        } else {
                            c.add_json(part);
                        }
                    }
                }
                (None, Value::Object(o)) if o.contains_key("_multimodal") => {
                    if let Some(s) = o.get("text_summary").and_then(Value::as_str) {
                        c.add_str(s);
                    }
                }
                (None, other) => c.add_json(other),
            },
            "codex_reasoning_items" | "codex_message_items" => c.add_json_blank_encrypted(v),
            _ => c.add_json(v),
        }
    }
    c.add_bytes(2 + fields.saturating_sub(1));
    (c, images)
}

/// Whole-conversation estimate used by the trigger and preflight, charging
/// thinking on every assistant row (the conservative default).
pub fn estimate_messages_tokens_rough(messages: &[Value]) -> u64 {
    estimate_messages_tokens_rough_with(messages, true)
}

/// Wire-shadow estimate: per message, the compact JSON of what the provider
/// receives (string sidecar substituted on user/assistant rows, private `_`
/// keys and `reasoning_details` dropped, `reasoning` dropped when
/// `reasoning_content` is non-empty, images as a small placeholder plus
/// [`IMAGE_TOKEN_PRICE`] each, Codex ciphertext blanked). With
/// `charge_stale_thinking == false` thinking is kept only on the newest
/// assistant row, so the trigger stays in the tail walk's size class.
///
/// Agent runtimes price `str(dict)`, Python's repr; the compact JSON of the
/// same shadow plays that role here (keys, quotes and braces are the
/// per-message overhead).
pub(crate) fn estimate_messages_tokens_rough_with(
    messages: &[Value],
    charge_stale_thinking: bool,
) -> u64 {
    let newest = if charge_stale_thinking {
        None
    } else {
        newest_assistant_index(messages)
    };
    let mut total = Counter::default();
    let mut images = 0u64;
    for (i, msg) in messages.iter().enumerate() {
        let keep = charge_stale_thinking || newest == Some(i);
        let (c, n) = wire_shadow_counter(msg, keep);
        total.bytes += c.bytes;
        total.cjk += c.cjk;
        images += n;
    }
    total.tokens() + images * IMAGE_TOKEN_PRICE
}

/// Estimate of the whole request: messages (system prompt included, as on the
/// OpenAI wire) plus tool schemas: per tool `name + description + compact
/// JSON of parameters` characters, `ceil(/4)` over the sum (50+ tools add
/// 20–30 K tokens).
pub fn estimate_request_tokens_rough(messages: &[Value], tools: Option<&Value>) -> u64 {
    estimate_messages_tokens_rough(messages) + estimate_tools_tokens(tools)
}

/// Token estimate of a `tools` array (see [`estimate_request_tokens_rough`]).
pub fn estimate_tools_tokens(tools: Option<&Value>) -> u64 {
    let Some(Value::Array(tools)) = tools else {
        return 0;
    };
    let mut c = Counter::default();
    for tool in tools {
        let f = tool.get("function").unwrap_or(tool);
        if let Some(n) = f.get("name").and_then(Value::as_str) {
            c.add_str(n);
        }
        if let Some(d) = f.get("description").and_then(Value::as_str) {
            c.add_str(d);
        }
        if let Some(p) = f.get("parameters") {
            c.add_json(p);
        }
    }
    c.tokens()
}

#[cfg(test)]
mod tests;
