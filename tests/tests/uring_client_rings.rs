//! The io_uring client on its fixed set of rings (`UringConfig::client_rings`): many channels,
//! each of several streams, run on them with no thread per stream, and all move their bytes at
//! once. A binary of its own: it counts this process's threads by name.

mod common;

use std::sync::Arc;

use common::*;
use ferry_core::{Access, Channel, MemoryRegion, OpKind, Transport};
use ferry_transport_uring::{UringConfig, UringTransport};

/// How many of this process's threads have a name (as the kernel keeps it) starting `prefix`.
fn threads_named(prefix: &str) -> usize {
    std::fs::read_dir("/proc/self/task")
        .unwrap()
        .flatten()
        .filter(|t| {
            std::fs::read_to_string(t.path().join("comm"))
                .is_ok_and(|c| c.trim().starts_with(prefix))
        })
        .count()
}

/// 150 channels of two streams each, to three servers, run on the client's two rings: no
/// stream thread exists, the transport counts two threads, and a WRITE then a READ on every
/// channel at once move the right bytes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_channels_run_on_the_client_rings_with_no_thread_per_stream() {
    if !uring_usable() {
        return;
    }
    const CHANNELS: usize = 150;
    const LEN: usize = 64 << 10;
    let servers: Vec<_> = (0..3)
        .map(|_| {
            let table = Arc::new(Table::default());
            let h = serve_uring(
                &table,
                UringConfig {
                    server_rings: 1,
                    ..UringConfig::default()
                },
            );
            let (tok, seg) = publish(
                &table,
                "x",
                LEN * CHANNELS,
                Access::REMOTE_READ | Access::REMOTE_WRITE,
            );
            (h, tok, seg)
        })
        .collect();
    let t = UringTransport::new(UringConfig {
        streams: 2,
        client_rings: 2,
        chunk_size: 16 << 10,
        ..UringConfig::default()
    })
    .unwrap();
    let mut channels: Vec<Arc<dyn Channel>> = Vec::new();
    for i in 0..CHANNELS {
        let addr = servers[i % 3].0.local_addr();
        let offer = t.offer();
        let peer = tokio::task::spawn_blocking(move || peer_info(addr, offer))
            .await
            .unwrap();
        channels.push(t.open(peer).await.unwrap());
    }
    assert_eq!(threads_named("ferry-uring-cr"), 2, "client rings");
    assert_eq!(threads_named("ferry-uring-s"), 0, "client stream threads");
    use std::sync::atomic::Ordering::Relaxed;
    assert_eq!(t.stats().threads.load(Relaxed), 2);

    let src = Arc::new(MemoryRegion::alloc_zeroed(LEN * CHANNELS, 4096).unwrap());
    fill(&src, 9);
    let dst = Arc::new(MemoryRegion::alloc_zeroed(LEN * CHANNELS, 4096).unwrap());
    // Every channel writes its own range of its server's segment, then reads it back, all at
    // once.
    let tasks: Vec<_> = channels
        .iter()
        .enumerate()
        .map(|(i, ch)| {
            let (ch, src, dst) = (ch.clone(), src.clone(), dst.clone());
            let tok = servers[i % 3].1;
            let at = (i * LEN) as u64;
            tokio::spawn(async move {
                let o = run(&ch, vec![op(OpKind::Write, &src, at, tok, at, LEN as u64)]).await;
                assert!(o.is_success() && o.drained, "channel {i} write: {o:?}");
                let o = run(&ch, vec![op(OpKind::Read, &dst, at, tok, at, LEN as u64)]).await;
                assert!(o.is_success(), "channel {i} read: {o:?}");
            })
        })
        .collect();
    for task in tasks {
        task.await.unwrap();
    }
    assert!(
        bytes(&dst, 0, LEN * CHANNELS) == bytes(&src, 0, LEN * CHANNELS),
        "bytes differ"
    );
    for (i, (_, _, seg)) in servers.iter().enumerate() {
        for k in (i..CHANNELS).step_by(3) {
            assert!(
                bytes(seg, (k * LEN) as u64, LEN) == bytes(&src, (k * LEN) as u64, LEN),
                "server {i}, channel {k}"
            );
        }
    }
    drop(channels);
    assert_eq!(
        threads_named("ferry-uring-cr"),
        2,
        "the rings stay with the transport"
    );
}
