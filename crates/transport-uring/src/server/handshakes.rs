//! The server's connections before their handshake is over: one thread accepts them and runs
//! every control conversation ([`ServerConversation`]) on non-blocking sockets with `poll(2)`,
//! so a connection costs no thread; an attached data stream goes to one of the server's rings. Each conversation
//! must be over within [`HandshakeLimits::timeout`] of its accept, at most
//! [`HandshakeLimits::max_pending`] run at once (one accepted past that is closed at once), and
//! each frame's header is checked ([`ServerConversation::on_header`]) before its body is read.
//! All of it is counted by the server's [`HandshakeGate`].
//!
//! [`HandshakeLimits::timeout`]: ferry_net::HandshakeLimits::timeout
//! [`HandshakeLimits::max_pending`]: ferry_net::HandshakeLimits::max_pending

use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::{AsFd, AsRawFd};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use ferry_core::handshake::{ServerConversation, ServerStep};
use ferry_core::stream::ServerStream;
use ferry_core::wire::{CONTROL_HEADER_LEN, ControlHeader, StreamAttach};
use ferry_net::{AcceptBackoff, HandshakeGate, HandshakeSlot};
use tracing::{debug, warn};

/// What the accept thread serves with: the table and responder every conversation answers
/// from, the server's shared state, and the rings its attached streams go to.
pub(super) struct Acceptor {
    pub(super) table: Arc<dyn SegmentTable>,
    pub(super) responder: Arc<dyn HandshakeResponder>,
    pub(super) ctx: Arc<Ctx>,
    pub(super) rings: RingSet,
}

use ferry_core::{HandshakeResponder, SegmentTable};

use super::rings::RingSet;
use super::shared::Ctx;
use crate::control::tune;

/// Where a connection's next frame stands.
enum Input {
    Header {
        buf: [u8; CONTROL_HEADER_LEN],
        got: usize,
    },
    Body {
        header: ControlHeader,
        buf: Vec<u8>,
        got: usize,
    },
}

impl Input {
    fn header() -> Self {
        Input::Header {
            buf: [0; CONTROL_HEADER_LEN],
            got: 0,
        }
    }
}

/// One connection in its handshake.
struct Conn {
    stream: TcpStream,
    from: SocketAddr,
    talk: ServerConversation,
    deadline: Instant,
    input: Input,
    /// Frames to send, and how much of them went.
    out: Vec<u8>,
    sent: usize,
    /// Close once `out` is sent (the conversation ended with a refusal or a hello).
    closing: bool,
    slot: HandshakeSlot,
}

/// What became of a connection after an event.
enum Next {
    Keep,
    Drop,
    Stream(StreamAttach, ServerStream),
}

impl Conn {
    /// Reads what the socket has, up to the end of the current frame each time, and feeds each
    /// whole frame to the conversation.
    fn on_readable(&mut self) -> Next {
        if self.closing {
            return Next::Keep;
        }
        loop {
            let (buf, got) = match &mut self.input {
                Input::Header { buf, got } => (&mut buf[..], got),
                Input::Body { buf, got, .. } => (&mut buf[..], got),
            };
            if *got < buf.len() {
                match self.stream.read(&mut buf[*got..]) {
                    Ok(0) => return Next::Drop,
                    Ok(n) => *got += n,
                    Err(e) if e.kind() == ErrorKind::WouldBlock => return Next::Keep,
                    Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                    Err(e) => {
                        debug!(from = %self.from, error = %e, "handshake read failed");
                        return Next::Drop;
                    }
                }
                if *got < buf.len() {
                    continue;
                }
            }
            let next = self.on_whole_frame_part();
            if !matches!(next, Next::Keep) || self.closing {
                return next;
            }
        }
    }

    /// The current header or body is complete: decode it and act on it.
    fn on_whole_frame_part(&mut self) -> Next {
        let step = match std::mem::replace(&mut self.input, Input::header()) {
            Input::Header { buf, .. } => {
                let header = match ferry_net::decode_header(&buf, self.from) {
                    Ok(h) => h,
                    Err(e) => {
                        debug!(from = %self.from, error = %e, "malformed control header");
                        return Next::Drop;
                    }
                };
                match self.talk.on_header(&header) {
                    Some(step) => step,
                    None => {
                        self.input = Input::Body {
                            header,
                            buf: vec![0; header.body_len as usize],
                            got: 0,
                        };
                        return Next::Keep;
                    }
                }
            }
            Input::Body { header, buf, .. } => {
                match ferry_net::decode_body(&header, &buf, self.from) {
                    Ok(frame) => self.talk.on_frame(frame),
                    Err(e) => {
                        debug!(from = %self.from, error = %e, "malformed control frame");
                        return Next::Drop;
                    }
                }
            }
        };
        match step {
            ServerStep::Reply(f) => self.queue(&f),
            ServerStep::Read => Next::Keep,
            ServerStep::Close(f) => {
                self.closing = true;
                self.queue(&f)
            }
            ServerStep::Fail(e) => {
                debug!(from = %self.from, error = %e, "handshake failed");
                Next::Drop
            }
            ServerStep::Stream { attach, stream } => Next::Stream(attach, stream),
            _ => {
                debug!(from = %self.from, "a handshake step this server does not know");
                Next::Drop
            }
        }
    }

    fn queue(&mut self, frame: &ferry_core::wire::ControlFrame) -> Next {
        match ferry_net::encode_frame(frame) {
            Ok(bytes) => {
                self.out.extend_from_slice(&bytes);
                self.on_writable()
            }
            Err(e) => {
                warn!(from = %self.from, error = %e, "cannot encode a handshake answer");
                Next::Drop
            }
        }
    }

    /// Sends what is queued, as far as the socket takes it; a closing connection ends once all
    /// of it went.
    fn on_writable(&mut self) -> Next {
        while self.sent < self.out.len() {
            match self.stream.write(&self.out[self.sent..]) {
                Ok(0) => return Next::Drop,
                Ok(n) => self.sent += n,
                Err(e) if e.kind() == ErrorKind::WouldBlock => return Next::Keep,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => {
                    debug!(from = %self.from, error = %e, "handshake write failed");
                    return Next::Drop;
                }
            }
        }
        self.out.clear();
        self.sent = 0;
        if self.closing {
            let _ = self.stream.shutdown(std::net::Shutdown::Write);
            return Next::Drop;
        }
        Next::Keep
    }
}

/// The longest a wait lasts with nothing due, so that a stop is seen even if the listener's
/// shutdown did not wake `poll`.
const IDLE_WAIT: Duration = Duration::from_secs(1);

/// Accepts connections on `listener` (non-blocking) and runs their handshakes until the server
/// stops; an attached data stream goes to one of the server's rings ([`RingSet::attached`]).
/// The listener is shared with the server's handle, which shuts it down to stop the server.
/// After a failed accept the listener is left out of the poll for [`AcceptBackoff`]'s wait,
/// while the handshakes in progress go on.
pub(super) fn run(listener: Arc<TcpListener>, acceptor: Acceptor, gate: Arc<HandshakeGate>) {
    let ctx = &acceptor.ctx;
    let timeout = gate.limits().timeout;
    let mut conns: Vec<Conn> = Vec::new();
    let mut fds: Vec<libc::pollfd> = Vec::new();
    let mut backoff = AcceptBackoff::new();
    // Until when the listener rests after a failed accept.
    let mut resting: Option<Instant> = None;
    loop {
        if ctx.live.stopped.load(Ordering::Acquire) {
            break;
        }
        let now = Instant::now();
        resting = resting.filter(|&until| until > now);
        fds.clear();
        fds.push(libc::pollfd {
            // A negative descriptor is skipped by poll (its revents stay 0).
            fd: if resting.is_some() {
                -1
            } else {
                listener.as_raw_fd()
            },
            events: libc::POLLIN,
            revents: 0,
        });
        for c in &conns {
            let mut events = 0;
            if !c.closing {
                events |= libc::POLLIN;
            }
            if c.sent < c.out.len() {
                events |= libc::POLLOUT;
            }
            fds.push(libc::pollfd {
                fd: c.stream.as_raw_fd(),
                events,
                revents: 0,
            });
        }
        let wait = conns
            .iter()
            .map(|c| c.deadline)
            .chain(resting)
            .map(|at| at.saturating_duration_since(now))
            .min()
            .unwrap_or(IDLE_WAIT)
            .min(IDLE_WAIT);
        // Round up, so that a deadline less than a millisecond away is not polled for again
        // and again with a zero timeout.
        let wait_ms = wait.as_micros().div_ceil(1000).min(i32::MAX as u128) as i32;
        // SAFETY: `fds` is a valid, initialized array of `fds.len()` pollfd structs that lives
        // across the call; poll only writes their `revents`.
        let n = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, wait_ms) };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() != ErrorKind::Interrupted {
                warn!(error = %e, "poll failed in the handshake loop");
                std::thread::sleep(Duration::from_millis(10));
            }
            continue;
        }
        if ctx.live.stopped.load(Ordering::Acquire) {
            break;
        }
        // Each connection's event, newest first so that removing one leaves the others'
        // positions in `fds` valid.
        for i in (0..conns.len()).rev() {
            let revents = fds[i + 1].revents;
            let mut next = Next::Keep;
            if revents & (libc::POLLIN | libc::POLLHUP | libc::POLLERR) != 0 {
                next = conns[i].on_readable();
                if conns[i].closing && revents & (libc::POLLHUP | libc::POLLERR) != 0 {
                    next = Next::Drop;
                }
            }
            if matches!(next, Next::Keep) && revents & libc::POLLOUT != 0 {
                next = conns[i].on_writable();
            }
            if matches!(next, Next::Keep) && Instant::now() >= conns[i].deadline {
                gate.note_timeout();
                debug!(from = %conns[i].from, ?timeout, "handshake not over by its deadline; closing");
                next = Next::Drop;
            }
            match next {
                Next::Keep => {}
                Next::Drop => {
                    conns.swap_remove(i);
                }
                Next::Stream(attach, proto) => {
                    let c = conns.swap_remove(i);
                    // The handshake is over: its place among the pending ones is free.
                    drop(c.slot);
                    acceptor
                        .rings
                        .attached(c.stream, c.from, attach, proto, &ctx.config);
                }
            }
        }
        if fds[0].revents != 0 {
            let failed = accept_all(&listener, &acceptor, &gate, &mut conns, &mut backoff);
            resting = failed.map(|wait| Instant::now() + wait);
        }
    }
}

/// Takes every connection waiting on the listener: admitted ones start their handshake; past the
/// gate's cap the oldest pending connection of the source holding the most is shut down to make
/// room (its handshake then ends as a closed connection), as on every listener. After a failed
/// accept, how long the listener is to rest ([`AcceptBackoff`]).
fn accept_all(
    listener: &TcpListener,
    acceptor: &Acceptor,
    gate: &Arc<HandshakeGate>,
    conns: &mut Vec<Conn>,
    backoff: &mut AcceptBackoff,
) -> Option<Duration> {
    let ctx = &acceptor.ctx;
    let timeout = gate.limits().timeout;
    loop {
        match listener.accept() {
            Ok((stream, from)) => {
                backoff.accepted();
                if ctx.live.stopped.load(Ordering::Acquire) {
                    return None;
                }
                let Some(slot) = gate.admit_evicting(stream.as_fd(), from.ip()) else {
                    debug!(%from, "too many connections in their handshake; closed at once");
                    continue;
                };
                tune(
                    &stream,
                    ctx.config.socket_buffer,
                    ctx.config.dead_peer_after,
                );
                if let Err(e) = stream.set_nonblocking(true) {
                    debug!(%from, error = %e, "cannot make a connection non-blocking; closed");
                    continue;
                }
                conns.push(Conn {
                    stream,
                    from,
                    talk: ServerConversation::new(
                        acceptor.responder.clone(),
                        acceptor.table.clone(),
                        from,
                    ),
                    deadline: Instant::now() + timeout,
                    input: Input::header(),
                    out: Vec::new(),
                    sent: 0,
                    closing: false,
                    slot,
                });
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock => return None,
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) => {
                if ctx.live.stopped.load(Ordering::Acquire) {
                    return None;
                }
                // Out of descriptors (say): the listener stays readable; do not spin.
                let wait = backoff.failed();
                warn!(error = %e, ?wait, "accept failed");
                return Some(wait);
            }
        }
    }
}
