//! `cargo xtask fresh-machine --mounts-only`: the task's mounts live in its own namespace, so an
//! interrupted run leaves nothing mounted under its cache, even when the cache is named by a
//! relative path through a symlink; and a root something is still mounted in is not removed.
//!
//! These run the real binary as root; without root or `unshare` they skip (and fail under
//! `FERRY_REQUIRE_NETNS`, the namespaces-and-root requirement).

use std::io::{BufRead, BufReader};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// Whether this test can run here; skips (or fails when required) otherwise.
fn can_run() -> bool {
    let root = Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "0");
    let unshare = Command::new("unshare")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    if root && unshare {
        return true;
    }
    ferry_tests::require_or_skip(
        ferry_tests::NETNS,
        format!("fresh-machine's mounts need root ({root}) and unshare ({unshare})"),
    );
    false
}

/// A directory of this test's own under the temporary directory, removed when dropped.
struct Scratch(PathBuf);

impl Scratch {
    fn new(name: &str) -> Scratch {
        let dir = std::env::temp_dir().join(format!("ferry-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("scratch dir");
        // Canonical, so paths compare with what the kernel lists.
        Scratch(std::fs::canonicalize(&dir).expect("canonical scratch dir"))
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The mount points `findmnt` lists in this test's namespace, at or under `dir`.
fn host_mounts_under(dir: &Path) -> Vec<String> {
    let out = Command::new("findmnt")
        .args(["-rn", "-o", "TARGET"])
        .output()
        .expect("findmnt (util-linux)");
    assert!(out.status.success(), "findmnt failed");
    // findmnt -r escapes a space as \x20; the scratch paths have none.
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|t| Path::new(t).starts_with(dir))
        .map(str::to_owned)
        .collect()
}

#[test]
fn an_interrupted_run_on_a_symlinked_relative_cache_leaves_nothing_mounted() {
    if !can_run() {
        return;
    }
    // Ctrl-C: SIGINT to the foreground job's whole process group.
    interrupted_run_leaves_nothing("INT", true);
}

#[test]
fn a_run_killed_by_sigkill_leaves_nothing_mounted() {
    if !can_run() {
        return;
    }
    // `kill -9` of the one process its caller knows, nothing else.
    interrupted_run_leaves_nothing("KILL", false);
}

/// Runs `fresh-machine --mounts-only` on a cache named `link/.` (relative, through a symlink),
/// waits for its mounts, sends `signal` to it (or its process group), and checks that no mount
/// was visible here at any time and none is left.
fn interrupted_run_leaves_nothing(signal: &str, whole_group: bool) {
    let scratch = Scratch::new(&format!("fresh-{signal}"));
    let real = scratch.0.join("real");
    std::fs::create_dir_all(&real).unwrap();
    std::os::unix::fs::symlink("real", scratch.0.join("link")).unwrap();
    // Through `env --default-signal=INT`: a shell's foreground job takes SIGINT at its default,
    // where this test may run with it ignored (a background job of a script inherits that).
    let mut child = Command::new("env")
        .args(["--default-signal=INT", env!("CARGO_BIN_EXE_xtask")])
        .args(["fresh-machine", "--mounts-only"])
        .current_dir(&scratch.0)
        // Relative, through a symlink: the mounts are listed under `real`.
        .env("FERRY_FRESH_DIR", "link/.")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        // Its own process group, as a shell's foreground job: Ctrl-C signals the group.
        .process_group(0)
        .spawn()
        .expect("spawn xtask");
    let pgid = child.id();
    // Its stderr is read to the end on a thread of its own: a pipe closed early would fail the
    // task's next write and end it before the signal.
    let stderr = child.stderr.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    let reader = std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines() {
            let Ok(line) = line else { break };
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let mut log = String::new();
    let mut made = None;
    while let Ok(line) = rx.recv_timeout(Duration::from_secs(120)) {
        log += &line;
        log.push('\n');
        if let Some(rest) = line.strip_prefix("fresh-machine: ")
            && let Some((n, _)) = rest.split_once(" mounts under ")
        {
            made = n.parse::<usize>().ok();
            break;
        }
    }
    let made = made.unwrap_or_else(|| panic!("no mounts reported:\n{log}"));
    // root, proc, sys (and what it holds), dev, dev/pts, dev/shm, the toolchain (twice).
    assert!(made >= 7, "only {made} mounts:\n{log}");
    assert!(
        log.contains(&real.join("root").display().to_string()),
        "{log}"
    );
    assert_eq!(
        host_mounts_under(&scratch.0),
        Vec::<String>::new(),
        "mounts visible outside the task's namespace while it runs"
    );
    let marker = format!("FERRY_FRESH_DIR={}", real.display());
    assert!(
        !processes_with_env(&marker).is_empty(),
        "the task's processes are not found by their environment"
    );
    let target = if whole_group {
        format!("-{pgid}")
    } else {
        pgid.to_string()
    };
    let kill = Command::new("kill")
        .args([&format!("-{signal}"), "--", &target])
        .status()
        .unwrap();
    assert!(kill.success());
    let deadline = Instant::now() + Duration::from_secs(60);
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if Instant::now() > deadline {
            let _ = Command::new("kill")
                .args(["-KILL", "--", &format!("-{pgid}")])
                .status();
            panic!("xtask did not end within 60 s of SIG{signal}");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(!status.success(), "an interrupted run reports success");
    drop(rx);
    reader.join().unwrap();
    // The namespace's mounts go with the last process in it: none may be left (the `sleep`
    // standing in for the chroot step carries the task's FERRY_FRESH_DIR, as every process of
    // it does).
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut left = processes_with_env(&marker);
    while !left.is_empty() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
        left = processes_with_env(&marker);
    }
    assert!(left.is_empty(), "processes of the task still run: {left:?}");
    assert_eq!(host_mounts_under(&scratch.0), Vec::<String>::new());
    // The root is plain directories now: removable, and its /dev an empty directory.
    let dev = real.join("root/dev");
    assert!(dev.is_dir() && std::fs::read_dir(&dev).unwrap().next().is_none());
}

/// The pids whose environment holds `entry` (`NAME=value`).
fn processes_with_env(entry: &str) -> Vec<u32> {
    let mut pids = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else {
            continue;
        };
        let Ok(env) = std::fs::read(e.path().join("environ")) else {
            continue;
        };
        if env.split(|b| *b == 0).any(|v| v == entry.as_bytes()) {
            pids.push(pid);
        }
    }
    pids
}

#[test]
fn a_root_with_a_mount_left_in_it_is_not_removed() {
    if !can_run() {
        return;
    }
    let scratch = Scratch::new("fresh-refuse");
    let root = scratch.0.join("root");
    std::fs::create_dir_all(root.join("dev")).unwrap();
    // A mount left in the root (as an older xtask left the host's /dev), made in a namespace of
    // this test's own so it cannot outlive the test either.
    let script = format!(
        "set -e; mount -t tmpfs left {root}/dev; touch {root}/dev/keep; \
         FERRY_FRESH_DIR={dir} {xtask} fresh-machine --mounts-only </dev/null && exit 9; \
         test -e {root}/dev/keep || exit 8",
        root = root.display(),
        dir = scratch.0.display(),
        xtask = env!("CARGO_BIN_EXE_xtask"),
    );
    let out = Command::new("unshare")
        .args([
            "--mount",
            "--propagation",
            "private",
            "--",
            "sh",
            "-c",
            &script,
        ])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{:?}\n{stderr}", out.status);
    assert!(
        stderr.contains(&format!("refusing to remove {}", root.display())),
        "{stderr}"
    );
    assert!(
        stderr.contains(&format!("{}/dev", root.display())),
        "{stderr}"
    );
}
