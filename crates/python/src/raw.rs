//! `RawEngine`: an `Engine` whose memory is named by raw virtual address, the layer under
//! `ferry.mooncake` (and any other API that names memory the way Mooncake's `TransferEngine`
//! and NIXL's agent do). It binds the facade's [`ferry::raw`]: registrations of raw pointers
//! published under opaque names (`raw#<id>/<location>`), their addresses in an index segment
//! published to the same peers, peers whose listed registrations and index map an address to
//! a segment and offset, and batches of `(local address, remote address, length)` that become
//! one ordinary Ferry request.
//!
//! Taking raw pointers is the caller's contract, as in Mooncake: memory given to `register`
//! must stay valid (and, for remote write, writable) until `unregister` and until every request
//! using it ended. Everything else is checked before a byte moves: every local and remote
//! range must lie whole inside one registration, lists must have equal lengths, lengths must
//! not be zero.

use std::collections::HashMap;
use std::ptr::NonNull;
use std::sync::{Arc, Mutex, PoisonError, RwLock};

use ferry::raw::{
    AddressMap, IndexEntry, RawPeer, encode_index, index_name, next_id, segment_name,
};
use ferry::{Batch, LocalMemory, LocalRef, MemoryRegion, OpKind, Outcome, TransferEngine};
use pyo3::prelude::*;

use crate::args::parse_access;
use crate::engine::Engine;
use crate::errors;
use crate::request::{self, PyOutcome, Request, seconds};
use crate::runtime;

/// What keeps a raw registration published (dropping it unpublishes the range).
enum Held {
    Host(ferry::Registration),
    Gpu(ferry::GpuRegistration),
}

impl Held {
    /// The token peers address it by.
    fn token(&self) -> ferry::SegmentToken {
        match self {
            Held::Host(r) => r.token(),
            Held::Gpu(r) => r.token(),
        }
    }
}

/// A local raw registration.
struct Local {
    /// The id its segment name carries (and the index maps to its address).
    id: u64,
    /// Whether peers may touch it (only those are in the index).
    published: bool,
    memory: LocalRef,
    location: String,
    /// How many `register` calls of exactly this range are outstanding (Mooncake lets a caller
    /// register a buffer again; the last `unregister` unpublishes it).
    count: usize,
    held: Held,
}

/// An engine whose memory is named by raw address (see the module's docs).
///
/// `RawEngine(engine)` wraps an `Engine`; it serves (when the engine listens) and connects
/// through it. Registrations made here are published under `raw#<id>/<location>` (no address),
/// and their addresses in the index segment `raw-index#<generation>`, both to every peer, or,
/// with `publish_to` (key names), only to the peers proving one of them.
#[pyclass(name = "RawEngine", module = "ferry", frozen)]
pub(crate) struct RawEngine {
    engine: TransferEngine,
    /// The key names registrations and the index are published to; None: every peer.
    publish_to: Option<Vec<String>>,
    local: RwLock<AddressMap<Local>>,
    /// The published index of the registrations' addresses; replaced on every change, under
    /// this lock.
    index: Mutex<Option<ferry::Registration>>,
    /// Connected peers by the address string callers name them with.
    peers: Mutex<HashMap<String, Arc<RawPeer>>>,
    /// Addresses whose incarnation was lost: the next connect adopts whatever serves there.
    stale: Mutex<std::collections::HashSet<String>>,
}

fn location_is_gpu(location: &str) -> Option<u32> {
    let rest = location
        .strip_prefix("cuda:")
        .or_else(|| location.strip_prefix("gpu:"))?;
    rest.parse().ok()
}

#[pymethods]
impl RawEngine {
    #[new]
    #[pyo3(signature = (engine, publish_to=None))]
    fn new(engine: &Bound<'_, Engine>, publish_to: Option<Vec<String>>) -> PyResult<Self> {
        if publish_to.as_ref().is_some_and(Vec::is_empty) {
            return Err(errors::invalid_argument(
                "publish_to names no peer (None publishes to every peer)",
            ));
        }
        Ok(Self {
            engine: engine.get().inner.clone(),
            publish_to,
            local: RwLock::new(AddressMap::new()),
            index: Mutex::new(None),
            peers: Mutex::new(HashMap::new()),
            stale: Mutex::new(Default::default()),
        })
    }

    /// Registers `length` bytes at address `addr` in `location` (`"cpu:0"`, `"cuda:N"`; any
    /// other string is host memory) with `access` for peers (default `"read+write"`), and
    /// publishes it under `raw#<id>/<location>`, its address in the index. Registering exactly
    /// the same range
    /// again only counts it; a range that overlaps another registration is refused
    /// (`InvalidArgument`). `cuda:N` memory goes through the CUDA driver (`Unavailable`
    /// without one).
    #[pyo3(signature = (addr, length, location="cpu:0", access="read+write"))]
    fn register(
        &self,
        py: Python<'_>,
        addr: u64,
        length: u64,
        location: &str,
        access: &str,
    ) -> PyResult<()> {
        let access = parse_access(access)?;
        {
            let mut map = self.local.write().unwrap_or_else(PoisonError::into_inner);
            if let Some(e) = map.get_mut(addr)
                && e.len == length
            {
                e.value.count += 1;
                return Ok(());
            }
            // Checked before anything native is made.
            map.check_free(addr, length)
                .map_err(|reason| errors::invalid_argument(format!("register: {reason}")))?;
        }
        let Some(ptr) = usize::try_from(addr)
            .ok()
            .and_then(|a| NonNull::new(a as *mut u8))
        else {
            return Err(errors::invalid_argument("register: address 0"));
        };
        let len = usize::try_from(length)
            .map_err(|_| errors::invalid_argument(format!("register: length {length}")))?;
        let rt = runtime::get(py)?;
        let engine = &self.engine;
        // "*" (Mooncake's "find out"): device memory where a driver says so, else host memory.
        let gpu = match (location, location_is_gpu(location)) {
            (_, Some(ordinal)) => {
                let cuda = engine.cuda().map_err(|e| errors::to_py(py, e))?;
                Some((cuda, Some(ordinal)))
            }
            ("*", None) => engine.cuda().ok().map(|c| (c, None)),
            _ => None,
        };
        if let Some((cuda, ordinal)) = gpu {
            // SAFETY: the caller's contract (Mooncake's): `addr..+length` is memory it keeps
            // valid until it unregisters it and every request using it ended. The driver
            // checks that the range lies inside one device allocation and says which GPU holds
            // it (`wrap_located`), or refuses; Ferry hands the address only to the driver's
            // copies and the NIC registration, never to host code.
            let wrapped =
                runtime::detach(py, || unsafe { cuda.wrap_located(addr, len, Box::new(())) })?;
            match (wrapped, ordinal) {
                (Ok(memory), _) => {
                    let on = memory.location().ordinal;
                    if ordinal.is_some_and(|o| o != on) {
                        return Err(errors::invalid_argument(format!(
                            "register: the driver places {addr:#x} on GPU {on}, not on {location}"
                        )));
                    }
                    let location = format!("cuda:{on}");
                    let id = next_id();
                    let name = segment_name(id, &location);
                    let memory = Arc::new(memory);
                    let reg = runtime::detach(py, || {
                        let _enter = rt.enter();
                        match self.audience() {
                            Some(peers) => engine.register_gpu_to(memory, access, &name, &peers),
                            None => engine.register_gpu(memory, access, &name),
                        }
                    })?
                    .map_err(|e| errors::to_py(py, e))?;
                    let local = Local {
                        id,
                        published: access.is_remote(),
                        memory: reg.local_ref(),
                        location,
                        count: 1,
                        held: Held::Gpu(reg),
                    };
                    return self.insert(py, addr, length, local);
                }
                (Err(e), Some(_)) => return Err(crate::gpu::cuda_err(py, e)),
                // "*" and the driver does not know the address: host memory.
                (Err(_), None) => {}
            }
        }
        let location = if location == "*" { "cpu:0" } else { location };
        // SAFETY: the caller's contract (Mooncake's): `addr..+length` is memory of this process
        // that stays valid, and in place, until it unregisters it and every request using it
        // ended; with remote-write access it is writable. Ferry makes no Rust reference into it
        // that outlives a copy (`MemoryRegion`'s concurrency model).
        let region = unsafe { MemoryRegion::from_raw_parts(ptr, len, Box::new(())) };
        self.publish_host(py, addr, length, location, access, region)
    }

    /// Unregisters the registration whose base address is `addr` (once per `register` of it):
    /// it is unpublished, and its memory is free once the requests using it ended. Raises
    /// `UnknownAddress` when no registration starts at `addr`.
    fn unregister(&self, py: Python<'_>, addr: u64) -> PyResult<()> {
        let gone = {
            let mut map = self.local.write().unwrap_or_else(PoisonError::into_inner);
            match map.get_mut(addr) {
                None => {
                    let reason = "no registration starts there";
                    return Err(errors::to_py(py, local_unknown(addr, 0, reason)));
                }
                Some(e) if e.value.count > 1 => {
                    e.value.count -= 1;
                    None
                }
                Some(_) => map.remove(addr),
            }
        };
        if gone.is_some() {
            // Out of the index first: no peer maps an address to it from now on. An index that
            // could not be replaced keeps its entry, which maps nothing: peers map only the
            // segments listed, and this one is unpublished below.
            let _ = self.republish(py);
        }
        // Dropping the handle unpublishes it; off the GIL, it may wait for native cleanup.
        runtime::detach(py, || drop(gone))?;
        Ok(())
    }

    /// The local registrations: `(address, length, location, token)` in address order.
    fn registrations(&self) -> Vec<(u64, u64, String, String)> {
        let map = self.local.read().unwrap_or_else(PoisonError::into_inner);
        map.iter()
            .map(|e| {
                (
                    e.base,
                    e.len,
                    e.value.location.clone(),
                    e.value.held.token().to_string(),
                )
            })
            .collect()
    }

    /// Allocates `length` bytes of zeroed, page-aligned host memory owned by Ferry, registers
    /// it like `register` (location `"cpu:0"`) and returns its address. The memory is freed
    /// once it is unregistered and no request uses it any more, so a request still running
    /// never touches freed memory.
    #[pyo3(signature = (length, access="read+write"))]
    fn allocate(&self, py: Python<'_>, length: u64, access: &str) -> PyResult<u64> {
        let access = parse_access(access)?;
        let len = usize::try_from(length)
            .ok()
            .filter(|&n| n > 0)
            .ok_or_else(|| {
                errors::invalid_argument(format!(
                    "allocate: length must be at least 1, not {length}"
                ))
            })?;
        // In a memfd of its own, which same-host peers with the right may map and copy with
        // one-sidedly (docs/architecture.md 4.2); plain memory where no memfd can be made.
        let region = match MemoryRegion::alloc_shareable(len) {
            Ok(r) => r,
            // No memfd here (no memfd_create, sealing refused): plain memory, not shareable.
            Err(_) => MemoryRegion::alloc_zeroed(len, ferry::PAGE_ALIGN).map_err(|e| {
                errors::err(
                    py,
                    errors::Kind::ResourceExhausted,
                    format!("allocate {length} bytes: {e}"),
                )
            })?,
        };
        let addr = region.as_ptr() as u64;
        self.publish_host(py, addr, length, "cpu:0", access, region)?;
        Ok(addr)
    }

    /// Why GPU memory cannot be used here (the CUDA driver's loader error, naming libcuda), or
    /// None when a driver is loaded.
    fn cuda_unavailable(&self) -> Option<String> {
        self.engine.cuda().err().map(|e| e.to_string())
    }

    /// The registrations peer `peer` (`"host:port"`) lists now: `(address, length, location)`
    /// in address order. Connects first if need be; asks the peer afresh.
    fn remote_registrations(
        &self,
        py: Python<'_>,
        peer: &str,
    ) -> PyResult<Vec<(u64, u64, String)>> {
        let map = runtime::block_on(py, || async {
            let p = self.peer(peer).await?;
            p.refresh(&self.engine).await?;
            Ok::<_, ferry::Error>(p.registrations())
        })?
        .map_err(|e| errors::to_py(py, e))?;
        Ok(map
            .iter()
            .map(|e| (e.base, e.len, e.value.location.clone()))
            .collect())
    }

    /// Checks that every `(addrs[i], lengths[i])` lies whole in one registration of `peer`
    /// (looked up in a fresh listing once where the last one lacks it), or of this engine
    /// when `peer` is None; raises `UnknownAddress` naming the first that does not. Moves
    /// nothing.
    #[pyo3(signature = (peer, addrs, lengths))]
    fn check(
        &self,
        py: Python<'_>,
        peer: Option<&str>,
        addrs: Vec<u64>,
        lengths: Vec<u64>,
    ) -> PyResult<()> {
        if addrs.len() != lengths.len() {
            return Err(errors::invalid_argument(format!(
                "{} addresses but {} lengths",
                addrs.len(),
                lengths.len()
            )));
        }
        let Some(peer) = peer else {
            let map = self.local.read().unwrap_or_else(PoisonError::into_inner);
            for (&addr, &len) in addrs.iter().zip(&lengths) {
                if let Err(miss) = map.lookup(addr, len) {
                    return Err(errors::to_py(py, local_unknown(addr, len, miss)));
                }
            }
            return Ok(());
        };
        runtime::block_on(py, || async {
            let p = self.peer(peer).await?;
            p.holding(&self.engine, &addrs, &lengths).await.map(drop)
        })?
        .map_err(|e| self.fail(py, peer, e))
    }

    /// Connects to `peer` (`"host:port"`) unless connected; blocks with the GIL released.
    fn connect(&self, py: Python<'_>, peer: &str) -> PyResult<()> {
        runtime::block_on(py, || self.peer(peer))?
            .map(drop)
            .map_err(|e| errors::to_py(py, e))
    }

    /// Forgets the connection to `peer`, so that the next call connects afresh (adopting a
    /// restarted incarnation).
    fn forget(&self, peer: &str) {
        self.peers
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(peer);
        self.stale
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(peer.to_owned());
    }

    /// Moves `lengths[i]` bytes between local address `local[i]` and `peer`'s address
    /// `remote[i]`, for every `i`, as one request (`op`: `"read"` or `"write"`), and returns its
    /// `Outcome` once it ended *and* drained: nothing of it still moves. Blocks with the GIL
    /// released. Every range is checked first (an address the peer's listing lacks is looked
    /// up in a fresh listing once): `UnknownAddress`, `InvalidArgument` (unequal lists, no op)
    /// are raised before anything moves. A failed request raises its `FerryError` subclass with
    /// the `Outcome` as `outcome` (how many ops completed, what failed WRITEs may have done).
    #[pyo3(signature = (peer, op, local, remote, lengths, timeout=None))]
    #[allow(clippy::too_many_arguments)]
    fn transfer(
        &self,
        py: Python<'_>,
        peer: &str,
        op: &str,
        local: Vec<u64>,
        remote: Vec<u64>,
        lengths: Vec<u64>,
        timeout: Option<f64>,
    ) -> PyResult<PyOutcome> {
        let outcome = self.start(
            py,
            peer,
            op,
            &local,
            &remote,
            &lengths,
            timeout,
            |handle, _| async {
                // Interrupted (Ctrl-C), this future is dropped: the request is cancelled then.
                let cancel = CancelOnDrop(Some(handle.canceller()));
                let drained = handle.drained();
                handle.await;
                let outcome = drained.await;
                cancel.disarm();
                outcome
            },
        )?;
        self.settle(py, peer, outcome)
    }

    /// Like `transfer`, but returns at once with the running `Request` (its `wait`, `done`,
    /// `cancel` and `wait_drained`). The checks are the same and raise here. With `notify`
    /// (`(name, message)`), the message goes to the peer (`notify`) once every op completed,
    /// and the request is done only then; its failure is the request's `after_error`.
    #[pyo3(signature = (peer, op, local, remote, lengths, timeout=None, notify=None))]
    #[allow(clippy::too_many_arguments)]
    fn submit(
        &self,
        py: Python<'_>,
        peer: &str,
        op: &str,
        local: Vec<u64>,
        remote: Vec<u64>,
        lengths: Vec<u64>,
        timeout: Option<f64>,
        notify: Option<(String, Vec<u8>)>,
    ) -> PyResult<Request> {
        let engine = self.engine.clone();
        let (watch, canceller) = self.start(
            py,
            peer,
            op,
            &local,
            &remote,
            &lengths,
            timeout,
            |handle, p| {
                let after = notify.map(|(name, message)| async move {
                    engine.notify(p.peer(), &name, &message).await
                });
                async move { request::watch_then(handle, after) }
            },
        )?;
        Ok(Request { watch, canceller })
    }

    /// Sends `message` (bytes) to peer `peer`'s inbox under the name `name`, once; returns
    /// once the peer holds it. Call it after the transfer it speaks of completed: it never
    /// arrives before that transfer's bytes. Blocks with the GIL released.
    fn notify(&self, py: Python<'_>, peer: &str, name: &str, message: Vec<u8>) -> PyResult<()> {
        runtime::block_on(py, || async {
            let p = self.peer(peer).await?;
            self.engine.notify(p.peer(), name, &message).await
        })?
        .map_err(|e| self.fail(py, peer, e))
    }

    /// The notifications peers sent this engine since the last call, oldest first:
    /// `(name, message, peer_id, key_name, epoch)` each. `name` is what the sender called
    /// itself (never proven); `key_name` is the key the sender proved (None without keys), and
    /// `peer_id` and `epoch` the incarnation it named in its handshake (bound to that key's
    /// proof where keys are in use, only claimed without).
    #[allow(clippy::type_complexity)]
    fn take_notifications(&self) -> Vec<(String, Vec<u8>, String, Option<String>, String)> {
        self.engine
            .take_notifications()
            .into_iter()
            .map(|n| {
                (
                    n.name,
                    n.message,
                    n.from.to_string(),
                    n.key_name,
                    n.epoch.to_string(),
                )
            })
            .collect()
    }

    /// The names of the keys this engine accepts (its keyring's, the one it proves first);
    /// empty without keys. A name with a key of its own is proven only by that key.
    fn key_names(&self) -> Vec<String> {
        self.engine.key_names()
    }

    fn __repr__(&self) -> String {
        let n = self
            .local
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .len();
        format!(
            "<ferry.RawEngine peer_id={} registrations={n}>",
            self.engine.peer_id()
        )
    }
}

/// Cancels a request when dropped before [`disarm`](Self::disarm): a wait for it that was
/// interrupted ends the request too.
struct CancelOnDrop(Option<ferry::Canceller>);

impl CancelOnDrop {
    fn disarm(mut self) {
        self.0 = None;
    }
}

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        if let Some(c) = self.0.take() {
            c.cancel();
        }
    }
}

/// A local range in no registration of this engine (nothing was sent).
fn local_unknown(addr: u64, len: u64, reason: impl std::fmt::Display) -> ferry::Error {
    ferry::Error::UnknownAddress {
        side: "local",
        peer: "this engine".into(),
        addr,
        len,
        reason: reason.to_string(),
    }
}

fn op_kind(op: &str) -> PyResult<OpKind> {
    match op {
        "read" => Ok(OpKind::Read),
        "write" => Ok(OpKind::Write),
        other => Err(errors::invalid_argument(format!(
            "op must be \"read\" or \"write\", not {other:?}"
        ))),
    }
}

fn check_lists(local: &[u64], remote: &[u64], lengths: &[u64]) -> PyResult<()> {
    if local.len() != remote.len() || local.len() != lengths.len() {
        return Err(errors::invalid_argument(format!(
            "the lists of local addresses, remote addresses and lengths must have one entry per \
             op; they have {}, {} and {}",
            local.len(),
            remote.len(),
            lengths.len()
        )));
    }
    if local.is_empty() {
        return Err(errors::invalid_argument("a transfer needs at least one op"));
    }
    Ok(())
}

impl RawEngine {
    /// Checks the arguments, resolves every range, submits the request (all with the GIL
    /// released, on the runtime) and hands its handle to `then`; an error before the submit
    /// means nothing moved.
    #[allow(clippy::too_many_arguments)]
    fn start<T, F>(
        &self,
        py: Python<'_>,
        peer: &str,
        op: &str,
        local: &[u64],
        remote: &[u64],
        lengths: &[u64],
        timeout: Option<f64>,
        then: impl FnOnce(ferry::RequestHandle, Arc<RawPeer>) -> F + Send,
    ) -> PyResult<T>
    where
        F: std::future::Future<Output = T>,
        T: Send,
    {
        let kind = op_kind(op)?;
        check_lists(local, remote, lengths)?;
        let timeout = seconds("timeout", timeout)?;
        runtime::block_on(py, || async {
            let p = self.peer(peer).await?;
            let batch = self
                .batch(&p, kind, local, remote, lengths, timeout)
                .await?;
            let handle = self.engine.submit(batch)?;
            Ok::<T, ferry::Error>(then(handle, p).await)
        })?
        .map_err(|e| self.fail(py, peer, e))
    }

    /// Registers host `region` (at `addr`) and enters it in the local map.
    fn publish_host(
        &self,
        py: Python<'_>,
        addr: u64,
        length: u64,
        location: &str,
        access: ferry::Access,
        region: MemoryRegion,
    ) -> PyResult<()> {
        let rt = runtime::get(py)?;
        let id = next_id();
        let name = segment_name(id, location);
        let reg = runtime::detach(py, || {
            let _enter = rt.enter();
            match self.audience() {
                Some(peers) => self.engine.register_to(region, access, &name, &peers),
                None => self.engine.register(region, access, &name),
            }
        })?
        .map_err(|e| errors::to_py(py, e))?;
        let local = Local {
            id,
            published: access.is_remote(),
            memory: reg.local_ref(),
            location: location.to_owned(),
            count: 1,
            held: Held::Host(reg),
        };
        self.insert(py, addr, length, local)
    }

    /// The key names to publish to (None: every peer).
    fn audience(&self) -> Option<Vec<&str>> {
        self.publish_to
            .as_ref()
            .map(|names| names.iter().map(String::as_str).collect())
    }

    /// Enters a registration in the local map and its address in a new index (a range
    /// registered meanwhile by another thread is refused, and this registration dropped; so
    /// is one whose index could not be published).
    fn insert(&self, py: Python<'_>, addr: u64, length: u64, local: Local) -> PyResult<()> {
        {
            let mut map = self.local.write().unwrap_or_else(PoisonError::into_inner);
            map.insert(addr, length, local)
                .map_err(|reason| errors::invalid_argument(format!("register: {reason}")))?;
        }
        if let Err(e) = self.republish(py) {
            let gone = self
                .local
                .write()
                .unwrap_or_else(PoisonError::into_inner)
                .remove(addr);
            runtime::detach(py, || drop(gone))?;
            return Err(e);
        }
        Ok(())
    }

    /// Publishes the index of the published registrations as they are now, to the same peers
    /// as they are, in place of the last one (a new generation first, then the old one goes).
    fn republish(&self, py: Python<'_>) -> PyResult<()> {
        let mut index = self.index.lock().unwrap_or_else(PoisonError::into_inner);
        let entries: Vec<IndexEntry> = {
            let map = self.local.read().unwrap_or_else(PoisonError::into_inner);
            map.iter()
                .filter(|e| e.value.published)
                .map(|e| IndexEntry {
                    id: e.value.id,
                    base: e.base,
                    len: e.len,
                })
                .collect()
        };
        let old = if entries.is_empty() {
            index.take()
        } else {
            let rt = runtime::get(py)?;
            let region = MemoryRegion::from_vec(encode_index(&entries));
            let name = index_name(next_id());
            let access = ferry::Access::REMOTE_READ;
            let reg = runtime::detach(py, || {
                let _enter = rt.enter();
                match self.audience() {
                    Some(peers) => self.engine.register_to(region, access, &name, &peers),
                    None => self.engine.register(region, access, &name),
                }
            })?
            .map_err(|e| errors::to_py(py, e))?;
            index.replace(reg)
        };
        runtime::detach(py, || drop(old))?;
        Ok(())
    }

    /// The connected peer named `peer`, connecting (or, after [`forget`](Self::forget),
    /// re-resolving) if need be.
    async fn peer(&self, peer: &str) -> Result<Arc<RawPeer>, ferry::Error> {
        if let Some(p) = self
            .peers
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(peer)
        {
            return Ok(p.clone());
        }
        let stale = self
            .stale
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(peer);
        let connected = if stale {
            self.engine.reresolve(peer).await?
        } else {
            self.engine.connect(peer).await?
        };
        let p = Arc::new(RawPeer::new(connected));
        Ok(self
            .peers
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .entry(peer.to_owned())
            .or_insert(p)
            .clone())
    }

    /// The batch of `kind` ops, every range resolved (nothing sent yet).
    async fn batch(
        &self,
        p: &RawPeer,
        kind: OpKind,
        local: &[u64],
        remote: &[u64],
        lengths: &[u64],
        timeout: Option<std::time::Duration>,
    ) -> Result<Batch, ferry::Error> {
        // One snapshot of the peer's registrations holds every remote range; each is looked up
        // by reference, and its segment copied once, into the batch, as Ferry's own API does.
        let remotes = p.holding(&self.engine, remote, lengths).await?;
        let mut batch = Batch::new();
        let map = self.local.read().unwrap_or_else(PoisonError::into_inner);
        for ((&addr, &raddr), &len) in local.iter().zip(remote).zip(lengths) {
            let (e, off) = map
                .lookup(addr, len)
                .map_err(|miss| local_unknown(addr, len, miss))?;
            let (r, roff) = remotes
                .lookup(raddr, len)
                .map_err(|miss| p.unknown(raddr, len, &miss))?;
            batch.push(kind, &e.value.memory, off, &r.value.segment, roff, len);
        }
        drop(map);
        if let Some(t) = timeout {
            batch = batch.timeout(t);
        }
        Ok(batch)
    }

    /// An error before or while submitting: a peer that could not be reached, or answered as
    /// another incarnation, is connected afresh next time.
    fn fail(&self, py: Python<'_>, peer: &str, e: ferry::Error) -> PyErr {
        if matches!(
            e,
            ferry::Error::StaleEpoch { .. } | ferry::Error::PeerLost { .. }
        ) {
            self.forget(peer);
        }
        errors::to_py(py, e)
    }

    /// A drained outcome: returned when it succeeded, raised otherwise (a lost peer is
    /// connected afresh next time).
    fn settle(&self, py: Python<'_>, peer: &str, outcome: Outcome) -> PyResult<PyOutcome> {
        if let Some(f) = outcome.failure
            && matches!(
                f.kind,
                ferry::FailureKind::PeerLost
                    | ferry::FailureKind::Remote(ferry::RemoteStatus::StaleEpoch)
            )
        {
            self.forget(peer);
        }
        let o = PyOutcome(outcome);
        request::raise_failure(py, &o)?;
        Ok(o)
    }
}

/// Adds `RawEngine` to the module.
pub(crate) fn add_to(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<RawEngine>()?;
    m.add_function(pyo3::wrap_pyfunction!(topology_json, m)?)
}

/// Ferry's view of this machine's topology (sysfs and the verbs device list) as JSON: NICs
/// with their NUMA nodes, GPUs, and the NICs assigned to each GPU (`ferry topology --json`).
#[pyfunction]
fn topology_json(py: Python<'_>) -> PyResult<String> {
    runtime::detach(py, || {
        let listing = ferry::rdma_devices::enumerate_verbs_devices();
        let verbs = ferry::topology::VerbsDevices {
            names: listing.devices.into_iter().map(|d| d.name).collect(),
            unavailable: listing.unavailable,
        };
        ferry::topology::Topology::discover("/sys", &verbs, &ferry::topology::Selector::default())
            .and_then(|t| t.to_json())
            .map_err(|e| e.to_string())
    })?
    .map_err(|reason| errors::err(py, errors::Kind::Unavailable, format!("topology: {reason}")))
}
