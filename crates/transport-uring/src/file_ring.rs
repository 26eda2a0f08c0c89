//! The io_uring accelerator of file segments: [`FileRing::io`], one positioned read or write on a
//! stream's ring (the server moves a [`FileSegment`]'s pieces with it, O_DIRECT where alignment
//! allows), and [`read_file_into`], which loads a file range with a bounded queue depth of ring
//! reads. The segments themselves, and the portable positioned-read path this falls back to,
//! live in `ferry-file`.

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd};
use std::path::Path;

use ferry_core::{Access, MemoryRegion};
use ferry_file::{FileError, FileSegment};
use io_uring::{IoUring, opcode, types};

use crate::error::UringError;

/// A ring of one thread for positioned file reads and writes ([`FileRing::io`]), made at its
/// first use. One operation at a time: nothing of it is in flight between calls.
#[derive(Default)]
pub(crate) struct FileRing {
    ring: Option<IoUring>,
    /// The user data of the next operation: a completion is taken only as its own op's.
    next: u64,
}

impl FileRing {
    /// Runs one positioned read or write on the ring until `len` bytes moved (short transfers
    /// are resubmitted). A read that meets end of file early returns the bytes read.
    ///
    /// Never more than one operation on the buffer: the next piece is submitted only once the
    /// kernel completed the previous one (its own completion, by user data; a wait that ends
    /// without it, a signal say, waits again), and it returns only when nothing it submitted is
    /// in flight (an error of the wait is not returned while an operation still runs into the
    /// buffer).
    ///
    /// # Safety
    /// `buf..buf+len` must be valid for the transfer (writes for a read) and unaliased until the
    /// call returns.
    pub(crate) unsafe fn io(
        &mut self,
        fd: BorrowedFd<'_>,
        write: bool,
        buf: *mut u8,
        len: usize,
        offset: u64,
    ) -> io::Result<usize> {
        let fd = fd.as_raw_fd();
        let mut done = 0usize;
        while done < len {
            let ring = match &mut self.ring {
                Some(r) => r,
                None => self.ring.insert(IoUring::new(4)?),
            };
            let ask = (len - done).min(1 << 30) as u32;
            // SAFETY: `done < len`, inside the caller's range.
            let p = unsafe { buf.add(done) };
            let at = offset + done as u64;
            let e = if write {
                opcode::Write::new(types::Fd(fd), p, ask).offset(at).build()
            } else {
                opcode::Read::new(types::Fd(fd), p, ask).offset(at).build()
            };
            let id = self.next;
            self.next = self.next.wrapping_add(1);
            // SAFETY: the buffer is valid per this function's contract until the completion,
            // which `complete` waits for before anything else is submitted or this returns.
            if unsafe { ring.submission().push(&e.user_data(id)) }.is_err() {
                // Never the case with one operation at a time on a ring of four entries.
                return Err(io::Error::other("io_uring submission queue full"));
            }
            let res = match complete(ring, id) {
                Ok(res) => res,
                Err(e) => {
                    // The entry was never taken by the kernel (nothing runs into the buffer):
                    // the ring goes with it, so no later call submits it.
                    self.ring = None;
                    return Err(e);
                }
            };
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
}

/// Submits the one entry queued on `ring` (user data `id`) and waits for its completion: its
/// result. An error only where the kernel never took the entry; once it did, every wait that
/// fails is waited again (a failing `io_uring_enter` gives way to polling the completion queue,
/// whose entry the kernel posts whatever the wait does).
fn complete(ring: &mut IoUring, id: u64) -> io::Result<i32> {
    let mut taken = false;
    loop {
        if taken && let Some(res) = take(ring, id) {
            return Ok(res);
        }
        match ring.submit_and_wait(1) {
            // The entry is taken once the submission queue is empty (the count is of entries
            // submitted by this call, 0 on a wait after the first).
            Ok(_) => taken |= ring.submission().is_empty(),
            Err(e)
                if matches!(
                    e.raw_os_error(),
                    Some(libc::EINTR | libc::EBUSY | libc::EAGAIN)
                ) =>
            {
                taken |= ring.submission().is_empty();
            }
            Err(e) => {
                if !ring.submission().is_empty() && !taken {
                    return Err(e);
                }
                taken = true;
                tracing::debug!(error = %e, "waiting on a file ring failed; polling its completion");
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
        }
    }
}

/// The result of the completion with user data `id`, if it came (any other is not ours and is
/// dropped: nothing else runs on a file ring).
fn take(ring: &mut IoUring, id: u64) -> Option<i32> {
    let mut found = None;
    for c in ring.completion() {
        if c.user_data() == id {
            found = Some(c.result());
        }
    }
    found
}

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

#[cfg(test)]
mod tests {
    use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd};
    use std::os::unix::thread::JoinHandleExt;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::{Duration, Instant};

    use super::FileRing;

    static SIGNALS: AtomicUsize = AtomicUsize::new(0);

    extern "C" fn on_signal(_: libc::c_int) {
        SIGNALS.fetch_add(1, Ordering::SeqCst);
    }

    /// A SIGUSR2 handler that only counts, installed without `SA_RESTART`, so that a wait it
    /// interrupts returns early.
    fn install_handler() {
        static ONCE: std::sync::Once = std::sync::Once::new();
        ONCE.call_once(|| {
            // SAFETY: a zeroed sigaction with a handler that only touches an atomic, for a
            // signal nothing else in this test binary uses.
            unsafe {
                let mut sa: libc::sigaction = std::mem::zeroed();
                sa.sa_sigaction = on_signal as extern "C" fn(libc::c_int) as usize;
                libc::sigemptyset(&mut sa.sa_mask);
                assert_eq!(libc::sigaction(libc::SIGUSR2, &sa, std::ptr::null_mut()), 0);
            }
        });
    }

    /// Whether thread `tid` of this process is in `io_uring_enter` now.
    fn in_enter(tid: i32) -> bool {
        std::fs::read_to_string(format!("/proc/self/task/{tid}/syscall")).is_ok_and(|s| {
            s.split_whitespace().next() == Some(&libc::SYS_io_uring_enter.to_string())
        })
    }

    fn wait_for(what: &str, mut cond: impl FnMut() -> bool) {
        let end = Instant::now() + Duration::from_secs(20);
        while !cond() {
            assert!(Instant::now() < end, "timed out waiting for {what}");
            std::thread::yield_now();
        }
    }

    /// The submission and completion tails of a ring, from its descriptor's fdinfo.
    fn tails(ring: &io_uring::IoUring) -> (u64, u64) {
        let info = std::fs::read_to_string(format!("/proc/self/fdinfo/{}", ring.as_raw_fd()))
            .expect("fdinfo of the ring");
        let field = |name: &str| -> u64 {
            info.lines()
                .find_map(|l| l.strip_prefix(name))
                .and_then(|v| v.trim().parse().ok())
                .unwrap_or_else(|| panic!("no {name} in the ring's fdinfo:\n{info}"))
        };
        (field("SqTail:"), field("CqTail:"))
    }

    /// A read whose wait a signal interrupts is waited for again: no second read goes on its
    /// buffer, and once the call returned every read it submitted has completed.
    #[test]
    fn a_signal_in_the_wait_never_puts_a_second_read_on_the_buffer() {
        if io_uring::IoUring::new(4).is_err() {
            ferry_tests::require_or_skip(ferry_tests::URING, "the kernel refuses io_uring rings");
            return;
        }
        install_handler();
        let mut fds = [0; 2];
        // SAFETY: pipe2 fills two descriptors we then own.
        assert_eq!(unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) }, 0);
        // SAFETY: fresh descriptors from pipe2, owned here.
        let (r, w) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
        let (tid_tx, tid_rx) = std::sync::mpsc::channel();
        let reader = std::thread::spawn(move || {
            // SAFETY: gettid has no preconditions.
            tid_tx.send(unsafe { libc::gettid() }).unwrap();
            let mut buf = vec![0u8; 8];
            let mut ring = FileRing::default();
            // SAFETY: `buf` holds 8 bytes and outlives the ring (leaked below).
            let got = unsafe { ring.io(r.as_fd(), false, buf.as_mut_ptr(), 8, 0) };
            let tails = tails(ring.ring.as_ref().expect("the ring was made"));
            // Whatever the kernel may still do with it: never freed.
            std::mem::forget(buf.clone());
            let first = buf.clone();
            std::mem::forget(buf);
            std::mem::forget(ring);
            (got.map_err(|e| e.to_string()), first, tails)
        });
        let tid = tid_rx.recv().unwrap();
        wait_for("the read's wait", || in_enter(tid));
        let before = SIGNALS.load(Ordering::SeqCst);
        // SAFETY: the thread is alive (it is joined below), and SIGUSR2 has a handler.
        let sent = unsafe { libc::pthread_kill(reader.as_pthread_t(), libc::SIGUSR2) };
        assert_eq!(sent, 0);
        wait_for("the signal", || SIGNALS.load(Ordering::SeqCst) > before);
        wait_for("the wait after the signal", || in_enter(tid));
        // SAFETY: writes 8 bytes from a local to the pipe we own.
        let wrote = unsafe { libc::write(w.as_raw_fd(), b"12345678".as_ptr().cast(), 8) };
        assert_eq!(wrote, 8);
        let (got, bytes, (sq, cq)) = reader.join().unwrap();
        assert_eq!(got, Ok(8));
        assert_eq!(bytes, b"12345678");
        assert_eq!(sq, 1, "reads submitted for one 8-byte read");
        assert_eq!(cq, sq, "a read still in flight when the call returned");
    }
}
