//! `cargo xtask bench tcp`: Ferry's TCP transport against iperf3 on loopback, in one run.
//!
//! For one and two streams, with 1 MiB ops and the same number of bytes, it runs iperf3 (one
//! process for one stream; two processes in parallel for two streams, since iperf3 3.12 runs all
//! `-P` streams in one thread) and `ferry bench` (release build, its own in-process loopback
//! server) back to back, in `--repeat` rounds. Each ferry run is divided by the iperf3 run of its
//! round (the machine's speed drifts by more than 10% between rounds on a shared host), and the
//! table shows median rates and the median and range of those ratios. Target: at least 0.9 for
//! both.
//!
//! Options: `--total BYTES` (default 4GiB per run), `--repeat N` (default 5).
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

fn median(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

fn tcp(args: &[String]) -> Result<()> {
    let mut total = 4u64 << 30;
    let mut repeat = 5usize;
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
    println!(
        "loopback, 1 MiB ops, {total} bytes per run, {repeat} rounds of iperf3, ferry write and \
         ferry read back to back; rates are medians, ratios the median of each round's ratio \
         (range in brackets); GB/s = 10^9 B/s"
    );
    println!(
        "{:<8} {:>8} {:>12} {:>18} {:>11} {:>18}",
        "streams", "iperf3", "ferry write", "ratio", "ferry read", "ratio"
    );
    let mut worst: f64 = f64::INFINITY;
    for streams in [1usize, 2] {
        // Interleave the tools so that machine noise hits both alike; pair each ferry run with
        // the iperf3 run just before it.
        let (mut ip, mut fw, mut fr, mut rw, mut rr) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for _ in 0..repeat {
            let i = iperf3(streams, total)?;
            let w = ferry(streams, "write", total)?;
            let r = ferry(streams, "read", total)?;
            ip.push(i);
            fw.push(w);
            fr.push(r);
            rw.push(w / i);
            rr.push(r / i);
        }
        let range = |v: &[f64]| {
            let lo = v.iter().copied().fold(f64::INFINITY, f64::min);
            let hi = v.iter().copied().fold(0.0, f64::max);
            format!("{:.2} [{lo:.2}-{hi:.2}]", median(v))
        };
        worst = worst.min(median(&rw));
        println!(
            "{:<8} {:>8.3} {:>12.3} {:>18} {:>11.3} {:>18}",
            streams,
            median(&ip),
            median(&fw),
            range(&rw),
            median(&fr),
            range(&rr)
        );
    }
    let verdict = if worst >= 0.9 { "meets" } else { "misses" };
    println!(
        "ferry/iperf3 (write, worse of 1 and 2 streams, median) = {worst:.2}: {verdict} the 0.9 target"
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

    #[test]
    fn medians() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[4.0, 1.0, 2.0, 3.0]), 2.5);
        assert!(median(&[]).is_nan());
    }
}
