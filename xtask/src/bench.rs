//! `cargo xtask bench tcp`: Ferry's TCP transport against iperf3 on loopback, in one run.
//!
//! For one and two streams, with 1 MiB ops and the same number of bytes, it runs iperf3 (one
//! process for one stream; two processes in parallel for two streams, since iperf3 3.12 runs all
//! `-P` streams in one thread) and `ferry bench` (release build, its own in-process loopback
//! server) back to back, each `--repeat` times (best run kept, the same rule for both), and prints
//! a table of rates and ferry/iperf3 ratios. Target: at least 0.9 for both.
//!
//! Options: `--total BYTES` (default 4GiB per run), `--repeat N` (default 3).
//! `cargo xtask bench uring` runs the io_uring comparison (`bench_uring.rs`).

use std::process::{Command, Stdio};
use std::thread::sleep;
use std::time::Duration;

use anyhow::{Context, Result, bail};

use crate::util::{cargo, have, project_root, run as run_loud};

const USAGE: &str = "usage: cargo xtask bench tcp [--total BYTES] [--repeat N]
       cargo xtask bench uring [options of bench_uring]";

/// Dispatches `cargo xtask bench <what>`.
pub(crate) fn run(args: &[String]) -> Result<()> {
    match args.first().map(String::as_str) {
        Some("tcp") => tcp(&args[1..]),
        Some("uring") => crate::bench_uring::run(&args[1..]),
        _ => {
            eprintln!("{USAGE}");
            bail!("bench: say which transport to measure")
        }
    }
}

fn size(s: &str) -> Result<u64> {
    let units = [
        ("GiB", 1u64 << 30),
        ("MiB", 1 << 20),
        ("KiB", 1 << 10),
        ("", 1),
    ];
    for (suffix, mul) in units {
        if let Some(n) = s.strip_suffix(suffix) {
            return Ok(n
                .trim()
                .parse::<u64>()
                .with_context(|| format!("size {s:?}"))?
                * mul);
        }
    }
    bail!("size {s:?}")
}

fn ensure_iperf3() -> Result<()> {
    if have("iperf3") {
        return Ok(());
    }
    eprintln!("iperf3 missing: installing it with apt-get");
    let sudo = have("sudo");
    let apt = |args: &[&str]| {
        let mut c = if sudo {
            let mut c = Command::new("sudo");
            c.arg("apt-get");
            c
        } else {
            Command::new("apt-get")
        };
        c.args(args).env("DEBIAN_FRONTEND", "noninteractive");
        c
    };
    run_loud(&mut apt(&["update", "-q"]))?;
    run_loud(&mut apt(&["install", "-y", "-q", "iperf3"]))?;
    if !have("iperf3") {
        bail!("iperf3 still missing after apt-get install iperf3");
    }
    Ok(())
}

/// The number after `"key":` at or after `from` in a JSON text (xtask has no JSON parser).
fn json_num(text: &str, key: &str, from: usize) -> Option<f64> {
    let pat = format!("\"{key}\"");
    let at = text.get(from..)?.find(&pat)? + from + pat.len();
    let rest = text.get(at..)?.trim_start().strip_prefix(':')?.trim_start();
    let end = rest
        .find(|c: char| !(c.is_ascii_digit() || matches!(c, '.' | '-' | '+' | 'e' | 'E')))
        .unwrap_or(rest.len());
    rest[..end].parse().ok()
}

fn free_port() -> Result<u16> {
    let l = std::net::TcpListener::bind("127.0.0.1:0").context("finding a free port")?;
    Ok(l.local_addr()?.port())
}

/// `n` iperf3 client/server pairs in parallel, `total` bytes over all; returns GB/s (10^9 B/s):
/// the bytes received over the longest receiver's time.
fn iperf3(n: usize, total: u64) -> Result<f64> {
    let mut servers = Vec::new();
    let mut ports = Vec::new();
    for _ in 0..n {
        let port = free_port()?;
        let s = Command::new("iperf3")
            .args(["-s", "-1", "-p", &port.to_string()])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .context("starting iperf3 -s")?;
        servers.push(s);
        ports.push(port);
    }
    sleep(Duration::from_millis(300));
    let per = total / n as u64;
    let clients: Vec<_> = ports
        .iter()
        .map(|p| {
            Command::new("iperf3")
                .args(["-c", "127.0.0.1", "-p", &p.to_string(), "-l", "1M", "-J"])
                .args(["-n", &per.to_string()])
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .context("starting iperf3 -c")
        })
        .collect::<Result<_>>()?;
    let mut bytes = 0.0;
    let mut seconds: f64 = 0.0;
    for c in clients {
        let out = c.wait_with_output().context("waiting for iperf3 -c")?;
        let text = String::from_utf8_lossy(&out.stdout);
        if !out.status.success() {
            bail!(
                "iperf3 -c failed: {text} {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        let at = text
            .find("\"sum_received\"")
            .context("iperf3 JSON without sum_received")?;
        bytes += json_num(&text, "bytes", at).context("iperf3 bytes")?;
        seconds = seconds.max(json_num(&text, "seconds", at).context("iperf3 seconds")?);
    }
    for mut s in servers {
        let _ = s.wait();
    }
    if seconds <= 0.0 {
        bail!("iperf3 reported no time");
    }
    Ok(bytes / seconds / 1e9)
}

fn ferry(streams: usize, op: &str, total: u64) -> Result<f64> {
    let bin = project_root().join("target/release/ferry");
    let out = Command::new(&bin)
        .args(["bench", "--json", "--transport", "tcp", "--op", op])
        // One 1 MiB buffer per stream on each side, as iperf3 reuses one `-l 1M` buffer per
        // process (ferry bench raises the segment to one op per stream).
        .args(["--op-size", "1MiB", "--segment-size", "1MiB"])
        .args([
            "--streams",
            &streams.to_string(),
            "--total",
            &total.to_string(),
        ])
        .output()
        .with_context(|| format!("running {}", bin.display()))?;
    let text = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        bail!(
            "ferry bench failed: {text} {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    json_num(&text, "gb_per_s", 0).with_context(|| format!("no gb_per_s in {text:?}"))
}

fn best(repeat: usize, mut f: impl FnMut() -> Result<f64>) -> Result<f64> {
    let mut best: f64 = 0.0;
    for _ in 0..repeat {
        best = best.max(f()?);
    }
    Ok(best)
}

fn tcp(args: &[String]) -> Result<()> {
    let mut total = 4u64 << 30;
    let mut repeat = 3usize;
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--total" => total = size(it.next().context("--total needs a value")?)?,
            "--repeat" => {
                repeat = it
                    .next()
                    .context("--repeat needs a value")?
                    .parse()
                    .context("--repeat")?
            }
            other => {
                eprintln!("{USAGE}");
                bail!("unknown option {other}")
            }
        }
    }
    let repeat = repeat.max(1);
    ensure_iperf3()?;
    run_loud(cargo().args(["build", "--release", "-p", "ferry-cli"]))?;
    println!("loopback, 1 MiB ops, {total} bytes per run, best of {repeat}; GB/s = 10^9 B/s");
    println!(
        "{:<10} {:>12} {:>12} {:>12} {:>14} {:>12}",
        "streams", "iperf3", "ferry write", "ratio", "ferry read", "ratio"
    );
    let mut worst: f64 = f64::INFINITY;
    for streams in [1usize, 2] {
        // Interleave the tools so that machine noise hits both alike.
        let mut ip: f64 = 0.0;
        let mut fw: f64 = 0.0;
        let mut fr: f64 = 0.0;
        for _ in 0..repeat {
            ip = ip.max(best(1, || iperf3(streams, total))?);
            fw = fw.max(best(1, || ferry(streams, "write", total))?);
            fr = fr.max(best(1, || ferry(streams, "read", total))?);
        }
        let (rw, rr) = (fw / ip, fr / ip);
        worst = worst.min(rw);
        println!(
            "{:<10} {:>12.3} {:>12.3} {:>12.2} {:>14.3} {:>12.2}",
            streams, ip, fw, rw, fr, rr
        );
    }
    let verdict = if worst >= 0.9 { "meets" } else { "misses" };
    println!(
        "ferry/iperf3 (write, worst of 1 and 2 streams) = {worst:.2}: {verdict} the 0.9 target"
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_sizes_and_json() {
        assert_eq!(size("4GiB").unwrap(), 4 << 30);
        assert_eq!(size("12").unwrap(), 12);
        assert!(size("x").is_err());
        let t = r#"{"end":{"sum_sent":{"bytes":5},"sum_received":{"seconds": 2.5,"bytes":10}}}"#;
        let at = t.find("\"sum_received\"").unwrap();
        assert_eq!(json_num(t, "bytes", at), Some(10.0));
        assert_eq!(json_num(t, "seconds", at), Some(2.5));
        assert_eq!(json_num(t, "nope", 0), None);
    }
}
