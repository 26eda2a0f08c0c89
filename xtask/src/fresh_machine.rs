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
//! Every mount is made in the task's own mount namespace, so none can outlive it: the task
//! re-runs itself under `unshare --mount --propagation private --pid --fork --kill-child` before
//! it mounts anything (and the re-run refuses to mount unless it is in a PID and a mount
//! namespace of its own, in which no mount propagates). The host never sees the
//! root's mounts; when the task ends, however it ends (a failed step, Ctrl-C, `kill -9` of the
//! task), the kernel kills everything in its PID namespace, and the mount namespace and
//! its mounts go with it. `/dev` inside is a tmpfs of its own with copies of the few device nodes
//! a build and the tests use and a new `devpts` instance, never a bind of the host's `/dev`, so
//! even a remove through it reaches no host device. The cache path is made canonical (a relative
//! or symlinked `FERRY_FRESH_DIR` names the same directory the kernel reports), and a tree is
//! removed only after `/proc/self/mountinfo` (read with its octal escapes decoded) shows nothing
//! mounted at or under it.
//!
//! `--mounts-only` makes the root's mounts on an empty root (no base, no checkout), says how many
//! it made, and waits in place of the `chroot` step until it is interrupted: the way to check the
//! mount handling without a Debian base or a build (`xtask/tests/fresh_machine.rs`).
//!
//! Run it before any change to native dependencies or to `.ci/run`/`.ci/packages` lands
//! (docs/release.md, "Fresh machine"). Needs root, debootstrap, unshare (util-linux) and a Debian
//! mirror (the one apt uses here, else `deb.debian.org`). The root and its target directory stay
//! in `cache_dir()/root` after the run, to look into (without its mounts); the next run replaces
//! them.

use std::ffi::{OsStr, OsString};
use std::os::unix::ffi::OsStringExt;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use anyhow::{Context, Result, bail};

use crate::util::{have, project_root, run};

const USAGE: &str = "usage: cargo xtask fresh-machine [--full] [--rebuild-base] [--mounts-only]";

/// The argument the task re-runs itself with inside its own namespaces, followed by `=` and the
/// mount namespace it started in (not for users: the re-run checks that it really is in new
/// ones).
const INSIDE: &str = "--inside-namespace";

/// What the command line asks for.
#[derive(Debug, Default, PartialEq, Eq)]
struct Options {
    full: bool,
    rebuild: bool,
    mounts_only: bool,
    /// The mount namespace the task started in, for its re-run inside new ones.
    inside: Option<String>,
}

impl Options {
    fn parse(args: &[String]) -> Result<Options> {
        let mut o = Options::default();
        for a in args {
            match a.as_str() {
                "--full" => o.full = true,
                "--rebuild-base" => o.rebuild = true,
                "--mounts-only" => o.mounts_only = true,
                other if other.starts_with(INSIDE) => {
                    let from = other[INSIDE.len()..].strip_prefix('=');
                    o.inside = Some(from.context("--inside-namespace=NS")?.to_owned());
                }
                other => bail!("unknown argument {other:?}\n{USAGE}"),
            }
        }
        Ok(o)
    }
}

/// Where the bare base and the root live: `FERRY_FRESH_DIR`, else
/// `~/.cache/ferry/fresh-machine`; made if missing, and canonical (absolute, no symlink, no
/// `..`), so it is spelled as `/proc/self/mountinfo` spells the mounts under it.
fn cache_dir() -> Result<PathBuf> {
    let dir = match std::env::var_os("FERRY_FRESH_DIR") {
        Some(d) => PathBuf::from(d),
        None => std::env::var_os("HOME")
            .map_or_else(|| PathBuf::from("/tmp"), PathBuf::from)
            .join(".cache/ferry/fresh-machine"),
    };
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    std::fs::canonicalize(&dir).with_context(|| format!("resolving {}", dir.display()))
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

/// The sysroot of the toolchain that runs us, canonical: `$CARGO`'s `bin/..` when that holds
/// `rustc`, else what `rustc --print sysroot` says.
fn sysroot() -> Result<PathBuf> {
    let found = sysroot_as_given()?;
    std::fs::canonicalize(&found).with_context(|| format!("resolving {}", found.display()))
}

fn sysroot_as_given() -> Result<PathBuf> {
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

/// One mount point as `/proc/self/mountinfo` lists it.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Mount {
    /// Where it is mounted, escapes decoded.
    point: PathBuf,
    /// Whether it propagates to and from a peer group (`shared:N` among the optional fields).
    shared: bool,
}

/// The mounts a `/proc/self/mountinfo` text lists, in its order; a line too short to hold a
/// mount point is left out.
fn parse_mountinfo(text: &str) -> Vec<Mount> {
    text.lines()
        .filter_map(|line| {
            let fields: Vec<&str> = line.split(' ').collect();
            let point = fields.get(4)?;
            // Optional fields run from the seventh to the lone `-`.
            let shared = fields
                .iter()
                .skip(6)
                .take_while(|f| **f != "-")
                .any(|f| f.starts_with("shared:"));
            Some(Mount {
                point: unescape_mountinfo(point),
                shared,
            })
        })
        .collect()
}

/// A mountinfo path with the kernel's octal escapes (`\040` space, `\011` tab, `\012` newline,
/// `\134` backslash) undone; a backslash not followed by three octal digits stays as it is.
fn unescape_mountinfo(field: &str) -> PathBuf {
    let b = field.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let octal = b
            .get(i + 1..i + 4)
            .filter(|d| d.iter().all(|c| (b'0'..=b'7').contains(c)));
        match (b[i], octal) {
            (b'\\', Some(d)) => {
                let v = d.iter().fold(0u32, |v, c| v * 8 + u32::from(c - b'0'));
                match u8::try_from(v) {
                    Ok(byte) => {
                        out.push(byte);
                        i += 4;
                    }
                    Err(_) => {
                        out.push(b'\\');
                        i += 1;
                    }
                }
            }
            (c, _) => {
                out.push(c);
                i += 1;
            }
        }
    }
    PathBuf::from(OsString::from_vec(out))
}

/// The mount points at or under `root` (component-wise: `/a/rootx` is not under `/a/root`).
fn mounts_under(mounts: &[Mount], root: &Path) -> Vec<PathBuf> {
    mounts
        .iter()
        .filter(|m| m.point.starts_with(root))
        .map(|m| m.point.clone())
        .collect()
}

/// This process's mounts, read now.
fn read_mountinfo() -> Result<Vec<Mount>> {
    let text = std::fs::read_to_string("/proc/self/mountinfo").context("reading mountinfo")?;
    Ok(parse_mountinfo(&text))
}

/// Fails, naming them, when anything is mounted at or under `path` in `mounts`: a remove must
/// not walk into a mount (a bind of the host's `/dev` left by a killed run of an older xtask
/// made `rm -rf` of the cache delete the host's device nodes).
fn refuse_if_mounted(mounts: &[Mount], path: &Path) -> Result<()> {
    let held = mounts_under(mounts, path);
    if held.is_empty() {
        return Ok(());
    }
    let list: Vec<String> = held.iter().map(|p| format!("  {}", p.display())).collect();
    bail!(
        "refusing to remove {}: {} mount(s) still at or under it:\n{}\n\
         (left on the host by an interrupted run of an older xtask: `umount -R -l {}` as root \
         detaches them)",
        path.display(),
        held.len(),
        list.join("\n"),
        path.display()
    )
}

/// Removes the tree at `path` (canonical, so its spelling is the kernel's), after checking that
/// nothing is mounted in it; `--one-file-system` besides.
fn remove_tree(path: &Path) -> Result<()> {
    if path.symlink_metadata().is_err() {
        return Ok(());
    }
    let path =
        std::fs::canonicalize(path).with_context(|| format!("resolving {}", path.display()))?;
    refuse_if_mounted(&read_mountinfo()?, &path)?;
    run(Command::new("rm")
        .args(["-rf", "--one-file-system"])
        .arg(&path))
}

/// This process's mount and PID namespaces, as `/proc/self/ns` names them:
/// `mnt:[4026531841],pid:[4026531836]`.
fn namespaces() -> Result<String> {
    let mut names = Vec::new();
    for ns in ["mnt", "pid"] {
        let path = format!("/proc/self/ns/{ns}");
        let link = std::fs::read_link(&path).with_context(|| format!("reading {path}"))?;
        names.push(link.to_string_lossy().into_owned());
    }
    Ok(names.join(","))
}

/// Fails unless this process runs where a mount cannot reach the host: in a PID namespace
/// (so the kernel kills everything in it when its first process ends) and a mount namespace
/// both other than those of `started_in` ([`namespaces`] of the task as started), with no
/// mount that propagates.
fn ensure_own_namespace(started_in: &str) -> Result<()> {
    let ours = namespaces()?;
    let shared_ns: Vec<&str> = ours
        .split(',')
        .filter(|n| started_in.split(',').any(|s| s == *n))
        .collect();
    if !shared_ns.is_empty() {
        bail!(
            "fresh-machine: still in the namespace(s) it started in ({}); refusing to mount",
            shared_ns.join(", ")
        );
    }
    let shared: Vec<String> = read_mountinfo()?
        .iter()
        .filter(|m| m.shared)
        .map(|m| m.point.display().to_string())
        .collect();
    if !shared.is_empty() {
        bail!(
            "fresh-machine: mounts that propagate in its namespace ({}); refusing to mount",
            shared.join(", ")
        );
    }
    Ok(())
}

/// A mount the root gets: `mount ARGS TARGET`.
#[derive(Debug)]
struct MountStep {
    args: Vec<OsString>,
    target: PathBuf,
}

fn step(args: &[&OsStr], target: PathBuf) -> MountStep {
    MountStep {
        args: args.iter().map(|a| a.to_os_string()).collect(),
        target,
    }
}

/// The mounts that make `root` a machine, in order: the root a mount point of its own, `/proc`,
/// the host's `/sys`, a private `/dev` (a tmpfs; its nodes are made by [`populate_dev`]) with
/// a new `devpts` and a `/dev/shm`, the toolchain read-only at its own path, and, when
/// `registry` is given as `(lower, upper, work)`, the host's cargo registry (`lower`) as the
/// lower layer of an overlay with those upper and work directories.
fn mount_plan(
    root: &Path,
    sysroot: &Path,
    registry: Option<(&Path, &Path, &Path)>,
) -> Result<Vec<MountStep>> {
    let s = |x: &'static str| OsStr::new(x);
    let inner_sysroot = root.join(sysroot.strip_prefix("/").context("a relative sysroot")?);
    let mut plan = vec![
        // `ip netns` runs `mount --make-rslave /`, which fails on a plain directory.
        step(&[s("--bind"), root.as_os_str()], root.to_path_buf()),
        step(&[s("-t"), s("proc"), s("proc")], root.join("proc")),
        step(&[s("--rbind"), s("/sys")], root.join("sys")),
        step(
            &[
                s("-t"),
                s("tmpfs"),
                s("-o"),
                s("mode=0755,nosuid,size=64m"),
                s("fresh-dev"),
            ],
            root.join("dev"),
        ),
        step(
            &[
                s("-t"),
                s("devpts"),
                s("-o"),
                s("newinstance,ptmxmode=0666,mode=0620,gid=5"),
                s("devpts"),
            ],
            root.join("dev/pts"),
        ),
        step(
            &[
                s("-t"),
                s("tmpfs"),
                s("-o"),
                s("mode=1777,nosuid,nodev"),
                s("shm"),
            ],
            root.join("dev/shm"),
        ),
        step(
            &[s("--bind"), s("-o"), s("ro"), sysroot.as_os_str()],
            inner_sysroot.clone(),
        ),
        // A read-only bind needs a remount on older kernels to take the flag.
        step(&[s("-o"), s("remount,bind,ro")], inner_sysroot),
    ];
    if let Some((lower, upper, work)) = registry {
        let mut opts = OsString::from("lowerdir=");
        opts.push(lower);
        opts.push(",upperdir=");
        opts.push(upper);
        opts.push(",workdir=");
        opts.push(work);
        plan.push(step(
            &[s("-t"), s("overlay"), s("overlay"), s("-o"), &opts],
            root.join("root/.cargo/registry"),
        ));
    }
    Ok(plan)
}

/// The host's device nodes copied into the private `/dev` (new nodes with the same numbers and
/// modes; removing them removes nothing of the host's): the ones every build and test uses, and
/// where the host has them, `kvm`, `net/tun`, `fuse` and the verbs devices under `infiniband/`.
fn populate_dev(dev: &Path) -> Result<()> {
    for name in ["null", "zero", "full", "random", "urandom", "tty"] {
        copy_node(&Path::new("/dev").join(name), &dev.join(name))?;
    }
    let mut optional: Vec<PathBuf> = ["kvm", "net/tun", "fuse"]
        .iter()
        .map(PathBuf::from)
        .collect();
    if let Ok(entries) = std::fs::read_dir("/dev/infiniband") {
        optional.extend(
            entries
                .flatten()
                .map(|e| Path::new("infiniband").join(e.file_name())),
        );
    }
    for rel in optional {
        let host = Path::new("/dev").join(&rel);
        if host.exists() {
            copy_node(&host, &dev.join(&rel))?;
        }
    }
    for (link, to) in [
        ("fd", "/proc/self/fd"),
        ("stdin", "/proc/self/fd/0"),
        ("stdout", "/proc/self/fd/1"),
        ("stderr", "/proc/self/fd/2"),
        ("ptmx", "pts/ptmx"),
    ] {
        std::os::unix::fs::symlink(to, dev.join(link))
            .with_context(|| format!("linking {}", dev.join(link).display()))?;
    }
    Ok(())
}

/// `(major, minor)` of a Linux device number (glibc's `gnu_dev_major`/`gnu_dev_minor`).
fn major_minor(rdev: u64) -> (u64, u64) {
    let major = ((rdev >> 8) & 0xfff) | ((rdev >> 32) & 0xffff_f000);
    let minor = (rdev & 0xff) | ((rdev >> 12) & 0xffff_ff00);
    (major, minor)
}

/// Makes at `to` a device node like the host's `host` (its type, numbers and mode).
fn copy_node(host: &Path, to: &Path) -> Result<()> {
    let md = std::fs::metadata(host).with_context(|| format!("reading {}", host.display()))?;
    let kind = if md.file_type().is_char_device() {
        "c"
    } else if md.file_type().is_block_device() {
        "b"
    } else {
        bail!("{} is not a device node", host.display());
    };
    if let Some(parent) = to.parent() {
        std::fs::create_dir_all(parent)?;
    }
    let (major, minor) = major_minor(md.rdev());
    run(Command::new("mknod")
        .arg("-m")
        .arg(format!("{:o}", md.mode() & 0o7777))
        .arg(to)
        .arg(kind)
        .arg(major.to_string())
        .arg(minor.to_string()))
}

/// Makes every mount of [`mount_plan`] (and the private `/dev`'s nodes after its tmpfs).
fn mount_all(root: &Path, dir: &Path, sysroot: &Path) -> Result<()> {
    let registry = host_registry();
    let (upper, work) = (dir.join("registry-upper"), dir.join("registry-work"));
    let registry = if registry.is_dir() {
        for d in [&upper, &work] {
            remove_tree(d)?;
            std::fs::create_dir_all(d)?;
        }
        Some(std::fs::canonicalize(&registry).context("resolving the cargo registry")?)
    } else {
        eprintln!(
            "fresh-machine: no cargo registry at {}; crates are downloaded inside",
            registry.display()
        );
        None
    };
    let plan = mount_plan(
        root,
        sysroot,
        registry
            .as_deref()
            .map(|r| (r, upper.as_path(), work.as_path())),
    )?;
    let dev = root.join("dev");
    for m in plan {
        std::fs::create_dir_all(&m.target)
            .with_context(|| format!("creating {}", m.target.display()))?;
        run(Command::new("mount").args(&m.args).arg(&m.target))?;
        if m.target == dev {
            populate_dev(&dev)?;
        }
    }
    Ok(())
}

/// Makes (once) the tarball of a bare `debootstrap --variant=minbase bookworm` root.
fn ensure_base(dir: &Path, rebuild: bool) -> Result<PathBuf> {
    let tar = dir.join("bookworm-minbase.tar");
    if tar.is_file() && !rebuild {
        eprintln!("fresh-machine: bare base cached in {}", tar.display());
        return Ok(tar);
    }
    let staging = dir.join("base");
    // debootstrap mounts /proc and /sys in it while it works; in this namespace they vanish with
    // the task, but one left on the host by an older xtask must stop the remove.
    remove_tree(&staging)?;
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
    remove_tree(&staging)?;
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
    // The repository itself too, as a clone has it: tests and build scripts may ask git. A
    // linked worktree's `.git` is a file naming a directory outside the checkout: the copy gets
    // a clone instead ([`copy_checkout`]).
    let mut kept = if root.join(".git").is_dir() {
        b".git\0".to_vec()
    } else {
        Vec::new()
    };
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
    if !project_root().join(".git").is_dir() {
        clone_repository(dest)?;
    }
    Ok(())
}

/// Gives the copy at `dest` a repository of its own, for a checkout that is a linked worktree
/// (its `.git` names a directory the root does not hold): a clone of this one, at this
/// checkout's `HEAD`, with its index made from it; the copied files stay as they are.
fn clone_repository(dest: &Path) -> Result<()> {
    let tmp = dest.join(".git-clone");
    run(Command::new("git")
        .args(["clone", "--quiet", "--no-checkout", "--no-local"])
        .arg(project_root())
        .arg(&tmp))?;
    std::fs::rename(tmp.join(".git"), dest.join(".git")).context("moving the clone's .git")?;
    std::fs::remove_dir_all(&tmp).context("removing the clone's folder")?;
    run(Command::new("git")
        .arg("-C")
        .arg(dest)
        .args(["reset", "-q"]))
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

/// `cargo xtask fresh-machine [--full] [--rebuild-base] [--mounts-only]`: checks what it needs,
/// then runs the task again in namespaces of its own ([`inside`]).
pub(crate) fn run_task(args: &[String]) -> Result<()> {
    let opts = Options::parse(args)?;
    if !crate::util::is_root() {
        bail!("fresh-machine needs root (debootstrap, chroot, mount)");
    }
    for tool in ["chroot", "mount", "mknod", "unshare", "tar", "git"] {
        if !have(tool) {
            bail!("fresh-machine needs `{tool}` on PATH");
        }
    }
    if let Some(started_in) = &opts.inside {
        return inside(&opts, started_in);
    }
    let dir = cache_dir()?;
    let exe = std::env::current_exe().context("finding xtask's own binary")?;
    let ns = namespaces()?;
    // The new PID namespace's first process is a shell that runs the task and exits with it: the
    // task is not that namespace's init, which would ignore Ctrl-C's SIGINT (an init takes only
    // the signals it handles), so Ctrl-C ends it as any foreground job. When the first process
    // ends, the kernel kills everything else in the namespace. --kill-child: unshare's own
    // death (`kill -9`) SIGKILLs that first process. unshare takes this process's place (exec),
    // so the pid the caller knows is unshare's; it blocks SIGINT and SIGTERM while it waits.
    let mut cmd = Command::new("unshare");
    cmd.args([
        "--mount",
        "--propagation",
        "private",
        "--pid",
        "--fork",
        "--kill-child",
        "--",
        "/bin/sh",
        "-c",
        "\"$0\" \"$@\"; exit $?",
    ])
    .arg(exe)
    .arg("fresh-machine")
    .args(args)
    .arg(format!("{INSIDE}={ns}"))
    .env("FERRY_FRESH_DIR", &dir);
    eprintln!("$ {cmd:?}");
    let err = std::os::unix::process::CommandExt::exec(&mut cmd);
    Err(err).context("running unshare")
}

/// The task proper, in its own PID and mount namespaces (`started_in`: [`namespaces`] of the
/// task as started).
fn inside(opts: &Options, started_in: &str) -> Result<()> {
    ensure_own_namespace(started_in)?;
    let t = Instant::now();
    let dir = cache_dir()?;
    let base = if opts.mounts_only {
        None
    } else {
        if !have("debootstrap") {
            bail!("fresh-machine needs `debootstrap` on PATH (apt-get install debootstrap)");
        }
        Some(ensure_base(&dir, opts.rebuild)?)
    };
    let root = dir.join("root");
    remove_tree(&root)?;
    std::fs::create_dir_all(&root)?;
    if let Some(base) = &base {
        run(Command::new("tar")
            .arg("-C")
            .arg(&root)
            .args(["--numeric-owner", "-xf"])
            .arg(base))?;
        prepare_root(&root)?;
    }
    let sysroot = sysroot()?;
    mount_all(&root, &dir, &sysroot)?;
    let made = mounts_under(&read_mountinfo()?, &root).len();
    if opts.mounts_only {
        eprintln!(
            "fresh-machine: {made} mounts under {}, in the task's own namespace; waiting until \
             interrupted",
            root.display()
        );
        return run(Command::new("sleep").arg("infinity"));
    }
    let script = root.join("work/fresh-machine.sh");
    std::fs::write(&script, inside_script(opts.full, &sysroot))?;
    eprintln!(
        "fresh-machine: root ready in {:.0}s ({}, {made} mounts); running the steps inside",
        t.elapsed().as_secs_f64(),
        root.display()
    );
    run(Command::new("chroot")
        .arg(&root)
        .args(["/bin/bash", "/work/fresh-machine.sh"])
        .env_clear()
        .env("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
        .env("TERM", "dumb"))
    .context("a step failed on the fresh Debian 12 root")?;
    eprintln!(
        "fresh-machine: passed in {:.0}s in all (base included)",
        t.elapsed().as_secs_f64()
    );
    Ok(())
}

/// Fills an unpacked base with what the run needs: the checkout, the host's name resolution and
/// trust anchors, and an `/etc/hosts`.
fn prepare_root(root: &Path) -> Result<()> {
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
    fn mountinfo_points_are_decoded_and_shared_mounts_seen() {
        let text = "22 27 0:21 / /proc rw,relatime - proc proc rw\n\
                    27 1 254:0 / / rw,relatime shared:1 - ext4 /dev/vda rw\n\
                    66 46 0:40 / /tmp/a\\040b/c\\011d\\134e rw master:3 - tmpfs x rw\n\
                    67 46 0:41 / /tmp/odd\\9x rw - tmpfs y rw\n\
                    short line\n";
        let m = parse_mountinfo(text);
        assert_eq!(m.len(), 4, "{m:?}");
        assert_eq!(m[0].point, Path::new("/proc"));
        assert!(!m[0].shared && m[1].shared && !m[2].shared);
        assert_eq!(m[2].point, Path::new("/tmp/a b/c\td\\e"));
        // Not an escape: taken as it stands.
        assert_eq!(m[3].point, Path::new("/tmp/odd\\9x"));
        assert_eq!(unescape_mountinfo("/x\\012y"), Path::new("/x\ny"));
        assert_eq!(unescape_mountinfo("/x\\777"), Path::new("/x\\777"));
        assert_eq!(unescape_mountinfo("/end\\04"), Path::new("/end\\04"));
    }

    #[test]
    fn a_tree_with_anything_mounted_under_it_is_not_removed() {
        let text = "1 0 0:1 / / rw - ext4 r rw\n\
                    2 1 0:2 / /c/root\\040x/dev rw - devtmpfs d rw\n\
                    3 1 0:3 / /c/rootless rw - tmpfs t rw\n\
                    4 1 0:4 / /c/other/dev rw - tmpfs t rw\n";
        let m = parse_mountinfo(text);
        // The escaped space is decoded, so the mount is seen under the real path.
        let err = refuse_if_mounted(&m, Path::new("/c/root x")).unwrap_err();
        assert!(format!("{err}").contains("/c/root x/dev"), "{err}");
        // Component-wise: `/c/rootless` is not under `/c/root`.
        assert!(refuse_if_mounted(&m, Path::new("/c/root")).is_ok());
        assert_eq!(mounts_under(&m, Path::new("/c")).len(), 3);
        assert!(refuse_if_mounted(&m, Path::new("/c/other/dev")).is_err());
        assert!(refuse_if_mounted(&m, Path::new("/elsewhere")).is_ok());
    }

    #[test]
    fn the_mount_plan_stays_under_the_root_and_never_binds_the_hosts_dev() {
        let root = Path::new("/cache/root");
        let plan = mount_plan(
            root,
            Path::new("/opt/tc"),
            Some((
                Path::new("/r"),
                Path::new("/cache/u"),
                Path::new("/cache/w"),
            )),
        )
        .unwrap();
        for m in &plan {
            assert!(m.target.starts_with(root), "{m:?}");
            assert!(
                !m.args
                    .iter()
                    .any(|a| a.to_str().is_some_and(|a| a.starts_with("/dev"))),
                "{m:?}"
            );
        }
        let dev = plan.iter().find(|m| m.target == root.join("dev")).unwrap();
        assert_eq!(
            dev.args[..2],
            [OsString::from("-t"), OsString::from("tmpfs")]
        );
        let pts = plan
            .iter()
            .find(|m| m.target == root.join("dev/pts"))
            .unwrap();
        assert!(
            pts.args
                .iter()
                .any(|a| a.to_string_lossy().contains("newinstance"))
        );
        assert!(plan.iter().any(|m| m.target == root.join("opt/tc")));
        let overlay = plan.last().unwrap();
        assert_eq!(overlay.target, root.join("root/.cargo/registry"));
        assert_eq!(
            overlay.args.last().unwrap(),
            "lowerdir=/r,upperdir=/cache/u,workdir=/cache/w"
        );
        assert!(mount_plan(root, Path::new("relative"), None).is_err());
    }

    #[test]
    fn device_numbers_split_as_glibc_does() {
        assert_eq!(major_minor(0x103), (1, 3));
        assert_eq!(major_minor(0x0a_e8), (10, 232));
        // A minor past 255 and a major past 4095 use the high bits.
        let rdev = (0x1234u64 & 0xfff) << 8 | (0x1234u64 & !0xfff) << 32 | 0x45 | (0x100 << 12);
        assert_eq!(major_minor(rdev), (0x1234, 0x145));
        let null = std::fs::metadata("/dev/null").unwrap();
        assert_eq!(major_minor(null.rdev()), (1, 3));
    }

    #[test]
    fn options_parse_and_refuse_strangers() {
        let args = |a: &[&str]| a.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let o = Options::parse(&args(&["--mounts-only", "--full"])).unwrap();
        assert!(o.mounts_only && o.full && !o.rebuild && o.inside.is_none());
        assert!(Options::parse(&args(&["--nope"])).is_err());
        assert!(Options::parse(&args(&["--inside-namespace"])).is_err());
        let o = Options::parse(&args(&["--inside-namespace=mnt:[1]"])).unwrap();
        assert_eq!(o.inside.as_deref(), Some("mnt:[1]"));
    }

    #[test]
    fn the_copy_is_a_repository_at_this_head_whether_or_not_this_is_a_worktree() {
        let dest = std::env::temp_dir().join(format!("ferry-fresh-copy-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dest);
        copy_checkout(&dest).unwrap();
        let git = |dir: &Path, args: &[&str]| {
            let out = Command::new("git")
                .arg("-C")
                .arg(dir)
                .args(args)
                .output()
                .unwrap();
            assert!(out.status.success(), "git {args:?} in {}", dir.display());
            String::from_utf8_lossy(&out.stdout).into_owned()
        };
        let head = git(&dest, &["rev-parse", "HEAD"]);
        let files = git(&dest, &["ls-files"]);
        let _ = std::fs::remove_dir_all(&dest);
        assert_eq!(head, git(&project_root(), &["rev-parse", "HEAD"]));
        assert!(files.lines().any(|l| l == "Cargo.lock"), "{files}");
    }

    #[test]
    fn the_checkout_lists_files_that_exist() {
        let list = checkout_files().unwrap();
        let names: Vec<&[u8]> = list.split(|b| *b == 0).filter(|p| !p.is_empty()).collect();
        assert!(names.iter().any(|n| *n == b".ci/packages"));
        assert!(names.iter().any(|n| *n == b"Cargo.lock"));
        // `.git` itself where it is the repository, not where it names a linked worktree's.
        let git_dir = project_root().join(".git").is_dir();
        assert_eq!(names.iter().any(|n| *n == b".git"), git_dir);
        assert!(!names.iter().any(|n| n.starts_with(b"target/")));
    }
}
