//! The io_uring server on its fixed set of rings (`UringConfig::server_rings`): zero-copy READs,
//! large WRITEs, checksums (`uring_rings_idle.rs`: many idle streams); and the client's
//! (`UringConfig::client_rings`): large READs (`uring_client_rings.rs`: many channels).

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::*;
use ferry_core::{Access, MemoryRegion, OpKind, Transport};
use ferry_transport_uring::{UringConfig, UringTransport};

/// With SEND_ZC forced, the ring server sends READ payloads zero-copy, every byte arrives, and
/// every zero-copy send's notification comes (each releases the lease that kept its buffer).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ring_server_reads_go_out_zero_copy_and_are_all_let_go() {
    if !uring_usable() {
        return;
    }
    if !ferry_transport_uring::probe_kernel().supports("SEND_ZC") {
        ferry_tests::require_or_skip(ferry_tests::URING, "the kernel lacks io_uring SEND_ZC");
        return;
    }
    let table = Arc::new(Table::default());
    let config = UringConfig {
        zero_copy: ferry_transport_uring::ZeroCopy::Always,
        ..UringConfig::default()
    };
    let server = serve_uring(&table, config);
    let len = 4 << 20;
    let (tok, remote) = publish(&table, "r", len, Access::REMOTE_READ);
    fill(&remote, 3);
    let t = UringTransport::new(UringConfig {
        chunk_size: 1 << 20,
        ..UringConfig::default()
    })
    .unwrap();
    let my_offer = t.offer();
    let addr = server.local_addr();
    let peer = tokio::task::spawn_blocking(move || peer_info(addr, my_offer))
        .await
        .unwrap();
    let ch = t.open(peer).await.unwrap();
    let dst = Arc::new(MemoryRegion::alloc_zeroed(len, 4096).unwrap());
    let o = run(&ch, vec![op(OpKind::Read, &dst, 0, tok, 0, len as u64)]).await;
    assert!(o.is_success(), "{o:?}");
    assert!(
        bytes(&dst, 0, len) == bytes(&remote, 0, len),
        "bytes differ"
    );
    use std::sync::atomic::Ordering::Relaxed;
    let zc = server.stats().zc_sends.load(Relaxed);
    assert!(zc >= 4, "{zc} zero-copy sends for four 1 MiB chunks");
    // The notifications follow the peer's acknowledgements; wait for them (bounded).
    let end = std::time::Instant::now() + Duration::from_secs(10);
    while server.stats().notifications.load(Relaxed) < zc {
        assert!(
            std::time::Instant::now() < end,
            "{} of {zc} notifications",
            server.stats().notifications.load(Relaxed)
        );
        tokio::task::yield_now().await;
    }
}

/// WRITE payloads larger than the receive low mark (256 KiB), with tails of every size below
/// it, land whole on the ring server: a receive under a raised mark never waits for more than
/// the rest of its payload.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ring_server_receives_large_writes_with_any_tail() {
    if !uring_usable() {
        return;
    }
    let table = Arc::new(Table::default());
    let config = UringConfig::default();
    let server = serve_uring(&table, config);
    let len = 4 << 20;
    let (tok, remote) = publish(&table, "w", len, Access::REMOTE_WRITE);
    let t = UringTransport::new(UringConfig {
        chunk_size: 4 << 20,
        ..UringConfig::default()
    })
    .unwrap();
    let my_offer = t.offer();
    let addr = server.local_addr();
    let peer = tokio::task::spawn_blocking(move || peer_info(addr, my_offer))
        .await
        .unwrap();
    let ch = t.open(peer).await.unwrap();
    let src = Arc::new(MemoryRegion::alloc_zeroed(len, 4096).unwrap());
    for (i, n) in [(256 << 10) + 1, (1 << 20) + 12345, (3 << 20) + 4097, len]
        .into_iter()
        .enumerate()
    {
        fill(&src, i as u64 + 1);
        // A receive that waits for bytes that never come would hang the WRITE: fail instead.
        let o = tokio::time::timeout(
            Duration::from_secs(60),
            run(&ch, vec![op(OpKind::Write, &src, 0, tok, 0, n as u64)]),
        )
        .await
        .unwrap_or_else(|_| panic!("a {n}-byte WRITE never completed"));
        assert!(o.is_success(), "{n} bytes: {o:?}");
        assert!(
            bytes(&remote, 0, n) == bytes(&src, 0, n),
            "{n} bytes differ"
        );
    }
}

/// READ payloads larger than the receive low mark (256 KiB), with tails of every size below it,
/// land whole on a client ring, one chunk and several in flight: a receive under a raised mark
/// never waits for more than the rest of its payload, and the mark is back at 1 for the next
/// header.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_ring_receives_large_reads_with_any_tail() {
    if !uring_usable() {
        return;
    }
    let table = Arc::new(Table::default());
    let server = serve_uring(&table, UringConfig::default());
    let len = 4 << 20;
    let (tok, remote) = publish(&table, "r", len, Access::REMOTE_READ);
    fill(&remote, 11);
    for chunk in [4 << 20, 1 << 20] {
        let t = UringTransport::new(UringConfig {
            chunk_size: chunk,
            client_rings: 1,
            ..UringConfig::default()
        })
        .unwrap();
        let my_offer = t.offer();
        let addr = server.local_addr();
        let peer = tokio::task::spawn_blocking(move || peer_info(addr, my_offer))
            .await
            .unwrap();
        let ch = t.open(peer).await.unwrap();
        for n in [(256 << 10) + 1, (1 << 20) + 12345, (3 << 20) + 4097, len] {
            let dst = Arc::new(MemoryRegion::alloc_zeroed(len, 4096).unwrap());
            // A receive that waits for bytes that never come would hang the READ: fail instead.
            let o = tokio::time::timeout(
                Duration::from_secs(60),
                run(&ch, vec![op(OpKind::Read, &dst, 0, tok, 0, n as u64)]),
            )
            .await
            .unwrap_or_else(|_| panic!("a {n}-byte READ never completed"));
            assert!(o.is_success(), "{n} bytes: {o:?}");
            assert!(
                bytes(&dst, 0, n) == bytes(&remote, 0, n),
                "{n} bytes differ (chunks of {chunk})"
            );
        }
    }
}

/// WRITE payloads whose next request header arrives split (the link delivers ~1 KiB pieces
/// that cut headers anywhere): the payload's receive takes what is there of the next header,
/// the rest comes later, and every chunk lands whole and in place.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ring_server_takes_split_headers_after_payloads() {
    if !uring_usable() {
        return;
    }
    let table = Arc::new(Table::default());
    let server = serve_uring(&table, UringConfig::default());
    let proxy = ferry_tests::proxy::FaultProxy::start(server.local_addr()).unwrap();
    // 256-byte chunks (each its own WRITE request: 32 + 256 bytes, not a vectored piece), many
    // in flight, so the trickle's pieces (rate / 20 = 1031 bytes, a prime: the cuts walk through
    // every offset of a request) end inside some headers.
    let chunks = 240usize;
    let len = 256 * chunks;
    let (tok, remote) = publish(&table, "w", len, Access::REMOTE_WRITE);
    let t = UringTransport::new(UringConfig {
        chunk_size: 256,
        depth: 64,
        ..UringConfig::default()
    })
    .unwrap();
    let my_offer = t.offer();
    let addr = proxy.addr();
    let peer = tokio::task::spawn_blocking(move || peer_info(addr, my_offer))
        .await
        .unwrap();
    let ch = t.open(peer).await.unwrap();
    proxy.inject(
        ferry_tests::proxy::Scope::All,
        ferry_tests::proxy::Dir::ToTarget,
        ferry_tests::proxy::Fault::Trickle {
            bytes_per_sec: 20 * 1031,
        },
    );
    let src = Arc::new(MemoryRegion::alloc_zeroed(len, 4096).unwrap());
    fill(&src, 7);
    let o = tokio::time::timeout(
        Duration::from_secs(120),
        run(&ch, vec![op(OpKind::Write, &src, 0, tok, 0, len as u64)]),
    )
    .await
    .expect("WRITEs through split headers never completed");
    assert!(o.is_success(), "{o:?}");
    assert!(
        bytes(&remote, 0, len) == bytes(&src, 0, len),
        "bytes differ"
    );
}

/// CHECKSUM requests on the ring server: a memory range of many hashing pieces (one per turn
/// of the ring) and a file range answer the CRC-32C of exactly their bytes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ring_server_answers_checksums_of_memory_and_files() {
    if !uring_usable() {
        return;
    }
    let table = Arc::new(Table::default());
    let config = UringConfig {
        server_rings: 1,
        ..UringConfig::default()
    };
    let server = serve_uring(&table, config);
    let len = (9 << 20) + 5;
    let (tok, remote) = publish(&table, "m", len, Access::REMOTE_READ);
    fill(&remote, 21);
    let dir = tempfile::tempdir_in("/var/tmp").unwrap();
    let path = dir.path().join("f");
    let data: Vec<u8> = (0..300_001u32).map(|i| (i * 7 % 253) as u8).collect();
    std::fs::write(&path, &data).unwrap();
    let file_tok = ferry_core::SegmentToken::random();
    table.files.lock().unwrap().insert(
        file_tok,
        (
            "f".into(),
            Arc::new(ferry_file::FileSegment::open(&path, Access::REMOTE_READ).unwrap()),
        ),
    );
    let t = UringTransport::new(UringConfig::default()).unwrap();
    let my_offer = t.offer();
    let addr = server.local_addr();
    let peer = tokio::task::spawn_blocking(move || peer_info(addr, my_offer))
        .await
        .unwrap();
    let ch = t.open(peer).await.unwrap();
    let dst = Arc::new(MemoryRegion::alloc_zeroed(4096, 4096).unwrap());
    let o = run(
        &ch,
        vec![op(OpKind::Checksum, &dst, 0, tok, 3, len as u64 - 3)],
    )
    .await;
    assert!(o.is_success(), "{o:?}");
    let want = ferry_core::checksum::crc32c(&bytes(&remote, 3, len - 3));
    assert_eq!(bytes(&dst, 0, 4), want.to_le_bytes());
    let o = run(
        &ch,
        vec![op(OpKind::Checksum, &dst, 8, file_tok, 1, 300_000)],
    )
    .await;
    assert!(o.is_success(), "{o:?}");
    let want = ferry_core::checksum::crc32c(&data[1..]);
    assert_eq!(bytes(&dst, 8, 4), want.to_le_bytes());
}
