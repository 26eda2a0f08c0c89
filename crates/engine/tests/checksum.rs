//! `Peer::checksum`: the CHECKSUM data request, served by both data planes over memory and file
//! segments, in every pairing; refused locally for a version-1 peer.

use std::io::Write;

use anyhow::Result;
use ferry::{
    Access, DataPlane, Error, MemoryRegion, TransferEngine, VersionRange, checksum::crc32c,
};
use ferry_tests::{URING, require_or_skip};

fn planes() -> Vec<DataPlane> {
    #[cfg(feature = "uring")]
    let unusable = ferry::probe_kernel().unusable_reason();
    #[cfg(not(feature = "uring"))]
    let unusable = Some("built without the `uring` feature".to_owned());
    match unusable {
        None => vec![DataPlane::Tcp, DataPlane::Uring],
        Some(why) => {
            require_or_skip(URING, format!("io_uring unusable here: {why}"));
            vec![DataPlane::Tcp]
        }
    }
}

fn data(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn checksums_match_local_bytes_on_both_data_planes_in_every_pairing() -> Result<()> {
    let mem = data(3 << 20, 7);
    let file_bytes = data((1 << 20) + 123, 9);
    let mut file = tempfile::NamedTempFile::new()?;
    file.write_all(&file_bytes)?;
    file.flush()?;
    for server_plane in planes() {
        let server = TransferEngine::builder()
            .same_host(false)
            .data_plane(server_plane)
            .listen("127.0.0.1:0".parse()?)
            .build()?;
        let _m = server.register(
            MemoryRegion::from_vec(mem.clone()),
            Access::REMOTE_READ,
            "mem",
        )?;
        let _f = server.publish_file_named(file.path(), Access::REMOTE_READ, "file")?;
        let addr = server.local_addr().expect("listens");
        for client_plane in planes() {
            let client = TransferEngine::builder()
                .same_host(false)
                .data_plane(client_plane)
                .build()?;
            let peer = client.connect(addr).await?;
            assert_eq!(peer.protocol_version(), ferry::SUPPORTED_VERSIONS.max);
            let seg = peer.segment("mem")?;
            for (off, len) in [
                (0u64, mem.len() as u64),
                (5, 100),
                (1 << 20, 0),
                (17, 2 << 20),
            ] {
                let got = peer.checksum(&seg, off, len).await?;
                let want = crc32c(&mem[off as usize..(off + len) as usize]);
                assert_eq!(
                    got, want,
                    "{server_plane:?}<-{client_plane:?} mem {off}+{len}"
                );
            }
            let fseg = peer.segment("file")?;
            let got = peer.checksum(&fseg, 3, file_bytes.len() as u64 - 3).await?;
            assert_eq!(got, crc32c(&file_bytes[3..]));
            // Bounds are checked locally against the descriptor before anything is sent.
            assert!(matches!(
                peer.checksum(&seg, 1, mem.len() as u64).await,
                Err(Error::OutOfBounds { .. })
            ));
            // The stream is still good after all that: a READ after checksums.
            let buf =
                client.register(MemoryRegion::alloc_zeroed(4096, 4096)?, Access::LOCAL, "b")?;
            let o = client
                .submit(ferry::Batch::new().read(&buf, 0, &seg, 4096, 4096))?
                .await;
            assert!(o.is_success(), "{o:?}");
        }
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_version_one_peer_is_never_sent_a_checksum() -> Result<()> {
    let server = TransferEngine::builder()
        .same_host(false)
        .data_plane(DataPlane::Tcp)
        .protocol_versions(VersionRange { min: 1, max: 1 })
        .listen("127.0.0.1:0".parse()?)
        .build()?;
    let _m = server.register(
        MemoryRegion::from_vec(vec![1; 4096]),
        Access::REMOTE_READ,
        "m",
    )?;
    let client = TransferEngine::builder()
        .same_host(false)
        .data_plane(DataPlane::Tcp)
        .build()?;
    let peer = client
        .connect(server.local_addr().expect("listens"))
        .await?;
    assert_eq!(peer.protocol_version(), 1);
    let seg = peer.segment("m")?;
    match peer.checksum(&seg, 0, 4096).await {
        Err(Error::Unavailable { reason, .. }) => {
            assert!(reason.contains("protocol version 1"), "{reason}")
        }
        other => panic!("expected Unavailable, got {other:?}"),
    }
    // And the version-1 data path still works.
    let buf = client.register(MemoryRegion::alloc_zeroed(4096, 4096)?, Access::LOCAL, "b")?;
    let o = client
        .submit(ferry::Batch::new().read(&buf, 0, &seg, 0, 4096))?
        .await;
    assert!(o.is_success(), "{o:?}");
    Ok(())
}
