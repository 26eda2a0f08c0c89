//! The io_uring server on its fixed set of rings (`UringConfig::event_loop`): many attached,
//! idle data streams cost it no thread each, and a new peer is served meanwhile.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::Arc;
use std::time::Duration;

use common::*;
use ferry_core::wire::{ControlFrame, SUPPORTED_VERSIONS, TransportOffer};
use ferry_core::{Access, MemoryRegion, OpKind, Transport};
use transport_uring::{UringConfig, UringTransport};

/// This process's threads (`Threads:` of `/proc/self/status`).
fn threads() -> usize {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("Threads:"))
        .and_then(|v| v.trim().parse().ok())
        .expect("a Threads line in /proc/self/status")
}

/// One client: a handshake, then one data stream attached by hand (no client thread) and left
/// idle.
fn idle_client(addr: std::net::SocketAddr, offer: &TransportOffer) -> TcpStream {
    let peer = peer_info_with(addr, offer.clone(), SUPPORTED_VERSIONS);
    let attach = ferry_core::handshake::stream_attach(&peer, 0, offer.code());
    let mut frame = Vec::new();
    ferry_core::handshake::attach_frame(&peer, attach)
        .encode(SUPPORTED_VERSIONS.max, &mut frame)
        .unwrap();
    let mut expect = Vec::new();
    ControlFrame::StreamAccept
        .encode(SUPPORTED_VERSIONS.max, &mut expect)
        .unwrap();
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    s.write_all(&frame).unwrap();
    let mut got = vec![0u8; expect.len()];
    s.read_exact(&mut got).unwrap();
    assert_eq!(got, expect, "the attach was not accepted");
    s
}

/// 1,000 idle attached data streams leave the server at most cores + 8 threads (the accept
/// thread and one per ring), and a new peer's 64-byte WRITE and READ round trips still work
/// while they stay connected.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_streams_cost_the_ring_server_no_thread() {
    if !uring_usable() {
        return;
    }
    const CLIENTS: usize = 1000;
    let cores = std::thread::available_parallelism().unwrap().get();
    let before = threads();
    let table = Arc::new(Table::default());
    let config = UringConfig {
        event_loop: true,
        ..UringConfig::default()
    };
    let server = serve_uring(&table, config, None);
    let addr = server.local_addr();
    let (tok, remote) = publish(
        &table,
        "x",
        4096,
        Access::REMOTE_READ | Access::REMOTE_WRITE,
    );
    let offer = UringTransport::new(UringConfig::default()).unwrap().offer();
    let idle = tokio::task::spawn_blocking(move || {
        (0..CLIENTS)
            .map(|_| idle_client(addr, &offer))
            .collect::<Vec<_>>()
    })
    .await
    .unwrap();
    let server_threads = threads() - before;
    assert!(
        server_threads <= cores + 8,
        "{server_threads} server threads for {CLIENTS} idle streams on {cores} cores"
    );

    let t = UringTransport::new(UringConfig::default()).unwrap();
    let my_offer = t.offer();
    let peer = tokio::task::spawn_blocking(move || peer_info(addr, my_offer))
        .await
        .unwrap();
    let ch = t.open(peer).await.unwrap();
    let src = Arc::new(MemoryRegion::alloc_zeroed(64, 4096).unwrap());
    fill(&src, 5);
    let dst = Arc::new(MemoryRegion::alloc_zeroed(64, 4096).unwrap());
    let o = run(&ch, vec![op(OpKind::Write, &src, 0, tok, 100, 64)]).await;
    assert!(o.is_success(), "{o:?}");
    assert_eq!(bytes(&remote, 100, 64), bytes(&src, 0, 64));
    let o = run(&ch, vec![op(OpKind::Read, &dst, 0, tok, 100, 64)]).await;
    assert!(o.is_success(), "{o:?}");
    assert_eq!(bytes(&dst, 0, 64), bytes(&src, 0, 64));
    // Every idle stream is still the server's: none was closed under it.
    for mut s in idle {
        s.set_nonblocking(true).unwrap();
        let mut b = [0u8; 1];
        let r = s.read(&mut b);
        assert!(
            matches!(&r, Err(e) if e.kind() == std::io::ErrorKind::WouldBlock),
            "an idle stream ended or got bytes: {r:?}"
        );
    }
}

/// With SEND_ZC forced, the ring server sends READ payloads zero-copy, every byte arrives, and
/// every zero-copy send's notification comes (each releases the lease that kept its buffer).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ring_server_reads_go_out_zero_copy_and_are_all_let_go() {
    if !uring_usable() {
        return;
    }
    if !transport_uring::probe_kernel().supports("SEND_ZC") {
        ferry_tests::require_or_skip(ferry_tests::URING, "the kernel lacks io_uring SEND_ZC");
        return;
    }
    let table = Arc::new(Table::default());
    let config = UringConfig {
        event_loop: true,
        zero_copy: transport_uring::ZeroCopy::Always,
        ..UringConfig::default()
    };
    let server = serve_uring(&table, config, None);
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
    let config = UringConfig {
        event_loop: true,
        ..UringConfig::default()
    };
    let server = serve_uring(&table, config, None);
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

/// CHECKSUM requests on the ring server: a memory range of many hashing pieces (one per turn
/// of the ring) and a file range answer the CRC-32C of exactly their bytes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ring_server_answers_checksums_of_memory_and_files() {
    if !uring_usable() {
        return;
    }
    let table = Arc::new(Table::default());
    let config = UringConfig {
        event_loop: true,
        server_rings: 1,
        ..UringConfig::default()
    };
    let server = serve_uring(&table, config, None);
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
