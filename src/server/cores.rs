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
//! (handed over through a channel when that is another one: a wake-up per
//! connection, not per request). Left to whichever thread won the accept,
//! 64 connections split 47/17 and the busier thread was the bottleneck.
//!
//! What is shared is what was shared before: the chat state (sessions,
//! records, store), the metrics and the configuration. Work that takes long
//! (bodies of 1 MiB and more, `malloc_trim`) runs on the blocking pool as
//! before, so it does not hold up a thread's other connections.

use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, watch, Notify};

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

/// The serving threads' connection counts and their hand-over channels.
struct Shared {
    open: Box<[AtomicUsize]>,
    inboxes: Box<[mpsc::UnboundedSender<std::net::TcpStream>]>,
}

/// One thread's side of the balancing: where its accepted connections go,
/// and the connections other threads hand it.
pub(crate) struct Balance {
    shared: Arc<Shared>,
    me: usize,
    inbox: mpsc::UnboundedReceiver<std::net::TcpStream>,
}

/// Where an accepted connection went.
pub(crate) enum Placed {
    /// To be served by this thread.
    Here(TcpStream, Load),
    /// Handed to another thread.
    Elsewhere,
}

/// A connection counted against its thread until dropped.
pub(crate) struct Load {
    shared: Arc<Shared>,
    thread: usize,
}

impl Drop for Load {
    fn drop(&mut self) {
        self.shared.open[self.thread].fetch_sub(1, Ordering::Relaxed);
    }
}

impl Balance {
    /// One per thread.
    fn new(threads: usize) -> Vec<Balance> {
        let (senders, receivers): (Vec<_>, Vec<_>) =
            (0..threads).map(|_| mpsc::unbounded_channel()).unzip();
        let shared = Arc::new(Shared {
            open: (0..threads).map(|_| AtomicUsize::new(0)).collect(),
            inboxes: senders.into_boxed_slice(),
        });
        receivers
            .into_iter()
            .enumerate()
            .map(|(me, inbox)| Balance {
                shared: Arc::clone(&shared),
                me,
                inbox,
            })
            .collect()
    }

    fn load(&self, thread: usize) -> Load {
        self.shared.open[thread].fetch_add(1, Ordering::Relaxed);
        Load {
            shared: Arc::clone(&self.shared),
            thread,
        }
    }

    /// Keeps `stream` unless another thread serves fewer connections.
    pub(crate) fn place(&self, stream: TcpStream) -> Placed {
        let open = |i: usize| self.shared.open[i].load(Ordering::Relaxed);
        let mine = open(self.me);
        let least = (0..self.shared.open.len()).min_by_key(|&i| (open(i), i != self.me));
        let Some(to) = least.filter(|&i| i != self.me && open(i) < mine) else {
            return Placed::Here(stream, self.load(self.me));
        };
        // Counted before it arrives, so a burst of accepts spreads out.
        let load = self.load(to);
        match stream.into_std() {
            Ok(std) => match self.shared.inboxes[to].send(std) {
                Ok(()) => {
                    // The receiving thread's `Load` gives the count back.
                    std::mem::forget(load);
                    Placed::Elsewhere
                }
                Err(mpsc::error::SendError(std)) => match TcpStream::from_std(std) {
                    Ok(stream) => Placed::Here(stream, self.load(self.me)),
                    Err(e) => {
                        tracing::debug!(error = %e, "handed-back connection lost");
                        Placed::Elsewhere
                    }
                },
            },
            Err(e) => {
                tracing::debug!(error = %e, "connection not handed over");
                Placed::Elsewhere
            }
        }
    }
}

/// The next connection another thread handed over (`None`: none can come,
/// or it could not be registered here). Pending forever without balancing.
pub(crate) async fn handed_over(
    balance: &mut Option<Balance>,
) -> Option<(TcpStream, Option<Load>)> {
    let Some(b) = balance.as_mut() else {
        return std::future::pending().await;
    };
    let Some(std) = b.inbox.recv().await else {
        return std::future::pending().await;
    };
    let load = Load {
        shared: Arc::clone(&b.shared),
        thread: b.me,
    };
    match TcpStream::from_std(std) {
        Ok(stream) => Some((stream, Some(load))),
        Err(e) => {
            tracing::debug!(error = %e, "handed-over connection lost");
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn accepted(listener: &TcpListener) -> (TcpStream, TcpStream) {
        let addr = listener.local_addr().unwrap();
        let client = TcpStream::connect(addr).await.unwrap();
        let (server, _) = listener.accept().await.unwrap();
        (client, server)
    }

    #[tokio::test]
    async fn a_connection_goes_to_the_thread_serving_the_fewest() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let mut threads = Balance::new(2);
        let mut other = Some(threads.pop().unwrap());
        let me = threads.pop().unwrap();

        // Equal counts: kept.
        let (_c1, s1) = accepted(&listener).await;
        let Placed::Here(_s1, load1) = me.place(s1) else {
            panic!("kept with equal counts");
        };
        // This thread now serves one more: the next goes to the other one,
        // counted there at once, and arrives through its inbox.
        let (_c2, s2) = accepted(&listener).await;
        assert!(matches!(me.place(s2), Placed::Elsewhere));
        assert_eq!(me.shared.open[1].load(Ordering::Relaxed), 1);
        let (_s2, load2) = handed_over(&mut other).await.expect("handed over");
        // Counts are given back as the connections end.
        drop((load1, load2));
        assert_eq!(me.shared.open[0].load(Ordering::Relaxed), 0);
        assert_eq!(me.shared.open[1].load(Ordering::Relaxed), 0);
    }
}
