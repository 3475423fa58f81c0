//! A view of a chat-completions request body that never re-serialises what
//! it did not change.
//!
//! The top level is kept as raw JSON members (in their original order) and
//! `messages` as raw JSON values. [`ChatRequest::to_bytes`] splices only the
//! members that were replaced into the original body, so numbers such as
//! `0.70`, integers beyond `u64`, unknown fields, key order and even the
//! whitespace between members reach the upstream exactly as the client wrote
//! them.

use std::borrow::Cow;
use std::fmt;
use std::ops::Range;

use bytes::{Bytes, BytesMut};
use indexmap::IndexMap;
use serde::de::{self, Deserializer, MapAccess, Visitor};
use serde_json::value::RawValue;
use serde_json::Value;
use xxhash_rust::xxh3::Xxh3;

/// Why a body could not be viewed as a chat request. The caller forwards the
/// original bytes untouched in every case.
#[derive(Debug, thiserror::Error)]
pub enum ParseError {
    /// Not a JSON object (or not JSON at all).
    #[error("request body is not a JSON object: {0}")]
    NotObject(#[source] serde_json::Error),
    /// The same top-level key appears twice; re-emitting would lose one.
    #[error("request body has a duplicate top-level key")]
    DuplicateKey,
    /// `messages` is missing.
    #[error("request body has no `messages`")]
    MissingMessages,
    /// `messages` is not an array.
    #[error("`messages` is not an array: {0}")]
    MessagesNotArray(#[source] serde_json::Error),
}

/// One top-level member: its raw value and, when it came from the original
/// body, where that value sits in the original bytes.
#[derive(Debug)]
struct Member {
    /// The value; `None` for `messages`, which lives (parsed) in
    /// [`ChatRequest::messages`]: a second copy of the whole history per
    /// request would be pure waste.
    raw: Option<Box<RawValue>>,
    /// Byte range of the value in `original`; `None` for added members.
    span: Option<Range<usize>>,
    /// `raw` differs from the original value.
    changed: bool,
}

/// Whether a raw message is an instruction row (`role` `system` or
/// `developer`). Most messages do not contain either word and are
/// rejected by a byte search; the rest are parsed for their role.
pub(crate) fn is_instruction_message(m: &RawValue) -> bool {
    #[derive(serde::Deserialize)]
    struct RoleOnly<'a> {
        #[serde(default, borrow)]
        role: Option<Cow<'a, str>>,
    }
    let s = m.get().as_bytes();
    let maybe = memchr::memmem::find(s, b"\"system\"").is_some()
        || memchr::memmem::find(s, b"\"developer\"").is_some();
    maybe
        && serde_json::from_str::<RoleOnly<'_>>(m.get())
            .ok()
            .and_then(|r| r.role)
            .is_some_and(|r| r == "system" || r == "developer")
}

/// The top-level members in body order (keys are unique: the parse
/// refuses duplicates). A body has a handful: a scan costs less than
/// hashing the key for each lookup, and a request looks up a dozen.
#[derive(Debug)]
struct Members(Vec<(Cow<'static, str>, Member)>);

/// A member's key as the members keep it: the names requests of the three
/// APIs use are static strings, any other is copied. A key copied was an
/// allocation of each member of every request (ten for an agent's turn).
fn member_key(key: &str) -> Cow<'static, str> {
    const KNOWN: &[&str] = &[
        "model",
        "messages",
        "stream",
        "stream_options",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "temperature",
        "top_p",
        "top_k",
        "max_tokens",
        "max_completion_tokens",
        "max_output_tokens",
        "stop",
        "stop_sequences",
        "seed",
        "n",
        "user",
        "metadata",
        "store",
        "response_format",
        "reasoning_effort",
        "reasoning",
        "thinking",
        "system",
        "input",
        "instructions",
        "include",
        "text",
        "previous_response_id",
        "prompt_cache_key",
        "service_tier",
        "presence_penalty",
        "frequency_penalty",
        "logprobs",
        "top_logprobs",
        "cache_prompt",
    ];
    match KNOWN.iter().find(|k| **k == key) {
        Some(k) => Cow::Borrowed(k),
        None => Cow::Owned(key.to_owned()),
    }
}

impl Members {
    fn get(&self, key: &str) -> Option<&Member> {
        self.0.iter().find(|(k, _)| k == key).map(|(_, m)| m)
    }

    fn get_mut(&mut self, key: &str) -> Option<&mut Member> {
        self.0.iter_mut().find(|(k, _)| k == key).map(|(_, m)| m)
    }

    /// Appends `key`, which must not be present.
    fn insert(&mut self, key: &str, m: Member) {
        self.0.push((member_key(key), m));
    }

    fn iter(&self) -> impl Iterator<Item = (&str, &Member)> {
        self.0.iter().map(|(k, m)| (&**k, m))
    }

    #[cfg(test)]
    fn keys(&self) -> impl Iterator<Item = &str> {
        self.0.iter().map(|(k, _)| &**k)
    }

    fn values(&self) -> impl Iterator<Item = &Member> {
        self.0.iter().map(|(_, m)| m)
    }

    fn values_mut(&mut self) -> impl Iterator<Item = &mut Member> {
        self.0.iter_mut().map(|(_, m)| m)
    }

    fn len(&self) -> usize {
        self.0.len()
    }
}

/// A parsed chat request body (see the module docs).
#[derive(Debug)]
pub struct ChatRequest {
    original: Bytes,
    top: Members,
    messages: Vec<Box<RawValue>>,
    /// Set when `messages` was replaced through [`ChatRequest::with_messages`].
    messages_replaced: bool,
    /// The name of the list member (`messages`; `input` for Responses).
    list_key: &'static str,
}

/// One top-level value of the borrowed parse, pointing into the input.
enum TopValue<'a> {
    Raw(&'a RawValue),
    /// The elements of `messages`, read in the same pass as the top level,
    /// so a request body is scanned once, not twice.
    Messages(Vec<&'a RawValue>),
}

/// Borrowed parse of the top level, in body order.
struct BorrowedTop<'a>(Vec<(String, TopValue<'a>)>);

/// Parses a [`BorrowedTop`] whose list member is named `.0`.
struct TopSeed<'k>(&'k str);

impl<'de> de::DeserializeSeed<'de> for TopSeed<'_> {
    type Value = BorrowedTop<'de>;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        struct V<'k>(&'k str);
        impl<'de> Visitor<'de> for V<'_> {
            type Value = BorrowedTop<'de>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
                let mut out: Vec<(String, TopValue<'de>)> = Vec::new();
                while let Some(k) = map.next_key::<String>()? {
                    let v = if k == self.0 {
                        TopValue::Messages(map.next_value::<MessageList<'de>>()?.0)
                    } else {
                        TopValue::Raw(map.next_value()?)
                    };
                    if out.iter().any(|(existing, _)| *existing == k) {
                        return Err(de::Error::custom(DUPLICATE_MARK));
                    }
                    out.push((k, v));
                }
                Ok(BorrowedTop(out))
            }
        }
        d.deserialize_map(V(self.0))
    }
}

impl<'de> serde::Deserialize<'de> for BorrowedTop<'de> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        de::DeserializeSeed::deserialize(TopSeed(MESSAGES), d)
    }
}

/// The list member of a chat-completions request.
const MESSAGES: &str = "messages";

/// The `messages` array as borrowed raw elements; anything else is an error
/// marked [`NOT_ARRAY_MARK`].
struct MessageList<'a>(Vec<&'a RawValue>);

impl<'de> serde::Deserialize<'de> for MessageList<'de> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = MessageList<'de>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str(NOT_ARRAY_MARK)
            }
            fn visit_seq<A: de::SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
                let mut out = Vec::with_capacity(seq.size_hint().unwrap_or(0));
                while let Some(m) = seq.next_element::<&'de RawValue>()? {
                    out.push(m);
                }
                Ok(MessageList(out))
            }
        }
        d.deserialize_seq(V)
    }
}

const DUPLICATE_MARK: &str = "compactor: duplicate key";
const NOT_ARRAY_MARK: &str = "compactor: `messages` as an array";

/// The byte range of the `messages` array in `body`. From its elements when
/// it has any: only JSON whitespace may stand between `[` and the first
/// element, and between the last element and `]`. An empty array has no
/// element to start from and is found by a second, raw parse.
fn messages_span(body: &[u8], elements: &[&RawValue], key: &str) -> Option<Range<usize>> {
    span_around(body, elements).or_else(|| raw_list_span(body, key))
}

fn span_around(body: &[u8], elements: &[&RawValue]) -> Option<Range<usize>> {
    let is_ws = |b: &u8| matches!(b, b' ' | b'\t' | b'\n' | b'\r');
    let (first, last) = (elements.first()?, elements.last()?);
    let first = offset_in(body, first.get())?;
    let last = offset_in(body, last.get())?;
    let open = body[..first.start].iter().rposition(|b| !is_ws(b))?;
    let close = last.end + body[last.end..].iter().position(|b| !is_ws(b))?;
    (body[open] == b'[' && body[close] == b']').then_some(open..close + 1)
}

#[cfg(test)]
fn raw_messages_span(body: &[u8]) -> Option<Range<usize>> {
    raw_list_span(body, MESSAGES)
}

#[cold]
fn raw_list_span(body: &[u8], key: &str) -> Option<Range<usize>> {
    // Owned keys: a key written with escapes (`"m\u0065ssages"`) cannot be
    // borrowed, and the main parse matched it after unescaping.
    let top: IndexMap<String, &RawValue> = serde_json::from_slice(body).ok()?;
    offset_in(body, top.get(key)?.get())
}

/// Offset of `inner` inside `outer`, when `inner` is a sub-slice of it.
fn offset_in(outer: &[u8], inner: &str) -> Option<Range<usize>> {
    let start = (inner.as_ptr() as usize).checked_sub(outer.as_ptr() as usize)?;
    let end = start.checked_add(inner.len())?;
    (end <= outer.len()).then_some(start..end)
}

impl ChatRequest {
    /// A request of nothing, made without an allocation: what stands in
    /// for a request moved elsewhere to be freed.
    pub(crate) fn empty() -> Self {
        Self {
            original: Bytes::new(),
            top: Members(Vec::new()),
            messages: Vec::new(),
            messages_replaced: false,
            list_key: "messages",
        }
    }

    /// Parses `bytes` (the whole request body) in one pass. Cheap: only the
    /// top level and the boundaries of each message are parsed.
    pub fn parse(bytes: impl Into<Bytes>) -> Result<Self, ParseError> {
        Self::parse_list(bytes, MESSAGES)
    }

    /// [`Self::parse`] for a body whose message list is the member
    /// `list_key` (the same view serves other APIs' item lists).
    pub(crate) fn parse_list(
        bytes: impl Into<Bytes>,
        list_key: &'static str,
    ) -> Result<Self, ParseError> {
        let original: Bytes = bytes.into();
        // The skim reads what serde_json reads, several times faster; what
        // it leaves to serde_json (errors among it) takes the path below.
        if let Some(parsed) = Self::skimmed(&original, list_key) {
            return Ok(parsed);
        }
        let borrowed = {
            let mut de = serde_json::Deserializer::from_slice(&original);
            de::DeserializeSeed::deserialize(TopSeed(list_key), &mut de).and_then(|t| {
                de.end()?;
                Ok(t)
            })
        };
        let borrowed: BorrowedTop<'_> = borrowed.map_err(|e| {
            let text = e.to_string();
            if text.contains(DUPLICATE_MARK) {
                ParseError::DuplicateKey
            } else if text.contains(NOT_ARRAY_MARK) {
                ParseError::MessagesNotArray(e)
            } else {
                ParseError::NotObject(e)
            }
        })?;
        let mut top = Members(Vec::with_capacity(borrowed.0.len()));
        let mut messages = None;
        for (k, v) in borrowed.0 {
            let (raw, span) = match v {
                TopValue::Raw(v) => (Some(v.to_owned()), offset_in(&original, v.get())),
                TopValue::Messages(list) => {
                    let span = messages_span(&original, &list, list_key);
                    messages = Some(list.into_iter().map(ToOwned::to_owned).collect());
                    (None, span)
                }
            };
            top.insert(
                &k,
                Member {
                    raw,
                    span,
                    changed: false,
                },
            );
        }
        let messages = messages.ok_or(ParseError::MissingMessages)?;
        Ok(Self {
            original,
            top,
            messages,
            messages_replaced: false,
            list_key,
        })
    }

    /// [`Self::parse_list`] by [`crate::skim`]: `None` leaves the body to
    /// serde_json.
    fn skimmed(original: &Bytes, list_key: &'static str) -> Option<Self> {
        let text = std::str::from_utf8(original).ok()?;
        // Room for a usual body's top level (a chat request's or an agent's
        // ten or so members) without regrowing.
        let mut top = Members(Vec::with_capacity(12));
        let elements = crate::skim::each_member(text, Some(list_key), |k, span| {
            // A repeated key is serde_json's to refuse.
            if top.get(k).is_some() {
                return None;
            }
            let raw = if k == list_key {
                None
            } else {
                Some(crate::skim::raw_boxed(text.get(span.clone())?)?)
            };
            let member = Member {
                raw,
                span: Some(span),
                changed: false,
            };
            top.insert(k, member);
            Some(())
        })?;
        let messages = elements?
            .into_iter()
            .map(|r| crate::skim::raw_boxed(text.get(r)?))
            .collect::<Option<Vec<_>>>()?;
        Some(Self {
            original: original.clone(),
            top,
            messages,
            messages_replaced: false,
            list_key,
        })
    }

    /// Raw top-level member, if present.
    pub(crate) fn get_raw(&self, key: &str) -> Option<&RawValue> {
        self.top.get(key).and_then(|m| m.raw.as_deref())
    }

    /// The messages (replaced ones after [`Self::with_messages`]).
    pub fn messages(&self) -> &[Box<RawValue>] {
        &self.messages
    }

    /// Borrowed from the body unless an escape had to be decoded.
    fn get_str(&self, key: &str) -> Option<Cow<'_, str>> {
        let raw = self.get_raw(key)?.get();
        // A raw value is valid JSON: quoted without a backslash, it is the
        // text between its quotes.
        if let Some(text) = raw.strip_prefix('"').and_then(|r| r.strip_suffix('"')) {
            if !text.contains('\\') {
                return Some(Cow::Borrowed(text));
            }
        }
        serde_json::from_str::<String>(raw).ok().map(Cow::Owned)
    }

    /// `model`, when it is a string.
    pub(crate) fn model(&self) -> Option<Cow<'_, str>> {
        self.get_str("model")
    }

    /// `stream == true`.
    pub fn stream(&self) -> bool {
        self.get_raw("stream").map(|r| r.get().trim()) == Some("true")
    }

    /// The output reservation: `max_completion_tokens`, else `max_tokens`
    /// (OpenAI deprecated the latter; llama.cpp reads both in that order).
    pub(crate) fn max_output_tokens(&self) -> Option<u64> {
        ["max_completion_tokens", "max_tokens"]
            .iter()
            .find_map(|k| {
                self.get_raw(k)
                    .and_then(|r| serde_json::from_str::<u64>(r.get()).ok())
            })
    }

    /// Body `session_id` (OpenRouter convention), when a non-empty string.
    pub(crate) fn session_id(&self) -> Option<String> {
        self.get_str("session_id")
            .filter(|s| !s.is_empty())
            .map(Cow::into_owned)
    }

    /// Body `prompt_cache_key` (OpenAI convention), when a non-empty string.
    pub(crate) fn prompt_cache_key(&self) -> Option<String> {
        self.get_str("prompt_cache_key")
            .filter(|s| !s.is_empty())
            .map(Cow::into_owned)
    }

    /// Whether the client itself asked for usage in the stream
    /// (`stream_options.include_usage == true`).
    pub fn client_wants_usage(&self) -> bool {
        #[derive(serde::Deserialize)]
        struct Opts {
            include_usage: Option<Value>,
        }
        self.get_raw("stream_options")
            .and_then(|r| serde_json::from_str::<Option<Opts>>(r.get()).ok())
            .flatten()
            .and_then(|o| o.include_usage)
            == Some(Value::Bool(true))
    }

    /// Moves the messages out, leaving none. The body is not considered
    /// changed: put them (or others) back with [`Self::with_messages`] to
    /// send something else.
    pub(crate) fn take_messages(&mut self) -> Vec<Box<RawValue>> {
        std::mem::take(&mut self.messages)
    }

    /// Replaces `messages`; the member keeps its position in the body.
    pub fn with_messages(&mut self, messages: Vec<Box<RawValue>>) {
        self.messages = messages;
        self.messages_replaced = true;
    }

    /// Sets `stream_options.include_usage = true` for streaming requests whose
    /// client did not ask for it, keeping every other `stream_options` key.
    /// Never touches a non-streaming request (OpenAI and vLLM reject
    /// `stream_options` without `stream`). Returns whether the body changed.
    pub fn force_include_usage(&mut self) -> bool {
        if !self.stream() || self.client_wants_usage() {
            return false;
        }
        let merged = match self
            .get_raw("stream_options")
            .map(|r| serde_json::from_str::<IndexMap<String, Box<RawValue>>>(r.get()))
        {
            Some(Ok(mut opts)) => {
                if let Some(v) = opts.get_mut("include_usage") {
                    *v = raw_true();
                } else {
                    opts.insert("include_usage".to_owned(), raw_true());
                }
                serde_json::to_string(&opts).ok()
            }
            // Absent, `null` or not an object: the client's value carries no
            // options to keep.
            _ => None,
        };
        let text = merged.unwrap_or_else(|| r#"{"include_usage":true}"#.to_owned());
        let raw = match RawValue::from_string(text) {
            Ok(r) => r,
            Err(_) => return false,
        };
        self.set_member("stream_options", raw);
        true
    }

    /// Replaces the top-level member `key` in place (or appends it when the
    /// body has none). Not for the list member: see [`Self::with_messages`].
    pub(crate) fn set_member(&mut self, key: &str, raw: Box<RawValue>) {
        match self.top.get_mut(key) {
            Some(m) => {
                m.raw = Some(raw);
                m.changed = true;
            }
            None => {
                let added = Member {
                    raw: Some(raw),
                    span: None,
                    changed: true,
                };
                self.top.insert(key, added);
            }
        }
    }

    /// Undoes [`Self::with_messages`], [`Self::set_member`] and
    /// [`Self::force_include_usage`]: the body is the client's again (the
    /// messages stay taken). Lets one parse serve a second preparation (the
    /// retry after an overflow error) as if it were fresh.
    pub(crate) fn rewind(&mut self) {
        if !self.is_modified() {
            return;
        }
        self.messages = Vec::new();
        self.messages_replaced = false;
        // Added members go; replaced ones get their original bytes back.
        self.top.0.retain(|(_, m)| m.span.is_some());
        for m in self.top.values_mut().filter(|m| m.changed) {
            m.raw = m
                .span
                .clone()
                .and_then(|s| std::str::from_utf8(&self.original[s]).ok())
                .and_then(|s| RawValue::from_string(s.to_owned()).ok());
            m.changed = false;
        }
    }

    /// Whether [`Self::to_bytes`] would differ from the original body.
    pub fn is_modified(&self) -> bool {
        self.messages_replaced || self.top.values().any(|m| m.changed)
    }

    /// The body to send upstream. Unchanged requests give back the original
    /// bytes; otherwise only replaced members are rewritten in place and
    /// added members are appended before the closing brace.
    pub fn to_bytes(&self) -> Bytes {
        if !self.is_modified() {
            return self.original.clone();
        }
        let src = &self.original[..];
        let mut out = BytesMut::with_capacity(src.len() + 64);
        let mut cursor = 0usize;
        let mut appended: Vec<(&str, &RawValue)> = Vec::new();
        // Members that came from the body are in body order, so their spans
        // increase monotonically; splice replacements in order.
        for (k, m) in self.top.iter() {
            let replaced_messages = k == self.list_key && self.messages_replaced;
            let Some(orig) = m.span.clone() else {
                if let Some(raw) = m.raw.as_deref() {
                    appended.push((k, raw));
                }
                continue;
            };
            if !m.changed && !replaced_messages {
                continue;
            }
            out.extend_from_slice(&src[cursor..orig.start]);
            match (replaced_messages, m.raw.as_deref()) {
                (true, _) => write_array(&mut out, &self.messages),
                (false, Some(raw)) => out.extend_from_slice(raw.get().as_bytes()),
                (false, None) => out.extend_from_slice(&src[orig.clone()]),
            }
            cursor = orig.end;
        }
        if appended.is_empty() {
            out.extend_from_slice(&src[cursor..]);
            return out.freeze();
        }
        // Insert the new members just before the final `}`.
        let close = src.iter().rposition(|&b| b == b'}').unwrap_or(src.len());
        let close = close.max(cursor);
        out.extend_from_slice(&src[cursor..close]);
        let empty_object = self.top.len() == appended.len();
        for (i, (k, v)) in appended.iter().enumerate() {
            if i > 0 || !empty_object {
                out.extend_from_slice(b",");
            }
            write_key(&mut out, k);
            out.extend_from_slice(v.get().as_bytes());
        }
        out.extend_from_slice(&src[close..]);
        out.freeze()
    }
}

fn raw_true() -> Box<RawValue> {
    // `true` is always valid JSON; the fallback keeps this infallible.
    RawValue::from_string("true".to_owned()).unwrap_or_else(|_| Box::<RawValue>::default())
}

fn write_key(out: &mut BytesMut, key: &str) {
    let quoted = serde_json::to_string(key).unwrap_or_else(|_| format!("\"{key}\""));
    out.extend_from_slice(quoted.as_bytes());
    out.extend_from_slice(b":");
}

fn write_array(out: &mut BytesMut, items: &[Box<RawValue>]) {
    out.extend_from_slice(b"[");
    for (i, m) in items.iter().enumerate() {
        if i > 0 {
            out.extend_from_slice(b",");
        }
        out.extend_from_slice(m.get().as_bytes());
    }
    out.extend_from_slice(b"]");
}

/// Writes `v` as canonical JSON: object keys sorted, no whitespace, numbers
/// and strings as serde_json prints them. Independent of serde_json's
/// `preserve_order` feature so hashes never depend on the dependency graph.
pub(crate) fn write_canonical(v: &Value, out: &mut Vec<u8>) {
    match v {
        Value::Object(map) => {
            let mut keys: Vec<&String> = map.keys().collect();
            keys.sort_unstable();
            out.push(b'{');
            for (i, k) in keys.into_iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                let _ = serde_json::to_writer(&mut *out, k);
                out.push(b':');
                if let Some(child) = map.get(k) {
                    write_canonical(child, out);
                }
            }
            out.push(b'}');
        }
        Value::Array(items) => {
            out.push(b'[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                write_canonical(item, out);
            }
            out.push(b']');
        }
        scalar => {
            let _ = serde_json::to_writer(&mut *out, scalar);
        }
    }
}

/// Hash of one message's canonical JSON (not chained). Messages that are not
/// valid JSON (impossible after [`ChatRequest::parse`]) hash their raw text.
pub(crate) fn message_hash(msg: &RawValue) -> u128 {
    let mut buf = Vec::with_capacity(msg.get().len());
    canonical_bytes(msg, &mut buf);
    xxhash_rust::xxh3::xxh3_128(&buf)
}

fn canonical_bytes(msg: &RawValue, buf: &mut Vec<u8>) {
    buf.clear();
    match serde_json::from_str::<Value>(msg.get()) {
        Ok(v) => write_canonical(&v, buf),
        Err(_) => buf.extend_from_slice(msg.get().as_bytes()),
    }
}

/// Chained hashes: element `i` identifies messages `0..=i` (over canonical
/// JSON, so whitespace and key order differences between clients do not
/// matter). Two histories share a prefix of length `n` exactly when their
/// element `n - 1` is equal (up to hash collisions).
pub fn message_hashes(messages: &[Box<RawValue>]) -> Vec<u128> {
    let mut out = Vec::with_capacity(messages.len());
    extend_message_hashes(&mut out, messages);
    out
}

/// Appends the chain for `more` to `chain` (which must be the chain of the
/// messages that precede `more`), so a caller that already hashed a prefix
/// only pays for the new messages.
pub fn extend_message_hashes(chain: &mut Vec<u128>, more: &[Box<RawValue>]) {
    extend_hashes(chain, more, false);
}

/// [`extend_message_hashes`]; `canonical` says that every message of
/// `more` is canonical JSON already ([`write_canonical`]'s form), so its
/// bytes are hashed as they are, without a parse.
fn extend_hashes(chain: &mut Vec<u128>, more: &[Box<RawValue>], canonical: bool) {
    let mut prev: u128 = chain.last().copied().unwrap_or(0);
    let mut buf = Vec::new();
    let mut hasher = Xxh3::new();
    for m in more {
        let bytes = if canonical {
            m.get().as_bytes()
        } else {
            canonical_bytes(m, &mut buf);
            &buf
        };
        hasher.reset();
        hasher.update(&prev.to_le_bytes());
        hasher.update(&(bytes.len() as u64).to_le_bytes());
        hasher.update(bytes);
        prev = hasher.digest128();
        chain.push(prev);
    }
}

/// A fast hash of a message's raw bytes (not canonical): what
/// [`ChainCache`] matches resent messages by, and the session key's memo of
/// a conversation's opening; made once per request for both.
pub fn raw_hash(m: &RawValue) -> u64 {
    xxhash_rust::xxh3::xxh3_64(m.get().as_bytes())
}

/// Per-session memo of the last chain, keyed by a fast hash of each
/// message's raw bytes: a client that resends its history byte for byte
/// (the usual case) only pays the canonical hashing for new messages.
#[derive(Debug, Default)]
pub struct ChainCache {
    raw: Vec<u64>,
    chain: Vec<u128>,
}

// By hand for `clone_from`: every turn copies the client's chain over the
// sent one, which then reuses its buffers instead of allocating two.
impl Clone for ChainCache {
    fn clone(&self) -> Self {
        Self {
            raw: self.raw.clone(),
            chain: self.chain.clone(),
        }
    }

    fn clone_from(&mut self, source: &Self) {
        self.raw.clone_from(&source.raw);
        self.chain.clone_from(&source.chain);
    }
}

impl ChainCache {
    /// An empty cache.
    pub fn new() -> Self {
        Self::default()
    }

    /// The chain of `messages` (equal to [`message_hashes`]), reusing the
    /// prefix that is byte-identical to the previous call.
    pub fn chain(&mut self, messages: &[Box<RawValue>]) -> &[u128] {
        self.chain_as(messages, false)
    }

    /// [`Self::chain`]; `canonical` says the messages are canonical JSON
    /// (a codec's decoding), hashed as they are.
    pub(crate) fn chain_as(&mut self, messages: &[Box<RawValue>], canonical: bool) -> &[u128] {
        let raw: Vec<u64> = messages.iter().map(|m| raw_hash(m)).collect();
        self.chain_hashed(messages, &raw, canonical)
    }

    /// [`Self::chain_as`] with each message's [`raw_hash`] already made
    /// (`raw[i]` of `messages[i]`).
    pub(crate) fn chain_hashed(
        &mut self,
        messages: &[Box<RawValue>],
        raw: &[u64],
        canonical: bool,
    ) -> &[u128] {
        if raw.len() != messages.len() {
            return self.chain_as(messages, canonical);
        }
        let same = raw
            .iter()
            .zip(&self.raw)
            .take_while(|(a, b)| a == b)
            .count();
        self.chain.truncate(same);
        extend_hashes(&mut self.chain, &messages[same..], canonical);
        // The buffer kept, not reallocated, turn after turn.
        self.raw.clear();
        self.raw.extend_from_slice(raw);
        &self.chain
    }
}

/// Length of the longest common prefix of two chains.
pub fn common_prefix_len(a: &[u128], b: &[u128]) -> usize {
    let n = a.len().min(b.len());
    // Chained hashes make equality monotone (equal at i ⇒ equal before i),
    // so a binary search finds the boundary in O(log n).
    let (mut lo, mut hi) = (0usize, n);
    while lo < hi {
        let mid = lo + (hi - lo) / 2;
        if a[mid] == b[mid] {
            lo = mid + 1;
        } else {
            hi = mid;
        }
    }
    lo
}

#[cfg(test)]
mod tests;
