//! The handles an `Engine` gives out: `Registration`, `FileRegistration`, `Peer` and
//! `RemoteSegment`, each wrapping the facade's type of the same role.

use std::sync::{Arc, Mutex, PoisonError};

use ferry::Access;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

use crate::args::access_name;
use crate::errors;

/// A registration as its Python object and its engine's [`Keeper`] share it: `None` once
/// closed.
pub(crate) type Held<T> = Arc<Mutex<Option<T>>>;

/// A new [`Held`] of `value`.
pub(crate) fn held<T>(value: T) -> Held<T> {
    Arc::new(Mutex::new(Some(value)))
}

/// One registration an engine keeps.
trait Kept: Send + Sync {
    fn is_closed(&self) -> bool;
    fn close(&self);
}

impl<T: Send> Kept for Mutex<Option<T>> {
    fn is_closed(&self) -> bool {
        self.lock()
            .unwrap_or_else(PoisonError::into_inner)
            .is_none()
    }

    fn close(&self) {
        let gone = self.lock().unwrap_or_else(PoisonError::into_inner).take();
        drop(gone);
    }
}

/// What an engine keeps published: every registration it made stays published (and its memory
/// held) until it is closed or the engine is shut down or gone, whether or not Python still
/// holds its handle; dropping a handle unpublishes nothing.
#[derive(Default)]
pub(crate) struct Keeper {
    held: Mutex<Vec<Arc<dyn Kept>>>,
}

impl Keeper {
    /// Keeps `h` (and forgets the ones closed meanwhile).
    pub(crate) fn keep<T: Send + 'static>(&self, h: &Held<T>) {
        let mut held = self.held.lock().unwrap_or_else(PoisonError::into_inner);
        held.retain(|k| !k.is_closed());
        held.push(h.clone());
    }

    /// Closes every registration kept (the engine is shutting down).
    pub(crate) fn close_all(&self) {
        let all = std::mem::take(&mut *self.held.lock().unwrap_or_else(PoisonError::into_inner));
        for k in all {
            k.close();
        }
    }
}

/// Registered memory: a buffer-protocol object published under a name. It stays published
/// until `close()` (or the end of a `with` block) or until its engine is shut down or gone:
/// the engine keeps it, so dropping this object unpublishes nothing. The memory stays in use
/// until requests using it drained.
#[pyclass(name = "Registration", module = "ferry", frozen)]
pub(crate) struct Registration {
    pub(crate) name: String,
    pub(crate) len: u64,
    pub(crate) readonly: bool,
    pub(crate) access: Access,
    pub(crate) token: String,
    pub(crate) inner: Held<ferry::Registration>,
}

#[pymethods]
impl Registration {
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

    /// Whether the buffer is read-only (it can then only be a source: WRITEs from it, READs
    /// of it by peers).
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

    /// Unpublishes it now: peers' requests are refused as for an unknown token from then on,
    /// and later requests of this engine cannot use it. The buffer export is released once no
    /// request uses the memory. Closing twice does nothing.
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        let reg = self
            .inner
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        match reg {
            Some(r) => r.retire().map_err(|e| errors::to_py(py, e)),
            None => Ok(()),
        }
    }

    fn __len__(&self) -> usize {
        self.len as usize
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_args))]
    fn __exit__(&self, py: Python<'_>, _args: &Bound<'_, pyo3::types::PyTuple>) -> PyResult<()> {
        self.close(py)
    }

    fn __repr__(&self) -> String {
        format!(
            "<ferry.Registration {:?} {} bytes access={}{}{}>",
            self.name,
            self.len,
            access_name(self.access),
            if self.readonly { " readonly" } else { "" },
            if self.closed() { " closed" } else { "" }
        )
    }
}

/// A published file segment. `close()` (or its engine's shutdown) unpublishes it; reads
/// already running finish. Dropping this object unpublishes nothing: the engine keeps it.
#[pyclass(name = "FileRegistration", module = "ferry", frozen)]
pub(crate) struct FileRegistration {
    pub(crate) name: String,
    pub(crate) len: u64,
    pub(crate) token: String,
    pub(crate) inner: Held<ferry::FileRegistration>,
}

#[pymethods]
impl FileRegistration {
    /// The name it is published under.
    #[getter]
    fn name(&self) -> &str {
        &self.name
    }

    /// Its token (hex).
    #[getter]
    fn token(&self) -> &str {
        &self.token
    }

    /// Unpublishes the file segment. Closing twice does nothing.
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
    fn __exit__(&self, _args: &Bound<'_, pyo3::types::PyTuple>) {
        self.close();
    }

    fn __repr__(&self) -> String {
        format!(
            "<ferry.FileRegistration {:?} {} bytes>",
            self.name, self.len
        )
    }
}

/// A connected peer incarnation and the segments it published at connection time.
#[pyclass(name = "Peer", module = "ferry", frozen)]
pub(crate) struct Peer {
    pub(crate) inner: ferry::Peer,
}

#[pymethods]
impl Peer {
    /// Its control address.
    #[getter]
    fn addr(&self) -> String {
        self.inner.addr().to_string()
    }

    /// Its peer id (hex).
    #[getter]
    fn peer_id(&self) -> String {
        self.inner.id().to_string()
    }

    /// The epoch of this incarnation (hex).
    #[getter]
    fn epoch(&self) -> String {
        self.inner.epoch().to_string()
    }

    /// The transport its requests take (`"tcp"`, `"uring"`, `"rdma"`).
    #[getter]
    fn transport(&self) -> &'static str {
        self.inner.transport().name()
    }

    /// The segments it published at connection time, as dicts (`name`, `len`, `access`,
    /// `token`).
    #[getter]
    fn segments<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let list = PyList::empty(py);
        for s in self.inner.segments() {
            let d = PyDict::new(py);
            d.set_item("name", &s.name)?;
            d.set_item("len", s.len)?;
            d.set_item("access", access_name(s.access))?;
            d.set_item("token", s.token.to_string())?;
            list.append(d)?;
        }
        Ok(list)
    }

    /// The segment published under `name`; raises `UnknownSegmentName` (a `LookupError`) when
    /// there is none.
    fn segment(&self, py: Python<'_>, name: &str) -> PyResult<RemoteSegment> {
        let segment = self.inner.segment(name).map_err(|e| errors::to_py(py, e))?;
        Ok(RemoteSegment { segment })
    }

    /// Whether its data channel can still carry requests.
    fn is_alive(&self) -> bool {
        self.inner.is_alive()
    }

    /// Closes the data path: in-flight chunks fail as lost, later requests fail at once.
    fn close(&self) {
        self.inner.close();
    }

    fn __repr__(&self) -> String {
        format!(
            "<ferry.Peer {} transport={} segments={}>",
            self.inner.addr(),
            self.inner.transport().name(),
            self.inner.segments().len()
        )
    }
}

/// A segment published by a peer, as the target of READs and WRITEs.
#[pyclass(name = "RemoteSegment", module = "ferry", frozen)]
pub(crate) struct RemoteSegment {
    pub(crate) segment: ferry::RemoteSegment,
}

#[pymethods]
impl RemoteSegment {
    /// Its name.
    #[getter]
    fn name(&self) -> &str {
        self.segment.name()
    }

    /// What this side may do to it: `"read"`, `"write"` or `"read+write"`.
    #[getter]
    fn access(&self) -> &'static str {
        access_name(self.segment.access())
    }

    /// Its token (hex).
    #[getter]
    fn token(&self) -> String {
        self.segment.desc().token.to_string()
    }

    fn __len__(&self) -> usize {
        self.segment.len() as usize
    }

    fn __repr__(&self) -> String {
        format!(
            "<ferry.RemoteSegment {:?} {} bytes access={}>",
            self.segment.name(),
            self.segment.len(),
            access_name(self.segment.access())
        )
    }
}
