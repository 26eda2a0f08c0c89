//! Facility gates: what a test does when something it needs is missing here.
//!
//! Each facility has a variable `FERRY_REQUIRE_<FACILITY>`. `1` makes a missing facility a test
//! failure, `0` lets the test skip; unset, an ordinary test skips (with the reason printed) and an
//! `#[ignore]`d hardware test fails, since running it at all asked for its hardware.

use std::fmt::Display;

/// io_uring with the opcodes the data plane needs, and the optional ones the tests cover (SEND_ZC,
/// SPLICE): a kernel that refuses it (seccomp, `kernel.io_uring_disabled`) or predates them.
pub const URING: &str = "FERRY_REQUIRE_URING";
/// Root (uid 0, with its capabilities): tests of what a privileged process may and may not do,
/// such as a same-host server whose client execs a set-user-id program.
pub const ROOT: &str = "FERRY_REQUIRE_ROOT";
/// Network namespaces and veth links (`ip netns`; root).
pub const NETNS: &str = "FERRY_REQUIRE_NETNS";
/// `libibverbs.so.1` loadable (the rdma-core user space, no device needed).
pub const IBVERBS: &str = "FERRY_REQUIRE_IBVERBS";
/// The verbs devices the `#[ignore]`d hardware tests are pointed at (`FERRY_RDMA_TEST_DEVICES`,
/// `FERRY_TEST_RDMA_DEVICE`); soft-RoCE `rxe` counts.
pub const RDMA: &str = "FERRY_REQUIRE_RDMA";
/// Programs the tests run: `cc` (fake libraries), `python3` (fixture generator).
pub const TOOLS: &str = "FERRY_REQUIRE_TOOLS";
/// A readable `/sys`.
pub const SYSFS: &str = "FERRY_REQUIRE_SYSFS";
/// More than one CPU to run on (thread placement tests).
pub const CPUS: &str = "FERRY_REQUIRE_CPUS";
/// An etcd server binary (`etcd`, Debian's `etcd-server`) the etcd discovery tests start on a
/// loopback port, and a build with the broadcast crate's `etcd` feature.
pub const ETCD: &str = "FERRY_REQUIRE_ETCD";
/// A Prometheus server binary (`prometheus`, Debian's `prometheus`) the metrics test starts on a
/// loopback port to scrape `ferry serve --metrics`.
pub const PROMETHEUS: &str = "FERRY_REQUIRE_PROMETHEUS";

/// Whether `var` (one of this module's constants) makes its facility required: `1` yes, `0` no,
/// unset (or anything else) `default`.
pub fn required(var: &str, default: bool) -> bool {
    match std::env::var(var).as_deref() {
        Ok("1") => true,
        Ok("0") => false,
        _ => default,
    }
}

/// For a test whose facility is missing (`why` says what is missing): panics if `var` is `1`,
/// else prints that the test skips. The caller returns right after.
///
/// ```ignore
/// if let Some(why) = probe_kernel().unusable_reason() {
///     return require_or_skip(URING, format!("io_uring unusable here: {why}"));
/// }
/// ```
#[track_caller]
pub fn require_or_skip(var: &str, why: impl Display) {
    gate(var, false, why);
}

/// For an `#[ignore]`d test run without its hardware: panics unless `var` is `0`, so a hardware
/// run that found no hardware does not pass as if it had tested something.
#[track_caller]
pub fn require_unless_allowed(var: &str, why: impl Display) {
    gate(var, true, why);
}

#[track_caller]
fn gate(var: &str, default: bool, why: impl Display) {
    if required(var, default) {
        if default {
            panic!("{why} ({var}=0 lets this test skip instead)");
        }
        panic!("{why}, but {var}=1 says this machine has it");
    }
    if default {
        eprintln!("skipped: {why} ({var}=0)");
    } else {
        eprintln!("skipped: {why} ({var}=1 makes this a failure)");
    }
}
