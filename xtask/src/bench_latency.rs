//! `cargo xtask bench latency`: small-op round trips against a bare TCP ping-pong, in one run.
//!
//! The reference is the floor a transfer engine over TCP can reach on this machine: two threads of
//! this process, each blocked in `recv` on its end of a loopback connection (Nagle off), bouncing
//! 64 bytes. Ferry is `ferry bench --op-size 64 --depth 1` (WRITEs, one op in flight, its own
//! loopback server), with the TCP streams on I/O threads (`--io-threads auto`, the default) and on
//! the caller's runtime (`caller`), and over io_uring (the stream's ring reading every response,
//! `--uring-caller-receives false`, and the awaiting task reading its own, the default). The table shows median
//! (p50) round trips over `--repeat` rounds and their ratio to the ping-pong's p50.
//! docs/architecture.md's target is 1.2x.
//!
//! The same-host rows are `ferry bench --transport local` (client and server threads of one
//! process, on the request/answer ring, and with `FERRY_SAME_HOST_RING=off` on the plane's Unix
//! sockets). Every row is measured *idle* (nothing else asked of the machine) and *hot* (a
//! low-priority busy loop per CPU, so no vCPU idles between messages), alternating, and shows
//! beside p50 and p99 what a round trip costs: wake-ups (context switches, `perf stat`'s
//! `context-switches` for `ferry bench`, the threads' `/proc` counts for the ping-pong) and
//! system calls (`perf stat`'s `raw_syscalls:sys_enter`; the ping-pong makes 4 by
//! construction), per round trip, the run's setup included. Without a working `perf` those
//! columns say `-`. The issue 50 target: the same-host ring's hot p50 at most 1.0x the hot
//! ping-pong's, with no wake-up and no system call per round trip.
//!
//! Options: `--ops N` (round trips per run, default 20000), `--repeat N` (default 3),
//! `--baseline FERRY` (another build's `ferry` binary: its same-host rows too, ring and socket,
//! measured in the same rounds, for an A/B of a change to the plane), `--ferry FERRY` (the
//! binary of the other rows, not built; default: this tree's release build, built first). The
//! Ferry rows run in turn
//! and in the reverse order every other round, so no row always runs first.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::time::Instant;

use anyhow::{Context, Result, bail};

use crate::util::{cargo, ferry_bench_json, json_num, median, release_bin, run as run_loud};

/// What a run of round trips cost: p50 and p99 (microseconds), and per round trip the
/// wake-ups (context switches) and system calls, where counted.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Cost {
    pub(crate) p50: f64,
    pub(crate) p99: f64,
    pub(crate) wakeups: Option<f64>,
    pub(crate) syscalls: Option<f64>,
}

/// Context switches of this process's threads so far (each thread's `/proc` counts).
fn own_switches() -> Option<f64> {
    let mut total = 0u64;
    for t in std::fs::read_dir("/proc/self/task").ok()? {
        let status = std::fs::read_to_string(t.ok()?.path().join("status")).ok()?;
        for line in status.lines() {
            if let Some(v) = line
                .strip_prefix("voluntary_ctxt_switches:")
                .or_else(|| line.strip_prefix("nonvoluntary_ctxt_switches:"))
            {
                total += v.trim().parse::<u64>().ok()?;
            }
        }
    }
    Some(total as f64)
}

/// p99 of `v` (sorted copy).
fn p99(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    s.get((s.len() * 99 / 100).min(s.len().saturating_sub(1)))
        .copied()
        .unwrap_or(f64::NAN)
}

/// A low-priority busy loop per CPU while it lives: no vCPU idles (the "hot" mode).
pub(crate) struct Hot(Vec<Child>);

impl Hot {
    pub(crate) fn start() -> Result<Self> {
        let cpus = std::thread::available_parallelism().map_or(2, |n| n.get());
        let mut loops = Vec::with_capacity(cpus);
        for _ in 0..cpus {
            loops.push(
                Command::new("nice")
                    .args(["-n", "19", "sh", "-c", "while :; do :; done"])
                    .stdin(Stdio::null())
                    .spawn()
                    .context("starting a busy loop (nice, sh)")?,
            );
        }
        Ok(Self(loops))
    }
}

impl Drop for Hot {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// p50 of a bare 64-byte TCP ping-pong over loopback, in microseconds.
pub(crate) fn ping_pong(ops: usize) -> Result<f64> {
    Ok(ping_pong_cost(ops)?.p50)
}

/// A bare 64-byte TCP ping-pong over loopback: its cost (4 system calls per round trip).
pub(crate) fn ping_pong_cost(ops: usize) -> Result<Cost> {
    let listener = TcpListener::bind("127.0.0.1:0").context("bind")?;
    let addr = listener.local_addr()?;
    let echo = std::thread::spawn(move || -> Result<()> {
        let (mut s, _) = listener.accept()?;
        s.set_nodelay(true)?;
        let mut buf = [0u8; 64];
        loop {
            match s.read_exact(&mut buf) {
                Ok(()) => s.write_all(&buf)?,
                Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(()),
                Err(e) => return Err(e.into()),
            }
        }
    });
    let mut c = TcpStream::connect(addr).context("connect")?;
    c.set_nodelay(true)?;
    let mut buf = [7u8; 64];
    let mut lat = Vec::with_capacity(ops);
    let mut before = None;
    for i in 0..ops + ops / 10 {
        if i == ops / 10 {
            before = own_switches();
        }
        let t = Instant::now();
        c.write_all(&buf)?;
        c.read_exact(&mut buf)?;
        if i >= ops / 10 {
            // The first tenth warms up.
            lat.push(t.elapsed().as_secs_f64() * 1e6);
        }
    }
    let after = own_switches();
    drop(c);
    echo.join()
        .map_err(|_| anyhow::anyhow!("echo thread panicked"))??;
    Ok(Cost {
        p50: median(&lat),
        p99: p99(&lat),
        wakeups: before.zip(after).map(|(b, a)| (a - b) / ops as f64),
        syscalls: Some(4.0),
    })
}

/// `ferry bench` (the binary `bin`) of 64-byte WRITEs, one in flight, with `extra` flags and
/// `env`, under `perf stat` where it works: its cost.
pub(crate) fn ferry_cost(
    bin: &std::path::Path,
    ops: usize,
    extra: &[&str],
    env: &[(&str, &str)],
) -> Result<Cost> {
    let total = (ops * 64).to_string();
    let counts = std::env::temp_dir().join(format!("ferry-latency-{}.perf", std::process::id()));
    let perf = Command::new("perf")
        .args([
            "stat",
            "-x,",
            "-e",
            "raw_syscalls:sys_enter,context-switches",
            "--",
            "true",
        ])
        .output()
        .is_ok_and(|o| o.status.success());
    let mut cmd = if perf {
        let mut c = Command::new("perf");
        c.args([
            "stat",
            "-x,",
            "-e",
            "raw_syscalls:sys_enter,context-switches",
            "-o",
        ])
        .arg(&counts)
        .arg("--")
        .arg(bin);
        c
    } else {
        Command::new(bin)
    };
    cmd.args([
        "bench",
        "--json",
        "--op",
        "write",
        "--op-size",
        "64",
        "--depth",
        "1",
    ])
    .args(["--total", &total])
    .args(extra)
    .envs(env.iter().copied());
    let out = cmd.output().context("running ferry bench")?;
    let text = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        bail!(
            "ferry bench failed: {text} {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let num = |k: &str| json_num(&text, k, 0).with_context(|| format!("no {k} in {text:?}"));
    let (mut wakeups, mut syscalls) = (None, None);
    if perf {
        let stat = std::fs::read_to_string(&counts).unwrap_or_default();
        let _ = std::fs::remove_file(&counts);
        for line in stat.lines() {
            let mut f = line.split(',');
            let v = f.next().and_then(|v| v.trim().parse::<f64>().ok());
            let name = f.nth(1).unwrap_or("");
            match name {
                "raw_syscalls:sys_enter" => syscalls = v.map(|v| v / ops as f64),
                "context-switches" => wakeups = v.map(|v| v / ops as f64),
                _ => {}
            }
        }
    }
    Ok(Cost {
        p50: num("p50_us")?,
        p99: num("p99_us").unwrap_or(f64::NAN),
        wakeups,
        syscalls,
    })
}

/// p50 of `ferry bench` 64-byte WRITEs, one in flight.
pub(crate) fn ferry(ops: usize, extra: &[&str]) -> Result<f64> {
    let total = (ops * 64).to_string();
    let mut args = vec![
        "--op",
        "write",
        "--op-size",
        "64",
        "--depth",
        "1",
        "--total",
        &total,
    ];
    args.extend_from_slice(extra);
    ferry_bench_json(&args, "p50_us")
}

/// Runs the comparison.
pub(crate) fn run(args: &[String]) -> Result<()> {
    let mut ops = 20_000usize;
    let mut repeat = 3usize;
    let mut baseline: Option<std::path::PathBuf> = None;
    let mut current: Option<std::path::PathBuf> = None;
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let mut num = |name: &str| -> Result<usize> {
            it.next()
                .with_context(|| format!("{name} needs a value"))?
                .parse()
                .with_context(|| name.to_owned())
        };
        match a.as_str() {
            "--ops" => ops = num("--ops")?.max(100),
            "--repeat" => repeat = num("--repeat")?.max(1),
            "--baseline" | "--ferry" => {
                let b = it
                    .next()
                    .with_context(|| format!("{a} needs a ferry binary"))?;
                let b = Some(std::fs::canonicalize(b).with_context(|| b.clone())?);
                if a == "--ferry" {
                    current = b;
                } else {
                    baseline = b;
                }
            }
            other => bail!(
                "unknown option {other} (bench latency takes --ops N, --repeat N, \
                 --baseline FERRY, --ferry FERRY)"
            ),
        }
    }
    let current = match current {
        Some(bin) => bin,
        None => {
            run_loud(cargo().args(["build", "--release", "-p", "ferry-engine-cli"]))?;
            release_bin("ferry")
        }
    };
    let mut cases: Vec<Case> = vec![
        (
            "ferry same-host, ring",
            vec!["--transport", "local"],
            vec![],
        ),
        (
            "ferry same-host, socket",
            vec!["--transport", "local"],
            vec![("FERRY_SAME_HOST_RING", "off")],
        ),
        ("ferry tcp, I/O threads", vec!["--transport", "tcp"], vec![]),
        (
            "ferry tcp, caller's runtime",
            vec!["--transport", "tcp", "--io-threads", "caller"],
            vec![],
        ),
    ];
    match ferry(200, &["--transport", "uring"]) {
        Ok(_) => {
            cases.push((
                "ferry uring, ring receives",
                vec!["--transport", "uring", "--uring-caller-receives", "false"],
                vec![],
            ));
            cases.push((
                "ferry uring, caller receives",
                vec!["--transport", "uring", "--uring-caller-receives", "true"],
                vec![],
            ));
        }
        Err(e) => println!("the uring row is left out: {e:#}"),
    }
    // Which binary each row runs: this tree's, and the baseline's same-host rows after them.
    let mut bins = vec![current.clone(); cases.len()];
    if let Some(base) = &baseline {
        for k in 0..2 {
            let (_, extra, env) = cases[k].clone();
            let name = [
                "ferry same-host, ring (baseline)",
                "ferry same-host, socket (baseline)",
            ][k];
            cases.push((name, extra, env));
            bins.push(base.clone());
        }
    }
    // [mode][case + 1]: case 0 is the ping-pong; mode 0 idle, 1 hot.
    let mut costs: Vec<Vec<Vec<Cost>>> = vec![vec![Vec::new(); cases.len() + 1]; 2];
    for round in 0..repeat {
        for step in 0..2 {
            // Alternating: idle first in even rounds, hot first in odd ones.
            let mode = (round + step) % 2;
            let _hot = if mode == 1 { Some(Hot::start()?) } else { None };
            costs[mode][0].push(ping_pong_cost(ops)?);
            let turn: Vec<usize> = if round % 2 == 0 {
                (0..cases.len()).collect()
            } else {
                (0..cases.len()).rev().collect()
            };
            for i in turn {
                let (_, extra, env) = &cases[i];
                costs[mode][i + 1].push(ferry_cost(&bins[i], ops, extra, env)?);
            }
        }
    }
    println!(
        "loopback and same-host, 64-byte round trips, {ops} per run, median of {repeat} runs; \
         wake-ups and system calls per round trip (perf stat; the run's setup included)"
    );
    for (mode, name) in ["idle", "hot (a nice-19 busy loop per CPU)"]
        .iter()
        .enumerate()
    {
        let field = |v: &[Cost], f: fn(&Cost) -> Option<f64>| -> String {
            let got: Vec<f64> = v.iter().filter_map(f).collect();
            if got.is_empty() {
                "-".into()
            } else {
                format!("{:.2}", median(&got))
            }
        };
        let base = median(&costs[mode][0].iter().map(|c| c.p50).collect::<Vec<_>>());
        println!("\n{name}");
        println!(
            "{:<36} {:>9} {:>9} {:>7} {:>10} {:>10}",
            "case", "p50 us", "p99 us", "ratio", "wakeups/rt", "syscalls/rt"
        );
        let names = std::iter::once("bare TCP ping-pong").chain(cases.iter().map(|c| c.0));
        for (name, v) in names.zip(&costs[mode]) {
            let p = median(&v.iter().map(|c| c.p50).collect::<Vec<_>>());
            let q = median(&v.iter().map(|c| c.p99).collect::<Vec<_>>());
            println!(
                "{name:<36} {p:>9.1} {q:>9.1} {:>6.2}x {:>10} {:>10}",
                p / base,
                field(v, |c| c.wakeups),
                field(v, |c| c.syscalls),
            );
        }
    }
    println!(
        "\ntargets: network planes 1.2x; the same-host ring hot at most 1.0x with no wake-up \
         and no system call per round trip (issue 50)"
    );
    Ok(())
}

/// A row: its name, `ferry bench` flags, and environment.
type Case = (
    &'static str,
    Vec<&'static str>,
    Vec<(&'static str, &'static str)>,
);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ping_pong_measures_something() {
        let p = ping_pong(200).unwrap();
        assert!(p.is_finite() && p > 0.0, "{p}");
    }
}
