//! The portable data plane's selection (io_uring or TCP) with a forced kernel probe, and file
//! segments in one process (publish, READ from another engine, unpublish).
#![cfg(feature = "uring")]

use std::net::SocketAddr;

use anyhow::{Context, Result, bail};
use ferry::{
    Access, Batch, DataPlane, Error, FailureKind, MemoryRegion, OpcodeSupport, RemoteStatus,
    TransferEngine, TransportKind, UringProbe,
};

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
    // File segments need io_uring: a clear error naming why TCP was chosen.
    let path = std::env::current_exe()?;
    match engine.publish_file(&path, Access::REMOTE_READ) {
        Err(Error::Unavailable { reason, .. }) => {
            assert!(reason.contains("lacks io_uring opcode(s) SEND"), "{reason}")
        }
        other => bail!("expected Unavailable, got {other:?}"),
    }
    Ok(())
}

#[test]
fn forcing_uring_on_a_kernel_without_send_is_an_error_naming_it() -> Result<()> {
    for b in [
        TransferEngine::builder().data_plane(DataPlane::Uring),
        TransferEngine::builder().transports(&[TransportKind::Uring]),
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
        eprintln!("skipped: io_uring unusable here: {why}");
        return Ok(());
    }
    let len = (1 << 20) + 12_345;
    let (path, data) = random_file("ferry-file-seg", len, 0xf11e)?;
    let server = TransferEngine::builder()
        .data_plane(DataPlane::Uring)
        .listen("127.0.0.1:0".parse::<SocketAddr>()?)
        .build()?;
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
    let client = TransferEngine::builder().build()?;
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
    Ok(())
}
