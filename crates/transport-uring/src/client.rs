//! The client side: a channel of several data streams to one peer incarnation.
//!
//! Each stream has a sender thread and a receiver thread, each with its own ring. The sender
//! writes request headers and WRITE payloads (SEND_ZC from registered memory where possible) in
//! order, resending whatever the kernel did not take; the receiver reads responses, and READ
//! payloads straight into registered memory. Responses on a stream come back in request order, so
//! the receiver matches them with a FIFO of in-flight chunks (bounded by `depth`) and checks the
//! sequence number. A request is drained once every chunk is resolved *and* every zero-copy
//! notification of its sends arrived.

use std::net::{SocketAddr, TcpStream};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ferry_core::wire::{DATA_REQUEST_LEN, DATA_RESPONSE_LEN, DataRequest, DataResponse};
use ferry_core::{
    BoxFuture, Channel, FailureKind, Op, OpKind, Outcome, RequestControl, TransportKind,
};
use tracing::debug;

use crate::ring::{Body, IoStats, SockIo};
use crate::waiter::Countdown;

/// How a channel's sender threads send payloads.
#[derive(Clone, Copy, Debug)]
pub(crate) struct SendPlan {
    /// SEND_ZC (else SEND).
    pub(crate) zero_copy: bool,
    /// vmsplice + SPLICE for WRITE payloads (loopback peers).
    pub(crate) splice: bool,
    /// Registered buffers and fixed file.
    pub(crate) register: bool,
    /// Pin stream `i`'s threads to the `i`-th allowed CPU (loopback, several streams).
    pub(crate) pin: bool,
}

/// One request being executed.
#[derive(Debug)]
struct ReqShared {
    ops: Arc<[Op]>,
    control: Arc<RequestControl>,
    /// Unresolved chunks and notifications, plus one held by the poster.
    parts: Arc<Countdown>,
}

#[derive(Debug)]
struct Job {
    req: Arc<ReqShared>,
    op: usize,
    /// Offset of the chunk within the op.
    at: u64,
    len: u64,
}

#[derive(Debug)]
struct InFlight {
    job: Job,
    seq: u32,
}

/// Keeps a request un-drained until the zero-copy notification of one send.
struct NotifHold(Arc<ReqShared>);

impl NotifHold {
    fn new(req: &Arc<ReqShared>) -> Self {
        req.parts.add(1);
        Self(req.clone())
    }
}

impl Drop for NotifHold {
    fn drop(&mut self) {
        self.0.parts.done_one();
    }
}

/// Wakes a sender thread that waits on its ring for zero-copy notifications.
#[derive(Debug)]
struct Wake {
    fd: OwnedFd,
    /// The sender is (about to be) waiting on its ring.
    sleeping: AtomicBool,
}

impl Wake {
    fn new() -> std::io::Result<Self> {
        // SAFETY: plain eventfd creation; the result is checked before use.
        let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC) };
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(Self {
            // SAFETY: eventfd returned a fresh descriptor that we now own.
            fd: unsafe { OwnedFd::from_raw_fd(fd) },
            sleeping: AtomicBool::new(false),
        })
    }

    fn poke(&self) {
        if self.sleeping.load(Ordering::SeqCst) {
            let one = 1u64.to_ne_bytes();
            // SAFETY: writing 8 bytes from a local array to our own eventfd.
            let _ = unsafe { libc::write(self.fd.as_raw_fd(), one.as_ptr().cast(), 8) };
        }
    }
}

#[derive(Debug)]
struct StreamSlot {
    jobs: Mutex<Option<mpsc::Sender<Job>>>,
    wake: Arc<Wake>,
    dead: Arc<AtomicBool>,
    socket: Arc<TcpStream>,
}

/// What `execute` needs of one stream: its job queue (if open), its death flag, its wake-up.
type Poster = (Option<mpsc::Sender<Job>>, Arc<AtomicBool>, Arc<Wake>);

/// A data channel to one peer, driven by io_uring.
#[derive(Debug)]
pub struct UringChannel {
    peer: SocketAddr,
    streams: Vec<StreamSlot>,
    next: AtomicUsize,
    chunk: u64,
    closed: AtomicBool,
    zero_copy: bool,
}

fn shutdown(s: &TcpStream) {
    let _ = s.shutdown(std::net::Shutdown::Both);
}

impl UringChannel {
    pub(crate) fn new(
        peer: SocketAddr,
        sockets: Vec<TcpStream>,
        chunk: u64,
        depth: usize,
        plan: SendPlan,
        stats: Arc<IoStats>,
    ) -> Result<Self, ferry_core::Error> {
        let SendPlan {
            zero_copy,
            splice,
            register,
            pin,
        } = plan;
        let depth = depth.max(1);
        let mut streams = Vec::with_capacity(sockets.len());
        for (i, s) in sockets.into_iter().enumerate() {
            let socket = Arc::new(s);
            let dead = Arc::new(AtomicBool::new(false));
            let (jobs_tx, jobs_rx) = mpsc::channel::<Job>();
            let (fly_tx, fly_rx) = mpsc::sync_channel::<InFlight>(depth);
            let fd = socket.as_raw_fd();
            let wake =
                Arc::new(Wake::new().map_err(|e| {
                    ferry_core::Error::io("create eventfd for", peer.to_string(), e)
                })?);
            let w1 = wake.clone();
            // Each thread creates its own ring (single-issuer rings belong to their creator) and
            // reports whether that worked before the channel is handed out.
            let (ready_tx, ready_rx) = mpsc::sync_channel::<std::io::Result<()>>(2);
            let spawn = |name: String, f: Box<dyn FnOnce() + Send>| {
                std::thread::Builder::new()
                    .name(name)
                    .spawn(f)
                    .map_err(|e| {
                        ferry_core::Error::io("spawn ring thread for", peer.to_string(), e)
                    })
            };
            let (s1, d1, st1, r1) = (
                socket.clone(),
                dead.clone(),
                stats.clone(),
                ready_tx.clone(),
            );
            spawn(
                format!("ferry-uring-tx{i}"),
                Box::new(move || match SockIo::new(fd, zero_copy, register, st1) {
                    Ok(mut io) => {
                        if pin {
                            crate::pin_stream_thread(i);
                        }
                        io.set_wake(w1.fd.as_raw_fd());
                        let _ = r1.send(Ok(()));
                        sender(io, splice, &w1, s1, d1, jobs_rx, fly_tx, peer, i)
                    }
                    Err(e) => {
                        d1.store(true, Ordering::Release);
                        let _ = r1.send(Err(e));
                    }
                }),
            )?;
            let (s2, d2, st2, r2) = (socket.clone(), dead.clone(), stats.clone(), ready_tx);
            spawn(
                format!("ferry-uring-rx{i}"),
                Box::new(move || match SockIo::<()>::new(fd, false, register, st2) {
                    Ok(io) => {
                        if pin {
                            crate::pin_stream_thread(i);
                        }
                        let _ = r2.send(Ok(()));
                        receiver(io, s2, d2, fly_rx, peer, i)
                    }
                    Err(e) => {
                        d2.store(true, Ordering::Release);
                        shutdown(&s2);
                        let _ = r2.send(Err(e));
                    }
                }),
            )?;
            for _ in 0..2 {
                match ready_rx.recv() {
                    Ok(Ok(())) => {}
                    Ok(Err(e)) => {
                        shutdown(&socket);
                        return Err(ferry_core::Error::io(
                            "create io_uring ring for",
                            peer.to_string(),
                            e,
                        ));
                    }
                    Err(_) => {
                        shutdown(&socket);
                        return Err(ferry_core::Error::Unavailable {
                            library: "io_uring".into(),
                            reason: "a ring thread ended before reporting".into(),
                        });
                    }
                }
            }
            streams.push(StreamSlot {
                jobs: Mutex::new(Some(jobs_tx)),
                wake,
                dead,
                socket,
            });
        }
        Ok(Self {
            peer,
            streams,
            next: AtomicUsize::new(0),
            chunk: chunk.max(1),
            closed: AtomicBool::new(false),
            zero_copy,
        })
    }

    /// Whether payloads go out with SEND_ZC.
    pub fn zero_copy(&self) -> bool {
        self.zero_copy
    }

    /// Number of data streams.
    pub fn streams(&self) -> usize {
        self.streams.len()
    }

    fn senders(&self) -> Vec<Poster> {
        self.streams
            .iter()
            .map(|s| {
                let tx = match s.jobs.lock() {
                    Ok(g) => g.clone(),
                    Err(p) => p.into_inner().clone(),
                };
                (tx, s.dead.clone(), s.wake.clone())
            })
            .collect()
    }
}

impl Channel for UringChannel {
    fn kind(&self) -> TransportKind {
        TransportKind::Uring
    }

    fn execute(&self, ops: Arc<[Op]>, control: Arc<RequestControl>) -> BoxFuture<'static, Outcome> {
        let slots = if self.closed.load(Ordering::Acquire) {
            Vec::new()
        } else {
            self.senders()
        };
        let mut rr = self.next.fetch_add(1, Ordering::Relaxed);
        let chunk = self.chunk;
        let req = Arc::new(ReqShared {
            ops: ops.clone(),
            control: control.clone(),
            parts: Arc::new(Countdown::new(1)),
        });
        // Chunks are queued to the stream threads now; each thread checks the request's stop
        // flag and failures before it posts a chunk, and bounds what is in flight.
        'ops: for (i, op) in ops.iter().enumerate() {
            let chunks = op.len.div_ceil(chunk).max(1);
            let Ok(chunks32) = u32::try_from(chunks) else {
                control.with_ledger(|l| l.not_posted(i, FailureKind::Local, None));
                break;
            };
            control.with_ledger(|l| l.plan(i, chunks32));
            for c in 0..chunks {
                if control.should_stop_posting() {
                    break 'ops;
                }
                let at = c * chunk;
                let mut job = Job {
                    req: req.clone(),
                    op: i,
                    at,
                    len: chunk.min(op.len - at),
                };
                let mut tried = 0;
                loop {
                    let live = (tried < slots.len())
                        .then(|| {
                            (0..slots.len())
                                .map(|k| &slots[(rr + k) % slots.len()])
                                .find(|s| s.0.is_some() && !s.1.load(Ordering::Acquire))
                        })
                        .flatten();
                    rr = rr.wrapping_add(1);
                    tried += 1;
                    let Some((Some(tx), _, wake)) = live else {
                        control.with_ledger(|l| l.not_posted(i, FailureKind::PeerLost, None));
                        break 'ops;
                    };
                    req.parts.add(1);
                    match tx.send(job) {
                        Ok(()) => {
                            wake.poke();
                            break;
                        }
                        Err(mpsc::SendError(j)) => {
                            req.parts.done_one();
                            job = j;
                        }
                    }
                }
            }
        }
        let parts = req.parts.clone();
        drop(req);
        parts.done_one();
        Box::pin(async move {
            parts.wait().await;
            control.outcome(true)
        })
    }

    fn is_alive(&self) -> bool {
        !self.closed.load(Ordering::Acquire)
            && self.streams.iter().any(|s| !s.dead.load(Ordering::Acquire))
    }

    fn close(&self) {
        self.closed.store(true, Ordering::Release);
        for s in &self.streams {
            s.dead.store(true, Ordering::Release);
            shutdown(&s.socket);
        }
        debug!(peer = %self.peer, "channel closed");
    }
}

impl Drop for UringChannel {
    fn drop(&mut self) {
        for s in &self.streams {
            shutdown(&s.socket);
            // Dropping the job sender ends the sender thread (and through it the receiver).
            match s.jobs.lock() {
                Ok(mut g) => drop(g.take()),
                Err(p) => drop(p.into_inner().take()),
            }
        }
    }
}

fn fail_unposted(job: Job) {
    job.req
        .control
        .with_ledger(|l| l.not_posted(job.op, FailureKind::PeerLost, None));
    job.req.parts.done_one();
}

fn fail_lost(job: Job, native: Option<i32>) {
    job.req
        .control
        .with_ledger(|l| l.lost(job.op, FailureKind::PeerLost, native));
    job.req.parts.done_one();
}

#[allow(clippy::too_many_arguments)]
fn sender(
    mut io: SockIo<NotifHold>,
    splice: bool,
    wake: &Wake,
    socket: Arc<TcpStream>,
    dead: Arc<AtomicBool>,
    jobs: mpsc::Receiver<Job>,
    fly: mpsc::SyncSender<InFlight>,
    peer: SocketAddr,
    index: usize,
) {
    let mut seq: u32 = 0;
    let mut head = [0u8; DATA_REQUEST_LEN];
    loop {
        let job = if io.pending_notifications() > 0 {
            match jobs.try_recv() {
                Ok(j) => j,
                Err(mpsc::TryRecvError::Empty) => {
                    // Announce the wait, then look again: a poster that queued a job after our
                    // first look sees the flag and writes the eventfd (both sides SeqCst).
                    wake.sleeping.store(true, Ordering::SeqCst);
                    match jobs.try_recv() {
                        Ok(j) => {
                            wake.sleeping.store(false, Ordering::SeqCst);
                            j
                        }
                        Err(mpsc::TryRecvError::Empty) => {
                            io.wait_notifications(Duration::from_millis(10));
                            wake.sleeping.store(false, Ordering::SeqCst);
                            continue;
                        }
                        Err(mpsc::TryRecvError::Disconnected) => break,
                    }
                }
                Err(mpsc::TryRecvError::Disconnected) => break,
            }
        } else {
            match jobs.recv() {
                Ok(j) => j,
                Err(_) => break,
            }
        };
        if dead.load(Ordering::Acquire) {
            fail_unposted(job);
            continue;
        }
        if job.req.control.should_stop_posting() {
            // Stopped or failed: the reason is already in the ledger; this chunk never moves.
            job.req.parts.done_one();
            continue;
        }
        let op = &job.req.ops[job.op];
        let local_at = op.local_offset + job.at;
        if op.local.check(local_at, job.len).is_err() {
            job.req
                .control
                .with_ledger(|l| l.not_posted(job.op, FailureKind::Local, None));
            job.req.parts.done_one();
            continue;
        }
        let s = seq;
        seq = seq.wrapping_add(1);
        DataRequest {
            kind: op.kind,
            seq: s,
            token: op.token,
            offset: op.remote_offset + job.at,
            len: job.len,
        }
        .encode(&mut head);
        let is_write = op.kind == OpKind::Write;
        let (region, len) = (op.local.clone(), job.len as usize);
        let req = job.req.clone();
        let op_index = job.op;
        if let Err(mpsc::SendError(f)) = fly.send(InFlight { job, seq: s }) {
            dead.store(true, Ordering::Release);
            fail_unposted(f.job);
            continue;
        }
        req.control.with_ledger(|l| l.posted(op_index));
        let res = if is_write && splice {
            let ptr = (region.as_ptr() as usize + local_at as usize) as *const u8;
            // SAFETY: bounds-checked above; the request owns the range and keeps the region alive
            // until its response is read (the job in flight holds the ops), and the peer answers
            // only after it received every byte, so no page reference outlives that.
            unsafe { io.send_spliced(&head, ptr, len) }
        } else if is_write {
            let body = Body {
                region: &region,
                offset: local_at,
                len,
            };
            let mut hold = || NotifHold::new(&req);
            // SAFETY: the range was bounds-checked against the region above; the request owns it
            // until drained, which waits for every hold made here (each keeps the request, and so
            // its ops' regions, alive until the send's notification).
            unsafe { io.send(&head, Some(body), Some(&mut hold)) }
        } else {
            io.send_buf(&head)
        };
        if let Err(e) = res {
            debug!(%peer, stream = index, error = %e, "send failed; stream closed");
            dead.store(true, Ordering::Release);
            // Wake the receiver: it fails everything in flight on this stream as lost.
            shutdown(&socket);
        }
    }
    drop(fly);
    io.drain(Duration::from_secs(10));
}

fn receiver(
    mut io: SockIo<()>,
    socket: Arc<TcpStream>,
    dead: Arc<AtomicBool>,
    fly: mpsc::Receiver<InFlight>,
    peer: SocketAddr,
    index: usize,
) {
    let mut head = [0u8; DATA_RESPONSE_LEN];
    while let Ok(f) = fly.recv() {
        if let Err(e) = io.recv_buf(&mut head) {
            debug!(%peer, stream = index, error = %e, "receive failed; stream closed");
            fail_lost(f.job, e.raw_os_error());
            break;
        }
        let resp = match DataResponse::decode(&head) {
            Ok(r) if r.seq == f.seq => r,
            other => {
                debug!(%peer, stream = index, ?other, "bad response; stream closed");
                fail_lost(f.job, None);
                break;
            }
        };
        let job = f.job;
        let op = &job.req.ops[job.op];
        if let Some(status) = resp.refused {
            job.req.control.with_ledger(|l| l.refused(job.op, status));
            job.req.parts.done_one();
            continue;
        }
        if op.kind == OpKind::Read {
            let at = op.local_offset + job.at;
            if resp.len != job.len || op.local.check(at, job.len).is_err() {
                fail_lost(job, None);
                break;
            }
            let ptr = (op.local.as_ptr() as usize + at as usize) as *mut u8;
            // SAFETY: bounds-checked above; the request owns the range until drained, keeps the
            // region alive through the job's Arc, and no Rust reference to it exists.
            if let Err(e) = unsafe { io.recv_exact(ptr, job.len as usize) } {
                debug!(%peer, stream = index, error = %e, "receive failed; stream closed");
                fail_lost(job, e.raw_os_error());
                break;
            }
        }
        job.req.control.with_ledger(|l| l.acked(job.op));
        job.req.parts.done_one();
    }
    dead.store(true, Ordering::Release);
    shutdown(&socket);
    while let Ok(f) = fly.recv() {
        fail_lost(f.job, None);
    }
}
