//! A connected peer incarnation: what it publishes, its segments as op targets, its counters,
//! and the requests it answers directly (a checksum, a close).

use std::fmt;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use ferry_core::checksum::CHECKSUM_LEN;
use ferry_core::{
    Access, Epoch, Error, FailureKind, MemoryRegion, OpKind, PeerId, RemoteStatus, SegmentDesc,
    TransportKind,
};

use crate::handles::RemoteSegment;
use crate::reconnect::PeerInner;

/// A connected peer incarnation and what it publishes.
#[derive(Clone)]
pub struct Peer {
    pub(crate) inner: Arc<PeerInner>,
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
