//! Session keys: which conversation a request belongs to.
//!
//! Key = hash(credential fingerprint ‖ session id ‖ instructions). The
//! credential is only ever hashed (with a per-process secret, so a key seen
//! in a response header cannot be used to test guesses of an API key) and
//! never stored. The session id comes from the first configured header
//! present, then the body (`session_id`, `prompt_cache_key`), then a
//! fingerprint of the conversation's opening (model + first system/developer
//! message + first other message), which later turns repeat verbatim.
//!
//! An explicit id is joined by the first system/developer message: an
//! agent's sub-agent or memory pass (qwen-code's sends the agent's own
//! `prompt_cache_key` with another system prompt and other tools) is another
//! conversation, with its own fixed part, trigger and calibration, not one
//! whose trigger flips between the two fixed parts every request.

use std::borrow::Cow;
use std::fmt;
use std::hash::{BuildHasher, Hasher};
use std::sync::{Arc, Mutex};

use http::header::{HeaderMap, HeaderName};
use serde::Deserialize;
use serde_json::value::RawValue;
use xxhash_rust::xxh3::Xxh3;

use crate::request::{message_hash, raw_hash, ChatRequest};
use crate::sync::lock;

/// The default header list, in precedence order. `a+b` means: header `a`,
/// combined with header `b` when that is present too (Claude Code subagents
/// share the parent's session id and add an agent id).
pub const DEFAULT_SESSION_HEADERS: &[&str] = &[
    "x-session-id",
    "x-claude-code-session-id+x-claude-code-agent-id",
    "session-id",
    "thread-id",
    "x-session-affinity",
    "x-opencode-session",
];

/// Headers whose values identify the client's credential: bearer tokens,
/// Azure's `api-key`, Anthropic-style `x-api-key` and Google's
/// `x-goog-api-key`.
const CREDENTIAL_HEADERS: [HeaderName; 4] = [
    http::header::AUTHORIZATION,
    HeaderName::from_static("api-key"),
    HeaderName::from_static("x-api-key"),
    HeaderName::from_static("x-goog-api-key"),
];

/// Query parameters whose values identify the client's credential
/// (Google's `?key=`, and the spellings some gateways accept). Matched
/// after percent-decoding the name, so `?k%65y=` counts too.
const CREDENTIAL_PARAMS: [&[u8]; 4] = [b"key", b"api-key", b"api_key", b"access_token"];

/// Percent-decodes a query parameter name (`+` is a space in form
/// encoding). A malformed escape is kept as written.
fn decode_param_name(raw: &[u8]) -> Cow<'_, [u8]> {
    if !raw.iter().any(|b| matches!(b, b'%' | b'+')) {
        return Cow::Borrowed(raw);
    }
    let hex = |b: u8| (b as char).to_digit(16).map(|d| d as u8);
    let mut out = Vec::with_capacity(raw.len());
    let mut i = 0;
    while i < raw.len() {
        match raw[i] {
            b'%' => match (
                raw.get(i + 1).copied().and_then(hex),
                raw.get(i + 2).copied().and_then(hex),
            ) {
                (Some(h), Some(l)) => {
                    out.push(h << 4 | l);
                    i += 3;
                    continue;
                }
                _ => out.push(b'%'),
            },
            b'+' => out.push(b' '),
            b => out.push(b),
        }
        i += 1;
    }
    Cow::Owned(out)
}

/// The credential-bearing parameters of a query string, in order, as
/// (decoded name, raw value). Values are compared as written: two
/// spellings of one key only get two scopes, never one scope for two keys.
fn credential_params(query: &str) -> impl Iterator<Item = (Cow<'_, [u8]>, &[u8])> {
    query.as_bytes().split(|&b| b == b'&').filter_map(|pair| {
        let (name, value) = match pair.iter().position(|&b| b == b'=') {
            Some(eq) => (&pair[..eq], &pair[eq + 1..]),
            None => (pair, &b""[..]),
        };
        let name = decode_param_name(name);
        CREDENTIAL_PARAMS.contains(&&*name).then_some((name, value))
    })
}

/// The credential parameters of a client's query (`key=…` and the like),
/// each pair as the client wrote it, joined by `&`: what a side call made
/// for the client (summary, token count) presents, so an upstream that
/// authenticates by `?key=` accepts it as it accepts the client. `None`
/// when the query carries none.
pub(crate) fn credential_query(query: &str) -> Option<String> {
    let pairs: Vec<&str> = query
        .split('&')
        .filter(|pair| {
            let name = pair.split_once('=').map_or(*pair, |(n, _)| n);
            CREDENTIAL_PARAMS.contains(&&*decode_param_name(name.as_bytes()))
        })
        .collect();
    (!pairs.is_empty()).then(|| pairs.join("&"))
}

/// [`credential_query`] of a request URI, shared by the side calls of
/// one request.
pub(crate) fn credential_query_of(uri: &http::Uri) -> Option<Arc<str>> {
    uri.query().and_then(credential_query).map(Arc::from)
}

/// Only the credential headers of `h` (what window discovery presents).
pub(crate) fn credential_headers(h: &HeaderMap) -> HeaderMap {
    let mut out = HeaderMap::new();
    for name in &CREDENTIAL_HEADERS {
        for v in h.get_all(name) {
            out.append(name.clone(), v.clone());
        }
    }
    out
}

/// Which of `names` (the first 64) `headers` holds: bit `i` for the
/// `i`th. A request carries a handful of fields and few of the credential
/// and session headers looked for: one look at its names costs less than
/// a hashed lookup for each name (ten of them by default, ~1,500
/// instructions a request).
fn present<'a>(
    headers: &HeaderMap,
    names: impl IntoIterator<Item = &'a HeaderName> + Clone,
) -> u64 {
    let mut held = 0u64;
    for key in headers.keys() {
        for (i, name) in names.clone().into_iter().take(64).enumerate() {
            if name == key {
                held |= 1 << i;
            }
        }
    }
    held
}

/// Opaque session key (printed as 32 hex digits).
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SessionKey(u128);

impl SessionKey {
    /// The raw value.
    pub(crate) fn as_u128(self) -> u128 {
        self.0
    }

    /// Builds a key from its raw value (tests, lookups).
    pub fn from_u128(v: u128) -> Self {
        Self(v)
    }

    /// Parses the 32-hex-digit form (as in `x-compactor-session`).
    pub(crate) fn parse_hex(s: &str) -> Option<Self> {
        if s.len() != 32 {
            return None;
        }
        u128::from_str_radix(s, 16).ok().map(Self)
    }

    /// The 32-hex-digit form as ASCII: what [`fmt::Display`] prints, without
    /// the formatting machinery (a response header on every request).
    pub(crate) fn hex(self) -> [u8; 32] {
        const DIGITS: &[u8; 16] = b"0123456789abcdef";
        let mut out = [0u8; 32];
        for (i, b) in out.iter_mut().enumerate() {
            let nibble = (self.0 >> (124 - 4 * i)) & 0xf;
            *b = DIGITS[nibble as usize];
        }
        out
    }
}

impl fmt::Display for SessionKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:032x}", self.0)
    }
}

impl fmt::Debug for SessionKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "SessionKey({self})")
    }
}

/// Hash of the client's credential headers (never the credential itself).
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub(crate) struct CredentialFingerprint(u128);

impl CredentialFingerprint {
    /// The raw value (for scoping other stores, e.g. compaction records).
    pub(crate) fn as_u128(self) -> u128 {
        self.0
    }
}

/// Where the session id came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SessionSource {
    /// A configured header (its name; `a+b` when combined).
    Header(String),
    /// Body `session_id`.
    BodySessionId,
    /// Body `prompt_cache_key`.
    BodyPromptCacheKey,
    /// Fingerprint of model + first system message + first other message.
    Fingerprint,
}

impl SessionSource {
    /// Short label for metrics and logs.
    pub(crate) fn label(&self) -> &'static str {
        match self {
            Self::Header(_) => "header",
            Self::BodySessionId => "body_session_id",
            Self::BodyPromptCacheKey => "body_prompt_cache_key",
            Self::Fingerprint => "fingerprint",
        }
    }
}

/// A configured header entry is not a valid header name.
#[derive(Debug, thiserror::Error)]
#[error("invalid session header name `{0}`")]
pub struct KeyConfigError(pub(crate) String);

/// One header entry of the configured list.
#[derive(Debug, Clone)]
pub(crate) struct HeaderRule {
    /// The header carrying the id.
    pub(crate) name: HeaderName,
    /// Appended to the id when present (`name+combine_with`).
    pub(crate) combine_with: Option<HeaderName>,
}

impl HeaderRule {
    /// Parses `name` or `name+other`.
    pub(crate) fn parse(spec: &str) -> Result<Self, KeyConfigError> {
        let bad = || KeyConfigError(spec.to_owned());
        let (a, b) = match spec.split_once('+') {
            Some((a, b)) => (a, Some(b)),
            None => (spec, None),
        };
        let name = HeaderName::from_bytes(a.trim().as_bytes()).map_err(|_| bad())?;
        let combine_with = b
            .map(|b| HeaderName::from_bytes(b.trim().as_bytes()).map_err(|_| bad()))
            .transpose()?;
        Ok(Self { name, combine_with })
    }

    fn label(&self) -> String {
        match &self.combine_with {
            Some(c) => format!("{}+{}", self.name, c),
            None => self.name.to_string(),
        }
    }
}

/// Derives session keys; holds the configured header list and the
/// per-process secret.
#[derive(Debug, Clone)]
pub struct SessionKeyer {
    rules: Vec<HeaderRule>,
    secret: u64,
    openings: Arc<OpeningMemo>,
}

// Domain tags keep ids from different kinds of source apart.
const TAG_EXPLICIT: u8 = 1;
const TAG_FINGERPRINT: u8 = 2;

impl SessionKeyer {
    /// Keyer for `headers` (see [`DEFAULT_SESSION_HEADERS`]) with a random
    /// per-process secret.
    pub(crate) fn new<S: AsRef<str>>(headers: &[S]) -> Result<Self, KeyConfigError> {
        let secret = std::collections::hash_map::RandomState::new()
            .build_hasher()
            .finish();
        Self::with_secret(headers, secret)
    }

    /// Keyer with a fixed secret (tests; keys are then reproducible).
    pub fn with_secret<S: AsRef<str>>(headers: &[S], secret: u64) -> Result<Self, KeyConfigError> {
        let rules = headers
            .iter()
            .map(|h| HeaderRule::parse(h.as_ref()))
            .collect::<Result<_, _>>()?;
        Ok(Self {
            rules,
            secret,
            openings: Arc::default(),
        })
    }

    /// Fingerprint of the credential headers present (`Authorization`,
    /// `api-key`, `x-api-key`, `x-goog-api-key`). Requests without any share
    /// one fingerprint. See [`Self::credential_of`] for the query too.
    pub(crate) fn credential(&self, headers: &HeaderMap) -> CredentialFingerprint {
        self.credential_of(headers, None)
    }

    /// Fingerprint of every credential a request carries: the credential
    /// headers and the credential query parameters of `query` (`?key=` and
    /// the like, see [`CREDENTIAL_PARAMS`]). Each part is tagged with its
    /// source and name and length-prefixed, so no two different sets of
    /// credentials hash the same input.
    pub(crate) fn credential_of(
        &self,
        headers: &HeaderMap,
        query: Option<&str>,
    ) -> CredentialFingerprint {
        let mut h = Xxh3::with_seed(self.secret);
        h.update(b"compactor-credential");
        let mut part = |tag: u8, name: &[u8], value: &[u8]| {
            h.update(&[tag]);
            h.update(&(name.len() as u64).to_le_bytes());
            h.update(name);
            h.update(&(value.len() as u64).to_le_bytes());
            h.update(value);
        };
        let held = present(headers, &CREDENTIAL_HEADERS);
        for (i, name) in CREDENTIAL_HEADERS.iter().enumerate() {
            if held & (1 << i) == 0 {
                continue;
            }
            for v in headers.get_all(name) {
                part(b'h', name.as_str().as_bytes(), v.as_bytes());
            }
        }
        for (name, value) in query.into_iter().flat_map(credential_params) {
            part(b'q', &name, value);
        }
        CredentialFingerprint(h.digest128())
    }

    /// The session key of a parsed request, from its headers alone (see
    /// [`Self::derive_with_credential`] for the whole request).
    pub fn derive(&self, headers: &HeaderMap, req: &ChatRequest) -> (SessionKey, SessionSource) {
        let cred = self.credential(headers);
        self.derive_in(cred, headers, req)
    }

    /// The session key of a request (headers, and the query of `uri` for
    /// credentials sent as parameters), also giving the credential
    /// fingerprint it hashed in (the caller needs both; the credentials are
    /// then hashed once).
    // Only tests derive with a credential given apart from the headers.
    #[cfg(test)]
    pub(crate) fn derive_with_credential(
        &self,
        headers: &HeaderMap,
        uri: &http::Uri,
        req: &ChatRequest,
    ) -> (SessionKey, SessionSource, CredentialFingerprint) {
        let cred = self.credential_of(headers, uri.query());
        let (key, source) = self.derive_in(cred, headers, req);
        (key, source, cred)
    }

    /// The session key of a request of any API, from what its codec read
    /// (see [`Self::derive_with_credential`]).
    pub(crate) fn derive_hints(
        &self,
        headers: &HeaderMap,
        uri: &http::Uri,
        hints: &SessionHints<'_>,
    ) -> (SessionKey, SessionSource, CredentialFingerprint) {
        let cred = self.credential_of(headers, uri.query());
        let (key, source) = self.derive_for(
            cred,
            headers,
            hints.session_id,
            hints.prompt_cache_key,
            hints.model,
            (hints.messages, hints.raw_hashes),
        );
        (key, source, cred)
    }

    /// The session key of `req` within credential scope `cred`.
    fn derive_in(
        &self,
        cred: CredentialFingerprint,
        headers: &HeaderMap,
        req: &ChatRequest,
    ) -> (SessionKey, SessionSource) {
        self.derive_for(
            cred,
            headers,
            req.session_id().as_deref(),
            req.prompt_cache_key().as_deref(),
            req.model().as_deref(),
            (req.messages(), None),
        )
    }

    /// The session key from its ingredients.
    fn derive_for(
        &self,
        cred: CredentialFingerprint,
        headers: &HeaderMap,
        body_session_id: Option<&str>,
        prompt_cache_key: Option<&str>,
        model: Option<&str>,
        (messages, raw): (&[Box<RawValue>], Option<&[u64]>),
    ) -> (SessionKey, SessionSource) {
        let held = present(headers, self.rules.iter().map(|r| &r.name));
        let instructions = || {
            let (system, _) = self.openings.opening(messages, raw);
            system.unwrap_or(0).to_le_bytes()
        };
        for (i, rule) in self.rules.iter().enumerate() {
            if i < 64 && held & (1 << i) == 0 {
                continue;
            }
            let Some(v) = headers.get(&rule.name).filter(|v| !v.is_empty()) else {
                continue;
            };
            // Two parts, each length-prefixed by `key`: session `s:a` alone
            // and session `s` with agent `a` are two conversations.
            let extra = rule
                .combine_with
                .as_ref()
                .and_then(|c| headers.get(c))
                .filter(|v| !v.is_empty());
            let sys_h = instructions();
            let key = match extra {
                Some(extra) => self.key(
                    cred,
                    TAG_EXPLICIT,
                    &[v.as_bytes(), extra.as_bytes(), &sys_h],
                ),
                None => self.key(cred, TAG_EXPLICIT, &[v.as_bytes(), &sys_h]),
            };
            return (key, SessionSource::Header(rule.label()));
        }
        if let Some(id) = body_session_id.filter(|s| !s.is_empty()) {
            return (
                self.key(cred, TAG_EXPLICIT, &[id.as_bytes(), &instructions()]),
                SessionSource::BodySessionId,
            );
        }
        if let Some(id) = prompt_cache_key.filter(|s| !s.is_empty()) {
            return (
                self.key(cred, TAG_EXPLICIT, &[id.as_bytes(), &instructions()]),
                SessionSource::BodyPromptCacheKey,
            );
        }
        let (system, first) = self.openings.opening(messages, raw);
        let sys_h = system.unwrap_or(0).to_le_bytes();
        let first_h = first.unwrap_or(0).to_le_bytes();
        let model = model.unwrap_or("").as_bytes();
        (
            self.key(cred, TAG_FINGERPRINT, &[model, &sys_h, &first_h]),
            SessionSource::Fingerprint,
        )
    }

    fn key(&self, cred: CredentialFingerprint, tag: u8, parts: &[&[u8]]) -> SessionKey {
        let mut h = Xxh3::with_seed(self.secret);
        h.update(&cred.0.to_le_bytes());
        h.update(&[tag]);
        for p in parts {
            // Length prefixes make the concatenation unambiguous.
            h.update(&(p.len() as u64).to_le_bytes());
            h.update(p);
        }
        SessionKey(h.digest128())
    }
}

/// What a request body says about its session, whatever its API.
#[derive(Debug, Clone, Copy)]
pub(crate) struct SessionHints<'a> {
    /// A body session id (chat `session_id`, Claude Code's
    /// `metadata.user_id`).
    pub(crate) session_id: Option<&'a str>,
    /// Body `prompt_cache_key`.
    pub(crate) prompt_cache_key: Option<&'a str>,
    /// `model`.
    pub(crate) model: Option<&'a str>,
    /// The conversation as the engine sees it (system message first).
    pub(crate) messages: &'a [Box<RawValue>],
    /// [`crate::request::raw_hash`] of each of `messages`, when made.
    pub(crate) raw_hashes: Option<&'a [u64]>,
}

#[derive(Deserialize)]
struct RoleOnly<'a> {
    #[serde(default, borrow)]
    role: Option<Cow<'a, str>>,
}

/// What the fingerprint takes from one message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Opening {
    /// `system` or `developer`.
    is_system: bool,
    /// [`message_hash`]: canonical, so reformatting clients keep their key.
    hash: u128,
}

impl Opening {
    fn of(m: &RawValue) -> Self {
        let role = serde_json::from_str::<RoleOnly<'_>>(m.get())
            .ok()
            .and_then(|r| r.role);
        Self {
            is_system: matches!(role.as_deref(), Some("system" | "developer")),
            hash: message_hash(m),
        }
    }
}

/// Slots in [`OpeningMemo`] (a power of two).
const OPENING_SLOTS: usize = 1024;

/// Direct-mapped memo of [`Opening::of`], keyed by a hash of the message's
/// raw bytes. Every turn of a conversation repeats its opening verbatim, and
/// an agent's system prompt (tool manuals, rules) often runs to tens of KB:
/// parsing it into a `Value` for the canonical hash on every request costs
/// far more than hashing its bytes. Bounded by construction; a slot shared
/// by two openings only costs the parse again.
struct OpeningMemo {
    slots: Box<[Mutex<Option<Memoised>>]>,
}

/// A raw-bytes hash and what it was found to describe.
type Memoised = (u64, Opening);

impl Default for OpeningMemo {
    fn default() -> Self {
        Self {
            slots: (0..OPENING_SLOTS).map(|_| Mutex::new(None)).collect(),
        }
    }
}

impl fmt::Debug for OpeningMemo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("OpeningMemo")
            .field("slots", &self.slots.len())
            .finish()
    }
}

impl OpeningMemo {
    /// What `m` (whose [`raw_hash`] is `raw`, when made) describes.
    fn describe(&self, m: &RawValue, raw: Option<u64>) -> Opening {
        let raw = raw.unwrap_or_else(|| raw_hash(m));
        let slot = &self.slots[(raw as usize) & (OPENING_SLOTS - 1)];
        if let Some((seen, opening)) = *lock(slot) {
            if seen == raw {
                return opening;
            }
        }
        let opening = Opening::of(m);
        *lock(slot) = Some((raw, opening));
        opening
    }

    /// Canonical hashes of the first system/developer message and of the
    /// first other message.
    fn opening(
        &self,
        messages: &[Box<RawValue>],
        raw: Option<&[u64]>,
    ) -> (Option<u128>, Option<u128>) {
        let raw = raw.filter(|r| r.len() == messages.len());
        let mut system = None;
        let mut first = None;
        for (i, m) in messages.iter().enumerate() {
            let o = self.describe(m, raw.map(|r| r[i]));
            if o.is_system && system.is_none() {
                system = Some(o.hash);
            } else if !o.is_system && first.is_none() {
                first = Some(o.hash);
            }
            if system.is_some() && first.is_some() {
                break;
            }
        }
        (system, first)
    }
}

#[cfg(test)]
mod tests;
