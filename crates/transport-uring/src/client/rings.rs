//! The client's event loop: a fixed set of rings ([`UringConfig::client_rings`], one per CPU by
//! default), each on one thread, drives every client stream of the transport; a stream costs
//! no thread.
//!
//! A stream is a state machine around [`ClientStream`](ferry_core::stream::ClientStream) with
//! two sides, each with at most one socket operation in flight: the send side takes the chunks
//! dealt to the stream (while fewer than `depth` are in flight) and writes each request, then its
//! WRITE payload, in order; the receive side keeps one receive armed, of the next response
//! header or of the payload a READ's response brings (straight into its chunk's memory). A send
//! or payload receive first moves what the socket takes or holds at once with one non-blocking
//! syscall; the rest goes through the ring (SENDMSG or RECVMSG with `MSG_WAITALL`, or with the
//! receive low mark raised for large payloads). Everything a ring's streams queued in one turn
//! goes to the kernel with one `io_uring_enter`.
//!
//! WRITE payloads to a peer the configuration sends zero-copy to go out with SEND_ZC (from a
//! registered buffer where the ring takes it), each send holding its request un-drained until the
//! kernel's notification, however the stream ends; a stream that ends with notifications
//! outstanding has its connection reset after [`FINISH_GRACE`](crate::FINISH_GRACE) so the
//! kernel lets go. To a loopback peer they go by `vmsplice` + `splice(2)` on the ring's thread,
//! with the socket made non-blocking for the call only (a full socket waits on a poll on the
//! ring, never in the call).
//!
//! A stream is woken (a chunk dealt to it, bytes a submitter left unsent) through its ring's
//! inbox ([`RingWake`]), which writes the ring's eventfd only while the ring's thread waits.
//!
//! [`UringConfig::client_rings`]: crate::UringConfig::client_rings

use std::collections::{HashMap, VecDeque};
use std::io;
use std::net::{SocketAddr, TcpStream};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Weak, mpsc};
use std::time::{Duration, Instant};

use ferry_core::queue::Next;
use ferry_core::stream::{Chunk, Outgoing, Post, Resolution};
use ferry_core::wire::DATA_RESPONSE_LEN;
use ferry_core::{FailureKind, MemoryRegion, OpKind};
use ferry_net::RECV_LOW_MARK as LOWAT;
use io_uring::{IoUring, cqueue, opcode, types};
use tracing::{debug, warn};

use super::state::{
    Queue, READ_TICK, Reader, ReqShared, RingInbox, RingWake, StreamShared, shutdown,
};
use crate::ring::user_data::{self, Decoded, MAX_SLOTS};
use crate::ring::{
    BufCache, IoStats, ThreadCount, iovecs_from, new_ring, push, spawn_ring, submit,
};

/// Submission entries per ring (more are submitted in several calls).
const SQ_ENTRIES: u32 = 256;
/// Completion entries per ring (the kernel keeps an overflow beyond them).
const CQ_ENTRIES: u32 = 4096;
/// Fixed-file slots per ring: streams past them use their plain descriptor.
const FIXED_FILES: u32 = 1 << 12;
/// What an operation's user data says it is (its kind in `ring::user_data`; a zero-copy send is
/// named by its key alone).
const K_RECV: u8 = 1;
const K_SEND: u8 = 2;
const K_POLL: u8 = 4;
const K_WAKE: u8 = 5;
const K_HANGUP: u8 = 6;

fn ud(kind: u8, slot: usize, generation: u32) -> u64 {
    user_data::op(kind, slot, generation)
}

/// The transport's settings a ring needs.
#[derive(Clone, Copy, Debug)]
pub(crate) struct RingPlan {
    /// Register buffers (for SEND_ZC) and sockets (fixed files) with the ring.
    pub(crate) register: bool,
    /// Some stream may send zero-copy: try registered buffers.
    pub(crate) zero_copy: bool,
    /// Ring `i` pins itself to the `i`-th CPU this process may run on when a stream that asks
    /// for it ([`NewStream::pin`]) is handed to it.
    pub(crate) pin: bool,
}

/// A stream handed to a ring.
pub(crate) struct NewStream {
    pub(crate) sh: Arc<StreamShared>,
    pub(crate) queue: Arc<Queue>,
    /// Its index in its channel (its place in `queue`).
    pub(crate) index: usize,
    pub(crate) peer: SocketAddr,
    /// WRITE payloads go out with SEND_ZC.
    pub(crate) zero_copy: bool,
    /// WRITE payloads go by vmsplice + splice (loopback peers).
    pub(crate) splice: bool,
    /// A task awaiting a small request it sent directly may read its response
    /// (`UringConfig::caller_receives`).
    pub(crate) caller_receives: bool,
    /// Stream `i` of a loopback channel of several streams, on ring `i`: the ring pins itself
    /// to the `i`-th CPU, where the server's ring `i` serving this stream runs too, so both ends
    /// of a flow share a core (a one-stream channel's ring is left to the scheduler).
    pub(crate) pin: bool,
}

#[derive(Debug)]
struct RingHandle {
    tx: mpsc::Sender<NewStream>,
    inbox: Arc<RingInbox>,
    stop: Arc<AtomicBool>,
}

/// A transport's client rings. Dropping it stops each ring once its streams ended.
#[derive(Debug)]
pub(crate) struct ClientRings {
    rings: Vec<RingHandle>,
    next: AtomicUsize,
    ids: AtomicU64,
}

impl ClientRings {
    /// Starts `n` rings (0: one per CPU this process may run on), each on its own thread.
    pub(crate) fn start(n: usize, plan: RingPlan, stats: &Arc<IoStats>) -> io::Result<Self> {
        let n = if n == 0 {
            std::thread::available_parallelism().map_or(1, |n| n.get())
        } else {
            n
        };
        let mut rings = Vec::with_capacity(n);
        for i in 0..n {
            let inbox = Arc::new(RingInbox::new()?);
            let stop = Arc::new(AtomicBool::new(false));
            let (tx, rx) = mpsc::channel();
            let (b, s, st) = (inbox.clone(), stop.clone(), stats.clone());
            spawn_ring(
                format!("ferry-uring-cr{i}"),
                None,
                move || Driver::new(plan, i, rx, b, s, st),
                |mut d| d.run(),
            )?;
            rings.push(RingHandle { tx, inbox, stop });
        }
        Ok(Self {
            rings,
            next: AtomicUsize::new(0),
            ids: AtomicU64::new(0),
        })
    }

    /// How many rings it runs.
    pub(crate) fn len(&self) -> usize {
        self.rings.len()
    }

    /// The ring for a channel's stream `index`: with `pin` (a loopback peer, several streams)
    /// ring `index` (modulo the rings), any other the next in turn.
    pub(crate) fn place(&self, index: usize, pin: bool) -> usize {
        let k = if pin {
            index
        } else {
            self.next.fetch_add(1, Ordering::Relaxed)
        };
        k % self.rings.len()
    }

    /// A wake-up for a new stream of ring `at`.
    pub(crate) fn wake_for(&self, at: usize) -> RingWake {
        RingWake {
            inbox: self.rings[at].inbox.clone(),
            id: self.ids.fetch_add(1, Ordering::Relaxed),
        }
    }

    /// Hands `stream` to ring `at` (whose wake-up its queue holds, from [`Self::wake_for`]).
    pub(crate) fn attach(&self, at: usize, stream: NewStream) -> io::Result<()> {
        let r = &self.rings[at];
        r.tx.send(stream)
            .map_err(|_| io::Error::other("the client ring has stopped"))?;
        r.inbox.fd.wake_now();
        Ok(())
    }
}

impl Drop for ClientRings {
    fn drop(&mut self) {
        for r in &self.rings {
            r.stop.store(true, Ordering::Release);
            r.inbox.fd.wake_now();
        }
    }
}

/// What keeps the memory a send points at alive until it completed.
enum Keep {
    /// A request the stream posted (header, piece table, the regions of its payload), and
    /// bytes a submitter left unsent before it, if any.
    Posted(
        #[allow(dead_code)] Box<Outgoing<ReqShared>>,
        #[allow(dead_code)] Option<Vec<u8>>,
    ),
    /// Bytes a submitter's send left over.
    Bytes(#[allow(dead_code)] Vec<u8>),
}

/// What follows a send's copied bytes.
enum Body {
    None,
    /// SEND_ZC of `len` bytes at `ptr` in `region`, `done` sent; each send holds the request
    /// un-drained until its notification.
    Zc {
        ptr: *const u8,
        len: usize,
        done: usize,
        region: Arc<MemoryRegion>,
        req: Arc<ReqShared>,
    },
    /// vmsplice + splice of `len` bytes at `ptr`: `done` moved to the socket, `piped` in the
    /// pipe and not yet moved.
    Splice {
        ptr: *const u8,
        len: usize,
        done: usize,
        piped: usize,
    },
}

/// One request (or a submitter's leftover bytes) being sent.
struct Out {
    /// Copied bytes, back to back; `done` of them went.
    parts: Vec<(*const u8, usize)>,
    done: usize,
    total: usize,
    body: Body,
    _keep: Keep,
}

/// A response's payload being received.
enum Incoming {
    /// A READ's (or a checksum's) payload, into its chunk's memory.
    One {
        chunk: Chunk<ReqShared>,
        part: (*const u8, usize),
        done: usize,
    },
    /// A vectored READ's payload, into its pieces' memory in order.
    Pieces {
        pieces: Vec<Chunk<ReqShared>>,
        parts: Vec<(*const u8, usize)>,
        total: usize,
        done: usize,
    },
}

impl Incoming {
    fn parts(&self) -> (&[(*const u8, usize)], usize, usize) {
        match self {
            Incoming::One { part, done, .. } => (std::slice::from_ref(part), part.1, *done),
            Incoming::Pieces {
                parts, total, done, ..
            } => (parts, *total, *done),
        }
    }

    fn advance(&mut self, n: usize) {
        match self {
            Incoming::One { done, .. } | Incoming::Pieces { done, .. } => *done += n,
        }
    }

    fn acked(self) {
        match self {
            Incoming::One { chunk, .. } => chunk.acked(),
            Incoming::Pieces { pieces, .. } => pieces.into_iter().for_each(Chunk::acked),
        }
    }

    fn lost(self, native: Option<i32>) {
        match self {
            Incoming::One { chunk, .. } => chunk.lost(native),
            Incoming::Pieces { pieces, .. } => pieces.into_iter().for_each(|c| c.lost(native)),
        }
    }
}

/// Which send-side operation is in flight.
#[derive(Clone, Copy, PartialEq, Eq)]
enum SendOp {
    Copy,
    Zc,
    /// A poll for room in the socket (a splice that found it full).
    Room,
}

/// One client stream on a ring. Boxed: the ring's operations point into it.
struct Conn {
    id: u64,
    /// Its place on the ring (in its operations' user data).
    slot: usize,
    sh: Arc<StreamShared>,
    queue: Arc<Queue>,
    index: usize,
    peer: SocketAddr,
    fd: RawFd,
    /// Its fixed-file slot, if registered.
    fixed: Option<u32>,
    zero_copy: bool,
    splice: bool,
    /// See [`NewStream::caller_receives`]: while the stream is idle (or a direct reader reads)
    /// the ring keeps only a hang-up poll armed, no receive, and the response header's bytes
    /// live in the shared state (`resp`), `head` being only where a ring receive lands.
    caller_receives: bool,
    /// The hang-up poll is in flight.
    hangup_inflight: bool,
    /// The socket's file status flags (for the non-blocking splice).
    fl: i32,
    /// The channel still deals jobs.
    open: bool,
    /// The response header being received (`head_at` bytes of it).
    head: [u8; DATA_RESPONSE_LEN],
    head_at: usize,
    incoming: Option<Incoming>,
    recv_inflight: bool,
    /// The socket's `SO_RCVLOWAT` as last set (1: the kernel's default); 0: refused, none used.
    lowat: usize,
    riov: Vec<libc::iovec>,
    rmsg: libc::msghdr,
    out: Option<Out>,
    send_inflight: Option<SendOp>,
    siov: Vec<libc::iovec>,
    smsg: libc::msghdr,
    /// Pipe for spliced sends (read end, write end, capacity), made on first use.
    pipe: Option<(OwnedFd, OwnedFd, usize)>,
    generation: u32,
    /// Ending, with the native error that broke it (if any): waits for its operations in flight.
    ending: Option<Option<i32>>,
    stats: Arc<IoStats>,
}

impl Conn {
    fn busy(&self) -> bool {
        self.recv_inflight || self.send_inflight.is_some() || self.hangup_inflight
    }
}

macro_rules! on_fd {
    ($c:expr, $op:ident :: new ( $($arg:expr),* ) $(. $m:ident ( $($a:expr),* ))* ) => {
        match $c.fixed {
            Some(slot) => opcode::$op::new(types::Fixed(slot), $($arg),*) $(. $m($($a),*))* .build(),
            None => opcode::$op::new(types::Fd($c.fd), $($arg),*) $(. $m($($a),*))* .build(),
        }
    };
}

/// A zero-copy send the kernel has not let go of.
struct Zc {
    generation: u32,
    slot: usize,
    /// Keeps its request un-drained (and the region alive) until the notification.
    _hold: super::state::NotifHold,
    /// Its socket, to reset should the peer never acknowledge.
    socket: Arc<TcpStream>,
}

/// One ring and its thread's streams.
struct Driver {
    ring: IoUring,
    /// Its place in the set, and whether it may pin itself there ([`RingPlan::pin`]) and did.
    index: usize,
    pin: bool,
    pinned: bool,
    rx: mpsc::Receiver<NewStream>,
    inbox: Arc<RingInbox>,
    stop: Arc<AtomicBool>,
    wake_buf: Box<[u8; 8]>,
    wake_armed: bool,
    fixed_files: bool,
    conns: Vec<Option<Box<Conn>>>,
    generations: Vec<u32>,
    free: Vec<usize>,
    ids: HashMap<u64, usize>,
    runnable: VecDeque<usize>,
    woken: Vec<u64>,
    /// Completions of one reap (kept for its capacity).
    reaped: Vec<(u64, i32, u32)>,
    bufs: BufCache,
    zc: HashMap<u64, Zc>,
    zc_next: u64,
    /// Direct readers watched (stream name, reader token, seen at a tick before), and when the
    /// next tick is due; when the list was last not empty.
    watched: Vec<(u64, u64, bool)>,
    next_tick: Instant,
    /// When every stream last looked at its work (a safety net, once a second at most).
    last_sweep: Instant,
    last_watched: Instant,
    /// Ended streams' sockets with zero-copy sends outstanding: when to reset them, and whether
    /// they were.
    lingering: Vec<(Weak<TcpStream>, Instant, bool)>,
    stats: Arc<IoStats>,
    _count: ThreadCount,
}

impl Driver {
    fn new(
        plan: RingPlan,
        index: usize,
        rx: mpsc::Receiver<NewStream>,
        inbox: Arc<RingInbox>,
        stop: Arc<AtomicBool>,
        stats: Arc<IoStats>,
    ) -> io::Result<Self> {
        // Made and entered only by the ring's thread (no deferred task work runs while it is in
        // another system call, a splice say).
        let ring = new_ring(SQ_ENTRIES, CQ_ENTRIES)?;
        let fixed_files =
            plan.register && ring.submitter().register_files_sparse(FIXED_FILES).is_ok();
        let bufs = BufCache::new(&ring, plan.register && plan.zero_copy);
        // splice(2) has no MSG_NOSIGNAL: a peer gone mid-splice would raise SIGPIPE at the
        // process. The ring's thread blocks it (the splice reports EPIPE).
        // SAFETY: plain signal-mask calls on a local set, for the calling thread only.
        unsafe {
            let mut set: libc::sigset_t = std::mem::zeroed();
            libc::sigemptyset(&mut set);
            libc::sigaddset(&mut set, libc::SIGPIPE);
            libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
        }
        let count = ThreadCount::new(&stats);
        Ok(Self {
            ring,
            index,
            pin: plan.pin,
            pinned: false,
            rx,
            inbox,
            stop,
            wake_buf: Box::new([0; 8]),
            wake_armed: false,
            fixed_files,
            conns: Vec::new(),
            generations: Vec::new(),
            free: Vec::new(),
            ids: HashMap::new(),
            runnable: VecDeque::new(),
            woken: Vec::new(),
            reaped: Vec::new(),
            bufs,
            zc: HashMap::new(),
            zc_next: 0,
            watched: Vec::new(),
            next_tick: Instant::now(),
            last_sweep: Instant::now(),
            last_watched: Instant::now(),
            lingering: Vec::new(),
            stats,
            _count: count,
        })
    }

    fn run(&mut self) {
        if let Err(e) = self.turns() {
            warn!(error = %e, "a client ring failed; its streams end");
            for i in 0..self.conns.len() {
                self.end(i, e.raw_os_error().or(Some(libc::EIO)));
            }
            // Wait for what is in flight (each socket is shut down), as far as the ring lets us.
            let deadline = Instant::now() + crate::FINISH_GRACE;
            while self.conns.iter().flatten().any(|c| c.busy()) && Instant::now() < deadline {
                if self.wait(Some(Duration::from_millis(10))).is_err() {
                    break;
                }
                self.reap();
            }
            if self.conns.iter().flatten().any(|c| c.busy()) || self.wake_armed {
                // The kernel may still write into them: never free them.
                std::mem::forget(std::mem::take(&mut self.conns));
                std::mem::forget(std::mem::take(&mut self.wake_buf));
            }
            // Zero-copy sends the kernel did not let go of: their buffers stay alive for good.
            std::mem::forget(std::mem::take(&mut self.zc));
        }
    }

    /// Whether the ring may end: stopped, with no stream and no zero-copy send left.
    fn done(&self) -> bool {
        self.stop.load(Ordering::Acquire)
            && self.conns.iter().all(Option::is_none)
            && self.zc.is_empty()
    }

    fn turns(&mut self) -> io::Result<()> {
        loop {
            while let Ok(n) = self.rx.try_recv() {
                self.add(n);
            }
            self.inbox.take(&mut self.woken);
            for id in self.woken.drain(..) {
                if let Some(&i) = self.ids.get(&id) {
                    self.runnable.push_back(i);
                }
            }
            self.tick();
            while let Some(i) = self.runnable.pop_front() {
                self.advance(i);
            }
            self.linger();
            if self.done() {
                return self.drain_wake();
            }
            if !self.wake_armed {
                let e = opcode::Read::new(
                    types::Fd(self.inbox.fd.0.as_raw_fd()),
                    self.wake_buf.as_mut_ptr(),
                    8,
                )
                .build()
                .user_data(ud(K_WAKE, 0, 0));
                // SAFETY: the buffer is boxed in the driver, which outlives the read (the ring
                // waits for it before it ends, or leaks the buffer).
                unsafe { push(&mut self.ring, &e) }?;
                self.wake_armed = true;
            }
            // Wait, unless a wake-up came meanwhile (the inbox is looked at after the flag is
            // up, so a waker that saw it down left its stream there for this look).
            self.inbox.asleep.store(true, Ordering::SeqCst);
            let timed_out = if self.inbox.any() {
                self.inbox.asleep.store(false, Ordering::SeqCst);
                submit(&mut self.ring, false)?;
                false
            } else {
                let t = if self.inbox.ticking.load(Ordering::SeqCst) {
                    self.next_tick.saturating_duration_since(Instant::now())
                } else if self.lingering.is_empty() {
                    Duration::from_secs(1)
                } else {
                    Duration::from_millis(50)
                };
                let r = self.wait(Some(t));
                self.inbox.asleep.store(false, Ordering::SeqCst);
                r?
            };
            self.reap();
            if timed_out && self.last_sweep.elapsed() >= Duration::from_secs(1) {
                self.last_sweep = Instant::now();
                // A safety net: every stream looks at its work once a second when nothing else
                // woke the ring.
                let all = self
                    .conns
                    .iter()
                    .enumerate()
                    .filter_map(|(i, c)| c.as_ref().map(|_| i));
                self.runnable.extend(all);
            }
        }
    }

    /// Every [`READ_TICK`] while direct readers are about: a reader whose response has waited in
    /// the socket since the last tick or longer (its task is not polling) is relieved, the ring
    /// reading that response (so a request completes whether or not it is awaited). Ticks stop
    /// after a second without direct readers (the next one starts them again).
    fn tick(&mut self) {
        let now = Instant::now();
        let ticking = self.inbox.ticking.load(Ordering::SeqCst);
        if ticking && now < self.next_tick {
            return;
        }
        {
            let mut g = match self.inbox.watch.lock() {
                Ok(g) => g,
                Err(p) => p.into_inner(),
            };
            self.watched
                .extend(g.drain(..).map(|(id, token)| (id, token, false)));
        }
        if self.watched.is_empty() {
            if ticking && now.duration_since(self.last_watched) > Duration::from_secs(1) {
                self.inbox.ticking.store(false, Ordering::SeqCst);
                // A reader pushed before the flag went down was not woken for: look again.
                let more = match self.inbox.watch.lock() {
                    Ok(g) => !g.is_empty(),
                    Err(p) => !p.into_inner().is_empty(),
                };
                if more {
                    self.inbox.ticking.store(true, Ordering::SeqCst);
                }
            }
            self.next_tick = now + READ_TICK;
            return;
        }
        self.inbox.ticking.store(true, Ordering::SeqCst);
        self.last_watched = now;
        self.next_tick = now + READ_TICK;
        let mut watched = std::mem::take(&mut self.watched);
        watched.retain_mut(|(id, token, seen)| {
            let Some(&i) = self.ids.get(id) else {
                return false;
            };
            let Some(Some(c)) = self.conns.get_mut(i) else {
                return false;
            };
            let mut g = c.sh.lock();
            if g.reader != Reader::Caller(*token) {
                return false;
            }
            if !*seen {
                *seen = true;
                return true;
            }
            let mut b = [0u8; 1];
            // SAFETY: peeks at most one byte into a local buffer.
            let n = unsafe {
                libc::recv(
                    c.fd,
                    b.as_mut_ptr().cast(),
                    1,
                    libc::MSG_PEEK | libc::MSG_DONTWAIT,
                )
            };
            if n < 0 {
                // Nothing arrived yet: the reader waits for the peer, not the other way round.
                return true;
            }
            // The response (or the stream's end) waited a tick unread: the ring reads it.
            g.reader = Reader::Ring;
            drop(g);
            IoStats::add(&c.stats.caller_takeovers, 1);
            self.runnable.push_back(i);
            false
        });
        self.watched = watched;
    }

    /// Ends the eventfd's read before the ring goes (its buffer is the driver's).
    fn drain_wake(&mut self) -> io::Result<()> {
        while self.wake_armed {
            self.inbox.fd.wake_now();
            self.wait(Some(Duration::from_millis(100)))?;
            self.reap();
        }
        Ok(())
    }

    /// Submits what is queued and waits for a completion, or for `timeout`: whether it timed
    /// out.
    fn wait(&mut self, timeout: Option<Duration>) -> io::Result<bool> {
        let Some(t) = timeout.filter(|_| self.ring.params().is_feature_ext_arg()) else {
            submit(&mut self.ring, true)?;
            return Ok(false);
        };
        let ts = types::Timespec::new()
            .sec(t.as_secs())
            .nsec(t.subsec_nanos());
        let args = types::SubmitArgs::new().timespec(&ts);
        match self.ring.submitter().submit_with_args(1, &args) {
            Ok(_) => Ok(false),
            Err(e) if e.raw_os_error() == Some(libc::ETIME) => Ok(true),
            // Interrupted, a full completion queue or a transient shortage: reaping goes on.
            Err(e)
                if matches!(
                    e.raw_os_error(),
                    Some(libc::EINTR | libc::EBUSY | libc::EAGAIN)
                ) =>
            {
                Ok(false)
            }
            Err(e) => Err(e),
        }
    }

    /// Resets the connections of ended streams whose zero-copy sends the peer has not
    /// acknowledged within the grace (which purges the socket's queues, so the kernel lets go);
    /// forgets those with none left.
    fn linger(&mut self) {
        if self.lingering.is_empty() {
            return;
        }
        let now = Instant::now();
        let zc = &self.zc;
        self.lingering.retain_mut(|(weak, at, was_reset)| {
            let Some(socket) = weak.upgrade() else {
                return false;
            };
            let held = zc
                .values()
                .filter(|z| Arc::ptr_eq(&z.socket, &socket))
                .count();
            if held == 0 {
                return false;
            }
            if now >= *at {
                if *was_reset {
                    warn!(
                        pending = held,
                        "zero-copy sends still held by the kernel after the connection was \
                         reset; their requests stay un-drained until it lets go"
                    );
                } else {
                    debug!(
                        pending = held,
                        "zero-copy sends unacknowledged after the grace; resetting the connection"
                    );
                    if let Err(e) = reset(socket.as_raw_fd()) {
                        warn!(error = %e, "cannot reset the connection");
                    }
                    *was_reset = true;
                }
                *at = now + crate::FINISH_GRACE * 10;
            }
            true
        });
    }

    fn add(&mut self, n: NewStream) {
        if n.pin && self.pin && !self.pinned {
            crate::pin_stream_thread(self.index);
            self.pinned = true;
        }
        let id = match n.queue.taker(n.index).map(|t| t.waker()) {
            Some(w) => w.id,
            None => {
                warn!(peer = %n.peer, "a stream without a ring wake-up was handed to a ring");
                n.sh.dead.store(true, Ordering::Release);
                shutdown(&n.sh.socket);
                return;
            }
        };
        let i = match self.free.pop() {
            Some(i) => i,
            None if self.conns.len() < MAX_SLOTS => {
                self.conns.push(None);
                self.generations.push(0);
                self.conns.len() - 1
            }
            None => {
                warn!(peer = %n.peer, "a client ring is full; stream closed");
                n.sh.dead.store(true, Ordering::Release);
                shutdown(&n.sh.socket);
                return;
            }
        };
        self.generations[i] = user_data::next_generation(self.generations[i]);
        let fd = n.sh.socket.as_raw_fd();
        let fixed = (self.fixed_files && i < FIXED_FILES as usize)
            .then(|| {
                self.ring
                    .submitter()
                    .register_files_update(i as u32, &[fd])
                    .ok()
                    .map(|_| i as u32)
            })
            .flatten();
        // SAFETY: F_GETFL on the stream's socket, which `n.sh` keeps open.
        let fl = unsafe { libc::fcntl(fd, libc::F_GETFL) };
        self.conns[i] = Some(Box::new(Conn {
            id,
            slot: i,
            sh: n.sh,
            queue: n.queue,
            index: n.index,
            peer: n.peer,
            fd,
            fixed,
            zero_copy: n.zero_copy,
            splice: n.splice && fl >= 0,
            caller_receives: n.caller_receives,
            hangup_inflight: false,
            fl: fl.max(0),
            open: true,
            head: [0; DATA_RESPONSE_LEN],
            head_at: 0,
            incoming: None,
            recv_inflight: false,
            lowat: 1,
            riov: Vec::new(),
            // SAFETY: a zeroed msghdr is valid (no name, no iovecs, no control).
            rmsg: unsafe { std::mem::zeroed() },
            out: None,
            send_inflight: None,
            siov: Vec::new(),
            // SAFETY: as above.
            smsg: unsafe { std::mem::zeroed() },
            pipe: None,
            generation: self.generations[i],
            ending: None,
            stats: self.stats.clone(),
        }));
        self.ids.insert(id, i);
        self.runnable.push_back(i);
    }

    /// Stream `i` ends (with the native error that broke it, if any): its socket is shut down
    /// at once; once the kernel is done with its operations in flight (the shutdown ends them)
    /// what it had in flight fails and what was dealt to it goes to the channel's other streams.
    fn end(&mut self, i: usize, native: Option<i32>) {
        let Some(c) = self.conns.get_mut(i).and_then(|c| c.as_mut()) else {
            return;
        };
        if c.ending.is_none() {
            c.ending = Some(native);
            c.sh.dead.store(true, Ordering::Release);
            shutdown(&c.sh.socket);
        }
        if c.busy() {
            return;
        }
        let Some(mut c) = self.conns[i].take() else {
            return;
        };
        let native = c.ending.flatten();
        if let Some(inc) = c.incoming.take() {
            inc.lost(native);
        }
        c.out = None;
        {
            let mut g = c.sh.lock();
            if let Some((chunk, _)) = g.payload.take() {
                chunk.lost(native);
            }
            g.proto.fail_all(native);
        }
        // The other streams take what was dealt to this one; the last one to end fails it.
        for job in c.queue.leave(c.index) {
            job.not_posted(FailureKind::PeerLost);
        }
        if self
            .zc
            .values()
            .any(|z| z.slot == i && z.generation == c.generation)
        {
            self.lingering.push((
                Arc::downgrade(&c.sh.socket),
                Instant::now() + crate::FINISH_GRACE,
                false,
            ));
        }
        if let Some(slot) = c.fixed {
            let _ = self.ring.submitter().register_files_update(slot, &[-1]);
        }
        self.ids.remove(&c.id);
        self.free.push(i);
    }

    fn reap(&mut self) {
        let mut done = std::mem::take(&mut self.reaped);
        done.clear();
        done.extend(
            self.ring
                .completion()
                .map(|c| (c.user_data(), c.result(), c.flags())),
        );
        for &(u, res, flags) in &done {
            let (kind, slot, generation) = match user_data::decode(u) {
                Decoded::Op { kind: K_WAKE, .. } => {
                    self.wake_armed = false;
                    continue;
                }
                Decoded::Op {
                    kind: kind @ (K_RECV | K_SEND | K_POLL | K_HANGUP),
                    slot,
                    generation,
                } => (kind, slot, generation),
                Decoded::Op { .. } => continue,
                Decoded::Zc(key) => {
                    if cqueue::notif(flags) {
                        IoStats::add(&self.stats.notifications, 1);
                        self.zc.remove(&key);
                        continue;
                    }
                    let Some(z) = self.zc.get(&key) else {
                        continue;
                    };
                    let named = (K_SEND, z.slot, z.generation);
                    if !cqueue::more(flags) {
                        // No notification will come for this one.
                        self.zc.remove(&key);
                    }
                    named
                }
            };
            let Some(Some(c)) = self.conns.get_mut(slot) else {
                continue;
            };
            if c.generation != generation {
                continue;
            }
            let r = if kind == K_RECV {
                c.recv_inflight = false;
                if c.ending.is_some() {
                    Ok(())
                } else if c.caller_receives && c.incoming.is_none() {
                    on_received_shared(c, res)
                } else {
                    on_received(c, res)
                }
            } else if kind == K_HANGUP {
                c.hangup_inflight = false;
                if c.ending.is_some() {
                    Ok(())
                } else {
                    on_hangup(c)
                }
            } else {
                let op = c.send_inflight.take();
                if c.ending.is_some() {
                    Ok(())
                } else {
                    on_sent(c, op, res)
                }
            };
            match r {
                Ok(()) if c.ending.is_some() => self.end(slot, None),
                Ok(()) => self.runnable.push_back(slot),
                Err(native) => self.end(slot, native),
            }
        }
        self.reaped = done;
    }

    /// Runs stream `i`: its receive side, then its send side, until each waits on the socket
    /// (or, the send side, for work).
    fn advance(&mut self, i: usize) {
        let Some(Some(c)) = self.conns.get_mut(i) else {
            return;
        };
        if c.ending.is_some() {
            return self.end(i, None);
        }
        if let Some(t) = c.queue.taker(c.index) {
            t.rise();
        }
        let recv = if c.caller_receives {
            receive_shared
        } else {
            receive
        };
        let r = recv(&mut self.ring, c).and_then(|()| {
            let go = send(
                &mut self.ring,
                c,
                &mut self.bufs,
                &mut self.zc,
                &mut self.zc_next,
            )?;
            // A chunk taken from a direct reader's stream took the reading over.
            if go && c.caller_receives {
                recv(&mut self.ring, c)?;
            }
            Ok(go)
        });
        match r {
            Ok(true) => {}
            Ok(false) => self.end(i, None),
            Err(native) => self.end(i, native),
        }
    }
}

/// Keeps the receive side going: resolves what came, then arms the next receive (a header's
/// rest, or a payload's, after moving what the socket holds now). `Err`: the stream is broken
/// (with the native error, if any).
fn receive(ring: &mut IoUring, c: &mut Conn) -> Result<(), Option<i32>> {
    loop {
        if c.recv_inflight {
            return Ok(());
        }
        if c.incoming.is_none() {
            // The next header: the low mark must be back at 1 (a 16-byte header must wake us).
            if c.lowat > 1 {
                set_lowat(c, 1).map_err(|e| e.raw_os_error())?;
            }
            // With responses still due, the next one is often in the socket already.
            let due = c.head_at > 0 || c.sh.lock().proto.in_flight() > 0;
            if due {
                let at = c.head_at;
                // SAFETY: receives at most the header's missing bytes into the stream's own
                // header buffer.
                let n = unsafe {
                    libc::recv(
                        c.fd,
                        c.head.as_mut_ptr().add(at).cast(),
                        DATA_RESPONSE_LEN - at,
                        libc::MSG_DONTWAIT,
                    )
                };
                match received(n) {
                    Ok(Some(n)) => {
                        on_header_bytes(c, n)?;
                        continue;
                    }
                    Ok(None) => {}
                    Err(native) => return Err(native),
                }
            }
            let at = c.head_at;
            let e = on_fd!(
                c,
                Recv::new(
                    // SAFETY: `at < DATA_RESPONSE_LEN`, inside the header buffer.
                    unsafe { c.head.as_mut_ptr().add(at) },
                    (DATA_RESPONSE_LEN - at) as u32
                )
                .flags(libc::MSG_WAITALL)
            )
            .user_data(ud(K_RECV, c.slot, c.generation));
            // SAFETY: the header buffer lives in the boxed `Conn`, freed only once no receive
            // is in flight.
            unsafe { push(ring, &e) }.map_err(|e| e.raw_os_error())?;
            c.recv_inflight = true;
            return Ok(());
        }
        receive_payload(ring, c)?;
    }
}

/// Moves the payload being received (`c.incoming`) on: acknowledges it once whole; else what
/// the socket holds at the payload's start moves with one call, and the rest through a ring
/// receive (armed; `recv_inflight`).
fn receive_payload(ring: &mut IoUring, c: &mut Conn) -> Result<(), Option<i32>> {
    loop {
        if c.recv_inflight {
            return Ok(());
        }
        let Some(inc) = c.incoming.as_mut() else {
            return Ok(());
        };
        let (parts, total, done) = inc.parts();
        if done >= total {
            if let Some(inc) = c.incoming.take() {
                inc.acked();
            }
            return Ok(());
        }
        iovecs_from(parts, done, &mut c.riov);
        c.rmsg.msg_iov = c.riov.as_mut_ptr();
        c.rmsg.msg_iovlen = c.riov.len() as _;
        if done == 0 {
            // What the socket holds when the payload starts moves with one call; after a ring
            // receive the socket holds less than the mark, so the ring waits for the rest.
            // SAFETY: the iovecs cover the chunks' checked local ranges, which their requests
            // own until drained (the chunks keep the regions alive) and nothing else touches
            // meanwhile.
            let n = unsafe { libc::recvmsg(c.fd, &mut c.rmsg, libc::MSG_DONTWAIT) };
            match received(n) {
                Ok(Some(n)) => {
                    inc.advance(n);
                    continue;
                }
                Ok(None) => {}
                Err(native) => return Err(native),
            }
        }
        // The rest through the ring: with the low mark raised for a large payload (one wake-up
        // per mark, not per segment) the receive completes with what is there.
        let rest = total - done;
        let mut flags = libc::MSG_WAITALL;
        if total > LOWAT && c.lowat != 0 && set_lowat(c, rest.min(LOWAT)).is_ok() {
            flags = 0;
        }
        let msg: *mut libc::msghdr = &mut c.rmsg;
        let e = on_fd!(c, RecvMsg::new(msg).flags(flags as u32)).user_data(ud(
            K_RECV,
            c.slot,
            c.generation,
        ));
        // SAFETY: the message and iovecs live in the boxed `Conn`; the ranges as above.
        unsafe { push(ring, &e) }.map_err(|e| e.raw_os_error())?;
        c.recv_inflight = true;
        return Ok(());
    }
}

/// The receive side with `caller_receives`: who reads is in the shared state (the ring, or a
/// task awaiting the one request it sent directly). While a direct reader reads, the ring
/// arms nothing; while the stream is idle, only a hang-up poll (arriving bytes do not end it),
/// so a response to a direct send wakes no ring. Otherwise it finishes a payload a direct
/// reader left, then receives the header's rest (its bytes kept in the shared state).
fn receive_shared(ring: &mut IoUring, c: &mut Conn) -> Result<(), Option<i32>> {
    loop {
        if c.recv_inflight {
            return Ok(());
        }
        if c.incoming.is_some() {
            // A payload the ring receives, as without direct readers; meanwhile no submitter
            // may make itself a reader (the chunk is no longer in flight).
            c.sh.lock().recv_armed = true;
            receive_payload(ring, c)?;
            if c.incoming.is_some() || c.recv_inflight {
                return Ok(());
            }
            continue;
        }
        let mut g = c.sh.lock();
        if g.reader != Reader::Ring {
            // A direct reader meets the stream's end itself and hands the reading back.
            return Ok(());
        }
        if let Some((chunk, done)) = g.payload.take() {
            drop(g);
            let len = chunk.payload_len() as usize;
            let ptr = (chunk.op().local.as_ptr() as usize + chunk.local_at() as usize) as *const u8;
            c.incoming = Some(Incoming::One {
                chunk,
                part: (ptr, len),
                done,
            });
            continue;
        }
        if g.proto.in_flight() == 0 && g.resp_at == 0 {
            g.recv_armed = false;
            drop(g);
            if c.hangup_inflight {
                return Ok(());
            }
            let mask = (libc::POLLRDHUP | libc::POLLHUP | libc::POLLERR) as u32;
            let e = on_fd!(c, PollAdd::new(mask)).user_data(ud(K_HANGUP, c.slot, c.generation));
            // SAFETY: a poll carries no buffer.
            unsafe { push(ring, &e) }.map_err(|e| e.raw_os_error())?;
            c.hangup_inflight = true;
            return Ok(());
        }
        // The header's rest lands in `head` and is moved to the shared state when it comes.
        let want = DATA_RESPONSE_LEN - g.resp_at;
        g.recv_armed = true;
        drop(g);
        if c.lowat > 1 {
            set_lowat(c, 1).map_err(|e| e.raw_os_error())?;
        }
        let e = on_fd!(
            c,
            Recv::new(c.head.as_mut_ptr(), want as u32).flags(libc::MSG_WAITALL)
        )
        .user_data(ud(K_RECV, c.slot, c.generation));
        // SAFETY: the header buffer lives in the boxed `Conn`, freed only once no receive is
        // in flight.
        unsafe { push(ring, &e) }.map_err(|e| e.raw_os_error())?;
        c.recv_inflight = true;
        return Ok(());
    }
}

/// A header receive of [`receive_shared`] completed with `res`: its bytes join the shared
/// header; a whole one is resolved under the same lock.
fn on_received_shared(c: &mut Conn, res: i32) -> Result<(), Option<i32>> {
    let mut g = c.sh.lock();
    // Until the ring arms its next receive, no receive of its is pending, unless a payload
    // follows this header (below): then no submitter may make itself a reader meanwhile.
    g.recv_armed = false;
    let Some(n) = receive_result(c, res)? else {
        return Ok(());
    };
    let at = g.resp_at;
    let n = n.min(DATA_RESPONSE_LEN - at);
    g.resp[at..at + n].copy_from_slice(&c.head[..n]);
    g.resp_at += n;
    if g.resp_at < DATA_RESPONSE_LEN {
        return Ok(());
    }
    g.resp_at = 0;
    let head = g.resp;
    let resolved = g.proto.on_response(&head);
    g.recv_armed = match &resolved {
        Ok(Resolution::Payload(chunk)) => chunk.payload_len() > 0,
        Ok(Resolution::Pieces(_)) => true,
        _ => false,
    };
    drop(g);
    resolve(c, resolved)
}

/// The hang-up poll ended: with nothing due and the ring the reader, the peer closed an idle
/// stream (anything else is met by whoever reads).
fn on_hangup(c: &mut Conn) -> Result<(), Option<i32>> {
    let g = c.sh.lock();
    if g.reader == Reader::Ring
        && g.proto.in_flight() == 0
        && g.resp_at == 0
        && g.payload.is_none()
        && c.incoming.is_none()
    {
        debug!(peer = %c.peer, stream = c.index, "peer closed the stream");
        return Err(None);
    }
    Ok(())
}

/// What a non-blocking call's return value means: bytes moved (`Some`), nothing now (`None`),
/// or a broken stream (0 bytes from a receive: the peer closed it).
fn received(n: isize) -> Result<Option<usize>, Option<i32>> {
    if n > 0 {
        return Ok(Some(n as usize));
    }
    if n == 0 {
        return Err(None);
    }
    let e = io::Error::last_os_error();
    match e.raw_os_error() {
        Some(libc::EAGAIN | libc::EINTR) => Ok(None),
        native => Err(native),
    }
}

/// `n` more bytes of the response header came: once it is whole, the stream protocol resolves
/// it (a payload to receive next, or nothing).
fn on_header_bytes(c: &mut Conn, n: usize) -> Result<(), Option<i32>> {
    c.head_at += n;
    if c.head_at < DATA_RESPONSE_LEN {
        return Ok(());
    }
    c.head_at = 0;
    let head = c.head;
    let resolved = c.sh.lock().proto.on_response(&head);
    resolve(c, resolved)
}

/// What the stream protocol made of a whole response header: a payload to receive next, or
/// nothing. `Err`: the response broke the protocol.
fn resolve(
    c: &mut Conn,
    resolved: Result<Resolution<ReqShared>, ferry_core::stream::Violation>,
) -> Result<(), Option<i32>> {
    match resolved {
        Ok(Resolution::Done) => Ok(()),
        Ok(Resolution::Payload(chunk)) => {
            let len = chunk.payload_len() as usize;
            if len == 0 {
                chunk.acked();
                return Ok(());
            }
            let ptr = (chunk.op().local.as_ptr() as usize + chunk.local_at() as usize) as *const u8;
            c.incoming = Some(Incoming::One {
                chunk,
                part: (ptr, len),
                done: 0,
            });
            Ok(())
        }
        Ok(Resolution::Pieces(pieces)) => {
            let parts: Vec<(*const u8, usize)> = pieces
                .iter()
                .map(|p| {
                    (
                        (p.op().local.as_ptr() as usize + p.local_at() as usize) as *const u8,
                        p.payload_len() as usize,
                    )
                })
                .collect();
            let total = parts.iter().map(|p| p.1).sum();
            c.incoming = Some(Incoming::Pieces {
                pieces,
                parts,
                total,
                done: 0,
            });
            Ok(())
        }
        Err(v) => {
            debug!(peer = %c.peer, stream = c.index, error = %v, "bad response; stream closed");
            Err(None)
        }
    }
}

/// What a receive's completion `res` means: bytes received, nothing (interrupted: the
/// receive is armed again), or a broken stream (the peer closed it, or an error).
fn receive_result(c: &Conn, res: i32) -> Result<Option<usize>, Option<i32>> {
    if res == -libc::EINTR || res == -libc::EAGAIN {
        return Ok(None);
    }
    if res < 0 {
        debug!(peer = %c.peer, stream = c.index, error = %io::Error::from_raw_os_error(-res), "receive failed; stream closed");
        return Err(Some(-res));
    }
    if res == 0 {
        debug!(peer = %c.peer, stream = c.index, "peer closed the stream");
        return Err(None);
    }
    Ok(Some(res as usize))
}

/// A receive completed with `res`.
fn on_received(c: &mut Conn, res: i32) -> Result<(), Option<i32>> {
    let Some(n) = receive_result(c, res)? else {
        return Ok(());
    };
    match c.incoming.as_mut() {
        Some(inc) => {
            inc.advance(n);
            Ok(())
        }
        None => on_header_bytes(c, n),
    }
}

/// Keeps the send side going: finishes the send under way, then what a submitter left unsent,
/// then new chunks while fewer than `depth` are in flight. `Ok(false)`: the stream is over (the
/// channel is gone and nothing is left to do); `Err`: broken.
fn send(
    ring: &mut IoUring,
    c: &mut Conn,
    bufs: &mut BufCache,
    zc: &mut HashMap<u64, Zc>,
    zc_next: &mut u64,
) -> Result<bool, Option<i32>> {
    loop {
        if c.send_inflight.is_some() {
            return Ok(true);
        }
        if c.out.is_some() {
            if !push_out(ring, c, bufs, zc, zc_next)? {
                return Ok(true);
            }
            c.out = None;
        }
        // What a submitter left unsent goes out before anything else; the send side is claimed
        // (`busy`) before the look, so that a submitter cannot send past a chunk taken here.
        let (room, in_flight) = {
            let mut g = c.sh.lock();
            if !g.tail.is_empty() {
                g.busy = true;
                let tail = std::mem::take(&mut g.tail);
                drop(g);
                let parts = vec![(tail.as_ptr(), tail.len())];
                c.out = Some(Out {
                    total: tail.len(),
                    parts,
                    done: 0,
                    body: Body::None,
                    _keep: Keep::Bytes(tail),
                });
                continue;
            }
            let room = c.open && g.proto.has_room();
            g.busy = room;
            (room, g.proto.in_flight())
        };
        let mut job = None;
        if room {
            // Nothing found: the wait stays announced, so a job dealt after the last look wakes
            // the stream through its ring.
            match c.queue.next_or_wait(c.index, in_flight == 0) {
                Next::Job(j) => job = Some(j),
                Next::Closed => c.open = false,
                Next::Empty => {}
            }
        }
        let Some(job) = job else {
            let over = {
                let mut g = c.sh.lock();
                g.busy = false;
                !c.open
                    && g.proto.in_flight() == 0
                    && g.tail.is_empty()
                    && g.resp_at == 0
                    && g.payload.is_none()
            };
            if over && c.head_at == 0 && c.incoming.is_none() {
                if let Some(t) = c.queue.taker(c.index) {
                    t.rise();
                }
                return Ok(false);
            }
            return Ok(true);
        };
        if let Some(t) = c.queue.taker(c.index) {
            t.rise();
        }
        if c.sh.dead.load(Ordering::Acquire) {
            job.not_posted(FailureKind::PeerLost);
            continue;
        }
        if c.caller_receives {
            // This chunk's response follows any a direct reader awaits: the ring reads both.
            let took = {
                let mut g = c.sh.lock();
                let took = g.reader != Reader::Ring;
                g.reader = Reader::Ring;
                took
            };
            if took {
                IoStats::add(&c.stats.caller_handbacks, 1);
            }
        }
        let (posted, tail) = {
            let mut g = c.sh.lock();
            (g.proto.post(job), std::mem::take(&mut g.tail))
        };
        let out = match posted {
            Post::Send(out) => Box::new(out),
            Post::Resolved => continue,
            Post::Broken(job) => {
                job.not_posted(FailureKind::PeerLost);
                continue;
            }
        };
        c.out = Some(plan_out(c, out, tail));
    }
}

/// How one posted request goes out: its header (and piece table) copied, then its WRITE
/// payload copied, by SEND_ZC or spliced. `tail`: a submitter's leftover bytes, which precede
/// it on the wire.
fn plan_out(c: &Conn, out: Box<Outgoing<ReqShared>>, tail: Vec<u8>) -> Out {
    let mut parts: Vec<(*const u8, usize)> = Vec::with_capacity(3);
    // Leftover bytes of a submitter (rare: a direct send past a chunk taken here cannot
    // happen, but a tail left before is sent first) go first; kept with the request.
    let mut keep_tail = None;
    if !tail.is_empty() {
        parts.push((tail.as_ptr(), tail.len()));
        keep_tail = Some(tail);
    }
    parts.push((out.head.as_ptr(), out.head.len()));
    let is_write = out.kind == OpKind::Write;
    let at = (out.region.as_ptr() as usize + out.local_at as usize) as *const u8;
    let body = if !out.scatter.is_empty() {
        parts.push((out.table.as_ptr(), out.table.len()));
        if is_write {
            parts.extend(out.scatter.iter().map(|r| {
                (
                    (r.region.as_ptr() as usize + r.at as usize) as *const u8,
                    r.len,
                )
            }));
        }
        Body::None
    } else if !is_write || out.len == 0 {
        Body::None
    } else if c.splice {
        Body::Splice {
            ptr: at,
            len: out.len,
            done: 0,
            piped: 0,
        }
    } else if c.zero_copy {
        Body::Zc {
            ptr: at,
            len: out.len,
            done: 0,
            region: out.region.clone(),
            req: out.req.clone(),
        }
    } else {
        parts.push((at, out.len));
        Body::None
    };
    if is_write && matches!(body, Body::None) && out.len > 0 {
        IoStats::add(&c.stats.copy_sends, 1);
    }
    let total = parts.iter().map(|p| p.1).sum();
    Out {
        parts,
        done: 0,
        total,
        body,
        _keep: Keep::Posted(out, keep_tail),
    }
}

/// Moves `c.out` on: its copied bytes (what the socket takes now with one call, the rest by a
/// SENDMSG on the ring), then its body. `Ok(true)`: all of it went; `Ok(false)`: an operation
/// is in flight.
fn push_out(
    ring: &mut IoUring,
    c: &mut Conn,
    bufs: &mut BufCache,
    zc: &mut HashMap<u64, Zc>,
    zc_next: &mut u64,
) -> Result<bool, Option<i32>> {
    let fail = |c: &Conn, e: io::Error| {
        debug!(peer = %c.peer, stream = c.index, error = %e, "send failed; stream closed");
        e.raw_os_error()
    };
    loop {
        let Some(out) = c.out.as_mut() else {
            return Ok(true);
        };
        if out.done < out.total {
            let more = if matches!(out.body, Body::None) {
                0
            } else {
                libc::MSG_MORE
            };
            iovecs_from(&out.parts, out.done, &mut c.siov);
            c.smsg.msg_iov = c.siov.as_mut_ptr();
            c.smsg.msg_iovlen = c.siov.len() as _;
            // SAFETY: the iovecs cover the request's header and table (in its boxed
            // `Outgoing`) and checked ranges of the regions it keeps alive, or leftover bytes
            // the send owns; the call keeps none of them past its return.
            let n = unsafe {
                libc::sendmsg(
                    c.fd,
                    &c.smsg,
                    libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL | more,
                )
            };
            if n > 0 {
                out.done += n as usize;
                continue;
            }
            let e = io::Error::last_os_error();
            if n == 0 || !matches!(e.raw_os_error(), Some(libc::EAGAIN | libc::EINTR)) {
                let e = if n == 0 {
                    io::Error::new(io::ErrorKind::WriteZero, "send took nothing")
                } else {
                    e
                };
                return Err(fail(c, e));
            }
            if e.raw_os_error() == Some(libc::EINTR) {
                continue;
            }
            // The rest through the ring, all of it before the completion.
            let flags = (libc::MSG_WAITALL | libc::MSG_NOSIGNAL | more) as u32;
            let msg: *const libc::msghdr = &c.smsg;
            let e = on_fd!(c, SendMsg::new(msg).flags(flags)).user_data(ud(
                K_SEND,
                c.slot,
                c.generation,
            ));
            // SAFETY: as for the call above; the send (and so its memory) is kept until the
            // completion was reaped.
            unsafe { push(ring, &e) }.map_err(|e| fail(c, e))?;
            c.send_inflight = Some(SendOp::Copy);
            return Ok(false);
        }
        match &mut out.body {
            Body::None => return Ok(true),
            Body::Zc {
                ptr,
                len,
                done,
                region,
                req,
            } => {
                if *done >= *len {
                    return Ok(true);
                }
                let n = (*len - *done).min(u32::MAX as usize & !4095) as u32;
                // SAFETY: `done < len`, inside the checked range.
                let at = unsafe { ptr.add(*done) };
                let index = bufs.index(ring, region, &c.stats);
                let key = *zc_next;
                *zc_next += 1;
                // The hold is in place before the send can complete, so the request cannot be
                // seen as drained in between.
                zc.insert(
                    key,
                    Zc {
                        generation: c.generation,
                        slot: c.slot,
                        _hold: super::state::NotifHold::new(req),
                        socket: c.sh.socket.clone(),
                    },
                );
                let e = on_fd!(
                    c,
                    SendZc::new(at, n)
                        .buf_index(index)
                        .flags(libc::MSG_WAITALL | libc::MSG_NOSIGNAL)
                )
                .user_data(user_data::zc(key));
                IoStats::add(&c.stats.zc_sends, 1);
                if index.is_some() {
                    IoStats::add(&c.stats.fixed_sends, 1);
                }
                // SAFETY: the range was checked against the region at post; the hold in `zc`
                // keeps the request, and so the region, alive until the kernel's notification.
                if let Err(e) = unsafe { push(ring, &e) } {
                    zc.remove(&key);
                    return Err(fail(c, e));
                }
                c.send_inflight = Some(SendOp::Zc);
                return Ok(false);
            }
            Body::Splice {
                ptr,
                len,
                done,
                piped,
            } => {
                let (ptr, len) = (*ptr, *len);
                let (mut d, mut p) = (*done, *piped);
                let r = splice_some(c, ptr, len, &mut d, &mut p);
                if let Some(Body::Splice { done, piped, .. }) = c.out.as_mut().map(|o| &mut o.body)
                {
                    (*done, *piped) = (d, p);
                }
                match r {
                    Ok(true) => return Ok(true),
                    Ok(false) => {
                        // The socket is full: wait for room on the ring.
                        let e = on_fd!(c, PollAdd::new(libc::POLLOUT as u32)).user_data(ud(
                            K_POLL,
                            c.slot,
                            c.generation,
                        ));
                        // SAFETY: a poll carries no buffer.
                        unsafe { push(ring, &e) }.map_err(|e| fail(c, e))?;
                        IoStats::add(&c.stats.room_waits, 1);
                        c.send_inflight = Some(SendOp::Room);
                        return Ok(false);
                    }
                    Err(e) => return Err(fail(c, e)),
                }
            }
        }
    }
}

/// Moves the body at `ptr` (`len` bytes, `done` of them in the socket, `piped` in the pipe) by
/// page reference: `vmsplice` into the stream's pipe, `splice` from it to the socket, with the
/// socket non-blocking for that call only (the ring's own operations on it must block). There
/// is no completion notification: the body must stay unmodified until the peer acknowledged it
/// (its response does). `Ok(true)`: all of it went; `Ok(false)`: the socket is full.
fn splice_some(
    c: &mut Conn,
    ptr: *const u8,
    len: usize,
    done: &mut usize,
    piped: &mut usize,
) -> io::Result<bool> {
    let (pr, pw, cap) = pipe(c)?;
    while *done < len {
        if *piped == 0 {
            let iov = libc::iovec {
                // SAFETY: `done < len`, inside the request's checked range.
                iov_base: unsafe { ptr.add(*done) } as *mut libc::c_void,
                iov_len: (len - *done).min(cap),
            };
            // SAFETY: the iovec points into the request's range, valid until its response;
            // vmsplice only takes page references.
            let n = unsafe { libc::vmsplice(pw, &iov, 1, 0) };
            if n < 0 {
                let e = io::Error::last_os_error();
                if e.kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(e);
            }
            *piped = n as usize;
        }
        let more = if *done + *piped < len {
            libc::SPLICE_F_MORE
        } else {
            0
        };
        // SAFETY: fcntl and splice on descriptors this stream keeps open (its socket, its
        // pipe); no user memory is passed.
        let res = unsafe {
            libc::fcntl(c.fd, libc::F_SETFL, c.fl | libc::O_NONBLOCK);
            let res = libc::splice(
                pr,
                std::ptr::null_mut(),
                c.fd,
                std::ptr::null_mut(),
                *piped,
                libc::SPLICE_F_MOVE | libc::SPLICE_F_NONBLOCK | more,
            );
            let e = io::Error::last_os_error();
            libc::fcntl(c.fd, libc::F_SETFL, c.fl);
            (res, e)
        };
        match res {
            (n, _) if n > 0 => {
                let n = n as usize;
                if n < *piped {
                    IoStats::add(&c.stats.short_sends, 1);
                }
                *done += n;
                *piped -= n;
                if *piped == 0 {
                    IoStats::add(&c.stats.spliced_sends, 1);
                }
            }
            (0, _) => {
                return Err(io::Error::new(
                    io::ErrorKind::WriteZero,
                    "splice moved nothing",
                ));
            }
            (_, e) if e.kind() == io::ErrorKind::Interrupted => {}
            (_, e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(false),
            (_, e) => return Err(e),
        }
    }
    Ok(true)
}

/// The stream's pipe for spliced sends (read end, write end, capacity), made on first use.
fn pipe(c: &mut Conn) -> io::Result<(RawFd, RawFd, usize)> {
    if c.pipe.is_none() {
        let mut fds = [0i32; 2];
        // SAFETY: `fds` has room for the two descriptors pipe2 writes.
        if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: pipe2 succeeded, so both are fresh descriptors we now own.
        let (r, w) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
        // SAFETY: F_SETPIPE_SZ on our own pipe; failure leaves the default size.
        let cap = unsafe { libc::fcntl(w.as_raw_fd(), libc::F_SETPIPE_SZ, 1 << 20) };
        let cap = if cap > 0 { cap as usize } else { 64 << 10 };
        c.pipe = Some((r, w, cap));
    }
    match &c.pipe {
        Some((r, w, cap)) => Ok((r.as_raw_fd(), w.as_raw_fd(), *cap)),
        None => Err(io::Error::other("pipe")),
    }
}

/// A send-side operation completed with `res`.
fn on_sent(c: &mut Conn, op: Option<SendOp>, res: i32) -> Result<(), Option<i32>> {
    let Some(op) = op else {
        return Ok(());
    };
    if op == SendOp::Room || res == -libc::EINTR || res == -libc::EAGAIN || res == -libc::ECANCELED
    {
        // Room in the socket (or nothing sent): the send goes on from where it was.
        return Ok(());
    }
    if res < 0 {
        let e = io::Error::from_raw_os_error(-res);
        debug!(peer = %c.peer, stream = c.index, error = %e, "send failed; stream closed");
        return Err(Some(-res));
    }
    let n = res as usize;
    let Some(out) = c.out.as_mut() else {
        return Ok(());
    };
    match op {
        SendOp::Copy => {
            let asked = out.total - out.done;
            if n < asked {
                IoStats::add(&c.stats.short_sends, 1);
            }
            out.done += n.min(asked);
        }
        SendOp::Zc => {
            if let Body::Zc { len, done, .. } = &mut out.body {
                if n < *len - *done {
                    IoStats::add(&c.stats.short_sends, 1);
                }
                *done += n.min(*len - *done);
            }
        }
        SendOp::Room => {}
    }
    Ok(())
}

/// Sets the socket's `SO_RCVLOWAT` to `v`. If the kernel refuses, marks are not used on this
/// socket again (`lowat` 0), and a raised one is brought back to 1 first.
fn set_lowat(c: &mut Conn, v: usize) -> io::Result<()> {
    if c.lowat == v {
        return Ok(());
    }
    // SAFETY: the descriptor of the stream's socket, which `c` keeps open.
    let fd = unsafe { std::os::fd::BorrowedFd::borrow_raw(c.fd) };
    match ferry_net::set_recv_low_mark(fd, v) {
        Ok(()) => {
            c.lowat = v;
            Ok(())
        }
        Err(e) => {
            debug!(error = %e, "SO_RCVLOWAT refused; receiving without it");
            if c.lowat > 1 {
                // Still raised: a header would wait for the old mark.
                ferry_net::set_recv_low_mark(fd, 1).map_err(|e2| {
                    io::Error::new(
                        e2.kind(),
                        format!("cannot lower the socket's SO_RCVLOWAT back to 1: {e2}"),
                    )
                })?;
            }
            c.lowat = 0;
            Err(e)
        }
    }
}

/// Aborts a connection: a reset to the peer, and the socket's send and retransmit queues purged
/// (`connect` to an `AF_UNSPEC` address, which Linux turns into `tcp_disconnect`).
fn reset(fd: RawFd) -> io::Result<()> {
    // SAFETY: a zeroed sockaddr is a valid AF_UNSPEC (0) address; connect only reads
    // `size_of::<sockaddr>()` bytes of it, and `fd` is a socket its caller keeps open.
    let rc = unsafe {
        let addr: libc::sockaddr = std::mem::zeroed();
        libc::connect(
            fd,
            &addr,
            std::mem::size_of::<libc::sockaddr>() as libc::socklen_t,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}
