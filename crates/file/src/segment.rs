//! [`FileSegment`]: a file's byte range served to peers like registered memory, and
//! [`read_file_into`], which loads a file range into registered memory with positioned reads.

use std::fmt;
use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::{AsFd, BorrowedFd};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use ferry_core::{Access, MemoryRegion, OpKind, RemoteStatus};

use crate::error::FileError;

/// Block size O_DIRECT transfers are aligned to.
pub const DIRECT_ALIGN: u64 = 4096;

/// A published file range. Cheap to share (`Arc`); holding it keeps the file open.
pub struct FileSegment {
    path: PathBuf,
    buffered: File,
    direct: Option<File>,
    base: u64,
    len: u64,
    access: Access,
}

impl fmt::Debug for FileSegment {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FileSegment")
            .field("path", &self.path)
            .field("base", &self.base)
            .field("len", &self.len)
            .field("access", &self.access)
            .field("direct", &self.direct.is_some())
            .finish()
    }
}

fn open(path: &Path, write: bool, direct: bool) -> io::Result<File> {
    let mut o = OpenOptions::new();
    o.read(true).write(write);
    if direct {
        o.custom_flags(libc::O_DIRECT);
    }
    o.open(path)
}

impl FileSegment {
    /// Publishes the whole of `path` (its size now) with `access` for peers. Write access opens the
    /// file read-write; peers can never extend it.
    pub fn open(path: impl AsRef<Path>, access: Access) -> Result<Self, FileError> {
        let path = path.as_ref();
        let size = std::fs::metadata(path)
            .map_err(|source| FileError::OpenFile {
                path: path.to_owned(),
                source,
            })?
            .len();
        Self::open_range(path, 0, size, access)
    }

    /// Publishes `offset..offset+len` of `path`. The range must lie inside the file now.
    pub fn open_range(
        path: impl AsRef<Path>,
        offset: u64,
        len: u64,
        access: Access,
    ) -> Result<Self, FileError> {
        let path = path.as_ref().to_owned();
        let write = access.contains(Access::REMOTE_WRITE);
        let buffered = open(&path, write, false).map_err(|source| FileError::OpenFile {
            path: path.clone(),
            source,
        })?;
        let size = buffered
            .metadata()
            .map_err(|source| FileError::OpenFile {
                path: path.clone(),
                source,
            })?
            .len();
        if ferry_core::check_range(offset, len, size).is_err() {
            return Err(FileError::OutOfRange {
                what: "file",
                offset,
                len,
                size,
            });
        }
        // O_DIRECT is not offered by every filesystem (tmpfs refuses it): buffered then.
        let direct = match open(&path, false, true) {
            Ok(f) => Some(f),
            Err(e) => {
                tracing::debug!(path = %path.display(), error = %e, "no O_DIRECT; buffered reads");
                None
            }
        };
        Ok(Self {
            path,
            buffered,
            direct,
            base: offset,
            len,
            access,
        })
    }

    /// The file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Segment length.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether the segment is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Rights peers have.
    pub fn access(&self) -> Access {
        self.access
    }

    /// Offset of the segment in the file.
    pub fn base(&self) -> u64 {
        self.base
    }

    /// Whether O_DIRECT reads are possible on this file.
    pub fn direct_capable(&self) -> bool {
        self.direct.is_some()
    }

    /// Checks an op of `kind` on `offset..offset+len` of the segment: access first, then bounds
    /// (against the segment, and for a WRITE against the file's size now, so a WRITE can never
    /// extend a file that shrank). Returns the file offset.
    pub fn check(&self, kind: OpKind, offset: u64, len: u64) -> Result<u64, RemoteStatus> {
        if !self.access.contains(kind.needed_access()) {
            return Err(RemoteStatus::AccessDenied);
        }
        ferry_core::check_range(offset, len, self.len).map_err(|_| RemoteStatus::OutOfBounds)?;
        let at = self
            .base
            .checked_add(offset)
            .ok_or(RemoteStatus::OutOfBounds)?;
        if kind == OpKind::Write {
            let size = self
                .buffered
                .metadata()
                .map_err(|_| RemoteStatus::OutOfBounds)?
                .len();
            ferry_core::check_range(at, len, size).map_err(|_| RemoteStatus::OutOfBounds)?;
        }
        Ok(at)
    }

    /// The file to read `file_offset..+len` (file offsets) into memory at `addr` with, for
    /// drivers that do their own I/O (the io_uring transport), and whether it is the O_DIRECT one:
    /// that is only offered when the offset, the length and `addr` are all multiples of
    /// [`DIRECT_ALIGN`]. Reads through it must stay inside the range [`check`](Self::check)
    /// allowed.
    pub fn read_fd(&self, file_offset: u64, len: u64, addr: usize) -> (BorrowedFd<'_>, bool) {
        match &self.direct {
            Some(d) if direct_ok(file_offset, len, addr) => (d.as_fd(), true),
            _ => (self.buffered.as_fd(), false),
        }
    }

    /// The file to write with, for drivers that do their own I/O: buffered, opened read-write
    /// only when the segment has `Access::REMOTE_WRITE`. Writes through it must stay inside the
    /// range [`check`](Self::check) allowed, which never extends the file.
    pub fn write_fd(&self) -> BorrowedFd<'_> {
        self.buffered.as_fd()
    }

    /// Loads `offset..offset+len` of the segment into `region` at `region_offset` with
    /// positioned reads of up to 1 MiB through a bounce buffer (what the io_uring transport
    /// falls back to where the kernel refuses rings). Returns the bytes read (`len`; a file that
    /// ends earlier is an error).
    pub fn read_into(
        &self,
        region: &MemoryRegion,
        region_offset: u64,
        offset: u64,
        len: u64,
    ) -> Result<u64, FileError> {
        ferry_core::check_range(offset, len, self.len).map_err(|_| FileError::OutOfRange {
            what: "file segment",
            offset,
            len,
            size: self.len,
        })?;
        read_file_into_positioned(
            region,
            region_offset,
            &self.buffered,
            &self.path,
            self.base + offset,
            len,
        )
    }

    /// `e`, with the file, the range and what was being done in its message (the kind kept).
    fn io_error(&self, doing: &str, len: usize, at: u64, e: io::Error) -> io::Error {
        io::Error::new(
            e.kind(),
            format!(
                "{doing} {len} bytes at {at} of {}: {e}",
                self.path.display()
            ),
        )
    }
}

impl ferry_core::FileSource for FileSegment {
    fn check(&self, kind: OpKind, offset: u64, len: u64) -> Result<u64, RemoteStatus> {
        FileSegment::check(self, kind, offset, len)
    }

    fn read_exact_at(&self, at: u64, buf: &mut [u8]) -> io::Result<()> {
        std::os::unix::fs::FileExt::read_exact_at(&self.buffered, buf, at)
            .map_err(|e| self.io_error("reading", buf.len(), at, e))
    }

    fn write_all_at(&self, at: u64, buf: &[u8]) -> io::Result<()> {
        std::os::unix::fs::FileExt::write_all_at(&self.buffered, buf, at)
            .map_err(|e| self.io_error("writing", buf.len(), at, e))
    }
}

fn direct_ok(file_offset: u64, len: u64, addr: usize) -> bool {
    file_offset.is_multiple_of(DIRECT_ALIGN)
        && len.is_multiple_of(DIRECT_ALIGN)
        && (addr as u64).is_multiple_of(DIRECT_ALIGN)
}

/// Loads `len` bytes of `path` from `file_offset` into `region` at `region_offset` with
/// positioned reads (`pread`) of up to 1 MiB through a bounce buffer: the portable path, which
/// any data plane can use (the io_uring transport has a faster one with a bounded queue depth
/// and O_DIRECT). Returns the bytes read (`len`; a file that ends earlier is an error).
pub fn read_file_into(
    region: &MemoryRegion,
    region_offset: u64,
    path: impl AsRef<Path>,
    file_offset: u64,
    len: u64,
) -> Result<u64, FileError> {
    let path = path.as_ref();
    let file = open(path, false, false).map_err(|source| FileError::OpenFile {
        path: path.to_owned(),
        source,
    })?;
    read_file_into_positioned(region, region_offset, &file, path, file_offset, len)
}

fn read_file_into_positioned(
    region: &MemoryRegion,
    region_offset: u64,
    file: &File,
    path: &Path,
    file_offset: u64,
    len: u64,
) -> Result<u64, FileError> {
    const CHUNK: u64 = 1 << 20;
    if region.check(region_offset, len).is_err() {
        return Err(FileError::OutOfRange {
            what: "region",
            offset: region_offset,
            len,
            size: region.len() as u64,
        });
    }
    let size = file
        .metadata()
        .map_err(|source| FileError::OpenFile {
            path: path.to_owned(),
            source,
        })?
        .len();
    if ferry_core::check_range(file_offset, len, size).is_err() {
        return Err(FileError::OutOfRange {
            what: "file",
            offset: file_offset,
            len,
            size,
        });
    }
    let mut buf = vec![0u8; CHUNK.min(len) as usize];
    let mut done = 0u64;
    while done < len {
        let n = CHUNK.min(len - done) as usize;
        std::os::unix::fs::FileExt::read_exact_at(file, &mut buf[..n], file_offset + done)
            .map_err(|source| FileError::ReadFile {
                path: path.to_owned(),
                offset: file_offset + done,
                source,
            })?;
        region
            .write_at(region_offset + done, &buf[..n])
            .map_err(|e| FileError::OutOfRange {
                what: "region",
                offset: e.offset,
                len: e.len,
                size: e.size,
            })?;
        done += n as u64;
    }
    Ok(len)
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferry_core::FileSource;

    #[test]
    fn positioned_io_errors_name_the_file_and_range() {
        let path = std::env::temp_dir().join(format!("ferry-file-err-{}", std::process::id()));
        std::fs::write(&path, [1u8; 100]).unwrap();
        let seg = FileSegment::open(&path, Access::REMOTE_READ).unwrap();
        let mut buf = [0u8; 10];
        let e = FileSource::read_exact_at(&seg, 95, &mut buf).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::UnexpectedEof);
        let msg = e.to_string();
        assert!(
            msg.contains("reading 10 bytes at 95") && msg.contains(&path.display().to_string()),
            "{msg}"
        );
        FileSource::read_exact_at(&seg, 90, &mut buf).unwrap();
        assert_eq!(buf, [1u8; 10]);
        let _ = std::fs::remove_file(&path);
    }
}
