//! Opening the file: lock it, scan it, and decide.
//!
//! - A new or empty file gets a header.
//! - A clean file is used as it is; a torn tail (a write cut by a crash)
//!   is cut off first, which is no damage: logged at INFO.
//! - A damaged file (a frame that does not check, with good ones after
//!   it; a damaged header) keeps its name as `<name>.damaged-<UTC>` and a
//!   fresh file holding every entry that checked replaces it at the path:
//!   logged at WARN, counted by the caller.
//! - A compactor file that cannot be used (its header damaged and no
//!   entry that checks, a later format, the redb file of an earlier
//!   compactor) is kept aside the same way and a fresh file started.
//! - Any other file is someone else's: refused, left untouched.
//!
//! Then what expired while no process ran is dropped, and the file is
//! rewritten when that (or earlier garbage) left it mostly garbage.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::calls;
use super::disk::{self, OpenError};
use super::evict::{apply_sweep, plan_sweep};
use super::frame::{self, Header};
use super::index::Index;
use super::inner::{now_ms, Inner, Settings};
use super::rewrite;
use super::scan::{self, Scan};

/// What opening came to: the store's state, and where a damaged or
/// foreign file was kept.
pub(super) struct Opened {
    pub(super) inner: Arc<Inner>,
    pub(super) moved_aside: Option<PathBuf>,
}

/// What the scan makes of the file.
enum Verdict {
    Clean(u64),
    Damaged(u64),
    /// Ours, or a store compactor wrote before, but unusable: kept aside.
    Foreign(String),
    /// Nothing says compactor wrote it: someone else's file, refused and
    /// left untouched (moving it aside would put a fresh store where
    /// another program's data was).
    NotOurs(String),
}

fn new_secret() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    std::collections::hash_map::RandomState::new()
        .build_hasher()
        .finish()
}

fn verdict(scan: &Scan) -> Verdict {
    match scan.header {
        Some(Header::Ours { secret, .. }) if scan.damaged() => Verdict::Damaged(secret),
        Some(Header::Ours { secret, .. }) => Verdict::Clean(secret),
        Some(Header::Newer(v)) => Verdict::Foreign(format!("written by a later format ({v})")),
        // Our header damaged (or its magic), but entries check: ours.
        _ if scan.frames > 0 => Verdict::Damaged(new_secret()),
        Some(Header::Damaged) => Verdict::Foreign("header damaged, no entry checks".into()),
        _ if scan.redb => Verdict::Foreign("a redb file of an earlier compactor".into()),
        _ => Verdict::NotOurs("no compactor header and no entry that checks".into()),
    }
}

/// Opens the file at `path`. Blocking: at start-up, before serving.
pub(super) fn open(path: &Path, settings: Settings) -> Result<Opened, OpenError> {
    disk::make_dir(path).map_err(OpenError::io(path, "create directory"))?;
    let file = disk::open_locked(path)?;
    // A rewrite that died with its process; the lock says none runs.
    if let Err(e) = disk::remove_stale_temp(path, &file) {
        tracing::warn!(backend = "file", path = %path.display(), error = %e,
            "store's temporary file name taken; rewrites fail until it is free");
    }
    let len = file.metadata().map_err(OpenError::io(path, "stat"))?.len();
    let mut first = vec![0u8; usize::try_from(len.min(frame::HEADER_LEN as u64)).unwrap_or(0)];
    file.read_exact_at(&mut first, 0)
        .map_err(OpenError::io(path, "read"))?;
    if frame::is_header_start(&first) {
        return fresh(path, file, len, settings);
    }
    let scan = scan::scan(&file, len).map_err(OpenError::io(path, "read"))?;
    let (secret, aside) = match verdict(&scan) {
        Verdict::NotOurs(reason) => {
            return Err(OpenError::NotOurs {
                path: path.to_owned(),
                reason,
            })
        }
        Verdict::Clean(secret) => {
            cut_torn_tail(path, &file, &scan)?;
            (secret, None)
        }
        Verdict::Damaged(secret) => (
            secret,
            Some(Aside::Damaged {
                skipped: scan.skipped,
                undecodable: scan.undecodable,
                secret_kept: matches!(scan.header, Some(Header::Ours { .. })),
            }),
        ),
        Verdict::Foreign(why) => (new_secret(), Some(Aside::Foreign(why))),
    };
    disk::own(path, &file)?;
    let (index, end) = match aside {
        Some(Aside::Foreign(_)) => (Index::default(), len),
        _ => (scan.index, scan.end),
    };
    let inner = Arc::new(Inner::new(
        path.to_owned(),
        file,
        end,
        index,
        secret,
        settings,
    ));
    let moved_aside = match &aside {
        Some(why) => Some(keep_aside(&inner, why)?),
        None => None,
    };
    settle(&inner, aside.is_some()).map_err(OpenError::io(path, "rewrite"))?;
    Ok(Opened { inner, moved_aside })
}

/// A new file, or one cut while it was created: a header and nothing else.
fn fresh(path: &Path, file: File, len: u64, settings: Settings) -> Result<Opened, OpenError> {
    if len > 0 {
        tracing::info!(backend = "file", path = %path.display(), bytes = len,
            "store file was cut while it was created; starting it again");
    }
    disk::own(path, &file)?;
    let secret = new_secret();
    file.set_len(0).map_err(OpenError::io(path, "truncate"))?;
    file.write_all_at(&frame::header(secret), 0)
        .and_then(|()| file.sync_data())
        .and_then(|()| disk::sync_dir(path))
        .map_err(OpenError::io(path, "write"))?;
    let end = frame::HEADER_LEN as u64;
    let inner = Inner::new(
        path.to_owned(),
        file,
        end,
        Index::default(),
        secret,
        settings,
    );
    Ok(Opened {
        inner: Arc::new(inner),
        moved_aside: None,
    })
}

/// A torn tail is what a crash in the middle of a write leaves: cut off.
fn cut_torn_tail(path: &Path, file: &File, scan: &Scan) -> Result<(), OpenError> {
    if scan.torn == 0 {
        return Ok(());
    }
    file.set_len(scan.end)
        .and_then(|()| file.sync_data())
        .map_err(OpenError::io(path, "truncate"))?;
    tracing::info!(backend = "file", path = %path.display(), bytes = scan.torn,
        "store file ended in a partly written entry (normal after a crash): cut off");
    Ok(())
}

/// Why a file is kept aside.
enum Aside {
    Damaged {
        skipped: u64,
        undecodable: u64,
        /// The keyer secret was read (else a new one hashes credentials
        /// from now on, and no credential reaches the records kept).
        secret_kept: bool,
    },
    Foreign(String),
}

/// Keeps the damaged or foreign file as `<name>.damaged-<UTC>`; the
/// rewrite that follows puts a fresh file at the path.
fn keep_aside(inner: &Inner, why: &Aside) -> Result<PathBuf, OpenError> {
    let path = &inner.path;
    let aside = disk::keep_aside(path).map_err(OpenError::io(path, "move aside"))?;
    let (records, states) = {
        let shared = inner.shared();
        (shared.index.meta.len(), shared.index.states.len())
    };
    match why {
        Aside::Damaged {
            skipped,
            undecodable,
            secret_kept,
        } => tracing::warn!(backend = "file", path = %path.display(),
            moved_to = %aside.display(), skipped_bytes = skipped,
            undecodable_entries = undecodable, records_kept = records, states_kept = states,
            secret_kept = secret_kept,
            "store file damaged: moved aside, starting with a fresh one holding every entry that checks"),
        Aside::Foreign(reason) => tracing::warn!(backend = "file", path = %path.display(),
            moved_to = %aside.display(), reason = %reason,
            "store file is not a compactor state file: moved aside, starting with a fresh one"),
    }
    Ok(aside)
}

/// Drops what expired while no process ran, and rewrites the file when
/// `required` says so or garbage is more than an eighth of it.
///
/// A rewrite only for the garbage is optional: when it fails (a full
/// disk, most often) the file that checked whole is used as it is, the
/// running store tries again later, and what the rewrite would have
/// dropped is written as deletes where there is room. Failing the open
/// instead would serve from memory for the whole life of the process. A
/// required rewrite (the file at the path is the one kept aside) cannot be
/// skipped: appending would change the copy kept as evidence.
fn settle(inner: &Arc<Inner>, required: bool) -> std::io::Result<()> {
    let end = inner.writer().end;
    let mut shared = inner.shared();
    let plan = plan_sweep(&shared.index, now_ms(), inner.ttl_ms, inner.max_bytes);
    let index = &shared.index;
    let freed: u64 = plan
        .gone
        .iter()
        .filter_map(|k| index.meta.get(k).map(|m| m.at.len))
        .chain(
            plan.states
                .iter()
                .filter_map(|s| index.states.get(s).map(|m| m.at.len)),
        )
        .sum();
    let live = index.live().saturating_sub(freed);
    if !required && end.saturating_sub(live) <= (live / 8).max(64 << 10) {
        drop(shared);
        return calls::sweep(inner).map_err(std::io::Error::other);
    }
    apply_sweep(&mut shared.index, &plan);
    drop(shared);
    match rewrite::now(inner) {
        Ok(r) => {
            tracing::info!(backend = "file", path = %inner.path.display(), before = end,
                after = r.after, damaged_entries = r.dropped, millis = r.millis,
                "store file rewritten at open");
            Ok(())
        }
        Err(e) if !required => {
            rewrite::put_off(inner);
            tracing::warn!(backend = "file", path = %inner.path.display(), error = %e,
                bytes = end, live_bytes = live,
                "store file rewrite at open failed; using the file as it is, retried later");
            if let Err(e) = calls::write_sweep(inner, &plan) {
                tracing::debug!(backend = "file", error = %e,
                    "expired entries not written as deleted; dropped again at the next open");
            }
            Ok(())
        }
        Err(e) => Err(std::io::Error::other(e)),
    }
}
