//! The engine: builder, registrations, peers and submission.

use std::collections::HashMap;
use std::fmt;
use std::net::{SocketAddr, ToSocketAddrs};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use ferry_core::wire::{Hello, SUPPORTED_VERSIONS, VersionRange};
use ferry_core::{
    Access, Channel, Epoch, Error, MemoryRegion, Op, PeerId, PeerInfo, RequestControl, SegmentDesc,
    SegmentTable, SegmentToken, Transport, TransportKind,
};
use registry::{Budgets, Registry, RegistryError};
use tokio::sync::{Notify, watch};
use tracing::Instrument;
#[cfg(feature = "rdma")]
use transport_rdma::{RdmaConfig, RdmaTransport};
use transport_tcp::{ServerHandle, TcpConfig, TcpServer, TcpTransport};
#[cfg(feature = "uring")]
use transport_uring::{
    FileSegment, Preference, UringConfig, UringProbe, UringServer, UringServerHandle,
    UringTransport,
};

use crate::describe::{Description, RailDescription, RouteCounters, SegmentDescription};
use crate::request::{Batch, RequestHandle};
use crate::serve::{RegistryTable, Responder};

/// Which transport carries the portable data plane (the one every host has, beside RDMA).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum DataPlane {
    /// io_uring where the kernel supports the opcodes it needs (probed at build), TCP otherwise;
    /// the reason is reported in [`Description::data_plane`](crate::Description::data_plane).
    /// The builder's default.
    #[default]
    Auto,
    /// io_uring, or an error naming what the kernel lacks.
    Uring,
    /// The tokio TCP transport.
    Tcp,
}

impl DataPlane {
    /// Parses `auto`, `uring` or `tcp`.
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "auto" => Some(Self::Auto),
            "uring" | "io_uring" => Some(Self::Uring),
            "tcp" => Some(Self::Tcp),
            _ => None,
        }
    }
}

/// The portable data plane chosen at build, and why.
fn choose_data_plane(
    pref: DataPlane,
    #[cfg(feature = "uring")] probe: Option<&UringProbe>,
) -> Result<(TransportKind, String), Error> {
    #[cfg(feature = "uring")]
    {
        let pref = match pref {
            DataPlane::Auto => Preference::Auto,
            DataPlane::Uring => Preference::Uring,
            DataPlane::Tcp => Preference::Tcp,
        };
        let probed;
        let probe = match probe {
            Some(p) => p,
            None if pref == Preference::Tcp => {
                return Ok((TransportKind::Tcp, "tcp forced by configuration".into()));
            }
            None => {
                probed = transport_uring::probe_kernel();
                &probed
            }
        };
        let s = transport_uring::select(probe, pref).map_err(|e| Error::Unavailable {
            library: "io_uring".into(),
            reason: format!("io_uring was forced but cannot be used: {e}"),
        })?;
        Ok((s.kind, s.reason))
    }
    #[cfg(not(feature = "uring"))]
    match pref {
        DataPlane::Uring => Err(Error::Unavailable {
            library: "io_uring".into(),
            reason: "io_uring was forced but this build lacks the `uring` feature".into(),
        }),
        DataPlane::Tcp => Ok((TransportKind::Tcp, "tcp forced by configuration".into())),
        DataPlane::Auto => Ok((
            TransportKind::Tcp,
            "fell back to tcp: this build lacks the `uring` feature".into(),
        )),
    }
}

/// Builds a [`TransferEngine`]. Nothing native is loaded by building.
#[derive(Debug, Clone)]
pub struct EngineBuilder {
    listen: Option<SocketAddr>,
    kinds: Vec<TransportKind>,
    data_plane: DataPlane,
    #[cfg(feature = "uring")]
    uring_probe: Option<UringProbe>,
    extra: Vec<Arc<dyn Transport>>,
    tcp: TcpConfig,
    budgets: Budgets,
    request_timeout: Option<Duration>,
    connect_timeout: Duration,
    versions: VersionRange,
    #[cfg(feature = "rdma")]
    rdma: Option<RdmaConfig>,
    #[cfg(feature = "uring")]
    uring_max_threads: usize,
}

impl Default for EngineBuilder {
    fn default() -> Self {
        Self {
            listen: None,
            kinds: vec![TransportKind::Tcp],
            data_plane: DataPlane::default(),
            #[cfg(feature = "uring")]
            uring_probe: None,
            extra: Vec::new(),
            tcp: TcpConfig::default(),
            budgets: Budgets::default(),
            request_timeout: None,
            connect_timeout: Duration::from_secs(10),
            versions: SUPPORTED_VERSIONS,
            #[cfg(feature = "rdma")]
            rdma: None,
            #[cfg(feature = "uring")]
            uring_max_threads: transport_uring::MAX_THREADS,
        }
    }
}

impl EngineBuilder {
    /// Serves published segments on `addr` (port 0: any free port). Without it the engine only
    /// connects out.
    pub fn listen(mut self, addr: SocketAddr) -> Self {
        self.listen = Some(addr);
        self
    }

    /// The built-in transports to use, in order of preference (default: TCP). `Tcp` stands for
    /// the portable data plane chosen by [`data_plane`](Self::data_plane); `Uring` forces io_uring
    /// for it.
    pub fn transports(mut self, kinds: &[TransportKind]) -> Self {
        self.kinds = kinds.to_vec();
        if kinds.contains(&TransportKind::Uring) {
            self.data_plane = DataPlane::Uring;
        }
        self
    }

    /// Which transport carries the portable data plane (default [`DataPlane::Auto`]), where the
    /// [`transports`](Self::transports) include one (the default does; an RDMA-only list has
    /// none, and this is then ignored). With [`DataPlane::Uring`] and a listener, the io_uring
    /// server serves (it also answers TCP clients: the wire is the same), and file segments can
    /// be published.
    pub fn data_plane(mut self, pref: DataPlane) -> Self {
        self.data_plane = pref;
        self
    }

    /// Uses `probe` instead of probing the kernel when choosing the data plane (tests force a
    /// kernel without some opcode this way).
    #[cfg(feature = "uring")]
    pub fn uring_probe(mut self, probe: UringProbe) -> Self {
        self.uring_probe = Some(probe);
        self
    }

    #[cfg(feature = "uring")]
    fn uring_config(&self) -> UringConfig {
        UringConfig {
            streams: self.tcp.streams,
            chunk_size: self.tcp.chunk_size,
            depth: self.tcp.depth,
            socket_buffer: self.tcp.socket_buffer,
            connect_timeout: self.connect_timeout,
            dead_peer_after: self.tcp.dead_peer_after,
            max_threads: self.uring_max_threads,
            ..UringConfig::default()
        }
    }

    /// Threads the io_uring data plane runs at most on each side (default 256): it runs one
    /// per client stream and one per served data stream. Past it, new peers are opened over
    /// the TCP data plane (same wire, a fixed set of I/O threads; [`Peer::transport`] says
    /// `tcp`) and the listener serves new data streams on the TCP data plane's I/O threads.
    /// Counted in `describe().data_plane_io` ("peers past it over tcp").
    #[cfg(feature = "uring")]
    pub fn uring_max_threads(mut self, n: usize) -> Self {
        self.uring_max_threads = n;
        self
    }

    /// Adds a transport implemented outside this crate (preferred over the built-in ones).
    pub fn transport(mut self, transport: Arc<dyn Transport>) -> Self {
        self.extra.push(transport);
        self
    }

    /// Data streams per peer for TCP (default 1).
    pub fn streams(mut self, n: usize) -> Self {
        self.tcp.streams = n;
        self
    }

    /// Largest chunk an op is split into (default 1 MiB).
    pub fn chunk_size(mut self, bytes: u64) -> Self {
        self.tcp.chunk_size = bytes;
        self
    }

    /// Chunks in flight per stream (default 8).
    pub fn depth(mut self, n: usize) -> Self {
        self.tcp.depth = n;
        self
    }

    /// Socket buffer size (`None`: kernel autotuning).
    pub fn socket_buffer(mut self, bytes: Option<usize>) -> Self {
        self.tcp.socket_buffer = bytes;
        self
    }

    /// I/O threads of the TCP data plane, for the client side and for the server each:
    /// `Some(0)` (default) one per available core, `Some(n)` n, `None` none (streams run on the
    /// caller's tokio runtime: lower latency for small ops, less throughput for bulk; see
    /// `TcpConfig::io_threads`).
    pub fn io_threads(mut self, n: Option<usize>) -> Self {
        self.tcp.io_threads = n;
        self
    }

    /// Registration budgets.
    pub fn budgets(mut self, budgets: Budgets) -> Self {
        self.budgets = budgets;
        self
    }

    /// Default per-request timeout (none by default).
    pub fn request_timeout(mut self, timeout: Duration) -> Self {
        self.request_timeout = Some(timeout);
        self
    }

    /// Limit for connecting and the handshake (default 10 s).
    pub fn connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = timeout;
        self.tcp.connect_timeout = timeout;
        self
    }

    /// How long a TCP or io_uring data stream may go without its sent data acknowledged (or,
    /// idle, without answers to keepalive probes) before the peer is taken for dead: the
    /// stream closes, its chunks in flight are reported lost (an uncertain WRITE), and
    /// `drained` resolves once the kernel let go of the buffers. Default 30 s; `None` leaves it
    /// to the kernel (about 15 minutes of retransmissions, and a silent idle peer is never
    /// noticed). A peer whose application stops reading for that long counts as dead too (the
    /// kernel applies the limit to zero-window probes).
    pub fn dead_peer_after(mut self, after: Option<Duration>) -> Self {
        self.tcp.dead_peer_after = after;
        self
    }

    /// The protocol versions to speak (default: all this build supports). For interoperability
    /// tests; a peer with no common version is refused with `ProtocolMismatch`.
    pub fn protocol_versions(mut self, versions: VersionRange) -> Self {
        self.versions = versions;
        self
    }

    /// Enables the RDMA transport with `config`; it is preferred over the built-in TCP and
    /// io_uring transports when both ends offer it, and registrations then go through its
    /// contexts (one MR per rail for local ranges, two for remote ones). `TransportKind::Rdma`
    /// in [`transports`](Self::transports) enables it with `RdmaConfig::default()` (discovery).
    #[cfg(feature = "rdma")]
    pub fn rdma(mut self, config: RdmaConfig) -> Self {
        self.rdma = Some(config);
        if !self.kinds.contains(&TransportKind::Rdma) {
            self.kinds.push(TransportKind::Rdma);
        }
        self
    }

    /// Builds the engine. With [`listen`](Self::listen) it must run inside a tokio runtime (the
    /// listener is bound here, and served on that runtime).
    pub fn build(self) -> Result<TransferEngine, Error> {
        let mut transports: Vec<Arc<dyn Transport>> = self.extra.clone();
        #[cfg(feature = "rdma")]
        let mut rdma: Option<RdmaTransport> = None;
        let mut data_plane: Option<(TransportKind, String)> = None;
        #[cfg(feature = "uring")]
        let mut uring: Option<UringTransport> = None;
        for kind in &self.kinds {
            match kind {
                TransportKind::Tcp | TransportKind::Uring if data_plane.is_none() => {
                    let (chosen, reason) = choose_data_plane(
                        self.data_plane,
                        #[cfg(feature = "uring")]
                        self.uring_probe.as_ref(),
                    )?;
                    tracing::info!(transport = %chosen, %reason, "portable data plane");
                    #[cfg(feature = "uring")]
                    if chosen == TransportKind::Uring {
                        let probed;
                        let probe = match &self.uring_probe {
                            Some(p) => p,
                            None => {
                                probed = transport_uring::probe_kernel();
                                &probed
                            }
                        };
                        let t = UringTransport::with_probe(self.uring_config(), probe)?;
                        transports.push(Arc::new(t.clone()));
                        uring = Some(t);
                    }
                    // TCP is offered beside io_uring too: the wire is the same, so TCP-only
                    // peers still meet us (our io_uring channel takes their TCP offers).
                    transports.push(Arc::new(TcpTransport::new(self.tcp.clone())));
                    data_plane = Some((chosen, reason));
                }
                TransportKind::Tcp | TransportKind::Uring => {}
                #[cfg(feature = "rdma")]
                TransportKind::Rdma if rdma.is_none() => {
                    let config = self.rdma.clone().unwrap_or_default();
                    let t = RdmaTransport::open(config).map_err(|e| e.into_core())?;
                    // Preferred over every built-in transport: right after the added ones.
                    transports.insert(self.extra.len(), Arc::new(t.clone()));
                    rdma = Some(t);
                }
                other => {
                    if !transports.iter().any(|t| t.kind() == *other) {
                        return Err(Error::Unavailable {
                            library: format!("ferry {other} transport"),
                            reason: format!(
                                "the {other} transport is not built into this engine; \
                                 add it with EngineBuilder::transport"
                            ),
                        });
                    }
                }
            }
        }
        if transports.is_empty() {
            return Err(Error::InvalidRequest {
                reason: "no transport configured".into(),
            });
        }
        let id = PeerId::random();
        let epoch = Epoch::fresh();
        #[cfg(feature = "rdma")]
        let registry = match &rdma {
            Some(t) => Registry::new(Arc::new(t.backend()), self.budgets),
            None => Registry::host(self.budgets),
        };
        #[cfg(not(feature = "rdma"))]
        let registry = Registry::host(self.budgets);
        let table = Arc::new(RegistryTable::new(registry.clone()));
        let responder = Arc::new(Responder {
            id,
            epoch,
            versions: self.versions,
            transports: transports.clone(),
            table: table.clone(),
        });
        let server = match self.listen {
            None => None,
            #[cfg(feature = "uring")]
            Some(addr) if uring.is_some() => {
                let config = uring
                    .as_ref()
                    .map(|t| t.config().clone())
                    .unwrap_or_default();
                let overflow = Arc::new(TcpOverflow(transport_tcp::StreamServer::new(
                    table.clone(),
                    &self.tcp,
                )));
                let h = UringServer::bind(addr)?.with_overflow(overflow).serve(
                    table.clone(),
                    responder.clone(),
                    config,
                )?;
                Some(Server::Uring(h))
            }
            Some(addr) => {
                if let Err(e) = tokio::runtime::Handle::try_current() {
                    return Err(Error::Unavailable {
                        library: "tokio runtime".into(),
                        reason: format!("EngineBuilder::build with listen needs one: {e}"),
                    });
                }
                let server = TcpServer::bind(addr)?;
                let tcp_config = self.tcp.clone();
                Some(Server::Tcp(server.serve(
                    table.clone(),
                    responder.clone(),
                    tcp_config,
                )))
            }
        };
        tracing::info!(peer = %id, %epoch, listen = ?server.as_ref().map(|s| s.local_addr()), "engine built");
        Ok(TransferEngine {
            inner: Arc::new(Inner {
                id,
                epoch,
                versions: self.versions,
                transports,
                registry,
                table,
                server,
                data_plane,
                known: Mutex::new(HashMap::new()),
                routes: Mutex::new(Vec::new()),
                request_timeout: self.request_timeout,
                connect_timeout: self.connect_timeout,
                #[cfg(feature = "rdma")]
                rdma,
                #[cfg(feature = "uring")]
                uring,
            }),
        })
    }
}

type Route = (String, TransportKind, Arc<RouteCounters>);

/// The io_uring listener's streams past its thread budget, served on the TCP data plane's I/O
/// threads.
#[cfg(feature = "uring")]
#[derive(Debug)]
struct TcpOverflow(transport_tcp::StreamServer);

#[cfg(feature = "uring")]
impl transport_uring::StreamOverflow for TcpOverflow {
    fn serve(
        &self,
        stream: std::net::TcpStream,
        from: SocketAddr,
        done: Box<dyn FnOnce() + Send>,
    ) -> Result<(), Error> {
        self.0.serve(stream, from, done)
    }
}

/// The engine's listener: the TCP transport's server, or the io_uring one.
#[derive(Debug)]
enum Server {
    Tcp(ServerHandle),
    #[cfg(feature = "uring")]
    Uring(UringServerHandle),
}

impl Server {
    fn local_addr(&self) -> SocketAddr {
        match self {
            Server::Tcp(h) => h.local_addr(),
            #[cfg(feature = "uring")]
            Server::Uring(h) => h.local_addr(),
        }
    }

    fn shutdown(&self) {
        match self {
            Server::Tcp(h) => h.shutdown(),
            #[cfg(feature = "uring")]
            Server::Uring(h) => h.shutdown(),
        }
    }
}

struct Inner {
    id: PeerId,
    epoch: Epoch,
    versions: VersionRange,
    transports: Vec<Arc<dyn Transport>>,
    registry: Registry,
    table: Arc<RegistryTable>,
    server: Option<Server>,
    /// The portable data plane and why it was chosen.
    data_plane: Option<(TransportKind, String)>,
    /// The epoch each address had when we first met it: a different one is refused (StaleEpoch).
    known: Mutex<HashMap<SocketAddr, (PeerId, Epoch)>>,
    routes: Mutex<Vec<Route>>,
    request_timeout: Option<Duration>,
    connect_timeout: Duration,
    #[cfg(feature = "rdma")]
    rdma: Option<RdmaTransport>,
    /// The io_uring data plane, when it was chosen (for its counters).
    #[cfg(feature = "uring")]
    uring: Option<UringTransport>,
}

impl fmt::Debug for Inner {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TransferEngine")
            .field("id", &self.id)
            .field("epoch", &self.epoch)
            .field("listen", &self.server.as_ref().map(|s| s.local_addr()))
            .finish_non_exhaustive()
    }
}

/// Ferry's transfer engine: registers memory, connects to peers and moves bytes between them.
#[derive(Clone, Debug)]
pub struct TransferEngine {
    inner: Arc<Inner>,
}

/// A registered range, owned by the caller. Dropping it (or [`retire`](Self::retire)) unpublishes
/// it at once; its memory stays alive while requests still use it.
pub struct Registration {
    inner: Option<registry::Registration>,
    table: Arc<RegistryTable>,
    region: Arc<MemoryRegion>,
    token: SegmentToken,
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
        self.table.remove(self.token);
        let _span = tracing::info_span!("retire", token = %self.token).entered();
        match self.inner.take() {
            Some(r) => r.retire().map(|_| ()).map_err(RegistryError::into_core),
            None => Ok(()),
        }
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        self.table.remove(self.token);
    }
}

/// A published file segment (io_uring data plane only), owned by the caller. Dropping it (or
/// [`retire`](Self::retire)) unpublishes it: later requests naming its token are refused as
/// unknown; reads already running finish on the open file.
#[cfg(feature = "uring")]
pub struct FileRegistration {
    table: Arc<RegistryTable>,
    file: Arc<FileSegment>,
    token: SegmentToken,
    name: String,
}

#[cfg(feature = "uring")]
impl fmt::Debug for FileRegistration {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FileRegistration")
            .field("name", &self.name)
            .field("token", &self.token)
            .field("file", &self.file)
            .finish()
    }
}

#[cfg(feature = "uring")]
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

#[cfg(feature = "uring")]
impl Drop for FileRegistration {
    fn drop(&mut self) {
        self.table.remove_file(self.token);
    }
}

/// A connected peer incarnation and what it publishes.
#[derive(Clone)]
pub struct Peer {
    inner: Arc<PeerInner>,
}

struct PeerInner {
    addr: SocketAddr,
    id: PeerId,
    epoch: Epoch,
    segments: Vec<SegmentDesc>,
    channel: Arc<dyn Channel>,
    counters: Arc<RouteCounters>,
}

impl fmt::Debug for Peer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Peer")
            .field("addr", &self.inner.addr)
            .field("id", &self.inner.id)
            .field("epoch", &self.inner.epoch)
            .field("transport", &self.inner.channel.kind())
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
        self.inner.channel.kind()
    }

    /// Whether its data channel can still carry requests. A channel whose every stream died
    /// (the peer reset them, or went silent past `dead_peer_after`) fails each new request at
    /// once with `PeerLost`; [`TransferEngine::connect`] to the same address opens a fresh one
    /// (the same incarnation is accepted again).
    pub fn is_alive(&self) -> bool {
        self.inner.channel.is_alive()
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

    /// Closes the data path: in-flight chunks fail as lost, later requests fail at once.
    pub fn close(&self) {
        self.inner.channel.close();
    }
}

/// A segment published by a peer, as an op target.
#[derive(Clone)]
pub struct RemoteSegment {
    peer: Arc<PeerInner>,
    desc: SegmentDesc,
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

impl TransferEngine {
    /// A builder with defaults: the portable data plane (io_uring where the kernel supports it,
    /// else TCP), no listener, default budgets, no request timeout.
    pub fn builder() -> EngineBuilder {
        EngineBuilder::default()
    }

    /// This engine's peer id.
    pub fn peer_id(&self) -> PeerId {
        self.inner.id
    }

    /// This engine's epoch.
    pub fn epoch(&self) -> Epoch {
        self.inner.epoch
    }

    /// The address it serves on, if it listens.
    pub fn local_addr(&self) -> Option<SocketAddr> {
        self.inner.server.as_ref().map(|s| s.local_addr())
    }

    /// Registers `region` under `name` with `access` for peers: admitted against the budgets,
    /// prepared on every context, then published.
    pub fn register(
        &self,
        region: impl Into<Arc<MemoryRegion>>,
        access: Access,
        name: &str,
    ) -> Result<Registration, Error> {
        let region = region.into();
        let span = tracing::info_span!("register", name, len = region.len(), %access);
        let _enter = span.enter();
        let reg = self
            .inner
            .registry
            .register(name, region.clone(), access)
            .map_err(RegistryError::into_core)?;
        let token = reg.token();
        if access.is_remote() {
            self.inner.table.add(reg.lease());
        }
        tracing::debug!(%token, "published");
        Ok(Registration {
            inner: Some(reg),
            table: self.inner.table.clone(),
            region,
            token,
        })
    }

    /// Publishes the whole of the file at `path` as a segment named after the path, with
    /// `access` for peers (see [`publish_file_named`](Self::publish_file_named)).
    #[cfg(feature = "uring")]
    pub fn publish_file(
        &self,
        path: impl AsRef<std::path::Path>,
        access: Access,
    ) -> Result<FileRegistration, Error> {
        let path = path.as_ref();
        self.publish_file_named(path, access, &path.display().to_string())
    }

    /// Publishes the whole of the file at `path` (its size now) as the segment `name`, served
    /// to peers by io_uring reads (O_DIRECT when a request's alignment allows) and, with
    /// `Access::REMOTE_WRITE`, writes that never extend the file. It gets a random token and is
    /// listed in the handshake from now on; dropping the handle unpublishes it.
    ///
    /// The io_uring data plane serves them with its rings (O_DIRECT where a request's alignment
    /// allows); the TCP data plane (where the kernel refuses io_uring, or when it is forced) with
    /// positioned reads and writes off its I/O threads. File segments take no registration
    /// budget: no memory is pinned for them.
    #[cfg(feature = "uring")]
    pub fn publish_file_named(
        &self,
        path: impl AsRef<std::path::Path>,
        access: Access,
        name: &str,
    ) -> Result<FileRegistration, Error> {
        let path = path.as_ref();
        let _span =
            tracing::info_span!("publish_file", name, path = %path.display(), %access).entered();
        if self.inner.data_plane.is_none() {
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
        self.inner
            .table
            .add_file(token, name.to_owned(), file.clone());
        tracing::info!(%token, len = file.len(), "file segment published");
        Ok(FileRegistration {
            table: self.inner.table.clone(),
            file,
            token,
            name: name.to_owned(),
        })
    }

    /// Loads `len` bytes of the file at `path` from `file_offset` into `dst` at `offset`, with
    /// io_uring reads of up to 1 MiB, at most 32 in flight (O_DIRECT for aligned chunks), or
    /// with positioned reads through a bounce buffer where this engine's data plane is not
    /// io_uring (the kernel refused it, or TCP was forced). Blocking: call it from a blocking
    /// context. Returns the bytes read.
    #[cfg(feature = "uring")]
    pub fn read_file_into(
        &self,
        dst: &Registration,
        offset: u64,
        path: impl AsRef<std::path::Path>,
        file_offset: u64,
        len: u64,
    ) -> Result<u64, Error> {
        const QUEUE_DEPTH: usize = 32;
        let path = path.as_ref();
        let _span = tracing::info_span!("read_file_into", path = %path.display(), file_offset, len)
            .entered();
        if self.data_plane() != Some(TransportKind::Uring) {
            return Ok(transport_uring::read_file_into_buffered(
                dst.region(),
                offset,
                path,
                file_offset,
                len,
            )?);
        }
        Ok(transport_uring::read_file_into(
            dst.region(),
            offset,
            path,
            file_offset,
            len,
            QUEUE_DEPTH,
        )?)
    }

    /// The portable data plane (`Tcp` or `Uring`) this engine chose, if one is enabled.
    pub fn data_plane(&self) -> Option<TransportKind> {
        self.inner.data_plane.as_ref().map(|(k, _)| *k)
    }

    fn hello(&self) -> Hello {
        Hello {
            versions: self.inner.versions,
            peer_id: self.inner.id,
            epoch: self.inner.epoch,
            transports: self.inner.transports.iter().map(|t| t.offer()).collect(),
            segments: self.inner.table.published(),
        }
    }

    /// Connects to the engine serving `addr`: handshake, then the data path over the first
    /// transport both ends offer. A peer with no common protocol version is refused with
    /// `ProtocolMismatch`; an address whose epoch differs from the one this engine met there
    /// first is refused with `StaleEpoch` (use [`reresolve`](Self::reresolve) to adopt it).
    pub async fn connect(&self, addr: impl ToSocketAddrs) -> Result<Peer, Error> {
        let addr = resolve(addr)?;
        let span = tracing::info_span!("connect", %addr);
        self.connect_inner(addr).instrument(span).await
    }

    /// Forgets the epoch known for `addr` and connects afresh, adopting whatever incarnation
    /// serves it now. Descriptors of the old incarnation stay refused.
    pub async fn reresolve(&self, addr: impl ToSocketAddrs) -> Result<Peer, Error> {
        let addr = resolve(addr)?;
        self.inner
            .known
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(&addr);
        tracing::info!(%addr, "re-resolving peer");
        self.connect(addr).await
    }

    async fn connect_inner(&self, addr: SocketAddr) -> Result<Peer, Error> {
        let hello = self.hello();
        let server = transport_tcp::handshake(addr, &hello, self.inner.connect_timeout).await?;
        {
            let mut known = self
                .inner
                .known
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            match known.get(&addr) {
                Some((_, e)) if *e != server.epoch => {
                    return Err(Error::StaleEpoch {
                        addr: addr.to_string(),
                        known: *e,
                        found: server.epoch,
                    });
                }
                Some(_) => {}
                None => {
                    known.insert(addr, (server.peer_id, server.epoch));
                }
            }
        }
        let mut chosen = None;
        for t in &self.inner.transports {
            #[cfg(feature = "uring")]
            if t.kind() == TransportKind::Uring
                && let Some(u) = &self.inner.uring
                && u.over_thread_budget()
            {
                tracing::info!(%addr, threads = u.stats().threads.load(std::sync::atomic::Ordering::Relaxed),
                    max = u.config().max_threads,
                    "io_uring thread budget reached: this peer goes over the TCP data plane");
                u.stats()
                    .handed_over
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                continue;
            }
            let exact = server
                .transports
                .iter()
                .find(|o| TransportKind::of_offer(o) == Some(t.kind()));
            // Our io_uring channel speaks the TCP transport's wire: it takes a TCP offer too.
            let offer = exact.or_else(|| {
                (t.kind() == TransportKind::Uring)
                    .then(|| {
                        server
                            .transports
                            .iter()
                            .find(|o| TransportKind::of_offer(o) == Some(TransportKind::Tcp))
                    })
                    .flatten()
            });
            if let Some(offer) = offer {
                chosen = Some((t.clone(), offer.clone()));
                break;
            }
        }
        let Some((transport, offer)) = chosen else {
            return Err(Error::NoRoute {
                peer: addr.to_string(),
                reason: format!(
                    "we offer {:?}, the peer {:?}",
                    self.inner
                        .transports
                        .iter()
                        .map(|t| t.kind().name())
                        .collect::<Vec<_>>(),
                    server.transports
                ),
            });
        };
        let info = PeerInfo {
            addr,
            local_id: self.inner.id,
            local_epoch: self.inner.epoch,
            remote_id: server.peer_id,
            remote_epoch: server.epoch,
            offer,
            segments: server.segments.clone(),
        };
        let channel = transport.open(info).await?;
        let counters = self.route(addr.to_string(), channel.kind());
        tracing::info!(peer = %server.peer_id, epoch = %server.epoch, transport = %channel.kind(),
            segments = server.segments.len(), "connected");
        Ok(Peer {
            inner: Arc::new(PeerInner {
                addr,
                id: server.peer_id,
                epoch: server.epoch,
                segments: server.segments,
                channel,
                counters,
            }),
        })
    }

    fn route(&self, peer: String, kind: TransportKind) -> Arc<RouteCounters> {
        let mut routes = self
            .inner
            .routes
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if let Some((_, _, c)) = routes.iter().find(|(p, k, _)| *p == peer && *k == kind) {
            return c.clone();
        }
        let c = Arc::new(RouteCounters::default());
        routes.push((peer, kind, c.clone()));
        c
    }

    /// Submits a batch: every op is checked against its local region and the peer's descriptor
    /// before anything moves (an error here means nothing moved), then the request runs in the
    /// background. Must be called inside a tokio runtime.
    pub fn submit(&self, batch: Batch) -> Result<RequestHandle, Error> {
        let Some(first) = batch.ops.first() else {
            return Err(Error::InvalidRequest {
                reason: "empty batch".into(),
            });
        };
        let peer = first.remote.peer.clone();
        let mut ops = Vec::with_capacity(batch.ops.len());
        for p in &batch.ops {
            if !Arc::ptr_eq(&p.remote.peer, &peer) {
                return Err(Error::InvalidRequest {
                    reason: "a batch goes to one peer incarnation; split it per peer".into(),
                });
            }
            let op = Op {
                kind: p.kind,
                local: p.local.clone(),
                local_offset: p.local_offset,
                token: p.remote.desc.token,
                remote_offset: p.remote_offset,
                len: p.len,
            };
            op.check_local()?;
            p.remote.desc.check(p.kind, p.remote_offset, p.len)?;
            ops.push(op);
        }
        if let Err(e) = tokio::runtime::Handle::try_current() {
            return Err(Error::Unavailable {
                library: "tokio runtime".into(),
                reason: format!("TransferEngine::submit needs one: {e}"),
            });
        }
        let bytes: u64 = ops.iter().map(|o| o.len).sum();
        let ops: Arc<[Op]> = ops.into();
        let control = Arc::new(RequestControl::new(&ops));
        let span = tracing::info_span!("request", peer = %peer.addr, ops = ops.len(), bytes);
        let (tx, rx) = watch::channel(None);
        let fut = peer.channel.execute(ops, control.clone());
        let counters = peer.counters.clone();
        tokio::spawn(
            async move {
                let outcome = fut.await;
                counters.record(&outcome);
                if let Some(f) = outcome.failure {
                    tracing::debug!(op = f.op_index, kind = %f.kind, effect = ?outcome.remote_effect,
                        "request failed");
                }
                let _ = tx.send(Some(outcome));
            }
            .instrument(span),
        );
        Ok(RequestHandle {
            control,
            wake: Arc::new(Notify::new()),
            done: rx,
            timeout: batch.timeout.or(self.inner.request_timeout),
        })
    }

    /// Identity, listener, registrations and per-route counters.
    pub fn describe(&self) -> Description {
        let counters = self.inner.registry.counters();
        let published = self
            .inner
            .registry
            .published()
            .iter()
            .map(|l| SegmentDescription {
                name: l.name().to_owned(),
                token: l.token().to_string(),
                len: l.len(),
                access: l.access().to_string(),
            })
            .chain(
                self.inner
                    .table
                    .file_descs()
                    .into_iter()
                    .map(|d| SegmentDescription {
                        name: d.name,
                        token: d.token.to_string(),
                        len: d.len,
                        access: d.access.to_string(),
                    }),
            )
            .collect();
        let routes = self
            .inner
            .routes
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .iter()
            .map(|(p, k, c)| c.snapshot(p.clone(), *k))
            .collect();
        Description {
            peer_id: self.inner.id.to_string(),
            epoch: self.inner.epoch.to_string(),
            listen: self.local_addr().map(|a| a.to_string()),
            transports: self
                .inner
                .transports
                .iter()
                .map(|t| t.kind().name().to_owned())
                .collect(),
            data_plane: self
                .inner
                .data_plane
                .as_ref()
                .map(|(k, why)| format!("{k} ({why})")),
            #[cfg(feature = "uring")]
            data_plane_io: self.inner.uring.as_ref().map(|t| {
                let mut line = t.describe();
                if let Some(Server::Uring(h)) = &self.inner.server {
                    use std::sync::atomic::Ordering::Relaxed;
                    let s = h.stats();
                    line.push_str(&format!(
                        "; listener: threads {}, streams past it on tcp I/O threads {}, held responses {}",
                        s.threads.load(Relaxed),
                        s.handed_over.load(Relaxed),
                        s.held_responses.load(Relaxed),
                    ));
                }
                line
            }),
            #[cfg(not(feature = "uring"))]
            data_plane_io: None,
            registrations: counters.registrations,
            registered_bytes: counters.bytes,
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
        }
    }

    /// Per-rail RDMA counters (empty without RDMA).
    fn rails(&self) -> Vec<RailDescription> {
        #[cfg(feature = "rdma")]
        if let Some(t) = &self.inner.rdma {
            return t
                .rail_stats()
                .into_iter()
                .map(|s| RailDescription {
                    rail: s.rail,
                    bytes: s.bytes,
                    work_requests: s.work_requests,
                    errors: s.errors,
                    flushed: s.flushed,
                    replayed: s.replayed,
                    replayed_bytes: s.replayed_bytes,
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
        self.inner
            .registry
            .check()
            .map_err(RegistryError::into_core)?;
        #[cfg(feature = "rdma")]
        if let Some(rdma) = &self.inner.rdma {
            rdma.check()?;
        }
        Ok(())
    }

    /// Retries the native destroy of every registration left `Unquiesced` by a failed one (see
    /// [`check`](Self::check)), once the cause is dealt with: destroyed copies release their
    /// budget charges, fully destroyed registrations free their memory, and a context with
    /// nothing unquiesced left accepts registrations again. Returns what was released and the
    /// evidence for what is still held.
    pub fn retry_unquiesced(&self) -> registry::UnquiescedRetry {
        self.inner.registry.retry_unquiesced()
    }

    /// Stops serving: the listener closes and accepted connections are dropped.
    pub fn shutdown(&self) {
        if let Some(s) = &self.inner.server {
            s.shutdown();
        }
    }
}

fn resolve(addr: impl ToSocketAddrs) -> Result<SocketAddr, Error> {
    addr.to_socket_addrs()
        .map_err(|e| Error::io("resolve", "peer address", e))?
        .next()
        .ok_or_else(|| Error::InvalidRequest {
            reason: "the peer address resolves to nothing".into(),
        })
}
