//! The same-host server copies with no more right than its client has over itself, at every
//! copy: a client process that attached a stream and then exec'd another program (a
//! set-user-id one, or any) is never copied to again, whoever holds the stream's socket (here
//! this test process, which took it from the client with `pidfd_getfd`, as a forked child of
//! the client would keep it); a client of another user is refused at the probe even by a
//! privileged server.
//!
//! The client is `sh` (`read x; exec PROGRAM`): a `pre_exec` hook connects it to the server's
//! socket before `sh` runs, so the kernel records `sh`'s pid and user as the socket's peer.
//! The tests speak the plane's protocol themselves and aim each copy at the lowest bytes of the
//! client's stack, which no program reaches. Each runs on a socket stream and on a ring stream
//! (the request/answer ring, whose server checks the client before each copy rather than before
//! each request), for a memory READ, a memory WRITE (the server reads the client) and a file
//! READ, each larger than `INLINE_MAX` so that it copies to or from the client's memory.

mod common;
use common::Responder;

use std::io::{BufRead, BufReader, Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::os::unix::process::CommandExt;
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use ferry_core::wire::{
    ControlFrame, DATA_REQUEST_LEN, DATA_RESPONSE_LEN, DataRequest, StreamAttach,
};
use ferry_core::{
    Access, Epoch, MemoryRegion, OpKind, PeerId, SegmentDesc, SegmentLease, SegmentTable,
    SegmentToken,
};
use ferry_net::HandshakeLimits;
use ferry_tests::{ROOT, require_or_skip};
use ferry_transport_local::wire::{
    INLINE_MAX, PROBE_FAILED, PROBE_OK, RING_BIT, RING_OFFER, RING_TAKEN, local_code,
};
use ferry_transport_local::{LocalServer, LocalServerHandle};

const TOKEN: SegmentToken = SegmentToken(1);
/// The published file's token.
const FILE: SegmentToken = SegmentToken(2);
/// Bytes of the segment and of the file.
const SEG: usize = 16 << 10;
/// Bytes of each copy after the exec: past the inline limit, so a ring stream copies them to or
/// from the client's memory.
const BIG: usize = INLINE_MAX + 1;
const MARK: &[u8; 16] = b"PWNED-BY-NOBODY!";
const PEER: std::net::SocketAddr = std::net::SocketAddr::V4(std::net::SocketAddrV4::new(
    std::net::Ipv4Addr::LOCALHOST,
    0,
));

/// One readable and writable segment of [`SEG`] bytes, filled with [`MARK`], and a published
/// file ([`FILE`]) of as many bytes, filled alike.
#[derive(Debug)]
struct Table(Arc<MemoryRegion>, Arc<FileBytes>);

impl SegmentTable for Table {
    fn resolve(&self, token: SegmentToken) -> Option<SegmentLease> {
        (token == TOKEN).then(|| SegmentLease {
            region: self.0.clone(),
            base: 0,
            len: SEG as u64,
            access: Access::REMOTE_READ | Access::REMOTE_WRITE,
            guard: None,
        })
    }
    fn file(&self, token: SegmentToken) -> Option<Arc<dyn ferry_core::FileSource>> {
        (token == FILE).then(|| self.1.clone() as Arc<dyn ferry_core::FileSource>)
    }
    fn published(&self) -> Vec<SegmentDesc> {
        Vec::new()
    }
}

/// A published file held in memory (positioned reads and writes behind a bounds check).
#[derive(Debug)]
struct FileBytes(Vec<u8>);

impl ferry_core::FileSource for FileBytes {
    fn check(&self, _: OpKind, offset: u64, len: u64) -> Result<u64, ferry_core::RemoteStatus> {
        match offset.checked_add(len) {
            Some(end) if end <= self.0.len() as u64 => Ok(offset),
            _ => Err(ferry_core::RemoteStatus::OutOfBounds),
        }
    }
    fn read_exact_at(&self, at: u64, buf: &mut [u8]) -> std::io::Result<()> {
        buf.copy_from_slice(&self.0[at as usize..at as usize + buf.len()]);
        Ok(())
    }
    fn write_all_at(&self, _: u64, _: &[u8]) -> std::io::Result<()> {
        Err(std::io::Error::from(std::io::ErrorKind::PermissionDenied))
    }
}

fn marked() -> Vec<u8> {
    MARK.iter().copied().cycle().take(SEG).collect()
}

/// A server of the segment and the file; the segment, to look at.
fn serve() -> (LocalServerHandle, Epoch, Arc<MemoryRegion>) {
    let region = Arc::new(MemoryRegion::from_vec(marked()));
    let epoch = Epoch::fresh();
    let h = LocalServer::bind()
        .unwrap()
        .serve(
            Arc::new(Table(region.clone(), Arc::new(FileBytes(marked())))),
            Arc::new(Responder(epoch)),
            HandshakeLimits {
                timeout: Duration::from_secs(30),
                max_pending: 8,
            },
            8,
        )
        .unwrap();
    (h, epoch, region)
}

/// The op a test aims at the client after its exec.
#[derive(Clone, Copy, Debug)]
enum Aim {
    /// A READ of the segment: the server writes into the client.
    Read,
    /// A WRITE into the segment: the server reads the client.
    Write,
    /// A READ of the published file: the server writes into the client.
    FileRead,
}

/// Every stream kind (ring or socket) with every op.
const CASES: [(bool, Aim); 6] = [
    (false, Aim::Read),
    (false, Aim::Write),
    (false, Aim::FileRead),
    (true, Aim::Read),
    (true, Aim::Write),
    (true, Aim::FileRead),
];

/// A client: `sh` connected to the server's socket before it ran (as user `uid` if given),
/// waiting for a line to exec `program`; and the stream's socket, taken from it.
struct Client {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
    sock: UnixStream,
    /// The stream's ring, once the client took it.
    ring: Option<Ring>,
    seq: u32,
}

impl Client {
    fn start(h: &LocalServerHandle, program: &str, uid: Option<u32>) -> Self {
        // Made before the fork: the hook only makes system calls.
        // SAFETY: sockaddr_un is plain data; all zeroes is a valid value.
        let mut addr: libc::sockaddr_un = unsafe { std::mem::zeroed() };
        addr.sun_family = libc::AF_UNIX as libc::sa_family_t;
        let name = h.name().as_bytes();
        for (d, s) in addr.sun_path[1..].iter_mut().zip(name) {
            *d = *s as libc::c_char;
        }
        let len = (std::mem::size_of::<libc::sa_family_t>() + 1 + name.len()) as libc::socklen_t;
        let mut cmd = Command::new("sh");
        cmd.args(["-c", "read x; exec \"$0\"", program])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped());
        if let Some(uid) = uid {
            cmd.uid(uid).gid(uid);
        }
        // SAFETY: the hook makes only async-signal-safe system calls on memory made before
        // the fork (`addr`), and returns the error of the one that failed.
        unsafe {
            cmd.pre_exec(move || {
                let fd = libc::socket(libc::AF_UNIX, libc::SOCK_STREAM, 0);
                if fd < 0 || libc::connect(fd, (&raw const addr).cast(), len) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                if libc::dup2(fd, 3) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let mut child = cmd.spawn().unwrap();
        let sock = take_fd(child.id(), 3);
        Self {
            stdin: child.stdin.take().unwrap(),
            stdout: BufReader::new(child.stdout.take().unwrap()),
            child,
            sock,
            ring: None,
            seq: 0,
        }
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Attaches the stream (asking for the ring if `ring`) and answers the probe with the
    /// lowest bytes of the client's stack: the server's answer (`PROBE_OK` and the bytes, or
    /// `PROBE_FAILED`). Asked for, the ring must be offered, and is taken.
    fn attach(&mut self, epoch: Epoch, ring: bool) -> [u8; 9] {
        let attach = ControlFrame::StreamAttach(StreamAttach {
            peer_id: PeerId(1),
            epoch: Epoch::fresh(),
            server_epoch: epoch,
            transport: local_code() | if ring { RING_BIT } else { 0 },
            stream_index: 0,
        });
        ferry_net::write_frame(&mut self.sock, PEER, &attach).unwrap();
        let reply = ferry_net::read_frame(&mut self.sock, PEER).unwrap();
        assert!(matches!(reply, ControlFrame::StreamAccept), "{reply:?}");
        let at = stack_bottom(self.pid());
        self.sock.write_all(&at.to_le_bytes()).unwrap();
        let mut answer = [0u8; 9];
        self.sock.read_exact(&mut answer).unwrap();
        if ring && answer[0] == PROBE_OK {
            let (byte, fd) = recv_fd(&self.sock);
            assert_eq!(byte, RING_OFFER, "the server offered no ring");
            self.ring = Some(Ring::map(&fd.expect("the ring's memfd")));
            self.sock.write_all(&[RING_TAKEN]).unwrap();
        }
        answer
    }

    /// Sends `aim` (of `len` bytes at offset 0) with the client's address `at`: whether the
    /// server answered (the stream still served).
    fn request(&mut self, aim: Aim, at: u64, len: usize) -> bool {
        let (kind, token) = match aim {
            Aim::Read => (OpKind::Read, TOKEN),
            Aim::Write => (OpKind::Write, TOKEN),
            Aim::FileRead => (OpKind::Read, FILE),
        };
        let mut bytes = [0u8; DATA_REQUEST_LEN + 8];
        DataRequest {
            kind,
            seq: self.seq,
            token,
            offset: 0,
            len: len as _,
            ack_slack: 0,
        }
        .encode((&mut bytes[..DATA_REQUEST_LEN]).try_into().unwrap());
        self.seq += 1;
        bytes[DATA_REQUEST_LEN..].copy_from_slice(&at.to_le_bytes());
        match &mut self.ring {
            Some(ring) => ring.call(&self.sock, &bytes),
            None => {
                let _ = self.sock.write_all(&bytes);
                let mut resp = [0u8; DATA_RESPONSE_LEN];
                self.sock.read_exact(&mut resp).is_ok()
            }
        }
    }

    /// Asks the server to READ the segment's first [`BIG`] bytes into `at` of the client.
    fn read_into(&mut self, at: u64) -> bool {
        self.request(Aim::Read, at, BIG)
    }

    /// Lets `sh` exec its program, and waits until the program runs: `cat` echoes a line.
    fn exec_cat(&mut self) {
        self.stdin.write_all(b"exec\nping\n").unwrap();
        let mut line = String::new();
        self.stdout.read_line(&mut line).unwrap();
        assert_eq!(line, "ping\n", "the client's program runs");
    }
}

impl Drop for Client {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The client's side of a stream's request/answer ring, mapped from the memfd the server
/// offered. The layout is the plane's (`crate::ring`, private to the crate): the requests' ring
/// header at 0 (`head`, then `tail` and the reader's futex word a line apart) and its data at
/// 4096; the answers' header at 512 and its data after the requests' data.
struct Ring {
    base: *mut u8,
    /// Bytes written to the requests' ring.
    head: u64,
    /// Bytes taken from the answers' ring.
    tail: u64,
}

const RING_CAP: usize = 256 << 10;
const RING_LINE: usize = 128;
const REQ_HEADER: usize = 0;
const REQ_DATA: usize = 4096;
const ANS_HEADER: usize = 4 * RING_LINE;
const SHM_LEN: usize = 4096 + 2 * RING_CAP;

impl Ring {
    fn map(fd: &OwnedFd) -> Self {
        // SAFETY: a fresh shared mapping of the whole memfd (sealed at this size by the server);
        // the result is checked.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                SHM_LEN,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            )
        };
        assert_ne!(
            base,
            libc::MAP_FAILED,
            "{}",
            std::io::Error::last_os_error()
        );
        Self {
            base: base.cast(),
            head: 0,
            tail: 0,
        }
    }

    fn u64_at(&self, off: usize) -> &AtomicU64 {
        // SAFETY: `off` is an aligned header word inside the live mapping.
        unsafe { AtomicU64::from_ptr(self.base.add(off).cast()) }
    }

    fn u32_at(&self, off: usize) -> &AtomicU32 {
        // SAFETY: `off` is an aligned header word inside the live mapping.
        unsafe { AtomicU32::from_ptr(self.base.add(off).cast()) }
    }

    /// Writes one request into the ring and waits for its answer, or for the server to end the
    /// stream (it shuts the socket down): whether it answered.
    fn call(&mut self, sock: &UnixStream, request: &[u8]) -> bool {
        for b in request {
            let at = REQ_DATA + (self.head as usize & (RING_CAP - 1));
            // SAFETY: `at` lies in the requests' data area, inside the mapping.
            unsafe { self.base.add(at).write_volatile(*b) };
            self.head += 1;
        }
        self.u64_at(REQ_HEADER).store(self.head, Ordering::SeqCst);
        let sleeper = self.u32_at(REQ_HEADER + 2 * RING_LINE);
        if sleeper.swap(0, Ordering::SeqCst) != 0 {
            // SAFETY: FUTEX_WAKE on an aligned word of the shared mapping; it touches no memory.
            unsafe { libc::syscall(libc::SYS_futex, sleeper.as_ptr(), libc::FUTEX_WAKE, 1) };
        }
        let answered = |r: &Self| {
            r.u64_at(ANS_HEADER).load(Ordering::SeqCst) - r.tail >= DATA_RESPONSE_LEN as u64
        };
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if answered(self) {
                self.tail += DATA_RESPONSE_LEN as u64;
                self.u64_at(ANS_HEADER + RING_LINE)
                    .store(self.tail, Ordering::SeqCst);
                return true;
            }
            // The socket carries nothing on a ring stream: readable means shut down.
            let mut p = libc::pollfd {
                fd: sock.as_raw_fd(),
                events: libc::POLLIN | libc::POLLRDHUP,
                revents: 0,
            };
            // SAFETY: one valid pollfd.
            if unsafe { libc::poll(&mut p, 1, 10) } > 0 {
                return answered(self);
            }
            assert!(Instant::now() < deadline, "no answer and no end in 30 s");
        }
    }
}

impl Drop for Ring {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `map`, no longer referenced.
        unsafe { libc::munmap(self.base.cast(), SHM_LEN) };
    }
}

/// One byte from `sock`, and the descriptor that came with it (`SCM_RIGHTS`).
fn recv_fd(sock: &UnixStream) -> (u8, Option<OwnedFd>) {
    let mut byte = [0u8; 1];
    let mut iov = libc::iovec {
        iov_base: byte.as_mut_ptr().cast(),
        iov_len: 1,
    };
    let mut cbuf = [0u64; 8];
    // SAFETY: msghdr is plain data; all zeroes is a valid value.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = cbuf.as_mut_ptr().cast();
    msg.msg_controllen = std::mem::size_of_val(&cbuf) as _;
    // SAFETY: `msg` points at `byte` and `cbuf`, both ours and writable for their lengths.
    let n = unsafe { libc::recvmsg(sock.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC) };
    assert_eq!(n, 1, "recvmsg: {}", std::io::Error::last_os_error());
    // SAFETY: the kernel filled `msg`'s control area; the macros walk it within its length.
    let fd = unsafe {
        let c = libc::CMSG_FIRSTHDR(&msg);
        (!c.is_null() && (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_RIGHTS)
            .then(|| OwnedFd::from_raw_fd(libc::CMSG_DATA(c).cast::<i32>().read_unaligned()))
    };
    (byte[0], fd)
}

/// A copy of descriptor `fd` of process `pid` (`pidfd_getfd`: this process may trace it).
fn take_fd(pid: u32, fd: i32) -> UnixStream {
    // SAFETY: pidfd_open and pidfd_getfd take integers and return new descriptors or -1.
    unsafe {
        let pidfd = libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0);
        assert!(
            pidfd >= 0,
            "pidfd_open: {}",
            std::io::Error::last_os_error()
        );
        let got = libc::syscall(libc::SYS_pidfd_getfd, pidfd as i32, fd, 0);
        let e = std::io::Error::last_os_error();
        libc::close(pidfd as i32);
        assert!(got >= 0, "pidfd_getfd: {e}");
        UnixStream::from(OwnedFd::from_raw_fd(got as i32))
    }
}

/// The lowest address of process `pid`'s stack mapping now.
fn stack_bottom(pid: u32) -> u64 {
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).unwrap();
    let line = maps
        .lines()
        .find(|l| l.ends_with("[stack]"))
        .expect("a stack mapping");
    let start = line.split('-').next().unwrap();
    u64::from_str_radix(start, 16).unwrap()
}

/// [`BIG`] bytes of process `pid`'s memory at `at`, read by this process.
fn peek(pid: u32, at: u64) -> Vec<u8> {
    let mut out = vec![0u8; BIG];
    let local = libc::iovec {
        iov_base: out.as_mut_ptr().cast(),
        iov_len: BIG,
    };
    let remote = libc::iovec {
        iov_base: at as *mut libc::c_void,
        iov_len: BIG,
    };
    // SAFETY: `out` is ours and writable for BIG bytes; the kernel checks the remote range.
    let n = unsafe { libc::process_vm_readv(pid as libc::pid_t, &local, 1, &remote, 1, 0) };
    assert_eq!(n, BIG as isize, "peek: {}", std::io::Error::last_os_error());
    out
}

fn segment(region: &MemoryRegion) -> Vec<u8> {
    let mut out = vec![0u8; BIG];
    region.read_at(0, &mut out).unwrap();
    out
}

/// After the client's exec: `aim` at the lowest bytes of its stack is refused (the stream ends
/// unanswered), and neither those bytes nor the segment changed.
fn refused_after_exec(c: &mut Client, region: &MemoryRegion, ring: bool, aim: Aim, what: &str) {
    let at = stack_bottom(c.pid());
    let untouched = peek(c.pid(), at);
    let seg = segment(region);
    assert_ne!(
        untouched, seg,
        "the test needs other bytes in the client than served"
    );
    assert!(
        !c.request(aim, at, BIG),
        "ring {ring}, {aim:?}: the server served a copy with {what}"
    );
    assert!(
        peek(c.pid(), at) == untouched,
        "ring {ring}, {aim:?}: bytes landed in {what}"
    );
    assert!(
        segment(region) == seg,
        "ring {ring}, {aim:?}: bytes of {what} landed in the segment"
    );
}

/// The control first: before the exec a READ lands in the client's stack. Then the client
/// execs `cat` (same user, dumpable: the kernel alone would allow the copy), and the next op is
/// refused: the stream ends unanswered and `cat`'s stack (and the segment) untouched. On socket
/// and ring streams, for memory READs and WRITEs and file READs.
#[test]
fn a_client_that_execs_is_never_copied_to_again() {
    for (ring, aim) in CASES {
        let (h, epoch, region) = serve();
        let mut c = Client::start(&h, "cat", None);
        let answer = c.attach(epoch, ring);
        assert_eq!(answer[0], PROBE_OK, "{answer:?}");
        assert_eq!(
            c.ring.is_some(),
            ring,
            "the stream is on the ring asked for"
        );
        let before_exec = stack_bottom(c.pid());
        assert!(
            c.read_into(before_exec),
            "ring {ring}: the attached client is served"
        );
        assert!(
            peek(c.pid(), before_exec) == segment(&region),
            "ring {ring}: the READ landed"
        );
        c.exec_cat();
        refused_after_exec(&mut c, &region, ring, aim, "the program the client exec'd");
    }
}

/// The review's reproduction: the client execs a set-user-id program (a copy of `cat` owned by
/// another user, made here), which the kernel marks non-dumpable; a privileged server (root)
/// must not copy to or from it. Needs root (to make the program and read its memory). On socket
/// and ring streams, for memory READs and WRITEs and file READs.
#[test]
fn a_client_that_execs_a_set_user_id_program_gets_no_byte_into_it() {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return require_or_skip(ROOT, "not root: cannot make a set-user-id program");
    }
    let dir = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("exec-suid");
    std::fs::create_dir_all(&dir).unwrap();
    let prog = dir.join(format!("cat-{}", std::process::id()));
    std::fs::copy("/bin/cat", &prog).unwrap();
    std::os::unix::fs::chown(&prog, Some(65534), Some(65534)).unwrap();
    std::fs::set_permissions(&prog, std::os::unix::fs::PermissionsExt::from_mode(0o4755)).unwrap();
    for (ring, aim) in CASES {
        let (h, epoch, region) = serve();
        let mut c = Client::start(&h, prog.to_str().unwrap(), None);
        assert_eq!(c.attach(epoch, ring)[0], PROBE_OK);
        assert_eq!(
            c.ring.is_some(),
            ring,
            "the stream is on the ring asked for"
        );
        c.exec_cat();
        let status = std::fs::read_to_string(format!("/proc/{}/status", c.pid())).unwrap();
        let uids = status.lines().find(|l| l.starts_with("Uid:")).unwrap();
        if !uids.split_whitespace().any(|u| u == "65534") {
            let _ = std::fs::remove_file(&prog);
            return require_or_skip(
                ROOT,
                format!("the set-user-id bit was not honoured here (nosuid?): {uids}"),
            );
        }
        refused_after_exec(&mut c, &region, ring, aim, "a set-user-id program");
    }
    let _ = std::fs::remove_file(&prog);
}

/// A client of another user (nobody) than a privileged server (root): the server's serving
/// thread has no more right than root's own user without `CAP_SYS_PTRACE`, so the probe of the
/// client's memory is refused and nothing is served (no ring offered either). Needs root.
#[test]
fn a_client_of_another_user_is_refused_at_the_probe_by_a_privileged_server() {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return require_or_skip(ROOT, "not root: no privileged server to test");
    }
    for ring in [false, true] {
        let (h, epoch, _region) = serve();
        let mut c = Client::start(&h, "cat", Some(65534));
        let answer = c.attach(epoch, ring);
        assert_eq!(
            answer[0], PROBE_FAILED,
            "a root server probed another user's process"
        );
        let errno = i32::from_le_bytes([answer[1], answer[2], answer[3], answer[4]]);
        assert_eq!(errno, libc::EPERM);
        assert!(!c.read_into(stack_bottom(c.pid())));
    }
}
