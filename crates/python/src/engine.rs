//! `Engine`: registers memory and files, connects to peers, moves bytes. The handles it gives
//! out are in `handles`; every call that can block (connecting, probing) releases the GIL.

use std::sync::atomic::{AtomicU64, Ordering};

use ferry::{Access, DataPlane, OpKind, TransferEngine, TransportKind};
use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::args::{non_negative, parse_access, seconds, to_plain};
use crate::buffer;
use crate::errors;
use crate::gpu::{self, GpuRegistration};
use crate::handles::{FileRegistration, Keeper, Peer, Registration, RemoteSegment};
use crate::request::{self, Batch, Request, make_op, to_batch};
use crate::runtime;

/// Data streams per peer, as the transports take them (`ferry --streams` has the same limit).
const MAX_STREAMS: usize = 64;

/// Names registrations that were given none.
static UNNAMED: AtomicU64 = AtomicU64::new(0);

/// Resolves the argument `what`, HOST:PORT (`example` shows one), to its first address.
fn host_port(what: &str, addr: &str, example: &str) -> PyResult<std::net::SocketAddr> {
    use std::net::ToSocketAddrs;
    addr.to_socket_addrs()
        .ok()
        .and_then(|mut a| a.next())
        .ok_or_else(|| {
            errors::invalid_argument(format!(
                "{what} must be HOST:PORT like \"{example}\" or \"localhost:0\", not {addr:?}"
            ))
        })
}

/// Ferry's transfer engine: registers memory and files, connects to peers, moves bytes.
///
/// `Engine(listen="127.0.0.1:0")` also serves what it publishes (port 0: any free port; see
/// `listen_addr`); without `listen` it only connects out. `transports` lists the built-in
/// transports to use in order of preference (`"tcp"`, the portable data plane chosen by
/// `data_plane`; `"uring"`; `"rdma"`); `data_plane` is `"auto"` (io_uring where the kernel
/// supports it, TCP otherwise), `"uring"` or `"tcp"`. `streams`, `depth` and `chunk_size` tune
/// the TCP/io_uring data plane (defaults 1, 8, 1 MiB); `socket_buffer` sets the socket buffers
/// in bytes (0: kernel autotuning); `io_threads` the TCP data plane's I/O threads (0: one per
/// core). Times are in seconds: `request_timeout` is every request's default deadline,
/// `connect_timeout` limits connecting and the handshake, `dead_peer_after` (default 30, 0 for
/// the kernel's quarter hour) gives a silent peer up. `auth_key_file` names a keyring file
/// (lines of `name hexkey`): peers must then prove a key of it, and this engine proves its first
/// key when it connects (without it, the file named by `FERRY_AUTH_KEY_FILE`, if set).
/// `metrics="127.0.0.1:9400"` serves Prometheus metrics over HTTP there (`GET /metrics`; port
/// 0: any free port, see `metrics_addr`; a bare port, `"9400"`, is 127.0.0.1's).
/// `same_host=False` turns the same-host plane off (on by default: a peer on this host is
/// reached by process-to-process copies, see `describe()["same_host"]`; `FERRY_SAME_HOST=off`
/// does the same for every engine).
#[pyclass(name = "Engine", module = "ferry", frozen)]
pub(crate) struct Engine {
    pub(crate) inner: TransferEngine,
    /// Every registration it made, published until closed or this engine is.
    keeper: Keeper,
}

#[pymethods]
impl Engine {
    #[new]
    #[pyo3(signature = (listen=None, *, transports=None, data_plane="auto", streams=None,
        depth=None, chunk_size=None, socket_buffer=None, io_threads=None, request_timeout=None,
        connect_timeout=None, dead_peer_after=None, auth_key_file=None, metrics=None,
        same_host=true))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        listen: Option<&str>,
        transports: Option<Vec<String>>,
        data_plane: &str,
        streams: Option<i64>,
        depth: Option<i64>,
        chunk_size: Option<i64>,
        socket_buffer: Option<i64>,
        io_threads: Option<i64>,
        request_timeout: Option<f64>,
        connect_timeout: Option<f64>,
        dead_peer_after: Option<f64>,
        auth_key_file: Option<std::path::PathBuf>,
        metrics: Option<&str>,
        same_host: bool,
    ) -> PyResult<Self> {
        // Python ints as counts and sizes: a negative one is a ValueError naming the argument.
        let whole = |what: &str, v: Option<i64>| v.map(|v| non_negative(what, v)).transpose();
        let streams = whole("streams", streams)?.map(|n| n as usize);
        let depth = whole("depth", depth)?.map(|n| n as usize);
        let chunk_size = whole("chunk_size", chunk_size)?;
        let socket_buffer = whole("socket_buffer", socket_buffer)?.map(|n| n as usize);
        let io_threads = whole("io_threads", io_threads)?.map(|n| n as usize);
        let mut b = TransferEngine::builder().same_host(same_host);
        if let Some(addr) = listen {
            b = b.listen(host_port("listen", addr, "127.0.0.1:0")?);
        }
        if let Some(ts) = transports {
            let mut kinds = Vec::with_capacity(ts.len());
            for t in &ts {
                kinds.push(match t.as_str() {
                    "tcp" => TransportKind::Tcp,
                    "uring" => TransportKind::Uring,
                    "rdma" => TransportKind::Rdma,
                    other => {
                        return Err(errors::invalid_argument(format!(
                            "transports takes \"tcp\", \"uring\" and \"rdma\", not {other:?}"
                        )));
                    }
                });
            }
            if kinds.is_empty() {
                return Err(errors::invalid_argument(
                    "transports must name at least one",
                ));
            }
            b = b.transports(&kinds);
        }
        let plane = DataPlane::parse(data_plane).ok_or_else(|| {
            errors::invalid_argument(format!(
                "data_plane must be \"auto\", \"uring\" or \"tcp\", not {data_plane:?}"
            ))
        })?;
        b = b.data_plane(plane);
        for (what, v) in [("streams", streams), ("depth", depth)] {
            if v == Some(0) {
                return Err(errors::invalid_argument(format!(
                    "{what} must be at least 1"
                )));
            }
        }
        if let Some(n) = streams.filter(|&n| n > MAX_STREAMS) {
            return Err(errors::invalid_argument(format!(
                "streams must be at most {MAX_STREAMS}, not {n}"
            )));
        }
        if let Some(n) = streams {
            b = b.streams(n);
        }
        if let Some(n) = depth {
            b = b.depth(n);
        }
        match chunk_size {
            Some(0) => {
                return Err(errors::invalid_argument(
                    "chunk_size must be at least 1 byte",
                ));
            }
            Some(n) if n > ferry::core_types::wire::MAX_CHUNK => {
                return Err(errors::invalid_argument(format!(
                    "chunk_size must be at most {} MiB (the largest chunk the wire carries), not {n}",
                    ferry::core_types::wire::MAX_CHUNK >> 20
                )));
            }
            Some(n) => b = b.chunk_size(n),
            None => {}
        }
        if let Some(n) = socket_buffer {
            b = b.socket_buffer((n > 0).then_some(n));
        }
        if let Some(n) = io_threads {
            b = b.io_threads(Some(n));
        }
        if let Some(t) = seconds("request_timeout", request_timeout)? {
            b = b.request_timeout(t);
        }
        if let Some(t) = seconds("connect_timeout", connect_timeout)? {
            b = b.connect_timeout(t);
        }
        if let Some(t) = seconds("dead_peer_after", dead_peer_after)? {
            b = b.dead_peer_after((!t.is_zero()).then_some(t));
        }
        if let Some(path) = auth_key_file {
            b = b.auth_key_file(path);
        }
        if let Some(addr) = metrics {
            // A bare port (`"9400"`) is this host's, as `ferry serve --metrics 9400` takes it.
            let bare = addr.trim().trim_start_matches(':').parse::<u16>().ok();
            b = b.metrics(match bare {
                Some(port) => std::net::SocketAddr::from(([127, 0, 0, 1], port)),
                None => host_port("metrics", addr, "127.0.0.1:9400")?,
            });
        }
        let rt = runtime::get(py)?;
        let inner = runtime::detach(py, || {
            let _enter = rt.enter();
            b.build()
        })?
        .map_err(|e| errors::to_py(py, e))?;
        Ok(Self {
            inner,
            keeper: Keeper::default(),
        })
    }

    /// The address it serves on (`"127.0.0.1:41234"`), or None when it does not listen.
    #[getter]
    fn listen_addr(&self) -> Option<String> {
        self.inner.local_addr().map(|a| a.to_string())
    }

    /// The address its Prometheus metrics are served on (`"127.0.0.1:9400"`), or None.
    #[getter]
    fn metrics_addr(&self) -> Option<String> {
        self.inner.metrics_addr().map(|a| a.to_string())
    }

    /// Its peer id (hex).
    #[getter]
    fn peer_id(&self) -> String {
        self.inner.peer_id().to_string()
    }

    /// Its epoch (hex), chosen at start and never reused.
    #[getter]
    fn epoch(&self) -> String {
        self.inner.epoch().to_string()
    }

    /// The server identity this engine proves to clients that name it (an Ed25519 public key,
    /// 64 hex digits): from `FERRY_IDENTITY_KEY_FILE`, else generated for this process. Put it
    /// in the records peers connect by (`connect(addr, server_identity=...)`).
    #[getter]
    fn server_identity(&self) -> String {
        self.inner.server_identity().to_string()
    }

    /// The portable data plane it chose (`"uring"` or `"tcp"`), or None.
    #[getter]
    fn data_plane(&self) -> Option<&'static str> {
        self.inner.data_plane().map(TransportKind::name)
    }

    /// Registers the memory of `obj`, any object with the buffer protocol (a NumPy array,
    /// `bytearray`, `memoryview`, `mmap`), without copying it, under `name` with `access` for
    /// peers: `"local"` (default: only this engine's requests use it), `"read"`, `"write"` or
    /// `"read+write"`.
    ///
    /// The registration holds a buffer export of `obj`, so the memory stays valid (and in place)
    /// until the registration is closed and no request uses it, even if `obj` is deleted.
    /// Raises `TypeError` for an object without the buffer protocol and for a read-only buffer
    /// with `"write"` access, `ValueError` for a strided buffer or a bad `access`, and
    /// `ResourceExhausted`/`RegistrationError` when the engine refuses it.
    #[pyo3(signature = (obj, name=None, access="local"))]
    fn register(
        &self,
        py: Python<'_>,
        obj: &Bound<'_, PyAny>,
        name: Option<String>,
        access: &str,
    ) -> PyResult<Registration> {
        let access = parse_access(access)?;
        let exported = buffer::export(obj)?;
        if exported.readonly && access.contains(Access::REMOTE_WRITE) {
            return Err(PyTypeError::new_err(format!(
                "cannot register {} for remote write: the buffer of this {} is read-only \
                 (register a writable buffer, or use access=\"read\")",
                name.as_deref()
                    .map_or_else(|| "a buffer".to_owned(), |n| format!("{n:?}")),
                obj.get_type().name()?
            )));
        }
        let name =
            name.unwrap_or_else(|| format!("buffer-{}", UNNAMED.fetch_add(1, Ordering::Relaxed)));
        let len = exported.region.len() as u64;
        let reg = runtime::guard(py, || {
            self.inner
                .register(exported.region, access, &name)
                .map_err(|e| errors::to_py(py, e))
        })?;
        let r = Registration {
            name,
            len,
            readonly: exported.readonly,
            access,
            token: reg.token().to_string(),
            inner: crate::handles::held(reg),
        };
        self.keeper.keep(&r.inner);
        Ok(r)
    }

    /// Allocates `size` bytes on GPU `device` (an ordinal) and registers them under `name` with
    /// `access` for peers (as `register`), returning a `GpuRegistration`: the local side of
    /// `read`/`write`/`Batch` ops like a `Registration` (staged through pinned host buffers over
    /// TCP and io_uring, GPUDirect over RDMA where a route exists), published to peers when
    /// `access` grants them anything. The memory is freed once it is closed (or this engine
    /// is) and the registration object and every request using it are gone.
    ///
    /// The CUDA driver is loaded on the engine's first GPU call: the system's `libcuda.so.1`, or
    /// the file the environment variable `FERRY_LIBCUDA` names then. Raises `Unavailable` (with
    /// the loader's reason) without a driver, `InvalidRequest` (a `ValueError`) for a device the
    /// driver does not list, `ValueError` for a size below 1 or a bad `access`, and `FerryError`
    /// when the driver refuses the allocation.
    #[pyo3(signature = (device, size, name=None, access="local"))]
    fn alloc_gpu(
        &self,
        py: Python<'_>,
        device: i64,
        size: i64,
        name: Option<String>,
        access: &str,
    ) -> PyResult<GpuRegistration> {
        let r = gpu::alloc(py, &self.inner, device, size, name, access)?;
        self.keeper.keep(&r.inner);
        Ok(r)
    }

    /// Registers device memory someone else owns, without copying it: `obj` is any object with
    /// `__cuda_array_interface__` (a PyTorch CUDA tensor, a CuPy array, a Numba device array),
    /// contiguous (strides None or C order), of `product(shape) * itemsize` bytes. Arguments as
    /// for `alloc_gpu`. The registration keeps `obj` alive (and so its memory) until it is
    /// closed (or this engine is) and the registration object and every request using it are
    /// gone.
    ///
    /// The driver says which GPU holds the memory (`cuPointerGetAttribute`) and that the range
    /// lies inside one device allocation; `device` when given (else `obj.device.index`,
    /// PyTorch, else `obj.device.id`, CuPy) is checked against it. Ferry's copies run on its
    /// own non-blocking streams and do not wait for work queued on the producer's stream:
    /// synchronize it (`torch.cuda.synchronize()`, `stream.synchronize()`) before submitting.
    ///
    /// Raises `TypeError` when `obj` has no interface or marks its memory read-only while
    /// `access` grants remote writes, `ValueError` for a non-contiguous, masked or empty array,
    /// an unknown `typestr` or a GPU other than the driver's, `InvalidRequest` (a `ValueError`)
    /// for a range past its allocation or memory that is not device memory, `FerryError` for a
    /// pointer the driver does not know, and `Unavailable` without a driver.
    #[pyo3(signature = (obj, name=None, access="local", device=None))]
    fn register_gpu(
        &self,
        py: Python<'_>,
        obj: &Bound<'_, PyAny>,
        name: Option<String>,
        access: &str,
        device: Option<i64>,
    ) -> PyResult<GpuRegistration> {
        let r = gpu::wrap(py, &self.inner, obj, name, access, device)?;
        self.keeper.keep(&r.inner);
        Ok(r)
    }

    /// Loads `length` bytes of the file at `path` from `file_offset` into the GPU registration
    /// `dst` at `offset` (`length=None`: the rest of the file, clipped to the rest of `dst`), by
    /// cuFile (GPUDirect Storage) where `libcufile.so.0` loads and the file system supports it,
    /// else by positioned reads into pinned buffers and host-to-device copies, pipelined.
    /// Blocks with the GIL released. Returns `{"bytes": n, "path": "gds" | "compat (why)"}`;
    /// `describe()["staging"]["last_file_path"]` says the same. Raises `IoError` (the file),
    /// `OutOfBounds` (past the end of `dst`), `InvalidRequest` (a closed `dst`).
    #[pyo3(signature = (dst, path, *, offset=0, file_offset=0, length=None))]
    #[allow(clippy::too_many_arguments)]
    fn read_file_into_gpu<'py>(
        &self,
        py: Python<'py>,
        dst: &Bound<'py, GpuRegistration>,
        path: std::path::PathBuf,
        offset: i64,
        file_offset: i64,
        length: Option<i64>,
    ) -> PyResult<Bound<'py, PyDict>> {
        gpu::read_file(
            py,
            &self.inner,
            dst.get(),
            path,
            offset,
            file_offset,
            length,
        )
    }

    /// Publishes the file at `path` (its whole size now) as the segment `name` (default: the
    /// path), served to peers by positioned reads and, with `access="read+write"`, writes that
    /// never extend the file. No memory is pinned for it.
    #[pyo3(signature = (path, name=None, access="read"))]
    fn publish_file(
        &self,
        py: Python<'_>,
        path: std::path::PathBuf,
        name: Option<String>,
        access: &str,
    ) -> PyResult<FileRegistration> {
        let access = parse_access(access)?;
        if !access.is_remote() {
            return Err(errors::invalid_argument(
                "a published file needs access \"read\", \"write\" or \"read+write\"",
            ));
        }
        let name = name.unwrap_or_else(|| path.display().to_string());
        let inner = &self.inner;
        let reg = runtime::detach(py, || inner.publish_file_named(&path, access, &name))?
            .map_err(|e| errors::to_py(py, e))?;
        let r = FileRegistration {
            name: reg.name().to_owned(),
            len: reg.len(),
            token: reg.token().to_string(),
            inner: crate::handles::held(reg),
        };
        self.keeper.keep(&r.inner);
        Ok(r)
    }

    /// Connects to the engine serving `addr` (`"host:port"`): handshake, then the data path
    /// over the first transport both ends offer. Blocks with the GIL released (at most the
    /// engine's `connect_timeout`). Raises `StaleEpoch` when the address now has another
    /// epoch than the one this engine met there first, `ProtocolMismatch`, `Timeout`,
    /// `IoError` (refused, unreachable) or `NoRoute`. With `server_identity` (the server's
    /// `server_identity`, 64 hex digits) the address is paired with it, as `expect_server`
    /// does, and a server that does not prove it raises `AuthenticationFailed` naming the
    /// address, whatever keys it holds.
    #[pyo3(signature = (addr, server_identity=None))]
    fn connect(&self, py: Python<'_>, addr: &str, server_identity: Option<&str>) -> PyResult<Peer> {
        let inner = &self.inner;
        let expect = server_identity.map(parse_identity).transpose()?;
        let peer = runtime::block_on(py, || async {
            match expect {
                Some(identity) => inner.connect_expecting(addr, identity).await,
                None => inner.connect(addr).await,
            }
        })?
        .map_err(|e| errors::to_py(py, e))?;
        Ok(Peer { inner: peer })
    }

    /// Pairs `addr` with the server identity `server_identity` (64 hex digits) without
    /// connecting: every handshake with it from now on, this engine's and a `RawEngine`'s on
    /// it, must prove it, else `AuthenticationFailed` naming the address. Needs keys
    /// (`InvalidRequest` without).
    fn expect_server(&self, py: Python<'_>, addr: &str, server_identity: &str) -> PyResult<()> {
        let identity = parse_identity(server_identity)?;
        self.inner
            .expect_server(addr, identity)
            .map(drop)
            .map_err(|e| errors::to_py(py, e))
    }

    /// Forgets the epoch known for `addr` and connects afresh, adopting whatever incarnation
    /// serves it now (descriptors of the old one stay refused).
    fn reresolve(&self, py: Python<'_>, addr: &str) -> PyResult<Peer> {
        let inner = &self.inner;
        let peer =
            runtime::block_on(py, || inner.reresolve(addr))?.map_err(|e| errors::to_py(py, e))?;
        Ok(Peer { inner: peer })
    }

    /// Starts a READ of `remote[remote_offset:+length]` into `local[local_offset:+length]` and
    /// returns its `Request` (`length=None`: the rest of `remote`, which `local` must have room
    /// for, else `OutOfBounds`). `timeout` (seconds) ends it logically once it passes (`None`:
    /// the engine's `request_timeout`; `0`: already passed). Bad arguments raise
    /// before anything moves: `TypeError` (wrong types, a read-only `local`), `ValueError`
    /// (negative numbers), `OutOfBounds`, `AccessDenied`.
    #[pyo3(signature = (local, remote, *, local_offset=0, remote_offset=0, length=None, timeout=None))]
    #[allow(clippy::too_many_arguments)]
    fn read(
        &self,
        py: Python<'_>,
        local: &Bound<'_, PyAny>,
        remote: &Bound<'_, RemoteSegment>,
        local_offset: i64,
        remote_offset: i64,
        length: Option<i64>,
        timeout: Option<f64>,
    ) -> PyResult<Request> {
        let at = (local_offset, remote_offset, length);
        self.one_op(py, OpKind::Read, local, remote, at, timeout)
    }

    /// Starts a WRITE of `local[local_offset:+length]` into `remote[remote_offset:+length]` and
    /// returns its `Request`; arguments and errors as for `read`.
    #[pyo3(signature = (local, remote, *, local_offset=0, remote_offset=0, length=None, timeout=None))]
    #[allow(clippy::too_many_arguments)]
    fn write(
        &self,
        py: Python<'_>,
        local: &Bound<'_, PyAny>,
        remote: &Bound<'_, RemoteSegment>,
        local_offset: i64,
        remote_offset: i64,
        length: Option<i64>,
        timeout: Option<f64>,
    ) -> PyResult<Request> {
        let at = (local_offset, remote_offset, length);
        self.one_op(py, OpKind::Write, local, remote, at, timeout)
    }

    /// Submits a `Batch` as one request: every op is checked against its local registration
    /// and the peer's descriptor first (an error here means nothing moved), then it runs in the
    /// background. Returns its `Request`.
    fn submit(&self, py: Python<'_>, batch: &Bound<'_, Batch>) -> PyResult<Request> {
        let b = batch.borrow();
        self.start(py, &b.ops, b.timeout)
    }

    /// What the engine is and has done, as a dict: identity, listener, transports, data plane,
    /// registrations, published segments, per-route and per-rail counters.
    fn describe<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let d = runtime::guard(py, || Ok(self.inner.describe()))?;
        to_plain(py, &d)
    }

    /// Surfaces native cleanup that failed earlier (an `Unquiesced` registration); returns None
    /// when there is none.
    fn check(&self, py: Python<'_>) -> PyResult<()> {
        self.inner.check().map_err(|e| errors::to_py(py, e))
    }

    /// Stops serving: the listener closes, accepted connections are dropped and every
    /// registration it made is closed (unpublished; memory is released once no request uses it).
    fn shutdown(&self, py: Python<'_>) -> PyResult<()> {
        self.inner.shutdown();
        let keeper = &self.keeper;
        runtime::detach(py, || keeper.close_all())
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_args))]
    fn __exit__(&self, py: Python<'_>, _args: &Bound<'_, pyo3::types::PyTuple>) -> PyResult<()> {
        self.shutdown(py)
    }

    fn __repr__(&self) -> String {
        format!(
            "<ferry.Engine peer_id={} listen={} data_plane={}>",
            self.inner.peer_id(),
            self.inner
                .local_addr()
                .map_or("None".into(), |a| a.to_string()),
            self.inner.data_plane().map_or("None", TransportKind::name)
        )
    }
}

impl Engine {
    /// `read` and `write`: one op of `kind` at `(local_offset, remote_offset, length)`, the
    /// timeout checked first.
    fn one_op(
        &self,
        py: Python<'_>,
        kind: OpKind,
        local: &Bound<'_, PyAny>,
        remote: &Bound<'_, RemoteSegment>,
        (local_offset, remote_offset, length): (i64, i64, Option<i64>),
        timeout: Option<f64>,
    ) -> PyResult<Request> {
        let timeout = seconds("timeout", timeout)?;
        let op = make_op(kind, local, remote, local_offset, remote_offset, length)?;
        self.start(py, &[op], timeout)
    }

    fn start(
        &self,
        py: Python<'_>,
        ops: &[request::PyOp],
        timeout: Option<std::time::Duration>,
    ) -> PyResult<Request> {
        let batch = to_batch(py, ops, timeout)?;
        let rt = runtime::get(py)?;
        runtime::guard(py, || {
            let _enter = rt.enter();
            let handle = self
                .inner
                .submit(batch)
                .map_err(|e| request::segment_error(py, e, ops))?;
            let (watch, canceller) = request::watch(handle);
            Ok(Request { watch, canceller })
        })
    }
}

/// Runs every check of the capability matrix (what `ferry doctor --json` prints) and returns it
/// as a dict: `{"summary": {"transports", "rdma_devices", "gpus", "uring_opcodes"}, "checks":
/// [{"name", "status", "detail", "hint"}, ...]}`. Releases the GIL while
/// probing.
#[pyfunction]
pub(crate) fn doctor(py: Python<'_>) -> PyResult<Bound<'_, PyAny>> {
    let caps = runtime::detach(py, || {
        ferry::capabilities::probe(&ferry::capabilities::ProbeOptions::default())
    })?;
    to_plain(py, &caps)
}

/// Registers the classes and functions of this module.
pub(crate) fn add_to(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<Engine>()?;
    m.add_class::<Registration>()?;
    m.add_class::<FileRegistration>()?;
    m.add_class::<Peer>()?;
    m.add_class::<RemoteSegment>()?;
    m.add_function(pyo3::wrap_pyfunction!(doctor, m)?)?;
    Ok(())
}

/// A server identity given as text (64 hex digits), or `InvalidArgument` naming it.
fn parse_identity(text: &str) -> PyResult<ferry::ServerIdentity> {
    text.parse()
        .map_err(|e: ferry::IdentityError| errors::invalid_argument(e.to_string()))
}
