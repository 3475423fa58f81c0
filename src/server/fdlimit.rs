//! `limits.max_connections` against the open-file limit. A cap above what
//! the process can open lets silent connections take every descriptor:
//! then accept fails (EMFILE), the health endpoint cannot be reached and
//! upstream and store sockets cannot be opened. At start the soft
//! `RLIMIT_NOFILE` is raised to the hard limit (allowed without
//! privilege) and the cap clamped to what the limit leaves.

/// Descriptors kept out of the cap for what is not a client connection:
/// the listener, stdio, the runtime's epoll and event fds, the state file
/// (two during a compaction), a Redis pool, discovery and summary side
/// calls.
pub const FIXED_HEADROOM: u64 = 64;

/// The cap a soft limit of `soft` descriptors allows: half of what the
/// fixed headroom leaves, because every client connection with a request
/// in flight holds an upstream socket too. At least 1.
pub fn clamp(configured: usize, soft: Option<u64>) -> usize {
    let Some(soft) = soft else {
        return configured;
    };
    let room = soft.saturating_sub(FIXED_HEADROOM) / 2;
    let room = usize::try_from(room).unwrap_or(usize::MAX).max(1);
    configured.min(room)
}

/// Raises the soft open-file limit to the hard one where allowed and
/// returns the soft limit now in force (`None`: unknown or unlimited).
#[cfg(all(target_os = "linux", target_env = "gnu"))]
#[allow(unsafe_code)]
pub fn raise_nofile() -> Option<u64> {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit only read and write the struct passed.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } != 0 {
        return None;
    }
    if lim.rlim_cur < lim.rlim_max {
        let raised = libc::rlimit {
            rlim_cur: lim.rlim_max,
            rlim_max: lim.rlim_max,
        };
        // SAFETY: as above.
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) } == 0 {
            lim.rlim_cur = lim.rlim_max;
        }
    }
    (lim.rlim_cur != libc::RLIM_INFINITY).then_some(lim.rlim_cur)
}

/// Elsewhere the limit is not known: the configured cap stands.
#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
pub(crate) fn raise_nofile() -> Option<u64> {
    None
}

/// The cap in force: `configured` clamped by the (raised) file limit,
/// logged at INFO.
pub fn effective_max_connections(configured: usize) -> usize {
    let soft = raise_nofile();
    let cap = clamp(configured, soft);
    if cap < configured {
        tracing::info!(
            configured,
            effective = cap,
            open_file_limit = soft,
            "limits.max_connections clamped to the open-file limit"
        );
    } else {
        tracing::info!(
            max_connections = cap,
            open_file_limit = soft,
            "connection cap"
        );
    }
    cap
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cap_leaves_room_for_upstream_sockets_and_the_rest() {
        assert_eq!(clamp(4096, Some(1024)), 480);
        assert_eq!(clamp(100, Some(1024)), 100);
        assert_eq!(clamp(4096, Some(1_048_576)), 4096);
        assert_eq!(clamp(4096, None), 4096);
        assert_eq!(clamp(4096, Some(10)), 1);
    }
}
