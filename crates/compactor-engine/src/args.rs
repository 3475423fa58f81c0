//! JSON-aware shrinking of large tool-call arguments.
//!
//! Slicing the raw argument string produced invalid JSON, and strict
//! providers then rejected every later turn with a non-retryable 400.
//! Here the arguments are parsed, long string leaves are shortened,
//! and the result is re-serialised with the original key order, so the output
//! is valid JSON whenever the input was.

use indexmap::IndexMap;
use serde::de::{Deserialize, Deserializer, MapAccess, SeqAccess, Visitor};
use serde::ser::{Serialize, SerializeMap, SerializeSeq, Serializer};
use std::fmt;

/// Default maximum characters kept of a string leaf.
pub(super) const DEFAULT_MAX_LEAF_CHARS: usize = 200;

/// Suffix every shortened leaf ends with. The head of the marker is loud and
/// clearly not prose: models imitated a bare `...[truncated]` in new tool
/// calls and wrote it to disk. The tail keeps the common
/// `...[truncated]` ending that downstream checks recognise.
pub(super) const TRUNCATION_TAG: &str = "...[truncated]";

/// The marker appended to a shortened leaf.
pub(crate) fn truncation_marker(omitted: usize, original: usize) -> String {
    format!(
        " [compactor: {omitted} of {original} chars omitted here; not part of the original call, never reproduce]{TRUNCATION_TAG}"
    )
}

/// A JSON value that keeps object key order (serde_json's `Value` sorts keys
/// without its `preserve_order` feature, which would reorder arguments).
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum OrderedJson {
    /// `null`
    Null,
    /// `true` / `false`
    Bool(bool),
    /// Any number, kept exactly.
    Number(serde_json::Number),
    /// A string.
    String(String),
    /// An array.
    Array(Vec<OrderedJson>),
    /// An object in source order.
    Object(IndexMap<String, OrderedJson>),
}

impl OrderedJson {
    /// Parses JSON text, keeping key order.
    pub(crate) fn parse(text: &str) -> Result<Self, serde_json::Error> {
        serde_json::from_str(text)
    }

    /// Compact JSON text with non-ASCII kept as is.
    pub(crate) fn to_json(&self) -> String {
        serde_json::to_string(self).unwrap_or_default()
    }

    /// The string inside, if this is a string.
    pub(crate) fn as_str(&self) -> Option<&str> {
        match self {
            OrderedJson::String(s) => Some(s),
            _ => None,
        }
    }

    /// Plain-text rendering for summaries: strings bare, the rest as JSON.
    pub(crate) fn to_plain(&self) -> String {
        match self {
            OrderedJson::String(s) => s.clone(),
            other => other.to_json(),
        }
    }
}

impl Serialize for OrderedJson {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            OrderedJson::Null => s.serialize_unit(),
            OrderedJson::Bool(b) => s.serialize_bool(*b),
            OrderedJson::Number(n) => n.serialize(s),
            OrderedJson::String(v) => s.serialize_str(v),
            OrderedJson::Array(a) => {
                let mut seq = s.serialize_seq(Some(a.len()))?;
                for x in a {
                    seq.serialize_element(x)?;
                }
                seq.end()
            }
            OrderedJson::Object(o) => {
                let mut map = s.serialize_map(Some(o.len()))?;
                for (k, v) in o {
                    map.serialize_entry(k, v)?;
                }
                map.end()
            }
        }
    }
}

struct OrderedVisitor;

impl<'de> Visitor<'de> for OrderedVisitor {
    type Value = OrderedJson;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("any JSON value")
    }
    fn visit_unit<E>(self) -> Result<OrderedJson, E> {
        Ok(OrderedJson::Null)
    }
    fn visit_none<E>(self) -> Result<OrderedJson, E> {
        Ok(OrderedJson::Null)
    }
    fn visit_bool<E>(self, b: bool) -> Result<OrderedJson, E> {
        Ok(OrderedJson::Bool(b))
    }
    fn visit_i64<E>(self, v: i64) -> Result<OrderedJson, E> {
        Ok(OrderedJson::Number(v.into()))
    }
    fn visit_u64<E>(self, v: u64) -> Result<OrderedJson, E> {
        Ok(OrderedJson::Number(v.into()))
    }
    fn visit_f64<E>(self, v: f64) -> Result<OrderedJson, E> {
        Ok(serde_json::Number::from_f64(v).map_or(OrderedJson::Null, OrderedJson::Number))
    }
    fn visit_str<E>(self, v: &str) -> Result<OrderedJson, E> {
        Ok(OrderedJson::String(v.to_string()))
    }
    fn visit_string<E>(self, v: String) -> Result<OrderedJson, E> {
        Ok(OrderedJson::String(v))
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<OrderedJson, A::Error> {
        let mut out = Vec::with_capacity(seq.size_hint().unwrap_or(0));
        while let Some(x) = seq.next_element()? {
            out.push(x);
        }
        Ok(OrderedJson::Array(out))
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<OrderedJson, A::Error> {
        let mut out = IndexMap::with_capacity(map.size_hint().unwrap_or(0));
        while let Some((k, v)) = map.next_entry::<String, OrderedJson>()? {
            out.insert(k, v);
        }
        Ok(OrderedJson::Object(out))
    }
}

impl<'de> Deserialize<'de> for OrderedJson {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(OrderedVisitor)
    }
}

/// Shortens every string leaf longer than `max_leaf` characters in place;
/// returns whether anything changed. A leaf that already carries the
/// truncation tag is left alone, and a leaf is replaced only if that saves
/// bytes.
fn shrink_leaves(v: &mut OrderedJson, max_leaf: usize) -> bool {
    match v {
        OrderedJson::String(s) => {
            if s.ends_with(TRUNCATION_TAG) {
                return false;
            }
            let chars = s.chars().count();
            if chars <= max_leaf {
                return false;
            }
            let head_end = s.char_indices().nth(max_leaf).map_or(s.len(), |(i, _)| i);
            let mut out = String::with_capacity(head_end + 120);
            out.push_str(&s[..head_end]);
            out.push_str(&truncation_marker(chars - max_leaf, chars));
            if out.len() < s.len() {
                *s = out;
                true
            } else {
                false
            }
        }
        OrderedJson::Array(a) => a
            .iter_mut()
            .fold(false, |acc, x| shrink_leaves(x, max_leaf) | acc),
        OrderedJson::Object(o) => o
            .values_mut()
            .fold(false, |acc, x| shrink_leaves(x, max_leaf) | acc),
        _ => false,
    }
}

/// Shrinks the string leaves of a tool call's JSON arguments to `max_leaf`
/// characters plus a marker ending in [`TRUNCATION_TAG`]. Non-string leaves,
/// key order and short strings are untouched; non-ASCII is kept as is. When
/// the arguments are not JSON, nothing shrinks, or the result would not be
/// shorter, the original string comes back byte for byte (so unchanged
/// messages stay byte-stable for prompt caches).
pub(super) fn truncate_tool_call_args_json(args: &str, max_leaf: usize) -> String {
    let Ok(mut parsed) = OrderedJson::parse(args) else {
        return args.to_string();
    };
    if !shrink_leaves(&mut parsed, max_leaf) {
        return args.to_string();
    }
    let out = parsed.to_json();
    if out.is_empty() || out.len() >= args.len() {
        return args.to_string();
    }
    out
}

#[cfg(test)]
mod tests;
