//! The server half of a data stream: decode a request header, resolve it against the
//! [`SegmentTable`], check access and bounds before any byte of a segment is touched, refuse what
//! fails, and decide when a WRITE's response may be held back.

use std::sync::Arc;

use crate::checksum::{CHECKSUM_LEN, RegionCrc};
use crate::ids::SegmentToken;
use crate::op::OpKind;
use crate::outcome::RemoteStatus;
use crate::transport::{FileSource, SegmentLease, SegmentTable, ServeStats};
use crate::wire::{
    DATA_REQUEST_LEN, DATA_RESPONSE_LEN, DataRequest, DataResponse, RequestHead, VectoredRequest,
    VectoredResponse, WireError, decode_pieces,
};

/// The header of a response that accepts request `seq` with `len` payload bytes following (an
/// accepted READ's length, else 0).
pub fn accepted(seq: u32, len: u64) -> [u8; DATA_RESPONSE_LEN] {
    let mut out = [0u8; DATA_RESPONSE_LEN];
    DataResponse {
        seq,
        refused: None,
        len,
        also_acks: 0,
    }
    .encode(&mut out);
    out
}

/// Bytes of a checksum answer: the response header, then the checksum.
pub const CHECKSUM_RESPONSE_LEN: usize = DATA_RESPONSE_LEN + CHECKSUM_LEN;

/// The answer to CHECKSUM request `seq`: an accepted response announcing
/// [`CHECKSUM_LEN`] payload bytes, then `crc` (little-endian).
pub fn checksum_response(seq: u32, crc: u32) -> [u8; CHECKSUM_RESPONSE_LEN] {
    let mut out = [0u8; CHECKSUM_RESPONSE_LEN];
    let head = accepted(seq, CHECKSUM_LEN as u64);
    out[..DATA_RESPONSE_LEN].copy_from_slice(&head);
    out[DATA_RESPONSE_LEN..].copy_from_slice(&crc.to_le_bytes());
    out
}

/// The header of a response that refuses request `seq` (no byte moved).
pub fn refused(seq: u32, status: RemoteStatus) -> [u8; DATA_RESPONSE_LEN] {
    let mut out = [0u8; DATA_RESPONSE_LEN];
    DataResponse {
        seq,
        refused: Some(status),
        len: 0,
        also_acks: 0,
    }
    .encode(&mut out);
    out
}

/// What the driver must do for one request. Every target was checked (token, access, bounds)
/// against the table; lengths are at most [`MAX_CHUNK`](crate::wire::MAX_CHUNK).
#[derive(Debug)]
pub enum Action {
    /// Receive `len` payload bytes into `lease.region` at `at`, then answer with
    /// [`ServerStream::answer_write`] (or hold the answer back: [`ServerStream::may_hold`]).
    WriteMemory {
        /// The segment (keeps it alive).
        lease: SegmentLease,
        /// The segment's token.
        token: SegmentToken,
        /// Offset in `lease.region`.
        at: u64,
        /// Payload length.
        len: usize,
        /// The request's sequence number.
        seq: u32,
        /// How many responses the client lets the server hold back.
        ack_slack: u16,
    },
    /// Send `response`, then `len` bytes of `lease.region` from `at`.
    ReadMemory {
        /// The segment (keeps it alive).
        lease: SegmentLease,
        /// Offset in `lease.region`.
        at: u64,
        /// Payload length.
        len: usize,
        /// The response header.
        response: [u8; DATA_RESPONSE_LEN],
    },
    /// Send `response`, then `len` bytes of `file` from `at` (a file that ends earlier closes
    /// the stream).
    ReadFile {
        /// The file.
        file: Arc<dyn FileSource>,
        /// Offset in the file.
        at: u64,
        /// Payload length.
        len: usize,
        /// The response header.
        response: [u8; DATA_RESPONSE_LEN],
    },
    /// Receive `len` payload bytes and write them to `file` at `at`, then send `response`.
    WriteFile {
        /// The file.
        file: Arc<dyn FileSource>,
        /// Offset in the file.
        at: u64,
        /// Payload length.
        len: usize,
        /// The response header.
        response: [u8; DATA_RESPONSE_LEN],
    },
    /// Compute the CRC-32C of a memory range (`sum`, checked already; a piece per
    /// [`RegionCrc::step`], so that a driver whose thread serves other streams lets them run
    /// between pieces), then send [`checksum_response`]`(seq, crc)`. Nothing else moves.
    ChecksumMemory {
        /// The segment (keeps it alive while it is hashed).
        lease: SegmentLease,
        /// The range's checksum, to be computed.
        sum: RegionCrc,
        /// The request's sequence number.
        seq: u32,
    },
    /// Compute the CRC-32C of `len` bytes of `file` from `at`
    /// ([`crc32c_file`](crate::checksum::crc32c_file): blocking positioned reads), then send
    /// [`checksum_response`]`(seq, crc)`; a file that ends earlier closes the stream.
    ChecksumFile {
        /// The file.
        file: Arc<dyn FileSource>,
        /// Offset in the file.
        at: u64,
        /// Bytes to hash.
        len: u64,
        /// The request's sequence number.
        seq: u32,
    },
    /// Receive and drop `discard` payload bytes (a refused WRITE's), then send `response`.
    Refuse {
        /// The request's direction.
        kind: OpKind,
        /// The segment it named.
        token: SegmentToken,
        /// Why it is refused.
        status: RemoteStatus,
        /// Payload bytes to read and drop.
        discard: u64,
        /// The response header.
        response: [u8; DATA_RESPONSE_LEN],
    },
    /// A vectored request (protocol version 3): receive its piece table,
    /// [`VectoredRequest::table_len`] bytes, and hand them to [`ServerStream::on_table`], whose
    /// action follows. Nothing is held across it: send [`ServerStream::flush`]'s first.
    Table {
        /// The request header.
        req: VectoredRequest,
    },
    /// The checked pieces of a vectored request, the longest prefix the server accepts, in
    /// order. A WRITE: receive each target's bytes into it in turn, then receive and drop
    /// `discard` bytes (the refused pieces' payload), then send `response`. A READ: send
    /// `response`, then each target's bytes in turn.
    Vectored {
        /// READ or WRITE.
        kind: OpKind,
        /// The accepted pieces' targets.
        targets: Vec<Target>,
        /// Payload bytes to read and drop after the targets' (a WRITE's refused pieces).
        discard: u64,
        /// The response header.
        response: [u8; DATA_RESPONSE_LEN],
    },
    /// The header does not decode and the payload length cannot be trusted: send `response`
    /// (`Malformed`, with the sequence number read from the raw header), then close the stream.
    Close {
        /// Why.
        error: WireError,
        /// The response header.
        response: [u8; DATA_RESPONSE_LEN],
    },
}

/// Where one accepted piece of a vectored request lands or comes from; checked against its
/// segment (token, access, bounds) before any byte moved.
#[derive(Debug)]
pub enum Target {
    /// `len` bytes of `lease.region` at `at`.
    Memory {
        /// The segment (keeps it alive).
        lease: SegmentLease,
        /// Offset in `lease.region`.
        at: u64,
        /// Length.
        len: usize,
    },
    /// `len` bytes of `file` at `at` (positioned I/O; a file that ends earlier closes the
    /// stream).
    File {
        /// The file.
        file: Arc<dyn FileSource>,
        /// Offset in the file.
        at: u64,
        /// Length.
        len: usize,
    },
}

impl Target {
    /// The piece's length.
    pub fn len(&self) -> usize {
        match self {
            Target::Memory { len, .. } | Target::File { len, .. } => *len,
        }
    }

    /// Whether the piece is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl Action {
    /// Whether the action answers an accepted WRITE to memory, the only answer that may join
    /// held-back responses. Before any other, the driver sends [`ServerStream::flush`]'s, so
    /// that no answer overtakes them.
    pub fn joins_held(&self) -> bool {
        matches!(self, Action::WriteMemory { .. })
    }
}

/// The server state of one data stream: the table its peer may see, the WRITE responses it
/// holds back (see [`DataRequest::ack_slack`]) and the checked target of the request whose
/// arrival allowed the last hold. No I/O: the driver feeds request headers to
/// [`on_request`](Self::on_request) and piece tables to [`on_table`](Self::on_table) and does
/// what the [`Action`] says, in order.
///
/// The table is fixed when the stream is made (by the handshake,
/// [`ServerStep::Stream`](crate::handshake::ServerStep::Stream): the peer's view of the
/// published segments), and every single op and every piece of a vectored request resolves
/// through it; a driver holds no table to pass.
#[derive(Debug)]
pub struct ServerStream {
    table: Arc<dyn SegmentTable>,
    held: u16,
    last_held: u32,
    carried: Option<(SegmentLease, u64)>,
    stats: Option<Arc<ServeStats>>,
    _permit: Option<crate::stream_cap::StreamPermit>,
}

impl ServerStream {
    /// A stream that serves what `table` resolves, with nothing held.
    pub fn new(table: Arc<dyn SegmentTable>) -> Self {
        Self {
            table,
            held: 0,
            last_held: 0,
            carried: None,
            stats: None,
            _permit: None,
        }
    }

    /// The same stream, holding its place under its key name's cap for its life.
    pub fn holding(mut self, permit: Option<crate::stream_cap::StreamPermit>) -> Self {
        self._permit = permit;
        self
    }

    /// The same stream, counting what it accepts and refuses in `stats` (shared by the streams
    /// of one server; `None` counts nothing).
    pub fn counting(mut self, stats: Option<Arc<ServeStats>>) -> Self {
        self.stats = stats;
        self
    }

    /// The segment under `token` as this stream's peer sees it (`None`: unknown, retired, or
    /// not published to this peer), for a driver that hands the peer something other than a
    /// copy: the same-host plane's shared registrations ([`crate::share`]).
    pub fn resolve(&self, token: SegmentToken) -> Option<SegmentLease> {
        self.table.resolve(token)
    }

    /// Responses held back now.
    pub fn held(&self) -> u16 {
        self.held
    }

    /// Decodes, resolves and checks one request header: memory segments first, then file
    /// segments (an unknown token is indistinguishable from a retired one).
    pub fn on_request(&mut self, head: &[u8; DATA_REQUEST_LEN]) -> Action {
        let action = self.decide(head);
        if let Some(stats) = &self.stats {
            count(stats, &action);
        }
        action
    }

    fn decide(&mut self, head: &[u8; DATA_REQUEST_LEN]) -> Action {
        let table = &*self.table;
        let req = match RequestHead::decode(head) {
            Ok(RequestHead::Single(r)) => r,
            Ok(RequestHead::Vectored(req)) => {
                self.carried = None;
                return Action::Table { req };
            }
            Err(error) => {
                self.carried = None;
                return Action::Close {
                    error,
                    response: refused(request_seq(head), RemoteStatus::Malformed),
                };
            }
        };
        // `len` is at most MAX_CHUNK (checked by decode) for a READ or WRITE, so it fits a
        // usize; a CHECKSUM's is not used as one.
        let len = req.len as usize;
        let memory = match self.carried.take() {
            Some(c) => Some(Ok(c)),
            None => table
                .resolve(req.token)
                .map(|l| l.check(req.kind, req.offset, req.len).map(|at| (l, at))),
        };
        let target = match memory {
            Some(Ok((lease, at))) => Ok(match req.kind {
                OpKind::Write => Action::WriteMemory {
                    lease,
                    token: req.token,
                    at,
                    len,
                    seq: req.seq,
                    ack_slack: req.ack_slack,
                },
                OpKind::Read => Action::ReadMemory {
                    lease,
                    at,
                    len,
                    response: accepted(req.seq, req.len),
                },
                OpKind::Checksum => {
                    match RegionCrc::new(lease.region.clone(), at, req.len) {
                        Ok(sum) => Action::ChecksumMemory {
                            lease,
                            sum,
                            seq: req.seq,
                        },
                        // Checked against the segment just above, which lies in the region.
                        Err(_) => Action::Refuse {
                            kind: req.kind,
                            token: req.token,
                            status: RemoteStatus::OutOfBounds,
                            discard: 0,
                            response: refused(req.seq, RemoteStatus::OutOfBounds),
                        },
                    }
                }
            }),
            Some(Err(status)) => Err(status),
            None => match table.file(req.token) {
                Some(file) => file
                    .check(req.kind, req.offset, req.len)
                    .map(|at| match req.kind {
                        OpKind::Write => Action::WriteFile {
                            file,
                            at,
                            len,
                            response: accepted(req.seq, 0),
                        },
                        OpKind::Read => Action::ReadFile {
                            file,
                            at,
                            len,
                            response: accepted(req.seq, req.len),
                        },
                        OpKind::Checksum => Action::ChecksumFile {
                            file,
                            at,
                            len: req.len,
                            seq: req.seq,
                        },
                    }),
                None => Err(RemoteStatus::UnknownSegment),
            },
        };
        target.unwrap_or_else(|status| Action::Refuse {
            kind: req.kind,
            token: req.token,
            status,
            discard: match req.kind {
                OpKind::Write => req.len,
                OpKind::Read | OpKind::Checksum => 0,
            },
            response: refused(req.seq, status),
        })
    }

    /// Decodes and checks the piece table of vectored request `req` (see
    /// [`decode_pieces`]: counts and lengths are checked before allocation); resolves each
    /// piece in order as [`on_request`](Self::on_request) does one chunk, and accepts the
    /// longest prefix that passes: the response says how many pieces that is and why the next
    /// was refused. A table that does not decode closes the stream ([`Action::Close`]).
    pub fn on_table(&mut self, req: &VectoredRequest, bytes: &[u8]) -> Action {
        let table = &*self.table;
        let pieces = match decode_pieces(req, bytes) {
            Ok(p) => p,
            Err(error) => {
                return Action::Close {
                    error,
                    response: refused(req.seq, RemoteStatus::Malformed),
                };
            }
        };
        let mut targets = Vec::with_capacity(pieces.len());
        let mut refusal = None;
        let mut moved = 0u64;
        for p in &pieces {
            let target = match table.resolve(p.token) {
                Some(lease) => lease
                    .check(req.kind, p.offset, p.len)
                    .map(|at| Target::Memory {
                        lease,
                        at,
                        len: p.len as usize,
                    }),
                None => match table.file(p.token) {
                    Some(file) => file
                        .check(req.kind, p.offset, p.len)
                        .map(|at| Target::File {
                            file,
                            at,
                            len: p.len as usize,
                        }),
                    None => Err(RemoteStatus::UnknownSegment),
                },
            };
            match target {
                Ok(t) => {
                    moved += p.len;
                    targets.push(t);
                }
                Err(status) => {
                    refusal = Some(status);
                    break;
                }
            }
        }
        let done = targets.len() as u32;
        if let Some(stats) = &self.stats {
            stats.accepted(req.kind, u64::from(done), moved);
            if let Some(status) = refusal {
                stats.refused(status);
            }
        }
        let mut response = [0u8; DATA_RESPONSE_LEN];
        VectoredResponse {
            seq: req.seq,
            refused: refusal,
            done,
            // At most the request's total, itself at most MAX_CHUNK (checked by decode).
            len: match req.kind {
                OpKind::Write => 0,
                _ => moved as u32,
            },
        }
        .encode(&mut response);
        Action::Vectored {
            kind: req.kind,
            targets,
            discard: match req.kind {
                OpKind::Write => req.total - moved,
                _ => 0,
            },
            response,
        }
    }

    /// Whether the response of an accepted WRITE with `ack_slack` may join the held-back ones,
    /// if the next request is already there (see [`hold_for_next`](Self::hold_for_next)).
    pub fn may_hold(&self, ack_slack: u16) -> bool {
        self.held < ack_slack
    }

    /// After an accepted WRITE `seq` into `lease` whose response [`may_hold`](Self::may_hold),
    /// with the next request header `next` already received: holds the response back if `next`
    /// is a WRITE into the same segment within `lease` (then nothing lies between this chunk
    /// and its response but the arrival of that payload, which the client is sending now: no
    /// lookup, nothing that could stall). Returns whether it held; if not, answer at once
    /// ([`answer_write`](Self::answer_write)).
    pub fn hold_for_next(
        &mut self,
        lease: &SegmentLease,
        token: SegmentToken,
        seq: u32,
        next: &[u8; DATA_REQUEST_LEN],
    ) -> bool {
        let Ok(next) = DataRequest::decode(next) else {
            return false;
        };
        if next.kind != OpKind::Write || next.token != token {
            return false;
        }
        let Ok(at) = lease.check(OpKind::Write, next.offset, next.len) else {
            return false;
        };
        self.held += 1;
        self.last_held = seq;
        self.carried = Some((lease.clone(), at));
        true
    }

    /// The response accepting WRITE `seq` and, with it, every held-back one.
    pub fn answer_write(&mut self, seq: u32) -> [u8; DATA_RESPONSE_LEN] {
        let mut out = [0u8; DATA_RESPONSE_LEN];
        DataResponse {
            seq,
            refused: None,
            len: 0,
            also_acks: self.held,
        }
        .encode(&mut out);
        self.held = 0;
        out
    }

    /// The response that releases the held-back responses (the last one carrying the others),
    /// if any are held; the driver sends it before an answer that does not join them, and when
    /// the stream ends.
    pub fn flush(&mut self) -> Option<[u8; DATA_RESPONSE_LEN]> {
        if self.held == 0 {
            return None;
        }
        self.held -= 1;
        let seq = self.last_held;
        Some(self.answer_write(seq))
    }
}

/// Counts what `action` accepts or refuses in `stats`.
fn count(stats: &ServeStats, action: &Action) {
    match action {
        Action::WriteMemory { len, .. } | Action::WriteFile { len, .. } => {
            stats.accepted(OpKind::Write, 1, *len as u64)
        }
        Action::ReadMemory { len, .. } | Action::ReadFile { len, .. } => {
            stats.accepted(OpKind::Read, 1, *len as u64)
        }
        Action::ChecksumMemory { sum, .. } => stats.accepted(OpKind::Checksum, 1, sum.remaining()),
        Action::ChecksumFile { len, .. } => stats.accepted(OpKind::Checksum, 1, *len),
        Action::Refuse { status, .. } => stats.refused(*status),
        Action::Close { .. } => stats.refused(RemoteStatus::Malformed),
        // The table once here; its pieces by `on_table`, piece by piece.
        Action::Table { .. } => stats.table(),
        Action::Vectored { .. } => {}
    }
}

/// The sequence number of a request header, read from its raw bytes (to answer a header that
/// does not decode).
pub fn request_seq(head: &[u8; DATA_REQUEST_LEN]) -> u32 {
    u32::from_le_bytes([head[4], head[5], head[6], head[7]])
}
