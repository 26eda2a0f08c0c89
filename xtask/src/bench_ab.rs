//! `cargo xtask bench ab --baseline BIN`: this tree's `ferry` against another build of it, in
//! alternating rounds, to show that a change costs no speed.
//!
//! Both binaries run `ferry bench` (each its own in-process loopback server) with the same
//! arguments, one right after the other in each round, the order swapped every round so neither
//! always runs on a warmer machine. Cases: the TCP and io_uring data planes and the same-host
//! plane (`local`; with `--two-process` served by `ferry serve` of the engine's choice, which
//! serves it beside its data plane), one and two
//! streams, 1 MiB READs and WRITEs (rate, GB/s), 64 KiB READs and WRITEs at depth 16 on one
//! stream (a quarter of `--total` each), and a 64-byte WRITE round trip with one op in flight
//! (p50, microseconds) on each data plane. The table shows each side's median and the
//! median and range of the per-round ratios, oriented so that above 1 means this tree is
//! faster.
//!
//! With `--two-process` each build serves from its own `ferry serve --transport T` child process
//! instead (one per build and data plane, up for the whole run, publishing a 64 MiB `bench`
//! segment) and `ferry bench 127.0.0.1:PORT` is the client: the same cases across two
//! processes.
//!
//! Options: `--baseline BIN` (required: the `ferry` of the build to compare against, e.g.
//! `target/release/ferry` of a worktree at main, or at 4fbd163 for the io_uring rows, whose
//! `ferry bench` takes the same flags), `--total BYTES` per bulk run (default 2GiB), `--ops N`
//! per latency run (default 20000), `--repeat N` rounds (default 5), `--only TEXT` (only the
//! cases whose label contains it, e.g. `--only "uring, 1 stream, 1 MiB read"`),
//! `--two-process`, `--no-build` (use this tree's `target/release/ferry` as it is), `--ferry BIN`
//! (measure this binary as the tree's side, not built: a copy kept apart from a target
//! directory other builds write to).

use std::collections::HashMap;
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

use crate::util::{cargo, ferry_bench_json_of, median, median_and_range, run as run_loud, size};

/// One measured case: its label, the `ferry bench` arguments, the JSON key, and whether
/// larger is better (a rate) or smaller (a latency).
struct Case {
    label: String,
    transport: &'static str,
    args: Vec<String>,
    key: &'static str,
    higher_is_better: bool,
}

/// A `ferry bench` case on `transport`: `op`s of `size` bytes, `total` bytes, and `extra` flags.
fn case(
    label: String,
    transport: &'static str,
    op: &str,
    size: &str,
    total: u64,
    extra: &[&str],
) -> Case {
    let mut args: Vec<String> = ["--transport", transport, "--op", op, "--op-size", size]
        .map(String::from)
        .to_vec();
    args.extend(extra.iter().map(|a| a.to_string()));
    args.extend(["--total".to_owned(), total.to_string()]);
    Case {
        label,
        transport,
        args,
        key: "gb_per_s",
        higher_is_better: true,
    }
}

fn cases(total: u64, ops: usize) -> Vec<Case> {
    let mut v = Vec::new();
    for transport in ["tcp", "uring", "local"] {
        for streams in [1, 2] {
            for op in ["read", "write"] {
                let label = format!("{transport}, {streams} stream(s), 1 MiB {op}s (GB/s)");
                let streams = streams.to_string();
                v.push(case(
                    label,
                    transport,
                    op,
                    "1MiB",
                    total,
                    &["--streams", &streams],
                ));
            }
        }
        for op in ["read", "write"] {
            let label = format!("{transport}, 1 stream, 64 KiB {op}s at depth 16 (GB/s)");
            v.push(case(
                label,
                transport,
                op,
                "64KiB",
                total / 4,
                &["--depth", "16"],
            ));
        }
        let label = format!("{transport}, 64 B write round trip p50 (us)");
        v.push(Case {
            key: "p50_us",
            higher_is_better: false,
            ..case(
                label,
                transport,
                "write",
                "64",
                ops as u64 * 64,
                &["--depth", "1"],
            )
        });
    }
    v
}

/// Runs the comparison.
pub(crate) fn run(args: &[String]) -> Result<()> {
    let mut baseline: Option<PathBuf> = None;
    let mut current: Option<PathBuf> = None;
    let mut total = 2u64 << 30;
    let mut ops = 20_000usize;
    let mut repeat = 5usize;
    let mut only: Option<String> = None;
    let mut two_process = false;
    let mut build = true;
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let mut value = |name: &str| -> Result<String> {
            it.next()
                .cloned()
                .with_context(|| format!("{name} needs a value"))
        };
        match a.as_str() {
            "--baseline" => baseline = Some(PathBuf::from(value("--baseline")?)),
            "--total" => total = size(&value("--total")?)?,
            "--ops" => ops = value("--ops")?.parse().context("--ops")?,
            "--repeat" => {
                repeat = value("--repeat")?
                    .parse::<usize>()
                    .context("--repeat")?
                    .max(1)
            }
            "--only" => only = Some(value("--only")?),
            "--two-process" => two_process = true,
            "--no-build" => build = false,
            "--ferry" => current = Some(PathBuf::from(value("--ferry")?)),
            other => bail!(
                "unknown option {other} (bench ab takes --baseline BIN, --total BYTES, --ops N, --repeat N, --only TEXT, --two-process, --no-build, --ferry BIN)"
            ),
        }
    }
    let Some(baseline) = baseline else {
        bail!("bench ab needs --baseline BIN: the ferry binary of the build to compare against")
    };
    if !baseline.is_file() {
        bail!("the baseline {} is not a file", baseline.display());
    }
    let current = match current {
        Some(bin) => bin,
        None => {
            if build {
                run_loud(cargo().args(["build", "--release", "-p", "ferry-engine-cli"]))?;
            }
            crate::util::release_bin("ferry")
        }
    };
    let cases: Vec<Case> = cases(total, ops)
        .into_iter()
        .filter(|c| only.as_ref().is_none_or(|o| c.label.contains(o.as_str())))
        .collect();
    if cases.is_empty() {
        bail!("no case matches --only {only:?}");
    }
    // With --two-process: each build's server per data plane, up for the whole run.
    let mut servers: HashMap<(bool, &str), Served> = HashMap::new();
    if two_process {
        for c in &cases {
            for (ours, bin) in [(true, &current), (false, &baseline)] {
                if let std::collections::hash_map::Entry::Vacant(e) =
                    servers.entry((ours, c.transport))
                {
                    e.insert(Served::start(bin, c.transport)?);
                }
            }
        }
    }
    let measure = |bin: &Path, ours: bool, c: &Case| -> Result<f64> {
        let mut args: Vec<String> = Vec::new();
        if let Some(s) = servers.get(&(ours, c.transport)) {
            args.push(s.addr.to_string());
        }
        args.extend(c.args.iter().cloned());
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        ferry_bench_json_of(bin, &args, c.key)
    };
    // ratios[c]: per-round ratio (above 1: this tree is better); medians of each side.
    let mut ratios: Vec<Vec<f64>> = vec![Vec::new(); cases.len()];
    let mut ours: Vec<Vec<f64>> = vec![Vec::new(); cases.len()];
    let mut theirs: Vec<Vec<f64>> = vec![Vec::new(); cases.len()];
    for round in 0..repeat {
        eprintln!("bench ab: round {} of {repeat}", round + 1);
        for (i, c) in cases.iter().enumerate() {
            let (a, b) = if round % 2 == 0 {
                let b = measure(&baseline, false, c)?;
                (measure(&current, true, c)?, b)
            } else {
                let a = measure(&current, true, c)?;
                (a, measure(&baseline, false, c)?)
            };
            ours[i].push(a);
            theirs[i].push(b);
            ratios[i].push(if c.higher_is_better { a / b } else { b / a });
        }
    }
    println!(
        "| case | baseline | this tree | this tree / baseline, median [range] of {repeat} rounds |"
    );
    println!("|---|---|---|---|");
    for (i, c) in cases.iter().enumerate() {
        println!(
            "| {} | {:.2} | {:.2} | {} |",
            c.label,
            median(&theirs[i]),
            median(&ours[i]),
            median_and_range(&ratios[i]),
        );
    }
    println!(
        "(ratios above 1: this tree is faster; latency rows compare p50 round trips; {})",
        if two_process {
            "two processes: each build's `ferry serve` and `ferry bench` on loopback"
        } else {
            "in-process loopback: each `ferry bench` runs its own server"
        }
    );
    Ok(())
}

/// One build's `ferry serve --transport T` on a free loopback port, killed when dropped.
struct Served {
    child: Child,
    addr: SocketAddr,
}

impl Served {
    fn start(bin: &Path, transport: &str) -> Result<Self> {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .context("finding a free port")?
            .port();
        let addr: SocketAddr = ([127, 0, 0, 1], port).into();
        let mut child = Command::new(bin)
            .args([
                "serve",
                "--listen",
                &addr.to_string(),
                "--transport",
                // The same-host plane is served beside the engine's data plane.
                if transport == "local" {
                    "auto"
                } else {
                    transport
                },
            ])
            // Named, since builds before the default segment (4fbd163) publish none by default.
            .args(["--segment", "bench=64MiB"])
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .with_context(|| format!("starting {} serve", bin.display()))?;
        let out = child.stdout.take().context("serve's stdout")?;
        let served = Self { child, addr };
        // `listening on` comes once its segments are published (a bare listening port may not
        // serve the segment yet); the rest of its output is drained so that it never blocks.
        let mut lines = std::io::BufRead::lines(std::io::BufReader::new(out));
        loop {
            match lines.next() {
                Some(Ok(l)) if l.starts_with("listening on") => break,
                Some(Ok(_)) => {}
                _ => bail!("{} serve ended before it listened", bin.display()),
            }
        }
        std::thread::spawn(move || lines.for_each(drop));
        let end = Instant::now() + Duration::from_secs(10);
        while TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_err() {
            if Instant::now() > end {
                bail!(
                    "{} serve is not listening on {addr} after 10 s",
                    bin.display()
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(served)
    }
}

impl Drop for Served {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
