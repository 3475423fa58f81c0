//! Reading the real token usage from upstream responses without buffering
//! them, and hiding the usage chunk compactor asked for on the client's
//! behalf.
//!
//! - [`sse`]: incremental SSE scanner.
//! - [`UsageExtractor`] / [`UsageObserver`]: the last `usage` (and
//!   llama.cpp `timings`) of an SSE stream or a JSON body, plus an error
//!   that arrived before the first content delta. The observer rides on the
//!   one body tap, [`crate::upstream::body::TapBody`].
//! - [`hide`]: removes the forced `include_usage` output from a stream.
//! - [`inject`]: the request side (forcing `include_usage`).
//! - [`peek`]: holding a stream's start until content or an error shows.

pub mod hide;
pub mod inject;
pub(crate) mod peek;
pub mod sse;

use std::sync::LazyLock;

use memchr::memmem::Finder;
use serde::Deserialize;
use serde_json::value::RawValue;
use serde_json::Value;

use self::sse::{SseEvent, SseScanner};
pub use crate::compaction::trigger::Usage;
pub use crate::upstream::body::{Eos, Observer};

/// llama.cpp `timings` (only the counts).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Timings {
    /// Prompt tokens processed for this request.
    pub(crate) prompt_n: Option<u64>,
    /// Prompt tokens reused from the cache.
    pub(crate) cache_n: Option<u64>,
    /// Tokens generated.
    pub(crate) predicted_n: Option<u64>,
}

/// Where [`UsageReport::prompt_tokens`] came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PromptSource {
    /// `usage.prompt_tokens`.
    Usage,
    /// llama.cpp `timings.prompt_n + timings.cache_n`.
    Timings,
}

/// Everything usage-related found in one response.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct UsageReport {
    /// The last non-null `usage` object seen.
    pub usage: Option<Usage>,
    /// The last `timings` object seen.
    pub(crate) timings: Option<Timings>,
}

impl UsageReport {
    /// Real prompt size: `usage.prompt_tokens`, else `prompt_n + cache_n`.
    pub fn prompt_tokens(&self) -> Option<(u64, PromptSource)> {
        if let Some(p) = self.usage.and_then(|u| u.prompt_tokens) {
            return Some((p, PromptSource::Usage));
        }
        let t = self.timings?;
        let p = t.prompt_n?.checked_add(t.cache_n.unwrap_or(0))?;
        Some((p, PromptSource::Timings))
    }

    /// Completion size: `usage.completion_tokens`, else `predicted_n`.
    pub(crate) fn completion_tokens(&self) -> Option<u64> {
        self.usage
            .and_then(|u| u.completion_tokens)
            .or_else(|| self.timings.and_then(|t| t.predicted_n))
    }

    /// `usage` with the timings fallback applied (what calibration wants).
    pub(crate) fn effective(&self) -> Option<Usage> {
        let (prompt, _) = self.prompt_tokens()?;
        let completion = self.completion_tokens();
        let base = self.usage.unwrap_or_default();
        Some(Usage {
            prompt_tokens: Some(prompt),
            completion_tokens: completion,
            total_tokens: base
                .total_tokens
                .or_else(|| completion.map(|c| prompt.saturating_add(c))),
            cached_tokens: base
                .cached_tokens
                .or_else(|| self.timings.and_then(|t| t.cache_n)),
        })
    }
}

/// How the response body is framed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BodyKind {
    /// `text/event-stream`.
    Sse,
    /// A single JSON document (non-streaming response or error body).
    Json,
    /// `application/x-ndjson`: one JSON object a line (Ollama's streams,
    /// the last object with `done: true` and the counts).
    Ndjson,
}

impl BodyKind {
    /// From a `Content-Type` value; anything not an event stream or NDJSON
    /// is treated as JSON (parse failures are harmless).
    pub fn from_content_type(ct: Option<&str>) -> Self {
        let starts = |v: &str, p: &str| {
            v.trim_start()
                .as_bytes()
                .get(..p.len())
                .is_some_and(|h| h.eq_ignore_ascii_case(p.as_bytes()))
        };
        match ct {
            Some(v) if starts(v, "text/event-stream") => Self::Sse,
            Some(v) if starts(v, "application/x-ndjson") => Self::Ndjson,
            _ => Self::Json,
        }
    }
}

/// What the start of a stream turned out to be.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum StreamStart {
    /// Nothing decisive yet.
    Undecided,
    /// A content delta (or a finish) arrived first.
    Content,
    /// An error arrived before any content; the raw payload is kept so the
    /// caller can run overflow recognition on it.
    Error(Vec<u8>),
}

/// Largest non-streaming body kept for usage parsing.
pub(crate) const MAX_JSON_BYTES: usize = 8 << 20;

/// Incremental usage extraction over a response body.
#[derive(Debug)]
pub struct UsageExtractor {
    kind: BodyKind,
    scanner: SseScanner,
    /// The JSON body, or the NDJSON line not ended yet.
    json: Vec<u8>,
    json_oversized: bool,
    report: UsageReport,
    start: StreamStart,
    bytes: u64,
    parse_failures: u64,
    /// NDJSON lines skipped for their size.
    lines_skipped: u64,
}

#[derive(Deserialize, Default)]
struct ChunkLite<'a> {
    #[serde(default, borrow)]
    usage: Option<&'a RawValue>,
    #[serde(default, borrow)]
    timings: Option<&'a RawValue>,
    #[serde(default, borrow)]
    error: Option<&'a RawValue>,
    #[serde(default, borrow)]
    choices: Option<&'a RawValue>,
    #[serde(default, rename = "type", borrow)]
    kind: Option<&'a RawValue>,
    /// Anthropic `message_start` carries its usage in `message`.
    #[serde(default, borrow)]
    message: Option<&'a RawValue>,
    /// Responses `response.completed` carries its usage in `response`.
    #[serde(default, borrow)]
    response: Option<&'a RawValue>,
    /// Ollama's `/api/chat` and `/api/generate` count at the top level.
    #[serde(default, borrow)]
    prompt_eval_count: Option<&'a RawValue>,
    #[serde(default, borrow)]
    eval_count: Option<&'a RawValue>,
}

impl<'a> ChunkLite<'a> {
    /// `payload` read as serde_json reads it into this struct: skimmed
    /// (`crate::skim`) when it can be, else parsed by serde_json, which also
    /// decides what the skim leaves to it (escaped or repeated keys, invalid
    /// text), so the outcome is the same either way. The skim is several
    /// times cheaper: for a small completion, 5,500 instructions of
    /// serde_json against ~1,000.
    fn read(payload: &'a [u8]) -> Result<Self, ()> {
        match Self::skimmed(payload) {
            Some(c) => Ok(c),
            None => serde_json::from_slice(payload).map_err(|_| ()),
        }
    }

    fn skimmed(payload: &'a [u8]) -> Option<Self> {
        let text = std::str::from_utf8(payload).ok()?;
        let mut c = ChunkLite::default();
        let mut seen = 0u16;
        crate::skim::each_member(text, None, |key, span| {
            let (bit, slot) = match key {
                "usage" => (0, &mut c.usage),
                "timings" => (1, &mut c.timings),
                "error" => (2, &mut c.error),
                "choices" => (3, &mut c.choices),
                "type" => (4, &mut c.kind),
                "message" => (5, &mut c.message),
                "response" => (6, &mut c.response),
                "prompt_eval_count" => (7, &mut c.prompt_eval_count),
                "eval_count" => (8, &mut c.eval_count),
                _ => return Some(()),
            };
            first_time(&mut seen, bit)?;
            // serde_json reads `null` into an `Option` as `None`.
            *slot = match text.get(span)? {
                "null" => None,
                raw => Some(crate::skim::raw(raw)?),
            };
            Some(())
        })?;
        Some(c)
    }
}

/// An object's `usage` member, for the nested places it hides in.
#[derive(Deserialize)]
struct NestedUsage<'a> {
    #[serde(default, borrow)]
    usage: Option<&'a RawValue>,
}

/// Chat completions' counts, and the Anthropic and Responses spellings
/// (`input_tokens`, `output_tokens`; Anthropic counts cache writes and
/// reads apart from `input_tokens`).
#[derive(Deserialize)]
struct UsageLite {
    prompt_tokens: Option<Value>,
    completion_tokens: Option<Value>,
    total_tokens: Option<Value>,
    prompt_tokens_details: Option<DetailsLite>,
    input_tokens: Option<Value>,
    output_tokens: Option<Value>,
    cache_creation_input_tokens: Option<Value>,
    cache_read_input_tokens: Option<Value>,
    input_tokens_details: Option<DetailsLite>,
}

#[derive(Deserialize)]
struct DetailsLite {
    cached_tokens: Option<Value>,
}

#[derive(Deserialize)]
struct TimingsLite {
    prompt_n: Option<Value>,
    cache_n: Option<Value>,
    predicted_n: Option<Value>,
}

#[derive(Deserialize)]
struct ChoiceLite<'a> {
    #[serde(default, borrow)]
    delta: Option<DeltaLite<'a>>,
    #[serde(default, borrow)]
    message: Option<&'a RawValue>,
    #[serde(default, borrow)]
    finish_reason: Option<&'a RawValue>,
}

#[derive(Deserialize)]
struct DeltaLite<'a> {
    #[serde(default, borrow)]
    content: Option<&'a RawValue>,
    #[serde(default, borrow)]
    tool_calls: Option<&'a RawValue>,
    #[serde(default, borrow)]
    function_call: Option<&'a RawValue>,
    #[serde(default, borrow)]
    reasoning_content: Option<&'a RawValue>,
    #[serde(default, borrow)]
    reasoning: Option<&'a RawValue>,
    #[serde(default, borrow)]
    refusal: Option<&'a RawValue>,
}

fn count(v: &Option<Value>) -> Option<u64> {
    match v.as_ref()? {
        Value::Number(n) => n
            .as_u64()
            .or_else(|| n.as_f64().filter(|f| *f >= 0.0).map(|f| f as u64)),
        _ => None,
    }
}

fn is_meaningful(raw: Option<&RawValue>) -> bool {
    match raw.map(|r| r.get().trim()) {
        None | Some("null") | Some("\"\"") | Some("[]") | Some("{}") => false,
        Some(_) => true,
    }
}

/// Parses a `usage` object; `None` for `null` or a non-object.
pub(crate) fn parse_usage(raw: &RawValue) -> Option<Usage> {
    skimmed_usage(raw.get()).unwrap_or_else(|| parse_usage_serde(raw.get()))
}

/// [`parse_usage`] by serde_json: ~2,000 instructions for a three-count
/// object, mostly building the `Value`s. Decides what the skim leaves.
fn parse_usage_serde(text: &str) -> Option<Usage> {
    let u: UsageLite = serde_json::from_str(text).ok()?;
    let cache_read = count(&u.cache_read_input_tokens);
    // The whole prompt: Anthropic's `input_tokens` leaves out what was
    // written to and read from its cache; Responses' includes it.
    let input = count(&u.input_tokens).map(|i| {
        i.saturating_add(count(&u.cache_creation_input_tokens).unwrap_or(0))
            .saturating_add(cache_read.unwrap_or(0))
    });
    Some(Usage {
        prompt_tokens: count(&u.prompt_tokens).or(input),
        completion_tokens: count(&u.completion_tokens).or_else(|| count(&u.output_tokens)),
        total_tokens: count(&u.total_tokens),
        cached_tokens: u
            .prompt_tokens_details
            .or(u.input_tokens_details)
            .and_then(|d| count(&d.cached_tokens))
            .or(cache_read),
    })
}

/// [`parse_usage`] from a skim of the object (`crate::skim`), read as
/// serde_json reads it into `UsageLite`; `None` when serde_json has to
/// decide (an escaped or repeated key, invalid text).
fn skimmed_usage(text: &str) -> Option<Option<Usage>> {
    let mut n: [Option<u64>; 7] = [None; 7];
    let mut details: [Option<Option<u64>>; 2] = [None; 2];
    let mut seen = 0u16;
    // A value serde_json fails the whole usage on; one it has to judge.
    let (mut fails, mut defer) = (false, false);
    crate::skim::each_member(text, None, |key, span| {
        let slot = match key {
            "prompt_tokens" => 0,
            "completion_tokens" => 1,
            "total_tokens" => 2,
            "input_tokens" => 3,
            "output_tokens" => 4,
            "cache_creation_input_tokens" => 5,
            "cache_read_input_tokens" => 6,
            "prompt_tokens_details" => 7,
            "input_tokens_details" => 8,
            _ => return Some(()),
        };
        first_time(&mut seen, slot)?;
        let value = text.get(span)?;
        if slot < 7 {
            n[slot] = json_count(value);
            return Some(());
        }
        details[slot - 7] = match value {
            "null" => None,
            v if v.starts_with('{') => Some(cached_tokens(v)?),
            // serde_json reads a struct from an array too, by position:
            // its call.
            v if v.starts_with('[') => {
                defer = true;
                None
            }
            _ => {
                fails = true;
                None
            }
        };
        Some(())
    })?;
    if defer {
        return None;
    }
    if fails {
        return Some(None);
    }
    let [prompt, completion, total, input, output, creation, cache_read] = n;
    let input = input.map(|i| {
        i.saturating_add(creation.unwrap_or(0))
            .saturating_add(cache_read.unwrap_or(0))
    });
    Some(Some(Usage {
        prompt_tokens: prompt.or(input),
        completion_tokens: completion.or(output),
        total_tokens: total,
        cached_tokens: details[0].or(details[1]).flatten().or(cache_read),
    }))
}

/// Marks the known field `bit` as read; `None` the second time: serde_json
/// refuses a field given twice (an unknown one it skips), so the skim
/// leaves that body to it.
fn first_time(seen: &mut u16, bit: usize) -> Option<()> {
    let mask = 1u16 << bit;
    (*seen & mask == 0).then(|| *seen |= mask)
}

/// A details object's `cached_tokens` as [`DetailsLite`] reads it; `None`
/// when serde_json has to decide.
fn cached_tokens(details: &str) -> Option<Option<u64>> {
    let mut cached = None;
    crate::skim::each_member(details, None, |key, span| {
        if key == "cached_tokens" {
            if cached.is_some() {
                return None;
            }
            cached = Some(json_count(details.get(span)?));
        }
        Some(())
    })?;
    Some(cached.flatten())
}

/// A count as [`count`] reads it, from the JSON text of a valid value: a
/// non-negative number (a fraction truncated, a huge one saturated).
fn json_count(value: &str) -> Option<u64> {
    if !value.starts_with(|c: char| c == '-' || c.is_ascii_digit()) {
        return None;
    }
    value.parse::<u64>().ok().or_else(|| {
        value
            .parse::<f64>()
            .ok()
            .filter(|f| *f >= 0.0)
            .map(|f| f as u64)
    })
}

/// Fields of `new` where it has them, else those of `old`: an Anthropic
/// stream gives the prompt in `message_start` and only the output count in
/// the later `message_delta`.
fn merge_usage(old: Option<Usage>, new: Usage) -> Usage {
    let Some(old) = old else {
        return new;
    };
    Usage {
        prompt_tokens: new.prompt_tokens.or(old.prompt_tokens),
        completion_tokens: new.completion_tokens.or(old.completion_tokens),
        total_tokens: new.total_tokens.or(old.total_tokens),
        cached_tokens: new.cached_tokens.or(old.cached_tokens),
    }
}

/// Event types of Anthropic and Responses streams that mean the answer has
/// started (an overflow can no longer come first).
const CONTENT_EVENTS: &[&str] = &[
    "\"message_start\"",
    "\"content_block_start\"",
    "\"content_block_delta\"",
    "\"message_delta\"",
    "\"response.output_item.added\"",
    "\"response.content_part.added\"",
    "\"response.output_text.delta\"",
    "\"response.completed\"",
];

/// Event types that report a failed answer (Responses).
const ERROR_EVENTS: &[&str] = &["\"error\"", "\"response.failed\""];

fn parse_timings(raw: &RawValue) -> Option<Timings> {
    let t: TimingsLite = serde_json::from_str(raw.get()).ok()?;
    // llama.cpp uses -1 for "not measured"; `count` drops negatives.
    Some(Timings {
        prompt_n: count(&t.prompt_n),
        cache_n: count(&t.cache_n),
        predicted_n: count(&t.predicted_n),
    })
}

/// Whether `choices` carries generated content (or a finish), i.e. the
/// response has started for real.
fn choices_have_content(raw: &RawValue) -> bool {
    let Ok(choices) = serde_json::from_str::<Vec<ChoiceLite<'_>>>(raw.get()) else {
        return false;
    };
    choices.iter().any(|c| {
        is_meaningful(c.finish_reason)
            || is_meaningful(c.message)
            || c.delta.as_ref().is_some_and(|d| {
                is_meaningful(d.content)
                    || is_meaningful(d.tool_calls)
                    || is_meaningful(d.function_call)
                    || is_meaningful(d.reasoning_content)
                    || is_meaningful(d.reasoning)
                    || is_meaningful(d.refusal)
            })
    })
}

// Built once: building a memmem searcher costs more than scanning a
// typical SSE event, and these run on every event of every stream.
/// Finds `"usage"`.
pub(crate) static USAGE_KEY: LazyLock<Finder<'static>> =
    LazyLock::new(|| Finder::new(b"\"usage\""));
/// Finds `"prompt_eval_count"` (Ollama's counts).
static PROMPT_EVAL_KEY: LazyLock<Finder<'static>> =
    LazyLock::new(|| Finder::new(b"\"prompt_eval_count\""));
/// Finds `"timings"`.
static TIMINGS_KEY: LazyLock<Finder<'static>> = LazyLock::new(|| Finder::new(b"\"timings\""));

/// Whether `data` may hold `"usage"` or `"timings"`: both have a `g`, which
/// stream chunks rarely do, so one `memchr` rules most events out where
/// the two substring searches cost ~300 instructions an event.
pub(crate) fn may_have_usage_key(data: &[u8]) -> bool {
    memchr::memchr(b'g', data).is_some()
}

/// `"usage"` followed by `:` and an object (so the `"usage":null` OpenAI adds
/// to every chunk does not trigger a parse).
fn has_usage_object(data: &[u8]) -> bool {
    any_match(&USAGE_KEY, data, |p| {
        let rest = &data[p + 7..];
        let rest = rest.trim_ascii_start();
        rest.strip_prefix(b":")
            .is_some_and(|r| r.trim_ascii_start().first() == Some(&b'{'))
    })
}

/// Where the first of `finder`'s keys in `hay` starts whose value is not
/// plainly `null` on its line (spaces or tabs around the colon). Whatever
/// else follows it, another line's text included, counts as not `null`:
/// a frame's events are searched at once, and an event's data lines are
/// joined before they are read.
fn first_not_null(finder: &Finder<'_>, hay: &[u8]) -> Option<usize> {
    let blank = |b: &[u8]| {
        b.iter()
            .position(|&c| c != b' ' && c != b'\t')
            .unwrap_or(b.len())
    };
    first_match(finder, hay, |at| {
        let rest = &hay[at + finder.needle().len()..];
        let rest = &rest[blank(rest)..];
        let plainly_null = rest.first() == Some(&b':') && {
            let value = &rest[1..];
            value[blank(value)..].starts_with(b"null")
        };
        !plainly_null
    })
}

/// How much of the front of `front` (a tap's data from an event's start)
/// is whole events that carry neither usage nor timings: up to the last
/// event end before the first `"timings"` or `"usage"` key whose value is
/// not plainly `null`. Both keys have a `g` (at most six bytes in), and
/// most streams have none before their usage chunk.
fn quiet_events(front: &[u8]) -> usize {
    let stop = match memchr::memchr(b'g', front) {
        None => front.len(),
        Some(g) => {
            let from = g.saturating_sub(6);
            let hay = &front[from..];
            let usage = first_not_null(&USAGE_KEY, hay);
            let timings = TIMINGS_KEY.find(hay);
            usage
                .into_iter()
                .chain(timings)
                .min()
                .map_or(front.len(), |p| from + p)
        }
    };
    sse::last_event_end(front, stop)
}

/// Whether `test` holds for some position of `finder`'s needle in `hay`.
pub(crate) fn any_match(finder: &Finder<'_>, hay: &[u8], test: impl FnMut(usize) -> bool) -> bool {
    first_match(finder, hay, test).is_some()
}

/// The first position of `finder`'s needle in `hay` for which `test` holds.
/// A loop of `find` rather than `find_iter`: building the iterator copies
/// the searcher (~300 bytes), once per SSE event on these paths.
///
/// The needles are quoted keys (`"usage"`): two occurrences share at most
/// a quote, so the next search starts at the closing quote of the last
/// match, not one byte after its start. After `"finish_reason":null}]}`
/// what is left is then shorter than the needle, and the search that
/// would scan it (a second one per event, ~110 instructions) ends at once.
fn first_match(
    finder: &Finder<'_>,
    hay: &[u8],
    mut test: impl FnMut(usize) -> bool,
) -> Option<usize> {
    let needle = finder.needle();
    debug_assert!(
        needle.len() >= 2
            && needle[0] == b'"'
            && memchr::memchr(b'"', &needle[1..]) == Some(needle.len() - 2),
        "a quoted key without inner quotes"
    );
    let mut from = 0;
    while let Some(p) = finder.find(&hay[from..]) {
        if test(from + p) {
            return Some(from + p);
        }
        from += p + needle.len() - 1;
    }
    None
}

impl UsageExtractor {
    /// A fresh extractor for a body of `kind`.
    pub fn new(kind: BodyKind) -> Self {
        Self {
            kind,
            scanner: SseScanner::new(),
            json: Vec::new(),
            json_oversized: false,
            report: UsageReport::default(),
            start: StreamStart::Undecided,
            bytes: 0,
            parse_failures: 0,
            lines_skipped: 0,
        }
    }

    /// Feeds the next body bytes.
    pub fn feed(&mut self, data: &[u8]) {
        self.feed_while(data, false);
    }

    /// [`UsageExtractor::feed`] for a reader of the stream's start only: an
    /// SSE body is scanned until its start is decided, not further (a burst
    /// of a whole response read at once is not scanned twice, here and by
    /// the tap that reads it after).
    pub(crate) fn feed_start(&mut self, data: &[u8]) {
        self.feed_while(data, true);
    }

    fn feed_while(&mut self, data: &[u8], undecided_only: bool) {
        self.bytes += data.len() as u64;
        match self.kind {
            BodyKind::Sse => {
                let Self {
                    scanner,
                    report,
                    start,
                    parse_failures,
                    ..
                } = self;
                let mut data = data;
                if !undecided_only && *start != StreamStart::Undecided && scanner.between_events() {
                    // Once the start is decided only usage and timings are
                    // read: the events before the first that may carry
                    // either are left out whole (found as the frame's hider
                    // finds them) instead of scanned line by line (~240
                    // instructions an event). Within the size cap, so none
                    // of them is one the scanner would have counted as
                    // oversized.
                    let front = &data[..data.len().min(sse::MAX_EVENT_BYTES)];
                    data = &data[quiet_events(front)..];
                }
                scanner.feed_until(data, |ev| {
                    on_event(ev, report, start, parse_failures);
                    !undecided_only || *start == StreamStart::Undecided
                });
            }
            BodyKind::Ndjson => self.feed_lines(data),
            BodyKind::Json => {
                if self.json_oversized {
                    return;
                }
                if self.json.len() + data.len() > MAX_JSON_BYTES {
                    self.json_oversized = true;
                    self.json = Vec::new();
                } else {
                    self.json.extend_from_slice(data);
                }
            }
        }
    }

    /// NDJSON: each whole line read as one chunk; a line longer than an
    /// SSE event may be is skipped (counted), not buffered.
    fn feed_lines(&mut self, mut data: &[u8]) {
        while let Some(nl) = memchr::memchr(b'\n', data) {
            let (line, rest) = (&data[..nl], &data[nl + 1..]);
            if self.json.is_empty() && !self.json_oversized {
                self.on_line(line);
            } else {
                self.buffer_line(line);
                let whole = std::mem::take(&mut self.json);
                if !std::mem::take(&mut self.json_oversized) {
                    self.on_line(&whole);
                }
                self.json = whole;
                self.json.clear();
            }
            data = rest;
        }
        self.buffer_line(data);
    }

    fn buffer_line(&mut self, part: &[u8]) {
        if self.json_oversized {
            return;
        }
        if self.json.len() + part.len() > sse::MAX_EVENT_BYTES {
            self.json_oversized = true;
            self.lines_skipped += 1;
            self.json = Vec::new();
        } else {
            self.json.extend_from_slice(part);
        }
    }

    /// One NDJSON line: once the start is decided, only a line that counts
    /// (`prompt_eval_count`, Ollama's last) is parsed.
    fn on_line(&mut self, line: &[u8]) {
        let line = line.trim_ascii();
        let undecided = self.start == StreamStart::Undecided;
        if line.is_empty() || (!undecided && PROMPT_EVAL_KEY.find(line).is_none()) {
            return;
        }
        match ChunkLite::read(line) {
            Ok(c) => apply_chunk(&c, line, &mut self.report, &mut self.start, true),
            Err(_) => self.parse_failures += 1,
        }
    }

    /// Ends the body: parses a JSON body, or flushes an SSE event left
    /// without its blank line (an NDJSON line without its line feed).
    pub fn finish(&mut self) {
        match self.kind {
            BodyKind::Ndjson => {
                let last = std::mem::take(&mut self.json);
                if !self.json_oversized {
                    self.on_line(&last);
                }
            }
            BodyKind::Sse => {
                let Self {
                    scanner,
                    report,
                    start,
                    parse_failures,
                    ..
                } = self;
                scanner.finish(|ev| on_event(ev, report, start, parse_failures));
            }
            BodyKind::Json => {
                let body = std::mem::take(&mut self.json);
                if body.is_empty() {
                    return;
                }
                match ChunkLite::read(&body) {
                    Ok(c) => apply_chunk(&c, &body, &mut self.report, &mut self.start, true),
                    Err(_) => self.parse_failures += 1,
                }
            }
        }
    }

    /// What was found so far.
    pub fn report(&self) -> UsageReport {
        self.report
    }

    /// How the stream started (for SSE; a JSON error body counts too).
    pub(crate) fn start(&self) -> &StreamStart {
        &self.start
    }

    /// Body bytes seen.
    pub(crate) fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Payloads that could not be parsed (counted, never fatal).
    pub(crate) fn parse_failures(&self) -> u64 {
        self.parse_failures
    }

    /// Events skipped for exceeding the size cap.
    pub(crate) fn oversized(&self) -> u64 {
        let json = match self.kind {
            BodyKind::Ndjson => self.lines_skipped,
            _ => u64::from(self.json_oversized),
        };
        self.scanner.skipped() + json
    }
}

fn on_event(
    ev: SseEvent<'_>,
    report: &mut UsageReport,
    start: &mut StreamStart,
    parse_failures: &mut u64,
) {
    let undecided = *start == StreamStart::Undecided;
    let is_error_event = ev.error_field || ev.event == Some(b"error");
    if undecided && is_error_event {
        *start = StreamStart::Error(ev.data.to_vec());
    }
    // After the start is settled only usage/timings matter; skip the parse
    // for the (vast majority of) chunks that carry neither.
    let interesting = may_have_usage_key(ev.data)
        && (has_usage_object(ev.data) || TIMINGS_KEY.find(ev.data).is_some());
    if !undecided && !interesting {
        return;
    }
    if ev.data == b"[DONE]" {
        return;
    }
    match ChunkLite::read(ev.data) {
        Ok(c) => apply_chunk(&c, ev.data, report, start, false),
        Err(_) => *parse_failures += 1,
    }
}

fn apply_chunk(
    c: &ChunkLite<'_>,
    payload: &[u8],
    report: &mut UsageReport,
    start: &mut StreamStart,
    whole_body: bool,
) {
    let nested = || {
        [c.message, c.response].into_iter().flatten().find_map(|m| {
            serde_json::from_str::<NestedUsage<'_>>(m.get())
                .ok()
                .and_then(|n| n.usage)
        })
    };
    if let Some(u) = c.usage.or_else(nested).and_then(parse_usage) {
        report.usage = Some(merge_usage(report.usage, u));
    } else if let Some(prompt) = c.prompt_eval_count.and_then(|r| json_count(r.get())) {
        let completion = c.eval_count.and_then(|r| json_count(r.get()));
        report.usage = Some(Usage {
            prompt_tokens: Some(prompt),
            completion_tokens: completion,
            total_tokens: completion.map(|e| prompt.saturating_add(e)),
            cached_tokens: None,
        });
    }
    if let Some(t) = c.timings.and_then(parse_timings) {
        report.timings = Some(t);
    }
    if *start != StreamStart::Undecided {
        return;
    }
    let kind = c.kind.map(|k| k.get().trim());
    let typed_error = kind.is_some_and(|k| ERROR_EVENTS.contains(&k));
    let typed_content = kind.is_some_and(|k| CONTENT_EVENTS.contains(&k));
    if is_meaningful(c.error) || typed_error {
        *start = StreamStart::Error(payload.to_vec());
    } else if whole_body || typed_content || c.choices.is_some_and(choices_have_content) {
        *start = StreamStart::Content;
    }
}

/// What a finished tap hands back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TapOutcome {
    /// Usage found in the body.
    pub report: UsageReport,
    /// How the body ended.
    pub eos: Eos,
    /// How the stream started.
    pub(crate) start: StreamStart,
    /// Body bytes forwarded.
    pub(crate) bytes: u64,
    /// Payloads that failed to parse.
    pub(crate) parse_failures: u64,
    /// Events skipped for size.
    pub(crate) oversized: u64,
}

/// Called with a body's usage as soon as it is known (see
/// [`UsageObserver::on_usage`]).
pub(crate) type OnUsage = Box<dyn FnOnce(UsageReport) + Send>;

/// [`Observer`] that extracts usage and hands a [`TapOutcome`] to `done`
/// exactly once, when the body ends.
pub struct UsageObserver<F: FnOnce(TapOutcome)> {
    extractor: UsageExtractor,
    on_usage: Option<OnUsage>,
    done: Option<F>,
}

impl<F: FnOnce(TapOutcome)> UsageObserver<F> {
    /// Observer for a body of `kind`.
    pub fn new(kind: BodyKind, done: F) -> Self {
        Self {
            extractor: UsageExtractor::new(kind),
            on_usage: None,
            done: Some(done),
        }
    }

    /// For a caller that does not read how the stream started (the
    /// response's hold-back already decided it): events that carry no
    /// usage are then not parsed to find out. The first events of every
    /// stream were parsed twice, once here and once by the hold-back.
    pub(crate) fn ignoring_start(mut self) -> Self {
        self.extractor.start = StreamStart::Content;
        self
    }

    /// Also hands the report to `f` as soon as it has a prompt count: at
    /// the usage chunk, which comes before `[DONE]`, or at the end of the
    /// body at the latest (JSON bodies, llama.cpp `timings`). Never called
    /// for a body that reports none. A client that sends its next turn
    /// right after the stream ends is then estimated with this turn's real
    /// count.
    pub(crate) fn on_usage(mut self, f: OnUsage) -> Self {
        self.on_usage = Some(f);
        self
    }

    fn post_usage(&mut self) {
        let report = self.extractor.report();
        if report.prompt_tokens().is_none() {
            return;
        }
        if let Some(f) = self.on_usage.take() {
            f(report);
        }
    }
}

impl<F: FnOnce(TapOutcome)> Observer for UsageObserver<F> {
    fn on_data(&mut self, data: &[u8]) {
        self.extractor.feed(data);
        if self.on_usage.is_some() && self.extractor.report().usage.is_some() {
            self.post_usage();
        }
    }

    fn on_eos(mut self, eos: Eos) {
        self.extractor.finish();
        self.post_usage();
        let e = &self.extractor;
        let outcome = TapOutcome {
            report: e.report(),
            eos,
            start: e.start().clone(),
            bytes: e.bytes(),
            parse_failures: e.parse_failures(),
            oversized: e.oversized(),
        };
        if let Some(done) = self.done.take() {
            done(outcome);
        }
    }
}

#[cfg(test)]
mod tests;
