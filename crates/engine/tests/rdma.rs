//! The engine over RDMA: handshake on loopback TCP, data by one-sided READ/WRITE on real verbs
//! devices (soft-RoCE in `cargo xtask soft-roce`).
//!
//! `#[ignore]`d: run with `--include-ignored` and `FERRY_RDMA_TEST_DEVICES=rxe0,rxe1
//! FERRY_RDMA_TEST_GIDS=<gid index of each>`. Unset, the test fails (with
//! `FERRY_REQUIRE_RDMA=0` it prints why and skips); set but naming a device libibverbs does not
//! list, it fails.
#![cfg(feature = "rdma")]

use std::sync::Arc;

use anyhow::{Context, Result, ensure};
use ferry::{Access, Batch, MemoryRegion, RailSpec, RdmaConfig, TransferEngine, TransportKind};

fn rails() -> Option<(RailSpec, RailSpec)> {
    let Ok(devs) = std::env::var("FERRY_RDMA_TEST_DEVICES") else {
        ferry_tests::require_unless_allowed(
            ferry_tests::RDMA,
            "FERRY_RDMA_TEST_DEVICES is unset (run `cargo xtask soft-roce`)",
        );
        return None;
    };
    let gids: Vec<u32> = std::env::var("FERRY_RDMA_TEST_GIDS")
        .unwrap_or_default()
        .split(',')
        .map(|g| g.trim().parse().unwrap_or(0))
        .collect();
    let names: Vec<&str> = devs
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .collect();
    let listed: Vec<String> = ferry::rdma_devices::enumerate_verbs_devices()
        .devices
        .into_iter()
        .map(|d| d.name)
        .collect();
    for n in &names {
        assert!(
            listed.iter().any(|l| l == n),
            "FERRY_RDMA_TEST_DEVICES names {n}, but libibverbs lists only {listed:?}"
        );
    }
    let spec = |i: usize| {
        let i = i.min(names.len() - 1);
        RailSpec::new(names[i], 1, gids.get(i).copied().unwrap_or(0))
    };
    Some((spec(0), spec(1)))
}

/// The counters `client` describes for local rail `name` (`device:port`).
fn described_rail(client: &TransferEngine, name: &str) -> Option<ferry::RailDescription> {
    client.describe().rails.into_iter().find(|r| r.rail == name)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs RDMA devices: FERRY_RDMA_TEST_DEVICES (cargo xtask soft-roce)"]
async fn engine_moves_bytes_over_rdma_and_counts_them_per_rail() -> Result<()> {
    let Some((s, c)) = rails() else { return Ok(()) };
    let server = TransferEngine::builder()
        .same_host(false)
        .listen("127.0.0.1:0".parse()?)
        .rdma(RdmaConfig::with_rails(vec![s]).chunk_size(256 << 10))
        .build()?;
    const LEN: usize = 3 << 20;
    let pattern: Vec<u8> = (0..LEN).map(|i| (i * 7 % 253) as u8).collect();
    let target = Arc::new(MemoryRegion::from_vec(vec![0; LEN]));
    let _seg = server.register(
        target.clone(),
        Access::REMOTE_READ | Access::REMOTE_WRITE,
        "t",
    )?;
    let addr = server.local_addr().context("no listener")?;

    let client = TransferEngine::builder()
        .same_host(false)
        .rdma(RdmaConfig::with_rails(vec![c]).chunk_size(256 << 10))
        .build()?;
    let src = client.register(
        MemoryRegion::from_vec(pattern.clone()),
        Access::LOCAL,
        "src",
    )?;
    let dst = client.register(MemoryRegion::from_vec(vec![0; LEN]), Access::LOCAL, "dst")?;
    let peer = client.connect(addr).await?;
    ensure!(
        peer.transport() == TransportKind::Rdma,
        "route is {}",
        peer.transport()
    );
    let seg = peer.segment("t")?;
    ensure!(
        !seg.desc().remote_keys.is_empty(),
        "no remote keys published"
    );

    let o = client
        .submit(Batch::new().write(&src, 1, &seg, 5, (LEN - 10) as u64))?
        .await;
    ensure!(o.is_success() && o.drained, "{o:?}");
    let mut got = vec![0u8; LEN - 10];
    target.read_at(5, &mut got)?;
    ensure!(got == pattern[1..LEN - 9], "WRITE: remote bytes differ");

    let o = client
        .submit(Batch::new().read(&dst, 0, &seg, 5, (LEN - 10) as u64))?
        .await;
    ensure!(o.is_success(), "{o:?}");
    let mut back = vec![0u8; LEN - 10];
    dst.region().read_at(0, &mut back)?;
    ensure!(back == pattern[1..LEN - 9], "READ: bytes differ");

    let d = client.describe();
    eprintln!("rails: {:?}", d.rails);
    ensure!(
        d.rails.len() == 1 && d.rails[0].bytes == 2 * (LEN as u64 - 10),
        "{:?}",
        d.rails
    );
    Ok(())
}

/// The engine heals a rail by itself: a long READ striped over two rails, one of which crosses
/// a veth link taken down and up mid-transfer (`ferry_tests::rxe_flap`), completes with the
/// right bytes; the flapped rail's queue pair is torn down, the peer's rail watch rebuilds it
/// through a new handshake once the port is back, `describe()` counts it, and the rail carries
/// traffic again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs RDMA devices: FERRY_RDMA_TEST_DEVICES (cargo xtask soft-roce)"]
async fn engine_heals_a_rail_whose_port_flaps_mid_read() -> Result<()> {
    use ferry_tests::rxe_flap::{DEVICES, RxeFlapPair, wait_for};
    use std::time::Duration;
    let Some((s, c)) = rails() else { return Ok(()) };
    let Some(flap) = RxeFlapPair::create_if_allowed()? else {
        return Ok(());
    };
    let spec = |k: usize| RailSpec::new(DEVICES[k], 1, flap.gids[k]);
    let server = TransferEngine::builder()
        .same_host(false)
        .listen("127.0.0.1:0".parse()?)
        .rdma(RdmaConfig::with_rails(vec![s, spec(1)]).chunk_size(64 << 10))
        .build()?;
    const LEN: usize = 96 << 20;
    let pattern: Vec<u8> = (0..LEN).map(|i| (i * 13 % 251) as u8).collect();
    let _seg = server.register(
        MemoryRegion::from_vec(pattern.clone()),
        Access::REMOTE_READ,
        "source",
    )?;
    let addr = server.local_addr().context("no listener")?;
    let client = TransferEngine::builder()
        .same_host(false)
        .rdma(RdmaConfig::with_rails(vec![c, spec(0)]).chunk_size(64 << 10))
        .build()?;
    let dst = client.register(MemoryRegion::from_vec(vec![0; LEN]), Access::LOCAL, "dst")?;
    let peer = client.connect(addr).await?;
    ensure!(peer.transport() == TransportKind::Rdma);
    let seg = peer.segment("source")?;
    let flapped = format!("{}:1", DEVICES[0]);
    let rail = || described_rail(&client, &flapped).context("the flapped rail is not described");

    let read = client.submit(Batch::new().read(&dst, 0, &seg, 0, LEN as u64))?;
    wait_for(
        "the flapped rail moving 1 MiB",
        Duration::from_secs(60),
        || rail().ok().filter(|r| r.bytes >= 1 << 20),
    )?;
    flap.set_link(false)?;
    let failed = wait_for("the rail failing", Duration::from_secs(60), || {
        rail().ok().filter(|r| r.down == 1 && r.torn_down >= 1)
    })?;
    eprintln!("rail failed and torn down: {failed:?}");
    flap.set_link(true)?;
    let healed = wait_for("the rail rebuilt", Duration::from_secs(60), || {
        rail().ok().filter(|r| r.rebuilds == 1 && r.down == 0)
    })?;
    eprintln!("rail rebuilt by the engine: {healed:?}");
    let o = tokio::time::timeout(Duration::from_secs(300), read)
        .await
        .context("the READ did not resolve within 300 s")?;
    ensure!(o.is_success() && o.drained, "{o:?}");
    let mut got = vec![0u8; LEN];
    dst.region().read_at(0, &mut got)?;
    if got != pattern {
        // Which 64 KiB chunks differ, to tell a lost chunk from a misplaced one.
        let bad: Vec<usize> = (0..LEN / (64 << 10))
            .filter(|&c| got[c << 16..(c + 1) << 16] != pattern[c << 16..(c + 1) << 16])
            .collect();
        let zero = bad
            .iter()
            .filter(|&&c| got[c << 16..(c + 1) << 16].iter().all(|&b| b == 0))
            .count();
        anyhow::bail!(
            "READ across the flap: {} chunks of 64 KiB differ ({zero} all zero), first {:?}; \
             outcome {o:?}; rails {:?}",
            bad.len(),
            &bad[..bad.len().min(16)],
            client.describe().rails
        );
    }
    if rail()?.bytes == healed.bytes {
        let o = client
            .submit(Batch::new().read(&dst, 0, &seg, 0, 8 << 20))?
            .await;
        ensure!(o.is_success(), "{o:?}");
    }
    let after = rail()?;
    eprintln!("rails: {:?}", client.describe().rails);
    ensure!(
        after.bytes > healed.bytes,
        "the healed rail carried nothing: {after:?}"
    );
    // Every queue pair torn down was rebuilt and the rail is up. CI once saw the fresh queue
    // pair fail again soon after the port came back (flushed, with no error completion of its
    // own) and healed a second time, the READ still whole: a heal too, so more than one is
    // allowed, each teardown matched by a rebuild.
    ensure!(
        after.rebuilds >= 1 && after.rebuilds == after.torn_down && after.down == 0,
        "{after:?}"
    );
    if after.rebuilds > 1 {
        eprintln!("the rail was healed {} times", after.rebuilds);
    }
    ensure!(peer.is_alive());
    let text = client.describe().to_string();
    ensure!(
        text.contains(&format!("{} rebuilt", after.rebuilds)),
        "{text}"
    );
    drop((peer, dst, client, _seg, server));
    drop(flap);
    Ok(())
}

/// A peer with one rail whose port flaps mid-READ (or, where the READ outruns the flap, under a
/// READ that starts while the port is down): with the only rail down the channel is dead,
/// so no rail can be healed in place; the request waits for a reconnect (a fresh handshake and
/// fresh queue pairs, the old ones torn down), which succeeds once the port is back, and the
/// READ is replayed and completes with the right bytes. While the port is down a reconnect
/// attempt may fail; none of them makes the request fail for good.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs RDMA devices: FERRY_RDMA_TEST_DEVICES (cargo xtask soft-roce)"]
async fn a_single_rail_peer_whose_port_flaps_mid_read_reconnects_and_the_read_completes()
-> Result<()> {
    use ferry::ReconnectPolicy;
    use ferry_tests::rxe_flap::{DEVICES, RxeFlapPair, wait_for};
    use std::future::IntoFuture;
    use std::time::Duration;
    if rails().is_none() {
        return Ok(());
    }
    let Some(flap) = RxeFlapPair::create_if_allowed()? else {
        return Ok(());
    };
    let spec = |k: usize| RailSpec::new(DEVICES[k], 1, flap.gids[k]);
    // Attempts enough to outlast the time the port is down under an emulated CPU.
    let policy = ReconnectPolicy {
        attempts: 30,
        backoff_base: Duration::from_millis(100),
        backoff_max: Duration::from_secs(1),
        replay_writes: false,
    };
    let server = TransferEngine::builder()
        .same_host(false)
        .listen("127.0.0.1:0".parse()?)
        .rdma(RdmaConfig::with_rails(vec![spec(1)]).chunk_size(64 << 10))
        .build()?;
    const LEN: usize = 64 << 20;
    let pattern: Vec<u8> = (0..LEN).map(|i| (i * 17 % 241) as u8).collect();
    let _seg = server.register(
        MemoryRegion::from_vec(pattern.clone()),
        Access::REMOTE_READ,
        "source",
    )?;
    let addr = server.local_addr().context("no listener")?;
    let client = TransferEngine::builder()
        .same_host(false)
        .rdma(RdmaConfig::with_rails(vec![spec(0)]).chunk_size(64 << 10))
        .reconnect(policy)
        .build()?;
    let dst = client.register(MemoryRegion::from_vec(vec![0; LEN]), Access::LOCAL, "dst")?;
    let peer = client.connect(addr).await?;
    ensure!(peer.transport() == TransportKind::Rdma);
    let seg = peer.segment("source")?;
    let flapped = format!("{}:1", DEVICES[0]);
    let rail = || described_rail(&client, &flapped);
    let route = || client.describe().routes.into_iter().next();

    let submit_read = || -> Result<_> {
        Ok(tokio::spawn(
            client
                .submit(Batch::new().read(&dst, 0, &seg, 0, LEN as u64))?
                .into_future(),
        ))
    };
    let mut read = submit_read()?;
    wait_for("the rail moving 1 MiB", Duration::from_secs(60), || {
        rail().filter(|r| r.bytes >= 1 << 20)
    })?;
    flap.set_link(false)?;
    if read.is_finished() {
        // It outran the flap (the emulated rate varies): the next READ starts with the port
        // down, which fails the rail just the same.
        let o = read.await?;
        ensure!(o.is_success(), "{o:?}");
        eprintln!("the READ finished before the link went down; another starts with it down");
        read = submit_read()?;
    }
    // The only rail fails: its channel is dead, and the request asks for a reconnect (which
    // fails, or connects queue pairs that cannot carry anything yet, while the port is down).
    let down = wait_for("the rail failing", Duration::from_secs(60), || {
        rail().filter(|r| r.down == 1)
    })
    .with_context(|| format!("{:?}", client.describe()))?;
    eprintln!("the rail failed: {down:?}");
    let asked = wait_for(
        "a reconnect attempt (or the READ ending)",
        Duration::from_secs(60),
        || route().filter(|r| r.reconnect_attempts >= 1 || read.is_finished()),
    )
    .with_context(|| format!("{:?}", client.describe()))?;
    ensure!(
        !read.is_finished(),
        "the READ ended while the port was down: {asked:?}"
    );
    flap.set_link(true)?;
    let o = tokio::time::timeout(Duration::from_secs(300), read)
        .await
        .context("the READ did not resolve within 300 s")??;
    let r = route().context("no route described")?;
    eprintln!("route: {r:?}\nrails: {:?}", client.describe().rails);
    ensure!(o.is_success() && o.drained, "{o:?}; route {r:?}");
    let mut got = vec![0u8; LEN];
    dst.region().read_at(0, &mut got)?;
    ensure!(got == pattern, "READ across the flap: bytes differ; {o:?}");
    ensure!(r.reconnects >= 1 && r.replays >= 1, "{r:?}");
    ensure!(peer.is_alive());
    // The reconnected channel carries the next READ on fresh queue pairs.
    let o = client
        .submit(Batch::new().read(&dst, 0, &seg, 0, 8 << 20))?
        .await;
    ensure!(o.is_success(), "{o:?}");
    drop((peer, dst, client, _seg, server));
    drop(flap);
    Ok(())
}
