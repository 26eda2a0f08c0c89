//! The suite's shared fixture: an in-memory segment table (memory and file segments), a
//! responder, an io_uring server on loopback, op and byte helpers. The facility gates and network
//! namespaces every crate shares are the `ferry_tests` library.
#![allow(dead_code, unreachable_pub)]

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ferry_tests::{URING, require_or_skip};

use ferry_core::wire::{
    Hello, Reject, RejectReason, SUPPORTED_VERSIONS, TransportOffer, VersionRange,
};
use ferry_core::{
    Access, Channel, Epoch, HandshakeResponder, MemoryRegion, Op, OpKind, Outcome, PeerId,
    PeerInfo, RequestControl, SegmentDesc, SegmentLease, SegmentTable, SegmentToken, Transport,
};
use ferry_file::FileSegment;
use ferry_transport_uring::{UringConfig, UringServer, UringServerHandle, UringTransport};

type Entry = (String, Arc<MemoryRegion>, Access);

/// Memory segments and file segments under random tokens.
#[derive(Debug, Default)]
pub struct Table {
    pub mem: Mutex<HashMap<SegmentToken, Entry>>,
    pub files: Mutex<HashMap<SegmentToken, (String, Arc<FileSegment>)>>,
    /// File sources that are not a `FileSegment` (served by their own positioned I/O).
    pub sources: Mutex<HashMap<SegmentToken, Arc<dyn ferry_core::FileSource>>>,
}

impl SegmentTable for Table {
    fn resolve(&self, token: SegmentToken) -> Option<SegmentLease> {
        let t = self.mem.lock().unwrap();
        t.get(&token).map(|(_, r, a)| SegmentLease {
            region: r.clone(),
            base: 0,
            len: r.len() as u64,
            access: *a,
            guard: None,
        })
    }
    fn published(&self) -> Vec<SegmentDesc> {
        let mut v: Vec<SegmentDesc> = self
            .mem
            .lock()
            .unwrap()
            .iter()
            .map(|(tok, (name, r, a))| SegmentDesc {
                name: name.clone(),
                token: *tok,
                len: r.len() as u64,
                access: *a,
                remote_keys: vec![],
            })
            .collect();
        v.extend(
            self.files
                .lock()
                .unwrap()
                .iter()
                .map(|(tok, (name, f))| SegmentDesc {
                    name: name.clone(),
                    token: *tok,
                    len: f.len(),
                    access: f.access(),
                    remote_keys: vec![],
                }),
        );
        v
    }
    fn file(&self, token: SegmentToken) -> Option<Arc<dyn ferry_core::FileSource>> {
        let files = self.files.lock().unwrap();
        match files.get(&token) {
            Some((_, f)) => Some(f.clone() as Arc<dyn ferry_core::FileSource>),
            None => self.sources.lock().unwrap().get(&token).cloned(),
        }
    }
}

/// Answers a handshake with `table`'s segments and one transport offer, or refuses a hello that
/// shares no protocol version with `versions` (`SUPPORTED_VERSIONS` but where a test says).
#[derive(Debug)]
pub struct Responder {
    pub id: PeerId,
    pub epoch: Epoch,
    pub versions: VersionRange,
    pub table: Arc<dyn SegmentTable>,
    pub offer: TransportOffer,
}

impl HandshakeResponder for Responder {
    fn peer_id(&self) -> PeerId {
        self.id
    }
    fn epoch(&self) -> Epoch {
        self.epoch
    }
    fn respond(
        &self,
        hello: &Hello,
        _from: SocketAddr,
        _peer: Option<&str>,
    ) -> Result<Hello, Reject> {
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
            transports: vec![self.offer.clone()],
            segments: self.table.published(),
        })
    }
}

/// An io_uring server on 127.0.0.1 (any port) serving `table` with `config`; it offers io_uring
/// with `config`'s settings.
pub fn serve_uring(table: &Arc<Table>, config: UringConfig) -> UringServerHandle {
    let server = UringServer::bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let responder = Arc::new(Responder {
        id: PeerId::random(),
        epoch: Epoch::fresh(),
        versions: SUPPORTED_VERSIONS,
        table: table.clone(),
        offer: UringTransport::new(config.clone()).unwrap().offer(),
    });
    server.serve(table.clone(), responder, config).unwrap()
}

/// Whether io_uring can run here; prints the reason when it cannot, and fails the test instead
/// with `FERRY_REQUIRE_URING=1`.
#[track_caller]
pub fn uring_usable() -> bool {
    let p = ferry_transport_uring::probe_kernel();
    match p.unusable_reason() {
        None => true,
        Some(why) => {
            require_or_skip(URING, format!("io_uring unusable here: {why}"));
            false
        }
    }
}

pub fn publish(
    table: &Table,
    name: &str,
    len: usize,
    access: Access,
) -> (SegmentToken, Arc<MemoryRegion>) {
    let r = Arc::new(MemoryRegion::alloc_zeroed(len, 4096).unwrap());
    let tok = SegmentToken::random();
    table
        .mem
        .lock()
        .unwrap()
        .insert(tok, (name.into(), r.clone(), access));
    (tok, r)
}

pub fn fill(r: &MemoryRegion, seed: u64) {
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

pub fn bytes(r: &MemoryRegion, at: u64, len: usize) -> Vec<u8> {
    let mut v = vec![0u8; len];
    r.read_at(at, &mut v).unwrap();
    v
}

pub fn op(
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

pub async fn run(ch: &Arc<dyn Channel>, ops: Vec<Op>) -> Outcome {
    let ops: Arc<[Op]> = ops.into();
    let control = Arc::new(RequestControl::new(&ops));
    ch.execute(ops, control).await
}

/// Handshake with the blocking uring handshake and build the peer info for the first offer.
pub fn peer_info(addr: SocketAddr, my_offer: TransportOffer) -> PeerInfo {
    peer_info_with(addr, my_offer, SUPPORTED_VERSIONS)
}

/// [`peer_info`] for a client that speaks `versions`: the info's version is the newest both
/// ends speak.
pub fn peer_info_with(
    addr: SocketAddr,
    my_offer: TransportOffer,
    versions: VersionRange,
) -> PeerInfo {
    let hello = Hello {
        versions,
        peer_id: PeerId::random(),
        epoch: Epoch::fresh(),
        transports: vec![my_offer],
        segments: vec![],
    };
    let server = ferry_transport_uring::handshake(addr, &hello, Duration::from_secs(5)).unwrap();
    PeerInfo {
        addr,
        local_id: hello.peer_id,
        local_epoch: hello.epoch,
        remote_id: server.peer_id,
        remote_epoch: server.epoch,
        offer: server.transports[0].clone(),
        segments: server.segments,
        session: None,
        key_name: None,
        version: versions.common(server.versions).unwrap_or(1),
    }
}
