//! Ferry: a transfer engine that moves bytes between registered memory over RDMA, io_uring or TCP.

pub mod capabilities;
pub mod discovery;

/// sysfs topology: NICs, GPUs, distance classes, NIC assignment and filters (`ferry-topology`).
pub use topology;
