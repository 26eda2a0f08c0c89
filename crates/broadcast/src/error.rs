//! The crate's one error enum.

use std::io;

use crate::manifest::ManifestError;

/// Why a broadcast operation failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum BroadcastError {
    /// The manifest, or the files it is built from, is refused.
    #[error(transparent)]
    Manifest(#[from] ManifestError),
    /// The transfer engine failed (connect, register, submit).
    #[error(transparent)]
    Engine(#[from] ferry::Error),
    /// Local I/O (a listener, writing the received files).
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: String,
        /// Why it failed.
        #[source]
        source: io::Error,
    },
    /// A member's control service could not be reached or answered nonsense.
    #[error("control service at {addr}: {reason}")]
    Control {
        /// Its address.
        addr: String,
        /// What went wrong.
        reason: String,
    },
    /// The source restarted (a new epoch) during the broadcast: its chunks may differ from those
    /// already verified, so the receiver refuses to mix them.
    #[error(
        "the source of {name:?} restarted during the broadcast (epoch {had}, now {found}): \
         refusing to mix chunks of two versions; pull again to fetch the new one"
    )]
    SourceRestarted {
        /// The broadcast.
        name: String,
        /// The source epoch this receiver fetched from.
        had: u64,
        /// The one it found.
        found: u64,
    },
    /// No source is listed for the broadcast.
    #[error("no source publishes {name:?} (discovery: {discovery})")]
    NoSource {
        /// The broadcast.
        name: String,
        /// Where it looked.
        discovery: String,
    },
    /// The discovery backend failed.
    #[error("discovery ({backend}): {reason}")]
    Discovery {
        /// `embedded` or `etcd`.
        backend: &'static str,
        /// What went wrong.
        reason: String,
    },
    /// Every holder of some chunk was given up on, the source included.
    #[error("no holder left for chunk {chunk} of {name:?}: {reason}")]
    NoHolder {
        /// The broadcast.
        name: String,
        /// The chunk.
        chunk: usize,
        /// Why the last one was given up on.
        reason: String,
    },
}

impl BroadcastError {
    pub(crate) fn io(what: impl Into<String>, source: io::Error) -> Self {
        Self::Io {
            what: what.into(),
            source,
        }
    }
}
