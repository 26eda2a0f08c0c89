//! The server child: one engine serving a writable `scratch` segment and read-only segments
//! registered and retired on command, and the handle the parent drives it by.
//!
//! Commands, one per stdin line, each answered by one line: `register NAME BYTES SEED` (a
//! read-only segment holding pattern SEED) → `OK`; `retire NAME` → `OK`; `describe` →
//! `REGS <live registrations> <registered bytes> IO <data_plane_io or ->`. EOF ends it.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::net::SocketAddr;
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};

use anyhow::{Context, Result, bail};
use ferry::{Access, MemoryRegion, TransferEngine};
use ferry_tests::{Census, pattern};

use crate::Args;

/// Size of the writable segment every client writes its own slice of.
pub(crate) const SCRATCH: u64 = 64 << 20;

/// Runs the server child (see the module docs).
pub(crate) fn serve(args: &Args) -> Result<()> {
    args.only(&["plane"])?;
    let (plane, _) = args.plane()?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let _in_rt = rt.enter();
    let engine = TransferEngine::builder()
        .same_host(false)
        .listen("127.0.0.1:0".parse()?)
        .data_plane(plane)
        .build()?;
    let mut regs = HashMap::new();
    let scratch = MemoryRegion::alloc_zeroed(SCRATCH as usize, 4096)?;
    regs.insert(
        "scratch".to_owned(),
        engine.register(
            scratch,
            Access::REMOTE_READ | Access::REMOTE_WRITE,
            "scratch",
        )?,
    );
    let mut out = std::io::stdout().lock();
    writeln!(
        out,
        "LISTEN {}",
        engine.local_addr().context("no listen address")?
    )?;
    out.flush()?;
    for line in std::io::stdin().lock().lines() {
        let line = line?;
        let words: Vec<&str> = line.split_whitespace().collect();
        let reply = match words[..] {
            ["register", name, bytes, seed] => {
                let mut bytes = vec![0u8; bytes.parse()?];
                pattern::fill(&mut bytes, seed.parse()?, 0);
                let region = MemoryRegion::from_vec(bytes);
                regs.insert(
                    name.to_owned(),
                    engine.register(region, Access::REMOTE_READ, name)?,
                );
                "OK".to_owned()
            }
            ["retire", name] => {
                if let Some(r) = regs.remove(name) {
                    r.retire()?;
                }
                "OK".to_owned()
            }
            ["describe"] => {
                let d = engine.describe();
                format!(
                    "REGS {} {} IO {}",
                    d.registrations,
                    d.registered_bytes,
                    d.data_plane_io.as_deref().unwrap_or("-")
                )
            }
            _ => bail!("unknown command {line:?}"),
        };
        writeln!(out, "{reply}")?;
        out.flush()?;
    }
    engine.shutdown();
    Ok(())
}

/// The parent's handle on a server child; dropping it closes the child's stdin and reaps it.
pub(crate) struct Server {
    child: Child,
    stdin: Option<ChildStdin>,
    stdout: BufReader<ChildStdout>,
    /// Where it listens.
    pub(crate) addr: SocketAddr,
}

impl Server {
    /// Starts this binary as `serve --plane PLANE` and waits for its address.
    pub(crate) fn start(plane: &str) -> Result<Self> {
        let exe = std::env::current_exe().context("this binary's path")?;
        let mut child = Command::new(exe)
            .args(["serve", "--plane", plane])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .context("starting the server child")?;
        let stdin = child.stdin.take();
        let mut stdout = BufReader::new(child.stdout.take().context("child stdout")?);
        let mut line = String::new();
        stdout.read_line(&mut line)?;
        let addr = line
            .trim()
            .strip_prefix("LISTEN ")
            .with_context(|| format!("the server child said {line:?}"))?
            .parse()?;
        Ok(Self {
            child,
            stdin,
            stdout,
            addr,
        })
    }

    /// Sends one command and returns the child's answer.
    pub(crate) fn command(&mut self, cmd: &str) -> Result<String> {
        let stdin = self.stdin.as_mut().context("the server child is closed")?;
        writeln!(stdin, "{cmd}")?;
        stdin.flush()?;
        let mut line = String::new();
        if self.stdout.read_line(&mut line)? == 0 {
            bail!("the server child exited on {cmd:?}");
        }
        Ok(line.trim().to_owned())
    }

    /// Live registrations and the data plane's I/O line (`describe`).
    pub(crate) fn describe(&mut self) -> Result<(u64, String)> {
        let line = self.command("describe")?;
        let rest = line.strip_prefix("REGS ").context("describe answer")?;
        let (regs, io) = rest.split_once(" IO ").context("describe answer")?;
        let regs = regs.split_whitespace().next().context("describe answer")?;
        Ok((regs.parse()?, io.to_owned()))
    }

    /// The child's resources.
    pub(crate) fn census(&self) -> Result<Census> {
        Census::of(self.child.id())
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        drop(self.stdin.take());
        if !matches!(self.child.wait(), Ok(s) if s.success()) {
            eprintln!("the server child did not exit cleanly");
        }
    }
}
