//! A CHECKSUM of a large memory or file range does not stall other peers: while one peer's
//! checksum of 256 MiB runs on a server whose TCP data plane has a single I/O thread, another
//! peer's small ops, one after another, all complete (a memory checksum is hashed a piece at a
//! time, and the thread serves its other streams between pieces; a file's runs off the I/O
//! thread). The io_uring server serves both peers' streams on the same ring (stream 0 of a
//! loopback client on ring 0) and hashes either range a piece per turn; the same must hold there.

use std::pin::Pin;
use std::task::Poll;

use anyhow::{Context, Result, ensure};
use ferry::{Access, Batch, DataPlane, MemoryRegion, TransferEngine};
use ferry_tests::{URING, require_or_skip};

const BIG: usize = 256 << 20;
const SMALL_OPS: usize = 20;

fn planes() -> Vec<DataPlane> {
    #[cfg_attr(not(feature = "uring"), allow(unused_mut))]
    let mut v = vec![DataPlane::Tcp];
    #[cfg(feature = "uring")]
    match ferry::probe_kernel().unusable_reason() {
        None => v.push(DataPlane::Uring),
        Some(why) => require_or_skip(URING, format!("io_uring unusable here: {why}")),
    }
    #[cfg(not(feature = "uring"))]
    require_or_skip(URING, "built without the uring feature");
    v
}

fn engine(plane: DataPlane, listen: bool) -> Result<TransferEngine> {
    let b = TransferEngine::builder()
        .same_host(false)
        .data_plane(plane)
        .io_threads(Some(1))
        .no_auth();
    Ok(if listen {
        b.listen("127.0.0.1:0".parse()?)
    } else {
        b
    }
    .build()?)
}

/// Polls `f` once: whether it is done.
async fn poll_once<F: Future>(mut f: Pin<&mut F>) -> Poll<F::Output> {
    std::future::poll_fn(|cx| Poll::Ready(f.as_mut().poll(cx))).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_large_checksum_does_not_stall_another_peers_ops() -> Result<()> {
    for plane in planes() {
        let server = engine(plane, true)?;
        let big = server.register(
            MemoryRegion::alloc_zeroed(BIG, 4096)?,
            Access::REMOTE_READ,
            "big",
        )?;
        // A sparse file: its zeros cost no disk.
        let dir = tempfile::tempdir()?;
        let path = dir.path().join("big");
        std::fs::File::create(&path)?.set_len(BIG as u64)?;
        let big_file = server.publish_file_named(&path, Access::REMOTE_READ, "big-file")?;
        let small = server.register(
            MemoryRegion::alloc_zeroed(4096, 4096)?,
            Access::REMOTE_READ,
            "small",
        )?;
        let addr = server.local_addr().context("listening")?;

        let a = engine(plane, false)?;
        let a_peer = a.connect(addr).await?;
        let b = engine(plane, false)?;
        let b_peer = b.connect(addr).await?;
        let b_small = b_peer.segment("small")?;
        let probe = b.register(MemoryRegion::alloc_zeroed(64, 64)?, Access::LOCAL, "probe")?;
        // B's stream is warm before the checksum starts.
        let o = b
            .submit(Batch::new().read(&probe, 0, &b_small, 0, 64))?
            .await;
        ensure!(o.is_success(), "{plane:?}: {o:?}");

        for name in ["big", "big-file"] {
            let a_big = a_peer.segment(name)?;
            let mut checksum = std::pin::pin!(a_peer.checksum(&a_big, 0, BIG as u64));
            // One poll sends A's request; then B's ops, each a round trip of its own: all but the
            // first leave after A's request reached the server.
            ensure!(
                poll_once(checksum.as_mut()).await.is_pending(),
                "{plane:?} {name}: the checksum of {BIG} bytes was over at once"
            );
            for _ in 0..SMALL_OPS {
                let o = b
                    .submit(Batch::new().read(&probe, 0, &b_small, 0, 64))?
                    .await;
                ensure!(o.is_success(), "{plane:?} {name}: {o:?}");
            }
            ensure!(
                poll_once(checksum.as_mut()).await.is_pending(),
                "{plane:?} {name}: the checksum of {BIG} bytes was over before {SMALL_OPS} small ops of \
                 another peer completed: they waited for it"
            );
            let crc = checksum.await?;
            ensure!(
                crc == ferry::checksum::crc32c(&vec![0u8; BIG]),
                "{plane:?} {name}: wrong checksum {crc:#x}"
            );
        }
        drop((big, big_file, small));
    }
    Ok(())
}
