//! What a client stream's ring shares with the threads that submit to it: the request being
//! executed, the stream's protocol state and send side, and how the stream is woken.

use std::net::TcpStream;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use ferry_core::queue::{JobQueue, Wake};
use ferry_core::stream::{Chunk, ChunkOwner, ClientStream, Work};
use ferry_core::{Op, RequestControl};

use super::owners::Owners;
use crate::waiter::Countdown;

#[derive(Debug)]
pub(crate) struct ReqShared {
    pub(crate) ops: Arc<[Op]>,
    pub(crate) control: Arc<RequestControl>,
    /// Unresolved chunks and notifications, plus one held by the poster.
    pub(crate) parts: Arc<Countdown>,
}

impl ChunkOwner for ReqShared {
    fn ops(&self) -> &[Op] {
        &self.ops
    }

    fn control(&self) -> &RequestControl {
        &self.control
    }

    fn chunk_done(&self) {
        self.parts.done_one();
    }
}

pub(crate) type Job = Work<ReqShared>;

/// Keeps a request un-drained until the zero-copy notification of one send.
pub(crate) struct NotifHold(Arc<ReqShared>);

impl NotifHold {
    pub(crate) fn new(req: &Arc<ReqShared>) -> Self {
        req.parts.add(1);
        Self(req.clone())
    }
}

impl Drop for NotifHold {
    fn drop(&mut self) {
        self.0.parts.done_one();
    }
}

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
}

impl EventFd {
    /// Writes the eventfd (its reader's wait ends).
    pub(crate) fn wake_now(&self) {
        let one = 1u64.to_ne_bytes();
        // SAFETY: writing 8 bytes from a local array to our own eventfd.
        let _ = unsafe { libc::write(self.0.as_raw_fd(), one.as_ptr().cast(), 8) };
    }
}

pub(crate) type Queue = JobQueue<Job, RingWake>;

/// A client ring's mailbox: the streams woken since its thread last looked, and the eventfd
/// whose read ends the ring's wait.
#[derive(Debug)]
pub(crate) struct RingInbox {
    pub(crate) woken: Mutex<Vec<u64>>,
    pub(crate) fd: EventFd,
    /// The ring's thread is (about to be) waiting in the kernel: a wake-up must write the
    /// eventfd. While it runs it looks at `woken` before it waits again.
    pub(crate) asleep: AtomicBool,
    /// Direct readers to watch (a stream's name, the reader's token): the ring takes the reading
    /// over from one whose response waits unread for a tick ([`READ_TICK`]).
    pub(crate) watch: Mutex<Vec<(u64, u64)>>,
    /// The ring looks at its watch list every tick (else it sleeps up to a second, and a new
    /// direct reader wakes it).
    pub(crate) ticking: AtomicBool,
}

/// How long a response to a direct send may wait unread in its socket before the stream's ring
/// reads it instead of the awaiting task (which then need not be polled for the request to
/// complete): between one and two of these.
pub(crate) const READ_TICK: std::time::Duration = std::time::Duration::from_millis(2);

impl RingInbox {
    pub(crate) fn new() -> std::io::Result<Self> {
        Ok(Self {
            woken: Mutex::new(Vec::new()),
            fd: EventFd::new()?,
            asleep: AtomicBool::new(false),
            watch: Mutex::new(Vec::new()),
            ticking: AtomicBool::new(false),
        })
    }

    /// The streams woken since the last look (and forgets them).
    pub(crate) fn take(&self, into: &mut Vec<u64>) {
        let mut g = match self.woken.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        };
        into.append(&mut g);
    }

    /// Whether a stream was woken since the last look.
    pub(crate) fn any(&self) -> bool {
        match self.woken.lock() {
            Ok(g) => !g.is_empty(),
            Err(p) => !p.into_inner().is_empty(),
        }
    }
}

/// Wakes one stream of a client ring: names it in the ring's inbox, and ends the ring's wait if
/// it waits. A wake-up before the ring looks stays in the inbox until it does.
#[derive(Debug)]
pub(crate) struct RingWake {
    pub(crate) inbox: Arc<RingInbox>,
    /// The stream's name on its ring.
    pub(crate) id: u64,
}

impl RingWake {
    /// Has the ring watch the direct reader `token` of this stream (and starts its ticks if they
    /// stopped: a wake-up, once per idle spell).
    pub(crate) fn watch(&self, token: u64) {
        match self.inbox.watch.lock() {
            Ok(mut g) => g.push((self.id, token)),
            Err(p) => p.into_inner().push((self.id, token)),
        }
        if !self.inbox.ticking.load(Ordering::SeqCst) {
            self.inbox.asleep.store(false, Ordering::SeqCst);
            self.inbox.fd.wake_now();
        }
    }
}

impl Wake for RingWake {
    fn wake(&self) {
        match self.inbox.woken.lock() {
            Ok(mut g) => g.push(self.id),
            Err(p) => p.into_inner().push(self.id),
        }
        if self.inbox.asleep.swap(false, Ordering::SeqCst) {
            self.inbox.fd.wake_now();
        }
    }
}

/// A stream's protocol state and its socket's send side, shared by the stream's ring and the
/// threads that submit to an idle stream themselves. Whoever holds the lock and finds the send
/// side free posts (assigns the sequence number) and writes the request in one go, so requests
/// reach the socket in sequence order.
#[derive(Debug)]
pub(crate) struct StreamShared {
    pub(crate) state: Mutex<SendState>,
    pub(crate) socket: Arc<TcpStream>,
    pub(crate) dead: Arc<AtomicBool>,
}

#[derive(Debug)]
pub(crate) struct SendState {
    pub(crate) proto: ClientStream<ReqShared>,
    /// Who may write and read the socket now, and what a reader left for the next.
    pub(crate) owners: Owners<Chunk<ReqShared>>,
}

impl StreamShared {
    pub(crate) fn lock(&self) -> std::sync::MutexGuard<'_, SendState> {
        match self.state.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        }
    }
}

/// Gives up a stream's socket from any thread: shuts down both directions, ignoring the result
/// (the peer may have closed it already). A receive on the socket then ends and its operations
/// in flight fail, so the stream's ring ends the stream: it fails what was in flight and hands
/// what was dealt to it to the channel's other streams. The descriptor stays open until the last
/// `Arc<TcpStream>` goes, so its number is not reused while the ring still refers to it.
pub(crate) fn shutdown(s: &TcpStream) {
    let _ = s.shutdown(std::net::Shutdown::Both);
}

#[cfg(test)]
mod tests {
    use std::os::fd::AsRawFd;

    use super::EventFd;

    /// Whether `w`'s eventfd was written (and resets it).
    fn poked(w: &EventFd) -> bool {
        let mut p = libc::pollfd {
            fd: w.0.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: polling one descriptor of ours, no wait.
        let ready = unsafe { libc::poll(&mut p, 1, 0) } == 1;
        if ready {
            let mut b = [0u8; 8];
            // SAFETY: reading 8 bytes into a local array from our own readable eventfd.
            unsafe { libc::read(w.0.as_raw_fd(), b.as_mut_ptr().cast(), 8) };
        }
        ready
    }

    /// A wake-up before the ring waits is kept (the eventfd's counter) until read, once however
    /// many came (the queue's protocol: `ferry_core::queue`).
    #[test]
    fn a_wake_before_the_wait_is_kept_until_read() {
        let w = EventFd::new().unwrap();
        assert!(!poked(&w));
        w.wake_now();
        w.wake_now();
        assert!(poked(&w));
        assert!(!poked(&w));
    }
}
