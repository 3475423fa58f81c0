//! The text log line, formatted cheaply.
//!
//! tracing-subscriber's own formatter spends about 15,000 instructions on
//! the per-request line: the timestamp is rebuilt from the epoch each time,
//! and every field goes through ANSI style wrappers even when colour is off,
//! then the message through a char-by-char escaping writer. That was 15% of
//! compactor's user-space instructions per request against a fast upstream
//! (`scripts/bench_instructions.sh`). These two pieces plug into the same
//! formatter and give the same layout:
//!
//! - [`CachedUtc`]: RFC 3339 UTC with microseconds, as
//!   `tracing_subscriber::fmt::time::SystemTime` writes it; the date and time
//!   of day are formatted once per second per thread.
//! - [`PlainFields`]: `message name=value ...` as `DefaultFields` writes it
//!   without colour; the message still has terminal control characters
//!   escaped, but only a message that contains one pays for it.

use std::cell::Cell;
use std::fmt::{self, Write as _};
use std::time::{SystemTime, UNIX_EPOCH};

use tracing::field::{Field, Visit};
use tracing_subscriber::field::RecordFields;
use tracing_subscriber::fmt::format::Writer;
use tracing_subscriber::fmt::time::FormatTime;
use tracing_subscriber::fmt::FormatFields;

use crate::http1::decimal;

/// RFC 3339 UTC timestamps with microseconds (see the module docs).
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct CachedUtc;

/// `YYYY-MM-DDTHH:MM:SS`
const SECOND_LEN: usize = 19;
/// `YYYY-MM-DDTHH:MM:SS.ffffffZ`
pub(super) const STAMP_LEN: usize = SECOND_LEN + 8;

thread_local! {
    /// The last second formatted on this thread.
    static SECOND: Cell<(u64, [u8; SECOND_LEN])> = const { Cell::new((u64::MAX, [0; SECOND_LEN])) };
}

impl FormatTime for CachedUtc {
    fn format_time(&self, w: &mut Writer<'_>) -> fmt::Result {
        match SystemTime::now().duration_since(UNIX_EPOCH) {
            Ok(d) => write_timestamp(w, d.as_secs(), d.subsec_micros()),
            // Before 1970: not worth a fast path.
            Err(_) => tracing_subscriber::fmt::time::SystemTime.format_time(w),
        }
    }
}

/// Writes `secs.micros` since the epoch as `YYYY-MM-DDTHH:MM:SS.ffffffZ`.
pub(super) fn write_timestamp(w: &mut impl fmt::Write, secs: u64, micros: u32) -> fmt::Result {
    // ASCII by construction.
    w.write_str(std::str::from_utf8(&timestamp(secs, micros)).map_err(|_| fmt::Error)?)
}

/// `secs.micros` since the epoch as `YYYY-MM-DDTHH:MM:SS.ffffffZ`, its
/// second formatted once per second on each thread.
pub(super) fn timestamp(secs: u64, micros: u32) -> [u8; STAMP_LEN] {
    let (cached, mut text) = SECOND.with(Cell::get);
    if cached != secs {
        text = format_second(secs);
        SECOND.with(|c| c.set((secs, text)));
    }
    let mut out = [0u8; STAMP_LEN];
    out[..SECOND_LEN].copy_from_slice(&text);
    out[SECOND_LEN..].copy_from_slice(b".000000Z");
    let mut m = micros.min(999_999);
    for slot in out[SECOND_LEN + 1..STAMP_LEN - 1].iter_mut().rev() {
        *slot = b'0' + (m % 10) as u8;
        m /= 10;
    }
    out
}

/// `YYYY-MM-DDTHH:MM:SS` of `secs` since the epoch (years up to 9999).
fn format_second(secs: u64) -> [u8; SECOND_LEN] {
    let (days, rem) = (secs / 86_400, secs % 86_400);
    let (y, m, d) = crate::civil::civil_from_days(days as i64);
    let mut out = *b"0000-00-00T00:00:00";
    let mut put = |at: usize, width: usize, mut v: u64| {
        for slot in out[at..at + width].iter_mut().rev() {
            *slot = b'0' + (v % 10) as u8;
            v /= 10;
        }
    };
    put(0, 4, y.clamp(0, 9999) as u64);
    put(5, 2, u64::from(m));
    put(8, 2, u64::from(d));
    put(11, 2, rem / 3600);
    put(14, 2, rem % 3600 / 60);
    put(17, 2, rem % 60);
    out
}

/// Fields as `DefaultFields` writes them without colour (see the module docs).
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct PlainFields;

impl<'writer> FormatFields<'writer> for PlainFields {
    fn format_fields<R: RecordFields>(&self, writer: Writer<'writer>, fields: R) -> fmt::Result {
        let mut v = PlainVisitor {
            writer,
            first: true,
            result: Ok(()),
        };
        fields.record(&mut v);
        v.result
    }
}

struct PlainVisitor<'a> {
    writer: Writer<'a>,
    first: bool,
    result: fmt::Result,
}

impl PlainVisitor<'_> {
    /// Writes the separator and `name=` (nothing for the message), then the
    /// value with `value`. Plain `write_str` calls: nested `format_args!`
    /// cost several hundred instructions per field.
    fn field(&mut self, field: &Field, value: impl FnOnce(&mut Writer<'_>) -> fmt::Result) {
        if self.result.is_err() {
            return;
        }
        let w = &mut self.writer;
        let mut r = if std::mem::take(&mut self.first) {
            Ok(())
        } else {
            w.write_char(' ')
        };
        match field.name() {
            "message" => {}
            name => {
                let name = name.strip_prefix("r#").unwrap_or(name);
                r = r
                    .and_then(|()| w.write_str(name))
                    .and_then(|()| w.write_char('='));
            }
        }
        self.result = r.and_then(|()| value(w));
    }

    fn is_message(field: &Field) -> bool {
        field.name() == "message"
    }
}

/// Writes an integer without the formatting machinery.
fn write_int(w: &mut Writer<'_>, negative: bool, v: u64) -> fmt::Result {
    if negative {
        w.write_char('-')?;
    }
    // Only ASCII digits were written.
    w.write_str(std::str::from_utf8(decimal(v, &mut [0; 20])).map_err(|_| fmt::Error)?)
}

impl Visit for PlainVisitor<'_> {
    fn record_u64(&mut self, field: &Field, value: u64) {
        self.field(field, |w| write_int(w, false, value));
    }

    fn record_i64(&mut self, field: &Field, value: i64) {
        self.field(field, |w| write_int(w, value < 0, value.unsigned_abs()));
    }

    fn record_bool(&mut self, field: &Field, value: bool) {
        self.field(field, |w| w.write_str(if value { "true" } else { "false" }));
    }

    fn record_str(&mut self, field: &Field, value: &str) {
        if Self::is_message(field) {
            self.field(field, |w| Escaping(w).write_str(value));
        } else if value
            .bytes()
            .all(|b| b.is_ascii_graphic() && b != b'"' && b != b'\\' || b == b' ')
        {
            // Debug would add nothing but the quotes.
            self.field(field, |w| {
                w.write_char('"')?;
                w.write_str(value)?;
                w.write_char('"')
            });
        } else {
            self.field(field, |w| write!(w, "{value:?}"));
        }
    }

    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        if Self::is_message(field) {
            self.field(field, |w| write!(Escaping(w), "{value:?}"));
        } else {
            self.field(field, |w| write!(w, "{value:?}"));
        }
    }
}

/// Escapes what a terminal would act on (ESC, BEL, BS, FF, DEL and the C1
/// controls), as tracing-subscriber does for messages. Text without any is
/// written through in one piece.
struct Escaping<'a, W>(&'a mut W);

fn needs_escape(c: char) -> bool {
    matches!(
        c,
        '\x1b' | '\x07' | '\x08' | '\x0c' | '\x7f' | '\u{80}'..='\u{9f}'
    )
}

impl<W: fmt::Write> fmt::Write for Escaping<'_, W> {
    fn write_str(&mut self, s: &str) -> fmt::Result {
        // Only C0/DEL bytes and the 0xC2 lead byte of C1 controls can start
        // an escape: a byte scan rules most text out.
        if !s.bytes().any(|b| b < 0x20 || b == 0x7f || b == 0xc2) {
            return self.0.write_str(s);
        }
        for c in s.chars() {
            if !needs_escape(c) {
                self.0.write_char(c)?;
            } else if c < '\u{80}' {
                write!(self.0, "\\x{:02x}", c as u32)?;
            } else {
                write!(self.0, "\\u{{{:x}}}", c as u32)?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use crate::telemetry::capture::Captured;

    use super::*;

    fn stamp(secs: u64, micros: u32) -> String {
        let mut s = String::new();
        write_timestamp(&mut s, secs, micros).unwrap();
        s
    }

    #[test]
    fn timestamps_match_known_dates() {
        // Expected values from Python's datetime.
        assert_eq!(stamp(0, 0), "1970-01-01T00:00:00.000000Z");
        assert_eq!(stamp(951_782_400, 7), "2000-02-29T00:00:00.000007Z");
        assert_eq!(stamp(1_709_164_800, 999_999), "2024-02-29T00:00:00.999999Z");
        assert_eq!(stamp(1_796_040_684, 123_456), "2026-11-30T12:11:24.123456Z");
        assert_eq!(stamp(4_102_444_799, 500_000), "2099-12-31T23:59:59.500000Z");
        // The cache is per second: going back in time is not served from it.
        assert_eq!(stamp(0, 1), "1970-01-01T00:00:00.000001Z");
    }

    #[test]
    fn timestamp_agrees_with_tracing_subscriber_now() {
        // Same second, same text up to the fraction (retry across a tick).
        for _ in 0..3 {
            let (mut ours, mut theirs) = (String::new(), String::new());
            CachedUtc.format_time(&mut Writer::new(&mut ours)).unwrap();
            tracing_subscriber::fmt::time::SystemTime
                .format_time(&mut Writer::new(&mut theirs))
                .unwrap();
            assert_eq!(ours.len(), theirs.len(), "{ours} vs {theirs}");
            if ours[..SECOND_LEN] == theirs[..SECOND_LEN] {
                return;
            }
        }
        panic!("timestamps disagree");
    }

    fn emit_all() {
        let path = "/v1/chat/completions";
        let none: Option<f64> = None;
        tracing::info!(
            method = %"POST",
            path = %path,
            route = "chat",
            status = 200u16,
            delta = -3i64,
            ok = true,
            upstream_ms = Some(3.06),
            missing = none,
            total_ms = 6.106,
            debug = ?("a", 1),
            r#type = "x",
            quoted = "say \"hi\"\n",
            plain = "a b~",
            unicode = "é",
            big = u64::MAX,
            small = i64::MIN,
            "request"
        );
        tracing::warn!(n = 1, "formatted {} message", 2);
        tracing::info!(only = 1);
        tracing::info!("escape \x1b[31m and \u{9b} and \x07 but not é or \t");
    }

    /// Lines of `emit_all` under both field formatters, without time.
    fn lines(ours: bool) -> String {
        let buf = Captured::default();
        let builder = tracing_subscriber::fmt()
            .with_ansi(false)
            .without_time()
            .with_writer(buf.clone());
        if ours {
            tracing::subscriber::with_default(builder.fmt_fields(PlainFields).finish(), emit_all);
        } else {
            tracing::subscriber::with_default(builder.finish(), emit_all);
        }
        buf.text()
    }

    #[test]
    fn fields_are_written_as_tracing_subscriber_writes_them() {
        let ours = lines(true);
        assert_eq!(ours, lines(false));
        // And the test covers what it claims to.
        assert_eq!(ours.lines().count(), 4, "{ours}");
        assert!(ours.contains(r#"request method=POST path=/v1/chat/completions route="chat" status=200 delta=-3 ok=true upstream_ms=3.06 total_ms=6.106 debug=("a", 1) type="x" quoted="say \"hi\"\n" plain="a b~" unicode="é" big=18446744073709551615 small=-9223372036854775808"#), "{ours}");
        assert!(
            ours.contains("escape \\x1b[31m and \\u{9b} and \\x07 but not é or \t"),
            "{ours}"
        );
    }
}
