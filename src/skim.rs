//! A validating skim of a JSON object: where each top-level member's value
//! sits, and the elements of one array member, without building anything.
//!
//! serde_json reads a string a byte at a time (eight with its SWAR step),
//! about 2.6 instructions a byte of message text: parsing a 25 KB agent
//! turn into raw messages was half of compactor's instructions for it. Here
//! a string's end is found with `memchr2` and its text checked for control
//! characters in a loop the compiler vectorises, and the body's UTF-8 is
//! checked once, by the standard library, before.
//!
//! It accepts a subset of what serde_json accepts, with the same spans: the
//! caller parses with serde_json whenever [`each_member`] returns `None` (a
//! syntax error, a key written with an escape, a key the caller refuses as
//! repeated, a list member that is not an array), so errors are still
//! serde_json's own, worded as before.
//! What both accept is the grammar serde_json's `ignore_value` checks, which
//! `tests::agrees_with_serde_json` holds it to.

use std::ops::Range;

use serde::de::{self, DeserializeSeed, Deserializer, MapAccess, Visitor};
use serde_json::value::RawValue;

/// Skims `text` as one JSON object (surrounding whitespace allowed), each
/// member handed to `each` in body order: its key (as written: none has an
/// escape) and its value's byte range. With `list`, the member of that name
/// must be an array, and its elements are returned. `None` when serde_json
/// has to decide (see the module docs), or when `each` returns `None`.
///
/// No list of the members is kept (it cost each skim an allocation): the
/// caller refuses a repeated key where serde_json would (returning `None`),
/// and drops what it was handed when the skim ends in `None` (text after
/// it was invalid).
pub(crate) fn each_member<'a>(
    text: &'a str,
    list: Option<&str>,
    mut each: impl FnMut(&'a str, Range<usize>) -> Option<()>,
) -> Option<Option<Vec<Range<usize>>>> {
    let body = text.as_bytes();
    let mut s = Scan {
        b: body,
        i: 0,
        stack: Open::default(),
    };
    let mut elements = None;
    s.ws();
    s.eat(b'{')?;
    s.ws();
    if s.peek()? == b'}' {
        s.i += 1;
    } else {
        loop {
            let key_start = s.i + 1;
            if s.peek()? != b'"' || s.string()? {
                return None;
            }
            // From the valid text: a key without escapes is its bytes.
            let key = text.get(key_start..s.i - 1)?;
            s.ws();
            s.eat(b':')?;
            s.ws();
            let start = s.i;
            if Some(key) == list {
                elements = Some(s.array()?);
            } else {
                s.value()?;
            }
            each(key, start..s.i)?;
            s.ws();
            match s.peek()? {
                b',' => {
                    s.i += 1;
                    s.ws();
                }
                b'}' => {
                    s.i += 1;
                    break;
                }
                _ => return None,
            }
        }
    }
    s.ws();
    (s.i == body.len()).then_some(elements)
}

/// `json` as a raw value without parsing it again. Only for text
/// [`each_member`] skimmed (a member's or an element's range), which is
/// valid JSON.
///
/// serde_json checks a raw value it builds from a string by parsing it;
/// its own deserializers hand one over through a private newtype protocol
/// (the `$serde_json::private::RawValue` token), which this speaks. Should a
/// serde_json release change the protocol, this returns `None` and the
/// caller parses as before (`tests::trusted_raw_values_are_built` fails
/// first).
pub(crate) fn raw(json: &str) -> Option<&RawValue> {
    <&RawValue as de::Deserialize>::deserialize(Trusted(json)).ok()
}

/// [`raw`], owned.
pub(crate) fn raw_boxed(json: &str) -> Option<Box<RawValue>> {
    <Box<RawValue> as de::Deserialize>::deserialize(Trusted(json)).ok()
}

const RAW_VALUE_TOKEN: &str = "$serde_json::private::RawValue";

struct Trusted<'de>(&'de str);

impl<'de> Deserializer<'de> for Trusted<'de> {
    type Error = de::value::Error;

    fn deserialize_newtype_struct<V: Visitor<'de>>(
        self,
        name: &'static str,
        visitor: V,
    ) -> Result<V::Value, Self::Error> {
        if name != RAW_VALUE_TOKEN {
            return Err(de::Error::custom("not a raw value"));
        }
        visitor.visit_map(OneEntry(Some(self.0)))
    }

    fn deserialize_any<V: Visitor<'de>>(self, _visitor: V) -> Result<V::Value, Self::Error> {
        Err(de::Error::custom("not a raw value"))
    }

    serde::forward_to_deserialize_any! {
        bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string
        bytes byte_buf option unit unit_struct seq tuple
        tuple_struct map struct enum identifier ignored_any
    }
}

/// The map of one entry serde_json's raw value visitors read: the token as
/// the key, the JSON text as the value.
struct OneEntry<'de>(Option<&'de str>);

impl<'de> MapAccess<'de> for OneEntry<'de> {
    type Error = de::value::Error;

    fn next_key_seed<K: DeserializeSeed<'de>>(
        &mut self,
        seed: K,
    ) -> Result<Option<K::Value>, Self::Error> {
        if self.0.is_none() {
            return Ok(None);
        }
        seed.deserialize(de::value::BorrowedStrDeserializer::new(RAW_VALUE_TOKEN))
            .map(Some)
    }

    fn next_value_seed<V: DeserializeSeed<'de>>(
        &mut self,
        seed: V,
    ) -> Result<V::Value, Self::Error> {
        let json = self
            .0
            .take()
            .ok_or_else(|| de::Error::custom("no raw value"))?;
        seed.deserialize(de::value::BorrowedStrDeserializer::new(json))
    }
}

/// A position in the body and the containers open around it.
struct Scan<'a> {
    b: &'a [u8],
    i: usize,
    stack: Open,
}

/// The containers open around a position, innermost last: the first 64 as
/// bits of a word (a set bit an object), deeper ones in a vector. A reply
/// or a request nests a few levels; a vector of bytes cost each skim an
/// allocation.
#[derive(Default)]
struct Open {
    bits: u64,
    depth: usize,
    deeper: Vec<u8>,
}

impl Open {
    fn len(&self) -> usize {
        self.depth
    }

    fn push(&mut self, open: u8) {
        if self.depth < 64 {
            let bit = 1u64 << self.depth;
            if open == b'{' {
                self.bits |= bit;
            } else {
                self.bits &= !bit;
            }
        } else {
            self.deeper.push(open);
        }
        self.depth += 1;
    }

    fn last(&self) -> Option<u8> {
        let top = self.depth.checked_sub(1)?;
        if top < 64 {
            Some(if self.bits >> top & 1 == 1 {
                b'{'
            } else {
                b'['
            })
        } else {
            self.deeper.last().copied()
        }
    }

    fn pop(&mut self) {
        if self.depth > 64 {
            self.deeper.pop();
        }
        self.depth = self.depth.saturating_sub(1);
    }
}

impl Scan<'_> {
    fn peek(&self) -> Option<u8> {
        self.b.get(self.i).copied()
    }

    fn eat(&mut self, c: u8) -> Option<()> {
        (self.peek()? == c).then(|| self.i += 1)
    }

    fn ws(&mut self) {
        while let Some(b' ' | b'\n' | b'\t' | b'\r') = self.peek() {
            self.i += 1;
        }
    }

    /// A string from its opening quote; whether it holds an escape.
    ///
    /// Most strings of a request or a reply (keys, roles, ids, short
    /// values) end within 16 bytes with nothing to unescape: those are
    /// found here, inline in the caller, and the rest (longer text,
    /// escapes, errors) by [`Self::long_string`], whose set-up (six saved
    /// registers, `memchr2`) cost a short string more than its scan did.
    #[inline]
    fn string(&mut self) -> Option<bool> {
        let text = self.i + 1;
        for word_at in [text, text + 8] {
            let Some(word) = self.b.get(word_at..word_at + 8) else {
                break;
            };
            if let Some(at) = word_special(word) {
                if word[at] == b'"' {
                    self.i = word_at + at + 1;
                    return Some(false);
                }
                break;
            }
        }
        self.long_string()
    }

    /// [`Self::string`] in full: any length, escapes checked.
    #[inline(never)]
    fn long_string(&mut self) -> Option<bool> {
        self.i += 1;
        let mut escaped = false;
        loop {
            self.i += special(&self.b[self.i..])?;
            match self.b[self.i] {
                b'"' | b'\\' => {}
                _ => return None,
            }
            if self.b[self.i] == b'"' {
                self.i += 1;
                return Some(escaped);
            }
            escaped = true;
            match self.b.get(self.i + 1)? {
                b'"' | b'\\' | b'/' | b'b' | b'f' | b'n' | b'r' | b't' => self.i += 2,
                b'u' => {
                    let hex = self.b.get(self.i + 2..self.i + 6)?;
                    if !hex.iter().all(u8::is_ascii_hexdigit) {
                        return None;
                    }
                    self.i += 6;
                }
                _ => return None,
            }
        }
    }

    fn literal(&mut self, word: &[u8]) -> Option<()> {
        let end = self.i + word.len();
        (self.b.get(self.i..end)? == word).then(|| self.i = end)
    }

    fn digits(&mut self) -> usize {
        let start = self.i;
        while let Some(b'0'..=b'9') = self.peek() {
            self.i += 1;
        }
        self.i - start
    }

    /// serde_json's number grammar: `-`? (`0` | [1-9][0-9]*) (`.` [0-9]+)?
    /// ([eE] [+-]? [0-9]+)?
    fn number(&mut self) -> Option<()> {
        if self.peek() == Some(b'-') {
            self.i += 1;
        }
        match self.peek()? {
            b'0' => {
                self.i += 1;
                if let Some(b'0'..=b'9') = self.peek() {
                    return None;
                }
            }
            b'1'..=b'9' => {
                self.digits();
            }
            _ => return None,
        }
        if self.peek() == Some(b'.') {
            self.i += 1;
            if self.digits() == 0 {
                return None;
            }
        }
        if let Some(b'e' | b'E') = self.peek() {
            self.i += 1;
            if let Some(b'+' | b'-') = self.peek() {
                self.i += 1;
            }
            if self.digits() == 0 {
                return None;
            }
        }
        Some(())
    }

    /// An array from its `[`: its elements' ranges.
    fn array(&mut self) -> Option<Vec<Range<usize>>> {
        self.eat(b'[')?;
        let mut out = Vec::new();
        self.ws();
        if self.peek()? == b']' {
            self.i += 1;
            return Some(out);
        }
        loop {
            self.ws();
            let start = self.i;
            self.value()?;
            out.push(start..self.i);
            self.ws();
            match self.peek()? {
                b',' => self.i += 1,
                b']' => {
                    self.i += 1;
                    return Some(out);
                }
                _ => return None,
            }
        }
    }

    /// One value, nested ones included, without recursion (serde_json's
    /// `ignore_value` has no depth limit either).
    fn value(&mut self) -> Option<()> {
        let depth = self.stack.len();
        loop {
            self.ws();
            match self.peek()? {
                b'"' => {
                    self.string()?;
                }
                open @ (b'{' | b'[') => {
                    self.i += 1;
                    self.ws();
                    let close = if open == b'{' { b'}' } else { b']' };
                    if self.peek()? == close {
                        self.i += 1;
                    } else {
                        self.stack.push(open);
                        if open == b'{' {
                            self.key()?;
                        }
                        continue;
                    }
                }
                b't' => self.literal(b"true")?,
                b'f' => self.literal(b"false")?,
                b'n' => self.literal(b"null")?,
                b'-' | b'0'..=b'9' => self.number()?,
                _ => return None,
            }
            // A value ended: close what it ended, or go on to the next one.
            loop {
                if self.stack.len() == depth {
                    return Some(());
                }
                let open = self.stack.last()?;
                self.ws();
                match (self.peek()?, open) {
                    (b',', _) => {
                        self.i += 1;
                        if open == b'{' {
                            self.ws();
                            self.key()?;
                        }
                        break;
                    }
                    (b']', b'[') | (b'}', b'{') => {
                        self.i += 1;
                        self.stack.pop();
                    }
                    _ => return None,
                }
            }
        }
    }

    /// An object member's key and colon (any key: only its syntax matters).
    fn key(&mut self) -> Option<()> {
        if self.peek()? != b'"' {
            return None;
        }
        self.string()?;
        self.ws();
        self.eat(b':')
    }
}

/// Where the next byte that ends a run of string text is: a quote, a
/// backslash or a control character (not allowed unescaped). Keys, roles
/// and short values end within a few bytes: the first 16 are tested eight
/// at a time in a word, which costs less than setting up `memchr2`, which
/// takes longer text (its control characters found by a minimum the
/// compiler vectorises, two instructions per 16 bytes).
#[inline]
fn special(s: &[u8]) -> Option<usize> {
    const SHORT: usize = 16;
    let mut at = 0;
    while at < SHORT {
        let Some(word) = s.get(at..at + 8) else {
            return s[at..].iter().position(|&b| is_special(b)).map(|p| at + p);
        };
        if let Some(hit) = word_special(word) {
            return Some(at + hit);
        }
        at += 8;
    }
    let rest = &s[SHORT..];
    let end = memchr::memchr2(b'"', b'\\', rest)?;
    let end = if rest[..end].iter().fold(u8::MAX, |m, &b| m.min(b)) < 0x20 {
        rest[..end].iter().position(|&b| b < 0x20)?
    } else {
        end
    };
    Some(SHORT + end)
}

/// The first special byte (see [`special`]) of an 8-byte `word`.
#[inline]
fn word_special(word: &[u8]) -> Option<usize> {
    let mut bytes = [0u8; 8];
    bytes.copy_from_slice(word);
    let hit = special_bytes(u64::from_le_bytes(bytes));
    (hit != 0).then(|| (hit.trailing_zeros() / 8) as usize)
}

fn is_special(b: u8) -> bool {
    b == b'"' || b == b'\\' || b < 0x20
}

/// Marks the quotes, backslashes and control characters among a word's
/// bytes; the lowest mark is always a true one (a borrow only carries a
/// false mark upwards, past a true one).
fn special_bytes(x: u64) -> u64 {
    const ONES: u64 = u64::MAX / 255;
    const HIGH: u64 = ONES << 7;
    let zeros = |y: u64| y.wrapping_sub(ONES) & !y & HIGH;
    zeros(x ^ (ONES * u64::from(b'"')))
        | zeros(x ^ (ONES * u64::from(b'\\')))
        | (x.wrapping_sub(ONES * 0x20) & !x & HIGH)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// A top-level object's members, in body order.
    #[derive(Debug, Default)]
    struct Skimmed<'a> {
        /// Key (as written: none has an escape) and the value's byte range.
        members: Vec<(&'a str, Range<usize>)>,
        /// The elements of the list member, when it was asked for and present.
        list: Option<Vec<Range<usize>>>,
    }

    /// Skims `text` as one JSON object (surrounding whitespace allowed); with
    /// `list`, the member of that name must be an array and its elements are
    /// listed, with the check of repeated keys callers of [`each_member`]
    /// make: what the tests compare with serde_json.
    fn object<'a>(text: &'a str, list: Option<&str>) -> Option<Skimmed<'a>> {
        let mut members: Vec<(&'a str, Range<usize>)> = Vec::with_capacity(16);
        let list = each_member(text, list, |key, span| {
            if members.iter().any(|(k, _)| *k == key) {
                return None;
            }
            members.push((key, span));
            Some(())
        })?;
        Some(Skimmed { members, list })
    }

    /// Members (key, raw text) and the list member's elements.
    type View = (Vec<(String, String)>, Option<Vec<String>>);

    /// What serde_json makes of `body` as an object with raw members (the
    /// list member's elements when it is an array); `None` when it refuses.
    fn serde_view(body: &[u8], list: &str) -> Option<View> {
        let members: Vec<(String, &RawValue)> =
            serde_json::from_slice::<indexmap::IndexMap<String, &RawValue>>(body)
                .ok()?
                .into_iter()
                .collect();
        let elements = members
            .iter()
            .find(|(k, _)| k == list)
            .and_then(|(_, v)| serde_json::from_str::<Vec<&RawValue>>(v.get()).ok())
            .map(|l| l.iter().map(|r| r.get().to_owned()).collect());
        let members = members
            .into_iter()
            .map(|(k, v)| (k, v.get().to_owned()))
            .collect();
        Some((members, elements))
    }

    fn skim_view(body: &[u8], list: &str) -> Option<View> {
        let s = object(std::str::from_utf8(body).ok()?, Some(list))?;
        let text = |r: &Range<usize>| String::from_utf8(body[r.clone()].to_vec()).unwrap();
        let members = s
            .members
            .iter()
            .map(|(k, r)| ((*k).to_owned(), text(r)))
            .collect();
        Some((members, s.list.map(|l| l.iter().map(text).collect())))
    }

    /// Whatever the skim accepts, serde_json reads the same way.
    fn check(body: &[u8]) {
        if let Some(ours) = skim_view(body, "m") {
            let theirs = serde_view(body, "m");
            assert_eq!(
                Some(&ours),
                theirs.as_ref(),
                "{}",
                String::from_utf8_lossy(body)
            );
        }
    }

    #[test]
    fn agrees_with_serde_json() {
        let accepted = [
            r#"{"m":[]}"#,
            r#" {"m" : [ {"a":1} , "x" ,-0.5e+3, true,null,false,[[]],{}] , "k":{"z":[1,{"y":"\u00e9\n"}]} } "#,
            r#"{"model":"gpt","m":[{"role":"user","content":"hi \"there\" \\ /"}],"t":0.70,"big":18446744073709551616123}"#,
            "{\"m\":[\"é ✓ 𝄞\"],\"n\":1e5}",
            r#"{}"#,
        ];
        for body in accepted {
            assert!(skim_view(body.as_bytes(), "m").is_some(), "{body}");
            check(body.as_bytes());
        }
        let refused = [
            r#"{"m":[1,]}"#,
            r#"{"m":[1],}"#,
            r#"{"m":[01]}"#,
            r#"{"m":[1.]}"#,
            r#"{"m":[1e]}"#,
            r#"{"m":[-]}"#,
            r#"{"m":["a\x"]}"#,
            r#"{"m":["\u12g4"]}"#,
            "{\"m\":[\"tab\tin\"]}",
            r#"{"m":[tru]}"#,
            r#"{"m":[1] "k":2}"#,
            r#"{"m":[1]}x"#,
            r#"{"m":{"a":1}}"#,
            r#"{"m":[],"m":[]}"#,
            r#"{"\u006d":[]}"#,
            r#"[1]"#,
            r#"{"m":[{"a" 1}]}"#,
            r#"{"m":[{,}]}"#,
            r#"{"m":[{"a":1,}]}"#,
            r#"{"m":["unterminated]}"#,
        ];
        for body in refused {
            assert!(skim_view(body.as_bytes(), "m").is_none(), "{body}");
        }
    }

    #[test]
    fn containers_nested_past_a_word_of_bits_close_as_they_opened() {
        for depth in [1, 63, 64, 65, 66, 127, 200] {
            // Objects and arrays by turns, so each level's kind matters.
            let (mut open, mut close) = (String::new(), String::new());
            for level in 0..depth {
                if level % 3 == 0 {
                    open.push_str(r#"{"a":"#);
                    close.insert(0, '}');
                } else {
                    open.push('[');
                    close.insert(0, ']');
                }
            }
            let body = format!(r#"{{"m":[{open}1{close}],"k":{open}"v"{close}}}"#);
            assert!(skim_view(body.as_bytes(), "m").is_some(), "depth {depth}");
            check(body.as_bytes());
            // The innermost container closed as the other kind.
            let swapped: String = close
                .chars()
                .enumerate()
                .map(|(i, c)| match (i, c) {
                    (0, '}') => ']',
                    (0, ']') => '}',
                    (_, c) => c,
                })
                .collect();
            let wrong = format!(r#"{{"m":[],"k":{open}"v"{swapped}}}"#);
            assert!(skim_view(wrong.as_bytes(), "m").is_none(), "depth {depth}");
        }
    }

    #[test]
    fn string_ends_are_found_at_every_offset() {
        for len in 0..40 {
            for end in [b'"', b'\\'] {
                let mut s = vec![b'a'; len];
                s.push(end);
                s.extend_from_slice(b"\"xyz\\");
                assert_eq!(special(&s), Some(len), "{len}");
            }
            let plain = vec![b'a'; len];
            assert_eq!(special(&plain), None);
            let mut ctl = vec![b'a'; len];
            ctl.push(b'\n');
            ctl.push(b'"');
            assert_eq!(special(&ctl), Some(len));
        }
    }

    /// The inline scan of short strings ends where the full one does, for
    /// every length around its two words, at the body's end or not, with an
    /// escape, a control character or no end at all.
    #[test]
    fn short_strings_end_where_the_long_scan_ends() {
        for len in 0..40 {
            for end in [&b"\""[..], b"\"\"", b"\\n\"", b"\n\"", b"\\x\"", b""] {
                for tail in [&b""[..], b",1234567890123456789}"] {
                    let mut body = b"\"".to_vec();
                    body.extend(std::iter::repeat_n(b'a', len));
                    body.extend_from_slice(end);
                    body.extend_from_slice(tail);
                    let scan = |long: bool| {
                        let mut s = Scan {
                            b: &body,
                            i: 0,
                            stack: Open::default(),
                        };
                        let found = if long { s.long_string() } else { s.string() };
                        (found, s.i)
                    };
                    let (short, long) = (scan(false), scan(true));
                    assert_eq!(short.0, long.0, "{:?}", String::from_utf8_lossy(&body));
                    if long.0.is_some() {
                        assert_eq!(short.1, long.1, "{:?}", String::from_utf8_lossy(&body));
                    }
                }
            }
        }
    }

    #[test]
    fn trusted_raw_values_are_built() {
        let r = raw(r#"{"a": [1, 2]}"#).expect("serde_json's raw value protocol");
        assert_eq!(r.get(), r#"{"a": [1, 2]}"#);
        let b = raw_boxed("\"x\"").expect("serde_json's raw value protocol");
        assert_eq!(b.get(), "\"x\"");
    }

    fn json_text() -> impl Strategy<Value = String> {
        let leaf = prop_oneof![
            Just("null".to_owned()),
            Just("true".to_owned()),
            any::<i64>().prop_map(|n| n.to_string()),
            any::<f64>().prop_map(|f| serde_json::to_string(&f).unwrap()),
            ".{0,12}".prop_map(|s| serde_json::to_string(&s).unwrap()),
        ];
        leaf.prop_recursive(4, 32, 6, |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..5)
                    .prop_map(|v| format!("[{}]", v.join(" ,"))),
                prop::collection::vec(("[a-z]{1,3}", inner), 0..5).prop_map(|v| {
                    let fields: Vec<String> = v
                        .into_iter()
                        .map(|(k, v)| format!("\"{k}\": {v}"))
                        .collect();
                    format!("{{{}}}", fields.join(","))
                }),
            ]
        })
    }

    proptest! {
        #[test]
        fn agrees_with_serde_json_on_generated_and_damaged_bodies(
            elements in prop::collection::vec(json_text(), 0..6),
            other in json_text(),
            cut in any::<prop::sample::Index>(),
            byte in any::<u8>(),
        ) {
            let body = format!("{{\"o\":{other},\"m\":[{}]}}", elements.join(","));
            prop_assert!(skim_view(body.as_bytes(), "m").is_some() || serde_view(body.as_bytes(), "m").is_none());
            check(body.as_bytes());
            // One byte replaced anywhere: still never accepted differently.
            let mut damaged = body.into_bytes();
            let at = cut.index(damaged.len());
            damaged[at] = byte;
            check(&damaged);
        }
    }
}
