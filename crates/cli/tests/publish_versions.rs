//! `ferry publish` publishes the next version of the same name on SIGHUP, without restarting,
//! and `ferry pull --weights-version N` pulls the version asked for and says which it got;
//! `publish --from-memory` serves what it read into memory, `pull --in-memory` writes nothing.

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
    pull_with(addr, version, |c| c.arg("--into").arg(dir))
}

/// `ferry pull ADDR --weights-version VERSION` with `more` arguments, its JSON summary.
fn pull_with(
    addr: &str,
    version: &str,
    more: impl FnOnce(&mut Command) -> &mut Command,
) -> Result<serde_json::Value> {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_ferry"));
    cmd.args([
        "pull",
        addr,
        "--transport",
        "tcp",
        "--json",
        "--linger",
        "0",
    ])
    .args(["--weights-version", version]);
    let out = more(&mut cmd).output()?;
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
    let (p, mut out, addr) = publish(&file, &[])?;
    let got = dir.path().join("v1");
    let s = pull(&addr, &got, "1")?;
    assert_eq!(s["version"], 1, "{s}");
    assert_eq!(std::fs::read(got.join("w.bin"))?, v1);

    // The next checkpoint written beside and renamed over the name (the old file stays
    // whole), then SIGHUP: the same process publishes version 2 and still serves version 1.
    let v2: Vec<u8> = (0..200_000u32).map(|i| (i % 239) as u8).collect();
    let next = dir.path().join("w.bin.next");
    std::fs::write(&next, &v2)?;
    std::fs::rename(&next, &file)?;
    let hup = || -> Result<()> {
        let status = Command::new("kill")
            .args(["-HUP", &p.0.id().to_string()])
            .status()?;
        assert!(status.success());
        Ok(())
    };
    hup()?;
    let line = line_with(&mut out, "version 2")?;
    assert!(line.contains("versions served: [1, 2]"), "{line}");
    let got = dir.path().join("v2");
    let s = pull(&addr, &got, "2")?;
    assert_eq!(s["version"], 2, "{s}");
    assert_eq!(std::fs::read(got.join("w.bin"))?, v2);
    let got = dir.path().join("v1-again");
    pull(&addr, &got, "1")?;
    assert_eq!(std::fs::read(got.join("w.bin"))?, v1);
    // A version it does not publish is refused, naming the versions it keeps.
    let err = pull(&addr, &dir.path().join("v9"), "9").unwrap_err();
    assert!(err.to_string().contains("[1, 2]"), "{err}");

    // The next checkpoint written over the file in place: version 2's bytes are gone, so
    // version 2 is withdrawn, with one line saying why, before anyone pulls it; SIGHUP then
    // publishes version 3.
    let v3: Vec<u8> = (0..250_000u32).map(|i| (i % 233) as u8).collect();
    std::fs::write(&file, &v3)?;
    let line = line_with(&mut out, "withdrawn")?;
    assert!(
        line.contains("version 2 withdrawn") && line.contains("w.bin changed on disk"),
        "{line}"
    );
    let err = pull(&addr, &dir.path().join("v2-gone"), "2").unwrap_err();
    assert!(err.to_string().contains("[1]"), "{err}");
    assert!(
        !dir.path().join("v2-gone/w.bin").exists(),
        "a refused pull writes nothing"
    );
    hup()?;
    let line = line_with(&mut out, "version 3")?;
    assert!(line.contains("versions served: [1, 3]"), "{line}");
    let got = dir.path().join("v3");
    pull(&addr, &got, "3")?;
    assert_eq!(std::fs::read(got.join("w.bin"))?, v3);
    Ok(())
}

/// Starts `ferry publish FILE` (name `w`, 64 KiB chunks, loopback) with `more` flags; returns it,
/// its output and the control address it printed.
fn publish(
    file: &std::path::Path,
    more: &[&str],
) -> Result<(Publisher, BufReader<ChildStdout>, String)> {
    let child = Command::new(env!("CARGO_BIN_EXE_ferry"))
        .arg("publish")
        .arg(file)
        .args([
            "--name",
            "w",
            "--listen",
            "127.0.0.1:0",
            "--transport",
            "tcp",
        ])
        .args(["--chunk-size", "64KiB", "--serve-for", "120"])
        .args(more)
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
    Ok((p, out, addr))
}

#[test]
fn from_memory_serves_what_it_read_and_an_in_memory_pull_writes_nothing() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let file = dir.path().join("w.bin");
    let v1: Vec<u8> = (0..300_000u32).map(|i| (i % 251) as u8).collect();
    std::fs::write(&file, &v1)?;
    let (p, mut out, addr) = publish(&file, &["--from-memory"])?;
    // In memory: every byte verified, no file written (run where any would land).
    let cwd = dir.path().join("cwd");
    std::fs::create_dir(&cwd)?;
    let s = pull_with(&addr, "1", |c| c.arg("--in-memory").current_dir(&cwd))?;
    assert_eq!(
        (s["version"].as_u64(), s["bytes"].as_u64()),
        (Some(1), Some(300_000)),
        "{s}"
    );
    assert_eq!(
        std::fs::read_dir(&cwd)?.count(),
        0,
        "an in-memory pull writes nothing"
    );
    // Into a directory: the memory's registration names the file.
    let got = dir.path().join("v1");
    pull(&addr, &got, "1")?;
    assert_eq!(std::fs::read(got.join("w.bin.v1"))?, v1);
    // The file changes and SIGHUP publishes it as version 2; version 1 is still served from
    // the memory it was read into, unchanged.
    let v2: Vec<u8> = (0..200_000u32).map(|i| (i % 239) as u8).collect();
    std::fs::write(&file, &v2)?;
    let status = Command::new("kill")
        .args(["-HUP", &p.0.id().to_string()])
        .status()?;
    assert!(status.success());
    let line = line_with(&mut out, "version 2")?;
    assert!(line.contains("versions served: [1, 2]"), "{line}");
    let got = dir.path().join("v2");
    pull(&addr, &got, "2")?;
    assert_eq!(std::fs::read(got.join("w.bin.v2"))?, v2);
    let got = dir.path().join("v1-again");
    pull(&addr, &got, "1")?;
    assert_eq!(std::fs::read(got.join("w.bin.v1"))?, v1);
    // Exactly one of --into and --in-memory.
    for extra in [&["--into", "x", "--in-memory"][..], &[][..]] {
        let o = Command::new(env!("CARGO_BIN_EXE_ferry"))
            .args(["pull", &addr])
            .args(extra)
            .current_dir(&cwd)
            .output()?;
        assert!(!o.status.success(), "{extra:?} accepted");
    }
    Ok(())
}

/// `ferry publish ... | head -1`: a stdout whose reader is gone stops the printing, never the
/// publisher. The pipe's read end is closed before the publisher starts, so its first line
/// already meets the broken pipe.
#[test]
fn a_closed_stdout_does_not_stop_the_publisher() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let file = dir.path().join("w.bin");
    std::fs::write(&file, vec![7u8; 100_000])?;
    let (reader, writer) = std::io::pipe()?;
    drop(reader);
    let out = Command::new(env!("CARGO_BIN_EXE_ferry"))
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
        .args(["--serve-for", "1s"])
        .stdout(writer)
        .stderr(Stdio::piped())
        .output()?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{:?}: {stderr}", out.status);
    assert!(!stderr.contains("panicked"), "{stderr}");
    Ok(())
}
