//! Issue 49: the bound holds for everything the file keeps. Conversation
//! states were not counted: 3,000 sessions at a 256 KiB bound made a file
//! of about three times the bound.

use std::time::Duration;

use super::tests::{opened, rec};
use super::*;

const BOUND: usize = 256 << 10;
const SESSIONS: u128 = 3000;
/// Every this many sessions, a compaction record too.
const RECORD_EVERY: u128 = 100;

/// A directory on tmpfs when there is one: thousands of writes, each
/// with its sync, cost little there.
fn scratch() -> tempfile::TempDir {
    tempfile::tempdir_in("/dev/shm").unwrap_or_else(|_| tempfile::tempdir().unwrap())
}

/// A state shaped as `chat::persist` writes one (its JSON, about 300
/// bytes), its session's number in it so that a read of another's fails.
fn state_of(session: u128) -> Vec<u8> {
    format!(
        "{{\"calibration\":{{\"last_real_prompt_tokens\":{},\"ratio\":1.0{:08},\
         \"last_estimate_error\":-0.0{:07},\"observations\":{}}},\"trigger\":\
         {{\"cooldown_until_unix_ms\":null,\"cooldown_error\":null,\
         \"ineffective_compression_count\":0,\"fallback_streak\":0,\
         \"recovery_deadline_unix_ms\":null,\"compression_count\":{}}}}}",
        10_000 + session * 7,
        session * 7919 % 100_000_000,
        session * 104_729 % 10_000_000,
        session % 40,
        session % 5
    )
    .into_bytes()
}

/// Record `h`: about 8 KiB, its own text.
fn record(h: u128) -> StoredRecord {
    rec(2, h, &format!("{h}:{}", "r".repeat(8 << 10)))
}

/// What the scenario measured.
struct Figures {
    peak: u64,
    end: u64,
    reopened: u64,
}

impl Figures {
    fn print(&self) {
        let b = BOUND as f64;
        eprintln!(
            "{SESSIONS} states, {} records of 8 KiB at a {} KiB bound: file peak {} ({:.2}x), \
             end {} ({:.2}x), after reopen {} ({:.2}x)",
            SESSIONS / RECORD_EVERY,
            BOUND >> 10,
            self.peak,
            self.peak as f64 / b,
            self.end,
            self.end as f64 / b,
            self.reopened,
            self.reopened as f64 / b
        );
    }
}

/// Writes the sessions' states in order, a record every
/// [`RECORD_EVERY`]; returns the file's peak and its length at the end.
async fn write_sessions(s: &FileStore) -> (u64, u64) {
    let mut peak = 0u64;
    for session in 0..SESSIONS {
        if session % RECORD_EVERY == 0 {
            s.put(1, record(session)).await.unwrap();
            peak = peak.max(s.file_len());
        }
        s.put_state(session, state_of(session)).await.unwrap();
        peak = peak.max(s.file_len());
    }
    // Rewrites run in the background: wait for the last one.
    while s.rewriting() {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    (peak, s.file_len())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_thousand_sessions_keep_the_file_within_one_and_a_half_times_the_bound() {
    let dir = scratch();
    let path = dir.path().join("state.log");
    let s = opened(&path, Duration::from_secs(3600), BOUND);
    let (peak, end) = write_sessions(&s).await;
    let newest = SESSIONS - 1;
    let kept_running = s.get_state(newest).await.unwrap();
    drop(s);
    let s = opened(&path, Duration::from_secs(3600), BOUND);
    let f = Figures {
        peak,
        end,
        reopened: s.file_len(),
    };
    f.print();
    let limit = BOUND as u64 * 3 / 2;
    assert!(f.peak <= limit, "peak {} > {limit}", f.peak);
    assert!(
        f.end <= limit && f.reopened <= limit,
        "{} {}",
        f.end,
        f.reopened
    );
    assert_eq!(kept_running, Some(state_of(newest)), "newest state kept");
    // The most recent states survive, the oldest went (after the reopen
    // too: evicted for good).
    for session in [newest, newest - 1, newest - 50] {
        let back = s.get_state(session).await.unwrap();
        assert_eq!(back, Some(state_of(session)), "state {session}");
    }
    for session in [0, 1, 500] {
        assert_eq!(s.get_state(session).await.unwrap(), None, "{session} kept");
    }
    let newest_record = SESSIONS - RECORD_EVERY;
    let found = s.find(1, &[0, newest_record]).await.unwrap();
    assert_eq!(found, Some(record(newest_record)), "newest record kept");
    let used = s.inner.shared().index.usage();
    assert!(used.counted <= BOUND as u64, "{used:?}");
    assert!(used.states <= evict::Limits::new(BOUND).states, "{used:?}");
}

/// States take at most a quarter of the bound: a flood of new sessions
/// drops the oldest states, not the records that fill the rest.
#[tokio::test]
async fn a_flood_of_states_leaves_the_records_three_quarters_of_the_bound() {
    let dir = scratch();
    let path = dir.path().join("state.log");
    let s = opened(&path, Duration::from_secs(3600), BOUND);
    let records = 30u128;
    for h in 0..records {
        s.put(1, record(h)).await.unwrap();
    }
    let before = s.len();
    for session in 0..SESSIONS {
        s.put_state(session, state_of(session)).await.unwrap();
    }
    let share = evict::Limits::new(BOUND).states;
    let used = s.inner.shared().index.usage();
    assert!(
        used.states <= share && used.counted <= BOUND as u64,
        "{used:?}"
    );
    // The records older than every state: only what the share needs went.
    let left = (BOUND as u64 - share) as usize;
    assert!(
        s.bytes() + record(0).size() > left,
        "{} records' bytes",
        s.bytes()
    );
    assert!(s.len() < before, "the oldest records made room");
    let newest = s.find(1, &[0, records - 1]).await.unwrap();
    assert_eq!(newest, Some(record(records - 1)));
    let last = s.get_state(SESSIONS - 1).await.unwrap();
    assert_eq!(last, Some(state_of(SESSIONS - 1)));
    assert_eq!(s.get_state(0).await.unwrap(), None);
}

/// A file over the bound at open (written under a larger bound, or by a
/// compactor that did not count states) is brought within it: the oldest
/// states and records dropped, the file rewritten.
#[tokio::test]
async fn a_file_over_the_bound_at_open_is_brought_within_it() {
    let dir = scratch();
    let path = dir.path().join("state.log");
    {
        let s = opened(&path, Duration::from_secs(3600), 64 << 20);
        write_sessions(&s).await;
        assert!(s.file_len() > BOUND as u64 * 3, "{}", s.file_len());
    }
    let s = opened(&path, Duration::from_secs(3600), BOUND);
    assert!(s.moved_aside().is_none());
    assert!(s.file_len() <= BOUND as u64 * 3 / 2, "{}", s.file_len());
    let used = s.inner.shared().index.usage();
    assert!(used.counted <= BOUND as u64, "{used:?}");
    let newest = SESSIONS - 1;
    assert_eq!(s.get_state(newest).await.unwrap(), Some(state_of(newest)));
    assert_eq!(s.get_state(0).await.unwrap(), None);
    drop(s);
    let s = opened(&path, Duration::from_secs(3600), BOUND);
    assert!(s.file_len() <= BOUND as u64 * 3 / 2, "{}", s.file_len());
    assert_eq!(s.get_state(newest).await.unwrap(), Some(state_of(newest)));
}
