//! `cargo xtask mutants [--file TEXT]... [--list]`: mutation testing of the code that checks
//! input from outside, with cargo-mutants.
//!
//! cargo-mutants plants one defect at a time (a condition negated, a comparison flipped, a
//! function body replaced by a default) and runs the tests; a mutant the tests do not catch
//! ("missed") is a check nothing tests. The default scope is what decides what a peer may do:
//! the wire decoders, the handshake and its authentication, the stream protocol's client and server, the registry, the
//! file segments' checks and both servers' request paths. `--file TEXT` narrows it to the scope's
//! files whose path contains TEXT (repeatable), `--list` only lists the mutants. cargo-mutants is installed with
//! `cargo install cargo-mutants --locked` when it is missing. The report is cargo-mutants'
//! `mutants.out/` under `target/mutants`; the missed ones are printed at the end. A full run
//! takes hours on two cores: each mutant is a build and a test run.

use anyhow::{Context, Result, bail};

use crate::util::{cargo, have, project_root, run as run_loud};

/// The code that checks input from outside: (its package, the file, the packages whose tests
/// cover it).
const SCOPE: &[(&str, &str, &[&str])] = &[
    (
        "ferry-engine-core",
        "crates/core/src/wire/*.rs",
        &["ferry-engine-core"],
    ),
    (
        "ferry-engine-core",
        "crates/core/src/handshake.rs",
        &["ferry-engine-core"],
    ),
    (
        "ferry-engine-core",
        "crates/core/src/auth.rs",
        &["ferry-engine-core"],
    ),
    (
        "ferry-engine-core",
        "crates/core/src/stream/client.rs",
        &["ferry-engine-core"],
    ),
    (
        "ferry-engine-core",
        "crates/core/src/stream/server.rs",
        &["ferry-engine-core"],
    ),
    (
        "ferry-engine-core",
        "crates/core/src/transport.rs",
        &["ferry-engine-core"],
    ),
    (
        "ferry-registry",
        "crates/registry/src/registry.rs",
        &["ferry-registry"],
    ),
    ("ferry-file", "crates/file/src/segment.rs", &["ferry-file"]),
    (
        "ferry-transport-tcp",
        "crates/transport-tcp/src/server.rs",
        &["ferry-transport-tcp", "ferry-tests"],
    ),
    (
        "ferry-transport-uring",
        "crates/transport-uring/src/server/*.rs",
        &["ferry-transport-uring", "ferry-tests"],
    ),
];

/// Runs cargo-mutants over [`SCOPE`] (or the `--file` globs).
pub(crate) fn run(args: &[String]) -> Result<()> {
    let mut files: Vec<String> = Vec::new();
    let mut list = false;
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--file" => files.push(it.next().context("--file needs a path part")?.clone()),
            "--list" => list = true,
            other => bail!("unknown option {other} (mutants takes --file TEXT, --list)"),
        }
    }
    if !have("cargo-mutants") {
        eprintln!("mutants: installing cargo-mutants from crates.io");
        run_loud(cargo().args(["install", "cargo-mutants", "--locked"]))?;
    }
    let scope: Vec<_> = SCOPE
        .iter()
        .filter(|(_, f, _)| files.is_empty() || files.iter().any(|g| f.contains(g.as_str())))
        .collect();
    if scope.is_empty() {
        bail!("no file of the mutation scope matches {files:?}");
    }
    let out = crate::util::target_dir().join("mutants");
    let mut cmd = cargo();
    cmd.arg("mutants")
        .arg("--output")
        .arg(&out)
        .arg("--test-workspace=false")
        .arg("--timeout-multiplier")
        .arg("3");
    let mut packages: Vec<&str> = Vec::new();
    let mut tests: Vec<&str> = Vec::new();
    for (pkg, file, by) in &scope {
        cmd.args(["--file", file]);
        packages.push(pkg);
        tests.extend(by.iter().copied());
    }
    packages.sort_unstable();
    packages.dedup();
    tests.sort_unstable();
    tests.dedup();
    for p in packages {
        cmd.args(["--package", p]);
    }
    for t in tests {
        cmd.args(["--test-package", t]);
    }
    if list {
        cmd.arg("--list");
    }
    // cargo-mutants exits non-zero when mutants are missed: that is the report, not a failure
    // to run.
    let status = cmd
        .current_dir(project_root())
        .status()
        .context("running cargo mutants")?;
    let missed = std::fs::read_to_string(out.join("mutants.out/missed.txt")).unwrap_or_default();
    if !list {
        println!("missed mutants ({}):", missed.lines().count());
        print!("{missed}");
    }
    match status.code() {
        Some(0) | Some(2) | Some(3) => Ok(()),
        _ => bail!("cargo mutants failed: {status}"),
    }
}
