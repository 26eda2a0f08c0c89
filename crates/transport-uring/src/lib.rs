//! Ferry's TCP wire protocol driven by io_uring, and file segments.
//!
//! This module set starts with the kernel probe: which io_uring opcodes this kernel offers, so the
//! engine can choose io_uring where it can run and fall back to TCP with a reason where it cannot.
#![deny(unsafe_op_in_unsafe_fn)]

pub mod probe;

pub use probe::{OpcodeSupport, UringProbe, probe_kernel};
