//! Client connection bounds: the cap on open connections (beyond it a raw
//! 503 and close), and the idle timeout (no request in flight and no
//! request bytes for `timeouts.client_idle_secs` → close; this also covers
//! a connection that never sends a byte, which hyper-util's version sniffing
//! would otherwise wait on forever).

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::TcpStream;
use tokio::time::Sleep;

use crate::error::RETRY_AFTER_SECS;
use crate::metrics::Metrics;

/// Requests in flight on one connection.
#[derive(Debug, Default)]
pub struct Activity(AtomicUsize);

/// One request in flight on its connection, until dropped (with the
/// response body's end, or when hyper drops the handler).
#[derive(Debug)]
pub struct Active(Arc<Activity>);

impl Active {
    /// Counts a request on `activity`.
    pub fn new(activity: &Arc<Activity>) -> Self {
        activity.0.fetch_add(1, Ordering::Relaxed);
        Active(Arc::clone(activity))
    }
}

impl Drop for Active {
    fn drop(&mut self) {
        (self.0).0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// A client socket whose reads fail with `TimedOut` once it has been idle
/// (no request in flight, no bytes) for `idle`; hyper then closes it.
pub struct IdleIo {
    inner: TcpStream,
    idle: Duration,
    activity: Arc<Activity>,
    armed: bool,
    sleep: Pin<Box<Sleep>>,
    metrics: Arc<Metrics>,
}

impl IdleIo {
    /// Wraps an accepted socket.
    pub fn new(
        inner: TcpStream,
        idle: Duration,
        activity: Arc<Activity>,
        metrics: Arc<Metrics>,
    ) -> Self {
        IdleIo {
            inner,
            idle,
            activity,
            armed: false,
            sleep: Box::pin(tokio::time::sleep(idle)),
            metrics,
        }
    }
}

impl AsyncRead for IdleIo {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = &mut *self;
        match Pin::new(&mut this.inner).poll_read(cx, buf) {
            Poll::Pending => {}
            ready => {
                this.armed = false;
                return ready;
            }
        }
        if this.activity.0.load(Ordering::Relaxed) > 0 {
            // A request is being answered: a quiet client is fine.
            this.armed = false;
            return Poll::Pending;
        }
        if !this.armed {
            this.armed = true;
            this.sleep.as_mut().reset(crate::clock::from_now(this.idle));
        }
        match this.sleep.as_mut().poll(cx) {
            Poll::Ready(()) => {
                this.metrics.record_idle_connection_close();
                Poll::Ready(Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "client connection idle",
                )))
            }
            Poll::Pending => Poll::Pending,
        }
    }
}

impl AsyncWrite for IdleIo {
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
        bufs: &[io::IoSlice<'_>],
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

/// How long a refused connection may take to receive its 503.
const REJECT_WRITE: Duration = Duration::from_secs(1);

/// Answers a connection beyond the cap with a 503 and closes it, without
/// reading its request (bounded: a client that does not read is dropped).
pub async fn reject(mut stream: TcpStream) {
    let body = r#"{"error":{"message":"compactor is at capacity: too many open connections","type":"server_error","code":"overloaded"}}"#;
    let head = format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nretry-after: {RETRY_AFTER_SECS}\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
        body.len()
    );
    let write = async {
        stream.write_all(head.as_bytes()).await?;
        stream.write_all(body.as_bytes()).await?;
        stream.shutdown().await
    };
    if let Err(e) = tokio::time::timeout(REJECT_WRITE, write)
        .await
        .unwrap_or_else(|_| Err(io::ErrorKind::TimedOut.into()))
    {
        tracing::debug!(error = %e, "503 to a refused connection not delivered");
    }
}
