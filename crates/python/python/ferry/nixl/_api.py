"""``ferry.nixl._api``: NIXL's agent API (``nixl._api``, 1.5) on Ferry. See docs/nixl.md for
every call, what Ferry does and where it differs.

An agent is a Ferry engine that listens (peers read and write its memory through it), a
``RawEngine`` over it (memory named by raw address), and the bookkeeping NIXL's API exposes:
remote agents by name, prepared descriptor lists, transfer handles, notifications.
"""

from __future__ import annotations

import enum
import json
import logging
import math
import os
import pickle
import sys
import threading
import time
from typing import Any, Optional, Union

from ferry import _failures, _ferry
from ferry._hosts import bind_host, join, publish_to, warn_if_open
from ferry._senders import Bindings, Sender
from ferry.nixl import _bindings as nixlBind
from ferry.nixl import _telemetry
from ferry.nixl._bindings import (
    nixlBackendError,
    nixlInvalidParamError,
    nixlMismatchError,
    nixlNoTelemetryError,
    nixlNotFoundError,
    nixlNotSupportedError,
    nixlRepostActiveError,
)

logger = logging.getLogger("ferry.nixl")

DEFAULT_COMM_PORT = nixlBind.DEFAULT_COMM_PORT

#: The backends NIXL users name that Ferry serves (it picks its own transport for each).
PLUGINS = ["UCX", "LIBFABRIC", "UCCL", "MOONCAKE", "GPUNETIO", "POSIX"]
#: Backends that answer ``query_memory`` about files and move nothing (NIXL's POSIX plugin).
_FILE_PLUGINS = {"POSIX"}

#: What ``get_agent_metadata`` returns starts with this (then JSON).
_MD_MAGIC = b"FERRY-NIXL-MD/1\n"
#: Notifications that carry metadata (``send_local_metadata``) start with this.
_MD_NOTIF = b"\x00ferry-nixl-md\x00"
#: Notifications that invalidate metadata (``invalidate_local_metadata``) start with this.
_MD_INVALIDATE = b"\x00ferry-nixl-invalidate\x00"
#: The 1-byte segment whose name tells a peer's listing this agent's name.
_NAME_SEGMENT = "nixl-agent@"


def _is_torch_tensor(obj: object) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.Tensor)


def _text(name: Union[str, bytes]) -> str:
    return name.decode() if isinstance(name, bytes) else str(name)


def _us(seconds: float) -> int:
    """Seconds as whole microseconds, rounded up (a duration that passed is never 0)."""
    return math.ceil(seconds * 1e6)


def _file_info(path: Any) -> Optional[dict[str, str]]:
    """NIXL's POSIX ``queryMem`` answer for one file: its size, mode and mtime, or None."""
    name = path.decode() if isinstance(path, bytes) else str(path)
    if not name:
        return None
    try:
        st = os.stat(name)
    except OSError:
        return None
    return {"size": str(st.st_size), "mode": str(st.st_mode), "mtime": str(int(st.st_mtime))}


def _raise(cls: type, reason: str, cause: Optional[BaseException] = None) -> None:
    logger.error("%s", reason)
    err = cls(reason)
    if cause is not None:
        raise err from cause
    raise err


class nixl_thread_sync_t(enum.Enum):
    """NIXL's thread synchronization modes (Ferry's agent is thread-safe in every mode)."""

    NIXL_THREAD_SYNC_NONE = nixlBind.NIXL_THREAD_SYNC_NONE
    NIXL_THREAD_SYNC_STRICT = nixlBind.NIXL_THREAD_SYNC_STRICT
    NIXL_THREAD_SYNC_RW = nixlBind.NIXL_THREAD_SYNC_RW
    NIXL_THREAD_SYNC_DEFAULT = nixlBind.NIXL_THREAD_SYNC_NONE


class nixl_agent_config:
    """NIXL's agent configuration. ``backends`` names are accepted and Ferry serves them with
    its own transport; ``enable_listen_thread`` makes the agent listen on ``listen_port``
    (else on a free port); ``capture_telemetry`` keeps per-transfer telemetry."""

    def __init__(
        self,
        enable_prog_thread: bool = True,
        enable_listen_thread: bool = False,
        listen_port: int = DEFAULT_COMM_PORT,
        capture_telemetry: bool = False,
        num_threads: int = 0,
        backends: list[str] = ["UCX"],
        sync_mode: Optional[nixl_thread_sync_t] = None,
    ):
        self.backends = backends
        self.enable_pthread = enable_prog_thread
        self.enable_listen = enable_listen_thread
        self.port = listen_port
        self.capture_telemetry = capture_telemetry
        self.num_threads = num_threads
        if sync_mode is not None and not isinstance(sync_mode, nixl_thread_sync_t):
            raise TypeError(
                f"sync_mode must be a nixl_thread_sync_t (got {type(sync_mode).__name__!r})"
            )
        self.sync_mode = sync_mode


class nixl_prepped_dlist_handle:
    """A prepared descriptor list (``prep_xfer_dlist``); ``release()`` frees it."""

    __slots__ = ("_handle", "_agent", "_released")

    def __init__(self, agent: "nixl_agent", value: int):
        self._handle = int(value)
        self._agent = agent
        self._released = False

    def __repr__(self) -> str:
        return f"nixl_prepped_dlist_handle(0x{self._handle:x}, released={self._released})"

    def release(self) -> None:
        if not self._released:
            self._agent._dlists.pop(self._handle, None)
            self._released = True


class nixl_xfer_handle:
    """A transfer request (``make_prepped_xfer``, ``initialize_xfer``); ``release()`` ends a
    running transfer and returns once no byte of it can move."""

    __slots__ = ("_handle", "_agent", "_released")

    def __init__(self, agent: "nixl_agent", value: int):
        self._handle = int(value)
        self._agent = agent
        self._released = False

    def __repr__(self) -> str:
        return f"nixl_xfer_handle(0x{self._handle:x}, released={self._released})"

    def release(self) -> None:
        if not self._released:
            self._agent._release_xfer(self._handle)
            self._released = True

    def __del__(self) -> None:
        try:
            self.release()
        except Exception:
            pass


nixl_backend_handle = int


class _Remote:
    """A remote agent: its name, where its Ferry engine listens, and the server identity it
    proves there (None: metadata that names none)."""

    __slots__ = ("name", "addr", "peer_id", "epoch", "identity")

    def __init__(self, name: str, addr: str, peer_id: str, epoch: str,
                 identity: Optional[str] = None):
        self.name, self.addr, self.peer_id, self.epoch = name, addr, peer_id, epoch
        self.identity = identity


class _Dlist:
    """A prepared descriptor list: whose memory (None: this agent's) and its descriptors."""

    __slots__ = ("agent", "mem", "descs")

    def __init__(self, agent: Optional[str], mem: nixlBind.nixl_mem_t, descs: list[tuple]):
        self.agent, self.mem, self.descs = agent, mem, descs


class _Xfer:
    """A transfer request and, once posted, its running Ferry request."""

    __slots__ = ("op", "remote", "local", "remote_addrs", "lengths", "nbytes", "notif", "backend",
                 "request", "posted_at", "started_us", "post_us", "ended_us", "error")

    def __init__(self, op: str, remote: str, local: list[int], remote_addrs: list[int],
                 lengths: list[int], notif: bytes, backend: str):
        self.op, self.remote, self.local, self.backend = op, remote, local, backend
        self.remote_addrs, self.lengths, self.notif = remote_addrs, lengths, notif
        self.nbytes = sum(lengths)
        self.request: Any = None
        self.posted_at = 0.0
        self.started_us = 0
        self.post_us = 0
        self.ended_us = 0
        self.error: Optional[str] = None


class nixl_agent:
    """NIXL's agent on Ferry: registers memory, exchanges metadata with remote agents, moves
    descriptor lists by READ and WRITE, and sends notifications after transfers.

    The agent's Ferry engine listens on ``FERRY_BIND_ADDRESS`` (default: this machine's first
    address), on ``listen_port`` with ``enable_listen_thread`` and on a free port otherwise;
    ``get_agent_metadata`` carries that address. ``FERRY_AUTH_KEY_FILE`` keys the peers: then
    an agent's metadata alone lets no stranger read or write its memory. Without it, the agent
    warns (logger ``ferry.nixl``) when it listens off loopback.

    Notifications, metadata and invalidations are taken from the agent they name only
    (``ferry._senders``): from the incarnation recorded for that name, or from a key named
    after it; others are dropped with a warning on ``ferry.nixl``.
    """

    def __init__(
        self,
        agent_name: str,
        nixl_conf: Optional[nixl_agent_config] = None,
        instantiate_all: bool = False,
    ):
        if nixl_conf and instantiate_all:
            instantiate_all = False
            logger.warning("Ignoring instantiate_all based on the provided config in agent creation.")
        if not nixl_conf:
            nixl_conf = nixl_agent_config()
        # NIXL makes its C++ agent from a nixlAgentConfig here (an empty name is ValueError);
        # Ferry's nixlAgent serves its calls through this object.
        sync = nixl_conf.sync_mode or (
            nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT if nixl_conf.enable_listen
            else nixl_thread_sync_t.NIXL_THREAD_SYNC_NONE)
        self.agent = nixlBind._adopting()
        if self.agent is None:
            with nixlBind._building(self):
                self.agent = nixlBind.nixlAgent(agent_name, nixlBind.nixlAgentConfig(
                    nixl_conf.enable_pthread, nixl_conf.enable_listen, nixl_conf.port, sync.value,
                    1, 0, 100000, nixl_conf.capture_telemetry))
        self._telemetry = nixlBind._telemetry_enabled(nixl_conf.capture_telemetry)
        # NIXL's Prometheus exporter (ferry.nixl._telemetry): None without it.
        self._tm, metrics = _telemetry.exporter(agent_name, self._telemetry)
        if self._tm is not None:  # its transfer calls count their errors; no cost otherwise
            self.__class__ = _telemetry.counting(type(self))
        self.name = agent_name
        self.config = nixl_conf
        host = os.environ.get("FERRY_BIND_ADDRESS") or bind_host("")
        port = nixl_conf.port if nixl_conf.enable_listen else 0
        self._engine = _telemetry.make_engine(join(host, port), metrics, agent_name)
        self._raw = _ferry.RawEngine(self._engine, publish_to())
        self._addr = join(host, int(self._engine.listen_addr.rsplit(":", 1)[1]))
        # A 1-byte segment whose name tells a peer's listing who this agent is
        # (fetch_remote_metadata by address).
        self._name_buf = bytearray(1)
        self._name_reg = self._engine.register(
            self._name_buf, name=f"{_NAME_SEGMENT}{agent_name}", access="read")
        self._lock = threading.RLock()
        self._remotes: dict[str, _Remote] = {}
        self._senders = Bindings(self._raw.key_names())
        self._senders.bind(agent_name, self._engine.peer_id, self._engine.epoch)
        self._dlists: dict[int, _Dlist] = {}
        self._xfers: dict[int, _Xfer] = {}
        self._ids = iter(range(1, 1 << 62))
        self._pending: dict[str, list[bytes]] = {}
        self.notifs: dict[str, list[bytes]] = {}
        self.plugin_list = list(PLUGINS)
        self.backends: dict[str, nixl_backend_handle] = {}
        self.backend_mems: dict[str, list[str]] = {}
        self.backend_options: dict[str, dict[str, str]] = {}
        self._etcd: Any = None
        for b in (self.plugin_list if instantiate_all else nixl_conf.backends):
            if b not in self.plugin_list:
                logger.warning("Skipping backend registration %s: Ferry serves %s", b, self.plugin_list)
            else:
                self.create_backend(b)
        self.nixl_mems = {
            "DRAM": nixlBind.DRAM_SEG, "VRAM": nixlBind.VRAM_SEG, "FILE": nixlBind.FILE_SEG,
            "BLOCK": nixlBind.BLK_SEG, "OBJ": nixlBind.OBJ_SEG,
            "cpu": nixlBind.DRAM_SEG, "cuda": nixlBind.VRAM_SEG,
        }
        self.nixl_ops = {"WRITE": nixlBind.NIXL_WRITE, "READ": nixlBind.NIXL_READ}
        logger.info("Initialized NIXL agent %s on Ferry, listening on %s (data plane %s)",
                    agent_name, self._addr, self._engine.data_plane)
        warn_if_open(logger, f"NIXL agent {agent_name!r}", self._engine.listen_addr,
                     self._senders.keyed)

    def __del__(self) -> None:
        try:
            self._engine.shutdown()
        except Exception:
            pass

    # ----- plugins and backends --------------------------------------------------------

    def get_plugin_list(self) -> list[str]:
        """The backend names Ferry accepts (it serves each with its own transport)."""
        return self.plugin_list

    def get_plugin_mem_types(self, backend: str) -> list[str]:
        if backend not in self.plugin_list:
            logger.warning("Plugin %s is not available to get its supported mem types.", backend)
            return []
        return ["FILE_SEG"] if backend in _FILE_PLUGINS else ["DRAM_SEG", "VRAM_SEG"]

    def get_plugin_params(self, backend: str) -> dict[str, str]:
        if backend not in self.plugin_list:
            logger.warning("Plugin %s is not available to get its parameters.", backend)
            return {}
        return {}

    def get_backend_mem_types(self, backend: str) -> list[str]:
        if backend not in self.backend_mems:
            logger.warning("Backend %s not instantiated to get its supported mem types.", backend)
            return []
        return self.backend_mems[backend]

    def get_backend_params(self, backend: str) -> dict[str, str]:
        if backend not in self.backend_options:
            logger.warning("Backend %s not instantiated to get its parameters.", backend)
            return {}
        return self.backend_options[backend]

    def create_backend(self, backend: str, initParams: dict[str, str] = {}) -> None:
        """Accepts a backend name NIXL users pass; Ferry serves it with its own transport."""
        if backend not in self.plugin_list:
            _raise(nixlNotFoundError, f"createBackend: Ferry serves {self.plugin_list}, not {backend!r}")
        self.backends[backend] = len(self.backends) + 1
        self.backend_mems[backend] = self.get_plugin_mem_types(backend)
        self.backend_options[backend] = dict(initParams)

    # ----- descriptors -----------------------------------------------------------------

    @staticmethod
    def _tensor_rows(descs: Any) -> Optional[tuple[str, list[tuple[int, int, int]]]]:
        tensors = [descs] if _is_torch_tensor(descs) else list(descs)
        rows = []
        for t in tensors:
            if not t.is_contiguous():
                logger.error("Please use a list of contiguous Tensors")
                return None
            dev = t.get_device()
            rows.append((t.data_ptr(), t.numel() * t.element_size(), max(dev, 0)))
        mem = "DRAM" if tensors[0].get_device() == -1 else "VRAM"
        return mem, rows

    def _dlist(self, cls: type, descs: Any, mem_type: Optional[str], width: int) -> Any:
        if isinstance(descs, cls):
            return descs
        if _is_torch_tensor(descs) or (isinstance(descs, (list, tuple)) and descs
                                       and _is_torch_tensor(descs[0])):
            found = self._tensor_rows(descs)
            if found is None:
                return None
            mem, rows = found
            if width == 4:
                rows = [r + ("",) for r in rows]
            return cls(self.nixl_mems[mem], rows)
        if mem_type is None:
            logger.error("Please specify a mem type if not using Tensors")
            return None
        if hasattr(descs, "ndim"):
            if descs.ndim != 2 or descs.shape[1] != 3:
                logger.error("Nx3 shape required for descriptor list from numpy array")
                return None
            return cls(self.nixl_mems[mem_type], descs)
        if not descs or len(tuple(descs[0])) != width:
            logger.error("%d-tuple list needed", width)
            return None
        return cls(self.nixl_mems[mem_type], descs)

    def get_xfer_descs(self, descs: Any, mem_type: Optional[str] = None) -> nixlBind.nixlXferDList:
        """A ``nixlXferDList`` from ``(address, length, device)`` tuples, an Nx3 array, a tensor or
        a list of tensors (None, logged, for anything else)."""
        if isinstance(descs, nixlBind.nixlRegDList):
            logger.error("RegList type detected for transfer, please use XferList")
            return None  # type: ignore[return-value]
        return self._dlist(nixlBind.nixlXferDList, descs, mem_type, 3)

    def get_reg_descs(self, descs: Any, mem_type: Optional[str] = None) -> nixlBind.nixlRegDList:
        """A ``nixlRegDList`` from ``(address, length, device, meta)`` tuples, an Nx3 array, a
        tensor or a list of tensors (None, logged, for anything else)."""
        if isinstance(descs, nixlBind.nixlXferDList):
            logger.error("XferList type detected for registration, please use RegList")
            return None  # type: ignore[return-value]
        return self._dlist(nixlBind.nixlRegDList, descs, mem_type, 4)

    def get_remote_descs(self, descs: Any, mem_type: Optional[str] = None) -> nixlBind.nixlRemoteDList:
        if isinstance(descs, nixlBind.nixlRemoteDList):
            return descs
        if mem_type is None:
            logger.error("Please specify a mem type")
            return None  # type: ignore[return-value]
        return nixlBind.nixlRemoteDList(self.nixl_mems[mem_type], descs)

    def get_serialized_descs(self, descs: Any) -> bytes:
        return pickle.dumps(descs)

    def deserialize_descs(self, serialized_descs: bytes) -> Any:
        return pickle.loads(serialized_descs)

    # ----- memory ----------------------------------------------------------------------

    @staticmethod
    def _location(mem: nixlBind.nixl_mem_t, dev: int) -> str:
        if mem == nixlBind.DRAM_SEG:
            return "cpu:0"
        if mem == nixlBind.VRAM_SEG:
            return f"cuda:{dev}"
        _raise(nixlNotSupportedError, f"Ferry's NIXL agent registers DRAM and VRAM, not {mem.name}")
        return ""

    def register_memory(self, reg_list: Any, mem_type: Optional[str] = None,
                        backends: list[str] = []) -> nixlBind.nixlRegDList:
        """Registers every descriptor (raw addresses: the caller's contract, as in NIXL) and
        returns the ``nixlRegDList``. A range that overlaps another registration is refused
        (``nixlInvalidParamError``), and what this call registered is unregistered again."""
        for b in backends:
            self.backends[b]  # KeyError for an unknown backend, as NIXL
        descs = self.get_reg_descs(reg_list, mem_type)
        if descs is None:
            raise TypeError("register_memory needs descriptors (see get_reg_descs)")
        done = []
        try:
            for addr, length, dev, *_ in descs:
                self._raw.register(addr, length, self._location(descs.getType(), dev))
                done.append(addr)
        except _ferry.FerryError as e:
            for a in done:
                self._raw.unregister(a)
            cls = nixlNotSupportedError if isinstance(e, _ferry.Unavailable) else nixlInvalidParamError
            _raise(cls, f"registerMem: {e}", e)
        if self._tm is not None and done:
            self._tm.registered(sum(d[1] for d in descs))
        return descs

    def deregister_memory(self, dereg_list: nixlBind.nixlRegDList, backends: list[str] = []) -> None:
        """Unregisters every descriptor; ``nixlNotFoundError`` for one never registered."""
        if dereg_list is None:
            raise TypeError("deregister_memory needs a nixlRegDList")
        for addr, *_ in dereg_list:
            try:
                self._raw.unregister(addr)
            except _ferry.FerryError as e:
                _raise(nixlNotFoundError, f"deregisterMem: {e}", e)
        if self._tm is not None and len(dereg_list):
            self._tm.deregistered(sum(d[1] for d in dereg_list))

    def query_memory(self, reg_list: Any, backend: str, mem_type: Optional[str] = None) -> list:
        if backend not in self.backends:
            raise ValueError(
                f"Backend '{backend}' not found. Available backends: {list(self.backends.keys())}")
        if backend not in _FILE_PLUGINS:
            _raise(nixlNotSupportedError, "queryMem: memory queries are for storage backends")
        descs = self.get_reg_descs(reg_list, mem_type)
        return [_file_info(d[3]) for d in descs]

    # ----- metadata ----------------------------------------------------------------------

    def get_agent_metadata(self) -> bytes:
        """What a peer needs to reach this agent: its name and where it listens (its
        registrations come from the peer's handshake listing, fresh)."""
        md = {"name": self.name, "addr": self._addr, "peer_id": self._engine.peer_id,
              "epoch": self._engine.epoch, "server_identity": self._engine.server_identity}
        return _MD_MAGIC + json.dumps(md, sort_keys=True).encode()

    def get_partial_agent_metadata(self, descs: Any, inc_conn_info: bool = False,
                                   backends: list[str] = []) -> bytes:
        """The same as ``get_agent_metadata``: a peer checks descriptors against the listing."""
        return self.get_agent_metadata()

    @staticmethod
    def _parse(metadata: bytes) -> _Remote:
        if not isinstance(metadata, (bytes, bytearray)) or not metadata.startswith(_MD_MAGIC):
            _raise(nixlMismatchError, "loadRemoteMD: not the metadata of a Ferry NIXL agent")
        try:
            md = json.loads(bytes(metadata[len(_MD_MAGIC):]))
            identity = md.get("server_identity")
            return _Remote(str(md["name"]), str(md["addr"]), str(md["peer_id"]), str(md["epoch"]),
                           None if identity is None else str(identity))
        except (ValueError, KeyError, TypeError) as e:
            _raise(nixlMismatchError, f"loadRemoteMD: malformed metadata: {e}", e)
        raise AssertionError("unreachable")

    def _load(self, metadata: bytes) -> str:
        """Loads metadata the application vouches for (``add_remote_agent``, etcd, a fetch by
        address): its incarnation is the one that speaks for its name from now on."""
        return self._record(self._parse(metadata))

    def _record(self, r: _Remote) -> str:
        if r.identity is not None and self._senders.keyed:
            # Keyed, the address must prove the identity the metadata names: another holder of
            # this agent's key there (redirected metadata) is refused at the handshake.
            try:
                self._engine.expect_server(r.addr, r.identity)
            except _ferry.FerryError as e:
                _raise(nixlMismatchError, f"loadRemoteMD: {r.name}'s server identity: {e}", e)
        with self._lock:
            old = self._remotes.get(r.name)
            if old is not None and (old.addr != r.addr or old.epoch != r.epoch):
                self._raw.forget(old.addr)
            self._remotes[r.name] = r
            self._senders.bind(r.name, r.peer_id, r.epoch)
        return r.name

    def add_remote_agent(self, metadata: bytes) -> bytes:
        """Loads a remote agent's metadata; returns its name (bytes, as NIXL)."""
        return self._load(metadata).encode()

    def remove_remote_agent(self, agent: Union[str, bytes]) -> None:
        """Forgets the remote agent: later calls naming it fail with ``nixlNotFoundError``, and
        the next agent to speak under its name (or to load metadata for it) is taken as it."""
        name = _text(agent)
        with self._lock:
            r = self._remotes.pop(name, None)
            if name != self.name:
                self._senders.unbind(name)
        if r is not None:
            self._raw.forget(r.addr)

    def check_remote_metadata(self, agent: Union[str, bytes], descs: Any = None) -> bool:
        """Whether the agent's metadata is loaded (and, with ``descs``, whether every
        descriptor lies in its registrations)."""
        self._drain()
        with self._lock:
            r = self._remotes.get(_text(agent))
        if r is None:
            return False
        if descs is None or len(descs) == 0:
            return True
        try:
            self._raw.check(r.addr, [d[0] for d in descs], [d[1] for d in descs])
            return True
        except _ferry.FerryError:
            return False

    def _remote(self, agent: Union[str, bytes], what: str) -> _Remote:
        self._drain()
        with self._lock:
            r = self._remotes.get(_text(agent))
        if r is None:
            _raise(nixlNotFoundError, f"{what}: metadata for remote agent {_text(agent)!r} not found")
        return r  # type: ignore[return-value]

    def make_connection(self, remote_agent: str, backends: list[str] = []) -> None:
        """Connects to the remote agent now (optional; the first transfer does otherwise)."""
        r = self._remote(remote_agent, "makeConnection")
        try:
            self._raw.connect(r.addr)
        except _ferry.FerryError as e:
            _raise(nixlBackendError, f"makeConnection to {r.name} at {r.addr}: {e}", e)

    def _kv(self) -> Any:
        if self._etcd is None:
            endpoints = os.environ.get("NIXL_ETCD_ENDPOINTS", "")
            if not endpoints:
                _raise(nixlNotSupportedError,
                       "no metadata server: set NIXL_ETCD_ENDPOINTS, or give the peer's address")
            try:
                self._etcd = _ferry.EtcdKv(endpoints.split(",")[0].strip())
            except _ferry.FerryError as e:
                _raise(nixlBackendError, f"etcd {endpoints}: {e}", e)
        return self._etcd

    @staticmethod
    def _etcd_key(agent: str, label: str = "") -> str:
        ns = os.environ.get("NIXL_ETCD_NAMESPACE", "/nixl/agents")
        return f"{ns.rstrip('/')}/{agent}" + (f"/{label}" if label else "")

    def send_local_metadata(self, ip_addr: str = "", port: int = DEFAULT_COMM_PORT) -> None:
        """Sends this agent's metadata to the agent listening at ``ip_addr:port`` (a
        notification it loads), or, without an address, to etcd (``NIXL_ETCD_ENDPOINTS``)."""
        md = self.get_agent_metadata()
        if not ip_addr:
            self._kv().put(self._etcd_key(self.name), md)
            return
        try:
            self._raw.notify(join(ip_addr, port), self.name, _MD_NOTIF + md)
        except _ferry.FerryError as e:
            _raise(nixlBackendError, f"sendLocalMD to {ip_addr}:{port}: {e}", e)

    def send_partial_agent_metadata(self, descs: Any, inc_conn_info: bool = False,
                                    backends: list[str] = [], ip_addr: str = "",
                                    port: int = DEFAULT_COMM_PORT, label: str = "") -> None:
        if not ip_addr and label:
            self._kv().put(self._etcd_key(self.name, label), self.get_agent_metadata())
            return
        self.send_local_metadata(ip_addr, port)

    def fetch_remote_metadata(self, remote_agent: str, ip_addr: str = "",
                              port: int = DEFAULT_COMM_PORT, label: str = "") -> None:
        """Loads ``remote_agent``'s metadata: from the agent listening at ``ip_addr:port``
        (its handshake listing names it), or from etcd. ``check_remote_metadata`` then says
        it is there."""
        if not ip_addr:
            md = self._kv().get(self._etcd_key(remote_agent, label))
            if md is None:
                _raise(nixlNotFoundError, f"fetchRemoteMD: no metadata of {remote_agent!r} in etcd")
            self._load(md)
            return
        addr = join(ip_addr, port)
        try:
            names = [s for s in self._peer_segments(addr) if s.startswith(_NAME_SEGMENT)]
        except _ferry.FerryError as e:
            _raise(nixlBackendError, f"fetchRemoteMD from {addr}: {e}", e)
        if f"{_NAME_SEGMENT}{remote_agent}" not in names:
            _raise(nixlNotFoundError, f"fetchRemoteMD: the agent at {addr} is {names}, not {remote_agent!r}")
        peer = self._engine.connect(addr)
        md = {"name": remote_agent, "addr": addr, "peer_id": peer.peer_id, "epoch": peer.epoch}
        self._load(_MD_MAGIC + json.dumps(md).encode())

    def _peer_segments(self, addr: str) -> list[str]:
        return [s["name"] for s in self._engine.connect(addr).segments]

    def invalidate_local_metadata(self, ip_addr: str = "", port: int = DEFAULT_COMM_PORT) -> None:
        if not ip_addr:
            self._kv().delete(self._etcd_key(self.name))
            return
        try:
            self._raw.notify(join(ip_addr, port), self.name, _MD_INVALIDATE)
        except _ferry.FerryError as e:
            _raise(nixlBackendError, f"invalidateLocalMD to {ip_addr}:{port}: {e}", e)

    # ----- transfers ---------------------------------------------------------------------

    def prep_xfer_dlist(self, agent_name: Union[str, bytes], xfer_list: Any,
                        mem_type: Optional[str] = None,
                        backends: list[str] = []) -> nixl_prepped_dlist_handle:
        """Checks a descriptor list against the registrations of this agent
        (``"NIXL_INIT_AGENT"``) or of a remote (or this) agent by name, and keeps it for
        ``make_prepped_xfer``. A descriptor outside every registration, or an unknown agent, is
        ``nixlNotFoundError``; nothing moves."""
        for b in backends:
            self.backends[b]
        name = _text(agent_name)
        if hasattr(xfer_list, "ndim") and xfer_list.ndim == 2 and xfer_list.shape[1] == 5:
            if mem_type is None:
                raise ValueError("Please specify a mem type for strided descriptors")
            rows = []
            for addr, length, dev, stride, count in xfer_list.tolist():
                rows += [(int(addr) + i * int(stride), int(length), int(dev)) for i in range(int(count))]
            descs = nixlBind.nixlXferDList(self.nixl_mems[mem_type], rows)
        else:
            descs = self.get_xfer_descs(xfer_list, mem_type)
        if descs is None:
            raise TypeError("prep_xfer_dlist needs transfer descriptors (see get_xfer_descs)")
        rows = list(descs)
        if name in ("NIXL_INIT_AGENT", ""):
            owner = None
        elif name == self.name:
            owner = self._addr
        else:
            owner = self._remote(name, "prepXferDlist").addr
        try:
            self._raw.check(owner, [r[0] for r in rows], [r[1] for r in rows])
        except _ferry.FerryError as e:
            _raise(nixlNotFoundError,
                   f"prepXferDlist for agent {name!r}: {e}", e)
        with self._lock:
            h = next(self._ids)
            self._dlists[h] = _Dlist(None if owner is None else name, descs.getType(), rows)
        return nixl_prepped_dlist_handle(self, h)

    def _backend_for(self, backends: list[str], what: str) -> str:
        """The backend NIXL would pick for a transfer of memory: the first of ``backends`` (the
        call's), else of the agent's own in the order they were made, that moves memory (not
        POSIX, which serves files); ``nixlNotFoundError`` without one, as NIXL."""
        for b in backends or self.backends:
            if b not in _FILE_PLUGINS:
                return b
        _raise(nixlNotFoundError, f"{what}: no specified or potential backend can move memory "
               f"(the agent's backends: {list(self.backends)}; create_backend('UCX'))")
        return ""

    def _new_xfer(self, operation: str, local: list[tuple], remote: list[tuple], remote_agent: str,
                  notif_msg: Union[bytes, str], backends: list[str]) -> nixl_xfer_handle:
        op = operation
        self.nixl_ops[op]  # KeyError for an unknown operation, as NIXL
        backend = self._backend_for(backends, "createXferReq")
        if len(local) != len(remote) or not local:
            _raise(nixlInvalidParamError,
                   f"makeXferReq: different number of descriptors for local ({len(local)}), "
                   f"remote ({len(remote)})" if local or remote else "makeXferReq: no descriptors")
        for i, (l, r) in enumerate(zip(local, remote)):
            if l[1] != r[1]:
                _raise(nixlInvalidParamError,
                       f"makeXferReq: length mismatch at index {i}: local {l[1]}, remote {r[1]}")
        notif = notif_msg.encode() if isinstance(notif_msg, str) else bytes(notif_msg)
        x = _Xfer(op.lower(), remote_agent, [l[0] for l in local], [r[0] for r in remote],
                  [l[1] for l in local], notif, backend)
        with self._lock:
            h = next(self._ids)
            self._xfers[h] = x
        return nixl_xfer_handle(self, h)

    def _dlist_of(self, handle: nixl_prepped_dlist_handle) -> _Dlist:
        d = self._dlists.get(handle._handle) if not handle._released else None
        if d is None:
            _raise(nixlInvalidParamError, f"makeXferReq: {handle!r} was released or is not this agent's")
        return d  # type: ignore[return-value]

    def make_prepped_xfer(self, operation: str, local_xfer_side: nixl_prepped_dlist_handle,
                          local_indices: Any, remote_xfer_side: nixl_prepped_dlist_handle,
                          remote_indices: Any, notif_msg: Union[bytes, str] = b"",
                          backends: list[str] = [], skip_desc_merge: bool = False) -> nixl_xfer_handle:
        """A transfer request of the descriptors at ``local_indices`` and ``remote_indices`` of
        two prepared lists (their lengths pairwise equal), with a notification sent to the
        remote agent once the transfer completed (``notif_msg``)."""
        self.nixl_ops[operation]  # KeyError for an unknown operation, before anything else
        for b in backends:
            self.backends[b]
        ls, rs = self._dlist_of(local_xfer_side), self._dlist_of(remote_xfer_side)
        if ls.agent is not None or rs.agent is None:
            _raise(nixlInvalidParamError,
                   "makeXferReq: invalid sides (local must be local, remote must be remote)")
        li = [int(i) for i in (local_indices.tolist() if hasattr(local_indices, "tolist") else local_indices)]
        ri = [int(i) for i in (remote_indices.tolist() if hasattr(remote_indices, "tolist") else remote_indices)]
        if len(li) != len(ri):
            _raise(nixlInvalidParamError,
                   f"makeXferReq: different number of indices for local ({len(li)}), remote ({len(ri)})")
        for side, idx, d in (("local", li, ls), ("remote", ri, rs)):
            for k, i in enumerate(idx):
                if not 0 <= i < len(d.descs):
                    _raise(nixlInvalidParamError,
                           f"makeXferReq: {side} index out of range at index {k} with value {i}")
        return self._new_xfer(operation, [ls.descs[i] for i in li], [rs.descs[i] for i in ri],
                              rs.agent or "", notif_msg, backends)

    def initialize_xfer(self, operation: str, local_descs: nixlBind.nixlXferDList,
                        remote_descs: nixlBind.nixlXferDList, remote_agent: str,
                        notif_msg: Union[bytes, str] = b"", backends: list[str] = []) -> nixl_xfer_handle:
        """A transfer request of two descriptor lists (checked like ``prep_xfer_dlist``)."""
        self.nixl_ops[operation]  # KeyError for an unknown operation, before anything else
        for b in backends:
            self.backends[b]
        name = _text(remote_agent)
        owner = self._addr if name == self.name else self._remote(name, "createXferReq").addr
        local, remote = list(local_descs), list(remote_descs)
        if len(local) != len(remote):
            _raise(nixlInvalidParamError,
                   f"createXferReq: different descriptor list sizes (local={len(local)}, remote={len(remote)})")
        try:
            self._raw.check(None, [d[0] for d in local], [d[1] for d in local])
            self._raw.check(owner, [d[0] for d in remote], [d[1] for d in remote])
        except _ferry.FerryError as e:
            _raise(nixlNotFoundError, f"createXferReq towards {name!r}: {e}", e)
        return self._new_xfer(operation, local, remote, name, notif_msg, backends)

    def _xfer(self, handle: nixl_xfer_handle, what: str) -> _Xfer:
        x = self._xfers.get(handle._handle) if not handle._released else None
        if x is None:
            _raise(nixlInvalidParamError, f"{what}: {handle!r} was released or is not this agent's")
        return x  # type: ignore[return-value]

    def transfer(self, handle: nixl_xfer_handle, notif_msg: Union[bytes, str] = b"") -> str:
        """Posts the transfer: ``"PROC"`` while it runs, ``"DONE"``, or ``"ERR"`` (logged, and
        ``get_xfer_telemetry``/``ferry_error`` say why). A notification goes to the remote
        agent once every byte landed. Posting a transfer still running raises
        ``nixlRepostActiveError``."""
        x = self._xfer(handle, "postXferReq")
        if x.request is not None and not x.request.done():
            _raise(nixlRepostActiveError, f"postXferReq: {handle!r} is still running")
        if notif_msg:
            x.notif = notif_msg.encode() if isinstance(notif_msg, str) else bytes(notif_msg)
        remote = self._remotes.get(x.remote)
        addr = self._addr if x.remote == self.name else (remote.addr if remote else None)
        if addr is None:
            x.error = f"remote agent {x.remote!r} was removed"
            _telemetry.error(self._tm, "backend")
            logger.error("postXferReq: %s", x.error)
            return "ERR"
        t0 = time.perf_counter()
        try:
            x.request = self._raw.submit(
                addr, x.op, x.local, x.remote_addrs, x.lengths, None,
                (self.name, x.notif) if x.notif else None)
            x.error = None
        except _ferry.FerryError as e:
            x.error = str(e)
            x.request = None
            logger.error("postXferReq towards %s (%s): %s", x.remote, addr, e)
            _telemetry.error(self._tm, "backend")
            return "ERR"
        x.posted_at = t0
        x.started_us = _us(t0)
        x.ended_us = 0
        x.post_us = _us(time.perf_counter() - t0)
        return self._state(x)

    def _state(self, x: _Xfer) -> str:
        if x.request is None:
            return "ERR"
        if not x.request.done():
            return "PROC"
        first = not x.ended_us
        if first:
            x.ended_us = _us(time.perf_counter() - x.posted_at)
        outcome = x.request.wait(check=False)
        if outcome.ok and x.request.after_error is None:
            if first and self._tm is not None:
                self._tm.transfer(x.op == "write", x.nbytes, x.ended_us, x.post_us)
            return "DONE"
        if x.error is None:
            x.error = (x.request.after_error and f"the notification failed: {x.request.after_error}") or _failures.of_outcome(outcome)
            logger.error("transfer towards %s failed: %s", x.remote, x.error)
            _telemetry.error(self._tm, "backend")
        return "ERR"

    def check_xfer_state(self, handle: nixl_xfer_handle) -> str:
        """``"DONE"`` (every byte landed and the notification, if any, was delivered),
        ``"PROC"`` or ``"ERR"``."""
        return self._state(self._xfer(handle, "getXferStatus"))

    def ferry_error(self, handle: nixl_xfer_handle) -> Optional[str]:
        """Ferry extension: why the transfer ended in ``"ERR"`` (which op failed, how many
        completed before it, whether its WRITEs may have landed), or None."""
        x = self._xfer(handle, "ferry_error")
        self._state(x)
        return x.error

    def get_xfer_telemetry(self, handle: nixl_xfer_handle) -> nixlBind.nixlXferTelemetry:
        """The transfer's telemetry (``nixlXferTelemetry``) when the agent keeps it:
        ``NIXL_TELEMETRY_ENABLE`` when set, else ``capture_telemetry`` (decided when the agent
        was made); ``nixlNoTelemetryError`` otherwise."""
        x = self._xfer(handle, "getXferTelemetry")
        if not self._telemetry:
            _raise(nixlNoTelemetryError,
                   "getXferTelemetry: telemetry is not enabled (capture_telemetry, NIXL_TELEMETRY_ENABLE)")
        self._state(x)
        return nixlBind.nixlXferTelemetry(x.started_us, x.post_us, x.ended_us,
                                          x.nbytes, len(x.lengths),
                                          x.backend)

    def estimate_xfer_cost(self, req_handle: nixl_xfer_handle) -> tuple[int, int, str]:
        x = self._xfer(req_handle, "estimateXferCost")
        return sum(x.lengths) // 1000, 0, "UNKNOWN"

    def query_xfer_backend(self, handle: nixl_xfer_handle) -> str:
        """The backend chosen when the transfer was made, as NIXL chooses it: the first of the
        call's ``backends``, else of the agent's, that moves memory (Ferry's transport moves
        the bytes whatever the name)."""
        return self._xfer(handle, "queryXferBackend").backend

    def _release_xfer(self, h: int) -> None:
        with self._lock:
            x = self._xfers.pop(h, None)
        if x is not None and x.request is not None and not x.request.done():
            x.request.cancel()
            x.request.wait_drained()

    def release_xfer_handle(self, handle: nixl_xfer_handle) -> None:
        """Releases the handle; a running transfer is cancelled, and this returns once no
        byte of it can move."""
        handle.release()

    def release_dlist_handle(self, handle: nixl_prepped_dlist_handle) -> None:
        handle.release()

    def prep_mem_view(self, dlist: Any, *, backends: Optional[list[str]] = None) -> int:
        _raise(nixlNotSupportedError, "prepMemView: Ferry has no UCX GPU device API")
        return 0

    def release_mem_view(self, mvh: int) -> None:
        _raise(nixlNotSupportedError, "releaseMemView: Ferry has no UCX GPU device API")

    # ----- notifications -------------------------------------------------------------------

    def _drain(self) -> None:
        """Takes what arrived: metadata and invalidations are applied, notifications kept, each
        only from the agent it names (``_take``); the rest is dropped with a warning."""
        for name, msg, peer_id, key, epoch in self._raw.take_notifications():
            sender = Sender(peer_id, epoch, key)
            if msg.startswith(_MD_NOTIF):
                try:
                    r = self._parse(msg[len(_MD_NOTIF):])
                except nixlMismatchError:
                    continue
                # Metadata speaks of its sender alone: its name and incarnation.
                if (r.name, r.peer_id, r.epoch) != (name, sender.peer_id, sender.epoch):
                    self._drop(name, sender, "metadata",
                               f"it describes {r.name!r} as peer {r.peer_id} epoch {r.epoch}")
                elif self._take(name, sender, "metadata"):
                    self._record(r)
            elif msg == _MD_INVALIDATE:
                if self._take(name, sender, "an invalidation"):
                    self.remove_remote_agent(name)
            elif self._take(name, sender, "a notification"):
                with self._lock:
                    self._pending.setdefault(name, []).append(msg)

    def _take(self, name: str, sender: Sender, what: str) -> bool:
        """Whether ``sender`` speaks for agent ``name`` (``ferry._senders``); logged if not."""
        with self._lock:
            why = self._senders.check(name, sender)
        if why is not None:
            self._drop(name, sender, what, why)
        return why is None

    @staticmethod
    def _drop(name: str, sender: Sender, what: str, why: str) -> None:
        logger.warning("dropped %s naming agent %r from %s: %s", what, name, sender, why)

    def get_new_notifs(self, backends: list[str] = []) -> dict[str, list[bytes]]:
        """The notifications that arrived since the last call, by sending agent (only those
        from the agent they name: see the class's docs)."""
        self._drain()
        with self._lock:
            out, self._pending = self._pending, {}
        return out

    def update_notifs(self, backends: list[str] = []) -> dict[str, list[bytes]]:
        for agent, msgs in self.get_new_notifs().items():
            self.notifs.setdefault(agent, []).extend(msgs)
        return self.notifs

    def check_remote_xfer_done(self, remote_agent_name: str, lookup_tag: bytes,
                               backends: list[str] = [], tag_is_prefix: bool = True) -> bool:
        """Whether a notification from the agent starts with (or contains) ``lookup_tag``;
        the one found is removed."""
        self.update_notifs()
        msgs = self.notifs.get(_text(remote_agent_name), [])
        for m in msgs:
            if (tag_is_prefix and m.startswith(lookup_tag)) or (not tag_is_prefix and lookup_tag in m):
                msgs.remove(m)
                return True
        return False

    def send_notif(self, remote_agent_name: Union[str, bytes], notif_msg: Union[bytes, str],
                   backend: Optional[str] = None) -> None:
        """Sends a notification to the remote agent (not bound to a transfer)."""
        r = self._remote(remote_agent_name, "genNotif")
        msg = notif_msg.encode() if isinstance(notif_msg, str) else bytes(notif_msg)
        try:
            self._raw.notify(r.addr, self.name, msg)
        except _ferry.FerryError as e:
            _raise(nixlBackendError, f"genNotif to {r.name} at {r.addr}: {e}", e)

