//! The fault suite's table, the load bench and the soak.
//!
//! - `cargo xtask faults [--check]`: runs the fault suite (`tests/tests/faults.rs`, the same
//!   tests `cargo test` runs) with `FERRY_FAULTS_TABLE` set, so that each case records its row,
//!   and writes the table into docs/faults.md between its markers (`--check`: fails if the
//!   table there differs in its verdicts instead).
//! - `cargo xtask bench load [--plane tcp|uring|both] [stress load options]`: the release build
//!   of `stress` (ferry-benches) with hundreds of peers, some stalled behind the fault proxy.
//! - `cargo xtask soak --minutes N` (or `--seconds N`) `[--plane tcp|uring] [--workers N]`: the
//!   release build of `stress soak`. `cargo xtask ci` runs a short one on a debug build
//!   ([`from_ci`]).

use anyhow::{Context, Result, bail};
use ferry_tests::{FaultRow, TABLE_VAR};

use crate::util::{cargo, project_root, run as run_loud};

const BEGIN: &str = "<!-- faults table: cargo xtask faults -->";
const END: &str = "<!-- end of faults table -->";

/// `cargo xtask faults`.
pub(crate) fn faults(args: &[String]) -> Result<()> {
    let check = match args {
        [] => false,
        [c] if c == "--check" => true,
        _ => bail!("usage: cargo xtask faults [--check]"),
    };
    let table = crate::util::target_dir().join("faults-table.tsv");
    let _ = std::fs::remove_file(&table);
    // The suite runs its cases one at a time anyway (it counts the whole process's threads).
    let status = cargo()
        .args(["test", "-p", "ferry-tests", "--test", "faults"])
        .env(TABLE_VAR, &table)
        .status()
        .context("running the fault suite")?;
    let text = std::fs::read_to_string(&table).unwrap_or_default();
    let mut rows = FaultRow::parse_all(&text)?;
    if rows.is_empty() {
        bail!("the fault suite recorded no row ({status})");
    }
    // Faults in the order the suite names them, each on both planes.
    let order = |r: &FaultRow| {
        let f = [
            "cut",
            "reset",
            "half",
            "stall 1",
            "stall past",
            "trickle",
            "server",
            "client",
        ]
        .iter()
        .position(|p| r.fault.starts_with(p))
        .unwrap_or(99);
        (f, r.plane.clone())
    };
    rows.sort_by_key(order);
    let md = FaultRow::markdown(&rows);
    print!("{md}");
    let doc = project_root().join("docs/faults.md");
    let old =
        std::fs::read_to_string(&doc).with_context(|| format!("reading {}", doc.display()))?;
    let (Some(b), Some(e)) = (old.find(BEGIN), old.find(END)) else {
        bail!("{} lacks the markers {BEGIN} and {END}", doc.display());
    };
    if check {
        let verdicts = |s: &str| -> Vec<String> {
            s.lines()
                .filter(|l| l.starts_with("| ") && !l.starts_with("| fault"))
                .map(|l| l.split(" | ").take(5).collect::<Vec<_>>().join("|"))
                .collect()
        };
        if verdicts(&old[b..e]) != verdicts(&md) {
            bail!("docs/faults.md's table differs from this run: run cargo xtask faults");
        }
    } else {
        let new = format!("{}{BEGIN}\n{md}{}", &old[..b], &old[e..]);
        std::fs::write(&doc, new).with_context(|| format!("writing {}", doc.display()))?;
        eprintln!("wrote the table into {}", doc.display());
    }
    if !status.success() || rows.iter().any(|r| !r.passed()) {
        bail!("the fault suite failed ({status}); see the table");
    }
    Ok(())
}

fn build_stress() -> Result<std::path::PathBuf> {
    run_loud(cargo().args([
        "build",
        "--release",
        "-p",
        "ferry-benches",
        "--bin",
        "stress",
    ]))?;
    Ok(crate::util::release_bin("stress"))
}

/// `cargo xtask bench load`.
pub(crate) fn load(args: &[String]) -> Result<()> {
    planes_of("load", args)
}

/// `cargo xtask bench idle`: many idle clients on one server (`stress idle`).
pub(crate) fn idle(args: &[String]) -> Result<()> {
    planes_of("idle", args)
}

/// `cargo xtask bench fanout`: one client opening many peers (`stress fanout`).
pub(crate) fn fanout(args: &[String]) -> Result<()> {
    planes_of("fanout", args)
}

/// Runs `stress MODE` once per data plane of `--plane` (both by default).
fn planes_of(mode: &str, args: &[String]) -> Result<()> {
    let mut planes = vec!["tcp".to_owned(), "uring".to_owned()];
    let mut rest = Vec::new();
    let mut it = args.iter();
    while let Some(a) = it.next() {
        if a == "--plane" {
            let p = it.next().context("--plane needs a value")?;
            if p != "both" {
                planes = vec![p.clone()];
            }
        } else {
            rest.push(a.clone());
        }
    }
    let bin = build_stress()?;
    for plane in planes {
        let mut cmd = std::process::Command::new(&bin);
        cmd.args([mode, "--plane", &plane]).args(&rest);
        run_loud(&mut cmd)?;
    }
    Ok(())
}

/// `cargo xtask soak`.
pub(crate) fn soak(args: &[String]) -> Result<()> {
    let mut rest = Vec::new();
    let mut seconds = 600.0f64;
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let mut num = |name: &str| -> Result<f64> {
            it.next()
                .with_context(|| format!("{name} needs a value"))?
                .parse()
                .with_context(|| name.to_owned())
        };
        match a.as_str() {
            "--minutes" => seconds = num("--minutes")? * 60.0,
            "--seconds" => seconds = num("--seconds")?,
            "--plane" | "--workers" => {
                rest.push(a.clone());
                rest.push(it.next().context("a value")?.clone());
            }
            other => bail!(
                "unknown option {other} (soak takes --minutes N or --seconds N, --plane P, --workers N)"
            ),
        }
    }
    let bin = build_stress()?;
    let mut cmd = std::process::Command::new(bin);
    cmd.args(["soak", "--seconds", &seconds.to_string()])
        .args(&rest);
    run_loud(&mut cmd)
}

/// The CI step: a 30-second soak on the debug build the test step compiled the dependencies of.
pub(crate) fn from_ci() -> Result<()> {
    run_loud(cargo().args([
        "run",
        "-p",
        "ferry-benches",
        "--bin",
        "stress",
        "--",
        "soak",
        "--seconds",
        "30",
    ]))
}
