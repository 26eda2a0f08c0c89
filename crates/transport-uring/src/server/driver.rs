//! One server ring's thread: its streams' turns, the ring's submissions and completions, and
//! the end of each stream and of the ring.

use std::collections::{HashMap, VecDeque};
use std::io;
use std::net::{SocketAddr, TcpStream};
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, mpsc};

use ferry_core::stream::{ServerStream, checksum_response};
use ferry_core::wire::DATA_REQUEST_LEN;
use ferry_core::{SegmentLease, SegmentToken};
use io_uring::{IoUring, cqueue, opcode, types};
use tracing::{debug, warn};

use super::conn::{Armed, Conn, Step, total};
use super::files::Stage;
use super::plan::plan;
use super::shared::{Ctx, lock, wake};
use super::sockio::{direct, head_now, low_mark, mark_one, on_complete, sock_op};
use crate::file_ring::FileRing;
use crate::ring::user_data::{self, Decoded};
use crate::ring::{BufCache, IoStats, ThreadCount, new_ring, push, submit};

/// Submission entries per ring (more are submitted in several calls).
const SQ_ENTRIES: u32 = 1024;
/// Completion entries per ring (the kernel keeps an overflow beyond them).
const CQ_ENTRIES: u32 = 8192;
/// Fixed-file slots per ring: streams past them use their plain descriptor.
const FIXED_FILES: u32 = 1 << 14;
/// Kinds of operations in their user data (`ring::user_data`): a stream's socket operation
/// (its front step's), a header receive armed beside a send, the wake eventfd's read, a no-op
/// that ends a wait at once.
const K_STEP: u8 = 1;
const K_ARMED: u8 = 2;
const K_WAKE: u8 = 3;
const K_NOP: u8 = 4;

/// A stream handed from the accept thread to a ring.
pub(super) struct NewStream {
    pub(super) stream: TcpStream,
    pub(super) from: SocketAddr,
    pub(super) proto: ServerStream,
    /// The encoded `StreamAccept`, the stream's first bytes.
    pub(super) accept: Vec<u8>,
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

/// What a stream's turn ended with.
enum Turn {
    /// An operation is in flight (or the stream waits for its next turn).
    Wait,
    /// Run it again next turn (a checksum piece done, its turn's budget spent).
    Yield,
    /// The stream is over (cleanly or not).
    End(io::Result<()>),
}

/// One ring and its thread's streams.
pub(super) struct Driver {
    ctx: Arc<Ctx>,
    ring: IoUring,
    rx: mpsc::Receiver<NewStream>,
    wake: Arc<OwnedFd>,
    wake_buf: Box<[u8; 8]>,
    wake_armed: bool,
    fixed_files: bool,
    conns: Vec<Option<Box<Conn>>>,
    generations: Vec<u32>,
    free: Vec<usize>,
    runnable: VecDeque<usize>,
    file_ring: FileRing,
    /// Registered buffers for zero-copy sends.
    bufs: BufCache,
    /// Zero-copy sends not yet let go by the kernel, by key: the stream and generation that
    /// sent it (for its completion) and the lease that keeps its buffer alive (until its
    /// notification).
    zc: HashMap<u64, (usize, u32, SegmentLease)>,
    zc_next: u64,
    /// This ring's place and the set's pin flag (`RingSet::pin`), until it pinned itself.
    pin: Option<(usize, Arc<AtomicBool>)>,
    _count: ThreadCount,
}

impl Driver {
    pub(super) fn new(
        ctx: Arc<Ctx>,
        rx: mpsc::Receiver<NewStream>,
        wake: Arc<OwnedFd>,
        pin: Option<(usize, Arc<AtomicBool>)>,
    ) -> io::Result<Self> {
        // Made and entered only by the ring's thread (no deferred task work runs while it is in
        // another system call, a splice say).
        let ring = new_ring(SQ_ENTRIES, CQ_ENTRIES)?;
        let fixed_files = ctx.config.register_buffers
            && ring.submitter().register_files_sparse(FIXED_FILES).is_ok();
        let count = ThreadCount::new(&ctx.stats);
        let bufs = BufCache::new(
            &ring,
            ctx.config.register_buffers && ctx.config.zero_copy_enabled(),
        );
        Ok(Self {
            ctx,
            ring,
            rx,
            wake,
            wake_buf: Box::new([0; 8]),
            wake_armed: false,
            fixed_files,
            conns: Vec::new(),
            generations: Vec::new(),
            free: Vec::new(),
            runnable: VecDeque::new(),
            file_ring: FileRing::default(),
            bufs,
            zc: HashMap::new(),
            zc_next: 0,
            pin,
            _count: count,
        })
    }

    fn stopped(&self) -> bool {
        self.ctx.live.stopped.load(Ordering::Acquire)
    }

    pub(super) fn run(&mut self) {
        let res = self.turns();
        if let Err(e) = &res {
            warn!(error = %e, "a server ring failed; its streams are left to the kernel");
        }
        // Every stream's socket is shut down; wait for the operations in flight (the shutdown
        // ends them) before their memory goes.
        for c in self.conns.iter().flatten() {
            let _ = c.stream.shutdown(std::net::Shutdown::Both);
        }
        let grace = std::time::Instant::now() + crate::config::FINISH_GRACE;
        if res.is_ok() {
            while self.conns.iter().flatten().any(|c| c.busy())
                || self.wake_armed
                || (!self.zc.is_empty() && std::time::Instant::now() < grace)
            {
                if self.wake_armed {
                    wake(&self.wake);
                }
                let r = if self.conns.iter().flatten().any(|c| c.busy()) || self.wake_armed {
                    submit(&mut self.ring, true)
                } else {
                    // Only notifications are awaited: poll, the grace bounds it.
                    std::thread::sleep(std::time::Duration::from_millis(1));
                    submit(&mut self.ring, false)
                };
                if r.is_err() {
                    break;
                }
                self.reap();
            }
        }
        // Zero-copy sends the kernel did not let go of (the peer never acknowledged them):
        // their buffers stay alive for good.
        std::mem::forget(std::mem::take(&mut self.zc));
        let still = self.conns.iter().flatten().any(|c| c.busy()) || self.wake_armed;
        for i in 0..self.conns.len() {
            if self.conns[i].as_ref().is_some_and(|c| !c.busy()) {
                self.end(i, Ok(()));
            }
        }
        if still {
            // The kernel may still write into them: never free them.
            std::mem::forget(std::mem::take(&mut self.conns));
            std::mem::forget(std::mem::take(&mut self.wake_buf));
        }
    }

    fn turns(&mut self) -> io::Result<()> {
        loop {
            if self.stopped() {
                return Ok(());
            }
            if let Some((i, flag)) = &self.pin
                && flag.load(Ordering::Acquire)
            {
                // One ring per core: ring `i` on the `i`-th CPU, where a loopback client's
                // stream `i` runs too (see `RingSet::hand`).
                crate::tune::pin_stream_thread(*i);
                self.pin = None;
            }
            while let Ok(n) = self.rx.try_recv() {
                self.add(n);
            }
            if !self.wake_armed {
                let e = opcode::Read::new(
                    types::Fd(self.wake.as_raw_fd()),
                    self.wake_buf.as_mut_ptr(),
                    8,
                )
                .build()
                .user_data(user_data::op(K_WAKE, 0, 0));
                // SAFETY: the buffer is boxed in the driver, which outlives the read (`run`
                // waits for it, or leaks the buffer).
                unsafe { push(&mut self.ring, &e) }?;
                self.wake_armed = true;
            }
            self.run_streams()?;
            submit(&mut self.ring, true)?;
            self.reap();
        }
    }

    /// Gives every runnable stream its turn, each within [`TURN_BUDGET`]: one that has more to
    /// do runs again at the next turn.
    fn run_streams(&mut self) -> io::Result<()> {
        let mut yielded = Vec::new();
        while let Some(i) = self.runnable.pop_front() {
            match self.advance(i) {
                Turn::Wait => {}
                Turn::Yield => yielded.push(i),
                Turn::End(r) => self.end(i, r),
            }
        }
        if !yielded.is_empty() {
            // A stream has more to do (a checksum, its budget spent): do not sleep, but still
            // run the ring's deferred task work (other streams' receives), which only a wait
            // runs; a no-op completes at once and ends the wait.
            let nop = opcode::Nop::new()
                .build()
                .user_data(user_data::op(K_NOP, 0, 0));
            // SAFETY: a no-op carries no buffer.
            unsafe { push(&mut self.ring, &nop) }?;
        }
        self.runnable.extend(yielded);
        Ok(())
    }

    fn reap(&mut self) {
        let done: Vec<(u64, i32, u32)> = self
            .ring
            .completion()
            .map(|c| (c.user_data(), c.result(), c.flags()))
            .collect();
        for (u, res, flags) in done {
            let (armed, i, g) = match user_data::decode(u) {
                Decoded::Op { kind: K_WAKE, .. } => {
                    self.wake_armed = false;
                    continue;
                }
                Decoded::Op {
                    kind: kind @ (K_STEP | K_ARMED),
                    slot,
                    generation,
                } => (kind == K_ARMED, slot, generation),
                Decoded::Op { .. } => continue,
                Decoded::Zc(key) => {
                    if cqueue::notif(flags) {
                        IoStats::add(&self.ctx.stats.notifications, 1);
                        self.zc.remove(&key);
                        continue;
                    }
                    let Some(&(i, g, _)) = self.zc.get(&key) else {
                        continue;
                    };
                    if !cqueue::more(flags) {
                        // No notification will come for this one.
                        self.zc.remove(&key);
                    }
                    (false, i, g)
                }
            };
            let Some(Some(c)) = self.conns.get_mut(i) else {
                continue;
            };
            if c.generation != g {
                continue;
            }
            let r = if armed {
                match c.armed.as_mut() {
                    Some(a) if a.res.is_none() => a.res = Some(res),
                    _ => continue,
                }
                Ok(())
            } else {
                if !c.inflight {
                    continue;
                }
                c.inflight = false;
                if c.dead { Ok(()) } else { on_complete(c, res) }
            };
            if c.dead {
                if !c.busy() {
                    self.end(i, Ok(()));
                }
                continue;
            }
            match r {
                Ok(()) => self.runnable.push_back(i),
                Err(e) => self.end(i, Err(e)),
            }
        }
    }

    fn add(&mut self, n: NewStream) {
        if self.free.is_empty() && self.conns.len() >= user_data::MAX_SLOTS {
            // Its operations could not be named: closed (dropped) instead.
            warn!(from = %n.from, "a server ring serves as many streams as it can name; stream closed");
            return;
        }
        let stream = Arc::new(n.stream);
        let live_id = self.ctx.live.next.fetch_add(1, Ordering::Relaxed);
        lock(&self.ctx.live.conns).insert(live_id, stream.clone());
        if self.stopped() {
            let _ = stream.shutdown(std::net::Shutdown::Both);
        }
        let i = match self.free.pop() {
            Some(i) => i,
            None => {
                self.conns.push(None);
                self.generations.push(0);
                self.conns.len() - 1
            }
        };
        self.generations[i] = user_data::next_generation(self.generations[i]);
        let fixed = (self.fixed_files && i < FIXED_FILES as usize)
            .then(|| {
                self.ring
                    .submitter()
                    .register_files_update(i as u32, &[stream.as_raw_fd()])
                    .ok()
                    .map(|_| i as u32)
            })
            .flatten();
        let mut steps = VecDeque::new();
        steps.push_back(Step::send_owned(n.accept));
        self.conns[i] = Some(Box::new(Conn {
            stream,
            from: n.from,
            live_id,
            fixed,
            proto: n.proto,
            steps,
            inflight: false,
            armed: None,
            dead: false,
            zero_copy: self.ctx.config.zero_copy_for(n.from.ip()),
            lowat: 1,
            head: [0; DATA_REQUEST_LEN],
            head_got: 0,
            ready: false,
            stage: Stage { region: None },
            iov: Vec::new(),
            // SAFETY: a zeroed msghdr is valid (no name, no iovecs, no control).
            msg: unsafe { std::mem::zeroed() },
            generation: self.generations[i],
        }));
        self.runnable.push_back(i);
    }

    /// Ends stream `i`: at once, or once the kernel is done with its operations in flight
    /// (the socket's shutdown ends them).
    fn end(&mut self, i: usize, res: io::Result<()>) {
        let Some(c) = self.conns[i].as_mut() else {
            return;
        };
        if let Err(e) = res {
            debug!(from = %c.from, error = %e, "connection ended");
        }
        if c.busy() {
            c.dead = true;
            let _ = c.stream.shutdown(std::net::Shutdown::Both);
            return;
        }
        let Some(c) = self.conns[i].take() else {
            return;
        };
        if let Some(slot) = c.fixed {
            let _ = self.ring.submitter().register_files_update(slot, &[-1]);
        }
        let _ = c.stream.shutdown(std::net::Shutdown::Both);
        lock(&self.ctx.live.conns).remove(&c.live_id);
        self.free.push(i);
    }

    /// Runs stream `i`'s steps until one waits for the socket.
    fn advance(&mut self, i: usize) -> Turn {
        let stopped = self.stopped();
        let Some(c) = self.conns[i].as_mut() else {
            return Turn::Wait;
        };
        if c.inflight || c.dead {
            return Turn::Wait;
        }
        if stopped {
            return Turn::End(Ok(()));
        }
        let mut spent = 0usize;
        loop {
            if spent >= TURN_BUDGET {
                // The others' turn: this stream goes on at the next.
                return Turn::Yield;
            }
            spent += c.steps.front().map_or(0, step_bytes).max(STEP_COST);
            let Some(step) = c.steps.front_mut() else {
                if let Some(turn) = next_request(c, &self.ctx) {
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
                    let index = self.bufs.index(&self.ring, &lease.region, &self.ctx.stats);
                    let flags = libc::MSG_WAITALL | libc::MSG_NOSIGNAL;
                    let e = match c.fixed {
                        Some(slot) => opcode::SendZc::new(types::Fixed(slot), ptr, n),
                        None => opcode::SendZc::new(types::Fd(c.stream.as_raw_fd()), ptr, n),
                    }
                    .buf_index(index)
                    .flags(flags)
                    .build();
                    let key = self.zc_next;
                    self.zc_next += 1;
                    // The hold is in place before the send can complete.
                    self.zc.insert(key, (i, c.generation, lease.clone()));
                    IoStats::add(&self.ctx.stats.zc_sends, 1);
                    if index.is_some() {
                        IoStats::add(&self.ctx.stats.fixed_sends, 1);
                    }
                    c.inflight = true;
                    let e = e.user_data(user_data::zc(key));
                    // SAFETY: the range was checked against the region by the stream protocol;
                    // the lease held in `zc` keeps the region alive (and its registration in
                    // use) until the kernel's notification that it let go of the pages.
                    if let Err(err) = unsafe { push(&mut self.ring, &e) } {
                        c.inflight = false;
                        self.zc.remove(&key);
                        return Turn::End(Err(err));
                    }
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
                            Err(e) => return Turn::End(Err(e)),
                        }
                    }
                    return submit_sock(&mut self.ring, c, i);
                }
                Step::FileRead {
                    file,
                    at,
                    len,
                    stage,
                } => file.read_piece(&mut self.file_ring, stage, *len, *at),
                Step::FileWrite {
                    file,
                    at,
                    len,
                    stage,
                } => file.write_piece(&mut self.file_ring, stage, *len, *at),
                Step::Answer {
                    lease,
                    token,
                    seq,
                    ack_slack,
                } => {
                    let (lease, token, seq, ack_slack) = (lease.clone(), *token, *seq, *ack_slack);
                    c.steps.pop_front();
                    answer(c, &self.ctx.stats, &lease, token, seq, ack_slack);
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
                Step::Close => return Turn::End(Ok(())),
            };
            if let Err(e) = r {
                return Turn::End(Err(e));
            }
            c.steps.pop_front();
        }
    }
}

/// `c` has no step queued: plans the request whose header is in, takes the header's armed
/// receive as its own step, or queues the header's receive (then the stream is idle and gives
/// its file staging back). `Some`: the turn ends so.
fn next_request(c: &mut Conn, ctx: &Ctx) -> Option<Turn> {
    if !c.ready && c.armed.as_ref().is_none_or(|a| a.res.is_none()) {
        c.stage.release();
    }
    if c.ready {
        c.ready = false;
        let head = c.head;
        plan(c, ctx, &head);
    } else if let Some(a) = c.armed.take() {
        // The header's receive went with the last send: take it as its own.
        let Some(res) = a.res else {
            c.armed = Some(a);
            return Some(Turn::Wait);
        };
        c.steps.push_back(Step::Head { buf: a.buf, got: 0 });
        if let Err(e) = on_complete(c, res) {
            return Some(Turn::End(Err(e)));
        }
    } else {
        c.steps.push_back(Step::head());
    }
    None
}

/// Submits the ring operation of `c`'s front step (stream `i`, a send or receive the socket did
/// not finish at once); a request's last send also arms the next header's receive.
fn submit_sock(ring: &mut IoUring, c: &mut Conn, i: usize) -> Turn {
    low_mark(c);
    let Some(e) = sock_op(c) else {
        return Turn::End(Err(io::Error::other("a socket step with no bytes")));
    };
    let last_send = c.steps.len() == 1
        && matches!(c.steps.front(), Some(Step::Send { .. }))
        && !c.ready
        && c.armed.is_none();
    let e = e.user_data(user_data::op(K_STEP, i, c.generation));
    c.inflight = true;
    // SAFETY: the entry points into the boxed `Conn` (iovecs, message, the next header's buffer)
    // and at memory its front step keeps alive (`Keep`, owned buffers); the step is popped, and
    // the `Conn` freed, only after the completion was reaped.
    if let Err(err) = unsafe { push(ring, &e) } {
        // Not queued (the ring refused a submit): nothing is in flight.
        c.inflight = false;
        return Turn::End(Err(err));
    }
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
        }
        .user_data(user_data::op(K_ARMED, i, c.generation));
        // SAFETY: the buffer is boxed in `c.armed` (set before the completion can be reaped, on
        // this thread), which is kept until it completes.
        if unsafe { push(ring, &e) }.is_ok() {
            c.armed = Some(Armed { buf, res: None });
        }
    }
    Turn::Wait
}

/// An accepted WRITE's payload is in (its `Answer` step taken off the queue): holds the answer
/// back for the next request where the protocol may and that request's header is here, or queues
/// it next.
fn answer(
    c: &mut Conn,
    stats: &IoStats,
    lease: &SegmentLease,
    token: SegmentToken,
    seq: u32,
    ack_slack: u16,
) {
    let may_hold = c.proto.may_hold(ack_slack);
    // The next header, where part of it came with the payload or a held answer could use it: the
    // rest of it if the socket has it now.
    if (c.head_got > 0 || may_hold) && head_now(c) {
        c.head_got = 0;
        c.ready = true;
        if may_hold && c.proto.hold_for_next(lease, token, seq, &c.head) {
            IoStats::add(&stats.held_responses, 1);
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
    use std::sync::{Arc, mpsc};

    use ferry_core::stream::ServerStream;

    use super::{Driver, NewStream, STEP_COST, Step, TURN_BUDGET};
    use crate::config::UringConfig;
    use crate::ring::IoStats;
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
        let (_tx, rx) = mpsc::channel();
        // SAFETY: plain eventfd creation; checked before use.
        let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC) };
        assert!(fd >= 0);
        // SAFETY: a fresh descriptor we now own.
        let wake =
            Arc::new(unsafe { <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) });
        let mut d = Driver::new(ctx, rx, wake, None).unwrap();
        let mut peers = Vec::new();
        for _ in 0..2 {
            let (ours, peer) = pair();
            let from = peer.local_addr().unwrap();
            d.add(NewStream {
                stream: ours,
                from,
                proto: ServerStream::new(table.clone()),
                accept: b"A".to_vec(),
            });
            peers.push(peer);
        }
        // Stream 0: twice its turn's budget of small sends, all of which the socket takes.
        let sends = 2 * TURN_BUDGET / STEP_COST;
        let piece = 1024;
        for k in 0..sends {
            let c = d.conns[0].as_mut().unwrap();
            c.steps.push_back(Step::send_owned(vec![k as u8; piece]));
        }
        d.run_streams().unwrap();
        let queued = |d: &Driver, i: usize| {
            d.conns[i]
                .as_ref()
                .unwrap()
                .steps
                .iter()
                .filter(|s| matches!(s, Step::Send { .. }))
                .count()
        };
        assert!(
            queued(&d, 0) > 0,
            "stream 0 sent all its {sends} sends in one turn"
        );
        assert_eq!(
            queued(&d, 1),
            0,
            "stream 1 was not served in the first turn"
        );
        // The rest goes in later turns, in order.
        for _ in 0..sends {
            if queued(&d, 0) == 0 {
                break;
            }
            d.run_streams().unwrap();
        }
        assert_eq!(queued(&d, 0), 0, "stream 0's sends never finished");
        let mut got = vec![0u8; 1 + sends * piece];
        peers[0].read_exact(&mut got).unwrap();
        assert_eq!(got[0], b'A');
        for (k, chunk) in got[1..].chunks(piece).enumerate() {
            assert!(chunk.iter().all(|&b| b == k as u8), "send {k} out of order");
        }
        let mut accept = [0u8; 1];
        peers[1].read_exact(&mut accept).unwrap();
        assert_eq!(&accept, b"A");
    }
}
