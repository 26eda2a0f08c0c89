//! What a process holds, read from `/proc`: resident memory, open file descriptors and threads.
//! The fault suite, `cargo xtask bench load` and `cargo xtask soak` count with it, so that "nothing
//! leaked" and "stays flat" mean the same thing in all three.

use std::fmt;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};

/// One reading of a process's resources.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Census {
    /// Resident memory (`VmRSS`), KiB.
    pub rss_kib: u64,
    /// Open file descriptors (entries of `/proc/PID/fd`).
    pub fds: u64,
    /// Threads (entries of `/proc/PID/task`).
    pub threads: u64,
}

impl Census {
    /// This process.
    pub fn of_self() -> Result<Self> {
        Self::read("self")
    }

    /// Process `pid`.
    pub fn of(pid: u32) -> Result<Self> {
        Self::read(&pid.to_string())
    }

    fn read(pid: &str) -> Result<Self> {
        let proc = format!("/proc/{pid}");
        let status = std::fs::read_to_string(format!("{proc}/status"))
            .with_context(|| format!("reading {proc}/status"))?;
        let rss_kib = status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .with_context(|| format!("no VmRSS in {proc}/status"))?;
        let count = |dir: &str| -> Result<u64> {
            Ok(std::fs::read_dir(format!("{proc}/{dir}"))
                .with_context(|| format!("listing {proc}/{dir}"))?
                .count() as u64)
        };
        Ok(Self {
            rss_kib,
            // The listing's own descriptor is open while it is read: leave it out.
            fds: count("fd")?.saturating_sub(u64::from(pid == "self")),
            threads: count("task")?,
        })
    }

    /// The larger of each figure (a running peak).
    pub fn max(self, other: Self) -> Self {
        Self {
            rss_kib: self.rss_kib.max(other.rss_kib),
            fds: self.fds.max(other.fds),
            threads: self.threads.max(other.threads),
        }
    }

    /// Whether descriptors and threads are back to `baseline` or below (memory is left out:
    /// allocators keep freed pages, so only a soak's trend says anything about it).
    pub fn within(self, baseline: Self) -> bool {
        self.fds <= baseline.fds && self.threads <= baseline.threads
    }
}

impl fmt::Display for Census {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "rss {:.1} MiB, {} fds, {} threads",
            self.rss_kib as f64 / 1024.0,
            self.fds,
            self.threads
        )
    }
}

/// The names of this process's threads (`/proc/self/task/*/comm`), sorted: what to print when
/// threads did not come back.
pub fn thread_names() -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir("/proc/self/task")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|t| std::fs::read_to_string(t.path().join("comm")).ok())
        .map(|n| n.trim().to_owned())
        .collect();
    names.sort();
    names
}

/// Reads `read` until descriptors and threads are back to `baseline` (see [`Census::within`]) or
/// `settle` has passed; returns the last reading and whether it got back. Threads and sockets of
/// closed peers take a moment to go (a stream's thread notices its socket closed, the kernel
/// reaps a task), hence the wait.
pub fn settle(
    baseline: Census,
    settle: Duration,
    mut read: impl FnMut() -> Result<Census>,
) -> Result<(Census, bool)> {
    let start = Instant::now();
    loop {
        let now = read()?;
        if now.within(baseline) {
            return Ok((now, true));
        }
        if start.elapsed() >= settle {
            return Ok((now, false));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // Tests of this binary run in parallel, so this process's own counts move under them: the
    // figures are checked on a child that does nothing, `settle` on readings given to it.
    #[test]
    fn reads_a_process_and_settles_back_to_a_baseline() {
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        let c = Census::of(child.id()).unwrap();
        child.kill().unwrap();
        child.wait().unwrap();
        assert!(c.rss_kib > 0 && c.fds >= 3 && c.threads == 1, "{c}");
        assert!(Census::of_self().unwrap().threads >= 1);
        assert!(!thread_names().is_empty());
        let base = Census {
            rss_kib: 1,
            fds: 3,
            threads: 1,
        };
        let mut falling = [5, 4, 3].into_iter();
        let (now, back) = settle(base, Duration::from_secs(5), || {
            Ok(Census {
                fds: falling.next().unwrap_or(3),
                ..base
            })
        })
        .unwrap();
        assert!(back && now == base);
        let stuck = Census { threads: 2, ..base };
        let (now, back) = settle(base, Duration::from_millis(100), || Ok(stuck)).unwrap();
        assert!(!back && now == stuck);
        assert_eq!(base.max(stuck), stuck);
    }
}
