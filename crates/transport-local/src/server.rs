//! The serving side: an abstract Unix socket whose connections attach data streams (nothing
//! else), each served on a thread of its own that copies between the published memory and the
//! client's buffers.

use std::collections::HashMap;
use std::io::{self, BufReader, Read, Write};
use std::net::SocketAddr;
use std::os::fd::AsFd;
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr as UnixAddr, UnixListener, UnixStream};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use ferry_core::checksum::crc32c_file;
use ferry_core::handshake::{ServerConversation, ServerStep};
use ferry_core::stream::{Action, ServerStream, Target, checksum_response};
use ferry_core::wire::{
    ControlFrame, DATA_REQUEST_LEN, MAX_CHUNK, MAX_PIECES, Reject, RejectReason, SUPPORTED_VERSIONS,
};
use ferry_core::{Error, HandshakeResponder, OpKind, SegmentTable};
use ferry_net::{AcceptBackoff, HandshakeGate, HandshakeLimits, HandshakeSlot, HandshakeStats};
use tracing::{debug, warn};

use crate::gpu::{Served, ServerGpu};
use crate::host::{self, Direction, Span};
use crate::pipe::{Link, Rx, Tx};
use crate::ring::{ANSWERS, REQUESTS, SHM_LEN};
use crate::shm::{Shm, send_fd};
use crate::wire::{
    ADDR_LEN, CUDA_IPC_CODE, INLINE_MARK, INLINE_MAX, IPC_MARK, IPC_REF_LEN, PROBE_FAILED,
    PROBE_OK, RING_BIT, RING_NONE, RING_OFFER, RING_TAKEN, SHARE_CODE, local_code,
};

/// The address the handshake machinery is told a local stream comes from (Unix sockets have
/// none; logs name the client's pid beside it).
pub(crate) const UNIX_PEER: SocketAddr = SocketAddr::V4(std::net::SocketAddrV4::new(
    std::net::Ipv4Addr::LOCALHOST,
    0,
));

/// A bound abstract socket, not serving yet.
#[derive(Debug)]
pub struct LocalServer {
    listener: UnixListener,
    name: String,
    gpu: ServerGpu,
    privileged: bool,
    sharing: bool,
}

impl LocalServer {
    /// Binds a fresh abstract socket (`ferry-local-` and 16 random hex digits): abstract names
    /// vanish with the process and are reachable only inside its network namespace.
    pub fn bind() -> Result<Self, Error> {
        let name = format!("ferry-local-{:016x}", rand::random::<u64>());
        let addr = UnixAddr::from_abstract_name(name.as_bytes())
            .map_err(|e| Error::io("name the same-host socket", name.clone(), e))?;
        let listener = UnixListener::bind_addr(&addr)
            .map_err(|e| Error::io("bind the same-host socket", name.clone(), e))?;
        Ok(Self {
            listener,
            name,
            #[cfg(feature = "cuda")]
            gpu: ServerGpu::new(None),
            #[cfg(not(feature = "cuda"))]
            gpu: ServerGpu,
            privileged: false,
            sharing: true,
        })
    }

    /// Serves share streams (`crate::shares`: peers map shared registrations), or refuses
    /// them (`false`: every copy is the owner's). On by default.
    pub fn sharing(mut self, on: bool) -> Self {
        self.sharing = on;
        self
    }

    /// Serves even where a serving thread cannot drop `CAP_SYS_PTRACE` (`allow`): its copies
    /// then reach any process a client names, whatever its user or dumpability, so a client
    /// that execs a set-user-id program could have the server write into it. Off by default:
    /// such a thread refuses its connection.
    pub fn privileged(mut self, allow: bool) -> Self {
        self.privileged = allow;
        self
    }

    /// Takes CUDA IPC streams with `cuda` (when it has the entry points and a GPU): clients'
    /// GPU buffers are then copied with the driver, device to device where the segment is GPU
    /// memory ([`crate::wire`]). Without it every CUDA IPC attach is refused.
    #[cfg(feature = "cuda")]
    pub fn with_cuda(mut self, cuda: Option<crate::CudaSource>) -> Self {
        self.gpu = ServerGpu::new(cuda);
        self
    }

    /// The abstract name it is bound to.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Starts serving `table` with the identity and policy of `responder`, on a thread that
    /// accepts and a thread per connection. A connection must attach (one `StreamAttach`, or
    /// its authenticated form, for the same-host plane) within `limits.timeout`, at most
    /// `limits.max_pending` attach at once (one past that is closed at once), and at most
    /// `max_streams` streams are served at once (one past that is refused).
    pub fn serve(
        self,
        table: Arc<dyn SegmentTable>,
        responder: Arc<dyn HandshakeResponder>,
        limits: HandshakeLimits,
        max_streams: usize,
    ) -> Result<LocalServerHandle, Error> {
        let shared = Arc::new(Shared {
            gate: HandshakeGate::new(limits),
            table,
            responder,
            max_streams,
            gpu: self.gpu,
            privileged: self.privileged,
            sharing: self.sharing,
            streams: AtomicUsize::new(0),
            staged: AtomicUsize::new(0),
            stopped: AtomicBool::new(false),
            open: Mutex::new(HashMap::new()),
            next_id: AtomicU64::new(0),
        });
        let listener = Arc::new(self.listener);
        let accept = {
            let shared = shared.clone();
            let listener = listener.clone();
            std::thread::Builder::new()
                .name("ferry-local-accept".into())
                .spawn(move || accept_loop(&listener, &shared))
                .map_err(|e| Error::io("start the same-host accept thread", self.name.clone(), e))?
        };
        Ok(LocalServerHandle {
            name: self.name,
            shared,
            _listener: listener,
            accept: Mutex::new(Some(accept)),
        })
    }
}

/// A running same-host server; dropping it (or [`shutdown`](Self::shutdown)) stops accepting
/// and ends every stream it serves.
#[derive(Debug)]
pub struct LocalServerHandle {
    name: String,
    shared: Arc<Shared>,
    /// Held so that the socket (and its name) lives as long as the handle.
    _listener: Arc<UnixListener>,
    accept: Mutex<Option<std::thread::JoinHandle<()>>>,
}

impl LocalServerHandle {
    /// The abstract socket name clients attach to.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Connections attaching now, and those closed past the cap or the deadline.
    pub fn handshakes(&self) -> HandshakeStats {
        self.shared.gate.stats()
    }

    /// Whether it still serves (not shut down).
    pub fn is_serving(&self) -> bool {
        !self.shared.stopped.load(Ordering::Acquire)
    }

    /// Streams served now.
    pub fn streams(&self) -> usize {
        self.shared.streams.load(Ordering::Acquire)
    }

    /// Bytes of file staging its streams hold now (an idle stream holds none).
    pub fn staging_bytes(&self) -> usize {
        self.shared.staged.load(Ordering::Acquire)
    }

    /// Stops accepting and shuts every served stream down (their clients see the end of the
    /// stream once the copy in progress, if any, is over).
    pub fn shutdown(&self) {
        if self.shared.stopped.swap(true, Ordering::AcqRel) {
            return;
        }
        // Wakes the accept thread, which sees the flag and ends (the socket is ours until the
        // handle drops, so the name cannot be another's).
        if let Ok(addr) = UnixAddr::from_abstract_name(self.name.as_bytes()) {
            let _ = UnixStream::connect_addr(&addr);
        }
        let accept = self
            .accept
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        if let Some(t) = accept {
            let _ = t.join();
        }
        for (_, s) in self
            .shared
            .open
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .drain()
        {
            let _ = s.shutdown(std::net::Shutdown::Both);
        }
    }
}

impl Drop for LocalServerHandle {
    fn drop(&mut self) {
        self.shutdown();
    }
}

#[derive(Debug)]
struct Shared {
    gate: Arc<HandshakeGate>,
    table: Arc<dyn SegmentTable>,
    responder: Arc<dyn HandshakeResponder>,
    max_streams: usize,
    gpu: ServerGpu,
    /// Whether a serving thread that cannot drop `CAP_SYS_PTRACE` serves anyway.
    privileged: bool,
    /// Whether share streams are served.
    sharing: bool,
    streams: AtomicUsize,
    /// Bytes of file staging its streams hold now.
    staged: AtomicUsize,
    stopped: AtomicBool,
    /// A clone of every served stream's socket, to shut them down with the server (each
    /// removed when its stream ends, so a closed stream holds no descriptor).
    open: Mutex<HashMap<u64, UnixStream>>,
    next_id: AtomicU64,
}

fn accept_loop(listener: &UnixListener, shared: &Arc<Shared>) {
    let mut backoff = AcceptBackoff::new();
    loop {
        let accepted = listener.accept();
        if shared.stopped.load(Ordering::Acquire) {
            return;
        }
        let sock = match accepted {
            Ok((sock, _)) => {
                backoff.accepted();
                sock
            }
            Err(e) => {
                // EMFILE and friends: wait instead of spinning on the same error.
                let wait = backoff.failed();
                warn!(error = %e, ?wait, "same-host accept failed");
                std::thread::sleep(wait);
                continue;
            }
        };
        // Past the cap the oldest attaching connection of the user holding the most makes
        // room (a same-host connection's source is its user: `SO_PEERCRED`).
        let uid = host::peer_credentials(&sock).map_or(u32::MAX, |(_, uid)| uid);
        let source = std::net::IpAddr::V4(std::net::Ipv4Addr::from(uid));
        let Some(slot) = shared.gate.admit_evicting(sock.as_fd(), source) else {
            debug!("too many same-host connections attaching; closed at once");
            continue;
        };
        let shared = shared.clone();
        let spawned = std::thread::Builder::new()
            .name("ferry-local-serve".into())
            .spawn(move || serve_conn(sock, slot, &shared));
        if let Err(e) = spawned {
            warn!(error = %e, "cannot start a same-host serving thread");
        }
    }
}

/// Reads through a deadline: each read may wait only for what is left of it.
struct Deadline<'a> {
    sock: &'a UnixStream,
    until: Instant,
}

impl Read for Deadline<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let left = self.until.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::Error::from(io::ErrorKind::TimedOut));
        }
        self.sock.set_read_timeout(Some(left))?;
        (&*self.sock).read(buf)
    }
}

fn serve_conn(sock: UnixStream, slot: HandshakeSlot, shared: &Shared) {
    // Before anything of the client is touched: this thread's copies run with no more right
    // than the client's own user has over its process (the kernel checks it at every copy).
    if let Err(e) = host::drop_ptrace_capability() {
        if !shared.privileged {
            warn!(error = %e, "a same-host serving thread cannot drop CAP_SYS_PTRACE; closed");
            return;
        }
        debug!(error = %e, "serving with CAP_SYS_PTRACE (allowed)");
    }
    let pid = match host::peer_credentials(&sock) {
        Ok((pid, _)) if pid != 0 => pid,
        Ok(_) => {
            debug!("same-host client outside this pid namespace; closed");
            return;
        }
        Err(e) => {
            debug!(error = %e, "no credentials for a same-host client; closed");
            return;
        }
    };
    // Held from here on: a client that exits is noticed before its pid is copied to again
    // (another process may reuse it).
    let client = match host::peer_pidfd(&sock, pid) {
        Ok(p) => p,
        Err(e) => {
            debug!(pid, error = %e, "cannot hold the same-host client's process; closed");
            return;
        }
    };
    let limits = shared.gate.limits();
    let (proto, gpu, space, ring, share) = match attach(&sock, pid, &client, shared, limits.timeout)
    {
        Ok(Some(p)) => p,
        Ok(None) => return,
        Err(e) => {
            if let Error::Timeout { .. } = e {
                shared.gate.note_timeout();
            }
            debug!(pid, error = %e, "same-host attach failed");
            return;
        }
    };
    drop(slot);
    let _ = sock.set_read_timeout(None);
    let count = shared.streams.fetch_add(1, Ordering::AcqRel) + 1;
    let _counted = Counted(&shared.streams);
    if count > shared.max_streams {
        debug!(
            pid,
            max = shared.max_streams,
            "too many same-host streams; refused"
        );
        return;
    }
    let id = shared.next_id.fetch_add(1, Ordering::Relaxed);
    if let Ok(clone) = sock.try_clone() {
        shared
            .open
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(id, clone);
    }
    let _listed = Listed(shared, id);
    if shared.stopped.load(Ordering::Acquire) {
        return;
    }
    let span = tracing::debug_span!("serve same-host stream", pid);
    let _e = span.enter();
    let held = Held {
        pid,
        process: &client,
        space: &space,
    };
    let ends = match ring.map(|shm| Link::start(shm, &sock, ANSWERS, REQUESTS)) {
        None => None,
        Some(Ok(ends)) => Some(ends),
        Some(Err(e)) => {
            debug!(error = %e, "cannot watch a same-host ring stream; closed");
            let _ = sock.shutdown(std::net::Shutdown::Both);
            return;
        }
    };
    if share {
        return crate::shares::serve(&sock, &proto, || held.check(&sock));
    }
    let conn = match &ends {
        Some((tx, rx)) => Conn::Ring(&sock, tx, rx),
        None => Conn::Sock(&sock),
    };
    match serve_data(&sock, conn, &held, &shared.staged, proto, gpu) {
        Ok(()) => debug!("same-host stream ended"),
        Err(e) => debug!(error = %e, "same-host stream failed"),
    }
    let _ = sock.shutdown(std::net::Shutdown::Both);
}

/// Takes a served stream's socket clone out of the server's list when the stream ends.
struct Listed<'a>(&'a Shared, u64);

impl Drop for Listed<'_> {
    fn drop(&mut self) {
        self.0
            .open
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(&self.1);
    }
}

struct Counted<'a>(&'a AtomicUsize);

impl Drop for Counted<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// The attach of one stream, within `timeout` of the accept: the frame (checked by the
/// handshake's conversation), the acceptance, and the probe that proves this thread may copy
/// to and from the client's memory; with the stream's CUDA IPC state when it attached as a CUDA
/// IPC stream, and the client's address space held. `None`: refused (and answered).
fn attach(
    sock: &UnixStream,
    pid: u32,
    client: &host::Pidfd,
    shared: &Shared,
    timeout: Duration,
) -> Result<Option<Attachment>, Error> {
    let until = Instant::now() + timeout;
    let mut reader = Deadline { sock, until };
    let frame = match ferry_net::read_frame(&mut reader, UNIX_PEER) {
        Ok(f) => f,
        Err(Error::PeerLost {
            source: Some(e), ..
        }) if matches!(
            e.kind(),
            io::ErrorKind::TimedOut | io::ErrorKind::WouldBlock
        ) =>
        {
            return Err(Error::Timeout {
                what: "a same-host stream's attach",
                after: timeout,
            });
        }
        Err(e) => return Err(e),
    };
    let code = match &frame {
        ControlFrame::StreamAttach(a) => a.transport,
        ControlFrame::AuthAttach(a) => a.attach.transport,
        other => {
            debug!(
                pid,
                frame = other.name(),
                "same-host socket takes only attaches"
            );
            return Ok(None);
        }
    };
    let (transport, ring) = (code & !RING_BIT, code & RING_BIT != 0);
    let share = code == SHARE_CODE && shared.sharing;
    let mut out = sock;
    let gpu = if transport == CUDA_IPC_CODE {
        match shared.gpu.served() {
            Ok(g) => Some(g),
            Err(why) => {
                debug!(pid, why, "a CUDA IPC stream refused");
                let _ = ferry_net::write_frame(
                    &mut out,
                    UNIX_PEER,
                    &refusal(shared, &format!("no CUDA IPC here: {why}")),
                );
                return Ok(None);
            }
        }
    } else if transport == local_code() || share {
        None
    } else {
        let _ = ferry_net::write_frame(
            &mut out,
            UNIX_PEER,
            &refusal(shared, "this socket serves the same-host plane only"),
        );
        return Ok(None);
    };
    let mut talk =
        ServerConversation::new(shared.responder.clone(), shared.table.clone(), UNIX_PEER);
    let proto = match talk.on_frame(frame) {
        ServerStep::Stream { stream, .. } => stream,
        ServerStep::Close(f) | ServerStep::Reply(f) => {
            let _ = ferry_net::write_frame(&mut out, UNIX_PEER, &f);
            return Ok(None);
        }
        ServerStep::Fail(e) => return Err(e),
        _ => return Ok(None),
    };
    if shared.streams.load(Ordering::Acquire) >= shared.max_streams {
        let _ = ferry_net::write_frame(
            &mut out,
            UNIX_PEER,
            &refusal(shared, "too many same-host streams are served now"),
        );
        return Ok(None);
    }
    ferry_net::write_frame(&mut out, UNIX_PEER, &ControlFrame::StreamAccept)?;
    // The probe: the client names eight bytes of its memory; we read them and send them back.
    let mut addr = [0u8; ADDR_LEN];
    reader
        .read_exact(&mut addr)
        .map_err(|e| ferry_net::lost(UNIX_PEER, "same-host probe", e))?;
    let mut value = [0u8; 8];
    let ours = [Span {
        addr: value.as_mut_ptr() as usize,
        len: value.len(),
    }];
    let theirs = [Span {
        addr: u64::from_le_bytes(addr) as usize,
        len: value.len(),
    }];
    // SAFETY: `value` is a local array, writable, not referenced during the copy.
    let copied = unsafe { host::copy(pid, Direction::In, &ours, &theirs) }
        .and_then(|()| host::hold_space(pid, client, theirs[0].addr as u64, value));
    let mut answer = [0u8; 9];
    let space = match copied {
        Ok(space) => {
            answer[0] = PROBE_OK;
            answer[1..].copy_from_slice(&value);
            Some(space)
        }
        Err(e) => {
            debug!(pid, error = %e, "same-host probe refused");
            answer[0] = PROBE_FAILED;
            answer[1..5].copy_from_slice(&e.raw_os_error().unwrap_or(0).to_le_bytes());
            None
        }
    };
    out.write_all(&answer)
        .map_err(|e| ferry_net::lost(UNIX_PEER, "same-host probe", e))?;
    let Some(space) = space else {
        return Ok(None);
    };
    let ring = if ring {
        offer_ring(sock, &mut reader)
            .map_err(|e| ferry_net::lost(UNIX_PEER, "same-host ring offer", e))?
    } else {
        None
    };
    Ok(Some((proto, gpu, space, ring, share)))
}

/// What an attach leaves a served stream: its protocol, its CUDA IPC state, the client's
/// address space held, the ring when the client took it, and whether it is a share stream
/// (`crate::shares`).
type Attachment = (
    ServerStream,
    Option<Served>,
    host::AddressSpace,
    Option<Shm>,
    bool,
);

/// Offers a fresh ring (its memfd over the socket) and reads whether the client took it.
fn offer_ring(sock: &UnixStream, reader: &mut Deadline<'_>) -> io::Result<Option<Shm>> {
    let made = Shm::create(SHM_LEN);
    match &made {
        Ok((_, fd)) => send_fd(sock, RING_OFFER, Some(fd))?,
        Err(e) => {
            debug!(error = %e, "no ring for a same-host stream; it stays on the socket");
            send_fd(sock, RING_NONE, None)?
        }
    }
    let mut taken = [0u8; 1];
    reader.read_exact(&mut taken)?;
    Ok(match made {
        Ok((shm, _fd)) if taken[0] == RING_TAKEN => Some(shm),
        _ => None,
    })
}

/// What a served stream reads requests from and writes answers to: its socket, or its ring.
#[derive(Clone, Copy)]
enum Conn<'a> {
    Sock(&'a UnixStream),
    Ring(&'a UnixStream, &'a Tx, &'a Rx),
}

impl<'a> Conn<'a> {
    fn write_all(self, bytes: &[u8]) -> io::Result<()> {
        match self {
            Conn::Sock(s) => (&*s).write_all(bytes),
            Conn::Ring(_, tx, _) => tx.write_all(bytes),
        }
    }

    /// Whether a request (or the end) is there to read now.
    fn readable_now(self) -> bool {
        match self {
            Conn::Sock(s) => host::readable_now(s),
            Conn::Ring(_, _, rx) => rx.ready(),
        }
    }

    fn ring(self) -> bool {
        matches!(self, Conn::Ring(..))
    }

    /// The stream's socket.
    fn sock(self) -> &'a UnixStream {
        match self {
            Conn::Sock(s) | Conn::Ring(s, ..) => s,
        }
    }
}

impl Read for Conn<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match *self {
            Conn::Sock(s) => (&*s).read(buf),
            Conn::Ring(_, _, rx) => rx.read(buf),
        }
    }
}

/// The client a stream serves, as proven at its attach: copies go to `pid` only while it is
/// still that process (`process`) running in that address space (`space`), both checked before
/// each request: a client that exited or exec'd (a set-user-id program, say) is never copied
/// to again, whoever holds the stream's socket now.
struct Held<'a> {
    pid: u32,
    process: &'a host::Pidfd,
    space: &'a host::AddressSpace,
}

impl Held<'_> {
    /// Before a request: the client still the process and the program that attached, and the
    /// stream not given up (`ESRCH`: it exited or exec'd; `ECONNRESET`: it hung up both ways,
    /// so nothing more is copied).
    fn check(&self, sock: &UnixStream) -> io::Result<()> {
        match host::liveness(sock, self.process) {
            host::Liveness::Live => {}
            host::Liveness::Exited => return Err(io::Error::from_raw_os_error(libc::ESRCH)),
            host::Liveness::HungUp => return Err(io::Error::from_raw_os_error(libc::ECONNRESET)),
        }
        if self.space.gone() {
            return Err(io::Error::from_raw_os_error(libc::ESRCH));
        }
        Ok(())
    }
}

fn refusal(shared: &Shared, message: &str) -> ControlFrame {
    ControlFrame::Reject(Reject {
        reason: RejectReason::Refused,
        versions: SUPPORTED_VERSIONS,
        epoch: shared.responder.epoch(),
        message: message.into(),
    })
}

/// Serves requests until the client closes the stream, as the stream protocol decides: every
/// request is checked (token, access, bounds) before any byte of a segment is touched; each is
/// followed by the client's address block (one address, or one per piece), and the copy goes
/// between the checked segment range and those addresses in the client process. Answers are
/// written once no further request is waiting, so a burst is answered in one write.
///
/// On a ring stream (`conn`) the client's liveness (`held`) is checked before each request
/// that copies to or from its memory: an inline op's bytes go through the ring only, so it
/// needs none (and makes no system call).
fn serve_data(
    sock: &UnixStream,
    conn: Conn<'_>,
    held: &Held<'_>,
    staged: &AtomicUsize,
    mut proto: ServerStream,
    mut gpu: Option<Served>,
) -> io::Result<()> {
    let pid = held.pid;
    let ring = conn.ring();
    let mut rd = BufReader::with_capacity(64 << 10, conn);
    let mut inline = [0u8; INLINE_MAX];
    let mut out: Vec<u8> = Vec::with_capacity(4 << 10);
    let mut staging = Staging::new(staged);
    let mut table: Vec<u8> = Vec::new();
    let mut entries: Vec<Entry> = Vec::new();
    let ipc = gpu.is_some();
    let mut head = [0u8; DATA_REQUEST_LEN];
    loop {
        flush_unless_buffered(&rd, DATA_REQUEST_LEN + ADDR_LEN, conn, &mut out)?;
        // Idle (no request waiting, here or on the socket): the file staging is given back.
        staging.settle(|| rd.buffer().is_empty() && !conn.readable_now());
        match rd.read_exact(&mut head) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => {
                conn.write_all(&out)?;
                return Ok(());
            }
            Err(e) => return Err(e),
        }
        let action = proto.on_request(&head);
        // The client checked: on a ring stream before copies only (memory ops: `serve_memory`).
        let copies = matches!(
            action,
            Action::ReadFile { .. } | Action::WriteFile { .. } | Action::Table { .. }
        );
        if !ring || copies {
            held.check(sock)?;
        }
        match action {
            Action::WriteMemory {
                lease,
                at,
                len,
                seq,
                ..
            } => {
                let answer = proto.answer_write(seq);
                let op = (Direction::In, &*lease.region, at, len);
                serve_memory(&mut rd, held, op, (ipc, ring), &mut gpu, &mut inline)?;
                out.extend_from_slice(&answer);
            }
            Action::ReadMemory {
                lease,
                at,
                len,
                response,
            } => {
                let op = (Direction::Out, &*lease.region, at, len);
                let moved = serve_memory(&mut rd, held, op, (ipc, ring), &mut gpu, &mut inline)?;
                out.extend_from_slice(&response);
                out.extend_from_slice(moved);
            }
            Action::ReadFile {
                file,
                at,
                len,
                response,
            } => {
                let op = (Direction::Out, &file, at, len);
                let bufs = (&mut staging.buf, &mut inline);
                let moved = serve_file(&mut rd, pid, op, (ipc, ring), &mut gpu, bufs)?;
                out.extend_from_slice(&response);
                out.extend_from_slice(moved);
            }
            Action::WriteFile {
                file,
                at,
                len,
                response,
            } => {
                let op = (Direction::In, &file, at, len);
                let bufs = (&mut staging.buf, &mut inline);
                serve_file(&mut rd, pid, op, (ipc, ring), &mut gpu, bufs)?;
                out.extend_from_slice(&response);
            }
            Action::ChecksumMemory { sum, seq, .. } => {
                skip_entry(&mut rd, ipc, ring, &mut inline)?;
                out.extend_from_slice(&checksum_response(seq, sum.finish()));
            }
            Action::ChecksumFile { file, at, len, seq } => {
                skip_entry(&mut rd, ipc, ring, &mut inline)?;
                let crc = crc32c_file(&*file, at, len)?;
                out.extend_from_slice(&checksum_response(seq, crc));
            }
            Action::Refuse { response, .. } => {
                skip_entry(&mut rd, ipc, ring, &mut inline)?;
                out.extend_from_slice(&response);
            }
            Action::Table { req } => {
                let bufs = (&mut table, &mut entries, &mut staging.buf, &mut out);
                if !serve_table(&mut rd, conn, pid, &mut proto, &req, ipc, &mut gpu, bufs)? {
                    conn.write_all(&out)?;
                    return Ok(());
                }
            }
            Action::Vectored { .. } => {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    "pieces without a table",
                ));
            }
            Action::Close { response, error } => {
                out.extend_from_slice(&response);
                conn.write_all(&out)?;
                return Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    error.to_string(),
                ));
            }
        }
    }
}

/// One READ (`Out`) or WRITE (`In`) of the checked range `at..at+len` of `region`: its entry
/// read, then its bytes moved inline through the ring (a WRITE's read from it; a READ's
/// returned, to follow the response) or copied to or from the client's memory, after the check
/// that the client is still the process and program that attached (on a ring stream; a socket
/// stream checked it before the request). What the answer carries after its response.
fn serve_memory<'b>(
    rd: &mut BufReader<Conn<'_>>,
    held: &Held<'_>,
    (dir, region, at, len): (Direction, &ferry_core::MemoryRegion, u64, usize),
    (ipc, ring): (bool, bool),
    gpu: &mut Option<Served>,
    inline: &'b mut [u8; INLINE_MAX],
) -> io::Result<&'b [u8]> {
    let theirs = read_entry(rd, len, ipc, ring)?;
    if let Entry::Inline(n) = theirs {
        if dir == Direction::In {
            let bytes = inline_bytes(inline, n, len)?;
            rd.read_exact(bytes)?;
            write_region(region, at, bytes)?;
            return Ok(&[]);
        }
        let bytes = inline_bytes(inline, n + len, len)?;
        region
            .read_at(at, bytes)
            .map_err(|_| invalid("an inline READ outside its segment"))?;
        return Ok(bytes);
    }
    if ring {
        held.check(rd.get_ref().sock())?;
    }
    copy_memory(held.pid, dir, theirs, region, at, len, gpu)?;
    Ok(&[])
}

/// One READ (`Out`) or WRITE (`In`) of `len` bytes at `at` of a published file (its range
/// checked): its entry read, then its bytes moved inline through the ring (a small op on a ring
/// stream; a READ's returned, to follow the response), to or from a CUDA IPC grant, or through
/// `staging` to or from the client's memory (the client checked before the request). What the
/// answer carries after its response.
fn serve_file<'b>(
    rd: &mut BufReader<Conn<'_>>,
    pid: u32,
    (dir, file, at, len): (Direction, &Arc<dyn ferry_core::FileSource>, u64, usize),
    (ipc, ring): (bool, bool),
    gpu: &mut Option<Served>,
    (staging, inline): (&mut Vec<u8>, &'b mut [u8; INLINE_MAX]),
) -> io::Result<&'b [u8]> {
    let theirs = match read_entry(rd, len, ipc, ring)? {
        Entry::Inline(n) if dir == Direction::In => {
            let bytes = inline_bytes(inline, n, len)?;
            rd.read_exact(bytes)?;
            file.write_all_at(at, bytes)?;
            return Ok(&[]);
        }
        Entry::Inline(n) => {
            let bytes = inline_bytes(inline, n + len, len)?;
            file.read_exact_at(at, bytes)?;
            return Ok(bytes);
        }
        Entry::Addr(span) => span,
        Entry::Ipc(grant) => {
            let served = served(gpu)?;
            match dir {
                Direction::Out => served.read_file(&grant, file, at, len, staging)?,
                Direction::In => served.write_file(&grant, file, at, len, staging)?,
            }
            return Ok(&[]);
        }
    };
    staging.resize(len, 0);
    if dir == Direction::Out {
        file.read_exact_at(at, staging)?;
    }
    let ours = Span {
        addr: staging.as_mut_ptr() as usize,
        len,
    };
    // SAFETY: `staging` is ours, `len` bytes long, writable, and not referenced elsewhere
    // during the copy.
    unsafe { host::copy(pid, dir, &[ours], &[theirs])? };
    if dir == Direction::In {
        file.write_all_at(at, staging)?;
    }
    Ok(&[])
}

/// A stream's file staging (a file op's bytes pass through it), counted in its server's total
/// and given back whenever the stream goes idle.
struct Staging<'a> {
    buf: Vec<u8>,
    counted: usize,
    total: &'a AtomicUsize,
}

impl<'a> Staging<'a> {
    fn new(total: &'a AtomicUsize) -> Self {
        Self {
            buf: Vec::new(),
            counted: 0,
            total,
        }
    }

    /// Counts what the buffer holds now; gives it back if the stream is `idle` (asked only
    /// while it holds something).
    fn settle(&mut self, idle: impl FnOnce() -> bool) {
        if self.buf.capacity() > 0 && idle() {
            self.buf = Vec::new();
        }
        let now = self.buf.capacity();
        if now > self.counted {
            self.total.fetch_add(now - self.counted, Ordering::AcqRel);
        } else {
            self.total.fetch_sub(self.counted - now, Ordering::AcqRel);
        }
        self.counted = now;
    }
}

impl Drop for Staging<'_> {
    fn drop(&mut self) {
        self.total.fetch_sub(self.counted, Ordering::AcqRel);
    }
}

/// One memory request's copy between the checked range `at..at+len` of `region` and the
/// client's entry: a plain address by a cross-process copy (`In`: the client's bytes into
/// `region`), a CUDA IPC grant by the driver.
fn copy_memory(
    pid: u32,
    dir: Direction,
    theirs: Entry,
    region: &ferry_core::MemoryRegion,
    at: u64,
    len: usize,
    gpu: &mut Option<Served>,
) -> io::Result<()> {
    let theirs = match theirs {
        Entry::Addr(span) => span,
        Entry::Inline(_) => return Err(invalid("an inline entry where an address belongs")),
        Entry::Ipc(grant) => {
            let g = served(gpu)?;
            return match dir {
                Direction::In => g.write_region(&grant, region, at, len),
                Direction::Out => g.read_region(&grant, region, at, len),
            };
        }
    };
    let ours = Span {
        addr: region.as_ptr() as usize + at as usize,
        len,
    };
    // SAFETY: the stream protocol checked `at..at+len` against the region, which the caller's
    // lease keeps alive; no Rust reference into it exists; a READ (`Out`) only reads it.
    unsafe { host::copy(pid, dir, &[ours], &[theirs]) }
}

/// A vectored request: its piece table and address block read (answers queued so far
/// written first unless both are buffered), checked, and served. `false` when the stream must
/// close after the answers in `out`.
#[allow(clippy::too_many_arguments)]
fn serve_table(
    rd: &mut BufReader<Conn<'_>>,
    conn: Conn<'_>,
    pid: u32,
    proto: &mut ServerStream,
    req: &ferry_core::wire::VectoredRequest,
    ipc: bool,
    gpu: &mut Option<Served>,
    (table, entries, stage, out): (&mut Vec<u8>, &mut Vec<Entry>, &mut Vec<u8>, &mut Vec<u8>),
) -> io::Result<bool> {
    if req.pieces > MAX_PIECES {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "too many pieces",
        ));
    }
    table.resize(req.table_len(), 0);
    flush_unless_buffered(rd, table.len() + req.pieces as usize * ADDR_LEN, conn, out)?;
    rd.read_exact(table)?;
    entries.clear();
    for _ in 0..req.pieces {
        // Pieces are never inline: the mark is only an address here (whose copy fails).
        entries.push(read_entry(rd, 0, ipc, false)?);
    }
    let action = proto.on_table(req, table);
    serve_vectored(pid, action, entries, gpu, stage, out)
}

/// Writes the answers queued in `out` unless `need` bytes of requests are already buffered: a
/// read that could wait for the client never leaves answers behind.
fn flush_unless_buffered(
    rd: &BufReader<Conn<'_>>,
    need: usize,
    conn: Conn<'_>,
    out: &mut Vec<u8>,
) -> io::Result<()> {
    if rd.buffer().len() < need && !out.is_empty() {
        conn.write_all(out)?;
        out.clear();
    }
    Ok(())
}

/// Performs a vectored request's accepted pieces against the client's addresses, in order
/// (memory pieces in one copy call, file pieces through `stage`), and queues its response.
/// `false` when the stream must close after the response.
fn serve_vectored(
    pid: u32,
    action: Action,
    entries: &[Entry],
    gpu: &mut Option<Served>,
    stage: &mut Vec<u8>,
    out: &mut Vec<u8>,
) -> io::Result<bool> {
    let (kind, targets, response) = match action {
        Action::Vectored {
            kind,
            targets,
            response,
            ..
        } => (kind, targets, response),
        Action::Close { response, .. } => {
            out.extend_from_slice(&response);
            return Ok(false);
        }
        _ => {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "a piece table answered with neither pieces nor a close",
            ));
        }
    };
    let dir = match kind {
        OpKind::Write => Direction::In,
        OpKind::Read | OpKind::Checksum => Direction::Out,
    };
    // The pieces accepted are the first ones (up to a refused piece): each takes its address
    // from the block's entry at its place; the entries after a refusal are not used.
    if entries.len() < targets.len() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "an address block shorter than the pieces accepted",
        ));
    }
    let mut ours = Vec::with_capacity(targets.len());
    let mut theirs = Vec::with_capacity(targets.len());
    for (t, entry) in targets.iter().zip(entries) {
        let addr = match entry {
            Entry::Addr(span) => span.addr,
            Entry::Inline(_) => return Err(invalid("an inline entry for a piece")),
            Entry::Ipc(grant) => {
                // Memory pieces before it move first, so that order is kept.
                // SAFETY: the ranges were checked by the stream protocol; leases live in
                // `targets` for the call.
                unsafe { host::copy(pid, dir, &ours, &theirs)? };
                ours.clear();
                theirs.clear();
                let g = served(gpu)?;
                match (t, dir) {
                    (Target::Memory { lease, at, len }, Direction::In) => {
                        g.write_region(grant, &lease.region, *at, *len)?
                    }
                    (Target::Memory { lease, at, len }, Direction::Out) => {
                        g.read_region(grant, &lease.region, *at, *len)?
                    }
                    (Target::File { file, at, len }, Direction::In) => {
                        g.write_file(grant, file, *at, *len, stage)?
                    }
                    (Target::File { file, at, len }, Direction::Out) => {
                        g.read_file(grant, file, *at, *len, stage)?
                    }
                }
                continue;
            }
        };
        match t {
            Target::Memory { lease, at, len } => {
                ours.push(Span {
                    addr: lease.region.as_ptr() as usize + *at as usize,
                    len: *len,
                });
                theirs.push(Span { addr, len: *len });
            }
            Target::File { file, at, len } => {
                // Memory pieces before it move first, so that order is kept.
                // SAFETY: the ranges were checked by the stream protocol; leases live in
                // `targets` for the call.
                unsafe { host::copy(pid, dir, &ours, &theirs)? };
                ours.clear();
                theirs.clear();
                stage.resize(*len, 0);
                let one = [Span {
                    addr: stage.as_mut_ptr() as usize,
                    len: *len,
                }];
                let there = [Span { addr, len: *len }];
                if dir == Direction::In {
                    // SAFETY: `stage` is ours, writable, unreferenced during the copy.
                    unsafe { host::copy(pid, dir, &one, &there)? };
                    file.write_all_at(*at, stage)?;
                } else {
                    file.read_exact_at(*at, stage)?;
                    // SAFETY: `stage` is ours and only read.
                    unsafe { host::copy(pid, dir, &one, &there)? };
                }
            }
        }
    }
    // SAFETY: as above.
    unsafe { host::copy(pid, dir, &ours, &theirs)? };
    drop(targets);
    out.extend_from_slice(&response);
    Ok(true)
}

/// One entry of an address block.
enum Entry {
    /// An address in the client's memory: `len` bytes there are its range for the copy.
    Addr(Span),
    /// A CUDA IPC grant (CUDA IPC streams only), as it came.
    Ipc([u8; IPC_REF_LEN]),
    /// No address (ring streams only): this many bytes follow the entry in the ring.
    Inline(usize),
}

fn invalid(what: &str) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, what.to_owned())
}

/// The first `len` bytes of `buf` for an inline op whose entry said `follows` bytes come
/// (`len` for a WRITE; a READ passes `len` more, so `follows` must be 0).
fn inline_bytes(buf: &mut [u8; INLINE_MAX], follows: usize, len: usize) -> io::Result<&mut [u8]> {
    if follows != len || len > INLINE_MAX {
        return Err(invalid("an inline entry whose length is not its op's"));
    }
    Ok(&mut buf[..len])
}

/// Copies an inline WRITE's bytes into the checked range at `at` of `region`.
fn write_region(region: &ferry_core::MemoryRegion, at: u64, bytes: &[u8]) -> io::Result<()> {
    region
        .write_at(at, bytes)
        .map_err(|_| invalid("an inline WRITE outside its segment"))
}

/// Reads the entry of a request that copies nothing (refused, or a checksum), and on a ring
/// stream the inline bytes that follow it.
fn skip_entry(
    rd: &mut impl Read,
    ipc: bool,
    ring: bool,
    buf: &mut [u8; INLINE_MAX],
) -> io::Result<()> {
    if let Entry::Inline(n) = read_entry(rd, 0, ipc, ring)? {
        rd.read_exact(&mut buf[..n])?;
    }
    Ok(())
}

/// Reads one entry of an address block (`len`: the request's length; pieces of a vectored
/// request take theirs from the table): an address, or on a CUDA IPC stream (`ipc`) a marked
/// address and its grant.
fn read_entry(rd: &mut impl Read, len: usize, ipc: bool, ring: bool) -> io::Result<Entry> {
    let mut raw = [0u8; ADDR_LEN];
    rd.read_exact(&mut raw)?;
    if len > MAX_CHUNK as usize {
        return Err(io::Error::from(io::ErrorKind::InvalidData));
    }
    let addr = u64::from_le_bytes(raw);
    if ipc && addr & IPC_MARK != 0 {
        let mut grant = [0u8; IPC_REF_LEN];
        rd.read_exact(&mut grant)?;
        return Ok(Entry::Ipc(grant));
    }
    if ring && addr & (IPC_MARK | INLINE_MARK) == INLINE_MARK {
        let follows = (addr & u64::from(u32::MAX)) as usize;
        if follows > INLINE_MAX {
            return Err(invalid("more inline bytes than an op may move"));
        }
        return Ok(Entry::Inline(follows));
    }
    Ok(Entry::Addr(Span {
        addr: addr as usize,
        len,
    }))
}

/// The stream's CUDA IPC state (a grant comes only on a CUDA IPC stream, which has it).
fn served(gpu: &mut Option<Served>) -> io::Result<&mut Served> {
    gpu.as_mut().ok_or_else(|| {
        io::Error::new(
            io::ErrorKind::InvalidData,
            "a CUDA IPC grant on a stream without CUDA IPC",
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferry_core::wire::{Hello, StreamAttach};
    use ferry_core::{Epoch, PeerId, SegmentDesc, SegmentLease, SegmentToken};

    #[derive(Debug)]
    struct Responder(Epoch);

    impl HandshakeResponder for Responder {
        fn peer_id(&self) -> PeerId {
            PeerId(7)
        }
        fn epoch(&self) -> Epoch {
            self.0
        }
        fn respond(&self, _: &Hello, _: SocketAddr, _: Option<&str>) -> Result<Hello, Reject> {
            panic!("a same-host socket never answers a hello")
        }
    }

    #[derive(Debug)]
    struct Nothing;

    impl SegmentTable for Nothing {
        fn resolve(&self, _: SegmentToken) -> Option<SegmentLease> {
            None
        }
        fn published(&self) -> Vec<SegmentDesc> {
            Vec::new()
        }
    }

    fn server(timeout: Duration, max_pending: usize) -> (LocalServerHandle, Epoch) {
        server_of(timeout, max_pending, 4)
    }

    fn server_of(
        timeout: Duration,
        max_pending: usize,
        max_streams: usize,
    ) -> (LocalServerHandle, Epoch) {
        let epoch = Epoch::fresh();
        let h = LocalServer::bind()
            .unwrap()
            .serve(
                Arc::new(Nothing),
                Arc::new(Responder(epoch)),
                HandshakeLimits {
                    timeout,
                    max_pending,
                },
                max_streams,
            )
            .unwrap();
        (h, epoch)
    }

    /// Attaches a stream of this process and answers the probe with `canary`'s address:
    /// what the server answered (its first byte `PROBE_OK` or `PROBE_FAILED`).
    fn attach_probed(h: &LocalServerHandle, epoch: Epoch, canary: u64) -> (UnixStream, [u8; 9]) {
        let mut s = connect(h);
        ferry_net::write_frame(&mut s, UNIX_PEER, &attach(epoch, local_code())).unwrap();
        let reply = ferry_net::read_frame(&mut s, UNIX_PEER).unwrap();
        assert!(matches!(reply, ControlFrame::StreamAccept), "{reply:?}");
        s.write_all(&canary.to_le_bytes()).unwrap();
        let mut answer = [0u8; 9];
        s.read_exact(&mut answer).unwrap();
        (s, answer)
    }

    /// A READ of 8 bytes of an unknown token into `at`: a served stream answers it (refused).
    fn unknown_read(s: &mut UnixStream, at: u64) {
        read_request(s, SegmentToken(99), 8, at);
    }

    /// Sends a READ of `len` bytes at offset 0 of `token` into `at`. A server that closed the
    /// stream refuses it (the write may fail): the caller reads what came.
    fn read_request(s: &mut UnixStream, token: SegmentToken, len: u32, at: u64) {
        let mut head = [0u8; DATA_REQUEST_LEN];
        ferry_core::wire::DataRequest {
            kind: OpKind::Read,
            seq: 0,
            token,
            offset: 0,
            len: len as _,
            ack_slack: 0,
        }
        .encode(&mut head);
        let _ = s.write_all(&head);
        let _ = s.write_all(&at.to_le_bytes());
    }

    #[test]
    fn past_the_stream_cap_an_attach_is_refused_with_the_reason() {
        let (h, epoch) = server_of(Duration::from_secs(30), 8, 1);
        let canary = Box::new(0x0bad_cafe_u64);
        let (_first, answer) = attach_probed(&h, epoch, (&raw const *canary) as u64);
        assert_eq!(answer[0], PROBE_OK);
        // Served by the time its probe was answered... and counted once its thread moves on:
        // the count is the server's, read after a request on the first stream was answered.
        let mut first = _first;
        let mut target = Box::new(0u64);
        unknown_read(&mut first, (&raw mut *target) as u64);
        let mut resp = [0u8; ferry_core::wire::DATA_RESPONSE_LEN];
        first.read_exact(&mut resp).unwrap();
        assert_eq!(h.streams(), 1);
        let mut second = connect(&h);
        ferry_net::write_frame(&mut second, UNIX_PEER, &attach(epoch, local_code())).unwrap();
        match ferry_net::read_frame(&mut second, UNIX_PEER).unwrap() {
            ControlFrame::Reject(r) => {
                assert_eq!(r.reason, RejectReason::Refused);
                assert!(r.message.contains("too many"), "{}", r.message);
            }
            other => panic!("the stream past the cap was not refused: {other:?}"),
        }
        assert!(rest(second).is_empty());
    }

    /// A file of 7s, in memory, published as token 5.
    #[derive(Debug)]
    struct Sevens;

    impl ferry_core::FileSource for Sevens {
        fn check(&self, _: OpKind, offset: u64, _: u64) -> Result<u64, ferry_core::RemoteStatus> {
            Ok(offset)
        }
        fn read_exact_at(&self, _: u64, buf: &mut [u8]) -> io::Result<()> {
            buf.fill(7);
            Ok(())
        }
        fn write_all_at(&self, _: u64, _: &[u8]) -> io::Result<()> {
            Ok(())
        }
    }

    #[derive(Debug)]
    struct OneFile;

    impl SegmentTable for OneFile {
        fn resolve(&self, _: SegmentToken) -> Option<SegmentLease> {
            None
        }
        fn published(&self) -> Vec<SegmentDesc> {
            Vec::new()
        }
        fn file(&self, token: SegmentToken) -> Option<Arc<dyn ferry_core::FileSource>> {
            (token == SegmentToken(5)).then(|| Arc::new(Sevens) as Arc<dyn ferry_core::FileSource>)
        }
    }

    #[test]
    fn an_idle_stream_gives_its_file_staging_back() {
        let epoch = Epoch::fresh();
        let h = LocalServer::bind()
            .unwrap()
            .serve(
                Arc::new(OneFile),
                Arc::new(Responder(epoch)),
                HandshakeLimits::default(),
                4,
            )
            .unwrap();
        let canary = Box::new(0x5eed_u64);
        let (mut s, answer) = attach_probed(&h, epoch, (&raw const *canary) as u64);
        assert_eq!(answer[0], PROBE_OK);
        let mut target = vec![0u8; 1 << 20];
        read_request(&mut s, SegmentToken(5), 1 << 20, target.as_mut_ptr() as u64);
        let mut resp = [0u8; ferry_core::wire::DATA_RESPONSE_LEN];
        s.read_exact(&mut resp).unwrap();
        assert!(target.iter().all(|b| *b == 7));
        // The server gives the staging back before it waits for the next request: wait for
        // that (the stream is idle from now on), within a generous bound.
        let until = Instant::now() + Duration::from_secs(20);
        while h.staging_bytes() != 0 {
            assert!(
                Instant::now() < until,
                "the idle stream kept {} bytes",
                h.staging_bytes()
            );
            std::thread::yield_now();
        }
    }

    #[test]
    fn a_stream_whose_probe_fails_is_never_served() {
        let (h, epoch) = server(Duration::from_secs(30), 8);
        // Nothing is mapped at address 8: the probe's copy fails.
        let (mut s, answer) = attach_probed(&h, epoch, 8);
        assert_eq!(answer[0], PROBE_FAILED);
        let mut target = Box::new(0u64);
        unknown_read(&mut s, (&raw mut *target) as u64);
        // Nothing more comes from us: a served stream would answer, then end.
        let _ = s.shutdown(std::net::Shutdown::Write);
        assert!(
            rest(s).is_empty(),
            "a stream whose probe failed answered a request"
        );
        assert_eq!(h.streams(), 0);
    }

    fn connect(h: &LocalServerHandle) -> UnixStream {
        let addr = UnixAddr::from_abstract_name(h.name().as_bytes()).unwrap();
        UnixStream::connect_addr(&addr).unwrap()
    }

    fn attach(epoch: Epoch, transport: u16) -> ControlFrame {
        ControlFrame::StreamAttach(StreamAttach {
            peer_id: PeerId(1),
            epoch: Epoch::fresh(),
            server_epoch: epoch,
            transport,
            stream_index: 0,
        })
    }

    /// Reads until the server closes the connection: what it sent before.
    fn rest(mut s: UnixStream) -> Vec<u8> {
        let mut out = Vec::new();
        let _ = s.read_to_end(&mut out);
        out
    }

    #[test]
    fn a_connection_that_never_attaches_is_closed_at_the_deadline_and_counted() {
        let (h, _) = server(Duration::from_millis(200), 8);
        let s = connect(&h);
        assert!(rest(s).is_empty());
        assert_eq!(h.handshakes().timed_out, 1);
        assert_eq!(h.streams(), 0);
    }

    #[test]
    fn past_the_pending_cap_the_oldest_attaching_connection_makes_room() {
        let (h, epoch) = server(Duration::from_secs(30), 1);
        let first = connect(&h);
        // The gate admits in accept order: the second evicts the first, which sees its end.
        let mut second = connect(&h);
        assert!(rest(first).is_empty());
        ferry_net::write_frame(&mut second, UNIX_PEER, &attach(epoch, local_code())).unwrap();
        let reply = ferry_net::read_frame(&mut second, UNIX_PEER).unwrap();
        assert!(matches!(reply, ControlFrame::StreamAccept), "{reply:?}");
        // Counted by the time the second was admitted, which its answer follows.
        assert_eq!(h.handshakes().evicted, 1);
    }

    #[test]
    fn only_an_attach_for_this_plane_is_taken() {
        let (h, epoch) = server(Duration::from_secs(30), 8);
        // A hello: closed with no answer.
        let mut s = connect(&h);
        let hello = ControlFrame::Hello(Hello {
            versions: SUPPORTED_VERSIONS,
            peer_id: PeerId(1),
            epoch: Epoch::fresh(),
            transports: Vec::new(),
            segments: Vec::new(),
        });
        ferry_net::write_frame(&mut s, UNIX_PEER, &hello).unwrap();
        assert!(rest(s).is_empty());
        // An attach for the TCP plane: refused.
        let mut s = connect(&h);
        ferry_net::write_frame(&mut s, UNIX_PEER, &attach(epoch, 1)).unwrap();
        let reply = ferry_net::read_frame(&mut s, UNIX_PEER).unwrap();
        assert!(matches!(reply, ControlFrame::Reject(_)), "{reply:?}");
        // An attach meant for another incarnation: refused as stale.
        let mut s = connect(&h);
        ferry_net::write_frame(&mut s, UNIX_PEER, &attach(Epoch::fresh(), local_code())).unwrap();
        match ferry_net::read_frame(&mut s, UNIX_PEER).unwrap() {
            ControlFrame::Reject(r) => assert_eq!(r.reason, RejectReason::StaleEpoch),
            other => panic!("{other:?}"),
        }
        assert_eq!(h.streams(), 0);
    }

    #[test]
    fn an_attached_stream_is_probed_then_served_and_refuses_what_the_table_lacks() {
        let (h, epoch) = server(Duration::from_secs(30), 8);
        let mut s = connect(&h);
        ferry_net::write_frame(&mut s, UNIX_PEER, &attach(epoch, local_code())).unwrap();
        let reply = ferry_net::read_frame(&mut s, UNIX_PEER).unwrap();
        assert!(matches!(reply, ControlFrame::StreamAccept), "{reply:?}");
        let canary = Box::new(0x1234_5678_9abc_def1_u64);
        let at = (&raw const *canary) as usize as u64;
        s.write_all(&at.to_le_bytes()).unwrap();
        let mut answer = [0u8; 9];
        s.read_exact(&mut answer).unwrap();
        assert_eq!(answer[0], PROBE_OK);
        assert_eq!(answer[1..], canary.to_le_bytes());
        // A READ of a token the table does not know: refused, nothing copied.
        let mut target = Box::new(0u64);
        unknown_read(&mut s, (&raw mut *target) as usize as u64);
        let mut resp = [0u8; ferry_core::wire::DATA_RESPONSE_LEN];
        s.read_exact(&mut resp).unwrap();
        let r = ferry_core::wire::DataResponse::decode(&resp).unwrap();
        assert_eq!(r.refused, Some(ferry_core::RemoteStatus::UnknownSegment));
        assert_eq!(*target, 0);
        drop(s);
    }
}
