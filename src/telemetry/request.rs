//! The one log line every request writes, written straight into the log
//! batch when the output is plain text.
//!
//! Through tracing the line cost ~6,800 instructions a request (8% of a
//! small chat request's): each field is dispatched to the formatter's
//! visitor, each float is formatted by the shortest-representation
//! algorithm, and the event goes through the subscriber's context. Written
//! here the line is byte for byte what the text format writes (a test holds
//! them together) for ~1,500. JSON output and colour still go through
//! tracing, and so does any filtering: `RUST_LOG` decides as before.

use std::io::Write as _;
use std::sync::OnceLock;

use tracing::Level;
use tracing_subscriber::fmt::MakeWriter;

use super::BatchWriter;

/// The target the line is logged under (what `RUST_LOG` filters on).
pub const TARGET: &str = "compactor::server::router";

/// The batch the plain text format writes into, when that is the format.
static PLAIN: OnceLock<BatchWriter<std::io::Stdout>> = OnceLock::new();

thread_local! {
    /// Where a line is put together before it is copied into the batch.
    static LINE: std::cell::RefCell<Vec<u8>> = std::cell::RefCell::new(Vec::with_capacity(256));
}

/// Plain text goes to `writer`: the line is written there directly.
pub(super) fn write_plain_to(writer: BatchWriter<std::io::Stdout>) {
    let _ = PLAIN.set(writer);
}

/// One request's figures (content-free).
#[derive(Debug, Clone, Copy)]
pub struct RequestLine<'a> {
    /// The method.
    pub method: &'a str,
    /// The path, without the query.
    pub path: &'a str,
    /// The route label.
    pub route: &'static str,
    /// The response status.
    pub status: u16,
    /// Request body bytes read.
    pub bytes_in: u64,
    /// Response body bytes written.
    pub bytes_out: u64,
    /// Time waiting for the upstream's response head, when it was asked,
    /// in microseconds (written as milliseconds).
    pub upstream_us: Option<u64>,
    /// Time from the request head to the end of the response, in
    /// microseconds (written as milliseconds).
    pub total_us: u64,
    /// How the response body ended.
    pub eos: &'static str,
}

/// Logs `l` at INFO under [`TARGET`].
pub fn log(l: &RequestLine<'_>) {
    if !tracing::enabled!(
        target: TARGET,
        Level::INFO,
        method,
        path,
        route,
        status,
        bytes_in,
        bytes_out,
        upstream_ms,
        total_ms,
        eos
    ) {
        return;
    }
    if let Some(w) = PLAIN.get() {
        if let Ok(d) = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH) {
            // The thread's own buffer: a line is not worth an allocation.
            LINE.with_borrow_mut(|line| {
                line.clear();
                line.extend_from_slice(&super::line::timestamp(d.as_secs(), d.subsec_micros()));
                line.push(b' ');
                plain(line, l);
                let _ = w.make_writer().write_all(line);
            });
            return;
        }
    }
    tracing::info!(
        target: TARGET,
        method = %l.method,
        path = %l.path,
        route = l.route,
        status = l.status,
        bytes_in = l.bytes_in,
        bytes_out = l.bytes_out,
        upstream_ms = l.upstream_us.map(millis),
        total_ms = millis(l.total_us),
        eos = l.eos,
        "request"
    );
}

/// The line after its timestamp, as the text format writes it with
/// [`super::line::PlainFields`]. Bytes, not a `String`: its integers are
/// digits written into it, not characters pushed one by one.
fn plain(out: &mut Vec<u8>, l: &RequestLine<'_>) {
    out.extend_from_slice(b" INFO ");
    out.extend_from_slice(TARGET.as_bytes());
    out.extend_from_slice(b": request method=");
    out.extend_from_slice(l.method.as_bytes());
    out.extend_from_slice(b" path=");
    out.extend_from_slice(l.path.as_bytes());
    out.extend_from_slice(b" route=");
    label(out, l.route);
    out.extend_from_slice(b" status=");
    push_int(out, u64::from(l.status));
    out.extend_from_slice(b" bytes_in=");
    push_int(out, l.bytes_in);
    out.extend_from_slice(b" bytes_out=");
    push_int(out, l.bytes_out);
    if let Some(us) = l.upstream_us {
        out.extend_from_slice(b" upstream_ms=");
        push_millis(out, us);
    }
    out.extend_from_slice(b" total_ms=");
    push_millis(out, l.total_us);
    out.extend_from_slice(b" eos=");
    label(out, l.eos);
    out.push(b'\n');
}

/// A label field (a route's, an end of stream's: lowercase words, which
/// `Debug` quotes and has nothing to escape in) as the visitor writes it.
/// Every route's and every end's label is held to that by a test
/// (`route_labels_are_written_quoted_as_they_are`,
/// `eos_labels_are_written_quoted_as_they_are`), not checked per line.
fn label(out: &mut Vec<u8>, s: &'static str) {
    debug_assert!(plain_label(s), "{s}");
    out.push(b'"');
    out.extend_from_slice(s.as_bytes());
    out.push(b'"');
}

/// Whether `Debug` writes `s` as its bytes between quotes.
fn plain_label(s: &str) -> bool {
    s.bytes().all(|b| b.is_ascii_lowercase() || b == b'_')
}

fn push_int(out: &mut Vec<u8>, v: u64) {
    out.extend_from_slice(crate::http1::decimal(v, &mut [0; 20]));
}

/// A duration in whole microseconds as milliseconds, as the text format
/// writes the `f64` field (`{:?}`): below 10^9 ms a whole number of
/// thousandths has one shortest representation, its digits, so it is
/// written from the integer (no float is formatted or rounded).
fn push_millis(out: &mut Vec<u8>, us: u64) {
    push_int(out, us / 1000);
    out.push(b'.');
    let frac = us % 1000;
    let digits = [frac / 100, frac / 10 % 10, frac % 10];
    let keep = match digits {
        [_, 0, 0] => 1,
        [_, _, 0] => 2,
        _ => 3,
    };
    out.extend(digits[..keep].iter().map(|&d| b'0' + d as u8));
}

/// Microseconds as the milliseconds field tracing's formats write.
fn millis(us: u64) -> f64 {
    us as f64 / 1e3
}

/// `d` in whole microseconds, rounded to the nearest (half up).
pub fn micros(d: std::time::Duration) -> u64 {
    u64::try_from(d.as_nanos().saturating_add(500) / 1000).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use crate::telemetry::capture::Captured;

    use super::*;

    #[test]
    fn millis_are_written_as_debug_writes_the_float() {
        let mut cases: Vec<u64> = (0..200_000).collect();
        cases.extend((0..2_000u64).map(|n| n * 999_983));
        cases.extend((0..2_000u64).map(|n| 999_999_999_999 - n * 7_919));
        cases.extend([1_000_000, 123_456_789_123, 999_999_999_999]);
        for us in cases {
            let mut ours = Vec::new();
            push_millis(&mut ours, us);
            assert_eq!(ours, format!("{:?}", millis(us)).as_bytes(), "{us}");
        }
    }

    #[test]
    fn micros_round_to_the_nearest() {
        use std::time::Duration;
        assert_eq!(micros(Duration::from_nanos(0)), 0);
        assert_eq!(micros(Duration::from_nanos(499)), 0);
        assert_eq!(micros(Duration::from_nanos(500)), 1);
        assert_eq!(micros(Duration::from_nanos(1_499)), 1);
        assert_eq!(micros(Duration::from_nanos(104_500)), 105);
        assert_eq!(micros(Duration::from_secs(30)), 30_000_000);
        assert_eq!(micros(Duration::MAX), u64::MAX);
    }

    #[test]
    fn the_line_is_what_the_text_format_writes() {
        let lines = [
            RequestLine {
                method: "POST",
                path: "/v1/chat/completions",
                route: "chat",
                status: 200,
                bytes_in: 79,
                bytes_out: 271,
                upstream_us: Some(104),
                total_us: 250,
                eos: "complete",
            },
            RequestLine {
                method: "GET",
                path: "/v1/models",
                route: "passthrough",
                status: 502,
                bytes_in: 0,
                bytes_out: 18_446_744_073_709_551_615,
                upstream_us: None,
                total_us: 30_000_000,
                eos: "cancelled",
            },
        ];
        for l in lines {
            let buf = Captured::default();
            let subscriber = tracing_subscriber::fmt()
                .with_ansi(false)
                .without_time()
                .fmt_fields(super::super::line::PlainFields)
                .with_writer(buf.clone())
                .finish();
            // The fallback path: no plain batch is installed in tests.
            tracing::subscriber::with_default(subscriber, || log(&l));
            let theirs = buf.text();
            let mut ours = Vec::new();
            plain(&mut ours, &l);
            let ours = String::from_utf8(ours).unwrap();
            // Without a timestamp the text format starts at the level.
            assert_eq!(ours.trim_start(), theirs.trim_start(), "{l:?}");
            assert!(ours.starts_with(" INFO "));
        }
    }
}
