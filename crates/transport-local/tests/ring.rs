//! The request/answer ring end to end, in one process: a served segment read and written in
//! ops of every size around the inline limit, on ring streams and on socket streams alike,
//! every byte checked; refused ops (inline bytes skipped by the server) leave the stream
//! serving.

mod common;
use common::{Responder, serve_table};

use std::sync::Arc;

use ferry_core::wire::TransportOffer;
use ferry_core::{
    Access, Channel, Epoch, MemoryRegion, Op, OpKind, PeerInfo, RequestControl, SegmentDesc,
    SegmentLease, SegmentTable, SegmentToken,
};
use ferry_net::HandshakeLimits;
use ferry_transport_local::wire::INLINE_MAX;
use ferry_transport_local::{LocalConfig, LocalServer, LocalServerHandle, LocalTransport};

const LEN: usize = 1 << 20;
const TOKEN: SegmentToken = SegmentToken(1);

#[derive(Debug)]
struct Table(Arc<MemoryRegion>);

impl SegmentTable for Table {
    fn resolve(&self, token: SegmentToken) -> Option<SegmentLease> {
        (token == TOKEN).then(|| SegmentLease {
            region: self.0.clone(),
            base: 0,
            len: LEN as u64,
            access: Access::REMOTE_READ | Access::REMOTE_WRITE,
            guard: None,
        })
    }
    fn published(&self) -> Vec<SegmentDesc> {
        Vec::new()
    }
}

fn serve(segment: Arc<MemoryRegion>) -> (LocalServerHandle, PeerInfo) {
    serve_table(Arc::new(Table(segment)), 2)
}

fn op(kind: OpKind, local: &Arc<MemoryRegion>, at: u64, len: u64) -> Op {
    Op {
        kind,
        local: local.clone(),
        local_offset: at,
        token: TOKEN,
        remote_offset: at,
        len,
    }
}

async fn run(ch: &dyn Channel, ops: Vec<Op>) -> ferry_core::Outcome {
    let ops: Arc<[Op]> = ops.into();
    ch.execute(ops.clone(), Arc::new(RequestControl::new(&ops)))
        .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_op_size_around_the_inline_limit_moves_its_bytes_on_the_ring_and_off_it() {
    for ring in [true, false] {
        let segment = Arc::new(MemoryRegion::from_vec(
            (0..LEN).map(|i| (i % 253) as u8).collect(),
        ));
        let (_h, peer) = serve(segment.clone());
        let transport = LocalTransport::new(LocalConfig {
            ring,
            ..LocalConfig::default()
        });
        let ch = transport.connect_channel(&peer).unwrap();
        assert_eq!(ch.ring_streams(), if ring { 2 } else { 0 });
        let local = Arc::new(MemoryRegion::alloc_zeroed(LEN, 4096).unwrap());
        let sizes = [
            1u64,
            7,
            64,
            4096,
            INLINE_MAX as u64 - 1,
            INLINE_MAX as u64,
            INLINE_MAX as u64 + 1,
            64 << 10,
        ];
        // READs, one at a time and all at once, at offsets that differ per size.
        let mut at = 0u64;
        let mut all = Vec::new();
        for &len in &sizes {
            let o = run(&ch, vec![op(OpKind::Read, &local, at, len)]).await;
            assert!(o.failure.is_none(), "READ {len}: {o:?}");
            all.push(op(OpKind::Read, &local, at + (128 << 10), len));
            at += len + 13;
        }
        let o = run(&ch, all).await;
        assert!(o.failure.is_none(), "{o:?}");
        let mut got = vec![0u8; LEN];
        local.read_at(0, &mut got).unwrap();
        let mut seg = vec![0u8; LEN];
        segment.read_at(0, &mut seg).unwrap();
        let mut at = 0usize;
        for &len in &sizes {
            for base in [at, at + (128 << 10)] {
                let r = base..base + len as usize;
                assert!(
                    got[r.clone()] == seg[r],
                    "ring {ring}: READ of {len} at {base}"
                );
            }
            at += len as usize + 13;
        }
        // WRITEs of other bytes into the second half of the segment.
        let base = (LEN / 2) as u64;
        local.write_at(0, &vec![0xee; LEN / 2]).unwrap();
        let mut at = 0u64;
        for &len in &sizes {
            let o = run(&ch, vec![op(OpKind::Write, &local, at, len)]).await;
            assert!(o.failure.is_none(), "WRITE {len}: {o:?}");
            at += len + 13;
        }
        let _ = base;
        segment.read_at(0, &mut seg).unwrap();
        let mut at = 0usize;
        for &len in &sizes {
            assert!(
                seg[at..at + len as usize].iter().all(|b| *b == 0xee),
                "ring {ring}: WRITE of {len} at {at}"
            );
            at += len as usize + 13;
        }
        // A refused small WRITE (past the segment's end): its inline bytes are skipped and
        // the stream keeps serving.
        let mut bad = op(OpKind::Write, &local, 0, 64);
        bad.remote_offset = LEN as u64 - 8;
        let o = run(&ch, vec![bad]).await;
        assert!(o.failure.is_some(), "a WRITE past the end was not refused");
        let o = run(&ch, vec![op(OpKind::Read, &local, 0, 64)]).await;
        assert!(o.failure.is_none(), "after a refusal: {o:?}");
        assert!(ch.is_alive());
    }
}

/// A file segment held in memory: what a published file is to the server (positioned reads and
/// writes behind a bounds check).
#[derive(Debug)]
struct FileBytes(std::sync::Mutex<Vec<u8>>);

impl ferry_core::FileSource for FileBytes {
    fn check(&self, _: OpKind, offset: u64, len: u64) -> Result<u64, ferry_core::RemoteStatus> {
        let size = self.0.lock().unwrap().len() as u64;
        match offset.checked_add(len) {
            Some(end) if end <= size => Ok(offset),
            _ => Err(ferry_core::RemoteStatus::OutOfBounds),
        }
    }
    fn read_exact_at(&self, at: u64, buf: &mut [u8]) -> std::io::Result<()> {
        let bytes = self.0.lock().unwrap();
        buf.copy_from_slice(&bytes[at as usize..at as usize + buf.len()]);
        Ok(())
    }
    fn write_all_at(&self, at: u64, buf: &[u8]) -> std::io::Result<()> {
        let mut bytes = self.0.lock().unwrap();
        bytes[at as usize..at as usize + buf.len()].copy_from_slice(buf);
        Ok(())
    }
}

/// A table of one file segment, `TOKEN`, served from `F`.
#[derive(Debug)]
struct Files<F>(Arc<F>);

impl<F: ferry_core::FileSource> SegmentTable for Files<F> {
    fn resolve(&self, _: SegmentToken) -> Option<SegmentLease> {
        None
    }
    fn file(&self, token: SegmentToken) -> Option<Arc<dyn ferry_core::FileSource>> {
        (token == TOKEN).then(|| self.0.clone() as Arc<dyn ferry_core::FileSource>)
    }
    fn published(&self) -> Vec<SegmentDesc> {
        Vec::new()
    }
}

/// A channel of `streams` ring streams to a server of `files`' file segments (and the servers,
/// held for as long as the channel is used).
fn files_channel(
    files: Arc<dyn SegmentTable>,
    streams: u16,
) -> (
    (LocalServerHandle, LocalServerHandle),
    ferry_transport_local::LocalChannel,
) {
    let epoch = Epoch::fresh();
    let h = LocalServer::bind()
        .unwrap()
        .serve(
            files,
            Arc::new(Responder(epoch)),
            HandshakeLimits::default(),
            16,
        )
        .unwrap();
    let (memory, mut peer) = serve(Arc::new(MemoryRegion::from_vec(vec![0; 8])));
    peer.remote_epoch = epoch;
    peer.offer = TransportOffer::Local {
        boot_id: [0; 16],
        pid: std::process::id(),
        streams,
        socket: h.name().to_owned(),
    };
    let ch = LocalTransport::new(LocalConfig::default())
        .connect_channel(&peer)
        .unwrap();
    assert_eq!(
        ch.ring_streams(),
        usize::from(streams),
        "the test needs ring streams"
    );
    ((h, memory), ch)
}

/// Small READs and WRITEs of a published file go inline on a ring stream, as memory's do (a
/// pull of a published directory reads files in pieces of every size).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_file_segment_is_read_and_written_in_small_ops_on_the_ring() {
    let file = Arc::new(FileBytes(std::sync::Mutex::new(
        (0..LEN).map(|i| (i % 251) as u8).collect(),
    )));
    let (_servers, ch) = files_channel(Arc::new(Files(file.clone())), 2);
    let local = Arc::new(MemoryRegion::alloc_zeroed(LEN, 4096).unwrap());
    for len in [1u64, 64, INLINE_MAX as u64, INLINE_MAX as u64 + 1] {
        let o = run(&ch, vec![op(OpKind::Read, &local, 1000, len)]).await;
        assert!(o.failure.is_none(), "a file READ of {len}: {o:?}");
        let mut got = vec![0u8; len as usize];
        local.read_at(1000, &mut got).unwrap();
        let want = &file.0.lock().unwrap()[1000..1000 + len as usize];
        assert!(got == want, "a file READ of {len} moved other bytes");
    }
    local.write_at(0, &vec![0xab; LEN / 2]).unwrap();
    for len in [1u64, 64, INLINE_MAX as u64] {
        let o = run(&ch, vec![op(OpKind::Write, &local, 5000, len)]).await;
        assert!(o.failure.is_none(), "a file WRITE of {len}: {o:?}");
        let bytes = file.0.lock().unwrap();
        assert!(
            bytes[5000..5000 + len as usize].iter().all(|b| *b == 0xab),
            "a file WRITE of {len} did not land"
        );
    }
    assert!(ch.is_alive());
}

/// A file segment whose reads wait while its gate is shut: a server held mid-answer.
#[derive(Debug)]
struct Gated {
    bytes: FileBytes,
    open: std::sync::Mutex<bool>,
    opened: std::sync::Condvar,
}

impl Gated {
    fn set(&self, open: bool) {
        *self.open.lock().unwrap() = open;
        self.opened.notify_all();
    }
}

impl ferry_core::FileSource for Gated {
    fn check(&self, kind: OpKind, offset: u64, len: u64) -> Result<u64, ferry_core::RemoteStatus> {
        self.bytes.check(kind, offset, len)
    }
    fn read_exact_at(&self, at: u64, buf: &mut [u8]) -> std::io::Result<()> {
        let open = self.open.lock().unwrap();
        drop(self.opened.wait_while(open, |o| !*o).unwrap());
        self.bytes.read_exact_at(at, buf)
    }
    fn write_all_at(&self, at: u64, buf: &[u8]) -> std::io::Result<()> {
        self.bytes.write_all_at(at, buf)
    }
}

/// A small request whose task's spin ran out adapts the channel's spin by how long it took
/// once it resolves: an answer held past the longest spin (the server idle, as far as the
/// client can tell) halves it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_answered_after_its_spin_ran_out_adapts_the_spin_by_its_wait() {
    let gated = Arc::new(Gated {
        bytes: FileBytes(std::sync::Mutex::new(vec![7; 4096])),
        open: std::sync::Mutex::new(true),
        opened: std::sync::Condvar::new(),
    });
    let (_servers, ch) = files_channel(Arc::new(Files(gated.clone())), 1);
    let local = Arc::new(MemoryRegion::alloc_zeroed(4096, 4096).unwrap());

    gated.set(false);
    let before = ch.spin_ns();
    let armed = ch.readers_armed();
    let ops: Arc<[Op]> = vec![op(OpKind::Read, &local, 0, 64)].into();
    let started = std::time::Instant::now();
    let request = tokio::spawn(ch.execute(ops.clone(), Arc::new(RequestControl::new(&ops))));
    // The spin ran out (the request is left to the reader), and the wait is past the longest
    // spin (50 us) whatever the scheduler does next.
    while ch.readers_armed() == armed || started.elapsed() < std::time::Duration::from_millis(1) {
        tokio::task::yield_now().await;
    }
    gated.set(true);
    let o = request.await.unwrap();
    assert!(o.failure.is_none(), "{o:?}");
    let mut got = [0u8; 64];
    local.read_at(0, &mut got).unwrap();
    assert_eq!(got, [7; 64]);
    assert!(before >= 2_000, "a new channel spins for {before} ns");
    assert_eq!(
        ch.spin_ns(),
        before / 2,
        "the spin did not adapt to the request's wait (from {before} ns)"
    );
}
