//! The data planes' loopback correctness cases: io_uring against io_uring, ferry-transport-tcp
//! against itself (its streams on I/O threads or on the caller's runtime, on either side), and both
//! mixed directions (uring client to TCP server, TCP client to uring server). A case whose pairing
//! needs io_uring skips that pairing where io_uring is unusable; the TCP pairings always run.

mod common;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use common::*;
use ferry_core::wire::{
    ControlFrame, DATA_REQUEST_LEN, DATA_RESPONSE_LEN, DataRequest, DataResponse, Hello,
    SUPPORTED_VERSIONS, TransportOffer, VersionRange,
};
use ferry_core::{
    Access, Channel, Epoch, Error, FailureKind, MemoryRegion, OpKind, PeerId, PeerInfo,
    RemoteEffect, RemoteStatus, SegmentToken, Transport,
};
use ferry_transport_tcp::{TcpConfig, TcpServer, TcpTransport};
use ferry_transport_uring::{UringConfig, UringServer, UringTransport, ZeroCopy};

#[derive(Clone, Copy, Debug, PartialEq)]
enum Side {
    /// As a server: the default io_uring server (its fixed set of rings, one per CPU); as a
    /// client: io_uring.
    Uring(ZeroCopy),
    /// As a server: io_uring on two rings ([`UringConfig::server_rings`]); as a client:
    /// `Uring(ZeroCopy::Auto)`.
    Rings(ZeroCopy),
    /// The TCP data plane with its data streams on `io_threads` I/O threads
    /// ([`TcpConfig::io_threads`]: `Some(0)` one per core, `None` the caller's runtime).
    Tcp(Option<usize>),
}

/// The TCP data plane as configured by default (`TcpConfig::default().io_threads`).
const TCP: Side = Side::Tcp(Some(0));

impl Side {
    fn is_uring(self) -> bool {
        matches!(self, Side::Uring(_) | Side::Rings(_))
    }
}

/// The pairings (client, server) of `pairs` that can run here: those with an io_uring side only
/// where io_uring is usable (checked once, by `uring_usable`, so `FERRY_REQUIRE_URING=1` still
/// fails where it is not).
fn runnable(pairs: &[(Side, Side)]) -> Vec<(Side, Side)> {
    let mut uring = None;
    pairs
        .iter()
        .copied()
        .filter(|&(c, s)| {
            !(c.is_uring() || s.is_uring()) || *uring.get_or_insert_with(uring_usable)
        })
        .collect()
}

enum ServerHandle {
    Uring(#[allow(dead_code)] ferry_transport_uring::UringServerHandle),
    Tcp(#[allow(dead_code)] ferry_transport_tcp::ServerHandle),
}

struct Fixture {
    _server: ServerHandle,
    addr: SocketAddr,
    table: Arc<Table>,
    epoch: Epoch,
}

fn start(side: Side) -> Fixture {
    start_with(side, SUPPORTED_VERSIONS)
}

/// A server of `side` whose handshake speaks `versions`.
fn start_with(side: Side, versions: VersionRange) -> Fixture {
    let table = Arc::new(Table::default());
    let epoch = Epoch::fresh();
    let addr: SocketAddr = "127.0.0.1:0".parse().unwrap();
    let responder = |offer| {
        Arc::new(Responder {
            id: PeerId::random(),
            epoch,
            versions,
            table: table.clone(),
            offer,
        })
    };
    let (server, addr) = match side {
        Side::Uring(_) | Side::Rings(_) => {
            let t = UringTransport::new(match side {
                Side::Uring(zc) => UringConfig {
                    zero_copy: zc,
                    ..UringConfig::default()
                },
                Side::Rings(zc) => UringConfig {
                    zero_copy: zc,
                    server_rings: 2,
                    ..UringConfig::default()
                },
                Side::Tcp(_) => unreachable!("an io_uring side"),
            })
            .unwrap();
            let server = UringServer::bind(addr).unwrap();
            let addr = server.local_addr();
            let h = server
                .serve(table.clone(), responder(t.offer()), t.config().clone())
                .unwrap();
            (ServerHandle::Uring(h), addr)
        }
        Side::Tcp(io_threads) => {
            let server = TcpServer::bind(addr).unwrap();
            let addr = server.local_addr();
            let offer = TransportOffer::Tcp {
                streams: 64,
                port: 0,
            };
            let config = TcpConfig {
                io_threads,
                ..TcpConfig::default()
            };
            let h = server.serve(table.clone(), responder(offer), config);
            (ServerHandle::Tcp(h), addr)
        }
    };
    Fixture {
        _server: server,
        addr,
        table,
        epoch,
    }
}

async fn channel(f: &Fixture, client: Side, streams: usize, chunk: u64) -> Arc<dyn Channel> {
    channel_with(f, client, streams, chunk, SUPPORTED_VERSIONS).await
}

/// [`channel`] from a client whose handshake speaks `versions`.
async fn channel_with(
    f: &Fixture,
    client: Side,
    streams: usize,
    chunk: u64,
    versions: VersionRange,
) -> Arc<dyn Channel> {
    let client = if let Side::Rings(_) = client {
        Side::Uring(ZeroCopy::Auto)
    } else {
        client
    };
    let (transport, offer): (Arc<dyn Transport>, TransportOffer) = match client {
        Side::Rings(_) => unreachable!("a client side"),
        Side::Uring(zc) => {
            let t = UringTransport::new(UringConfig {
                streams,
                chunk_size: chunk,
                depth: 4,
                zero_copy: zc,
                // Auto: loopback WRITE payloads by vmsplice + SPLICE; Always/Never: SEND_ZC/SEND.
                splice_loopback: zc == ZeroCopy::Auto,
                ..UringConfig::default()
            })
            .unwrap();
            let o = t.offer();
            (Arc::new(t), o)
        }
        Side::Tcp(io_threads) => {
            let t = TcpTransport::new(TcpConfig {
                streams,
                chunk_size: chunk,
                depth: 4,
                io_threads,
                ..TcpConfig::default()
            });
            let o = t.offer();
            (Arc::new(t), o)
        }
    };
    let addr = f.addr;
    let peer = tokio::task::spawn_blocking(move || peer_info_with(addr, offer, versions))
        .await
        .unwrap();
    transport.open(peer).await.unwrap()
}

/// The client's thread gauge counts its rings, however many streams and channels it runs (with
/// `caller_receives` too): they start with the first channel, stay while the transport lives
/// and end with it. The server's gauge counts its rings, whatever it serves.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_threads_are_its_rings_however_many_streams() {
    if !uring_usable() {
        return;
    }
    let gauge = |s: &ferry_transport_uring::IoStats| s.threads.load(Ordering::Relaxed);
    let settle = |want: u64, what: &str, get: &dyn Fn() -> u64| {
        let end = std::time::Instant::now() + Duration::from_secs(10);
        while get() != want {
            assert!(
                std::time::Instant::now() < end,
                "{what}: {} threads, want {want}",
                get()
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    };
    for caller_receives in [false, true] {
        let t = UringTransport::new(UringConfig {
            streams: 3,
            client_rings: 2,
            caller_receives,
            ..UringConfig::default()
        })
        .unwrap();
        let server = UringConfig {
            server_rings: 2,
            ..t.config().clone()
        };
        let h = serve_uring(&Arc::new(Table::default()), server);
        let addr = h.local_addr();
        let offer = t.offer();
        let peer = tokio::task::spawn_blocking(move || peer_info(addr, offer))
            .await
            .unwrap();
        assert_eq!(gauge(h.stats()), 2);
        assert_eq!(gauge(t.stats()), 0, "nothing before the first channel");
        let ch = t.open(peer.clone()).await.unwrap();
        let ch2 = t.open(peer).await.unwrap();
        assert_eq!(
            gauge(t.stats()),
            2,
            "caller_receives {caller_receives}, two channels"
        );
        assert_eq!(t.client_rings_running(), 2);
        assert_eq!(gauge(h.stats()), 2, "server with the channels open");
        drop((ch, ch2));
        settle(2, "client after the drop", &|| gauge(t.stats()));
        assert_eq!(gauge(h.stats()), 2, "server after the drop");
        let stats = t.stats_handle();
        drop(t);
        settle(0, "client after the transport's drop", &|| gauge(&stats));
    }
}

const PAIRS: &[(Side, Side)] = &[
    (Side::Uring(ZeroCopy::Auto), Side::Uring(ZeroCopy::Auto)),
    (Side::Uring(ZeroCopy::Never), Side::Uring(ZeroCopy::Never)),
    (Side::Uring(ZeroCopy::Always), Side::Uring(ZeroCopy::Always)),
    (Side::Uring(ZeroCopy::Auto), TCP),
    (TCP, Side::Uring(ZeroCopy::Auto)),
    (Side::Uring(ZeroCopy::Auto), Side::Rings(ZeroCopy::Auto)),
    (Side::Uring(ZeroCopy::Never), Side::Rings(ZeroCopy::Auto)),
    (Side::Uring(ZeroCopy::Always), Side::Rings(ZeroCopy::Always)),
    (TCP, Side::Rings(ZeroCopy::Auto)),
    // Streams on I/O threads (two, fewer than the streams) and on the caller's runtime, on
    // either side.
    (Side::Tcp(Some(2)), Side::Tcp(Some(2))),
    (Side::Tcp(None), Side::Tcp(None)),
    (Side::Tcp(None), Side::Tcp(Some(1))),
    (Side::Tcp(Some(0)), Side::Tcp(None)),
];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn write_then_read_many_sizes_unaligned() {
    for (client, server) in runnable(PAIRS) {
        let f = start(server);
        let size = 20 << 20;
        let (tok, remote) = publish(
            &f.table,
            "seg",
            size,
            Access::REMOTE_READ | Access::REMOTE_WRITE,
        );
        let src = Arc::new(MemoryRegion::alloc_zeroed(size, 4096).unwrap());
        fill(&src, 7);
        let dst = Arc::new(MemoryRegion::alloc_zeroed(size, 4096).unwrap());
        for &(streams, chunk) in &[(3usize, 64u64 << 10), (1, 1 << 20)] {
            let ch = channel(&f, client, streams, chunk).await;
            for &(lo, ro, len) in &[
                (0u64, 0u64, 1u64),
                (3, 5, 100),
                (1, 4097, 200_001),
                (17, 33, (3 << 20) - 40),
                (4095, 12_345, (16 << 20) + 3),
            ] {
                let o = run(&ch, vec![op(OpKind::Write, &src, lo, tok, ro, len)]).await;
                assert!(o.is_success() && o.drained, "{client:?}->{server:?}: {o:?}");
                assert!(
                    bytes(&remote, ro, len as usize) == bytes(&src, lo, len as usize),
                    "{client:?}->{server:?} write {lo} {ro} {len}"
                );
                let o = run(&ch, vec![op(OpKind::Read, &dst, lo + 1, tok, ro, len)]).await;
                assert!(o.is_success() && o.drained, "{client:?}->{server:?}: {o:?}");
                assert_eq!(o.completed_bytes, len);
                assert!(
                    bytes(&dst, lo + 1, len as usize) == bytes(&src, lo, len as usize),
                    "{client:?}->{server:?} read {lo} {ro} {len}"
                );
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refusals_move_no_byte() {
    for (client, server) in runnable(PAIRS) {
        let f = start(server);
        let (ro_tok, ro_seg) = publish(&f.table, "ro", 4096, Access::REMOTE_READ);
        let (rw_tok, rw_seg) = publish(
            &f.table,
            "rw",
            4096,
            Access::REMOTE_READ | Access::REMOTE_WRITE,
        );
        let (wo_tok, _) = publish(&f.table, "wo", 4096, Access::REMOTE_WRITE);
        let ch = channel(&f, client, 1, 1 << 20).await;
        let src = Arc::new(MemoryRegion::alloc_zeroed(8192, 4096).unwrap());
        fill(&src, 3);
        let cases = [
            (
                op(OpKind::Write, &src, 0, SegmentToken(12345), 0, 100),
                RemoteStatus::UnknownSegment,
            ),
            (
                op(OpKind::Write, &src, 0, ro_tok, 0, 100),
                RemoteStatus::AccessDenied,
            ),
            (
                op(OpKind::Read, &src, 0, wo_tok, 0, 100),
                RemoteStatus::AccessDenied,
            ),
            (
                op(OpKind::Write, &src, 0, rw_tok, 4000, 200),
                RemoteStatus::OutOfBounds,
            ),
            (
                op(OpKind::Read, &src, 0, rw_tok, u64::MAX - 1, 4),
                RemoteStatus::OutOfBounds,
            ),
        ];
        for (o, status) in cases {
            let out = run(&ch, vec![op(OpKind::Write, &src, 0, rw_tok, 0, 10), o]).await;
            assert_eq!(out.completed_ops, 1, "{client:?}->{server:?}");
            let fail = out.failure.unwrap();
            assert_eq!(
                (fail.op_index, fail.kind),
                (1, FailureKind::Remote(status)),
                "{client:?}->{server:?}"
            );
            assert_eq!(out.remote_effect, RemoteEffect::None);
            assert!(out.drained);
        }
        assert!(bytes(&ro_seg, 0, 4096).iter().all(|&b| b == 0));
        assert_eq!(bytes(&rw_seg, 0, 10), bytes(&src, 0, 10));
        assert!(bytes(&rw_seg, 10, 4086).iter().all(|&b| b == 0));
        // The stream survives refusals (a refused WRITE's payload was drained).
        let out = run(&ch, vec![op(OpKind::Write, &src, 0, rw_tok, 0, 4096)]).await;
        assert!(out.is_success(), "{client:?}->{server:?}: {out:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stale_epoch_stream_is_refused() {
    let uring = Side::Uring(ZeroCopy::Auto);
    for (client, server) in runnable(&[(uring, uring), (uring, TCP), (TCP, TCP)]) {
        let f = start(server);
        let (t, offer): (Arc<dyn Transport>, _) = match client {
            Side::Uring(_) | Side::Rings(_) => (
                Arc::new(UringTransport::new(UringConfig::default()).unwrap()),
                TransportOffer::Uring {
                    streams: 1,
                    port: 0,
                    zero_copy: false,
                },
            ),
            Side::Tcp(_) => (
                Arc::new(TcpTransport::new(TcpConfig::default())),
                TransportOffer::Tcp {
                    streams: 1,
                    port: 0,
                },
            ),
        };
        let res = t
            .open(PeerInfo {
                addr: f.addr,
                local_id: PeerId::random(),
                local_epoch: Epoch::fresh(),
                remote_id: PeerId::random(),
                remote_epoch: Epoch(f.epoch.0 ^ 1),
                offer,
                segments: vec![],
                session: None,
                key_name: None,
                version: ferry_core::wire::SUPPORTED_VERSIONS.max,
            })
            .await;
        match res {
            Err(Error::StaleEpoch { found, .. }) => assert_eq!(found, f.epoch),
            other => panic!("{client:?}->{server:?}: expected StaleEpoch, got {other:?}"),
        }
    }
}

/// A server that shares no protocol version with the client refuses its hello, and the client's
/// error names both ranges.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn protocol_mismatch_names_both_ranges() {
    let theirs = VersionRange { min: 7, max: 9 };
    let f = start_with(TCP, theirs);
    let hello = Hello {
        versions: SUPPORTED_VERSIONS,
        peer_id: PeerId::random(),
        epoch: Epoch::fresh(),
        transports: vec![],
        segments: vec![],
    };
    match ferry_transport_tcp::handshake(f.addr, &hello, Duration::from_secs(5)).await {
        Err(Error::ProtocolMismatch { local, remote, .. }) => {
            assert_eq!(local, SUPPORTED_VERSIONS);
            assert_eq!(remote, theirs);
        }
        other => panic!("expected ProtocolMismatch, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn handshake_says_which_engine_each_side_has() {
    if !uring_usable() {
        return;
    }
    let f = start(Side::Uring(ZeroCopy::Never));
    let t = TcpTransport::new(TcpConfig::default());
    let addr = f.addr;
    let peer = tokio::task::spawn_blocking(move || peer_info(addr, t.offer()))
        .await
        .unwrap();
    assert!(
        matches!(
            peer.offer,
            TransportOffer::Uring {
                zero_copy: false,
                ..
            }
        ),
        "{:?}",
        peer.offer
    );
    let f = start(TCP);
    let addr = f.addr;
    let peer = tokio::task::spawn_blocking(move || {
        peer_info(
            addr,
            TransportOffer::Uring {
                streams: 64,
                port: 0,
                zero_copy: true,
            },
        )
    })
    .await
    .unwrap();
    assert!(
        matches!(peer.offer, TransportOffer::Tcp { .. }),
        "{:?}",
        peer.offer
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_does_not_hurt_the_server() {
    for (client, server) in runnable(&[
        (TCP, Side::Uring(ZeroCopy::Auto)),
        (TCP, Side::Rings(ZeroCopy::Auto)),
        (TCP, TCP),
    ]) {
        let f = start(server);
        let mut s = std::net::TcpStream::connect(f.addr).unwrap();
        s.write_all(b"FRRY\x01\x00\x01\x00\xff\xff\xff\xff")
            .unwrap();
        let mut s2 = std::net::TcpStream::connect(f.addr).unwrap();
        s2.write_all(&[0xAB; 64]).unwrap();
        drop((s, s2));
        let (tok, _) = publish(&f.table, "x", 100, Access::REMOTE_READ);
        let ch = channel(&f, client, 1, 1 << 20).await;
        let dst = Arc::new(MemoryRegion::alloc_zeroed(100, 64).unwrap());
        assert!(
            run(&ch, vec![op(OpKind::Read, &dst, 0, tok, 0, 100)])
                .await
                .is_success(),
            "{client:?}->{server:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn closed_channel_fails_without_effect() {
    for (client, server) in runnable(&[(Side::Uring(ZeroCopy::Auto), TCP), (TCP, TCP)]) {
        let f = start(server);
        let (tok, _) = publish(&f.table, "x", 100, Access::REMOTE_WRITE);
        let ch = channel(&f, client, 2, 1 << 20).await;
        ch.close();
        assert!(!ch.is_alive(), "{client:?}");
        let src = Arc::new(MemoryRegion::alloc_zeroed(100, 64).unwrap());
        let o = run(&ch, vec![op(OpKind::Write, &src, 0, tok, 0, 100)]).await;
        assert_eq!(
            o.failure.map(|f| f.kind),
            Some(FailureKind::PeerLost),
            "{client:?}"
        );
        assert_eq!(o.remote_effect, RemoteEffect::None);
        assert!(o.drained);
    }
}

/// Accepts one stream on `l`, answering its attach.
fn accept_stream(l: &TcpListener) -> std::net::TcpStream {
    let (mut s, _) = l.accept().unwrap();
    let mut head = [0u8; ferry_core::wire::CONTROL_HEADER_LEN];
    s.read_exact(&mut head).unwrap();
    let h = ferry_core::wire::ControlHeader::decode(&head).unwrap();
    let mut body = vec![0u8; h.body_len as usize];
    s.read_exact(&mut body).unwrap();
    let mut out = Vec::new();
    ControlFrame::StreamAccept
        .encode(SUPPORTED_VERSIONS.max, &mut out)
        .unwrap();
    s.write_all(&out).unwrap();
    s
}

/// A server that accepts one stream (answering its attach) and then runs `script` on it.
fn scripted_server(
    script: impl FnOnce(std::net::TcpStream) + Send + 'static,
) -> (SocketAddr, std::thread::JoinHandle<()>) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let h = std::thread::spawn(move || script(accept_stream(&l)));
    (addr, h)
}

/// A server that accepts the stream, swallows part of a WRITE and dies without answering.
fn dying_server(swallow: usize) -> (SocketAddr, std::thread::JoinHandle<()>) {
    scripted_server(move |mut s| {
        let mut sink = vec![0u8; swallow];
        s.read_exact(&mut sink).unwrap();
    })
}

/// A one-stream channel of a transport with `config` to a scripted server at `addr`.
async fn open_one_stream(addr: SocketAddr, config: UringConfig) -> Arc<dyn Channel> {
    open_streams(
        addr,
        UringConfig {
            streams: 1,
            ..config
        },
    )
    .await
}

/// A channel of `config.streams` streams to a scripted server at `addr` (attached in order).
async fn open_streams(addr: SocketAddr, config: UringConfig) -> Arc<dyn Channel> {
    let streams = config.streams as u16;
    let t = UringTransport::new(config).unwrap();
    t.open(scripted_peer(addr, streams)).await.unwrap()
}

/// The peer a scripted server at `addr` stands for (no handshake: its streams are attached
/// directly).
fn scripted_peer(addr: SocketAddr, streams: u16) -> PeerInfo {
    PeerInfo {
        addr,
        local_id: PeerId::random(),
        local_epoch: Epoch::fresh(),
        remote_id: PeerId::random(),
        remote_epoch: Epoch(1),
        offer: TransportOffer::Tcp { streams, port: 0 },
        segments: vec![],
        session: None,
        key_name: None,
        version: ferry_core::wire::SUPPORTED_VERSIONS.max,
    }
}

/// Reads `n` WRITE requests with their payloads; returns them.
fn read_writes(s: &mut std::net::TcpStream, n: usize) -> Vec<DataRequest> {
    (0..n)
        .map(|_| {
            let mut h = [0u8; DATA_REQUEST_LEN];
            s.read_exact(&mut h).unwrap();
            let r = DataRequest::decode(&h).unwrap();
            assert_eq!(r.kind, OpKind::Write);
            let mut sink = vec![0u8; r.len as usize];
            s.read_exact(&mut sink).unwrap();
            r
        })
        .collect()
}

fn respond(s: &mut std::net::TcpStream, seq: u32, also_acks: u16) {
    let mut b = [0u8; DATA_RESPONSE_LEN];
    DataResponse {
        seq,
        refused: None,
        len: 0,
        also_acks,
    }
    .encode(&mut b);
    s.write_all(&b).unwrap();
}

/// Serves WRITEs on `s` (one response each) until the client closes it; returns them.
fn serve_writes(s: &mut std::net::TcpStream) -> Vec<DataRequest> {
    let mut got = Vec::new();
    loop {
        let mut h = [0u8; DATA_REQUEST_LEN];
        if s.read_exact(&mut h).is_err() {
            return got;
        }
        let r = DataRequest::decode(&h).unwrap();
        let mut sink = vec![0u8; r.len as usize];
        s.read_exact(&mut sink).unwrap();
        respond(s, r.seq, 0);
        got.push(r);
    }
}

/// A loopback WRITE spliced into a socket whose peer does not read fills the socket: the client
/// ring waits for room on the ring, never in the call, so another channel on the same ring
/// completes its requests meanwhile; once the peer reads, the payload arrives whole and in order
/// and the response completes the request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_spliced_write_into_a_full_socket_waits_on_the_ring_not_in_the_call() {
    if !uring_usable() {
        return;
    }
    let t = UringTransport::new(UringConfig {
        streams: 1,
        client_rings: 1,
        chunk_size: 16 << 20,
        ..UringConfig::default()
    })
    .unwrap();
    if !t.config().kernel_splice {
        ferry_tests::require_or_skip(
            ferry_tests::URING,
            "the kernel lacks io_uring SPLICE, so loopback WRITEs are not spliced",
        );
        return;
    }
    let len = 16 << 20;
    let (go_tx, go_rx) = std::sync::mpsc::channel::<()>();
    let (got_tx, got_rx) = std::sync::mpsc::channel::<Vec<u8>>();
    let (addr, h) = scripted_server(move |mut s| {
        // Nothing is read until the client waits for room.
        if go_rx.recv().is_err() {
            return;
        }
        let mut head = [0u8; DATA_REQUEST_LEN];
        s.read_exact(&mut head).unwrap();
        let r = DataRequest::decode(&head).unwrap();
        let mut got = vec![0u8; r.len as usize];
        s.read_exact(&mut got).unwrap();
        respond(&mut s, r.seq, 0);
        let _ = got_tx.send(got);
    });
    let slow = t.open(scripted_peer(addr, 1)).await.unwrap();
    // A real server for a second channel on the same (only) client ring.
    let f = start(Side::Rings(ZeroCopy::Auto));
    let (tok, remote) = publish(
        &f.table,
        "x",
        1 << 20,
        Access::REMOTE_READ | Access::REMOTE_WRITE,
    );
    let offer = t.offer();
    let fast_addr = f.addr;
    let peer = tokio::task::spawn_blocking(move || peer_info(fast_addr, offer))
        .await
        .unwrap();
    let fast = t.open(peer).await.unwrap();
    let src = Arc::new(MemoryRegion::alloc_zeroed(len, 4096).unwrap());
    fill(&src, 41);
    let write = tokio::spawn({
        let (slow, src) = (slow.clone(), src.clone());
        async move {
            run(
                &slow,
                vec![op(OpKind::Write, &src, 0, SegmentToken(9), 0, len as u64)],
            )
            .await
        }
    });
    let end = std::time::Instant::now() + Duration::from_secs(30);
    while t.stats().room_waits.load(Ordering::Relaxed) == 0 {
        assert!(
            std::time::Instant::now() < end,
            "the spliced WRITE never found its socket full"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // The ring is not held by the full socket: the other channel's requests complete.
    let small = Arc::new(MemoryRegion::alloc_zeroed(1 << 20, 4096).unwrap());
    fill(&small, 42);
    for _ in 0..3 {
        let o = tokio::time::timeout(
            Duration::from_secs(30),
            run(&fast, vec![op(OpKind::Write, &small, 0, tok, 0, 1 << 20)]),
        )
        .await
        .expect("the ring is held by the full socket");
        assert!(o.is_success(), "{o:?}");
    }
    assert!(bytes(&remote, 0, 1 << 20) == bytes(&small, 0, 1 << 20));
    go_tx.send(()).unwrap();
    let got = got_rx.recv().unwrap();
    h.join().unwrap();
    assert!(got == bytes(&src, 0, len), "the spliced payload differs");
    let o = write.await.unwrap();
    assert!(o.is_success() && o.drained, "{o:?}");
}

/// With SEND_ZC forced, a client ring sends WRITE payloads zero-copy from a registered region
/// and from one too large to register (the unregistered fallback); the requests are drained
/// only once every notification came, and the bytes arrive in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn zero_copy_writes_are_let_go_and_fall_back_to_unregistered_buffers() {
    if !uring_usable() {
        return;
    }
    if !ferry_transport_uring::probe_kernel().supports("SEND_ZC") {
        ferry_tests::require_or_skip(ferry_tests::URING, "the kernel lacks io_uring SEND_ZC");
        return;
    }
    let (got_tx, got_rx) = std::sync::mpsc::channel::<Vec<Vec<u8>>>();
    let (addr, h) = scripted_server(move |mut s| {
        let mut got = Vec::new();
        for _ in 0..2 {
            let mut head = [0u8; DATA_REQUEST_LEN];
            s.read_exact(&mut head).unwrap();
            let r = DataRequest::decode(&head).unwrap();
            let mut payload = vec![0u8; r.len as usize];
            s.read_exact(&mut payload).unwrap();
            respond(&mut s, r.seq, 0);
            got.push(payload);
        }
        let _ = got_tx.send(got);
    });
    let t = UringTransport::new(UringConfig {
        streams: 1,
        zero_copy: ZeroCopy::Always,
        splice_loopback: false,
        ..UringConfig::default()
    })
    .unwrap();
    let ch = t.open(scripted_peer(addr, 1)).await.unwrap();
    let small = Arc::new(MemoryRegion::alloc_zeroed(1 << 20, 4096).unwrap());
    fill(&small, 7);
    // Larger than the kernel registers in one buffer: sent unregistered. (Both WRITEs are
    // larger than what a submitter sends directly, with a copy.)
    let huge = Arc::new(MemoryRegion::alloc_zeroed((1 << 30) + (64 << 10), 4096).unwrap());
    huge.write_at(1 << 30, &[9u8; 64 << 10]).unwrap();
    let o = run(
        &ch,
        vec![op(OpKind::Write, &small, 0, SegmentToken(9), 0, 1 << 20)],
    )
    .await;
    assert!(o.is_success() && o.drained, "{o:?}");
    let o = run(
        &ch,
        vec![op(
            OpKind::Write,
            &huge,
            1 << 30,
            SegmentToken(9),
            0,
            64 << 10,
        )],
    )
    .await;
    assert!(o.is_success() && o.drained, "{o:?}");
    let got = got_rx.recv().unwrap();
    h.join().unwrap();
    assert!(
        got[0] == bytes(&small, 0, 1 << 20),
        "the registered payload differs"
    );
    assert!(
        got[1].iter().all(|&b| b == 9),
        "the unregistered payload differs"
    );
    let s = t.stats();
    let zc = s.zc_sends.load(Ordering::Relaxed);
    assert!(zc >= 2, "{zc} zero-copy sends");
    // Drained: every notification came.
    assert_eq!(s.notifications.load(Ordering::Relaxed), zc);
    assert_eq!(
        s.fixed_sends.load(Ordering::Relaxed),
        1,
        "only the small region is registered"
    );
}

/// A zero-copy WRITE the peer never takes (its window is full, it never reads) keeps its request
/// un-drained after the stream ends, until the ring, after the grace, resets the connection (the
/// peer sees a reset) and the kernel lets the pages go: then the request ends, lost and drained.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unacknowledged_zero_copy_writes_are_let_go_by_a_reset_after_the_grace() {
    if !uring_usable() {
        return;
    }
    if !ferry_transport_uring::probe_kernel().supports("SEND_ZC") {
        ferry_tests::require_or_skip(ferry_tests::URING, "the kernel lacks io_uring SEND_ZC");
        return;
    }
    // A tiny receive window (set on the listener, so the handshake advertises it).
    let l = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
    l.set_recv_buffer_size(4096).unwrap();
    l.bind(&"127.0.0.1:0".parse::<SocketAddr>().unwrap().into())
        .unwrap();
    l.listen(1).unwrap();
    let l: TcpListener = l.into();
    let addr = l.local_addr().unwrap();
    let (end_tx, end_rx) = std::sync::mpsc::channel::<()>();
    let h = std::thread::spawn(move || {
        let mut s = accept_stream(&l);
        // Nothing is read until the client's request has ended.
        let _ = end_rx.recv();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let mut buf = vec![0u8; 128 << 10];
        loop {
            match s.read(&mut buf) {
                Ok(0) => return std::io::ErrorKind::UnexpectedEof,
                Ok(_) => {}
                Err(e) => return e.kind(),
            }
        }
    });
    let t = UringTransport::new(UringConfig {
        streams: 1,
        zero_copy: ZeroCopy::Always,
        splice_loopback: false,
        socket_buffer: Some(1 << 20),
        ..UringConfig::default()
    })
    .unwrap();
    let ch = t.open(scripted_peer(addr, 1)).await.unwrap();
    let src = Arc::new(MemoryRegion::alloc_zeroed(64 << 10, 4096).unwrap());
    let write = tokio::spawn({
        let (ch, src) = (ch.clone(), src.clone());
        async move {
            run(
                &ch,
                vec![op(OpKind::Write, &src, 0, SegmentToken(9), 0, 64 << 10)],
            )
            .await
        }
    });
    let end = std::time::Instant::now() + Duration::from_secs(30);
    while t.stats().zc_sends.load(Ordering::Relaxed) == 0 {
        assert!(std::time::Instant::now() < end, "no zero-copy send");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(t.stats().notifications.load(Ordering::Relaxed), 0);
    // The channel goes: its stream ends with the send unacknowledged.
    let t0 = std::time::Instant::now();
    ch.close();
    drop(ch);
    let o = tokio::time::timeout(Duration::from_secs(20), write)
        .await
        .expect("the request never ended: its hold was never released")
        .unwrap();
    let took = t0.elapsed();
    assert!(
        matches!(o.failure.map(|f| f.kind), Some(FailureKind::PeerLost)),
        "{o:?}"
    );
    assert!(o.drained, "{o:?}");
    assert_eq!(t.stats().notifications.load(Ordering::Relaxed), 1);
    assert!(took >= Duration::from_millis(900), "no grace: {took:?}");
    let _ = end_tx.send(());
    assert_eq!(h.join().unwrap(), std::io::ErrorKind::ConnectionReset);
}

/// A stream that dies hands the chunks dealt to it but not yet sent to the channel's other
/// streams, on both data planes: the chunk it lost fails its request as uncertain, and another
/// request whose chunks waited behind it on that stream still completes, every chunk over the
/// surviving stream.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dying_stream_hands_its_waiting_chunks_to_the_others() {
    if !uring_usable() {
        return;
    }
    const CHUNK: u64 = 32 << 20;
    for client in [Side::Uring(ZeroCopy::Auto), TCP] {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let h = std::thread::spawn(move || {
            let mut s0 = accept_stream(&l);
            let mut s1 = accept_stream(&l);
            // Stream 0 takes request A's chunk but not its payload, so its sender stays stuck
            // in that send (more than the socket buffers hold) while request B's chunks are
            // dealt to both streams; then it dies unanswered.
            let mut head = [0u8; DATA_REQUEST_LEN];
            s0.read_exact(&mut head).unwrap();
            std::thread::sleep(Duration::from_millis(300));
            drop(s0);
            // Stream 1 stays busy (its first chunk unanswered) until stream 0 is surely gone,
            // so it cannot take stream 0's chunks by itself; then it serves everything.
            let first = read_writes(&mut s1, 1);
            std::thread::sleep(Duration::from_millis(300));
            respond(&mut s1, first[0].seq, 0);
            let mut all = first;
            all.extend(serve_writes(&mut s1));
            all
        });
        let ch = match client {
            Side::Uring(_) | Side::Rings(_) => {
                open_streams(
                    addr,
                    UringConfig {
                        streams: 2,
                        chunk_size: CHUNK,
                        depth: 1,
                        ..UringConfig::default()
                    },
                )
                .await
            }
            Side::Tcp(_) => TcpTransport::new(TcpConfig {
                streams: 2,
                chunk_size: CHUNK,
                depth: 1,
                ..TcpConfig::default()
            })
            .open(scripted_peer(addr, 2))
            .await
            .unwrap(),
        };
        let src = Arc::new(MemoryRegion::alloc_zeroed(4 * CHUNK as usize, 4096).unwrap());
        let a = run(
            &ch,
            vec![op(OpKind::Write, &src, 0, SegmentToken(5), 0, CHUNK)],
        );
        let b = run(
            &ch,
            vec![op(OpKind::Write, &src, 0, SegmentToken(5), 0, 4 * CHUNK)],
        );
        let (a, b) = tokio::join!(a, b);
        assert_eq!(
            a.failure.map(|f| f.kind),
            Some(FailureKind::PeerLost),
            "{client:?}: {a:?}"
        );
        assert_eq!(a.remote_effect, RemoteEffect::Uncertain, "{client:?}");
        assert!(b.is_success() && b.drained, "{client:?}: {b:?}");
        assert_eq!(b.completed_bytes, 4 * CHUNK);
        assert!(ch.is_alive(), "{client:?}: stream 1 lives");
        drop(ch);
        let mut offsets: Vec<u64> = h.join().unwrap().iter().map(|r| r.offset).collect();
        offsets.sort_unstable();
        assert_eq!(offsets, [0, CHUNK, 2 * CHUNK, 3 * CHUNK], "{client:?}");
    }
}

/// The client's side of held-back responses: its WRITE requests allow them (`ack_slack` counts
/// the chunks in flight), one response for four WRITEs resolves all four, and a response that
/// claims chunks not in flight closes the stream with the request failed as lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn held_back_responses_resolve_every_chunk_they_name() {
    if !uring_usable() {
        return;
    }
    let (addr, h) = scripted_server(|mut s| {
        let reqs = read_writes(&mut s, 4);
        let slack: Vec<u16> = reqs.iter().map(|r| r.ack_slack).collect();
        // Posted one after another with room for all four: 1, 2, 3, 4 in flight, of which the
        // server may hold back all but one (loopback).
        assert_eq!(slack, [0, 1, 2, 3]);
        respond(&mut s, reqs[3].seq, 3);
        // Then a response that names one more chunk than is in flight.
        let reqs = read_writes(&mut s, 2);
        respond(&mut s, reqs[1].seq, 2);
        let mut rest = Vec::new();
        let _ = s.read_to_end(&mut rest);
    });
    let ch = open_one_stream(
        addr,
        UringConfig {
            chunk_size: 1000,
            depth: 8,
            ..UringConfig::default()
        },
    )
    .await;
    let src = Arc::new(MemoryRegion::alloc_zeroed(4000, 64).unwrap());
    let o = run(
        &ch,
        vec![op(OpKind::Write, &src, 0, SegmentToken(5), 0, 4000)],
    )
    .await;
    assert!(o.is_success() && o.drained, "{o:?}");
    assert_eq!(o.completed_bytes, 4000);
    let o = run(
        &ch,
        vec![op(OpKind::Write, &src, 0, SegmentToken(5), 0, 2000)],
    )
    .await;
    assert_eq!(
        o.failure.map(|f| f.kind),
        Some(FailureKind::PeerLost),
        "{o:?}"
    );
    assert_eq!(o.remote_effect, RemoteEffect::Uncertain);
    assert!(o.drained);
    assert!(!ch.is_alive());
    drop(ch);
    h.join().unwrap();
}

/// The server's side: with many WRITE chunks in flight on one stream it holds responses back
/// (counted), every byte still lands, and READs and refusals in between are answered in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_holds_back_write_responses_and_keeps_order() {
    if !uring_usable() {
        return;
    }
    for side in [Side::Uring(ZeroCopy::Auto), Side::Rings(ZeroCopy::Auto)] {
        let f = start(side);
        let ServerHandle::Uring(server) = &f._server else {
            unreachable!()
        };
        let size = 16 << 20;
        let (tok, remote) = publish(
            &f.table,
            "seg",
            size,
            Access::REMOTE_READ | Access::REMOTE_WRITE,
        );
        let (ro_tok, _) = publish(&f.table, "ro", 4096, Access::REMOTE_READ);
        let src = Arc::new(MemoryRegion::alloc_zeroed(size, 4096).unwrap());
        fill(&src, 11);
        let dst = Arc::new(MemoryRegion::alloc_zeroed(size, 4096).unwrap());
        let ch = channel(&f, Side::Uring(ZeroCopy::Auto), 1, 64 << 10).await;
        let o = run(&ch, vec![op(OpKind::Write, &src, 0, tok, 0, size as u64)]).await;
        assert!(o.is_success() && o.drained, "{o:?}");
        assert!(bytes(&remote, 0, size) == bytes(&src, 0, size));
        let held = server.stats().held_responses.load(Ordering::Relaxed);
        assert!(
            held > 0,
            "256 chunks in flight four at a time, none held back"
        );
        // Held-back WRITEs, then a READ, a refused WRITE and more WRITEs, in one request.
        let half = (size / 2) as u64;
        let o = run(
            &ch,
            vec![
                op(OpKind::Write, &src, half, tok, 0, half),
                op(OpKind::Read, &dst, 0, tok, 0, half),
                op(OpKind::Write, &src, 0, tok, half, half),
                op(OpKind::Write, &src, 0, ro_tok, 0, 100),
            ],
        )
        .await;
        assert_eq!(o.completed_ops, 3, "{o:?}");
        assert_eq!(
            o.failure.map(|f| (f.op_index, f.kind)),
            Some((3, FailureKind::Remote(RemoteStatus::AccessDenied)))
        );
        assert!(bytes(&dst, 0, half as usize) == bytes(&src, half, half as usize));
        assert!(bytes(&remote, half, half as usize) == bytes(&src, 0, half as usize));
        assert!(ch.is_alive());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn peer_lost_mid_write_is_uncertain() {
    if !uring_usable() {
        return;
    }
    for zc in [ZeroCopy::Auto, ZeroCopy::Always, ZeroCopy::Never] {
        let (addr, h) = dying_server(300_000);
        let ch = open_one_stream(
            addr,
            UringConfig {
                chunk_size: 64 << 10,
                zero_copy: zc,
                splice_loopback: zc == ZeroCopy::Auto,
                ..UringConfig::default()
            },
        )
        .await;
        let src = Arc::new(MemoryRegion::alloc_zeroed(8 << 20, 4096).unwrap());
        let o = run(
            &ch,
            vec![
                op(OpKind::Write, &src, 0, SegmentToken(9), 0, 8 << 20),
                op(OpKind::Read, &src, 0, SegmentToken(9), 0, 10),
            ],
        )
        .await;
        h.join().unwrap();
        assert_eq!(o.completed_ops, 0, "{o:?}");
        assert_eq!(
            o.failure.map(|f| (f.op_index, f.kind)),
            Some((0, FailureKind::PeerLost))
        );
        assert_eq!(o.remote_effect, RemoteEffect::Uncertain, "{zc:?}");
        assert!(o.drained);
        assert!(!ch.is_alive());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_shutdown_loses_the_peer() {
    if !uring_usable() {
        return;
    }
    for (client, server) in [
        (Side::Uring(ZeroCopy::Auto), Side::Uring(ZeroCopy::Auto)),
        (TCP, Side::Uring(ZeroCopy::Auto)),
        (Side::Uring(ZeroCopy::Auto), Side::Rings(ZeroCopy::Auto)),
        (TCP, Side::Rings(ZeroCopy::Auto)),
    ] {
        let f = start(server);
        let (tok, _) = publish(&f.table, "x", 1 << 20, Access::REMOTE_WRITE);
        let ch = channel(&f, client, 2, 64 << 10).await;
        let src = Arc::new(MemoryRegion::alloc_zeroed(1 << 20, 4096).unwrap());
        assert!(
            run(&ch, vec![op(OpKind::Write, &src, 0, tok, 0, 1 << 20)])
                .await
                .is_success()
        );
        let Fixture { _server, .. } = f;
        drop(_server);
        let o = run(&ch, vec![op(OpKind::Write, &src, 0, tok, 0, 1 << 20)]).await;
        assert_eq!(
            o.failure.map(|f| f.kind),
            Some(FailureKind::PeerLost),
            "{client:?}: {o:?}"
        );
        assert!(o.drained);
        // A stream that carried nothing since the loss learns of it on its next chunk.
        let o = run(&ch, vec![op(OpKind::Write, &src, 0, tok, 0, 1 << 20)]).await;
        assert_eq!(
            o.failure.map(|f| f.kind),
            Some(FailureKind::PeerLost),
            "{client:?}: {o:?}"
        );
        assert!(!ch.is_alive(), "{client:?}");
    }
}

/// Four streams of one client on a server's two rings: the bytes move the same both ways, the
/// server runs its two ring threads whatever it serves, and shutting the server down closes every
/// stream.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_ring_servers_shutdown_closes_every_stream() {
    if !uring_usable() {
        return;
    }
    let table = Arc::new(Table::default());
    let config = UringConfig {
        server_rings: 2,
        ..UringConfig::default()
    };
    let h = serve_uring(&table, config);
    let addr = h.local_addr();
    let len = (5 << 20) + 333;
    let (tok, dst) = publish(&table, "x", len, Access::REMOTE_READ | Access::REMOTE_WRITE);
    let t = UringTransport::new(UringConfig {
        streams: 4,
        chunk_size: 256 << 10,
        depth: 4,
        ..UringConfig::default()
    })
    .unwrap();
    let offer = t.offer();
    let peer = tokio::task::spawn_blocking(move || peer_info(addr, offer))
        .await
        .unwrap();
    let ch = t.open(peer).await.unwrap();
    let stats = h.stats();
    assert_eq!(stats.threads.load(Ordering::Relaxed), 2);
    let src = Arc::new(MemoryRegion::alloc_zeroed(len, 4096).unwrap());
    fill(&src, 0x0f10);
    let o = run(&ch, vec![op(OpKind::Write, &src, 0, tok, 0, len as u64)]).await;
    assert!(o.is_success() && o.drained, "{o:?}");
    assert!(
        bytes(&dst, 0, len) == bytes(&src, 0, len),
        "written bytes differ"
    );
    let back = Arc::new(MemoryRegion::alloc_zeroed(len, 4096).unwrap());
    let o = run(&ch, vec![op(OpKind::Read, &back, 0, tok, 0, len as u64)]).await;
    assert!(o.is_success(), "{o:?}");
    assert!(
        bytes(&back, 0, len) == bytes(&src, 0, len),
        "read bytes differ"
    );
    assert_eq!(stats.threads.load(Ordering::Relaxed), 2);
    // Shut down: every stream is closed; within a few requests (each
    // dealt over all four streams) every stream has learned it.
    h.shutdown();
    let mut gone = false;
    for _ in 0..5 {
        let o = run(&ch, vec![op(OpKind::Write, &src, 0, tok, 0, len as u64)]).await;
        assert_eq!(
            o.failure.map(|f| f.kind),
            Some(FailureKind::PeerLost),
            "{o:?}"
        );
        assert!(o.drained);
        if !ch.is_alive() {
            gone = true;
            break;
        }
    }
    assert!(gone, "a stream outlived the server's shutdown");
}

/// Random requests on a raw data stream to the TCP server: every answer matches an oracle of the
/// checks (token, access, bounds), and the segment changes exactly where accepted WRITEs wrote.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_requests_match_the_oracle() {
    for (_, server) in runnable(&[(TCP, TCP), (TCP, Side::Rings(ZeroCopy::Auto))]) {
        random_requests_match_the_oracle_on(server).await;
    }
}

async fn random_requests_match_the_oracle_on(server: Side) {
    use ferry_core::wire::StreamAttach;
    use rand::{Rng, SeedableRng};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    let f = start(server);
    let (rw, rw_seg) = publish(
        &f.table,
        "rw",
        5000,
        Access::REMOTE_READ | Access::REMOTE_WRITE,
    );
    let (ro, ro_seg) = publish(&f.table, "ro", 3000, Access::REMOTE_READ);
    fill(&ro_seg, 11);
    let mut shadow_rw = vec![0u8; 5000];
    let shadow_ro = bytes(&ro_seg, 0, 3000);
    let mut s = tokio::net::TcpStream::connect(f.addr).await.unwrap();
    s.set_nodelay(true).unwrap();
    let mut frame = Vec::new();
    ControlFrame::StreamAttach(StreamAttach {
        peer_id: PeerId::random(),
        epoch: Epoch::fresh(),
        server_epoch: f.epoch,
        transport: 1,
        stream_index: 0,
    })
    .encode(1, &mut frame)
    .unwrap();
    s.write_all(&frame).await.unwrap();
    let mut accept = [0u8; 12];
    s.read_exact(&mut accept).await.unwrap();
    assert_eq!(
        ControlFrame::decode(&accept).unwrap().unwrap().0,
        ControlFrame::StreamAccept
    );
    let mut rng = rand::rngs::StdRng::seed_from_u64(42);
    for seq in 0..400u32 {
        let token = match rng.gen_range(0..3) {
            0 => rw,
            1 => ro,
            _ => SegmentToken(rng.r#gen()),
        };
        let kind = if rng.gen_bool(0.5) {
            OpKind::Read
        } else {
            OpKind::Write
        };
        let offset = rng.gen_range(0..6000u64);
        let len = rng.gen_range(0..3000u64);
        let req = DataRequest {
            kind,
            seq,
            token,
            offset,
            len,
            ack_slack: 0,
        };
        let mut head = [0u8; DATA_REQUEST_LEN];
        req.encode(&mut head);
        s.write_all(&head).await.unwrap();
        let payload: Vec<u8> = (0..len).map(|_| rng.r#gen()).collect();
        if kind == OpKind::Write {
            s.write_all(&payload).await.unwrap();
        }
        let (size, access) = if token == rw {
            (5000, Access::REMOTE_READ | Access::REMOTE_WRITE)
        } else if token == ro {
            (3000, Access::REMOTE_READ)
        } else {
            (0, Access::LOCAL)
        };
        let expect = if size == 0 {
            Some(RemoteStatus::UnknownSegment)
        } else if !access.contains(kind.needed_access()) {
            Some(RemoteStatus::AccessDenied)
        } else if offset + len > size {
            Some(RemoteStatus::OutOfBounds)
        } else {
            None
        };
        let mut rh = [0u8; DATA_RESPONSE_LEN];
        s.read_exact(&mut rh).await.unwrap();
        let resp = DataResponse::decode(&rh).unwrap();
        assert_eq!((resp.seq, resp.refused), (seq, expect), "{req:?}");
        if expect.is_none() {
            let (lo, hi) = (offset as usize, (offset + len) as usize);
            if kind == OpKind::Write {
                shadow_rw[lo..hi].copy_from_slice(&payload);
            } else {
                let mut got = vec![0u8; len as usize];
                s.read_exact(&mut got).await.unwrap();
                let want = if token == rw {
                    &shadow_rw[lo..hi]
                } else {
                    &shadow_ro[lo..hi]
                };
                assert_eq!(got, want);
            }
        }
    }
    assert_eq!(bytes(&rw_seg, 0, 5000), shadow_rw);
    assert_eq!(bytes(&ro_seg, 0, 3000), shadow_ro);
}

/// The TCP server serves file segments (the engine's `FileSegment`) by their positioned I/O:
/// WRITEs and READs across chunk and block boundaries, refusals that leave the file alone, and
/// chunks larger than its staging.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn file_segments_by_positioned_io() {
    for (_, server) in runnable(&[(TCP, TCP), (TCP, Side::Rings(ZeroCopy::Auto))]) {
        file_segments_by_positioned_io_on(server).await;
    }
}

async fn file_segments_by_positioned_io_on(server: Side) {
    let f = start(server);
    let dir = tempfile::tempdir_in("/var/tmp").unwrap();
    let add_file = |path: &std::path::Path, access| {
        let tok = SegmentToken::random();
        let seg = Arc::new(ferry_file::FileSegment::open(path, access).unwrap());
        f.table
            .files
            .lock()
            .unwrap()
            .insert(tok, (format!("file-{tok:?}"), seg));
        tok
    };
    let len = 10_000usize;
    let path = dir.path().join("file");
    let initial: Vec<u8> = (0..len).map(|i| (i * 31 % 251) as u8).collect();
    std::fs::write(&path, &initial).unwrap();
    let rw = add_file(&path, Access::REMOTE_READ | Access::REMOTE_WRITE);
    let ro = add_file(&path, Access::REMOTE_READ);
    let ch = channel(&f, TCP, 2, 4096).await;
    let src = Arc::new(MemoryRegion::alloc_zeroed(8192, 4096).unwrap());
    fill(&src, 9);
    let dst = Arc::new(MemoryRegion::alloc_zeroed(len, 4096).unwrap());
    // WRITE across chunk and block boundaries, then READ the whole file (its odd tail too).
    let o = run(&ch, vec![op(OpKind::Write, &src, 3, rw, 4001, 5000)]).await;
    assert!(o.is_success(), "{o:?}");
    let mut expect = initial.clone();
    expect[4001..9001].copy_from_slice(&bytes(&src, 3, 5000));
    assert!(std::fs::read(&path).unwrap() == expect);
    let o = run(&ch, vec![op(OpKind::Read, &dst, 0, ro, 0, len as u64)]).await;
    assert!(o.is_success() && o.drained, "{o:?}");
    assert!(bytes(&dst, 0, len) == expect);
    // Refused by the server's check without touching the file; the stream survives.
    for (o, status) in [
        (
            op(OpKind::Write, &src, 0, ro, 0, 100),
            RemoteStatus::AccessDenied,
        ),
        (
            op(OpKind::Write, &src, 0, rw, len as u64 - 10, 20),
            RemoteStatus::OutOfBounds,
        ),
    ] {
        let out = run(&ch, vec![o]).await;
        let fail = out.failure.unwrap();
        assert_eq!(fail.kind, FailureKind::Remote(status));
        assert_eq!(out.remote_effect, RemoteEffect::None);
    }
    assert!(
        std::fs::read(&path).unwrap() == expect,
        "a refused WRITE changed the file"
    );
    let o = run(&ch, vec![op(OpKind::Read, &dst, 0, ro, 5, 0)]).await;
    assert!(o.is_success(), "an empty READ: {o:?}");
    let o = run(&ch, vec![op(OpKind::Read, &dst, 1, rw, len as u64 - 7, 7)]).await;
    assert!(o.is_success(), "{o:?}");
    assert_eq!(bytes(&dst, 1, 7), expect[len - 7..]);

    // Chunks larger than the server's 1 MiB file staging move in pieces, both ways.
    let big = (5 << 19) + 333; // 2.5 MiB and an odd tail
    let big_path = dir.path().join("big");
    std::fs::write(&big_path, vec![0u8; big]).unwrap();
    let big_tok = add_file(&big_path, Access::REMOTE_READ | Access::REMOTE_WRITE);
    let ch = channel(&f, TCP, 1, 4 << 20).await;
    let src = Arc::new(MemoryRegion::alloc_zeroed(big, 4096).unwrap());
    fill(&src, 21);
    let o = run(
        &ch,
        vec![op(OpKind::Write, &src, 0, big_tok, 0, big as u64)],
    )
    .await;
    assert!(o.is_success(), "{o:?}");
    assert!(std::fs::read(&big_path).unwrap() == bytes(&src, 0, big));
    let back = Arc::new(MemoryRegion::alloc_zeroed(big, 4096).unwrap());
    let o = run(
        &ch,
        vec![op(OpKind::Read, &back, 0, big_tok, 0, big as u64)],
    )
    .await;
    assert!(o.is_success(), "{o:?}");
    assert!(bytes(&back, 0, big) == bytes(&src, 0, big));
}

/// Version-2 ranges, for a peer that predates vectored requests.
const V2: VersionRange = VersionRange { min: 1, max: 2 };

/// `n` small ops of `kind` at scattered, non-overlapping slots (4 KiB apart, in a shuffled
/// order, lengths 1 to 4000), local slot `i` for op `i`, remote slots permuted.
fn scattered(
    kind: OpKind,
    local: &Arc<MemoryRegion>,
    tok: SegmentToken,
    n: u64,
    seed: u64,
) -> Vec<ferry_core::Op> {
    let mut x = seed | 1;
    let mut slots: Vec<u64> = (0..n).collect();
    for i in (1..slots.len()).rev() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        slots.swap(i, (x % (i as u64 + 1)) as usize);
    }
    (0..n)
        .map(|i| {
            let len = 1 + (i * 7919 + seed) % 4000;
            op(
                kind,
                local,
                i * 4096 + i % 5,
                tok,
                slots[i as usize] * 4096 + 3,
                len,
            )
        })
        .collect()
}

/// Batches of many small ops at scattered offsets, WRITEs then READs and mixed batches (runs
/// of WRITEs and READs of other slots in one request), move exactly their bytes in every
/// pairing (io_uring and TCP clients against either server), over one and several streams,
/// both with peers of protocol version 3 (vectored requests) and with a client or a server
/// that speaks only version 2 (one request per op).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vectored_batches_move_scattered_pieces_in_every_pairing() {
    let pairs = [
        (Side::Uring(ZeroCopy::Auto), Side::Uring(ZeroCopy::Auto)),
        (Side::Uring(ZeroCopy::Never), TCP),
        (TCP, Side::Uring(ZeroCopy::Auto)),
        (Side::Uring(ZeroCopy::Auto), Side::Rings(ZeroCopy::Auto)),
        (TCP, Side::Rings(ZeroCopy::Auto)),
        (TCP, TCP),
        (Side::Tcp(None), Side::Tcp(None)),
    ];
    for (client, server) in runnable(&pairs) {
        for (server_versions, client_versions) in [
            (SUPPORTED_VERSIONS, SUPPORTED_VERSIONS),
            (V2, SUPPORTED_VERSIONS),
            (SUPPORTED_VERSIONS, V2),
        ] {
            let f = start_with(server, server_versions);
            let n = 300u64;
            let size = (2 * n * 4096) as usize;
            let (tok, remote) = publish(
                &f.table,
                "seg",
                size,
                Access::REMOTE_READ | Access::REMOTE_WRITE,
            );
            let src = Arc::new(MemoryRegion::alloc_zeroed(size, 4096).unwrap());
            fill(&src, 11);
            let dst = Arc::new(MemoryRegion::alloc_zeroed(size, 4096).unwrap());
            let tag =
                format!("{client:?}->{server:?} server {server_versions} client {client_versions}");
            for &(streams, chunk) in &[(1usize, 64u64 << 10), (3, 1 << 20)] {
                let ch = channel_with(&f, client, streams, chunk, client_versions).await;
                let writes = scattered(OpKind::Write, &src, tok, n, streams as u64);
                let o = run(&ch, writes.clone()).await;
                assert!(o.is_success() && o.drained, "{tag}: {o:?}");
                for w in &writes {
                    assert_eq!(
                        bytes(&remote, w.remote_offset, w.len as usize),
                        bytes(&src, w.local_offset, w.len as usize),
                        "{tag}: write"
                    );
                }
                let reads: Vec<_> = writes
                    .iter()
                    .map(|w| {
                        op(
                            OpKind::Read,
                            &dst,
                            w.local_offset,
                            tok,
                            w.remote_offset,
                            w.len,
                        )
                    })
                    .collect();
                let o = run(&ch, reads.clone()).await;
                assert!(o.is_success() && o.drained, "{tag}: {o:?}");
                assert_eq!(o.completed_ops, n as usize);
                for r in &reads {
                    assert_eq!(
                        bytes(&dst, r.local_offset, r.len as usize),
                        bytes(&src, r.local_offset, r.len as usize),
                        "{tag}: read"
                    );
                }
                // A mixed batch: runs of WRITEs into the upper half and READs of the lower.
                let upper: Vec<_> = scattered(OpKind::Write, &src, tok, n, 99)
                    .into_iter()
                    .map(|mut w| {
                        w.remote_offset += n * 4096;
                        w
                    })
                    .collect();
                let mut mixed = Vec::new();
                for (k, (w, r)) in upper.iter().zip(&reads).enumerate() {
                    if (k / 20) % 2 == 0 {
                        mixed.push(w.clone());
                    } else {
                        mixed.push(r.clone());
                    }
                }
                let o = run(&ch, mixed.clone()).await;
                assert!(o.is_success() && o.drained, "{tag} mixed: {o:?}");
                for m in &mixed {
                    if m.kind == OpKind::Write {
                        assert_eq!(
                            bytes(&remote, m.remote_offset, m.len as usize),
                            bytes(&src, m.local_offset, m.len as usize),
                            "{tag}: mixed write"
                        );
                    }
                }
            }
        }
    }
}

/// A piece refused in the middle of a batch (out of bounds, then against the segment's rights,
/// then an unknown segment), READs and WRITEs, in every pairing: the outcome completes exactly
/// the ops before it, whose bytes moved, fails at it with its refusal, and no later op's bytes
/// moved (no remote effect); the stream survives for the next batch.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_piece_refused_mid_batch_completes_exactly_the_ops_before_it() {
    let pairs = [
        (Side::Uring(ZeroCopy::Auto), Side::Uring(ZeroCopy::Auto)),
        (Side::Uring(ZeroCopy::Auto), TCP),
        (TCP, Side::Uring(ZeroCopy::Auto)),
        (Side::Uring(ZeroCopy::Auto), Side::Rings(ZeroCopy::Auto)),
        (TCP, TCP),
    ];
    for (client, server) in runnable(&pairs) {
        let f = start(server);
        let (rw_tok, rw_seg) = publish(
            &f.table,
            "rw",
            1 << 20,
            Access::REMOTE_READ | Access::REMOTE_WRITE,
        );
        let (ro_tok, _) = publish(&f.table, "ro", 1 << 20, Access::REMOTE_READ);
        fill(&rw_seg, 5);
        let ch = channel(&f, client, 1, 1 << 20).await;
        let src = Arc::new(MemoryRegion::alloc_zeroed(1 << 20, 4096).unwrap());
        fill(&src, 6);
        let dst = Arc::new(MemoryRegion::alloc_zeroed(1 << 20, 4096).unwrap());
        for kind in [OpKind::Write, OpKind::Read] {
            let local = if kind == OpKind::Write { &src } else { &dst };
            let bads = [
                (
                    op(kind, local, 0, rw_tok, (1 << 20) - 10, 100),
                    RemoteStatus::OutOfBounds,
                ),
                (
                    op(kind, local, 0, SegmentToken(4242), 0, 100),
                    RemoteStatus::UnknownSegment,
                ),
                (
                    op(kind, local, 0, ro_tok, 0, 100),
                    if kind == OpKind::Write {
                        RemoteStatus::AccessDenied
                    } else {
                        // READ access is there: this one is accepted; judged below.
                        RemoteStatus::Malformed
                    },
                ),
            ];
            for (case, (bad, status)) in bads.into_iter().enumerate() {
                let before = bytes(&rw_seg, 0, 1 << 20);
                let dst_before = bytes(&dst, 0, 1 << 20);
                let mut ops: Vec<_> = (0..12u64)
                    .map(|i| {
                        op(
                            kind,
                            local,
                            i * 8192,
                            rw_tok,
                            (case as u64 * 12 + i) * 8192,
                            3000 + i,
                        )
                    })
                    .collect();
                ops[7] = bad;
                let o = run(&ch, ops.clone()).await;
                let tag = format!("{client:?}->{server:?} {kind:?} case {case}");
                if status == RemoteStatus::Malformed {
                    assert!(o.is_success(), "{tag}: {o:?}");
                    continue;
                }
                assert_eq!(o.completed_ops, 7, "{tag}: {o:?}");
                let fail = o.failure.unwrap();
                assert_eq!(
                    (fail.op_index, fail.kind),
                    (7, FailureKind::Remote(status)),
                    "{tag}"
                );
                assert_eq!(o.remote_effect, RemoteEffect::None, "{tag}");
                assert!(o.drained);
                let after = bytes(&rw_seg, 0, 1 << 20);
                let dst_after = bytes(&dst, 0, 1 << 20);
                for (i, x) in ops.iter().enumerate() {
                    if i == 7 {
                        continue;
                    }
                    let (l, r, n) = (
                        x.local_offset as usize,
                        x.remote_offset as usize,
                        x.len as usize,
                    );
                    if kind == OpKind::Write {
                        let want = if i < 7 {
                            &bytes(&src, l as u64, n)[..]
                        } else {
                            &before[r..r + n]
                        };
                        assert_eq!(&after[r..r + n], want, "{tag}: op {i}");
                    } else {
                        let want = if i < 7 {
                            &after[r..r + n]
                        } else {
                            &dst_before[l..l + n]
                        };
                        assert_eq!(&dst_after[l..l + n], want, "{tag}: op {i}");
                    }
                }
            }
            // The stream survives.
            let o = run(
                &ch,
                vec![
                    op(OpKind::Write, &src, 0, rw_tok, 0, 4096),
                    op(OpKind::Write, &src, 0, rw_tok, 8192, 4096),
                ],
            )
            .await;
            assert!(o.is_success(), "{client:?}->{server:?}: {o:?}");
        }
    }
}

/// What goes on the wire: towards a peer whose common version is 2, a batch of small WRITEs is
/// one request per op; towards version 3, one vectored request naming every op, with their bytes
/// back to back; both clients (io_uring and TCP), a scripted server.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vectored_requests_go_only_to_version_3_peers() {
    for uring in [true, false] {
        if uring && !uring_usable() {
            continue;
        }
        for version in [2u16, 3] {
            let (addr, h) = scripted_server(move |mut s| {
                if version == 2 {
                    let reqs = read_writes(&mut s, 5);
                    let lens: Vec<u64> = reqs.iter().map(|r| r.len).collect();
                    assert_eq!(lens, [100, 101, 102, 103, 104]);
                    for r in &reqs {
                        respond(&mut s, r.seq, 0);
                    }
                } else {
                    let mut h = [0u8; DATA_REQUEST_LEN];
                    s.read_exact(&mut h).unwrap();
                    let Ok(ferry_core::wire::RequestHead::Vectored(req)) =
                        ferry_core::wire::RequestHead::decode(&h)
                    else {
                        panic!("not a vectored request")
                    };
                    assert_eq!((req.kind, req.pieces, req.total), (OpKind::Write, 5, 510));
                    let mut table = vec![0u8; req.table_len()];
                    s.read_exact(&mut table).unwrap();
                    let pieces = ferry_core::wire::decode_pieces(&req, &table).unwrap();
                    let offs: Vec<u64> = pieces.iter().map(|p| p.offset).collect();
                    assert_eq!(offs, [0, 1000, 2000, 3000, 4000]);
                    let mut payload = vec![0u8; 510];
                    s.read_exact(&mut payload).unwrap();
                    assert_eq!(payload[..100], [1u8; 100]);
                    let mut b = [0u8; DATA_RESPONSE_LEN];
                    ferry_core::wire::VectoredResponse {
                        seq: req.seq,
                        refused: None,
                        done: 5,
                        len: 0,
                    }
                    .encode(&mut b);
                    s.write_all(&b).unwrap();
                }
                let mut rest = Vec::new();
                let _ = s.read_to_end(&mut rest);
            });
            let mut peer = scripted_peer(addr, 1);
            peer.version = version;
            let ch = if uring {
                UringTransport::new(UringConfig {
                    streams: 1,
                    ..UringConfig::default()
                })
                .unwrap()
                .open(peer)
                .await
                .unwrap()
            } else {
                TcpTransport::new(TcpConfig {
                    streams: 1,
                    ..TcpConfig::default()
                })
                .open(peer)
                .await
                .unwrap()
            };
            let src = Arc::new(MemoryRegion::alloc_zeroed(8192, 64).unwrap());
            src.write_at(0, &[1u8; 8192]).unwrap();
            let ops = (0..5u64)
                .map(|i| {
                    op(
                        OpKind::Write,
                        &src,
                        i * 200,
                        SegmentToken(5),
                        i * 1000,
                        100 + i,
                    )
                })
                .collect();
            let o = run(&ch, ops).await;
            assert!(
                o.is_success() && o.drained,
                "uring {uring} version {version}: {o:?}"
            );
            drop(ch);
            h.join().unwrap();
        }
    }
}

/// A vectored batch whose pieces alternate between a memory segment and a file segment moves
/// every piece, WRITE then READ, on both servers (file pieces by positioned I/O).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vectored_batches_mix_file_and_memory_pieces() {
    let uring = Side::Uring(ZeroCopy::Auto);
    for (client, server) in runnable(&[
        (TCP, TCP),
        (uring, uring),
        (TCP, uring),
        (uring, Side::Rings(ZeroCopy::Auto)),
        (TCP, Side::Rings(ZeroCopy::Auto)),
    ]) {
        let f = start(server);
        let dir = tempfile::tempdir_in("/var/tmp").unwrap();
        let path = dir.path().join("file");
        std::fs::write(&path, vec![0u8; 64 << 10]).unwrap();
        let file_tok = SegmentToken::random();
        let seg = Arc::new(
            ferry_file::FileSegment::open(&path, Access::REMOTE_READ | Access::REMOTE_WRITE)
                .unwrap(),
        );
        f.table
            .files
            .lock()
            .unwrap()
            .insert(file_tok, ("file".into(), seg));
        let (mem_tok, mem) = publish(
            &f.table,
            "mem",
            64 << 10,
            Access::REMOTE_READ | Access::REMOTE_WRITE,
        );
        let ch = channel(&f, client, 1, 64 << 10).await;
        let src = Arc::new(MemoryRegion::alloc_zeroed(64 << 10, 4096).unwrap());
        fill(&src, 17);
        let dst = Arc::new(MemoryRegion::alloc_zeroed(64 << 10, 4096).unwrap());
        let pieces = |kind, local: &Arc<MemoryRegion>| -> Vec<ferry_core::Op> {
            (0..10u64)
                .map(|i| {
                    let tok = if i % 2 == 0 { mem_tok } else { file_tok };
                    op(kind, local, i * 3000, tok, i * 5000 + 7, 1000 + i * 100)
                })
                .collect()
        };
        let tag = format!("{client:?}->{server:?}");
        let o = run(&ch, pieces(OpKind::Write, &src)).await;
        assert!(o.is_success() && o.drained, "{tag}: {o:?}");
        let file = std::fs::read(&path).unwrap();
        for w in pieces(OpKind::Write, &src) {
            let (r, n) = (w.remote_offset as usize, w.len as usize);
            let there = if w.token == mem_tok {
                bytes(&mem, w.remote_offset, n)
            } else {
                file[r..r + n].to_vec()
            };
            assert_eq!(there, bytes(&src, w.local_offset, n), "{tag}: write");
        }
        let o = run(&ch, pieces(OpKind::Read, &dst)).await;
        assert!(o.is_success() && o.drained, "{tag}: {o:?}");
        for r in pieces(OpKind::Read, &dst) {
            let n = r.len as usize;
            assert_eq!(
                bytes(&dst, r.local_offset, n),
                bytes(&src, r.local_offset, n),
                "{tag}: read"
            );
        }
    }
}
