//! The crate's error enum.

use std::io;

/// What went wrong in the io_uring transport's own operations (rings, file reads). Data-plane failures
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
    /// Opening, checking or reading a file (`ferry-file`'s error, or a ring read that failed).
    #[error(transparent)]
    File(#[from] ferry_file::FileError),
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
            UringError::File(e) => e.into(),
        }
    }
}
