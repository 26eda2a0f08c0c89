//! Reconnect and replay, through a [`FaultProxy`] between a client engine and a server engine,
//! on both portable data planes (io_uring cases skip where the kernel refuses it): a connection
//! reset in the middle of a large READ is replayed and the READ completes with the right bytes;
//! a server restarted as a new incarnation on the same port is refused (`StaleEpoch`) and nothing
//! is replayed into it; a WRITE cut midway is replayed only when the policy allows; a stall that
//! never ends is ended by the request's deadline with an exact prefix, and so are reconnect
//! attempts to a server gone for good; and many clients that lose the same server reconnect once
//! each, however many requests each had waiting. GPU memory staged through pinned buffers (the
//! fake CUDA driver) is replayed the same way: a reset mid-READ into a GPU completes with the
//! right bytes, and a cut staged WRITE is replayed only when the policy allows.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use ferry::{
    Access, Batch, DataPlane, FailureKind, MemoryRegion, Peer, ReconnectPolicy, Registration,
    RemoteEffect, RemoteStatus, RouteDescription, TransferEngine,
};
use ferry_tests::{
    Dir, FakeCuda, FakeVariant, Fault, FaultProxy, Scope, URING, fake_cuda, require_or_skip,
};

const MIB: u64 = 1 << 20;

#[derive(Clone, Copy, Debug)]
enum Plane {
    Tcp,
    Uring,
}

impl Plane {
    fn data_plane(self) -> DataPlane {
        match self {
            Plane::Tcp => DataPlane::Tcp,
            Plane::Uring => DataPlane::Uring,
        }
    }

    /// Whether the plane can run here (io_uring: the kernel allows it, or the test skips, or
    /// fails under `FERRY_REQUIRE_URING=1`).
    fn usable(self) -> bool {
        match self {
            Plane::Tcp => true,
            Plane::Uring => match ferry::probe_kernel().unusable_reason() {
                None => true,
                Some(why) => {
                    require_or_skip(URING, format!("io_uring unusable here: {why}"));
                    false
                }
            },
        }
    }
}

/// Reconnects quickly (tests wait on them).
fn policy(replay_writes: bool) -> ReconnectPolicy {
    ReconnectPolicy {
        attempts: 8,
        backoff_base: Duration::from_millis(10),
        backoff_max: Duration::from_millis(200),
        replay_writes,
    }
}

fn pattern(len: u64, seed: u64) -> Vec<u8> {
    let mut x = seed | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

fn region_with(data: &[u8]) -> Result<MemoryRegion> {
    let r = MemoryRegion::alloc_zeroed(data.len(), 4096)?;
    r.write_at(0, data)?;
    Ok(r)
}

fn bytes(reg: &Registration, at: u64, len: u64) -> Result<Vec<u8>> {
    let mut v = vec![0u8; len as usize];
    reg.region().read_at(at, &mut v)?;
    Ok(v)
}

/// A server engine serving `src` (readable and writable) on `listen`.
fn server(plane: Plane, listen: SocketAddr, src: &[u8]) -> Result<(TransferEngine, Registration)> {
    let engine = TransferEngine::builder()
        .same_host(false)
        .data_plane(plane.data_plane())
        .listen(listen)
        .build()?;
    let reg = engine.register(
        region_with(src)?,
        Access::REMOTE_READ | Access::REMOTE_WRITE,
        "src",
    )?;
    Ok((engine, reg))
}

/// A server, a proxy in front of it, and a client engine connected through the proxy.
struct Rig {
    server: TransferEngine,
    src: Registration,
    data: Vec<u8>,
    proxy: FaultProxy,
    client: TransferEngine,
    peer: Peer,
}

async fn rig(plane: Plane, len: u64, policy: ReconnectPolicy) -> Result<Rig> {
    rig_with(plane, len, policy, None).await
}

/// As [`rig`], the client with GPU support on the fake CUDA driver `gpu` when given (staging
/// buffers of 1 MiB, so that a few MiB make several chunks).
async fn rig_with(
    plane: Plane,
    len: u64,
    policy: ReconnectPolicy,
    gpu: Option<&FakeCuda>,
) -> Result<Rig> {
    let data = pattern(len, 0x5eed ^ len);
    let (server, src) = server(plane, "127.0.0.1:0".parse()?, &data)?;
    let proxy = FaultProxy::start(server.local_addr().context("listen")?)?;
    let mut client = TransferEngine::builder()
        .same_host(false)
        .data_plane(plane.data_plane())
        .reconnect(policy);
    if let Some(fake) = gpu {
        client = client
            .cuda(ferry::cuda::Cuda::open(fake.path().as_os_str())?)
            .staging_buffers(4, MIB as usize);
    }
    let client = client.build()?;
    let peer = client.connect(proxy.addr()).await?;
    Ok(Rig {
        server,
        src,
        data,
        proxy,
        client,
        peer,
    })
}

fn route(engine: &TransferEngine) -> Result<RouteDescription> {
    let routes = engine.describe().routes;
    ensure!(routes.len() == 1, "one route expected: {routes:?}");
    Ok(routes[0].clone())
}

/// Stalls every connection's `dir` after `after` bytes, waits until one stalled (the request is
/// then certainly in the middle), and resets every connection: the request's bytes in flight are
/// lost. The stall is lifted right after, so reconnections flow.
async fn reset_midway(proxy: &FaultProxy, dir: Dir, after: u64) -> Result<()> {
    let stall = proxy.inject(
        Scope::All,
        dir,
        Fault::Stall {
            after,
            duration: None,
        },
    );
    let fired = proxy.counters().faults_fired;
    let deadline = Instant::now() + Duration::from_secs(60);
    while proxy.counters().faults_fired == fired {
        ensure!(Instant::now() < deadline, "the stall never began");
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    proxy.kill_all();
    proxy.remove(stall);
    Ok(())
}

async fn read_reset_midway(plane: Plane) -> Result<()> {
    if !plane.usable() {
        return Ok(());
    }
    let len = 64 * MIB;
    let r = rig(plane, len, policy(false)).await?;
    let dst = r.client.register(
        MemoryRegion::alloc_zeroed(len as usize, 4096)?,
        Access::LOCAL,
        "dst",
    )?;
    let seg = r.peer.segment("src")?;
    let handle = r.client.submit(Batch::new().read(&dst, 0, &seg, 0, len))?;
    reset_midway(&r.proxy, Dir::ToClient, 8 * MIB).await?;
    let o = handle.await;
    ensure!(o.is_success(), "{o:?}");
    ensure!(
        bytes(&dst, 0, len)? == r.data,
        "bytes differ after the replay"
    );
    let route = route(&r.client)?;
    ensure!(route.replays >= 1, "{route:?}");
    ensure!(route.replayed_bytes >= len, "{route:?}");
    ensure!(route.reconnects >= 1, "{route:?}");
    ensure!(route.reconnect_failures == 0, "{route:?}");
    let shown = r.client.describe().to_string();
    ensure!(shown.contains("replays"), "{shown}");
    drop(r.server);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reset_mid_read_is_replayed_over_tcp() -> Result<()> {
    read_reset_midway(Plane::Tcp).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reset_mid_read_is_replayed_over_uring() -> Result<()> {
    read_reset_midway(Plane::Uring).await
}

/// One connection reset after N bytes (the proxy's "cut at byte N", once).
async fn read_cut_at_byte_n(plane: Plane) -> Result<()> {
    if !plane.usable() {
        return Ok(());
    }
    let len = 32 * MIB;
    let r = rig(plane, len, policy(false)).await?;
    let dst = r.client.register(
        MemoryRegion::alloc_zeroed(len as usize, 4096)?,
        Access::LOCAL,
        "dst",
    )?;
    let seg = r.peer.segment("src")?;
    r.proxy.inject_once(
        Scope::All,
        Dir::ToClient,
        Fault::Reset { after: 5 * MIB + 7 },
    );
    let o = r
        .client
        .submit(Batch::new().read(&dst, 0, &seg, 0, len))?
        .await;
    ensure!(o.is_success(), "{o:?}");
    ensure!(
        bytes(&dst, 0, len)? == r.data,
        "bytes differ after the replay"
    );
    ensure!(r.proxy.counters().faults_fired == 1);
    let route = route(&r.client)?;
    ensure!(route.replays >= 1, "{route:?}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cut_at_byte_n_is_replayed_over_tcp() -> Result<()> {
    read_cut_at_byte_n(Plane::Tcp).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cut_at_byte_n_is_replayed_over_uring() -> Result<()> {
    read_cut_at_byte_n(Plane::Uring).await
}

/// The server restarts (a new epoch) on the same port while a READ is cut: the reconnect is
/// refused with `StaleEpoch`, the request fails with it, and nothing is replayed.
async fn new_epoch_is_refused(plane: Plane) -> Result<()> {
    if !plane.usable() {
        return Ok(());
    }
    let len = 32 * MIB;
    let r = rig(plane, len, policy(true)).await?;
    let addr = r.server.local_addr().context("listen")?;
    let old_epoch = r.server.epoch();
    let dst = r.client.register(
        MemoryRegion::alloc_zeroed(len as usize, 4096)?,
        Access::LOCAL,
        "dst",
    )?;
    let seg = r.peer.segment("src")?;
    let handle = r.client.submit(Batch::new().read(&dst, 0, &seg, 0, len))?;
    // Stall mid-READ, restart the server behind the proxy, then cut.
    let stall = r.proxy.inject(
        Scope::All,
        Dir::ToClient,
        Fault::Stall {
            after: 4 * MIB,
            duration: None,
        },
    );
    let deadline = Instant::now() + Duration::from_secs(60);
    while r.proxy.counters().faults_fired == 0 {
        ensure!(Instant::now() < deadline, "the stall never began");
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let Rig {
        server,
        src,
        data,
        proxy,
        client,
        peer: _peer,
    } = r;
    server.shutdown();
    drop(src);
    drop(server);
    let mut restarted = None;
    for _ in 0..500 {
        match self::server(plane, addr, &data) {
            Ok(s) => {
                restarted = Some(s);
                break;
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(10)).await,
        }
    }
    let (new_server, _new_src) = restarted.context("the port was not free again")?;
    ensure!(new_server.epoch() != old_epoch);
    proxy.kill_all();
    proxy.remove(stall);
    let o = handle.await;
    let f = o
        .failure
        .context("a READ into a new incarnation must fail")?;
    ensure!(
        f.kind == FailureKind::Remote(RemoteStatus::StaleEpoch),
        "{o:?}"
    );
    ensure!(o.completed_ops == 0, "{o:?}");
    let route = route(&client)?;
    ensure!(route.replays == 0, "{route:?}");
    ensure!(route.reconnect_failures == 1, "{route:?}");
    ensure!(route.reconnects == 0, "{route:?}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_epoch_is_refused_over_tcp() -> Result<()> {
    new_epoch_is_refused(Plane::Tcp).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_epoch_is_refused_over_uring() -> Result<()> {
    new_epoch_is_refused(Plane::Uring).await
}

/// A WRITE cut midway: without `replay_writes` it ends `PeerLost` with an `Uncertain` remote
/// effect and nothing replayed; with it, it completes and the remote bytes are right.
async fn write_cut_midway(plane: Plane, replay_writes: bool) -> Result<()> {
    if !plane.usable() {
        return Ok(());
    }
    let len = 32 * MIB;
    let r = rig(plane, len, policy(replay_writes)).await?;
    let mine = pattern(len, 0x3417e);
    let local = r
        .client
        .register(region_with(&mine)?, Access::LOCAL, "local")?;
    let seg = r.peer.segment("src")?;
    let handle = r
        .client
        .submit(Batch::new().write(&local, 0, &seg, 0, len))?;
    reset_midway(&r.proxy, Dir::ToTarget, 6 * MIB).await?;
    let o = handle.await;
    let route = route(&r.client)?;
    if replay_writes {
        ensure!(o.is_success(), "{o:?}");
        ensure!(bytes(&r.src, 0, len)? == mine, "remote bytes differ");
        ensure!(route.replays >= 1, "{route:?}");
    } else {
        let f = o.failure.context("a WRITE cut midway must fail")?;
        ensure!(f.kind == FailureKind::PeerLost, "{o:?}");
        ensure!(o.remote_effect == RemoteEffect::Uncertain, "{o:?}");
        ensure!(route.replays == 0 && route.reconnects == 0, "{route:?}");
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cut_write_is_uncertain_without_replay_over_tcp() -> Result<()> {
    write_cut_midway(Plane::Tcp, false).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cut_write_is_uncertain_without_replay_over_uring() -> Result<()> {
    write_cut_midway(Plane::Uring, false).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cut_write_is_replayed_when_allowed_over_tcp() -> Result<()> {
    write_cut_midway(Plane::Tcp, true).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cut_write_is_replayed_when_allowed_over_uring() -> Result<()> {
    write_cut_midway(Plane::Uring, true).await
}

/// A proxy that stalls for ever after some bytes: the request ends by its deadline, its prefix
/// holds exactly the right bytes, and it drains once the proxy is gone.
async fn stall_forever_ends_by_deadline(plane: Plane) -> Result<()> {
    if !plane.usable() {
        return Ok(());
    }
    let ops = 16u64;
    let len = ops * MIB;
    let r = rig(plane, len, policy(true)).await?;
    let dst = r.client.register(
        MemoryRegion::alloc_zeroed(len as usize, 4096)?,
        Access::LOCAL,
        "dst",
    )?;
    let seg = r.peer.segment("src")?;
    r.proxy.inject(
        Scope::All,
        Dir::ToClient,
        Fault::Stall {
            after: 5 * MIB / 2,
            duration: None,
        },
    );
    let mut batch = Batch::new().timeout(Duration::from_secs(2));
    for i in 0..ops {
        batch = batch.read(&dst, i * MIB, &seg, i * MIB, MIB);
    }
    let handle = r.client.submit(batch)?;
    let drained = handle.drained();
    let o = tokio::time::timeout(Duration::from_secs(60), handle.outcome())
        .await
        .context("the request outlived its deadline by a minute")?;
    let f = o.failure.context("a stalled request cannot complete")?;
    ensure!(f.kind == FailureKind::Timeout, "{o:?}");
    ensure!((o.completed_ops as u64) < ops, "{o:?}");
    ensure!(o.completed_bytes == o.completed_ops as u64 * MIB, "{o:?}");
    let prefix = o.completed_bytes;
    ensure!(
        bytes(&dst, 0, prefix)? == r.data[..prefix as usize],
        "the prefix's bytes differ"
    );
    // The chunks held in the stall resolve once the proxy is gone.
    drop(r.proxy);
    let d = tokio::time::timeout(Duration::from_secs(60), drained)
        .await
        .context("never drained")?;
    ensure!(d.drained, "{d:?}");
    ensure!(d.completed_ops >= o.completed_ops, "{d:?} after {o:?}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stall_forever_ends_by_the_deadline_over_tcp() -> Result<()> {
    stall_forever_ends_by_deadline(Plane::Tcp).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stall_forever_ends_by_the_deadline_over_uring() -> Result<()> {
    stall_forever_ends_by_deadline(Plane::Uring).await
}

/// The server is gone for good while a READ is cut: reconnect attempts (a thousand allowed,
/// spaced up to 2 s) stop at the request's deadline, which ends it with its exact prefix and
/// lets it drain; the reconnect is not counted as given up.
async fn attempts_stop_at_the_deadline(plane: Plane) -> Result<()> {
    if !plane.usable() {
        return Ok(());
    }
    let len = 32 * MIB;
    let r = rig(
        plane,
        len,
        ReconnectPolicy {
            attempts: 1000,
            backoff_base: Duration::from_millis(200),
            backoff_max: Duration::from_secs(2),
            replay_writes: false,
        },
    )
    .await?;
    let dst = r.client.register(
        MemoryRegion::alloc_zeroed(len as usize, 4096)?,
        Access::LOCAL,
        "dst",
    )?;
    let seg = r.peer.segment("src")?;
    let handle = r.client.submit(
        Batch::new()
            .read(&dst, 0, &seg, 0, len)
            .timeout(Duration::from_secs(3)),
    )?;
    let stall = r.proxy.inject(
        Scope::All,
        Dir::ToClient,
        Fault::Stall {
            after: 4 * MIB,
            duration: None,
        },
    );
    let deadline = Instant::now() + Duration::from_secs(60);
    while r.proxy.counters().faults_fired == 0 {
        ensure!(Instant::now() < deadline, "the stall never began");
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    r.server.shutdown();
    drop(r.server);
    drop(r.src);
    r.proxy.kill_all();
    r.proxy.remove(stall);
    let drained = handle.drained();
    let o = tokio::time::timeout(Duration::from_secs(60), handle.outcome())
        .await
        .context("the request outlived its deadline by a minute")?;
    let f = o
        .failure
        .context("a READ from a server gone cannot complete")?;
    ensure!(
        matches!(f.kind, FailureKind::Timeout | FailureKind::PeerLost),
        "{o:?}"
    );
    ensure!(o.completed_ops == 0 && o.completed_bytes == 0, "{o:?}");
    let d = tokio::time::timeout(Duration::from_secs(60), drained)
        .await
        .context("reconnect attempts went on past the deadline")?;
    ensure!(d.drained && d.completed_ops == 0, "{d:?}");
    let route = route(&r.client)?;
    ensure!(
        route.reconnect_attempts >= 1 && route.reconnect_attempts < 1000,
        "{route:?}"
    );
    ensure!(
        route.reconnects == 0 && route.reconnect_failures == 0,
        "{route:?}"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reconnect_attempts_stop_at_the_deadline_over_tcp() -> Result<()> {
    attempts_stop_at_the_deadline(Plane::Tcp).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reconnect_attempts_stop_at_the_deadline_over_uring() -> Result<()> {
    attempts_stop_at_the_deadline(Plane::Uring).await
}

/// Many clients, each with several requests waiting, lose the same server at once: every
/// request completes, and each client reconnects exactly once (one reconnect per peer shared by
/// its requests), so the server sees as many new connections as clients times (handshake +
/// streams), not times requests.
async fn reconnect_storm(plane: Plane, clients: usize) -> Result<()> {
    if !plane.usable() {
        return Ok(());
    }
    const REQUESTS: usize = 4;
    let len = 256 * 1024u64;
    let data = pattern(len, 77);
    let (server, _src) = server(plane, "127.0.0.1:0".parse()?, &data)?;
    let proxy = FaultProxy::start(server.local_addr().context("listen")?)?;
    let mut rigs = Vec::new();
    for _ in 0..clients {
        let engine = TransferEngine::builder()
            .same_host(false)
            .data_plane(plane.data_plane())
            .io_threads(Some(1))
            .reconnect(ReconnectPolicy {
                attempts: 8,
                backoff_base: Duration::from_millis(100),
                backoff_max: Duration::from_secs(1),
                replay_writes: false,
            })
            .build()?;
        let peer = engine.connect(proxy.addr()).await?;
        let dst = engine.register(
            MemoryRegion::alloc_zeroed(len as usize * REQUESTS, 4096)?,
            Access::LOCAL,
            "dst",
        )?;
        rigs.push((engine, peer, dst));
    }
    // Hold every answer, submit everything, then cut every connection at once.
    let stall = proxy.inject(
        Scope::All,
        Dir::ToClient,
        Fault::Stall {
            after: 0,
            duration: None,
        },
    );
    let mut handles = Vec::new();
    for (engine, peer, dst) in &rigs {
        let seg = peer.segment("src")?;
        for k in 0..REQUESTS {
            let at = k as u64 * len;
            handles.push(engine.submit(Batch::new().read(dst, at, &seg, 0, len))?);
        }
    }
    let before = proxy.counters().accepted;
    proxy.kill_all();
    proxy.remove(stall);
    for h in handles {
        let o = h.await;
        ensure!(o.is_success(), "{o:?}");
    }
    let mut attempts = 0;
    for (engine, _, dst) in &rigs {
        for k in 0..REQUESTS {
            ensure!(bytes(dst, k as u64 * len, len)? == data, "bytes differ");
        }
        let route = route(engine)?;
        ensure!(route.reconnects == 1, "{route:?}");
        attempts += route.reconnect_attempts;
    }
    let reconnections = proxy.counters().accepted - before;
    // A handshake and one data stream per successful reconnect; failed attempts add at most as
    // many.
    ensure!(
        reconnections >= 2 * clients as u64 && reconnections <= 2 * attempts,
        "{reconnections} connections for {clients} clients ({attempts} attempts)"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reconnect_storm_is_one_reconnect_per_client_over_tcp() -> Result<()> {
    reconnect_storm(Plane::Tcp, 50).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reconnect_storm_is_one_reconnect_per_client_over_uring() -> Result<()> {
    reconnect_storm(Plane::Uring, 20).await
}

/// GPU memory staged through the pool's lanes, reset midway: a READ into the GPU is replayed
/// piece by piece and completes with the right bytes in device memory; a WRITE from the GPU
/// completes under `replay_writes`, and without it ends `PeerLost` and `Uncertain`. Every
/// chunk is staged once however often its sub-request ran, and no lane stays borrowed.
async fn staged_reset_midway(plane: Plane, write: bool, replay_writes: bool) -> Result<()> {
    if !plane.usable() {
        return Ok(());
    }
    let fake = fake_cuda(FakeVariant::Full).context("the fake CUDA driver is missing")?;
    fake.reset();
    let len = 24 * MIB;
    let r = rig_with(plane, len, policy(replay_writes), Some(fake)).await?;
    let gpu = r.client.alloc_gpu(0, len as usize, Access::LOCAL, "gpu")?;
    let seg = r.peer.segment("src")?;
    let mine = pattern(len, 0x6e0);
    if write {
        gpu.memory().copy_from_host(0, &mine)?;
    }
    let batch = if write {
        Batch::new().write(&gpu, 0, &seg, 0, len)
    } else {
        Batch::new().read(&gpu, 0, &seg, 0, len)
    };
    let handle = r.client.submit(batch)?;
    let drained = handle.drained();
    let dir = if write { Dir::ToTarget } else { Dir::ToClient };
    reset_midway(&r.proxy, dir, 6 * MIB).await?;
    let o = handle.await;
    let d = drained.await;
    ensure!(d.drained, "{d:?}");
    let route = route(&r.client)?;
    let staging = r.client.describe().staging.context("staging described")?;
    ensure!(staging.buffers_in_use == 0, "{staging:?}");
    if write && !replay_writes {
        let f = o.failure.context("a staged WRITE cut midway must fail")?;
        ensure!(f.kind == FailureKind::PeerLost, "{o:?}");
        ensure!(o.remote_effect == RemoteEffect::Uncertain, "{o:?}");
        ensure!(route.replays == 0, "{route:?}");
        ensure!(staging.staged_bytes < len, "{staging:?}");
        return Ok(());
    }
    ensure!(o.is_success(), "{o:?}");
    ensure!(route.replays >= 1, "{route:?}");
    ensure!(route.reconnects >= 1, "{route:?}");
    ensure!(
        staging.staged_bytes == len,
        "each chunk staged once: {staging:?}"
    );
    if write {
        ensure!(bytes(&r.src, 0, len)? == mine, "remote bytes differ");
    } else {
        let mut back = vec![0u8; len as usize];
        gpu.memory().copy_to_host(0, &mut back)?;
        ensure!(back == r.data, "GPU bytes differ after the replay");
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reset_mid_staged_gpu_read_is_replayed_over_tcp() -> Result<()> {
    staged_reset_midway(Plane::Tcp, false, false).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reset_mid_staged_gpu_read_is_replayed_over_uring() -> Result<()> {
    staged_reset_midway(Plane::Uring, false, false).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cut_staged_gpu_write_is_uncertain_without_replay_over_tcp() -> Result<()> {
    staged_reset_midway(Plane::Tcp, true, false).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cut_staged_gpu_write_is_replayed_when_allowed_over_uring() -> Result<()> {
    staged_reset_midway(Plane::Uring, true, true).await
}

/// A staged GPU READ cancelled while its connection stalls, then cut: the handle resolves
/// `Cancelled` at once, and the cut pieces are neither reconnected nor replayed (they are parts
/// of the cancelled request); drained comes once the cut resolved them, with every lane back.
async fn staged_cancel_then_cut(plane: Plane) -> Result<()> {
    if !plane.usable() {
        return Ok(());
    }
    let fake = fake_cuda(FakeVariant::Full).context("the fake CUDA driver is missing")?;
    fake.reset();
    let len = 24 * MIB;
    let r = rig_with(plane, len, policy(false), Some(fake)).await?;
    let gpu = r.client.alloc_gpu(0, len as usize, Access::LOCAL, "gpu")?;
    let seg = r.peer.segment("src")?;
    let stall = r.proxy.inject(
        Scope::All,
        Dir::ToClient,
        Fault::Stall {
            after: 3 * MIB,
            duration: None,
        },
    );
    let handle = r.client.submit(Batch::new().read(&gpu, 0, &seg, 0, len))?;
    let drained = handle.drained();
    let deadline = Instant::now() + Duration::from_secs(60);
    while r.proxy.counters().faults_fired == 0 {
        ensure!(Instant::now() < deadline, "the stall never began");
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    handle.cancel();
    let o = handle.await;
    ensure!(
        o.failure.map(|f| f.kind) == Some(FailureKind::Cancelled),
        "{o:?}"
    );
    r.proxy.kill_all();
    r.proxy.remove(stall);
    let d = tokio::time::timeout(Duration::from_secs(60), drained)
        .await
        .context("drained never came")?;
    ensure!(d.drained, "{d:?}");
    let route = route(&r.client)?;
    ensure!(
        route.reconnects == 0 && route.replays == 0,
        "a cancelled request's pieces were replayed: {route:?}"
    );
    let staging = r.client.describe().staging.context("staging described")?;
    ensure!(staging.buffers_in_use == 0, "{staging:?}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancelled_staged_read_is_not_replayed_over_tcp() -> Result<()> {
    staged_cancel_then_cut(Plane::Tcp).await
}
