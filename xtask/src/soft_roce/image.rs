//! The guest image (kernel, initrd and root file system built by `xtask/soft-roce/*.sh`), cached
//! outside the repo in [`cache_dir`] and rebuilt when the hash of its scripts changes.

use crate::util::{project_root, run as run_cmd};
use anyhow::{Context, Result};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

/// Scripts that go into the guest image: the image is rebuilt when their hash changes.
const IMAGE_SCRIPTS: &[&str] = &["build-rootfs.sh", "make-image.sh", "guest-init.sh"];

/// The image cache: `FERRY_SOFT_ROCE_DIR`, else `~/.cache/ferry/soft-roce` (`/tmp/...` without
/// `HOME`).
pub(super) fn cache_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("FERRY_SOFT_ROCE_DIR") {
        return PathBuf::from(d);
    }
    let home = std::env::var_os("HOME").map_or_else(|| PathBuf::from("/tmp"), PathBuf::from);
    home.join(".cache/ferry/soft-roce")
}

/// The scripts that build and boot the guest: `xtask/soft-roce/`.
pub(super) fn scripts_dir() -> PathBuf {
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

/// Whether `dir` holds a complete image built from the current scripts.
pub(super) fn image_is_current(dir: &Path) -> Result<bool> {
    let want = image_hash()?;
    let have_hash = std::fs::read_to_string(dir.join("image.hash")).unwrap_or_default();
    Ok(have_hash.trim() == want
        && ["rootfs.img", "initrd.img", "vmlinuz"]
            .iter()
            .all(|f| dir.join(f).is_file()))
}

/// Builds the image in `dir` (needs root: debootstrap, chroot) unless it is current.
pub(super) fn ensure_image(dir: &Path) -> Result<()> {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn image_hash_is_stable_and_covers_the_image_scripts() {
        assert_eq!(image_hash().unwrap(), image_hash().unwrap());
        for s in IMAGE_SCRIPTS {
            assert!(scripts_dir().join(s).is_file(), "{s}");
        }
    }
}
