//! The io_uring server on its fixed set of rings (`UringConfig::server_rings`): many attached,
//! idle data streams cost it no thread each, and a new peer is served meanwhile. A binary of
//! its own: it counts this process's threads, which no other test may start meanwhile.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::Arc;
use std::time::Duration;

use common::*;
use ferry_core::wire::{ControlFrame, SUPPORTED_VERSIONS, TransportOffer};
use ferry_core::{Access, MemoryRegion, OpKind, Transport};
use ferry_transport_uring::{UringConfig, UringTransport};

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
    let config = UringConfig::default();
    let server = serve_uring(&table, config);
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
