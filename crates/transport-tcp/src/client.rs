//! The client side: a channel of several data streams to one peer incarnation.
//!
//! Each stream has a sender task (writes request headers and WRITE payloads straight from
//! registered memory) and a receiver task (reads responses and READ payloads straight into
//! registered memory), both on the stream's I/O thread (`pool.rs`). Chunks are dealt to the
//! streams in turn ([`Dealer`]); a stream with nothing in flight takes the oldest chunk of
//! another's queue, and a stream that dies hands its queue on. Each stream keeps at most `depth`
//! chunks in flight. Responses on a stream come back in request order, so the receiver
//! matches them with a FIFO of in-flight chunks (and checks the sequence number).
//!
//! A request of one small chunk submitted while a stream is idle skips the hand-over to the
//! sender task: the submitting thread posts it and writes it with one non-blocking `sendmsg`
//! ([`TcpChannel::send_direct`]); the receiver task, which waits on the socket whether or not
//! chunks are in flight, meets the response, and the sender task sends first whatever part of
//! the request the kernel did not take.

use std::net::SocketAddr;
use std::os::fd::AsFd;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use ferry_core::countdown::Executing;
use ferry_core::dealer::direct_op;
use ferry_core::queue::{JobQueue, Next, Wake};
use ferry_core::stream::{AckPolicy, Chunk, ClientStream, Post, Resolution, Work};
use ferry_core::wire::{DATA_REQUEST_LEN, DATA_RESPONSE_LEN};
use ferry_core::{
    BoxFuture, Channel, FailureKind, Op, OpKind, Outcome, RequestControl, TransportKind,
};
use ferry_net::{ChannelStreams, SentNow};
use tokio::net::TcpStream;
use tokio::sync::Notify;
use tracing::debug;

use crate::TcpStats;
use crate::io::{RawRange, recv_buf, recv_exact, recv_vectored, send_all, send_vectored, shutdown};
use crate::pool::IoPool;

/// Payloads up to this size are staged with their header and sent in one call.
const SMALL: usize = 16 << 10;

type Job = Work<Executing>;

/// A stream's sender task's wake-up: new work, room freed in flight, nothing left in flight
/// (it may take others' jobs), the stream's or the channel's end.
#[derive(Debug, Default)]
struct TaskWake(Notify);

impl Wake for TaskWake {
    fn wake(&self) {
        self.0.notify_one();
    }
}

type Queue = JobQueue<Job, TaskWake>;

/// What stream `i`'s sender does next.
enum Step {
    /// Post and send this job (the send side is claimed: `busy`).
    Job(Job),
    /// Send these bytes first, the rest of a direct send (the send side is claimed: `busy`).
    Tail(Vec<u8>),
    /// The stream is full: wait for room.
    Full,
    /// The channel is gone (and nothing is queued for this stream) or the stream died.
    Stop,
}

/// The next step of stream `i`'s sender, waiting for work. `idle_now`: nothing is in flight on
/// the stream as the caller last looked. The send side is claimed (`busy`) before the queue is
/// looked at, so that a submitter cannot send directly past a job taken here; it is released
/// again before the wait, and a submitter that leaves a tail wakes the wait.
async fn next_step(
    queue: &Queue,
    i: usize,
    dead: &AtomicBool,
    proto: &StreamProto,
    idle_now: bool,
) -> Step {
    let Some(t) = queue.taker(i) else {
        return Step::Stop;
    };
    let mut idle_now = idle_now;
    loop {
        if dead.load(Ordering::Acquire) {
            return Step::Stop;
        }
        {
            let mut g = proto.lock();
            if !g.tail.is_empty() {
                g.busy = true;
                return Step::Tail(std::mem::take(&mut g.tail));
            }
            if !g.proto.has_room() {
                return Step::Full;
            }
            g.busy = true;
        }
        match queue.next_or_wait(i, idle_now) {
            Next::Job(j) => return Step::Job(j),
            Next::Closed => {
                proto.lock().busy = false;
                return Step::Stop;
            }
            Next::Empty => {
                proto.lock().busy = false;
                t.waker().0.notified().await;
                t.rise();
                idle_now = proto.lock().proto.in_flight() == 0;
            }
        }
    }
}

/// Stream `i`'s sender stops taking jobs: what was dealt to it goes to the others, and what no
/// stream is left to take fails (never posted).
fn leave(queue: &Queue, i: usize) {
    for job in queue.leave(i) {
        job.not_posted(FailureKind::PeerLost);
    }
}

/// Deals `job` to another stream (after stream `i` left), or fails it if none is left.
fn hand_on(queue: &Queue, job: Job) {
    if let Err(job) = queue.hand_on(job) {
        job.not_posted(FailureKind::PeerLost);
    }
}

/// A data channel to one peer over TCP.
#[derive(Debug)]
pub struct TcpChannel {
    peer: SocketAddr,
    streams: ChannelStreams,
    queue: Arc<Queue>,
    chunk: u64,
    /// The peer takes vectored requests (protocol version 3): small ops are grouped.
    vectored: bool,
    /// Each stream's protocol state and send side, in stream order (for direct sends).
    protos: Vec<Arc<StreamProto>>,
    /// The transport's counters.
    stats: Arc<TcpStats>,
    /// Keeps the I/O threads of the streams running while the channel lives.
    _pool: Arc<IoPool>,
}

impl TcpChannel {
    /// Moves each stream to an I/O thread of `pool`, where its sender and receiver tasks run.
    pub(crate) fn new(
        peer: SocketAddr,
        sockets: Vec<TcpStream>,
        chunk: u64,
        depth: usize,
        vectored: bool,
        pool: &Arc<IoPool>,
        stats: &Arc<TcpStats>,
    ) -> std::io::Result<Self> {
        let depth = depth.max(1);
        let queue = Arc::new(Queue::new((0..sockets.len()).map(|_| TaskWake::default())));
        let mut streams = ChannelStreams::new();
        let mut protos = Vec::with_capacity(sockets.len());
        for (i, s) in sockets.into_iter().enumerate() {
            // Out of the caller's reactor, into the I/O thread's; duplicate descriptors stay
            // here to shut the socket down and to send directly from any thread.
            let std_socket = s.into_std()?;
            let control = std_socket.try_clone()?;
            let dead = Arc::new(AtomicBool::new(false));
            let proto = Arc::new(StreamProto {
                state: std::sync::Mutex::new(SendState {
                    proto: ClientStream::new(depth, AckPolicy::Immediate),
                    busy: false,
                    tail: Vec::new(),
                }),
                room: Notify::new(),
                socket: std_socket.try_clone()?,
                dead: dead.clone(),
            });
            protos.push(proto.clone());
            let d = dead.clone();
            let q = queue.clone();
            let spawned = pool.spawn(async move {
                let socket = match TcpStream::from_std(std_socket) {
                    Ok(s) => Arc::new(s),
                    Err(e) => {
                        debug!(%peer, stream = i, error = %e, "registering the stream failed");
                        d.store(true, Ordering::Release);
                        leave(&q, i);
                        return;
                    }
                };
                tokio::spawn(receiver(
                    socket.clone(),
                    d.clone(),
                    q.clone(),
                    proto.clone(),
                    peer,
                    i,
                ));
                sender(socket, d, q, proto, peer, i).await;
            });
            if let Err(e) = spawned {
                queue.close();
                return Err(e);
            }
            streams.push(dead, control);
        }
        Ok(Self {
            peer,
            streams,
            queue,
            chunk: chunk.max(1),
            vectored,
            protos,
            stats: stats.clone(),
            _pool: pool.clone(),
        })
    }

    /// Sends a request of one small chunk ([`direct_op`]) from the calling thread, on a stream
    /// that is idle (nothing in flight, its sender not taking or sending a chunk, nothing queued
    /// on the channel): one non-blocking `sendmsg` instead of a hand-over to the stream's sender task;
    /// the stream's receiver task, which waits on the socket idle or not, meets the response.
    /// What the kernel does not take at once is left for the sender task to send before
    /// anything else, so each socket carries its requests in sequence order. `false`: nothing
    /// was done, deal the request.
    fn send_direct(&self, ops: &[Op], control: &RequestControl, req: &Arc<Executing>) -> bool {
        let Some(op) = direct_op(ops, self.chunk) else {
            return false;
        };
        for (i, sp) in self.protos.iter().enumerate() {
            // A stream whose lock is taken is busy; its tasks hold it only briefly.
            let Ok(mut g) = sp.state.try_lock() else {
                continue;
            };
            if g.busy
                || !g.tail.is_empty()
                || g.proto.in_flight() > 0
                || g.proto.is_broken()
                || sp.dead.load(Ordering::Acquire)
            {
                continue;
            }
            // Requests dealt earlier and not taken yet go first.
            if self.queue.lock().queued() > 0 {
                return false;
            }
            control.with_ledger(|l| l.plan(0, 1));
            req.parts.add(1);
            let job = Work::One(Chunk {
                req: req.clone(),
                op: 0,
                at: 0,
                len: op.len,
            });
            let out = match g.proto.post(job) {
                Post::Send(out) => out,
                Post::Resolved => return true,
                Post::Broken(job) => {
                    // Not reached (checked above); hand it on as a leaving stream would.
                    drop(g);
                    hand_on(&self.queue, job);
                    return true;
                }
            };
            let sent = ferry_net::send_now(sp.socket.as_fd(), &out);
            self.stats.direct_sends.fetch_add(1, Ordering::Relaxed);
            if !matches!(sent, SentNow::Failed(_)) {
                // Sent, or its rest copied into the tail: the payload has left the buffer.
                g.proto.sent(out.seq);
            }
            let tail = match sent {
                SentNow::All => None,
                SentNow::Failed(e) => {
                    // The receiver task's wait ends with the socket and fails what is in
                    // flight, this chunk included.
                    debug!(peer = %self.peer, stream = i, error = %e, "send failed; stream closed");
                    let _ = sp.socket.shutdown(std::net::Shutdown::Both);
                    return true;
                }
                SentNow::Part(tail) => Some(tail),
            };
            if let Some(tail) = tail {
                self.stats.direct_tails.fetch_add(1, Ordering::Relaxed);
                g.tail = tail;
                drop(g);
                // The sender waits for work, or for room (with a depth of one).
                if let Some(t) = self.queue.taker(i) {
                    t.waker().wake();
                }
                sp.room.notify_one();
            }
            return true;
        }
        false
    }
}

impl Channel for TcpChannel {
    fn kind(&self) -> TransportKind {
        TransportKind::Tcp
    }

    fn execute(&self, ops: Arc<[Op]>, control: Arc<RequestControl>) -> BoxFuture<'static, Outcome> {
        let req = Executing::new(ops.clone(), control.clone());
        let closed = self.streams.is_closed();
        // Dealt now, before the future is first polled; each sender checks the request's stop
        // flag and failures again before it posts a chunk, and bounds what it has in flight.
        // A small request to an idle stream is sent from here; otherwise chunks are dealt (runs
        // of small ops as vectored requests of up to one chunk's bytes).
        if closed || !self.send_direct(&ops, &control, &req) {
            req.deal(
                &self.queue,
                self.chunk,
                self.vectored.then_some(self.chunk),
                closed,
            );
        }
        let settled = req.settle();
        Box::pin(async move {
            settled.await;
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

impl Drop for TcpChannel {
    fn drop(&mut self) {
        self.streams.shutdown_all();
        self.queue.close();
    }
}

/// What a stream's sender and receiver tasks and its direct submitters share: the stream
/// protocol's client state and its send side (the sender and submitters post, the receiver
/// matches responses; the tasks run on the stream's I/O thread, and a submitter only tries the
/// lock, so it is held briefly and rarely contended), the sender's wake-up when room frees in
/// flight, and the socket for direct sends.
#[derive(Debug)]
struct StreamProto {
    state: std::sync::Mutex<SendState>,
    room: Notify,
    /// A duplicate descriptor of the stream's socket: submitters send on it directly.
    socket: std::net::TcpStream,
    /// Set once the stream ended.
    dead: Arc<AtomicBool>,
}

/// A stream's protocol state and who may write its socket. Whoever holds the lock and finds the
/// send side free (not `busy`, no `tail`) posts (assigns the sequence number) and writes the
/// request in one go, so requests reach the socket in sequence order.
#[derive(Debug)]
struct SendState {
    proto: ClientStream<Executing>,
    /// The sender task is taking or sending a chunk (or a tail): nobody else writes the socket.
    busy: bool,
    /// Bytes of a direct send that the kernel did not take at once; the sender task sends them
    /// before anything else.
    tail: Vec<u8>,
}

impl StreamProto {
    fn lock(&self) -> std::sync::MutexGuard<'_, SendState> {
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

async fn sender(
    socket: Arc<TcpStream>,
    dead: Arc<AtomicBool>,
    queue: Arc<Queue>,
    proto: Arc<StreamProto>,
    peer: SocketAddr,
    index: usize,
) {
    let mut stage = vec![0u8; DATA_REQUEST_LEN + SMALL];
    'run: loop {
        // Room in flight first (or a tail to send), then a job: a job is never held while this
        // stream is full.
        let idle_now = loop {
            if dead.load(Ordering::Acquire) {
                break 'run;
            }
            {
                let g = proto.lock();
                if g.proto.has_room() || !g.tail.is_empty() {
                    break g.proto.in_flight() == 0;
                }
            }
            proto.room.notified().await;
        };
        let job = match next_step(&queue, index, &dead, &proto, idle_now).await {
            Step::Job(job) => job,
            Step::Full => continue,
            Step::Stop => break,
            Step::Tail(tail) => {
                let res = crate::io::send_buf(&socket, &tail).await;
                proto.lock().busy = false;
                if let Err(e) = res {
                    debug!(%peer, stream = index, error = %e, "send failed; stream closed");
                    dead.store(true, Ordering::Release);
                    shutdown(&socket);
                    break;
                }
                continue;
            }
        };
        if dead.load(Ordering::Acquire) {
            proto.lock().busy = false;
            leave(&queue, index);
            hand_on(&queue, job);
            break;
        }
        let posted = proto.lock().proto.post(job);
        let out = match posted {
            Post::Send(out) => out,
            Post::Resolved => {
                proto.lock().busy = false;
                continue;
            }
            Post::Broken(job) => {
                proto.lock().busy = false;
                leave(&queue, index);
                hand_on(&queue, job);
                break;
            }
        };
        let is_write = out.kind == OpKind::Write;
        let res = if !out.scatter.is_empty() {
            let mut parts = Vec::with_capacity(2 + if is_write { out.scatter.len() } else { 0 });
            parts.push(RawRange {
                addr: out.head.as_ptr() as usize,
                len: out.head.len(),
            });
            parts.push(RawRange {
                addr: out.table.as_ptr() as usize,
                len: out.table.len(),
            });
            if is_write {
                parts.extend(out.scatter.iter().map(|r| RawRange {
                    addr: r.region.as_ptr() as usize + r.at as usize,
                    len: r.len,
                }));
            }
            // SAFETY: the header and table live in `out` for the whole call; the stream
            // protocol checked each piece's range against its region at post, and the request
            // owns them until drained and keeps the regions alive (`out.scatter` holds Arcs).
            unsafe { send_vectored(&socket, &parts).await }
        } else if is_write && out.len <= SMALL {
            // Small payloads are staged with their header and sent in one call.
            let total = DATA_REQUEST_LEN + out.len;
            stage[..DATA_REQUEST_LEN].copy_from_slice(&out.head);
            match out
                .region
                .read_at(out.local_at, &mut stage[DATA_REQUEST_LEN..total])
            {
                Ok(()) => crate::io::send_buf(&socket, &stage[..total]).await,
                Err(e) => Err(std::io::Error::other(e.to_string())),
            }
        } else if is_write {
            let body = RawRange {
                addr: out.region.as_ptr() as usize + out.local_at as usize,
                len: out.len,
            };
            // SAFETY: the stream protocol checked the range against the region at post; the
            // request owns it until drained and keeps the region alive (the chunk in flight
            // holds an Arc).
            unsafe { send_all(&socket, &out.head, body).await }
        } else {
            crate::io::send_buf(&socket, &out.head).await
        };
        {
            let mut g = proto.lock();
            g.busy = false;
            if res.is_ok() {
                // A WRITE's answer counts only from here: its payload has left the buffer.
                g.proto.sent(out.seq);
            }
        }
        if let Err(e) = res {
            debug!(%peer, stream = index, error = %e, "send failed; stream closed");
            dead.store(true, Ordering::Release);
            // Wake the receiver: it fails everything in flight on this stream as lost.
            shutdown(&socket);
            break;
        }
    }
    // What was dealt to this stream goes to the others; the last one fails it.
    leave(&queue, index);
}

async fn receiver(
    socket: Arc<TcpStream>,
    dead: Arc<AtomicBool>,
    queue: Arc<Queue>,
    proto: Arc<StreamProto>,
    peer: SocketAddr,
    index: usize,
) {
    // Once nothing is in flight, the sender may take other streams' jobs: wake it, unless it
    // already waits as idle (a request sent directly past it). Room freed in flight wakes it
    // too.
    let settle = |in_flight: usize| {
        if in_flight == 0
            && let Some(t) = queue.taker(index)
            && !t.waits_idle()
        {
            t.waker().wake();
        }
        proto.room.notify_one();
    };
    let mut head = [0u8; DATA_RESPONSE_LEN];
    let broken = loop {
        if let Err(e) = recv_buf(&socket, &mut head).await {
            if proto.lock().proto.in_flight() > 0 {
                debug!(%peer, stream = index, error = %e, "receive failed; stream closed");
            }
            break e.raw_os_error();
        }
        let (resolved, in_flight) = {
            let mut st = proto.lock();
            (st.proto.on_response(&head), st.proto.in_flight())
        };
        let chunk = match resolved {
            Ok(Resolution::Done) => {
                settle(in_flight);
                continue;
            }
            Ok(Resolution::Pieces(pieces)) => {
                let parts: Vec<RawRange> = pieces
                    .iter()
                    .map(|c| RawRange {
                        addr: c.op().local.as_ptr() as usize + c.local_at() as usize,
                        len: c.payload_len() as usize,
                    })
                    .collect();
                // SAFETY: the stream protocol checked each piece's range against its region at
                // post; the request owns the ranges until drained, keeps the regions alive
                // through the chunks' Arcs, and no Rust reference to them exists (raw recv).
                if let Err(e) = unsafe { recv_vectored(&socket, &parts).await } {
                    debug!(%peer, stream = index, error = %e, "receive failed; stream closed");
                    let native = e.raw_os_error();
                    pieces.into_iter().for_each(|c| c.lost(native));
                    break native;
                }
                pieces.into_iter().for_each(Chunk::acked);
                settle(in_flight);
                continue;
            }
            Ok(Resolution::Payload(chunk)) => chunk,
            Err(v) => {
                debug!(%peer, stream = index, error = %v, "bad response; stream closed");
                break None;
            }
        };
        let dst = RawRange {
            addr: chunk.op().local.as_ptr() as usize + chunk.local_at() as usize,
            len: chunk.payload_len() as usize,
        };
        // SAFETY: the stream protocol checked the range against the region at post; the request
        // owns the range until drained, keeps the region alive through the chunk's Arc, and no
        // Rust reference to it exists (raw recv).
        if let Err(e) = unsafe { recv_exact(&socket, dst).await } {
            debug!(%peer, stream = index, error = %e, "receive failed; stream closed");
            let native = e.raw_os_error();
            chunk.lost(native);
            break native;
        }
        chunk.acked();
        settle(in_flight);
    };
    dead.store(true, Ordering::Release);
    shutdown(&socket);
    proto.lock().proto.fail_all(broken);
    // The sender may wait for room or a job: it sees the stream dead and hands its queue on.
    if let Some(t) = queue.taker(index) {
        t.waker().wake();
    }
    proto.room.notify_one();
}

#[cfg(test)]
mod tests {
    use std::io::{Read, Write};
    use std::net::TcpListener;
    use std::os::fd::AsRawFd;
    use std::sync::Arc;
    use std::sync::atomic::Ordering;
    use std::sync::mpsc;
    use std::time::{Duration, Instant};

    use ferry_core::wire::{
        ControlFrame, DATA_REQUEST_LEN, DATA_RESPONSE_LEN, DataRequest, DataResponse,
        SUPPORTED_VERSIONS, TransportOffer,
    };
    use ferry_core::{
        BoxFuture, Channel, Epoch, MemoryRegion, Op, OpKind, Outcome, PeerId, PeerInfo,
        RequestControl, SegmentToken,
    };

    use crate::{TcpConfig, TcpTransport};
    use ferry_core::dealer::DIRECT_MAX;

    /// Accepts one data stream on `l`, answering its attach.
    fn accept_stream(l: &TcpListener) -> std::net::TcpStream {
        let (mut s, _) = l.accept().unwrap();
        let mut head = [0u8; ferry_core::wire::CONTROL_HEADER_LEN];
        s.read_exact(&mut head).unwrap();
        let h = ferry_core::wire::ControlHeader::decode(&head).unwrap();
        let mut body = vec![0u8; h.body_len as usize];
        s.read_exact(&mut body).unwrap();
        let mut out = Vec::new();
        ControlFrame::StreamAccept
            .encode(SUPPORTED_VERSIONS.max, &mut out)
            .unwrap();
        s.write_all(&out).unwrap();
        s
    }

    /// A peer at `addr` that offers one TCP data stream.
    fn peer(addr: std::net::SocketAddr) -> PeerInfo {
        PeerInfo {
            addr,
            local_id: PeerId::random(),
            local_epoch: Epoch::fresh(),
            remote_id: PeerId::random(),
            remote_epoch: Epoch(1),
            offer: TransportOffer::Tcp {
                streams: 1,
                port: 0,
            },
            segments: vec![],
            session: None,
            key_name: None,
            version: SUPPORTED_VERSIONS.max,
        }
    }

    /// A fake peer's answer to one data request read from `s`: checks that its sequence number
    /// is `*seq` (then counts on), keeps a WRITE's payload in `mem` at its offset and answers a
    /// READ from `mem`. Returns the request, or `None` at the end of the stream.
    fn answer(s: &mut std::net::TcpStream, mem: &mut [u8], seq: &mut u32) -> Option<DataRequest> {
        let r = take(s, mem, seq)?;
        reply(s, mem, &r);
        Some(r)
    }

    /// [`answer`]'s first half: the request and a WRITE's payload, not answered.
    fn take(s: &mut std::net::TcpStream, mem: &mut [u8], seq: &mut u32) -> Option<DataRequest> {
        let mut h = [0u8; DATA_REQUEST_LEN];
        s.read_exact(&mut h).ok()?;
        let r = DataRequest::decode(&h).unwrap();
        assert_eq!(r.seq, *seq, "a request out of sequence");
        *seq += 1;
        if r.kind == OpKind::Write {
            s.read_exact(&mut mem[r.offset as usize..(r.offset + r.len) as usize])
                .unwrap();
        }
        Some(r)
    }

    /// [`answer`]'s second half.
    fn reply(s: &mut std::net::TcpStream, mem: &[u8], r: &DataRequest) {
        let range = r.offset as usize..(r.offset + r.len) as usize;
        let mut b = [0u8; DATA_RESPONSE_LEN];
        DataResponse {
            seq: r.seq,
            refused: None,
            len: if r.kind == OpKind::Read { r.len } else { 0 },
            also_acks: 0,
        }
        .encode(&mut b);
        s.write_all(&b).unwrap();
        if r.kind == OpKind::Read {
            s.write_all(&mem[range]).unwrap();
        }
    }

    fn region(len: usize, seed: u8) -> Arc<MemoryRegion> {
        let r = Arc::new(MemoryRegion::alloc_zeroed(len, 4096).unwrap());
        let v: Vec<u8> = (0..len)
            .map(|i| (i as u8).wrapping_mul(31) ^ seed)
            .collect();
        r.write_at(0, &v).unwrap();
        r
    }

    fn bytes(r: &MemoryRegion, at: u64, len: usize) -> Vec<u8> {
        let mut v = vec![0u8; len];
        r.read_at(at, &mut v).unwrap();
        v
    }

    /// One request of one op (`len` bytes at `at` on both sides), started, not yet awaited.
    fn request(
        ch: &dyn Channel,
        kind: OpKind,
        local: &Arc<MemoryRegion>,
        at: u64,
        len: u64,
    ) -> BoxFuture<'static, Outcome> {
        let ops: Arc<[Op]> = vec![Op {
            kind,
            local: local.clone(),
            local_offset: at,
            token: SegmentToken(9),
            remote_offset: at,
            len,
        }]
        .into();
        let control = Arc::new(RequestControl::new(&ops));
        ch.execute(ops, control)
    }

    /// A direct send the kernel takes only in part (the peer reads nothing yet and both socket
    /// buffers are as small as the kernel allows): the sender task sends the rest, and the peer
    /// sees that request whole and then the next one, in sequence.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_direct_send_the_kernel_takes_in_part_is_finished_by_the_sender() {
        const OP: usize = DIRECT_MAX - DATA_REQUEST_LEN;
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let small: libc::c_int = 1;
        // SAFETY: setting an int socket option on a listener we own; accepted sockets inherit
        // it.
        let rc = unsafe {
            libc::setsockopt(
                l.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_RCVBUF,
                (&small as *const libc::c_int).cast(),
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            )
        };
        assert_eq!(rc, 0);
        let addr = l.local_addr().unwrap();
        // One message per request the peer is to read (it reads nothing unasked); the last
        // one, `None`, ends it.
        let (go_tx, go_rx) = mpsc::channel::<Option<()>>();
        let server = std::thread::spawn(move || {
            let mut s = accept_stream(&l);
            let mut mem = vec![0u8; 2 * OP];
            let mut seq = 0;
            let mut lens = Vec::new();
            while let Ok(Some(())) = go_rx.recv() {
                let r = answer(&mut s, &mut mem, &mut seq).unwrap();
                lens.push(r.len);
            }
            (mem, lens)
        });
        let t = TcpTransport::new(TcpConfig {
            depth: 4,
            socket_buffer: Some(1),
            io_threads: Some(1),
            ..TcpConfig::default()
        });
        let ch = t.connect_channel(peer(addr)).await.unwrap();
        let src = region(2 * OP, 3);
        // Until a request is sent directly: a submitter that meets the sender task looking for
        // work deals its request instead (then the peer answers it, and we try again).
        let deadline = Instant::now() + Duration::from_secs(60);
        let mut dealt = 0;
        loop {
            assert!(Instant::now() < deadline, "no direct send in 60 s");
            let before = t.stats().direct_sends.load(Ordering::Relaxed);
            // The send happens in `execute`, before the future is polled.
            let fut = request(&ch, OpKind::Write, &src, 0, OP as u64);
            let direct = t.stats().direct_sends.load(Ordering::Relaxed) > before;
            go_tx.send(Some(())).unwrap();
            let o = tokio::time::timeout(Duration::from_secs(20), fut)
                .await
                .expect("a request cut short is never finished");
            assert!(o.is_success() && o.drained, "{o:?}");
            if direct {
                break;
            }
            dealt += 1;
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        assert_eq!(
            t.stats().direct_tails.load(Ordering::Relaxed),
            1,
            "the kernel took {OP} bytes at once"
        );
        go_tx.send(Some(())).unwrap();
        let o = request(&ch, OpKind::Write, &src, OP as u64, OP as u64).await;
        assert!(o.is_success() && o.drained, "{o:?}");
        assert!(ch.is_alive());
        go_tx.send(None).unwrap();
        let (mem, lens) = server.join().unwrap();
        assert_eq!(lens.len(), dealt + 2);
        assert!(mem == bytes(&src, 0, 2 * OP), "the peer's bytes differ");
    }

    /// A peer that answers a WRITE before reading its payload, then closes the stream with the
    /// payload unread: the answer does not make the WRITE complete (its payload never all
    /// left), so the request fails `PeerLost` with an uncertain remote effect, and is drained
    /// only once the sender let go of the payload. Taking the answer at its word would report
    /// success while the payload was still being read.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_write_answered_before_its_payload_is_read_is_not_complete() {
        const OP: usize = 8 << 20;
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let server = std::thread::spawn(move || {
            let mut s = accept_stream(&l);
            let mut h = [0u8; DATA_REQUEST_LEN];
            s.read_exact(&mut h).unwrap();
            let r = DataRequest::decode(&h).unwrap();
            assert_eq!(r.kind, OpKind::Write);
            let mut b = [0u8; DATA_RESPONSE_LEN];
            DataResponse {
                seq: r.seq,
                refused: None,
                len: 0,
                also_acks: 0,
            }
            .encode(&mut b);
            s.write_all(&b).unwrap();
            // Closed with the payload unread (a reset).
        });
        let t = TcpTransport::new(TcpConfig {
            depth: 1,
            socket_buffer: Some(1),
            io_threads: Some(1),
            ..TcpConfig::default()
        });
        let ch = t.connect_channel(peer(addr)).await.unwrap();
        let src = region(OP, 5);
        let o = request(&ch, OpKind::Write, &src, 0, OP as u64).await;
        server.join().unwrap();
        assert_eq!(
            o.failure.map(|f| f.kind),
            Some(ferry_core::FailureKind::PeerLost),
            "{o:?}"
        );
        assert_eq!(
            o.remote_effect,
            ferry_core::RemoteEffect::Uncertain,
            "{o:?}"
        );
        assert!(o.drained, "{o:?}");
    }

    /// The peer closes the stream instead of answering a request sent directly, and then a
    /// request is sent on the closed stream: both fail (neither hangs) and the channel is seen
    /// dead.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_peer_that_closes_while_the_caller_writes_fails_the_requests() {
        const OP: u64 = 64;
        let deadline = Instant::now() + Duration::from_secs(60);
        // A fresh peer and channel per try, until the request the peer does not answer was sent
        // directly (a submitter that meets the sender task looking for work deals its request).
        loop {
            assert!(Instant::now() < deadline, "no direct send in 60 s");
            let l = TcpListener::bind("127.0.0.1:0").unwrap();
            let addr = l.local_addr().unwrap();
            let server = std::thread::spawn(move || {
                let mut s = accept_stream(&l);
                let mut mem = vec![0u8; 4 * OP as usize];
                let mut seq = 0;
                // 64-byte WRITEs are answered; the first other request closes the stream.
                while let Some(r) = take(&mut s, &mut mem, &mut seq) {
                    if r.len != OP {
                        return;
                    }
                    reply(&mut s, &mem, &r);
                }
            });
            let t = TcpTransport::new(TcpConfig {
                io_threads: Some(1),
                ..TcpConfig::default()
            });
            let ch = t.connect_channel(peer(addr)).await.unwrap();
            let src = region(4 * OP as usize, 5);
            let o = request(&ch, OpKind::Write, &src, 0, OP).await;
            assert!(o.is_success(), "{o:?}");
            let before = t.stats().direct_sends.load(Ordering::Relaxed);
            let fut = request(&ch, OpKind::Write, &src, 0, 2 * OP);
            let direct = t.stats().direct_sends.load(Ordering::Relaxed) > before;
            let o = tokio::time::timeout(Duration::from_secs(20), fut)
                .await
                .expect("a closed stream's request hangs");
            assert!(!o.is_success(), "{o:?}");
            server.join().unwrap();
            // The receiver marks the stream dead before it fails what was in flight.
            assert!(
                !ch.is_alive(),
                "the channel is still alive after its stream ended"
            );
            let o = tokio::time::timeout(
                Duration::from_secs(20),
                request(&ch, OpKind::Write, &src, 0, OP),
            )
            .await
            .expect("a request on a dead channel hangs");
            assert!(!o.is_success(), "{o:?}");
            if direct {
                return;
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }

    /// Many tasks submit small WRITEs and READs and larger WRITEs (several chunks, always
    /// dealt) to one stream at once: some go out from their submitters, some through the
    /// sender task, and the peer sees every request in sequence with its bytes whole; on I/O
    /// threads and on the caller's runtime.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn requests_from_many_submitters_reach_the_socket_in_sequence() {
        for io_threads in [Some(1), None] {
            many_submitters(io_threads).await;
        }
    }

    async fn many_submitters(io_threads: Option<usize>) {
        const TASKS: u64 = 8;
        const EACH: u64 = 100;
        const OP: u64 = 64;
        const BIG: u64 = 48 << 10;
        // Each task's area: its small ops, then one large WRITE per ten small ones.
        const AREA: u64 = EACH * OP + EACH / 10 * BIG;
        let len = (TASKS * AREA) as usize;
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let server = std::thread::spawn(move || {
            let mut s = accept_stream(&l);
            let mut mem = vec![0u8; len];
            let mut seq = 0;
            while answer(&mut s, &mut mem, &mut seq).is_some() {}
            mem
        });
        let t = TcpTransport::new(TcpConfig {
            depth: 4,
            chunk_size: 16 << 10,
            io_threads,
            ..TcpConfig::default()
        });
        let ch = Arc::new(t.connect_channel(peer(addr)).await.unwrap());
        let src = region(len, 7);
        let back = Arc::new(MemoryRegion::alloc_zeroed(len, 4096).unwrap());
        let mut tasks = Vec::new();
        for k in 0..TASKS {
            let (ch, src, back) = (ch.clone(), src.clone(), back.clone());
            tasks.push(tokio::spawn(async move {
                let base = k * AREA;
                for i in 0..EACH {
                    let at = base + i * OP;
                    let w = request(&*ch, OpKind::Write, &src, at, OP).await;
                    assert!(w.is_success() && w.drained, "write {k}/{i}: {w:?}");
                    let r = request(&*ch, OpKind::Read, &back, at, OP).await;
                    assert!(r.is_success() && r.drained, "read {k}/{i}: {r:?}");
                    if i % 10 == 9 {
                        let at = base + EACH * OP + i / 10 * BIG;
                        let w = request(&*ch, OpKind::Write, &src, at, BIG).await;
                        assert!(w.is_success() && w.drained, "large write {k}/{i}: {w:?}");
                    }
                }
            }));
        }
        for task in tasks {
            task.await.unwrap();
        }
        assert!(ch.is_alive());
        let small = |r: &MemoryRegion| -> Vec<u8> {
            (0..TASKS)
                .flat_map(|k| bytes(r, k * AREA, (EACH * OP) as usize))
                .collect()
        };
        assert!(small(&back) == small(&src), "bytes read back differ");
        assert!(
            t.stats().direct_sends.load(Ordering::Relaxed) > 0,
            "no request was sent by its submitter"
        );
        drop(ch);
        let mem = server.join().unwrap();
        assert!(mem == bytes(&src, 0, len), "the peer's bytes differ");
    }

    /// A peer that refuses a large WRITE as soon as it read its header, before it read the
    /// payload: the request is over only once the sender task has written the payload (its
    /// refusal then stands), and a small request submitted meanwhile is not written past it (it
    /// waits for the send side), so the peer finds it whole and in sequence after the refused
    /// payload.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_request_answered_while_its_payload_is_written_keeps_the_next_behind_it() {
        // One chunk, more than both sockets' buffers hold (the kernel's maximum on loopback is
        // a few MiB), so its payload cannot all be written before the peer reads it.
        const BIG: usize = 32 << 20;
        const SMALL: u64 = 64;
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let (go_tx, go_rx) = mpsc::channel::<()>();
        let server = std::thread::spawn(move || {
            let mut s = accept_stream(&l);
            let mut h = [0u8; DATA_REQUEST_LEN];
            s.read_exact(&mut h).unwrap();
            let r = DataRequest::decode(&h).unwrap();
            assert_eq!((r.seq, r.len), (0, BIG as u64));
            let mut b = [0u8; DATA_RESPONSE_LEN];
            DataResponse {
                seq: 0,
                refused: Some(ferry_core::RemoteStatus::AccessDenied),
                len: 0,
                also_acks: 0,
            }
            .encode(&mut b);
            s.write_all(&b).unwrap();
            // The payload is read only once the client submitted the next request.
            go_rx.recv().unwrap();
            let mut payload = vec![0u8; BIG];
            s.read_exact(&mut payload).unwrap();
            let mut mem = vec![0u8; SMALL as usize];
            let mut seq = 1;
            let r = answer(&mut s, &mut mem, &mut seq).unwrap();
            (payload, r.len, mem)
        });
        let t = TcpTransport::new(TcpConfig {
            chunk_size: BIG as u64,
            socket_buffer: Some(256 << 10),
            io_threads: Some(1),
            ..TcpConfig::default()
        });
        let ch = t.connect_channel(peer(addr)).await.unwrap();
        let src = region(BIG, 11);
        let first = request(&ch, OpKind::Write, &src, 0, BIG as u64);
        let next = request(&ch, OpKind::Write, &src, 0, SMALL);
        go_tx.send(()).unwrap();
        // The refusal ends the request once its payload has left the buffer (not before).
        let o = tokio::time::timeout(Duration::from_secs(20), first)
            .await
            .expect("the refusal did not end the request");
        assert_eq!(
            o.failure.map(|f| f.kind),
            Some(ferry_core::FailureKind::Remote(
                ferry_core::RemoteStatus::AccessDenied
            )),
            "{o:?}"
        );
        assert!(o.drained, "{o:?}");
        let o = tokio::time::timeout(Duration::from_secs(20), next)
            .await
            .expect("the next request hangs");
        assert!(o.is_success() && o.drained, "{o:?}");
        let (payload, len, mem) = server.join().unwrap();
        assert!(
            payload == bytes(&src, 0, BIG),
            "the refused payload differs"
        );
        assert_eq!(len, SMALL);
        assert!(
            mem == bytes(&src, 0, SMALL as usize),
            "the next request's bytes differ"
        );
    }
}
