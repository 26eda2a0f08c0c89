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
//! outstanding has its connection reset after [`FINISH_GRACE`](crate::config::FINISH_GRACE) so the
//! kernel lets go. To a loopback peer they go by `vmsplice` + `splice(2)` on the ring's thread,
//! with the socket made non-blocking for the call only (a full socket waits on a poll on the
//! ring, never in the call).
//!
//! A stream is woken (a chunk dealt to it, bytes a submitter left unsent) through its ring's
//! inbox ([`RingWake`]), which writes the ring's eventfd only while the ring's thread waits.
//!
//! [`UringConfig::client_rings`]: crate::config::UringConfig::client_rings

use std::collections::{HashMap, VecDeque};
use std::io;
use std::net::{SocketAddr, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Weak, mpsc};
use std::time::{Duration, Instant};

use ferry_core::FailureKind;
use ferry_core::wire::DATA_RESPONSE_LEN;
use io_uring::{IoUring, cqueue, opcode, types};
use tracing::{debug, warn};

use super::conn::{Conn, K_HANGUP, K_POLL, K_RECV, K_SEND, K_WAKE, Zc, ud};
use super::recv::{on_hangup, on_received, on_received_shared, receive, receive_shared};
use super::send::{on_sent, reset, send};
use super::state::{Queue, READ_TICK, RingInbox, RingWake, StreamShared, shutdown};
use crate::ring::user_data::{self, Decoded, MAX_SLOTS};
use crate::ring::{BufCache, IoStats, ThreadCount, new_ring, push, spawn_ring, submit};

/// Submission entries per ring (more are submitted in several calls).
const SQ_ENTRIES: u32 = 256;
/// Completion entries per ring (the kernel keeps an overflow beyond them).
const CQ_ENTRIES: u32 = 4096;
/// Fixed-file slots per ring: streams past them use their plain descriptor.
const FIXED_FILES: u32 = 1 << 12;

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
            let deadline = Instant::now() + crate::config::FINISH_GRACE;
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
            if !g.owners.reads(*token) {
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
            g.owners.ring_reads();
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
                *at = now + crate::config::FINISH_GRACE * 10;
            }
            true
        });
    }

    fn add(&mut self, n: NewStream) {
        if n.pin && self.pin && !self.pinned {
            crate::tune::pin_stream_thread(self.index);
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
            if let Some((chunk, _)) = g.owners.take_payload() {
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
                Instant::now() + crate::config::FINISH_GRACE,
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
