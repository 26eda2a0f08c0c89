//! GPU memory: `Engine.alloc_gpu`, `Engine.register_gpu` and the `GpuRegistration` they give.
//!
//! Both wrap the facade's GPU registration ([`ferry::GpuRegistration`]): device memory the
//! engine stages through pinned host buffers over TCP and io_uring (and reaches by GPUDirect over
//! RDMA where a route exists), published to peers when its access grants them anything. Device
//! memory has no host address, so nothing here ever dereferences it: bytes move by the driver's
//! copies only (`copy_from`, `to_bytes`, the staging pipeline).
//!
//! Memory someone else owns comes in through the CUDA Array Interface (version 2 or 3, what
//! PyTorch, CuPy and Numba export): [`interface`] checks it, and the exporting object becomes
//! the owner of the wrapped [`DeviceMemory`], so it stays alive until the memory is no longer
//! used. Its last reference may go on a thread not attached to the interpreter (a staging lane,
//! a runtime worker); dropping a `Py` there only queues the decref (PyO3's reference pool), as
//! for host registrations (see `buffer`).
//!
//! The driver is the engine's: the system's `libcuda.so.1` (or the file `FERRY_LIBCUDA` names),
//! loaded by each engine on its first GPU call; without one every GPU call raises `Unavailable`
//! with the loader's reason.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, PoisonError};

use ferry::cuda::{CudaError, DeviceMemory};
use ferry::{Access, TransferEngine};
use pyo3::buffer::PyUntypedBuffer;
use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyTuple};

use crate::args::{access_name, non_negative, parse_access};
use crate::errors::{self, Kind};
use crate::runtime;

/// Names GPU registrations that were given none.
static UNNAMED: AtomicU64 = AtomicU64::new(0);

/// A driver error as the Python exception of its kind: `Unavailable` without a driver,
/// `OutOfBounds` for a range outside the memory, `InvalidRequest` (a `ValueError`) for a device
/// ordinal the driver does not list or memory the driver does not place as device memory, `FerryError` for a failed driver call.
pub(crate) fn cuda_err(py: Python<'_>, e: CudaError) -> PyErr {
    let kind = match &e {
        CudaError::Unavailable { .. } => Kind::Unavailable,
        CudaError::OutOfBounds(_) => Kind::OutOfBounds,
        CudaError::NoDevice { .. } | CudaError::NotDeviceMemory { .. } => Kind::InvalidRequest,
        _ => Kind::FerryError,
    };
    errors::err(py, kind, e.to_string())
}

/// The name of `obj`'s type, for error messages.
fn type_name(obj: &Bound<'_, PyAny>) -> String {
    obj.get_type()
        .name()
        .map(|n| n.to_string())
        .unwrap_or_else(|_| "?".into())
}

/// What a CUDA Array Interface describes, checked.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Interface {
    /// The device address of the first byte.
    pub(crate) ptr: u64,
    /// Its length in bytes (`product(shape) * itemsize`).
    pub(crate) len: usize,
    /// Whether the exporter marks it read-only.
    pub(crate) readonly: bool,
}

/// The item size of an array-interface `typestr` (`"<f4"`, `"|u1"`, `">c16"`, `"<V8"`), or why
/// it is refused. Byte order does not matter to Ferry (it moves bytes); object arrays (`O`) and
/// anything unparsable are refused.
fn itemsize(typestr: &str) -> Result<usize, String> {
    let mut chars = typestr.chars();
    let (Some(order), Some(kind)) = (chars.next(), chars.next()) else {
        return Err(format!("typestr {typestr:?} is too short"));
    };
    if !matches!(order, '<' | '>' | '|' | '=') {
        return Err(format!(
            "typestr {typestr:?} does not start with a byte order ('<', '>', '|' or '=')"
        ));
    }
    if !matches!(kind, 'b' | 'i' | 'u' | 'f' | 'c' | 'm' | 'M' | 'V') {
        return Err(format!(
            "typestr {typestr:?} has kind {kind:?}, which is not plain data (b, i, u, f, c, m, \
             M or V)"
        ));
    }
    match chars.as_str().parse::<usize>() {
        Ok(n) if n > 0 => Ok(n),
        _ => Err(format!(
            "typestr {typestr:?} has no item size in bytes after its kind"
        )),
    }
}

/// Reads and checks `obj.__cuda_array_interface__`: a dict with `shape`, `typestr`, `data`
/// (`(ptr, readonly)`) and optionally `strides` (None or C-contiguous), `mask` (None) and
/// `version`. Errors: `TypeError` when `obj` has no interface (or it is not a dict),
/// `ValueError` for a strided, masked, empty or unparsable one.
pub(crate) fn interface(obj: &Bound<'_, PyAny>) -> PyResult<Interface> {
    let ty = type_name(obj);
    let cai = obj.getattr("__cuda_array_interface__").map_err(|e| {
        PyTypeError::new_err(format!(
            "register_gpu() needs an object with __cuda_array_interface__ (a PyTorch CUDA \
             tensor, a CuPy array, a Numba device array), not {ty}: {e}"
        ))
    })?;
    let cai = cai.cast_into::<PyDict>().map_err(|e| {
        PyTypeError::new_err(format!(
            "the __cuda_array_interface__ of this {ty} is not a dict: {e}"
        ))
    })?;
    let bad = |what: String| errors::invalid_argument(format!("register_gpu(): {ty}: {what}"));
    let item = |key: &str| -> PyResult<Bound<'_, PyAny>> {
        cai.get_item(key)?
            .ok_or_else(|| bad(format!("its __cuda_array_interface__ has no {key:?} entry")))
    };
    let shape: Vec<usize> = item("shape")?
        .extract()
        .map_err(|e| bad(format!("shape must be a tuple of non-negative ints: {e}")))?;
    let typestr: String = item("typestr")?
        .extract()
        .map_err(|e| bad(format!("typestr must be a str: {e}")))?;
    let size = itemsize(&typestr).map_err(|e| bad(format!("unknown typestr: {e}")))?;
    let (ptr, readonly): (u64, bool) = item("data")?
        .extract()
        .map_err(|e| bad(format!("data must be a tuple (pointer, readonly): {e}")))?;
    if let Some(mask) = cai.get_item("mask")?
        && !mask.is_none()
    {
        return Err(bad("masked arrays cannot be registered".into()));
    }
    let count = shape
        .iter()
        .try_fold(1usize, |acc, &d| acc.checked_mul(d))
        .ok_or_else(|| bad(format!("shape {shape:?} overflows")))?;
    let len = count
        .checked_mul(size)
        .ok_or_else(|| bad(format!("shape {shape:?} of {size}-byte items overflows")))?;
    if len == 0 {
        return Err(bad(format!(
            "it is empty (shape {shape:?}); there is nothing to register"
        )));
    }
    if ptr == 0 {
        return Err(bad("its data pointer is null".into()));
    }
    if let Some(strides) = cai.get_item("strides")?
        && !strides.is_none()
    {
        let strides: Vec<i64> = strides
            .extract()
            .map_err(|e| bad(format!("strides must be None or a tuple of ints: {e}")))?;
        if !c_contiguous(&shape, &strides, size) {
            return Err(bad(format!(
                "it is not contiguous (shape {shape:?}, strides {strides:?}, {size}-byte items); \
                 register a contiguous copy (tensor.contiguous(), cupy.ascontiguousarray)"
            )));
        }
    }
    ptr.checked_add(len as u64)
        .ok_or_else(|| bad(format!("{ptr:#x} + {len} bytes overflows")))?;
    Ok(Interface { ptr, len, readonly })
}

/// Whether `strides` (in bytes) lay `shape` out in C order with no gaps; dimensions of extent 1
/// may have any stride.
fn c_contiguous(shape: &[usize], strides: &[i64], itemsize: usize) -> bool {
    if shape.len() != strides.len() {
        return false;
    }
    let mut expect = itemsize as i64;
    for (&d, &s) in shape.iter().zip(strides).rev() {
        if d != 1 && s != expect {
            return false;
        }
        expect = expect.saturating_mul(d as i64);
    }
    true
}

/// The device ordinal claimed for `obj`: `device` when given, else `obj.device.index` (a
/// PyTorch CUDA tensor's), else `obj.device.id` (a CuPy array's), else none.
fn claimed_ordinal(obj: &Bound<'_, PyAny>, device: Option<i64>) -> PyResult<Option<u32>> {
    let from_obj = || -> Option<i64> {
        let dev = obj.getattr("device").ok()?;
        ["index", "id"]
            .iter()
            .find_map(|a| dev.getattr(*a).ok()?.extract::<i64>().ok())
    };
    device
        .or_else(from_obj)
        .map(|d| {
            u32::try_from(d)
                .map_err(|_| errors::invalid_argument(format!("device must be >= 0, not {d}")))
        })
        .transpose()
}

/// Registers `memory` with `engine` (GIL released, on the runtime) and makes the Python handle.
fn registration(
    py: Python<'_>,
    engine: &TransferEngine,
    memory: DeviceMemory,
    access: Access,
    name: String,
    readonly: bool,
) -> PyResult<GpuRegistration> {
    let rt = runtime::get(py)?;
    let memory = Arc::new(memory);
    let reg = runtime::detach(py, || {
        let _enter = rt.enter();
        engine.register_gpu(memory.clone(), access, &name)
    })?
    .map_err(|e| errors::to_py(py, e))?;
    let route = reg.route();
    Ok(GpuRegistration {
        len: memory.len() as u64,
        device: memory.location().ordinal,
        pci_bus_id: memory.location().pci_bus_id.clone(),
        ptr: memory.device_ptr(),
        token: reg.token().to_string(),
        route: route.route.to_string(),
        why: route.why.clone(),
        name,
        access,
        readonly,
        memory,
        inner: crate::handles::held(reg),
    })
}

/// `Engine.alloc_gpu`: allocates `size` bytes on GPU `device` and registers them.
pub(crate) fn alloc(
    py: Python<'_>,
    engine: &TransferEngine,
    device: i64,
    size: i64,
    name: Option<String>,
    access: &str,
) -> PyResult<GpuRegistration> {
    let access = parse_access(access)?;
    let ordinal = u32::try_from(device)
        .map_err(|_| errors::invalid_argument(format!("device must be >= 0, not {device}")))?;
    let size = usize::try_from(size)
        .ok()
        .filter(|&n| n > 0)
        .ok_or_else(|| {
            errors::invalid_argument(format!("size must be at least 1 byte, not {size}"))
        })?;
    let name = name.unwrap_or_else(|| format!("gpu-{}", UNNAMED.fetch_add(1, Ordering::Relaxed)));
    let cuda = engine.cuda().map_err(|e| errors::to_py(py, e))?;
    let memory = runtime::detach(py, || cuda.device(ordinal).and_then(|d| d.alloc(size)))?
        .map_err(|e| cuda_err(py, e))?;
    registration(py, engine, memory, access, name, false)
}

/// `Engine.register_gpu`: wraps the device memory `obj` exports, with `obj` as its owner.
pub(crate) fn wrap(
    py: Python<'_>,
    engine: &TransferEngine,
    obj: &Bound<'_, PyAny>,
    name: Option<String>,
    access: &str,
    device: Option<i64>,
) -> PyResult<GpuRegistration> {
    let access = parse_access(access)?;
    let cai = interface(obj)?;
    if cai.readonly && access.contains(Access::REMOTE_WRITE) {
        return Err(PyTypeError::new_err(format!(
            "cannot register {} for remote write: the __cuda_array_interface__ of this {} marks \
             it read-only (register writable memory, or use access=\"read\")",
            name.as_deref()
                .map_or_else(|| "GPU memory".to_owned(), |n| format!("{n:?}")),
            type_name(obj)
        )));
    }
    let claimed = claimed_ordinal(obj, device)?;
    let name = name.unwrap_or_else(|| format!("gpu-{}", UNNAMED.fetch_add(1, Ordering::Relaxed)));
    let cuda = engine.cuda().map_err(|e| errors::to_py(py, e))?;
    let owner: Box<dyn std::any::Any + Send + Sync> = Box::new(obj.clone().unbind());
    // SAFETY: `cai.ptr..+cai.len` is the memory `obj` exports through the CUDA Array Interface
    // (checked: non-null, contiguous, not empty, no overflow); by that interface's contract it
    // stays valid while `obj` lives, and `obj` is the owner the DeviceMemory keeps until its
    // last handle (registration, request, this Python handle) drops. The driver itself says
    // which GPU holds it and that the range lies inside one device allocation
    // (`wrap_located`). Ferry only hands the address to the driver's copies and, on a
    // GPUDirect route, to the NIC registration; never to host code.
    let memory = runtime::detach(py, || unsafe { cuda.wrap_located(cai.ptr, cai.len, owner) })?
        .map_err(|e| cuda_err(py, e))?;
    if let Some(c) = claimed
        && c != memory.location().ordinal
    {
        return Err(errors::invalid_argument(format!(
            "the driver places this memory on GPU {}, not GPU {c} (the device argument or the \
             object's device); leave device unset to take the driver's word",
            memory.location().ordinal
        )));
    }
    registration(py, engine, memory, access, name, cai.readonly)
}

/// `Engine.read_file_into_gpu`: loads `length` bytes of the file at `path` from `file_offset`
/// into `dst` at `offset` (`length=None`: the rest of the file, clipped to the rest of `dst`).
pub(crate) fn read_file<'py>(
    py: Python<'py>,
    engine: &TransferEngine,
    dst: &GpuRegistration,
    path: std::path::PathBuf,
    offset: i64,
    file_offset: i64,
    length: Option<i64>,
) -> PyResult<Bound<'py, PyDict>> {
    let offset = non_negative("offset", offset)?;
    let file_offset = non_negative("file_offset", file_offset)?;
    let len = match length {
        Some(l) => non_negative("length", l)?,
        None => {
            let size = std::fs::metadata(&path)
                .map_err(|e| {
                    errors::to_py(
                        py,
                        ferry::Error::Io {
                            op: "read_file_into_gpu",
                            target: path.display().to_string(),
                            source: e,
                        },
                    )
                })?
                .len();
            size.saturating_sub(file_offset)
                .min(dst.len.saturating_sub(offset))
        }
    };
    // Checked here: the facade reports a range past the end as a failed registration.
    dst.bounds(py, offset, len)?;
    let guard = dst.inner.lock().unwrap_or_else(PoisonError::into_inner);
    let reg = guard.as_ref().ok_or_else(|| {
        errors::err(
            py,
            Kind::InvalidRequest,
            format!("GPU registration {:?} is closed", dst.name),
        )
    })?;
    let load = runtime::detach(py, || {
        engine.read_file_into_gpu(reg, offset, &path, file_offset, len)
    })?
    .map_err(|e| errors::to_py(py, e))?;
    drop(guard);
    let d = PyDict::new(py);
    d.set_item("bytes", load.bytes)?;
    d.set_item("path", load.path.to_string())?;
    Ok(d)
}

/// Device memory registered with an engine (`Engine.alloc_gpu`, `Engine.register_gpu`), usable
/// as the local side of `read`, `write` and `Batch` ops like a `Registration`: its ops are
/// staged through pinned host buffers over TCP and io_uring (GPUDirect over RDMA where a route
/// exists). With remote access it is published to peers under its name.
///
/// `close()` (or its engine's shutdown) unpublishes it; dropping this object does not (the
/// engine keeps it). The memory itself stays valid while this object (or a request using it)
/// lives, so views taken through `__cuda_array_interface__` stay valid too: memory
/// from `alloc_gpu` is freed, and the object given to `register_gpu` released, only then.
#[pyclass(name = "GpuRegistration", module = "ferry", frozen)]
pub(crate) struct GpuRegistration {
    pub(crate) name: String,
    pub(crate) len: u64,
    pub(crate) readonly: bool,
    device: u32,
    pci_bus_id: String,
    ptr: u64,
    access: Access,
    token: String,
    route: String,
    why: String,
    memory: Arc<DeviceMemory>,
    pub(crate) inner: crate::handles::Held<ferry::GpuRegistration>,
}

impl GpuRegistration {
    /// Checks `offset..+len` against the memory; `OutOfBounds` names the registration.
    fn bounds(&self, py: Python<'_>, offset: u64, len: u64) -> PyResult<()> {
        if offset.checked_add(len).is_none_or(|end| end > self.len) {
            return Err(errors::err(
                py,
                Kind::OutOfBounds,
                format!(
                    "range {offset}..+{len} is outside GPU registration {:?} ({} bytes)",
                    self.name, self.len
                ),
            ));
        }
        Ok(())
    }
}

#[pymethods]
impl GpuRegistration {
    /// The name it is published under.
    #[getter]
    fn name(&self) -> &str {
        &self.name
    }

    /// Its token (hex), which peers address it by.
    #[getter]
    fn token(&self) -> &str {
        &self.token
    }

    /// Peers' access: `"local"`, `"read"`, `"write"` or `"read+write"`.
    #[getter]
    fn access(&self) -> &'static str {
        access_name(self.access)
    }

    /// The device ordinal.
    #[getter]
    fn device(&self) -> u32 {
        self.device
    }

    /// The device's PCI bus id.
    #[getter]
    fn pci_bus_id(&self) -> &str {
        &self.pci_bus_id
    }

    /// The device address of its first byte.
    #[getter]
    fn ptr(&self) -> u64 {
        self.ptr
    }

    /// The GPUDirect route chosen for it (`"dmabuf"`, `"peermem"` or `"off"`: staged).
    #[getter]
    fn route(&self) -> &str {
        &self.route
    }

    /// Why that route, in words (as `describe()` says it).
    #[getter]
    fn why(&self) -> &str {
        &self.why
    }

    /// Whether the memory is read-only (it can then only be a source).
    #[getter]
    fn readonly(&self) -> bool {
        self.readonly
    }

    /// Whether it was closed.
    #[getter]
    fn closed(&self) -> bool {
        self.inner
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .is_none()
    }

    /// The CUDA Array Interface (version 3) of the memory: one dimension of `len` bytes
    /// (`typestr` `"|u1"`), so `torch.as_tensor(reg, device="cuda")`, `cupy.asarray(reg)` and
    /// `numba.cuda.as_cuda_array(reg)` view it without a copy. `stream` is None: Ferry's own
    /// copies are synchronized before its requests end.
    #[getter]
    fn __cuda_array_interface__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        d.set_item("shape", PyTuple::new(py, [self.len])?)?;
        d.set_item("typestr", "|u1")?;
        d.set_item("data", (self.ptr, self.readonly))?;
        d.set_item("version", 3)?;
        d.set_item("strides", py.None())?;
        d.set_item("stream", py.None())?;
        Ok(d)
    }

    /// Copies the bytes of `data` (any contiguous buffer-protocol object) into the memory at
    /// `offset`, by the driver (host to device, synchronous, GIL released). Raises
    /// `OutOfBounds` past the end and `TypeError` for a read-only registration.
    #[pyo3(signature = (data, offset=0))]
    fn copy_from(&self, py: Python<'_>, data: &Bound<'_, PyAny>, offset: i64) -> PyResult<()> {
        if self.readonly {
            return Err(PyTypeError::new_err(format!(
                "cannot copy into GPU registration {:?}: it is read-only",
                self.name
            )));
        }
        let offset = non_negative("offset", offset)?;
        let buf = PyUntypedBuffer::get(data).map_err(|e| {
            PyTypeError::new_err(format!(
                "copy_from() needs a bytes-like object, not {}: {e}",
                type_name(data)
            ))
        })?;
        if !buf.is_c_contiguous() {
            return Err(errors::invalid_argument(
                "copy_from() needs a contiguous buffer",
            ));
        }
        let len = buf.len_bytes();
        self.bounds(py, offset, len as u64)?;
        // The address crosses into the detached closure as an integer.
        let addr = buf.buf_ptr() as usize;
        let memory = &self.memory;
        let res = runtime::detach(py, move || {
            let slice: &[u8] = if len == 0 {
                &[]
            } else {
                // SAFETY: `addr` is the contiguous buffer of `len` bytes that `buf` exports; the
                // export is held (and so the memory valid and in place) until `buf` is released
                // after this closure returns. Another Python thread writing it meanwhile races
                // only with the bytes copied, as with any registered buffer.
                unsafe { std::slice::from_raw_parts(addr as *const u8, len) }
            };
            memory.copy_from_host(offset, slice)
        });
        buf.release(py);
        res?.map_err(|e| cuda_err(py, e))
    }

    /// The bytes of the memory from `offset` (`length=None`: to the end), copied out by the
    /// driver (device to host, synchronous, GIL released). Raises `OutOfBounds` past the end.
    #[pyo3(signature = (offset=0, length=None))]
    fn to_bytes<'py>(
        &self,
        py: Python<'py>,
        offset: i64,
        length: Option<i64>,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let offset = non_negative("offset", offset)?;
        let len = match length {
            Some(l) => non_negative("length", l)?,
            None => self.len.saturating_sub(offset),
        };
        self.bounds(py, offset, len)?;
        let memory = &self.memory;
        let out = runtime::detach(py, || {
            let mut out = vec![0u8; len as usize];
            memory.copy_to_host(offset, &mut out).map(|()| out)
        })?
        .map_err(|e| cuda_err(py, e))?;
        Ok(PyBytes::new(py, &out))
    }

    /// Unpublishes it now: peers' requests are refused as for an unknown token from then on,
    /// and later requests of this engine cannot use it. The memory stays valid while this
    /// object or a request using it lives. Closing twice does nothing.
    fn close(&self) {
        let reg = self
            .inner
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        drop(reg);
    }

    fn __len__(&self) -> usize {
        self.len as usize
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_args))]
    fn __exit__(&self, _args: &Bound<'_, PyTuple>) {
        self.close();
    }

    fn __repr__(&self) -> String {
        format!(
            "<ferry.GpuRegistration {:?} {} bytes on GPU {} access={} route={}{}{}>",
            self.name,
            self.len,
            self.device,
            access_name(self.access),
            self.route,
            if self.readonly { " readonly" } else { "" },
            if self.closed() { " closed" } else { "" }
        )
    }
}

/// Registers the classes of this module.
pub(crate) fn add_to(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<GpuRegistration>()?;
    Ok(())
}
