//! `cargo xtask bench same-host`: two processes on this host through NIXL's agent API (the
//! same script, `benches/nixl_bench.py`, on both wheels), READ and WRITE of 1 MiB blocks (64
//! per transfer) and 64 KiB blocks (16 per transfer: depth 16), a 64-byte WRITE round trip and a
//! 4 KiB single-op WRITE, in alternating rounds: Ferry's same-host plane, Ferry's network plane
//! (`FERRY_SAME_HOST=off`: io_uring where the kernel has it), NIXL's UCX with its default
//! transports, and one core's memcpy of the same blocks (figures in docs/performance.md, "Same
//! host (issue 37)" and "Issue 50's remaining rows").
//!
//! By default NIXL's wheel goes into a throwaway environment and Ferry's module is built into
//! the bench environment (`bench_compat`). Options measure given builds instead, unbuilt:
//!
//! - `--python PY`: the interpreter every side runs (it needs numpy); nothing is installed;
//! - `--ferry-path DIR`: Ferry's package (a directory holding `ferry/` with its
//!   `_ferry.abi3.so`), first on the Ferry sides' `PYTHONPATH`;
//! - `--nixl-site DIR`: the `site-packages` holding NIXL's wheel (`target/nixl-real-venv`'s),
//!   on the UCX side's and memcpy's `PYTHONPATH`;
//! - `--baseline-path DIR`: another build's Ferry package: a `ferry-base` side (its same-host
//!   plane), and `local/base` ratios;
//! - `--shared`: a `ferry-shared` side, the same workload with both processes' buffers
//!   allocated by Ferry (`crates/python/benches/nixl_shared_bench.py`: shared registrations,
//!   copied one-sidedly by the initiator);
//! - `--no-net`: leaves out the network plane's side.

use std::path::PathBuf;

use anyhow::{Context, Result, bail};

use crate::bench_compat::{NIXL, Side, Target, initiator, nixl_and_ferry, result_line};
use crate::util::{json_num, median_and_range, total_and_repeat};

const USAGE: &str = "usage: cargo xtask bench same-host [--total BYTES] [--repeat N] \
                     [--python PY --ferry-path DIR --nixl-site DIR] [--baseline-path DIR] \
                     [--shared] [--no-net]";

/// What `bench same-host` was asked for beyond `--total` and `--repeat`.
#[derive(Default)]
struct Options {
    python: Option<PathBuf>,
    ferry_path: Option<PathBuf>,
    nixl_site: Option<PathBuf>,
    baseline_path: Option<PathBuf>,
    shared: bool,
    no_net: bool,
}

/// Splits the options of this bench from `--total`/`--repeat` (which go to the shared parser).
fn options(args: &[String]) -> Result<(Options, Vec<String>)> {
    let mut o = Options::default();
    let mut rest = Vec::new();
    let mut it = args.iter();
    while let Some(a) = it.next() {
        // Absolute, links kept: a virtual environment's `bin/python` is a link whose target
        // would leave the environment.
        let mut dir = || -> Result<PathBuf> {
            let v = it.next().with_context(|| format!("{a} needs a path"))?;
            let p = std::path::absolute(v).with_context(|| format!("{a} {v}"))?;
            if !p.exists() {
                bail!("{a} {v}: no such file or directory");
            }
            Ok(p)
        };
        match a.as_str() {
            "--python" => o.python = Some(dir()?),
            "--ferry-path" => o.ferry_path = Some(dir()?),
            "--nixl-site" => o.nixl_site = Some(dir()?),
            "--baseline-path" => o.baseline_path = Some(dir()?),
            "--shared" => o.shared = true,
            "--no-net" => o.no_net = true,
            "--total" | "--repeat" => {
                rest.push(a.clone());
                rest.push(
                    it.next()
                        .with_context(|| format!("{a} needs a value"))?
                        .clone(),
                );
            }
            other => {
                eprintln!("{USAGE}");
                bail!("unknown option {other}")
            }
        }
    }
    if o.python.is_some() != o.nixl_site.is_some() {
        bail!("--python and --nixl-site go together (the interpreter and NIXL's packages)");
    }
    Ok((o, rest))
}

/// The sides to compare, Ferry's same-host plane first and UCX's last (memcpy runs on its
/// interpreter).
fn sides(o: &Options) -> Result<Vec<Side>> {
    let (nixl, ferry_py) = match &o.python {
        Some(py) => (py.clone(), py.clone()),
        None => nixl_and_ferry()?,
    };
    let script = "benches/nixl_bench.py";
    let bind = ("FERRY_BIND_ADDRESS", "127.0.0.1");
    let ferry = |label, script, env, path: &Option<PathBuf>| Side {
        label,
        python: ferry_py.clone(),
        prefix: vec!["-m", "ferry.nixl"],
        script,
        env,
        path: path.clone(),
    };
    let mut sides = vec![ferry("ferry-local", script, vec![bind], &o.ferry_path)];
    if o.shared {
        sides.push(ferry(
            "ferry-shared",
            "crates/python/benches/nixl_shared_bench.py",
            vec![bind],
            &o.ferry_path,
        ));
    }
    if o.baseline_path.is_some() {
        sides.push(ferry("ferry-base", script, vec![bind], &o.baseline_path));
    }
    if !o.no_net {
        sides.push(ferry(
            "ferry-net",
            script,
            vec![bind, ("FERRY_SAME_HOST", "off")],
            &o.ferry_path,
        ));
    }
    sides.push(Side {
        label: "ucx",
        python: nixl,
        prefix: vec![],
        script,
        env: vec![],
        path: o.nixl_site.clone(),
    });
    Ok(sides)
}

/// Bytes a run of `bench same-host` moves: `total`, or for a transfer under 64 KiB 20,000
/// transfers' worth (the small rows).
fn bytes_per_run(block: u64, blocks: u32, total: u64) -> String {
    let per = block * u64::from(blocks);
    if per < 64 << 10 { per * 20_000 } else { total }.to_string()
}

/// The cases: (op, block, blocks per transfer). The small rows (issue 50): a 64-byte round trip
/// and a 4 KiB single op, 20,000 transfers each whatever `--total` says.
const CASES: [(&str, u64, u32); 6] = [
    ("READ", 1 << 20, 64),
    ("WRITE", 1 << 20, 64),
    ("READ", 64 << 10, 16),
    ("WRITE", 64 << 10, 16),
    ("WRITE", 64, 1),
    ("WRITE", 4 << 10, 1),
];

/// One round of `side` (every case); its rates, GB/s, in `CASES` order.
fn round_of(side: &Side, round: usize, total: u64) -> Result<Vec<f64>> {
    let t = Target::start(side, "metadata")?;
    let mut rates = Vec::new();
    for (op, block, blocks) in CASES {
        let line = initiator(
            side,
            &t,
            &[
                "run".into(),
                block.to_string(),
                "--blocks".into(),
                blocks.to_string(),
                "--bytes".into(),
                bytes_per_run(block, blocks, total),
                "--op".into(),
                op.into(),
            ],
        )?;
        let gbps = json_num(&line, "gbps", 0).with_context(|| format!("no gbps in {line:?}"))?;
        println!(
            "round {round} {:<12} {op:<5} {blocks:>2} x {block:>7} B {gbps:>7.3} GB/s, {:.1} us \
             per transfer",
            side.label,
            (block * u64::from(blocks)) as f64 / gbps / 1e3
        );
        rates.push(gbps);
    }
    Ok(rates)
}

/// One round of one core's memcpy of the same blocks, on `ucx`'s interpreter (it has numpy,
/// and the script's import of `nixl` resolves).
fn memcpy_round(ucx: &Side, total: u64) -> Result<Vec<f64>> {
    let mut rates = Vec::new();
    for (_, block, blocks) in CASES {
        let out = ucx
            .command_plain()
            .args([
                "memcpy",
                &block.to_string(),
                "--blocks",
                &blocks.to_string(),
            ])
            .args(["--bytes", &bytes_per_run(block, blocks, total)])
            .output()
            .context("running the memcpy case")?;
        let line = result_line(&String::from_utf8_lossy(&out.stdout)).to_owned();
        rates.push(json_num(&line, "gbps", 0).with_context(|| format!("no gbps in {line:?}"))?);
    }
    Ok(rates)
}

/// Runs the bench (the module's docs).
pub(crate) fn run(args: &[String]) -> Result<()> {
    let (o, rest) = options(args)?;
    let (total, repeat) = total_and_repeat(&rest, 1u64 << 30, 3, USAGE)?;
    let sides = sides(&o)?;
    let ucx = sides.last().context("no UCX side")?;
    println!(
        "Same host, two processes, NIXL's agent API ({} against Ferry's), {total} bytes per run, \
         {repeat} rounds, the order of the sides turning each round; GB/s = 10^9 B/s",
        o.nixl_site
            .as_ref()
            .map_or_else(|| NIXL.join(" "), |p| p.display().to_string())
    );
    // rates[side][case][round]; the last side is memcpy.
    let mut rates = vec![vec![Vec::new(); CASES.len()]; sides.len() + 1];
    for round in 1..=repeat {
        let mut order: Vec<usize> = (0..=sides.len()).collect();
        let turn = round % order.len();
        order.rotate_left(turn);
        for s in order {
            let got = match sides.get(s) {
                Some(side) => round_of(side, round, total)?,
                None => {
                    let r = memcpy_round(ucx, total)?;
                    println!("round {round} memcpy done");
                    r
                }
            };
            for (c, g) in got.into_iter().enumerate() {
                rates[s][c].push(g);
            }
        }
    }
    table(&sides, &rates);
    println!(
        "targets (issue 50): 1 MiB at least 0.9x memcpy; 64 KiB (depth 16) at least 0.6x memcpy \
         and 1.2x UCX, one-sided on shared registrations 0.8x memcpy; the 64 B and 4 KiB rows \
         (one transfer at a time: GB/s x 10^3 / bytes = transfers per ms) ahead of UCX, the \
         4 KiB one 1.5x faster than before"
    );
    Ok(())
}

/// Prints each side's median `[range]` per case (GB/s; us per transfer for the small rows), then
/// per-round rate ratios (above 1: faster) of the Ferry sides against
/// memcpy, UCX and (where measured) the baseline.
fn table(sides: &[Side], rates: &[Vec<Vec<f64>>]) {
    let memcpy = sides.len();
    let ucx = sides.len() - 1;
    let base = sides.iter().position(|s| s.label == "ferry-base");
    let name = |(op, block, blocks): (&str, u64, u32)| {
        if block < 1024 {
            format!("{op} {blocks} x {block} B")
        } else {
            format!("{op} {blocks} x {} KiB", block >> 10)
        }
    };
    print!("\n{:<20}", "case, GB/s");
    for s in sides {
        print!(" {:>20}", s.label);
    }
    println!(" {:>20}", "memcpy");
    for (c, case) in CASES.iter().enumerate() {
        let (_, block, blocks) = *case;
        let per = block * u64::from(blocks);
        // A small transfer's rate is a time per transfer: shown as one, in us.
        let small = per < 64 << 10;
        print!("{:<20}", name(*case) + if small { ", us" } else { "" });
        for side in rates {
            let v: Vec<f64> = if small {
                side[c].iter().map(|g| per as f64 / g / 1e3).collect()
            } else {
                side[c].clone()
            };
            print!(" {:>20}", median_and_range(&v));
        }
        println!();
    }
    let ratio = |a: usize, b: usize, c: usize| -> Vec<f64> {
        rates[a][c]
            .iter()
            .zip(&rates[b][c])
            .map(|(x, y)| x / y)
            .collect()
    };
    println!("\nratios per round, median [range]:");
    for (c, case) in CASES.iter().enumerate() {
        for (a, side) in sides.iter().enumerate() {
            if a == ucx || side.label == "ferry-net" {
                continue;
            }
            let mut line = format!(
                "{:<20} {:<13} /memcpy {:>20}  /ucx {:>20}",
                name(*case),
                side.label,
                median_and_range(&ratio(a, memcpy, c)),
                median_and_range(&ratio(a, ucx, c)),
            );
            if let Some(b) = base.filter(|&b| b != a) {
                line += &format!("  /base {:>20}", median_and_range(&ratio(a, b, c)));
            }
            println!("{line}");
        }
    }
}
