//! Ferry's cross-crate test suite lives in this package's `tests/` (two processes, interop between
//! the data planes, cut links and killed peers); this library is what every crate's tests share:
//!
//! - [`require_or_skip`] and [`require_unless_allowed`]: one rule for a test whose facility is
//!   missing (io_uring refused, no network namespaces, no libibverbs, no RDMA device, no `cc`). It
//!   skips with the reason printed, or fails where `FERRY_REQUIRE_<FACILITY>` says the facility is
//!   required (`.ci/run` sets them). `#[ignore]`d hardware tests fail unless told they may skip.
//! - [`Netns`]: a network namespace joined to this one by a veth link that can be cut.
//! - [`rxe_flap`]: a second soft-RoCE pair on a veth link of its own, whose link a test takes
//!   down and up (a port flap) in the soft-RoCE guest.
//! - [`fake_cuda()`]: Ferry's fake CUDA driver (a C library built with `cc`, backed by host
//!   memory, with failures a test switches on), loaded in place of `libcuda.so.1` by path.
//! - [`Fleet`]: namespaces joined by one bridge (hosts that reach each other), links optionally
//!   shaped by TBF.
//! - [`Census`]: a process's resident memory, descriptors and threads from `/proc`, and
//!   [`settle`] back to a baseline: the fault suite, the load bench and the soak count leaks
//!   with it.
//! - [`pattern`]: bytes known at every position, to check what a transfer moved (old, new or
//!   corrupt).
//! - [`FaultRow`]: a row of the fault suite's table (`cargo xtask faults`).
//! - [`FaultProxy`]: a TCP proxy on loopback that cuts, stalls, slows, resets and half-closes the
//!   connections it forwards, switched at runtime.
//!
//! It depends on no crate of ours, so any crate takes it as a dev-dependency.

mod census;
pub mod fake_cuda;
mod fault_table;
mod fleet;
mod netns;
pub mod pattern;
pub mod proxy;
mod require;
pub mod rxe_flap;

pub use census::{Census, settle, thread_names};
pub use fake_cuda::{FakeCuda, FakeVariant, fake_cuda};
pub use fault_table::{FaultRow, TABLE_VAR};
pub use fleet::Fleet;
pub use netns::Netns;
pub use proxy::{Dir, Fault, FaultProxy, ProxyCounters, RuleId, Scope};
pub use require::{
    CPUS, ETCD, IBVERBS, NETNS, PROMETHEUS, RDMA, ROOT, SYSFS, TOOLS, URING, require_or_skip,
    require_unless_allowed, required,
};
