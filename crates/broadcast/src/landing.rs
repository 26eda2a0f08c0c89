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
    crate::layout::with_scratch(c.len as usize, |buf| {
        slot.read(0, buf).map_err(std::io::Error::other)?;
        if slot.is_host() {
            copied.fetch_add(c.len, Ordering::Relaxed);
        }
        if Digest::from(blake3::hash(buf)) != c.blake3 {
            return Ok(false);
        }
        file.write_all_at(buf, c.offset)?;
        Ok(true)
    })
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

/// The journal of a commit into a directory, `.ferry-commit.PID`: one line per file, the hidden
/// name it was written under and its final name (tab-separated). Its appearance is the commit
/// point (see [`commit`]).
const JOURNAL: &str = ".ferry-commit.";
/// Marks the hidden files of a pull: `.NAME.ferry-partial.PID`.
const PARTIAL: &str = ".ferry-partial.";

/// The test hook `FERRY_PULL_STOP_AT`: the process dies (abort: no destructor runs, as under
/// `SIGKILL`) at the named step of a commit: `synced` (every file complete and flushed, no
/// journal), `journal` (the journal written), `rename:N` (after the Nth rename), `renamed`
/// (every file renamed, the journal not removed yet). Tests kill a pull at each step this way,
/// not by timing.
fn stop_at(step: &str) {
    if std::env::var("FERRY_PULL_STOP_AT").is_ok_and(|s| s == step) {
        eprintln!("FERRY_PULL_STOP_AT={step}: dying here");
        std::process::abort();
    }
}

fn sync_dir(dir: &Path) -> std::io::Result<()> {
    std::fs::File::open(dir)?.sync_all()
}

/// Commits a pull into `dir` in one step: `files` (hidden name, final name; each complete and
/// flushed) become their final names. The journal is written (to a hidden name, flushed,
/// renamed: the commit point) before the first rename and removed after the last. Killed
/// before the journal appears, the directory is untouched (hidden files aside, which the next
/// pull into it removes); killed after, the next pull into it finishes the renames first
/// ([`recover`]). A reader that sees no `.ferry-commit.*` file sees a whole directory.
pub(crate) fn commit(dir: &Path, files: &[(String, String)]) -> std::io::Result<()> {
    use std::io::Write;
    stop_at("synced");
    let journal = dir.join(format!("{JOURNAL}{}", std::process::id()));
    let staged = dir.join(format!(".{JOURNAL}{}{PARTIAL}", std::process::id()));
    {
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .open(&staged)?;
        for (tmp, name) in files {
            writeln!(f, "{tmp}\t{name}")?;
        }
        f.sync_all()?;
    }
    std::fs::rename(&staged, &journal)?;
    sync_dir(dir)?;
    stop_at("journal");
    for (i, (tmp, name)) in files.iter().enumerate() {
        std::fs::rename(dir.join(tmp), dir.join(name))?;
        stop_at(&format!("rename:{}", i + 1));
    }
    sync_dir(dir)?;
    stop_at("renamed");
    std::fs::remove_file(&journal)?;
    sync_dir(dir)
}

/// Whether process `pid` runs (on this host's `/proc`).
fn alive(pid: &str) -> bool {
    pid.parse::<u32>()
        .is_ok_and(|p| p == std::process::id() || Path::new(&format!("/proc/{p}")).exists())
}

/// What a killed pull left in `dir`, set right: the commits it had journaled are finished (their
/// remaining renames done, the journal removed), and its hidden files are removed. Pulls still
/// running (their process alive) are left alone. Returns how many files were renamed and
/// removed. A missing `dir` has nothing to recover.
pub(crate) fn recover(dir: &Path) -> std::io::Result<(usize, usize)> {
    let entries = match std::fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok((0, 0)),
        Err(e) => return Err(e),
    };
    let names: Vec<String> = entries
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .collect();
    let (mut renamed, mut removed) = (0, 0);
    for n in &names {
        let Some(pid) = n.strip_prefix(JOURNAL) else {
            continue;
        };
        if alive(pid) {
            continue;
        }
        let text = std::fs::read_to_string(dir.join(n))?;
        for line in text.lines() {
            let Some((tmp, name)) = line.split_once('\t') else {
                continue;
            };
            // Plain names only, as the manifest's segment names are.
            if [tmp, name]
                .iter()
                .any(|s| s.is_empty() || s.contains('/') || *s == "..")
            {
                continue;
            }
            if dir.join(tmp).exists() {
                std::fs::rename(dir.join(tmp), dir.join(name))?;
                renamed += 1;
            }
        }
        sync_dir(dir)?;
        std::fs::remove_file(dir.join(n))?;
        tracing::info!(dir = %dir.display(), renamed, "finished the commit of a killed pull");
    }
    for n in &names {
        let Some(rest) = n.strip_prefix('.') else {
            continue;
        };
        let Some((_, pid)) = rest.rsplit_once(PARTIAL) else {
            continue;
        };
        // `.NAME.ferry-partial.PID` and a journal being written, `..ferry-commit.PID.ferry-partial.`.
        let pid = if pid.is_empty() {
            rest.rsplit_once(PARTIAL)
                .and_then(|(head, _)| head.strip_prefix(JOURNAL))
                .unwrap_or("")
        } else {
            pid
        };
        if alive(pid) {
            continue;
        }
        match std::fs::remove_file(dir.join(n)) {
            Ok(()) => removed += 1,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
    }
    if removed > 0 {
        tracing::info!(dir = %dir.display(), removed, "removed the hidden files of killed pulls");
    }
    Ok((renamed, removed))
}

/// Finishes what killed pulls left in `dir` ([`recover`]), as the broadcast's error.
pub(crate) fn recover_dir(dir: &Path) -> Result<(), BroadcastError> {
    recover(dir).map(|_| ()).map_err(|e| {
        BroadcastError::io(
            format!("recovering {} from a killed pull", dir.display()),
            e,
        )
    })
}
