//! Copying one request's pieces side by side: the submitting thread and a small persistent pool
//! of copy threads, shared by every channel of the process (`crate::shares` moves a large
//! one-sided request this way).
//!
//! [`side_by_side`] hands the request to up to `pieces - 1` of the pool's threads and then
//! copies in the submitting thread too; each thread claims the next piece not yet claimed until
//! none is left, so the submitting thread never waits for a pool thread to start (a busy pool
//! only means it copies more itself). The rules, whatever copies:
//! - a piece is claimed once and run once: copied, or skipped when the request has stopped
//!   ([`Pieces::stopped`]) or its future was dropped before the piece started;
//! - the future resolves only once every piece has been run or skipped: no piece of a request
//!   that resolved is still copying (a late copy never lands in the caller's memory after its
//!   request ended, issue 51), whatever the outcome;
//! - a piece that panics (this side's bug) counts as run, so the request still resolves, and
//!   the pool thread lives on.
//!
//! The pool has half the CPUs, one to four threads (the rest stay with the application and the
//! owners' serving threads), started on the first request that needs them; where none can be
//! started, the submitting thread copies alone.

use std::collections::VecDeque;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock, PoisonError, Weak};
use std::task::{Context, Poll};

use ferry_core::countdown::Countdown;
use tracing::{debug, error};

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Hand-offs that may wait for the pool's threads.
const QUEUED_MAX: usize = 64;

/// A request cut in pieces that any thread may run, each once.
pub(crate) trait Pieces: Send + Sync + 'static {
    /// How many pieces.
    fn count(&self) -> usize;
    /// Whether the request has stopped: the pieces not started yet are skipped.
    fn stopped(&self) -> bool;
    /// Copies piece `p`.
    fn copy(&self, p: usize);
    /// Records piece `p` as never started (stopped, or its future dropped).
    fn skip(&self, p: usize);
}

/// Something the pool's threads run: a request's pieces.
trait Work: Send + Sync {
    fn work(&self);
}

/// The pool's threads and what they were handed.
#[derive(Debug)]
pub(crate) struct Pool {
    inner: Arc<Inner>,
    threads: usize,
}

#[derive(Debug, Default)]
struct Inner {
    /// Requests handed to the pool, once per thread asked to help. A request is held weakly:
    /// one whose future is gone and whose pieces are all run needs no one.
    queue: Mutex<VecDeque<Weak<dyn Work>>>,
    ready: Condvar,
}

impl std::fmt::Debug for dyn Work {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Work")
    }
}

impl Pool {
    /// A pool of up to `threads` threads, as many as could be started.
    pub(crate) fn new(threads: usize) -> Self {
        let inner = Arc::new(Inner::default());
        let mut started = 0;
        for _ in 0..threads {
            let inner = inner.clone();
            match std::thread::Builder::new()
                .name("ferry-local-copy".into())
                .spawn(move || inner.serve())
            {
                Ok(_) => started += 1,
                Err(e) => debug!(error = %e, "cannot start a copy thread; fewer copy side by side"),
            }
        }
        Self {
            inner,
            threads: started,
        }
    }

    /// The process's pool: half the CPUs, one to four threads, started on first use.
    pub(crate) fn shared() -> &'static Self {
        static POOL: OnceLock<Pool> = OnceLock::new();
        POOL.get_or_init(|| {
            let threads =
                std::thread::available_parallelism().map_or(1, |n| (n.get() / 2).clamp(1, 4));
            Self::new(threads)
        })
    }

    /// Its threads.
    #[cfg(test)]
    pub(crate) fn threads(&self) -> usize {
        self.threads
    }

    /// Hands `work` to `n` threads (at most all of them), unless [`QUEUED_MAX`] hand-offs wait
    /// already: the threads are busy (or gone: a child forked after they started has none),
    /// and the submitting thread copies alone.
    fn help(&self, work: &Arc<dyn Work>, n: usize) {
        let mut n = n.min(self.threads);
        {
            let mut q = lock(&self.inner.queue);
            n = n.min(QUEUED_MAX.saturating_sub(q.len()));
            for _ in 0..n {
                q.push_back(Arc::downgrade(work));
            }
        }
        for _ in 0..n {
            self.inner.ready.notify_one();
        }
    }
}

impl Inner {
    /// A pool thread: runs what it is handed, for ever (the pool lives as long as the process).
    fn serve(&self) {
        loop {
            let next = {
                let mut q = lock(&self.queue);
                loop {
                    if let Some(w) = q.pop_front() {
                        break w;
                    }
                    q = self.ready.wait(q).unwrap_or_else(PoisonError::into_inner);
                }
            };
            let Some(work) = next.upgrade() else { continue };
            // A panicking piece is counted as run (see `Run::work`); the thread lives on.
            if std::panic::catch_unwind(AssertUnwindSafe(|| work.work())).is_err() {
                error!("a one-sided copy panicked on a copy thread");
            }
        }
    }
}

/// One request being run: its pieces, which are claimed, and those not finished (the last
/// wakes the request's task).
struct Run<P> {
    pieces: P,
    next: AtomicUsize,
    left: Countdown,
    /// The request's future was dropped: the pieces not started are skipped.
    dropped: AtomicBool,
}

impl<P: Pieces> Run<P> {
    fn done(&self) -> bool {
        self.left.is_done()
    }
}

/// Counts a piece finished when dropped (a panic included), waking the waiter after the last.
struct Finished<'a, P: Pieces>(&'a Run<P>);

impl<P: Pieces> Drop for Finished<'_, P> {
    fn drop(&mut self) {
        self.0.left.done_one();
    }
}

impl<P: Pieces> Work for Run<P> {
    fn work(&self) {
        let count = self.pieces.count();
        loop {
            let p = self.next.fetch_add(1, Ordering::Relaxed);
            if p >= count {
                return;
            }
            let _finished = Finished(self);
            if self.dropped.load(Ordering::Acquire) || self.pieces.stopped() {
                self.pieces.skip(p);
            } else {
                self.pieces.copy(p);
            }
        }
    }
}

/// Runs `pieces` on the submitting thread and up to `pieces - 1` of `pool`'s threads (the
/// module's rules); returns once no piece is left to claim, with the future that resolves once
/// the last piece claimed is run.
pub(crate) fn side_by_side<P: Pieces>(pool: &Pool, pieces: P) -> Copying<P> {
    let count = pieces.count();
    let run = Arc::new(Run {
        pieces,
        next: AtomicUsize::new(0),
        left: Countdown::new(count),
        dropped: AtomicBool::new(false),
    });
    let work: Arc<dyn Work> = run.clone();
    pool.help(&work, count.saturating_sub(1));
    drop(work);
    run.work();
    Copying(run)
}

/// The future of a request run by [`side_by_side`]: ready once every piece was run. Dropping
/// it skips the pieces not started yet.
pub(crate) struct Copying<P: Pieces>(Arc<Run<P>>);

impl<P: Pieces> Copying<P> {
    /// Whether every piece was run.
    pub(crate) fn done(&self) -> bool {
        self.0.done()
    }

    /// The pieces.
    #[cfg(test)]
    pub(crate) fn pieces(&self) -> &P {
        &self.0.pieces
    }
}

impl<P: Pieces> Future for Copying<P> {
    type Output = ();

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        self.0.left.poll_done(cx)
    }
}

impl<P: Pieces> Drop for Copying<P> {
    fn drop(&mut self) {
        self.0.dropped.store(true, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc;
    use std::task::Waker;
    use std::thread::ThreadId;

    /// Pieces that record who ran them. The first piece run off the submitting thread waits
    /// for the test's gate; the submitting thread's first piece waits until another thread
    /// started one, and then stops the request if `stop_then` says so.
    struct Gated {
        submitter: ThreadId,
        stop_then: bool,
        stop: AtomicBool,
        /// Per piece: run by which thread, copied (or skipped).
        ran: Mutex<Vec<Option<(ThreadId, bool)>>>,
        other_started: (Mutex<bool>, Condvar),
        gate: Mutex<Option<mpsc::Receiver<()>>>,
    }

    impl Gated {
        fn new(count: usize, stop_then: bool) -> (Self, mpsc::Sender<()>) {
            let (tx, rx) = mpsc::channel();
            let g = Self {
                submitter: std::thread::current().id(),
                stop_then,
                stop: AtomicBool::new(false),
                ran: Mutex::new(vec![None; count]),
                other_started: (Mutex::new(false), Condvar::new()),
                gate: Mutex::new(Some(rx)),
            };
            (g, tx)
        }

        fn record(&self, p: usize, copied: bool) {
            let mut ran = lock(&self.ran);
            assert!(ran[p].is_none(), "piece {p} run twice");
            ran[p] = Some((std::thread::current().id(), copied));
        }

        fn ran(&self) -> Vec<Option<(ThreadId, bool)>> {
            lock(&self.ran).clone()
        }
    }

    impl Pieces for Gated {
        fn count(&self) -> usize {
            lock(&self.ran).len()
        }
        fn stopped(&self) -> bool {
            self.stop.load(Ordering::Acquire)
        }
        fn copy(&self, p: usize) {
            if std::thread::current().id() == self.submitter {
                let (m, cv) = &self.other_started;
                let mut started = lock(m);
                while !*started {
                    started = cv.wait(started).unwrap();
                }
                if self.stop_then {
                    self.stop.store(true, Ordering::Release);
                }
            } else {
                {
                    let (m, cv) = &self.other_started;
                    *lock(m) = true;
                    cv.notify_all();
                }
                if let Some(rx) = lock(&self.gate).take() {
                    let _ = rx.recv();
                }
            }
            self.record(p, true);
        }
        fn skip(&self, p: usize) {
            self.record(p, false);
        }
    }

    /// Pieces that record whether each was copied.
    struct Recorded {
        stop_after_first: bool,
        stop: AtomicBool,
        ran: Mutex<Vec<Option<bool>>>,
    }

    impl Recorded {
        fn new(count: usize, stop_after_first: bool) -> Self {
            Self {
                stop_after_first,
                stop: AtomicBool::new(false),
                ran: Mutex::new(vec![None; count]),
            }
        }
    }

    impl Pieces for Recorded {
        fn count(&self) -> usize {
            lock(&self.ran).len()
        }
        fn stopped(&self) -> bool {
            self.stop.load(Ordering::Acquire)
        }
        fn copy(&self, p: usize) {
            lock(&self.ran)[p] = Some(true);
            if self.stop_after_first {
                self.stop.store(true, Ordering::Release);
            }
        }
        fn skip(&self, p: usize) {
            lock(&self.ran)[p] = Some(false);
        }
    }

    fn poll_once<F: Future + Unpin>(f: &mut F) -> Poll<F::Output> {
        let mut cx = Context::from_waker(Waker::noop());
        Pin::new(f).poll(&mut cx)
    }

    /// Waits for `f` on this thread (parked until woken: the wake is what is waited for).
    fn block_on<F: Future + Unpin>(f: &mut F) -> F::Output {
        struct Unpark(std::thread::Thread);
        impl std::task::Wake for Unpark {
            fn wake(self: Arc<Self>) {
                self.0.unpark();
            }
        }
        let waker = Waker::from(Arc::new(Unpark(std::thread::current())));
        let mut cx = Context::from_waker(&waker);
        loop {
            if let Poll::Ready(o) = Pin::new(&mut *f).poll(&mut cx) {
                return o;
            }
            std::thread::park();
        }
    }

    /// The submitting thread ran out of pieces while a pool thread still copies one: the
    /// future stays pending until that piece is done, and is woken and resolves then; every
    /// piece was copied once, on two threads.
    #[test]
    fn the_future_resolves_only_after_the_pool_s_last_piece() {
        let pool = Pool::new(1);
        assert_eq!(pool.threads(), 1);
        let (pieces, gate) = Gated::new(5, false);
        let mut copying = side_by_side(&pool, pieces);
        assert!(!copying.done(), "resolved with a piece still copying");
        assert_eq!(poll_once(&mut copying), Poll::Pending);
        gate.send(()).unwrap();
        block_on(&mut copying);
        let ran = copying.pieces().ran();
        assert!(ran.iter().all(|r| matches!(r, Some((_, true)))), "{ran:?}");
        let threads: std::collections::HashSet<_> = ran.iter().flatten().map(|r| r.0).collect();
        assert_eq!(threads.len(), 2, "copied side by side");
    }

    /// A request stopped while a pool thread copies a piece: the pieces not started then are
    /// skipped, and the future resolves only after the piece in flight.
    #[test]
    fn a_stopped_request_skips_the_pieces_not_started() {
        let pool = Pool::new(1);
        let (pieces, gate) = Gated::new(8, true);
        let mut copying = side_by_side(&pool, pieces);
        assert_eq!(
            poll_once(&mut copying),
            Poll::Pending,
            "a piece is in flight"
        );
        gate.send(()).unwrap();
        block_on(&mut copying);
        let ran = copying.pieces().ran();
        assert!(ran.iter().all(Option::is_some), "{ran:?}");
        let copied = ran.iter().flatten().filter(|r| r.1).count();
        assert_eq!(
            copied, 2,
            "the two pieces started before the stop only: {ran:?}"
        );
    }

    /// A busy pool: the submitting thread claims and runs every piece itself (it never waits
    /// for a pool thread), a stop skipping those after it.
    #[test]
    fn a_busy_pool_leaves_every_piece_to_the_submitting_thread() {
        let pool = Pool::new(1);
        let (blocker, open) = Gated::new(2, false);
        let mut held = side_by_side(&pool, blocker);
        let copying = side_by_side(&pool, Recorded::new(6, true));
        assert!(copying.done());
        let ran = lock(&copying.pieces().ran).clone();
        assert_eq!(ran[0], Some(true));
        assert!(ran[1..].iter().all(|r| *r == Some(false)), "{ran:?}");
        open.send(()).unwrap();
        block_on(&mut held);
    }

    /// While the pool's threads are held, at most `QUEUED_MAX` hand-offs wait; the requests
    /// past them are copied by their submitting threads alone.
    #[test]
    fn hand_offs_waiting_for_busy_threads_are_bounded() {
        let pool = Pool::new(1);
        let (blocker, open) = Gated::new(2, false);
        let mut held = side_by_side(&pool, blocker);
        let runs: Vec<_> = (0..QUEUED_MAX + 10)
            .map(|_| side_by_side(&pool, Recorded::new(2, false)))
            .collect();
        assert!(runs.iter().all(|r| r.done()));
        assert_eq!(lock(&pool.inner.queue).len(), QUEUED_MAX);
        open.send(()).unwrap();
        block_on(&mut held);
    }

    /// A dropped future skips the pieces that had not started.
    #[test]
    fn a_dropped_future_skips_the_pieces_not_started() {
        let run = Arc::new(Run {
            pieces: Recorded::new(3, false),
            next: AtomicUsize::new(0),
            left: Countdown::new(3),
            dropped: AtomicBool::new(false),
        });
        drop(Copying(run.clone()));
        run.work();
        assert!(lock(&run.pieces.ran).iter().all(|r| *r == Some(false)));
        assert!(run.done());
    }
}
