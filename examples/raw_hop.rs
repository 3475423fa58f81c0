//! The floor of a tokio proxy hop without an HTTP library: what a hop costs
//! when all it does is find where each request and response ends and copy
//! the bytes, as nginx does with `proxy_buffering off`. The load benchmark
//! runs it beside the hyper hop (`naive_proxy`) and nginx, so the price of
//! hyper's HTTP/1 machinery can be told apart from the price of tokio, the
//! sockets and the loopback.
//!
//! `cargo run --example raw_hop -- LISTEN UPSTREAM_ADDR [THREADS]`
//!
//! Each thread runs a current-thread runtime accepting from the shared
//! listening socket (as compactor's `server::cores`); each client connection
//! gets one keep-alive upstream connection of its own. Heads are parsed with
//! httparse only to learn the framing; the bytes go out as they came (no
//! header is rewritten). Request bodies must have a `Content-Length`;
//! response bodies may be sized, chunked or close-delimited. Anything else
//! closes the connection: this is a yardstick, not a proxy to deploy.
//! Prints `listening on <addr>`.

use std::io;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

const MAX_HEADERS: usize = 64;

fn main() -> Result<(), BoxError> {
    let mut args = std::env::args().skip(1);
    let listen = args.next().unwrap_or_else(|| "127.0.0.1:0".to_owned());
    let upstream = args
        .next()
        .ok_or("usage: raw_hop LISTEN UPSTREAM_ADDR [THREADS]")?;
    let threads = args
        .next()
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    let listener = std::net::TcpListener::bind(&listen)?;
    listener.set_nonblocking(true)?;
    println!("listening on {}", listener.local_addr()?);
    let mut handles = Vec::new();
    for _ in 0..threads {
        let listener = listener.try_clone()?;
        let upstream = upstream.clone();
        handles.push(std::thread::spawn(move || serve(listener, upstream)));
    }
    for h in handles {
        h.join().map_err(|_| "a serving thread panicked")??;
    }
    Ok(())
}

fn serve(listener: std::net::TcpListener, upstream: String) -> Result<(), BoxError> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let local = tokio::task::LocalSet::new();
    local.block_on(&rt, async move {
        let listener = TcpListener::from_std(listener)?;
        loop {
            let (stream, _) = listener.accept().await?;
            stream.set_nodelay(true)?;
            let upstream = upstream.clone();
            tokio::task::spawn_local(async move {
                let _ = connection(stream, &upstream).await;
            });
        }
    })
}

/// Serves one client connection until it closes or sends what this hop
/// does not handle.
async fn connection(mut client: TcpStream, upstream: &str) -> io::Result<()> {
    let mut up: Option<TcpStream> = None;
    let mut buf = Vec::with_capacity(16 * 1024);
    let mut resp = Vec::with_capacity(16 * 1024);
    loop {
        // Read a request head.
        let (head_len, body_len) = loop {
            if let Some(found) = request_head(&buf)? {
                break found;
            }
            if read_more(&mut client, &mut buf).await? == 0 {
                return Ok(());
            }
        };
        let total = head_len + body_len;
        while buf.len() < total {
            if read_more(&mut client, &mut buf).await? == 0 {
                return Ok(());
            }
        }
        let upstream_conn = match &mut up {
            Some(s) => s,
            None => {
                let s = TcpStream::connect(upstream).await?;
                s.set_nodelay(true)?;
                up.insert(s)
            }
        };
        upstream_conn.write_all(&buf[..total]).await?;
        buf.drain(..total);
        let keep = relay_response(upstream_conn, &mut client, &mut resp).await?;
        if !keep {
            up = None;
        }
    }
}

async fn read_more(s: &mut TcpStream, buf: &mut Vec<u8>) -> io::Result<usize> {
    if buf.capacity() - buf.len() < 4096 {
        buf.reserve(16 * 1024);
    }
    s.read_buf(buf).await
}

/// `Some((head length, body length))` once a whole request head is in `buf`.
fn request_head(buf: &[u8]) -> io::Result<Option<(usize, usize)>> {
    let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut req = httparse::Request::new(&mut headers);
    match req.parse(buf).map_err(invalid)? {
        httparse::Status::Partial => Ok(None),
        httparse::Status::Complete(n) => {
            let mut len = 0;
            for h in req.headers.iter() {
                if h.name.eq_ignore_ascii_case("content-length") {
                    len = parse_len(h.value)?;
                } else if h.name.eq_ignore_ascii_case("transfer-encoding") {
                    return Err(invalid("chunked request bodies are not handled"));
                }
            }
            Ok(Some((n, len)))
        }
    }
}

enum Framing {
    Sized(usize),
    Chunked(Chunks),
    UntilClose,
}

/// Copies one response from `up` to `client`; `Ok(false)` when the upstream
/// connection cannot be used again.
async fn relay_response(
    up: &mut TcpStream,
    client: &mut TcpStream,
    buf: &mut Vec<u8>,
) -> io::Result<bool> {
    buf.clear();
    let (head_len, mut framing) = loop {
        if read_more(up, buf).await? == 0 {
            return Err(io::ErrorKind::UnexpectedEof.into());
        }
        let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
        let mut resp = httparse::Response::new(&mut headers);
        if let httparse::Status::Complete(n) = resp.parse(buf).map_err(invalid)? {
            let mut framing = Framing::UntilClose;
            for h in resp.headers.iter() {
                if h.name.eq_ignore_ascii_case("content-length") {
                    framing = Framing::Sized(parse_len(h.value)?);
                } else if h.name.eq_ignore_ascii_case("transfer-encoding") {
                    framing = Framing::Chunked(Chunks::default());
                }
            }
            break (n, framing);
        }
    };
    let mut body_start = head_len;
    loop {
        let done = match &mut framing {
            Framing::Sized(left) => {
                let here = (buf.len() - body_start).min(*left);
                *left -= here;
                *left == 0
            }
            Framing::Chunked(c) => c.feed(&buf[body_start..])?,
            Framing::UntilClose => false,
        };
        client.write_all(buf).await?;
        buf.clear();
        body_start = 0;
        if done {
            return Ok(true);
        }
        if read_more(up, buf).await? == 0 {
            return match framing {
                Framing::UntilClose => Ok(false),
                _ => Err(io::ErrorKind::UnexpectedEof.into()),
            };
        }
    }
}

/// Where a chunked body ends, found without copying it.
#[derive(Default)]
struct Chunks {
    state: ChunkState,
    size: usize,
}

#[derive(Default, Clone, Copy, PartialEq)]
enum ChunkState {
    #[default]
    Size,
    Extension,
    SizeLf,
    Data,
    DataCr,
    DataLf,
    /// After the last chunk: trailer lines until an empty one.
    TrailerStart,
    TrailerLine,
    TrailerLf,
    EndLf,
}

impl Chunks {
    /// Consumes `bytes`; true once the body's last byte was among them.
    fn feed(&mut self, bytes: &[u8]) -> io::Result<bool> {
        let mut i = 0;
        while i < bytes.len() {
            let b = bytes[i];
            match self.state {
                ChunkState::Size => match b {
                    b'0'..=b'9' | b'a'..=b'f' | b'A'..=b'F' => {
                        let d = (b as char).to_digit(16).unwrap_or(0) as usize;
                        self.size = self
                            .size
                            .checked_mul(16)
                            .and_then(|s| s.checked_add(d))
                            .ok_or_else(|| invalid("chunk size overflows"))?;
                    }
                    b';' | b' ' | b'\t' => self.state = ChunkState::Extension,
                    b'\r' => self.state = ChunkState::SizeLf,
                    _ => return Err(invalid("bad chunk size")),
                },
                ChunkState::Extension => {
                    if b == b'\r' {
                        self.state = ChunkState::SizeLf;
                    }
                }
                ChunkState::SizeLf => {
                    if b != b'\n' {
                        return Err(invalid("bad chunk size line"));
                    }
                    self.state = if self.size == 0 {
                        ChunkState::TrailerStart
                    } else {
                        ChunkState::Data
                    };
                }
                ChunkState::Data => {
                    let take = (bytes.len() - i).min(self.size);
                    self.size -= take;
                    i += take;
                    if self.size == 0 {
                        self.state = ChunkState::DataCr;
                    }
                    continue;
                }
                ChunkState::DataCr => {
                    if b != b'\r' {
                        return Err(invalid("chunk data overruns its size"));
                    }
                    self.state = ChunkState::DataLf;
                }
                ChunkState::DataLf => {
                    if b != b'\n' {
                        return Err(invalid("chunk data overruns its size"));
                    }
                    self.state = ChunkState::Size;
                }
                ChunkState::TrailerStart => {
                    self.state = if b == b'\r' {
                        ChunkState::EndLf
                    } else {
                        ChunkState::TrailerLine
                    };
                }
                ChunkState::TrailerLine => {
                    if b == b'\r' {
                        self.state = ChunkState::TrailerLf;
                    }
                }
                ChunkState::TrailerLf => self.state = ChunkState::TrailerStart,
                ChunkState::EndLf => {
                    if i + 1 != bytes.len() {
                        return Err(invalid("bytes after the end of a chunked body"));
                    }
                    return Ok(true);
                }
            }
            i += 1;
        }
        Ok(false)
    }
}

fn parse_len(v: &[u8]) -> io::Result<usize> {
    std::str::from_utf8(v)
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .ok_or_else(|| invalid("bad content-length"))
}

fn invalid(e: impl ToString) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, e.to_string())
}
