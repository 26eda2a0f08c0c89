//! Membership as `ferry publish` and `ferry pull` show it (issue 51): a pull stopped by a signal
//! leaves the list at once, so the publisher says so within moments (not when its lease runs
//! out) and the next pull neither tries to attach it nor counts it as a peer; the publisher
//! prints each receiver event once (not a log line and a plain line of the same text); and a
//! pull stopped (SIGSTOP) past its lease and resumed is silent, then back, then finishes: never
//! joined twice, and it does not blame its source for the time it did not run.

use std::io::{BufRead, BufReader, Read};
use std::process::{Child, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

fn ferry() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_ferry"));
    c.env_remove("FERRY_AUTH_KEY_FILE")
        .env_remove("RUST_LOG")
        .env("NO_COLOR", "1");
    c
}

/// Sends `sig` (`INT`, `TERM`) to `child`.
fn signal(child: &Child, sig: &str) -> Result<()> {
    let status = Command::new("kill")
        .arg(format!("-{sig}"))
        .arg(child.id().to_string())
        .status()?;
    anyhow::ensure!(status.success(), "kill -{sig}");
    Ok(())
}

/// Kills the publisher when the test ends, however it ends.
struct Publisher(Child);

impl Drop for Publisher {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The next line of `out` that contains `what`; the lines before it are appended to `seen`.
fn line_with(out: &mut BufReader<ChildStdout>, what: &str, seen: &mut String) -> Result<String> {
    loop {
        let mut line = String::new();
        if out.read_line(&mut line)? == 0 {
            bail!("ferry publish ended before printing {what:?}; printed {seen}");
        }
        seen.push_str(&line);
        if line.contains(what) {
            return Ok(line);
        }
    }
}

#[test]
fn an_interrupted_pull_leaves_at_once_and_the_publisher_says_so_once() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let file = dir.path().join("big.bin");
    // 128 MiB in 64 KiB chunks, one in flight: the first pull takes seconds, so it is stopped
    // in the middle.
    std::fs::File::create(&file)?.set_len(128 << 20)?;
    let mut child = ferry()
        .arg("publish")
        .arg(&file)
        .args(["--name", "members", "--listen", "127.0.0.1:0"])
        .args(["--transport", "tcp", "--chunk-size", "64KiB"])
        .args(["--serve-for", "120"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()?;
    let mut out = BufReader::new(child.stdout.take().context("stdout")?);
    let mut err_pipe = child.stderr.take().context("stderr")?;
    let publisher = Publisher(child);
    let errs = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = err_pipe.read_to_string(&mut s);
        s
    });
    let mut printed = String::new();
    let control = line_with(&mut out, "control ", &mut printed)?;
    let addr = control
        .split_whitespace()
        .nth(1)
        .context("the control address")?
        .to_owned();
    let pull = |window: &str| {
        let mut c = ferry();
        c.args(["pull", &addr, "--in-memory", "--linger", "0"])
            .args(["--transport", "tcp", "--window", window])
            .args(["--progress", "lines", "--progress-every", "100ms"])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        c
    };

    let first = pull("1").spawn()?;
    line_with(&mut out, "joined", &mut printed)?;
    signal(&first, "INT")?;
    let o = first.wait_with_output()?;
    assert_eq!(
        o.status.code(),
        Some(130),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    let stopped = Instant::now();

    // At once, while the first one's lease (3 s) would still list it.
    let second = pull("8").spawn()?;
    let left = line_with(&mut out, "before finishing", &mut printed)?;
    let said_after = stopped.elapsed();
    assert!(
        left.contains("left before finishing") && left.contains("interrupted"),
        "{left}"
    );
    assert!(
        said_after < Duration::from_millis(2500),
        "the publisher said it {said_after:?} after the pull stopped (its lease, not its leave): \
         {left}"
    );
    let second = second.wait_with_output()?;
    let err = String::from_utf8_lossy(&second.stderr);
    assert!(second.status.success(), "{err}");
    assert!(
        !err.contains("cannot attach"),
        "tried the stopped pull as a holder: {err}"
    );
    let progress: Vec<&str> = err.lines().filter(|l| l.contains(" peer")).collect();
    assert!(!progress.is_empty(), "no progress line: {err}");
    for l in &progress {
        // `..., 1 peer, ETA 2 s; from ...`: the number before ` peer`.
        let peers: Option<u32> = l
            .split(" peer")
            .next()
            .and_then(|head| head.rsplit(' ').next())
            .and_then(|n| n.parse().ok());
        assert!(
            peers.is_some_and(|p| p <= 1),
            "counted the stopped pull (or itself) as a peer: {l}"
        );
    }

    signal(&publisher.0, "INT")?;
    let mut rest = String::new();
    out.read_to_string(&mut rest)?;
    printed.push_str(&rest);
    let logged = errs.join().map_err(|_| anyhow::anyhow!("stderr reader"))?;
    let both = format!("{printed}{logged}");
    assert_eq!(
        both.matches("before finishing").count(),
        1,
        "said more than once: stdout {printed}\nstderr {logged}"
    );
    assert_eq!(
        both.matches("joined, pulling").count(),
        2,
        "stdout {printed}\nstderr {logged}"
    );
    Ok(())
}

#[test]
fn a_pull_stopped_past_its_lease_and_resumed_is_silent_then_back_never_joined_twice() -> Result<()>
{
    let dir = tempfile::tempdir()?;
    let file = dir.path().join("big.bin");
    std::fs::File::create(&file)?.set_len(64 << 20)?;
    let mut child = ferry()
        .arg("publish")
        .arg(&file)
        .args(["--name", "resumed", "--listen", "127.0.0.1:0"])
        .args(["--transport", "tcp", "--chunk-size", "64KiB"])
        .args(["--serve-for", "30"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()?;
    let mut out = BufReader::new(child.stdout.take().context("stdout")?);
    let _publisher = Publisher(child);
    let mut printed = String::new();
    let control = line_with(&mut out, "control ", &mut printed)?;
    let addr = control
        .split_whitespace()
        .nth(1)
        .context("the control address")?
        .to_owned();
    let pull = ferry()
        .args(["pull", &addr, "--in-memory", "--linger", "0"])
        .args(["--transport", "tcp", "--window", "1", "--progress", "none"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()?;
    let pull = Publisher(pull);
    line_with(&mut out, "joined", &mut printed)?;
    signal(&pull.0, "STOP")?;
    // Its 3 s lease runs out: silent, out of the plan.
    line_with(&mut out, "went silent", &mut printed)?;
    signal(&pull.0, "CONT")?;
    // Resumed, it heartbeats again and goes on: its source is not to blame for the time it
    // did not run.
    line_with(&mut out, "is back after", &mut printed)?;
    let end = line_with(&mut out, "finish", &mut printed)?;
    assert!(end.contains("finished version 1"), "{printed}");
    assert_eq!(printed.matches("joined").count(), 1, "{printed}");
    Ok(())
}
