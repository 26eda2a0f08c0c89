//! The Python package (`crates/python`): `cargo xtask wheel`, `cargo xtask ci`'s `python` step
//! and `cargo xtask bench python`.
//!
//! Each makes (once) a virtual environment in `<target>/python-venv` with the interpreter named
//! by `FERRY_PYTHON` (default `python3`) and installs maturin, pytest, NumPy, mypy and
//! safetensors into it from the package index with pip. Debian needs `python3-venv` for the
//! environment; `python3-dev` is not needed (the module is abi3 and links no libpython).
//!
//! `wheel` builds the release abi3 wheel, stripped, into `<target>/wheels` (`maturin build`;
//! the platform tag is what maturin's manylinux check finds the extension's symbols allow).
//!
//! The CI step builds that wheel, installs it into a new environment whose PATH has no cargo
//! or rustc and checks `import ferry` (from site-packages), `python -m ferry --version` and a
//! loopback `python -m ferry bench` there; then installs it into the test environment and runs
//! mypy's stubtest and the pytest suite in `crates/python/tests` against the installed
//! package. Without an interpreter or the venv module it skips with the reason, unless
//! `FERRY_REQUIRE_PYTHON=1` (then it fails), as the FERRY_REQUIRE_* gates of the Rust tests do.
//!
//! `bench python` builds the module into the environment (`maturin develop --release`), starts
//! one `ferry serve` (release build) and runs, in `--repeat` alternating rounds, `ferry bench
//! PEER --op read` (the Rust CLI) and `python -m ferry bench PEER --op read` (the same loop
//! through the Python API) against it, 1 MiB READs, the same bytes each; it prints each round
//! and the median ratio Python/Rust (target: at least 0.9).

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use anyhow::{Context, Result, bail};

use crate::util::{cargo, have, json_num, median, project_root, run as run_loud, total_and_repeat};

/// `python` arguments that install quietly with pip.
const PIP_INSTALL: [&str; 5] = ["-m", "pip", "install", "-q", "--disable-pip-version-check"];

/// The virtual environment's directory.
fn venv_dir() -> PathBuf {
    crate::util::target_dir().join("python-venv")
}

/// The interpreter to make the environment with.
fn base_python() -> String {
    std::env::var("FERRY_PYTHON").unwrap_or_else(|_| "python3".to_owned())
}

/// Whether `FERRY_REQUIRE_PYTHON=1`.
fn required() -> bool {
    std::env::var("FERRY_REQUIRE_PYTHON").is_ok_and(|v| v == "1")
}

/// A facility is missing: `Ok(None)` with a skip line, or an error when it is required.
fn missing(reason: String, require: bool) -> Result<Option<PathBuf>> {
    if require {
        bail!("{reason} (FERRY_REQUIRE_PYTHON=1 says this machine has it)");
    }
    eprintln!("python: SKIPPED: {reason} (set FERRY_REQUIRE_PYTHON=1 to make this a failure)");
    Ok(None)
}

/// The environment's interpreter, made and provisioned if need be; `None` when Python or its
/// venv module is missing and not required.
fn venv(require: bool) -> Result<Option<PathBuf>> {
    let dir = venv_dir();
    let py = dir.join("bin/python");
    if !py.is_file() {
        let base = base_python();
        let on_path = if base.contains('/') {
            Path::new(&base).is_file()
        } else {
            have(&base)
        };
        if !on_path {
            return missing(format!("no Python interpreter `{base}`"), require);
        }
        eprintln!("$ {base} -m venv {}", dir.display());
        let out = Command::new(&base)
            .args(["-m", "venv"])
            .arg(&dir)
            .output()
            .with_context(|| format!("running {base} -m venv"))?;
        if !out.status.success() {
            // Debian without python3-venv: "ensurepip is not available".
            let _ = std::fs::remove_dir_all(&dir);
            return missing(
                format!(
                    "`{base} -m venv` failed (install python3-venv): {}",
                    String::from_utf8_lossy(&out.stdout).trim()
                ),
                require,
            );
        }
    }
    // Already installed packages are not fetched again.
    run_loud(Command::new(&py).args(PIP_INSTALL).args([
        "maturin",
        "pytest",
        "numpy",
        "mypy",
        "safetensors",
    ]))?;
    Ok(Some(py))
}

/// Builds the extension into the environment (`release`: optimized, as for the bench).
fn develop(py: &Path, release: bool) -> Result<()> {
    let bin = py.parent().context("venv has no bin directory")?;
    let path = venv_path(bin)?;
    let mut cmd = Command::new(bin.join("maturin"));
    cmd.current_dir(project_root())
        .args(["develop", "--manifest-path", "crates/python/Cargo.toml"])
        .env("VIRTUAL_ENV", venv_dir())
        .env("PATH", path);
    if release {
        cmd.arg("--release");
    }
    run_loud(&mut cmd)
}

/// The wheels' directory: `<target>/wheels`.
fn wheels_dir() -> PathBuf {
    crate::util::target_dir().join("wheels")
}

/// Builds the abi3 wheel (release) into [`wheels_dir`] with the environment's maturin and
/// returns its path. maturin checks the extension's symbols against the manylinux policies and
/// tags the wheel with the oldest glibc it runs on (`--compatibility` is left to its check, so
/// the tag claims only what the symbols show); the tag is in the file name.
fn build_wheel(py: &Path) -> Result<PathBuf> {
    let dir = wheels_dir();
    // One wheel of this version in the folder, so `pip install target/wheels/*.whl` is exact.
    if dir.is_dir() {
        for e in std::fs::read_dir(&dir).with_context(|| format!("listing {}", dir.display()))? {
            let p = e?.path();
            if p.extension().is_some_and(|x| x == "whl") {
                std::fs::remove_file(&p).with_context(|| format!("removing {}", p.display()))?;
            }
        }
    }
    let bin = py.parent().context("venv has no bin directory")?;
    run_loud(
        Command::new(bin.join("maturin"))
            .current_dir(project_root())
            .args([
                "build",
                "--release",
                "--strip",
                "--manifest-path",
                "crates/python/Cargo.toml",
                "--out",
            ])
            .arg(&dir)
            .env("PATH", venv_path(bin)?),
    )?;
    let mut wheels: Vec<PathBuf> = std::fs::read_dir(&dir)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "whl"))
        .collect();
    match wheels.len() {
        1 => Ok(wheels.remove(0)),
        n => bail!("maturin left {n} wheels in {}", dir.display()),
    }
}

/// The wheel in [`wheels_dir`] (what the `python` step just built), built now if there is none:
/// the package the frameworks step installs into its environments.
pub(crate) fn wheel_for_tests() -> Result<PathBuf> {
    let dir = wheels_dir();
    let mut wheels: Vec<PathBuf> = std::fs::read_dir(&dir)
        .map(|r| {
            r.filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.extension().is_some_and(|x| x == "whl"))
                .collect()
        })
        .unwrap_or_default();
    if wheels.len() == 1 {
        let wheel = wheels.remove(0);
        eprintln!("python: using the built wheel {}", wheel.display());
        return Ok(wheel);
    }
    let py = venv(true)?.context("no Python environment")?;
    build_wheel(&py)
}

/// PATH with the environment's `bin` first.
fn venv_path(bin: &Path) -> Result<std::ffi::OsString> {
    Ok(std::env::join_paths(
        std::iter::once(bin.to_path_buf()).chain(std::env::split_paths(
            &std::env::var_os("PATH").unwrap_or_default(),
        )),
    )?)
}

/// PATH without any directory that holds `cargo` or `rustc`: what a Python user without Rust
/// has.
fn path_without_rust() -> Result<std::ffi::OsString> {
    Ok(std::env::join_paths(
        std::env::split_paths(&std::env::var_os("PATH").unwrap_or_default())
            .filter(|d| !d.join("cargo").exists() && !d.join("rustc").exists()),
    )?)
}

/// `cargo xtask wheel`: builds the wheel and prints its path.
pub(crate) fn wheel(args: &[String]) -> Result<()> {
    if !args.is_empty() {
        bail!("usage: cargo xtask wheel");
    }
    let py = venv(true)?.context("no Python environment")?;
    let wheel = build_wheel(&py)?;
    println!("{}", wheel.display());
    Ok(())
}

/// Installs `wheel` into a new environment with no Rust toolchain on PATH and checks what a
/// user does first: `import ferry` from site-packages, `python -m ferry --version`, and a
/// loopback transfer (`python -m ferry bench`, which serves itself).
fn check_wheel_without_rust(wheel: &Path) -> Result<()> {
    let dir = crate::util::target_dir().join("wheel-check-venv");
    if dir.exists() {
        std::fs::remove_dir_all(&dir).with_context(|| format!("removing {}", dir.display()))?;
    }
    let path = path_without_rust()?;
    run_loud(
        Command::new(base_python())
            .args(["-m", "venv"])
            .arg(&dir)
            .env("PATH", &path),
    )?;
    let py = dir.join("bin/python");
    run_loud(
        Command::new(&py)
            .args(PIP_INSTALL)
            .arg("--no-index")
            .arg(wheel)
            .env("PATH", &path),
    )?;
    let scratch = std::env::temp_dir();
    let check = |args: &[&str]| -> Result<String> {
        let out = Command::new(&py)
            .args(args)
            .current_dir(&scratch)
            .env("PATH", &path)
            .output()
            .with_context(|| format!("running python {args:?}"))?;
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        if !out.status.success() {
            bail!(
                "python {args:?} from the installed wheel failed: {text} {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        eprintln!("wheel check: python {} -> {}", args.join(" "), text.trim());
        Ok(text)
    };
    let file = check(&["-c", "import ferry; print(ferry.__file__)"])?;
    if !file.contains("site-packages") {
        bail!("`import ferry` found {file:?}, not the installed wheel");
    }
    check(&["-m", "ferry", "--version"])?;
    let bench = check(&["-m", "ferry", "bench", "--total", "64MiB", "--json"])?;
    let rate = json_num(&bench, "gb_per_s", 0)
        .with_context(|| format!("no gb_per_s in the wheel's bench output {bench:?}"))?;
    if rate <= 0.0 {
        bail!("the wheel's loopback bench moved nothing: {bench}");
    }
    Ok(())
}

/// `cargo xtask ci`'s `python` step: build the wheel, check it in an environment without Rust,
/// install it into the test environment, check the type stubs against it (mypy's stubtest) and
/// run the pytest suite against the installed package (not an editable build).
pub(crate) fn from_ci() -> Result<()> {
    let Some(py) = venv(required())? else {
        return Ok(());
    };
    let wheel = build_wheel(&py)?;
    check_wheel_without_rust(&wheel)?;
    run_loud(
        Command::new(&py)
            .args(PIP_INSTALL)
            .args(["--force-reinstall", "--no-deps"])
            .arg(&wheel),
    )?;
    run_loud(Command::new(&py).current_dir(project_root()).args([
        "-m",
        "mypy.stubtest",
        "ferry._ferry",
    ]))?;
    run_loud(
        Command::new(&py)
            .current_dir(project_root())
            .args([
                "-m",
                "pytest",
                "crates/python/tests",
                "-q",
                "-p",
                "no:cacheprovider",
            ])
            .env("RUST_BACKTRACE", "1"),
    )
}

/// A `ferry serve` process on loopback, killed on drop.
struct Serve {
    child: Child,
    addr: String,
}

impl Serve {
    fn start(segment_bytes: u64) -> Result<Self> {
        let bin = crate::util::release_bin("ferry");
        let mut child = Command::new(&bin)
            .args(["serve", "--listen", "127.0.0.1:0", "--segment"])
            .arg(format!("bench={segment_bytes}"))
            .stdout(Stdio::piped())
            .spawn()
            .with_context(|| format!("starting {} serve", bin.display()))?;
        let stdout = child.stdout.take().context("ferry serve has no stdout")?;
        let mut serve = Self {
            child,
            addr: String::new(),
        };
        for line in BufReader::new(stdout).lines() {
            let line = line.context("reading ferry serve's output")?;
            if let Some(addr) = line.strip_prefix("listening on ") {
                serve.addr = addr.trim().to_owned();
                break;
            }
        }
        if serve.addr.is_empty() {
            bail!("ferry serve ended without saying where it listens");
        }
        Ok(serve)
    }
}

impl Drop for Serve {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// GB/s of one bench run (`cmd` prints the JSON report); `who` names it in errors.
fn gbps(cmd: &mut Command, who: &str) -> Result<f64> {
    let out = cmd.output().with_context(|| format!("running {who}"))?;
    let text = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        bail!(
            "{who} failed: {text} {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    json_num(&text, "gb_per_s", 0).with_context(|| format!("no gb_per_s in {who}'s {text:?}"))
}

/// The bench environment's interpreter with Ferry's module built into it, optimized
/// (`cargo xtask bench mooncake` runs Ferry's side there).
pub(crate) fn bench_env() -> Result<PathBuf> {
    let py = venv(true)?.context("no Python environment")?;
    develop(&py, true)?;
    Ok(py)
}

/// `cargo xtask bench python [--total BYTES] [--repeat N]`.
pub(crate) fn bench(args: &[String]) -> Result<()> {
    const USAGE: &str = "usage: cargo xtask bench python [--total BYTES] [--repeat N]";
    let (total, repeat) = total_and_repeat(args, 2u64 << 30, 5, USAGE)?;
    run_loud(cargo().args(["build", "--release", "-p", "ferry-engine-cli"]))?;
    let py = venv(true)?.context("no Python environment")?;
    develop(&py, true)?;
    // One op in flight per slot: the 8 MiB that `ferry bench` serves itself on loopback.
    let serve = Serve::start(8 << 20)?;
    let total_s = total.to_string();
    let common = [
        serve.addr.as_str(),
        "--op",
        "read",
        "--op-size",
        "1MiB",
        "--total",
        &total_s,
        "--json",
    ];
    println!(
        "1 MiB READs from one `ferry serve` on loopback ({}), {total} bytes per run, {repeat} \
         rounds of the Rust CLI and the Python API back to back; GB/s = 10^9 B/s",
        serve.addr
    );
    println!(
        "{:<6} {:>10} {:>10} {:>8}",
        "round", "rust", "python", "ratio"
    );
    let (mut rust, mut python, mut ratios) = (Vec::new(), Vec::new(), Vec::new());
    for round in 1..=repeat {
        let r = gbps(
            Command::new(crate::util::release_bin("ferry"))
                .arg("bench")
                .args(common),
            "ferry bench",
        )?;
        let p = gbps(
            Command::new(&py)
                .args(["-m", "ferry", "bench"])
                .args(common),
            "python -m ferry bench",
        )?;
        println!("{round:<6} {r:>10.3} {p:>10.3} {:>8.3}", p / r);
        rust.push(r);
        python.push(p);
        ratios.push(p / r);
    }
    let lo = ratios.iter().copied().fold(f64::INFINITY, f64::min);
    let hi = ratios.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    println!(
        "median {:>10.3} {:>10.3} {:>8.3}  (ratio range {lo:.3}-{hi:.3}; target: at least 0.9)",
        median(&rust),
        median(&python),
        median(&ratios)
    );
    Ok(())
}
