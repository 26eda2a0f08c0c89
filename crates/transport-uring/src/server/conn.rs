//! One served data stream as its ring holds it: the queue of steps the stream protocol's
//! actions become, and what keeps their memory alive while the kernel may use it.

use std::collections::VecDeque;
use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;

use ferry_core::checksum::{FileCrc, RegionCrc};
use ferry_core::stream::{ServerStream, Target};
use ferry_core::wire::{DATA_REQUEST_LEN, VectoredRequest};
use ferry_core::{MemoryRegion, SegmentLease, SegmentToken};

use super::files::{FileIo, Stage};
use super::shared::Ctx;

/// Bytes a refused WRITE's payload is dropped through, per receive.
pub(super) const DISCARD_BUF: usize = 64 << 10;

/// What keeps the memory of a step's pointers alive until its operation completed.
#[derive(Default)]
pub(super) struct Keep {
    pub(super) _bytes: Vec<u8>,
    pub(super) _lease: Option<SegmentLease>,
    pub(super) _region: Option<Arc<MemoryRegion>>,
    pub(super) _targets: Option<Arc<Vec<Target>>>,
}

/// One thing a stream does, in order.
pub(super) enum Step {
    /// Sends `parts` (address, length) back to back; `done` bytes went.
    Send {
        parts: Vec<(*const u8, usize)>,
        done: usize,
        _keep: Keep,
    },
    /// Sends `head` (copied, `MSG_MORE`), then `len` bytes of `lease.region` at `at` with
    /// SEND_ZC; each zero-copy send holds a clone of the lease until its notification.
    SendZc {
        head: Vec<u8>,
        head_done: usize,
        lease: SegmentLease,
        at: u64,
        len: usize,
        done: usize,
    },
    /// Receives exactly the bytes of `parts`; `done` came. With `head_too` (a WRITE's payload,
    /// the last bytes of its request) a receive that need not wait for all of them also takes
    /// what is there of the next request's header, into [`Conn::head`] (never waiting for it).
    Recv {
        parts: Vec<(*const u8, usize)>,
        done: usize,
        head_too: bool,
        _keep: Keep,
    },
    /// Receives and drops `left` bytes.
    Discard { left: u64, buf: Box<[u8]> },
    /// Receives the next request header.
    Head {
        buf: Box<[u8; DATA_REQUEST_LEN]>,
        got: usize,
    },
    /// Receives a vectored request's piece table.
    Table {
        req: VectoredRequest,
        bytes: Vec<u8>,
        got: usize,
    },
    /// Reads `len` bytes of a file at `at` into the start of `stage` (a ring operation on a
    /// segment's descriptor; another source's on the ring's thread); `done` came.
    FileRead {
        file: Arc<FileIo>,
        at: u64,
        len: usize,
        done: usize,
        stage: Arc<MemoryRegion>,
    },
    /// Writes the first `len` bytes of `stage` to a file at `at` (as a read does); `done` went.
    FileWrite {
        file: Arc<FileIo>,
        at: u64,
        len: usize,
        done: usize,
        stage: Arc<MemoryRegion>,
    },
    /// An accepted WRITE's payload is in: answer it or hold the answer back.
    Answer {
        lease: SegmentLease,
        token: SegmentToken,
        seq: u32,
        ack_slack: u16,
    },
    /// Hashes a memory range, a piece per turn, then answers.
    Crc {
        sum: RegionCrc,
        seq: u32,
        _lease: SegmentLease,
    },
    /// Hashes a file range, a piece (one positioned read on the ring's thread) per turn, then
    /// answers.
    CrcFile { sum: FileCrc, seq: u32 },
    /// Ends the stream (after what came before it).
    Close,
}

impl Step {
    pub(super) fn send_owned(bytes: Vec<u8>) -> Self {
        let parts = vec![(bytes.as_ptr(), bytes.len())];
        Step::Send {
            parts,
            done: 0,
            _keep: Keep {
                _bytes: bytes,
                ..Keep::default()
            },
        }
    }

    pub(super) fn head() -> Self {
        Step::Head {
            buf: Box::new([0; DATA_REQUEST_LEN]),
            got: 0,
        }
    }
}

/// One data stream on a ring. Boxed: the ring's operations point into it.
pub(super) struct Conn {
    pub(super) ctx: Arc<Ctx>,
    pub(super) stream: Arc<TcpStream>,
    pub(super) from: SocketAddr,
    /// Its place in the server's connections (so a shutdown reaches it).
    pub(super) live_id: u64,
    /// Its fixed-file slot, if registered (as its ring host says at each turn).
    pub(super) fixed: Option<u32>,
    pub(super) proto: ServerStream,
    pub(super) steps: VecDeque<Step>,
    /// An operation of the front step is in flight.
    pub(super) inflight: bool,
    /// The next request header's receive, submitted with the request's last send (one enter
    /// for both) while the stream is otherwise idle; at most one receive is in flight.
    pub(super) armed: Option<Armed>,
    /// READ payloads go out with SEND_ZC (`UringConfig::zero_copy_for` this peer).
    pub(super) zero_copy: bool,
    /// The socket's `SO_RCVLOWAT` as last set (1: the kernel's default); 0: the kernel refused
    /// a mark, none is used on this socket.
    pub(super) lowat: usize,
    /// The next request's header: `head_got` bytes of it received ahead of its turn (with a
    /// WRITE's payload, or after it without waiting); all of it and taken as the next request:
    /// `ready`.
    pub(super) head: [u8; DATA_REQUEST_LEN],
    pub(super) head_got: usize,
    pub(super) ready: bool,
    pub(super) stage: Stage,
    /// The iovecs and message of the operation in flight.
    pub(super) iov: Vec<libc::iovec>,
    pub(super) msg: libc::msghdr,
}

/// A header receive armed beside a send.
pub(super) struct Armed {
    pub(super) buf: Box<[u8; DATA_REQUEST_LEN]>,
    /// Its completion's result, once reaped.
    pub(super) res: Option<i32>,
}

/// The bytes of `parts` in all.
pub(super) fn total(parts: &[(*const u8, usize)]) -> usize {
    parts.iter().map(|p| p.1).sum()
}
