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
//! client's stack, which no program reaches.

mod common;
use common::Responder;

use std::io::{BufRead, BufReader, Read, Write};
use std::os::fd::{FromRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::os::unix::process::CommandExt;
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use ferry_core::wire::{
    ControlFrame, DATA_REQUEST_LEN, DATA_RESPONSE_LEN, DataRequest, StreamAttach,
};
use ferry_core::{
    Access, Epoch, MemoryRegion, OpKind, PeerId, SegmentDesc, SegmentLease, SegmentTable,
    SegmentToken,
};
use ferry_net::HandshakeLimits;
use ferry_tests::{ROOT, require_or_skip};
use ferry_transport_local::wire::{PROBE_FAILED, PROBE_OK, local_code};
use ferry_transport_local::{LocalServer, LocalServerHandle};

const TOKEN: SegmentToken = SegmentToken(1);
const MARK: &[u8; 16] = b"PWNED-BY-NOBODY!";
const PEER: std::net::SocketAddr = std::net::SocketAddr::V4(std::net::SocketAddrV4::new(
    std::net::Ipv4Addr::LOCALHOST,
    0,
));

/// One readable and writable segment of 4 KiB, filled with [`MARK`].
#[derive(Debug)]
struct Table(Arc<MemoryRegion>);

impl SegmentTable for Table {
    fn resolve(&self, token: SegmentToken) -> Option<SegmentLease> {
        (token == TOKEN).then(|| SegmentLease {
            region: self.0.clone(),
            base: 0,
            len: 4096,
            access: Access::REMOTE_READ | Access::REMOTE_WRITE,
            guard: None,
        })
    }
    fn published(&self) -> Vec<SegmentDesc> {
        Vec::new()
    }
}

fn serve() -> (LocalServerHandle, Epoch) {
    let region = Arc::new(MemoryRegion::alloc_zeroed(4096, 4096).unwrap());
    // SAFETY: the region is ours, 4096 bytes, and nothing else references it yet.
    let bytes = unsafe { std::slice::from_raw_parts_mut(region.as_ptr(), 4096) };
    for c in bytes.chunks_mut(MARK.len()) {
        c.copy_from_slice(&MARK[..c.len()]);
    }
    let epoch = Epoch::fresh();
    let h = LocalServer::bind()
        .unwrap()
        .serve(
            Arc::new(Table(region)),
            Arc::new(Responder(epoch)),
            HandshakeLimits {
                timeout: Duration::from_secs(30),
                max_pending: 8,
            },
            8,
        )
        .unwrap();
    (h, epoch)
}

/// A client: `sh` connected to the server's socket before it ran (as user `uid` if given),
/// waiting for a line to exec `program`; and the stream's socket, taken from it.
struct Client {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
    sock: UnixStream,
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
        }
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Attaches the stream and answers the probe with the lowest bytes of the client's stack:
    /// the server's answer (`PROBE_OK` and the bytes, or `PROBE_FAILED`).
    fn attach(&mut self, epoch: Epoch) -> [u8; 9] {
        let attach = ControlFrame::StreamAttach(StreamAttach {
            peer_id: PeerId(1),
            epoch: Epoch::fresh(),
            server_epoch: epoch,
            transport: local_code(),
            stream_index: 0,
        });
        ferry_net::write_frame(&mut self.sock, PEER, &attach).unwrap();
        let reply = ferry_net::read_frame(&mut self.sock, PEER).unwrap();
        assert!(matches!(reply, ControlFrame::StreamAccept), "{reply:?}");
        let at = stack_bottom(self.pid());
        self.sock.write_all(&at.to_le_bytes()).unwrap();
        let mut answer = [0u8; 9];
        self.sock.read_exact(&mut answer).unwrap();
        answer
    }

    /// Lets `sh` exec its program, and waits until the program runs: `cat` echoes a line.
    fn exec_cat(&mut self) {
        self.stdin.write_all(b"exec\nping\n").unwrap();
        let mut line = String::new();
        self.stdout.read_line(&mut line).unwrap();
        assert_eq!(line, "ping\n", "the client's program runs");
    }

    /// Asks the server to READ the segment's first 16 bytes into `at` of the client: whether
    /// the server answered (the stream still served).
    fn read_into(&mut self, at: u64) -> bool {
        let mut head = [0u8; DATA_REQUEST_LEN];
        DataRequest {
            kind: OpKind::Read,
            seq: 0,
            token: TOKEN,
            offset: 0,
            len: MARK.len() as _,
            ack_slack: 0,
        }
        .encode(&mut head);
        let _ = self.sock.write_all(&head);
        let _ = self.sock.write_all(&at.to_le_bytes());
        let mut resp = [0u8; DATA_RESPONSE_LEN];
        self.sock.read_exact(&mut resp).is_ok()
    }
}

impl Drop for Client {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
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

/// 16 bytes of process `pid`'s memory at `at`, read by this process.
fn peek(pid: u32, at: u64) -> [u8; 16] {
    let mut out = [0u8; 16];
    let local = libc::iovec {
        iov_base: out.as_mut_ptr().cast(),
        iov_len: 16,
    };
    let remote = libc::iovec {
        iov_base: at as *mut libc::c_void,
        iov_len: 16,
    };
    // SAFETY: `out` is ours and writable for 16 bytes; the kernel checks the remote range.
    let n = unsafe { libc::process_vm_readv(pid as libc::pid_t, &local, 1, &remote, 1, 0) };
    assert_eq!(n, 16, "peek: {}", std::io::Error::last_os_error());
    out
}

/// The control first: before the exec a READ lands in the client's stack. Then the client
/// execs `cat` (same user, dumpable: the kernel alone would allow the copy), and the next READ
/// is refused: the stream ends unanswered and `cat`'s stack is untouched.
#[test]
fn a_client_that_execs_is_never_copied_to_again() {
    let (h, epoch) = serve();
    let mut c = Client::start(&h, "cat", None);
    let answer = c.attach(epoch);
    assert_eq!(answer[0], PROBE_OK, "{answer:?}");
    let before_exec = stack_bottom(c.pid());
    assert!(c.read_into(before_exec), "the attached client is served");
    assert_eq!(&peek(c.pid(), before_exec), MARK);
    c.exec_cat();
    let at = stack_bottom(c.pid());
    let untouched = peek(c.pid(), at);
    assert!(
        !c.read_into(at),
        "the server answered a READ into the program the client exec'd"
    );
    assert_eq!(
        peek(c.pid(), at),
        untouched,
        "bytes landed in the exec'd program"
    );
}

/// The review's reproduction: the client execs a set-user-id program (a copy of `cat` owned by
/// another user, made here), which the kernel marks non-dumpable; a privileged server (root)
/// must not write into it. Needs root (to make the program and read its memory).
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
    let (h, epoch) = serve();
    let mut c = Client::start(&h, prog.to_str().unwrap(), None);
    assert_eq!(c.attach(epoch)[0], PROBE_OK);
    c.exec_cat();
    let status = std::fs::read_to_string(format!("/proc/{}/status", c.pid())).unwrap();
    let uids = status.lines().find(|l| l.starts_with("Uid:")).unwrap();
    let _ = std::fs::remove_file(&prog);
    if !uids.split_whitespace().any(|u| u == "65534") {
        return require_or_skip(
            ROOT,
            format!("the set-user-id bit was not honoured here (nosuid?): {uids}"),
        );
    }
    let at = stack_bottom(c.pid());
    let untouched = peek(c.pid(), at);
    assert!(
        !c.read_into(at),
        "the server answered a READ into a set-user-id program"
    );
    assert_eq!(
        peek(c.pid(), at),
        untouched,
        "bytes landed in the set-user-id program"
    );
}

/// A client of another user (nobody) than a privileged server (root): the server's serving
/// thread has no more right than root's own user without `CAP_SYS_PTRACE`, so the probe of the
/// client's memory is refused and nothing is served. Needs root.
#[test]
fn a_client_of_another_user_is_refused_at_the_probe_by_a_privileged_server() {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return require_or_skip(ROOT, "not root: no privileged server to test");
    }
    let (h, epoch) = serve();
    let mut c = Client::start(&h, "cat", Some(65534));
    let answer = c.attach(epoch);
    assert_eq!(
        answer[0], PROBE_FAILED,
        "a root server probed another user's process"
    );
    let errno = i32::from_le_bytes([answer[1], answer[2], answer[3], answer[4]]);
    assert_eq!(errno, libc::EPERM);
    assert!(!c.read_into(stack_bottom(c.pid())));
}
