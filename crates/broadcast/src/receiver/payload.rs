//! Where a receiver's payload lands: its own buffers, the caller's destinations (or their
//! staging slices) with scratch for the bytes none takes, or files; the pieces a chunk spans
//! there, the check at rest over them, and what moves the payload out (a copy of a segment,
//! the files written or renamed into a directory, the staged commit).

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use ferry::Registration;

use crate::error::BroadcastError;
use crate::hashing::crc_of;
use crate::landing::{self, Landing, crc_of_file, partial_name, recover_dir};
use crate::layout::{self, LocalExtents, Slice};
use crate::manifest::{Chunk, Manifest};

/// The payload as this receiver holds it, and what was done to it.
pub(super) struct Payload {
    /// Where each segment lands: this receiver's buffers, the caller's destinations or their
    /// staging slices, and scratch for bytes no destination takes (empty per segment when
    /// pulling into files).
    pub(super) layout: Vec<LocalExtents>,
    /// `layout` as `(offset in the segment, length)`.
    pub(super) ranges: Vec<Vec<(u64, u64)>>,
    /// Buffers this receiver allocated (whole segments, scratch, or landing slots).
    _own: Vec<Registration>,
    /// Staged: `(tensor, staging, live)` for [`commit`](Self::commit).
    staged: Option<Vec<(String, Slice, Slice)>>,
    /// The destination tensors (local names).
    pub(super) tensors: Vec<String>,
    /// Whether a READ into the destinations was started.
    pub(super) touched: AtomicBool,
    /// A pull into a directory ([`Receiver::join_to_dir`](super::Receiver::join_to_dir)):
    /// where the chunks go.
    pub(super) files: Option<Landing>,
    /// Bytes the CPU copied: host memory copied out to be hashed, and commits.
    pub(super) copied: Arc<AtomicU64>,
    /// Whether every chunk was verified (the pull completed).
    pub(super) complete: bool,
}

impl Payload {
    /// A payload landing in `layout` (nothing copied, nothing touched, not complete).
    pub(super) fn new(
        layout: Vec<LocalExtents>,
        own: Vec<Registration>,
        staged: Option<Vec<(String, Slice, Slice)>>,
        tensors: Vec<String>,
        files: Option<Landing>,
    ) -> Self {
        let ranges = layout
            .iter()
            .map(|seg| seg.iter().map(|(at, s)| (*at, s.len())).collect())
            .collect();
        Self {
            layout,
            ranges,
            _own: own,
            staged,
            tensors,
            touched: AtomicBool::new(false),
            files,
            copied: Arc::new(AtomicU64::new(0)),
            complete: false,
        }
    }

    /// Whether the pull is staged (the live tensors change only in [`commit`](Self::commit)).
    pub(super) fn is_staged(&self) -> bool {
        self.staged.is_some()
    }

    /// Whether a failed pull leaves the caller's live tensors torn: in place into the caller's
    /// destinations, with a READ into them started.
    pub(super) fn tears(&self) -> bool {
        self.staged.is_none() && !self.tensors.is_empty() && self.touched.load(Ordering::Relaxed)
    }

    /// The bytes of segment `i` (`len` bytes) as held now (a copy).
    pub(super) fn segment_bytes(&self, i: usize, len: u64) -> Option<Vec<u8>> {
        let mut v = vec![0u8; usize::try_from(len).ok()?];
        if let Some(l) = &self.files {
            use std::os::unix::fs::FileExt;
            l.segs.get(i)?.file.read_exact_at(&mut v, 0).ok()?;
            return Some(v);
        }
        for (at, slice) in self.layout.get(i)? {
            let dst = v.get_mut(*at as usize..(*at + slice.len()) as usize)?;
            slice.read(0, dst).ok()?;
        }
        Some(v)
    }

    /// The pieces of chunk `c` as held here: `(slice, offset in it, length)`, in order (none
    /// when pulling into files).
    pub(super) fn pieces(&self, c: &Chunk) -> Vec<(Slice, u64, u64)> {
        let seg = c.segment as usize;
        let r = &self.ranges[seg];
        layout::pieces(r, r, c.offset, c.len)
            .into_iter()
            .map(|(li, _, at, n)| {
                let (start, slice) = &self.layout[seg][li];
                (slice.clone(), at - start, n)
            })
            .collect()
    }

    /// The indices of the chunks among `chunks` whose CRC-32C at rest is not the manifest's.
    pub(super) fn check_at_rest(&self, chunks: &[Chunk]) -> Vec<usize> {
        let mut buf = Vec::new();
        let mut bad = Vec::new();
        for (i, c) in chunks.iter().enumerate() {
            let crc = match &self.files {
                None => crc_of(&self.pieces(c), &self.copied).ok(),
                Some(l) => crc_of_file(
                    &l.segs[c.segment as usize].file,
                    c.offset,
                    c.len,
                    &mut buf,
                    &self.copied,
                )
                .ok(),
            };
            if crc != Some(c.crc32c) {
                bad.push(i);
            }
        }
        bad
    }

    /// Staged: copies every tensor of `manifest` from its staging slice into its live one,
    /// once the pull is complete; returns the bytes copied. Refused before that, and in place.
    /// Host to host each byte is copied once, in pieces spread over half the CPUs (one to
    /// four threads); a copy that fails part way leaves the live tensors partly written.
    pub(super) fn commit(&self, manifest: &Manifest) -> Result<u64, BroadcastError> {
        let refuse = |reason: &str| BroadcastError::Commit {
            name: manifest.name.clone(),
            version: manifest.version,
            reason: reason.to_owned(),
        };
        let Some(staged) = &self.staged else {
            return Err(refuse("the pull was in place: there is nothing to commit"));
        };
        if !self.complete {
            return Err(refuse("the pull has not completed"));
        }
        // Half the CPUs, one to four: the rest stay with the application and the relaying.
        let threads = std::thread::available_parallelism().map_or(1, |n| (n.get() / 2).clamp(1, 4));
        let cpu = layout::copy_all(staged, threads, layout::COPY_PIECE)
            .map_err(|e| refuse(&format!("copying tensor {e}")))?;
        self.copied.fetch_add(cpu, Ordering::Relaxed);
        Ok(staged.iter().map(|(_, _, live)| live.len()).sum())
    }

    /// Writes each segment of `manifest` to `dir/<segment name>` in one commit
    /// ([`Receiver::write_to`](super::Receiver::write_to) states the contract): pulling into
    /// files, the temporary files renamed or copied ([`rename_into`](Self::rename_into));
    /// else each segment copied out of where it landed into a new hidden file beside its name.
    pub(super) fn write_to(&self, manifest: &Manifest, dir: &Path) -> Result<(), BroadcastError> {
        if let Some(l) = &self.files {
            return self.rename_into(manifest, l, dir);
        }
        std::fs::create_dir_all(dir)
            .map_err(|e| BroadcastError::io(format!("creating {}", dir.display()), e))?;
        recover_dir(dir)?;
        let mut staged = Vec::with_capacity(manifest.segments.len());
        let mut written = Ok(());
        for (i, seg) in manifest.segments.iter().enumerate() {
            let tmp = partial_name(dir, &seg.name);
            staged.push(tmp.clone());
            written = std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .open(&tmp)
                .and_then(|f| self.write_segment(i, f));
            if written.is_err() {
                break;
            }
        }
        let written = written.and_then(|()| landing::commit(dir, &pairs(manifest, &staged)));
        if let Err(e) = written {
            for tmp in &staged {
                let _ = std::fs::remove_file(tmp);
            }
            return Err(BroadcastError::io(
                format!("writing into {}", dir.display()),
                e,
            ));
        }
        Ok(())
    }

    /// Pulling into files, after a complete pull: each temporary file flushed and renamed into
    /// `dir` (its own directory), or copied there beside its name and renamed; one commit
    /// ([`write_to`](Self::write_to)).
    fn rename_into(
        &self,
        manifest: &Manifest,
        l: &Landing,
        dir: &Path,
    ) -> Result<(), BroadcastError> {
        if !self.complete {
            return Err(BroadcastError::io(
                format!("writing {}", dir.display()),
                std::io::Error::other("the pull has not completed: its files stay temporary"),
            ));
        }
        let same = std::fs::canonicalize(dir).ok() == std::fs::canonicalize(&l.dir).ok();
        if !same {
            std::fs::create_dir_all(dir)
                .map_err(|e| BroadcastError::io(format!("creating {}", dir.display()), e))?;
            recover_dir(dir)?;
        }
        let mut staged = Vec::with_capacity(l.segs.len());
        let mut done = Ok(());
        for (seg, f) in manifest.segments.iter().zip(&l.segs) {
            if same {
                staged.push(f.tmp.clone());
                done = f.file.sync_data();
            } else {
                // From the file held open (renamed or not), never through a symlink there.
                let tmp = partial_name(dir, &seg.name);
                staged.push(tmp.clone());
                done = (|| {
                    use std::io::Seek;
                    let mut from = f.file.try_clone()?;
                    from.seek(std::io::SeekFrom::Start(0))?;
                    let mut to = std::fs::OpenOptions::new()
                        .write(true)
                        .create_new(true)
                        .open(&tmp)?;
                    std::io::copy(&mut from, &mut to)?;
                    to.sync_data()
                })();
            }
            if done.is_err() {
                break;
            }
        }
        let done = done.and_then(|()| landing::commit(dir, &pairs(manifest, &staged)));
        if let Err(e) = done {
            if !same {
                for tmp in &staged {
                    let _ = std::fs::remove_file(tmp);
                }
            }
            return Err(BroadcastError::io(
                format!("writing into {}", dir.display()),
                e,
            ));
        }
        if same {
            l.renamed.store(true, Ordering::Relaxed);
        }
        Ok(())
    }

    /// Writes segment `i`, extent by extent in offset order, 1 MiB at a time.
    fn write_segment(&self, i: usize, file: std::fs::File) -> std::io::Result<()> {
        use std::io::Write;
        const PIECE: u64 = 1 << 20;
        let mut out = std::io::BufWriter::with_capacity(PIECE as usize, file);
        let mut buf = Vec::new();
        for (_, slice) in &self.layout[i] {
            let mut at = 0;
            while at < slice.len() {
                let n = PIECE.min(slice.len() - at);
                buf.resize(n as usize, 0);
                slice.read(at, &mut buf).map_err(std::io::Error::other)?;
                out.write_all(&buf)?;
                at += n;
            }
        }
        out.flush()
    }
}

/// The (hidden name, final name) pairs of a commit: each staged file's name in its directory
/// and its segment's name.
fn pairs(manifest: &Manifest, staged: &[std::path::PathBuf]) -> Vec<(String, String)> {
    manifest
        .segments
        .iter()
        .zip(staged)
        .map(|(seg, tmp)| {
            let hidden = tmp
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default();
            (hidden, seg.name.clone())
        })
        .collect()
}
