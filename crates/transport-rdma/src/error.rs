//! The crate's one error type.

use std::io;

use ferry_verbs_sys::VerbsError;

/// Everything that can go wrong opening devices, connecting queue pairs or registering memory.
///
/// Each variant is named after the failed operation and names the device (and port, GID index or
/// queue pair) involved; the native error is the `#[source]`.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RdmaError {
    /// libibverbs could not be loaded.
    #[error("no RDMA devices found: {library} could not be loaded: {reason}")]
    LoadLibrary {
        /// The library tried.
        library: String,
        /// The loader's reason.
        reason: String,
    },
    /// Listing devices or reading the topology failed, or nothing usable is left.
    #[error("selecting RDMA devices: {reason}")]
    Select {
        /// What went wrong, with the devices that were seen.
        reason: String,
    },
    /// `ibv_open_device` failed.
    #[error("opening RDMA device {device}")]
    OpenDevice {
        /// The device.
        device: String,
        /// The verbs error.
        #[source]
        source: VerbsError,
    },
    /// A query verb on a port or GID failed.
    #[error("querying {device} port {port} (GID index {gid_index}): {what}")]
    QueryPort {
        /// The device.
        device: String,
        /// The port.
        port: u8,
        /// The GID index.
        gid_index: u32,
        /// Which query.
        what: &'static str,
        /// The verbs error.
        #[source]
        source: VerbsError,
    },
    /// A pinned or selected port cannot carry traffic.
    #[error("{device} port {port} (GID index {gid_index}) is not usable: {reason}")]
    PortUnusable {
        /// The device.
        device: String,
        /// The port.
        port: u8,
        /// The GID index.
        gid_index: u32,
        /// Why.
        reason: String,
    },
    /// Allocating a native object (PD, completion channel, CQ, QP) failed.
    #[error("creating {what} on {device}")]
    Create {
        /// The object (`protection domain`, `completion queue`, `queue pair`...).
        what: &'static str,
        /// The device.
        device: String,
        /// The verbs error.
        #[source]
        source: VerbsError,
    },
    /// A queue-pair state transition was refused.
    #[error(
        "queue pair {qpn} on {device} port {port} (GID index {gid_index}): transition {transition} failed"
    )]
    ModifyQp {
        /// The device.
        device: String,
        /// The port.
        port: u8,
        /// The local GID index.
        gid_index: u32,
        /// The queue-pair number.
        qpn: u32,
        /// The transition, such as `INIT->RTR`.
        transition: &'static str,
        /// The errno.
        #[source]
        source: io::Error,
    },
    /// The peer's RDMA offer cannot be used.
    #[error("connecting queue pairs with {peer}: {reason}")]
    Connect {
        /// The peer.
        peer: String,
        /// Why.
        reason: String,
    },
}

/// The error as ferry-core's error enum (what the `Transport` trait returns).
impl From<RdmaError> for ferry_core::Error {
    fn from(e: RdmaError) -> Self {
        match e {
            RdmaError::LoadLibrary { library, reason } => ferry_core::Error::Unavailable {
                library,
                reason: format!("no RDMA devices found: {reason}"),
            },
            other => ferry_core::Error::Unavailable {
                library: "ferry rdma transport".into(),
                reason: error_chain(&other),
            },
        }
    }
}

/// `err` and all its sources, joined with `: `.
pub(crate) fn error_chain(err: &dyn std::error::Error) -> String {
    let mut s = err.to_string();
    let mut cur = err.source();
    while let Some(e) = cur {
        s.push_str(": ");
        s.push_str(&e.to_string());
        cur = e.source();
    }
    s
}
