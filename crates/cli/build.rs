//! Records the git commit the binary is built from, for `ferry --version` and `ferry doctor`:
//! `FERRY_GIT_COMMIT` is the short commit of HEAD, or `unknown` where there is no git or no
//! repository (a crate unpacked from a package). A packager may set `FERRY_GIT_COMMIT` itself.

use std::path::{Path, PathBuf};
use std::process::Command;

fn git(args: &[&str]) -> Option<String> {
    let out = Command::new("git").args(args).output().ok()?;
    if !out.status.success() {
        return None;
    }
    let s = String::from_utf8(out.stdout).ok()?;
    let s = s.trim();
    (!s.is_empty()).then(|| s.to_owned())
}

/// Files whose change moves HEAD: HEAD itself (a worktree has its own), the branch it points to,
/// and packed-refs (where a branch lives after `git gc`).
fn head_files() -> Vec<PathBuf> {
    let mut files = Vec::new();
    let (Some(git_dir), Some(common)) = (
        git(&["rev-parse", "--absolute-git-dir"]),
        git(&["rev-parse", "--path-format=absolute", "--git-common-dir"]),
    ) else {
        return files;
    };
    let (git_dir, common) = (PathBuf::from(git_dir), PathBuf::from(common));
    files.push(git_dir.join("HEAD"));
    if let Some(branch) = git(&["symbolic-ref", "-q", "HEAD"]) {
        files.push(common.join(branch));
    }
    files.push(common.join("packed-refs"));
    files
}

fn main() {
    println!("cargo:rerun-if-env-changed=FERRY_GIT_COMMIT");
    let commit = std::env::var("FERRY_GIT_COMMIT")
        .ok()
        .filter(|c| !c.is_empty())
        .or_else(|| git(&["rev-parse", "--short=12", "HEAD"]));
    for f in head_files() {
        if Path::new(&f).exists() {
            println!("cargo:rerun-if-changed={}", f.display());
        }
    }
    // Without a repository, only a change of this script reruns it.
    println!("cargo:rerun-if-changed=build.rs");
    println!(
        "cargo:rustc-env=FERRY_GIT_COMMIT={}",
        commit.unwrap_or_else(|| "unknown".into())
    );
}
