//! A channel's job queue, shared by the drivers: the [`Dealer`] under a lock, each stream's
//! wake-up, and the protocol that decides whom a newly dealt job wakes. No I/O: a driver
//! supplies only how one of its streams is woken ([`Wake`]: a tokio `Notify`, an eventfd).
//!
//! The protocol, for the stream taking jobs and for whoever deals them:
//! - A stream that finds nothing for it announces its wait ([`JobQueue::next_or_wait`]) and
//!   looks once more before it waits; both the announcement and a dealer's read of it are
//!   `SeqCst`, so a job dealt after that last look finds the announcement and wakes it.
//! - A job dealt to stream `i` wakes `i` if it waits; if `i` is busy (it looks again on its
//!   own), it wakes one stream that waits with nothing in flight instead, which may take the
//!   job ([`Dealer::take`]). A stream that waits with chunks in flight is never woken for
//!   another's job: a response will wake it.
//! - A stream that ends leaves ([`JobQueue::leave`]): what was dealt to it goes to the others,
//!   which are woken; what no stream is left to take goes back to the driver to fail.
//!
//! Why one queue per stream, with the traces and figures: `docs/performance.md`; why the wake
//! policy is io_uring's for both drivers: `docs/decisions.md`.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, MutexGuard, PoisonError};

use crate::dealer::{Dealer, StreamSet};

/// How a driver wakes one of its streams (its thread or its task).
///
/// A wake-up that comes before the stream waits must not be lost: the next wait returns at
/// once (a stored permit, an eventfd's counter).
pub trait Wake {
    /// Wakes the stream.
    fn wake(&self);
}

/// One stream as the queue sees it: its wake-up and what it announced of its wait.
#[derive(Debug)]
pub struct Taker<W> {
    wake: W,
    /// The stream is (about to be) waiting for a job.
    waiting: AtomicBool,
    /// ... with nothing in flight: it may take another stream's job.
    starved: AtomicBool,
}

impl<W: Wake> Taker<W> {
    fn new(wake: W) -> Self {
        Self {
            wake,
            waiting: AtomicBool::new(false),
            starved: AtomicBool::new(false),
        }
    }

    /// The driver's wake-up for this stream, to wait on or to wake it for reasons of its own
    /// (room freed in flight, bytes left to send).
    pub fn waker(&self) -> &W {
        &self.wake
    }

    /// Whether the stream waits with nothing in flight, as it announced: a job dealt to any
    /// stream may wake it, so a driver need not wake it again when its last chunk in flight
    /// (sent past it, directly) resolves.
    pub fn waits_idle(&self) -> bool {
        self.starved.load(Ordering::SeqCst)
    }

    /// The stream no longer waits (it woke, or it found a job after all).
    pub fn rise(&self) {
        self.waiting.store(false, Ordering::SeqCst);
        self.starved.store(false, Ordering::SeqCst);
    }

    fn announce(&self, idle: bool) {
        self.starved.store(idle, Ordering::SeqCst);
        self.waiting.store(true, Ordering::SeqCst);
    }
}

/// What [`JobQueue::next`] found for a stream.
#[derive(Debug, PartialEq, Eq)]
pub enum Next<J> {
    /// A job to post.
    Job(J),
    /// Nothing now.
    Empty,
    /// The channel is gone and nothing is queued for this stream: it ends once nothing is in
    /// flight.
    Closed,
}

/// The chunks of a channel not yet taken by its streams, with each stream's wake-up.
#[derive(Debug)]
pub struct JobQueue<J, W> {
    dealer: Mutex<Dealer<J>>,
    takers: Vec<Taker<W>>,
}

impl<J, W: Wake> JobQueue<J, W> {
    /// A queue for one stream per wake-up, in stream order.
    pub fn new(wakes: impl IntoIterator<Item = W>) -> Self {
        let takers: Vec<Taker<W>> = wakes.into_iter().map(Taker::new).collect();
        Self {
            dealer: Mutex::new(Dealer::new(takers.len())),
            takers,
        }
    }

    /// The dealer's lock, for [`crate::dealer::deal_ops`] and its kin.
    pub fn dealer(&self) -> &Mutex<Dealer<J>> {
        &self.dealer
    }

    /// The dealer, locked (a panic elsewhere under the lock leaves it usable: every change to
    /// it is one call).
    pub fn lock(&self) -> MutexGuard<'_, Dealer<J>> {
        self.dealer.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Stream `i`, if there is one.
    pub fn taker(&self, i: usize) -> Option<&Taker<W>> {
        self.takers.get(i)
    }

    /// Wakes stream `i` if it waits for work, else one stream that waits with nothing in
    /// flight (it may take the job). Busy streams look again on their own.
    pub fn wake_for(&self, i: usize) {
        if let Some(own) = self.takers.get(i)
            && own.waiting.load(Ordering::SeqCst)
        {
            own.wake.wake();
            return;
        }
        if let Some(t) = self
            .takers
            .iter()
            .find(|t| t.starved.load(Ordering::SeqCst))
        {
            t.wake.wake();
        }
    }

    /// [`JobQueue::wake_for`] each stream in `set`.
    pub fn wake_all_in(&self, set: StreamSet) {
        for i in 0..self.takers.len() {
            if set.contains(i) {
                self.wake_for(i);
            }
        }
    }

    /// The next job for stream `i`, without waiting. With `idle` (nothing in flight on it) it
    /// may take the oldest job of the longest other queue.
    pub fn next(&self, i: usize, idle: bool) -> Next<J> {
        let mut g = self.lock();
        match g.take(i, idle) {
            Some(j) => Next::Job(j),
            None if g.is_closed() => Next::Closed,
            None => Next::Empty,
        }
    }

    /// [`JobQueue::next`]; when that finds nothing, stream `i` announces its wait and looks once
    /// more. On [`Next::Empty`] the wait stays announced: the caller waits on its wake-up, then
    /// calls [`Taker::rise`]. Otherwise the stream no longer waits.
    pub fn next_or_wait(&self, i: usize, idle: bool) -> Next<J> {
        match self.next(i, idle) {
            Next::Empty => {}
            found => return found,
        }
        let Some(t) = self.takers.get(i) else {
            return Next::Closed;
        };
        t.announce(idle);
        let found = self.next(i, idle);
        if !matches!(found, Next::Empty) {
            t.rise();
        }
        found
    }

    /// Deals `job` to the next stream still taking jobs and wakes for it; `Err(job)` if no
    /// stream is left (the caller fails it, never posted).
    pub fn hand_on(&self, job: J) -> Result<(), J> {
        let dealt = self.lock().deal(job);
        dealt.map(|k| self.wake_for(k))
    }

    /// Stream `i` stops taking jobs: what was dealt to it goes to the others (woken); returns
    /// what no stream is left to take, for the caller to fail (never posted).
    pub fn leave(&self, i: usize) -> Vec<J> {
        if let Some(t) = self.takers.get(i) {
            t.rise();
        }
        let mut woken = StreamSet::default();
        let orphans = self.lock().leave(i, &mut woken);
        self.wake_all_in(woken);
        orphans
    }

    /// The channel is gone: every stream is woken, and each ends once nothing is queued for it
    /// ([`Next::Closed`]).
    pub fn close(&self) {
        self.lock().close();
        for t in &self.takers {
            t.wake.wake();
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::{JobQueue, Next, Wake};

    /// Counts its wake-ups.
    #[derive(Debug, Default)]
    struct Count(AtomicUsize);

    impl Wake for Count {
        fn wake(&self) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    fn queue(streams: usize) -> JobQueue<u32, Count> {
        JobQueue::new((0..streams).map(|_| Count::default()))
    }

    /// Wake-ups of stream `i` since the last look (and resets them).
    fn woken(q: &JobQueue<u32, Count>, i: usize) -> usize {
        q.taker(i).unwrap().waker().0.swap(0, Ordering::SeqCst)
    }

    /// A job dealt to a waiting stream wakes it; dealt to a busy one, it wakes a stream that
    /// waits with nothing in flight instead, and no stream that waits with chunks in flight.
    #[test]
    fn a_job_for_a_busy_stream_wakes_an_idle_one() {
        let q = queue(3);
        assert_eq!(q.next_or_wait(0, false), Next::Empty);
        q.wake_for(0);
        assert_eq!(woken(&q, 0), 1);
        q.taker(0).unwrap().rise();
        // Stream 1 waits with chunks in flight (a response will wake it), stream 2 idles.
        assert_eq!(q.next_or_wait(1, false), Next::Empty);
        assert_eq!(q.next_or_wait(2, true), Next::Empty);
        q.wake_for(0);
        assert_eq!((woken(&q, 0), woken(&q, 1), woken(&q, 2)), (0, 0, 1));
        q.taker(2).unwrap().rise();
        q.wake_for(0);
        assert_eq!(
            (woken(&q, 0), woken(&q, 1), woken(&q, 2)),
            (0, 0, 0),
            "nobody to wake"
        );
        q.close();
        assert_eq!((woken(&q, 0), woken(&q, 1), woken(&q, 2)), (1, 1, 1));
    }

    /// A stream waits idle only from a wait announced with nothing in flight until it rises
    /// (a driver skips waking it again when a chunk sent past it resolves).
    #[test]
    fn waits_idle_follows_the_announced_wait() {
        let q = queue(2);
        let t = q.taker(0).unwrap();
        assert!(!t.waits_idle(), "not waiting yet");
        assert_eq!(q.next_or_wait(0, false), Next::Empty);
        assert!(!t.waits_idle(), "waits with chunks in flight");
        t.rise();
        assert_eq!(q.next_or_wait(0, true), Next::Empty);
        assert!(t.waits_idle());
        assert!(!q.taker(1).unwrap().waits_idle(), "another stream's wait");
        t.rise();
        assert!(!t.waits_idle(), "risen");
        q.hand_on(5).unwrap();
        assert_eq!(q.next_or_wait(0, true), Next::Job(5));
        assert!(!t.waits_idle(), "found a job: no wait");
    }

    /// The last look of [`JobQueue::next_or_wait`] finds a job dealt before it, and a job dealt
    /// after it finds the wait announced: no job is left with its stream asleep.
    #[test]
    fn a_job_dealt_around_the_last_look_is_never_missed() {
        let q = queue(2);
        q.hand_on(7).unwrap();
        assert_eq!(q.next_or_wait(0, false), Next::Job(7));
        assert!(!q.taker(0).unwrap().waiting.load(Ordering::SeqCst));
        assert_eq!(q.next_or_wait(0, false), Next::Empty);
        // Dealt in turn: stream 1 first, then 0, which waits.
        q.hand_on(8).unwrap();
        q.hand_on(9).unwrap();
        assert_eq!(woken(&q, 0), 1);
        q.taker(0).unwrap().rise();
        assert_eq!(q.next_or_wait(0, false), Next::Job(9));
    }

    /// An idle stream takes a busy one's job; a stream with chunks in flight does not.
    #[test]
    fn only_an_idle_stream_takes_anothers_job() {
        let q = queue(2);
        q.hand_on(1).unwrap();
        assert_eq!(q.next(1, false), Next::Empty);
        assert_eq!(q.next(1, true), Next::Job(1));
    }

    /// A leaving stream's jobs go to the others, which are woken; when none is left they come
    /// back to the caller; a closed queue ends each stream once its own jobs are taken.
    #[test]
    fn leaving_hands_jobs_on_and_closing_ends_the_streams() {
        let q = queue(2);
        q.hand_on(1).unwrap();
        assert_eq!(q.next_or_wait(1, false), Next::Empty);
        assert!(q.leave(0).is_empty());
        assert_eq!(woken(&q, 1), 1);
        q.close();
        assert_eq!(q.next(1, false), Next::Job(1));
        assert_eq!(q.next(1, false), Next::Closed);
        assert_eq!(q.hand_on(2), Ok(()));
        assert_eq!(q.leave(1), vec![2]);
        assert_eq!(q.hand_on(3), Err(3));
    }
}
