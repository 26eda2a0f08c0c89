//! The engine's GPU state and its staging pool: pinned host buffers, each with a copy stream of
//! its device and the thread that runs that stream's copies.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError};

use ferry_core::{Access, Error, MemoryRegion, SegmentToken};
use ferry_cuda::{Cuda, CudaError, DeviceMemory};
use tokio::sync::Semaphore;

use super::config::{GpuConfig, Staging};
use crate::describe::{GpuRegistrationDescription, StagingDescription};

/// The engine's GPU state: the driver (loaded on first use), the staging pool and counters.
pub(crate) struct GpuState {
    pub(crate) config: GpuConfig,
    cuda: OnceLock<Result<Cuda, String>>,
    /// One staging pool per device, made when a staged request on that device first needs it:
    /// pinned memory is pinned for the context that allocated it, and a lane's stream copies
    /// only its own device's memory asynchronously.
    pools: Mutex<Vec<(u32, Arc<StagingPool>)>>,
    pub(crate) counters: StagingCounters,
    pub(crate) registrations: Mutex<Vec<(SegmentToken, GpuRegistrationDescription)>>,
    pub(crate) last_file_path: Mutex<Option<String>>,
}

impl fmt::Debug for GpuState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GpuState")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

/// Counters of the staging path.
#[derive(Debug, Default)]
pub(crate) struct StagingCounters {
    pub(super) staged_bytes: AtomicU64,
    pub(super) copies: AtomicU64,
    pub(super) copy_wait_ns: AtomicU64,
    pub(super) copy_failures: AtomicU64,
}

impl GpuState {
    pub(crate) fn new(config: GpuConfig) -> Self {
        let cuda = OnceLock::new();
        if let Some(c) = &config.cuda {
            let _ = cuda.set(Ok(c.clone()));
        }
        Self {
            config,
            cuda,
            pools: Mutex::new(Vec::new()),
            counters: StagingCounters::default(),
            registrations: Mutex::new(Vec::new()),
            last_file_path: Mutex::new(None),
        }
    }

    /// The driver, if the builder gave one or it was loaded already (loads nothing).
    pub(crate) fn loaded(&self) -> Option<Cuda> {
        self.cuda.get().and_then(|c| c.as_ref().ok().cloned())
    }

    /// The driver: the one the builder was given, or the system's, loaded once.
    pub(crate) fn cuda(&self) -> Result<Cuda, Error> {
        self.cuda
            .get_or_init(|| Cuda::load().map_err(|e| e.to_string()))
            .clone()
            .map_err(|reason| Error::Unavailable {
                library: ferry_cuda::LIBCUDA.into(),
                reason: reason
                    .strip_prefix(&format!("{}: ", ferry_cuda::LIBCUDA))
                    .unwrap_or(&reason)
                    .to_owned(),
            })
    }

    pub(super) fn pool(
        &self,
        device: &ferry_cuda::Device,
        rdma: Option<&ferry_registry::Registry>,
    ) -> Result<Arc<StagingPool>, Error> {
        let ordinal = device.location().ordinal;
        let mut pools = self.pools.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some((_, p)) = pools.iter().find(|(o, _)| *o == ordinal) {
            return Ok(p.clone());
        }
        // Made under the lock: two first requests on one device make one pool.
        let pool = Arc::new(StagingPool::new(
            device,
            self.config.buffers.max(1),
            self.config.buffer_size.max(4096),
            rdma,
        )?);
        pools.push((ordinal, pool.clone()));
        Ok(pool)
    }

    pub(crate) fn describe(&self) -> StagingDescription {
        let pools = self.pools.lock().unwrap_or_else(PoisonError::into_inner);
        StagingDescription {
            policy: match self.config.staging {
                Staging::Auto => "auto",
                Staging::Never => "never",
            }
            .into(),
            gpu_direct_registration: self.config.gpu_direct.name().into(),
            buffers: pools.iter().map(|(_, p)| p.buffers).sum(),
            buffer_size: self.config.buffer_size as u64,
            buffers_in_use: pools.iter().map(|(_, p)| p.in_use()).sum(),
            staged_bytes: self.counters.staged_bytes.load(Ordering::Relaxed),
            copies: self.counters.copies.load(Ordering::Relaxed),
            copy_wait_us: self.counters.copy_wait_ns.load(Ordering::Relaxed) / 1000,
            copy_failures: self.counters.copy_failures.load(Ordering::Relaxed),
            last_file_path: self
                .last_file_path
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .clone(),
        }
    }
}

/// A bounded pool of staging lanes: each a pinned host buffer (a host `MemoryRegion` transports
/// may use), a copy stream of the pool's device, and the thread that runs that stream's copies.
/// Made once, when the first staged request needs it; a chunk only borrows a lane.
pub(crate) struct StagingPool {
    free: Mutex<Vec<Lane>>,
    permits: Arc<Semaphore>,
    pub(super) buffers: usize,
    pub(super) buffer_size: usize,
    /// The buffers' local RDMA registrations (engines with RDMA: staging with
    /// `gpu_direct_registration = off` sends from them); dropped after the buffers' last use.
    _rdma: Vec<ferry_registry::Registration>,
}

impl StagingPool {
    fn new(
        device: &ferry_cuda::Device,
        buffers: usize,
        buffer_size: usize,
        rdma: Option<&ferry_registry::Registry>,
    ) -> Result<Self, Error> {
        let mut free = Vec::with_capacity(buffers);
        let mut registered = Vec::new();
        for i in 0..buffers {
            let b = Arc::new(
                device
                    .alloc_pinned(buffer_size)
                    .map_err(Error::from)?
                    .into_region(),
            );
            if let Some(r) = rdma {
                registered.push(
                    r.register(format!("staging buffer {i}"), b.clone(), Access::LOCAL)
                        .map_err(Error::from)?,
                );
            }
            let stream = device.copy_stream().map_err(Error::from)?;
            free.push(Lane::start(i, b, stream)?);
        }
        tracing::info!(
            buffers,
            buffer_size,
            device = device.location().ordinal,
            "staging pool allocated: pinned host buffers, each with a copy stream and its thread"
        );
        Ok(Self {
            free: Mutex::new(free),
            permits: Arc::new(Semaphore::new(buffers)),
            buffers,
            buffer_size,
            _rdma: registered,
        })
    }

    fn in_use(&self) -> usize {
        self.buffers - self.permits.available_permits()
    }

    /// Borrows an idle lane (waits while all are borrowed). No allocation.
    pub(super) async fn take(self: &Arc<Self>) -> Option<LaneGuard> {
        let permit = self.permits.clone().acquire_owned().await.ok()?;
        let lane = self
            .free
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .pop()?;
        // A lane goes back only after its copy finished; this guards the buffer anyway, should a
        // borrower have been dropped while its copy ran.
        lane.idle().await;
        Some(LaneGuard {
            pool: self.clone(),
            lane: Some(lane),
            _permit: permit,
        })
    }
}

/// A copy for a lane's thread: `n` bytes between `mem` at `at` and the start of the lane's buffer.
pub(super) struct CopyJob {
    seq: u64,
    mem: Arc<DeviceMemory>,
    at: u64,
    n: usize,
    to_host: bool,
}

/// The last copy a lane's thread finished: its sequence number and result.
#[derive(Default)]
pub(super) struct CopyDone {
    state: Mutex<(u64, Option<Result<(), CudaError>>)>,
    notify: tokio::sync::Notify,
}

/// One pinned buffer with its copy stream and thread. The thread blocks in the driver (a copy
/// is enqueued on the lane's stream and synchronized), so no runtime thread does, and copies of
/// different lanes run at once: chunk k+1's device-to-host copy overlaps chunk k's send.
pub(super) struct Lane {
    pub(super) buf: Arc<MemoryRegion>,
    jobs: Option<std::sync::mpsc::SyncSender<CopyJob>>,
    done: Arc<CopyDone>,
    /// Sequence number of the last job sent (only the borrower sends).
    sent: u64,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Lane {
    fn start(
        i: usize,
        buf: Arc<MemoryRegion>,
        stream: ferry_cuda::CopyStream,
    ) -> Result<Self, Error> {
        // One job at a time per lane (the borrower waits for each), so a channel of one never
        // blocks the sender, and holds its slot without allocating per job.
        let (tx, rx) = std::sync::mpsc::sync_channel::<CopyJob>(1);
        let done = Arc::new(CopyDone::default());
        let (thread_buf, thread_done) = (buf.clone(), done.clone());
        let thread = std::thread::Builder::new()
            .name(format!("ferry-stage-{i}"))
            .spawn(move || {
                while let Ok(job) = rx.recv() {
                    let r = if job.to_host {
                        stream.copy_to_region(&job.mem, job.at, &thread_buf, 0, job.n)
                    } else {
                        stream.copy_from_region(&job.mem, job.at, &thread_buf, 0, job.n)
                    };
                    drop(job.mem);
                    *thread_done
                        .state
                        .lock()
                        .unwrap_or_else(PoisonError::into_inner) = (job.seq, Some(r));
                    thread_done.notify.notify_one();
                }
            })
            .map_err(|source| Error::Io {
                op: "spawn",
                target: "a staging lane's copy thread".into(),
                source,
            })?;
        Ok(Self {
            buf,
            jobs: Some(tx),
            done,
            sent: 0,
            thread: Some(thread),
        })
    }

    /// Waits until the thread finished job `seq`, and takes its result (`None`: the thread is
    /// gone, or the result was taken).
    async fn finished(&self, seq: u64) -> Option<Result<(), CudaError>> {
        loop {
            let notified = self.done.notify.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            {
                let mut st = self
                    .done
                    .state
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner);
                if st.0 >= seq {
                    return st.1.take();
                }
            }
            if self.thread.as_ref().is_none_or(|t| t.is_finished()) {
                return None;
            }
            notified.await;
        }
    }

    /// Waits until no copy of this lane is running.
    async fn idle(&self) {
        if self.sent > 0 {
            let _ = self.finished(self.sent).await;
        }
    }

    /// Runs one copy between `mem` at `at` and the first `n` bytes of the buffer on the lane's
    /// thread, and waits for it without blocking the runtime.
    pub(super) async fn copy(
        &mut self,
        mem: &Arc<DeviceMemory>,
        at: u64,
        n: usize,
        to_host: bool,
    ) -> Result<(), Option<CudaError>> {
        self.sent += 1;
        let job = CopyJob {
            seq: self.sent,
            mem: mem.clone(),
            at,
            n,
            to_host,
        };
        let sent = self.jobs.as_ref().is_some_and(|j| j.try_send(job).is_ok());
        if !sent {
            tracing::warn!("a staging lane's copy thread is gone");
            return Err(None);
        }
        match self.finished(self.sent).await {
            Some(r) => r.map_err(Some),
            None => Err(None),
        }
    }
}

impl Drop for Lane {
    fn drop(&mut self) {
        // Closing the channel ends the thread after its copy (if one runs); joined so that the
        // buffer and the stream are gone when the pool is.
        self.jobs = None;
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// A lane borrowed from the pool; it goes back on drop (after the sub-request that used its
/// buffer drained, so no transport still holds it).
pub(super) struct LaneGuard {
    pool: Arc<StagingPool>,
    lane: Option<Lane>,
    _permit: tokio::sync::OwnedSemaphorePermit,
}

impl LaneGuard {
    pub(super) fn lane(&mut self) -> &mut Lane {
        // Set from construction until drop.
        self.lane.as_mut().unwrap_or_else(|| unreachable!())
    }
}

impl Drop for LaneGuard {
    fn drop(&mut self) {
        if let Some(l) = self.lane.take() {
            self.pool
                .free
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .push(l);
        }
    }
}
