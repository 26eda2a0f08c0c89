//! Host builds: the RDMA test binaries and the release `ferry` binary, found in cargo's
//! `--message-format=json` output.

use crate::util::{cargo, json_bool, json_str, project_root};
use anyhow::{Context, Result};
use std::path::{Path, PathBuf};
use std::process::Stdio;

/// Packages whose test binaries run against the rxe devices.
const TEST_PACKAGES: &[&str] = &["ferry-transport-rdma", "ferry-engine"];

/// Test targets of those packages that need other hardware than RDMA: their ignored tests fail
/// without it (as `ferry-tests` makes ignored hardware tests do), so the guest, which has rxe
/// devices and no GPU, does not run them. `gpu_real` is `cargo xtask gpu-check`'s.
const NOT_FOR_RXE: &[&str] = &["gpu_real"];

/// One executable from cargo's JSON messages.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Artifact {
    /// `package:target`, for people.
    pub(crate) label: String,
    /// The executable cargo built.
    pub(crate) executable: PathBuf,
    /// The package directory (test binaries run there, as under `cargo test`).
    pub(super) package_dir: PathBuf,
}

/// Executables of compiler-artifact messages; with `tests_only`, only test-profile ones.
pub(crate) fn parse_artifacts(json_lines: &str, tests_only: bool) -> Vec<Artifact> {
    let mut found = Vec::new();
    for line in json_lines.lines() {
        if json_str(line, "reason", 0).as_deref() != Some("compiler-artifact") {
            continue;
        }
        let Some(exe) = json_str(line, "executable", 0) else {
            continue;
        };
        let is_test = line
            .find("\"profile\"")
            .is_some_and(|p| json_bool(line, "test", p) == Some(true));
        if tests_only && !is_test {
            continue;
        }
        let manifest = json_str(line, "manifest_path", 0).map(PathBuf::from);
        let package_dir = manifest
            .as_deref()
            .and_then(Path::parent)
            .map_or_else(project_root, Path::to_path_buf);
        let package = package_dir
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let target = line
            .find("\"target\"")
            .and_then(|p| json_str(line, "name", p))
            .unwrap_or_default();
        found.push(Artifact {
            label: format!("{package}:{target}"),
            executable: PathBuf::from(exe),
            package_dir,
        });
    }
    found
}

/// Runs a cargo build with `--message-format=json`; Ok(stdout) or Err(stderr).
pub(crate) fn cargo_json(args: &[&str]) -> Result<std::result::Result<String, String>> {
    let mut cmd = cargo();
    cmd.args(args).arg("--message-format=json");
    eprintln!("$ {cmd:?}");
    let out = cmd
        .stderr(Stdio::piped())
        .output()
        .with_context(|| format!("spawning {cmd:?}"))?;
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    if out.status.success() {
        Ok(Ok(stdout))
    } else {
        Ok(Err(stderr))
    }
}

/// What the host builds produced.
#[derive(Debug, Default)]
pub(super) struct Builds {
    /// The test binaries of [`TEST_PACKAGES`].
    pub(super) tests: Vec<Artifact>,
    /// The release `ferry` binary, if it was built.
    pub(super) ferry: Option<PathBuf>,
    /// Packages that could not be built (a compile error): each a failure of the suite.
    pub(super) broken: Vec<String>,
    /// Notes for people: packages absent from the workspace, binaries missing.
    pub(super) notes: Vec<String>,
}

impl Builds {
    /// Keeps the test binaries whose label contains `only` (all without it), each `repeat`
    /// times in a row (at least once). A filter that matches nothing is a note, and the suite
    /// then runs no test binary.
    pub(super) fn select(&mut self, only: Option<&str>, repeat: u32) {
        if let Some(text) = only {
            self.tests.retain(|t| t.label.contains(text));
            if self.tests.is_empty() {
                self.notes
                    .push(format!("--only {text}: no test binary's label contains it"));
            }
        }
        let n = repeat.max(1) as usize;
        self.tests = std::mem::take(&mut self.tests)
            .into_iter()
            .flat_map(|t| std::iter::repeat_n(t, n))
            .collect();
    }
}

/// Builds the test binaries of [`TEST_PACKAGES`] and the release `ferry` binary, and lists them
/// on stderr. A package that fails to compile is recorded in [`Builds::broken`], not returned as
/// an error; `Err` only when cargo cannot be run.
pub(super) fn build_on_host() -> Result<Builds> {
    let mut b = Builds::default();
    for pkg in TEST_PACKAGES {
        match cargo_json(&["test", "--no-run", "-p", pkg])? {
            Ok(stdout) => {
                let found: Vec<Artifact> = parse_artifacts(&stdout, true)
                    .into_iter()
                    .filter(|a| {
                        !NOT_FOR_RXE
                            .iter()
                            .any(|t| a.label.ends_with(&format!(":{t}")))
                    })
                    .collect();
                if found.is_empty() {
                    b.notes.push(format!("{pkg}: no test binaries"));
                }
                b.tests.extend(found);
            }
            Err(stderr) if stderr.contains("did not match any packages") => {
                b.notes
                    .push(format!("{pkg}: not in the workspace yet, no tests to run"));
            }
            Err(stderr) => {
                eprint!("{stderr}");
                b.broken.push(format!("building the tests of {pkg} failed"));
            }
        }
    }
    match cargo_json(&["build", "--release", "-p", "ferry-engine-cli"])? {
        Ok(stdout) => {
            b.ferry = parse_artifacts(&stdout, false)
                .into_iter()
                .map(|a| a.executable)
                .find(|p| p.file_name().is_some_and(|n| n == "ferry"));
            if b.ferry.is_none() {
                b.notes
                    .push("ferry-engine-cli built no `ferry` binary".to_owned());
            }
        }
        Err(stderr) => {
            eprint!("{stderr}");
            b.broken
                .push("building ferry-engine-cli (release) failed".to_owned());
        }
    }
    eprintln!("soft-roce: test binaries found:");
    for t in &b.tests {
        eprintln!("  {} -> {}", t.label, t.executable.display());
    }
    if b.tests.is_empty() {
        eprintln!("  (none)");
    }
    match &b.ferry {
        Some(f) => eprintln!("soft-roce: ferry binary: {}", f.display()),
        None => eprintln!("soft-roce: no ferry binary"),
    }
    for n in &b.notes {
        eprintln!("soft-roce: note: {n}");
    }
    Ok(b)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_keeps_matching_test_binaries_and_repeat_runs_each_in_a_row() {
        let a = |label: &str| Artifact {
            label: label.into(),
            executable: format!("/t/{label}").into(),
            package_dir: "/w".into(),
        };
        let mut b = Builds {
            tests: vec![a("engine:rdma"), a("transport-rdma:rxe"), a("engine:gpu")],
            ..Builds::default()
        };
        b.select(Some("engine:"), 2);
        let labels: Vec<&str> = b.tests.iter().map(|t| t.label.as_str()).collect();
        assert_eq!(
            labels,
            ["engine:rdma", "engine:rdma", "engine:gpu", "engine:gpu"]
        );
        assert!(b.notes.is_empty());
        b.select(Some("nothing"), 1);
        assert!(b.tests.is_empty());
        assert_eq!(b.notes.len(), 1);
        let mut all = Builds {
            tests: vec![a("x:y")],
            ..Builds::default()
        };
        all.select(None, 0);
        assert_eq!(all.tests.len(), 1);
    }

    #[test]
    fn finds_test_executables_in_cargo_json() {
        let json = r#"{"reason":"compiler-artifact","package_id":"path+file:///w/crates/transport-rdma#ferry-transport-rdma@0.1.0","manifest_path":"/w/crates/transport-rdma/Cargo.toml","target":{"kind":["lib"],"crate_types":["lib"],"name":"ferry_transport_rdma","src_path":"/w/crates/transport-rdma/src/lib.rs","edition":"2024","doc":true,"doctest":true,"test":true},"profile":{"opt_level":"0","debuginfo":2,"debug_assertions":true,"overflow_checks":true,"test":true},"features":[],"filenames":["/w/target/debug/deps/ferry_transport_rdma-ab12"],"executable":"/w/target/debug/deps/ferry_transport_rdma-ab12","fresh":true}
{"reason":"compiler-artifact","manifest_path":"/w/crates/transport-rdma/Cargo.toml","target":{"kind":["lib"],"name":"ferry_transport_rdma","test":true},"profile":{"test":false},"executable":null,"fresh":true}
{"reason":"compiler-artifact","manifest_path":"/w/crates/cli/Cargo.toml","target":{"kind":["bin"],"name":"ferry","test":true},"profile":{"test":false},"executable":"/w/target/release/ferry","fresh":true}
{"reason":"build-finished","success":true}"#;
        let tests = parse_artifacts(json, true);
        assert_eq!(
            tests,
            vec![Artifact {
                label: "transport-rdma:ferry_transport_rdma".into(),
                executable: "/w/target/debug/deps/ferry_transport_rdma-ab12".into(),
                package_dir: "/w/crates/transport-rdma".into(),
            }]
        );
        let all = parse_artifacts(json, false);
        assert_eq!(all.len(), 2);
        assert_eq!(all[1].executable, PathBuf::from("/w/target/release/ferry"));
    }
}
