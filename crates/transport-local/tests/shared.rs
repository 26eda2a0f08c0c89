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
            len: SEG,
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
    let table = Arc::new(Table::default());
    let region = shareable(0x11);
    table.add(
        RW,
        &region,
        Access::REMOTE_READ | Access::REMOTE_WRITE,
        true,
    );
    let (_h, peer) = serve(table.clone());
    let ch = LocalTransport::new(LocalConfig::default())
        .connect_channel(&peer)
        .unwrap();
    assert_eq!(ch.map_shared(RW), Some(Ok(Grant::ReadWrite)));
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
    let table = Arc::new(Table::default());
    let region = shareable(0x12);
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
