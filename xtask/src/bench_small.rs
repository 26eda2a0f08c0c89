//! `cargo xtask bench small`: small ops against their references, in one run, alternating rounds.
//!
//! Each round runs every reference just before the Ferry case it is the reference of, and every
//! row's ratio is the median (range in brackets) of its rounds' ratios; rates and round trips are
//! medians. Rows (loopback, release build of `ferry bench`, its own in-process server):
//!
//! - **64 B round trip**: `ferry bench --op-size 64 --depth 1` on the default data plane
//!   (`auto`) against a bare TCP ping-pong ([`bench_latency`](crate::bench_latency)'s); target
//!   at most 1.2x.
//! - **64 KiB ops, depth 16**: `ferry bench --op-size 64KiB --depth 16`, READ and WRITE, default
//!   data plane, against one `iperf3 -l 1M` stream; target at least 0.8x.
//! - **KV-cache batch**: one request of `--blocks` (1024) ops of `--block` (32 KiB) bytes, each at
//!   a random block-aligned offset of a 1 GiB remote segment and of a 1 GiB local buffer
//!   (`ferry bench --batch 1024 --scatter`), one request in flight, READ and WRITE, on tcp and
//!   uring, against one op of the same total bytes (32 MiB) on the same data plane; target at
//!   least 0.8x.
//! - **Mooncake**: the same batch shape through Mooncake's TCP transport
//!   (`transfer_engine_bench --protocol=tcp --batch_size=1024 --block_size=32768 --threads=1`,
//!   from the PyPI wheel `mooncake-transfer-engine-non-cuda`, installed with pip into
//!   `target/mooncake`), divided by Ferry's tcp batch of the same round. Left out with a line
//!   saying why where the wheel cannot be installed or its bench does not run (`--no-mooncake`
//!   leaves it out).
//!
//! Options: `--repeat N` (rounds, default 3), `--ops N` (64 B round trips per run, default
//! 20000), `--total BYTES` (bytes per 64 KiB and KV run, default 1GiB), `--blocks N`,
//! `--block BYTES`, `--no-mooncake`.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use anyhow::{Context, Result, bail};

use crate::util::{cargo, ensure_tool, ferry_bench_json, median, run as run_loud};

/// The Mooncake wheel (no CUDA) and the version measured.
const MOONCAKE_WHEEL: &str = "mooncake-transfer-engine-non-cuda==0.3.13.post1";

struct Opts {
    repeat: usize,
    ops: usize,
    total: u64,
    blocks: u64,
    block: u64,
    mooncake: bool,
}

fn parse(args: &[String]) -> Result<Opts> {
    let mut o = Opts {
        repeat: 3,
        ops: 20_000,
        total: 1 << 30,
        blocks: 1024,
        block: 32 << 10,
        mooncake: true,
    };
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let mut val = |name: &str| it.next().with_context(|| format!("{name} needs a value"));
        match a.as_str() {
            "--repeat" => o.repeat = val("--repeat")?.parse::<usize>()?.max(1),
            "--ops" => o.ops = val("--ops")?.parse::<usize>()?.max(100),
            "--total" => o.total = crate::util::size(val("--total")?)?,
            "--blocks" => o.blocks = val("--blocks")?.parse::<u64>()?.max(1),
            "--block" => o.block = crate::util::size(val("--block")?)?.max(1),
            "--no-mooncake" => o.mooncake = false,
            other => bail!(
                "unknown option {other} (bench small takes --repeat N, --ops N, --total BYTES, \
                 --blocks N, --block BYTES, --no-mooncake)"
            ),
        }
    }
    Ok(o)
}

/// A row: its name, its reference's name, and each round's (reference, ferry) figures.
struct Row {
    name: String,
    reference: &'static str,
    unit: &'static str,
    /// Whether lower is better (round trips): the ratio is then ferry / reference.
    lower_better: bool,
    target: Option<f64>,
    pairs: Vec<(f64, f64)>,
}

impl Row {
    fn new(name: String, reference: &'static str, unit: &'static str, target: Option<f64>) -> Self {
        Self {
            name,
            reference,
            unit,
            lower_better: unit == "us",
            target,
            pairs: Vec::new(),
        }
    }

    fn print(&self) {
        let refs: Vec<f64> = self.pairs.iter().map(|p| p.0).collect();
        let ours: Vec<f64> = self.pairs.iter().map(|p| p.1).collect();
        let ratios: Vec<f64> = self.pairs.iter().map(|(r, f)| f / r).collect();
        let lo = ratios.iter().copied().fold(f64::INFINITY, f64::min);
        let hi = ratios.iter().copied().fold(0.0, f64::max);
        let m = median(&ratios);
        let verdict = match self.target {
            Some(t) if self.lower_better => {
                if m <= t {
                    format!("meets <= {t}")
                } else {
                    format!("misses <= {t}")
                }
            }
            Some(t) if m >= t => format!("meets >= {t}"),
            Some(t) => format!("misses >= {t}"),
            None => String::new(),
        };
        println!(
            "{:<44} {:>9.3} {:>9.3} {:>4} {:>20} {}",
            self.name,
            median(&ours),
            median(&refs),
            self.unit,
            format!("{m:.2} [{lo:.2}-{hi:.2}] vs {}", self.reference),
            verdict
        );
    }
}

fn free_port() -> Result<u16> {
    let l = std::net::TcpListener::bind("127.0.0.1:0").context("finding a free port")?;
    Ok(l.local_addr()?.port())
}

/// One `iperf3 -l 1M` stream of `total` bytes; GB/s.
fn iperf3(total: u64) -> Result<f64> {
    let port = free_port()?;
    let mut server = crate::iperf3::server(port)?;
    std::thread::sleep(Duration::from_millis(300));
    let r = crate::iperf3::clients(&[port], total, &[]);
    let _ = server.kill();
    let _ = server.wait();
    let (bytes, seconds) = r?;
    if seconds <= 0.0 {
        bail!("iperf3 reported no time");
    }
    Ok(bytes / seconds / 1e9)
}

/// GB/s of one `ferry bench` run.
fn ferry_gbps(args: &[&str]) -> Result<f64> {
    ferry_bench_json(args, "gb_per_s")
}

/// Mooncake's bench: its binary, installed from PyPI when missing.
fn mooncake_bench() -> Result<PathBuf> {
    let dir = crate::util::target_dir().join("mooncake");
    let bin = dir.join("mooncake/transfer_engine_bench");
    if bin.exists() {
        return Ok(bin);
    }
    let out = Command::new("python3")
        .args(["-m", "pip", "install", "--quiet", "--no-deps", "--target"])
        .arg(&dir)
        .arg(MOONCAKE_WHEEL)
        .output()
        .context("running python3 -m pip")?;
    if !out.status.success() {
        bail!(
            "pip install {MOONCAKE_WHEEL} failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    if !bin.exists() {
        bail!("{MOONCAKE_WHEEL} has no {}", bin.display());
    }
    Ok(bin)
}

/// A Mooncake target (server) process, killed on drop.
struct MooncakeTarget(Child, u16);

impl Drop for MooncakeTarget {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts `transfer_engine_bench --mode=target` with P2P handshakes (no etcd) and a 1 GiB
/// buffer, and reads the handshake port it logs.
fn mooncake_target(bin: &PathBuf) -> Result<MooncakeTarget> {
    let log = crate::util::target_dir().join("mooncake/target.log");
    let file = std::fs::File::create(&log).context("mooncake target log")?;
    let port = free_port()?;
    let child = Command::new(bin)
        .args([
            "--mode=target",
            "--protocol=tcp",
            "--metadata_server=P2PHANDSHAKE",
            "--buffer_size=1073741824",
        ])
        .arg(format!("--local_server_name=127.0.0.1:{port}"))
        .stdout(Stdio::null())
        .stderr(file)
        .spawn()
        .context("starting transfer_engine_bench --mode=target")?;
    let mut target = MooncakeTarget(child, 0);
    for _ in 0..100 {
        std::thread::sleep(Duration::from_millis(100));
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        let key = "listening on 127.0.0.1:";
        if let Some(at) = text.find(key) {
            let digits: String = text[at + key.len()..]
                .chars()
                .take_while(char::is_ascii_digit)
                .collect();
            target.1 = digits.parse().context("mooncake handshake port")?;
            return Ok(target);
        }
    }
    bail!(
        "the Mooncake target logged no handshake port ({})",
        log.display()
    )
}

/// GB/s of one Mooncake initiator run against `target`: `op` batches of `blocks` x `block`.
fn mooncake(bin: &PathBuf, target: &MooncakeTarget, op: &str, o: &Opts) -> Result<f64> {
    let port = free_port()?;
    let out = Command::new(bin)
        .args([
            "--mode=initiator",
            "--protocol=tcp",
            "--metadata_server=P2PHANDSHAKE",
            "--threads=1",
            "--duration=3",
            "--buffer_size=1073741824",
            "--report_unit=GB",
        ])
        .arg(format!("--local_server_name=127.0.0.1:{port}"))
        .arg(format!("--segment_id=127.0.0.1:{}", target.1))
        .arg(format!("--operation={op}"))
        .arg(format!("--block_size={}", o.block))
        .arg(format!("--batch_size={}", o.blocks))
        .output()
        .context("running transfer_engine_bench --mode=initiator")?;
    let text = String::from_utf8_lossy(&out.stderr);
    let key = "throughput ";
    let at = text
        .rfind(key)
        .with_context(|| format!("Mooncake's bench printed no throughput: {text}"))?;
    let num: String = text[at + key.len()..]
        .chars()
        .take_while(|c| c.is_ascii_digit() || *c == '.')
        .collect();
    num.parse()
        .with_context(|| format!("Mooncake throughput {num:?}"))
}

/// Runs the bench.
pub(crate) fn run(args: &[String]) -> Result<()> {
    let o = parse(args)?;
    ensure_tool("iperf3", "iperf3")?;
    run_loud(cargo().args(["build", "--release", "-p", "ferry-engine-cli"]))?;
    let mut planes = vec!["tcp"];
    match ferry_gbps(&["--transport", "uring", "--total", "1MiB"]) {
        Ok(_) => planes.push("uring"),
        Err(e) => println!("the uring rows are left out: {e:#}"),
    }
    let moon = if o.mooncake {
        match mooncake_bench().and_then(|b| mooncake_target(&b).map(|t| (b, t))) {
            Ok(m) => Some(m),
            Err(e) => {
                println!("the Mooncake rows are left out: {e:#}");
                None
            }
        }
    } else {
        None
    };
    let mut table = Table::new(&o, &planes);
    for round in 0..o.repeat {
        eprintln!("== bench small: round {} of {}", round + 1, o.repeat);
        table.round(&o, moon.as_ref())?;
    }
    table.print(&o, moon.is_some());
    Ok(())
}

/// The rows of one bench, filled a round at a time.
struct Table {
    /// 64 B round trips against the TCP ping-pong.
    rtt: Row,
    /// 64 KiB reads and writes against iperf3.
    small: Vec<Row>,
    /// `(plane, op, row)`: the scattered KV batches against one op of their bytes.
    kv: Vec<(&'static str, &'static str, Row)>,
    /// `(op, row)`: Mooncake's batches against Ferry's tcp batch.
    moon: Vec<(&'static str, Row)>,
}

impl Table {
    /// The rows for `o`, with KV rows for each of `planes`.
    fn new(o: &Opts, planes: &[&'static str]) -> Table {
        let rtt = Row::new(
            "64 B round trip, auto (p50)".into(),
            "TCP ping-pong",
            "us",
            Some(1.2),
        );
        let small = ["read", "write"]
            .iter()
            .map(|op| {
                Row::new(
                    format!("64 KiB {op}s, depth 16, auto"),
                    "iperf3 1M",
                    "GB/s",
                    Some(0.8),
                )
            })
            .collect();
        let mut kv = Vec::new();
        for plane in planes {
            for op in ["read", "write"] {
                kv.push((
                    *plane,
                    op,
                    Row::new(
                        format!(
                            "{} x {} KiB scattered {op}s, {plane}",
                            o.blocks,
                            o.block >> 10
                        ),
                        "one op",
                        "GB/s",
                        Some(0.8),
                    ),
                ));
            }
        }
        let moon = ["read", "write"]
            .iter()
            .map(|op| {
                (
                    *op,
                    Row::new(
                        format!("Mooncake tcp, {} x {} KiB {op}s", o.blocks, o.block >> 10),
                        "ferry tcp batch",
                        "GB/s",
                        None,
                    ),
                )
            })
            .collect();
        Table {
            rtt,
            small,
            kv,
            moon,
        }
    }

    /// One round: each row's reference just before its Ferry case (Mooncake's after Ferry's
    /// tcp batch, its reference).
    fn round(&mut self, o: &Opts, moon: Option<&(PathBuf, MooncakeTarget)>) -> Result<()> {
        let total = o.total.to_string();
        let batch_bytes = o.blocks * o.block;
        let (blocks, block, whole) = (
            o.blocks.to_string(),
            o.block.to_string(),
            batch_bytes.to_string(),
        );
        // At least two requests per KV run.
        let kv_total = o.total.max(2 * batch_bytes).to_string();
        let p = crate::bench_latency::ping_pong(o.ops)?;
        self.rtt
            .pairs
            .push((p, crate::bench_latency::ferry(o.ops, &[])?));
        for (row, op) in self.small.iter_mut().zip(["read", "write"]) {
            let i = iperf3(o.total)?;
            let f = ferry_gbps(&[
                "--op",
                op,
                "--op-size",
                "64KiB",
                "--depth",
                "16",
                "--total",
                &total,
            ])?;
            row.pairs.push((i, f));
        }
        let mut tcp_batch = [0.0f64; 2];
        for (plane, op, row) in &mut self.kv {
            let common = [
                "--transport",
                plane,
                "--op",
                op,
                "--segment-size",
                "1GiB",
                "--depth",
                "1",
                "--total",
                &kv_total,
            ];
            let one = ferry_gbps(&[&common[..], &["--op-size", &whole]].concat())?;
            let scattered = ferry_gbps(
                &[
                    &common[..],
                    &["--op-size", &block, "--batch", &blocks, "--scatter"],
                ]
                .concat(),
            )?;
            if *plane == "tcp" {
                tcp_batch[usize::from(*op == "write")] = scattered;
            }
            row.pairs.push((one, scattered));
        }
        if let Some((bin, target)) = moon {
            for (i, (op, row)) in self.moon.iter_mut().enumerate() {
                row.pairs
                    .push((tcp_batch[i], mooncake(bin, target, op, o)?));
            }
        }
        Ok(())
    }

    /// The table, with the Mooncake rows where `moon` ran.
    fn print(&self, o: &Opts, moon: bool) {
        println!(
            "loopback, {} rounds; figures are medians, ratios the median [range] of each round's \
             ratio to the reference run just before it; GB/s = 10^9 B/s",
            o.repeat
        );
        println!(
            "{:<44} {:>9} {:>9} {:>4} {:>20}",
            "case", "ferry", "reference", "", "ratio"
        );
        self.rtt.print();
        for r in &self.small {
            r.print();
        }
        for (_, _, r) in &self.kv {
            r.print();
        }
        if moon {
            println!("(Mooncake rows: 'ferry' is Mooncake, the reference Ferry's tcp batch)");
            for (_, r) in &self.moon {
                r.print();
            }
        }
    }
}
