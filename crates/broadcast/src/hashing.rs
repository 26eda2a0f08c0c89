//! Hashing chunks: a source's manifest built from its tensors (their chunks checksummed on
//! threads), BLAKE3 when chunks are fetched, CRC-32C at rest.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};

use std::collections::HashSet;

use crate::layout::{Slice, Tensor};
use crate::manifest::{Chunk, Digest, Entry, Manifest, ManifestError, Segment, invalid};

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

/// A chunk to checksum: `(index of its registration in the caller's list, offset, length)`.
pub(crate) type ChunkAt = (usize, u64, u64);

/// A chunk's CRC-32C and BLAKE3.
pub(crate) type Sums = (u32, Digest);

/// The CRC-32C and BLAKE3 of each of `chunks` (of the registrations `wholes`), in the order
/// given, computed on `threads` threads at most, each taking the next chunk no thread has taken
/// (so a slow chunk holds up only its own thread). Host memory only is spread over threads:
/// with a GPU registration among `wholes` it runs on the caller's thread, as the driver's
/// copies out did before. The first error is returned (the others stop at their next chunk).
pub(crate) fn chunk_sums(
    wholes: &[Slice],
    chunks: &[ChunkAt],
    threads: usize,
) -> Result<Vec<Sums>, String> {
    let one = |&(w, at, n): &ChunkAt| -> Result<Sums, String> {
        let whole = wholes
            .get(w)
            .ok_or_else(|| format!("chunk of registration {w}: no such registration"))?;
        let named = |e: String| format!("registration {:?}: {e}", whole.segment());
        let (crc, _) = whole.crc_append(0, at, n).map_err(named)?;
        let mut h = blake3::Hasher::new();
        whole.blake3_update(&mut h, at, n).map_err(named)?;
        Ok((crc, h.finalize().into()))
    };
    let threads = if wholes.iter().all(Slice::is_host) {
        threads.clamp(1, chunks.len().max(1))
    } else {
        1
    };
    if threads == 1 {
        return chunks.iter().map(one).collect();
    }
    let next = AtomicUsize::new(0);
    let failed = AtomicBool::new(false);
    let work = || -> Result<Vec<(usize, Sums)>, String> {
        let mut mine = Vec::new();
        while !failed.load(Ordering::Relaxed) {
            let i = next.fetch_add(1, Ordering::Relaxed);
            let Some(c) = chunks.get(i) else { break };
            match one(c) {
                Ok(sums) => mine.push((i, sums)),
                Err(e) => {
                    failed.store(true, Ordering::Relaxed);
                    return Err(e);
                }
            }
        }
        Ok(mine)
    };
    let mut out = vec![(0, Digest::default()); chunks.len()];
    let mut seen = 0usize;
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads).map(|_| s.spawn(work)).collect();
        for h in handles {
            let mine = h
                .join()
                .map_err(|_| "a thread checksumming chunks panicked".to_string())??;
            seen += mine.len();
            for (i, sums) in mine {
                out[i] = sums;
            }
        }
        Ok::<(), String>(())
    })?;
    if seen != chunks.len() {
        return Err(format!("{seen} of {} chunks checksummed", chunks.len()));
    }
    Ok(out)
}

/// Threads [`chunk_sums`] runs on when a source builds a manifest: the CPUs this process may
/// run on, at most 8 (BLAKE3 of a chunk already uses the CPU's vector width).
pub(crate) fn manifest_threads() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get().min(8))
}

// Manifests of tensors served from memory are built here, beside the chunks' checksums, so
// that neither `manifest` nor `layout` needs this module.
impl Manifest {
    /// Builds a manifest for tensors served from memory: one segment per registration named
    /// by the tensors' slices (in order of first appearance; the whole registration, so bytes
    /// of it that no tensor names travel too), one entry per tensor (its dtype and shape, the
    /// segment and offset of its slice), and the chunks' CRC-32C and BLAKE3 read from the
    /// memory now, host memory on up to as many threads as CPUs (8 at most; the caller's own
    /// thread for GPU memory).
    /// Refused: two tensors of the same name, two registrations of one name.
    pub fn from_tensors(
        name: &str,
        version: u64,
        tensors: &[Tensor],
        chunk_size: u64,
    ) -> Result<Self, ManifestError> {
        let mut m = Manifest::empty(name, version, chunk_size)?;
        let mut wholes: Vec<Slice> = Vec::new();
        let mut seen = HashSet::new();
        for t in tensors {
            if !seen.insert(t.name.as_str()) {
                return Err(invalid(format!("tensor {:?} appears twice", t.name)));
            }
            let seg = t.slice.segment();
            let si = match m.segments.iter().position(|s| s.name == seg) {
                Some(i) => i,
                None => {
                    let whole = t.slice.whole_registration();
                    m.segments.push(Segment {
                        name: seg.to_owned(),
                        len: whole.len(),
                    });
                    wholes.push(whole);
                    m.segments.len() - 1
                }
            };
            if wholes[si].len() != t.slice.whole_registration().len() {
                return Err(invalid(format!(
                    "two registrations are named {seg:?} (tensor {:?})",
                    t.name
                )));
            }
            m.entries.push(Entry {
                name: t.name.clone(),
                len: t.slice.len(),
                dtype: t.dtype.clone(),
                shape: t.shape.clone(),
                segment: u32::try_from(si).map_err(|_| invalid("too many registrations"))?,
                offset: t.slice.offset(),
            });
        }
        let mut at_of = Vec::new();
        for (si, whole) in wholes.iter().enumerate() {
            let mut at = 0u64;
            while at < whole.len() {
                let n = (whole.len() - at).min(chunk_size);
                at_of.push((si, at, n));
                at += n;
            }
        }
        let sums = chunk_sums(&wholes, &at_of, manifest_threads())
            .map_err(|e| invalid(format!("reading the tensors' registrations: {e}")))?;
        for (&(si, offset, len), (crc32c, blake3)) in at_of.iter().zip(sums) {
            m.chunks.push(Chunk {
                segment: si as u32,
                offset,
                len,
                crc32c,
                blake3,
            });
        }
        m.validate()?;
        Ok(m)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferry::{Access, DataPlane, MemoryRegion, TransferEngine};

    #[test]
    fn chunk_sums_on_several_threads_are_each_chunks_own_in_order() {
        let e = TransferEngine::builder()
            .data_plane(DataPlane::Tcp)
            .build()
            .unwrap();
        let a: Vec<u8> = (0..300_001u32).map(|i| (i * 31 + i / 7) as u8).collect();
        let b: Vec<u8> = (0..70_000u32).map(|i| (i * 13 + 5) as u8).collect();
        let reg = |v: &[u8], name: &str| {
            let r = e
                .register(
                    MemoryRegion::from_vec(v.to_vec()),
                    Access::REMOTE_READ,
                    name,
                )
                .unwrap();
            Slice::whole(&r, name)
        };
        let wholes = [reg(&a, "a"), reg(&b, "b")];
        let mut chunks = Vec::new();
        let mut want = Vec::new();
        for (w, bytes) in [(0usize, &a), (1, &b)] {
            for (i, c) in bytes.chunks(4096 * 3 + 1).enumerate() {
                chunks.push((w, (i * (4096 * 3 + 1)) as u64, c.len() as u64));
                want.push((ferry::checksum::crc32c(c), Digest::of(c)));
            }
        }
        for threads in [1, 2, 5, 64] {
            assert_eq!(
                chunk_sums(&wholes, &chunks, threads).unwrap(),
                want,
                "{threads} threads"
            );
        }
        let past_the_end = [(1usize, 69_000u64, 4096u64)];
        let err = chunk_sums(&wholes, &past_the_end, 2).unwrap_err();
        assert!(err.contains("\"b\""), "{err}");
        assert!(chunk_sums(&wholes, &[(2, 0, 1)], 2).is_err());
        assert!(chunk_sums(&wholes, &[], 4).unwrap().is_empty());
    }
}
