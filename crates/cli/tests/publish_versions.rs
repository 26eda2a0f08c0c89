//! `ferry publish` publishes the next version of the same name on SIGHUP, without restarting,
//! and `ferry pull --weights-version N` pulls the version asked for and says which it got.

use std::io::{BufRead, BufReader};
use std::process::{Child, ChildStdout, Command, Stdio};

use anyhow::{Context, Result, bail};

/// Kills the publisher when the test ends, however it ends.
struct Publisher(Child);

impl Drop for Publisher {
    fn drop(&mut self) {
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

fn pull(addr: &str, dir: &std::path::Path, version: &str) -> Result<serde_json::Value> {
    let out = Command::new(env!("CARGO_BIN_EXE_ferry"))
        .args([
            "pull",
            addr,
            "--transport",
            "tcp",
            "--json",
            "--linger",
            "0",
        ])
        .args(["--weights-version", version, "--into"])
        .arg(dir)
        .output()?;
    if !out.status.success() {
        bail!(
            "ferry pull --weights-version {version}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(serde_json::from_slice(&out.stdout)?)
}

#[test]
fn sighup_publishes_the_next_version_and_pull_takes_the_one_asked_for() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let file = dir.path().join("w.bin");
    let v1: Vec<u8> = (0..300_000u32).map(|i| (i % 251) as u8).collect();
    std::fs::write(&file, &v1)?;
    let child = Command::new(env!("CARGO_BIN_EXE_ferry"))
        .arg("publish")
        .arg(&file)
        .args([
            "--name",
            "w",
            "--listen",
            "127.0.0.1:0",
            "--transport",
            "tcp",
        ])
        .args(["--chunk-size", "64KiB", "--serve-for", "120"])
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
    let got = dir.path().join("v1");
    let s = pull(&addr, &got, "1")?;
    assert_eq!(s["version"], 1, "{s}");
    assert_eq!(std::fs::read(got.join("w.bin"))?, v1);

    // The next checkpoint, then SIGHUP: the same process publishes version 2.
    let v2: Vec<u8> = (0..200_000u32).map(|i| (i % 239) as u8).collect();
    std::fs::write(&file, &v2)?;
    let status = Command::new("kill")
        .args(["-HUP", &p.0.id().to_string()])
        .status()?;
    assert!(status.success());
    let line = line_with(&mut out, "version 2")?;
    assert!(line.contains("versions served: [1, 2]"), "{line}");
    let got = dir.path().join("v2");
    let s = pull(&addr, &got, "2")?;
    assert_eq!(s["version"], 2, "{s}");
    assert_eq!(std::fs::read(got.join("w.bin"))?, v2);
    // A version it does not publish is refused, naming the versions it keeps.
    let err = pull(&addr, &dir.path().join("v9"), "9").unwrap_err();
    assert!(err.to_string().contains("[1, 2]"), "{err}");
    Ok(())
}
