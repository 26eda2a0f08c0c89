//! `cargo xtask bench ray [--no-build] [options of bench_ray.py]`: Ray's tensor transports on
//! one host, in one Ray session, in alternating rounds (docs/ray.md, *The bench*; figures in
//! docs/performance.md).
//!
//! It runs `crates/python/benches/bench_ray.py` with the frameworks environment's interpreter
//! (`<target>/frameworks-venv`: Ray 2.60, torch, NumPy; docs/ray.md says how to make it), after
//! building Ferry's module optimized into the Python environment of `cargo xtask bench python`
//! (`maturin develop --release`; the frameworks environment imports the same in-place build).
//! The rows: Ray's object store, Ray's NIXL transport on the real NIXL wheel (the packages of
//! `<target>/nixl-real-venv`, `nixl` and `nixl-cu13` 1.5.1, linked into the real-NIXL actors'
//! `PYTHONPATH`; the row is skipped, saying so, where that environment is missing), the same
//! transport under `FERRY_AS_NIXL=1`, `FERRY` (per object, a held storage, into a target
//! buffer), memcpy, and one object read by 4 actors on `FERRY` and on `FERRY_RELAY`. Every
//! other argument goes to the script (`--mib`, `--parts`, `--transfers`, `--rounds`, `--modes`,
//! `--readers`, `--json`, `--limit`); `--cluster` runs two Ray nodes in two network namespaces
//! against iperf3, `--fleet` one object read by `--readers` actors on as many nodes, each in a
//! namespace behind a link shaped to `--rate` (200 Mbit/s), against one reader alone.
//!
//! Every exit path of the script (a failure, a signal, its own `--limit`) stops the Ray
//! processes it started and checks that none is left: its local session's by id, its
//! namespaces' all (never `ray stop`, which stops every Ray on the machine).

use std::path::PathBuf;
use std::process::Command;

use anyhow::{Result, bail};

use crate::util::{project_root, run as run_loud, target_dir};

/// The frameworks environment's interpreter.
fn frameworks_python() -> PathBuf {
    target_dir().join("frameworks-venv/bin/python")
}

/// The `site-packages` of `<target>/nixl-real-venv`, where it exists.
fn nixl_site() -> Option<PathBuf> {
    let lib = target_dir().join("nixl-real-venv/lib");
    let entries = std::fs::read_dir(&lib).ok()?;
    entries
        .filter_map(|e| e.ok())
        .map(|e| e.path().join("site-packages"))
        .find(|p| p.join("nixl").is_dir())
}

/// Runs the bench (the module's docs).
pub(crate) fn run(args: &[String]) -> Result<()> {
    let py = frameworks_python();
    if !py.is_file() {
        bail!(
            "bench ray: no {} (make the frameworks environment first: a venv with \
             \"ray==2.60.*\", torch, numpy and pytest, and Ferry's module on its path; docs/ray.md)",
            py.display()
        );
    }
    let build = !args.iter().any(|a| a == "--no-build");
    let mut rest: Vec<String> = args
        .iter()
        .filter(|a| *a != "--no-build")
        .cloned()
        .collect();
    if build {
        crate::python::bench_env()?;
    }
    if !rest.iter().any(|a| a == "--nixl-site") {
        match nixl_site() {
            Some(site) => rest.extend(["--nixl-site".to_owned(), site.display().to_string()]),
            None => eprintln!(
                "bench ray: no {}/nixl-real-venv with the real nixl wheel: the nixl-real row is \
                 skipped (make it with `python -m venv` and `pip install --no-deps nixl==1.5.1 \
                 nixl-cu13==1.5.1`)",
                target_dir().display()
            ),
        }
    }
    let root = project_root();
    run_loud(
        Command::new(&py)
            .current_dir(&root)
            .arg(root.join("crates/python/benches/bench_ray.py"))
            .args(&rest),
    )
}
