//! Batches of ops and the handles of submitted requests.

use std::future::{Future, IntoFuture};
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::task::{Context, Poll, Wake, Waker};
use std::time::Duration;

use ferry_core::{Error, FailureKind, Op, OpKind, Outcome, RequestControl};
use tokio::sync::Notify;

use crate::handles::{Registration, RemoteSegment};
use crate::reconnect::PeerInner;

/// The local side of an op: host memory, or (with the `cuda` feature) device memory, with its
/// GPUDirect RDMA region when it has one. Device memory reaches a transport only as that region
/// and only towards an RDMA peer; otherwise the engine stages it.
#[derive(Clone, Debug)]
pub(crate) enum Local {
    Host(Arc<ferry_core::MemoryRegion>),
    #[cfg(feature = "cuda")]
    Device(
        Arc<ferry_cuda::DeviceMemory>,
        Option<Arc<ferry_core::MemoryRegion>>,
        Option<Arc<ferry_core::MemoryRegion>>,
    ),
}

impl Local {
    fn len(&self) -> u64 {
        match self {
            Local::Host(r) => r.len() as u64,
            #[cfg(feature = "cuda")]
            Local::Device(m, ..) => m.len() as u64,
        }
    }
}

/// Local memory a batch can name: a [`Registration`] of host memory, or (with the `cuda`
/// feature) a `GpuRegistration` of device memory.
pub trait LocalMemory {
    /// The memory, as the batch records it.
    fn local_ref(&self) -> LocalRef;
}

/// Local memory as a batch records it (opaque).
#[derive(Clone, Debug)]
pub struct LocalRef(pub(crate) Local);

impl LocalRef {
    /// Its length in bytes.
    pub fn len(&self) -> u64 {
        self.0.len()
    }

    /// Whether it has no byte.
    pub fn is_empty(&self) -> bool {
        self.0.len() == 0
    }

    /// The host memory, when it is host memory (layers above the engine read and checksum it).
    pub fn host(&self) -> Option<&Arc<ferry_core::MemoryRegion>> {
        match &self.0 {
            Local::Host(r) => Some(r),
            #[cfg(feature = "cuda")]
            Local::Device(..) => None,
        }
    }

    /// The device memory, when it is device memory (copied to and from the host by the driver).
    #[cfg(feature = "cuda")]
    pub fn device(&self) -> Option<&Arc<ferry_cuda::DeviceMemory>> {
        match &self.0 {
            Local::Host(_) => None,
            Local::Device(m, ..) => Some(m),
        }
    }
}

impl<T: LocalMemory + ?Sized> LocalMemory for Arc<T> {
    fn local_ref(&self) -> LocalRef {
        (**self).local_ref()
    }
}

impl LocalMemory for LocalRef {
    fn local_ref(&self) -> LocalRef {
        self.clone()
    }
}

impl<T: LocalMemory + ?Sized> LocalMemory for &T {
    fn local_ref(&self) -> LocalRef {
        (**self).local_ref()
    }
}

impl LocalMemory for Registration {
    fn local_ref(&self) -> LocalRef {
        LocalRef(Local::Host(self.region().clone()))
    }
}

#[cfg(feature = "cuda")]
/// An op of a staged request.
#[derive(Clone, Debug)]
pub(crate) struct StagedOp {
    pub(crate) kind: OpKind,
    pub(crate) local: Local,
    pub(crate) local_offset: u64,
    pub(crate) token: ferry_core::SegmentToken,
    pub(crate) remote_offset: u64,
    pub(crate) len: u64,
}

/// A batch after its checks: host ops for a transport, or ops with device memory to stage.
pub(crate) enum Checked {
    Host(Vec<Op>),
    #[cfg(feature = "cuda")]
    Staged(Vec<StagedOp>),
}

/// One op of a batch, before validation.
#[derive(Clone, Debug)]
pub(crate) struct PendingOp {
    pub(crate) kind: OpKind,
    pub(crate) local: Local,
    pub(crate) local_offset: u64,
    pub(crate) remote: RemoteSegment,
    pub(crate) remote_offset: u64,
    pub(crate) len: u64,
}

/// An ordered batch of READs and WRITEs to one peer: one request.
#[derive(Clone, Debug, Default)]
pub struct Batch {
    pub(crate) ops: Vec<PendingOp>,
    pub(crate) timeout: Option<Duration>,
}

impl Batch {
    /// An empty batch.
    pub fn new() -> Self {
        Self::default()
    }

    /// Appends a READ of `remote[remote_offset..+len]` into `local[local_offset..+len]`.
    pub fn read(
        mut self,
        local: &impl LocalMemory,
        local_offset: u64,
        remote: &RemoteSegment,
        remote_offset: u64,
        len: u64,
    ) -> Self {
        self.push(
            OpKind::Read,
            local,
            local_offset,
            remote,
            remote_offset,
            len,
        );
        self
    }

    /// Appends a WRITE of `local[local_offset..+len]` into `remote[remote_offset..+len]`.
    pub fn write(
        mut self,
        local: &impl LocalMemory,
        local_offset: u64,
        remote: &RemoteSegment,
        remote_offset: u64,
        len: u64,
    ) -> Self {
        self.push(
            OpKind::Write,
            local,
            local_offset,
            remote,
            remote_offset,
            len,
        );
        self
    }

    /// Appends an op (in place).
    pub fn push(
        &mut self,
        kind: OpKind,
        local: &impl LocalMemory,
        local_offset: u64,
        remote: &RemoteSegment,
        remote_offset: u64,
        len: u64,
    ) {
        self.ops.push(PendingOp {
            kind,
            local: local.local_ref().0,
            local_offset,
            remote: remote.clone(),
            remote_offset,
            len,
        });
    }

    /// Sets this request's timeout (overrides the engine's default). Logical: the request ends,
    /// in-flight chunks still finish before `drained`.
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = Some(timeout);
        self
    }

    /// Number of ops.
    pub fn len(&self) -> usize {
        self.ops.len()
    }

    /// Whether the batch has no op.
    pub fn is_empty(&self) -> bool {
        self.ops.is_empty()
    }

    /// The peer incarnation the batch goes to and its ops, each checked against its local
    /// region and the peer's descriptor (an error here means nothing moved). A batch is not
    /// empty and goes to one peer incarnation.
    pub(crate) fn checked(&self) -> Result<(Arc<PeerInner>, Checked), Error> {
        let Some(first) = self.ops.first() else {
            return Err(Error::InvalidRequest {
                reason: "empty batch".into(),
            });
        };
        let peer = first.remote.peer.clone();
        for p in &self.ops {
            if !Arc::ptr_eq(&p.remote.peer, &peer) {
                return Err(Error::InvalidRequest {
                    reason: "a batch goes to one peer incarnation; split it per peer".into(),
                });
            }
            ferry_core::check_range(p.local_offset, p.len, p.local.len()).map_err(|source| {
                Error::OutOfBounds {
                    side: "local",
                    source,
                }
            })?;
            p.remote.desc.check(p.kind, p.remote_offset, p.len)?;
        }
        // Device memory goes to the transport as its GPUDirect region when the peer is reached
        // over RDMA and every device op has one, or as its CUDA IPC region when the peer is
        // reached by the same-host plane with CUDA IPC and every device op has one; otherwise
        // the whole batch is staged.
        #[cfg(feature = "cuda")]
        let (direct, by_ipc) = {
            let channel = peer.channel();
            let rdma = channel.kind() == ferry_core::TransportKind::Rdma;
            let ipc =
                channel.kind() == ferry_core::TransportKind::Local && channel.takes_cuda_ipc();
            let all = |which: fn(&Local) -> bool| self.ops.iter().all(|p| which(&p.local));
            let by_ipc = ipc && all(|l| !matches!(l, Local::Device(_, _, None)));
            let direct = by_ipc || (rdma && all(|l| !matches!(l, Local::Device(_, None, _))));
            (direct, by_ipc)
        };
        #[cfg(feature = "cuda")]
        if !direct
            && self
                .ops
                .iter()
                .any(|p| matches!(p.local, Local::Device(..)))
        {
            let ops = self
                .ops
                .iter()
                .map(|p| StagedOp {
                    kind: p.kind,
                    local: p.local.clone(),
                    local_offset: p.local_offset,
                    token: p.remote.desc.token,
                    remote_offset: p.remote_offset,
                    len: p.len,
                })
                .collect();
            return Ok((peer, Checked::Staged(ops)));
        }
        let mut ops = Vec::with_capacity(self.ops.len());
        for p in &self.ops {
            #[cfg_attr(not(feature = "cuda"), allow(clippy::infallible_destructuring_match))]
            let region = match &p.local {
                Local::Host(region) => region,
                #[cfg(feature = "cuda")]
                Local::Device(_, _, Some(region)) if by_ipc => region,
                #[cfg(feature = "cuda")]
                Local::Device(_, Some(region), _) if !by_ipc => region,
                #[cfg(feature = "cuda")]
                Local::Device(..) => unreachable!("device ops without a region are staged"),
            };
            ops.push(Op {
                kind: p.kind,
                local: region.clone(),
                local_offset: p.local_offset,
                token: p.remote.desc.token,
                remote_offset: p.remote_offset,
                len: p.len,
            });
        }
        Ok((peer, Checked::Host(ops)))
    }
}

/// Cancels a request from anywhere (cheap to clone).
#[derive(Clone, Debug)]
pub struct Canceller {
    control: Arc<RequestControl>,
    wake: Arc<Notify>,
}

impl Canceller {
    /// Ends the request logically: no further chunk is posted and its handle resolves at once with
    /// a `Cancelled` failure (unless it already completed). Buffers stay owned until `drained`.
    pub fn cancel(&self) {
        self.control.stop(FailureKind::Cancelled);
        self.wake.notify_one();
    }
}

/// A submitted request. Await it (it is `IntoFuture`) for the logical [`Outcome`]; await
/// [`drained`](Self::drained) for the moment its buffers are free again.
///
/// The channel's future of the request is driven by whoever awaits the handle or a
/// [`drained`](Self::drained) future, on the caller's own task: no task is spawned per request,
/// so the transport's completion wakes the awaiting task directly. If every handle and drained
/// future is dropped before the request finished, the rest of it runs as a task of the runtime
/// it was submitted on (its outcome still reaches the route's counters).
#[derive(Debug)]
pub struct RequestHandle {
    pub(crate) control: Arc<RequestControl>,
    pub(crate) wake: Arc<Notify>,
    drive: DriveRef,
    pub(crate) timeout: Option<Duration>,
}

/// The channel's future of one request, shared by its handle and drained futures: the first to
/// see it complete records the outcome (route counters, a debug line) and wakes the others.
struct Drive {
    state: Mutex<DriveState>,
    /// Every task that polled and still waits; the channel's future gets a waker that wakes
    /// them all, so it does not matter which of them polled it last.
    waiters: Arc<Waiters>,
    control: Arc<RequestControl>,
    counters: Arc<crate::counters::RouteCounters>,
    /// What the request carries, for its counters.
    shape: crate::counters::Shape,
    /// When it was submitted.
    started: std::time::Instant,
    span: tracing::Span,
    /// Handles and drained futures alive; the last one to go finishes an unfinished request
    /// on `runtime`.
    users: AtomicUsize,
    runtime: tokio::runtime::Handle,
}

struct DriveState {
    fut: Option<ferry_core::BoxFuture<'static, Outcome>>,
    done: Option<Outcome>,
}

impl std::fmt::Debug for Drive {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Drive")
            .field("done", &lock(&self.state).done)
            .finish_non_exhaustive()
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Wakers of the tasks waiting for one request.
#[derive(Default)]
struct Waiters(Mutex<Vec<Waker>>);

impl Waiters {
    fn register(&self, w: &Waker) {
        let mut g = lock(&self.0);
        if !g.iter().any(|x| x.will_wake(w)) {
            g.push(w.clone());
        }
    }

    /// Wakes every waiter, outside the lock. The emptied list goes back unless a waiter came
    /// meanwhile, so that the next registration allocates nothing (a staged request is woken
    /// as each of its pieces finishes).
    fn wake_all(&self) {
        let mut ws = std::mem::take(&mut *lock(&self.0));
        for w in ws.drain(..) {
            w.wake();
        }
        let mut g = lock(&self.0);
        if g.capacity() == 0 {
            *g = ws;
        }
    }
}

impl Wake for Waiters {
    fn wake(self: Arc<Self>) {
        self.wake_all();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        self.wake_all();
    }
}

impl Drive {
    /// Polls the channel's future for the task of `cx` (or returns the recorded outcome).
    fn poll(&self, cx: &mut Context<'_>) -> Poll<Outcome> {
        let mut st = lock(&self.state);
        if let Some(o) = st.done {
            return Poll::Ready(o);
        }
        self.waiters.register(cx.waker());
        let Some(fut) = st.fut.as_mut() else {
            // Not reachable (the future is only taken when it completed), but a request whose
            // future is gone holds no buffer.
            return Poll::Ready(self.control.outcome(true));
        };
        let waker = Waker::from(self.waiters.clone());
        let polled = {
            let _span = self.span.enter();
            fut.as_mut().poll(&mut Context::from_waker(&waker))
        };
        let Poll::Ready(outcome) = polled else {
            return Poll::Pending;
        };
        st.fut = None;
        st.done = Some(outcome);
        drop(st);
        self.counters
            .record(&outcome, &self.shape, self.started.elapsed());
        if let Some(f) = outcome.failure {
            let _span = self.span.enter();
            tracing::debug!(op = f.op_index, kind = %f.kind, effect = ?outcome.remote_effect,
                "request failed");
        }
        // The other tasks waiting for this request.
        self.waiters.wake_all();
        Poll::Ready(outcome)
    }
}

/// One user of a [`Drive`] (a handle or a drained future).
#[derive(Debug)]
struct DriveRef(Arc<Drive>);

impl DriveRef {
    fn new(drive: Arc<Drive>) -> Self {
        drive.users.fetch_add(1, Ordering::AcqRel);
        Self(drive)
    }
}

impl Clone for DriveRef {
    fn clone(&self) -> Self {
        Self::new(self.0.clone())
    }
}

impl Drop for DriveRef {
    fn drop(&mut self) {
        if self.0.users.fetch_sub(1, Ordering::AcqRel) != 1 {
            return;
        }
        let drive = self.0.clone();
        if lock(&drive.state).done.is_some() {
            return;
        }
        // Nobody waits for the request any more: it runs to its end as a task, as it would had
        // it been awaited (the route's counters still see its outcome).
        let runtime = drive.runtime.clone();
        runtime.spawn(std::future::poll_fn(move |cx| drive.poll(cx)));
    }
}

impl RequestHandle {
    /// Runs `ops` on `peer`'s channel (the caller checked there is a tokio runtime),
    /// reconnecting and replaying after a lost connection as the peer's
    /// [`ReconnectPolicy`](crate::ReconnectPolicy) allows (never past `timeout`), and recording
    /// the outcome in the route's counters.
    pub(crate) fn start(peer: &Arc<PeerInner>, ops: Vec<Op>, timeout: Option<Duration>) -> Self {
        let ops: Arc<[Op]> = ops.into();
        let control = Arc::new(RequestControl::new(&ops));
        let deadline = timeout.map(|t| tokio::time::Instant::now() + t);
        // The first attempt posts here (channels post in `execute`; their future only waits),
        // so the request moves whether or not the handle is polled; a replay after a lost
        // connection runs while the handle or a drained future is awaited (or, once both are
        // dropped, as a task).
        let shape = crate::counters::Shape::of(
            ops.iter().map(|o| (o.kind, o.len)),
            crate::describe::Path::Direct,
        );
        let fut = crate::reconnect::run(peer.clone(), ops, control.clone(), deadline);
        Self::driven(peer, control, Box::pin(fut), timeout, shape)
    }

    /// Runs `fut`, the request `control` keeps the ledger of, as a task of the current tokio
    /// runtime (a staged request moves through several steps that must go on whether or not
    /// anyone awaits it), recording its outcome in the route's counters.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn start_with(
        peer: &PeerInner,
        control: Arc<RequestControl>,
        fut: ferry_core::BoxFuture<'static, Outcome>,
        timeout: Option<Duration>,
        shape: crate::counters::Shape,
    ) -> Self {
        let handle = Self::driven(peer, control, fut, timeout, shape);
        let drive = handle.drive.clone();
        tokio::spawn(std::future::poll_fn(move |cx| drive.0.poll(cx)));
        handle
    }

    fn driven(
        peer: &PeerInner,
        control: Arc<RequestControl>,
        fut: ferry_core::BoxFuture<'static, Outcome>,
        timeout: Option<Duration>,
        shape: crate::counters::Shape,
    ) -> Self {
        let drive = Arc::new(Drive {
            state: Mutex::new(DriveState {
                fut: Some(fut),
                done: None,
            }),
            waiters: Arc::default(),
            control: control.clone(),
            counters: peer.counters.clone(),
            shape,
            started: std::time::Instant::now(),
            span: tracing::info_span!("request", peer = %peer.addr),
            users: AtomicUsize::new(0),
            runtime: tokio::runtime::Handle::current(),
        });
        Self {
            control,
            wake: Arc::new(Notify::new()),
            drive: DriveRef::new(drive),
            timeout,
        }
    }

    /// A handle that can cancel the request.
    pub fn canceller(&self) -> Canceller {
        Canceller {
            control: self.control.clone(),
            wake: self.wake.clone(),
        }
    }

    /// Cancels the request (see [`Canceller::cancel`]).
    pub fn cancel(&self) {
        self.canceller().cancel();
    }

    /// The outcome so far (not drained), for progress reports: the completed prefix, and a
    /// failure only once one happened (or the request was stopped); ops still in flight are
    /// not a failure.
    pub fn progress(&self) -> Outcome {
        self.control.progress()
    }

    /// Resolves when the transport has physically finished with every buffer of the request,
    /// with the final outcome (`drained: true`). Take it before awaiting the handle.
    pub fn drained(&self) -> impl Future<Output = Outcome> + Send + 'static {
        let drive = self.drive.clone();
        std::future::poll_fn(move |cx| drive.0.poll(cx))
    }

    /// Waits for the logical outcome: completion, or the timeout, or a cancel.
    pub async fn outcome(self) -> Outcome {
        let drained = std::future::poll_fn(|cx| self.drive.0.poll(cx));
        let deadline = async {
            match self.timeout {
                Some(t) => tokio::time::sleep(t).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            biased;
            o = drained => o,
            _ = self.wake.notified() => self.control.outcome(false),
            _ = deadline => {
                self.control.stop(FailureKind::Timeout);
                self.control.outcome(false)
            }
        }
    }
}

impl IntoFuture for RequestHandle {
    type Output = Outcome;
    type IntoFuture = Pin<Box<dyn Future<Output = Outcome> + Send>>;

    fn into_future(self) -> Self::IntoFuture {
        Box::pin(self.outcome())
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::Ordering;

    use ferry_core::transport::MockChannel;
    use ferry_core::{MemoryRegion, SegmentToken, TransportKind};
    use tokio::sync::oneshot;

    use super::*;

    /// A peer whose channel runs each request until the test sends on the returned sender
    /// (then every chunk is acknowledged), and one 4 KiB WRITE op for it.
    fn peer() -> (Arc<PeerInner>, Vec<Op>, oneshot::Sender<()>) {
        let (tx, rx) = oneshot::channel::<()>();
        let rx = Arc::new(Mutex::new(Some(rx)));
        let mut ch = MockChannel::new();
        ch.expect_kind().return_const(TransportKind::Tcp);
        ch.expect_execute().returning(move |ops, control| {
            let rx = lock(&rx).take().expect("one request");
            Box::pin(async move {
                let _ = rx.await;
                control.with_ledger(|l| {
                    for i in 0..ops.len() {
                        l.plan(i, 1);
                        l.posted(i);
                        l.acked(i);
                    }
                });
                control.outcome(true)
            })
        });
        let inner = Arc::new(PeerInner::for_test(
            Arc::new(ch),
            Vec::new(),
            Arc::default(),
        ));
        let region = Arc::new(MemoryRegion::alloc_zeroed(4096, 4096).unwrap());
        let op = Op {
            kind: OpKind::Write,
            local: region,
            local_offset: 0,
            token: SegmentToken(1),
            remote_offset: 0,
            len: 4096,
        };
        (inner, vec![op], tx)
    }

    /// The handle and a drained future on another task both see the one outcome, recorded
    /// once in the route's counters, though no task was spawned for the request.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_handle_and_a_drained_future_share_one_outcome() {
        let (peer, ops, tx) = peer();
        let h = RequestHandle::start(&peer, ops, None);
        let drained = tokio::spawn(h.drained());
        tokio::task::yield_now().await;
        assert!(!drained.is_finished());
        tx.send(()).unwrap();
        let o = h.await;
        assert!(o.is_success() && o.drained, "{o:?}");
        let d = drained.await.unwrap();
        assert_eq!(d, o);
        assert_eq!(peer.counters.requests.load(Ordering::Relaxed), 1);
        assert_eq!(peer.counters.bytes.load(Ordering::Relaxed), 4096);
    }

    /// A timeout and a cancel end the request logically (not drained) while the channel still
    /// holds it; a drained future waits for the channel, and the counters see the request once.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn timeout_and_cancel_leave_drained_to_the_channel() {
        for cancel in [false, true] {
            let (peer, ops, tx) = peer();
            let timeout = (!cancel).then_some(Duration::from_millis(50));
            let h = RequestHandle::start(&peer, ops, timeout);
            let drained = tokio::spawn(h.drained());
            if cancel {
                h.cancel();
            }
            let o = h.await;
            let want = if cancel {
                FailureKind::Cancelled
            } else {
                FailureKind::Timeout
            };
            assert_eq!(o.failure.map(|f| f.kind), Some(want), "{o:?}");
            assert!(!o.drained);
            tokio::task::yield_now().await;
            assert!(!drained.is_finished(), "drained before the channel let go");
            assert_eq!(peer.counters.requests.load(Ordering::Relaxed), 0);
            tx.send(()).unwrap();
            let d = drained.await.unwrap();
            assert!(d.drained, "{d:?}");
            assert_eq!(peer.counters.requests.load(Ordering::Relaxed), 1);
        }
    }

    /// A request whose handle is dropped unawaited (and with no drained future) runs to its end
    /// as a task: the route's counters see its outcome.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_dropped_handle_still_finishes_its_request() {
        let (peer, ops, tx) = peer();
        drop(RequestHandle::start(&peer, ops, None));
        tx.send(()).unwrap();
        let counted = async {
            while peer.counters.requests.load(Ordering::Relaxed) == 0 {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        };
        tokio::time::timeout(Duration::from_secs(20), counted)
            .await
            .expect("the dropped request never finished");
        assert_eq!(peer.counters.requests.load(Ordering::Relaxed), 1);
    }
}
