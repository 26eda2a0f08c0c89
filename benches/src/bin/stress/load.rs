//! `stress load`: a few hundred peers, each an engine with one data stream, run closed loops of
//! one op at a time against one server child: a quarter 1 MiB ops, the rest 4 KiB, half READs
//! and half WRITEs. In alternating windows a few more peers, behind a fault proxy that stops
//! forwarding after 64 KiB in each direction without closing anything, each submit eight 1 MiB
//! READs or WRITEs and hang: the server is left with sends nobody reads and payloads that never
//! come. Reported: the healthy peers' ops/s and p50/p99 latency with and without the stalled
//! ones (the ratio per round; rounds alternate which window comes first, so drift hits both
//! alike), and the server's resident
//! memory, descriptors and threads idle, at peak and at the end.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use ferry::{Access, Batch, DataPlane, MemoryRegion, RequestHandle, TransferEngine};
use ferry_tests::proxy::{Dir, Fault, FaultProxy, Scope};

use crate::server::{SCRATCH, Server};
use crate::{Args, quantile};

const SMALL: u64 = 4 << 10;
const LARGE: u64 = 1 << 20;
/// No window is being recorded.
const NONE: usize = usize::MAX;

/// One finished op: the window it finished in, its latency, whether it was large, whether it
/// failed.
type Sample = (usize, u32, bool, bool);

/// A client engine on the TCP data plane with one stream on the caller's runtime (cheap: a
/// few hundred of them share this process's two workers).
pub(crate) fn client() -> Result<TransferEngine> {
    Ok(TransferEngine::builder()
        .same_host(false)
        .data_plane(DataPlane::Tcp)
        .streams(1)
        .io_threads(None)
        .build()?)
}

/// Runs the bench (see the module docs).
pub(crate) fn run(args: &Args) -> Result<()> {
    args.only(&["plane", "peers", "stalled", "seconds", "rounds"])?;
    let (_, plane) = args.plane()?;
    let peers: usize = args.get("peers", 256)?;
    let stalled: usize = args.get("stalled", 16)?;
    let window = Duration::from_secs_f64(args.get("seconds", 2.0)?);
    let rounds: usize = args.get::<usize>("rounds", 6)?.max(1);
    let mut server = Server::start(&plane)?;
    let idle = server.census()?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let addr = server.addr;
    let samples: Arc<Mutex<Vec<Sample>>> = Arc::default();
    let current = Arc::new(AtomicUsize::new(NONE));
    let stop = Arc::new(AtomicBool::new(false));
    let mut peak = idle;
    let mut tasks = Vec::new();
    let t0 = Instant::now();
    for i in 0..peers {
        let engine = client()?;
        let (samples, current, stop) = (samples.clone(), current.clone(), stop.clone());
        let peer = rt
            .block_on(engine.connect(addr))
            .with_context(|| format!("peer {i} of {peers} connecting"))?;
        tasks.push(rt.spawn(async move {
            let len = if i % 4 == 0 { LARGE } else { SMALL };
            let region = MemoryRegion::alloc_zeroed(len as usize, 4096)?;
            let local = engine.register(region, Access::LOCAL, "buf")?;
            let remote = peer.segment("scratch")?;
            let at = (i as u64 * LARGE) % SCRATCH;
            let mut mine = Vec::new();
            while !stop.load(Ordering::Relaxed) {
                let batch = if i % 2 == 0 {
                    Batch::new().read(&local, 0, &remote, at, len)
                } else {
                    Batch::new().write(&local, 0, &remote, at, len)
                };
                let start = Instant::now();
                let outcome = engine.submit(batch)?.await;
                let w = current.load(Ordering::Relaxed);
                if w != NONE {
                    let us = start.elapsed().as_micros().min(u32::MAX as u128) as u32;
                    mine.push((w, us, len == LARGE, !outcome.is_success()));
                }
            }
            samples
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .extend(mine);
            drop(peer);
            anyhow::Ok(())
        }));
    }
    let connect_s = t0.elapsed().as_secs_f64();
    let proxy = FaultProxy::start(addr)?;
    for dir in [Dir::ToClient, Dir::ToTarget] {
        proxy.inject(
            Scope::All,
            dir,
            Fault::Stall {
                after: 64 << 10,
                duration: None,
            },
        );
    }
    std::thread::sleep(window); // warm-up, not recorded
    for r in 0..rounds {
        // ABBA: every other round starts with the stalled window, so that whatever follows a
        // window change hits both kinds alike.
        let order = if r % 2 == 0 {
            [false, true]
        } else {
            [true, false]
        };
        for with_stalled in order {
            let hung = if with_stalled {
                rt.block_on(stall(stalled, &proxy))?
            } else {
                Vec::new()
            };
            // Before either kind of window, a pause that is not recorded: the stalled peers get
            // stuck, those of the last window finish going.
            std::thread::sleep(Duration::from_millis(500));
            current.store(2 * r + usize::from(with_stalled), Ordering::Relaxed);
            std::thread::sleep(window);
            current.store(NONE, Ordering::Relaxed);
            peak = peak.max(server.census()?);
            for (h, _, _) in &hung {
                h.cancel();
            }
            drop(hung);
            proxy.kill_all();
        }
    }
    let (_, io) = server.describe()?;
    stop.store(true, Ordering::Relaxed);
    for t in tasks {
        rt.block_on(t)??;
    }
    drop(proxy);
    let (end, _) = ferry_tests::settle(idle, Duration::from_secs(10), || server.census())?;
    report(
        &plane,
        peers,
        stalled,
        window,
        rounds,
        &samples.lock().unwrap_or_else(|e| e.into_inner()),
        connect_s,
    );
    println!("server: idle {idle}; peak {peak}; end (peers closed) {end}");
    println!("server data plane: {io}");
    Ok(())
}

/// Starts `n` peers through `proxy` whose requests hang (see the module docs).
async fn stall(
    n: usize,
    proxy: &FaultProxy,
) -> Result<Vec<(RequestHandle, ferry::Peer, TransferEngine)>> {
    let mut hung = Vec::new();
    for i in 0..n {
        let engine = client()?;
        let peer = engine.connect(proxy.addr()).await?;
        let local = engine.register(
            MemoryRegion::alloc_zeroed((8 * LARGE) as usize, 4096)?,
            Access::LOCAL,
            "stalled",
        )?;
        let remote = peer.segment("scratch")?;
        let mut batch = Batch::new().timeout(Duration::from_secs(3600));
        for k in 0..8 {
            let at = ((i as u64 * 8 + k) * LARGE) % SCRATCH;
            batch = if i % 2 == 0 {
                batch.read(&local, k * LARGE, &remote, at, LARGE)
            } else {
                batch.write(&local, k * LARGE, &remote, at, LARGE)
            };
        }
        hung.push((engine.submit(batch)?, peer, engine));
    }
    Ok(hung)
}

fn report(
    plane: &str,
    peers: usize,
    stalled: usize,
    window: Duration,
    rounds: usize,
    samples: &[Sample],
    connect_s: f64,
) {
    let secs = window.as_secs_f64();
    println!(
        "plane {plane}: {peers} peers ({} of 1 MiB, {} of 4 KiB; half READ, half WRITE; one op in \
         flight each), connected in {connect_s:.1}s; {stalled} stalled peers in every other \
         window; {rounds} rounds of two {secs:.1}s windows",
        peers.div_ceil(4),
        peers - peers.div_ceil(4)
    );
    println!(
        "| windows | healthy ops/s | 4 KiB p50 / p99 (us) | 1 MiB p50 / p99 (us) | failed ops |"
    );
    println!("|---|---|---|---|---|");
    let mut ratios = Vec::new();
    for (name, parity) in [("without stalled peers", 0), ("with stalled peers", 1)] {
        let of = |large: bool| {
            let mut v: Vec<u32> = samples
                .iter()
                .filter(|s| s.0 % 2 == parity && s.2 == large)
                .map(|s| s.1)
                .collect();
            v.sort_unstable();
            format!("{} / {}", quantile(&v, 0.5), quantile(&v, 0.99))
        };
        let n = samples.iter().filter(|s| s.0 % 2 == parity).count();
        let failed = samples.iter().filter(|s| s.0 % 2 == parity && s.3).count();
        println!(
            "| {name} | {:.0} | {} | {} | {failed} |",
            n as f64 / (secs * rounds as f64),
            of(false),
            of(true)
        );
    }
    for r in 0..rounds {
        let count = |w: usize| samples.iter().filter(|s| s.0 == w).count() as f64;
        if count(2 * r) > 0.0 {
            ratios.push(count(2 * r + 1) / count(2 * r));
        }
    }
    let each: Vec<String> = ratios.iter().map(|r| format!("{r:.2}")).collect();
    ratios.sort_by(f64::total_cmp);
    if let (Some(lo), Some(hi)) = (ratios.first(), ratios.last()) {
        println!(
            "healthy ops/s with stalled peers / without, per round: median {:.2} [{lo:.2}-{hi:.2}] \
             (rounds in order: {})",
            ratios[ratios.len() / 2],
            each.join(" ")
        );
    }
}
