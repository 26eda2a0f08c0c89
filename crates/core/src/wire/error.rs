//! Why a frame could not be decoded ([`WireError`]) or encoded ([`EncodeError`]).

/// Why a frame could not be decoded.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum WireError {
    /// The input ended inside a field.
    #[error("truncated: needed {needed} more bytes for {field}")]
    Truncated {
        /// The field being read.
        field: &'static str,
        /// Bytes missing.
        needed: usize,
    },
    /// The frame does not start with [`MAGIC`](super::MAGIC).
    #[error("bad magic {0:02x?}")]
    BadMagic([u8; 4]),
    /// A length or count exceeds its limit.
    #[error("{field} is {value}, limit {limit}")]
    TooLarge {
        /// The field.
        field: &'static str,
        /// Its value.
        value: u64,
        /// The limit.
        limit: u64,
    },
    /// An enum field holds an unknown code.
    #[error("unknown {field} code {code}")]
    UnknownCode {
        /// The field.
        field: &'static str,
        /// The code.
        code: u64,
    },
    /// A name is not UTF-8.
    #[error("{field} is not UTF-8")]
    NotUtf8 {
        /// The field.
        field: &'static str,
    },
    /// Bytes were left over after the body.
    #[error("{extra} trailing bytes in a {kind} frame")]
    Trailing {
        /// The frame kind.
        kind: &'static str,
        /// Bytes left.
        extra: usize,
    },
    /// A frame arrived where another was expected.
    #[error("unexpected {found} frame, expected {expected}")]
    Unexpected {
        /// What arrived.
        found: &'static str,
        /// What was expected.
        expected: &'static str,
    },
}

/// Encoding failed because a field exceeds what the wire (and the peer's decoder) accepts.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("cannot encode: {field} is {value}, limit {limit}")]
pub struct EncodeError {
    /// The field.
    pub field: &'static str,
    /// Its value.
    pub value: u64,
    /// The limit.
    pub limit: u64,
}

pub(super) fn limit(field: &'static str, value: usize, max: usize) -> Result<(), EncodeError> {
    if value > max {
        Err(EncodeError {
            field,
            value: value as u64,
            limit: max as u64,
        })
    } else {
        Ok(())
    }
}
