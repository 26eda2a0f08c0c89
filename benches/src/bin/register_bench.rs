//! What `register` costs: for each data plane (TCP, io_uring) and, where this machine has RDMA
//! ports, for each number of rails, the time of a first registration of a buffer of each size,
//! of a repeat of the same pages while the first is held (the registration cache), and the
//! first's cost per GiB. Buffers are written before they are timed (registered weights exist
//! already), and the median of `--repeat` rounds is printed as a Markdown table. Run it with
//! `cargo xtask bench register`, or:
//!
//! ```text
//! cargo run --release -p ferry-benches --bin register_bench -- [--sizes 64MiB,1GiB] [--repeat N]
//! ```

use std::time::Instant;

use anyhow::{Context, Result, bail};
use ferry::{Access, DataPlane, MemoryRegion, TransferEngine};

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn parse_size(s: &str) -> Result<u64> {
    let (num, unit) = s.trim().split_at(
        s.trim()
            .find(|c: char| !c.is_ascii_digit())
            .unwrap_or(s.trim().len()),
    );
    let n: u64 = num.parse().with_context(|| format!("size {s:?}"))?;
    let mult = match unit {
        "" | "B" => 1,
        "KiB" => 1 << 10,
        "MiB" => 1 << 20,
        "GiB" => 1 << 30,
        other => bail!("size {s:?}: unit {other:?} (B, KiB, MiB, GiB)"),
    };
    Ok(n * mult)
}

/// Microseconds of the first registration and of a repeat of the same pages, median of
/// `repeat` rounds.
fn measure(engine: &TransferEngine, size: u64, repeat: usize) -> Result<(f64, f64)> {
    let region = std::sync::Arc::new(MemoryRegion::alloc_zeroed(size as usize, 4096)?);
    // Touch every page: registered weights exist already; a page fault is not registration.
    let page = vec![1u8; 4096];
    let mut at = 0;
    while at < size {
        region.write_at(at, &page[..(size - at).min(4096) as usize])?;
        at += 4096;
    }
    let (mut first, mut again) = (Vec::new(), Vec::new());
    for _ in 0..repeat {
        let t = Instant::now();
        let a = engine.register(region.clone(), Access::REMOTE_READ, "w")?;
        first.push(t.elapsed().as_secs_f64() * 1e6);
        let t = Instant::now();
        let b = engine.register(region.clone(), Access::REMOTE_READ, "w2")?;
        again.push(t.elapsed().as_secs_f64() * 1e6);
        drop(b);
        drop(a);
    }
    Ok((median(&mut first), median(&mut again)))
}

fn row(what: &str, size: u64, (first, again): (f64, f64)) {
    let gib = size as f64 / (1u64 << 30) as f64;
    println!(
        "| {what} | {} MiB | {first:.1} | {again:.1} | {:.1} |",
        size >> 20,
        first / gib
    );
}

#[tokio::main]
async fn main() -> Result<()> {
    let mut sizes = vec![64 << 20, 1 << 30];
    let mut repeat = 5;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--sizes" => {
                sizes = args
                    .next()
                    .context("--sizes needs a value")?
                    .split(',')
                    .map(parse_size)
                    .collect::<Result<_>>()?;
            }
            "--repeat" => repeat = args.next().context("--repeat needs a value")?.parse()?,
            other => bail!("unknown argument {other:?}"),
        }
    }
    println!("| registration | size | first (us) | repeat, first held (us) | first per GiB (us) |");
    println!("|---|---|---|---|---|");
    for (name, plane) in [("tcp", DataPlane::Tcp), ("uring", DataPlane::Uring)] {
        let engine = match TransferEngine::builder().data_plane(plane).build() {
            Ok(e) => e,
            Err(e) => {
                println!("| {name} | | not measured: {e} | | |");
                continue;
            }
        };
        for &size in &sizes {
            row(
                &format!("host memory, {name}"),
                size,
                measure(&engine, size, repeat)?,
            );
        }
    }
    // RDMA: every usable port, then the first k rails for each k.
    let all = match TransferEngine::builder()
        .rdma(ferry::RdmaConfig::default())
        .build()
    {
        Ok(e) => e,
        Err(e) => {
            println!("| rdma | | not measured: {e} | | |");
            return Ok(());
        }
    };
    let rails: Vec<String> = all.describe().rails.into_iter().map(|r| r.rail).collect();
    drop(all);
    if rails.is_empty() {
        println!("| rdma | | not measured: the RDMA transport opened no rail | | |");
    }
    for k in 1..=rails.len() {
        let hca = rails[..k].join(",");
        let selector = ferry::topology::Selector::from_hca(&hca)
            .with_context(|| format!("selecting {hca}"))?;
        let engine = TransferEngine::builder()
            .rdma(ferry::RdmaConfig::default().selector(selector))
            .build()?;
        for &size in &sizes {
            row(
                &format!("rdma, {k} rail(s) ({hca})"),
                size,
                measure(&engine, size, repeat)?,
            );
        }
    }
    Ok(())
}
