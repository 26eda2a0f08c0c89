//! `stress fanout`: one client engine opens `--peers` peers of `--streams` data streams each (to
//! one server child, connected to that many times), then every peer writes and reads back
//! 64 KiB at once. Reported: this process's threads, resident memory and descriptors idle and
//! with the peers open (the client side of a fan-out, e.g. a trainer pushing to many inference
//! hosts), how long the connects and the round of ops took, and the server child's census.

use std::time::Instant;

use anyhow::{Context, Result, ensure};
use ferry::{Access, Batch, MemoryRegion, TransferEngine};
use ferry_tests::Census;

use crate::Args;
use crate::server::{SCRATCH, Server};

const OP: u64 = 64 << 10;

/// Runs the bench (see the module docs).
pub(crate) fn run(args: &Args) -> Result<()> {
    args.only(&["plane", "peers", "streams"])?;
    let (data_plane, plane) = args.plane()?;
    let peers: usize = args.get("peers", 256)?;
    let streams: usize = args.get("streams", 4)?;
    ensure!(
        (peers as u64) * OP <= SCRATCH,
        "--peers {peers}: at most {} (64 KiB each in the server's scratch segment)",
        SCRATCH / OP
    );
    let server = Server::start(&plane)?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let engine = TransferEngine::builder()
        .same_host(false)
        .data_plane(data_plane)
        .streams(streams)
        .build()?;
    let local = engine.register(
        MemoryRegion::alloc_zeroed(peers * OP as usize, 4096)?,
        Access::LOCAL,
        "buf",
    )?;
    let idle = Census::of_self()?;
    let t = Instant::now();
    let mut open = Vec::with_capacity(peers);
    for i in 0..peers {
        open.push(
            rt.block_on(engine.connect(server.addr))
                .with_context(|| format!("peer {i} of {peers} connecting"))?,
        );
    }
    let connect_s = t.elapsed().as_secs_f64();
    let loaded = Census::of_self()?;
    let t = Instant::now();
    rt.block_on(async {
        let mut handles = Vec::with_capacity(2 * peers);
        for (i, peer) in open.iter().enumerate() {
            let remote = peer.segment("scratch")?;
            let at = i as u64 * OP;
            handles.push(engine.submit(Batch::new().write(&local, at, &remote, at, OP))?);
        }
        for h in handles {
            let o = h.await;
            ensure!(o.is_success(), "a WRITE failed: {o:?}");
        }
        let mut handles = Vec::with_capacity(peers);
        for (i, peer) in open.iter().enumerate() {
            let remote = peer.segment("scratch")?;
            let at = i as u64 * OP;
            handles.push(engine.submit(Batch::new().read(&local, at, &remote, at, OP))?);
        }
        for h in handles {
            let o = h.await;
            ensure!(o.is_success(), "a READ failed: {o:?}");
        }
        anyhow::Ok(())
    })?;
    let ops_s = t.elapsed().as_secs_f64();
    let busy = Census::of_self()?;
    let served = server.census()?;
    let io = engine.describe().data_plane_io.unwrap_or_default();
    println!(
        "{plane}: {peers} peers of {streams} streams connected in {connect_s:.2} s; a 64 KiB WRITE \
         then READ on each, all at once, in {ops_s:.3} s"
    );
    println!("| client process | threads | RSS MiB | descriptors |");
    println!("|---|---|---|---|");
    for (what, c) in [
        ("idle", idle),
        ("peers open", loaded),
        ("after the ops", busy),
    ] {
        println!(
            "| {what} | {} | {:.0} | {} |",
            c.threads,
            c.rss_kib as f64 / 1024.0,
            c.fds
        );
    }
    println!(
        "server child: {} threads, {:.0} MiB, {} descriptors; client data plane: {io}",
        served.threads,
        served.rss_kib as f64 / 1024.0,
        served.fds
    );
    drop(open);
    Ok(())
}
