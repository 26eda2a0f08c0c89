//! Ferry: a transfer engine that moves bytes between registered memory over RDMA, io_uring or TCP.

pub mod discovery;
