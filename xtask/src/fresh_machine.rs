//! `cargo xtask fresh-machine`: proves that a bare Debian 12 builds and tests Ferry with nothing
//! but what `.ci/packages` installs.
//!
//! A machine that already has a package hides a missing install step (the `libprotobuf-dev`
//! that etcd-client's build needs went unnoticed that way), so this task builds a root with
//! `debootstrap --variant=minbase bookworm` (the bare base is cached as a tarball in
//! [`cache_dir`] and unpacked afresh for every run, so each run starts from the same bare root),
//! copies this checkout into it (`.git`, the files git tracks and untracked ones it does not
//! ignore: what a clean clone of a commit of this tree holds), and inside it, under `chroot`:
//!
//! 1. runs `.ci/packages`, the package step of `.ci/run`;
//! 2. `cargo clippy --workspace --all-targets -- -D warnings` (the step that failed on a fresh
//!    machine);
//! 3. `cargo test --workspace --all-targets`, which builds the default features and, through
//!    `ferry-tests`' default features, the `etcd` feature of the broadcast and the CLI;
//! 4. `cargo build -p ferry-engine-cli --features etcd`, the user's way to the etcd discovery.
//!
//! With `--full` it runs the whole `.ci/run` instead of steps 2-4 (soft-RoCE guest included).
//!
//! The Rust toolchain (this cargo's sysroot) is bind-mounted read-only at its own path, and the
//! cargo registry cache is the lower, read-only layer of an overlay, so nothing in the host's
//! cargo home is written and crates already downloaded are not fetched again. Tests that need a
//! facility the root lacks skip as they do anywhere (no `FERRY_REQUIRE_*` is set, except under
//! `--full`, where `.ci/run` sets them).
//!
//! Run it before any change to native dependencies or to `.ci/run`/`.ci/packages` lands
//! (docs/release.md, "Fresh machine"). Needs root, debootstrap and a Debian mirror (the one apt
//! uses here, else `deb.debian.org`). The root and its target directory stay in
//! `cache_dir()/root` after the run, to look into; the next run replaces them.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use anyhow::{Context, Result, bail};

use crate::util::{have, project_root, run};

const USAGE: &str = "usage: cargo xtask fresh-machine [--full] [--rebuild-base]";

/// Where the bare base and the root live: `FERRY_FRESH_DIR`, else
/// `~/.cache/ferry/fresh-machine`.
fn cache_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("FERRY_FRESH_DIR") {
        return PathBuf::from(d);
    }
    let home = std::env::var_os("HOME").map_or_else(|| PathBuf::from("/tmp"), PathBuf::from);
    home.join(".cache/ferry/fresh-machine")
}

/// The Debian mirror apt uses here (deb822 sources), else the CDN.
fn mirror() -> String {
    std::fs::read_to_string("/etc/apt/sources.list.d/debian.sources")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("URIs:").map(|u| u.trim().to_owned()))
        })
        .filter(|u| !u.is_empty())
        .unwrap_or_else(|| "http://deb.debian.org/debian".to_owned())
}

/// The sysroot of the toolchain that runs us: `$CARGO`'s `bin/..` when that holds `rustc`,
/// else what `rustc --print sysroot` says.
fn sysroot() -> Result<PathBuf> {
    if let Some(cargo) = std::env::var_os("CARGO") {
        let root = Path::new(&cargo).parent().and_then(Path::parent);
        if let Some(root) = root.filter(|r| r.join("bin/rustc").is_file()) {
            return Ok(root.to_path_buf());
        }
    }
    let out = Command::new("rustc")
        .args(["--print", "sysroot"])
        .current_dir(project_root())
        .output()
        .context("running rustc --print sysroot")?;
    if !out.status.success() {
        bail!("rustc --print sysroot failed");
    }
    Ok(PathBuf::from(String::from_utf8_lossy(&out.stdout).trim()))
}

/// The host's cargo registry (downloaded crates and the index cache).
fn host_registry() -> PathBuf {
    std::env::var_os("CARGO_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cargo")))
        .unwrap_or_else(|| PathBuf::from("/root/.cargo"))
        .join("registry")
}

/// Mounts made inside the root; dropping it detaches every mount under the root (ours and any
/// the steps made, such as `ip netns`'s /run/netns), whatever went wrong.
struct Mounts {
    root: PathBuf,
}

impl Mounts {
    fn mount(&mut self, args: &[&str], target: &Path) -> Result<()> {
        std::fs::create_dir_all(target)
            .with_context(|| format!("creating {}", target.display()))?;
        run(Command::new("mount").args(args).arg(target))
    }
}

impl Drop for Mounts {
    fn drop(&mut self) {
        unmount_all_under(&self.root);
    }
}

/// Detaches (lazily, deepest first) every mount point at or under `root`, as
/// `/proc/self/mountinfo` lists them.
fn unmount_all_under(root: &Path) {
    let Ok(info) = std::fs::read_to_string("/proc/self/mountinfo") else {
        return;
    };
    let mut points: Vec<PathBuf> = info
        .lines()
        .filter_map(|l| l.split(' ').nth(4))
        // mountinfo escapes spaces and the like as octal; such a path is not one we made.
        .map(PathBuf::from)
        .filter(|p| p.starts_with(root))
        .collect();
    points.sort_by_key(|p| std::cmp::Reverse(p.components().count()));
    points.dedup();
    for p in points {
        let _ = Command::new("umount").arg("-l").arg(&p).status();
    }
}

/// Makes (once) the tarball of a bare `debootstrap --variant=minbase bookworm` root.
fn ensure_base(dir: &Path, rebuild: bool) -> Result<PathBuf> {
    let tar = dir.join("bookworm-minbase.tar");
    if tar.is_file() && !rebuild {
        eprintln!("fresh-machine: bare base cached in {}", tar.display());
        return Ok(tar);
    }
    let staging = dir.join("base");
    if staging.exists() {
        std::fs::remove_dir_all(&staging)
            .with_context(|| format!("removing {}", staging.display()))?;
    }
    let t = Instant::now();
    eprintln!("fresh-machine: debootstrap of a bare Debian 12 (a few minutes, once)");
    run(Command::new("debootstrap")
        .args(["--variant=minbase", "bookworm"])
        .arg(&staging)
        .arg(mirror()))?;
    let part = dir.join("bookworm-minbase.tar.part");
    run(Command::new("tar")
        .arg("-C")
        .arg(&staging)
        .args(["--numeric-owner", "-cf"])
        .arg(&part)
        .arg("."))?;
    std::fs::rename(&part, &tar).context("moving the base tarball in place")?;
    std::fs::remove_dir_all(&staging).ok();
    eprintln!(
        "fresh-machine: base made in {:.0}s",
        t.elapsed().as_secs_f64()
    );
    Ok(tar)
}

/// The checkout's files a clean clone would hold: `.git`, tracked files and untracked ones git
/// does not ignore, as NUL-separated paths relative to the root.
fn checkout_files() -> Result<Vec<u8>> {
    let out = Command::new("git")
        .args([
            "ls-files",
            "-z",
            "--cached",
            "--others",
            "--exclude-standard",
        ])
        .current_dir(project_root())
        .output()
        .context("running git ls-files")?;
    if !out.status.success() {
        bail!(
            "git ls-files failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    // A file deleted in the work tree but still in the index is not part of the checkout.
    let root = project_root();
    // The repository itself too, as a clone has it: tests and build scripts may ask git.
    let mut kept = b".git\0".to_vec();
    for p in out.stdout.split(|b| *b == 0).filter(|p| !p.is_empty()) {
        let rel = Path::new(std::str::from_utf8(p).context("a non-UTF-8 path in the checkout")?);
        if root.join(rel).symlink_metadata().is_ok() {
            kept.extend_from_slice(p);
            kept.push(0);
        }
    }
    Ok(kept)
}

/// Copies the checkout into `dest` with tar (modes kept).
fn copy_checkout(dest: &Path) -> Result<()> {
    let list = checkout_files()?;
    std::fs::create_dir_all(dest).with_context(|| format!("creating {}", dest.display()))?;
    let list_file = dest.with_extension("files");
    std::fs::write(&list_file, &list).context("writing the file list")?;
    let pack = Command::new("tar")
        .arg("-C")
        .arg(project_root())
        .args(["--null", "-T"])
        .arg(&list_file)
        .args(["-cf", "-"])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .context("starting tar")?;
    let stdout = pack.stdout.context("tar has no stdout")?;
    let status = Command::new("tar")
        .arg("-C")
        .arg(dest)
        .arg("-xf")
        .arg("-")
        .stdin(stdout)
        .status()
        .context("unpacking the checkout")?;
    if !status.success() {
        bail!("unpacking the checkout into {} failed", dest.display());
    }
    std::fs::remove_file(&list_file).ok();
    Ok(())
}

/// The script run inside the root (bash, as root, in the checkout's copy).
fn inside_script(full: bool, sysroot: &Path) -> String {
    let steps = if full {
        "step '.ci/run (all of it)' bash .ci/run\n".to_owned()
    } else {
        "step '.ci/packages' bash .ci/packages\n\
         step 'clippy' cargo clippy --workspace --all-targets -- -D warnings\n\
         step 'test (default features; etcd through ferry-tests)' cargo test --workspace --all-targets --no-fail-fast\n\
         step 'ferry-cli --features etcd' cargo build -p ferry-engine-cli --features etcd\n"
            .to_owned()
    };
    format!(
        "set -euo pipefail\n\
         export HOME=/root PATH={sysroot}/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin\n\
         export CARGO_HOME=/root/.cargo CARGO_TARGET_DIR=/work/target CARGO_INCREMENTAL=0 CARGO_TERM_COLOR=never\n\
         export RUSTUP_TOOLCHAIN={sysroot} LANG=C.UTF-8\n\
         cd /work/ferry\n\
         start=$(date +%s)\n\
         step() {{ local name=$1; shift; local t=$(date +%s); echo \"== fresh-machine: $name\"; \"$@\"; \
         echo \"== fresh-machine: $name ok in $(( $(date +%s) - t ))s\"; }}\n\
         {steps}\
         echo \"== fresh-machine: all steps passed in $(( $(date +%s) - start ))s\"\n",
        sysroot = sysroot.display(),
    )
}

/// `cargo xtask fresh-machine [--full] [--rebuild-base]`.
pub(crate) fn run_task(args: &[String]) -> Result<()> {
    let (mut full, mut rebuild) = (false, false);
    for a in args {
        match a.as_str() {
            "--full" => full = true,
            "--rebuild-base" => rebuild = true,
            other => bail!("unknown argument {other:?}\n{USAGE}"),
        }
    }
    if !crate::util::is_root() {
        bail!("fresh-machine needs root (debootstrap, chroot, mount)");
    }
    for tool in ["debootstrap", "chroot", "mount", "tar", "git"] {
        if !have(tool) {
            bail!(
                "fresh-machine needs `{tool}` on PATH (debootstrap: apt-get install debootstrap)"
            );
        }
    }
    let t = Instant::now();
    let dir = cache_dir();
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let base = ensure_base(&dir, rebuild)?;
    let root = dir.join("root");
    if root.exists() {
        // Whatever is still mounted in it (a killed run, or a mount the tests made inside, such
        // as `ip netns`'s /run/netns) is detached first, so rm cannot reach the host through it.
        unmount_all_under(&root);
        run(Command::new("rm")
            .args(["-rf", "--one-file-system"])
            .arg(&root))?;
    }
    std::fs::create_dir_all(&root)?;
    run(Command::new("tar")
        .arg("-C")
        .arg(&root)
        .args(["--numeric-owner", "-xf"])
        .arg(&base))?;
    copy_checkout(&root.join("work/ferry"))?;
    std::fs::copy("/etc/resolv.conf", root.join("etc/resolv.conf")).ok();
    // The site's own trust anchors, as the network's other settings (resolv.conf) come from the
    // host: where an egress proxy signs with a local CA, pip inside could not reach the package
    // index without it. `.ci/packages`' ca-certificates picks them up.
    if let Ok(entries) = std::fs::read_dir("/usr/local/share/ca-certificates") {
        let dest = root.join("usr/local/share/ca-certificates");
        std::fs::create_dir_all(&dest)?;
        for e in entries.flatten() {
            let p = e.path();
            if p.extension().is_some_and(|x| x == "crt") {
                std::fs::copy(&p, dest.join(e.file_name()))
                    .with_context(|| format!("copying {}", p.display()))?;
            }
        }
    }
    // debootstrap writes no /etc/hosts (the installer does, as on every installed machine), and
    // without it `localhost` does not resolve.
    let hosts = root.join("etc/hosts");
    if !hosts.exists() {
        std::fs::write(
            &hosts,
            "127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n",
        )
        .with_context(|| format!("writing {}", hosts.display()))?;
    }

    let sysroot = sysroot()?;
    let registry = host_registry();
    let mut mounts = Mounts { root: root.clone() };
    // The root a mount point of its own, as `/` is on a machine: `ip netns` runs
    // `mount --make-rslave /`, which fails on a plain directory.
    let root_arg = root.to_string_lossy().into_owned();
    mounts.mount(&["--bind", &root_arg], &root)?;
    run(Command::new("mount").arg("--make-private").arg(&root))?;
    mounts.mount(&["-t", "proc", "proc"], &root.join("proc"))?;
    for (from, to) in [("/sys", "sys"), ("/dev", "dev")] {
        let to = root.join(to);
        mounts.mount(&["--rbind", from], &to)?;
        // Slave, not shared: where the host's mounts are shared (systemd), unmounting the
        // copies afterwards must not propagate back and unmount the host's /dev/pts and the like.
        run(Command::new("mount").arg("--make-rslave").arg(&to))?;
    }
    let inner_sysroot = root.join(sysroot.strip_prefix("/").context("a relative sysroot")?);
    mounts.mount(
        &["--bind", "-o", "ro", &sysroot.to_string_lossy()],
        &inner_sysroot,
    )?;
    // A read-only bind needs a remount on older kernels to take the flag.
    run(Command::new("mount")
        .args(["-o", "remount,bind,ro"])
        .arg(&inner_sysroot))?;
    if registry.is_dir() {
        let (upper, work) = (dir.join("registry-upper"), dir.join("registry-work"));
        for d in [&upper, &work] {
            if d.exists() {
                std::fs::remove_dir_all(d).ok();
            }
            std::fs::create_dir_all(d)?;
        }
        mounts.mount(
            &[
                "-t",
                "overlay",
                "overlay",
                "-o",
                &format!(
                    "lowerdir={},upperdir={},workdir={}",
                    registry.display(),
                    upper.display(),
                    work.display()
                ),
            ],
            &root.join("root/.cargo/registry"),
        )?;
    } else {
        eprintln!(
            "fresh-machine: no cargo registry at {}; crates are downloaded inside",
            registry.display()
        );
    }
    let script = root.join("work/fresh-machine.sh");
    std::fs::write(&script, inside_script(full, &sysroot))?;
    eprintln!(
        "fresh-machine: root ready in {:.0}s ({}); running the steps inside",
        t.elapsed().as_secs_f64(),
        root.display()
    );
    let res = run(Command::new("chroot")
        .arg(&root)
        .args(["/bin/bash", "/work/fresh-machine.sh"])
        .env_clear()
        .env("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
        .env("TERM", "dumb"));
    drop(mounts);
    res.context("a step failed on the fresh Debian 12 root")?;
    eprintln!(
        "fresh-machine: passed in {:.0}s in all (base included)",
        t.elapsed().as_secs_f64()
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_inside_script_runs_the_package_step_first_and_stops_at_a_failure() {
        let s = inside_script(false, Path::new("/opt/tc"));
        assert!(s.starts_with("set -euo pipefail\n"));
        let packages = s.find("bash .ci/packages").unwrap();
        let clippy = s.find("cargo clippy").unwrap();
        let test = s.find("cargo test --workspace").unwrap();
        let etcd = s.find("--features etcd").unwrap();
        assert!(packages < clippy && clippy < test && test < etcd, "{s}");
        assert!(s.contains("PATH=/opt/tc/bin:"), "{s}");
        let full = inside_script(true, Path::new("/opt/tc"));
        assert!(full.contains("bash .ci/run") && !full.contains("cargo clippy"));
    }

    #[test]
    fn the_checkout_lists_files_that_exist() {
        let list = checkout_files().unwrap();
        let names: Vec<&[u8]> = list.split(|b| *b == 0).filter(|p| !p.is_empty()).collect();
        assert!(names.iter().any(|n| *n == b".ci/packages"));
        assert!(names.iter().any(|n| *n == b"Cargo.lock"));
        assert!(names.iter().any(|n| *n == b".git"));
        assert!(!names.iter().any(|n| n.starts_with(b"target/")));
    }
}
