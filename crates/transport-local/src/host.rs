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

/// The tracer this process named (`PR_SET_PTRACER`), and how many live grants hold it.
static TRACER: Mutex<Grants> = Mutex::new(Grants::new());

/// The bookkeeping of Yama's one named tracer: which pid holds it and how many channels still
/// need it. No I/O: [`allow_tracer`] and [`TracerGrant`]'s drop act on what it decides.
#[derive(Debug, PartialEq, Eq)]
struct Grants {
    named: Option<(u32, usize)>,
}

/// What a grant asks of the kernel.
#[derive(Debug, PartialEq, Eq)]
enum Prctl {
    /// Name this pid (`PR_SET_PTRACER, pid`).
    Name(u32),
    /// Name nobody (`PR_SET_PTRACER, 0`): the last grant is gone.
    Revoke,
    /// Nothing to ask: the pid is named already, or another grant still holds it.
    Nothing,
}

impl Grants {
    const fn new() -> Self {
        Self { named: None }
    }

    /// A channel to `pid` wants the grant. Refused while another live pid holds it (`alive`
    /// says whether a pid still runs: a dead holder's grant is taken over).
    fn acquire(&mut self, pid: u32, alive: impl Fn(u32) -> bool) -> Result<Prctl, u32> {
        match self.named {
            Some((held, n)) if held == pid => {
                self.named = Some((pid, n + 1));
                Ok(Prctl::Nothing)
            }
            Some((other, _)) if alive(other) => Err(other),
            _ => {
                self.named = Some((pid, 1));
                Ok(Prctl::Name(pid))
            }
        }
    }

    /// The prctl failed: the grant was not made.
    fn undo(&mut self, pid: u32) {
        if let Some((held, n)) = self.named
            && held == pid
        {
            self.named = (n > 1).then_some((pid, n - 1));
        }
    }

    /// A channel to `pid` ended.
    fn release(&mut self, pid: u32) -> Prctl {
        match self.named {
            Some((held, n)) if held == pid && n > 1 => {
                self.named = Some((pid, n - 1));
                Prctl::Nothing
            }
            Some((held, _)) if held == pid => {
                self.named = None;
                Prctl::Revoke
            }
            _ => Prctl::Nothing,
        }
    }
}

fn set_ptracer(pid: u32) -> io::Result<()> {
    // SAFETY: PR_SET_PTRACER takes a pid by value (0: nobody); no memory is passed.
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
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Yama's grant to one same-host server, held by a channel to it: while any channel to that
/// pid lives, the pid may copy to and from this process; when the last one ends the grant is
/// revoked (`PR_SET_PTRACER, 0`). Where Yama asks for no named tracer it holds nothing.
#[derive(Debug)]
pub(crate) struct TracerGrant(Option<u32>);

impl TracerGrant {
    /// A grant that holds nothing (for tests of a channel over a socket pair).
    #[cfg(test)]
    pub(crate) fn none() -> Self {
        Self(None)
    }
}

impl Drop for TracerGrant {
    fn drop(&mut self) {
        let Some(pid) = self.0 else { return };
        let mut grants = TRACER.lock().unwrap_or_else(PoisonError::into_inner);
        if grants.release(pid) == Prctl::Revoke
            && let Err(e) = set_ptracer(0)
        {
            tracing::warn!(pid, error = %e, "cannot revoke the same-host server's Yama grant");
        }
    }
}

/// Lets process `pid` copy into and out of this process's memory where Yama asks for a named
/// tracer (scope 1): `PR_SET_PTRACER`, for as long as the returned grant (or another to the
/// same pid) lives. Yama keeps one named tracer per process, so a second live same-host server
/// is refused (its channel takes the network planes) rather than taking the grant from the
/// first. Nothing to do at scope 0 or without Yama; at scope 2 or 3 only privilege helps, and
/// the copy probe at attach tells.
pub(crate) fn allow_tracer(pid: u32) -> Result<TracerGrant, String> {
    if yama_scope() != Some(1) {
        return Ok(TracerGrant(None));
    }
    let mut grants = TRACER.lock().unwrap_or_else(PoisonError::into_inner);
    match grants.acquire(pid, alive) {
        Err(other) => Err(format!(
            "Yama (ptrace_scope 1) lets a process name one tracer, and this one already named \
             pid {other}, another same-host peer"
        )),
        Ok(Prctl::Name(pid)) => match set_ptracer(pid) {
            Ok(()) => Ok(TracerGrant(Some(pid))),
            Err(e) => {
                grants.undo(pid);
                Err(format!("prctl(PR_SET_PTRACER, {pid}): {e}"))
            }
        },
        Ok(_) => Ok(TracerGrant(Some(pid))),
    }
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

/// Copies into this process revoked, and what to restore when the last revocation ends.
struct Quarantine {
    held: usize,
    /// `PR_GET_DUMPABLE` before the first revocation.
    was: libc::c_int,
}

static QUARANTINE: Mutex<Quarantine> = Mutex::new(Quarantine { held: 0, was: 1 });

/// While it lives, no process without `CAP_SYS_PTRACE` may copy into or out of this one: the
/// process is not dumpable (`PR_SET_DUMPABLE` 0), which the kernel checks at the start of every
/// cross-process copy, whoever asks. Same-host servers copy without that capability, so a
/// server that was stopped (or stalled) with a copy still to make cannot make it after the
/// revocation: it is refused (`EPERM`). It is the whole process's: while any revocation lives,
/// every same-host server is refused (their streams end, and new channels take the network
/// planes), and no debugger or core dump reaches the process. The last one to end restores the
/// process's dumpability as it was.
#[derive(Debug)]
pub(crate) struct Revoked(());

/// Revokes copies into this process until the returned guard (and every other) is dropped.
pub(crate) fn revoke_copies() -> io::Result<Revoked> {
    let mut q = QUARANTINE.lock().unwrap_or_else(PoisonError::into_inner);
    if q.held == 0 {
        // SAFETY: PR_GET_DUMPABLE takes no pointer.
        let was = unsafe { libc::prctl(libc::PR_GET_DUMPABLE, 0, 0, 0, 0) };
        if was < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: PR_SET_DUMPABLE takes a value.
        if unsafe { libc::prctl(libc::PR_SET_DUMPABLE, 0 as libc::c_ulong, 0, 0, 0) } != 0 {
            return Err(io::Error::last_os_error());
        }
        q.was = was;
    }
    q.held += 1;
    Ok(Revoked(()))
}

impl Drop for Revoked {
    fn drop(&mut self) {
        let mut q = QUARANTINE.lock().unwrap_or_else(PoisonError::into_inner);
        q.held -= 1;
        if q.held == 0 {
            let was = q.was as libc::c_ulong;
            // SAFETY: PR_SET_DUMPABLE takes a value.
            if unsafe { libc::prctl(libc::PR_SET_DUMPABLE, was, 0, 0, 0) } != 0 {
                tracing::warn!(error = %io::Error::last_os_error(),
                    "cannot make the process dumpable again after a same-host revocation");
            }
        }
    }
}

/// Revocations of copies into this process now (see [`Revoked`]).
pub(crate) fn revocations() -> usize {
    QUARANTINE
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .held
}

/// Whether every thread of process `pid` is stopped (`T`, `t`: a stop signal, a tracer), or
/// the process is gone: a stopped thread is inside no system call's copy (a stop takes effect
/// on the way back to user space), so it copies nothing until it runs again.
pub(crate) fn process_stopped(pid: u32) -> bool {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return true;
    };
    let mut any = false;
    for t in tasks.flatten() {
        let Ok(stat) = std::fs::read_to_string(t.path().join("stat")) else {
            continue;
        };
        any = true;
        // `pid (comm) S ...`: the state follows the last `)`, the name may hold any byte.
        let state = stat
            .rsplit_once(')')
            .and_then(|(_, r)| r.trim_start().chars().next());
        if !matches!(state, Some('T' | 't')) {
            return false;
        }
    }
    any || std::fs::metadata(format!("/proc/{pid}")).is_err()
}

/// `CAP_SYS_PTRACE`'s bit in a capability set.
const CAP_SYS_PTRACE: u32 = 19;
/// `_LINUX_CAPABILITY_VERSION_3`: two 32-bit words per set.
const CAP_VERSION_3: u32 = 0x2008_0522;

#[repr(C)]
struct CapHeader {
    version: u32,
    pid: libc::c_int,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
struct CapData {
    effective: u32,
    permitted: u32,
    inheritable: u32,
}

/// The calling thread's capability sets (`capget` with pid 0: this thread, not the process).
fn thread_caps() -> io::Result<[CapData; 2]> {
    let mut head = CapHeader {
        version: CAP_VERSION_3,
        pid: 0,
    };
    let mut data = [CapData::default(); 2];
    // SAFETY: `head` and two `CapData` words (version 3's size) are valid for the kernel's
    // writes for the call.
    let rc = unsafe { libc::syscall(libc::SYS_capget, &raw mut head, data.as_mut_ptr()) };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(data)
}

/// Whether the calling thread has `CAP_SYS_PTRACE` in its effective set: the right to copy to
/// and from any process, whatever its user or dumpability.
pub(crate) fn ptrace_capable() -> io::Result<bool> {
    Ok(thread_caps()?[0].effective & (1 << CAP_SYS_PTRACE) != 0)
}

/// Clears `CAP_SYS_PTRACE` from the calling thread's effective set (capabilities are per thread
/// in the kernel: the process's other threads keep theirs). From then on the kernel lets this
/// thread copy to and from a process only where the thread's real user owns it (all its user
/// ids), it is dumpable (not running a set-user-id program, say) and Yama agrees: no more than
/// that process's own user may. The permitted set is kept, so the kernel's check that a
/// tracer's permitted capabilities cover its target's still passes for a privileged client.
/// An error: the kernel refused (a seccomp filter, say), and the thread still has it.
pub(crate) fn drop_ptrace_capability() -> io::Result<()> {
    set_ptrace_effective(false)
}

/// Sets `CAP_SYS_PTRACE` in the calling thread's effective set (`on`: raised, where the
/// permitted set has it; off: cleared), and checks the kernel did.
fn set_ptrace_effective(on: bool) -> io::Result<()> {
    let mut data = thread_caps()?;
    let bit = 1 << CAP_SYS_PTRACE;
    let want = if on && data[0].permitted & bit != 0 {
        data[0].effective | bit
    } else if on {
        return Ok(());
    } else {
        data[0].effective & !bit
    };
    if want == data[0].effective {
        return Ok(());
    }
    data[0].effective = want;
    let mut head = CapHeader {
        version: CAP_VERSION_3,
        pid: 0,
    };
    // SAFETY: `head` and two `CapData` words are valid for the kernel's reads for the call.
    let rc = unsafe { libc::syscall(libc::SYS_capset, &raw mut head, data.as_ptr()) };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    if ptrace_capable()? != on {
        return Err(io::Error::other("capset left CAP_SYS_PTRACE as it was"));
    }
    Ok(())
}

/// `SO_PEERPIDFD` (Linux 6.5): a pidfd of the process that connected the socket.
const SO_PEERPIDFD: libc::c_int = 77;

/// The process at the other end of `sock`, held by a pidfd: the kernel's own (`SO_PEERPIDFD`,
/// taken at connect, so it can name no later process) where it has one, else one opened by the
/// pid `SO_PEERCRED` recorded (`pid`), which names a later process only if the client exited
/// and its pid was reused between its connect and this call.
pub(crate) fn peer_pidfd(sock: &UnixStream, pid: u32) -> io::Result<Pidfd> {
    let mut fd: libc::c_int = -1;
    let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: `fd` and `len` are valid for writes of the sizes passed; the socket is open.
    let rc = unsafe {
        libc::getsockopt(
            sock.as_raw_fd(),
            libc::SOL_SOCKET,
            SO_PEERPIDFD,
            (&raw mut fd).cast(),
            &mut len,
        )
    };
    if rc == 0 && fd >= 0 {
        // SAFETY: the kernel just made `fd` for us; nothing else owns it.
        return Ok(Pidfd(unsafe { std::os::fd::FromRawFd::from_raw_fd(fd) }));
    }
    let e = io::Error::last_os_error();
    match e.raw_os_error() {
        Some(libc::ENOPROTOOPT) | Some(libc::EINVAL) => Pidfd::open(pid),
        _ => Err(e),
    }
}

/// The address space a process had when it was opened (`/proc/PID/mem`, which holds that
/// memory map, not the pid): once the process execs a program or exits, that map is gone and
/// the handle says so, even if the pid now runs something else. It is a witness, never a way
/// to copy: the copies go by pid, with the serving thread's own right.
#[derive(Debug)]
pub(crate) struct AddressSpace(std::fs::File);

impl AddressSpace {
    /// Holds the address space process `pid` runs in now. Opening it takes the kernel's check
    /// with the thread's effective capabilities (a privileged client's permitted set must be
    /// covered by them), so a serving thread that dropped `CAP_SYS_PTRACE` raises it again for
    /// the open alone, where it may, and drops it before it returns (an error if it cannot).
    pub(crate) fn open(pid: u32) -> io::Result<Self> {
        let raised = ptrace_capable()?;
        set_ptrace_effective(true)?;
        let opened = std::fs::File::open(format!("/proc/{pid}/mem")).map(Self);
        if !raised {
            drop_ptrace_capability()?;
        }
        opened
    }

    /// Reads `buf.len()` bytes at `addr` of the held address space (fewer at its end; an error
    /// where nothing there is mapped or the space is gone).
    pub(crate) fn read(&self, addr: u64, buf: &mut [u8]) -> io::Result<usize> {
        std::os::unix::fs::FileExt::read_at(&self.0, buf, addr)
    }

    /// Whether the held address space is gone (the process exec'd or exited): one read at
    /// address 0, never mapped, which the kernel refuses (`EIO`) while the space lives and
    /// answers with nothing once no process uses it.
    pub(crate) fn gone(&self) -> bool {
        let mut b = [0u8; 1];
        matches!(self.read(0, &mut b), Ok(0))
    }
}

/// Holds the address space the probe's copy reached: opened by pid, then proven to be the
/// connecting process's (its pidfd still running, so the pid named it when it was opened) and
/// the space the copies reach (the probe's eight bytes read through it are the ones copied).
pub(crate) fn hold_space(
    pid: u32,
    client: &Pidfd,
    at: u64,
    copied: [u8; 8],
) -> io::Result<AddressSpace> {
    let space = AddressSpace::open(pid)?;
    if client.exited() {
        return Err(io::Error::from_raw_os_error(libc::ESRCH));
    }
    let mut seen = [0u8; 8];
    if space.read(at, &mut seen)? != seen.len() || seen != copied {
        return Err(io::Error::new(
            io::ErrorKind::PermissionDenied,
            "the probe's bytes read through /proc differ from those copied (another pid \
             namespace's /proc?)",
        ));
    }
    Ok(space)
}

/// What one look at a served stream's socket and its client's pidfd says (one `poll` of both).
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Liveness {
    /// Both as they were.
    Live,
    /// The client process exited (its pid may name another process from now on).
    Exited,
    /// The other end of the socket hung up both ways (closed it, exited, or shut down reading
    /// and writing: `POLLHUP`); a peer that only shut its sending half has not.
    HungUp,
}

/// Looks at `sock` and `client` at once, without waiting, in one system call.
pub(crate) fn liveness(sock: &UnixStream, client: &Pidfd) -> Liveness {
    let mut p = [
        libc::pollfd {
            fd: client.0.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        },
        libc::pollfd {
            fd: sock.as_raw_fd(),
            events: 0,
            revents: 0,
        },
    ];
    // SAFETY: two valid pollfds, a zero timeout.
    let n = unsafe { libc::poll(p.as_mut_ptr(), 2, 0) };
    if n <= 0 {
        return Liveness::Live;
    }
    if p[0].revents != 0 {
        Liveness::Exited
    } else if p[1].revents & (libc::POLLHUP | libc::POLLERR) != 0 {
        Liveness::HungUp
    } else {
        Liveness::Live
    }
}

/// Whether `sock` has something to read now (or its end, or an error), without waiting.
pub(crate) fn readable_now(sock: &UnixStream) -> bool {
    let mut p = libc::pollfd {
        fd: sock.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one valid pollfd, a zero timeout.
    let n = unsafe { libc::poll(&mut p, 1, 0) };
    n != 0
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

/// Sends what `sock` takes of `buf` now, without waiting (`WouldBlock` when it takes nothing)
/// and without `SIGPIPE` (a closed peer is `EPIPE`). The socket itself stays blocking.
pub(crate) fn send_now(sock: &UnixStream, buf: &[u8]) -> io::Result<usize> {
    // SAFETY: `buf` is valid for reads of `buf.len()` bytes for the call.
    let n = unsafe {
        libc::send(
            sock.as_raw_fd(),
            buf.as_ptr().cast(),
            buf.len(),
            libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL,
        )
    };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(n as usize)
}

/// Waits, as long as it takes, until the other end of every socket of `socks` has closed or
/// shut down both ways (`POLLHUP`); interrupted waits are retried.
pub(crate) fn wait_all_hung_up(socks: &[&UnixStream]) {
    let mut left: Vec<libc::pollfd> = socks
        .iter()
        .map(|s| libc::pollfd {
            fd: s.as_raw_fd(),
            events: 0,
            revents: 0,
        })
        .collect();
    while !left.is_empty() {
        // SAFETY: `left` holds `left.len()` valid pollfds; no timeout.
        let n = unsafe { libc::poll(left.as_mut_ptr(), left.len() as libc::nfds_t, -1) };
        if n < 0 {
            if io::Error::last_os_error().kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return;
        }
        left.retain(|p| p.revents & (libc::POLLHUP | libc::POLLERR | libc::POLLNVAL) == 0);
    }
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
    fn yamas_grant_is_named_once_shared_by_channels_and_revoked_with_the_last() {
        let mut g = Grants::new();
        let alive = |_| true;
        assert_eq!(g.acquire(40, alive), Ok(Prctl::Name(40)));
        assert_eq!(g.acquire(40, alive), Ok(Prctl::Nothing));
        // Another live server is refused; the grant stays the first's.
        assert_eq!(g.acquire(41, alive), Err(40));
        assert_eq!(g.release(40), Prctl::Nothing);
        assert_eq!(
            g.release(40),
            Prctl::Revoke,
            "the last channel revokes the grant"
        );
        assert_eq!(g, Grants::new());
        // A dead holder's grant is taken over; a failed prctl leaves nothing named.
        assert_eq!(g.acquire(42, alive), Ok(Prctl::Name(42)));
        assert_eq!(g.acquire(43, |p| p != 42), Ok(Prctl::Name(43)));
        g.undo(43);
        assert_eq!(g, Grants::new());
        assert_eq!(g.release(43), Prctl::Nothing);
    }

    /// Opening a client's address space raises `CAP_SYS_PTRACE` for the open alone: the
    /// serving thread that had dropped it has dropped it again after.
    #[test]
    fn opening_an_address_space_leaves_the_capability_dropped() {
        let mut child = std::process::Command::new("sleep")
            .arg("1000")
            .spawn()
            .unwrap();
        let pid = child.id();
        let after = std::thread::spawn(move || {
            drop_ptrace_capability().unwrap();
            let space = AddressSpace::open(pid).unwrap();
            assert!(!space.gone());
            ptrace_capable().unwrap()
        })
        .join()
        .unwrap();
        child.kill().unwrap();
        child.wait().unwrap();
        assert!(
            !after,
            "the serving thread kept CAP_SYS_PTRACE after the open"
        );
    }

    #[test]
    fn a_thread_drops_ptrace_for_itself_only() {
        let before = ptrace_capable().unwrap();
        let dropped = std::thread::spawn(|| {
            drop_ptrace_capability().unwrap();
            ptrace_capable().unwrap()
        })
        .join()
        .unwrap();
        assert!(!dropped, "the serving thread still has CAP_SYS_PTRACE");
        assert_eq!(
            ptrace_capable().unwrap(),
            before,
            "another thread's set changed"
        );
    }

    /// A child that execs `cat` on a line of input: the address space held before is gone once
    /// `cat` runs (the pid is the same), and a held space is gone once its process exits.
    #[test]
    fn a_held_address_space_is_gone_once_its_process_execs_or_exits() {
        use std::io::{BufRead, Write};
        use std::process::{Command, Stdio};
        let mut child = Command::new("sh")
            .args(["-c", "read x; exec cat"])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let space = AddressSpace::open(child.id()).unwrap();
        assert!(!space.gone());
        let mut stdin = child.stdin.take().unwrap();
        let mut stdout = std::io::BufReader::new(child.stdout.take().unwrap());
        stdin.write_all(b"exec\nping\n").unwrap();
        let mut line = String::new();
        stdout.read_line(&mut line).unwrap();
        assert_eq!(line, "ping\n", "cat runs");
        assert!(
            space.gone(),
            "the space of the program before the exec is still there"
        );
        let now = AddressSpace::open(child.id()).unwrap();
        assert!(!now.gone());
        drop(stdin);
        child.wait().unwrap();
        assert!(now.gone());
    }

    #[test]
    fn a_hang_up_is_both_directions_not_half() {
        let (a, b) = UnixStream::pair().unwrap();
        let me = Pidfd::open(std::process::id()).unwrap();
        assert_eq!(liveness(&a, &me), Liveness::Live);
        b.shutdown(std::net::Shutdown::Write).unwrap();
        assert_eq!(
            liveness(&a, &me),
            Liveness::Live,
            "a half close is not a hang-up"
        );
        drop(b);
        assert_eq!(liveness(&a, &me), Liveness::HungUp);
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let held = Pidfd::open(child.id()).unwrap();
        child.wait().unwrap();
        assert_eq!(liveness(&a, &held), Liveness::Exited);
    }

    #[test]
    fn a_revocation_makes_the_process_undumpable_until_the_last_one_ends() {
        let dumpable = || {
            // SAFETY: PR_GET_DUMPABLE takes no pointer.
            unsafe { libc::prctl(libc::PR_GET_DUMPABLE, 0, 0, 0, 0) }
        };
        let before = dumpable();
        let a = revoke_copies().unwrap();
        let b = revoke_copies().unwrap();
        assert_eq!(dumpable(), 0);
        drop(a);
        assert_eq!(dumpable(), 0, "another revocation still lives");
        drop(b);
        assert_eq!(dumpable(), before);
    }

    #[test]
    fn a_stopped_process_is_seen_stopped_and_a_running_one_is_not() {
        let mut child = std::process::Command::new("sleep")
            .arg("1000")
            .spawn()
            .unwrap();
        let pid = child.id();
        assert!(!process_stopped(pid));
        // SAFETY: kill with a valid signal number.
        unsafe { libc::kill(pid as libc::pid_t, libc::SIGSTOP) };
        // The stop is the event: waitpid with WUNTRACED returns once the child stopped.
        let mut status = 0;
        // SAFETY: `status` is valid for the write.
        let r = unsafe { libc::waitpid(pid as libc::pid_t, &mut status, libc::WUNTRACED) };
        assert_eq!(r, pid as libc::pid_t);
        assert!(libc::WIFSTOPPED(status));
        assert!(process_stopped(pid));
        child.kill().unwrap();
        child.wait().unwrap();
        assert!(
            process_stopped(pid),
            "a process that is gone copies nothing"
        );
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
