//! The io_uring data plane's settings ([`UringConfig`], [`ZeroCopy`]) and the timing the client
//! and server rings share ([`FINISH_GRACE`]). The crate root re-exports the public ones; the
//! client and server import them from here, so no import points back up to the root.

use std::time::Duration;

use ferry_net::{DEAD_PEER_AFTER, HandshakeLimits};

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
    /// in [`IoStats::register_failures`](crate::IoStats::register_failures)).
    pub register_buffers: bool,
    /// Whether the kernel offers SEND_ZC (from the probe; set by
    /// [`UringTransport::new`](crate::UringTransport::new)).
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
    /// A small WRITE or READ (at most 16 KiB) sent directly on an idle stream
    /// ([`UringChannel`](crate::UringChannel)'s fast path) from a task on a tokio runtime with
    /// I/O enabled has its response (and a READ's payload) read by that task: it receives
    /// without blocking whenever the runtime's reactor finds the socket readable, so the round
    /// trip wakes no thread but the awaiting one (the stream's client ring keeps only a hang-up
    /// poll armed while the stream is idle). On by default; off, the stream's client ring reads
    /// every response and wakes the task. A runtime built without I/O is found out at its
    /// first such request, quietly (no panic printed), and its tasks' requests are read by the
    /// rings from then on. Counted in
    /// [`IoStats::caller_receives`](crate::IoStats::caller_receives),
    /// [`IoStats::caller_handbacks`](crate::IoStats::caller_handbacks) and
    /// [`IoStats::caller_takeovers`](crate::IoStats::caller_takeovers).
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
            caller_receives: true,
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
