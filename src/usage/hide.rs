//! Removing what a forced `stream_options.include_usage` added to a stream,
//! for clients that did not ask for usage.
//!
//! Per event (one `data:` JSON object), with every other byte left as the
//! upstream sent it:
//! - a `choices: []` chunk with a non-null `usage` is dropped, terminating
//!   blank line included (OpenAI, vLLM, llama.cpp ≥ 2025-09);
//! - a `usage` member anywhere else is spliced out (OpenAI's `"usage":null`
//!   on every chunk, providers that put usage on the finish chunk);
//! - llama.cpp puts its `timings` on the *last* chunk: on the usage chunk
//!   when usage was requested, on the finish chunk otherwise. So the finish
//!   chunk is held until the next event, and when that event is a dropped
//!   usage chunk its `timings` member is appended to the finish chunk, which
//!   is exactly what llama.cpp sends without `include_usage`.
//!
//! The transform streams: it holds back at most one incomplete event (plus
//! the finish chunk until the event after it arrives).

use std::ops::Range;
use std::pin::Pin;
use std::sync::LazyLock;
use std::task::{Context, Poll};

use bytes::{Buf, Bytes, BytesMut};
use http_body::{Body, Frame, SizeHint};
use memchr::memchr2;
use memchr::memmem::Finder;
use pin_project_lite::pin_project;

use super::sse::MAX_EVENT_BYTES;

/// Streaming usage remover; see the module docs.
#[derive(Debug, Default)]
pub struct UsageHider {
    /// Bytes of the current, incomplete event block.
    pending: Vec<u8>,
    /// Where scanning for the block end resumes inside `pending`.
    scan_pos: usize,
    /// Start of the current line inside `pending`.
    line_start: usize,
    /// A complete finish chunk held until the next block.
    held: Option<Held>,
    /// The current event outgrew the cap: its bytes are forwarded as they
    /// come, untouched, until it ends.
    passthrough: bool,
    oversized_events: u64,
    dropped_events: u64,
    edited_events: u64,
}

#[derive(Debug)]
struct Held {
    block: Vec<u8>,
    /// Position of the closing `}` of the data object inside `block`.
    close: usize,
    has_timings: bool,
    /// Data-less blocks (comments) that arrived after it.
    trailing: Vec<u8>,
}

impl Held {
    fn flush(self, out: &mut BytesMut) {
        out.extend_from_slice(&self.block);
        out.extend_from_slice(&self.trailing);
    }
}

/// Bound on comment bytes kept behind a held finish chunk.
const MAX_HELD_TRAILING: usize = 64 << 10;

/// What to do with one complete event block.
enum Verdict {
    Keep,
    /// Replace with these bytes.
    Edited(Vec<u8>),
    /// Drop; carries the chunk's `timings` member (with its leading comma)
    /// if it had one.
    Drop(Option<Vec<u8>>),
}

impl UsageHider {
    /// A fresh hider.
    pub fn new() -> Self {
        Self::default()
    }

    /// Processes the next input slice, appending what can be released.
    pub fn push(&mut self, input: &[u8], out: &mut BytesMut) {
        self.pending.extend_from_slice(input);
        let mut consumed = 0usize;
        loop {
            let Some(off) = memchr2(b'\n', b'\r', &self.pending[self.scan_pos..]) else {
                self.scan_pos = self.pending.len();
                break;
            };
            let p = self.scan_pos + off;
            let term_end = if self.pending[p] == b'\r' {
                match self.pending.get(p + 1) {
                    Some(b'\n') => p + 2,
                    Some(_) => p + 1,
                    // A CR at the end: the LF that may follow belongs to
                    // this line ending; wait for it.
                    None => {
                        self.scan_pos = p;
                        break;
                    }
                }
            } else {
                p + 1
            };
            if p == self.line_start {
                // Blank line: the block `consumed..term_end` is complete.
                if self.passthrough {
                    out.extend_from_slice(&self.pending[consumed..term_end]);
                    self.passthrough = false;
                } else {
                    let pending = std::mem::take(&mut self.pending);
                    self.release(&pending[consumed..term_end], out);
                    self.pending = pending;
                }
                consumed = term_end;
            }
            self.line_start = term_end;
            self.scan_pos = term_end;
        }
        if consumed > 0 {
            self.pending.drain(..consumed);
            self.scan_pos -= consumed;
            self.line_start -= consumed;
        }
        if self.pending.len() > MAX_EVENT_BYTES || (self.passthrough && self.scan_pos > 0) {
            self.spill(out);
        }
    }

    /// How many leading bytes of `frame` can go out as they are, without a
    /// copy: with nothing pending or held, the whole event blocks at its
    /// front of which none would be changed, dropped or held (the finish
    /// chunk is held). Most of a stream is: `push` would copy each block
    /// twice (into the pending block, then out) to release the same bytes.
    /// The state is unchanged; the rest of the frame goes to `push`.
    ///
    /// Read from the frame as a whole rather than block by block (a frame
    /// gathers a stream's burst, ~20 events): the first block that may
    /// change (one with a `"usage"` key) is found by one search, and the
    /// blocks before it end at the last blank line before it, found
    /// backwards. Per event that was two line-end searches, a `g` search
    /// and a key search (~400 instructions).
    ///
    /// A finish chunk is held only until the next data block, and changed
    /// only when that block is a dropped usage chunk: one with a data block
    /// after it inside the passed bytes goes out as it came. So only the
    /// passed bytes' last blocks are read for a finish: those back to the
    /// last data block without one are left to `push`. Searching every
    /// event of the frame for a `finish_reason` not `null` cost ~200
    /// instructions an event, most of a stream's hiding.
    pub(crate) fn passing(&self, frame: &[u8]) -> usize {
        if !self.pending.is_empty()
            || self.scan_pos != 0
            || self.line_start != 0
            || self.held.is_some()
            || self.passthrough
        {
            return 0;
        }
        // A block longer than the cap goes to `push` (which forwards it
        // untouched as it comes): blocks ending within the first cap's bytes
        // are no longer than the cap, and the rest of a longer frame is
        // passed the next time.
        let front = &frame[..frame.len().min(MAX_EVENT_BYTES)];
        let stop = usage_key_at(front).unwrap_or(front.len());
        let mut end = super::sse::last_event_end(front, stop);
        while end > 0 {
            let start = super::sse::last_event_end(front, end - 1);
            let block = &front[start..end];
            // Held or kept behind a held block, with what follows it
            // deciding how it goes out: `push` reads it.
            if data_payload(block).is_none() || has_finish(block) {
                end = start;
            } else {
                break;
            }
        }
        end
    }

    /// Forwards the scanned part of an oversized event untouched, so memory
    /// stays bounded and the stream keeps flowing.
    fn spill(&mut self, out: &mut BytesMut) {
        if !self.passthrough {
            if let Some(h) = self.held.take() {
                h.flush(out);
            }
            self.passthrough = true;
            self.oversized_events += 1;
        }
        let k = self.scan_pos;
        out.extend_from_slice(&self.pending[..k]);
        self.pending.drain(..k);
        self.scan_pos = 0;
        // usize::MAX: the current line began in bytes already forwarded, so
        // the next terminator ends a non-empty line.
        self.line_start = self.line_start.checked_sub(k).unwrap_or(usize::MAX);
    }

    /// Events forwarded untouched because they exceeded the size cap.
    // Only tests read it.
    #[cfg(test)]
    pub(crate) fn oversized_events(&self) -> u64 {
        self.oversized_events
    }

    /// Flushes everything at the end of the stream (an unterminated last
    /// event gets the same treatment as a complete one).
    pub fn finish(&mut self, out: &mut BytesMut) {
        let rest = std::mem::take(&mut self.pending);
        self.scan_pos = 0;
        self.line_start = 0;
        if std::mem::take(&mut self.passthrough) {
            out.extend_from_slice(&rest);
        } else if !rest.is_empty() {
            self.release(&rest, out);
        }
        if let Some(h) = self.held.take() {
            h.flush(out);
        }
    }

    /// Releases one complete event block (copied only when it is held).
    fn release(&mut self, block: &[u8], out: &mut BytesMut) {
        // Comments and blank blocks between the finish chunk and the usage
        // chunk stay behind the finish chunk, in order.
        if let Some(h) = self.held.as_mut() {
            if data_payload(block).is_none() && h.trailing.len() < MAX_HELD_TRAILING {
                h.trailing.extend_from_slice(block);
                return;
            }
        }
        let verdict = judge(block);
        if let Verdict::Drop(timings) = &verdict {
            self.dropped_events += 1;
            if let Some(mut h) = self.held.take() {
                if let (Some(t), false) = (timings, h.has_timings) {
                    let mut spliced = Vec::with_capacity(h.block.len() + t.len() + 12);
                    spliced.extend_from_slice(&h.block[..h.close]);
                    spliced.extend_from_slice(t);
                    spliced.extend_from_slice(&h.block[h.close..]);
                    h.block = spliced;
                }
                h.flush(out);
            }
            return;
        }
        if let Some(h) = self.held.take() {
            h.flush(out);
        }
        let block = match verdict {
            Verdict::Keep => std::borrow::Cow::Borrowed(block),
            Verdict::Edited(b) => {
                self.edited_events += 1;
                std::borrow::Cow::Owned(b)
            }
            Verdict::Drop(_) => return,
        };
        match finish_chunk_close(&block) {
            Some((close, has_timings)) => {
                self.held = Some(Held {
                    block: block.into_owned(),
                    close,
                    has_timings,
                    trailing: Vec::new(),
                })
            }
            None => out.extend_from_slice(&block),
        }
    }
}

/// The single `data:` line of a block: (payload range, whole block is
/// simple). `None` when the block has no data line or more than one.
fn data_payload(block: &[u8]) -> Option<Range<usize>> {
    let mut found: Option<Range<usize>> = None;
    let mut i = 0;
    while i < block.len() {
        let end = memchr2(b'\n', b'\r', &block[i..]).map_or(block.len(), |o| i + o);
        let line = &block[i..end];
        if let Some(v) = line.strip_prefix(b"data:") {
            if found.is_some() {
                return None;
            }
            let skip = usize::from(v.first() == Some(&b' '));
            found = Some(i + 5 + skip..end);
        }
        i = end + 1;
        if end < block.len() && block[end] == b'\r' && block.get(end + 1) == Some(&b'\n') {
            i += 1;
        }
    }
    found
}

/// Finds `"finish_reason"` (built once, see [`super::USAGE_KEY`]).
static FINISH_REASON_KEY: LazyLock<Finder<'static>> =
    LazyLock::new(|| Finder::new(b"\"finish_reason\""));

/// Whether `block` has a `"usage"` key somewhere: without one, [`judge`]
/// keeps it.
fn has_usage_key(block: &[u8]) -> bool {
    usage_key_at(block).is_some()
}

/// Where the first `"usage"` key in `hay` starts. Its `g` is the key's
/// fifth byte: a key starts at most four bytes before the first `g`, and
/// one `memchr` rules out most of a stream.
fn usage_key_at(hay: &[u8]) -> Option<usize> {
    let from = memchr::memchr(b'g', hay)?.saturating_sub(4);
    super::USAGE_KEY.find(&hay[from..]).map(|p| from + p)
}

fn judge(block: &[u8]) -> Verdict {
    if !has_usage_key(block) {
        return Verdict::Keep;
    }
    let Some(range) = data_payload(block) else {
        return Verdict::Keep;
    };
    let payload = &block[range.clone()];
    let Some(members) = top_members(payload) else {
        return Verdict::Keep;
    };
    let find = |k: &[u8]| members.iter().position(|m| &payload[m.key.clone()] == k);
    let Some(ui) = find(b"usage") else {
        return Verdict::Keep;
    };
    let usage_val = &payload[members[ui].value.clone()];
    let choices_empty = find(b"choices").is_some_and(|ci| {
        let v = &payload[members[ci].value.clone()];
        v.first() == Some(&b'[') && v[1..].trim_ascii_start() == b"]"
    });
    if choices_empty && usage_val != b"null" {
        // Keep the upstream's own separators (`,"timings":` vs `, "timings": `)
        // so the member lands on the finish chunk exactly as it would have.
        let timings = find(b"timings").map(|ti| {
            if ti > 0 {
                payload[members[ti - 1].value.end..members[ti].value.end].to_vec()
            } else {
                let mut m = b",".to_vec();
                m.extend_from_slice(&payload[members[0].start..members[0].value.end]);
                m
            }
        });
        return Verdict::Drop(timings);
    }
    // Splice the member out together with one adjacent comma.
    let cut = if ui > 0 {
        members[ui - 1].value.end..members[ui].value.end
    } else if members.len() > 1 {
        members[0].start..members[1].start
    } else {
        members[0].start..members[0].value.end
    };
    let mut out = Vec::with_capacity(block.len());
    out.extend_from_slice(&block[..range.start + cut.start]);
    out.extend_from_slice(&block[range.start + cut.end..]);
    Verdict::Edited(out)
}

/// For a block whose chunk has a non-null `finish_reason`: the position of
/// the data object's closing brace in the block, and whether it already has
/// `timings`.
fn finish_chunk_close(block: &[u8]) -> Option<(usize, bool)> {
    if !has_finish(block) {
        return None;
    }
    let range = data_payload(block)?;
    let payload = &block[range.clone()];
    let members = top_members(payload)?;
    let has_timings = members
        .iter()
        .any(|m| &payload[m.key.clone()] == b"timings");
    let close = payload.iter().rposition(|&b| b == b'}')?;
    Some((range.start + close, has_timings))
}

/// Whether `block` has a `finish_reason` that is not `null` somewhere: the
/// blocks [`finish_chunk_close`] may hold.
fn has_finish(block: &[u8]) -> bool {
    super::any_match(&FINISH_REASON_KEY, block, |p| {
        let rest = block[p + 15..].trim_ascii_start();
        rest.strip_prefix(b":")
            .is_some_and(|r| !r.trim_ascii_start().starts_with(b"null"))
    })
}

/// One top-level member of a JSON object, as byte ranges into the text.
#[derive(Debug, Clone)]
struct MemberSpan {
    /// The key's opening quote.
    start: usize,
    /// The key text between its quotes (raw, escapes not decoded).
    key: Range<usize>,
    /// The value.
    value: Range<usize>,
}

/// Top-level members of a JSON object, or `None` if `s` is not one
/// (checked structurally; scalars are not validated in depth).
fn top_members(s: &[u8]) -> Option<Vec<MemberSpan>> {
    let mut i = skip_ws(s, 0);
    if s.get(i) != Some(&b'{') {
        return None;
    }
    i = skip_ws(s, i + 1);
    let mut out = Vec::new();
    if s.get(i) == Some(&b'}') {
        return (skip_ws(s, i + 1) == s.len()).then_some(out);
    }
    loop {
        if s.get(i) != Some(&b'"') {
            return None;
        }
        let start = i;
        let key_end = skip_string(s, i)?;
        let key = start + 1..key_end - 1;
        i = skip_ws(s, key_end);
        if s.get(i) != Some(&b':') {
            return None;
        }
        i = skip_ws(s, i + 1);
        let v_end = skip_value(s, i)?;
        out.push(MemberSpan {
            start,
            key,
            value: i..v_end,
        });
        i = skip_ws(s, v_end);
        match s.get(i) {
            Some(b',') => i = skip_ws(s, i + 1),
            Some(b'}') => {
                return (skip_ws(s, i + 1) == s.len()).then_some(out);
            }
            _ => return None,
        }
    }
}

fn skip_ws(s: &[u8], mut i: usize) -> usize {
    while matches!(s.get(i), Some(b' ' | b'\t' | b'\n' | b'\r')) {
        i += 1;
    }
    i
}

/// `s[i]` is an opening quote; returns the index after the closing quote.
fn skip_string(s: &[u8], i: usize) -> Option<usize> {
    let mut j = i + 1;
    loop {
        let off = memchr2(b'"', b'\\', s.get(j..)?)?;
        j += off;
        if s[j] == b'\\' {
            j += 2;
        } else {
            return Some(j + 1);
        }
    }
}

fn skip_value(s: &[u8], i: usize) -> Option<usize> {
    match *s.get(i)? {
        b'"' => skip_string(s, i),
        b'{' | b'[' => {
            let mut depth = 0usize;
            let mut j = i;
            while j < s.len() {
                match s[j] {
                    b'"' => {
                        j = skip_string(s, j)?;
                        continue;
                    }
                    b'{' | b'[' => depth += 1,
                    b'}' | b']' => {
                        depth -= 1;
                        if depth == 0 {
                            return Some(j + 1);
                        }
                    }
                    _ => {}
                }
                j += 1;
            }
            None
        }
        _ => {
            let mut j = i;
            while j < s.len() && !matches!(s[j], b',' | b'}' | b']' | b' ' | b'\t' | b'\n' | b'\r')
            {
                j += 1;
            }
            (j > i).then_some(j)
        }
    }
}

pin_project! {
    /// Body wrapper applying [`UsageHider`] to every data frame. Trailers
    /// pass through after the flushed remainder.
    pub struct HideUsageBody<B, E = <B as Body>::Error> {
        #[pin]
        inner: B,
        hider: UsageHider,
        done: bool,
        // Boxed: rare, and inline they put the boxed body stack of a
        // hidden stream (`upstream::idle_timeout`) past the 1,032 bytes
        // glibc's per-thread cache serves.
        trailers: Option<Box<http::HeaderMap>>,
        // The part of a frame after what went out without a copy.
        rest: Option<Bytes>,
        error: Option<E>,
    }
}

impl<B: Body> HideUsageBody<B> {
    /// Wraps `inner`.
    pub fn new(inner: B) -> Self {
        Self {
            inner,
            hider: UsageHider::new(),
            done: false,
            trailers: None,
            rest: None,
            error: None,
        }
    }
}

impl<B> Body for HideUsageBody<B>
where
    B: Body,
    B::Data: Buf,
{
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
        let mut this = self.project();
        loop {
            if *this.done {
                if let Some(e) = this.error.take() {
                    return Poll::Ready(Some(Err(e)));
                }
                return Poll::Ready(this.trailers.take().map(|t| Ok(Frame::trailers(*t))));
            }
            let mut out = BytesMut::new();
            let data = match this.rest.take() {
                Some(rest) => rest,
                None => match this.inner.as_mut().poll_frame(cx) {
                    Poll::Pending => return Poll::Pending,
                    Poll::Ready(Some(Ok(frame))) => match frame.into_data() {
                        // A `Bytes` frame is taken as the same buffer.
                        Ok(mut data) => data.copy_to_bytes(data.remaining()),
                        Err(frame) => {
                            *this.done = true;
                            this.hider.finish(&mut out);
                            *this.trailers = frame.into_trailers().ok().map(Box::new);
                            Bytes::new()
                        }
                    },
                    Poll::Ready(Some(Err(e))) => {
                        // Release what was held back first, then the error,
                        // as the client would have seen it without compactor.
                        *this.done = true;
                        this.hider.finish(&mut out);
                        *this.error = Some(e);
                        Bytes::new()
                    }
                    Poll::Ready(None) => {
                        *this.done = true;
                        this.hider.finish(&mut out);
                        Bytes::new()
                    }
                },
            };
            if !data.is_empty() {
                let k = this.hider.passing(&data);
                if k == data.len() {
                    // The hider is untouched: ending here flushes nothing.
                    *this.done = this.inner.is_end_stream();
                    return Poll::Ready(Some(Ok(Frame::data(data))));
                }
                if k > 0 {
                    *this.rest = Some(data.slice(k..));
                    return Poll::Ready(Some(Ok(Frame::data(data.slice(..k)))));
                }
                out.reserve(data.len());
                this.hider.push(&data, &mut out);
                if this.inner.is_end_stream() {
                    *this.done = true;
                    this.hider.finish(&mut out);
                }
            }
            if !out.is_empty() {
                return Poll::Ready(Some(Ok(Frame::data(out.freeze()))));
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.done && self.trailers.is_none() && self.error.is_none()
    }

    fn size_hint(&self) -> SizeHint {
        // The length changes; only "unknown" is honest.
        SizeHint::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hide_all(chunks: &[&[u8]]) -> Vec<u8> {
        let mut h = UsageHider::new();
        let mut out = BytesMut::new();
        for c in chunks {
            h.push(c, &mut out);
        }
        h.finish(&mut out);
        out.to_vec()
    }

    #[test]
    fn members_scanner() {
        let s = br#" { "a" : 1 , "b\"":{"x":[1,"]"]}, "c":"}" } "#;
        let m = top_members(s).unwrap();
        let keys: Vec<&[u8]> = m.iter().map(|m| &s[m.key.clone()]).collect();
        assert_eq!(keys, vec![&b"a"[..], &b"b\\\""[..], &b"c"[..]]);
        assert_eq!(&s[m[1].value.clone()], br#"{"x":[1,"]"]}"#);
        assert!(top_members(b"[1]").is_none());
        assert!(top_members(b"{\"a\":1").is_none());
        assert!(top_members(b"{\"a\":1} x").is_none());
        assert_eq!(top_members(b"{}").unwrap().len(), 0);
    }

    #[test]
    fn a_finish_reason_after_a_null_one_is_found() {
        // Two choices, the first unfinished: the search goes on past the
        // first match (from its closing quote) to the second.
        let block = b"data: {\"choices\":[{\"index\":0,\"finish_reason\":null},{\"index\":1,\"finish_reason\":\"stop\"}]}\n\n";
        assert!(has_finish(block));
        assert!(finish_chunk_close(block).is_some());
        let unfinished =
            b"data: {\"choices\":[{\"finish_reason\":null},{\"finish_reason\" : null}]}\n\n";
        assert!(!has_finish(unfinished));
        // Keys back to back share no more than a quote.
        let adjacent = b"\"finish_reason\"finish_reason\":\"stop\"";
        assert!(has_finish(adjacent));
    }

    #[test]
    fn usage_key_spliced_in_every_position() {
        let cases: &[(&str, &str)] = &[
            (
                "data: {\"a\":1,\"usage\":null,\"b\":2}\n\n",
                "data: {\"a\":1,\"b\":2}\n\n",
            ),
            ("data: {\"usage\":null,\"b\":2}\n\n", "data: {\"b\":2}\n\n"),
            (
                "data: {\"a\":1, \"usage\": null}\n\n",
                "data: {\"a\":1}\n\n",
            ),
            ("data: {\"usage\":null}\n\n", "data: {}\n\n"),
            (
                "data: {\"choices\":[{\"x\":1}],\"usage\":{\"prompt_tokens\":3}}\r\n\r\n",
                "data: {\"choices\":[{\"x\":1}]}\r\n\r\n",
            ),
        ];
        for (input, want) in cases {
            assert_eq!(
                String::from_utf8(hide_all(&[input.as_bytes()])).unwrap(),
                *want,
                "input {input:?}"
            );
        }
    }

    #[test]
    fn usage_only_chunk_dropped_and_rest_untouched() {
        let s = "data: {\"choices\":[{\"delta\":{\"content\":\"usage\"}}]}\n\n: ping\n\ndata: {\"choices\":[],\"usage\":{\"prompt_tokens\":9}}\n\ndata: [DONE]\n\n";
        let want = "data: {\"choices\":[{\"delta\":{\"content\":\"usage\"}}]}\n\n: ping\n\ndata: [DONE]\n\n";
        assert_eq!(String::from_utf8(hide_all(&[s.as_bytes()])).unwrap(), want);
    }

    #[test]
    fn crlf_pair_split_after_dropped_event() {
        let s = b"data: {\"choices\":[],\"usage\":{\"p\":1}}\r\n\r\ndata: x\r\n\r\n";
        let want = b"data: x\r\n\r\n".to_vec();
        for cut in 0..=s.len() {
            assert_eq!(hide_all(&[&s[..cut], &s[cut..]]), want, "cut {cut}");
        }
    }

    #[test]
    fn oversized_event_streams_through_untouched() {
        let big = format!(
            "data: {{\"usage\":null,\"x\":\"{}\"}}",
            "a".repeat(3 * MAX_EVENT_BYTES)
        );
        let stream = format!(
            "data: {{\"a\":1,\"usage\":null}}\n\n{big}\r\n\r\ndata: {{\"b\":2,\"usage\":null}}\n\n"
        );
        let mut h = UsageHider::new();
        let mut out = BytesMut::new();
        let mut released_before_end = false;
        let bytes = stream.as_bytes();
        let big_end = stream.find("\r\n\r\n").unwrap();
        let mut pos = 0;
        for c in bytes.chunks(64 * 1024) {
            h.push(c, &mut out);
            pos += c.len();
            if pos < big_end && out.len() > 1024 {
                released_before_end = true;
            }
        }
        h.finish(&mut out);
        assert!(released_before_end);
        assert!(h.pending.capacity() < 3 * MAX_EVENT_BYTES);
        let want = format!("data: {{\"a\":1}}\n\n{big}\r\n\r\ndata: {{\"b\":2}}\n\n");
        assert!(out[..] == *want.as_bytes());
        assert_eq!(h.oversized_events(), 1);
    }

    #[test]
    fn releases_complete_events_without_waiting_for_the_end() {
        let mut h = UsageHider::new();
        let mut out = BytesMut::new();
        h.push(b"data: {\"a\":1,\"usage\":null}\n\ndata: {\"b\"", &mut out);
        assert_eq!(&out[..], b"data: {\"a\":1}\n\n");
        out.clear();
        h.push(b":2}\n\n", &mut out);
        assert_eq!(&out[..], b"data: {\"b\":2}\n\n");
    }
}
