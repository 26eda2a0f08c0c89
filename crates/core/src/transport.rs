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
use std::sync::atomic::{AtomicU64, Ordering};

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
    /// The same-host plane: process-to-process copies on one host.
    Local,
}

impl TransportKind {
    /// The name users type (`tcp`, `uring`, `rdma`, `local`).
    pub fn name(self) -> &'static str {
        match self {
            TransportKind::Tcp => "tcp",
            TransportKind::Uring => "uring",
            TransportKind::Rdma => "rdma",
            TransportKind::Local => "local",
        }
    }

    /// The kind of a handshake offer, if this build knows it.
    pub fn of_offer(offer: &TransportOffer) -> Option<Self> {
        match offer {
            TransportOffer::Tcp { .. } => Some(TransportKind::Tcp),
            TransportOffer::Uring { .. } => Some(TransportKind::Uring),
            TransportOffer::Rdma { .. } => Some(TransportKind::Rdma),
            TransportOffer::Local { .. } => Some(TransportKind::Local),
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

    /// Rails of this channel that failed and can be rebuilt now (RDMA: the local port is ACTIVE
    /// again) get fresh endpoints, returned as the offer for a new handshake with the same peer
    /// incarnation; the peer's answer goes to [`heal`](Self::heal). `None` when nothing is to
    /// heal, and always for transports without rails. Each call replaces the endpoints the last
    /// one made (those are torn down).
    fn heal_offer(&self) -> Option<TransportOffer> {
        None
    }

    /// Completes a heal: `answer` is the peer's handshake answer to the offer of
    /// [`heal_offer`](Self::heal_offer). The peer must be the incarnation this channel was
    /// opened to, else `StaleEpoch` (and the fresh endpoints are torn down, never used). Returns
    /// how many rails rejoin the channel; they carry work again, requests already running
    /// included.
    fn heal(&self, answer: PeerInfo) -> Result<usize, Error> {
        Err(Error::InvalidRequest {
            reason: format!(
                "a {} channel has no rails to heal ({})",
                self.kind(),
                answer.addr
            ),
        })
    }

    /// Whether an op's local region may be device memory granted by CUDA IPC
    /// ([`DeviceNative::CudaIpc`](crate::DeviceNative::CudaIpc)): the same-host plane's channels
    /// that attached with CUDA IPC. Every other channel is given host memory (or, over RDMA,
    /// GPUDirect regions) only.
    fn takes_cuda_ipc(&self) -> bool {
        false
    }

    /// How this channel moves GPU buffers, where its plane has a choice (the same-host plane:
    /// `cuda-ipc`, or `host stage (<why>)`); `None` elsewhere.
    fn gpu_route(&self) -> Option<String> {
        None
    }

    /// What this channel moves one-sidedly, where its plane can (the same-host plane's shared
    /// registrations: what it mapped and the ops it moved so); `None` elsewhere.
    fn one_sided(&self) -> Option<String> {
        None
    }
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
    fn serve_stats(&self) -> Option<Arc<ServeStats>> {
        None
    }

    /// The cap on data streams attached at once per key name, shared by every listener this
    /// responder answers for (`None`, the default: no cap).
    fn stream_cap(&self) -> Option<Arc<crate::stream_cap::StreamCap>> {
        None
    }

    /// Takes a notification from `from` (authenticated as `peer`, if at all) into this
    /// server's inbox, or refuses it (the default: this server takes none).
    #[allow(clippy::needless_lifetimes)]
    fn notify<'a>(
        &self,
        notify: &crate::wire::Notify,
        from: SocketAddr,
        peer: Option<&'a str>,
    ) -> Result<(), Reject> {
        let _ = (notify, from, peer);
        Err(Reject {
            reason: crate::wire::RejectReason::Refused,
            versions: crate::wire::SUPPORTED_VERSIONS,
            epoch: self.epoch(),
            message: "this server takes no notifications".into(),
        })
    }
}

// ---------------------------------------------------------------------------------------------
// Checks of an op before it reaches a transport.

impl Op {
    /// Checks the local side of the op.
    pub fn check_local(&self) -> Result<(), Error> {
        self.local
            .check(self.local_offset, self.kind.local_len(self.len))
            .map_err(|source| Error::OutOfBounds {
                side: "local",
                source,
            })
    }
}

impl SegmentDesc {
    /// Checks an op of `kind` on `offset..offset+len` against this descriptor.
    pub fn check(&self, kind: OpKind, offset: u64, len: u64) -> Result<(), Error> {
        crate::memory::check_range(offset, len, self.len).map_err(|source| Error::OutOfBounds {
            side: "remote",
            source,
        })?;
        let needed = kind.needed_access();
        if !self.access.contains(needed) {
            return Err(Error::AccessDenied {
                token: self.token,
                needed,
                granted: self.access,
            });
        }
        Ok(())
    }
}

// ---------------------------------------------------------------------------------------------
// What a server counts.

/// What the data streams of one server accepted and refused, counted as
/// [`ServerStream`](crate::stream::ServerStream) decides, before any byte moves: an accepted READ
/// or WRITE whose stream dies midway still counts its whole length. A CHECKSUM counts the bytes it
/// hashes; a vectored request counts each accepted piece as an op. Shared by the streams of a
/// server ([`HandshakeResponder::serve_stats`]); relaxed atomics, read by
/// [`snapshot`](Self::snapshot).
#[derive(Debug, Default)]
pub struct ServeStats {
    ops: [AtomicU64; 3],
    bytes: [AtomicU64; 3],
    refused: [AtomicU64; 5],
    tables: AtomicU64,
}

/// A snapshot of [`ServeStats`].
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct ServeCounts {
    /// Ops accepted and their bytes, by kind (READ, WRITE, CHECKSUM, in that order).
    pub accepted: [(OpKind, u64, u64); 3],
    /// Requests (or vectored pieces) refused, by status, in the order of
    /// [`ServeStats::STATUSES`].
    pub refused: [(RemoteStatus, u64); 5],
    /// Vectored requests whose piece table arrived (accepted or refused, piece by piece).
    pub tables: u64,
}

impl ServeStats {
    /// The op kinds counted, in the order of [`ServeCounts::accepted`].
    pub const KINDS: [OpKind; 3] = [OpKind::Read, OpKind::Write, OpKind::Checksum];
    /// The refusals counted, in the order of [`ServeCounts::refused`].
    pub const STATUSES: [RemoteStatus; 5] = [
        RemoteStatus::UnknownSegment,
        RemoteStatus::OutOfBounds,
        RemoteStatus::AccessDenied,
        RemoteStatus::StaleEpoch,
        RemoteStatus::Malformed,
    ];

    fn kind_index(kind: OpKind) -> usize {
        match kind {
            OpKind::Read => 0,
            OpKind::Write => 1,
            OpKind::Checksum => 2,
        }
    }

    /// Counts `ops` accepted ops of `kind` moving `bytes`.
    pub fn accepted(&self, kind: OpKind, ops: u64, bytes: u64) {
        let i = Self::kind_index(kind);
        self.ops[i].fetch_add(ops, Ordering::Relaxed);
        self.bytes[i].fetch_add(bytes, Ordering::Relaxed);
    }

    /// Counts one vectored request's piece table.
    pub fn table(&self) {
        self.tables.fetch_add(1, Ordering::Relaxed);
    }

    /// Counts one refusal.
    pub fn refused(&self, status: RemoteStatus) {
        let i = match status {
            RemoteStatus::UnknownSegment => 0,
            RemoteStatus::OutOfBounds => 1,
            RemoteStatus::AccessDenied => 2,
            RemoteStatus::StaleEpoch => 3,
            RemoteStatus::Malformed => 4,
        };
        self.refused[i].fetch_add(1, Ordering::Relaxed);
    }

    /// The counts now.
    pub fn snapshot(&self) -> ServeCounts {
        ServeCounts {
            accepted: Self::KINDS.map(|k| {
                let i = Self::kind_index(k);
                (
                    k,
                    self.ops[i].load(Ordering::Relaxed),
                    self.bytes[i].load(Ordering::Relaxed),
                )
            }),
            refused: std::array::from_fn(|i| {
                (Self::STATUSES[i], self.refused[i].load(Ordering::Relaxed))
            }),
            tables: self.tables.load(Ordering::Relaxed),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// What one peer may see.

/// A table as one authenticated peer sees it: segments published to other peers are unknown
/// (indistinguishable from retired ones), for data ops and listings alike.
#[derive(Debug)]
pub struct PeerView {
    table: Arc<dyn SegmentTable>,
    peer: Arc<str>,
}

impl PeerView {
    /// `table` as `peer` sees it.
    pub fn new(table: Arc<dyn SegmentTable>, peer: Arc<str>) -> Self {
        Self { table, peer }
    }
}

impl SegmentTable for PeerView {
    fn resolve(&self, token: SegmentToken) -> Option<SegmentLease> {
        if !self.table.visible_to(token, Some(&self.peer)) {
            return None;
        }
        self.table.resolve(token)
    }

    fn published(&self) -> Vec<SegmentDesc> {
        self.table.published_to(Some(&self.peer))
    }

    fn file(&self, token: SegmentToken) -> Option<Arc<dyn FileSource>> {
        if !self.table.visible_to(token, Some(&self.peer)) {
            return None;
        }
        self.table.file(token)
    }

    fn visible_to(&self, token: SegmentToken, peer: Option<&str>) -> bool {
        peer == Some(&*self.peer) && self.table.visible_to(token, peer)
    }

    fn published_to(&self, peer: Option<&str>) -> Vec<SegmentDesc> {
        if peer == Some(&*self.peer) {
            self.table.published_to(peer)
        } else {
            Vec::new()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A table of two file segments: `PUBLIC` published to everyone, `BOBS` to bob only.
    #[derive(Debug)]
    struct TwoSegments;

    const PUBLIC: SegmentToken = SegmentToken(1);
    const BOBS: SegmentToken = SegmentToken(2);

    #[derive(Debug)]
    struct NoBytes;

    impl FileSource for NoBytes {
        fn check(
            &self,
            _kind: crate::OpKind,
            offset: u64,
            _len: u64,
        ) -> Result<u64, crate::RemoteStatus> {
            Ok(offset)
        }
        fn read_exact_at(&self, _at: u64, _buf: &mut [u8]) -> std::io::Result<()> {
            Ok(())
        }
        fn write_all_at(&self, _at: u64, _buf: &[u8]) -> std::io::Result<()> {
            Ok(())
        }
    }

    fn desc(name: &str, token: SegmentToken) -> SegmentDesc {
        SegmentDesc {
            name: name.into(),
            token,
            len: 1,
            access: crate::Access::REMOTE_READ,
            remote_keys: Vec::new(),
        }
    }

    impl SegmentTable for TwoSegments {
        fn resolve(&self, _token: SegmentToken) -> Option<SegmentLease> {
            None
        }
        fn published(&self) -> Vec<SegmentDesc> {
            vec![desc("public", PUBLIC), desc("bobs", BOBS)]
        }
        fn file(&self, token: SegmentToken) -> Option<Arc<dyn FileSource>> {
            (token == PUBLIC || token == BOBS).then(|| Arc::new(NoBytes) as Arc<dyn FileSource>)
        }
        fn visible_to(&self, token: SegmentToken, peer: Option<&str>) -> bool {
            token == PUBLIC || (token == BOBS && peer == Some("bob"))
        }
        fn published_to(&self, peer: Option<&str>) -> Vec<SegmentDesc> {
            self.published()
                .into_iter()
                .filter(|d| self.visible_to(d.token, peer))
                .collect()
        }
    }

    fn names(ds: Vec<SegmentDesc>) -> Vec<String> {
        ds.into_iter().map(|d| d.name).collect()
    }

    #[test]
    fn a_peers_view_shows_it_only_what_is_published_to_it_and_speaks_for_no_one_else() {
        let table: Arc<dyn SegmentTable> = Arc::new(TwoSegments);
        let alice = PeerView::new(table.clone(), "alice".into());
        let bob = PeerView::new(table, "bob".into());
        // Files: reachable through the view only where published to its peer.
        assert!(alice.file(PUBLIC).is_some());
        assert!(alice.file(BOBS).is_none());
        assert!(bob.file(BOBS).is_some());
        // Listings.
        assert_eq!(names(alice.published()), ["public"]);
        assert_eq!(names(bob.published()), ["public", "bobs"]);
        assert_eq!(names(alice.published_to(Some("alice"))), ["public"]);
        // A view answers for its own peer alone: never for another name, nor for no name.
        assert!(alice.published_to(Some("bob")).is_empty());
        assert!(alice.published_to(None).is_empty());
        assert!(alice.visible_to(PUBLIC, Some("alice")));
        assert!(!alice.visible_to(BOBS, Some("alice")));
        assert!(!alice.visible_to(BOBS, Some("bob")));
        assert!(!alice.visible_to(PUBLIC, None));
        assert!(bob.visible_to(BOBS, Some("bob")));
    }

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

    fn op(kind: OpKind, local: usize, local_offset: u64, len: u64) -> Op {
        Op {
            kind,
            local: Arc::new(MemoryRegion::from_vec(vec![0; local])),
            local_offset,
            token: PUBLIC,
            remote_offset: 0,
            len,
        }
    }

    /// The local side of an op must lie in its region; a checksum needs room for its digest
    /// only, however long the remote range it hashes.
    #[test]
    fn an_op_is_checked_against_its_local_memory() {
        assert!(op(OpKind::Read, 100, 80, 20).check_local().is_ok());
        let err = op(OpKind::Read, 100, 81, 20).check_local().unwrap_err();
        assert!(
            matches!(
                err,
                Error::OutOfBounds {
                    side: "local",
                    source: crate::OutOfBounds {
                        offset: 81,
                        len: 20,
                        size: 100
                    }
                }
            ),
            "{err:?}"
        );
        assert!(op(OpKind::Write, 100, u64::MAX, 2).check_local().is_err());
        assert!(op(OpKind::Checksum, 8, 4, 1 << 30).check_local().is_ok());
        assert!(op(OpKind::Checksum, 8, 5, 1).check_local().is_err());
    }

    /// An op is checked against the remote descriptor's bounds, then its access.
    #[test]
    fn a_remote_descriptor_checks_bounds_then_access() {
        let d = SegmentDesc {
            len: 100,
            ..desc("public", PUBLIC)
        };
        assert!(d.check(OpKind::Read, 0, 100).is_ok());
        assert!(d.check(OpKind::Checksum, 40, 60).is_ok());
        assert!(matches!(
            d.check(OpKind::Read, 1, 100),
            Err(Error::OutOfBounds { side: "remote", .. })
        ));
        assert!(matches!(
            d.check(OpKind::Read, u64::MAX, 2),
            Err(Error::OutOfBounds { side: "remote", .. })
        ));
        assert!(matches!(
            d.check(OpKind::Write, 0, 1),
            Err(Error::AccessDenied {
                needed: Access::REMOTE_WRITE,
                ..
            })
        ));
        // Bounds first: an out-of-bounds WRITE to a read-only segment says out of bounds.
        assert!(matches!(
            d.check(OpKind::Write, 99, 2),
            Err(Error::OutOfBounds { .. })
        ));
    }

    /// Each kind has the name users type, shown as such, and is known from its offer; an offer
    /// this build does not know has no kind.
    #[test]
    fn transport_kinds_name_themselves_and_are_known_by_their_offers() {
        let kinds = [
            (
                TransportKind::Tcp,
                "tcp",
                TransportOffer::Tcp {
                    streams: 1,
                    port: 0,
                },
            ),
            (
                TransportKind::Uring,
                "uring",
                TransportOffer::Uring {
                    streams: 1,
                    port: 0,
                    zero_copy: false,
                },
            ),
            (
                TransportKind::Rdma,
                "rdma",
                TransportOffer::Rdma { rails: Vec::new() },
            ),
        ];
        for (kind, name, offer) in kinds {
            assert_eq!(kind.name(), name);
            assert_eq!(kind.to_string(), name);
            assert_eq!(TransportKind::of_offer(&offer), Some(kind));
        }
        let unknown = TransportOffer::Unknown {
            code: 99,
            body: Vec::new(),
        };
        assert_eq!(TransportKind::of_offer(&unknown), None);
    }

    /// A table that keeps the defaults publishes everything to everyone.
    #[test]
    fn a_table_without_restrictions_publishes_to_everyone() {
        #[derive(Debug)]
        struct Open;
        impl SegmentTable for Open {
            fn resolve(&self, _token: SegmentToken) -> Option<SegmentLease> {
                None
            }
            fn published(&self) -> Vec<SegmentDesc> {
                vec![desc("public", PUBLIC)]
            }
        }
        assert!(Open.visible_to(PUBLIC, None));
        assert!(Open.visible_to(PUBLIC, Some("anyone")));
        assert_eq!(names(Open.published_to(None)), ["public"]);
        assert!(Open.file(PUBLIC).is_none());
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
