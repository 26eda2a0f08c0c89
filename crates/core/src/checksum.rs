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

/// The CRC-32C of `region[offset..offset + len]`, read where it lies where the CPU can
/// ([`MemoryRegion::crc32c_in_place`]), else copied out piece by piece. No reference into
/// registered memory is formed either way, so a concurrent transfer into the range cannot be
/// undefined behaviour; it only makes the value meaningless. A device region is out of bounds.
pub fn crc32c_region(region: &MemoryRegion, offset: u64, len: u64) -> Result<u32, OutOfBounds> {
    region.check(offset, len)?;
    if let Some(crc) = region.crc32c_in_place(0, offset, len)? {
        return Ok(crc);
    }
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
/// them run between the pieces of a long range. Bytes are read as in [`crc32c_region`] (in
/// place where the CPU can).
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
        // Checked against the region in `new`; the region does not shrink.
        match self.region.crc32c_in_place(self.crc, self.at, n as u64) {
            Ok(Some(crc)) => {
                self.crc = crc;
                self.at += n as u64;
                self.left -= n as u64;
                return None;
            }
            Ok(None) => {}
            Err(_) => {
                self.left = 0;
                return Some(self.crc);
            }
        }
        if self.buf.len() < n {
            self.buf.resize(n, 0);
        }
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
    let mut range = FileRange::new(at, len);
    loop {
        if let Some(crc) = range.step(file)? {
            return Ok(crc);
        }
    }
}

/// The CRC-32C of a range of a file, computed one piece ([`FileCrc::PIECE`] bytes, one
/// positioned read) per [`step`](Self::step), so that a driver that serves other streams on the
/// same thread can let them run between the pieces of a long range.
#[derive(Debug)]
pub struct FileCrc {
    file: Arc<dyn FileSource>,
    range: FileRange,
}

impl FileCrc {
    /// Bytes hashed per step.
    pub const PIECE: usize = PIECE;

    /// A checksum of `file[at..at + len]` (a range past the file's end fails the step that
    /// reaches it).
    pub fn new(file: Arc<dyn FileSource>, at: u64, len: u64) -> Self {
        Self {
            file,
            range: FileRange::new(at, len),
        }
    }

    /// Bytes not hashed yet.
    pub fn remaining(&self) -> u64 {
        self.range.left
    }

    /// Reads and hashes the next piece; the checksum once the whole range is hashed (then again
    /// on each call).
    pub fn step(&mut self) -> io::Result<Option<u32>> {
        self.range.step(&*self.file)
    }
}

/// Where a file checksum stands: the next byte, the bytes left, the CRC so far.
#[derive(Debug)]
struct FileRange {
    at: u64,
    left: u64,
    crc: u32,
    buf: Vec<u8>,
}

impl FileRange {
    fn new(at: u64, left: u64) -> Self {
        Self {
            at,
            left,
            crc: 0,
            buf: Vec::new(),
        }
    }

    fn step(&mut self, file: &dyn FileSource) -> io::Result<Option<u32>> {
        if self.left == 0 {
            self.buf = Vec::new();
            return Ok(Some(self.crc));
        }
        let n = self.left.min(PIECE as u64) as usize;
        if self.buf.len() < n {
            self.buf.resize(n, 0);
        }
        file.read_exact_at(self.at, &mut self.buf[..n])?;
        self.crc = crc32c_append(self.crc, &self.buf[..n]);
        self.at += n as u64;
        self.left -= n as u64;
        Ok(None)
    }
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

    /// A file's bytes: reads inside them, an error past their end.
    #[derive(Debug)]
    struct Bytes(Vec<u8>);

    impl FileSource for Bytes {
        fn check(&self, _: crate::OpKind, offset: u64, _: u64) -> Result<u64, crate::RemoteStatus> {
            Ok(offset)
        }
        fn read_exact_at(&self, at: u64, buf: &mut [u8]) -> io::Result<()> {
            let from = self
                .0
                .get(at as usize..at as usize + buf.len())
                .ok_or_else(|| io::Error::from(io::ErrorKind::UnexpectedEof))?;
            buf.copy_from_slice(from);
            Ok(())
        }
        fn write_all_at(&self, _: u64, _: &[u8]) -> io::Result<()> {
            Err(io::Error::from(io::ErrorKind::Unsupported))
        }
    }

    /// A file range hashed a piece per step gives the whole range's checksum after one read
    /// per piece, the same as `crc32c_file` in one call; a range past the end fails its step.
    #[test]
    fn a_file_checksum_in_pieces_is_the_whole_ones() {
        let data: Vec<u8> = (0..(PIECE * 2 + 17)).map(|i| (i * 13 + 1) as u8).collect();
        let whole = crc32c(&data[3..]);
        let file: Arc<dyn FileSource> = Arc::new(Bytes(data.clone()));
        let len = data.len() as u64 - 3;
        assert_eq!(crc32c_file(&*file, 3, len).unwrap(), whole);
        let mut sum = FileCrc::new(file.clone(), 3, len);
        let mut steps = 1;
        let stepped = loop {
            match sum.step().unwrap() {
                Some(crc) => break crc,
                None => {
                    steps += 1;
                    assert!(sum.remaining() < len);
                }
            }
        };
        assert_eq!((stepped, steps), (whole, 4), "three pieces, then the sum");
        assert_eq!(sum.step().unwrap(), Some(whole));
        assert_eq!(FileCrc::new(file.clone(), 0, 0).step().unwrap(), Some(0));
        let mut past = FileCrc::new(file, 1, data.len() as u64);
        assert!(past.step().is_ok() && past.step().is_ok() && past.step().is_err());
    }
}
