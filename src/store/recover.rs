//! The name a damaged (or foreign) store file is kept under:
//! `<name>.damaged-<UTC timestamp>`, beside it, never deleted; the file
//! backend moves such a file aside at open and starts a fresh one
//! (`file/open.rs`).

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

/// `state.log` → `state.log.damaged-20261203T145301Z` (a second
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
    use std::time::Duration;

    #[test]
    fn stamps_are_utc_calendar_times() {
        assert_eq!(utc_stamp(0), "19700101T000000Z");
        assert_eq!(utc_stamp(951_782_400), "20000229T000000Z");
        assert_eq!(utc_stamp(1_796_313_181), "20261203T155301Z");
    }

    #[test]
    fn a_second_name_in_the_same_second_does_not_overwrite_the_first() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("state.log");
        let t = UNIX_EPOCH + Duration::from_secs(0);
        let first = damaged_name(&path, t);
        assert_eq!(
            first.file_name().unwrap(),
            "state.log.damaged-19700101T000000Z"
        );
        std::fs::write(&first, b"x").unwrap();
        let second = damaged_name(&path, t);
        assert_eq!(
            second.file_name().unwrap(),
            "state.log.damaged-19700101T000000Z-1"
        );
    }
}
