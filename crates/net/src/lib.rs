//! Socket plumbing that Ferry's two TCP data planes (`ferry-transport-tcp` on tokio,
//! `ferry-transport-uring` on rings) share, so that it is written once: how a data socket is
//! tuned (Nagle, buffers, the dead-peer limit), the receive low mark for large payloads, how a
//! server listens ([`listen`]) and waits after a failed accept ([`AcceptBackoff`]), the limits
//! on connections before their handshake is over ([`HandshakeGate`]), and the reading and
//! writing of control frames. What the bytes mean is `ferry_core::wire`,
//! `ferry_core::handshake` and `ferry_core::stream`, which do no I/O; this crate does only the
//! socket calls around them.
//!
//! The only `unsafe` code is the socket-option calls of [`set_recv_low_mark`] and
//! [`recv_low_mark`], and the one `sendmsg` of [`send_now`].
#![deny(unsafe_op_in_unsafe_fn)]

use std::collections::VecDeque;
use std::io::{Read, Write};
use std::net::{IpAddr, SocketAddr};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use ferry_core::Error;
use ferry_core::backoff::Backoff;
use ferry_core::wire::{CONTROL_HEADER_LEN, ControlFrame, ControlHeader, SUPPORTED_VERSIONS};

/// The default dead-peer limit of both data planes: a peer whose sent data stays unacknowledged
/// this long, or that answers no keepalive probe, is given up (see [`tune`]).
pub const DEAD_PEER_AFTER: Duration = Duration::from_secs(30);

/// Payload receives of more than this wake their reader only once this much has arrived (or the
/// rest of the payload, if less), through the socket's `SO_RCVLOWAT` ([`set_recv_low_mark`]);
/// the mark is back to 1 before a header is awaited.
pub const RECV_LOW_MARK: usize = 256 << 10;

/// Default of [`HandshakeLimits::timeout`].
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);
/// Default of [`HandshakeLimits::max_pending`].
pub const MAX_PENDING_HANDSHAKES: usize = 256;

/// What a server allows a connection before its handshake is over (a control exchange
/// answered, or a data stream attached): everything a peer sends then comes before it has
/// proven anything.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HandshakeLimits {
    /// The whole handshake must be over within this time from the accept, however the peer
    /// spreads its bytes; past it the connection is closed.
    pub timeout: Duration,
    /// Connections in their handshake at once; one accepted past it is closed at once.
    pub max_pending: usize,
}

impl Default for HandshakeLimits {
    fn default() -> Self {
        Self {
            timeout: HANDSHAKE_TIMEOUT,
            max_pending: MAX_PENDING_HANDSHAKES,
        }
    }
}

/// What a server's [`HandshakeGate`] has seen.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HandshakeStats {
    /// Connections in their handshake now.
    pub pending: u64,
    /// Connections closed at once because [`HandshakeLimits::max_pending`] were pending.
    pub refused: u64,
    /// Connections closed because their handshake outlasted [`HandshakeLimits::timeout`].
    pub timed_out: u64,
    /// Connections in their handshake closed to make room for a newer one
    /// ([`HandshakeGate::admit_evicting`]).
    pub evicted: u64,
}

/// A server's connections in their handshake: at most [`HandshakeLimits::max_pending`] at once,
/// each holding its [`HandshakeSlot`] until its handshake is over. Shared by the accept loop and
/// the connections of one listener.
///
/// Past the cap, [`admit`](Self::admit) refuses the newcomer, while
/// [`admit_evicting`](Self::admit_evicting) makes room for it: it shuts down the oldest pending
/// connection of the source address that holds the most, so a flood of idle connections (which
/// arrives first and sits) cannot keep a peer that is about to prove itself out, and one
/// source's flood gives way before another source's connection does. The decision is
/// [`HandshakeGate::victim`]'s, without I/O.
#[derive(Debug)]
pub struct HandshakeGate {
    limits: HandshakeLimits,
    pending: AtomicU64,
    refused: AtomicU64,
    timed_out: AtomicU64,
    evicted: AtomicU64,
    /// The connections admitted by `admit_evicting`, oldest first.
    watched: Mutex<Watched>,
}

#[derive(Debug, Default)]
struct Watched {
    next: u64,
    /// (slot id, source address, a duplicate of the socket to shut down on eviction)
    conns: VecDeque<(u64, IpAddr, OwnedFd)>,
}

impl HandshakeGate {
    /// A gate with `limits` and nothing pending.
    pub fn new(limits: HandshakeLimits) -> Arc<Self> {
        Arc::new(Self {
            limits,
            pending: AtomicU64::new(0),
            refused: AtomicU64::new(0),
            timed_out: AtomicU64::new(0),
            evicted: AtomicU64::new(0),
            watched: Mutex::default(),
        })
    }

    /// Its limits.
    pub fn limits(&self) -> HandshakeLimits {
        self.limits
    }

    /// Takes a place if one is free.
    fn take_place(&self) -> bool {
        let max = self.limits.max_pending as u64;
        self.pending
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < max).then_some(n + 1)
            })
            .is_ok()
    }

    /// Admits one more connection to its handshake, or counts it refused (`None`: close it at
    /// once) when [`HandshakeLimits::max_pending`] are pending.
    pub fn admit(self: &Arc<Self>) -> Option<HandshakeSlot> {
        if self.take_place() {
            Some(HandshakeSlot {
                gate: self.clone(),
                id: None,
            })
        } else {
            self.refused.fetch_add(1, Ordering::Relaxed);
            None
        }
    }

    /// Admits `socket`, a connection from `from`, to its handshake. When
    /// [`HandshakeLimits::max_pending`] are pending, the oldest connection of the source
    /// holding the most of those admitted this way is shut down (both directions: its reads
    /// end at once, whatever waits on them) and its place goes to `socket`; it is counted
    /// `evicted`. `None` (counted refused: close it at once) only when none of the pending
    /// connections was admitted this way. The gate keeps a duplicate of the socket's
    /// descriptor until the slot drops.
    pub fn admit_evicting(
        self: &Arc<Self>,
        socket: BorrowedFd<'_>,
        from: IpAddr,
    ) -> Option<HandshakeSlot> {
        let mut watched = self.watched.lock().unwrap_or_else(PoisonError::into_inner);
        let Ok(dup) = socket.try_clone_to_owned() else {
            // Out of descriptors: this one cannot be watched, so it is admitted as `admit` does.
            drop(watched);
            return self.admit();
        };
        if !self.take_place() {
            let sources: Vec<IpAddr> = watched.conns.iter().map(|(_, ip, _)| *ip).collect();
            let Some(i) = Self::victim(&sources) else {
                self.refused.fetch_add(1, Ordering::Relaxed);
                return None;
            };
            let Some((_, ip, fd)) = watched.conns.remove(i) else {
                self.refused.fetch_add(1, Ordering::Relaxed);
                return None;
            };
            // Its place passes to the newcomer: the evicted slot no longer frees one.
            if let Err(e) = socket2::SockRef::from(&fd).shutdown(std::net::Shutdown::Both) {
                tracing::debug!(from = %ip, error = %e, "shutting down an evicted connection");
            }
            self.evicted.fetch_add(1, Ordering::Relaxed);
            tracing::debug!(evicted = %ip, %from,
                "oldest connection in its handshake closed to admit a newer one");
        }
        let id = watched.next;
        watched.next += 1;
        watched.conns.push_back((id, from, dup));
        Some(HandshakeSlot {
            gate: self.clone(),
            id: Some(id),
        })
    }

    /// Which pending connection (by its source address, oldest first) makes room for a new
    /// one: the oldest of the source that holds the most. `None` when there is none.
    pub fn victim(sources: &[IpAddr]) -> Option<usize> {
        let held = |ip: &IpAddr| sources.iter().filter(|s| *s == ip).count();
        let most = sources.iter().map(held).max()?;
        sources.iter().position(|ip| held(ip) == most)
    }

    /// Counts a connection closed at the handshake deadline.
    pub fn note_timeout(&self) {
        self.timed_out.fetch_add(1, Ordering::Relaxed);
    }

    /// The counters now.
    pub fn stats(&self) -> HandshakeStats {
        HandshakeStats {
            pending: self.pending.load(Ordering::Acquire),
            refused: self.refused.load(Ordering::Relaxed),
            timed_out: self.timed_out.load(Ordering::Relaxed),
            evicted: self.evicted.load(Ordering::Relaxed),
        }
    }
}

/// One connection's place among a gate's pending handshakes; dropping it (the handshake is
/// over, or the connection closed) frees the place, unless the connection was evicted (its
/// place went to the connection that evicted it).
#[derive(Debug)]
pub struct HandshakeSlot {
    gate: Arc<HandshakeGate>,
    /// Its id among the watched connections (`admit_evicting`).
    id: Option<u64>,
}

impl HandshakeSlot {
    /// Whether the gate shut this connection down to make room for a newer one.
    pub fn evicted(&self) -> bool {
        let Some(id) = self.id else { return false };
        let watched = self
            .gate
            .watched
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        !watched.conns.iter().any(|(i, _, _)| *i == id)
    }
}

impl Drop for HandshakeSlot {
    fn drop(&mut self) {
        let Some(id) = self.id else {
            self.gate.pending.fetch_sub(1, Ordering::AcqRel);
            return;
        };
        let mut watched = self
            .gate
            .watched
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if let Some(i) = watched.conns.iter().position(|(i, _, _)| *i == id) {
            watched.conns.remove(i);
            self.gate.pending.fetch_sub(1, Ordering::AcqRel);
        }
    }
}

/// The backlog of a server's listener ([`listen`]): connections the kernel completes and queues
/// until the server accepts them.
pub const LISTEN_BACKLOG: i32 = 1024;

/// A server's listening socket on `addr` (port 0: any free one), and the address it is bound
/// to. Both data planes listen alike: `SO_REUSEADDR`, so that a restarted process takes the
/// same port again while its old connections linger; non-blocking, for an accept loop that
/// polls (tokio's reactor, or a `poll(2)` loop over the listener and the connections in their
/// handshake); and a backlog of [`LISTEN_BACKLOG`]. A failure is [`Error::Io`] naming the step
/// (`bind`, `local address of`) and `addr`.
pub fn listen(addr: SocketAddr) -> Result<(std::net::TcpListener, SocketAddr), Error> {
    let bind = || -> std::io::Result<std::net::TcpListener> {
        let sock = socket2::Socket::new(
            socket2::Domain::for_address(addr),
            socket2::Type::STREAM,
            Some(socket2::Protocol::TCP),
        )?;
        sock.set_reuse_address(true)?;
        sock.set_nonblocking(true)?;
        sock.bind(&addr.into())?;
        sock.listen(LISTEN_BACKLOG)?;
        Ok(sock.into())
    };
    let listener = bind().map_err(|e| Error::io("bind", addr.to_string(), e))?;
    let bound = listener
        .local_addr()
        .map_err(|e| Error::io("local address of", addr.to_string(), e))?;
    Ok((listener, bound))
}

/// The longest a server's first wait after a failed accept lasts ([`AcceptBackoff`]).
pub const ACCEPT_BACKOFF: Duration = Duration::from_millis(10);
/// The longest any wait after a failed accept lasts ([`AcceptBackoff`]).
pub const ACCEPT_BACKOFF_MAX: Duration = Duration::from_secs(1);

/// How long a server's accept loop leaves its listener alone after an accept fails (out of
/// descriptors, say: the listener stays readable, so accepting again at once would spin on the
/// same error). Every Ferry listener waits by this one rule: failure `n` in a row (from 0) waits
/// a random time up to `min(ACCEPT_BACKOFF_MAX, ACCEPT_BACKOFF * 2^n)`
/// ([`ferry_core::backoff::Backoff`]'s full jitter), and an accepted connection starts the
/// count again. No clock, no I/O: the loop sleeps, or stops polling the listener, for the wait.
#[derive(Debug)]
pub struct AcceptBackoff {
    backoff: Backoff,
}

impl AcceptBackoff {
    /// No failure yet, jittered by a generator seeded at random.
    pub fn new() -> Self {
        Self {
            backoff: Backoff::random(ACCEPT_BACKOFF, ACCEPT_BACKOFF_MAX),
        }
    }

    /// An accept returned a connection: the next failure waits as the first did.
    pub fn accepted(&mut self) {
        if self.backoff.attempts() > 0 {
            *self = Self::new();
        }
    }

    /// An accept failed: how long to leave the listener alone before the next.
    pub fn failed(&mut self) -> Duration {
        self.backoff.next_delay()
    }
}

impl Default for AcceptBackoff {
    fn default() -> Self {
        Self::new()
    }
}

/// Tunes a data socket: Nagle off; socket buffers of `size` where the kernel's maximum allows
/// that much (a smaller forced size would only disable autotuning and shrink them); and with
/// `dead_peer` set, the kernel gives up on the connection once sent data has gone
/// unacknowledged that long (`TCP_USER_TIMEOUT`, which also covers a peer whose application
/// stops reading), and an idle connection is probed from half that time on (keepalive), so a
/// peer that vanished without a word (host down, cable cut) ends the stream with `ETIMEDOUT`
/// instead of leaving its chunks in flight forever; the kernel then drops the sends' page
/// references too. Failures are logged, never fatal: the socket still works untuned.
pub fn tune(socket: &impl AsFd, size: Option<usize>, dead_peer: Option<Duration>) {
    let sock = socket2::SockRef::from(socket);
    if let Err(e) = sock.set_nodelay(true) {
        tracing::debug!(error = %e, "TCP_NODELAY");
    }
    if let Some(after) = dead_peer {
        if let Err(e) = sock.set_tcp_user_timeout(Some(after)) {
            tracing::debug!(error = %e, ?after, "TCP_USER_TIMEOUT");
        }
        let keepalive = socket2::TcpKeepalive::new()
            .with_time((after / 2).max(Duration::from_secs(1)))
            .with_interval((after / 10).max(Duration::from_secs(1)))
            .with_retries(5);
        if let Err(e) = sock.set_tcp_keepalive(&keepalive) {
            tracing::debug!(error = %e, ?after, "SO_KEEPALIVE");
        }
    }
    let Some(size) = size else { return };
    if size <= sysctl("/proc/sys/net/core/wmem_max")
        && let Err(e) = sock.set_send_buffer_size(size)
    {
        tracing::debug!(error = %e, size, "SO_SNDBUF");
    }
    if size <= sysctl("/proc/sys/net/core/rmem_max")
        && let Err(e) = sock.set_recv_buffer_size(size)
    {
        tracing::debug!(error = %e, size, "SO_RCVBUF");
    }
}

/// A numeric sysctl from `/proc/sys`, or 0 if it cannot be read.
fn sysctl(path: &str) -> usize {
    std::fs::read_to_string(path)
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(0)
}

/// Sets the socket's `SO_RCVLOWAT` to `bytes` (clamped to `i32::MAX`): a receive wakes its
/// reader only once that many bytes are queued. The kernel's error is returned as is.
pub fn set_recv_low_mark(socket: BorrowedFd<'_>, bytes: usize) -> std::io::Result<()> {
    let val = bytes.min(i32::MAX as usize) as libc::c_int;
    // SAFETY: setsockopt reads `size_of::<c_int>()` bytes from a local int; the descriptor is
    // borrowed open for the call.
    let rc = unsafe {
        libc::setsockopt(
            socket.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_RCVLOWAT,
            (&raw const val).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// The socket's `SO_RCVLOWAT` now.
pub fn recv_low_mark(socket: BorrowedFd<'_>) -> std::io::Result<usize> {
    let mut v: libc::c_int = -1;
    let mut l = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: getsockopt writes at most `l` bytes into a local int; the descriptor is borrowed
    // open for the call.
    let rc = unsafe {
        libc::getsockopt(
            socket.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_RCVLOWAT,
            (&raw mut v).cast(),
            &mut l,
        )
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(usize::try_from(v).unwrap_or(0))
}

/// `PeerLost` for an I/O error with `peer` during `during`.
pub fn lost(peer: SocketAddr, during: &'static str, e: std::io::Error) -> Error {
    Error::PeerLost {
        peer: peer.to_string(),
        during,
        source: Some(e),
    }
}

/// The bytes of one control frame at our highest protocol version.
pub fn encode_frame(frame: &ControlFrame) -> Result<Vec<u8>, Error> {
    let mut buf = Vec::new();
    frame
        .encode(SUPPORTED_VERSIONS.max, &mut buf)
        .map_err(|e| Error::InvalidRequest {
            reason: e.to_string(),
        })?;
    Ok(buf)
}

/// Decodes a control frame's header from `peer` (its body length checked against the limit
/// before anything is allocated for it).
pub fn decode_header(
    head: &[u8; CONTROL_HEADER_LEN],
    peer: SocketAddr,
) -> Result<ControlHeader, Error> {
    ControlHeader::decode(head).map_err(|source| Error::Malformed {
        peer: peer.to_string(),
        source,
    })
}

/// Decodes a control frame's body from `peer`.
pub fn decode_body(
    header: &ControlHeader,
    body: &[u8],
    peer: SocketAddr,
) -> Result<ControlFrame, Error> {
    ControlFrame::decode_body(header, body).map_err(|source| Error::Malformed {
        peer: peer.to_string(),
        source,
    })
}

/// Reads one control frame from a blocking stream.
pub fn read_frame(stream: &mut impl Read, peer: SocketAddr) -> Result<ControlFrame, Error> {
    let mut head = [0u8; CONTROL_HEADER_LEN];
    stream
        .read_exact(&mut head)
        .map_err(|e| lost(peer, "handshake", e))?;
    let header = decode_header(&head, peer)?;
    let mut body = vec![0u8; header.body_len as usize];
    stream
        .read_exact(&mut body)
        .map_err(|e| lost(peer, "handshake", e))?;
    decode_body(&header, &body, peer)
}

/// Writes one control frame to a blocking stream.
pub fn write_frame(
    stream: &mut impl Write,
    peer: SocketAddr,
    frame: &ControlFrame,
) -> Result<(), Error> {
    stream
        .write_all(&encode_frame(frame)?)
        .map_err(|e| lost(peer, "handshake", e))
}

/// What [`send_now`] did with a request.
#[derive(Debug)]
pub enum SentNow {
    /// The socket took all of it.
    All,
    /// The socket took part of it (or none): these are the bytes left, in order, for the
    /// stream's driver to send before anything else.
    Part(Vec<u8>),
    /// The send failed (not for a full socket): the stream cannot go on.
    Failed(std::io::Error),
}

/// Writes a request the stream protocol posted (its header, and a WRITE's payload straight from
/// registered memory) with one non-blocking `sendmsg` on `socket`, from the submitting thread:
/// the direct send of both data planes to an idle stream (`ferry_core::dealer::direct_op`). What
/// the kernel does not take at once comes back, copied, as [`SentNow::Part`]. The caller holds
/// the stream's send side, so nothing else writes the socket meanwhile.
pub fn send_now<R>(socket: BorrowedFd<'_>, out: &ferry_core::stream::Outgoing<R>) -> SentNow {
    let body_len = if out.kind == ferry_core::OpKind::Write {
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
    // SAFETY: a zeroed msghdr is valid (no address, no control data); the iovecs point at
    // `out.head` and at the chunk's payload, whose range the stream protocol checked against
    // the region `out.region` keeps alive for the call; the descriptor is borrowed open.
    let sent = unsafe {
        let mut msg: libc::msghdr = std::mem::zeroed();
        msg.msg_iov = iov.as_ptr() as *mut libc::iovec;
        msg.msg_iovlen = if body_len > 0 { 2 } else { 1 };
        libc::sendmsg(
            socket.as_raw_fd(),
            &msg,
            libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL,
        )
    };
    let total = out.head.len() + body_len;
    let sent = if sent >= 0 {
        sent as usize
    } else {
        let e = std::io::Error::last_os_error();
        if !matches!(
            e.kind(),
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::Interrupted
        ) {
            return SentNow::Failed(e);
        }
        0
    };
    if sent >= total {
        return SentNow::All;
    }
    let mut tail = Vec::with_capacity(total - sent);
    tail.extend_from_slice(out.head.get(sent..).unwrap_or(&[]));
    let body_from = sent.saturating_sub(out.head.len());
    // SAFETY: as for the send above; `body_from <= body_len`.
    tail.extend_from_slice(unsafe {
        std::slice::from_raw_parts(body.add(body_from), body_len - body_from)
    });
    SentNow::Part(tail)
}

/// The data streams of a client channel as its handle sees them: whether the channel was
/// closed, whether each stream died, and a descriptor of each to shut it down from any thread.
/// A channel is alive while it is not closed and one of its streams is.
#[derive(Debug, Default)]
pub struct ChannelStreams {
    closed: AtomicBool,
    streams: Vec<(Arc<AtomicBool>, std::net::TcpStream)>,
}

impl ChannelStreams {
    /// No streams yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds a stream: `dead` is set by whoever ends it; `socket` is a handle (a duplicate
    /// descriptor is fine) to shut it down.
    pub fn push(&mut self, dead: Arc<AtomicBool>, socket: std::net::TcpStream) {
        self.streams.push((dead, socket));
    }

    /// Number of streams.
    pub fn len(&self) -> usize {
        self.streams.len()
    }

    /// Whether there are no streams.
    pub fn is_empty(&self) -> bool {
        self.streams.is_empty()
    }

    /// Whether [`close`](Self::close) was called.
    pub fn is_closed(&self) -> bool {
        self.closed.load(Ordering::Acquire)
    }

    /// Not closed, and at least one stream alive.
    pub fn is_alive(&self) -> bool {
        !self.is_closed() && self.streams.iter().any(|(d, _)| !d.load(Ordering::Acquire))
    }

    /// Closes the channel: every stream is marked dead and shut down (their drivers then fail
    /// what is in flight as lost), and [`is_alive`](Self::is_alive) is false from now on.
    pub fn close(&self) {
        self.closed.store(true, Ordering::Release);
        for (dead, _) in &self.streams {
            dead.store(true, Ordering::Release);
        }
        self.shutdown_all();
    }

    /// Shuts every stream down (both directions), waking whatever waits on them.
    pub fn shutdown_all(&self) {
        for (_, s) in &self.streams {
            let _ = s.shutdown(std::net::Shutdown::Both);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::{TcpListener, TcpStream};

    /// A posted WRITE of `len` payload bytes of `region` at 0 (header: `fill`).
    fn posted(
        region: &Arc<ferry_core::MemoryRegion>,
        len: usize,
        fill: u8,
    ) -> ferry_core::stream::Outgoing<()> {
        ferry_core::stream::Outgoing {
            head: [fill; ferry_core::wire::DATA_REQUEST_LEN],
            seq: 0,
            kind: ferry_core::OpKind::Write,
            req: Arc::new(()),
            region: region.clone(),
            local_at: 0,
            len,
            table: Vec::new(),
            scatter: Vec::new(),
        }
    }

    /// `send_now` hands the socket what it takes and returns the rest in order: a small request
    /// goes whole; one larger than a full socket takes comes back in part, and what the peer
    /// got followed by the part is the request; a socket shut down fails the send.
    #[test]
    fn send_now_sends_what_the_socket_takes_and_returns_the_rest() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let a = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (mut b, _) = l.accept().unwrap();
        let len = 8 << 20;
        let region = Arc::new(ferry_core::MemoryRegion::alloc_zeroed(len, 4096).unwrap());
        let data: Vec<u8> = (0..len).map(|i| (i * 7 + 1) as u8).collect();
        region.write_at(0, &data).unwrap();
        let small = posted(&region, 100, 5);
        assert!(matches!(send_now(a.as_fd(), &small), SentNow::All));
        let mut got = vec![0u8; small.head.len() + 100];
        b.read_exact(&mut got).unwrap();
        assert_eq!(&got[..small.head.len()], &small.head);
        assert_eq!(&got[small.head.len()..], &data[..100]);
        // Nobody reads: 8 MiB does not fit in the two sockets' buffers.
        let big = posted(&region, len, 6);
        let SentNow::Part(rest) = send_now(a.as_fd(), &big) else {
            panic!("8 MiB went into a socket nobody reads");
        };
        let want: Vec<u8> = big
            .head
            .iter()
            .copied()
            .chain(data.iter().copied())
            .collect();
        let mut took = vec![0u8; want.len() - rest.len()];
        b.read_exact(&mut took).unwrap();
        took.extend_from_slice(&rest);
        assert!(
            took == want,
            "the bytes sent and the rest are not the request"
        );
        a.shutdown(std::net::Shutdown::Both).unwrap();
        assert!(matches!(send_now(a.as_fd(), &small), SentNow::Failed(_)));
    }

    /// Failures in a row wait under a ceiling doubling from 10 ms to 1 s, and the late ones
    /// use the whole second (some wait more than half of it); an accepted connection brings
    /// the next failure's ceiling back to 10 ms.
    #[test]
    fn accept_failures_back_off_and_an_accept_starts_again() {
        let mut longest = Duration::ZERO;
        for seed in 0..100 {
            let mut b = AcceptBackoff {
                backoff: Backoff::new(ACCEPT_BACKOFF, ACCEPT_BACKOFF_MAX, seed),
            };
            for n in 0..12 {
                let ceiling = ACCEPT_BACKOFF
                    .saturating_mul(1 << n)
                    .min(ACCEPT_BACKOFF_MAX);
                let wait = b.failed();
                assert!(wait <= ceiling, "seed {seed}, failure {n}: {wait:?}");
                longest = longest.max(wait);
            }
            b.accepted();
            let wait = b.failed();
            assert!(
                wait <= ACCEPT_BACKOFF,
                "seed {seed}, after an accept: {wait:?}"
            );
        }
        assert!(longest > ACCEPT_BACKOFF_MAX / 2, "{longest:?}");
        assert_eq!(ACCEPT_BACKOFF, Duration::from_millis(10));
        assert_eq!(ACCEPT_BACKOFF_MAX, Duration::from_secs(1));
    }

    /// The gate admits up to its cap, refuses (and counts) past it, and frees a place when a
    /// slot drops.
    #[test]
    fn the_handshake_gate_caps_pending_connections() {
        let gate = HandshakeGate::new(HandshakeLimits {
            timeout: HANDSHAKE_TIMEOUT,
            max_pending: 2,
        });
        let a = gate.admit().unwrap();
        let _b = gate.admit().unwrap();
        assert!(gate.admit().is_none());
        gate.note_timeout();
        assert_eq!(
            gate.stats(),
            HandshakeStats {
                pending: 2,
                refused: 1,
                timed_out: 1,
                evicted: 0,
            }
        );
        drop(a);
        assert!(gate.admit().is_some());
        assert_eq!(gate.stats().pending, 1);
    }

    /// Past the cap, `admit_evicting` shuts down the oldest connection of the source holding
    /// the most and hands its place to the newcomer: the evicted one's reads end at once, its
    /// slot frees nothing when it drops, and the count stays at the cap.
    #[test]
    fn the_handshake_gate_evicts_the_oldest_of_the_largest_source() {
        use std::io::Read;
        let gate = HandshakeGate::new(HandshakeLimits {
            timeout: HANDSHAKE_TIMEOUT,
            max_pending: 3,
        });
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let (flood, other): (IpAddr, IpAddr) = ([10, 0, 0, 1].into(), [10, 0, 0, 2].into());
        let conn = |from: IpAddr| {
            let client = std::net::TcpStream::connect(addr).unwrap();
            let (server, _) = listener.accept().unwrap();
            let slot = gate.admit_evicting(server.as_fd(), from);
            (client, server, slot)
        };
        let (mut c_other, _s0, other_slot) = conn(other);
        let (mut c1, _s1, slot1) = conn(flood);
        let (_c2, _s2, _slot2) = conn(flood);
        assert_eq!(gate.stats().pending, 3);
        // Full: the flood's oldest goes, not the other source's (older still).
        let (_c3, _s3, slot3) = conn(flood);
        assert!(slot3.is_some());
        let slot1 = slot1.unwrap();
        assert!(slot1.evicted() && !other_slot.as_ref().unwrap().evicted());
        let mut b = [0u8; 1];
        assert_eq!(
            c1.read(&mut b).unwrap(),
            0,
            "the evicted connection is shut down"
        );
        c_other
            .set_read_timeout(Some(Duration::from_millis(50)))
            .unwrap();
        assert!(
            c_other.read(&mut b).is_err(),
            "the other source's is still open"
        );
        assert_eq!(
            gate.stats(),
            HandshakeStats {
                pending: 3,
                refused: 0,
                timed_out: 0,
                evicted: 1,
            }
        );
        drop(slot1);
        assert_eq!(gate.stats().pending, 3, "an evicted slot frees no place");
        drop(other_slot);
        assert_eq!(gate.stats().pending, 2);
        // Slots of `admit` cannot be evicted: a gate full of them refuses.
        let plain = HandshakeGate::new(HandshakeLimits {
            timeout: HANDSHAKE_TIMEOUT,
            max_pending: 1,
        });
        let _held = plain.admit().unwrap();
        let (_c, s, _) = conn(flood);
        assert!(plain.admit_evicting(s.as_fd(), flood).is_none());
        assert_eq!(plain.stats().refused, 1);
    }

    #[test]
    fn the_victim_is_the_oldest_of_the_source_holding_the_most() {
        let (a, b): (IpAddr, IpAddr) = ([10, 0, 0, 1].into(), [10, 0, 0, 2].into());
        assert_eq!(HandshakeGate::victim(&[]), None);
        assert_eq!(HandshakeGate::victim(&[b, a, a]), Some(1));
        assert_eq!(HandshakeGate::victim(&[a, b]), Some(0));
        assert_eq!(HandshakeGate::victim(&[b, b, a, a, b]), Some(0));
    }

    /// The backlog a listening socket was given: `TCP_INFO`'s `tcpi_sacked` on a listener.
    fn backlog(l: &TcpListener) -> u32 {
        // SAFETY: `tcp_info` is plain integers, for which all zeros is a valid value.
        let mut info: libc::tcp_info = unsafe { std::mem::zeroed() };
        let mut len = std::mem::size_of::<libc::tcp_info>() as libc::socklen_t;
        // SAFETY: getsockopt writes at most `len` bytes into `info`, a local of that size; the
        // listener's descriptor is open for the call.
        let rc = unsafe {
            libc::getsockopt(
                l.as_raw_fd(),
                libc::IPPROTO_TCP,
                libc::TCP_INFO,
                (&raw mut info).cast(),
                &mut len,
            )
        };
        assert_eq!(rc, 0, "{}", std::io::Error::last_os_error());
        info.tcpi_sacked
    }

    /// A server listens where asked (port 0: a port chosen, and said), with `SO_REUSEADDR`,
    /// non-blocking and with the shared backlog; a port already listened on is an I/O error
    /// naming the bind and the address asked.
    #[test]
    fn a_server_listens_reusably_without_blocking_with_the_shared_backlog() {
        let (l, addr) = listen("127.0.0.1:0".parse().unwrap()).unwrap();
        assert_ne!(addr.port(), 0);
        assert_eq!(l.local_addr().unwrap(), addr);
        let sock = socket2::SockRef::from(&l);
        assert!(sock.reuse_address().unwrap());
        assert!(sock.nonblocking().unwrap());
        // The kernel caps a backlog at `net.core.somaxconn` (4096 since Linux 5.4).
        let cap = std::fs::read_to_string("/proc/sys/net/core/somaxconn")
            .ok()
            .and_then(|s| s.trim().parse::<u32>().ok())
            .unwrap_or(u32::MAX);
        assert_eq!(backlog(&l), (LISTEN_BACKLOG as u32).min(cap));
        let taken = listen(addr).map(|_| ()).unwrap_err();
        assert!(
            matches!(&taken, Error::Io { op: "bind", target, .. } if *target == addr.to_string()),
            "{taken:?}"
        );
    }

    /// `tune` arms dead-peer detection as asked (user timeout, keepalive from half of it) and
    /// leaves the kernel's defaults alone without it.
    #[test]
    fn tune_sets_the_dead_peer_limit() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let a = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (b, _) = l.accept().unwrap();
        tune(&a, None, Some(Duration::from_secs(8)));
        tune(&b, None, None);
        let (sa, sb) = (socket2::SockRef::from(&a), socket2::SockRef::from(&b));
        assert!(sa.nodelay().unwrap());
        assert_eq!(sa.tcp_user_timeout().unwrap(), Some(Duration::from_secs(8)));
        assert!(sa.keepalive().unwrap());
        assert_eq!(sa.keepalive_time().unwrap(), Duration::from_secs(4));
        assert_eq!(sb.tcp_user_timeout().unwrap(), None);
        assert!(!sb.keepalive().unwrap());
    }

    /// Frames written by `write_frame` read back whole; a header that claims more than the
    /// limit is `Malformed` before any body is read.
    #[test]
    fn control_frames_round_trip_and_lying_lengths_are_malformed() {
        let peer: SocketAddr = "127.0.0.1:1".parse().unwrap();
        let mut buf = Vec::new();
        write_frame(&mut buf, peer, &ControlFrame::StreamAccept).unwrap();
        let back = read_frame(&mut buf.as_slice(), peer).unwrap();
        assert!(matches!(back, ControlFrame::StreamAccept));
        let mut lying = buf.clone();
        lying[8..12].copy_from_slice(&u32::MAX.to_le_bytes());
        let e = read_frame(&mut lying.as_slice(), peer).unwrap_err();
        assert!(matches!(e, Error::Malformed { .. }), "{e}");
        let e = read_frame(&mut &buf[..5], peer).unwrap_err();
        assert!(matches!(e, Error::PeerLost { .. }), "{e}");
    }

    /// A channel lives while one stream does; closing it marks every stream dead and shuts the
    /// sockets (the peer reads the end).
    #[test]
    fn a_channel_is_alive_while_a_stream_is_and_close_shuts_them_all() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let mut streams = ChannelStreams::new();
        let mut far = Vec::new();
        let mut deads = Vec::new();
        for _ in 0..2 {
            let a = TcpStream::connect(l.local_addr().unwrap()).unwrap();
            far.push(l.accept().unwrap().0);
            let dead = Arc::new(AtomicBool::new(false));
            deads.push(dead.clone());
            streams.push(dead, a);
        }
        assert!(streams.is_alive());
        deads[0].store(true, Ordering::Release);
        assert!(streams.is_alive());
        streams.close();
        assert!(!streams.is_alive() && streams.is_closed());
        assert!(deads[1].load(Ordering::Acquire));
        for mut f in far {
            let mut b = [0u8; 1];
            assert_eq!(f.read(&mut b).unwrap(), 0, "the far end sees the close");
        }
    }
}
