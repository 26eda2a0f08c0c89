//! The serving side: one listener thread for control connections (handshake) and data streams;
//! each data stream is served by its own thread with its own ring, or, with
//! [`UringConfig::event_loop`], by one of a fixed set of rings (`rings.rs`). Every request is checked for
//! token, access and bounds before any byte of a segment (memory or file) is touched.

use std::collections::HashMap;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ferry_core::stream::{Action, ServerStream, Target, checksum_response};
use ferry_core::wire::{ControlFrame, DATA_REQUEST_LEN, DATA_RESPONSE_LEN, StreamAttach};
use ferry_core::{
    Epoch, Error, FileSource, HandshakeResponder, MemoryRegion, OpKind, PeerId, SegmentLease,
    SegmentTable,
};
use ferry_file::{DIRECT_ALIGN, FileSegment};
use ferry_net::{HandshakeGate, HandshakeStats};
use io_uring::IoUring;
use tracing::{debug, warn};

use crate::control::write_frame;
use crate::file_ring::file_io;
use crate::ring::{Body, IoStats, SockIo, ThreadCount};
use crate::{StreamOverflow, UringConfig};

/// A bound listener, not serving yet.
#[derive(Debug)]
pub struct UringServer {
    listener: TcpListener,
    addr: SocketAddr,
    overflow: Option<Arc<dyn StreamOverflow>>,
}

#[derive(Debug, Default)]
pub(crate) struct Live {
    pub(crate) stopped: AtomicBool,
    pub(crate) conns: Mutex<HashMap<u64, Arc<TcpStream>>>,
    pub(crate) next: AtomicU64,
    /// The eventfds that wake the server's rings ([`UringConfig::event_loop`]), so that they
    /// see `stopped`.
    pub(crate) ring_wakes: Mutex<Vec<Arc<std::os::fd::OwnedFd>>>,
    /// Loopback clients' first streams, by client incarnation, while they are served: set once
    /// a second stream of the same client attaches, which tells stream 0's thread to pin itself.
    first_streams: Mutex<HashMap<(PeerId, Epoch), Arc<AtomicBool>>>,
}

pub(crate) fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    match m.lock() {
        Ok(g) => g,
        Err(p) => p.into_inner(),
    }
}

/// Keeps a first stream in [`Live::first_streams`] while it is served.
struct FirstStream<'a> {
    live: &'a Live,
    key: (PeerId, Epoch),
    flag: Arc<AtomicBool>,
}

impl Drop for FirstStream<'_> {
    fn drop(&mut self) {
        let mut g = lock(&self.live.first_streams);
        if g.get(&self.key).is_some_and(|f| Arc::ptr_eq(f, &self.flag)) {
            g.remove(&self.key);
        }
    }
}

impl Live {
    fn shutdown_all(&self) {
        let conns = lock(&self.conns);
        for c in conns.values() {
            let _ = c.shutdown(std::net::Shutdown::Both);
        }
        drop(conns);
        for w in lock(&self.ring_wakes).iter() {
            let one: u64 = 1;
            // SAFETY: writes 8 bytes from a local to an eventfd the ring set keeps open.
            unsafe { libc::write(w.as_raw_fd(), (&one as *const u64).cast(), 8) };
        }
    }
}

/// A running server; dropping it (or [`UringServerHandle::shutdown`]) stops the listener and
/// every connection it accepted.
#[derive(Debug)]
pub struct UringServerHandle {
    addr: SocketAddr,
    live: Arc<Live>,
    listener_fd: i32,
    stats: Arc<IoStats>,
    gate: Arc<HandshakeGate>,
    rings: usize,
}

impl UringServerHandle {
    /// How many rings serve its data streams ([`UringConfig::event_loop`]); 0: a thread and a
    /// ring per served data stream.
    pub fn rings(&self) -> usize {
        self.rings
    }

    /// The address it listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// The I/O counters of the server's rings.
    pub fn stats(&self) -> &IoStats {
        &self.stats
    }

    /// Connections in their handshake now, and those closed past the cap or the deadline.
    pub fn handshakes(&self) -> HandshakeStats {
        self.gate.stats()
    }

    /// The limits those are counted against.
    pub fn handshake_limits(&self) -> ferry_net::HandshakeLimits {
        self.gate.limits()
    }

    /// Stops serving: the listener closes and every accepted connection is shut down.
    pub fn shutdown(&self) {
        if !self.live.stopped.swap(true, Ordering::AcqRel) {
            // SAFETY: shutting down a socket we own (the listener thread keeps it open until it
            // sees `stopped`); this only wakes the blocked accept().
            unsafe { libc::shutdown(self.listener_fd, libc::SHUT_RDWR) };
            self.live.shutdown_all();
        }
    }
}

impl Drop for UringServerHandle {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// What the server's threads share.
pub(crate) struct Ctx {
    pub(crate) table: Arc<dyn SegmentTable>,
    pub(crate) responder: Arc<dyn HandshakeResponder>,
    pub(crate) config: UringConfig,
    pub(crate) stats: Arc<IoStats>,
    pub(crate) live: Arc<Live>,
    overflow: Option<Arc<dyn StreamOverflow>>,
    /// The fixed set of rings that serves every data stream ([`UringConfig::event_loop`]).
    rings: std::sync::OnceLock<crate::rings::RingSet>,
}

impl UringServer {
    /// Binds `addr` (port 0: any; `SO_REUSEADDR` as std sets it).
    pub fn bind(addr: SocketAddr) -> Result<Self, Error> {
        let listener =
            TcpListener::bind(addr).map_err(|e| Error::io("bind", addr.to_string(), e))?;
        let addr = listener
            .local_addr()
            .map_err(|e| Error::io("local address of", addr.to_string(), e))?;
        Ok(Self {
            listener,
            addr,
            overflow: None,
        })
    }

    /// Hands the data streams accepted past [`UringConfig::max_threads`] to `overflow` instead
    /// of starting a thread for each (without one, the server keeps starting threads).
    pub fn with_overflow(mut self, overflow: Arc<dyn StreamOverflow>) -> Self {
        self.overflow = Some(overflow);
        self
    }

    /// The bound address.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Starts serving `table` with the identity and policy of `responder` (same shape as the TCP
    /// transport's `TcpServer::serve`): its memory segments, and its file segments
    /// ([`SegmentTable::file`]; a [`FileSegment`] with io_uring reads and writes, O_DIRECT where a
    /// request's alignment allows, any other source with its positioned reads and writes).
    /// Needs no async runtime. One thread accepts connections and runs their handshakes
    /// (within `config.handshake`: a deadline on each, a cap on how many at once; counted in
    /// [`UringServerHandle::handshakes`]); each attached data stream gets a thread of its own
    /// (or the overflow's, past [`UringConfig::max_threads`]), or, with
    /// [`UringConfig::event_loop`], a place on one of the server's fixed set of rings (started
    /// here: an error if a ring cannot be made).
    pub fn serve(
        self,
        table: Arc<dyn SegmentTable>,
        responder: Arc<dyn HandshakeResponder>,
        config: UringConfig,
    ) -> Result<UringServerHandle, Error> {
        let addr = self.addr;
        let live = Arc::new(Live::default());
        let stats = Arc::new(IoStats::default());
        let listener_fd = self.listener.as_raw_fd();
        let ctx = Arc::new(Ctx {
            table,
            responder,
            config,
            stats: stats.clone(),
            live: live.clone(),
            overflow: self.overflow,
            rings: std::sync::OnceLock::new(),
        });
        let mut rings = 0;
        if ctx.config.event_loop {
            let set = crate::rings::RingSet::start(ctx.config.server_rings, &ctx)
                .map_err(|e| Error::io("start the serving rings of", addr.to_string(), e))?;
            rings = set.len();
            let _ = ctx.rings.set(set);
        }
        let listener = self.listener;
        // The accept thread polls it with the connections in their handshake.
        listener
            .set_nonblocking(true)
            .map_err(|e| Error::io("make non-blocking the listener on", addr.to_string(), e))?;
        let gate = HandshakeGate::new(ctx.config.handshake);
        let gate_run = gate.clone();
        std::thread::Builder::new()
            .name("ferry-uring-accept".into())
            .spawn(move || crate::handshakes::run(listener, ctx, gate_run))
            .map_err(|e| Error::io("spawn accept thread for", addr.to_string(), e))?;
        Ok(UringServerHandle {
            addr,
            live,
            listener_fd,
            stats,
            gate,
            rings,
        })
    }
}

/// Serves a data stream whose handshake just ended (the attach accepted, its `proto` bound to
/// what the peer may see): answers the attach (the socket's send buffer is empty, so that small
/// frame goes at once; `left` of the handshake's time bounds it anyway) and serves the stream
/// on a thread of its own, or hands it to the overflow past the thread budget.
pub(crate) fn attached(
    stream: TcpStream,
    from: SocketAddr,
    attach: StreamAttach,
    proto: ServerStream,
    ctx: &Arc<Ctx>,
    left: Duration,
) {
    if let Some(rings) = ctx.rings.get() {
        crate::rings::attached(
            rings,
            stream,
            from,
            attach.stream_index,
            proto,
            ctx.config.pin_loopback_streams,
        );
        return;
    }
    let ctx = ctx.clone();
    let run = move || {
        if let Err(e) = serve_attached(stream, from, attach, proto, &ctx, left) {
            debug!(%from, error = %e, "connection ended");
        }
    };
    // The thread counts itself before it answers the attach; past the thread budget it only
    // hands the stream to the overflow and ends.
    let spawned = std::thread::Builder::new()
        .name("ferry-uring-conn".into())
        .spawn(run);
    if let Err(e) = spawned {
        warn!(%from, error = %e, "cannot spawn a connection thread");
    }
}

fn serve_attached(
    mut stream: TcpStream,
    from: SocketAddr,
    a: StreamAttach,
    proto: ServerStream,
    ctx: &Ctx,
    left: Duration,
) -> Result<(), Error> {
    stream
        .set_nonblocking(false)
        .map_err(|e| crate::control::lost(from, "attaching a data stream", e))?;
    let _ = stream.set_write_timeout(Some(left.max(Duration::from_millis(1))));
    // A data stream's thread is counted (a handshake's ends at once), before the stream
    // is accepted so that the client's next stream sees it. Past the thread budget the
    // stream goes to the overflow's fixed set of threads and this one ends.
    let what = "served data streams";
    let count = match &ctx.overflow {
        None => Ok(ThreadCount::new(&ctx.stats, what)),
        Some(o) => ThreadCount::within(&ctx.stats, ctx.config.max_threads, what).ok_or(o),
    };
    if count.is_err() {
        IoStats::add(&ctx.stats.handed_over, 1);
    }
    write_frame(&mut stream, from, &ControlFrame::StreamAccept)?;
    let _ = stream.set_write_timeout(None);
    let _count = match count {
        Ok(c) => c,
        Err(o) => return hand_over(o.as_ref(), stream, from, proto, ctx),
    };
    // A one-stream client pins nothing, so stream 0 starts unpinned and pins itself once
    // a second stream of the same client attaches (left to the scheduler, its thread was
    // woken onto the other stream's core, which then ran three busy threads while its
    // own idled for up to a millisecond at a time).
    let mut first = None;
    if ctx.config.pin_loopback_streams && from.ip().is_loopback() {
        let key = (a.peer_id, a.epoch);
        if a.stream_index == 0 {
            let flag = Arc::new(AtomicBool::new(false));
            lock(&ctx.live.first_streams).insert(key, flag.clone());
            first = Some(FirstStream {
                live: &ctx.live,
                key,
                flag,
            });
        } else {
            crate::pin_stream_thread(usize::from(a.stream_index));
            if let Some(f) = lock(&ctx.live.first_streams).get(&key) {
                f.store(true, Ordering::Release);
            }
        }
    }
    let stream = Arc::new(stream);
    let id = ctx.live.next.fetch_add(1, Ordering::Relaxed);
    lock(&ctx.live.conns).insert(id, stream.clone());
    if ctx.live.stopped.load(Ordering::Acquire) {
        let _ = stream.shutdown(std::net::Shutdown::Both);
    }
    let _span = tracing::debug_span!("serve stream", %from, stream = a.stream_index).entered();
    let res = serve_data(&stream, from, ctx, proto, first.as_ref().map(|f| &*f.flag))
        .map_err(|e| crate::control::lost(from, "serving data", e));
    drop(first);
    lock(&ctx.live.conns).remove(&id);
    res
}

/// Hands an attached data stream to `overflow`, keeping it in the server's connections (so that
/// a shutdown still closes it) until the overflow is done with it.
fn hand_over(
    overflow: &dyn StreamOverflow,
    stream: TcpStream,
    from: SocketAddr,
    proto: ServerStream,
    ctx: &Ctx,
) -> Result<(), Error> {
    let kept = stream
        .try_clone()
        .map_err(|e| crate::control::lost(from, "handing over a data stream", e))?;
    let id = ctx.live.next.fetch_add(1, Ordering::Relaxed);
    lock(&ctx.live.conns).insert(id, Arc::new(kept));
    if ctx.live.stopped.load(Ordering::Acquire) {
        let _ = stream.shutdown(std::net::Shutdown::Both);
    }
    debug!(%from, threads = ctx.stats.threads.load(Ordering::Relaxed), "data stream handed over past the thread budget");
    let live = ctx.live.clone();
    let res = overflow.serve(
        stream,
        from,
        proto,
        Box::new(move || {
            lock(&live.conns).remove(&id);
        }),
    );
    if res.is_err() {
        lock(&ctx.live.conns).remove(&id);
    }
    res
}

/// File segments move through a staging buffer of at most this much per stream (a multiple of
/// `DIRECT_ALIGN`, so aligned chunks stay aligned piece by piece).
pub(crate) const FILE_PIECE: usize = 1 << 20;

/// A staging buffer for file segments, page-aligned for O_DIRECT.
pub(crate) struct Stage {
    pub(crate) region: Option<Arc<MemoryRegion>>,
}

impl Stage {
    pub(crate) fn get(&mut self, len: usize) -> std::io::Result<&Arc<MemoryRegion>> {
        let need = (len as u64).div_ceil(DIRECT_ALIGN) * DIRECT_ALIGN;
        if self.region.as_ref().is_none_or(|r| (r.len() as u64) < need) {
            let r =
                MemoryRegion::alloc_zeroed(need.max(DIRECT_ALIGN) as usize, DIRECT_ALIGN as usize)
                    .map_err(|e| std::io::Error::other(e.to_string()))?;
            self.region = Some(Arc::new(r));
        }
        self.region
            .as_ref()
            .ok_or_else(|| std::io::Error::other("staging buffer"))
    }
}

/// A published file as this server moves it: a [`FileSegment`] through the stream's file ring
/// (O_DIRECT where alignment allows), any other [`FileSource`] through its own positioned I/O.
pub(crate) enum FileIo {
    Segment(Arc<FileSegment>),
    Source(Arc<dyn FileSource>),
}

impl FileIo {
    pub(crate) fn new(source: Arc<dyn FileSource>) -> Self {
        let any: Arc<dyn std::any::Any + Send + Sync> = source.clone();
        match any.downcast::<FileSegment>() {
            Ok(seg) => FileIo::Segment(seg),
            Err(_) => FileIo::Source(source),
        }
    }

    /// Reads exactly `n` bytes at file offset `at` into the start of `buf`.
    pub(crate) fn read_piece(
        &self,
        ring: &mut IoUring,
        buf: &MemoryRegion,
        n: usize,
        at: u64,
    ) -> std::io::Result<()> {
        match self {
            FileIo::Segment(f) => {
                let (fd, _direct) = f.read_fd(at, n as u64, buf.as_ptr() as usize);
                // SAFETY: the staging region holds at least `n` bytes and is used only by this
                // stream's thread, which waits for the read here.
                let got = unsafe { file_io(ring, fd, false, buf.as_ptr(), n, at) }?;
                if got < n {
                    return Err(std::io::Error::new(
                        std::io::ErrorKind::UnexpectedEof,
                        format!("file {} shrank under a READ", f.path().display()),
                    ));
                }
                Ok(())
            }
            FileIo::Source(f) => {
                // SAFETY: the staging region is this stream thread's alone, and no other view
                // of it is alive during the call; read straight into it, no bounce buffer.
                let piece = unsafe { buf.slice_mut(0, n) }
                    .map_err(|e| std::io::Error::other(format!("staging buffer: {e}")))?;
                f.read_exact_at(at, piece)
            }
        }
    }

    /// Writes the first `n` bytes of `buf` at file offset `at`.
    pub(crate) fn write_piece(
        &self,
        ring: &mut IoUring,
        buf: &MemoryRegion,
        n: usize,
        at: u64,
    ) -> std::io::Result<()> {
        match self {
            FileIo::Segment(f) => {
                // SAFETY: the staging region holds the `n` bytes just received and is used only
                // by this stream's thread, which waits for the write here.
                let put = unsafe { file_io(ring, f.write_fd(), true, buf.as_ptr(), n, at) }?;
                if put < n {
                    return Err(std::io::Error::other(format!(
                        "short write to file {}",
                        f.path().display()
                    )));
                }
                Ok(())
            }
            FileIo::Source(f) => {
                // SAFETY: the staging region is this stream thread's alone and nothing writes
                // it during the call; write straight from it, no bounce buffer.
                let piece = unsafe { buf.slice(0, n) }
                    .map_err(|e| std::io::Error::other(format!("staging buffer: {e}")))?;
                f.write_all_at(at, piece)
            }
        }
    }
}

/// Receives the next request header through the ring's armed receive (armed here if it is not
/// already). `false`: the client closed the stream cleanly, between requests.
fn next_head<H>(io: &mut SockIo<H>, head: &mut [u8; DATA_REQUEST_LEN]) -> std::io::Result<bool> {
    let mut at = 0usize;
    loop {
        if !io.armed() {
            io.arm_recv(DATA_REQUEST_LEN - at)?;
        }
        match io.take_armed() {
            Some(Ok([])) if at == 0 => return Ok(false),
            Some(Ok([])) => {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::UnexpectedEof,
                    format!("peer closed the stream {at} bytes into a request header"),
                ));
            }
            Some(Ok(bytes)) => {
                let n = bytes.len().min(DATA_REQUEST_LEN - at);
                head[at..at + n].copy_from_slice(&bytes[..n]);
                at += n;
                if at == DATA_REQUEST_LEN {
                    return Ok(true);
                }
            }
            Some(Err(e)) => return Err(e),
            None => io.wait(Duration::from_secs(60)),
        }
    }
}

/// Arms the receive of the next request header and submits it without waiting: `true` if the
/// whole header was already there (it is in `head`). Otherwise the receive stays armed and
/// [`next_head`] finishes it.
fn try_next_head<H>(
    io: &mut SockIo<H>,
    head: &mut [u8; DATA_REQUEST_LEN],
) -> std::io::Result<bool> {
    io.arm_recv(DATA_REQUEST_LEN)?;
    io.poll()?;
    if io.recv_outstanding() {
        return Ok(false);
    }
    // It completed at once: take it (a short piece is finished by a wait for the rest, which
    // the client sent with it; a clean end reports `false` and is met again by `next_head`).
    next_head(io, head)
}

/// The most bytes of a file piece a vectored request moves through the stream's scratch buffer
/// at a time: a piece may be up to `MAX_CHUNK` long, the buffer never grows past this.
const FILE_STEP: usize = 1 << 20;

/// A file piece of `len` bytes as steps of at most [`FILE_STEP`]: (offset in the piece, length).
fn file_steps(len: usize) -> impl Iterator<Item = (u64, usize)> {
    (0..len)
        .step_by(FILE_STEP)
        .map(move |off| (off as u64, FILE_STEP.min(len - off)))
}

/// Moves a vectored request's accepted pieces, in order, and answers it. A WRITE: runs of
/// memory targets with one vectored receive (RECVMSG), file targets through `scratch` and
/// positioned writes (this stream's own thread blocks), then the refused pieces' payload
/// (`discard`) dropped, then `response`. A READ: `response` and runs of memory targets with one
/// vectored send (SENDMSG), file targets through `scratch` and positioned reads.
fn serve_vectored(
    io: &mut SockIo<SegmentLease>,
    kind: OpKind,
    targets: &[Target],
    discard: u64,
    response: &[u8; DATA_RESPONSE_LEN],
    scratch: &mut Vec<u8>,
) -> std::io::Result<()> {
    if kind == OpKind::Write {
        let mut parts: Vec<(*mut u8, usize)> = Vec::with_capacity(targets.len());
        for t in targets {
            match t {
                Target::Memory { lease, at, len } => parts.push((
                    (lease.region.as_ptr() as usize + *at as usize) as *mut u8,
                    *len,
                )),
                Target::File { file, at, len } => {
                    // SAFETY: every memory range was checked against its region, which the
                    // targets' leases keep alive; no Rust reference into them exists.
                    unsafe { io.recv_vectored(&parts) }?;
                    parts.clear();
                    for (off, n) in file_steps(*len) {
                        scratch.resize(scratch.len().max(n), 0);
                        io.recv_buf(&mut scratch[..n])?;
                        file.write_all_at(*at + off, &scratch[..n])?;
                    }
                }
            }
        }
        // SAFETY: as above.
        unsafe { io.recv_vectored(&parts) }?;
        if discard > 0 && scratch.len() < 64 << 10 {
            scratch.resize(64 << 10, 0);
        }
        let mut left = discard;
        while left > 0 {
            let n = (scratch.len() as u64).min(left) as usize;
            io.recv_buf(&mut scratch[..n])?;
            left -= n as u64;
        }
        io.send_buf(response)
    } else {
        let mut parts: Vec<(*const u8, usize)> = Vec::with_capacity(targets.len() + 1);
        parts.push((response.as_ptr(), response.len()));
        for t in targets {
            match t {
                Target::Memory { lease, at, len } => parts.push((
                    (lease.region.as_ptr() as usize + *at as usize) as *const u8,
                    *len,
                )),
                Target::File { file, at, len } => {
                    // SAFETY: the response lives across the call; the memory ranges were
                    // checked against their regions, which the leases keep alive; they are
                    // only read, by a copying send done when the call returns.
                    unsafe { io.send_vectored(&parts) }?;
                    parts.clear();
                    for (off, n) in file_steps(*len) {
                        scratch.resize(scratch.len().max(n), 0);
                        file.read_exact_at(*at + off, &mut scratch[..n])?;
                        io.send_buf(&scratch[..n])?;
                    }
                }
            }
        }
        // SAFETY: as above.
        unsafe { io.send_vectored(&parts) }
    }
}

/// Serves chunks on one data stream until the client closes it, as the stream protocol
/// ([`ServerStream`]) decides: responses in request order, a refused WRITE's payload read and
/// dropped, a malformed header answered with `Malformed` and the stream closed, accepted WRITE
/// responses held back while the client's next WRITE into the same segment has already arrived.
/// `pin_first`: set once this stream (a loopback client's stream 0) should pin its thread.
fn serve_data(
    stream: &TcpStream,
    from: SocketAddr,
    ctx: &Ctx,
    mut proto: ServerStream,
    mut pin_first: Option<&AtomicBool>,
) -> std::io::Result<()> {
    let mut io: SockIo<SegmentLease> = SockIo::new(
        stream.as_raw_fd(),
        ctx.config.zero_copy_for(from.ip()),
        ctx.config.register_buffers,
        ctx.stats.clone(),
    )?;
    let mut file_ring: Option<IoUring> = None;
    let mut stage = Stage { region: None };
    let mut head = [0u8; DATA_REQUEST_LEN];
    let mut scratch: Vec<u8> = Vec::new();
    // `ready`: `head` already holds the next request (a response is held back only then, so the
    // client is never left waiting on a response with nothing else coming).
    let mut ready = false;
    let res = loop {
        if !ready {
            match next_head(&mut io, &mut head) {
                Ok(true) => {}
                Ok(false) => break Ok(()),
                Err(e) => break Err(e),
            }
        }
        ready = false;
        if let Some(f) = pin_first
            && f.load(Ordering::Acquire)
        {
            crate::pin_stream_thread(0);
            pin_first = None;
        }
        let action = proto.on_request(&head);
        // Only an accepted WRITE to memory may join the held-back responses; any other answer
        // must not overtake them.
        if !action.joins_held()
            && let Some(r) = proto.flush()
            && let Err(e) = io.send_buf(&r)
        {
            break Err(e);
        }
        let step = match action {
            Action::WriteMemory {
                lease,
                token,
                at,
                len,
                seq,
                ack_slack,
            } => {
                let ptr = (lease.region.as_ptr() as usize + at as usize) as *mut u8;
                // SAFETY: the stream protocol checked `at..at+len` against the region, which
                // the lease keeps alive; no Rust reference into it exists (raw receive).
                unsafe { io.recv_exact(ptr, len) }.and_then(|()| {
                    if proto.may_hold(ack_slack) && try_next_head(&mut io, &mut head)? {
                        ready = true;
                        if proto.hold_for_next(&lease, token, seq, &head) {
                            IoStats::add(&ctx.stats.held_responses, 1);
                            return Ok(());
                        }
                    }
                    // The next header's receive goes into the ring with the response (one
                    // io_uring_enter for both; `next_head` finds it armed), unless the next
                    // header is in already.
                    if !ready && !io.armed() {
                        io.arm_recv(DATA_REQUEST_LEN)?;
                    }
                    io.send_buf(&proto.answer_write(seq))
                })
            }
            Action::ReadMemory {
                lease,
                at,
                len,
                response,
            } => {
                let region = lease.region.clone();
                let body = Body {
                    region: &region,
                    offset: at,
                    len,
                };
                let mut hold = || lease.clone();
                // SAFETY: the range was checked against the region; each hold is a clone of the
                // lease, which keeps the region alive (and the registration in use) until the
                // zero-copy notification.
                unsafe { io.send(&response, Some(body), Some(&mut hold)) }
            }
            Action::ReadFile {
                file,
                at,
                len,
                response,
            } => {
                // Through a staging buffer of at most FILE_PIECE (O_DIRECT-aligned), however
                // large the chunk: the header first, then the payload piece by piece. A file
                // that shrank under the READ closes the stream.
                let f = FileIo::new(file);
                let ring = match &mut file_ring {
                    Some(r) => r,
                    None => file_ring.insert(IoUring::new(4)?),
                };
                // The header goes out with the first piece (alone only for an empty READ).
                let mut step = if len == 0 {
                    io.send_buf(&response)
                } else {
                    Ok(())
                };
                let mut done = 0usize;
                while step.is_ok() && done < len {
                    let n = FILE_PIECE.min(len - done);
                    let from_at = at + done as u64;
                    step = stage.get(n).cloned().and_then(|buf| {
                        f.read_piece(ring, &buf, n, from_at)?;
                        let body = Body {
                            region: &buf,
                            offset: 0,
                            len: n,
                        };
                        let head: &[u8] = if done == 0 { &response } else { &[] };
                        // SAFETY: the staging buffer is not reused before this copying send
                        // returns (no zero-copy hold is given).
                        unsafe { io.send(head, Some(body), None) }
                    });
                    done += n;
                }
                step
            }
            Action::WriteFile {
                file,
                at,
                len,
                response,
            } => {
                let f = FileIo::new(file);
                let ring = match &mut file_ring {
                    Some(r) => r,
                    None => file_ring.insert(IoUring::new(4)?),
                };
                let mut step = Ok(());
                let mut done = 0usize;
                while step.is_ok() && done < len {
                    let n = FILE_PIECE.min(len - done);
                    let to_at = at + done as u64;
                    step = stage.get(n).cloned().and_then(|buf| {
                        // SAFETY: the staging region holds at least `n` bytes and is used only
                        // here.
                        unsafe { io.recv_exact(buf.as_ptr(), n) }?;
                        f.write_piece(ring, &buf, n, to_at)
                    });
                    done += n;
                }
                step.and_then(|()| io.send_buf(&response))
            }
            Action::Refuse {
                kind,
                token,
                status,
                discard,
                response,
            } => {
                debug!(%from, %token, %kind, %status, "refused chunk");
                if discard > 0 && scratch.is_empty() {
                    scratch = vec![0u8; 64 << 10];
                }
                let mut left = discard;
                let mut r = Ok(());
                while left > 0 && r.is_ok() {
                    let n = (scratch.len() as u64).min(left) as usize;
                    r = io.recv_buf(&mut scratch[..n]);
                    left -= n as u64;
                }
                r.and_then(|()| io.send_buf(&response))
            }
            // This stream has its own thread: hashing blocks only it.
            Action::ChecksumMemory { lease, sum, seq } => {
                let crc = sum.finish();
                drop(lease);
                io.send_buf(&checksum_response(seq, crc))
            }
            Action::ChecksumFile { file, at, len, seq } => {
                // This stream has its own thread: the positioned reads block only it.
                ferry_core::checksum::crc32c_file(&*file, at, len)
                    .and_then(|crc| io.send_buf(&checksum_response(seq, crc)))
            }
            Action::Close { error, response } => {
                warn!(%from, %error, "malformed data request; closing stream");
                break io.send_buf(&response);
            }
            Action::Table { req } => {
                let mut bytes = vec![0u8; req.table_len()];
                if let Err(e) = io.recv_buf(&mut bytes) {
                    break Err(e);
                }
                match proto.on_table(&req, &bytes) {
                    Action::Vectored {
                        kind,
                        targets,
                        discard,
                        response,
                    } => serve_vectored(&mut io, kind, &targets, discard, &response, &mut scratch),
                    Action::Close { error, response } => {
                        warn!(%from, %error, "malformed piece table; closing stream");
                        break io.send_buf(&response);
                    }
                    other => {
                        warn!(%from, ?other, "unexpected answer to a piece table; closing stream");
                        break Ok(());
                    }
                }
            }
            Action::Vectored { .. } => {
                warn!(%from, "a vectored action without its table; closing stream");
                break Ok(());
            }
        };
        if let Err(e) = step {
            break Err(e);
        }
    };
    io.finish(crate::FINISH_GRACE);
    res
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A file piece of any length moves through at most `FILE_STEP` bytes of scratch, every
    /// byte once, in order.
    #[test]
    fn file_pieces_move_in_bounded_steps() {
        for len in [0, 1, FILE_STEP - 1, FILE_STEP, FILE_STEP + 1, 64 << 20] {
            let steps: Vec<_> = file_steps(len).collect();
            assert!(steps.iter().all(|&(_, n)| n > 0 && n <= FILE_STEP), "{len}");
            let mut next = 0u64;
            for &(off, n) in &steps {
                assert_eq!(off, next, "{len}");
                next += n as u64;
            }
            assert_eq!(next, len as u64);
        }
    }
}
