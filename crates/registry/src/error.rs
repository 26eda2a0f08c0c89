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

impl RegistryError {
    /// The name of the registration the error is about.
    pub fn name(&self) -> &str {
        match self {
            Self::ResourceExhausted { name, .. }
            | Self::Register { name, .. }
            | Self::Fenced { name, .. }
            | Self::Unquiesced { name, .. }
            | Self::NoContexts { name, .. } => name,
        }
    }
}

/// The engine's error for a registry error: a refused admission is `ResourceExhausted` (the
/// count budget reports copies, the bytes budget bytes; the budget names the registration), a
/// failed native destroy is `Unquiesced` (its evidence this error's message), and every other
/// failure is `Register` with this error as its source.
impl From<RegistryError> for ferry_core::Error {
    fn from(e: RegistryError) -> Self {
        match e {
            RegistryError::ResourceExhausted {
                budget,
                name,
                requested_copies,
                requested_bytes,
                held_copies,
                held_bytes,
                limit,
                ..
            } => {
                let (requested, held) = match budget {
                    Budget::Count => (requested_copies, held_copies),
                    Budget::Bytes => (requested_bytes, held_bytes),
                };
                ferry_core::Error::ResourceExhausted {
                    budget: format!("{budget} (registering {name:?})"),
                    requested,
                    held,
                    limit,
                }
            }
            RegistryError::Unquiesced { .. } => ferry_core::Error::Unquiesced {
                what: format!("registration {:?}", e.name()),
                evidence: e.to_string(),
            },
            other => ferry_core::Error::Register {
                name: other.name().to_owned(),
                source: Box::new(other),
            },
        }
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    fn exhausted(budget: Budget) -> RegistryError {
        RegistryError::ResourceExhausted {
            budget,
            name: "b".into(),
            len: 10,
            requested_copies: 2,
            requested_bytes: 20,
            held_copies: 3,
            held_bytes: 30,
            limit: 40,
        }
    }

    #[test]
    fn a_refused_admission_reports_the_budget_it_exceeds() {
        match ferry_core::Error::from(exhausted(Budget::Count)) {
            ferry_core::Error::ResourceExhausted {
                budget,
                requested,
                held,
                limit,
            } => {
                assert_eq!((requested, held, limit), (2, 3, 40));
                assert_eq!(budget, "registration count (registering \"b\")");
            }
            other => panic!("expected ResourceExhausted, got {other:?}"),
        }
        match ferry_core::Error::from(exhausted(Budget::Bytes)) {
            ferry_core::Error::ResourceExhausted {
                requested, held, ..
            } => assert_eq!((requested, held), (20, 30)),
            other => panic!("expected ResourceExhausted, got {other:?}"),
        }
    }

    #[test]
    fn other_failures_keep_the_registry_error_as_source() {
        let e = RegistryError::NoContexts {
            name: "w".into(),
            backend: "none".into(),
        };
        let text = e.to_string();
        match ferry_core::Error::from(e) {
            ferry_core::Error::Register { name, source } => {
                assert_eq!(name, "w");
                assert_eq!(source.to_string(), text);
            }
            other => panic!("expected Register, got {other:?}"),
        }
    }
}
