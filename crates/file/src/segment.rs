//! File segments: a file's byte range served to peers like registered memory, read and written
//! with io_uring (O_DIRECT when offset, length and buffer alignment allow, buffered otherwise), and
//! [`read_file_into`], which loads a file range into registered memory with a bounded queue depth.

use std::fmt;
use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use ferry_core::{Access, MemoryRegion, OpKind, RemoteStatus};
use io_uring::{IoUring, opcode, types};

use crate::error::UringError;

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
    pub fn open(path: impl AsRef<Path>, access: Access) -> Result<Self, UringError> {
        let path = path.as_ref();
        let size = std::fs::metadata(path)
            .map_err(|source| UringError::OpenFile {
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
    ) -> Result<Self, UringError> {
        let path = path.as_ref().to_owned();
        let write = access.contains(Access::REMOTE_WRITE);
        let buffered = open(&path, write, false).map_err(|source| UringError::OpenFile {
            path: path.clone(),
            source,
        })?;
        let size = buffered
            .metadata()
            .map_err(|source| UringError::OpenFile {
                path: path.clone(),
                source,
            })?
            .len();
        if ferry_core::check_range(offset, len, size).is_err() {
            return Err(UringError::OutOfRange {
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

    /// The fd to read `file_offset..+len` into memory at `addr` with, and whether it is O_DIRECT.
    pub(crate) fn read_fd(&self, file_offset: u64, len: u64, addr: usize) -> (i32, bool) {
        match &self.direct {
            Some(d) if direct_ok(file_offset, len, addr) => (d.as_raw_fd(), true),
            _ => (self.buffered.as_raw_fd(), false),
        }
    }

    pub(crate) fn write_fd(&self) -> i32 {
        self.buffered.as_raw_fd()
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

/// Runs one positioned read or write on `ring` until `len` bytes moved (short transfers are
/// resubmitted). A read that meets end of file early returns the bytes read.
///
/// # Safety
/// `buf..buf+len` must be valid for the transfer (writes for a read) and unaliased.
pub(crate) unsafe fn file_io(
    ring: &mut IoUring,
    fd: i32,
    write: bool,
    buf: *mut u8,
    len: usize,
    offset: u64,
) -> io::Result<usize> {
    let mut done = 0usize;
    while done < len {
        let ask = (len - done).min(1 << 30) as u32;
        // SAFETY: `done < len`, inside the caller's range.
        let p = unsafe { buf.add(done) };
        let at = offset + done as u64;
        let e = if write {
            opcode::Write::new(types::Fd(fd), p, ask).offset(at).build()
        } else {
            opcode::Read::new(types::Fd(fd), p, ask).offset(at).build()
        };
        // SAFETY: the buffer is valid per this function's contract until the completion, which
        // is awaited below.
        unsafe { ring.submission().push(&e.user_data(7)) }
            .map_err(|_| io::Error::other("io_uring submission queue full"))?;
        ring.submit_and_wait(1)?;
        let Some(c) = ring.completion().next() else {
            continue;
        };
        let res = c.result();
        if res < 0 {
            if res == -libc::EINTR || res == -libc::EAGAIN {
                continue;
            }
            return Err(io::Error::from_raw_os_error(-res));
        }
        if res == 0 {
            break;
        }
        done += res as usize;
    }
    Ok(done)
}

/// Loads `len` bytes of `path` from `file_offset` into `region` at `region_offset` with
/// positioned reads (`pread`) of up to 1 MiB through a bounce buffer: what
/// [`read_file_into`] does where the kernel refuses io_uring, and what an engine whose data
/// plane is TCP uses. Returns the bytes read (`len`; a file that ends earlier is an error).
pub fn read_file_into_buffered(
    region: &Arc<MemoryRegion>,
    region_offset: u64,
    path: impl AsRef<Path>,
    file_offset: u64,
    len: u64,
) -> Result<u64, UringError> {
    let path = path.as_ref();
    let file = open(path, false, false).map_err(|source| UringError::OpenFile {
        path: path.to_owned(),
        source,
    })?;
    read_file_into_positioned(region, region_offset, &file, path, file_offset, len)
}

fn read_file_into_positioned(
    region: &Arc<MemoryRegion>,
    region_offset: u64,
    file: &File,
    path: &Path,
    file_offset: u64,
    len: u64,
) -> Result<u64, UringError> {
    const CHUNK: u64 = 1 << 20;
    if region.check(region_offset, len).is_err() {
        return Err(UringError::OutOfRange {
            what: "region",
            offset: region_offset,
            len,
            size: region.len() as u64,
        });
    }
    let size = file
        .metadata()
        .map_err(|source| UringError::OpenFile {
            path: path.to_owned(),
            source,
        })?
        .len();
    if ferry_core::check_range(file_offset, len, size).is_err() {
        return Err(UringError::OutOfRange {
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
            .map_err(|source| UringError::ReadFile {
                path: path.to_owned(),
                offset: file_offset + done,
                source,
            })?;
        region
            .write_at(region_offset + done, &buf[..n])
            .map_err(|e| UringError::OutOfRange {
                what: "region",
                offset: e.offset,
                len: e.len,
                size: e.size,
            })?;
        done += n as u64;
    }
    Ok(len)
}

/// Loads `len` bytes of `path` from `file_offset` into `region` at `region_offset`, with up to
/// `queue_depth` reads of at most 1 MiB in flight on one ring. Chunks whose file offset, length
/// and destination address are 4096-aligned use O_DIRECT (READ_FIXED from the region when it can
/// be registered), the others buffered reads. Returns the bytes read (`len`; a file that ends
/// earlier is an error).
pub fn read_file_into(
    region: &Arc<MemoryRegion>,
    region_offset: u64,
    path: impl AsRef<Path>,
    file_offset: u64,
    len: u64,
    queue_depth: usize,
) -> Result<u64, UringError> {
    const CHUNK: u64 = 1 << 20;
    let path = path.as_ref();
    if region.check(region_offset, len).is_err() {
        return Err(UringError::OutOfRange {
            what: "region",
            offset: region_offset,
            len,
            size: region.len() as u64,
        });
    }
    let open_err = |source| UringError::OpenFile {
        path: path.to_owned(),
        source,
    };
    let buffered = open(path, false, false).map_err(open_err)?;
    let size = buffered.metadata().map_err(open_err)?.len();
    if ferry_core::check_range(file_offset, len, size).is_err() {
        return Err(UringError::OutOfRange {
            what: "file",
            offset: file_offset,
            len,
            size,
        });
    }
    let direct = open(path, false, true).ok();
    let qd = queue_depth.clamp(1, 256);
    let mut ring = match IoUring::new((qd as u32).next_power_of_two()) {
        Ok(r) => r,
        Err(e) => {
            // Seccomp profiles (Docker's default among them) and `kernel.io_uring_disabled`
            // refuse rings: positioned reads then, slower but the same bytes.
            tracing::info!(error = %e, path = %path.display(), "no io_uring ring; positioned reads");
            return read_file_into_positioned(
                region,
                region_offset,
                &buffered,
                path,
                file_offset,
                len,
            );
        }
    };
    let base = region.as_ptr() as usize + region_offset as usize;
    // Register the destination range as one fixed buffer when the kernel lets us.
    let fixed = if len > 0 && len <= 1 << 30 {
        let iov = libc::iovec {
            iov_base: base as *mut libc::c_void,
            iov_len: len as usize,
        };
        // SAFETY: the range lies inside `region` (checked above), which outlives the ring (the
        // ring is dropped at the end of this function, with the registration).
        unsafe { ring.submitter().register_buffers(&[iov]) }.is_ok()
    } else {
        false
    };
    let read_err = |offset, source| UringError::ReadFile {
        path: path.to_owned(),
        offset,
        source,
    };
    // Pending pieces: (offset in the range, length). Short reads push the remainder back.
    let mut todo: std::collections::VecDeque<(u64, u64)> = (0..len.div_ceil(CHUNK))
        .map(|i| (i * CHUNK, CHUNK.min(len - i * CHUNK)))
        .collect();
    let mut inflight: Vec<Option<(u64, u64)>> = vec![None; qd];
    let mut busy = 0usize;
    while !todo.is_empty() || busy > 0 {
        while busy < qd {
            let Some((at, n)) = todo.pop_front() else {
                break;
            };
            let slot = inflight.iter().position(Option::is_none).unwrap_or(0);
            let addr = base + at as usize;
            let foff = file_offset + at;
            let e = match &direct {
                Some(d) if direct_ok(foff, n, addr) => {
                    if fixed {
                        opcode::ReadFixed::new(
                            types::Fd(d.as_raw_fd()),
                            addr as *mut u8,
                            n as u32,
                            0,
                        )
                        .offset(foff)
                        .build()
                    } else {
                        opcode::Read::new(types::Fd(d.as_raw_fd()), addr as *mut u8, n as u32)
                            .offset(foff)
                            .build()
                    }
                }
                _ => opcode::Read::new(types::Fd(buffered.as_raw_fd()), addr as *mut u8, n as u32)
                    .offset(foff)
                    .build(),
            };
            // SAFETY: `at..at+n` lies inside the checked destination range, which this function
            // exclusively uses until every completion is reaped below.
            unsafe { ring.submission().push(&e.user_data(slot as u64)) }
                .map_err(|_| read_err(foff, io::Error::other("submission queue full")))?;
            inflight[slot] = Some((at, n));
            busy += 1;
        }
        ring.submit_and_wait(1)
            .map_err(|e| read_err(file_offset, e))?;
        let done: Vec<(u64, i32)> = ring
            .completion()
            .map(|c| (c.user_data(), c.result()))
            .collect();
        for (slot, res) in done {
            let Some((at, n)) = inflight.get_mut(slot as usize).and_then(Option::take) else {
                continue;
            };
            busy -= 1;
            if res < 0 {
                if res == -libc::EINTR || res == -libc::EAGAIN {
                    todo.push_front((at, n));
                    continue;
                }
                // Drain what is in flight before returning: the kernel still writes the region.
                while busy > 0 {
                    if ring.submit_and_wait(1).is_err() {
                        break;
                    }
                    busy -= ring.completion().count();
                }
                return Err(read_err(
                    file_offset + at,
                    io::Error::from_raw_os_error(-res),
                ));
            }
            let got = res as u64;
            if got == 0 {
                while busy > 0 {
                    if ring.submit_and_wait(1).is_err() {
                        break;
                    }
                    busy -= ring.completion().count();
                }
                return Err(read_err(
                    file_offset + at,
                    io::Error::new(io::ErrorKind::UnexpectedEof, "file ended early"),
                ));
            }
            if got < n {
                todo.push_front((at + got, n - got));
            }
        }
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
