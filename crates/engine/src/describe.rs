//! The engine's self-description: what `describe()` reports, and the labels and buckets its
//! counters and the metrics share.

use ferry_core::{FailureKind, RemoteStatus};

/// How a request's ops moved: straight between registered memory (`direct`), or through the
/// engine's pinned host buffers (`staged`, GPU memory no direct route serves).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Path {
    Direct,
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    Staged,
}

impl Path {
    pub(crate) const ALL: [Path; 2] = [Path::Direct, Path::Staged];

    pub(crate) fn name(self) -> &'static str {
        match self {
            Path::Direct => "direct",
            Path::Staged => "staged",
        }
    }
}

/// Upper bounds of the latency buckets, in microseconds (the last bucket is unbounded).
pub(crate) const LATENCY_BOUNDS_US: [u64; 18] = [
    10, 25, 50, 100, 250, 500, 1_000, 2_500, 5_000, 10_000, 25_000, 50_000, 100_000, 250_000,
    500_000, 1_000_000, 2_500_000, 10_000_000,
];

/// Failure kinds as counted (label values of `ferry_request_failures_total`).
pub(crate) const FAILURES: [&str; 10] = [
    "timeout",
    "cancelled",
    "peer_lost",
    "local",
    "remote_unknown_segment",
    "remote_out_of_bounds",
    "remote_access_denied",
    "remote_stale_epoch",
    "remote_malformed",
    "other",
];

pub(crate) fn failure_index(kind: FailureKind) -> usize {
    match kind {
        FailureKind::Timeout => 0,
        FailureKind::Cancelled => 1,
        FailureKind::PeerLost => 2,
        FailureKind::Local => 3,
        FailureKind::Remote(RemoteStatus::UnknownSegment) => 4,
        FailureKind::Remote(RemoteStatus::OutOfBounds) => 5,
        FailureKind::Remote(RemoteStatus::AccessDenied) => 6,
        FailureKind::Remote(RemoteStatus::StaleEpoch) => 7,
        FailureKind::Remote(RemoteStatus::Malformed) => 8,
        _ => 9,
    }
}

/// The label of a refusal's status (`unknown_segment`, ...).
pub(crate) fn status_label(status: RemoteStatus) -> &'static str {
    FAILURES[failure_index(FailureKind::Remote(status))]
        .strip_prefix("remote_")
        .unwrap_or("other")
}

/// Ops and bytes of one op kind along one path of a route.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
#[non_exhaustive]
pub struct TrafficDescription {
    /// `read`, `write` or `checksum`.
    pub op: String,
    /// How the bytes moved: `direct` (between registered memory, GPUDirect included) or
    /// `staged` (GPU memory through pinned host buffers).
    pub route: String,
    /// Ops completed (acknowledged).
    pub ops: u64,
    /// Their bytes (a checksum's: the bytes hashed).
    pub bytes: u64,
}

/// Request latencies (submission to the logical outcome) of one op kind and size class.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
#[non_exhaustive]
pub struct LatencyDescription {
    /// `read`, `write`, `checksum`, or `mixed` (a request of several kinds).
    pub op: String,
    /// The size class: requests of at most `4KiB`, `64KiB`, `1MiB`, `16MiB` bytes (and more
    /// than the class before), or `inf`.
    pub size: String,
    /// Requests.
    pub count: u64,
    /// Their summed latency, in nanoseconds.
    pub sum_ns: u64,
    /// Requests per bucket (not cumulative): one per bound of 10, 25, 50, 100, 250, 500 µs, 1,
    /// 2.5, 5, 10, 25, 50, 100, 250, 500 ms, 1, 2.5 and 10 s (at most that long), then one
    /// past the last.
    pub buckets: Vec<u64>,
}

/// What this engine's listener accepted and refused, counted as each request is checked
/// (before any byte moves; an accepted op whose stream dies midway still counts).
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
#[non_exhaustive]
pub struct ServedDescription {
    /// Ops accepted and their bytes, by kind.
    pub accepted: Vec<TrafficDescription>,
    /// Requests refused, by status (`unknown_segment`, `out_of_bounds`, `access_denied`,
    /// `stale_epoch`, `malformed`).
    pub refused: Vec<(String, u64)>,
    /// Vectored requests whose piece table arrived (their pieces are counted above, each as an
    /// op or a refusal).
    pub tables: u64,
}

impl ServedDescription {
    pub(crate) fn of(counts: &ferry_core::transport::ServeCounts) -> Self {
        Self {
            accepted: counts
                .accepted
                .iter()
                .map(|(kind, ops, bytes)| TrafficDescription {
                    op: kind.to_string(),
                    route: Path::Direct.name().to_owned(),
                    ops: *ops,
                    bytes: *bytes,
                })
                .collect(),
            refused: counts
                .refused
                .iter()
                .map(|(s, n)| (status_label(*s).to_owned(), *n))
                .collect(),
            tables: counts.tables,
        }
    }
}

/// The registration cache: registering the same pages again (same start, length and access)
/// shares the native copies already made, until the last registration using them retires.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[non_exhaustive]
pub struct CacheDescription {
    /// Copies asked for that an existing copy served.
    pub hits: u64,
    /// Copies made.
    pub misses: u64,
    /// Distinct copies alive.
    pub entries: u64,
}

/// Registrations on one registration context (an RDMA device's port, or `host`).
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
#[non_exhaustive]
pub struct ContextDescription {
    /// The context's name.
    pub name: String,
    /// Native copies on it (RDMA: memory regions).
    pub copies: u64,
    /// Bytes those copies cover.
    pub bytes: u64,
    /// Whether admission is fenced on it after a failed destroy.
    pub fenced: bool,
}

/// Counters of one route, as [`TransferEngine::describe`](crate::TransferEngine::describe) reports
/// them. Only acknowledged ops and bytes are counted.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
#[non_exhaustive]
pub struct RouteDescription {
    /// The peer's address.
    pub peer: String,
    /// The transport (`tcp`, `uring`, `rdma`).
    pub transport: String,
    /// Requests finished on the route.
    pub requests: u64,
    /// Ops completed (acknowledged).
    pub ops: u64,
    /// Bytes completed (acknowledged).
    pub bytes: u64,
    /// Requests that ended with a failure.
    pub errors: u64,
    /// Ops run again after a lost connection, which had chunks sent before (READs and
    /// CHECKSUMs; WRITEs only under `ReconnectPolicy::replay_writes`). Whole ops are replayed.
    pub replays: u64,
    /// Bytes of those ops.
    pub replayed_bytes: u64,
    /// Channels reopened to the same peer incarnation after every stream of the last one died.
    pub reconnects: u64,
    /// Reconnect attempts (handshake and data path), successful or not.
    pub reconnect_attempts: u64,
    /// Reconnects given up: the attempts ran out, or the peer came back as a new incarnation
    /// (`StaleEpoch`).
    pub reconnect_failures: u64,
    /// Ops and bytes completed by op kind and path (kinds and paths with none left out).
    pub traffic: Vec<TrafficDescription>,
    /// Failed requests by the kind of their first failure (`timeout`, `cancelled`,
    /// `peer_lost`, `local`, `remote_<status>`; kinds with none left out).
    pub failures: Vec<(String, u64)>,
    /// Why the same-host plane was not taken on this route, where this engine has it on: the
    /// peer did not offer it (another host, or it serves none), or opening it failed (and
    /// why). `None` when it was taken, or is off here.
    pub same_host: Option<String>,
    /// How GPU buffers move on the route where its plane has a choice: the same-host plane's
    /// `cuda-ipc` (granted by CUDA IPC, copied device to device by the peer), or
    /// `host stage (<why not>)`. `None` on the other planes (TCP and io_uring stage GPU
    /// buffers; RDMA takes GPUDirect registrations).
    pub gpu: Option<String>,
    /// What the route's channel (the one opened at connect) moves one-sidedly: on the
    /// same-host plane, the peer's shared registrations it mapped and the ops it moved by
    /// `memcpy` (`crate::describe` of the peer says which of its registrations are shared);
    /// `None` on other planes, or where the peer shares none (an older one, or shared
    /// registrations off).
    pub one_sided: Option<String>,
}

/// How a shareable registration's memfd is handed out now (see
/// [`SegmentDescription::shared`]).
pub(crate) fn shared_state(s: &ferry_core::share::ShareState) -> String {
    use ferry_core::share::ShareMode;
    match s.mode() {
        ShareMode::Unshared => "memfd, not granted".into(),
        ShareMode::ReadOnly => format!("memfd, read-only, {} grants", s.grants()),
        ShareMode::ReadWrite => format!("memfd, read-write, {} grants", s.grants()),
    }
}

/// A published segment, as described locally.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
#[non_exhaustive]
pub struct SegmentDescription {
    /// Its name.
    pub name: String,
    /// Its token (hex).
    pub token: String,
    /// Its length.
    pub len: u64,
    /// Peers' access (`read`, `write`, `read+write`).
    pub access: String,
    /// Whether its memory is shared with same-host peers for one-sided copies (memory Ferry
    /// allocated in a memfd: `ferry_core::share`), and how: `memfd, not granted`, `memfd,
    /// read-only, N grants`, `memfd, read-write, N grants`; `None`: the owner copies (the
    /// user's memory, a file).
    pub shared: Option<String>,
}

/// The listener's connections before their handshake is over: the limits and what they did.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[non_exhaustive]
pub struct HandshakeDescription {
    /// Connections in their handshake now.
    pub pending: u64,
    /// Connections closed at once because `max_pending` were in their handshake.
    pub refused: u64,
    /// Connections closed because their handshake outlasted `timeout_ms`.
    pub timed_out: u64,
    /// Connections in their handshake closed to make room for a newer one: past the cap, the
    /// oldest of the source address holding the most goes.
    pub evicted: u64,
    /// The cap on connections in their handshake at once.
    pub max_pending: u64,
    /// The deadline of a handshake, in milliseconds from the accept.
    pub timeout_ms: u64,
}

/// What an engine is and has done: identity, listener, registrations and per-route counters.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
#[non_exhaustive]
pub struct Description {
    /// Peer id (hex).
    pub peer_id: String,
    /// Epoch (hex).
    pub epoch: String,
    /// The server identity this engine proves to clients that name it (an Ed25519 public key,
    /// hex; see [`TransferEngine::connect_expecting`](crate::TransferEngine::connect_expecting)):
    /// from `FERRY_IDENTITY_KEY_FILE` or the builder, else generated for this process.
    pub server_identity: String,
    /// The address served, if any.
    pub listen: Option<String>,
    /// Transports built in and enabled.
    pub transports: Vec<String>,
    /// The same-host plane: `on` with its socket, or off and why (`FERRY_SAME_HOST`, no boot
    /// id, no listener to serve it beside), and what this host allows (Yama, the copy probe).
    pub same_host: String,
    /// The portable data plane (`uring` or `tcp`) and why it was chosen, e.g. `tcp (fell back to
    /// tcp: kernel lacks io_uring opcode(s) SEND)`; `None` when neither is enabled.
    pub data_plane: Option<String>,
    /// The io_uring data plane's settings and counters when it is in use, e.g. `uring: streams
    /// 2, SEND_ZC on, registered buffers tried; threads 2 (client rings), zc sends 12, fixed 12,
    /// copy sends 0, notifications 12, short sends 0, register failures 0` (the client side of
    /// this engine: `threads` counts its client rings, 0 before its first connect), then,
    /// for an io_uring listener, `; listener on 2 rings: threads 2, held responses 40`.
    pub data_plane_io: Option<String>,
    /// The listener's connections before their handshake is over, if it listens.
    pub handshakes: Option<HandshakeDescription>,
    /// Live registrations.
    pub registrations: u64,
    /// Bytes of the live registrations, each range once.
    pub registered_bytes: u64,
    /// Bytes charged to the registration budget: each native copy of a range charges its
    /// length (an RDMA registration on two rails, twice).
    pub budget_bytes: u64,
    /// Registrations held because a native destroy failed (see
    /// [`TransferEngine::retry_unquiesced`](crate::TransferEngine::retry_unquiesced)).
    pub unquiesced: u64,
    /// Registration contexts on which admission is fenced after a failed destroy.
    pub fenced_contexts: Vec<String>,
    /// Registrations per registration context.
    pub contexts: Vec<ContextDescription>,
    /// What the listener accepted and refused, if it listens.
    pub served: Option<ServedDescription>,
    /// Request latencies by op kind and size class (classes no request fell in left out).
    pub latency: Vec<LatencyDescription>,
    /// The registration cache (RDMA): native copies shared by registrations of the same pages.
    pub registration_cache: Option<CacheDescription>,
    /// The address metrics are served on (Prometheus text format), if they are.
    pub metrics: Option<String>,
    /// Published segments.
    pub published: Vec<SegmentDescription>,
    /// Per-route counters.
    pub routes: Vec<RouteDescription>,
    /// Per-rail RDMA counters (empty without RDMA).
    pub rails: Vec<RailDescription>,
    /// The broadcasts this engine takes part in, as they last reported themselves
    /// ([`TransferEngine::report_broadcast`](crate::TransferEngine::report_broadcast)).
    pub broadcasts: Vec<BroadcastDescription>,
    /// The transfer agents of compatibility layers in this process (NIXL's), as they recorded
    /// themselves ([`crate::agent_telemetry`]): process-wide, the same on every engine.
    pub agents: Vec<crate::AgentDescription>,
    /// GPU registrations: device, PCI bus id, the GPUDirect route and why.
    #[cfg(feature = "cuda")]
    pub gpu_registrations: Vec<GpuRegistrationDescription>,
    /// The staging path: policy, pinned buffers, staged bytes, time waiting on copies, and the
    /// path of the last file load into GPU memory.
    #[cfg(feature = "cuda")]
    pub staging: Option<StagingDescription>,
}

impl std::fmt::Display for Description {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(f, "peer {} epoch {}", self.peer_id, self.epoch)?;
        if let Some(l) = &self.listen {
            writeln!(f, "listening on {l}")?;
        }
        writeln!(f, "transports: {}", self.transports.join(", "))?;
        if let Some(d) = &self.data_plane {
            writeln!(f, "data plane: {d}")?;
        }
        writeln!(f, "same host: {}", self.same_host)?;
        if let Some(io) = &self.data_plane_io {
            writeln!(f, "{io}")?;
        }
        if let Some(h) = &self.handshakes {
            writeln!(
                f,
                "handshakes: {} pending (at most {}), {} closed past the cap, {} evicted for \
                 newer ones, {} closed at the {} ms deadline",
                h.pending, h.max_pending, h.refused, h.evicted, h.timed_out, h.timeout_ms
            )?;
        }
        if let Some(s) = &self.served {
            let accepted: Vec<String> = s
                .accepted
                .iter()
                .map(|t| format!("{} {} ops ({} bytes)", t.op, t.ops, t.bytes))
                .collect();
            let refused: u64 = s.refused.iter().map(|(_, n)| n).sum();
            writeln!(f, "served: {}; {refused} refused", accepted.join(", "))?;
        }
        if let Some(m) = &self.metrics {
            writeln!(f, "metrics on http://{m}/metrics")?;
        }
        writeln!(
            f,
            "registrations: {} ({} bytes; {} charged to the budget)",
            self.registrations, self.registered_bytes, self.budget_bytes
        )?;
        if self.unquiesced > 0 || !self.fenced_contexts.is_empty() {
            writeln!(
                f,
                "unquiesced registrations: {} (admission fenced on: {})",
                self.unquiesced,
                self.fenced_contexts.join(", ")
            )?;
        }
        for s in &self.published {
            write!(
                f,
                "published {} token {} len {} access {}",
                s.name, s.token, s.len, s.access
            )?;
            match &s.shared {
                Some(how) => writeln!(f, " shared ({how})")?,
                None => writeln!(f)?,
            }
        }
        for r in &self.routes {
            writeln!(
                f,
                "route {} over {}: {} requests, {} ops, {} bytes, {} errors; {} replays ({} bytes), \
                 {} reconnects ({} attempts, {} given up)",
                r.peer,
                r.transport,
                r.requests,
                r.ops,
                r.bytes,
                r.errors,
                r.replays,
                r.replayed_bytes,
                r.reconnects,
                r.reconnect_attempts,
                r.reconnect_failures
            )?;
            if let Some(why) = &r.same_host {
                writeln!(f, "  same host not taken: {why}")?;
            }
            if let Some(gpu) = &r.gpu {
                writeln!(f, "  gpu buffers: {gpu}")?;
            }
            if let Some(one) = &r.one_sided {
                writeln!(f, "  one-sided: {one}")?;
            }
        }
        #[cfg(feature = "cuda")]
        for g in &self.gpu_registrations {
            let nics = if g.nics.is_empty() {
                String::new()
            } else {
                format!("; NICs {} ({})", g.nics.join(", "), g.nic_choice)
            };
            writeln!(
                f,
                "gpu registration {} len {} on GPU {} ({}): route {} ({}){nics}; {}",
                g.name, g.len, g.device, g.pci_bus_id, g.route.route, g.route.why, g.served
            )?;
        }
        #[cfg(feature = "cuda")]
        if let Some(s) = &self.staging {
            writeln!(
                f,
                "staging {} (gpu_direct_registration {}): {} buffers of {} bytes, {} in use, \
                 {} bytes staged, {} copies ({} failed), {} us waiting on copies{}",
                s.policy,
                s.gpu_direct_registration,
                s.buffers,
                s.buffer_size,
                s.buffers_in_use,
                s.staged_bytes,
                s.copies,
                s.copy_failures,
                s.copy_wait_us,
                s.last_file_path
                    .as_ref()
                    .map(|p| format!("; last file load: {p}"))
                    .unwrap_or_default()
            )?;
        }
        for r in &self.rails {
            writeln!(
                f,
                "rail {}: {} bytes, {} work requests, {} errors, {} flushed, {} replayed ({} bytes)",
                r.rail, r.bytes, r.work_requests, r.errors, r.flushed, r.replayed, r.replayed_bytes
            )?;
            if r.torn_down + r.rebuilds + r.down + r.unproven > 0 {
                writeln!(
                    f,
                    "rail {}: {} queue pairs torn down, {} rebuilt, down on {} channels, {} unproven chunks replayed",
                    r.rail, r.torn_down, r.rebuilds, r.down, r.unproven
                )?;
            }
        }
        for b in &self.broadcasts {
            writeln!(
                f,
                "broadcast {} v{} ({}): {} of {} bytes{}, {} refetched chunks, {} member{}",
                b.name,
                b.version,
                b.role,
                b.bytes,
                b.total_bytes,
                if b.done { ", done" } else { "" },
                b.refetched,
                b.peers,
                if b.peers == 1 { "" } else { "s" }
            )?;
        }
        Ok(())
    }
}

/// What one broadcast (a source, or a receiver) last reported of itself.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct BroadcastDescription {
    /// `source` or `receiver`.
    pub role: String,
    /// The broadcast's name.
    pub name: String,
    /// The version moving.
    pub version: u64,
    /// Bytes verified (a receiver) or published (a source).
    pub bytes: u64,
    /// The version's payload bytes.
    pub total_bytes: u64,
    /// Chunks fetched again after a failed check.
    pub refetched: u64,
    /// Members listed.
    pub peers: u64,
    /// Every chunk verified (a receiver), or the source stopped.
    pub done: bool,
}

/// Counters of one RDMA rail (`device:port`), summed over the live channels.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
#[non_exhaustive]
pub struct RailDescription {
    /// `device:port`.
    pub rail: String,
    /// Bytes acknowledged.
    pub bytes: u64,
    /// Work requests acknowledged.
    pub work_requests: u64,
    /// Error completions.
    pub errors: u64,
    /// Flushed work requests.
    pub flushed: u64,
    /// Unsignalled work requests before an error completion on this rail, replayed elsewhere
    /// rather than counted acknowledged on the verbs ordering rule alone.
    pub unproven: u64,
    /// Chunks of a failed rail this rail re-posted (multi-rail replay).
    pub replayed: u64,
    /// Bytes of those replayed chunks.
    pub replayed_bytes: u64,
    /// Failed queue pairs of this rail destroyed once flushed (never reused).
    pub torn_down: u64,
    /// Times this rail rejoined a channel on a fresh queue pair (a new handshake) after its
    /// port came back.
    pub rebuilds: u64,
    /// Channels on which this rail is down now (failed, not yet rebuilt).
    pub down: u64,
}

/// The staging path's counters, as `describe()` reports them.
#[cfg(feature = "cuda")]
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
#[non_exhaustive]
pub struct StagingDescription {
    /// `auto` or `never`.
    pub policy: String,
    /// The `gpu_direct_registration` setting.
    pub gpu_direct_registration: String,
    /// Pinned buffers allocated, over every device's pool (0 until the first staged request;
    /// each device's pool is made by the first staged request on that device).
    pub buffers: usize,
    /// Their size (the staging chunk).
    pub buffer_size: u64,
    /// Buffers held by requests now (0 when idle: nothing stays pinned to a request).
    pub buffers_in_use: usize,
    /// Bytes of device memory moved through the buffers (acknowledged chunks).
    pub staged_bytes: u64,
    /// Device copies done.
    pub copies: u64,
    /// Time spent waiting on device copies, in microseconds.
    pub copy_wait_us: u64,
    /// Device copies that failed.
    pub copy_failures: u64,
    /// Which path the last `read_file_into_gpu` took (`gds` or `compat (why)`).
    pub last_file_path: Option<String>,
}

/// A GPU registration as `describe()` reports it.
#[cfg(feature = "cuda")]
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
#[non_exhaustive]
pub struct GpuRegistrationDescription {
    /// Its name.
    pub name: String,
    /// Its length.
    pub len: u64,
    /// The device ordinal.
    pub device: u32,
    /// The device's PCI bus id.
    pub pci_bus_id: String,
    /// The GPUDirect route and why.
    pub route: ferry_cuda::RouteChoice,
    /// The RDMA rails (`device:port`) it is registered on (empty unless the route is direct).
    pub nics: Vec<String>,
    /// Why those rails (the NICs nearest its GPU, or why locality is unknown); empty unless the
    /// route is direct.
    pub nic_choice: String,
    /// How peers' ops on it move (e.g. `staged through host memory by the server`).
    pub served: String,
}
