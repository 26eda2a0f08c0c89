//! `cargo xtask`: the project's automation, one module per task.
//!
//! `main` only dispatches; each task lives in its own module.
#![forbid(unsafe_code)]

mod ci;
mod util;

use anyhow::{Result, bail};

const USAGE: &str = "\
usage: cargo xtask <task> [args]

tasks:
  ci                     fmt check, clippy -D warnings, all tests, docs with warnings denied
";

fn main() -> Result<()> {
    let mut args = std::env::args().skip(1);
    let task = args.next().unwrap_or_default();
    let rest: Vec<String> = args.collect();
    match task.as_str() {
        "ci" => ci::run(&rest),
        "" | "help" | "-h" | "--help" => {
            print!("{USAGE}");
            Ok(())
        }
        other => {
            eprint!("{USAGE}");
            bail!("unknown task `{other}`")
        }
    }
}
