//! Ferry's same-host data plane: when both ends of a channel run on one host, the side that owns
//! the published memory copies straight between it and the client's buffers, process to
//! process (`process_vm_readv`/`process_vm_writev`: one copy, no socket payload), after the same
//! checks as on every plane.
//!
//! - *Same host* means the same boot id (in the handshake offers) **and** a reachable abstract
//!   Unix socket whose owner is the pid the handshake named (`SO_PEERCRED`), never an address
//!   guess. A server answers a client's [`TransportOffer::Local`] only when the boot ids match.
//! - *Who copies.* Only the server, and only between the segment range its stream protocol
//!   ([`ferry_core::stream::ServerStream`]) checked, per peer, and the client's own buffers: the
//!   client names addresses in its own address space, so a client can make the server touch
//!   nothing of the server's that was not published to it. The client grants the server the
//!   right to copy (Yama `ptrace_scope` 1: `PR_SET_PTRACER` for that pid, while a channel to it
//!   lives), never the reverse.
//! - *No more right than the client's.* Serving threads drop `CAP_SYS_PTRACE`, so the kernel
//!   checks each copy as the client's own user tracing the client (another user's process and
//!   a non-dumpable one are refused); a process that cannot drop it serves only with
//!   [`LocalConfig::allow_privileged`]. A client that exited or exec'd another program is never
//!   copied to again: the server holds the connecting process (`SO_PEERPIDFD`) and the address
//!   space the probe reached, and checks both before each request.
//! - *Proof before use.* Each stream is probed at attach: the server must read eight bytes of
//!   the client's memory and send them back. A refused probe (another user, Yama 2 or 3, a
//!   container without the right) fails [`Transport::open`] with `Unavailable` and its reason;
//!   the engine then opens the network planes instead.
//! - *Failures.* A server that dies mid-copy ends the stream: chunks in flight are `PeerLost`
//!   (a WRITE's effect uncertain), as on TCP. A client that dies mid-copy makes the copy fail
//!   (`ESRCH`) and the server drops the stream. `drained` holds only once the server has ended
//!   every stream, or, for a server that holds them past a close's grace (stopped), once copies
//!   into this process are revoked (it is not dumpable until that server ends its streams) and
//!   the server is seen stopped: so no copy into a buffer outlives its request.
//!
//! - *GPU buffers* (feature `cuda`): where both ends have the CUDA driver's IPC entry points, a
//!   client's GPU buffer is granted by CUDA IPC (the handle of its allocation) in place of an
//!   address, and the server copies with the driver, device to device where its segment is GPU
//!   memory: no host bounce. A stream that cannot (an older server, no driver or no IPC on
//!   either side, or a build without CUDA) is attached without it, and the engine stages GPU
//!   buffers through host memory as on TCP; [`LocalChannel::gpu_route`] says which.
//!
//! - *Shared registrations* (memory the peer's engine allocated in a memfd,
//!   `ferry_core::MemoryRegion::alloc_shareable`): a channel asks for a token's memory on a
//!   share stream; the owner grants it only where the peer's view holds it and its access allows
//!   reading (read-only grants on a memfd sealed against writes), and the channel then moves
//!   host READs and WRITEs inside it with `memcpy`, one-sidedly: in the submitting thread, and
//!   for a request over a chunk also on a small pool of copy threads (half the CPUs, one to
//!   four), the request resolving once its last piece was copied. When
//!   the memory is freed the owner sets the memfd's revoked word and discards its bytes (the size
//!   never changes, so nothing faults); a copy that saw the word fails (`UnknownSegment`).
//!   [`LocalConfig::shared`] turns it off.
//!
//! The protocol on the socket is in [`wire`].

mod client;
#[cfg(feature = "cuda")]
mod gpu;
#[cfg(not(feature = "cuda"))]
#[path = "nogpu.rs"]
mod gpu;
mod host;
mod pipe;
mod pool;
mod ring;
mod server;
mod shares;
mod shm;
pub mod wire;

use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::time::Duration;

use ferry_core::wire::TransportOffer;
use ferry_core::{
    BoxFuture, Channel, Error, HandshakeResponder, PeerInfo, SegmentTable, Transport, TransportKind,
};
use ferry_net::HandshakeLimits;

pub use client::{GpuRoute, LocalChannel};
pub use server::{LocalServer, LocalServerHandle};

/// Settings of the same-host plane.
#[derive(Clone, Debug)]
pub struct LocalConfig {
    /// Streams per channel (each a socket and a serving thread on the peer; 1 to 16). Copies
    /// of one stream run one after another, so streams are how a channel uses several cores.
    pub streams: usize,
    /// Chunks in flight per stream.
    pub depth: usize,
    /// Largest chunk an op is split into (at most `MAX_CHUNK`).
    pub chunk_size: u64,
    /// Limit for attaching a stream (connect, attach, probe).
    pub connect_timeout: Duration,
    /// What the server allows a connection before it attached.
    pub handshake: HandshakeLimits,
    /// Streams a server serves at once, over all its peers.
    pub max_streams: usize,
    /// Serve even where a serving thread cannot drop `CAP_SYS_PTRACE` (then its copies reach
    /// any process a client names, whatever its user or dumpability). Off by default: such a
    /// server is not started and peers take the network planes.
    pub allow_privileged: bool,
    /// Offer each stream the request/answer ring in shared memory (`crate::pipe`): requests
    /// and answers without a system call while both sides are busy, small ops' bytes inline.
    /// On by default; [`RING_ENV`]`=off` in the environment turns it off (the streams then
    /// stay on their sockets, as with a server older than the ring).
    pub ring: bool,
    /// Ask for the memory of the peer's shared registrations (memory its engine allocated in a
    /// memfd) on a share stream, map what is granted, and move ops on it one-sidedly
    /// (`crate::shares`); also serve such asks. On by default; [`SHARED_ENV`]`=off` turns it
    /// off (every copy is then the owner's).
    pub shared: bool,
    /// Where the CUDA driver GPU buffers are granted and copied with by CUDA IPC comes from
    /// (asked at each attach; used when it has the entry points and a GPU); `None`: GPU
    /// buffers take the host stage.
    #[cfg(feature = "cuda")]
    pub cuda: Option<CudaSource>,
}

/// Where the same-host plane finds the CUDA driver, asked when a stream attaches: a fixed one,
/// or whatever the engine has loaded by then (an engine that never touched GPU memory offers no
/// CUDA IPC, and loads no driver for the plane's sake).
#[cfg(feature = "cuda")]
#[derive(Clone)]
pub struct CudaSource(Arc<dyn Fn() -> Option<ferry_cuda::Cuda> + Send + Sync>);

#[cfg(feature = "cuda")]
impl CudaSource {
    /// Always `cuda`.
    pub fn fixed(cuda: ferry_cuda::Cuda) -> Self {
        Self(Arc::new(move || Some(cuda.clone())))
    }

    /// Whatever `f` returns when asked.
    pub fn new(f: impl Fn() -> Option<ferry_cuda::Cuda> + Send + Sync + 'static) -> Self {
        Self(Arc::new(f))
    }

    /// The driver now, if any.
    pub fn get(&self) -> Option<ferry_cuda::Cuda> {
        (self.0)()
    }
}

#[cfg(feature = "cuda")]
impl std::fmt::Debug for CudaSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("CudaSource")
    }
}

impl Default for LocalConfig {
    fn default() -> Self {
        Self {
            streams: 2,
            depth: 16,
            chunk_size: 4 << 20,
            connect_timeout: Duration::from_secs(10),
            handshake: HandshakeLimits::default(),
            max_streams: 256,
            allow_privileged: false,
            ring: ring_from_env(),
            shared: on_unless_off(SHARED_ENV),
            #[cfg(feature = "cuda")]
            cuda: None,
        }
    }
}

/// The environment variable that, set to `off` (or `0`, `false`, `no`), keeps the same-host
/// plane's streams on their sockets (no request/answer ring): [`LocalConfig::ring`]'s default.
pub const RING_ENV: &str = "FERRY_SAME_HOST_RING";

/// The environment variable that, set to `off` (or `0`, `false`, `no`), keeps the same-host
/// plane from mapping peers' shared registrations (every copy the owner's):
/// [`LocalConfig::shared`]'s default.
pub const SHARED_ENV: &str = "FERRY_SAME_HOST_SHARED";

fn ring_from_env() -> bool {
    on_unless_off(RING_ENV)
}

fn on_unless_off(var: &str) -> bool {
    !matches!(
        std::env::var(var).as_deref().map(str::trim),
        Ok("off" | "0" | "false" | "no")
    )
}

/// What this process can say about the same-host plane before any peer is met (for `doctor`
/// and `describe`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LocalProbe {
    /// The boot id, or why it could not be read.
    pub boot_id: Result<[u8; 16], String>,
    /// Yama's `ptrace_scope`, if Yama is built in.
    pub yama_scope: Option<u8>,
    /// Whether a copy with this very process works (the system call is allowed here: seccomp
    /// profiles of some container runtimes refuse it), or the kernel's reason.
    pub copies: Result<(), String>,
    /// Whether a serving thread runs without `CAP_SYS_PTRACE` (`true`: this process had it
    /// and a thread drops it; `false`: it never had it), or why one cannot drop it.
    pub serving: Result<bool, String>,
    /// Channels whose server held its streams past a close, for which copies into this
    /// process are revoked now (the process is not dumpable until each server ends them).
    pub revoked: usize,
}

impl LocalProbe {
    /// One line for humans: what the plane needs and whether this host has it.
    pub fn summary(&self) -> String {
        let line = match (&self.boot_id, &self.copies) {
            (Err(e), _) => return format!("off: no boot id ({e})"),
            (_, Err(e)) => return format!("off: process_vm_readv refused here ({e})"),
            (Ok(_), Ok(())) => match self.yama_scope {
                None | Some(0) => "on: process-to-process copies (same user)".into(),
                Some(1) => "on: process-to-process copies (Yama ptrace_scope 1: each client \
                            names its one same-host server)"
                    .into(),
                Some(s) => format!(
                    "limited: Yama ptrace_scope {s} allows the copies only to a server with \
                     CAP_SYS_PTRACE, which serving threads drop; peers take the network planes"
                ),
            },
        };
        let line = if self.revoked > 0 {
            format!(
                "{line}; copies into this process revoked now ({} same-host server(s) held \
                 their streams past a close: not dumpable until they end them)",
                self.revoked
            )
        } else {
            line
        };
        match &self.serving {
            Ok(false) => line,
            Ok(true) => format!(
                "{line}; serving threads drop CAP_SYS_PTRACE (a client is copied to with the \
                 right its own user has)"
            ),
            Err(e) => format!(
                "{line}; not served here: a serving thread cannot drop CAP_SYS_PTRACE ({e}), \
                 set FERRY_SAME_HOST=privileged to serve anyway"
            ),
        }
    }

    /// Whether this process serves the plane with `allow_privileged` as set (a process that
    /// cannot drop `CAP_SYS_PTRACE` serves only where allowed).
    pub fn serves(&self, allow_privileged: bool) -> Result<(), String> {
        match &self.serving {
            Err(e) if !allow_privileged => Err(privileged_refusal(e)),
            _ => Ok(()),
        }
    }
}

/// Whether a fresh thread of this process serves without `CAP_SYS_PTRACE`: `true` where it had
/// the capability and dropped it.
fn serving_probe() -> Result<bool, String> {
    let t = std::thread::Builder::new()
        .name("ferry-local-probe".into())
        .spawn(|| {
            let had = host::ptrace_capable().map_err(|e| format!("capget: {e}"))?;
            host::drop_ptrace_capability().map_err(|e| e.to_string())?;
            Ok(had)
        })
        .map_err(|e| format!("cannot start a thread: {e}"))?;
    t.join()
        .unwrap_or_else(|_| Err("the probing thread panicked".into()))
}

/// Probes this host for the same-host plane (reads two files, copies eight bytes with itself).
pub fn probe() -> LocalProbe {
    let copies = {
        let src = 0x5eed_u64.to_le_bytes();
        let mut dst = [0u8; 8];
        let ours = [host::Span {
            addr: dst.as_mut_ptr() as usize,
            len: 8,
        }];
        let theirs = [host::Span {
            addr: src.as_ptr() as usize,
            len: 8,
        }];
        // SAFETY: `dst` is a local array, writable and unreferenced during the copy.
        match unsafe { host::copy(std::process::id(), host::Direction::In, &ours, &theirs) } {
            Ok(()) if dst == src => Ok(()),
            Ok(()) => Err("the copy moved other bytes".into()),
            Err(e) => Err(e.to_string()),
        }
    };
    LocalProbe {
        boot_id: host::boot_id().map_err(|e| e.to_string()),
        yama_scope: host::yama_scope(),
        copies,
        serving: serving_probe(),
        revoked: host::revocations(),
    }
}

/// The same-host [`Transport`]: offers this host's boot id and pid, answers clients of the same
/// host with its server's socket, and opens [`LocalChannel`]s.
#[derive(Debug, Clone)]
pub struct LocalTransport {
    config: LocalConfig,
    boot_id: Option<[u8; 16]>,
    /// The server [`serve`](Self::serve) started: held by whoever called it (the engine), so
    /// that the server, whose responder holds this transport, is not kept alive by it.
    server: Arc<Mutex<Weak<LocalServerHandle>>>,
}

impl LocalTransport {
    /// A transport with `config` (streams clamped to 1..=16, chunk size to 1..=`MAX_CHUNK`).
    /// Without a readable boot id it offers nothing a peer answers.
    pub fn new(mut config: LocalConfig) -> Self {
        config.streams = config.streams.clamp(1, 16);
        config.depth = config.depth.max(1);
        config.chunk_size = config.chunk_size.clamp(1, ferry_core::wire::MAX_CHUNK);
        let boot_id = match host::boot_id() {
            Ok(id) => Some(id),
            Err(e) => {
                tracing::info!(error = %e, "no boot id: the same-host plane is off");
                None
            }
        };
        Self {
            config,
            boot_id,
            server: Arc::default(),
        }
    }

    /// Its settings.
    pub fn config(&self) -> &LocalConfig {
        &self.config
    }

    /// Starts serving `table` on a fresh abstract socket, answered in handshakes from now on
    /// while the returned handle lives and serves. Serving twice returns the first server.
    pub fn serve(
        &self,
        table: Arc<dyn SegmentTable>,
        responder: Arc<dyn HandshakeResponder>,
    ) -> Result<Arc<LocalServerHandle>, Error> {
        let mut slot = self.server.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(s) = slot.upgrade() {
            return Ok(s);
        }
        serving_probe_result(self.config.allow_privileged)?;
        let bound = LocalServer::bind()?
            .privileged(self.config.allow_privileged)
            .sharing(self.config.shared);
        #[cfg(feature = "cuda")]
        let bound = bound.with_cuda(self.config.cuda.clone());
        let handle = Arc::new(bound.serve(
            table,
            responder,
            self.config.handshake,
            self.config.max_streams,
        )?);
        tracing::debug!(socket = %handle.name(), "same-host plane serving");
        *slot = Arc::downgrade(&handle);
        Ok(handle)
    }

    /// The server started by [`serve`](Self::serve), while it serves.
    pub fn server(&self) -> Option<Arc<LocalServerHandle>> {
        self.server
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .upgrade()
            .filter(|s| s.is_serving())
    }

    /// Opens a channel (blocking: connects, attaches and probes each stream).
    pub fn connect_channel(&self, peer: &PeerInfo) -> Result<LocalChannel, Error> {
        #[cfg(feature = "cuda")]
        let ipc = gpu::client_offers(self.config.cuda.as_ref().and_then(CudaSource::get).as_ref());
        #[cfg(not(feature = "cuda"))]
        let ipc = gpu::client_offers();
        client::connect(
            peer,
            self.config.streams,
            self.config.depth,
            self.config.chunk_size,
            self.config.connect_timeout,
            ipc,
            (self.config.ring, self.config.shared),
        )
    }

    fn no_route(peer: &PeerInfo, reason: &str) -> Error {
        Error::NoRoute {
            peer: peer.addr.to_string(),
            reason: format!("same-host plane: {reason}"),
        }
    }
}

/// Refuses to serve where a serving thread would keep `CAP_SYS_PTRACE`, unless allowed.
fn serving_probe_result(allow_privileged: bool) -> Result<(), Error> {
    match serving_probe() {
        Err(e) if !allow_privileged => Err(Error::Unavailable {
            library: "same-host plane".into(),
            reason: privileged_refusal(&e),
        }),
        _ => Ok(()),
    }
}

fn privileged_refusal(why: &str) -> String {
    format!(
        "a serving thread cannot drop CAP_SYS_PTRACE ({why}); set FERRY_SAME_HOST=privileged \
         to serve anyway"
    )
}

impl Transport for LocalTransport {
    fn kind(&self) -> TransportKind {
        TransportKind::Local
    }

    fn offer(&self) -> TransportOffer {
        TransportOffer::Local {
            boot_id: self.boot_id.unwrap_or([0; 16]),
            pid: std::process::id(),
            streams: 0,
            socket: String::new(),
        }
    }

    fn accept(&self, peer: &PeerInfo) -> Result<TransportOffer, Error> {
        let TransportOffer::Local { boot_id, .. } = &peer.offer else {
            return Err(Self::no_route(peer, "not a same-host offer"));
        };
        let Some(ours) = self.boot_id else {
            return Err(Self::no_route(peer, "this host's boot id is unknown"));
        };
        if *boot_id != ours {
            return Err(Self::no_route(peer, "the peer runs on another host"));
        }
        let Some(server) = self.server() else {
            return Err(Self::no_route(
                peer,
                "this engine serves no same-host socket",
            ));
        };
        Ok(TransportOffer::Local {
            boot_id: ours,
            pid: std::process::id(),
            streams: self.config.streams as u16,
            socket: server.name().to_owned(),
        })
    }

    fn open(&self, peer: PeerInfo) -> BoxFuture<'static, Result<Arc<dyn Channel>, Error>> {
        let this = self.clone();
        Box::pin(async move {
            let opened = tokio::task::spawn_blocking(move || this.connect_channel(&peer)).await;
            match opened {
                Ok(Ok(ch)) => Ok(Arc::new(ch) as Arc<dyn Channel>),
                Ok(Err(e)) => Err(e),
                Err(e) => Err(Error::Unavailable {
                    library: "same-host plane".into(),
                    reason: format!("the attaching task failed: {e}"),
                }),
            }
        })
    }
}

/// A channel's shared registrations, as its users see them.
impl LocalChannel {
    /// Asks the server for the shared memory of the segment under `token` now (blocking) and
    /// maps it, unless mapped or refused before: how it is mapped, or why not; `None`: the
    /// server has no share stream (older, or shared registrations off on either side). Ops on
    /// a mapped segment move one-sidedly from then on (a token an op names is asked for by
    /// itself, on a thread of its own; this is for callers that want the mapping first).
    pub fn map_shared(
        &self,
        token: ferry_core::SegmentToken,
    ) -> Option<Result<ferry_core::share::Grant, ferry_core::share::ShareRefusal>> {
        self.shares.as_ref().map(|s| s.map(token))
    }

    /// Segments mapped now, and ops moved one-sidedly so far (`None`: no share stream).
    pub fn shared_use(&self) -> Option<(usize, u64)> {
        self.shares
            .as_ref()
            .map(|s| (s.mapped(), s.one_sided_ops()))
    }
}
