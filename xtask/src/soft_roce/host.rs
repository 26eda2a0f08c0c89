//! Can this machine run the suite? Root (or password-less sudo), installing missing Debian
//! packages, and the readiness checks of the two modes: [`guest_ready`] (QEMU, debootstrap, a
//! host glibc the guest can run) and [`host_ready`] (`rdma_rxe` loadable, perftest and iproute2).

use super::image::{cache_dir, image_is_current};
use crate::util::{have, is_root};
use std::path::Path;
use std::process::{Command, Stdio};

/// The guest's glibc (Debian bookworm): host-built binaries must not need a newer one.
const GUEST_GLIBC: (u32, u32) = (2, 36);

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

/// `prog` run as root (directly, or through `sudo -n -E`); `None` when neither is possible.
pub(super) fn root_command(prog: &str) -> Option<Command> {
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
pub(super) fn guest_ready() -> std::result::Result<(), String> {
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
pub(super) fn host_ready() -> std::result::Result<(), String> {
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
