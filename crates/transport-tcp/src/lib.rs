//! Ferry's portable data plane over TCP (tokio).
//!
//! - [`TcpServer`]: one listener for control connections (the handshake, answered by the
//!   engine's [`HandshakeResponder`]) and data streams (served from a [`SegmentTable`]: registered
//!   memory, and file segments by positioned I/O on the blocking pool). Every request is checked
//!   for token, access and bounds before any byte of a segment is touched.
//! - [`TcpTransport`]: the [`Transport`] that opens [`TcpChannel`]s: several streams per peer,
//!   chunks dealt to them in turn (an idle stream takes others', a dying one hands its own on:
//!   [`ferry_core::dealer`]), a bounded number in flight per stream, payloads sent from and
//!   received into registered memory without an intermediate copy, Nagle off. A request of one
//!   small chunk submitted while a stream is idle is written by the submitting thread itself
//!   ([`ferry_core::dealer::direct_op`]; counted in [`TcpTransport::stats`]).
//! - Data streams, on both sides, live on a bounded set of I/O threads with current-thread
//!   runtimes ([`TcpConfig::io_threads`]), or on the caller's runtime where that is asked for.
//! - [`handshake`]: the client side of the control handshake.
//!
//! The io_uring transport speaks the same wire (`ferry_core::wire`) and interoperates.

mod client;
mod control;
mod io;
mod pool;
mod server;

use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::time::Duration;

use ferry_core::wire::TransportOffer;
use ferry_core::{BoxFuture, Channel, Error, PeerInfo, Transport, TransportKind};

pub use client::TcpChannel;
pub use control::{handshake, handshake_expecting, handshake_with, notify_expecting, notify_with};
pub use server::{ServerHandle, TcpServer};

#[doc(no_inline)]
pub use ferry_core::{HandshakeResponder, SegmentTable};

/// Settings of the TCP data plane.
#[derive(Clone, Debug)]
pub struct TcpConfig {
    /// Data streams per peer (1 to 64).
    pub streams: usize,
    /// Largest chunk an op is split into.
    pub chunk_size: u64,
    /// Chunks in flight per stream.
    pub depth: usize,
    /// Socket buffer size to request (applied only where the kernel's maximum allows it, since a
    /// clamped size would only disable autotuning). `None`: kernel autotuning.
    pub socket_buffer: Option<usize>,
    /// Limit for connecting and attaching a stream.
    pub connect_timeout: Duration,
    /// I/O threads that drive the data streams (each a current-thread tokio runtime; streams
    /// are assigned round-robin and stay on their thread). `Some(0)` (default): one per
    /// available core; `None`: no threads of its own, streams run as tasks on the caller's
    /// runtime. A transport and a server each have their own threads, started on first use.
    ///
    /// The trade-off: I/O threads move bulk data faster because a stream never migrates
    /// between workers; the caller's runtime answers small ops sooner because no request
    /// crosses threads on its way to the socket (figures: `docs/performance.md`).
    pub io_threads: Option<usize>,
    /// How long sent data may go unacknowledged (and an idle connection unanswered by
    /// keepalive probes) before a data stream is given up as dead and its chunks in flight
    /// are reported lost. `None`: the kernel's defaults (about 15 minutes of retransmissions;
    /// an idle connection to a vanished peer is never noticed). A peer whose application stops
    /// reading for that long counts as dead too (the kernel applies the limit to zero-window
    /// probes).
    pub dead_peer_after: Option<Duration>,
    /// What the server allows a connection before its handshake is over: a deadline on the
    /// whole handshake and a cap on connections in it (see [`HandshakeLimits`]).
    pub handshake: HandshakeLimits,
}

/// Default of [`TcpConfig::dead_peer_after`]: long enough to ride out a switch reboot or a
/// link flap, short enough that a dead host does not hold requests for the kernel's quarter of
/// an hour (the same for both TCP data planes).
pub use ferry_net::DEAD_PEER_AFTER;
pub use ferry_net::{AcceptBackoff, HandshakeGate, HandshakeLimits, HandshakeSlot, HandshakeStats};

impl Default for TcpConfig {
    fn default() -> Self {
        Self {
            streams: 1,
            chunk_size: 1 << 20,
            depth: 8,
            socket_buffer: Some(4 << 20),
            connect_timeout: Duration::from_secs(10),
            io_threads: Some(0),
            dead_peer_after: Some(DEAD_PEER_AFTER),
            handshake: HandshakeLimits::default(),
        }
    }
}

/// The TCP [`Transport`].
#[derive(Debug, Clone)]
pub struct TcpTransport {
    config: TcpConfig,
    pool: Arc<pool::IoPool>,
    stats: Arc<TcpStats>,
}

/// Counters of one [`TcpTransport`], over every channel it opened.
#[derive(Debug, Default)]
pub struct TcpStats {
    /// Requests of one small chunk that the submitting thread sent itself on an idle stream,
    /// with no hand-over to the stream's sender task.
    pub direct_sends: AtomicU64,
    /// Direct sends the kernel took only in part; the sender task sent the rest.
    pub direct_tails: AtomicU64,
}

impl TcpTransport {
    /// A transport with `config` (streams clamped to 1..=64, chunk size to 1..=`MAX_CHUNK`).
    pub fn new(mut config: TcpConfig) -> Self {
        config.streams = config.streams.clamp(1, 64);
        config.chunk_size = config.chunk_size.clamp(1, ferry_core::wire::MAX_CHUNK);
        config.depth = config.depth.max(1);
        let pool = Arc::new(pool::IoPool::new(config.io_threads, "ferry-tcp-io"));
        Self {
            config,
            pool,
            stats: Arc::default(),
        }
    }

    /// The counters of every channel this transport opened.
    pub fn stats(&self) -> &TcpStats {
        &self.stats
    }

    /// Its settings.
    pub fn config(&self) -> &TcpConfig {
        &self.config
    }

    /// Opens a channel (the concrete type; [`Transport::open`] boxes it).
    pub async fn connect_channel(&self, peer: PeerInfo) -> Result<TcpChannel, Error> {
        let (addr, offered) = ferry_core::handshake::stream_endpoint(&peer)?;
        let n = self.config.streams.min(offered);
        let mut sockets = Vec::with_capacity(n);
        for i in 0..n {
            let code = TransportOffer::Tcp {
                streams: 0,
                port: 0,
            }
            .code();
            let attach = ferry_core::handshake::stream_attach(&peer, i as u16, code);
            sockets.push(
                control::attach(
                    addr,
                    attach,
                    ferry_core::handshake::attach_frame(&peer, attach),
                    self.config.connect_timeout,
                    self.config.socket_buffer,
                    self.config.dead_peer_after,
                )
                .await?,
            );
        }
        TcpChannel::new(
            peer.addr,
            sockets,
            self.config.chunk_size,
            self.config.depth,
            peer.version >= ferry_core::wire::VECTORED_VERSION,
            &self.pool,
            &self.stats,
        )
        .map_err(|e| Error::io("start the data streams of", peer.addr.to_string(), e))
    }
}

impl Transport for TcpTransport {
    fn kind(&self) -> TransportKind {
        TransportKind::Tcp
    }

    fn offer(&self) -> TransportOffer {
        TransportOffer::Tcp {
            streams: 64,
            port: 0,
        }
    }

    fn accept(&self, _peer: &PeerInfo) -> Result<TransportOffer, Error> {
        Ok(self.offer())
    }

    fn open(&self, peer: PeerInfo) -> BoxFuture<'static, Result<Arc<dyn Channel>, Error>> {
        let this = self.clone();
        Box::pin(async move {
            let ch = this.connect_channel(peer).await?;
            Ok(Arc::new(ch) as Arc<dyn Channel>)
        })
    }
}
