use super::*;
use proptest::prelude::*;

/// Parses a response head out of `wire`, then decodes its body from the
/// rest, `cuts` deciding where each read ends (as the socket delivers).
/// Returns the head, the body's bytes, its trailers and the bytes left.
fn read_all(
    wire: &[u8],
    is_head: bool,
    cuts: &[usize],
) -> Result<(Head, Vec<u8>, Option<HeaderMap>, usize), Error> {
    read_with(wire, is_head, cuts, false)
}

/// [`read_all`]; with `join`, each data frame is joined with the data read
/// after it, as [`Reading`] sends a body on.
fn read_with(
    wire: &[u8],
    is_head: bool,
    cuts: &[usize],
    join: bool,
) -> Result<(Head, Vec<u8>, Option<HeaderMap>, usize), Error> {
    let r = read_response(wire, is_head, cuts, join)?;
    Ok((r.head, r.body, r.trailers, r.left))
}

fn chunked(parts: &[&[u8]], trailers: &str) -> Vec<u8> {
    chunked_with(parts, trailers, |_| "\r\n")
}

/// [`chunked`], the line end after chunk `i`'s size and data `eol(i)`.
fn chunked_with(parts: &[&[u8]], trailers: &str, eol: impl Fn(usize) -> &'static str) -> Vec<u8> {
    let mut w = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n".to_vec();
    for (i, p) in parts.iter().enumerate() {
        let ext = if i % 2 == 0 { ";ext=1" } else { "" };
        w.extend_from_slice(format!("{:x}{ext}{}", p.len(), eol(i)).as_bytes());
        w.extend_from_slice(p);
        w.extend_from_slice(eol(i).as_bytes());
    }
    w.extend_from_slice(b"0\r\n");
    w.extend_from_slice(trailers.as_bytes());
    w.extend_from_slice(b"\r\n");
    w
}

proptest! {
    /// However the socket cuts a chunked body, the same bytes and trailers
    /// come out, and the body ends exactly where it ends.
    #[test]
    fn a_chunked_body_decodes_the_same_whatever_the_reads(
        parts in prop::collection::vec(prop::collection::vec(any::<u8>(), 1..300), 0..8),
        cuts in prop::collection::vec(1usize..40, 0..64),
        with_trailers in any::<bool>(),
    ) {
        let parts: Vec<&[u8]> = parts.iter().map(Vec::as_slice).collect();
        let trailers = if with_trailers { "x-sum: 7\r\nx-more: a b\r\n" } else { "" };
        let mut wire = chunked(&parts, trailers);
        wire.extend_from_slice(b"HTTP/1.1 200 OK\r\n");
        let (head, data, got_trailers, left) = read_all(&wire, false, &cuts).unwrap();
        prop_assert_eq!(data, parts.concat());
        prop_assert!(head.decoder.is_done());
        prop_assert_eq!(left, b"HTTP/1.1 200 OK\r\n".len(), "the next response is not eaten");
        match got_trailers {
            Some(t) => {
                prop_assert!(with_trailers);
                prop_assert_eq!(t.get("x-sum").unwrap(), "7");
                prop_assert_eq!(t.get("x-more").unwrap(), "a b");
            }
            None => prop_assert!(!with_trailers),
        }
    }

    /// Joined as a body is sent on (whole chunks read by offset, the rest
    /// step by step), the same bytes and trailers come out, whatever the
    /// reads and whichever chunks end their lines with a bare LF.
    #[test]
    fn a_chunked_body_joined_decodes_the_same_whatever_the_reads(
        parts in prop::collection::vec(prop::collection::vec(any::<u8>(), 1..300), 0..12),
        cuts in prop::collection::vec(1usize..600, 0..16),
        bare_lf in any::<u16>(),
        with_trailers in any::<bool>(),
    ) {
        let parts: Vec<&[u8]> = parts.iter().map(Vec::as_slice).collect();
        let trailers = if with_trailers { "x-sum: 7\r\n" } else { "" };
        let mut wire = chunked_with(&parts, trailers, |i| if bare_lf >> i & 1 == 1 { "\n" } else { "\r\n" });
        wire.extend_from_slice(b"HTTP/1.1 200 OK\r\n");
        let (head, data, got_trailers, left) = read_with(&wire, false, &cuts, true).unwrap();
        prop_assert_eq!(data, parts.concat());
        prop_assert!(head.decoder.is_done());
        prop_assert_eq!(left, b"HTTP/1.1 200 OK\r\n".len(), "the next response is not eaten");
        prop_assert_eq!(got_trailers.is_some(), with_trailers);
    }

    /// A sized body, cut anywhere, is its Content-Length bytes.
    #[test]
    fn a_sized_body_decodes_the_same_whatever_the_reads(
        body in prop::collection::vec(any::<u8>(), 1..2000),
        cuts in prop::collection::vec(1usize..300, 0..32),
    ) {
        let mut wire = format!("HTTP/1.1 200 OK\r\ncontent-length: {}\r\n\r\n", body.len()).into_bytes();
        wire.extend_from_slice(&body);
        let (head, data, _, left) = read_all(&wire, false, &cuts).unwrap();
        prop_assert_eq!(data, body);
        prop_assert!(head.keep_alive);
        prop_assert_eq!(left, 0);
    }

    /// A length is read as the standard library reads the same digits
    /// (leading zeros too, as hyper reads them); any other byte, a sign or
    /// a value past `u64::MAX` makes it no length. (Lists and optional
    /// whitespace are `http1`'s table.)
    #[test]
    fn a_length_is_its_digits_and_nothing_else(v in prop::collection::vec(any::<u8>(), 0..22)) {
        prop_assume!(!v.iter().any(|b| matches!(b, b',' | b' ' | b'\t')));
        let expected = match std::str::from_utf8(&v) {
            Ok(t) if t.bytes().all(|b| b.is_ascii_digit()) => t.parse::<u64>().ok(),
            _ => None,
        };
        prop_assert_eq!(crate::http1::content_length(&v), expected);
    }

    #[test]
    fn digit_strings_of_any_size_read_as_their_number(n in any::<u64>(), zeros in 0usize..30) {
        let text = format!("{}{n}", "0".repeat(zeros));
        prop_assert_eq!(crate::http1::content_length(text.as_bytes()), Some(n));
    }
}

#[test]
fn the_last_chunk_after_data_ends_the_body_with_that_data() {
    let mut buf = BytesMut::from(&b"5\r\nhello\r\n0\r\n\r\n"[..]);
    let mut d = Decoder::new(Framing::Chunked(Chunk::Size));
    match d.decode(&mut buf).unwrap() {
        Decoded::Frame(f) => assert_eq!(f.into_data().unwrap(), "hello"),
        other => panic!("{other:?}"),
    }
    assert!(d.is_done(), "the body's end was already read");
    assert!(buf.is_empty());
}

#[test]
fn status_line_headers_and_reason_are_read() {
    let wire = b"HTTP/1.1 429 Slow Down\r\nX-Request-Id: a1\r\nset-cookie: a\r\nset-cookie: b\r\ncontent-length: 2\r\n\r\nno";
    let (head, data, _, _) = read_all(wire, false, &[]).unwrap();
    let r = &head.response;
    assert_eq!(r.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(r.version(), Version::HTTP_11);
    assert_eq!(r.headers()["x-request-id"], "a1");
    let cookies: Vec<_> = r.headers().get_all("set-cookie").iter().collect();
    assert_eq!(cookies, ["a", "b"]);
    let names: Vec<_> = r.headers().keys().map(|k| k.as_str()).collect();
    assert_eq!(names, ["x-request-id", "set-cookie", "content-length"]);
    assert_eq!(
        r.extensions()
            .get::<hyper::ext::ReasonPhrase>()
            .map(|p| p.as_bytes()),
        Some(&b"Slow Down"[..])
    );
    assert_eq!(data, b"no");
    let (canonical, _, _, _) =
        read_all(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n", false, &[]).unwrap();
    assert!(canonical
        .response
        .extensions()
        .get::<hyper::ext::ReasonPhrase>()
        .is_none());
}

#[test]
fn interim_responses_are_skipped_and_an_upgrade_is_refused() {
    let wire = b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nlink: </a>\r\n\r\nHTTP/1.1 200 OK\r\ncontent-length: 1\r\n\r\nx";
    let (head, data, _, _) = read_all(wire, false, &[3, 20, 7]).unwrap();
    assert_eq!(head.response.status(), StatusCode::OK);
    assert!(head.response.headers().get("link").is_none());
    assert_eq!(data, b"x");
    let up = read_all(
        b"HTTP/1.1 101 Switching Protocols\r\nupgrade: h2c\r\n\r\n",
        false,
        &[],
    );
    assert!(matches!(up, Err(Error::Parse(_))));
}

#[test]
fn bodiless_responses_have_no_body_whatever_their_headers_say() {
    for (wire, is_head) in [
        (&b"HTTP/1.1 200 OK\r\ncontent-length: 50\r\n\r\n"[..], true),
        (
            b"HTTP/1.1 204 No Content\r\ncontent-length: 50\r\n\r\n",
            false,
        ),
        (
            b"HTTP/1.1 304 Not Modified\r\ntransfer-encoding: chunked\r\n\r\n",
            false,
        ),
        (b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n", false),
    ] {
        let mut buf = BytesMut::from(wire);
        let head = parse_head(&mut buf, is_head).unwrap().unwrap();
        assert!(head.decoder.is_done());
        assert!(head.keep_alive);
        assert_eq!(head.decoder.size_hint().exact(), Some(0));
    }
}

#[test]
fn a_body_without_length_runs_to_the_close_and_the_connection_is_not_kept() {
    let wire = b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\n\r\nall of it";
    let (head, data, _, _) = read_all(wire, false, &[30, 3]).unwrap();
    assert_eq!(data, b"all of it");
    assert!(!head.keep_alive);
    let te = b"HTTP/1.1 200 OK\r\ntransfer-encoding: gzip\r\n\r\nzzz";
    let (head, data, _, _) = read_all(te, false, &[]).unwrap();
    assert_eq!(data, b"zzz", "not chunked last: read to the close");
    assert!(!head.keep_alive);
}

#[test]
fn keep_alive_follows_the_version_and_connection_header() {
    let keep = |wire: &[u8]| {
        let mut buf = BytesMut::from(wire);
        parse_head(&mut buf, false).unwrap().unwrap().keep_alive
    };
    assert!(keep(b"HTTP/1.1 200 OK\r\ncontent-length: 1\r\n\r\n"));
    assert!(!keep(
        b"HTTP/1.1 200 OK\r\nconnection: Close\r\ncontent-length: 1\r\n\r\n"
    ));
    assert!(!keep(b"HTTP/1.0 200 OK\r\ncontent-length: 1\r\n\r\n"));
    assert!(keep(
        b"HTTP/1.0 200 OK\r\nconnection: keep-alive\r\ncontent-length: 1\r\n\r\n"
    ));
    // Both framings: read by the chunks, the connection not trusted after.
    assert!(!keep(
        b"HTTP/1.1 200 OK\r\ncontent-length: 3\r\ntransfer-encoding: chunked\r\n\r\n"
    ));
}

/// `close` wins wherever it is: a later `keep-alive` token, in the same
/// line or another, does not undo it (issue 49: `close, keep-alive` kept
/// the connection pooled).
#[test]
fn close_anywhere_in_connection_is_not_undone_by_keep_alive() {
    let keep = |wire: &[u8]| {
        let mut buf = BytesMut::from(wire);
        parse_head(&mut buf, false).unwrap().unwrap().keep_alive
    };
    for conn in [
        "connection: close, keep-alive\r\n",
        "connection: keep-alive, close\r\n",
        "connection: close\r\nconnection: keep-alive\r\n",
        "connection: keep-alive\r\nconnection: close\r\n",
    ] {
        for version in ["1.1", "1.0"] {
            let wire = format!("HTTP/{version} 200 OK\r\n{conn}content-length: 1\r\n\r\nx");
            assert!(!keep(wire.as_bytes()), "{wire:?}");
        }
    }
}

/// A response with a Transfer-Encoding and a Content-Length is read by
/// its chunks and goes on without the length (issue 49: the length went
/// to the client, whose copy was cut to it).
#[test]
fn a_length_next_to_a_transfer_encoding_is_dropped() {
    let body = "x".repeat(270);
    for te in ["chunked", "gzip, chunked"] {
        let wire = format!(
            "HTTP/1.1 200 OK\r\ncontent-length: 10\r\ntransfer-encoding: {te}\r\nx-a: 1\r\n\r\n{:x}\r\n{body}\r\n0\r\n\r\n",
            body.len()
        );
        let (head, data, _, _) = read_all(wire.as_bytes(), false, &[]).unwrap();
        assert_eq!(data, body.as_bytes(), "{te}");
        let headers = head.response.headers();
        assert!(headers.get(header::CONTENT_LENGTH).is_none(), "{te}");
        assert_eq!(headers["x-a"], "1");
        assert_eq!(headers[header::TRANSFER_ENCODING], te);
        assert!(!head.keep_alive);
    }
    // Not chunked last: read to the close, the length dropped too.
    let wire = b"HTTP/1.1 200 OK\r\ntransfer-encoding: gzip\r\ncontent-length: 1\r\n\r\nzzz";
    let (head, data, _, _) = read_all(wire, false, &[]).unwrap();
    assert_eq!(data, b"zzz");
    assert!(head
        .response
        .headers()
        .get(header::CONTENT_LENGTH)
        .is_none());
    // Without a Transfer-Encoding the length stays.
    let wire = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok";
    let (head, _, _, _) = read_all(wire, false, &[]).unwrap();
    assert_eq!(head.response.headers()[header::CONTENT_LENGTH], "2");
}

/// An HTTP/1.0 response with a Transfer-Encoding has faulty framing (RFC
/// 9112 §6.1): an error, so the client gets a 502 and the connection is
/// dropped (issue 49: it was framed by its length, the chunk lines went to
/// the client as body and the connection was reused).
#[test]
fn a_transfer_encoding_in_an_http10_response_is_an_error() {
    for wire in [
        &b"HTTP/1.0 200 OK\r\ntransfer-encoding: chunked\r\ncontent-length: 5\r\nconnection: keep-alive\r\n\r\n1\r\nx\r\n0\r\n\r\n"[..],
        b"HTTP/1.0 200 OK\r\ntransfer-encoding: chunked\r\n\r\n1\r\nx\r\n0\r\n\r\n",
    ] {
        assert!(matches!(read_all(wire, false, &[]), Err(Error::Parse(_))));
    }
}

#[test]
fn a_length_said_twice_is_one_length() {
    let wire = b"HTTP/1.1 200 OK\r\ncontent-length: 2, 2\r\ncontent-length: 2\r\n\r\nok";
    let (_, data, _, _) = read_all(wire, false, &[]).unwrap();
    assert_eq!(data, b"ok");
    let bad = b"HTTP/1.1 200 OK\r\ncontent-length: 2, 3\r\n\r\nok";
    assert!(matches!(read_all(bad, false, &[]), Err(Error::Parse(_))));
}

#[test]
fn malformed_framing_is_an_error() {
    let cases: &[&[u8]] = &[
        b"HTTP/1.1 200 OK\r\ncontent-length: 1\r\ncontent-length: 2\r\n\r\nxx",
        b"HTTP/1.1 200 OK\r\ncontent-length: -1\r\n\r\n",
        b"HTTP/1.1 200 OK\r\ncontent-length: 1x\r\n\r\n",
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n",
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n2\r\nabc\r\n0\r\n\r\n",
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n11111111111111111\r\n",
        b"NOT HTTP\r\n\r\n",
    ];
    for wire in cases {
        let r = read_all(wire, false, &[]);
        assert!(
            matches!(r, Err(Error::Parse(_))),
            "{:?}: {:?}",
            String::from_utf8_lossy(wire),
            r.map(|_| ())
        );
    }
    let mut line = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n1".to_vec();
    line.resize(line.len() + MAX_LINE + 1, b';');
    assert!(matches!(read_all(&line, false, &[]), Err(Error::Parse(_))));
}

#[test]
fn a_body_cut_short_is_incomplete() {
    for wire in [
        &b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nshort"[..],
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhel",
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n",
        b"HTTP/1.1 200 OK\r\ncontent-len",
    ] {
        let r = read_all(wire, false, &[]);
        assert!(
            r.as_ref().err().is_some_and(Error::is_incomplete_message),
            "{:?}",
            String::from_utf8_lossy(wire)
        );
    }
}

fn body_of(data: Option<&'static [u8]>) -> ProxyReqBody {
    match data {
        None => super::super::body::boxed(http_body_util::Empty::<Bytes>::new()),
        Some(d) => super::super::body::boxed(http_body_util::Full::new(Bytes::from_static(d))),
    }
}

/// A body of unknown length that yields `parts`.
fn stream_of(parts: &[&'static [u8]]) -> ProxyReqBody {
    super::super::body::boxed(Parts(parts.iter().map(|p| Bytes::from_static(p)).collect()))
}

struct Parts(VecDeque<Bytes>);

impl Body for Parts {
    type Data = Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        Poll::Ready(self.0.pop_front().map(|b| Ok(Frame::data(b))))
    }
}

#[test]
fn the_request_head_is_written_with_the_framing_hyper_chose() {
    let mut headers = HeaderMap::new();
    headers.insert("host", HeaderValue::from_static("up:1"));
    headers.insert("x-b", HeaderValue::from_static("2"));
    let head = |method: Method, h: &HeaderMap, body: &ProxyReqBody| {
        let h = RequestHeaders {
            fields: h,
            set: &[],
            host: h.get("host"),
            underscores: false,
        };
        let (b, f) = encode_head(&method, "/v1/x?q=1", &h, body).unwrap();
        (String::from_utf8(b.to_vec()).unwrap(), f)
    };
    let (text, f) = head(Method::GET, &headers, &body_of(None));
    assert_eq!(
        text,
        "GET /v1/x?q=1 HTTP/1.1\r\nhost: up:1\r\nx-b: 2\r\n\r\n"
    );
    assert_eq!(f, RequestFraming::Empty);
    let (text, f) = head(Method::POST, &headers, &body_of(Some(b"{}")));
    assert_eq!(
        text,
        "POST /v1/x?q=1 HTTP/1.1\r\nhost: up:1\r\nx-b: 2\r\ncontent-length: 2\r\n\r\n"
    );
    assert_eq!(f, RequestFraming::Length(2));
    let mut sized = headers.clone();
    sized.insert("content-length", HeaderValue::from_static("2"));
    let (text, f) = head(Method::POST, &sized, &body_of(Some(b"{}")));
    assert_eq!(text.matches("content-length").count(), 1, "{text}");
    assert_eq!(f, RequestFraming::Length(2));
    let (text, f) = head(Method::POST, &headers, &stream_of(&[b"a"]));
    assert!(
        text.ends_with("transfer-encoding: chunked\r\n\r\n"),
        "{text}"
    );
    assert_eq!(f, RequestFraming::Chunked);
    let mut bad = headers.clone();
    bad.insert("content-length", HeaderValue::from_static("two"));
    assert!(matches!(
        encode_head(
            &Method::POST,
            "/",
            &RequestHeaders {
                fields: &bad,
                set: &[],
                host: None,
                underscores: false,
            },
            &body_of(Some(b"{}"))
        ),
        Err(Error::RequestLength)
    ));
}

#[test]
fn request_bodies_are_framed_as_announced() {
    let mut cx = Context::from_waker(std::task::Waker::noop());
    let drain = |out: &mut Outgoing, cx: &mut Context<'_>| -> Result<Vec<u8>, Error> {
        while let Poll::Ready(more) = out.poll_body(cx) {
            if !more? {
                break;
            }
        }
        Ok(out.queue.iter().flat_map(|b| b.to_vec()).collect())
    };
    let mut chunked = Outgoing {
        queue: VecDeque::new(),
        body: Some(stream_of(&[b"ab", b"", b"cde"])),
        framing: RequestFraming::Chunked,
        owed: 0,
        flush: false,
    };
    assert_eq!(
        drain(&mut chunked, &mut cx).unwrap(),
        b"2\r\nab\r\n3\r\ncde\r\n0\r\n\r\n"
    );
    let long = |owed| Outgoing {
        queue: VecDeque::new(),
        body: Some(stream_of(&[b"abc"])),
        framing: RequestFraming::Length(owed),
        owed,
        flush: false,
    };
    assert_eq!(drain(&mut long(3), &mut cx).unwrap(), b"abc");
    assert!(matches!(
        drain(&mut long(2), &mut cx),
        Err(Error::RequestLength)
    ));
    assert!(matches!(
        drain(&mut long(4), &mut cx),
        Err(Error::RequestLength)
    ));
}

#[test]
fn chunk_size_lines() {
    assert_eq!(chunk_size(b"1a\r").unwrap(), 26);
    assert_eq!(chunk_size(b"1A;name=v").unwrap(), 26);
    assert_eq!(chunk_size(b"0").unwrap(), 0);
    assert_eq!(chunk_size(b"ffffffffffffffff").unwrap(), u64::MAX);
    for bad in [&b""[..], b"\r", b"g", b"1g", b";x", b"11111111111111111"] {
        assert!(
            chunk_size(bad).is_err(),
            "{:?}",
            String::from_utf8_lossy(bad)
        );
    }
}

/// Whole chunks at the buffer's front are taken by offset, sizes of any
/// case and length read right, up to the first one the decoder's step has
/// to judge (the last chunk, extensions, a bare LF, one not all read).
#[test]
fn whole_chunks_are_taken_by_their_sizes() {
    let data = "\r\n".repeat(13);
    let wire = format!(
        "3\r\nabc\r\n1A\r\n{data}\r\n000f\r\n{}\r\n0\r\n\r\n",
        "x".repeat(15)
    );
    let mut taken = Vec::new();
    let at = whole_chunks(wire.as_bytes(), |r| taken.push(wire[r].to_owned()));
    assert_eq!(taken, ["abc", data.as_str(), &"x".repeat(15)]);
    assert_eq!(&wire[at..], "0\r\n\r\n");
    for stop in ["2;ext=1\r\nab\r\n", "2\nab\r\n", "5\r\nab", "2\r\nabc\r\n"] {
        let wire = format!("1\r\na\r\n{stop}");
        let mut taken = Vec::new();
        let at = whole_chunks(wire.as_bytes(), |r| taken.push(wire[r].to_owned()));
        assert_eq!(
            (taken.as_slice(), &wire[at..]),
            (&["a".to_owned()][..], stop)
        );
    }
}
