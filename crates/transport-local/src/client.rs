//! The client side: a channel of a few streams over the server's abstract Unix socket, each
//! driven by the core stream protocol ([`ClientStream`]). Chunks are posted by whichever thread
//! has them (the submitter, or the stream's reader after a response made room); each stream's
//! reader thread resolves responses.

use std::io::{self, Read, Write};
use std::net::SocketAddr;
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr as UnixAddr, UnixStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::time::Duration;

/// How long a closed channel waits for the server to answer what it holds and end its streams
/// before it hangs up on both directions: a server that is stopped (or stalled) does not hold
/// the channel's requests past it.
const CLOSE_GRACE: Duration = Duration::from_secs(2);

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
use tokio::sync::Notify;
use tracing::debug;

use crate::host;
use crate::wire::{ADDR_LEN, CUDA_IPC_CODE, IPC_MARK, IPC_REF_LEN, PROBE_OK, local_code};

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

/// One stream's attach: ready, or a CUDA IPC attach the server refused (its message).
enum Attached {
    Ready(UnixStream),
    IpcRefused(String),
}

/// One request as the streams see it.
struct Req {
    ops: Arc<[Op]>,
    control: Arc<RequestControl>,
    outstanding: AtomicUsize,
    done: Notify,
}

impl ChunkOwner for Req {
    fn ops(&self) -> &[Op] {
        &self.ops
    }

    fn control(&self) -> &RequestControl {
        &self.control
    }

    fn chunk_done(&self) {
        if self.outstanding.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.done.notify_one();
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
    let mut gpu = match ipc {
        // The driver refuses a process's own IPC handles.
        Ok(()) if *pid == std::process::id() => {
            GpuRoute::HostStage("the peer is this process (CUDA IPC is between processes)".into())
        }
        Ok(()) => GpuRoute::CudaIpc,
        Err(why) => GpuRoute::HostStage(why),
    };
    for i in 0..n {
        let code = if gpu == GpuRoute::CudaIpc {
            CUDA_IPC_CODE
        } else {
            local_code()
        };
        let sock = match attach(peer, *pid, socket, i as u16, timeout, code)? {
            Attached::Ready(s) => s,
            Attached::IpcRefused(why) => {
                debug!(peer = %peer.addr, why, "the peer takes no CUDA IPC; GPU buffers are staged");
                gpu = GpuRoute::HostStage(format!("the peer refused CUDA IPC: {why}"));
                match attach(peer, *pid, socket, i as u16, timeout, local_code())? {
                    Attached::Ready(s) => s,
                    Attached::IpcRefused(why) => return Err(unavailable(why)),
                }
            }
        };
        socks.push(sock);
    }
    Ok(LocalChannel::new(
        peer.addr,
        socks,
        depth,
        chunk,
        peer.version >= VECTORED_VERSION,
        gpu,
    ))
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
    host::allow_tracer(pid).map_err(unavailable)?;
    let attach = stream_attach(peer, index, code);
    let mut w = &sock;
    ferry_net::write_frame(&mut w, peer.addr, &attach_frame(peer, attach))?;
    let mut r = &sock;
    let reply = ferry_net::read_frame(&mut r, peer.addr)?;
    if code == CUDA_IPC_CODE
        && let ControlFrame::Reject(refused) = &reply
        && refused.reason == RejectReason::Refused
    {
        return Ok(Attached::IpcRefused(refused.message.clone()));
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
    sock.set_read_timeout(None).map_err(io)?;
    sock.set_write_timeout(None).map_err(io)?;
    Ok(Attached::Ready(sock))
}

/// A channel of the same-host plane to one peer incarnation.
#[derive(Debug)]
pub struct LocalChannel {
    shared: Arc<Shared>,
}

struct Shared {
    peer: SocketAddr,
    dealer: Mutex<Dealer<Job>>,
    streams: Vec<Side>,
    chunk: u64,
    vectored: bool,
    gpu: GpuRoute,
    closed: AtomicBool,
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
    proto: Mutex<ClientStream<Req>>,
    alive: AtomicBool,
}

impl LocalChannel {
    fn new(
        peer: SocketAddr,
        socks: Vec<UnixStream>,
        depth: usize,
        chunk: u64,
        vectored: bool,
        gpu: GpuRoute,
    ) -> Self {
        let n = socks.len();
        let shared = Arc::new(Shared {
            peer,
            dealer: Mutex::new(Dealer::new(n)),
            streams: socks
                .into_iter()
                .map(|sock| Side {
                    sock,
                    proto: Mutex::new(ClientStream::new(depth, AckPolicy::Immediate)),
                    alive: AtomicBool::new(true),
                })
                .collect(),
            chunk,
            vectored,
            gpu,
            closed: AtomicBool::new(false),
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
        Self { shared }
    }

    /// Streams of the channel.
    pub fn streams(&self) -> usize {
        self.shared.streams.len()
    }

    /// How the channel moves GPU buffers: by CUDA IPC (a region made by
    /// `DeviceMemory::ipc_region` may be an op's local region), or not (the host stage, why).
    pub fn gpu_route(&self) -> &GpuRoute {
        &self.shared.gpu
    }
}

impl Shared {
    fn lock_dealer(&self) -> std::sync::MutexGuard<'_, Dealer<Job>> {
        self.dealer.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Posts what stream `i` may take while it has room.
    fn pump(&self, i: usize) {
        let side = &self.streams[i];
        let mut proto = side.proto.lock().unwrap_or_else(PoisonError::into_inner);
        while proto.has_room() {
            let idle = proto.in_flight() == 0;
            let Some(job) = self.lock_dealer().take(i, idle) else {
                return;
            };
            match proto.post(job) {
                Post::Send(out) => {
                    if let Err(e) = send(&side.sock, &out) {
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

    fn pump_all(&self, set: StreamSet) {
        for i in 0..self.streams.len() {
            if set.contains(i) {
                self.pump(i);
            }
        }
    }

    /// The reader of stream `i`: resolves each response, then posts what it made room for.
    fn read_responses(self: Arc<Self>, i: usize) {
        let side = &self.streams[i];
        let mut head = [0u8; DATA_RESPONSE_LEN];
        let mut r = &side.sock;
        let native = loop {
            if let Err(e) = r.read_exact(&mut head) {
                break (e.kind() != io::ErrorKind::UnexpectedEof)
                    .then(|| e.raw_os_error())
                    .flatten();
            }
            let mut proto = side.proto.lock().unwrap_or_else(PoisonError::into_inner);
            match proto.on_response(&head) {
                Ok(Resolution::Done) => {}
                Ok(Resolution::Payload(chunk)) => {
                    if let Err(e) = land(&mut r, chunk) {
                        break e.raw_os_error();
                    }
                }
                Ok(Resolution::Pieces(pieces)) => pieces.into_iter().for_each(Chunk::acked),
                Err(v) => {
                    debug!(peer = %self.peer, violation = %v, "same-host stream broke the protocol");
                    break None;
                }
            }
            drop(proto);
            self.pump(i);
        };
        self.stream_ended(i, native);
    }

    /// Stream `i` is over: what it had in flight is lost, what was dealt to it goes to the
    /// others (or is never posted when none is left).
    fn stream_ended(&self, i: usize, native: Option<i32>) {
        let side = &self.streams[i];
        if !side.alive.swap(false, Ordering::AcqRel) {
            return;
        }
        let _ = side.sock.shutdown(std::net::Shutdown::Both);
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

    /// After a close: waits up to [`CLOSE_GRACE`] for every stream to end, then hangs up on
    /// those left, whose chunks in flight then end as lost. The server checks for the hang-up
    /// before each copy, so it copies nothing more for them.
    fn hang_up_after_grace(&self) {
        let n = self.streams.len();
        let ended = self.ended.lock().unwrap_or_else(PoisonError::into_inner);
        let (ended, _) = self
            .ended_cv
            .wait_timeout_while(ended, CLOSE_GRACE, |e| *e < n)
            .unwrap_or_else(PoisonError::into_inner);
        if *ended < n {
            debug!(peer = %self.peer, "same-host streams not ended after the close's grace; hung up");
            for s in &self.streams {
                let _ = s.sock.shutdown(std::net::Shutdown::Both);
            }
        }
    }
}

/// Resolves an accepted READ (its bytes are in place already) or CHECKSUM (its four bytes
/// follow the header; they land in local memory).
fn land(r: &mut impl Read, chunk: Chunk<Req>) -> io::Result<()> {
    if chunk.op().kind != OpKind::Checksum {
        chunk.acked();
        return Ok(());
    }
    let mut crc = [0u8; ferry_core::op::CHECKSUM_LEN];
    if let Err(e) = r.read_exact(&mut crc) {
        chunk.lost(e.raw_os_error());
        return Err(e);
    }
    match chunk.op().local.write_at(chunk.local_at(), &crc) {
        Ok(()) => chunk.acked(),
        Err(_) => chunk.not_posted(FailureKind::Local),
    }
    Ok(())
}

/// Writes a posted request: its header, a vectored request's piece table, and the address
/// block (a GPU buffer's entry is a marked address and its CUDA IPC grant).
fn send(sock: &UnixStream, out: &Outgoing<Req>) -> io::Result<()> {
    let mut w = sock;
    if out.scatter.is_empty() {
        let len = out.len as u64;
        if let Some(grant) = crate::gpu::grant_of(&out.region, out.local_at, len) {
            let mut one = [0u8; DATA_REQUEST_LEN + ADDR_LEN + IPC_REF_LEN];
            one[..DATA_REQUEST_LEN].copy_from_slice(&out.head);
            one[DATA_REQUEST_LEN..DATA_REQUEST_LEN + ADDR_LEN]
                .copy_from_slice(&IPC_MARK.to_le_bytes());
            one[DATA_REQUEST_LEN + ADDR_LEN..].copy_from_slice(&grant);
            return w.write_all(&one);
        }
        // One chunk: the header and its address from the stack, one write.
        let mut one = [0u8; DATA_REQUEST_LEN + ADDR_LEN];
        one[..DATA_REQUEST_LEN].copy_from_slice(&out.head);
        let at = out.region.as_ptr() as u64 + out.local_at;
        one[DATA_REQUEST_LEN..].copy_from_slice(&at.to_le_bytes());
        return w.write_all(&one);
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
    w.write_all(&buf)
}

impl Channel for LocalChannel {
    fn kind(&self) -> TransportKind {
        TransportKind::Local
    }

    fn execute(&self, ops: Arc<[Op]>, control: Arc<RequestControl>) -> BoxFuture<'static, Outcome> {
        let shared = &self.shared;
        let req = Arc::new(Req {
            ops: ops.clone(),
            control: control.clone(),
            // The poster's own count, released once everything is dealt.
            outstanding: AtomicUsize::new(1),
            done: Notify::new(),
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
                req.outstanding.fetch_add(1, Ordering::AcqRel);
                Chunk {
                    req: req.clone(),
                    op,
                    at: 0,
                    len: o.len,
                }
                .not_posted(FailureKind::Local);
            }
            let last = req.outstanding.fetch_sub(1, Ordering::AcqRel) == 1;
            return Box::pin(async move {
                if !last {
                    req.done.notified().await;
                }
                control.outcome(true)
            });
        }
        deal_request(
            &shared.dealer,
            &req,
            shared.chunk,
            shared.vectored.then_some(shared.chunk),
            closed,
            |n| {
                req.outstanding.fetch_add(n, Ordering::AcqRel);
            },
            |set| shared.pump_all(set),
        );
        let last = req.outstanding.fetch_sub(1, Ordering::AcqRel) == 1;
        Box::pin(async move {
            if !last {
                req.done.notified().await;
            }
            control.outcome(true)
        })
    }

    fn takes_cuda_ipc(&self) -> bool {
        self.shared.gpu == GpuRoute::CudaIpc
    }

    fn gpu_route(&self) -> Option<String> {
        Some(self.shared.gpu.to_string())
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
        let shared = self.shared.clone();
        let watch = std::thread::Builder::new()
            .name("ferry-local-close".into())
            .spawn(move || shared.hang_up_after_grace());
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
