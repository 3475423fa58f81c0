//! The binary's runtime: one current-thread tokio runtime per core, each
//! accepting from the same listening socket and serving the connections it
//! accepted, with an upstream pool of its own.
//!
//! On tokio's work-stealing runtime a proxied request crosses threads: the
//! upstream connection's task and the client connection's task land on
//! different workers, and every hand-over between them (the request, the
//! response head, each body chunk) wakes the other worker with a futex or
//! an eventfd write. Measured against the mock upstream at one connection,
//! that was 2 futex calls and 0.4 eventfd writes per JSON request, 4 and 5
//! per SSE request, where nginx makes none. Here a connection, its upstream
//! connections and the tasks it spawns stay on the thread that accepted it:
//! a hand-over is a push onto that thread's run queue.
//!
//! Every thread accepts; a connection goes to the thread serving the fewest
//! ([`super::balance`]).
//!
//! What is shared is what was shared before: the chat state (sessions,
//! records, store), the metrics and the configuration. Work that takes long
//! (bodies of 1 MiB and more, `malloc_trim`) runs on the blocking pool as
//! before, so it does not hold up a thread's other connections.

use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use tokio::net::TcpListener;
use tokio::sync::{watch, Notify};

use super::balance::Balance;
use super::{serve_on, AppError, AppState, Duties};
use crate::chat::ChatState;
use crate::config::Config;
use crate::metrics::Metrics;
use crate::upstream::Upstream;

/// How many threads serve: `TOKIO_WORKER_THREADS` when set (tokio's own
/// variable, which sized the work-stealing runtime before), else one per
/// core.
pub fn thread_count() -> usize {
    std::env::var("TOKIO_WORKER_THREADS")
        .ok()
        .and_then(|v| v.trim().parse::<usize>().ok())
        .filter(|&n| n > 0)
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
}

/// Binds, logs `listening on <addr>`, serves on [`thread_count`] threads
/// until `shutdown` (run on the calling thread, with the signal handlers)
/// resolves, then drains every thread's connections.
pub fn run<S, F>(config: Config, shutdown: S) -> Result<(), AppError>
where
    S: FnOnce() -> F,
    F: Future<Output = ()>,
{
    let threads = thread_count();
    // The calling thread keeps a runtime of its own: signals, and whatever
    // the state's construction registers (it lives as long as the server).
    let main = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(AppError::Runtime)?;
    let addr = config.listen;
    let (listener, local, states) = main.block_on(async {
        let listener = super::listen(addr).map_err(|source| AppError::Bind { addr, source })?;
        let local = listener
            .local_addr()
            .map_err(|source| AppError::Bind { addr, source })?;
        // Each thread registers the socket with its own reactor.
        let listener = listener
            .into_std()
            .map_err(|source| AppError::Bind { addr, source })?;
        let states = states(config, threads)?;
        Ok::<_, AppError>((listener, local, states))
    })?;
    tracing::info!(upstream = %states[0].upstream.base(), threads, "listening on {local}");

    let (stop, stopped) = watch::channel(false);
    let drain = Arc::new(Drain {
        left: AtomicUsize::new(threads),
        all: Notify::new(),
    });
    let max_connections = super::max_connections(&states[0]);
    let serving = set_up(&listener, local, states, max_connections)?;
    drop(listener);
    let mut handles = Vec::with_capacity(threads);
    for (i, (rt, socket, state, duties, balance)) in serving.into_iter().enumerate() {
        let mut stopped = stopped.clone();
        let drain = Arc::clone(&drain);
        let handle = std::thread::Builder::new()
            .name(format!("compactor-{i}"))
            .spawn(move || {
                rt.block_on(async {
                    let stop = async {
                        let _ = stopped.wait_for(|s| *s).await;
                    };
                    let leaving = Leaving(&drain);
                    let in_time = serve_on(socket, state, stop, duties, Some(balance)).await;
                    drop(leaving);
                    // This thread's reactor keeps running until every thread
                    // has drained: sockets it registered (a pooled store
                    // connection) may still serve another thread's requests.
                    drain.all_left().await;
                    in_time
                })
            })
            .map_err(AppError::Runtime)?;
        handles.push(handle);
    }
    main.block_on(shutdown());
    let _ = stop.send(true);
    let mut drained_all = true;
    for h in handles {
        match h.join() {
            Ok(drained) => drained_all &= drained,
            Err(panic) => std::panic::resume_unwind(panic),
        }
    }
    if drained_all {
        tracing::info!("all connections closed");
    } else {
        tracing::warn!("shutdown grace period elapsed, aborting remaining connections");
    }
    Ok(())
}

/// One thread's runtime, its registration of the listening socket, its
/// state and share of the balancing.
type Thread = (
    tokio::runtime::Runtime,
    TcpListener,
    Arc<AppState>,
    Duties,
    Balance,
);

/// Every thread's runtime and socket, set up before any serves: a failure
/// stops the start instead of leaving a thread short.
fn set_up(
    listener: &std::net::TcpListener,
    local: std::net::SocketAddr,
    states: Vec<Arc<AppState>>,
    max_connections: u64,
) -> Result<Vec<Thread>, AppError> {
    let threads = states.len();
    let mut serving = Vec::with_capacity(threads);
    for ((i, state), balance) in states.into_iter().enumerate().zip(Balance::new(threads)) {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(AppError::Runtime)?;
        let socket = listener.try_clone().map_err(AppError::Runtime)?;
        // Registered with this thread's reactor.
        let socket = {
            let _in = rt.enter();
            TcpListener::from_std(socket).map_err(|source| AppError::Bind {
                addr: local,
                source,
            })?
        };
        let duties = Duties {
            sweep: i == 0,
            max_connections,
        };
        serving.push((rt, socket, state, duties, balance));
    }
    Ok(serving)
}

/// The serving threads still draining their connections.
struct Drain {
    left: AtomicUsize,
    all: Notify,
}

impl Drain {
    async fn all_left(&self) {
        loop {
            // Created before the check: a notification in between is kept.
            let notified = self.all.notified();
            if self.left.load(Ordering::Acquire) == 0 {
                return;
            }
            notified.await;
        }
    }
}

/// A thread still serving; dropped when it has drained (or panicked, so
/// the others are not left waiting for it).
struct Leaving<'a>(&'a Drain);

impl Drop for Leaving<'_> {
    fn drop(&mut self) {
        if self.0.left.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.0.all.notify_waiters();
        }
    }
}

/// One state per thread: the upstream (and so its connection pool) is the
/// thread's own, the rest is shared.
fn states(config: Config, threads: usize) -> Result<Vec<Arc<AppState>>, AppError> {
    let metrics = Arc::new(Metrics::default());
    let chat = Arc::new(ChatState::from_config(&config, Arc::clone(&metrics))?);
    let config = Arc::new(config);
    (0..threads)
        .map(|_| {
            let upstream = Upstream::new(&config, Arc::clone(&metrics))?;
            Ok(Arc::new(AppState {
                config: Arc::clone(&config),
                upstream: Arc::new(upstream),
                metrics: Arc::clone(&metrics),
                chat: Arc::clone(&chat),
            }))
        })
        .collect()
}
