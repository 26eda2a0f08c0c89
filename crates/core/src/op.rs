//! Operations, and the descriptors of published segments that they name.

use std::fmt;
use std::sync::Arc;

use crate::ids::{Access, SegmentToken};
use crate::memory::MemoryRegion;

/// Bytes of a checksum on the wire (a little-endian `u32`): what an [`OpKind::Checksum`] lands in
/// local memory.
pub const CHECKSUM_LEN: usize = 4;

/// The direction of one op.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum OpKind {
    /// Copy remote bytes into local memory.
    Read,
    /// Copy local bytes into remote memory.
    Write,
    /// Ask the peer for the CRC-32C of `len` remote bytes ([`crate::checksum`]); its
    /// [`CHECKSUM_LEN`] bytes (little-endian) land in local
    /// memory at the op's local offset. Never split into chunks; needs protocol version 2 and a
    /// TCP or io_uring data plane.
    Checksum,
}

impl OpKind {
    /// The remote access right the op needs.
    pub fn needed_access(self) -> Access {
        match self {
            OpKind::Read | OpKind::Checksum => Access::REMOTE_READ,
            OpKind::Write => Access::REMOTE_WRITE,
        }
    }

    /// Local bytes the op touches for `len` remote bytes: `len`, or the digest's length for a
    /// checksum.
    pub fn local_len(self, len: u64) -> u64 {
        match self {
            OpKind::Checksum => CHECKSUM_LEN as u64,
            OpKind::Read | OpKind::Write => len,
        }
    }
}

impl fmt::Display for OpKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            OpKind::Read => "read",
            OpKind::Write => "write",
            OpKind::Checksum => "checksum",
        })
    }
}

/// One op of a request: `len` bytes between a local region and a remote segment.
///
/// The request that carries the op owns `local[local_offset..local_offset+len]` from submission
/// until its outcome says `drained`: nothing else may read (for a READ) or write (for either) the
/// range meanwhile. Transports rely on that to hand the range straight to the kernel or the NIC.
#[derive(Clone, Debug)]
pub struct Op {
    /// Direction.
    pub kind: OpKind,
    /// The local registered memory.
    pub local: Arc<MemoryRegion>,
    /// Offset in `local`.
    pub local_offset: u64,
    /// The remote segment's token.
    pub token: SegmentToken,
    /// Offset in the remote segment.
    pub remote_offset: u64,
    /// Bytes to move.
    pub len: u64,
}

/// A remote key of a published segment on one native context (RDMA: rkey and address per rail).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct RemoteKey {
    /// The context (rail) index on the publishing side.
    pub context: u32,
    /// The address the remote key is valid for (the segment's base).
    pub addr: u64,
    /// The remote key.
    pub rkey: u32,
}

/// A published segment as peers see it in the handshake.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SegmentDesc {
    /// The user's name for the segment (unique per engine).
    pub name: String,
    /// The token ops name it by.
    pub token: SegmentToken,
    /// Its length in bytes.
    pub len: u64,
    /// What peers may do to it.
    pub access: Access,
    /// Per-context remote keys (empty for TCP/io_uring-only segments).
    pub remote_keys: Vec<RemoteKey>,
}
