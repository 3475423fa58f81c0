//! The file system side: the owner-only file and directory, the lock that
//! keeps a second process out, the rewrite's temporary file, renames
//! made durable, and a damaged file moved aside.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::time::SystemTime;

use crate::store::recover::damaged_name;

/// Why the state file could not be opened: nothing here says the file is
/// damaged (a damaged file is moved aside, not refused), so it is left
/// where it is and the store serves from memory.
#[derive(Debug, thiserror::Error)]
pub enum OpenError {
    /// Another process (or this one) holds the file.
    #[error("store file {path} in use by another process")]
    Busy { path: PathBuf },
    /// The file or its directory cannot be created, read or written.
    #[error("store file {path}: {op}: {source}")]
    Unavailable {
        path: PathBuf,
        op: &'static str,
        source: io::Error,
    },
}

impl OpenError {
    pub(super) fn io<'a>(path: &'a Path, op: &'static str) -> impl FnOnce(io::Error) -> Self + 'a {
        move |source| Self::Unavailable {
            path: path.to_owned(),
            op,
            source,
        }
    }
}

/// Creates the directory (0700) when missing.
pub(super) fn make_dir(path: &Path) -> io::Result<()> {
    match path.parent().filter(|d| !d.as_os_str().is_empty()) {
        Some(dir) if !dir.exists() => std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir),
        _ => Ok(()),
    }
}

/// Opens (or creates, 0600) the file at `path` and takes its lock. A
/// rewrite renames a new file over the path; a process that opened
/// the old one just before finds, once it holds the lock, that the path
/// names another file, and opens again.
pub(super) fn open_locked(path: &Path) -> Result<File, OpenError> {
    for _ in 0..8 {
        let file = open_rw(path, false).map_err(OpenError::io(path, "open"))?;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))
            .map_err(OpenError::io(path, "chmod"))?;
        match file.try_lock() {
            Ok(()) => {}
            Err(std::fs::TryLockError::WouldBlock) => {
                return Err(OpenError::Busy {
                    path: path.to_owned(),
                })
            }
            Err(std::fs::TryLockError::Error(e)) => return Err(OpenError::io(path, "lock")(e)),
        }
        if same_file(&file, path).map_err(OpenError::io(path, "stat"))? {
            return Ok(file);
        }
    }
    Err(OpenError::Busy {
        path: path.to_owned(),
    })
}

fn open_rw(path: &Path, truncate: bool) -> io::Result<File> {
    OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(truncate)
        .mode(0o600)
        .open(path)
}

fn same_file(file: &File, path: &Path) -> io::Result<bool> {
    let (open, named) = (file.metadata()?, std::fs::metadata(path)?);
    Ok(open.dev() == named.dev() && open.ino() == named.ino())
}

/// The rewrite's temporary file beside `path`: `<name>.compact`.
pub(super) fn temp_path(path: &Path) -> PathBuf {
    let mut name = path.file_name().unwrap_or_default().to_owned();
    name.push(".compact");
    path.with_file_name(name)
}

/// Creates the temporary file, locked before anything can see it (it is
/// renamed over the path, and the path's file is always locked).
pub(super) fn create_temp(path: &Path) -> io::Result<File> {
    let file = open_rw(&temp_path(path), true)?;
    file.try_lock().map_err(io::Error::from)?;
    Ok(file)
}

/// Makes a rename in the directory of `path` durable.
pub(super) fn sync_dir(path: &Path) -> io::Result<()> {
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    File::open(dir)?.sync_all()
}

/// Keeps the file at `path` as `<name>.damaged-<UTC>` (a second name for
/// the same file: the path is replaced by a rename afterwards, so there is
/// never a moment without a file at it). Falls back to a rename where the
/// file system has no hard links.
pub(super) fn keep_aside(path: &Path) -> io::Result<PathBuf> {
    let aside = damaged_name(path, SystemTime::now());
    if std::fs::hard_link(path, &aside).is_err() {
        std::fs::rename(path, &aside)?;
    }
    sync_dir(path)?;
    Ok(aside)
}
