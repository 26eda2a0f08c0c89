//! `ferry serve` and `ferry bench` as a user runs them, over 127.0.0.1.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};

use anyhow::{Context, Result, bail};

fn bench_json(args: &[&str]) -> Result<serde_json::Value> {
    let out = Command::new(env!("CARGO_BIN_EXE_ferry"))
        .arg("bench")
        .args(args)
        .arg("--json")
        .output()?;
    if !out.status.success() {
        bail!(
            "ferry bench {args:?} failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(serde_json::from_slice(&out.stdout)?)
}

/// What `--transport auto` runs here to a peer on this host: the same-host plane where this host
/// allows it, else io_uring where the kernel can carry it, else TCP.
fn auto_transport() -> &'static str {
    let same_host = ferry::probe_same_host();
    if same_host.boot_id.is_ok() && same_host.copies.is_ok() {
        "local"
    } else if ferry::probe_kernel().usable() {
        "uring"
    } else {
        "tcp"
    }
}

fn check_report(v: &serde_json::Value, op: &str, op_bytes: u64, total: u64) -> Result<()> {
    check_report_over(v, auto_transport(), op, op_bytes, total)
}

fn check_report_over(
    v: &serde_json::Value,
    transport: &str,
    op: &str,
    op_bytes: u64,
    total: u64,
) -> Result<()> {
    assert_eq!(v["transport"], transport, "{v}");
    assert_eq!(v["op"], op);
    assert_eq!(v["op_bytes"].as_u64(), Some(op_bytes));
    assert_eq!(v["total_bytes"].as_u64(), Some(total));
    for key in ["seconds", "gb_per_s", "ops_per_s", "p50_us", "p99_us"] {
        let x = v[key]
            .as_f64()
            .with_context(|| format!("{key} missing in {v}"))?;
        assert!(x >= 0.0, "{key} = {x}");
    }
    assert!(v["p99_us"].as_f64() >= v["p50_us"].as_f64());
    Ok(())
}

#[test]
fn loopback_bench_without_a_peer() -> Result<()> {
    let v = bench_json(&["--total", "8MiB", "--op-size", "256KiB", "--streams", "2"])?;
    check_report(&v, "write", 256 << 10, 8 << 20)
}

#[test]
fn loopback_bench_over_each_data_plane() -> Result<()> {
    for transport in ["tcp", "uring"] {
        let unusable = ferry::probe_kernel().unusable_reason();
        if let (Some(why), "uring") = (unusable, transport) {
            ferry_tests::require_or_skip(
                ferry_tests::URING,
                format!("--transport uring: io_uring unusable here: {why}"),
            );
            continue;
        }
        for op in ["read", "write"] {
            let v = bench_json(&[
                "--transport",
                transport,
                "--op",
                op,
                "--total",
                "8MiB",
                "--op-size",
                "1MiB",
                "--streams",
                "2",
            ])?;
            check_report_over(&v, transport, op, 1 << 20, 8 << 20)?;
        }
    }
    Ok(())
}

/// Starts `ferry serve` with `args` and returns it with the address it printed.
fn serve(args: &[&str]) -> Result<(std::process::Child, Option<String>)> {
    let mut serve = Command::new(env!("CARGO_BIN_EXE_ferry"))
        .arg("serve")
        .args(["--listen", "127.0.0.1:0"])
        .args(args)
        .stdout(Stdio::piped())
        .spawn()?;
    let stdout = serve.stdout.take().context("stdout")?;
    let mut addr = None;
    for line in BufReader::new(stdout).lines() {
        let line = line?;
        if let Some(a) = line.strip_prefix("listening on ") {
            addr = Some(a.trim().to_owned());
            break;
        }
    }
    Ok((serve, addr))
}

#[test]
fn bench_reads_a_file_segment_served_by_io_uring() -> Result<()> {
    if let Some(why) = ferry::probe_kernel().unusable_reason() {
        ferry_tests::require_or_skip(ferry_tests::URING, format!("io_uring unusable here: {why}"));
        return Ok(());
    }
    bench_reads_a_file_segment_served_over("uring")
}

#[test]
fn bench_reads_a_file_segment_served_over_tcp() -> Result<()> {
    bench_reads_a_file_segment_served_over("tcp")
}

/// `ferry serve --transport SERVED --file`, then `ferry bench` READs of it over each data plane
/// this machine has.
fn bench_reads_a_file_segment_served_over(served: &str) -> Result<()> {
    let path = std::env::temp_dir().join(format!("ferry-cli-file-{served}-{}", std::process::id()));
    std::fs::write(&path, vec![7u8; (4 << 20) + 100])?;
    let spec = format!("shard={}", path.display());
    // The TCP server runs its streams on the caller's runtime here (I/O threads elsewhere).
    let io_threads = if served == "tcp" { "caller" } else { "auto" };
    let (mut child, addr) = serve(&[
        "--transport",
        served,
        "--file",
        &spec,
        "--io-threads",
        io_threads,
    ])?;
    let result = (|| -> Result<()> {
        let addr = addr.context("ferry serve printed no address")?;
        let mut clients = vec!["tcp"];
        match ferry::probe_kernel().unusable_reason() {
            None => clients.push("uring"),
            Some(why) => eprintln!("no io_uring client here ({why}): tcp only"),
        }
        for transport in clients {
            let v = bench_json(&[
                &addr,
                "--transport",
                transport,
                "--segment",
                "shard",
                "--op",
                "read",
                "--total",
                "8MiB",
            ])?;
            check_report_over(&v, transport, "read", 1 << 20, 8 << 20)?;
        }
        Ok(())
    })();
    let _ = child.kill();
    let _ = child.wait();
    let _ = std::fs::remove_file(&path);
    result
}

/// `ferry serve --file-rw`: `ferry bench` WRITEs land in the file (over each data plane this
/// machine has), the file keeps its size, and bytes past the last whole op stay as they were.
#[test]
fn bench_writes_into_a_writable_file_segment() -> Result<()> {
    let len = (4usize << 20) + 100;
    let path = std::env::temp_dir().join(format!("ferry-cli-file-rw-{}", std::process::id()));
    std::fs::write(&path, vec![7u8; len])?;
    let spec = format!("ckpt={}", path.display());
    let (mut child, addr) = serve(&["--file-rw", &spec])?;
    let result = (|| -> Result<()> {
        let addr = addr.context("ferry serve printed no address")?;
        let mut clients = vec!["tcp"];
        if ferry::probe_kernel().unusable_reason().is_none() {
            clients.push("uring");
        }
        for transport in clients {
            std::fs::write(&path, vec![7u8; len])?;
            let v = bench_json(&[
                &addr,
                "--transport",
                transport,
                "--segment",
                "ckpt",
                "--op",
                "write",
                "--total",
                "8MiB",
            ])?;
            check_report_over(&v, transport, "write", 1 << 20, 8 << 20)?;
            let got = std::fs::read(&path)?;
            assert_eq!(got.len(), len, "{transport}: the file changed size");
            assert!(
                got[..4 << 20].iter().filter(|&&b| b == 7).count() < 1 << 16,
                "{transport}: the WRITEs did not land in the file"
            );
            assert!(
                got[4 << 20..].iter().all(|&b| b == 7),
                "{transport}: tail touched"
            );
        }
        Ok(())
    })();
    let _ = child.kill();
    let _ = child.wait();
    let _ = std::fs::remove_file(&path);
    // A read-only server refuses the flag outright.
    let out = Command::new(env!("CARGO_BIN_EXE_ferry"))
        .args(["serve", "--read-only", "--file-rw", "x=/dev/null"])
        .output()?;
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--read-only"));
    result
}

#[test]
fn bench_against_ferry_serve() -> Result<()> {
    let (mut serve, addr) = serve(&["--segment", "weights=4MiB"])?;
    let result = (|| -> Result<()> {
        let addr = addr.context("ferry serve printed no address")?;
        for op in ["read", "write"] {
            let v = bench_json(&[
                &addr,
                "--segment",
                "weights",
                "--op",
                op,
                "--op-size",
                "64KiB",
                "--total",
                "2MiB",
            ])?;
            check_report(&v, op, 64 << 10, 2 << 20)?;
        }
        // A segment the server does not publish is an error naming it.
        let out = Command::new(env!("CARGO_BIN_EXE_ferry"))
            .args(["bench", &addr, "--segment", "nope", "--total", "1MiB"])
            .output()?;
        assert!(!out.status.success());
        assert!(String::from_utf8_lossy(&out.stderr).contains("nope"));
        Ok(())
    })();
    let _ = serve.kill();
    let _ = serve.wait();
    result
}
