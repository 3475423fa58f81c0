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
//! What is shared is what was shared before: the chat state (sessions,
//! records, store), the metrics and the configuration. Work that takes long
//! (bodies of 1 MiB and more, `malloc_trim`) runs on the blocking pool as
//! before, so it does not hold up a thread's other connections.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;

use tokio::net::TcpListener;
use tokio::sync::{watch, Barrier};

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
        let listener = TcpListener::bind(addr)
            .await
            .map_err(|source| AppError::Bind { addr, source })?;
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
    // A thread that has drained its connections keeps its reactor running
    // until all have: sockets it registered (a pooled store connection) may
    // still be in use by another thread's requests.
    let drained = Arc::new(Barrier::new(threads));
    let max_connections = super::max_connections(&states[0]);
    let mut handles = Vec::with_capacity(threads);
    for (i, state) in states.into_iter().enumerate() {
        let listener = listener.try_clone().map_err(AppError::Runtime)?;
        let mut stopped = stopped.clone();
        let drained = Arc::clone(&drained);
        let duties = Duties {
            sweep: i == 0,
            max_connections,
        };
        let handle = std::thread::Builder::new()
            .name(format!("compactor-{i}"))
            .spawn(move || serve_thread(listener, state, duties, &mut stopped, &drained, local))
            .map_err(AppError::Runtime)?;
        handles.push(handle);
    }
    drop(listener);
    main.block_on(shutdown());
    let _ = stop.send(true);
    let mut drained_all = true;
    let mut result = Ok(());
    for h in handles {
        match h.join() {
            Ok(Ok(drained)) => drained_all &= drained,
            Ok(Err(e)) => result = Err(e),
            Err(panic) => std::panic::resume_unwind(panic),
        }
    }
    if drained_all {
        tracing::info!("all connections closed");
    } else {
        tracing::warn!("shutdown grace period elapsed, aborting remaining connections");
    }
    result
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

/// The body of one serving thread: true when its connections ended within
/// the shutdown grace.
fn serve_thread(
    listener: std::net::TcpListener,
    state: Arc<AppState>,
    duties: Duties,
    stopped: &mut watch::Receiver<bool>,
    drained: &Barrier,
    local: SocketAddr,
) -> Result<bool, AppError> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(AppError::Runtime)?;
    rt.block_on(async {
        let listener = TcpListener::from_std(listener).map_err(|source| AppError::Bind {
            addr: local,
            source,
        })?;
        let stop = async {
            let _ = stopped.wait_for(|s| *s).await;
        };
        let in_time = serve_on(listener, state, stop, duties).await;
        drained.wait().await;
        Ok(in_time)
    })
}
