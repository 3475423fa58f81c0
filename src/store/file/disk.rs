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
    /// A symbolic link is at the path: never followed, so that a link
    /// planted there cannot turn the store's chmod, writes and renames on
    /// another file.
    #[error(
        "store file {path} is a symbolic link; the store does not follow links \
         (name the file itself in [store] path; to run without a store file set \
         [store] backend = \"memory\" or COMPACTOR_STORE_BACKEND=memory)"
    )]
    Symlink { path: PathBuf },
    /// Something other than a regular file is at the path (a directory, a
    /// device, a FIFO).
    #[error(
        "store file {path} is not a regular file ({kind}); left untouched \
         (to run without a store file set [store] backend = \"memory\" or \
         COMPACTOR_STORE_BACKEND=memory)"
    )]
    NotAFile { path: PathBuf, kind: &'static str },
    /// A file that is not compactor's (nor a store compactor wrote before)
    /// is at the path: someone else's data, left as it is.
    #[error(
        "store file {path} is not a compactor state file ({reason}); left untouched \
         (name another path in [store] path, or move the file away)"
    )]
    NotOurs { path: PathBuf, reason: String },
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
///
/// Only a regular file is opened, never through a link: the path is
/// checked before (`lstat`), opened with `O_NOFOLLOW` (where `libc` is
/// at hand; the checks stand in elsewhere) and the handle checked after
/// (`fstat`). Its mode is left to [`own`], once the file is known to be
/// the store's.
pub(super) fn open_locked(path: &Path) -> Result<File, OpenError> {
    for _ in 0..8 {
        check_path(path)?;
        let file = match open_rw(path) {
            Ok(f) => f,
            // Replaced by a link since the check (O_NOFOLLOW: ELOOP).
            Err(_) if is_symlink(path) => {
                return Err(OpenError::Symlink {
                    path: path.to_owned(),
                })
            }
            Err(e) => return Err(OpenError::io(path, "open")(e)),
        };
        let meta = file.metadata().map_err(OpenError::io(path, "stat"))?;
        if !meta.is_file() {
            return Err(not_a_file(path, &meta));
        }
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

/// Makes the store's file owner-only (on the handle: `fchmod`, never a
/// path that could have become a link). Only for a file that is the
/// store's: someone else's file keeps its mode.
pub(super) fn own(path: &Path, file: &File) -> Result<(), OpenError> {
    file.set_permissions(std::fs::Permissions::from_mode(0o600))
        .map_err(OpenError::io(path, "chmod"))
}

/// `O_NOFOLLOW`: opening a symbolic link fails instead of opening its
/// target.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
const NOFOLLOW: i32 = libc::O_NOFOLLOW;
#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
const NOFOLLOW: i32 = 0;

/// What is at `path` may be opened: nothing yet, or a regular file.
fn check_path(path: &Path) -> Result<(), OpenError> {
    match std::fs::symlink_metadata(path) {
        Ok(m) if m.file_type().is_symlink() => Err(OpenError::Symlink {
            path: path.to_owned(),
        }),
        Ok(m) if !m.is_file() => Err(not_a_file(path, &m)),
        Ok(_) => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(OpenError::io(path, "stat")(e)),
    }
}

fn is_symlink(path: &Path) -> bool {
    std::fs::symlink_metadata(path).is_ok_and(|m| m.file_type().is_symlink())
}

fn not_a_file(path: &Path, m: &std::fs::Metadata) -> OpenError {
    use std::os::unix::fs::FileTypeExt;
    let t = m.file_type();
    let kind = if t.is_dir() {
        "a directory"
    } else if t.is_char_device() || t.is_block_device() {
        "a device"
    } else if t.is_fifo() {
        "a FIFO"
    } else if t.is_socket() {
        "a socket"
    } else {
        "not a regular file"
    };
    OpenError::NotAFile {
        path: path.to_owned(),
        kind,
    }
}

fn open_rw(path: &Path) -> io::Result<File> {
    OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o600)
        .custom_flags(NOFOLLOW)
        .open(path)
}

/// Whether `file` is what `path` names (the name itself, not a link's
/// target).
fn same_file(file: &File, path: &Path) -> io::Result<bool> {
    let (open, named) = (file.metadata()?, std::fs::symlink_metadata(path)?);
    Ok(open.dev() == named.dev() && open.ino() == named.ino())
}

/// The rewrite's temporary file beside `path`: `<name>.compact`.
pub(super) fn temp_path(path: &Path) -> PathBuf {
    let mut name = path.file_name().unwrap_or_default().to_owned();
    name.push(".compact");
    path.with_file_name(name)
}

/// Creates the temporary file, locked before anything can see it (it is
/// renamed over the path, and the path's file is always locked). Made new
/// (`O_EXCL`, `O_NOFOLLOW`): a link planted under its name is never
/// written through; [`remove_stale_temp`] clears the name first.
pub(super) fn create_temp(path: &Path, ours: &File) -> io::Result<File> {
    remove_stale_temp(path, ours)?;
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(NOFOLLOW)
        .open(temp_path(path))?;
    file.try_lock().map_err(io::Error::from)?;
    Ok(file)
}

/// Clears the temporary file's name: a regular file owned by whoever owns
/// the store file (a rewrite that died with its process: the store file's
/// lock says none runs) or a symbolic link (unlinking a link leaves its
/// target alone) is removed; anything else is an error, left as it is.
pub(super) fn remove_stale_temp(path: &Path, ours: &File) -> io::Result<()> {
    let temp = temp_path(path);
    let m = match std::fs::symlink_metadata(&temp) {
        Ok(m) => m,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e),
    };
    if m.file_type().is_symlink() {
        tracing::warn!(backend = "file", path = %temp.display(),
            "a symbolic link had the store's temporary name: removed, not followed");
    } else if !(m.is_file() && m.uid() == ours.metadata()?.uid()) {
        return Err(io::Error::new(
            io::ErrorKind::AlreadyExists,
            format!(
                "{} exists and is not a temporary file of the store's; remove it",
                temp.display()
            ),
        ));
    }
    match std::fs::remove_file(&temp) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => Err(e),
        _ => Ok(()),
    }
}

/// Renames the temporary file `file` over `path`, once the temporary name
/// still names `file` (not a link put there since it was made).
pub(super) fn rename_temp(path: &Path, file: &File) -> io::Result<()> {
    let temp = temp_path(path);
    if !same_file(file, &temp)? {
        return Err(io::Error::other(format!(
            "{} was replaced while the store wrote it",
            temp.display()
        )));
    }
    std::fs::rename(temp, path)
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
