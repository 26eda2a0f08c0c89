//! The serving side's event loop: a fixed set of rings ([`UringConfig::server_rings`]), each on one
//! thread, drives every attached data stream the server has; a stream costs no thread.
//!
//! The accept thread hands a stream whose handshake ended to one ring (in turn). Each stream is a
//! state machine around [`ServerStream`]: a queue of steps (send these bytes, receive into these
//! ranges, drop this many bytes, a file piece, a checksum piece), at most one socket operation of
//! it in flight at a time, so a stream's bytes stay in order while the ring runs every other
//! stream's. An idle stream is one armed receive of its next request header. Everything a ring's
//! streams queued in one turn goes to the kernel with one `io_uring_enter`.
//!
//! Sockets are fixed files where the kernel lets the ring register them. A send or payload receive
//! first moves what the socket takes or holds at once with one non-blocking syscall; the rest goes
//! through the ring (SENDMSG / RECVMSG with `MSG_WAITALL`, straight from and into the segment). A
//! WRITE payload's receive that does not wait for all its bytes (that one, and the ring's under a
//! raised `SO_RCVLOWAT`) also takes what is there of the next request header. A memory READ's
//! payload to a peer the configuration sends zero-copy to goes out with SEND_ZC (from a registered
//! buffer where the ring takes it), its lease held in the driver until the kernel's notification,
//! however the stream ends; a request's last send carries the next header's receive in the same
//! enter. File pieces run on the ring's thread (positioned or O_DIRECT ring I/O of at most one
//! piece, 1 MiB); a checksum runs one piece per turn
//! ([`RegionCrc::step`](ferry_core::checksum::RegionCrc::step) of memory,
//! [`FileCrc::step`](ferry_core::checksum::FileCrc::step) of a file: one positioned read).
//!
//! [`UringConfig::server_rings`]: crate::config::UringConfig::server_rings

use std::io;
use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use ferry_core::stream::ServerStream;
use ferry_core::wire::StreamAttach;
use tracing::{debug, warn};

use super::conn::Conn;
use super::shared::{Ctx, lock};
use crate::config::UringConfig;
use crate::ring::host::Host;
use crate::ring::inbox::Inbox;
use crate::ring::kernel::{RingSize, Uring};
use crate::ring::{ThreadCount, spawn_ring};

/// A server ring's size: submission entries (more are submitted in several calls), completion
/// entries (the kernel keeps an overflow beyond them), fixed-file slots (streams past them use
/// their plain descriptor).
const SIZE: RingSize = RingSize {
    sq: 1024,
    cq: 8192,
    files: 1 << 14,
};

/// A stream handed from the accept thread to a ring.
pub(super) struct NewStream {
    pub(super) stream: TcpStream,
    pub(super) from: SocketAddr,
    pub(super) proto: ServerStream,
    /// The encoded `StreamAccept`, the stream's first bytes.
    pub(super) accept: Vec<u8>,
}

/// One ring as the accept thread and the server's handle see it.
#[derive(Debug)]
struct RingHandle {
    inbox: Arc<Inbox<NewStream>>,
}

/// The server's fixed set of rings; dropping it does not stop them (the server's `stopped`
/// flag, and the wake-ups `Live::ring_wakes` holds for the server's handle, do).
#[derive(Debug)]
pub(super) struct RingSet {
    rings: Vec<RingHandle>,
    next: AtomicUsize,
    /// Set once a loopback client's second stream (index 1 or more) is handed over: then each
    /// ring pins itself to its CPU (`UringConfig::pin_loopback_streams`), as that client's
    /// streams are pinned. A one-stream client's streams are not, and neither are the rings.
    pin: Arc<AtomicBool>,
}

impl RingSet {
    /// Starts `n` rings (0: one per CPU this process may run on), each on its own thread.
    pub(super) fn start(n: usize, ctx: &Arc<Ctx>) -> io::Result<Self> {
        let n = if n == 0 {
            std::thread::available_parallelism().map_or(1, |n| n.get())
        } else {
            n
        };
        let mut rings = Vec::with_capacity(n);
        let pin = Arc::new(AtomicBool::new(false));
        for i in 0..n {
            let inbox = Arc::new(Inbox::new()?);
            let (c, b) = (ctx.clone(), inbox.clone());
            let p = ctx.config.pin_loopback_streams.then(|| (i, pin.clone()));
            // Each ring pins itself once a loopback client's second stream came (`RingSet::pin`).
            spawn_ring(
                format!("ferry-uring-ring{i}"),
                None,
                move || {
                    let zc = c.config.zero_copy_enabled();
                    let ring = Uring::new(SIZE, c.config.register_buffers, zc)?;
                    let host = Host::new(ring, b.fd.clone(), c.stats.clone());
                    Ok(Ring {
                        _count: ThreadCount::new(&c.stats),
                        ctx: c,
                        inbox: b,
                        host,
                        pin: p,
                    })
                },
                Ring::run,
            )?;
            lock(&ctx.live.ring_wakes).push(inbox.fd.clone());
            rings.push(RingHandle { inbox });
        }
        Ok(Self {
            rings,
            next: AtomicUsize::new(0),
            pin,
        })
    }

    /// How many rings it runs.
    pub(super) fn len(&self) -> usize {
        self.rings.len()
    }

    /// Serves a data stream whose handshake just ended (the attach accepted, its `proto` bound
    /// to what the peer may see) on one of the rings, which answers the attach first, as the
    /// stream's first bytes.
    pub(super) fn attached(
        &self,
        stream: TcpStream,
        from: SocketAddr,
        attach: StreamAttach,
        proto: ServerStream,
        config: &UringConfig,
    ) {
        if config.unpaced_loopback && from.ip().is_loopback() {
            crate::tune::unpace(&stream);
        }
        let accept = match ferry_net::encode_frame(&ferry_core::wire::ControlFrame::StreamAccept) {
            Ok(b) => b,
            Err(e) => {
                warn!(%from, error = %e, "cannot encode a stream accept");
                return;
            }
        };
        // io_uring honours O_NONBLOCK with EAGAIN instead of waiting: the ring's sockets block.
        if let Err(e) = stream.set_nonblocking(false) {
            debug!(%from, error = %e, "cannot make a data stream blocking; closed");
            return;
        }
        let index =
            (config.pin_loopback_streams && from.ip().is_loopback()).then_some(attach.stream_index);
        if self.hand(stream, from, index, proto, accept).is_err() {
            debug!(%from, "the server's rings have stopped; stream closed");
        }
    }

    /// Hands `stream` (blocking mode; its attach accepted by `accept`, sent first) to a ring:
    /// a loopback client's stream `index` to ring `index` (once such a client's second stream
    /// comes, the rings pin themselves one per CPU as its streams are, so both ends of a stream
    /// share a core), any other to the next in turn.
    fn hand(
        &self,
        stream: TcpStream,
        from: SocketAddr,
        index: Option<u16>,
        proto: ServerStream,
        accept: Vec<u8>,
    ) -> Result<(), ()> {
        let i = match index {
            Some(k) => usize::from(k),
            None => self.next.fetch_add(1, Ordering::Relaxed),
        } % self.rings.len();
        if index.is_some_and(|k| k >= 1) && !self.pin.swap(true, Ordering::AcqRel) {
            // Every ring pins itself at its next turn.
            for r in &self.rings {
                r.inbox.wake_now();
            }
        }
        let r = &self.rings[i];
        if Arc::strong_count(&r.inbox) == 1 {
            // Its thread has gone.
            return Err(());
        }
        r.inbox.hand(NewStream {
            stream,
            from,
            proto,
            accept,
        });
        Ok(())
    }
}

/// One server ring's thread: its host and what it runs with.
struct Ring {
    ctx: Arc<Ctx>,
    inbox: Arc<Inbox<NewStream>>,
    host: Host<Conn, Uring>,
    /// This ring's place and the set's pin flag (`RingSet::pin`), until it pinned itself.
    pin: Option<(usize, Arc<AtomicBool>)>,
    _count: ThreadCount,
}

impl Ring {
    /// Runs turns until the server stops (or the ring fails), then the host's shutdown.
    fn run(mut self) {
        let mut news = Vec::new();
        loop {
            if self.ctx.live.stopped.load(Ordering::Acquire) {
                break;
            }
            if let Some((i, flag)) = &self.pin
                && flag.load(Ordering::Acquire)
            {
                // One ring per core: ring `i` on the `i`-th CPU, where a loopback client's
                // stream `i` runs too (see `RingSet::hand`).
                crate::tune::pin_stream_thread(*i);
                self.pin = None;
            }
            self.inbox.take_news(&mut news);
            for n in news.drain(..) {
                self.add(n);
            }
            if let Err(e) = self.host.turn(&self.inbox, None) {
                warn!(error = %e, "a server ring failed; its streams end");
                break;
            }
        }
        self.host.shutdown();
    }

    /// Takes a stream handed over into the host (its socket where a shutdown reaches it).
    fn add(&mut self, n: NewStream) {
        let NewStream {
            stream,
            from,
            proto,
            accept,
        } = n;
        let stream = Arc::new(stream);
        let live_id = self.ctx.live.next.fetch_add(1, Ordering::Relaxed);
        lock(&self.ctx.live.conns).insert(live_id, stream.clone());
        if self.ctx.live.stopped.load(Ordering::Acquire) {
            let _ = stream.shutdown(std::net::Shutdown::Both);
        }
        let conn = Box::new(Conn::new(
            self.ctx.clone(),
            from,
            proto,
            accept,
            stream,
            live_id,
        ));
        if self.host.add(conn).is_err() {
            // Its operations could not be named: closed (dropped) instead.
            warn!(%from, "a server ring serves as many streams as it can name; stream closed");
            lock(&self.ctx.live.conns).remove(&live_id);
        }
    }
}
