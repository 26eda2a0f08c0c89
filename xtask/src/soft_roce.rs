//! `cargo xtask soft-roce [--host] [--require] [--require-bench] [--keep-share DIR]`: the RDMA
//! suite on real soft-RoCE (`rdma_rxe`) devices (ARCHITECTURE.md section 7).
//!
//! Guest mode (the default) builds once, and caches outside the repo, a small Debian guest with
//! the scripts in `xtask/soft-roce/`; builds the RDMA test binaries and the `ferry` binary on the
//! host; stages them in a share folder with a `guest-test.sh` generated from
//! `xtask/soft-roce/guest/*.sh`; boots the guest under QEMU (TCG, 2 vCPUs), which brings up
//! `rxe0`/`rxe1`, runs `ib_write_bw` and `ib_read_bw` as the reference, `ferry doctor` and
//! `ferry topology`, every test binary with `--include-ignored --test-threads=1`, and the ferry
//! RDMA bench; and then prints a table whose last line is `ferry/ib_write_bw = R`.
//!
//! `--host` runs the same script on the host itself, where the kernel can load `rdma_rxe` (a
//! GitHub-hosted runner). Where neither can run, one line says why and the task succeeds, unless
//! `--require` is given.
//!
//! Environment: `FERRY_SOFT_ROCE_DIR` (image cache, default `~/.cache/ferry/soft-roce`),
//! `FERRY_SOFT_ROCE_TIMEOUT` (seconds for the whole guest run, default 1200). For `cargo xtask
//! ci` ([`from_ci`]): `FERRY_REQUIRE_SOFT_ROCE=1` requires the suite,
//! `FERRY_REQUIRE_SOFT_ROCE_BENCH=1` also requires the ferry bench to run, and
//! `FERRY_SOFT_ROCE=skip` skips it (when it is not required).

use crate::util::{cargo, have, project_root, run as run_cmd};
use anyhow::{Context, Result, bail};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Instant;

/// Message size of the reference perftests and of the ferry bench.
const OP_SIZE: u64 = 1 << 20;
/// Operations per run: perftest `-n`, and `--total OP_SIZE * ITERS` for the ferry bench.
const ITERS: u64 = 128;
/// The guest's glibc (Debian bookworm): host-built binaries must not need a newer one.
const GUEST_GLIBC: (u32, u32) = (2, 36);
/// Packages whose test binaries run against the rxe devices.
const TEST_PACKAGES: &[&str] = &["ferry-transport-rdma", "ferry"];
/// Scripts that go into the guest image: the image is rebuilt when their hash changes.
const IMAGE_SCRIPTS: &[&str] = &["build-rootfs.sh", "make-image.sh", "guest-init.sh"];
/// Prefix of the result lines the guest script prints.
const MARK: &str = "@@ferry ";

/// The ferry RDMA bench, as two shell command lines run in the guest (or on the host with
/// `--host`) by `guest/suite.sh`: the server, whose output must contain the address it listens
/// on (`10.99.0.1:PORT`), and the client, where `@ADDR@` is replaced by that address and whose
/// stdout must end with the `--json` object carrying `gb_per_s`. `ferry` is the path of the
/// release binary. Adjust here when the CLI changes.
fn bench_commands(ferry: &str) -> (String, String) {
    let total = OP_SIZE * ITERS;
    // Pinned to the path perftest measures (one queue pair, client on rxe1, server on rxe0), so
    // that the ratio compares like with like; striping over both devices would flatter ferry.
    let serve = format!(
        "{ferry} serve --listen 10.99.0.1:0 --segment bench={total} --transport rdma --rdma-hca =rxe0"
    );
    let bench = format!(
        "{ferry} bench @ADDR@ --segment bench --transport rdma --rdma-hca =rxe1 --op write \
         --op-size {OP_SIZE} --total {total} --json"
    );
    (serve, bench)
}

#[derive(Debug, Default)]
struct Opts {
    host: bool,
    require: bool,
    require_bench: bool,
    keep_share: Option<PathBuf>,
}

/// `cargo xtask soft-roce ...`: exits non-zero when the suite failed, or could not run and
/// `--require` was given.
pub(crate) fn run(args: &[String]) -> Result<()> {
    let mut opts = Opts::default();
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--host" => opts.host = true,
            "--require" => opts.require = true,
            "--require-bench" => opts.require_bench = true,
            "--keep-share" => {
                let dir = it.next().context("--keep-share needs a directory")?;
                opts.keep_share = Some(PathBuf::from(dir));
            }
            other => bail!(
                "soft-roce: unknown argument `{other}` \
                 (usage: cargo xtask soft-roce [--host] [--require] [--require-bench] [--keep-share DIR])"
            ),
        }
    }
    let ready = if opts.host {
        host_ready()
    } else {
        guest_ready()
    };
    if let Err(why) = ready {
        return unavailable(&why, opts.require);
    }
    if !opts.host
        && let Err(e) = ensure_image(&cache_dir())
    {
        return unavailable(
            &format!("building the guest image failed: {e:#}"),
            opts.require,
        );
    }
    let report = suite(&opts)?;
    let failures = report.failures(opts.require_bench);
    report.print(&failures);
    if !failures.is_empty() {
        // After the ratio line on purpose: that line stays the last one of the report.
        std::process::exit(1);
    }
    Ok(())
}

/// The `soft-roce` step of `cargo xtask ci`: runs the suite on the host where the kernel can load
/// `rdma_rxe`, else in the guest where QEMU and debootstrap are (or can be made) available, else
/// prints one skip line. Fails when the suite fails, or when it cannot run and
/// `FERRY_REQUIRE_SOFT_ROCE=1`.
pub(crate) fn from_ci() -> Result<()> {
    let require = env_is("FERRY_REQUIRE_SOFT_ROCE", "1");
    if !require && env_is("FERRY_SOFT_ROCE", "skip") {
        eprintln!("soft-roce: SKIPPED: FERRY_SOFT_ROCE=skip");
        return Ok(());
    }
    let mut opts = Opts {
        require,
        require_bench: env_is("FERRY_REQUIRE_SOFT_ROCE_BENCH", "1"),
        ..Opts::default()
    };
    match host_ready() {
        Ok(()) => opts.host = true,
        Err(host_why) => {
            if let Err(guest_why) = guest_ready() {
                return unavailable(
                    &format!("{guest_why}; and on the host: {host_why}"),
                    require,
                );
            }
        }
    }
    if !opts.host
        && let Err(e) = ensure_image(&cache_dir())
    {
        return unavailable(
            &format!("building the guest image failed: {e:#}"),
            opts.require,
        );
    }
    let report = suite(&opts)?;
    let failures = report.failures(opts.require_bench);
    report.print(&failures);
    if !failures.is_empty() {
        bail!("soft-roce: {}", failures.join("; "));
    }
    Ok(())
}

fn env_is(name: &str, value: &str) -> bool {
    std::env::var(name).is_ok_and(|v| v == value)
}

fn unavailable(why: &str, require: bool) -> Result<()> {
    if require {
        bail!("soft-roce: cannot run the suite, and it is required: {why}");
    }
    eprintln!(
        "soft-roce: SKIPPED: {why} (--require or FERRY_REQUIRE_SOFT_ROCE=1 makes this an error)"
    );
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Can this machine run the suite?

fn is_root() -> bool {
    std::fs::read_to_string("/proc/self/status").is_ok_and(|s| {
        s.lines()
            .find(|l| l.starts_with("Uid:"))
            .and_then(|l| l.split_whitespace().nth(2))
            .is_some_and(|euid| euid == "0")
    })
}

/// Whether commands needing root can run: as root, or through password-less sudo.
fn root_prefix() -> Option<Vec<String>> {
    if is_root() {
        return Some(Vec::new());
    }
    let sudo_ok = have("sudo")
        && Command::new("sudo")
            .args(["-n", "true"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
    sudo_ok.then(|| vec!["sudo".to_owned(), "-n".to_owned(), "-E".to_owned()])
}

fn root_command(prog: &str) -> Option<Command> {
    let prefix = root_prefix()?;
    Some(match prefix.split_first() {
        None => Command::new(prog),
        Some((first, rest)) => {
            let mut c = Command::new(first);
            c.args(rest).arg(prog);
            c
        }
    })
}

/// Installs missing Debian packages with apt-get where that is possible (root or sudo).
fn apt_install(pkgs: &[&str]) -> std::result::Result<(), String> {
    if pkgs.is_empty() {
        return Ok(());
    }
    if !have("apt-get") {
        return Err(format!("{} missing and no apt-get here", pkgs.join(", ")));
    }
    let Some(mut cmd) = root_command("apt-get") else {
        return Err(format!(
            "{} missing and installing needs root",
            pkgs.join(", ")
        ));
    };
    eprintln!("soft-roce: installing {}", pkgs.join(" "));
    cmd.args(["install", "-y", "--no-install-recommends"])
        .args(pkgs)
        .env("DEBIAN_FRONTEND", "noninteractive")
        .stdout(Stdio::null());
    match cmd.status() {
        Ok(s) if s.success() => Ok(()),
        Ok(s) => Err(format!("apt-get install {} failed ({s})", pkgs.join(" "))),
        Err(e) => Err(format!("apt-get install {}: {e}", pkgs.join(" "))),
    }
}

fn host_glibc() -> Option<(u32, u32)> {
    let out = Command::new("getconf")
        .arg("GNU_LIBC_VERSION")
        .output()
        .ok()?;
    let text = String::from_utf8_lossy(&out.stdout);
    let ver = text.split_whitespace().nth(1)?;
    let mut parts = ver.split('.');
    let major = parts.next()?.parse().ok()?;
    let minor = parts.next()?.parse().ok()?;
    Some((major, minor))
}

/// Guest mode: QEMU, debootstrap and mkfs.ext4 present or installable, root to build the image
/// (unless cached), x86_64, and a host glibc the guest can run binaries of.
fn guest_ready() -> std::result::Result<(), String> {
    if std::env::consts::ARCH != "x86_64" {
        return Err(format!(
            "the soft-RoCE guest is x86_64 and this host is {}",
            std::env::consts::ARCH
        ));
    }
    match host_glibc() {
        Some(v) if v > GUEST_GLIBC => {
            return Err(format!(
                "host glibc {}.{} is newer than the guest's {}.{}, so host-built test binaries cannot run in the guest",
                v.0, v.1, GUEST_GLIBC.0, GUEST_GLIBC.1
            ));
        }
        Some(_) => {}
        None => {
            return Err("cannot tell the host's glibc version (getconf GNU_LIBC_VERSION)".into());
        }
    }
    let image_ok = image_is_current(&cache_dir()).unwrap_or(false);
    let mut missing = Vec::new();
    if !have("qemu-system-x86_64") {
        missing.push("qemu-system-x86");
    }
    if !image_ok {
        if !have("debootstrap") {
            missing.push("debootstrap");
        }
        if !have("mkfs.ext4") {
            missing.push("e2fsprogs");
        }
        if !Path::new("/usr/share/keyrings/debian-archive-keyring.gpg").exists() {
            missing.push("debian-archive-keyring");
        }
    }
    apt_install(&missing).map_err(|e| format!("QEMU/debootstrap unavailable: {e}"))?;
    if !image_ok && !is_root() {
        return Err(format!(
            "building the guest image (debootstrap, chroot) needs root, and {} holds no current image",
            cache_dir().display()
        ));
    }
    Ok(())
}

/// Host mode: `rdma_rxe` loaded or loadable, root (or sudo), and perftest, rdma and ip present
/// (installed where possible).
fn host_ready() -> std::result::Result<(), String> {
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease")
        .map(|s| s.trim().to_owned())
        .unwrap_or_else(|_| "?".to_owned());
    if root_prefix().is_none() {
        return Err("creating rxe devices on the host needs root or password-less sudo".into());
    }
    if !Path::new("/sys/module/rdma_rxe").exists() {
        let loaded = have("modprobe")
            && root_command("modprobe")
                .map(|mut c| {
                    c.arg("rdma_rxe")
                        .stdout(Stdio::null())
                        .stderr(Stdio::null())
                        .status()
                        .is_ok_and(|s| s.success())
                })
                .unwrap_or(false);
        if !loaded {
            return Err(format!("the host kernel {kernel} cannot load rdma_rxe"));
        }
    }
    let mut missing = Vec::new();
    for (prog, pkg) in [
        ("ib_write_bw", "perftest"),
        ("rdma", "iproute2"),
        ("ip", "iproute2"),
        ("ibv_devinfo", "ibverbs-utils"),
    ] {
        if !have(prog) && !missing.contains(&pkg) {
            missing.push(pkg);
        }
    }
    if !missing.is_empty() {
        missing.extend(["rdma-core", "ibverbs-providers"]);
    }
    apt_install(&missing)
}

// ---------------------------------------------------------------------------------------------
// The guest image, cached outside the repo.

fn cache_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("FERRY_SOFT_ROCE_DIR") {
        return PathBuf::from(d);
    }
    let home = std::env::var_os("HOME").map_or_else(|| PathBuf::from("/tmp"), PathBuf::from);
    home.join(".cache/ferry/soft-roce")
}

fn scripts_dir() -> PathBuf {
    project_root().join("xtask/soft-roce")
}

/// FNV-1a (64 bit) over the names and contents of the image scripts: a change detector.
fn image_hash() -> Result<String> {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for name in IMAGE_SCRIPTS {
        let path = scripts_dir().join(name);
        let body = std::fs::read(&path).with_context(|| format!("reading {}", path.display()))?;
        for b in name
            .as_bytes()
            .iter()
            .chain([0u8].iter())
            .chain(body.iter())
        {
            h ^= u64::from(*b);
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
    }
    Ok(format!("{h:016x}"))
}

fn image_is_current(dir: &Path) -> Result<bool> {
    let want = image_hash()?;
    let have_hash = std::fs::read_to_string(dir.join("image.hash")).unwrap_or_default();
    Ok(have_hash.trim() == want
        && ["rootfs.img", "initrd.img", "vmlinuz"]
            .iter()
            .all(|f| dir.join(f).is_file()))
}

fn ensure_image(dir: &Path) -> Result<()> {
    if image_is_current(dir)? {
        eprintln!("soft-roce: guest image cached in {}", dir.display());
        return Ok(());
    }
    let t = Instant::now();
    eprintln!(
        "soft-roce: building the guest image in {} (debootstrap, a few minutes, once)",
        dir.display()
    );
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let stamp = dir.join("image.hash");
    if stamp.exists() {
        std::fs::remove_file(&stamp).with_context(|| format!("removing {}", stamp.display()))?;
    }
    for script in ["build-rootfs.sh", "make-image.sh"] {
        run_cmd(
            Command::new("bash")
                .arg(scripts_dir().join(script))
                .env("SOFT_ROCE_DIR", dir),
        )?;
    }
    std::fs::write(&stamp, image_hash()?)
        .with_context(|| format!("writing {}", stamp.display()))?;
    eprintln!(
        "soft-roce: guest image built in {:.0}s",
        t.elapsed().as_secs_f64()
    );
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Host builds.

/// One executable from cargo's JSON messages.
#[derive(Debug, Clone, PartialEq)]
struct Artifact {
    /// `package:target`, for people.
    label: String,
    executable: PathBuf,
    /// The package directory (test binaries run there, as under `cargo test`).
    package_dir: PathBuf,
}

/// The JSON string value after `"key":` in `line`, with the common escapes undone.
fn json_str(line: &str, key: &str) -> Option<String> {
    let pat = format!("\"{key}\":\"");
    let start = line.find(&pat)? + pat.len();
    let mut out = String::new();
    let mut chars = line[start..].chars();
    while let Some(c) = chars.next() {
        match c {
            '"' => return Some(out),
            '\\' => match chars.next()? {
                'n' => out.push('\n'),
                't' => out.push('\t'),
                other => out.push(other),
            },
            c => out.push(c),
        }
    }
    None
}

/// The JSON number after `"key":` in `line`.
fn json_num(line: &str, key: &str) -> Option<f64> {
    let pat = format!("\"{key}\":");
    let start = line.find(&pat)? + pat.len();
    let rest = line[start..].trim_start();
    let end = rest
        .find(|c: char| !(c.is_ascii_digit() || matches!(c, '.' | '-' | '+' | 'e' | 'E')))
        .unwrap_or(rest.len());
    rest[..end].parse().ok()
}

/// Executables of compiler-artifact messages; with `tests_only`, only test-profile ones.
fn parse_artifacts(json_lines: &str, tests_only: bool) -> Vec<Artifact> {
    let mut found = Vec::new();
    for line in json_lines.lines() {
        if !line.contains("\"reason\":\"compiler-artifact\"") {
            continue;
        }
        let Some(exe) = json_str(line, "executable") else {
            continue;
        };
        let is_test = line
            .find("\"profile\":{")
            .is_some_and(|p| line[p..].contains("\"test\":true"));
        if tests_only && !is_test {
            continue;
        }
        let manifest = json_str(line, "manifest_path").map(PathBuf::from);
        let package_dir = manifest
            .as_deref()
            .and_then(Path::parent)
            .map_or_else(project_root, Path::to_path_buf);
        let package = package_dir
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let target = line
            .find("\"target\":{")
            .and_then(|p| json_str(&line[p..], "name"))
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
fn cargo_json(args: &[&str]) -> Result<std::result::Result<String, String>> {
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

#[derive(Debug, Default)]
struct Builds {
    tests: Vec<Artifact>,
    ferry: Option<PathBuf>,
    /// Packages that could not be built (a compile error): each a failure of the suite.
    broken: Vec<String>,
    /// Notes for people: packages absent from the workspace, binaries missing.
    notes: Vec<String>,
}

fn build_on_host() -> Result<Builds> {
    let mut b = Builds::default();
    for pkg in TEST_PACKAGES {
        match cargo_json(&["test", "--no-run", "-p", pkg])? {
            Ok(stdout) => {
                let found = parse_artifacts(&stdout, true);
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
    match cargo_json(&["build", "--release", "-p", "ferry-cli"])? {
        Ok(stdout) => {
            b.ferry = parse_artifacts(&stdout, false)
                .into_iter()
                .map(|a| a.executable)
                .find(|p| p.file_name().is_some_and(|n| n == "ferry"));
            if b.ferry.is_none() {
                b.notes.push("ferry-cli built no `ferry` binary".to_owned());
            }
        }
        Err(stderr) => {
            eprint!("{stderr}");
            b.broken
                .push("building ferry-cli (release) failed".to_owned());
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

// ---------------------------------------------------------------------------------------------
// The share folder and the generated guest-test.sh.

/// Seconds one test binary may run in the guest: `FERRY_SOFT_ROCE_TEST_TIMEOUT`, default 300.
fn test_timeout() -> String {
    std::env::var("FERRY_SOFT_ROCE_TEST_TIMEOUT")
        .ok()
        .filter(|v| v.parse::<u32>().is_ok_and(|n| n > 0))
        .unwrap_or_else(|| "300".to_owned())
}

/// A shell word that reads back as `s`.
fn sh_quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
}

/// Links (or copies) `from` to `to`, executable.
fn stage_file(from: &Path, to: &Path) -> Result<()> {
    if to.exists() {
        std::fs::remove_file(to).with_context(|| format!("removing {}", to.display()))?;
    }
    if std::fs::hard_link(from, to).is_err() {
        std::fs::copy(from, to)
            .with_context(|| format!("copying {} to {}", from.display(), to.display()))?;
    }
    Ok(())
}

/// Names of the staged test binaries: the executable's file name (unique: it carries cargo's hash).
fn staged_name(a: &Artifact) -> String {
    a.executable
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| a.label.replace(':', "-"))
}

/// The guest script: a header with this run's settings, then the parts from `guest/`.
fn guest_script(host: bool, share_in_guest: &str, builds: &Builds) -> String {
    let mut s = String::new();
    s.push_str("#!/bin/bash\n# Generated by `cargo xtask soft-roce` from xtask/soft-roce/guest/*.sh: do not edit.\nset -u\n");
    let root = project_root();
    let ferry = format!("{share_in_guest}/bin/ferry");
    let (serve, bench) = bench_commands(&ferry);
    let vars = [
        ("MODE", if host { "host" } else { "guest" }.to_owned()),
        ("SHARE", share_in_guest.to_owned()),
        ("REPO", root.display().to_string()),
        ("LIVE", if host { "" } else { "/dev/ttyS0" }.to_owned()),
        ("OP_SIZE", OP_SIZE.to_string()),
        ("ITERS", ITERS.to_string()),
        ("TEST_TIMEOUT", test_timeout()),
        ("FERRY", ferry.clone()),
        ("FERRY_SERVE", serve),
        ("FERRY_BENCH", bench),
    ];
    for (k, v) in vars {
        let _ = writeln!(s, "{k}={}", sh_quote(&v));
    }
    s.push_str("TESTS=(\n");
    for t in &builds.tests {
        let entry = format!("{}|{}", staged_name(t), t.package_dir.display());
        let _ = writeln!(s, "  {}", sh_quote(&entry));
    }
    s.push_str(")\n");
    let mut parts: Vec<(&str, &str)> = Vec::new();
    if host {
        parts.push((
            "host-teardown.sh",
            include_str!("../soft-roce/guest/host-teardown.sh"),
        ));
    }
    parts.push((
        "setup-rxe-pair.sh",
        include_str!("../soft-roce/guest/setup-rxe-pair.sh"),
    ));
    parts.push(("suite.sh", include_str!("../soft-roce/guest/suite.sh")));
    for (name, body) in parts {
        let _ = writeln!(s, "\n# ---- guest/{name}");
        for line in body.lines().filter(|l| !l.starts_with("#!")) {
            s.push_str(line);
            s.push('\n');
        }
    }
    s
}

fn stage(share: &Path, host: bool, builds: &Builds) -> Result<()> {
    for sub in ["tests", "bin"] {
        let d = share.join(sub);
        if d.exists() {
            std::fs::remove_dir_all(&d).with_context(|| format!("clearing {}", d.display()))?;
        }
        std::fs::create_dir_all(&d).with_context(|| format!("creating {}", d.display()))?;
    }
    for t in &builds.tests {
        stage_file(&t.executable, &share.join("tests").join(staged_name(t)))?;
    }
    if let Some(f) = &builds.ferry {
        stage_file(f, &share.join("bin/ferry"))?;
    }
    let in_guest = if host {
        share.display().to_string()
    } else {
        "/mnt/host".to_owned()
    };
    let script = share.join("guest-test.sh");
    std::fs::write(&script, guest_script(host, &in_guest, builds))
        .with_context(|| format!("writing {}", script.display()))?;
    run_cmd(Command::new("chmod").arg("0755").arg(&script))?;
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// The run and its report.

fn suite(opts: &Opts) -> Result<Report> {
    let t0 = Instant::now();
    let cache = cache_dir();
    let builds = build_on_host()?;
    let (share, temporary) = match &opts.keep_share {
        Some(d) => (d.clone(), false),
        None => (
            std::env::temp_dir().join(format!("ferry-soft-roce-{}", std::process::id())),
            true,
        ),
    };
    std::fs::create_dir_all(&share).with_context(|| format!("creating {}", share.display()))?;
    let share = share
        .canonicalize()
        .with_context(|| format!("resolving {}", share.display()))?;
    stage(&share, opts.host, &builds)?;
    let log_path = share.join("result.log");
    if log_path.exists() {
        std::fs::remove_file(&log_path)
            .with_context(|| format!("removing {}", log_path.display()))?;
    }
    let t_run = Instant::now();
    let run_status = if opts.host {
        eprintln!("soft-roce: running the suite on the host (rxe0/rxe1 on a veth pair)");
        let Some(mut cmd) = root_command("bash") else {
            bail!("soft-roce: root or password-less sudo needed for --host");
        };
        let line = format!(
            "{} 2>&1 | tee {}; exit ${{PIPESTATUS[0]}}",
            sh_quote(&share.join("guest-test.sh").display().to_string()),
            sh_quote(&log_path.display().to_string())
        );
        cmd.arg("-c").arg(line);
        cmd.status().context("running guest-test.sh on the host")?
    } else {
        let timeout = std::env::var("FERRY_SOFT_ROCE_TIMEOUT").unwrap_or_else(|_| "1800".into());
        eprintln!(
            "soft-roce: booting the guest (QEMU TCG, 2 vCPUs, up to {timeout}s); results appear as @@ferry lines"
        );
        Command::new("bash")
            .arg(scripts_dir().join("run-vm.sh"))
            .env("SOFT_ROCE_DIR", &cache)
            .env("SHARE", &share)
            .env("REPO", project_root())
            .env("CONSOLE", share.join("console.log"))
            .env("TIMEOUT", timeout)
            .env("ACCEL", "tcg")
            .env("SMP", "2")
            .status()
            .context("running xtask/soft-roce/run-vm.sh")?
    };
    let run_s = t_run.elapsed().as_secs_f64();
    let log = std::fs::read_to_string(&log_path).unwrap_or_default();
    let mut report = Report::parse(&log, opts.host);
    report.run_ok = run_status.success();
    report.run_s = run_s;
    report.total_s = t0.elapsed().as_secs_f64();
    report.broken_builds = builds.broken;
    report.notes = builds.notes;
    report.expected_tests = builds
        .tests
        .iter()
        .map(|t| (staged_name(t), t.label.clone()))
        .collect();
    let failed = !report.failures(opts.require_bench).is_empty();
    if failed {
        eprintln!("---- {} ----", log_path.display());
        eprint!("{log}");
        if log.is_empty() {
            let console = std::fs::read_to_string(share.join("console.log")).unwrap_or_default();
            eprintln!("---- guest console ----");
            eprint!("{console}");
        }
        eprintln!("---- end ----");
    }
    if temporary && !failed {
        let _ = std::fs::remove_dir_all(&share);
    } else {
        eprintln!("soft-roce: share folder kept: {}", share.display());
    }
    Ok(report)
}

#[derive(Debug, Default, PartialEq)]
struct RefRate {
    tool: String,
    /// When it ran: `before-bench` or `after-bench`.
    when: String,
    /// 10^9 bytes per second.
    gb_per_s: Option<f64>,
    detail: String,
}

#[derive(Debug, Default, PartialEq)]
struct TestRun {
    name: String,
    rc: String,
    passed: u64,
    failed: u64,
    ignored: u64,
    wall_s: String,
    timeout_s: String,
}

impl TestRun {
    fn outcome(&self) -> String {
        match self.rc.as_str() {
            "0" => "ok".to_owned(),
            "124" | "137" => format!("TIMED OUT after {}s", self.timeout_s),
            rc => format!("FAILED rc={rc}"),
        }
    }
}

#[derive(Debug, Default)]
struct Report {
    host: bool,
    setup: Option<String>,
    refs: Vec<RefRate>,
    cmds: Vec<(String, String)>,
    tests: Vec<TestRun>,
    /// Ok(GB/s) or Err(why it did not run).
    bench: Option<std::result::Result<f64, String>>,
    /// Packets rxe0 and rxe1 sent during the bench.
    bench_pkts: Option<String>,
    end: Option<String>,
    /// `guest-test.sh exit=N` from the guest's init.
    guest_exit: Option<String>,
    run_ok: bool,
    run_s: f64,
    total_s: f64,
    broken_builds: Vec<String>,
    notes: Vec<String>,
    /// Staged names of the test binaries, with their `package:target` labels.
    expected_tests: Vec<(String, String)>,
}

/// The bench's bytes must have crossed rxe0/rxe1: at least one packet per 4096 bytes (the
/// largest RoCE MTU) is sent, or the bench did not run over RDMA and its rate is no RDMA rate.
fn check_rxe_packets(bytes: f64, pkts: Option<&str>) -> std::result::Result<(), String> {
    let Some(n) = pkts.and_then(|p| p.parse::<f64>().ok()) else {
        return Ok(()); // counters unreadable: nothing to check against
    };
    let least = (bytes / 4096.0).ceil();
    if n < least {
        return Err(format!(
            "ferry bench sent {n} rxe packets for {bytes} bytes, fewer than the {least} RDMA needs: not over rxe"
        ));
    }
    Ok(())
}

/// `key=value` words of a result line.
fn kv<'a>(words: &'a str, key: &str) -> Option<&'a str> {
    words
        .split_whitespace()
        .find_map(|w| w.strip_prefix(key)?.strip_prefix('='))
}

/// perftest's average bandwidth in 10^9 bytes per second; its MB is 2^20 bytes.
fn perftest_gb_per_s(bw: f64, unit: &str) -> Option<f64> {
    match unit {
        "MB/sec" => Some(bw * 1_048_576.0 / 1e9),
        "Gb/sec" => Some(bw / 8.0),
        _ => None,
    }
}

impl Report {
    fn parse(log: &str, host: bool) -> Report {
        let mut r = Report {
            host,
            ..Report::default()
        };
        for line in log.lines() {
            if let Some(exit) = line.strip_prefix("rxe-init: guest-test.sh exit=") {
                r.guest_exit = Some(exit.trim().to_owned());
            }
            // Anywhere in the line: output of a killed test may precede it.
            let Some(rest) = line.find(MARK).map(|p| &line[p + MARK.len()..]) else {
                continue;
            };
            let (kind, words) = rest.split_once(' ').unwrap_or((rest, ""));
            match kind {
                "setup" => r.setup = Some(words.to_owned()),
                "ref" => {
                    let tool = words.split_whitespace().next().unwrap_or("?").to_owned();
                    let rate = if kv(words, "status") == Some("ok") {
                        kv(words, "bw_avg")
                            .and_then(|v| v.parse::<f64>().ok())
                            .and_then(|bw| perftest_gb_per_s(bw, kv(words, "unit").unwrap_or("")))
                    } else {
                        None
                    };
                    let detail = match rate {
                        Some(_) => format!(
                            "{} {}, {} x {} B, {}s wall",
                            kv(words, "bw_avg").unwrap_or("?"),
                            kv(words, "unit").unwrap_or("?"),
                            kv(words, "iters").unwrap_or("?"),
                            kv(words, "bytes").unwrap_or("?"),
                            kv(words, "wall_s").unwrap_or("?")
                        ),
                        None => format!(
                            "FAILED ({})",
                            kv(words, "reason").unwrap_or("no bandwidth in its output")
                        ),
                    };
                    r.refs.push(RefRate {
                        tool,
                        when: kv(words, "when").unwrap_or("?").to_owned(),
                        gb_per_s: rate,
                        detail,
                    });
                }
                "cmd" => {
                    let sub = words.split_whitespace().next().unwrap_or("?").to_owned();
                    r.cmds
                        .push((sub, kv(words, "rc").unwrap_or("?").to_owned()));
                }
                "test" => {
                    let num = |k| kv(words, k).and_then(|v| v.parse().ok()).unwrap_or(0);
                    r.tests.push(TestRun {
                        name: words.split_whitespace().next().unwrap_or("?").to_owned(),
                        rc: kv(words, "rc").unwrap_or("?").to_owned(),
                        passed: num("passed"),
                        failed: num("failed"),
                        ignored: num("ignored"),
                        wall_s: kv(words, "wall_s").unwrap_or("?").to_owned(),
                        timeout_s: kv(words, "timeout_s").unwrap_or("?").to_owned(),
                    });
                }
                "bench" => {
                    r.bench_pkts = kv(words, "rxe_pkts").map(str::to_owned);
                    r.bench = Some(if kv(words, "status") == Some("ok") {
                        match words.find("json=").map(|p| &words[p + 5..]) {
                            Some(json) => json_num(json, "gb_per_s")
                                .filter(|v| v.is_finite() && *v > 0.0)
                                .ok_or_else(|| "no gb_per_s in its --json output".to_owned())
                                .and_then(|g| {
                                    let bytes = json_num(json, "total_bytes")
                                        .unwrap_or((OP_SIZE * ITERS) as f64);
                                    check_rxe_packets(bytes, kv(words, "rxe_pkts")).map(|()| g)
                                }),
                            None => Err("no --json output".to_owned()),
                        }
                    } else {
                        Err(format!(
                            "ferry bench failed: {}",
                            kv(words, "reason").unwrap_or("?")
                        ))
                    });
                }
                "end" => r.end = Some(words.to_owned()),
                _ => {}
            }
        }
        r
    }

    /// The `package:target` label of a staged test binary, or its name.
    fn label<'a>(&'a self, name: &'a str) -> &'a str {
        self.expected_tests
            .iter()
            .find(|(n, _)| n == name)
            .map_or(name, |(_, l)| l.as_str())
    }

    /// The ib_write_bw reference: the mean of its runs before and after the bench.
    fn write_rate(&self) -> Option<f64> {
        let rates: Vec<f64> = self
            .refs
            .iter()
            .filter(|r| r.tool == "ib_write_bw")
            .filter_map(|r| r.gb_per_s)
            .collect();
        (!rates.is_empty()).then(|| rates.iter().sum::<f64>() / rates.len() as f64)
    }

    /// What makes the run fail; empty when it passed.
    fn failures(&self, require_bench: bool) -> Vec<String> {
        let mut f = self.broken_builds.clone();
        let place = if self.host { "host suite" } else { "guest" };
        if self.setup.is_none() {
            f.push(format!("{place}: rxe setup did not complete"));
        }
        if self.end.is_none() {
            f.push(format!("{place}: the suite did not finish"));
        }
        if !self.host && self.guest_exit.is_none() {
            f.push("guest: no exit status from the guest (boot failure or timeout?)".to_owned());
        }
        if !self.run_ok {
            f.push(format!("{place}: exited with failure"));
        }
        for r in &self.refs {
            if r.gb_per_s.is_none() {
                f.push(format!("{}: {}", r.tool, r.detail));
            }
        }
        for t in &self.tests {
            if t.rc != "0" {
                f.push(format!(
                    "{} ({}): {}, {} failed",
                    self.label(&t.name),
                    t.name,
                    t.outcome(),
                    t.failed
                ));
            }
        }
        for (name, label) in &self.expected_tests {
            if self.end.is_some() && !self.tests.iter().any(|t| &t.name == name) {
                f.push(format!("{label} ({name}): did not run"));
            }
        }
        if require_bench {
            match &self.bench {
                Some(Ok(_)) => {}
                Some(Err(why)) => f.push(why.clone()),
                None => f.push("ferry bench did not run".to_owned()),
            }
        }
        f
    }

    fn ratio_line(&self) -> String {
        let write = self.write_rate();
        match (&self.bench, write) {
            (Some(Ok(ferry)), Some(reference)) => {
                format!("ferry/ib_write_bw = {:.2}", ferry / reference)
            }
            (Some(Err(why)), _) => format!("ferry/ib_write_bw = n/a ({why})"),
            (None, _) => "ferry/ib_write_bw = n/a (the ferry bench did not run)".to_owned(),
            (Some(Ok(_)), None) => {
                "ferry/ib_write_bw = n/a (no ib_write_bw reference rate)".to_owned()
            }
        }
    }

    fn print(&self, failures: &[String]) {
        let mode = if self.host {
            "host, rdma_rxe on a veth pair"
        } else {
            "guest, QEMU TCG 2 vCPUs, rdma_rxe on a veth pair"
        };
        println!();
        println!("soft-roce results ({mode}; rxe1 -> rxe0, {OP_SIZE} B ops x {ITERS})");
        if let Some(s) = &self.setup {
            println!(
                "  {:<44} rxe0 gid[{}] {}, rxe1 gid[{}] {}; kernel {}, {} cpus",
                "setup",
                kv(s, "gids")
                    .and_then(|g| g.split(',').next())
                    .unwrap_or("?"),
                kv(s, "gid0").unwrap_or("?"),
                kv(s, "gids")
                    .and_then(|g| g.split(',').nth(1))
                    .unwrap_or("?"),
                kv(s, "gid1").unwrap_or("?"),
                kv(s, "kernel").unwrap_or("?"),
                kv(s, "cpus").unwrap_or("?")
            );
        }
        for r in &self.refs {
            let rate = r
                .gb_per_s
                .map_or_else(|| "-".to_owned(), |g| format!("{g:.4} GB/s"));
            println!(
                "  {:<44} {:<14} {}",
                format!("{} (reference, {})", r.tool, r.when),
                rate,
                r.detail
            );
        }
        for (sub, rc) in &self.cmds {
            let what = if rc == "0" {
                "ok".to_owned()
            } else {
                format!("failed rc={rc} (reported, not fatal)")
            };
            println!("  {:<44} {}", format!("ferry {sub}"), what);
        }
        for t in &self.tests {
            println!(
                "  {:<44} {:<14} {} passed, {} failed, {} ignored, {}s",
                format!("test {}", self.label(&t.name)),
                t.outcome(),
                t.passed,
                t.failed,
                t.ignored,
                t.wall_s
            );
        }
        if self.tests.is_empty() {
            println!("  {:<44} none found", "test binaries");
        }
        let bench = match &self.bench {
            Some(Ok(g)) => format!(
                "{g:.4} GB/s     {} rxe packets sent during it",
                self.bench_pkts.as_deref().unwrap_or("?")
            ),
            Some(Err(why)) => format!("- ({why})"),
            None => "- (did not run)".to_owned(),
        };
        println!(
            "  {:<44} {}",
            "ferry bench --transport rdma --op write", bench
        );
        for n in &self.notes {
            println!("  note: {n}");
        }
        println!(
            "  cycle: {:.1}s {}, {:.1}s in all",
            self.run_s,
            if self.host {
                "suite"
            } else {
                "guest boot + suite"
            },
            self.total_s
        );
        if failures.is_empty() {
            println!("soft-roce: PASSED");
        } else {
            println!("soft-roce: FAILED: {}", failures.join("; "));
        }
        println!("{}", self.ratio_line());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LOG: &str = "\
noise
@@ferry setup status=ok mode=guest devices=rxe0,rxe1 gids=1,1 gid0=x gid1=y
@@ferry ref ib_write_bw when=before-bench status=ok bytes=1048576 iters=128 bw_avg=26.80 unit=MB/sec wall_s=5.1
@@ferry ref ib_read_bw status=failed reason=client-rc-1-server-rc-0
@@ferry cmd doctor rc=0
@@ferry cmd topology rc=2
@@ferry test ferry_transport_rdma-0123 rc=0 passed=5 failed=0 ignored=0 wall_s=3.2
@@ferry test ferry-99 rc=101 passed=3 failed=1 ignored=0 wall_s=1.0
@@ferry ref ib_write_bw when=after-bench status=ok bytes=1048576 iters=128 bw_avg=28.80 unit=MB/sec wall_s=5.1
@@ferry bench status=ok wall_s=6.0 rxe_pkts=33000 json={\"transport\":\"rdma\",\"op\":\"write\",\"gb_per_s\":0.0253,\"ops_per_s\":24.1}
test slow ... @@ferry test slow-1 rc=124 passed=0 failed=0 ignored=0 wall_s=300.1 timeout_s=300
@@ferry end fails=1 uptime=40.1
rxe-init: guest-test.sh exit=1
";

    #[test]
    fn parses_every_result_line() {
        let r = Report::parse(LOG, false);
        assert!(r.setup.is_some());
        assert_eq!(r.refs.len(), 3);
        assert_eq!(r.refs[0].when, "before-bench");
        let w = r.write_rate().unwrap();
        assert!(
            (w - 27.80 * 1_048_576.0 / 1e9).abs() < 1e-12,
            "mean of both runs: {w}"
        );
        assert_eq!(r.refs[1].gb_per_s, None);
        assert_eq!(
            r.cmds,
            vec![
                ("doctor".into(), "0".into()),
                ("topology".into(), "2".into())
            ]
        );
        assert_eq!(r.tests.len(), 3);
        assert_eq!(r.tests[2].outcome(), "TIMED OUT after 300s");
        assert_eq!((r.tests[1].passed, r.tests[1].failed), (3, 1));
        assert_eq!(r.bench, Some(Ok(0.0253)));
        assert_eq!(r.guest_exit.as_deref(), Some("1"));
        let line = r.ratio_line();
        assert_eq!(line, format!("ferry/ib_write_bw = {:.2}", 0.0253 / w));
    }

    #[test]
    fn failures_name_what_failed() {
        let mut r = Report::parse(LOG, false);
        r.run_ok = false;
        let f = r.failures(false);
        assert!(f.iter().any(|s| s.starts_with("ib_read_bw")), "{f:?}");
        assert!(
            f.iter()
                .any(|s| s.starts_with("ferry-99 (ferry-99): FAILED rc=101")),
            "{f:?}"
        );
        assert!(
            !f.iter().any(|s| s.contains("ferry_transport_rdma")),
            "{f:?}"
        );
    }

    #[test]
    fn a_failed_or_missing_bench_is_not_a_number() {
        let failed = LOG.replace(
            "@@ferry bench status=ok wall_s=6.0 rxe_pkts=33000 json={\"transport\":\"rdma\",\"op\":\"write\",\"gb_per_s\":0.0253,\"ops_per_s\":24.1}",
            "@@ferry bench status=failed reason=serve-printed-no-address",
        );
        let r = Report::parse(&failed, false);
        assert_eq!(
            r.ratio_line(),
            "ferry/ib_write_bw = n/a (ferry bench failed: serve-printed-no-address)"
        );
        assert!(
            r.failures(true)
                .iter()
                .any(|s| s.contains("serve-printed-no-address"))
        );
        assert!(!r.failures(false).iter().any(|s| s.contains("bench")));
        let missing: String = LOG
            .lines()
            .filter(|l| !l.contains("bench"))
            .map(|l| format!("{l}\n"))
            .collect();
        let r = Report::parse(&missing, false);
        assert!(r.ratio_line().starts_with("ferry/ib_write_bw = n/a"));
        assert!(r.failures(true).iter().any(|s| s.contains("did not run")));
    }

    #[test]
    fn an_empty_log_is_a_failed_guest() {
        let r = Report::parse("", false);
        let f = r.failures(false);
        assert!(f.iter().any(|s| s.contains("no exit status")), "{f:?}");
        assert!(f.iter().any(|s| s.contains("setup")), "{f:?}");
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

    #[test]
    fn json_helpers() {
        assert_eq!(
            json_str(r#"{"a":"x\"y\\z"}"#, "a").as_deref(),
            Some("x\"y\\z")
        );
        assert_eq!(
            json_num(r#"{"gb_per_s": 1.5e-2,"x":1}"#, "gb_per_s"),
            Some(0.015)
        );
        assert_eq!(json_num(r#"{"gb_per_s":null}"#, "gb_per_s"), None);
        assert_eq!(sh_quote("it's"), r"'it'\''s'");
    }

    #[test]
    fn a_bench_that_did_not_cross_rxe_has_no_rate() {
        let over_tcp = LOG.replace("rxe_pkts=33000", "rxe_pkts=1200");
        let r = Report::parse(&over_tcp, false);
        assert!(
            matches!(&r.bench, Some(Err(why)) if why.contains("not over rxe")),
            "{:?}",
            r.bench
        );
        assert!(
            r.ratio_line()
                .starts_with("ferry/ib_write_bw = n/a (ferry bench sent 1200")
        );
        assert_eq!(check_rxe_packets(8192.0, Some("2")), Ok(()));
        assert!(check_rxe_packets(8193.0, Some("2")).is_err());
        assert_eq!(check_rxe_packets(8193.0, Some("unknown")), Ok(()));
    }

    #[test]
    fn perftest_units() {
        assert_eq!(perftest_gb_per_s(1000.0, "MB/sec"), Some(1.048576));
        assert_eq!(perftest_gb_per_s(8.0, "Gb/sec"), Some(1.0));
        assert_eq!(perftest_gb_per_s(8.0, "furlongs"), None);
    }

    #[test]
    fn image_hash_is_stable_and_covers_the_image_scripts() {
        assert_eq!(image_hash().unwrap(), image_hash().unwrap());
        for s in IMAGE_SCRIPTS {
            assert!(scripts_dir().join(s).is_file(), "{s}");
        }
    }

    #[test]
    fn the_guest_script_holds_the_header_and_every_part() {
        let b = Builds {
            tests: vec![Artifact {
                label: "engine:ferry".into(),
                executable: "/t/ferry-77".into(),
                package_dir: "/w/crates/engine".into(),
            }],
            ..Builds::default()
        };
        let s = guest_script(false, "/mnt/host", &b);
        assert!(s.starts_with("#!/bin/bash\n"));
        assert!(s.contains("MODE='guest'"));
        assert!(s.contains("'ferry-77|/w/crates/engine'"));
        assert!(s.contains("FERRY_BENCH='/mnt/host/bin/ferry bench @ADDR@ "));
        assert!(s.contains("# ---- guest/setup-rxe-pair.sh"));
        assert!(s.contains("# ---- guest/suite.sh"));
        assert!(!s.contains("host-teardown"));
        assert_eq!(s.matches("#!/bin/bash").count(), 1);
        let h = guest_script(true, "/tmp/share", &b);
        assert!(h.contains("# ---- guest/host-teardown.sh"));
        assert!(h.contains("LIVE=''"));
    }
}
