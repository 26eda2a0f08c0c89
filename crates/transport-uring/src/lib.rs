//! Ferry's TCP wire protocol driven by io_uring, and its accelerator of file segments.
//!
//! - [`probe_kernel`] / [`UringProbe`]: which io_uring opcodes this kernel offers.
//! - [`select`]: the engine's choice between io_uring and TCP, with the reason it can report.
//! - [`UringTransport`]: the [`Transport`] that opens [`UringChannel`]s. No client stream has a
//!   thread: a fixed set of client rings ([`UringConfig::client_rings`], one per CPU by default,
//!   started at the first connect), each on one thread, drives every stream of every channel as
//!   a state machine with one send and one receive in flight (the next response's receive kept
//!   armed, idle or not); sockets are fixed files, WRITE payloads go out with SEND_ZC (from
//!   registered buffers where the kernel lets us register the region, unregistered otherwise,
//!   e.g. under a small `RLIMIT_MEMLOCK`) or a copying send, what a socket takes or holds at
//!   once moves with one non-blocking syscall, and a request is drained only once every
//!   zero-copy notification arrived. A channel's chunks are dealt to its streams in turn; a
//!   stream with nothing in flight takes the oldest chunk of another's queue, and a dying stream
//!   hands its queue on.
//! - [`UringServer`]: the serving side, same shape as the TCP transport's server and the same
//!   bytes on the wire, so a uring peer and a TCP peer interoperate in both directions. It also
//!   serves the file segments of its table ([`ferry_core::SegmentTable::file`]): a
//!   `ferry_file::FileSegment` (recognized by downcasting the `FileSource`) through the stream's
//!   ring, O_DIRECT where a piece's alignment allows; any other source by its positioned I/O.
//! - A server's connections in their handshake cost no thread: its accept thread runs all of
//!   them on non-blocking sockets, within [`UringConfig::handshake`] (a deadline on each, a cap
//!   on how many at once).
//! - No data stream gets a thread either: a fixed set of rings ([`UringConfig::server_rings`], one per CPU by default), each on one
//!   thread, serves every attached stream as a queue of steps around the same
//!   [`ServerStream`](ferry_core::stream::ServerStream), one socket operation of each stream in
//!   flight, every stream's submissions of a turn in one `io_uring_enter`; sockets are fixed
//!   files, READ payloads go out with SEND_ZC where the configuration sends zero-copy (registered
//!   buffers where the ring takes them), copying SENDMSG otherwise, and what a socket takes or
//!   holds at once moves with one plain non-blocking syscall. File segments keep their paths
//!   (O_DIRECT ring reads and writes, positioned I/O for other sources), a piece of at most
//!   1 MiB at a time on the ring's thread.
//! - [`read_file_into`]: loads a file range into registered memory with bounded queue depth
//!   (positioned reads, `ferry_file`'s portable path, where the kernel refuses a ring).
//!
//! File segments themselves live in `ferry-file`, below the transports: the TCP data plane
//! serves and reads them without io_uring.
//!
//! On loopback the kernel copies SEND_ZC payloads, which makes SEND_ZC slower than a plain SEND
//! there (`docs/performance.md`), so `ZeroCopy::Auto` sends to loopback peers with SEND, and WRITE payloads to loopback peers go by `vmsplice` +
//! `splice` (`UringConfig::splice_loopback`), which leaves the receiver's copy as the only one.
//! The splice is a direct syscall on the ring's (or the stream's) thread, the socket non-blocking
//! for that call only: io_uring always hands IORING_OP_SPLICE to an io-wq worker, and that
//! hand-off cost more than the splice. `ZeroCopy::Always` keeps
//! SEND_ZC everywhere (the tests use it to check it).
//!
//! A loopback peer's data streams do not run a pacing congestion control (BBR leaves for cubic,
//! `UringConfig::unpaced_loopback`): the kernel would otherwise pace them with a timer per burst,
//! armed on the sending ring's thread, for a link that is not there.
//!
//! Receives are plain RECV straight into registered memory (multishot receive with provided
//! buffers would add a copy out of the provided buffers, so it is not used for payloads).
#![deny(unsafe_op_in_unsafe_fn)]

mod client;
mod config;
mod control;
mod error;
mod file_ring;
pub mod probe;
mod ring;
mod server;
#[cfg(test)]
mod testing;
mod tune;
mod waiter;

use std::sync::Arc;

use ferry_core::wire::TransportOffer;
use ferry_core::{BoxFuture, Channel, Error, PeerInfo, Transport, TransportKind};

pub use client::UringChannel;
pub use config::{UringConfig, ZeroCopy};
pub use control::handshake;
pub use error::UringError;
pub use file_ring::read_file_into;
pub use probe::{OpcodeSupport, UringProbe, probe_kernel};
pub use ring::IoStats;
pub use server::{UringServer, UringServerHandle};
pub use waiter::block_on;

/// What the user asked for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Preference {
    /// io_uring where the kernel can carry it, TCP otherwise.
    #[default]
    Auto,
    /// io_uring or an error.
    Uring,
    /// TCP, even where io_uring would work.
    Tcp,
}

/// The engine's data-plane choice and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Selection {
    /// The transport to use.
    pub kind: TransportKind,
    /// Why (reportable in `describe()`).
    pub reason: String,
}

/// Chooses between io_uring and TCP from a kernel probe and the user's preference. A forced
/// io_uring on a kernel that cannot carry it is an error naming what is missing.
pub fn select(probe: &UringProbe, pref: Preference) -> Result<Selection, UringError> {
    match (pref, probe.unusable_reason()) {
        (Preference::Tcp, _) => Ok(Selection {
            kind: TransportKind::Tcp,
            reason: "tcp forced by configuration".into(),
        }),
        (Preference::Uring, Some(why)) => Err(UringError::Unusable { reason: why }),
        (Preference::Auto, Some(why)) => Ok(Selection {
            kind: TransportKind::Tcp,
            reason: format!("fell back to tcp: {why}"),
        }),
        (pref, None) => Ok(Selection {
            kind: TransportKind::Uring,
            reason: format!(
                "io_uring {} (SEND_ZC {})",
                if pref == Preference::Uring {
                    "forced by configuration"
                } else {
                    "supported by the kernel"
                },
                if probe.supports("SEND_ZC") {
                    "available"
                } else {
                    "unavailable: copying sends"
                }
            ),
        }),
    }
}

/// Default of [`UringConfig::dead_peer_after`] (and of the TCP transport's): long enough to
/// ride out a switch reboot or a link flap, short enough that a dead host does not hold
/// requests for the kernel's quarter of an hour.
pub use ferry_net::DEAD_PEER_AFTER;
pub use ferry_net::{HandshakeLimits, HandshakeStats};

/// The io_uring [`Transport`].
#[derive(Debug, Clone)]
pub struct UringTransport {
    config: UringConfig,
    stats: Arc<IoStats>,
    /// The client rings, once the first connect started them (shared by the transport's clones).
    rings: Arc<std::sync::Mutex<Option<Arc<client::ClientRings>>>>,
}

impl UringTransport {
    /// Probes the kernel and builds a transport (streams clamped to 1..=64, chunk size to
    /// 1..=`MAX_CHUNK`). Fails with the probe's reason where io_uring cannot carry the data
    /// plane, or where `ZeroCopy::Always` meets a kernel without SEND_ZC.
    pub fn new(config: UringConfig) -> Result<Self, UringError> {
        Self::with_probe(config, &probe_kernel())
    }

    /// As [`UringTransport::new`] with a given probe result (tests force one).
    pub fn with_probe(mut config: UringConfig, probe: &UringProbe) -> Result<Self, UringError> {
        if let Some(reason) = probe.unusable_reason() {
            return Err(UringError::Unusable { reason });
        }
        config.kernel_send_zc = probe.supports("SEND_ZC");
        config.kernel_splice = probe.supports("SPLICE");
        if config.zero_copy == ZeroCopy::Always && !config.kernel_send_zc {
            return Err(UringError::Unusable {
                reason: "zero-copy send forced but the kernel lacks io_uring opcode SEND_ZC".into(),
            });
        }
        config.streams = config.streams.clamp(1, 64);
        config.chunk_size = config.chunk_size.clamp(1, ferry_core::wire::MAX_CHUNK);
        config.depth = config.depth.max(1);
        Ok(Self {
            config,
            stats: Arc::new(IoStats::default()),
            rings: Arc::default(),
        })
    }

    /// Its settings (after the probe).
    pub fn config(&self) -> &UringConfig {
        &self.config
    }

    /// The I/O counters of every channel this transport opened.
    pub fn stats(&self) -> &IoStats {
        &self.stats
    }

    /// The same counters, shared (readable after the transport is gone: its client rings end
    /// with it and count themselves out).
    pub fn stats_handle(&self) -> Arc<IoStats> {
        self.stats.clone()
    }

    /// One line for `engine.describe()`.
    pub fn describe(&self) -> String {
        use std::sync::atomic::Ordering::Relaxed;
        let s = &self.stats;
        format!(
            "uring: streams {}, SEND_ZC {}, registered buffers {}; threads {} (client rings), zc sends {}, fixed {}, copy sends {}, notifications {}, short sends {}, register failures {}",
            self.config.streams,
            if self.config.zero_copy_enabled() {
                "on"
            } else {
                "off"
            },
            if self.config.register_buffers {
                "tried"
            } else {
                "off"
            },
            s.threads.load(Relaxed),
            s.zc_sends.load(Relaxed),
            s.fixed_sends.load(Relaxed),
            s.copy_sends.load(Relaxed),
            s.notifications.load(Relaxed),
            s.short_sends.load(Relaxed),
            s.register_failures.load(Relaxed),
        )
    }

    /// Opens a channel (blocking: connects and attaches the streams).
    pub fn connect_channel_blocking(&self, peer: PeerInfo) -> Result<UringChannel, Error> {
        let (addr, offered) = ferry_core::handshake::stream_endpoint(&peer)?;
        let n = self.config.streams.min(offered);
        let mut sockets = Vec::with_capacity(n);
        for i in 0..n {
            let attach = ferry_core::handshake::stream_attach(&peer, i as u16, self.offer().code());
            sockets.push(control::attach(
                addr,
                attach,
                ferry_core::handshake::attach_frame(&peer, attach),
                self.config.connect_timeout,
                self.config.socket_buffer,
                self.config.dead_peer_after,
            )?);
        }
        if self.config.unpaced_loopback && addr.ip().is_loopback() {
            for s in &sockets {
                tune::unpace(s);
            }
        }
        let splice =
            self.config.splice_loopback && self.config.kernel_splice && addr.ip().is_loopback();
        let pin = self.config.pin_loopback_streams && addr.ip().is_loopback() && n >= 2;
        let rings = self.client_rings()?;
        UringChannel::new(
            peer.addr,
            sockets,
            self.config.chunk_size,
            self.config.depth,
            client::SendPlan {
                zero_copy: self.config.zero_copy_for(addr.ip()),
                splice,
                pin,
                loopback: addr.ip().is_loopback(),
                vectored: peer.version >= ferry_core::wire::VECTORED_VERSION,
                caller_receives: self.config.caller_receives,
            },
            &rings,
            self.stats.clone(),
        )
    }

    /// The client rings, started on first use.
    fn client_rings(&self) -> Result<Arc<client::ClientRings>, Error> {
        let mut g = match self.rings.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        };
        if let Some(r) = g.as_ref() {
            return Ok(r.clone());
        }
        let plan = client::RingPlan {
            register: self.config.register_buffers,
            zero_copy: self.config.zero_copy_enabled(),
            pin: self.config.pin_loopback_streams,
        };
        let rings = Arc::new(
            client::ClientRings::start(self.config.client_rings, plan, &self.stats)
                .map_err(|e| Error::io("start the client rings of", "io_uring transport", e))?,
        );
        *g = Some(rings.clone());
        Ok(rings)
    }

    /// How many client rings run (0 until the first connect).
    pub fn client_rings_running(&self) -> usize {
        match self.rings.lock() {
            Ok(g) => g.as_ref().map_or(0, |r| r.len()),
            Err(p) => p.into_inner().as_ref().map_or(0, |r| r.len()),
        }
    }
}

impl Transport for UringTransport {
    fn kind(&self) -> TransportKind {
        TransportKind::Uring
    }

    fn offer(&self) -> TransportOffer {
        TransportOffer::Uring {
            streams: 64,
            port: 0,
            zero_copy: self.config.zero_copy_enabled(),
        }
    }

    fn accept(&self, _peer: &PeerInfo) -> Result<TransportOffer, Error> {
        Ok(self.offer())
    }

    fn open(&self, peer: PeerInfo) -> BoxFuture<'static, Result<Arc<dyn Channel>, Error>> {
        let this = self.clone();
        let (tx, rx) = waiter::oneshot();
        let spawned = std::thread::Builder::new()
            .name("ferry-uring-connect".into())
            .spawn(move || {
                tx.send(
                    this.connect_channel_blocking(peer)
                        .map(|c| Arc::new(c) as Arc<dyn Channel>),
                )
            });
        Box::pin(async move {
            if let Err(e) = spawned {
                return Err(Error::io("spawn connect thread", "io_uring transport", e));
            }
            match rx.await {
                Some(r) => r,
                None => Err(Error::Unavailable {
                    library: "io_uring".into(),
                    reason: "connect thread ended without a result".into(),
                }),
            }
        })
    }
}
