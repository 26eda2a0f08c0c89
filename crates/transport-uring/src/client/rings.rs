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

use std::collections::HashMap;
use std::io;
use std::net::SocketAddr;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, mpsc};
use std::time::{Duration, Instant};

use ferry_core::wire::DATA_RESPONSE_LEN;
use tracing::warn;

use super::conn::Conn;
use super::state::{Queue, READ_TICK, RingInbox, RingWake, StreamShared, shutdown};
use crate::ring::host::Host;
use crate::ring::kernel::{RingSize, Uring};
use crate::ring::{IoStats, ThreadCount, spawn_ring};

/// A client ring's size: submission entries (more are submitted in several calls), completion
/// entries (the kernel keeps an overflow beyond them), fixed-file slots (streams past them use
/// their plain descriptor).
const SIZE: RingSize = RingSize {
    sq: 256,
    cq: 4096,
    files: 1 << 12,
};

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
                move || Ring::new(plan, i, rx, b, s, st),
                Ring::run,
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
        r.inbox.inbox.wake_now();
        Ok(())
    }
}

impl Drop for ClientRings {
    fn drop(&mut self) {
        for r in &self.rings {
            r.stop.store(true, Ordering::Release);
            r.inbox.inbox.wake_now();
        }
    }
}

/// One client ring's thread: its host, and what the client's wing keeps beside it (the names
/// its streams are woken by, the direct readers it watches).
struct Ring {
    host: Host<Conn, Uring>,
    /// Its place in the set, and whether it may pin itself there ([`RingPlan::pin`]) and did.
    index: usize,
    pin: bool,
    pinned: bool,
    rx: mpsc::Receiver<NewStream>,
    inbox: Arc<RingInbox>,
    stop: Arc<AtomicBool>,
    /// Streams by the name their wake-ups carry: its slot (checked against the stream there,
    /// so a name outliving its stream wakes nobody).
    ids: HashMap<u64, usize>,
    woken: Vec<u64>,
    /// Direct readers watched (stream name, reader token, seen at a tick before), and when the
    /// next tick is due; when the list was last not empty.
    watched: Vec<(u64, u64, bool)>,
    next_tick: Instant,
    /// When every stream last looked at its work (a safety net, once a second at most).
    last_sweep: Instant,
    last_watched: Instant,
    stats: Arc<IoStats>,
    _count: ThreadCount,
}

impl Ring {
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
        let ring = Uring::new(SIZE, plan.register, plan.zero_copy)?;
        // splice(2) has no MSG_NOSIGNAL: a peer gone mid-splice would raise SIGPIPE at the
        // process. The ring's thread blocks it (the splice reports EPIPE).
        // SAFETY: plain signal-mask calls on a local set, for the calling thread only.
        unsafe {
            let mut set: libc::sigset_t = std::mem::zeroed();
            libc::sigemptyset(&mut set);
            libc::sigaddset(&mut set, libc::SIGPIPE);
            libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
        }
        Ok(Self {
            host: Host::new(ring, inbox.inbox.fd.clone(), stats.clone()),
            index,
            pin: plan.pin,
            pinned: false,
            rx,
            inbox,
            stop,
            ids: HashMap::new(),
            woken: Vec::new(),
            watched: Vec::new(),
            next_tick: Instant::now(),
            last_sweep: Instant::now(),
            last_watched: Instant::now(),
            _count: ThreadCount::new(&stats),
            stats,
        })
    }

    /// Runs turns until the set stopped and its last stream and zero-copy send are gone (or the
    /// ring fails: its streams end with its error), then the host's shutdown.
    fn run(mut self) {
        if let Err(e) = self.turns() {
            warn!(error = %e, "a client ring failed; its streams end");
            let native = e.raw_os_error().or(Some(libc::EIO));
            self.host.end_all(|| native);
        }
        self.host.shutdown();
    }

    fn turns(&mut self) -> io::Result<()> {
        loop {
            while let Ok(n) = self.rx.try_recv() {
                self.add(n);
            }
            self.inbox.inbox.take_woken(&mut self.woken);
            for id in std::mem::take(&mut self.woken) {
                self.wake(id);
            }
            self.tick();
            if self.stop.load(Ordering::Acquire) && self.host.is_empty() {
                return Ok(());
            }
            let t = if self.inbox.ticking.load(Ordering::SeqCst) {
                self.next_tick.saturating_duration_since(Instant::now())
            } else {
                Duration::from_secs(1)
            };
            let timed_out = self.host.turn(&self.inbox.inbox, Some(t))?;
            if timed_out && self.last_sweep.elapsed() >= Duration::from_secs(1) {
                self.last_sweep = Instant::now();
                // A safety net: every stream looks at its work once a second when nothing else
                // woke the ring.
                self.host.wake_all();
            }
        }
    }

    /// Runs the stream woken by name `id` at the next turn (a name whose stream ended wakes
    /// nobody, and is forgotten).
    fn wake(&mut self, id: u64) {
        let Some(&i) = self.ids.get(&id) else {
            return;
        };
        if self.host.stream_mut(i).is_some_and(|c| c.id == id) {
            self.host.wake(i);
        } else {
            self.ids.remove(&id);
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
            let Some(c) = self.host.stream_mut(i).filter(|c| c.id == *id) else {
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
            self.host.wake(i);
            false
        });
        self.watched = watched;
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
        let fd = n.sh.socket.as_raw_fd();
        // SAFETY: F_GETFL on the stream's socket, which `n.sh` keeps open.
        let fl = unsafe { libc::fcntl(fd, libc::F_GETFL) };
        let conn = Box::new(Conn {
            id,
            sh: n.sh,
            queue: n.queue,
            index: n.index,
            peer: n.peer,
            fd,
            fixed: None,
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
            stats: self.stats.clone(),
        });
        match self.host.add(conn) {
            Ok(i) => {
                // A name of the slot's last stream is stale now.
                self.ids.retain(|_, at| *at != i);
                self.ids.insert(id, i);
            }
            Err(c) => {
                warn!(peer = %c.peer, "a client ring is full; stream closed");
                c.sh.dead.store(true, Ordering::Release);
                shutdown(&c.sh.socket);
            }
        }
    }
}
