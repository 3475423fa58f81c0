//! compactor's HTTP/1.1 client: writes a request on an upstream connection
//! and reads the response from it, with no task, no channel and no copy of
//! a body byte.
//!
//! It replaces hyper's client connection (`hyper::client::conn::http1`),
//! whose cost the raw hop (`examples/raw_hop.rs`) made plain: a hop that
//! only finds where messages end costs 6k instructions a small JSON request
//! and 10k an SSE response of 22 events; the bare hyper hop 38k and 142k.
//! On the client side hyper builds a dispatcher per connection, hands every
//! decoded chunk through a body channel to the response's receiver, and
//! keeps a want/give handshake between them. Here the response body *is*
//! the decoder: polling it reads the socket and cuts the next frame out of
//! the read buffer (`split_to`, shared, never copied).
//!
//! What hyper's client did that a proxy relies on is kept, rule by rule:
//! - the request goes out with the caller's headers in their order (names
//!   as the `HeaderMap` holds them), its framing decided as hyper did: a
//!   body that is already at its end adds no framing header, a
//!   `Content-Length` the caller set is kept and held to, a body of known
//!   length gets one, any other body goes chunked;
//! - the request body keeps being written while the response is read (an
//!   upstream may answer before it read everything); a connection whose
//!   request was not written to the end is not used again;
//! - 1xx interim responses are skipped (a 101 is an error: compactor never
//!   asks for an upgrade), HEAD and 204/304 responses have no body, the
//!   body is sized by `Transfer-Encoding: chunked` (its trailers become a
//!   trailers frame), else `Content-Length`, else the connection's close
//!   (the rules of `crate::http1`: a `Content-Length` next to a
//!   `Transfer-Encoding` is dropped, not forwarded; a `Transfer-Encoding`
//!   in an HTTP/1.0 response is an error);
//! - a connection goes back to the pool only when its response said it may
//!   (HTTP/1.1 without `Connection: close`, HTTP/1.0 with `keep-alive`;
//!   `close` anywhere wins over any `keep-alive`), was
//!   read to its end, and nothing followed it;
//! - a reason phrase other than the status's canonical one is kept (as
//!   hyper's `ReasonPhrase` extension, which hyper's server writes back);
//! - the limits: a response head of at most 64 KiB and 128 header fields,
//!   a chunk-size line or trailer block of at most 16 KiB.

use std::collections::VecDeque;
use std::future::Future;
use std::io::{self, IoSlice};
use std::mem::MaybeUninit;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::{Buf, Bytes, BytesMut};
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::{Method, Response, StatusCode, Version};
use http_body::{Body, Frame, SizeHint};
use hyper_rustls::MaybeHttpsStream;
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use super::body::ProxyReqBody;
use super::headers::RequestHeaders;
use crate::error::BoxError;
use crate::http1::{decimal, BodyLength, FramingFields};

/// The socket under a connection: TCP, or TLS over TCP, read and written
/// with tokio's traits.
pub(crate) type Io = TokioIo<MaybeHttpsStream<TokioIo<tokio::net::TcpStream>>>;

const MAX_HEAD: usize = 64 * 1024;
const MAX_HEADERS: usize = 128;
const MAX_LINE: usize = 16 * 1024;
/// The first read of a response asks for this much; a read that fills
/// what it asked for doubles the next one, up to [`MAX_READ`].
const FIRST_READ: usize = 8 * 1024;
const MAX_READ: usize = 256 * 1024;
/// Slices handed to one vectored write.
const MAX_IOV: usize = 16;

/// Why an exchange failed.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The connection ended before the response did (or before it began).
    #[error("connection closed before message completed")]
    Incomplete,
    #[error("error reading from the upstream connection")]
    Read(#[source] io::Error),
    #[error("error writing to the upstream connection")]
    Write(#[source] io::Error),
    /// The upstream's bytes are not an HTTP/1.x response.
    #[error("invalid HTTP response from the upstream: {0}")]
    Parse(&'static str),
    /// The request body (the client's upload) failed.
    #[error("error reading the request body")]
    RequestBody(#[source] BoxError),
    /// The request body did not match the `Content-Length` it was sent with.
    #[error("request body length does not match its Content-Length")]
    RequestLength,
}

impl Error {
    /// Whether the connection closed before the response was complete.
    pub fn is_incomplete_message(&self) -> bool {
        matches!(self, Error::Incomplete)
    }

    /// Whether the request's own body was at fault (the client's upload).
    pub fn is_request_body(&self) -> bool {
        matches!(self, Error::RequestBody(_) | Error::RequestLength)
    }
}

impl From<httparse::Error> for Error {
    fn from(e: httparse::Error) -> Self {
        Error::Parse(match e {
            httparse::Error::TooManyHeaders => "too many header fields",
            httparse::Error::Version => "bad version",
            httparse::Error::Status => "bad status line",
            httparse::Error::HeaderName => "bad header name",
            httparse::Error::HeaderValue => "bad header value",
            _ => "malformed head",
        })
    }
}

/// How a request body goes on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RequestFraming {
    /// Nothing follows the head.
    Empty,
    /// Exactly this many bytes follow.
    Length(u64),
    Chunked,
}

/// Writes the request head (`path` in origin form) into a buffer and says
/// how the body follows it; the framing header it needs is added.
pub(crate) fn encode_head(
    method: &Method,
    path: &str,
    headers: &RequestHeaders<'_>,
    body: &ProxyReqBody,
) -> Result<(Bytes, RequestFraming), Error> {
    // Room for every field the client sent and every one set (more than
    // goes out when some are dropped or replaced) and the framing header.
    let size: usize = headers
        .fields
        .iter()
        .chain(headers.set.iter().map(|(k, v)| (k, v)))
        .chain(headers.host.map(|v| (&header::HOST, v)))
        .map(|(k, v)| k.as_str().len() + v.len() + 4)
        .sum::<usize>()
        + method.as_str().len()
        + path.len()
        + 64;
    let mut out = Vec::with_capacity(size);
    out.extend_from_slice(method.as_str().as_bytes());
    out.push(b' ');
    out.extend_from_slice(path.as_bytes());
    out.extend_from_slice(b" HTTP/1.1\r\n");
    let mut length = None;
    for (k, v) in headers.iter() {
        if length.is_none() && k == header::CONTENT_LENGTH {
            length = Some(v);
        }
        field(&mut out, k.as_str(), v.as_bytes());
    }
    let framing = if body.is_end_stream() {
        RequestFraming::Empty
    } else if let Some(v) = length {
        RequestFraming::Length(
            crate::http1::content_length(v.as_bytes()).ok_or(Error::RequestLength)?,
        )
    } else {
        match body.size_hint().exact() {
            Some(n) => RequestFraming::Length(n),
            None => RequestFraming::Chunked,
        }
    };
    match framing {
        RequestFraming::Length(n) if length.is_none() => {
            field(&mut out, "content-length", decimal(n, &mut [0; 20]));
        }
        RequestFraming::Chunked => field(&mut out, "transfer-encoding", b"chunked"),
        _ => {}
    }
    out.extend_from_slice(b"\r\n");
    Ok((Bytes::from(out), framing))
}

/// One header field line.
fn field(out: &mut Vec<u8>, name: &str, value: &[u8]) {
    out.extend_from_slice(name.as_bytes());
    out.extend_from_slice(b": ");
    out.extend_from_slice(value);
    out.extend_from_slice(b"\r\n");
}

/// What is left to write of a request.
struct Outgoing {
    /// Bytes ready to go, in order.
    queue: VecDeque<Bytes>,
    body: Option<ProxyReqBody>,
    framing: RequestFraming,
    /// Body bytes still owed to a `Content-Length`.
    owed: u64,
    flush: bool,
}

impl Outgoing {
    /// Takes the body's next frame into the queue; `Ready(false)` once the
    /// body ended.
    fn poll_body(&mut self, cx: &mut Context<'_>) -> Poll<Result<bool, Error>> {
        let Some(body) = self.body.as_mut() else {
            return Poll::Ready(Ok(false));
        };
        match Pin::new(body).poll_frame(cx) {
            Poll::Pending => Poll::Pending,
            Poll::Ready(Some(Err(e))) => Poll::Ready(Err(Error::RequestBody(e))),
            Poll::Ready(Some(Ok(frame))) => {
                // Trailers of a request are dropped, as hyper's client did
                // unless the upstream asked for them (`TE: trailers`, which
                // is hop-by-hop and never forwarded).
                if let Ok(data) = frame.into_data() {
                    if !data.is_empty() {
                        self.queue_data(data)?;
                    }
                }
                Poll::Ready(Ok(true))
            }
            Poll::Ready(None) => {
                self.body = None;
                match self.framing {
                    RequestFraming::Chunked => {
                        self.queue.push_back(Bytes::from_static(b"0\r\n\r\n"))
                    }
                    RequestFraming::Length(_) if self.owed != 0 => {
                        return Poll::Ready(Err(Error::RequestLength))
                    }
                    _ => {}
                }
                self.flush = true;
                Poll::Ready(Ok(false))
            }
        }
    }

    fn queue_data(&mut self, data: Bytes) -> Result<(), Error> {
        match self.framing {
            RequestFraming::Chunked => {
                self.queue
                    .push_back(Bytes::from(format!("{:x}\r\n", data.len())));
                self.queue.push_back(data);
                self.queue.push_back(Bytes::from_static(b"\r\n"));
            }
            RequestFraming::Length(_) => {
                let n = data.len() as u64;
                if n > self.owed {
                    return Err(Error::RequestLength);
                }
                self.owed -= n;
                self.queue.push_back(data);
            }
            RequestFraming::Empty => return Err(Error::RequestLength),
        }
        Ok(())
    }
}

/// An upstream connection: the socket, what was read from it and not yet
/// used, and what is left to write of the request in flight.
pub(crate) struct Conn {
    io: Io,
    buf: BytesMut,
    next_read: usize,
    out: Option<Outgoing>,
}

impl Conn {
    pub(crate) fn new(io: Io) -> Self {
        Conn {
            io,
            buf: BytesMut::new(),
            next_read: FIRST_READ,
            out: None,
        }
    }

    /// Reads what the socket has into the buffer: `Ready(Ok(0))` at its end.
    fn poll_fill(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<usize>> {
        let want = self.next_read;
        if self.buf.capacity() - self.buf.len() < want / 2 {
            self.buf.reserve(want);
        }
        let read = std::pin::pin!(tokio::io::AsyncReadExt::read_buf(
            &mut self.io,
            &mut self.buf
        ));
        let n = std::task::ready!(read.poll(cx))?;
        if n >= want && want < MAX_READ {
            self.next_read = want * 2;
        }
        Poll::Ready(Ok(n))
    }

    /// Writes what it can of the request; `Ok` when it is all written or
    /// the socket (or the body) has to wait.
    fn poll_write_request(&mut self, cx: &mut Context<'_>) -> Result<(), Error> {
        let Some(out) = self.out.as_mut() else {
            return Ok(());
        };
        loop {
            // What the body has ready goes in the same write: a chat body
            // leaves with its head.
            while out.body.is_some() && out.queue.len() < MAX_IOV - 2 {
                match out.poll_body(cx) {
                    Poll::Pending => break,
                    Poll::Ready(Err(e)) => return Err(e),
                    Poll::Ready(Ok(_)) => {}
                }
            }
            if !out.queue.is_empty() {
                let mut slices = [IoSlice::new(&[]); MAX_IOV];
                let mut n = 0;
                for b in out.queue.iter().take(MAX_IOV) {
                    slices[n] = IoSlice::new(b);
                    n += 1;
                }
                match Pin::new(&mut self.io).poll_write_vectored(cx, &slices[..n]) {
                    Poll::Pending => return Ok(()),
                    Poll::Ready(Err(e)) => return Err(Error::Write(e)),
                    Poll::Ready(Ok(0)) => {
                        return Err(Error::Write(io::ErrorKind::WriteZero.into()))
                    }
                    Poll::Ready(Ok(mut written)) => {
                        // A TLS stream may keep what it was given until it
                        // is flushed: flushed before waiting on the body.
                        out.flush = true;
                        while written > 0 {
                            let Some(front) = out.queue.front_mut() else {
                                break;
                            };
                            if written >= front.len() {
                                written -= front.len();
                                out.queue.pop_front();
                            } else {
                                front.advance(written);
                                written = 0;
                            }
                        }
                    }
                }
            } else if out.flush {
                match Pin::new(&mut self.io).poll_flush(cx) {
                    Poll::Pending => return Ok(()),
                    Poll::Ready(Err(e)) => return Err(Error::Write(e)),
                    Poll::Ready(Ok(())) => out.flush = false,
                }
            } else if out.body.is_some() {
                // Polled above: it waits.
                return Ok(());
            } else {
                self.out = None;
                return Ok(());
            }
        }
    }

    /// Sends a request (`head` from [`encode_head`]) and waits for the
    /// response head. The body keeps being written afterwards, by the
    /// response body, if it is not all out yet.
    pub(crate) async fn send(
        &mut self,
        head: Bytes,
        framing: RequestFraming,
        body: ProxyReqBody,
        method: &Method,
    ) -> Result<Head, Error> {
        let mut queue = VecDeque::with_capacity(4);
        queue.push_back(head);
        let owed = match framing {
            RequestFraming::Length(n) => n,
            _ => 0,
        };
        self.out = Some(Outgoing {
            queue,
            body: (framing != RequestFraming::Empty).then_some(body),
            framing,
            owed,
            flush: true,
        });
        let is_head = *method == Method::HEAD;
        let mut write_error: Option<Error> = None;
        std::future::poll_fn(|cx| {
            if write_error.is_none() {
                if let Err(e) = self.poll_write_request(cx) {
                    if e.is_request_body() {
                        return Poll::Ready(Err(e));
                    }
                    // The upstream may have answered and closed: what it
                    // sent is still read below.
                    self.out = None;
                    write_error = Some(e);
                }
            }
            loop {
                if let Some(head) = parse_head(&mut self.buf, is_head)? {
                    return Poll::Ready(Ok(head));
                }
                if self.buf.len() > MAX_HEAD {
                    return Poll::Ready(Err(Error::Parse("response head too large")));
                }
                match self.poll_fill(cx) {
                    Poll::Pending => return Poll::Pending,
                    Poll::Ready(Ok(0)) => {
                        return Poll::Ready(Err(write_error.take().unwrap_or(Error::Incomplete)))
                    }
                    Poll::Ready(Ok(_)) => {}
                    Poll::Ready(Err(e)) => {
                        return Poll::Ready(Err(write_error.take().unwrap_or(Error::Read(e))))
                    }
                }
            }
        })
        .await
    }

    /// Whether an idle connection can take a request: nothing arrived on
    /// it (a close, or bytes nobody asked for) since it went idle. Reads
    /// without waiting.
    pub(crate) fn is_usable(&mut self) -> bool {
        if !self.buf.is_empty() || self.out.is_some() {
            return false;
        }
        let mut cx = Context::from_waker(std::task::Waker::noop());
        let mut probe = [0u8; 1];
        let mut rb = ReadBuf::new(&mut probe);
        matches!(
            Pin::new(&mut self.io).poll_read(&mut cx, &mut rb),
            Poll::Pending
        )
    }
}

/// A response head read off a connection, and how its body follows.
pub(crate) struct Head {
    pub(crate) response: Response<()>,
    pub(crate) decoder: Decoder,
    pub(crate) keep_alive: bool,
}

/// The headers compactor may add to an upstream response (`chat::respond::mark_head`).
const ADDED_RESPONSE_HEADERS: usize = 3;

/// Parses a response head at the front of `buf` (consumed), skipping
/// interim 1xx responses; `None` while it is incomplete.
fn parse_head(buf: &mut BytesMut, is_head: bool) -> Result<Option<Head>, Error> {
    loop {
        // Left uninitialised: filling 128 empty fields cost each response
        // ~600 instructions before a byte was parsed.
        let mut fields = [const { MaybeUninit::<httparse::Header<'_>>::uninit() }; MAX_HEADERS];
        let mut parsed = httparse::Response::new(&mut []);
        let len = match httparse::ParserConfig::default().parse_response_with_uninit_headers(
            &mut parsed,
            buf,
            &mut fields,
        )? {
            httparse::Status::Partial => return Ok(None),
            httparse::Status::Complete(len) => len,
        };
        let code = parsed.code.ok_or(Error::Parse("no status code"))?;
        let status = StatusCode::from_u16(code).map_err(|_| Error::Parse("bad status code"))?;
        if status == StatusCode::SWITCHING_PROTOCOLS {
            return Err(Error::Parse("101 Switching Protocols was not asked for"));
        }
        if status.is_informational() {
            buf.advance(len);
            continue;
        }
        let version = match parsed.version {
            Some(0) => Version::HTTP_10,
            _ => Version::HTTP_11,
        };
        // Header values are slices of one copy of the head.
        let raw = Bytes::copy_from_slice(&buf[..len]);
        let base = buf.as_ptr() as usize;
        // Room for the headers compactor adds to a response (its three
        // `x-compactor-*` ones): growing a full map rehashes it. No more:
        // a few headers' map past 1,032 bytes (12 entries of 104) misses
        // glibc's per-thread cache, 600 instructions a response.
        let mut headers = HeaderMap::with_capacity(parsed.headers.len() + ADDED_RESPONSE_HEADERS);
        let mut facts = FramingFields::default();
        for f in parsed.headers.iter() {
            let name = HeaderName::from_bytes(f.name.as_bytes())
                .map_err(|_| Error::Parse("bad header name"))?;
            let at = f.value.as_ptr() as usize - base;
            let value = HeaderValue::from_maybe_shared(raw.slice(at..at + f.value.len()))
                .map_err(|_| Error::Parse("bad header value"))?;
            facts.note(&name, f.value);
            headers.append(name, value);
        }
        let reason = parsed
            .reason
            .filter(|r| !r.is_empty() && Some(*r) != status.canonical_reason())
            .and_then(|r| hyper::ext::ReasonPhrase::try_from(r.as_bytes().to_vec()).ok());
        buf.advance(len);
        let bodiless =
            is_head || status == StatusCode::NO_CONTENT || status == StatusCode::NOT_MODIFIED;
        let framing = facts
            .response(version == Version::HTTP_11, bodiless)
            .map_err(Error::Parse)?;
        if framing.drop_length {
            // Read by its Transfer-Encoding: a length forwarded with it
            // would frame the client's copy (the server holds a response
            // to its Content-Length), cutting or stalling the body.
            headers.remove(header::CONTENT_LENGTH);
        }
        let decoder = Decoder::new(match framing.body {
            BodyLength::Empty => Framing::Done,
            BodyLength::Length(n) => Framing::Length(n),
            BodyLength::Chunked => Framing::Chunked(Chunk::Size),
            BodyLength::ToClose => Framing::Close,
        });
        let keep_alive = framing.persistent;
        let mut response = Response::new(());
        *response.status_mut() = status;
        *response.version_mut() = version;
        *response.headers_mut() = headers;
        if let Some(r) = reason {
            response.extensions_mut().insert(r);
        }
        return Ok(Some(Head {
            response,
            decoder,
            keep_alive,
        }));
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Framing {
    Length(u64),
    Chunked(Chunk),
    /// Until the upstream closes the connection.
    Close,
    Done,
}

/// Where a chunked body's decoder is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Chunk {
    /// Before a chunk-size line.
    Size,
    /// Inside a chunk's data, this much left.
    Data(u64),
    /// After a chunk's data: its CRLF.
    DataEnd,
    /// After the last chunk: trailer fields, then an empty line.
    Trailers,
}

/// What decoding found in the buffer.
#[derive(Debug)]
pub(crate) enum Decoded {
    Frame(Frame<Bytes>),
    /// The body ended.
    End,
    /// More bytes are needed.
    More,
}

/// What [`Decoder::step`] found in the buffer.
enum Step {
    /// This many bytes at the front of the buffer are body data.
    Data(usize),
    Trailers(HeaderMap),
    End,
    More,
}

/// Cuts a response body's frames out of the read buffer.
#[derive(Debug)]
pub(crate) struct Decoder {
    framing: Framing,
}

impl Decoder {
    fn new(framing: Framing) -> Self {
        Decoder { framing }
    }

    pub(crate) fn is_done(&self) -> bool {
        self.framing == Framing::Done
    }

    pub(crate) fn size_hint(&self) -> SizeHint {
        match self.framing {
            Framing::Length(n) => SizeHint::with_exact(n),
            Framing::Done => SizeHint::with_exact(0),
            _ => SizeHint::default(),
        }
    }

    /// The next frame in `buf` (consumed).
    pub(crate) fn decode(&mut self, buf: &mut BytesMut) -> Result<Decoded, Error> {
        Ok(match self.step(buf)? {
            Step::Data(n) => {
                let data = buf.split_to(n).freeze();
                self.took(buf, n)?;
                Decoded::Frame(Frame::data(data))
            }
            Step::Trailers(t) => Decoded::Frame(Frame::trailers(t)),
            Step::End => Decoded::End,
            Step::More => Decoded::More,
        })
    }

    /// `first` (data just decoded) and the data decodable after it in
    /// `buf`, copied together; trailers or an error met on the way are
    /// handed back to follow the data.
    pub(crate) fn join(
        &mut self,
        buf: &mut BytesMut,
        first: Bytes,
    ) -> (Bytes, Option<Result<Frame<Bytes>, Error>>) {
        let mut joined: Option<BytesMut> = None;
        let mut add = |data: &[u8], left: usize| {
            joined
                .get_or_insert_with(|| {
                    let mut j = BytesMut::with_capacity(first.len() + data.len() + left);
                    j.extend_from_slice(&first);
                    j
                })
                .extend_from_slice(data);
        };
        let held = loop {
            if self.framing == Framing::Chunked(Chunk::Size) {
                let taken = whole_chunks(buf, |data| add(&buf[data.clone()], buf.len() - data.end));
                buf.advance(taken);
            }
            match self.step(buf) {
                Ok(Step::Data(n)) => {
                    add(&buf[..n], buf.len() - n);
                    buf.advance(n);
                    if let Err(e) = self.took(buf, n) {
                        break Some(Err(e));
                    }
                }
                Ok(Step::Trailers(t)) => break Some(Ok(Frame::trailers(t))),
                Ok(Step::End | Step::More) => break None,
                Err(e) => break Some(Err(e)),
            }
        };
        (joined.map_or(first, BytesMut::freeze), held)
    }

    /// What comes next in `buf`: framing is consumed, data is not (the
    /// caller takes it, then says so with [`Decoder::took`]).
    fn step(&mut self, buf: &mut BytesMut) -> Result<Step, Error> {
        loop {
            let left = match self.framing {
                Framing::Done => return Ok(Step::End),
                Framing::Close => u64::MAX,
                Framing::Length(left) | Framing::Chunked(Chunk::Data(left)) => left,
                Framing::Chunked(Chunk::Size) => {
                    // A size line is a few bytes: a plain scan beats
                    // memchr's setup.
                    let Some(eol) = buf.iter().take(MAX_LINE + 1).position(|&b| b == b'\n') else {
                        return self.more(buf);
                    };
                    let size = chunk_size(&buf[..eol])?;
                    buf.advance(eol + 1);
                    self.framing = Framing::Chunked(if size == 0 {
                        Chunk::Trailers
                    } else {
                        Chunk::Data(size)
                    });
                    continue;
                }
                Framing::Chunked(Chunk::DataEnd) => {
                    if buf.len() < 2 && !buf.starts_with(b"\n") {
                        return Ok(Step::More);
                    }
                    self.skip_end(buf)?;
                    continue;
                }
                Framing::Chunked(Chunk::Trailers) => {
                    if buf.starts_with(b"\r\n") || buf.starts_with(b"\n") {
                        buf.advance(if buf[0] == b'\r' { 2 } else { 1 });
                        self.framing = Framing::Done;
                        return Ok(Step::End);
                    }
                    let Some(at) = memchr::memmem::find(buf, b"\r\n\r\n") else {
                        return self.more(buf);
                    };
                    let trailers = parse_trailers(&buf[..at + 4])?;
                    buf.advance(at + 4);
                    self.framing = Framing::Done;
                    return Ok(Step::Trailers(trailers));
                }
            };
            if buf.is_empty() {
                return Ok(Step::More);
            }
            return Ok(Step::Data(
                usize::try_from(left).unwrap_or(usize::MAX).min(buf.len()),
            ));
        }
    }

    /// `n` bytes of data, as [`Decoder::step`] announced, were taken from
    /// the front of `buf`.
    fn took(&mut self, buf: &mut BytesMut, n: usize) -> Result<(), Error> {
        match self.framing {
            Framing::Length(left) => {
                let rest = left - n as u64;
                self.framing = if rest == 0 {
                    Framing::Done
                } else {
                    Framing::Length(rest)
                };
            }
            Framing::Chunked(Chunk::Data(left)) => {
                let rest = left - n as u64;
                if rest == 0 {
                    self.framing = Framing::Chunked(Chunk::DataEnd);
                    // The body's end, when it is already here, ends the
                    // body with this data (the connection goes back to the
                    // pool as the last data leaves).
                    self.skip_end(buf)?;
                } else {
                    self.framing = Framing::Chunked(Chunk::Data(rest));
                }
            }
            _ => {}
        }
        Ok(())
    }

    /// After a chunk's data: consumes its line end, and the last chunk with
    /// no trailers if it follows (so the body is seen to end with the data).
    fn skip_end(&mut self, buf: &mut BytesMut) -> Result<(), Error> {
        let n = if buf.starts_with(b"\r\n") {
            2
        } else if buf.starts_with(b"\n") {
            1
        } else if buf.is_empty() || buf[..] == b"\r"[..] {
            return Ok(());
        } else {
            return Err(Error::Parse("chunk data longer than its size"));
        };
        buf.advance(n);
        self.framing = Framing::Chunked(Chunk::Size);
        if buf.starts_with(b"0\r\n\r\n") {
            buf.advance(5);
            self.framing = Framing::Done;
        }
        Ok(())
    }

    fn more(&self, buf: &BytesMut) -> Result<Step, Error> {
        if buf.len() > MAX_LINE {
            return Err(Error::Parse("chunk-size line or trailers too long"));
        }
        Ok(Step::More)
    }

    /// The connection ended: the end of a body read to the close, else an
    /// incomplete one.
    pub(crate) fn eof(&mut self) -> Result<(), Error> {
        match self.framing {
            Framing::Close | Framing::Done => {
                self.framing = Framing::Done;
                Ok(())
            }
            _ => Err(Error::Incomplete),
        }
    }
}

/// The whole chunks at the front of `buf`, which starts at a chunk-size
/// line: each one's data handed to `each` by its range in `buf`; how many
/// bytes they take. Stops before anything else (a chunk not all read, the
/// last chunk, a line end or size [`Decoder::step`] has to judge), which
/// the decoder then reads as ever.
///
/// An SSE burst is ~20 chunks in one read: read by offset, with the buffer
/// advanced once, a chunk costs a fifth of the three decoder steps and
/// three buffer advances it took one by one.
fn whole_chunks(buf: &[u8], mut each: impl FnMut(std::ops::Range<usize>)) -> usize {
    let mut at = 0;
    loop {
        let rest = &buf[at..];
        // The size line as servers write it: hex digits and a CRLF, read
        // in one pass. Extensions, a bare LF or a bad size go to the
        // decoder's step, which judges them.
        let Some((size, digits)) = hex_prefix(rest) else {
            return at;
        };
        if digits == 0 || size == 0 || rest.get(digits..digits + 2) != Some(&b"\r\n"[..]) {
            return at;
        }
        let Ok(size) = usize::try_from(size) else {
            return at;
        };
        let start = digits + 2;
        let Some(end) = start.checked_add(size) else {
            return at;
        };
        if !rest
            .get(end..)
            .is_some_and(|after| after.starts_with(b"\r\n"))
        {
            return at;
        }
        each(at + start..at + end);
        at += end + 2;
    }
}

/// A trailer block, its empty line included.
fn parse_trailers(block: &[u8]) -> Result<HeaderMap, Error> {
    let mut fields = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let httparse::Status::Complete((_, fields)) = httparse::parse_headers(block, &mut fields)?
    else {
        return Err(Error::Parse("bad trailers"));
    };
    let mut map = HeaderMap::with_capacity(fields.len());
    for f in fields.iter() {
        let name = HeaderName::from_bytes(f.name.as_bytes())
            .map_err(|_| Error::Parse("bad trailer name"))?;
        let value =
            HeaderValue::from_bytes(f.value).map_err(|_| Error::Parse("bad trailer value"))?;
        map.append(name, value);
    }
    Ok(map)
}

/// The hex digits at the front of `line`: their value and how many there
/// are; `None` past 16 (a size no `u64` holds).
fn hex_prefix(line: &[u8]) -> Option<(u64, usize)> {
    let mut size: u64 = 0;
    let mut digits = 0;
    while let Some(&b) = line.get(digits) {
        let d = match b {
            b'0'..=b'9' => b - b'0',
            b'a'..=b'f' => b - b'a' + 10,
            b'A'..=b'F' => b - b'A' + 10,
            _ => break,
        };
        if digits == 16 {
            return None;
        }
        size = size << 4 | u64::from(d);
        digits += 1;
    }
    Some((size, digits))
}

/// A chunk-size line (without its LF): hex digits, then extensions.
fn chunk_size(line: &[u8]) -> Result<u64, Error> {
    const BAD: Error = Error::Parse("bad chunk size");
    let line = line.strip_suffix(b"\r").unwrap_or(line);
    match hex_prefix(line) {
        Some((size, digits)) if digits > 0 => match line.get(digits) {
            None | Some(b';' | b' ' | b'\t') => Ok(size),
            Some(_) => Err(BAD),
        },
        _ => Err(BAD),
    }
}

/// The body of a response being read, and the connection it is read from.
/// Polled, it writes what is left of the request, then decodes what was
/// read, reading the socket when it needs more.
///
/// A data frame is all the body data already read: the chunks of an SSE
/// burst that arrived in one read leave as one frame (copied together once;
/// a single chunk, or a sized body, is a slice of the read buffer), so the
/// body stack above and the client's chunk encoder run once per burst.
pub(crate) struct Reading {
    pub(crate) conn: Box<Conn>,
    pub(crate) decoder: Decoder,
    pub(crate) keep_alive: bool,
    /// Trailers or an error met while joining: they follow the data.
    held: Option<Result<Frame<Bytes>, Error>>,
}

impl Reading {
    pub(crate) fn new(conn: Box<Conn>, decoder: Decoder, keep_alive: bool) -> Self {
        Reading {
            conn,
            decoder,
            keep_alive,
            held: None,
        }
    }

    /// Whether the body has nothing more to give.
    pub(crate) fn is_done(&self) -> bool {
        self.decoder.is_done() && self.held.is_none()
    }

    /// The next frame; `Ready(None)` at the body's end.
    pub(crate) fn poll_frame(
        &mut self,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Error>>> {
        if let Some(held) = self.held.take() {
            return Poll::Ready(Some(held));
        }
        if self.conn.out.is_some() && self.conn.poll_write_request(cx).is_err() {
            // The response goes on; the connection is not used again.
            self.conn.out = None;
            self.keep_alive = false;
        }
        loop {
            match self.decoder.decode(&mut self.conn.buf) {
                Err(e) => return Poll::Ready(Some(Err(e))),
                Ok(Decoded::Frame(f)) => {
                    return Poll::Ready(Some(Ok(match f.into_data() {
                        Ok(data) => Frame::data(self.join(data)),
                        Err(trailers) => trailers,
                    })))
                }
                Ok(Decoded::End) => return Poll::Ready(None),
                Ok(Decoded::More) => match self.conn.poll_fill(cx) {
                    Poll::Pending => return Poll::Pending,
                    Poll::Ready(Ok(0)) => {
                        self.keep_alive = false;
                        return Poll::Ready(self.decoder.eof().err().map(Err));
                    }
                    Poll::Ready(Ok(_)) => {}
                    Poll::Ready(Err(e)) => return Poll::Ready(Some(Err(Error::Read(e)))),
                },
            }
        }
    }

    /// `first` and the data decodable after it from what was already read,
    /// copied together straight from the read buffer.
    fn join(&mut self, first: Bytes) -> Bytes {
        let (joined, held) = self.decoder.join(&mut self.conn.buf, first);
        self.held = held;
        joined
    }

    /// Whether the connection can carry another request now that the body
    /// ended.
    pub(crate) fn reusable(&self) -> bool {
        self.keep_alive && self.is_done() && self.conn.out.is_none() && self.conn.buf.is_empty()
    }
}

/// A whole response as [`read_response`] read it.
#[doc(hidden)]
pub struct ResponseRead {
    pub(crate) head: Head,
    /// The body's bytes, all frames together.
    pub body: Vec<u8>,
    pub trailers: Option<HeaderMap>,
    /// Bytes read past the response's end (and never read).
    pub left: usize,
}

impl ResponseRead {
    /// The response head (status, version, header fields as forwarded).
    pub fn response(&self) -> &Response<()> {
        &self.head.response
    }

    /// Whether the connection could carry another request.
    pub fn keep_alive(&self) -> bool {
        self.head.keep_alive
    }
}

/// Reads a response out of `wire` as a connection would, each read ending
/// where `cuts` says (as the socket delivers); with `join`, each data frame
/// joined with the data read after it, as [`Reading`] sends a body on. For
/// the unit tests, the fuzz targets and their property tests
/// (`fuzz/checks.rs`): the decoder on bytes, without a socket.
#[doc(hidden)]
pub fn read_response(
    wire: &[u8],
    is_head: bool,
    cuts: &[usize],
    join: bool,
) -> Result<ResponseRead, Error> {
    let mut pending = wire;
    let mut buf = BytesMut::new();
    let mut cuts = cuts.iter().copied();
    let mut feed = |buf: &mut BytesMut| -> bool {
        if pending.is_empty() {
            return false;
        }
        let n = cuts.next().unwrap_or(pending.len()).clamp(1, pending.len());
        buf.extend_from_slice(&pending[..n]);
        pending = &pending[n..];
        true
    };
    let mut head = loop {
        if let Some(h) = parse_head(&mut buf, is_head)? {
            break h;
        }
        if buf.len() > MAX_HEAD {
            return Err(Error::Parse("response head too large"));
        }
        if !feed(&mut buf) {
            return Err(Error::Incomplete);
        }
    };
    let mut body = Vec::new();
    let mut trailers = None;
    loop {
        match head.decoder.decode(&mut buf)? {
            Decoded::Frame(f) => match f.into_data() {
                Ok(d) if join => {
                    let (d, held) = head.decoder.join(&mut buf, d);
                    body.extend_from_slice(&d);
                    match held {
                        Some(Ok(f)) => trailers = f.into_trailers().ok(),
                        Some(Err(e)) => return Err(e),
                        None => {}
                    }
                }
                Ok(d) => body.extend_from_slice(&d),
                Err(f) => trailers = f.into_trailers().ok(),
            },
            Decoded::End => break,
            Decoded::More => {
                if !feed(&mut buf) {
                    head.decoder.eof()?;
                    break;
                }
            }
        }
    }
    let left = buf.len() + pending.len();
    Ok(ResponseRead {
        head,
        body,
        trailers,
        left,
    })
}

#[cfg(test)]
mod tests;
