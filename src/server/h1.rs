//! compactor's HTTP/1.1 server for the requests clients send most: a whole
//! head and a `Content-Length` body (or none) that arrive together. The
//! request is cut out of the read buffer (`split_to`, shared, never copied)
//! and handed to the router as one body frame; the response head is written
//! with the body's first frames in one write. No dispatcher, no body
//! channel, no per-request timer.
//!
//! Why: with compactor's own upstream client (`upstream::h1`) in place,
//! hyper's server side was the largest cost of a small request: a bare
//! hyper hop costs 24.6 µs of CPU a request at 64 connections where nginx
//! costs 16.8 and a hop with no HTTP library 13.6 (`scripts/bench_load.sh`).
//!
//! Everything else goes to hyper's server, with the bytes already read, for
//! the rest of the connection, so what hyper answered it still answers
//! (400, 431, `100 Continue`, HTTP/2, …): a request hyper would reject or
//! that is malformed here, HTTP/1.0, `Transfer-Encoding`, `Expect`,
//! `Upgrade`, `CONNECT`, `Connection: close`, more than [`MAX_HEADERS`]
//! header fields, a message over [`MAX_MESSAGE`] bytes, or one whose rest
//! does not arrive within [`MESSAGE_WAIT`] of its first bytes. Each
//! handoff is counted by its reason (`compactor_h1_handoffs_total`).
//!
//! The response is framed as hyper's server frames it, rule by rule
//! (`hyper::proto::h1::role::Server::encode`): the status line (a
//! `ReasonPhrase` extension kept), the headers in their order with names
//! lower-case, `Content-Length` and `Transfer-Encoding` held to, a length
//! from the body's size when neither is set, else chunked (close-delimited
//! for an HTTP/1.0 response), no body for HEAD, 204 and 304, a `Date` when
//! the response has none, trailers only when a `Trailer` header names
//! them, and `Connection: close` once a shutdown began.

use std::cell::RefCell;
use std::convert::Infallible;
use std::future::{poll_fn, Future};
use std::io::{self, IoSlice};
use std::mem::MaybeUninit;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::{Buf, Bytes, BytesMut};
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::{Method, Request, Response, StatusCode, Uri, Version};
use http_body::Body;
use http_body_util::Full;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::sync::watch;

use crate::error::ProxyBody;
use crate::http1::{closes, content_length, has_token, is_chunked};
use crate::metrics::Handoff;

/// Header fields a request served here may have (hyper takes up to 100).
pub(crate) const MAX_HEADERS: usize = 64;
/// Largest message (head and body) read whole here.
pub(crate) const MAX_MESSAGE: usize = 256 * 1024;
/// How long the rest of a message may take once its first bytes came.
pub(crate) const MESSAGE_WAIT: Duration = Duration::from_millis(200);
/// The first read buffer of a connection.
const FIRST_READ: usize = 8 * 1024;
/// Response bytes gathered before they are written.
const WRITE_BATCH: usize = 64 * 1024;
/// A data frame this large is written from where it is, not copied.
const COPY_MAX: usize = 16 * 1024;

/// How serving a connection here ended.
#[derive(Debug)]
pub(crate) enum Ended {
    /// The connection is over (closed by the client, a shutdown, an error).
    Closed,
    /// hyper serves the rest of the connection, from these bytes on; why.
    Handoff(Bytes, Handoff),
}

/// The request body of a request served here: its bytes, whole.
pub(crate) type RequestBody = Full<Bytes>;

/// Serves requests on `io` with `handle` until the connection ends or a
/// request is for hyper. `shutdown` changing closes an idle connection and
/// makes the response in flight the last one.
pub(crate) async fn serve<I, H, F>(
    io: &mut I,
    mut handle: H,
    shutdown: &mut watch::Receiver<()>,
) -> Ended
where
    I: AsyncRead + AsyncWrite + Unpin,
    H: FnMut(Request<RequestBody>) -> F,
    // The router's own future, as it is: a wrapper around it to take the
    // `Ok` out would be one more copy of a future of kilobytes a request.
    F: Future<Output = Result<Response<ProxyBody>, Infallible>>,
{
    let mut buf = BytesMut::with_capacity(FIRST_READ);
    let mut out = Vec::new();
    let mut names = Vec::new();
    // One wait for the shutdown for the whole connection, registered with
    // the channel at its first poll and left there: a `changed()` per idle
    // wait registered and unregistered each time (~450 instructions a
    // request). Once it is ready the connection ends, so it is never
    // polled after. Between requests a second receiver is read: a load,
    // not a poll that takes the channel's lock.
    let probe = shutdown.clone();
    let mut stop = std::pin::pin!(shutdown.changed());
    loop {
        // The size of the message being read, once its head says it.
        let mut want = 0;
        let (request, te_trailers) = loop {
            if !buf.is_empty() {
                match parse(&mut buf, &mut names) {
                    Parsed::Request(request, te_trailers) => break (request, te_trailers),
                    Parsed::Hyper(why) => return Ended::Handoff(buf.freeze(), why),
                    Parsed::Partial(whole) => want = whole,
                }
            }
            let read = if buf.is_empty() {
                tokio::select! {
                    biased;
                    _ = &mut stop => return Ended::Closed,
                    read = read_more(io, &mut buf, 0) => read,
                }
            } else {
                // A message cut in parts: its rest comes at once or hyper
                // waits for it (with its own timers and answers).
                match tokio::time::timeout(MESSAGE_WAIT, read_more(io, &mut buf, want)).await {
                    Ok(read) => read,
                    Err(_) => return Ended::Handoff(buf.freeze(), Handoff::Slow),
                }
            };
            match read {
                Ok(0) | Err(_) => return Ended::Closed,
                Ok(_) => {}
            }
        };
        let asked = Asked {
            head: *request.method() == Method::HEAD,
            trailers: te_trailers,
        };
        let Ok(response) = handle(request).await;
        // A closed channel (`Err`) is a shutdown too.
        let last = probe.has_changed().unwrap_or(true);
        match write_response(io, &mut out, response, asked, last).await {
            Ok(true) => {}
            Ok(false) | Err(_) => {
                // A FIN after the last response, as hyper ends a connection.
                let _ = io.shutdown().await;
                return Ended::Closed;
            }
        }
    }
}

/// Reads what the socket has into `buf`, with room for a message of
/// `want` bytes (once known: one allocation, not a doubling per read);
/// `Ok(0)` at its end.
async fn read_more<I: AsyncRead + Unpin>(
    io: &mut I,
    buf: &mut BytesMut,
    want: usize,
) -> io::Result<usize> {
    if want > buf.len() {
        buf.reserve(want - buf.len());
    } else if buf.capacity() - buf.len() < FIRST_READ / 2 {
        buf.reserve(FIRST_READ.max(buf.len()));
    }
    io.read_buf(buf).await
}

/// What the front of the read buffer holds.
// The request is moved once, to the caller; boxing it would cost an
// allocation a request.
#[allow(clippy::large_enum_variant)]
enum Parsed {
    /// A request served here, cut out of the buffer; whether it accepts
    /// trailers (`TE: trailers`).
    Request(Request<RequestBody>, bool),
    /// The start of a message served here: read more (the whole
    /// message's size when its head is in, else 0).
    Partial(usize),
    /// A message for hyper (nothing was consumed), and why.
    Hyper(Handoff),
}

/// A header field found in the head: its name and its value's range.
type Field = (HeaderName, usize, usize);

fn parse(buf: &mut BytesMut, names: &mut Vec<Field>) -> Parsed {
    // Left uninitialised, as in `upstream::h1`: filling 64 empty fields
    // cost each request ~300 instructions before a byte was parsed.
    let mut fields = [const { MaybeUninit::<httparse::Header<'_>>::uninit() }; MAX_HEADERS];
    let mut parsed = httparse::Request::new(&mut []);
    let head_len = match parsed.parse_with_uninit_headers(buf, &mut fields) {
        Ok(httparse::Status::Complete(n)) => n,
        Ok(httparse::Status::Partial) if buf.len() < MAX_MESSAGE => return Parsed::Partial(0),
        Ok(httparse::Status::Partial) | Err(httparse::Error::TooManyHeaders) => {
            return Parsed::Hyper(Handoff::Oversized)
        }
        Err(_) if buf.starts_with(b"PRI * HTTP/2.0") => return Parsed::Hyper(Handoff::H2),
        Err(_) => return Parsed::Hyper(Handoff::Malformed),
    };
    if parsed.version != Some(1) {
        return Parsed::Hyper(Handoff::Http10);
    }
    let (Some(method), Some(path)) = (parsed.method, parsed.path) else {
        return Parsed::Hyper(Handoff::Malformed);
    };
    let method = match Method::from_bytes(method.as_bytes()) {
        Ok(m) if m == Method::CONNECT => return Parsed::Hyper(Handoff::Connect),
        Ok(m) => m,
        Err(_) => return Parsed::Hyper(Handoff::Malformed),
    };
    let base = buf.as_ptr() as usize;
    let path = (path.as_ptr() as usize - base, path.len());
    names.clear();
    let mut length = None;
    let mut te_trailers = false;
    for f in parsed.headers.iter() {
        let Ok(name) = HeaderName::from_bytes(f.name.as_bytes()) else {
            return Parsed::Hyper(Handoff::Malformed);
        };
        match name {
            // Anything but digits is hyper's call.
            header::CONTENT_LENGTH => {
                match content_length(f.value).and_then(|n| usize::try_from(n).ok()) {
                    Some(n) if length.is_none() => length = Some(n),
                    _ => return Parsed::Hyper(Handoff::Malformed),
                }
            }
            header::TRANSFER_ENCODING => return Parsed::Hyper(Handoff::TransferEncoding),
            header::EXPECT => return Parsed::Hyper(Handoff::Expect),
            header::UPGRADE => return Parsed::Hyper(Handoff::Upgrade),
            header::CONNECTION if closes(f.value) => {
                return Parsed::Hyper(Handoff::ConnectionClose)
            }
            header::TE => te_trailers |= has_token(f.value, b"trailers"),
            _ => {}
        }
        names.push((name, f.value.as_ptr() as usize - base, f.value.len()));
    }
    let Some(total) = length.unwrap_or(0).checked_add(head_len) else {
        return Parsed::Hyper(Handoff::Oversized);
    };
    if total > MAX_MESSAGE {
        return Parsed::Hyper(Handoff::Oversized);
    }
    if buf.len() < total {
        return Parsed::Partial(total);
    }
    let head = buf.split_to(head_len).freeze();
    let body = buf.split_to(total - head_len).freeze();
    match build(method, &head, path, names, body.clone()) {
        Some(request) => Parsed::Request(request, te_trailers),
        None => {
            // Valid to httparse, not to `http`: hyper answers it, from the
            // same bytes.
            let mut whole = BytesMut::with_capacity(head.len() + body.len() + buf.len());
            whole.extend_from_slice(&head);
            whole.extend_from_slice(&body);
            whole.extend_from_slice(buf);
            *buf = whole;
            Parsed::Hyper(Handoff::Malformed)
        }
    }
}

/// What the fast path makes of the bytes at the front of a connection:
/// for the fuzz targets and their property tests (`fuzz/checks.rs`), which
/// hold it against httparse and the wire rules read plainly.
#[doc(hidden)]
#[derive(Debug, PartialEq, Eq)]
pub enum Framed {
    /// Served here: the head's and the body's lengths, and the request as
    /// the router gets it (method, target, header fields in order, body).
    Served {
        head: usize,
        method: String,
        target: String,
        fields: Vec<(String, Vec<u8>)>,
        body: Vec<u8>,
    },
    /// Served here once more bytes come.
    Partial,
    /// For hyper, and why; whether the bytes were left as they came.
    Hyper(&'static str, bool),
}

/// [`Framed`] of `input`.
#[doc(hidden)]
pub fn frame_request(input: &[u8]) -> Framed {
    let mut buf = BytesMut::from(input);
    let mut names = Vec::new();
    match parse(&mut buf, &mut names) {
        Parsed::Partial(_) => Framed::Partial,
        Parsed::Hyper(why) => Framed::Hyper(why.label(), buf[..] == *input),
        Parsed::Request(request, _) => {
            let (parts, body) = request.into_parts();
            let body = match body.size_hint().exact() {
                Some(0) => Vec::new(),
                _ => {
                    let mut body = std::pin::pin!(body);
                    let mut cx = Context::from_waker(std::task::Waker::noop());
                    match body.as_mut().poll_frame(&mut cx) {
                        Poll::Ready(Some(Ok(frame))) => {
                            frame.into_data().map(|d| d.to_vec()).unwrap_or_default()
                        }
                        _ => Vec::new(),
                    }
                }
            };
            let consumed = input.len() - buf.len();
            Framed::Served {
                head: consumed - body.len(),
                method: parts.method.to_string(),
                target: parts.uri.to_string(),
                fields: parts
                    .headers
                    .iter()
                    .map(|(k, v)| (k.as_str().to_owned(), v.as_bytes().to_vec()))
                    .collect(),
                body,
            }
        }
    }
}

/// The request, its header values slices of `head`.
fn build(
    method: Method,
    head: &Bytes,
    (path_at, path_len): (usize, usize),
    names: &mut Vec<Field>,
    body: Bytes,
) -> Option<Request<RequestBody>> {
    let uri = Uri::from_maybe_shared(head.slice(path_at..path_at + path_len)).ok()?;
    let mut headers = HeaderMap::with_capacity(names.len());
    for (name, at, len) in names.drain(..) {
        let value = HeaderValue::from_maybe_shared(head.slice(at..at + len)).ok()?;
        headers.append(name, value);
    }
    let mut request = Request::new(Full::new(body));
    *request.method_mut() = method;
    *request.uri_mut() = uri;
    *request.version_mut() = Version::HTTP_11;
    *request.headers_mut() = headers;
    Some(request)
}

/// How a response body is delimited on the wire.
#[derive(Debug, PartialEq, Eq)]
enum Framing {
    /// `Content-Length` (0 also for a response that has no body).
    Length(u64),
    /// Chunked; trailers only of the names a `Trailer` header listed.
    Chunked(Vec<HeaderName>),
    /// Ends with the connection (an HTTP/1.0 response of unknown length).
    Close,
}

/// What hyper knows of a body's length before its first frame.
#[derive(Clone, Copy)]
enum Declared {
    /// At its end already.
    Empty,
    Known(u64),
    Unknown,
}

/// What the request asked of its response.
#[derive(Clone, Copy)]
struct Asked {
    /// A HEAD request: no body.
    head: bool,
    /// `TE: trailers`: trailers may be sent (those a `Trailer` header names).
    trailers: bool,
}

/// The response's framing can not be written (hyper refuses such a head
/// and closes the connection without an answer).
#[derive(Debug)]
struct BadHead;

/// Writes `response`; whether the connection may serve another request.
async fn write_response<I: AsyncWrite + Unpin>(
    io: &mut I,
    out: &mut Vec<u8>,
    response: Response<ProxyBody>,
    asked: Asked,
    mut last: bool,
) -> io::Result<bool> {
    let (mut parts, mut body) = response.into_parts();
    let declared = if body.is_end_stream() {
        Declared::Empty
    } else {
        match body.size_hint().exact() {
            Some(n) => Declared::Known(n),
            None => Declared::Unknown,
        }
    };
    if last && parts.version == Version::HTTP_11 {
        close_connection(&mut parts.headers);
    }
    out.clear();
    let framing = match encode_head(out, &parts, declared, asked, &mut last) {
        Ok(framing) => framing,
        Err(BadHead) => return Ok(false),
    };
    if framing == Framing::Length(0) || matches!(declared, Declared::Empty) {
        if let Framing::Chunked(_) = framing {
            out.extend_from_slice(b"0\r\n\r\n");
        }
        io.write_all(out).await?;
        return Ok(!last && framing != Framing::Close);
    }
    let mut owed = match framing {
        Framing::Length(n) => n,
        _ => 0,
    };
    loop {
        let step = poll_fn(|cx| match Pin::new(&mut body).poll_frame(cx) {
            Poll::Ready(frame) => Poll::Ready(Some(frame)),
            // Nothing more yet: what is gathered goes out now.
            Poll::Pending if !out.is_empty() => Poll::Ready(None),
            Poll::Pending => Poll::Pending,
        })
        .await;
        let frame = match step {
            None => {
                io.write_all(out).await?;
                out.clear();
                continue;
            }
            Some(Some(Ok(frame))) => frame,
            Some(None) => return end(io, out, &framing, owed, None, last).await,
            Some(Some(Err(_))) => {
                // The body failed: what came before it is written (the
                // coalescer's frames), the message is left unfinished.
                io.write_all(out).await?;
                return Ok(false);
            }
        };
        let data = match frame.into_data() {
            Ok(data) => data,
            Err(frame) => {
                let trailers = frame.into_trailers().ok();
                return end(io, out, &framing, owed, trailers, last).await;
            }
        };
        if !data.is_empty() {
            let mut data = data;
            if let Framing::Length(_) = framing {
                if data.len() as u64 > owed {
                    // More than the length said: hyper errs and closes.
                    data.truncate(owed as usize);
                    write_data(io, out, &framing, data).await?;
                    io.write_all(out).await?;
                    return Ok(false);
                }
                owed -= data.len() as u64;
            }
            write_data(io, out, &framing, data).await?;
        }
        if body.is_end_stream() {
            return end(io, out, &framing, owed, None, last).await;
        }
        if out.len() >= WRITE_BATCH {
            io.write_all(out).await?;
            out.clear();
        }
    }
}

/// Adds `close` to the response's `Connection` (hyper's keep-alive off).
fn close_connection(headers: &mut HeaderMap) {
    let closing = headers
        .get_all(header::CONNECTION)
        .iter()
        .any(|v| closes(v.as_bytes()));
    if !closing {
        headers.append(header::CONNECTION, HeaderValue::from_static("close"));
    }
}

/// Appends one data frame in `framing`; a large one is written at once,
/// from where it is.
async fn write_data<I: AsyncWrite + Unpin>(
    io: &mut I,
    out: &mut Vec<u8>,
    framing: &Framing,
    data: Bytes,
) -> io::Result<()> {
    let chunked = matches!(framing, Framing::Chunked(_));
    if chunked {
        chunk_size(out, data.len());
    }
    if data.len() <= COPY_MAX {
        out.extend_from_slice(&data);
    } else {
        write_all_vectored(io, &mut [IoSlice::new(out), IoSlice::new(&data)]).await?;
        out.clear();
    }
    if chunked {
        out.extend_from_slice(b"\r\n");
    }
    Ok(())
}

/// Ends the message: the last chunk and its trailers, or checks the length.
async fn end<I: AsyncWrite + Unpin>(
    io: &mut I,
    out: &mut Vec<u8>,
    framing: &Framing,
    owed: u64,
    trailers: Option<HeaderMap>,
    last: bool,
) -> io::Result<bool> {
    let keep = match framing {
        Framing::Chunked(allowed) => {
            out.extend_from_slice(b"0\r\n");
            for (name, value) in trailers.iter().flatten() {
                if allowed.contains(name) {
                    out.extend_from_slice(name.as_str().as_bytes());
                    out.extend_from_slice(b": ");
                    out.extend_from_slice(value.as_bytes());
                    out.extend_from_slice(b"\r\n");
                }
            }
            out.extend_from_slice(b"\r\n");
            true
        }
        // A body shorter than its length: the client must not wait for
        // the rest on a connection that goes on.
        Framing::Length(_) => owed == 0,
        Framing::Close => false,
    };
    io.write_all(out).await?;
    out.clear();
    Ok(keep && !last)
}

async fn write_all_vectored<I: AsyncWrite + Unpin>(
    io: &mut I,
    mut bufs: &mut [IoSlice<'_>],
) -> io::Result<()> {
    IoSlice::advance_slices(&mut bufs, 0);
    while !bufs.is_empty() {
        let n = io.write_vectored(bufs).await?;
        if n == 0 {
            return Err(io::ErrorKind::WriteZero.into());
        }
        IoSlice::advance_slices(&mut bufs, n);
    }
    Ok(())
}

/// A chunk's size line, in hyper's upper-case hex.
fn chunk_size(out: &mut Vec<u8>, len: usize) {
    const HEX: &[u8; 16] = b"0123456789ABCDEF";
    let mut digits = [0u8; 16];
    let mut at = digits.len();
    let mut n = len;
    loop {
        at -= 1;
        digits[at] = HEX[n & 15];
        n >>= 4;
        if n == 0 {
            break;
        }
    }
    out.extend_from_slice(&digits[at..]);
    out.extend_from_slice(b"\r\n");
}

fn can_have_body(head_request: bool, status: StatusCode) -> bool {
    !head_request && can_have_content_length(status)
}

fn can_have_content_length(status: StatusCode) -> bool {
    !status.is_informational()
        && status != StatusCode::NO_CONTENT
        && status != StatusCode::NOT_MODIFIED
}

/// Writes the status line and the header fields into `out`, as hyper's
/// server does; the body's framing.
fn encode_head(
    out: &mut Vec<u8>,
    parts: &http::response::Parts,
    declared: Declared,
    asked: Asked,
    last: &mut bool,
) -> Result<Framing, BadHead> {
    let status = parts.status;
    if status == StatusCode::SWITCHING_PROTOCOLS {
        *last = true;
    } else if status.is_informational() {
        // hyper has no interim responses from a service: a 500 instead.
        out.extend_from_slice(b"HTTP/1.1 500 Internal Server Error\r\ncontent-length: 0\r\n");
        date(out);
        out.extend_from_slice(b"\r\n");
        *last = true;
        return Ok(Framing::Length(0));
    }
    status_line(out, parts);
    let http10 = parts.version == Version::HTTP_10;
    let can_chunk = !http10 && can_have_body(asked.head, status);
    let mut fields = Fields {
        out,
        declared,
        head_request: asked.head,
        can_chunk,
        framing: None,
        wrote_date: false,
        allowed: Vec::new(),
        open: None,
        te_chunked: true,
    };
    for (name, value) in &parts.headers {
        fields.field(name, value, last)?;
    }
    fields.close_line();
    let Fields {
        out,
        framing,
        wrote_date,
        mut allowed,
        ..
    } = fields;
    let mut framing = match framing {
        Some(f) => f,
        None => implied_framing(out, declared, asked.head, status, can_chunk),
    };
    if !can_have_body(asked.head, status) {
        framing = Framing::Length(0);
    }
    if !wrote_date {
        date(out);
    }
    out.extend_from_slice(b"\r\n");
    if let Framing::Chunked(names) = &mut framing {
        if asked.trailers {
            allowed.retain(is_valid_trailer_field);
            *names = allowed;
        }
    }
    if framing == Framing::Close {
        *last = true;
    }
    Ok(framing)
}

/// `HTTP/1.x <code> <reason>`: a `ReasonPhrase` extension, else the
/// status's canonical reason.
fn status_line(out: &mut Vec<u8>, parts: &http::response::Parts) {
    let http10 = parts.version == Version::HTTP_10;
    let reason = parts.extensions.get::<hyper::ext::ReasonPhrase>();
    if !http10 && parts.status == StatusCode::OK && reason.is_none() {
        out.extend_from_slice(b"HTTP/1.1 200 OK\r\n");
        return;
    }
    out.extend_from_slice(if http10 { b"HTTP/1.0 " } else { b"HTTP/1.1 " });
    out.extend_from_slice(parts.status.as_str().as_bytes());
    out.push(b' ');
    match reason {
        Some(r) => out.extend_from_slice(r.as_bytes()),
        None => out.extend_from_slice(
            parts
                .status
                .canonical_reason()
                .unwrap_or("<none>")
                .as_bytes(),
        ),
    }
    out.extend_from_slice(b"\r\n");
}

/// The framing header hyper adds when the response set none.
fn implied_framing(
    out: &mut Vec<u8>,
    declared: Declared,
    head_request: bool,
    status: StatusCode,
    can_chunk: bool,
) -> Framing {
    match declared {
        Declared::Unknown if can_chunk => {
            out.extend_from_slice(b"transfer-encoding: chunked\r\n");
            Framing::Chunked(Vec::new())
        }
        Declared::Unknown => Framing::Close,
        Declared::Empty | Declared::Known(0) => {
            if can_have_content_length(status) && !head_request {
                out.extend_from_slice(b"content-length: 0\r\n");
            }
            Framing::Length(0)
        }
        Declared::Known(n) if can_have_content_length(status) => {
            out.extend_from_slice(b"content-length: ");
            out.extend_from_slice(crate::http1::decimal(n, &mut [0; 20]));
            out.extend_from_slice(b"\r\n");
            Framing::Length(n)
        }
        Declared::Known(_) => Framing::Length(0),
    }
}

/// The header fields being written, and what they said of the framing.
struct Fields<'a> {
    out: &'a mut Vec<u8>,
    declared: Declared,
    head_request: bool,
    can_chunk: bool,
    framing: Option<Framing>,
    wrote_date: bool,
    /// Names a `Trailer` header listed.
    allowed: Vec<HeaderName>,
    /// A framing or `Connection` line left open for more values of its name.
    open: Option<HeaderName>,
    /// Whether the last `Transfer-Encoding` value ends with `chunked`.
    te_chunked: bool,
}

impl Fields<'_> {
    fn field(
        &mut self,
        name: &HeaderName,
        value: &HeaderValue,
        last: &mut bool,
    ) -> Result<(), BadHead> {
        if self.open.as_ref().is_some_and(|o| o != name) {
            self.close_line();
        }
        let continuing = self.open.as_ref() == Some(name);
        match *name {
            header::CONTENT_LENGTH => return self.length(name, value, continuing),
            header::TRANSFER_ENCODING => {
                if self.framing.is_some() && !continuing {
                    return Err(BadHead);
                }
                if self.can_chunk {
                    self.te_chunked = is_chunked(value.as_bytes());
                    if !continuing {
                        self.framing = Some(Framing::Chunked(Vec::new()));
                    }
                    self.joined(name, value, continuing);
                }
                return Ok(());
            }
            header::TRAILER => {
                if self.can_chunk {
                    if let Ok(v) = value.to_str() {
                        self.allowed.extend(
                            v.split(',')
                                .filter_map(|s| HeaderName::from_bytes(s.trim().as_bytes()).ok()),
                        );
                    }
                    self.joined(name, value, continuing);
                }
                return Ok(());
            }
            header::CONNECTION => {
                if closes(value.as_bytes()) {
                    *last = true;
                }
                self.joined(name, value, continuing);
                return Ok(());
            }
            header::DATE => self.wrote_date = true,
            _ => {}
        }
        self.line(name, value);
        Ok(())
    }

    /// A `Content-Length` field: held to the body's known length, checked
    /// when the length is unknown, dropped for a body already at its end
    /// (but for HEAD).
    fn length(
        &mut self,
        name: &HeaderName,
        value: &HeaderValue,
        continuing: bool,
    ) -> Result<(), BadHead> {
        let n = match self.declared {
            Declared::Empty if !self.head_request => return Ok(()),
            Declared::Empty => {
                self.framing = Some(Framing::Length(0));
                self.line(name, value);
                return Ok(());
            }
            Declared::Known(n) => n,
            Declared::Unknown => content_length(value.as_bytes()).ok_or(BadHead)?,
        };
        match &self.framing {
            // A later value of the same field: the first one stands (when
            // the length is unknown, it must say the same).
            Some(Framing::Length(prev)) if continuing => {
                if matches!(self.declared, Declared::Unknown) && *prev != n {
                    return Err(BadHead);
                }
            }
            Some(_) => return Err(BadHead),
            None => {
                self.joined(name, value, false);
                self.framing = Some(Framing::Length(n));
            }
        }
        Ok(())
    }

    /// A field whose values share one line (`a, b`).
    fn joined(&mut self, name: &HeaderName, value: &HeaderValue, continuing: bool) {
        if continuing {
            self.out.extend_from_slice(b", ");
        } else {
            self.out.extend_from_slice(name.as_str().as_bytes());
            self.out.extend_from_slice(b": ");
            self.open = Some(name.clone());
        }
        self.out.extend_from_slice(value.as_bytes());
    }

    fn line(&mut self, name: &HeaderName, value: &HeaderValue) {
        self.out.extend_from_slice(name.as_str().as_bytes());
        self.out.extend_from_slice(b": ");
        self.out.extend_from_slice(value.as_bytes());
        self.out.extend_from_slice(b"\r\n");
    }

    /// Ends a line left open; a `Transfer-Encoding` whose last coding is
    /// not `chunked` gets it.
    fn close_line(&mut self) {
        if let Some(name) = self.open.take() {
            if name == header::TRANSFER_ENCODING && !self.te_chunked {
                self.out.extend_from_slice(b", chunked");
            }
            self.out.extend_from_slice(b"\r\n");
        }
    }
}

/// Fields a trailer may not carry (hyper's list).
fn is_valid_trailer_field(name: &HeaderName) -> bool {
    !matches!(
        *name,
        header::AUTHORIZATION
            | header::CACHE_CONTROL
            | header::CONTENT_ENCODING
            | header::CONTENT_LENGTH
            | header::CONTENT_RANGE
            | header::CONTENT_TYPE
            | header::HOST
            | header::MAX_FORWARDS
            | header::SET_COOKIE
            | header::TRAILER
            | header::TRANSFER_ENCODING
            | header::TE
    )
}

/// Appends `date: <now>\r\n`, formatted once a second per thread.
fn date(out: &mut Vec<u8>) {
    thread_local! {
        static DATE: RefCell<(u64, [u8; 29])> = const { RefCell::new((u64::MAX, [0; 29])) };
    }
    let now = SystemTime::now();
    let secs = now.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
    DATE.with(|cached| {
        let mut cached = cached.borrow_mut();
        if cached.0 != secs {
            let text = httpdate::fmt_http_date(now);
            if text.len() == 29 {
                cached.1.copy_from_slice(text.as_bytes());
                cached.0 = secs;
            }
        }
        out.extend_from_slice(b"date: ");
        out.extend_from_slice(&cached.1);
        out.extend_from_slice(b"\r\n");
    });
}

/// A connection whose first bytes were already read: they are read again
/// first (for hyper, after a handoff).
pub(crate) struct Rewind<I> {
    prefix: Bytes,
    inner: I,
}

impl<I> Rewind<I> {
    pub(crate) fn new(prefix: Bytes, inner: I) -> Self {
        Rewind { prefix, inner }
    }
}

impl<I: AsyncRead + Unpin> AsyncRead for Rewind<I> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        if !self.prefix.is_empty() {
            let n = self.prefix.len().min(buf.remaining());
            buf.put_slice(&self.prefix[..n]);
            self.prefix.advance(n);
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<I: AsyncWrite + Unpin> AsyncWrite for Rewind<I> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests;
