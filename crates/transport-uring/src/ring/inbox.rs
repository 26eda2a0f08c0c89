//! A ring thread's inbox, the one wake protocol of every ring: other threads leave new streams
//! and the names of streams to run in it, and write the ring's eventfd only while the ring's
//! thread waits (or is about to) in the kernel. The ring looks at the inbox after it said it
//! waits and before it does, so nothing left there is missed.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

/// An eventfd a ring reads, so that a write of it ends the ring's wait.
#[derive(Debug)]
pub(crate) struct EventFd(pub(crate) OwnedFd);

impl EventFd {
    pub(crate) fn new() -> std::io::Result<Self> {
        // SAFETY: plain eventfd creation; the result is checked before use.
        let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC) };
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: eventfd returned a fresh descriptor that we now own.
        Ok(Self(unsafe { OwnedFd::from_raw_fd(fd) }))
    }

    /// Writes the eventfd (its reader's wait ends).
    pub(crate) fn wake_now(&self) {
        let one = 1u64.to_ne_bytes();
        // SAFETY: writing 8 bytes from a local array to our own eventfd.
        let _ = unsafe { libc::write(self.0.as_raw_fd(), one.as_ptr().cast(), 8) };
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    match m.lock() {
        Ok(g) => g,
        Err(p) => p.into_inner(),
    }
}

/// A ring's mailbox: streams handed to it (`N`), names of streams woken, and the eventfd whose
/// read ends the ring's wait.
pub(crate) struct Inbox<N> {
    news: Mutex<Vec<N>>,
    woken: Mutex<Vec<u64>>,
    pub(crate) fd: Arc<EventFd>,
    /// The ring's thread is (about to be) waiting in the kernel: a wake-up must write the
    /// eventfd. While it runs it looks at the inbox before it waits again.
    asleep: AtomicBool,
}

impl<N> std::fmt::Debug for Inbox<N> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Inbox")
            .field("fd", &self.fd)
            .field("asleep", &self.asleep)
            .finish_non_exhaustive()
    }
}

impl<N> Inbox<N> {
    pub(crate) fn new() -> std::io::Result<Self> {
        Ok(Self {
            news: Mutex::new(Vec::new()),
            woken: Mutex::new(Vec::new()),
            fd: Arc::new(EventFd::new()?),
            asleep: AtomicBool::new(false),
        })
    }

    /// Hands a new stream to the ring.
    pub(crate) fn hand(&self, n: N) {
        lock(&self.news).push(n);
        self.poke();
    }

    /// Has the ring run stream `id` (the ring's own name for it) at its next turn.
    pub(crate) fn wake(&self, id: u64) {
        lock(&self.woken).push(id);
        self.poke();
    }

    /// Ends the ring's wait if it waits, so that it looks at what it shares (a stop flag, say).
    pub(crate) fn poke(&self) {
        if self.asleep.swap(false, Ordering::SeqCst) {
            self.fd.wake_now();
        }
    }

    /// Ends the ring's wait whether or not it said it waits (its shutdown, which waits for the
    /// eventfd's read to end).
    pub(crate) fn wake_now(&self) {
        self.fd.wake_now();
    }

    /// The streams handed over since the last look (and forgets them).
    pub(crate) fn take_news(&self, into: &mut Vec<N>) {
        into.append(&mut lock(&self.news));
    }

    /// The streams woken since the last look (and forgets them).
    pub(crate) fn take_woken(&self, into: &mut Vec<u64>) {
        into.append(&mut lock(&self.woken));
    }

    /// The ring's thread is about to wait: whether it may (nothing was left in the inbox since
    /// its last look; if something was, it does not wait and looks again).
    pub(crate) fn may_sleep(&self) -> bool {
        self.asleep.store(true, Ordering::SeqCst);
        if !lock(&self.news).is_empty() || !lock(&self.woken).is_empty() {
            self.asleep.store(false, Ordering::SeqCst);
            return false;
        }
        true
    }

    /// The ring's thread is awake again.
    pub(crate) fn awake(&self) {
        self.asleep.store(false, Ordering::SeqCst);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn poked(w: &EventFd) -> bool {
        let mut b = [0u8; 8];
        // SAFETY: a non-blocking poll then read of our own eventfd into a local buffer.
        unsafe {
            let mut p = libc::pollfd {
                fd: w.0.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            };
            if libc::poll(&mut p, 1, 0) != 1 {
                return false;
            }
            libc::read(w.0.as_raw_fd(), b.as_mut_ptr().cast(), 8) == 8
        }
    }

    /// A wake-up while the ring runs is left in the inbox (no eventfd write), and the ring does
    /// not sleep over it; one while the ring waits writes the eventfd once.
    #[test]
    fn a_wake_while_running_is_seen_before_the_wait_and_one_while_waiting_writes_the_eventfd() {
        let inbox: Inbox<()> = Inbox::new().unwrap();
        inbox.wake(7);
        assert!(!poked(&inbox.fd), "a running ring's eventfd was written");
        assert!(!inbox.may_sleep(), "the ring slept over a wake-up");
        let mut w = Vec::new();
        inbox.take_woken(&mut w);
        assert_eq!(w, [7]);
        assert!(inbox.may_sleep());
        inbox.hand(());
        inbox.wake(8);
        assert!(poked(&inbox.fd), "a waiting ring was not woken");
        assert!(!poked(&inbox.fd), "one wait woken twice");
        let mut n = Vec::new();
        inbox.take_news(&mut n);
        assert_eq!(n.len(), 1);
    }
}
