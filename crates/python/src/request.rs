//! Batches, submitted requests and their outcomes.
//!
//! A submitted request's logical outcome and then its drained one are recorded in a [`Watch`].
//! A request with no step after it is driven by whoever waits for it, with no task of its own:
//! `Request.wait` polls it in the caller's thread with the GIL released and sleeps on the
//! watch's condvar until the transport's completion wakes it; `done()` polls it once. `await
//! request` registers an asyncio future that the watch settles through
//! `loop.call_soon_threadsafe`, called from tokio's blocking pool, where a job polls the request
//! when its waker fires (never a runtime worker, which must not wait for the GIL). A request
//! with a step after it (`notify`) is watched by one task on the shared runtime.

use std::future::{Future, IntoFuture};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError, Weak};
use std::task::{Context, Poll, Wake, Waker};
use std::time::{Duration, Instant};

use ferry::{Canceller, OpKind, Outcome, RemoteEffect, RemoteStatus};
use pyo3::exceptions::{PyTimeoutError, PyTypeError};
use pyo3::prelude::*;

use ferry::LocalMemory;

pub(crate) use crate::args::{non_negative, seconds};
use crate::errors::{self, Kind};
use crate::gpu::GpuRegistration;
use crate::handles::{Registration, RemoteSegment};

/// A request's own future of an outcome, polled in whichever thread waits for it.
type OutcomeFuture = std::pin::Pin<Box<dyn Future<Output = Outcome> + Send>>;

/// An asyncio future to settle: (event loop, future, whether it waits for `drained`).
type AsyncWaiter = (Py<PyAny>, Py<PyAny>, bool);

/// An asyncio future now due, with what it gets (`None`: the watch was lost).
type Due = (Py<PyAny>, Py<PyAny>, Option<Outcome>);

/// What the watch of a request knows.
#[derive(Default)]
struct State {
    /// The logical outcome, once the request ended (completed, failed, timed out, cancelled).
    outcome: Option<Outcome>,
    /// The final outcome once the buffers are free again (`drained: true`).
    drained: Option<Outcome>,
    /// The request's futures ended without an outcome (a panic below, or the watching task was
    /// dropped): waiting raises.
    lost: bool,
    /// Why the step run after the request completed (`watch_then`) failed, if it did.
    after_error: Option<String>,
    /// asyncio futures to settle.
    waiters: Vec<AsyncWaiter>,
    /// Threads inside `Request.wait`'s loop (polling or asleep on the condvar): a wake of a
    /// directly driven request only has to tell them, as they poll it themselves.
    sleepers: usize,
    /// A thread is polling the request's futures now: a wake meanwhile asks it to poll again.
    polling: bool,
    /// A wake came since the last poll began.
    woken: bool,
    /// A blocking-pool job that polls the request is queued and has not started.
    queued: bool,
}

impl State {
    fn settled(&self) -> bool {
        self.drained.is_some() || self.lost
    }

    /// Records the logical outcome (`drained == false`) or the drained one (or, with `None`,
    /// that the watch was lost) and takes the asyncio futures that waited for it.
    fn record(&mut self, outcome: Option<Outcome>, drained: bool) -> Vec<Due> {
        match (outcome, drained) {
            (Some(o), false) => self.outcome = Some(o),
            (Some(o), true) => {
                // The drained outcome is also the logical one unless one came first (a
                // timeout, a cancel), which stays.
                self.outcome.get_or_insert(o);
                self.drained = Some(o);
            }
            (None, _) => self.lost = true,
        }
        let (due, keep): (Vec<_>, Vec<_>) = std::mem::take(&mut self.waiters)
            .into_iter()
            .partition(|(_, _, wants_drained)| outcome.is_none() || *wants_drained == drained);
        self.waiters = keep;
        due.into_iter().map(|(l, f, _)| (l, f, outcome)).collect()
    }
}

/// The outcome slots of one request, shared by its Python handle and whatever drives it.
///
/// A request with no step after it (no `notify`) is driven *directly*: no task of its own
/// watches it. Whoever waits polls its futures (the logical outcome, then the drained one) in
/// its own thread: `Request.wait` (GIL released) with the watch's [`Nudge`] as waker, sleeping
/// on the condvar until the transport's completion, the request's timer or a cancel wakes it;
/// `Request.done()` once, never waiting. A wake that finds nobody in `wait` (an asyncio future
/// awaits, or the request drains after its logical end) queues one job on the runtime's
/// blocking pool that polls it and settles the asyncio futures there; no runtime worker ever
/// waits for the GIL. A request with a step after it is watched by one task (`watch_then`).
pub(crate) struct Watch {
    state: Mutex<State>,
    cond: Condvar,
    /// The request's futures while it is driven directly and not drained.
    direct: Mutex<Option<Direct>>,
    /// The waker of every poll that waits: a [`Nudge`] of this watch.
    waker: Waker,
    /// The engine's runtime: its timers and reactor serve the polls, its blocking pool the
    /// jobs that settle asyncio futures.
    runtime: tokio::runtime::Handle,
}

/// The futures of a directly driven request.
struct Direct {
    /// The logical outcome (completion, the request's timeout, a cancel), until it resolved.
    logical: Option<OutcomeFuture>,
    /// The drained outcome.
    drained: OutcomeFuture,
}

/// The waker of a directly driven request's polls. Weak: the request's futures hold it, and the
/// watch holds them.
struct Nudge(Weak<Watch>);

impl Wake for Nudge {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        if let Some(w) = self.0.upgrade() {
            w.nudge();
        }
    }
}

impl Watch {
    fn new(direct: Option<Direct>) -> Arc<Self> {
        Arc::new_cyclic(|me| Self {
            state: Mutex::default(),
            cond: Condvar::new(),
            direct: Mutex::new(direct),
            waker: Waker::from(Arc::new(Nudge(me.clone()))),
            runtime: tokio::runtime::Handle::current(),
        })
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The transport (or the request's timer, or a cancel) woke a poll of this request: the
    /// poller polls again, a thread in `wait` is told, and with nobody there one blocking-pool
    /// job polls it.
    fn nudge(self: &Arc<Self>) {
        let mut st = self.lock();
        if st.settled() {
            return;
        }
        st.woken = true;
        if st.polling {
            return;
        }
        if st.sleepers > 0 {
            drop(st);
            self.cond.notify_all();
            return;
        }
        if std::mem::replace(&mut st.queued, true) {
            return;
        }
        drop(st);
        let w = self.clone();
        self.runtime.spawn_blocking(move || {
            w.lock().queued = false;
            let due = w.poll_direct(&w.waker, true);
            if !due.is_empty() {
                // A blocking-pool thread: it may wait for the GIL.
                Python::try_attach(|py| deliver(py, due));
            }
        });
    }

    /// Polls the request's futures with `waker` in this thread, again while a wake came during
    /// the poll, and records what resolved; returns the asyncio futures now due. `block`:
    /// wait for a poll running in another thread to end first (without, that poll is left to
    /// do it). A panic below stays out of Python: the watch is lost.
    fn poll_direct(&self, waker: &Waker, block: bool) -> Vec<Due> {
        let mut slot = match self.direct.try_lock() {
            Ok(s) => s,
            Err(std::sync::TryLockError::Poisoned(p)) => p.into_inner(),
            Err(std::sync::TryLockError::WouldBlock) if block => {
                self.direct.lock().unwrap_or_else(PoisonError::into_inner)
            }
            Err(std::sync::TryLockError::WouldBlock) => return Vec::new(),
        };
        let mut due = Vec::new();
        loop {
            let Some(d) = slot.as_mut() else {
                return due;
            };
            {
                let mut st = self.lock();
                st.polling = true;
                st.woken = false;
            }
            let polled = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                // Timers and the reactor of the engine's runtime, as in its own tasks.
                let _enter = self.runtime.enter();
                let mut cx = Context::from_waker(waker);
                let logical = d.logical.as_mut().map(|f| f.as_mut().poll(&mut cx));
                // The drained future once the logical one ended (on success both at once).
                let drained = match logical {
                    Some(Poll::Pending) => Poll::Pending,
                    _ => d.drained.as_mut().poll(&mut cx),
                };
                (logical, drained)
            }));
            let mut st = self.lock();
            st.polling = false;
            let mut recorded = true;
            match polled {
                Ok((Some(Poll::Ready(o)), drained)) => {
                    d.logical = None;
                    due.extend(st.record(Some(o), false));
                    if let Poll::Ready(o) = drained {
                        due.extend(st.record(Some(o), true));
                    }
                }
                Ok((_, Poll::Ready(o))) => due.extend(st.record(Some(o), true)),
                Ok(_) => recorded = false,
                Err(_) => due.extend(st.record(None, false)),
            }
            let again = st.woken && !st.settled();
            let ended = st.settled();
            // Only a thread in `wait` sleeps on the condvar (a notify is a system call).
            let tell = recorded && st.sleepers > 0;
            drop(st);
            if ended {
                // Dropping the futures may unwind too (a poisoned lock below): it stays here.
                let gone = slot.take();
                let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| drop(gone)));
            }
            if tell {
                self.cond.notify_all();
            }
            if !again {
                return due;
            }
        }
    }

    /// Waits, in a thread counted in `sleepers` with the GIL released, until the outcome asked
    /// for (`drained`, or the logical one) is known, the watch is lost (`(None, true)`), or
    /// `until` passes (`(None, false)`). A directly driven request is polled here, again at
    /// each wake of its waker.
    fn wait_until(&self, until: Instant, drained: bool) -> (Option<Outcome>, bool) {
        loop {
            let due = self.poll_direct(&self.waker, true);
            if !due.is_empty() {
                // This thread does not hold the GIL; the blocking pool settles them.
                self.runtime.spawn_blocking(move || {
                    Python::try_attach(|py| deliver(py, due));
                });
            }
            let mut st = self.lock();
            loop {
                let ready = if drained { st.drained } else { st.outcome };
                if ready.is_some() || st.lost {
                    return (ready, st.lost);
                }
                let now = Instant::now();
                if now >= until {
                    return (None, false);
                }
                if st.woken {
                    break;
                }
                st = self
                    .cond
                    .wait_timeout(st, until - now)
                    .unwrap_or_else(PoisonError::into_inner)
                    .0;
            }
        }
    }

    /// Records an outcome from the watching task (a runtime worker): the asyncio futures due
    /// are settled from the blocking pool, never from the worker.
    fn settle(&self, outcome: Option<Outcome>, drained: bool) {
        let (due, tell) = {
            let mut st = self.lock();
            (st.record(outcome, drained), st.sleepers > 0)
        };
        if tell {
            self.cond.notify_all();
        }
        if !due.is_empty() {
            self.runtime.spawn_blocking(move || {
                Python::try_attach(|py| deliver(py, due));
            });
        }
    }
}

/// Settles each due asyncio future from its loop's thread (`call_soon_threadsafe`).
fn deliver(py: Python<'_>, due: Vec<Due>) {
    for (event_loop, fut, outcome) in due {
        settle_future(py, &event_loop, &fut, outcome);
    }
}

/// Sets `fut`'s result (or its exception when the request's watch was lost) from its loop's
/// thread. A closed loop cannot be told; the future is then dropped unsettled.
fn settle_future(py: Python<'_>, event_loop: &Py<PyAny>, fut: &Py<PyAny>, o: Option<Outcome>) {
    let result = (|| -> PyResult<()> {
        let value: Py<PyAny> = match o {
            Some(o) => Py::new(py, PyOutcome(o))?.into_any(),
            None => lost_error(py).into_value(py).into_any(),
        };
        let setter = pyo3::wrap_pyfunction!(_settle, py)?;
        event_loop.call_method1(py, "call_soon_threadsafe", (setter, fut, value))?;
        Ok(())
    })();
    if let Err(e) = result {
        // A closed event loop raises RuntimeError; nothing awaits the future any more.
        if !e.is_instance_of::<pyo3::exceptions::PyRuntimeError>(py) {
            e.write_unraisable(py, None);
        }
    }
}

/// Settles an asyncio future with an outcome or an exception, unless it was cancelled meanwhile.
#[pyfunction]
fn _settle(fut: &Bound<'_, PyAny>, value: &Bound<'_, PyAny>) -> PyResult<()> {
    if fut.call_method0("done")?.is_truthy()? {
        return Ok(());
    }
    if value.is_instance_of::<pyo3::exceptions::PyBaseException>() {
        fut.call_method1("set_exception", (value,))?;
    } else {
        fut.call_method1("set_result", (value,))?;
    }
    Ok(())
}

fn lost_error(py: Python<'_>) -> PyErr {
    errors::err(
        py,
        Kind::FerryError,
        "internal error: the task watching this request ended without an outcome".into(),
    )
}

/// Sets the watch's state to `lost` if the watching task unwinds or is dropped before it
/// recorded the outcomes, so that no waiter hangs.
struct LostGuard(Option<Arc<Watch>>);

impl Drop for LostGuard {
    fn drop(&mut self) {
        if let Some(w) = self.0.take() {
            w.settle(None, false);
        }
    }
}

/// Starts watching `handle` on the current runtime, driven directly: no task of its own (see
/// [`Watch`]). The request moves whether or not anyone polls it (its first attempt is posted
/// at submit); its replays, its deadline's timer and its drain after a timeout or cancel run
/// while someone waits for it (`wait`, `await`, a blocking-pool job once such a wait was left),
/// as the facade's handle does (`ferry::RequestHandle`). `done()` polls it without waiting.
pub(crate) fn watch(handle: ferry::RequestHandle) -> (Arc<Watch>, Canceller) {
    let canceller = handle.canceller();
    let drained: OutcomeFuture = Box::pin(handle.drained());
    let logical: OutcomeFuture = handle.into_future();
    let watch = Watch::new(Some(Direct {
        logical: Some(logical),
        drained,
    }));
    (watch, canceller)
}

/// Like [`watch`], with `after` run once every op of the request completed (a notification
/// to the peer, say), before the outcome is recorded: the request is done only once `after`
/// is, and `after`'s error, if any, is kept as the request's `after_error`. With `after`, one
/// task on the current runtime watches the request (`after` must run whether or not anyone
/// waits); without, it is driven directly ([`watch`]).
pub(crate) fn watch_then<F>(
    handle: ferry::RequestHandle,
    after: Option<F>,
) -> (Arc<Watch>, Canceller)
where
    F: Future<Output = Result<(), ferry::Error>> + Send + 'static,
{
    let Some(after) = after else {
        return watch(handle);
    };
    let watch = Watch::new(None);
    let canceller = handle.canceller();
    let drained = handle.drained();
    let w = watch.clone();
    tokio::spawn(async move {
        let mut guard = LostGuard(Some(w.clone()));
        let outcome = handle.await;
        if outcome.is_success()
            && let Err(e) = after.await
        {
            w.lock().after_error = Some(e.to_string());
        }
        w.settle(Some(outcome), false);
        let done = drained.await;
        guard.0 = None;
        w.settle(Some(done), true);
    });
    (watch, canceller)
}

/// The local side of an op: host memory (`Registration`) or device memory (`GpuRegistration`).
pub(crate) enum LocalReg {
    Host(Py<Registration>),
    Gpu(Py<GpuRegistration>),
}

impl LocalReg {
    /// `obj` as a local registration; `TypeError` for anything else.
    fn extract(obj: &Bound<'_, PyAny>) -> PyResult<Self> {
        if let Ok(r) = obj.cast::<Registration>() {
            return Ok(Self::Host(r.clone().unbind()));
        }
        if let Ok(r) = obj.cast::<GpuRegistration>() {
            return Ok(Self::Gpu(r.clone().unbind()));
        }
        Err(PyTypeError::new_err(format!(
            "local must be a Registration or a GpuRegistration, not {}",
            obj.get_type()
                .name()
                .map(|n| n.to_string())
                .unwrap_or_else(|_| "?".into())
        )))
    }

    /// Name, length and whether it is read-only.
    fn facts(&self) -> (&str, u64, bool) {
        match self {
            Self::Host(r) => {
                let r = r.get();
                (&r.name, r.len, r.readonly)
            }
            Self::Gpu(r) => {
                let r = r.get();
                (&r.name, r.len, r.readonly)
            }
        }
    }
}

/// One op of a Python batch, before validation.
pub(crate) struct PyOp {
    kind: OpKind,
    local: LocalReg,
    local_offset: u64,
    remote: Py<RemoteSegment>,
    remote_offset: u64,
    len: u64,
}

/// Checks a Python op's arguments and describes it; errors are `TypeError`/`ValueError`.
pub(crate) fn make_op(
    kind: OpKind,
    local: &Bound<'_, PyAny>,
    remote: &Bound<'_, RemoteSegment>,
    local_offset: i64,
    remote_offset: i64,
    length: Option<i64>,
) -> PyResult<PyOp> {
    let local = LocalReg::extract(local)?;
    let local_offset = non_negative("local_offset", local_offset)?;
    let remote_offset = non_negative("remote_offset", remote_offset)?;
    let (name, reg_len, readonly) = local.facts();
    if kind == OpKind::Read && readonly {
        return Err(PyTypeError::new_err(format!(
            "cannot READ into registration {name:?}: its memory is read-only"
        )));
    }
    let len = match length {
        Some(l) => non_negative("length", l)?,
        // The rest of the source; the destination must hold all of it.
        None => {
            let local_rest = reg_len.checked_sub(local_offset).ok_or_else(|| {
                errors::err(
                    remote.py(),
                    Kind::OutOfBounds,
                    format!(
                        "local_offset {local_offset} is past the end of registration {name:?} \
                         ({reg_len} bytes)"
                    ),
                )
            })?;
            let remote_len = remote.get().segment.len();
            let remote_rest = remote_len.checked_sub(remote_offset).ok_or_else(|| {
                errors::err(
                    remote.py(),
                    Kind::OutOfBounds,
                    format!(
                        "remote_offset {remote_offset} is past the end of segment {:?} ({} bytes)",
                        remote.get().segment.name(),
                        remote_len
                    ),
                )
            })?;
            let segment = remote.get().segment.name().to_owned();
            let (source, dest) = match kind {
                OpKind::Read => (
                    (remote_rest, format!("segment {segment:?}")),
                    (local_rest, format!("registration {name:?}")),
                ),
                _ => (
                    (local_rest, format!("registration {name:?}")),
                    (remote_rest, format!("segment {segment:?}")),
                ),
            };
            if dest.0 < source.0 {
                return Err(errors::err(
                    remote.py(),
                    Kind::OutOfBounds,
                    format!(
                        "the destination, {}, has {} bytes from its offset, fewer than the {} \
                         bytes of {} from its offset: give length= to move only part",
                        dest.1, dest.0, source.0, source.1
                    ),
                ));
            }
            source.0
        }
    };
    Ok(PyOp {
        kind,
        local,
        local_offset,
        remote: remote.clone().unbind(),
        remote_offset,
        len,
    })
}

/// The engine's error for a submit of `ops`, naming the segment it concerns where the engine
/// gives only its token (`AccessDenied`, `UnknownSegment`).
pub(crate) fn segment_error(py: Python<'_>, e: ferry::Error, ops: &[PyOp]) -> PyErr {
    let token = match &e {
        ferry::Error::AccessDenied { token, .. } | ferry::Error::UnknownSegment { token, .. } => {
            *token
        }
        _ => return errors::to_py(py, e),
    };
    let name = ops
        .iter()
        .map(|op| &op.remote.get().segment)
        .find(|s| s.desc().token == token)
        .map(|s| s.name().to_owned());
    match name {
        Some(name) => errors::err(py, errors::kind_of(&e), format!("segment {name:?}: {e}")),
        None => errors::to_py(py, e),
    }
}

/// Builds the facade's batch from Python ops; `ValueError`/`FerryError` for what it refuses.
pub(crate) fn to_batch(
    py: Python<'_>,
    ops: &[PyOp],
    timeout: Option<Duration>,
) -> PyResult<ferry::Batch> {
    let mut batch = ferry::Batch::new();
    let closed = |name: &str| {
        errors::err(
            py,
            Kind::InvalidRequest,
            format!("registration {name:?} is closed"),
        )
    };
    for op in ops {
        let remote = &op.remote.get().segment;
        // The memory as the batch records it (its registration may be closed meanwhile).
        let local = match &op.local {
            LocalReg::Host(r) => {
                let r = r.get();
                let guard = r.inner.lock().unwrap_or_else(PoisonError::into_inner);
                guard
                    .as_ref()
                    .map(LocalMemory::local_ref)
                    .ok_or_else(|| closed(&r.name))?
            }
            LocalReg::Gpu(r) => {
                let r = r.get();
                let guard = r.inner.lock().unwrap_or_else(PoisonError::into_inner);
                guard
                    .as_ref()
                    .map(LocalMemory::local_ref)
                    .ok_or_else(|| closed(&r.name))?
            }
        };
        batch.push(
            op.kind,
            &local,
            op.local_offset,
            remote,
            op.remote_offset,
            op.len,
        );
    }
    Ok(match timeout {
        Some(t) => batch.timeout(t),
        None => batch,
    })
}

/// An ordered batch of READs and WRITEs to one peer, submitted as one request with
/// `Engine.submit(batch)`.
///
/// Offsets and lengths are in bytes. `length=None` moves the rest of the source (the remote
/// segment for a READ, the local registration for a WRITE) from its offset on; a destination
/// with less room is `OutOfBounds` (give `length` to move only part). `timeout` (seconds) ends
/// the request logically once it passes: its outcome then fails with kind `timeout`.
#[pyclass(name = "Batch", module = "ferry")]
pub(crate) struct Batch {
    pub(crate) ops: Vec<PyOp>,
    pub(crate) timeout: Option<Duration>,
}

#[pymethods]
impl Batch {
    #[new]
    #[pyo3(signature = (timeout=None))]
    fn new(timeout: Option<f64>) -> PyResult<Self> {
        Ok(Self {
            ops: Vec::new(),
            timeout: seconds("timeout", timeout)?,
        })
    }

    /// Appends a READ of `remote[remote_offset:+length]` into `local[local_offset:+length]`;
    /// returns the batch.
    #[pyo3(signature = (local, remote, local_offset=0, remote_offset=0, length=None))]
    fn read<'py>(
        mut slf: PyRefMut<'py, Self>,
        local: &Bound<'py, PyAny>,
        remote: &Bound<'py, RemoteSegment>,
        local_offset: i64,
        remote_offset: i64,
        length: Option<i64>,
    ) -> PyResult<PyRefMut<'py, Self>> {
        let op = make_op(
            OpKind::Read,
            local,
            remote,
            local_offset,
            remote_offset,
            length,
        )?;
        slf.ops.push(op);
        Ok(slf)
    }

    /// Appends a WRITE of `local[local_offset:+length]` into `remote[remote_offset:+length]`;
    /// returns the batch.
    #[pyo3(signature = (local, remote, local_offset=0, remote_offset=0, length=None))]
    fn write<'py>(
        mut slf: PyRefMut<'py, Self>,
        local: &Bound<'py, PyAny>,
        remote: &Bound<'py, RemoteSegment>,
        local_offset: i64,
        remote_offset: i64,
        length: Option<i64>,
    ) -> PyResult<PyRefMut<'py, Self>> {
        let op = make_op(
            OpKind::Write,
            local,
            remote,
            local_offset,
            remote_offset,
            length,
        )?;
        slf.ops.push(op);
        Ok(slf)
    }

    fn __len__(&self) -> usize {
        self.ops.len()
    }

    fn __repr__(&self) -> String {
        format!(
            "Batch(ops={}, bytes={}, timeout={:?})",
            self.ops.len(),
            self.ops.iter().map(|o| o.len).sum::<u64>(),
            self.timeout.map(|t| t.as_secs_f64())
        )
    }
}

/// A submitted request. `wait()` blocks (with the GIL released) until it ends and returns its
/// `Outcome`, raising the failure's `FerryError` subclass (with the outcome as its `outcome`
/// attribute) when the request failed; `wait(check=False)` returns the failed `Outcome` instead.
/// `await request` does the same in asyncio and gives the `Outcome` without raising (call
/// `outcome.raise_for_failure()`).
///
/// The registrations it uses stay alive until it is drained, whatever Python does with them.
#[pyclass(name = "Request", module = "ferry", frozen)]
pub(crate) struct Request {
    pub(crate) watch: Arc<Watch>,
    pub(crate) canceller: Canceller,
}

impl Request {
    fn wait_for(&self, py: Python<'_>, timeout: Option<f64>, drained: bool) -> PyResult<PyOutcome> {
        let limit = seconds("timeout", timeout)?;
        // Already ended (often so for the oldest of several in flight): no GIL round trip.
        {
            let st = self.watch.lock();
            if let Some(o) = if drained { st.drained } else { st.outcome } {
                return Ok(PyOutcome(o));
            }
        }
        let deadline = limit.map(|t| Instant::now() + t);
        // Wait in slices so that Ctrl-C (a pending signal) interrupts a long wait.
        const SLICE: Duration = crate::runtime::SIGNAL_POLL;
        loop {
            let watch = &self.watch;
            let got = py.detach(|| {
                let until = Instant::now() + SLICE;
                let until = deadline.map_or(until, |d| d.min(until));
                watch.lock().sleepers += 1;
                let got = watch.wait_until(until, drained);
                watch.lock().sleepers -= 1;
                got
            });
            match got {
                (Some(o), _) => return Ok(PyOutcome(o)),
                (None, true) => return Err(lost_error(py)),
                (None, false) => {}
            }
            if let Err(e) = py.check_signals() {
                // Ctrl-C (or another signal handler's exception): the request ends too.
                self.canceller.cancel();
                return Err(e);
            }
            if let (Some(d), Some(t)) = (deadline, limit)
                && Instant::now() >= d
            {
                return Err(PyTimeoutError::new_err(format!(
                    "the request did not {} within {:.3} s; it is still running (wait again, \
                     or cancel() it)",
                    if drained { "drain" } else { "end" },
                    t.as_secs_f64()
                )));
            }
        }
    }

    fn future<'py>(&self, py: Python<'py>, drained: bool) -> PyResult<Bound<'py, PyAny>> {
        let asyncio = py.import("asyncio")?;
        let event_loop = asyncio.call_method0("get_running_loop")?;
        let fut = event_loop.call_method0("create_future")?;
        // Cancelling the awaiting task (asyncio.wait_for, TaskGroup) cancels the request.
        let on_done = Py::new(
            py,
            CancelOnCancel {
                canceller: self.canceller.clone(),
            },
        )?;
        fut.call_method1("add_done_callback", (on_done,))?;
        // A directly driven request is polled here with the watch's waker, so that its end
        // (or its timer) wakes the watch, which settles this future from the blocking pool.
        let due = self.watch.poll_direct(&self.watch.waker, false);
        deliver(py, due);
        let ready = {
            let mut st = self.watch.lock();
            let ready = if drained { st.drained } else { st.outcome };
            match (ready, st.lost) {
                (None, false) => {
                    st.waiters
                        .push((event_loop.clone().unbind(), fut.clone().unbind(), drained));
                    None
                }
                (o, _) => Some(o),
            }
        };
        match ready {
            Some(Some(o)) => {
                fut.call_method1("set_result", (Py::new(py, PyOutcome(o))?,))?;
            }
            Some(None) => {
                fut.call_method1("set_exception", (lost_error(py).into_value(py),))?;
            }
            None => {}
        }
        Ok(fut)
    }
}

#[pymethods]
impl Request {
    /// Blocks until the request ends (completed, failed, timed out or cancelled) and returns its
    /// `Outcome`. Releases the GIL meanwhile. With `check` (the default), a failed request
    /// raises its `FerryError` subclass (`PeerLost`, `Timeout`, ...) with the `Outcome` as its
    /// `outcome` attribute: a failure is never mistaken for data in the buffer. With
    /// `check=False` the failed `Outcome` is returned. With `timeout` (seconds), raises the
    /// builtin `TimeoutError` if it has not ended by then; the request keeps running.
    #[pyo3(signature = (timeout=None, check=true))]
    fn wait(&self, py: Python<'_>, timeout: Option<f64>, check: bool) -> PyResult<PyOutcome> {
        let outcome = self.wait_for(py, timeout, false)?;
        if check {
            outcome.raise_for_failure(py)?;
        }
        Ok(outcome)
    }

    /// Like `wait(check=False)`, but returns only once the transport has physically finished
    /// with the local buffers (`outcome.drained` is true): after a timeout or cancel, reuse the
    /// buffers only then. It does not raise for a failed request (it is how one is cleaned up).
    #[pyo3(signature = (timeout=None))]
    fn wait_drained(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<PyOutcome> {
        self.wait_for(py, timeout, true)
    }

    /// An asyncio future that resolves to the drained `Outcome` (call inside a running loop).
    fn drained<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        self.future(py, true)
    }

    /// Why the notification sent once the request completed failed (None: it was delivered,
    /// or the request had none). Known once the request is done.
    #[getter]
    fn after_error(&self) -> Option<String> {
        self.watch.lock().after_error.clone()
    }

    /// Whether the request has ended (its outcome is known). Never waits for the transport: a
    /// request it has finished is resolved right here, in the caller's thread, so a loop that
    /// polls `done()` sees the end as soon as it happens.
    fn done(&self, py: Python<'_>) -> bool {
        let awaited = {
            let st = self.watch.lock();
            if st.outcome.is_some() || st.lost {
                return true;
            }
            !st.waiters.is_empty()
        };
        // Polled with no waker unless asyncio futures await it: a caller that polls wants no
        // thread woken for it.
        let waker = if awaited {
            &self.watch.waker
        } else {
            Waker::noop()
        };
        // The GIL released while it polls (the transport may spin briefly for the answer):
        // the caller's other Python threads run meanwhile.
        let watch = &self.watch;
        let due = py.detach(|| watch.poll_direct(waker, false));
        deliver(py, due);
        let st = self.watch.lock();
        st.outcome.is_some() || st.lost
    }

    /// Test hook, not part of the API: the request's next poll first holds its thread at the
    /// returned gate until [`TestGate::open`] is called (or [`TestGate::PATIENCE`] passed),
    /// then polls the request as before. `None`: the request is not driven directly (or has
    /// drained).
    fn _plant_gate_for_tests(&self) -> Option<TestGate> {
        let mut slot = self
            .watch
            .direct
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let d = slot.as_mut()?;
        let gate = TestGate::default();
        let held = gate.clone();
        let target = match d.logical.as_mut() {
            Some(f) => f,
            None => &mut d.drained,
        };
        let inner = std::mem::replace(target, Box::pin(std::future::pending()));
        *target = Box::pin(async move {
            held.hold();
            inner.await
        });
        Some(gate)
    }

    /// Test hook, not part of the API: the request's next poll panics, as a bug below it
    /// would (the watch is then lost). Whether it was planted (the request is driven directly
    /// and has not drained).
    fn _plant_panic_for_tests(&self) -> bool {
        let mut slot = self
            .watch
            .direct
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let Some(d) = slot.as_mut() else {
            return false;
        };
        let boom: OutcomeFuture = Box::pin(async { panic!("a test panic in a request's poll") });
        match d.logical.as_mut() {
            Some(f) => *f = boom,
            None => d.drained = boom,
        }
        true
    }

    /// Ends the request logically: no further chunk is posted and it resolves with a
    /// `cancelled` failure (unless it already completed). Buffers stay in use until drained.
    fn cancel(&self) {
        self.canceller.cancel();
    }

    fn __await__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        self.future(py, false)?.call_method0("__await__")
    }

    fn __repr__(&self) -> String {
        let st = self.watch.lock();
        match (st.drained, st.outcome) {
            (Some(o), _) | (None, Some(o)) => format!("<ferry.Request done: {}>", describe(&o)),
            _ => "<ferry.Request running>".into(),
        }
    }
}

/// Test hook, not part of the API: a gate that a planted poll waits at
/// ([`Request::_plant_gate_for_tests`]), so that a test can tell whether the polling thread
/// let other Python threads run while it waited.
#[pyclass(module = "ferry", name = "_TestGate", frozen)]
#[derive(Clone, Default)]
pub(crate) struct TestGate(Arc<(Mutex<GateState>, Condvar)>);

#[derive(Default)]
struct GateState {
    entered: bool,
    opened: bool,
    timed_out: bool,
}

impl TestGate {
    /// How long a planted poll waits for the gate to open.
    const PATIENCE: Duration = Duration::from_secs(5);

    /// Marks the gate entered and waits for it to open, at most [`Self::PATIENCE`].
    fn hold(&self) {
        let (lock, cond) = &*self.0;
        let mut st = lock.lock().unwrap_or_else(PoisonError::into_inner);
        st.entered = true;
        let (mut st, waited) = cond
            .wait_timeout_while(st, Self::PATIENCE, |s| !s.opened)
            .unwrap_or_else(PoisonError::into_inner);
        st.timed_out = waited.timed_out();
    }

    fn state<T>(&self, f: impl FnOnce(&mut GateState) -> T) -> T {
        f(&mut self.0.0.lock().unwrap_or_else(PoisonError::into_inner))
    }
}

#[pymethods]
impl TestGate {
    /// Whether a poll has reached the gate.
    fn entered(&self) -> bool {
        self.state(|s| s.entered)
    }

    /// Lets the poll at the gate go on.
    fn open(&self) {
        self.state(|s| s.opened = true);
        self.0.1.notify_all();
    }

    /// Whether the poll gave up waiting for the gate to open.
    fn timed_out(&self) -> bool {
        self.state(|s| s.timed_out)
    }
}

/// The done-callback that cancels a request when the asyncio future awaiting it is cancelled.
#[pyclass(module = "ferry", frozen)]
struct CancelOnCancel {
    canceller: Canceller,
}

#[pymethods]
impl CancelOnCancel {
    fn __call__(&self, fut: &Bound<'_, PyAny>) -> PyResult<()> {
        if fut.call_method0("cancelled")?.is_truthy()? {
            self.canceller.cancel();
        }
        Ok(())
    }
}

fn effect_name(e: RemoteEffect) -> &'static str {
    match e {
        RemoteEffect::None => "none",
        RemoteEffect::Certain => "certain",
        RemoteEffect::Uncertain => "uncertain",
    }
}

fn failure_kind_name(k: ferry::FailureKind) -> &'static str {
    use ferry::FailureKind as F;
    match k {
        F::Timeout => "timeout",
        F::Cancelled => "cancelled",
        F::PeerLost => "peer_lost",
        F::Remote(RemoteStatus::UnknownSegment) => "unknown_segment",
        F::Remote(RemoteStatus::OutOfBounds) => "out_of_bounds",
        F::Remote(RemoteStatus::AccessDenied) => "access_denied",
        F::Remote(RemoteStatus::StaleEpoch) => "stale_epoch",
        F::Remote(RemoteStatus::Malformed) => "malformed",
        F::Local => "local",
        _ => "other",
    }
}

fn describe(o: &Outcome) -> String {
    let failure = match o.failure {
        None => "None".to_owned(),
        Some(f) => format!(
            "Failure(op_index={}, kind={:?})",
            f.op_index,
            failure_kind_name(f.kind)
        ),
    };
    format!(
        "Outcome(completed_ops={}, completed_bytes={}, failure={failure}, remote_effect={:?}, \
         drained={})",
        o.completed_ops,
        o.completed_bytes,
        effect_name(o.remote_effect),
        if o.drained { "True" } else { "False" },
    )
}

/// Raises `o`'s failure as `Outcome.raise_for_failure` does; nothing when it succeeded.
pub(crate) fn raise_failure(py: Python<'_>, o: &PyOutcome) -> PyResult<()> {
    o.raise_for_failure(py)
}

/// The outcome of a request: how many ops from the start completed and their bytes, the first
/// failure if any, what failed WRITEs may have done to remote memory, and whether the local
/// buffers are free again. Never reports a byte that was not acknowledged.
#[pyclass(name = "Outcome", module = "ferry", frozen)]
#[derive(Clone, Copy)]
pub(crate) struct PyOutcome(pub(crate) Outcome);

#[pymethods]
impl PyOutcome {
    /// How many ops, from the start of the batch, are known complete.
    #[getter]
    fn completed_ops(&self) -> usize {
        self.0.completed_ops
    }

    /// The bytes of those ops.
    #[getter]
    fn completed_bytes(&self) -> u64 {
        self.0.completed_bytes
    }

    /// The first failure (`Failure`), or None when every op completed.
    #[getter]
    fn failure(&self) -> Option<PyFailure> {
        self.0.failure.map(PyFailure)
    }

    /// What the failed and later WRITEs may have done remotely: `"none"`, `"certain"` (some of
    /// their bytes landed, none is in doubt) or `"uncertain"` (some may have landed).
    #[getter]
    fn remote_effect(&self) -> &'static str {
        effect_name(self.0.remote_effect)
    }

    /// Whether the local side has physically finished with the buffers.
    #[getter]
    fn drained(&self) -> bool {
        self.0.drained
    }

    /// Whether every op completed.
    #[getter]
    fn ok(&self) -> bool {
        self.0.is_success()
    }

    /// Raises the `FerryError` subclass of the failure's kind (`Timeout`, `Cancelled`,
    /// `PeerLost`, `OutOfBounds`, `AccessDenied`, `UnknownSegment`, `StaleEpoch`, `Malformed`,
    /// or `FerryError` for a local error), with this outcome as its `outcome` attribute.
    /// Does nothing when the request succeeded.
    fn raise_for_failure(&self, py: Python<'_>) -> PyResult<()> {
        let Some(f) = self.0.failure else {
            return Ok(());
        };
        let msg = format!(
            "op {} of the request failed: {}{}; {} ops ({} bytes) completed before it; remote \
             effect of the failed and later WRITEs: {}",
            f.op_index,
            f.kind,
            f.native_status
                .map(|s| format!(" (native status {s})"))
                .unwrap_or_default(),
            self.0.completed_ops,
            self.0.completed_bytes,
            effect_name(self.0.remote_effect)
        );
        let err = errors::err(py, errors::kind_of_failure(f.kind), msg);
        err.value(py).setattr("outcome", Py::new(py, *self)?)?;
        Err(err)
    }

    fn __bool__(&self) -> bool {
        self.0.is_success()
    }

    fn __repr__(&self) -> String {
        describe(&self.0)
    }

    fn __eq__(&self, other: &Bound<'_, PyAny>) -> bool {
        other.cast::<PyOutcome>().is_ok_and(|o| o.get().0 == self.0)
    }
}

/// The first failed op of a request.
#[pyclass(name = "Failure", module = "ferry", frozen)]
#[derive(Clone, Copy)]
pub(crate) struct PyFailure(ferry::Failure);

#[pymethods]
impl PyFailure {
    /// Index of the op in the batch (equal to the outcome's `completed_ops`).
    #[getter]
    fn op_index(&self) -> usize {
        self.0.op_index
    }

    /// What went wrong: `"timeout"`, `"cancelled"`, `"peer_lost"`, `"local"`, or a refusal by
    /// the remote side: `"unknown_segment"`, `"out_of_bounds"`, `"access_denied"`,
    /// `"stale_epoch"`, `"malformed"`.
    #[getter]
    fn kind(&self) -> &'static str {
        failure_kind_name(self.0.kind)
    }

    /// Whether the remote side refused the op (no byte of the refused chunk moved).
    #[getter]
    fn remote(&self) -> bool {
        matches!(self.0.kind, ferry::FailureKind::Remote(_))
    }

    /// The native status (errno, verbs work-completion status) where there is one.
    #[getter]
    fn native_status(&self) -> Option<i32> {
        self.0.native_status
    }

    /// The failure in words, as the Rust engine says it.
    #[getter]
    fn message(&self) -> String {
        self.0.kind.to_string()
    }

    fn __repr__(&self) -> String {
        format!(
            "Failure(op_index={}, kind={:?}, native_status={:?})",
            self.0.op_index,
            failure_kind_name(self.0.kind),
            self.0.native_status
        )
    }
}

/// Test hook, not part of the API: how many tasks of the shared runtime are alive now (a
/// request driven directly adds none).
#[pyfunction]
fn _runtime_tasks_for_tests(py: Python<'_>) -> PyResult<usize> {
    Ok(crate::runtime::get(py)?.metrics().num_alive_tasks())
}

/// Registers the classes of this module.
pub(crate) fn add_to(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(pyo3::wrap_pyfunction!(_runtime_tasks_for_tests, m)?)?;
    m.add_class::<Batch>()?;
    m.add_class::<Request>()?;
    m.add_class::<TestGate>()?;
    m.add_class::<PyOutcome>()?;
    m.add_class::<PyFailure>()?;
    Ok(())
}
