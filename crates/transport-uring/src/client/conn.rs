//! One client stream as its ring holds it: its receive side (the response header or payload
//! coming in), its send side (a request going out, what keeps its memory alive), and the
//! operations it has in flight.

use std::io;
use std::net::SocketAddr;
use std::os::fd::{OwnedFd, RawFd};
use std::sync::Arc;

use ferry_core::MemoryRegion;
use ferry_core::countdown::Executing;
use ferry_core::stream::{Chunk, Outgoing};
use ferry_core::wire::DATA_RESPONSE_LEN;

use super::state::{Queue, StreamShared};
use tracing::debug;

use crate::ring::IoStats;
use crate::ring::host::OpKind;

/// A client stream's kinds of ring operation: a receive (header or payload), a send (copied, or
/// a zero-copy send's completion), a poll for room in a full socket, the hang-up poll of an idle
/// stream with a direct reader.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Op {
    Recv = 1,
    Send = 2,
    Poll = 4,
    Hangup = 6,
}

impl OpKind for Op {
    fn kind(self) -> u8 {
        self as u8
    }

    fn of(kind: u8) -> Option<Self> {
        [Op::Recv, Op::Send, Op::Poll, Op::Hangup]
            .into_iter()
            .find(|op| *op as u8 == kind)
    }
}

/// What keeps the memory a send points at alive until it completed.
pub(super) enum Keep {
    /// A request the stream posted (header, piece table, the regions of its payload), and
    /// bytes a submitter left unsent before it, if any.
    Posted(
        #[allow(dead_code)] Box<Outgoing<Executing>>,
        #[allow(dead_code)] Option<Vec<u8>>,
    ),
    /// Bytes a submitter's send left over.
    Bytes(#[allow(dead_code)] Vec<u8>),
}

/// What follows a send's copied bytes.
pub(super) enum Body {
    None,
    /// SEND_ZC of `len` bytes at `ptr` in `region`, `done` sent; each send holds the request
    /// un-drained until its notification.
    Zc {
        ptr: *const u8,
        len: usize,
        done: usize,
        region: Arc<MemoryRegion>,
        req: Arc<Executing>,
    },
    /// vmsplice + splice of `len` bytes at `ptr`: `done` moved to the socket, `piped` in the
    /// pipe and not yet moved.
    Splice {
        ptr: *const u8,
        len: usize,
        done: usize,
        piped: usize,
    },
}

/// One request (or a submitter's leftover bytes) being sent.
pub(super) struct Out {
    /// A WRITE's sequence number: reported sent ([`ClientStream::sent`]) once all of it went.
    ///
    /// [`ClientStream::sent`]: ferry_core::stream::ClientStream::sent
    pub(super) write_seq: Option<u32>,
    /// Copied bytes, back to back; `done` of them went.
    pub(super) parts: Vec<(*const u8, usize)>,
    pub(super) done: usize,
    pub(super) total: usize,
    pub(super) body: Body,
    pub(super) _keep: Keep,
}

/// A response's payload being received.
pub(super) enum Incoming {
    /// A READ's (or a checksum's) payload, into its chunk's memory.
    One {
        chunk: Chunk<Executing>,
        part: (*const u8, usize),
        done: usize,
    },
    /// A vectored READ's payload, into its pieces' memory in order.
    Pieces {
        pieces: Vec<Chunk<Executing>>,
        parts: Vec<(*const u8, usize)>,
        total: usize,
        done: usize,
    },
}

impl Incoming {
    pub(super) fn parts(&self) -> (&[(*const u8, usize)], usize, usize) {
        match self {
            Incoming::One { part, done, .. } => (std::slice::from_ref(part), part.1, *done),
            Incoming::Pieces {
                parts, total, done, ..
            } => (parts, *total, *done),
        }
    }

    pub(super) fn advance(&mut self, n: usize) {
        match self {
            Incoming::One { done, .. } | Incoming::Pieces { done, .. } => *done += n,
        }
    }

    pub(super) fn acked(self) {
        match self {
            Incoming::One { chunk, .. } => chunk.acked(),
            Incoming::Pieces { pieces, .. } => pieces.into_iter().for_each(Chunk::acked),
        }
    }

    pub(super) fn lost(self, native: Option<i32>) {
        match self {
            Incoming::One { chunk, .. } => chunk.lost(native),
            Incoming::Pieces { pieces, .. } => pieces.into_iter().for_each(|c| c.lost(native)),
        }
    }
}

/// Which send-side operation is in flight.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum SendOp {
    Copy,
    Zc,
    /// A poll for room in the socket (a splice that found it full).
    Room,
}

/// One client stream on a ring. Boxed: the ring's operations point into it.
pub(super) struct Conn {
    pub(super) id: u64,
    pub(super) sh: Arc<StreamShared>,
    pub(super) queue: Arc<Queue>,
    pub(super) index: usize,
    pub(super) peer: SocketAddr,
    pub(super) fd: RawFd,
    /// Its fixed-file slot, if registered (as its ring host says at each turn).
    pub(super) fixed: Option<u32>,
    pub(super) zero_copy: bool,
    pub(super) splice: bool,
    /// See `NewStream::caller_receives`: while the stream is idle (or a direct reader reads)
    /// the ring keeps only a hang-up poll armed, no receive, and the response header's bytes
    /// live in the shared state (`resp`), `head` being only where a ring receive lands.
    pub(super) caller_receives: bool,
    /// The hang-up poll is in flight.
    pub(super) hangup_inflight: bool,
    /// The socket's file status flags (for the non-blocking splice).
    pub(super) fl: i32,
    /// The channel still deals jobs.
    pub(super) open: bool,
    /// The response header being received (`head_at` bytes of it).
    pub(super) head: [u8; DATA_RESPONSE_LEN],
    pub(super) head_at: usize,
    pub(super) incoming: Option<Incoming>,
    pub(super) recv_inflight: bool,
    /// The socket's `SO_RCVLOWAT` as last set (1: the kernel's default); 0: refused, none used.
    pub(super) lowat: usize,
    pub(super) riov: Vec<libc::iovec>,
    pub(super) rmsg: libc::msghdr,
    pub(super) out: Option<Out>,
    pub(super) send_inflight: Option<SendOp>,
    pub(super) siov: Vec<libc::iovec>,
    pub(super) smsg: libc::msghdr,
    /// Pipe for spliced sends (read end, write end, capacity), made on first use.
    pub(super) pipe: Option<(OwnedFd, OwnedFd, usize)>,
    pub(super) stats: Arc<IoStats>,
}

/// The ring operation `$op` on stream `$c`'s socket: its fixed-file slot where it has one, its
/// descriptor otherwise.
macro_rules! on_fd {
    ($c:expr, $op:ident :: new ( $($arg:expr),* ) $(. $m:ident ( $($a:expr),* ))* ) => {
        match $c.fixed {
            Some(slot) => io_uring::opcode::$op::new(io_uring::types::Fixed(slot), $($arg),*) $(. $m($($a),*))* .build(),
            None => io_uring::opcode::$op::new(io_uring::types::Fd($c.fd), $($arg),*) $(. $m($($a),*))* .build(),
        }
    };
}
pub(super) use on_fd;

/// Sets the socket's `SO_RCVLOWAT` to `v`. If the kernel refuses, marks are not used on this
/// socket again (`lowat` 0), and a raised one is brought back to 1 first.
pub(super) fn set_lowat(c: &mut Conn, v: usize) -> io::Result<()> {
    if c.lowat == v {
        return Ok(());
    }
    // SAFETY: the descriptor of the stream's socket, which `c` keeps open.
    let fd = unsafe { std::os::fd::BorrowedFd::borrow_raw(c.fd) };
    match ferry_net::set_recv_low_mark(fd, v) {
        Ok(()) => {
            c.lowat = v;
            Ok(())
        }
        Err(e) => {
            debug!(error = %e, "SO_RCVLOWAT refused; receiving without it");
            if c.lowat > 1 {
                // Still raised: a header would wait for the old mark.
                ferry_net::set_recv_low_mark(fd, 1).map_err(|e2| {
                    io::Error::new(
                        e2.kind(),
                        format!("cannot lower the socket's SO_RCVLOWAT back to 1: {e2}"),
                    )
                })?;
            }
            c.lowat = 0;
            Err(e)
        }
    }
}
