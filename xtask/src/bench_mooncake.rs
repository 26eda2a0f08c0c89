//! `cargo xtask bench mooncake [--total BYTES] [--repeat N]`: the Mooncake API workload
//! (`benches/mooncake_bench.py`) on Mooncake's own wheel and on Ferry's, in alternating rounds,
//! and their ratios (docs/mooncake.md, "Speed"; targets: at least 2x at 1 MiB blocks, 1.5x at
//! 64 KiB).
//!
//! Mooncake's wheel (`mooncake-transfer-engine-non-cuda`, [`MOONCAKE`]) is installed with pip
//! into a throwaway environment, `<target>/mooncake-venv` (it needs `libibverbs.so.1`, which
//! `.ci/packages` installs, even for TCP); Ferry's module is built into the Python environment
//! of `cargo xtask bench python` (`maturin develop --release`). Each round starts a target and
//! an initiator process per engine (P2PHANDSHAKE, TCP on both sides: `MC_FORCE_TCP=1`, Ferry
//! on its default data plane) and runs batch sync WRITEs and READs of 32 blocks of 1 MiB and of
//! 64 KiB, then one-block 4 KiB `transfer_sync_write` against the same WRITE through Ferry's
//! own Python API (target: at most 1.3x).

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};

use anyhow::{Context, Result, bail};

use crate::util::{
    json_num, json_str, median_and_range, project_root, run as run_loud, total_and_repeat,
};

/// The wheel compared against (the Mooncake release the compatibility layer follows).
const MOONCAKE: &str = "mooncake-transfer-engine-non-cuda==0.3.13";

const USAGE: &str = "usage: cargo xtask bench mooncake [--total BYTES] [--repeat N]";

/// The workload script.
fn script() -> PathBuf {
    project_root().join("benches/mooncake_bench.py")
}

/// The throwaway environment with Mooncake's wheel, made once.
fn mooncake_venv() -> Result<PathBuf> {
    let dir = crate::util::target_dir().join("mooncake-venv");
    let py = dir.join("bin/python");
    if !py.is_file() {
        run_loud(Command::new("python3").args(["-m", "venv"]).arg(&dir))?;
    }
    run_loud(Command::new(&py).args([
        "-m",
        "pip",
        "install",
        "-q",
        "--disable-pip-version-check",
        MOONCAKE,
    ]))?;
    Ok(py)
}

/// One engine: how to start its Python on the workload script.
struct Side {
    label: &'static str,
    python: PathBuf,
    /// Arguments before the script (`-m ferry.mooncake` for Ferry).
    prefix: Vec<&'static str>,
}

impl Side {
    fn command(&self) -> Command {
        let mut c = Command::new(&self.python);
        c.args(&self.prefix)
            .arg(script())
            .env("MC_FORCE_TCP", "1")
            .env("MC_LOG_LEVEL", "WARNING");
        c
    }
}

/// A target process, killed on drop.
struct Target {
    child: Child,
    name: String,
    buffer: u64,
}

impl Target {
    fn start(side: &Side) -> Result<Self> {
        let mut child = side
            .command()
            .arg("target")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .with_context(|| format!("starting the {} target", side.label))?;
        let out = child.stdout.take().context("target has no stdout")?;
        let mut line = String::new();
        BufReader::new(out).read_line(&mut line)?;
        let bad = || format!("the {} target printed {line:?}", side.label);
        let name = json_str(&line, "name", 0).with_context(bad)?;
        // Addresses are below 2^53, so the number is exact.
        let buffer = json_num(&line, "buffer", 0).with_context(bad)? as u64;
        Ok(Self {
            child,
            name,
            buffer,
        })
    }
}

impl Drop for Target {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Runs `side`'s initiator with `args` against `t`; its JSON line.
fn initiator(side: &Side, t: &Target, args: &[String]) -> Result<String> {
    let out = side
        .command()
        .args(args.iter().take(1))
        .arg(&t.name)
        .arg(t.buffer.to_string())
        .args(args.iter().skip(1))
        .output()
        .with_context(|| format!("running the {} initiator", side.label))?;
    if !out.status.success() {
        bail!(
            "the {} initiator ({args:?}) failed: {}",
            side.label,
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned())
}

/// `cargo xtask bench mooncake`.
pub(crate) fn run(args: &[String]) -> Result<()> {
    let (total, repeat) = total_and_repeat(args, 1u64 << 30, 5, USAGE)?;
    let mooncake = mooncake_venv()?;
    let ferry_py = crate::python::bench_env()?;
    let sides = [
        Side {
            label: "mooncake",
            python: mooncake,
            prefix: vec![],
        },
        Side {
            label: "ferry",
            python: ferry_py,
            prefix: vec!["-m", "ferry.mooncake"],
        },
    ];
    let cases: [(&str, u64); 4] = [
        ("write", 1 << 20),
        ("read", 1 << 20),
        ("write", 64 << 10),
        ("read", 64 << 10),
    ];
    println!(
        "Mooncake API, batch sync ops of 32 blocks, two processes on loopback, P2PHANDSHAKE, TCP \
         ({MOONCAKE} against Ferry's wheel), {total} bytes per run, {repeat} alternating rounds; \
         GB/s = 10^9 B/s"
    );
    let mut rates = vec![[Vec::new(), Vec::new()]; cases.len()];
    let mut small = [Vec::new(), Vec::new()];
    for round in 1..=repeat {
        // Alternate which engine goes first.
        let order: [usize; 2] = if round % 2 == 1 { [0, 1] } else { [1, 0] };
        for &s in &order {
            let side = &sides[s];
            let t = Target::start(side)?;
            for (i, (op, block)) in cases.iter().enumerate() {
                let line = initiator(
                    side,
                    &t,
                    &[
                        "run".into(),
                        (*op).into(),
                        block.to_string(),
                        "--bytes".into(),
                        total.to_string(),
                    ],
                )?;
                let gbps =
                    json_num(&line, "gbps", 0).with_context(|| format!("no gbps in {line:?}"))?;
                println!(
                    "round {round} {:<8} {op:<5} {:>7} KiB blocks {gbps:>7.3} GB/s",
                    side.label,
                    block >> 10
                );
                rates[i][s].push(gbps);
            }
            if s == 1 {
                let line = initiator(side, &t, &["small".into()])?;
                let ours = json_num(&line, "mooncake_api_us", 0).context("no mooncake_api_us")?;
                let native = json_num(&line, "ferry_api_us", 0).context("no ferry_api_us")?;
                println!(
                    "round {round} ferry    4 KiB transfer_sync_write {ours:.1} us, Ferry's own \
                     Python API {native:.1} us"
                );
                small[0].push(ours);
                small[1].push(native);
            }
        }
    }
    println!(
        "\n{:<26} {:>22} {:>22} {:>22}",
        "case", "mooncake GB/s", "ferry GB/s", "ratio"
    );
    for (i, (op, block)) in cases.iter().enumerate() {
        let ratios: Vec<f64> = rates[i][1]
            .iter()
            .zip(&rates[i][0])
            .map(|(f, m)| f / m)
            .collect();
        println!(
            "{:<26} {:>22} {:>22} {:>22}",
            format!("batch sync {op} {} KiB", block >> 10),
            median_and_range(&rates[i][0]),
            median_and_range(&rates[i][1]),
            median_and_range(&ratios)
        );
    }
    let costs: Vec<f64> = small[0].iter().zip(&small[1]).map(|(a, b)| a / b).collect();
    println!(
        "4 KiB transfer_sync_write against Ferry's own API: {} us against {} us, cost ratio {} \
         (target: at most 1.3)",
        median_and_range(&small[0]),
        median_and_range(&small[1]),
        median_and_range(&costs)
    );
    println!("targets: at least 2x Mooncake at 1 MiB blocks, 1.5x at 64 KiB");
    Ok(())
}
