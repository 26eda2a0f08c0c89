//! The engine's listener: the io_uring server where io_uring carries the data plane (its data
//! streams on a fixed set of rings), the TCP transport's server otherwise.

use std::net::SocketAddr;
use std::sync::Arc;

use ferry_core::Error;
use ferry_transport_tcp::{ServerHandle, TcpServer};
#[cfg(feature = "uring")]
use ferry_transport_uring::{UringServer, UringServerHandle, UringTransport};

use crate::config::DataPlaneConfig;
use crate::serve::{RegistryTable, Responder};

/// A listener the engine serves published segments on.
#[derive(Debug)]
pub(crate) enum Server {
    Tcp(ServerHandle),
    #[cfg(feature = "uring")]
    Uring(UringServerHandle),
}

impl Server {
    /// Binds `addr` and serves `table` on it: with the io_uring server when `uring` carries the
    /// data plane, else with the TCP server (which needs a tokio runtime, checked here).
    pub(crate) fn start(
        addr: SocketAddr,
        config: &DataPlaneConfig,
        #[cfg(feature = "uring")] uring: Option<&UringTransport>,
        table: Arc<RegistryTable>,
        responder: Arc<Responder>,
    ) -> Result<Self, Error> {
        #[cfg(feature = "uring")]
        if let Some(uring) = uring {
            let h = UringServer::bind(addr)?.serve(table, responder, uring.config().clone())?;
            return Ok(Server::Uring(h));
        }
        if let Err(e) = tokio::runtime::Handle::try_current() {
            return Err(Error::Unavailable {
                library: "tokio runtime".into(),
                reason: format!("EngineBuilder::build with listen needs one: {e}"),
            });
        }
        let server = TcpServer::bind(addr)?;
        Ok(Server::Tcp(server.serve(table, responder, config.tcp())))
    }

    /// The listener's handshake counters, and the limits they are counted against.
    pub(crate) fn handshakes(
        &self,
    ) -> (
        ferry_transport_tcp::HandshakeStats,
        ferry_transport_tcp::HandshakeLimits,
    ) {
        match self {
            Server::Tcp(h) => (h.handshakes(), h.handshake_limits()),
            #[cfg(feature = "uring")]
            Server::Uring(h) => (h.handshakes(), h.handshake_limits()),
        }
    }

    pub(crate) fn local_addr(&self) -> SocketAddr {
        match self {
            Server::Tcp(h) => h.local_addr(),
            #[cfg(feature = "uring")]
            Server::Uring(h) => h.local_addr(),
        }
    }

    pub(crate) fn shutdown(&self) {
        match self {
            Server::Tcp(h) => h.shutdown(),
            #[cfg(feature = "uring")]
            Server::Uring(h) => h.shutdown(),
        }
    }
}
