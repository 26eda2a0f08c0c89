//! `cargo xtask frameworks` and `cargo xtask ci`'s `frameworks` step: Ferry against the
//! frameworks that name it (Ray, verl, vLLM), installed from the package index into cached
//! virtual environments.
//!
//! Each environment in [`ENVIRONMENTS`] is `<target>/<name>`, a link into a cache outside the
//! checkout (`FERRY_VENV_CACHE`, default `~/.cache/ferry/venvs`; see [`env_dir`]), made once with
//! the interpreter named by `FERRY_PYTHON` (default `python3`); its pip installs run again only when
//! their arguments change (the arguments are kept in the environment's `.ferry-provisioned`), so
//! a cached environment costs a second. The wheel the `python` step built (`<target>/wheels`,
//! built here if absent) is installed into each without dependencies, replacing any copy there,
//! and the environment's test files from `crates/python/tests` run against it under pytest with
//! the environment's `FERRY_REQUIRE_*` variables set, so a test that would skip for a missing
//! framework fails instead.
//!
//! An environment that cannot be made (no interpreter, no venv module, pip failing: no network)
//! is skipped with the reason, unless `FERRY_REQUIRE_PYTHON=1`, as in the `python` step; a test
//! that fails always fails the step. `cargo xtask frameworks --only NAME` provisions and tests
//! one environment; `--provision` installs without testing (what a developer runs before
//! `target/<name>/bin/python -m pytest ...` by hand).

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};

use crate::util::{project_root, run as run_loud, target_dir};

/// One cached environment: its directory name, its pip installs (in order), the test files it
/// runs (`crates/python/tests` glob patterns) and the facility variables set for them.
struct Environment {
    name: &'static str,
    installs: &'static [&'static [&'static str]],
    tests: &'static [&'static str],
    require: &'static [&'static str],
    /// Free space its installation needs (GiB): the installed size and pip's unpacking beside it.
    needs_gib: u64,
}

/// The environments. torch from the index is the CUDA build; it runs on a machine without a GPU.
const ENVIRONMENTS: &[Environment] = &[
    Environment {
        name: "frameworks-venv",
        // verl without its dependencies (a full install downgrades `packaging` and brings
        // wandb, datasets and more), then what `verl.checkpoint_engine` imports, pinned as
        // verl pins them. LMCache the same way (its own pins would replace NumPy and protobuf):
        // its P2P transfer channels import without a GPU.
        installs: &[
            &["torch", "ray[default]==2.60.*", "pytest", "numpy"],
            &["--no-deps", "verl==0.9.1"],
            &[
                "tensordict>=0.8,<=0.10.0,!=0.9.0",
                "transformers>=5.5.3,<5.11,!=5.6.0",
                "omegaconf>=2.2,<2.4",
                "codetiming",
                "orjson",
                "uvicorn",
                "fastapi",
            ],
            &[
                "--no-deps",
                "lmcache==0.5.6",
                "sortedcontainers",
                "prometheus_client",
                "py-cpuinfo",
                "psutil",
                "aiohttp",
                "multidict",
                "yarl",
                "propcache",
                "aiosignal",
                "frozenlist",
                "aiohappyeyeballs",
                "cachetools",
                "msgspec",
                "pyzmq",
                "numba",
                "llvmlite",
            ],
        ],
        tests: &["test_ray*.py", "test_verl*.py", "test_nixl_lmcache.py"],
        require: &[
            "FERRY_REQUIRE_RAY",
            "FERRY_REQUIRE_VERL",
            "FERRY_REQUIRE_LMCACHE",
        ],
        needs_gib: 9,
    },
    Environment {
        name: "vllm-venv",
        // vLLM pins its torch (2.14), hence an environment of its own.
        installs: &[&["vllm==0.33.*", "pytest"]],
        tests: &["test_vllm*.py"],
        require: &["FERRY_REQUIRE_VLLM"],
        needs_gib: 13,
    },
];

/// `python` arguments that install quietly with pip, keeping no second copy of the downloads.
const PIP_INSTALL: [&str; 6] = [
    "-m",
    "pip",
    "install",
    "-q",
    "--disable-pip-version-check",
    "--no-cache-dir",
];

const USAGE: &str = "usage: cargo xtask frameworks [--only NAME] [--provision]";

/// `cargo xtask frameworks [--only NAME] [--provision]`.
pub(crate) fn run(args: &[String]) -> Result<()> {
    let mut only = None;
    let mut provision_only = false;
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--only" => only = Some(it.next().context(USAGE)?.clone()),
            "--provision" => provision_only = true,
            _ => bail!("{USAGE}"),
        }
    }
    if let Some(name) = &only
        && !ENVIRONMENTS
            .iter()
            .any(|e| e.name == name || e.name == format!("{name}-venv"))
    {
        bail!(
            "no environment {name:?}; environments: {}",
            ENVIRONMENTS
                .iter()
                .map(|e| e.name)
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
    for env in ENVIRONMENTS {
        if only
            .as_ref()
            .is_some_and(|n| env.name != n && env.name != format!("{n}-venv"))
        {
            continue;
        }
        let Some(py) = provision(env)? else { continue };
        if !provision_only {
            test(env, &py)?;
        }
    }
    Ok(())
}

/// `cargo xtask ci`'s step: every environment, provisioned and tested.
pub(crate) fn from_ci() -> Result<()> {
    run(&[])
}

/// Whether `FERRY_REQUIRE_PYTHON=1`.
fn required() -> bool {
    std::env::var("FERRY_REQUIRE_PYTHON").is_ok_and(|v| v == "1")
}

/// The environment's interpreter, made and installed if need be; `None` (with a skip line) when
/// that fails and Python is not required.
fn provision(env: &Environment) -> Result<Option<PathBuf>> {
    match try_provision(env) {
        Ok(py) => Ok(Some(py)),
        Err(e) if !required() => {
            eprintln!(
                "frameworks: SKIPPED {}: {e:#} (set FERRY_REQUIRE_PYTHON=1 to make this a failure)",
                env.name
            );
            Ok(None)
        }
        Err(e) => Err(e.context(format!(
            "provisioning {} (FERRY_REQUIRE_PYTHON=1 says this machine can)",
            env.name
        ))),
    }
}

/// Where an environment lives: `<target>/<name>` when that exists (a directory, or the link this
/// step leaves), else `<cache>/<name>`, linked from `<target>/<name>`, where the cache is
/// `FERRY_VENV_CACHE` or `~/.cache/ferry/venvs`: outside the checkout, so a clean clone on the
/// same machine finds the environments made before and does not download them again.
fn env_dir(name: &str) -> Result<PathBuf> {
    let local = target_dir().join(name);
    if local.exists() {
        // The link's target: scripts the environment writes name its real path, which a later
        // clone's link leaves valid.
        return std::fs::canonicalize(&local)
            .with_context(|| format!("resolving {}", local.display()));
    }
    let cache = match std::env::var_os("FERRY_VENV_CACHE") {
        Some(dir) => PathBuf::from(dir),
        None => PathBuf::from(std::env::var_os("HOME").context("HOME is not set")?)
            .join(".cache/ferry/venvs"),
    };
    let dir = cache.join(name);
    std::fs::create_dir_all(&cache).with_context(|| format!("making {}", cache.display()))?;
    if let Some(parent) = local.parent() {
        std::fs::create_dir_all(parent)?;
    }
    // A dangling link from an earlier cache is replaced.
    let _ = std::fs::remove_file(&local);
    std::os::unix::fs::symlink(&dir, &local)
        .with_context(|| format!("linking {} to {}", local.display(), dir.display()))?;
    Ok(dir)
}

fn try_provision(env: &Environment) -> Result<PathBuf> {
    let dir = env_dir(env.name)?;
    let py = dir.join("bin/python");
    if !py.is_file() {
        let base = std::env::var("FERRY_PYTHON").unwrap_or_else(|_| "python3".to_owned());
        run_loud(Command::new(&base).args(["-m", "venv"]).arg(&dir))
            .with_context(|| format!("`{base} -m venv` (install python3-venv)"))?;
    }
    let marker = dir.join(".ferry-provisioned");
    let wanted = provision_record(env);
    let have = std::fs::read_to_string(&marker).unwrap_or_default();
    if have != wanted {
        check_free_space(env, &dir)?;
        for install in env.installs {
            run_loud(Command::new(&py).args(PIP_INSTALL).args(*install))
                .with_context(|| format!("pip install {}", install.join(" ")))?;
        }
        std::fs::write(&marker, &wanted)
            .with_context(|| format!("writing {}", marker.display()))?;
    } else {
        eprintln!(
            "frameworks: {} is provisioned ({})",
            env.name,
            marker.display()
        );
    }
    Ok(py)
}

/// Fails before pip starts when the disk holding `dir` has less free space than `env` needs, so
/// a full disk is named as such rather than as a pip error halfway through a download.
fn check_free_space(env: &Environment, dir: &Path) -> Result<()> {
    let out = Command::new("df")
        .args(["-B1", "--output=avail"])
        .arg(dir)
        .output()
        .context("running df")?;
    let text = String::from_utf8_lossy(&out.stdout);
    let Some(free) = text
        .lines()
        .nth(1)
        .and_then(|l| l.trim().parse::<u64>().ok())
    else {
        eprintln!(
            "frameworks: could not read free space for {} from df",
            dir.display()
        );
        return Ok(());
    };
    let free_gib = free >> 30;
    if free_gib < env.needs_gib {
        bail!(
            "provisioning {} needs about {} GiB free on the disk of {}; {} GiB are free \
             (free space, or point FERRY_VENV_CACHE at a larger disk)",
            env.name,
            env.needs_gib,
            dir.display(),
            free_gib
        );
    }
    Ok(())
}

/// What the marker holds: one line per pip install, in order.
fn provision_record(env: &Environment) -> String {
    env.installs.iter().map(|i| i.join(" ") + "\n").collect()
}

/// Installs the wheel and runs the environment's test files with its facilities required.
fn test(env: &Environment, py: &Path) -> Result<()> {
    let wheel = crate::python::wheel_for_tests()?;
    run_loud(
        Command::new(py)
            .args(PIP_INSTALL)
            .args(["--force-reinstall", "--no-deps"])
            .arg(&wheel),
    )?;
    let files = test_files(env)?;
    if files.is_empty() {
        eprintln!("frameworks: {} has no test files yet", env.name);
        return Ok(());
    }
    let mut cmd = Command::new(py);
    cmd.current_dir(project_root())
        .args(["-m", "pytest", "-q", "-p", "no:cacheprovider"])
        .args(&files)
        .env("RUST_BACKTRACE", "1");
    for var in env.require {
        cmd.env(var, "1");
    }
    run_loud(&mut cmd).with_context(|| format!("the {} tests", env.name))
}

/// The files of `crates/python/tests` that match the environment's patterns (`prefix*.py`).
fn test_files(env: &Environment) -> Result<Vec<String>> {
    let dir = project_root().join("crates/python/tests");
    let mut files = Vec::new();
    for e in std::fs::read_dir(&dir).with_context(|| format!("listing {}", dir.display()))? {
        let name = e?.file_name().to_string_lossy().into_owned();
        if env.tests.iter().any(|p| matches(p, &name)) {
            files.push(format!("crates/python/tests/{name}"));
        }
    }
    files.sort();
    Ok(files)
}

/// `pattern` is `PREFIX*SUFFIX` or a plain name.
fn matches(pattern: &str, name: &str) -> bool {
    match pattern.split_once('*') {
        Some((pre, suf)) => {
            name.len() >= pre.len() + suf.len() && name.starts_with(pre) && name.ends_with(suf)
        }
        None => pattern == name,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn patterns_match_prefix_and_suffix() {
        assert!(matches("test_ray*.py", "test_ray.py"));
        assert!(matches("test_ray*.py", "test_ray_cluster.py"));
        assert!(!matches("test_ray*.py", "test_rayx.pyc"));
        assert!(!matches("test_ray*.py", "test_verl.py"));
        assert!(matches("conftest.py", "conftest.py"));
    }

    #[test]
    fn the_record_changes_with_the_installs() {
        let a = Environment {
            name: "a",
            installs: &[&["x==1"]],
            tests: &[],
            require: &[],
            needs_gib: 0,
        };
        let b = Environment {
            installs: &[&["x==2"]],
            ..a
        };
        assert_ne!(provision_record(&a), provision_record(&b));
        assert_eq!(provision_record(&a), "x==1\n");
    }

    #[test]
    fn a_disk_too_small_is_named_before_pip_runs() {
        let small = Environment {
            name: "small",
            installs: &[],
            tests: &[],
            require: &[],
            needs_gib: 0,
        };
        let huge = Environment {
            name: "huge",
            needs_gib: 1 << 40,
            ..small
        };
        let dir = std::env::temp_dir();
        assert!(check_free_space(&small, &dir).is_ok());
        let err = format!("{:#}", check_free_space(&huge, &dir).unwrap_err());
        assert!(err.contains("provisioning huge needs about"), "{err}");
    }
}
