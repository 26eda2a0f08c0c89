//! The registry's errors.

use std::fmt;
use std::sync::Arc;

use ferry_core::{Access, OutOfBounds, SegmentToken};

use crate::backend::{ContextId, NativeError};

/// Which budget a request would exceed.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Budget {
    /// The aggregate count of native copies.
    Count,
    /// The aggregate bytes of native copies (each copy charges the full range).
    Bytes,
}

impl fmt::Display for Budget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Budget::Count => f.write_str("registration count"),
            Budget::Bytes => f.write_str("registration bytes"),
        }
    }
}

/// Errors of the registry.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RegistryError {
    /// Admission would exceed a budget. Nothing native was called; published registrations are
    /// never evicted to make room.
    #[error(
        "registering {name:?} needs {requested_copies} native copies of {len} bytes \
         ({requested_bytes} bytes charged), which exceeds the {budget} budget: \
         {held_copies} copies and {held_bytes} bytes already held, limit {limit}"
    )]
    ResourceExhausted {
        /// The budget that would be exceeded.
        budget: Budget,
        /// The registration's name.
        name: String,
        /// Length of the range.
        len: u64,
        /// Copies the fan-out needs.
        requested_copies: u64,
        /// Bytes the fan-out charges (copies times length).
        requested_bytes: u64,
        /// Copies already held (including admissions in progress).
        held_copies: u64,
        /// Bytes already held (including admissions in progress).
        held_bytes: u64,
        /// The limit of `budget` (a count or a byte size).
        limit: u64,
    },

    /// A native registration failed; the copies made before it were destroyed and their charges
    /// released. Registration errors never switch to staging.
    #[error(
        "registering {name:?} ({len} bytes, {access}) on context {context_name} ({context}), copy {copy} of {copies}"
    )]
    Register {
        /// The registration's name.
        name: String,
        /// Length of the range.
        len: u64,
        /// The access rights of the failed copy.
        access: Access,
        /// The context the copy failed on.
        context: ContextId,
        /// The context's name.
        context_name: String,
        /// Index of the failed copy in the fan-out.
        copy: usize,
        /// Number of copies in the fan-out.
        copies: usize,
        /// The native error.
        #[source]
        source: NativeError,
    },

    /// Admission is fenced on a context because an earlier native destroy failed there.
    #[error(
        "registering {name:?}: context {context_name} ({context}) is fenced after a failed native destroy"
    )]
    Fenced {
        /// The registration's name.
        name: String,
        /// The fenced context.
        context: ContextId,
        /// The context's name.
        context_name: String,
        /// The destroy failure that fenced it.
        #[source]
        cause: Arc<NativeError>,
    },

    /// A native destroy failed: the native copies, the memory and their budget charges stay held,
    /// and new admission on the context is fenced.
    #[error(
        "retiring {name:?} ({token}): destroying a copy on context {context_name} ({context}) failed; {copies_held} copies and the memory stay held (unquiesced)"
    )]
    Unquiesced {
        /// The registration's name.
        name: String,
        /// The registration's token.
        token: SegmentToken,
        /// The context the destroy failed on.
        context: ContextId,
        /// The context's name.
        context_name: String,
        /// Copies still held (the failed one included).
        copies_held: usize,
        /// The native error.
        #[source]
        source: Arc<NativeError>,
    },

    /// The backend offers no context to register on.
    #[error("registering {name:?}: the registration backend {backend} offers no context")]
    NoContexts {
        /// The registration's name.
        name: String,
        /// The backend, as its `Debug` prints it.
        backend: String,
    },
}

/// Why a peer's request may not touch a looked-up segment.
#[derive(Clone, Copy, PartialEq, Eq, Debug, thiserror::Error)]
#[non_exhaustive]
pub enum AccessError {
    /// The range falls outside the segment.
    #[error("segment {token}: {source}")]
    OutOfBounds {
        /// The segment.
        token: SegmentToken,
        /// The range and the segment's size.
        #[source]
        source: OutOfBounds,
    },
    /// The segment does not grant the needed rights.
    #[error("segment {token} grants {granted} access, the request needs {needed}")]
    Denied {
        /// The segment.
        token: SegmentToken,
        /// What the request needs.
        needed: Access,
        /// What the segment grants.
        granted: Access,
    },
}
