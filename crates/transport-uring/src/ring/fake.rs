//! A fake ring for tests of ring hosts and their streams: it runs nothing, it records what was
//! queued and submitted by user data, and completes only what a test says.

use std::collections::VecDeque;
use std::io;
use std::os::fd::RawFd;
use std::sync::Arc;
use std::time::Duration;

use ferry_core::MemoryRegion;
use io_uring::{cqueue, squeue};

use super::IoStats;
use super::host::{K_NOP, MAX_STREAM_KIND};
use super::kernel::{Cqe, Ring};
use super::user_data::{self, Decoded};

/// A ring that queues entries by user data and completes only what the test says.
#[derive(Default)]
pub(crate) struct Fake {
    pub(crate) queued: Vec<u64>,
    pub(crate) submitted: Vec<u64>,
    pub(crate) done: VecDeque<Cqe>,
    /// On a wait with nothing completed, complete every submitted operation with `-ECANCELED`
    /// (a shut-down socket's).
    pub(crate) cancel_on_wait: bool,
    /// Waits that found nothing completed (the ring would sleep).
    pub(crate) waits: usize,
    pub(crate) files: Vec<u32>,
}

impl Ring for Fake {
    unsafe fn push(&mut self, e: &squeue::Entry) -> io::Result<()> {
        self.queued.push(e.get_user_data());
        Ok(())
    }

    fn enter(&mut self, wait: bool, _timeout: Option<Duration>) -> io::Result<bool> {
        self.submitted.append(&mut self.queued);
        // A no-op completes at once.
        let nop =
            |u: &u64| matches!(user_data::decode(*u), Decoded::Op { kind, .. } if kind == K_NOP);
        for u in self.submitted.iter().filter(|u| nop(u)) {
            self.done.push_back((*u, 0, 0));
        }
        self.submitted.retain(|u| !nop(u));
        if wait && self.done.is_empty() {
            self.waits += 1;
            if self.cancel_on_wait {
                for u in self.submitted.drain(..) {
                    self.done.push_back((u, -libc::ECANCELED, 0));
                }
            }
        }
        Ok(false)
    }

    fn reap(&mut self, into: &mut Vec<Cqe>) {
        into.extend(self.done.drain(..));
    }

    fn register_file(&mut self, slot: usize, _fd: RawFd) -> Option<u32> {
        self.files.push(slot as u32);
        Some(slot as u32)
    }

    fn unregister_file(&mut self, slot: u32) {
        self.files.retain(|&f| f != slot);
    }

    fn buf_index(&mut self, _region: &Arc<MemoryRegion>, _stats: &IoStats) -> Option<u16> {
        None
    }
}

impl Fake {
    /// Completes the submitted operation with user data `u`.
    pub(crate) fn complete(&mut self, u: u64, res: i32, flags: u32) {
        let at = self.submitted.iter().position(|&s| s == u);
        assert!(at.is_some(), "{u:#x} was not submitted");
        if !cqueue::more(flags) {
            self.submitted.retain(|&s| s != u);
        }
        self.done.push_back((u, res, flags));
    }

    /// The submitted stream operations (the host's own left out).
    pub(crate) fn ops(&self) -> Vec<u64> {
        let own = |u: &&u64| matches!(user_data::decode(**u), Decoded::Op { kind, .. } if kind > MAX_STREAM_KIND);
        self.submitted.iter().filter(|u| !own(u)).copied().collect()
    }
}
