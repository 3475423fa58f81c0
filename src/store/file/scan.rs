//! The scan at open: every frame from the start is checked and applied to
//! a new index, in file order (a later put replaces, a delete removes).
//!
//! Where a frame does not check, the scan looks forward for the next
//! [`SYNC`] whose frame does and goes on from there, counting the bytes it
//! skipped. Bad bytes with no good frame after them are a torn tail: the
//! last write of a process that died in it.

use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;

use super::entry::{self, Entry};
use super::frame::{self, Header, HEADER_LEN, SYNC};
use super::index::{Index, Loc, Meta, StateMeta};

/// What the scan found.
#[derive(Debug, Default)]
pub(super) struct Scan {
    pub(super) index: Index,
    pub(super) header: Option<Header>,
    /// End of the last good frame (or of the header).
    pub(super) end: u64,
    /// Good frames read.
    pub(super) frames: u64,
    /// Bytes skipped between good frames.
    pub(super) skipped: u64,
    /// Frames that checked but did not decode.
    pub(super) undecodable: u64,
    /// Bytes after the last good frame.
    pub(super) torn: u64,
    /// The file starts as a redb file does (the file backend's format
    /// before this one).
    pub(super) redb: bool,
}

impl Scan {
    /// Whether anything but a torn tail was wrong.
    pub(super) fn damaged(&self) -> bool {
        self.skipped > 0
            || self.undecodable > 0
            || matches!(
                self.header,
                Some(Header::Damaged | Header::Ours { repaired: true, .. })
            )
    }
}

/// Reads a file through one buffer, by position.
struct Reader<'a> {
    file: &'a File,
    len: u64,
    buf: Vec<u8>,
    /// File offset of `buf[0]`.
    start: u64,
}

/// Where format 1's entries start.
const V1_HEADER_LEN: u64 = 32;

/// Bytes read at once when the scan moves on.
const CHUNK: usize = 1 << 20;

impl Reader<'_> {
    /// The file's bytes `at..at + n`, `None` past its end.
    fn get(&mut self, at: u64, n: u64) -> io::Result<Option<&[u8]>> {
        let Some(stop) = at.checked_add(n).filter(|s| *s <= self.len) else {
            return Ok(None);
        };
        let stop_in_buf = self.start + self.buf.len() as u64;
        if at < self.start || stop > stop_in_buf {
            let want = (stop - at).max(CHUNK as u64).min(self.len - at);
            // `want` is at most the file's length, which a file on disk
            // holds: a damaged length cannot ask for more.
            self.buf
                .resize(usize::try_from(want).map_err(io::Error::other)?, 0);
            self.file.read_exact_at(&mut self.buf, at)?;
            self.start = at;
        }
        let from = usize::try_from(at - self.start).map_err(io::Error::other)?;
        let to = usize::try_from(stop - self.start).map_err(io::Error::other)?;
        Ok(self.buf.get(from..to))
    }

    /// The whole frame at `at`, if one checks there.
    fn frame(&mut self, at: u64) -> io::Result<Option<(frame::Kind, Vec<u8>)>> {
        let Some(head) = self.get(at, frame::HEAD as u64)? else {
            return Ok(None);
        };
        let Some((_, len)) = frame::head(head) else {
            return Ok(None);
        };
        let Some(bytes) = self.get(at, len)? else {
            return Ok(None);
        };
        Ok(frame::open(bytes).map(|(kind, payload)| (kind, payload.to_vec())))
    }

    /// The next offset after `from` where a frame checks.
    fn resync(&mut self, from: u64) -> io::Result<Option<u64>> {
        let finder = memchr::memmem::Finder::new(&SYNC);
        let mut pos = from;
        while pos < self.len {
            let n = (self.len - pos).min(CHUNK as u64);
            let Some(window) = self.get(pos, n)? else {
                return Ok(None);
            };
            let hits: Vec<u64> = finder.find_iter(window).map(|i| pos + i as u64).collect();
            for at in hits {
                if self.frame(at)?.is_some() {
                    return Ok(Some(at));
                }
            }
            // A SYNC cut by the window's end is found by the next window.
            pos += n.saturating_sub(SYNC.len() as u64 - 1).max(1);
        }
        Ok(None)
    }
}

/// Scans the `len` bytes of `file`.
pub(super) fn scan(file: &File, len: u64) -> io::Result<Scan> {
    let mut r = Reader {
        file,
        len,
        buf: Vec::new(),
        start: 0,
    };
    let header = r
        .get(0, len.min(HEADER_LEN as u64))?
        .map(frame::read_header);
    // Where entries start; a file without a header that checks is read
    // from where format 1's entries started, its frames found by resync.
    let start = match header {
        Some(Header::Ours { len, .. }) => len,
        _ => V1_HEADER_LEN,
    };
    let mut s = Scan {
        header,
        end: start,
        redb: r.get(0, frame::REDB_MAGIC.len() as u64)? == Some(&frame::REDB_MAGIC[..]),
        ..Scan::default()
    };
    let mut at = start;
    while at < len {
        let found = match r.frame(at)? {
            Some(f) => Some((at, f)),
            None => match r.resync(at + 1)? {
                Some(next) => {
                    s.skipped += next - at;
                    r.frame(next)?.map(|f| (next, f))
                }
                None => None,
            },
        };
        let Some((start, (kind, payload))) = found else {
            break;
        };
        let loc = Loc {
            offset: start,
            len: (payload.len() + frame::OVERHEAD) as u64,
        };
        match entry::parse(kind, &payload) {
            Some(e) => apply(&mut s.index, e, loc),
            None => s.undecodable += 1,
        }
        s.frames += 1;
        at = start + loc.len;
        s.end = at;
    }
    s.torn = len.saturating_sub(s.end);
    Ok(s)
}

fn apply(index: &mut Index, e: Entry, at: Loc) {
    match e {
        Entry::Record {
            key,
            touched,
            k,
            size,
        } => index.add(
            key,
            Meta {
                k,
                size,
                touched,
                dirty: false,
                at,
            },
        ),
        Entry::RecordDeletes(keys) => {
            for k in &keys {
                index.remove(k);
            }
        }
        Entry::Touches(uses) => {
            for (k, when) in uses {
                if let Some(at) = index.meta.get(&k).map(|m| m.touched.max(when)) {
                    index.set_touched(&k, at);
                }
            }
        }
        Entry::Window {
            upstream,
            model,
            tokens,
        } => index.set_window(upstream, model, tokens),
        Entry::State { session, written } => index.put_state(session, StateMeta { written, at }),
        Entry::StateDeletes(sessions) => {
            for s in sessions {
                index.remove_state(s);
            }
        }
    }
}
