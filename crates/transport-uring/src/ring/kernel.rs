//! The kernel's ring as a ring host uses it ([`Ring`]): submissions, one wait, completions, fixed
//! files and registered buffers. [`Uring`] is the real one; the host's tests run on a fake.

use std::io;
use std::os::fd::RawFd;
use std::sync::Arc;
use std::time::Duration;

use ferry_core::MemoryRegion;
use io_uring::{IoUring, squeue, types};

use super::{BufCache, IoStats, new_ring, push, submit};

/// One completion: user data, result, flags.
pub(crate) type Cqe = (u64, i32, u32);

/// What a ring host asks of its ring.
pub(crate) trait Ring {
    /// Queues `e` (submitting what is queued first if the queue is full).
    ///
    /// # Safety
    /// Every pointer of `e` must stay valid until its completion is reaped.
    unsafe fn push(&mut self, e: &squeue::Entry) -> io::Result<()>;
    /// Submits what is queued and, with `wait`, waits for a completion (at most `timeout`,
    /// where the kernel takes one): whether the wait timed out.
    fn enter(&mut self, wait: bool, timeout: Option<Duration>) -> io::Result<bool>;
    /// Appends the completions that came to `into`.
    fn reap(&mut self, into: &mut Vec<Cqe>);
    /// Registers `fd` as fixed file `slot`: the slot, where the ring has one for it.
    fn register_file(&mut self, slot: usize, fd: RawFd) -> Option<u32>;
    /// Lets fixed file `slot` go.
    fn unregister_file(&mut self, slot: u32);
    /// The registered-buffer index covering `region`, registering it where possible.
    fn buf_index(&mut self, region: &Arc<MemoryRegion>, stats: &IoStats) -> Option<u16>;
}

/// How a [`Uring`] is made.
#[derive(Clone, Copy, Debug)]
pub(crate) struct RingSize {
    /// Submission entries (more are submitted in several calls).
    pub(crate) sq: u32,
    /// Completion entries (the kernel keeps an overflow beyond them).
    pub(crate) cq: u32,
    /// Fixed-file slots: streams past them use their plain descriptor.
    pub(crate) files: u32,
}

/// An io_uring of the calling thread, with its fixed files and registered buffers.
pub(crate) struct Uring {
    ring: IoUring,
    /// Fixed-file slots registered (0: none).
    files: u32,
    bufs: BufCache,
}

impl Uring {
    /// A ring of `size`, made and entered only by the calling thread; with `register`, sockets
    /// become fixed files and, with `zero_copy` too, buffers are registered for SEND_ZC.
    pub(crate) fn new(size: RingSize, register: bool, zero_copy: bool) -> io::Result<Self> {
        let ring = new_ring(size.sq, size.cq)?;
        let files = if register && ring.submitter().register_files_sparse(size.files).is_ok() {
            size.files
        } else {
            0
        };
        let bufs = BufCache::new(&ring, register && zero_copy);
        Ok(Self { ring, files, bufs })
    }
}

impl Ring for Uring {
    unsafe fn push(&mut self, e: &squeue::Entry) -> io::Result<()> {
        // SAFETY: the caller's contract.
        unsafe { push(&mut self.ring, e) }
    }

    fn enter(&mut self, wait: bool, timeout: Option<Duration>) -> io::Result<bool> {
        let Some(t) = timeout.filter(|_| wait && self.ring.params().is_feature_ext_arg()) else {
            submit(&mut self.ring, wait)?;
            return Ok(false);
        };
        let ts = types::Timespec::new()
            .sec(t.as_secs())
            .nsec(t.subsec_nanos());
        let args = types::SubmitArgs::new().timespec(&ts);
        match self.ring.submitter().submit_with_args(1, &args) {
            Ok(_) => Ok(false),
            Err(e) if e.raw_os_error() == Some(libc::ETIME) => Ok(true),
            // Interrupted, a full completion queue or a transient shortage: reaping goes on.
            Err(e)
                if matches!(
                    e.raw_os_error(),
                    Some(libc::EINTR | libc::EBUSY | libc::EAGAIN)
                ) =>
            {
                Ok(false)
            }
            Err(e) => Err(e),
        }
    }

    fn reap(&mut self, into: &mut Vec<Cqe>) {
        into.extend(
            self.ring
                .completion()
                .map(|c| (c.user_data(), c.result(), c.flags())),
        );
    }

    fn register_file(&mut self, slot: usize, fd: RawFd) -> Option<u32> {
        if slot >= self.files as usize {
            return None;
        }
        self.ring
            .submitter()
            .register_files_update(slot as u32, &[fd])
            .ok()
            .map(|_| slot as u32)
    }

    fn unregister_file(&mut self, slot: u32) {
        let _ = self.ring.submitter().register_files_update(slot, &[-1]);
    }

    fn buf_index(&mut self, region: &Arc<MemoryRegion>, stats: &IoStats) -> Option<u16> {
        self.bufs.index(&self.ring, region, stats)
    }
}
