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
//! per-round ratios (below 1: Ferry spends less CPU per byte than iperf3); a second table splits
//! each side's CPU per GB into its client and its server.
//!
//! With `--baseline BIN` another build's `ferry serve` and `ferry bench` run the same cases in
//! the same rounds (the three sides' order rotating each round), and the table adds the ratios of
//! this tree's CPU per GB and rate to that build's.
//!
//! Options: `--total BYTES` per run (default 4GiB), `--repeat N` rounds (default 5), `--transport
//! auto|uring|tcp` (default auto: the engine's choice, io_uring where the kernel allows),
//! `--baseline BIN`.

use std::net::{SocketAddr, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

use crate::util::{cargo, ensure_tool, json_num, median, median_and_range, run as run_loud, size};

const USAGE: &str = "usage: cargo xtask bench cpu [--total BYTES] [--repeat N] [--transport auto|uring|tcp] [--baseline BIN]";

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

/// One measured run: CPU seconds of each end, bytes moved, wall seconds.
struct Run {
    client: f64,
    server: f64,
    bytes: f64,
    seconds: f64,
}

impl Run {
    fn cpu_per_gb(&self) -> f64 {
        (self.client + self.server) / (self.bytes / 1e9)
    }
    fn client_per_gb(&self) -> f64 {
        self.client / (self.bytes / 1e9)
    }
    fn server_per_gb(&self) -> f64 {
        self.server / (self.bytes / 1e9)
    }
    fn gb_per_s(&self) -> f64 {
        self.bytes / self.seconds / 1e9
    }
}

/// CPU seconds of one run's two ends.
struct Cpu {
    client: f64,
    server: f64,
}

/// Runs `client` to its end against `server` and counts both processes' CPU meanwhile; returns
/// the client's stdout with the CPU seconds of each end and the wall seconds.
fn measured(server: &Server, client: &mut Command, hz: f64) -> Result<(String, Cpu, f64)> {
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
    let cpu = Cpu {
        client: (c1 - c0) as f64 / hz,
        server: (s1 - s0) as f64 / hz,
    };
    Ok((text, cpu, wall))
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

/// One build of Ferry: its binary and its `ferry serve`, up for the whole run.
struct Ferry {
    bin: PathBuf,
    server: Server,
    addr: SocketAddr,
}

impl Ferry {
    fn start(bin: PathBuf, transport: &str) -> Result<Self> {
        let addr: SocketAddr = ([127, 0, 0, 1], free_port()?).into();
        let server = Server(
            Command::new(&bin)
                .args(["serve", "--listen", &addr.to_string()])
                .args(["--transport", transport])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .with_context(|| format!("starting {} serve", bin.display()))?,
        );
        wait_listening(addr, "ferry serve")?;
        Ok(Self { bin, server, addr })
    }
}

fn ferry_run(ferry: &Ferry, transport: &str, case: &Case, total: u64, hz: f64) -> Result<Run> {
    let (server, addr) = (&ferry.server, ferry.addr);
    let mut cmd = Command::new(&ferry.bin);
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
        client: cpu.client,
        server: cpu.server,
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
        client: cpu.client,
        server: cpu.server,
        bytes,
        seconds,
    })
}

/// Runs the comparison.
pub(crate) fn run(args: &[String]) -> Result<()> {
    let mut total = 4u64 << 30;
    let mut repeat = 5usize;
    let mut transport = "auto".to_owned();
    let mut baseline: Option<PathBuf> = None;
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
            "--baseline" => baseline = Some(PathBuf::from(value("--baseline")?)),
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
    let hz = clock_ticks();
    let mut ferries = vec![Ferry::start(crate::util::release_bin("ferry"), &transport)?];
    if let Some(b) = baseline {
        if !b.is_file() {
            bail!("the baseline {} is not a file", b.display());
        }
        ferries.push(Ferry::start(b, &transport)?);
    }
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

    // Per round: runs[side][case] of each Ferry build, and the iperf3 reference.
    let mut rounds: Vec<(Vec<Vec<Run>>, Run)> = Vec::new();
    for round in 0..repeat {
        eprintln!("bench cpu: round {} of {repeat}", round + 1);
        let sides = 1 + ferries.len();
        let mut reference = None;
        let mut runs: Vec<Vec<Run>> = (0..ferries.len()).map(|_| Vec::new()).collect();
        for k in 0..sides {
            // Side 0 is iperf3; the order rotates every round.
            match (k + round) % sides {
                0 => reference = Some(iperf3_run(&iperf_server, iperf_port, total, hz)?),
                f => {
                    for case in CASES {
                        runs[f - 1].push(ferry_run(&ferries[f - 1], &transport, case, total, hz)?);
                    }
                }
            }
        }
        rounds.push((runs, reference.context("no iperf3 run in a round")?));
    }
    drop(iperf_server);
    let ferries_len = ferries.len();
    drop(ferries);

    type Round = (Vec<Vec<Run>>, Run);
    let column = |side: usize, c: usize, f: fn(&Run) -> f64| -> Vec<f64> {
        rounds.iter().map(|(runs, _)| f(&runs[side][c])).collect()
    };
    let reference = |f: fn(&Run) -> f64| -> Vec<f64> { rounds.iter().map(|(_, r)| f(r)).collect() };
    let per_round = |of: &dyn Fn(&Round) -> f64| -> String {
        median_and_range(&rounds.iter().map(of).collect::<Vec<_>>())
    };
    let with_baseline = ferries_len > 1;
    print!(
        "| ferry ({transport}), one stream, depth 16 | ferry CPU s/GB (GB/s) | iperf3 -l 1M CPU s/GB (GB/s) | ferry / iperf3 CPU per GB, median [range] of {repeat} rounds |"
    );
    if with_baseline {
        print!(" baseline CPU s/GB (GB/s) | ferry / baseline CPU per GB | ferry / baseline rate |");
    }
    println!();
    println!(
        "|---|---|---|---|{}",
        if with_baseline { "---|---|---|" } else { "" }
    );
    for (c, case) in CASES.iter().enumerate() {
        print!(
            "| {} | {:.3} ({:.2}) | {:.3} ({:.2}) | {} |",
            case.label,
            median(&column(0, c, Run::cpu_per_gb)),
            median(&column(0, c, Run::gb_per_s)),
            median(&reference(Run::cpu_per_gb)),
            median(&reference(Run::gb_per_s)),
            per_round(&|(runs, r)| runs[0][c].cpu_per_gb() / r.cpu_per_gb()),
        );
        if with_baseline {
            print!(
                " {:.3} ({:.2}) | {} | {} |",
                median(&column(1, c, Run::cpu_per_gb)),
                median(&column(1, c, Run::gb_per_s)),
                per_round(&|(runs, _)| runs[0][c].cpu_per_gb() / runs[1][c].cpu_per_gb()),
                per_round(&|(runs, _)| runs[0][c].gb_per_s() / runs[1][c].gb_per_s()),
            );
        }
        println!();
    }
    println!(
        "(CPU: user + system seconds of client and server together per 10^9 bytes; below 1: ferry spends less CPU per byte)"
    );
    println!();
    println!(
        "| each end, CPU s/GB (median of {repeat} rounds) | ferry client | ferry server | iperf3 client | iperf3 server | ferry / iperf3 client | ferry / iperf3 server |"
    );
    println!("|---|---|---|---|---|---|---|");
    for (c, case) in CASES.iter().enumerate() {
        println!(
            "| {} | {:.3} | {:.3} | {:.3} | {:.3} | {} | {} |",
            case.label,
            median(&column(0, c, Run::client_per_gb)),
            median(&column(0, c, Run::server_per_gb)),
            median(&reference(Run::client_per_gb)),
            median(&reference(Run::server_per_gb)),
            per_round(&|(runs, r)| runs[0][c].client_per_gb() / r.client_per_gb()),
            per_round(&|(runs, r)| runs[0][c].server_per_gb() / r.server_per_gb()),
        );
    }
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
