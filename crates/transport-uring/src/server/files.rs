//! File segments as a serving ring moves them: a [`FileSegment`] with ring operations on its
//! descriptors (O_DIRECT where alignment allows; `stream.rs` queues them), any other
//! [`FileSource`] through its own positioned I/O, a piece at a time through the stream's staging
//! buffer.

use std::sync::Arc;

use ferry_core::{FileSource, MemoryRegion};
use ferry_file::{DIRECT_ALIGN, FileSegment};

/// File segments move through a staging buffer of at most this much per stream (a multiple of
/// `DIRECT_ALIGN`, so aligned chunks stay aligned piece by piece).
pub(super) const FILE_PIECE: usize = 1 << 20;

/// Staging buffers kept per ring thread for the streams it serves: a stream takes one for a
/// file op and gives it back when it goes idle; beyond this many, given-back buffers are
/// freed. So memory held for file staging is bounded by the streams moving file bytes at once,
/// not by the streams attached.
const SPARE_STAGES: usize = 4;

thread_local! {
    static SPARE: std::cell::RefCell<Vec<Arc<MemoryRegion>>> =
        const { std::cell::RefCell::new(Vec::new()) };
}

/// A stream's staging buffer for file segments, page-aligned for O_DIRECT: taken on a file
/// op's first piece (from the ring thread's spares, or made), handed back while the stream is
/// idle ([`release`](Self::release)).
pub(super) struct Stage {
    pub(super) region: Option<Arc<MemoryRegion>>,
}

impl Stage {
    pub(super) fn get(&mut self, len: usize) -> std::io::Result<&Arc<MemoryRegion>> {
        let need = (len as u64).div_ceil(DIRECT_ALIGN) * DIRECT_ALIGN;
        if self.region.is_none() {
            // A spare no operation still uses (its last piece's completion reaped).
            self.region = SPARE.with_borrow_mut(|spare| {
                let at = spare.iter().position(|r| Arc::strong_count(r) == 1)?;
                Some(spare.swap_remove(at))
            });
        }
        if self.region.as_ref().is_none_or(|r| (r.len() as u64) < need) {
            let r = MemoryRegion::alloc_zeroed(
                need.max(FILE_PIECE as u64) as usize,
                DIRECT_ALIGN as usize,
            )
            .map_err(|e| std::io::Error::other(e.to_string()))?;
            self.region = Some(Arc::new(r));
        }
        self.region
            .as_ref()
            .ok_or_else(|| std::io::Error::other("staging buffer"))
    }

    /// Hands the buffer to the ring thread's spares (past [`SPARE_STAGES`] it is freed, once
    /// the operations that still use it completed).
    pub(super) fn release(&mut self) {
        if let Some(r) = self.region.take() {
            SPARE.with_borrow_mut(|spare| {
                if spare.len() < SPARE_STAGES {
                    spare.push(r);
                }
            });
        }
    }
}

/// A published file as this server moves it: a [`FileSegment`] with ring operations on its
/// descriptors (O_DIRECT where alignment allows), any other [`FileSource`] through its own
/// positioned I/O.
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

    /// What errors name it by: a segment's path.
    pub(super) fn name(&self) -> String {
        match self {
            FileIo::Segment(f) => f.path().display().to_string(),
            FileIo::Source(_) => "(a file source)".to_owned(),
        }
    }

    /// Reads exactly `n` bytes at file offset `at` into the start of `buf` (a source other
    /// than a segment, whose pieces are ring operations).
    pub(super) fn read_piece(&self, buf: &MemoryRegion, n: usize, at: u64) -> std::io::Result<()> {
        let FileIo::Source(f) = self else {
            return Err(std::io::Error::other(
                "a segment's piece is a ring operation",
            ));
        };
        // SAFETY: the staging region is its stream's alone (its steps run in order, nothing of
        // it in flight), and no other view of it is alive during the call.
        let piece = unsafe { buf.slice_mut(0, n) }
            .map_err(|e| std::io::Error::other(format!("staging buffer: {e}")))?;
        f.read_exact_at(at, piece)
    }

    /// Writes the first `n` bytes of `buf` at file offset `at` (as [`Self::read_piece`]).
    pub(super) fn write_piece(&self, buf: &MemoryRegion, n: usize, at: u64) -> std::io::Result<()> {
        let FileIo::Source(f) = self else {
            return Err(std::io::Error::other(
                "a segment's piece is a ring operation",
            ));
        };
        // SAFETY: as in `read_piece`; nothing writes the region during the call.
        let piece = unsafe { buf.slice(0, n) }
            .map_err(|e| std::io::Error::other(format!("staging buffer: {e}")))?;
        f.write_all_at(at, piece)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A stream that goes idle gives its staging to the ring thread's spares; the next stream's
    /// file op takes it again (none is taken while an operation still holds it), and the spares
    /// stay bounded however many streams give buffers back.
    #[test]
    fn idle_streams_give_their_staging_back_to_a_bounded_spare_list() {
        let spares = || SPARE.with_borrow(Vec::len);
        let mut a = Stage { region: None };
        let first = a.get(4096).unwrap().clone();
        a.release();
        assert!(a.region.is_none());
        assert_eq!(spares(), 1);
        // Still held by an operation in flight (`first`): not taken; a new one is made.
        let mut b = Stage { region: None };
        assert!(!Arc::ptr_eq(b.get(FILE_PIECE).unwrap(), &first));
        drop(first);
        let mut c = Stage { region: None };
        let again = c.get(FILE_PIECE).unwrap().clone();
        assert_eq!(spares(), 0, "the spare no operation holds was taken");
        drop(again);
        for s in [&mut b, &mut c] {
            s.release();
        }
        for _ in 0..2 * SPARE_STAGES {
            let mut s = Stage { region: None };
            s.region = Some(Arc::new(
                MemoryRegion::alloc_zeroed(FILE_PIECE, DIRECT_ALIGN as usize).unwrap(),
            ));
            s.release();
        }
        assert_eq!(spares(), SPARE_STAGES);
    }
}
