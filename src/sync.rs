//! Lock helpers.

use std::sync::{Mutex, MutexGuard, PoisonError};

/// Locks `m`, also when a thread panicked while holding it. Everything
/// compactor keeps behind a mutex (queues, counters, log batches) stays
/// consistent after any single operation, so the data is still good and a
/// panic elsewhere must not take logging or calibration down with it.
pub fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}
