//! A request as a channel executes it ([`Executing`]) and its count of unresolved parts
//! ([`Countdown`]): one held by the poster while it deals the request or sends it directly, one
//! per chunk dealt or sent, and whatever else the transport must see finished before the
//! request is over (zero-copy notifications, say). Every part is resolved exactly once, and
//! the request's future ([`Executing::settle`], [`Countdown::wait`]) resolves once none is left.
//! Runtime-agnostic: the last part's thread wakes the future's task, whatever runtime or ring
//! thread each runs on.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::task::{Context, Poll, Waker};

use crate::dealer::deal_request;
use crate::op::Op;
use crate::outcome::RequestControl;
use crate::queue::{JobQueue, Wake};
use crate::stream::{ChunkOwner, Work};

/// A request as a channel executes it: what its chunks carry ([`ChunkOwner`]) to the channel's
/// streams, each chunk one of its parts.
#[derive(Debug)]
pub struct Executing {
    /// The request's ops.
    pub ops: Arc<[Op]>,
    /// Its stop flag and ledger.
    pub control: Arc<RequestControl>,
    /// Its unresolved parts, the poster's among them until [`settle`](Self::settle).
    pub parts: Arc<Countdown>,
}

impl Executing {
    /// A request of `ops` under `control`, holding the poster's part.
    pub fn new(ops: Arc<[Op]>, control: Arc<RequestControl>) -> Arc<Self> {
        Arc::new(Self {
            ops,
            control,
            parts: Arc::new(Countdown::new(1)),
        })
    }

    /// Deals the request to `queue`'s streams ([`deal_request`]: chunks of at most `chunk`
    /// bytes, runs of small ops as vectored requests of at most `group` bytes), each chunk a
    /// part, and wakes the streams its jobs went to.
    pub fn deal<W: Wake>(
        self: &Arc<Self>,
        queue: &JobQueue<Work<Self>, W>,
        chunk: u64,
        group: Option<u64>,
        closed: bool,
    ) {
        deal_request(
            queue.dealer(),
            self,
            chunk,
            group,
            closed,
            |n| self.parts.add(n),
            |set| queue.wake_all_in(set),
        );
    }

    /// Resolves the poster's part, once the request is dealt or sent, and lets go of the
    /// request: what it returns resolves once every part is (the chunks keep the request
    /// alive until then).
    pub fn settle(self: Arc<Self>) -> impl Future<Output = ()> + Send + 'static {
        let parts = self.parts.clone();
        drop(self);
        parts.done_one();
        parts.wait()
    }
}

impl ChunkOwner for Executing {
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

/// A count of unresolved parts; [`Countdown::wait`] resolves when it reaches zero. A count that
/// reached zero stays done (parts must all be added while one is still held).
///
/// Its changes and [`is_done`](Self::is_done) are sequentially consistent: a caller that sets
/// a flag of its own (`SeqCst`) and then finds the count not done is sure that the thread
/// resolving the last part sees the flag after [`done_one`](Self::done_one) returns `true`.
#[derive(Debug)]
pub struct Countdown {
    left: AtomicUsize,
    /// Whether the count reached zero, and the task waiting for it.
    waker: Mutex<(bool, Option<Waker>)>,
}

impl Countdown {
    /// A count of `initial` parts (`0`: done already).
    pub fn new(initial: usize) -> Self {
        Self {
            left: AtomicUsize::new(initial),
            waker: Mutex::new((initial == 0, None)),
        }
    }

    /// Adds `n` parts.
    pub fn add(&self, n: usize) {
        self.left.fetch_add(n, Ordering::SeqCst);
    }

    /// Resolves one part; the last wakes the task waiting for the count ([`wait`](Self::wait),
    /// [`poll_done`](Self::poll_done)), if one is, and returns `true`.
    pub fn done_one(&self) -> bool {
        if self.left.fetch_sub(1, Ordering::SeqCst) != 1 {
            return false;
        }
        let w = {
            let mut g = self.lock();
            g.0 = true;
            g.1.take()
        };
        if let Some(w) = w {
            w.wake();
        }
        true
    }

    /// Whether no part is left, without a lock (for a task that spins on the count, or checks
    /// it before registering to be woken).
    pub fn is_done(&self) -> bool {
        self.left.load(Ordering::SeqCst) == 0
    }

    /// Ready once the count is zero; until then `cx`'s task is the one the last part wakes
    /// (for a future that polls the count among other things).
    pub fn poll_done(&self, cx: &mut Context<'_>) -> Poll<()> {
        if self.is_done() {
            return Poll::Ready(());
        }
        let mut g = self.lock();
        if g.0 {
            return Poll::Ready(());
        }
        match &g.1 {
            Some(old) if old.will_wake(cx.waker()) => {}
            _ => g.1 = Some(cx.waker().clone()),
        }
        Poll::Pending
    }

    /// Resolves once the count is zero (at once if it is already).
    pub fn wait(self: Arc<Self>) -> impl Future<Output = ()> + Send + 'static {
        CountdownWait(self)
    }

    fn lock(&self) -> MutexGuard<'_, (bool, Option<Waker>)> {
        self.waker.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

struct CountdownWait(Arc<Countdown>);

impl Future for CountdownWait {
    type Output = ();
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        self.0.poll_done(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::op::OpKind;
    use std::sync::atomic::AtomicUsize;

    /// Counts its wakes.
    #[derive(Default)]
    struct Wakes(AtomicUsize);

    impl std::task::Wake for Wakes {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    /// A stream wake-up that does nothing (the test takes the jobs itself).
    struct Asleep;

    impl Wake for Asleep {
        fn wake(&self) {}
    }

    /// The wait resolves only once every part (the poster's and those added) is done, the last
    /// (and only it) saying so and waking the waiting task once; a count done before the wait
    /// is first polled is not lost, and a count of zero is done at once.
    #[test]
    fn the_wait_resolves_when_the_last_part_is_done_and_not_before() {
        let wakes = Arc::new(Wakes::default());
        let waker = Waker::from(wakes.clone());
        let mut cx = Context::from_waker(&waker);

        let parts = Arc::new(Countdown::new(1));
        parts.add(2);
        let mut wait = Box::pin(parts.clone().wait());
        assert!(!parts.done_one());
        assert!(wait.as_mut().poll(&mut cx).is_pending());
        assert!(parts.poll_done(&mut cx).is_pending());
        assert!(!parts.done_one());
        assert!(wait.as_mut().poll(&mut cx).is_pending());
        assert!(!parts.is_done());
        assert_eq!(wakes.0.load(Ordering::SeqCst), 0);
        assert!(parts.done_one(), "the last part says so");
        assert!(parts.is_done());
        assert_eq!(
            wakes.0.load(Ordering::SeqCst),
            1,
            "the last part wakes the waiter"
        );
        assert!(wait.as_mut().poll(&mut cx).is_ready());
        assert!(parts.poll_done(&mut cx).is_ready());

        let early = Arc::new(Countdown::new(1));
        early.done_one();
        assert!(Box::pin(early.wait()).as_mut().poll(&mut cx).is_ready());
        assert!(
            Box::pin(Arc::new(Countdown::new(0)).wait())
                .as_mut()
                .poll(&mut cx)
                .is_ready()
        );
    }

    /// An executed request's future resolves once every chunk dealt to the streams is resolved
    /// and the poster settled, not before: each chunk is one part.
    #[test]
    fn a_dealt_request_is_over_when_its_last_chunk_resolves() {
        let wakes = Arc::new(Wakes::default());
        let waker = Waker::from(wakes.clone());
        let mut cx = Context::from_waker(&waker);
        let ops: Arc<[Op]> = vec![Op {
            kind: OpKind::Write,
            local: Arc::new(crate::MemoryRegion::from_vec(vec![0; 64])),
            local_offset: 0,
            token: crate::SegmentToken(1),
            remote_offset: 0,
            len: 2500,
        }]
        .into();
        let control = Arc::new(RequestControl::new(&ops));
        let queue = JobQueue::new([Asleep, Asleep]);
        let req = Executing::new(ops, control);
        req.deal(&queue, 1000, None, false);
        let mut over = Box::pin(req.settle());
        let mut jobs = Vec::new();
        while let Some(j) = queue.lock().take(0, true) {
            jobs.push(j);
        }
        assert_eq!(jobs.len(), 3, "chunks of 1000 bytes");
        for j in jobs {
            assert!(over.as_mut().poll(&mut cx).is_pending());
            let Work::One(c) = j else {
                panic!("no vectored job without a group")
            };
            c.req.chunk_done();
        }
        assert!(over.as_mut().poll(&mut cx).is_ready());
    }
}
