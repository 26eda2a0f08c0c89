//! Shared registrations end to end, in one process (issue 50): memory allocated in a memfd is
//! granted to a peer whose view resolves it, mapped, and read and written one-sidedly; every
//! other case is refused and the owner copies; a read-only grant cannot write; a registration
//! whose memory is freed cannot be read one-sidedly afterwards, nor through the descriptor.

mod common;
use common::{Responder, serve_table};

use std::collections::HashMap;
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::fd::AsRawFd;
use std::sync::{Arc, Mutex};

use ferry_core::share::{Grant, ShareMode, ShareRefusal};
use ferry_core::wire::TransportOffer;
use ferry_core::{
    Access, Channel, Epoch, FailureKind, MemoryRegion, Op, OpKind, PeerInfo, RequestControl,
    SegmentDesc, SegmentLease, SegmentTable, SegmentToken,
};
use ferry_net::HandshakeLimits;
use ferry_transport_local::{LocalConfig, LocalServer, LocalServerHandle, LocalTransport};

const LEN: usize = 256 << 10;
/// Where the segments start in their regions (a segment need not be its whole region).
const BASE: u64 = 4096;
const SEG: u64 = (LEN as u64) - BASE;
/// A region for requests over a chunk (4 MiB by default).
const BIG: usize = 40 << 20;
/// Ops of 1 MiB in a request to stop or revoke mid-way, and the regions they lie in: long
/// enough to be seen under way on a loaded machine.
const LONG: u64 = 128;
const LONG_REGION: usize = (LONG as usize + 1) << 20;

const RW: SegmentToken = SegmentToken(1);
const RO: SegmentToken = SegmentToken(2);
const USER: SegmentToken = SegmentToken(3);
const HIDDEN: SegmentToken = SegmentToken(4);
const WRITE_ONLY: SegmentToken = SegmentToken(5);

/// What the server publishes: per token, the region, its access, and whether this peer's view
/// holds it (a segment published to other key names only is not in it: `resolve` through the
/// peer's view says `None`, as `PeerView` does).
#[derive(Debug, Default)]
struct Table(Mutex<HashMap<SegmentToken, Published>>);

/// A published segment's region, access, and whether it is in this peer's view.
type Published = (Arc<MemoryRegion>, Access, bool);

impl SegmentTable for Table {
    fn resolve(&self, token: SegmentToken) -> Option<SegmentLease> {
        let map = self.0.lock().unwrap();
        let (region, access, visible) = map.get(&token)?;
        visible.then(|| SegmentLease {
            region: region.clone(),
            base: BASE,
            len: region.len() as u64 - BASE,
            access: *access,
            guard: None,
        })
    }
    fn published(&self) -> Vec<SegmentDesc> {
        Vec::new()
    }
}

impl Table {
    fn add(&self, token: SegmentToken, region: &Arc<MemoryRegion>, access: Access, visible: bool) {
        let entry = (region.clone(), access, visible);
        self.0.lock().unwrap().insert(token, entry);
    }

    /// Unregisters: the table's hold on the region goes.
    fn remove(&self, token: SegmentToken) {
        self.0.lock().unwrap().remove(&token);
    }
}

fn serve(table: Arc<Table>) -> (LocalServerHandle, PeerInfo) {
    serve_table(table, 2)
}

fn shareable(fill: u8) -> Arc<MemoryRegion> {
    let r = MemoryRegion::alloc_shareable(LEN).expect("a memfd");
    r.write_at(0, &vec![fill; LEN]).unwrap();
    Arc::new(r)
}

/// A shareable registration `RW` holding `bytes`, read-write, served, and a channel that mapped
/// it: the table (to revoke it), the region, the server (held while the channel is used) and
/// the channel.
fn mapped_rw(
    bytes: &[u8],
) -> (
    Arc<Table>,
    Arc<MemoryRegion>,
    LocalServerHandle,
    ferry_transport_local::LocalChannel,
) {
    let table = Arc::new(Table::default());
    let region = Arc::new(MemoryRegion::alloc_shareable(bytes.len()).expect("a memfd"));
    region.write_at(0, bytes).unwrap();
    table.add(
        RW,
        &region,
        Access::REMOTE_READ | Access::REMOTE_WRITE,
        true,
    );
    let (h, peer) = serve(table.clone());
    let ch = LocalTransport::new(LocalConfig::default())
        .connect_channel(&peer)
        .unwrap();
    assert_eq!(ch.map_shared(RW), Some(Ok(Grant::ReadWrite)));
    (table, region, h, ch)
}

fn op(kind: OpKind, local: &Arc<MemoryRegion>, token: SegmentToken, len: u64) -> Op {
    Op {
        kind,
        local: local.clone(),
        local_offset: 0,
        token,
        remote_offset: 0,
        len,
    }
}

async fn run(ch: &dyn Channel, ops: Vec<Op>) -> ferry_core::Outcome {
    let ops: Arc<[Op]> = ops.into();
    ch.execute(ops.clone(), Arc::new(RequestControl::new(&ops)))
        .await
}

fn one_sided(ch: &ferry_transport_local::LocalChannel) -> u64 {
    ch.shared_use().expect("a share stream").1
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_granted_registration_is_read_and_written_one_sidedly() {
    let (_table, region, _h, ch) = mapped_rw(&[0x11; LEN]);
    assert_eq!(ch.shared_use(), Some((1, 0)));
    let local = Arc::new(MemoryRegion::alloc_zeroed(LEN, 4096).unwrap());
    let o = run(&ch, vec![op(OpKind::Read, &local, RW, 64 << 10)]).await;
    assert!(o.is_success(), "{o:?}");
    let mut got = vec![0u8; 64 << 10];
    local.read_at(0, &mut got).unwrap();
    assert!(got.iter().all(|b| *b == 0x11));
    local.write_at(0, &vec![0x22; LEN]).unwrap();
    let mut w = op(OpKind::Write, &local, RW, 8 << 10);
    w.remote_offset = 100;
    let o = run(&ch, vec![w]).await;
    assert!(o.is_success(), "{o:?}");
    assert_eq!(one_sided(&ch), 2, "both ops went one-sidedly");
    // The WRITE landed at the segment's offset in the region (BASE + 100).
    let mut seg = vec![0u8; LEN];
    region.read_at(0, &mut seg).unwrap();
    let at = BASE as usize + 100;
    assert!(seg[at..at + (8 << 10)].iter().all(|b| *b == 0x22));
    assert_eq!(seg[at - 1], 0x11);
    assert_eq!(seg[at + (8 << 10)], 0x11);
    // Past the segment's end: not one-sided; the owner refuses it.
    let mut past = op(OpKind::Read, &local, RW, 64);
    past.remote_offset = SEG - 8;
    let o = run(&ch, vec![past]).await;
    assert!(!o.is_success());
    assert_eq!(one_sided(&ch), 2);
    let state = region.shared().unwrap().state();
    assert_eq!((state.mode(), state.grants()), (ShareMode::ReadWrite, 1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_owner_that_stopped_serving_is_copied_with_no_more() {
    let (_table, _region, h, ch) = mapped_rw(&[0x12; LEN]);
    let local = Arc::new(MemoryRegion::alloc_zeroed(LEN, 4096).unwrap());
    let o = run(&ch, vec![op(OpKind::Write, &local, RW, 4096)]).await;
    assert!(o.is_success(), "{o:?}");
    assert_eq!(one_sided(&ch), 1);
    // The server shuts its sockets (as a process that dies has them shut) before it returns:
    // from then on nothing is one-sided (the request takes the streams, whose own ending is
    // theirs to see).
    h.shutdown();
    let _ = run(&ch, vec![op(OpKind::Write, &local, RW, 4096)]).await;
    assert_eq!(one_sided(&ch), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_without_the_right_never_gets_the_memfd_and_the_owner_copies() {
    let table = Arc::new(Table::default());
    let hidden = shareable(0x33);
    let write_only = shareable(0x44);
    let user = Arc::new(MemoryRegion::alloc_zeroed(LEN, 4096).unwrap());
    user.write_at(0, &vec![0x55; LEN]).unwrap();
    let rw = Access::REMOTE_READ | Access::REMOTE_WRITE;
    table.add(HIDDEN, &hidden, rw, false);
    table.add(WRITE_ONLY, &write_only, Access::REMOTE_WRITE, true);
    table.add(USER, &user, rw, true);
    let (_h, peer) = serve(table.clone());
    let ch = LocalTransport::new(LocalConfig::default())
        .connect_channel(&peer)
        .unwrap();
    assert_eq!(ch.map_shared(HIDDEN), Some(Err(ShareRefusal::NotVisible)));
    assert_eq!(
        ch.map_shared(WRITE_ONLY),
        Some(Err(ShareRefusal::NotReadable))
    );
    assert_eq!(ch.map_shared(USER), Some(Err(ShareRefusal::NotShareable)));
    assert_eq!(
        ch.map_shared(SegmentToken(99)),
        Some(Err(ShareRefusal::NotVisible))
    );
    for r in [&hidden, &write_only] {
        let s = r.shared().unwrap().state();
        assert_eq!(
            (s.mode(), s.grants()),
            (ShareMode::Unshared, 0),
            "the fd never left"
        );
    }
    // The user's memory keeps the owner's copies: the bytes arrive, nothing one-sided.
    let local = Arc::new(MemoryRegion::alloc_zeroed(LEN, 4096).unwrap());
    let o = run(&ch, vec![op(OpKind::Read, &local, USER, 64 << 10)]).await;
    assert!(o.is_success(), "{o:?}");
    let mut got = vec![0u8; 64 << 10];
    local.read_at(0, &mut got).unwrap();
    assert!(got.iter().all(|b| *b == 0x55));
    assert_eq!(ch.shared_use(), Some((0, 0)));
    // With shared registrations off, no share stream at all.
    let off = LocalTransport::new(LocalConfig {
        shared: false,
        ..LocalConfig::default()
    })
    .connect_channel(&peer)
    .unwrap();
    assert_eq!(off.map_shared(USER), None);
    // A server with them off refuses the share stream: the channel maps nothing.
    let epoch = Epoch::fresh();
    let h = LocalServer::bind()
        .unwrap()
        .sharing(false)
        .serve(
            table,
            Arc::new(Responder(epoch)),
            HandshakeLimits::default(),
            16,
        )
        .unwrap();
    let mut refusing = peer.clone();
    refusing.remote_epoch = epoch;
    refusing.offer = TransportOffer::Local {
        boot_id: [0; 16],
        pid: std::process::id(),
        streams: 2,
        socket: h.name().to_owned(),
    };
    let ch = LocalTransport::new(LocalConfig::default())
        .connect_channel(&refusing)
        .unwrap();
    assert_eq!(ch.map_shared(HIDDEN), None);
}

/// The `/proc/self/maps` line of the mapping of a memfd named `ferry-shared` with `perms`.
fn mapped_with(perms: &str) -> usize {
    std::fs::read_to_string("/proc/self/maps")
        .unwrap()
        .lines()
        .filter(|l| l.contains("memfd:ferry-shared") && l.split_whitespace().nth(1) == Some(perms))
        .count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_only_grant_cannot_write() {
    let table = Arc::new(Table::default());
    let region = shareable(0x66);
    table.add(RO, &region, Access::REMOTE_READ, true);
    let (_h, peer) = serve(table.clone());
    let ch = LocalTransport::new(LocalConfig::default())
        .connect_channel(&peer)
        .unwrap();
    let before = mapped_with("r--s");
    assert_eq!(ch.map_shared(RO), Some(Ok(Grant::ReadOnly)));
    assert_eq!(mapped_with("r--s"), before + 1, "mapped PROT_READ");
    let local = Arc::new(MemoryRegion::alloc_zeroed(LEN, 4096).unwrap());
    let o = run(&ch, vec![op(OpKind::Read, &local, RO, 4096)]).await;
    assert!(o.is_success(), "{o:?}");
    assert_eq!(one_sided(&ch), 1);
    // A WRITE is not one-sided (the owner refuses it: the segment is read-only).
    let o = run(&ch, vec![op(OpKind::Write, &local, RO, 4096)]).await;
    assert!(!o.is_success());
    assert_eq!(one_sided(&ch), 1);
    // Whoever holds the descriptor, reopened for writing even: the seal refuses every write and
    // every resize, and a later read-write grant is refused.
    let shared = region.shared().unwrap();
    let path = format!("/proc/self/fd/{}", shared.fd().as_raw_fd());
    let mut f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
    let e = f.write_all(b"x").unwrap_err();
    assert_eq!(e.raw_os_error(), Some(libc::EPERM), "{e}");
    assert!(f.set_len(0).is_err(), "resized");
    assert_eq!(
        shared.grant(true, Access::REMOTE_READ | Access::REMOTE_WRITE),
        Err(ShareRefusal::SealedReadOnly)
    );
    let mut seg = vec![0u8; 16];
    region.read_at(0, &mut seg).unwrap();
    assert!(seg.iter().all(|b| *b == 0x66), "unchanged");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_registration_whose_memory_is_freed_cannot_be_read_afterwards() {
    for (token, access) in [
        (RW, Access::REMOTE_READ | Access::REMOTE_WRITE),
        (RO, Access::REMOTE_READ),
    ] {
        let table = Arc::new(Table::default());
        let region = shareable(0x77);
        table.add(token, &region, access, true);
        let (_h, peer) = serve(table.clone());
        let ch = LocalTransport::new(LocalConfig::default())
            .connect_channel(&peer)
            .unwrap();
        assert!(matches!(ch.map_shared(token), Some(Ok(_))));
        let local = Arc::new(MemoryRegion::alloc_zeroed(LEN, 4096).unwrap());
        let o = run(&ch, vec![op(OpKind::Read, &local, token, 4096)]).await;
        assert!(o.is_success(), "{o:?}");
        // A descriptor of the memfd held past the end (what a peer that ignores the revoked
        // word keeps): opened before the region goes.
        let fd = region.shared().unwrap().fd().as_raw_fd();
        let mut kept = std::fs::File::open(format!("/proc/self/fd/{fd}")).unwrap();
        // Unregistered, and the last hold on the memory dropped: the revocation is done when
        // the drop returns (the event the test waits for).
        table.remove(token);
        assert_eq!(
            Arc::strong_count(&region),
            1,
            "nothing else holds the region"
        );
        drop(region);
        local.write_at(0, &vec![0xaa; 4096]).unwrap();
        let o = run(&ch, vec![op(OpKind::Read, &local, token, 4096)]).await;
        let failure = o.failure.expect("a READ of a freed registration succeeded");
        assert_eq!(
            failure.kind,
            FailureKind::Remote(ferry_core::RemoteStatus::UnknownSegment),
            "{failure:?}"
        );
        let mut got = vec![0u8; 4096];
        local.read_at(0, &mut got).unwrap();
        assert!(got.iter().all(|b| *b == 0xaa), "bytes landed after the end");
        // Not mapped any more, nor granted again.
        assert_eq!(ch.shared_use().map(|u| u.0), Some(0));
        assert_eq!(ch.map_shared(token), Some(Err(ShareRefusal::Revoked)));
        // The kept descriptor reads no byte of the registration (discarded), and never faults.
        let mut bytes = vec![0xffu8; LEN];
        kept.seek(SeekFrom::Start(0)).unwrap();
        kept.read_exact(&mut bytes).unwrap();
        assert!(
            bytes.iter().all(|b| *b == 0),
            "{access:?}: the bytes outlived the registration"
        );
    }
}

/// A byte of a pattern no two nearby offsets share with a shift of a page or a piece.
fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| ((i as u64).wrapping_mul(0x9e37_79b9) >> 13) as u8 ^ seed ^ (i >> 20) as u8)
        .collect()
}

fn bytes_of(r: &MemoryRegion) -> Vec<u8> {
    let mut v = vec![0u8; r.len()];
    r.read_at(0, &mut v).unwrap();
    v
}

/// Runs `ops` on `ch` on a thread of its own, returning the control to stop it with.
fn run_on_thread(
    ch: &Arc<ferry_transport_local::LocalChannel>,
    ops: Vec<Op>,
) -> (
    Arc<RequestControl>,
    std::thread::JoinHandle<ferry_core::Outcome>,
) {
    let ops: Arc<[Op]> = ops.into();
    let control = Arc::new(RequestControl::new(&ops));
    let (ch, c) = (ch.clone(), control.clone());
    let t = std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        rt.block_on(ch.execute(ops, c))
    });
    (control, t)
}

/// Waits (yielding) until `landed` says the request's first bytes are there.
fn until(landed: impl Fn() -> bool, t: &std::thread::JoinHandle<ferry_core::Outcome>) {
    while !landed() && !t.is_finished() {
        std::thread::yield_now();
    }
}

/// Requests over a chunk are moved one-sidedly too, in pieces copied side by side: READs and
/// WRITEs of several ops of odd sizes and offsets land every byte where it belongs and none
/// elsewhere, round after round.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_over_a_chunk_is_copied_in_pieces_every_byte_right() {
    let remote = pattern(0x3c, BIG);
    let (_table, region, _h, ch) = mapped_rw(&remote);
    // (length, remote offset, local offset): odd sizes, a piece's edge crossed anywhere, one
    // op of no bytes, local and remote offsets that differ.
    let shape: [(u64, u64, u64); 7] = [
        ((3 << 20) + 17, 5, 4096 + 3),
        (1, (3 << 20) + 100, (3 << 20) + 8200),
        ((5 << 20) - 3, (4 << 20) + 1, (4 << 20) + 77),
        (0, 9 << 20, 9 << 20),
        ((2 << 20) + 4095, 10 << 20, (12 << 20) + 1),
        (64 << 10, (13 << 20) - 7, (15 << 20) + 5),
        ((7 << 20) + 1, 20 << 20, (16 << 20) + 9),
    ];
    let total: u64 = shape.iter().map(|s| s.0).sum();
    assert!(total > LocalConfig::default().chunk_size);
    let ops_of = |kind, local: &Arc<MemoryRegion>| -> Vec<Op> {
        shape
            .iter()
            .map(|&(len, remote_offset, local_offset)| Op {
                kind,
                local: local.clone(),
                local_offset,
                token: RW,
                remote_offset,
                len,
            })
            .collect()
    };
    let mut moved = one_sided(&ch);
    for round in 0..4u8 {
        // READs: each op's bytes of the segment, at its local offset; the rest untouched.
        region.write_at(0, &remote).unwrap();
        let local = Arc::new(MemoryRegion::alloc_zeroed(BIG, 4096).unwrap());
        let o = run(&ch, ops_of(OpKind::Read, &local)).await;
        assert!(o.is_success(), "{o:?}");
        assert_eq!(o.completed_bytes, total);
        let mut want = vec![0u8; BIG];
        for &(len, r, l) in &shape {
            let (r, l, n) = ((BASE + r) as usize, l as usize, len as usize);
            want[l..l + n].copy_from_slice(&remote[r..r + n]);
        }
        assert!(
            bytes_of(&local) == want,
            "round {round}: a READ's bytes differ"
        );
        moved += shape.len() as u64;
        assert_eq!(one_sided(&ch), moved, "one-sided, not the owner's");

        // WRITEs: each op's local bytes into the segment; the rest of the region unchanged.
        let src = pattern(0xa5 ^ round, BIG);
        local.write_at(0, &src).unwrap();
        let o = run(&ch, ops_of(OpKind::Write, &local)).await;
        assert!(o.is_success(), "{o:?}");
        let mut want = remote.clone();
        for &(len, r, l) in &shape {
            let (r, l, n) = ((BASE + r) as usize, l as usize, len as usize);
            want[r..r + n].copy_from_slice(&src[l..l + n]);
        }
        assert!(
            bytes_of(&region) == want,
            "round {round}: a WRITE's bytes differ"
        );
        moved += shape.len() as u64;
        assert_eq!(one_sided(&ch), moved);
    }
}

/// A registration revoked while a request over a chunk is being copied: the ops that see it
/// fail `UnknownSegment`, the request still resolves, and the mapping is dropped.
#[test]
fn a_registration_revoked_mid_request_fails_the_rest_and_the_request_resolves() {
    let mut caught = 0;
    for attempt in 0..10 {
        let (table, region, _h, ch) = mapped_rw(&vec![0; LONG_REGION]);
        let ch = Arc::new(ch);
        let local = Arc::new(MemoryRegion::alloc_zeroed(LONG_REGION, 4096).unwrap());
        local.write_at(0, &vec![0x5a; LONG_REGION]).unwrap();
        let n = LONG;
        let ops = (0..n)
            .map(|i| Op {
                kind: OpKind::Write,
                local: local.clone(),
                local_offset: i << 20,
                token: RW,
                remote_offset: i << 20,
                len: 1 << 20,
            })
            .collect();
        let (_, t) = run_on_thread(&ch, ops);
        // The first piece's first byte landed: revoke (unregistered, the last hold dropped).
        until(
            || {
                let mut b = [0u8; 1];
                region.read_at(BASE, &mut b).unwrap();
                b[0] == 0x5a
            },
            &t,
        );
        table.remove(RW);
        drop(region);
        let o = t.join().unwrap();
        if o.is_success() {
            // The whole request was copied before the revocation: try again.
            continue;
        }
        caught += 1;
        let f = o.failure.expect("failed");
        assert_eq!(
            f.kind,
            FailureKind::Remote(ferry_core::RemoteStatus::UnknownSegment),
            "attempt {attempt}: {o:?}"
        );
        assert!(o.completed_ops < n as usize);
        assert_eq!(ch.shared_use().map(|u| u.0), Some(0), "the mapping dropped");
        assert_eq!(ch.map_shared(RW), Some(Err(ShareRefusal::Revoked)));
        break;
    }
    assert!(caught > 0, "every request finished before its revocation");
}

/// A request over a chunk stopped while it is being copied: the pieces not started are not
/// copied, it resolves `Cancelled`, and nothing lands in the caller's memory afterwards.
#[test]
fn a_stopped_request_over_a_chunk_copies_nothing_after_it_resolves() {
    let (_table, _region, _h, ch) = mapped_rw(&vec![0xab; LONG_REGION]);
    let ch = Arc::new(ch);
    let n = LONG as usize;
    let reads = |local: &Arc<MemoryRegion>| -> Vec<Op> {
        (0..n as u64)
            .map(|i| Op {
                kind: OpKind::Read,
                local: local.clone(),
                local_offset: i << 20,
                token: RW,
                remote_offset: i << 20,
                len: 1 << 20,
            })
            .collect()
    };
    let mut caught = 0;
    for _ in 0..10 {
        let local = Arc::new(MemoryRegion::alloc_zeroed(LONG_REGION, 4096).unwrap());
        let (control, t) = run_on_thread(&ch, reads(&local));
        until(
            || {
                let mut b = [0u8; 1];
                local.read_at(0, &mut b).unwrap();
                b[0] == 0xab
            },
            &t,
        );
        control.stop(FailureKind::Cancelled);
        let o = t.join().unwrap();
        if o.is_success() {
            continue;
        }
        caught += 1;
        assert_eq!(o.failure.unwrap().kind, FailureKind::Cancelled, "{o:?}");
        let at_end = bytes_of(&local);
        // Blocks the request touched: every op complete, and at most the pieces in flight at
        // the stop (one per copying thread) beyond them; the rest never started.
        let touched: Vec<bool> = at_end
            .chunks(1 << 20)
            .take(n)
            .map(|b| b.iter().any(|x| *x != 0))
            .collect();
        assert!(touched[..o.completed_ops].iter().all(|t| *t));
        let beyond = touched[o.completed_ops..].iter().filter(|t| **t).count();
        assert!(beyond <= 5, "{beyond} ops copied after the stop: {o:?}");
        assert!(o.completed_ops + beyond < n, "nothing was skipped");
        // Another request over a chunk on the same pool, to its end: the stopped one's bytes
        // did not change meanwhile.
        let other = Arc::new(MemoryRegion::alloc_zeroed(LONG_REGION, 4096).unwrap());
        let (_, t) = run_on_thread(&ch, reads(&other));
        assert!(t.join().unwrap().is_success());
        assert!(
            bytes_of(&local) == at_end,
            "bytes landed after the request resolved"
        );
        if caught == 3 {
            break;
        }
    }
    assert!(caught > 0, "every request finished before its stop");
}
