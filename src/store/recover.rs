//! A damaged redb file never keeps the proxy from starting: it is moved
//! aside as `<name>.damaged-<UTC timestamp>` (kept for the operator, never
//! deleted), a fresh file is opened at the original path, and when even
//! that fails the store degrades to memory.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use super::redb::{OpenError, RedbStore};

/// What opening the configured file came to.
pub struct Opened {
    /// The store, or `None`: serve from memory.
    pub(crate) store: Option<RedbStore>,
    /// Where a damaged file was moved to.
    pub(crate) moved_aside: Option<PathBuf>,
}

/// Opens `path`; a damaged file is moved aside and a fresh one opened.
/// Logs (content-free: paths and redb's own error text) what happened.
pub fn open_redb(path: &Path, ttl: Duration, max_bytes: usize) -> Opened {
    let damage = match RedbStore::open(path, ttl, max_bytes) {
        Ok(store) => {
            return Opened {
                store: Some(store),
                moved_aside: None,
            }
        }
        Err(OpenError::Damaged(why)) => why,
        Err(e) => {
            tracing::warn!(backend = "redb", path = %path.display(), error = %e,
                "store cannot be opened; records are kept in memory only");
            return Opened {
                store: None,
                moved_aside: None,
            };
        }
    };
    let aside = damaged_name(path, SystemTime::now());
    if let Err(e) = std::fs::rename(path, &aside) {
        tracing::warn!(backend = "redb", path = %path.display(), error = %damage, rename_error = %e,
            "store file damaged and cannot be moved aside; records are kept in memory only");
        return Opened {
            store: None,
            moved_aside: None,
        };
    }
    tracing::warn!(backend = "redb", path = %path.display(), moved_to = %aside.display(),
        error = %damage, "store file damaged: moved aside, starting with a fresh one");
    let store = match RedbStore::open(path, ttl, max_bytes) {
        Ok(s) => Some(s),
        Err(e) => {
            tracing::warn!(backend = "redb", path = %path.display(), error = %e,
                "fresh store cannot be opened; records are kept in memory only");
            None
        }
    };
    Opened {
        store,
        moved_aside: Some(aside),
    }
}

/// `state.redb` → `state.redb.damaged-20261203T145301Z` (a second
/// recovery within the same second gets `-1`, `-2`, … appended).
pub fn damaged_name(path: &Path, now: SystemTime) -> PathBuf {
    let secs = now.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
    let base = {
        let mut name = path.file_name().map_or_else(OsString::new, OsString::from);
        name.push(format!(".damaged-{}", utc_stamp(secs)));
        path.with_file_name(name)
    };
    let mut candidate = base.clone();
    let mut n = 0u32;
    while candidate.exists() {
        n += 1;
        let mut name = base.file_name().map_or_else(OsString::new, OsString::from);
        name.push(format!("-{n}"));
        candidate = base.with_file_name(name);
    }
    candidate
}

/// `YYYYMMDDTHHMMSSZ` of a unix time.
fn utc_stamp(secs: u64) -> String {
    let days = (secs / 86_400) as i64;
    let rem = secs % 86_400;
    let (year, month, day) = crate::civil::civil_from_days(days);
    format!(
        "{year:04}{month:02}{day:02}T{:02}{:02}{:02}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::{Store, StoredRecord};

    const TTL: Duration = Duration::from_secs(600);

    fn rec(h: u128, bytes: usize) -> StoredRecord {
        StoredRecord {
            k: 2,
            prefix_hash: h,
            replacement: vec![format!("{{\"c\":\"{}\"}}", "r".repeat(bytes))],
            original_tokens: 100,
            replacement_tokens: 10,
            summary_rows: None,
        }
    }

    /// A file written by the store: records of several sizes (pages of
    /// every kind: branches, leaves, large values), a window, a state.
    async fn written(path: &Path) -> Vec<u8> {
        let s = RedbStore::open(path, TTL, 64 << 20).unwrap();
        for h in 0..40u128 {
            s.put((h % 3) + 1, rec(h, 300 + 97 * h as usize))
                .await
                .unwrap();
        }
        s.put(1, rec(99, 40_000)).await.unwrap();
        s.put_window("http://u:1", "m", 8192).await.unwrap();
        s.put_state(5, vec![b's'; 2000]).await.unwrap();
        drop(s);
        std::fs::read(path).unwrap()
    }

    /// The store at `path` starts and serves a write and a read.
    async fn serves(path: &Path) -> Opened {
        let opened = open_redb(path, TTL, 64 << 20);
        let s = opened.store.as_ref().expect("a store, not memory");
        s.put(7, rec(7, 100)).await.unwrap();
        assert_eq!(s.find(7, &[1, 7]).await.unwrap().unwrap().prefix_hash, 7);
        opened
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

    #[tokio::test]
    async fn a_file_cut_to_half_is_moved_aside_and_a_fresh_store_serves() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("state.redb");
        let bytes = written(&path).await;
        std::fs::write(&path, &bytes[..bytes.len() / 2]).unwrap();
        let opened = serves(&path).await;
        let aside = opened.moved_aside.clone().expect("moved aside");
        assert_eq!(std::fs::read(&aside).unwrap(), &bytes[..bytes.len() / 2]);
        assert_eq!(asides(dir.path()), 1);
        drop(opened);
        // The fresh file is a good one: it opens again as it is.
        assert!(serves(&path).await.moved_aside.is_none());
    }

    #[tokio::test]
    async fn every_zeroed_page_starts_and_serves() {
        let dir = tempfile::tempdir().unwrap();
        let good = dir.path().join("good.redb");
        let bytes = written(&good).await;
        let pages = bytes.len().div_ceil(4096);
        assert!(pages >= 16, "{pages} pages");
        // Every page of the head of the file (header, allocator state,
        // table roots), then a spread over the rest: one open per case.
        let cases: Vec<usize> = (0..16).chain((16..pages).step_by(pages / 24 + 1)).collect();
        let mut recovered = 0;
        for &page in &cases {
            let path = dir.path().join(format!("p{page}.redb"));
            let mut damaged = bytes.clone();
            let end = (page * 4096 + 4096).min(damaged.len());
            damaged[page * 4096..end].fill(0);
            std::fs::write(&path, &damaged).unwrap();
            let opened = serves(&path).await;
            recovered += usize::from(opened.moved_aside.is_some());
        }
        // Zeroing the header or a live page is found at open; a free page
        // is not damage. Both kinds occur in a file this size.
        assert!(
            recovered > 0 && recovered < cases.len(),
            "{recovered}/{}",
            cases.len()
        );
    }

    #[tokio::test]
    async fn a_garbage_file_is_moved_aside() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("state.redb");
        let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
        let garbage: Vec<u8> = (0..300_000)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect();
        std::fs::write(&path, &garbage).unwrap();
        assert!(serves(&path).await.moved_aside.is_some());
    }

    #[tokio::test]
    async fn a_file_in_use_is_not_moved_aside() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("state.redb");
        let _held = RedbStore::open(&path, TTL, 1 << 20).unwrap();
        let opened = open_redb(&path, TTL, 1 << 20);
        assert!(opened.store.is_none() && opened.moved_aside.is_none());
        assert_eq!(asides(dir.path()), 0);
    }

    #[test]
    fn stamps_are_utc_calendar_times() {
        assert_eq!(utc_stamp(0), "19700101T000000Z");
        assert_eq!(utc_stamp(951_782_400), "20000229T000000Z");
        assert_eq!(utc_stamp(1_796_313_181), "20261203T155301Z");
    }

    #[test]
    fn a_second_name_in_the_same_second_does_not_overwrite_the_first() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("state.redb");
        let t = UNIX_EPOCH + Duration::from_secs(0);
        let first = damaged_name(&path, t);
        assert_eq!(
            first.file_name().unwrap(),
            "state.redb.damaged-19700101T000000Z"
        );
        std::fs::write(&first, b"x").unwrap();
        let second = damaged_name(&path, t);
        assert_eq!(
            second.file_name().unwrap(),
            "state.redb.damaged-19700101T000000Z-1"
        );
    }
}
