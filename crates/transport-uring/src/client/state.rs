//! What a client stream's ring shares with the threads that submit to it: the jobs of the
//! requests being executed ([`Executing`]), the stream's protocol state and send side, and how
//! the stream is woken.

use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use ferry_core::countdown::Executing;
use ferry_core::queue::{JobQueue, Wake};
use ferry_core::stream::{Chunk, ClientStream, Work};

use super::owners::Owners;
use crate::ring::inbox::Inbox;

pub(crate) type Job = Work<Executing>;

/// Keeps a request un-drained until the zero-copy notification of one send.
pub(crate) struct NotifHold(Arc<Executing>);

impl NotifHold {
    pub(crate) fn new(req: &Arc<Executing>) -> Self {
        req.parts.add(1);
        Self(req.clone())
    }
}

impl Drop for NotifHold {
    fn drop(&mut self) {
        self.0.parts.done_one();
    }
}

pub(crate) type Queue = JobQueue<Job, RingWake>;

/// A client ring's mailbox: the host's [`Inbox`] (the streams woken since its thread last looked,
/// and the eventfd whose read ends the ring's wait), and the direct readers to watch.
#[derive(Debug)]
pub(crate) struct RingInbox {
    pub(crate) inbox: Inbox<()>,
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
            inbox: Inbox::new()?,
            watch: Mutex::new(Vec::new()),
            ticking: AtomicBool::new(false),
        })
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
            self.inbox.inbox.wake_now();
        }
    }
}

impl Wake for RingWake {
    fn wake(&self) {
        self.inbox.inbox.wake(self.id);
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
    pub(crate) proto: ClientStream<Executing>,
    /// Who may write and read the socket now, and what a reader left for the next.
    pub(crate) owners: Owners<Chunk<Executing>>,
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
