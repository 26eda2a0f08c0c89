//! The client side: a channel of a few streams over the server's abstract Unix socket, each
//! driven by the core stream protocol ([`ClientStream`]). Chunks are posted by whichever thread
//! has them (the submitter, or the stream's reader after a response made room); each stream's
//! reader thread resolves responses, except on a ring stream while every request in flight has
//! a task spinning for its answers (small ones): those tasks resolve them, and the reader stays
//! parked (`watching`, [`pipe::Rx::park_while`]), so a round trip wakes no thread.

use std::io::{self, Read, Write};
use std::net::SocketAddr;
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr as UnixAddr, UnixStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

/// How long a closed channel waits for the server to answer what it holds and end its streams
/// before it revokes the server's copies and gives the streams up: a server that is stopped
/// (or stalled) does not hold the channel's requests past it.
const CLOSE_GRACE: Duration = Duration::from_millis(400);

/// After the revocation, how long a channel waits at most for the server to end its streams or
/// to be seen stopped, before it gives the streams up anyway (a copy the server's thread was
/// inside when the revocation came ends within this, unless the kernel waits on this
/// process's own memory).
const SETTLE: Duration = Duration::from_millis(200);

use ferry_core::countdown::Countdown;
use ferry_core::dealer::{Dealer, StreamSet, deal_request};
use ferry_core::handshake::{attach_frame, attach_reply, stream_attach};
use ferry_core::outcome::FailureKind;
use ferry_core::stream::{AckPolicy, Chunk, ChunkOwner, ClientStream, Outgoing, Post, Resolution};
use ferry_core::wire::{
    ControlFrame, DATA_REQUEST_LEN, DATA_RESPONSE_LEN, RejectReason, TransportOffer,
    VECTORED_VERSION,
};
use ferry_core::{
    BoxFuture, Channel, Error, Op, OpKind, Outcome, PeerInfo, RequestControl, TransportKind,
};
use tracing::{debug, warn};

use crate::host;
use crate::pipe::{self, Link, Tx};
use crate::ring::{ANSWERS, REQUESTS, SHM_LEN, Spin};
use crate::shares::Shares;
use crate::shm::{Shm, recv_fd};
use crate::wire::{
    ADDR_LEN, CUDA_IPC_CODE, INLINE_MARK, IPC_MARK, IPC_REF_LEN, PROBE_OK, RING_BIT, RING_DECLINED,
    RING_OFFER, RING_TAKEN, SHARE_CODE, inline, local_code,
};

/// How a channel moves GPU buffers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum GpuRoute {
    /// Granted by CUDA IPC and copied by the server with the driver (no host bounce).
    CudaIpc,
    /// Not on this channel (why): the engine stages GPU buffers through host memory.
    HostStage(String),
}

impl std::fmt::Display for GpuRoute {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            GpuRoute::CudaIpc => f.write_str("cuda-ipc"),
            GpuRoute::HostStage(why) => write!(f, "host stage ({why})"),
        }
    }
}

/// A stream's ring ends: requests written, answers read.
type Ends = (Tx, pipe::Rx);

/// One stream's attach: ready (on its ring, if it took one), or an attach with CUDA IPC or
/// the ring that the server refused (its message).
enum Attached {
    Ready(UnixStream, Option<Ends>),
    Refused(String),
}

/// One request as the streams see it.
struct Req {
    ops: Arc<[Op]>,
    control: Arc<RequestControl>,
    /// Its unresolved chunks, and the poster's part until everything is dealt; the last wakes
    /// the request's task.
    parts: Countdown,
    /// Whether it is counted in its channel's `watching` (its answers are the readers' to
    /// resolve), until its last chunk resolves.
    watched: AtomicBool,
    /// The channel's count of such requests.
    watching: Arc<AtomicUsize>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl ChunkOwner for Req {
    fn ops(&self) -> &[Op] {
        &self.ops
    }

    fn control(&self) -> &RequestControl {
        &self.control
    }

    fn chunk_done(&self) {
        if self.parts.done_one() && self.watched.swap(false, Ordering::SeqCst) {
            self.watching.fetch_sub(1, Ordering::SeqCst);
        }
    }
}

type Job = ferry_core::stream::Work<Req>;

/// Opens the streams of a channel to `peer`, whose offer names its socket and pid: each stream
/// is connected, its server checked to be the handshake's process (`SO_PEERCRED`), granted the
/// right to copy to and from this process where Yama asks, attached, and probed. With `ipc`
/// `Ok` the first stream attaches as a CUDA IPC stream; a server that refuses it gets every
/// stream attached without (and the channel's GPU buffers take the host stage).
pub(crate) fn connect(
    peer: &PeerInfo,
    streams: usize,
    depth: usize,
    chunk: u64,
    timeout: Duration,
    ipc: Result<(), String>,
    (ring, share): (bool, bool),
) -> Result<LocalChannel, Error> {
    let TransportOffer::Local {
        pid,
        streams: offered,
        socket,
        ..
    } = &peer.offer
    else {
        return Err(Error::NoRoute {
            peer: peer.addr.to_string(),
            reason: "the peer offers no same-host plane".into(),
        });
    };
    let n = streams.min(usize::from(*offered).max(1));
    let mut socks = Vec::with_capacity(n);
    // Held by the channel: the server may copy to and from this process while it lives.
    let grant = host::allow_tracer(*pid).map_err(unavailable)?;
    let mut gpu = match ipc {
        // The driver refuses a process's own IPC handles.
        Ok(()) if *pid == std::process::id() => {
            GpuRoute::HostStage("the peer is this process (CUDA IPC is between processes)".into())
        }
        Ok(()) => GpuRoute::CudaIpc,
        Err(why) => GpuRoute::HostStage(why),
    };
    // What the server takes is learned on the first stream: a refusal with the ring asked
    // for is tried again without it (an older server), then without CUDA IPC.
    let mut with_ring = ring;
    for i in 0..n {
        let sock = loop {
            let ipc = gpu == GpuRoute::CudaIpc;
            let code = if ipc { CUDA_IPC_CODE } else { local_code() };
            let code = if with_ring { code | RING_BIT } else { code };
            match attach(peer, *pid, socket, i as u16, timeout, code)? {
                Attached::Ready(s, ends) => break (s, ends),
                Attached::Refused(why) if with_ring => {
                    debug!(peer = %peer.addr, why, "refused with the ring; attaching without");
                    with_ring = false;
                }
                Attached::Refused(why) if ipc => {
                    debug!(peer = %peer.addr, why, "the peer takes no CUDA IPC; GPU buffers are staged");
                    gpu = GpuRoute::HostStage(format!("the peer refused CUDA IPC: {why}"));
                    with_ring = ring;
                }
                Attached::Refused(why) => return Err(unavailable(why)),
            }
        };
        socks.push(sock);
    }
    let shares = share
        .then(|| match attach(peer, *pid, socket, n as u16, timeout, SHARE_CODE) {
            Ok(Attached::Ready(s, _)) => Some(Arc::new(Shares::new(s))),
            Ok(Attached::Refused(why)) => {
                debug!(peer = %peer.addr, why, "no share stream: the owner copies everything");
                None
            }
            Err(e) => {
                debug!(peer = %peer.addr, error = %e, "no share stream: the owner copies everything");
                None
            }
        })
        .flatten();
    let mut ch = LocalChannel::new(
        peer.addr,
        socks,
        depth,
        chunk,
        peer.version >= VECTORED_VERSION,
        gpu,
        (*pid, grant),
    );
    ch.shares = shares;
    Ok(ch)
}

fn unavailable(reason: String) -> Error {
    Error::Unavailable {
        library: "same-host plane".into(),
        reason,
    }
}

fn attach(
    peer: &PeerInfo,
    pid: u32,
    socket: &str,
    index: u16,
    timeout: Duration,
    code: u16,
) -> Result<Attached, Error> {
    let addr = UnixAddr::from_abstract_name(socket.as_bytes())
        .map_err(|e| unavailable(format!("socket name {socket:?}: {e}")))?;
    let sock = UnixStream::connect_addr(&addr).map_err(|e| {
        unavailable(format!(
            "the peer's socket @{socket} is not reachable from here (another network \
             namespace?): {e}"
        ))
    })?;
    let io = |e: io::Error| ferry_net::lost(peer.addr, "attaching a same-host stream", e);
    sock.set_read_timeout(Some(timeout)).map_err(io)?;
    sock.set_write_timeout(Some(timeout)).map_err(io)?;
    let (owner, _) = host::peer_credentials(&sock).map_err(io)?;
    if owner != pid {
        return Err(unavailable(format!(
            "the socket @{socket} belongs to pid {owner}, but the peer's handshake named pid \
             {pid} (another pid namespace, or not the peer)"
        )));
    }
    let attach = stream_attach(peer, index, code);
    let mut w = &sock;
    ferry_net::write_frame(&mut w, peer.addr, &attach_frame(peer, attach))?;
    let mut r = &sock;
    let reply = ferry_net::read_frame(&mut r, peer.addr)?;
    if code != local_code()
        && let ControlFrame::Reject(refused) = &reply
        && refused.reason == RejectReason::Refused
    {
        return Ok(Attached::Refused(refused.message.clone()));
    }
    attach_reply(peer.addr, &attach, reply)?;
    // The probe: the server reads these eight bytes of ours and sends them back.
    let canary = Box::new(rand::random::<u64>() | 1);
    let at = (&raw const *canary) as usize as u64;
    w.write_all(&at.to_le_bytes()).map_err(io)?;
    let mut answer = [0u8; 9];
    r.read_exact(&mut answer).map_err(io)?;
    if answer[0] != PROBE_OK {
        let errno = i32::from_le_bytes([answer[1], answer[2], answer[3], answer[4]]);
        return Err(unavailable(format!(
            "the peer (pid {pid}) may not copy to and from this process: {} (Yama \
             ptrace_scope: {}; the copies need the same user, or CAP_SYS_PTRACE)",
            io::Error::from_raw_os_error(errno),
            host::yama_scope().map_or("none".into(), |s| s.to_string()),
        )));
    }
    if answer[1..] != canary.to_le_bytes() {
        return Err(unavailable(format!(
            "the peer (pid {pid}) answered the probe with bytes other than ours"
        )));
    }
    let ends = if code & RING_BIT != 0 {
        take_ring(peer.addr, &sock).map_err(io)?
    } else {
        None
    };
    sock.set_read_timeout(None).map_err(io)?;
    sock.set_write_timeout(None).map_err(io)?;
    Ok(Attached::Ready(sock, ends))
}

/// The longest a stream's reader thread spins for answers before it sleeps: short, since a
/// task awaiting a small request spins for its own answers, and a long spin would take a core
/// from the server's copies of a bulk transfer (seen as a loss in `bench ab`'s 1 MiB WRITEs on
/// two shared cores).
const READER_SPIN_NS: u64 = 5_000;

/// Reads the server's ring offer and maps the ring where it can (else the stream stays on the
/// socket), answering which.
fn take_ring(peer: SocketAddr, sock: &UnixStream) -> io::Result<Option<Ends>> {
    let (byte, fd) = recv_fd(sock)?;
    let mapped = match (byte, fd) {
        (RING_OFFER, Some(fd)) => match Shm::adopt(&fd, SHM_LEN) {
            Ok(shm) => Some(shm),
            Err(e) => {
                debug!(%peer, error = %e, "the same-host ring offered is not usable; on the socket");
                None
            }
        },
        _ => None,
    };
    let mut w = sock;
    let Some(shm) = mapped else {
        w.write_all(&[RING_DECLINED])?;
        return Ok(None);
    };
    w.write_all(&[RING_TAKEN])?;
    let (tx, rx) = Link::start(shm, sock, REQUESTS, ANSWERS)?;
    Ok(Some((tx, rx.with_max_spin(READER_SPIN_NS))))
}

/// A channel of the same-host plane to one peer incarnation.
#[derive(Debug)]
pub struct LocalChannel {
    shared: Arc<Shared>,
    /// The share stream and what it mapped (`crate::shares`), when the server has one.
    pub(crate) shares: Option<Arc<Shares>>,
}

struct Shared {
    peer: SocketAddr,
    dealer: Mutex<Dealer<Job>>,
    streams: Vec<Side>,
    chunk: u64,
    vectored: bool,
    gpu: GpuRoute,
    closed: AtomicBool,
    /// Whether small requests' tasks spin for their answers (some stream is on the ring).
    spins: bool,
    /// Requests with chunks outstanding that no task spins for: while there is none, the ring
    /// streams' readers stay parked ([`pipe::Rx::park_while`]) and an answer wakes no thread.
    watching: Arc<AtomicUsize>,
    /// How many requests armed the readers (see [`LocalChannel::readers_armed`]).
    armed: std::sync::atomic::AtomicU64,
    /// How long they spin now, in nanoseconds (adapted: [`Spin`]).
    spin: std::sync::atomic::AtomicU64,
    /// The server's process.
    server_pid: u32,
    /// Yama's grant to the server (where Yama asks for one), revoked with the last channel.
    _grant: host::TracerGrant,
    /// Streams ended, and its change announced (for the close's grace).
    ended: Mutex<usize>,
    ended_cv: Condvar,
}

impl std::fmt::Debug for Shared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LocalChannel")
            .field("peer", &self.peer)
            .field("streams", &self.streams.len())
            .finish()
    }
}

struct Side {
    sock: UnixStream,
    /// The stream's ring, when it took one: requests and answers go through it, and the
    /// socket carries only the hang-up.
    ring: Option<Ends>,
    proto: Mutex<ClientStream<Req>>,
    /// Request bytes the socket would not take without waiting (a server that does not read:
    /// stalled, stopped), sent before any later request: by the next pump, which every answer
    /// and every submit runs. Touched only with `proto` locked. A caller's thread never waits
    /// on the socket, so a frozen server cannot hold it past its deadline.
    outbox: Mutex<Vec<u8>>,
    /// An inline WRITE's header and bytes, put together (kept, so that no op zeroes a buffer
    /// of [`INLINE_MAX`](crate::wire::INLINE_MAX) bytes). Touched only with `proto` locked.
    scratch: Mutex<Vec<u8>>,
    alive: AtomicBool,
    /// What was received and not yet resolved: taken by the stream's reader thread, or by a
    /// task polling a request of the channel (which then resolves responses without waiting
    /// for the reader to be woken).
    rx: Mutex<Rx>,
}

/// The receiving side of one stream.
#[derive(Default)]
struct Rx {
    /// Bytes received (`RX_BUF` of them, allocated at the first receive): `at..len` are not
    /// resolved yet.
    buf: Vec<u8>,
    at: usize,
    len: usize,
    /// A chunk whose response header is resolved and whose bytes have not all come (a
    /// CHECKSUM's four, an inline READ's payload on a ring stream): the chunk, its bytes, and
    /// how many of them were received.
    pending: Option<(Chunk<Req>, usize, usize)>,
    /// The stream's end, once seen (the native error, if any), for the reader to act on.
    end: Option<Option<i32>>,
}

/// A stream's receive buffer: what one receive asks of the socket, at most (the part of a
/// response header left from the one before, under 32 bytes, stays in front of it).
const RX_BUF: usize = 16 << 10;

impl Side {
    /// Writes what the socket or ring takes of `bytes` now, without waiting: how much.
    fn send_now(&self, bytes: &[u8]) -> io::Result<usize> {
        match &self.ring {
            Some((tx, _)) => tx.send_now(bytes),
            None => send_all_now(&self.sock, bytes),
        }
    }

    /// Receives what is there into `buf` without waiting (`Ok(0)` at the end, `WouldBlock`).
    fn recv_now(&self, buf: &mut [u8]) -> io::Result<usize> {
        match &self.ring {
            Some((_, rx)) => rx.recv_now(buf),
            None => host::recv_now(&self.sock, buf),
        }
    }

    /// Waits until an answer or the end is there.
    fn wait_readable(&self) -> io::Result<()> {
        match &self.ring {
            Some((_, rx)) => {
                rx.wait();
                Ok(())
            }
            None => host::wait_readable(&self.sock),
        }
    }
}

impl Drop for Side {
    fn drop(&mut self) {
        // The ring's watcher holds a clone of the socket: without this the server would never
        // see the stream end.
        if self.ring.is_some() {
            let _ = self.sock.shutdown(std::net::Shutdown::Both);
        }
    }
}

impl LocalChannel {
    fn new(
        peer: SocketAddr,
        socks: Vec<(UnixStream, Option<Ends>)>,
        depth: usize,
        chunk: u64,
        vectored: bool,
        gpu: GpuRoute,
        (server_pid, grant): (u32, host::TracerGrant),
    ) -> Self {
        let n = socks.len();
        let spins = socks.iter().any(|(_, ring)| ring.is_some());
        let shared = Arc::new(Shared {
            spins,
            spin: std::sync::atomic::AtomicU64::new(Spin::new().budget_ns()),
            watching: Arc::default(),
            armed: Default::default(),
            peer,
            dealer: Mutex::new(Dealer::new(n)),
            streams: socks
                .into_iter()
                .map(|(sock, ring)| Side {
                    sock,
                    ring,
                    proto: Mutex::new(ClientStream::new(depth, AckPolicy::Immediate)),
                    outbox: Mutex::default(),
                    scratch: Mutex::default(),
                    alive: AtomicBool::new(true),
                    rx: Mutex::default(),
                })
                .collect(),
            chunk,
            vectored,
            gpu,
            closed: AtomicBool::new(false),
            server_pid,
            _grant: grant,
            ended: Mutex::new(0),
            ended_cv: Condvar::new(),
        });
        for i in 0..n {
            let s = shared.clone();
            let started = std::thread::Builder::new()
                .name("ferry-local-rx".into())
                .spawn(move || s.read_responses(i));
            if let Err(e) = started {
                debug!(error = %e, "cannot start a same-host reader; the stream is given up");
                shared.stream_ended(i, None);
            }
        }
        Self {
            shared,
            shares: None,
        }
    }

    /// Streams of the channel.
    pub fn streams(&self) -> usize {
        self.shared.streams.len()
    }

    /// How many of its streams run on the request/answer ring (the rest on their sockets).
    pub fn ring_streams(&self) -> usize {
        self.shared
            .streams
            .iter()
            .filter(|s| s.ring.is_some())
            .count()
    }

    /// How many requests so far armed the ring streams' readers (a request no task spins for,
    /// or a small one whose task's spin ran out): a reader thread is woken for an answer only
    /// after such an arm, so on a ring channel this bounds the readers' wake-ups.
    pub fn readers_armed(&self) -> u64 {
        self.shared.armed.load(Ordering::Relaxed)
    }

    /// How long a small request's task spins for its answers now (nanoseconds): the
    /// channel's adaptive spin, for diagnostics and tests.
    pub fn spin_ns(&self) -> u64 {
        self.shared.spin.load(Ordering::Relaxed)
    }

    /// How the channel moves GPU buffers: by CUDA IPC (a region made by
    /// `DeviceMemory::ipc_region` may be an op's local region), or not (the host stage, why).
    pub fn gpu_route(&self) -> &GpuRoute {
        &self.shared.gpu
    }
}

/// The most ops a request may have for its task to spin for its answers.
const SPIN_OPS: usize = 16;

impl Shared {
    /// Spins (resolving answers as they come) until `req` resolved or the channel's spin ran
    /// out. Resolved: the spin grows, and `None`. Ran out: `req` is watched, and the spin's
    /// start is returned, for [`spin_missed`](Self::spin_missed) once `req` resolves.
    fn spin_for(&self, req: &Req) -> Option<Instant> {
        let budget = self.spin.load(Ordering::Relaxed);
        let start = Instant::now();
        let until = start + Duration::from_nanos(budget);
        let mut i = 0u32;
        let hit = loop {
            if req.parts.is_done() {
                break true;
            }
            self.progress();
            std::hint::spin_loop();
            i = i.wrapping_add(1);
            if i.is_multiple_of(16) && Instant::now() >= until {
                break false;
            }
        };
        if hit {
            let mut s = Spin::from_ns(budget);
            s.hit();
            self.spin.store(s.budget_ns(), Ordering::Relaxed);
            return None;
        }
        self.watch(req);
        Some(start)
    }

    /// A request whose spin ran out resolved `waited` after the spin began: the spin adapts
    /// to that ([`Spin::missed`]).
    fn spin_missed(&self, waited: Duration) {
        let mut s = Spin::from_ns(self.spin.load(Ordering::Relaxed));
        s.missed(u64::try_from(waited.as_nanos()).unwrap_or(u64::MAX));
        self.spin.store(s.budget_ns(), Ordering::Relaxed);
    }

    /// No task spins for `req`'s answers (any more): counts it in `watching` until its last
    /// chunk resolves, and arms the ring streams' readers, so that the next answer wakes them
    /// (at once where answers are there already).
    fn watch(&self, req: &Req) {
        self.watching.fetch_add(1, Ordering::SeqCst);
        req.watched.store(true, Ordering::SeqCst);
        // Its last chunk may have resolved before it was marked: uncounted again.
        if req.parts.is_done() {
            if req.watched.swap(false, Ordering::SeqCst) {
                self.watching.fetch_sub(1, Ordering::SeqCst);
            }
            return;
        }
        if self.spins {
            self.armed.fetch_add(1, Ordering::Relaxed);
        }
        for side in &self.streams {
            if let Some((_, rx)) = &side.ring {
                rx.arm();
            }
        }
    }

    fn lock_dealer(&self) -> std::sync::MutexGuard<'_, Dealer<Job>> {
        self.dealer.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Posts what stream `i` may take while it has room.
    fn pump(&self, i: usize) {
        let side = &self.streams[i];
        let mut proto = side.proto.lock().unwrap_or_else(PoisonError::into_inner);
        if let Err(e) = flush(side) {
            debug!(peer = %self.peer, error = %e, "same-host stream failed to send");
            proto.fail_all(e.raw_os_error());
            let _ = side.sock.shutdown(std::net::Shutdown::Both);
            return;
        }
        while proto.has_room() {
            let idle = proto.in_flight() == 0;
            let Some(job) = self.lock_dealer().take(i, idle) else {
                return;
            };
            match proto.post(job) {
                Post::Send(out) => {
                    if let Err(e) = send(side, &out) {
                        debug!(peer = %self.peer, error = %e, "same-host stream failed to send");
                        proto.fail_all(e.raw_os_error());
                        let _ = side.sock.shutdown(std::net::Shutdown::Both);
                        return;
                    }
                    // No payload crosses the socket: the server copies it out of our memory
                    // before it answers (the copy is its own), so its answer stands alone.
                    proto.sent(out.seq);
                }
                Post::Resolved => {}
                Post::Broken(work) => {
                    if let Err(work) = self.lock_dealer().deal(work) {
                        work.not_posted(FailureKind::PeerLost);
                    }
                    return;
                }
            }
        }
    }

    /// Pumps the first live ring stream, which takes the job just dealt to another stream
    /// when it has nothing in flight: small requests one at a time keep to one stream, so one
    /// server thread serves them (spinning, while they come), and the others' sleep instead of
    /// spinning for every other request beside it (three spinners on two cores preempt each
    /// other: a spin that runs out wakes threads).
    fn pump_small_first(&self) {
        if let Some(i) = self
            .streams
            .iter()
            .position(|s| s.ring.is_some() && s.alive.load(Ordering::Acquire))
        {
            self.pump(i);
        }
    }

    fn pump_all(&self, set: StreamSet) {
        for i in 0..self.streams.len() {
            if set.contains(i) {
                self.pump(i);
            }
        }
    }

    /// The reader of stream `i`: waits for responses, resolves them (unless a polling task
    /// took them first), then posts what they made room for; ends the stream at its end.
    fn read_responses(self: Arc<Self>, i: usize) {
        let side = &self.streams[i];
        let native = loop {
            if let Some((_, rx)) = &side.ring {
                // While every request in flight has a task spinning for its answers, they
                // resolve them: this thread is not woken per answer.
                rx.park_while(|| self.watching.load(Ordering::SeqCst) == 0);
            }
            if let Err(e) = side.wait_readable() {
                break e.raw_os_error();
            }
            let mut rx = lock(&side.rx);
            let resolved = self.drain(i, &mut rx);
            if let Some(native) = rx.end {
                if let Some((chunk, ..)) = rx.pending.take() {
                    chunk.lost(native);
                }
                break native;
            }
            drop(rx);
            if resolved {
                self.pump(i);
            }
        };
        self.stream_ended(i, native);
    }

    /// Resolves, without waiting, whatever responses the streams have received (each stream
    /// whose receiving side is free now): what a task polling one of the channel's requests
    /// does, so that it sees its chunks resolved as soon as their answers came.
    fn progress(&self) {
        for (i, side) in self.streams.iter().enumerate() {
            if !side.alive.load(Ordering::Acquire) {
                continue;
            }
            let Ok(mut rx) = side.rx.try_lock() else {
                continue;
            };
            let resolved = self.drain(i, &mut rx);
            let ended = rx.end.is_some();
            drop(rx);
            if ended {
                // The reader may wait on a socket that will never be readable again (the
                // server broke the protocol and went quiet): wake it to end the stream.
                let _ = side.sock.shutdown(std::net::Shutdown::Both);
            } else if resolved {
                self.pump(i);
            }
        }
    }

    /// Receives what stream `i` holds now and resolves every whole response in it; records the
    /// stream's end (for its reader) when it has come. Whether anything was resolved.
    fn drain(&self, i: usize, rx: &mut Rx) -> bool {
        let side = &self.streams[i];
        let mut resolved = false;
        if rx.buf.is_empty() {
            rx.buf = vec![0; RX_BUF];
        }
        while rx.end.is_none() {
            match self.resolve_buffered(i, rx) {
                Ok(n) => resolved |= n,
                Err(()) => {
                    rx.end = Some(None);
                    break;
                }
            }
            // What is left is a part of one answer at most: moved to the front.
            if rx.at > 0 {
                rx.buf.copy_within(rx.at..rx.len, 0);
                rx.len -= rx.at;
                rx.at = 0;
            }
            let at = rx.len;
            match side.recv_now(&mut rx.buf[at..]) {
                Ok(0) => rx.end = Some(None),
                Ok(n) => rx.len += n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => {
                    debug!(peer = %self.peer, error = %e, "same-host stream failed to receive");
                    rx.end = Some(e.raw_os_error());
                }
            }
        }
        resolved
    }

    /// Resolves the whole responses in `rx`'s buffer; `Err` when the server broke the
    /// protocol (the stream must end).
    fn resolve_buffered(&self, i: usize, rx: &mut Rx) -> Result<bool, ()> {
        use ferry_core::op::CHECKSUM_LEN;
        let mut resolved = false;
        let ring = self.streams[i].ring.is_some();
        loop {
            let avail = &rx.buf[rx.at..rx.len];
            if let Some((chunk, need, got)) = rx.pending.take() {
                // As much as came, in place; the chunk resolves with its last byte.
                let n = avail.len().min(need - got);
                let landed = chunk
                    .op()
                    .local
                    .write_at(chunk.local_at() + got as u64, &avail[..n]);
                rx.at += n;
                match landed {
                    Err(_) => chunk.not_posted(FailureKind::Local),
                    Ok(()) if got + n == need => chunk.acked(),
                    Ok(()) => {
                        rx.pending = Some((chunk, need, got + n));
                        return Ok(resolved);
                    }
                }
                resolved = true;
                continue;
            }
            let Some(head) = avail.first_chunk::<DATA_RESPONSE_LEN>() else {
                return Ok(resolved);
            };
            let head = *head;
            rx.at += DATA_RESPONSE_LEN;
            resolved = true;
            let mut proto = lock(&self.streams[i].proto);
            match proto.on_response(&head) {
                Ok(Resolution::Done) => {}
                // An accepted READ's bytes are in place already (or follow, inline on a ring
                // stream); a CHECKSUM's four follow.
                Ok(Resolution::Payload(chunk)) if chunk.op().kind == OpKind::Checksum => {
                    rx.pending = Some((chunk, CHECKSUM_LEN, 0));
                }
                Ok(Resolution::Payload(chunk))
                    if inline(
                        ring,
                        chunk.op().kind,
                        chunk.payload_len(),
                        chunk.op().local.is_host(),
                    ) =>
                {
                    let need = chunk.payload_len() as usize;
                    rx.pending = Some((chunk, need, 0));
                }
                Ok(Resolution::Payload(chunk)) => chunk.acked(),
                Ok(Resolution::Pieces(pieces)) => pieces.into_iter().for_each(Chunk::acked),
                Err(v) => {
                    debug!(peer = %self.peer, violation = %v, "same-host stream broke the protocol");
                    return Err(());
                }
            }
        }
    }

    /// Stream `i` is over: what it had in flight is lost, what was dealt to it goes to the
    /// others (or is never posted when none is left).
    fn stream_ended(&self, i: usize, native: Option<i32>) {
        self.end_stream(i, native, true);
    }

    /// Ends stream `i` for its requests; `hang_up`: shuts its socket both ways too (else the
    /// socket stays open, to see when the server ends its side).
    fn end_stream(&self, i: usize, native: Option<i32>, hang_up: bool) {
        let side = &self.streams[i];
        if !side.alive.swap(false, Ordering::AcqRel) {
            return;
        }
        if hang_up {
            let _ = side.sock.shutdown(std::net::Shutdown::Both);
        }
        side.proto
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .fail_all(native);
        let mut woken = StreamSet::default();
        let orphans = self.lock_dealer().leave(i, &mut woken);
        for job in orphans {
            job.not_posted(FailureKind::PeerLost);
        }
        self.pump_all(woken);
        *self.ended.lock().unwrap_or_else(PoisonError::into_inner) += 1;
        self.ended_cv.notify_all();
    }

    /// Whether every stream ended within `wait`.
    fn all_ended_within(&self, wait: Duration) -> bool {
        let n = self.streams.len();
        let ended = self.ended.lock().unwrap_or_else(PoisonError::into_inner);
        let (ended, _) = self
            .ended_cv
            .wait_timeout_while(ended, wait, |e| *e < n)
            .unwrap_or_else(PoisonError::into_inner);
        *ended >= n
    }

    /// After a close: waits up to [`CLOSE_GRACE`] for every stream to end. A server that has not
    /// ended them by then (stopped, stalled) may still have a copy to make into this process's
    /// memory, after the requests end and their buffers are the caller's again: so copies into
    /// this process are revoked first ([`host::revoke_copies`]), then, once the server ended its
    /// streams or is seen stopped (within [`SETTLE`]), the streams are given up and their chunks
    /// end as lost. The revocation lasts until the server has ended every stream (its side of
    /// each socket closed: it ran again, or it is gone). Where it cannot be made, and on a CUDA
    /// IPC channel (the driver's copies ignore it), the streams are hung up on both ways, which
    /// the server checks before each request.
    fn end_after_grace(&self) {
        if self.all_ended_within(CLOSE_GRACE) {
            return;
        }
        if self.gpu == GpuRoute::CudaIpc {
            // The driver's copies into GPU buffers ignore the revocation: hung up on, the
            // server copies nothing for a request it has not checked yet.
            debug!(peer = %self.peer, "same-host streams not ended after the close's grace; hung up");
            for s in &self.streams {
                let _ = s.sock.shutdown(std::net::Shutdown::Both);
            }
            return;
        }
        let revoked = match host::revoke_copies() {
            Ok(r) => r,
            Err(e) => {
                warn!(peer = %self.peer, error = %e, "cannot revoke copies into this process; \
                    the same-host streams are hung up on (a stopped server may still copy when it \
                    runs again)");
                for s in &self.streams {
                    let _ = s.sock.shutdown(std::net::Shutdown::Both);
                }
                return;
            }
        };
        let until = std::time::Instant::now() + SETTLE;
        let settled = loop {
            if self.all_ended_within(Duration::from_millis(5)) {
                break true;
            }
            if host::process_stopped(self.server_pid) {
                break true;
            }
            if std::time::Instant::now() >= until {
                break false;
            }
        };
        if !settled {
            warn!(peer = %self.peer, pid = self.server_pid, "a same-host server neither ended its \
                streams nor stopped after copies were revoked; a copy it began before may still \
                be finishing");
        }
        warn!(peer = %self.peer, pid = self.server_pid, "a same-host server held its streams past \
            the close's grace: copies into this process are revoked (it is not dumpable) until \
            the server ends them");
        for i in 0..self.streams.len() {
            self.end_stream(i, None, false);
        }
        let socks: Vec<&UnixStream> = self.streams.iter().map(|s| &s.sock).collect();
        host::wait_all_hung_up(&socks);
        drop(revoked);
        debug!(peer = %self.peer, "the same-host server ended its streams; the revocation ended");
    }
}

/// Writes a posted request: its header, a vectored request's piece table, and the address
/// block (a GPU buffer's entry is a marked address and its CUDA IPC grant). Never waits: what
/// the socket does not take now goes to the stream's outbox, after whatever is there.
fn send(side: &Side, out: &Outgoing<Req>) -> io::Result<()> {
    let mut outbox = lock(&side.outbox);
    if out.scatter.is_empty() {
        let len = out.len as u64;
        if inline(side.ring.is_some(), out.kind, len, out.region.is_host()) {
            return send_inline(side, &mut outbox, out);
        }
        if let Some(grant) = crate::gpu::grant_of(&out.region, out.local_at, len) {
            let mut one = [0u8; DATA_REQUEST_LEN + ADDR_LEN + IPC_REF_LEN];
            one[..DATA_REQUEST_LEN].copy_from_slice(&out.head);
            one[DATA_REQUEST_LEN..DATA_REQUEST_LEN + ADDR_LEN]
                .copy_from_slice(&IPC_MARK.to_le_bytes());
            one[DATA_REQUEST_LEN + ADDR_LEN..].copy_from_slice(&grant);
            return send_or_keep(side, &mut outbox, &one);
        }
        // One chunk: the header and its address from the stack, one write.
        let mut one = [0u8; DATA_REQUEST_LEN + ADDR_LEN];
        one[..DATA_REQUEST_LEN].copy_from_slice(&out.head);
        let at = out.region.as_ptr() as u64 + out.local_at;
        one[DATA_REQUEST_LEN..].copy_from_slice(&at.to_le_bytes());
        return send_or_keep(side, &mut outbox, &one);
    }
    let mut buf =
        Vec::with_capacity(out.head.len() + out.table.len() + ADDR_LEN * out.scatter.len());
    buf.extend_from_slice(&out.head);
    buf.extend_from_slice(&out.table);
    for range in &out.scatter {
        if let Some(grant) = crate::gpu::grant_of(&range.region, range.at, range.len as u64) {
            buf.extend_from_slice(&IPC_MARK.to_le_bytes());
            buf.extend_from_slice(&grant);
            continue;
        }
        let at = range.region.as_ptr() as u64 + range.at;
        buf.extend_from_slice(&at.to_le_bytes());
    }
    send_or_keep(side, &mut outbox, &buf)
}

/// Sends `bytes` now as far as the socket takes them (all of them after the `outbox`, if it
/// holds any), keeping the rest in the outbox.
fn send_or_keep(side: &Side, outbox: &mut Vec<u8>, bytes: &[u8]) -> io::Result<()> {
    if !outbox.is_empty() {
        outbox.extend_from_slice(bytes);
        return send_kept(side, outbox);
    }
    let n = side.send_now(bytes)?;
    outbox.extend_from_slice(&bytes[n..]);
    Ok(())
}

/// Sends what the outbox holds, as far as the socket takes it now.
fn send_kept(side: &Side, outbox: &mut Vec<u8>) -> io::Result<()> {
    let n = side.send_now(outbox)?;
    outbox.drain(..n);
    Ok(())
}

/// Sends the stream's outbox as far as the socket takes it now (the caller holds its `proto`).
fn flush(side: &Side) -> io::Result<()> {
    let mut outbox = lock(&side.outbox);
    if outbox.is_empty() {
        return Ok(());
    }
    send_kept(side, &mut outbox)
}

/// Writes a chunk whose bytes go inline through the ring: its header, the marked entry, and a
/// WRITE's payload, copied out of the caller's buffer now (one write into the ring; what does
/// not fit waits in the outbox).
fn send_inline(side: &Side, outbox: &mut Vec<u8>, out: &Outgoing<Req>) -> io::Result<()> {
    let follows = if out.kind == OpKind::Write {
        out.len
    } else {
        0
    };
    let mut head = [0u8; DATA_REQUEST_LEN + ADDR_LEN];
    head[..DATA_REQUEST_LEN].copy_from_slice(&out.head);
    head[DATA_REQUEST_LEN..].copy_from_slice(&(INLINE_MARK | follows as u64).to_le_bytes());
    if follows == 0 {
        // A READ: nothing follows its entry, so no payload buffer to zero per op.
        return send_or_keep(side, outbox, &head);
    }
    let mut one = lock(&side.scratch);
    // Zeroed only past its last length (not at all for ops of one size); every byte sent is
    // written over first.
    one.resize(head.len() + follows, 0);
    one[..head.len()].copy_from_slice(&head);
    out.region
        .read_at(out.local_at, &mut one[head.len()..])
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "a chunk outside its region"))?;
    send_or_keep(side, outbox, &one)
}

/// Sends as much of `bytes` as the socket takes without waiting: how much.
fn send_all_now(sock: &UnixStream, bytes: &[u8]) -> io::Result<usize> {
    let mut done = 0;
    while done < bytes.len() {
        match host::send_now(sock, &bytes[done..]) {
            Ok(n) => done += n,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(done)
}

/// The future of a request: ready once every chunk resolved. Each poll first resolves the
/// responses the channel's streams hold (`progress`), so a task that polls sees its request
/// end without waiting for a reader thread to be scheduled.
///
/// A small request (`spin`: every op inline-sized, a few of them) on a channel with ring
/// streams is spun for first, for as long as the channel's adaptive [`Spin`] says, resolving
/// answers as they come: a busy server answers within it, and the task then sees its request
/// end with no thread woken and no system call. Past the spin, it waits for the reader.
fn finish(shared: Option<Arc<Shared>>, req: Arc<Req>, spin: bool) -> BoxFuture<'static, Outcome> {
    let mut first = spin;
    // When the spin ran out: when it began, until the request resolves.
    let mut missed: Option<Instant> = None;
    Box::pin(std::future::poll_fn(move |cx| {
        if !req.parts.is_done()
            && let Some(shared) = &shared
        {
            shared.progress();
            if std::mem::take(&mut first) {
                missed = shared.spin_for(&req);
            }
        }
        let done = req.parts.poll_done(cx);
        if done.is_ready()
            && let (Some(start), Some(shared)) = (missed.take(), &shared)
        {
            shared.spin_missed(start.elapsed());
        }
        done.map(|()| req.control.outcome(true))
    }))
}

impl Channel for LocalChannel {
    fn kind(&self) -> TransportKind {
        TransportKind::Local
    }

    fn execute(&self, ops: Arc<[Op]>, control: Arc<RequestControl>) -> BoxFuture<'static, Outcome> {
        let shared = &self.shared;
        // One-sided where every op can be (mapped shared registrations): no stream is used.
        if let Some(done) = self
            .shares
            .as_ref()
            .filter(|_| !shared.closed.load(Ordering::Acquire))
            .and_then(|s| s.execute(&ops, &control, shared.chunk))
        {
            return done;
        }
        let req = Arc::new(Req {
            ops: ops.clone(),
            control: control.clone(),
            // The poster's own part, resolved once everything is dealt.
            parts: Countdown::new(1),
            watched: AtomicBool::new(false),
            watching: shared.watching.clone(),
        });
        let closed = shared.closed.load(Ordering::Acquire)
            || !shared
                .streams
                .iter()
                .any(|s| s.alive.load(Ordering::Acquire));
        // Device memory reaches this plane only as a CUDA IPC grant, on a channel that has
        // CUDA IPC; any other is this side's mistake, failed before anything is posted.
        let ipc = shared.gpu == GpuRoute::CudaIpc;
        if let Some(bad) = ops.iter().position(|op| {
            let granted = ipc && crate::gpu::grant_of(&op.local, op.local_offset, op.len).is_some();
            !op.local.is_host() && !granted
        }) {
            debug!(peer = %shared.peer, op = bad, gpu = %shared.gpu,
                "device memory this channel cannot grant; the request fails");
            for (op, o) in ops.iter().enumerate() {
                req.parts.add(1);
                Chunk {
                    req: req.clone(),
                    op,
                    at: 0,
                    len: o.len,
                }
                .not_posted(FailureKind::Local);
            }
            // The poster's count.
            req.chunk_done();
            return finish(None, req, false);
        }
        let spin = shared.spins
            && ops.len() <= SPIN_OPS
            && ops
                .iter()
                .all(|op| op.len <= crate::wire::INLINE_MAX as u64);
        if !spin {
            // Its answers are the readers' from the start (armed before anything is posted).
            shared.watch(&req);
        }
        deal_request(
            &shared.dealer,
            &req,
            shared.chunk,
            shared.vectored.then_some(shared.chunk),
            closed,
            |n| req.parts.add(n),
            |set| {
                if spin {
                    shared.pump_small_first();
                }
                shared.pump_all(set)
            },
        );
        // The poster's count (and the request unwatched if everything resolved meanwhile).
        req.chunk_done();
        finish(Some(shared.clone()), req, spin)
    }

    fn takes_cuda_ipc(&self) -> bool {
        self.shared.gpu == GpuRoute::CudaIpc
    }

    fn gpu_route(&self) -> Option<String> {
        Some(self.shared.gpu.to_string())
    }

    fn one_sided(&self) -> Option<String> {
        self.shared_use().map(|(mapped, ops)| {
            format!("{mapped} shared registration(s) mapped, {ops} ops moved one-sidedly")
        })
    }

    fn is_alive(&self) -> bool {
        !self.shared.closed.load(Ordering::Acquire)
            && self
                .shared
                .streams
                .iter()
                .any(|s| s.alive.load(Ordering::Acquire))
    }

    fn close(&self) {
        if self.shared.closed.swap(true, Ordering::AcqRel) {
            return;
        }
        self.shared.lock_dealer().close();
        // Only our sending half: the server answers what it has, then ends the stream, and the
        // readers resolve everything in flight before they go (a copy into our memory may still
        // run until then, so `drained` waits for it). A server that does not within the grace
        // is hung up on.
        for s in &self.shared.streams {
            let _ = s.sock.shutdown(std::net::Shutdown::Write);
        }
        if let Some(s) = &self.shares {
            s.close();
        }
        let shared = self.shared.clone();
        let watch = std::thread::Builder::new()
            .name("ferry-local-close".into())
            .spawn(move || shared.end_after_grace());
        if watch.is_err() {
            for s in &self.shared.streams {
                let _ = s.sock.shutdown(std::net::Shutdown::Both);
            }
        }
    }
}

impl Drop for LocalChannel {
    fn drop(&mut self) {
        self.close();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferry_core::{Epoch, MemoryRegion, PeerId, SegmentToken};
    use std::os::unix::net::UnixListener;

    /// A listener on a fresh abstract name, and a peer whose handshake named `pid` and it.
    fn fake_server(pid: u32) -> (UnixListener, PeerInfo) {
        let name = format!("ferry-local-test-{:016x}", rand::random::<u64>());
        let addr = UnixAddr::from_abstract_name(name.as_bytes()).unwrap();
        let listener = UnixListener::bind_addr(&addr).unwrap();
        let peer = PeerInfo {
            addr: "127.0.0.1:1".parse().unwrap(),
            local_id: PeerId(1),
            local_epoch: Epoch::fresh(),
            remote_id: PeerId(2),
            remote_epoch: Epoch::fresh(),
            offer: TransportOffer::Local {
                boot_id: [0; 16],
                pid,
                streams: 1,
                socket: name,
            },
            segments: Vec::new(),
            session: None,
            key_name: None,
            version: VECTORED_VERSION,
        };
        (listener, peer)
    }

    fn refusal(r: Result<LocalChannel, Error>) -> String {
        match r {
            Err(Error::Unavailable { reason, .. }) => reason,
            Err(other) => panic!("not refused as unavailable: {other}"),
            Ok(_) => panic!("the channel was opened"),
        }
    }

    /// A server that reads nothing (stopped, say) while the requests outgrow the socket's
    /// buffer: the submitting thread is never held (the rest waits in the stream's outbox),
    /// and the request ends once the stream does.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_server_that_reads_nothing_never_holds_the_submitter() {
        let (ours, theirs) = UnixStream::pair().unwrap();
        let small: libc::c_int = 4096;
        // SAFETY: a valid socket and an int option of its size.
        let rc = unsafe {
            libc::setsockopt(
                std::os::fd::AsRawFd::as_raw_fd(&ours),
                libc::SOL_SOCKET,
                libc::SO_SNDBUF,
                (&raw const small).cast(),
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            )
        };
        assert_eq!(rc, 0);
        let ch = LocalChannel::new(
            "127.0.0.1:1".parse().unwrap(),
            vec![(ours, None)],
            16,
            1 << 20,
            true,
            GpuRoute::HostStage("test".into()),
            (std::process::id(), host::TracerGrant::none()),
        );
        let local = Arc::new(MemoryRegion::alloc_zeroed(1 << 20, 4096).unwrap());
        // 8,192 ops of 64 bytes: piece tables of about 300 KiB in all.
        let ops: Arc<[Op]> = (0..8192u64)
            .map(|i| Op {
                kind: OpKind::Read,
                local: local.clone(),
                local_offset: i * 64,
                token: SegmentToken(1),
                remote_offset: i * 64,
                len: 64,
            })
            .collect::<Vec<_>>()
            .into();
        let control = Arc::new(RequestControl::new(&ops));
        let (tx, rx) = std::sync::mpsc::channel();
        let submitter = std::thread::spawn(move || {
            let fut = ch.execute(ops, control);
            tx.send(()).unwrap();
            (ch, fut)
        });
        rx.recv_timeout(Duration::from_secs(30))
            .expect("the submitter waited on a server that reads nothing");
        let (ch, fut) = submitter.join().unwrap();
        assert!(
            !lock(&ch.shared.streams[0].outbox).is_empty(),
            "the socket took it all: the test sent too little"
        );
        drop(theirs);
        let o = tokio::time::timeout(Duration::from_secs(30), fut)
            .await
            .expect("the request outlived its stream");
        assert_eq!(o.failure.map(|f| f.kind), Some(FailureKind::PeerLost));
    }

    #[test]
    fn a_socket_owned_by_another_pid_than_the_handshake_named_is_refused() {
        // The handshake named pid 1; the socket is this process's.
        let (_listener, peer) = fake_server(1);
        let why = refusal(connect(
            &peer,
            1,
            1,
            1 << 20,
            Duration::from_secs(5),
            Err("no".into()),
            (true, false),
        ));
        assert!(why.contains("belongs to pid"), "{why}");
    }

    #[test]
    fn a_probe_echoed_with_other_bytes_than_ours_is_refused() {
        let (listener, peer) = fake_server(std::process::id());
        let server = std::thread::spawn(move || {
            let (mut s, _) = listener.accept().unwrap();
            let _attach = ferry_net::read_frame(&mut s, "127.0.0.1:1".parse().unwrap()).unwrap();
            ferry_net::write_frame(
                &mut s,
                "127.0.0.1:1".parse().unwrap(),
                &ControlFrame::StreamAccept,
            )
            .unwrap();
            let mut at = [0u8; ADDR_LEN];
            s.read_exact(&mut at).unwrap();
            // "Read" fine, but the bytes are not the client's canary.
            let mut answer = [0u8; 9];
            answer[0] = PROBE_OK;
            s.write_all(&answer).unwrap();
            s
        });
        let why = refusal(connect(
            &peer,
            1,
            1,
            1 << 20,
            Duration::from_secs(5),
            Err("no".into()),
            (true, false),
        ));
        assert!(why.contains("other than ours"), "{why}");
        drop(server.join().unwrap());
    }

    /// A channel of one socket stream whose server end the test plays (`theirs`), and a 4 KiB
    /// READ executed on it (not yet answered).
    fn one_read_on_a_socket() -> (LocalChannel, UnixStream, BoxFuture<'static, Outcome>) {
        let (ours, theirs) = UnixStream::pair().unwrap();
        let ch = LocalChannel::new(
            "127.0.0.1:1".parse().unwrap(),
            vec![(ours, None)],
            4,
            1 << 20,
            true,
            GpuRoute::HostStage("test".into()),
            (std::process::id(), host::TracerGrant::none()),
        );
        let local = Arc::new(MemoryRegion::alloc_zeroed(4096, 4096).unwrap());
        let ops: Arc<[Op]> = vec![Op {
            kind: OpKind::Read,
            local,
            local_offset: 0,
            token: SegmentToken(1),
            remote_offset: 0,
            len: 4096,
        }]
        .into();
        let control = Arc::new(RequestControl::new(&ops));
        let fut = ch.execute(ops, control);
        (ch, theirs, fut)
    }

    /// A server that answers with bytes the protocol has no meaning for, then goes quiet with
    /// the socket open: the request ends (lost, its stream given up) instead of waiting for an
    /// answer that never comes, whichever of the reader thread or the polling task read the
    /// bad answer.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_server_answering_nonsense_ends_the_request() {
        for _ in 0..20 {
            let (ch, mut theirs, fut) = one_read_on_a_socket();
            let mut req = [0u8; DATA_REQUEST_LEN + ADDR_LEN];
            theirs.read_exact(&mut req).unwrap();
            theirs.write_all(&[0xff; DATA_RESPONSE_LEN]).unwrap();
            let o = tokio::time::timeout(Duration::from_secs(30), fut)
                .await
                .expect("the request waited on a server that broke the protocol");
            let f = o.failure.expect("a nonsense answer is no success");
            assert_eq!(f.kind, FailureKind::PeerLost, "{o:?}");
            assert!(!ch.is_alive());
            drop(theirs);
        }
    }

    /// A request no task spins for is counted in the channel's `watching` (what keeps the
    /// readers awake) from its execute until its last chunk resolves, then uncounted.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_watched_request_is_uncounted_when_its_last_chunk_resolves() {
        // A failure past this, never a pace.
        const PATIENCE: Duration = Duration::from_secs(20);
        let (ch, mut theirs, fut) = one_read_on_a_socket();
        let watching = ch.shared.watching.clone();
        assert_eq!(watching.load(Ordering::SeqCst), 1, "no task spins for it");
        let mut req = [0u8; DATA_REQUEST_LEN + ADDR_LEN];
        theirs.read_exact(&mut req).unwrap();
        // An answer the protocol has no meaning for: the stream is given up, its chunk failed.
        theirs.write_all(&[0xff; DATA_RESPONSE_LEN]).unwrap();
        let o = tokio::time::timeout(PATIENCE, fut)
            .await
            .expect("the request ends with its stream");
        assert!(o.failure.is_some(), "{o:?}");
        // The last chunk's thread uncounts it just after waking the request's task.
        let until = std::time::Instant::now() + PATIENCE;
        while watching.load(Ordering::SeqCst) != 0 {
            assert!(
                std::time::Instant::now() < until,
                "the ended request is still counted as watched"
            );
            tokio::task::yield_now().await;
        }
    }
}
