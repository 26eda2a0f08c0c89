"""The names NIXL's ``nixl._bindings`` gives users, on Ferry: descriptor lists, the enums and
constants, the exception classes, telemetry, and the agent as NIXL's C++ API names it
(``nixlAgentConfig``, ``nixlAgent``). ``ferry.nixl._api`` is the Python agent; each
``nixl_agent`` stands on a ``nixlAgent``, and a ``nixlAgent`` made directly serves its calls
through a ``nixl_agent`` of its own.

Ferry's versions are plain Python: a descriptor list is a memory type and a list of tuples;
an exception carries NIXL's status name and, after it, Ferry's reason (``str(e)`` starts with
the status name, as NIXL's is exactly it).
"""

from __future__ import annotations

import contextlib
import contextvars
import enum
import os
import weakref
from typing import Any, Iterable, Iterator, Optional

from ferry._ferry import FerryError

DEFAULT_COMM_PORT = 8888
#: The agent name ``prep_xfer_dlist`` takes for local descriptors.
NIXL_INIT_AGENT = ""
#: Ferry has no UCX GPU device API (``prep_mem_view``).
HAVE_UCX_GPU_DEVICE_API = False


class nixl_mem_t(enum.IntEnum):
    DRAM_SEG = 0
    VRAM_SEG = 1
    BLK_SEG = 2
    OBJ_SEG = 3
    FILE_SEG = 4


class nixl_xfer_op_t(enum.IntEnum):
    NIXL_READ = 0
    NIXL_WRITE = 1


class nixl_status_t(enum.IntEnum):
    NIXL_IN_PROG = 1
    NIXL_SUCCESS = 0
    NIXL_ERR_NOT_POSTED = -1
    NIXL_ERR_INVALID_PARAM = -2
    NIXL_ERR_BACKEND = -3
    NIXL_ERR_NOT_FOUND = -4
    NIXL_ERR_MISMATCH = -5
    NIXL_ERR_NOT_ALLOWED = -6
    NIXL_ERR_REPOST_ACTIVE = -7
    NIXL_ERR_UNKNOWN = -8
    NIXL_ERR_NOT_SUPPORTED = -9


class nixl_thread_sync_t(enum.IntEnum):
    NIXL_THREAD_SYNC_NONE = 0
    NIXL_THREAD_SYNC_STRICT = 1
    NIXL_THREAD_SYNC_RW = 2
    NIXL_THREAD_SYNC_DEFAULT = 0


class nixl_cost_t(enum.IntEnum):
    NIXL_COST_ANALYTICAL_BACKEND = 0


DRAM_SEG, VRAM_SEG, BLK_SEG, OBJ_SEG, FILE_SEG = (
    nixl_mem_t.DRAM_SEG, nixl_mem_t.VRAM_SEG, nixl_mem_t.BLK_SEG, nixl_mem_t.OBJ_SEG,
    nixl_mem_t.FILE_SEG,
)
NIXL_READ, NIXL_WRITE = nixl_xfer_op_t.NIXL_READ, nixl_xfer_op_t.NIXL_WRITE
globals().update({m.name: m for m in nixl_status_t})
NIXL_THREAD_SYNC_NONE = nixl_thread_sync_t.NIXL_THREAD_SYNC_NONE
NIXL_THREAD_SYNC_STRICT = nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT
NIXL_THREAD_SYNC_RW = nixl_thread_sync_t.NIXL_THREAD_SYNC_RW
NIXL_THREAD_SYNC_DEFAULT = nixl_thread_sync_t.NIXL_THREAD_SYNC_NONE
NIXL_COST_ANALYTICAL_BACKEND = nixl_cost_t.NIXL_COST_ANALYTICAL_BACKEND


class _NixlError(FerryError):
    """NIXL's exceptions on Ferry: ``str(e)`` is the status name, then Ferry's reason."""

    status = "NIXL_ERR_UNKNOWN"

    def __init__(self, reason: str = "") -> None:
        super().__init__(f"{self.status}: {reason}" if reason else self.status)
        self.reason = reason


def _error(name: str, status: str) -> type:
    return type(name, (_NixlError,), {"status": status, "__module__": __name__,
                                      "__doc__": f"NIXL's {status}."})


nixlNotPostedError = _error("nixlNotPostedError", "NIXL_ERR_NOT_POSTED")
nixlInvalidParamError = _error("nixlInvalidParamError", "NIXL_ERR_INVALID_PARAM")
nixlBackendError = _error("nixlBackendError", "NIXL_ERR_BACKEND")
nixlNotFoundError = _error("nixlNotFoundError", "NIXL_ERR_NOT_FOUND")
nixlMismatchError = _error("nixlMismatchError", "NIXL_ERR_MISMATCH")
nixlNotAllowedError = _error("nixlNotAllowedError", "NIXL_ERR_NOT_ALLOWED")
nixlRepostActiveError = _error("nixlRepostActiveError", "NIXL_ERR_REPOST_ACTIVE")
nixlUnknownError = _error("nixlUnknownError", "NIXL_ERR_UNKNOWN")
nixlNotSupportedError = _error("nixlNotSupportedError", "NIXL_ERR_NOT_SUPPORTED")
nixlRemoteDisconnectError = _error("nixlRemoteDisconnectError", "NIXL_ERR_REMOTE_DISCONNECT")
nixlCancelledError = _error("nixlCancelledError", "NIXL_ERR_CANCELED")
nixlNoTelemetryError = _error("nixlNoTelemetryError", "NIXL_ERR_NO_TELEMETRY")


def _rows(descs: Any, width: int, what: str) -> list[tuple]:
    """Descriptors as tuples: a sequence of tuples of ``width`` elements, or an Nx3 array."""
    if hasattr(descs, "ndim") and hasattr(descs, "tolist"):
        if descs.ndim != 2 or descs.shape[1] != 3 or descs.dtype.kind not in "iu":
            raise ValueError("descs must be a Nx3 numpy array of uint64 or int64")
        rows = [tuple(int(x) for x in r) for r in descs.tolist()]
        return [r + ("",) for r in rows] if width == 4 else rows
    out = []
    for d in descs:
        t = tuple(d)
        if len(t) != width:
            raise ValueError(f"Each descriptor tuple must have exactly {width} elements")
        addr, length, dev = (int(t[0]), int(t[1]), int(t[2]))
        if addr < 0 or length < 0 or dev < 0:
            raise ValueError(f"{what}: address, length and device ID must not be negative: {t}")
        out.append((addr, length, dev) + t[3:])
    return out


class _DList:
    width = 3

    def __init__(self, mem_type: Any, descs: Iterable = (), sorted: bool = False) -> None:
        self._type = nixl_mem_t(int(mem_type))
        self._descs = _rows(descs, self.width, type(self).__name__)

    def getType(self) -> nixl_mem_t:
        return self._type

    def descCount(self) -> int:
        return len(self._descs)

    def isEmpty(self) -> bool:
        return not self._descs

    def __len__(self) -> int:
        return len(self._descs)

    def addDesc(self, desc: tuple) -> None:
        """Appends one descriptor (a tuple of the list's width)."""
        self._descs += _rows([desc], self.width, type(self).__name__)

    append = addDesc

    def remDesc(self, index: int) -> None:
        """Removes the descriptor at ``index`` (``IndexError`` past the end)."""
        del self._descs[int(index)]

    def clear(self) -> None:
        self._descs = []

    def index(self, desc: tuple) -> int:
        """The index of ``desc``; ``nixlNotFoundError`` if the list lacks it."""
        row = _rows([desc], self.width, type(self).__name__)[0]
        try:
            return self._descs.index(row)
        except ValueError:
            raise nixlNotFoundError(
                f"{type(self).__name__}.index: {desc!r} is not in the list") from None

    def __setitem__(self, i: int, desc: tuple) -> None:
        self._descs[i] = _rows([desc], self.width, type(self).__name__)[0]

    def print(self) -> None:
        """Prints the list (NIXL's ``print()``: its type, count and descriptors)."""
        print(f"DescList of mem type {self._type.name}, {len(self._descs)} descriptors:")
        for d in self._descs:
            print("  " + ", ".join(str(x) for x in d))

    def __getitem__(self, i: int) -> tuple:
        return self._descs[i]

    def __iter__(self) -> Iterator[tuple]:
        return iter(self._descs)

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and other._type == self._type and other._descs == self._descs  # type: ignore[attr-defined]

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._type.name}, {self._descs!r})"


class nixlXferDList(_DList):
    """Transfer descriptors: ``(address, length, device ID)``."""


class nixlRegDList(_DList):
    """Registration descriptors: ``(address, length, device ID, meta info)``."""

    width = 4

    def trim(self) -> None:
        """NIXL frees the list's spare capacity; a Python list keeps none to give back."""


class nixlRemoteDList(_DList):
    """Remote descriptors: ``(address, length, device ID, agent name)``."""

    width = 4


class nixlXferTelemetry:
    """A transfer's telemetry, as NIXL's ``getXferTelemetry`` gives it: ``startTime`` (when it
    was posted, microseconds of the monotonic clock), ``postDuration`` (how long the post took)
    and ``xferDuration`` (from the post until the transfer was seen complete), both in whole
    microseconds rounded up, ``totalBytes`` and ``descCount``; ``backendName`` is the backend
    name ``query_xfer_backend`` gives."""

    def __init__(self, startTime: int = 0, postDuration: int = 0, xferDuration: int = 0,
                 totalBytes: int = 0, descCount: int = 0, backendName: str = "") -> None:
        self.startTime = startTime
        self.postDuration = postDuration
        self.xferDuration = xferDuration
        self.totalBytes = totalBytes
        self.descCount = descCount
        self.backendName = backendName

    def __repr__(self) -> str:
        return (f"nixlXferTelemetry(startTime={self.startTime}, postDuration={self.postDuration}, "
                f"xferDuration={self.xferDuration}, totalBytes={self.totalBytes}, "
                f"descCount={self.descCount}, backendName={self.backendName!r})")


_TRUE = ("y", "yes", "on", "1", "true", "enable")
_FALSE = ("n", "no", "off", "0", "false", "disable")


def _telemetry_enabled(capture_telemetry: bool) -> bool:
    """Whether an agent keeps per-transfer telemetry, as NIXL decides it when an agent is made:
    ``NIXL_TELEMETRY_ENABLE`` when it is set (``y``/``yes``/``on``/``1``/``true``/``enable`` or
    their negatives, any case; anything else is ``RuntimeError``), else ``capture_telemetry``.
    So ``NIXL_TELEMETRY_ENABLE=no`` turns off what the agent's config asked for."""
    value = os.environ.get("NIXL_TELEMETRY_ENABLE")
    if value is None or value.strip() == "":
        return bool(capture_telemetry)
    v = value.strip().lower()
    if v in _TRUE:
        return True
    if v in _FALSE:
        return False
    raise RuntimeError(
        f"NIXL_TELEMETRY_ENABLE={value!r}: known are {', '.join(_TRUE)} as positive and "
        f"{', '.join(_FALSE)} as negative (case insensitive)")


class nixlAgentConfig:
    """NIXL's C++ agent configuration (``nixlAgentConfig``), positional arguments in NIXL's
    order. Ferry reads ``useListenThread``, ``listenPort`` and ``captureTelemetry``; the
    others are kept and change nothing (Ferry's engine has its own threads)."""

    def __init__(self, useProgThread: bool = True, useListenThread: bool = False,
                 listenPort: int = DEFAULT_COMM_PORT,
                 syncMode: Any = nixl_thread_sync_t.NIXL_THREAD_SYNC_DEFAULT,
                 num_workers: int = 1, pthrDelay: int = 0, lthrDelay: int = 100000,
                 captureTelemetry: bool = False) -> None:
        self.useProgThread = useProgThread
        self.useListenThread = useListenThread
        self.listenPort = listenPort
        self.syncMode = syncMode
        self.num_workers = num_workers
        self.pthrDelay = pthrDelay
        self.lthrDelay = lthrDelay
        self.captureTelemetry = captureTelemetry
        self.etcdWatchTimeout = 5_000_000

    def __repr__(self) -> str:
        return f"nixlAgentConfig({vars(self)!r})"


#: The ``nixl_agent`` being made, while it makes its ``nixlAgent`` (``_building``).
_BUILDING: contextvars.ContextVar[Any] = contextvars.ContextVar("ferry_nixl_building", default=None)
#: The ``nixlAgent`` being made directly, while it makes the ``nixl_agent`` that serves it.
_ADOPTING: contextvars.ContextVar[Any] = contextvars.ContextVar("ferry_nixl_adopting", default=None)


@contextlib.contextmanager
def _building(agent: Any) -> Iterator[None]:
    """While ``agent`` (a ``nixl_agent``) makes its ``nixlAgent``: the ``nixlAgent`` made then
    serves its calls through ``agent`` rather than through a ``nixl_agent`` of its own."""
    tok = _BUILDING.set(agent)
    try:
        yield
    finally:
        _BUILDING.reset(tok)


def _adopting() -> Any:
    """The ``nixlAgent`` a ``nixl_agent`` being made now is to stand on, or None."""
    return _ADOPTING.get()


_STATUS = {"DONE": nixl_status_t.NIXL_SUCCESS, "PROC": nixl_status_t.NIXL_IN_PROG}


class nixlAgent:
    """NIXL's agent as its C++ API names it (``registerMem``, ``createXferReq``,
    ``postXferReq``, ...), returning NIXL's statuses and integer handles, and raising NIXL's
    exceptions. Every call is served by a ``ferry.nixl.nixl_agent``: the one that made this
    object, or, for one made directly, one of its own made from ``config``."""

    def __init__(self, name: str, config: nixlAgentConfig) -> None:
        if not name:
            raise ValueError("Agent needs a non-empty name")
        self.name = name
        self.config = config
        self._backends: dict[int, str] = {}
        self._xfers: dict[int, Any] = {}
        self._dlists: dict[int, Any] = {}
        owner = _BUILDING.get()
        if owner is not None:
            self._own: Any = None
            self._ref = weakref.ref(owner)
            return
        from ferry.nixl import _api

        tok = _ADOPTING.set(self)
        try:
            self._own = _api.nixl_agent(name, _api.nixl_agent_config(
                enable_listen_thread=bool(config.useListenThread),
                listen_port=int(config.listenPort),
                capture_telemetry=bool(config.captureTelemetry), backends=[]))
        finally:
            _ADOPTING.reset(tok)
        self._ref = weakref.ref(self._own)

    def _a(self) -> Any:
        a = self._ref()
        if a is None:
            raise nixlInvalidParamError(f"nixlAgent {self.name!r}: its nixl_agent is gone")
        return a

    def _names(self, backends: Iterable[int]) -> list[str]:
        out = []
        for b in backends:
            if int(b) not in self._backends:
                raise nixlInvalidParamError(f"no backend handle {b} on agent {self.name!r}")
            out.append(self._backends[int(b)])
        return out

    def _xfer(self, reqh: int) -> Any:
        h = self._xfers.get(int(reqh))
        if h is None:
            raise nixlInvalidParamError(f"no transfer request {reqh} on agent {self.name!r}")
        return h

    # plugins and backends
    def getAvailPlugins(self) -> list[str]:
        return list(self._a().get_plugin_list())

    def getPluginParams(self, type: str) -> tuple[dict[str, str], list[str]]:
        a = self._a()
        if type not in a.get_plugin_list():
            raise nixlNotFoundError(
                f"getPluginParams: Ferry serves {a.get_plugin_list()}, not {type!r}")
        return dict(a.get_plugin_params(type)), list(a.get_plugin_mem_types(type))

    def getBackendParams(self, backend: int) -> tuple[dict[str, str], list[str]]:
        name = self._names([backend])[0]
        a = self._a()
        return dict(a.get_backend_params(name)), list(a.get_backend_mem_types(name))

    def createBackend(self, type: str, initParams: dict[str, str] = {}) -> int:
        a = self._a()
        a.create_backend(type, dict(initParams))
        h = int(a.backends[type])
        self._backends[h] = type
        return h

    # memory
    def registerMem(self, descs: nixlRegDList, backends: list[int] = []) -> nixl_status_t:
        self._a().register_memory(descs, backends=self._names(backends))
        return nixl_status_t.NIXL_SUCCESS

    def deregisterMem(self, descs: nixlRegDList, backends: list[int] = []) -> nixl_status_t:
        self._a().deregister_memory(descs, backends=self._names(backends))
        return nixl_status_t.NIXL_SUCCESS

    def queryMem(self, descs: nixlRegDList, backend: int) -> list[Optional[dict[str, str]]]:
        return self._a().query_memory(descs, self._names([backend])[0])

    # metadata
    def getLocalMD(self) -> bytes:
        return self._a().get_agent_metadata()

    def getLocalPartialMD(self, descs: Any, inc_conn_info: bool = False,
                          backends: list[int] = []) -> bytes:
        return self._a().get_partial_agent_metadata(descs, inc_conn_info, self._names(backends))

    def loadRemoteMD(self, remote_metadata: bytes) -> bytes:
        return self._a().add_remote_agent(remote_metadata)

    def invalidateRemoteMD(self, remote_agent: str) -> nixl_status_t:
        a = self._a()
        if remote_agent not in a._remotes:
            raise nixlNotFoundError(f"invalidateRemoteMD: no metadata of {remote_agent!r}")
        a.remove_remote_agent(remote_agent)
        return nixl_status_t.NIXL_SUCCESS

    def checkRemoteMD(self, remote_name: str, descs: Any = None) -> bool:
        return bool(self._a().check_remote_metadata(remote_name, descs))

    def sendLocalMD(self, ip_addr: str = "", port: int = 0) -> None:
        self._a().send_local_metadata(ip_addr, port or DEFAULT_COMM_PORT)

    def sendLocalPartialMD(self, descs: Any, inc_conn_info: bool = False, backends: list[int] = [],
                           ip_addr: str = "", port: int = 0, label: str = "") -> None:
        self._a().send_partial_agent_metadata(descs, inc_conn_info, self._names(backends),
                                              ip_addr, port or DEFAULT_COMM_PORT, label)

    def prepMemView(self, dlist: Any, backends: list[int] = []) -> int:
        """``nixlNotSupportedError``: Ferry has no UCX GPU device API."""
        return self._a().prep_mem_view(dlist, backends=self._names(backends))

    def releaseMemView(self, mvh: int) -> None:
        self._a().release_mem_view(mvh)

    def fetchRemoteMD(self, remote_name: str, ip_addr: str = "", port: int = 0,
                      label: str = "") -> None:
        self._a().fetch_remote_metadata(remote_name, ip_addr, port or DEFAULT_COMM_PORT, label)

    def invalidateLocalMD(self, ip_addr: str = "", port: int = 0) -> None:
        self._a().invalidate_local_metadata(ip_addr, port or DEFAULT_COMM_PORT)

    def makeConnection(self, remote_agent: str, backends: list[int] = []) -> None:
        self._a().make_connection(remote_agent, self._names(backends))

    # transfers
    def prepXferDlist(self, agent_name: str, descs: nixlXferDList, backends: list[int] = []) -> int:
        h = self._a().prep_xfer_dlist(agent_name or NIXL_INIT_AGENT, descs,
                                      backends=self._names(backends))
        self._dlists[h._handle] = h
        return h._handle

    def releasedDlistH(self, handle: int) -> nixl_status_t:
        h = self._dlists.pop(int(handle), None)
        if h is None:
            raise nixlInvalidParamError(f"no prepared list {handle} on agent {self.name!r}")
        h.release()
        return nixl_status_t.NIXL_SUCCESS

    def _keep(self, h: Any) -> int:
        self._xfers[h._handle] = h
        return h._handle

    def makeXferReq(self, operation: Any, local_side: int, local_indices: list[int],
                    remote_side: int, remote_indices: list[int], notif_msg: Any = "",
                    backends: list[int] = [], skip_desc_merge: bool = False) -> int:
        sides = []
        for s in (local_side, remote_side):
            if int(s) not in self._dlists:
                raise nixlInvalidParamError(f"no prepared list {s} on agent {self.name!r}")
            sides.append(self._dlists[int(s)])
        return self._keep(self._a().make_prepped_xfer(
            nixl_xfer_op_t(int(operation)).name[len("NIXL_"):], sides[0], local_indices,
            sides[1], remote_indices, notif_msg, self._names(backends), skip_desc_merge))

    def createXferReq(self, operation: Any, local_descs: nixlXferDList,
                      remote_descs: nixlXferDList, remote_agent: str, notif_msg: Any = "",
                      backends: list[int] = []) -> int:
        return self._keep(self._a().initialize_xfer(
            nixl_xfer_op_t(int(operation)).name[len("NIXL_"):], local_descs, remote_descs,
            remote_agent, notif_msg, self._names(backends)))

    def _status(self, h: Any, state: str, what: str) -> nixl_status_t:
        if state == "ERR":
            raise nixlBackendError(f"{what}: {self._a().ferry_error(h)}")
        return _STATUS[state]

    def postXferReq(self, reqh: int, notif_msg: Any = "") -> nixl_status_t:
        h = self._xfer(reqh)
        return self._status(h, self._a().transfer(h, notif_msg), "postXferReq")

    def getXferStatus(self, reqh: int) -> nixl_status_t:
        h = self._xfer(reqh)
        return self._status(h, self._a().check_xfer_state(h), "getXferStatus")

    def getXferTelemetry(self, reqh: int) -> nixlXferTelemetry:
        return self._a().get_xfer_telemetry(self._xfer(reqh))

    def estimateXferCost(self, req_handle: int) -> tuple[int, int, int]:
        duration, margin, _ = self._a().estimate_xfer_cost(self._xfer(req_handle))
        return duration, margin, int(nixl_cost_t.NIXL_COST_ANALYTICAL_BACKEND)

    def queryXferBackend(self, reqh: int) -> int:
        a = self._a()
        return int(a.backends.get(a.query_xfer_backend(self._xfer(reqh)), 0))

    def releaseXferReq(self, reqh: int) -> nixl_status_t:
        self._xfer(reqh).release()
        del self._xfers[int(reqh)]
        return nixl_status_t.NIXL_SUCCESS

    # notifications
    def getNotifs(self, notif_map: dict[str, list[bytes]],
                  backends: list[int] = []) -> dict[str, list[bytes]]:
        """Adds the notifications that arrived to ``notif_map`` and returns it."""
        for agent, msgs in self._a().get_new_notifs(self._names(backends)).items():
            notif_map.setdefault(agent, []).extend(msgs)
        return notif_map

    def genNotif(self, remote_agent: str, msg: Any, backends: list[int] = []) -> None:
        names = self._names(backends)
        self._a().send_notif(remote_agent, msg, names[0] if names else None)
