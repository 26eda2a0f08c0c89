//! GPU memory in the engine: registering device memory, publishing it to peers, and staging it
//! through pinned host buffers over the TCP and io_uring data planes.
//!
//! Device memory is never a `MemoryRegion`, so it never reaches a transport: an op on a
//! [`GpuRegistration`] becomes host ops on buffers of the staging pool plus driver copies
//! (client side), and a published device segment is a `FileSource` whose positioned reads and
//! writes are device copies through the servers' bounded staging path (serving side).
//!
//! The client pipeline: a request's device ops are cut into chunks of one pool buffer; at most
//! as many chunks as there are buffers are in flight, so chunk k+1's device-to-host copy runs
//! while chunk k is on the wire (WRITE), and chunk k's host-to-device copy runs while chunk k+1
//! is received (READ). Buffers are allocated once, when the first staged request needs them;
//! no chunk allocates a buffer.

mod config;
mod nics;
mod pipeline;
mod pool;
mod register;
#[cfg(test)]
mod tests;

pub use crate::describe::{GpuRegistrationDescription, StagingDescription};
pub(crate) use config::GpuConfig;
pub use config::{STAGING_BUFFER_SIZE, STAGING_BUFFERS, Staging};
pub(crate) use nics::{choose_nics, rail_device};
pub(crate) use pipeline::{HostRunner, prepare, run};
pub(crate) use pool::GpuState;
pub(crate) use register::Direct;
pub use register::GpuRegistration;
