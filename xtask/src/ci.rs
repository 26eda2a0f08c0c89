//! `cargo xtask ci`: the whole gate, in the order a failure is cheapest to find.
//! `cargo xtask ci --step NAME` runs one step alone (`fmt`, `tidy`, `clippy`, `test`, `doctest`,
//! `doc`, `soak`, `python`, `frameworks`, `soft-roce`).
//!
//! `cargo xtask ci --repeat N` runs the whole test suite (`cargo test --workspace --all-targets
//! --no-fail-fast`) N times in a row, whatever fails, and ends with each test that failed and
//! in how many runs: the hunt for flaky tests. Set the `FERRY_REQUIRE_*` variables as `.ci/run`
//! does, so no test skips its way to green.

use crate::util::{self, cargo};
use anyhow::{Result, bail};

type Step = (&'static str, fn() -> Result<()>);

const STEPS: &[Step] = &[
    ("fmt", || {
        util::run(cargo().args(["fmt", "--all", "--", "--check"]))
    }),
    // The docs against the tree: no build, under a second.
    ("tidy", || crate::tidy::run(&[])),
    ("clippy", || {
        util::run(cargo().args([
            "clippy",
            "--workspace",
            "--all-targets",
            "--",
            "-D",
            "warnings",
        ]))
    }),
    ("test", || {
        util::run(
            cargo()
                .args(["test", "--workspace", "--all-targets"])
                .env("RUST_BACKTRACE", "1"),
        )
    }),
    ("doctest", || {
        util::run(cargo().args(["test", "--workspace", "--doc"]))
    }),
    ("doc", || {
        util::run(
            cargo()
                .args(["doc", "--workspace", "--no-deps"])
                .env("RUSTDOCFLAGS", "-D warnings"),
        )
    }),
    ("soak", crate::stress::from_ci),
    ("python", crate::python::from_ci),
    ("frameworks", crate::frameworks::from_ci),
    ("soft-roce", crate::soft_roce::from_ci),
];

pub(crate) fn run(args: &[String]) -> Result<()> {
    match args {
        [] => {
            for (name, f) in STEPS {
                step(name, *f)?;
            }
            eprintln!("xtask ci: all steps passed");
            Ok(())
        }
        [flag, n] if flag == "--repeat" => {
            let n: u32 = n
                .parse()
                .ok()
                .filter(|n| *n > 0)
                .ok_or_else(|| anyhow::anyhow!("--repeat takes a positive count, not {n:?}"))?;
            repeat(n)
        }
        [flag, name] if flag == "--step" => match STEPS.iter().find(|(n, _)| n == name) {
            Some((name, f)) => step(name, *f),
            None => bail!(
                "no ci step {name:?}; steps: {}",
                STEPS.iter().map(|(n, _)| *n).collect::<Vec<_>>().join(", ")
            ),
        },
        _ => bail!("usage: cargo xtask ci [--step NAME | --repeat N]"),
    }
}

fn step(name: &str, f: impl FnOnce() -> Result<()>) -> Result<()> {
    let t = std::time::Instant::now();
    eprintln!("== xtask ci: {name}");
    let r = f();
    eprintln!(
        "== xtask ci: {name} {} in {:.1}s",
        if r.is_ok() { "ok" } else { "FAILED" },
        t.elapsed().as_secs_f64()
    );
    r
}

/// The names of the tests a `cargo test` output says failed (`test NAME ... FAILED`), with the
/// test binary they ran in where the output says (`Running ... (BINARY)`).
fn failed_tests(output: &str) -> Vec<String> {
    let mut binary = String::new();
    let mut failed = Vec::new();
    for line in output.lines() {
        let line = line.trim();
        if let Some(rest) = line.strip_prefix("Running ") {
            // `Running unittests src/lib.rs (target/debug/deps/ferry_core-1a2b)`: the source,
            // and the binary, which names the crate.
            binary = match rest.split_once(" (") {
                Some((what, bin)) => {
                    let bin = bin.trim_end_matches(')');
                    let bin = bin.rsplit('/').next().unwrap_or(bin);
                    format!("{what} [{bin}]")
                }
                None => rest.to_owned(),
            };
        } else if let Some(name) = line
            .strip_prefix("test ")
            .and_then(|l| l.strip_suffix(" ... FAILED"))
        {
            failed.push(format!("{binary}: {name}"));
        }
    }
    failed
}

/// `--repeat N`: the test suite N times; a summary of every failure.
fn repeat(n: u32) -> Result<()> {
    use std::collections::BTreeMap;
    let mut failures: BTreeMap<String, u32> = BTreeMap::new();
    let mut failed_runs = 0;
    for run in 1..=n {
        let t = std::time::Instant::now();
        eprintln!("== xtask ci --repeat: run {run} of {n}");
        // One pipe for both streams: cargo writes `Running BINARY` to stderr and the tests
        // write their results to stdout, and the order between them names each failure's binary.
        let (mut reader, writer) = std::io::pipe()?;
        let mut child = cargo()
            .args(["test", "--workspace", "--all-targets", "--no-fail-fast"])
            .env("RUST_BACKTRACE", "1")
            .stdout(writer.try_clone()?)
            .stderr(writer)
            .spawn()?;
        let mut text = String::new();
        {
            use std::io::{BufRead, Write};
            let mut lines = std::io::BufReader::new(&mut reader);
            let mut line = Vec::new();
            while lines.read_until(b'\n', &mut line)? > 0 {
                std::io::stdout().write_all(&line)?;
                text.push_str(&String::from_utf8_lossy(&line));
                line.clear();
            }
        }
        let status = child.wait()?;
        let failed = failed_tests(&text);
        if !status.success() {
            failed_runs += 1;
            if failed.is_empty() {
                *failures
                    .entry("(a test binary failed to build or crashed; see the log)".to_owned())
                    .or_default() += 1;
            }
        }
        for f in failed {
            *failures.entry(f).or_default() += 1;
        }
        eprintln!(
            "== xtask ci --repeat: run {run} {} in {:.0}s",
            if status.success() { "passed" } else { "FAILED" },
            t.elapsed().as_secs_f64()
        );
    }
    eprintln!(
        "== xtask ci --repeat: {} of {n} runs passed",
        n - failed_runs
    );
    for (name, count) in &failures {
        eprintln!("   failed in {count} of {n} runs: {name}");
    }
    if failed_runs > 0 {
        bail!("{failed_runs} of {n} runs of the test suite failed");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn failed_tests_are_named_with_their_binary() {
        let out = "     Running tests/in_process.rs (target/debug/deps/in_process-ca11)\n\
                   test a ... ok\n\
                   test relay::b ... FAILED\n\
                   \n     Running unittests src/lib.rs (target/debug/deps/ferry-12)\n\
                   test c ... FAILED\n";
        assert_eq!(
            failed_tests(out),
            vec![
                "tests/in_process.rs [in_process-ca11]: relay::b".to_owned(),
                "unittests src/lib.rs [ferry-12]: c".to_owned()
            ]
        );
    }
}
