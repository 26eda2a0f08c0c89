//! Hashing chunks where they landed: BLAKE3 when they are fetched, CRC-32C at rest.

use std::sync::atomic::{AtomicU64, Ordering};

use crate::layout::Slice;
use crate::manifest::Digest;

/// BLAKE3 of `pieces` (`(slice, offset in it, length)`) in order, adding the bytes of host
/// memory the CPU copied out to hash them to `copied`.
pub(crate) fn blake3_of(
    pieces: &[(Slice, u64, u64)],
    copied: &AtomicU64,
) -> Result<Digest, String> {
    let mut h = blake3::Hasher::new();
    for (slice, at, n) in pieces {
        slice.blake3_update(&mut h, *at, *n)?;
        if slice.is_host() {
            copied.fetch_add(*n, Ordering::Relaxed);
        }
    }
    Ok(h.finalize().into())
}

/// CRC-32C of `pieces` (`(slice, offset in it, length)`) in order, adding the bytes of host
/// memory the CPU copied out to hash them to `copied` (none where it reads them in place).
pub(crate) fn crc_of(pieces: &[(Slice, u64, u64)], copied: &AtomicU64) -> Result<u32, String> {
    let mut crc = 0;
    for (slice, at, n) in pieces {
        let (c, cpu) = slice.crc_append(crc, *at, *n)?;
        crc = c;
        copied.fetch_add(cpu, Ordering::Relaxed);
    }
    Ok(crc)
}
