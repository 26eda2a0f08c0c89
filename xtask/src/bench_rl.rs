//! `cargo xtask bench rl [--no-build] [options of bench_rl.py]`: RL weight sync on one host, 1
//! trainer to N = 4 receivers, in alternating rounds (docs/rl.md, *The bench*; figures in
//! docs/performance.md).
//!
//! It runs `crates/python/benches/bench_rl.py` with the frameworks environment's interpreter
//! (`<target>/frameworks-venv`: verl 0.9.1, torch; docs/rl.md says how to install verl there),
//! after building Ferry's module optimized (`maturin develop --release`, as `cargo xtask bench
//! python` does) and putting that in-place build (`crates/python/python`) first on `PYTHONPATH`,
//! for the script, its receivers and the vLLM row: the frameworks environments hold an installed
//! wheel that would shadow it (CI's), which measured whatever that wheel was. `--no-build` with
//! `PYTHONPATH` set keeps it, for a before/after round of another build. The rows: `ferry.verl`
//! to one receiver alone (ideal), `ferry.verl` to N, a point-to-point chain over
//! `ferry.mooncake` (rank i reads from rank i-1, as verl's mooncake engine does), and
//! `ferry.vllm` to N through vLLM's own engines (`bench_rl_vllm.py`, which the script starts
//! once in `<target>/vllm-venv`; without that environment the row says it is missing).
//! Targets (issue 48): at N = 4 at least 0.85 of ideal and at least 2x the chain. Every other
//! argument goes to the script (`--mib` (1024), `--tensor-mib`, `--bucket-mib` (2048, verl's
//! default), `--receivers`, `--rounds`, `--modes`, `--json`).

use std::path::PathBuf;
use std::process::Command;

use anyhow::{Result, bail};

use crate::util::{project_root, run as run_loud, target_dir};

/// The frameworks environment's interpreter.
fn frameworks_python() -> PathBuf {
    target_dir().join("frameworks-venv/bin/python")
}

/// Runs the bench (the module's docs).
pub(crate) fn run(args: &[String]) -> Result<()> {
    let py = frameworks_python();
    if !py.is_file() {
        bail!(
            "bench rl: no {} (make the frameworks environment first: `cargo xtask frameworks \
             --provision`, or a venv with torch and verl 0.9.1 as docs/rl.md says)",
            py.display()
        );
    }
    let build = !args.iter().any(|a| a == "--no-build");
    let rest: Vec<&String> = args.iter().filter(|a| *a != "--no-build").collect();
    if build {
        crate::python::bench_env()?;
    }
    let root = project_root();
    let tree = root.join("crates/python/python");
    let path = match std::env::var_os("PYTHONPATH") {
        Some(p) if !build => p,
        _ => tree.into_os_string(),
    };
    run_loud(
        Command::new(&py)
            .current_dir(&root)
            .env("PYTHONPATH", path)
            .arg(root.join("crates/python/benches/bench_rl.py"))
            .args(rest),
    )
}
