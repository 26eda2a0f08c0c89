"""Weight broadcast from Python: a trainer's tensors into live inference tensors, versioned.

A trainer publishes named tensors of its own memory (no copy for host memory); each inference
process pulls a version straight into the tensors it serves from, and relays what it verified
to the next receiver, so the trainer sends each byte about once::

    import numpy as np, ferry
    from ferry.broadcast import Publisher, pull

    trainer = ferry.Engine(listen="127.0.0.1:0")
    weights = {"w1": np.ones((1024, 1024), np.float32), "b1": np.zeros(1024, np.float32)}
    with Publisher(trainer, weights, name="policy", version=1) as pub:
        ...  # give pub.addr to the inference processes

    # in an inference process:
    engine = ferry.Engine(listen="127.0.0.1:0")
    live = {"w1": np.empty((1024, 1024), np.float32), "b1": np.empty(1024, np.float32)}
    summary = pull(engine, addr, live, name="policy")          # in place
    summary = pull(engine, addr, live, mode="staged", staging=spare)
    summary.commit()                                             # staged: now into `live`

Tensors are NumPy arrays (or any buffer-protocol object), objects with
``__cuda_array_interface__`` (GPU memory), ``Registration``/``GpuRegistration`` objects, or
``(registration, offset, length)`` tuples. Names and sizes are matched before any byte moves;
a mismatch is one ``TensorMismatch`` that lists every problem. An in-place pull that fails
(or times out) after its first byte raises ``TornError`` naming the tensors and the version they were moving
to; ``held(array)`` says what an array holds. A staged pull leaves the live tensors untouched
until ``commit()``.

Arrays are registered with the engine for the call and closed after it; pass registrations
(``engine.register(array, access="read")``, made once) to keep them registered across pulls,
which matters where registering is costly (RDMA).

Versions: ``Publisher.publish(tensors, version)`` serves version v+1 while v is still pulled
(the publisher keeps the newest ``keep_versions``); v+1 must live in other memory than v for v
to stay servable. Receivers of v+1 never take chunks from a receiver of v.
"""

from __future__ import annotations

import asyncio
import time
import uuid
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from ferry._ferry import (
    Engine,
    FerryError,
    GpuRegistration,
    InvalidArgument,
    Registration,
    _join,
    _publish,
)

__all__ = [
    "BroadcastError",
    "Publisher",
    "PullStalled",
    "PullSummary",
    "PullTimeout",
    "TensorMismatch",
    "Torn",
    "TornError",
    "held",
    "pull",
    "pull_async",
]


class BroadcastError(FerryError):
    """A broadcast failed; ``name`` and ``version`` say which (empty and 0 when unknown)."""

    name: str = ""
    version: int = 0


class TensorMismatch(BroadcastError, ValueError):
    """The published tensors and the destinations differ (missing, extra or differently sized
    tensors, all listed in ``problems``); nothing moved."""

    problems: list[str] = []


class PullTimeout(BroadcastError, TimeoutError):
    """A pull did not complete within its ``timeout`` (nothing was written, or the pull was
    staged: an in-place pull cut short after its first byte is a ``TornError``)."""


class PullStalled(BroadcastError):
    """A pull cannot go on: ``holder`` (the source, or the last relay that could serve the chunks
    still missing) was given up (it stalled, died or was refused) and no other holder has them;
    ``verified`` of ``chunks`` chunks were verified. An in-place pull cut short so is a
    ``TornError`` whose ``__cause__`` is this."""

    holder: str = ""
    verified: int = 0
    chunks: int = 0


class TornError(BroadcastError):
    """An in-place pull failed after writing: ``tensors`` hold neither their old version nor
    ``version``, the one they were moving to."""

    tensors: list[str] = []


@dataclass(frozen=True)
class Torn:
    """What ``held`` returns for a tensor an in-place pull left half-written."""

    moving_to: int


# id(destination) -> (weak reference to it, what it holds). Keyed by id because arrays are not
# hashable; the weak reference's callback drops the entry with the object.
_HELD: "dict[int, tuple[weakref.ref[Any], int | Torn]]" = {}

_NUMPY_DTYPES = {
    "float64": "F64",
    "float32": "F32",
    "float16": "F16",
    "bfloat16": "BF16",
    "int64": "I64",
    "int32": "I32",
    "int16": "I16",
    "int8": "I8",
    "uint64": "U64",
    "uint32": "U32",
    "uint16": "U16",
    "uint8": "U8",
    "bool": "BOOL",
}


def held(obj: Any) -> int | Torn | None:
    """The version ``obj`` (a destination of ``pull``) holds, ``Torn(v)`` after an in-place
    pull towards v failed, or None when no pull wrote it (or it cannot be tracked)."""
    entry = _HELD.get(id(obj))
    if entry is None or entry[0]() is not obj:
        return None
    return entry[1]


def _mark(objs: Any, state: int | Torn) -> None:
    for o in objs:
        key = id(o)

        def gone(ref: Any, key: int = key) -> None:
            if _HELD.get(key, (None,))[0] is ref:
                del _HELD[key]

        try:
            _HELD[key] = (weakref.ref(o, gone), state)
        except TypeError:  # not weakly referenceable: not tracked
            pass


def _whole(what: str, value: Any, minimum: int) -> int:
    """``value`` as an int of at least ``minimum``; ``InvalidArgument`` (a ``ValueError``)
    naming ``what`` otherwise."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgument(f"{what} must be a whole number, not {value!r}")
    if value < minimum:
        raise InvalidArgument(f"{what} must be at least {minimum}, not {value}")
    return value


def _seconds(what: str, value: Any) -> None:
    """Refuses anything but None or a number of seconds from 0 to 1e9 (NaN too)."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (0 <= value < 1e9):
        raise InvalidArgument(f"{what} must be a number of seconds from 0 to 1e9, not {value!r}")


def _unique(prefix: str) -> str:
    return f"{prefix}.{uuid.uuid4().hex[:12]}"


class _Placed:
    """Tensors of a mapping as registrations of one engine: what the native layer takes."""

    def __init__(self, engine: Engine, tensors: Mapping[str, Any], prefix: str, *, writable: bool):
        self.regs: list[Any] = []  # registrations made here, closed with this object
        self.list: list[tuple] = []
        for i, (name, obj) in enumerate(tensors.items()):
            if not isinstance(name, str):
                raise TypeError(f"tensor names must be str, not {type(name).__name__}")
            reg, offset, length, dtype, shape = self._place(engine, obj, f"{prefix}.{i}", name, writable)
            self.list.append((name, reg, offset, length, dtype, shape))

    def _place(self, engine: Engine, obj: Any, seg: str, name: str, writable: bool):
        if isinstance(obj, tuple) and len(obj) == 3 and isinstance(obj[0], (Registration, GpuRegistration)):
            reg, offset, length = obj
            return reg, int(offset), int(length), None, None
        if isinstance(obj, (Registration, GpuRegistration)):
            return obj, 0, len(obj), None, None
        shape = getattr(obj, "shape", None)
        dtype = _NUMPY_DTYPES.get(str(getattr(obj, "dtype", "")))
        shape = [int(d) for d in shape] if shape is not None else None
        if hasattr(obj, "__cuda_array_interface__"):
            reg = engine.register_gpu(obj, name=seg, access="read")
        else:
            flags = getattr(obj, "flags", None)
            if writable and flags is not None and not flags.writeable:
                raise TypeError(f"tensor {name!r}: the destination array is read-only")
            reg = engine.register(obj, name=seg, access="read")
            if writable and reg.readonly:
                reg.close()
                raise TypeError(f"tensor {name!r}: the destination buffer is read-only")
        self.regs.append(reg)
        return reg, 0, len(reg), dtype, shape

    def dests(self) -> list[tuple]:
        return [(n, r, o, l) for (n, r, o, l, _, _) in self.list]

    def kinds(self) -> dict[str, tuple]:
        """Each array's dtype and shape, where it has them: checked against the manifest."""
        return {n: (d, s) for (n, _, _, _, d, s) in self.list if d is not None or s is not None}

    def close(self) -> None:
        for r in self.regs:
            r.close()
        self.regs.clear()


class Publisher:
    """Publishes ``tensors`` (name to array, GPU array or registration) of ``engine`` (which
    must listen) as version ``version`` of the broadcast ``name``. ``addr`` is what receivers
    are given; with ``discovery="etcd://HOST:PORT"`` the publisher also lists itself in that
    etcd, and receivers may be given ``etcd://HOST:PORT/NAME`` instead (``etcd_source``). Host
    arrays are served where they lie: leave them unchanged while their version is served, and
    publish the next version from other arrays. With ``auth_key_file`` (a keyring file, as
    ``Engine(auth_key_file=...)`` takes; give the engine the same) the control service answers
    only members that prove a key of it. ``digest`` is the newest version's manifest digest, for
    receivers' ``expect_manifest``. A context manager."""

    def __init__(
        self,
        engine: Engine,
        tensors: Mapping[str, Any],
        *,
        name: str,
        version: int = 1,
        chunk_size: int | None = None,
        discovery: str | None = None,
        listen: str | None = None,
        keep_versions: int = 2,
        auth_key_file: str | None = None,
    ):
        _whole("version", version, 0)
        _whole("keep_versions", keep_versions, 1)
        if chunk_size is not None:
            _whole("chunk_size", chunk_size, 1)
        if engine.listen_addr is None:
            raise InvalidArgument(
                'the engine does not listen, so receivers cannot reach it: make it with '
                'ferry.Engine(listen="HOST:PORT") ("127.0.0.1:0": any free port)'
            )
        if listen is None:
            ip = (engine.listen_addr or "127.0.0.1:0").rsplit(":", 1)[0]
            listen = f"{ip}:0"
        self.name = name
        self._discovery = discovery
        self._engine = engine
        self._keep = keep_versions
        self._placed: dict[int, _Placed] = {}
        placed = _Placed(engine, tensors, _unique(f"ferry.bcast.{name}.v{version}"), writable=False)
        try:
            self._native = _publish(
                engine,
                name,
                version,
                placed.list,
                chunk_size,
                listen,
                self._keep,
                auth_key_file,
                discovery,
            )
        except BaseException:
            placed.close()
            raise
        self._placed[version] = placed
        self.version = version

    @property
    def addr(self) -> str:
        """The address receivers are given (``pull(engine, pub.addr, ...)``)."""
        return self._native.addr

    @property
    def digest(self) -> str:
        """The newest version's manifest digest (64 hex digits): give it to receivers as
        ``pull(..., expect_manifest=...)`` to bind every chunk to this publisher."""
        return self._native.digest()

    @property
    def etcd_source(self) -> str | None:
        """With etcd discovery, the source receivers may pull from instead of ``addr``:
        ``etcd://HOST:PORT/NAME`` (with ``expect_manifest=digest``, or keys); else None."""
        if self._discovery is None:
            return None
        host = self._discovery.removeprefix("etcd://").split("/", 1)[0]
        return f"etcd://{host}/{self.name}"

    @property
    def versions(self) -> list[int]:
        """The versions served now, oldest first."""
        return self._native.versions()

    def publish(self, tensors: Mapping[str, Any], version: int) -> None:
        """Publishes ``version`` (above the newest) from ``tensors``; the oldest version beyond
        ``keep_versions`` is dropped and its registrations closed."""
        _whole("version", version, 0)
        placed = _Placed(self._engine, tensors, _unique(f"ferry.bcast.{self.name}.v{version}"), writable=False)
        try:
            self._native.publish(version, placed.list)
        except BaseException:
            placed.close()
            raise
        self._placed[version] = placed
        self.version = version
        kept = set(self._native.versions())
        for v in [v for v in self._placed if v not in kept]:
            self._placed.pop(v).close()

    def close(self) -> None:
        """Stops serving and closes the registrations it made."""
        self._native.close()
        for p in self._placed.values():
            p.close()
        self._placed.clear()

    def __enter__(self) -> "Publisher":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


@dataclass
class PullSummary:
    """What a pull did. ``bytes`` is the payload, ``from_source``/``from_relays`` the bytes
    received from each, ``refetched`` the chunks fetched again after a checksum mismatch;
    ``parents_given_up`` the relay parents left for another, ``holders_stalled`` the holders
    given up for advertising nothing new in time, ``holders_left`` those given up because they
    left (each pulled from elsewhere). In staged mode ``commit()`` copies the staging into the live tensors (until then they are
    untouched) and returns the seconds it took."""

    version: int
    bytes: int
    seconds: float
    from_source: int
    from_relays: int
    refetched: int
    parents_given_up: int = 0
    holders_stalled: int = 0
    holders_left: int = 0
    mode: str = "in_place"
    bytes_copied: int = 0
    committed: bool = False
    _native: Any = field(default=None, repr=False)
    _placed: list = field(default_factory=list, repr=False)
    _live: list = field(default_factory=list, repr=False)

    @property
    def gb_per_s(self) -> float:
        return self.bytes / max(self.seconds, 1e-9) / 1e9

    @property
    def copies_per_byte(self) -> float:
        """Bytes the CPU copied (host memory copied out to be hashed as it lands, and a
        commit's copy; the check at rest reads memory in place where the CPU can) per byte
        received: counted, not timed. In place 1.0, staged 2.0 after the commit (x86-64)."""
        return self.bytes_copied / max(self.bytes, 1)

    def commit(self) -> float:
        if self.mode != "staged":
            raise BroadcastError("commit() is for staged pulls; this one was in place")
        if self.committed:
            return 0.0
        t = time.perf_counter()
        self._native.commit()
        took = time.perf_counter() - t
        self.bytes_copied = self._native.bytes_copied()
        self.committed = True
        _mark(self._live, self.version)
        self._release()
        return took

    def close(self) -> None:
        """Stops relaying and, staged, drops the staged version without committing it (the
        live tensors stay as they are). A completed in-place pull is already closed."""
        self._release()

    def _release(self) -> None:
        for p in self._placed:
            p.close()
        self._placed = []
        if self._native is not None:
            self._native.close()
            self._native = None


def pull(
    engine: Engine,
    source: str,
    into: Mapping[str, Any],
    *,
    name: str | None = None,
    version: int | None = None,
    mode: str = "in_place",
    staging: Mapping[str, Any] | None = None,
    relay: bool = True,
    timeout: float | None = None,
    progress: Callable[[int, int], None] | None = None,
    rename: Mapping[str, str] | None = None,
    subset: bool = False,
    shards: Mapping[str, int] | None = None,
    verify_at_rest: bool = True,
    linger: float = 30.0,
    auth_key_file: str | None = None,
    expect_manifest: str | None = None,
) -> PullSummary:
    """Pulls version ``version`` (None: the newest) of the broadcast at ``source`` (a
    ``Publisher.addr``, or ``etcd://HOST:PORT/NAME`` where a publisher with etcd discovery is
    listed; the other receivers are found there too; from etcd, which anyone who can write it
    fills, give ``expect_manifest`` or ``auth_key_file``, else the pull is refused) into ``into`` (name to array, GPU array or registration of ``engine``,
    which must listen to relay). ``mode="in_place"`` writes the live tensors;
    ``mode="staged"`` writes ``staging`` (same names and sizes) and ``commit()`` on the summary
    copies it into ``into``. ``rename`` maps published names to the names in ``into``;
    ``subset`` allows leaving published tensors out. ``shards`` maps a name in ``into`` to a byte
    offset in the published tensor: that destination takes only its own length from there (a
    tensor-parallel rank's rows). ``verify_at_rest=False`` skips the second checksum pass over
    every chunk before the pull reports done (each chunk is still verified as it lands): one
    CRC-32C read of the payload less. With ``relay`` the pull keeps serving
    later receivers for up to ``linger`` seconds after it completes (the CLI's ``--linger``
    default too). ``progress(bytes, total)`` is called as chunks are verified; an exception it
    raises stops the pull and is raised here. ``timeout=None`` waits as long as the pull
    takes. Ctrl-C stops the pull with ``KeyboardInterrupt`` within a fraction of a second. ``auth_key_file`` (the publisher's keyring file; give
    ``engine`` the same) authenticates every control request and chunk, as ``ferry pull
    --auth-key-file`` does; ``expect_manifest`` (``Publisher.digest``, 64 hex digits) refuses
    any other manifest before anything is written, as ``--expect-manifest`` does. Blocks with
    the GIL released."""
    if mode not in ("in_place", "staged"):
        raise ValueError(f'mode must be "in_place" or "staged", not {mode!r}')
    _seconds("timeout", timeout)
    _seconds("linger", linger)
    if linger is None:
        raise InvalidArgument("linger must be a number of seconds from 0 to 1e9, not None")
    if version is not None:
        _whole("version", version, 0)
    if relay and engine.listen_addr is None:
        raise InvalidArgument(
            'the engine does not listen, so it cannot relay to other receivers: make it with '
            'ferry.Engine(listen="HOST:PORT"), or pass relay=False'
        )
    if progress is not None and not callable(progress):
        raise TypeError(f"progress must be callable, not {type(progress).__name__}")
    if (mode == "staged") != (staging is not None):
        raise ValueError('staging is given exactly when mode="staged"')
    tag = _unique(f"ferry.pull.{name or 'any'}")
    placed = [_Placed(engine, into, tag + ".live", writable=True)]
    dests_staging = None
    try:
        if staging is not None:
            placed.append(_Placed(engine, staging, tag + ".staging", writable=True))
            dests_staging = placed[1].dests()
        native = _join(
            engine,
            source,
            placed[0].dests(),
            name,
            version,
            dests_staging,
            dict(rename or {}),
            subset,
            relay,
            {k: int(v) for k, v in (shards or {}).items()},
            verify_at_rest,
            auth_key_file,
            expect_manifest,
            placed[0].kinds(),
        )
    except BaseException:
        for p in placed:
            p.close()
        raise
    live = list(into.values())
    try:
        s = native.run(timeout, progress, linger if relay else 0.0)
    except TornError:
        _mark(live, Torn(native.version))
        native.close()
        for p in placed:
            p.close()
        raise
    except BaseException as e:
        # Interrupted: the source may be the reason; it is not waited for long.
        native.close(0.5 if isinstance(e, KeyboardInterrupt) else None)
        for p in placed:
            p.close()
        raise
    summary = PullSummary(
        version=s["version"],
        bytes=s["bytes"],
        seconds=s["seconds"],
        from_source=s["from_source"],
        from_relays=s["from_relays"],
        refetched=s["refetched"],
        parents_given_up=s["parents_given_up"],
        holders_stalled=s["holders_stalled"],
        holders_left=s["holders_left"],
        mode=mode,
        bytes_copied=s["bytes_copied"],
        _native=native,
        _placed=placed,
        _live=live,
    )
    if mode == "in_place":
        _mark(live, summary.version)
        summary._release()
    return summary


async def pull_async(engine: Engine, source: str, into: Mapping[str, Any], **kwargs: Any) -> PullSummary:
    """``pull`` for asyncio: runs in a worker thread, so the event loop goes on meanwhile."""
    return await asyncio.to_thread(pull, engine, source, into, **kwargs)
