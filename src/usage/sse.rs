//! Incremental server-sent-events scanner.
//!
//! Fed arbitrary slices of a stream (frames may split an event, a line or a
//! CRLF pair at any byte), it reports each complete event. Lines end with LF,
//! CRLF or a bare CR, as the SSE specification allows. Events larger than
//! [`MAX_EVENT_BYTES`] are skipped, never buffered without bound.

use memchr::memchr2;

/// Largest event (sum of its data lines) the scanner keeps.
pub(crate) const MAX_EVENT_BYTES: usize = 1 << 20;

/// Bytes of an oversized line kept to read its field name.
const FIELD_HEAD: usize = 8;

/// One dispatched event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SseEvent<'a> {
    /// The `event:` field, if any.
    pub event: Option<&'a [u8]>,
    /// The `data:` lines joined with `\n`.
    pub data: &'a [u8],
    /// The payload came from an `error:` field instead of `data:` (the form
    /// late-2024 llama.cpp builds used for an error inside a stream).
    pub error_field: bool,
}

/// Incremental SSE scanner; see the module docs.
#[derive(Debug, Default)]
pub struct SseScanner {
    /// Partial line carried over from the previous slice.
    line: Vec<u8>,
    line_oversized: bool,
    /// The previous slice ended in CR: a leading LF in the next one belongs
    /// to that line ending.
    skip_lf: bool,
    data: Vec<u8>,
    event: Vec<u8>,
    has_event_name: bool,
    has_data: bool,
    error_field: bool,
    oversized: bool,
    events: u64,
    skipped: u64,
}

impl SseScanner {
    /// A fresh scanner.
    pub fn new() -> Self {
        Self::default()
    }

    /// Events skipped because they exceeded [`MAX_EVENT_BYTES`].
    pub(crate) fn skipped(&self) -> u64 {
        self.skipped
    }

    /// Whether the next byte fed starts an event: nothing of a line or an
    /// event is held, and no LF is owed to a CR. Whole events fed from
    /// here may then be left out (see [`last_event_end`]) with no trace in
    /// the scanner's state.
    pub(crate) fn between_events(&self) -> bool {
        self.line.is_empty()
            && !self.line_oversized
            && !self.skip_lf
            && !self.has_data
            && !self.has_event_name
            && !self.error_field
            && !self.oversized
    }

    /// Feeds the next slice of the stream; `on_event` runs for every event
    /// that completes inside it.
    pub fn feed(&mut self, chunk: &[u8], mut on_event: impl FnMut(SseEvent<'_>)) {
        self.feed_until(chunk, |e| {
            on_event(e);
            true
        });
    }

    /// [`SseScanner::feed`] that stops after the event for which `on_event`
    /// says `false`: for a reader that only wants the stream's first
    /// events (the rest of `chunk` is not scanned; the scanner is not to be
    /// fed again).
    pub fn feed_until(&mut self, chunk: &[u8], mut on_event: impl FnMut(SseEvent<'_>) -> bool) {
        let go = std::cell::Cell::new(true);
        let mut on_event = |e: SseEvent<'_>| {
            if !on_event(e) {
                go.set(false);
            }
        };
        let mut i = 0;
        if self.skip_lf && !chunk.is_empty() {
            self.skip_lf = false;
            if chunk[0] == b'\n' {
                i = 1;
            }
        }
        while i < chunk.len() && go.get() {
            match memchr2(b'\n', b'\r', &chunk[i..]) {
                Some(off) => {
                    let end = i + off;
                    if self.line.is_empty() && !self.line_oversized {
                        if let Some(next) = self.one_line_event(chunk, i, end, &mut on_event) {
                            i = next;
                            continue;
                        }
                        self.process_line(&chunk[i..end], false, &mut on_event);
                    } else {
                        self.push_partial(&chunk[i..end]);
                        let line = std::mem::take(&mut self.line);
                        let oversized = std::mem::replace(&mut self.line_oversized, false);
                        self.process_line(&line, oversized, &mut on_event);
                        self.line = line;
                        self.line.clear();
                    }
                    let (next, lf_owed) = past_line_end(chunk, end);
                    i = next;
                    self.skip_lf |= lf_owed;
                }
                None => {
                    self.push_partial(&chunk[i..]);
                    break;
                }
            }
        }
    }

    /// Dispatches an event left without its closing blank line when the
    /// stream ended. (Browsers drop such an event; for usage accounting it
    /// is still evidence, so the caller decides.)
    pub fn finish(&mut self, mut on_event: impl FnMut(SseEvent<'_>)) {
        if !self.line.is_empty() || self.line_oversized {
            let line = std::mem::take(&mut self.line);
            let oversized = std::mem::replace(&mut self.line_oversized, false);
            self.process_line(&line, oversized, &mut on_event);
        }
        self.dispatch(&mut on_event);
    }

    fn push_partial(&mut self, bytes: &[u8]) {
        if self.line_oversized {
            return;
        }
        if self.line.len() + bytes.len() > MAX_EVENT_BYTES {
            // Keep just enough to know the field name ("data", "error").
            let mut head = std::mem::take(&mut self.line);
            head.truncate(FIELD_HEAD);
            let more = FIELD_HEAD.saturating_sub(head.len()).min(bytes.len());
            head.extend_from_slice(&bytes[..more]);
            self.line = head;
            self.line_oversized = true;
        } else {
            self.line.extend_from_slice(bytes);
        }
    }

    /// The event of one `data:` (or `error:`) line, `chunk[start..end]`,
    /// when the blank line that ends it follows in `chunk`: dispatched from
    /// the chunk, not copied into the event's buffer first (a stream's
    /// events are mostly this shape). Where scanning resumes, or `None`
    /// for any other line, which [`Self::process_line`] takes.
    fn one_line_event(
        &mut self,
        chunk: &[u8],
        start: usize,
        end: usize,
        on_event: &mut impl FnMut(SseEvent<'_>),
    ) -> Option<usize> {
        if self.has_data || self.oversized {
            return None;
        }
        let (field, value) = field_value(&chunk[start..end])?;
        if !matches!(field, b"data" | b"error") || value.len() > MAX_EVENT_BYTES {
            return None;
        }
        // The line's end (its LF known to be in `chunk`), then the blank
        // line's.
        let (blank, false) = past_line_end(chunk, end) else {
            return None;
        };
        if !matches!(chunk.get(blank)?, b'\n' | b'\r') {
            return None;
        }
        let (next, lf_owed) = past_line_end(chunk, blank);
        self.skip_lf |= lf_owed;
        self.emit(value, field == b"error", on_event);
        self.reset();
        Some(next)
    }

    fn process_line(
        &mut self,
        line: &[u8],
        oversized: bool,
        on_event: &mut impl FnMut(SseEvent<'_>),
    ) {
        if line.is_empty() && !oversized {
            self.dispatch(on_event);
            return;
        }
        let Some((field, value)) = field_value(line) else {
            return;
        };
        match field {
            b"data" | b"error" => {
                if field == b"error" {
                    self.error_field = true;
                }
                if oversized {
                    self.mark_oversized();
                    return;
                }
                if self.oversized {
                    return;
                }
                let extra = usize::from(self.has_data) + value.len();
                if self.data.len() + extra > MAX_EVENT_BYTES {
                    self.mark_oversized();
                    return;
                }
                if self.has_data {
                    self.data.push(b'\n');
                }
                self.data.extend_from_slice(value);
                self.has_data = true;
            }
            b"event" if !oversized => {
                self.event.clear();
                self.event.extend_from_slice(value);
                self.has_event_name = true;
            }
            _ => {}
        }
    }

    fn mark_oversized(&mut self) {
        self.oversized = true;
        self.has_data = true;
        self.data = Vec::new();
    }

    fn dispatch(&mut self, on_event: &mut impl FnMut(SseEvent<'_>)) {
        if self.has_data {
            if self.oversized {
                self.skipped += 1;
            } else {
                let data = std::mem::take(&mut self.data);
                self.emit(&data, self.error_field, on_event);
                // Its buffer kept for the next event.
                self.data = data;
            }
        }
        self.reset();
    }

    /// Hands the event of `data` over, with the event name if one came.
    fn emit(&mut self, data: &[u8], error_field: bool, on_event: &mut impl FnMut(SseEvent<'_>)) {
        self.events += 1;
        on_event(SseEvent {
            event: self.has_event_name.then_some(&self.event[..]),
            data,
            error_field,
        });
    }

    /// Ready for the next event.
    fn reset(&mut self) {
        self.data.clear();
        self.event.clear();
        self.has_event_name = false;
        self.has_data = false;
        self.error_field = false;
        self.oversized = false;
    }
}

/// The end of the last event of `frame` (which starts where an event
/// does) that ends at or before `stop`; 0 when none does. Found backwards
/// from `stop`: an event ends where a blank line's line end does, which the
/// bytes around a line end tell (CRLF, LF and CR end lines; a CR ending the
/// frame may be the first half of a CRLF, so it ends nothing yet).
pub(crate) fn last_event_end(frame: &[u8], stop: usize) -> usize {
    // A line starts at `t` when the line end before it ends there.
    let line_starts_at =
        |t: usize| t == 0 || frame[t - 1] == b'\n' || (frame[t - 1] == b'\r' && frame[t] != b'\n');
    let mut upto = stop;
    while let Some(q) = memchr::memrchr2(b'\n', b'\r', &frame[..upto]) {
        upto = q;
        // The line end that ends at q + 1, and where it starts.
        let start = match frame[q] {
            b'\n' if q > 0 && frame[q - 1] == b'\r' => q - 1,
            b'\n' => q,
            // A CR followed by LF: the CRLF is the LF's to end.
            _ => match frame.get(q + 1) {
                Some(b'\n') | None => continue,
                Some(_) => q,
            },
        };
        if line_starts_at(start) {
            return q + 1;
        }
    }
    0
}

/// Where the line ending at `chunk[end]` (LF, CRLF or a bare CR) is left
/// behind, and whether it was a CR closing `chunk`, whose LF, if one comes,
/// opens the next slice.
fn past_line_end(chunk: &[u8], end: usize) -> (usize, bool) {
    match (chunk[end], chunk.get(end + 1)) {
        (b'\r', Some(b'\n')) => (end + 2, false),
        (b'\r', None) => (end + 1, true),
        _ => (end + 1, false),
    }
}

/// A line's field name and value (one leading space dropped); `None` for a
/// comment.
fn field_value(line: &[u8]) -> Option<(&[u8], &[u8])> {
    if line.first() == Some(&b':') {
        return None;
    }
    Some(match memchr::memchr(b':', line) {
        Some(c) => {
            let v = &line[c + 1..];
            (&line[..c], v.strip_prefix(b" ").unwrap_or(v))
        }
        None => (line, &b""[..]),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[derive(Debug, Clone, PartialEq, Eq)]
    struct Owned {
        event: Option<Vec<u8>>,
        data: Vec<u8>,
        error_field: bool,
    }

    fn scan(chunks: &[&[u8]]) -> (Vec<Owned>, u64) {
        let mut s = SseScanner::new();
        let mut out = Vec::new();
        for c in chunks {
            s.feed(c, |e| {
                out.push(Owned {
                    event: e.event.map(<[u8]>::to_vec),
                    data: e.data.to_vec(),
                    error_field: e.error_field,
                })
            });
        }
        (out, s.skipped())
    }

    fn d(s: &str) -> Owned {
        Owned {
            event: None,
            data: s.as_bytes().to_vec(),
            error_field: false,
        }
    }

    #[test]
    fn all_line_endings_and_fields() {
        let (ev, _) = scan(&[b"data: a\n\ndata:b\r\n\r\ndata: c\r\rdata: x\ndata: y\n\n"]);
        assert_eq!(ev, vec![d("a"), d("b"), d("c"), d("x\ny")]);
        let (ev, _) = scan(&[b": ping\n\nevent: error\ndata: {}\nid: 3\nretry: 1\n\n"]);
        assert_eq!(
            ev,
            vec![Owned {
                event: Some(b"error".to_vec()),
                data: b"{}".to_vec(),
                error_field: false
            }]
        );
        let (ev, _) = scan(&[b"error: {\"code\":400}\n\n"]);
        assert!(ev[0].error_field);
        assert_eq!(ev[0].data, b"{\"code\":400}");
    }

    #[test]
    fn crlf_split_across_frames() {
        let (ev, _) = scan(&[b"data: a\r", b"\n\r", b"\ndata: b\r\n", b"\r\n"]);
        assert_eq!(ev, vec![d("a"), d("b")]);
    }

    #[test]
    fn feed_until_stops_after_the_event_that_says_so() {
        let mut s = SseScanner::new();
        let mut seen = Vec::new();
        s.feed_until(b": hi\n\ndata: a\n\ndata: b\n\ndata: c\n\n", |e| {
            seen.push(e.data.to_vec());
            e.data != b"b"
        });
        assert_eq!(seen, [b"a".to_vec(), b"b".to_vec()]);
        assert_eq!(s.events, 2, "the events after it are not scanned");
    }

    #[test]
    fn incomplete_event_is_not_dispatched_until_finish() {
        let mut s = SseScanner::new();
        let mut n = 0;
        s.feed(b"data: [DONE]\n", |_| n += 1);
        assert_eq!(n, 0);
        s.finish(|e| {
            assert_eq!(e.data, b"[DONE]");
            n += 1
        });
        assert_eq!(n, 1);
    }

    #[test]
    fn oversized_event_is_skipped_and_next_survives() {
        let big = vec![b'x'; MAX_EVENT_BYTES + 10];
        let mut stream = b"data: ".to_vec();
        stream.extend_from_slice(&big);
        stream.extend_from_slice(b"\n\ndata: ok\n\n");
        // In one slice and in small slices (partial-line path).
        let (ev, skipped) = scan(&[&stream]);
        assert_eq!((ev, skipped), (vec![d("ok")], 1));
        let parts: Vec<&[u8]> = stream.chunks(4096).collect();
        let (ev, skipped) = scan(&parts);
        assert_eq!((ev, skipped), (vec![d("ok")], 1));
    }

    fn arb_stream() -> impl Strategy<Value = Vec<u8>> {
        let line = prop_oneof![
            "[a-z{}\":, ]{0,12}".prop_map(|s| format!("data: {s}")),
            "[a-z{}\":, ]{0,12}".prop_map(|s| format!("error:{s}")),
            "[a-z]{0,5}".prop_map(|s| format!(": {s}")),
            "[a-z]{1,5}".prop_map(|s| format!("event: {s}")),
            Just(String::new()),
        ];
        let eol = prop_oneof![Just("\n"), Just("\r\n"), Just("\r")];
        proptest::collection::vec((line, eol), 0..30).prop_map(|v| {
            let mut out = Vec::new();
            for (l, e) in v {
                out.extend_from_slice(l.as_bytes());
                out.extend_from_slice(e.as_bytes());
            }
            out
        })
    }

    proptest! {
        #[test]
        fn split_invariance(stream in arb_stream(), cuts in proptest::collection::vec(0usize..400, 0..8)) {
            let (whole, _) = scan(&[&stream]);
            let mut points: Vec<usize> = cuts.into_iter().map(|c| c.min(stream.len())).collect();
            points.sort_unstable();
            let mut parts: Vec<&[u8]> = Vec::new();
            let mut last = 0;
            for p in points { parts.push(&stream[last..p]); last = p; }
            parts.push(&stream[last..]);
            let (split, _) = scan(&parts);
            prop_assert_eq!(whole.clone(), split);
            // Byte-at-a-time is the harshest split.
            let bytes: Vec<&[u8]> = stream.chunks(1).collect();
            let (single, _) = scan(&bytes);
            prop_assert_eq!(whole, single);
        }
    }
}
