//! What the crate's tests share: the identity a bare same-host server answers with, a peer
//! record for such a server, and a server of one table in this process. Each test file uses
//! part of it, hence `dead_code` allowed on the parts.

use std::sync::Arc;

use ferry_core::wire::{Hello, Reject, TransportOffer, VECTORED_VERSION};
use ferry_core::{Epoch, HandshakeResponder, PeerId, PeerInfo, SegmentTable};
use ferry_net::HandshakeLimits;
use ferry_transport_local::{LocalServer, LocalServerHandle};

/// A same-host server's identity: peer 7 at `epoch`. The plane's socket takes attaches only,
/// so it never answers a hello.
#[derive(Debug)]
pub(crate) struct Responder(pub(crate) Epoch);

impl HandshakeResponder for Responder {
    fn peer_id(&self) -> PeerId {
        PeerId(7)
    }
    fn epoch(&self) -> Epoch {
        self.0
    }
    fn respond(
        &self,
        _: &Hello,
        _: std::net::SocketAddr,
        _: Option<&str>,
    ) -> Result<Hello, Reject> {
        panic!("a same-host socket never answers a hello")
    }
}

/// The peer record a client holds for a same-host server at `socket` in process `pid`,
/// answering as [`Responder`] at `epoch` and offering `streams` streams.
#[allow(dead_code)]
pub(crate) fn peer_at(socket: &str, pid: u32, epoch: Epoch, streams: u16) -> PeerInfo {
    PeerInfo {
        addr: "127.0.0.1:1".parse().unwrap(),
        local_id: PeerId(1),
        local_epoch: Epoch::fresh(),
        remote_id: PeerId(7),
        remote_epoch: epoch,
        offer: TransportOffer::Local {
            boot_id: [0; 16],
            pid,
            streams,
            socket: socket.to_owned(),
        },
        segments: Vec::new(),
        session: None,
        key_name: None,
        version: VECTORED_VERSION,
    }
}

/// `table` served by a fresh same-host server in this process, and the peer record for it
/// offering `streams` streams.
#[allow(dead_code)]
pub(crate) fn serve_table(
    table: Arc<dyn SegmentTable>,
    streams: u16,
) -> (LocalServerHandle, PeerInfo) {
    let epoch = Epoch::fresh();
    let h = LocalServer::bind()
        .unwrap()
        .serve(
            table,
            Arc::new(Responder(epoch)),
            HandshakeLimits::default(),
            16,
        )
        .unwrap();
    let peer = peer_at(h.name(), std::process::id(), epoch, streams);
    (h, peer)
}
