//! The store's behaviour through its `Store` calls: what outlives a
//! reopen, the bounds, the sweep, and writes going on during a rewrite.

use std::path::Path;
use std::sync::atomic::Ordering;
use std::time::Duration;

use super::*;

pub(super) fn rec(k: usize, h: u128, text: &str) -> StoredRecord {
    StoredRecord {
        k,
        prefix_hash: h,
        replacement: vec![text.to_owned()],
        original_tokens: 100,
        replacement_tokens: 10,
        summary_rows: None,
    }
}

fn open(path: &Path) -> FileStore {
    opened(path, Duration::from_secs(60), 1 << 20)
}

/// A store whose puts at the bound wait up to 30 s for the rewrite's
/// progress (paced, not refused) as long as it makes some. With the
/// default 200 ms a rewrite slowed by a busy machine (the other tests,
/// on two cores) refused puts in clean-clone CI runs: what the store should
/// do then, but not what these tests measure. The tests of refusal set
/// their own wait.
pub(super) fn opened(path: &Path, ttl: Duration, bound: usize) -> FileStore {
    let s = FileStore::open(path, ttl, bound).unwrap();
    s.set_write_wait(Duration::from_secs(30));
    s
}

#[tokio::test]
async fn records_survive_reopen_and_stay_scoped_by_credential() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("sub/state.log");
    {
        let s = open(&path);
        assert!(!s.may_have(10));
        s.put(1, rec(2, 22, "{\"a\":\"é\"}")).await.unwrap();
        s.put(1, rec(4, 44, "{\"b\":2}")).await.unwrap();
        assert!(s.may_have(2) && !s.may_have(1));
    }
    let secret = open(&path).keyer_secret();
    let s = open(&path);
    assert_eq!(s.keyer_secret(), secret, "the secret outlives the process");
    assert_eq!(s.len(), 2);
    let hit = s.find(1, &[11, 22, 33, 44, 55]).await.unwrap().unwrap();
    assert_eq!(hit, rec(4, 44, "{\"b\":2}"));
    assert_eq!(s.find(1, &[11, 22, 99]).await.unwrap().unwrap().k, 2);
    assert!(s.find(2, &[11, 22, 33, 44]).await.unwrap().is_none());
    assert!(s.find(1, &[]).await.unwrap().is_none());
}

#[tokio::test]
async fn a_replaced_record_and_its_summary_rows_read_back_after_reopen() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("state.log");
    let mut second = rec(2, 22, "two");
    second.summary_rows = Some(vec![0]);
    {
        let s = open(&path);
        s.put(1, rec(2, 22, "one")).await.unwrap();
        s.put(1, second.clone()).await.unwrap();
    }
    let s = open(&path);
    assert_eq!(s.len(), 1);
    assert_eq!(s.find(1, &[1, 22]).await.unwrap(), Some(second));
}

#[tokio::test]
async fn learned_windows_survive_reopen() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("state.log");
    {
        let s = open(&path);
        assert!(s.windows().is_empty());
        s.put_window("http://u:1", "m", 4096).await.unwrap();
        s.put_window("http://u:1", "m", 8192).await.unwrap();
    }
    assert_eq!(
        open(&path).windows(),
        vec![("http://u:1".into(), "m".into(), 8192)]
    );
}

#[tokio::test]
async fn file_is_owner_only() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("new/state.log");
    let _s = open(&path);
    let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode(&path), 0o600);
    assert_eq!(mode(path.parent().unwrap()), 0o700);
}

#[tokio::test]
async fn a_second_process_cannot_share_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("state.log");
    let _s = open(&path);
    let second = FileStore::open(&path, Duration::from_secs(60), 1 << 20);
    assert!(matches!(second, Err(OpenError::Busy { .. })), "{second:?}");
}

#[tokio::test]
async fn conversation_state_survives_reopen_and_expires() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("state.log");
    {
        let s = open(&path);
        assert_eq!(s.get_state(7).await.unwrap(), None);
        s.put_state(7, b"one".to_vec()).await.unwrap();
        s.put_state(7, b"two".to_vec()).await.unwrap();
    }
    {
        let s = open(&path);
        assert_eq!(s.get_state(7).await.unwrap().as_deref(), Some(&b"two"[..]));
        assert_eq!(s.get_state(8).await.unwrap(), None);
    }
    std::thread::sleep(Duration::from_millis(250));
    // Reopened with a TTL shorter than the time since the write.
    let s = opened(&path, Duration::from_millis(200), 1 << 20);
    assert_eq!(s.get_state(7).await.unwrap(), None, "expired");
    assert!(s.inner.shared().index.states.is_empty(), "dropped at open");
    drop(s);
    // Dropped for good: a longer TTL does not bring it back.
    let s = open(&path);
    assert_eq!(s.get_state(7).await.unwrap(), None);
}

#[tokio::test]
async fn the_file_shrinks_at_open_after_many_records_expired() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("state.log");
    {
        let s = opened(&path, Duration::from_millis(200), 64 << 20);
        let text = "y".repeat(4000);
        for h in 0..2000u128 {
            s.put(h % 7, rec(3, h, &text)).await.unwrap();
        }
        s.put_state(1, vec![b'z'; 1000]).await.unwrap();
    }
    let full = std::fs::metadata(&path).unwrap().len();
    assert!(full > 2000 * 4000, "{full}");
    std::thread::sleep(Duration::from_millis(250));
    let s = opened(&path, Duration::from_millis(200), 64 << 20);
    assert!(s.is_empty());
    let after = std::fs::metadata(&path).unwrap().len();
    assert!(after < full / 4, "{full} → {after}");
    drop(s);
    // And the shrunk file is a good one.
    let s = opened(&path, Duration::from_secs(60), 1 << 20);
    assert!(s.moved_aside().is_none());
    s.put(1, rec(1, 1, "{}")).await.unwrap();
    assert!(s.find(1, &[1]).await.unwrap().is_some());
}

#[tokio::test]
async fn a_put_makes_room_before_it_exceeds_the_bound() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("state.log");
    let bound = 512 << 10;
    let s = opened(&path, Duration::from_secs(3600), bound);
    for h in 0..30u128 {
        s.put(1, rec(2, h, &"q".repeat(64 << 10))).await.unwrap();
        assert!(s.bytes() <= bound, "{} > {bound} after put {h}", s.bytes());
    }
    assert!(s.find(1, &[0, 29]).await.unwrap().is_some(), "newest kept");
    assert!(
        s.find(1, &[0, 0]).await.unwrap().is_none(),
        "oldest dropped"
    );
    drop(s);
    let s = opened(&path, Duration::from_secs(3600), bound);
    assert!(s.bytes() <= bound && s.find(1, &[0, 29]).await.unwrap().is_some());
    assert!(
        s.find(1, &[0, 0]).await.unwrap().is_none(),
        "evicted for good"
    );
}

fn env(k: &str, default: usize) -> usize {
    std::env::var(k)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// The file, not only the records, stays within 1.5× the bound while
/// unique records far beyond it are written, and after a restart.
/// `COMPACTOR_BOUND_MB` / `COMPACTOR_RECORDS` / `COMPACTOR_RECORD_KB`
/// scale it up for a measurement (issue 22: 256 / 750 / 1024).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_file_stays_within_one_and_a_half_times_the_bound() {
    let bound = env("COMPACTOR_BOUND_MB", 4) << 20;
    let (n, kb) = (
        env("COMPACTOR_RECORDS", 100),
        env("COMPACTOR_RECORD_KB", 256),
    );
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("state.log");
    let s = opened(&path, Duration::from_secs(3600), bound);
    let (mut peak, mut slowest) = (0u64, Duration::ZERO);
    for h in 0..n as u128 {
        // Unique records, each a little over a power of two.
        let text = format!("{h:08}{}", "p".repeat((kb << 10) + 100));
        let started = std::time::Instant::now();
        s.put(1, rec(2, h, &text)).await.unwrap();
        slowest = slowest.max(started.elapsed());
        peak = peak.max(s.file_len());
        assert!(s.bytes() <= bound, "{} > {bound}", s.bytes());
    }
    // Rewrites run in the background: wait for the last one.
    while s.rewriting() {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let live = s.len();
    let running = s.file_len();
    let c = &s.inner.counters;
    let (rewrites, paced, refused) = (
        c.rewrites.load(Ordering::Relaxed),
        c.paced.load(Ordering::Relaxed),
        c.refused.load(Ordering::Relaxed),
    );
    drop(s);
    let s = opened(&path, Duration::from_secs(3600), bound);
    let restarted = s.file_len();
    eprintln!(
        "bound {bound} records {n}x{kb}KiB live {live} file peak {peak} end {running} \
         after restart {restarted} slowest put {slowest:?} rewrites {rewrites} \
         paced puts {paced} refused {refused}"
    );
    let limit = bound as u64 * 3 / 2;
    assert!(peak <= limit, "peak {peak} > {limit}");
    assert!(
        running <= limit && restarted <= limit,
        "{running} {restarted}"
    );
    assert!(rewrites > 0 && refused == 0);
    assert!(live > 0 && s.len() == live);
    assert!(
        s.find(1, &[0, n as u128 - 1]).await.unwrap().is_some(),
        "newest kept"
    );
}

#[tokio::test]
async fn sweep_drops_expired_and_bounds_bytes_oldest_first() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("state.log");
    let s = opened(&path, Duration::from_millis(200), 3000);
    for h in 1..=3u128 {
        s.put(1, rec(1, h, &"x".repeat(900))).await.unwrap();
        std::thread::sleep(Duration::from_millis(3));
    }
    s.touch(1, 1);
    s.put(1, rec(1, 4, &"x".repeat(900))).await.unwrap();
    s.sweep().await.unwrap();
    assert!(s.bytes() <= 3000);
    assert!(s.find(1, &[2]).await.unwrap().is_none(), "oldest dropped");
    assert!(s.find(1, &[1]).await.unwrap().is_some(), "touched kept");
    std::thread::sleep(Duration::from_millis(250));
    assert!(s.find(1, &[1]).await.unwrap().is_none(), "expired");
    s.sweep().await.unwrap();
    assert!(s.is_empty());
    drop(s);
    assert!(open(&path).is_empty(), "the sweep reached the file");
}

#[tokio::test]
async fn last_uses_noted_in_memory_reach_the_file_at_the_sweep() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("state.log");
    let s = open(&path);
    s.put(1, rec(1, 1, "a")).await.unwrap();
    s.put(1, rec(1, 2, "b")).await.unwrap();
    let before = s.inner.shared().index.meta[&(1, 1)].touched;
    std::thread::sleep(Duration::from_millis(5));
    s.touch(1, 1);
    s.sweep().await.unwrap();
    let touched = s.inner.shared().index.meta[&(1, 1)].touched;
    assert!(touched > before);
    drop(s);
    assert_eq!(
        open(&path).inner.shared().index.meta[&(1, 1)].touched,
        touched
    );
}

/// A bound of 1 MiB (the file may reach 1.5 MiB) and records of 4 KiB: a
/// rewrite starts at about 1.25 MiB, a quarter of the room left (64
/// KiB, 15 records) is free to write before its copy progresses.
const BOUND: usize = 1 << 20;

fn small(h: u128) -> StoredRecord {
    rec(2, h, &"w".repeat(4 << 10))
}

async fn filled(path: &Path) -> FileStore {
    opened(path, Duration::from_secs(3600), BOUND)
}

/// Puts records until a rewrite starts (held at its first entry).
async fn until_rewriting(s: &FileStore, next: &mut u128) {
    while !s.rewriting() {
        s.put(1, small(*next)).await.unwrap();
        *next += 1;
    }
    s.inner.hold.wait_parked();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writes_go_on_while_a_rewrite_copies() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("state.log");
    let s = filled(&path).await;
    s.inner.hold.set(true);
    let mut next = 0u128;
    until_rewriting(&s, &mut next).await;
    // The rewrite is parked inside its copy: these writes can only
    // succeed if none waits for it. They fit the room it left.
    let during = next;
    for _ in 0..3 {
        s.put(1, small(next)).await.unwrap();
        next += 1;
    }
    s.put_state(9, b"state".to_vec()).await.unwrap();
    s.put_window("http://u:1", "m", 4096).await.unwrap();
    let c = &s.inner.counters;
    assert!(s.rewriting(), "still copying");
    assert_eq!(c.written_while_rewriting.load(Ordering::Relaxed), 5);
    assert_eq!(c.paced.load(Ordering::Relaxed), 0, "no write waited");
    let before = s.file_len();
    s.inner.hold.set(false);
    while s.rewriting() {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(c.rewrites.load(Ordering::Relaxed), 1);
    assert!(s.file_len() < before, "{} !< {before}", s.file_len());
    // What was written during the copy is in the new file, found through
    // the relocated index now and after a reopen.
    for h in during..next {
        assert!(s.find(1, &[0, h]).await.unwrap().is_some(), "{h}");
    }
    assert_eq!(
        s.get_state(9).await.unwrap().as_deref(),
        Some(&b"state"[..])
    );
    drop(s);
    let s = filled(&path).await;
    for h in during..next {
        assert!(
            s.find(1, &[0, h]).await.unwrap().is_some(),
            "{h} after reopen"
        );
    }
    assert_eq!(
        s.get_state(9).await.unwrap().as_deref(),
        Some(&b"state"[..])
    );
    assert_eq!(s.windows(), vec![("http://u:1".into(), "m".into(), 4096)]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_that_would_outrun_the_copy_waits_for_its_progress_only() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("state.log");
    let s = std::sync::Arc::new(filled(&path).await);
    s.inner.hold.set(true);
    let mut next = 0u128;
    until_rewriting(&s, &mut next).await;
    // With the copy held, writes use up the room and then wait.
    let limit = index::bounds(BOUND, 0).hard;
    let writer = {
        let s = std::sync::Arc::clone(&s);
        tokio::spawn(async move {
            for h in next..next + 40 {
                s.put(1, small(h)).await.unwrap();
                assert!(s.file_len() <= limit, "{} > {limit}", s.file_len());
            }
        })
    };
    while s.inner.counters.paced.load(Ordering::Relaxed) == 0 {
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    assert!(s.file_len() <= limit);
    s.inner.hold.set(false);
    writer.await.unwrap();
    assert_eq!(s.inner.counters.refused.load(Ordering::Relaxed), 0);
}

#[tokio::test]
async fn a_write_refused_at_the_bound_is_an_error_and_the_file_stays_bounded() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("state.log");
    let s = filled(&path).await;
    s.set_write_wait(Duration::from_millis(20));
    s.inner.hold.set(true);
    let mut next = 0u128;
    until_rewriting(&s, &mut next).await;
    let limit = index::bounds(BOUND, 0).hard;
    let mut refused = false;
    for h in next..next + 40 {
        refused |= s.put(1, small(h)).await.is_err();
        assert!(s.file_len() <= limit);
    }
    assert!(refused);
    s.inner.hold.set(false);
}

#[tokio::test]
async fn a_record_damaged_after_open_is_corrupt_and_leaves_the_index() {
    use std::os::unix::fs::FileExt;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("state.log");
    let s = open(&path);
    s.put(1, rec(1, 5, &"r".repeat(100))).await.unwrap();
    s.put_state(3, b"st".to_vec()).await.unwrap();
    let (rec_at, state_at) = {
        let shared = s.inner.shared();
        (shared.index.meta[&(1, 5)].at, shared.index.states[&3].at)
    };
    let f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
    f.write_all_at(b"!", rec_at.offset + 60).unwrap();
    f.write_all_at(b"!", state_at.offset + 20).unwrap();
    assert!(matches!(s.find(1, &[5]).await, Err(StoreError::Corrupt)));
    assert!(s.find(1, &[5]).await.unwrap().is_none(), "dropped");
    assert!(matches!(s.get_state(3).await, Err(StoreError::Corrupt)));
    assert_eq!(s.get_state(3).await.unwrap(), None);
    s.put(1, rec(1, 6, "ok")).await.unwrap();
    assert!(s.find(1, &[6]).await.unwrap().is_some());
}

#[tokio::test]
async fn a_rewrite_that_fails_leaves_writes_bounded_and_never_stuck() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("state.log");
    let s = filled(&path).await;
    // The temporary file cannot be created: every rewrite fails.
    std::fs::create_dir(disk::temp_path(&path)).unwrap();
    let limit = index::bounds(BOUND, 0).hard;
    let (mut refused, mut kept) = (0, None);
    for h in 0..600u128 {
        let started = std::time::Instant::now();
        match s.put(1, small(h)).await {
            Ok(()) => kept = Some(h),
            Err(_) => refused += 1,
        }
        assert!(s.file_len() <= limit, "{} > {limit}", s.file_len());
        // Refused at once: no wait for a rewrite that is not coming.
        assert!(started.elapsed() < Duration::from_secs(5));
    }
    assert!(refused > 0 && !s.rewriting());
    assert_eq!(s.inner.counters.rewrites.load(Ordering::Relaxed), 0);
    // Reads still serve what was written.
    assert!(s.find(1, &[0, kept.unwrap()]).await.unwrap().is_some());
}

/// The text of record `h` of credential `cred`: each record's own, so a
/// read at a wrong offset (or of another record) cannot pass.
fn text_of(cred: u128, h: u128) -> String {
    format!("{cred}:{h}:{}", "t".repeat(2000 + (h as usize * 37) % 4000))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_record_reads_back_as_written_across_concurrent_rewrites() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("state.log");
    let s = std::sync::Arc::new(filled(&path).await);
    let tasks: Vec<_> = (1..=4u128)
        .map(|cred| {
            let s = std::sync::Arc::clone(&s);
            tokio::spawn(async move {
                for h in 0..250u128 {
                    s.put(cred, rec(2, h, &text_of(cred, h))).await.unwrap();
                    if h % 3 == 0 {
                        s.put_state(cred, h.to_le_bytes().to_vec()).await.unwrap();
                    }
                    if h % 50 == 0 {
                        s.sweep().await.unwrap();
                    }
                    // A recent record: found with its own text, or evicted.
                    let back = h.saturating_sub(5);
                    if let Some(r) = s.find(cred, &[0, back]).await.unwrap() {
                        assert_eq!(r.replacement, vec![text_of(cred, back)]);
                        s.touch(cred, back);
                    }
                }
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap();
    }
    while s.rewriting() {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert!(s.inner.counters.rewrites.load(Ordering::Relaxed) > 3);
    let kept: Vec<entry::Key> = s.inner.shared().index.meta.keys().copied().collect();
    assert!(!kept.is_empty());
    for &(cred, h) in &kept {
        let r = s.find(cred, &[0, h]).await.unwrap().unwrap();
        assert_eq!(r.replacement, vec![text_of(cred, h)]);
    }
    let s = std::sync::Arc::into_inner(s).unwrap();
    drop(s);
    let s = filled(&path).await;
    assert!(s.moved_aside().is_none());
    let mut again: Vec<entry::Key> = s.inner.shared().index.meta.keys().copied().collect();
    let mut kept = kept;
    kept.sort_unstable();
    again.sort_unstable();
    assert_eq!(again, kept, "the file holds what the index held");
    for cred in 1..=4u128 {
        // The last state each task put (249 is a multiple of 3).
        let last = Some(249u128.to_le_bytes().to_vec());
        assert_eq!(s.get_state(cred).await.unwrap(), last);
    }
}

/// Issue 49: at a small bound the hard limit is the live entries plus 64
/// KiB, so the garbage under it never reached the 64 KiB a rewrite waited
/// for: every write was refused and no rewrite ever ran.
#[tokio::test]
async fn a_small_bound_never_refuses_writes_while_garbage_exists() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("state.log");
    let bound = 64 << 10;
    let s = opened(&path, Duration::from_secs(3600), bound);
    // Unique records: each put past the bound evicts the oldest, so the
    // live entries stay near the bound and every put leaves garbage.
    for h in 0..400u128 {
        s.put(1, rec(2, h, &"s".repeat(1000)))
            .await
            .unwrap_or_else(|e| {
                panic!(
                    "put {h} refused: file {} live {}: {e}",
                    s.file_len(),
                    s.inner.shared().index.live()
                )
            });
        let live = s.inner.shared().index.live();
        assert!(s.file_len() <= index::bounds(bound, live).hard.max(live));
    }
    while s.rewriting() {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert!(s.inner.counters.rewrites.load(Ordering::Relaxed) > 0);
    assert_eq!(s.inner.counters.refused.load(Ordering::Relaxed), 0);
    assert!(s.find(1, &[0, 399]).await.unwrap().is_some());
}

/// The same wedge reached through conversation states, which the bound
/// did not count then (the hard limit became the live entries plus 64
/// KiB); now they count and take at most their share of it: one state
/// written again and again beside records and states that fill the bound.
#[tokio::test]
async fn states_beside_a_full_small_bound_never_wedge_writes() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("state.log");
    let bound = 200 << 10;
    let s = opened(&path, Duration::from_secs(3600), bound);
    for h in 0..200u128 {
        s.put(1, rec(2, h, &"r".repeat(1000))).await.unwrap();
    }
    // States far beyond their share: the oldest make room.
    for session in 100..400u128 {
        s.put_state(session, vec![b's'; 2000]).await.unwrap();
    }
    let limits = evict::Limits::new(bound);
    assert!(s.inner.shared().index.usage().states <= limits.states);
    for n in 0..300usize {
        s.put_state(7, vec![b'n'; 1000 + n % 7])
            .await
            .unwrap_or_else(|e| panic!("state {n} refused: file {}: {e}", s.file_len()));
    }
    while s.rewriting() {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert!(s.inner.counters.rewrites.load(Ordering::Relaxed) > 0);
    assert_eq!(s.inner.counters.refused.load(Ordering::Relaxed), 0);
    drop(s);
    let s = opened(&path, Duration::from_secs(3600), bound);
    assert_eq!(
        s.get_state(7).await.unwrap().map(|v| v.len()),
        Some(1000 + 299 % 7)
    );
}

/// Issue 49: a restart on a nearly full disk. The rewrite at open (only
/// for garbage: the file checked whole) fails; the file is used as it is
/// instead of the store being off for the life of the process. The full
/// disk is injected (`tests_hook::set_disk_full`: the temporary file's
/// writes fail with `StorageFull` after half their bytes), so this shows
/// what open does with a failed rewrite, not how a file system fills.
#[tokio::test]
async fn a_rewrite_at_open_that_fails_leaves_the_file_in_use_and_tries_again_later() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("state.log");
    {
        // Four live records and about 300 KB of replaced ones: rewritten
        // at open, not while running (under the start bound).
        let s = opened(&path, Duration::from_secs(3600), BOUND);
        for n in 0..150u128 {
            s.put(1, rec(2, n % 4, &format!("{n}{}", "g".repeat(2000))))
                .await
                .unwrap();
        }
        s.put_state(3, b"kept".to_vec()).await.unwrap();
        assert_eq!(s.inner.counters.rewrites.load(Ordering::Relaxed), 0);
    }
    let before = std::fs::read(&path).unwrap();
    tests_hook::set_disk_full(true);
    let opened_on_a_full_disk = FileStore::open(&path, Duration::from_secs(3600), BOUND);
    tests_hook::set_disk_full(false);
    let s = opened_on_a_full_disk.expect("the file checked whole: used as it is");
    s.set_write_wait(Duration::from_secs(30));
    assert!(s.moved_aside().is_none());
    assert_eq!(std::fs::read(&path).unwrap(), before, "left as it was");
    assert!(!disk::temp_path(&path).exists(), "the half copy removed");
    assert_eq!(s.inner.counters.rewrites.load(Ordering::Relaxed), 0);
    assert!(
        inner::lock(&s.inner.retry_at).is_some(),
        "put off, not given up"
    );
    for h in 0..4u128 {
        assert!(s.find(1, &[0, h]).await.unwrap().is_some(), "{h}");
    }
    assert_eq!(s.get_state(3).await.unwrap().as_deref(), Some(&b"kept"[..]));
    // Once the wait is over (cut short here), the running store rewrites
    // the file when it reaches its start bound.
    *inner::lock(&s.inner.retry_at) = None;
    let mut n = 1000u128;
    while s.inner.counters.rewrites.load(Ordering::Relaxed) == 0 {
        s.put(1, rec(2, n % 4, &"h".repeat(2000))).await.unwrap();
        n += 1;
        while s.rewriting() {
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        assert!(n < 2000, "no rewrite came");
    }
    assert!(s.file_len() < before.len() as u64);
    assert_eq!(s.get_state(3).await.unwrap().as_deref(), Some(&b"kept"[..]));
}

/// Issue 49: every write was an `fdatasync` under the writer's lock, so
/// writes faster than the disk queued one sync each. Now the writes that
/// queue while a sync runs share the next one.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn writes_queued_behind_a_sync_share_the_next_one() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("state.log");
    let s = std::sync::Arc::new(open(&path));
    let syncs = || s.inner.counters.syncs.load(Ordering::Relaxed);
    // Alone, each write is its own sync.
    for h in 0..4u128 {
        s.put(1, rec(2, h, "alone")).await.unwrap();
    }
    assert_eq!(syncs(), 4);
    s.inner.hold.set_slow_sync(50);
    let tasks: Vec<_> = (0..24u128)
        .map(|h| {
            let s = std::sync::Arc::clone(&s);
            tokio::spawn(async move { s.put(2, rec(2, h, &format!("together {h}"))).await })
        })
        .collect();
    for t in tasks {
        t.await.unwrap().unwrap();
    }
    let grouped = syncs() - 4;
    assert!(grouped < 24 / 2, "{grouped} syncs for 24 writes");
    s.inner.hold.set_slow_sync(0);
    let s = std::sync::Arc::into_inner(s).unwrap();
    drop(s);
    let s = open(&path);
    for h in 0..24u128 {
        let r = s.find(2, &[0, h]).await.unwrap().unwrap();
        assert_eq!(r.replacement, vec![format!("together {h}")]);
    }
}

/// Writes beyond what may queue for a slow disk are refused at once (the
/// record stays in memory) instead of each holding a blocking thread.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn writes_beyond_the_queue_are_refused_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("state.log");
    let s = std::sync::Arc::new(open(&path));
    s.inner.hold.set_slow_sync(300);
    let tasks: Vec<_> = (0..100u128)
        .map(|h| {
            let s = std::sync::Arc::clone(&s);
            tokio::spawn(async move {
                let started = std::time::Instant::now();
                let r = s.put(1, rec(2, h, "x")).await;
                (h, r.is_ok(), started.elapsed())
            })
        })
        .collect();
    let mut kept = Vec::new();
    let mut refused = 0;
    for t in tasks {
        let (h, ok, took) = t.await.unwrap();
        if ok {
            kept.push(h);
        } else {
            refused += 1;
            assert!(took < Duration::from_millis(250), "refused after {took:?}");
        }
    }
    assert!(refused > 0 && !kept.is_empty(), "{refused} refused");
    assert_eq!(s.inner.counters.queue_full.load(Ordering::Relaxed), refused);
    assert_eq!(s.inner.queued.load(Ordering::Relaxed), 0);
    s.inner.hold.set_slow_sync(0);
    for h in kept {
        assert!(s.find(1, &[0, h]).await.unwrap().is_some());
    }
}

/// A write whose caller's timeout gave up on it while it was queued for
/// a blocking thread is not made when its turn comes (it used to run
/// anyway, long after, holding a thread and a sync).
#[test]
fn a_queued_write_its_caller_gave_up_on_is_not_made() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .max_blocking_threads(1)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("state.log");
        let s = std::sync::Arc::new(open(&path));
        s.inner.hold.set_slow_sync(300);
        // Takes the one blocking thread for the length of its sync.
        let first = {
            let s = std::sync::Arc::clone(&s);
            tokio::spawn(async move { s.put(1, rec(2, 1, "first")).await })
        };
        tokio::time::sleep(Duration::from_millis(50)).await;
        let late = tokio::time::timeout(Duration::from_millis(20), s.put(1, rec(2, 2, "late")));
        assert!(late.await.is_err(), "timed out while queued");
        first.await.unwrap().unwrap();
        s.inner.hold.set_slow_sync(0);
        // Its turn has come and gone: a later call runs after it.
        s.put(1, rec(2, 3, "after")).await.unwrap();
        assert!(s.find(1, &[0, 2]).await.unwrap().is_none(), "not made");
        assert_eq!(s.inner.counters.abandoned.load(Ordering::Relaxed), 1);
        assert!(s.find(1, &[0, 3]).await.unwrap().is_some());
        assert_eq!(s.inner.queued.load(Ordering::Relaxed), 0);
    });
}
