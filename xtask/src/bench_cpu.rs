//! `cargo xtask bench cpu`: CPU seconds per GB moved, both ends counted, Ferry against iperf3 on
//! loopback, in alternating rounds.
//!
//! Two server processes stay up for the whole run: `ferry serve` (release build, its default
//! `bench` segment) and `iperf3 -s`. Each measured run is one client process against one of them:
//! `ferry bench 127.0.0.1:PORT` (one stream; 1 MiB and 64 KiB READs and WRITEs at depth 16) or
//! `iperf3 -c 127.0.0.1 -l 1M` (the reference: iperf3 with 1 MiB writes, against which the issue
//! judges both op sizes). A run's CPU time is the client's whole life (its user + system time,
//! from this process's `cutime` + `cstime` in `/proc/self/stat` around the wait for it: it
//! counts start-up, so the bytes per run must dwarf it) plus what the server spent meanwhile (its
//! `utime` + `stime` in `/proc/<pid>/stat` before the client starts and after it exits). Within a
//! round the order of Ferry and iperf3 is swapped every round so neither always runs on a warmer
//! machine; every Ferry case is divided by the iperf3 run of its round. The table shows each
//! side's median CPU seconds per GB (10^9 bytes) and rate, and the median and range of the
//! per-round ratios (below 1: Ferry spends less CPU per byte than iperf3).
//!
//! Options: `--total BYTES` per run (default 4GiB), `--repeat N` rounds (default 5), `--transport
//! auto|uring|tcp` (default auto: the engine's choice, io_uring where the kernel allows).

use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

use crate::util::{cargo, ensure_tool, json_num, median, median_and_range, run as run_loud, size};

const USAGE: &str =
    "usage: cargo xtask bench cpu [--total BYTES] [--repeat N] [--transport auto|uring|tcp]";

/// A server process, killed when dropped.
struct Server(Child);

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Clock ticks per second, the unit of `/proc/<pid>/stat`'s times (`getconf CLK_TCK`; 100 on
/// every Linux this runs on if `getconf` is missing).
fn clock_ticks() -> f64 {
    Command::new("getconf")
        .arg("CLK_TCK")
        .output()
        .ok()
        .and_then(|o| String::from_utf8_lossy(&o.stdout).trim().parse().ok())
        .unwrap_or(100.0)
}

/// The fields of `/proc/<pid>/stat` after the command name (which may hold spaces), the first
/// being field 3 (`state`).
fn stat_fields(text: &str) -> Result<Vec<u64>> {
    let rest = text
        .rfind(')')
        .and_then(|at| text.get(at + 1..))
        .context("a /proc stat line without its command name")?;
    // `state` is a letter; every field after it that the caller reads is a number.
    Ok(rest
        .split_whitespace()
        .skip(1)
        .map(|f| f.parse::<i64>().map_or(0, |v| v.max(0) as u64))
        .collect())
}

/// Ticks a process ran (user + system, all its threads), from `/proc/<pid>/stat`.
fn ticks_of(pid: u32) -> Result<u64> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .with_context(|| format!("reading /proc/{pid}/stat"))?;
    let f = stat_fields(&text)?;
    // Fields 14 (utime) and 15 (stime); the vector starts at field 4.
    Ok(f.get(10).copied().unwrap_or(0) + f.get(11).copied().unwrap_or(0))
}

/// Ticks this process's waited-for children ran (fields 16 and 17 of `/proc/self/stat`).
fn children_ticks() -> Result<u64> {
    let f = stat_fields(&std::fs::read_to_string("/proc/self/stat").context("/proc/self/stat")?)?;
    Ok(f.get(12).copied().unwrap_or(0) + f.get(13).copied().unwrap_or(0))
}

fn free_port() -> Result<u16> {
    let l = std::net::TcpListener::bind("127.0.0.1:0").context("finding a free port")?;
    Ok(l.local_addr()?.port())
}

/// Waits up to 10 s until something accepts connections on `addr`.
fn wait_listening(addr: SocketAddr, what: &str) -> Result<()> {
    let end = Instant::now() + Duration::from_secs(10);
    while TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_err() {
        if Instant::now() > end {
            bail!("{what} is not listening on {addr} after 10 s");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok(())
}

/// One measured run: CPU seconds of both ends, bytes moved, wall seconds.
struct Run {
    cpu: f64,
    bytes: f64,
    seconds: f64,
}

impl Run {
    fn cpu_per_gb(&self) -> f64 {
        self.cpu / (self.bytes / 1e9)
    }
    fn gb_per_s(&self) -> f64 {
        self.bytes / self.seconds / 1e9
    }
}

/// Runs `client` to its end against `server` and counts both processes' CPU meanwhile; returns
/// the client's stdout with the CPU seconds.
fn measured(server: &Server, client: &mut Command, hz: f64) -> Result<(String, f64, f64)> {
    let pid = server.0.id();
    let (s0, c0) = (ticks_of(pid)?, children_ticks()?);
    let t0 = Instant::now();
    let out = client
        .stderr(Stdio::piped())
        .output()
        .with_context(|| format!("running {client:?}"))?;
    let wall = t0.elapsed().as_secs_f64();
    let (s1, c1) = (ticks_of(pid)?, children_ticks()?);
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    if !out.status.success() {
        bail!(
            "{client:?} failed: {text} {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok((text, (s1 - s0 + c1 - c0) as f64 / hz, wall))
}

/// One Ferry case: label and the `ferry bench` arguments of its op.
struct Case {
    label: &'static str,
    args: [&'static str; 4],
}

const CASES: &[Case] = &[
    Case {
        label: "1 MiB READs",
        args: ["--op", "read", "--op-size", "1MiB"],
    },
    Case {
        label: "1 MiB WRITEs",
        args: ["--op", "write", "--op-size", "1MiB"],
    },
    Case {
        label: "64 KiB READs",
        args: ["--op", "read", "--op-size", "64KiB"],
    },
    Case {
        label: "64 KiB WRITEs",
        args: ["--op", "write", "--op-size", "64KiB"],
    },
];

fn ferry_run(
    ferry: &Path,
    server: &Server,
    addr: SocketAddr,
    transport: &str,
    case: &Case,
    total: u64,
    hz: f64,
) -> Result<Run> {
    let mut cmd = Command::new(ferry);
    cmd.args([
        "bench",
        &addr.to_string(),
        "--json",
        "--transport",
        transport,
    ])
    .args([
        "--streams",
        "1",
        "--depth",
        "16",
        "--total",
        &total.to_string(),
    ])
    .args(case.args);
    let (text, cpu, wall) = measured(server, &mut cmd, hz)?;
    let bytes = json_num(&text, "total_bytes", 0).with_context(|| format!("no bytes in {text}"))?;
    let seconds = json_num(&text, "seconds", 0).unwrap_or(wall);
    Ok(Run {
        cpu,
        bytes,
        seconds,
    })
}

fn iperf3_run(server: &Server, port: u16, total: u64, hz: f64) -> Result<Run> {
    let mut cmd = Command::new("iperf3");
    cmd.args(["-c", "127.0.0.1", "-p", &port.to_string(), "-l", "1M", "-J"])
        .args(["-n", &total.to_string()]);
    let (text, cpu, _) = measured(server, &mut cmd, hz)?;
    let (bytes, seconds) = crate::iperf3::received_in(&text)?;
    Ok(Run {
        cpu,
        bytes,
        seconds,
    })
}

/// Runs the comparison.
pub(crate) fn run(args: &[String]) -> Result<()> {
    let mut total = 4u64 << 30;
    let mut repeat = 5usize;
    let mut transport = "auto".to_owned();
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let mut value = |name: &str| -> Result<String> {
            it.next()
                .cloned()
                .with_context(|| format!("{name} needs a value"))
        };
        match a.as_str() {
            "--total" => total = size(&value("--total")?)?,
            "--repeat" => {
                repeat = value("--repeat")?
                    .parse::<usize>()
                    .context("--repeat")?
                    .max(1)
            }
            "--transport" => transport = value("--transport")?,
            other => {
                eprintln!("{USAGE}");
                bail!("unknown option {other}")
            }
        }
    }
    if !["auto", "uring", "tcp"].contains(&transport.as_str()) {
        bail!("--transport {transport}: use auto, uring or tcp");
    }
    ensure_tool("iperf3", "iperf3")?;
    run_loud(cargo().args(["build", "--release", "-p", "ferry-engine-cli"]))?;
    let ferry = crate::util::release_bin("ferry");
    let hz = clock_ticks();

    let ferry_port = free_port()?;
    let ferry_addr: SocketAddr = ([127, 0, 0, 1], ferry_port).into();
    let ferry_server = Server(
        Command::new(&ferry)
            .args(["serve", "--listen", &ferry_addr.to_string()])
            .args(["--transport", &transport])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .context("starting ferry serve")?,
    );
    wait_listening(ferry_addr, "ferry serve")?;
    let iperf_port = free_port()?;
    // Not one-off (`-1`): the server must outlive each client so that its CPU time can be read
    // after the client ends, and it may take the probe connection below.
    let iperf_server = Server(
        Command::new("iperf3")
            .args(["-s", "-p", &iperf_port.to_string()])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .context("starting iperf3 -s")?,
    );
    wait_listening(([127, 0, 0, 1], iperf_port).into(), "iperf3 -s")?;

    // ratios[c], ferry[c], reference: per round.
    let mut ratios: Vec<Vec<f64>> = vec![Vec::new(); CASES.len()];
    let mut ours: Vec<Vec<Run>> = (0..CASES.len()).map(|_| Vec::new()).collect();
    let mut theirs: Vec<Run> = Vec::new();
    for round in 0..repeat {
        eprintln!("bench cpu: round {} of {repeat}", round + 1);
        let reference_first = round % 2 == 0;
        let mut reference = None;
        if reference_first {
            reference = Some(iperf3_run(&iperf_server, iperf_port, total, hz)?);
        }
        let mut runs = Vec::new();
        for case in CASES {
            runs.push(ferry_run(
                &ferry,
                &ferry_server,
                ferry_addr,
                &transport,
                case,
                total,
                hz,
            )?);
        }
        let reference = match reference {
            Some(r) => r,
            None => iperf3_run(&iperf_server, iperf_port, total, hz)?,
        };
        for (i, r) in runs.into_iter().enumerate() {
            ratios[i].push(r.cpu_per_gb() / reference.cpu_per_gb());
            ours[i].push(r);
        }
        theirs.push(reference);
    }
    drop(iperf_server);
    drop(ferry_server);

    let per_gb = |v: &[Run]| median(&v.iter().map(Run::cpu_per_gb).collect::<Vec<_>>());
    let rate = |v: &[Run]| median(&v.iter().map(Run::gb_per_s).collect::<Vec<_>>());
    println!(
        "| ferry ({transport}), one stream, depth 16 | ferry CPU s/GB (GB/s) | iperf3 -l 1M CPU s/GB (GB/s) | ferry / iperf3 CPU per GB, median [range] of {repeat} rounds |"
    );
    println!("|---|---|---|---|");
    for (i, c) in CASES.iter().enumerate() {
        println!(
            "| {} | {:.3} ({:.2}) | {:.3} ({:.2}) | {} |",
            c.label,
            per_gb(&ours[i]),
            rate(&ours[i]),
            per_gb(&theirs),
            rate(&theirs),
            median_and_range(&ratios[i]),
        );
    }
    println!(
        "(CPU: user + system seconds of client and server together per 10^9 bytes; below 1: ferry spends less CPU per byte)"
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_times_after_a_command_name_with_spaces() {
        // pid (comm) state ppid pgrp session tty tpgid flags minflt cminflt majflt cmajflt utime
        // stime cutime cstime ...
        let line = "42 (a (b) c) S 1 2 3 4 5 6 7 8 9 10 110 220 330 440 20 0";
        let f = stat_fields(line).unwrap();
        assert_eq!((f[10], f[11], f[12], f[13]), (110, 220, 330, 440));
        assert!(stat_fields("no name here").is_err());
    }
}
