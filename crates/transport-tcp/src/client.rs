//! The client side: a channel of several data streams to one peer incarnation.
//!
//! Each stream has a sender task (writes request headers and WRITE payloads straight from
//! registered memory) and a receiver task (reads responses and READ payloads straight into
//! registered memory), both on the stream's I/O thread (`pool.rs`). Chunks are dealt to the
//! streams in turn ([`Dealer`]); a stream with nothing in flight takes the oldest chunk of
//! another's queue, and a stream that dies hands its queue on. Each stream keeps at most `depth`
//! chunks in flight. Responses on a stream come back in request order, so the receiver
//! matches them with a FIFO of in-flight chunks (and checks the sequence number).

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use ferry_core::dealer::{deal_ops, deal_ops_grouped};
use ferry_core::queue::{JobQueue, Next, Wake};
use ferry_core::stream::{AckPolicy, Chunk, ChunkOwner, ClientStream, Post, Resolution, Work};
use ferry_core::wire::{DATA_REQUEST_LEN, DATA_RESPONSE_LEN};
use ferry_core::{
    BoxFuture, Channel, FailureKind, Op, OpKind, Outcome, RequestControl, TransportKind,
};
use ferry_net::ChannelStreams;
use tokio::net::TcpStream;
use tokio::sync::Notify;
use tracing::debug;

use crate::io::{RawRange, recv_buf, recv_exact, recv_vectored, send_all, send_vectored, shutdown};
use crate::pool::IoPool;

/// Payloads up to this size are staged with their header and sent in one call.
const SMALL: usize = 16 << 10;

/// One request being executed.
#[derive(Debug)]
struct ReqShared {
    ops: Arc<[Op]>,
    control: Arc<RequestControl>,
    /// Chunks handed to streams and not resolved yet, plus one held by the poster.
    outstanding: AtomicUsize,
    done: Notify,
}

impl ChunkOwner for ReqShared {
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

type Job = Work<ReqShared>;

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

/// The next job for stream `i`'s sender, waiting for one; `None` once the channel is gone (and
/// nothing is queued for it) or the stream died. `idle_now`: nothing is in flight on the
/// stream as the caller last looked; `idle` looks again after a wait.
async fn next_job(
    queue: &Queue,
    i: usize,
    dead: &AtomicBool,
    idle_now: bool,
    idle: impl Fn() -> bool,
) -> Option<Job> {
    let t = queue.taker(i)?;
    let mut idle_now = idle_now;
    loop {
        if dead.load(Ordering::Acquire) {
            return None;
        }
        match queue.next_or_wait(i, idle_now) {
            Next::Job(j) => return Some(j),
            Next::Closed => return None,
            Next::Empty => {
                t.waker().0.notified().await;
                t.rise();
                idle_now = idle();
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
    ) -> std::io::Result<Self> {
        let depth = depth.max(1);
        let queue = Arc::new(Queue::new((0..sockets.len()).map(|_| TaskWake::default())));
        let mut streams = ChannelStreams::new();
        for (i, s) in sockets.into_iter().enumerate() {
            // Out of the caller's reactor, into the I/O thread's; a duplicate descriptor stays
            // here to shut the socket down from any thread.
            let std_socket = s.into_std()?;
            let control = std_socket.try_clone()?;
            let dead = Arc::new(AtomicBool::new(false));
            let proto = Arc::new(StreamProto {
                state: std::sync::Mutex::new(ClientStream::new(depth, AckPolicy::Immediate)),
                room: Notify::new(),
            });
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
            _pool: pool.clone(),
        })
    }
}

impl Channel for TcpChannel {
    fn kind(&self) -> TransportKind {
        TransportKind::Tcp
    }

    fn execute(&self, ops: Arc<[Op]>, control: Arc<RequestControl>) -> BoxFuture<'static, Outcome> {
        let queue = &self.queue;
        let req = Arc::new(ReqShared {
            ops: ops.clone(),
            control: control.clone(),
            outstanding: AtomicUsize::new(1),
            done: Notify::new(),
        });
        let closed = self.streams.is_closed();
        // Dealt now, before the future is first polled; each sender checks the request's stop
        // flag and failures again before it posts a chunk, and bounds what it has in flight.
        let one = |op, at, len| {
            req.outstanding.fetch_add(1, Ordering::AcqRel);
            Work::One(Chunk {
                req: req.clone(),
                op,
                at,
                len,
            })
        };
        let undealt = |job: Job| {
            req.outstanding.fetch_sub(job.chunks(), Ordering::AcqRel);
        };
        let wake = |set| queue.wake_all_in(set);
        if self.vectored {
            // Runs of small ops go out as vectored requests of up to one chunk's bytes.
            deal_ops_grouped(
                queue.dealer(),
                &ops,
                &control,
                self.chunk,
                self.chunk,
                closed,
                one,
                |members| {
                    req.outstanding.fetch_add(members.len(), Ordering::AcqRel);
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
                undealt,
                wake,
            );
        } else {
            deal_ops(
                queue.dealer(),
                &ops,
                &control,
                self.chunk,
                closed,
                one,
                undealt,
                wake,
            );
        }
        // The poster's own count; `notify_one` stores a permit, so the last chunk's
        // notification is not lost if it comes before the future waits.
        let last = req.outstanding.fetch_sub(1, Ordering::AcqRel) == 1;
        Box::pin(async move {
            if !last {
                req.done.notified().await;
            }
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

/// What a stream's sender and receiver tasks share: the stream protocol's client state (the
/// sender posts, the receiver matches responses; both on the stream's I/O thread, so the lock is
/// never contended), and the sender's wake-up when room frees in flight.
#[derive(Debug)]
struct StreamProto {
    state: std::sync::Mutex<ClientStream<ReqShared>>,
    room: Notify,
}

impl StreamProto {
    fn lock(&self) -> std::sync::MutexGuard<'_, ClientStream<ReqShared>> {
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
        // Room in flight first, then a job: a job is never held while this stream is full.
        let idle_now = loop {
            if dead.load(Ordering::Acquire) {
                break 'run;
            }
            {
                let g = proto.lock();
                if g.has_room() {
                    break g.in_flight() == 0;
                }
            }
            proto.room.notified().await;
        };
        let idle = || proto.lock().in_flight() == 0;
        let Some(job) = next_job(&queue, index, &dead, idle_now, idle).await else {
            break;
        };
        if dead.load(Ordering::Acquire) {
            leave(&queue, index);
            hand_on(&queue, job);
            break;
        }
        let posted = proto.lock().post(job);
        let out = match posted {
            Post::Send(out) => out,
            Post::Resolved => continue,
            Post::Broken(job) => {
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
    // Once nothing is in flight, the sender may take other streams' jobs: wake it. Room freed
    // in flight wakes it too.
    let settle = |in_flight: usize| {
        if in_flight == 0
            && let Some(t) = queue.taker(index)
        {
            t.waker().wake();
        }
        proto.room.notify_one();
    };
    let mut head = [0u8; DATA_RESPONSE_LEN];
    let broken = loop {
        if let Err(e) = recv_buf(&socket, &mut head).await {
            if proto.lock().in_flight() > 0 {
                debug!(%peer, stream = index, error = %e, "receive failed; stream closed");
            }
            break e.raw_os_error();
        }
        let (resolved, in_flight) = {
            let mut st = proto.lock();
            (st.on_response(&head), st.in_flight())
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
    proto.lock().fail_all(broken);
    // The sender may wait for room or a job: it sees the stream dead and hands its queue on.
    settle(0);
}
