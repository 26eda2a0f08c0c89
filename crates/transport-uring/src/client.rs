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
//!
//! A request of one small chunk submitted while a stream is idle skips the hand-over: the
//! submitting thread posts it and writes it with one non-blocking `sendmsg`
//! ([`UringChannel::send_direct`]); the stream thread, whose receive stays armed while idle,
//! meets the response, and sends first whatever part of the request the kernel did not take.

use std::net::{SocketAddr, TcpStream};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ferry_core::dealer::{deal_ops, deal_ops_grouped};
use ferry_core::queue::{JobQueue, Next, Wake};
use ferry_core::stream::{AckPolicy, Chunk, ChunkOwner, ClientStream, Post, Resolution, Work};
use ferry_core::wire::{DATA_REQUEST_LEN, DATA_RESPONSE_LEN};
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
    /// The task awaiting a WRITE or READ it sent directly reads the response itself
    /// (`UringConfig::caller_receives`).
    pub(crate) caller_receives: bool,
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

/// A stream thread's wake-up: an eventfd its ring reads, so that new work, a submitter's
/// unsent tail or the channel's end ends the ring's wait.
#[derive(Debug)]
struct EventFd(OwnedFd);

impl EventFd {
    fn new() -> std::io::Result<Self> {
        // SAFETY: plain eventfd creation; the result is checked before use.
        let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC) };
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: eventfd returned a fresh descriptor that we now own.
        Ok(Self(unsafe { OwnedFd::from_raw_fd(fd) }))
    }
}

impl Wake for EventFd {
    fn wake(&self) {
        let one = 1u64.to_ne_bytes();
        // SAFETY: writing 8 bytes from a local array to our own eventfd.
        let _ = unsafe { libc::write(self.0.as_raw_fd(), one.as_ptr().cast(), 8) };
    }
}

type Queue = JobQueue<Job, EventFd>;

/// Requests of one chunk whose header and payload together are at most this many bytes are
/// sent by the submitting thread itself when a stream is idle ([`UringChannel::send_direct`]).
const DIRECT_MAX: usize = 16 << 10;

/// A stream's protocol state and its socket's send side, shared by the stream's thread and the
/// threads that submit to an idle stream themselves. Whoever holds the lock and finds the send
/// side free posts (assigns the sequence number) and writes the request in one go, so requests
/// reach the socket in sequence order.
#[derive(Debug)]
struct StreamShared {
    state: Mutex<SendState>,
    socket: Arc<TcpStream>,
    dead: Arc<AtomicBool>,
}

#[derive(Debug)]
struct SendState {
    proto: ClientStream<ReqShared>,
    /// The stream thread is taking or sending a chunk (or a tail): nobody else writes the
    /// socket.
    busy: bool,
    /// Bytes of a submitter's send that the kernel did not take at once; the stream thread
    /// sends them before anything else.
    tail: Vec<u8>,
    /// Who reads the socket's responses: the stream thread, or the task awaiting a request it
    /// sent directly (that task's number). Only the reader receives, and only under this lock.
    reader: Reader,
    /// Numbers the direct readers.
    readers: u64,
    /// The response header read so far (`resp_at` bytes of it), by whichever reader.
    resp: [u8; DATA_RESPONSE_LEN],
    resp_at: usize,
    /// The stream thread has a receive armed (or completed and not yet taken) on its ring: a
    /// direct reader must not be made meanwhile.
    recv_armed: bool,
    /// A READ's payload a direct reader is receiving (the chunk, bytes received): whoever reads
    /// next finishes it before the next header.
    payload: Option<(Chunk<ReqShared>, usize)>,
}

/// Who reads a stream's responses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Reader {
    /// The stream thread, with a receive armed on its ring while chunks are in flight.
    Ring,
    /// The task that awaits the one chunk in flight (its number): it receives without blocking
    /// when its runtime's reactor says the socket is readable, so no thread is woken but the
    /// one that runs it.
    Caller(u64),
}

impl StreamShared {
    fn lock(&self) -> std::sync::MutexGuard<'_, SendState> {
        match self.state.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        }
    }
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
            caller_receives,
        } = plan;
        let depth = depth.max(1);
        let wakes = (0..sockets.len())
            .map(|_| EventFd::new())
            .collect::<std::io::Result<Vec<_>>>()
            .map_err(|e| ferry_core::Error::io("create eventfd for", peer.to_string(), e))?;
        let queue = Arc::new(Queue::new(wakes));
        let mut streams = ChannelStreams::new();
        let mut shared = Vec::new();
        // On failure the threads started so far end (their sockets shut, the queue dropped).
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
            let policy = if loopback {
                AckPolicy::Loopback
            } else {
                AckPolicy::Network
            };
            let sh = Arc::new(StreamShared {
                state: Mutex::new(SendState {
                    proto: ClientStream::new(depth, policy),
                    busy: false,
                    tail: Vec::new(),
                    reader: Reader::Ring,
                    readers: 0,
                    resp: [0; DATA_RESPONSE_LEN],
                    resp_at: 0,
                    recv_armed: false,
                    payload: None,
                }),
                socket: socket.clone(),
                dead: dead.clone(),
            });
            shared.push(sh.clone());
            let fd = socket.as_raw_fd();
            // The thread creates its own ring (single-issuer rings belong to their creator) and
            // reports whether that worked before the channel is handed out.
            let (ready_tx, ready_rx) = mpsc::sync_channel::<std::io::Result<()>>(1);
            let cx = StreamCtx {
                splice,
                caller_receives,
                socket: socket.clone(),
                dead: dead.clone(),
                queue: queue.clone(),
                peer,
                index: i,
                stats: stats.clone(),
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
                            if let Some(t) = cx.queue.taker(i) {
                                io.set_wake(t.waker().0.as_raw_fd());
                            }
                            let _ = ready_tx.send(Ok(()));
                            stream(io, cx, sh)
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
            shared,
            stats,
            chunk: chunk.max(1),
            zero_copy,
            vectored,
            caller_receives,
        })
    }

    /// Sends a request of one small chunk from the calling thread, on a stream that is idle
    /// (nothing in flight, its thread not sending, nothing queued on the channel): one
    /// non-blocking `sendmsg` instead of a hand-over to the stream's thread, whose armed
    /// receive then meets the response. What the kernel does not take at once is left for the
    /// stream thread to send first. [`Direct::Dealt`]: nothing was done, deal the request.
    ///
    /// With [`SendPlan::caller_receives`], an idle stream's thread keeps no receive armed (only
    /// a poll for the socket's hang-up), and a WRITE or a READ of at most [`DIRECT_MAX`] bytes
    /// sent whole from a task on a tokio runtime makes that task the stream's reader
    /// ([`CallerRead`]); any other direct send wakes the stream thread to arm its receive.
    fn send_direct(&self, ops: &[Op], control: &RequestControl, req: &Arc<ReqShared>) -> Direct {
        let [op] = ops else {
            return Direct::Dealt;
        };
        let one_chunk = op.kind == OpKind::Checksum || op.len <= self.chunk;
        let payload = if op.kind == OpKind::Write { op.len } else { 0 };
        if !one_chunk || payload > (DIRECT_MAX - DATA_REQUEST_LEN) as u64 {
            return Direct::Dealt;
        }
        // A READ's payload is read by the task only while it is small: a large one comes in
        // many pieces, each a wake-up of the task, where the stream thread waits for it whole.
        let caller = self.caller_receives
            && (op.kind == OpKind::Write
                || (op.kind == OpKind::Read && op.len <= DIRECT_MAX as u64))
            && tokio::runtime::Handle::try_current().is_ok();
        for (i, sh) in self.shared.iter().enumerate() {
            // A stream whose lock is taken is busy; its thread holds it only briefly.
            let Ok(mut g) = sh.state.try_lock() else {
                continue;
            };
            if g.busy
                || !g.tail.is_empty()
                || g.proto.in_flight() > 0
                || g.proto.is_broken()
                || g.reader != Reader::Ring
                || g.resp_at > 0
                || g.payload.is_some()
                || (self.caller_receives && g.recv_armed)
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
            let body_len = if out.kind == OpKind::Write {
                out.len
            } else {
                0
            };
            let body = (out.region.as_ptr() as usize + out.local_at as usize) as *const u8;
            let iov = [
                libc::iovec {
                    iov_base: out.head.as_ptr() as *mut libc::c_void,
                    iov_len: out.head.len(),
                },
                libc::iovec {
                    iov_base: body as *mut libc::c_void,
                    iov_len: body_len,
                },
            ];
            // SAFETY: a zeroed msghdr is valid (no address, no control data); the iovecs point
            // at `out.head` (alive for the call) and at the chunk's payload, whose range the
            // stream protocol checked against the region `out.region` keeps alive.
            let sent = unsafe {
                let mut msg: libc::msghdr = std::mem::zeroed();
                msg.msg_iov = iov.as_ptr() as *mut libc::iovec;
                msg.msg_iovlen = if body_len > 0 { 2 } else { 1 };
                libc::sendmsg(
                    sh.socket.as_raw_fd(),
                    &msg,
                    libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL,
                )
            };
            let total = out.head.len() + body_len;
            IoStats::add(&self.stats.direct_sends, 1);
            let sent = if sent >= 0 {
                sent as usize
            } else {
                let e = std::io::Error::last_os_error();
                if !matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::Interrupted
                ) {
                    // The stream thread's armed receive ends with the socket and fails what is
                    // in flight, this chunk included.
                    debug!(peer = %self.peer, stream = i, error = %e, "send failed; stream closed");
                    shutdown(&sh.socket);
                    drop(g);
                    if self.caller_receives {
                        // The stream thread arms its receive, which ends with the socket.
                        self.wake_stream(i);
                    }
                    return Direct::Sent;
                }
                0
            };
            if sent < total {
                IoStats::add(&self.stats.direct_tails, 1);
                let mut tail = Vec::with_capacity(total - sent);
                let head_rest = out.head.get(sent..).unwrap_or(&[]);
                tail.extend_from_slice(head_rest);
                let body_from = sent.saturating_sub(out.head.len());
                // SAFETY: as for the send above; `body_from <= body_len`.
                tail.extend_from_slice(unsafe {
                    std::slice::from_raw_parts(body.add(body_from), body_len - body_from)
                });
                g.tail = tail;
                drop(g);
                self.wake_stream(i);
                return Direct::Sent;
            }
            if caller {
                g.readers += 1;
                let token = g.readers;
                g.reader = Reader::Caller(token);
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
                // Its thread keeps no receive armed while idle: it arms one now.
                self.wake_stream(i);
            }
            return Direct::Sent;
        }
        Direct::Dealt
    }

    /// Ends stream `i`'s thread's wait on its ring.
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
    /// Sent (or resolved, or failed with its stream); the stream thread meets the response.
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
    /// Not the reader any more (the stream thread took over: it meets the response).
    Gone,
    /// The stream ended or failed, or the response is not one op's: the stream thread is to
    /// read (and so fail) it.
    HandBack,
}

/// The task awaiting a WRITE or READ it sent directly, as its stream's reader (see [`Reader`]):
/// it receives the response header (then a READ's payload, into place) without blocking, under
/// the stream's lock, whenever its runtime's reactor finds the socket readable, and resolves
/// the chunk through the stream protocol. It stops being the reader when the chunk is resolved,
/// when the stream thread takes a new chunk (which takes the reading over, the header's bytes
/// or the payload's so far included), and when it is dropped or meets the stream's end, an error
/// or a response that is not one op's (it then hands the reading back and wakes the stream
/// thread). Either way the request completes through its countdown.
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
        // The stream thread meets the end or the error too, and fails what is in flight.
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
        // caught and taken as "no reactor" (the stream thread reads).
        let registered = std::panic::catch_unwind(|| {
            // SAFETY: `fd` is the stream's socket, which `self.sh` keeps open (and the same
            // description) for as long as this registration, which is dropped before `read`
            // returns.
            unsafe { tokio::io::unix::AsyncFd::register_with_interest(SocketFd(fd), interest) }
        });
        let afd = match registered {
            Ok(Ok(a)) => a,
            Ok(Err(e)) => {
                debug!(stream = self.index, error = %e, "cannot watch a stream socket; its thread reads");
                self.hand_back();
                return;
            }
            Err(_) => {
                debug!(
                    stream = self.index,
                    "no reactor to watch a stream socket; its thread reads"
                );
                self.hand_back();
                return;
            }
        };
        // The chunk may be resolved by the stream thread instead (it took the reading over, or
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
                    debug!(stream = self.index, error = %e, "reactor failed; the stream thread reads");
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
        if g.reader != Reader::Caller(self.token) {
            return Got::Gone;
        }
        if let Some((chunk, done)) = g.payload.as_ref() {
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
                        if let Some(p) = g.payload.as_mut() {
                            p.1 = done;
                        }
                        return Got::More;
                    }
                    if let Some((chunk, _)) = g.payload.take() {
                        chunk.acked();
                    }
                    g.reader = Reader::Ring;
                    Got::Done
                }
                Err(got) => got,
            };
        }
        let at = g.resp_at;
        let want = DATA_RESPONSE_LEN - at;
        // SAFETY: receives at most `want` bytes into the header buffer from `at` on, which the
        // lock held here keeps borrowed.
        let n = unsafe {
            libc::recv(
                fd,
                g.resp.as_mut_ptr().add(at).cast(),
                want,
                libc::MSG_DONTWAIT,
            )
        };
        let n = match received(n) {
            Ok(0) => return Got::HandBack,
            Ok(n) => n,
            Err(got) => return got,
        };
        g.resp_at += n;
        if g.resp_at < DATA_RESPONSE_LEN {
            return Got::More;
        }
        g.resp_at = 0;
        let head = g.resp;
        match g.proto.on_response(&head) {
            Ok(Resolution::Done) => {
                g.reader = Reader::Ring;
                Got::Done
            }
            Ok(Resolution::Payload(chunk)) if chunk.payload_len() == 0 => {
                chunk.acked();
                g.reader = Reader::Ring;
                Got::Done
            }
            Ok(Resolution::Payload(chunk)) => {
                g.payload = Some((chunk, 0));
                Got::More
            }
            resolved => {
                // One op sent directly is never a vectored request: the peer broke the
                // protocol. The stream is given up; its thread fails what is in flight.
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

    /// Makes the stream thread the reader again (if this still is) and wakes it.
    fn hand_back(&mut self) {
        if self.over {
            return;
        }
        self.over = true;
        {
            let mut g = self.sh.lock();
            if g.reader != Reader::Caller(self.token) {
                return;
            }
            g.reader = Reader::Ring;
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
        let req = Arc::new(ReqShared {
            ops: ops.clone(),
            control: control.clone(),
            parts: Arc::new(Countdown::new(1)),
        });
        // A small request to an idle stream is sent from here; otherwise chunks are dealt to
        // the stream threads now; each thread checks the request's stop flag and failures again
        // before it posts a chunk, and bounds what it has in flight.
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
            if self.vectored {
                // Runs of small ops go out as vectored requests of up to one chunk's bytes.
                deal_ops_grouped(
                    self.queue.dealer(),
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
                    self.queue.dealer(),
                    &ops,
                    &control,
                    self.chunk,
                    closed,
                    one,
                    Work::skipped,
                    wake,
                );
            }
        }
        let parts = req.parts.clone();
        drop(req);
        parts.done_one();
        Box::pin(async move {
            if let Some(mut c) = caller {
                c.read().await;
            }
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
        self.queue.close();
    }
}

/// What a stream thread owns besides its ring.
struct StreamCtx {
    splice: bool,
    /// See [`SendPlan::caller_receives`]: while idle (or while a direct reader reads) the
    /// thread keeps only a hang-up poll armed, no receive.
    caller_receives: bool,
    socket: Arc<TcpStream>,
    dead: Arc<AtomicBool>,
    queue: Arc<Queue>,
    peer: SocketAddr,
    index: usize,
    stats: Arc<IoStats>,
}

impl StreamCtx {
    /// The thread no longer waits on its ring.
    fn rise(&self) {
        if let Some(t) = self.queue.taker(self.index) {
            t.rise();
        }
    }
}

/// One stream's thread: it sends requests in order (WRITE payloads from registered memory) and
/// reads the responses with a receive kept armed on the same ring (idle or not), so that a
/// response arriving while the thread sends is picked up by that send's wait, with no second
/// thread to wake, and a response to a request a submitter sent itself wakes the thread.
fn stream(mut io: SockIo<NotifHold>, cx: StreamCtx, sh: Arc<StreamShared>) {
    let mut open = true;
    // Without `caller_receives` the thread is the only reader: it keeps the header it is
    // receiving to itself, with no lock per response (the shared one is for direct readers).
    let mut own = [0u8; DATA_RESPONSE_LEN];
    let mut own_at = 0usize;
    let broken = 'run: loop {
        // A READ's payload a direct reader left (it handed the reading back).
        if cx.caller_receives
            && let Err(native) = finish_payload(&mut io, &sh, &cx)
        {
            break 'run native;
        }
        // Responses that arrived meanwhile.
        while let Some(got) = io.take_armed() {
            let head = if !cx.caller_receives {
                match got {
                    Ok([]) => {
                        debug!(peer = %cx.peer, stream = cx.index, "peer closed the stream");
                        break 'run None;
                    }
                    Ok(bytes) => {
                        let n = bytes.len().min(DATA_RESPONSE_LEN - own_at);
                        own[own_at..own_at + n].copy_from_slice(&bytes[..n]);
                        own_at += n;
                    }
                    Err(e) => {
                        debug!(peer = %cx.peer, stream = cx.index, error = %e, "receive failed; stream closed");
                        break 'run e.raw_os_error();
                    }
                }
                (own_at == DATA_RESPONSE_LEN).then(|| {
                    own_at = 0;
                    own
                })
            } else {
                let mut g = sh.lock();
                g.recv_armed = false;
                match got {
                    Ok([]) => {
                        debug!(peer = %cx.peer, stream = cx.index, "peer closed the stream");
                        break 'run None;
                    }
                    Ok(bytes) => {
                        let at = g.resp_at;
                        let n = bytes.len().min(DATA_RESPONSE_LEN - at);
                        g.resp[at..at + n].copy_from_slice(&bytes[..n]);
                        g.resp_at += n;
                    }
                    Err(e) => {
                        debug!(peer = %cx.peer, stream = cx.index, error = %e, "receive failed; stream closed");
                        break 'run e.raw_os_error();
                    }
                }
                if g.resp_at == DATA_RESPONSE_LEN {
                    g.resp_at = 0;
                    Some(g.resp)
                } else {
                    None
                }
            };
            if let Some(head) = head
                && let Err(native) = on_response(&mut io, &head, &sh, &cx)
            {
                break 'run native;
            }
            if let Err(e) = arm(&mut io, &sh, &cx, own_at) {
                debug!(peer = %cx.peer, stream = cx.index, error = %e, "cannot arm a receive");
                break 'run None;
            }
        }
        if io.take_hangup() {
            let g = sh.lock();
            // With chunks in flight the armed receive meets the end (a direct reader, if any,
            // hands the reading back when it does).
            if g.reader == Reader::Ring && g.proto.in_flight() == 0 && g.resp_at == 0 {
                debug!(peer = %cx.peer, stream = cx.index, "peer closed the stream");
                break 'run None;
            }
        }
        if let Err(e) = arm(&mut io, &sh, &cx, own_at) {
            debug!(peer = %cx.peer, stream = cx.index, error = %e, "cannot arm a receive");
            break 'run None;
        }
        // What a submitter left unsent goes out before anything else.
        if let Err(native) = flush_tail(&mut io, &sh, &cx) {
            break 'run native;
        }
        // New work, while fewer than `depth` chunks are in flight. The send side is claimed
        // (`busy`) before the look, so that a submitter cannot send past a chunk taken here.
        let mut job = None;
        let (room, in_flight) = {
            let mut g = sh.lock();
            let room = open && g.proto.has_room();
            g.busy = room;
            (room, g.proto.in_flight())
        };
        if room {
            let idle = in_flight == 0;
            // Nothing found: the wait stays announced, so a job dealt after the last look writes
            // the eventfd.
            match cx.queue.next_or_wait(cx.index, idle) {
                Next::Job(j) => job = Some(j),
                Next::Closed => open = false,
                Next::Empty => {}
            }
        }
        let Some(job) = job else {
            let (in_flight, tail, resp_at) = {
                let mut g = sh.lock();
                g.busy = false;
                let payload = g.payload.is_some();
                (
                    g.proto.in_flight(),
                    !g.tail.is_empty(),
                    g.resp_at + own_at + usize::from(payload),
                )
            };
            if !open && in_flight == 0 && resp_at == 0 && !tail {
                cx.rise();
                break 'run None;
            }
            // Wait for a response, a zero-copy notification or new work (the wait was
            // announced above if new work could be taken; with `depth` chunks in flight posters need not
            // wake us: a response will; a submitter that leaves a tail writes the eventfd).
            if !tail {
                io.wait(Duration::from_secs(1));
            }
            cx.rise();
            continue;
        };
        cx.rise();
        if cx.caller_receives {
            // This chunk's response follows any a direct reader awaits: the thread reads both.
            let took = {
                let mut g = sh.lock();
                let took = g.reader != Reader::Ring;
                g.reader = Reader::Ring;
                took
            };
            if took {
                IoStats::add(&cx.stats.caller_handbacks, 1);
            }
            if let Err(native) = finish_payload(&mut io, &sh, &cx) {
                job.not_posted(FailureKind::PeerLost);
                break 'run native;
            }
            if let Err(e) = arm_recv(&mut io, &sh) {
                debug!(peer = %cx.peer, stream = cx.index, error = %e, "cannot arm a receive");
                break 'run None;
            }
        }
        let res = post(&mut io, job, &sh, &cx);
        sh.lock().busy = false;
        if let Err(native) = res {
            break 'run native;
        }
    };
    cx.dead.store(true, Ordering::Release);
    shutdown(&cx.socket);
    {
        let mut g = sh.lock();
        if let Some((chunk, _)) = g.payload.take() {
            chunk.lost(broken);
        }
        g.proto.fail_all(broken);
    }
    // The other streams take what was dealt to this one; the last one to end fails it.
    for job in cx.queue.leave(cx.index) {
        job.not_posted(FailureKind::PeerLost);
    }
    // Until they are notified the kernel may still read the buffers of zero-copy sends.
    io.finish(crate::FINISH_GRACE);
}

/// Arms what the stream thread waits on besides new work: a receive of the next response
/// header, unless [`SendPlan::caller_receives`] and no response is due to the thread (none in
/// flight, or a direct reader reads it); idle, a hang-up poll instead, which bytes arriving do
/// not end. (A direct reader meets the stream's end itself and hands the reading back.)
fn arm(
    io: &mut SockIo<NotifHold>,
    sh: &StreamShared,
    cx: &StreamCtx,
    own_at: usize,
) -> std::io::Result<()> {
    if !cx.caller_receives {
        // The thread's own header (`own_at` bytes of it so far); nothing shared to update.
        return if io.armed() {
            Ok(())
        } else {
            io.arm_recv(DATA_RESPONSE_LEN - own_at)
        };
    }
    let (due, idle) = {
        let g = sh.lock();
        let ring = g.reader == Reader::Ring;
        let pending = g.proto.in_flight() > 0 || g.resp_at > 0;
        (ring && pending, ring && !pending)
    };
    if due {
        arm_recv(io, sh)?;
    }
    if idle {
        io.arm_hangup()?;
    }
    Ok(())
}

/// Receives the rest of a READ's payload a direct reader started, if the thread is the reader
/// and one is left, into its chunk's memory (waiting on the ring). `Err`: the stream is broken.
fn finish_payload(
    io: &mut SockIo<NotifHold>,
    sh: &StreamShared,
    cx: &StreamCtx,
) -> Result<(), Option<i32>> {
    let left = {
        let mut g = sh.lock();
        if g.reader != Reader::Ring {
            return Ok(());
        }
        g.payload.take()
    };
    let Some((chunk, done)) = left else {
        return Ok(());
    };
    let len = chunk.payload_len() as usize;
    let ptr = (chunk.op().local.as_ptr() as usize + chunk.local_at() as usize + done) as *mut u8;
    // SAFETY: the stream protocol checked the chunk's range against its region at post; the
    // request owns the range until drained, keeps the region alive through the chunk's Arc,
    // and no Rust reference to it exists; `done <= len`.
    match unsafe { io.recv_exact(ptr, len - done) } {
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

/// Arms the receive of the next response header's rest, unless one is armed.
fn arm_recv(io: &mut SockIo<NotifHold>, sh: &StreamShared) -> std::io::Result<()> {
    if io.armed() {
        return Ok(());
    }
    let mut g = sh.lock();
    io.arm_recv(DATA_RESPONSE_LEN - g.resp_at)?;
    g.recv_armed = true;
    Ok(())
}

/// Sends what a submitter's send left over, if anything. `Err`: the stream is broken.
fn flush_tail(
    io: &mut SockIo<NotifHold>,
    sh: &StreamShared,
    cx: &StreamCtx,
) -> Result<(), Option<i32>> {
    let tail = {
        let mut g = sh.lock();
        if g.tail.is_empty() {
            return Ok(());
        }
        g.busy = true;
        std::mem::take(&mut g.tail)
    };
    let res = io.send_buf(&tail);
    sh.lock().busy = false;
    res.map_err(|e| {
        debug!(peer = %cx.peer, stream = cx.index, error = %e, "send failed; stream closed");
        e.raw_os_error()
    })
}

/// Sends one chunk's request (and WRITE payload); the receive for its response is armed
/// already. The caller holds the send side (`busy`). `Err` (with the native error, if any):
/// the stream is broken.
fn post(
    io: &mut SockIo<NotifHold>,
    job: Job,
    sh: &StreamShared,
    cx: &StreamCtx,
) -> Result<(), Option<i32>> {
    if cx.dead.load(Ordering::Acquire) {
        job.not_posted(FailureKind::PeerLost);
        return Ok(());
    }
    let (posted, tail) = {
        let mut g = sh.lock();
        let posted = g.proto.post(job);
        (posted, std::mem::take(&mut g.tail))
    };
    let out = match posted {
        Post::Send(out) => out,
        Post::Resolved => return Ok(()),
        Post::Broken(job) => {
            job.not_posted(FailureKind::PeerLost);
            return Ok(());
        }
    };
    let fail = |e: std::io::Error| {
        debug!(peer = %cx.peer, stream = cx.index, error = %e, "send failed; stream closed");
        e.raw_os_error()
    };
    // A submitter's leftover bytes precede this request on the wire.
    if !tail.is_empty() {
        io.send_buf(&tail).map_err(fail)?;
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
    res.map_err(fail)
}

/// Resolves the oldest chunks in flight with `head` (reading a READ's payload into registered
/// memory first). `Err`: the stream is broken.
fn on_response(
    io: &mut SockIo<NotifHold>,
    head: &[u8; DATA_RESPONSE_LEN],
    sh: &StreamShared,
    cx: &StreamCtx,
) -> Result<(), Option<i32>> {
    let resolved = sh.lock().proto.on_response(head);
    let chunk = match resolved {
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

    use ferry_core::queue::Wake;

    use super::EventFd;

    /// Whether `w`'s eventfd was written (and resets it).
    fn poked(w: &EventFd) -> bool {
        let mut p = libc::pollfd {
            fd: w.0.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: polling one descriptor of ours, no wait.
        let ready = unsafe { libc::poll(&mut p, 1, 0) } == 1;
        if ready {
            let mut b = [0u8; 8];
            // SAFETY: reading 8 bytes into a local array from our own readable eventfd.
            unsafe { libc::read(w.0.as_raw_fd(), b.as_mut_ptr().cast(), 8) };
        }
        ready
    }

    /// A wake-up before the ring waits is kept (the eventfd's counter) until read, once however
    /// many came (the queue's protocol: `ferry_core::queue`).
    #[test]
    fn a_wake_before_the_wait_is_kept_until_read() {
        let w = EventFd::new().unwrap();
        assert!(!poked(&w));
        w.wake();
        w.wake();
        assert!(poked(&w));
        assert!(!poked(&w));
    }
}
