//! The ring host: one type ([`Host`]) owns a ring thread's streams and runs them, the client's and
//! the server's alike. It holds the slots (a slab with a generation per slot, so a completion
//! never reaches a later stream in the same slot), each stream's fixed file and count of
//! operations in flight, the zero-copy holds (released by the kernel's notification), the wake
//! read of the thread's [`Inbox`], the runnable queue, and the one shutdown.
//!
//! A stream plugs in through [`Stream`]: it advances (queues its ring operations through an
//! [`Io`], which names them in the shared user data with the stream's own small op enum), is told
//! of its operations' completions, and ends. The host never frees a stream the kernel may still
//! write into: a stream that ends has its socket shut down, which ends its operations, and goes
//! once the last of them completed.

use std::collections::{HashMap, VecDeque};
use std::io;
use std::net::TcpStream;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use ferry_core::MemoryRegion;
use io_uring::{cqueue, opcode, squeue, types};
use tracing::{debug, warn};

use super::IoStats;
use super::inbox::{EventFd, Inbox};
use super::kernel::{Cqe, Ring};
use super::user_data::{self, Decoded, MAX_SLOTS};
use crate::config::FINISH_GRACE;

/// Kinds of the host's own operations in their user data: the wake eventfd's read, a no-op that
/// ends a wait at once. A stream's kinds are below them.
const K_WAKE: u8 = 0xff;
pub(crate) const K_NOP: u8 = 0xfe;
/// The largest kind a stream's operation may have.
pub(crate) const MAX_STREAM_KIND: u8 = 0xfd;

/// A stream's kinds of ring operation, as its user data carries them (1 to
/// [`MAX_STREAM_KIND`]).
pub(crate) trait OpKind: Copy {
    fn kind(self) -> u8;
    fn of(kind: u8) -> Option<Self>;
}

/// What a stream's turn ended with.
#[derive(Debug)]
pub(crate) enum Turn<E> {
    /// An operation is in flight, or the stream waits to be woken.
    Wait,
    /// Run it again at the next turn (its turn's budget spent): the ring does not sleep.
    Yield,
    /// The stream is over (with the error that ended it, if any).
    End(Option<E>),
}

/// A stream a [`Host`] runs.
pub(crate) trait Stream {
    /// Its kinds of ring operation.
    type Op: OpKind;
    /// What one of its zero-copy sends holds until the kernel lets go of the pages.
    type Hold;
    /// What ends it badly.
    type Error;
    /// How the completion of a zero-copy send (not its notification) comes back.
    const ZC_SENT: Self::Op;

    /// Its socket: registered as a fixed file, shut down when the stream ends (which ends its
    /// operations in flight), reset when zero-copy sends outlast it past the grace.
    fn socket(&self) -> &Arc<TcpStream>;
    /// Runs until it waits on the ring (its operations queued through `io`), yields or ends.
    fn advance(&mut self, io: &mut Io<'_, Self::Hold>) -> Turn<Self::Error>;
    /// Operation `op` completed with the kernel's `res` and `flags`: `Ok` runs the stream at
    /// the next turn, `Err` ends it. Never called once the stream is ending.
    fn complete(&mut self, op: Self::Op, res: i32, flags: u32) -> Result<(), Self::Error>;
    /// It begins to end (once; its socket is shut down already).
    fn ending(&mut self) {}
    /// It ended: nothing of it is in flight, it is dropped next. `why`: the first error given.
    fn end(self: Box<Self>, why: Option<Self::Error>);
}

/// The ring as a stream's [`Stream::advance`] sees it: its operations queued under its own slot
/// and generation, the zero-copy holds, its fixed file and the ring's registered buffers.
pub(crate) struct Io<'a, H> {
    ring: &'a mut dyn Ring,
    slot: usize,
    generation: u32,
    fixed: Option<u32>,
    inflight: &'a mut u32,
    zc: &'a mut Holds<H>,
    stats: &'a IoStats,
}

impl<H> Io<'_, H> {
    /// The stream's fixed-file slot, if its socket has one.
    pub(crate) fn fixed(&self) -> Option<u32> {
        self.fixed
    }

    /// The registered-buffer index covering `region`, if the ring has one for it.
    pub(crate) fn buf_index(&mut self, region: &Arc<MemoryRegion>) -> Option<u16> {
        self.ring.buf_index(region, self.stats)
    }

    /// Queues `e` as the stream's operation `op`.
    ///
    /// # Safety
    /// Every pointer of `e` must stay valid until its completion was handed to the stream (or,
    /// the stream ending, until it ended).
    pub(crate) unsafe fn push(&mut self, op: impl OpKind, e: squeue::Entry) -> io::Result<()> {
        let kind = op.kind();
        debug_assert!(kind != 0 && kind <= MAX_STREAM_KIND);
        let e = e.user_data(user_data::op(kind, self.slot, self.generation));
        // SAFETY: the caller's contract.
        unsafe { self.ring.push(&e) }?;
        *self.inflight += 1;
        Ok(())
    }

    /// Queues the zero-copy send `e`, `hold` kept until the kernel's notification that it let
    /// go of the pages (however the stream ends); its completion comes back as
    /// [`Stream::ZC_SENT`].
    ///
    /// # Safety
    /// As [`Self::push`]; the pages it sends must stay valid while `hold` is held.
    pub(crate) unsafe fn push_zc(&mut self, e: squeue::Entry, hold: H) -> io::Result<()> {
        let key = self.zc.next;
        self.zc.next += 1;
        // The hold is in place before the send can complete.
        self.zc.held.insert(
            key,
            Held {
                slot: self.slot,
                generation: self.generation,
                _hold: hold,
            },
        );
        let e = e.user_data(user_data::zc(key));
        // SAFETY: the caller's contract.
        if let Err(err) = unsafe { self.ring.push(&e) } {
            self.zc.held.remove(&key);
            return Err(err);
        }
        *self.inflight += 1;
        Ok(())
    }
}

/// A zero-copy send's hold, by its stream.
struct Held<H> {
    slot: usize,
    generation: u32,
    _hold: H,
}

/// Zero-copy sends the kernel has not let go of, by key.
struct Holds<H> {
    held: HashMap<u64, Held<H>>,
    next: u64,
}

impl<H> Holds<H> {
    fn of(&self, slot: usize, generation: u32) -> usize {
        self.held
            .values()
            .filter(|h| h.slot == slot && h.generation == generation)
            .count()
    }
}

/// One place of the slab.
struct Slot<S: Stream> {
    stream: Option<Box<S>>,
    generation: u32,
    fixed: Option<u32>,
    /// Its operations the kernel has not completed.
    inflight: u32,
    /// Ending (with the first error given): waits for its operations in flight.
    ending: Option<Option<S::Error>>,
}

/// An ended stream's socket whose zero-copy sends are still held: when to reset it, and whether
/// it was.
struct Linger {
    socket: Weak<TcpStream>,
    slot: usize,
    generation: u32,
    at: Instant,
    was_reset: bool,
}

/// A ring thread's streams on one ring (`R`: the kernel's, a fake in tests).
pub(crate) struct Host<S: Stream, R: Ring> {
    ring: R,
    slots: Vec<Slot<S>>,
    free: Vec<usize>,
    /// Slots to run at the next turn (a slot may be named twice; a stream with nothing to do
    /// waits).
    runnable: VecDeque<usize>,
    yielded: Vec<usize>,
    zc: Holds<S::Hold>,
    lingering: Vec<Linger>,
    wake: Arc<EventFd>,
    wake_buf: Box<[u8; 8]>,
    wake_armed: bool,
    /// Completions of one reap (kept for its capacity).
    reaped: Vec<Cqe>,
    stats: Arc<IoStats>,
    /// How long [`Self::shutdown`] waits for operations in flight at most.
    give_up: Duration,
}

impl<S: Stream, R: Ring> Host<S, R> {
    /// A host on `ring`, woken through the eventfd `wake` (its thread's inbox's).
    pub(crate) fn new(ring: R, wake: Arc<EventFd>, stats: Arc<IoStats>) -> Self {
        Self {
            ring,
            slots: Vec::new(),
            free: Vec::new(),
            runnable: VecDeque::new(),
            yielded: Vec::new(),
            zc: Holds {
                held: HashMap::new(),
                next: 0,
            },
            lingering: Vec::new(),
            wake,
            wake_buf: Box::new([0; 8]),
            wake_armed: false,
            reaped: Vec::new(),
            stats,
            give_up: FINISH_GRACE * 10,
        }
    }

    /// Takes `stream` into a free slot (its socket a fixed file where the ring has room), to
    /// run at the next turn: its slot, or the stream back if the ring names as many as it can.
    pub(crate) fn add(&mut self, stream: Box<S>) -> Result<usize, Box<S>> {
        let i = match self.free.pop() {
            Some(i) => i,
            None if self.slots.len() < MAX_SLOTS => {
                self.slots.push(Slot {
                    stream: None,
                    generation: 0,
                    fixed: None,
                    inflight: 0,
                    ending: None,
                });
                self.slots.len() - 1
            }
            None => return Err(stream),
        };
        let fixed = self.ring.register_file(i, stream.socket().as_raw_fd());
        let s = &mut self.slots[i];
        s.generation = user_data::next_generation(s.generation);
        s.fixed = fixed;
        s.inflight = 0;
        s.ending = None;
        s.stream = Some(stream);
        self.runnable.push_back(i);
        Ok(i)
    }

    /// Its ring (a test's fake, say).
    #[cfg(test)]
    pub(crate) fn ring(&mut self) -> &mut R {
        &mut self.ring
    }

    /// The stream in `slot`, if one is there.
    pub(crate) fn stream_mut(&mut self, slot: usize) -> Option<&mut S> {
        self.slots.get_mut(slot)?.stream.as_deref_mut()
    }

    /// Runs the stream in `slot` at the next turn.
    pub(crate) fn wake(&mut self, slot: usize) {
        self.runnable.push_back(slot);
    }

    /// Runs every stream at the next turn.
    pub(crate) fn wake_all(&mut self) {
        let all = self.slots.iter().enumerate();
        let live = all.filter_map(|(i, s)| s.stream.as_ref().map(|_| i));
        self.runnable.extend(live);
    }

    /// Whether it has no stream, and no zero-copy send held.
    pub(crate) fn is_empty(&self) -> bool {
        self.slots.iter().all(|s| s.stream.is_none()) && self.zc.held.is_empty()
    }

    /// Whether the kernel may still write into memory of its streams or its own.
    fn busy(&self) -> bool {
        self.wake_armed || self.slots.iter().any(|s| s.stream.is_some())
    }

    /// One turn: arms the wake read, runs the runnable streams, submits what they queued and,
    /// unless a stream yielded (then a no-op ends the wait at once, so the ring's deferred task
    /// work still runs) or `inbox` holds something (then it only submits), waits for a
    /// completion (at most `timeout`), then hands the completions to their streams. Whether the
    /// wait timed out.
    pub(crate) fn turn<N>(
        &mut self,
        inbox: &Inbox<N>,
        timeout: Option<Duration>,
    ) -> io::Result<bool> {
        self.arm_wake()?;
        let yielded = self.run_streams()?;
        self.linger();
        let timed_out = if yielded {
            // A stream has more to do: do not sleep, but still run the ring's deferred task
            // work (other streams' receives), which only a wait runs; a no-op completes at once
            // and ends the wait.
            let nop = opcode::Nop::new()
                .build()
                .user_data(user_data::op(K_NOP, 0, 0));
            // SAFETY: a no-op carries no buffer.
            unsafe { self.ring.push(&nop) }?;
            self.ring.enter(true, None)?;
            false
        } else if !inbox.may_sleep() {
            // Something was left in the inbox meanwhile: submit, and look at it at once.
            self.ring.enter(false, None)?;
            false
        } else {
            let t = if self.lingering.is_empty() {
                timeout
            } else {
                Some(timeout.map_or(LINGER_LOOK, |t| t.min(LINGER_LOOK)))
            };
            let r = self.ring.enter(true, t);
            inbox.awake();
            r?
        };
        self.reap();
        Ok(timed_out)
    }

    fn arm_wake(&mut self) -> io::Result<()> {
        if self.wake_armed {
            return Ok(());
        }
        let e = opcode::Read::new(
            types::Fd(self.wake.0.as_raw_fd()),
            self.wake_buf.as_mut_ptr(),
            8,
        )
        .build()
        .user_data(user_data::op(K_WAKE, 0, 0));
        // SAFETY: the buffer is boxed in the host, which outlives the read (`shutdown` waits for
        // it, or leaks the buffer); `wake` keeps the eventfd open.
        unsafe { self.ring.push(&e) }?;
        self.wake_armed = true;
        Ok(())
    }

    /// Gives every runnable stream its turn: whether one yielded (it runs again at the next).
    fn run_streams(&mut self) -> io::Result<bool> {
        while let Some(i) = self.runnable.pop_front() {
            let Some(slot) = self.slots.get_mut(i) else {
                continue;
            };
            let Some(stream) = slot.stream.as_deref_mut() else {
                continue;
            };
            if slot.ending.is_some() {
                continue;
            }
            let mut io = Io {
                ring: &mut self.ring,
                slot: i,
                generation: slot.generation,
                fixed: slot.fixed,
                inflight: &mut slot.inflight,
                zc: &mut self.zc,
                stats: &self.stats,
            };
            match stream.advance(&mut io) {
                Turn::Wait => {}
                Turn::Yield => self.yielded.push(i),
                Turn::End(why) => self.end(i, why),
            }
        }
        if self.yielded.is_empty() {
            return Ok(false);
        }
        self.runnable.extend(self.yielded.drain(..));
        Ok(true)
    }

    /// Hands the completions that came to their streams.
    fn reap(&mut self) {
        let mut done = std::mem::take(&mut self.reaped);
        done.clear();
        self.ring.reap(&mut done);
        for &(u, res, flags) in &done {
            let (op, i, g) = match user_data::decode(u) {
                Decoded::Op { kind: K_WAKE, .. } => {
                    self.wake_armed = false;
                    continue;
                }
                Decoded::Op {
                    kind,
                    slot,
                    generation,
                } => match S::Op::of(kind) {
                    Some(op) => (op, slot, generation),
                    None => continue,
                },
                Decoded::Zc(key) => {
                    if cqueue::notif(flags) {
                        IoStats::add(&self.stats.notifications, 1);
                        self.zc.held.remove(&key);
                        continue;
                    }
                    let Some(h) = self.zc.held.get(&key) else {
                        continue;
                    };
                    let named = (S::ZC_SENT, h.slot, h.generation);
                    if !cqueue::more(flags) {
                        // No notification will come for this one.
                        self.zc.held.remove(&key);
                    }
                    named
                }
            };
            let Some(slot) = self.slots.get_mut(i) else {
                continue;
            };
            if slot.generation != g {
                continue;
            }
            let Some(stream) = slot.stream.as_deref_mut() else {
                continue;
            };
            slot.inflight = slot.inflight.saturating_sub(1);
            if slot.ending.is_some() {
                if slot.inflight == 0 {
                    self.finish(i);
                }
                continue;
            }
            match stream.complete(op, res, flags) {
                Ok(()) => self.runnable.push_back(i),
                Err(e) => self.end(i, Some(e)),
            }
        }
        self.reaped = done;
    }

    /// Ends the stream in `slot` (with `why`, unless an error was given before): its socket is
    /// shut down at once, and it goes once the kernel completed its operations in flight.
    pub(crate) fn end(&mut self, slot: usize, why: Option<S::Error>) {
        let Some(s) = self.slots.get_mut(slot) else {
            return;
        };
        let Some(stream) = s.stream.as_deref_mut() else {
            return;
        };
        match &mut s.ending {
            None => {
                s.ending = Some(why);
                let _ = stream.socket().shutdown(std::net::Shutdown::Both);
                stream.ending();
            }
            Some(first @ None) => *first = why,
            Some(Some(_)) => {}
        }
        if s.inflight == 0 {
            self.finish(slot);
        }
    }

    /// The stream in `slot` ended and nothing of it is in flight: it goes, its slot is free.
    fn finish(&mut self, slot: usize) {
        let s = &mut self.slots[slot];
        let Some(stream) = s.stream.take() else {
            return;
        };
        let why = s.ending.take().flatten();
        if let Some(f) = s.fixed.take() {
            self.ring.unregister_file(f);
        }
        if self.zc.of(slot, s.generation) > 0 {
            self.lingering.push(Linger {
                socket: Arc::downgrade(stream.socket()),
                slot,
                generation: s.generation,
                at: Instant::now() + FINISH_GRACE,
                was_reset: false,
            });
        }
        self.free.push(slot);
        stream.end(why);
    }

    /// Resets the connections of ended streams whose zero-copy sends the peer has not
    /// acknowledged within the grace (which purges the socket's queues, so the kernel lets go);
    /// forgets those with none left.
    fn linger(&mut self) {
        if self.lingering.is_empty() {
            return;
        }
        let now = Instant::now();
        let zc = &self.zc;
        self.lingering.retain_mut(|l| {
            let Some(socket) = l.socket.upgrade() else {
                return false;
            };
            let held = zc.of(l.slot, l.generation);
            if held == 0 {
                return false;
            }
            if now >= l.at {
                if l.was_reset {
                    warn!(
                        pending = held,
                        "zero-copy sends still held by the kernel after the connection was \
                         reset; their holds stay until it lets go"
                    );
                } else {
                    debug!(
                        pending = held,
                        "zero-copy sends unacknowledged after the grace; resetting the connection"
                    );
                    if let Err(e) = reset(socket.as_raw_fd()) {
                        warn!(error = %e, "cannot reset the connection");
                    }
                    l.was_reset = true;
                }
                l.at = now + FINISH_GRACE * 10;
            }
            true
        });
    }

    /// Ends every stream with the error `why` gives.
    pub(crate) fn end_all(&mut self, why: impl Fn() -> S::Error) {
        for i in 0..self.slots.len() {
            self.end(i, Some(why()));
        }
    }

    /// The one shutdown: every stream ends (its socket shut down), then the ring waits for what
    /// is in flight (the shutdowns end it) and, within [`FINISH_GRACE`], for the kernel to let go
    /// of zero-copy sends; what the kernel may still write into is never freed, and zero-copy
    /// holds it did not let go of stay held for good.
    pub(crate) fn shutdown(&mut self) {
        for i in 0..self.slots.len() {
            self.end(i, None);
        }
        let grace = Instant::now() + FINISH_GRACE;
        // The kernel ends a shut-down socket's operations at once; this bounds a kernel that
        // does not.
        let deadline = Instant::now() + self.give_up;
        loop {
            let now = Instant::now();
            let busy = self.busy();
            if !(busy || !self.zc.held.is_empty() && now < grace) || now >= deadline {
                break;
            }
            if self.wake_armed {
                self.wake.wake_now();
            }
            // Only notifications are awaited: the grace bounds the wait.
            let t = if busy {
                Duration::from_millis(10)
            } else {
                grace
                    .saturating_duration_since(now)
                    .min(Duration::from_millis(10))
            };
            if let Err(e) = self.ring.enter(true, Some(t)) {
                warn!(error = %e, "a ring cannot wait for its operations in flight");
                break;
            }
            self.reap();
        }
        std::mem::forget(std::mem::take(&mut self.zc.held));
        if self.busy() {
            warn!("a ring ends with operations in flight; their memory is never freed");
            std::mem::forget(std::mem::take(&mut self.slots));
            std::mem::forget(std::mem::take(&mut self.wake_buf));
        }
    }
}

/// How often a ring with ended streams' zero-copy sends held looks at them, at least.
const LINGER_LOOK: Duration = Duration::from_millis(50);

/// Aborts a connection: a reset to the peer, and the socket's send and retransmit queues purged
/// (`connect` to an `AF_UNSPEC` address, which Linux turns into `tcp_disconnect`).
pub(crate) fn reset(fd: RawFd) -> io::Result<()> {
    // SAFETY: a zeroed sockaddr is a valid AF_UNSPEC (0) address; connect only reads
    // `size_of::<sockaddr>()` bytes of it, and `fd` is a socket its caller keeps open.
    let rc = unsafe {
        let addr: libc::sockaddr = std::mem::zeroed();
        libc::connect(
            fd,
            &addr,
            std::mem::size_of::<libc::sockaddr>() as libc::socklen_t,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

#[cfg(test)]
#[path = "host_tests.rs"]
mod tests;
