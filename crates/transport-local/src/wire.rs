//! What the same-host plane adds to the data-stream protocol of `ferry_core::stream`.
//!
//! A same-host stream carries the same request and response headers as a TCP stream, with one
//! difference: no payload ever crosses the socket. In its place, every request header (and a
//! vectored request's piece table) is followed by its *address block*: the little-endian
//! address, in the client's address space, of the chunk's local range (one per piece for a
//! vectored request; a CHECKSUM's and a refused request's is sent and ignored). The server
//! copies between the checked segment range and that address before it answers, so an
//! accepted READ's response is followed by nothing: its bytes are already in place. A
//! CHECKSUM's response still carries its four bytes.
//!
//! Attaching a stream is the handshake's `StreamAttach` (or its authenticated form) over the
//! server's abstract Unix socket, answered `StreamAccept`; then the *probe*: the client sends
//! the address of eight bytes of its memory, and the server answers one status byte
//! ([`PROBE_OK`] and the eight bytes it read there, or [`PROBE_FAILED`] and the kernel's errno,
//! little-endian, in the next four). A stream is used only after the client found its own bytes
//! in the answer.
//!
//! *CUDA IPC streams.* A client that can grant GPU buffers by CUDA IPC attaches with the
//! transport code [`CUDA_IPC_CODE`] instead of the plane's own. A server that cannot open CUDA
//! IPC handles (no driver, no IPC entry points, a build without CUDA), and every server older
//! than this protocol, refuses that attach with a `Reject`; the client then attaches with the
//! plane's code and its GPU buffers take the host stage. On a CUDA IPC stream an address whose
//! top bit is set ([`IPC_MARK`]) is followed by a *grant* of [`IPC_REF_LEN`] bytes: the 64-byte
//! `CUipcMemHandle` of the client's allocation, then the buffer's offset in that allocation and
//! its length (little-endian u64 each); the server copies with the driver between the opened
//! handle and the checked segment range. No user-space address has that bit set, so an address
//! is never mistaken for a grant; on a stream attached with the plane's own code the bit means
//! nothing (the copy to such an address fails and ends the stream).
//!
//! *The ring.* A client that can take the request/answer ring attaches with [`RING_BIT`] set in
//! its transport code (on the plane's code or on [`CUDA_IPC_CODE`]); a server older than the
//! ring refuses that code with a `Reject` and the client attaches without it. After a probe
//! that worked, the server sends one byte on the socket: [`RING_OFFER`] with the ring's memfd
//! attached (`SCM_RIGHTS`, sealed against resizing, `crate::ring::SHM_LEN` bytes), or
//! [`RING_NONE`] (it could not make one); the client answers one byte, [`RING_TAKEN`] (it mapped
//! it) or [`RING_DECLINED`]. On a stream that took the ring, every byte the stream protocol
//! would have sent on the socket goes through the ring instead (requests one way, answers the
//! other), and the socket carries nothing more: either side shuts it down to end the stream,
//! as before. A ring stream may also carry an op's bytes *inline*: an address block entry
//! with [`INLINE_MARK`] set (and not [`IPC_MARK`]) names no address; its low 32 bits are the
//! bytes that follow it in the ring (a WRITE's payload, at most [`INLINE_MAX`]; 0 for a READ,
//! whose accepted response is then followed by its payload in the ring). The server copies
//! inline bytes between the ring and the checked segment range, and never touches the
//! client's memory for them.
//!
//! *Share streams.* A client that can map shared registrations attaches one more connection
//! with the transport code [`SHARE_CODE`] (a server older than shared registrations refuses it
//! with a `Reject`, and the channel never maps one). After its probe it carries no data
//! requests, only *share requests*: the eight little-endian bytes of a segment's token. The
//! server resolves the token through the peer's view, as for a request, and answers one byte:
//! [`SHARE_GRANTED`] with the registration's memfd attached (`SCM_RIGHTS`), followed by
//! [`SHARE_GRANT_LEN`] bytes (the grant, [`SHARE_READ_ONLY`] or [`SHARE_READ_WRITE`]; the
//! segment's offset in the region, its length, and the region's length, little-endian u64
//! each), or [`SHARE_REFUSED`] followed by one byte, the refusal's code
//! (`ferry_core::share::ShareRefusal::code`). The memfd holds the region's bytes from offset
//! 0, rounded up to a page, then a header page whose first `u32` is the revoked word
//! (`ferry_core::SHARED_REVOKED_AT`).

use ferry_core::wire::TransportOffer;

/// Bytes of one address in an address block.
pub const ADDR_LEN: usize = 8;

/// The probe copy worked; the eight bytes read follow.
pub const PROBE_OK: u8 = 1;
/// The probe copy failed; the errno follows.
pub const PROBE_FAILED: u8 = 2;

/// The transport code a stream that may carry CUDA IPC grants attaches with (the plane's code,
/// 4, with 0x100 set).
pub const CUDA_IPC_CODE: u16 = 0x0104;

/// The top bit of an address: a grant of [`IPC_REF_LEN`] bytes follows (CUDA IPC streams only).
pub const IPC_MARK: u64 = 1 << 63;

/// Bytes of a CUDA IPC grant: the handle (64), the offset (8), the length (8).
pub const IPC_REF_LEN: usize = 64 + 16;

/// Set in an attach's transport code: the client takes the request/answer ring.
pub const RING_BIT: u16 = 0x0200;

/// The server's byte after the probe: the ring's memfd is attached.
pub const RING_OFFER: u8 = 1;
/// The server's byte after the probe: no ring (the stream stays on the socket).
pub const RING_NONE: u8 = 2;
/// The client's answer: it mapped the ring; the stream runs on it from now on.
pub const RING_TAKEN: u8 = 1;
/// The client's answer: it did not map the ring; the stream stays on the socket.
pub const RING_DECLINED: u8 = 2;

/// Bit 62 of an address block entry on a ring stream: no address, the op's bytes go through
/// the ring (the low 32 bits: bytes following the entry).
pub const INLINE_MARK: u64 = 1 << 62;

/// The most bytes an op moves inline.
pub const INLINE_MAX: usize = 8 << 10;

/// The transport code a share stream attaches with (the plane's code, 4, with 0x400 set).
pub const SHARE_CODE: u16 = 0x0404;

/// A share request's answer: granted, the memfd attached, [`SHARE_GRANT_LEN`] bytes follow.
pub const SHARE_GRANTED: u8 = 1;
/// A share request's answer: refused, the refusal's code follows.
pub const SHARE_REFUSED: u8 = 2;
/// Bytes after [`SHARE_GRANTED`]: the grant, then three little-endian u64.
pub const SHARE_GRANT_LEN: usize = 1 + 24;
/// A grant: mapped read-only (the memfd is sealed against writes).
pub const SHARE_READ_ONLY: u8 = 1;
/// A grant: mapped read-write.
pub const SHARE_READ_WRITE: u8 = 2;

/// Whether a client sends a chunk of `len` bytes inline on a ring stream (READs and WRITEs of
/// host memory, one chunk, at most [`INLINE_MAX`]): the rule both sides of a ring stream read
/// a response by.
pub fn inline(ring: bool, kind: ferry_core::OpKind, len: u64, host: bool) -> bool {
    ring && host
        && len <= INLINE_MAX as u64
        && matches!(kind, ferry_core::OpKind::Read | ferry_core::OpKind::Write)
}

/// The transport code of the same-host plane on the wire (what its streams attach with).
pub fn local_code() -> u16 {
    TransportOffer::Local {
        boot_id: [0; 16],
        pid: 0,
        streams: 0,
        socket: String::new(),
    }
    .code()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cuda_ipc_code_is_no_other_plane_s() {
        assert_ne!(CUDA_IPC_CODE, local_code());
        assert_ne!(SHARE_CODE, local_code());
        assert_ne!(SHARE_CODE & !RING_BIT, CUDA_IPC_CODE);
        for offer in [
            TransportOffer::Tcp {
                streams: 0,
                port: 0,
            },
            TransportOffer::Uring {
                streams: 0,
                port: 0,
                zero_copy: false,
            },
            TransportOffer::Rdma { rails: Vec::new() },
        ] {
            assert_ne!(offer.code(), CUDA_IPC_CODE);
        }
    }
}
