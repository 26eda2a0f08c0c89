//! Batches of ops and the handles of submitted requests.

use std::future::{Future, IntoFuture};
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use ferry_core::{Error, FailureKind, Op, OpKind, Outcome, RequestControl};
use tokio::sync::{Notify, watch};
use tracing::Instrument;

use crate::handles::{PeerInner, Registration, RemoteSegment};

/// The local side of an op: host memory, or (with the `cuda` feature) device memory, with its
/// GPUDirect RDMA region when it has one. Device memory reaches a transport only as that region
/// and only towards an RDMA peer; otherwise the engine stages it.
#[derive(Clone, Debug)]
pub(crate) enum Local {
    Host(Arc<ferry_core::MemoryRegion>),
    #[cfg(feature = "cuda")]
    Device(
        Arc<cuda::DeviceMemory>,
        Option<Arc<ferry_core::MemoryRegion>>,
    ),
}

impl Local {
    fn len(&self) -> u64 {
        match self {
            Local::Host(r) => r.len() as u64,
            #[cfg(feature = "cuda")]
            Local::Device(m, _) => m.len() as u64,
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

impl<T: LocalMemory + ?Sized> LocalMemory for Arc<T> {
    fn local_ref(&self) -> LocalRef {
        (**self).local_ref()
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

/// A batch after its checks: host ops for a transport, or ops with device memory to stage.
pub(crate) enum Checked {
    Host(Vec<Op>),
    #[cfg(feature = "cuda")]
    Staged(Vec<crate::gpu::StagedOp>),
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
        // over RDMA and every device op has one; otherwise the whole batch is staged.
        #[cfg(feature = "cuda")]
        let direct = peer.channel.kind() == ferry_core::TransportKind::Rdma
            && self.ops.iter().all(|p| match &p.local {
                Local::Device(_, d) => d.is_some(),
                Local::Host(_) => true,
            });
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
                .map(|p| crate::gpu::StagedOp {
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
            let region = match &p.local {
                Local::Host(region) => region,
                #[cfg(feature = "cuda")]
                Local::Device(_, Some(region)) => region,
                #[cfg(feature = "cuda")]
                Local::Device(_, None) => unreachable!("device ops without a region are staged"),
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
#[derive(Debug)]
pub struct RequestHandle {
    pub(crate) control: Arc<RequestControl>,
    pub(crate) wake: Arc<Notify>,
    pub(crate) done: watch::Receiver<Option<Outcome>>,
    pub(crate) timeout: Option<Duration>,
}

impl RequestHandle {
    /// Runs `ops` on `peer`'s channel as a task of the current tokio runtime (the caller checked
    /// there is one), recording the outcome in the route's counters.
    pub(crate) fn start(peer: &PeerInner, ops: Vec<Op>, timeout: Option<Duration>) -> Self {
        let ops: Arc<[Op]> = ops.into();
        let control = Arc::new(RequestControl::new(&ops));
        let fut = peer.channel.execute(ops, control.clone());
        Self::start_with(peer, control, fut, timeout)
    }

    /// Runs `fut`, the request `control` keeps the ledger of, as a task of the current tokio
    /// runtime, recording its outcome in the route's counters.
    pub(crate) fn start_with(
        peer: &PeerInner,
        control: Arc<RequestControl>,
        fut: ferry_core::BoxFuture<'static, Outcome>,
        timeout: Option<Duration>,
    ) -> Self {
        let span = tracing::info_span!("request", peer = %peer.addr);
        let (tx, rx) = watch::channel(None);
        let counters = peer.counters.clone();
        tokio::spawn(
            async move {
                let outcome = fut.await;
                counters.record(&outcome);
                if let Some(f) = outcome.failure {
                    tracing::debug!(op = f.op_index, kind = %f.kind, effect = ?outcome.remote_effect,
                        "request failed");
                }
                let _ = tx.send(Some(outcome));
            }
            .instrument(span),
        );
        Self {
            control,
            wake: Arc::new(Notify::new()),
            done: rx,
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
        let mut rx = self.done.clone();
        let control = self.control.clone();
        async move {
            loop {
                if let Some(o) = *rx.borrow_and_update() {
                    return o;
                }
                if rx.changed().await.is_err() {
                    // The request's task ended without a word: nothing holds the buffers now.
                    return control.outcome(true);
                }
            }
        }
    }

    /// Waits for the logical outcome: completion, or the timeout, or a cancel.
    pub async fn outcome(self) -> Outcome {
        let drained = self.drained();
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
