//! Checksums of byte ranges: CRC-32C (Castagnoli), computed with the CPU's CRC instruction
//! where there is one (SSE 4.2 on x86-64, the CRC extension on aarch64; detected at run time by
//! the `crc32c` crate, with a table-driven fallback elsewhere).
//!
//! One function family serves every side: the data plane's checksum request (a peer hashes a
//! range of one of its segments, [`OpKind::Checksum`](crate::OpKind::Checksum)), and the
//! broadcast manifest's per-chunk checksums. `cargo bench -p ferry-engine-core --bench checksum`
//! measures the rate; `docs/broadcast.md` quotes it against the link rate.

use std::io;
use std::sync::Arc;

use crate::memory::{MemoryRegion, OutOfBounds};
use crate::transport::FileSource;

pub use crate::op::CHECKSUM_LEN;

/// Bytes hashed per piece when the source must be copied out (files, registered memory).
const PIECE: usize = 256 << 10;

/// The CRC-32C of `bytes`.
pub fn crc32c(bytes: &[u8]) -> u32 {
    ::crc32c::crc32c(bytes)
}

/// Extends `crc` (the CRC-32C of earlier bytes) with `bytes`.
pub fn crc32c_append(crc: u32, bytes: &[u8]) -> u32 {
    ::crc32c::crc32c_append(crc, bytes)
}

/// The CRC-32C of `region[offset..offset + len]`, copied out piece by piece (no reference into
/// registered memory is formed, so a concurrent transfer into the range cannot be undefined
/// behaviour; it only makes the value meaningless).
pub fn crc32c_region(region: &MemoryRegion, offset: u64, len: u64) -> Result<u32, OutOfBounds> {
    region.check(offset, len)?;
    let mut buf = vec![0u8; PIECE.min(len as usize)];
    let mut crc = 0;
    let mut done = 0u64;
    while done < len {
        let n = (len - done).min(PIECE as u64) as usize;
        region.read_at(offset + done, &mut buf[..n])?;
        crc = crc32c_append(crc, &buf[..n]);
        done += n as u64;
    }
    Ok(crc)
}

/// The CRC-32C of a range of a region, computed one piece ([`RegionCrc::PIECE`] bytes) per
/// [`step`](Self::step), so that a driver that serves other streams on the same thread can let
/// them run between the pieces of a long range. Bytes are copied out as in [`crc32c_region`].
#[derive(Debug)]
pub struct RegionCrc {
    region: Arc<MemoryRegion>,
    at: u64,
    left: u64,
    crc: u32,
    buf: Vec<u8>,
}

impl RegionCrc {
    /// Bytes hashed per step.
    pub const PIECE: usize = PIECE;

    /// A checksum of `region[at..at + len]`, checked against the region now.
    pub fn new(region: Arc<MemoryRegion>, at: u64, len: u64) -> Result<Self, OutOfBounds> {
        region.check(at, len)?;
        Ok(Self {
            region,
            at,
            left: len,
            crc: 0,
            buf: Vec::new(),
        })
    }

    /// Bytes not hashed yet (the whole range before the first step).
    pub fn remaining(&self) -> u64 {
        self.left
    }

    /// Hashes the next piece; the checksum once the whole range is hashed (then again on each
    /// call).
    pub fn step(&mut self) -> Option<u32> {
        if self.left == 0 {
            self.buf = Vec::new();
            return Some(self.crc);
        }
        let n = self.left.min(PIECE as u64) as usize;
        if self.buf.len() < n {
            self.buf.resize(n, 0);
        }
        // Checked against the region in `new`; the region does not shrink.
        if self.region.read_at(self.at, &mut self.buf[..n]).is_err() {
            self.left = 0;
            return Some(self.crc);
        }
        self.crc = crc32c_append(self.crc, &self.buf[..n]);
        self.at += n as u64;
        self.left -= n as u64;
        None
    }

    /// Hashes the rest at once.
    pub fn finish(mut self) -> u32 {
        loop {
            if let Some(crc) = self.step() {
                return crc;
            }
        }
    }
}

/// The CRC-32C of `len` bytes of `file` from `at` (positioned reads: blocking).
pub fn crc32c_file(file: &dyn FileSource, at: u64, len: u64) -> io::Result<u32> {
    let mut buf = vec![0u8; PIECE.min(len as usize)];
    let mut crc = 0;
    let mut done = 0u64;
    while done < len {
        let n = (len - done).min(PIECE as u64) as usize;
        file.read_exact_at(at + done, &mut buf[..n])?;
        crc = crc32c_append(crc, &buf[..n]);
        done += n as u64;
    }
    Ok(crc)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The check value of CRC-32C (RFC 3720 B.4) and the piecewise paths agree with one call.
    #[test]
    fn known_value_and_pieces_agree() {
        assert_eq!(crc32c(b"123456789"), 0xe306_9283);
        assert_eq!(crc32c(&[]), 0);
        let data: Vec<u8> = (0..(PIECE * 2 + 17)).map(|i| (i * 7 + 3) as u8).collect();
        let whole = crc32c(&data);
        let region = MemoryRegion::from_vec(data.clone());
        assert_eq!(crc32c_region(&region, 0, data.len() as u64), Ok(whole));
        assert_eq!(crc32c_region(&region, 5, 100), Ok(crc32c(&data[5..105])));
        assert!(crc32c_region(&region, 1, data.len() as u64).is_err());
        let split = crc32c_append(crc32c(&data[..1000]), &data[1000..]);
        assert_eq!(split, whole);
        let region = Arc::new(region);
        let mut steps = RegionCrc::new(region.clone(), 0, data.len() as u64).unwrap();
        let mut n = 1;
        let stepped = loop {
            match steps.step() {
                Some(crc) => break crc,
                None => n += 1,
            }
        };
        assert_eq!((stepped, n), (whole, 4), "three pieces, then the sum");
        assert_eq!(steps.step(), Some(whole));
        let part = RegionCrc::new(region.clone(), 5, 100).unwrap().finish();
        assert_eq!(part, crc32c(&data[5..105]));
        assert_eq!(RegionCrc::new(region.clone(), 0, 0).unwrap().finish(), 0);
        assert!(RegionCrc::new(region, 1, data.len() as u64).is_err());
    }
}
