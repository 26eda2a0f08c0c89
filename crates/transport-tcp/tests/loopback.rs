//! The TCP data plane against an in-process server on 127.0.0.1: transfers, refusals, epochs.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ferry_core::wire::{
    Hello, Reject, RejectReason, SUPPORTED_VERSIONS, TransportOffer, VersionRange,
};
use ferry_core::{
    Access, Epoch, Error, FailureKind, FileSource, HandshakeResponder, MemoryRegion, Op, OpKind,
    PeerId, PeerInfo, RemoteEffect, RemoteStatus, RequestControl, SegmentDesc, SegmentLease,
    SegmentTable, SegmentToken, Transport,
};
use ferry_transport_tcp::{TcpConfig, TcpServer, TcpTransport, handshake};

type Entry = (String, Arc<MemoryRegion>, Access);

#[derive(Debug, Default)]
struct Table(
    Mutex<HashMap<SegmentToken, Entry>>,
    Mutex<HashMap<SegmentToken, Arc<TestFile>>>,
);

/// A file segment served by positioned I/O (what the engine's file segments provide).
#[derive(Debug)]
struct TestFile {
    file: std::fs::File,
    len: u64,
    access: Access,
}

impl FileSource for TestFile {
    fn check(&self, kind: OpKind, offset: u64, len: u64) -> Result<u64, RemoteStatus> {
        if !self.access.contains(kind.needed_access()) {
            return Err(RemoteStatus::AccessDenied);
        }
        ferry_core::check_range(offset, len, self.len).map_err(|_| RemoteStatus::OutOfBounds)?;
        Ok(offset)
    }
    fn read_exact_at(&self, at: u64, buf: &mut [u8]) -> std::io::Result<()> {
        std::os::unix::fs::FileExt::read_exact_at(&self.file, buf, at)
    }
    fn write_all_at(&self, at: u64, buf: &[u8]) -> std::io::Result<()> {
        std::os::unix::fs::FileExt::write_all_at(&self.file, buf, at)
    }
}

impl SegmentTable for Table {
    fn resolve(&self, token: SegmentToken) -> Option<SegmentLease> {
        let t = self.0.lock().unwrap();
        t.get(&token).map(|(_, r, a)| SegmentLease {
            region: r.clone(),
            base: 0,
            len: r.len() as u64,
            access: *a,
            guard: None,
        })
    }
    fn published(&self) -> Vec<SegmentDesc> {
        let t = self.0.lock().unwrap();
        t.iter()
            .map(|(tok, (name, r, a))| SegmentDesc {
                name: name.clone(),
                token: *tok,
                len: r.len() as u64,
                access: *a,
                remote_keys: vec![],
            })
            .collect()
    }
    fn file(&self, token: SegmentToken) -> Option<Arc<dyn FileSource>> {
        let f = self.1.lock().unwrap();
        f.get(&token).map(|f| f.clone() as Arc<dyn FileSource>)
    }
}

#[derive(Debug)]
struct Responder {
    id: PeerId,
    epoch: Epoch,
    versions: VersionRange,
    table: Arc<Table>,
}

impl HandshakeResponder for Responder {
    fn peer_id(&self) -> PeerId {
        self.id
    }
    fn epoch(&self) -> Epoch {
        self.epoch
    }
    fn respond(&self, hello: &Hello, _from: SocketAddr) -> Result<Hello, Reject> {
        if self.versions.common(hello.versions).is_none() {
            return Err(Reject {
                reason: RejectReason::ProtocolMismatch,
                versions: self.versions,
                epoch: self.epoch,
                message: "no common version".into(),
            });
        }
        Ok(Hello {
            versions: self.versions,
            peer_id: self.id,
            epoch: self.epoch,
            transports: vec![TransportOffer::Tcp {
                streams: 64,
                port: 0,
            }],
            segments: self.table.published(),
        })
    }
}

struct Fixture {
    _server: ferry_transport_tcp::ServerHandle,
    addr: SocketAddr,
    table: Arc<Table>,
    epoch: Epoch,
}

fn start(versions: VersionRange) -> Fixture {
    start_with(versions, TcpConfig::default().io_threads)
}

/// A server whose data streams run on `io_threads` (see `TcpConfig::io_threads`).
fn start_with(versions: VersionRange, io_threads: Option<usize>) -> Fixture {
    let table = Arc::new(Table::default());
    let epoch = Epoch::fresh();
    let server = TcpServer::bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let addr = server.local_addr();
    let responder = Arc::new(Responder {
        id: PeerId::random(),
        epoch,
        versions,
        table: table.clone(),
    });
    let config = TcpConfig {
        io_threads,
        ..TcpConfig::default()
    };
    let handle = server.serve(table.clone(), responder, config);
    Fixture {
        _server: handle,
        addr,
        table,
        epoch,
    }
}

fn publish(
    f: &Fixture,
    name: &str,
    len: usize,
    access: Access,
) -> (SegmentToken, Arc<MemoryRegion>) {
    let r = Arc::new(MemoryRegion::alloc_zeroed(len, 4096).unwrap());
    let tok = SegmentToken::random();
    f.table
        .0
        .lock()
        .unwrap()
        .insert(tok, (name.into(), r.clone(), access));
    (tok, r)
}

fn fill(r: &MemoryRegion, seed: u64) {
    let mut x = seed | 1;
    let mut buf = vec![0u8; r.len()];
    for b in buf.iter_mut() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        *b = x as u8;
    }
    r.write_at(0, &buf).unwrap();
}

fn bytes(r: &MemoryRegion, at: u64, len: usize) -> Vec<u8> {
    let mut v = vec![0u8; len];
    r.read_at(at, &mut v).unwrap();
    v
}

async fn channel(f: &Fixture, streams: usize, chunk: u64) -> Arc<dyn ferry_core::Channel> {
    channel_with(f, streams, chunk, TcpConfig::default().io_threads).await
}

async fn channel_with(
    f: &Fixture,
    streams: usize,
    chunk: u64,
    io_threads: Option<usize>,
) -> Arc<dyn ferry_core::Channel> {
    let t = TcpTransport::new(TcpConfig {
        streams,
        chunk_size: chunk,
        depth: 4,
        io_threads,
        ..TcpConfig::default()
    });
    let hello = Hello {
        versions: SUPPORTED_VERSIONS,
        peer_id: PeerId::random(),
        epoch: Epoch::fresh(),
        transports: vec![t.offer()],
        segments: vec![],
    };
    let server = handshake(f.addr, &hello, Duration::from_secs(5))
        .await
        .unwrap();
    t.open(PeerInfo {
        addr: f.addr,
        local_id: hello.peer_id,
        local_epoch: hello.epoch,
        remote_id: server.peer_id,
        remote_epoch: server.epoch,
        offer: server.transports[0].clone(),
        segments: server.segments,
    })
    .await
    .unwrap()
}

fn op(
    kind: OpKind,
    local: &Arc<MemoryRegion>,
    lo: u64,
    token: SegmentToken,
    ro: u64,
    len: u64,
) -> Op {
    Op {
        kind,
        local: local.clone(),
        local_offset: lo,
        token,
        remote_offset: ro,
        len,
    }
}

async fn run(ch: &Arc<dyn ferry_core::Channel>, ops: Vec<Op>) -> ferry_core::Outcome {
    let ops: Arc<[Op]> = ops.into();
    let control = Arc::new(RequestControl::new(&ops));
    ch.execute(ops, control).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn write_then_read_striped_unaligned() {
    // Streams on I/O threads (two, fewer than the streams) and on the caller's runtime, on
    // either side.
    for (server_io, client_io) in [
        (Some(2), Some(2)),
        (None, None),
        (Some(1), None),
        (None, Some(0)),
    ] {
        write_then_read_with(server_io, client_io).await;
    }
}

async fn write_then_read_with(server_io: Option<usize>, client_io: Option<usize>) {
    let f = start_with(SUPPORTED_VERSIONS, server_io);
    let (tok, remote) = publish(
        &f,
        "seg",
        3 << 20,
        Access::REMOTE_READ | Access::REMOTE_WRITE,
    );
    let ch = channel_with(&f, 3, 64 << 10, client_io).await;
    let src = Arc::new(MemoryRegion::alloc_zeroed(3 << 20, 4096).unwrap());
    fill(&src, 7);
    let dst = Arc::new(MemoryRegion::alloc_zeroed(3 << 20, 4096).unwrap());
    for &(lo, ro, len) in &[
        (0u64, 0u64, 1u64),
        (3, 5, 100),
        (1, 4097, 200_001),
        (17, 33, (3 << 20) - 40),
    ] {
        let o = run(&ch, vec![op(OpKind::Write, &src, lo, tok, ro, len)]).await;
        assert!(o.is_success(), "{server_io:?}/{client_io:?}: {o:?}");
        assert_eq!(
            bytes(&remote, ro, len as usize),
            bytes(&src, lo, len as usize)
        );
        let o = run(&ch, vec![op(OpKind::Read, &dst, lo, tok, ro, len)]).await;
        assert!(o.is_success() && o.drained, "{o:?}");
        assert_eq!(o.completed_bytes, len);
        assert_eq!(bytes(&dst, lo, len as usize), bytes(&src, lo, len as usize));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refusals_move_no_byte() {
    let f = start(SUPPORTED_VERSIONS);
    let (ro_tok, ro_seg) = publish(&f, "ro", 4096, Access::REMOTE_READ);
    let (rw_tok, rw_seg) = publish(&f, "rw", 4096, Access::REMOTE_READ | Access::REMOTE_WRITE);
    let ch = channel(&f, 1, 1 << 20).await;
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
        assert_eq!(out.completed_ops, 1);
        let fail = out.failure.unwrap();
        assert_eq!((fail.op_index, fail.kind), (1, FailureKind::Remote(status)));
        assert_eq!(out.remote_effect, RemoteEffect::None);
    }
    assert!(bytes(&ro_seg, 0, 4096).iter().all(|&b| b == 0));
    assert_eq!(bytes(&rw_seg, 0, 10), bytes(&src, 0, 10));
    assert!(bytes(&rw_seg, 10, 4086).iter().all(|&b| b == 0));
    // The stream survives refusals (a refused WRITE's payload was drained).
    let out = run(&ch, vec![op(OpKind::Write, &src, 0, rw_tok, 0, 4096)]).await;
    assert!(out.is_success());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn protocol_mismatch_names_both_ranges() {
    let f = start(VersionRange { min: 7, max: 9 });
    let hello = Hello {
        versions: SUPPORTED_VERSIONS,
        peer_id: PeerId::random(),
        epoch: Epoch::fresh(),
        transports: vec![],
        segments: vec![],
    };
    match handshake(f.addr, &hello, Duration::from_secs(5)).await {
        Err(Error::ProtocolMismatch { local, remote, .. }) => {
            assert_eq!(local, SUPPORTED_VERSIONS);
            assert_eq!(remote, VersionRange { min: 7, max: 9 });
        }
        other => panic!("expected ProtocolMismatch, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stale_epoch_stream_is_refused() {
    let f = start(SUPPORTED_VERSIONS);
    let t = TcpTransport::new(TcpConfig::default());
    let res = t
        .open(PeerInfo {
            addr: f.addr,
            local_id: PeerId::random(),
            local_epoch: Epoch::fresh(),
            remote_id: PeerId::random(),
            remote_epoch: Epoch(f.epoch.0 ^ 1),
            offer: TransportOffer::Tcp {
                streams: 1,
                port: 0,
            },
            segments: vec![],
        })
        .await;
    match res {
        Err(Error::StaleEpoch { found, .. }) => assert_eq!(found, f.epoch),
        other => panic!("expected StaleEpoch, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_does_not_hurt_the_server() {
    use tokio::io::AsyncWriteExt;
    let f = start(SUPPORTED_VERSIONS);
    let mut s = tokio::net::TcpStream::connect(f.addr).await.unwrap();
    s.write_all(b"FRRY\x01\x00\x01\x00\xff\xff\xff\xff")
        .await
        .unwrap();
    let mut s2 = tokio::net::TcpStream::connect(f.addr).await.unwrap();
    s2.write_all(&[0xAB; 64]).await.unwrap();
    drop((s, s2));
    let (tok, _) = publish(&f, "x", 100, Access::REMOTE_READ);
    let ch = channel(&f, 1, 1 << 20).await;
    let dst = Arc::new(MemoryRegion::alloc_zeroed(100, 64).unwrap());
    assert!(
        run(&ch, vec![op(OpKind::Read, &dst, 0, tok, 0, 100)])
            .await
            .is_success()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn closed_channel_fails_without_effect() {
    let f = start(SUPPORTED_VERSIONS);
    let (tok, _) = publish(&f, "x", 100, Access::REMOTE_WRITE);
    let ch = channel(&f, 2, 1 << 20).await;
    ch.close();
    assert!(!ch.is_alive());
    let src = Arc::new(MemoryRegion::alloc_zeroed(100, 64).unwrap());
    let o = run(&ch, vec![op(OpKind::Write, &src, 0, tok, 0, 100)]).await;
    assert_eq!(o.failure.map(|f| f.kind), Some(FailureKind::PeerLost));
    assert_eq!(o.remote_effect, RemoteEffect::None);
    assert!(o.drained);
}

/// Random requests on a raw data stream: every answer matches an oracle of the checks (token,
/// access, bounds), and the segment changes exactly where accepted WRITEs wrote.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_requests_match_the_oracle() {
    use ferry_core::wire::{
        ControlFrame, DATA_REQUEST_LEN, DATA_RESPONSE_LEN, DataRequest, DataResponse, StreamAttach,
    };
    use rand::{Rng, SeedableRng};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    let f = start(SUPPORTED_VERSIONS);
    let (rw, rw_seg) = publish(&f, "rw", 5000, Access::REMOTE_READ | Access::REMOTE_WRITE);
    let (ro, ro_seg) = publish(&f, "ro", 3000, Access::REMOTE_READ);
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn file_segments_by_positioned_io() {
    let f = start(SUPPORTED_VERSIONS);
    let len = 10_000usize;
    let path = std::env::temp_dir().join(format!("ferry-tcp-file-{}", std::process::id()));
    let initial: Vec<u8> = (0..len).map(|i| (i * 31 % 251) as u8).collect();
    std::fs::write(&path, &initial).unwrap();
    let open = |write| {
        std::fs::OpenOptions::new()
            .read(true)
            .write(write)
            .open(&path)
            .unwrap()
    };
    let (rw, ro) = (SegmentToken(0xf1), SegmentToken(0xf2));
    {
        let mut files = f.table.1.lock().unwrap();
        files.insert(
            rw,
            Arc::new(TestFile {
                file: open(true),
                len: len as u64,
                access: Access::REMOTE_READ | Access::REMOTE_WRITE,
            }),
        );
        files.insert(
            ro,
            Arc::new(TestFile {
                file: open(false),
                len: len as u64,
                access: Access::REMOTE_READ,
            }),
        );
    }
    let ch = channel(&f, 2, 4096).await;
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
    let _ = std::fs::remove_file(&path);

    // Chunks larger than the server's 1 MiB file staging move in pieces, both ways.
    let big = (5 << 19) + 333; // 2.5 MiB and an odd tail
    let big_path = std::env::temp_dir().join(format!("ferry-tcp-file-big-{}", std::process::id()));
    std::fs::write(&big_path, vec![0u8; big]).unwrap();
    let big_tok = SegmentToken(0xf3);
    f.table.1.lock().unwrap().insert(
        big_tok,
        Arc::new(TestFile {
            file: std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .open(&big_path)
                .unwrap(),
            len: big as u64,
            access: Access::REMOTE_READ | Access::REMOTE_WRITE,
        }),
    );
    let ch = channel(&f, 1, 4 << 20).await;
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
    let _ = std::fs::remove_file(&big_path);
}

/// Streams another listener accepted and attached (the io_uring server past its thread budget)
/// are served by a `StreamServer` on its I/O threads: bytes move both ways, checks still refuse
/// an unknown segment, and `done` runs once the client closes each stream.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn handed_over_streams_are_served_until_the_client_closes_them() {
    use std::io::{Read, Write};
    let table = Arc::new(Table::default());
    let dst = Arc::new(MemoryRegion::alloc_zeroed(3 << 20, 4096).unwrap());
    let tok = SegmentToken::random();
    let access = Access::REMOTE_READ | Access::REMOTE_WRITE;
    table
        .0
        .lock()
        .unwrap()
        .insert(tok, ("x".into(), dst.clone(), access));
    let server = Arc::new(ferry_transport_tcp::StreamServer::new(
        table.clone(),
        &TcpConfig::default(),
    ));
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
    let accepting = {
        let server = server.clone();
        std::thread::spawn(move || {
            for _ in 0..2 {
                let (mut s, from) = listener.accept().unwrap();
                let mut head = [0u8; ferry_core::wire::CONTROL_HEADER_LEN];
                s.read_exact(&mut head).unwrap();
                let h = ferry_core::wire::ControlHeader::decode(&head).unwrap();
                let mut body = vec![0u8; h.body_len as usize];
                s.read_exact(&mut body).unwrap();
                let mut out = Vec::new();
                ferry_core::wire::ControlFrame::StreamAccept
                    .encode(SUPPORTED_VERSIONS.max, &mut out)
                    .unwrap();
                s.write_all(&out).unwrap();
                let tx = done_tx.clone();
                server
                    .serve(s, from, Box::new(move || tx.send(()).unwrap()))
                    .unwrap();
            }
        })
    };
    let t = TcpTransport::new(TcpConfig {
        streams: 2,
        chunk_size: 256 << 10,
        depth: 4,
        ..TcpConfig::default()
    });
    let ch = t
        .open(PeerInfo {
            addr,
            local_id: PeerId::random(),
            local_epoch: Epoch::fresh(),
            remote_id: PeerId::random(),
            remote_epoch: Epoch(1),
            offer: TransportOffer::Tcp {
                streams: 2,
                port: 0,
            },
            segments: vec![],
        })
        .await
        .unwrap();
    accepting.join().unwrap();
    let len = (3 << 20) - 17;
    let src = Arc::new(MemoryRegion::alloc_zeroed(3 << 20, 4096).unwrap());
    fill(&src, 0x5eed);
    let o = run(&ch, vec![op(OpKind::Write, &src, 5, tok, 9, len)]).await;
    assert!(o.is_success(), "{o:?}");
    assert!(bytes(&dst, 9, len as usize) == bytes(&src, 5, len as usize));
    let back = Arc::new(MemoryRegion::alloc_zeroed(3 << 20, 4096).unwrap());
    let o = run(&ch, vec![op(OpKind::Read, &back, 0, tok, 9, len)]).await;
    assert!(o.is_success(), "{o:?}");
    assert!(bytes(&back, 0, len as usize) == bytes(&src, 5, len as usize));
    let o = run(
        &ch,
        vec![op(OpKind::Read, &back, 0, SegmentToken(3), 0, 10)],
    )
    .await;
    assert_eq!(
        o.failure.map(|f| f.kind),
        Some(FailureKind::Remote(RemoteStatus::UnknownSegment))
    );
    assert!(done_rx.try_recv().is_err(), "done before the client closed");
    drop(ch);
    for _ in 0..2 {
        done_rx
            .recv_timeout(Duration::from_secs(10))
            .expect("a handed-over stream never reported done");
    }
}
