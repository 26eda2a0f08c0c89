"""Ray Direct Transport on Ferry: the ``FERRY`` tensor transport (docs/ray.md).

Register it once in the driver, before the actors are made (and, harmlessly, again in each
actor's ``__init__``), then name it where Ray takes a tensor transport::

    import ray, torch, ferry.ray

    ray.init()
    ferry.ray.register()

    @ray.remote
    class Trainer:
        @ray.method(tensor_transport="FERRY")
        def weights(self) -> torch.Tensor:
            return self.w

    ref = trainer.weights.remote()        # the tensor stays in the trainer
    worker.load.remote(ref)               # the worker reads it from the trainer's memory

The transport is one-sided: the receiving actor reads the source's memory with an ordinary
Ferry request, on the fastest plane the two processes share (same-host copies on one host,
RDMA, io_uring or TCP across hosts). Each process that takes part has one Ferry engine,
listening on the Ray node's address (``FERRY_BIND_ADDRESS`` overrides it) and keyed by
``FERRY_AUTH_KEY_FILE`` when that is set (pass it to the actors in ``runtime_env``).

How Ray's ``TensorTransportManager`` contract maps onto Ferry:

- ``extract_tensor_transport_metadata`` (source): each tensor's whole storage is registered
  once (a cache keyed by the storage, shared by overlapping views and by every object holding
  it) and published for reading; the metadata names the engine's address, its incarnation,
  and each tensor's segment, offset and length.
- ``fetch_multiple_tensors`` / ``wait_fetch_complete`` (receiver): one request of READs, one
  per tensor, straight into the receiving tensors (Ray's ``target_buffers`` when given, so
  there is no extra copy; else, on the CPU, buffers of a receive pool reused once free, which
  saves fresh memory's first touch: ``_RecvPool``).
- ``abort_transport`` cancels the object's request and returns once it drained: no byte of it
  can still move.
- ``garbage_collect`` (source) releases the object's hold on each storage; the last one
  unpublishes it. A request still reading it keeps the memory alive until it ended.
- Errors are ``ray.exceptions.RayDirectTransportError`` naming the object, both actors, the
  source's address and Ferry's reason.
"""

from __future__ import annotations

import itertools
import logging
import os
import sys
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

import ray
from ray.experimental.rdt.tensor_transport_manager import (
    CommunicatorMetadata,
    FetchRequest,
    TensorTransportManager,
    TensorTransportMetadata,
)

import ferry

if TYPE_CHECKING:
    import torch

__all__ = [
    "TRANSPORT",
    "TRANSPORT_NUMPY",
    "TRANSPORT_RELAY",
    "FerryCommunicatorMetadata",
    "FerryNumpyTransport",
    "FerryRelayTransport",
    "FerryTensorTransport",
    "FerryTransportMetadata",
    "deregister_memory",
    "manager",
    "register",
    "register_memory",
]

logger = logging.getLogger("ferry.ray")

#: The name Ray programs give the transport (``tensor_transport="FERRY"``; Ray upper-cases it).
TRANSPORT = "FERRY"
#: The name for ``numpy.ndarray`` objects (``tensor_transport="FERRY_NUMPY"``).
TRANSPORT_NUMPY = "FERRY_NUMPY"
#: The name for torch tensors read by many actors (``tensor_transport="FERRY_RELAY"``): each
#: object is a Ferry broadcast, and readers relay verified chunks to one another.
TRANSPORT_RELAY = "FERRY_RELAY"
#: How long a ``FERRY_RELAY`` reader keeps relaying after it has every byte, at most (seconds;
#: it stops as soon as every reader it knows of has finished).
RELAY_LINGER = 30.0

_register_lock = threading.Lock()


def register() -> None:
    """Registers Ferry's tensor transports with Ray in this process: ``FERRY`` for
    ``torch.Tensor`` (``cpu`` and ``cuda``; when torch imports) and ``FERRY_NUMPY`` for
    ``numpy.ndarray`` (``cpu``), and ``FERRY_RELAY`` for torch tensors that many actors read
    (readers relay to one another). Ray gives each transport name one data type, hence several
    names; all share this process's engine, connections and registrations. Idempotent: call it in the
    driver before making the actors that use it, and again wherever convenient (an actor's
    ``__init__``); a second call does nothing. Ray copies the registrations of the driver into
    each actor it makes afterwards."""
    import numpy
    from ray.experimental.rdt import util

    try:
        import torch
    except ImportError:  # numpy-only: FERRY_NUMPY alone
        torch = None
    wanted = [(TRANSPORT_NUMPY, ["cpu"], FerryNumpyTransport, numpy.ndarray)]
    if torch is not None:
        wanted[:0] = [
            (TRANSPORT, ["cpu", "cuda"], FerryTensorTransport, torch.Tensor),
            (TRANSPORT_RELAY, ["cpu", "cuda"], FerryRelayTransport, torch.Tensor),
        ]
    with _register_lock:
        for name, devices, cls, data_type in wanted:
            info = util.transport_manager_info.get(name)
            if info is not None:
                if info.transport_manager_class is not cls:
                    raise ValueError(
                        f"the tensor transport {name} is already registered with "
                        f"{info.transport_manager_class.__qualname__}, not Ferry's"
                    )
                continue
            util.register_tensor_transport(name, devices, cls, data_type)


@dataclass
class FerryCommunicatorMetadata(CommunicatorMetadata):
    """Nothing: a one-sided read needs no rendezvous (the tensor metadata names the source)."""


@dataclass
class FerryTransportMetadata(TensorTransportMetadata):
    """Where an object's tensors lie: the source engine and, per tensor, ``(segment, offset,
    nbytes)`` (``segment`` None for an empty tensor).

    Args:
        addr: The address the source's engine listens on.
        peer_id: The source engine's peer id (hex), to tell a restarted process at the address.
        epoch: The source engine's epoch (hex).
        server_identity: The identity the source proves to clients that expect it (with keys).
        source: Who made the object (actor id and name, or the driver), for error messages.
        segments: Per tensor, the segment holding it, its offset in it, and its length.
        kinds: Per tensor, ``"torch"`` or ``"numpy"`` (what the receiver makes).
        relay: ``FERRY_RELAY`` only: the object's broadcast, as (control address, broadcast
            name, manifest digest); its tensors are named ``t<i>`` by their index.
    """

    addr: Optional[str] = None
    peer_id: Optional[str] = None
    epoch: Optional[str] = None
    server_identity: Optional[str] = None
    source: Optional[str] = None
    segments: list = field(default_factory=list)
    kinds: list = field(default_factory=list)
    relay: Optional[tuple] = None

    __eq__ = object.__eq__
    __hash__ = object.__hash__


@dataclass
class _Held:
    """A published storage: its registration and how many objects hold it."""

    registration: Any
    name: str
    objects: int


@dataclass
class FerryFetchRequest(FetchRequest):
    """A fetch in flight: its Ferry request, the receive buffers' registrations, and where it
    reads from. Dropping it unwaited cancels the request and waits for it to drain."""

    request: Any = None
    registrations: list = field(default_factory=list)
    addr: Optional[str] = None
    source: Optional[str] = None
    transport: Any = None
    finished: bool = False
    relay: Any = None

    # By identity: the generated comparison would compare tensors element by element.
    __eq__ = object.__eq__
    __hash__ = object.__hash__

    def _finish(self) -> None:
        if self.finished:
            return
        self.finished = True
        if self.request is not None and not self.request.done():
            self.request.cancel()
        if self.request is not None:
            try:
                self.request.wait_drained()
            except Exception:  # the request's end was already reported, or will be
                pass
        for reg in self.registrations:
            reg.close()
        self.registrations = []
        if self.transport is not None:
            self.transport._forget_inflight(self.obj_id, self)

    def __del__(self) -> None:
        try:
            self._finish()
        except Exception:
            pass


def _who() -> str:
    """This process as error messages name it: the actor (id and name) or the driver."""
    try:
        ctx = ray.get_runtime_context()
        actor_id = ctx.get_actor_id()
    except Exception:
        return f"process {os.getpid()}"
    if actor_id is None:
        return f"the driver (pid {os.getpid()})"
    name = None
    try:
        name = ctx.get_actor_name()
    except Exception:
        pass
    return f"actor {actor_id}" + (f" ({name!r})" if name else "")


def _listen_address() -> str:
    """Where this process's engine listens: ``FERRY_BIND_ADDRESS`` (a host, or host:port),
    else the Ray node's address, any free port."""
    bind = os.environ.get("FERRY_BIND_ADDRESS")
    if bind:
        return bind if ":" in bind.rsplit("]", 1)[-1] else f"{bind}:0"
    host = ray.util.get_node_ip_address()
    return f"[{host}]:0" if ":" in host else f"{host}:0"


def _is_torch(x: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


def _is_numpy(x: Any) -> bool:
    np = sys.modules.get("numpy")
    return np is not None and isinstance(x, np.ndarray)


def _kind(x: Any) -> str:
    """``"torch"`` or ``"numpy"``; TypeError for anything else."""
    if _is_torch(x):
        return "torch"
    if _is_numpy(x):
        return "numpy"
    raise TypeError(f"{TRANSPORT} moves torch tensors and numpy arrays, not {type(x).__name__}")


def _device_type(x: Any) -> str:
    return x.device.type if _is_torch(x) else "cpu"


def _nbytes(x: Any) -> int:
    return x.numel() * x.element_size() if _is_torch(x) else int(x.nbytes)


def _contiguous(x: Any) -> bool:
    return x.is_contiguous() if _is_torch(x) else bool(x.flags.c_contiguous)


def _data_ptr(x: Any) -> int:
    return x.data_ptr() if _is_torch(x) else int(x.ctypes.data)


def _byte_view(t: Any) -> Any:
    """``t``'s bytes as a flat uint8 tensor (or array) over the same memory (``t`` contiguous)."""
    if _is_numpy(t):
        import numpy as np

        return t.reshape(-1).view(np.uint8)
    import torch

    flat = t.detach().reshape(-1)
    return flat if flat.dtype == torch.uint8 else flat.view(torch.uint8)


def _numpy_root(a: Any) -> Any:
    """The outermost array whose memory holds ``a`` (its ``base`` chain): views of one array
    share that array's registration. ``a`` itself when the root does not cover it as one
    contiguous range."""
    import numpy as np

    root = a
    while isinstance(root.base, np.ndarray):
        root = root.base
    lo, hi = int(a.ctypes.data), int(a.ctypes.data) + int(a.nbytes)
    rlo = int(root.ctypes.data)
    if root is not a and root.flags.c_contiguous and rlo <= lo and hi <= rlo + int(root.nbytes):
        return root
    return a


def _storage_key(t: Any) -> tuple[str, int, int]:
    """The cache key of the memory under ``t``: device, address and length of a torch
    tensor's storage, or of a numpy array's root."""
    if _is_numpy(t):
        root = _numpy_root(t)
        return ("cpu", int(root.ctypes.data), int(root.nbytes))
    storage = t.untyped_storage()
    return (str(t.device), storage.data_ptr(), storage.nbytes())


def _storage_whole(t: Any) -> Any:
    """The whole memory under ``t`` (what ``_storage_key`` names) as a flat uint8 tensor or
    array: made only to publish it, on a cache miss."""
    if _is_numpy(t):
        return _byte_view(_numpy_root(t))
    import torch

    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())


class _State:
    """What every Ferry transport of a process shares (Ray makes one manager per transport
    name): the engine, the published storages, the connected sources, the fetches."""

    def __init__(self) -> None:
        self.engine: Optional[ferry.Engine] = None


_shared: dict[str, Any] = {}
_shared_lock = threading.Lock()


class FerryTensorTransport(TensorTransportManager):
    """Ray's ``TensorTransportManager`` on Ferry (the module's docs), for ``torch.Tensor``
    (``FERRY``). Ray makes one per transport name and process; every instance in a process
    shares one state (one engine, one registration cache)."""

    def __init__(self) -> None:
        with _shared_lock:
            if not _shared:
                self._init_state()
                _shared.update(self.__dict__)
            else:
                self.__dict__.update(_shared)

    def _init_state(self) -> None:
        self._lock = threading.RLock()
        self._box = _State()
        self._names = itertools.count()
        # Published storages by (device, storage address), and the storages each object holds.
        self._storages: dict[tuple[str, int], _Held] = {}
        self._objects: dict[str, list[tuple[str, int, int]]] = {}
        # Connected sources by address.
        self._peers: dict[str, Any] = {}
        # Fetches in flight by object id, aborts that came before their fetch, and objects
        # whose fetch ended (an abort after the end is a no-op).
        self._inflight: dict[str, list[FerryFetchRequest]] = {}
        self._aborted: set[str] = set()
        self._ended: OrderedDict[str, None] = OrderedDict()
        # FERRY_RELAY: each object's broadcast (source), and the pulls of this process
        # (receiver) by object id, newest last.
        self._publishers: dict[str, Any] = {}
        self._pulls: OrderedDict[str, "_RelayPull"] = OrderedDict()

    # -- the engine -------------------------------------------------------------------------

    def engine(self) -> ferry.Engine:
        """This process's engine, made on first use (the module's docs say where it listens)."""
        with self._lock:
            if self._box.engine is None:
                self._box.engine = ferry.Engine(listen=_listen_address())
                logger.info(
                    "Ferry engine for Ray's %s transport listens on %s (%s)",
                    TRANSPORT,
                    self._box.engine.listen_addr,
                    _who(),
                )
            return self._box.engine

    def registered_storages(self) -> int:
        """How many storages this process has published for objects (tests, diagnostics)."""
        with self._lock:
            return len(self._storages)

    def transports(self) -> dict[str, str]:
        """The plane each connected source is reached on, by address: ``"local"`` (same-host
        copies), ``"uring"``, ``"tcp"`` or ``"rdma"`` (tests, diagnostics)."""
        with self._lock:
            return {addr: peer.transport for addr, peer in self._peers.items()}

    def relay_summary(self, obj_id: str, timeout: float) -> Optional[dict]:
        """What this process's pull of ``obj_id`` took from the source and from relays, once
        it stopped relaying (waits up to ``timeout`` seconds for that); None if there was no
        such pull or it failed (``FERRY_RELAY``; tests, diagnostics)."""
        with self._lock:
            pull = self._pulls.get(obj_id)
        if pull is None or not pull.ended.wait(timeout):
            return None
        return pull.summary

    def inflight(self) -> int:
        """How many fetches are in flight in this process (tests, diagnostics)."""
        with self._lock:
            return sum(len(v) for v in self._inflight.values())

    # -- the contract -----------------------------------------------------------------------

    def tensor_transport_backend(self) -> str:
        return TRANSPORT

    @staticmethod
    def is_one_sided() -> bool:
        return True

    @staticmethod
    def can_abort_transport() -> bool:
        return True

    def actor_has_tensor_transport(self, actor: "ray.actor.ActorHandle") -> bool:
        def __ray_actor_has_ferry_transport__(self: Any) -> bool:
            from ferry.ray import _available_in_process

            return _available_in_process()

        return ray.get(
            actor.__ray_call__.options(concurrency_group="_ray_system").remote(
                __ray_actor_has_ferry_transport__
            )
        )

    def extract_tensor_transport_metadata(
        self, obj_id: str, rdt_object: list[Any]
    ) -> FerryTransportMetadata:
        if not rdt_object:
            return FerryTransportMetadata(tensor_meta=[], tensor_device=None)
        kinds = []
        for i, t in enumerate(rdt_object):
            try:
                kinds.append(_kind(t))
            except TypeError as e:
                raise TypeError(f"item {i} of object {obj_id}: {e}") from None
        device_type = _device_type(rdt_object[0])
        for i, t in enumerate(rdt_object):
            if _device_type(t) != device_type:
                raise ValueError(
                    f"all tensors of an RDT object must be on one device type; object "
                    f"{obj_id} has {device_type} and {_device_type(t)}"
                )
            if not _contiguous(t):
                raise ValueError(
                    f"all tensors of an RDT object must be contiguous; item {i} of object "
                    f"{obj_id} is not"
                )
        if device_type == "cuda":
            import torch

            # Ferry's copies run on its own streams: the producer's work must be done.
            for dev in {t.device for t in rdt_object}:
                torch.cuda.synchronize(dev)
        engine = self.engine()
        segments: list[Optional[tuple[str, int, int]]] = []
        keys: list[tuple[str, int, int]] = []
        with self._lock:
            try:
                for t in rdt_object:
                    nbytes = _nbytes(t)
                    if nbytes == 0:
                        segments.append(None)
                        continue
                    key, held = self._hold(engine, t)
                    keys.append(key)
                    segments.append((held.name, _data_ptr(t) - key[1], nbytes))
            except BaseException:
                self._release(keys)
                raise
            self._objects.setdefault(obj_id, []).extend(keys)
        return FerryTransportMetadata(
            tensor_meta=[(t.shape, t.dtype) for t in rdt_object],
            tensor_device=device_type,
            kinds=kinds,
            addr=engine.listen_addr,
            peer_id=engine.peer_id,
            epoch=engine.epoch,
            server_identity=engine.server_identity,
            source=_who(),
            segments=segments,
        )

    def get_communicator_metadata(
        self,
        src_actor: "ray.actor.ActorHandle",
        dst_actor: "ray.actor.ActorHandle",
        backend: Optional[str] = None,
    ) -> FerryCommunicatorMetadata:
        return FerryCommunicatorMetadata()

    def recv_multiple_tensors(
        self,
        obj_id: str,
        tensor_transport_metadata: TensorTransportMetadata,
        communicator_metadata: CommunicatorMetadata,
        target_buffers: Optional[list[Any]] = None,
    ) -> list[Any]:
        fetch = self.fetch_multiple_tensors(
            obj_id, tensor_transport_metadata, communicator_metadata, target_buffers
        )
        return self.wait_fetch_complete(fetch)

    def fetch_multiple_tensors(
        self,
        obj_id: str,
        tensor_transport_metadata: TensorTransportMetadata,
        communicator_metadata: CommunicatorMetadata,
        target_buffers: Optional[list[Any]] = None,
    ) -> FerryFetchRequest:
        meta = tensor_transport_metadata
        assert isinstance(meta, FerryTransportMetadata), type(meta)
        source = meta.source or "the source"
        self._raise_if_aborted(obj_id, meta)
        if target_buffers:
            tensors = list(target_buffers)
            if len(tensors) != len(meta.tensor_meta):
                raise ValueError(
                    f"object {obj_id} from {source} has {len(meta.tensor_meta)} tensors, "
                    f"but {len(tensors)} target buffers were given"
                )
            for i, t in enumerate(tensors):
                if not _contiguous(t):
                    raise ValueError(f"target buffer {i} of object {obj_id} is not contiguous")
            root = None
        else:
            tensors, root = _empty_like_meta(meta)
        fetch = FerryFetchRequest(
            obj_id=obj_id, tensors=tensors, addr=meta.addr, source=source, transport=self
        )
        if not any(meta.segments):
            fetch.finished = True
            return fetch
        try:
            engine = self.engine()
            peer = self._peer(meta)
            batch = ferry.Batch()
            # The object's one receive buffer: one registration for all its CPU tensors, kept
            # by the pool when pooled (closed by the pool only).
            root_reg = None
            if root is not None:
                root_reg = _POOL.registration(engine, root)
                if root_reg is None:
                    root_reg = engine.register(root)
                    fetch.registrations.append(root_reg)
                base = _data_ptr(root)
            for i, (t, seg) in enumerate(zip(tensors, meta.segments)):
                if seg is None:
                    continue
                name, offset, nbytes = seg
                if _nbytes(t) != nbytes:
                    raise ValueError(
                        f"target buffer {i} holds {_nbytes(t)} bytes, "
                        f"item {i} of object {obj_id} {nbytes}"
                    )
                if root_reg is not None and _device_type(t) == "cpu":
                    # In the object's buffer (every CPU tensor of it lies there).
                    batch.read(root_reg, peer.segment(name), _data_ptr(t) - base, offset, nbytes)
                    continue
                view = _byte_view(t)
                if _is_numpy(view):
                    reg = engine.register(view)
                    fetch.registrations.append(reg)
                elif view.is_cuda:
                    reg = engine.register_gpu(view)
                    fetch.registrations.append(reg)
                else:
                    reg = engine.register(view.numpy())
                    fetch.registrations.append(reg)
                batch.read(reg, peer.segment(name), 0, offset, nbytes)
            with self._lock:
                if obj_id in self._aborted:
                    self._aborted.discard(obj_id)
                    raise RuntimeError("the transfer was aborted before it started")
                fetch.request = engine.submit(batch)
                self._inflight.setdefault(obj_id, []).append(fetch)
        except Exception as e:
            fetch._finish()
            self._drop_peer(meta.addr)
            raise self._error(obj_id, meta, _reason(e)) from e
        return fetch

    def _raise_if_aborted(self, obj_id: str, meta: FerryTransportMetadata) -> None:
        """Raises (once) when ``abort_transport`` named ``obj_id`` before its fetch began."""
        with self._lock:
            if obj_id in self._aborted:
                self._aborted.discard(obj_id)
                raise self._error(obj_id, meta, "the transfer was aborted before it started")

    def wait_fetch_complete(
        self, fetch_request: FetchRequest, timeout: float = -1
    ) -> list[Any]:
        fetch = fetch_request
        assert isinstance(fetch, FerryFetchRequest), type(fetch)
        if fetch.relay is not None:
            return self._wait_relay(fetch, timeout)
        if fetch.request is None:
            return fetch.tensors
        try:
            outcome = fetch.request.wait(timeout=None if timeout < 0 else timeout, check=False)
        except TimeoutError:
            raise TimeoutError(
                f"{TRANSPORT} transfer of object {fetch.obj_id} from {fetch.source} at "
                f"{fetch.addr} not done after {timeout}s"
            ) from None
        fetch._finish()
        if not outcome.ok:
            failure = outcome.failure
            reason = f"{failure.kind}: {failure.message}" if failure else "failed"
            if failure is not None and failure.kind != "cancelled":
                self._drop_peer(fetch.addr)
            raise self._error_at(fetch.obj_id, fetch.source, fetch.addr, reason)
        return fetch.tensors

    def send_multiple_tensors(
        self,
        tensors: list[Any],
        tensor_transport_metadata: TensorTransportMetadata,
        communicator_metadata: CommunicatorMetadata,
    ) -> None:
        raise NotImplementedError(
            f"{TRANSPORT} is one-sided: the receiver reads, and Ray never calls send"
        )

    def garbage_collect(
        self, obj_id: str, tensor_transport_meta: TensorTransportMetadata, tensors: list[Any]
    ) -> None:
        with self._lock:
            keys = self._objects.pop(obj_id, None)
            if keys:
                self._release(keys)

    def abort_transport(self, obj_id: str, communicator_metadata: CommunicatorMetadata) -> None:
        """Cancels the object's fetch in this process and returns once it drained (no byte of
        it can still move); a fetch not started yet fails when it starts."""
        with self._lock:
            fetches = list(self._inflight.get(obj_id, ()))
            if not fetches and obj_id not in self._ended:
                self._aborted.add(obj_id)
        for fetch in fetches:
            if fetch.request is not None:
                fetch.request.cancel()
                fetch.request.wait_drained()
            if fetch.relay is not None:
                fetch.relay.stop()
        if fetches:
            logger.info("aborted the %s fetch of object %s (%s)", TRANSPORT, obj_id, _who())

    # -- helpers ----------------------------------------------------------------------------

    def register_memory(self, tensor: "torch.Tensor") -> None:
        """Publishes ``tensor``'s storage and holds it until ``deregister_memory``: objects of
        it then reuse the registration (and readers their connection's listing of it) instead
        of publishing it anew after the last one went. The counterpart of Ray's
        ``register_nixl_memory``."""
        _kind(tensor)
        if _nbytes(tensor) == 0:
            return
        with self._lock:
            self._hold(self.engine(), tensor)

    def deregister_memory(self, tensor: "torch.Tensor") -> None:
        """Drops the hold ``register_memory`` took; the storage stays published while objects
        still hold it."""
        _kind(tensor)
        if _nbytes(tensor) == 0:
            return
        key = _storage_key(tensor)
        with self._lock:
            self._release([key])

    def _hold(self, engine: ferry.Engine, t: "torch.Tensor") -> tuple:
        """Takes one hold of ``t``'s storage (a numpy array's: its root array's memory),
        publishing it first if nobody holds it (under the lock). Keyed by device, address and
        length: a storage resized in place is published anew, and a numpy array and a torch
        tensor over the same memory share one registration."""
        key = _storage_key(t)
        held = self._storages.get(key)
        if held is None:
            whole = _storage_whole(t)
            name = f"ray.{os.getpid()}.{next(self._names)}"
            if _is_numpy(whole):
                reg = engine.register(whole, name=name, access="read")
            elif whole.is_cuda:
                reg = engine.register_gpu(whole, name=name, access="read")
            else:
                reg = engine.register(whole.numpy(), name=name, access="read")
            held = _Held(reg, name, 0)
            self._storages[key] = held
        held.objects += 1
        return key, held

    def _release(self, keys: list[tuple[str, int, int]]) -> None:
        """Drops one hold of each storage; the last unpublishes it (under the lock)."""
        for key in keys:
            held = self._storages.get(key)
            if held is None:
                continue
            held.objects -= 1
            if held.objects <= 0:
                del self._storages[key]
                held.registration.close()

    def _forget_inflight(self, obj_id: str, fetch: FerryFetchRequest) -> None:
        with self._lock:
            fetches = self._inflight.get(obj_id)
            if fetches and fetch in fetches:
                fetches.remove(fetch)
                if not fetches:
                    del self._inflight[obj_id]
            self._ended[obj_id] = None
            while len(self._ended) > 4096:
                self._ended.popitem(last=False)

    def _peer(self, meta: FerryTransportMetadata) -> Any:
        """The connection to the source, whose listing holds every segment ``meta`` names:
        the cached one, else a fresh one (the listing is the one of connection time)."""
        names = [s[0] for s in meta.segments if s is not None]
        with self._lock:
            peer = self._peers.get(meta.addr)
        if (
            peer is not None
            and peer.is_alive()
            and peer.epoch == meta.epoch
            and all(self._lists(peer, n) for n in names)
        ):
            return peer
        engine = self.engine()
        keyed = bool(os.environ.get("FERRY_AUTH_KEY_FILE"))
        identity = meta.server_identity if keyed else None
        try:
            peer = engine.connect(meta.addr, server_identity=identity)
        except ferry.StaleEpoch:
            # Another incarnation met at this address before: the metadata names this one.
            peer = engine.reresolve(meta.addr)
        if peer.epoch != meta.epoch:
            raise RuntimeError(
                f"the engine at {meta.addr} is another incarnation (epoch {peer.epoch}, the "
                f"object's source had {meta.epoch}): the source process has ended"
            )
        with self._lock:
            self._peers[meta.addr] = peer
        return peer

    @staticmethod
    def _lists(peer: Any, name: str) -> bool:
        try:
            peer.segment(name)
        except ferry.UnknownSegmentName:
            return False
        return True

    def _drop_peer(self, addr: Optional[str]) -> None:
        with self._lock:
            self._peers.pop(addr, None)

    def _error(self, obj_id: str, meta: FerryTransportMetadata, reason: str) -> Exception:
        return self._error_at(obj_id, meta.source or "the source", meta.addr, reason)

    @staticmethod
    def _error_at(obj_id: str, source: Optional[str], addr: Optional[str], reason: str) -> Exception:
        from ray.exceptions import RayDirectTransportError

        return RayDirectTransportError(
            f"The {TRANSPORT} transfer of object {obj_id} from {source} (Ferry engine at "
            f"{addr}) to {_who()} failed: {reason}. The source actor may have died during "
            f"the transfer."
        )


class FerryNumpyTransport(FerryTensorTransport):
    """The same transport for ``numpy.ndarray`` objects (``FERRY_NUMPY``): Ray gives each
    transport name one data type. It shares the process's state with ``FERRY``."""

    def tensor_transport_backend(self) -> str:
        return TRANSPORT_NUMPY


class _RelayPull:
    """One ``FERRY_RELAY`` object pulled in a thread (``ferry.broadcast.pull``, relaying on):
    ``done`` is set once every byte is verified, or the pull failed (``error``); the thread then
    goes on relaying to the object's other readers while any is unfinished, up to
    ``RELAY_LINGER`` seconds, and sets ``ended`` with ``summary`` (bytes from the source, from
    relays). ``stop()`` ends the pull at its next chunk and returns once it ended: its buffers
    are then closed, so no byte of it can still move."""

    def __init__(self, engine: ferry.Engine, relay: tuple, into: dict[str, Any]) -> None:
        self.done = threading.Event()
        self.ended = threading.Event()
        self.error: Optional[BaseException] = None
        self.summary: Optional[dict] = None
        self._stopping = False
        self._thread = threading.Thread(
            target=self._run, args=(engine, relay, into), name="ferry-ray-relay", daemon=True
        )
        self._thread.start()

    def _progress(self, got: int, total: int) -> None:
        if self._stopping:
            raise _Aborted("the transfer was aborted")
        if got >= total:
            self.done.set()

    def _run(self, engine: ferry.Engine, relay: tuple, into: dict[str, Any]) -> None:
        from ferry.broadcast import pull

        addr, name, digest = relay
        try:
            s = pull(
                engine,
                addr,
                into,
                name=name,
                relay=True,
                linger=RELAY_LINGER,
                expect_manifest=digest,
                auth_key_file=os.environ.get("FERRY_AUTH_KEY_FILE") or None,
                progress=self._progress,
                # Each chunk is verified as it lands; the second pass at rest would read the
                # payload again after the receiver already has it.
                verify_at_rest=False,
            )
            self.summary = {
                "bytes": s.bytes,
                "from_source": s.from_source,
                "from_relays": s.from_relays,
                "seconds": s.seconds,
            }
        except BaseException as e:  # reported by wait_fetch_complete
            if not self.done.is_set():
                self.error = e
            else:
                logger.warning("a %s reader stopped relaying: %s", TRANSPORT_RELAY, _reason(e))
        finally:
            self.done.set()
            self.ended.set()

    def stop(self) -> None:
        if self.done.is_set():
            return
        self._stopping = True
        self.ended.wait()


class _Aborted(Exception):
    """A ``FERRY_RELAY`` pull stopped by ``abort_transport``."""


class FerryRelayTransport(FerryTensorTransport):
    """``FERRY_RELAY``: the same transport, each object published as a Ferry broadcast
    (``ferry.broadcast``): N actors reading one object relay verified chunks to one another,
    so the source sends about one copy, not N. Costs over ``FERRY``: the source hashes the
    payload once per object (its manifest), each reader copies each byte once more as it
    verifies it, and a reader's thread keeps relaying after its ``ray.get`` returned while
    other readers of the object are unfinished (up to ``RELAY_LINGER``). docs/ray.md."""

    def tensor_transport_backend(self) -> str:
        return TRANSPORT_RELAY

    def extract_tensor_transport_metadata(
        self, obj_id: str, rdt_object: list[Any]
    ) -> FerryTransportMetadata:
        from ferry.broadcast import Publisher

        meta = super().extract_tensor_transport_metadata(obj_id, rdt_object)
        if not any(meta.segments):
            return meta
        with self._lock:
            by_name = {h.name: h for h in self._storages.values()}
            tensors = {
                f"t{i}": (by_name[seg[0]].registration, seg[1], seg[2])
                for i, seg in enumerate(meta.segments)
                if seg is not None
            }
        name = f"ray.{obj_id}"
        try:
            pub = Publisher(
                self.engine(),
                tensors,
                name=name,
                auth_key_file=os.environ.get("FERRY_AUTH_KEY_FILE") or None,
            )
        except BaseException:
            super().garbage_collect(obj_id, meta, rdt_object)
            raise
        with self._lock:
            old = self._publishers.pop(obj_id, None)
            self._publishers[obj_id] = pub
        if old is not None:
            old.close()
        meta.relay = (pub.addr, name, pub.digest)
        return meta

    def fetch_multiple_tensors(
        self,
        obj_id: str,
        tensor_transport_metadata: TensorTransportMetadata,
        communicator_metadata: CommunicatorMetadata,
        target_buffers: Optional[list[Any]] = None,
    ) -> FerryFetchRequest:
        meta = tensor_transport_metadata
        assert isinstance(meta, FerryTransportMetadata), type(meta)
        if meta.relay is None:
            return super().fetch_multiple_tensors(
                obj_id, meta, communicator_metadata, target_buffers
            )
        source = meta.source or "the source"
        self._raise_if_aborted(obj_id, meta)
        tensors = list(target_buffers) if target_buffers else _empty_like_meta(meta)[0]
        into: dict[str, Any] = {}
        for i, (t, seg) in enumerate(zip(tensors, meta.segments)):
            if seg is None:
                continue
            if not _contiguous(t) or _nbytes(t) != seg[2]:
                raise ValueError(
                    f"target buffer {i} of object {obj_id} is not contiguous or holds "
                    f"{_nbytes(t)} bytes, not {seg[2]}"
                )
            view = _byte_view(t)
            into[f"t{i}"] = view if _is_numpy(view) or view.is_cuda else view.numpy()
        fetch = FerryFetchRequest(
            obj_id=obj_id, tensors=tensors, addr=meta.relay[0], source=source, transport=self
        )
        try:
            fetch.relay = _RelayPull(self.engine(), meta.relay, into)
        except Exception as e:
            raise self._error(obj_id, meta, _reason(e)) from e
        with self._lock:
            self._inflight.setdefault(obj_id, []).append(fetch)
            self._pulls[obj_id] = fetch.relay
            while len(self._pulls) > 256:
                self._pulls.popitem(last=False)
        return fetch

    def _wait_relay(self, fetch: FerryFetchRequest, timeout: float) -> list[Any]:
        if not fetch.relay.done.wait(None if timeout < 0 else timeout):
            raise TimeoutError(
                f"{TRANSPORT_RELAY} transfer of object {fetch.obj_id} from {fetch.source} "
                f"(broadcast at {fetch.addr}) not done after {timeout}s"
            )
        fetch._finish()
        if fetch.relay.error is not None:
            raise self._error_at(
                fetch.obj_id, fetch.source, fetch.addr, _reason(fetch.relay.error)
            )
        return fetch.tensors

    def garbage_collect(
        self, obj_id: str, tensor_transport_meta: TensorTransportMetadata, tensors: list[Any]
    ) -> None:
        with self._lock:
            pub = self._publishers.pop(obj_id, None)
        if pub is not None:
            pub.close()
        super().garbage_collect(obj_id, tensor_transport_meta, tensors)


class _Pooled:
    __slots__ = ("root", "ptr", "reg", "engine", "extra")

    def __init__(self, root: Any) -> None:
        self.root = root  # a flat uint8 numpy array, the buffer's owner
        self.ptr = int(root.ctypes.data)
        self.reg: Any = None  # its write registration with ``engine``, kept while pooled
        self.engine: Any = None
        self.extra = 0  # references to ``root`` that ``reg`` holds


class _RecvPool:
    """Receive buffers of CPU objects fetched without target buffers, reused once free: one
    buffer per object, its tensors laid out in it one after another (``_empty_like_meta``), so
    an object of many tensors costs one buffer, one registration and one lookup, not one each.

    A fresh buffer costs its first touch: on this project's VMs the kernel faults and zeroes
    each 4 KiB page during the copy, which makes a read into fresh memory about 4x slower
    than into touched memory (docs/ray.md), and registering it costs a few ms more. A buffer
    handed out stays in the pool; it is handed out again only when nothing but the pool (and
    its registration) refers to its root array: every tensor, view or array over it holds a
    reference to that root, so a buffer still in use (any tensor of its object kept) is never
    reused. Buffers under ``MIN_BYTES`` are not pooled, and the pool keeps at most
    ``MAX_BYTES`` (what it holds stays allocated for the life of the process)."""

    MIN_BYTES = 1 << 20
    MAX_BYTES = 1 << 30

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_size: dict[int, list[_Pooled]] = {}
        self._by_ptr: dict[int, _Pooled] = {}
        self._bytes = 0

    def take(self, nbytes: int) -> Any:
        """A flat uint8 array of ``nbytes``: a free pooled one, a new pooled one, or (pool
        full, or small) a plain one."""
        import numpy as np

        if nbytes < self.MIN_BYTES:
            return np.empty(nbytes, dtype=np.uint8)
        with self._lock:
            for e in self._by_size.get(nbytes, ()):
                # The entry's reference, getrefcount's argument, and the registration's.
                if sys.getrefcount(e.root) == 2 + e.extra:
                    return e.root
            root = np.empty(nbytes, dtype=np.uint8)
            if self._bytes + nbytes <= self.MAX_BYTES:
                e = _Pooled(root)
                self._by_size.setdefault(nbytes, []).append(e)
                self._by_ptr[e.ptr] = e
                self._bytes += nbytes
            return root

    def registration(self, engine: ferry.Engine, root: Any) -> Any:
        """The kept write registration of the pooled buffer ``root`` (an array ``take``
        returned), registering it on first use; None when ``root`` is not pooled."""
        with self._lock:
            e = self._by_ptr.get(_data_ptr(root))
            if e is None or e.root.nbytes != _nbytes(root):
                return None
            if e.reg is None or e.engine is not engine:
                if e.reg is not None:
                    try:
                        e.reg.close()
                    except Exception:  # its engine is gone, and the registration with it
                        pass
                    e.reg = None
                before = sys.getrefcount(e.root)
                e.reg = engine.register(e.root)
                e.engine = engine
                e.extra = sys.getrefcount(e.root) - before
            return e.reg


_POOL = _RecvPool()
_ALIGN = 64  # each tensor's offset in an object's receive buffer: aligned for every dtype


def _empty_like_meta(meta: FerryTransportMetadata) -> tuple[list[Any], Any]:
    """Receiving tensors (or arrays) of the object's shapes, dtypes and kinds, and the one
    buffer the CPU ones lie in (a flat uint8 array from the receive pool, ``_RecvPool``; None
    when there is none): the object's tensors one after another, each at an offset aligned to
    ``_ALIGN``. Tensors on another device are fresh, one each."""
    import numpy as np

    kinds = meta.kinds or ["torch"] * len(meta.tensor_meta)
    device = meta.tensor_device or "cpu"
    layout: list[Optional[tuple[int, int]]] = []  # (offset, bytes) in the buffer, per tensor
    total = 0
    for (shape, dtype), kind in zip(meta.tensor_meta, kinds):
        count = 1
        for d in shape:
            count *= int(d)
        size = np.dtype(dtype).itemsize if kind == "numpy" else dtype.itemsize
        if not count or (kind != "numpy" and device != "cpu"):
            layout.append(None)
            continue
        off = -(-total // _ALIGN) * _ALIGN
        layout.append((off, count * size))
        total = off + count * size
    root = _POOL.take(total) if total else None
    flat = None
    out = []
    for (shape, dtype), kind, place in zip(meta.tensor_meta, kinds, layout):
        if kind == "numpy":
            dt = np.dtype(dtype)
            if place is None:
                out.append(np.empty(shape, dtype=dt))
            else:
                out.append(root[place[0] : place[0] + place[1]].view(dt).reshape(shape))
            continue
        import torch

        if place is None:
            out.append(torch.empty(shape, dtype=dtype, device=device))
            continue
        if flat is None:
            flat = torch.from_numpy(root)
        out.append(flat[place[0] : place[0] + place[1]].view(dtype).view(shape))
    return out, root


def register_memory(tensor: "torch.Tensor") -> None:
    """Keeps ``tensor``'s storage published for the life of this process (until
    ``deregister_memory``), so that objects returning it again and again (weights) reuse one
    registration: ``FerryTensorTransport.register_memory`` of this process's transport."""
    manager().register_memory(tensor)


def deregister_memory(tensor: "torch.Tensor") -> None:
    """Drops the hold of ``register_memory``."""
    manager().deregister_memory(tensor)


def _reason(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


def _available_in_process() -> bool:
    """Whether this process can take part: Ferry's transport is registered and its engine
    starts."""
    try:
        manager().engine()
        return True
    except Exception:
        logger.warning("Ferry's %s transport is unavailable here", TRANSPORT, exc_info=True)
        return False


def manager() -> FerryTensorTransport:
    """This process's transport (the one Ray made), registering it first if need be. Every
    Ferry transport of the process shares its state, so any one serves."""
    register()
    from ray.experimental.rdt.util import get_tensor_transport_manager, transport_manager_info

    name = TRANSPORT if TRANSPORT in transport_manager_info else TRANSPORT_NUMPY
    m = get_tensor_transport_manager(name)
    assert isinstance(m, FerryTensorTransport)
    return m

