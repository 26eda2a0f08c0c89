//! `stress soak`: a mixed workload against a server child for a while, every byte checked, with
//! resources compared before and after.
//!
//! Workers (half of them behind a fault proxy) each loop: build an engine, connect, run twenty
//! random steps, drop it all (connects and disconnects). A step READs one to three ranges of the
//! newest read-only segment (each holds a known pattern; one retired meanwhile sends the worker
//! to connect afresh) and checks every completed op's bytes,
//! or WRITEs a fresh pattern into the worker's own slice of `scratch`, READs it back and checks
//! it; a failed WRITE whose remote effect is `None` must have left the slice as it was (checked
//! on the next read-back). Local buffers are registered per few steps and retired. Meanwhile
//! this thread registers a new read-only segment on the server every half second and retires
//! old ones, and switches a random proxy fault (cut, reset, half-close, stall, trickle) on for
//! a moment every second.
//!
//! The run is a warm-up (a fifth, 3 to 30 s) and the main part. After each, every client is
//! closed, the server retires all but `scratch` and both processes are counted once they
//! settle. It fails if any byte is wrong, if a live registration is left, if descriptors or
//! threads at the end exceed those after warm-up, or if resident memory at the end exceeds the
//! warm-up's peak by more than [`RSS_SLACK`] (a fifth, at least 32 MiB): the allocator keeps
//! what a busy moment took, so a leak shows as growth past what the warm-up ever needed.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Result, bail, ensure};
use ferry::{
    Access, Batch, FailureKind, MemoryRegion, Outcome, RemoteEffect, RemoteStatus, TransferEngine,
};
use ferry_tests::proxy::{Dir, Fault, FaultProxy, Scope};
use ferry_tests::{Census, pattern};
use rand::Rng;

use crate::Args;
use crate::server::{SCRATCH, Server};

/// Resident memory at the end may exceed the warm-up's peak by this fraction, or by 32 MiB if
/// more.
const RSS_SLACK: f64 = 0.2;
const RO_LEN: u64 = 4 << 20;
/// The most of `scratch` one worker writes and reads back at a time.
const SLICE: u64 = 2 << 20;

#[derive(Debug, Default)]
struct Tally {
    ops: AtomicU64,
    bytes_checked: AtomicU64,
    connects: AtomicU64,
    connect_failures: AtomicU64,
    local_registrations: AtomicU64,
    failures: Mutex<HashMap<String, u64>>,
    wrong: Mutex<Vec<String>>,
}

impl Tally {
    fn failed(&self, o: &Outcome) {
        if let Some(f) = o.failure {
            *self
                .failures
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .entry(f.kind.to_string())
                .or_default() += 1;
        }
    }

    fn wrong(&self, what: String) {
        eprintln!("WRONG: {what}");
        self.wrong
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(what);
    }
}

/// Runs the soak (see the module docs).
pub(crate) fn run(args: &Args) -> Result<()> {
    args.only(&["plane", "seconds", "workers"])?;
    let (data_plane, plane) = args.plane()?;
    let total = Duration::from_secs_f64(args.get("seconds", 60.0)?);
    let workers: usize = args.get::<usize>("workers", 8)?.max(1);
    let warmup = (total / 5).clamp(Duration::from_secs(3), Duration::from_secs(30));
    let mut server = Server::start(&plane)?;
    let proxy = FaultProxy::start(server.addr)?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let tally = Arc::new(Tally::default());
    let start = (server.census()?, Census::of_self()?);
    let mut peak = start;
    let mut peaks = Vec::new();
    let mut next_seed = 1u64;
    println!(
        "soak on {plane}: {workers} workers (half behind the fault proxy), warm-up {:.0}s, then {:.0}s",
        warmup.as_secs_f64(),
        total.saturating_sub(warmup).as_secs_f64()
    );
    let mut after = Vec::new();
    for (name, length) in [("warm-up", warmup), ("main", total.saturating_sub(warmup))] {
        let t = Instant::now();
        phase(
            &rt,
            &mut server,
            &proxy,
            &tally,
            data_plane,
            workers,
            length,
            &mut next_seed,
            &mut peak,
        )?;
        let (regs, _) = server.describe()?;
        ensure!(
            regs == 1,
            "after the {name} phase the server still holds {regs} registrations (only scratch \
             should be left)"
        );
        let base = after.first().copied().unwrap_or((
            Census {
                fds: u64::MAX,
                threads: u64::MAX,
                ..start.0
            },
            Census {
                fds: u64::MAX,
                threads: u64::MAX,
                ..start.1
            },
        ));
        if after.is_empty() {
            // The warm-up's figures are the reference: let closed peers go first.
            std::thread::sleep(Duration::from_secs(3));
        }
        let settle = Duration::from_secs(15);
        let (s, _) = ferry_tests::settle(base.0, settle, || server.census())?;
        let (c, _) = ferry_tests::settle(base.1, settle, Census::of_self)?;
        after.push((s, c));
        peaks.push(peak);
        eprintln!(
            "after {name} ({:.0}s): server {s}; clients {c}",
            t.elapsed().as_secs_f64()
        );
    }
    let (warm, end, warm_peak) = (after[0], after[1], peaks[0]);
    println!("| process | start | after warm-up | peak | end |");
    println!("|---|---|---|---|---|");
    for (who, s, w, p, e) in [
        ("server", start.0, warm.0, peak.0, end.0),
        ("clients + proxy", start.1, warm.1, peak.1, end.1),
    ] {
        println!("| {who} | {s} | {w} | {p} | {e} |");
    }
    println!(
        "(peak during warm-up: server {}; clients {})",
        warm_peak.0, warm_peak.1
    );
    let failures = tally.failures.lock().unwrap_or_else(|e| e.into_inner());
    println!(
        "{} ops, {:.2} GB checked byte by byte, {} connects ({} refused or cut), {} local \
         registrations, {} server registrations; failed requests by kind: {:?}; {} faults fired",
        tally.ops.load(Ordering::Relaxed),
        tally.bytes_checked.load(Ordering::Relaxed) as f64 / 1e9,
        tally.connects.load(Ordering::Relaxed),
        tally.connect_failures.load(Ordering::Relaxed),
        tally.local_registrations.load(Ordering::Relaxed),
        next_seed - 1,
        failures,
        proxy.counters().faults_fired,
    );
    let wrong = tally.wrong.lock().unwrap_or_else(|e| e.into_inner());
    let mut problems: Vec<String> = wrong.iter().take(5).cloned().collect();
    for (who, w, e, p) in [
        ("server", warm.0, end.0, warm_peak.0),
        ("clients", warm.1, end.1, warm_peak.1),
    ] {
        if e.fds > w.fds || e.threads > w.threads {
            problems.push(format!("{who}: {e} at the end against {w} after warm-up"));
        }
        let limit = (p.rss_kib as f64 * (1.0 + RSS_SLACK)).max((p.rss_kib + (32 << 10)) as f64);
        if e.rss_kib as f64 > limit {
            problems.push(format!(
                "{who}: resident memory {} KiB at the end, limit {limit:.0} KiB",
                e.rss_kib
            ));
        }
    }
    if tally.ops.load(Ordering::Relaxed) == 0 {
        problems.push("no op completed".into());
    }
    if !problems.is_empty() {
        bail!(
            "soak failed ({} wrong bytes reports): {}",
            wrong.len(),
            problems.join("; ")
        );
    }
    println!(
        "soak passed: every byte right, descriptors and threads back to the warm-up level, memory within its slack"
    );
    Ok(())
}

/// One phase: workers for `length`, with registrations and faults switched from this thread;
/// ends with every worker joined and every read-only segment retired.
#[allow(clippy::too_many_arguments)]
fn phase(
    rt: &tokio::runtime::Runtime,
    server: &mut Server,
    proxy: &FaultProxy,
    tally: &Arc<Tally>,
    data_plane: ferry::DataPlane,
    workers: usize,
    length: Duration,
    next_seed: &mut u64,
    peak: &mut (Census, Census),
) -> Result<()> {
    let mut live: Vec<u64> = Vec::new();
    let mut register = |server: &mut Server, live: &mut Vec<u64>| -> Result<()> {
        let seed = *next_seed;
        *next_seed += 1;
        ensure!(server.command(&format!("register ro-{seed} {RO_LEN} {seed}"))? == "OK");
        live.push(seed);
        while live.len() > 6 {
            ensure!(server.command(&format!("retire ro-{}", live.remove(0)))? == "OK");
        }
        Ok(())
    };
    register(server, &mut live)?;
    let stop = Arc::new(AtomicBool::new(false));
    let addrs = (server.addr, proxy.addr());
    let handles: Vec<_> = (0..workers)
        .map(|w| {
            let (tally, stop) = (tally.clone(), stop.clone());
            let addr = if w % 2 == 0 { addrs.0 } else { addrs.1 };
            rt.spawn(worker(w, workers, addr, data_plane, tally, stop))
        })
        .collect();
    let end = Instant::now() + length;
    let mut rng = rand::thread_rng();
    let mut tick = 0u64;
    while Instant::now() < end {
        std::thread::sleep(Duration::from_millis(500));
        tick += 1;
        register(server, &mut live)?;
        *peak = (peak.0.max(server.census()?), peak.1.max(Census::of_self()?));
        if tick.is_multiple_of(2) {
            let after = rng.gen_range(0..4u64 << 20);
            let dir = [Dir::ToClient, Dir::ToTarget, Dir::Both][rng.gen_range(0..3)];
            let fault = match rng.gen_range(0..5) {
                0 => Fault::Cut { after },
                1 => Fault::Reset { after },
                2 => Fault::HalfClose { after },
                3 => Fault::Stall {
                    after,
                    duration: Some(Duration::from_millis(300)),
                },
                _ => Fault::Trickle {
                    bytes_per_sec: 256 << 10,
                },
            };
            let id = proxy.inject(Scope::All, dir, fault);
            std::thread::sleep(Duration::from_millis(200));
            proxy.remove(id);
        }
    }
    stop.store(true, Ordering::Relaxed);
    for h in handles {
        rt.block_on(h)??;
    }
    proxy.kill_all();
    for seed in live {
        ensure!(server.command(&format!("retire ro-{seed}"))? == "OK");
    }
    Ok(())
}

/// A worker's loop (see the module docs).
async fn worker(
    w: usize,
    workers: usize,
    addr: std::net::SocketAddr,
    data_plane: ferry::DataPlane,
    tally: Arc<Tally>,
    stop: Arc<AtomicBool>,
) -> Result<()> {
    let slice = (SCRATCH / workers as u64).min(SLICE) & !4095;
    let base = w as u64 * slice;
    // What the worker's slice of scratch holds: the pattern seed of its last WRITE, or `None`
    // when a failed WRITE may have changed part of it.
    let mut known: Option<u64> = None;
    let mut seed_base = (w as u64 + 1) << 40;
    let timeout = Duration::from_secs(5);
    while !stop.load(Ordering::Relaxed) {
        let engine = TransferEngine::builder()
            .same_host(false)
            .data_plane(data_plane)
            .streams(2)
            .build()?;
        tally.connects.fetch_add(1, Ordering::Relaxed);
        let peer = match engine.connect(addr).await {
            Ok(p) => p,
            Err(_) => {
                tally.connect_failures.fetch_add(1, Ordering::Relaxed);
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let Some(ro) = peer
            .segments()
            .iter()
            .filter_map(|s| s.name.strip_prefix("ro-")?.parse::<u64>().ok())
            .max()
        else {
            bail!("the server publishes no read-only segment");
        };
        let (ro_seg, scratch) = (peer.segment(&format!("ro-{ro}"))?, peer.segment("scratch")?);
        let mut local = None;
        for step in 0..20 {
            if stop.load(Ordering::Relaxed) || !peer.is_alive() {
                // A fault broke the connection: a new engine connects afresh.
                break;
            }
            if step % 5 == 0 {
                // A fresh local registration now and then (the old one retires on drop).
                let region = MemoryRegion::alloc_zeroed(2 * slice as usize, 4096)?;
                local = Some(engine.register(region, Access::LOCAL, "local")?);
                tally.local_registrations.fetch_add(1, Ordering::Relaxed);
            }
            let Some(buf) = local.as_ref() else {
                continue;
            };
            let (read_ro, ranges) = {
                let mut rng = rand::thread_rng();
                let n = rng.gen_range(1..=3);
                let ranges: Vec<(u64, u64)> = (0..n)
                    .map(|_| {
                        let len =
                            [4u64 << 10, 64 << 10, 1 << 20][rng.gen_range(0..3)].min(slice / 4);
                        (rng.gen_range(0..(RO_LEN - len) / 8) * 8, len)
                    })
                    .collect();
                (rng.gen_bool(0.5), ranges)
            };
            if read_ro {
                let mut batch = Batch::new().timeout(timeout);
                let mut at = 0;
                for &(off, len) in &ranges {
                    batch = batch.read(buf, at, &ro_seg, off, len);
                    at += len;
                }
                let o = settled(&engine, batch).await?;
                tally.failed(&o);
                let retired = matches!(
                    o.failure.map(|f| f.kind),
                    Some(FailureKind::Remote(RemoteStatus::UnknownSegment))
                );
                let mut at = 0;
                for &(off, len) in ranges.iter().take(o.completed_ops) {
                    let mut got = vec![0u8; len as usize];
                    buf.region().read_at(at, &mut got)?;
                    if let Some(i) = pattern::first_mismatch(&got, ro, off) {
                        tally.wrong(format!("worker {w}: READ ro-{ro}[{off}+{len}] byte {i}"));
                    }
                    tally.bytes_checked.fetch_add(len, Ordering::Relaxed);
                    at += len;
                }
                tally
                    .ops
                    .fetch_add(o.completed_ops as u64, Ordering::Relaxed);
                if retired {
                    // The segment was retired meanwhile: connect afresh to learn a newer one.
                    break;
                }
                continue;
            }
            // WRITE a fresh pattern over the slice, then READ it back.
            seed_base += 1;
            let seed = seed_base;
            let mut bytes = vec![0u8; slice as usize];
            pattern::fill(&mut bytes, seed, 0);
            buf.region().write_at(0, &bytes)?;
            let o = settled(
                &engine,
                Batch::new()
                    .timeout(timeout)
                    .write(buf, 0, &scratch, base, slice),
            )
            .await?;
            tally.failed(&o);
            known = match (o.is_success(), o.remote_effect) {
                (true, _) => Some(seed),
                (false, RemoteEffect::None) => known,
                (false, _) => None,
            };
            let o2 = settled(
                &engine,
                Batch::new()
                    .timeout(timeout)
                    .read(buf, slice, &scratch, base, slice),
            )
            .await?;
            tally.failed(&o2);
            if o2.is_success() {
                tally.ops.fetch_add(2, Ordering::Relaxed);
                if let Some(s) = known {
                    buf.region().read_at(slice, &mut bytes)?;
                    if let Some(i) = pattern::first_mismatch(&bytes, s, 0) {
                        tally.wrong(format!(
                            "worker {w}: scratch slice byte {i} is not what the last WRITE put \
                             there (WRITE of seed {seed}: {o:?})"
                        ));
                    }
                    tally.bytes_checked.fetch_add(slice, Ordering::Relaxed);
                }
            }
        }
        drop(local);
        peer.close();
    }
    Ok(())
}

/// Runs `batch` and returns its outcome once its buffers are drained too: a chunk of a request
/// that timed out may still be moving, and the next step reuses the buffer.
async fn settled(engine: &TransferEngine, batch: Batch) -> Result<Outcome> {
    let handle = engine.submit(batch)?;
    let drained = handle.drained();
    let outcome = handle.await;
    drained.await;
    Ok(outcome)
}
