//! The portable data plane's selection (io_uring or TCP) with a forced kernel probe, and file
//! segments in one process (publish, READ from another engine, unpublish).
#![cfg(feature = "uring")]

use std::net::SocketAddr;

use anyhow::{Context, Result, bail};
use ferry::{
    Access, Batch, DataPlane, Error, FailureKind, MemoryRegion, OpcodeSupport, RemoteStatus,
    TransferEngine, TransportKind, UringProbe,
};
use ferry_tests::{URING, require_or_skip};

/// A kernel whose io_uring lacks SEND (everything else the data plane needs is there).
fn probe_without_send() -> UringProbe {
    let op = |name, required, supported| OpcodeSupport {
        name,
        required,
        supported,
    };
    UringProbe::Available {
        opcodes: vec![
            op("SEND", true, false),
            op("RECV", true, true),
            op("READ", true, true),
            op("WRITE", true, true),
            op("SEND_ZC", false, false),
            op("ASYNC_CANCEL", true, true),
        ],
    }
}

/// A kernel with every required opcode (no SEND_ZC).
fn probe_complete() -> UringProbe {
    let mut p = probe_without_send();
    if let UringProbe::Available { opcodes } = &mut p {
        opcodes[0].supported = true;
    }
    p
}

#[test]
fn auto_falls_back_to_tcp_with_the_missing_opcode_in_describe() -> Result<()> {
    let engine = TransferEngine::builder()
        .same_host(false)
        .data_plane(DataPlane::Auto)
        .uring_probe(probe_without_send())
        .build()?;
    assert_eq!(engine.data_plane(), Some(TransportKind::Tcp));
    let d = engine.describe();
    let dp = d
        .data_plane
        .clone()
        .context("no data plane in describe()")?;
    assert!(
        dp.starts_with("tcp")
            && dp.contains("fell back to tcp: kernel lacks io_uring opcode(s) SEND"),
        "{dp}"
    );
    assert!(!d.transports.contains(&"uring".to_owned()), "{d:?}");
    // Display and JSON show it too.
    assert!(d.to_string().contains("opcode(s) SEND"), "{d}");
    let json = serde_json::to_value(&d)?;
    assert_eq!(json["data_plane"].as_str(), Some(dp.as_str()));
    // File segments do not need io_uring: the TCP data plane serves them too (see
    // `file_segments_are_served_over_tcp_where_io_uring_is_refused`).
    let path = std::env::current_exe()?;
    let file = engine.publish_file(&path, Access::REMOTE_READ)?;
    assert_eq!(file.len(), std::fs::metadata(&path)?.len());
    Ok(())
}

#[test]
fn forcing_uring_on_a_kernel_without_send_is_an_error_naming_it() -> Result<()> {
    for b in [
        TransferEngine::builder()
            .same_host(false)
            .data_plane(DataPlane::Uring),
        TransferEngine::builder()
            .same_host(false)
            .transports(&[TransportKind::Uring]),
    ] {
        match b.uring_probe(probe_without_send()).build() {
            Err(Error::Unavailable { library, reason }) => {
                assert_eq!(library, "io_uring");
                assert!(reason.contains("SEND"), "{reason}");
            }
            other => bail!("expected Unavailable, got {other:?}"),
        }
    }
    Ok(())
}

#[test]
fn auto_picks_uring_where_the_probe_allows_and_tcp_can_be_forced() -> Result<()> {
    let engine = TransferEngine::builder()
        .same_host(false)
        .data_plane(DataPlane::Auto)
        .uring_probe(probe_complete())
        .build()?;
    assert_eq!(engine.data_plane(), Some(TransportKind::Uring));
    let dp = engine.describe().data_plane.context("data plane")?;
    assert!(
        dp.starts_with("uring") && dp.contains("supported by the kernel"),
        "{dp}"
    );
    let engine = TransferEngine::builder()
        .same_host(false)
        .data_plane(DataPlane::Tcp)
        .uring_probe(probe_complete())
        .build()?;
    assert_eq!(engine.data_plane(), Some(TransportKind::Tcp));
    let dp = engine.describe().data_plane.context("data plane")?;
    assert!(dp.contains("tcp forced"), "{dp}");
    Ok(())
}

fn random_file(name: &str, len: usize, seed: u64) -> Result<(std::path::PathBuf, Vec<u8>)> {
    let mut x = seed | 1;
    let data: Vec<u8> = (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect();
    let path = std::env::temp_dir().join(format!("{name}-{}-{seed:x}", std::process::id()));
    std::fs::write(&path, &data)?;
    Ok((path, data))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn file_segment_published_read_and_unpublished_in_process() -> Result<()> {
    if let Some(why) = ferry::probe_kernel().unusable_reason() {
        require_or_skip(URING, format!("io_uring unusable here: {why}"));
        return Ok(());
    }
    let server = TransferEngine::builder()
        .same_host(false)
        .data_plane(DataPlane::Uring)
        .listen("127.0.0.1:0".parse::<SocketAddr>()?)
        .build()?;
    assert_eq!(server.data_plane(), Some(TransportKind::Uring));
    file_segment_round_trip(server, 0xf11e).await
}

/// A kernel that refuses io_uring (a seccomp profile, `kernel.io_uring_disabled`) leaves the
/// engine on TCP: file segments are published, read, written and unpublished all the same.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn file_segments_are_served_over_tcp_where_io_uring_is_refused() -> Result<()> {
    let server = TransferEngine::builder()
        .same_host(false)
        .data_plane(DataPlane::Auto)
        .uring_probe(probe_without_send())
        .listen("127.0.0.1:0".parse::<SocketAddr>()?)
        .build()?;
    assert_eq!(server.data_plane(), Some(TransportKind::Tcp));
    file_segment_round_trip(server, 0x7c9).await
}

/// Publishes a read-only and a writable file on `server`, READs and WRITEs them from another
/// engine at unaligned offsets (the tail of a file whose size is no multiple of the block size
/// included), loads one with `read_file_into`, and unpublishes.
async fn file_segment_round_trip(server: TransferEngine, seed: u64) -> Result<()> {
    let len = (1 << 20) + 12_345;
    let (path, data) = random_file("ferry-file-seg", len, seed)?;
    let file = server.publish_file_named(&path, Access::REMOTE_READ, "shard")?;
    assert_eq!(file.len(), len as u64);
    assert!(
        server
            .describe()
            .published
            .iter()
            .any(|s| s.name == "shard")
    );
    let addr = server.local_addr().context("listen")?;
    let client = TransferEngine::builder().same_host(false).build()?;
    let peer = client.connect(addr).await?;
    let seg = peer.segment("shard")?;
    assert_eq!((seg.len(), seg.access()), (len as u64, Access::REMOTE_READ));
    assert!(seg.desc().remote_keys.is_empty());
    let dst = client.register(MemoryRegion::alloc_zeroed(len, 4096)?, Access::LOCAL, "d")?;
    let o = client
        .submit(Batch::new().read(&dst, 3, &seg, 7, len as u64 - 7))?
        .await;
    assert!(o.is_success(), "{o:?}");
    let mut got = vec![0u8; len - 7];
    dst.region().read_at(3, &mut got)?;
    assert!(got == data[7..], "bytes differ");
    // Local loader: the same file into registered memory.
    let local = server.register(MemoryRegion::alloc_zeroed(len, 4096)?, Access::LOCAL, "l")?;
    let n =
        tokio::task::block_in_place(|| server.read_file_into(&local, 1, &path, 5, len as u64 - 5))?;
    assert_eq!(n, len as u64 - 5);
    let mut got = vec![0u8; len - 5];
    local.region().read_at(1, &mut got)?;
    assert!(got == data[5..], "read_file_into bytes differ");
    // Unpublished: gone from the handshake, and the old descriptor is refused.
    file.retire();
    assert!(
        !server
            .describe()
            .published
            .iter()
            .any(|s| s.name == "shard")
    );
    let again = client.connect(addr).await?;
    assert!(again.segment("shard").is_err());
    let o = client
        .submit(Batch::new().read(&dst, 0, &seg, 0, 10))?
        .await;
    assert_eq!(
        o.failure.map(|f| f.kind),
        Some(FailureKind::Remote(RemoteStatus::UnknownSegment))
    );
    let _ = std::fs::remove_file(&path);

    // A writable file: WRITEs land in place and never extend it; a read-only one refuses them.
    let wlen = 3 * 4096 + 77;
    let (wpath, mut expect) = random_file("ferry-file-seg-w", wlen, seed ^ 0x55)?;
    let wfile = server.publish_file_named(
        &wpath,
        Access::REMOTE_READ | Access::REMOTE_WRITE,
        "scratch",
    )?;
    let (rpath, _) = random_file("ferry-file-seg-r", 4096, seed ^ 0xaa)?;
    let rfile = server.publish_file_named(&rpath, Access::REMOTE_READ, "ro")?;
    let peer = client.connect(addr).await?;
    let wseg = peer.segment("scratch")?;
    let src = client.register(MemoryRegion::alloc_zeroed(wlen, 4096)?, Access::LOCAL, "s")?;
    let fresh: Vec<u8> = (0..wlen).map(|i| (i * 7 + 1) as u8).collect();
    src.region().write_at(0, &fresh)?;
    // Unaligned, across block boundaries, through the unaligned tail.
    for &(lo, ro, n) in &[(0u64, 0u64, 1u64), (5, 4093, 8000), (100, 4096 * 3, 77)] {
        let o = client
            .submit(Batch::new().write(&src, lo, &wseg, ro, n))?
            .await;
        assert!(o.is_success(), "write {lo}/{ro}/{n}: {o:?}");
        expect[ro as usize..(ro + n) as usize]
            .copy_from_slice(&fresh[lo as usize..(lo + n) as usize]);
    }
    assert!(
        std::fs::read(&wpath)? == expect,
        "file bytes after WRITEs differ"
    );
    // Both are refused before anything moves (the descriptor says so); the servers' own checks
    // are the same `FileSegment::check` the io_uring file tests cover.
    let past_end = client.submit(Batch::new().write(&src, 0, &wseg, wlen as u64 - 10, 11));
    assert!(past_end.is_err(), "a WRITE past the end must be refused");
    assert_eq!(
        std::fs::metadata(&wpath)?.len(),
        wlen as u64,
        "the file grew"
    );
    let rseg = peer.segment("ro")?;
    let read_only = client.submit(Batch::new().write(&src, 0, &rseg, 0, 10));
    assert!(
        read_only.is_err(),
        "a WRITE to a read-only file must be refused"
    );
    drop((wfile, rfile));
    let _ = std::fs::remove_file(&wpath);
    let _ = std::fs::remove_file(&rpath);
    Ok(())
}

/// A client opens every peer over io_uring however many it opens, its threads its rings (no
/// thread per stream, no budget to spill past), with or without `caller_receives`, and moves the
/// same bytes. A listener runs its fixed set of rings however many streams it serves.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_peer_goes_over_io_uring_on_the_client_rings() -> Result<()> {
    if let Some(why) = ferry::probe_kernel().unusable_reason() {
        require_or_skip(URING, format!("io_uring unusable here: {why}"));
        return Ok(());
    }
    for caller_receives in [true, false] {
        peers_on_rings(caller_receives).await?;
    }
    Ok(())
}

async fn peers_on_rings(caller_receives: bool) -> Result<()> {
    let len = (3 << 20) + 4321;
    let serve = || -> Result<(TransferEngine, ferry::Registration)> {
        let e = TransferEngine::builder()
            .same_host(false)
            .data_plane(DataPlane::Uring)
            .uring_server_rings(2)
            .listen("127.0.0.1:0".parse::<SocketAddr>()?)
            .build()?;
        let seg = e.register(
            MemoryRegion::alloc_zeroed(len, 4096)?,
            Access::REMOTE_READ | Access::REMOTE_WRITE,
            "seg",
        )?;
        Ok((e, seg))
    };
    // A two-stream client's streams are served on each server's rings.
    let (a, _seg_a) = serve()?;
    let (b, _seg_b) = serve()?;
    let client = TransferEngine::builder()
        .same_host(false)
        .data_plane(DataPlane::Uring)
        .streams(2)
        .uring_client_rings(3)
        .uring_caller_receives(caller_receives)
        .build()?;
    let src = client.register(MemoryRegion::alloc_zeroed(len, 4096)?, Access::LOCAL, "src")?;
    let dst = client.register(MemoryRegion::alloc_zeroed(len, 4096)?, Access::LOCAL, "dst")?;
    let mut peers = Vec::new();
    for (i, server) in [&a, &b, &a].into_iter().enumerate() {
        let peer = client
            .connect(server.local_addr().context("listen")?)
            .await?;
        assert_eq!(peer.transport(), TransportKind::Uring, "peer {i}");
        let data: Vec<u8> = (0..len).map(|k| (k * 31 + i * 7 + 3) as u8).collect();
        src.region().write_at(0, &data)?;
        let seg = peer.segment("seg")?;
        let o = client
            .submit(Batch::new().write(&src, 0, &seg, 0, len as u64))?
            .await;
        assert!(o.is_success() && o.drained, "peer {i} write: {o:?}");
        let o = client
            .submit(Batch::new().read(&dst, 0, &seg, 0, len as u64))?
            .await;
        assert!(o.is_success(), "peer {i} read: {o:?}");
        let mut got = vec![0u8; len];
        dst.region().read_at(0, &mut got)?;
        assert!(got == data, "peer {i}: bytes differ");
        peers.push(peer);
    }
    let io = client
        .describe()
        .data_plane_io
        .context("uring in describe")?;
    assert!(io.contains("threads 3 (client rings)"), "{io}");
    for (name, server) in [("a", &a), ("b", &b)] {
        let io = server
            .describe()
            .data_plane_io
            .context("uring in describe")?;
        assert!(
            io.contains("listener on 2 rings: threads 2,"),
            "server {name}: {io}"
        );
    }
    Ok(())
}
