//! Whether the awaiting task's tokio runtime can watch a stream's socket, found out quietly.
//!
//! A direct reader ([`CallerRead`](super::CallerRead)) registers the stream's socket with the
//! reactor of the runtime it runs on. Tokio offers no way to ask whether a runtime was built
//! with I/O: the registration panics where it was not. [`quietly`] runs that registration with
//! the panic caught and not printed (a panic hook, installed at its first use, that passes every
//! other panic to the hook it replaced), and remembers the runtime it found without I/O, so
//! that [`may_watch`] makes no task of that runtime a reader again: its requests are read by
//! their streams' rings from the start.

use std::cell::Cell;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, Once, PoisonError};

use tokio::runtime::{Handle, Id};

/// How many runtimes found without I/O are remembered (the latest); one forgotten is found
/// out again, quietly, at its next direct request.
const REMEMBERED: usize = 16;

/// Runtimes found without I/O, oldest first.
static WITHOUT_IO: Mutex<Vec<Id>> = Mutex::new(Vec::new());

/// Whether any runtime was ever found without I/O: until one is, [`may_watch`] takes no lock
/// (it runs once per direct request).
static ANY_WITHOUT_IO: AtomicBool = AtomicBool::new(false);

/// The quiet hook is installed (once per process).
static HOOK: Once = Once::new();

thread_local! {
    /// This thread is inside [`quietly`]: a panic here is caught there, not printed.
    static QUIET: Cell<bool> = const { Cell::new(false) };
}

/// Whether a task on the calling thread's runtime may be made a stream's reader: there is a
/// runtime, and it was not found without I/O.
pub(crate) fn may_watch() -> bool {
    match Handle::try_current() {
        Ok(h) => !ANY_WITHOUT_IO.load(Ordering::Acquire) || !without_io().contains(&h.id()),
        Err(_) => false,
    }
}

/// Runs `register` (a registration with the current runtime's reactor), catching a panic
/// without printing it: `None` then, and the current runtime, if any, is remembered as one
/// without I/O. Panics on other threads meanwhile are printed as before.
pub(crate) fn quietly<R>(register: impl FnOnce() -> R) -> Option<R> {
    HOOK.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if !QUIET.with(Cell::get) {
                previous(info);
            }
        }));
    });
    QUIET.with(|q| q.set(true));
    // The closure's state is dropped whole if it panics, and nothing it touched is used after.
    let r = catch_unwind(AssertUnwindSafe(register));
    QUIET.with(|q| q.set(false));
    match r {
        Ok(r) => Some(r),
        Err(_) => {
            if let Ok(h) = Handle::try_current() {
                let mut w = without_io();
                if !w.contains(&h.id()) {
                    if w.len() == REMEMBERED {
                        w.remove(0);
                    }
                    w.push(h.id());
                    ANY_WITHOUT_IO.store(true, Ordering::Release);
                }
            }
            None
        }
    }
}

fn without_io() -> std::sync::MutexGuard<'static, Vec<Id>> {
    WITHOUT_IO.lock().unwrap_or_else(PoisonError::into_inner)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// A runtime built without I/O: the registration's panic is caught and not printed, and
    /// the runtime is remembered, so its tasks are not made readers again; a runtime with I/O
    /// registers. Run in a process of its own ([`in_a_process_of_its_own`]), so that its panic
    /// hook is the process's first and no other test's panic is counted.
    #[test]
    fn a_runtime_without_io_is_found_quietly_and_remembered() {
        let (_, err) = crate::testing::in_a_process_of_its_own(
            "client::reactor::tests::in_a_process_of_its_own",
        );
        assert!(
            !err.contains("IO is disabled"),
            "the panic was printed: {err}"
        );
    }

    #[test]
    #[ignore = "run by a_runtime_without_io_is_found_quietly_and_remembered, in a process of its own"]
    fn in_a_process_of_its_own() {
        static SEEN: AtomicUsize = AtomicUsize::new(0);
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            SEEN.fetch_add(1, Ordering::Relaxed);
            previous(info);
        }));
        let (a, b) = std::os::unix::net::UnixStream::pair().unwrap();
        let bare = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        bare.block_on(async {
            assert!(may_watch());
            // SAFETY: the registration owns the socket, so its descriptor stays open and the
            // same for as long as the registration lives.
            let got = quietly(|| unsafe { tokio::io::unix::AsyncFd::register(a) });
            assert!(got.is_none());
            assert!(!may_watch());
        });
        assert_eq!(
            SEEN.load(Ordering::Relaxed),
            0,
            "the panic reached the process's hook"
        );
        let io = tokio::runtime::Builder::new_current_thread()
            .enable_io()
            .build()
            .unwrap();
        io.block_on(async {
            assert!(may_watch());
            // SAFETY: as above.
            let got = quietly(|| unsafe { tokio::io::unix::AsyncFd::register(b) });
            assert!(matches!(got, Some(Ok(_))));
            assert!(may_watch());
        });
        assert!(!may_watch(), "outside a runtime");
        // A panic outside `quietly` still reaches the process's hook.
        assert!(std::panic::catch_unwind(|| panic!("a panic of the test's own")).is_err());
        assert_eq!(SEEN.load(Ordering::Relaxed), 1);
    }
}
