//! A served data stream as a ring host runs it ([`Stream`] for [`Conn`]): its turn (the queue of
//! steps, each within the turn's budget), its operations' completions, and its end. Its kinds of
//! ring operation are [`Op`]; a file piece of a [`FileSegment`](ferry_file::FileSegment) is one of
//! them (a positioned read or write on the segment's descriptor), so a stream serving a file never
//! stops the ring's others.

use std::collections::VecDeque;
use std::io;
use std::net::{SocketAddr, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use ferry_core::stream::{ServerStream, checksum_response};
use ferry_core::wire::DATA_REQUEST_LEN;
use ferry_core::{SegmentLease, SegmentToken};
use io_uring::{opcode, types};
use tracing::debug;

use super::conn::{Armed, Conn, Step, total};
use super::files::{FileIo, Stage};
use super::plan::plan;
use super::shared::{Ctx, lock};
use super::sockio::{direct, head_now, low_mark, mark_one, on_complete, sock_op};
use crate::ring::IoStats;
use crate::ring::host::{Io, OpKind, Stream, Turn};

/// A server stream's kinds of ring operation: its front step's socket operation, a header
/// receive armed beside a send, a zero-copy send's completion, a file piece.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Op {
    Step = 1,
    Armed = 2,
    ZcSent = 3,
    File = 4,
}

/// What one stream may do in a ring turn before every other runnable stream had its turn:
/// steps worth this many bytes (sends and receives done at once, file pieces), each step
/// counted as at least [`STEP_COST`] (so that many small ones, a pipeline of requests whose
/// bytes are all there, are bounded too).
const TURN_BUDGET: usize = 2 << 20;
/// The least a step costs of [`TURN_BUDGET`].
const STEP_COST: usize = 64 << 10;

/// The bytes a step moves on the ring's thread, as [`TURN_BUDGET`] counts them.
fn step_bytes(step: &Step) -> usize {
    match step {
        Step::Send { parts, done, .. } | Step::Recv { parts, done, .. } => {
            total(parts).saturating_sub(*done)
        }
        Step::FileRead { len, .. } | Step::FileWrite { len, .. } => *len,
        _ => 0,
    }
}

impl OpKind for Op {
    fn kind(self) -> u8 {
        self as u8
    }

    fn of(kind: u8) -> Option<Self> {
        [Op::Step, Op::Armed, Op::ZcSent, Op::File]
            .into_iter()
            .find(|op| *op as u8 == kind)
    }
}

impl Conn {
    /// A stream from `from` handed over (its socket in the server's live connections, under
    /// `live_id`, so a shutdown reaches it): its first step sends `accept`, the attach's answer.
    pub(super) fn new(
        ctx: Arc<Ctx>,
        from: SocketAddr,
        proto: ServerStream,
        accept: Vec<u8>,
        stream: Arc<TcpStream>,
        live_id: u64,
    ) -> Self {
        let mut steps = VecDeque::new();
        steps.push_back(Step::send_owned(accept));
        Conn {
            zero_copy: ctx.config.zero_copy_for(from.ip()),
            ctx,
            stream,
            from,
            live_id,
            fixed: None,
            proto,
            steps,
            inflight: false,
            armed: None,
            lowat: 1,
            head: [0; DATA_REQUEST_LEN],
            head_got: 0,
            ready: false,
            stage: Stage { region: None },
            iov: Vec::new(),
            // SAFETY: a zeroed msghdr is valid (no name, no iovecs, no control).
            msg: unsafe { std::mem::zeroed() },
        }
    }
}

impl Stream for Conn {
    type Op = Op;
    type Hold = SegmentLease;
    type Error = io::Error;
    const ZC_SENT: Op = Op::ZcSent;

    fn socket(&self) -> &Arc<TcpStream> {
        &self.stream
    }

    fn advance(&mut self, io: &mut Io<'_, SegmentLease>) -> Turn<io::Error> {
        self.fixed = io.fixed();
        advance(self, io)
    }

    fn complete(&mut self, op: Op, res: i32, _flags: u32) -> io::Result<()> {
        match op {
            Op::Armed => {
                if let Some(a) = self.armed.as_mut()
                    && a.res.is_none()
                {
                    a.res = Some(res);
                }
                Ok(())
            }
            Op::Step | Op::ZcSent | Op::File => {
                if !self.inflight {
                    return Ok(());
                }
                self.inflight = false;
                on_complete(self, res)
            }
        }
    }

    fn end(self: Box<Self>, why: Option<io::Error>) {
        if let Some(e) = why {
            debug!(from = %self.from, error = %e, "connection ended");
        }
        lock(&self.ctx.live.conns).remove(&self.live_id);
    }
}

/// Runs stream `c`'s steps until one waits for the ring.
fn advance(c: &mut Conn, io: &mut Io<'_, SegmentLease>) -> Turn<io::Error> {
    if c.inflight {
        return Turn::Wait;
    }
    if c.ctx.live.stopped.load(Ordering::Acquire) {
        return Turn::End(None);
    }
    let mut spent = 0usize;
    loop {
        if spent >= TURN_BUDGET {
            // The others' turn: this stream goes on at the next.
            return Turn::Yield;
        }
        spent += c.steps.front().map_or(0, step_bytes).max(STEP_COST);
        let Some(step) = c.steps.front_mut() else {
            if let Some(turn) = next_request(c) {
                return turn;
            }
            continue;
        };
        let r = match step {
            Step::SendZc {
                head,
                head_done,
                lease,
                at,
                len,
                done,
            } if *head_done >= head.len() => {
                if *done >= *len {
                    c.steps.pop_front();
                    continue;
                }
                let ptr = (lease.region.as_ptr() as usize + *at as usize + *done) as *const u8;
                let n = (*len - *done).min(u32::MAX as usize & !4095) as u32;
                let index = io.buf_index(&lease.region);
                let flags = libc::MSG_WAITALL | libc::MSG_NOSIGNAL;
                let e = match c.fixed {
                    Some(slot) => opcode::SendZc::new(types::Fixed(slot), ptr, n),
                    None => opcode::SendZc::new(types::Fd(c.stream.as_raw_fd()), ptr, n),
                }
                .buf_index(index)
                .flags(flags)
                .build();
                IoStats::add(&c.ctx.stats.zc_sends, 1);
                if index.is_some() {
                    IoStats::add(&c.ctx.stats.fixed_sends, 1);
                }
                let hold = lease.clone();
                // SAFETY: the range was checked against the region by the stream protocol;
                // the lease the host holds keeps the region alive (and its registration in
                // use) until the kernel's notification that it let go of the pages.
                if let Err(err) = unsafe { io.push_zc(e, hold) } {
                    return Turn::End(Some(err));
                }
                c.inflight = true;
                return Turn::Wait;
            }
            Step::SendZc { .. }
            | Step::Send { .. }
            | Step::Recv { .. }
            | Step::Discard { .. }
            | Step::Head { .. }
            | Step::Table { .. } => {
                if matches!(step, Step::Send { .. } | Step::Recv { .. }) {
                    // What the socket takes (or holds) now moves with one plain syscall,
                    // no ring round trip; the ring waits only for the rest.
                    match direct(c) {
                        Ok(true) => {
                            c.steps.pop_front();
                            continue;
                        }
                        Ok(false) => {}
                        Err(e) => return Turn::End(Some(e)),
                    }
                }
                return submit_sock(io, c);
            }
            Step::FileRead { .. } | Step::FileWrite { .. } => match file_op(c, io) {
                Ok(true) => return Turn::Wait,
                Ok(false) => Ok(()),
                Err(e) => Err(e),
            },
            Step::Answer {
                lease,
                token,
                seq,
                ack_slack,
            } => {
                let (lease, token, seq, ack_slack) = (lease.clone(), *token, *seq, *ack_slack);
                c.steps.pop_front();
                answer(c, &lease, token, seq, ack_slack);
                continue;
            }
            Step::Crc { sum, seq, .. } => match sum.step() {
                Some(crc) => {
                    let seq = *seq;
                    c.steps.pop_front();
                    c.steps
                        .push_front(Step::send_owned(checksum_response(seq, crc).to_vec()));
                    continue;
                }
                None => return Turn::Yield,
            },
            Step::CrcFile { sum, seq } => match sum.step() {
                Ok(Some(crc)) => {
                    let seq = *seq;
                    c.steps.pop_front();
                    c.steps
                        .push_front(Step::send_owned(checksum_response(seq, crc).to_vec()));
                    continue;
                }
                Ok(None) => return Turn::Yield,
                Err(e) => Err(e),
            },
            Step::Close => return Turn::End(None),
        };
        if let Err(e) = r {
            return Turn::End(Some(e));
        }
        c.steps.pop_front();
    }
}

/// The front step of `c`, a file piece: a [`FileSegment`](ferry_file::FileSegment)'s goes to the
/// ring as a positioned read or write on the segment's descriptor (`true`: it is in flight, its
/// completion counts its bytes), any other source's is done here (`false`: done).
fn file_op(c: &mut Conn, io: &mut Io<'_, SegmentLease>) -> io::Result<bool> {
    let (write, file, at, len, done, stage) = match c.steps.front() {
        Some(Step::FileRead {
            file,
            at,
            len,
            done,
            stage,
        }) => (false, file, *at, *len, *done, stage),
        Some(Step::FileWrite {
            file,
            at,
            len,
            done,
            stage,
        }) => (true, file, *at, *len, *done, stage),
        _ => return Err(io::Error::other("a file op without a file step")),
    };
    let FileIo::Segment(seg) = &**file else {
        if write {
            file.write_piece(stage, len, at)?;
        } else {
            file.read_piece(stage, len, at)?;
        }
        return Ok(false);
    };
    let rest = len - done;
    // SAFETY: `done < len <= stage.len()`: inside the staging region.
    let p = unsafe { stage.as_ptr().add(done) };
    let pos = at + done as u64;
    let ask = rest.min(1 << 30) as u32;
    let e = if write {
        opcode::Write::new(types::Fd(seg.write_fd().as_raw_fd()), p, ask)
            .offset(pos)
            .build()
    } else {
        let (fd, _direct) = seg.read_fd(pos, rest as u64, p as usize);
        opcode::Read::new(types::Fd(fd.as_raw_fd()), p, ask)
            .offset(pos)
            .build()
    };
    // SAFETY: the step holds the staging region and the segment (so its descriptors) until the
    // completion was handed back (it is popped only then), and nothing else of this stream uses
    // the region meanwhile (its steps run in order, one operation in flight).
    unsafe { io.push(Op::File, e) }?;
    c.inflight = true;
    Ok(true)
}

/// `c` has no step queued: plans the request whose header is in, takes the header's armed
/// receive as its own step, or queues the header's receive (then the stream is idle and gives
/// its file staging back). `Some`: the turn ends so.
fn next_request(c: &mut Conn) -> Option<Turn<io::Error>> {
    if !c.ready && c.armed.as_ref().is_none_or(|a| a.res.is_none()) {
        c.stage.release();
    }
    if c.ready {
        c.ready = false;
        let head = c.head;
        let ctx = c.ctx.clone();
        plan(c, &ctx, &head);
    } else if let Some(a) = c.armed.take() {
        // The header's receive went with the last send: take it as its own.
        let Some(res) = a.res else {
            c.armed = Some(a);
            return Some(Turn::Wait);
        };
        c.steps.push_back(Step::Head { buf: a.buf, got: 0 });
        if let Err(e) = on_complete(c, res) {
            return Some(Turn::End(Some(e)));
        }
    } else {
        c.steps.push_back(Step::head());
    }
    None
}

/// Submits the ring operation of `c`'s front step (a send or receive the socket did not finish
/// at once); a request's last send also arms the next header's receive.
fn submit_sock(io: &mut Io<'_, SegmentLease>, c: &mut Conn) -> Turn<io::Error> {
    low_mark(c);
    let Some(e) = sock_op(c) else {
        return Turn::End(Some(io::Error::other("a socket step with no bytes")));
    };
    let last_send = c.steps.len() == 1
        && matches!(c.steps.front(), Some(Step::Send { .. }))
        && !c.ready
        && c.armed.is_none();
    // SAFETY: the entry points into the boxed `Conn` (iovecs, message, the next header's buffer)
    // and at memory its front step keeps alive (`Keep`, owned buffers); the step is popped, and
    // the `Conn` freed, only after the completion was handed back (the host frees no stream
    // with an operation in flight).
    if let Err(err) = unsafe { io.push(Op::Step, e) } {
        // Not queued (the ring refused a submit): nothing is in flight.
        return Turn::End(Some(err));
    }
    c.inflight = true;
    // The header's receive needs the low mark at 1 (a 32-byte header must wake the ring); where
    // it cannot be had, the header is received after the send.
    if last_send && mark_one(c) {
        // Nothing else is received on this stream until the header is in.
        let mut buf = Box::new([0u8; DATA_REQUEST_LEN]);
        let flags = libc::MSG_WAITALL | libc::MSG_NOSIGNAL;
        let e = match c.fixed {
            Some(slot) => opcode::Recv::new(
                types::Fixed(slot),
                buf.as_mut_ptr(),
                DATA_REQUEST_LEN as u32,
            )
            .flags(flags)
            .build(),
            None => opcode::Recv::new(
                types::Fd(c.stream.as_raw_fd()),
                buf.as_mut_ptr(),
                DATA_REQUEST_LEN as u32,
            )
            .flags(flags)
            .build(),
        };
        // SAFETY: the buffer is boxed in `c.armed` (set before the completion can be handed
        // back, on this thread), which is kept until it completes.
        if unsafe { io.push(Op::Armed, e) }.is_ok() {
            c.armed = Some(Armed { buf, res: None });
        }
    }
    Turn::Wait
}

/// An accepted WRITE's payload is in (its `Answer` step taken off the queue): holds the answer
/// back for the next request where the protocol may and that request's header is here, or queues
/// it next.
fn answer(c: &mut Conn, lease: &SegmentLease, token: SegmentToken, seq: u32, ack_slack: u16) {
    let may_hold = c.proto.may_hold(ack_slack);
    // The next header, where part of it came with the payload or a held answer could use it: the
    // rest of it if the socket has it now.
    if (c.head_got > 0 || may_hold) && head_now(c) {
        c.head_got = 0;
        c.ready = true;
        if may_hold && c.proto.hold_for_next(lease, token, seq, &c.head) {
            IoStats::add(&c.ctx.stats.held_responses, 1);
            return;
        }
    }
    let answer = c.proto.answer_write(seq);
    c.steps.push_front(Step::send_owned(answer.to_vec()));
    if c.head_got > 0 {
        // Part of the next header is in: the rest is received after the answer (the payload was
        // the request's last step, nothing else is queued).
        c.steps.push_back(Step::Head {
            buf: Box::new(c.head),
            got: c.head_got,
        });
        c.head_got = 0;
    }
}

#[cfg(test)]
mod tests {
    use std::io::Read;
    use std::net::{TcpListener, TcpStream};
    use std::sync::Arc;
    use std::time::Duration;

    use ferry_core::stream::ServerStream;

    use super::{Op, STEP_COST, Step, TURN_BUDGET};
    use crate::config::UringConfig;
    use crate::ring::IoStats;
    use crate::ring::host::Host;
    use crate::ring::inbox::Inbox;
    use crate::ring::kernel::{RingSize, Uring};
    use crate::server::conn::Conn;
    use crate::server::shared::{Ctx, Live};
    use crate::testing::NoSegments;

    /// A connected loopback pair: (the ring's end, the peer's).
    fn pair() -> (TcpStream, TcpStream) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let peer = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (ours, _) = l.accept().unwrap();
        (ours, peer)
    }

    /// A stream with many steps that all complete at once (small sends the socket takes) has
    /// them spread over several turns: the stream after it is served in the first.
    #[test]
    fn one_stream_cannot_take_a_whole_turn() {
        if io_uring::IoUring::new(4).is_err() {
            ferry_tests::require_or_skip(ferry_tests::URING, "the kernel refuses io_uring rings");
            return;
        }
        let table = Arc::new(NoSegments);
        let ctx = Arc::new(Ctx {
            config: UringConfig::default(),
            stats: Arc::new(IoStats::default()),
            live: Arc::new(Live::default()),
        });
        let inbox: Inbox<()> = Inbox::new().unwrap();
        let size = RingSize {
            sq: 64,
            cq: 256,
            files: 4,
        };
        let ring = Uring::new(size, true, false).unwrap();
        let mut h: Host<Conn, Uring> = Host::new(ring, inbox.fd.clone(), ctx.stats.clone());
        let mut peers = Vec::new();
        for k in 0..2 {
            let (ours, peer) = pair();
            let from = peer.local_addr().unwrap();
            let proto = ServerStream::new(table.clone());
            let c = Conn::new(ctx.clone(), from, proto, b"A".to_vec(), Arc::new(ours), k);
            assert_eq!(h.add(Box::new(c)).ok(), Some(k as usize));
            peers.push(peer);
        }
        // Stream 0: twice its turn's budget of small sends, all of which the socket takes.
        let sends = 2 * TURN_BUDGET / STEP_COST;
        let piece = 1024;
        for k in 0..sends {
            let c = h.stream_mut(0).unwrap();
            c.steps.push_back(Step::send_owned(vec![k as u8; piece]));
        }
        let tick = Some(Duration::from_millis(10));
        h.turn(&inbox, tick).unwrap();
        let queued = |h: &mut Host<Conn, Uring>, i: usize| {
            h.stream_mut(i)
                .unwrap()
                .steps
                .iter()
                .filter(|s| matches!(s, Step::Send { .. }))
                .count()
        };
        assert!(
            queued(&mut h, 0) > 0,
            "stream 0 sent all its {sends} sends in one turn"
        );
        assert_eq!(
            queued(&mut h, 1),
            0,
            "stream 1 was not served in the first turn"
        );
        // The rest goes in later turns, in order.
        for _ in 0..sends {
            if queued(&mut h, 0) == 0 {
                break;
            }
            h.turn(&inbox, tick).unwrap();
        }
        assert_eq!(queued(&mut h, 0), 0, "stream 0's sends never finished");
        let mut got = vec![0u8; 1 + sends * piece];
        peers[0].read_exact(&mut got).unwrap();
        assert_eq!(got[0], b'A');
        for (k, chunk) in got[1..].chunks(piece).enumerate() {
            assert!(chunk.iter().all(|&b| b == k as u8), "send {k} out of order");
        }
        let mut accept = [0u8; 1];
        peers[1].read_exact(&mut accept).unwrap();
        assert_eq!(&accept, b"A");
        h.shutdown();
    }

    /// A stream reading a file segment puts the piece on the ring as an operation and waits
    /// for its completion; the ring's other stream is served in the same turn, while the piece
    /// is still in flight (a file piece stops no other stream).
    #[test]
    fn a_file_piece_is_a_ring_operation_and_the_other_streams_run_meanwhile() {
        use crate::ring::fake::Fake;
        use crate::ring::user_data::{self, Decoded};
        use crate::server::files::{FILE_PIECE, FileIo};
        use ferry_core::{Access, MemoryRegion};

        let table = Arc::new(NoSegments);
        let ctx = Arc::new(Ctx {
            config: UringConfig::default(),
            stats: Arc::new(IoStats::default()),
            live: Arc::new(Live::default()),
        });
        let inbox: Inbox<()> = Inbox::new().unwrap();
        let mut h: Host<Conn, Fake> =
            Host::new(Fake::default(), inbox.fd.clone(), ctx.stats.clone());
        let path = std::env::temp_dir().join(format!("ferry-file-piece-{}", std::process::id()));
        std::fs::write(&path, vec![7u8; FILE_PIECE]).unwrap();
        let seg = ferry_file::FileSegment::open(&path, Access::REMOTE_READ).unwrap();
        let _ = std::fs::remove_file(&path);
        let stage = Arc::new(MemoryRegion::alloc_zeroed(FILE_PIECE, 4096).unwrap());
        let mut peers = Vec::new();
        for k in 0..2 {
            let (ours, peer) = pair();
            let from = peer.local_addr().unwrap();
            let proto = ServerStream::new(table.clone());
            let c = Conn::new(ctx.clone(), from, proto, b"A".to_vec(), Arc::new(ours), k);
            h.add(Box::new(c)).ok().unwrap();
            peers.push(peer);
        }
        h.stream_mut(0).unwrap().steps.push_back(Step::FileRead {
            file: Arc::new(FileIo::Segment(Arc::new(seg))),
            at: 0,
            len: FILE_PIECE,
            done: 0,
            stage: stage.clone(),
        });
        h.stream_mut(1)
            .unwrap()
            .steps
            .push_back(Step::send_owned(b"memory".to_vec()));
        h.turn(&inbox, None).unwrap();
        let file_ops: Vec<u64> = h
            .ring()
            .ops()
            .into_iter()
            .filter(|&u| {
                matches!(user_data::decode(u), Decoded::Op { kind, slot: 0, .. } if kind == Op::File as u8)
            })
            .collect();
        assert_eq!(
            file_ops.len(),
            1,
            "the file piece did not go to the ring as an operation"
        );
        assert!(
            matches!(
                h.stream_mut(0).unwrap().steps.front(),
                Some(Step::FileRead { done: 0, .. })
            ),
            "the file piece is not waiting for its completion"
        );
        let mut got = [0u8; 7];
        peers[1].read_exact(&mut got).unwrap();
        assert_eq!(
            &got, b"Amemory",
            "the other stream was not served meanwhile"
        );
        // Its completion counts its bytes and the stream goes on.
        h.ring().complete(file_ops[0], FILE_PIECE as i32, 0);
        h.turn(&inbox, None).unwrap();
        assert!(
            !h.stream_mut(0)
                .unwrap()
                .steps
                .iter()
                .any(|s| matches!(s, Step::FileRead { .. })),
            "a completed file piece stayed queued"
        );
        h.ring().cancel_on_wait = true;
        h.shutdown();
    }
}
