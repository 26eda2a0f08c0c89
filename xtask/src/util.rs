//! Small helpers shared by the tasks: the project root and running commands loudly.

use anyhow::{Context, Result, bail};
use std::path::{Path, PathBuf};
use std::process::Command;

/// The workspace root (the parent of `xtask/`).
pub(crate) fn project_root() -> PathBuf {
    let dir = env!("CARGO_MANIFEST_DIR");
    Path::new(dir)
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_else(|| PathBuf::from("."))
}

/// The cargo that runs us (so the pinned toolchain is used throughout).
pub(crate) fn cargo() -> Command {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned());
    let mut cmd = Command::new(cargo);
    cmd.current_dir(project_root());
    cmd
}

/// Runs `cmd`, echoing it first; fails with the command line if it exits non-zero.
pub(crate) fn run(cmd: &mut Command) -> Result<()> {
    let line = format!("{cmd:?}");
    eprintln!("$ {line}");
    let status = cmd.status().with_context(|| format!("spawning {line}"))?;
    if !status.success() {
        bail!("command failed ({status}): {line}");
    }
    Ok(())
}

/// Whether `prog` is on PATH.
pub(crate) fn have(prog: &str) -> bool {
    std::env::var_os("PATH")
        .is_some_and(|paths| std::env::split_paths(&paths).any(|dir| dir.join(prog).is_file()))
}
