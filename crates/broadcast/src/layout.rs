//! Where the bytes of each manifest segment live at one member, and the pieces a chunk is
//! moved in.
//!
//! A manifest segment is a run of bytes; at a member it is held as *extents*: pieces of it,
//! each in a slice of a registration of that member's engine. The source holds each segment
//! whole, in the registration (or published file) of the same name, so its layout is the
//! identity. A receiver that pulls into buffers of its own holds each segment whole too. A
//! receiver that pulls *in place* holds each tensor (a manifest entry) in the destination it
//! named, and the bytes no destination takes (a `.safetensors` header, a tensor it filtered
//! out) in a scratch buffer of its own: its extents tile every segment exactly.
//!
//! A chunk is moved as the pieces where the holder's extents and the receiver's extents meet
//! ([`pieces`]), one READ each in one batch, and verified over those pieces in order.
//! Receivers tell their children their layout on the control service ([`Extent`]s naming
//! their registrations); a layout from a peer is checked ([`check`]) before it is used.

use ferry::{LocalMemory, LocalRef};
use serde::{Deserialize, Serialize};

use crate::manifest::{MAX_ENTRIES, MAX_SEGMENTS, Manifest};

/// Most extents a layout from a peer may have (every entry, and a gap before and after each).
pub const MAX_EXTENTS: usize = 2 * MAX_ENTRIES + MAX_SEGMENTS;

/// A slice of a registration of this process's engine: where one tensor's bytes live (host
/// or GPU memory), and what a peer reads it by (the registration's name).
#[derive(Clone, Debug)]
pub struct Slice {
    memory: LocalRef,
    segment: String,
    offset: u64,
    len: u64,
}

impl Slice {
    /// `len` bytes at `offset` of `memory`, registered at its engine as `segment`. Refused
    /// when the range does not lie inside the memory.
    pub fn new(
        memory: &impl LocalMemory,
        segment: &str,
        offset: u64,
        len: u64,
    ) -> Result<Self, String> {
        let memory = memory.local_ref();
        if offset.checked_add(len).is_none_or(|end| end > memory.len()) {
            return Err(format!(
                "{len} bytes at {offset} lie outside registration {segment:?} of {} bytes",
                memory.len()
            ));
        }
        Ok(Self {
            memory,
            segment: segment.to_owned(),
            offset,
            len,
        })
    }

    /// The whole of `memory`, registered as `segment`.
    pub fn whole(memory: &impl LocalMemory, segment: &str) -> Self {
        let memory = memory.local_ref();
        let len = memory.len();
        Self {
            memory,
            segment: segment.to_owned(),
            offset: 0,
            len,
        }
    }

    /// The registration's name.
    pub fn segment(&self) -> &str {
        &self.segment
    }

    /// Offset in the registration.
    pub fn offset(&self) -> u64 {
        self.offset
    }

    /// Length in bytes.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether it has no byte.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Whether it is host memory (GPU memory otherwise).
    pub fn is_host(&self) -> bool {
        self.memory.host().is_some()
    }

    /// The whole registration this slice is of.
    pub fn whole_registration(&self) -> Self {
        Self {
            memory: self.memory.clone(),
            segment: self.segment.clone(),
            offset: 0,
            len: self.memory.len(),
        }
    }

    pub(crate) fn memory(&self) -> &LocalRef {
        &self.memory
    }

    /// `len` bytes from `at` (relative to the slice) of this slice.
    pub(crate) fn sub(&self, at: u64, len: u64) -> Self {
        Self {
            memory: self.memory.clone(),
            segment: self.segment.clone(),
            offset: self.offset + at,
            len,
        }
    }

    /// Copies `dst.len()` bytes at `at` (relative to the slice) out to `dst`.
    pub(crate) fn read(&self, at: u64, dst: &mut [u8]) -> Result<(), String> {
        self.bounds(at, dst.len() as u64)?;
        let off = self.offset + at;
        if let Some(r) = self.memory.host() {
            return r.read_at(off, dst).map_err(|e| e.to_string());
        }
        #[cfg(feature = "cuda")]
        if let Some(d) = self.memory.device() {
            return d.copy_to_host(off, dst).map_err(|e| e.to_string());
        }
        Err("memory of an unknown kind".into())
    }

    /// Copies `src` into this slice at `at` (relative to the slice).
    pub(crate) fn write(&self, at: u64, src: &[u8]) -> Result<(), String> {
        self.bounds(at, src.len() as u64)?;
        let off = self.offset + at;
        if let Some(r) = self.memory.host() {
            return r.write_at(off, src).map_err(|e| e.to_string());
        }
        #[cfg(feature = "cuda")]
        if let Some(d) = self.memory.device() {
            return d.copy_from_host(off, src).map_err(|e| e.to_string());
        }
        Err("memory of an unknown kind".into())
    }

    fn bounds(&self, at: u64, len: u64) -> Result<(), String> {
        if at.checked_add(len).is_none_or(|end| end > self.len) {
            return Err(format!(
                "{len} bytes at {at} outside a slice of {} bytes of {:?}",
                self.len, self.segment
            ));
        }
        Ok(())
    }

    /// Copies the whole of `src` (of the same length) into this slice: host to host directly
    /// (one CPU copy per byte, [`MemoryRegion::copy_from_region`](ferry::MemoryRegion::copy_from_region)), GPU to or from host by the
    /// driver, GPU to GPU through host pieces. Returns the bytes the CPU copied.
    pub(crate) fn copy_from(&self, src: &Slice) -> Result<u64, String> {
        if src.len != self.len {
            return Err(format!(
                "copying {} bytes into a slice of {}",
                src.len, self.len
            ));
        }
        match (src.memory.host(), self.memory.host()) {
            (Some(s), Some(d)) => {
                d.copy_from_region(self.offset, s, src.offset, self.len)
                    .map_err(|e| e.to_string())?;
                Ok(self.len)
            }
            #[cfg(feature = "cuda")]
            (Some(s), None) => {
                let d = self.memory.device().ok_or("memory of an unknown kind")?;
                d.copy_from_region(self.offset, s, src.offset, self.len as usize)
                    .map_err(|e| e.to_string())?;
                Ok(0)
            }
            #[cfg(feature = "cuda")]
            (None, Some(d)) => {
                let s = src.memory.device().ok_or("memory of an unknown kind")?;
                s.copy_to_region(src.offset, d, self.offset, self.len as usize)
                    .map_err(|e| e.to_string())?;
                Ok(0)
            }
            _ => {
                let mut buf = vec![0u8; PIECE.min(self.len) as usize];
                let mut at = 0;
                while at < self.len {
                    let n = PIECE.min(self.len - at) as usize;
                    src.read(at, &mut buf[..n])?;
                    self.write(at, &buf[..n])?;
                    at += n as u64;
                }
                Ok(0)
            }
        }
    }

    /// CRC-32C of `len` bytes at `at`, appended to `crc`, and the bytes the CPU copied to
    /// compute it: host memory is read where it lies where the CPU has a CRC-32C instruction
    /// ([`MemoryRegion::crc32c_in_place`](ferry::MemoryRegion::crc32c_in_place), no copy), and
    /// is otherwise copied out in pieces of 1 MiB; GPU memory is copied out by the driver (not
    /// counted).
    pub(crate) fn crc_append(&self, crc: u32, at: u64, len: u64) -> Result<(u32, u64), String> {
        self.bounds(at, len)?;
        if let Some(r) = self.memory.host()
            && let Some(c) = r
                .crc32c_in_place(crc, self.offset + at, len)
                .map_err(|e| e.to_string())?
        {
            return Ok((c, 0));
        }
        let mut crc = crc;
        self.for_each_piece(at, len, |b| crc = ferry::checksum::crc32c_append(crc, b))?;
        Ok((crc, if self.is_host() { len } else { 0 }))
    }

    /// `len` bytes at `at` fed to `hasher` (BLAKE3), copied out in pieces of 1 MiB (by the CPU
    /// from host memory, by the driver from GPU memory).
    pub(crate) fn blake3_update(
        &self,
        hasher: &mut blake3::Hasher,
        at: u64,
        len: u64,
    ) -> Result<(), String> {
        self.for_each_piece(at, len, |b| {
            hasher.update(b);
        })
    }

    /// Copies `len` bytes at `at` out in pieces of at most 1 MiB and hands each to `f`.
    fn for_each_piece(&self, at: u64, len: u64, mut f: impl FnMut(&[u8])) -> Result<(), String> {
        self.bounds(at, len)?;
        with_scratch(PIECE.min(len) as usize, |buf| {
            let mut done = 0;
            while done < len {
                let n = PIECE.min(len - done) as usize;
                self.read(at + done, &mut buf[..n])?;
                f(&buf[..n]);
                done += n as u64;
            }
            Ok(())
        })
    }
}

/// Largest piece copied at once.
const PIECE: u64 = 1 << 20;

thread_local! {
    /// This thread's buffer for [`with_scratch`]: kept, so that the chunks a receiver hashes
    /// (one per chunk, per hop) cost no allocation and no zeroing each.
    static SCRATCH: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Runs `f` over a buffer of `len` bytes (their contents unspecified: whatever the thread's
/// last use left) that `f` must fill before it reads. The thread's buffer is grown once (zeroed
/// then) and reused, so a thread holds as much as the largest `len` it was asked for (a chunk:
/// at most 1 MiB for hashing, a chunk for landing). A nested call gets a buffer of its own.
pub(crate) fn with_scratch<R>(len: usize, f: impl FnOnce(&mut [u8]) -> R) -> R {
    SCRATCH.with(|cell| match cell.try_borrow_mut() {
        Ok(mut buf) => {
            if buf.len() < len {
                buf.resize(len, 0);
            }
            f(&mut buf[..len])
        }
        Err(_) => f(&mut vec![0u8; len]),
    })
}

/// Bytes one thread copies at a time in [`copy_all`] (a commit's piece).
pub const COPY_PIECE: u64 = 8 << 20;

/// Copies each `(name, src, dst)` pair's `src` into its `dst` (of the same length), cut into
/// pieces of `piece` bytes that up to `threads` threads take in turn, so that a large copy
/// uses more than one core's share of memory bandwidth. Returns the bytes the CPU copied (host
/// to host one per byte, none where the driver copies to or from GPU memory), or the first
/// failure, naming the pair; after a failure no thread starts another piece, and the
/// destinations are left partly written.
pub fn copy_all(
    pairs: &[(String, Slice, Slice)],
    threads: usize,
    piece: u64,
) -> Result<u64, String> {
    let piece = piece.max(1);
    use std::sync::Mutex;
    use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
    let mut work = Vec::new();
    for (i, (_, src, dst)) in pairs.iter().enumerate() {
        if src.len != dst.len {
            return Err(format!(
                "{:?}: copying {} bytes into a slice of {}",
                pairs[i].0, src.len, dst.len
            ));
        }
        let mut at = 0;
        while at < src.len {
            let n = piece.min(src.len - at);
            work.push((i, at, n));
            at += n;
        }
    }
    let next = AtomicUsize::new(0);
    let copied = AtomicU64::new(0);
    let failed = AtomicBool::new(false);
    let first_err = Mutex::new(None);
    let worker = || {
        while !failed.load(Ordering::Relaxed) {
            let Some(&(i, at, n)) = work.get(next.fetch_add(1, Ordering::Relaxed)) else {
                return;
            };
            let (name, src, dst) = &pairs[i];
            match dst.sub(at, n).copy_from(&src.sub(at, n)) {
                Ok(c) => {
                    copied.fetch_add(c, Ordering::Relaxed);
                }
                Err(e) => {
                    failed.store(true, Ordering::Relaxed);
                    let mut g = first_err.lock().unwrap_or_else(|p| p.into_inner());
                    g.get_or_insert(format!("{name:?}: {e}"));
                }
            }
        }
    };
    let threads = threads.clamp(1, work.len().max(1));
    std::thread::scope(|s| {
        for _ in 1..threads {
            s.spawn(worker);
        }
        worker();
    });
    match first_err.into_inner().unwrap_or_else(|p| p.into_inner()) {
        Some(e) => Err(e),
        None => Ok(copied.into_inner()),
    }
}

/// One named tensor a publisher serves from memory: where its bytes are, and what they are.
#[derive(Clone, Debug)]
pub struct Tensor {
    /// Its name in the manifest.
    pub name: String,
    /// Its bytes.
    pub slice: Slice,
    /// The element type (`F32`, `BF16`, ...), if known.
    pub dtype: Option<String>,
    /// The shape, if known.
    pub shape: Option<Vec<u64>>,
}

/// A piece of a manifest segment as a member holds it, on the wire: `len` bytes from
/// `seg_offset` of the segment lie in the member's registration `segment` at `offset`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Extent {
    /// Offset in the manifest segment.
    pub seg_offset: u64,
    /// Length.
    pub len: u64,
    /// The member's registration holding it.
    pub segment: String,
    /// Offset in that registration.
    pub offset: u64,
}

/// A segment's extents at this member: `(offset in the manifest segment, slice)`, in order,
/// tiling the segment.
pub(crate) type LocalExtents = Vec<(u64, Slice)>;

/// The wire form of a local layout.
pub(crate) fn to_wire(layout: &[LocalExtents]) -> Vec<Vec<Extent>> {
    layout
        .iter()
        .map(|seg| {
            seg.iter()
                .map(|(at, s)| Extent {
                    seg_offset: *at,
                    len: s.len,
                    segment: s.segment.clone(),
                    offset: s.offset,
                })
                .collect()
        })
        .collect()
}

/// The source's layout of `m`: each segment whole, in the registration of its name.
pub(crate) fn identity(m: &Manifest) -> Vec<Vec<Extent>> {
    m.segments
        .iter()
        .map(|s| {
            if s.len == 0 {
                Vec::new()
            } else {
                vec![Extent {
                    seg_offset: 0,
                    len: s.len,
                    segment: s.name.clone(),
                    offset: 0,
                }]
            }
        })
        .collect()
}

/// Checks a layout from a peer against `m`: one list per segment, at most [`MAX_EXTENTS`] in
/// all, each list's extents in order, non-empty, tiling its segment exactly. (That each lies
/// inside the named registration is checked when it is resolved against the peer's list.)
pub fn check(m: &Manifest, layout: &[Vec<Extent>]) -> Result<(), String> {
    if layout.len() != m.segments.len() {
        return Err(format!(
            "{} segment layouts for {} segments",
            layout.len(),
            m.segments.len()
        ));
    }
    let total: usize = layout.iter().map(Vec::len).sum();
    if total > MAX_EXTENTS {
        return Err(format!("{total} extents, limit {MAX_EXTENTS}"));
    }
    for (seg, ext) in m.segments.iter().zip(layout) {
        let mut at = 0u64;
        for e in ext {
            if e.seg_offset != at || e.len == 0 {
                return Err(format!(
                    "segment {:?}: extent at {} of {} bytes, expected one at {at}",
                    seg.name, e.seg_offset, e.len
                ));
            }
            at = at
                .checked_add(e.len)
                .filter(|&end| end <= seg.len)
                .ok_or_else(|| format!("segment {:?}: extents run past its end", seg.name))?;
            e.offset
                .checked_add(e.len)
                .ok_or_else(|| format!("segment {:?}: extent offset overflows", seg.name))?;
        }
        if at != seg.len {
            return Err(format!(
                "segment {:?}: extents cover {at} of {} bytes",
                seg.name, seg.len
            ));
        }
    }
    Ok(())
}

/// Where the ranges `a` and `b` (each `(start, len)` extents tiling the same segment, in
/// order) meet inside `off..off+len`: `(index in a, index in b, start, len)` in order.
/// Extents that do not tile are cut short where they stop (the caller checked them).
pub fn pieces(
    a: &[(u64, u64)],
    b: &[(u64, u64)],
    off: u64,
    len: u64,
) -> Vec<(usize, usize, u64, u64)> {
    let end = off.saturating_add(len);
    let first = |v: &[(u64, u64)]| v.partition_point(|&(s, l)| s.saturating_add(l) <= off);
    let (mut i, mut j) = (first(a), first(b));
    let mut at = off;
    let mut out = Vec::new();
    while at < end && i < a.len() && j < b.len() {
        let (ea, eb) = (a[i].0 + a[i].1, b[j].0 + b[j].1);
        if a[i].0 > at || b[j].0 > at {
            break;
        }
        let stop = ea.min(eb).min(end);
        out.push((i, j, at, stop - at));
        at = stop;
        if ea == stop {
            i += 1;
        }
        if eb == stop {
            j += 1;
        }
    }
    out
}

/// The bytes of a layout no destination takes, for one receiver: registered host memory the
/// gaps are packed into.
pub(crate) fn gaps(m: &Manifest, taken: &[Vec<(u64, Slice)>]) -> (u64, Vec<Vec<(u64, u64)>>) {
    let mut total = 0u64;
    let mut out = Vec::with_capacity(m.segments.len());
    for (seg, t) in m.segments.iter().zip(taken) {
        let mut g = Vec::new();
        let mut at = 0u64;
        for (s, slice) in t {
            if *s > at {
                g.push((at, *s - at));
                total += *s - at;
            }
            at = at.max(s + slice.len);
        }
        if seg.len > at {
            g.push((at, seg.len - at));
            total += seg.len - at;
        }
        out.push(g);
    }
    (total, out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copy_all_copies_every_piece_once_on_several_threads_and_names_a_bad_pair() {
        use ferry::{Access, DataPlane, MemoryRegion, TransferEngine};
        let e = TransferEngine::builder()
            .data_plane(DataPlane::Tcp)
            .build()
            .unwrap();
        let bytes: Vec<u8> = (0..100_000u32).map(|i| (i * 7 + i / 251) as u8).collect();
        let reg = |v: Vec<u8>, name: &str| {
            e.register(MemoryRegion::from_vec(v), Access::REMOTE_READ, name)
                .unwrap()
        };
        let (src, dst) = (reg(bytes.clone(), "src"), reg(vec![0; 100_000], "dst"));
        // Two tensors of one arena each, the first cut into many pieces.
        let pairs = vec![
            (
                "a".to_string(),
                Slice::new(&src, "src", 0, 70_001).unwrap(),
                Slice::new(&dst, "dst", 0, 70_001).unwrap(),
            ),
            (
                "b".to_string(),
                Slice::new(&src, "src", 70_001, 29_999).unwrap(),
                Slice::new(&dst, "dst", 70_001, 29_999).unwrap(),
            ),
        ];
        assert_eq!(
            copy_all(&pairs, 3, 4096).unwrap(),
            100_000,
            "one copy per byte"
        );
        let mut got = vec![0u8; 100_000];
        dst.region().read_at(0, &mut got).unwrap();
        assert_eq!(got, bytes);
        let bad = vec![(
            "c".to_string(),
            Slice::new(&src, "src", 0, 10).unwrap(),
            Slice::new(&dst, "dst", 0, 11).unwrap(),
        )];
        assert!(copy_all(&bad, 2, 4096).unwrap_err().contains("\"c\""));
    }

    #[test]
    fn pieces_cut_where_either_side_changes() {
        let a = [(0, 10), (10, 5), (15, 20)];
        let b = [(0, 12), (12, 23)];
        assert_eq!(
            pieces(&a, &b, 0, 35),
            vec![(0, 0, 0, 10), (1, 0, 10, 2), (1, 1, 12, 3), (2, 1, 15, 20)]
        );
        assert_eq!(
            pieces(&a, &b, 11, 6),
            vec![(1, 0, 11, 1), (1, 1, 12, 3), (2, 1, 15, 2)]
        );
        // A hole in one side stops the walk there.
        assert_eq!(pieces(&[(0, 4)], &[(0, 8)], 0, 8), vec![(0, 0, 0, 4)]);
    }
}
