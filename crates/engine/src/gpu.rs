//! GPU memory in the engine: registering device memory, publishing it to peers, and staging it
//! through pinned host buffers over the TCP and io_uring data planes.
//!
//! Device memory is never a `MemoryRegion`, so it never reaches a transport: an op on a
//! [`GpuRegistration`] becomes host ops on buffers of the staging pool plus driver copies
//! (client side), and a published device segment is a `FileSource` whose positioned reads and
//! writes are device copies through the servers' bounded staging path (serving side).
//!
//! The client pipeline: a request's device ops are cut into chunks of one pool buffer; at most
//! as many chunks as there are buffers are in flight, so chunk k+1's device-to-host copy runs
//! while chunk k is on the wire (WRITE), and chunk k's host-to-device copy runs while chunk k+1
//! is received (READ). Buffers are allocated once, when the first staged request needs them;
//! no chunk allocates a buffer.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use std::time::Instant;

use cuda::{Cuda, CudaError, DeviceMemory, DeviceSegment, GpuDirectSetting, RouteChoice};
use ferry_core::{
    Access, Error, FailureKind, MemoryRegion, Op, OpKind, Outcome, RemoteEffect, RequestControl,
    SegmentDesc, SegmentToken,
};
use tokio::sync::Semaphore;

use crate::handles::PeerInner;
use crate::serve::RegistryTable;

/// Whether device memory may move through host memory when no direct route serves it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Staging {
    /// Stage through pinned host buffers where no direct route serves the op (TCP, io_uring,
    /// RDMA with `gpu_direct_registration = off`).
    #[default]
    Auto,
    /// Never stage: an op on device memory without a direct route is refused before anything
    /// moves.
    Never,
}

impl std::str::FromStr for Staging {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(Staging::Auto),
            "never" => Ok(Staging::Never),
            _ => Err(format!("staging is auto or never, not {s:?}")),
        }
    }
}

/// The builder's GPU settings.
#[derive(Clone, Debug)]
pub(crate) struct GpuConfig {
    pub(crate) cuda: Option<Cuda>,
    pub(crate) staging: Staging,
    pub(crate) gpu_direct: GpuDirectSetting,
    pub(crate) buffers: usize,
    pub(crate) buffer_size: usize,
    pub(crate) gds: bool,
    /// Where the peermem version files and the PCI topology are read (`/sys`).
    pub(crate) sysfs_root: std::path::PathBuf,
}

/// Staging buffers by default: 4 of 4 MiB per GPU that stages (16 MiB pinned each, allocated on
/// first use).
pub const STAGING_BUFFERS: usize = 4;
/// The default staging buffer (and chunk) size.
pub const STAGING_BUFFER_SIZE: usize = 4 << 20;

impl Default for GpuConfig {
    fn default() -> Self {
        Self {
            cuda: None,
            staging: Staging::Auto,
            gpu_direct: GpuDirectSetting::Auto,
            buffers: STAGING_BUFFERS,
            buffer_size: STAGING_BUFFER_SIZE,
            gds: true,
            sysfs_root: "/sys".into(),
        }
    }
}

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
    staged_bytes: AtomicU64,
    copies: AtomicU64,
    copy_wait_ns: AtomicU64,
    copy_failures: AtomicU64,
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

    /// The driver: the one the builder was given, or the system's, loaded once.
    pub(crate) fn cuda(&self) -> Result<Cuda, Error> {
        self.cuda
            .get_or_init(|| Cuda::load().map_err(|e| e.to_string()))
            .clone()
            .map_err(|reason| Error::Unavailable {
                library: cuda::LIBCUDA.into(),
                reason: reason
                    .strip_prefix(&format!("{}: ", cuda::LIBCUDA))
                    .unwrap_or(&reason)
                    .to_owned(),
            })
    }

    fn pool(
        &self,
        device: &cuda::Device,
        rdma: Option<&registry::Registry>,
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
    buffers: usize,
    buffer_size: usize,
    /// The buffers' local RDMA registrations (engines with RDMA: staging with
    /// `gpu_direct_registration = off` sends from them); dropped after the buffers' last use.
    _rdma: Vec<registry::Registration>,
}

impl StagingPool {
    fn new(
        device: &cuda::Device,
        buffers: usize,
        buffer_size: usize,
        rdma: Option<&registry::Registry>,
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
    async fn take(self: &Arc<Self>) -> Option<LaneGuard> {
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
struct CopyJob {
    seq: u64,
    mem: Arc<DeviceMemory>,
    at: u64,
    n: usize,
    to_host: bool,
}

/// The last copy a lane's thread finished: its sequence number and result.
#[derive(Default)]
struct CopyDone {
    state: Mutex<(u64, Option<Result<(), CudaError>>)>,
    notify: tokio::sync::Notify,
}

/// One pinned buffer with its copy stream and thread. The thread blocks in the driver (a copy
/// is enqueued on the lane's stream and synchronized), so no runtime thread does, and copies of
/// different lanes run at once: chunk k+1's device-to-host copy overlaps chunk k's send.
struct Lane {
    buf: Arc<MemoryRegion>,
    jobs: Option<std::sync::mpsc::SyncSender<CopyJob>>,
    done: Arc<CopyDone>,
    /// Sequence number of the last job sent (only the borrower sends).
    sent: u64,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Lane {
    fn start(i: usize, buf: Arc<MemoryRegion>, stream: cuda::CopyStream) -> Result<Self, Error> {
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
    async fn copy(
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
struct LaneGuard {
    pool: Arc<StagingPool>,
    lane: Option<Lane>,
    _permit: tokio::sync::OwnedSemaphorePermit,
}

impl LaneGuard {
    fn lane(&mut self) -> &mut Lane {
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

/// The staging path's counters, as `describe()` reports them.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
#[non_exhaustive]
pub struct StagingDescription {
    /// `auto` or `never`.
    pub policy: String,
    /// The `gpu_direct_registration` setting.
    pub gpu_direct_registration: String,
    /// Pinned buffers allocated, over every device's pool (0 until the first staged request;
    /// each device's pool is made by the first staged request on that device).
    pub buffers: usize,
    /// Their size (the staging chunk).
    pub buffer_size: u64,
    /// Buffers held by requests now (0 when idle: nothing stays pinned to a request).
    pub buffers_in_use: usize,
    /// Bytes of device memory moved through the buffers (acknowledged chunks).
    pub staged_bytes: u64,
    /// Device copies done.
    pub copies: u64,
    /// Time spent waiting on device copies, in microseconds.
    pub copy_wait_us: u64,
    /// Device copies that failed.
    pub copy_failures: u64,
    /// Which path the last `read_file_into_gpu` took (`gds` or `compat (why)`).
    pub last_file_path: Option<String>,
}

/// A GPU registration as `describe()` reports it.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
#[non_exhaustive]
pub struct GpuRegistrationDescription {
    /// Its name.
    pub name: String,
    /// Its length.
    pub len: u64,
    /// The device ordinal.
    pub device: u32,
    /// The device's PCI bus id.
    pub pci_bus_id: String,
    /// The GPUDirect route and why.
    pub route: RouteChoice,
    /// The RDMA rails (`device:port`) it is registered on (empty unless the route is direct).
    pub nics: Vec<String>,
    /// Why those rails (the NICs nearest its GPU, or why locality is unknown); empty unless the
    /// route is direct.
    pub nic_choice: String,
    /// How peers' ops on it move (e.g. `staged through host memory by the server`).
    pub served: String,
}

/// Device memory registered with the engine (and published to peers when `access` grants them
/// anything). Ops on it are staged through pinned host memory; dropping it unpublishes it.
pub struct GpuRegistration {
    pub(crate) memory: Arc<DeviceMemory>,
    pub(crate) token: SegmentToken,
    pub(crate) name: String,
    pub(crate) access: Access,
    pub(crate) route: RouteChoice,
    /// The GPUDirect RDMA registration (route `dmabuf` or `peermem`): the device region and its
    /// registry entry (the MRs on the NICs nearest the GPU, published with their remote keys).
    pub(crate) direct: Option<Direct>,
    pub(crate) table: Arc<RegistryTable>,
    pub(crate) state: Arc<crate::engine::Inner>,
}

/// A GPU registration made with the RDMA NICs.
pub(crate) struct Direct {
    /// The device memory as a region placed on its device (only RDMA ops get it).
    pub(crate) region: Arc<MemoryRegion>,
    /// Dropping it retires the MRs (after the last lease).
    pub(crate) registration: registry::Registration,
}

impl Direct {
    /// The rails (`device:port`) its MRs are on.
    fn rails(&self) -> Vec<String> {
        self.registration
            .lease()
            .contexts()
            .iter()
            .map(|c| c.name.clone())
            .collect()
    }
}

impl fmt::Debug for GpuRegistration {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GpuRegistration")
            .field("name", &self.name)
            .field("token", &self.token)
            .field("memory", &self.memory)
            .field("route", &self.route)
            .finish()
    }
}

impl GpuRegistration {
    /// The token peers address it by.
    pub fn token(&self) -> SegmentToken {
        self.token
    }

    /// The device memory.
    pub fn memory(&self) -> &Arc<DeviceMemory> {
        &self.memory
    }

    /// Its length.
    pub fn len(&self) -> u64 {
        self.memory.len() as u64
    }

    /// Whether it is empty.
    pub fn is_empty(&self) -> bool {
        self.memory.is_empty()
    }

    /// The GPUDirect route chosen for it (before registering) and why.
    pub fn route(&self) -> &RouteChoice {
        &self.route
    }

    /// The RDMA rails (`device:port`) it is registered on: empty unless the route is `dmabuf`
    /// or `peermem`.
    pub fn nics(&self) -> Vec<String> {
        self.direct.as_ref().map_or_else(Vec::new, Direct::rails)
    }

    /// The descriptor peers see (with the remote keys of its MRs when it is registered with
    /// RDMA NICs).
    pub fn desc(&self) -> SegmentDesc {
        match &self.direct {
            Some(d) => crate::serve::describe_lease(&d.registration.lease()),
            None => SegmentDesc {
                name: self.name.clone(),
                token: self.token,
                len: self.len(),
                access: self.access,
                remote_keys: Vec::new(),
            },
        }
    }
}

impl Drop for GpuRegistration {
    fn drop(&mut self) {
        // The registry entry (GPUDirect: listed with its remote keys) goes first, then the
        // device-copy source and any restriction (`RegistryTable::retire`).
        let direct = self.direct.take();
        self.table.retire(self.token, || drop(direct));
        if let Some(g) = &self.state.gpu {
            g.registrations
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .retain(|(t, _)| *t != self.token);
        }
    }
}

impl crate::TransferEngine {
    fn gpu_state(&self) -> Result<&GpuState, Error> {
        self.inner.gpu.as_ref().ok_or_else(|| Error::Unavailable {
            library: "ferry cuda".into(),
            reason: "GPU support is off in this engine".into(),
        })
    }

    /// The CUDA driver this engine uses (the builder's, or the system's `libcuda.so.1` loaded
    /// on first use; `Unavailable("libcuda.so.1: <loader's reason>")` without one).
    pub fn cuda(&self) -> Result<Cuda, Error> {
        self.gpu_state()?.cuda()
    }

    /// Allocates `len` bytes on GPU `ordinal` (freed when the registration and every request
    /// using it are gone) and registers them (see [`register_gpu`](Self::register_gpu)).
    pub fn alloc_gpu(
        &self,
        ordinal: u32,
        len: usize,
        access: Access,
        name: &str,
    ) -> Result<GpuRegistration, Error> {
        let mem = self
            .cuda()?
            .device(ordinal)
            .and_then(|d| d.alloc(len))
            .map_err(Error::from)?;
        self.register_gpu(mem, access, name)
    }

    /// Registers device memory (allocated by [`cuda::Device::alloc`] or wrapped with
    /// [`cuda::Device::wrap`]) under `name`. The GPUDirect route is decided first, from the
    /// `gpu_direct_registration` setting and what the machine offers; an explicit route that
    /// cannot work is an error naming what is missing, and nothing falls back silently.
    ///
    /// With route `dmabuf` or `peermem` (an engine with the RDMA transport) the memory is
    /// registered with the NICs nearest its GPU (the topology's assignment by PCI distance):
    /// through the registry like host memory, so budgets, fan-out and retirement are the same,
    /// and with remote access it is published with its remote keys, so RDMA peers READ and
    /// WRITE it one-sided. A registration that fails there (a NIC that refuses dma-buf MRs, a
    /// peer-memory client that cannot resolve the address) is an error naming the device and
    /// the native errno. Peers on the TCP or io_uring data plane are served by device copies
    /// through the server's staging buffer, whatever the route.
    pub fn register_gpu(
        &self,
        memory: impl Into<Arc<DeviceMemory>>,
        access: Access,
        name: &str,
    ) -> Result<GpuRegistration, Error> {
        let memory = memory.into();
        self.inner
            .table
            .publish_named(name, access.is_remote(), || {
                self.register_gpu_unchecked(memory, access, name)
            })
    }

    fn register_gpu_unchecked(
        &self,
        memory: Arc<DeviceMemory>,
        access: Access,
        name: &str,
    ) -> Result<GpuRegistration, Error> {
        let state = self.gpu_state()?;
        let _span = tracing::info_span!(
            "register_gpu",
            name,
            len = memory.len(),
            device = memory.location().ordinal
        )
        .entered();
        let route = self.choose_route(state, &memory)?;
        let (direct, nic_choice) = if route.route == cuda::GpuRoute::Off {
            (None, String::new())
        } else {
            let (d, why) = self.register_direct(state, &memory, &route, access, name)?;
            (Some(d), why)
        };
        let token = direct
            .as_ref()
            .map_or_else(SegmentToken::random, |d| d.registration.token());
        let served_by_staging = access.is_remote() && self.inner.data_plane.is_some();
        if access.is_remote() && direct.is_none() && !served_by_staging {
            return Err(Error::Unavailable {
                library: "GPU segments".into(),
                reason: "publishing GPU memory needs a portable data plane (io_uring or \
                         TCP) to serve it by staging, or a GPUDirect RDMA route, and this \
                         engine has neither"
                    .into(),
            });
        }
        if served_by_staging {
            self.inner.table.add_file(
                token,
                name.to_owned(),
                memory.len() as u64,
                access,
                Arc::new(DeviceSegment::new(memory.clone(), access)),
            );
        }
        let nics: Vec<String> = direct.as_ref().map_or_else(Vec::new, Direct::rails);
        let served = match (access.is_remote(), &direct, served_by_staging) {
            (false, _, _) => "local only".to_owned(),
            (true, Some(_), true) => format!(
                "published; RDMA peers reach it one-sided through {} ({}); TCP and io_uring \
                 peers' ops staged through the server's host buffer",
                nics.join(", "),
                route.route
            ),
            (true, Some(_), false) => format!(
                "published; RDMA peers reach it one-sided through {} ({})",
                nics.join(", "),
                route.route
            ),
            (true, None, _) => {
                "published; peers' ops staged through the server's host buffer".to_owned()
            }
        };
        let desc = GpuRegistrationDescription {
            name: name.to_owned(),
            len: memory.len() as u64,
            device: memory.location().ordinal,
            pci_bus_id: memory.location().pci_bus_id.clone(),
            route: route.clone(),
            nics,
            nic_choice,
            served,
        };
        state
            .registrations
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push((token, desc));
        tracing::info!(%token, route = %route.route, why = %route.why, "GPU memory registered");
        Ok(GpuRegistration {
            memory,
            token,
            name: name.to_owned(),
            access,
            route,
            direct,
            table: self.inner.table.clone(),
            state: self.inner.clone(),
        })
    }

    /// Registers `memory` with the RDMA NICs nearest its GPU by `route` (dma-buf or peermem),
    /// through the registry. Returns the registration and why those NICs.
    #[cfg(feature = "rdma")]
    fn register_direct(
        &self,
        state: &GpuState,
        memory: &Arc<DeviceMemory>,
        route: &RouteChoice,
        access: Access,
        name: &str,
    ) -> Result<(Direct, String), Error> {
        let Some(rdma) = &self.inner.rdma else {
            return Err(Error::InvalidRequest {
                reason: format!(
                    "gpu_direct_registration chose {} but this engine has no RDMA transport",
                    route.route
                ),
            });
        };
        let rails = rdma.rail_names();
        let devices: Vec<String> = rails.iter().map(|r| rail_device(r).to_owned()).collect();
        let topo = topology::Topology::discover(
            &state.config.sysfs_root,
            &topology::VerbsDevices::from_names(devices),
            &topology::Selector::default(),
        );
        let choice = choose_nics(&rails, topo.as_ref().ok(), &memory.location().pci_bus_id);
        let region = Arc::new(memory.nic_region(route.route).map_err(Error::from)?);
        let contexts: Vec<registry::ContextId> = choice
            .rails
            .iter()
            .map(|&i| registry::ContextId(i as u32))
            .collect();
        let registration = self
            .inner
            .registry
            .register_on(name, region.clone(), access, &contexts)
            .map_err(Error::from)?;
        tracing::info!(route = %route.route, nics = ?choice.names(&rails), why = %choice.why,
            "GPU memory registered with RDMA NICs");
        Ok((
            Direct {
                region,
                registration,
            },
            choice.why,
        ))
    }

    /// Without the `rdma` feature no route but `off` is ever chosen.
    #[cfg(not(feature = "rdma"))]
    fn register_direct(
        &self,
        _state: &GpuState,
        _memory: &Arc<DeviceMemory>,
        route: &RouteChoice,
        _access: Access,
        _name: &str,
    ) -> Result<(Direct, String), Error> {
        Err(Error::InvalidRequest {
            reason: format!(
                "gpu_direct_registration chose {} but this build has no RDMA transport",
                route.route
            ),
        })
    }

    /// Decides the GPUDirect route before anything is registered.
    fn choose_route(&self, state: &GpuState, memory: &DeviceMemory) -> Result<RouteChoice, Error> {
        let setting = state.config.gpu_direct;
        let rdma = self
            .inner
            .transports
            .iter()
            .any(|t| t.kind() == ferry_core::TransportKind::Rdma);
        if setting == GpuDirectSetting::Off {
            return cuda::route::choose(setting, &Default::default())
                .map_err(|e| Error::from(CudaError::from(e)));
        }
        if !rdma {
            // No NIC would see the memory: only staging can move it.
            return match setting {
                GpuDirectSetting::Auto => Ok(RouteChoice {
                    route: cuda::GpuRoute::Off,
                    why: "auto: no RDMA transport in this engine; GPU memory is staged over the \
                          portable data plane"
                        .into(),
                }),
                explicit => Err(Error::InvalidRequest {
                    reason: format!(
                        "gpu_direct_registration = {explicit} cannot work here: missing an RDMA \
                         transport in this engine (enable RDMA, or use auto/off to stage)"
                    ),
                }),
            };
        }
        let facts = cuda::RouteFacts {
            cuda_dmabuf_export: memory.device().cuda().has_dmabuf_export(),
            device_dmabuf: memory.device().info().dmabuf_supported,
            ibv_reg_dmabuf_mr: verbs_sys::Verbs::load()
                .map(|v| v.capabilities().reg_dmabuf_mr)
                .unwrap_or(false),
            peermem_version_file: cuda::peermem_version(&state.config.sysfs_root)
                .map(|(p, _)| p.display().to_string()),
        };
        cuda::route::choose(setting, &facts).map_err(|e| Error::from(CudaError::from(e)))
    }

    /// Loads `len` bytes of the file at `path` from `file_offset` into `dst` at `offset`: by
    /// cuFile (GPUDirect Storage) when `libcufile.so.0` loads and the file system supports it,
    /// else by the compatibility path (positioned reads into pinned buffers, then host-to-device
    /// copies, pipelined). Which path ran is returned and shown by `describe()`. Blocking.
    pub fn read_file_into_gpu(
        &self,
        dst: &GpuRegistration,
        offset: u64,
        path: impl AsRef<std::path::Path>,
        file_offset: u64,
        len: u64,
    ) -> Result<cuda::FileLoad, Error> {
        let state = self.gpu_state()?;
        let path = path.as_ref();
        let _span =
            tracing::info_span!("read_file_into_gpu", path = %path.display(), len).entered();
        let load = cuda::cufile::read_file_into(
            &dst.memory,
            offset,
            path,
            file_offset,
            len,
            state.config.gds,
        )
        .map_err(|e| match e {
            CudaError::Io { what, source } => Error::Io {
                op: "read_file_into_gpu",
                target: what,
                source,
            },
            e => Error::from(e),
        })?;
        tracing::info!(path = %load.path, bytes = load.bytes, "file loaded into GPU memory");
        *state
            .last_file_path
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = Some(load.path.to_string());
        Ok(load)
    }
}

use crate::request::Local as StagedLocal;

/// An op of a staged request.
#[derive(Clone, Debug)]
pub(crate) struct StagedOp {
    pub(crate) kind: OpKind,
    pub(crate) local: StagedLocal,
    pub(crate) local_offset: u64,
    pub(crate) token: SegmentToken,
    pub(crate) remote_offset: u64,
    pub(crate) len: u64,
}

/// Checks the staging policy and returns the pool for `ops` (the caller saw a device op): the
/// pool of the first device op's GPU. Device ops of a batch on another GPU are staged through
/// it too, by that GPU's own blocking copies (correct, not overlapped on streams): a batch per
/// GPU moves fastest.
pub(crate) fn prepare(
    inner: &crate::engine::Inner,
    ops: &[StagedOp],
) -> Result<Arc<StagingPool>, Error> {
    let Some(state) = &inner.gpu else {
        return Err(Error::Unavailable {
            library: "ferry cuda".into(),
            reason: "GPU support is off in this engine".into(),
        });
    };
    if state.config.staging == Staging::Never {
        return Err(Error::InvalidRequest {
            reason: "staging: never, and no direct route serves GPU memory on this peer's \
                     transport (TCP and io_uring move host memory only; over RDMA every GPU \
                     op of the batch needs a registration whose GPUDirect route is dmabuf or \
                     peermem): allow staging (auto), register with a GPUDirect route, or use \
                     host memory"
                .into(),
        });
    }
    let device = ops
        .iter()
        .find_map(|o| match &o.local {
            StagedLocal::Device(m, _) => Some(m.device().clone()),
            StagedLocal::Host(_) => None,
        })
        .ok_or_else(|| Error::InvalidRequest {
            reason: "no GPU op to stage".into(),
        })?;
    #[cfg(feature = "rdma")]
    let rdma = inner.rdma.is_some().then_some(&inner.registry);
    #[cfg(not(feature = "rdma"))]
    let rdma = None;
    state.pool(&device, rdma)
}

/// One piece of the pipeline: a host op whole, or one buffer's worth of a device op.
#[derive(Clone, Copy)]
struct Piece {
    op: usize,
    offset: u64,
    len: u64,
}

/// The pieces of a staged request, in order, handed out to its workers one at a time.
struct Cursor {
    op: usize,
    offset: u64,
}

/// What the workers of one staged request share.
struct Pipeline {
    peer: Arc<PeerInner>,
    ops: Arc<[StagedOp]>,
    control: Arc<RequestControl>,
    pool: Arc<StagingPool>,
    inner: Arc<crate::engine::Inner>,
    deadline: Option<tokio::time::Instant>,
    cursor: Mutex<Cursor>,
}

impl Pipeline {
    /// The next piece to post, unless the request stopped or every piece was handed out.
    fn next(&self) -> Option<Piece> {
        if self.control.should_stop_posting() {
            return None;
        }
        let chunk = self.pool.buffer_size as u64;
        let mut c = self.cursor.lock().unwrap_or_else(PoisonError::into_inner);
        let op = self.ops.get(c.op)?;
        let piece = match op.local {
            StagedLocal::Host(_) => Piece {
                op: c.op,
                offset: 0,
                len: op.len,
            },
            StagedLocal::Device(..) => Piece {
                op: c.op,
                offset: c.offset,
                len: chunk.min(op.len - c.offset),
            },
        };
        c.offset += piece.len;
        if matches!(op.local, StagedLocal::Host(_)) || c.offset >= op.len {
            c.op += 1;
            c.offset = 0;
        }
        Some(piece)
    }
}

/// Runs a request whose ops include device memory: host ops go through the channel as they are,
/// device ops through the pool's lanes (a pinned buffer and a copy stream each), at most one
/// piece per lane in flight. Each piece is a sub-request on the peer's channel that reconnects and
/// replays after a lost connection as any request does (a READ piece always; a WRITE piece under
/// `replay_writes`), bounded by the request's `timeout`. Every piece is recorded in `control`'s
/// ledger, so the outcome's prefix, failure and remote effect follow the same rules as any
/// request's.
///
/// Allocations are per request (its workers), not per chunk: a chunk borrows a lane, and its
/// sub-request costs what any one-op request costs (its op, its ledger, the channel's future).
pub(crate) async fn run(
    peer: Arc<PeerInner>,
    ops: Arc<[StagedOp]>,
    control: Arc<RequestControl>,
    pool: Arc<StagingPool>,
    inner: Arc<crate::engine::Inner>,
    timeout: Option<std::time::Duration>,
) -> Outcome {
    let chunk = pool.buffer_size as u64;
    control.with_ledger(|l| {
        for (i, op) in ops.iter().enumerate() {
            let n = match op.local {
                StagedLocal::Host(_) => 1,
                StagedLocal::Device(..) => op.len.div_ceil(chunk).max(1),
            };
            l.plan(i, n as u32);
        }
    });
    let pipeline = Arc::new(Pipeline {
        deadline: timeout.map(|t| tokio::time::Instant::now() + t),
        peer,
        ops,
        control,
        pool,
        inner,
        cursor: Mutex::new(Cursor { op: 0, offset: 0 }),
    });
    // As many workers as lanes, each a task of its own (so that one's completion is handled
    // while another's is polled, on another runtime thread); each takes the next piece when its
    // last one drained.
    let mut workers = tokio::task::JoinSet::new();
    for _ in 0..pipeline.pool.buffers {
        let p = pipeline.clone();
        workers.spawn(async move { worker(&p).await });
    }
    while workers.join_next().await.is_some() {}
    pipeline.control.outcome(true)
}

async fn worker(p: &Pipeline) {
    while let Some(piece) = p.next() {
        run_piece(p, piece).await;
    }
}

async fn run_piece(p: &Pipeline, piece: Piece) {
    let op = &p.ops[piece.op];
    let Some(state) = &p.inner.gpu else { return };
    let counters = &state.counters;
    let control = &p.control;
    let mem = match &op.local {
        StagedLocal::Host(region) => {
            let host = Op {
                kind: op.kind,
                local: region.clone(),
                local_offset: op.local_offset,
                token: op.token,
                remote_offset: op.remote_offset,
                len: op.len,
            };
            let o = execute(p, host).await;
            record(control, piece.op, &o);
            return;
        }
        StagedLocal::Device(m, _) => m,
    };
    let Some(mut guard) = p.pool.take().await else {
        control.with_ledger(|l| l.not_posted(piece.op, FailureKind::Local, None));
        return;
    };
    let lane = guard.lane();
    let n = piece.len as usize;
    let at = op.local_offset + piece.offset;
    let host = Op {
        kind: op.kind,
        local: lane.buf.clone(),
        local_offset: 0,
        token: op.token,
        remote_offset: op.remote_offset + piece.offset,
        len: piece.len,
    };
    let to_host = match op.kind {
        OpKind::Write => true,
        OpKind::Read => false,
        // A checksum answers into host memory (`Peer::checksum`); it is never staged.
        OpKind::Checksum => {
            control.with_ledger(|l| l.not_posted(piece.op, FailureKind::Local, None));
            return;
        }
    };
    let copied = |r: Result<(), Option<CudaError>>, t0: Instant| {
        counters
            .copy_wait_ns
            .fetch_add(t0.elapsed().as_nanos() as u64, Ordering::Relaxed);
        counters.copies.fetch_add(1, Ordering::Relaxed);
        r.map_err(|e| {
            counters.copy_failures.fetch_add(1, Ordering::Relaxed);
            let code = e.as_ref().and_then(CudaError::code);
            match e {
                Some(e) => tracing::warn!(error = %e, "staging copy failed"),
                None => tracing::warn!("staging copy failed: its lane's thread is gone"),
            }
            code
        })
    };
    if to_host {
        let t0 = Instant::now();
        if let Err(code) = copied(lane.copy(mem, at, n, true).await, t0) {
            // Nothing of this chunk was sent.
            control.with_ledger(|l| l.not_posted(piece.op, FailureKind::Local, code));
            return;
        }
        let o = execute(p, host).await;
        if o.is_success() {
            counters
                .staged_bytes
                .fetch_add(piece.len, Ordering::Relaxed);
        }
        record(control, piece.op, &o);
    } else {
        let o = execute(p, host).await;
        if !o.is_success() {
            record(control, piece.op, &o);
            return;
        }
        let t0 = Instant::now();
        match copied(lane.copy(mem, at, n, false).await, t0) {
            Ok(()) => {
                counters
                    .staged_bytes
                    .fetch_add(piece.len, Ordering::Relaxed);
                record(control, piece.op, &o);
            }
            Err(code) => control.with_ledger(|l| l.not_posted(piece.op, FailureKind::Local, code)),
        }
    }
    drop(guard);
}

/// Runs one host op as a sub-request on the peer's channel to its end (drained), reconnecting
/// and replaying as the peer's policy allows until the request's deadline; a cancel of the
/// request stops it too (no further chunk, no replay).
async fn execute(p: &Pipeline, op: Op) -> Outcome {
    let ops: Arc<[Op]> = Arc::from([op]);
    let control = Arc::new(RequestControl::part_of(&p.control, &ops));
    crate::reconnect::run(p.peer.clone(), ops, control, p.deadline).await
}

/// Folds a piece's outcome into the request's ledger: complete (posted and acknowledged), or
/// failed with its kind; a failed WRITE piece that may have reached remote memory counts as
/// posted and lost (uncertain).
fn record(control: &RequestControl, op: usize, o: &Outcome) {
    control.with_ledger(|l| match o.failure {
        None => {
            l.posted(op);
            l.acked(op);
        }
        Some(f) => {
            if o.remote_effect == RemoteEffect::None {
                l.not_posted(op, f.kind, f.native_status);
            } else {
                l.posted(op);
                l.lost(op, f.kind, f.native_status);
            }
        }
    });
}

impl crate::request::LocalMemory for GpuRegistration {
    fn local_ref(&self) -> crate::request::LocalRef {
        crate::request::LocalRef(StagedLocal::Device(
            self.memory.clone(),
            self.direct.as_ref().map(|d| d.region.clone()),
        ))
    }
}

#[cfg_attr(not(feature = "rdma"), allow(dead_code))]
/// The device of a rail name (`mlx5_0:1` is on `mlx5_0`).
pub(crate) fn rail_device(rail: &str) -> &str {
    rail.rsplit_once(':').map_or(rail, |(d, _)| d)
}

#[cfg_attr(not(feature = "rdma"), allow(dead_code))]
/// Which of the engine's rails a GPU registration is made on, and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct NicChoice {
    /// Rail indices (the registry's context ids).
    pub(crate) rails: Vec<usize>,
    /// Why, in words (shown by `describe()`).
    pub(crate) why: String,
}

#[cfg_attr(not(feature = "rdma"), allow(dead_code))]
impl NicChoice {
    fn names(&self, rails: &[String]) -> Vec<String> {
        self.rails
            .iter()
            .filter_map(|&i| rails.get(i).cloned())
            .collect()
    }
}

#[cfg_attr(not(feature = "rdma"), allow(dead_code))]
/// The rails on the NICs nearest the GPU at `pci_bus_id`: the topology's assignment (same PCI
/// switch, then root complex, then NUMA node, then across sockets, load spread over GPUs). When
/// locality is unknown (no sysfs topology, the GPU not in it, no NIC assigned, or no rail on
/// the assigned NICs) every rail serves it, and `why` says so.
pub(crate) fn choose_nics(
    rails: &[String],
    topo: Option<&topology::Topology>,
    pci_bus_id: &str,
) -> NicChoice {
    let every = |why: String| NicChoice {
        rails: (0..rails.len()).collect(),
        why: format!("{why}: every rail ({})", rails.join(", ")),
    };
    let Some(topo) = topo else {
        return every("the sysfs PCI topology is unreadable, so locality is unknown".into());
    };
    let Some(gpu) = topo
        .gpus
        .iter()
        .find(|g| g.pci.to_string().eq_ignore_ascii_case(pci_bus_id))
    else {
        return every(format!(
            "GPU {pci_bus_id} is not in the sysfs PCI topology, so locality is unknown"
        ));
    };
    let Some(assigned) = topo.assignment.get(gpu.id).filter(|a| !a.nics.is_empty()) else {
        return every(format!("no usable NIC is assigned to GPU {pci_bus_id}"));
    };
    let picked: Vec<usize> = rails
        .iter()
        .enumerate()
        .filter(|(_, r)| assigned.nics.iter().any(|n| n == rail_device(r)))
        .map(|(i, _)| i)
        .collect();
    let class = assigned
        .class
        .map_or_else(|| "?".to_owned(), |c| c.as_str().to_owned());
    if picked.is_empty() {
        return every(format!(
            "the NICs nearest GPU {pci_bus_id} ({}, {class}) carry none of this engine's rails",
            assigned.nics.join(", ")
        ));
    }
    NicChoice {
        why: format!(
            "nearest GPU {pci_bus_id} by PCI distance ({class}): {}",
            picked
                .iter()
                .filter_map(|&i| rails.get(i).map(String::as_str))
                .collect::<Vec<_>>()
                .join(", ")
        ),
        rails: picked,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two GPUs, each with its own nearest NIC (what the topology crate's assignment gives on a
    /// DGX-like machine; its fixtures test the assignment itself), built in memory: no I/O.
    fn two_gpus() -> topology::Topology {
        let gpu = |id: usize, pci: &str| topology::Gpu {
            id,
            pci: pci.parse().unwrap(),
            vendor: None,
            device: None,
            numa_node: None,
            nics: Vec::new(),
        };
        let assigned = |gpu: usize, nic: &str, id: usize| topology::Assignment {
            gpu,
            nics: vec![nic.to_owned()],
            nic_ids: vec![id],
            class: Some(topology::DistanceClass::Pix),
        };
        topology::Topology {
            nics: Vec::new(),
            gpus: vec![gpu(0, "0000:17:00.0"), gpu(1, "0000:3d:00.0")],
            assignment: vec![assigned(0, "mlx5_0", 0), assigned(1, "mlx5_3", 3)],
            verbs_only: Vec::new(),
            verbs_unavailable: None,
            pci_devices: 0,
            numa_nodes: Vec::new(),
        }
    }

    fn rails(names: &[&str]) -> Vec<String> {
        names.iter().map(|n| format!("{n}:1")).collect()
    }

    /// A GPU registration is made on the rails of the NICs nearest its GPU, and says why.
    #[test]
    fn nics_nearest_the_gpu_serve_it() {
        let t = two_gpus();
        let r = rails(&["mlx5_0", "mlx5_1", "mlx5_3", "mlx5_7"]);
        let c = choose_nics(&r, Some(&t), "0000:17:00.0");
        assert_eq!(c.rails, vec![0], "{c:?}");
        assert!(
            c.why.contains("PIX") && c.why.contains("mlx5_0:1"),
            "{}",
            c.why
        );
        // The bus id is matched whatever its case.
        let c = choose_nics(&r, Some(&t), "0000:3D:00.0");
        assert_eq!(c.names(&r), vec!["mlx5_3:1".to_owned()], "{c:?}");
    }

    /// Unknown locality never narrows the rails, and the reason says which fact was missing.
    #[test]
    fn unknown_locality_uses_every_rail_and_says_why() {
        let t = two_gpus();
        let r = rails(&["mlx5_4", "mlx5_5"]);
        let c = choose_nics(&r, None, "0000:17:00.0");
        assert_eq!(c.rails, vec![0, 1]);
        assert!(c.why.contains("unreadable"), "{}", c.why);
        let c = choose_nics(&r, Some(&t), "0000:ee:00.0");
        assert_eq!(c.rails, vec![0, 1]);
        assert!(
            c.why.contains("0000:ee:00.0 is not in the sysfs"),
            "{}",
            c.why
        );
        // GPU 0's nearest NIC is mlx5_0, which carries no rail here.
        let c = choose_nics(&r, Some(&t), "0000:17:00.0");
        assert_eq!(c.rails, vec![0, 1]);
        assert!(c.why.contains("carry none"), "{}", c.why);
        assert!(
            c.why.contains("every rail (mlx5_4:1, mlx5_5:1)"),
            "{}",
            c.why
        );
        let mut none = two_gpus();
        none.assignment[0].nics.clear();
        let c = choose_nics(&r, Some(&none), "0000:17:00.0");
        assert_eq!(c.rails, vec![0, 1]);
        assert!(c.why.contains("no usable NIC is assigned"), "{}", c.why);
    }

    /// Local memory that is device memory, with or without its GPUDirect region.
    struct Dev(Arc<DeviceMemory>, Option<Arc<MemoryRegion>>);

    impl crate::request::LocalMemory for Dev {
        fn local_ref(&self) -> crate::request::LocalRef {
            crate::request::LocalRef(StagedLocal::Device(self.0.clone(), self.1.clone()))
        }
    }

    /// Host memory.
    struct Host(Arc<MemoryRegion>);

    impl crate::request::LocalMemory for Host {
        fn local_ref(&self) -> crate::request::LocalRef {
            crate::request::LocalRef(StagedLocal::Host(self.0.clone()))
        }
    }

    fn segment(kind: ferry_core::TransportKind) -> crate::handles::RemoteSegment {
        let mut ch = ferry_core::transport::MockChannel::new();
        ch.expect_kind().return_const(kind);
        let desc = SegmentDesc {
            name: "g".into(),
            token: SegmentToken(7),
            len: 1 << 20,
            access: Access::REMOTE_READ | Access::REMOTE_WRITE,
            remote_keys: Vec::new(),
        };
        let peer = Arc::new(PeerInner::for_test(
            Arc::new(ch),
            vec![desc.clone()],
            crate::route::Routes::default().counters("p".into(), kind),
        ));
        crate::handles::RemoteSegment { peer, desc }
    }

    /// Device memory reaches a transport only as its GPUDirect region, only towards an RDMA
    /// peer, and only when every device op of the batch has one; every other batch is staged.
    #[test]
    fn gpu_ops_go_to_the_nic_only_over_rdma_with_a_region() {
        use ferry_core::TransportKind::{Rdma, Tcp, Uring};
        let Some(fake) = ferry_tests::fake_cuda(ferry_tests::FakeVariant::Full) else {
            return;
        };
        let cuda = Cuda::open(fake.path().as_os_str()).unwrap();
        let mem = Arc::new(cuda.device(0).unwrap().alloc(1 << 20).unwrap());
        let region = Arc::new(mem.nic_region(cuda::GpuRoute::Peermem).unwrap());
        assert!(!region.is_host());
        assert_eq!(region.as_ptr() as u64, mem.device_ptr());
        let with = Dev(mem.clone(), Some(region.clone()));
        let without = Dev(mem.clone(), None);
        let host = Host(Arc::new(MemoryRegion::from_vec(vec![0; 64])));
        for (kind, direct) in [(Rdma, true), (Tcp, false), (Uring, false)] {
            let seg = segment(kind);
            let (_, checked) = crate::Batch::new()
                .write(&with, 0, &seg, 0, 4096)
                .read(&host, 0, &seg, 8, 64)
                .checked()
                .unwrap();
            match checked {
                crate::request::Checked::Host(ops) => {
                    assert!(direct, "{kind}: device memory given to a {kind} transport");
                    assert!(Arc::ptr_eq(&ops[0].local, &region));
                    assert!(ops[1].local.is_host());
                }
                crate::request::Checked::Staged(_) => assert!(!direct, "{kind}: staged"),
            }
            // A device op without a region stages the whole batch, whatever the peer.
            let (_, checked) = crate::Batch::new()
                .write(&with, 0, &seg, 0, 4096)
                .write(&without, 0, &seg, 0, 4096)
                .checked()
                .unwrap();
            assert!(
                matches!(checked, crate::request::Checked::Staged(_)),
                "{kind}"
            );
        }
    }

    #[test]
    fn rail_names_give_their_device() {
        assert_eq!(rail_device("mlx5_0:1"), "mlx5_0");
        assert_eq!(rail_device("rxe0"), "rxe0");
    }
}
