//! The client side: a channel of several data streams to one peer incarnation.
//!
//! Each stream has one thread with one ring. It writes request headers and WRITE payloads
//! (SEND_ZC from registered memory where possible, or vmsplice + splice to a loopback peer) in
//! order, resending whatever the kernel did not take, and keeps a receive for the next response
//! armed on the same ring, so a response that arrives while it sends is picked up by the send's
//! own wait. READ payloads are read straight into registered memory. Responses on a stream come
//! back in request order, so the thread matches them with a FIFO of in-flight chunks (bounded by
//! `depth`) and checks the sequence number. A request is drained once every chunk is resolved
//! *and* every zero-copy notification of its sends arrived.

use std::net::{SocketAddr, TcpStream};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ferry_core::dealer::{Dealer, StreamSet, deal_ops, deal_ops_grouped};
use ferry_core::stream::{AckPolicy, Chunk, ChunkOwner, ClientStream, Post, Resolution, Work};
use ferry_core::wire::DATA_RESPONSE_LEN;
use ferry_core::{
    BoxFuture, Channel, FailureKind, Op, OpKind, Outcome, RequestControl, TransportKind,
};
use ferry_net::ChannelStreams;
use tracing::debug;

use crate::ring::{Body, IoStats, SockIo, ThreadCount};
use crate::waiter::Countdown;

/// How a channel's stream threads send payloads.
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
    /// The peer is on this host (loopback): no flight time to cover, so the server may hold back
    /// responses for all but one chunk in flight, not just for half of them ([`AckPolicy`]).
    pub(crate) loopback: bool,
    /// The peer takes vectored requests (protocol version 3): runs of small ops are grouped.
    pub(crate) vectored: bool,
}

/// One request being executed.
#[derive(Debug)]
struct ReqShared {
    ops: Arc<[Op]>,
    control: Arc<RequestControl>,
    /// Unresolved chunks and notifications, plus one held by the poster.
    parts: Arc<Countdown>,
}

impl ChunkOwner for ReqShared {
    fn ops(&self) -> &[Op] {
        &self.ops
    }

    fn control(&self) -> &RequestControl {
        &self.control
    }

    fn chunk_done(&self) {
        self.parts.done_one();
    }
}

type Job = Work<ReqShared>;

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

/// Wakes a stream thread that waits on its ring (for responses, notifications or new work).
#[derive(Debug)]
struct Wake {
    fd: OwnedFd,
    /// The sender is (about to be) waiting on its ring.
    sleeping: AtomicBool,
    /// ... with nothing in flight: it may take another stream's chunk.
    starved: AtomicBool,
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
            starved: AtomicBool::new(false),
        })
    }

    /// The thread no longer waits.
    fn rise(&self) {
        self.sleeping.store(false, Ordering::SeqCst);
        self.starved.store(false, Ordering::SeqCst);
    }

    fn poke_now(&self) {
        let one = 1u64.to_ne_bytes();
        // SAFETY: writing 8 bytes from a local array to our own eventfd.
        let _ = unsafe { libc::write(self.fd.as_raw_fd(), one.as_ptr().cast(), 8) };
    }
}

/// The chunks of a channel not yet taken by its streams ([`Dealer`]: dealt in turn, taken by
/// a stream with nothing in flight, handed on by a stream that ends), with each stream
/// thread's wake-up.
#[derive(Debug)]
struct JobQueue<J> {
    state: Mutex<Dealer<J>>,
    /// Each stream thread's wake-up, by stream index.
    wakes: Vec<Arc<Wake>>,
}

impl<J> JobQueue<J> {
    fn new(wakes: Vec<Arc<Wake>>) -> Self {
        Self {
            state: Mutex::new(Dealer::new(wakes.len())),
            wakes,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Dealer<J>> {
        match self.state.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        }
    }

    /// Wakes stream `i` if it waits for work, else one stream that waits with nothing in
    /// flight (it may take the chunk). A thread announces its wait before it looks at the queue
    /// a last time, both `SeqCst`: a chunk queued after that look finds the flag set. Busy
    /// threads look again on their own.
    fn wake_for(&self, i: usize) {
        if let Some(own) = self.wakes.get(i)
            && own.sleeping.load(Ordering::SeqCst)
        {
            own.poke_now();
            return;
        }
        if let Some(w) = self.wakes.iter().find(|w| w.starved.load(Ordering::SeqCst)) {
            w.poke_now();
        }
    }

    /// Wakes (see [`JobQueue::wake_for`]) for each stream in `set`.
    fn wake_all_in(&self, set: StreamSet) {
        for i in 0..self.wakes.len() {
            if set.contains(i) {
                self.wake_for(i);
            }
        }
    }

    /// Marks the channel gone and wakes every stream thread: each ends once nothing is queued
    /// for it and nothing is in flight.
    fn drop_channel(&self) {
        self.lock().close();
        for w in &self.wakes {
            w.poke_now();
        }
    }

    /// For stream `i`: `Some(Some(job))`, `Some(None)` once the channel is gone and nothing is
    /// queued for it, `None` if nothing is. With `idle` (nothing in flight) it may take the
    /// oldest chunk of the longest other queue.
    fn next(&self, i: usize, idle: bool) -> Option<Option<J>> {
        let mut g = self.lock();
        match g.take(i, idle) {
            Some(j) => Some(Some(j)),
            None if g.is_closed() => Some(None),
            None => None,
        }
    }

    /// Stream `i`'s thread stops taking jobs: what was dealt to it goes to the others (woken);
    /// returns what no stream is left to take, for the caller to fail.
    fn leave(&self, i: usize) -> Vec<J> {
        let mut woken = StreamSet::default();
        let orphans = self.lock().leave(i, &mut woken);
        self.wake_all_in(woken);
        orphans
    }
}

/// A data channel to one peer, driven by io_uring.
#[derive(Debug)]
pub struct UringChannel {
    peer: SocketAddr,
    streams: ChannelStreams,
    queue: Arc<JobQueue<Job>>,
    chunk: u64,
    zero_copy: bool,
    vectored: bool,
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
            loopback,
            vectored,
        } = plan;
        let depth = depth.max(1);
        let wakes = (0..sockets.len())
            .map(|_| Wake::new().map(Arc::new))
            .collect::<std::io::Result<Vec<_>>>()
            .map_err(|e| ferry_core::Error::io("create eventfd for", peer.to_string(), e))?;
        let queue = Arc::new(JobQueue::new(wakes.clone()));
        let mut streams = ChannelStreams::new();
        // On failure the threads started so far end (their sockets shut, the queue dropped).
        let abandon = |streams: &ChannelStreams, queue: &JobQueue<Job>| {
            streams.shutdown_all();
            queue.drop_channel();
        };
        for (i, (s, wake)) in sockets.into_iter().zip(wakes).enumerate() {
            // A duplicate descriptor stays with the channel handle, to shut the socket down from
            // any thread.
            let handle = match s.try_clone() {
                Ok(h) => h,
                Err(e) => {
                    abandon(&streams, &queue);
                    return Err(ferry_core::Error::io(
                        "duplicate a stream socket of",
                        peer.to_string(),
                        e,
                    ));
                }
            };
            let socket = Arc::new(s);
            let dead = Arc::new(AtomicBool::new(false));
            let fd = socket.as_raw_fd();
            // The thread creates its own ring (single-issuer rings belong to their creator) and
            // reports whether that worked before the channel is handed out.
            let (ready_tx, ready_rx) = mpsc::sync_channel::<std::io::Result<()>>(1);
            let cx = StreamCtx {
                splice,
                wake,
                socket: socket.clone(),
                dead: dead.clone(),
                queue: queue.clone(),
                peer,
                index: i,
            };
            let st = stats.clone();
            let spawned = std::thread::Builder::new()
                .name(format!("ferry-uring-s{i}"))
                .spawn(
                    move || match SockIo::new(fd, zero_copy, register, st.clone()) {
                        Ok(mut io) => {
                            let _count = ThreadCount::new(&st, "client streams");
                            if pin {
                                crate::pin_stream_thread(i);
                            }
                            io.set_wake(cx.wake.fd.as_raw_fd());
                            let _ = ready_tx.send(Ok(()));
                            let policy = if loopback {
                                AckPolicy::Loopback
                            } else {
                                AckPolicy::Network
                            };
                            stream(io, cx, ClientStream::new(depth, policy))
                        }
                        Err(e) => {
                            cx.dead.store(true, Ordering::Release);
                            shutdown(&cx.socket);
                            let _ = ready_tx.send(Err(e));
                        }
                    },
                );
            let failed = match spawned {
                Err(e) => Some(ferry_core::Error::io(
                    "spawn ring thread for",
                    peer.to_string(),
                    e,
                )),
                Ok(_) => match ready_rx.recv() {
                    Ok(Ok(())) => None,
                    Ok(Err(e)) => Some(ferry_core::Error::io(
                        "create io_uring ring for",
                        peer.to_string(),
                        e,
                    )),
                    Err(_) => Some(ferry_core::Error::Unavailable {
                        library: "io_uring".into(),
                        reason: "a ring thread ended before reporting".into(),
                    }),
                },
            };
            streams.push(dead, handle);
            if let Some(e) = failed {
                abandon(&streams, &queue);
                return Err(e);
            }
        }
        Ok(Self {
            peer,
            streams,
            queue,
            chunk: chunk.max(1),
            zero_copy,
            vectored,
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
}

impl Channel for UringChannel {
    fn kind(&self) -> TransportKind {
        TransportKind::Uring
    }

    fn execute(&self, ops: Arc<[Op]>, control: Arc<RequestControl>) -> BoxFuture<'static, Outcome> {
        let closed = self.streams.is_closed();
        let req = Arc::new(ReqShared {
            ops: ops.clone(),
            control: control.clone(),
            parts: Arc::new(Countdown::new(1)),
        });
        // Chunks are dealt to the stream threads now; each thread checks the request's stop
        // flag and failures again before it posts a chunk, and bounds what it has in flight.
        let one = |op, at, len| {
            req.parts.add(1);
            Work::One(Chunk {
                req: req.clone(),
                op,
                at,
                len,
            })
        };
        let wake = |set| self.queue.wake_all_in(set);
        if self.vectored {
            // Runs of small ops go out as vectored requests of up to one chunk's bytes.
            deal_ops_grouped(
                &self.queue.state,
                &ops,
                &control,
                self.chunk,
                self.chunk,
                closed,
                one,
                |members| {
                    req.parts.add(members.len());
                    Work::Pieces(
                        members
                            .iter()
                            .map(|&op| Chunk {
                                req: req.clone(),
                                op,
                                at: 0,
                                len: ops[op].len,
                            })
                            .collect(),
                    )
                },
                Work::skipped,
                wake,
            );
        } else {
            deal_ops(
                &self.queue.state,
                &ops,
                &control,
                self.chunk,
                closed,
                one,
                Work::skipped,
                wake,
            );
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
        self.streams.is_alive()
    }

    fn close(&self) {
        self.streams.close();
        debug!(peer = %self.peer, "channel closed");
    }
}

impl Drop for UringChannel {
    fn drop(&mut self) {
        self.streams.shutdown_all();
        self.queue.drop_channel();
    }
}

/// What a stream thread owns besides its ring.
struct StreamCtx {
    splice: bool,
    wake: Arc<Wake>,
    socket: Arc<TcpStream>,
    dead: Arc<AtomicBool>,
    queue: Arc<JobQueue<Job>>,
    peer: SocketAddr,
    index: usize,
}

/// One stream's thread: it sends requests in order (WRITE payloads from registered memory) and
/// reads the responses with a receive kept armed on the same ring, so that a response arriving
/// while the thread sends is picked up by that send's wait, with no second thread to wake.
fn stream(mut io: SockIo<NotifHold>, cx: StreamCtx, mut proto: ClientStream<ReqShared>) {
    let mut resp = [0u8; DATA_RESPONSE_LEN];
    let mut resp_at = 0usize;
    let mut open = true;
    let broken = 'run: loop {
        // Responses that arrived meanwhile.
        while let Some(got) = io.take_armed() {
            match got {
                Ok([]) => {
                    debug!(peer = %cx.peer, stream = cx.index, "peer closed the stream");
                    break 'run None;
                }
                Ok(bytes) => {
                    let n = bytes.len().min(DATA_RESPONSE_LEN - resp_at);
                    resp[resp_at..resp_at + n].copy_from_slice(&bytes[..n]);
                    resp_at += n;
                }
                Err(e) => {
                    debug!(peer = %cx.peer, stream = cx.index, error = %e, "receive failed; stream closed");
                    break 'run e.raw_os_error();
                }
            }
            if resp_at == DATA_RESPONSE_LEN {
                resp_at = 0;
                if let Err(native) = on_response(&mut io, &resp, &mut proto, &cx) {
                    break 'run native;
                }
            }
            if (proto.in_flight() > 0 || resp_at > 0)
                && let Err(e) = io.arm_recv(DATA_RESPONSE_LEN - resp_at)
            {
                debug!(peer = %cx.peer, stream = cx.index, error = %e, "cannot arm a receive");
                break 'run None;
            }
        }
        // New work, while fewer than `depth` chunks are in flight.
        let mut job = None;
        if open && proto.has_room() {
            let idle = proto.in_flight() == 0;
            match cx.queue.next(cx.index, idle) {
                Some(Some(j)) => job = Some(j),
                Some(None) => open = false,
                None => {
                    // Announce the wait, then look again: a poster that queued a job after our
                    // first look sees the flag and writes the eventfd (both sides SeqCst).
                    cx.wake.sleeping.store(true, Ordering::SeqCst);
                    cx.wake.starved.store(idle, Ordering::SeqCst);
                    match cx.queue.next(cx.index, idle) {
                        Some(Some(j)) => job = Some(j),
                        Some(None) => open = false,
                        None => {}
                    }
                }
            }
        }
        let Some(job) = job else {
            if !open && proto.in_flight() == 0 && resp_at == 0 {
                cx.wake.rise();
                break 'run None;
            }
            // Wait for a response, a zero-copy notification or new work (`sleeping` was set
            // above if new work could be taken; with `depth` chunks in flight posters need not
            // wake us: a response will).
            io.wait(Duration::from_secs(1));
            cx.wake.rise();
            continue;
        };
        cx.wake.rise();
        if let Err(native) = post(&mut io, job, &mut proto, &cx, resp_at) {
            break 'run native;
        }
    };
    cx.dead.store(true, Ordering::Release);
    shutdown(&cx.socket);
    proto.fail_all(broken);
    // The other streams take what was dealt to this one; the last one to end fails it.
    for job in cx.queue.leave(cx.index) {
        job.not_posted(FailureKind::PeerLost);
    }
    // Until they are notified the kernel may still read the buffers of zero-copy sends.
    io.finish(crate::FINISH_GRACE);
}

/// Sends one chunk's request (and WRITE payload), keeping a receive armed for its response.
/// `Err` (with the native error, if any): the stream is broken.
fn post(
    io: &mut SockIo<NotifHold>,
    job: Job,
    proto: &mut ClientStream<ReqShared>,
    cx: &StreamCtx,
    resp_at: usize,
) -> Result<(), Option<i32>> {
    if cx.dead.load(Ordering::Acquire) {
        job.not_posted(FailureKind::PeerLost);
        return Ok(());
    }
    let out = match proto.post(job) {
        Post::Send(out) => out,
        Post::Resolved => return Ok(()),
        Post::Broken(job) => {
            job.not_posted(FailureKind::PeerLost);
            return Ok(());
        }
    };
    if !io.armed()
        && let Err(e) = io.arm_recv(DATA_RESPONSE_LEN - resp_at)
    {
        debug!(peer = %cx.peer, stream = cx.index, error = %e, "cannot arm a receive");
        return Err(None);
    }
    let is_write = out.kind == OpKind::Write;
    let res = if !out.scatter.is_empty() {
        let mut parts: Vec<(*const u8, usize)> =
            Vec::with_capacity(2 + if is_write { out.scatter.len() } else { 0 });
        parts.push((out.head.as_ptr(), out.head.len()));
        parts.push((out.table.as_ptr(), out.table.len()));
        if is_write {
            parts.extend(out.scatter.iter().map(|r| {
                (
                    (r.region.as_ptr() as usize + r.at as usize) as *const u8,
                    r.len,
                )
            }));
        }
        // SAFETY: the header and table live in `out` across the call; each piece's range was
        // checked against its region at post, and `out.scatter` keeps the regions alive; the
        // send is a copying one, done when the call returns.
        unsafe { io.send_vectored(&parts) }
    } else if is_write && cx.splice {
        let ptr = (out.region.as_ptr() as usize + out.local_at as usize) as *const u8;
        // SAFETY: the stream protocol checked the range against the region at post; the
        // request owns the range and keeps the region alive until its response is read (the
        // chunk in flight holds the ops), and the peer answers only after it received every
        // byte, so no page reference outlives that.
        unsafe { io.send_spliced(&out.head, ptr, out.len) }
    } else if is_write {
        let body = Body {
            region: &out.region,
            offset: out.local_at,
            len: out.len,
        };
        let mut hold = || NotifHold::new(&out.req);
        // SAFETY: the range was checked against the region at post; the request owns it until
        // drained, which waits for every hold made here (each keeps the request, and so its
        // ops' regions, alive until the send's notification).
        unsafe { io.send(&out.head, Some(body), Some(&mut hold)) }
    } else {
        io.send_buf(&out.head)
    };
    res.map_err(|e| {
        debug!(peer = %cx.peer, stream = cx.index, error = %e, "send failed; stream closed");
        e.raw_os_error()
    })
}

/// Resolves the oldest chunks in flight with `head` (reading a READ's payload into registered
/// memory first). `Err`: the stream is broken.
fn on_response(
    io: &mut SockIo<NotifHold>,
    head: &[u8; DATA_RESPONSE_LEN],
    proto: &mut ClientStream<ReqShared>,
    cx: &StreamCtx,
) -> Result<(), Option<i32>> {
    let chunk = match proto.on_response(head) {
        Ok(Resolution::Done) => return Ok(()),
        Ok(Resolution::Pieces(pieces)) => {
            let parts: Vec<(*mut u8, usize)> = pieces
                .iter()
                .map(|c| {
                    (
                        (c.op().local.as_ptr() as usize + c.local_at() as usize) as *mut u8,
                        c.payload_len() as usize,
                    )
                })
                .collect();
            // SAFETY: each piece's range was checked against its region at post; the request
            // owns the ranges until drained, keeps the regions alive through the chunks' Arcs,
            // and no Rust reference to them exists.
            return match unsafe { io.recv_vectored(&parts) } {
                Ok(()) => {
                    pieces.into_iter().for_each(Chunk::acked);
                    Ok(())
                }
                Err(e) => {
                    debug!(peer = %cx.peer, stream = cx.index, error = %e, "receive failed; stream closed");
                    let native = e.raw_os_error();
                    pieces.into_iter().for_each(|c| c.lost(native));
                    Err(native)
                }
            };
        }
        Ok(Resolution::Payload(chunk)) => chunk,
        Err(v) => {
            debug!(peer = %cx.peer, stream = cx.index, error = %v, "bad response; stream closed");
            return Err(None);
        }
    };
    let ptr = (chunk.op().local.as_ptr() as usize + chunk.local_at() as usize) as *mut u8;
    // SAFETY: the stream protocol checked the range against the region at post; the request
    // owns the range until drained, keeps the region alive through the chunk's Arc, and no Rust
    // reference to it exists.
    match unsafe { io.recv_exact(ptr, chunk.payload_len() as usize) } {
        Ok(()) => {
            chunk.acked();
            Ok(())
        }
        Err(e) => {
            debug!(peer = %cx.peer, stream = cx.index, error = %e, "receive failed; stream closed");
            let native = e.raw_os_error();
            chunk.lost(native);
            Err(native)
        }
    }
}

#[cfg(test)]
mod tests {
    use std::os::fd::AsRawFd;
    use std::sync::Arc;
    use std::sync::atomic::Ordering;

    use super::{JobQueue, Wake};

    fn queue(streams: usize) -> JobQueue<u32> {
        JobQueue::new(
            (0..streams)
                .map(|_| Arc::new(Wake::new().unwrap()))
                .collect(),
        )
    }

    /// Whether `w`'s eventfd was written (and resets it).
    fn poked(w: &Wake) -> bool {
        let mut p = libc::pollfd {
            fd: w.fd.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: polling one descriptor of ours, no wait.
        let ready = unsafe { libc::poll(&mut p, 1, 0) } == 1;
        if ready {
            let mut b = [0u8; 8];
            // SAFETY: reading 8 bytes into a local array from our own readable eventfd.
            unsafe { libc::read(w.fd.as_raw_fd(), b.as_mut_ptr().cast(), 8) };
        }
        ready
    }

    /// A chunk dealt to a waiting stream wakes it; dealt to a busy one, it wakes a stream that
    /// waits with nothing in flight instead, and no stream that waits with chunks in flight.
    #[test]
    fn a_chunk_for_a_busy_stream_wakes_an_idle_one() {
        let q = queue(3);
        q.wakes[0].sleeping.store(true, Ordering::SeqCst);
        q.wake_for(0);
        assert!(poked(&q.wakes[0]));
        q.wakes[0].rise();
        // Stream 1 waits with chunks in flight (a response will wake it), stream 2 idles.
        q.wakes[1].sleeping.store(true, Ordering::SeqCst);
        q.wakes[2].sleeping.store(true, Ordering::SeqCst);
        q.wakes[2].starved.store(true, Ordering::SeqCst);
        q.wake_for(0);
        assert!(!poked(&q.wakes[0]));
        assert!(!poked(&q.wakes[1]));
        assert!(poked(&q.wakes[2]));
        q.wakes[2].rise();
        q.wake_for(0);
        assert!(
            ![0, 1, 2].iter().any(|&i| poked(&q.wakes[i])),
            "nobody to wake"
        );
        q.drop_channel();
        assert!([0, 1, 2].iter().all(|&i| poked(&q.wakes[i])));
    }
}
