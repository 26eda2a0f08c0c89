//! The same-host plane (`ferry-transport-local`) end to end: chosen by itself when both ends run
//! on this host, READ and WRITE (chunked, vectored, and refused) with the bytes checked, the
//! per-peer view of a keyed server held, the fallback to the network planes named in
//! `describe()` when the server does not serve it, and a served process killed mid-copy (the
//! test binary re-runs itself as the child, `FERRY_TEST_CHILD=same-host`).

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::Arc;

use anyhow::{Context, Result};
use ferry::core_types::auth::Keyring;
use ferry::{
    Access, Batch, DataPlane, FailureKind, MemoryRegion, RemoteStatus, TransferEngine,
    TransportKind,
};

const ALICE: &str = "alice 000102030405060708090a0b0c0d0e0f";
const BOB: &str = "bob 101112131415161718191a1b1c1d1e1f";

fn engine(listen: bool, keys: Option<&str>) -> Result<TransferEngine> {
    let mut b = TransferEngine::builder()
        .data_plane(DataPlane::Tcp)
        .no_auth();
    if listen {
        b = b.listen("127.0.0.1:0".parse()?);
    }
    if let Some(k) = keys {
        b = b.auth_keyring(Keyring::parse(k)?);
    }
    Ok(b.build()?)
}

/// A client engine connected to `server`, on the same-host plane.
async fn client_of(server: &TransferEngine) -> Result<(TransferEngine, ferry::Peer)> {
    let client = engine(false, None)?;
    let peer = client
        .connect(server.local_addr().context("listens")?)
        .await?;
    assert_eq!(peer.transport(), TransportKind::Local);
    Ok((client, peer))
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_on_this_host_is_reached_by_copies_and_every_byte_lands() -> Result<()> {
    let server = engine(true, None)?;
    let rw = Access::REMOTE_READ | Access::REMOTE_WRITE;
    let len = (9 << 20) + 123;
    let remote = Arc::new(MemoryRegion::from_vec(pattern(len, 7)));
    let _reg = server.register(remote.clone(), rw, "weights")?;
    let _ro = server.register(
        MemoryRegion::from_vec(vec![1; 4096]),
        Access::REMOTE_READ,
        "ro",
    )?;
    let (client, peer) = client_of(&server).await?;
    let seg = peer.segment("weights")?;

    // A READ of several chunks, at an odd offset.
    let local = client.register(MemoryRegion::alloc_zeroed(len, 4096)?, Access::LOCAL, "l")?;
    let o = client
        .submit(Batch::new().read(&local, 5, &seg, 5, (len - 5) as u64))?
        .await;
    assert!(o.is_success() && o.drained, "{o:?}");
    let mut got = vec![0u8; len - 5];
    local.region().read_at(5, &mut got)?;
    assert_eq!(got, pattern(len, 7)[5..]);

    // Many small WRITEs (vectored requests), then one large one.
    let src = client.register(
        MemoryRegion::from_vec(pattern(1 << 20, 99)),
        Access::LOCAL,
        "s",
    )?;
    let mut b = Batch::new();
    for i in 0..256u64 {
        b = b.write(&src, i * 4096, &seg, (1 << 20) + i * 4096, 4096);
    }
    let o = client.submit(b)?.await;
    assert!(o.is_success(), "{o:?}");
    assert_eq!(o.completed_ops, 256);
    let mut back = vec![0u8; 1 << 20];
    remote.read_at(1 << 20, &mut back)?;
    assert_eq!(back, pattern(1 << 20, 99));

    // Refusals: past the end (refused here before anything is sent; with a descriptor that
    // claims more, by the server), and a WRITE into a read-only segment; nothing moves.
    assert!(
        client
            .submit(Batch::new().read(&local, 0, &seg, len as u64 - 10, 20))
            .is_err()
    );
    let mut forged = peer
        .segments()
        .iter()
        .find(|d| d.name == "weights")
        .context("listed")?
        .clone();
    forged.len += 1 << 20;
    let forged = peer.segment_from_descriptor(forged);
    local.region().write_at(0, &[0xee; 64])?;
    let o = client
        .submit(Batch::new().read(&local, 0, &forged, len as u64 - 10, 64))?
        .await;
    match &o.failure {
        Some(f) => assert_eq!(
            f.kind,
            FailureKind::Remote(RemoteStatus::OutOfBounds),
            "{o:?}"
        ),
        None => panic!("a READ past the segment succeeded: {o:?}"),
    }
    let mut untouched = [0u8; 64];
    local.region().read_at(0, &mut untouched)?;
    assert_eq!(untouched, [0xee; 64], "bytes moved on a refusal");
    let mut ro = peer
        .segments()
        .iter()
        .find(|d| d.name == "ro")
        .context("listed")?
        .clone();
    assert!(
        client
            .submit(Batch::new().write(&src, 0, &peer.segment("ro")?, 0, 64))
            .is_err()
    );
    ro.access = rw;
    let ro = peer.segment_from_descriptor(ro);
    let o = client
        .submit(Batch::new().write(&src, 0, &ro, 0, 64))?
        .await;
    match &o.failure {
        Some(f) => assert_eq!(
            f.kind,
            FailureKind::Remote(RemoteStatus::AccessDenied),
            "{o:?}"
        ),
        None => panic!("a WRITE into a read-only segment succeeded: {o:?}"),
    }

    // The route names the plane, and says nothing of a refusal.
    let d = client.describe();
    let route = d
        .routes
        .iter()
        .find(|r| r.transport == "local")
        .context("a local route")?;
    assert_eq!(route.same_host, None);
    assert!(
        server
            .describe()
            .same_host
            .contains("serving on @ferry-local-")
    );
    Ok(())
}

/// A piece refused in the middle of a vectored batch (out of bounds, by a forged descriptor the
/// client cannot check), WRITEs then READs: the outcome completes exactly the ops before it,
/// whose bytes moved, fails at it with the server's refusal, no later op's bytes move, and the
/// stream survives for the next batch, as on the network planes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_piece_refused_mid_batch_completes_exactly_the_pieces_before_it() -> Result<()> {
    let server = engine(true, None)?;
    let rw = Access::REMOTE_READ | Access::REMOTE_WRITE;
    let remote = Arc::new(MemoryRegion::from_vec(pattern(1 << 20, 5)));
    let _reg = server.register(remote.clone(), rw, "rw")?;
    let (client, peer) = client_of(&server).await?;
    let seg = peer.segment("rw")?;
    let mut desc = peer
        .segments()
        .iter()
        .find(|d| d.name == "rw")
        .context("listed")?
        .clone();
    desc.len += 1 << 20;
    let forged = peer.segment_from_descriptor(desc);
    let src = client.register(
        MemoryRegion::from_vec(pattern(1 << 20, 6)),
        Access::LOCAL,
        "src",
    )?;
    let dst = client.register(
        MemoryRegion::alloc_zeroed(1 << 20, 4096)?,
        Access::LOCAL,
        "dst",
    )?;
    for write in [true, false] {
        let before = {
            let mut b = vec![0u8; 1 << 20];
            remote.read_at(0, &mut b)?;
            b
        };
        let mut dst_before = vec![0u8; 1 << 20];
        dst.region().read_at(0, &mut dst_before)?;
        let mut b = Batch::new();
        for i in 0..12u64 {
            let (s, at) = if i == 7 {
                (&forged, (1 << 20) - 10)
            } else {
                (&seg, i * 8192)
            };
            let len = if i == 7 { 100 } else { 3000 + i };
            b = if write {
                b.write(&src, i * 8192, s, at, len)
            } else {
                b.read(&dst, i * 8192, s, at, len)
            };
        }
        let o = client.submit(b)?.await;
        let tag = if write { "WRITE" } else { "READ" };
        assert_eq!(o.completed_ops, 7, "{tag}: {o:?}");
        let f = o.failure.as_ref().context("a failure")?;
        assert_eq!(
            (f.op_index, f.kind),
            (7, FailureKind::Remote(RemoteStatus::OutOfBounds)),
            "{tag}: {o:?}"
        );
        assert!(o.drained, "{tag}: {o:?}");
        let mut after = vec![0u8; 1 << 20];
        remote.read_at(0, &mut after)?;
        let mut dst_after = vec![0u8; 1 << 20];
        dst.region().read_at(0, &mut dst_after)?;
        let src_bytes = pattern(1 << 20, 6);
        for i in (0..12usize).filter(|i| *i != 7) {
            let (at, n) = (i * 8192, 3000 + i);
            if write {
                let want = if i < 7 {
                    &src_bytes[at..at + n]
                } else {
                    &before[at..at + n]
                };
                assert_eq!(&after[at..at + n], want, "{tag}: op {i}");
            } else {
                let want = if i < 7 {
                    &after[at..at + n]
                } else {
                    &dst_before[at..at + n]
                };
                assert_eq!(&dst_after[at..at + n], want, "{tag}: op {i}");
            }
        }
        // The stream survives: the next batch succeeds on the same plane.
        let o = client
            .submit(
                Batch::new()
                    .write(&src, 0, &seg, 0, 4096)
                    .write(&src, 0, &seg, 8192, 4096),
            )?
            .await;
        assert!(o.is_success(), "{tag}: the next batch {o:?}");
        assert_eq!(peer.transport(), TransportKind::Local);
    }
    Ok(())
}

/// CHECKSUMs on this host: the one answer with bytes after its header (the four of the CRC),
/// whichever of the stream's reader or a polling task receives them, split or whole. Many in
/// flight at once on both streams, between READs, each equals the CRC-32C of the served
/// bytes, and the READs land.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn checksums_on_this_host_match_the_served_bytes() -> Result<()> {
    let server = engine(true, None)?;
    let len = 4 << 20;
    let data = pattern(len, 3);
    let _reg = server.register(
        MemoryRegion::from_vec(data.clone()),
        Access::REMOTE_READ,
        "w",
    )?;
    let (client, peer) = client_of(&server).await?;
    let seg = peer.segment("w")?;
    let local = client.register(MemoryRegion::alloc_zeroed(len, 4096)?, Access::LOCAL, "l")?;
    let mut sums = tokio::task::JoinSet::new();
    for i in 0..64usize {
        let (at, n) = (i * 4099 % (len / 2), 1 + i * 7919 % (len / 2));
        let (peer, seg) = (peer.clone(), seg.clone());
        sums.spawn(async move { (at, n, peer.checksum(&seg, at as u64, n as u64).await) });
    }
    let mut reads = Vec::new();
    for k in 0..8usize {
        let at = (k * (len / 8)) as u64;
        let b = Batch::new().read(&local, at, &seg, at, (len / 8) as u64);
        reads.push(client.submit(b)?);
    }
    for r in reads {
        let o = r.await;
        assert!(o.is_success(), "{o:?}");
    }
    let mut got = vec![0u8; len];
    local.region().read_at(0, &mut got)?;
    assert!(
        got == data,
        "the READs between the checksums brought other bytes"
    );
    let mut checked = 0;
    while let Some(r) = sums.join_next().await {
        let (at, n, crc) = r?;
        assert_eq!(
            crc?,
            ferry::checksum::crc32c(&data[at..at + n]),
            "{n} bytes at {at}"
        );
        checked += 1;
    }
    assert_eq!(checked, 64);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_keyed_server_copies_only_what_it_published_to_the_peer() -> Result<()> {
    let both = format!("{ALICE}\n{BOB}");
    let server = engine(true, Some(&both))?;
    let secret = Arc::new(MemoryRegion::from_vec(vec![0x5a; 8192]));
    let _s = server.register_to(
        secret.clone(),
        Access::REMOTE_READ | Access::REMOTE_WRITE,
        "alice-only",
        &["alice"],
    )?;
    let alice = engine(false, Some(ALICE))?;
    let bob = engine(false, Some(BOB))?;
    let a = alice
        .connect(server.local_addr().context("listens")?)
        .await?;
    let b = bob.connect(server.local_addr().context("listens")?).await?;
    assert_eq!(a.transport(), TransportKind::Local);
    assert_eq!(b.transport(), TransportKind::Local);
    assert!(b.segment("alice-only").is_err(), "listed to bob");
    // Bob names the segment by alice's descriptor: the server's per-peer view refuses it.
    let desc = a
        .segments()
        .iter()
        .find(|d| d.name == "alice-only")
        .context("listed to alice")?
        .clone();
    let stolen = b.segment_from_descriptor(desc);
    let local = bob.register(MemoryRegion::alloc_zeroed(8192, 4096)?, Access::LOCAL, "l")?;
    let o = bob
        .submit(Batch::new().read(&local, 0, &stolen, 0, 8192))?
        .await;
    assert!(!o.is_success(), "bob read alice's segment: {o:?}");
    let mut got = vec![0u8; 8192];
    local.region().read_at(0, &mut got)?;
    assert!(got.iter().all(|b| *b == 0), "bytes reached bob");
    let o = bob
        .submit(Batch::new().write(&local, 0, &stolen, 0, 8192))?
        .await;
    assert!(!o.is_success());
    assert!(secret.read_at(0, &mut got).is_ok() && got.iter().all(|b| *b == 0x5a));
    // Alice reads it.
    let mine = alice.register(MemoryRegion::alloc_zeroed(8192, 4096)?, Access::LOCAL, "l")?;
    let seg = a.segment("alice-only")?;
    let o = alice
        .submit(Batch::new().read(&mine, 0, &seg, 0, 8192))?
        .await;
    assert!(o.is_success(), "{o:?}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_without_the_plane_is_reached_over_the_network_and_describe_says_why() -> Result<()>
{
    let server = TransferEngine::builder()
        .data_plane(DataPlane::Tcp)
        .no_auth()
        .same_host(false)
        .listen("127.0.0.1:0".parse()?)
        .build()?;
    assert!(server.describe().same_host.starts_with("off"));
    let _r = server.register(
        MemoryRegion::from_vec(vec![3; 4096]),
        Access::REMOTE_READ,
        "x",
    )?;
    let client = engine(false, None)?;
    let peer = client
        .connect(server.local_addr().context("listens")?)
        .await?;
    assert_eq!(peer.transport(), TransportKind::Tcp);
    let local = client.register(MemoryRegion::alloc_zeroed(4096, 4096)?, Access::LOCAL, "l")?;
    let o = client
        .submit(Batch::new().read(&local, 0, &peer.segment("x")?, 0, 4096))?
        .await;
    assert!(o.is_success());
    let d = client.describe();
    let why = d.routes[0].same_host.clone().context("a reason")?;
    assert!(why.contains("did not offer"), "{why}");
    Ok(())
}

/// Child: serves a 64 MiB read-write segment named `big`, prints `LISTEN addr`, and waits to be
/// killed.
#[test]
fn child_same_host_server() -> Result<()> {
    if std::env::var("FERRY_TEST_CHILD").as_deref() != Ok("same-host") {
        return Ok(());
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(async {
        let engine = engine(true, None)?;
        let _reg = engine.register(
            MemoryRegion::alloc_zeroed(64 << 20, 4096)?,
            Access::REMOTE_READ | Access::REMOTE_WRITE,
            "big",
        )?;
        println!("LISTEN {}", engine.local_addr().context("listens")?);
        loop {
            tokio::time::sleep(std::time::Duration::from_secs(3600)).await;
        }
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_served_process_killed_mid_copy_leaves_an_honest_outcome() -> Result<()> {
    let mut child = Command::new(std::env::current_exe()?)
        .args([
            "--exact",
            "child_same_host_server",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("FERRY_TEST_CHILD", "same-host")
        .stdout(Stdio::piped())
        .spawn()?;
    let mut lines = BufReader::new(child.stdout.take().context("stdout")?).lines();
    let addr = loop {
        let line = lines.next().context("the child ended before listening")??;
        // libtest writes the test's name on the same line first.
        if let Some((_, a)) = line.split_once("LISTEN ") {
            break a.trim().parse::<std::net::SocketAddr>()?;
        }
    };
    let client = engine(false, None)?;
    let peer = client.connect(addr).await?;
    assert_eq!(peer.transport(), TransportKind::Local);
    let seg = peer.segment("big")?;
    let local = client.register(
        MemoryRegion::alloc_zeroed(64 << 20, 4096)?,
        Access::LOCAL,
        "l",
    )?;
    // Enough WRITEs that the kill lands while some are in flight or queued.
    let mut b = Batch::new();
    for _ in 0..256 {
        b = b.write(&local, 0, &seg, 0, 64 << 20);
    }
    let handle = client.submit(b)?;
    // SAFETY: kill(2) with a child pid we own.
    unsafe { libc::kill(child.id() as i32, libc::SIGKILL) };
    let o = handle.await;
    let _ = child.wait();
    assert!(
        !o.is_success(),
        "256 WRITEs of 64 MiB finished before a SIGKILL: {o:?}"
    );
    let f = o.failure.context("a failure")?;
    assert_eq!(f.kind, FailureKind::PeerLost, "{o:?}");
    assert!(o.drained, "{o:?}");
    assert!(o.completed_ops < 256);
    assert_eq!(o.remote_effect, ferry::RemoteEffect::Uncertain, "{o:?}");
    Ok(())
}
