//! One run of the suite: build on the host, stage the share folder, run `guest-test.sh` on the
//! host or boot the guest with it, and read its result log into a [`Report`].

use super::Opts;
use super::artifacts::build_on_host;
use super::host::root_command;
use super::image::{cache_dir, scripts_dir};
use super::report::Report;
use super::stage::{sh_quote, stage, staged_name};
use crate::util::project_root;
use anyhow::{Context, Result, bail};
use std::process::Command;
use std::time::Instant;

/// Runs the suite as `opts` says and returns its report. The share folder is removed after a
/// passing run unless it is `--keep-share`'s; after a failing one, the log (or the guest console)
/// is printed and the folder kept. `Err` only when the run itself could not be started.
pub(super) fn suite(opts: &Opts) -> Result<Report> {
    let t0 = Instant::now();
    let cache = cache_dir();
    let mut builds = build_on_host()?;
    builds.select(opts.only.as_deref(), opts.repeat);
    let (share, temporary) = match &opts.keep_share {
        Some(d) => (d.clone(), false),
        None => (
            std::env::temp_dir().join(format!("ferry-soft-roce-{}", std::process::id())),
            true,
        ),
    };
    std::fs::create_dir_all(&share).with_context(|| format!("creating {}", share.display()))?;
    let share = share
        .canonicalize()
        .with_context(|| format!("resolving {}", share.display()))?;
    stage(&share, opts.host, &builds)?;
    let log_path = share.join("result.log");
    if log_path.exists() {
        std::fs::remove_file(&log_path)
            .with_context(|| format!("removing {}", log_path.display()))?;
    }
    let t_run = Instant::now();
    let run_status = if opts.host {
        eprintln!("soft-roce: running the suite on the host (rxe0/rxe1 on a veth pair)");
        let Some(mut cmd) = root_command("bash") else {
            bail!("soft-roce: root or password-less sudo needed for --host");
        };
        let line = format!(
            "{} 2>&1 | tee {}; exit ${{PIPESTATUS[0]}}",
            sh_quote(&share.join("guest-test.sh").display().to_string()),
            sh_quote(&log_path.display().to_string())
        );
        cmd.arg("-c").arg(line);
        cmd.status().context("running guest-test.sh on the host")?
    } else {
        let timeout = std::env::var("FERRY_SOFT_ROCE_TIMEOUT").unwrap_or_else(|_| "1800".into());
        eprintln!(
            "soft-roce: booting the guest (QEMU TCG, 2 vCPUs, up to {timeout}s); results appear as @@ferry lines"
        );
        Command::new("bash")
            .arg(scripts_dir().join("run-vm.sh"))
            .env("SOFT_ROCE_DIR", &cache)
            .env("SHARE", &share)
            .env("REPO", project_root())
            .env("CONSOLE", share.join("console.log"))
            .env("TIMEOUT", timeout)
            .env("ACCEL", "tcg")
            .env("SMP", "2")
            .status()
            .context("running xtask/soft-roce/run-vm.sh")?
    };
    let run_s = t_run.elapsed().as_secs_f64();
    let log = std::fs::read_to_string(&log_path).unwrap_or_default();
    let mut report = Report::parse(&log, opts.host);
    report.run_ok = run_status.success();
    report.run_s = run_s;
    report.total_s = t0.elapsed().as_secs_f64();
    report.broken_builds = builds.broken;
    report.notes = builds.notes;
    report.expected_tests = builds
        .tests
        .iter()
        .map(|t| (staged_name(t), t.label.clone()))
        .collect();
    let failed = !report.failures(opts.require_bench).is_empty();
    if failed {
        eprintln!("---- {} ----", log_path.display());
        eprint!("{log}");
        if log.is_empty() {
            let console = std::fs::read_to_string(share.join("console.log")).unwrap_or_default();
            eprintln!("---- guest console ----");
            eprint!("{console}");
        }
        eprintln!("---- end ----");
    }
    if temporary && !failed {
        let _ = std::fs::remove_dir_all(&share);
    } else {
        eprintln!("soft-roce: share folder kept: {}", share.display());
    }
    Ok(report)
}
