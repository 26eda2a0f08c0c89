//! File segments as a serving ring moves them: a [`FileSegment`] through the ring's file ring
//! (O_DIRECT where alignment allows), any other [`FileSource`] through its own positioned I/O,
//! a piece at a time through the stream's staging buffer.

use std::sync::Arc;

use ferry_core::{FileSource, MemoryRegion};
use ferry_file::{DIRECT_ALIGN, FileSegment};

use crate::file_ring::FileRing;

/// File segments move through a staging buffer of at most this much per stream (a multiple of
/// `DIRECT_ALIGN`, so aligned chunks stay aligned piece by piece).
pub(super) const FILE_PIECE: usize = 1 << 20;

/// A staging buffer for file segments, page-aligned for O_DIRECT.
pub(super) struct Stage {
    pub(super) region: Option<Arc<MemoryRegion>>,
}

impl Stage {
    pub(super) fn get(&mut self, len: usize) -> std::io::Result<&Arc<MemoryRegion>> {
        let need = (len as u64).div_ceil(DIRECT_ALIGN) * DIRECT_ALIGN;
        if self.region.as_ref().is_none_or(|r| (r.len() as u64) < need) {
            let r =
                MemoryRegion::alloc_zeroed(need.max(DIRECT_ALIGN) as usize, DIRECT_ALIGN as usize)
                    .map_err(|e| std::io::Error::other(e.to_string()))?;
            self.region = Some(Arc::new(r));
        }
        self.region
            .as_ref()
            .ok_or_else(|| std::io::Error::other("staging buffer"))
    }
}

/// A published file as this server moves it: a [`FileSegment`] through the stream's file ring
/// (O_DIRECT where alignment allows), any other [`FileSource`] through its own positioned I/O.
pub(super) enum FileIo {
    Segment(Arc<FileSegment>),
    Source(Arc<dyn FileSource>),
}

impl FileIo {
    pub(super) fn new(source: Arc<dyn FileSource>) -> Self {
        let any: Arc<dyn std::any::Any + Send + Sync> = source.clone();
        match any.downcast::<FileSegment>() {
            Ok(seg) => FileIo::Segment(seg),
            Err(_) => FileIo::Source(source),
        }
    }

    /// Reads exactly `n` bytes at file offset `at` into the start of `buf`.
    pub(super) fn read_piece(
        &self,
        ring: &mut FileRing,
        buf: &MemoryRegion,
        n: usize,
        at: u64,
    ) -> std::io::Result<()> {
        match self {
            FileIo::Segment(f) => {
                let (fd, _direct) = f.read_fd(at, n as u64, buf.as_ptr() as usize);
                // SAFETY: the staging region holds at least `n` bytes and is used only by this
                // stream's thread, which waits for the read here.
                let got = unsafe { ring.io(fd, false, buf.as_ptr(), n, at) }?;
                if got < n {
                    return Err(std::io::Error::new(
                        std::io::ErrorKind::UnexpectedEof,
                        format!("file {} shrank under a READ", f.path().display()),
                    ));
                }
                Ok(())
            }
            FileIo::Source(f) => {
                // SAFETY: the staging region is this stream thread's alone, and no other view
                // of it is alive during the call; read straight into it, no bounce buffer.
                let piece = unsafe { buf.slice_mut(0, n) }
                    .map_err(|e| std::io::Error::other(format!("staging buffer: {e}")))?;
                f.read_exact_at(at, piece)
            }
        }
    }

    /// Writes the first `n` bytes of `buf` at file offset `at`.
    pub(super) fn write_piece(
        &self,
        ring: &mut FileRing,
        buf: &MemoryRegion,
        n: usize,
        at: u64,
    ) -> std::io::Result<()> {
        match self {
            FileIo::Segment(f) => {
                // SAFETY: the staging region holds the `n` bytes just received and is used only
                // by this stream's thread, which waits for the write here.
                let put = unsafe { ring.io(f.write_fd(), true, buf.as_ptr(), n, at) }?;
                if put < n {
                    return Err(std::io::Error::other(format!(
                        "short write to file {}",
                        f.path().display()
                    )));
                }
                Ok(())
            }
            FileIo::Source(f) => {
                // SAFETY: the staging region is this stream thread's alone and nothing writes
                // it during the call; write straight from it, no bounce buffer.
                let piece = unsafe { buf.slice(0, n) }
                    .map_err(|e| std::io::Error::other(format!("staging buffer: {e}")))?;
                f.write_all_at(at, piece)
            }
        }
    }
}
