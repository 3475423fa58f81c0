//! Tracing setup: `RUST_LOG`-style filter (default `compactor=info`), text or
//! JSON, written to stdout in batches, text formatted by [`line`].
//!
//! Every request logs one line. Written straight to stdout that is one
//! `write` syscall per request on the request's worker thread, about a
//! quarter of compactor's own CPU per request against a fast upstream. So
//! lines are appended to a buffer in memory and a background thread writes
//! what has gathered, at most [`FLUSH_EVERY`] after the first line of a
//! batch. The thread sleeps while there is nothing to write. Order is kept,
//! nothing is dropped: past [`MAX_PENDING`] bytes the logging thread writes
//! the batch itself, and [`LogGuard`] flushes on exit.

use std::io::Write;
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::Duration;

use tracing_subscriber::fmt::MakeWriter;
use tracing_subscriber::EnvFilter;

use crate::config::LogFormat;
use crate::sync::lock;

#[cfg(test)]
mod capture;
pub(crate) mod line;
pub(crate) mod request;

/// Filter used when `RUST_LOG` is unset or invalid.
pub(crate) const DEFAULT_FILTER: &str = "compactor=info";
/// Longest a log line waits in memory.
pub(crate) const FLUSH_EVERY: Duration = Duration::from_millis(20);
/// A batch this large is written at once by the thread that logs.
const MAX_PENDING: usize = 256 << 10;

/// Telemetry initialisation failure.
#[derive(Debug, thiserror::Error)]
#[error("cannot initialise logging: {0}")]
pub struct TelemetryError(String);

/// Installs the global subscriber. Keep the guard alive until exit: dropping
/// it writes what is still buffered.
pub fn init(format: LogFormat) -> Result<LogGuard, TelemetryError> {
    let filter =
        EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(DEFAULT_FILTER));
    // Colour only on a terminal, so piped logs stay parseable.
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stdout());
    let (writer, guard) = BatchWriter::spawn(std::io::stdout, FLUSH_EVERY)
        .map_err(|e| TelemetryError(format!("log writer thread: {e}")))?;
    if format == LogFormat::Text && !ansi {
        request::write_plain_to(writer.clone());
    }
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(ansi)
        .with_timer(line::CachedUtc)
        .with_writer(writer);
    let result = match format {
        // Colours come from tracing-subscriber's own field formatter.
        LogFormat::Text if ansi => builder.try_init(),
        LogFormat::Text => builder.fmt_fields(line::PlainFields).try_init(),
        LogFormat::Json => builder.json().try_init(),
    };
    result.map_err(|e| TelemetryError(e.to_string()))?;
    Ok(guard)
}

struct Pending {
    buf: Vec<u8>,
    stop: bool,
}

struct Shared<W> {
    pending: Mutex<Pending>,
    /// Signalled when a batch starts (empty → non-empty) and on stop.
    started: Condvar,
    /// The destination; locked before `pending` by whoever writes, so
    /// batches reach it in order.
    out: Mutex<W>,
}

impl<W: Write> Shared<W> {
    /// Takes the gathered batch and writes it. Errors are dropped: there is
    /// nowhere left to report a failing log destination.
    fn write_batch(&self) {
        let mut out = lock(&self.out);
        let batch = std::mem::take(&mut lock(&self.pending).buf);
        if !batch.is_empty() {
            let _ = out.write_all(&batch);
            let _ = out.flush();
        }
    }
}

/// A [`MakeWriter`] that appends to the shared batch.
pub(crate) struct BatchWriter<W> {
    shared: Arc<Shared<W>>,
}

impl<W> Clone for BatchWriter<W> {
    fn clone(&self) -> Self {
        BatchWriter {
            shared: Arc::clone(&self.shared),
        }
    }
}

impl<W: Write + Send + 'static> BatchWriter<W> {
    /// Starts the writer thread over the destination `make()` returns.
    pub(crate) fn spawn(
        make: impl FnOnce() -> W,
        flush_every: Duration,
    ) -> std::io::Result<(Self, LogGuard)> {
        let shared = Arc::new(Shared {
            pending: Mutex::new(Pending {
                buf: Vec::new(),
                stop: false,
            }),
            started: Condvar::new(),
            out: Mutex::new(make()),
        });
        let thread = {
            let shared = Arc::clone(&shared);
            std::thread::Builder::new()
                .name("compactor-log".to_owned())
                .spawn(move || flush_loop(&shared, flush_every))?
        };
        let stop = {
            let shared = Arc::clone(&shared);
            Box::new(move || {
                lock(&shared.pending).stop = true;
                shared.started.notify_all();
            }) as Box<dyn FnOnce() + Send>
        };
        let guard = LogGuard {
            stop: Some(stop),
            thread: Some(thread),
        };
        Ok((BatchWriter { shared }, guard))
    }
}

fn flush_loop<W: Write>(shared: &Shared<W>, flush_every: Duration) {
    loop {
        {
            let mut p = lock(&shared.pending);
            while p.buf.is_empty() && !p.stop {
                p = shared
                    .started
                    .wait(p)
                    .unwrap_or_else(PoisonError::into_inner);
            }
            if p.stop {
                drop(p);
                shared.write_batch();
                return;
            }
        }
        // Let the batch gather (a stop request cuts the wait short).
        let p = lock(&shared.pending);
        let (p, _) = shared
            .started
            .wait_timeout_while(p, flush_every, |p| !p.stop)
            .unwrap_or_else(PoisonError::into_inner);
        drop(p);
        shared.write_batch();
    }
}

/// One log line being written into the batch.
pub(crate) struct LineWriter<'a, W: Write> {
    shared: &'a Shared<W>,
}

impl<W: Write> Write for LineWriter<'_, W> {
    fn write(&mut self, data: &[u8]) -> std::io::Result<usize> {
        let mut p = lock(&self.shared.pending);
        let was_empty = p.buf.is_empty();
        p.buf.extend_from_slice(data);
        let full = p.buf.len() >= MAX_PENDING;
        let stopped = p.stop;
        drop(p);
        if full || stopped {
            // Backpressure instead of unbounded memory; after shutdown
            // there is no thread left to write.
            self.shared.write_batch();
        } else if was_empty {
            self.shared.started.notify_one();
        }
        Ok(data.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl<'a, W: Write + 'a> MakeWriter<'a> for BatchWriter<W> {
    type Writer = LineWriter<'a, W>;

    fn make_writer(&'a self) -> Self::Writer {
        LineWriter {
            shared: &self.shared,
        }
    }
}

/// Stops the writer thread and writes what is buffered when dropped.
pub struct LogGuard {
    stop: Option<Box<dyn FnOnce() + Send>>,
    thread: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for LogGuard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LogGuard").finish_non_exhaustive()
    }
}

impl Drop for LogGuard {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            stop();
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A destination that records each `write_all` separately.
    #[derive(Clone, Default)]
    struct Sink(Arc<Mutex<Vec<Vec<u8>>>>);

    impl Write for Sink {
        fn write(&mut self, data: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().push(data.to_vec());
            Ok(data.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    fn line(w: &BatchWriter<Sink>, s: &str) {
        w.make_writer().write_all(s.as_bytes()).unwrap();
    }

    #[test]
    fn lines_are_written_in_order_in_few_writes_and_flushed_on_drop() {
        let sink = Sink::default();
        let (w, guard) = BatchWriter::spawn(|| sink.clone(), Duration::from_secs(60)).unwrap();
        for i in 0..1000 {
            line(&w, &format!("line {i}\n"));
        }
        // Nothing written yet: the batch waits for its interval...
        assert!(sink.0.lock().unwrap().is_empty());
        // ...and the guard writes it all on exit, in one piece.
        drop(guard);
        let writes = sink.0.lock().unwrap().clone();
        assert_eq!(writes.len(), 1);
        let expected: String = (0..1000).map(|i| format!("line {i}\n")).collect();
        assert_eq!(String::from_utf8(writes.concat()).unwrap(), expected);
    }

    #[test]
    fn a_batch_is_written_after_the_interval_without_a_drop() {
        let sink = Sink::default();
        let (w, _guard) = BatchWriter::spawn(|| sink.clone(), Duration::from_millis(1)).unwrap();
        line(&w, "a\n");
        line(&w, "b\n");
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while sink.0.lock().unwrap().concat() != b"a\nb\n" {
            assert!(std::time::Instant::now() < deadline, "batch never written");
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    #[test]
    fn a_full_batch_is_written_by_the_logging_thread() {
        let sink = Sink::default();
        let (w, _guard) = BatchWriter::spawn(|| sink.clone(), Duration::from_secs(60)).unwrap();
        let big = "x".repeat(MAX_PENDING);
        line(&w, "first\n");
        line(&w, &big);
        // Written synchronously, before the 60 s interval.
        let writes = sink.0.lock().unwrap().concat();
        assert_eq!(writes.len(), "first\n".len() + big.len());
        assert!(writes.starts_with(b"first\n"));
    }

    #[test]
    fn lines_after_shutdown_are_written_directly() {
        let sink = Sink::default();
        let (w, guard) = BatchWriter::spawn(|| sink.clone(), Duration::from_secs(60)).unwrap();
        drop(guard);
        line(&w, "late\n");
        assert_eq!(sink.0.lock().unwrap().concat(), b"late\n");
    }
}
