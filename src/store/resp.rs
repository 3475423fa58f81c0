//! A small RESP2 client for the Redis/Valkey backend: URL parsing, AUTH and
//! SELECT, plain TCP or TLS (rustls, as the upstream client), and a pool of
//! connections that reconnects on its own.
//!
//! Hand-rolled rather than the `redis` crate: the backend needs a dozen
//! commands and Lua scripts, and the crate (with `tokio-comp`, rustls and
//! its connection manager) adds 37 crates to the build, the `url`/`idna`/ICU
//! stack among them. Each call takes a connection out of the pool and puts
//! it back only after a complete reply, so a call that fails or is cancelled
//! (the store's timeout) drops its connection instead of leaving a reply
//! unread on it; the next call dials again.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;

/// A bulk string or array longer than this is refused (a bounded reply).
const MAX_BULK: usize = 64 << 20;
const MAX_ARRAY: usize = 1 << 20;
/// Connections kept idle for reuse.
const MAX_IDLE: usize = 16;
/// Connections open at once: a slow server makes callers queue (within
/// their timeout) instead of dialling without bound.
const MAX_OPEN: usize = 64;
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);

/// One RESP2 reply.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reply {
    /// `+OK`
    Simple(String),
    /// `-ERR …`
    Error(String),
    /// `:n`
    Int(i64),
    /// `$n` (None: the null bulk string).
    Bulk(Option<Vec<u8>>),
    /// `*n` (None: the null array).
    Array(Option<Vec<Reply>>),
}

impl Reply {
    /// The bytes of a bulk or simple string; `None` for nil and others.
    pub fn into_bytes(self) -> Option<Vec<u8>> {
        match self {
            Reply::Bulk(b) => b,
            Reply::Simple(s) => Some(s.into_bytes()),
            _ => None,
        }
    }

    /// An integer reply (or a bulk string holding one).
    pub fn as_int(&self) -> Option<i64> {
        match self {
            Reply::Int(n) => Some(*n),
            Reply::Bulk(Some(b)) => std::str::from_utf8(b).ok()?.parse().ok(),
            _ => None,
        }
    }

    /// The elements of an array reply (nil: empty).
    pub fn into_array(self) -> Vec<Reply> {
        match self {
            Reply::Array(Some(v)) => v,
            _ => Vec::new(),
        }
    }
}

/// Why a call failed.
#[derive(Debug, thiserror::Error)]
pub enum RespError {
    /// Connecting, reading or writing failed.
    #[error("redis i/o: {0}")]
    Io(#[from] std::io::Error),
    /// The server broke the protocol (or a reply exceeded its bound).
    #[error("redis protocol: {0}")]
    Protocol(&'static str),
    /// The server answered with an error reply.
    #[error("redis error reply: {0}")]
    Server(String),
    /// The URL is not usable.
    #[error("redis url: {0}")]
    Url(String),
}

/// A parsed `redis://` or `rediss://` URL.
#[derive(Clone, PartialEq, Eq)]
pub struct RedisUrl {
    /// Host name or address.
    pub(crate) host: String,
    /// Port (6379 unless given).
    pub(crate) port: u16,
    /// `rediss://`
    pub(crate) tls: bool,
    /// ACL user name (AUTH user pass).
    pub(crate) user: Option<String>,
    /// Password (AUTH [user] pass).
    pub(crate) pass: Option<String>,
    /// Database number (SELECT).
    pub(crate) db: u32,
}

impl std::fmt::Debug for RedisUrl {
    // The password never reaches a log.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisUrl")
            .field("host", &self.host)
            .field("port", &self.port)
            .field("tls", &self.tls)
            .field("auth", &self.pass.is_some())
            .field("db", &self.db)
            .finish()
    }
}

fn percent_decode(s: &str) -> Result<String, RespError> {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = bytes
                .get(i + 1..i + 3)
                .and_then(|h| std::str::from_utf8(h).ok())
                .and_then(|h| u8::from_str_radix(h, 16).ok())
                .ok_or_else(|| RespError::Url("bad percent escape".into()))?;
            out.push(hex);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).map_err(|_| RespError::Url("credentials are not UTF-8".into()))
}

impl RedisUrl {
    /// Parses `redis://[user:pass@]host[:port][/db]` (or `rediss://`).
    pub(crate) fn parse(url: &str) -> Result<Self, RespError> {
        let (tls, rest) = if let Some(r) = url.strip_prefix("rediss://") {
            (true, r)
        } else if let Some(r) = url.strip_prefix("redis://") {
            (false, r)
        } else {
            return Err(RespError::Url("expected redis:// or rediss://".into()));
        };
        let (authority, path) = rest.split_once('/').unwrap_or((rest, ""));
        let (auth, hostport) = match authority.rsplit_once('@') {
            Some((a, h)) => (Some(a), h),
            None => (None, authority),
        };
        let (user, pass) = match auth {
            None => (None, None),
            Some(a) => match a.split_once(':') {
                Some((u, p)) => (
                    (!u.is_empty()).then(|| percent_decode(u)).transpose()?,
                    Some(percent_decode(p)?),
                ),
                // `redis://pass@host` is ambiguous; treat a lone part as the password.
                None => (None, Some(percent_decode(a)?)),
            },
        };
        let (host, port) = split_host_port(hostport)?;
        let db = match path.trim_end_matches('/') {
            "" => 0,
            d => d
                .parse()
                .map_err(|_| RespError::Url("database must be a number".into()))?,
        };
        Ok(Self {
            host,
            port,
            tls,
            user,
            pass,
            db,
        })
    }
}

fn split_host_port(hostport: &str) -> Result<(String, u16), RespError> {
    let bad_port = || RespError::Url("bad port".into());
    if let Some(v6) = hostport.strip_prefix('[') {
        let (host, after) = v6
            .split_once(']')
            .ok_or_else(|| RespError::Url("unclosed [".into()))?;
        let port = match after.strip_prefix(':') {
            Some(p) => p.parse().map_err(|_| bad_port())?,
            None => 6379,
        };
        return Ok((host.to_owned(), port));
    }
    let (host, port) = match hostport.rsplit_once(':') {
        Some((h, p)) => (h, p.parse().map_err(|_| bad_port())?),
        None => (hostport, 6379),
    };
    if host.is_empty() {
        return Err(RespError::Url("no host".into()));
    }
    Ok((host.to_owned(), port))
}

/// Encodes one command as a RESP array of bulk strings.
pub fn encode(args: &[&[u8]]) -> Vec<u8> {
    let mut out = Vec::with_capacity(16 + args.iter().map(|a| a.len() + 16).sum::<usize>());
    out.extend_from_slice(format!("*{}\r\n", args.len()).as_bytes());
    for a in args {
        out.extend_from_slice(format!("${}\r\n", a.len()).as_bytes());
        out.extend_from_slice(a);
        out.extend_from_slice(b"\r\n");
    }
    out
}

trait Io: AsyncRead + AsyncWrite + Unpin + Send {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send> Io for T {}

/// One connection.
pub struct Conn {
    io: BufReader<Box<dyn Io>>,
}

async fn read_line<R: AsyncBufReadExt + Unpin>(r: &mut R) -> Result<String, RespError> {
    let mut line = Vec::new();
    // Bounded: a header line is short.
    let n = (&mut *r)
        .take(64 << 10)
        .read_until(b'\n', &mut line)
        .await?;
    if n == 0 {
        return Err(RespError::Io(std::io::ErrorKind::UnexpectedEof.into()));
    }
    if !line.ends_with(b"\r\n") {
        return Err(RespError::Protocol("line not terminated"));
    }
    line.truncate(line.len() - 2);
    String::from_utf8(line).map_err(|_| RespError::Protocol("line not UTF-8"))
}

fn parse_len(s: &str, max: usize) -> Result<Option<usize>, RespError> {
    let n: i64 = s.parse().map_err(|_| RespError::Protocol("bad length"))?;
    if n < 0 {
        return Ok(None);
    }
    let n = usize::try_from(n).map_err(|_| RespError::Protocol("bad length"))?;
    if n > max {
        return Err(RespError::Protocol("reply exceeds its bound"));
    }
    Ok(Some(n))
}

/// Reads one reply (arrays recursively).
pub fn read_reply<'a, R: AsyncBufReadExt + Unpin + Send>(
    r: &'a mut R,
) -> std::pin::Pin<Box<dyn std::future::Future<Output = Result<Reply, RespError>> + Send + 'a>> {
    Box::pin(async move {
        let line = read_line(r).await?;
        let (tag, rest) = line.split_at(line.len().min(1));
        match tag {
            "+" => Ok(Reply::Simple(rest.to_owned())),
            "-" => Ok(Reply::Error(rest.to_owned())),
            ":" => rest
                .parse()
                .map(Reply::Int)
                .map_err(|_| RespError::Protocol("bad integer")),
            "$" => match parse_len(rest, MAX_BULK)? {
                None => Ok(Reply::Bulk(None)),
                Some(n) => {
                    let mut buf = vec![0; n + 2];
                    r.read_exact(&mut buf).await?;
                    if !buf.ends_with(b"\r\n") {
                        return Err(RespError::Protocol("bulk not terminated"));
                    }
                    buf.truncate(n);
                    Ok(Reply::Bulk(Some(buf)))
                }
            },
            "*" => match parse_len(rest, MAX_ARRAY)? {
                None => Ok(Reply::Array(None)),
                Some(n) => {
                    let mut items = Vec::with_capacity(n.min(1024));
                    for _ in 0..n {
                        items.push(read_reply(r).await?);
                    }
                    Ok(Reply::Array(Some(items)))
                }
            },
            _ => Err(RespError::Protocol("unknown reply type")),
        }
    })
}

impl Conn {
    /// Sends one command and reads its reply; an error reply is an `Err`.
    pub async fn call(&mut self, args: &[&[u8]]) -> Result<Reply, RespError> {
        self.io.get_mut().write_all(&encode(args)).await?;
        self.io.get_mut().flush().await?;
        match read_reply(&mut self.io).await? {
            Reply::Error(e) => Err(RespError::Server(e)),
            other => Ok(other),
        }
    }
}

/// A pool of connections to one server.
pub struct Client {
    url: RedisUrl,
    tls: Option<tokio_rustls::TlsConnector>,
    idle: Mutex<Vec<Conn>>,
    open: tokio::sync::Semaphore,
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Client").field("url", &self.url).finish()
    }
}

impl Client {
    /// A client for `url`; `tls` is the rustls configuration `rediss://`
    /// uses. Connects lazily.
    pub fn new(url: RedisUrl, tls: Option<Arc<rustls::ClientConfig>>) -> Self {
        Self {
            url,
            tls: tls.map(tokio_rustls::TlsConnector::from),
            idle: Mutex::new(Vec::new()),
            open: tokio::sync::Semaphore::new(MAX_OPEN),
        }
    }

    async fn connect(&self) -> Result<Conn, RespError> {
        let addr = (self.url.host.as_str(), self.url.port);
        let tcp = tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect(addr))
            .await
            .map_err(|_| RespError::Io(std::io::ErrorKind::TimedOut.into()))??;
        tcp.set_nodelay(true)?;
        let io: Box<dyn Io> = match (&self.tls, self.url.tls) {
            (Some(connector), true) => {
                let name = rustls::pki_types::ServerName::try_from(self.url.host.clone())
                    .map_err(|_| RespError::Url("host is not a TLS server name".into()))?;
                Box::new(connector.connect(name, tcp).await?)
            }
            (None, true) => return Err(RespError::Url("rediss:// without TLS setup".into())),
            _ => Box::new(tcp),
        };
        let mut conn = Conn {
            io: BufReader::new(io),
        };
        if let Some(pass) = &self.url.pass {
            match &self.url.user {
                Some(user) => {
                    conn.call(&[b"AUTH", user.as_bytes(), pass.as_bytes()])
                        .await?
                }
                None => conn.call(&[b"AUTH", pass.as_bytes()]).await?,
            };
        }
        if self.url.db != 0 {
            conn.call(&[b"SELECT", self.url.db.to_string().as_bytes()])
                .await?;
        }
        Ok(conn)
    }

    /// Drops the idle connections.
    pub fn clear_idle(&self) {
        crate::sync::lock(&self.idle).clear();
    }

    /// Runs one command on a pooled connection (dialling one if none is
    /// idle). An error reply leaves the connection usable; any other
    /// failure drops it.
    pub async fn call(&self, args: &[&[u8]]) -> Result<Reply, RespError> {
        let _permit = self
            .open
            .acquire()
            .await
            .map_err(|_| RespError::Protocol("client closed"))?;
        let idle = crate::sync::lock(&self.idle).pop();
        let mut conn = match idle {
            Some(c) => c,
            None => self.connect().await?,
        };
        let result = conn.call(args).await;
        if matches!(result, Ok(_) | Err(RespError::Server(_))) {
            let mut idle = crate::sync::lock(&self.idle);
            if idle.len() < MAX_IDLE {
                idle.push(conn);
            }
        }
        result
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_parse_with_auth_tls_port_and_db() {
        let u = RedisUrl::parse("rediss://al%40ice:p%3Ass@cache.internal:6380/3").unwrap();
        assert_eq!(
            (u.host.as_str(), u.port, u.tls, u.db),
            ("cache.internal", 6380, true, 3)
        );
        assert_eq!(u.user.as_deref(), Some("al@ice"));
        assert_eq!(u.pass.as_deref(), Some("p:ss"));
        let u = RedisUrl::parse("redis://:secret@127.0.0.1").unwrap();
        assert_eq!(
            (u.user, u.pass.as_deref(), u.port),
            (None, Some("secret"), 6379)
        );
        let u = RedisUrl::parse("redis://[::1]:7000/").unwrap();
        assert_eq!((u.host.as_str(), u.port, u.db), ("::1", 7000, 0));
        for bad in [
            "http://x",
            "redis://",
            "redis://h:port",
            "redis://h/x",
            "redis://%zz@h",
        ] {
            assert!(RedisUrl::parse(bad).is_err(), "{bad}");
        }
        assert!(
            !format!("{:?}", RedisUrl::parse("redis://u:hunter2@h").unwrap()).contains("hunter2")
        );
    }

    #[test]
    fn commands_encode_as_bulk_arrays() {
        assert_eq!(
            encode(&[b"SET", b"k", b"a\r\nb"]),
            b"*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$4\r\na\r\nb\r\n".to_vec()
        );
    }

    async fn parse(bytes: &[u8]) -> Result<Reply, RespError> {
        let mut r = BufReader::new(bytes);
        read_reply(&mut r).await
    }

    #[tokio::test]
    async fn replies_parse_including_nested_and_nil() {
        assert_eq!(parse(b"+OK\r\n").await.unwrap(), Reply::Simple("OK".into()));
        assert_eq!(parse(b":-7\r\n").await.unwrap(), Reply::Int(-7));
        assert_eq!(parse(b"$-1\r\n").await.unwrap(), Reply::Bulk(None));
        assert_eq!(
            parse(b"*2\r\n$2\r\nhi\r\n*1\r\n:1\r\n").await.unwrap(),
            Reply::Array(Some(vec![
                Reply::Bulk(Some(b"hi".to_vec())),
                Reply::Array(Some(vec![Reply::Int(1)])),
            ]))
        );
        assert_eq!(
            parse(b"-ERR no\r\n").await.unwrap(),
            Reply::Error("ERR no".into())
        );
        assert!(parse(b"$5\r\nab\r\n").await.is_err(), "short bulk");
        assert!(parse(b"$999999999999\r\n").await.is_err(), "over the bound");
        assert!(parse(b"?x\r\n").await.is_err());
        assert!(parse(b"").await.is_err());
    }
}
