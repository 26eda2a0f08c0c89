//! CUDA IPC: device memory of one process copied by another on the same host, device to device,
//! with no host bounce (`cuIpcGetMemHandle` / `cuIpcOpenMemHandle_v2`).
//!
//! The two roles follow the same-host plane's rule (the side that owns the published memory
//! copies, the requesting side grants access to its own buffers):
//! - the *granting* side exports its buffer as an [`IpcRef`] ([`DeviceMemory::ipc_ref`]): the
//!   handle of the allocation holding it (handles are of an allocation's base, found with
//!   `cuMemGetAddressRange_v2`) and the buffer's offset and length in that allocation;
//! - the *copying* side opens what one peer process granted in its [`IpcImports`] (opened
//!   handles cached per peer, closed when the cache drops: when that peer is lost), checks each
//!   range against the allocation the driver mapped, and copies on a [`CopyStream`] between the
//!   opened memory and its own (device memory: `cuMemcpyDtoDAsync_v2`; host memory:
//!   `cuMemcpyHtoDAsync_v2` / `cuMemcpyDtoHAsync_v2`, still one copy), synchronized before the
//!   call returns.
//!
//! The real driver refuses a handle the calling process exported itself, so IPC is for two
//! processes; within one process device memory is reachable by its address already.

use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Mutex, PoisonError};

use ferry_core::{DeviceNative, DevicePlacement, MemoryRegion, Placement, check_range};

use crate::CudaError;
use crate::device::{CopyStream, Device, DeviceMemory};
use crate::driver::{DevicePtr, IPC_HANDLE_LEN, IpcMemHandle};

/// Bytes of an [`IpcRef`] on the wire: the handle, then the offset and the length (each a
/// little-endian u64).
pub const IPC_REF_LEN: usize = IPC_HANDLE_LEN + 16;

/// Opened handles one [`IpcImports`] keeps at most; past it the least recently used one that no
/// copy holds is closed.
pub const MAX_OPEN_HANDLES: usize = 256;

/// A buffer in another process's device memory, as that process grants it: the IPC handle of
/// its allocation and the buffer's range there.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IpcRef {
    /// The allocation's handle.
    pub handle: IpcMemHandle,
    /// Where the buffer starts in the allocation.
    pub offset: u64,
    /// The buffer's length.
    pub len: u64,
}

impl IpcRef {
    /// The wire form ([`IPC_REF_LEN`] bytes).
    pub fn encode(&self) -> [u8; IPC_REF_LEN] {
        let mut out = [0u8; IPC_REF_LEN];
        out[..IPC_HANDLE_LEN].copy_from_slice(&self.handle.0);
        out[IPC_HANDLE_LEN..IPC_HANDLE_LEN + 8].copy_from_slice(&self.offset.to_le_bytes());
        out[IPC_HANDLE_LEN + 8..].copy_from_slice(&self.len.to_le_bytes());
        out
    }

    /// Reads the wire form.
    pub fn decode(raw: &[u8; IPC_REF_LEN]) -> Self {
        let mut handle = [0u8; IPC_HANDLE_LEN];
        handle.copy_from_slice(&raw[..IPC_HANDLE_LEN]);
        let u64_at = |at: usize| {
            let mut b = [0u8; 8];
            b.copy_from_slice(&raw[at..at + 8]);
            u64::from_le_bytes(b)
        };
        Self {
            handle: IpcMemHandle(handle),
            offset: u64_at(IPC_HANDLE_LEN),
            len: u64_at(IPC_HANDLE_LEN + 8),
        }
    }

    /// The part `at..at+len` of this buffer (checked against it).
    pub fn slice(&self, at: u64, len: u64) -> Result<IpcRef, CudaError> {
        check_range(at, len, self.len).map_err(CudaError::OutOfBounds)?;
        Ok(IpcRef {
            handle: self.handle,
            offset: self.offset + at,
            len,
        })
    }
}

impl DeviceMemory {
    /// This memory as another process may open it: the IPC handle of the allocation holding it
    /// (`cuMemGetAddressRange_v2` finds its base, `cuIpcGetMemHandle` exports that) and this
    /// memory's range in it. `Unavailable` where the driver has no CUDA IPC.
    pub fn ipc_ref(&self) -> Result<IpcRef, CudaError> {
        let ordinal = self.location().ordinal;
        let driver = self.device().driver();
        self.device().make_current()?;
        let (base, size) = driver
            .address_range(self.device_ptr())
            .map_err(|e| e.on_device(ordinal))?;
        let offset = self.device_ptr() - base;
        check_range(offset, self.len() as u64, size).map_err(|_| CudaError::NotDeviceMemory {
            library: driver.library().to_owned(),
            what: format!(
                "cuMemGetAddressRange_v2: {:#x}+{} runs past its allocation ({base:#x}+{size})",
                self.device_ptr(),
                self.len()
            ),
        })?;
        let handle = driver
            .ipc_get_handle(base)
            .map_err(|e| e.on_device(ordinal))?;
        Ok(IpcRef {
            handle,
            offset,
            len: self.len() as u64,
        })
    }
}

impl DeviceMemory {
    /// This memory as a [`MemoryRegion`] placed on its device with its CUDA IPC grant
    /// ([`DeviceNative::CudaIpc`]): what the same-host plane's client sends in place of a host
    /// address. The region keeps this memory alive; its host accessors refuse it.
    pub fn ipc_region(self: &Arc<Self>) -> Result<MemoryRegion, CudaError> {
        let r = self.ipc_ref()?;
        let placement = DevicePlacement {
            ordinal: self.location().ordinal,
            pci_bus_id: self.location().pci_bus_id.clone(),
            native: DeviceNative::CudaIpc {
                handle: r.handle.0,
                offset: r.offset,
            },
        };
        // SAFETY: `ptr..ptr+len` is this device allocation (or part of one), kept alive by the
        // region's keepalive (this `Arc<DeviceMemory>`); the region is only given to the
        // same-host plane, which copies it by the driver (documented on `DeviceNative::CudaIpc`).
        Ok(unsafe {
            MemoryRegion::device(
                self.device_ptr(),
                self.len(),
                placement,
                Box::new(self.clone()),
            )
        })
    }
}

impl IpcRef {
    /// `at..at+len` of `region` as a grant, when the region is a CUDA IPC one
    /// ([`DeviceMemory::ipc_region`]); `None` for any other region.
    pub fn of_region(region: &MemoryRegion, at: u64, len: u64) -> Option<IpcRef> {
        match region.placement() {
            Placement::Device(DevicePlacement {
                native: DeviceNative::CudaIpc { handle, offset },
                ..
            }) => Some(IpcRef {
                handle: IpcMemHandle(*handle),
                offset: offset + at,
                len,
            }),
            _ => None,
        }
    }
}

/// One opened handle: closed (`cuIpcCloseMemHandle`) when the last holder drops it.
struct Opened {
    device: Device,
    base: DevicePtr,
    size: u64,
}

impl Drop for Opened {
    fn drop(&mut self) {
        let r = self
            .device
            .make_current()
            .and_then(|_| self.device.driver().ipc_close_handle(self.base));
        if let Err(e) = r {
            self.device
                .cuda()
                .record(e.on_device(self.device.location().ordinal));
        }
    }
}

/// A checked range of an opened handle: device memory of another process, mapped here. Holds
/// the handle open while it lives.
pub struct Imported {
    opened: Arc<Opened>,
    offset: u64,
    len: usize,
}

impl fmt::Debug for Imported {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Imported")
            .field("base", &format_args!("{:#x}", self.opened.base))
            .field("offset", &self.offset)
            .field("len", &self.len)
            .finish()
    }
}

impl Imported {
    /// Its length.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    fn ptr(&self) -> DevicePtr {
        self.opened.base + self.offset
    }
}

struct Cache {
    opened: HashMap<IpcMemHandle, (Arc<Opened>, u64)>,
    tick: u64,
}

/// The handles one peer process granted, opened in `device`'s context on first use and kept
/// open for the next copies; dropping it closes every one no copy still holds (the copying
/// side drops it when that peer is lost, so nothing is copied into memory of a process that
/// left).
pub struct IpcImports {
    device: Device,
    cache: Mutex<Cache>,
}

impl fmt::Debug for IpcImports {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IpcImports")
            .field("device", &self.device.location().ordinal)
            .field("open", &self.open_handles())
            .finish()
    }
}

impl IpcImports {
    /// An empty cache whose handles are opened in `device`'s context (an allocation of another
    /// GPU is reached by peer access, enabled lazily by the driver).
    pub fn new(device: &Device) -> Self {
        Self {
            device: device.clone(),
            cache: Mutex::new(Cache {
                opened: HashMap::new(),
                tick: 0,
            }),
        }
    }

    /// The device whose context opens the handles.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Handles open now.
    pub fn open_handles(&self) -> usize {
        self.cache
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .opened
            .len()
    }

    /// `at..at+len` of `r` (relative to `r`), opened and checked: the range must lie in `r`
    /// and `r` in the allocation the driver mapped for its handle. A handle the driver refuses
    /// (forged, stale, of a process that left) is its error; nothing is mapped for it.
    pub fn resolve(&self, r: &IpcRef, at: u64, len: usize) -> Result<Imported, CudaError> {
        let part = r.slice(at, len as u64)?;
        let opened = self.open(&part.handle)?;
        check_range(part.offset, part.len, opened.size).map_err(CudaError::OutOfBounds)?;
        Ok(Imported {
            opened,
            offset: part.offset,
            len,
        })
    }

    fn open(&self, handle: &IpcMemHandle) -> Result<Arc<Opened>, CudaError> {
        let mut cache = self.cache.lock().unwrap_or_else(PoisonError::into_inner);
        cache.tick += 1;
        let tick = cache.tick;
        if let Some((o, used)) = cache.opened.get_mut(handle) {
            *used = tick;
            return Ok(o.clone());
        }
        let ordinal = self.device.location().ordinal;
        let driver = self.device.driver();
        self.device.make_current()?;
        let base = driver
            .ipc_open_handle(handle)
            .map_err(|e| e.on_device(ordinal))?;
        // Owned from here: closed on every path below.
        let mut opened = Opened {
            device: self.device.clone(),
            base,
            size: 0,
        };
        let (start, size) = driver
            .address_range(base)
            .map_err(|e| e.on_device(ordinal))?;
        if start != base {
            return Err(CudaError::NotDeviceMemory {
                library: driver.library().to_owned(),
                what: format!("cuIpcOpenMemHandle_v2 mapped {base:#x}, inside {start:#x}+{size}"),
            });
        }
        opened.size = size;
        let opened = Arc::new(opened);
        if cache.opened.len() >= MAX_OPEN_HANDLES {
            let idle = cache
                .opened
                .iter()
                .filter(|(_, (o, _))| Arc::strong_count(o) == 1)
                .min_by_key(|(_, (_, used))| *used)
                .map(|(h, _)| *h);
            if let Some(h) = idle {
                cache.opened.remove(&h);
            }
        }
        cache.opened.insert(*handle, (opened.clone(), tick));
        tracing::debug!(
            device = ordinal,
            base = format_args!("{base:#x}"),
            size,
            "opened a CUDA IPC handle"
        );
        Ok(opened)
    }
}

impl CopyStream {
    /// `mem` is on this stream's GPU (a device-to-device copy runs on the GPU that owns it).
    fn on_this_gpu(&self, mem: &DeviceMemory) -> Result<(), CudaError> {
        if mem.location().ordinal == self.device().location().ordinal {
            Ok(())
        } else {
            Err(CudaError::Unavailable {
                library: self.device().cuda().library().to_owned(),
                reason: format!(
                    "memory of GPU {} is copied to an opened IPC handle on a stream of its own \
                     GPU, not GPU {}",
                    mem.location().ordinal,
                    self.device().location().ordinal
                ),
            })
        }
    }

    fn imported_ok(&self, dst: &Imported) -> Result<(), CudaError> {
        if self.device().same_context(&dst.opened.device) {
            Ok(())
        } else {
            Err(CudaError::Unavailable {
                library: self.device().cuda().library().to_owned(),
                reason: "an opened IPC handle is copied on a stream of the device that opened it"
                    .into(),
            })
        }
    }

    /// Copies `len` bytes of `mem` at `offset` into `dst` (device to device, across
    /// processes), on this stream; returns when the bytes are there.
    pub fn copy_to_imported(
        &self,
        mem: &DeviceMemory,
        offset: u64,
        dst: &Imported,
    ) -> Result<(), CudaError> {
        self.imported_ok(dst)?;
        self.on_this_gpu(mem)?;
        let src = mem.bounds(offset, dst.len)?;
        // SAFETY: `src` was bounds-checked in `mem`, which outlives the call; `dst` lies in the
        // opened allocation (checked by `resolve`), held open by `dst`; synchronized below.
        let r = self.enqueue(|d, s| unsafe { d.copy_dtod_async(dst.ptr(), src, dst.len, s) });
        self.finish(r)
    }

    /// Copies `src` (device memory of another process) into `mem` at `offset`, device to
    /// device, on this stream.
    pub fn copy_from_imported(
        &self,
        mem: &DeviceMemory,
        offset: u64,
        src: &Imported,
    ) -> Result<(), CudaError> {
        self.imported_ok(src)?;
        self.on_this_gpu(mem)?;
        let dst = mem.bounds(offset, src.len)?;
        // SAFETY: as for `copy_to_imported`, the other way.
        let r = self.enqueue(|d, s| unsafe { d.copy_dtod_async(dst, src.ptr(), src.len, s) });
        self.finish(r)
    }

    /// Copies `dst.len()` bytes of host memory `src` at `src_offset` into `dst` (host to
    /// another process's device memory: one copy), on this stream.
    pub fn copy_region_to_imported(
        &self,
        src: &MemoryRegion,
        src_offset: u64,
        dst: &Imported,
    ) -> Result<(), CudaError> {
        self.imported_ok(dst)?;
        src.check(src_offset, dst.len as u64)
            .map_err(CudaError::OutOfBounds)?;
        if !src.is_host() {
            return Err(host_only(self));
        }
        // SAFETY: the host range was bounds-checked in `src` (host memory), which outlives the
        // call; `dst` as in `copy_to_imported`; synchronized below.
        let r = self.enqueue(|d, s| unsafe {
            d.copy_htod_async(dst.ptr(), src.as_ptr().add(src_offset as usize), dst.len, s)
        });
        self.finish(r)
    }

    /// Copies `src` into `dst` (host to another process's device memory), on this stream.
    pub fn copy_host_to_imported(&self, src: &[u8], dst: &Imported) -> Result<(), CudaError> {
        self.imported_ok(dst)?;
        check_range(0, dst.len as u64, src.len() as u64).map_err(CudaError::OutOfBounds)?;
        // SAFETY: `src` is borrowed for the whole call, which waits for the copy; `dst` as in
        // `copy_to_imported`.
        let r =
            self.enqueue(|d, s| unsafe { d.copy_htod_async(dst.ptr(), src.as_ptr(), dst.len, s) });
        self.finish(r)
    }

    /// Copies `src` (another process's device memory) into `dst`, on this stream.
    pub fn copy_imported_to_host(&self, src: &Imported, dst: &mut [u8]) -> Result<(), CudaError> {
        self.imported_ok(src)?;
        check_range(0, src.len as u64, dst.len() as u64).map_err(CudaError::OutOfBounds)?;
        // SAFETY: `dst` is exclusively borrowed for the whole call, which waits for the copy.
        let r = self
            .enqueue(|d, s| unsafe { d.copy_dtoh_async(dst.as_mut_ptr(), src.ptr(), src.len, s) });
        self.finish(r)
    }

    /// Copies `src` (another process's device memory) into host memory `dst` at `dst_offset`,
    /// on this stream.
    pub fn copy_imported_to_region(
        &self,
        src: &Imported,
        dst: &MemoryRegion,
        dst_offset: u64,
    ) -> Result<(), CudaError> {
        self.imported_ok(src)?;
        dst.check(dst_offset, src.len as u64)
            .map_err(CudaError::OutOfBounds)?;
        if !dst.is_host() {
            return Err(host_only(self));
        }
        // SAFETY: as for `copy_region_to_imported`, the other way; the host range is written
        // only by this copy until it is synchronized.
        let r = self.enqueue(|d, s| unsafe {
            d.copy_dtoh_async(dst.as_ptr().add(dst_offset as usize), src.ptr(), src.len, s)
        });
        self.finish(r)
    }
}

fn host_only(s: &CopyStream) -> CudaError {
    CudaError::Unavailable {
        library: s.device().cuda().library().to_owned(),
        reason: "a device region is copied to an opened IPC handle as device memory, not as a \
                 host region"
            .into(),
    }
}
