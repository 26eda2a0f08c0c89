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

use ferry_core::wire::TransportOffer;

/// Bytes of one address in an address block.
pub const ADDR_LEN: usize = 8;

/// The probe copy worked; the eight bytes read follow.
pub const PROBE_OK: u8 = 1;
/// The probe copy failed; the errno follows.
pub const PROBE_FAILED: u8 = 2;

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
