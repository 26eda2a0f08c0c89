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
    /// A member answered a manifest that is refused (it does not add up, or declares more
    /// bytes than accepted): refused before anything is allocated for it.
    #[error("manifest from {addr}: {source}")]
    ManifestFrom {
        /// The member's control address.
        addr: String,
        /// Why it is refused.
        #[source]
        source: ManifestError,
    },
    /// The source answered a manifest whose digest is not the one given out of band.
    #[error(
        "the manifest from {source_addr} has digest {found}, not the expected {expected}: \
         refusing it (another publisher, or another version)"
    )]
    ManifestDigest {
        /// The source's control address.
        source_addr: String,
        /// The digest given.
        expected: crate::manifest::Digest,
        /// The manifest's.
        found: crate::manifest::Digest,
    },
    /// The discovery backend lists whatever anyone who can write it lists
    /// ([`Listing::Open`](crate::discovery::Listing::Open)), and nothing binds the manifest
    /// of the source it names to the publisher: neither keys nor an expected digest were given.
    #[error(
        "{discovery} lists whatever anyone who can write it lists, so the source it names \
         proves nothing: refusing to take its manifest unbound. Give the broadcast's keys \
         (--auth-key-file, Python's auth_key_file, ReceiverOptions::keys) or the manifest's \
         digest the publisher printed (--expect-manifest, expect_manifest, \
         ReceiverOptions::expect_manifest)"
    )]
    UnboundSource {
        /// The backend ([`Discovery::describe`](crate::Discovery::describe)).
        discovery: String,
    },
    /// A member's data plane is served by another peer incarnation than its record names (a
    /// record pointing at someone else's server, or a stale one).
    #[error(
        "the member record naming {named} lists {addr}, but {found} answers there: refusing \
         it"
    )]
    WrongPeer {
        /// The address the record lists (its data plane, or the source's control service).
        addr: String,
        /// The peer and epoch the record names.
        named: String,
        /// What answered there.
        found: String,
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
    /// The pull cannot go on: the holder named (the source, or the last relay that could serve
    /// the chunks still missing) was given up, and no other holder has them. What was verified
    /// is kept where it landed.
    #[error(
        "pull of {name:?} version {version} stopped: {holder} {reason}, and no other holder \
         has the chunks still missing; {verified} of {chunks} chunks verified ({bytes} of \
         {total} bytes)"
    )]
    Stalled {
        /// The broadcast.
        name: String,
        /// The version.
        version: u64,
        /// The holder given up: its role, id and data address.
        holder: String,
        /// Why it was given up ("sent nothing for 3.0 s while 8 chunks were requested from it").
        reason: String,
        /// Chunks verified.
        verified: u64,
        /// Chunks in the manifest.
        chunks: u64,
        /// Bytes verified.
        bytes: u64,
        /// Payload bytes.
        total: u64,
    },
    /// The published tensors and the receiver's destinations do not match; nothing moved.
    #[error("{name:?} version {version}: the published tensors do not match the destinations: {}", problems.join("; "))]
    Mismatch {
        /// The broadcast.
        name: String,
        /// The version.
        version: u64,
        /// Every problem found: missing, extra and differently sized tensors.
        problems: Vec<String>,
    },
    /// A pull in place failed after writing into the destinations: they hold neither their
    /// old version nor `version`, the one they were moving to.
    #[error("{name:?}: pull of version {version} failed, {} destination tensors are torn ({}): {cause}", tensors.len(), preview(tensors))]
    Torn {
        /// The broadcast.
        name: String,
        /// The version the destinations were moving to.
        version: u64,
        /// The destination tensors (local names).
        tensors: Vec<String>,
        /// Why the pull failed.
        #[source]
        cause: Box<BroadcastError>,
    },
    /// A pull did not complete in the time its caller gave it.
    #[error("pull of {name:?} version {version} did not complete within {seconds:.1} s")]
    TimedOut {
        /// The broadcast.
        name: String,
        /// The version.
        version: u64,
        /// The time given.
        seconds: f64,
    },
    /// A staged version could not be committed.
    #[error("{name:?}: cannot commit version {version}: {reason}")]
    Commit {
        /// The broadcast.
        name: String,
        /// The version.
        version: u64,
        /// Why.
        reason: String,
    },
}

/// The first few names of `v`, for messages.
fn preview(v: &[String]) -> String {
    let mut s = v
        .iter()
        .take(8)
        .map(|n| format!("{n:?}"))
        .collect::<Vec<_>>()
        .join(", ");
    if v.len() > 8 {
        s.push_str(&format!(", and {} more", v.len() - 8));
    }
    s
}

impl BroadcastError {
    pub(crate) fn io(what: impl Into<String>, source: io::Error) -> Self {
        Self::Io {
            what: what.into(),
            source,
        }
    }
}
