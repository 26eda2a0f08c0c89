//! The driver boundary: the narrow set of `libcuda.so.1` entry points Ferry calls, as the
//! [`Driver`] trait, and [`LibCuda`], its implementation by a table of function pointers resolved
//! with libloading.
//!
//! Why not cudarc: its loader searches a fixed list of file names (no path parameter), caches
//! the result process-wide and panics when none loads or a symbol is missing. A test could then
//! swap in a fake driver only through `LD_LIBRARY_PATH` at process start, for the whole process.
//! This table loads any path it is given, returns [`CudaError::Unavailable`] instead of
//! panicking, and treats the dma-buf export as optional (absent before CUDA 11.7).
//!
//! Oldest driver supported: CUDA 11.4 (the `_v2` memory entry points and
//! `cuDevicePrimaryCtxRelease_v2`); the dma-buf route needs 11.7 (`cuMemGetHandleForAddressRange`).

use std::ffi::{CStr, c_char, c_int, c_uint, c_ulonglong, c_void};
use std::fmt;
use std::os::fd::{FromRawFd, OwnedFd};
use std::sync::Arc;

use crate::CudaError;

/// A device handle as the driver numbers it (`CUdevice`).
pub type CuDevice = c_int;
/// A device address (`CUdeviceptr`).
pub type DevicePtr = u64;

/// A context handle (`CUcontext`), as an opaque integer so it is `Send`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CtxHandle(pub usize);

/// A stream handle (`CUstream`), as an opaque integer so it is `Send`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StreamHandle(pub usize);

/// What the driver says about a device address (`cuPointerGetAttribute`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PointerInfo {
    /// `CU_POINTER_ATTRIBUTE_MEMORY_TYPE`: 1 host, 2 device, 3 array, 4 unified.
    pub memory_type: u32,
    /// `CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL`.
    pub ordinal: i32,
    /// `CU_POINTER_ATTRIBUTE_RANGE_START_ADDR`: where the allocation holding it starts.
    pub start: DevicePtr,
    /// `CU_POINTER_ATTRIBUTE_RANGE_SIZE`: that allocation's length.
    pub size: u64,
}

/// `CU_MEMORYTYPE_DEVICE`.
pub const MEMORY_TYPE_DEVICE: u32 = 2;

const ATTR_MEMORY_TYPE: c_int = 2;
const ATTR_DEVICE_ORDINAL: c_int = 9;
const ATTR_RANGE_START_ADDR: c_int = 11;
const ATTR_RANGE_SIZE: c_int = 12;

/// `CU_STREAM_NON_BLOCKING`: the stream does not synchronize with the legacy default stream.
const STREAM_NON_BLOCKING: c_uint = 1;

/// `CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED`.
pub const ATTR_DMA_BUF_SUPPORTED: c_int = 124;
/// `CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD`.
const HANDLE_TYPE_DMA_BUF_FD: c_int = 1;

/// `CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS`: an opened handle of another device's memory enables
/// peer access when first needed.
const IPC_MEM_LAZY_ENABLE_PEER_ACCESS: c_uint = 1;

/// Bytes of a CUDA IPC memory handle (`CU_IPC_HANDLE_SIZE`).
pub const IPC_HANDLE_LEN: usize = 64;

/// A CUDA IPC memory handle (`CUipcMemHandle`): names one device allocation (by its base) of the
/// process that exported it, for another process to open. Opaque bytes; only the driver that
/// made it gives them a meaning, and it refuses ones it did not make.
#[repr(C)]
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct IpcMemHandle(pub [u8; IPC_HANDLE_LEN]);

impl fmt::Debug for IpcMemHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "IpcMemHandle(")?;
        for b in &self.0[..16] {
            write!(f, "{b:02x}")?;
        }
        write!(f, "..)")
    }
}

/// The driver entry points Ferry uses. Object safe, so that tests can put a driver backed by
/// host memory behind it; the production implementation is [`LibCuda`].
///
/// Every call that works on memory expects the caller to have made the device's context current
/// on the calling thread ([`set_current`](Self::set_current)).
pub trait Driver: Send + Sync + fmt::Debug + 'static {
    /// The library this driver was loaded from (soname or path).
    fn library(&self) -> &str;
    /// Whether the library is Ferry's fake driver for tests (it exports `ferry_fake_cuda`).
    fn is_fake(&self) -> bool;
    /// `cuDriverGetVersion`: the CUDA version as `1000 * major + 10 * minor`.
    fn version(&self) -> Result<i32, CudaError>;
    /// `cuInit(0)`.
    fn init(&self) -> Result<(), CudaError>;
    /// `cuDeviceGetCount`.
    fn device_count(&self) -> Result<i32, CudaError>;
    /// `cuDeviceGet`.
    fn device(&self, ordinal: i32) -> Result<CuDevice, CudaError>;
    /// `cuDeviceGetName`.
    fn device_name(&self, dev: CuDevice) -> Result<String, CudaError>;
    /// `cuDeviceGetPCIBusId`, lower-cased (`0000:17:00.0`, as sysfs spells it).
    fn pci_bus_id(&self, dev: CuDevice) -> Result<String, CudaError>;
    /// `cuDeviceTotalMem_v2`.
    fn total_mem(&self, dev: CuDevice) -> Result<u64, CudaError>;
    /// `cuDeviceGetAttribute`.
    fn attribute(&self, dev: CuDevice, attr: c_int) -> Result<i32, CudaError>;
    /// `cuDevicePrimaryCtxRetain`.
    fn primary_ctx_retain(&self, dev: CuDevice) -> Result<CtxHandle, CudaError>;
    /// `cuDevicePrimaryCtxRelease_v2`.
    fn primary_ctx_release(&self, dev: CuDevice) -> Result<(), CudaError>;
    /// `cuCtxSetCurrent`.
    fn set_current(&self, ctx: CtxHandle) -> Result<(), CudaError>;
    /// `cuMemAlloc_v2`.
    fn mem_alloc(&self, len: usize) -> Result<DevicePtr, CudaError>;
    /// `cuMemFree_v2`.
    fn mem_free(&self, ptr: DevicePtr) -> Result<(), CudaError>;
    /// `cuMemAllocHost_v2`: page-locked host memory.
    fn host_alloc(&self, len: usize) -> Result<*mut u8, CudaError>;
    /// `cuMemFreeHost`.
    ///
    /// # Safety
    /// `ptr` came from [`host_alloc`](Self::host_alloc) of this driver and is freed once.
    unsafe fn host_free(&self, ptr: *mut u8) -> Result<(), CudaError>;
    /// `cuMemcpyHtoD_v2`.
    ///
    /// # Safety
    /// `src..src+len` is readable host memory; `dst..dst+len` lies in one device allocation.
    unsafe fn copy_htod(&self, dst: DevicePtr, src: *const u8, len: usize)
    -> Result<(), CudaError>;
    /// `cuMemcpyDtoH_v2`.
    ///
    /// # Safety
    /// `dst..dst+len` is writable host memory; `src..src+len` lies in one device allocation.
    unsafe fn copy_dtoh(&self, dst: *mut u8, src: DevicePtr, len: usize) -> Result<(), CudaError>;
    /// `cuStreamCreate(.., CU_STREAM_NON_BLOCKING)`: a stream in the current context that does
    /// not wait for work on the legacy default stream.
    fn stream_create(&self) -> Result<StreamHandle, CudaError>;
    /// `cuStreamDestroy_v2`.
    fn stream_destroy(&self, stream: StreamHandle) -> Result<(), CudaError>;
    /// `cuStreamSynchronize`: waits until every copy enqueued on `stream` finished.
    fn stream_synchronize(&self, stream: StreamHandle) -> Result<(), CudaError>;
    /// `cuMemcpyHtoDAsync_v2`: enqueues a copy on `stream`.
    ///
    /// # Safety
    /// As for [`copy_htod`](Self::copy_htod), and both ranges stay valid and untouched by
    /// anything else until `stream` is synchronized.
    unsafe fn copy_htod_async(
        &self,
        dst: DevicePtr,
        src: *const u8,
        len: usize,
        stream: StreamHandle,
    ) -> Result<(), CudaError>;
    /// `cuMemcpyDtoHAsync_v2`: enqueues a copy on `stream`.
    ///
    /// # Safety
    /// As for [`copy_dtoh`](Self::copy_dtoh), and both ranges stay valid and untouched by
    /// anything else until `stream` is synchronized.
    unsafe fn copy_dtoh_async(
        &self,
        dst: *mut u8,
        src: DevicePtr,
        len: usize,
        stream: StreamHandle,
    ) -> Result<(), CudaError>;
    /// `cuPointerGetAttribute` of the memory type, device ordinal and allocation range of
    /// `ptr` (an address the driver does not know is an error, `CUDA_ERROR_INVALID_VALUE`).
    fn pointer_info(&self, ptr: DevicePtr) -> Result<PointerInfo, CudaError>;
    /// Whether `cuMemGetHandleForAddressRange` (dma-buf export) is exported.
    fn has_dmabuf_export(&self) -> bool;
    /// `cuMemGetHandleForAddressRange(.., CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD, 0)`: a dma-buf
    /// file descriptor for `ptr..ptr+len` (`Unavailable` when the export is missing).
    fn dmabuf_export(&self, ptr: DevicePtr, len: usize) -> Result<OwnedFd, CudaError>;
    /// Whether the CUDA IPC entry points (`cuIpcGetMemHandle`, `cuIpcOpenMemHandle_v2`,
    /// `cuIpcCloseMemHandle`, `cuMemGetAddressRange_v2`, `cuMemcpyDtoDAsync_v2`) are all
    /// exported.
    fn has_ipc(&self) -> bool;
    /// `cuMemGetAddressRange_v2`: the base and size of the allocation holding `ptr`.
    fn address_range(&self, ptr: DevicePtr) -> Result<(DevicePtr, u64), CudaError>;
    /// `cuIpcGetMemHandle`: a handle of the allocation whose base is `base` (the driver refuses
    /// an address inside one).
    fn ipc_get_handle(&self, base: DevicePtr) -> Result<IpcMemHandle, CudaError>;
    /// `cuIpcOpenMemHandle_v2(.., CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS)`: maps another process's
    /// allocation into the current context; the base address it got here. Each open is
    /// closed once by [`ipc_close_handle`](Self::ipc_close_handle).
    fn ipc_open_handle(&self, handle: &IpcMemHandle) -> Result<DevicePtr, CudaError>;
    /// `cuIpcCloseMemHandle`: unmaps what [`ipc_open_handle`](Self::ipc_open_handle) returned.
    fn ipc_close_handle(&self, base: DevicePtr) -> Result<(), CudaError>;
    /// `cuMemcpyDtoDAsync_v2`: enqueues a device-to-device copy on `stream`.
    ///
    /// # Safety
    /// Both ranges lie in live device allocations (or opened IPC handles) and stay so, untouched
    /// by anything else, until `stream` is synchronized.
    unsafe fn copy_dtod_async(
        &self,
        dst: DevicePtr,
        src: DevicePtr,
        len: usize,
        stream: StreamHandle,
    ) -> Result<(), CudaError>;
}

type FnInit = unsafe extern "C" fn(c_uint) -> c_int;
type FnIntOut = unsafe extern "C" fn(*mut c_int) -> c_int;
type FnDeviceGet = unsafe extern "C" fn(*mut CuDevice, c_int) -> c_int;
type FnDeviceStr = unsafe extern "C" fn(*mut c_char, c_int, CuDevice) -> c_int;
type FnTotalMem = unsafe extern "C" fn(*mut usize, CuDevice) -> c_int;
type FnAttribute = unsafe extern "C" fn(*mut c_int, c_int, CuDevice) -> c_int;
type FnCtxRetain = unsafe extern "C" fn(*mut *mut c_void, CuDevice) -> c_int;
type FnCtxRelease = unsafe extern "C" fn(CuDevice) -> c_int;
type FnSetCurrent = unsafe extern "C" fn(*mut c_void) -> c_int;
type FnMemAlloc = unsafe extern "C" fn(*mut DevicePtr, usize) -> c_int;
type FnMemFree = unsafe extern "C" fn(DevicePtr) -> c_int;
type FnHostAlloc = unsafe extern "C" fn(*mut *mut c_void, usize) -> c_int;
type FnHostFree = unsafe extern "C" fn(*mut c_void) -> c_int;
type FnHtoD = unsafe extern "C" fn(DevicePtr, *const c_void, usize) -> c_int;
type FnDtoH = unsafe extern "C" fn(*mut c_void, DevicePtr, usize) -> c_int;
type FnStreamCreate = unsafe extern "C" fn(*mut *mut c_void, c_uint) -> c_int;
type FnStream = unsafe extern "C" fn(*mut c_void) -> c_int;
type FnHtoDAsync = unsafe extern "C" fn(DevicePtr, *const c_void, usize, *mut c_void) -> c_int;
type FnDtoHAsync = unsafe extern "C" fn(*mut c_void, DevicePtr, usize, *mut c_void) -> c_int;
type FnPointerAttr = unsafe extern "C" fn(*mut c_void, c_int, DevicePtr) -> c_int;
type FnGetHandle = unsafe extern "C" fn(*mut c_void, DevicePtr, usize, c_int, c_ulonglong) -> c_int;
type FnErrorName = unsafe extern "C" fn(c_int, *mut *const c_char) -> c_int;
type FnAddressRange = unsafe extern "C" fn(*mut DevicePtr, *mut usize, DevicePtr) -> c_int;
type FnIpcGet = unsafe extern "C" fn(*mut IpcMemHandle, DevicePtr) -> c_int;
type FnIpcOpen = unsafe extern "C" fn(*mut DevicePtr, IpcMemHandle, c_uint) -> c_int;
type FnIpcClose = unsafe extern "C" fn(DevicePtr) -> c_int;
type FnDtoDAsync = unsafe extern "C" fn(DevicePtr, DevicePtr, usize, *mut c_void) -> c_int;

/// The CUDA IPC entry points, all or none.
#[derive(Clone, Copy)]
struct IpcFns {
    address_range: FnAddressRange,
    get: FnIpcGet,
    open: FnIpcOpen,
    close: FnIpcClose,
    dtod_async: FnDtoDAsync,
}

/// The resolved entry points. Plain function pointers: valid while `LibCuda::_lib` lives.
struct Fns {
    init: FnInit,
    version: FnIntOut,
    device_count: FnIntOut,
    device_get: FnDeviceGet,
    device_name: FnDeviceStr,
    pci_bus_id: FnDeviceStr,
    total_mem: FnTotalMem,
    attribute: FnAttribute,
    ctx_retain: FnCtxRetain,
    ctx_release: FnCtxRelease,
    set_current: FnSetCurrent,
    mem_alloc: FnMemAlloc,
    mem_free: FnMemFree,
    host_alloc: FnHostAlloc,
    host_free: FnHostFree,
    htod: FnHtoD,
    dtoh: FnDtoH,
    stream_create: FnStreamCreate,
    stream_destroy: FnStream,
    stream_sync: FnStream,
    htod_async: FnHtoDAsync,
    dtoh_async: FnDtoHAsync,
    pointer_attr: FnPointerAttr,
    get_handle: Option<FnGetHandle>,
    error_name: Option<FnErrorName>,
    ipc: Option<IpcFns>,
}

/// The CUDA driver loaded from a shared library (the system's `libcuda.so.1`, or a path).
pub struct LibCuda {
    name: String,
    fake: bool,
    f: Fns,
    // Last: the function pointers above are only valid while the library stays loaded.
    _lib: Arc<libloading::Library>,
}

impl fmt::Debug for LibCuda {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LibCuda")
            .field("library", &self.name)
            .field("fake", &self.fake)
            .field("dmabuf_export", &self.f.get_handle.is_some())
            .field("ipc", &self.f.ipc.is_some())
            .finish()
    }
}

impl LibCuda {
    /// Loads the driver from `name` (a soname searched by the dynamic loader, or a path). A
    /// library that does not load, or lacks a required entry point, is
    /// `Unavailable("<name>: <loader's reason>")`; nothing panics.
    pub fn load(name: &std::ffi::OsStr) -> Result<Self, CudaError> {
        let lib = crate::open(name)?;
        let library = name.to_string_lossy().into_owned();
        macro_rules! req {
            ($sym:literal) => {{
                // SAFETY: the type alias at the use site is the entry point's signature in
                // cuda.h (CUDA 11.4 and later); the pointer is used only while `lib` lives.
                let s = unsafe { lib.get(concat!($sym, "\0").as_bytes()) }.map_err(|e| {
                    CudaError::Unavailable {
                        library: library.clone(),
                        reason: format!("missing export {} ({})", $sym, crate::loader_reason(&e)),
                    }
                })?;
                *s
            }};
        }
        macro_rules! opt {
            ($sym:literal) => {{
                // SAFETY: as for required entry points.
                unsafe { lib.get(concat!($sym, "\0").as_bytes()) }
                    .ok()
                    .map(|s| *s)
            }};
        }
        let f = Fns {
            init: req!("cuInit"),
            version: req!("cuDriverGetVersion"),
            device_count: req!("cuDeviceGetCount"),
            device_get: req!("cuDeviceGet"),
            device_name: req!("cuDeviceGetName"),
            pci_bus_id: req!("cuDeviceGetPCIBusId"),
            total_mem: req!("cuDeviceTotalMem_v2"),
            attribute: req!("cuDeviceGetAttribute"),
            ctx_retain: req!("cuDevicePrimaryCtxRetain"),
            ctx_release: req!("cuDevicePrimaryCtxRelease_v2"),
            set_current: req!("cuCtxSetCurrent"),
            mem_alloc: req!("cuMemAlloc_v2"),
            mem_free: req!("cuMemFree_v2"),
            host_alloc: req!("cuMemAllocHost_v2"),
            host_free: req!("cuMemFreeHost"),
            htod: req!("cuMemcpyHtoD_v2"),
            dtoh: req!("cuMemcpyDtoH_v2"),
            stream_create: req!("cuStreamCreate"),
            stream_destroy: req!("cuStreamDestroy_v2"),
            stream_sync: req!("cuStreamSynchronize"),
            htod_async: req!("cuMemcpyHtoDAsync_v2"),
            dtoh_async: req!("cuMemcpyDtoHAsync_v2"),
            pointer_attr: req!("cuPointerGetAttribute"),
            get_handle: opt!("cuMemGetHandleForAddressRange"),
            error_name: opt!("cuGetErrorName"),
            // cuda.h maps cuIpcOpenMemHandle to its `_v2` since CUDA 11; older drivers export
            // only the first (same signature).
            ipc: (|| {
                let open: Option<FnIpcOpen> =
                    opt!("cuIpcOpenMemHandle_v2").or_else(|| opt!("cuIpcOpenMemHandle"));
                Some(IpcFns {
                    address_range: opt!("cuMemGetAddressRange_v2")?,
                    get: opt!("cuIpcGetMemHandle")?,
                    open: open?,
                    close: opt!("cuIpcCloseMemHandle")?,
                    dtod_async: opt!("cuMemcpyDtoDAsync_v2")?,
                })
            })(),
        };
        let fake = crate::has_symbol(&lib, b"ferry_fake_cuda\0");
        if fake {
            tracing::warn!(library, "loaded Ferry's FAKE CUDA driver (tests only)");
        }
        Ok(Self {
            name: library,
            fake,
            f,
            _lib: Arc::new(lib),
        })
    }

    fn check(&self, call: &'static str, code: c_int) -> Result<(), CudaError> {
        if code == 0 {
            return Ok(());
        }
        let name = self.f.error_name.and_then(|f| {
            let mut p: *const c_char = std::ptr::null();
            // SAFETY: `cuGetErrorName` writes a pointer to a static string (or leaves it null).
            let rc = unsafe { f(code, &mut p) };
            // SAFETY: on success `p` points to a NUL-terminated static string owned by the driver.
            (rc == 0 && !p.is_null())
                .then(|| unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
        });
        Err(CudaError::Call {
            library: self.name.clone(),
            call,
            code,
            name: name.unwrap_or_default(),
        })
    }

    /// The IPC entry points, or `Unavailable` naming what `call` needed.
    fn ipc(&self, call: &str) -> Result<IpcFns, CudaError> {
        self.f.ipc.ok_or_else(|| CudaError::Unavailable {
            library: self.name.clone(),
            reason: format!(
                "{call}: the driver lacks a CUDA IPC entry point (cuIpcGetMemHandle, \
                 cuIpcOpenMemHandle, cuIpcCloseMemHandle, cuMemGetAddressRange_v2 or \
                 cuMemcpyDtoDAsync_v2)"
            ),
        })
    }

    fn string(
        &self,
        call: &'static str,
        f: FnDeviceStr,
        dev: CuDevice,
    ) -> Result<String, CudaError> {
        let mut buf = [0 as c_char; 256];
        // SAFETY: `buf` is writable for its whole length, which is what we pass.
        let rc = unsafe { f(buf.as_mut_ptr(), buf.len() as c_int, dev) };
        self.check(call, rc)?;
        buf[buf.len() - 1] = 0;
        // SAFETY: the driver wrote a NUL-terminated string into `buf`, and its last byte is NUL.
        Ok(unsafe { CStr::from_ptr(buf.as_ptr()) }
            .to_string_lossy()
            .into_owned())
    }
}

impl Driver for LibCuda {
    fn library(&self) -> &str {
        &self.name
    }

    fn is_fake(&self) -> bool {
        self.fake
    }

    fn version(&self) -> Result<i32, CudaError> {
        let mut v = 0;
        // SAFETY: the pointer refers to a live c_int that the call only writes.
        let rc = unsafe { (self.f.version)(&mut v) };
        self.check("cuDriverGetVersion", rc).map(|_| v)
    }

    fn init(&self) -> Result<(), CudaError> {
        // SAFETY: cuInit takes flags by value (must be 0).
        let rc = unsafe { (self.f.init)(0) };
        self.check("cuInit", rc)
    }

    fn device_count(&self) -> Result<i32, CudaError> {
        let mut n = 0;
        // SAFETY: as for `version`.
        let rc = unsafe { (self.f.device_count)(&mut n) };
        self.check("cuDeviceGetCount", rc).map(|_| n)
    }

    fn device(&self, ordinal: i32) -> Result<CuDevice, CudaError> {
        let mut d = 0;
        // SAFETY: as for `version`.
        let rc = unsafe { (self.f.device_get)(&mut d, ordinal) };
        self.check("cuDeviceGet", rc).map(|_| d)
    }

    fn device_name(&self, dev: CuDevice) -> Result<String, CudaError> {
        self.string("cuDeviceGetName", self.f.device_name, dev)
    }

    fn pci_bus_id(&self, dev: CuDevice) -> Result<String, CudaError> {
        self.string("cuDeviceGetPCIBusId", self.f.pci_bus_id, dev)
            .map(|s| s.to_ascii_lowercase())
    }

    fn total_mem(&self, dev: CuDevice) -> Result<u64, CudaError> {
        let mut n = 0usize;
        // SAFETY: as for `version`.
        let rc = unsafe { (self.f.total_mem)(&mut n, dev) };
        self.check("cuDeviceTotalMem_v2", rc).map(|_| n as u64)
    }

    fn attribute(&self, dev: CuDevice, attr: c_int) -> Result<i32, CudaError> {
        let mut v = 0;
        // SAFETY: as for `version`.
        let rc = unsafe { (self.f.attribute)(&mut v, attr, dev) };
        self.check("cuDeviceGetAttribute", rc).map(|_| v)
    }

    fn primary_ctx_retain(&self, dev: CuDevice) -> Result<CtxHandle, CudaError> {
        let mut ctx: *mut c_void = std::ptr::null_mut();
        // SAFETY: the pointer refers to a live pointer-sized slot that the call only writes.
        let rc = unsafe { (self.f.ctx_retain)(&mut ctx, dev) };
        self.check("cuDevicePrimaryCtxRetain", rc)
            .map(|_| CtxHandle(ctx as usize))
    }

    fn primary_ctx_release(&self, dev: CuDevice) -> Result<(), CudaError> {
        // SAFETY: takes the device by value; releases one retain made by `primary_ctx_retain`.
        let rc = unsafe { (self.f.ctx_release)(dev) };
        self.check("cuDevicePrimaryCtxRelease_v2", rc)
    }

    fn set_current(&self, ctx: CtxHandle) -> Result<(), CudaError> {
        // SAFETY: `ctx` is a context handle the driver returned (a retained primary context).
        let rc = unsafe { (self.f.set_current)(ctx.0 as *mut c_void) };
        self.check("cuCtxSetCurrent", rc)
    }

    fn mem_alloc(&self, len: usize) -> Result<DevicePtr, CudaError> {
        let mut p: DevicePtr = 0;
        // SAFETY: as for `version`.
        let rc = unsafe { (self.f.mem_alloc)(&mut p, len) };
        self.check("cuMemAlloc_v2", rc).map(|_| p)
    }

    fn mem_free(&self, ptr: DevicePtr) -> Result<(), CudaError> {
        // SAFETY: the caller frees a pointer from `mem_alloc` once (DeviceMemory's Drop).
        let rc = unsafe { (self.f.mem_free)(ptr) };
        self.check("cuMemFree_v2", rc)
    }

    fn host_alloc(&self, len: usize) -> Result<*mut u8, CudaError> {
        let mut p: *mut c_void = std::ptr::null_mut();
        // SAFETY: as for `primary_ctx_retain`.
        let rc = unsafe { (self.f.host_alloc)(&mut p, len) };
        self.check("cuMemAllocHost_v2", rc).map(|_| p.cast())
    }

    unsafe fn host_free(&self, ptr: *mut u8) -> Result<(), CudaError> {
        // SAFETY: the caller guarantees `ptr` came from `host_alloc` and is freed once.
        let rc = unsafe { (self.f.host_free)(ptr.cast()) };
        self.check("cuMemFreeHost", rc)
    }

    unsafe fn copy_htod(
        &self,
        dst: DevicePtr,
        src: *const u8,
        len: usize,
    ) -> Result<(), CudaError> {
        // SAFETY: the caller guarantees both ranges (see the trait's contract).
        let rc = unsafe { (self.f.htod)(dst, src.cast(), len) };
        self.check("cuMemcpyHtoD_v2", rc)
    }

    unsafe fn copy_dtoh(&self, dst: *mut u8, src: DevicePtr, len: usize) -> Result<(), CudaError> {
        // SAFETY: the caller guarantees both ranges (see the trait's contract).
        let rc = unsafe { (self.f.dtoh)(dst.cast(), src, len) };
        self.check("cuMemcpyDtoH_v2", rc)
    }

    fn stream_create(&self) -> Result<StreamHandle, CudaError> {
        let mut s: *mut c_void = std::ptr::null_mut();
        // SAFETY: the call writes one stream handle into `s`.
        let rc = unsafe { (self.f.stream_create)(&mut s, STREAM_NON_BLOCKING) };
        self.check("cuStreamCreate", rc)
            .map(|_| StreamHandle(s as usize))
    }

    fn stream_destroy(&self, stream: StreamHandle) -> Result<(), CudaError> {
        // SAFETY: the caller destroys a handle from `stream_create` once (CopyStream's Drop).
        let rc = unsafe { (self.f.stream_destroy)(stream.0 as *mut c_void) };
        self.check("cuStreamDestroy_v2", rc)
    }

    fn stream_synchronize(&self, stream: StreamHandle) -> Result<(), CudaError> {
        // SAFETY: `stream` is a live handle from `stream_create`.
        let rc = unsafe { (self.f.stream_sync)(stream.0 as *mut c_void) };
        self.check("cuStreamSynchronize", rc)
    }

    unsafe fn copy_htod_async(
        &self,
        dst: DevicePtr,
        src: *const u8,
        len: usize,
        stream: StreamHandle,
    ) -> Result<(), CudaError> {
        // SAFETY: the caller guarantees both ranges until the stream is synchronized.
        let rc = unsafe { (self.f.htod_async)(dst, src.cast(), len, stream.0 as *mut c_void) };
        self.check("cuMemcpyHtoDAsync_v2", rc)
    }

    unsafe fn copy_dtoh_async(
        &self,
        dst: *mut u8,
        src: DevicePtr,
        len: usize,
        stream: StreamHandle,
    ) -> Result<(), CudaError> {
        // SAFETY: the caller guarantees both ranges until the stream is synchronized.
        let rc = unsafe { (self.f.dtoh_async)(dst.cast(), src, len, stream.0 as *mut c_void) };
        self.check("cuMemcpyDtoHAsync_v2", rc)
    }

    fn pointer_info(&self, ptr: DevicePtr) -> Result<PointerInfo, CudaError> {
        let mut memory_type: c_uint = 0;
        let mut ordinal: c_int = -1;
        let mut start: DevicePtr = 0;
        let mut size: usize = 0;
        for (attr, out) in [
            (
                ATTR_MEMORY_TYPE,
                (&mut memory_type as *mut c_uint).cast::<c_void>(),
            ),
            (ATTR_DEVICE_ORDINAL, (&mut ordinal as *mut c_int).cast()),
            (ATTR_RANGE_START_ADDR, (&mut start as *mut DevicePtr).cast()),
            (ATTR_RANGE_SIZE, (&mut size as *mut usize).cast()),
        ] {
            // SAFETY: each attribute writes one value of the type `out` points to (cuda.h:
            // unsigned int, int, CUdeviceptr, size_t), which lives across the call.
            let rc = unsafe { (self.f.pointer_attr)(out, attr, ptr) };
            self.check("cuPointerGetAttribute", rc)?;
        }
        Ok(PointerInfo {
            memory_type,
            ordinal,
            start,
            size: size as u64,
        })
    }

    fn has_dmabuf_export(&self) -> bool {
        self.f.get_handle.is_some()
    }

    fn dmabuf_export(&self, ptr: DevicePtr, len: usize) -> Result<OwnedFd, CudaError> {
        let Some(f) = self.f.get_handle else {
            return Err(CudaError::Unavailable {
                library: self.name.clone(),
                reason: "missing export cuMemGetHandleForAddressRange (dma-buf export needs \
                         a CUDA 11.7+ driver)"
                    .into(),
            });
        };
        let mut fd: c_int = -1;
        // SAFETY: for the dma-buf handle type the handle is an int the call writes; the range
        // is the caller's device allocation.
        let rc = unsafe {
            f(
                (&mut fd as *mut c_int).cast(),
                ptr,
                len,
                HANDLE_TYPE_DMA_BUF_FD,
                0,
            )
        };
        self.check("cuMemGetHandleForAddressRange", rc)?;
        if fd < 0 {
            return Err(CudaError::Call {
                library: self.name.clone(),
                call: "cuMemGetHandleForAddressRange",
                code: 0,
                name: format!("returned fd {fd}"),
            });
        }
        // SAFETY: on success the driver handed us a new dma-buf fd that nothing else owns.
        Ok(unsafe { OwnedFd::from_raw_fd(fd) })
    }

    fn has_ipc(&self) -> bool {
        self.f.ipc.is_some()
    }

    fn address_range(&self, ptr: DevicePtr) -> Result<(DevicePtr, u64), CudaError> {
        let f = self.ipc("cuMemGetAddressRange_v2")?;
        let mut base: DevicePtr = 0;
        let mut size: usize = 0;
        // SAFETY: both out-pointers refer to live locals of the types cuda.h names
        // (CUdeviceptr, size_t) that the call only writes.
        let rc = unsafe { (f.address_range)(&mut base, &mut size, ptr) };
        self.check("cuMemGetAddressRange_v2", rc)
            .map(|_| (base, size as u64))
    }

    fn ipc_get_handle(&self, base: DevicePtr) -> Result<IpcMemHandle, CudaError> {
        let f = self.ipc("cuIpcGetMemHandle")?;
        let mut h = IpcMemHandle([0; IPC_HANDLE_LEN]);
        // SAFETY: `h` is a live, writable CUipcMemHandle (64 bytes, repr(C)) the call fills.
        let rc = unsafe { (f.get)(&mut h, base) };
        self.check("cuIpcGetMemHandle", rc).map(|_| h)
    }

    fn ipc_open_handle(&self, handle: &IpcMemHandle) -> Result<DevicePtr, CudaError> {
        let f = self.ipc("cuIpcOpenMemHandle_v2")?;
        let mut p: DevicePtr = 0;
        // SAFETY: the handle goes by value as the C struct (repr(C), 64 bytes); the call writes
        // one CUdeviceptr into `p`. A handle the driver did not make is refused by it.
        let rc = unsafe { (f.open)(&mut p, *handle, IPC_MEM_LAZY_ENABLE_PEER_ACCESS) };
        self.check("cuIpcOpenMemHandle_v2", rc).map(|_| p)
    }

    fn ipc_close_handle(&self, base: DevicePtr) -> Result<(), CudaError> {
        let f = self.ipc("cuIpcCloseMemHandle")?;
        // SAFETY: the caller closes a pointer `ipc_open_handle` returned, once per open.
        let rc = unsafe { (f.close)(base) };
        self.check("cuIpcCloseMemHandle", rc)
    }

    unsafe fn copy_dtod_async(
        &self,
        dst: DevicePtr,
        src: DevicePtr,
        len: usize,
        stream: StreamHandle,
    ) -> Result<(), CudaError> {
        let f = self.ipc("cuMemcpyDtoDAsync_v2")?;
        // SAFETY: the caller guarantees both ranges until the stream is synchronized.
        let rc = unsafe { (f.dtod_async)(dst, src, len, stream.0 as *mut c_void) };
        self.check("cuMemcpyDtoDAsync_v2", rc)
    }
}
