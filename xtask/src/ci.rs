//! `cargo xtask ci`: the whole gate, in the order a failure is cheapest to find.
//! `cargo xtask ci --step NAME` runs one step alone (`fmt`, `clippy`, `test`, `doctest`,
//! `doc`, `soak`, `python`, `soft-roce`).

use crate::util::{self, cargo};
use anyhow::{Result, bail};

type Step = (&'static str, fn() -> Result<()>);

const STEPS: &[Step] = &[
    ("fmt", || {
        util::run(cargo().args(["fmt", "--all", "--", "--check"]))
    }),
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
        [flag, name] if flag == "--step" => match STEPS.iter().find(|(n, _)| n == name) {
            Some((name, f)) => step(name, *f),
            None => bail!(
                "no ci step {name:?}; steps: {}",
                STEPS.iter().map(|(n, _)| *n).collect::<Vec<_>>().join(", ")
            ),
        },
        _ => bail!("usage: cargo xtask ci [--step NAME]"),
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
