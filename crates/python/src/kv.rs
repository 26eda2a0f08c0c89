//! `EtcdKv`: plain records in etcd through the metadata room (`ferry_metadata::EtcdKv`, the
//! one etcd client, also under broadcast discovery), for the Mooncake layer's `etcd://`
//! metadata mode (its endpoint records) and the NIXL layer's `NIXL_ETCD_ENDPOINTS` (agents'
//! metadata), each bound to a lease this process keeps alive. Every call blocks with the GIL
//! released.

use std::time::Duration;

use pyo3::prelude::*;

use crate::errors::{self, Kind};
use crate::runtime;

/// A connection to etcd for plain records: `EtcdKv("127.0.0.1:2379", ttl=10.0)`; `put` binds
/// the record to this client's lease, kept alive while the object lives (a killed process's
/// records go within `ttl` seconds); `get` returns bytes or None; `delete`; `close` revokes
/// the lease. Errors are `FerryError`s naming the endpoint.
#[pyclass(name = "EtcdKv", module = "ferry", frozen)]
pub(crate) struct EtcdKv {
    #[cfg(feature = "etcd")]
    inner: ferry_metadata::EtcdKv,
}

#[cfg(feature = "etcd")]
fn kv_err(py: Python<'_>, e: ferry_metadata::MetadataError) -> PyErr {
    // A store that did not answer in time is a `TimeoutError` too, as a transfer's deadline is.
    let kind = match e {
        ferry_metadata::MetadataError::Timeout { .. } => Kind::Timeout,
        _ => Kind::FerryError,
    };
    errors::err(py, kind, e.to_string())
}

#[cfg(feature = "etcd")]
#[pymethods]
impl EtcdKv {
    #[new]
    #[pyo3(signature = (endpoint, ttl=10.0))]
    fn new(py: Python<'_>, endpoint: &str, ttl: f64) -> PyResult<Self> {
        let ttl = crate::request::seconds("ttl", Some(ttl))?.unwrap_or(Duration::from_secs(10));
        let inner = runtime::block_on(py, || ferry_metadata::EtcdKv::connect(endpoint, ttl))?
            .map_err(|e| kv_err(py, e))?;
        Ok(Self { inner })
    }

    /// Stores `value` under `key`, bound to this client's lease.
    fn put(&self, py: Python<'_>, key: &str, value: Vec<u8>) -> PyResult<()> {
        runtime::block_on(py, || self.inner.put_leased(key, value))?.map_err(|e| kv_err(py, e))
    }

    /// The bytes under `key`, or None.
    fn get(&self, py: Python<'_>, key: &str) -> PyResult<Option<Vec<u8>>> {
        runtime::block_on(py, || self.inner.get(key))?.map_err(|e| kv_err(py, e))
    }

    /// Removes `key` (nothing if absent).
    fn delete(&self, py: Python<'_>, key: &str) -> PyResult<()> {
        runtime::block_on(py, || self.inner.delete(key))?.map_err(|e| kv_err(py, e))
    }

    /// Revokes the lease: every record this client put goes now.
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        runtime::block_on(py, || self.inner.revoke())?.map_err(|e| kv_err(py, e))
    }
}

#[cfg(not(feature = "etcd"))]
#[pymethods]
impl EtcdKv {
    #[new]
    #[pyo3(signature = (endpoint, ttl=10.0))]
    fn new(py: Python<'_>, endpoint: &str, ttl: f64) -> PyResult<Self> {
        let _ = ttl;
        Err(errors::err(
            py,
            Kind::Unavailable,
            format!(
                "etcd {endpoint}: this build of the ferry package has no etcd client (the \
                 ferry-python crate's `etcd` feature, on by default, was left out)"
            ),
        ))
    }
}

/// Adds `EtcdKv` to the module.
pub(crate) fn add_to(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<EtcdKv>()
}
