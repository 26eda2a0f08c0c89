//! `cargo xtask`: the project's automation, one module per task.
//!
//! `main` only dispatches; each task lives in its own module.
#![forbid(unsafe_code)]

mod bench;
mod bench_broadcast;
mod bench_latency;
mod bench_uring;
mod bindgen;
mod ci;
mod iperf3;
mod soft_roce;
mod util;

use anyhow::{Result, bail};

const USAGE: &str = "\
usage: cargo xtask <task> [args]

tasks:
  ci                     fmt check, clippy -D warnings, all tests, docs with warnings denied
  bench tcp [--total BYTES] [--repeat N]
                         ferry bench (TCP) against iperf3 on loopback, 1 and 2 streams, with ratios
  bench uring [...]      the io_uring transport against iperf3 -Z and fio (xtask/src/bench_uring.rs)
  bench latency [--ops N] [--repeat N]
                         64-byte round trips of ferry bench against a bare TCP ping-pong
  bench broadcast [--receivers N] [--size BYTES] [--rate TC_RATE] [--chunk-size BYTES] [--skip-baseline] [--no-build]
                         ferry publish/pull: 1 source, N receivers in shaped network namespaces
  bindgen [--check]      regenerate (or compare) crates/verbs-sys/src/sys/ from infiniband/verbs.h
  soft-roce [--host] [--require] [--require-bench] [--keep-share DIR]
                         RDMA tests, perftest reference and ferry bench on soft-RoCE (rdma_rxe)
                         in a QEMU guest (or on the host with --host); see xtask/src/soft_roce/
";

fn main() -> Result<()> {
    let mut args = std::env::args().skip(1);
    let task = args.next().unwrap_or_default();
    let rest: Vec<String> = args.collect();
    match task.as_str() {
        "ci" => ci::run(&rest),
        "bench" => bench::run(&rest),
        "soft-roce" => soft_roce::run(&rest),
        "bindgen" => bindgen::run(&rest),
        "" | "help" | "-h" | "--help" => {
            print!("{USAGE}");
            Ok(())
        }
        other => {
            eprint!("{USAGE}");
            bail!("unknown task `{other}`")
        }
    }
}
