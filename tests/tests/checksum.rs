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

/// A file CHECKSUM takes turns on the server's blocking pool: on a pool bounded to one thread
/// (the server's data streams on the test's runtime), another peer's file READ, sent once the
/// server has accepted a checksum of a large sparse file, and 19 more after it, complete while
/// that checksum is still running (its future still pending; then its value is right). A checksum that held the
/// blocking thread for its whole range would keep the READ waiting until it was over.
#[test]
fn a_file_checksum_takes_turns_with_another_peers_file_read() -> Result<()> {
    const HUGE: u64 = 1 << 30;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .max_blocking_threads(1)
        .enable_all()
        .build()?;
    rt.block_on(async {
        let server = TransferEngine::builder()
            .same_host(false)
            .data_plane(DataPlane::Tcp)
            .io_threads(None)
            .no_auth()
            .listen("127.0.0.1:0".parse()?)
            .build()?;
        let dir = tempfile::tempdir()?;
        let huge_path = dir.path().join("huge");
        std::fs::File::create(&huge_path)?.set_len(HUGE)?;
        let small_path = dir.path().join("small");
        std::fs::write(&small_path, [7u8; 4096])?;
        let _huge = server.publish_file_named(&huge_path, Access::REMOTE_READ, "huge")?;
        let _small = server.publish_file_named(&small_path, Access::REMOTE_READ, "small")?;
        let addr = server.local_addr().context("listening")?;
        let checksums_accepted = || -> Result<u64> {
            let served = server.describe().served.context("a listener counts")?;
            let c = served.accepted.iter().find(|t| t.op == "checksum");
            Ok(c.context("checksums are counted")?.ops)
        };

        let a = engine(DataPlane::Tcp, false)?;
        let a_peer = a.connect(addr).await?;
        let b = engine(DataPlane::Tcp, false)?;
        let b_peer = b.connect(addr).await?;
        let b_small = b_peer.segment("small")?;
        let probe = b.register(MemoryRegion::alloc_zeroed(64, 64)?, Access::LOCAL, "probe")?;

        let a_huge = a_peer.segment("huge")?;
        let mut checksum = std::pin::pin!(a_peer.checksum(&a_huge, 0, HUGE));
        ensure!(
            poll_once(checksum.as_mut()).await.is_pending(),
            "the checksum of {HUGE} bytes was over at once"
        );
        // The event: the server took the checksum (its request checked and accepted).
        while checksums_accepted()? == 0 {
            tokio::time::sleep(std::time::Duration::from_millis(1)).await;
        }
        // Reads one after another: the first alone could finish with the checksum if it waited
        // for it; the ones after it would then leave with the checksum's answer on its way.
        for _ in 0..SMALL_OPS {
            let o = b
                .submit(Batch::new().read(&probe, 0, &b_small, 0, 64))?
                .await;
            ensure!(o.is_success(), "{o:?}");
        }
        ensure!(
            poll_once(checksum.as_mut()).await.is_pending(),
            "the checksum of {HUGE} bytes was over before {SMALL_OPS} file reads of 64 bytes of \
             another peer completed: they waited for it"
        );
        let crc = checksum.await?;
        let zeros = vec![0u8; 1 << 20];
        let want = (0..HUGE >> 20).fold(0, |c, _| ferry::checksum::crc32c_append(c, &zeros));
        ensure!(crc == want, "wrong checksum {crc:#x}");
        let mut got = [0u8; 64];
        probe.region().read_at(0, &mut got)?;
        ensure!(got == [7u8; 64], "the read brought {got:?}");
        Ok(())
    })
}
