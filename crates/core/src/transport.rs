//! The boundary between the engine and its transports: small object-safe traits.
//!
//! - [`Transport`]: one kind of data plane (TCP, io_uring, RDMA). It says what it offers in the
//!   handshake, answers a peer's offer on the serving side, and opens a [`Channel`] to a peer.
//! - [`Channel`]: the data path to one peer incarnation. It runs requests and reports every chunk
//!   to the request's [`RequestControl`], from which the [`Outcome`] is computed.
//! - [`SegmentTable`]: the serving side's view of what is published, so that transports never
//!   depend on the registry. The engine adapts the registry to it.
//! - [`HandshakeResponder`]: the serving side's answer to a peer's [`Hello`].

use std::any::Any;
use std::fmt;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;

use crate::error::Error;
use crate::ids::{Access, Epoch, PeerId, SegmentToken};
use crate::memory::MemoryRegion;
use crate::op::{Op, OpKind, SegmentDesc};
use crate::outcome::{Outcome, RemoteStatus, RequestControl};
use crate::wire::{Hello, Reject, TransportOffer};

/// A boxed, sendable future (what object-safe async methods return).
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// The kinds of data plane.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[non_exhaustive]
pub enum TransportKind {
    /// tokio TCP.
    Tcp,
    /// io_uring (same wire as TCP).
    Uring,
    /// RDMA reliable-connected queue pairs.
    Rdma,
}

impl TransportKind {
    /// The name users type (`tcp`, `uring`, `rdma`).
    pub fn name(self) -> &'static str {
        match self {
            TransportKind::Tcp => "tcp",
            TransportKind::Uring => "uring",
            TransportKind::Rdma => "rdma",
        }
    }

    /// The kind of a handshake offer, if this build knows it.
    pub fn of_offer(offer: &TransportOffer) -> Option<Self> {
        match offer {
            TransportOffer::Tcp { .. } => Some(TransportKind::Tcp),
            TransportOffer::Uring { .. } => Some(TransportKind::Uring),
            TransportOffer::Rdma { .. } => Some(TransportKind::Rdma),
            _ => None,
        }
    }
}

impl fmt::Display for TransportKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Everything a transport needs to open a channel to (or accept one from) a peer whose handshake
/// succeeded.
#[derive(Clone, Debug)]
pub struct PeerInfo {
    /// The peer's control address.
    pub addr: SocketAddr,
    /// Our id.
    pub local_id: PeerId,
    /// Our epoch.
    pub local_epoch: Epoch,
    /// The peer's id.
    pub remote_id: PeerId,
    /// The peer's epoch.
    pub remote_epoch: Epoch,
    /// The peer's offer for this transport.
    pub offer: TransportOffer,
    /// The peer's published segments.
    pub segments: Vec<SegmentDesc>,
    /// The authenticated session with the peer, if the handshake authenticated (client side:
    /// its data streams attach with its proof).
    pub session: Option<Arc<crate::auth::Session>>,
    /// Server side: the key name the peer proved in the handshake (`None`: it proved none, or
    /// this is the client side). Limits on what one peer may hold (RDMA queue pairs) are kept
    /// per name.
    pub key_name: Option<Arc<str>>,
    /// The protocol version both ends speak (the newest in both ranges): vectored requests
    /// only from [`VECTORED_VERSION`](crate::wire::VECTORED_VERSION) on.
    pub version: u16,
}

/// One kind of data plane.
#[cfg_attr(any(test, feature = "__mock"), mockall::automock)]
pub trait Transport: Send + Sync + fmt::Debug + 'static {
    /// Which kind this is.
    fn kind(&self) -> TransportKind;

    /// The offer (with endpoints) to put in our handshake.
    fn offer(&self) -> TransportOffer;

    /// Serving side: a peer offered `peer.offer`; prepare to serve it (RDMA: create queue pairs
    /// and connect them to the peer's endpoints) and return our offer for that peer.
    fn accept(&self, peer: &PeerInfo) -> Result<TransportOffer, Error>;

    /// Client side: opens the data path to a peer whose handshake succeeded.
    fn open(&self, peer: PeerInfo) -> BoxFuture<'static, Result<Arc<dyn Channel>, Error>>;
}

/// The data path to one peer incarnation.
#[cfg_attr(any(test, feature = "__mock"), mockall::automock)]
pub trait Channel: Send + Sync + fmt::Debug + 'static {
    /// The transport this channel belongs to.
    fn kind(&self) -> TransportKind;

    /// Runs a request: posts its ops' chunks in order, reports each chunk to `control`, stops
    /// posting once `control` says so (stop or failure), and resolves once every posted chunk is
    /// acknowledged, refused or known lost, with `drained: true`. Ops were validated against the
    /// local regions and the peer's descriptors by the caller; the remote side checks again.
    ///
    /// The request starts here, before the future is first polled (the facade polls it only
    /// when the request is awaited): the future only waits for the chunks' fate.
    fn execute(&self, ops: Arc<[Op]>, control: Arc<RequestControl>) -> BoxFuture<'static, Outcome>;

    /// Whether the channel can still carry requests.
    fn is_alive(&self) -> bool;

    /// Closes the channel: in-flight chunks fail as lost, later requests fail at once.
    fn close(&self);
}

/// A published segment, resolved for serving one chunk. Holding the lease keeps the registration
/// from retiring under the chunk.
#[derive(Clone)]
pub struct SegmentLease {
    /// The memory.
    pub region: Arc<MemoryRegion>,
    /// Where the segment starts in `region`.
    pub base: u64,
    /// Segment length.
    pub len: u64,
    /// Rights peers have.
    pub access: Access,
    /// Whatever keeps the registration in use while the lease lives (registry lease guard).
    pub guard: Option<Arc<dyn Any + Send + Sync>>,
}

impl fmt::Debug for SegmentLease {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SegmentLease")
            .field("region", &self.region)
            .field("base", &self.base)
            .field("len", &self.len)
            .field("access", &self.access)
            .finish()
    }
}

impl SegmentLease {
    /// Checks an op of `kind` on `offset..offset+len` of the segment: access first, then bounds.
    /// Returns the offset in `region` on success.
    pub fn check(&self, kind: OpKind, offset: u64, len: u64) -> Result<u64, RemoteStatus> {
        if !self.access.contains(kind.needed_access()) {
            return Err(RemoteStatus::AccessDenied);
        }
        crate::memory::check_range(offset, len, self.len).map_err(|_| RemoteStatus::OutOfBounds)?;
        let at = self
            .base
            .checked_add(offset)
            .ok_or(RemoteStatus::OutOfBounds)?;
        self.region
            .check(at, len)
            .map_err(|_| RemoteStatus::OutOfBounds)?;
        Ok(at)
    }
}

/// A published file range, served with positioned reads and writes by servers that have no
/// faster way. `Any`, so that a server with one (the io_uring server and its `FileSegment`:
/// rings and O_DIRECT) can recognize the sources it knows.
pub trait FileSource: Any + Send + Sync + fmt::Debug + 'static {
    /// Checks an op of `kind` on `offset..offset+len` of the segment: access first, then bounds
    /// (a WRITE also against the file's size now, so that it can never extend the file).
    /// Returns the offset in the file.
    fn check(&self, kind: OpKind, offset: u64, len: u64) -> Result<u64, RemoteStatus>;

    /// Reads exactly `buf.len()` bytes at file offset `at` (a file that ends earlier is an
    /// `UnexpectedEof` error).
    fn read_exact_at(&self, at: u64, buf: &mut [u8]) -> std::io::Result<()>;

    /// Writes all of `buf` at file offset `at`.
    fn write_all_at(&self, at: u64, buf: &[u8]) -> std::io::Result<()>;
}

/// The serving side's table of published segments.
#[cfg_attr(any(test, feature = "__mock"), mockall::automock)]
pub trait SegmentTable: Send + Sync + fmt::Debug + 'static {
    /// The segment published under `token`, if any (retired ones are unknown).
    fn resolve(&self, token: SegmentToken) -> Option<SegmentLease>;

    /// Descriptors of everything published, for the handshake.
    fn published(&self) -> Vec<SegmentDesc>;

    /// The file segment published under `token`, if any (asked when [`resolve`](Self::resolve)
    /// does not know the token). Tables without file segments keep the default.
    fn file(&self, _token: SegmentToken) -> Option<Arc<dyn FileSource>> {
        None
    }

    /// Whether the segment under `token` is published to `peer` (the key name an authenticated
    /// peer proved; `None`: an unauthenticated peer). Segments published to named peers only
    /// are visible to those names alone. Tables that publish to everyone keep the default.
    // mockall's mocks need the argument's lifetime named.
    #[allow(clippy::needless_lifetimes)]
    fn visible_to<'a>(&self, _token: SegmentToken, _peer: Option<&'a str>) -> bool {
        true
    }

    /// Descriptors of what is published to `peer` (see [`visible_to`](Self::visible_to)), for
    /// the handshake. Tables that publish to everyone keep the default.
    // mockall's mocks need the argument's lifetime named.
    #[allow(clippy::needless_lifetimes)]
    fn published_to<'a>(&self, _peer: Option<&'a str>) -> Vec<SegmentDesc> {
        self.published()
    }
}

/// The serving side's identity and handshake policy.
#[cfg_attr(any(test, feature = "__mock"), mockall::automock)]
pub trait HandshakeResponder: Send + Sync + fmt::Debug + 'static {
    /// Our peer id.
    fn peer_id(&self) -> PeerId;

    /// Our epoch.
    fn epoch(&self) -> Epoch;

    /// Answers a peer's hello from `from`: our hello (with the transports we accept for it and
    /// the segments published to `peer`: the key name it proved, `None` when unauthenticated),
    /// or a refusal.
    // mockall's mocks need the argument's lifetime named.
    #[allow(clippy::needless_lifetimes)]
    fn respond<'a>(
        &self,
        hello: &Hello,
        from: SocketAddr,
        peer: Option<&'a str>,
    ) -> Result<Hello, Reject>;

    /// The authentication this server requires (`None`: none; every peer is served as before).
    fn auth(&self) -> Option<Arc<crate::auth::ServerAuth>> {
        None
    }

    /// Where this server's data streams count what they accept and refuse (`None`: nothing is
    /// counted).
    fn serve_stats(&self) -> Option<Arc<crate::stream::ServeStats>> {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lease_checks_access_then_bounds() {
        let lease = SegmentLease {
            region: Arc::new(MemoryRegion::from_vec(vec![0; 100])),
            base: 10,
            len: 50,
            access: Access::REMOTE_READ,
            guard: None,
        };
        assert_eq!(lease.check(OpKind::Read, 0, 50), Ok(10));
        assert_eq!(
            lease.check(OpKind::Read, 1, 50),
            Err(RemoteStatus::OutOfBounds)
        );
        assert_eq!(
            lease.check(OpKind::Write, 0, 1),
            Err(RemoteStatus::AccessDenied)
        );
        assert_eq!(
            lease.check(OpKind::Read, u64::MAX, 2),
            Err(RemoteStatus::OutOfBounds)
        );
    }

    #[test]
    fn mocks_are_object_safe() {
        let mut t = MockTransport::new();
        t.expect_kind().return_const(TransportKind::Tcp);
        let t: Arc<dyn Transport> = Arc::new(t);
        assert_eq!(t.kind(), TransportKind::Tcp);
        let mut table = MockSegmentTable::new();
        table.expect_resolve().returning(|_| None);
        assert!(table.resolve(SegmentToken(1)).is_none());
    }
}
