//! The portable data plane's settings: one set on the builder, from which the TCP and the
//! io_uring transports' configurations are both derived (here, and only here).

use std::time::Duration;

use ferry_transport_tcp::TcpConfig;
#[cfg(feature = "uring")]
use ferry_transport_uring::UringConfig;

/// The environment variable that, set to `off` (or `0`, `false`, `no`), turns the same-host plane
/// off for every engine of the process (see `EngineBuilder::same_host`); set to `privileged`, it
/// serves the plane even where a serving thread cannot drop `CAP_SYS_PTRACE`.
pub const SAME_HOST_ENV: &str = "FERRY_SAME_HOST";

/// What the builder sets for the portable data plane, whichever transport carries it.
#[derive(Clone, Debug)]
pub(crate) struct DataPlaneConfig {
    /// Data streams per peer.
    pub(crate) streams: usize,
    /// Largest chunk an op is split into.
    pub(crate) chunk_size: u64,
    /// Chunks in flight per stream.
    pub(crate) depth: usize,
    /// Socket buffer size (`None`: kernel autotuning).
    pub(crate) socket_buffer: Option<usize>,
    /// Limit for connecting, the handshake and attaching a stream.
    pub(crate) connect_timeout: Duration,
    /// How long sent data may go unacknowledged before the peer is taken for dead.
    pub(crate) dead_peer_after: Option<Duration>,
    /// The TCP data plane's I/O threads (see `TcpConfig::io_threads`).
    pub(crate) io_threads: Option<usize>,
    /// How many rings serve the io_uring listener's data streams (0: one per CPU).
    #[cfg(feature = "uring")]
    pub(crate) uring_server_rings: usize,
    /// Whether a task awaiting a small io_uring WRITE reads its response itself.
    #[cfg(feature = "uring")]
    pub(crate) uring_caller_receives: bool,
    /// How many rings drive the io_uring client streams (0: one per CPU).
    #[cfg(feature = "uring")]
    pub(crate) uring_client_rings: usize,
    /// What the listener allows a connection before its handshake is over.
    pub(crate) handshake: ferry_transport_tcp::HandshakeLimits,
}

impl Default for DataPlaneConfig {
    /// The TCP transport's defaults, and io_uring's default rings.
    fn default() -> Self {
        #[cfg(feature = "uring")]
        let uring = UringConfig::default();
        let TcpConfig {
            streams,
            chunk_size,
            depth,
            socket_buffer,
            connect_timeout,
            io_threads,
            dead_peer_after,
            handshake,
        } = TcpConfig::default();
        Self {
            streams,
            chunk_size,
            depth,
            socket_buffer,
            connect_timeout,
            dead_peer_after,
            io_threads,
            #[cfg(feature = "uring")]
            uring_server_rings: uring.server_rings,
            #[cfg(feature = "uring")]
            uring_caller_receives: uring.caller_receives,
            #[cfg(feature = "uring")]
            uring_client_rings: uring.client_rings,
            handshake,
        }
    }
}

impl DataPlaneConfig {
    /// The TCP transport's (and its server's) configuration.
    /// The same-host plane's settings: the connect timeout and handshake limits shared with
    /// the network planes, its own streams, depth and chunk size.
    pub(crate) fn local(&self) -> ferry_transport_local::LocalConfig {
        ferry_transport_local::LocalConfig {
            connect_timeout: self.connect_timeout,
            handshake: self.handshake,
            ..Default::default()
        }
    }

    pub(crate) fn tcp(&self) -> TcpConfig {
        TcpConfig {
            streams: self.streams,
            chunk_size: self.chunk_size,
            depth: self.depth,
            socket_buffer: self.socket_buffer,
            connect_timeout: self.connect_timeout,
            io_threads: self.io_threads,
            dead_peer_after: self.dead_peer_after,
            handshake: self.handshake,
        }
    }

    /// The io_uring transport's (and its server's) configuration; what the builder does not
    /// set keeps `UringConfig`'s defaults.
    #[cfg(feature = "uring")]
    pub(crate) fn uring(&self) -> UringConfig {
        UringConfig {
            streams: self.streams,
            chunk_size: self.chunk_size,
            depth: self.depth,
            socket_buffer: self.socket_buffer,
            connect_timeout: self.connect_timeout,
            dead_peer_after: self.dead_peer_after,
            server_rings: self.uring_server_rings,
            caller_receives: self.uring_caller_receives,
            client_rings: self.uring_client_rings,
            handshake: self.handshake,
            ..UringConfig::default()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_transports_get_every_setting() {
        let c = DataPlaneConfig {
            streams: 3,
            chunk_size: 4096,
            depth: 5,
            socket_buffer: None,
            connect_timeout: Duration::from_secs(7),
            dead_peer_after: Some(Duration::from_secs(9)),
            io_threads: None,
            #[cfg(feature = "uring")]
            uring_server_rings: 17,
            #[cfg(feature = "uring")]
            uring_caller_receives: true,
            #[cfg(feature = "uring")]
            uring_client_rings: 19,
            handshake: ferry_transport_tcp::HandshakeLimits {
                timeout: Duration::from_secs(3),
                max_pending: 13,
            },
        };
        let t = c.tcp();
        assert_eq!(
            (
                t.streams,
                t.chunk_size,
                t.depth,
                t.socket_buffer,
                t.io_threads
            ),
            (3, 4096, 5, None, None)
        );
        assert_eq!(
            (t.connect_timeout, t.dead_peer_after, t.handshake),
            (c.connect_timeout, c.dead_peer_after, c.handshake)
        );
        #[cfg(feature = "uring")]
        {
            let u = c.uring();
            assert_eq!(
                (u.streams, u.chunk_size, u.depth, u.socket_buffer),
                (3, 4096, 5, None)
            );
            assert_eq!(u.server_rings, 17);
            assert!(u.caller_receives);
            assert_eq!(u.client_rings, 19);
            assert_eq!(
                (u.connect_timeout, u.dead_peer_after, u.handshake),
                (c.connect_timeout, c.dead_peer_after, c.handshake)
            );
        }
    }
}
