//! `ferry serve --metrics` scraped by a real Prometheus server (Debian's `prometheus`) while
//! `ferry bench` reads from it: the test asks Prometheus' HTTP API for the rate of served bytes
//! until it is above zero. Needs a `prometheus` binary (`FERRY_REQUIRE_PROMETHEUS`).

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use ferry_tests::{PROMETHEUS, require_or_skip};

/// Kills and reaps its child when dropped (a failed test leaves no process behind).
struct Reaped(Child);

impl Drop for Reaped {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn free_port() -> Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

/// One HTTP/1.0 GET (so the answer is never chunked and ends when the connection closes):
/// the status code and the body.
fn get(addr: SocketAddr, path: &str) -> Result<(u16, String)> {
    let mut s = TcpStream::connect(addr).with_context(|| format!("connecting to {addr}"))?;
    s.set_read_timeout(Some(Duration::from_secs(10)))?;
    write!(s, "GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n")?;
    let mut all = String::new();
    s.read_to_string(&mut all)?;
    let (head, body) = all
        .split_once("\r\n\r\n")
        .with_context(|| format!("no end of head in {all:?}"))?;
    let code = head
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .with_context(|| format!("no status in {head:?}"))?;
    Ok((code, body.to_owned()))
}

/// Percent-encodes a query parameter.
fn encode(q: &str) -> String {
    q.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

#[test]
fn prometheus_scrapes_serve_while_a_bench_runs() -> Result<()> {
    let bin = ["prometheus", "/usr/bin/prometheus"].into_iter().find(|b| {
        Command::new(b)
            .arg("--version")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok()
    });
    let Some(bin) = bin else {
        require_or_skip(
            PROMETHEUS,
            "no prometheus binary (Debian: apt-get install prometheus)",
        );
        return Ok(());
    };

    // The server, with its metrics on a free loopback port.
    let mut serve = Command::new(env!("CARGO_BIN_EXE_ferry"))
        .args([
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--metrics",
            "127.0.0.1:0",
        ])
        .args(["--segment", "bench=16MiB"])
        .stdout(Stdio::piped())
        .spawn()
        .context("starting ferry serve")?;
    let stdout = serve.stdout.take().context("stdout")?;
    let serve = Reaped(serve);
    let (mut data, mut metrics) = (None, None);
    for line in BufReader::new(stdout).lines() {
        let line = line?;
        if let Some(m) = line.strip_prefix("metrics on http://") {
            metrics = Some(m.trim_end_matches("/metrics").parse::<SocketAddr>()?);
        }
        if let Some(a) = line.strip_prefix("listening on ") {
            data = Some(a.trim().to_owned());
        }
        // The address comes first, what was said while starting after it.
        if line.starts_with("serving until stopped") {
            break;
        }
    }
    let data = data.context("ferry serve printed no address")?;
    let metrics = metrics.context("ferry serve printed no metrics address")?;
    let (code, body) = get(metrics, "/metrics")?;
    assert_eq!(code, 200, "{body}");

    // Prometheus, scraping it every second.
    let dir = tempfile::tempdir()?;
    let config = dir.path().join("prometheus.yml");
    std::fs::write(
        &config,
        format!(
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n\
             scrape_configs:\n  - job_name: ferry\n    static_configs:\n      \
             - targets: ['{metrics}']\n"
        ),
    )?;
    let web: SocketAddr = format!("127.0.0.1:{}", free_port()?).parse()?;
    let prometheus = Reaped(
        Command::new(bin)
            .arg(format!("--config.file={}", config.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.path().join("data").display()
            ))
            .arg(format!("--web.listen-address={web}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .context("starting prometheus")?,
    );

    // A bench reading from the server for longer than the test can wait.
    let bench = Reaped(
        Command::new(env!("CARGO_BIN_EXE_ferry"))
            .args(["bench", &data, "--op", "read", "--op-size", "1MiB"])
            .args(["--duration", "300", "--json"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .context("starting ferry bench")?,
    );

    // Until Prometheus has scraped twice within the window while bytes moved.
    let query = "rate(ferry_served_bytes_total{op=\"read\"}[10s])";
    let path = format!("/api/v1/query?query={}", encode(query));
    let t0 = Instant::now();
    let mut last = String::from("(no answer yet)");
    let rate = loop {
        if t0.elapsed() > Duration::from_secs(120) {
            bail!("no positive {query} within 120 s; last answer: {last}");
        }
        if let Ok((200, body)) = get(web, &path) {
            let v: serde_json::Value = serde_json::from_str(&body)?;
            let rate = v["data"]["result"]
                .as_array()
                .and_then(|r| r.first())
                .and_then(|s| s["value"][1].as_str())
                .and_then(|x| x.parse::<f64>().ok());
            last = body;
            if let Some(r) = rate.filter(|r| *r > 0.0) {
                break r;
            }
        }
        // Prometheus answers only at its next scrape and evaluation: ask again shortly.
        std::thread::sleep(Duration::from_millis(250));
    };
    println!("prometheus: {query} = {rate:.0} bytes/s; answer: {last}");
    // The same series straight from the server: the counter Prometheus saw moving.
    let (_, body) = get(metrics, "/metrics")?;
    let served = body
        .lines()
        .find_map(|l| l.strip_prefix("ferry_served_bytes_total{op=\"read\"} "))
        .context("no ferry_served_bytes_total{op=\"read\"} in a scrape")?;
    assert!(served.parse::<f64>()? > 0.0, "{served}");
    drop(bench);
    drop(prometheus);
    drop(serve);
    Ok(())
}
