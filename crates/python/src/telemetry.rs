//! `AgentTelemetry`: a compatibility layer's agent records its transfers and registrations
//! (`ferry::agent_telemetry`), served by every metrics endpoint of the process under NIXL's
//! exporter names; `metrics_endpoints()` says where this process serves metrics now.

use pyo3::prelude::*;

use crate::errors;

/// One agent's telemetry: `AgentTelemetry(agent, hostname, bounds_us)` takes the agent's name
/// for this process (`InvalidArgument` if a live one holds it, or the bounds are not strictly
/// increasing microseconds above zero); its series are served while the object lives.
#[pyclass(name = "AgentTelemetry", module = "ferry", frozen)]
pub(crate) struct AgentTelemetry {
    inner: ferry::AgentTelemetry,
}

#[pymethods]
impl AgentTelemetry {
    #[new]
    #[pyo3(signature = (agent, hostname, bounds_us=None))]
    fn new(
        py: Python<'_>,
        agent: &str,
        hostname: &str,
        bounds_us: Option<Vec<u64>>,
    ) -> PyResult<Self> {
        let bounds = bounds_us.unwrap_or_else(|| ferry::agent_telemetry::DEFAULT_BOUNDS_US.into());
        ferry::AgentTelemetry::register(agent, hostname, &bounds)
            .map(|inner| Self { inner })
            .map_err(|e| errors::to_py(py, e))
    }

    /// A request that ended: a WRITE is sent bytes (`tx`), a READ received (`rx`); its time
    /// from the post to completion and the post's own time, in microseconds.
    fn transfer(&self, write: bool, nbytes: u64, xfer_us: u64, post_us: u64) {
        self.inner.transfer(write, nbytes, xfer_us, post_us);
    }

    /// One registration call's bytes.
    fn registered(&self, nbytes: u64) {
        self.inner.registered(nbytes);
    }

    /// One deregistration call's bytes.
    fn deregistered(&self, nbytes: u64) {
        self.inner.deregistered(nbytes);
    }

    /// One error of the agent's API by NIXL's status label (`not_found`, `backend`, ...);
    /// False, and nothing counted, for another label.
    fn error(&self, status: &str) -> bool {
        self.inner.error(status)
    }

    /// What was recorded, as a dict of the `AgentDescription` fields.
    fn describe<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let d = self.inner.describe();
        let out = pyo3::types::PyDict::new(py);
        for (k, v) in [
            ("tx_bytes", d.tx_bytes),
            ("rx_bytes", d.rx_bytes),
            ("tx_requests", d.tx_requests),
            ("rx_requests", d.rx_requests),
            ("registered_bytes", d.registered_bytes),
            ("deregistered_bytes", d.deregistered_bytes),
            ("xfer_time_us", d.xfer_time_us),
            ("post_time_us", d.post_time_us),
        ] {
            out.set_item(k, v)?;
        }
        Ok(out.into_any())
    }
}

/// The addresses ("host:port") the engines of this process serve their metrics on now.
#[pyfunction]
fn metrics_endpoints() -> Vec<String> {
    ferry::metrics::endpoints()
        .iter()
        .map(ToString::to_string)
        .collect()
}

pub(crate) fn add_to(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<AgentTelemetry>()?;
    m.add_function(pyo3::wrap_pyfunction!(metrics_endpoints, m)?)?;
    Ok(())
}
