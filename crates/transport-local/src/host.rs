//! What the host says about itself and its processes: the boot id, Yama's ptrace policy, a
//! socket peer's credentials, and the process-to-process copies themselves. The only module of
//! the crate that makes raw system calls.

use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::sync::{Mutex, PoisonError};

/// This host's boot id (`/proc/sys/kernel/random/boot_id`, a UUID) as 16 bytes: two processes
/// with the same one run under one kernel, since it boots.
pub(crate) fn boot_id() -> io::Result<[u8; 16]> {
    let text = std::fs::read_to_string("/proc/sys/kernel/random/boot_id")?;
    parse_boot_id(text.trim()).ok_or_else(|| {
        io::Error::new(
            io::ErrorKind::InvalidData,
            format!("boot id {text:?} is not a UUID"),
        )
    })
}

fn parse_boot_id(text: &str) -> Option<[u8; 16]> {
    let hex: Vec<u8> = text.bytes().filter(|b| *b != b'-').collect();
    if hex.len() != 32 {
        return None;
    }
    let mut out = [0u8; 16];
    for (i, pair) in hex.chunks(2).enumerate() {
        let s = std::str::from_utf8(pair).ok()?;
        out[i] = u8::from_str_radix(s, 16).ok()?;
    }
    Some(out)
}

/// Yama's `ptrace_scope` (0: classic same-user rules, 1: only ancestors and a tracer the process
/// names, 2: only `CAP_SYS_PTRACE`, 3: none), or `None` where Yama is not built in.
pub(crate) fn yama_scope() -> Option<u8> {
    std::fs::read_to_string("/proc/sys/kernel/yama/ptrace_scope")
        .ok()
        .and_then(|s| s.trim().parse().ok())
}

/// The process this one named as its tracer (`PR_SET_PTRACER`), if it named one.
static TRACER: Mutex<Option<u32>> = Mutex::new(None);

/// Lets process `pid` copy into and out of this process's memory where Yama asks for a named
/// tracer (scope 1): `PR_SET_PTRACER`. Yama keeps one named tracer per process, so a second
/// live same-host server is refused (its channel takes the network planes) rather than taking
/// the grant from the first. Nothing to do at scope 0 or without Yama; at scope 2 or 3 only
/// privilege helps, and the copy probe at attach tells.
pub(crate) fn allow_tracer(pid: u32) -> Result<(), String> {
    if yama_scope() != Some(1) {
        return Ok(());
    }
    let mut named = TRACER.lock().unwrap_or_else(PoisonError::into_inner);
    if let Some(other) = *named
        && other != pid
        && alive(other)
    {
        return Err(format!(
            "Yama (ptrace_scope 1) lets a process name one tracer, and this one already named \
             pid {other}, another same-host peer"
        ));
    }
    // SAFETY: PR_SET_PTRACER takes a pid by value; no memory is passed.
    let rc = unsafe {
        libc::prctl(
            libc::PR_SET_PTRACER,
            libc::c_ulong::from(pid),
            0 as libc::c_ulong,
            0 as libc::c_ulong,
            0 as libc::c_ulong,
        )
    };
    if rc != 0 {
        return Err(format!(
            "prctl(PR_SET_PTRACER, {pid}): {}",
            io::Error::last_os_error()
        ));
    }
    *named = Some(pid);
    Ok(())
}

fn alive(pid: u32) -> bool {
    let Ok(pid) = libc::pid_t::try_from(pid) else {
        return false;
    };
    // SAFETY: signal 0 only checks that the process exists.
    let rc = unsafe { libc::kill(pid, 0) };
    rc == 0 || io::Error::last_os_error().raw_os_error() == Some(libc::EPERM)
}

/// The pid and uid of the process at the other end of `sock`, as the kernel recorded them when
/// it connected (`SO_PEERCRED`); a pid of 0 is a process outside this pid namespace.
pub(crate) fn peer_credentials(sock: &UnixStream) -> io::Result<(u32, u32)> {
    let mut cred = libc::ucred {
        pid: 0,
        uid: 0,
        gid: 0,
    };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: `cred` and `len` are valid for writes of the sizes passed; the fd is open for the
    // life of `sock`.
    let rc = unsafe {
        libc::getsockopt(
            sock.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&raw mut cred).cast(),
            &mut len,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok((u32::try_from(cred.pid).unwrap_or(0), cred.uid))
}

/// A process held by a pid file descriptor (`pidfd_open`): it names that process, never a later
/// one that reuses its pid, so a server can tell that the client it attached has exited before
/// it copies to or from the pid again.
#[derive(Debug)]
pub(crate) struct Pidfd(std::os::fd::OwnedFd);

impl Pidfd {
    /// Holds process `pid` (Linux 5.3 and later; an older kernel's `ENOSYS` is an error).
    pub(crate) fn open(pid: u32) -> io::Result<Self> {
        let pid = libc::pid_t::try_from(pid)
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "pid out of range"))?;
        // SAFETY: pidfd_open takes a pid and flags by value and returns a new descriptor or -1.
        let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `fd` is a descriptor the kernel just made for us; nothing else owns it.
        Ok(Self(unsafe {
            std::os::fd::FromRawFd::from_raw_fd(fd as std::os::fd::RawFd)
        }))
    }

    /// Whether the process has exited (its pid may name another process from now on).
    pub(crate) fn exited(&self) -> bool {
        let mut p = libc::pollfd {
            fd: self.0.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd, a zero timeout.
        let n = unsafe { libc::poll(&mut p, 1, 0) };
        n != 0
    }
}

/// Whether the other end of `sock` hung up both ways (closed it, exited, or shut down reading
/// and writing): `POLLHUP`. A peer that only shut its sending half is not hung up.
pub(crate) fn hung_up(sock: &UnixStream) -> bool {
    let mut p = libc::pollfd {
        fd: sock.as_raw_fd(),
        events: 0,
        revents: 0,
    };
    // SAFETY: one valid pollfd, a zero timeout.
    let n = unsafe { libc::poll(&mut p, 1, 0) };
    n > 0 && p.revents & (libc::POLLHUP | libc::POLLERR) != 0
}

/// Receives what `sock` holds into `buf` without waiting: `Ok(0)` at the end of the stream,
/// `WouldBlock` when nothing is there now. The socket itself stays blocking (its sends wait).
pub(crate) fn recv_now(sock: &UnixStream, buf: &mut [u8]) -> io::Result<usize> {
    // SAFETY: `buf` is valid for writes of `buf.len()` bytes for the call.
    let n = unsafe {
        libc::recv(
            sock.as_raw_fd(),
            buf.as_mut_ptr().cast(),
            buf.len(),
            libc::MSG_DONTWAIT,
        )
    };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(n as usize)
}

/// Waits until `sock` has something to read, its end, or an error (`POLLIN`, `POLLHUP`,
/// `POLLERR`); interrupted waits are retried.
pub(crate) fn wait_readable(sock: &UnixStream) -> io::Result<()> {
    let mut p = libc::pollfd {
        fd: sock.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    loop {
        // SAFETY: one valid pollfd, no timeout.
        let n = unsafe { libc::poll(&mut p, 1, -1) };
        if n >= 0 {
            return Ok(());
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

/// A range of this process's memory: `len` bytes at `addr`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Span {
    /// Start address.
    pub(crate) addr: usize,
    /// Length.
    pub(crate) len: usize,
}

/// Which way a copy goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Direction {
    /// From the other process into ours (`process_vm_readv`).
    In,
    /// From ours into the other process (`process_vm_writev`).
    Out,
}

/// Copies between `ours` (ranges of this process, in order) and `theirs` (ranges of process
/// `pid`, in order, of the same total length), resuming after partial copies. An error is the
/// kernel's (`ESRCH`: the process is gone; `EPERM`: no right to its memory; `EFAULT`: a range
/// of either side is not mapped); bytes moved before it stay moved.
///
/// # Safety
/// Every range of `ours` must be valid for the copy's direction for the whole call (for
/// [`Direction::In`], writable and not read through a Rust reference meanwhile).
pub(crate) unsafe fn copy(
    pid: u32,
    dir: Direction,
    ours: &[Span],
    theirs: &[Span],
) -> io::Result<()> {
    let total: usize = ours.iter().map(|s| s.len).sum();
    if total != theirs.iter().map(|s| s.len).sum::<usize>() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "the two sides of a copy differ in length",
        ));
    }
    let pid = libc::pid_t::try_from(pid)
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "pid out of range"))?;
    let mut ours = Cursor::new(ours);
    let mut theirs = Cursor::new(theirs);
    let mut done = 0usize;
    while done < total {
        let local = ours.iovecs();
        let remote = theirs.iovecs();
        // SAFETY: the iovecs describe ranges of this process the caller vouches for (`ours`)
        // and ranges of `pid` the kernel checks itself (`theirs`); both arrays live for the call.
        let n = unsafe {
            match dir {
                Direction::In => libc::process_vm_readv(
                    pid,
                    local.as_ptr(),
                    local.len() as libc::c_ulong,
                    remote.as_ptr(),
                    remote.len() as libc::c_ulong,
                    0,
                ),
                Direction::Out => libc::process_vm_writev(
                    pid,
                    local.as_ptr(),
                    local.len() as libc::c_ulong,
                    remote.as_ptr(),
                    remote.len() as libc::c_ulong,
                    0,
                ),
            }
        };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        if n == 0 {
            return Err(io::Error::from_raw_os_error(libc::EFAULT));
        }
        let n = n as usize;
        ours.advance(n);
        theirs.advance(n);
        done += n;
    }
    Ok(())
}

/// Ranges not copied yet, at most `IOV_MAX` of them per call.
struct Cursor<'a> {
    spans: &'a [Span],
    /// Bytes of `spans[0]` already copied.
    skip: usize,
}

/// The kernel's limit on iovecs per call.
const IOV_MAX: usize = 1024;

impl<'a> Cursor<'a> {
    fn new(spans: &'a [Span]) -> Self {
        let mut c = Self { spans, skip: 0 };
        c.advance(0);
        c
    }

    fn iovecs(&self) -> Vec<libc::iovec> {
        self.spans
            .iter()
            .take(IOV_MAX)
            .enumerate()
            .map(|(i, s)| {
                let skip = if i == 0 { self.skip } else { 0 };
                libc::iovec {
                    iov_base: (s.addr + skip) as *mut libc::c_void,
                    iov_len: s.len - skip,
                }
            })
            .collect()
    }

    fn advance(&mut self, mut n: usize) {
        while let Some(first) = self.spans.first() {
            let left = first.len - self.skip;
            if n < left {
                self.skip += n;
                return;
            }
            n -= left;
            self.spans = &self.spans[1..];
            self.skip = 0;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn boot_ids_parse_as_uuids_and_nothing_else_does() {
        let id = parse_boot_id("0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0").unwrap();
        assert_eq!(id[0], 0x0f);
        assert_eq!(id[15], 0xf0);
        assert!(parse_boot_id("0f1e2d3c").is_none());
        assert!(parse_boot_id("zz1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0").is_none());
        assert_eq!(boot_id().unwrap(), boot_id().unwrap());
    }

    #[test]
    fn a_copy_with_its_own_process_moves_scattered_ranges_in_order() {
        let src: Vec<u8> = (0..=255u8).cycle().take(10_000).collect();
        let mut dst = vec![0u8; 10_000];
        let ours = [
            Span {
                addr: dst.as_mut_ptr() as usize,
                len: 3_000,
            },
            Span {
                addr: dst.as_mut_ptr() as usize + 3_000,
                len: 7_000,
            },
        ];
        let theirs = [
            Span {
                addr: src.as_ptr() as usize,
                len: 1,
            },
            Span {
                addr: src.as_ptr() as usize + 1,
                len: 9_999,
            },
        ];
        // SAFETY: `dst` is ours, writable, and not referenced during the copy.
        unsafe { copy(std::process::id(), Direction::In, &ours, &theirs) }.unwrap();
        assert_eq!(dst, src);
    }

    #[test]
    fn a_copy_to_an_unmapped_address_fails_with_the_kernels_error() {
        let src = [7u8; 64];
        let ours = [Span {
            addr: src.as_ptr() as usize,
            len: 64,
        }];
        let theirs = [Span { addr: 8, len: 64 }];
        // SAFETY: `src` is valid for reads; the copy writes only into the other side.
        let e = unsafe { copy(std::process::id(), Direction::Out, &ours, &theirs) }.unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::EFAULT));
        let short = [Span {
            addr: src.as_ptr() as usize,
            len: 1,
        }];
        // SAFETY: as above.
        let e = unsafe { copy(std::process::id(), Direction::Out, &short, &theirs) }.unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidInput);
    }

    #[test]
    fn a_pidfd_tells_when_its_process_exited() {
        let me = Pidfd::open(std::process::id()).unwrap();
        assert!(!me.exited());
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let held = Pidfd::open(child.id()).unwrap();
        child.wait().unwrap();
        assert!(held.exited());
    }

    #[test]
    fn a_hang_up_is_both_directions_not_half() {
        let (a, b) = UnixStream::pair().unwrap();
        assert!(!hung_up(&a));
        b.shutdown(std::net::Shutdown::Write).unwrap();
        assert!(!hung_up(&a), "a half close is not a hang-up");
        b.shutdown(std::net::Shutdown::Both).unwrap();
        assert!(hung_up(&a));
        let (c, d) = UnixStream::pair().unwrap();
        drop(d);
        assert!(hung_up(&c));
    }

    #[test]
    fn a_cursor_skips_what_was_copied_across_ranges() {
        let spans = [
            Span { addr: 100, len: 10 },
            Span { addr: 0, len: 0 },
            Span { addr: 200, len: 5 },
        ];
        let mut c = Cursor::new(&spans);
        c.advance(12);
        let v = c.iovecs();
        assert_eq!(v.len(), 1);
        assert_eq!(v[0].iov_base as usize, 202);
        assert_eq!(v[0].iov_len, 3);
        c.advance(3);
        assert!(c.iovecs().is_empty());
    }
}
