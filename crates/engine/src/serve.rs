//! The serving side's adapters: the registry as a [`SegmentTable`], and the handshake policy.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, PoisonError, RwLock};

use ferry_core::wire::{Hello, Reject, RejectReason, VersionRange};
use ferry_core::{
    Epoch, HandshakeResponder, PeerId, PeerInfo, RemoteKey, SegmentDesc, SegmentLease,
    SegmentTable, SegmentToken, Transport, TransportKind,
};
use ferry_registry::{Lease, Registry};

/// A segment served by positioned I/O: a file, or (with the `cuda` feature) device memory
/// served by device copies.
#[derive(Debug)]
struct ServedSource {
    name: String,
    len: u64,
    access: ferry_core::Access,
    source: Arc<dyn ferry_core::FileSource>,
}

/// Published segments as the transports' servers see them.
///
/// Guards are kept per token (one `Arc` made at registration), so that resolving a chunk allocates
/// nothing; the registry stays the authority on what is published. Published file segments live
/// beside them (served by io_uring, or by positioned reads on the TCP server), and are listed in
/// the handshake like memory (no remote keys).
#[derive(Debug)]
pub(crate) struct RegistryTable {
    pub(crate) registry: Registry,
    guards: RwLock<HashMap<SegmentToken, Arc<Lease>>>,
    files: RwLock<HashMap<SegmentToken, ServedSource>>,
    /// Segments published to named peers only (absent: to every peer), by token.
    audience: RwLock<HashMap<SegmentToken, Arc<[String]>>>,
    /// What was still reachable of each segment at the moment its restriction ended (see
    /// [`retire`](Self::retire)), for the tests of that order.
    #[cfg(test)]
    pub(crate) ended: std::sync::Mutex<Vec<Ended>>,
    /// Held while a name is checked and published, so that two registrations of one name
    /// cannot both pass the check.
    naming: Mutex<()>,
}

/// What of a retired segment was still reachable just after its restriction to named peers was
/// lifted: each must be `false`.
#[cfg(test)]
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Ended {
    /// The registry still knew the token.
    pub(crate) registered: bool,
    /// The token still resolved to memory.
    pub(crate) resolves: bool,
    /// The token still resolved to a file or device-copy source.
    pub(crate) file: bool,
    /// A listing for an anonymous peer named it.
    pub(crate) listed: bool,
}

/// Why a registration under a name already published is refused (inside
/// [`Error::Register`](ferry_core::Error::Register), which names the segment).
#[derive(Debug, thiserror::Error)]
#[error(
    "this engine already publishes a segment of that name (names are unique per engine: drop the \
     other registration first, or pick another name)"
)]
pub(crate) struct NameTaken;

impl RegistryTable {
    pub(crate) fn new(registry: Registry) -> Self {
        Self {
            registry,
            guards: RwLock::new(HashMap::new()),
            files: RwLock::new(HashMap::new()),
            audience: RwLock::new(HashMap::new()),
            #[cfg(test)]
            ended: std::sync::Mutex::new(Vec::new()),
            naming: Mutex::new(()),
        }
    }

    /// Ends the publication of the segment under `token`, in the one order that keeps a
    /// segment published to named peers from ever resolving or being listed for anyone else:
    /// `unpublish` first (it retires or drops the segment's registry entry, if it has one), then
    /// the served entries (lease guard, file or device-copy source), and its restriction last.
    /// Returns what `unpublish` returned.
    pub(crate) fn retire<T>(&self, token: SegmentToken, unpublish: impl FnOnce() -> T) -> T {
        let out = unpublish();
        self.guards
            .write()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(&token);
        self.files
            .write()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(&token);
        self.unrestrict(token);
        out
    }

    /// Runs `publish` (which publishes a segment named `name` to peers when `published`), after
    /// checking that no published segment has that name: the name a peer asks for must mean one
    /// segment. Local-only registrations (`published` false) are not checked.
    pub(crate) fn publish_named<T>(
        &self,
        name: &str,
        published: bool,
        publish: impl FnOnce() -> Result<T, ferry_core::Error>,
    ) -> Result<T, ferry_core::Error> {
        if !published {
            return publish();
        }
        let _naming = self.naming.lock().unwrap_or_else(PoisonError::into_inner);
        if self.published().iter().any(|d| d.name == name) {
            return Err(ferry_core::Error::Register {
                name: name.to_owned(),
                source: Box::new(NameTaken),
            });
        }
        publish()
    }

    /// Runs `publish` (which registers a segment and returns its token) and restricts that
    /// segment to the key names `peers`, with no listing in between: listings hold the same
    /// lock ([`published_to`](SegmentTable::published_to)), so none sees the segment
    /// unrestricted.
    pub(crate) fn publish_restricted<T>(
        &self,
        peers: Arc<[String]>,
        publish: impl FnOnce() -> Result<(SegmentToken, T), ferry_core::Error>,
    ) -> Result<T, ferry_core::Error> {
        let mut audience = self
            .audience
            .write()
            .unwrap_or_else(PoisonError::into_inner);
        let (token, out) = publish()?;
        audience.insert(token, peers);
        Ok(out)
    }

    fn unrestrict(&self, token: SegmentToken) {
        self.audience
            .write()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(&token);
        #[cfg(test)]
        {
            let seen = Ended {
                registered: self.registry.lookup(token).is_some(),
                resolves: self.resolve(token).is_some(),
                file: self.file(token).is_some(),
                listed: self.published_to(None).iter().any(|d| d.token == token),
            };
            self.ended
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .push(seen);
        }
    }

    /// Publishes a segment served by positioned I/O (a file, or device memory) under `token`.
    pub(crate) fn add_file(
        &self,
        token: SegmentToken,
        name: String,
        len: u64,
        access: ferry_core::Access,
        source: Arc<dyn ferry_core::FileSource>,
    ) {
        self.files
            .write()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(
                token,
                ServedSource {
                    name,
                    len,
                    access,
                    source,
                },
            );
    }

    /// Descriptors of the published file segments (GPU segments registered with RDMA NICs,
    /// which the registry lists with their remote keys, are left to it).
    pub(crate) fn file_descs(&self) -> Vec<SegmentDesc> {
        let files = self.files.read().unwrap_or_else(PoisonError::into_inner);
        let mut v: Vec<SegmentDesc> = files
            .iter()
            .filter(|(token, _)| self.registry.lookup(**token).is_none())
            .map(|(token, f)| SegmentDesc {
                name: f.name.clone(),
                token: *token,
                len: f.len,
                access: f.access,
                remote_keys: Vec::new(),
            })
            .collect();
        v.sort_by(|a, b| a.name.cmp(&b.name));
        v
    }

    pub(crate) fn add(&self, lease: Lease) {
        self.guards
            .write()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(lease.token(), Arc::new(lease));
    }
}

pub(crate) fn describe_lease(lease: &Lease) -> SegmentDesc {
    SegmentDesc {
        name: lease.name().to_owned(),
        token: lease.token(),
        len: lease.len(),
        access: lease.access(),
        remote_keys: lease
            .remote_keys()
            .map(|(ctx, rkey)| RemoteKey {
                context: ctx.0,
                addr: lease.region().as_ptr() as u64,
                rkey,
            })
            .collect(),
    }
}

impl SegmentTable for RegistryTable {
    fn resolve(&self, token: SegmentToken) -> Option<SegmentLease> {
        // Device memory has no host bytes for a server to touch: its token resolves to the
        // device-copy source in `file` instead.
        let lease = self
            .registry
            .lookup(token)
            .filter(|l| l.region().is_host())?;
        let guard = self
            .guards
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .get(&token)
            .cloned();
        let region = lease.region().clone();
        let len = lease.len();
        let access = lease.access();
        let guard: Arc<dyn std::any::Any + Send + Sync> = match guard {
            Some(g) => g,
            None => Arc::new(lease),
        };
        Some(SegmentLease {
            region,
            base: 0,
            len,
            access,
            guard: Some(guard),
        })
    }

    fn published(&self) -> Vec<SegmentDesc> {
        let mut v: Vec<SegmentDesc> = self
            .registry
            .published()
            .iter()
            .map(describe_lease)
            .collect();
        v.extend(self.file_descs());
        v
    }

    fn file(&self, token: SegmentToken) -> Option<Arc<dyn ferry_core::FileSource>> {
        self.files
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .get(&token)
            .map(|f| f.source.clone())
    }

    fn visible_to(&self, token: SegmentToken, peer: Option<&str>) -> bool {
        let audience = self.audience.read().unwrap_or_else(PoisonError::into_inner);
        match audience.get(&token) {
            None => true,
            Some(names) => peer.is_some_and(|p| names.iter().any(|n| n == p)),
        }
    }

    fn published_to(&self, peer: Option<&str>) -> Vec<SegmentDesc> {
        // The lock first: a segment being published to named peers is listed only once its
        // restriction is in place (`publish_restricted`).
        let audience = self.audience.read().unwrap_or_else(PoisonError::into_inner);
        let mut all = self.published();
        if !audience.is_empty() {
            all.retain(|d| match audience.get(&d.token) {
                None => true,
                Some(names) => peer.is_some_and(|p| names.iter().any(|n| n == p)),
            });
        }
        all
    }
}

/// The engine's identity and handshake policy.
#[derive(Debug)]
pub(crate) struct Responder {
    pub(crate) id: PeerId,
    pub(crate) epoch: Epoch,
    pub(crate) versions: VersionRange,
    pub(crate) transports: Vec<Arc<dyn Transport>>,
    pub(crate) table: Arc<RegistryTable>,
    /// The keys peers must prove (`None`: every peer is served).
    pub(crate) auth: Option<Arc<ferry_core::auth::ServerAuth>>,
    /// Where served streams count what they accept and refuse.
    pub(crate) stats: Arc<ferry_core::transport::ServeStats>,
    /// Where peers' notifications wait for the application.
    pub(crate) inbox: Arc<crate::inbox::Inbox>,
    /// Data streams attached per key name, capped.
    pub(crate) stream_cap: Arc<ferry_core::stream_cap::StreamCap>,
}

impl HandshakeResponder for Responder {
    fn notify(
        &self,
        notify: &ferry_core::wire::Notify,
        from: SocketAddr,
        peer: Option<&str>,
    ) -> Result<(), Reject> {
        let n = crate::inbox::Notification {
            from: notify.peer_id,
            epoch: notify.epoch,
            name: notify.name.clone(),
            key_name: peer.map(str::to_owned),
            addr: from,
            message: notify.message.clone(),
        };
        self.inbox.push(n).map_err(|message| {
            tracing::warn!(%from, peer = %notify.peer_id, %message, "notification refused");
            Reject {
                reason: RejectReason::Refused,
                versions: self.versions,
                epoch: self.epoch,
                message,
            }
        })
    }

    fn peer_id(&self) -> PeerId {
        self.id
    }

    fn epoch(&self) -> Epoch {
        self.epoch
    }

    fn auth(&self) -> Option<Arc<ferry_core::auth::ServerAuth>> {
        self.auth.clone()
    }

    fn serve_stats(&self) -> Option<Arc<ferry_core::transport::ServeStats>> {
        Some(self.stats.clone())
    }

    fn stream_cap(&self) -> Option<Arc<ferry_core::stream_cap::StreamCap>> {
        Some(self.stream_cap.clone())
    }

    fn respond(
        &self,
        hello: &Hello,
        from: SocketAddr,
        peer: Option<&str>,
    ) -> Result<Hello, Reject> {
        let _span = tracing::debug_span!("handshake", %from, peer = %hello.peer_id).entered();
        if self.versions.common(hello.versions).is_none() {
            tracing::info!(%from, ours = %self.versions, theirs = %hello.versions, "protocol mismatch");
            return Err(Reject {
                reason: RejectReason::ProtocolMismatch,
                versions: self.versions,
                epoch: self.epoch,
                message: format!(
                    "no common protocol version: server speaks {}, client {}",
                    self.versions, hello.versions
                ),
            });
        }
        let segments = self.table.published_to(peer);
        let mut transports = Vec::new();
        for t in &self.transports {
            let Some(offer) = hello
                .transports
                .iter()
                .find(|o| TransportKind::of_offer(o) == Some(t.kind()))
            else {
                continue;
            };
            let info = PeerInfo {
                addr: from,
                local_id: self.id,
                local_epoch: self.epoch,
                remote_id: hello.peer_id,
                remote_epoch: hello.epoch,
                offer: offer.clone(),
                segments: hello.segments.clone(),
                session: None,
                key_name: peer.map(Into::into),
                version: self.versions.common(hello.versions).unwrap_or(1),
            };
            match t.accept(&info) {
                Ok(o) => transports.push(o),
                // A same-host offer from another host is no fault of anyone's.
                Err(e @ ferry_core::Error::NoRoute { .. }) => {
                    tracing::debug!(%from, transport = %t.kind(), error = %e, "not served");
                }
                Err(e) => tracing::warn!(%from, transport = %t.kind(), error = %e, "cannot serve"),
            }
        }
        Ok(Hello {
            versions: self.versions,
            peer_id: self.id,
            epoch: self.epoch,
            transports,
            segments,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferry_core::transport::MockTransport;
    use ferry_registry::{Budgets, Registry};

    /// A responder speaking only version 5, whose one transport must never be asked to accept
    /// (nor anything listed) for a peer it cannot talk to.
    fn responder() -> Responder {
        let mut never = MockTransport::new();
        never.expect_kind().return_const(TransportKind::Tcp);
        never.expect_accept().never();
        Responder {
            id: PeerId(9),
            epoch: Epoch(3),
            versions: VersionRange { min: 5, max: 5 },
            transports: vec![Arc::new(never)],
            table: Arc::new(RegistryTable::new(Registry::host(Budgets::default()))),
            auth: None,
            stats: Default::default(),
            inbox: Default::default(),
            stream_cap: ferry_core::stream_cap::StreamCap::new(1),
        }
    }

    /// A GPU segment registered with the NICs (a device region in the registry) is listed once,
    /// and servers never resolve its token to the device region: they get the device-copy
    /// source instead.
    #[cfg(feature = "cuda")]
    #[test]
    fn a_gpu_segment_is_served_by_copies_and_listed_once() {
        use ferry_core::Access;
        let Some(fake) = ferry_tests::fake_cuda(ferry_tests::FakeVariant::Full) else {
            return;
        };
        let cuda = ferry_cuda::Cuda::open(fake.path().as_os_str()).unwrap();
        let mem = Arc::new(cuda.device(0).unwrap().alloc(8192).unwrap());
        let region = Arc::new(mem.nic_region(ferry_cuda::GpuRoute::Peermem).unwrap());
        let table = RegistryTable::new(Registry::host(Budgets::default()));
        let rw = Access::REMOTE_READ | Access::REMOTE_WRITE;
        let reg = table.registry.register("g", region, rw).unwrap();
        let token = reg.token();
        table.add_file(
            token,
            "g".into(),
            8192,
            rw,
            Arc::new(ferry_cuda::DeviceSegment::new(mem.clone(), rw)),
        );
        assert!(
            table.resolve(token).is_none(),
            "device memory resolved for a server"
        );
        assert!(table.file(token).is_some());
        let listed = table.published();
        assert_eq!(listed.len(), 1, "{listed:?}");
        assert_eq!(listed[0].token, token);
        assert!(table.file_descs().is_empty());
        drop(reg);
        // Retired from the registry: the file entry alone is listed (the engine removes it too).
        assert_eq!(table.published().len(), 1);
    }

    /// A segment published to bob only, retired by dropping its registration or by `retire`:
    /// when its restriction ends, the registry has already forgotten it, it resolves to
    /// nothing and no listing names it, so there is no moment when it is open to everyone.
    #[test]
    fn a_restricted_segment_is_unpublished_before_its_restriction_ends() {
        use ferry_core::{Access, MemoryRegion};
        let table = Arc::new(RegistryTable::new(Registry::host(Budgets::default())));
        let rw = Access::REMOTE_READ | Access::REMOTE_WRITE;
        let publish = |name: &str| {
            let region = Arc::new(MemoryRegion::from_vec(vec![0; 4096]));
            table
                .publish_restricted(Arc::from(["bob".to_owned()]), || {
                    let reg = table.registry.register(name, region.clone(), rw).unwrap();
                    table.add(reg.lease());
                    let token = reg.token();
                    Ok((
                        token,
                        crate::Registration {
                            inner: Some(reg),
                            table: table.clone(),
                            region,
                            token,
                        },
                    ))
                })
                .unwrap()
        };
        let dropped = publish("dropped");
        let retired = publish("retired");
        for reg in [&dropped, &retired] {
            assert!(!table.visible_to(reg.token, Some("alice")));
            assert!(table.visible_to(reg.token, Some("bob")));
            assert!(table.resolve(reg.token).is_some());
        }
        drop(dropped);
        retired.retire().unwrap();
        // Three ends: the drop, the retire, and the drop of the retired handle (a no-op).
        let ended = table.ended.lock().unwrap().clone();
        assert_eq!(ended, [Ended::default(); 3]);
    }

    fn hello(min: u16, max: u16) -> Hello {
        Hello {
            versions: VersionRange { min, max },
            peer_id: PeerId(1),
            epoch: Epoch(2),
            transports: vec![ferry_core::TransportOffer::Tcp {
                streams: 1,
                port: 0,
            }],
            segments: vec![],
        }
    }

    /// The server checks versions itself, on both sides of its range: a raw hello from a peer
    /// that is too new or too old (or sends an empty range) is refused with both ranges, before
    /// any transport is asked to accept it or any segment is listed. The client's own check
    /// would hide a one-sided server check; this test talks to the server alone.
    #[test]
    fn the_server_refuses_versions_on_both_sides_of_its_range() {
        let r = responder();
        let from: SocketAddr = "127.0.0.1:9".parse().unwrap();
        for (min, max) in [(6, 9), (1, 4), (0, 0), (6, 4), (5, 4)] {
            let e = r.respond(&hello(min, max), from, None).unwrap_err();
            assert_eq!(e.reason, RejectReason::ProtocolMismatch, "{min}..={max}");
            assert_eq!(e.versions, VersionRange { min: 5, max: 5 });
            assert_eq!(e.epoch, Epoch(3));
        }
    }
}
