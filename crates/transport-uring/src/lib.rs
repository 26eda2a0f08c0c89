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
mod control;
mod error;
mod file_ring;
pub mod probe;
mod ring;
mod server;
#[cfg(test)]
mod testing;
mod waiter;

use std::sync::Arc;
use std::time::Duration;

use ferry_core::wire::TransportOffer;
use ferry_core::{BoxFuture, Channel, Error, PeerInfo, Transport, TransportKind};

pub use client::UringChannel;
pub use control::handshake;
pub use error::UringError;
pub use file_ring::read_file_into;
pub use probe::{OpcodeSupport, UringProbe, probe_kernel};
pub use ring::IoStats;
pub use server::{UringServer, UringServerHandle};
pub use waiter::block_on;

/// Whether payload sends use SEND_ZC.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum ZeroCopy {
    /// SEND_ZC where the kernel offers it, SEND otherwise.
    #[default]
    Auto,
    /// Always SEND_ZC; a kernel without it is an error.
    Always,
    /// Always plain SEND.
    Never,
}

/// Settings of the io_uring data plane.
#[derive(Clone, Debug)]
pub struct UringConfig {
    /// Data streams per peer (1 to 64).
    pub streams: usize,
    /// Largest chunk an op is split into.
    pub chunk_size: u64,
    /// Chunks in flight per stream.
    pub depth: usize,
    /// Socket buffer size to request (where the kernel's maximum allows). `None`: autotuning.
    pub socket_buffer: Option<usize>,
    /// Limit for connecting and attaching a stream (and for a new connection's first frame).
    pub connect_timeout: Duration,
    /// SEND_ZC policy.
    pub zero_copy: ZeroCopy,
    /// Try to register buffers and the socket as fixed resources (falls back silently, counted
    /// in [`IoStats::register_failures`]).
    pub register_buffers: bool,
    /// Whether the kernel offers SEND_ZC (from the probe; set by [`UringTransport::new`]).
    pub kernel_send_zc: bool,
    /// To a loopback peer, send WRITE payloads by page reference (`vmsplice` + `splice`)
    /// instead of SEND_ZC, which the kernel copies on loopback: the peer's receive is then the
    /// only copy. The request is drained once the peer acknowledged the payload.
    pub splice_loopback: bool,
    /// Whether the kernel offers IORING_OP_SPLICE (from the probe).
    pub kernel_splice: bool,
    /// To a loopback peer over two or more streams, pin the client's stream `i` thread to the
    /// `i`-th CPU this thread may run on; the server serves a loopback client's stream `i` on
    /// ring `i` (modulo the rings) and, once such a client's second stream attached, pins its
    /// ring `i` to the `i`-th CPU, so both ends of one flow share a core's caches instead of
    /// bouncing each chunk between cores (`docs/performance.md`). Off: the scheduler places
    /// every thread.
    pub pin_loopback_streams: bool,
    /// To a loopback peer, a data stream whose congestion control paces its sends (BBR, the
    /// kernel's choice on many hosts) switches to one that does not (cubic, else reno), on both
    /// ends. Without a pacing qdisc the kernel paces such a socket itself with a timer per burst
    /// (`tcp_pace_kick`), armed from the acknowledgements the sending ring processes: on
    /// loopback, where there is no link to pace for, that made a serving ring the bottleneck of
    /// a one-stream 1 MiB READ (`docs/performance.md`). Off: the system's default everywhere.
    pub unpaced_loopback: bool,
    /// How long sent data may go unacknowledged (and an idle connection unanswered by
    /// keepalive probes) before a data stream is given up as dead: its chunks in flight are
    /// then reported lost and the kernel drops its references to their pages, so `drained`
    /// resolves. `None`: the kernel's defaults (about 15 minutes of retransmissions; an idle
    /// connection to a vanished peer is never noticed). A peer whose application stops reading
    /// for that long counts as dead too (the kernel applies the limit to zero-window probes).
    pub dead_peer_after: Option<Duration>,
    /// What the server allows a connection before its handshake is over: a deadline on the
    /// whole handshake and a cap on connections in it (see [`HandshakeLimits`]). Connections
    /// in their handshake share one thread.
    pub handshake: HandshakeLimits,
    /// How many rings serve a server's data streams, each on one thread (0: one per CPU this
    /// process may run on): a served stream costs no thread.
    pub server_rings: usize,
    /// A small WRITE or READ (at most 16 KiB) sent directly on an idle stream ([`UringChannel`]'s
    /// fast path) from a task on a tokio runtime with I/O enabled has its response (and a READ's
    /// payload) read by that task: it receives without blocking whenever the runtime's reactor
    /// finds the socket readable, so the round trip wakes no thread but the awaiting one (the
    /// stream's client ring keeps only a hang-up poll armed while the stream is idle). Off (the
    /// default): the stream's client ring reads every response and wakes the task. Counted in
    /// [`IoStats::caller_receives`], [`IoStats::caller_handbacks`] and
    /// [`IoStats::caller_takeovers`].
    ///
    /// On, a response that waits unread in its socket for a tick (2 to 4 ms: its request is not
    /// being awaited, or its runtime's reactor is not driven) is read by the stream's ring
    /// instead, as is one whose stream takes a later request, so every request completes whether
    /// or not anything polls it; such a request completes that much later than with the switch
    /// off. While direct readers are about each ring wakes once per tick to look.
    pub caller_receives: bool,
    /// How many rings drive the client's data streams, each on one thread (0: one per CPU this
    /// process may run on), started at the transport's first connect and shared by every
    /// channel it opens: a client stream costs no thread.
    pub client_rings: usize,
}

impl Default for UringConfig {
    fn default() -> Self {
        Self {
            streams: 1,
            chunk_size: 1 << 20,
            depth: 8,
            socket_buffer: Some(4 << 20),
            connect_timeout: Duration::from_secs(10),
            zero_copy: ZeroCopy::Auto,
            register_buffers: true,
            kernel_send_zc: false,
            splice_loopback: true,
            kernel_splice: false,
            pin_loopback_streams: true,
            unpaced_loopback: true,
            dead_peer_after: Some(DEAD_PEER_AFTER),
            handshake: HandshakeLimits::default(),
            server_rings: 0,
            caller_receives: false,
            client_rings: 0,
        }
    }
}

impl UringConfig {
    /// Whether payloads to `peer` go out with SEND_ZC: `Auto` leaves loopback peers to copying
    /// sends, since the kernel copies SEND_ZC on loopback anyway; `Always` uses it everywhere.
    pub fn zero_copy_for(&self, peer: std::net::IpAddr) -> bool {
        match self.zero_copy {
            ZeroCopy::Auto => self.kernel_send_zc && !peer.is_loopback(),
            _ => self.zero_copy_enabled(),
        }
    }

    /// Whether payloads go out with SEND_ZC under this configuration (to a non-loopback peer).
    pub fn zero_copy_enabled(&self) -> bool {
        match self.zero_copy {
            ZeroCopy::Always => true,
            ZeroCopy::Never => false,
            ZeroCopy::Auto => self.kernel_send_zc,
        }
    }
}

/// How long an ending stream waits for the peer to acknowledge its zero-copy sends before it
/// resets the connection to make the kernel let go of their pages (a client ring's ended
/// stream; a server ring waits as long when it stops).
pub(crate) const FINISH_GRACE: Duration = Duration::from_secs(1);

/// Pins the calling thread to the `index`-th CPU (modulo their count) of those it may run on now
/// (see [`UringConfig::pin_loopback_streams`]). Best effort: a failure is logged and ignored.
pub(crate) fn pin_stream_thread(index: usize) {
    // SAFETY: a zeroed cpu_set_t is a valid empty set; the calls below only read and write this
    // local set and the calling thread's (pid 0) affinity.
    unsafe {
        let mut allowed: libc::cpu_set_t = std::mem::zeroed();
        let size = std::mem::size_of::<libc::cpu_set_t>();
        if libc::sched_getaffinity(0, size, &mut allowed) != 0 {
            tracing::debug!(error = %std::io::Error::last_os_error(), "sched_getaffinity");
            return;
        }
        let cpus: Vec<usize> = (0..libc::CPU_SETSIZE as usize)
            .filter(|&c| libc::CPU_ISSET(c, &allowed))
            .collect();
        if cpus.len() < 2 {
            return;
        }
        let cpu = cpus[index % cpus.len()];
        let mut one: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut one);
        if libc::sched_setaffinity(0, size, &one) != 0 {
            tracing::debug!(error = %std::io::Error::last_os_error(), cpu, "sched_setaffinity");
        }
    }
}

/// Switches `socket` from a congestion control that paces its sends (any BBR) to one that does
/// not (cubic, else reno; see [`UringConfig::unpaced_loopback`]): whether it did. Best effort: a
/// socket the kernel will not switch keeps its own (logged).
pub(crate) fn unpace(socket: &impl std::os::fd::AsRawFd) -> bool {
    let fd = socket.as_raw_fd();
    let mut name = [0u8; 16];
    let mut len = name.len() as libc::socklen_t;
    // SAFETY: reads at most `len` bytes of the socket's option into a local buffer.
    let got = unsafe {
        libc::getsockopt(
            fd,
            libc::IPPROTO_TCP,
            libc::TCP_CONGESTION,
            name.as_mut_ptr().cast(),
            &mut len,
        )
    };
    if got != 0 || !name.starts_with(b"bbr") {
        return false;
    }
    for cc in [&b"cubic"[..], b"reno"] {
        // SAFETY: passes a local byte string of its own length to the socket's option.
        let set = unsafe {
            libc::setsockopt(
                fd,
                libc::IPPROTO_TCP,
                libc::TCP_CONGESTION,
                cc.as_ptr().cast(),
                cc.len() as libc::socklen_t,
            )
        };
        if set == 0 {
            return true;
        }
    }
    tracing::debug!(error = %std::io::Error::last_os_error(), "TCP_CONGESTION: the stream stays paced");
    false
}

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
                unpace(s);
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

#[cfg(test)]
mod tests {
    fn allowed() -> Vec<usize> {
        // SAFETY: a zeroed cpu_set_t is a valid empty set, filled by the kernel for this thread.
        unsafe {
            let mut set: libc::cpu_set_t = std::mem::zeroed();
            assert_eq!(
                libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set),
                0
            );
            (0..libc::CPU_SETSIZE as usize)
                .filter(|&c| libc::CPU_ISSET(c, &set))
                .collect()
        }
    }

    /// A loopback socket under BBR leaves it for a congestion control that does not pace; one
    /// under another keeps it.
    #[test]
    fn unpace_leaves_bbr_only() {
        fn congestion(s: &std::net::TcpStream) -> String {
            use std::os::fd::AsRawFd;
            let mut name = [0u8; 16];
            let mut len = name.len() as libc::socklen_t;
            // SAFETY: reads at most `len` bytes of the option into a local buffer.
            let got = unsafe {
                libc::getsockopt(
                    s.as_raw_fd(),
                    libc::IPPROTO_TCP,
                    libc::TCP_CONGESTION,
                    name.as_mut_ptr().cast(),
                    &mut len,
                )
            };
            assert_eq!(got, 0);
            String::from_utf8_lossy(&name[..len as usize])
                .trim_end_matches('\0')
                .to_owned()
        }
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let s = std::net::TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let before = congestion(&s);
        let switched = super::unpace(&s);
        let after = congestion(&s);
        if before.starts_with("bbr") {
            assert!(switched, "{before} kept");
            assert!(!after.starts_with("bbr"), "{after}");
        } else {
            assert!(!switched);
            assert_eq!(after, before);
        }
    }

    #[test]
    fn a_pinned_stream_thread_runs_on_the_indexed_allowed_cpu() {
        let before = allowed();
        if before.len() < 2 {
            ferry_tests::require_or_skip(
                ferry_tests::CPUS,
                format!("this process may run on {} CPU(s)", before.len()),
            );
            return;
        }
        for index in [0, 1, before.len() + 1] {
            let after = std::thread::spawn(move || {
                super::pin_stream_thread(index);
                allowed()
            })
            .join()
            .unwrap();
            assert_eq!(after, vec![before[index % before.len()]], "index {index}");
        }
    }
}
