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

fn check_report(v: &serde_json::Value, op: &str, op_bytes: u64, total: u64) -> Result<()> {
    assert_eq!(v["transport"], "tcp");
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
fn bench_against_ferry_serve() -> Result<()> {
    let mut serve = Command::new(env!("CARGO_BIN_EXE_ferry"))
        .args([
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--segment",
            "weights=4MiB",
        ])
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
