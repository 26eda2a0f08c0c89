//! `cargo xtask`: the project's automation, one module per task.
//!
//! `main` only dispatches; each task lives in its own module.
#![forbid(unsafe_code)]

mod bench;
mod bench_ab;
mod bench_broadcast;
mod bench_compat;
mod bench_cpu;
mod bench_latency;
mod bench_ray;
mod bench_rl;
mod bench_same_host;
mod bench_small;
mod bench_uring;
mod bindgen;
mod ci;
mod contracts;
mod frameworks;
mod fresh_machine;
mod fuzz;
mod gpu_check;
mod iperf3;
mod module_loops;
mod mutants;
mod python;
mod sizes;
mod soft_roce;
mod stress;
mod tidy;
mod util;

use anyhow::{Result, bail};

const USAGE: &str = "\
usage: cargo xtask <task> [args]

tasks:
  ci [--step NAME]       fmt check, tidy, clippy -D warnings, all tests, docs with warnings denied,
                         the Python package's pytest suite, the frameworks, soft-RoCE
  bench tcp [--total BYTES] [--repeat N]
                         ferry bench (TCP) against iperf3 on loopback, 1 and 2 streams, with ratios
  bench uring [...]      the io_uring transport against iperf3 -Z and fio (xtask/src/bench_uring.rs)
  bench latency [--ops N] [--repeat N]
                         64-byte round trips of ferry bench against a bare TCP ping-pong
  bench small [--repeat N] [--ops N] [--total BYTES] [--blocks N] [--block BYTES] [--no-mooncake]
                         small ops: 64 B round trip vs a TCP ping-pong, 64 KiB ops vs iperf3,
                         a scattered KV-cache batch vs one op of its bytes, Mooncake's TCP batch
  bench ab --baseline BIN [--total BYTES] [--ops N] [--repeat N] [--only TEXT] [--two-process] [--no-build]
                         this tree's ferry bench against another build, alternating rounds
  fresh-machine [--full] [--rebuild-base] [--mounts-only]
                         a bare Debian 12 root (debootstrap): .ci/packages, then clippy, all tests
                         and the etcd feature inside it; run before changing native dependencies
                         or .ci/ (xtask/src/fresh_machine.rs). Its mounts live in its own
                         namespace; --mounts-only makes them on an empty root and waits
  frameworks [--only NAME] [--provision]
                         Ray, verl and vLLM from the package index in cached venvs
                         (<target>/frameworks-venv, <target>/vllm-venv), and Ferry's tests
                         against them with their FERRY_REQUIRE_* set (xtask/src/frameworks.rs)
  wheel                  the Python package as an abi3 wheel (release, maturin) in <target>/wheels
  fuzz [--cases N]       the property tests of every parser of outside input, N cases each
                         (default 100000; xtask/src/fuzz.rs)
  bench python [--total BYTES] [--repeat N]
                         1 MiB READs through the Python package against the Rust CLI, alternating
  bench mooncake [--total BYTES] [--repeat N]
                         the Mooncake API on Mooncake's own wheel and on Ferry's, alternating
                         rounds: batch sync WRITE/READ of 32 blocks, and 4 KiB against Ferry's API
  bench nixl [--total BYTES] [--repeat N]
                         the NIXL API on NIXL's wheel (UCX over TCP, UCX's defaults) and on Ferry's:
                         READ of 64 blocks of 64 KiB and 1 MiB by index, rounds in turn
  bench register [--sizes 64MiB,1GiB] [--repeat N]
                         register's cost: first, a repeat of the same pages, per GiB, per rail count
  bench load [--plane tcp|uring|both] [--peers N] [--stalled N] [--seconds S] [--rounds R]
                         hundreds of peers against one server, some stalled behind a fault proxy:
                         ops/s, p50/p99, the server's memory and threads (xtask/src/stress.rs)
  bench idle [--plane tcp|uring|both] [--clients N] [--probes N]
                         many idle clients on one server: its threads, memory and descriptors,
                         and a new peer's first 64 B round trip beside them
  bench fanout [--plane tcp|uring|both] [--peers N] [--streams N]
                         one client engine opening N peers of S streams each: its threads,
                         memory and descriptors (the client side of a fan-out)
  bench broadcast [--receivers N] [--size BYTES] [--rate TC_RATE] [--chunk-size BYTES] [--skip-baseline] [--memory [--rounds R]] [--straggler RATE] [--stripes N] [--no-killed] [--bin PATH] [--no-build]
                         ferry publish/pull: 1 source, N receivers in shaped network namespaces
  bench ray [--no-build] [--mib N] [--parts N] [--rounds N] [--modes A,B] [--readers N] [--limit S] [--cluster | --fleet [--rate TC_RATE]]
                         Ray's tensor transports (object store, NIXL real and on Ferry, FERRY,
                         FERRY_RELAY) on one host, alternating rounds; --cluster: two nodes in
                         namespaces; --fleet: one object, N readers on N shaped nodes
                         (xtask/src/bench_ray.rs)
  bench rl [--no-build] [--mib N] [--bucket-mib N] [--receivers N] [--rounds N] [--modes A,B]
                         RL weight sync, 1 trainer to N receivers on one host: ferry.verl against
                         one receiver alone and a ferry.mooncake chain (xtask/src/bench_rl.rs)
  mutants [--file TEXT]... [--list]
                         cargo-mutants over the code that checks outside input (xtask/src/mutants.rs)
  faults [--check]       the fault suite (tests/tests/faults.rs); writes its table into docs/faults.md
  soak [--minutes N | --seconds N] [--plane tcp|uring] [--workers N]
                         a mixed workload through proxy faults, every byte checked; fails if
                         memory, descriptors or threads grow past warm-up (default 10 minutes)
  module-loops [--edges] fails on an import loop between the top-level modules of a crate (every
                         crate but net, one file) or between the modules of a module
                         folder (transport-uring's server/ and client/), naming it (also a test
                         per crate: xtask/src/module_loops.rs)
  tidy                   the docs name only what the tree holds: backticked paths, Rust paths, calls
                         and types in README.md and docs/*.md, the sections docs cite, names in
                         code comments, a layout row per crate in docs/architecture.md; no library
                         source file (crates/*/src, xtask/src) over 1,200 lines before its
                         tests, no fn over 150 lines, each opening with its //! contract (also
                         tests: xtask/src/tidy.rs, xtask/src/sizes.rs, xtask/src/contracts.rs)
  bindgen [--check]      regenerate (or compare) crates/verbs-sys/src/sys/ from infiniband/verbs.h
  gpu-check --out DIR [--allow-fake]
                         on a GPU machine: release build, doctor, real-driver GPU tests, GPU vs host
                         GB/s over TCP and io_uring, raw cuMemcpy rates, a file into GPU memory;
                         the table as JSON in DIR (fails at once without a GPU; --allow-fake: a dry
                         run against the driver FERRY_LIBCUDA names)
  gpu-check --bundle DIR the same, prebuilt for a GPU machine without cargo: DIR/run.sh there
  soft-roce [--host] [--require] [--require-bench] [--keep-share DIR] [--only TEXT] [--repeat N]
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
        "module-loops" => module_loops::run(&rest),
        "tidy" => tidy::run(&rest),
        "fuzz" => fuzz::run(&rest),
        "wheel" => python::wheel(&rest),
        "frameworks" => frameworks::run(&rest),
        "fresh-machine" => fresh_machine::run_task(&rest),
        "mutants" => mutants::run(&rest),
        "faults" => stress::faults(&rest),
        "soak" => stress::soak(&rest),
        "gpu-check" => gpu_check::run(&rest),
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
