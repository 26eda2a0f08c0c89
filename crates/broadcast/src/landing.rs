//! A pull into a directory ([`Receiver::join_to_dir`](crate::Receiver::join_to_dir)): the
//! temporary files chunks are written to as they are verified, the landing slots they are READ
//! into, and the checks of the directory before anything moves.

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::error::BroadcastError;
use crate::layout::Slice;
use crate::manifest::{Chunk, Digest};

/// A pull into a directory: each segment lands, chunk by chunk as verified, in a temporary file
/// beside its final name, served from there to this member's children, and renamed into place
/// by [`Receiver::write_to`](crate::Receiver::write_to). Chunks are READ into a fixed window of
/// landing slots (one per chunk in flight), verified there, and written to their file; so the
/// memory a pull holds is the window, whatever the payload.
pub(crate) struct Landing {
    pub(crate) dir: std::path::PathBuf,
    pub(crate) segs: Vec<LandingFile>,
    /// One chunk-sized slot per chunk in flight.
    pub(crate) slots: Vec<Slice>,
    /// The slots free now (a fetch takes one, and gives it back when its chunk is written or
    /// failed).
    pub(crate) free: Arc<std::sync::Mutex<Vec<usize>>>,
    /// Whether the files were renamed into place (else they are removed on drop).
    pub(crate) renamed: std::sync::atomic::AtomicBool,
}

/// One segment's temporary file.
pub(crate) struct LandingFile {
    pub(crate) file: Arc<std::fs::File>,
    pub(crate) tmp: std::path::PathBuf,
    /// Its registration, served to children (`None`: an empty segment).
    pub(crate) reg: Option<ferry::FileRegistration>,
}

impl Drop for Landing {
    fn drop(&mut self) {
        if !self.renamed.load(Ordering::Relaxed) {
            for f in &self.segs {
                let _ = std::fs::remove_file(&f.tmp);
            }
        }
    }
}

/// Makes `dir` if missing and checks it has room for `bytes` more: the blocks `statvfs` says
/// are free to this user.
pub(crate) fn room_for(dir: &Path, bytes: u64) -> Result<(), BroadcastError> {
    std::fs::create_dir_all(dir)
        .map_err(|e| BroadcastError::io(format!("making {}", dir.display()), e))?;
    let st = rustix::fs::statvfs(dir).map_err(|e| {
        BroadcastError::io(
            format!("statvfs {}", dir.display()),
            std::io::Error::from(e),
        )
    })?;
    let free = st.f_bavail.saturating_mul(st.f_frsize);
    if free < bytes {
        return Err(BroadcastError::io(
            format!("pulling into {}", dir.display()),
            std::io::Error::new(
                std::io::ErrorKind::StorageFull,
                format!("the payload needs {bytes} bytes, the filesystem has {free} free"),
            ),
        ));
    }
    Ok(())
}

/// The temporary name a file is written under until it is complete: hidden, and named for
/// this process, so a failed pull never leaves a file that looks complete.
pub(crate) fn partial_name(dir: &Path, name: &str) -> std::path::PathBuf {
    dir.join(format!(".{name}.ferry-partial.{}", std::process::id()))
}

/// Pulling into files: chunk `c`, landed in `slot`, copied out (counted in `copied`), verified
/// against its BLAKE3 and, if it matches, written to `file` at its offset. `Ok(false)`: a
/// mismatch (nothing written); `Err`: the write failed.
pub(crate) fn land(
    slot: &Slice,
    c: &Chunk,
    file: &std::fs::File,
    copied: &AtomicU64,
) -> std::io::Result<bool> {
    use std::os::unix::fs::FileExt;
    let mut buf = vec![0u8; c.len as usize];
    slot.read(0, &mut buf).map_err(std::io::Error::other)?;
    if slot.is_host() {
        copied.fetch_add(c.len, Ordering::Relaxed);
    }
    if Digest::from(blake3::hash(&buf)) != c.blake3 {
        return Ok(false);
    }
    file.write_all_at(&buf, c.offset)?;
    Ok(true)
}

/// Pulling into files: the CRC-32C of `len` bytes of `file` from `at`, read in pieces of at
/// most 1 MiB into `buf` (counted in `copied`).
pub(crate) fn crc_of_file(
    file: &std::fs::File,
    at: u64,
    len: u64,
    buf: &mut Vec<u8>,
    copied: &AtomicU64,
) -> std::io::Result<u32> {
    use std::os::unix::fs::FileExt;
    const PIECE: u64 = 1 << 20;
    let mut crc = 0;
    let mut done = 0;
    while done < len {
        let n = PIECE.min(len - done);
        buf.resize(n as usize, 0);
        file.read_exact_at(buf, at + done)?;
        crc = ferry::checksum::crc32c_append(crc, buf);
        done += n;
    }
    copied.fetch_add(len, Ordering::Relaxed);
    Ok(crc)
}
