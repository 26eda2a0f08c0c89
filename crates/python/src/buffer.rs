//! Buffer-protocol objects as registered memory, without a copy.
//!
//! A registration takes its own `memoryview` of the object: the view holds a buffer export, and
//! while an export is held the exporter may neither free nor move the memory (NumPy keeps the
//! data, `bytearray` refuses to resize, `mmap` refuses to close). The view is the
//! [`MemoryRegion`]'s keepalive, so the memory stays valid until the last request using the
//! region lets it go, even when Python code deletes every other reference to the object. The
//! last reference may go on an I/O thread that is not attached to the interpreter: dropping a
//! `Py` there only queues the decref for the next time a thread attaches (PyO3's reference
//! pool), so no I/O thread ever waits for the GIL.

use std::ptr::NonNull;

use ferry::MemoryRegion;
use pyo3::buffer::PyUntypedBuffer;
use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::types::PyMemoryView;

use crate::errors;

/// A buffer exported for registration.
pub(crate) struct Exported {
    /// The memory, kept alive by a `memoryview` of the exporter.
    pub(crate) region: MemoryRegion,
    /// Whether the exporter refused write access (`bytes`, a non-writeable NumPy array, a
    /// read-only `mmap`): nothing may write into it, locally or from a peer.
    pub(crate) readonly: bool,
}

/// Exports `obj`'s buffer for registration.
///
/// Errors: `TypeError` when `obj` does not support the buffer protocol, `ValueError` when its
/// buffer is not contiguous.
pub(crate) fn export(obj: &Bound<'_, PyAny>) -> PyResult<Exported> {
    let view = PyMemoryView::from(obj).map_err(|e| {
        let ty = obj
            .get_type()
            .name()
            .map(|n| n.to_string())
            .unwrap_or_else(|_| "?".into());
        PyTypeError::new_err(format!(
            "register() needs an object with the buffer protocol (a NumPy array, bytearray, \
             memoryview, mmap, ...), not {ty}: {e}"
        ))
    })?;
    let buf = PyUntypedBuffer::get(view.as_any())?;
    if !(buf.is_c_contiguous() || buf.is_fortran_contiguous()) {
        return Err(errors::invalid_argument(
            "register() needs a contiguous buffer; this one is strided (for NumPy, register \
             numpy.ascontiguousarray(a) or the array the view was taken from)",
        ));
    }
    let len = buf.len_bytes();
    let readonly = buf.readonly();
    let ptr = NonNull::new(buf.buf_ptr().cast::<u8>()).unwrap_or(NonNull::dangling());
    // The view holds its own export; this one only told us the address.
    buf.release(obj.py());
    let keepalive = Box::new(view.unbind());
    // SAFETY: `ptr..ptr+len` is the contiguous buffer the memoryview exports; the export held by
    // the view (the region's keepalive) keeps it valid and in place until the region drops it.
    // A read-only export is never written: `Engine.register` refuses remote-write access for it
    // and `Batch` refuses READs into it, the only two ways Ferry writes a region. Ferry makes no
    // Rust reference into the memory that outlives a copy (the concurrency model of
    // `MemoryRegion`), and Python code touching the object meanwhile is the same race as with
    // any NIC-registered memory: bytes are defined once the request's outcome says so.
    let region = unsafe { MemoryRegion::from_raw_parts(ptr, len, keepalive) };
    Ok(Exported { region, readonly })
}
