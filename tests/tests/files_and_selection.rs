//! File segments served over the wire and loaded locally; the forced-probe fallback; SEND_ZC
//! accounting.

mod common;

use std::io::Write;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use common::*;
use ferry_core::wire::{SUPPORTED_VERSIONS, TransportOffer};
use ferry_core::{
    Access, Epoch, FailureKind, MemoryRegion, OpKind, PeerId, RemoteStatus, SegmentToken,
    Transport, TransportKind,
};
use ferry_file::FileSegment;
use ferry_transport_uring::{
    OpcodeSupport, Preference, UringConfig, UringProbe, UringServer, UringServerHandle,
    UringTransport, ZeroCopy, block_on, read_file_into, select,
};
use rand::{Rng, SeedableRng};

fn random_file(dir: &std::path::Path, len: usize, seed: u64) -> (std::path::PathBuf, Vec<u8>) {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut data = vec![0u8; len];
    rng.fill(&mut data[..]);
    let path = dir.join(format!("seg-{seed}.bin"));
    let mut f = std::fs::File::create(&path).unwrap();
    f.write_all(&data).unwrap();
    f.sync_all().unwrap();
    (path, data)
}

/// An io_uring server of `table` (its data streams on its fixed set of rings).
fn serve(table: &Arc<Table>) -> UringServerHandle {
    let t = UringTransport::new(UringConfig::default()).unwrap();
    let server = UringServer::bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let responder = Arc::new(Responder {
        id: PeerId::random(),
        epoch: Epoch::fresh(),
        versions: SUPPORTED_VERSIONS,
        table: table.clone(),
        offer: t.offer(),
    });
    server
        .serve(table.clone(), responder, t.config().clone())
        .unwrap()
}

fn client(addr: std::net::SocketAddr, streams: usize) -> Arc<dyn ferry_core::Channel> {
    client_with_chunk(addr, streams, 256 << 10)
}

fn client_with_chunk(
    addr: std::net::SocketAddr,
    streams: usize,
    chunk_size: u64,
) -> Arc<dyn ferry_core::Channel> {
    let t = UringTransport::new(UringConfig {
        streams,
        chunk_size,
        ..UringConfig::default()
    })
    .unwrap();
    let peer = peer_info(addr, t.offer());
    block_on(t.open(peer)).unwrap()
}

#[test]
fn file_segment_reads_match_byte_for_byte_including_the_tail() {
    if !uring_usable() {
        return;
    }
    // /var/tmp is usually a disk filesystem (O_DIRECT works there; tmpfs refuses it).
    let dir = tempfile::tempdir_in("/var/tmp").unwrap();
    let len = (3 << 20) + 4096 * 5 + 1234; // not a multiple of 4096
    let (path, data) = random_file(dir.path(), len, 42);
    let table = Arc::new(Table::default());
    let seg = Arc::new(FileSegment::open(&path, Access::REMOTE_READ).unwrap());
    eprintln!("O_DIRECT capable: {}", seg.direct_capable());
    let tok = SegmentToken::random();
    table
        .files
        .lock()
        .unwrap()
        .insert(tok, ("file".into(), seg));
    let server = serve(&table);
    let ch = client(server.local_addr(), 2);
    let dst = Arc::new(MemoryRegion::alloc_zeroed(len + 8192, 4096).unwrap());
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    let mut cases: Vec<(u64, u64, u64)> = vec![
        (0, 0, len as u64),             // whole file, aligned start
        (4096, 4096, 1 << 20),          // aligned: O_DIRECT path
        (3, (len - 1234) as u64, 1234), // exactly the unaligned tail
        (5, (len - 5000) as u64, 5000), // crosses into the tail
        (0, (len - 1) as u64, 1),       // last byte
    ];
    for _ in 0..40 {
        let off = rng.gen_range(0..len as u64);
        let n = rng.gen_range(1..=(len as u64 - off).min(700_000));
        cases.push((rng.gen_range(0..4096), off, n));
    }
    for (lo, ro, n) in cases {
        let o = block_on(run(&ch, vec![op(OpKind::Read, &dst, lo, tok, ro, n)]));
        assert!(o.is_success() && o.drained, "read {ro}+{n}: {o:?}");
        assert!(
            bytes(&dst, lo, n as usize) == data[ro as usize..(ro + n) as usize],
            "bytes differ for file read {ro}+{n} into {lo}"
        );
    }
    // Past the end, and WRITE without write access.
    let o = block_on(run(
        &ch,
        vec![op(OpKind::Read, &dst, 0, tok, len as u64 - 10, 11)],
    ));
    assert_eq!(
        o.failure.map(|f| f.kind),
        Some(FailureKind::Remote(RemoteStatus::OutOfBounds))
    );
    let o = block_on(run(&ch, vec![op(OpKind::Write, &dst, 0, tok, 0, 10)]));
    assert_eq!(
        o.failure.map(|f| f.kind),
        Some(FailureKind::Remote(RemoteStatus::AccessDenied))
    );
    assert_eq!(
        std::fs::read(&path).unwrap(),
        data,
        "a refused WRITE changed the file"
    );
}

#[test]
fn file_segment_write_needs_access_and_never_extends() {
    if !uring_usable() {
        return;
    }
    let dir = tempfile::tempdir_in("/var/tmp").unwrap();
    let len = 10_000;
    let (path, mut data) = random_file(dir.path(), len, 9);
    let table = Arc::new(Table::default());
    let seg =
        Arc::new(FileSegment::open(&path, Access::REMOTE_READ | Access::REMOTE_WRITE).unwrap());
    let tok = SegmentToken::random();
    table
        .files
        .lock()
        .unwrap()
        .insert(tok, ("file".into(), seg));
    let server = serve(&table);
    let ch = client(server.local_addr(), 1);
    let src = Arc::new(MemoryRegion::alloc_zeroed(16384, 4096).unwrap());
    fill(&src, 5);
    let o = block_on(run(&ch, vec![op(OpKind::Write, &src, 1, tok, 4097, 3000)]));
    assert!(o.is_success(), "{o:?}");
    data[4097..7097].copy_from_slice(&bytes(&src, 1, 3000));
    let o = block_on(run(&ch, vec![op(OpKind::Write, &src, 0, tok, 9000, 1001)]));
    assert_eq!(
        o.failure.map(|f| f.kind),
        Some(FailureKind::Remote(RemoteStatus::OutOfBounds))
    );
    let on_disk = std::fs::read(&path).unwrap();
    assert_eq!(on_disk.len(), len, "the file was extended");
    assert!(on_disk == data);
}

/// A file source the io_uring server does not know: served through its own positioned I/O.
#[derive(Debug)]
struct Foreign(FileSegment);

impl ferry_core::FileSource for Foreign {
    fn check(&self, kind: OpKind, offset: u64, len: u64) -> Result<u64, RemoteStatus> {
        self.0.check(kind, offset, len)
    }
    fn read_exact_at(&self, at: u64, buf: &mut [u8]) -> std::io::Result<()> {
        ferry_core::FileSource::read_exact_at(&self.0, at, buf)
    }
    fn write_all_at(&self, at: u64, buf: &[u8]) -> std::io::Result<()> {
        ferry_core::FileSource::write_all_at(&self.0, at, buf)
    }
}

#[test]
fn other_file_sources_are_served_by_their_positioned_io() {
    if !uring_usable() {
        return;
    }
    let dir = tempfile::tempdir_in("/var/tmp").unwrap();
    let len = (3 << 19) + 77;
    let (path, _) = random_file(dir.path(), len, 78);
    let table = Arc::new(Table::default());
    let seg = FileSegment::open(&path, Access::REMOTE_READ | Access::REMOTE_WRITE).unwrap();
    let tok = SegmentToken::random();
    table
        .sources
        .lock()
        .unwrap()
        .insert(tok, Arc::new(Foreign(seg)));
    let server = serve(&table);
    let ch = client_with_chunk(server.local_addr(), 1, 4 << 20);
    let src = Arc::new(MemoryRegion::alloc_zeroed(len, 4096).unwrap());
    fill(&src, 17);
    let o = block_on(run(
        &ch,
        vec![op(OpKind::Write, &src, 0, tok, 0, len as u64)],
    ));
    assert!(o.is_success(), "{o:?}");
    assert!(std::fs::read(&path).unwrap() == bytes(&src, 0, len));
    let back = Arc::new(MemoryRegion::alloc_zeroed(len, 4096).unwrap());
    let o = block_on(run(
        &ch,
        vec![op(OpKind::Read, &back, 3, tok, 5, len as u64 - 5)],
    ));
    assert!(o.is_success(), "{o:?}");
    assert!(bytes(&back, 3, len - 5) == bytes(&src, 5, len - 5));
    let o = block_on(run(
        &ch,
        vec![op(OpKind::Write, &src, 0, tok, len as u64 - 1, 2)],
    ));
    assert_eq!(
        o.failure.map(|f| f.kind),
        Some(FailureKind::Remote(RemoteStatus::OutOfBounds))
    );
    assert_eq!(std::fs::metadata(&path).unwrap().len(), len as u64);
}

#[test]
fn file_chunks_larger_than_the_staging_move_in_pieces() {
    if !uring_usable() {
        return;
    }
    // The server stages at most 1 MiB per stream: 4 MiB chunks go through in pieces, aligned
    // (O_DIRECT where the filesystem has it) and with an odd tail.
    let dir = tempfile::tempdir_in("/var/tmp").unwrap();
    let len = (5 << 19) + 4096 + 333;
    let (path, _) = random_file(dir.path(), len, 77);
    let table = Arc::new(Table::default());
    let seg =
        Arc::new(FileSegment::open(&path, Access::REMOTE_READ | Access::REMOTE_WRITE).unwrap());
    let tok = SegmentToken::random();
    table
        .files
        .lock()
        .unwrap()
        .insert(tok, ("file".into(), seg));
    let server = serve(&table);
    let ch = client_with_chunk(server.local_addr(), 1, 4 << 20);
    let src = Arc::new(MemoryRegion::alloc_zeroed(len, 4096).unwrap());
    fill(&src, 13);
    let o = block_on(run(
        &ch,
        vec![op(OpKind::Write, &src, 0, tok, 0, len as u64)],
    ));
    assert!(o.is_success(), "{o:?}");
    assert!(std::fs::read(&path).unwrap() == bytes(&src, 0, len));
    let back = Arc::new(MemoryRegion::alloc_zeroed(len + 4096, 4096).unwrap());
    let o = block_on(run(&ch, vec![op(OpKind::Read, &back, 0, tok, 9, 0)]));
    assert!(o.is_success(), "an empty READ: {o:?}");
    for (lo, ro) in [(0u64, 0u64), (7, 4096), (4096, 5)] {
        let n = len as u64 - ro;
        let o = block_on(run(&ch, vec![op(OpKind::Read, &back, lo, tok, ro, n)]));
        assert!(o.is_success(), "read {ro}+{n}: {o:?}");
        assert!(
            bytes(&back, lo, n as usize) == bytes(&src, ro, n as usize),
            "bytes differ reading {n} at {ro} into {lo}"
        );
    }
}

#[test]
fn read_file_into_loads_unaligned_ranges_and_tail() {
    if !uring_usable() {
        return;
    }
    let dir = tempfile::tempdir_in("/var/tmp").unwrap();
    let len = (5 << 20) + 777;
    let (path, data) = random_file(dir.path(), len, 11);
    let region = Arc::new(MemoryRegion::alloc_zeroed(len + 8192, 4096).unwrap());
    for &(ro, fo, n, qd) in &[
        (0u64, 0u64, len as u64, 32usize), // aligned start, unaligned tail
        (4096, 8192, 2 << 20, 4),          // fully aligned: O_DIRECT
        (13, 1, (len - 1) as u64, 3),      // unaligned everything
    ] {
        let got = read_file_into(&region, ro, &path, fo, n, qd).unwrap();
        assert_eq!(got, n);
        assert!(
            bytes(&region, ro, n as usize) == data[fo as usize..(fo + n) as usize],
            "{ro} {fo} {n}"
        );
    }
    assert!(read_file_into(&region, 0, &path, 1, len as u64, 8).is_err());
}

fn probe(missing: &[&'static str]) -> UringProbe {
    let names = ["SEND", "RECV", "READ", "WRITE", "SEND_ZC", "ASYNC_CANCEL"];
    UringProbe::Available {
        opcodes: names
            .iter()
            .map(|&name| OpcodeSupport {
                name,
                required: name != "SEND_ZC",
                supported: !missing.contains(&name),
            })
            .collect(),
    }
}

#[test]
fn forced_probe_falls_back_with_the_reason() {
    // Pure logic: no ring is created, so this runs everywhere.
    let no_send = probe(&["SEND"]);
    let s = select(&no_send, Preference::Auto).unwrap();
    assert_eq!(s.kind, TransportKind::Tcp);
    assert!(
        s.reason.contains("fell back to tcp") && s.reason.contains("SEND"),
        "{}",
        s.reason
    );
    let err = select(&no_send, Preference::Uring).unwrap_err();
    assert!(err.to_string().contains("SEND"), "{err}");
    assert!(UringTransport::with_probe(UringConfig::default(), &no_send).is_err());
    let gone = UringProbe::Unavailable {
        reason: "io_uring_setup: Operation not permitted".into(),
    };
    let s = select(&gone, Preference::Auto).unwrap();
    assert_eq!(s.kind, TransportKind::Tcp);
    assert!(s.reason.contains("Operation not permitted"), "{}", s.reason);
    assert_eq!(
        select(&probe(&[]), Preference::Tcp).unwrap().kind,
        TransportKind::Tcp
    );
    assert_eq!(
        select(&probe(&[]), Preference::Auto).unwrap().kind,
        TransportKind::Uring
    );

    // No SEND_ZC: Auto falls back to copying sends and says so; Always is refused.
    let no_zc = probe(&["SEND_ZC"]);
    let s = select(&no_zc, Preference::Auto).unwrap();
    assert_eq!(s.kind, TransportKind::Uring);
    assert!(s.reason.contains("SEND_ZC unavailable"), "{}", s.reason);
    let t = UringTransport::with_probe(UringConfig::default(), &no_zc).unwrap();
    assert!(!t.config().zero_copy_enabled());
    assert!(matches!(
        t.offer(),
        TransportOffer::Uring {
            zero_copy: false,
            ..
        }
    ));
    assert!(t.describe().contains("SEND_ZC off"), "{}", t.describe());
    let err = UringTransport::with_probe(
        UringConfig {
            zero_copy: ZeroCopy::Always,
            ..UringConfig::default()
        },
        &no_zc,
    )
    .unwrap_err();
    assert!(err.to_string().contains("SEND_ZC"), "{err}");
}

#[test]
fn zero_copy_sends_are_counted_and_drained() {
    if !uring_usable() {
        return;
    }
    if !ferry_transport_uring::probe_kernel().supports("SEND_ZC") {
        ferry_tests::require_or_skip(ferry_tests::URING, "the kernel lacks io_uring SEND_ZC");
        return;
    }
    let table = Arc::new(Table::default());
    let (tok, remote) = publish(
        &table,
        "w",
        8 << 20,
        Access::REMOTE_READ | Access::REMOTE_WRITE,
    );
    let server = serve(&table);
    for (zc, splice) in [
        (ZeroCopy::Always, false),
        (ZeroCopy::Never, false),
        (ZeroCopy::Auto, true),
    ] {
        let t = UringTransport::new(UringConfig {
            zero_copy: zc,
            splice_loopback: splice,
            ..UringConfig::default()
        })
        .unwrap();
        let peer = peer_info(server.local_addr(), t.offer());
        let ch = block_on(t.open(peer)).unwrap();
        let src = Arc::new(MemoryRegion::alloc_zeroed(8 << 20, 4096).unwrap());
        fill(&src, zc as u64 + 1);
        let o = block_on(run(&ch, vec![op(OpKind::Write, &src, 0, tok, 0, 8 << 20)]));
        assert!(o.is_success() && o.drained, "{o:?}");
        assert!(bytes(&remote, 0, 8 << 20) == bytes(&src, 0, 8 << 20));
        let s = t.stats();
        let (zcs, copies, notifs) = (
            s.zc_sends.load(Ordering::Relaxed),
            s.copy_sends.load(Ordering::Relaxed),
            s.notifications.load(Ordering::Relaxed),
        );
        eprintln!("{zc:?}: {}", t.describe());
        let spliced = s.spliced_sends.load(Ordering::Relaxed);
        match zc {
            ZeroCopy::Auto => assert!(
                spliced >= 8 && zcs == 0 && copies == 0 || !t.config().kernel_splice,
                "{spliced} {zcs} {copies}"
            ),
            ZeroCopy::Always => {
                assert!(zcs >= 8 && copies == 0, "{zcs} {copies}");
                // Drained means every notification of this request's sends arrived.
                assert!(notifs >= 1, "no zero-copy notification seen");
            }
            _ => assert!(zcs == 0 && copies >= 8, "{zcs} {copies}"),
        }
    }
}
