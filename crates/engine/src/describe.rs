//! Counters and the engine's self-description.

use std::sync::atomic::{AtomicU64, Ordering};

use ferry_core::{Outcome, TransportKind};

/// Counters of one route (peer and transport).
#[derive(Debug, Default)]
pub(crate) struct RouteCounters {
    pub(crate) requests: AtomicU64,
    pub(crate) ops: AtomicU64,
    pub(crate) bytes: AtomicU64,
    pub(crate) errors: AtomicU64,
    pub(crate) replays: AtomicU64,
    pub(crate) replayed_bytes: AtomicU64,
    pub(crate) reconnects: AtomicU64,
    pub(crate) reconnect_attempts: AtomicU64,
    pub(crate) reconnect_failures: AtomicU64,
}

impl RouteCounters {
    pub(crate) fn record(&self, o: &Outcome) {
        self.requests.fetch_add(1, Ordering::Relaxed);
        self.ops
            .fetch_add(o.completed_ops as u64, Ordering::Relaxed);
        self.bytes.fetch_add(o.completed_bytes, Ordering::Relaxed);
        if o.failure.is_some() {
            self.errors.fetch_add(1, Ordering::Relaxed);
        }
    }

    pub(crate) fn snapshot(&self, peer: String, transport: TransportKind) -> RouteDescription {
        RouteDescription {
            peer,
            transport: transport.name().to_owned(),
            requests: self.requests.load(Ordering::Relaxed),
            ops: self.ops.load(Ordering::Relaxed),
            bytes: self.bytes.load(Ordering::Relaxed),
            errors: self.errors.load(Ordering::Relaxed),
            replays: self.replays.load(Ordering::Relaxed),
            replayed_bytes: self.replayed_bytes.load(Ordering::Relaxed),
            reconnects: self.reconnects.load(Ordering::Relaxed),
            reconnect_attempts: self.reconnect_attempts.load(Ordering::Relaxed),
            reconnect_failures: self.reconnect_failures.load(Ordering::Relaxed),
        }
    }
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
    /// The address served, if any.
    pub listen: Option<String>,
    /// Transports built in and enabled.
    pub transports: Vec<String>,
    /// The portable data plane (`uring` or `tcp`) and why it was chosen, e.g. `tcp (fell back to
    /// tcp: kernel lacks io_uring opcode(s) SEND)`; `None` when neither is enabled.
    pub data_plane: Option<String>,
    /// The io_uring data plane's settings and counters when it is in use, e.g. `uring: streams
    /// 2, SEND_ZC on, registered buffers tried; threads 2 (at most 256; peers past it over
    /// tcp: 0), zc sends 12, fixed 12, copy sends 0, notifications 12, short sends 0, register
    /// failures 0` (the client side of this engine: `threads` counts its stream threads), then,
    /// for an io_uring listener, `; listener: threads 3, streams past it on tcp I/O threads 0,
    /// held responses 40`.
    pub data_plane_io: Option<String>,
    /// The listener's connections before their handshake is over, if it listens.
    pub handshakes: Option<HandshakeDescription>,
    /// Live registrations.
    pub registrations: u64,
    /// Bytes charged to the registration budget.
    pub registered_bytes: u64,
    /// Registrations held because a native destroy failed (see
    /// [`TransferEngine::retry_unquiesced`](crate::TransferEngine::retry_unquiesced)).
    pub unquiesced: u64,
    /// Registration contexts on which admission is fenced after a failed destroy.
    pub fenced_contexts: Vec<String>,
    /// Published segments.
    pub published: Vec<SegmentDescription>,
    /// Per-route counters.
    pub routes: Vec<RouteDescription>,
    /// Per-rail RDMA counters (empty without RDMA).
    pub rails: Vec<RailDescription>,
    /// GPU registrations: device, PCI bus id, the GPUDirect route and why.
    #[cfg(feature = "cuda")]
    pub gpu_registrations: Vec<crate::gpu::GpuRegistrationDescription>,
    /// The staging path: policy, pinned buffers, staged bytes, time waiting on copies, and the
    /// path of the last file load into GPU memory.
    #[cfg(feature = "cuda")]
    pub staging: Option<crate::gpu::StagingDescription>,
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
        if let Some(io) = &self.data_plane_io {
            writeln!(f, "{io}")?;
        }
        if let Some(h) = &self.handshakes {
            writeln!(
                f,
                "handshakes: {} pending (at most {}), {} closed past the cap, {} closed at the \
                 {} ms deadline",
                h.pending, h.max_pending, h.refused, h.timed_out, h.timeout_ms
            )?;
        }
        writeln!(
            f,
            "registrations: {} ({} bytes)",
            self.registrations, self.registered_bytes
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
            writeln!(
                f,
                "published {} token {} len {} access {}",
                s.name, s.token, s.len, s.access
            )?;
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
        }
        Ok(())
    }
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
    /// Chunks of a failed rail this rail re-posted (multi-rail replay).
    pub replayed: u64,
    /// Bytes of those replayed chunks.
    pub replayed_bytes: u64,
}
