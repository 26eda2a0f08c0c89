//! `cargo xtask bench uring`: the io_uring transport against its references, in one run.
//!
//! - Network, loopback, 1 MiB ops, the same bytes: `iperf3 -Z` (one process for one stream, two
//!   processes for two streams: iperf3 3.12 runs all `-P` streams in one thread) against
//!   `ferry bench --transport uring --op write` (release build, its own io_uring server in the
//!   same process, the report's `transport` checked to be `uring`). Ferry is measured twice: with
//!   a 1 MiB segment (like iperf3, which reuses one `-l 1M` buffer on each side: the headline
//!   ratio) and with a 256 MiB segment (cache-cold memory, as a real transfer sees it). For two
//!   streams one more row puts the 1 MiB rate against `iperf3 -Z -P 2` in one process pair, the
//!   issue's literal reference (weaker here, since 3.12 drives both streams from one thread; it
//!   is also run before and after each round); the target is judged on the two-process rows.
//! - File: `fio --ioengine=io_uring --direct=1 --bs=1M --iodepth=32 --rw=read` on a temp file
//!   under /var/tmp against `read_file_into` (queue depth 32) and remote READs of the same file
//!   published as a file segment (`benches/src/bin/uring_bench.rs file`).
//!
//! Options: `--total BYTES` (network bytes per run, default 4GiB), `--file-size BYTES` (default
//! 1GiB), `--dir DIR` (default /var/tmp), `--repeat N` (network rounds, default 5). A round runs
//! iperf3, ferry (1 MiB, then 256 MiB segment) and iperf3 again; its reference is the mean of
//! the two iperf3 runs around ferry, so a machine drifting during the round hits both sides. Each
//! network row shows the median rates and the median of the rounds' ratios with their range
//! (shared machines drift by more than 10% between runs: a best-of-N would be decided by
//! luck). Installs iperf3 and fio with apt-get when missing.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::Duration;

use anyhow::{Context, Result, bail};

use crate::util::{cargo, ensure_tool, json_num, median, run as run_loud, size};

fn output(cmd: &mut Command) -> Result<String> {
    let line = format!("{cmd:?}");
    eprintln!("$ {line}");
    let out = cmd.output().with_context(|| format!("spawning {line}"))?;
    if !out.status.success() {
        bail!(
            "command failed ({}): {line}\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

struct Killed(Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn iperf3_server(port: u16) -> Result<Killed> {
    let child = crate::iperf3::server(port)?;
    // No probe connection: a one-off (`-1`) server would take it as its client.
    std::thread::sleep(Duration::from_millis(300));
    Ok(Killed(child))
}

/// iperf3 -Z over `streams` separate processes (one stream each), `total` bytes in all.
/// Returns the aggregate rate in GB/s (10^9 bytes per second).
fn iperf3(streams: usize, total: u64) -> Result<f64> {
    let base = 5201 + (std::process::id() % 1000) as u16 * 4;
    let ports: Vec<u16> = (0..streams).map(|i| base + i as u16).collect();
    let servers: Vec<Killed> = ports
        .iter()
        .map(|&p| iperf3_server(p))
        .collect::<Result<_>>()?;
    let (bytes, slowest) = crate::iperf3::clients(&ports, total / streams as u64, &["-Z"])?;
    drop(servers);
    Ok(bytes / slowest / 1e9)
}

/// iperf3 -Z with `-P streams` in one process pair (iperf3 3.12 runs all of them on one
/// thread per side: the literal reference, weaker than [`iperf3`]'s one process per
/// stream). Returns GB/s.
fn iperf3_one_process(streams: usize, total: u64) -> Result<f64> {
    let port = 5201 + (std::process::id() % 1000) as u16 * 4 + 3;
    let _server = iperf3_server(port)?;
    let out = Command::new("iperf3")
        .args(["-c", "127.0.0.1", "-p", &port.to_string()])
        .args(["-Z", "-l", "1M", "-n", &total.to_string(), "-J"])
        .args(["-P", &streams.to_string()])
        .output()
        .context("running iperf3 -c -P")?;
    let text = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        bail!("iperf3 -c -P failed: {text}");
    }
    let (bytes, seconds) = crate::iperf3::received_in(&text)?;
    if seconds <= 0.0 {
        bail!("iperf3 reported no time");
    }
    Ok(bytes / seconds / 1e9)
}

fn bench_bin() -> Result<PathBuf> {
    run_loud(cargo().args([
        "build",
        "--release",
        "-q",
        "-p",
        "ferry-benches",
        "--bin",
        "uring_bench",
    ]))?;
    let target = crate::util::target_dir();
    let bin = target.join("release/uring_bench");
    if !bin.is_file() {
        bail!("{} not built", bin.display());
    }
    run_loud(cargo().args(["build", "--release", "-q", "-p", "ferry-engine-cli"]))?;
    Ok(bin)
}

/// `ferry bench --transport uring` on loopback: WRITE, 1 MiB ops, `total` bytes over `streams`
/// streams, against a segment of `segment` bytes. Returns GB/s and the JSON line.
fn ferry_net(streams: usize, total: u64, segment: &str) -> Result<(f64, String)> {
    let target = crate::util::target_dir();
    let out = output(Command::new(target.join("release/ferry")).args([
        "bench",
        "--transport",
        "uring",
        "--json",
        "--op",
        "write",
        "--op-size",
        "1MiB",
        "--total",
        &total.to_string(),
        "--streams",
        &streams.to_string(),
        "--segment-size",
        segment,
    ]))?;
    if !out.contains("\"transport\":\"uring\"") {
        bail!("ferry bench --transport uring ran something else: {out}");
    }
    let rate = json_num(&out, "gb_per_s", 0).context("ferry bench gb_per_s")?;
    Ok((rate, out.trim().to_owned()))
}

fn make_file(path: &Path, len: u64) -> Result<()> {
    let mut f =
        std::fs::File::create(path).with_context(|| format!("create {}", path.display()))?;
    let mut block = vec![0u8; 1 << 20];
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    let mut left = len;
    while left > 0 {
        for b in block.chunks_exact_mut(8) {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            b.copy_from_slice(&x.to_le_bytes());
        }
        let n = left.min(block.len() as u64) as usize;
        f.write_all(&block[..n])?;
        left -= n as u64;
    }
    f.sync_all()?;
    Ok(())
}

/// fio's sequential O_DIRECT read rate of `path` in GB/s (io_uring, 1 MiB blocks, depth 32).
fn fio(path: &Path, len: u64) -> Result<f64> {
    let out = output(Command::new("fio").args([
        "--name=ferry",
        &format!("--filename={}", path.display()),
        "--ioengine=io_uring",
        "--direct=1",
        "--bs=1M",
        "--iodepth=32",
        "--rw=read",
        &format!("--size={len}"),
        "--output-format=json",
    ]))?;
    let at = out.find("\"read\"").context("fio JSON without read")?;
    Ok(json_num(&out, "bw_bytes", at).context("fio bw_bytes")? / 1e9)
}

struct Remove(PathBuf);

impl Drop for Remove {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// One row of the table: the case, Ferry's GB/s, the reference's GB/s, and the per-round ratios.
type Row = (String, f64, f64, Vec<f64>);

/// Entry point: `cargo xtask bench uring [--total BYTES] [--file-size BYTES] [--dir DIR]`.
pub(crate) fn run(args: &[String]) -> Result<()> {
    let mut total = 4u64 << 30;
    let mut file_size = 1u64 << 30;
    let mut dir = PathBuf::from("/var/tmp");
    let mut repeat = 5usize;
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let mut val = || it.next().with_context(|| format!("{a} needs a value"));
        match a.as_str() {
            "--total" => total = size(val()?)?,
            "--file-size" => file_size = size(val()?)?,
            "--dir" => dir = PathBuf::from(val()?),
            "--repeat" => repeat = val()?.parse().context("--repeat takes a count")?,
            other => bail!("unknown option {other}"),
        }
    }
    ensure_tool("iperf3", "iperf3")?;
    ensure_tool("fio", "fio")?;
    let bin = bench_bin()?;

    let mut rows: Vec<Row> = Vec::new();
    let mut details = Vec::new();
    let repeat = repeat.max(1);
    for streams in [1usize, 2] {
        net_rows(streams, total, repeat, &mut rows, &mut details)?;
    }
    file_rows(&bin, &dir, file_size, &mut rows, &mut details)?;
    print_table(&rows, &details);
    Ok(())
}

/// `repeat` rounds of Ferry over loopback with `streams` streams (1 MiB and 256 MiB segments)
/// between iperf3 runs (and, for several streams, iperf3 in one process): their rows.
fn net_rows(
    streams: usize,
    total: u64,
    repeat: usize,
    rows: &mut Vec<Row>,
    details: &mut Vec<String>,
) -> Result<()> {
    let (mut refs, mut hots, mut colds) = (Vec::new(), Vec::new(), Vec::new());
    let (mut hot_ratios, mut cold_ratios) = (Vec::new(), Vec::new());
    let (mut one_refs, mut one_ratios) = (Vec::new(), Vec::new());
    for round in 1..=repeat {
        eprintln!("net, {streams} stream(s): round {round}/{repeat}");
        let one_before = if streams > 1 {
            Some(iperf3_one_process(streams, total)?)
        } else {
            None
        };
        let before = iperf3(streams, total)?;
        let (hot, d1) = ferry_net(streams, total, "1MiB")?;
        let (cold, d2) = ferry_net(streams, total, "256MiB")?;
        let after = iperf3(streams, total)?;
        if let Some(b) = one_before {
            let one = (b + iperf3_one_process(streams, total)?) / 2.0;
            one_refs.push(one);
            one_ratios.push(hot / one);
            details.push(format!(
                "{streams} stream(s), round {round}: iperf3 -Z -P {streams} (one process) \
                 {one:.2} GB/s"
            ));
        }
        let reference = (before + after) / 2.0;
        refs.push(reference);
        hots.push(hot);
        colds.push(cold);
        hot_ratios.push(hot / reference);
        cold_ratios.push(cold / reference);
        details.push(d1);
        details.push(d2);
        details.push(format!(
            "{streams} stream(s), round {round}: iperf3 -Z {before:.2} and {after:.2}, \
             ferry 1 MiB {hot:.2}, 256 MiB {cold:.2} GB/s"
        ));
    }
    let reference = median(&refs);
    rows.push((
        format!("net {streams} stream(s), 1 MiB segment"),
        median(&hots),
        reference,
        hot_ratios,
    ));
    rows.push((
        format!("net {streams} stream(s), 256 MiB segment"),
        median(&colds),
        reference,
        cold_ratios,
    ));
    if !one_refs.is_empty() {
        rows.push((
            format!("net {streams} streams, 1 MiB, vs iperf3 -P {streams} (1 proc)"),
            median(&hots),
            median(&one_refs),
            one_ratios,
        ));
    }
    Ok(())
}

/// Ferry's file reads (`read_file_into`, and a file segment READ over loopback) against fio's
/// before and after them: their rows.
fn file_rows(
    bin: &Path,
    dir: &Path,
    file_size: u64,
    rows: &mut Vec<Row>,
    details: &mut Vec<String>,
) -> Result<()> {
    let path = dir.join(format!("ferry-bench-uring-{}.bin", std::process::id()));
    let _cleanup = Remove(path.clone());
    eprintln!("writing {} bytes to {}", file_size, path.display());
    make_file(&path, file_size)?;
    // fio runs before and after Ferry (a virtual disk's host cache can favour whoever reads
    // second); the better of the two is the reference.
    let fio_before = fio(&path, file_size)?;
    let file_out = output(Command::new(bin).args([
        "file",
        "--path",
        &path.display().to_string(),
        "--qd",
        "32",
        "--streams",
        "4",
    ]))?;
    let local_at = file_out
        .find("read_file_into")
        .context("uring_bench file output")?;
    let local = json_num(&file_out, "gb_per_s", local_at).context("read_file_into rate")?;
    let remote_at = file_out
        .find("file_segment_read")
        .context("uring_bench file output")?;
    let remote = json_num(&file_out, "gb_per_s", remote_at).context("file segment rate")?;
    details.push(file_out.trim().to_owned());
    let fio_after = fio(&path, file_size)?;
    details.push(format!(
        "fio GB/s: before {fio_before:.3}, after {fio_after:.3}"
    ));
    let fio = fio_before.max(fio_after);
    rows.push((
        "file read_file_into, qd 32".into(),
        local,
        fio,
        vec![local / fio],
    ));
    rows.push((
        "file segment READ over loopback, 4 streams".into(),
        remote,
        fio,
        vec![remote / fio],
    ));
    Ok(())
}

/// The details, then the table of rows with the targets.
fn print_table(rows: &[Row], details: &[String]) {
    println!();
    for d in details {
        println!("{d}");
    }
    println!();
    println!(
        "{:<46} {:>10} {:>12} {:>7}",
        "case", "ferry GB/s", "ref GB/s", "ratio (median of rounds [range])"
    );
    for (name, ferry, reference, ratios) in rows {
        let refname = if name.starts_with("net") {
            "ip3"
        } else {
            "fio"
        };
        let range = if ratios.len() > 1 {
            let lo = ratios.iter().cloned().fold(f64::INFINITY, f64::min);
            let hi = ratios.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            format!(" [{lo:.2}-{hi:.2}]")
        } else {
            String::new()
        };
        println!(
            "{:<46} {:>10.2} {:>8.2} {:<4}{:>6.2}x{range}",
            name,
            ferry,
            reference,
            refname,
            median(ratios),
        );
    }
    println!();
    println!("targets: network >= 1.0x iperf3 -Z (one process per stream); file READ >= 0.9x fio");
}
