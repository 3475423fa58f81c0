//! One engine, several APIs: each codec maps its API's request onto the
//! conversation the engine sees (chat-completions messages) and back.
//!
//! - Chat completions: the identity.
//! - [`anthropic`]: `POST /v1/messages` (top-level `system`, content
//!   blocks, `tool_use` / `tool_result` pairs).
//! - [`responses`]: `POST /v1/responses` without server-side state
//!   (`instructions`, `input` items, `function_call` / `function_call_output`
//!   pairs).
//! - [`ollama`]: Ollama's `POST /api/chat` (`images`, `thinking`, tool
//!   calls with object arguments and no ids).
//!
//! Byte preservation: decoding remembers which wire messages each engine
//! message came from ([`WireMap`]). Encoding walks what is to be sent and
//! emits the client's own wire bytes for every run of engine messages that
//! is exactly one wire message's decoding; only what the engine wrote or
//! changed (the summary, a pruned tool output) is converted back. The list
//! member of the body is then one splice, and every other member keeps its
//! bytes (the system member too, unless the engine changed the system
//! message).

pub(crate) mod anthropic;
mod memo;
pub(crate) mod ollama;
pub(crate) mod responses;
mod tools;

use std::collections::HashMap;
use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;

use bytes::Bytes;
use serde_json::value::RawValue;
use serde_json::Value;

use crate::request::{message_hash, raw_hash, write_canonical, ChatRequest, ParseError};

/// Which API a request speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Api {
    /// `POST /v1/chat/completions`.
    Chat,
    /// Anthropic `POST /v1/messages`.
    Messages,
    /// OpenAI `POST /v1/responses`.
    Responses,
    /// Ollama `POST /api/chat`.
    Ollama,
}

impl Api {
    /// Metric and log label.
    pub(crate) fn label(self) -> &'static str {
        match self {
            Api::Chat => "chat",
            Api::Messages => "messages",
            Api::Responses => "responses",
            Api::Ollama => "ollama",
        }
    }

    /// The body member holding the conversation.
    fn list_key(self) -> &'static str {
        match self {
            Api::Chat | Api::Messages | Api::Ollama => "messages",
            Api::Responses => "input",
        }
    }

    /// The body member holding the system prompt, outside the list.
    fn system_key(self) -> Option<&'static str> {
        match self {
            Api::Chat | Api::Ollama => None,
            Api::Messages => Some("system"),
            Api::Responses => Some("instructions"),
        }
    }
}

/// Why a request is not compacted: the caller forwards it untouched.
#[derive(Debug, thiserror::Error)]
pub enum DecodeError {
    /// Not a request body this API's view can hold.
    #[error(transparent)]
    Parse(#[from] ParseError),
    /// A message or item this codec does not know how to map.
    #[error("unsupported {0} shape")]
    Unsupported(&'static str),
    /// A message whose role this codec does not know how to map (the role
    /// as one of the names [`role_label`] knows, so a log line never
    /// carries what a client wrote there).
    #[error("unsupported role {role:?} in {member}")]
    UnsupportedRole {
        member: &'static str,
        role: &'static str,
    },
    /// The request depends on state the upstream keeps
    /// (`previous_response_id`, stored item references): compacting what
    /// compactor sees would not shorten what the upstream sees.
    #[error("request refers to server-side state")]
    ServerState,
}

/// One wire message (or run of items) and the engine messages it became.
#[derive(Debug, Clone)]
struct Group {
    wire: Range<usize>,
    engine: Range<usize>,
}

/// The end of a [`WireMap::same_first`] chain.
const NO_GROUP: usize = usize::MAX;

/// Where each engine message came from.
#[derive(Debug, Default)]
pub(crate) struct WireMap {
    /// The client's wire messages, as received.
    wire: Vec<Box<RawValue>>,
    groups: Vec<Group>,
    /// Canonical hash of each engine message (not chained).
    engine_hashes: Vec<u128>,
    /// [`crate::request::raw_hash`] of each engine message, made as it is
    /// decoded: kept with the decode, so a resumed one's are not made again.
    raw_hashes: Vec<u64>,
    /// Each wire message's role, as decoded (Anthropic: the encode merges
    /// neighbours of one role without parsing the client's messages again).
    wire_roles: Vec<&'static str>,
    /// The first and the last group whose first engine message has this
    /// hash; the others follow through `same_first` (one allocation for
    /// all, where a list per hash cost one each).
    by_first: HashMap<u128, (usize, usize)>,
    /// For each group, the next group with the same first hash
    /// ([`NO_GROUP`] at the end).
    same_first: Vec<usize>,
    /// Hash of the engine's system message made from the system member.
    system_hash: Option<u128>,
    /// Where each tool call and tool result sits in `wire`, by call id:
    /// (wire message, block within its content, for Anthropic).
    calls: HashMap<String, (usize, Option<usize>)>,
    results: HashMap<String, (usize, Option<usize>)>,
    /// `cache_control` markers in the client's own system member.
    system_cc: usize,
    /// The caller's rough token estimator, and its estimate of each engine
    /// message, made from the value the decode holds anyway.
    rough_fn: Option<Rough>,
    rough: Vec<u64>,
}

/// A rough token estimate of one engine message.
pub(crate) type Rough = fn(&Value) -> u64;

impl WireMap {
    /// The map as it stood when the first `wire_end` wire messages had
    /// become the first `out_len` engine messages, without the wire
    /// messages themselves (what [`memo`] keeps: the next request brings
    /// its own). Made from this one, which is used up: nothing is copied.
    fn into_kept(mut self, wire_end: usize, out_len: usize) -> WireMap {
        self.wire = Vec::new();
        let whole = self.groups.last().is_none_or(|g| g.wire.end <= wire_end);
        if out_len == self.engine_hashes.len() && whole {
            return self;
        }
        self.engine_hashes.truncate(out_len);
        self.raw_hashes.truncate(out_len);
        self.wire_roles.truncate(wire_end);
        self.rough.truncate(out_len);
        self.calls.retain(|_, at| at.0 < wire_end);
        self.results.retain(|_, at| at.0 < wire_end);
        self.by_first.clear();
        self.same_first.clear();
        // Trailing items a decode joined to its last group after the cut
        // are not part of it.
        let groups = std::mem::take(&mut self.groups);
        let kept = groups
            .into_iter()
            .take_while(|g| g.engine.end <= out_len && g.wire.start < wire_end);
        for g in kept {
            self.link(Group {
                wire: g.wire.start..g.wire.end.min(wire_end),
                engine: g.engine,
            });
        }
        self
    }

    /// Appends group `g`, chained after the groups with its first hash.
    fn link(&mut self, g: Group) {
        let id = self.groups.len();
        let first = self.engine_hashes[g.engine.start];
        self.same_first.push(NO_GROUP);
        match self.by_first.get_mut(&first) {
            None => {
                self.by_first.insert(first, (id, id));
            }
            Some((_, last)) => {
                self.same_first[*last] = id;
                *last = id;
            }
        }
        self.groups.push(g);
    }

    /// Records that `wire` became the engine messages `engine` (appended to
    /// `out`).
    fn push(&mut self, out: &mut Vec<Box<RawValue>>, wire: Range<usize>, engine: Vec<Value>) {
        let start = out.len();
        for v in engine {
            if let Some((raw, h)) = engine_raw(&v) {
                self.engine_hashes.push(h);
                self.raw_hashes.push(raw_hash(&raw));
                if let Some(f) = self.rough_fn {
                    self.rough.push(f(&v));
                }
                out.push(raw);
            }
        }
        if out.len() == start {
            return;
        }
        self.link(Group {
            wire,
            engine: start..out.len(),
        });
    }

    /// The system message, kept out of the groups (its wire form is a body
    /// member, not a list element).
    fn push_system(&mut self, out: &mut Vec<Box<RawValue>>, system: Value) {
        if let Some((raw, h)) = engine_raw(&system) {
            if let Some(f) = self.rough_fn {
                self.rough.push(f(&system));
            }
            self.system_hash = Some(h);
            self.engine_hashes.push(h);
            self.raw_hashes.push(raw_hash(&raw));
            out.push(raw);
        }
    }

    /// The wire block (or item) a tool call or result id came from, parsed.
    fn original(&self, result: bool, id: &str) -> Option<Value> {
        let (w, b) = *if result { &self.results } else { &self.calls }.get(id)?;
        let v: Value = serde_json::from_str(self.wire.get(w)?.get()).ok()?;
        match b {
            None => Some(v),
            Some(b) => v.get("content")?.get(b).cloned(),
        }
    }

    /// Splits `outgoing` into runs: the client's own wire messages where a
    /// run of engine messages is exactly one group's decoding, else single
    /// engine messages for the codec to convert.
    fn pieces<'a>(&'a self, outgoing: &'a [Box<RawValue>]) -> Vec<Piece<'a>> {
        // A message whose bytes hash to one the decode made is that
        // (canonical) message: its canonical hash is the hash of its bytes,
        // and the parse and re-serialisation `message_hash` does are saved
        // for what the engine kept. Others (the summary, an edited message)
        // are hashed the canonical way.
        // Sorted, not a hashed set, which SipHashes each: ~60,000
        // instructions fewer on a compacted 500-message request.
        let mut known = self.engine_hashes.clone();
        known.sort_unstable();
        let hashes: Vec<u128> = outgoing
            .iter()
            .map(|m| {
                let fast = xxhash_rust::xxh3::xxh3_128(m.get().as_bytes());
                if known.binary_search(&fast).is_ok() {
                    fast
                } else {
                    message_hash(m)
                }
            })
            .collect();
        let mut out = Vec::with_capacity(outgoing.len());
        let mut i = 0;
        while i < outgoing.len() {
            let mut next = self
                .by_first
                .get(&hashes[i])
                .map_or(NO_GROUP, |&(first, _)| first);
            let mut found = None;
            while next != NO_GROUP {
                let g = &self.groups[next];
                let n = g.engine.len();
                if hashes.get(i..i + n) == Some(&self.engine_hashes[g.engine.clone()]) {
                    found = Some(g);
                    break;
                }
                next = self.same_first[next];
            }
            match found {
                Some(g) => {
                    out.extend(g.wire.clone().map(|k| Piece::Wire(&self.wire[k], k)));
                    i += g.engine.len();
                }
                None => {
                    let system = Some(hashes[i]) == self.system_hash;
                    out.push(Piece::Engine(&outgoing[i], system));
                    i += 1;
                }
            }
        }
        out
    }
}

#[cfg(test)]
thread_local! {
    /// Where this thread's last decode resumed, when it did.
    static RESUMED_AT: std::cell::Cell<Option<usize>> = const { std::cell::Cell::new(None) };
    /// This thread's decodes neither resume nor keep (the reference a
    /// resumed decode is compared with).
    static BYPASS: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Where a decode starts: the longest kept decode of a prefix of this
/// body's wire messages ([`memo`]), or the beginning.
struct Resume {
    /// Hash chain of the decode's input, one element per wire boundary.
    chain: Vec<u128>,
    /// Wire messages already decoded.
    start: usize,
    /// Whether a kept decode was taken over (its system message included).
    resumed: bool,
}

impl Resume {
    /// Where to start, with the engine messages and map to go on from
    /// (`fresh` when nothing is kept).
    fn new(
        api: Api,
        system: Option<&RawValue>,
        wire: &[Box<RawValue>],
        fresh: WireMap,
    ) -> (Resume, Vec<Box<RawValue>>, WireMap) {
        let chain = memo::chain(api, fresh.rough_fn.is_some(), system, wire);
        #[cfg(test)]
        RESUMED_AT.set(None);
        #[cfg(test)]
        let chain = if BYPASS.get() { Vec::new() } else { chain };
        match memo::global().take(&chain) {
            Some(p) => {
                let mut map = p.map;
                map.rough_fn = fresh.rough_fn;
                #[cfg(test)]
                RESUMED_AT.set(Some(p.wire_len));
                let start = p.wire_len;
                (
                    Resume {
                        chain,
                        start,
                        resumed: true,
                    },
                    p.out,
                    map,
                )
            }
            None => {
                let out = Vec::with_capacity(wire.len() + 1);
                (
                    Resume {
                        chain,
                        start: 0,
                        resumed: false,
                    },
                    out,
                    fresh,
                )
            }
        }
    }

    /// The decode as it stood at `cut` (wire messages, engine messages
    /// decoded by then), to keep for the next request of this
    /// conversation: where a later decode may resume, which is not always
    /// the end. Kept when the request is dropped ([`Keep`]).
    fn keep(&self, cut: (usize, usize), out: &[Box<RawValue>]) -> Option<Keep> {
        let (wire_len, out_len) = cut;
        let key = *self.chain.get(wire_len)?;
        (out_len <= out.len()).then_some(Keep {
            key,
            wire_len,
            out_len,
        })
    }
}

/// What a codec's decode gives: the engine messages, where they came from,
/// and the decode to keep once the request is done with it.
type Decoded = (Vec<Box<RawValue>>, WireMap, Option<Keep>);

/// A decode to keep in the [`memo`] once its request is done with it: the
/// request's engine messages and map are moved there when it is dropped,
/// not copied when it is decoded (a copy of every engine message and of
/// the map's tables, then the request's own freed: on a warm 500-message
/// conversation a tenth of a Responses request).
#[derive(Debug)]
struct Keep {
    /// [`Resume`]'s chain at the cut.
    key: u128,
    wire_len: usize,
    out_len: usize,
}

/// A decoded engine message as the engine reads it, in canonical JSON
/// (`request::write_canonical`: keys sorted, no whitespace), and its
/// [`message_hash`]. Canonical, the message hashes from its own bytes: the
/// decode and the request's hash chain ([`ApiRequest::canonical`]) need no
/// second parse of what the decode just wrote.
fn engine_raw(v: &Value) -> Option<(Box<RawValue>, u128)> {
    let raw = if maps_sorted() {
        // serde_json writes a sorted map as canonical JSON already.
        serde_json::value::to_raw_value(v).ok()?
    } else {
        let mut buf = Vec::new();
        write_canonical(v, &mut buf);
        RawValue::from_string(String::from_utf8(buf).ok()?).ok()?
    };
    let h = xxhash_rust::xxh3::xxh3_128(raw.get().as_bytes());
    Some((raw, h))
}

/// Whether `serde_json::Map` keeps its keys sorted (no `preserve_order`
/// feature anywhere in the build): then serialising a value writes
/// canonical JSON.
fn maps_sorted() -> bool {
    static SORTED: OnceLock<bool> = OnceLock::new();
    *SORTED.get_or_init(|| {
        let mut m = serde_json::Map::new();
        m.insert("b".to_owned(), Value::Null);
        m.insert("a".to_owned(), Value::Null);
        m.keys().next().is_some_and(|k| k == "a")
    })
}

/// One element of what is sent, before the codec renders it.
#[derive(Debug)]
enum Piece<'a> {
    /// A client wire message (and its index), sent as its bytes.
    Wire(&'a RawValue, usize),
    /// An engine message to convert; `true` when it is the client's own
    /// system message unchanged.
    Engine(&'a RawValue, bool),
}

/// A request of any [`Api`], viewed as the engine's conversation.
#[derive(Debug)]
pub struct ApiRequest {
    api: Api,
    creq: ChatRequest,
    /// The engine's messages (moved out by [`Self::take_messages`]).
    engine: Vec<Box<RawValue>>,
    /// [`crate::request::raw_hash`] of each message (chat; a decode's are
    /// in its map).
    raw: Vec<u64>,
    map: WireMap,
    /// The decode to keep when the request is dropped.
    keep: Option<Keep>,
}

impl Drop for ApiRequest {
    fn drop(&mut self) {
        let Some(k) = self.keep.take() else {
            return;
        };
        // Messages taken and not put back: nothing whole to keep.
        if self.engine.len() < k.out_len {
            return;
        }
        let mut out = std::mem::take(&mut self.engine);
        out.truncate(k.out_len);
        let map = std::mem::take(&mut self.map).into_kept(k.wire_len, k.out_len);
        memo::global().store(k.key, k.wire_len, out, map);
    }
}

impl DecodeError {
    /// Content-free labels for the log line and the metric:
    /// `(reason, member, role)`.
    pub(crate) fn labels(&self) -> (&'static str, &'static str, &'static str) {
        match self {
            DecodeError::Parse(_) => ("parse", "body", ""),
            DecodeError::Unsupported(member) => ("unsupported", member, ""),
            DecodeError::UnsupportedRole { member, role } => ("unsupported_role", member, role),
            DecodeError::ServerState => ("server_state", "body", ""),
        }
    }
}

/// A role as a fixed label: the roles any of the APIs know, else `other`
/// (or `missing`).
pub(crate) fn role_label(role: Option<&str>) -> &'static str {
    match role {
        None => "missing",
        Some("system") => "system",
        Some("developer") => "developer",
        Some("user") => "user",
        Some("assistant") => "assistant",
        Some("tool") => "tool",
        Some("function") => "function",
        Some(_) => "other",
    }
}

/// Bodies [`ApiRequest::parse`] has decoded in this process.
static DECODES: AtomicU64 = AtomicU64::new(0);

/// How many request bodies [`ApiRequest::parse`] decoded in this process:
/// tests show with it that a request is decoded once, its retry included.
pub fn decodes() -> u64 {
    DECODES.load(Ordering::Relaxed)
}

impl ApiRequest {
    /// A chat request of nothing, made without an allocation, with nothing
    /// to keep when dropped: what stands in for a request moved elsewhere
    /// to be freed (`chat::worker`).
    pub(crate) fn empty() -> Self {
        Self {
            api: Api::Chat,
            creq: ChatRequest::empty(),
            engine: Vec::new(),
            raw: Vec::new(),
            map: WireMap::default(),
            keep: None,
        }
    }

    /// Parses and decodes one request body.
    pub fn parse(api: Api, bytes: impl Into<Bytes>) -> Result<Self, DecodeError> {
        Self::parse_with(api, bytes, None)
    }

    /// [`Self::parse`], estimating each decoded engine message with `rough`
    /// from the value the decode holds ([`Self::rough`]): a caller that
    /// estimates every message would otherwise parse each one again.
    pub(crate) fn parse_with(
        api: Api,
        bytes: impl Into<Bytes>,
        rough: Option<Rough>,
    ) -> Result<Self, DecodeError> {
        DECODES.fetch_add(1, Ordering::Relaxed);
        let mut creq = ChatRequest::parse_list(bytes, api.list_key())?;
        let wire = creq.take_messages();
        let map = WireMap {
            rough_fn: rough,
            ..WireMap::default()
        };
        let (engine, map, keep) = match api {
            Api::Chat => (wire, WireMap::default(), None),
            Api::Messages => anthropic::decode(&creq, wire, map)?,
            Api::Responses => responses::decode(&creq, wire, map)?,
            Api::Ollama => ollama::decode(&creq, wire, map)?,
        };
        // Hashed once here for the session key's opening memo and the
        // conversation's chain cache, which both match messages by it; a
        // decode hashed the messages it wrote (`WireMap::raw_hashes`).
        let raw = match api {
            Api::Chat => engine.iter().map(|m| raw_hash(m)).collect(),
            _ => Vec::new(),
        };
        Ok(Self {
            api,
            creq,
            engine,
            raw,
            map,
            keep,
        })
    }

    /// [`crate::request::raw_hash`] of each engine message as decoded (what
    /// [`Self::take_messages`] gives back, whatever was sent since).
    pub(crate) fn raw_hashes(&self) -> &[u64] {
        match self.api {
            Api::Chat => &self.raw,
            _ => &self.map.raw_hashes,
        }
    }

    /// The API.
    pub(crate) fn api(&self) -> Api {
        self.api
    }

    /// The engine's messages (empty after [`Self::take_messages`]).
    pub fn messages(&self) -> &[Box<RawValue>] {
        &self.engine
    }

    /// The rough estimate of each engine message, in order, when
    /// [`Self::parse_with`] made them (decoded APIs only).
    pub(crate) fn rough(&self) -> Option<&[u64]> {
        let complete =
            self.map.rough_fn.is_some() && self.map.rough.len() == self.map.engine_hashes.len();
        complete.then_some(self.map.rough.as_slice())
    }

    /// Whether the engine's messages are canonical JSON (decoded by a
    /// codec, not the client's own chat messages): their hash chain then
    /// hashes their bytes as they are (`ChainCache::chain_as`).
    pub(crate) fn canonical(&self) -> bool {
        self.api != Api::Chat
    }

    /// Moves the engine's messages out; the body stays unchanged until
    /// [`Self::with_messages`].
    pub(crate) fn take_messages(&mut self) -> Vec<Box<RawValue>> {
        std::mem::take(&mut self.engine)
    }

    /// Puts back the engine's messages [`Self::take_messages`] took.
    pub(crate) fn restore_messages(&mut self, engine: Vec<Box<RawValue>>) {
        self.engine = engine;
    }

    /// The body as the client sent it again (undoes [`Self::with_messages`]
    /// and the usage plan's edit): with [`Self::restore_messages`], the
    /// request is as parsed, ready for another preparation (the retry after
    /// an overflow error) without a second parse and decode. Free when
    /// nothing was edited.
    pub(crate) fn rewind(&mut self) {
        self.creq.rewind();
    }

    /// Raw top-level member.
    pub(crate) fn get_raw(&self, key: &str) -> Option<&RawValue> {
        self.creq.get_raw(key)
    }

    /// `tools` in chat-completions shape, for an upstream tokenizer that
    /// counts chat requests ([`tools`]); the client's own member for chat.
    pub(crate) fn chat_tools(&self) -> Option<std::borrow::Cow<'_, RawValue>> {
        let raw = self.get_raw("tools")?;
        match self.api {
            // Ollama's tools are chat completions' own.
            Api::Chat | Api::Ollama => Some(std::borrow::Cow::Borrowed(raw)),
            api => tools::chat_tools(api, raw).map(std::borrow::Cow::Owned),
        }
    }

    /// `model`, when it is a string.
    pub(crate) fn model(&self) -> Option<std::borrow::Cow<'_, str>> {
        self.creq.model()
    }

    /// Whether the reply streams: `stream == true`, or on Ollama's chat,
    /// where streaming is the default, anything but `stream == false`.
    pub(crate) fn stream(&self) -> bool {
        match self.api {
            Api::Ollama => self
                .get_raw("stream")
                .is_none_or(|r| r.get().trim() != "false"),
            _ => self.creq.stream(),
        }
    }

    /// The output reservation in this API's own field (Ollama:
    /// `options.num_predict`, when it is a positive count).
    pub(crate) fn max_output_tokens(&self) -> Option<u64> {
        let key = match self.api {
            Api::Chat => return self.creq.max_output_tokens(),
            Api::Ollama => return self.option("num_predict"),
            Api::Messages => "max_tokens",
            Api::Responses => "max_output_tokens",
        };
        self.get_raw(key)
            .and_then(|r| serde_json::from_str::<u64>(r.get()).ok())
    }

    /// The context window the request itself sets: Ollama's
    /// `options.num_ctx`, which Ollama loads the model with (its
    /// OpenAI-compatible routes ignore it).
    pub(crate) fn requested_window(&self) -> Option<u64> {
        match self.api {
            Api::Ollama => self.option("num_ctx"),
            _ => None,
        }
    }

    /// A positive count in Ollama's `options`.
    fn option(&self, key: &str) -> Option<u64> {
        #[derive(serde::Deserialize)]
        struct Options {
            num_ctx: Option<f64>,
            num_predict: Option<f64>,
        }
        let o: Options = serde_json::from_str(self.get_raw("options")?.get()).ok()?;
        let n = match key {
            "num_ctx" => o.num_ctx,
            _ => o.num_predict,
        };
        // -1 (no limit) and -2 (fill the context) reserve nothing certain.
        n.filter(|n| *n >= 1.0 && n.is_finite()).map(|n| n as u64)
    }

    /// A session id the body carries: `session_id` (chat), Claude Code's
    /// `metadata.user_id` (its `session_id` when it is a JSON string of one).
    pub(crate) fn session_id(&self) -> Option<String> {
        match self.api {
            Api::Chat => self.creq.session_id(),
            Api::Messages => anthropic::metadata_session(self.get_raw("metadata")?),
            Api::Responses | Api::Ollama => None,
        }
    }

    /// Body `prompt_cache_key` (chat and Responses).
    pub(crate) fn prompt_cache_key(&self) -> Option<String> {
        match self.api {
            Api::Messages | Api::Ollama => None,
            _ => self.creq.prompt_cache_key(),
        }
    }

    /// The chat-completions view underneath (usage planning).
    pub(crate) fn chat_mut(&mut self) -> Option<&mut ChatRequest> {
        (self.api == Api::Chat).then_some(&mut self.creq)
    }

    /// Sends `outgoing` (engine messages) instead of the client's
    /// conversation: the list member becomes their wire form, and the
    /// system member changes only when the engine changed the system
    /// message.
    pub(crate) fn with_messages(&mut self, outgoing: Vec<Box<RawValue>>) {
        let (system, wire) = match self.api {
            Api::Chat => {
                self.creq.with_messages(outgoing);
                return;
            }
            Api::Messages => anthropic::encode(&self.map, &outgoing),
            Api::Responses => responses::encode(&self.map, &outgoing),
            Api::Ollama => {
                let wire = ollama::encode(&self.map, &outgoing);
                self.creq.with_messages(wire);
                return;
            }
        };
        if let (Some(raw), Some(key)) = (system, self.api.system_key()) {
            self.creq.set_member(key, raw);
        }
        self.creq.with_messages(wire);
    }

    /// How many of the client's wire messages the first `k` engine
    /// messages of its conversation stand for (a system member is not a
    /// wire message).
    pub(crate) fn wire_count(&self, k: usize) -> usize {
        if self.api == Api::Chat {
            return k;
        }
        self.map
            .groups
            .iter()
            .take_while(|g| g.engine.end <= k)
            .last()
            .map_or(0, |g| g.wire.end)
    }

    /// The body to send.
    pub(crate) fn to_bytes(&self) -> Bytes {
        self.creq.to_bytes()
    }
}

/// The role of an engine message, or `""`.
fn role(m: &Value) -> &str {
    m.get("role").and_then(Value::as_str).unwrap_or("")
}

fn to_raw(v: &Value) -> Option<Box<RawValue>> {
    serde_json::value::to_raw_value(v).ok()
}

#[cfg(test)]
mod tests;
