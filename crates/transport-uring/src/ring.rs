//! One io_uring ring driving one socket from one thread (a client stream's own thread, with
//! `UringConfig::caller_receives`): ordered sends (short sends resent),
//! exact receives, SEND_ZC with its notifications, a fixed file and registered buffers.
//!
//! The ring is used synchronously: the owning thread submits the SQEs of one logical send or
//! receive and waits for their completions. Zero-copy notifications (`IORING_CQE_F_NOTIF`) may
//! arrive later, interleaved with other completions; each one releases a *hold* (whatever keeps
//! the sent buffer alive and its request un-drained) by dropping it.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use ferry_core::MemoryRegion;
use io_uring::{IoUring, cqueue, opcode, squeue, types};
use tracing::debug;

/// Ring entries per socket ring.
const ENTRIES: u32 = 64;
/// Fixed-buffer slots per ring.
const BUF_SLOTS: u32 = 32;
/// Largest buffer the kernel registers (it refuses single buffers above 1 GiB).
const MAX_FIXED_BUF: usize = 1 << 30;
// Receives of more than this wake their thread only once this much has arrived (or the rest of
// the payload, if less): `SO_RCVLOWAT`, see `SockIo::recv_exact`.
use ferry_net::RECV_LOW_MARK as LOWAT;

const UD_HEAD: u64 = 1;
const UD_BODY: u64 = 2;
const UD_RECV: u64 = 3;
const UD_TIMEOUT: u64 = 4;
const UD_WAKE: u64 = 5;
const UD_ARMED: u64 = 6;
const UD_CANCEL: u64 = 7;
const UD_HANGUP: u64 = 8;
/// Largest receive [`SockIo::arm_recv`] takes (it lands in the ring's own buffer).
pub(crate) const ARMED_MAX: usize = 64;
/// User data of zero-copy sends start here (each gets its own, for its notification).
const UD_ZC_BASE: u64 = 1 << 32;

/// Counters of one transport, shared by all its rings.
#[derive(Debug, Default)]
pub struct IoStats {
    /// Sends (or receives) the kernel completed short, whose remainder was resubmitted.
    pub short_sends: AtomicU64,
    /// Short receives resubmitted.
    pub short_recvs: AtomicU64,
    /// Payload sends done with SEND_ZC.
    pub zc_sends: AtomicU64,
    /// Payload bytes sent by vmsplice + SPLICE (loopback WRITEs; see `UringConfig::splice`).
    pub spliced_sends: AtomicU64,
    /// Payload sends done with plain SEND.
    pub copy_sends: AtomicU64,
    /// Zero-copy sends that came from a registered (fixed) buffer.
    pub fixed_sends: AtomicU64,
    /// Zero-copy notifications received.
    pub notifications: AtomicU64,
    /// Registrations of buffers that the kernel refused (fallback to unregistered sends).
    pub register_failures: AtomicU64,
    /// WRITE responses a server held back and sent as part of a later one
    /// (`DataRequest::ack_slack`; counted on the server's [`crate::UringServerHandle::stats`]).
    pub held_responses: AtomicU64,
    /// I/O threads running now: one per client ring (or, with `UringConfig::caller_receives`,
    /// one per client stream, each with its own ring), one per ring of a server (handshakes run
    /// on the server's accept thread, which is not counted).
    pub threads: AtomicU64,
    /// Requests of one small chunk that the submitting thread sent itself on an idle stream,
    /// with no hand-over to the stream's thread.
    pub direct_sends: AtomicU64,
    /// Of those, sends the kernel took only in part (a full socket): the stream's driver sent
    /// the rest before anything else.
    pub direct_tails: AtomicU64,
    /// Spliced sends of a client ring that found the socket full and waited on the ring for
    /// room (a poll), not in the call.
    pub room_waits: AtomicU64,
    /// Responses to direct sends that the awaiting task read itself, through its runtime's
    /// reactor (`UringConfig::caller_receives`), with no wake-up of the stream's thread.
    pub caller_receives: AtomicU64,
    /// Of the direct sends whose response the awaiting task was to read, those it handed back
    /// to the stream's thread (another request took the stream, the future was dropped, the
    /// stream ended).
    pub caller_handbacks: AtomicU64,
    /// Past `UringConfig::max_threads`: peers a client's engine opened over the TCP data plane
    /// instead.
    pub handed_over: AtomicU64,
}

impl IoStats {
    pub(crate) fn add(c: &AtomicU64, n: u64) {
        c.fetch_add(n, Ordering::Relaxed);
    }
}

/// Counts live I/O threads (one, or a reservation of several) in [`IoStats::threads`] while
/// held: the client's and the server's rings, and with `UringConfig::caller_receives` a thread
/// per client stream, so fan-out to many peers then costs that many threads (bounded by
/// `UringConfig::max_threads` where the owner enforces it); past 256 it warns at each doubling.
#[derive(Debug)]
pub(crate) struct ThreadCount {
    stats: Arc<IoStats>,
    n: u64,
}

impl ThreadCount {
    /// Counts `n` more threads if that keeps the count at `max` or below (`None`: it would not).
    pub(crate) fn reserve(
        stats: &Arc<IoStats>,
        n: u64,
        max: usize,
        what: &'static str,
    ) -> Option<Self> {
        let now = stats.threads.fetch_add(n, Ordering::Relaxed) + n;
        if now > max as u64 {
            stats.threads.fetch_sub(n, Ordering::Relaxed);
            return None;
        }
        Some(Self::counted(stats, n, now, what))
    }

    pub(crate) fn new(stats: &Arc<IoStats>, what: &'static str) -> Self {
        let now = stats.threads.fetch_add(1, Ordering::Relaxed) + 1;
        Self::counted(stats, 1, now, what)
    }

    fn counted(stats: &Arc<IoStats>, n: u64, now: u64, what: &'static str) -> Self {
        if now > 256 && now.is_power_of_two() {
            tracing::warn!(
                threads = now,
                "the io_uring data plane runs {now} threads ({what}: one per stream); for fan-out \
                 to many peers keep UringConfig::max_threads low, past it the TCP data plane's \
                 fixed pool of I/O threads takes over"
            );
        }
        Self {
            stats: stats.clone(),
            n,
        }
    }
}

impl Drop for ThreadCount {
    fn drop(&mut self) {
        self.stats.threads.fetch_sub(self.n, Ordering::Relaxed);
    }
}

/// Registered-buffer slots of one ring, keyed by region (weakly, so a dropped region's slot is
/// never matched by a new region at the same address: the `Weak` keeps the `Arc` allocation).
pub(crate) struct BufCache {
    slots: Vec<Option<Weak<MemoryRegion>>>,
    refused: Vec<Weak<MemoryRegion>>,
    enabled: bool,
    victim: usize,
}

impl BufCache {
    pub(crate) fn new(ring: &IoUring, want: bool) -> Self {
        let enabled = want && ring.submitter().register_buffers_sparse(BUF_SLOTS).is_ok();
        Self {
            slots: vec![None; if enabled { BUF_SLOTS as usize } else { 0 }],
            refused: Vec::new(),
            enabled,
            victim: 0,
        }
    }

    /// The fixed-buffer index covering `region`, registering it if needed and possible.
    pub(crate) fn index(
        &mut self,
        ring: &IoUring,
        region: &Arc<MemoryRegion>,
        stats: &IoStats,
    ) -> Option<u16> {
        if !self.enabled || region.is_empty() || region.len() > MAX_FIXED_BUF {
            return None;
        }
        let me = Arc::as_ptr(region);
        if let Some(i) = self.slots.iter().position(|s| {
            s.as_ref()
                .is_some_and(|w| w.as_ptr() == me && w.strong_count() > 0)
        }) {
            return Some(i as u16);
        }
        self.refused.retain(|w| w.strong_count() > 0);
        if self.refused.iter().any(|w| w.as_ptr() == me) {
            return None;
        }
        let slot = self
            .slots
            .iter()
            .position(|s| s.as_ref().is_none_or(|w| w.strong_count() == 0))
            .unwrap_or_else(|| {
                self.victim = (self.victim + 1) % self.slots.len();
                self.victim
            });
        let iov = libc::iovec {
            iov_base: region.as_ptr().cast(),
            iov_len: region.len(),
        };
        // SAFETY: the kernel pins the region's pages at registration and holds them until the slot
        // is replaced or the ring is closed, so the registration cannot outlive the pages; we only
        // use the slot while `region` is alive (checked through the `Weak` above).
        match unsafe {
            ring.submitter()
                .register_buffers_update(slot as u32, &[iov], None)
        } {
            Ok(()) => {
                self.slots[slot] = Some(Arc::downgrade(region));
                Some(slot as u16)
            }
            Err(e) => {
                IoStats::add(&stats.register_failures, 1);
                debug!(error = %e, len = region.len(), "registering buffer refused; sending unregistered");
                self.slots[slot] = None;
                self.refused.push(Arc::downgrade(region));
                None
            }
        }
    }
}

/// A payload to send straight from registered memory.
pub(crate) struct Body<'a> {
    /// The region holding it (for the fixed-buffer lookup).
    pub(crate) region: &'a Arc<MemoryRegion>,
    /// Offset in the region.
    pub(crate) offset: u64,
    /// Length.
    pub(crate) len: usize,
}

/// One socket driven by one ring. `H` is what a zero-copy send must keep alive until its
/// notification: dropping it releases the buffer.
pub(crate) struct SockIo<H> {
    ring: IoUring,
    fd: RawFd,
    fixed_file: bool,
    zero_copy: bool,
    bufs: BufCache,
    /// Sends awaiting their zero-copy notification.
    waiting: Vec<(u64, H)>,
    next_zc: u64,
    stats: Arc<IoStats>,
    /// Pipe for spliced sends (read end, write end, capacity), made on first use.
    pipe: Option<(OwnedFd, OwnedFd, usize)>,
    /// An eventfd that ends [`SockIo::wait`] early (new work arrived), its read
    /// buffer, and whether a read of it is armed on the ring.
    wake: Option<(RawFd, &'static mut [u8; 8], bool)>,
    /// The receive started by [`SockIo::arm_recv`].
    armed: Armed,
    /// The hang-up poll of [`SockIo::arm_hangup`]: outstanding, and whether it fired.
    hangup: (bool, bool),
    /// The socket's `SO_RCVLOWAT` as last set (1: the kernel's default).
    lowat: usize,
    /// The kernel refused a mark: receives wait for all their bytes with `MSG_WAITALL`.
    lowat_refused: bool,
    /// `io_uring_enter` failed in a way a retry does not mend: the ring is never entered again,
    /// so entries still in its submission queue (pointing at memory their callers free once the
    /// call that pushed them returned its error) never reach the kernel. See [`SockIo::run`].
    poisoned: bool,
}

/// A receive left outstanding on the ring while its thread does other work; its completion is
/// picked up by whatever wait on the ring meets it.
struct Armed {
    /// Where it lands. Owned here; leaked if the ring goes while the receive is outstanding.
    buf: Option<Box<[u8; ARMED_MAX]>>,
    /// Bytes asked (for a resubmission after EINTR/EAGAIN).
    len: usize,
    /// Submitted, completion not yet seen.
    outstanding: bool,
    /// The completion's result, not yet taken.
    done: Option<i32>,
}

fn cqe_err(res: i32) -> io::Error {
    io::Error::from_raw_os_error(-res)
}

/// The most iovecs one message is given (Linux's `UIO_MAXIOV`).
pub(crate) const MAX_IOV: usize = 1024;

/// The iovecs of `parts` from byte `done` on (at most [`MAX_IOV`] of them).
pub(crate) fn iovecs_from(
    parts: &[(*const u8, usize)],
    mut done: usize,
    iov: &mut Vec<libc::iovec>,
) {
    iov.clear();
    for &(ptr, len) in parts {
        if done >= len {
            done -= len;
            continue;
        }
        iov.push(libc::iovec {
            iov_base: (ptr as usize + done) as *mut libc::c_void,
            iov_len: len - done,
        });
        done = 0;
        if iov.len() == MAX_IOV {
            break;
        }
    }
}

macro_rules! on_fd {
    ($self:ident, $op:ident :: new ( $($arg:expr),* ) $(. $m:ident ( $($a:expr),* ))* ) => {
        if $self.fixed_file {
            opcode::$op::new(types::Fixed(0), $($arg),*) $(. $m($($a),*))* .build()
        } else {
            opcode::$op::new(types::Fd($self.fd), $($arg),*) $(. $m($($a),*))* .build()
        }
    };
}

impl<H> SockIo<H> {
    /// A ring for `fd` (which must outlive it), to be used only by the calling thread. `zero_copy`: send payloads with SEND_ZC;
    /// `register`: try registered buffers and the fixed file.
    pub(crate) fn new(
        fd: RawFd,
        zero_copy: bool,
        register: bool,
        stats: Arc<IoStats>,
    ) -> io::Result<Self> {
        // The ring is only ever used by the thread that creates it: single issuer, and task work
        // deferred to when that thread waits (fewer interruptions). Older kernels: plain ring.
        let ring = match IoUring::builder()
            .setup_single_issuer()
            .setup_defer_taskrun()
            .build(ENTRIES)
        {
            Ok(r) => r,
            Err(_) => IoUring::new(ENTRIES)?,
        };
        let fixed_file = register && ring.submitter().register_files(&[fd]).is_ok();
        let bufs = BufCache::new(&ring, register && zero_copy);
        Ok(Self {
            ring,
            fd,
            fixed_file,
            zero_copy,
            bufs,
            waiting: Vec::new(),
            next_zc: UD_ZC_BASE,
            stats,
            pipe: None,
            wake: None,
            armed: Armed {
                buf: Some(Box::new([0u8; ARMED_MAX])),
                len: 0,
                outstanding: false,
                done: None,
            },
            hangup: (false, false),
            lowat: 1,
            lowat_refused: false,
            poisoned: false,
        })
    }

    /// Pushes `entries` and waits until a completion for each of `want` user-data values arrived;
    /// returns their results in order. Notifications met meanwhile release their holds.
    ///
    /// The entries point at the caller's memory (a receive into a lease's region), which the
    /// caller may free as soon as this returns, error or not. So this never returns while the
    /// kernel may still use an entry: nothing is pushed unless all of them fit; `EINTR`, and
    /// `EBUSY`/`EAGAIN` (a full completion queue, a transient allocation failure: nothing was
    /// consumed, the completions reaped here make room), are retried; any other failure of
    /// `io_uring_enter` poisons the ring before it returns, so the entries it left in the
    /// submission queue are never submitted (the kernel reports errors of a consumed entry in
    /// its completion, not by failing the call, so a failed call consumed nothing). Should the
    /// kernel ever fail the call after it consumed an entry still in flight, the process
    /// aborts: that entry could write into freed memory.
    fn run(
        &mut self,
        entries: &[Option<squeue::Entry>],
        want: &[u64],
        out: &mut [(i32, u32)],
    ) -> io::Result<()> {
        if self.poisoned {
            return Err(io::Error::other("this stream's io_uring failed before"));
        }
        {
            let mut sq = self.ring.submission();
            let n = entries.iter().flatten().count();
            if sq.capacity() - sq.len() < n {
                return Err(io::Error::other("io_uring submission queue full"));
            }
            for e in entries.iter().flatten() {
                // SAFETY: every entry points at memory its caller keeps valid until the
                // completion, which this function waits for before returning.
                if unsafe { sq.push(e) }.is_err() {
                    return Err(io::Error::other("io_uring submission queue full"));
                }
            }
        }
        let mut got = 0;
        let mut seen = [false; 2];
        // Whether a call consumed the entries (they are then the kernel's until they complete).
        let mut consumed = false;
        while got < want.len() {
            match self.ring.submit_and_wait(1) {
                Ok(_) => consumed = true,
                Err(e) if e.raw_os_error() == Some(libc::EINTR) => continue,
                Err(e) if matches!(e.raw_os_error(), Some(libc::EBUSY | libc::EAGAIN)) => {}
                Err(e) => {
                    self.poisoned = true;
                    if consumed {
                        tracing::error!(error = %e, "io_uring_enter failed with a receive or \
                            send into caller memory in flight; aborting rather than letting the \
                            kernel write into memory that is about to be freed");
                        std::process::abort();
                    }
                    return Err(e);
                }
            }
            got += self.reap(want, out, &mut seen);
        }
        Ok(())
    }

    /// Takes every completion the ring holds: notifications release their holds, the armed
    /// receive and the wake read are noted, and the results of `want` go to `out` (in `want`'s
    /// order, once each, `seen` marking them). Returns how many of `want` it met.
    fn reap(&mut self, want: &[u64], out: &mut [(i32, u32)], seen: &mut [bool; 2]) -> usize {
        let mut got = 0;
        let waiting = &mut self.waiting;
        let wake = &mut self.wake;
        let armed = &mut self.armed;
        let hangup = &mut self.hangup;
        for c in self.ring.completion() {
            if c.user_data() == UD_ARMED {
                armed.outstanding = false;
                armed.done = Some(c.result());
                continue;
            }
            if c.user_data() == UD_HANGUP {
                // A poll ends by its event, or by an error (say, a cancelled request): either
                // way the stream is worth looking at.
                *hangup = (false, true);
                continue;
            }
            if c.user_data() == UD_WAKE {
                if let Some(w) = wake.as_mut() {
                    w.2 = false;
                }
                continue;
            }
            if cqueue::notif(c.flags()) {
                IoStats::add(&self.stats.notifications, 1);
                release(waiting, c.user_data());
                continue;
            }
            if let Some(i) = want.iter().position(|&w| w == c.user_data())
                && i < seen.len()
                && !seen[i]
            {
                seen[i] = true;
                out[i] = (c.result(), c.flags());
                got += 1;
            }
        }
        got
    }

    /// Sends `head` then `body` in order, resending whatever the kernel did not take. `hold` makes
    /// the value kept alive until each zero-copy send's notification.
    ///
    /// # Safety
    /// `body` must stay valid for reads (and not be written) until every hold made for it is
    /// dropped; the holds must keep its region alive.
    pub(crate) unsafe fn send(
        &mut self,
        head: &[u8],
        body: Option<Body<'_>>,
        mut hold: Option<&mut dyn FnMut() -> H>,
    ) -> io::Result<()> {
        let zero_copy = self.zero_copy && hold.is_some();
        let (body_ptr, body_len, buf_index) = match &body {
            Some(b) => {
                let idx = if zero_copy {
                    self.bufs.index(&self.ring, b.region, &self.stats)
                } else {
                    None
                };
                (
                    (b.region.as_ptr() as usize + b.offset as usize) as *const u8,
                    b.len,
                    idx,
                )
            }
            None => (std::ptr::null(), 0, None),
        };
        let mut head_at = 0usize;
        let mut body_at = 0usize;
        let more = if body_len > 0 { libc::MSG_MORE } else { 0 };
        while head_at < head.len() || body_at < body_len {
            let mut entries: [Option<squeue::Entry>; 2] = [None, None];
            let mut want = [0u64; 2];
            let mut n = 0;
            if head_at < head.len() {
                let len = (head.len() - head_at) as u32;
                let ptr = head[head_at..].as_ptr();
                let e = on_fd!(
                    self,
                    Send::new(ptr, len).flags(libc::MSG_WAITALL | libc::MSG_NOSIGNAL | more)
                );
                entries[n] = Some(e.user_data(UD_HEAD));
                want[n] = UD_HEAD;
                n += 1;
            }
            let mut zc_ud = None;
            if body_at < body_len {
                let len = (body_len - body_at).min(u32::MAX as usize & !4095) as u32;
                // SAFETY: `body_at < body_len`, so the pointer stays inside the caller's range.
                let ptr = unsafe { body_ptr.add(body_at) };
                let flags = libc::MSG_WAITALL | libc::MSG_NOSIGNAL;
                let e = if let (true, Some(hold)) = (zero_copy, hold.as_mut()) {
                    let ud = self.next_zc;
                    self.next_zc += 1;
                    zc_ud = Some(ud);
                    // The hold exists before the send can complete, so the request cannot be
                    // seen as drained in between.
                    self.waiting.push((ud, hold()));
                    on_fd!(
                        self,
                        SendZc::new(ptr, len).buf_index(buf_index).flags(flags)
                    )
                    .user_data(ud)
                } else {
                    on_fd!(self, Send::new(ptr, len).flags(flags)).user_data(UD_BODY)
                };
                if n == 1 {
                    entries[0] = entries[0].take().map(|h| h.flags(squeue::Flags::IO_LINK));
                }
                want[n] = zc_ud.unwrap_or(UD_BODY);
                entries[n] = Some(e);
                n += 1;
            }
            let mut out = [(0i32, 0u32); 2];
            self.run(&entries, &want[..n], &mut out)?;
            let mut k = 0;
            if head_at < head.len() {
                let (res, _) = out[k];
                k += 1;
                if res < 0 && res != -libc::ECANCELED && res != -libc::EINTR && res != -libc::EAGAIN
                {
                    return Err(cqe_err(res));
                }
                if res > 0 {
                    let want_len = head.len() - head_at;
                    if (res as usize) < want_len {
                        IoStats::add(&self.stats.short_sends, 1);
                    }
                    head_at += res as usize;
                }
                if head_at < head.len() {
                    // The body (if linked) was cancelled or not sent; resend in order.
                    if let Some(ud) = zc_ud {
                        let (_, flags) = out[k];
                        if !cqueue::more(flags) {
                            self.release_silently(ud);
                        }
                    }
                    continue;
                }
            }
            if body_at < body_len {
                let (res, flags) = out[k];
                let asked = (body_len - body_at).min(u32::MAX as usize & !4095);
                if let Some(ud) = zc_ud {
                    IoStats::add(&self.stats.zc_sends, 1);
                    if buf_index.is_some() {
                        IoStats::add(&self.stats.fixed_sends, 1);
                    }
                    if !cqueue::more(flags) {
                        // No notification will come for this one.
                        self.release_silently(ud);
                    }
                } else {
                    IoStats::add(&self.stats.copy_sends, 1);
                }
                if res < 0 {
                    if res == -libc::ECANCELED || res == -libc::EINTR || res == -libc::EAGAIN {
                        continue;
                    }
                    return Err(cqe_err(res));
                }
                if (res as usize) < asked {
                    IoStats::add(&self.stats.short_sends, 1);
                }
                body_at += res as usize;
            }
        }
        Ok(())
    }

    fn release_silently(&mut self, ud: u64) {
        release(&mut self.waiting, ud);
    }

    fn pipe(&mut self) -> io::Result<(RawFd, RawFd, usize)> {
        if self.pipe.is_none() {
            // splice(2) has no MSG_NOSIGNAL: a peer gone mid-send raises SIGPIPE at this thread,
            // which would end a host process that has not ignored it. Spliced sends run only on
            // the transport's own stream threads, so block it here (it stays pending, unhandled;
            // the splice itself reports EPIPE).
            // SAFETY: plain signal-mask calls on a local set, for the calling thread only.
            unsafe {
                let mut set: libc::sigset_t = std::mem::zeroed();
                libc::sigemptyset(&mut set);
                libc::sigaddset(&mut set, libc::SIGPIPE);
                libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
            }
            let mut fds = [0i32; 2];
            // SAFETY: `fds` has room for the two descriptors pipe2 writes.
            if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
                return Err(io::Error::last_os_error());
            }
            // SAFETY: pipe2 succeeded, so both are fresh descriptors we now own.
            let (r, w) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
            // SAFETY: F_SETPIPE_SZ on our own pipe; failure leaves the default size.
            let cap = unsafe { libc::fcntl(w.as_raw_fd(), libc::F_SETPIPE_SZ, 1 << 20) };
            let cap = if cap > 0 { cap as usize } else { 64 << 10 };
            self.pipe = Some((r, w, cap));
        }
        match &self.pipe {
            Some((r, w, cap)) => Ok((r.as_raw_fd(), w.as_raw_fd(), *cap)),
            None => Err(io::Error::other("pipe")),
        }
    }

    /// Sends `head` (copied) then `body` by page reference: `vmsplice` maps the body's pages into
    /// a pipe and `splice` moves them to the socket, so a loopback peer's receive is the only
    /// copy. The head goes through the ring (with `MSG_MORE`); the splice is a direct syscall on
    /// this thread, because io_uring always hands IORING_OP_SPLICE to an io-wq worker thread,
    /// a hand-off of two context switches per piece (`docs/performance.md`). There is no completion notification: the caller must not reuse the body
    /// before the peer has acknowledged receiving all of it (the data-plane response does that,
    /// and the TCP ACK it carries frees the retransmit queue's references first).
    ///
    /// # Safety
    /// `body_ptr..body_ptr+body_len` must stay valid and unmodified until the peer acknowledged it.
    pub(crate) unsafe fn send_spliced(
        &mut self,
        head: &[u8],
        body_ptr: *const u8,
        body_len: usize,
    ) -> io::Result<()> {
        let (pr, pw, cap) = self.pipe()?;
        if body_len == 0 {
            return self.send_buf(head);
        }
        let mut head_sent = false;
        let mut body_at = 0usize;
        while body_at < body_len {
            // Fill the pipe with (references to) the next piece of the body.
            let iov = libc::iovec {
                // SAFETY: `body_at < body_len`, inside the caller's range.
                iov_base: unsafe { body_ptr.add(body_at) } as *mut libc::c_void,
                iov_len: (body_len - body_at).min(cap),
            };
            // SAFETY: the iovec points into the caller's range (valid per the contract);
            // vmsplice only takes page references.
            let n = unsafe { libc::vmsplice(pw, &iov, 1, 0) };
            if n < 0 {
                let e = io::Error::last_os_error();
                if e.kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(e);
            }
            let piece = n as usize;
            if !head_sent {
                self.send_flags(head, libc::MSG_MORE)?;
                head_sent = true;
            }
            let mut moved = 0usize;
            while moved < piece {
                let more = if body_at + piece < body_len {
                    libc::SPLICE_F_MORE
                } else {
                    0
                };
                // SAFETY: splice between two descriptors this ring's owner keeps open (the pipe
                // is ours, the socket outlives the ring); no user memory is passed.
                let res = unsafe {
                    libc::splice(
                        pr,
                        std::ptr::null_mut(),
                        self.fd,
                        std::ptr::null_mut(),
                        piece - moved,
                        libc::SPLICE_F_MOVE | more,
                    )
                };
                if res < 0 {
                    let e = io::Error::last_os_error();
                    if matches!(
                        e.kind(),
                        io::ErrorKind::Interrupted | io::ErrorKind::WouldBlock
                    ) {
                        continue;
                    }
                    return Err(e);
                }
                if res == 0 {
                    return Err(io::Error::new(
                        io::ErrorKind::WriteZero,
                        "splice moved nothing",
                    ));
                }
                if moved > 0 || (res as usize) < piece {
                    IoStats::add(&self.stats.short_sends, 1);
                }
                moved += res as usize;
            }
            IoStats::add(&self.stats.spliced_sends, 1);
            body_at += piece;
        }
        Ok(())
    }

    /// Sends all of a Rust buffer through the ring with extra `MSG_*` flags (`MSG_MORE`: more
    /// follows, so the kernel may hold a small head back to coalesce it with the payload).
    fn send_flags(&mut self, buf: &[u8], flags: i32) -> io::Result<()> {
        let mut at = 0usize;
        while at < buf.len() {
            let rest = &buf[at..];
            let e = on_fd!(
                self,
                Send::new(rest.as_ptr(), rest.len() as u32)
                    .flags(libc::MSG_WAITALL | libc::MSG_NOSIGNAL | flags)
            )
            .user_data(UD_HEAD);
            let mut out = [(0i32, 0u32); 1];
            self.run(&[Some(e)], &[UD_HEAD], &mut out)?;
            let res = out[0].0;
            if res < 0 {
                if res == -libc::EINTR || res == -libc::EAGAIN {
                    continue;
                }
                return Err(cqe_err(res));
            }
            if (res as usize) < rest.len() {
                IoStats::add(&self.stats.short_sends, 1);
            }
            at += res as usize;
        }
        Ok(())
    }

    /// Sends `parts` (pointer, length) back to back, each IORING_OP_SENDMSG carrying them all as
    /// one message of iovecs (at most [`MAX_IOV`] per message), resending whatever the kernel did
    /// not take: a vectored request's header, piece table and scattered pieces in one SQE.
    ///
    /// # Safety
    /// Every part must stay valid for reads (and not be written) until the call returns.
    pub(crate) unsafe fn send_vectored(&mut self, parts: &[(*const u8, usize)]) -> io::Result<()> {
        let total: usize = parts.iter().map(|p| p.1).sum();
        let mut sent = 0usize;
        let mut iov: Vec<libc::iovec> = Vec::with_capacity(parts.len().min(MAX_IOV));
        while sent < total {
            iovecs_from(parts, sent, &mut iov);
            // SAFETY: a zeroed msghdr is a valid empty message; we fill in the iovec array only.
            let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
            msg.msg_iov = iov.as_mut_ptr();
            msg.msg_iovlen = iov.len() as _;
            let e = on_fd!(
                self,
                SendMsg::new(&msg as *const libc::msghdr)
                    .flags((libc::MSG_WAITALL | libc::MSG_NOSIGNAL) as u32)
            )
            .user_data(UD_HEAD);
            let mut out = [(0i32, 0u32); 1];
            // `msg` and `iov` live until `run` returns, which waits for the completion.
            self.run(&[Some(e)], &[UD_HEAD], &mut out)?;
            let res = out[0].0;
            if res < 0 {
                if res == -libc::EINTR || res == -libc::EAGAIN {
                    continue;
                }
                return Err(cqe_err(res));
            }
            if (res as usize) < total - sent {
                IoStats::add(&self.stats.short_sends, 1);
            }
            sent += res as usize;
        }
        Ok(())
    }

    /// Receives exactly the bytes of `parts` (pointer, length), back to back, each
    /// IORING_OP_RECVMSG scattering into all of them (a vectored READ's payload into its pieces'
    /// local ranges), with the socket's `SO_RCVLOWAT` raised as [`recv_exact`](Self::recv_exact)
    /// does. End of stream before that is `UnexpectedEof`.
    ///
    /// # Safety
    /// Every part must be valid for writes and not referenced elsewhere during the call.
    pub(crate) unsafe fn recv_vectored(&mut self, parts: &[(*mut u8, usize)]) -> io::Result<()> {
        if self.armed.outstanding {
            return Err(io::Error::other(
                "a receive is armed on this socket: bytes would land out of order",
            ));
        }
        let total: usize = parts.iter().map(|p| p.1).sum();
        let marked = total > LOWAT && !self.lowat_refused;
        let mut iov: Vec<libc::iovec> = Vec::with_capacity(parts.len().min(MAX_IOV));
        let mut got = 0usize;
        let res = loop {
            if got >= total {
                break Ok(());
            }
            let rest = total - got;
            let mut flags = libc::MSG_WAITALL;
            if marked && !self.lowat_refused && self.set_lowat(rest.min(LOWAT)).is_ok() {
                flags = 0;
            }
            let as_const: Vec<(*const u8, usize)> =
                parts.iter().map(|&(p, l)| (p as *const u8, l)).collect();
            iovecs_from(&as_const, got, &mut iov);
            // SAFETY: a zeroed msghdr is a valid empty message; we fill in the iovec array only.
            let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
            msg.msg_iov = iov.as_mut_ptr();
            msg.msg_iovlen = iov.len() as _;
            let e = on_fd!(
                self,
                RecvMsg::new(&mut msg as *mut libc::msghdr).flags(flags as u32)
            )
            .user_data(UD_RECV);
            let mut out = [(0i32, 0u32); 1];
            // `msg` and `iov` live until `run` returns, which waits for the completion.
            if let Err(e) = self.run(&[Some(e)], &[UD_RECV], &mut out) {
                break Err(e);
            }
            let res = out[0].0;
            if res == 0 {
                break Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    format!("peer closed the stream with {rest} of {total} bytes outstanding"),
                ));
            }
            if res < 0 {
                if res == -libc::EINTR || res == -libc::EAGAIN {
                    continue;
                }
                break Err(cqe_err(res));
            }
            got += res as usize;
        };
        if self.lowat > 1 {
            let was = self.lowat;
            if let Err(e) = self.set_lowat(1) {
                return Err(io::Error::new(
                    e.kind(),
                    format!("cannot lower the socket's SO_RCVLOWAT from {was} back to 1: {e}"),
                ));
            }
        }
        res
    }

    /// Sends all of a Rust buffer (copying send).
    pub(crate) fn send_buf(&mut self, buf: &[u8]) -> io::Result<()> {
        // SAFETY: no body: only `buf`, borrowed for the whole call, is read.
        unsafe { self.send(buf, None, None) }
    }

    /// Receives exactly `len` bytes at `ptr`. End of stream before that is `UnexpectedEof`
    /// (with `got` = 0 meaning a clean end before the first byte).
    ///
    /// A payload larger than [`LOWAT`] is received with the socket's `SO_RCVLOWAT` raised to
    /// [`LOWAT`] (to the rest of the payload for its tail): with `MSG_WAITALL` alone the ring
    /// wakes this thread for every segment that arrives (on loopback, about one per 64 KiB)
    /// and copies it; with the low mark it wakes once per [`LOWAT`] at most. The mark is back
    /// to 1 when this returns (a 32-byte request header must wake its receiver).
    ///
    /// # Safety
    /// `ptr..ptr+len` must be valid for writes and not referenced elsewhere during the call.
    pub(crate) unsafe fn recv_exact(&mut self, ptr: *mut u8, len: usize) -> io::Result<()> {
        if self.armed.outstanding {
            return Err(io::Error::other(
                "a receive is armed on this socket: bytes would land out of order",
            ));
        }
        let marked = len > LOWAT && !self.lowat_refused;
        let mut got = 0usize;
        let res = loop {
            if got >= len {
                break Ok(());
            }
            let rest = len - got;
            let ask = rest.min(1 << 30) as u32;
            let mut flags = libc::MSG_WAITALL;
            if marked && !self.lowat_refused && self.set_lowat(rest.min(LOWAT)).is_ok() {
                // Wakes at the mark; returns what is there (at least the mark, or the rest).
                flags = 0;
            }
            // SAFETY: `got < len`, inside the caller's range.
            let at = unsafe { ptr.add(got) };
            let e = on_fd!(self, Recv::new(at, ask).flags(flags)).user_data(UD_RECV);
            let mut out = [(0i32, 0u32); 1];
            if let Err(e) = self.run(&[Some(e)], &[UD_RECV], &mut out) {
                break Err(e);
            }
            let res = out[0].0;
            if res == 0 {
                break Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    format!("peer closed the stream with {rest} of {len} bytes outstanding"),
                ));
            }
            if res < 0 {
                if res == -libc::EINTR || res == -libc::EAGAIN {
                    continue;
                }
                break Err(cqe_err(res));
            }
            if flags != 0 && (res as u32) < ask {
                IoStats::add(&self.stats.short_recvs, 1);
            }
            got += res as usize;
        };
        if self.lowat > 1 {
            let was = self.lowat;
            if let Err(e) = self.set_lowat(1) {
                // A mark left up would keep the next request header (32 bytes) from waking us.
                return Err(io::Error::new(
                    e.kind(),
                    format!("cannot lower the socket's SO_RCVLOWAT from {was} back to 1: {e}"),
                ));
            }
        }
        res
    }

    /// Sets the socket's `SO_RCVLOWAT` to `v` (no call if it is already). If the kernel refuses,
    /// marks are not used on this socket again (`lowat` keeps the value in force).
    fn set_lowat(&mut self, v: usize) -> io::Result<()> {
        if self.lowat == v {
            return Ok(());
        }
        // SAFETY: the socket outlives this ring (its owner's contract), so the descriptor is
        // open for the call.
        let fd = unsafe { std::os::fd::BorrowedFd::borrow_raw(self.fd) };
        if let Err(e) = ferry_net::set_recv_low_mark(fd, v) {
            debug!(error = %e, "SO_RCVLOWAT refused; receiving without it");
            self.lowat_refused = true;
            return Err(e);
        }
        self.lowat = v;
        Ok(())
    }

    /// Receives exactly `buf.len()` bytes into a Rust buffer.
    #[cfg(test)]
    pub(crate) fn recv_buf(&mut self, buf: &mut [u8]) -> io::Result<()> {
        // SAFETY: `buf` is exclusively borrowed for the call.
        unsafe { self.recv_exact(buf.as_mut_ptr(), buf.len()) }
    }

    /// Zero-copy sends still waiting for their notification.
    #[cfg(test)]
    pub(crate) fn pending_notifications(&self) -> usize {
        self.waiting.len()
    }

    /// Makes [`SockIo::wait`] end as soon as `fd` (an eventfd, which must outlive
    /// this ring) is written.
    pub(crate) fn set_wake(&mut self, fd: RawFd) {
        // Leaked on purpose (8 bytes per stream): a read armed when the ring closes may still be
        // completed by the kernel while it tears the ring down.
        self.wake = Some((fd, Box::leak(Box::new([0u8; 8])), false));
    }

    /// Waits up to `timeout` for the next completion: a zero-copy notification (releasing its
    /// hold), the armed receive, or a write of the wake eventfd.
    pub(crate) fn wait(&mut self, timeout: Duration) {
        if self.poisoned {
            return;
        }
        if let Some((fd, buf, armed)) = self.wake.as_mut()
            && !*armed
        {
            let e = opcode::Read::new(types::Fd(*fd), buf.as_mut_ptr(), 8)
                .build()
                .user_data(UD_WAKE);
            // SAFETY: the buffer is leaked, so it outlives the read whatever happens to the ring.
            if unsafe { self.ring.submission().push(&e) }.is_ok() {
                *armed = true;
            }
        }
        let ts = types::Timespec::new()
            .sec(timeout.as_secs())
            .nsec(timeout.subsec_nanos());
        if self.ring.params().is_feature_ext_arg() {
            // The wait's own deadline (one io_uring_enter, no timeout request to arm and
            // complete): ends at the first completion or at the deadline (ETIME).
            let args = types::SubmitArgs::new().timespec(&ts);
            match self.ring.submitter().submit_with_args(1, &args) {
                Ok(_) => {}
                Err(e) if matches!(e.raw_os_error(), Some(libc::ETIME | libc::EINTR)) => {}
                Err(e) => debug!(error = %e, "waiting on the ring"),
            }
            self.reap(&[], &mut [], &mut [false; 2]);
            return;
        }
        // Ends at the first completion or at the deadline.
        let e = opcode::Timeout::new(&ts)
            .count(1)
            .build()
            .user_data(UD_TIMEOUT);
        let mut out = [(0i32, 0u32); 1];
        if let Err(e) = self.run(&[Some(e)], &[UD_TIMEOUT], &mut out) {
            debug!(error = %e, "waiting on the ring");
        }
    }

    /// Starts a receive of `len` bytes (at most [`ARMED_MAX`], all of them unless the stream
    /// ends or fails) into the ring's own buffer and returns at once. Its completion is met by
    /// the next wait on this ring (a send, [`SockIo::wait`]) and read with
    /// [`SockIo::take_armed`]. One at a time; no other receive may run on the socket meanwhile.
    pub(crate) fn arm_recv(&mut self, len: usize) -> io::Result<()> {
        let len = len.min(ARMED_MAX);
        if self.armed.outstanding || self.armed.done.is_some() {
            return Err(io::Error::other("a receive is already armed"));
        }
        let Some(buf) = self.armed.buf.as_mut() else {
            return Err(io::Error::other("armed receive buffer gone"));
        };
        let ptr = buf.as_mut_ptr();
        let e =
            on_fd!(self, Recv::new(ptr, len as u32).flags(libc::MSG_WAITALL)).user_data(UD_ARMED);
        // SAFETY: the buffer is owned by this ring and freed only once no receive into it is
        // outstanding (else leaked, see Drop).
        if unsafe { self.ring.submission().push(&e) }.is_err() {
            return Err(io::Error::other("io_uring submission queue full"));
        }
        self.armed.len = len;
        self.armed.outstanding = true;
        Ok(())
    }

    /// Starts a one-shot poll for the socket's hang-up or error (`POLLRDHUP`, `POLLHUP`,
    /// `POLLERR`; not `POLLIN`, so bytes arriving do not end it and do not wake the ring's
    /// thread) unless one is outstanding or fired and not yet taken. Its end is met by the next
    /// wait on this ring and read with [`SockIo::take_hangup`]. It carries no buffer.
    pub(crate) fn arm_hangup(&mut self) -> io::Result<()> {
        if self.hangup.0 || self.hangup.1 {
            return Ok(());
        }
        let mask = (libc::POLLRDHUP | libc::POLLHUP | libc::POLLERR) as u32;
        let e = on_fd!(self, PollAdd::new(mask)).user_data(UD_HANGUP);
        // SAFETY: a poll carries no buffer.
        if unsafe { self.ring.submission().push(&e) }.is_err() {
            return Err(io::Error::other("io_uring submission queue full"));
        }
        self.hangup.0 = true;
        Ok(())
    }

    /// Whether the hang-up poll ended since the last look (and forgets that it did).
    pub(crate) fn take_hangup(&mut self) -> bool {
        std::mem::take(&mut self.hangup.1)
    }

    /// Whether an armed receive is outstanding or completed and not yet taken.
    pub(crate) fn armed(&self) -> bool {
        self.armed.outstanding || self.armed.done.is_some()
    }

    /// The bytes of a completed armed receive (empty: the peer closed the stream), its error, or
    /// `None` while it is still outstanding (or none was armed). Interrupted receives are armed
    /// again here.
    pub(crate) fn take_armed(&mut self) -> Option<io::Result<&[u8]>> {
        let res = self.armed.done?;
        self.armed.done = None;
        if res == -libc::EINTR || res == -libc::EAGAIN {
            return match self.arm_recv(self.armed.len) {
                Ok(()) => None,
                Err(e) => Some(Err(e)),
            };
        }
        if res < 0 {
            return Some(Err(cqe_err(res)));
        }
        if (res as usize) < self.armed.len && res > 0 {
            IoStats::add(&self.stats.short_recvs, 1);
        }
        let buf = self.armed.buf.as_deref()?;
        Some(Ok(&buf[..(res as usize).min(ARMED_MAX)]))
    }

    /// Waits until the kernel has let go of every zero-copy send (its notification), which
    /// releases the holds that keep their requests from reporting `drained`. Used when a stream
    /// ends. A send is normally let go once the peer acknowledged it; if some are still held
    /// after `grace` (a peer that stopped acknowledging, a cut link), the connection is reset,
    /// which purges the socket's queues and so ends the kernel's use of those pages, and the
    /// wait goes on. A hold is never released before its notification, so a request cannot
    /// report `drained` while the kernel may still read its buffers; if the kernel keeps them
    /// after the reset too (a driver that never completes a transmit), this warns every
    /// `grace * 10` and keeps waiting.
    pub(crate) fn finish(&mut self, grace: Duration) {
        let mut deadline = Instant::now() + grace;
        let mut reset = false;
        while !self.waiting.is_empty() {
            let now = Instant::now();
            if now >= deadline {
                if reset {
                    tracing::warn!(
                        pending = self.waiting.len(),
                        "zero-copy sends still held by the kernel after the connection was \
                         reset; their requests stay un-drained until it lets go"
                    );
                } else {
                    tracing::debug!(
                        pending = self.waiting.len(),
                        "zero-copy sends unacknowledged after {grace:?}; resetting the connection"
                    );
                    if let Err(e) = self.reset() {
                        tracing::warn!(error = %e, "cannot reset the connection");
                    }
                    reset = true;
                }
                deadline = now + grace * 10;
            }
            self.wait((deadline - now).min(Duration::from_millis(50)));
        }
    }

    /// Aborts the connection: a reset to the peer, and the socket's send and retransmit queues
    /// purged (`connect` to an `AF_UNSPEC` address, which Linux turns into `tcp_disconnect`).
    fn reset(&self) -> io::Result<()> {
        // SAFETY: a zeroed sockaddr is a valid AF_UNSPEC (0) address; connect only reads
        // `size_of::<sockaddr>()` bytes of it, and `fd` is the socket this ring serves.
        let rc = unsafe {
            let addr: libc::sockaddr = std::mem::zeroed();
            libc::connect(
                self.fd,
                &addr,
                std::mem::size_of::<libc::sockaddr>() as libc::socklen_t,
            )
        };
        if rc != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }
}

impl<H> Drop for SockIo<H> {
    fn drop(&mut self) {
        if self.armed.outstanding && self.poisoned {
            // The ring cannot be waited on: the armed receive's buffer is the kernel's for good.
            std::mem::forget(self.armed.buf.take());
        } else if self.armed.outstanding {
            // The owner shuts the socket down before it lets the ring go, which ends the
            // receive; give it a moment, and cancel it if it still runs.
            let cancel = opcode::AsyncCancel::new(UD_ARMED)
                .build()
                .user_data(UD_CANCEL);
            // SAFETY: a cancel carries no buffer.
            let _ = unsafe { self.ring.submission().push(&cancel) };
            let end = Instant::now() + Duration::from_millis(100);
            while self.armed.outstanding && Instant::now() < end {
                self.wait(Duration::from_millis(10));
            }
            if self.armed.outstanding {
                // The kernel may still write it after the ring closes: never free it.
                std::mem::forget(self.armed.buf.take());
            }
        }
    }
}

fn release<H>(waiting: &mut Vec<(u64, H)>, ud: u64) {
    if let Some(i) = waiting.iter().position(|(u, _)| *u == ud) {
        drop(waiting.swap_remove(i));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;
    use std::net::{TcpListener, TcpStream};
    use std::os::fd::AsRawFd;
    use std::sync::atomic::AtomicUsize;

    struct Counted(Arc<AtomicUsize>);
    impl Drop for Counted {
        fn drop(&mut self) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    fn pair() -> (TcpStream, TcpStream) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let a = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (b, _) = l.accept().unwrap();
        (a, b)
    }

    /// SEND_ZC from a registered region, and from one too large to register (the unregistered
    /// fallback); every hold is released by its notification, and the bytes arrive in order.
    #[test]
    fn zero_copy_sends_release_holds_and_fall_back_to_unregistered() {
        if crate::probe_kernel().unusable_reason().is_some()
            || !crate::probe_kernel().supports("SEND_ZC")
        {
            ferry_tests::require_or_skip(ferry_tests::URING, "io_uring or SEND_ZC unavailable");
            return;
        }
        let (a, mut b) = pair();
        let stats = Arc::new(IoStats::default());
        let mut io: SockIo<Counted> =
            SockIo::new(a.as_raw_fd(), true, true, stats.clone()).unwrap();
        let small = Arc::new(MemoryRegion::alloc_zeroed(1 << 20, 4096).unwrap());
        small.write_at(0, &[7u8; 1 << 20]).unwrap();
        // Larger than the kernel registers in one buffer: sent unregistered.
        let huge = Arc::new(MemoryRegion::alloc_zeroed((1 << 30) + 4096, 4096).unwrap());
        huge.write_at(1 << 30, &[9u8; 4096]).unwrap();
        let reader = std::thread::spawn(move || {
            let mut v = vec![0u8; 3 + (1 << 20) + 3 + 4096];
            b.read_exact(&mut v).unwrap();
            v
        });
        let released = Arc::new(AtomicUsize::new(0));
        let mut hold = || Counted(released.clone());
        // SAFETY: both regions outlive the sends (they live until the end of the test, after
        // `drain`), and nothing writes them meanwhile.
        unsafe {
            io.send(
                b"abc",
                Some(Body {
                    region: &small,
                    offset: 0,
                    len: 1 << 20,
                }),
                Some(&mut hold),
            )
            .unwrap();
            io.send(
                b"def",
                Some(Body {
                    region: &huge,
                    offset: 1 << 30,
                    len: 4096,
                }),
                Some(&mut hold),
            )
            .unwrap();
        }
        let got = reader.join().unwrap();
        io.finish(Duration::from_secs(5));
        assert_eq!(io.pending_notifications(), 0);
        let zc = stats.zc_sends.load(Ordering::SeqCst);
        assert!(zc >= 2, "{zc}");
        assert_eq!(
            released.load(Ordering::SeqCst) as u64,
            zc,
            "a hold was not released"
        );
        assert_eq!(
            stats.fixed_sends.load(Ordering::SeqCst),
            1,
            "only the small region is registered"
        );
        assert_eq!(&got[..3], b"abc");
        assert!(got[3..3 + (1 << 20)].iter().all(|&x| x == 7));
        assert_eq!(&got[3 + (1 << 20)..6 + (1 << 20)], b"def");
        assert!(got[6 + (1 << 20)..].iter().all(|&x| x == 9));
    }

    /// A zero-copy send the peer never takes (its window is full) keeps its hold until the
    /// stream finishes: `finish` waits out the grace, resets the connection (the peer sees
    /// ECONNRESET), and only then, with the kernel's queues purged, is the hold released.
    #[test]
    fn finish_resets_a_connection_whose_zero_copy_sends_are_never_acknowledged() {
        if crate::probe_kernel().unusable_reason().is_some()
            || !crate::probe_kernel().supports("SEND_ZC")
        {
            ferry_tests::require_or_skip(ferry_tests::URING, "io_uring or SEND_ZC unavailable");
            return;
        }
        // A tiny receive window (set on the listener, so the handshake advertises it) and a
        // send buffer that holds the whole payload, so the send completes while its pages
        // stay queued.
        let l = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
        l.set_recv_buffer_size(4096).unwrap();
        l.bind(
            &"127.0.0.1:0"
                .parse::<std::net::SocketAddr>()
                .unwrap()
                .into(),
        )
        .unwrap();
        l.listen(1).unwrap();
        let l: TcpListener = l.into();
        let a = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        socket2::SockRef::from(&a)
            .set_send_buffer_size(1 << 20)
            .unwrap();
        let (mut b, _) = l.accept().unwrap();
        let released = Arc::new(AtomicUsize::new(0));
        // `finish` never gives up on a hold, so a regression would hang: the ring (which
        // belongs to the thread that made it) lives on a thread of its own, and the test fails
        // after a bound.
        let (tx, rx) = std::sync::mpsc::channel();
        let counter = released.clone();
        std::thread::spawn(move || {
            let stats = Arc::new(IoStats::default());
            let mut io: SockIo<Counted> =
                SockIo::new(a.as_raw_fd(), true, false, stats.clone()).unwrap();
            let region = Arc::new(MemoryRegion::alloc_zeroed(64 << 10, 4096).unwrap());
            let mut hold = || Counted(counter.clone());
            // SAFETY: the region outlives the send (it lives to the end of this thread, after
            // `finish`), and nothing writes it meanwhile.
            unsafe {
                io.send(
                    b"head",
                    Some(Body {
                        region: &region,
                        offset: 0,
                        len: 64 << 10,
                    }),
                    Some(&mut hold),
                )
                .unwrap();
            }
            io.wait(Duration::from_millis(200));
            let before = counter.load(Ordering::SeqCst);
            let t0 = Instant::now();
            io.finish(Duration::from_millis(100));
            let _ = tx.send((
                stats.zc_sends.load(Ordering::SeqCst),
                before,
                t0.elapsed(),
                io.pending_notifications(),
            ));
            drop(io);
            drop(a);
        });
        let (zc, before, took, pending) = rx
            .recv_timeout(Duration::from_secs(20))
            .expect("finish never returned: the hold was never released");
        assert_eq!(zc, 1);
        assert_eq!(before, 0, "released while the peer had not taken the bytes");
        assert!(took >= Duration::from_millis(100), "no grace: {took:?}");
        assert_eq!(pending, 0);
        assert_eq!(released.load(Ordering::SeqCst), 1);
        b.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let mut buf = vec![0u8; 128 << 10];
        let err = loop {
            match b.read(&mut buf) {
                Ok(0) => panic!("orderly end instead of a reset"),
                Ok(_) => {}
                Err(e) => break e,
            }
        };
        assert_eq!(err.kind(), std::io::ErrorKind::ConnectionReset, "{err}");
    }

    /// A receive armed before a send is reaped by that send's wait (or a later wait), a second
    /// receive is refused while it is outstanding, and a ring dropped with a receive still
    /// outstanding (the socket open, nothing arriving) cancels it without hanging.
    #[test]
    fn armed_receive_completes_beside_sends() {
        if crate::probe_kernel().unusable_reason().is_some() {
            ferry_tests::require_or_skip(ferry_tests::URING, "io_uring unavailable");
            return;
        }
        let (a, mut b) = pair();
        let mut io: SockIo<()> = SockIo::new(a.as_raw_fd(), false, true, Arc::default()).unwrap();
        io.arm_recv(8).unwrap();
        assert!(io.armed());
        assert!(io.arm_recv(8).is_err(), "second armed receive");
        let mut x = [0u8; 4];
        // SAFETY: `x` is a local buffer, exclusively borrowed.
        let e = unsafe { io.recv_exact(x.as_mut_ptr(), 4) }.unwrap_err();
        assert!(e.to_string().contains("armed"), "{e}");
        assert!(io.take_armed().is_none(), "nothing arrived yet");
        use std::io::Write;
        b.write_all(b"response").unwrap();
        io.send_buf(b"request").unwrap();
        let end = Instant::now() + Duration::from_secs(5);
        let bytes = loop {
            if let Some(r) = io.take_armed() {
                break r.unwrap().to_vec();
            }
            assert!(Instant::now() < end, "armed receive never completed");
            io.wait(Duration::from_millis(50));
        };
        assert_eq!(bytes, b"response");
        assert!(!io.armed());
        let mut got = [0u8; 7];
        b.read_exact(&mut got).unwrap();
        assert_eq!(&got, b"request");
        // Armed again with nothing to come: dropping the ring cancels it.
        io.arm_recv(4).unwrap();
        io.send_buf(b"x").unwrap();
        let t = Instant::now();
        drop(io);
        assert!(t.elapsed() < Duration::from_secs(2));
        drop(a);
    }

    fn rcvlowat(fd: std::os::fd::RawFd) -> usize {
        // SAFETY: the tests pass descriptors of sockets they hold open.
        let fd = unsafe { std::os::fd::BorrowedFd::borrow_raw(fd) };
        ferry_net::recv_low_mark(fd).unwrap()
    }

    /// A payload larger than the low mark, arriving in small pieces with pauses, lands whole
    /// (its tail below the mark too), and the mark is back to 1 afterwards, so a 32-byte header
    /// that follows alone still completes.
    #[test]
    fn large_receives_use_the_low_mark_and_lower_it_again() {
        if crate::probe_kernel().unusable_reason().is_some() {
            ferry_tests::require_or_skip(ferry_tests::URING, "io_uring unavailable");
            return;
        }
        let (mut a, b) = pair();
        let mut io: SockIo<()> = SockIo::new(b.as_raw_fd(), false, true, Arc::default()).unwrap();
        let len = 3 * LOWAT + 1234;
        let data: Vec<u8> = (0..len + 32).map(|i| (i * 7 % 251) as u8).collect();
        let send = data.clone();
        let writer = std::thread::spawn(move || {
            use std::io::Write;
            for piece in send[..len].chunks(50_000) {
                a.write_all(piece).unwrap();
                std::thread::sleep(Duration::from_millis(2));
            }
            std::thread::sleep(Duration::from_millis(50));
            a.write_all(&send[len..]).unwrap();
            a
        });
        let mut got = vec![0u8; len];
        // SAFETY: `got` is a local buffer, exclusively borrowed.
        unsafe { io.recv_exact(got.as_mut_ptr(), len) }.unwrap();
        assert!(got == data[..len], "payload differs");
        assert_eq!(rcvlowat(b.as_raw_fd()), 1);
        let mut head = [0u8; 32];
        io.recv_buf(&mut head).unwrap();
        assert_eq!(head[..], data[len..]);
        drop(writer.join().unwrap());
    }

    #[test]
    fn receive_reports_a_clean_end() {
        if crate::probe_kernel().unusable_reason().is_some() {
            ferry_tests::require_or_skip(ferry_tests::URING, "io_uring unavailable");
            return;
        }
        let (a, b) = pair();
        let mut io: SockIo<()> = SockIo::new(a.as_raw_fd(), false, false, Arc::default()).unwrap();
        drop(b);
        let mut buf = [0u8; 16];
        let e = io.recv_buf(&mut buf).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::UnexpectedEof);
    }
}
