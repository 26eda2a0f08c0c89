//! File segments on the TCP data plane, in any build (the `uring` feature included or not): an
//! engine publishes a file, a peer READs and WRITEs it over TCP, and `read_file_into` loads it
//! into registered memory by positioned reads.

use std::net::SocketAddr;

use anyhow::{Context, Result};
use ferry::{
    Access, Batch, DataPlane, Error, FailureKind, MemoryRegion, RemoteStatus, TransferEngine,
    TransportKind,
};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tcp_engine_serves_and_loads_file_segments() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let len = (2 << 20) + 4_321;
    let mut data: Vec<u8> = (0..len).map(|i| (i * 13 + 5) as u8).collect();
    let path = dir.path().join("shard.bin");
    std::fs::write(&path, &data)?;

    let server = TransferEngine::builder()
        .same_host(false)
        .data_plane(DataPlane::Tcp)
        .listen("127.0.0.1:0".parse::<SocketAddr>()?)
        .build()?;
    assert_eq!(server.data_plane(), Some(TransportKind::Tcp));
    let file =
        server.publish_file_named(&path, Access::REMOTE_READ | Access::REMOTE_WRITE, "shard")?;
    assert_eq!(file.len(), len as u64);
    assert!(
        server
            .describe()
            .published
            .iter()
            .any(|s| s.name == "shard")
    );

    let client = TransferEngine::builder()
        .same_host(false)
        .data_plane(DataPlane::Tcp)
        .build()?;
    assert_eq!(client.data_plane(), Some(TransportKind::Tcp));
    let addr = server.local_addr().context("listen")?;
    let peer = client.connect(addr).await?;
    let seg = peer.segment("shard")?;
    assert_eq!(seg.len(), len as u64);

    // READ at unaligned offsets, through the tail.
    let dst = client.register(MemoryRegion::alloc_zeroed(len, 4096)?, Access::LOCAL, "d")?;
    let o = client
        .submit(Batch::new().read(&dst, 3, &seg, 7, len as u64 - 7))?
        .await;
    assert!(o.is_success(), "{o:?}");
    let mut got = vec![0u8; len - 7];
    dst.region().read_at(3, &mut got)?;
    assert!(got == data[7..], "READ bytes differ");

    // WRITE in place; one past the end is refused before anything moves.
    let src = client.register(MemoryRegion::alloc_zeroed(6_000, 4096)?, Access::LOCAL, "s")?;
    let fresh: Vec<u8> = (0..6_000).map(|i| (i * 7 + 1) as u8).collect();
    src.region().write_at(0, &fresh)?;
    let o = client
        .submit(Batch::new().write(&src, 11, &seg, 4_093, 5_000))?
        .await;
    assert!(o.is_success(), "{o:?}");
    data[4_093..9_093].copy_from_slice(&fresh[11..5_011]);
    assert!(
        std::fs::read(&path)? == data,
        "file bytes after WRITE differ"
    );
    // A WRITE of many server pieces per chunk (the server writes piece k while it receives
    // piece k+1): every byte lands, and the acknowledgment comes after the last write.
    let big = len - 12_345;
    let many: Vec<u8> = (0..big).map(|i| (i * 31 + 3) as u8).collect();
    let src_big = client.register(MemoryRegion::alloc_zeroed(big, 4096)?, Access::LOCAL, "b")?;
    src_big.region().write_at(0, &many)?;
    let o = client
        .submit(Batch::new().write(&src_big, 0, &seg, 12_345, big as u64))?
        .await;
    assert!(o.is_success(), "{o:?}");
    data[12_345..].copy_from_slice(&many);
    assert!(
        std::fs::read(&path)? == data,
        "file bytes after a large WRITE differ"
    );
    let past_end = client.submit(Batch::new().write(&src, 0, &seg, len as u64 - 10, 11));
    assert!(past_end.is_err(), "a WRITE past the end must be refused");
    assert_eq!(std::fs::metadata(&path)?.len(), len as u64, "the file grew");

    // The local loader: positioned reads into registered memory.
    let local = server.register(MemoryRegion::alloc_zeroed(len, 4096)?, Access::LOCAL, "l")?;
    let n =
        tokio::task::block_in_place(|| server.read_file_into(&local, 1, &path, 5, len as u64 - 5))?;
    assert_eq!(n, len as u64 - 5);
    let mut got = vec![0u8; len - 5];
    local.region().read_at(1, &mut got)?;
    assert!(got == data[5..], "read_file_into bytes differ");
    match tokio::task::block_in_place(|| server.read_file_into(&local, 0, &path, 1, len as u64)) {
        Err(Error::InvalidRequest { reason }) => assert!(reason.contains("file"), "{reason}"),
        other => panic!("expected InvalidRequest past the file's end, got {other:?}"),
    }

    // Unpublished: the old descriptor is refused as unknown.
    file.retire();
    let o = client
        .submit(Batch::new().read(&dst, 0, &seg, 0, 10))?
        .await;
    assert_eq!(
        o.failure.map(|f| f.kind),
        Some(FailureKind::Remote(RemoteStatus::UnknownSegment))
    );
    Ok(())
}
