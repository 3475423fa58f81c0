//! The balancing of accepted connections between the serving threads of
//! [`super::cores`]: every thread accepts, and a connection goes to the
//! thread serving the fewest, handed over through a channel when that is
//! another one (a wake-up per connection, not per request). Left to
//! whichever thread won the accept, 64 connections split 47/17 and the
//! busier thread was the bottleneck.
//!
//! The accept loop ([`super::serve_on`]) places each connection and takes
//! the ones handed to it; the runtime ([`super::cores`]) makes one
//! [`Balance`] per thread.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use tokio::net::TcpStream;
use tokio::sync::mpsc;

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
    pub(crate) fn new(threads: usize) -> Vec<Balance> {
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
    use tokio::net::TcpListener;

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
