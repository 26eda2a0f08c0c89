"""The names NIXL's ``nixl._bindings`` gives users, on Ferry: descriptor lists, the enums and
constants, the exception classes, telemetry. The agent itself is ``ferry.nixl._api``.

Ferry's versions are plain Python: a descriptor list is a memory type and a list of tuples;
an exception carries NIXL's status name and, after it, Ferry's reason (``str(e)`` starts with
the status name, as NIXL's is exactly it).
"""

from __future__ import annotations

import enum
from typing import Any, Iterable, Iterator

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


class nixlRemoteDList(_DList):
    """Remote descriptors: ``(address, length, device ID, agent name)``."""

    width = 4


class nixlXferTelemetry:
    """A transfer's telemetry: times in microseconds, bytes and descriptors."""

    def __init__(self, startTime: int = 0, postDuration: int = 0, xferDuration: int = 0,
                 totalBytes: int = 0, descCount: int = 0) -> None:
        self.startTime = startTime
        self.postDuration = postDuration
        self.xferDuration = xferDuration
        self.totalBytes = totalBytes
        self.descCount = descCount

    def __repr__(self) -> str:
        return (f"nixlXferTelemetry(startTime={self.startTime}, postDuration={self.postDuration}, "
                f"xferDuration={self.xferDuration}, totalBytes={self.totalBytes}, "
                f"descCount={self.descCount})")
