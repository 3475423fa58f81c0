//! How far the file may grow while a rewrite copies it.
//!
//! A rewrite starts with the file at `start` and copies the live
//! entries, then what was appended meanwhile; the file may grow by the
//! room left to its hard bound in that time. A quarter of the room is
//! free from the start; the rest is let through in proportion to the
//! copy's progress, so the room is never used up before the copy ends,
//! and a write waits at most for the part of the copy that pays for it,
//! never for the whole rewrite. When the copy outpaces the writes (the
//! usual case: a record is written after a summary call of seconds), no
//! write waits at all.

use std::sync::{Condvar, Mutex, MutexGuard, PoisonError};
use std::time::Instant;

/// What writes may do right now.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(super) struct GateState {
    /// A rewrite is running.
    pub(super) rewriting: bool,
    /// While rewriting: the file length writes may reach.
    pub(super) allowed_end: u64,
    /// Bumped on every change, so a waiter knows it was woken for one.
    generation: u64,
}

#[derive(Debug, Default)]
pub(super) struct Gate {
    state: Mutex<GateState>,
    changed: Condvar,
}

impl Gate {
    fn lock(&self) -> MutexGuard<'_, GateState> {
        crate::sync::lock(&self.state)
    }

    pub(super) fn get(&self) -> GateState {
        *self.lock()
    }

    fn set(&self, f: impl FnOnce(&mut GateState)) {
        let mut s = self.lock();
        f(&mut s);
        s.generation += 1;
        self.changed.notify_all();
    }

    /// A rewrite started: writes may take the file to `allowed`.
    pub(super) fn begin(&self, allowed: u64) {
        self.set(|s| {
            s.rewriting = true;
            s.allowed_end = allowed;
        });
    }

    /// The copy progressed: writes may take the file to `end`.
    pub(super) fn allow(&self, end: u64) {
        self.set(|s| s.allowed_end = s.allowed_end.max(end));
    }

    /// The rewrite ended (swapped in or given up).
    pub(super) fn end(&self) {
        self.set(|s| s.rewriting = false);
    }

    /// Waits until the state differs from `seen`; `false` when `deadline`
    /// came first.
    pub(super) fn wait(&self, seen: GateState, deadline: Instant) -> bool {
        let mut s = self.lock();
        while *s == seen {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return false;
            }
            s = self
                .changed
                .wait_timeout(s, left)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
        true
    }

    /// Waits until no rewrite runs; `false` when `deadline` came first.
    pub(super) fn wait_idle(&self, deadline: Instant) -> bool {
        loop {
            let s = self.get();
            if !s.rewriting {
                return true;
            }
            if !self.wait(s, deadline) {
                return false;
            }
        }
    }
}

/// The allowance of a rewrite that has copied `copied` of `planned`
/// bytes, started at `start` with `room` to grow.
pub(super) fn allowance(start: u64, room: u64, copied: u64, planned: u64) -> u64 {
    let free = room / 4;
    let paced = room - free;
    if planned == 0 || copied >= planned {
        return start + room;
    }
    let share = u128::from(paced) * u128::from(copied) / u128::from(planned);
    start + free + u64::try_from(share).unwrap_or(paced)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::time::Duration;

    #[test]
    fn the_allowance_grows_with_the_copy() {
        assert_eq!(allowance(100, 40, 0, 200), 110);
        assert_eq!(allowance(100, 40, 100, 200), 125);
        assert_eq!(allowance(100, 40, 300, 200), 140);
        assert_eq!(allowance(100, 40, 0, 0), 140);
    }

    #[test]
    fn a_waiter_wakes_on_progress_or_gives_up_at_its_deadline() {
        let g = Arc::new(Gate::default());
        g.begin(10);
        let seen = g.get();
        let soon = Instant::now() + Duration::from_millis(20);
        assert!(!g.wait(seen, soon), "nothing changed");
        let g2 = Arc::clone(&g);
        let t = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(20));
            g2.allow(20);
        });
        assert!(g.wait(seen, Instant::now() + Duration::from_secs(10)));
        assert_eq!(g.get().allowed_end, 20);
        t.join().unwrap();
        g.end();
        assert!(g.wait_idle(Instant::now()));
    }
}
