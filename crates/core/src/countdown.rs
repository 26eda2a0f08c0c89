//! A request's count of unresolved parts, as a channel executes it: one held by the poster
//! while it deals the request ([`deal_request`](crate::dealer::deal_request)'s `count` adds one
//! per chunk), one per chunk dealt or sent, and whatever else the transport must see finished
//! before the request is over (zero-copy notifications, say). Every part is resolved exactly
//! once, and the request's future ([`Countdown::wait`]) resolves once none is left.
//! Runtime-agnostic: the last part's thread wakes the future's task, whatever runtime or ring
//! thread each runs on.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::task::{Context, Poll, Waker};

/// A count of unresolved parts; [`Countdown::wait`] resolves when it reaches zero. A count that
/// reached zero stays done (parts must all be added while one is still held).
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
        self.left.fetch_add(n, Ordering::AcqRel);
    }

    /// Resolves one part; the last wakes the task in [`wait`](Self::wait), if one is.
    pub fn done_one(&self) {
        if self.left.fetch_sub(1, Ordering::AcqRel) == 1 {
            let w = {
                let mut g = self.lock();
                g.0 = true;
                g.1.take()
            };
            if let Some(w) = w {
                w.wake();
            }
        }
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
        let mut g = self.0.lock();
        if g.0 {
            return Poll::Ready(());
        }
        g.1 = Some(cx.waker().clone());
        Poll::Pending
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;
    use std::task::Wake;

    /// Counts its wakes.
    #[derive(Default)]
    struct Wakes(AtomicUsize);

    impl Wake for Wakes {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    /// The wait resolves only once every part (the poster's and those added) is done, the last
    /// waking the waiting task once; a count done before the wait is first polled is not lost,
    /// and a count of zero is done at once.
    #[test]
    fn the_wait_resolves_when_the_last_part_is_done_and_not_before() {
        let wakes = Arc::new(Wakes::default());
        let waker = Waker::from(wakes.clone());
        let mut cx = Context::from_waker(&waker);

        let parts = Arc::new(Countdown::new(1));
        parts.add(2);
        let mut wait = Box::pin(parts.clone().wait());
        parts.done_one();
        assert!(wait.as_mut().poll(&mut cx).is_pending());
        parts.done_one();
        assert!(wait.as_mut().poll(&mut cx).is_pending());
        assert_eq!(wakes.0.load(Ordering::SeqCst), 0);
        parts.done_one();
        assert_eq!(
            wakes.0.load(Ordering::SeqCst),
            1,
            "the last part wakes the waiter"
        );
        assert!(wait.as_mut().poll(&mut cx).is_ready());

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
}
