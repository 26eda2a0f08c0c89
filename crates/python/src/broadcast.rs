//! The native side of `ferry.broadcast`: a publisher of named tensors of an engine's
//! registrations and a receiver that pulls them into registrations of another engine
//! (`ferry-broadcast`'s `Source::start_tensors` and `Receiver::join_into`). The Python module
//! registers the caller's arrays, builds the tensor lists and raises the typed errors; here
//! each blocking call releases the GIL and runs on the module's runtime.
//!
//! Errors: a `BroadcastError` becomes the exception class of `ferry.broadcast` named after its
//! kind (`TensorMismatch`, `TornError`, `PullTimeout`, `PullStalled`, else `BroadcastError`),
//! all `FerryError` subclasses, with `name`, `version` and, where they apply, `problems`,
//! `tensors` (and the cause as `__cause__`) or `holder`, `verified` and `chunks` set.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use ferry_broadcast::{
    BroadcastError, Destinations, Discovery, Embedded, Receiver, ReceiverOptions, Slice, Source,
    SourceOptions, Tensor,
};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::engine::Engine;
use crate::gpu::GpuRegistration;
use crate::handles::Registration;
use crate::runtime;

/// `BroadcastError` as the Python exception `ferry.broadcast` defines for its kind.
fn to_py(py: Python<'_>, e: BroadcastError) -> PyErr {
    exception(py, &e)
}

/// [`to_py`] of a borrowed error (a torn pull's cause becomes its exception's `__cause__`).
fn exception(py: Python<'_>, e: &BroadcastError) -> PyErr {
    let make = || -> PyResult<PyErr> {
        let m = py.import("ferry.broadcast")?;
        let (class, name, version) = match e {
            BroadcastError::Mismatch { name, version, .. } => ("TensorMismatch", name, *version),
            BroadcastError::Torn { name, version, .. } => ("TornError", name, *version),
            BroadcastError::Commit { name, version, .. } => ("BroadcastError", name, *version),
            BroadcastError::TimedOut { name, version, .. } => ("PullTimeout", name, *version),
            BroadcastError::Stalled { name, version, .. } => ("PullStalled", name, *version),
            _ => ("BroadcastError", &String::new(), 0),
        };
        let exc = m.getattr(class)?.call1((e.to_string(),))?;
        if !name.is_empty() {
            exc.setattr("name", name)?;
            exc.setattr("version", version)?;
        }
        match e {
            BroadcastError::Mismatch { problems, .. } => {
                exc.setattr("problems", problems.clone())?
            }
            BroadcastError::Torn { tensors, cause, .. } => {
                exc.setattr("tensors", tensors.clone())?;
                // Why it tore, as its own exception (`PullStalled`, say).
                let cause = exception(py, cause);
                exc.setattr("__cause__", cause.value(py))?;
            }
            BroadcastError::Stalled {
                holder,
                verified,
                chunks,
                ..
            } => {
                exc.setattr("holder", holder)?;
                exc.setattr("verified", verified)?;
                exc.setattr("chunks", chunks)?;
            }
            _ => {}
        }
        Ok(PyErr::from_value(exc))
    };
    make().unwrap_or_else(|err| err)
}

/// A slice of a `Registration` or `GpuRegistration`.
fn slice(obj: &Bound<'_, PyAny>, offset: u64, len: u64) -> PyResult<Slice> {
    let closed = |name: &str| PyValueError::new_err(format!("registration {name:?} is closed"));
    let made = if let Ok(r) = obj.cast::<Registration>() {
        let r = r.get();
        let g = r.inner.lock().unwrap_or_else(PoisonError::into_inner);
        let reg = g.as_ref().ok_or_else(|| closed(&r.name))?;
        Slice::new(reg, &r.name, offset, len)
    } else if let Ok(r) = obj.cast::<GpuRegistration>() {
        let r = r.get();
        let g = r.inner.lock().unwrap_or_else(PoisonError::into_inner);
        let reg = g.as_ref().ok_or_else(|| closed(&r.name))?;
        Slice::new(reg, &r.name, offset, len)
    } else {
        return Err(PyTypeError::new_err(format!(
            "a tensor must live in a Registration or a GpuRegistration, not {}",
            obj.get_type().name()?
        )));
    };
    made.map_err(PyValueError::new_err)
}

fn addr(s: &str) -> PyResult<SocketAddr> {
    s.parse().map_err(|e| {
        PyValueError::new_err(format!(
            "a broadcast address is an IP address and port like \"127.0.0.1:7500\", not {s:?}: {e}"
        ))
    })
}

/// Leases of members listed in etcd last this long without renewal (as `ferry publish --etcd`).
const ETCD_TTL: Duration = Duration::from_secs(3);

/// `etcd://HOST:PORT[/NAME]` as the client's endpoint `http://HOST:PORT` and the name, if any.
fn etcd_url(url: &str) -> PyResult<(String, Option<String>)> {
    let bad = || {
        PyValueError::new_err(format!(
            "an etcd address is etcd://HOST:PORT (a publisher's discovery) or \
             etcd://HOST:PORT/NAME (a pull's source), not {url:?}"
        ))
    };
    let rest = url.strip_prefix("etcd://").ok_or_else(bad)?;
    let (host, name) = match rest.split_once('/') {
        Some((h, n)) => (h, Some(n)),
        None => (rest, None),
    };
    if host.is_empty()
        || !host.contains(':')
        || name.is_some_and(|n| n.is_empty() || n.contains('/'))
    {
        return Err(bad());
    }
    Ok((format!("http://{host}"), name.map(str::to_owned)))
}

/// The etcd discovery of broadcast `name` at `endpoint` (`http://HOST:PORT`).
#[cfg(feature = "etcd")]
async fn etcd(endpoint: &str, name: &str) -> Result<Arc<dyn Discovery>, BroadcastError> {
    let d = ferry_broadcast::Etcd::connect(endpoint, name, ETCD_TTL).await?;
    Ok(Arc::new(d))
}

/// Without the `etcd` feature: the error that says so.
#[cfg(not(feature = "etcd"))]
async fn etcd(endpoint: &str, _name: &str) -> Result<Arc<dyn Discovery>, BroadcastError> {
    let _ = ETCD_TTL;
    Err(BroadcastError::Discovery {
        backend: "etcd",
        reason: format!(
            "{endpoint}: this build of the ferry package has no etcd discovery (the ferry-python \
             crate's `etcd` feature, on by default, was left out)"
        ),
    })
}

/// Where a pull finds its source.
enum SourceAt {
    /// Listed in the etcd at `endpoint` (`http://HOST:PORT`) under broadcast `name`.
    Etcd { endpoint: String, name: String },
    /// The publisher's control address.
    Addr(SocketAddr),
}

/// One tensor as the Python module passes it: name, registration, offset, length, dtype, shape.
type PyTensor<'py> = (
    String,
    Bound<'py, PyAny>,
    u64,
    u64,
    Option<String>,
    Option<Vec<u64>>,
);

fn tensors(list: Vec<PyTensor<'_>>) -> PyResult<Vec<Tensor>> {
    list.into_iter()
        .map(|(name, reg, offset, len, dtype, shape)| {
            Ok(Tensor {
                name,
                slice: slice(&reg, offset, len)?,
                dtype,
                shape,
            })
        })
        .collect()
}

/// A running publisher (`Source` over the caller's engine).
#[pyclass(name = "_Publisher", module = "ferry._ferry", frozen)]
pub(crate) struct Publisher {
    inner: Mutex<Option<Source>>,
    addr: String,
}

#[pymethods]
impl Publisher {
    /// The control address receivers are given.
    #[getter]
    fn addr(&self) -> &str {
        &self.addr
    }

    /// The newest version's manifest digest (64 hex digits): what receivers pass as
    /// `expect_manifest` to bind every chunk to this publisher.
    fn digest(&self) -> PyResult<String> {
        let g = self.inner.lock().unwrap_or_else(PoisonError::into_inner);
        g.as_ref()
            .map(|s| s.manifest().digest().to_string())
            .ok_or_else(|| PyValueError::new_err("the publisher is closed"))
    }

    /// The versions served, oldest first.
    fn versions(&self) -> Vec<u64> {
        let g = self.inner.lock().unwrap_or_else(PoisonError::into_inner);
        g.as_ref().map(Source::versions).unwrap_or_default()
    }

    /// Publishes `version` from `tensors` (a list as for `_publish`).
    fn publish(&self, py: Python<'_>, version: u64, tensors: Vec<PyTensor<'_>>) -> PyResult<()> {
        let ts = self::tensors(tensors)?;
        let g = self.inner.lock().unwrap_or_else(PoisonError::into_inner);
        let src = g
            .as_ref()
            .ok_or_else(|| PyValueError::new_err("the publisher is closed"))?;
        runtime::detach(py, || src.publish(version, &ts, None))?
            .map(|_| ())
            .map_err(|e| to_py(py, e))
    }

    /// Stops serving.
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        let src = self
            .inner
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        if let Some(src) = src {
            runtime::block_on(py, || src.stop())?;
        }
        Ok(())
    }
}

/// Starts a publisher of `tensors` on `engine` (which must listen); its control service
/// listens on `listen`. With `discovery` (`etcd://HOST:PORT`, or `etcd://HOST:PORT/NAME` with
/// this publisher's `name`), it also lists itself in that etcd, where `pull` finds it.
#[pyfunction]
#[pyo3(signature = (engine, name, version, tensors, chunk_size, listen, keep_versions, auth_key_file=None, discovery=None))]
#[allow(clippy::too_many_arguments)]
fn _publish(
    py: Python<'_>,
    engine: &Engine,
    name: &str,
    version: u64,
    tensors: Vec<PyTensor<'_>>,
    chunk_size: Option<u64>,
    listen: &str,
    keep_versions: usize,
    auth_key_file: Option<std::path::PathBuf>,
    discovery: Option<&str>,
) -> PyResult<Publisher> {
    let ts = self::tensors(tensors)?;
    let etcd_at = match discovery {
        None => None,
        Some(url) => {
            let (endpoint, given) = etcd_url(url)?;
            if let Some(given) = given.filter(|g| g != name) {
                return Err(PyValueError::new_err(format!(
                    "discovery {url:?} names the broadcast {given:?}, but this publisher's name is {name:?}"
                )));
            }
            Some(endpoint)
        }
    };
    let opts = SourceOptions {
        listen: addr(listen)?,
        keep_versions,
        keys: keyring(py, auth_key_file)?,
        ..Default::default()
    };
    let chunk = chunk_size.unwrap_or(ferry_broadcast::manifest::DEFAULT_CHUNK_SIZE);
    let src = runtime::block_on(py, || async {
        let disc = match &etcd_at {
            Some(endpoint) => Some(etcd(endpoint, name).await?),
            None => None,
        };
        Source::start_tensors(&engine.inner, name, version, &ts, chunk, opts, disc).await
    })?
    .map_err(|e| to_py(py, e))?;
    let addr = src.ctl_addr().to_string();
    Ok(Publisher {
        inner: Mutex::new(Some(src)),
        addr,
    })
}

/// A receiver that joined a broadcast (`Receiver::join_into`).
#[pyclass(name = "_Puller", module = "ferry._ferry", frozen)]
pub(crate) struct Puller {
    inner: Mutex<Option<Receiver>>,
    version: u64,
}

impl Puller {
    fn take(&self) -> PyResult<Receiver> {
        self.inner
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take()
            .ok_or_else(|| PyValueError::new_err("this pull is running or was closed"))
    }

    fn put(&self, r: Receiver) {
        *self.inner.lock().unwrap_or_else(PoisonError::into_inner) = Some(r);
    }
}

#[pymethods]
impl Puller {
    /// The version being pulled.
    #[getter]
    fn version(&self) -> u64 {
        self.version
    }

    /// Pulls every chunk (GIL released), calling `progress(bytes, total)` as bytes are
    /// verified (last with `bytes == total` on success); then, with `linger` seconds, keeps
    /// relaying while other receivers are unfinished. Returns the summary as a dict. `timeout`
    /// (seconds) bounds the pull. An exception `progress` raises, and Ctrl-C (or any exception
    /// a signal handler raises), stops the pull and is raised here.
    #[pyo3(signature = (timeout=None, progress=None, linger=0.0))]
    fn run<'py>(
        &self,
        py: Python<'py>,
        timeout: Option<f64>,
        progress: Option<Py<PyAny>>,
        linger: f64,
    ) -> PyResult<Bound<'py, PyDict>> {
        // Checked before the receiver is taken: a bad value leaves the pull as it was.
        let timeout = crate::request::seconds("timeout", timeout)?;
        let linger = crate::request::seconds("linger", Some(linger))?.unwrap_or_default();
        let mut r = self.take()?;
        let mut watch = r.progress();
        let name = r.manifest().name.clone();
        // Calls `progress` when the snapshot moved; its exception ends the pull.
        let report = |last: &mut (u64, u64), s: &ferry_broadcast::Snapshot| -> PyResult<()> {
            match &progress {
                Some(p) if *last != (s.bytes, s.total) => {
                    *last = (s.bytes, s.total);
                    Python::attach(|py| p.call1(py, (s.bytes, s.total)).map(drop))
                }
                _ => Ok(()),
            }
        };
        let ran = runtime::block_on(py, || async {
            let mut last = (u64::MAX, u64::MAX);
            let res = {
                let run = r.run();
                tokio::pin!(run);
                // A zero timeout has passed already: it wins before the pull is polled at all
                // (a timer of zero would fire only at the runtime's next tick, after a quick
                // pull could have ended). Otherwise a deadline due in the same poll as the
                // pull's end wins too: a pull is never late yet reported whole.
                let deadline = async {
                    match timeout {
                        Some(t) if t.is_zero() => {}
                        Some(t) => tokio::time::sleep(t).await,
                        None => std::future::pending().await,
                    }
                };
                tokio::pin!(deadline);
                loop {
                    tokio::select! {
                        biased;
                        () = &mut deadline => break None,
                        res = &mut run => break Some(res),
                        Ok(()) = watch.changed(), if progress.is_some() => {
                            let s = watch.borrow_and_update().clone();
                            report(&mut last, &s)?;
                        }
                    }
                }
            };
            if matches!(res, Some(Ok(_))) {
                // The last snapshot (every byte) even when the pull ended before the watch
                // was polled again.
                let s = watch.borrow_and_update().clone();
                report(&mut last, &s)?;
                if !linger.is_zero() {
                    r.linger(linger).await;
                }
            }
            Ok::<_, PyErr>(res)
        })
        .and_then(|ran| ran);
        // Interrupted or stopped by the callback: the pull's future was dropped, which
        // stopped it; the receiver is put back for `close`.
        let res = match ran {
            Ok(res) => res,
            Err(e) => {
                self.put(r);
                return Err(e);
            }
        };
        let res = res.unwrap_or_else(|| {
            Err(r.failed(BroadcastError::TimedOut {
                name,
                version: r.version(),
                seconds: timeout.unwrap_or_default().as_secs_f64(),
            }))
        });
        self.put(r);
        let sum = res.map_err(|e| to_py(py, e))?;
        let d = PyDict::new(py);
        d.set_item("name", &sum.name)?;
        d.set_item("version", sum.version)?;
        d.set_item("bytes", sum.bytes)?;
        d.set_item("seconds", sum.seconds)?;
        d.set_item("from_source", sum.bytes_from_source)?;
        d.set_item("from_relays", sum.bytes_from_relays)?;
        d.set_item("refetched", sum.refetched_chunks)?;
        d.set_item("parents_given_up", sum.parents_given_up)?;
        d.set_item("holders_stalled", sum.holders_stalled)?;
        d.set_item("holders_left", sum.holders_left)?;
        d.set_item("bytes_copied", sum.bytes_copied)?;
        Ok(d)
    }

    /// Staged: copies staging into the live tensors (GIL released); returns the bytes copied.
    fn commit(&self, py: Python<'_>) -> PyResult<u64> {
        let g = self.inner.lock().unwrap_or_else(PoisonError::into_inner);
        let r = g
            .as_ref()
            .ok_or_else(|| PyValueError::new_err("this pull was closed"))?;
        runtime::detach(py, || r.commit())?.map_err(|e| to_py(py, e))
    }

    /// Bytes the CPU copied so far: hashing host memory, and commits (counted, not timed).
    fn bytes_copied(&self) -> u64 {
        let g = self.inner.lock().unwrap_or_else(PoisonError::into_inner);
        g.as_ref().map_or(0, Receiver::bytes_copied)
    }

    /// Leaves the member list and stops serving. With `timeout` (seconds), gives the source
    /// that long to take the leave (an interrupted pull's source may not answer); it then
    /// learns from the missed heartbeats.
    #[pyo3(signature = (timeout=None))]
    fn close(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<()> {
        let timeout = crate::request::seconds("timeout", timeout)?;
        let r = self
            .inner
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        if let Some(r) = r {
            runtime::block_on(py, || async {
                match timeout {
                    Some(t) => drop(tokio::time::timeout(t, r.leave()).await),
                    None => r.leave().await,
                }
            })?;
        }
        Ok(())
    }
}

/// A list of destinations as the Python module passes them: name, registration, offset, length.
type PyDest<'py> = (String, Bound<'py, PyAny>, u64, u64);

/// A destination array's dtype and shape as the Python module passes them (each where known).
type PyKind = (Option<String>, Option<Vec<u64>>);

fn dests(list: Vec<PyDest<'_>>) -> PyResult<Vec<(String, Slice)>> {
    list.into_iter()
        .map(|(name, reg, off, len)| Ok((name, slice(&reg, off, len)?)))
        .collect()
}

/// The broadcast's keyring from `path` (a key file readable by others is refused, as the
/// engine's `auth_key_file` does).
fn keyring(py: Python<'_>, path: Option<std::path::PathBuf>) -> PyResult<Option<ferry::Keyring>> {
    path.map(|p| ferry::load_keyring(&p, false).map_err(|e| crate::errors::to_py(py, e)))
        .transpose()
}

/// Joins the broadcast whose publisher's control service is at `source` (or which is listed
/// in etcd: `etcd://HOST:PORT/NAME`) to pull it into `into` (and `staging`), on `engine`.
#[pyfunction]
#[pyo3(signature = (engine, source, into, name, version, staging, rename, subset, relay, shards, verify_at_rest, auth_key_file=None, expect_manifest=None, kinds=None))]
#[allow(clippy::too_many_arguments)]
fn _join(
    py: Python<'_>,
    engine: &Engine,
    source: &str,
    into: Vec<PyDest<'_>>,
    name: Option<String>,
    version: Option<u64>,
    staging: Option<Vec<PyDest<'_>>>,
    rename: HashMap<String, String>,
    subset: bool,
    relay: bool,
    shards: HashMap<String, u64>,
    verify_at_rest: bool,
    auth_key_file: Option<std::path::PathBuf>,
    expect_manifest: Option<String>,
    kinds: Option<HashMap<String, PyKind>>,
) -> PyResult<Puller> {
    let expect_manifest = expect_manifest
        .map(|h| {
            ferry_broadcast::Digest::from_hex(h.trim()).ok_or_else(|| {
                PyValueError::new_err(format!(
                    "expect_manifest {h:?} is not a manifest digest (64 hex digits)"
                ))
            })
        })
        .transpose()?;
    let keys = keyring(py, auth_key_file)?;
    let d = Destinations {
        into: dests(into)?,
        staging: staging.map(dests).transpose()?,
        rename,
        subset,
        shards,
        kinds: kinds
            .unwrap_or_default()
            .into_iter()
            .map(|(n, (dtype, shape))| (n, ferry_broadcast::TensorKind { dtype, shape }))
            .collect(),
    };
    let tracker_keys = keys.clone();
    let opts = ReceiverOptions {
        relay,
        version,
        verify_at_rest,
        expect_manifest,
        keys,
        ..Default::default()
    };
    let (at, name) = if source.starts_with("etcd://") {
        let (endpoint, listed) = etcd_url(source)?;
        let listed = listed.ok_or_else(|| {
            PyValueError::new_err(format!(
                "{source:?}: a pull from etcd names the broadcast: etcd://HOST:PORT/NAME"
            ))
        })?;
        if let Some(n) = name.as_ref().filter(|n| **n != listed) {
            return Err(PyValueError::new_err(format!(
                "name={n:?} but the source {source:?} names the broadcast {listed:?}"
            )));
        }
        let at = SourceAt::Etcd {
            endpoint,
            name: listed.clone(),
        };
        (at, Some(listed))
    } else {
        (SourceAt::Addr(addr(source)?), name)
    };
    let r = runtime::block_on(py, || async {
        let disc: Arc<dyn Discovery> = match &at {
            SourceAt::Etcd { endpoint, name } => etcd(endpoint, name).await?,
            SourceAt::Addr(a) => match tracker_keys {
                Some(k) => Arc::new(Embedded::with_keys(*a, k)),
                None => Arc::new(Embedded::new(*a)),
            },
        };
        Receiver::join_into(&engine.inner, disc, name.as_deref(), d, opts).await
    })?
    .map_err(|e| to_py(py, e))?;
    Ok(Puller {
        version: r.version(),
        inner: Mutex::new(Some(r)),
    })
}

pub(crate) fn add_to(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<Publisher>()?;
    m.add_class::<Puller>()?;
    m.add_function(wrap_pyfunction!(_publish, m)?)?;
    m.add_function(wrap_pyfunction!(_join, m)?)?;
    Ok(())
}
