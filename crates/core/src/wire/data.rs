//! Data-plane headers: one chunk ([`DataRequest`], [`DataResponse`]) or a vectored request of
//! many pieces ([`VectoredRequest`], [`VectoredResponse`]), and the piece table between them.

use crate::ids::SegmentToken;
use crate::op::OpKind;
use crate::outcome::RemoteStatus;

use super::codec::{Reader, put_u64};
use super::error::WireError;
use super::{DATA_REQUEST_LEN, DATA_RESPONSE_LEN, MAX_CHUNK, MAX_PIECES, PIECE_LEN};

const OP_READ: u8 = 1;
const OP_WRITE: u8 = 2;
const OP_CHECKSUM: u8 = 3;
const OP_RESPONSE: u8 = 0x81;
const OP_VREAD: u8 = 4;
const OP_VWRITE: u8 = 5;
const OP_VRESPONSE: u8 = 0x82;

/// A data-plane request header: one chunk of one op.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DataRequest {
    /// READ or WRITE.
    pub kind: OpKind,
    /// Sequence number of the chunk on its stream (echoed in the response).
    pub seq: u32,
    /// The segment.
    pub token: SegmentToken,
    /// Offset in the segment.
    pub offset: u64,
    /// Payload length (at most [`MAX_CHUNK`]); for a CHECKSUM, the length of the range to hash
    /// (any length: no payload moves, the answer is [`CHECKSUM_LEN`](crate::checksum::CHECKSUM_LEN)
    /// bytes).
    pub len: u64,
    /// For a WRITE: how many responses on this stream, this one's included, the server may hold
    /// back and answer with one response (see [`DataResponse::also_acks`]). 0 or 1: answer this
    /// one at once (what a peer that predates the field sends: the bytes were reserved zeros).
    pub ack_slack: u16,
}

impl DataRequest {
    /// Encodes into a fixed buffer (no allocation).
    pub fn encode(&self, out: &mut [u8; DATA_REQUEST_LEN]) {
        out[0] = match self.kind {
            OpKind::Read => OP_READ,
            OpKind::Write => OP_WRITE,
            OpKind::Checksum => OP_CHECKSUM,
        };
        out[1] = 0;
        out[2..4].copy_from_slice(&self.ack_slack.to_le_bytes());
        out[4..8].copy_from_slice(&self.seq.to_le_bytes());
        out[8..16].copy_from_slice(&self.token.0.to_le_bytes());
        out[16..24].copy_from_slice(&self.offset.to_le_bytes());
        out[24..32].copy_from_slice(&self.len.to_le_bytes());
    }

    /// Decodes and checks a header (the length against [`MAX_CHUNK`]).
    pub fn decode(buf: &[u8; DATA_REQUEST_LEN]) -> Result<Self, WireError> {
        let mut r = Reader::new(buf);
        let kind = match r.u8("op")? {
            OP_READ => OpKind::Read,
            OP_WRITE => OpKind::Write,
            OP_CHECKSUM => OpKind::Checksum,
            c => {
                return Err(WireError::UnknownCode {
                    field: "op",
                    code: c.into(),
                });
            }
        };
        let _flags = r.u8("flags")?;
        let ack_slack = r.u16("ack slack")?;
        let seq = r.u32("seq")?;
        let token = SegmentToken(r.u64("token")?);
        let offset = r.u64("offset")?;
        let len = r.u64("length")?;
        if len > MAX_CHUNK && kind != OpKind::Checksum {
            return Err(WireError::TooLarge {
                field: "chunk length",
                value: len,
                limit: MAX_CHUNK,
            });
        }
        Ok(Self {
            kind,
            seq,
            token,
            offset,
            len,
            ack_slack,
        })
    }
}

/// A data-plane response header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DataResponse {
    /// The request's sequence number.
    pub seq: u32,
    /// `None` when accepted, else why it was refused (no byte moved).
    pub refused: Option<RemoteStatus>,
    /// Payload bytes that follow (an accepted READ's length, else 0).
    pub len: u64,
    /// How many WRITE chunks sent just before `seq` on this stream (`seq - also_acks` up to
    /// `seq - 1`) this response also accepts: their responses were held back, as their requests'
    /// [`DataRequest::ack_slack`] allowed. 0 from a server that holds nothing back.
    pub also_acks: u16,
}

fn status_code(s: Option<RemoteStatus>) -> u8 {
    match s {
        None => 0,
        Some(RemoteStatus::UnknownSegment) => 1,
        Some(RemoteStatus::OutOfBounds) => 2,
        Some(RemoteStatus::AccessDenied) => 3,
        Some(RemoteStatus::StaleEpoch) => 4,
        Some(RemoteStatus::Malformed) => 5,
    }
}

impl DataResponse {
    /// Encodes into a fixed buffer (no allocation).
    pub fn encode(&self, out: &mut [u8; DATA_RESPONSE_LEN]) {
        out[0] = OP_RESPONSE;
        out[1] = status_code(self.refused);
        out[2..4].copy_from_slice(&self.also_acks.to_le_bytes());
        out[4..8].copy_from_slice(&self.seq.to_le_bytes());
        out[8..16].copy_from_slice(&self.len.to_le_bytes());
    }

    /// Decodes and checks a header.
    pub fn decode(buf: &[u8; DATA_RESPONSE_LEN]) -> Result<Self, WireError> {
        let mut r = Reader::new(buf);
        let op = r.u8("op")?;
        if op != OP_RESPONSE {
            return Err(WireError::UnknownCode {
                field: "response op",
                code: op.into(),
            });
        }
        let refused = status_from_code(r.u8("status")?)?;
        let also_acks = r.u16("also acks")?;
        let seq = r.u32("seq")?;
        let len = r.u64("length")?;
        if len > MAX_CHUNK {
            return Err(WireError::TooLarge {
                field: "response length",
                value: len,
                limit: MAX_CHUNK,
            });
        }
        Ok(Self {
            seq,
            refused,
            len,
            also_acks,
        })
    }
}

/// A vectored data request header (protocol version 3): one READ or WRITE of many pieces, each
/// a (segment, offset, length), whose bytes travel as one payload in piece order.
///
/// Layout (32 bytes, the size of a [`DataRequest`]): `op u8 (4: READ, 5: WRITE) | flags u8 (0) |
/// reserved u16 | seq u32 | pieces u32 | reserved u32 | reserved u64 | total u64`. The piece
/// table follows the header: `pieces` records of [`PIECE_LEN`] bytes (`token u64 | offset u64 |
/// len u64`, see [`decode_pieces`]); a WRITE's payload of `total` bytes follows the table.
///
/// The server checks the pieces in order before it moves a byte and performs the longest prefix
/// it accepts: its [`VectoredResponse`] says how many pieces were done and why the next one was
/// refused; no piece after a refused one is touched.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct VectoredRequest {
    /// READ or WRITE.
    pub kind: OpKind,
    /// Sequence number on its stream (echoed in the response).
    pub seq: u32,
    /// Pieces in the table (1 to [`MAX_PIECES`]).
    pub pieces: u32,
    /// The sum of the pieces' lengths (at most [`MAX_CHUNK`]).
    pub total: u64,
}

impl VectoredRequest {
    /// Encodes into a fixed buffer (no allocation).
    pub fn encode(&self, out: &mut [u8; DATA_REQUEST_LEN]) {
        *out = [0u8; DATA_REQUEST_LEN];
        out[0] = match self.kind {
            OpKind::Write => OP_VWRITE,
            OpKind::Read | OpKind::Checksum => OP_VREAD,
        };
        out[4..8].copy_from_slice(&self.seq.to_le_bytes());
        out[8..12].copy_from_slice(&self.pieces.to_le_bytes());
        out[24..32].copy_from_slice(&self.total.to_le_bytes());
    }

    /// Bytes of the piece table that follows the header.
    pub fn table_len(&self) -> usize {
        self.pieces as usize * PIECE_LEN
    }
}

/// One piece of a vectored request: a range of a remote segment.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Piece {
    /// The segment.
    pub token: SegmentToken,
    /// Offset in the segment.
    pub offset: u64,
    /// Length (at most [`MAX_CHUNK`]).
    pub len: u64,
}

impl Piece {
    /// Appends the piece's table record to `out`.
    pub fn encode(&self, out: &mut Vec<u8>) {
        put_u64(out, self.token.0);
        put_u64(out, self.offset);
        put_u64(out, self.len);
    }
}

/// Decodes the piece table of `req` from `buf`: the count is checked against [`MAX_PIECES`] and
/// against the bytes in `buf` before anything is allocated, every length against [`MAX_CHUNK`],
/// and the lengths must add up to `req.total` exactly (no overflow); `buf` must hold nothing
/// else.
pub fn decode_pieces(req: &VectoredRequest, buf: &[u8]) -> Result<Vec<Piece>, WireError> {
    let mut r = Reader::new(buf);
    let n = r.count(
        req.pieces.into(),
        MAX_PIECES as usize,
        PIECE_LEN,
        "piece count",
    )?;
    let mut pieces = Vec::with_capacity(n);
    let mut sum = 0u64;
    for _ in 0..n {
        let p = Piece {
            token: SegmentToken(r.u64("piece token")?),
            offset: r.u64("piece offset")?,
            len: r.u64("piece length")?,
        };
        if p.len > MAX_CHUNK {
            return Err(WireError::TooLarge {
                field: "piece length",
                value: p.len,
                limit: MAX_CHUNK,
            });
        }
        sum = sum.saturating_add(p.len);
        pieces.push(p);
    }
    r.finish("piece table")?;
    if sum != req.total {
        return Err(WireError::TooLarge {
            field: "sum of piece lengths (must equal the request's total)",
            value: sum,
            limit: req.total,
        });
    }
    Ok(pieces)
}

/// A request header as it arrives: one chunk ([`DataRequest`]) or a vectored request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RequestHead {
    /// One chunk of one op.
    Single(DataRequest),
    /// Many pieces (protocol version 3); the piece table follows.
    Vectored(VectoredRequest),
}

impl RequestHead {
    /// Decodes and checks a header: a vectored one's piece count against [`MAX_PIECES`] (and
    /// 0) and its total against [`MAX_CHUNK`].
    pub fn decode(buf: &[u8; DATA_REQUEST_LEN]) -> Result<Self, WireError> {
        let kind = match buf[0] {
            OP_VREAD => OpKind::Read,
            OP_VWRITE => OpKind::Write,
            _ => return DataRequest::decode(buf).map(RequestHead::Single),
        };
        let mut r = Reader::new(&buf[4..]);
        let seq = r.u32("seq")?;
        let pieces = r.u32("piece count")?;
        let _reserved = r.u32("reserved")?;
        let _reserved = r.u64("reserved")?;
        let total = r.u64("total length")?;
        if pieces == 0 || pieces > MAX_PIECES {
            return Err(WireError::TooLarge {
                field: "piece count (1 up)",
                value: pieces.into(),
                limit: MAX_PIECES.into(),
            });
        }
        if total > MAX_CHUNK {
            return Err(WireError::TooLarge {
                field: "vectored length",
                value: total,
                limit: MAX_CHUNK,
            });
        }
        Ok(RequestHead::Vectored(VectoredRequest {
            kind,
            seq,
            pieces,
            total,
        }))
    }
}

/// The response to a vectored request (16 bytes): `op u8 (0x82) | status u8 | reserved u16 |
/// seq u32 | done u32 | len u32`. The first `done` pieces were performed; when `done` is less
/// than the request's piece count, `refused` says why piece `done` was refused (and no later
/// piece was touched). `len` payload bytes follow: an accepted READ's pieces, in order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct VectoredResponse {
    /// The request's sequence number.
    pub seq: u32,
    /// Why piece `done` was refused; `None` when every piece was done.
    pub refused: Option<RemoteStatus>,
    /// Pieces performed, from the first.
    pub done: u32,
    /// Payload bytes that follow (a READ's done pieces, else 0).
    pub len: u32,
}

impl VectoredResponse {
    /// Encodes into a fixed buffer (no allocation).
    pub fn encode(&self, out: &mut [u8; DATA_RESPONSE_LEN]) {
        out[0] = OP_VRESPONSE;
        out[1] = status_code(self.refused);
        out[2..4].copy_from_slice(&[0, 0]);
        out[4..8].copy_from_slice(&self.seq.to_le_bytes());
        out[8..12].copy_from_slice(&self.done.to_le_bytes());
        out[12..16].copy_from_slice(&self.len.to_le_bytes());
    }
}

/// A response header as it arrives: to one chunk or to a vectored request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ResponseHead {
    /// To one chunk.
    Single(DataResponse),
    /// To a vectored request.
    Vectored(VectoredResponse),
}

impl ResponseHead {
    /// Decodes and checks a header (lengths against [`MAX_CHUNK`], `done` against
    /// [`MAX_PIECES`]).
    pub fn decode(buf: &[u8; DATA_RESPONSE_LEN]) -> Result<Self, WireError> {
        if buf[0] != OP_VRESPONSE {
            return DataResponse::decode(buf).map(ResponseHead::Single);
        }
        let mut r = Reader::new(&buf[1..]);
        let refused = status_from_code(r.u8("status")?)?;
        let _reserved = r.u16("reserved")?;
        let seq = r.u32("seq")?;
        let done = r.u32("pieces done")?;
        let len = r.u32("length")?;
        if done > MAX_PIECES {
            return Err(WireError::TooLarge {
                field: "pieces done",
                value: done.into(),
                limit: MAX_PIECES.into(),
            });
        }
        if u64::from(len) > MAX_CHUNK {
            return Err(WireError::TooLarge {
                field: "response length",
                value: len.into(),
                limit: MAX_CHUNK,
            });
        }
        Ok(ResponseHead::Vectored(VectoredResponse {
            seq,
            refused,
            done,
            len,
        }))
    }
}

fn status_from_code(c: u8) -> Result<Option<RemoteStatus>, WireError> {
    Ok(match c {
        0 => None,
        1 => Some(RemoteStatus::UnknownSegment),
        2 => Some(RemoteStatus::OutOfBounds),
        3 => Some(RemoteStatus::AccessDenied),
        4 => Some(RemoteStatus::StaleEpoch),
        5 => Some(RemoteStatus::Malformed),
        c => {
            return Err(WireError::UnknownCode {
                field: "status",
                code: c.into(),
            });
        }
    })
}
