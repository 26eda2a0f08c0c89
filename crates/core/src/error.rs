//! The error enum shared by every Ferry crate that moves bytes.

use std::io;
use std::time::Duration;

use crate::ids::{Access, Epoch, SegmentToken};
use crate::memory::OutOfBounds;
use crate::wire::VersionRange;

/// Everything that can go wrong when registering, connecting or transferring.
///
/// Each variant names what failed and carries the context a user needs to act on it; native errors
/// are kept as the `#[source]`.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A peer answered at a known address with an epoch other than the one this consumer knew: the
    /// source restarted, and descriptors taken from the old incarnation are refused. Re-resolve
    /// explicitly to adopt the new one.
    #[error(
        "stale epoch at {addr}: known epoch {known}, peer now has epoch {found}; re-resolve the peer explicitly"
    )]
    StaleEpoch {
        /// The peer's address.
        addr: String,
        /// The epoch this consumer knew.
        known: Epoch,
        /// The epoch the peer presented.
        found: Epoch,
    },
    /// The two ends share no protocol version; rejected before admission.
    #[error("protocol mismatch with {peer}: we speak versions {local}, the peer speaks {remote}")]
    ProtocolMismatch {
        /// The peer's address.
        peer: String,
        /// Our supported range.
        local: VersionRange,
        /// The peer's supported range.
        remote: VersionRange,
    },
    /// The segment token is unknown to the peer (never published, or retired: indistinguishable).
    #[error("unknown segment {token} at {peer} (never published or retired)")]
    UnknownSegment {
        /// The peer's address (or "local").
        peer: String,
        /// The token asked for.
        token: SegmentToken,
    },
    /// No segment of that name is published by the peer.
    #[error("peer {peer} publishes no segment named {name:?}")]
    UnknownSegmentName {
        /// The peer's address.
        peer: String,
        /// The name asked for.
        name: String,
    },
    /// A raw address range (memory named by its virtual address, as Mooncake's and NIXL's
    /// APIs name it) lies inside no registration of that side: nothing was sent.
    #[error("{side} address {addr:#x}+{len} at {peer}: {reason}")]
    UnknownAddress {
        /// `"local"` or `"remote"`.
        side: &'static str,
        /// The peer's address (or `"local"`).
        peer: String,
        /// The first byte asked for.
        addr: u64,
        /// How many bytes from it.
        len: u64,
        /// Why no registration holds it (none does, or the range passes one's end).
        reason: String,
    },
    /// A range falls outside a local region or a remote segment.
    #[error("{side} range out of bounds: {source}")]
    OutOfBounds {
        /// `"local"` or `"remote"`.
        side: &'static str,
        /// The failed check.
        #[source]
        source: OutOfBounds,
    },
    /// The access right needed for an op is not granted on the segment.
    #[error("access denied on segment {token}: {needed} needed, {granted} granted")]
    AccessDenied {
        /// The segment.
        token: SegmentToken,
        /// The right the op needs.
        needed: Access,
        /// The rights the segment grants.
        granted: Access,
    },
    /// The connection to the peer broke.
    #[error("peer {peer} lost during {during}")]
    PeerLost {
        /// The peer's address.
        peer: String,
        /// What was going on.
        during: &'static str,
        /// The I/O error that showed the loss, where there is one.
        #[source]
        source: Option<io::Error>,
    },
    /// A request or handshake took longer than allowed.
    #[error("{what} timed out after {after:?}")]
    Timeout {
        /// What timed out.
        what: &'static str,
        /// The limit.
        after: Duration,
    },
    /// The request was cancelled by the user.
    #[error("request cancelled")]
    Cancelled,
    /// A native library or runtime facility is not available.
    #[error("{library} unavailable: {reason}")]
    Unavailable {
        /// The library or facility (`libibverbs.so.1`, `tokio runtime`, ...).
        library: String,
        /// The loader's (or probe's) reason.
        reason: String,
    },
    /// A registration budget would be exceeded. Published ranges are never evicted to fit.
    #[error("{budget} budget exhausted: requested {requested}, held {held} of {limit}")]
    ResourceExhausted {
        /// Which budget (`registration count`, `registered bytes`, ...).
        budget: String,
        /// What the refused admission asked for.
        requested: u64,
        /// What is held now.
        held: u64,
        /// The limit.
        limit: u64,
    },
    /// A native destroy failed: the objects and their charges stay held and admission is fenced.
    #[error("{what} could not be released (unquiesced): {evidence}")]
    Unquiesced {
        /// The object that could not be destroyed.
        what: String,
        /// The native error and cleanup evidence.
        evidence: String,
    },
    /// Registering a range failed for a reason other than a budget (a native registration error,
    /// a fenced context, ...).
    #[error("registering {name:?} failed: {source}")]
    Register {
        /// The registration's name.
        name: String,
        /// The registry's error.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// A frame could not be decoded; the connection it came on is closed.
    #[error("malformed frame from {peer}: {source}")]
    Malformed {
        /// The peer's address.
        peer: String,
        /// What the decoder found.
        #[source]
        source: crate::wire::WireError,
    },
    /// The peer refused the handshake for a reason other than the version range.
    #[error("peer {peer} refused the handshake: {reason}")]
    HandshakeRefused {
        /// The peer's address.
        peer: String,
        /// The peer's reason.
        reason: String,
    },
    /// The peer refused a data stream: our key name (or, on a server without keys, all its
    /// peers) holds as many streams attached to it as it allows (its `max_streams_per_key`).
    /// Close channels to it, or use fewer streams per channel.
    #[error("peer {peer} refused a data stream, too many are attached: {reason}")]
    TooManyStreams {
        /// The peer's address.
        peer: String,
        /// The peer's reason.
        reason: String,
    },
    /// Authentication with the peer failed: it refused our key (a different key under our
    /// key's name, a name it does not know, a stream proof it does not accept), it could not
    /// prove it holds our key, or one side has a key and the other none.
    #[error("authentication with {peer} failed: {reason}")]
    Authentication {
        /// The peer's address.
        peer: String,
        /// What failed (never a key's bytes).
        reason: String,
    },
    /// The server at `addr` is not the one the client named: it could not prove the expected
    /// server identity (it signed with another, or proved none). It may hold the client's key
    /// (under per-peer keyrings every server holding it does); it is not the server expected,
    /// so nothing was sent to it past the handshake.
    #[error(
        "the server at {addr} is not {expected} (the server identity expected there): {reason}"
    )]
    ServerIdentity {
        /// The address connected to.
        addr: String,
        /// The identity expected (an Ed25519 public key, hex).
        expected: String,
        /// The peer id the server claimed, and what it proved instead.
        reason: String,
    },
    /// An authentication key (file) could not be used: unreadable, or not a valid keyring.
    #[error("authentication key {source_name}: {reason}")]
    AuthKey {
        /// The file (or `FERRY_AUTH_KEY_FILE`, or "the key given").
        source_name: String,
        /// What is wrong (never the key's bytes).
        reason: String,
        /// The I/O error, where the file could not be read.
        #[source]
        source: Option<io::Error>,
    },
    /// The request was malformed before anything moved (empty batch, mixed peers, ...).
    #[error("invalid request: {reason}")]
    InvalidRequest {
        /// Why.
        reason: String,
    },
    /// A transport the request needs is not offered by both ends.
    #[error("no common transport with {peer}: {reason}")]
    NoRoute {
        /// The peer's address.
        peer: String,
        /// Why none matched.
        reason: String,
    },
    /// An I/O operation failed.
    #[error("{op} {target}: {source}")]
    Io {
        /// The operation (`bind`, `connect`, `read file`...).
        op: &'static str,
        /// The address, file or device involved.
        target: String,
        /// The OS error.
        #[source]
        source: io::Error,
    },
}

impl Error {
    /// An [`Error::Io`] for `op` on `target`.
    pub fn io(op: &'static str, target: impl Into<String>, source: io::Error) -> Self {
        Self::Io {
            op,
            target: target.into(),
            source,
        }
    }
}

/// Shorthand for results with [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;
