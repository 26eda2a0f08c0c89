//! Runtime-agnostic bridges from the ring threads to futures: a one-shot value (a request's
//! count of parts is [`ferry_core::countdown::Countdown`]).

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll, Waker};

struct State<T> {
    value: Option<T>,
    closed: bool,
    waker: Option<Waker>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    match m.lock() {
        Ok(g) => g,
        Err(p) => p.into_inner(),
    }
}

/// The sending half of a one-shot value.
pub(crate) struct OneTx<T>(Arc<Mutex<State<T>>>);

/// The receiving half: a future of `Some(value)`, or `None` if the sender was dropped unsent.
pub(crate) struct OneRx<T>(Arc<Mutex<State<T>>>);

pub(crate) fn oneshot<T>() -> (OneTx<T>, OneRx<T>) {
    let s = Arc::new(Mutex::new(State {
        value: None,
        closed: false,
        waker: None,
    }));
    (OneTx(s.clone()), OneRx(s))
}

impl<T> OneTx<T> {
    pub(crate) fn send(self, v: T) {
        let w = {
            let mut g = lock(&self.0);
            g.value = Some(v);
            g.waker.take()
        };
        if let Some(w) = w {
            w.wake();
        }
    }
}

impl<T> Drop for OneTx<T> {
    fn drop(&mut self) {
        let w = {
            let mut g = lock(&self.0);
            g.closed = true;
            g.waker.take()
        };
        if let Some(w) = w {
            w.wake();
        }
    }
}

impl<T> Future for OneRx<T> {
    type Output = Option<T>;
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<T>> {
        let mut g = lock(&self.0);
        if let Some(v) = g.value.take() {
            return Poll::Ready(Some(v));
        }
        if g.closed {
            return Poll::Ready(None);
        }
        g.waker = Some(cx.waker().clone());
        Poll::Pending
    }
}

/// Drives a future to completion on the current thread (for blocking callers and benches).
pub fn block_on<F: Future>(f: F) -> F::Output {
    struct Unpark(std::thread::Thread);
    impl std::task::Wake for Unpark {
        fn wake(self: Arc<Self>) {
            self.0.unpark();
        }
        fn wake_by_ref(self: &Arc<Self>) {
            self.0.unpark();
        }
    }
    let waker = Waker::from(Arc::new(Unpark(std::thread::current())));
    let mut cx = Context::from_waker(&waker);
    let mut f = std::pin::pin!(f);
    loop {
        if let Poll::Ready(v) = f.as_mut().poll(&mut cx) {
            return v;
        }
        std::thread::park();
    }
}
