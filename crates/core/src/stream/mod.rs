//! The data-stream protocol that the TCP and io_uring data planes share on the wire, written once
//! and with no I/O (the quinn-proto model): the drivers (`ferry-transport-tcp` on tokio,
//! `ferry-transport-uring` on rings) own sockets, rings, threads and buffers, and ask this module
//! what each byte means.
//!
//! - [`ClientStream`]: one client stream's sequence numbers, its chunks in flight (bounded by a
//!   depth), how many WRITE responses the server may hold back ([`AckPolicy`]), the matching and
//!   validation of responses, and what a broken stream fails or hands on.
//! - [`ServerStream`]: one served stream's decode, resolution against the [`SegmentTable`](crate::SegmentTable),
//!   access and bounds checks, refusals, and when a WRITE's response may be held back.
//! - A served stream holds its place under its key name's cap
//!   ([`StreamPermit`](crate::stream_cap::StreamPermit)).
//! - [`Chunk`] and [`ChunkOwner`]: a chunk of a request and how its resolution is recorded in the
//!   request's ledger, the same for every driver.
//!
//! The protocol: a stream carries request headers ([`DataRequest`](crate::wire::DataRequest),
//! a WRITE's payload right behind its header) one way and response headers
//! ([`DataResponse`](crate::wire::DataResponse), an accepted READ's payload right behind it) the
//! other way, in request order. A CHECKSUM request (protocol version 2) carries no payload; its
//! accepted response carries the 4-byte CRC-32C of the named range. A response may also acknowledge the WRITEs just before it whose
//! responses the server held back, as far as their requests allowed. A response that does not
//! match the oldest chunk in flight breaks the stream: everything in flight is then lost
//! (`PeerLost`, uncertain for WRITEs), and chunks not yet posted go to the channel's other
//! streams ([`Dealer`](crate::dealer::Dealer)).
//!
//! A vectored request (protocol version 3, [`VectoredRequest`](crate::wire::VectoredRequest))
//! names many pieces (segment, offset, length), all READs or all WRITEs of one request, and moves
//! their bytes as one payload: the server checks the pieces in order and performs the longest
//! prefix it accepts, and its response says how many pieces that was and why the next one was
//! refused, so every piece (one whole op) is resolved as a chunk of its own. Only peers whose
//! common version is at least 3 are sent one; the dealer groups small ops
//! ([`deal_ops`](crate::dealer::deal_ops) with a group budget).
//!
//! The simulated pair in this module's tests joins client and server endpoints in memory, with
//! arbitrary splits of the byte streams, streams served in random order and streams lost midway.

mod client;
mod server;
#[cfg(test)]
mod sim;

pub use client::{
    AckPolicy, Chunk, ChunkOwner, ClientStream, LocalRange, Outgoing, Post, Resolution, Violation,
    Work,
};
pub use server::{
    Action, CHECKSUM_RESPONSE_LEN, ServerStream, Target, accepted, checksum_response, refused,
    request_seq,
};
