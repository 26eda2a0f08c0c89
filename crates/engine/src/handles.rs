//! The handles the engine gives out: registrations of memory and files, connected peers and
//! their segments. Each is owned by the caller; dropping a registration unpublishes it.

use std::fmt;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError, Weak};

use ferry_core::checksum::CHECKSUM_LEN;
use ferry_core::{
    Access, Channel, Epoch, Error, FailureKind, MemoryRegion, OpKind, PeerId, RemoteStatus,
    SegmentDesc, SegmentToken, TransportKind,
};
use ferry_file::FileSegment;

use crate::describe::RouteCounters;
use crate::engine::Inner;
use crate::reconnect::{Link, ReconnectPolicy, Recovery};
use crate::serve::RegistryTable;

/// A registered range, owned by the caller. Dropping it (or [`retire`](Self::retire)) unpublishes
/// it at once; its memory stays alive while requests still use it.
pub struct Registration {
    pub(crate) inner: Option<registry::Registration>,
    pub(crate) table: Arc<RegistryTable>,
    pub(crate) region: Arc<MemoryRegion>,
    pub(crate) token: SegmentToken,
}

impl fmt::Debug for Registration {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Registration")
            .field("token", &self.token)
            .field("inner", &self.inner)
            .finish()
    }
}

impl Registration {
    /// The token peers address it by.
    pub fn token(&self) -> SegmentToken {
        self.token
    }

    /// The registered memory.
    pub fn region(&self) -> &Arc<MemoryRegion> {
        &self.region
    }

    /// Its length in bytes.
    pub fn len(&self) -> u64 {
        self.region.len() as u64
    }

    /// Whether it is empty.
    pub fn is_empty(&self) -> bool {
        self.region.is_empty()
    }

    /// Unpublishes the range (peers' requests are refused as for an unknown token from now on)
    /// and releases it once no request uses it.
    pub fn retire(mut self) -> Result<(), Error> {
        let _span = tracing::info_span!("retire", token = %self.token).entered();
        let inner = self.inner.take();
        self.table.retire(self.token, || match inner {
            Some(r) => r.retire().map(|_| ()).map_err(Error::from),
            None => Ok(()),
        })
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        let inner = self.inner.take();
        self.table.retire(self.token, || drop(inner));
    }
}

/// A published file segment (served by either portable data plane), owned by the caller.
/// Dropping it (or [`retire`](Self::retire)) unpublishes it: later requests naming its token are
/// refused as unknown; reads already running finish on the open file.
pub struct FileRegistration {
    pub(crate) table: Arc<RegistryTable>,
    pub(crate) file: Arc<FileSegment>,
    pub(crate) token: SegmentToken,
    pub(crate) name: String,
}

impl fmt::Debug for FileRegistration {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FileRegistration")
            .field("name", &self.name)
            .field("token", &self.token)
            .field("file", &self.file)
            .finish()
    }
}

impl FileRegistration {
    /// The token peers address it by.
    pub fn token(&self) -> SegmentToken {
        self.token
    }

    /// The name it is published under.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The file range served.
    pub fn file(&self) -> &Arc<FileSegment> {
        &self.file
    }

    /// Its length in bytes.
    pub fn len(&self) -> u64 {
        self.file.len()
    }

    /// Whether it is empty.
    pub fn is_empty(&self) -> bool {
        self.file.is_empty()
    }

    /// The descriptor peers see in the handshake (no remote keys: files go over the wire).
    pub fn desc(&self) -> SegmentDesc {
        SegmentDesc {
            name: self.name.clone(),
            token: self.token,
            len: self.file.len(),
            access: self.file.access(),
            remote_keys: Vec::new(),
        }
    }

    /// Unpublishes the file segment.
    pub fn retire(self) {
        drop(self);
    }
}

impl Drop for FileRegistration {
    fn drop(&mut self) {
        self.table.retire(self.token, || ());
    }
}

/// A connected peer incarnation and what it publishes.
#[derive(Clone)]
pub struct Peer {
    pub(crate) inner: Arc<PeerInner>,
}

/// One connected peer incarnation, shared by its [`Peer`] handles and its segments.
pub(crate) struct PeerInner {
    pub(crate) addr: SocketAddr,
    pub(crate) id: PeerId,
    pub(crate) epoch: Epoch,
    pub(crate) segments: Vec<SegmentDesc>,
    /// The protocol version both ends speak (the newest in both ranges).
    pub(crate) version: u16,
    /// The channel its requests take now (replaced at a reconnect).
    pub(crate) link: Mutex<Link>,
    /// The reconnect in flight, one at a time.
    pub(crate) recovery: tokio::sync::Mutex<Recovery>,
    /// The engine, to reconnect through (a peer does not keep its engine alive).
    pub(crate) engine: Weak<Inner>,
    pub(crate) policy: ReconnectPolicy,
    /// [`Peer::close`] was called: no reconnect.
    pub(crate) closed: AtomicBool,
    pub(crate) counters: Arc<RouteCounters>,
}

impl PeerInner {
    /// The generation of the current channel, and the channel.
    pub(crate) fn link(&self) -> (u64, Arc<dyn Channel>) {
        let link = self.link.lock().unwrap_or_else(PoisonError::into_inner);
        (link.generation, link.channel.clone())
    }

    /// The current channel.
    pub(crate) fn channel(&self) -> Arc<dyn Channel> {
        self.link().1
    }

    /// A peer over `channel` with `segments` and no engine behind it (so no reconnect), for
    /// unit tests.
    #[cfg(test)]
    pub(crate) fn for_test(
        channel: Arc<dyn Channel>,
        segments: Vec<SegmentDesc>,
        counters: Arc<RouteCounters>,
    ) -> Self {
        Self {
            addr: SocketAddr::from(([127, 0, 0, 1], 9)),
            id: PeerId(1),
            epoch: Epoch(1),
            segments,
            version: 2,
            link: Mutex::new(crate::reconnect::Link {
                generation: 0,
                channel,
            }),
            recovery: Default::default(),
            engine: std::sync::Weak::new(),
            policy: crate::ReconnectPolicy::default(),
            closed: Default::default(),
            counters,
        }
    }
}

impl fmt::Debug for Peer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Peer")
            .field("addr", &self.inner.addr)
            .field("id", &self.inner.id)
            .field("epoch", &self.inner.epoch)
            .field("transport", &self.inner.channel().kind())
            .field("segments", &self.inner.segments.len())
            .finish()
    }
}

impl Peer {
    /// Its control address.
    pub fn addr(&self) -> SocketAddr {
        self.inner.addr
    }

    /// Its peer id.
    pub fn id(&self) -> PeerId {
        self.inner.id
    }

    /// The epoch of this incarnation.
    pub fn epoch(&self) -> Epoch {
        self.inner.epoch
    }

    /// The transport its requests take.
    pub fn transport(&self) -> TransportKind {
        self.inner.channel().kind()
    }

    /// Whether its data channel can still carry requests now. A channel whose every stream died
    /// (the peer reset them, or went silent past `dead_peer_after`) is reopened by the next
    /// request that needs it, as long as the same incarnation answers (see
    /// [`ReconnectPolicy`](crate::ReconnectPolicy)); with reconnects off (`attempts` 0) each
    /// new request fails at once with `PeerLost`, and
    /// [`TransferEngine::connect`](crate::TransferEngine::connect) to the same address opens a
    /// fresh one.
    pub fn is_alive(&self) -> bool {
        self.inner.channel().is_alive()
    }

    /// Descriptors of the segments it published at connection time.
    pub fn segments(&self) -> &[SegmentDesc] {
        &self.inner.segments
    }

    /// The segment published under `name`.
    pub fn segment(&self, name: &str) -> Result<RemoteSegment, Error> {
        self.inner
            .segments
            .iter()
            .find(|s| s.name == name)
            .map(|desc| RemoteSegment {
                peer: self.inner.clone(),
                desc: desc.clone(),
            })
            .ok_or_else(|| Error::UnknownSegmentName {
                peer: self.inner.addr.to_string(),
                name: name.to_owned(),
            })
    }

    /// A segment of this peer from a descriptor obtained out of band (a metadata service). The
    /// peer checks the token, bounds and access of every op itself.
    pub fn segment_from_descriptor(&self, desc: SegmentDesc) -> RemoteSegment {
        RemoteSegment {
            peer: self.inner.clone(),
            desc,
        }
    }

    /// Closes the data path: in-flight chunks fail as lost, later requests fail at once, and
    /// nothing is reconnected or replayed.
    pub fn close(&self) {
        self.inner.closed.store(true, Ordering::Release);
        self.inner.channel().close();
    }

    /// The protocol version spoken with this peer (the newest both ends speak).
    pub fn protocol_version(&self) -> u16 {
        self.inner.version
    }

    /// Asks the peer for the CRC-32C ([`checksum`](crate::checksum)) of `len` bytes of
    /// `segment` (one of this peer's) from `offset`, computed by the peer over its bytes as they
    /// are when the request reaches it (memory or file segments alike), with the READ access
    /// right. Compare it with [`checksum::crc32c`](crate::checksum::crc32c) of the local copy to
    /// verify a transfer. One data-plane request, never split, whatever `len`.
    ///
    /// Needs protocol version 2 ([`CHECKSUM_VERSION`](ferry_core::wire::CHECKSUM_VERSION)) on
    /// both ends and the TCP or io_uring data plane: an older peer or an RDMA channel is
    /// `Unavailable`, and nothing is sent. Must be called inside a tokio runtime.
    pub async fn checksum(
        &self,
        segment: &RemoteSegment,
        offset: u64,
        len: u64,
    ) -> Result<u32, Error> {
        let peer = self.inner.addr.to_string();
        if !Arc::ptr_eq(&segment.peer, &self.inner) {
            return Err(Error::InvalidRequest {
                reason: format!("segment {:?} belongs to another peer", segment.desc.name),
            });
        }
        if self.inner.version < ferry_core::wire::CHECKSUM_VERSION {
            return Err(Error::Unavailable {
                library: "checksum request".into(),
                reason: format!(
                    "peer {peer} speaks protocol version {}, checksums need {}",
                    self.inner.version,
                    ferry_core::wire::CHECKSUM_VERSION
                ),
            });
        }
        if self.inner.channel().kind() == TransportKind::Rdma {
            return Err(Error::Unavailable {
                library: "checksum request".into(),
                reason: format!(
                    "peer {peer} is reached over RDMA, which cannot ask it to hash; connect \
                     over the TCP or io_uring data plane"
                ),
            });
        }
        segment.desc.check(OpKind::Checksum, offset, len)?;
        let local = Arc::new(MemoryRegion::from_vec(vec![0; CHECKSUM_LEN]));
        let op = ferry_core::Op {
            kind: OpKind::Checksum,
            local: local.clone(),
            local_offset: 0,
            token: segment.desc.token,
            remote_offset: offset,
            len,
        };
        if let Err(e) = tokio::runtime::Handle::try_current() {
            return Err(Error::Unavailable {
                library: "tokio runtime".into(),
                reason: format!("Peer::checksum needs one: {e}"),
            });
        }
        let outcome = crate::request::RequestHandle::start(&self.inner, vec![op], None).await;
        match outcome.failure {
            None => {
                let mut digest = [0u8; CHECKSUM_LEN];
                local
                    .read_at(0, &mut digest)
                    .map_err(|source| Error::OutOfBounds {
                        side: "local",
                        source,
                    })?;
                Ok(u32::from_le_bytes(digest))
            }
            Some(f) => Err(match f.kind {
                FailureKind::Remote(RemoteStatus::UnknownSegment) => Error::UnknownSegment {
                    peer,
                    token: segment.desc.token,
                },
                FailureKind::Remote(RemoteStatus::AccessDenied) => Error::AccessDenied {
                    token: segment.desc.token,
                    needed: Access::REMOTE_READ,
                    granted: segment.desc.access,
                },
                FailureKind::Cancelled => Error::Cancelled,
                _ => Error::PeerLost {
                    peer,
                    during: "a checksum request",
                    source: f.native_status.map(std::io::Error::from_raw_os_error),
                },
            }),
        }
    }
}

/// A segment published by a peer, as an op target.
#[derive(Clone)]
pub struct RemoteSegment {
    pub(crate) peer: Arc<PeerInner>,
    pub(crate) desc: SegmentDesc,
}

impl fmt::Debug for RemoteSegment {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RemoteSegment")
            .field("peer", &self.peer.addr)
            .field("desc", &self.desc)
            .finish()
    }
}

impl RemoteSegment {
    /// Its descriptor.
    pub fn desc(&self) -> &SegmentDesc {
        &self.desc
    }

    /// Its name.
    pub fn name(&self) -> &str {
        &self.desc.name
    }

    /// Its length.
    pub fn len(&self) -> u64 {
        self.desc.len
    }

    /// Whether it is empty.
    pub fn is_empty(&self) -> bool {
        self.desc.len == 0
    }

    /// What we may do to it.
    pub fn access(&self) -> Access {
        self.desc.access
    }
}
