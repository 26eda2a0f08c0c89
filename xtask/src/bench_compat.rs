//! The compatibility layers against the real wheels, on the same Python workload, in
//! alternating rounds (docs/mooncake.md, docs/nixl.md; figures in docs/performance.md):
//!
//! - `cargo xtask bench mooncake [--total BYTES] [--repeat N]`: `benches/mooncake_bench.py` on
//!   Mooncake's wheel (`mooncake-transfer-engine-non-cuda`, [`MOONCAKE`]) and on Ferry's:
//!   batch sync WRITEs and READs of 32 blocks of 1 MiB and of 64 KiB, then one-block 4 KiB
//!   `transfer_sync_write` against the same WRITE through Ferry's own Python API (targets: at
//!   least 2x at 1 MiB, 1.5x at 64 KiB, at most 1.3x the cost). P2PHANDSHAKE, TCP on both sides
//!   (`MC_FORCE_TCP=1`), Ferry on its default data plane. Mooncake's wheel needs
//!   `libibverbs.so.1` (`.ci/packages`) even for TCP.
//! - `cargo xtask bench nixl [--total BYTES] [--repeat N]`: `benches/nixl_bench.py` on NIXL's
//!   wheel ([`NIXL`], `--no-deps`, with NumPy) with UCX forced onto TCP (`UCX_TLS=tcp`) and with
//!   UCX's default transports (which copy process to process on one host), and on Ferry's: a
//!   READ of 64 blocks of 64 KiB by index (the KV-cache pattern), and of 1 MiB blocks (target:
//!   at least 3x UCX over TCP at 64 KiB).
//!
//! Each wheel goes into a throwaway environment under `<target>` (made once); Ferry's module is
//! built into the Python environment of `cargo xtask bench python` (`maturin develop
//! --release`). Each round starts a target and an initiator process per side; which side goes
//! first alternates.

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};

use anyhow::{Context, Result, bail};

use crate::util::{
    json_num, json_str, median_and_range, project_root, run as run_loud, total_and_repeat,
};

/// The Mooncake wheel compared against (the release the compatibility layer follows).
const MOONCAKE: &str = "mooncake-transfer-engine-non-cuda==0.3.13";

/// The NIXL wheels compared against (installed `--no-deps`: their CUDA dependencies are 5 GB).
pub(crate) const NIXL: [&str; 2] = ["nixl-cu12==1.5.1", "nixl==1.5.1"];

/// A throwaway environment `<target>/<name>` with `packages` installed (`--no-deps` when
/// `no_deps`), made once; its interpreter.
fn throwaway_venv(name: &str, packages: &[&str], no_deps: bool) -> Result<PathBuf> {
    let dir = crate::util::target_dir().join(name);
    let py = dir.join("bin/python");
    if !py.is_file() {
        run_loud(Command::new("python3").args(["-m", "venv"]).arg(&dir))?;
    }
    let mut pip = Command::new(&py);
    pip.args(["-m", "pip", "install", "-q", "--disable-pip-version-check"]);
    if no_deps {
        pip.arg("--no-deps");
    }
    run_loud(pip.args(packages))?;
    Ok(py)
}

/// One side of a comparison: how to start its Python on the workload script.
pub(crate) struct Side {
    pub(crate) label: &'static str,
    pub(crate) python: PathBuf,
    /// Arguments before the script (`-m ferry.mooncake` for Ferry).
    pub(crate) prefix: Vec<&'static str>,
    pub(crate) script: &'static str,
    pub(crate) env: Vec<(&'static str, &'static str)>,
    /// Put before the interpreter's own packages (`PYTHONPATH`): a Ferry package built
    /// elsewhere, or the real NIXL wheel's `site-packages`.
    pub(crate) path: Option<PathBuf>,
}

/// The environment every workload process runs with: numpy's OpenBLAS keeps one thread per
/// core spinning after its first call, which the workloads never make use of and which takes
/// CPU from whichever side runs (seen in a profile of `bench same-host`).
const QUIET_NUMPY: (&str, &str) = ("OPENBLAS_NUM_THREADS", "1");

impl Side {
    fn command(&self) -> Command {
        let mut c = Command::new(&self.python);
        c.args(&self.prefix)
            .arg(project_root().join(self.script))
            .env(QUIET_NUMPY.0, QUIET_NUMPY.1)
            .envs(self.env.iter().copied());
        if let Some(p) = &self.path {
            c.env("PYTHONPATH", p);
        }
        c
    }

    /// The interpreter on the script alone: no prefix, no environment of the side but numpy's.
    pub(crate) fn command_plain(&self) -> Command {
        let mut c = Command::new(&self.python);
        c.arg(project_root().join(self.script))
            .env(QUIET_NUMPY.0, QUIET_NUMPY.1);
        if let Some(p) = &self.path {
            c.env("PYTHONPATH", p);
        }
        c
    }
}

/// The result line of a workload's output: the first that starts with `BENCH ` (NIXL logs to
/// stdout too), or the first line.
pub(crate) fn result_line(out: &str) -> &str {
    out.lines()
        .find_map(|l| l.strip_prefix("BENCH "))
        .or_else(|| out.lines().next())
        .unwrap_or("")
        .trim()
}

/// A target process, killed on drop: its name (Mooncake) or metadata (NIXL) and buffer.
pub(crate) struct Target {
    child: Child,
    name: String,
    buffer: u64,
}

impl Target {
    pub(crate) fn start(side: &Side, key: &str) -> Result<Self> {
        let mut child = side
            .command()
            .arg("target")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .with_context(|| format!("starting the {} target", side.label))?;
        let out = child.stdout.take().context("target has no stdout")?;
        let mut reader = BufReader::new(out);
        let mut line = String::new();
        loop {
            line.clear();
            if reader.read_line(&mut line)? == 0 {
                bail!("the {} target exited without its line", side.label);
            }
            if line.trim_start().starts_with('{') || line.starts_with("BENCH ") {
                break;
            }
        }
        let line = result_line(&line).to_owned();
        let bad = || format!("the {} target printed {line:?}", side.label);
        let name = json_str(&line, key, 0).with_context(bad)?;
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
pub(crate) fn initiator(side: &Side, t: &Target, args: &[String]) -> Result<String> {
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
    Ok(result_line(&String::from_utf8_lossy(&out.stdout)).to_owned())
}

/// `cargo xtask bench mooncake`.
pub(crate) fn mooncake(args: &[String]) -> Result<()> {
    const USAGE: &str = "usage: cargo xtask bench mooncake [--total BYTES] [--repeat N]";
    let (total, repeat) = total_and_repeat(args, 1u64 << 30, 5, USAGE)?;
    let mooncake = throwaway_venv("mooncake-venv", &[MOONCAKE], false)?;
    let ferry_py = crate::python::bench_env()?;
    // TCP on both sides: Mooncake forced to it, Ferry kept off its same-host plane (which it
    // would take between two processes of one host; `bench same-host` measures that).
    let env = vec![
        ("MC_FORCE_TCP", "1"),
        ("MC_LOG_LEVEL", "WARNING"),
        ("FERRY_SAME_HOST", "off"),
    ];
    let script = "benches/mooncake_bench.py";
    let sides = [
        Side {
            label: "mooncake",
            python: mooncake,
            prefix: vec![],
            script,
            env: env.clone(),
            path: None,
        },
        Side {
            label: "ferry",
            python: ferry_py,
            prefix: vec!["-m", "ferry.mooncake"],
            script,
            env,
            path: None,
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
            let t = Target::start(side, "name")?;
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

/// NIXL's wheel (no CUDA dependencies, numpy beside it) in its throwaway venv, and the Python
/// with Ferry's wheel: the two interpreters of the NIXL API benches.
pub(crate) fn nixl_and_ferry() -> Result<(PathBuf, PathBuf)> {
    let nixl = throwaway_venv("nixl-venv", &NIXL, true)?;
    run_loud(Command::new(&nixl).args([
        "-m",
        "pip",
        "install",
        "-q",
        "--disable-pip-version-check",
        "numpy",
    ]))?;
    Ok((nixl, crate::python::bench_env()?))
}

/// `cargo xtask bench nixl`.
pub(crate) fn nixl(args: &[String]) -> Result<()> {
    const USAGE: &str = "usage: cargo xtask bench nixl [--total BYTES] [--repeat N]";
    let (total, repeat) = total_and_repeat(args, 1u64 << 30, 5, USAGE)?;
    let (nixl, ferry_py) = nixl_and_ferry()?;
    let script = "benches/nixl_bench.py";
    let sides = [
        Side {
            label: "ucx-tcp",
            python: nixl.clone(),
            prefix: vec![],
            script,
            env: vec![("UCX_TLS", "tcp")],
            path: None,
        },
        Side {
            label: "ucx",
            python: nixl,
            prefix: vec![],
            script,
            env: vec![],
            path: None,
        },
        Side {
            label: "ferry",
            python: ferry_py,
            prefix: vec!["-m", "ferry.nixl"],
            script,
            // The network plane, as UCX over TCP is: same-host copies are `bench same-host`'s.
            env: vec![
                ("FERRY_BIND_ADDRESS", "127.0.0.1"),
                ("FERRY_SAME_HOST", "off"),
            ],
            path: None,
        },
    ];
    let blocks: [u64; 2] = [64 << 10, 1 << 20];
    println!(
        "NIXL API, READ of 64 blocks by index, two processes on loopback ({} against Ferry's \
         wheel; UCX over TCP and with its default transports), {total} bytes per run, {repeat} \
         rounds, the order of the sides turning each round; GB/s = 10^9 B/s",
        NIXL.join(" ")
    );
    // rates[block][side]
    let mut rates = vec![vec![Vec::new(); sides.len()]; blocks.len()];
    for round in 1..=repeat {
        let mut order: Vec<usize> = (0..sides.len()).collect();
        order.rotate_left(round % sides.len());
        for &s in &order {
            let side = &sides[s];
            let t = Target::start(side, "metadata")?;
            for (b, block) in blocks.iter().enumerate() {
                let line = initiator(
                    side,
                    &t,
                    &[
                        "run".into(),
                        block.to_string(),
                        "--bytes".into(),
                        total.to_string(),
                    ],
                )?;
                let gbps =
                    json_num(&line, "gbps", 0).with_context(|| format!("no gbps in {line:?}"))?;
                println!(
                    "round {round} {:<8} {:>5} KiB blocks {gbps:>7.3} GB/s",
                    side.label,
                    block >> 10
                );
                rates[b][s].push(gbps);
            }
        }
    }
    println!(
        "\n{:<14} {:>22} {:>22} {:>22} {:>22} {:>22}",
        "blocks", "ucx-tcp GB/s", "ucx GB/s", "ferry GB/s", "ferry/ucx-tcp", "ferry/ucx"
    );
    for (b, block) in blocks.iter().enumerate() {
        let ratio = |other: usize| -> Vec<f64> {
            rates[b][2]
                .iter()
                .zip(&rates[b][other])
                .map(|(f, o)| f / o)
                .collect()
        };
        println!(
            "{:<14} {:>22} {:>22} {:>22} {:>22} {:>22}",
            format!("64 x {} KiB", block >> 10),
            median_and_range(&rates[b][0]),
            median_and_range(&rates[b][1]),
            median_and_range(&rates[b][2]),
            median_and_range(&ratio(0)),
            median_and_range(&ratio(1)),
        );
    }
    println!(
        "targets: at least 3x UCX over TCP at 64 KiB (Ferry's network plane here; its same-host \
         copies against UCX's are `cargo xtask bench same-host`)"
    );
    Ok(())
}
