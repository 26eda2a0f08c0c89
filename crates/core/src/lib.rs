//! Ferry's shared vocabulary: ids, epochs, access rights, memory descriptors, ops, outcomes, the
//! `Transport` trait, the error enum and the wire frames.
//!
//! This crate imports no other Ferry crate and does no I/O of its own. The only `unsafe` code is in
//! [`memory`], which owns the raw registered bytes that transports read and write.
//!
//! Features: `__mock` (test-only) exposes mockall mocks of the traits in [`transport`]
//! (`MockTransport`, `MockChannel`, `MockSegmentTable`, `MockHandshakeResponder`).
#![deny(unsafe_op_in_unsafe_fn)]

pub mod auth;
pub mod backoff;
pub mod checksum;
pub mod countdown;
pub mod dealer;
pub mod error;
pub mod handshake;
pub mod identity;
pub mod ids;
pub mod memory;
pub mod op;
pub mod outcome;
pub mod queue;
pub mod share;
pub mod stream;
pub mod stream_cap;
pub mod transport;
pub mod wire;

pub use error::{Error, Result};
pub use ids::{Access, Epoch, PeerId, SegmentToken};
pub use memory::{
    AllocError, DeviceNative, DevicePlacement, MemoryRegion, OutOfBounds, PAGE_ALIGN, Placement,
    SHARED_HEADER, SHARED_REVOKED_AT, SharedMemory, check_range, shared_header_at,
};
pub use op::{Op, OpKind, RemoteKey, SegmentDesc};
pub use outcome::{
    Failure, FailureKind, Ledger, Outcome, RemoteEffect, RemoteStatus, ReplayPlan, RequestControl,
};
pub use transport::{
    BoxFuture, Channel, FileSource, HandshakeResponder, PeerInfo, SegmentLease, SegmentTable,
    Transport, TransportKind,
};
pub use wire::{TransportOffer, VersionRange};
