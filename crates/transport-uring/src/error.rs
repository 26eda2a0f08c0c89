//! The crate's error enum.

use std::io;
use std::path::PathBuf;

/// What went wrong in the io_uring transport's own operations (rings, files). Data-plane failures
/// reach users as [`ferry_core::Error`] and per-op outcomes; this enum converts into it.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum UringError {
    /// `io_uring_setup` failed (kernel without io_uring, seccomp, `io_uring_disabled`, limits).
    #[error("io_uring: creating a ring of {entries} entries failed: {source}")]
    CreateRing {
        /// Ring size asked for.
        entries: u32,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// The kernel probe says io_uring cannot carry the data plane, or a forced feature is missing.
    #[error("io_uring unusable: {reason}")]
    Unusable {
        /// The probe's reason.
        reason: String,
    },
    /// A file could not be opened.
    #[error("opening file {path}: {source}")]
    OpenFile {
        /// The file.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// Reading a file through io_uring failed.
    #[error("reading file {path} at offset {offset}: {source}")]
    ReadFile {
        /// The file.
        path: PathBuf,
        /// File offset of the failed read.
        offset: u64,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// A range is outside the file or the destination region.
    #[error("range {offset}+{len} is outside {what} of {size} bytes")]
    OutOfRange {
        /// `"file"`, `"region"` or `"file segment"`.
        what: &'static str,
        /// Start.
        offset: u64,
        /// Length.
        len: u64,
        /// Size of the thing.
        size: u64,
    },
}

impl From<UringError> for ferry_core::Error {
    fn from(e: UringError) -> Self {
        match e {
            UringError::CreateRing { source, .. } => {
                ferry_core::Error::io("create io_uring ring", "io_uring", source)
            }
            UringError::Unusable { reason } => ferry_core::Error::Unavailable {
                library: "io_uring".into(),
                reason,
            },
            UringError::OpenFile { path, source } => {
                ferry_core::Error::io("open file", path.display().to_string(), source)
            }
            UringError::ReadFile { path, source, .. } => {
                ferry_core::Error::io("read file", path.display().to_string(), source)
            }
            e @ UringError::OutOfRange { .. } => ferry_core::Error::InvalidRequest {
                reason: e.to_string(),
            },
        }
    }
}
