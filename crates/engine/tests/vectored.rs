//! Batches of small ops through the facade with peers of protocol versions 2 and 3 both ways:
//! vectored requests (version 3) only where both ends speak 3, one request per op otherwise;
//! every byte lands either way, on both data planes.

use anyhow::Result;
use ferry::{Access, Batch, DataPlane, MemoryRegion, TransferEngine, VersionRange};
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

const V2: VersionRange = VersionRange { min: 1, max: 2 };

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn small_op_batches_with_version_2_and_3_peers_both_ways() -> Result<()> {
    let all = ferry::SUPPORTED_VERSIONS;
    for plane in planes() {
        for (server_v, client_v, common) in [(all, all, 3u16), (V2, all, 2), (all, V2, 2)] {
            let server = TransferEngine::builder()
                .same_host(false)
                .data_plane(plane)
                .protocol_versions(server_v)
                .listen("127.0.0.1:0".parse()?)
                .build()?;
            let remote_mem = MemoryRegion::alloc_zeroed(1 << 20, 4096)?;
            let remote =
                server.register(remote_mem, Access::REMOTE_READ | Access::REMOTE_WRITE, "kv")?;
            let client = TransferEngine::builder()
                .same_host(false)
                .data_plane(plane)
                .protocol_versions(client_v)
                .build()?;
            let peer = client
                .connect(server.local_addr().expect("listens"))
                .await?;
            assert_eq!(peer.protocol_version(), common);
            let seg = peer.segment("kv")?;
            let src_mem = MemoryRegion::alloc_zeroed(1 << 20, 4096)?;
            let pattern: Vec<u8> = (0..1 << 20)
                .map(|i: u32| (i.wrapping_mul(131) >> 3) as u8)
                .collect();
            src_mem.write_at(0, &pattern)?;
            let src = client.register(src_mem, Access::LOCAL, "src")?;
            let dst = client.register(
                MemoryRegion::alloc_zeroed(1 << 20, 4096)?,
                Access::LOCAL,
                "dst",
            )?;
            // 128 blocks of 4 KiB, block i of the source to remote block (i * 37) % 256.
            let mut writes = Batch::new();
            let mut reads = Batch::new();
            for i in 0..128u64 {
                let r = ((i * 37) % 256) * 4096;
                writes = writes.write(&src, i * 4096, &seg, r, 4096);
                reads = reads.read(&dst, i * 8192, &seg, r, 4096);
            }
            let o = client.submit(writes)?.await;
            assert!(o.is_success(), "{plane:?} {server_v} {client_v}: {o:?}");
            let o = client.submit(reads)?.await;
            assert!(o.is_success(), "{plane:?} {server_v} {client_v}: {o:?}");
            let mut there = vec![0u8; 1 << 20];
            remote.region().read_at(0, &mut there)?;
            let mut back = vec![0u8; 1 << 20];
            dst.region().read_at(0, &mut back)?;
            for i in 0..128usize {
                let r = ((i * 37) % 256) * 4096;
                let want = &pattern[i * 4096..(i + 1) * 4096];
                assert_eq!(
                    &there[r..r + 4096],
                    want,
                    "{plane:?} {server_v} {client_v}: block {i}"
                );
                assert_eq!(
                    &back[i * 8192..i * 8192 + 4096],
                    want,
                    "{plane:?}: read {i}"
                );
            }
        }
    }
    Ok(())
}
