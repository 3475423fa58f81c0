//! Deadlines from configured durations.
//!
//! `Instant + Duration` panics when the sum is past what an instant holds,
//! and a timeout is configured in seconds as a `u64`: an operator's "never"
//! (`u64::MAX`) added to the clock would panic the task serving the request.

use std::time::Duration;

use tokio::time::Instant;

/// How far on a deadline past an instant's range goes: tokio's own `sleep`
/// and `timeout` take the same 30 years.
const FAR: Duration = Duration::from_secs(86_400 * 365 * 30);

/// `start + d`, or 30 years on when that is past an instant's range.
pub(crate) fn deadline(start: Instant, d: Duration) -> Instant {
    start.checked_add(d).unwrap_or_else(|| start + FAR)
}

/// [`deadline`] from now.
pub(crate) fn from_now(d: Duration) -> Instant {
    deadline(Instant::now(), d)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_deadline_past_the_range_is_far_on() {
        let now = Instant::now();
        assert_eq!(
            deadline(now, Duration::from_secs(5)),
            now + Duration::from_secs(5)
        );
        assert_eq!(deadline(now, Duration::from_secs(u64::MAX)), now + FAR);
        assert_eq!(deadline(now, Duration::MAX), now + FAR);
    }
}
