//! SIGINT and SIGTERM stop `ferry serve`, `bench`, `pull` and `publish` cleanly: each prints
//! what it did (one JSON object under `--json`) and exits 130 (SIGINT) or 143 (SIGTERM). A
//! closed stdout stops the printing, never the command. Progress goes to a log as lines where
//! stderr is no terminal.

use std::io::{BufRead, BufReader, Read};
use std::process::{Child, ChildStderr, ChildStdout, Command, Stdio};

use anyhow::{Context, Result, bail};

fn ferry() -> Command {
    Command::new(env!("CARGO_BIN_EXE_ferry"))
}

/// Sends `sig` (`INT`, `TERM`) to `child`.
fn signal(child: &Child, sig: &str) -> Result<()> {
    let status = Command::new("kill")
        .arg(format!("-{sig}"))
        .arg(child.id().to_string())
        .status()?;
    if !status.success() {
        bail!("kill -{sig} failed");
    }
    Ok(())
}

/// Reads `from` line by line until one contains `marker`; returns the lines read.
fn until<R: Read>(from: &mut BufReader<R>, marker: &str) -> Result<Vec<String>> {
    let mut seen = Vec::new();
    loop {
        let mut line = String::new();
        if from.read_line(&mut line)? == 0 {
            bail!("ended before a line with {marker:?}; read {seen:?}");
        }
        let hit = line.contains(marker);
        seen.push(line.trim_end().to_owned());
        if hit {
            return Ok(seen);
        }
    }
}

/// Waits for `child` and returns its exit code with the rest of its stdout.
fn finish(mut child: Child, mut out: BufReader<ChildStdout>) -> Result<(i32, String)> {
    let mut rest = String::new();
    out.read_to_string(&mut rest)?;
    let status = child.wait()?;
    let code = status
        .code()
        .with_context(|| format!("ended by a signal, not an exit: {status:?}"))?;
    Ok((code, rest))
}

fn last_json(text: &str) -> Result<serde_json::Value> {
    let line = text
        .lines()
        .last()
        .with_context(|| "no output".to_owned())?;
    serde_json::from_str(line).with_context(|| format!("not JSON: {line:?}"))
}

#[test]
fn serve_stopped_by_either_signal_says_what_it_served_and_exits_128_plus_the_signal() -> Result<()>
{
    for (sig, code) in [("INT", 130), ("TERM", 143)] {
        let mut child = ferry()
            .args(["serve", "--listen", "127.0.0.1:0", "--transport", "tcp"])
            .args(["--segment", "s=1MiB", "--json"])
            .stdout(Stdio::piped())
            .spawn()?;
        let mut out = BufReader::new(child.stdout.take().context("stdout")?);
        until(&mut out, "listening on")?;
        signal(&child, sig)?;
        let (got, rest) = finish(child, out)?;
        assert_eq!(got, code, "SIG{sig}: {rest}");
        let v = last_json(&rest)?;
        assert_eq!(v["stopped_by"], format!("SIG{sig}"), "{v}");
        assert_eq!(v["bytes_served"].as_u64(), Some(0), "{v}");
    }
    Ok(())
}

/// `ferry bench` on loopback for a minute, progress as lines every 50 ms.
fn long_bench(json: bool) -> Result<(Child, BufReader<ChildStdout>, BufReader<ChildStderr>)> {
    let mut cmd = ferry();
    cmd.args([
        "bench",
        "--duration",
        "60s",
        "--op-size",
        "64KiB",
        "--transport",
        "tcp",
    ])
    .args(["--progress", "lines", "--progress-every", "50ms"]);
    if json {
        cmd.arg("--json");
    }
    let mut child = cmd.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn()?;
    let out = BufReader::new(child.stdout.take().context("stdout")?);
    let err = BufReader::new(child.stderr.take().context("stderr")?);
    Ok((child, out, err))
}

#[test]
fn bench_stopped_mid_run_prints_what_moved() -> Result<()> {
    for (sig, code, json) in [("INT", 130, true), ("TERM", 143, false)] {
        let (child, out, mut err) = long_bench(json)?;
        // Two progress lines: the run has moved bytes.
        until(&mut err, "ferry bench: ")?;
        until(&mut err, "ferry bench: ")?;
        signal(&child, sig)?;
        let (got, rest) = finish(child, out)?;
        assert_eq!(got, code, "SIG{sig}: {rest}");
        if json {
            let v = last_json(&rest)?;
            assert_eq!(v["stopped_by"], format!("SIG{sig}"), "{v}");
            assert!(v["bytes_moved"].as_u64().is_some(), "{v}");
            assert!(v["seconds"].as_f64().is_some_and(|s| s > 0.0), "{v}");
        } else {
            assert!(
                rest.contains(&format!("stopped by SIG{sig}: ")) && rest.contains("bytes"),
                "{rest}"
            );
        }
    }
    Ok(())
}

#[test]
fn progress_lines_where_stderr_is_no_terminal() -> Result<()> {
    // `auto` on a pipe: lines, one at the start at least, in decimal units as the summary.
    let out = ferry()
        .args([
            "bench",
            "--total",
            "32MiB",
            "--transport",
            "tcp",
            "--progress-every",
            "1ms",
        ])
        .output()?;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let err = String::from_utf8_lossy(&out.stderr);
    let lines: Vec<&str> = err
        .lines()
        .filter(|l| l.starts_with("ferry bench: "))
        .collect();
    assert!(!lines.is_empty(), "no progress lines in {err:?}");
    for l in &lines {
        assert!(l.contains(" of 33.55 MB (") && l.contains("B/s"), "{l}");
        assert!(!l.contains("iB"), "one unit system: {l}");
    }
    // `none`: nothing.
    let out = ferry()
        .args([
            "bench",
            "--total",
            "8MiB",
            "--transport",
            "tcp",
            "--progress",
            "none",
        ])
        .output()?;
    assert!(out.status.success());
    assert!(!String::from_utf8_lossy(&out.stderr).contains("ferry bench: "));
    Ok(())
}

#[test]
fn a_closed_stdout_never_panics() -> Result<()> {
    // bench prints its summary into a pipe nobody reads any more.
    let mut child = ferry()
        .args([
            "bench",
            "--total",
            "8MiB",
            "--transport",
            "tcp",
            "--progress",
            "none",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()?;
    drop(child.stdout.take());
    let mut err = String::new();
    child
        .stderr
        .take()
        .context("stderr")?
        .read_to_string(&mut err)?;
    let status = child.wait()?;
    assert!(status.success(), "{status:?}: {err}");
    assert!(!err.contains("panicked"), "{err}");

    // serve keeps serving with its stdout gone, and stops on a signal as usual.
    let mut child = ferry()
        .args(["serve", "--listen", "127.0.0.1:0", "--transport", "tcp"])
        .args(["--segment", "s=1MiB"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()?;
    drop(child.stdout.take());
    let mut err = BufReader::new(child.stderr.take().context("stderr")?);
    until(&mut err, "stdout is gone")?;
    signal(&child, "TERM")?;
    let mut rest = String::new();
    err.read_to_string(&mut rest)?;
    let status = child.wait()?;
    assert_eq!(status.code(), Some(143), "{rest}");
    assert!(!rest.contains("panicked"), "{rest}");
    Ok(())
}

#[test]
fn pull_stopped_while_joining_exits_with_the_signal() -> Result<()> {
    // A listener that takes the connection and never answers: the pull waits for its reply.
    let silent = std::net::TcpListener::bind("127.0.0.1:0")?;
    let addr = silent.local_addr()?.to_string();
    for (sig, code) in [("INT", 130), ("TERM", 143)] {
        let mut child = ferry()
            .args(["pull", &addr, "--in-memory", "--json"])
            .stdout(Stdio::piped())
            .spawn()?;
        let out = BufReader::new(child.stdout.take().context("stdout")?);
        let (_conn, _) = silent.accept()?;
        signal(&child, sig)?;
        let (got, rest) = finish(child, out)?;
        assert_eq!(got, code, "SIG{sig}: {rest}");
        let v = last_json(&rest)?;
        assert_eq!(v["stopped_by"], format!("SIG{sig}"), "{v}");
        assert_eq!(v["bytes"].as_u64(), Some(0), "{v}");
    }
    Ok(())
}

#[test]
fn publish_stopped_says_what_it_served() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let file = dir.path().join("w.bin");
    std::fs::write(&file, vec![3u8; 1 << 20])?;
    let mut child = ferry()
        .args([
            "publish",
            "--name",
            "w",
            "--listen",
            "127.0.0.1:0",
            "--transport",
            "tcp",
        ])
        .arg(&file)
        .stdout(Stdio::piped())
        .spawn()?;
    let mut out = BufReader::new(child.stdout.take().context("stdout")?);
    until(&mut out, "receivers: ferry pull")?;
    signal(&child, "TERM")?;
    let (got, rest) = finish(child, out)?;
    assert_eq!(got, 143, "{rest}");
    assert!(
        rest.contains("stopped by SIGTERM: served 0 bytes"),
        "{rest}"
    );
    Ok(())
}

#[test]
fn pull_progress_lines_say_bytes_rate_and_peers() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let file = dir.path().join("w.bin");
    std::fs::write(&file, vec![5u8; 4 << 20])?;
    let mut publisher = ferry()
        .args([
            "publish",
            "--name",
            "w",
            "--listen",
            "127.0.0.1:0",
            "--transport",
            "tcp",
        ])
        .arg(&file)
        .stdout(Stdio::piped())
        .spawn()?;
    let mut out = BufReader::new(publisher.stdout.take().context("stdout")?);
    let lines = until(&mut out, "receivers: ferry pull")?;
    let result = (|| -> Result<()> {
        let ctl = lines
            .last()
            .and_then(|l| l.strip_prefix("control "))
            .and_then(|l| l.split_whitespace().next())
            .context("no control address")?;
        let pulled = ferry()
            .args(["pull", ctl, "--in-memory", "--no-relay", "--linger", "0"])
            .args(["--progress", "lines", "--progress-every", "1ms"])
            .output()?;
        let err = String::from_utf8_lossy(&pulled.stderr);
        assert!(pulled.status.success(), "{err}");
        let progress: Vec<&str> = err
            .lines()
            .filter(|l| l.starts_with("ferry pull: "))
            .collect();
        assert!(!progress.is_empty(), "no progress lines in {err:?}");
        assert!(
            progress.iter().all(|l| l.contains(" of 4.19 MB (")
                && l.contains("B/s, ")
                && (l.contains(" 0 peers") || l.contains(" 1 peer"))),
            "{progress:?}"
        );
        Ok(())
    })();
    let _ = publisher.kill();
    let _ = publisher.wait();
    result
}

#[test]
fn serve_without_rdma_says_so_in_one_calm_line() -> Result<()> {
    let mut child = ferry()
        .args(["serve", "--listen", "127.0.0.1:0", "--segment", "s=1MiB"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()?;
    let mut out = BufReader::new(child.stdout.take().context("stdout")?);
    let lines = until(&mut out, "serving until stopped")?;
    // The address first (`ferry serve | head -1`), then what was said while starting.
    assert!(lines[0].starts_with("listening on 127.0.0.1:"), "{lines:?}");
    signal(&child, "INT")?;
    let mut err = String::new();
    child
        .stderr
        .take()
        .context("stderr")?
        .read_to_string(&mut err)?;
    let (code, _) = finish(child, out)?;
    assert_eq!(code, 130);
    let transports = lines
        .iter()
        .find(|l| l.starts_with("transports: "))
        .context("transports")?;
    if transports.contains("rdma") {
        eprintln!("this machine serves RDMA: nothing to say about its absence");
        return Ok(());
    }
    assert!(
        lines
            .iter()
            .any(|l| l == "RDMA: none here (`ferry doctor` says why)"),
        "{lines:?}"
    );
    assert!(!err.contains("RDMA not served"), "{err}");
    Ok(())
}
