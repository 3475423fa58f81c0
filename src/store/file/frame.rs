//! The bytes of the log: a header, then frames, nothing else.
//!
//! Header, 64 bytes: two copies of the same 32, each [`MAGIC`], the format
//! version (u32 LE), 4 zero bytes, the keyer secret (u64 LE), and the
//! xxh3-64 of those 24 bytes. The secret hashes every credential: with
//! one copy, one flipped bit lost it and made every record unreachable;
//! with two, a damaged copy is told by its checksum and the other used.
//! Format 1 (a single copy, entries from byte 32) is still read; a
//! rewrite writes format 2.
//!
//! Frame: [`SYNC`], the payload length (u32 LE), the kind (u8), 3 zero
//! bytes, a head check (u32 LE: the low half of the xxh3-64 of the 12
//! bytes before it), the payload, and the xxh3-64 of everything before it
//! (u64 LE). The head has a check of its own because a scan that lost its
//! place tests every [`SYNC`] it meets: a false one is rejected from its
//! 16 bytes, without reading the length it claims. [`SYNC`] starts with
//! 0xF7, a byte no UTF-8 text holds, so record texts never carry one.
//!
//! Everything here takes untrusted bytes: no function panics on any input.

use xxhash_rust::xxh3::xxh3_64;

/// Bytes of the file header this code writes (format 2).
pub(super) const HEADER_LEN: usize = 2 * COPY_LEN;
/// Bytes of one copy of the header (format 1's whole header).
const COPY_LEN: usize = 32;
/// Bytes in front of a payload.
pub(super) const HEAD: usize = 16;
/// Bytes after a payload (its checksum).
const SUM: usize = 8;
/// A frame's bytes beyond its payload.
pub(super) const OVERHEAD: usize = HEAD + SUM;
/// The first bytes of every compactor state file (a non-ASCII first byte,
/// as PNG does, so a file mangled as text does not pass).
const MAGIC: [u8; 8] = *b"\x89CMPLOG\n";
/// The first bytes of a redb file: the file backend's format before this
/// one, still recognised so that it is kept aside, not refused.
pub(super) const REDB_MAGIC: [u8; 9] = *b"redb\x1a\x0a\xa9\x0d\x0a";
/// The format this code writes.
const VERSION: u32 = 2;
/// The format before: one copy of the header.
const VERSION_1: u32 = 1;
/// The first bytes of every frame.
pub(super) const SYNC: [u8; 4] = [0xF7, b'c', b'm', b'p'];

/// What a frame holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Kind {
    /// A record put (its key, last use, figures and texts).
    RecordPut = 1,
    /// Records dropped (keys).
    RecordDelete = 2,
    /// Last uses of records (key, unix ms).
    Touches = 3,
    /// A learned context window.
    Window = 4,
    /// A conversation state put.
    StatePut = 5,
    /// Conversation states dropped (session keys).
    StateDelete = 6,
}

impl Kind {
    fn from_u8(b: u8) -> Option<Self> {
        Some(match b {
            1 => Self::RecordPut,
            2 => Self::RecordDelete,
            3 => Self::Touches,
            4 => Self::Window,
            5 => Self::StatePut,
            6 => Self::StateDelete,
            _ => return None,
        })
    }
}

/// A payload longer than a frame can say (4 GiB).
#[derive(Debug, thiserror::Error)]
#[error("entry of {0} bytes is longer than a frame can hold")]
pub(super) struct TooLong(pub(super) usize);

/// What the first bytes of a file say it is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Header {
    /// A compactor state file this code reads.
    Ours {
        /// The keyer secret.
        secret: u64,
        /// Bytes of the header: where the entries start.
        len: u64,
        /// One copy of the header was damaged and the other one used.
        repaired: bool,
    },
    /// A compactor state file of a later format.
    Newer(u32),
    /// The magic is there but no copy checks.
    Damaged,
    /// Not a compactor state file (or its magic is damaged).
    Foreign,
}

/// One copy of the header of format `version` holding `secret`.
fn copy(version: u32, secret: u64) -> [u8; COPY_LEN] {
    let mut h = [0u8; COPY_LEN];
    h[..8].copy_from_slice(&MAGIC);
    h[8..12].copy_from_slice(&version.to_le_bytes());
    h[16..24].copy_from_slice(&secret.to_le_bytes());
    let sum = xxh3_64(&h[..24]);
    h[24..].copy_from_slice(&sum.to_le_bytes());
    h
}

/// The header of a file holding `secret`.
pub(super) fn header(secret: u64) -> [u8; HEADER_LEN] {
    let one = copy(VERSION, secret);
    let mut h = [0u8; HEADER_LEN];
    h[..COPY_LEN].copy_from_slice(&one);
    h[COPY_LEN..].copy_from_slice(&one);
    h
}

/// A format 1 header, as files written before format 2 start.
#[cfg(test)]
pub(super) fn header_v1(secret: u64) -> [u8; COPY_LEN] {
    copy(VERSION_1, secret)
}

/// The version and secret of a copy whose magic and checksum hold.
fn read_copy(bytes: &[u8]) -> Option<(u32, u64)> {
    let h = bytes.get(..COPY_LEN)?;
    if h.get(..8)? != MAGIC || le_u64(h, 24)? != xxh3_64(h.get(..24)?) {
        return None;
    }
    Some((le_u32(h, 8)?, le_u64(h, 16)?))
}

/// Reads a header from the first bytes of a file (up to [`HEADER_LEN`]).
pub(super) fn read_header(bytes: &[u8]) -> Header {
    let second = || bytes.get(COPY_LEN..).and_then(read_copy);
    let ours = |secret, repaired| Header::Ours {
        secret,
        len: HEADER_LEN as u64,
        repaired,
    };
    match (read_copy(bytes), second()) {
        (Some((VERSION_1, secret)), _) => Header::Ours {
            secret,
            len: COPY_LEN as u64,
            repaired: false,
        },
        (Some((VERSION, secret)), b) => ours(secret, b != Some((VERSION, secret))),
        (Some((v, _)), _) | (None, Some((v, _))) if v > VERSION => Header::Newer(v),
        (None, Some((VERSION, secret))) => ours(secret, true),
        _ if bytes.get(..8) == Some(&MAGIC[..]) => Header::Damaged,
        _ => Header::Foreign,
    }
}

/// Whether `bytes` (the first [`HEADER_LEN`] of a file, or all of a
/// shorter one) are how a header being written starts: a file cut while it
/// was created, holding nothing yet. A whole format 1 header is a file.
pub(super) fn is_header_start(bytes: &[u8]) -> bool {
    bytes.len() < HEADER_LEN
        && MAGIC.starts_with(bytes.get(..8.min(bytes.len())).unwrap_or(&[]))
        && !matches!(read_copy(bytes), Some((VERSION_1, _)))
}

/// Appends one frame of `kind` whose payload `fill` writes. The frame is
/// not appended when its payload is too long.
pub(super) fn push(
    out: &mut Vec<u8>,
    kind: Kind,
    fill: impl FnOnce(&mut Vec<u8>),
) -> Result<(), TooLong> {
    let start = out.len();
    out.extend_from_slice(&[0; HEAD]);
    fill(out);
    let len = out.len() - start - HEAD;
    let Ok(len32) = u32::try_from(len) else {
        out.truncate(start);
        return Err(TooLong(len));
    };
    let head = &mut out[start..start + HEAD];
    head[..4].copy_from_slice(&SYNC);
    head[4..8].copy_from_slice(&len32.to_le_bytes());
    head[8] = kind as u8;
    let check = xxh3_64(&head[..12]) as u32;
    head[12..16].copy_from_slice(&check.to_le_bytes());
    let sum = xxh3_64(&out[start..]);
    out.extend_from_slice(&sum.to_le_bytes());
    Ok(())
}

/// The kind and the whole frame's length that a frame head claims, when
/// `bytes` start with a frame head.
pub(super) fn head(bytes: &[u8]) -> Option<(Kind, u64)> {
    let h = bytes.get(..HEAD)?;
    if h.get(..4)? != SYNC || h.get(9..12)? != [0, 0, 0] {
        return None;
    }
    if le_u32(h, 12)? != xxh3_64(h.get(..12)?) as u32 {
        return None;
    }
    let kind = Kind::from_u8(*h.get(8)?)?;
    Some((kind, u64::from(le_u32(h, 4)?) + OVERHEAD as u64))
}

/// The kind and payload of a whole frame whose checksums hold.
pub(super) fn open(frame: &[u8]) -> Option<(Kind, &[u8])> {
    let (kind, len) = head(frame)?;
    if u64::try_from(frame.len()).ok()? != len {
        return None;
    }
    let end = frame.len().checked_sub(SUM)?;
    if le_u64(frame, end)? != xxh3_64(frame.get(..end)?) {
        return None;
    }
    Some((kind, frame.get(HEAD..end)?))
}

/// The payload of a frame, to change in place before [`reseal`].
pub(super) fn payload_mut(frame: &mut [u8]) -> Option<&mut [u8]> {
    let end = frame.len().checked_sub(SUM)?;
    frame.get_mut(HEAD..end)
}

/// Recomputes the checksum of a frame whose payload was changed in place.
pub(super) fn reseal(frame: &mut [u8]) {
    let Some(end) = frame.len().checked_sub(SUM) else {
        return;
    };
    let sum = xxh3_64(&frame[..end]);
    frame[end..].copy_from_slice(&sum.to_le_bytes());
}

fn le_u32(b: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_le_bytes(b.get(at..at + 4)?.try_into().ok()?))
}

fn le_u64(b: &[u8], at: usize) -> Option<u64> {
    Some(u64::from_le_bytes(b.get(at..at + 8)?.try_into().ok()?))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn one(kind: Kind, payload: &[u8]) -> Vec<u8> {
        let mut out = Vec::new();
        push(&mut out, kind, |o| o.extend_from_slice(payload)).unwrap();
        out
    }

    #[test]
    fn a_frame_reads_back_and_any_changed_byte_is_refused() {
        let f = one(Kind::Window, b"payload");
        assert_eq!(f.len(), b"payload".len() + OVERHEAD);
        assert_eq!(open(&f), Some((Kind::Window, &b"payload"[..])));
        for i in 0..f.len() {
            for bit in 0..8 {
                let mut bad = f.clone();
                bad[i] ^= 1 << bit;
                assert_eq!(open(&bad), None, "byte {i} bit {bit}");
            }
        }
        assert_eq!(open(&f[..f.len() - 1]), None);
        assert_eq!(open(&[]), None);
    }

    #[test]
    fn a_resealed_frame_checks_again() {
        let mut f = one(Kind::RecordPut, &[1, 2, 3]);
        payload_mut(&mut f).unwrap()[1] = 9;
        assert_eq!(open(&f), None);
        reseal(&mut f);
        assert_eq!(open(&f), Some((Kind::RecordPut, &[1, 9, 3][..])));
    }

    #[test]
    fn headers_are_told_apart() {
        let h = header(42);
        let ours = |repaired| Header::Ours {
            secret: 42,
            len: 64,
            repaired,
        };
        assert_eq!(read_header(&h), ours(false));
        let mut newer = copy(3, 42).to_vec();
        newer.extend_from_slice(&copy(3, 42));
        assert_eq!(read_header(&newer), Header::Newer(3));
        assert_eq!(read_header(b"redb\x1a\x0a\xa9\x0d\x0a"), Header::Foreign);
        assert_eq!(read_header(&[0; 64]), Header::Foreign);
        let mut both = h;
        both[17] ^= 1;
        both[49] ^= 1;
        assert_eq!(read_header(&both), Header::Damaged);
        let v1 = header_v1(42);
        let v1_ours = Header::Ours {
            secret: 42,
            len: 32,
            repaired: false,
        };
        assert_eq!(read_header(&v1), v1_ours);
        assert!(is_header_start(&h[..5]) && is_header_start(&[]) && is_header_start(&h[..40]));
        assert!(!is_header_start(b"redb") && !is_header_start(&h) && !is_header_start(&v1));
    }

    #[test]
    fn any_one_flipped_bit_of_a_header_keeps_its_secret() {
        let h = header(0x005E_C2E7);
        for bit in 0..HEADER_LEN * 8 {
            let mut bad = h;
            bad[bit / 8] ^= 1 << (bit % 8);
            let expect = Header::Ours {
                secret: 0x005E_C2E7,
                len: 64,
                repaired: true,
            };
            assert_eq!(read_header(&bad), expect, "bit {bit}");
        }
    }
}
