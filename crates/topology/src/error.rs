//! The crate's error type.

use std::path::PathBuf;

/// Everything that can fail in `ferry-topology`.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TopologyError {
    /// The sysfs root could not be resolved or listed.
    #[error("cannot read sysfs root {}: {source}", path.display())]
    ReadSysfs {
        /// The root as given.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// A NIC filter is malformed.
    #[error("malformed NIC filter {input:?}: token {token:?}: {reason}")]
    ParseFilter {
        /// The whole filter text.
        input: String,
        /// The offending token.
        token: String,
        /// What is wrong with it.
        reason: String,
    },
    /// The pinned device cannot be used.
    #[error("cannot use pinned RDMA device {device}: {reason}")]
    PinDevice {
        /// The pinned device name.
        device: String,
        /// Why it cannot be used.
        reason: String,
    },
    /// The pinned port cannot be used.
    #[error("cannot use pinned port {port} of RDMA device {device}: {reason}")]
    PinPort {
        /// The device.
        device: String,
        /// The pinned port.
        port: u32,
        /// Why it cannot be used.
        reason: String,
    },
    /// The pinned GID index cannot be used.
    #[error("cannot use pinned GID index {index} on port {port} of RDMA device {device}: {reason}")]
    PinGid {
        /// The device.
        device: String,
        /// The port.
        port: u32,
        /// The pinned GID index.
        index: u32,
        /// Why it cannot be used.
        reason: String,
    },
    /// A port or GID pin was given without a device pin.
    #[error("a {what} pin needs a device pin")]
    PinWithoutDevice {
        /// `"port"` or `"GID"`.
        what: &'static str,
    },
    /// The JSON rendering failed.
    #[error("cannot render the topology as JSON: {source}")]
    RenderJson {
        /// The serializer's error.
        #[source]
        source: serde_json::Error,
    },
}
