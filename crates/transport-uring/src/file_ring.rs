//! The io_uring accelerator of one-shot file loads: [`read_file_into`], which loads a file range
//! with a bounded queue depth of ring reads on a ring of its own. (A server serves a
//! [`FileSegment`]'s pieces as ordinary operations of the stream's ring, `server/stream.rs`.) The
//! segments themselves, and the portable positioned-read path this falls back to, live in
//! `ferry-file`.

use std::io;
use std::os::fd::AsRawFd;
use std::path::Path;

use ferry_core::{Access, MemoryRegion};
use ferry_file::{FileError, FileSegment};
use io_uring::{IoUring, opcode, types};

use crate::error::UringError;

/// Loads `len` bytes of `path` from `file_offset` into `region` at `region_offset`, with up to
/// `queue_depth` reads of at most 1 MiB in flight on one ring. Chunks whose file offset, length
/// and destination address are 4096-aligned use O_DIRECT (READ_FIXED from the region when it can
/// be registered), the others buffered reads. Returns the bytes read (`len`; a file that ends
/// earlier is an error).
pub fn read_file_into(
    region: &MemoryRegion,
    region_offset: u64,
    path: impl AsRef<Path>,
    file_offset: u64,
    len: u64,
    queue_depth: usize,
) -> Result<u64, UringError> {
    const CHUNK: u64 = 1 << 20;
    let path = path.as_ref();
    if region.check(region_offset, len).is_err() {
        return Err(FileError::OutOfRange {
            what: "region",
            offset: region_offset,
            len,
            size: region.len() as u64,
        }
        .into());
    }
    // The range as a read-only segment: opened buffered and (where offered) O_DIRECT, checked
    // against the file's size now.
    let file = FileSegment::open_range(path, file_offset, len, Access::REMOTE_READ)?;
    let qd = queue_depth.clamp(1, 256);
    let mut ring = match IoUring::new((qd as u32).next_power_of_two()) {
        Ok(r) => r,
        Err(e) => {
            // Seccomp profiles (Docker's default among them) and `kernel.io_uring_disabled`
            // refuse rings: positioned reads then, slower but the same bytes.
            tracing::info!(error = %e, path = %path.display(), "no io_uring ring; positioned reads");
            return Ok(file.read_into(region, region_offset, 0, len)?);
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
    let read_err = |offset, source| {
        UringError::from(FileError::ReadFile {
            path: path.to_owned(),
            offset,
            source,
        })
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
            let (fd, direct) = file.read_fd(foff, n, addr);
            let fd = types::Fd(fd.as_raw_fd());
            let e = if direct && fixed {
                opcode::ReadFixed::new(fd, addr as *mut u8, n as u32, 0)
                    .offset(foff)
                    .build()
            } else {
                opcode::Read::new(fd, addr as *mut u8, n as u32)
                    .offset(foff)
                    .build()
            };
            // SAFETY: `at..at+n` lies inside the checked destination range, which this function
            // exclusively uses until every completion is reaped below.
            unsafe { ring.submission().push(&e.user_data(slot as u64)) }
                .map_err(|_| read_err(foff, io::Error::other("submission queue full")))?;
            inflight[slot] = Some((at, n));
            busy += 1;
        }
        enter(&mut ring).map_err(|e| read_err(file_offset, e))?;
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
                    if enter(&mut ring).is_err() {
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
                    if enter(&mut ring).is_err() {
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

/// Submits what is queued and waits for a completion, retrying where `io_uring_enter` consumed
/// nothing and a retry mends it (`EINTR`, `EBUSY`: a full completion queue, `EAGAIN`): a read
/// already in flight into the caller's memory must be waited for, not abandoned by an early
/// error return.
fn enter(ring: &mut IoUring) -> io::Result<()> {
    loop {
        match ring.submit_and_wait(1) {
            Ok(_) => return Ok(()),
            Err(e)
                if matches!(
                    e.raw_os_error(),
                    Some(libc::EINTR | libc::EBUSY | libc::EAGAIN)
                ) =>
            {
                if !ring.completion().is_empty() {
                    return Ok(());
                }
            }
            Err(e) => return Err(e),
        }
    }
}
