//! `cargo xtask soft-roce [--host] [--require] [--require-bench] [--keep-share DIR] [--only TEXT]
//! [--repeat N]`: the RDMA
//! suite on real soft-RoCE (`rdma_rxe`) devices (docs/architecture.md section 7).
//!
//! Guest mode (the default) builds once, and caches outside the repo, a small Debian guest with
//! the scripts in `xtask/soft-roce/`; builds the RDMA test binaries and the `ferry` binary on the
//! host; stages them in a share folder with a `guest-test.sh` generated from
//! `xtask/soft-roce/guest/*.sh`; boots the guest under QEMU (TCG, 2 vCPUs), which brings up
//! `rxe0`/`rxe1`, runs `ib_write_bw` and `ib_read_bw` as the reference, `ferry doctor` and
//! `ferry topology`, every test binary with `--include-ignored --test-threads=1`, and the ferry
//! RDMA bench; and then prints a table whose last line is `ferry/ib_write_bw = R`.
//!
//! `--host` runs the same script on the host itself, where the kernel can load `rdma_rxe` (a
//! GitHub-hosted runner). Where neither can run, one line says why and the task succeeds, unless
//! `--require` is given.
//!
//! `--only TEXT` runs only the test binaries whose label (`package:target`) contains TEXT, and
//! `--repeat N` runs each N times in a row, each run its own result line (a run that fails once
//! in many is found by looping it in one boot).
//!
//! Environment: `FERRY_SOFT_ROCE_DIR` (image cache, default `~/.cache/ferry/soft-roce`),
//! `FERRY_SOFT_ROCE_TIMEOUT` (seconds for the whole guest run, default 1200). For `cargo xtask
//! ci` ([`from_ci`]): `FERRY_REQUIRE_SOFT_ROCE=1` requires the suite,
//! `FERRY_REQUIRE_SOFT_ROCE_BENCH=1` also requires the ferry bench to run, and
//! `FERRY_SOFT_ROCE=skip` skips it (when it is not required).
//!
//! One concern a module: [`host`] (can this machine run it), [`image`] (the cached guest image),
//! [`artifacts`] (host builds), [`stage`] (the share folder and `guest-test.sh`, with the ferry
//! bench's command lines), [`suite`] (one run) and [`report`] (the result log and the table).

pub(crate) mod artifacts;
mod host;
mod image;
mod report;
mod stage;
mod suite;

use anyhow::{Context, Result, bail};
use host::{guest_ready, host_ready};
use image::{cache_dir, ensure_image};
use std::path::PathBuf;

/// Message size of the reference perftests and of the ferry bench.
const OP_SIZE: u64 = 1 << 20;
/// Operations per run: perftest `-n`, and `--total OP_SIZE * ITERS` for the ferry bench.
const ITERS: u64 = 128;

/// How to run the suite: the flags of `cargo xtask soft-roce`, or what [`from_ci`] chose.
#[derive(Debug, Default)]
struct Opts {
    /// On the host itself rather than in the guest.
    host: bool,
    /// Not being able to run the suite is an error, not a skip.
    require: bool,
    /// The ferry bench not running (or not giving a rate) is a failure.
    require_bench: bool,
    /// Keep the share folder here rather than in a temporary folder removed after a pass.
    keep_share: Option<PathBuf>,
    /// Run only the test binaries whose label contains this.
    only: Option<String>,
    /// Runs of each test binary (0 is taken as 1).
    repeat: u32,
}

/// `cargo xtask soft-roce ...`: exits non-zero when the suite failed, or could not run and
/// `--require` was given.
pub(crate) fn run(args: &[String]) -> Result<()> {
    let mut opts = Opts::default();
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--host" => opts.host = true,
            "--require" => opts.require = true,
            "--require-bench" => opts.require_bench = true,
            "--keep-share" => {
                let dir = it.next().context("--keep-share needs a directory")?;
                opts.keep_share = Some(PathBuf::from(dir));
            }
            "--only" => {
                let text = it
                    .next()
                    .context("--only needs a text to match test labels")?;
                opts.only = Some(text.clone());
            }
            "--repeat" => {
                let n = it.next().context("--repeat needs a count")?;
                opts.repeat = n
                    .parse()
                    .ok()
                    .filter(|&n: &u32| n > 0)
                    .with_context(|| format!("--repeat takes a count above 0, not `{n}`"))?;
            }
            other => bail!(
                "soft-roce: unknown argument `{other}` \
                 (usage: cargo xtask soft-roce [--host] [--require] [--require-bench] \
                 [--keep-share DIR] [--only TEXT] [--repeat N])"
            ),
        }
    }
    let ready = if opts.host {
        host_ready()
    } else {
        guest_ready()
    };
    if let Err(why) = ready {
        return unavailable(&why, opts.require);
    }
    let failures = image_suite_report(&opts)?;
    if !failures.is_empty() {
        // After the ratio line on purpose: that line stays the last one of the report.
        std::process::exit(1);
    }
    Ok(())
}

/// The `soft-roce` step of `cargo xtask ci`: runs the suite on the host where the kernel can load
/// `rdma_rxe`, else in the guest where QEMU and debootstrap are (or can be made) available, else
/// prints one skip line. Fails when the suite fails, or when it cannot run and
/// `FERRY_REQUIRE_SOFT_ROCE=1`.
pub(crate) fn from_ci() -> Result<()> {
    let require = env_is("FERRY_REQUIRE_SOFT_ROCE", "1");
    if !require && env_is("FERRY_SOFT_ROCE", "skip") {
        eprintln!("soft-roce: SKIPPED: FERRY_SOFT_ROCE=skip");
        return Ok(());
    }
    let mut opts = Opts {
        require,
        require_bench: env_is("FERRY_REQUIRE_SOFT_ROCE_BENCH", "1"),
        ..Opts::default()
    };
    match host_ready() {
        Ok(()) => opts.host = true,
        Err(host_why) => {
            if let Err(guest_why) = guest_ready() {
                return unavailable(
                    &format!("{guest_why}; and on the host: {host_why}"),
                    require,
                );
            }
        }
    }
    let failures = image_suite_report(&opts)?;
    if !failures.is_empty() {
        bail!("soft-roce: {}", failures.join("; "));
    }
    Ok(())
}

/// After the readiness check: builds the guest image unless it is cached (guest mode), runs the
/// suite and prints its report. Returns what failed: empty when the run passed, and also when the
/// image could not be built and the suite is not required (one skip line is printed then). `Err`
/// when the image could not be built and the suite is required, or the run could not be started.
fn image_suite_report(opts: &Opts) -> Result<Vec<String>> {
    if !opts.host
        && let Err(e) = ensure_image(&cache_dir())
    {
        unavailable(
            &format!("building the guest image failed: {e:#}"),
            opts.require,
        )?;
        return Ok(Vec::new());
    }
    let report = suite::suite(opts)?;
    let failures = report.failures(opts.require_bench);
    report.print(&failures);
    Ok(failures)
}

/// Whether the environment variable `name` is set to `value`.
fn env_is(name: &str, value: &str) -> bool {
    std::env::var(name).is_ok_and(|v| v == value)
}

/// The suite cannot run because of `why`: an error when `require`, else one skip line and `Ok`.
fn unavailable(why: &str, require: bool) -> Result<()> {
    if require {
        bail!("soft-roce: cannot run the suite, and it is required: {why}");
    }
    eprintln!(
        "soft-roce: SKIPPED: {why} (--require or FERRY_REQUIRE_SOFT_ROCE=1 makes this an error)"
    );
    Ok(())
}
