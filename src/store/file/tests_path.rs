//! What the store does with what it finds at its path and at its
//! temporary file's: never a link followed, never someone else's file
//! replaced, chmodded or written through.

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::time::Duration;

use super::tests::rec;
use super::*;

const TTL: Duration = Duration::from_secs(600);

fn mode(p: &Path) -> u32 {
    std::fs::metadata(p).unwrap().permissions().mode() & 0o777
}

fn names(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

/// Another program's file, world-readable.
fn victim(dir: &Path) -> std::path::PathBuf {
    let p = dir.join("victim.txt");
    std::fs::write(&p, b"someone else's notes\n").unwrap();
    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o644)).unwrap();
    p
}

fn untouched(p: &Path) {
    assert_eq!(std::fs::read(p).unwrap(), b"someone else's notes\n");
    assert_eq!(mode(p), 0o644, "not chmodded");
}

#[tokio::test]
async fn a_symlink_at_the_path_is_refused_and_its_target_left_alone() {
    let dir = tempfile::tempdir().unwrap();
    let target = victim(dir.path());
    let path = dir.path().join("state.log");
    std::os::unix::fs::symlink(&target, &path).unwrap();
    let e = FileStore::open(&path, TTL, 1 << 20).unwrap_err();
    assert!(e.to_string().contains("is a symbolic link"), "{e}");
    untouched(&target);
    assert_eq!(names(dir.path()), ["state.log", "victim.txt"]);
    // A link to nothing is not created through either.
    let dangling = dir.path().join("dangling.log");
    std::os::unix::fs::symlink(dir.path().join("made.log"), &dangling).unwrap();
    let e = FileStore::open(&dangling, TTL, 1 << 20).unwrap_err();
    assert!(e.to_string().contains("is a symbolic link"), "{e}");
    assert!(!dir.path().join("made.log").exists());
}

/// `state.log -> /dev/null` to switch the store off: refused, with how to
/// switch it off. A FIFO stands in for /dev/null (whose mode a failing
/// test run as root would change for the whole machine); made with
/// `mkfifo(3)`, not the command: a fork would hold the other tests'
/// store files, and their locks, open until its exec.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
#[tokio::test]
#[allow(unsafe_code)]
async fn a_link_to_a_device_is_refused_with_how_to_switch_the_store_off() {
    use std::os::unix::ffi::OsStrExt;
    let dir = tempfile::tempdir().unwrap();
    let fifo = dir.path().join("null");
    let name = std::ffi::CString::new(fifo.as_os_str().as_bytes()).unwrap();
    // SAFETY: a NUL-terminated path that outlives the call.
    assert_eq!(unsafe { libc::mkfifo(name.as_ptr(), 0o600) }, 0);
    std::fs::set_permissions(&fifo, std::fs::Permissions::from_mode(0o666)).unwrap();
    let path = dir.path().join("state.log");
    std::os::unix::fs::symlink(&fifo, &path).unwrap();
    let e = FileStore::open(&path, TTL, 1 << 20).unwrap_err();
    let text = e.to_string();
    assert!(text.contains("symbolic link"), "{text}");
    assert!(text.contains("backend = \"memory\""), "{text}");
    assert_eq!(mode(&fifo), 0o666, "not chmodded");
    // The FIFO named directly: not a regular file, refused as well.
    let e = FileStore::open(&fifo, TTL, 1 << 20).unwrap_err();
    assert!(e.to_string().contains("not a regular file (a FIFO)"), "{e}");
    assert_eq!(mode(&fifo), 0o666);
}

#[tokio::test]
async fn someone_elses_file_at_the_path_is_refused_and_left_untouched() {
    let dir = tempfile::tempdir().unwrap();
    let path = victim(dir.path());
    let e = FileStore::open(&path, TTL, 1 << 20).unwrap_err();
    assert!(e.to_string().contains("not a compactor state file"), "{e}");
    untouched(&path);
    assert_eq!(names(dir.path()), ["victim.txt"], "nothing moved aside");
    // Shorter than a header, too.
    std::fs::write(&path, b"hi").unwrap();
    let e = FileStore::open(&path, TTL, 1 << 20).unwrap_err();
    assert!(e.to_string().contains("not a compactor state file"), "{e}");
    assert_eq!(std::fs::read(&path).unwrap(), b"hi");
}

#[tokio::test]
async fn a_link_planted_as_the_temporary_file_is_not_written_through() {
    let dir = tempfile::tempdir().unwrap();
    let target = victim(dir.path());
    let path = dir.path().join("state.log");
    let s = FileStore::open(&path, TTL, 1 << 20).unwrap();
    for h in 0..20u128 {
        s.put(1, rec(2, h % 3, &"p".repeat(5000))).await.unwrap();
    }
    std::os::unix::fs::symlink(&target, disk::temp_path(&path)).unwrap();
    rewrite::now(&s.inner).unwrap();
    untouched(&target);
    assert!(!disk::temp_path(&path).exists(), "the link removed");
    assert!(std::fs::symlink_metadata(&path).unwrap().is_file());
    for h in 0..3u128 {
        assert!(s.find(1, &[0, h]).await.unwrap().is_some());
    }
    // Planted while no store runs: the same at open.
    drop(s);
    std::os::unix::fs::symlink(&target, disk::temp_path(&path)).unwrap();
    let s = FileStore::open(&path, TTL, 1 << 20).unwrap();
    rewrite::now(&s.inner).unwrap();
    untouched(&target);
    assert_eq!(s.len(), 3);
}

#[tokio::test]
async fn the_files_mode_is_set_on_the_file_itself() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("state.log");
    drop(FileStore::open(&path, TTL, 1 << 20).unwrap());
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
    drop(FileStore::open(&path, TTL, 1 << 20).unwrap());
    assert_eq!(mode(&path), 0o600);
}
