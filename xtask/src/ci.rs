//! `cargo xtask ci`: the whole gate, in the order a failure is cheapest to find.

use crate::util::{self, cargo};
use anyhow::Result;

pub(crate) fn run(_args: &[String]) -> Result<()> {
    step("fmt", || {
        util::run(cargo().args(["fmt", "--all", "--", "--check"]))
    })?;
    step("clippy", || {
        util::run(cargo().args([
            "clippy",
            "--workspace",
            "--all-targets",
            "--",
            "-D",
            "warnings",
        ]))
    })?;
    step("test", || {
        util::run(
            cargo()
                .args(["test", "--workspace", "--all-targets"])
                .env("RUST_BACKTRACE", "1"),
        )
    })?;
    step("doctest", || {
        util::run(cargo().args(["test", "--workspace", "--doc"]))
    })?;
    step("doc", || {
        util::run(
            cargo()
                .args(["doc", "--workspace", "--no-deps"])
                .env("RUSTDOCFLAGS", "-D warnings"),
        )
    })?;
    step("soft-roce", crate::soft_roce::from_ci)?;
    eprintln!("xtask ci: all steps passed");
    Ok(())
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
