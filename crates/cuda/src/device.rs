//! Devices, their retained primary contexts, and GPU memory: device memory allocated here
//! (freed on drop) or owned by someone else (kept alive by an owner), pinned host memory, and
//! the serving side's view of device memory as a [`FileSource`].
//!
//! Device memory is never dereferenced by Rust: a [`DeviceMemory`] has a device address, not a
//! host pointer, and bytes move in and out of it only by the driver's copies. It is not a
//! [`MemoryRegion`] (which transports read and write by address), so it cannot reach a TCP or
//! io_uring transport by mistake: the engine stages it through pinned host buffers, which are.

use std::any::Any;
use std::fmt;
use std::ptr::NonNull;
use std::sync::{Arc, Mutex, OnceLock, PoisonError};

use ferry_core::{
    Access, DeviceNative, DevicePlacement, FileSource, MemoryRegion, OpKind, RemoteStatus,
    check_range,
};

use crate::CudaError;
use crate::driver::{CtxHandle, CuDevice, DevicePtr, Driver, LibCuda, StreamHandle};

/// Where a GPU sits: what routing needs (the topology crate matches the PCI bus id).
#[derive(Clone, Debug, PartialEq, Eq, Hash, serde::Serialize)]
pub struct DeviceLocation {
    /// The CUDA device ordinal.
    pub ordinal: u32,
    /// The PCI bus id, lower-case (`0000:17:00.0`).
    pub pci_bus_id: String,
}

/// What the driver says about one device.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct DeviceInfo {
    /// Ordinal and PCI bus id.
    pub location: DeviceLocation,
    /// The device's name (`NVIDIA H200`).
    pub name: String,
    /// Total device memory in bytes.
    pub total_mem: u64,
    /// Whether the device supports dma-buf export (`CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED`).
    pub dmabuf_supported: bool,
}

struct Inner {
    driver: Box<dyn Driver>,
    devices: Vec<(CuDevice, DeviceInfo)>,
    /// One retained primary context per device, made on first use and released on drop.
    contexts: Vec<OnceLock<Result<CtxHandle, String>>>,
    /// Errors of releases and frees that `Drop` could only record.
    deferred: Mutex<Vec<CudaError>>,
}

impl Drop for Inner {
    fn drop(&mut self) {
        for ((dev, info), ctx) in self.devices.iter().zip(&self.contexts) {
            if let Some(Ok(_)) = ctx.get()
                && let Err(e) = self.driver.primary_ctx_release(*dev)
            {
                tracing::warn!(device = info.location.ordinal, error = %e,
                    "releasing the primary context failed");
            }
        }
    }
}

/// A loaded CUDA driver and its devices. Cheap to clone; everything made from it keeps it alive.
#[derive(Clone)]
pub struct Cuda {
    inner: Arc<Inner>,
}

impl fmt::Debug for Cuda {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Cuda")
            .field("driver", &self.inner.driver)
            .field("devices", &self.inner.devices.len())
            .finish()
    }
}

impl Cuda {
    /// Loads the system's driver (`libcuda.so.1`, or the file `FERRY_LIBCUDA` names), initialises
    /// it and lists its devices. The library is probed before any call, so a machine without it
    /// gets `Unavailable("libcuda.so.1: <loader's reason>")`.
    pub fn load() -> Result<Self, CudaError> {
        Self::open(&crate::library_name("FERRY_LIBCUDA", crate::LIBCUDA))
    }

    /// As [`load`](Self::load), from the library `name` (a soname or a path).
    pub fn open(name: &std::ffi::OsStr) -> Result<Self, CudaError> {
        Self::with_driver(Box::new(LibCuda::load(name)?))
    }

    /// Initialises `driver` and lists its devices (no context is made yet).
    pub fn with_driver(driver: Box<dyn Driver>) -> Result<Self, CudaError> {
        driver.init()?;
        let count = driver.device_count()?;
        let mut devices = Vec::new();
        for ordinal in 0..count.max(0) {
            let dev = driver.device(ordinal)?;
            let info = DeviceInfo {
                location: DeviceLocation {
                    ordinal: ordinal as u32,
                    pci_bus_id: driver.pci_bus_id(dev)?,
                },
                name: driver.device_name(dev)?,
                total_mem: driver.total_mem(dev)?,
                dmabuf_supported: driver
                    .attribute(dev, crate::driver::ATTR_DMA_BUF_SUPPORTED)
                    .map(|v| v != 0)
                    .unwrap_or(false),
            };
            devices.push((dev, info));
        }
        let contexts = devices.iter().map(|_| OnceLock::new()).collect();
        Ok(Self {
            inner: Arc::new(Inner {
                driver,
                devices,
                contexts,
                deferred: Mutex::new(Vec::new()),
            }),
        })
    }

    /// Wraps device memory someone else owns, as [`Device::wrap`] does, but asks the driver
    /// where it is first (`cuPointerGetAttribute`): `ptr` must be device memory (not host,
    /// managed or array memory), and `ptr..ptr+len` must lie inside the one allocation holding
    /// `ptr`; the device is the one the driver names. A pointer the driver does not know, or a
    /// range past its allocation, is an error naming both.
    ///
    /// # Safety
    /// `owner` keeps the allocation alive, and nothing frees it, until the last handle drops.
    pub unsafe fn wrap_located(
        &self,
        ptr: DevicePtr,
        len: usize,
        owner: Box<dyn Any + Send + Sync>,
    ) -> Result<DeviceMemory, CudaError> {
        let driver = &*self.inner.driver;
        let info = driver.pointer_info(ptr)?;
        let refuse = |what: String| CudaError::NotDeviceMemory {
            library: driver.library().to_owned(),
            what: format!("cuPointerGetAttribute: {what}"),
        };
        if info.memory_type != crate::driver::MEMORY_TYPE_DEVICE {
            return Err(refuse(format!(
                "{ptr:#x} is not device memory (memory type {}: 1 host, 3 array, 4 managed); \
                 register host memory as host memory",
                info.memory_type
            )));
        }
        let end = ptr.checked_add(len as u64);
        if ptr < info.start || end.is_none_or(|e| e > info.start + info.size) {
            return Err(refuse(format!(
                "{ptr:#x}+{len} runs past its allocation ({:#x}+{} on GPU {})",
                info.start, info.size, info.ordinal
            )));
        }
        let ordinal = u32::try_from(info.ordinal)
            .map_err(|_| refuse(format!("{ptr:#x} names no device ({})", info.ordinal)))?;
        let device = self.device(ordinal)?;
        // SAFETY: the driver places the range inside one live device allocation on `device`;
        // the caller guarantees `owner` keeps it alive.
        Ok(unsafe { device.wrap(ptr, len, owner) })
    }

    /// Whether the driver exports the CUDA IPC entry points ([`crate::ipc`]).
    pub fn has_ipc(&self) -> bool {
        self.inner.driver.has_ipc()
    }

    /// The library loaded.
    pub fn library(&self) -> &str {
        self.inner.driver.library()
    }

    /// Whether it is Ferry's fake driver (tests only).
    pub fn is_fake(&self) -> bool {
        self.inner.driver.is_fake()
    }

    /// The driver's CUDA version as `major.minor`.
    pub fn version(&self) -> Result<String, CudaError> {
        let v = self.inner.driver.version()?;
        Ok(format!("{}.{}", v / 1000, (v % 1000) / 10))
    }

    /// Whether the driver exports the dma-buf entry point.
    pub fn has_dmabuf_export(&self) -> bool {
        self.inner.driver.has_dmabuf_export()
    }

    /// Every device the driver lists.
    pub fn devices(&self) -> Vec<DeviceInfo> {
        self.inner.devices.iter().map(|(_, i)| i.clone()).collect()
    }

    /// Device `ordinal`, with its primary context retained (once per device, for the life of
    /// this `Cuda`).
    pub fn device(&self, ordinal: u32) -> Result<Device, CudaError> {
        let idx = ordinal as usize;
        let Some((dev, info)) = self.inner.devices.get(idx) else {
            return Err(CudaError::NoDevice {
                library: self.library().to_owned(),
                ordinal,
                count: self.inner.devices.len(),
            });
        };
        let ctx = self.inner.contexts[idx]
            .get_or_init(|| {
                self.inner
                    .driver
                    .primary_ctx_retain(*dev)
                    .map_err(|e| e.to_string())
            })
            .clone()
            .map_err(|reason| CudaError::Context {
                device: ordinal,
                reason,
            })?;
        Ok(Device {
            cuda: self.clone(),
            ctx,
            info: info.clone(),
        })
    }

    /// The oldest error that a `Drop` could only record (a failed free), if any.
    pub fn check(&self) -> Result<(), CudaError> {
        let mut d = self
            .inner
            .deferred
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if d.is_empty() {
            Ok(())
        } else {
            Err(d.remove(0))
        }
    }

    pub(crate) fn record(&self, e: CudaError) {
        tracing::warn!(error = %e, "CUDA cleanup failed");
        self.inner
            .deferred
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(e);
    }
}

/// One device with its primary context.
#[derive(Clone)]
pub struct Device {
    cuda: Cuda,
    ctx: CtxHandle,
    info: DeviceInfo,
}

impl fmt::Debug for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Device").field("info", &self.info).finish()
    }
}

impl Device {
    /// What the driver says about it.
    pub fn info(&self) -> &DeviceInfo {
        &self.info
    }

    /// Ordinal and PCI bus id.
    pub fn location(&self) -> &DeviceLocation {
        &self.info.location
    }

    /// The driver.
    pub fn cuda(&self) -> &Cuda {
        &self.cuda
    }

    pub(crate) fn driver(&self) -> &dyn Driver {
        &*self.cuda.inner.driver
    }

    /// Makes this device's primary context current on the calling thread (every copy does).
    pub(crate) fn make_current(&self) -> Result<(), CudaError> {
        self.driver()
            .set_current(self.ctx)
            .map_err(|e| e.on_device(self.info.location.ordinal))
    }

    /// Whether `other` is this device of the same loaded driver (one context).
    pub(crate) fn same_context(&self, other: &Device) -> bool {
        Arc::ptr_eq(&self.cuda.inner, &other.cuda.inner) && self.ctx == other.ctx
    }

    /// Allocates `len` bytes of device memory, freed when the last handle drops.
    pub fn alloc(&self, len: usize) -> Result<DeviceMemory, CudaError> {
        self.make_current()?;
        let ptr = self
            .driver()
            .mem_alloc(len.max(1))
            .map_err(|e| e.on_device(self.info.location.ordinal))?;
        Ok(DeviceMemory {
            device: self.clone(),
            ptr,
            len,
            owner: DeviceOwner::Allocated,
        })
    }

    /// Wraps device memory someone else owns (what a PyTorch or JAX binding hands over):
    /// `ptr..ptr+len` on this device, kept alive by `owner` until the last handle drops.
    ///
    /// # Safety
    /// `ptr..ptr+len` must be one live device allocation on this device (or part of one) for as
    /// long as `owner` lives, and nothing may free it meanwhile.
    pub unsafe fn wrap(
        &self,
        ptr: DevicePtr,
        len: usize,
        owner: Box<dyn Any + Send + Sync>,
    ) -> DeviceMemory {
        DeviceMemory {
            device: self.clone(),
            ptr,
            len,
            owner: DeviceOwner::External(owner),
        }
    }

    /// A stream of copies on this device (`cuStreamCreate`, non-blocking: its copies do not
    /// wait for work on the legacy default stream, nor does that work wait for them), destroyed
    /// on drop. What the staging pipeline copies on: one per staging buffer.
    pub fn copy_stream(&self) -> Result<CopyStream, CudaError> {
        self.make_current()?;
        let handle = self
            .driver()
            .stream_create()
            .map_err(|e| e.on_device(self.info.location.ordinal))?;
        Ok(CopyStream {
            device: self.clone(),
            handle,
        })
    }

    /// Allocates `len` bytes of pinned (page-locked) host memory in this device's context.
    pub fn alloc_pinned(&self, len: usize) -> Result<PinnedBuffer, CudaError> {
        self.make_current()?;
        let p = self
            .driver()
            .host_alloc(len.max(1))
            .map_err(|e| e.on_device(self.info.location.ordinal))?;
        let ptr = NonNull::new(p).ok_or_else(|| CudaError::Call {
            library: self.cuda.library().to_owned(),
            call: "cuMemAllocHost_v2",
            code: 0,
            name: "returned a null pointer".into(),
        })?;
        Ok(PinnedBuffer {
            device: self.clone(),
            ptr,
            len,
        })
    }
}

enum DeviceOwner {
    /// Allocated by [`Device::alloc`]; freed on drop.
    Allocated,
    /// Someone else's; dropping the box releases it.
    External(#[allow(dead_code)] Box<dyn Any + Send + Sync>),
}

/// A range of device memory: allocated here or wrapped. It has no host address; bytes move by
/// the driver's copies only (bounds-checked here).
pub struct DeviceMemory {
    device: Device,
    ptr: DevicePtr,
    len: usize,
    owner: DeviceOwner,
}

impl fmt::Debug for DeviceMemory {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DeviceMemory")
            .field("device", &self.device.info.location)
            .field("addr", &format_args!("{:#x}", self.ptr))
            .field("len", &self.len)
            .finish()
    }
}

impl DeviceMemory {
    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The device address (for native registration: peermem `ibv_reg_mr`, cuFile).
    pub fn device_ptr(&self) -> DevicePtr {
        self.ptr
    }

    /// The device it lives on.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Ordinal and PCI bus id of its device.
    pub fn location(&self) -> &DeviceLocation {
        self.device.location()
    }

    pub(crate) fn bounds(&self, offset: u64, len: usize) -> Result<DevicePtr, CudaError> {
        check_range(offset, len as u64, self.len as u64).map_err(CudaError::OutOfBounds)?;
        Ok(self.ptr + offset)
    }

    /// Copies `dst.len()` bytes at `offset` out to host memory (device to host).
    pub fn copy_to_host(&self, offset: u64, dst: &mut [u8]) -> Result<(), CudaError> {
        let src = self.bounds(offset, dst.len())?;
        self.device.make_current()?;
        // SAFETY: `dst` is a writable host slice; `src..+len` was bounds-checked in this
        // allocation, which `self` keeps alive.
        unsafe {
            self.device
                .driver()
                .copy_dtoh(dst.as_mut_ptr(), src, dst.len())
        }
        .map_err(|e| e.on_device(self.location().ordinal))
    }

    /// Copies `src` into the device memory at `offset` (host to device).
    pub fn copy_from_host(&self, offset: u64, src: &[u8]) -> Result<(), CudaError> {
        let dst = self.bounds(offset, src.len())?;
        self.device.make_current()?;
        // SAFETY: `src` is a readable host slice; the device range was bounds-checked.
        unsafe { self.device.driver().copy_htod(dst, src.as_ptr(), src.len()) }
            .map_err(|e| e.on_device(self.location().ordinal))
    }

    /// Copies `len` bytes at `offset` into `dst` at `dst_offset` (device to host region).
    pub fn copy_to_region(
        &self,
        offset: u64,
        dst: &MemoryRegion,
        dst_offset: u64,
        len: usize,
    ) -> Result<(), CudaError> {
        let src = self.bounds(offset, len)?;
        dst.check(dst_offset, len as u64)
            .map_err(CudaError::OutOfBounds)?;
        self.device.make_current()?;
        // SAFETY: both ranges were bounds-checked; the region is host memory that the caller
        // (the staging pipeline) owns exclusively for this copy.
        unsafe {
            self.device
                .driver()
                .copy_dtoh(dst.as_ptr().add(dst_offset as usize), src, len)
        }
        .map_err(|e| e.on_device(self.location().ordinal))
    }

    /// Copies `len` bytes of `src` at `src_offset` into the device memory at `offset`.
    pub fn copy_from_region(
        &self,
        offset: u64,
        src: &MemoryRegion,
        src_offset: u64,
        len: usize,
    ) -> Result<(), CudaError> {
        let dst = self.bounds(offset, len)?;
        src.check(src_offset, len as u64)
            .map_err(CudaError::OutOfBounds)?;
        self.device.make_current()?;
        // SAFETY: both ranges were bounds-checked; nothing writes the host range meanwhile (the
        // staging pipeline owns it until this copy returns).
        unsafe {
            self.device
                .driver()
                .copy_htod(dst, src.as_ptr().add(src_offset as usize), len)
        }
        .map_err(|e| e.on_device(self.location().ordinal))
    }

    /// A dma-buf file descriptor for the whole range (`cuMemGetHandleForAddressRange`).
    pub fn dmabuf_fd(&self) -> Result<std::os::fd::OwnedFd, CudaError> {
        self.device.make_current()?;
        self.device
            .driver()
            .dmabuf_export(self.ptr, self.len.max(1))
            .map_err(|e| e.on_device(self.location().ordinal))
    }
}

impl DeviceMemory {
    /// This memory as a [`MemoryRegion`] placed on its device, for GPUDirect RDMA registration
    /// by `route` (peermem: the device address as is; dma-buf: a dma-buf exported for the range
    /// now, kept open by the region). The region keeps this memory alive; its host accessors
    /// refuse it, and only the RDMA transport may be given it. `route` `off` is refused: it has
    /// no NIC registration.
    pub fn nic_region(self: &Arc<Self>, route: crate::GpuRoute) -> Result<MemoryRegion, CudaError> {
        let native = match route {
            crate::GpuRoute::Peermem => DeviceNative::Peermem,
            crate::GpuRoute::Dmabuf => DeviceNative::Dmabuf {
                fd: Arc::new(self.dmabuf_fd()?),
                offset: 0,
            },
            crate::GpuRoute::Off => {
                return Err(CudaError::Unavailable {
                    library: self.device.cuda.library().to_owned(),
                    reason: "gpu_direct_registration = off: GPU memory has no NIC registration"
                        .into(),
                });
            }
        };
        let placement = DevicePlacement {
            ordinal: self.location().ordinal,
            pci_bus_id: self.location().pci_bus_id.clone(),
            native,
        };
        // SAFETY: `ptr..ptr+len` is one device allocation on this device (allocated here, or
        // wrapped under `Device::wrap`'s contract), and the region's keepalive is this
        // `Arc<DeviceMemory>`, which keeps it live and unfreed. The engine hands the region to
        // the RDMA registration path and RDMA ops only (documented on `MemoryRegion::device`).
        Ok(unsafe { MemoryRegion::device(self.ptr, self.len, placement, Box::new(self.clone())) })
    }
}

impl Drop for DeviceMemory {
    fn drop(&mut self) {
        if let DeviceOwner::Allocated = self.owner {
            let r = self
                .device
                .make_current()
                .and_then(|_| self.device.driver().mem_free(self.ptr));
            if let Err(e) = r {
                self.device
                    .cuda
                    .record(e.on_device(self.location().ordinal));
            }
        }
    }
}

/// A non-blocking stream of one device, for copies between its memory and pinned host memory.
///
/// Each copy is enqueued (`cuMemcpy*Async_v2`) and waited for (`cuStreamSynchronize`) before the
/// call returns, so a copy blocks only its own thread: copies on different streams run
/// concurrently with each other and with whatever the application runs on its own streams.
/// Nothing orders them after the application's kernels: memory is copied as it is when the copy
/// starts, so the caller synchronizes the stream that produced it before submitting (as with
/// any transfer engine). Memory of another device is copied by that device's blocking copies.
pub struct CopyStream {
    device: Device,
    handle: StreamHandle,
}

impl fmt::Debug for CopyStream {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CopyStream")
            .field("device", &self.device.info.location.ordinal)
            .finish_non_exhaustive()
    }
}

impl CopyStream {
    /// The stream's device.
    pub fn device(&self) -> &Device {
        &self.device
    }

    fn same_device(&self, mem: &DeviceMemory) -> bool {
        self.device.same_context(&mem.device)
    }

    /// Makes the stream's context current and enqueues `f`'s copy on the stream (the caller
    /// then [`finish`](Self::finish)es).
    pub(crate) fn enqueue(
        &self,
        f: impl FnOnce(&dyn Driver, StreamHandle) -> Result<(), CudaError>,
    ) -> Result<(), CudaError> {
        self.device.make_current()?;
        f(self.device.driver(), self.handle)
    }

    pub(crate) fn finish(&self, r: Result<(), CudaError>) -> Result<(), CudaError> {
        // A failed enqueue still synchronizes, so that nothing of an earlier copy is in flight
        // when the caller reuses its buffer.
        let synced = self.device.driver().stream_synchronize(self.handle);
        r.and(synced)
            .map_err(|e| e.on_device(self.device.info.location.ordinal))
    }

    /// Copies `len` bytes of `mem` at `offset` into `dst` at `dst_offset` (device to host), on
    /// this stream; returns when the bytes are in `dst`.
    pub fn copy_to_region(
        &self,
        mem: &DeviceMemory,
        offset: u64,
        dst: &MemoryRegion,
        dst_offset: u64,
        len: usize,
    ) -> Result<(), CudaError> {
        if !self.same_device(mem) {
            return mem.copy_to_region(offset, dst, dst_offset, len);
        }
        dst.check(dst_offset, len as u64)
            .map_err(CudaError::OutOfBounds)?;
        // SAFETY: the host range was bounds-checked in `dst`, which outlives this call, and the
        // caller (the staging pipeline) owns it exclusively meanwhile.
        unsafe { self.dtoh(mem, offset, dst.as_ptr().add(dst_offset as usize), len) }
    }

    /// Copies `len` bytes of `src` at `src_offset` into `mem` at `offset` (host to device), on
    /// this stream; returns when the bytes are in device memory.
    pub fn copy_from_region(
        &self,
        mem: &DeviceMemory,
        offset: u64,
        src: &MemoryRegion,
        src_offset: u64,
        len: usize,
    ) -> Result<(), CudaError> {
        if !self.same_device(mem) {
            return mem.copy_from_region(offset, src, src_offset, len);
        }
        src.check(src_offset, len as u64)
            .map_err(CudaError::OutOfBounds)?;
        // SAFETY: the host range was bounds-checked in `src`, which outlives this call; nothing
        // writes it meanwhile (the staging pipeline owns it until this copy returns).
        unsafe { self.htod(mem, offset, src.as_ptr().add(src_offset as usize), len) }
    }

    /// Copies `dst.len()` bytes of `mem` at `offset` into `dst` (device to host), on this stream.
    pub fn copy_to_host(
        &self,
        mem: &DeviceMemory,
        offset: u64,
        dst: &mut [u8],
    ) -> Result<(), CudaError> {
        if !self.same_device(mem) {
            return mem.copy_to_host(offset, dst);
        }
        // SAFETY: `dst` is exclusively borrowed for the whole call, which waits for the copy.
        unsafe { self.dtoh(mem, offset, dst.as_mut_ptr(), dst.len()) }
    }

    /// Copies `src` into `mem` at `offset` (host to device), on this stream.
    pub fn copy_from_host(
        &self,
        mem: &DeviceMemory,
        offset: u64,
        src: &[u8],
    ) -> Result<(), CudaError> {
        if !self.same_device(mem) {
            return mem.copy_from_host(offset, src);
        }
        // SAFETY: `src` is borrowed for the whole call, which waits for the copy.
        unsafe { self.htod(mem, offset, src.as_ptr(), src.len()) }
    }

    /// Device to host on this stream, synchronized.
    ///
    /// # Safety
    /// `dst..dst+len` is host memory writable by this call alone until it returns.
    unsafe fn dtoh(
        &self,
        mem: &DeviceMemory,
        offset: u64,
        dst: *mut u8,
        len: usize,
    ) -> Result<(), CudaError> {
        let src = mem.bounds(offset, len)?;
        self.device.make_current()?;
        // SAFETY: the device range was bounds-checked in `mem`, which outlives this call; the
        // host range is the caller's (see above); the stream is synchronized before returning.
        let r = unsafe {
            self.device
                .driver()
                .copy_dtoh_async(dst, src, len, self.handle)
        };
        self.finish(r)
    }

    /// Host to device on this stream, synchronized.
    ///
    /// # Safety
    /// `src..src+len` is host memory readable, and written by nobody, until this call returns.
    unsafe fn htod(
        &self,
        mem: &DeviceMemory,
        offset: u64,
        src: *const u8,
        len: usize,
    ) -> Result<(), CudaError> {
        let dst = mem.bounds(offset, len)?;
        self.device.make_current()?;
        // SAFETY: as for `dtoh`.
        let r = unsafe {
            self.device
                .driver()
                .copy_htod_async(dst, src, len, self.handle)
        };
        self.finish(r)
    }
}

impl Drop for CopyStream {
    fn drop(&mut self) {
        let r = self
            .device
            .make_current()
            .and_then(|_| self.device.driver().stream_destroy(self.handle));
        if let Err(e) = r {
            self.device
                .cuda
                .record(e.on_device(self.device.info.location.ordinal));
        }
    }
}

/// Pinned (page-locked) host memory from `cuMemAllocHost`, freed on drop. Host memory: it
/// becomes a [`MemoryRegion`] that transports may read and write by address.
pub struct PinnedBuffer {
    device: Device,
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: the buffer owns a plain host byte range; the driver handle it keeps is Send + Sync.
unsafe impl Send for PinnedBuffer {}
// SAFETY: `&PinnedBuffer` hands out nothing but its length; the bytes are reached through the
// `MemoryRegion` made from it, which documents its own concurrency model.
unsafe impl Sync for PinnedBuffer {}

impl fmt::Debug for PinnedBuffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PinnedBuffer")
            .field("addr", &self.ptr)
            .field("len", &self.len)
            .finish()
    }
}

impl PinnedBuffer {
    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The buffer as a host [`MemoryRegion`]; dropping the region frees the pinned memory.
    pub fn into_region(self) -> MemoryRegion {
        let ptr = self.ptr;
        let len = self.len;
        // SAFETY: `ptr..ptr+len` is pinned host memory owned by `self`, which the region keeps
        // alive (as its keepalive) and frees on drop; nothing else refers to it.
        unsafe { MemoryRegion::from_raw_parts(ptr, len, Box::new(self)) }
    }
}

impl Drop for PinnedBuffer {
    fn drop(&mut self) {
        let r = self.device.make_current().and_then(|_| {
            // SAFETY: `ptr` came from `host_alloc` of this driver and is freed only here.
            unsafe { self.device.driver().host_free(self.ptr.as_ptr()) }
        });
        if let Err(e) = r {
            self.device.cuda.record(e);
        }
    }
}

/// Device memory published to peers: served by the TCP and io_uring servers through their
/// bounded staging buffers, with device-to-host copies for READs and host-to-device copies for
/// WRITEs (the servers see a positioned-I/O source and learn nothing of CUDA). The copies run on
/// non-blocking streams of the memory's device, one per concurrent call, kept for reuse.
#[derive(Debug)]
pub struct DeviceSegment {
    memory: Arc<DeviceMemory>,
    access: Access,
    /// Copy streams of idle servers' calls (one per call at a time, made on first need): the
    /// serving copies do not wait for, nor hold up, the application's work on the legacy
    /// default stream.
    streams: Mutex<Vec<CopyStream>>,
}

impl DeviceSegment {
    /// Serves `memory` with `access` for peers.
    pub fn new(memory: Arc<DeviceMemory>, access: Access) -> Self {
        Self {
            memory,
            access,
            streams: Mutex::new(Vec::new()),
        }
    }

    /// Runs `f` on an idle copy stream of the memory's device (made if none is idle).
    fn on_stream(
        &self,
        f: impl FnOnce(&CopyStream) -> Result<(), CudaError>,
    ) -> std::io::Result<()> {
        let idle = self
            .streams
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .pop();
        let stream = match idle {
            Some(s) => s,
            None => self
                .memory
                .device
                .copy_stream()
                .map_err(std::io::Error::other)?,
        };
        let r = f(&stream);
        self.streams
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(stream);
        r.map_err(std::io::Error::other)
    }

    /// The memory served.
    pub fn memory(&self) -> &Arc<DeviceMemory> {
        &self.memory
    }

    /// Peers' access.
    pub fn access(&self) -> Access {
        self.access
    }
}

impl FileSource for DeviceSegment {
    fn check(&self, kind: OpKind, offset: u64, len: u64) -> Result<u64, RemoteStatus> {
        if !self.access.contains(kind.needed_access()) {
            return Err(RemoteStatus::AccessDenied);
        }
        check_range(offset, len, self.memory.len() as u64)
            .map_err(|_| RemoteStatus::OutOfBounds)?;
        Ok(offset)
    }

    fn read_exact_at(&self, at: u64, buf: &mut [u8]) -> std::io::Result<()> {
        self.on_stream(|s| s.copy_to_host(&self.memory, at, buf))
    }

    fn write_all_at(&self, at: u64, buf: &[u8]) -> std::io::Result<()> {
        self.on_stream(|s| s.copy_from_host(&self.memory, at, buf))
    }
}
