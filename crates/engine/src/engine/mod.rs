//! The engine: registering memory and files, connecting to peers, submitting requests, and
//! describing itself. It is built by [`EngineBuilder`](crate::EngineBuilder).

use std::collections::HashMap;
use std::fmt;
use std::net::{SocketAddr, ToSocketAddrs};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ferry_core::SegmentToken;
use ferry_core::wire::VersionRange;
use ferry_core::{Access, Epoch, Error, MemoryRegion, PeerId, Transport, TransportKind};
use ferry_file::FileSegment;
use ferry_registry::Registry;
#[cfg(feature = "rdma")]
use ferry_transport_rdma::RdmaTransport;
#[cfg(feature = "uring")]
use ferry_transport_uring::UringTransport;

mod connect;
#[cfg(feature = "cuda")]
mod gpu_memory;

use crate::describe::{BroadcastDescription, Description, RailDescription, SegmentDescription};
use crate::handles::FileRegistration;
use crate::handles::Registration;
use crate::listener::Server;
use crate::reconnect::PeerInner;
use crate::reconnect::ReconnectPolicy;
use crate::request::{Batch, Checked, RequestHandle};
use crate::route::Routes;
use crate::serve::RegistryTable;

/// What an engine holds, shared by its clones: one part per subsystem, wired here.
pub(crate) struct Inner {
    pub(crate) identity: Identity,
    pub(crate) published: Published,
    pub(crate) planes: DataPlanes,
    pub(crate) peers: Peers,
    pub(crate) serving: Serving,
    /// What the broadcasts on this engine last reported of themselves.
    pub(crate) broadcasts: crate::progress::Board,
    /// GPU memory: the driver, the staging pool, its counters.
    #[cfg(feature = "cuda")]
    pub(crate) gpu: Option<Arc<crate::gpu::GpuState>>,
}

/// Who the engine is to its peers.
pub(crate) struct Identity {
    pub(crate) id: PeerId,
    pub(crate) epoch: Epoch,
    pub(crate) versions: VersionRange,
    /// The keys this engine proves (client: the first) and accepts (server), if authenticated.
    pub(crate) keyring: Option<ferry_core::auth::Keyring>,
    /// The key this engine proves its server identity with (to clients that name it).
    pub(crate) signing: ferry_core::identity::IdentityKey,
}

/// What the engine registers and publishes.
pub(crate) struct Published {
    pub(crate) registry: Registry,
    pub(crate) table: Arc<RegistryTable>,
    /// The registration cache in front of the RDMA backend (none on host memory alone, where
    /// registering makes no native copy to share).
    pub(crate) shared_copies: Option<Arc<ferry_registry::SharedCopies>>,
}

/// The data planes the engine moves bytes over.
pub(crate) struct DataPlanes {
    /// Every transport offered, in order of preference.
    pub(crate) transports: Vec<Arc<dyn Transport>>,
    /// The portable data plane and why it was chosen.
    pub(crate) data_plane: Option<(TransportKind, String)>,
    #[cfg(feature = "rdma")]
    pub(crate) rdma: Option<RdmaTransport>,
    /// The io_uring data plane, when it was chosen (its rings and counters).
    #[cfg(feature = "uring")]
    pub(crate) uring: Option<UringTransport>,
    /// The same-host plane, when it is on.
    pub(crate) local: Option<ferry_transport_local::LocalTransport>,
}

/// Connecting to peers and running requests on them.
pub(crate) struct Peers {
    /// The epoch each address had when we first met it: a different one is refused (StaleEpoch).
    pub(crate) known: Mutex<HashMap<SocketAddr, (PeerId, Epoch)>>,
    /// The server identity each address must prove, as the application named it
    /// ([`TransferEngine::connect_expecting`]): every later handshake with it checks it.
    pub(crate) expected: Mutex<HashMap<SocketAddr, ferry_core::identity::ServerIdentity>>,
    pub(crate) routes: Routes,
    pub(crate) request_timeout: Option<Duration>,
    pub(crate) connect_timeout: Duration,
    /// What happens when a peer's connection is lost.
    pub(crate) reconnect: ReconnectPolicy,
}

/// Serving peers and scrapes.
pub(crate) struct Serving {
    pub(crate) server: Option<Server>,
    /// The same-host plane's server, beside the listener.
    pub(crate) local: Option<Arc<ferry_transport_local::LocalServerHandle>>,
    /// Notifications from peers, until the application takes them.
    pub(crate) inbox: Arc<crate::inbox::Inbox>,
    /// What the listener's data streams accepted and refused.
    pub(crate) stats: Arc<ferry_core::transport::ServeStats>,
    /// The HTTP listener serving metrics, if asked for.
    pub(crate) metrics: Option<crate::metrics::MetricsServer>,
}

impl fmt::Debug for Inner {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TransferEngine")
            .field("id", &self.identity.id)
            .field("epoch", &self.identity.epoch)
            .field(
                "listen",
                &self.serving.server.as_ref().map(|s| s.local_addr()),
            )
            .finish_non_exhaustive()
    }
}

/// The engine is what its peers reconnect through.
impl crate::reconnect::Reopen for Inner {
    fn reopen<'a>(
        self: Arc<Self>,
        peer: &'a PeerInner,
    ) -> ferry_core::BoxFuture<'a, Result<Arc<dyn ferry_core::Channel>, Error>> {
        Box::pin(async move { TransferEngine { inner: self }.reopen(peer).await })
    }

    fn heal<'a>(
        self: Arc<Self>,
        peer: &'a PeerInner,
    ) -> ferry_core::BoxFuture<'a, Result<usize, Error>> {
        Box::pin(async move { TransferEngine { inner: self }.heal(peer).await })
    }
}

/// Ferry's transfer engine: registers memory, connects to peers and moves bytes between them.
#[derive(Clone, Debug)]
pub struct TransferEngine {
    pub(crate) inner: Arc<Inner>,
}

impl TransferEngine {
    /// This engine's peer id.
    pub fn peer_id(&self) -> PeerId {
        self.inner.identity.id
    }

    /// This engine's epoch.
    pub fn epoch(&self) -> Epoch {
        self.inner.identity.epoch
    }

    /// The names of the keys this engine accepts (its keyring's, in file order; the first is
    /// the one it proves); empty when it runs without keys. Layers that file peers' messages
    /// by name use it to tell which names have a key of their own.
    pub fn key_names(&self) -> Vec<String> {
        self.inner
            .identity
            .keyring
            .as_ref()
            .map(|k| k.names().map(str::to_owned).collect())
            .unwrap_or_default()
    }

    /// The address it serves on, if it listens.
    pub fn local_addr(&self) -> Option<SocketAddr> {
        self.inner.serving.server.as_ref().map(|s| s.local_addr())
    }

    /// The address its Prometheus metrics are served on (`GET /metrics`), if they are (see
    /// [`EngineBuilder::metrics`](crate::EngineBuilder::metrics)).
    pub fn metrics_addr(&self) -> Option<SocketAddr> {
        self.inner.serving.metrics.as_ref().map(|m| m.local_addr())
    }

    /// The Prometheus text (version 0.0.4) a scrape of [`metrics_addr`](Self::metrics_addr)
    /// answers now: [`describe`](Self::describe) encoded as the series of
    /// [`crate::metrics`].
    pub fn metrics_text(&self) -> String {
        crate::metrics::render(&self.describe())
    }

    /// Registers `region` under `name` with `access` for peers: admitted against the budgets,
    /// prepared on every context, then published.
    pub fn register(
        &self,
        region: impl Into<Arc<MemoryRegion>>,
        access: Access,
        name: &str,
    ) -> Result<Registration, Error> {
        self.register_inner(region.into(), access, name)
    }

    /// Registers `region` like [`register`](Self::register), published only to the
    /// authenticated peers whose key is named in `peers` (names of this engine's keyring): other
    /// peers, authenticated or not, never see it listed and their ops on its token are refused
    /// as on an unknown token. Refused with `InvalidRequest` on an engine without keys (no
    /// peer could prove a name) or with an empty `peers`.
    pub fn register_to(
        &self,
        region: impl Into<Arc<MemoryRegion>>,
        access: Access,
        name: &str,
        peers: &[&str],
    ) -> Result<Registration, Error> {
        let audience = self.audience(peers)?;
        let region = region.into();
        self.inner.published.table.publish_restricted(audience, || {
            let reg = self.register_inner(region, access, name)?;
            Ok((reg.token, reg))
        })
    }

    pub(crate) fn audience(&self, peers: &[&str]) -> Result<Arc<[String]>, Error> {
        let Some(keyring) = &self.inner.identity.keyring else {
            return Err(Error::InvalidRequest {
                reason: "publishing to named peers needs authentication keys \
                         (EngineBuilder::auth_key_file)"
                    .into(),
            });
        };
        if peers.is_empty() {
            return Err(Error::InvalidRequest {
                reason: "publishing to named peers needs at least one name".into(),
            });
        }
        if let Some(unknown) = peers.iter().find(|p| keyring.get(p).is_none()) {
            tracing::warn!(peer = %unknown, "publishing to a key name this engine's keyring lacks: no peer can prove it");
        }
        Ok(peers.iter().map(|p| (*p).to_owned()).collect())
    }

    fn register_inner(
        &self,
        region: Arc<MemoryRegion>,
        access: Access,
        name: &str,
    ) -> Result<Registration, Error> {
        self.inner
            .published
            .table
            .publish_named(name, access.is_remote(), || {
                self.register_unchecked(region, access, name)
            })
    }

    fn register_unchecked(
        &self,
        region: Arc<MemoryRegion>,
        access: Access,
        name: &str,
    ) -> Result<Registration, Error> {
        let span = tracing::info_span!("register", name, len = region.len(), %access);
        let _enter = span.enter();
        let reg = self
            .inner
            .published
            .registry
            .register(name, region.clone(), access)
            .map_err(Error::from)?;
        let token = reg.token();
        if access.is_remote() {
            self.inner.published.table.add(reg.lease());
        }
        tracing::debug!(%token, "published");
        Ok(Registration {
            inner: Some(reg),
            table: self.inner.published.table.clone(),
            region,
            token,
        })
    }

    /// Publishes the whole of the file at `path` as a segment named after the path, with
    /// `access` for peers (see [`publish_file_named`](Self::publish_file_named)).
    pub fn publish_file(
        &self,
        path: impl AsRef<std::path::Path>,
        access: Access,
    ) -> Result<FileRegistration, Error> {
        let path = path.as_ref();
        self.publish_file_named(path, access, &path.display().to_string())
    }

    /// Publishes the whole of the file at `path` (its size now) as the segment `name`, served
    /// to peers by reads and, with `Access::REMOTE_WRITE`, writes that never extend the file. It
    /// gets a random token and is listed in the handshake from now on; dropping the handle
    /// unpublishes it.
    ///
    /// The io_uring data plane serves them with its rings (O_DIRECT where a request's alignment
    /// allows); the TCP data plane (where the kernel refuses io_uring, when it is forced, or in a
    /// build without the `uring` feature) with positioned reads and writes off its I/O threads.
    /// File segments take no registration budget: no memory is pinned for them.
    pub fn publish_file_named(
        &self,
        path: impl AsRef<std::path::Path>,
        access: Access,
        name: &str,
    ) -> Result<FileRegistration, Error> {
        self.publish_file_inner(path.as_ref(), access, name)
    }

    /// Publishes a file like [`publish_file_named`](Self::publish_file_named), only to the
    /// authenticated peers whose key is named in `peers` (see [`register_to`](Self::register_to)).
    pub fn publish_file_to(
        &self,
        path: impl AsRef<std::path::Path>,
        access: Access,
        name: &str,
        peers: &[&str],
    ) -> Result<FileRegistration, Error> {
        let audience = self.audience(peers)?;
        self.inner.published.table.publish_restricted(audience, || {
            let reg = self.publish_file_inner(path.as_ref(), access, name)?;
            Ok((reg.token, reg))
        })
    }

    fn publish_file_inner(
        &self,
        path: &std::path::Path,
        access: Access,
        name: &str,
    ) -> Result<FileRegistration, Error> {
        self.inner.published.table.publish_named(name, true, || {
            self.publish_file_unchecked(path, access, name)
        })
    }

    fn publish_file_unchecked(
        &self,
        path: &std::path::Path,
        access: Access,
        name: &str,
    ) -> Result<FileRegistration, Error> {
        let _span =
            tracing::info_span!("publish_file", name, path = %path.display(), %access).entered();
        if self.inner.planes.data_plane.is_none() {
            return Err(Error::Unavailable {
                library: "file segments".into(),
                reason: format!(
                    "publishing {} needs a portable data plane (io_uring or TCP) to serve it, and \
                     this engine has none",
                    path.display()
                ),
            });
        }
        let file = Arc::new(FileSegment::open(path, access)?);
        let token = SegmentToken::random();
        self.inner.published.table.add_file(
            token,
            name.to_owned(),
            file.len(),
            file.access(),
            file.clone(),
        );
        tracing::info!(%token, len = file.len(), "file segment published");
        Ok(FileRegistration {
            table: self.inner.published.table.clone(),
            file,
            token,
            name: name.to_owned(),
        })
    }

    /// Loads `len` bytes of the file at `path` from `file_offset` into `dst` at `offset`, with
    /// io_uring reads of up to 1 MiB, at most 32 in flight (O_DIRECT for aligned chunks), or
    /// with positioned reads through a bounce buffer where this engine's data plane is not
    /// io_uring (the kernel refused it, TCP was forced, or the build lacks the `uring` feature).
    /// Blocking: call it from a blocking context. Returns the bytes read.
    pub fn read_file_into(
        &self,
        dst: &Registration,
        offset: u64,
        path: impl AsRef<std::path::Path>,
        file_offset: u64,
        len: u64,
    ) -> Result<u64, Error> {
        let path = path.as_ref();
        let _span = tracing::info_span!("read_file_into", path = %path.display(), file_offset, len)
            .entered();
        #[cfg(feature = "uring")]
        if self.data_plane() == Some(TransportKind::Uring) {
            const QUEUE_DEPTH: usize = 32;
            return Ok(ferry_transport_uring::read_file_into(
                dst.region(),
                offset,
                path,
                file_offset,
                len,
                QUEUE_DEPTH,
            )?);
        }
        Ok(ferry_file::read_file_into(
            dst.region(),
            offset,
            path,
            file_offset,
            len,
        )?)
    }

    /// The portable data plane (`Tcp` or `Uring`) this engine chose, if one is enabled.
    pub fn data_plane(&self) -> Option<TransportKind> {
        self.inner.planes.data_plane.as_ref().map(|(k, _)| *k)
    }

    /// Submits a batch: every op is checked against its local region and the peer's descriptor
    /// before anything moves (an error here means nothing moved), then the request runs in the
    /// background. Must be called inside a tokio runtime.
    ///
    /// Ops on GPU memory (a `GpuRegistration`) are staged through the engine's pool of pinned
    /// host buffers (see [`crate::gpu`]); with `staging: never` such a batch is refused here.
    pub fn submit(&self, batch: Batch) -> Result<RequestHandle, Error> {
        let (peer, checked) = batch.checked()?;
        if let Err(e) = tokio::runtime::Handle::try_current() {
            return Err(Error::Unavailable {
                library: "tokio runtime".into(),
                reason: format!("TransferEngine::submit needs one: {e}"),
            });
        }
        let timeout = batch.timeout.or(self.inner.peers.request_timeout);
        match checked {
            Checked::Host(ops) => Ok(RequestHandle::start(&peer, ops, timeout)),
            #[cfg(feature = "cuda")]
            Checked::Staged(ops) => {
                let gpu = self.inner.gpu.as_ref();
                #[cfg(feature = "rdma")]
                let rdma = self
                    .inner
                    .planes
                    .rdma
                    .is_some()
                    .then_some(&self.inner.published.registry);
                #[cfg(not(feature = "rdma"))]
                let rdma = None;
                let pool = crate::gpu::prepare(gpu.map(|g| &**g), rdma, &ops)?;
                let gpu = gpu
                    .expect("prepare refuses an engine without GPU support")
                    .clone();
                let ops: Arc<[crate::request::StagedOp]> = ops.into();
                let on_peer = peer.clone();
                let host: crate::gpu::HostRunner = Arc::new(move |ops, control, deadline| {
                    Box::pin(crate::reconnect::run(
                        on_peer.clone(),
                        ops,
                        control,
                        deadline,
                    ))
                });
                let shape = crate::counters::Shape::of(
                    ops.iter().map(|o| (o.kind, o.len)),
                    crate::describe::Path::Staged,
                );
                let control = Arc::new(ferry_core::RequestControl::with_shape(
                    ops.iter().map(|o| (o.kind, o.len)),
                ));
                let fut = crate::gpu::run(host, ops, control.clone(), pool, gpu, timeout);
                Ok(RequestHandle::start_with(
                    &peer,
                    control,
                    Box::pin(fut),
                    timeout,
                    shape,
                ))
            }
        }
    }

    /// Identity, listener, registrations and per-route counters.
    pub fn describe(&self) -> Description {
        let counters = self.inner.published.registry.counters();
        let published = self
            .inner
            .published
            .registry
            .published()
            .iter()
            .map(|l| SegmentDescription {
                name: l.name().to_owned(),
                token: l.token().to_string(),
                len: l.len(),
                access: l.access().to_string(),
                shared: l
                    .region()
                    .shared()
                    .map(|m| crate::describe::shared_state(&m.state())),
            })
            .chain(
                self.inner
                    .published
                    .table
                    .file_descs()
                    .into_iter()
                    .map(|d| SegmentDescription {
                        name: d.name,
                        token: d.token.to_string(),
                        len: d.len,
                        access: d.access.to_string(),
                        shared: None,
                    }),
            )
            .collect();
        let routes = self.inner.peers.routes.snapshot();
        Description {
            peer_id: self.inner.identity.id.to_string(),
            epoch: self.inner.identity.epoch.to_string(),
            server_identity: self.inner.identity.signing.public().to_string(),
            listen: self.local_addr().map(|a| a.to_string()),
            transports: self
                .inner
                .planes
                .transports
                .iter()
                .map(|t| t.kind().name().to_owned())
                .collect(),
            data_plane: self
                .inner
                .planes
                .data_plane
                .as_ref()
                .map(|(k, why)| format!("{k} ({why})")),
            same_host: self.same_host_line(),
            #[cfg(feature = "uring")]
            data_plane_io: self.inner.planes.uring.as_ref().map(|t| {
                let mut line = t.describe();
                if let Some(Server::Uring(h)) = &self.inner.serving.server {
                    use std::sync::atomic::Ordering::Relaxed;
                    let s = h.stats();
                    line.push_str(&format!(
                        "; listener on {} rings: threads {}, held responses {}",
                        h.rings(),
                        s.threads.load(Relaxed),
                        s.held_responses.load(Relaxed),
                    ));
                }
                line
            }),
            #[cfg(not(feature = "uring"))]
            data_plane_io: None,
            handshakes: self.inner.serving.server.as_ref().map(|s| {
                let (stats, limits) = s.handshakes();
                crate::describe::HandshakeDescription {
                    pending: stats.pending,
                    refused: stats.refused,
                    timed_out: stats.timed_out,
                    evicted: stats.evicted,
                    max_pending: limits.max_pending as u64,
                    timeout_ms: u64::try_from(limits.timeout.as_millis()).unwrap_or(u64::MAX),
                }
            }),
            served: self.inner.serving.server.as_ref().map(|_| {
                crate::describe::ServedDescription::of(&self.inner.serving.stats.snapshot())
            }),
            contexts: counters
                .per_context
                .iter()
                .map(|c| crate::describe::ContextDescription {
                    name: c.name.clone(),
                    copies: c.copies,
                    bytes: c.bytes,
                    fenced: c.fenced,
                })
                .collect(),
            latency: self.inner.peers.routes.latencies().snapshot(),
            registration_cache: self.inner.published.shared_copies.as_ref().map(|c| {
                let s = c.stats();
                crate::describe::CacheDescription {
                    hits: s.hits,
                    misses: s.misses,
                    entries: s.entries,
                }
            }),
            metrics: self.metrics_addr().map(|a| a.to_string()),
            registrations: counters.registrations,
            registered_bytes: counters.view_bytes,
            budget_bytes: counters.bytes,
            unquiesced: counters.unquiesced,
            fenced_contexts: counters
                .per_context
                .iter()
                .filter(|c| c.fenced)
                .map(|c| c.name.clone())
                .collect(),
            published,
            routes,
            rails: self.rails(),
            broadcasts: self.inner.broadcasts.snapshot(),
            agents: crate::agent_telemetry::snapshot(),
            #[cfg(feature = "cuda")]
            gpu_registrations: self.inner.gpu.as_ref().map_or_else(Vec::new, |g| {
                g.registrations
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .iter()
                    .map(|(_, d)| d.clone())
                    .collect()
            }),
            #[cfg(feature = "cuda")]
            staging: self.inner.gpu.as_ref().map(|g| g.describe()),
        }
    }

    /// Records what a broadcast on this engine (`ferry-broadcast`'s source or receiver) reports
    /// of its progress, in place of its last report (same role, name and version): `describe()`
    /// lists it and the metrics serve it (`ferry_broadcast_*`). At most
    /// [`MAX_BROADCASTS`](crate::MAX_BROADCASTS) are kept; a finished one goes first.
    pub fn report_broadcast(&self, report: BroadcastDescription) {
        self.inner.broadcasts.report(report);
    }

    /// Per-rail RDMA counters (empty without RDMA).
    fn rails(&self) -> Vec<RailDescription> {
        #[cfg(feature = "rdma")]
        if let Some(t) = &self.inner.planes.rdma {
            return t
                .rail_stats()
                .into_iter()
                .map(|s| RailDescription {
                    rail: s.rail,
                    bytes: s.bytes,
                    work_requests: s.work_requests,
                    errors: s.errors,
                    flushed: s.flushed,
                    unproven: s.unproven,
                    replayed: s.replayed,
                    replayed_bytes: s.replayed_bytes,
                    torn_down: s.torn_down,
                    rebuilds: s.rebuilds,
                    down: s.down,
                })
                .collect();
        }
        Vec::new()
    }

    /// Surfaces native cleanup that failed earlier, where `Drop` could only record it: the
    /// registry's deferred errors (a registration whose native destroy failed on drop is
    /// `Unquiesced`, its copies and charges still held) and the RDMA transport's failed destroys
    /// of queue pairs, completion queues and protection domains. Returns the oldest one.
    pub fn check(&self) -> Result<(), Error> {
        self.inner.published.registry.check().map_err(Error::from)?;
        #[cfg(feature = "rdma")]
        if let Some(rdma) = &self.inner.planes.rdma {
            rdma.check()?;
        }
        Ok(())
    }

    /// Retries the native destroy of every registration left `Unquiesced` by a failed one (see
    /// [`check`](Self::check)), once the cause is dealt with: destroyed copies release their
    /// budget charges, fully destroyed registrations free their memory, and a context with
    /// nothing unquiesced left accepts registrations again. Returns what was released and the
    /// evidence for what is still held.
    pub fn retry_unquiesced(&self) -> ferry_registry::UnquiescedRetry {
        self.inner.published.registry.retry_unquiesced()
    }

    /// The same-host plane in one line (see [`Description::same_host`](crate::Description::same_host)).
    fn same_host_line(&self) -> String {
        let Some(_) = &self.inner.planes.local else {
            return format!(
                "off (EngineBuilder::same_host(false), {}=off, or no portable data plane)",
                crate::config::SAME_HOST_ENV
            );
        };
        let probe = ferry_transport_local::probe();
        match &self.inner.serving.local {
            Some(s) if s.is_serving() => format!(
                "{}; serving on @{} ({} streams now)",
                probe.summary(),
                s.name(),
                s.streams()
            ),
            _ => format!("{}; client only (no listener)", probe.summary()),
        }
    }

    /// Stops serving: the listener closes and accepted connections are dropped.
    pub fn shutdown(&self) {
        if let Some(s) = &self.inner.serving.server {
            s.shutdown();
        }
        if let Some(s) = &self.inner.serving.local {
            s.shutdown();
        }
    }
}

fn resolve(addr: impl ToSocketAddrs) -> Result<SocketAddr, Error> {
    addr.to_socket_addrs()
        .map_err(|e| {
            // The standard library's word for "127.0.0.1" (a host without its port).
            if e.kind() == std::io::ErrorKind::InvalidInput
                && e.to_string() == "invalid socket address"
            {
                Error::InvalidRequest {
                    reason: "the peer address is not HOST:PORT: is its port missing? (a Ferry \
                             engine listens where its listen_addr says, e.g. 127.0.0.1:7300)"
                        .into(),
                }
            } else {
                Error::io("resolve", "peer address", e)
            }
        })?
        .next()
        .ok_or_else(|| Error::InvalidRequest {
            reason: "the peer address resolves to nothing".into(),
        })
}
