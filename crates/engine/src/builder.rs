//! The engine's builder: what to run (transports, listener, budgets, timeouts) and the one
//! data-plane configuration the TCP and io_uring transports are derived from.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use ferry_core::auth::{KeyError, Keyring, ServerAuth};
use ferry_core::identity::IdentityKey;
use ferry_core::wire::{SUPPORTED_VERSIONS, VersionRange};
use ferry_core::{Epoch, Error, PeerId, Transport, TransportKind};
use ferry_registry::{Budgets, Registry};
#[cfg(feature = "rdma")]
use ferry_transport_rdma::{RdmaConfig, RdmaTransport};
#[cfg(feature = "uring")]
use ferry_transport_uring::UringProbe;

use crate::config::DataPlaneConfig;
use crate::engine::{DataPlanes, Identity, Inner, Peers, Published, Serving, TransferEngine};
use crate::listener::Server;
use crate::metrics::MetricsServer;
use crate::reconnect::ReconnectPolicy;
use crate::route::{DataPlane, PortablePlane, open_data_plane};
use crate::serve::{RegistryTable, Responder};

/// Builds a [`TransferEngine`]. Nothing native is loaded by building.
#[derive(Debug, Clone)]
pub struct EngineBuilder {
    listen: Option<SocketAddr>,
    kinds: Vec<TransportKind>,
    data_plane: DataPlane,
    #[cfg(feature = "uring")]
    uring_probe: Option<UringProbe>,
    extra: Vec<Arc<dyn Transport>>,
    data: DataPlaneConfig,
    budgets: Budgets,
    request_timeout: Option<Duration>,
    reconnect: ReconnectPolicy,
    versions: VersionRange,
    #[cfg(feature = "rdma")]
    rdma: Option<RdmaConfig>,
    #[cfg(feature = "cuda")]
    gpu: crate::gpu::GpuConfig,
    auth: AuthSetting,
    allow_open_key_file: bool,
    identity: IdentitySetting,
    metrics: Option<SocketAddr>,
    same_host: bool,
    max_streams_per_key: usize,
}

/// Where the engine's server identity (its signing key) comes from.
#[derive(Debug, Clone)]
enum IdentitySetting {
    /// The file named by `FERRY_IDENTITY_KEY_FILE`, if set; else a fresh key for this process.
    FromEnv,
    /// An identity key file.
    File(std::path::PathBuf),
    /// A key given in code.
    Key(IdentityKey),
}

/// Where the engine's authentication keys come from.
#[derive(Debug, Clone)]
enum AuthSetting {
    /// The file named by `FERRY_AUTH_KEY_FILE`, if set; else none.
    FromEnv,
    /// No authentication, whatever the environment says.
    Off,
    /// A keyring file.
    File(std::path::PathBuf),
    /// A keyring given in code (or why it was refused).
    Keys(Result<Keyring, KeyError>),
}

/// The environment variable naming a keyring file, read by [`EngineBuilder::build`] when no key
/// was given in code.
pub const AUTH_KEY_FILE_ENV: &str = "FERRY_AUTH_KEY_FILE";

/// The environment variable that, set to `1`, lets [`EngineBuilder::build`] read a key file that
/// group or others may access (see [`EngineBuilder::allow_open_key_file`]).
pub const ALLOW_OPEN_KEY_FILE_ENV: &str = "FERRY_ALLOW_OPEN_KEY_FILE";

/// The environment variable naming the engine's identity key file (its signing key: 64 hex
/// digits), read by [`EngineBuilder::build`] when none was given in code; unset, each process
/// generates its own (see [`EngineBuilder::identity_key_file`]).
pub const IDENTITY_KEY_FILE_ENV: &str = "FERRY_IDENTITY_KEY_FILE";

pub use crate::config::SAME_HOST_ENV;

/// Whether [`SAME_HOST_ENV`] leaves the same-host plane on.
fn same_host_env_on() -> bool {
    !matches!(
        std::env::var(SAME_HOST_ENV).as_deref().map(str::trim),
        Ok("off" | "0" | "false" | "no")
    )
}

/// Whether [`SAME_HOST_ENV`] is `privileged`: serve the plane even where a serving thread
/// cannot drop `CAP_SYS_PTRACE`.
fn same_host_env_privileged() -> bool {
    std::env::var(SAME_HOST_ENV).is_ok_and(|v| v.trim() == "privileged")
}

/// Reads the keyring file at `path` (lines of `name hexkey`, see [`ferry_core::auth::Keyring`]).
/// A file whose mode grants group or others any access is refused unless `allow_open` (then a
/// warning is logged). Errors name the file and never show a key's bytes.
pub fn load_keyring(path: &std::path::Path, allow_open: bool) -> Result<Keyring, Error> {
    let text = read_key_file(path, allow_open)?;
    Keyring::parse(&text).map_err(|e| Error::AuthKey {
        source_name: path.display().to_string(),
        reason: e.to_string(),
        source: None,
    })
}

/// Reads the identity key file at `path` (the signing key's 32-byte seed as 64 hex digits, see
/// [`IdentityKey::parse`]), refused like a keyring file when group or others may access it
/// unless `allow_open`. Errors name the file and never show the key's digits.
pub fn load_identity_key(path: &std::path::Path, allow_open: bool) -> Result<IdentityKey, Error> {
    let text = read_key_file(path, allow_open)?;
    IdentityKey::parse(&text).map_err(|e| Error::AuthKey {
        source_name: path.display().to_string(),
        reason: e.to_string(),
        source: None,
    })
}

/// A key file's text, once its mode is checked (see [`load_keyring`]).
fn read_key_file(path: &std::path::Path, allow_open: bool) -> Result<String, Error> {
    use std::io::Read;
    let shown = path.display().to_string();
    let unreadable = |e: std::io::Error| Error::AuthKey {
        source_name: shown.clone(),
        reason: format!("cannot read it: {e}"),
        source: Some(e),
    };
    let mut file = std::fs::File::open(path).map_err(unreadable)?;
    // The mode of the file opened, not of whatever the path names a moment later.
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = file.metadata().map_err(unreadable)?.permissions().mode();
        if mode & 0o077 != 0 {
            if !allow_open {
                return Err(Error::AuthKey {
                    source_name: shown,
                    reason: format!(
                        "group or others may access it (mode {:o}): `chmod 600` it, or allow \
                         it (`--allow-open-key-file`, {ALLOW_OPEN_KEY_FILE_ENV}=1, \
                         EngineBuilder::allow_open_key_file)",
                        mode & 0o777
                    ),
                    source: None,
                });
            }
            tracing::warn!(file = %shown, mode = format!("{:o}", mode & 0o777),
                "the key file is open to group or others, as allowed (chmod 600 it)");
        }
    }
    let mut text = String::new();
    file.read_to_string(&mut text).map_err(unreadable)?;
    Ok(text)
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
            data: DataPlaneConfig::default(),
            budgets: Budgets::default(),
            request_timeout: None,
            reconnect: ReconnectPolicy::default(),
            versions: SUPPORTED_VERSIONS,
            #[cfg(feature = "rdma")]
            rdma: None,
            #[cfg(feature = "cuda")]
            gpu: Default::default(),
            auth: AuthSetting::FromEnv,
            allow_open_key_file: false,
            identity: IdentitySetting::FromEnv,
            metrics: None,
            same_host: true,
            max_streams_per_key: ferry_core::stream_cap::DEFAULT_STREAMS_PER_KEY,
        }
    }
}

impl EngineBuilder {
    /// Whether peers on this host are served and reached by the same-host plane
    /// (`ferry-transport-local`: process-to-process copies, chosen in the handshake, falling back
    /// to the network planes when refused). Default on, with the portable data plane; `false`,
    /// or `FERRY_SAME_HOST=off` in the environment, turns it off (`FERRY_SAME_HOST=privileged`
    /// serves it even where a serving thread cannot drop `CAP_SYS_PTRACE`: see
    /// docs/security.md). Listing
    /// [`TransportKind::Local`] in [`transports`](Self::transports) asks for it too.
    pub fn same_host(mut self, on: bool) -> Self {
        self.same_host = on;
        self
    }

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

    /// How many rings serve the io_uring listener's data streams, each on one thread (default
    /// 0: one per CPU this process may run on). A served data stream costs no thread: the
    /// listener runs these however many peers it serves.
    #[cfg(feature = "uring")]
    pub fn uring_server_rings(mut self, n: usize) -> Self {
        self.data.uring_server_rings = n;
        self
    }

    /// How many rings drive the io_uring data plane's client streams, each on one thread
    /// (default 0: one per CPU this process may run on), started at the first connect. A client
    /// stream costs no thread: the engine runs these however many peers it opens.
    #[cfg(feature = "uring")]
    pub fn uring_client_rings(mut self, n: usize) -> Self {
        self.data.uring_client_rings = n;
        self
    }

    /// Whether the task that awaits a small io_uring WRITE or READ sent directly on an idle
    /// stream reads its response itself, through its tokio runtime's reactor, instead of being
    /// woken by the stream's ring (default on; `UringConfig::caller_receives` says what it
    /// changes: a response its task leaves unread for a tick is read by the ring).
    #[cfg(feature = "uring")]
    pub fn uring_caller_receives(mut self, on: bool) -> Self {
        self.data.uring_caller_receives = on;
        self
    }

    /// Authenticates peers with the keyring file at `path` (read by [`build`](Self::build);
    /// lines of `name hexkey`, each key at least 16 bytes): as a server, every peer must prove
    /// one of its keys, and the name of that key is the peer's identity (see
    /// [`TransferEngine::register_to`]); as a client, the engine proves the file's first key. An
    /// unreadable or invalid file, or one group or others may access (see
    /// [`allow_open_key_file`](Self::allow_open_key_file)), fails `build` with [`Error::AuthKey`] naming it. Without any
    /// key given in code, `build` reads the file named by `FERRY_AUTH_KEY_FILE`, if set.
    pub fn auth_key_file(mut self, path: impl Into<std::path::PathBuf>) -> Self {
        self.auth = AuthSetting::File(path.into());
        self
    }

    /// Reads a key file even where group or others may access it (logging a warning); by
    /// default `build` refuses such a file with [`Error::AuthKey`]. Setting
    /// `FERRY_ALLOW_OPEN_KEY_FILE=1` in the environment does the same.
    pub fn allow_open_key_file(mut self, allow: bool) -> Self {
        self.allow_open_key_file = allow;
        self
    }

    /// Authenticates peers with the one key `key` (at least 16 bytes) named `name` (see
    /// [`auth_key_file`](Self::auth_key_file)).
    pub fn auth_key(mut self, name: &str, key: &[u8]) -> Self {
        self.auth = AuthSetting::Keys(Keyring::single(name, key));
        self
    }

    /// Authenticates peers with `keyring` (see [`auth_key_file`](Self::auth_key_file)).
    pub fn auth_keyring(mut self, keyring: Keyring) -> Self {
        self.auth = AuthSetting::Keys(Ok(keyring));
        self
    }

    /// Proves the server identity whose signing key is in the file at `path` (64 hex digits: the
    /// Ed25519 key's 32-byte seed; read by [`build`](Self::build), refused like a keyring file
    /// when group or others may access it). A client that names this engine's public identity
    /// ([`TransferEngine::connect_expecting`]) is answered only by it, whoever else holds its
    /// key. Without one given in code, `build` reads the file named by
    /// `FERRY_IDENTITY_KEY_FILE`, if set, else generates a key for this process (its public
    /// identity: [`TransferEngine::server_identity`], `describe()`). The identity is proven in
    /// authenticated handshakes only.
    pub fn identity_key_file(mut self, path: impl Into<std::path::PathBuf>) -> Self {
        self.identity = IdentitySetting::File(path.into());
        self
    }

    /// Proves the server identity of `key` (see [`identity_key_file`](Self::identity_key_file)).
    pub fn identity_key(mut self, key: IdentityKey) -> Self {
        self.identity = IdentitySetting::Key(key);
        self
    }

    /// No authentication, even where `FERRY_AUTH_KEY_FILE` is set.
    pub fn no_auth(mut self) -> Self {
        self.auth = AuthSetting::Off;
        self
    }

    /// Serves this engine's metrics in the Prometheus text format over HTTP on `addr`
    /// (`GET /metrics`; port 0 picks a free port, see
    /// [`TransferEngine::metrics_addr`]): every counter of
    /// [`describe`](TransferEngine::describe) as the series of [`crate::metrics`]. Like
    /// [`listen`](Self::listen), [`build`](Self::build) binds it (an address in use fails the
    /// build, naming it) and it needs a tokio runtime. Anyone who can reach the address can read
    /// the metrics (peer addresses, segment counts, traffic): bind it to loopback or a
    /// management network.
    pub fn metrics(mut self, addr: SocketAddr) -> Self {
        self.metrics = Some(addr);
        self
    }

    /// Adds a transport implemented outside this crate (preferred over the built-in ones).
    pub fn transport(mut self, transport: Arc<dyn Transport>) -> Self {
        self.extra.push(transport);
        self
    }

    /// Data streams per peer over the TCP or io_uring data plane (default 1).
    pub fn streams(mut self, n: usize) -> Self {
        self.data.streams = n;
        self
    }

    /// Largest chunk an op is split into (default 1 MiB).
    pub fn chunk_size(mut self, bytes: u64) -> Self {
        self.data.chunk_size = bytes;
        self
    }

    /// Chunks in flight per stream (default 8).
    pub fn depth(mut self, n: usize) -> Self {
        self.data.depth = n;
        self
    }

    /// Socket buffer size (`None`: kernel autotuning).
    pub fn socket_buffer(mut self, bytes: Option<usize>) -> Self {
        self.data.socket_buffer = bytes;
        self
    }

    /// I/O threads of the TCP data plane, for the client side and for the server each:
    /// `Some(0)` (default) one per available core, `Some(n)` n, `None` none (streams run on the
    /// caller's tokio runtime: lower latency for small ops, less throughput for bulk; see
    /// `TcpConfig::io_threads`).
    pub fn io_threads(mut self, n: Option<usize>) -> Self {
        self.data.io_threads = n;
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

    /// What happens when the connection to a peer is lost (default
    /// [`ReconnectPolicy::default`]): a request whose channel broke is run again, in part, on a
    /// fresh connection to the same peer incarnation; `attempts: 0` turns this off.
    pub fn reconnect(mut self, policy: ReconnectPolicy) -> Self {
        self.reconnect = policy;
        self
    }

    /// Whether WRITEs that had bytes sent before a lost connection are replayed after a
    /// reconnect (default false; see [`ReconnectPolicy::replay_writes`]).
    pub fn replay_writes(mut self, on: bool) -> Self {
        self.reconnect.replay_writes = on;
        self
    }

    /// Limit for connecting and the handshake (default 10 s).
    pub fn connect_timeout(mut self, timeout: Duration) -> Self {
        self.data.connect_timeout = timeout;
        self
    }

    /// How long the listener gives a connection to finish its handshake, however it spreads its
    /// bytes (default 5 s): past it the connection is closed and counted
    /// ([`Description::handshakes`](crate::Description::handshakes)). A client's own handshake
    /// towards this engine must fit in it.
    pub fn handshake_timeout(mut self, timeout: Duration) -> Self {
        self.data.handshake.timeout = timeout;
        self
    }

    /// How many connections the listener lets be in their handshake at once (default 256);
    /// one accepted past it is closed at once and counted
    /// ([`Description::handshakes`](crate::Description::handshakes)).
    pub fn max_pending_handshakes(mut self, n: usize) -> Self {
        self.data.handshake.max_pending = n;
        self
    }

    /// How many data streams one key name may hold attached to this engine's listeners at
    /// once, all planes together (default 1024; without keys, all peers together): one more is
    /// refused at its attach, and the client's connect fails with
    /// [`Error::TooManyStreams`](crate::Error::TooManyStreams). Each peer's channel holds its
    /// `streams` of them.
    pub fn max_streams_per_key(mut self, n: usize) -> Self {
        self.max_streams_per_key = n;
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
        self.data.dead_peer_after = after;
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

    /// Uses `cuda` as the CUDA driver instead of loading the system's `libcuda.so.1` on first
    /// GPU use (tests give Ferry's fake driver this way).
    #[cfg(feature = "cuda")]
    pub fn cuda(mut self, cuda: ferry_cuda::Cuda) -> Self {
        self.gpu.cuda = Some(cuda);
        self
    }

    /// Whether GPU memory may be staged through pinned host memory (default
    /// [`Staging::Auto`](crate::Staging::Auto)); `Never` refuses ops on GPU memory that no direct
    /// route serves.
    #[cfg(feature = "cuda")]
    pub fn staging(mut self, staging: crate::Staging) -> Self {
        self.gpu.staging = staging;
        self
    }

    /// The staging pool: `buffers` pinned host buffers of `size` bytes each (default 4 of
    /// 4 MiB), allocated when the first staged request needs them. The pool bounds the chunks of
    /// GPU memory in flight.
    #[cfg(feature = "cuda")]
    pub fn staging_buffers(mut self, buffers: usize, size: usize) -> Self {
        self.gpu.buffers = buffers;
        self.gpu.buffer_size = size;
        self
    }

    /// The GPUDirect RDMA registration route, `gpu_direct_registration` (default `auto`).
    #[cfg(feature = "cuda")]
    pub fn gpu_direct_registration(mut self, setting: ferry_cuda::GpuDirectSetting) -> Self {
        self.gpu.gpu_direct = setting;
        self
    }

    /// Where the peermem version files (`module/nvidia_peermem/version`, ...) and the PCI
    /// topology that places GPUs and NICs are read: `/sys` by default. Tests point it at a
    /// prepared tree (a peermem version file in a temporary directory).
    #[cfg(feature = "cuda")]
    pub fn gpu_sysfs_root(mut self, root: impl Into<std::path::PathBuf>) -> Self {
        self.gpu.sysfs_root = root.into();
        self
    }

    /// Whether `read_file_into_gpu` tries cuFile (GPUDirect Storage) first (default true).
    #[cfg(feature = "cuda")]
    pub fn gds(mut self, on: bool) -> Self {
        self.gpu.gds = on;
        self
    }

    /// Builds the engine. With [`listen`](Self::listen) it must run inside a tokio runtime (the
    /// listener is bound here, and served on that runtime).
    pub fn build(self) -> Result<TransferEngine, Error> {
        let keyring = self.keyring()?;
        let signing = self.signing_key()?;
        #[cfg(feature = "cuda")]
        let gpu_state = Arc::new(crate::gpu::GpuState::new(self.gpu.clone()));
        let opened = self.open_transports(
            #[cfg(feature = "cuda")]
            &gpu_state,
        )?;
        let id = PeerId::random();
        let epoch = Epoch::fresh();
        #[cfg(feature = "rdma")]
        let shared_copies = opened
            .rdma
            .as_ref()
            .map(|t| Arc::new(ferry_registry::SharedCopies::new(Arc::new(t.backend()))));
        #[cfg(feature = "rdma")]
        let registry = match &shared_copies {
            Some(cache) => Registry::new(cache.clone(), self.budgets),
            None => Registry::host(self.budgets),
        };
        #[cfg(not(feature = "rdma"))]
        let (registry, shared_copies) = (Registry::host(self.budgets), None);
        let table = Arc::new(RegistryTable::new(registry.clone()));
        let serve_stats = Arc::new(ferry_core::transport::ServeStats::default());
        let inbox = Arc::new(crate::inbox::Inbox::default());
        let responder = Arc::new(Responder {
            inbox: inbox.clone(),
            stats: serve_stats.clone(),
            id,
            epoch,
            versions: self.versions,
            transports: opened.transports.clone(),
            table: table.clone(),
            auth: keyring
                .clone()
                .map(|k| Arc::new(ServerAuth::new(k).with_identity(signing.clone()))),
            stream_cap: ferry_core::stream_cap::StreamCap::new(self.max_streams_per_key),
        });
        if let Some(addr) = self.listen
            && keyring.is_none()
            && !addr.ip().is_loopback()
        {
            tracing::warn!(%addr, "serving without authentication on an address other than \
                loopback: anyone who can reach it can list the published segments and read or \
                write them (give a key file: --auth-key-file, FERRY_AUTH_KEY_FILE)");
        }
        #[cfg(feature = "uring")]
        let uring = opened.data_plane.as_ref().and_then(|p| p.uring.clone());
        let (server, local_server) = self.serve(
            &opened,
            #[cfg(feature = "uring")]
            uring.as_ref(),
            &table,
            responder,
        )?;
        let metrics = self.metrics.map(MetricsServer::bind).transpose()?;
        tracing::info!(peer = %id, %epoch, listen = ?server.as_ref().map(|s| s.local_addr()),
            metrics = ?metrics.as_ref().map(|(_, a)| a),
            auth = ?keyring.as_ref().map(|k| k.names().collect::<Vec<_>>()), "engine built");
        Ok(TransferEngine {
            inner: Arc::new_cyclic(|weak| Inner {
                identity: Identity {
                    id,
                    epoch,
                    versions: self.versions,
                    keyring,
                    signing,
                },
                published: Published {
                    registry,
                    table,
                    shared_copies,
                },
                planes: DataPlanes {
                    transports: opened.transports,
                    data_plane: opened.data_plane.map(|p| (p.kind, p.reason)),
                    #[cfg(feature = "rdma")]
                    rdma: opened.rdma,
                    #[cfg(feature = "uring")]
                    uring,
                    local: opened.local,
                },
                peers: Peers {
                    known: Default::default(),
                    expected: Default::default(),
                    routes: Default::default(),
                    request_timeout: self.request_timeout,
                    connect_timeout: self.data.connect_timeout,
                    reconnect: self.reconnect,
                },
                serving: Serving {
                    server,
                    local: local_server,
                    inbox,
                    stats: serve_stats,
                    metrics: metrics.map(|(listener, addr)| {
                        let weak = weak.clone();
                        let describe: crate::metrics::Describe = Arc::new(move || {
                            weak.upgrade()
                                .map(|inner| TransferEngine { inner }.describe())
                        });
                        MetricsServer::start(listener, addr, describe)
                    }),
                },
                broadcasts: Default::default(),
                #[cfg(feature = "cuda")]
                gpu: Some(gpu_state),
            }),
        })
    }

    /// The engine's signing key: the one given, else `FERRY_IDENTITY_KEY_FILE`'s, else fresh.
    fn signing_key(&self) -> Result<IdentityKey, Error> {
        let allow_open = self.allow_open_key_file
            || std::env::var_os(ALLOW_OPEN_KEY_FILE_ENV).is_some_and(|v| v == "1");
        Ok(match &self.identity {
            IdentitySetting::Key(k) => k.clone(),
            IdentitySetting::File(path) => load_identity_key(path, allow_open)?,
            IdentitySetting::FromEnv => match std::env::var_os(IDENTITY_KEY_FILE_ENV) {
                Some(path) if !path.is_empty() => {
                    load_identity_key(std::path::Path::new(&path), allow_open)?
                }
                _ => IdentityKey::generate(),
            },
        })
    }

    /// The keyring the engine authenticates with: none when authentication is off (or left to
    /// an unset [`AUTH_KEY_FILE_ENV`]), else the key file's (checked for open permissions unless
    /// allowed) or the keys given; [`Error::AuthKey`] when it cannot be had.
    fn keyring(&self) -> Result<Option<Keyring>, Error> {
        let allow_open = self.allow_open_key_file
            || std::env::var_os(ALLOW_OPEN_KEY_FILE_ENV).is_some_and(|v| v == "1");
        Ok(match &self.auth {
            AuthSetting::Off => None,
            AuthSetting::FromEnv => match std::env::var_os(AUTH_KEY_FILE_ENV) {
                Some(path) if !path.is_empty() => {
                    Some(load_keyring(std::path::Path::new(&path), allow_open)?)
                }
                _ => None,
            },
            AuthSetting::File(path) => Some(load_keyring(path, allow_open)?),
            AuthSetting::Keys(Ok(k)) => Some(k.clone()),
            AuthSetting::Keys(Err(e)) => {
                return Err(Error::AuthKey {
                    source_name: "the key given to EngineBuilder::auth_key".into(),
                    reason: e.to_string(),
                    source: None,
                });
            }
        })
    }

    /// Opens the configured transports, in preference order: the added ones, then the
    /// same-host plane (when on and a portable plane or `Local` is asked for), RDMA, and the
    /// portable data plane (io_uring before TCP). [`Error::Unavailable`] for a kind this build
    /// lacks and nobody added; [`Error::InvalidRequest`] when nothing is configured.
    fn open_transports(
        &self,
        #[cfg(feature = "cuda")] gpu_state: &Arc<crate::gpu::GpuState>,
    ) -> Result<OpenedTransports, Error> {
        let mut transports: Vec<Arc<dyn Transport>> = self.extra.clone();
        #[cfg(feature = "rdma")]
        let mut rdma: Option<RdmaTransport> = None;
        let mut data_plane: Option<PortablePlane> = None;
        for kind in &self.kinds {
            match kind {
                TransportKind::Tcp | TransportKind::Uring if data_plane.is_none() => {
                    let plane = open_data_plane(
                        self.data_plane,
                        #[cfg(feature = "uring")]
                        self.uring_probe.as_ref(),
                        &self.data,
                    )?;
                    tracing::info!(transport = %plane.kind, reason = %plane.reason, "portable data plane");
                    #[cfg(feature = "uring")]
                    if let Some(t) = &plane.uring {
                        transports.push(Arc::new(t.clone()));
                    }
                    transports.push(Arc::new(plane.tcp.clone()));
                    data_plane = Some(plane);
                }
                TransportKind::Tcp | TransportKind::Uring | TransportKind::Local => {}
                #[cfg(feature = "rdma")]
                TransportKind::Rdma if rdma.is_none() => {
                    let config = self.rdma.clone().unwrap_or_default();
                    let t = RdmaTransport::open(config).map_err(Error::from)?;
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
        // The same-host plane, before every built-in transport: a peer on this host is reached
        // by copies, whatever else both ends offer. GPU buffers move on it by CUDA IPC once
        // this engine has its CUDA driver (it never loads one for the plane's sake).
        let local = (self.same_host
            && same_host_env_on()
            && (data_plane.is_some() || self.kinds.contains(&TransportKind::Local)))
        .then(|| {
            let mut config = self.data.local();
            config.allow_privileged = same_host_env_privileged();
            #[cfg(feature = "cuda")]
            {
                let gpu = gpu_state.clone();
                config.cuda = Some(ferry_transport_local::CudaSource::new(move || gpu.loaded()));
            }
            ferry_transport_local::LocalTransport::new(config)
        });
        if let Some(l) = &local {
            transports.insert(self.extra.len(), Arc::new(l.clone()));
        }
        if transports.is_empty() {
            return Err(Error::InvalidRequest {
                reason: "no transport configured".into(),
            });
        }
        Ok(OpenedTransports {
            transports,
            data_plane,
            #[cfg(feature = "rdma")]
            rdma,
            local,
        })
    }

    /// With [`listen`](Self::listen): starts the listener (an error when it cannot bind) and,
    /// beside it, the same-host plane's server, which a socket that cannot be made leaves out
    /// (peers then use the network planes). Without: neither.
    fn serve(
        &self,
        opened: &OpenedTransports,
        #[cfg(feature = "uring")] uring: Option<&ferry_transport_uring::UringTransport>,
        table: &Arc<RegistryTable>,
        responder: Arc<Responder>,
    ) -> Result<
        (
            Option<Server>,
            Option<Arc<ferry_transport_local::LocalServerHandle>>,
        ),
        Error,
    > {
        let server = match self.listen {
            None => None,
            Some(addr) => Some(Server::start(
                addr,
                &self.data,
                #[cfg(feature = "uring")]
                uring,
                table.clone(),
                responder.clone(),
            )?),
        };
        let local_server = match (&server, &opened.local) {
            (Some(_), Some(l)) => match l.serve(table.clone(), responder) {
                Ok(h) => Some(h),
                Err(e) => {
                    tracing::warn!(error = %e, "same-host plane not served; peers on this host \
                        use the network planes");
                    None
                }
            },
            _ => None,
        };
        Ok((server, local_server))
    }
}

/// The transports [`EngineBuilder::build`] opened, in preference order, and the planes among
/// them that the engine keeps by name.
struct OpenedTransports {
    transports: Vec<Arc<dyn Transport>>,
    data_plane: Option<PortablePlane>,
    #[cfg(feature = "rdma")]
    rdma: Option<RdmaTransport>,
    local: Option<ferry_transport_local::LocalTransport>,
}

impl TransferEngine {
    /// A builder with defaults: the portable data plane (io_uring where the kernel supports it,
    /// else TCP), no listener, default budgets, no request timeout.
    pub fn builder() -> EngineBuilder {
        EngineBuilder::default()
    }
}
