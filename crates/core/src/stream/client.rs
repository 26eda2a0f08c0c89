//! The client half of a data stream: sequence numbers, the chunks in flight, how many WRITE
//! responses the server may hold back, and the matching and validation of responses.

use std::collections::VecDeque;
use std::sync::Arc;

use crate::memory::MemoryRegion;
use crate::op::{Op, OpKind};
use crate::outcome::{FailureKind, RemoteStatus, RequestControl};
use crate::wire::{
    DATA_REQUEST_LEN, DATA_RESPONSE_LEN, DataRequest, MAX_CHUNK, MAX_PIECES, Piece, ResponseHead,
    VectoredRequest, VectoredResponse, WireError,
};

/// What a driver's request gives the protocol: its ops, its control (stop flag and ledger), and
/// how one resolved chunk is counted (the driver's completion: a counter, a notification).
pub trait ChunkOwner: Send + Sync + 'static {
    /// The request's ops.
    fn ops(&self) -> &[Op];

    /// The request's stop flag and ledger.
    fn control(&self) -> &RequestControl;

    /// One chunk of the request is resolved (acknowledged, refused, lost or never posted).
    /// Called exactly once per chunk.
    fn chunk_done(&self);
}

/// One chunk of one op of a request: `len` bytes at `at` within the op.
#[derive(Debug)]
pub struct Chunk<R> {
    /// The request.
    pub req: Arc<R>,
    /// Index of the op in the request.
    pub op: usize,
    /// Offset of the chunk within the op.
    pub at: u64,
    /// Length of the chunk.
    pub len: u64,
}

impl<R: ChunkOwner> Chunk<R> {
    /// The op the chunk belongs to.
    pub fn op(&self) -> &Op {
        &self.req.ops()[self.op]
    }

    /// Offset of the chunk in the op's local region.
    pub fn local_at(&self) -> u64 {
        self.op().local_offset + self.at
    }

    /// Bytes that land in local memory at [`local_at`](Self::local_at) when the chunk's
    /// response accepts it: a READ's length, a CHECKSUM's digest
    /// ([`CHECKSUM_LEN`](crate::checksum::CHECKSUM_LEN)), a WRITE's length (sent, not received).
    pub fn payload_len(&self) -> u64 {
        self.op().kind.local_len(self.len)
    }

    /// The chunk completed: acknowledged by the peer.
    pub fn acked(self) {
        self.req.control().with_ledger(|l| l.acked(self.op));
        self.req.chunk_done();
    }

    /// The peer refused the chunk; it moved no byte.
    pub fn refused(self, status: RemoteStatus) {
        self.req
            .control()
            .with_ledger(|l| l.refused(self.op, status));
        self.req.chunk_done();
    }

    /// The chunk was posted and will never be acknowledged (`PeerLost`; its effect is unknown).
    pub fn lost(self, native: Option<i32>) {
        self.req
            .control()
            .with_ledger(|l| l.lost(self.op, FailureKind::PeerLost, native));
        self.req.chunk_done();
    }

    /// The chunk was never posted, for `kind` (it has no effect).
    pub fn not_posted(self, kind: FailureKind) {
        self.req
            .control()
            .with_ledger(|l| l.not_posted(self.op, kind, None));
        self.req.chunk_done();
    }

    /// The chunk is dropped unposted because its request stopped posting; the reason is already
    /// in the ledger.
    pub fn skipped(self) {
        self.req.chunk_done();
    }
}

/// What a stream posts: one chunk, or the pieces of one vectored request (protocol version 3;
/// see [`VectoredRequest`]): whole small ops of one request, all READs or all WRITEs, in op
/// order, their lengths adding up to at most [`MAX_CHUNK`] and at most [`MAX_PIECES`] of them
/// ([`deal_ops`](crate::dealer::deal_ops) groups them so).
#[derive(Debug)]
pub enum Work<R> {
    /// One chunk, one request header.
    One(Chunk<R>),
    /// Pieces that go out as one vectored request.
    Pieces(Vec<Chunk<R>>),
}

impl<R: ChunkOwner> Work<R> {
    /// The request the work belongs to (`None` only for an empty set of pieces).
    pub fn req(&self) -> Option<&Arc<R>> {
        match self {
            Work::One(c) => Some(&c.req),
            Work::Pieces(v) => v.first().map(|c| &c.req),
        }
    }

    /// Chunks in the work (each resolved once).
    pub fn chunks(&self) -> usize {
        match self {
            Work::One(_) => 1,
            Work::Pieces(v) => v.len(),
        }
    }

    fn into_vec(self) -> Vec<Chunk<R>> {
        match self {
            Work::One(c) => vec![c],
            Work::Pieces(v) => v,
        }
    }

    /// Every chunk was never posted, for `kind` ([`Chunk::not_posted`]).
    pub fn not_posted(self, kind: FailureKind) {
        for c in self.into_vec() {
            c.not_posted(kind);
        }
    }

    /// Every chunk is dropped unposted ([`Chunk::skipped`]).
    pub fn skipped(self) {
        for c in self.into_vec() {
            c.skipped();
        }
    }

    /// Every chunk was posted and is lost ([`Chunk::lost`]).
    pub fn lost(self, native: Option<i32>) {
        for c in self.into_vec() {
            c.lost(native);
        }
    }
}

impl<R> From<Chunk<R>> for Work<R> {
    fn from(c: Chunk<R>) -> Self {
        Work::One(c)
    }
}

/// How many of a stream's WRITE responses a client lets the server hold back
/// ([`DataRequest::ack_slack`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AckPolicy {
    /// Every response at once (`ack_slack` 0).
    Immediate,
    /// Over a network: at most half of the chunks in flight, less one, so the other half keeps
    /// moving and covers the flight time.
    Network,
    /// On loopback (no flight time): all chunks in flight but one.
    Loopback,
}

impl AckPolicy {
    /// The `ack_slack` of a WRITE posted with `in_flight` chunks in flight, itself included. The
    /// server holds a response back only while the next request has already arrived, so a lone
    /// request is answered at once and a stream that stops sending gets every answer.
    pub fn slack(self, in_flight: usize) -> u16 {
        let slack = match self {
            AckPolicy::Immediate => 0,
            AckPolicy::Network => in_flight.saturating_sub(1) / 2,
            AckPolicy::Loopback => in_flight.saturating_sub(1),
        };
        u16::try_from(slack).unwrap_or(u16::MAX)
    }
}

/// A chunk the stream admitted: the header to send, and where its payload lies (a WRITE's bytes
/// to send after the header, a READ's room for the bytes its response brings).
#[derive(Debug)]
pub struct Outgoing<R> {
    /// The encoded request header.
    pub head: [u8; DATA_REQUEST_LEN],
    /// Its sequence number: a WRITE's driver reports with it when the payload has left local
    /// memory ([`ClientStream::sent`]).
    pub seq: u32,
    /// READ, WRITE or CHECKSUM (only a WRITE sends bytes after the header).
    pub kind: OpKind,
    /// The request (to keep it alive, e.g. until a zero-copy notification).
    pub req: Arc<R>,
    /// The local region; `local_at..local_at + len` was checked to lie inside it.
    pub region: Arc<MemoryRegion>,
    /// Offset of the chunk in `region`.
    pub local_at: u64,
    /// Payload length (a vectored request's: the sum of its pieces').
    pub len: usize,
    /// A vectored request's piece table, sent right after the header (empty for one chunk).
    pub table: Vec<u8>,
    /// A vectored request's local ranges, in piece order: a WRITE sends their bytes after the
    /// table, a READ's response brings theirs (empty for one chunk: `region` at `local_at`).
    /// Each was checked to lie inside its region.
    pub scatter: Vec<LocalRange>,
}

/// One local range of a vectored request.
#[derive(Debug, Clone)]
pub struct LocalRange {
    /// The region.
    pub region: Arc<MemoryRegion>,
    /// Offset in `region`.
    pub at: u64,
    /// Length.
    pub len: usize,
}

/// What [`ClientStream::post`] made of a chunk.
#[derive(Debug)]
pub enum Post<R> {
    /// Send this: the chunk is in flight.
    Send(Outgoing<R>),
    /// The chunk was resolved without being posted (its request stopped posting, or its local
    /// range is invalid); nothing to send.
    Resolved,
    /// The stream is broken: the work was not posted, hand it to another stream.
    Broken(Work<R>),
}

/// What a valid response asks of the driver.
#[derive(Debug)]
pub enum Resolution<R> {
    /// The chunk (and any held-back WRITEs) is resolved; nothing follows the header.
    Done,
    /// An accepted READ or CHECKSUM: exactly `chunk.payload_len()` payload bytes follow the
    /// header. Receive them into `chunk.op().local` at `chunk.local_at()` (checked at post), then call
    /// [`Chunk::acked`], or [`Chunk::lost`] and [`ClientStream::fail_all`] if the stream fails.
    Payload(Chunk<R>),
    /// An accepted vectored READ (all its pieces, or the prefix the server performed): the
    /// pieces' payloads follow the header back to back, in this order, each exactly
    /// `payload_len()` bytes. Receive each into its local range (checked at post), then call
    /// [`Chunk::acked`] on each, or [`Chunk::lost`] on those not received and
    /// [`ClientStream::fail_all`] if the stream fails.
    Pieces(Vec<Chunk<R>>),
}

/// A response that breaks the protocol; the stream must be closed and what is in flight failed
/// ([`ClientStream::fail_all`]).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Violation {
    /// The header does not decode.
    #[error("bad response header: {0}")]
    Malformed(#[from] WireError),
    /// A response came with nothing in flight.
    #[error("response (seq {seq}) with nothing in flight")]
    Unsolicited {
        /// The response's sequence number.
        seq: u32,
    },
    /// Held-back acknowledgements that do not name the oldest WRITEs in flight.
    #[error(
        "response (seq {seq}) also acknowledges {also_acks} chunks, which are not the oldest WRITEs in flight ({in_flight} in flight)"
    )]
    BadHeldAcks {
        /// The response's sequence number.
        seq: u32,
        /// What it claims.
        also_acks: u16,
        /// Chunks in flight.
        in_flight: usize,
    },
    /// The response is not for the oldest chunk in flight.
    #[error("response out of order: seq {got}, expected {expected}")]
    OutOfOrder {
        /// The response's sequence number.
        got: u32,
        /// The oldest in flight.
        expected: u32,
    },
    /// A response of one kind (one chunk, vectored) for a request of the other.
    #[error("response (seq {seq}) of the wrong kind for its request (vectored or not)")]
    WrongKind {
        /// The response's sequence number.
        seq: u32,
    },
    /// A vectored response that claims more pieces than the request had, or whose status does
    /// not match its count (a refusal with every piece done, or no refusal with fewer).
    #[error(
        "vectored response (seq {seq}) says {done} pieces done of {pieces}, refused: {refused}"
    )]
    BadPieces {
        /// The response's sequence number.
        seq: u32,
        /// Pieces it says were done.
        done: u32,
        /// Pieces in the request.
        pieces: usize,
        /// Whether it carries a refusal.
        refused: bool,
    },
    /// An accepted READ or CHECKSUM announces a payload of another length than asked.
    #[error("READ or CHECKSUM response of {got} bytes for a payload of {expected}")]
    WrongLength {
        /// Announced.
        got: u64,
        /// Asked.
        expected: u64,
    },
}

#[derive(Debug)]
struct InFlight<R> {
    chunk: Chunk<R>,
    /// A vectored request's further pieces (`chunk` is its first).
    more: Vec<Chunk<R>>,
    vectored: bool,
    seq: u32,
    kind: OpKind,
    /// A WRITE whose payload the driver has not reported sent yet ([`ClientStream::sent`]).
    unsent: bool,
}

/// A WRITE answered before its driver reported its payload sent: its chunks and what the
/// answer said of each (`None`: acknowledged), resolved once the payload has left local memory.
#[derive(Debug)]
struct Answered<R> {
    seq: u32,
    chunks: Vec<(Chunk<R>, Option<RemoteStatus>)>,
}

impl<R: ChunkOwner> Answered<R> {
    fn resolve(self) {
        for (c, status) in self.chunks {
            match status {
                None => c.acked(),
                Some(s) => c.refused(s),
            }
        }
    }
}

/// The client state of one data stream. Responses come back in request order, so the chunks in
/// flight are a FIFO matched by sequence number. No I/O: the driver sends what [`post`] returns,
/// reports each WRITE's payload gone from local memory ([`sent`]) and feeds each response
/// header to [`on_response`].
///
/// A WRITE's chunks resolve (and so may let its request be `drained`) only once both its
/// answer came and its payload has left local memory: a peer that answers a WRITE before reading
/// its payload (which a well-behaved server never does) cannot make the request look drained
/// while the driver still reads its buffer; the answer waits for [`sent`].
///
/// [`post`]: ClientStream::post
/// [`sent`]: ClientStream::sent
/// [`on_response`]: ClientStream::on_response
#[derive(Debug)]
pub struct ClientStream<R> {
    next_seq: u32,
    fly: VecDeque<InFlight<R>>,
    /// WRITEs answered before their payload was reported sent, oldest first.
    answered: VecDeque<Answered<R>>,
    depth: usize,
    policy: AckPolicy,
    broken: bool,
}

impl<R: ChunkOwner> ClientStream<R> {
    /// A stream that keeps at most `depth` (at least 1) chunks in flight.
    pub fn new(depth: usize, policy: AckPolicy) -> Self {
        let depth = depth.max(1);
        Self {
            next_seq: 0,
            fly: VecDeque::with_capacity(depth),
            answered: VecDeque::new(),
            depth,
            policy,
            broken: false,
        }
    }

    /// Chunks in flight.
    pub fn in_flight(&self) -> usize {
        self.fly.len()
    }

    /// Whether another chunk may be posted now (fewer than `depth` in flight).
    pub fn has_room(&self) -> bool {
        self.fly.len() < self.depth
    }

    /// Whether the stream was broken ([`fail_all`](Self::fail_all)).
    pub fn is_broken(&self) -> bool {
        self.broken
    }

    /// Admits `chunk` for posting: checks its request still posts and its local range, assigns
    /// the next sequence number, records it in flight (before a byte is sent, so that a response
    /// always finds it) and encodes its header. The caller bounds what is in flight with
    /// [`has_room`](Self::has_room).
    pub fn post(&mut self, work: impl Into<Work<R>>) -> Post<R> {
        match work.into() {
            Work::One(chunk) => self.post_one(chunk),
            Work::Pieces(mut pieces) if pieces.len() <= 1 => match pieces.pop() {
                Some(chunk) => self.post_one(chunk),
                None => Post::Resolved,
            },
            Work::Pieces(pieces) => self.post_pieces(pieces),
        }
    }

    fn post_one(&mut self, chunk: Chunk<R>) -> Post<R> {
        if self.broken {
            return Post::Broken(Work::One(chunk));
        }
        let control = chunk.req.control();
        if control.should_stop_posting() {
            chunk.skipped();
            return Post::Resolved;
        }
        let op = chunk.op();
        let local_at = chunk.local_at();
        let payload = chunk.payload_len();
        let Ok(len) = usize::try_from(payload) else {
            chunk.not_posted(FailureKind::Local);
            return Post::Resolved;
        };
        if op.local.check(local_at, payload).is_err() {
            chunk.not_posted(FailureKind::Local);
            return Post::Resolved;
        }
        let kind = op.kind;
        let seq = self.next_seq;
        self.next_seq = seq.wrapping_add(1);
        let mut head = [0u8; DATA_REQUEST_LEN];
        DataRequest {
            kind,
            seq,
            token: op.token,
            offset: op.remote_offset + chunk.at,
            len: chunk.len,
            ack_slack: match kind {
                OpKind::Write => self.policy.slack(self.fly.len() + 1),
                OpKind::Read | OpKind::Checksum => 0,
            },
        }
        .encode(&mut head);
        let out = Outgoing {
            head,
            seq,
            kind,
            req: chunk.req.clone(),
            region: op.local.clone(),
            local_at,
            len,
            table: Vec::new(),
            scatter: Vec::new(),
        };
        control.with_ledger(|l| l.posted(chunk.op));
        self.fly.push_back(InFlight {
            chunk,
            more: Vec::new(),
            vectored: false,
            seq,
            kind,
            unsent: kind == OpKind::Write,
        });
        Post::Send(out)
    }

    /// [`post`](Self::post) for the pieces of a vectored request: checks each piece's local
    /// range in order (the first that fails is `Local`, never posted, and the pieces after it
    /// are dropped unposted: the request has failed there), then sends the rest as one request.
    fn post_pieces(&mut self, mut pieces: Vec<Chunk<R>>) -> Post<R> {
        if self.broken {
            return Post::Broken(Work::Pieces(pieces));
        }
        let Some(first) = pieces.first() else {
            return Post::Resolved;
        };
        let req = first.req.clone();
        let kind = first.op().kind;
        if req.control().should_stop_posting() {
            Work::Pieces(pieces).skipped();
            return Post::Resolved;
        }
        let mut total = 0u64;
        let mut scatter = Vec::with_capacity(pieces.len());
        let mut bad = None;
        for (k, c) in pieces.iter().enumerate() {
            let op = c.op();
            let local_at = c.local_at();
            let fits = op.kind == kind
                && kind != OpKind::Checksum
                && k < MAX_PIECES as usize
                && total + c.len <= MAX_CHUNK
                && op.local.check(local_at, c.len).is_ok();
            if !fits {
                bad = Some(k);
                break;
            }
            total += c.len;
            scatter.push(LocalRange {
                region: op.local.clone(),
                at: local_at,
                len: c.len as usize,
            });
        }
        if let Some(k) = bad {
            let mut rest = pieces.split_off(k).into_iter();
            if let Some(c) = rest.next() {
                c.not_posted(FailureKind::Local);
            }
            rest.for_each(Chunk::skipped);
            if pieces.is_empty() {
                return Post::Resolved;
            }
        }
        let seq = self.next_seq;
        self.next_seq = seq.wrapping_add(1);
        let mut head = [0u8; DATA_REQUEST_LEN];
        VectoredRequest {
            kind,
            seq,
            pieces: pieces.len() as u32,
            total,
        }
        .encode(&mut head);
        let mut table = Vec::with_capacity(pieces.len() * crate::wire::PIECE_LEN);
        for c in &pieces {
            let op = c.op();
            Piece {
                token: op.token,
                offset: op.remote_offset + c.at,
                len: c.len,
            }
            .encode(&mut table);
        }
        req.control().with_ledger(|l| {
            for c in &pieces {
                l.posted(c.op);
            }
        });
        let mut it = pieces.into_iter();
        let Some(chunk) = it.next() else {
            return Post::Resolved;
        };
        let out = Outgoing {
            head,
            seq,
            kind,
            req,
            region: chunk.op().local.clone(),
            local_at: chunk.local_at(),
            len: total as usize,
            table,
            scatter,
        };
        self.fly.push_back(InFlight {
            chunk,
            more: it.collect(),
            vectored: true,
            seq,
            kind,
            unsent: kind == OpKind::Write,
        });
        Post::Send(out)
    }

    /// Resolves the oldest chunks in flight with a response header: the WRITEs whose responses
    /// the server held back (`also_acks`, which must be exactly the oldest chunks in flight, all
    /// WRITEs), then the chunk the response names (acknowledged, refused, or an accepted READ
    /// whose payload follows). A violation leaves every chunk in flight for
    /// [`fail_all`](Self::fail_all).
    pub fn on_response(
        &mut self,
        head: &[u8; DATA_RESPONSE_LEN],
    ) -> Result<Resolution<R>, Violation> {
        let resp = match ResponseHead::decode(head)? {
            ResponseHead::Single(r) => r,
            ResponseHead::Vectored(r) => return self.on_vectored(r),
        };
        let held = usize::from(resp.also_acks);
        let plausible = held < self.fly.len()
            && self.fly.iter().take(held).enumerate().all(|(i, f)| {
                f.kind == OpKind::Write
                    && !f.vectored
                    && f.seq.wrapping_add((held - i) as u32) == resp.seq
            });
        if !plausible {
            return Err(if self.fly.is_empty() {
                Violation::Unsolicited { seq: resp.seq }
            } else {
                Violation::BadHeldAcks {
                    seq: resp.seq,
                    also_acks: resp.also_acks,
                    in_flight: self.fly.len(),
                }
            });
        }
        let Some(front) = self.fly.get(held) else {
            return Err(Violation::Unsolicited { seq: resp.seq });
        };
        if front.seq != resp.seq {
            return Err(Violation::OutOfOrder {
                got: resp.seq,
                expected: front.seq,
            });
        }
        if front.vectored {
            return Err(Violation::WrongKind { seq: resp.seq });
        }
        let payload = resp.refused.is_none() && front.kind != OpKind::Write;
        if payload && resp.len != front.chunk.payload_len() {
            return Err(Violation::WrongLength {
                got: resp.len,
                expected: front.chunk.payload_len(),
            });
        }
        for _ in 0..held {
            if let Some(f) = self.fly.pop_front() {
                self.settle_one(f.seq, f.unsent, f.chunk, None);
            }
        }
        let Some(f) = self.fly.pop_front() else {
            return Err(Violation::Unsolicited { seq: resp.seq });
        };
        match resp.refused {
            None if payload => return Ok(Resolution::Payload(f.chunk)),
            status => self.settle_one(f.seq, f.unsent, f.chunk, status),
        }
        Ok(Resolution::Done)
    }

    /// Resolves the oldest request in flight, a vectored one, with its response: the pieces
    /// done are acknowledged (a READ's are returned, their payloads follow), the piece the
    /// server refused is refused, and the pieces after it, which the server did not touch, are
    /// refused with the same status (they moved no byte).
    fn on_vectored(&mut self, resp: VectoredResponse) -> Result<Resolution<R>, Violation> {
        let Some(front) = self.fly.front() else {
            return Err(Violation::Unsolicited { seq: resp.seq });
        };
        if front.seq != resp.seq {
            return Err(Violation::OutOfOrder {
                got: resp.seq,
                expected: front.seq,
            });
        }
        if !front.vectored {
            return Err(Violation::WrongKind { seq: resp.seq });
        }
        let pieces = 1 + front.more.len();
        let done = resp.done as usize;
        if done > pieces || (done == pieces) != resp.refused.is_none() {
            return Err(Violation::BadPieces {
                seq: resp.seq,
                done: resp.done,
                pieces,
                refused: resp.refused.is_some(),
            });
        }
        let expected: u64 = match front.kind {
            OpKind::Write => 0,
            _ => std::iter::once(&front.chunk)
                .chain(&front.more)
                .take(done)
                .map(|c| c.len)
                .sum(),
        };
        if u64::from(resp.len) != expected {
            return Err(Violation::WrongLength {
                got: resp.len.into(),
                expected,
            });
        }
        let Some(f) = self.fly.pop_front() else {
            return Err(Violation::Unsolicited { seq: resp.seq });
        };
        let mut all: Vec<Chunk<R>> = Vec::with_capacity(pieces);
        all.push(f.chunk);
        all.extend(f.more);
        let rest = all.split_off(done);
        let refused: Vec<_> = match resp.refused {
            Some(status) => rest.into_iter().map(|c| (c, Some(status))).collect(),
            None => Vec::new(),
        };
        if f.kind == OpKind::Write || all.is_empty() {
            let mut chunks: Vec<_> = all.into_iter().map(|c| (c, None)).collect();
            chunks.extend(refused);
            self.settle(f.seq, f.unsent, chunks);
            Ok(Resolution::Done)
        } else {
            Answered {
                seq: f.seq,
                chunks: refused,
            }
            .resolve();
            Ok(Resolution::Pieces(all))
        }
    }

    /// [`settle`](Self::settle) for one chunk, with no allocation unless it must wait.
    fn settle_one(
        &mut self,
        seq: u32,
        unsent: bool,
        chunk: Chunk<R>,
        status: Option<RemoteStatus>,
    ) {
        match (unsent, status) {
            (true, _) => self.answered.push_back(Answered {
                seq,
                chunks: vec![(chunk, status)],
            }),
            (false, None) => chunk.acked(),
            (false, Some(s)) => chunk.refused(s),
        }
    }

    /// Resolves answered chunks now, or, for a WRITE whose payload is not reported sent yet,
    /// once it is ([`sent`](Self::sent)).
    fn settle(&mut self, seq: u32, unsent: bool, chunks: Vec<(Chunk<R>, Option<RemoteStatus>)>) {
        let answered = Answered { seq, chunks };
        if unsent {
            self.answered.push_back(answered);
        } else {
            answered.resolve();
        }
    }

    /// The payload of the WRITE posted as `seq` has left local memory (sent, or copied out): its
    /// buffer is no longer read. Its chunks resolve now if its answer already came. A READ's or
    /// CHECKSUM's `seq` changes nothing.
    pub fn sent(&mut self, seq: u32) {
        if let Some(f) = self.fly.iter_mut().find(|f| f.seq == seq) {
            f.unsent = false;
        } else if let Some(i) = self.answered.iter().position(|a| a.seq == seq)
            && let Some(a) = self.answered.remove(i)
        {
            a.resolve();
        }
    }

    /// WRITEs answered before their payload was reported sent (their chunks unresolved).
    pub fn answered_unsent(&self) -> usize {
        self.answered.len()
    }

    /// The stream is broken: every chunk in flight fails as lost (`native`: the error that broke
    /// it), and later [`post`](Self::post)s hand their chunks back. A WRITE answered before its
    /// payload was all sent is lost too: its payload never all went, so its answer says nothing.
    pub fn fail_all(&mut self, native: Option<i32>) {
        self.broken = true;
        for a in self.answered.drain(..) {
            for (c, _) in a.chunks {
                c.lost(native);
            }
        }
        for f in self.fly.drain(..) {
            f.chunk.lost(native);
            for c in f.more {
                c.lost(native);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::AckPolicy;

    /// Over a network half the window keeps moving (one response in two with three or four in
    /// flight); on loopback all but one chunk's responses may be held; one chunk alone is never
    /// held; a client that asks nothing lets nothing be held.
    #[test]
    fn ack_slack_keeps_half_the_window_moving_over_a_network() {
        let net: Vec<u16> = (1..=8).map(|n| AckPolicy::Network.slack(n)).collect();
        assert_eq!(net, [0, 0, 1, 1, 2, 2, 3, 3]);
        let lo: Vec<u16> = (1..=4).map(|n| AckPolicy::Loopback.slack(n)).collect();
        assert_eq!(lo, [0, 1, 2, 3]);
        assert_eq!(AckPolicy::Loopback.slack(1 << 20), u16::MAX);
        assert_eq!(AckPolicy::Immediate.slack(8), 0);
    }
}
