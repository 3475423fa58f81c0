//! The HTTP/1 wire rules both directions of the proxy apply, each written
//! once: a `Content-Length` value, the `Connection` tokens, how a
//! response's framing fields decide its body's length (RFC 9112 §6), a
//! `Host` field's validity (§3.2) and the decimal digits of a length.
//!
//! Why one place: the server's fast path, the upstream client, the router
//! and the forwarder each read `Content-Length` under their own rule, so
//! one message could be framed one way on the way in and refused on the
//! way out (a zero-padded length: 400 on one route, 200 on another).
//! hyper's server is the reference wherever it reads the same field: what
//! the fast path accepts, hyper accepts, and the other way round.

use http::header::{self, HeaderMap, HeaderName};

/// A `Content-Length` field value as hyper reads it: a comma-separated
/// list (`5, 5` is one length said twice) of 1*DIGIT (RFC 9110 §8.6, so
/// leading zeros are fine), each trimmed of spaces and tabs, all equal and
/// within a `u64`. Signs, hex, empty items and overflow are no length.
pub(crate) fn content_length(value: &[u8]) -> Option<u64> {
    let mut length = None;
    for item in value.split(|&b| b == b',') {
        let n = digits(trim(item))?;
        if length.is_some_and(|l| l != n) {
            return None;
        }
        length = Some(n);
    }
    length
}

/// The length every `Content-Length` field of `headers` says, when there
/// is one and they agree (`None` for no field, or any bad or differing one).
pub(crate) fn declared_length(headers: &HeaderMap) -> Option<u64> {
    let mut length = None;
    for value in headers.get_all(header::CONTENT_LENGTH) {
        let n = content_length(value.as_bytes())?;
        if length.is_some_and(|l| l != n) {
            return None;
        }
        length = Some(n);
    }
    length
}

/// 1*DIGIT that fits a `u64` (hyper's `from_digits`).
fn digits(v: &[u8]) -> Option<u64> {
    if v.is_empty() {
        return None;
    }
    v.iter().try_fold(0u64, |n, &d| {
        if !d.is_ascii_digit() {
            return None;
        }
        n.checked_mul(10)?.checked_add(u64::from(d - b'0'))
    })
}

/// Trims SP and HTAB from both ends (a field value's optional whitespace).
fn trim(mut v: &[u8]) -> &[u8] {
    while let [b' ' | b'\t', rest @ ..] = v {
        v = rest;
    }
    while let [rest @ .., b' ' | b'\t'] = v {
        v = rest;
    }
    v
}

/// Whether a comma-separated field value lists `token` (any case).
pub(crate) fn has_token(value: &[u8], token: &[u8]) -> bool {
    value
        .split(|&b| b == b',')
        .any(|t| trim(t).eq_ignore_ascii_case(token))
}

/// Whether a `Connection` field value asks to close. `close` anywhere
/// wins over any `keep-alive`, before or after it, in this line or another
/// (as hyper and nginx read it): a later token must not undo it.
pub(crate) fn closes(value: &[u8]) -> bool {
    has_token(value, b"close")
}

/// Whether a `Transfer-Encoding` value's last coding is `chunked`.
pub(crate) fn is_chunked(value: &[u8]) -> bool {
    value
        .rsplit(|&b| b == b',')
        .next()
        .is_some_and(|t| trim(t).eq_ignore_ascii_case(b"chunked"))
}

/// How a response body is delimited.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum BodyLength {
    /// No body (HEAD, 204, 304, or a length of 0).
    Empty,
    Length(u64),
    Chunked,
    /// Until the connection closes.
    ToClose,
}

/// A response's framing, as its head decides it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Framing {
    pub(crate) body: BodyLength,
    /// Whether the connection may carry another message after this one.
    pub(crate) persistent: bool,
    /// The message's `Content-Length` fields are not its length (a
    /// `Transfer-Encoding` is): they must not be forwarded, or the next
    /// hop frames the body by them (RFC 9112 §6.3, 3).
    pub(crate) drop_length: bool,
}

/// The framing and connection fields of a message, as its head is read.
#[derive(Debug, Default)]
pub(crate) struct FramingFields {
    length: Option<u64>,
    bad_length: bool,
    transfer_encoded: bool,
    chunked: bool,
    close: bool,
    keep_alive: bool,
}

impl FramingFields {
    /// Notes one header field.
    pub(crate) fn note(&mut self, name: &HeaderName, value: &[u8]) {
        if name == header::CONTENT_LENGTH {
            match content_length(value) {
                Some(n) if self.length.is_none_or(|l| l == n) => self.length = Some(n),
                _ => self.bad_length = true,
            }
        } else if name == header::TRANSFER_ENCODING {
            self.transfer_encoded = true;
            // The last field's last coding decides (as hyper reads it).
            self.chunked = is_chunked(value);
        } else if name == header::CONNECTION {
            self.close |= closes(value);
            self.keep_alive |= has_token(value, b"keep-alive");
        }
    }

    /// A response's framing (RFC 9112 §6.3), `bodiless` for a HEAD
    /// request's or a 204 or 304; `Err` for framing no length can be read
    /// from: the message is refused and its connection dropped.
    pub(crate) fn response(&self, http11: bool, bodiless: bool) -> Result<Framing, &'static str> {
        if self.transfer_encoded && !http11 {
            // §6.1: faulty framing, even with a Content-Length; an
            // HTTP/1.0 peer has no chunked coding to end the body with.
            return Err("Transfer-Encoding in an HTTP/1.0 response");
        }
        let mut persistent = !self.close && (http11 || self.keep_alive);
        let has_length = self.length.is_some() || self.bad_length;
        let body = if bodiless {
            if self.bad_length && !self.transfer_encoded {
                return Err("bad Content-Length");
            }
            BodyLength::Empty
        } else if self.transfer_encoded {
            if self.chunked {
                BodyLength::Chunked
            } else {
                BodyLength::ToClose
            }
        } else if self.bad_length {
            return Err("bad Content-Length");
        } else {
            match self.length {
                Some(0) => BodyLength::Empty,
                Some(n) => BodyLength::Length(n),
                None => BodyLength::ToClose,
            }
        };
        if self.transfer_encoded && has_length {
            // Both: the message may be crafted to be read two ways; it is
            // read by its Transfer-Encoding and the connection not trusted
            // after it.
            persistent = false;
        }
        if body == BodyLength::ToClose {
            persistent = false;
        }
        Ok(Framing {
            body,
            persistent,
            drop_length: self.transfer_encoded && has_length,
        })
    }
}

/// Why an HTTP/1.1 request's `Host` fields are refused (RFC 9112 §3.2:
/// none, more than one, or a value that is no `uri-host [ ":" port ]`);
/// `None` when they are fine. An empty value is one (a target with no
/// authority has an empty Host).
pub(crate) fn host_problem(headers: &HeaderMap) -> Option<&'static str> {
    let mut values = headers.get_all(header::HOST).into_iter();
    let Some(host) = values.next() else {
        return Some("missing Host header");
    };
    if values.next().is_some() {
        return Some("more than one Host header");
    }
    if !host.as_bytes().iter().all(|&b| host_byte(b)) {
        return Some("invalid Host header");
    }
    None
}

/// A byte of `uri-host [ ":" port ]`: unreserved, pct-encoded, sub-delims,
/// the port's colon and an IP literal's brackets (RFC 3986 §3.2.2).
fn host_byte(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"-._~%!$&'()*+,;=:[]".contains(&b)
}

/// `v`'s ASCII digits, written into `buf` from its end (a
/// `Content-Length` value, and the log lines' integers) without the
/// formatting machinery. Bytes, not a `str`: heads and log lines are bytes.
pub(crate) fn decimal(mut v: u64, buf: &mut [u8; 20]) -> &[u8] {
    let mut at = buf.len();
    loop {
        at -= 1;
        buf[at] = b'0' + (v % 10) as u8;
        v /= 10;
        if v == 0 {
            break;
        }
    }
    &buf[at..]
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    #[test]
    fn content_length_values() {
        let cases: &[(&str, Option<u64>)] = &[
            ("0", Some(0)),
            ("92", Some(92)),
            ("00000000000000000092", Some(92)),
            ("0000000000000000000000000000000000000092", Some(92)),
            (" 7\t", Some(7)),
            ("5, 5", Some(5)),
            ("5,5,5", Some(5)),
            ("18446744073709551615", Some(u64::MAX)),
            ("018446744073709551615", Some(u64::MAX)),
            ("18446744073709551616", None),
            ("99999999999999999999", None),
            ("5, 6", None),
            ("5,", None),
            (",5", None),
            ("", None),
            (" ", None),
            ("+3", None),
            ("-3", None),
            ("0x10", None),
            ("1 2", None),
            ("3a", None),
            ("\u{b3}", None),
        ];
        for &(v, want) in cases {
            assert_eq!(content_length(v.as_bytes()), want, "{v:?}");
        }
    }

    #[test]
    fn declared_length_of_all_fields() {
        let map = |values: &[&str]| {
            let mut m = HeaderMap::new();
            for v in values {
                m.append(header::CONTENT_LENGTH, HeaderValue::from_str(v).unwrap());
            }
            m
        };
        assert_eq!(declared_length(&map(&[])), None);
        assert_eq!(declared_length(&map(&["12"])), Some(12));
        assert_eq!(declared_length(&map(&["12", "012"])), Some(12));
        assert_eq!(declared_length(&map(&["12", "13"])), None);
        assert_eq!(declared_length(&map(&["12", "x"])), None);
    }

    #[test]
    fn connection_tokens() {
        let cases: &[(&[&str], bool)] = &[
            (&["close"], true),
            (&["Close"], true),
            (&[" close "], true),
            (&["close, keep-alive"], true),
            (&["keep-alive, close"], true),
            (&["keep-alive", "close"], true),
            (&["close", "keep-alive"], true),
            (&["upgrade,close"], true),
            (&["keep-alive"], false),
            (&["closed"], false),
            (&["x-close"], false),
            (&[""], false),
        ];
        for &(lines, want) in cases {
            let mut f = FramingFields::default();
            for line in lines {
                f.note(&header::CONNECTION, line.as_bytes());
            }
            let persistent = f.response(true, false).map(|f| f.persistent);
            let mut g = FramingFields::default();
            g.note(&header::CONTENT_LENGTH, b"1");
            for line in lines {
                g.note(&header::CONNECTION, line.as_bytes());
            }
            let framing = g.response(true, false).unwrap();
            assert_eq!(framing.persistent, !want, "{lines:?}");
            assert_eq!(
                lines.iter().any(|l| closes(l.as_bytes())),
                want,
                "{lines:?}"
            );
            // Without a length the body runs to the close either way.
            assert_eq!(persistent, Ok(false), "{lines:?}");
        }
    }

    // A table of cases: its length is the cases, not logic.
    #[allow(clippy::too_many_lines)]
    #[test]
    fn response_framing() {
        use BodyLength::*;
        // (fields, HTTP/1.1?, bodiless?, framing: body, persistent, drop_length)
        type Case = (
            &'static [(&'static str, &'static str)],
            bool,
            bool,
            Result<(BodyLength, bool, bool), ()>,
        );
        let cases: &[Case] = &[
            (
                &[("content-length", "10")],
                true,
                false,
                Ok((Length(10), true, false)),
            ),
            (
                &[("content-length", "0")],
                true,
                false,
                Ok((Empty, true, false)),
            ),
            (&[], true, false, Ok((ToClose, false, false))),
            (
                &[("transfer-encoding", "chunked")],
                true,
                false,
                Ok((Chunked, true, false)),
            ),
            (
                &[("transfer-encoding", "gzip, chunked")],
                true,
                false,
                Ok((Chunked, true, false)),
            ),
            (
                &[("transfer-encoding", "chunked, gzip")],
                true,
                false,
                Ok((ToClose, false, false)),
            ),
            (
                &[("transfer-encoding", "gzip")],
                true,
                false,
                Ok((ToClose, false, false)),
            ),
            // TE and CL: read by TE, the length dropped, not reused.
            (
                &[("content-length", "10"), ("transfer-encoding", "chunked")],
                true,
                false,
                Ok((Chunked, false, true)),
            ),
            (
                &[("transfer-encoding", "chunked"), ("content-length", "10")],
                true,
                false,
                Ok((Chunked, false, true)),
            ),
            (
                &[("transfer-encoding", "gzip"), ("content-length", "10")],
                true,
                false,
                Ok((ToClose, false, true)),
            ),
            // A TE makes even a bad length no length (as hyper reads it).
            (
                &[("transfer-encoding", "chunked"), ("content-length", "x")],
                true,
                false,
                Ok((Chunked, false, true)),
            ),
            (&[("content-length", "x")], true, false, Err(())),
            (
                &[("content-length", "1"), ("content-length", "2")],
                true,
                false,
                Err(()),
            ),
            (
                &[("content-length", "1"), ("content-length", "01")],
                true,
                false,
                Ok((Length(1), true, false)),
            ),
            // HTTP/1.0: close unless keep-alive; a TE is faulty framing.
            (
                &[("content-length", "3")],
                false,
                false,
                Ok((Length(3), false, false)),
            ),
            (
                &[("content-length", "3"), ("connection", "keep-alive")],
                false,
                false,
                Ok((Length(3), true, false)),
            ),
            (
                &[("content-length", "3"), ("connection", "keep-alive, close")],
                false,
                false,
                Ok((Length(3), false, false)),
            ),
            (&[("transfer-encoding", "chunked")], false, false, Err(())),
            (
                &[("transfer-encoding", "chunked"), ("content-length", "3")],
                false,
                false,
                Err(()),
            ),
            // Bodiless: no body whatever the fields say.
            (
                &[("content-length", "10")],
                true,
                true,
                Ok((Empty, true, false)),
            ),
            (
                &[("transfer-encoding", "chunked")],
                true,
                true,
                Ok((Empty, true, false)),
            ),
            (
                &[("transfer-encoding", "chunked"), ("content-length", "10")],
                true,
                true,
                Ok((Empty, false, true)),
            ),
        ];
        for (fields, http11, bodiless, want) in cases {
            let mut f = FramingFields::default();
            for (name, value) in fields.iter() {
                f.note(&HeaderName::from_static(name), value.as_bytes());
            }
            let got = f
                .response(*http11, *bodiless)
                .map(|f| (f.body, f.persistent, f.drop_length))
                .map_err(|_| ());
            assert_eq!(&got, want, "{fields:?} http11={http11} bodiless={bodiless}");
        }
    }

    #[test]
    fn host_fields() {
        let cases: &[(&[&str], bool)] = &[
            (&["api.openai.com"], true),
            (&["localhost:8080"], true),
            (&["127.0.0.1:1"], true),
            (&["[::1]:8080"], true),
            (&["xn--bcher-kva.example"], true),
            (&["under_score.example"], true),
            (&[""], true),
            (&[], false),
            (&["a", "a"], false),
            (&["a", "b"], false),
            (&["a b"], false),
            (&[" a"], false),
            (&["a\tb"], false),
            (&["a/b"], false),
            (&["a?b"], false),
            (&["a#b"], false),
            (&["user@a"], false),
            (&["a\"b"], false),
        ];
        for &(values, ok) in cases {
            let mut map = HeaderMap::new();
            for v in values {
                map.append(header::HOST, HeaderValue::from_str(v).unwrap());
            }
            assert_eq!(host_problem(&map).is_none(), ok, "{values:?}");
        }
    }

    #[test]
    fn decimal_digits() {
        for n in [0, 7, 10, 99, 4096, 123_456_789, u64::MAX] {
            assert_eq!(decimal(n, &mut [0; 20]), n.to_string().as_bytes(), "{n}");
        }
    }

    #[test]
    fn tokens_and_codings() {
        assert!(has_token(b"gzip, Trailers", b"trailers"));
        assert!(!has_token(b"trailersx", b"trailers"));
        assert!(is_chunked(b"gzip, chunked "));
        assert!(!is_chunked(b"chunked, gzip"));
        assert!(!is_chunked(b""));
    }
}
