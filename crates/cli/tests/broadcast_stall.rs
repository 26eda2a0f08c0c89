//! `ferry pull` from a publisher stopped with SIGSTOP in the middle of the pull (its kernel still
//! accepts and acknowledges, nothing comes back) ends within `--stall-after` and 10 s more,
//! naming the source and what was verified (its progress line names the source as stalled
//! before that; the failure is kind `stalled`, with a hint); and `--into` a directory that cannot be made fails
//! before anything is pulled, leaving nothing behind.

use std::io::{BufRead, BufReader};
use std::process::{Child, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

/// Resumes and kills the publisher when the test ends, however it ends.
struct Publisher(Child);

impl Publisher {
    fn signal(&self, sig: &str) -> Result<()> {
        let status = Command::new("kill")
            .args([sig, &self.0.id().to_string()])
            .status()?;
        anyhow::ensure!(status.success(), "kill {sig}");
        Ok(())
    }
}

impl Drop for Publisher {
    fn drop(&mut self) {
        let _ = self.signal("-CONT");
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The next line of the publisher's output that contains `what`.
fn line_with(out: &mut BufReader<ChildStdout>, what: &str) -> Result<String> {
    let mut line = String::new();
    loop {
        line.clear();
        if out.read_line(&mut line)? == 0 {
            bail!("ferry publish ended before printing {what:?}");
        }
        if line.contains(what) {
            return Ok(line);
        }
    }
}

#[test]
fn a_pull_from_a_stopped_publisher_ends_within_the_stall_window_naming_it() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let file = dir.path().join("big.bin");
    // 128 MiB in 64 KiB chunks, one in flight: the pull takes seconds (a debug build moves
    // about 60 MB/s here with two in flight), far longer than the publisher takes to report
    // the receiver joined (at most 250 ms), so the publisher stops in the middle of it.
    let len = 128u64 << 20;
    let f = std::fs::File::create(&file)?;
    f.set_len(len)?;
    drop(f);
    let child = Command::new(env!("CARGO_BIN_EXE_ferry"))
        .arg("publish")
        .arg(&file)
        .args(["--name", "stall", "--listen", "127.0.0.1:0"])
        .args(["--transport", "tcp", "--chunk-size", "64KiB"])
        .args(["--serve-for", "120"])
        .stdout(Stdio::piped())
        .spawn()?;
    let mut p = Publisher(child);
    let mut out = BufReader::new(p.0.stdout.take().context("stdout")?);
    let control = line_with(&mut out, "control ")?;
    let addr = control
        .split_whitespace()
        .nth(1)
        .context("the control address")?
        .to_owned();
    let data = control
        .split_whitespace()
        .nth(3)
        .context("the data address")?
        .trim_end_matches(';')
        .to_owned();
    let stall_after = Duration::from_secs(3);
    let pull = Command::new(env!("CARGO_BIN_EXE_ferry"))
        .args([
            "pull",
            &addr,
            "--in-memory",
            "--linger",
            "0",
            "--transport",
            "tcp",
        ])
        .args(["--window", "1", "--stall-after", "3s", "--json"])
        .args(["--progress", "lines", "--progress-every", "200ms"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()?;
    line_with(&mut out, "joined")?;
    p.signal("-STOP")?;
    let stopped = Instant::now();
    let o = pull.wait_with_output()?;
    let took = stopped.elapsed();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        !o.status.success(),
        "the pull completed before the publisher stopped: {}",
        String::from_utf8_lossy(&o.stdout)
    );
    assert!(
        err.contains(&format!("the source {data}")) && err.contains("chunks verified"),
        "{err}"
    );
    assert!(
        took < stall_after + Duration::from_secs(10),
        "the pull ended {took:?} after the publisher stopped: {err}"
    );
    // Before it is given up, the progress line names it as stalled; the failure has its own
    // kind and a hint, on stderr and in the JSON object.
    assert!(
        err.lines().any(|l| l.starts_with("ferry pull: ")
            && l.contains(&format!("waiting on the source {data}, silent "))),
        "{err}"
    );
    assert!(err.lines().any(|l| l.starts_with("hint: ")), "{err}");
    let out = String::from_utf8_lossy(&o.stdout);
    let v: serde_json::Value =
        serde_json::from_str(out.trim()).with_context(|| format!("one JSON object: {out}"))?;
    assert_eq!(v["error"]["kind"], "stalled", "{v}");
    assert!(
        v["error"]["hint"]
            .as_str()
            .is_some_and(|h| h.contains("stopped sending")),
        "{v}"
    );
    Ok(())
}

#[test]
fn into_a_directory_that_cannot_be_made_fails_before_anything_is_pulled() -> Result<()> {
    // No publisher listens: the directory is checked before the source is even asked.
    let o = Command::new(env!("CARGO_BIN_EXE_ferry"))
        .args([
            "pull",
            "127.0.0.1:9",
            "--into",
            "/proc/nope",
            "--linger",
            "0",
        ])
        .output()?;
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success());
    assert!(err.contains("/proc/nope"), "{err}");
    assert!(
        !err.contains("127.0.0.1:9"),
        "asked the source first: {err}"
    );
    Ok(())
}
