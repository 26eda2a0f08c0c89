//! What the crate's two-process tests share: the identity a bare same-host server answers with.

use ferry_core::wire::{Hello, Reject};
use ferry_core::{Epoch, HandshakeResponder, PeerId};

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
