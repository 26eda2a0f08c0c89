//! `cargo xtask fuzz [--cases N]`: the property tests of everything that parses input from
//! outside, at length.
//!
//! The toolchain here is stable, so coverage-guided fuzzing (cargo-fuzz needs nightly) is
//! replaced by property tests with a large case count: control frames, data-request and
//! response headers (vectored ones and their piece tables too) and the handshake replies (`ferry-core` `wire` and `stream::sim`), the
//! server's checks of requests from outside and the client's matching of responses
//! (`ferry-core` `stream::sim`, the `fuzz_` tests), socket-level control-frame reading
//! (`ferry-net`), the NIC filter syntax (`ferry-topology` `filter_fuzz`), and broadcast
//! manifests (`ferry-broadcast`: mangled manifests and arbitrary numbers never panic). `cargo xtask ci`
//! runs the same tests briefly (their default case counts); this task sets `PROPTEST_CASES`
//! and `FERRY_FUZZ_CASES` to `--cases` (default 100000) and runs them in a release build.
//! A failure prints proptest's minimal input and records it under the crate's
//! `proptest-regressions/`, which is committed: every crash found becomes a regression test that
//! runs first from then on.

use anyhow::{Context, Result, bail};

use crate::util::{cargo, run as run_loud};

/// Runs the property tests with `--cases` cases each.
pub(crate) fn run(args: &[String]) -> Result<()> {
    let mut cases = 100_000u64;
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--cases" => {
                cases = it
                    .next()
                    .context("--cases needs a value")?
                    .parse()
                    .context("--cases")?;
            }
            other => bail!("unknown option {other} (fuzz takes --cases N)"),
        }
    }
    let n = cases.to_string();
    run_loud(
        cargo()
            .args([
                "test",
                "--release",
                "-p",
                "ferry-engine-core",
                "-p",
                "ferry-net",
                "-p",
                "ferry-topology",
                "-p",
                "ferry-broadcast",
                "--",
                "fuzz",
                "never_panic",
                "roundtrip",
                "a_simulated_pair",
            ])
            .env("PROPTEST_CASES", &n)
            .env("FERRY_FUZZ_CASES", &n),
    )
}
