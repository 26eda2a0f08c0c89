//! The ring's raw shared memory, and nothing else that is unsafe about it: a sealed memfd
//! mapped by both sides, bounds-checked copies in and out of it, its atomics, the futex calls on
//! them, and passing its descriptor over the stream's socket (`SCM_RIGHTS`). Also a peer's
//! shared registration mapped here ([`Mapped`]: the one-sided copies' memory).
//!
//! The other process maps the same pages and may write anything at any time: every access here
//! is checked against the mapping's length (an out-of-range request panics: it is this side's
//! bug, never the peer's doing), data bytes are only ever copied out (never read through a
//! reference), and the memfd is sealed against shrinking and growing before either side maps
//! it, and checked to be so by the side that receives it, so a peer can never make an access
//! fault (`SIGBUS`) by truncating it.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicU32, AtomicU64};
use std::time::Duration;

/// The seals a ring's memfd must carry: its size fixed for good.
const SEALS: libc::c_int = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;

/// A shared mapping of a sealed memfd of fixed length.
#[derive(Debug)]
pub(crate) struct Shm {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the mapping is plain shared memory, accessed only through atomics and raw copies
// (no references to its bytes are handed out), so any thread may use it.
unsafe impl Send for Shm {}
// SAFETY: as above.
unsafe impl Sync for Shm {}

impl Shm {
    /// A fresh memfd of `len` bytes (zeroed), sealed at that size, and its mapping.
    pub(crate) fn create(len: usize) -> io::Result<(Self, OwnedFd)> {
        let name = c"ferry-ring";
        // SAFETY: a valid C string and flags; returns a new descriptor or -1.
        let fd = unsafe {
            libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING)
        };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: the kernel just made `fd` for us; nothing else owns it.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        let size = libc::off_t::try_from(len).map_err(|_| io::Error::other("ring too large"))?;
        // SAFETY: a valid descriptor and a length.
        if unsafe { libc::ftruncate(fd.as_raw_fd(), size) } != 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: fcntl on a valid descriptor with an int argument.
        if unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, SEALS) } != 0 {
            return Err(io::Error::last_os_error());
        }
        let shm = Self::map(&fd, len)?;
        Ok((shm, fd))
    }

    /// Maps a memfd the peer sent, after checking that it is sealed at exactly `len` bytes (so
    /// that no one can shrink it under the mapping).
    pub(crate) fn adopt(fd: &OwnedFd, len: usize) -> io::Result<Self> {
        // SAFETY: fcntl on a valid descriptor, no argument.
        let seals = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GET_SEALS) };
        if seals < 0 || seals & SEALS != SEALS {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "the ring's memfd is not sealed against resizing",
            ));
        }
        // SAFETY: `st` is plain data, valid for the kernel's write.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: a valid descriptor and a valid stat buffer.
        if unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } != 0 {
            return Err(io::Error::last_os_error());
        }
        if st.st_size as u64 != len as u64 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("the ring's memfd has {} bytes, not {len}", st.st_size),
            ));
        }
        Self::map(fd, len)
    }

    fn map(fd: &OwnedFd, len: usize) -> io::Result<Self> {
        // SAFETY: a fresh shared mapping of `len` bytes of a memfd at least that long (sealed);
        // no address hint, so nothing of ours is replaced.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        Ok(Self {
            ptr: ptr.cast(),
            len,
        })
    }

    fn check(&self, off: usize, len: usize, align: usize) {
        assert!(
            off.checked_add(len).is_some_and(|end| end <= self.len) && off.is_multiple_of(align),
            "a ring access at {off}+{len} outside its mapping of {}",
            self.len
        );
    }

    /// The `u64` at `off` (8-aligned, inside the mapping), as an atomic.
    pub(crate) fn u64_at(&self, off: usize) -> &AtomicU64 {
        self.check(off, 8, 8);
        // SAFETY: inside the mapping (checked), aligned, and the mapping lives as long as
        // `self`; atomics may alias memory another process writes.
        unsafe { &*self.ptr.add(off).cast::<AtomicU64>() }
    }

    /// The `u32` at `off` (4-aligned, inside the mapping), as an atomic (a futex word).
    pub(crate) fn u32_at(&self, off: usize) -> &AtomicU32 {
        self.check(off, 4, 4);
        // SAFETY: as for `u64_at`.
        unsafe { &*self.ptr.add(off).cast::<AtomicU32>() }
    }

    /// Copies `out.len()` bytes at `off` out of the mapping (bytes the peer may be changing
    /// meanwhile: they are data to check, never trusted).
    pub(crate) fn read(&self, off: usize, out: &mut [u8]) {
        self.check(off, out.len(), 1);
        // SAFETY: the source lies inside the mapping (checked), the destination is ours; the
        // two never overlap (the mapping is no Rust allocation).
        unsafe { std::ptr::copy_nonoverlapping(self.ptr.add(off), out.as_mut_ptr(), out.len()) };
    }

    /// Copies `bytes` into the mapping at `off`.
    pub(crate) fn write(&self, off: usize, bytes: &[u8]) {
        self.check(off, bytes.len(), 1);
        // SAFETY: the destination lies inside the mapping (checked); the source is ours.
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), self.ptr.add(off), bytes.len()) };
    }
}

impl Drop for Shm {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `map`, of this length; no reference into it outlives
        // `self` (the atomics borrow it).
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}

/// Sleeps while `word` holds `expected`, at most `timeout` (a futex shared between processes).
/// Returns on a wake, a change, the timeout or a signal alike: the caller looks again.
pub(crate) fn futex_wait(word: &AtomicU32, expected: u32, timeout: Duration) {
    let ts = libc::timespec {
        tv_sec: timeout.as_secs() as libc::time_t,
        tv_nsec: timeout.subsec_nanos() as libc::c_long,
    };
    // SAFETY: FUTEX_WAIT on a valid aligned word with a valid relative timeout; it only reads
    // the word.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAIT,
            expected,
            &raw const ts,
        )
    };
}

#[cfg(test)]
thread_local! {
    /// The `futex_wake` calls this thread made (tests count what a path costs).
    pub(crate) static WAKES: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

/// Wakes whoever sleeps on `word` (in either process).
pub(crate) fn futex_wake(word: &AtomicU32) {
    #[cfg(test)]
    WAKES.with(|w| w.set(w.get() + 1));
    // SAFETY: FUTEX_WAKE on a valid aligned word; it touches no memory.
    unsafe { libc::syscall(libc::SYS_futex, word.as_ptr(), libc::FUTEX_WAKE, i32::MAX) };
}

/// Sends one byte over `sock`, with `fd` attached when given (`SCM_RIGHTS`).
pub(crate) fn send_fd(sock: &UnixStream, byte: u8, fd: Option<&OwnedFd>) -> io::Result<()> {
    send_raw_fd(sock, byte, fd.map(|f| f.as_raw_fd()))
}

fn send_raw_fd(sock: &UnixStream, byte: u8, fd: Option<libc::c_int>) -> io::Result<()> {
    let mut data = [byte];
    let mut iov = libc::iovec {
        iov_base: data.as_mut_ptr().cast(),
        iov_len: 1,
    };
    // SAFETY: CMSG_SPACE is a pure computation.
    let space = unsafe { libc::CMSG_SPACE(std::mem::size_of::<libc::c_int>() as u32) } as usize;
    let mut control = vec![0u8; space];
    // SAFETY: msghdr is plain data; all zeroes is a valid value.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    if let Some(fd) = fd {
        msg.msg_control = control.as_mut_ptr().cast();
        msg.msg_controllen = space as _;
        // SAFETY: `msg` has a control buffer of CMSG_SPACE(int) bytes: the first header and
        // its int fit in it.
        unsafe {
            let c = libc::CMSG_FIRSTHDR(&msg);
            (*c).cmsg_level = libc::SOL_SOCKET;
            (*c).cmsg_type = libc::SCM_RIGHTS;
            (*c).cmsg_len = libc::CMSG_LEN(std::mem::size_of::<libc::c_int>() as u32) as _;
            libc::CMSG_DATA(c).cast::<libc::c_int>().write_unaligned(fd);
        }
    }
    // SAFETY: `msg` points at live buffers for the call.
    let n = unsafe { libc::sendmsg(sock.as_raw_fd(), &msg, libc::MSG_NOSIGNAL) };
    match n {
        1 => Ok(()),
        n if n < 0 => Err(io::Error::last_os_error()),
        _ => Err(io::Error::from(io::ErrorKind::WriteZero)),
    }
}

/// Receives one byte from `sock` and the descriptor attached to it, if any (made close-on-exec;
/// anything else attached is closed).
pub(crate) fn recv_fd(sock: &UnixStream) -> io::Result<(u8, Option<OwnedFd>)> {
    let mut data = [0u8];
    let mut iov = libc::iovec {
        iov_base: data.as_mut_ptr().cast(),
        iov_len: 1,
    };
    // Room for a few descriptors: a peer that sends more has them closed, not leaked.
    // SAFETY: CMSG_SPACE is a pure computation.
    let space = unsafe { libc::CMSG_SPACE(8 * std::mem::size_of::<libc::c_int>() as u32) };
    let mut control = vec![0u8; space as usize];
    // SAFETY: msghdr is plain data; all zeroes is a valid value.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = control.len() as _;
    // SAFETY: `msg` points at live buffers for the call.
    let n = unsafe { libc::recvmsg(sock.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    if n == 0 {
        return Err(io::Error::from(io::ErrorKind::UnexpectedEof));
    }
    let mut got: Vec<OwnedFd> = Vec::new();
    // SAFETY: the kernel filled `msg`'s control buffer: walking it with the CMSG macros stays
    // inside `msg_controllen`; each SCM_RIGHTS payload holds ints the kernel just made ours.
    unsafe {
        let mut c = libc::CMSG_FIRSTHDR(&msg);
        while !c.is_null() {
            if (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_RIGHTS {
                let bytes = (*c).cmsg_len as usize - libc::CMSG_LEN(0) as usize;
                let p = libc::CMSG_DATA(c).cast::<libc::c_int>();
                for i in 0..bytes / std::mem::size_of::<libc::c_int>() {
                    got.push(OwnedFd::from_raw_fd(p.add(i).read_unaligned()));
                }
            }
            c = libc::CMSG_NXTHDR(&msg, c);
        }
    }
    if msg.msg_flags & libc::MSG_CTRUNC != 0 || got.len() > 1 {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "more descriptors than one ring's",
        ));
    }
    Ok((data[0], got.pop()))
}

/// A peer's shared registration mapped here: its memfd (sealed against resizing, checked at
/// [`adopt`](Self::adopt), so no access inside the mapping can fault whatever the owner does),
/// read-only or read-write as granted. Copies go between it and this process's own registered
/// memory, and check the owner's revoked word before and after: a copy that may have raced the
/// revocation reports it, whatever its bytes.
#[derive(Debug)]
pub(crate) struct Mapped {
    ptr: *mut u8,
    /// Bytes mapped (the whole memfd).
    len: usize,
    /// Where the header page starts (the region's bytes end before it).
    header: usize,
    writable: bool,
}

// SAFETY: the mapping is plain shared memory, reached only through raw copies and an atomic
// (no references to its bytes are handed out), so any thread may use it.
unsafe impl Send for Mapped {}
// SAFETY: as above.
unsafe impl Sync for Mapped {}

/// A one-sided copy found the registration revoked (before or after it copied).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Revoked;

impl Mapped {
    /// Maps the memfd of a region of `region_len` bytes a peer granted, after checking that it
    /// is sealed against shrinking and growing and has exactly the layout of one
    /// (`ferry_core::shared_header_at`, then the header page). Read-only: `PROT_READ` only.
    pub(crate) fn adopt(fd: &OwnedFd, region_len: usize, writable: bool) -> io::Result<Self> {
        let resizing = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW;
        // SAFETY: fcntl on a valid descriptor, no argument.
        let seals = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GET_SEALS) };
        if seals < 0 || seals & resizing != resizing {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "a shared registration's memfd is not sealed against resizing",
            ));
        }
        let header = ferry_core::shared_header_at(region_len);
        let len = header + ferry_core::SHARED_HEADER;
        // SAFETY: `st` is plain data, valid for the kernel's write.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: a valid descriptor and a valid stat buffer.
        if unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } != 0 {
            return Err(io::Error::last_os_error());
        }
        if st.st_size as u64 != len as u64 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!(
                    "a shared registration's memfd has {} bytes, not {len}",
                    st.st_size
                ),
            ));
        }
        let prot = if writable {
            libc::PROT_READ | libc::PROT_WRITE
        } else {
            libc::PROT_READ
        };
        // SAFETY: a fresh shared mapping of the whole memfd (sealed at `len` bytes); no address
        // hint, so nothing of ours is replaced.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                prot,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        Ok(Self {
            ptr: ptr.cast(),
            len,
            header,
            writable,
        })
    }

    /// Whether it was mapped writable.
    pub(crate) fn writable(&self) -> bool {
        self.writable
    }

    /// Whether the owner revoked it.
    pub(crate) fn revoked(&self) -> bool {
        // SAFETY: the header page lies inside the mapping (`header + SHARED_HEADER == len`),
        // 4-aligned (page-aligned offset), readable; an atomic may alias memory another process
        // writes.
        let word = unsafe {
            &*self
                .ptr
                .add(self.header + ferry_core::SHARED_REVOKED_AT)
                .cast::<AtomicU32>()
        };
        word.load(std::sync::atomic::Ordering::Acquire) != 0
    }

    /// Checks `off..off+n` against the region's bytes of the mapping, and `at..at+n` against
    /// `local` (host memory only).
    fn check(&self, off: usize, n: usize, local: &ferry_core::MemoryRegion, at: u64) -> bool {
        local.is_host()
            && local.check(at, n as u64).is_ok()
            && off.checked_add(n).is_some_and(|end| end <= self.header)
    }

    /// Copies `n` bytes at `off` of the mapped region into `local` at `at` (a READ), after and
    /// before checking that the owner has not revoked it. Out-of-range arguments are this
    /// side's bug: they panic before anything is copied.
    pub(crate) fn copy_out(
        &self,
        off: usize,
        local: &ferry_core::MemoryRegion,
        at: u64,
        n: usize,
    ) -> Result<(), Revoked> {
        assert!(
            self.check(off, n, local, at),
            "a one-sided READ out of range"
        );
        if self.revoked() {
            return Err(Revoked);
        }
        // SAFETY: the source lies inside the mapping's region bytes and the destination inside
        // `local`'s host bytes (both checked above); a mapping is no Rust allocation, so the two
        // never overlap; raw copies only (the module's and `MemoryRegion`'s concurrency model).
        unsafe {
            std::ptr::copy_nonoverlapping(self.ptr.add(off), local.as_ptr().add(at as usize), n)
        };
        // The bytes copied are read before the word is looked at again.
        std::sync::atomic::fence(std::sync::atomic::Ordering::Acquire);
        if self.revoked() { Err(Revoked) } else { Ok(()) }
    }

    /// Copies `n` bytes of `local` at `at` into the mapped region at `off` (a WRITE), as
    /// [`copy_out`](Self::copy_out) checks. A read-only mapping panics (this side's bug).
    pub(crate) fn copy_in(
        &self,
        off: usize,
        local: &ferry_core::MemoryRegion,
        at: u64,
        n: usize,
    ) -> Result<(), Revoked> {
        assert!(self.writable, "a one-sided WRITE into a read-only mapping");
        assert!(
            self.check(off, n, local, at),
            "a one-sided WRITE out of range"
        );
        if self.revoked() {
            return Err(Revoked);
        }
        // SAFETY: the destination lies inside the mapping's region bytes, mapped writable, and
        // the source inside `local`'s host bytes (both checked above); no overlap (see
        // `copy_out`).
        unsafe {
            std::ptr::copy_nonoverlapping(local.as_ptr().add(at as usize), self.ptr.add(off), n)
        };
        std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
        if self.revoked() { Err(Revoked) } else { Ok(()) }
    }
}

impl Drop for Mapped {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `adopt`, of this length; no reference into it exists.
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sealed_ring_is_adopted_and_shared_and_an_unsealed_one_is_not() {
        let (a, fd) = Shm::create(8192).unwrap();
        let (x, y) = UnixStream::pair().unwrap();
        send_fd(&x, 7, Some(&fd)).unwrap();
        let (byte, got) = recv_fd(&y).unwrap();
        assert_eq!(byte, 7);
        let b = Shm::adopt(&got.unwrap(), 8192).unwrap();
        a.write(100, b"hello");
        let mut out = [0u8; 5];
        b.read(100, &mut out);
        assert_eq!(&out, b"hello");
        a.u64_at(8).store(42, std::sync::atomic::Ordering::Release);
        assert_eq!(b.u64_at(8).load(std::sync::atomic::Ordering::Acquire), 42);
        // Not the length agreed on: refused.
        assert!(Shm::adopt(&fd, 4096).is_err());
        // A memfd without seals (one the peer could shrink under the mapping): refused.
        // SAFETY: a valid C string and flags.
        let raw = unsafe { libc::memfd_create(c"plain".as_ptr(), libc::MFD_CLOEXEC) };
        assert!(raw >= 0);
        // SAFETY: just made, ours.
        let plain = unsafe { OwnedFd::from_raw_fd(raw) };
        // SAFETY: a valid descriptor.
        assert_eq!(unsafe { libc::ftruncate(plain.as_raw_fd(), 8192) }, 0);
        assert!(Shm::adopt(&plain, 8192).is_err());
        // The seals hold against the peer too.
        // SAFETY: a valid descriptor.
        assert_ne!(unsafe { libc::ftruncate(fd.as_raw_fd(), 0) }, 0);
    }

    #[test]
    #[should_panic(expected = "outside its mapping")]
    fn an_access_past_the_mapping_panics_before_it_touches_memory() {
        let (a, _fd) = Shm::create(4096).unwrap();
        a.write(4090, &[0u8; 8]);
    }
}
