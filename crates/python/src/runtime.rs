//! The process's tokio runtime, which every engine of the module shares: listeners, handshakes
//! and the tasks that watch requests run on it. Made on first use; it lives until the process
//! exits. A process that forks after making it must not use Ferry in the child (threads do not
//! survive `fork`): start worker processes with the `spawn` method.
//!
//! Every blocking call of the module goes through [`block_on`] (a future) or [`detach`] (a
//! plain blocking call), and every other call that reaches the engine through [`guard`]: the
//! GIL is released while they block, a Rust panic under them becomes a `FerryError` (never a
//! `PanicException`), and [`block_on`] wakes every [`SIGNAL_POLL`] to let Python run its signal
//! handlers, so that Ctrl-C interrupts any wait.

use std::future::Future;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::OnceLock;
use std::time::Duration;

use pyo3::prelude::*;
use tokio::runtime::Runtime;

use crate::errors::{Kind, err};

static RUNTIME: OnceLock<Result<Runtime, String>> = OnceLock::new();

/// How often a wait in [`block_on`] lets Python handle pending signals (Ctrl-C).
pub(crate) const SIGNAL_POLL: Duration = Duration::from_millis(50);

/// The shared runtime, or `Unavailable` when it could not be started.
pub(crate) fn get(py: Python<'_>) -> PyResult<&'static Runtime> {
    let rt = RUNTIME.get_or_init(|| {
        tokio::runtime::Builder::new_multi_thread()
            .thread_name("ferry-py")
            .enable_all()
            .build()
            .map_err(|e| e.to_string())
    });
    rt.as_ref().map_err(|reason| {
        err(
            py,
            Kind::Unavailable,
            format!("tokio runtime unavailable: {reason}"),
        )
    })
}

/// The `FerryError` a caught panic becomes, with the panic's message.
pub(crate) fn panic_error(py: Python<'_>, payload: Box<dyn std::any::Any + Send>) -> PyErr {
    let what = payload
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "(no message)".to_owned());
    err(
        py,
        Kind::FerryError,
        format!("internal error (a bug in Ferry; please report it): {what}"),
    )
}

/// Runs `f` (with the GIL held) and turns a panic in it into a `FerryError`.
pub(crate) fn guard<T>(py: Python<'_>, f: impl FnOnce() -> PyResult<T>) -> PyResult<T> {
    catch_unwind(AssertUnwindSafe(f)).unwrap_or_else(|p| Err(panic_error(py, p)))
}

/// Runs the blocking call `f` with the GIL released; a panic in it becomes a `FerryError`.
pub(crate) fn detach<T, F>(py: Python<'_>, f: F) -> PyResult<T>
where
    F: Send + FnOnce() -> T,
    T: Send,
{
    py.detach(|| catch_unwind(AssertUnwindSafe(f)))
        .map_err(|p| panic_error(py, p))
}

/// Runs the future `make()` gives to completion on the shared runtime, with the GIL released.
/// Every [`SIGNAL_POLL`] it takes the GIL back for a moment to run Python's signal handlers
/// (`Python::check_signals`): when one raises (`KeyboardInterrupt` on Ctrl-C), the future is
/// dropped, which cancels what it was doing, and that exception is returned. A panic in the
/// future becomes a `FerryError`.
///
/// The future is made on the waiting thread, so it need not be `Send`; only what `make`
/// captures crosses.
pub(crate) fn block_on<Fut, M>(py: Python<'_>, make: M) -> PyResult<Fut::Output>
where
    M: Send + FnOnce() -> Fut,
    Fut: Future,
    Fut::Output: Send,
{
    let rt = get(py)?;
    let ran = py.detach(|| {
        catch_unwind(AssertUnwindSafe(|| {
            rt.block_on(async {
                let fut = make();
                tokio::pin!(fut);
                // The first look after one period: a short call never takes the GIL back.
                let first = tokio::time::Instant::now() + SIGNAL_POLL;
                let mut tick = tokio::time::interval_at(first, SIGNAL_POLL);
                tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                loop {
                    tokio::select! {
                        biased;
                        out = &mut fut => return Ok(out),
                        _ = tick.tick() => {
                            Python::attach(|py| py.check_signals())?;
                        }
                    }
                }
            })
        }))
    });
    ran.unwrap_or_else(|p| Err(panic_error(py, p)))
}

/// A deliberate panic under each of the module's shields, for the test that proves none
/// reaches Python: `"guard"` (GIL held), `"detach"` (GIL released) or `"block_on"` (in a
/// future on the runtime). Not part of the API.
#[pyfunction]
pub(crate) fn _panic_for_tests(py: Python<'_>, under: &str) -> PyResult<()> {
    match under {
        "guard" => guard(py, || panic!("a test panic under guard")),
        "detach" => detach(py, || panic!("a test panic under detach")),
        "block_on" => block_on(py, || async { panic!("a test panic under block_on") }),
        other => Err(crate::errors::invalid_argument(format!(
            "under must be \"guard\", \"detach\" or \"block_on\", not {other:?}"
        ))),
    }
}
