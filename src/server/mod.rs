//! The server layer: the state every request shares, bind, the accept loop
//! and graceful shutdown; [`h1`] reads requests and writes responses (hyper's
//! server for what it leaves), [`router`] dispatches each request, [`admin`]
//! serves the session view. [`cores`] runs the accept loop on one thread per
//! core (it uses this module; this module uses only [`balance`], which
//! spreads the connections between those threads).
//!
//! Below it, [`crate::chat`] walks a chat completion and [`crate::upstream`]
//! talks to the upstream; neither reaches back up here.

pub mod admin;
pub(crate) mod balance;
pub mod conn;
pub mod cores;
pub mod fdlimit;
pub(crate) mod h1;
#[doc(hidden)]
pub use h1::{frame_request, Framed};
pub mod router;
pub mod ui;

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulShutdown;
use tokio::net::TcpListener;
use tokio::sync::{oneshot, watch};
use tokio::task::JoinHandle;

use balance::{handed_over, Balance, Load, Placed};

use crate::chat::ChatState;
use crate::config::{Config, ConfigError};
use crate::metrics::Metrics;
use crate::upstream::client::UpstreamSetupError;
use crate::upstream::Upstream;

/// State shared by every request.
pub struct AppState {
    /// The validated configuration.
    pub config: Arc<Config>,
    /// The upstream (pooled client, base, timeouts); shared with the
    /// compaction tasks, which outlive a request whose client left.
    pub(crate) upstream: Arc<Upstream>,
    /// Metrics registry (also held by `upstream` and `chat`).
    pub metrics: Arc<Metrics>,
    /// Sessions, compaction records, windows: the chat path's state
    /// (shared with the compaction tasks).
    pub(crate) chat: Arc<ChatState>,
}

impl std::fmt::Debug for AppState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AppState")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl AppState {
    /// Builds the state (upstream client, metrics) from a config.
    pub fn new(config: Config) -> Result<Self, AppError> {
        let metrics = Arc::new(Metrics::default());
        let upstream = Upstream::new(&config, Arc::clone(&metrics))?;
        let chat = ChatState::from_config(&config, Arc::clone(&metrics))?;
        Ok(AppState {
            config: Arc::new(config),
            upstream: Arc::new(upstream),
            metrics,
            chat: Arc::new(chat),
        })
    }
}

/// Start-up / serving failures.
#[derive(Debug, thiserror::Error)]
pub enum AppError {
    /// The upstream client could not be built.
    #[error(transparent)]
    Upstream(#[from] UpstreamSetupError),
    /// The configuration is invalid (found while building the state).
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// A serving thread or its runtime could not be started.
    #[error("cannot start a serving thread: {0}")]
    Runtime(#[source] std::io::Error),
    /// The listen address could not be bound.
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        /// The address.
        addr: SocketAddr,
        /// Cause.
        #[source]
        source: std::io::Error,
    },
}

/// How often idle sessions and compaction records are swept.
const SWEEP_EVERY: Duration = Duration::from_secs(30);

/// Binds the listener and builds the state.
pub async fn bind(config: Config) -> Result<(TcpListener, Arc<AppState>), AppError> {
    let addr = config.listen;
    let state = Arc::new(AppState::new(config)?);
    let listener = listen(addr).map_err(|source| AppError::Bind { addr, source })?;
    Ok((listener, state))
}

/// Connections the kernel queues before they are accepted (clamped by
/// `net.core.somaxconn`). tokio's `bind` asks for 1,024: a burst of more
/// silent connects than that (1,100 in `fault_load.sh MODE=silent`) left
/// the overflow half-open, neither accepted nor refused, for a minute.
const LISTEN_BACKLOG: u32 = 4096;

/// The listening socket on `addr` (address reuse as `bind` sets it), with
/// [`LISTEN_BACKLOG`]. Called inside a runtime.
pub(crate) fn listen(addr: std::net::SocketAddr) -> std::io::Result<TcpListener> {
    let socket = if addr.is_ipv4() {
        tokio::net::TcpSocket::new_v4()?
    } else {
        tokio::net::TcpSocket::new_v6()?
    };
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    socket.listen(LISTEN_BACKLOG)
}

/// What a serving loop does besides accepting.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Duties {
    /// Runs the periodic sweep of idle sessions and records (one loop of
    /// the process does).
    pub(crate) sweep: bool,
    /// Open client connections allowed, process-wide.
    pub(crate) max_connections: u64,
}

/// The connection cap in force (the open-file limit raised first),
/// published as a metric.
pub(crate) fn max_connections(state: &AppState) -> u64 {
    let max = fdlimit::effective_max_connections(state.config.limits.max_connections) as u64;
    state.metrics.set_max_connections(max);
    max
}

/// Accepts connections until `shutdown` resolves, then stops accepting and
/// lets in-flight requests finish for at most `shutdown_grace`.
pub async fn serve<F>(listener: TcpListener, state: Arc<AppState>, shutdown: F)
where
    F: Future<Output = ()>,
{
    let duties = Duties {
        sweep: true,
        max_connections: max_connections(&state),
    };
    if serve_on(listener, state, shutdown, duties, None).await {
        tracing::info!("all connections closed");
    } else {
        tracing::warn!("shutdown grace period elapsed, aborting remaining connections");
    }
}

/// [`serve`]'s loop with its `duties`; false when the shutdown grace ended
/// before the connections did.
pub(crate) async fn serve_on<F>(
    listener: TcpListener,
    state: Arc<AppState>,
    shutdown: F,
    duties: Duties,
    mut balance: Option<Balance>,
) -> bool
where
    F: Future<Output = ()>,
{
    let mut builder = auto::Builder::new(TokioExecutor::new());
    // half_close: a read EOF is not an abort. A client may shut its write
    // side once its request is sent and still read the answer (HTTP/1.1
    // allows it; HAProxy's `abortonclose` is off by default for this
    // reason). At the TCP level a half-close and a hang-up look the same
    // until a write, so a client that really went away is noticed on the
    // first write that fails: mid-stream that is the next frame; before the
    // response head, the upstream request runs until its head arrives (or
    // `timeouts.first_byte_secs` ends it), then the failed writes drop it
    // and its upstream connection. A compaction the request started
    // finishes and is recorded either way (chat::worker). HTTP/2 is not
    // affected: a stream's END_STREAM is not a connection close.
    // writev(false): a batch of small frames (an SSE burst the coalescer
    // gathered) is copied into one buffer and written at once; queued, hyper
    // writes at most 16 of them per `writev`.
    builder
        .http1()
        .timer(TokioTimer::new())
        .half_close(true)
        .writev(false);
    builder.http2().timer(TokioTimer::new());
    let builder = Arc::new(builder);
    // hyper's connections (those handed over by `h1`) are watched by
    // `graceful`; compactor's own by `own`, whose receivers they hold.
    let graceful = GracefulShutdown::new();
    let (own, _) = watch::channel(());
    tokio::pin!(shutdown);
    // Idle sessions and records are dropped by this loop, so the sweep
    // stops with the server.
    let max_connections = duties.max_connections;
    let mut sweep = tokio::time::interval(SWEEP_EVERY);
    sweep.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);

    loop {
        let (stream, load) = tokio::select! {
            _ = sweep.tick(), if duties.sweep => {
                state.chat.sweep();
                continue;
            }
            accepted = listener.accept() => {
                let (stream, _peer) = match accepted {
                    Ok(a) => a,
                    Err(e) => {
                        // EMFILE and friends: back off instead of spinning.
                        tracing::warn!(error = %e, "accept failed");
                        tokio::time::sleep(Duration::from_millis(100)).await;
                        continue;
                    }
                };
                let metrics = &state.metrics;
                if metrics.connections_open() >= max_connections {
                    metrics.record_connection_rejected();
                    tracing::warn!("connection refused: limits.max_connections reached");
                    tokio::spawn(conn::reject(stream));
                    continue;
                }
                let Some(b) = balance.as_ref() else {
                    serve_connection(&builder, &graceful, &own, &state, stream, None);
                    continue;
                };
                match b.place(stream) {
                    Placed::Here(stream, load) => (stream, Some(load)),
                    Placed::Elsewhere => continue,
                }
            }
            handed = handed_over(&mut balance) => match handed {
                Some(placed) => placed,
                None => continue,
            },
            () = &mut shutdown => break,
        };
        serve_connection(&builder, &graceful, &own, &state, stream, load);
    }
    drop(listener);
    let grace = state.config.timeouts.shutdown_grace;
    if duties.sweep {
        tracing::info!(
            grace_secs = grace.as_secs(),
            "shutting down, draining in-flight requests"
        );
    }
    let own_closed = async {
        own.send_replace(());
        own.closed().await;
    };
    tokio::select! {
        _ = async { tokio::join!(graceful.shutdown(), own_closed) } => true,
        () = tokio::time::sleep(grace) => false,
    }
}

/// Serves one accepted client connection in a task of its own; `load`
/// (its thread's share of the connections) is given back when it ends.
/// compactor's own server ([`h1`]) takes it first; hyper takes over for
/// what `h1` leaves to it.
fn serve_connection(
    builder: &Arc<auto::Builder<TokioExecutor>>,
    graceful: &GracefulShutdown,
    own: &watch::Sender<()>,
    state: &Arc<AppState>,
    stream: tokio::net::TcpStream,
    load: Option<Load>,
) {
    if let Err(e) = stream.set_nodelay(true) {
        tracing::debug!(error = %e, "set_nodelay failed");
    }
    let metrics = &state.metrics;
    metrics.connection_opened();
    let activity = Arc::new(conn::Activity::default());
    let mut io = conn::IdleIo::new(
        stream,
        state.config.timeouts.client_idle,
        Arc::clone(&activity),
        Arc::clone(metrics),
    );
    // Both subscribed here, before a shutdown can begin, so none is missed.
    let watcher = graceful.watcher();
    let mut shutdown = own.subscribe();
    let builder = Arc::clone(builder);
    let st = Arc::clone(state);
    let metrics = Arc::clone(metrics);
    tokio::spawn(async move {
        let handle = |req| {
            let active = conn::Active::new(&activity);
            router::handle_on(Arc::clone(&st), req, Some(active))
        };
        let ended = h1::serve(&mut io, handle, &mut shutdown).await;
        drop(shutdown);
        if let h1::Ended::Handoff(prefix, why) = ended {
            metrics.record_h1_handoff(why);
            let service = service_fn(move |req| {
                let active = conn::Active::new(&activity);
                router::handle_on(Arc::clone(&st), req, Some(active))
            });
            let io = TokioIo::new(h1::Rewind::new(prefix, io));
            let conn = builder.serve_connection(io, service).into_owned();
            if let Err(e) = watcher.watch(conn).await {
                tracing::debug!(error = %e, "connection ended with error");
            }
        }
        metrics.connection_closed();
        drop(load);
    });
}

/// Binds, logs `listening on <addr>`, serves until `shutdown`.
pub async fn run<F>(config: Config, shutdown: F) -> Result<(), AppError>
where
    F: Future<Output = ()>,
{
    let (listener, state) = bind(config).await?;
    let addr = listener.local_addr().map_err(|source| AppError::Bind {
        addr: state.config.listen,
        source,
    })?;
    tracing::info!(upstream = %state.upstream.base(), "listening on {addr}");
    serve(listener, state, shutdown).await;
    Ok(())
}

/// Resolves on SIGINT or SIGTERM.
pub async fn shutdown_signal() {
    let ctrl_c = async {
        if let Err(e) = tokio::signal::ctrl_c().await {
            tracing::error!(error = %e, "cannot listen for SIGINT");
            std::future::pending::<()>().await;
        }
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(e) => {
                tracing::error!(error = %e, "cannot listen for SIGTERM");
                std::future::pending::<()>().await;
            }
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => tracing::info!("SIGINT received"),
        () = term => tracing::info!("SIGTERM received"),
    }
}

/// A server running in the background (tests, embedding).
#[derive(Debug)]
pub struct RunningServer {
    /// The bound address.
    pub addr: SocketAddr,
    /// Shared state (metrics, config).
    pub state: Arc<AppState>,
    shutdown: Option<oneshot::Sender<()>>,
    task: JoinHandle<()>,
}

impl RunningServer {
    /// Base URL, e.g. `http://127.0.0.1:12345`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Triggers graceful shutdown and waits for it to complete.
    pub async fn shutdown(mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        if let Err(e) = (&mut self.task).await {
            tracing::debug!(error = %e, "server task ended abnormally");
        }
    }
}

impl Drop for RunningServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Binds and serves in a background task.
pub async fn start(config: Config) -> Result<RunningServer, AppError> {
    let (listener, state) = bind(config).await?;
    let addr = listener.local_addr().map_err(|source| AppError::Bind {
        addr: state.config.listen,
        source,
    })?;
    let (tx, rx) = oneshot::channel::<()>();
    let st = Arc::clone(&state);
    let task = tokio::spawn(async move {
        serve(listener, st, async {
            let _ = rx.await;
        })
        .await;
    });
    Ok(RunningServer {
        addr,
        state,
        shutdown: Some(tx),
        task,
    })
}
