//! The serving side's event loop: a fixed set of rings ([`UringConfig::server_rings`]), each on
//! one thread, drives every attached data stream the server has; a stream costs no thread.
//!
//! The accept thread hands a stream whose handshake ended to one ring (in turn). Each stream is
//! a state machine around [`ServerStream`]: a queue of steps (send these bytes, receive into
//! these ranges, drop this many bytes, a file piece, a checksum piece), at most one socket
//! operation of it in flight at a time, so a stream's bytes stay in order while the ring runs
//! every other stream's. An idle stream is one armed receive of its next request header.
//! Everything a ring's streams queued in one turn goes to the kernel with one `io_uring_enter`.
//!
//! Sockets are fixed files where the kernel lets the ring register them. A send or payload
//! receive first moves what the socket takes or holds at once with one non-blocking syscall;
//! the rest goes through the ring (SENDMSG / RECVMSG with `MSG_WAITALL`, straight from and into
//! the segment). A WRITE payload's receive that does not wait for all its bytes (that one, and
//! the ring's under a raised `SO_RCVLOWAT`) also takes what is there of the next request header. A memory READ's payload to a peer the configuration sends zero-copy to goes out
//! with SEND_ZC (from a registered buffer where the ring takes it), its lease held in the driver
//! until the kernel's notification, however the stream ends; a request's last send carries the
//! next header's receive in the same enter. File pieces run on the ring's thread (positioned or
//! O_DIRECT ring I/O of at most one piece, 1 MiB); a checksum runs one piece per turn
//! ([`RegionCrc::step`] of memory, [`FileCrc::step`] of a file: one positioned read).
//!
//! [`UringConfig::server_rings`]: crate::UringConfig::server_rings

use std::collections::{HashMap, VecDeque};
use std::io;
use std::net::{SocketAddr, TcpStream};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, mpsc};

use ferry_core::checksum::{FileCrc, RegionCrc};
use ferry_core::stream::{Action, ServerStream, Target, checksum_response};
use ferry_core::wire::{DATA_REQUEST_LEN, VectoredRequest};
use ferry_core::{MemoryRegion, OpKind, SegmentLease, SegmentToken};
use io_uring::{IoUring, cqueue, opcode, squeue, types};
use tracing::{debug, warn};

use crate::file_ring::FileRing;
use crate::ring::user_data::{self, Decoded};
use crate::ring::{
    BufCache, IoStats, MAX_IOV, ThreadCount, iovecs_from, new_ring, push, spawn_ring, submit,
};
use super::{Ctx, FILE_PIECE, FileIo, Stage, lock};
use ferry_net::RECV_LOW_MARK as LOWAT;

/// Submission entries per ring (more are submitted in several calls).
const SQ_ENTRIES: u32 = 1024;
/// Completion entries per ring (the kernel keeps an overflow beyond them).
const CQ_ENTRIES: u32 = 8192;
/// Fixed-file slots per ring: streams past them use their plain descriptor.
const FIXED_FILES: u32 = 1 << 14;
/// Kinds of operations in their user data (`ring::user_data`): a stream's socket operation
/// (its front step's), a header receive armed beside a send, the wake eventfd's read, a no-op
/// that ends a wait at once.
const K_STEP: u8 = 1;
const K_ARMED: u8 = 2;
const K_WAKE: u8 = 3;
const K_NOP: u8 = 4;
/// Bytes a refused WRITE's payload is dropped through, per receive.
const DISCARD_BUF: usize = 64 << 10;

/// A stream handed from the accept thread to a ring.
struct NewStream {
    stream: TcpStream,
    from: SocketAddr,
    proto: ServerStream,
    /// The encoded `StreamAccept`, the stream's first bytes.
    accept: Vec<u8>,
}

/// One ring as the accept thread and the server's handle see it.
#[derive(Debug)]
struct RingHandle {
    tx: mpsc::Sender<NewStream>,
    wake: Arc<OwnedFd>,
}

/// The server's fixed set of rings; dropping it does not stop them (the server's `stopped`
/// flag, and the wake-ups `Live::ring_wakes` holds for the server's handle, do).
#[derive(Debug)]
pub(crate) struct RingSet {
    rings: Vec<RingHandle>,
    next: AtomicUsize,
    /// Set once a loopback client's second stream (index 1 or more) is handed over: then each
    /// ring pins itself to its CPU (`UringConfig::pin_loopback_streams`), as that client's
    /// streams are pinned. A one-stream client's streams are not, and neither are the rings.
    pin: Arc<AtomicBool>,
}

fn wake(fd: &OwnedFd) {
    let one: u64 = 1;
    // SAFETY: writes 8 bytes from a local to an eventfd this set owns.
    unsafe { libc::write(fd.as_raw_fd(), (&one as *const u64).cast(), 8) };
}

impl RingSet {
    /// Starts `n` rings (0: one per CPU this process may run on), each on its own thread.
    pub(crate) fn start(n: usize, ctx: &Arc<Ctx>) -> io::Result<Self> {
        let n = if n == 0 {
            std::thread::available_parallelism().map_or(1, |n| n.get())
        } else {
            n
        };
        let mut rings = Vec::with_capacity(n);
        let pin = Arc::new(AtomicBool::new(false));
        for i in 0..n {
            // SAFETY: plain eventfd creation; the result is checked before use.
            let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC) };
            if fd < 0 {
                return Err(io::Error::last_os_error());
            }
            // SAFETY: eventfd returned a fresh descriptor that we now own.
            let wake = Arc::new(unsafe { OwnedFd::from_raw_fd(fd) });
            let (tx, rx) = mpsc::channel();
            let (c, w) = (ctx.clone(), wake.clone());
            let p = ctx.config.pin_loopback_streams.then(|| (i, pin.clone()));
            // Each ring pins itself once a loopback client's second stream came (`Driver::pin`).
            spawn_ring(
                format!("ferry-uring-ring{i}"),
                None,
                move || Driver::new(c, rx, w, p),
                |mut d| d.run(),
            )?;
            lock(&ctx.live.ring_wakes).push(wake.clone());
            rings.push(RingHandle { tx, wake });
        }
        Ok(Self {
            rings,
            next: AtomicUsize::new(0),
            pin,
        })
    }

    /// How many rings it runs.
    pub(crate) fn len(&self) -> usize {
        self.rings.len()
    }

    /// Hands `stream` (blocking mode; its attach accepted by `accept`, sent first) to a ring:
    /// a loopback client's stream `index` to ring `index` (once such a client's second stream
    /// comes, the rings pin themselves one per CPU as its streams are, so both ends of a stream
    /// share a core), any other to the next in turn.
    fn hand(
        &self,
        stream: TcpStream,
        from: SocketAddr,
        index: Option<u16>,
        proto: ServerStream,
        accept: Vec<u8>,
    ) -> Result<(), ()> {
        let i = match index {
            Some(k) => usize::from(k),
            None => self.next.fetch_add(1, Ordering::Relaxed),
        } % self.rings.len();
        if index.is_some_and(|k| k >= 1) && !self.pin.swap(true, Ordering::AcqRel) {
            // Every ring pins itself at its next turn.
            for r in &self.rings {
                wake(&r.wake);
            }
        }
        let r = &self.rings[i];
        r.tx.send(NewStream {
            stream,
            from,
            proto,
            accept,
        })
        .map_err(|_| ())?;
        wake(&r.wake);
        Ok(())
    }
}

/// Serves a data stream whose handshake just ended on one of the server's rings: its attach is
/// answered by the ring, as the stream's first bytes.
pub(crate) fn attached(
    rings: &RingSet,
    stream: TcpStream,
    from: SocketAddr,
    stream_index: u16,
    proto: ServerStream,
    pin_loopback: bool,
) {
    let accept = match ferry_net::encode_frame(&ferry_core::wire::ControlFrame::StreamAccept) {
        Ok(b) => b,
        Err(e) => {
            warn!(%from, error = %e, "cannot encode a stream accept");
            return;
        }
    };
    // io_uring honours O_NONBLOCK with EAGAIN instead of waiting: the ring's sockets block.
    if let Err(e) = stream.set_nonblocking(false) {
        debug!(%from, error = %e, "cannot make a data stream blocking; closed");
        return;
    }
    let index = (pin_loopback && from.ip().is_loopback()).then_some(stream_index);
    if rings.hand(stream, from, index, proto, accept).is_err() {
        debug!(%from, "the server's rings have stopped; stream closed");
    }
}

/// What keeps the memory of a step's pointers alive until its operation completed.
#[derive(Default)]
struct Keep {
    _bytes: Vec<u8>,
    _lease: Option<SegmentLease>,
    _region: Option<Arc<MemoryRegion>>,
    _targets: Option<Arc<Vec<Target>>>,
}

/// One thing a stream does, in order.
enum Step {
    /// Sends `parts` (address, length) back to back; `done` bytes went.
    Send {
        parts: Vec<(*const u8, usize)>,
        done: usize,
        _keep: Keep,
    },
    /// Sends `head` (copied, `MSG_MORE`), then `len` bytes of `lease.region` at `at` with
    /// SEND_ZC; each zero-copy send holds a clone of the lease until its notification.
    SendZc {
        head: Vec<u8>,
        head_done: usize,
        lease: SegmentLease,
        at: u64,
        len: usize,
        done: usize,
    },
    /// Receives exactly the bytes of `parts`; `done` came. With `head_too` (a WRITE's payload,
    /// the last bytes of its request) a receive that need not wait for all of them also takes
    /// what is there of the next request's header, into [`Conn::head`] (never waiting for it).
    Recv {
        parts: Vec<(*const u8, usize)>,
        done: usize,
        head_too: bool,
        _keep: Keep,
    },
    /// Receives and drops `left` bytes.
    Discard { left: u64, buf: Box<[u8]> },
    /// Receives the next request header.
    Head {
        buf: Box<[u8; DATA_REQUEST_LEN]>,
        got: usize,
    },
    /// Receives a vectored request's piece table.
    Table {
        req: VectoredRequest,
        bytes: Vec<u8>,
        got: usize,
    },
    /// Reads `len` bytes of a file at `at` into the start of `stage` (on the ring's thread).
    FileRead {
        file: Arc<FileIo>,
        at: u64,
        len: usize,
        stage: Arc<MemoryRegion>,
    },
    /// Writes the first `len` bytes of `stage` to a file at `at` (on the ring's thread).
    FileWrite {
        file: Arc<FileIo>,
        at: u64,
        len: usize,
        stage: Arc<MemoryRegion>,
    },
    /// An accepted WRITE's payload is in: answer it or hold the answer back.
    Answer {
        lease: SegmentLease,
        token: SegmentToken,
        seq: u32,
        ack_slack: u16,
    },
    /// Hashes a memory range, a piece per turn, then answers.
    Crc {
        sum: RegionCrc,
        seq: u32,
        _lease: SegmentLease,
    },
    /// Hashes a file range, a piece (one positioned read on the ring's thread) per turn, then
    /// answers.
    CrcFile { sum: FileCrc, seq: u32 },
    /// Ends the stream (after what came before it).
    Close,
}

impl Step {
    fn send_owned(bytes: Vec<u8>) -> Self {
        let parts = vec![(bytes.as_ptr(), bytes.len())];
        Step::Send {
            parts,
            done: 0,
            _keep: Keep {
                _bytes: bytes,
                ..Keep::default()
            },
        }
    }

    fn head() -> Self {
        Step::Head {
            buf: Box::new([0; DATA_REQUEST_LEN]),
            got: 0,
        }
    }
}

/// One data stream on a ring. Boxed: the ring's operations point into it.
struct Conn {
    stream: Arc<TcpStream>,
    from: SocketAddr,
    /// Its place in the server's connections (so a shutdown reaches it).
    live_id: u64,
    /// Its fixed-file slot, if registered.
    fixed: Option<u32>,
    proto: ServerStream,
    steps: VecDeque<Step>,
    /// A socket operation of the front step is in flight.
    inflight: bool,
    /// The next request header's receive, submitted with the request's last send (one enter
    /// for both) while the stream is otherwise idle; at most one receive is in flight.
    armed: Option<Armed>,
    /// Ended, waiting for its operations in flight before it is freed.
    dead: bool,
    /// READ payloads go out with SEND_ZC (`UringConfig::zero_copy_for` this peer).
    zero_copy: bool,
    /// The socket's `SO_RCVLOWAT` as last set (1: the kernel's default); 0: the kernel refused
    /// a mark, none is used on this socket.
    lowat: usize,
    /// The next request's header: `head_got` bytes of it received ahead of its turn (with a
    /// WRITE's payload, or after it without waiting); all of it and taken as the next request:
    /// `ready`.
    head: [u8; DATA_REQUEST_LEN],
    head_got: usize,
    ready: bool,
    stage: Stage,
    /// The iovecs and message of the operation in flight.
    iov: Vec<libc::iovec>,
    msg: libc::msghdr,
    /// Bumped per slot reuse, so a completion never reaches a later stream in the same slot.
    generation: u32,
}

/// A header receive armed beside a send.
struct Armed {
    buf: Box<[u8; DATA_REQUEST_LEN]>,
    /// Its completion's result, once reaped.
    res: Option<i32>,
}

impl Conn {
    /// Whether the kernel may still use memory of this stream.
    fn busy(&self) -> bool {
        self.inflight || self.armed.as_ref().is_some_and(|a| a.res.is_none())
    }
}

/// What one stream may do in a ring turn before every other runnable stream had its turn:
/// steps worth this many bytes (sends and receives done at once, file pieces), each step
/// counted as at least [`STEP_COST`] (so that many small ones, a pipeline of requests whose
/// bytes are all there, are bounded too).
const TURN_BUDGET: usize = 2 << 20;
/// The least a step costs of [`TURN_BUDGET`].
const STEP_COST: usize = 64 << 10;

/// The bytes a step moves on the ring's thread, as [`TURN_BUDGET`] counts them.
fn step_bytes(step: &Step) -> usize {
    match step {
        Step::Send { parts, done, .. } | Step::Recv { parts, done, .. } => {
            total(parts).saturating_sub(*done)
        }
        Step::FileRead { len, .. } | Step::FileWrite { len, .. } => *len,
        _ => 0,
    }
}

/// What a stream's turn ended with.
enum Turn {
    /// An operation is in flight (or the stream waits for its next turn).
    Wait,
    /// Run it again next turn (a checksum piece done, its turn's budget spent).
    Yield,
    /// The stream is over (cleanly or not).
    End(io::Result<()>),
}

/// One ring and its thread's streams.
struct Driver {
    ctx: Arc<Ctx>,
    ring: IoUring,
    rx: mpsc::Receiver<NewStream>,
    wake: Arc<OwnedFd>,
    wake_buf: Box<[u8; 8]>,
    wake_armed: bool,
    fixed_files: bool,
    conns: Vec<Option<Box<Conn>>>,
    generations: Vec<u32>,
    free: Vec<usize>,
    runnable: VecDeque<usize>,
    file_ring: FileRing,
    /// Registered buffers for zero-copy sends.
    bufs: BufCache,
    /// Zero-copy sends not yet let go by the kernel, by key: the stream and generation that
    /// sent it (for its completion) and the lease that keeps its buffer alive (until its
    /// notification).
    zc: HashMap<u64, (usize, u32, SegmentLease)>,
    zc_next: u64,
    /// This ring's place and the set's pin flag (`RingSet::pin`), until it pinned itself.
    pin: Option<(usize, Arc<AtomicBool>)>,
    _count: ThreadCount,
}

impl Driver {
    fn new(
        ctx: Arc<Ctx>,
        rx: mpsc::Receiver<NewStream>,
        wake: Arc<OwnedFd>,
        pin: Option<(usize, Arc<AtomicBool>)>,
    ) -> io::Result<Self> {
        // Made and entered only by the ring's thread (no deferred task work runs while it is in
        // another system call, a splice say).
        let ring = new_ring(SQ_ENTRIES, CQ_ENTRIES)?;
        let fixed_files = ctx.config.register_buffers
            && ring.submitter().register_files_sparse(FIXED_FILES).is_ok();
        let count = ThreadCount::new(&ctx.stats);
        let bufs = BufCache::new(
            &ring,
            ctx.config.register_buffers && ctx.config.zero_copy_enabled(),
        );
        Ok(Self {
            ctx,
            ring,
            rx,
            wake,
            wake_buf: Box::new([0; 8]),
            wake_armed: false,
            fixed_files,
            conns: Vec::new(),
            generations: Vec::new(),
            free: Vec::new(),
            runnable: VecDeque::new(),
            file_ring: FileRing::default(),
            bufs,
            zc: HashMap::new(),
            zc_next: 0,
            pin,
            _count: count,
        })
    }

    fn stopped(&self) -> bool {
        self.ctx.live.stopped.load(Ordering::Acquire)
    }

    fn run(&mut self) {
        let res = self.turns();
        if let Err(e) = &res {
            warn!(error = %e, "a server ring failed; its streams are left to the kernel");
        }
        // Every stream's socket is shut down; wait for the operations in flight (the shutdown
        // ends them) before their memory goes.
        for c in self.conns.iter().flatten() {
            let _ = c.stream.shutdown(std::net::Shutdown::Both);
        }
        let grace = std::time::Instant::now() + crate::FINISH_GRACE;
        if res.is_ok() {
            while self.conns.iter().flatten().any(|c| c.busy())
                || self.wake_armed
                || (!self.zc.is_empty() && std::time::Instant::now() < grace)
            {
                if self.wake_armed {
                    wake(&self.wake);
                }
                let r = if self.conns.iter().flatten().any(|c| c.busy()) || self.wake_armed {
                    submit(&mut self.ring, true)
                } else {
                    // Only notifications are awaited: poll, the grace bounds it.
                    std::thread::sleep(std::time::Duration::from_millis(1));
                    submit(&mut self.ring, false)
                };
                if r.is_err() {
                    break;
                }
                self.reap();
            }
        }
        // Zero-copy sends the kernel did not let go of (the peer never acknowledged them):
        // their buffers stay alive for good.
        std::mem::forget(std::mem::take(&mut self.zc));
        let still = self.conns.iter().flatten().any(|c| c.busy()) || self.wake_armed;
        for i in 0..self.conns.len() {
            if self.conns[i].as_ref().is_some_and(|c| !c.busy()) {
                self.end(i, Ok(()));
            }
        }
        if still {
            // The kernel may still write into them: never free them.
            std::mem::forget(std::mem::take(&mut self.conns));
            std::mem::forget(std::mem::take(&mut self.wake_buf));
        }
    }

    fn turns(&mut self) -> io::Result<()> {
        loop {
            if self.stopped() {
                return Ok(());
            }
            if let Some((i, flag)) = &self.pin
                && flag.load(Ordering::Acquire)
            {
                // One ring per core: ring `i` on the `i`-th CPU, where a loopback client's
                // stream `i` runs too (see `RingSet::hand`).
                crate::pin_stream_thread(*i);
                self.pin = None;
            }
            while let Ok(n) = self.rx.try_recv() {
                self.add(n);
            }
            if !self.wake_armed {
                let e = opcode::Read::new(
                    types::Fd(self.wake.as_raw_fd()),
                    self.wake_buf.as_mut_ptr(),
                    8,
                )
                .build()
                .user_data(user_data::op(K_WAKE, 0, 0));
                // SAFETY: the buffer is boxed in the driver, which outlives the read (`run`
                // waits for it, or leaks the buffer).
                unsafe { push(&mut self.ring, &e) }?;
                self.wake_armed = true;
            }
            self.run_streams()?;
            submit(&mut self.ring, true)?;
            self.reap();
        }
    }

    /// Gives every runnable stream its turn, each within [`TURN_BUDGET`]: one that has more to
    /// do runs again at the next turn.
    fn run_streams(&mut self) -> io::Result<()> {
        let mut yielded = Vec::new();
        while let Some(i) = self.runnable.pop_front() {
            match self.advance(i) {
                Turn::Wait => {}
                Turn::Yield => yielded.push(i),
                Turn::End(r) => self.end(i, r),
            }
        }
        if !yielded.is_empty() {
            // A stream has more to do (a checksum, its budget spent): do not sleep, but still
            // run the ring's deferred task work (other streams' receives), which only a wait
            // runs; a no-op completes at once and ends the wait.
            let nop = opcode::Nop::new()
                .build()
                .user_data(user_data::op(K_NOP, 0, 0));
            // SAFETY: a no-op carries no buffer.
            unsafe { push(&mut self.ring, &nop) }?;
        }
        self.runnable.extend(yielded);
        Ok(())
    }

    fn reap(&mut self) {
        let done: Vec<(u64, i32, u32)> = self
            .ring
            .completion()
            .map(|c| (c.user_data(), c.result(), c.flags()))
            .collect();
        for (u, res, flags) in done {
            let (armed, i, g) = match user_data::decode(u) {
                Decoded::Op { kind: K_WAKE, .. } => {
                    self.wake_armed = false;
                    continue;
                }
                Decoded::Op {
                    kind: kind @ (K_STEP | K_ARMED),
                    slot,
                    generation,
                } => (kind == K_ARMED, slot, generation),
                Decoded::Op { .. } => continue,
                Decoded::Zc(key) => {
                    if cqueue::notif(flags) {
                        IoStats::add(&self.ctx.stats.notifications, 1);
                        self.zc.remove(&key);
                        continue;
                    }
                    let Some(&(i, g, _)) = self.zc.get(&key) else {
                        continue;
                    };
                    if !cqueue::more(flags) {
                        // No notification will come for this one.
                        self.zc.remove(&key);
                    }
                    (false, i, g)
                }
            };
            let Some(Some(c)) = self.conns.get_mut(i) else {
                continue;
            };
            if c.generation != g {
                continue;
            }
            let r = if armed {
                match c.armed.as_mut() {
                    Some(a) if a.res.is_none() => a.res = Some(res),
                    _ => continue,
                }
                Ok(())
            } else {
                if !c.inflight {
                    continue;
                }
                c.inflight = false;
                if c.dead { Ok(()) } else { on_complete(c, res) }
            };
            if c.dead {
                if !c.busy() {
                    self.end(i, Ok(()));
                }
                continue;
            }
            match r {
                Ok(()) => self.runnable.push_back(i),
                Err(e) => self.end(i, Err(e)),
            }
        }
    }

    fn add(&mut self, n: NewStream) {
        if self.free.is_empty() && self.conns.len() >= user_data::MAX_SLOTS {
            // Its operations could not be named: closed (dropped) instead.
            warn!(from = %n.from, "a server ring serves as many streams as it can name; stream closed");
            return;
        }
        let stream = Arc::new(n.stream);
        let live_id = self.ctx.live.next.fetch_add(1, Ordering::Relaxed);
        lock(&self.ctx.live.conns).insert(live_id, stream.clone());
        if self.stopped() {
            let _ = stream.shutdown(std::net::Shutdown::Both);
        }
        let i = match self.free.pop() {
            Some(i) => i,
            None => {
                self.conns.push(None);
                self.generations.push(0);
                self.conns.len() - 1
            }
        };
        self.generations[i] = user_data::next_generation(self.generations[i]);
        let fixed = (self.fixed_files && i < FIXED_FILES as usize)
            .then(|| {
                self.ring
                    .submitter()
                    .register_files_update(i as u32, &[stream.as_raw_fd()])
                    .ok()
                    .map(|_| i as u32)
            })
            .flatten();
        let mut steps = VecDeque::new();
        steps.push_back(Step::send_owned(n.accept));
        self.conns[i] = Some(Box::new(Conn {
            stream,
            from: n.from,
            live_id,
            fixed,
            proto: n.proto,
            steps,
            inflight: false,
            armed: None,
            dead: false,
            zero_copy: self.ctx.config.zero_copy_for(n.from.ip()),
            lowat: 1,
            head: [0; DATA_REQUEST_LEN],
            head_got: 0,
            ready: false,
            stage: Stage { region: None },
            iov: Vec::new(),
            // SAFETY: a zeroed msghdr is valid (no name, no iovecs, no control).
            msg: unsafe { std::mem::zeroed() },
            generation: self.generations[i],
        }));
        self.runnable.push_back(i);
    }

    /// Ends stream `i`: at once, or once the kernel is done with its operations in flight
    /// (the socket's shutdown ends them).
    fn end(&mut self, i: usize, res: io::Result<()>) {
        let Some(c) = self.conns[i].as_mut() else {
            return;
        };
        if let Err(e) = res {
            debug!(from = %c.from, error = %e, "connection ended");
        }
        if c.busy() {
            c.dead = true;
            let _ = c.stream.shutdown(std::net::Shutdown::Both);
            return;
        }
        let Some(c) = self.conns[i].take() else {
            return;
        };
        if let Some(slot) = c.fixed {
            let _ = self.ring.submitter().register_files_update(slot, &[-1]);
        }
        let _ = c.stream.shutdown(std::net::Shutdown::Both);
        lock(&self.ctx.live.conns).remove(&c.live_id);
        self.free.push(i);
    }

    /// Runs stream `i`'s steps until one waits for the socket.
    fn advance(&mut self, i: usize) -> Turn {
        let stopped = self.stopped();
        let Some(c) = self.conns[i].as_mut() else {
            return Turn::Wait;
        };
        if c.inflight || c.dead {
            return Turn::Wait;
        }
        if stopped {
            return Turn::End(Ok(()));
        }
        let mut spent = 0usize;
        loop {
            if spent >= TURN_BUDGET {
                // The others' turn: this stream goes on at the next.
                return Turn::Yield;
            }
            spent += c.steps.front().map_or(0, step_bytes).max(STEP_COST);
            let Some(step) = c.steps.front_mut() else {
                if c.ready {
                    c.ready = false;
                    let head = c.head;
                    plan(c, &self.ctx, &head);
                } else if let Some(a) = c.armed.take() {
                    // The header's receive went with the last send: take it as its own.
                    let Some(res) = a.res else {
                        c.armed = Some(a);
                        return Turn::Wait;
                    };
                    c.steps.push_back(Step::Head { buf: a.buf, got: 0 });
                    if let Err(e) = on_complete(c, res) {
                        return Turn::End(Err(e));
                    }
                } else {
                    c.steps.push_back(Step::head());
                }
                continue;
            };
            let r = match step {
                Step::SendZc {
                    head,
                    head_done,
                    lease,
                    at,
                    len,
                    done,
                } if *head_done >= head.len() => {
                    if *done >= *len {
                        c.steps.pop_front();
                        continue;
                    }
                    let ptr = (lease.region.as_ptr() as usize + *at as usize + *done) as *const u8;
                    let n = (*len - *done).min(u32::MAX as usize & !4095) as u32;
                    let index = self.bufs.index(&self.ring, &lease.region, &self.ctx.stats);
                    let flags = libc::MSG_WAITALL | libc::MSG_NOSIGNAL;
                    let e = match c.fixed {
                        Some(slot) => opcode::SendZc::new(types::Fixed(slot), ptr, n),
                        None => opcode::SendZc::new(types::Fd(c.stream.as_raw_fd()), ptr, n),
                    }
                    .buf_index(index)
                    .flags(flags)
                    .build();
                    let key = self.zc_next;
                    self.zc_next += 1;
                    // The hold is in place before the send can complete.
                    self.zc.insert(key, (i, c.generation, lease.clone()));
                    IoStats::add(&self.ctx.stats.zc_sends, 1);
                    if index.is_some() {
                        IoStats::add(&self.ctx.stats.fixed_sends, 1);
                    }
                    c.inflight = true;
                    let e = e.user_data(user_data::zc(key));
                    // SAFETY: the range was checked against the region by the stream protocol;
                    // the lease held in `zc` keeps the region alive (and its registration in
                    // use) until the kernel's notification that it let go of the pages.
                    if let Err(err) = unsafe { push(&mut self.ring, &e) } {
                        c.inflight = false;
                        self.zc.remove(&key);
                        return Turn::End(Err(err));
                    }
                    return Turn::Wait;
                }
                Step::SendZc { .. }
                | Step::Send { .. }
                | Step::Recv { .. }
                | Step::Discard { .. }
                | Step::Head { .. }
                | Step::Table { .. } => {
                    if matches!(step, Step::Send { .. } | Step::Recv { .. }) {
                        // What the socket takes (or holds) now moves with one plain syscall,
                        // no ring round trip; the ring waits only for the rest.
                        match direct(c) {
                            Ok(true) => {
                                c.steps.pop_front();
                                continue;
                            }
                            Ok(false) => {}
                            Err(e) => return Turn::End(Err(e)),
                        }
                    }
                    low_mark(c);
                    let Some(e) = sock_op(c) else {
                        return Turn::End(Err(io::Error::other("a socket step with no bytes")));
                    };
                    let last_send = c.steps.len() == 1
                        && matches!(c.steps.front(), Some(Step::Send { .. }))
                        && !c.ready
                        && c.armed.is_none();
                    let e = e.user_data(user_data::op(K_STEP, i, c.generation));
                    c.inflight = true;
                    // SAFETY: the entry points into the boxed `Conn` (iovecs, message, the next
                    // header's buffer) and at memory its front step keeps alive (`Keep`, owned
                    // buffers); the step is popped, and the `Conn` freed, only after the
                    // completion was reaped.
                    if let Err(err) = unsafe { push(&mut self.ring, &e) } {
                        // Not queued (the ring refused a submit): nothing is in flight.
                        c.inflight = false;
                        return Turn::End(Err(err));
                    }
                    // The header's receive needs the low mark at 1 (a 32-byte header must wake
                    // the ring); where it cannot be had, the header is received after the send.
                    if last_send && mark_one(c) {
                        // Nothing else is received on this stream until the header is in.
                        let mut buf = Box::new([0u8; DATA_REQUEST_LEN]);
                        let flags = libc::MSG_WAITALL | libc::MSG_NOSIGNAL;
                        let e = match c.fixed {
                            Some(slot) => opcode::Recv::new(
                                types::Fixed(slot),
                                buf.as_mut_ptr(),
                                DATA_REQUEST_LEN as u32,
                            )
                            .flags(flags)
                            .build(),
                            None => opcode::Recv::new(
                                types::Fd(c.stream.as_raw_fd()),
                                buf.as_mut_ptr(),
                                DATA_REQUEST_LEN as u32,
                            )
                            .flags(flags)
                            .build(),
                        }
                        .user_data(user_data::op(K_ARMED, i, c.generation));
                        // SAFETY: the buffer is boxed in `c.armed` (set before the completion
                        // can be reaped, on this thread), which is kept until it completes.
                        if unsafe { push(&mut self.ring, &e) }.is_ok() {
                            c.armed = Some(Armed { buf, res: None });
                        }
                    }
                    return Turn::Wait;
                }
                Step::FileRead {
                    file,
                    at,
                    len,
                    stage,
                } => file.read_piece(&mut self.file_ring, stage, *len, *at),
                Step::FileWrite {
                    file,
                    at,
                    len,
                    stage,
                } => file.write_piece(&mut self.file_ring, stage, *len, *at),
                Step::Answer {
                    lease,
                    token,
                    seq,
                    ack_slack,
                } => {
                    let (lease, token, seq, ack_slack) = (lease.clone(), *token, *seq, *ack_slack);
                    c.steps.pop_front();
                    let may_hold = c.proto.may_hold(ack_slack);
                    // The next header, where part of it came with the payload or a held
                    // answer could use it: the rest of it if the socket has it now.
                    if (c.head_got > 0 || may_hold) && head_now(c) {
                        c.head_got = 0;
                        c.ready = true;
                        if may_hold && c.proto.hold_for_next(&lease, token, seq, &c.head) {
                            IoStats::add(&self.ctx.stats.held_responses, 1);
                            continue;
                        }
                    }
                    let answer = c.proto.answer_write(seq);
                    c.steps.push_front(Step::send_owned(answer.to_vec()));
                    if c.head_got > 0 {
                        // Part of the next header is in: the rest is received after the answer
                        // (the payload was the request's last step, nothing else is queued).
                        c.steps.push_back(Step::Head {
                            buf: Box::new(c.head),
                            got: c.head_got,
                        });
                        c.head_got = 0;
                    }
                    continue;
                }
                Step::Crc { sum, seq, .. } => match sum.step() {
                    Some(crc) => {
                        let seq = *seq;
                        c.steps.pop_front();
                        c.steps
                            .push_front(Step::send_owned(checksum_response(seq, crc).to_vec()));
                        continue;
                    }
                    None => return Turn::Yield,
                },
                Step::CrcFile { sum, seq } => match sum.step() {
                    Ok(Some(crc)) => {
                        let seq = *seq;
                        c.steps.pop_front();
                        c.steps
                            .push_front(Step::send_owned(checksum_response(seq, crc).to_vec()));
                        continue;
                    }
                    Ok(None) => return Turn::Yield,
                    Err(e) => Err(e),
                },
                Step::Close => return Turn::End(Ok(())),
            };
            if let Err(e) = r {
                return Turn::End(Err(e));
            }
            c.steps.pop_front();
        }
    }
}

/// Receives what the socket holds now of the rest of the next request header into `c.head`
/// (one non-blocking syscall, none if all of it came with the payload): whether all of it is in.
/// A part stays counted in `c.head_got`; an error or the peer's end is left to the next
/// receive, which sees it again.
fn head_now(c: &mut Conn) -> bool {
    if c.head_got < DATA_REQUEST_LEN {
        let rest = &mut c.head[c.head_got..];
        // SAFETY: receives at most `rest.len()` bytes into the stream's own header buffer.
        let n = unsafe {
            libc::recv(
                c.stream.as_raw_fd(),
                rest.as_mut_ptr().cast(),
                rest.len(),
                libc::MSG_DONTWAIT,
            )
        };
        if n > 0 {
            c.head_got += n as usize;
        }
    }
    c.head_got >= DATA_REQUEST_LEN
}

/// Appends to `iov` (which covers all of a WRITE payload's `rest` bytes) the part of the next
/// request header not received yet, so that the same receive takes what is there of it.
fn with_head(
    iov: &mut Vec<libc::iovec>,
    rest: usize,
    head: &mut [u8; DATA_REQUEST_LEN],
    got: usize,
) {
    let covered: usize = iov.iter().map(|v| v.iov_len).sum();
    if covered == rest && got < DATA_REQUEST_LEN && iov.len() < MAX_IOV {
        iov.push(libc::iovec {
            iov_base: head[got..].as_mut_ptr().cast(),
            iov_len: DATA_REQUEST_LEN - got,
        });
    }
}

/// Counts `n` bytes received by a payload's receive that may have taken the next header too:
/// those past the payload's rest are the header's.
fn received(done: &mut usize, all: usize, head_got: &mut usize, n: usize) {
    let rest = all.saturating_sub(*done);
    if n > rest {
        *head_got += n - rest;
        *done = all;
    } else {
        *done += n;
    }
}

/// Sets the socket's receive low mark for `c`'s front step, as the client rings do: a payload
/// receive of more than [`LOWAT`] wakes the ring once per
/// [`LOWAT`] (or the rest, for its tail), not once per segment; every other receive (a header
/// next) needs the mark back at 1. A refused mark is not tried again on the socket.
fn low_mark(c: &mut Conn) {
    if c.lowat == 0 {
        return;
    }
    let want = match c.steps.front() {
        Some(Step::Recv { parts, done, .. }) if total(parts) > LOWAT => {
            (total(parts) - done).clamp(1, LOWAT)
        }
        Some(Step::Send { .. } | Step::SendZc { .. }) => return,
        _ => 1,
    };
    if want == c.lowat {
        return;
    }
    // SAFETY: the descriptor of the stream's socket, which `c` keeps open.
    let fd = unsafe { std::os::fd::BorrowedFd::borrow_raw(c.stream.as_raw_fd()) };
    match ferry_net::set_recv_low_mark(fd, want) {
        Ok(()) => c.lowat = want,
        Err(e) => {
            debug!(error = %e, "SO_RCVLOWAT refused; receiving without it");
            if c.lowat != 1 {
                // Still raised: a header would wait for the old mark.
                let _ = ferry_net::set_recv_low_mark(fd, 1);
            }
            c.lowat = 0;
        }
    }
}

/// Brings the socket's receive low mark back to 1 (or finds it there): whether it is.
fn mark_one(c: &mut Conn) -> bool {
    if c.lowat <= 1 {
        return true;
    }
    // SAFETY: the descriptor of the stream's socket, which `c` keeps open.
    let fd = unsafe { std::os::fd::BorrowedFd::borrow_raw(c.stream.as_raw_fd()) };
    if ferry_net::set_recv_low_mark(fd, 1).is_ok() {
        c.lowat = 1;
        true
    } else {
        false
    }
}

/// Moves as much of `c`'s front step (a send or a payload receive) as the socket takes or holds
/// now, without waiting: `true` once all of it moved.
fn direct(c: &mut Conn) -> io::Result<bool> {
    let fd = c.stream.as_raw_fd();
    let Conn {
        steps,
        iov,
        head,
        head_got,
        ..
    } = c;
    let (send, parts, done, head_too) = match steps.front_mut() {
        Some(Step::Send { parts, done, .. }) => (true, &*parts, done, false),
        Some(Step::Recv {
            parts,
            done,
            head_too,
            ..
        }) => (false, &*parts, done, *head_too),
        _ => return Ok(false),
    };
    let all = total(parts);
    if *done >= all {
        return Ok(true);
    }
    iovecs_from(parts, *done, iov);
    if head_too {
        // Never waits: what is there of the next header comes with the payload's rest.
        with_head(iov, all - *done, head, *head_got);
    }
    // SAFETY: a zeroed msghdr is valid (no name, no control).
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = iov.as_mut_ptr();
    msg.msg_iovlen = iov.len() as _;
    let flags = libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL;
    // SAFETY: the iovecs cover memory the step keeps alive (its `Keep`, checked ranges of
    // leased regions) and that nothing else reads or writes meanwhile; the call does not keep
    // them past its return.
    let n = unsafe {
        if send {
            libc::sendmsg(fd, &msg, flags)
        } else {
            libc::recvmsg(fd, &mut msg, flags)
        }
    };
    if n < 0 {
        let e = io::Error::last_os_error();
        return match e.raw_os_error() {
            Some(libc::EAGAIN | libc::EINTR) => Ok(false),
            _ => Err(e),
        };
    }
    if n == 0 {
        return Err(if send {
            io::Error::new(io::ErrorKind::WriteZero, "send took nothing")
        } else {
            io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "peer closed the stream in a payload",
            )
        });
    }
    received(done, all, head_got, n as usize);
    Ok(*done >= all)
}

/// The socket operation of `c`'s front step (its iovecs and message set up in `c`).
fn sock_op(c: &mut Conn) -> Option<squeue::Entry> {
    let Conn {
        steps,
        iov,
        msg,
        fixed,
        stream,
        lowat,
        head,
        head_got,
        ..
    } = c;
    let (send, flags) = match steps.front_mut()? {
        Step::Send { parts, done, .. } => {
            iovecs_from(parts, *done, iov);
            // All of it before the completion (a full socket is waited out in the kernel,
            // not with a completion per piece).
            (true, libc::MSG_WAITALL)
        }
        Step::SendZc {
            head, head_done, ..
        } => {
            iovecs_from(&[(head.as_ptr(), head.len())], *head_done, iov);
            (true, libc::MSG_WAITALL | libc::MSG_MORE)
        }
        Step::Recv {
            parts,
            done,
            head_too,
            ..
        } => {
            iovecs_from(parts, *done, iov);
            // With the low mark raised the receive completes with what is there (at least the
            // mark, or the rest), and the next one sets the mark for the rest: waiting for all
            // of it under a mark above the rest would never wake.
            if *lowat > 1 {
                // It waits for no more than the mark (at most the payload's rest), so it may
                // also take what is there of the next header.
                if *head_too {
                    with_head(iov, total(parts) - *done, head, *head_got);
                }
                (false, 0)
            } else {
                (false, libc::MSG_WAITALL)
            }
        }
        Step::Discard { left, buf } => {
            let n = (*left).min(buf.len() as u64) as usize;
            iovecs_from(&[(buf.as_ptr(), n)], 0, iov);
            (false, 0)
        }
        Step::Head { buf, got } => {
            iovecs_from(&[(buf.as_ptr(), buf.len())], *got, iov);
            (false, libc::MSG_WAITALL)
        }
        Step::Table { bytes, got, .. } => {
            iovecs_from(&[(bytes.as_ptr(), bytes.len())], *got, iov);
            (false, libc::MSG_WAITALL)
        }
        _ => return None,
    };
    if iov.is_empty() {
        return None;
    }
    debug_assert!(iov.len() <= MAX_IOV);
    msg.msg_iov = iov.as_mut_ptr();
    msg.msg_iovlen = iov.len() as _;
    let flags = (flags | libc::MSG_NOSIGNAL) as u32;
    let msg_ptr: *mut libc::msghdr = msg;
    Some(match (send, *fixed) {
        (true, Some(slot)) => opcode::SendMsg::new(types::Fixed(slot), msg_ptr)
            .flags(flags)
            .build(),
        (true, None) => opcode::SendMsg::new(types::Fd(stream.as_raw_fd() as RawFd), msg_ptr)
            .flags(flags)
            .build(),
        (false, Some(slot)) => opcode::RecvMsg::new(types::Fixed(slot), msg_ptr)
            .flags(flags)
            .build(),
        (false, None) => opcode::RecvMsg::new(types::Fd(stream.as_raw_fd() as RawFd), msg_ptr)
            .flags(flags)
            .build(),
    })
}

fn total(parts: &[(*const u8, usize)]) -> usize {
    parts.iter().map(|p| p.1).sum()
}

/// A socket operation of `c`'s front step completed with `res`: counts its bytes, pops the step
/// once it is done (a header starts the next request).
fn on_complete(c: &mut Conn, res: i32) -> io::Result<()> {
    if res == -libc::EINTR || res == -libc::EAGAIN {
        return Ok(());
    }
    if res < 0 {
        return Err(io::Error::from_raw_os_error(-res));
    }
    let n = res as usize;
    let eof = |what: &str| io::Error::new(io::ErrorKind::UnexpectedEof, what.to_string());
    let finished = match c.steps.front_mut() {
        Some(Step::Send { parts, done, .. }) => {
            if n == 0 {
                return Err(io::Error::new(
                    io::ErrorKind::WriteZero,
                    "send took nothing",
                ));
            }
            *done += n;
            *done >= total(parts)
        }
        Some(Step::SendZc {
            head,
            head_done,
            len,
            done,
            ..
        }) => {
            if n == 0 {
                return Err(io::Error::new(
                    io::ErrorKind::WriteZero,
                    "send took nothing",
                ));
            }
            if *head_done < head.len() {
                *head_done += n;
            } else {
                *done += n;
            }
            *head_done >= head.len() && *done >= *len
        }
        Some(Step::Recv { parts, done, .. }) => {
            if n == 0 {
                return Err(eof("peer closed the stream in a payload"));
            }
            let all = total(parts);
            received(done, all, &mut c.head_got, n);
            *done >= all
        }
        Some(Step::Discard { left, .. }) => {
            if n == 0 {
                return Err(eof("peer closed the stream in a refused payload"));
            }
            *left = left.saturating_sub(n as u64);
            *left == 0
        }
        Some(Step::Head { buf, got }) => {
            if n == 0 && *got == 0 {
                // A clean end between requests.
                c.steps.clear();
                c.steps.push_back(Step::Close);
                return Ok(());
            }
            if n == 0 {
                return Err(eof("peer closed the stream in a request header"));
            }
            *got += n;
            if *got >= DATA_REQUEST_LEN {
                c.head = **buf;
                c.ready = true;
                true
            } else {
                false
            }
        }
        Some(Step::Table { bytes, got, .. }) => {
            if n == 0 {
                return Err(eof("peer closed the stream in a piece table"));
            }
            *got += n;
            *got >= bytes.len()
        }
        _ => return Err(io::Error::other("a completion for a step without one")),
    };
    if finished {
        // Done: off the queue (a piece table then queues its pieces).
        let step = c.steps.pop_front();
        if let Some(Step::Table { req, bytes, .. }) = step {
            plan_table(c, &req, &bytes);
        }
    }
    Ok(())
}

/// Queues what request `head` asks (as the stream protocol decides).
fn plan(c: &mut Conn, ctx: &Ctx, head: &[u8; DATA_REQUEST_LEN]) {
    let action = c.proto.on_request(head);
    // Only an accepted WRITE to memory may join the held-back responses; any other answer must
    // not overtake them.
    if !action.joins_held()
        && let Some(r) = c.proto.flush()
    {
        c.steps.push_back(Step::send_owned(r.to_vec()));
    }
    match action {
        Action::WriteMemory {
            lease,
            token,
            at,
            len,
            seq,
            ack_slack,
        } => {
            let ptr = (lease.region.as_ptr() as usize + at as usize) as *const u8;
            if len > 0 {
                c.steps.push_back(Step::Recv {
                    parts: vec![(ptr, len)],
                    done: 0,
                    head_too: true,
                    _keep: Keep {
                        _lease: Some(lease.clone()),
                        ..Keep::default()
                    },
                });
            }
            c.steps.push_back(Step::Answer {
                lease,
                token,
                seq,
                ack_slack,
            });
        }
        Action::ReadMemory {
            lease,
            at,
            len,
            response,
        } => {
            if c.zero_copy && len > 0 {
                c.steps.push_back(Step::SendZc {
                    head: response.to_vec(),
                    head_done: 0,
                    lease,
                    at,
                    len,
                    done: 0,
                });
                return;
            }
            let bytes = response.to_vec();
            let mut parts = vec![(bytes.as_ptr(), bytes.len())];
            if len > 0 {
                parts.push((
                    (lease.region.as_ptr() as usize + at as usize) as *const u8,
                    len,
                ));
            }
            IoStats::add(&ctx.stats.copy_sends, 1);
            c.steps.push_back(Step::Send {
                parts,
                done: 0,
                _keep: Keep {
                    _bytes: bytes,
                    _lease: Some(lease),
                    ..Keep::default()
                },
            });
        }
        Action::ReadFile {
            file,
            at,
            len,
            response,
        } => {
            let f = Arc::new(FileIo::new(file));
            if len == 0 {
                c.steps.push_back(Step::send_owned(response.to_vec()));
            }
            let mut done = 0usize;
            let mut first = true;
            while done < len {
                let n = FILE_PIECE.min(len - done);
                let Some(stage) = stage_for(c, n) else {
                    return;
                };
                c.steps.push_back(Step::FileRead {
                    file: f.clone(),
                    at: at + done as u64,
                    len: n,
                    stage: stage.clone(),
                });
                let bytes = if first { response.to_vec() } else { Vec::new() };
                first = false;
                let mut parts = Vec::with_capacity(2);
                if !bytes.is_empty() {
                    parts.push((bytes.as_ptr(), bytes.len()));
                }
                parts.push((stage.as_ptr() as *const u8, n));
                c.steps.push_back(Step::Send {
                    parts,
                    done: 0,
                    _keep: Keep {
                        _bytes: bytes,
                        _region: Some(stage),
                        ..Keep::default()
                    },
                });
                done += n;
            }
        }
        Action::WriteFile {
            file,
            at,
            len,
            response,
        } => {
            let f = Arc::new(FileIo::new(file));
            let mut done = 0usize;
            while done < len {
                let n = FILE_PIECE.min(len - done);
                let Some(stage) = stage_for(c, n) else {
                    return;
                };
                c.steps.push_back(Step::Recv {
                    parts: vec![(stage.as_ptr() as *const u8, n)],
                    done: 0,
                    head_too: false,
                    _keep: Keep {
                        _region: Some(stage.clone()),
                        ..Keep::default()
                    },
                });
                c.steps.push_back(Step::FileWrite {
                    file: f.clone(),
                    at: at + done as u64,
                    len: n,
                    stage,
                });
                done += n;
            }
            c.steps.push_back(Step::send_owned(response.to_vec()));
        }
        Action::Refuse {
            kind,
            token,
            status,
            discard,
            response,
        } => {
            debug!(from = %c.from, %token, %kind, %status, "refused chunk");
            if discard > 0 {
                c.steps.push_back(Step::Discard {
                    left: discard,
                    buf: vec![0u8; DISCARD_BUF].into_boxed_slice(),
                });
            }
            c.steps.push_back(Step::send_owned(response.to_vec()));
        }
        Action::ChecksumMemory { lease, sum, seq } => {
            c.steps.push_back(Step::Crc {
                sum,
                seq,
                _lease: lease,
            });
        }
        Action::ChecksumFile { file, at, len, seq } => {
            c.steps.push_back(Step::CrcFile {
                sum: FileCrc::new(file, at, len),
                seq,
            });
        }
        Action::Close { error, response } => {
            warn!(from = %c.from, %error, "malformed data request; closing stream");
            c.steps.push_back(Step::send_owned(response.to_vec()));
            c.steps.push_back(Step::Close);
        }
        Action::Table { req } => {
            c.steps.push_back(Step::Table {
                req,
                bytes: vec![0u8; req.table_len()],
                got: 0,
            });
        }
        Action::Vectored { .. } => {
            warn!(from = %c.from, "a vectored action without its table; closing stream");
            c.steps.push_back(Step::Close);
        }
    }
}

/// The stream's staging buffer for a file piece of `n` bytes (`None`: it cannot be had; the
/// stream is closed).
fn stage_for(c: &mut Conn, n: usize) -> Option<Arc<MemoryRegion>> {
    match c.stage.get(n) {
        Ok(r) => Some(r.clone()),
        Err(e) => {
            warn!(from = %c.from, error = %e, "no staging buffer; closing stream");
            c.steps.push_back(Step::Close);
            None
        }
    }
}

/// Queues a vectored request's pieces, its piece table received (runs of memory pieces as one
/// vectored receive or send, file pieces through the staging buffer).
fn plan_table(c: &mut Conn, req: &VectoredRequest, bytes: &[u8]) {
    let (kind, targets, discard, response) = match c.proto.on_table(req, bytes) {
        Action::Vectored {
            kind,
            targets,
            discard,
            response,
        } => (kind, Arc::new(targets), discard, response),
        Action::Close { error, response } => {
            warn!(from = %c.from, %error, "malformed piece table; closing stream");
            c.steps.push_front(Step::Close);
            c.steps.push_front(Step::send_owned(response.to_vec()));
            return;
        }
        other => {
            warn!(from = %c.from, ?other, "unexpected answer to a piece table; closing stream");
            c.steps.push_front(Step::Close);
            return;
        }
    };
    // Built apart, then put in front of whatever is queued (nothing: the table was the request's
    // last step).
    let mut steps = VecDeque::new();
    let keep = |bytes: Vec<u8>| Keep {
        _bytes: bytes,
        _targets: Some(targets.clone()),
        ..Keep::default()
    };
    let mut parts: Vec<(*const u8, usize)> = Vec::new();
    let mut head = if kind == OpKind::Write {
        Vec::new()
    } else {
        response.to_vec()
    };
    if !head.is_empty() {
        parts.push((head.as_ptr(), head.len()));
    }
    let flush =
        |steps: &mut VecDeque<Step>, parts: &mut Vec<(*const u8, usize)>, head: &mut Vec<u8>| {
            if parts.iter().all(|p| p.1 == 0) {
                parts.clear();
                return;
            }
            let p = std::mem::take(parts);
            let k = keep(std::mem::take(head));
            steps.push_back(if kind == OpKind::Write {
                Step::Recv {
                    parts: p,
                    done: 0,
                    head_too: false,
                    _keep: k,
                }
            } else {
                Step::Send {
                    parts: p,
                    done: 0,
                    _keep: k,
                }
            });
        };
    for t in targets.iter() {
        match t {
            Target::Memory { lease, at, len } => parts.push((
                (lease.region.as_ptr() as usize + *at as usize) as *const u8,
                *len,
            )),
            Target::File { file, at, len } => {
                flush(&mut steps, &mut parts, &mut head);
                let f = Arc::new(FileIo::Source(file.clone()));
                let mut off = 0usize;
                while off < *len {
                    let n = FILE_PIECE.min(len - off);
                    let Some(stage) = stage_for(c, n) else {
                        return;
                    };
                    let piece = vec![(stage.as_ptr() as *const u8, n)];
                    let k = Keep {
                        _region: Some(stage.clone()),
                        ..Keep::default()
                    };
                    let io = (f.clone(), *at + off as u64, n, stage);
                    if kind == OpKind::Write {
                        steps.push_back(Step::Recv {
                            parts: piece,
                            done: 0,
                            head_too: false,
                            _keep: k,
                        });
                        steps.push_back(Step::FileWrite {
                            file: io.0,
                            at: io.1,
                            len: io.2,
                            stage: io.3,
                        });
                    } else {
                        steps.push_back(Step::FileRead {
                            file: io.0,
                            at: io.1,
                            len: io.2,
                            stage: io.3,
                        });
                        steps.push_back(Step::Send {
                            parts: piece,
                            done: 0,
                            _keep: k,
                        });
                    }
                    off += n;
                }
            }
        }
    }
    flush(&mut steps, &mut parts, &mut head);
    if kind == OpKind::Write {
        if discard > 0 {
            steps.push_back(Step::Discard {
                left: discard,
                buf: vec![0u8; DISCARD_BUF].into_boxed_slice(),
            });
        }
        steps.push_back(Step::send_owned(response.to_vec()));
    }
    while let Some(s) = steps.pop_back() {
        c.steps.push_front(s);
    }
}

#[cfg(test)]
mod tests {
    use std::io::Read;
    use std::net::{TcpListener, TcpStream};
    use std::sync::{Arc, mpsc};

    use ferry_core::stream::ServerStream;

    use super::{Driver, NewStream, STEP_COST, Step, TURN_BUDGET};
    use crate::UringConfig;
    use crate::ring::IoStats;
    use super::{Ctx, Live};
    use crate::testing::{NoSegments, Responder};

    /// A connected loopback pair: (the ring's end, the peer's).
    fn pair() -> (TcpStream, TcpStream) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let peer = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (ours, _) = l.accept().unwrap();
        (ours, peer)
    }

    /// A stream with many steps that all complete at once (small sends the socket takes) has
    /// them spread over several turns: the stream after it is served in the first.
    #[test]
    fn one_stream_cannot_take_a_whole_turn() {
        if io_uring::IoUring::new(4).is_err() {
            ferry_tests::require_or_skip(ferry_tests::URING, "the kernel refuses io_uring rings");
            return;
        }
        let table = Arc::new(NoSegments);
        let ctx = Arc::new(Ctx::new(
            table.clone(),
            Responder::new(|| {}),
            UringConfig::default(),
            Arc::new(IoStats::default()),
            Arc::new(Live::default()),
        ));
        let (_tx, rx) = mpsc::channel();
        // SAFETY: plain eventfd creation; checked before use.
        let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC) };
        assert!(fd >= 0);
        // SAFETY: a fresh descriptor we now own.
        let wake =
            Arc::new(unsafe { <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) });
        let mut d = Driver::new(ctx, rx, wake, None).unwrap();
        let mut peers = Vec::new();
        for _ in 0..2 {
            let (ours, peer) = pair();
            let from = peer.local_addr().unwrap();
            d.add(NewStream {
                stream: ours,
                from,
                proto: ServerStream::new(table.clone()),
                accept: b"A".to_vec(),
            });
            peers.push(peer);
        }
        // Stream 0: twice its turn's budget of small sends, all of which the socket takes.
        let sends = 2 * TURN_BUDGET / STEP_COST;
        let piece = 1024;
        for k in 0..sends {
            let c = d.conns[0].as_mut().unwrap();
            c.steps.push_back(Step::send_owned(vec![k as u8; piece]));
        }
        d.run_streams().unwrap();
        let queued = |d: &Driver, i: usize| {
            d.conns[i]
                .as_ref()
                .unwrap()
                .steps
                .iter()
                .filter(|s| matches!(s, Step::Send { .. }))
                .count()
        };
        assert!(
            queued(&d, 0) > 0,
            "stream 0 sent all its {sends} sends in one turn"
        );
        assert_eq!(
            queued(&d, 1),
            0,
            "stream 1 was not served in the first turn"
        );
        // The rest goes in later turns, in order.
        for _ in 0..sends {
            if queued(&d, 0) == 0 {
                break;
            }
            d.run_streams().unwrap();
        }
        assert_eq!(queued(&d, 0), 0, "stream 0's sends never finished");
        let mut got = vec![0u8; 1 + sends * piece];
        peers[0].read_exact(&mut got).unwrap();
        assert_eq!(got[0], b'A');
        for (k, chunk) in got[1..].chunks(piece).enumerate() {
            assert!(chunk.iter().all(|&b| b == k as u8), "send {k} out of order");
        }
        let mut accept = [0u8; 1];
        peers[1].read_exact(&mut accept).unwrap();
        assert_eq!(&accept, b"A");
    }
}
