//! The client side: a channel of several data streams to one peer incarnation.
//!
//! Every stream runs on one of the transport's client rings ([`rings`]: a fixed set, one per CPU
//! by default, [`UringConfig::client_rings`](crate::config::UringConfig::client_rings)), a state machine
//! around [`ClientStream`] with no thread of its own: it takes chunks dealt to it, writes their
//! requests and WRITE payloads in order (SEND_ZC from registered memory where the configuration
//! sends zero-copy, vmsplice + splice to a loopback peer, a copying send otherwise) and keeps
//! one receive for the next response armed, READ payloads landing straight in registered
//! memory. Responses on a stream come back in request order, so the stream matches them with a
//! FIFO of in-flight chunks (bounded by `depth`) and checks the sequence number. A request is
//! drained once every chunk is resolved *and* every zero-copy notification of its sends arrived.
//! With [`UringConfig::caller_receives`](crate::config::UringConfig::caller_receives) a task awaiting a
//! small request it sent directly relieves the ring of reading its response ([`CallerRead`]).
//!
//! A request of one small chunk submitted while a stream is idle skips the hand-over: the
//! submitting thread posts it and writes it with one non-blocking `sendmsg`
//! ([`UringChannel::send_direct`]); the stream's armed receive meets the response, and what part
//! of the request the kernel did not take is sent first by the stream's driver.

mod conn;
mod owners;
mod reactor;
mod recv;
mod rings;
mod send;
mod state;
mod stream;

use std::net::{SocketAddr, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use ferry_core::countdown::{Countdown, Executing};
use ferry_core::dealer::{DIRECT_MAX, direct_op};
use ferry_core::queue::Wake;
use ferry_core::stream::{AckPolicy, Chunk, ClientStream, Post, Resolution, Work};
use ferry_core::{
    BoxFuture, Channel, FailureKind, Op, OpKind, Outcome, RequestControl, TransportKind,
};
use ferry_net::{ChannelStreams, SentNow};
use tracing::debug;

use owners::Owners;
pub(crate) use rings::{ClientRings, RingPlan};
use state::{Queue, SendState, StreamShared, shutdown};

use crate::ring::IoStats;

/// How a channel's streams send payloads, and who drives them.
#[derive(Clone, Copy, Debug)]
pub(crate) struct SendPlan {
    /// SEND_ZC (else SEND).
    pub(crate) zero_copy: bool,
    /// vmsplice + SPLICE for WRITE payloads (loopback peers).
    pub(crate) splice: bool,
    /// Stream `i` on client ring `i` (loopback, several streams), pinned to the `i`-th allowed
    /// CPU as the server's ring `i` is.
    pub(crate) pin: bool,
    /// The peer is on this host (loopback): no flight time to cover, so the server may hold back
    /// responses for all but one chunk in flight, not just for half of them ([`AckPolicy`]).
    pub(crate) loopback: bool,
    /// The peer takes vectored requests (protocol version 3): runs of small ops are grouped.
    pub(crate) vectored: bool,
    /// The task awaiting a WRITE or READ it sent directly reads the response itself
    /// (`UringConfig::caller_receives`).
    pub(crate) caller_receives: bool,
}

/// A data channel to one peer, driven by io_uring.
#[derive(Debug)]
pub struct UringChannel {
    peer: SocketAddr,
    streams: ChannelStreams,
    queue: Arc<Queue>,
    /// Each stream's shared state, by stream index.
    shared: Vec<Arc<StreamShared>>,
    stats: Arc<IoStats>,
    chunk: u64,
    zero_copy: bool,
    vectored: bool,
    caller_receives: bool,
}

impl UringChannel {
    /// A channel over `sockets` (each an attached data stream), its streams run on `rings`.
    pub(crate) fn new(
        peer: SocketAddr,
        sockets: Vec<TcpStream>,
        chunk: u64,
        depth: usize,
        plan: SendPlan,
        rings: &ClientRings,
        stats: Arc<IoStats>,
    ) -> Result<Self, ferry_core::Error> {
        let depth = depth.max(1);
        // Each stream's ring is chosen first: its wake-up names it.
        let places: Vec<usize> = (0..sockets.len())
            .map(|i| rings.place(i, plan.pin))
            .collect();
        let wakes = places.iter().map(|&at| rings.wake_for(at));
        let queue = Arc::new(Queue::new(wakes));
        let mut streams = ChannelStreams::new();
        let mut shared = Vec::new();
        // On failure the streams started so far end (their sockets shut, the queue dropped).
        let abandon = |streams: &ChannelStreams, queue: &Queue| {
            streams.shutdown_all();
            queue.close();
        };
        for (i, s) in sockets.into_iter().enumerate() {
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
            let policy = if plan.loopback {
                AckPolicy::Loopback
            } else {
                AckPolicy::Network
            };
            let sh = Arc::new(StreamShared {
                state: Mutex::new(SendState {
                    proto: ClientStream::new(depth, policy),
                    owners: Owners::default(),
                }),
                socket: socket.clone(),
                dead: dead.clone(),
            });
            shared.push(sh.clone());
            let failed = rings
                .attach(
                    places[i],
                    rings::NewStream {
                        sh,
                        queue: queue.clone(),
                        index: i,
                        peer,
                        zero_copy: plan.zero_copy,
                        splice: plan.splice,
                        caller_receives: plan.caller_receives,
                        pin: plan.pin,
                    },
                )
                .err()
                .map(|e| {
                    ferry_core::Error::io(
                        "attach a stream to a client ring for",
                        peer.to_string(),
                        e,
                    )
                });
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
            shared,
            stats,
            chunk: chunk.max(1),
            zero_copy: plan.zero_copy,
            vectored: plan.vectored,
            caller_receives: plan.caller_receives,
        })
    }

    /// Sends a request of one small chunk from the calling thread, on a stream that is idle
    /// (nothing in flight, its ring not sending, nothing queued on the channel): one
    /// non-blocking `sendmsg` instead of a hand-over to the stream's ring, whose armed
    /// receive then meets the response. What the kernel does not take at once is left for the
    /// stream's ring to send first. [`Direct::Dealt`]: nothing was done, deal the request.
    ///
    /// With [`SendPlan::caller_receives`], an idle stream's ring keeps no receive armed (only
    /// a poll for the socket's hang-up), and a WRITE or a READ of at most [`DIRECT_MAX`] bytes
    /// sent whole from a task on a tokio runtime makes that task the stream's reader
    /// ([`CallerRead`]); any other direct send wakes the stream's ring to arm its receive.
    fn send_direct(&self, ops: &[Op], control: &RequestControl, req: &Arc<Executing>) -> Direct {
        let Some(op) = direct_op(ops, self.chunk) else {
            return Direct::Dealt;
        };
        // A READ's payload is read by the task only while it is small: a large one comes in
        // many pieces, each a wake-up of the task, where the stream's ring waits for it whole.
        let caller = self.caller_receives
            && (op.kind == OpKind::Write
                || (op.kind == OpKind::Read && op.len <= DIRECT_MAX as u64))
            && reactor::may_watch();
        // Streams whose lock is taken are looked at last, waiting for it: the ring holds it only
        // briefly (a response's bookkeeping, its tick), and such a stream may well be idle.
        let mut locked = Vec::new();
        let (mut k, mut l) = (0, 0);
        loop {
            let (i, wait) = if k < self.shared.len() {
                k += 1;
                (k - 1, false)
            } else if l < locked.len() {
                l += 1;
                (locked[l - 1], true)
            } else {
                break;
            };
            let sh = &self.shared[i];
            let mut g = if wait {
                sh.lock()
            } else {
                match sh.state.try_lock() {
                    Ok(g) => g,
                    Err(_) => {
                        locked.push(i);
                        continue;
                    }
                }
            };
            if !g.owners.may_send_directly(self.caller_receives)
                || g.proto.in_flight() > 0
                || g.proto.is_broken()
                || sh.dead.load(Ordering::Acquire)
            {
                continue;
            }
            // Requests dealt earlier and not taken yet go first.
            if self.queue.lock().queued() > 0 {
                return Direct::Dealt;
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
                Post::Resolved => return Direct::Sent,
                Post::Broken(job) => {
                    // Not reached (checked above); hand it on like a leaving stream would.
                    drop(g);
                    if let Err(job) = self.queue.hand_on(job) {
                        job.not_posted(FailureKind::PeerLost);
                    }
                    return Direct::Sent;
                }
            };
            // SAFETY: the stream's socket, which `sh` keeps open.
            let fd = unsafe { std::os::fd::BorrowedFd::borrow_raw(sh.socket.as_raw_fd()) };
            let sent = ferry_net::send_now(fd, &out);
            IoStats::add(&self.stats.direct_sends, 1);
            if !matches!(sent, SentNow::Failed(_)) {
                // Sent, or its rest copied into the tail: the payload has left the buffer.
                g.proto.sent(out.seq);
            }
            match sent {
                SentNow::All => {}
                SentNow::Failed(e) => {
                    // The stream's ring's armed receive ends with the socket and fails what is
                    // in flight, this chunk included.
                    debug!(peer = %self.peer, stream = i, error = %e, "send failed; stream closed");
                    shutdown(&sh.socket);
                    drop(g);
                    if self.caller_receives {
                        // The stream's ring arms its receive, which ends with the socket.
                        self.wake_stream(i);
                    }
                    return Direct::Sent;
                }
                SentNow::Part(tail) => {
                    IoStats::add(&self.stats.direct_tails, 1);
                    g.owners.leave_tail(tail);
                    drop(g);
                    self.wake_stream(i);
                    return Direct::Sent;
                }
            }
            if caller {
                let token = g.owners.caller_reads();
                drop(g);
                // Should the task not poll for its response, the ring reads it after a tick.
                if let Some(t) = self.queue.taker(i) {
                    t.waker().watch(token);
                }
                return Direct::Caller(CallerRead {
                    sh: sh.clone(),
                    parts: req.parts.clone(),
                    queue: self.queue.clone(),
                    index: i,
                    token,
                    stats: self.stats.clone(),
                    over: false,
                });
            }
            drop(g);
            if self.caller_receives {
                // Its ring keeps no receive armed while idle: it arms one now.
                self.wake_stream(i);
            }
            return Direct::Sent;
        }
        Direct::Dealt
    }

    /// Wakes stream `i` on its ring.
    fn wake_stream(&self, i: usize) {
        if let Some(t) = self.queue.taker(i) {
            t.waker().wake();
        }
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

/// What [`UringChannel::send_direct`] did with a request.
enum Direct {
    /// Nothing: deal it to the streams.
    Dealt,
    /// Sent (or resolved, or failed with its stream); the stream's ring meets the response.
    Sent,
    /// Sent whole; the awaiting task reads the response.
    Caller(CallerRead),
}

/// What one receive of a direct reader found.
enum Got {
    /// The chunk is resolved.
    Done,
    /// Nothing to read yet.
    Empty,
    /// Some bytes of the header: read again.
    More,
    /// Not the reader any more (the stream's ring took over: it meets the response).
    Gone,
    /// The stream ended or failed, or the response is not one op's: the stream's ring is to
    /// read (and so fail) it.
    HandBack,
}

/// The task awaiting a WRITE or READ it sent directly, as its stream's reader (see [`Reader`](owners::Reader)):
/// it receives the response header (then a READ's payload, into place) without blocking, under
/// the stream's lock, whenever its runtime's reactor finds the socket readable, and resolves
/// the chunk through the stream protocol. It stops being the reader when the chunk is resolved,
/// when the stream's ring takes a new chunk (which takes the reading over, the header's bytes
/// or the payload's so far included), and when it is dropped or meets the stream's end, an error
/// or a response that is not one op's (it then hands the reading back and wakes the stream on
/// its ring). Either way the request completes through its countdown.
struct CallerRead {
    sh: Arc<StreamShared>,
    /// The request's countdown.
    parts: Arc<Countdown>,
    queue: Arc<Queue>,
    index: usize,
    token: u64,
    stats: Arc<IoStats>,
    /// No longer the reader.
    over: bool,
}

/// What a non-blocking receive's return value `n` means to a direct reader: bytes received
/// (0: the stream's end), or what to do instead.
fn received(n: isize) -> Result<usize, Got> {
    if n >= 0 {
        return Ok(n as usize);
    }
    let e = std::io::Error::last_os_error();
    Err(match e.kind() {
        std::io::ErrorKind::WouldBlock => Got::Empty,
        std::io::ErrorKind::Interrupted => Got::More,
        // The stream's ring meets the end or the error too, and fails what is in flight.
        _ => Got::HandBack,
    })
}

/// The stream's socket as the reactor sees it; borrowed, never closed by it.
struct SocketFd(std::os::fd::RawFd);

impl AsRawFd for SocketFd {
    fn as_raw_fd(&self) -> std::os::fd::RawFd {
        self.0
    }
}

impl CallerRead {
    /// Reads the response (or stops being the reader); the caller then waits on the countdown.
    async fn read(&mut self) {
        let fd = self.sh.socket.as_raw_fd();
        let interest = tokio::io::Interest::READABLE;
        // The reactor must have I/O enabled: a runtime built without it panics here, which is
        // caught quietly and taken as "no reactor" (the stream's ring reads; the runtime's
        // later requests are read by their rings from the start).
        let registered = reactor::quietly(|| {
            // SAFETY: `fd` is the stream's socket, which `self.sh` keeps open (and the same
            // description) for as long as this registration, which is dropped before `read`
            // returns.
            unsafe { tokio::io::unix::AsyncFd::register_with_interest(SocketFd(fd), interest) }
        });
        let afd = match registered {
            Some(Ok(a)) => a,
            Some(Err(e)) => {
                debug!(stream = self.index, error = %e, "cannot watch a stream socket; its ring reads");
                self.hand_back();
                return;
            }
            None => {
                debug!(
                    stream = self.index,
                    "no reactor to watch a stream socket; its ring reads"
                );
                self.hand_back();
                return;
            }
        };
        // The chunk may be resolved by the stream's ring instead (it took the reading over, or
        // the stream ended): then the socket need never become readable again.
        let mut resolved = std::pin::pin!(self.parts.clone().wait());
        loop {
            let ready = std::future::poll_fn(|cx| {
                if resolved.as_mut().poll(cx).is_ready() {
                    return std::task::Poll::Ready(None);
                }
                afd.poll_read_ready(cx).map(Some)
            })
            .await;
            let mut ready = match ready {
                Some(Ok(r)) => r,
                None => {
                    self.over = true;
                    return;
                }
                Some(Err(e)) => {
                    debug!(stream = self.index, error = %e, "reactor failed; the stream's ring reads");
                    self.hand_back();
                    return;
                }
            };
            loop {
                match self.receive(fd) {
                    Got::Done => {
                        IoStats::add(&self.stats.caller_receives, 1);
                        self.over = true;
                        return;
                    }
                    Got::More => continue,
                    Got::Empty => {
                        ready.clear_ready();
                        break;
                    }
                    Got::Gone => {
                        self.over = true;
                        return;
                    }
                    Got::HandBack => {
                        self.hand_back();
                        return;
                    }
                }
            }
        }
    }

    /// One non-blocking receive of the header's rest (or of a READ's payload), under the
    /// stream's lock.
    fn receive(&self, fd: std::os::fd::RawFd) -> Got {
        let mut g = self.sh.lock();
        if !g.owners.reads(self.token) {
            return Got::Gone;
        }
        if let Some((chunk, done)) = g.owners.payload() {
            let len = chunk.payload_len() as usize;
            let ptr =
                (chunk.op().local.as_ptr() as usize + chunk.local_at() as usize + done) as *mut u8;
            // SAFETY: the stream protocol checked the chunk's range against its region at post;
            // the request owns the range until drained, keeps the region alive through the
            // chunk's Arc, and no Rust reference to it exists; at most the `len - done` bytes
            // not yet received are written.
            let n = unsafe { libc::recv(fd, ptr.cast(), len - done, libc::MSG_DONTWAIT) };
            return match received(n) {
                Ok(0) => Got::HandBack,
                Ok(n) => {
                    let done = done + n;
                    if done < len {
                        g.owners.payload_at(done);
                        return Got::More;
                    }
                    if let Some((chunk, _)) = g.owners.take_payload() {
                        chunk.acked();
                    }
                    g.owners.ring_reads();
                    Got::Done
                }
                Err(got) => got,
            };
        }
        let rest = g.owners.header_rest();
        // SAFETY: receives at most the header's missing bytes into its rest, which the lock
        // held here keeps borrowed.
        let n = unsafe { libc::recv(fd, rest.as_mut_ptr().cast(), rest.len(), libc::MSG_DONTWAIT) };
        let n = match received(n) {
            Ok(0) => return Got::HandBack,
            Ok(n) => n,
            Err(got) => return got,
        };
        let Some(head) = g.owners.header_read(n) else {
            return Got::More;
        };
        match g.proto.on_response(&head) {
            Ok(Resolution::Done) => {
                g.owners.ring_reads();
                Got::Done
            }
            Ok(Resolution::Payload(chunk)) if chunk.payload_len() == 0 => {
                chunk.acked();
                g.owners.ring_reads();
                Got::Done
            }
            Ok(Resolution::Payload(chunk)) => {
                g.owners.payload_comes(chunk);
                Got::More
            }
            resolved => {
                // One op sent directly is never a vectored request: the peer broke the
                // protocol. The stream is given up; its ring fails what is in flight.
                match resolved {
                    Ok(Resolution::Pieces(ps)) => ps.into_iter().for_each(|c| c.lost(None)),
                    Ok(Resolution::Done | Resolution::Payload(_)) => {}
                    Err(v) => {
                        debug!(stream = self.index, error = %v, "bad response; stream closed")
                    }
                }
                shutdown(&self.sh.socket);
                Got::HandBack
            }
        }
    }

    /// Makes the stream's ring the reader again (if this still is) and wakes it.
    fn hand_back(&mut self) {
        if self.over {
            return;
        }
        self.over = true;
        if !self.sh.lock().owners.give_back(self.token) {
            return;
        }
        IoStats::add(&self.stats.caller_handbacks, 1);
        if let Some(t) = self.queue.taker(self.index) {
            t.waker().wake();
        }
    }
}

impl Drop for CallerRead {
    fn drop(&mut self) {
        self.hand_back();
    }
}

impl Channel for UringChannel {
    fn kind(&self) -> TransportKind {
        TransportKind::Uring
    }

    fn execute(&self, ops: Arc<[Op]>, control: Arc<RequestControl>) -> BoxFuture<'static, Outcome> {
        let closed = self.streams.is_closed();
        let req = Executing::new(ops.clone(), control.clone());
        // A small request to an idle stream is sent from here; otherwise chunks are dealt to
        // the streams now; each stream checks the request's stop flag and failures again
        // before it posts a chunk, and bounds what it has in flight.
        let direct = if closed {
            Direct::Dealt
        } else {
            self.send_direct(&ops, &control, &req)
        };
        let dealt = matches!(direct, Direct::Dealt);
        let caller = match direct {
            Direct::Caller(c) => Some(c),
            Direct::Dealt | Direct::Sent => None,
        };
        if dealt {
            // Runs of small ops go out as vectored requests of up to one chunk's bytes.
            req.deal(
                &self.queue,
                self.chunk,
                self.vectored.then_some(self.chunk),
                closed,
            );
        }
        let settled = req.settle();
        Box::pin(async move {
            if let Some(mut c) = caller {
                c.read().await;
            }
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

impl Drop for UringChannel {
    fn drop(&mut self) {
        self.streams.shutdown_all();
        self.queue.close();
    }
}
