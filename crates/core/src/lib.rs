//! Ferry's shared vocabulary: ids, epochs, access rights, memory descriptors, ops, outcomes, the
//! `Transport` trait, the error enum and the wire frames.
//!
//! This crate imports no other Ferry crate and does no I/O of its own. The only `unsafe` code is in
//! [`memory`], which owns the raw registered bytes that transports read and write.
#![deny(unsafe_op_in_unsafe_fn)]

pub mod ids;
pub mod memory;

pub use ids::{Access, Epoch, PeerId, SegmentToken};
pub use memory::{AllocError, MemoryRegion, OutOfBounds, PAGE_ALIGN, check_range};
