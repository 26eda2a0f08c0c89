//! `cargo xtask bench latency`: small-op round trips against a bare TCP ping-pong, in one run.
//!
//! The reference is the floor a transfer engine over TCP can reach on this machine: two threads of
//! this process, each blocked in `recv` on its end of a loopback connection (Nagle off), bouncing
//! 64 bytes. Ferry is `ferry bench --op-size 64 --depth 1` (WRITEs, one op in flight, its own
//! loopback server), with the TCP streams on I/O threads (`--io-threads auto`, the default) and on
//! the caller's runtime (`caller`), and over io_uring (the stream thread reading every response,
//! and with `--uring-caller-receives` the awaiting task reading its own). The table shows median
//! (p50) round trips over `--repeat` rounds and their ratio to the ping-pong's p50.
//! docs/architecture.md's target is 1.2x.
//!
//! Options: `--ops N` (round trips per run, default 20000), `--repeat N` (default 3).

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::Instant;

use anyhow::{Context, Result, bail};

use crate::util::{cargo, ferry_bench_json, median, run as run_loud};

/// p50 of a bare 64-byte TCP ping-pong over loopback, in microseconds.
pub(crate) fn ping_pong(ops: usize) -> Result<f64> {
    let listener = TcpListener::bind("127.0.0.1:0").context("bind")?;
    let addr = listener.local_addr()?;
    let echo = std::thread::spawn(move || -> Result<()> {
        let (mut s, _) = listener.accept()?;
        s.set_nodelay(true)?;
        let mut buf = [0u8; 64];
        loop {
            match s.read_exact(&mut buf) {
                Ok(()) => s.write_all(&buf)?,
                Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(()),
                Err(e) => return Err(e.into()),
            }
        }
    });
    let mut c = TcpStream::connect(addr).context("connect")?;
    c.set_nodelay(true)?;
    let mut buf = [7u8; 64];
    let mut lat = Vec::with_capacity(ops);
    for i in 0..ops + ops / 10 {
        let t = Instant::now();
        c.write_all(&buf)?;
        c.read_exact(&mut buf)?;
        if i >= ops / 10 {
            // The first tenth warms up.
            lat.push(t.elapsed().as_secs_f64() * 1e6);
        }
    }
    drop(c);
    echo.join()
        .map_err(|_| anyhow::anyhow!("echo thread panicked"))??;
    Ok(median(&lat))
}

/// p50 of `ferry bench` 64-byte WRITEs, one in flight.
pub(crate) fn ferry(ops: usize, extra: &[&str]) -> Result<f64> {
    let total = (ops * 64).to_string();
    let mut args = vec![
        "--op",
        "write",
        "--op-size",
        "64",
        "--depth",
        "1",
        "--total",
        &total,
    ];
    args.extend_from_slice(extra);
    ferry_bench_json(&args, "p50_us")
}

/// Runs the comparison.
pub(crate) fn run(args: &[String]) -> Result<()> {
    let mut ops = 20_000usize;
    let mut repeat = 3usize;
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let mut num = |name: &str| -> Result<usize> {
            it.next()
                .with_context(|| format!("{name} needs a value"))?
                .parse()
                .with_context(|| name.to_owned())
        };
        match a.as_str() {
            "--ops" => ops = num("--ops")?.max(100),
            "--repeat" => repeat = num("--repeat")?.max(1),
            other => bail!("unknown option {other} (bench latency takes --ops N, --repeat N)"),
        }
    }
    run_loud(cargo().args(["build", "--release", "-p", "ferry-engine-cli"]))?;
    let mut cases: Vec<(&str, Vec<&str>)> = vec![
        ("ferry tcp, I/O threads", vec!["--transport", "tcp"]),
        (
            "ferry tcp, caller's runtime",
            vec!["--transport", "tcp", "--io-threads", "caller"],
        ),
    ];
    match ferry(200, &["--transport", "uring"]) {
        Ok(_) => {
            cases.push(("ferry uring", vec!["--transport", "uring"]));
            cases.push((
                "ferry uring, caller receives",
                vec!["--transport", "uring", "--uring-caller-receives"],
            ));
        }
        Err(e) => println!("the uring row is left out: {e:#}"),
    }
    let mut reference = Vec::new();
    let mut rows: Vec<Vec<f64>> = vec![Vec::new(); cases.len()];
    for _ in 0..repeat {
        reference.push(ping_pong(ops)?);
        for (i, (_, extra)) in cases.iter().enumerate() {
            rows[i].push(ferry(ops, extra)?);
        }
    }
    let base = median(&reference);
    println!(
        "loopback, 64-byte round trips, {ops} per run, median of {repeat} runs' p50 (us); target 1.2x"
    );
    println!("{:<30} {:>10} {:>8}", "case", "p50 us", "ratio");
    println!("{:<30} {:>10.1} {:>8}", "bare TCP ping-pong", base, "1.00");
    for ((name, _), v) in cases.iter().zip(rows) {
        let p = median(&v);
        println!("{name:<30} {p:>10.1} {:>7.2}x", p / base);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ping_pong_measures_something() {
        let p = ping_pong(200).unwrap();
        assert!(p.is_finite() && p > 0.0, "{p}");
    }
}
