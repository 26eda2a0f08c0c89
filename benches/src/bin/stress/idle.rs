//! `stress idle`: many idle clients on one server child. Each client is a control handshake and
//! one data stream attached by hand (no thread of its own in this process), then left idle. The
//! server child's threads, resident memory and descriptors are read before and with the idle
//! clients, and a new peer's first 64-byte WRITE round trip (a fresh engine each time: connect,
//! then one op, only the op timed) is measured on the idle server and again with the clients
//! connected (the median of `--probes` peers each).

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use ferry::{Access, Batch, DataPlane, MemoryRegion, TransferEngine};
use ferry_core::wire::{ControlFrame, Hello, SUPPORTED_VERSIONS, TransportOffer};
use ferry_core::{Epoch, PeerId, PeerInfo};

use crate::Args;
use crate::server::Server;

/// Runs the bench (see the module docs).
pub(crate) fn run(args: &Args) -> Result<()> {
    args.only(&["plane", "clients", "probes"])?;
    let (_, plane) = args.plane()?;
    let clients: usize = args.get("clients", 10_000)?;
    let probes: usize = args.get::<usize>("probes", 9)?.max(1);
    // This process holds a socket per client and so does the server child, which inherits the
    // limit.
    raise_open_files(clients as u64 + 256)?;
    let server = Server::start(&plane)?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let addr = server.addr;
    let offer = match plane.as_str() {
        "uring" => TransportOffer::Uring {
            streams: 1,
            port: 0,
            zero_copy: false,
        },
        _ => TransportOffer::Tcp {
            streams: 1,
            port: 0,
        },
    };
    let first_idle = rt.block_on(first_round_trips(addr, &plane, probes))?;
    let idle = server.census()?;
    let t = Instant::now();
    let mut held = Vec::with_capacity(clients);
    for i in 0..clients {
        held.push(idle_client(addr, &offer).with_context(|| format!("idle client {i}"))?);
    }
    let took = t.elapsed();
    let loaded = server.census()?;
    let first_loaded = rt.block_on(first_round_trips(addr, &plane, probes))?;
    let after = server.census()?;
    println!(
        "{plane}: {clients} idle clients attached in {:.1} s",
        took.as_secs_f64()
    );
    println!("| | threads | RSS MiB | descriptors | new peer's first 64 B round trip p50 (us) |");
    println!("|---|---|---|---|---|");
    println!(
        "| idle server | {} | {:.0} | {} | {first_idle:.0} |",
        idle.threads,
        idle.rss_kib as f64 / 1024.0,
        idle.fds
    );
    println!(
        "| {clients} idle clients | {} | {:.0} | {} | {first_loaded:.0} |",
        loaded.threads.max(after.threads),
        loaded.rss_kib.max(after.rss_kib) as f64 / 1024.0,
        loaded.fds.max(after.fds)
    );
    println!(
        "RSS per idle client: {:.1} KiB; first round trip with them / idle: {:.2}x",
        (loaded.rss_kib.saturating_sub(idle.rss_kib)) as f64 / clients as f64,
        first_loaded / first_idle
    );
    drop(held);
    Ok(())
}

/// Raises this process's limit on open descriptors (`RLIMIT_NOFILE`) to at least `want`: the
/// soft limit up to the hard one, and the hard one too where this process may (as root).
fn raise_open_files(want: u64) -> Result<()> {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes the struct it is given, which lives across the call.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } != 0 {
        return Err(std::io::Error::last_os_error()).context("getrlimit(RLIMIT_NOFILE)");
    }
    if lim.rlim_cur >= want {
        return Ok(());
    }
    let raised = libc::rlimit {
        rlim_cur: want.max(lim.rlim_cur),
        rlim_max: want.max(lim.rlim_max),
    };
    // SAFETY: setrlimit reads the struct it is given, which lives across the call.
    if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) } != 0 {
        let e = std::io::Error::last_os_error();
        bail!(
            "{want} open files needed (one per idle client on each side), the limit is {} (hard {}) and cannot be raised: {e}",
            lim.rlim_cur,
            lim.rlim_max
        );
    }
    Ok(())
}

/// One idle client: a handshake, then one data stream attached and left idle.
fn idle_client(addr: SocketAddr, offer: &TransportOffer) -> Result<TcpStream> {
    let hello = Hello {
        versions: SUPPORTED_VERSIONS,
        peer_id: PeerId::random(),
        epoch: Epoch::fresh(),
        transports: vec![offer.clone()],
        segments: vec![],
    };
    let server = ferry_transport_uring::handshake(addr, &hello, Duration::from_secs(30))?;
    let peer = PeerInfo {
        addr,
        local_id: hello.peer_id,
        local_epoch: hello.epoch,
        remote_id: server.peer_id,
        remote_epoch: server.epoch,
        offer: server
            .transports
            .first()
            .context("the server offered no transport")?
            .clone(),
        segments: server.segments,
        session: None,
        key_name: None,
        version: SUPPORTED_VERSIONS
            .common(server.versions)
            .context("no common version")?,
    };
    let attach = ferry_core::handshake::stream_attach(&peer, 0, peer.offer.code());
    let mut frame = Vec::new();
    ferry_core::handshake::attach_frame(&peer, attach)
        .encode(SUPPORTED_VERSIONS.max, &mut frame)?;
    let mut expect = Vec::new();
    ControlFrame::StreamAccept.encode(SUPPORTED_VERSIONS.max, &mut expect)?;
    let mut s = TcpStream::connect(addr)?;
    s.set_read_timeout(Some(Duration::from_secs(30)))?;
    s.write_all(&frame)?;
    let mut got = vec![0u8; expect.len()];
    s.read_exact(&mut got)?;
    if got != expect {
        bail!("the attach was not accepted");
    }
    Ok(s)
}

/// The median of `probes` new peers' first 64-byte WRITE round trips, in microseconds.
async fn first_round_trips(addr: SocketAddr, plane: &str, probes: usize) -> Result<f64> {
    let plane = DataPlane::parse(plane).context("plane")?;
    let mut times = Vec::with_capacity(probes);
    for _ in 0..probes {
        let engine = TransferEngine::builder()
            .same_host(false)
            .data_plane(plane)
            .streams(1)
            .build()?;
        let src = engine.register(MemoryRegion::alloc_zeroed(64, 4096)?, Access::LOCAL, "src")?;
        let peer = engine.connect(addr).await?;
        let seg = peer.segment("scratch")?;
        let t = Instant::now();
        let o = engine
            .submit(Batch::new().write(&src, 0, &seg, 0, 64))?
            .await;
        times.push(t.elapsed().as_secs_f64() * 1e6);
        if !o.is_success() {
            bail!("a probe's write failed: {o:?}");
        }
        drop(peer);
        engine.shutdown();
    }
    times.sort_by(f64::total_cmp);
    Ok(times[times.len() / 2])
}
