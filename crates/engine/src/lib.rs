//! Ferry: a transfer engine that moves bytes between registered memory over RDMA, io_uring or TCP.
//!
//! ```no_run
//! # async fn demo() -> Result<(), ferry::Error> {
//! use ferry::{Access, Batch, MemoryRegion, TransferEngine};
//! let engine = TransferEngine::builder().build()?;
//! let buf = engine.register(MemoryRegion::alloc_zeroed(1 << 20, 4096).map_err(|e| ferry::Error::InvalidRequest { reason: e.to_string() })?, Access::LOCAL, "buf")?;
//! let peer = engine.connect("127.0.0.1:7400").await?;
//! let weights = peer.segment("weights")?;
//! let handle = engine.submit(Batch::new().read(&buf, 0, &weights, 0, 1 << 20))?;
//! let drained = handle.drained();
//! let outcome = handle.await;
//! assert!(outcome.is_success());
//! drained.await;
//! # Ok(()) }
//! ```
//!
//! Contract: docs/architecture.md, sections 2 to 6. Outcomes never report a byte that was not
//! acknowledged; timeouts and cancels are logical (the request ends, `drained` waits for the
//! buffers); an address whose epoch changed is refused with `StaleEpoch` until re-resolved. A
//! lost connection to the same incarnation is reconnected and the unfinished READs of the
//! requests on it replayed (WRITEs only if allowed): see [`ReconnectPolicy`].
#![forbid(unsafe_code)]

pub mod agent_telemetry;
mod builder;
mod config;
mod counters;
mod describe;
mod engine;
#[cfg(feature = "cuda")]
pub mod gpu;
mod handles;
pub mod inbox;
mod listener;
pub mod metrics;
mod peer;
mod progress;
pub mod raw;
mod reconnect;
mod request;
mod route;
mod serve;

pub use agent_telemetry::{AgentDescription, AgentTelemetry};
pub use builder::{
    ALLOW_OPEN_KEY_FILE_ENV, AUTH_KEY_FILE_ENV, EngineBuilder, IDENTITY_KEY_FILE_ENV,
    SAME_HOST_ENV, load_identity_key, load_keyring,
};
pub use describe::{
    BroadcastDescription, CacheDescription, ContextDescription, Description, HandshakeDescription,
    LatencyDescription, RailDescription, RouteDescription, SegmentDescription, ServedDescription,
    TrafficDescription,
};
pub use engine::TransferEngine;
pub use ferry_core::auth::Keyring;
pub use ferry_core::identity::{IdentityError, IdentityKey, ServerIdentity};
/// GPU memory (`ferry-cuda`): the driver, devices, device memory, routes and file loads.
#[cfg(feature = "cuda")]
pub use ferry_cuda as cuda;
/// The same-host plane's probe of this host (boot id, Yama, the copy system call), as `ferry
/// doctor`'s `same-host` row reads it.
pub use ferry_transport_local::{LocalProbe, probe as probe_same_host};
/// The pre-authentication gate of a listener (`ferry-net`): a cap on connections that have not
/// proven a key yet and a deadline for the proof, shared by the data planes' listeners and the
/// layers above the facade that open listeners of their own (the broadcast control services);
/// and the one rule by which every listener waits after a failed accept.
pub use ferry_transport_tcp::{
    AcceptBackoff, HandshakeGate, HandshakeLimits, HandshakeSlot, HandshakeStats,
};
/// The io_uring kernel probe (inject one with [`EngineBuilder::uring_probe`]).
#[cfg(feature = "uring")]
pub use ferry_transport_uring::{OpcodeSupport, UringProbe, probe_kernel};
#[cfg(feature = "cuda")]
pub use gpu::{GpuRegistration, GpuRegistrationDescription, Staging, StagingDescription};
pub use handles::FileRegistration;
pub use handles::{Registration, RemoteSegment};
pub use inbox::Notification;
pub use peer::Peer;
pub use progress::MAX_BROADCASTS;
pub use reconnect::ReconnectPolicy;
pub use request::{Batch, Canceller, LocalMemory, LocalRef, RequestHandle};
pub use route::DataPlane;

pub use ferry_core::wire::{CHECKSUM_VERSION, SUPPORTED_VERSIONS, VersionRange};

/// CRC-32C of byte ranges (hardware-accelerated where the CPU has it): the function
/// [`Peer::checksum`] asks a peer to compute, for comparing with local bytes (`ferry-core`).
pub use ferry_core::checksum;
pub use ferry_core::{
    Access, Epoch, Error, Failure, FailureKind, MemoryRegion, OpKind, Outcome, PAGE_ALIGN, PeerId,
    RemoteEffect, RemoteStatus, SegmentDesc, SegmentToken, TransportKind,
};
/// A published file range (`ferry-file`), as [`FileRegistration::file`] hands it out.
pub use ferry_file::FileSegment;
pub use ferry_registry::{Budgets, UnquiescedInfo, UnquiescedRetry};
/// The RDMA transport's configuration (`ferry-transport-rdma`).
#[cfg(feature = "rdma")]
pub use ferry_transport_rdma::{RailSpec, RdmaConfig};

/// Ferry's shared vocabulary (`ferry-core`), for transports built outside this crate.
pub use ferry_core as core_types;

pub mod capabilities;
pub mod rdma_devices;

/// sysfs topology: NICs, GPUs, distance classes, NIC assignment and filters (`ferry-topology`).
pub use ferry_topology as topology;

/// The quickstart's Rust example, compiled as a doctest so that the guide stays true to the API.
#[doc = include_str!("../../../docs/quickstart.md")]
#[cfg(doctest)]
pub struct QuickstartDoctest;
