//! `cargo xtask bench tcp`: Ferry's TCP transport against iperf3 on loopback, in one run.
//!
//! For one and two streams, with 1 MiB ops and the same number of bytes, it runs iperf3 (one
//! process for one stream; two processes in parallel for two streams, since iperf3 3.12 runs all
//! `-P` streams in one thread) and `ferry bench` (release build, its own in-process loopback
//! server) back to back, in `--repeat` rounds. Each ferry run is divided by the iperf3 run of its
//! round (the machine's speed drifts by more than 10% between rounds on a shared host), and the
//! table shows median rates and the median and range of those ratios. Target: at least 0.9 for
//! both.
//!
//! Options: `--total BYTES` (default 4GiB per run), `--repeat N` (default 5).
//! `cargo xtask bench uring` runs the io_uring comparison (`bench_uring.rs`).

use std::thread::sleep;
use std::time::Duration;

use anyhow::{Context, Result, bail};

use crate::util::{
    cargo, ensure_tool, ferry_bench_json, median, run as run_loud, total_and_repeat,
};

const USAGE: &str = "usage: cargo xtask bench tcp [--total BYTES] [--repeat N]
       cargo xtask bench uring [options of bench_uring]
       cargo xtask bench latency [--ops N] [--repeat N]
       cargo xtask bench small [--repeat N] [--ops N] [--total BYTES] [--blocks N] [--block BYTES] [--no-mooncake]
       cargo xtask bench ab --baseline BIN [--total BYTES] [--ops N] [--repeat N] [--only TEXT] [--two-process] [--no-build]
       cargo xtask bench cpu [--total BYTES] [--repeat N] [--transport auto|uring|tcp]
       cargo xtask bench python [--total BYTES] [--repeat N]
       cargo xtask bench mooncake [--total BYTES] [--repeat N]
       cargo xtask bench nixl [--total BYTES] [--repeat N]
       cargo xtask bench same-host [--total BYTES] [--repeat N] [--python PY --ferry-path DIR --nixl-site DIR] [--baseline-path DIR] [--shared] [--no-net]
       cargo xtask bench register [--sizes 64MiB,1GiB] [--repeat N]
       cargo xtask bench load [--plane tcp|uring|both] [--peers N] [--stalled N] [--seconds S] [--rounds R]
       cargo xtask bench idle [--plane tcp|uring|both] [--clients N] [--probes N]
       cargo xtask bench fanout [--plane tcp|uring|both] [--peers N] [--streams N]
       cargo xtask bench broadcast [--receivers N] [--size BYTES] [--rate TC_RATE] [--chunk-size BYTES]
       [--skip-baseline] [--no-build]
       cargo xtask bench rl [--no-build] [options of bench_rl.py]
       cargo xtask bench ray [--no-build] [options of bench_ray.py]";

/// Dispatches `cargo xtask bench <what>`.
pub(crate) fn run(args: &[String]) -> Result<()> {
    match args.first().map(String::as_str) {
        Some("tcp") => tcp(&args[1..]),
        Some("uring") => crate::bench_uring::run(&args[1..]),
        Some("latency") => crate::bench_latency::run(&args[1..]),
        Some("small") => crate::bench_small::run(&args[1..]),
        Some("ab") => crate::bench_ab::run(&args[1..]),
        Some("cpu") => crate::bench_cpu::run(&args[1..]),
        Some("python") => crate::python::bench(&args[1..]),
        Some("mooncake") => crate::bench_compat::mooncake(&args[1..]),
        Some("nixl") => crate::bench_compat::nixl(&args[1..]),
        Some("same-host") => crate::bench_same_host::run(&args[1..]),
        Some("broadcast") => crate::bench_broadcast::run(&args[1..]),
        Some("rl") => crate::bench_rl::run(&args[1..]),
        Some("ray") => crate::bench_ray::run(&args[1..]),
        Some("load") => crate::stress::load(&args[1..]),
        Some("idle") => crate::stress::idle(&args[1..]),
        Some("fanout") => crate::stress::fanout(&args[1..]),
        Some("register") => register(&args[1..]),
        _ => {
            eprintln!("{USAGE}");
            bail!("bench: say which transport to measure")
        }
    }
}

/// `cargo xtask bench register`: builds `register_bench` (release) and runs it with `args`;
/// it prints the table of docs/performance.md, "Registration".
fn register(args: &[String]) -> Result<()> {
    run_loud(cargo().args([
        "build",
        "--release",
        "-p",
        "ferry-benches",
        "--bin",
        "register_bench",
    ]))?;
    run_loud(std::process::Command::new(crate::util::release_bin("register_bench")).args(args))
}

fn free_port() -> Result<u16> {
    let l = std::net::TcpListener::bind("127.0.0.1:0").context("finding a free port")?;
    Ok(l.local_addr()?.port())
}

/// `n` iperf3 client/server pairs in parallel, `total` bytes over all; returns GB/s (10^9 B/s):
/// the bytes received over the longest receiver's time.
fn iperf3(n: usize, total: u64) -> Result<f64> {
    let mut servers = Vec::new();
    let mut ports = Vec::new();
    for _ in 0..n {
        let port = free_port()?;
        servers.push(crate::iperf3::server(port)?);
        ports.push(port);
    }
    sleep(Duration::from_millis(300));
    let (bytes, seconds) = crate::iperf3::clients(&ports, total / n as u64, &[])?;
    for mut s in servers {
        let _ = s.wait();
    }
    if seconds <= 0.0 {
        bail!("iperf3 reported no time");
    }
    Ok(bytes / seconds / 1e9)
}

/// GB/s of one `ferry bench` run over TCP: `op` (`write` or `read`), 1 MiB ops, `total` bytes
/// over `streams` streams.
fn ferry(streams: usize, op: &str, total: u64) -> Result<f64> {
    let (streams, total) = (streams.to_string(), total.to_string());
    ferry_bench_json(
        &[
            "--transport",
            "tcp",
            "--op",
            op,
            // One 1 MiB buffer per stream on each side, as iperf3 reuses one `-l 1M` buffer per
            // process (ferry bench raises the segment to one op per stream).
            "--op-size",
            "1MiB",
            "--segment-size",
            "1MiB",
            "--streams",
            &streams,
            "--total",
            &total,
        ],
        "gb_per_s",
    )
}

fn tcp(args: &[String]) -> Result<()> {
    let (total, repeat) = total_and_repeat(args, 4u64 << 30, 5, USAGE)?;
    ensure_tool("iperf3", "iperf3")?;
    run_loud(cargo().args(["build", "--release", "-p", "ferry-engine-cli"]))?;
    println!(
        "loopback, 1 MiB ops, {total} bytes per run, {repeat} rounds of iperf3, ferry write and \
         ferry read back to back; rates are medians, ratios the median of each round's ratio \
         (range in brackets); GB/s = 10^9 B/s"
    );
    println!(
        "{:<8} {:>8} {:>12} {:>18} {:>11} {:>18}",
        "streams", "iperf3", "ferry write", "ratio", "ferry read", "ratio"
    );
    let mut worst: f64 = f64::INFINITY;
    for streams in [1usize, 2] {
        // Interleave the tools so that machine noise hits both alike; pair each ferry run with
        // the iperf3 run just before it.
        let (mut ip, mut fw, mut fr, mut rw, mut rr) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for _ in 0..repeat {
            let i = iperf3(streams, total)?;
            let w = ferry(streams, "write", total)?;
            let r = ferry(streams, "read", total)?;
            ip.push(i);
            fw.push(w);
            fr.push(r);
            rw.push(w / i);
            rr.push(r / i);
        }
        let range = |v: &[f64]| {
            let lo = v.iter().copied().fold(f64::INFINITY, f64::min);
            let hi = v.iter().copied().fold(0.0, f64::max);
            format!("{:.2} [{lo:.2}-{hi:.2}]", median(v))
        };
        worst = worst.min(median(&rw));
        println!(
            "{:<8} {:>8.3} {:>12.3} {:>18} {:>11.3} {:>18}",
            streams,
            median(&ip),
            median(&fw),
            range(&rw),
            median(&fr),
            range(&rr)
        );
    }
    let verdict = if worst >= 0.9 { "meets" } else { "misses" };
    println!(
        "ferry/iperf3 (write, worse of 1 and 2 streams, median) = {worst:.2}: {verdict} the 0.9 target"
    );
    Ok(())
}
