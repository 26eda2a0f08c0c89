//! A simulated pair: client and server stream endpoints joined in memory, no sockets. The byte
//! streams are cut into arbitrary pieces, the streams of a channel are stepped in random order,
//! and a stream can be lost midway (its bytes in flight vanish, as when a connection resets).
//! What the simulation checks, whatever the schedule: every chunk is resolved exactly once; the
//! outcome's completed prefix really moved its bytes; a failure is the refusal the ops earned or
//! `PeerLost` after a cut; and a WRITE that the outcome reports with no remote effect changed no
//! remote byte.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use proptest::prelude::*;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::*;
use crate::dealer::{Dealer, StreamSet, deal_request};
use crate::ids::{Access, SegmentToken};
use crate::memory::MemoryRegion;
use crate::op::{Op, OpKind, SegmentDesc};
use crate::outcome::{FailureKind, Outcome, RemoteEffect, RemoteStatus, RequestControl};
use crate::transport::{FileSource, SegmentLease, SegmentTable};
use crate::wire::{DATA_REQUEST_LEN, DATA_RESPONSE_LEN};

#[derive(Debug)]
struct SimReq {
    ops: Arc<[Op]>,
    control: RequestControl,
    left: AtomicUsize,
}

impl ChunkOwner for SimReq {
    fn ops(&self) -> &[Op] {
        &self.ops
    }
    fn control(&self) -> &RequestControl {
        &self.control
    }
    fn chunk_done(&self) {
        let before = self.left.fetch_sub(1, Ordering::SeqCst);
        assert!(before > 0, "a chunk was resolved twice");
    }
}

#[derive(Debug)]
struct MemFile {
    data: Mutex<Vec<u8>>,
    access: Access,
}

impl FileSource for MemFile {
    fn check(&self, kind: OpKind, offset: u64, len: u64) -> Result<u64, RemoteStatus> {
        if !self.access.contains(kind.needed_access()) {
            return Err(RemoteStatus::AccessDenied);
        }
        let size = self.data.lock().unwrap().len() as u64;
        crate::memory::check_range(offset, len, size).map_err(|_| RemoteStatus::OutOfBounds)?;
        Ok(offset)
    }
    fn read_exact_at(&self, at: u64, buf: &mut [u8]) -> std::io::Result<()> {
        let d = self.data.lock().unwrap();
        buf.copy_from_slice(&d[at as usize..at as usize + buf.len()]);
        Ok(())
    }
    fn write_all_at(&self, at: u64, buf: &[u8]) -> std::io::Result<()> {
        let mut d = self.data.lock().unwrap();
        d[at as usize..at as usize + buf.len()].copy_from_slice(buf);
        Ok(())
    }
}

#[derive(Debug, Default)]
struct SimTable {
    memory: HashMap<SegmentToken, SegmentLease>,
    files: HashMap<SegmentToken, Arc<MemFile>>,
    /// Lookups of memory segments so far.
    resolved: AtomicUsize,
}

impl SegmentTable for SimTable {
    fn resolve(&self, token: SegmentToken) -> Option<SegmentLease> {
        self.resolved.fetch_add(1, Ordering::Relaxed);
        self.memory.get(&token).cloned()
    }
    fn published(&self) -> Vec<SegmentDesc> {
        Vec::new()
    }
    fn file(&self, token: SegmentToken) -> Option<Arc<dyn FileSource>> {
        self.files
            .get(&token)
            .map(|f| f.clone() as Arc<dyn FileSource>)
    }
}

/// Segments of the simulated server: a read-write memory segment, a read-only one, and a
/// read-write file, each `SLOT * slots` bytes.
const RW: SegmentToken = SegmentToken(11);
const RO: SegmentToken = SegmentToken(12);
const FILE: SegmentToken = SegmentToken(13);
const UNKNOWN: SegmentToken = SegmentToken(99);
const SLOT: u64 = 256;

/// The server's view of one request being received.
enum ServerRx {
    Head,
    Write {
        lease: SegmentLease,
        token: SegmentToken,
        at: u64,
        len: usize,
        got: usize,
        seq: u32,
        ack_slack: u16,
    },
    WriteFile {
        file: Arc<dyn FileSource>,
        at: u64,
        buf: Vec<u8>,
        len: usize,
        response: [u8; DATA_RESPONSE_LEN],
    },
    Discard {
        left: u64,
        response: [u8; DATA_RESPONSE_LEN],
    },
    /// A vectored request's piece table being received.
    Table {
        req: crate::wire::VectoredRequest,
        buf: Vec<u8>,
    },
    /// A vectored WRITE's payload being received into its targets, in turn.
    Pieces {
        targets: VecDeque<Target>,
        got: usize,
        discard: u64,
        response: [u8; DATA_RESPONSE_LEN],
    },
    Closed,
}

enum ClientRx {
    Head,
    Payload {
        chunk: Chunk<SimReq>,
        got: usize,
    },
    /// A vectored READ's pieces being received, in turn.
    Pieces {
        pieces: VecDeque<Chunk<SimReq>>,
        got: usize,
    },
}

struct Link {
    client: ClientStream<SimReq>,
    crx: ClientRx,
    server: ServerStream,
    srx: ServerRx,
    /// Bytes sent by the client, not yet delivered to the server.
    c2s: VecDeque<u8>,
    /// Delivered to the server, not yet consumed.
    s_in: VecDeque<u8>,
    s2c: VecDeque<u8>,
    c_in: VecDeque<u8>,
    alive: bool,
}

impl Link {
    fn new(depth: usize, policy: AckPolicy, table: Arc<SimTable>) -> Self {
        Self {
            client: ClientStream::new(depth, policy),
            crx: ClientRx::Head,
            server: ServerStream::new(table),
            srx: ServerRx::Head,
            c2s: VecDeque::new(),
            s_in: VecDeque::new(),
            s2c: VecDeque::new(),
            c_in: VecDeque::new(),
            alive: true,
        }
    }

    fn idle(&self) -> bool {
        !self.alive
            || (self.client.in_flight() == 0
                && self.c2s.is_empty()
                && self.s_in.is_empty()
                && self.s2c.is_empty()
                && self.c_in.is_empty())
    }

    /// The stream is lost: bytes in flight vanish, the server forgets it, the client fails what
    /// it had in flight (and a READ payload it was receiving).
    fn cut(&mut self) {
        self.alive = false;
        match std::mem::replace(&mut self.crx, ClientRx::Head) {
            ClientRx::Payload { chunk, .. } => chunk.lost(None),
            ClientRx::Pieces { pieces, .. } => pieces.into_iter().for_each(|c| c.lost(None)),
            ClientRx::Head => {}
        }
        self.client.fail_all(None);
        self.c2s.clear();
        self.s2c.clear();
        self.s_in.clear();
        self.c_in.clear();
        self.srx = ServerRx::Closed;
    }

    fn post(&mut self, work: Work<SimReq>) -> Option<Work<SimReq>> {
        match self.client.post(work) {
            Post::Send(out) => {
                self.c2s.extend(out.head);
                self.c2s.extend(&out.table);
                if !out.scatter.is_empty() {
                    if out.kind == OpKind::Write {
                        for r in &out.scatter {
                            let mut body = vec![0u8; r.len];
                            r.region.read_at(r.at, &mut body).unwrap();
                            self.c2s.extend(body);
                        }
                    }
                } else if out.kind == OpKind::Write {
                    let mut body = vec![0u8; out.len];
                    out.region.read_at(out.local_at, &mut body).unwrap();
                    self.c2s.extend(body);
                }
                // Copied out: the payload has left local memory.
                self.client.sent(out.seq);
                None
            }
            Post::Resolved => None,
            Post::Broken(c) => Some(c),
        }
    }

    /// The server consumes what was delivered to it.
    fn serve(&mut self) {
        loop {
            match &mut self.srx {
                ServerRx::Closed => return,
                ServerRx::Head => {
                    if self.s_in.len() < DATA_REQUEST_LEN {
                        return;
                    }
                    let head = take::<DATA_REQUEST_LEN>(&mut self.s_in);
                    let action = self.server.on_request(&head);
                    if !action.joins_held()
                        && let Some(r) = self.server.flush()
                    {
                        self.s2c.extend(r);
                    }
                    self.srx = self.begin(action);
                }
                ServerRx::Table { req, buf } => {
                    let n = (req.table_len() - buf.len()).min(self.s_in.len());
                    buf.extend(self.s_in.drain(..n));
                    if buf.len() < req.table_len() {
                        return;
                    }
                    let (req, buf) = (*req, std::mem::take(buf));
                    let action = self.server.on_table(&req, &buf);
                    self.srx = self.answer_table(action);
                }
                ServerRx::Pieces {
                    targets,
                    got,
                    discard,
                    response,
                } => {
                    if let Some(t) = targets.front() {
                        let n = (t.len() - *got).min(self.s_in.len());
                        let piece: Vec<u8> = self.s_in.drain(..n).collect();
                        match t {
                            Target::Memory { lease, at, .. } => {
                                lease.region.write_at(*at + *got as u64, &piece).unwrap()
                            }
                            Target::File { file, at, .. } => {
                                file.write_all_at(*at + *got as u64, &piece).unwrap()
                            }
                        }
                        *got += n;
                        if *got < t.len() {
                            return;
                        }
                        targets.pop_front();
                        *got = 0;
                        continue;
                    }
                    let n = (*discard).min(self.s_in.len() as u64);
                    self.s_in.drain(..n as usize);
                    *discard -= n;
                    if *discard > 0 {
                        return;
                    }
                    self.s2c.extend(*response);
                    self.srx = ServerRx::Head;
                }
                ServerRx::Write {
                    lease,
                    token,
                    at,
                    len,
                    got,
                    seq,
                    ack_slack,
                } => {
                    let n = (*len - *got).min(self.s_in.len());
                    let piece: Vec<u8> = self.s_in.drain(..n).collect();
                    lease.region.write_at(*at + *got as u64, &piece).unwrap();
                    *got += n;
                    if *got < *len {
                        return;
                    }
                    // Held back only if the next request has already arrived.
                    if self.server.may_hold(*ack_slack) && self.s_in.len() >= DATA_REQUEST_LEN {
                        let next: [u8; DATA_REQUEST_LEN] = std::array::from_fn(|i| self.s_in[i]);
                        if self.server.hold_for_next(lease, *token, *seq, &next) {
                            self.srx = ServerRx::Head;
                            continue;
                        }
                    }
                    let r = self.server.answer_write(*seq);
                    self.s2c.extend(r);
                    self.srx = ServerRx::Head;
                }
                ServerRx::WriteFile {
                    file,
                    at,
                    buf,
                    len,
                    response,
                } => {
                    let n = (*len - buf.len()).min(self.s_in.len());
                    buf.extend(self.s_in.drain(..n));
                    if buf.len() < *len {
                        return;
                    }
                    file.write_all_at(*at, buf).unwrap();
                    self.s2c.extend(*response);
                    self.srx = ServerRx::Head;
                }
                ServerRx::Discard { left, response } => {
                    let n = (*left).min(self.s_in.len() as u64);
                    self.s_in.drain(..n as usize);
                    *left -= n;
                    if *left > 0 {
                        return;
                    }
                    self.s2c.extend(*response);
                    self.srx = ServerRx::Head;
                }
            }
        }
    }

    /// What the server does with the action a request header asked for: a READ or CHECKSUM is
    /// answered at once, the rest is received next.
    fn begin(&mut self, action: Action) -> ServerRx {
        match action {
            Action::WriteMemory {
                lease,
                token,
                at,
                len,
                seq,
                ack_slack,
            } => ServerRx::Write {
                lease,
                token,
                at,
                len,
                got: 0,
                seq,
                ack_slack,
            },
            Action::ReadMemory {
                lease,
                at,
                len,
                response,
            } => {
                let mut body = vec![0u8; len];
                lease.region.read_at(at, &mut body).unwrap();
                self.s2c.extend(response);
                self.s2c.extend(body);
                ServerRx::Head
            }
            Action::ReadFile {
                file,
                at,
                len,
                response,
            } => {
                let mut body = vec![0u8; len];
                file.read_exact_at(at, &mut body).unwrap();
                self.s2c.extend(response);
                self.s2c.extend(body);
                ServerRx::Head
            }
            Action::WriteFile {
                file,
                at,
                len,
                response,
            } => ServerRx::WriteFile {
                file,
                at,
                buf: Vec::with_capacity(len),
                len,
                response,
            },
            Action::Refuse {
                discard, response, ..
            } => ServerRx::Discard {
                left: discard,
                response,
            },
            Action::Close { response, .. } => {
                self.s2c.extend(response);
                ServerRx::Closed
            }
            Action::ChecksumMemory { sum, seq, .. } => {
                self.s2c.extend(super::checksum_response(seq, sum.finish()));
                ServerRx::Head
            }
            Action::ChecksumFile { file, at, len, seq } => {
                let crc = crate::checksum::crc32c_file(&*file, at, len).unwrap();
                self.s2c.extend(super::checksum_response(seq, crc));
                ServerRx::Head
            }
            Action::Table { req } => ServerRx::Table {
                req,
                buf: Vec::with_capacity(req.table_len()),
            },
            Action::Vectored { .. } => {
                panic!("a vectored action before its table")
            }
        }
    }

    /// What the server does with its answer to a piece table: a vectored WRITE's payload is
    /// received next, a vectored READ is answered at once.
    fn answer_table(&mut self, action: Action) -> ServerRx {
        match action {
            Action::Vectored {
                kind: OpKind::Write,
                targets,
                discard,
                response,
            } => ServerRx::Pieces {
                targets: targets.into(),
                got: 0,
                discard,
                response,
            },
            Action::Vectored {
                targets, response, ..
            } => {
                self.s2c.extend(response);
                for t in targets {
                    let mut body = vec![0u8; t.len()];
                    match t {
                        Target::Memory { lease, at, .. } => {
                            lease.region.read_at(at, &mut body).unwrap()
                        }
                        Target::File { file, at, .. } => file.read_exact_at(at, &mut body).unwrap(),
                    }
                    self.s2c.extend(body);
                }
                ServerRx::Head
            }
            Action::Close { response, .. } => {
                self.s2c.extend(response);
                ServerRx::Closed
            }
            other => panic!("not an answer to a piece table: {other:?}"),
        }
    }

    /// The client consumes what was delivered to it; a violation breaks the stream.
    fn receive(&mut self) {
        loop {
            match &mut self.crx {
                ClientRx::Head => {
                    if self.c_in.len() < DATA_RESPONSE_LEN {
                        return;
                    }
                    let head = take::<DATA_RESPONSE_LEN>(&mut self.c_in);
                    match self.client.on_response(&head) {
                        Ok(Resolution::Done) => {}
                        Ok(Resolution::Payload(chunk)) => {
                            self.crx = ClientRx::Payload { chunk, got: 0 }
                        }
                        Ok(Resolution::Pieces(pieces)) => {
                            self.crx = ClientRx::Pieces {
                                pieces: pieces.into(),
                                got: 0,
                            }
                        }
                        Err(v) => panic!("a correct server broke the protocol: {v}"),
                    }
                }
                ClientRx::Pieces { pieces, got } => {
                    let Some(chunk) = pieces.front() else {
                        self.crx = ClientRx::Head;
                        continue;
                    };
                    let len = chunk.payload_len() as usize;
                    let n = (len - *got).min(self.c_in.len());
                    let piece: Vec<u8> = self.c_in.drain(..n).collect();
                    let at = chunk.local_at() + *got as u64;
                    chunk.op().local.write_at(at, &piece).unwrap();
                    *got += n;
                    if *got < len {
                        return;
                    }
                    *got = 0;
                    if let Some(c) = pieces.pop_front() {
                        c.acked();
                    }
                }
                ClientRx::Payload { chunk, got } => {
                    let len = chunk.payload_len() as usize;
                    let n = (len - *got).min(self.c_in.len());
                    let piece: Vec<u8> = self.c_in.drain(..n).collect();
                    let at = chunk.local_at() + *got as u64;
                    chunk.op().local.write_at(at, &piece).unwrap();
                    *got += n;
                    if *got < len {
                        return;
                    }
                    if let ClientRx::Payload { chunk, .. } =
                        std::mem::replace(&mut self.crx, ClientRx::Head)
                    {
                        chunk.acked();
                    }
                }
            }
        }
    }
}

fn take<const N: usize>(q: &mut VecDeque<u8>) -> [u8; N] {
    let out = std::array::from_fn(|i| q[i]);
    q.drain(..N);
    out
}

/// Moves 1..=`max` bytes (as many as there are, at most) from `from` to `to`.
fn deliver(rng: &mut StdRng, from: &mut VecDeque<u8>, to: &mut VecDeque<u8>, max: usize) {
    if from.is_empty() {
        return;
    }
    let n = rng.gen_range(1..=max.max(1)).min(from.len());
    to.extend(from.drain(..n));
}

/// One op as generated: its kind, which segment it names, and whether it stays in bounds.
#[derive(Clone, Copy, Debug)]
struct OpSpec {
    kind: OpKind,
    target: u8,
    len: u64,
    out_of_bounds: bool,
}

fn op_spec() -> impl Strategy<Value = OpSpec> {
    (
        prop_oneof![
            3 => Just(OpKind::Read),
            3 => Just(OpKind::Write),
            1 => Just(OpKind::Checksum)
        ],
        // 0..=5 RW memory (most), 6 RO memory, 7 file, 8 unknown.
        0u8..9,
        0u64..=SLOT,
        prop::bool::weighted(0.05),
    )
        .prop_map(|(kind, target, len, out_of_bounds)| OpSpec {
            kind,
            target,
            len,
            out_of_bounds,
        })
}

#[derive(Clone, Debug)]
struct Case {
    ops: Vec<OpSpec>,
    streams: usize,
    depth: usize,
    chunk: u64,
    policy: AckPolicy,
    /// The step at which one stream is lost, and which.
    cut: Option<(usize, usize)>,
    /// The largest piece a byte stream is cut into.
    split: usize,
    seed: u64,
    /// A peer of protocol version 3: small ops grouped into vectored requests of at most this
    /// many bytes.
    vectored: Option<u64>,
}

fn case() -> impl Strategy<Value = Case> {
    (
        prop::collection::vec(op_spec(), 1..8),
        1usize..=4,
        1usize..=4,
        1u64..=96,
        prop_oneof![
            1 => Just(AckPolicy::Immediate),
            1 => Just(AckPolicy::Network),
            2 => Just(AckPolicy::Loopback)
        ],
        prop::option::weighted(0.3, (0usize..400, 0usize..4)),
        prop_oneof![Just(1usize), 1usize..=64, 1usize..=4096],
        any::<u64>(),
        prop::option::weighted(0.5, 2u64..=2048),
    )
        .prop_map(
            |(ops, streams, depth, chunk, policy, cut, split, seed, vectored)| Case {
                ops,
                streams,
                depth,
                chunk,
                policy,
                cut,
                split,
                seed,
                vectored,
            },
        )
}

/// What a generated op expects from the server, if it was the only op: `Ok` or the refusal.
fn expected(spec: &OpSpec) -> Result<(), RemoteStatus> {
    if spec.target == 8 {
        return Err(RemoteStatus::UnknownSegment);
    }
    if spec.target == 6 && spec.kind == OpKind::Write {
        return Err(RemoteStatus::AccessDenied);
    }
    if spec.out_of_bounds {
        return Err(RemoteStatus::OutOfBounds);
    }
    Ok(())
}

struct Run {
    outcome: Outcome,
    cut_happened: bool,
}

fn fill(rng: &mut StdRng, len: usize) -> Vec<u8> {
    (0..len).map(|_| rng.r#gen()).collect()
}

/// The server's published memory and file, as a run starts: a read-write and a read-only
/// region and a file of `size` bytes each (random bytes), in a table under [`RW`], [`RO`] and
/// [`FILE`].
struct World {
    size: usize,
    rw: Arc<MemoryRegion>,
    ro: Arc<MemoryRegion>,
    file: Arc<MemFile>,
    table: Arc<SimTable>,
}

impl World {
    fn new(rng: &mut StdRng, size: usize) -> Self {
        let rw = Arc::new(MemoryRegion::from_vec(fill(rng, size)));
        let ro = Arc::new(MemoryRegion::from_vec(fill(rng, size)));
        let file = Arc::new(MemFile {
            data: Mutex::new(fill(rng, size)),
            access: Access::REMOTE_READ | Access::REMOTE_WRITE,
        });
        let lease = |region: &Arc<MemoryRegion>, access| SegmentLease {
            region: region.clone(),
            base: 0,
            len: size as u64,
            access,
            guard: None,
        };
        let mut table = SimTable::default();
        table
            .memory
            .insert(RW, lease(&rw, Access::REMOTE_READ | Access::REMOTE_WRITE));
        table.memory.insert(RO, lease(&ro, Access::REMOTE_READ));
        table.files.insert(FILE, file.clone());
        Self {
            size,
            rw,
            ro,
            file,
            table: Arc::new(table),
        }
    }

    /// The whole remote segment `spec` names, as it is now (the read-write one for an unknown
    /// segment).
    fn remote(&self, spec: &OpSpec) -> Vec<u8> {
        match spec.target {
            7 => self.file.data.lock().unwrap().clone(),
            6 => {
                let mut v = vec![0; self.size];
                self.ro.read_at(0, &mut v).unwrap();
                v
            }
            _ => {
                let mut v = vec![0; self.size];
                self.rw.read_at(0, &mut v).unwrap();
                v
            }
        }
    }
}

/// The ops of `case` over `local`: each op has its own slot, locally and remotely, so ops never
/// overlap; an out-of-bounds op runs past the end of its segment of `size` bytes.
fn ops_of(case: &Case, local: &Arc<MemoryRegion>, size: usize) -> Arc<[Op]> {
    case.ops
        .iter()
        .enumerate()
        .map(|(i, s)| Op {
            kind: s.kind,
            local: local.clone(),
            local_offset: i as u64 * SLOT,
            token: match s.target {
                6 => RO,
                7 => FILE,
                8 => UNKNOWN,
                _ => RW,
            },
            remote_offset: if s.out_of_bounds {
                size as u64 - s.len / 2
            } else {
                i as u64 * SLOT
            },
            len: if s.out_of_bounds { s.len.max(2) } else { s.len },
        })
        .collect()
}

/// Runs `case` to the end and checks every property the module docs name.
fn run(case: &Case) -> Run {
    let mut rng = StdRng::seed_from_u64(case.seed);
    let size = (SLOT * case.ops.len() as u64) as usize;
    let world = World::new(&mut rng, size);
    let before: Vec<Vec<u8>> = case.ops.iter().map(|s| world.remote(s)).collect();
    let local = Arc::new(MemoryRegion::from_vec(fill(&mut rng, size)));
    let mut local_before = vec![0; size];
    local.read_at(0, &mut local_before).unwrap();
    let ops = ops_of(case, &local, size);
    let req = Arc::new(SimReq {
        ops: ops.clone(),
        control: RequestControl::new(&ops),
        left: AtomicUsize::new(0),
    });
    let dealer = Mutex::new(Dealer::new(case.streams));
    deal_request(
        &dealer,
        &req,
        case.chunk,
        case.vectored,
        false,
        |n| {
            req.left.fetch_add(n, Ordering::SeqCst);
        },
        |_| {},
    );
    let mut links: Vec<Link> = (0..case.streams)
        .map(|_| Link::new(case.depth, case.policy, world.table.clone()))
        .collect();
    let cut_happened = drive(case, &mut rng, &mut links, &dealer);
    dealer.lock().unwrap().close();
    assert_eq!(
        req.left.load(Ordering::SeqCst),
        0,
        "every chunk is resolved exactly once"
    );
    let outcome = req.control.outcome(true);
    check_bytes(case, &world, &ops, &before, &local_before, &outcome);
    Run {
        outcome,
        cut_happened,
    }
}

/// Steps `links` in random order (a driver posting, bytes delivered and consumed either way)
/// until nothing is queued or in flight, losing the stream `case.cut` names at its step;
/// whether a stream was lost.
fn drive(
    case: &Case,
    rng: &mut StdRng,
    links: &mut [Link],
    dealer: &Mutex<Dealer<Work<SimReq>>>,
) -> bool {
    let mut cut_happened = false;
    let mut step = 0usize;
    loop {
        step += 1;
        assert!(step < 1_000_000, "the simulation does not finish");
        if let Some((at, which)) = case.cut
            && at == step
        {
            let i = which % links.len();
            if links[i].alive {
                cut_happened = true;
                links[i].cut();
                let mut woken = StreamSet::default();
                for orphan in dealer.lock().unwrap().leave(i, &mut woken) {
                    orphan.not_posted(FailureKind::PeerLost);
                }
            }
        }
        // Streams are stepped in random order.
        let i = rng.gen_range(0..links.len());
        let link = &mut links[i];
        if !link.alive {
            if links.iter().all(|l| !l.alive) {
                break;
            }
            continue;
        }
        match rng.gen_range(0..4) {
            // A driver posts while it has room and work.
            0 => {
                while link.client.has_room() {
                    let idle = link.client.in_flight() == 0;
                    let Some(c) = dealer.lock().unwrap().take(i, idle) else {
                        break;
                    };
                    if let Some(back) = link.post(c) {
                        panic!("a live stream refused a chunk: {back:?}");
                    }
                }
            }
            1 => {
                deliver(rng, &mut link.c2s, &mut link.s_in, case.split);
                link.serve();
            }
            2 => {
                deliver(rng, &mut link.s2c, &mut link.c_in, case.split);
                link.receive();
            }
            _ => {}
        }
        let queued = {
            let d = dealer.lock().unwrap();
            d.queued() > 0
        };
        if !queued && links.iter().all(Link::idle) && case.cut.is_none_or(|(at, _)| step > at) {
            break;
        }
    }
    cut_happened
}

/// Checks what `outcome` says against the bytes: the completed prefix moved its bytes (a
/// CHECKSUM's digest landed in its slot, nothing else of it changed); a WRITE from the failed
/// op on changed no remote byte when the outcome says no remote effect; a WRITE never changed
/// local bytes. `before`: each op's remote segment before the run; `local_before`: the local
/// buffer before it.
fn check_bytes(
    case: &Case,
    world: &World,
    ops: &[Op],
    before: &[Vec<u8>],
    local_before: &[u8],
    outcome: &Outcome,
) {
    for (i, (spec, op)) in case.ops.iter().zip(ops.iter()).enumerate() {
        let slot = i * SLOT as usize;
        let r = op.remote_offset as usize;
        let len = op.len as usize;
        let mut l = vec![0; len];
        op.local.read_at(slot as u64, &mut l).unwrap();
        let remote = world.remote(spec);
        if i < outcome.completed_ops && spec.kind == OpKind::Checksum {
            // The digest of the remote range landed in the first bytes of the slot, and nothing
            // else of the slot changed.
            let crc = crate::checksum::crc32c(&remote[r..r + len]);
            let n = crate::checksum::CHECKSUM_LEN;
            assert_eq!(
                l[..n.min(len)],
                crc.to_le_bytes()[..n.min(len)],
                "op {i}: digest"
            );
            let mut whole = vec![0; SLOT as usize];
            op.local.read_at(slot as u64, &mut whole).unwrap();
            assert_eq!(whole[..n], crc.to_le_bytes(), "op {i}: digest");
            assert_eq!(whole[n..], local_before[slot + n..slot + SLOT as usize]);
        } else if i < outcome.completed_ops {
            assert_eq!(l, &remote[r..r + len], "op {i} completed with other bytes");
        }
        // A WRITE from the failed op on counts as unchanged when the outcome says `None`.
        if i >= outcome.completed_ops
            && spec.kind == OpKind::Write
            && outcome.remote_effect == RemoteEffect::None
            && expected(spec).is_ok()
        {
            assert_eq!(
                &remote[r..r + len],
                &before[i][r..r + len],
                "op {i} changed remote bytes but the outcome says no remote effect"
            );
        }
        // A READ or CHECKSUM that is not complete may have landed partly; a WRITE never
        // touches local bytes.
        if spec.kind == OpKind::Write {
            assert_eq!(l, &local_before[slot..slot + len]);
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(fuzz_cases(512)))]

    /// Whatever the schedule, splits and streams: the outcome is the one the ops earned (every op
    /// complete, or the first refused op's refusal), unless a stream was lost (then `PeerLost` is
    /// allowed too), and the properties `run` checks hold.
    #[test]
    fn a_simulated_pair_moves_exactly_what_the_outcome_says(case in case()) {
        let Run { outcome, cut_happened } = run(&case);
        let first_bad = case.ops.iter().position(|s| expected(s).is_err());
        match outcome.failure {
            None => {
                prop_assert_eq!(outcome.completed_ops, case.ops.len());
                prop_assert!(first_bad.is_none());
            }
            Some(f) if f.kind == FailureKind::PeerLost => {
                prop_assert!(cut_happened, "PeerLost without a lost stream: {:?}", outcome);
                prop_assert!(first_bad.is_none_or(|b| f.op_index <= b));
            }
            Some(f) => {
                // Chunks of ops before a refused one may be left unposted once it is refused
                // (the request stops posting; with several streams, a later op's refusal can
                // come first): the prefix ends at or before the first bad op, with the refusal
                // of a bad op at or after it.
                let b = first_bad.expect("a refusal with no bad op");
                prop_assert!(f.op_index <= b);
                let earned = case.ops[f.op_index..]
                    .iter()
                    .filter_map(|s| expected(s).err())
                    .any(|status| f.kind == FailureKind::Remote(status));
                prop_assert!(earned, "{:?} is no op's refusal", f);
            }
        }
        prop_assert!(outcome.drained);
    }
}

/// With nothing lost and every op valid, every policy and split moves every op.
#[test]
fn without_faults_every_op_completes() {
    for policy in [
        AckPolicy::Immediate,
        AckPolicy::Network,
        AckPolicy::Loopback,
    ] {
        for split in [1, 7, 4096] {
            let case = Case {
                ops: (0..6)
                    .map(|i| OpSpec {
                        kind: match i % 3 {
                            0 => OpKind::Write,
                            1 => OpKind::Read,
                            _ => OpKind::Checksum,
                        },
                        target: if i == 5 { 7 } else { 0 },
                        len: SLOT - i,
                        out_of_bounds: false,
                    })
                    .collect(),
                streams: 2,
                depth: 4,
                chunk: 16,
                policy,
                cut: None,
                split,
                seed: 7,
                vectored: None,
            };
            let run = run(&case);
            assert!(
                run.outcome.is_success(),
                "{policy:?} {split}: {:?}",
                run.outcome
            );
        }
    }
}

/// A vectored batch with one piece refused midway (out of bounds; then against the segment's
/// rights): the outcome completes exactly the pieces before it, moved their bytes (checked by
/// `run`), fails at it with its refusal, and reports no remote effect for the pieces after it
/// (the server touched none of them). READs and WRITEs, splits of 1 byte and whole.
#[test]
fn a_piece_refused_mid_batch_completes_exactly_the_pieces_before_it() {
    for kind in [OpKind::Write, OpKind::Read] {
        for (bad, status) in [
            (
                OpSpec {
                    kind,
                    target: 0,
                    len: 64,
                    out_of_bounds: true,
                },
                RemoteStatus::OutOfBounds,
            ),
            (
                OpSpec {
                    kind,
                    target: if kind == OpKind::Write { 6 } else { 8 },
                    len: 64,
                    out_of_bounds: false,
                },
                if kind == OpKind::Write {
                    RemoteStatus::AccessDenied
                } else {
                    RemoteStatus::UnknownSegment
                },
            ),
        ] {
            for split in [1, 4096] {
                let mut ops: Vec<OpSpec> = (0..8)
                    .map(|i| OpSpec {
                        kind,
                        target: if i % 2 == 0 { 0 } else { 7 },
                        len: 32 + i,
                        out_of_bounds: false,
                    })
                    .collect();
                ops[3] = bad;
                let case = Case {
                    ops,
                    streams: 1,
                    depth: 4,
                    chunk: 1000,
                    policy: AckPolicy::Loopback,
                    cut: None,
                    split,
                    seed: 3,
                    vectored: Some(4096),
                };
                let run = run(&case);
                assert_eq!(run.outcome.completed_ops, 3, "{kind:?} {status:?}");
                let f = run.outcome.failure.unwrap();
                assert_eq!(
                    (f.op_index, f.kind),
                    (3, FailureKind::Remote(status)),
                    "{kind:?}"
                );
                assert_eq!(run.outcome.remote_effect, RemoteEffect::None);
            }
        }
    }
}

fn one_op(kind: OpKind, len: u64) -> (Arc<SimReq>, Arc<[Op]>) {
    let ops: Arc<[Op]> = vec![Op {
        kind,
        local: Arc::new(MemoryRegion::from_vec(vec![0; 1024])),
        local_offset: 0,
        token: RW,
        remote_offset: 0,
        len,
    }]
    .into();
    let req = Arc::new(SimReq {
        ops: ops.clone(),
        control: RequestControl::new(&ops),
        left: AtomicUsize::new(0),
    });
    (req, ops)
}

/// `n` ops of `kind` and `len` bytes each, op `i` at `i * len` locally and remotely in RW.
fn many_ops(kind: OpKind, n: usize, len: u64) -> (Arc<SimReq>, Arc<[Op]>) {
    let local = Arc::new(MemoryRegion::from_vec(vec![0; 4096]));
    let ops: Arc<[Op]> = (0..n)
        .map(|i| Op {
            kind,
            local: local.clone(),
            local_offset: i as u64 * len,
            token: RW,
            remote_offset: i as u64 * len,
            len,
        })
        .collect();
    let req = Arc::new(SimReq {
        ops: ops.clone(),
        control: RequestControl::new(&ops),
        left: AtomicUsize::new(0),
    });
    (req, ops)
}

/// Op `i` of `req` as one whole piece (counted).
fn piece(req: &Arc<SimReq>, ops: &[Op], i: usize) -> Chunk<SimReq> {
    req.left.fetch_add(1, Ordering::SeqCst);
    Chunk {
        req: req.clone(),
        op: i,
        at: 0,
        len: ops[i].len,
    }
}

fn chunk(req: &Arc<SimReq>, at: u64, len: u64) -> Chunk<SimReq> {
    req.left.fetch_add(1, Ordering::SeqCst);
    Chunk {
        req: req.clone(),
        op: 0,
        at,
        len,
    }
}

fn response(seq: u32, also_acks: u16) -> [u8; DATA_RESPONSE_LEN] {
    let mut out = [0u8; DATA_RESPONSE_LEN];
    crate::wire::DataResponse {
        seq,
        refused: None,
        len: 0,
        also_acks,
    }
    .encode(&mut out);
    out
}

/// A response that acknowledges chunks that are not the oldest WRITEs in flight, one out of
/// order, one with nothing in flight and a READ of the wrong length are violations, and
/// `fail_all` then reports every chunk in flight lost, once.
#[test]
fn responses_that_break_the_protocol_are_violations() {
    let (req, _) = one_op(OpKind::Write, 64);
    let mut s = ClientStream::new(8, AckPolicy::Loopback);
    for k in 0..4 {
        assert!(matches!(s.post(chunk(&req, k * 16, 16)), Post::Send(_)));
    }
    // Seq 3 acknowledging 3 held-back ones would be fine; naming 4 is not (nothing after them).
    assert!(matches!(
        s.on_response(&response(3, 4)),
        Err(Violation::BadHeldAcks { .. })
    ));
    assert!(matches!(
        s.on_response(&response(2, 0)),
        Err(Violation::OutOfOrder {
            got: 2,
            expected: 0
        })
    ));
    // Seq 1 with one held: chunks 0 and 1 acknowledged.
    assert!(matches!(
        s.on_response(&response(1, 1)),
        Ok(Resolution::Done)
    ));
    assert_eq!(s.in_flight(), 2);
    s.fail_all(Some(104));
    assert_eq!(req.left.load(Ordering::SeqCst), 0);
    assert!(matches!(
        s.on_response(&response(2, 0)),
        Err(Violation::Unsolicited { seq: 2 })
    ));
    // A broken stream hands new chunks back.
    let back = s.post(chunk(&req, 0, 16));
    let Post::Broken(c) = back else {
        panic!("a broken stream posted")
    };
    c.skipped();
    let o = req.control.outcome(true);
    assert_eq!(o.failure.map(|f| f.kind), Some(FailureKind::PeerLost));
    assert_eq!(o.failure.and_then(|f| f.native_status), Some(104));
    assert_eq!(o.remote_effect, RemoteEffect::Uncertain);

    let (req, _) = one_op(OpKind::Read, 64);
    let mut s = ClientStream::new(8, AckPolicy::Immediate);
    assert!(matches!(s.post(chunk(&req, 0, 64)), Post::Send(_)));
    let mut wrong = [0u8; DATA_RESPONSE_LEN];
    crate::wire::DataResponse {
        seq: 0,
        refused: None,
        len: 63,
        also_acks: 0,
    }
    .encode(&mut wrong);
    assert!(matches!(
        s.on_response(&wrong),
        Err(Violation::WrongLength {
            got: 63,
            expected: 64
        })
    ));
    // A READ's held acknowledgement cannot be implied.
    assert!(matches!(s.post(chunk(&req, 0, 64)), Post::Send(_)));
    assert!(matches!(
        s.on_response(&response(1, 1)),
        Err(Violation::BadHeldAcks { .. })
    ));
    s.fail_all(None);
    assert_eq!(req.left.load(Ordering::SeqCst), 0);
}

/// A WRITE answered before its driver reported its payload sent (a peer that answers before
/// reading the payload) is not resolved, so its request cannot be `drained` while the payload
/// may still be read: its chunks resolve as the answer said once the payload is sent (one chunk,
/// held-back acknowledgements, a vectored WRITE), or as lost if the stream breaks first. READs
/// are answered as always.
#[test]
fn a_write_answered_before_its_payload_left_resolves_only_once_sent() {
    let (req, _) = one_op(OpKind::Write, 64);
    let mut s = ClientStream::new(8, AckPolicy::Loopback);
    let mut seqs = Vec::new();
    for k in 0..3 {
        let Post::Send(out) = s.post(chunk(&req, k * 16, 16)) else {
            panic!("not sent")
        };
        seqs.push(out.seq);
    }
    s.sent(seqs[0]);
    // Seq 1 with seq 0 held back: 0 was sent, 1 not yet.
    assert!(matches!(
        s.on_response(&response(1, 1)),
        Ok(Resolution::Done)
    ));
    assert_eq!(
        req.left.load(Ordering::SeqCst),
        3 - 1,
        "only the sent one resolved"
    );
    assert_eq!((s.in_flight(), s.answered_unsent()), (1, 1));
    s.sent(seqs[1]);
    assert_eq!(req.left.load(Ordering::SeqCst), 1);
    assert_eq!(s.answered_unsent(), 0);
    // The last one answered before it is sent, then the stream breaks: lost, not acknowledged.
    assert!(matches!(
        s.on_response(&response(2, 0)),
        Ok(Resolution::Done)
    ));
    assert_eq!(req.left.load(Ordering::SeqCst), 1);
    s.fail_all(None);
    assert_eq!(req.left.load(Ordering::SeqCst), 0);
    let o = req.control.outcome(true);
    assert_eq!(o.failure.map(|f| f.kind), Some(FailureKind::PeerLost));
    assert_eq!(o.remote_effect, RemoteEffect::Uncertain);

    // A vectored WRITE, refused at its second piece before its payload went: nothing resolves
    // until it is sent, then the first piece is acknowledged and the rest refused.
    let (req, ops) = many_ops(OpKind::Write, 3, 16);
    let mut s = ClientStream::new(8, AckPolicy::Loopback);
    let pieces: Vec<_> = (0..3).map(|i| piece(&req, &ops, i)).collect();
    let Post::Send(out) = s.post(Work::Pieces(pieces)) else {
        panic!("not sent")
    };
    let mut h = [0u8; DATA_RESPONSE_LEN];
    crate::wire::VectoredResponse {
        seq: out.seq,
        refused: Some(RemoteStatus::AccessDenied),
        done: 1,
        len: 0,
    }
    .encode(&mut h);
    assert!(matches!(s.on_response(&h), Ok(Resolution::Done)));
    assert_eq!(req.left.load(Ordering::SeqCst), 3);
    s.sent(out.seq);
    assert_eq!(req.left.load(Ordering::SeqCst), 0);
    let o = req.control.outcome(true);
    assert_eq!(
        o.failure.map(|f| f.kind),
        Some(FailureKind::Remote(RemoteStatus::AccessDenied))
    );

    // A READ needs no report.
    let (req, _) = one_op(OpKind::Read, 16);
    let mut s = ClientStream::new(8, AckPolicy::Immediate);
    assert!(matches!(s.post(chunk(&req, 0, 16)), Post::Send(_)));
    let mut h = [0u8; DATA_RESPONSE_LEN];
    crate::wire::DataResponse {
        seq: 0,
        refused: Some(RemoteStatus::OutOfBounds),
        len: 0,
        also_acks: 0,
    }
    .encode(&mut h);
    assert!(matches!(s.on_response(&h), Ok(Resolution::Done)));
    assert_eq!(req.left.load(Ordering::SeqCst), 0);
}

/// A stopped request's chunks and chunks outside their local region are resolved at post,
/// never sent.
#[test]
fn post_resolves_what_must_not_move() {
    let (req, _) = one_op(OpKind::Write, 64);
    let mut s = ClientStream::new(1, AckPolicy::Immediate);
    assert!(matches!(s.post(chunk(&req, 2000, 16)), Post::Resolved));
    assert_eq!(
        req.control.outcome(true).failure.map(|f| f.kind),
        Some(FailureKind::Local)
    );
    let (req, _) = one_op(OpKind::Write, 64);
    req.control.stop(FailureKind::Cancelled);
    assert!(matches!(s.post(chunk(&req, 0, 16)), Post::Resolved));
    assert_eq!(req.left.load(Ordering::SeqCst), 0);
    assert_eq!(s.in_flight(), 0);
}

/// The server holds a WRITE's response back only for a next WRITE into the same segment within
/// its bounds, carries the checked target to that request, and refuses and flushes in order.
#[test]
fn the_server_holds_only_for_a_checked_next_write() {
    let region = Arc::new(MemoryRegion::from_vec(vec![0; 4096]));
    let mut table = SimTable::default();
    table.memory.insert(
        RW,
        SegmentLease {
            region,
            base: 0,
            len: 4096,
            access: Access::REMOTE_READ | Access::REMOTE_WRITE,
            guard: None,
        },
    );
    let head = |kind, seq, token, offset, len, ack_slack| {
        let mut h = [0u8; DATA_REQUEST_LEN];
        crate::wire::DataRequest {
            kind,
            seq,
            token,
            offset,
            len,
            ack_slack,
        }
        .encode(&mut h);
        h
    };
    let table = Arc::new(table);
    let stats = Arc::new(crate::transport::ServeStats::default());
    let mut s = ServerStream::new(table.clone()).counting(Some(stats.clone()));
    let Action::WriteMemory {
        lease,
        seq,
        ack_slack,
        ..
    } = s.on_request(&head(OpKind::Write, 0, RW, 0, 64, 3))
    else {
        panic!("not a write")
    };
    assert!(s.may_hold(ack_slack));
    // Out of bounds next: not held. Another segment: not held. A READ: not held.
    assert!(!s.hold_for_next(&lease, RW, seq, &head(OpKind::Write, 1, RW, 4090, 64, 3)));
    assert!(!s.hold_for_next(&lease, RW, seq, &head(OpKind::Write, 1, RO, 0, 64, 3)));
    assert!(!s.hold_for_next(&lease, RW, seq, &head(OpKind::Read, 1, RW, 0, 64, 0)));
    assert!(s.hold_for_next(&lease, RW, seq, &head(OpKind::Write, 1, RW, 64, 64, 3)));
    assert_eq!(s.held(), 1);
    // The next request uses the carried target (the table is not asked).
    let asked = table.resolved.load(Ordering::Relaxed);
    let Action::WriteMemory { at, seq, .. } = s.on_request(&head(OpKind::Write, 1, RW, 64, 64, 3))
    else {
        panic!("the carried target was not used")
    };
    assert_eq!(at, 64);
    assert_eq!(table.resolved.load(Ordering::Relaxed), asked);
    let r = crate::wire::DataResponse::decode(&s.answer_write(seq)).unwrap();
    assert_eq!((r.seq, r.also_acks), (1, 1));
    assert_eq!(s.held(), 0);
    // A refused request flushes nothing when nothing is held, and names its seq.
    let a = s.on_request(&head(OpKind::Write, 2, UNKNOWN, 0, 64, 3));
    let Action::Refuse {
        status, discard, ..
    } = a
    else {
        panic!("not refused")
    };
    assert_eq!((status, discard), (RemoteStatus::UnknownSegment, 64));
    assert!(s.flush().is_none());
    // A header that does not decode is answered with its raw seq and closes the stream.
    let mut bad = head(OpKind::Read, 77, RW, 0, 64, 0);
    bad[0] = 9;
    let Action::Close { response, .. } = s.on_request(&bad) else {
        panic!("not closed")
    };
    let r = crate::wire::DataResponse::decode(&response).unwrap();
    assert_eq!((r.seq, r.refused), (77, Some(RemoteStatus::Malformed)));
    // The stats saw two accepted WRITEs of 64 bytes (the carried one too), one unknown
    // segment and one malformed header; nothing else.
    let counts = stats.snapshot();
    assert_eq!(
        counts.accepted,
        [
            (OpKind::Read, 0, 0),
            (OpKind::Write, 2, 128),
            (OpKind::Checksum, 0, 0)
        ]
    );
    assert_eq!(
        counts.refused,
        [
            (RemoteStatus::UnknownSegment, 1),
            (RemoteStatus::OutOfBounds, 0),
            (RemoteStatus::AccessDenied, 0),
            (RemoteStatus::StaleEpoch, 0),
            (RemoteStatus::Malformed, 1)
        ]
    );
}

/// The fuzzed case count: `FERRY_FUZZ_CASES` (set by `cargo xtask fuzz`), else `default`.
fn fuzz_cases(default: u32) -> u32 {
    std::env::var("FERRY_FUZZ_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// A table of segments of several sizes and rights (and a file), for headers from outside.
fn fuzz_table() -> (SimTable, Vec<(SegmentToken, u64, Access)>) {
    let mut table = SimTable::default();
    let mut known = Vec::new();
    for (i, (len, access)) in [
        (0u64, Access::REMOTE_READ | Access::REMOTE_WRITE),
        (1, Access::REMOTE_READ),
        (4096, Access::REMOTE_WRITE),
        (65_536, Access::REMOTE_READ | Access::REMOTE_WRITE),
    ]
    .into_iter()
    .enumerate()
    {
        let token = SegmentToken(i as u64 + 1);
        // The region is larger than the segment, at a base above 0, so a check against the
        // region instead of the segment would show.
        let region = Arc::new(MemoryRegion::from_vec(vec![0; len as usize + 512]));
        table.memory.insert(
            token,
            SegmentLease {
                region,
                base: 256,
                len,
                access,
                guard: None,
            },
        );
        known.push((token, len, access));
    }
    table.files.insert(
        FILE,
        Arc::new(MemFile {
            data: Mutex::new(vec![0; 1000]),
            access: Access::REMOTE_READ,
        }),
    );
    known.push((FILE, 1000, Access::REMOTE_READ));
    (table, known)
}

/// Request headers from outside: mostly well-formed ones naming the known tokens (so the checks
/// are reached) with arbitrary offsets and lengths, and some raw bytes.
fn request_head() -> impl Strategy<Value = [u8; DATA_REQUEST_LEN]> {
    let formed = (
        prop_oneof![Just(OpKind::Read), Just(OpKind::Write)],
        any::<u32>(),
        prop_oneof![0u64..7, any::<u64>()],
        prop_oneof![0u64..70_000, any::<u64>()],
        prop_oneof![0u64..70_000, any::<u64>()],
        any::<u16>(),
    )
        .prop_map(|(kind, seq, token, offset, len, ack_slack)| {
            let mut h = [0u8; DATA_REQUEST_LEN];
            crate::wire::DataRequest {
                kind,
                seq,
                token: SegmentToken(token),
                offset,
                len,
                ack_slack,
            }
            .encode(&mut h);
            h
        });
    prop_oneof![4 => formed, 1 => any::<[u8; DATA_REQUEST_LEN]>()]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(fuzz_cases(2000)))]

    /// Whatever header arrives, the server's decision never panics and never lets a byte
    /// outside the named segment, or against its rights, be touched: every memory target lies
    /// inside the segment (and so the region), every file target inside the file, a refused
    /// WRITE's payload is discarded whole, and a header that does not decode closes the stream.
    /// A hold decided on an arbitrary next header carries a target that obeys the same rules.
    #[test]
    fn fuzz_server_checks_every_request_from_outside(
        heads in prop::collection::vec(request_head(), 1..6),
    ) {
        let (table, known) = fuzz_table();
        let mut s = ServerStream::new(Arc::new(table));
        for (i, head) in heads.iter().enumerate() {
            let decoded = crate::wire::DataRequest::decode(head);
            let action = s.on_request(head);
            let inside = |token: SegmentToken, kind: OpKind, at: u64, len: usize, base: u64| {
                let (_, seg_len, access) = known.iter().find(|k| k.0 == token).copied().unwrap();
                access.contains(kind.needed_access())
                    && at >= base
                    && at - base + len as u64 <= seg_len
            };
            match action {
                Action::WriteMemory { lease, token, at, len, seq, ack_slack } => {
                    let r = decoded.unwrap();
                    prop_assert_eq!((r.kind, r.token, r.seq, r.ack_slack), (OpKind::Write, token, seq, ack_slack));
                    prop_assert!(inside(token, OpKind::Write, at, len, lease.base));
                    prop_assert!(lease.region.check(at, len as u64).is_ok());
                    // The next header decides a hold; whatever it is, a carried target obeys
                    // the rules when it is used.
                    if let Some(next) = heads.get(i + 1)
                        && s.may_hold(ack_slack)
                        && s.hold_for_next(&lease, token, seq, next)
                    {
                        let n = crate::wire::DataRequest::decode(next).unwrap();
                        prop_assert_eq!((n.kind, n.token), (OpKind::Write, token));
                    } else {
                        let _ = s.answer_write(seq);
                    }
                }
                Action::ReadMemory { lease, at, len, response } => {
                    let r = decoded.unwrap();
                    prop_assert!(inside(r.token, OpKind::Read, at, len, lease.base));
                    prop_assert!(lease.region.check(at, len as u64).is_ok());
                    let resp = crate::wire::DataResponse::decode(&response).unwrap();
                    prop_assert_eq!((resp.seq, resp.len, resp.refused), (r.seq, r.len, None));
                }
                Action::ChecksumMemory { .. } => {
                    let r = decoded.unwrap();
                    prop_assert_eq!(r.kind, OpKind::Checksum);
                    let (_, seg_len, access) = known.iter().find(|k| k.0 == r.token).copied().unwrap();
                    prop_assert!(access.contains(OpKind::Checksum.needed_access()));
                    prop_assert!(r.offset.checked_add(r.len).is_some_and(|end| end <= seg_len));
                }
                Action::ChecksumFile { at, len, seq, .. } => {
                    let r = decoded.unwrap();
                    prop_assert_eq!((r.kind, r.token, r.seq), (OpKind::Checksum, FILE, seq));
                    prop_assert!(at.checked_add(len).is_some_and(|end| end <= 1000));
                }
                Action::ReadFile { at, len, .. } | Action::WriteFile { at, len, .. } => {
                    let r = decoded.unwrap();
                    prop_assert_eq!(r.token, FILE);
                    prop_assert!(inside(FILE, r.kind, at, len, 0));
                }
                Action::Refuse { kind, discard, response, .. } => {
                    let r = decoded.unwrap();
                    prop_assert_eq!(discard, if kind == OpKind::Write { r.len } else { 0 });
                    let resp = crate::wire::DataResponse::decode(&response).unwrap();
                    prop_assert_eq!(resp.seq, r.seq);
                    prop_assert!(resp.refused.is_some());
                }
                Action::Close { response, .. } => {
                    prop_assert!(crate::wire::RequestHead::decode(head).is_err());
                    let resp = crate::wire::DataResponse::decode(&response).unwrap();
                    prop_assert_eq!(resp.refused, Some(RemoteStatus::Malformed));
                    break;
                }
                Action::Table { req } => {
                    // Raw bytes that happen to be a vectored header: its table would follow.
                    prop_assert!(matches!(
                        crate::wire::RequestHead::decode(head),
                        Ok(crate::wire::RequestHead::Vectored(r)) if r == req
                    ));
                    break;
                }
                Action::Vectored { .. } => prop_assert!(false, "a vectored action without a table"),
            }
        }
    }

    /// Whatever vectored request arrives (counts and totals that lie, tables cut short or
    /// garbled, pieces naming any segment with any range), the server never panics, allocates
    /// no more than the bytes it was given allow, and lets no byte outside a named segment or
    /// against its rights be touched: it accepts a prefix of the pieces, every target inside its
    /// segment, says how many and why the next was refused, and discards exactly the refused
    /// pieces' payload of a WRITE; a table that does not decode closes the stream.
    #[test]
    fn fuzz_server_checks_vectored_requests_from_outside(
        write in any::<bool>(),
        seq in any::<u32>(),
        pieces in prop::collection::vec(
            (prop_oneof![0u64..7, Just(FILE.0), any::<u64>()], prop_oneof![0u64..70_000, any::<u64>()], prop_oneof![0u64..5000, any::<u64>()]),
            0..12,
        ),
        count_lie in prop::option::weighted(0.2, any::<u32>()),
        total_lie in prop::option::weighted(0.2, any::<u64>()),
        garble in prop::option::weighted(0.2, (any::<usize>(), any::<u8>())),
        cut in prop::option::weighted(0.2, any::<usize>()),
    ) {
        let (table, known) = fuzz_table();
        let kind = if write { OpKind::Write } else { OpKind::Read };
        let mut bytes = Vec::new();
        let mut total = 0u64;
        for &(token, offset, len) in &pieces {
            crate::wire::Piece { token: SegmentToken(token), offset, len }.encode(&mut bytes);
            total = total.wrapping_add(len);
        }
        let req = crate::wire::VectoredRequest {
            kind,
            seq,
            pieces: count_lie.unwrap_or(pieces.len() as u32),
            total: total_lie.unwrap_or(total),
        };
        let mut head = [0u8; DATA_REQUEST_LEN];
        req.encode(&mut head);
        if let Some((at, b)) = garble && !bytes.is_empty() {
            let n = bytes.len();
            bytes[at % n] ^= b | 1;
        }
        if let Some(c) = cut {
            bytes.truncate(c % (bytes.len() + 1));
        }
        let mut s = ServerStream::new(Arc::new(table));
        let req = match s.on_request(&head) {
            Action::Table { req } => req,
            Action::Close { .. } => {
                prop_assert!(req.pieces == 0 || req.pieces > crate::wire::MAX_PIECES || req.total > crate::wire::MAX_CHUNK);
                return Ok(());
            }
            other => {
                prop_assert!(false, "not a table: {:?}", other);
                unreachable!()
            }
        };
        let decoded = crate::wire::decode_pieces(&req, &bytes);
        match s.on_table(&req, &bytes) {
            Action::Vectored { kind: k, targets, discard, response } => {
                let pieces = decoded.unwrap();
                prop_assert_eq!(k, kind);
                prop_assert!(targets.len() <= pieces.len());
                let mut moved = 0u64;
                for (t, p) in targets.iter().zip(&pieces) {
                    let (_, seg_len, access) = known.iter().find(|k| k.0 == p.token).copied().unwrap();
                    prop_assert!(access.contains(kind.needed_access()));
                    prop_assert_eq!(t.len() as u64, p.len);
                    match t {
                        Target::Memory { lease, at, len } => {
                            prop_assert!(*at >= lease.base && at - lease.base + *len as u64 <= seg_len);
                            prop_assert!(lease.region.check(*at, *len as u64).is_ok());
                        }
                        Target::File { at, len, .. } => {
                            prop_assert_eq!(p.token, FILE);
                            prop_assert!(at + *len as u64 <= seg_len);
                        }
                    }
                    moved += p.len;
                }
                prop_assert_eq!(discard, if write { req.total - moved } else { 0 });
                let Ok(crate::wire::ResponseHead::Vectored(r)) = crate::wire::ResponseHead::decode(&response) else {
                    prop_assert!(false, "not a vectored response");
                    unreachable!()
                };
                prop_assert_eq!((r.seq, r.done as usize), (seq, targets.len()));
                prop_assert_eq!(r.refused.is_none(), targets.len() == pieces.len());
                prop_assert_eq!(u64::from(r.len), if write { 0 } else { moved });
            }
            Action::Close { response, .. } => {
                prop_assert!(decoded.is_err());
                let resp = crate::wire::DataResponse::decode(&response).unwrap();
                prop_assert_eq!((resp.seq, resp.refused), (seq, Some(RemoteStatus::Malformed)));
            }
            other => prop_assert!(false, "not an answer to a table: {:?}", other),
        }
    }

    /// Whatever responses arrive for vectored requests (and single ones), the client never
    /// panics, never resolves a piece twice or leaves one unresolved, and an accepted
    /// response's pieces are exactly the prefix it names.
    #[test]
    fn fuzz_client_matches_vectored_responses_from_outside(
        posts in prop::collection::vec((any::<bool>(), 1usize..5), 1..6),
        responses in prop::collection::vec(
            prop_oneof![
                3 => (any::<u32>(), 0u32..6, 0u32..300, prop::option::of(Just(RemoteStatus::AccessDenied))).prop_map(|(seq, done, len, refused)| {
                    let mut h = [0u8; DATA_RESPONSE_LEN];
                    crate::wire::VectoredResponse { seq: seq % 8, refused, done, len }.encode(&mut h);
                    h
                }),
                1 => (any::<u32>(), 0u64..64).prop_map(|(seq, len)| {
                    let mut h = [0u8; DATA_RESPONSE_LEN];
                    crate::wire::DataResponse { seq: seq % 8, refused: None, len, also_acks: 0 }.encode(&mut h);
                    h
                }),
                1 => any::<[u8; DATA_RESPONSE_LEN]>(),
            ],
            0..10,
        ),
    ) {
        let mut s = ClientStream::new(8, AckPolicy::Loopback);
        let mut reqs = Vec::new();
        for (write, n) in posts {
            let kind = if write { OpKind::Write } else { OpKind::Read };
            let (req, ops) = many_ops(kind, n, 16);
            let pieces: Vec<_> = (0..n).map(|i| piece(&req, &ops, i)).collect();
            prop_assert!(matches!(s.post(Work::Pieces(pieces)), Post::Send(_)));
            reqs.push(req);
        }
        for r in responses {
            match s.on_response(&r) {
                Ok(Resolution::Done) => {}
                Ok(Resolution::Payload(c)) => c.acked(),
                Ok(Resolution::Pieces(v)) => v.into_iter().for_each(Chunk::acked),
                Err(_) => break,
            }
        }
        s.fail_all(None);
        for req in &reqs {
            prop_assert_eq!(req.left.load(Ordering::SeqCst), 0);
        }
    }

    /// Whatever responses arrive, the client never panics and never resolves a chunk twice or
    /// leaves one unresolved: a violation, then `fail_all`, resolves everything in flight once.
    #[test]
    fn fuzz_client_matches_responses_from_outside(
        posts in prop::collection::vec((prop_oneof![Just(OpKind::Read), Just(OpKind::Write)], 0u64..64), 1..8),
        responses in prop::collection::vec(
            prop_oneof![
                3 => (any::<u32>(), 0u16..4, 0u64..64, any::<bool>()).prop_map(|(seq, also_acks, len, refuse)| {
                    let mut h = [0u8; DATA_RESPONSE_LEN];
                    crate::wire::DataResponse {
                        seq: seq % 8,
                        refused: refuse.then_some(RemoteStatus::OutOfBounds),
                        len,
                        also_acks,
                    }
                    .encode(&mut h);
                    h
                }),
                1 => any::<[u8; DATA_RESPONSE_LEN]>(),
            ],
            0..10,
        ),
    ) {
        let mut s = ClientStream::new(8, AckPolicy::Loopback);
        let mut reqs = Vec::new();
        for (kind, len) in posts {
            let (req, _) = one_op(kind, len);
            let c = chunk(&req, 0, len);
            prop_assert!(matches!(s.post(c), Post::Send(_)));
            reqs.push(req);
        }
        for r in responses {
            match s.on_response(&r) {
                Ok(Resolution::Done) => {}
                Ok(Resolution::Payload(c)) => c.acked(),
                Ok(Resolution::Pieces(v)) => v.into_iter().for_each(Chunk::acked),
                Err(_) => break,
            }
        }
        s.fail_all(None);
        for req in &reqs {
            prop_assert_eq!(req.left.load(Ordering::SeqCst), 0);
        }
    }

    /// The client's reading of a server's answer never panics, whatever frame arrives.
    #[test]
    fn fuzz_handshake_replies_from_outside(bytes in prop::collection::vec(any::<u8>(), 0..256)) {
        let mut framed = crate::wire::MAGIC.to_vec();
        framed.extend_from_slice(&bytes);
        for buf in [&bytes[..], &framed[..]] {
            if let Ok(Some((frame, _))) = crate::wire::ControlFrame::decode(buf) {
                let peer: std::net::SocketAddr = "127.0.0.1:1".parse().unwrap();
                let ours = crate::wire::Hello {
                    versions: crate::wire::SUPPORTED_VERSIONS,
                    peer_id: crate::ids::PeerId(1),
                    epoch: crate::ids::Epoch(1),
                    transports: vec![],
                    segments: vec![],
                };
                let _ = crate::handshake::hello_reply(peer, &ours, frame.clone());
                let attach = crate::wire::StreamAttach {
                    peer_id: crate::ids::PeerId(1),
                    epoch: crate::ids::Epoch(1),
                    server_epoch: crate::ids::Epoch(2),
                    transport: 0,
                    stream_index: 0,
                };
                let _ = crate::handshake::attach_reply(peer, &attach, frame);
            }
        }
    }
}

/// The held-response bookkeeping on its own: a response may join the held ones only while fewer
/// than the request's `ack_slack` are held; `flush` releases them as one response naming the
/// last held WRITE and accepting the others with it, and leaves nothing held; only an accepted
/// WRITE to memory joins them.
#[test]
fn held_responses_are_counted_flushed_and_joined_only_by_writes_to_memory() {
    let region = Arc::new(MemoryRegion::from_vec(vec![0; 4096]));
    let lease = SegmentLease {
        region,
        base: 0,
        len: 4096,
        access: Access::REMOTE_READ | Access::REMOTE_WRITE,
        guard: None,
    };
    let mut table = SimTable::default();
    table.memory.insert(RW, lease.clone());
    let write = |seq: u32, offset: u64| {
        let mut h = [0u8; DATA_REQUEST_LEN];
        crate::wire::DataRequest {
            kind: OpKind::Write,
            seq,
            token: RW,
            offset,
            len: 64,
            ack_slack: 4,
        }
        .encode(&mut h);
        h
    };
    let table = Arc::new(table);
    let mut s = ServerStream::new(table.clone());
    assert!(
        !s.may_hold(0),
        "a request that allows nothing is answered at once"
    );
    assert!(s.may_hold(1));
    assert!(s.flush().is_none(), "nothing held, nothing to flush");
    assert!(s.hold_for_next(&lease, RW, 7, &write(8, 64)));
    assert!(!s.may_hold(1), "one held: a slack of one allows no more");
    assert!(s.may_hold(2));
    let _ = s.on_request(&write(8, 64));
    assert!(s.hold_for_next(&lease, RW, 8, &write(9, 128)));
    assert_eq!(s.held(), 2);
    let r = crate::wire::DataResponse::decode(&s.flush().unwrap()).unwrap();
    assert_eq!((r.seq, r.also_acks, r.refused), (8, 1, None));
    assert_eq!(s.held(), 0);
    assert!(s.flush().is_none());

    let joins = |head: &[u8; DATA_REQUEST_LEN]| {
        ServerStream::new(table.clone())
            .on_request(head)
            .joins_held()
    };
    assert!(joins(&write(1, 0)));
    let mut read = write(1, 0);
    read[0] = 1; // READ
    assert!(!joins(&read));
    let mut unknown = write(1, 0);
    unknown[8..16].copy_from_slice(&99u64.to_le_bytes());
    assert!(!joins(&unknown), "a refused WRITE does not join");
}

/// The client's window and its broken state, an op's remote offset in every chunk's header,
/// and held acknowledgements that would name every chunk in flight (none would be left for
/// the response itself).
#[test]
fn the_client_bounds_its_window_and_encodes_each_chunks_remote_offset() {
    let (req, ops) = one_op(OpKind::Write, 64);
    assert_eq!(ops.len(), 1);
    let mut s = ClientStream::new(2, AckPolicy::Loopback);
    assert!(s.has_room() && !s.is_broken());
    let mut heads = Vec::new();
    for k in 0..2 {
        let Post::Send(out) = s.post(chunk(&req, k * 16, 16)) else {
            panic!("not sent")
        };
        heads.push(crate::wire::DataRequest::decode(&out.head).unwrap());
    }
    assert!(!s.has_room(), "two in flight fill a window of two");
    assert_eq!(
        heads[1].offset, 16,
        "the op's remote offset plus the chunk's"
    );
    // Both chunks named as held, with no chunk left for the response's own seq.
    assert!(matches!(
        s.on_response(&response(2, 2)),
        Err(Violation::BadHeldAcks { .. })
    ));
    s.fail_all(None);
    assert!(s.is_broken() && s.has_room());

    // An op that starts at remote offset 100: its chunk at 16 names 116.
    let region = Arc::new(MemoryRegion::from_vec(vec![0; 1024]));
    let ops: Arc<[Op]> = vec![Op {
        kind: OpKind::Read,
        local: region,
        local_offset: 0,
        token: RW,
        remote_offset: 100,
        len: 64,
    }]
    .into();
    let req = Arc::new(SimReq {
        ops: ops.clone(),
        control: RequestControl::new(&ops),
        left: AtomicUsize::new(0),
    });
    let mut s = ClientStream::new(4, AckPolicy::Immediate);
    let Post::Send(out) = s.post(chunk(&req, 16, 16)) else {
        panic!("not sent")
    };
    assert_eq!(
        crate::wire::DataRequest::decode(&out.head).unwrap().offset,
        116
    );
    s.fail_all(None);
}
