//! The ring host and its toolkit: [`host::Host`], one type that runs a ring thread's streams
//! (the client's and the server's), over the kernel's ring as [`kernel::Ring`] has it, woken
//! through its thread's [`inbox::Inbox`], with operations named by [`user_data`]; and beside it
//! what both sides share: the transport's counters, the count of ring threads, registered-buffer
//! slots, and the iovecs of a message's rest.

#[cfg(test)]
pub(crate) mod fake;
pub(crate) mod host;
pub(crate) mod inbox;
pub(crate) mod kernel;
pub(crate) mod user_data;

use std::io;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};

use ferry_core::MemoryRegion;
use io_uring::{IoUring, squeue};
use tracing::debug;

/// Fixed-buffer slots per ring.
const BUF_SLOTS: u32 = 32;
/// Largest buffer the kernel registers (it refuses single buffers above 1 GiB).
const MAX_FIXED_BUF: usize = 1 << 30;

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
    /// Of those, responses the stream's ring read instead because they waited unread for a
    /// tick (the awaiting task was not polling): the request completes all the same.
    pub caller_takeovers: AtomicU64,
}

impl IoStats {
    pub(crate) fn add(c: &AtomicU64, n: u64) {
        c.fetch_add(n, Ordering::Relaxed);
    }
}

/// Counts a live ring thread (the client's or the server's) in [`IoStats::threads`] while held.
#[derive(Debug)]
pub(crate) struct ThreadCount {
    stats: Arc<IoStats>,
}

impl ThreadCount {
    pub(crate) fn new(stats: &Arc<IoStats>) -> Self {
        stats.threads.fetch_add(1, Ordering::Relaxed);
        Self {
            stats: stats.clone(),
        }
    }
}

impl Drop for ThreadCount {
    fn drop(&mut self) {
        self.stats.threads.fetch_sub(1, Ordering::Relaxed);
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

/// Pushes one entry, submitting what is queued first if the queue is full.
///
/// # Safety
/// Every pointer of `e` must stay valid until its completion is reaped.
pub(crate) unsafe fn push(ring: &mut IoUring, e: &squeue::Entry) -> io::Result<()> {
    loop {
        // SAFETY: the caller's contract.
        if unsafe { ring.submission().push(e) }.is_ok() {
            return Ok(());
        }
        submit(ring, false)?;
    }
}

/// Submits what is queued, waiting for one completion if `wait`.
pub(crate) fn submit(ring: &mut IoUring, wait: bool) -> io::Result<()> {
    loop {
        let r = if wait {
            ring.submit_and_wait(1)
        } else {
            ring.submit()
        };
        match r {
            Ok(_) => return Ok(()),
            Err(e) if e.raw_os_error() == Some(libc::EINTR) => {}
            // A full completion queue or a transient shortage: reaping makes room.
            Err(e) if matches!(e.raw_os_error(), Some(libc::EBUSY | libc::EAGAIN)) => {
                return Ok(());
            }
            Err(e) => return Err(e),
        }
    }
}

/// Starts a ring's thread named `name`: `make` builds its driver there (a ring belongs to the
/// thread that made it, and its operations point into memory that never leaves it), the thread
/// pinned to the `pin`-th CPU this process may run on if asked, then `run` runs it. Returns once
/// the driver was made, or with the error that kept it from being made.
pub(crate) fn spawn_ring<D: 'static>(
    name: String,
    pin: Option<usize>,
    make: impl FnOnce() -> io::Result<D> + Send + 'static,
    run: impl FnOnce(D) + Send + 'static,
) -> io::Result<()> {
    let (made_tx, made_rx) = std::sync::mpsc::sync_channel(1);
    let what = name.clone();
    std::thread::Builder::new()
        .name(name)
        .spawn(move || match make() {
            Ok(d) => {
                if let Some(i) = pin {
                    crate::tune::pin_stream_thread(i);
                }
                let _ = made_tx.send(Ok(()));
                run(d);
            }
            Err(e) => {
                let _ = made_tx.send(Err(e));
            }
        })?;
    made_rx
        .recv()
        .map_err(|_| io::Error::other(format!("ring thread {what} ended at its start")))?
}

/// A ring of `sq` submission and `cq` completion entries, made and entered only by the calling
/// thread: single issuer, and task work deferred to when that thread waits (so none runs while
/// it is in another system call). Older kernels: a plain ring.
pub(crate) fn new_ring(sq: u32, cq: u32) -> io::Result<IoUring> {
    match IoUring::builder()
        .setup_cqsize(cq)
        .setup_single_issuer()
        .setup_defer_taskrun()
        .build(sq)
    {
        Ok(r) => Ok(r),
        Err(_) => IoUring::builder().setup_cqsize(cq).build(sq),
    }
}
