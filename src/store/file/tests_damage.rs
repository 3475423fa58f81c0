//! Nothing in a file's content keeps the store from opening and serving,
//! and nothing that checks is lost: every cut, every zeroed page, bit
//! flips, garbage, files that are not ours.

use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::time::Duration;

use super::entry::Key;
use super::index::Loc;
use super::tests::rec;
use super::*;

const TTL: Duration = Duration::from_secs(600);

/// A directory on tmpfs when there is one: thousands of opens, each with
/// its syncs, cost nothing there.
fn scratch() -> tempfile::TempDir {
    tempfile::tempdir_in("/dev/shm").unwrap_or_else(|_| tempfile::tempdir().unwrap())
}

/// A file written by the store and where each of its records is.
struct Written {
    bytes: Vec<u8>,
    records: HashMap<Key, Loc>,
    state: Loc,
}

/// `n` records of several sizes over three credentials (one of 40 KB
/// when `big`), a window and a state.
async fn written(path: &Path, n: u128, big: bool) -> Written {
    let s = FileStore::open(path, TTL, 64 << 20).unwrap();
    for h in 0..n {
        let text = "r".repeat(30 + 97 * h as usize);
        s.put((h % 3) + 1, rec(2, h, &text)).await.unwrap();
    }
    if big {
        s.put(1, rec(2, 99, &"b".repeat(40_000))).await.unwrap();
    }
    s.put_window("http://u:1", "m", 8192).await.unwrap();
    s.put_state(5, vec![b's'; 200]).await.unwrap();
    let (records, state) = {
        let shared = s.inner.shared();
        let records = shared.index.meta.iter().map(|(k, m)| (*k, m.at)).collect();
        (records, shared.index.states[&5].at)
    };
    drop(s);
    Written {
        bytes: std::fs::read(path).unwrap(),
        records,
        state,
    }
}

fn span(at: Loc) -> std::ops::Range<usize> {
    at.offset as usize..(at.offset + at.len) as usize
}

/// The records whose frame `damaged` holds unchanged.
fn intact(w: &Written, damaged: &[u8]) -> BTreeSet<Key> {
    w.records
        .iter()
        .filter(|(_, at)| damaged.get(span(**at)) == w.bytes.get(span(**at)))
        .map(|(k, _)| *k)
        .collect()
}

/// Opens `damaged` as a file: it opens, keeps exactly the intact records
/// (each read back), serves a write and a read, and opens clean again.
async fn opens_and_keeps(dir: &Path, w: &Written, damaged: &[u8], case: &str) {
    let path = dir.join("case.log");
    std::fs::write(&path, damaged).unwrap();
    let s = FileStore::open(&path, TTL, 64 << 20).unwrap_or_else(|e| panic!("{case}: {e}"));
    let kept: BTreeSet<Key> = s.inner.shared().index.meta.keys().copied().collect();
    assert_eq!(kept, intact(w, damaged), "{case}");
    for (cred, h) in &kept {
        let found = s.find(*cred, &[0, *h]).await.unwrap();
        assert_eq!(found.map(|r| r.prefix_hash), Some(*h), "{case}");
    }
    let state_intact = damaged.get(span(w.state)) == w.bytes.get(span(w.state));
    assert_eq!(
        s.get_state(5).await.unwrap().is_some(),
        state_intact,
        "{case}"
    );
    if let Some(aside) = s.moved_aside() {
        assert_eq!(
            std::fs::read(aside).unwrap(),
            damaged,
            "{case}: kept as it was"
        );
    }
    s.put(7, rec(2, 1 << 90, "new")).await.unwrap();
    assert!(s.find(7, &[0, 1 << 90]).await.unwrap().is_some(), "{case}");
    drop(s);
    let again = FileStore::open(&path, TTL, 64 << 20).unwrap();
    assert!(
        again.moved_aside().is_none(),
        "{case}: the new file is clean"
    );
    assert_eq!(again.len(), kept.len() + 1, "{case}");
    drop(again);
    for e in std::fs::read_dir(dir).unwrap() {
        std::fs::remove_file(e.unwrap().path()).unwrap();
    }
}

#[tokio::test]
async fn every_cut_of_a_small_file_opens_and_keeps_every_whole_entry() {
    let dir = scratch();
    let w = written(&dir.path().join("good.log"), 12, false).await;
    assert!(w.bytes.len() > 2000, "{}", w.bytes.len());
    std::fs::remove_file(dir.path().join("good.log")).unwrap();
    for len in 0..w.bytes.len() {
        opens_and_keeps(dir.path(), &w, &w.bytes[..len], &format!("cut at {len}")).await;
    }
}

#[tokio::test]
async fn cuts_of_a_larger_file_open_and_keep_every_whole_entry() {
    let dir = scratch();
    let w = written(&dir.path().join("good.log"), 40, true).await;
    std::fs::remove_file(dir.path().join("good.log")).unwrap();
    // A spread, and both sides of every frame's end.
    let mut cuts: BTreeSet<usize> = (0..w.bytes.len()).step_by(997).collect();
    for at in w.records.values() {
        let end = span(*at).end;
        cuts.extend([end - 1, end, end + 1]);
    }
    for len in cuts.into_iter().filter(|l| *l <= w.bytes.len()) {
        opens_and_keeps(dir.path(), &w, &w.bytes[..len], &format!("cut at {len}")).await;
    }
}

#[tokio::test]
async fn a_file_cut_to_half_is_cut_back_to_its_last_whole_entry_not_moved_aside() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("state.log");
    let w = written(&path, 40, true).await;
    let half = &w.bytes[..w.bytes.len() / 2];
    std::fs::write(&path, half).unwrap();
    let s = FileStore::open(&path, TTL, 64 << 20).unwrap();
    assert!(s.moved_aside().is_none(), "a torn tail is no damage");
    assert_eq!(s.len(), intact(&w, half).len());
    let whole = w
        .records
        .values()
        .map(|at| span(*at).end)
        .filter(|e| *e <= half.len())
        .max();
    assert_eq!(
        s.file_len(),
        whole.unwrap() as u64,
        "cut at the last whole entry"
    );
    assert_eq!(asides(dir.path()), 0);
}

#[tokio::test]
async fn every_zeroed_page_opens_and_keeps_every_entry_outside_it() {
    let dir = scratch();
    let w = written(&dir.path().join("good.log"), 40, true).await;
    std::fs::remove_file(dir.path().join("good.log")).unwrap();
    let pages = w.bytes.len().div_ceil(4096);
    assert!(pages >= 16, "{pages} pages");
    let mut moved = 0;
    for page in 0..pages {
        let mut damaged = w.bytes.clone();
        let end = (page * 4096 + 4096).min(damaged.len());
        damaged[page * 4096..end].fill(0);
        let path = dir.path().join("case.log");
        std::fs::write(&path, &damaged).unwrap();
        moved += usize::from(
            FileStore::open(&path, TTL, 64 << 20)
                .unwrap()
                .moved_aside()
                .is_some(),
        );
        opens_and_keeps(dir.path(), &w, &damaged, &format!("page {page} zeroed")).await;
    }
    // A page in the middle is damage (moved aside); the last one is a
    // torn tail (cut off).
    assert!(moved > 0 && moved < pages, "{moved}/{pages}");
}

/// A small deterministic generator (no dependency for a test).
struct XorShift(u64);

impl XorShift {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

#[tokio::test]
async fn random_bit_flips_and_garbage_open_and_keep_what_they_missed() {
    let dir = scratch();
    let w = written(&dir.path().join("good.log"), 40, true).await;
    std::fs::remove_file(dir.path().join("good.log")).unwrap();
    let mut rng = XorShift(0x9E37_79B9_7F4A_7C15);
    for case in 0..300 {
        let mut damaged = w.bytes.clone();
        let what = if case % 2 == 0 {
            for _ in 0..=rng.below(4) {
                let at = rng.below(damaged.len());
                damaged[at] ^= 1 << rng.below(8);
            }
            "bit flips"
        } else {
            let at = rng.below(damaged.len());
            let len = rng.below(3000).min(damaged.len() - at);
            for b in &mut damaged[at..at + len] {
                *b = rng.next() as u8;
            }
            "garbage"
        };
        opens_and_keeps(dir.path(), &w, &damaged, &format!("case {case}: {what}")).await;
    }
}

fn asides(dir: &Path) -> usize {
    std::fs::read_dir(dir)
        .unwrap()
        .filter(|e| {
            let name = e.as_ref().unwrap().file_name();
            name.to_string_lossy().contains(".damaged-")
        })
        .count()
}

/// The store at `path` opens and serves a write and a read.
async fn serves(path: &Path) -> FileStore {
    let s = FileStore::open(path, TTL, 64 << 20).expect("a store, not memory");
    s.put(7, rec(2, 7, "x")).await.unwrap();
    assert_eq!(s.find(7, &[1, 7]).await.unwrap().unwrap().prefix_hash, 7);
    s
}

#[tokio::test]
async fn a_damaged_file_is_moved_aside_and_a_fresh_one_keeps_what_checks() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("state.log");
    let w = written(&path, 40, true).await;
    let secret = FileStore::open(&path, TTL, 64 << 20)
        .unwrap()
        .keyer_secret();
    let mut damaged = w.bytes.clone();
    let mid = span(w.records[&(2, 10)]);
    damaged[mid.start + 40] ^= 0x10;
    std::fs::write(&path, &damaged).unwrap();
    let s = serves(&path).await;
    let aside: PathBuf = s.moved_aside().expect("moved aside").to_owned();
    assert!(aside
        .file_name()
        .unwrap()
        .to_string_lossy()
        .starts_with("state.log.damaged-"));
    assert_eq!(std::fs::read(&aside).unwrap(), damaged);
    assert_eq!(
        s.keyer_secret(),
        secret,
        "the header was intact: same secret"
    );
    assert_eq!(s.len(), w.records.len() - 1 + 1);
    assert_eq!(s.windows(), vec![("http://u:1".into(), "m".into(), 8192)]);
    assert_eq!(asides(dir.path()), 1);
    drop(s);
    assert!(serves(&path).await.moved_aside().is_none());
}

/// Nothing in it says compactor wrote it: someone else's file, refused
/// and left as it was (it used to be moved aside and replaced).
#[tokio::test]
async fn a_garbage_file_is_refused_and_left_as_it_was() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("state.log");
    let mut rng = XorShift(0x9E37_79B9_7F4A_7C15);
    let garbage: Vec<u8> = (0..300_000).map(|_| rng.next() as u8).collect();
    std::fs::write(&path, &garbage).unwrap();
    let e = FileStore::open(&path, TTL, 64 << 20).unwrap_err();
    assert!(matches!(e, OpenError::NotOurs { .. }), "{e}");
    assert_eq!(std::fs::read(&path).unwrap(), garbage);
    assert_eq!(asides(dir.path()), 0);
}

#[tokio::test]
async fn a_redb_file_is_not_ours_and_is_moved_aside() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("state.redb");
    let mut old = b"redb\x1a\x0a\xa9\x0d\x0a".to_vec();
    old.resize(8192, 0);
    std::fs::write(&path, &old).unwrap();
    let s = serves(&path).await;
    assert!(s.moved_aside().is_some());
    assert!(s.file_len() < 1024);
}

#[tokio::test]
async fn a_file_in_use_is_not_moved_aside() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("state.log");
    let _held = FileStore::open(&path, TTL, 1 << 20).unwrap();
    let second = FileStore::open(&path, TTL, 1 << 20);
    assert!(matches!(second, Err(OpenError::Busy { .. })));
    assert_eq!(asides(dir.path()), 0);
}

#[tokio::test]
async fn a_crash_during_creation_or_rewrite_leaves_nothing_to_recover() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("state.log");
    // Cut while its header was written.
    std::fs::write(&path, &frame::header(1)[..11]).unwrap();
    assert!(serves(&path).await.moved_aside().is_none());
    // A rewrite's temporary file left by a process that died.
    std::fs::write(disk::temp_path(&path), b"half a copy").unwrap();
    let s = serves(&path).await;
    assert!(s.moved_aside().is_none());
    assert!(!disk::temp_path(&path).exists());
    assert_eq!(asides(dir.path()), 0);
}

/// Issue 49: the header holds the secret every credential is hashed
/// with. One flipped bit anywhere in it is damage (the file kept aside)
/// that loses nothing: the other copy's secret is kept, so every record
/// is still reached by the same credentials.
#[tokio::test]
async fn a_flipped_bit_in_the_header_is_damage_that_keeps_the_secret() {
    let dir = scratch();
    let good = dir.path().join("good.log");
    let w = written(&good, 12, false).await;
    let secret = FileStore::open(&good, TTL, 64 << 20)
        .unwrap()
        .keyer_secret();
    std::fs::remove_file(&good).unwrap();
    let path = dir.path().join("case.log");
    for bit in 0..frame::HEADER_LEN * 8 {
        let mut damaged = w.bytes.clone();
        damaged[bit / 8] ^= 1 << (bit % 8);
        std::fs::write(&path, &damaged).unwrap();
        let s = FileStore::open(&path, TTL, 64 << 20).unwrap();
        assert_eq!(s.keyer_secret(), secret, "bit {bit}: the same secret");
        let aside = s
            .moved_aside()
            .unwrap_or_else(|| panic!("bit {bit}: not seen"));
        assert_eq!(std::fs::read(aside).unwrap(), damaged, "bit {bit}");
        assert_eq!(s.len(), w.records.len(), "bit {bit}: every record kept");
        drop(s);
        let again = FileStore::open(&path, TTL, 64 << 20).unwrap();
        assert!(again.moved_aside().is_none(), "bit {bit}: repaired");
        assert_eq!(again.keyer_secret(), secret, "bit {bit}");
        drop(again);
        for e in std::fs::read_dir(dir.path()).unwrap() {
            std::fs::remove_file(e.unwrap().path()).unwrap();
        }
    }
}

/// A file of format 1 (one copy of the header, entries from byte 32)
/// opens as it is, with its secret, and is written as format 2 by its
/// next rewrite.
#[tokio::test]
async fn a_file_of_the_first_format_opens_and_is_upgraded_at_its_next_rewrite() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("state.log");
    let w = written(&path, 12, false).await;
    let secret = 0x0123_4567_89AB_CDEF;
    let mut v1 = frame::header_v1(secret).to_vec();
    v1.extend_from_slice(&w.bytes[frame::HEADER_LEN..]);
    std::fs::write(&path, &v1).unwrap();
    let s = FileStore::open(&path, TTL, 64 << 20).unwrap();
    assert!(s.moved_aside().is_none(), "no damage");
    assert_eq!(s.keyer_secret(), Some(secret));
    assert_eq!(s.len(), w.records.len());
    assert_eq!(std::fs::read(&path).unwrap(), v1, "used as it is");
    s.put(9, rec(2, 9, "after")).await.unwrap();
    rewrite::now(&s.inner).unwrap();
    drop(s);
    let bytes = std::fs::read(&path).unwrap();
    assert!(matches!(
        frame::read_header(&bytes[..frame::HEADER_LEN]),
        frame::Header::Ours {
            secret: s,
            len: 64,
            repaired: false
        } if s == secret
    ));
    let s = FileStore::open(&path, TTL, 64 << 20).unwrap();
    assert!(s.moved_aside().is_none());
    assert_eq!(s.keyer_secret(), Some(secret));
    assert_eq!(s.len(), w.records.len() + 1);
    assert!(s.find(9, &[0, 9]).await.unwrap().is_some());
    // A format 1 file holding its header only is a file, not a cut one.
    std::fs::write(&path, frame::header_v1(secret)).unwrap();
    drop(s);
    let s = FileStore::open(&path, TTL, 64 << 20).unwrap();
    assert_eq!(s.keyer_secret(), Some(secret));
}
