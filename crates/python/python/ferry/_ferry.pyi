"""Type stubs of the native module ``ferry._ferry`` (re-exported by ``ferry``); ``cargo xtask ci``
checks them against the built module with mypy's stubtest."""

import os
from asyncio import Future
from collections.abc import Generator, Sequence
from typing import Any, Literal, Protocol, TypeAlias, final

from typing_extensions import Buffer, Self

__all__ = [
    "AccessDenied",
    "AgentTelemetry",
    "AuthKeyError",
    "AuthenticationFailed",
    "Batch",
    "Cancelled",
    "Engine",
    "Failure",
    "FerryError",
    "FileRegistration",
    "GpuRegistration",
    "HandshakeRefused",
    "InvalidArgument",
    "InvalidRequest",
    "IoError",
    "Malformed",
    "NoRoute",
    "OutOfBounds",
    "Outcome",
    "Peer",
    "PeerLost",
    "ProtocolMismatch",
    "RawEngine",
    "EtcdKv",
    "Registration",
    "RegistrationError",
    "RemoteSegment",
    "Request",
    "ResourceExhausted",
    "StaleEpoch",
    "Timeout",
    "Unavailable",
    "UnknownAddress",
    "UnknownSegment",
    "UnknownSegmentName",
    "Unquiesced",
    "_Publisher",
    "_Puller",
    "_TestGate",
    "__version__",
    "_join",
    "_panic_for_tests",
    "_runtime_tasks_for_tests",
    "_publish",
    "doctor",
    "metrics_endpoints",
    "topology_json",
]

__version__: str

_AccessName: TypeAlias = Literal["local", "read", "write", "read+write"]

_Local: TypeAlias = "Registration | GpuRegistration"

class _CudaArray(Protocol):
    """Anything that exports device memory by the CUDA Array Interface."""

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]: ...

class FerryError(Exception):
    """Base class of every error Ferry raises. str(e) is the message the Rust engine gave."""

class Unavailable(FerryError):
    """A native library or kernel facility is not available (libibverbs, io_uring, ...)."""

class PeerLost(FerryError, ConnectionError):
    """The connection to the peer broke."""

class StaleEpoch(FerryError):
    """The peer at a known address restarted (new epoch); re-resolve it explicitly."""

class ResourceExhausted(FerryError):
    """A registration budget would be exceeded; published ranges are never evicted to fit."""

class ProtocolMismatch(FerryError):
    """The two ends share no protocol version."""

class HandshakeRefused(FerryError, ConnectionError):
    """The peer refused the handshake."""

class UnknownSegment(FerryError, LookupError):
    """The peer knows no segment with that token (never published, or retired)."""

class UnknownSegmentName(UnknownSegment):
    """The peer publishes no segment of that name."""

class OutOfBounds(FerryError, ValueError):
    """A range falls outside a local registration or a remote segment."""

class AccessDenied(FerryError):
    """The segment does not grant the access right the op needs."""

class Timeout(FerryError, TimeoutError):
    """A request, connection or handshake took longer than allowed."""

class Cancelled(FerryError):
    """The request was cancelled."""

class Unquiesced(FerryError):
    """A native destroy failed: the objects and their budget charges stay held."""

class RegistrationError(FerryError):
    """Registering a range failed for a reason other than a budget."""

class Malformed(FerryError):
    """A frame could not be decoded (or the peer could not parse a request)."""

class InvalidRequest(FerryError, ValueError):
    """The request was malformed before anything moved (empty batch, mixed peers, ...)."""

class NoRoute(FerryError):
    """No transport is offered by both ends."""

class IoError(FerryError, OSError):
    """An I/O operation (bind, connect, open a file, ...) failed."""

class InvalidArgument(FerryError, ValueError):
    """An argument is out of its range (a negative offset, a zero count, a bad duration); the message names it."""

class AuthenticationFailed(HandshakeRefused):
    """Authentication with the peer failed (a key it does not accept, or one side without keys)."""

class AuthKeyError(FerryError):
    """An authentication key file cannot be used (missing, unreadable, malformed); the message names the file."""

class UnknownAddress(FerryError, LookupError):
    """A raw address range lies inside no registration of that side (Mooncake/NIXL layers)."""

@final
class Engine:
    """Ferry's transfer engine: registers memory and files, connects to peers, moves bytes.

    ``listen`` ("127.0.0.1:0": any free port) makes it serve what it publishes. ``transports``
    ("tcp", "uring", "rdma") in order of preference; ``data_plane`` "auto", "uring" or "tcp".
    Times are in seconds; ``socket_buffer=0`` is kernel autotuning, ``io_threads=0`` one I/O
    thread per core, ``dead_peer_after=0`` the kernel's limits. ``auth_key_file`` names a
    keyring file (lines of ``name hexkey``): peers must prove one of its keys, and this engine
    proves the first when it connects. ``metrics`` ("127.0.0.1:9400") serves Prometheus
    metrics over HTTP there (``GET /metrics``; port 0: any free port, see ``metrics_addr``).
    """

    def __new__(
        cls,
        listen: str | None = None,
        *,
        transports: Sequence[str] | None = None,
        data_plane: Literal["auto", "uring", "tcp"] = "auto",
        streams: int | None = None,
        depth: int | None = None,
        chunk_size: int | None = None,
        socket_buffer: int | None = None,
        io_threads: int | None = None,
        request_timeout: float | None = None,
        connect_timeout: float | None = None,
        dead_peer_after: float | None = None,
        auth_key_file: str | os.PathLike[str] | None = None,
        metrics: str | None = None,
        same_host: bool = True,
    ) -> Self: ...
    @property
    def listen_addr(self) -> str | None:
        """The address it serves on, or None when it does not listen."""
    @property
    def metrics_addr(self) -> str | None:
        """The address its Prometheus metrics are served on, or None."""
    @property
    def peer_id(self) -> str:
        """Its peer id (hex)."""
    @property
    def epoch(self) -> str:
        """Its epoch (hex), chosen at start and never reused."""
    @property
    def server_identity(self) -> str:
        """The server identity it proves to clients that name it (64 hex digits):
        ``FERRY_IDENTITY_KEY_FILE``'s, else generated for this process."""
    @property
    def data_plane(self) -> Literal["uring", "tcp"] | None:
        """The portable data plane it chose."""
    def register(
        self, obj: Buffer, name: str | None = None, access: _AccessName = "local"
    ) -> Registration:
        """Registers ``obj``'s memory without copying it; the registration keeps it alive.

        Raises TypeError (no buffer protocol; read-only buffer with write access), ValueError
        (strided buffer, bad access), ResourceExhausted or RegistrationError.
        """
    def alloc_gpu(
        self,
        device: int,
        size: int,
        name: str | None = None,
        access: _AccessName = "local",
    ) -> GpuRegistration:
        """Allocates ``size`` bytes on GPU ``device`` and registers them (a GpuRegistration).

        The CUDA driver loads on the engine's first GPU call (``libcuda.so.1``, or the file
        ``FERRY_LIBCUDA`` names). Raises Unavailable without a driver (the loader's reason),
        InvalidRequest for a device the driver does not list, ValueError for a bad size/access.
        """
    def register_gpu(
        self,
        obj: _CudaArray,
        name: str | None = None,
        access: _AccessName = "local",
        device: int | None = None,
    ) -> GpuRegistration:
        """Registers the device memory ``obj`` exports by ``__cuda_array_interface__`` (PyTorch
        CUDA tensor, CuPy array, Numba device array) without copying; keeps ``obj`` alive.

        The driver says which GPU holds the memory and that the range lies inside one device
        allocation; ``device`` (else ``obj.device.index``, PyTorch, or ``obj.device.id``, CuPy) is
        checked against it. Synchronize the producer's stream before submitting: Ferry's copies
        run on its own streams. Raises TypeError (no interface; read-only with write access),
        ValueError (non-contiguous, masked, empty, unknown typestr, another GPU than claimed; and
        InvalidRequest, one, for a range past its allocation or memory that is not device
        memory), FerryError (the driver does not know the pointer),
        Unavailable (no driver).
        """
    def read_file_into_gpu(
        self,
        dst: GpuRegistration,
        path: str | os.PathLike[str],
        *,
        offset: int = 0,
        file_offset: int = 0,
        length: int | None = None,
    ) -> dict[str, Any]:
        """Loads a file range into ``dst`` (cuFile/GDS, else pinned-buffer copies); blocks with
        the GIL released; returns ``{"bytes": n, "path": "gds" | "compat (why)"}``."""
    def publish_file(
        self,
        path: str | os.PathLike[str],
        name: str | None = None,
        access: _AccessName = "read",
    ) -> FileRegistration:
        """Publishes the file at ``path`` as the segment ``name`` (default: the path)."""
    def connect(self, addr: str, server_identity: str | None = None) -> Peer:
        """Connects to the engine serving ``addr``; blocks with the GIL released. With
        ``server_identity`` the address must prove it (``expect_server``), else
        ``AuthenticationFailed`` naming the address."""
    def expect_server(self, addr: str, server_identity: str) -> None:
        """Pairs ``addr`` with ``server_identity``: every later handshake with it (this
        engine's, a ``RawEngine``'s on it) must prove it. Needs keys."""
    def reresolve(self, addr: str) -> Peer:
        """Forgets the epoch known for ``addr`` and connects afresh."""
    def read(
        self,
        local: _Local,
        remote: RemoteSegment,
        *,
        local_offset: int = 0,
        remote_offset: int = 0,
        length: int | None = None,
        timeout: float | None = None,
    ) -> Request:
        """Starts a READ of ``remote[remote_offset:+length]`` into ``local[local_offset:+length]``."""
    def write(
        self,
        local: _Local,
        remote: RemoteSegment,
        *,
        local_offset: int = 0,
        remote_offset: int = 0,
        length: int | None = None,
        timeout: float | None = None,
    ) -> Request:
        """Starts a WRITE of ``local[local_offset:+length]`` into ``remote[remote_offset:+length]``."""
    def submit(self, batch: Batch) -> Request:
        """Submits a batch as one request (checked before anything moves)."""
    def describe(self) -> dict[str, Any]:
        """Identity, listener, transports, registrations, segments and counters, as a dict."""
    def check(self) -> None:
        """Raises the oldest native cleanup failure (Unquiesced), if any."""
    def shutdown(self) -> None:
        """Stops serving."""
    def __enter__(self) -> Self: ...
    def __exit__(self, *args: object) -> None: ...

@final
class Registration:
    """Registered memory. close() (or leaving a with block) unpublishes it."""

    @property
    def name(self) -> str: ...
    @property
    def token(self) -> str: ...
    @property
    def access(self) -> _AccessName: ...
    @property
    def readonly(self) -> bool:
        """Whether the buffer is read-only (a source only)."""
    @property
    def closed(self) -> bool: ...
    def close(self) -> None:
        """Unpublishes it; the memory is released once no request uses it."""
    def __len__(self) -> int: ...
    def __enter__(self) -> Self: ...
    def __exit__(self, *args: object) -> None: ...

@final
class GpuRegistration:
    """Device memory registered with an engine (alloc_gpu, register_gpu): the local side of
    read/write/Batch ops like a Registration, published to peers when its access allows.
    close() unpublishes it; the memory stays valid while this object or a request using it
    lives."""

    @property
    def name(self) -> str: ...
    @property
    def token(self) -> str: ...
    @property
    def access(self) -> _AccessName: ...
    @property
    def device(self) -> int:
        """The device ordinal."""
    @property
    def pci_bus_id(self) -> str: ...
    @property
    def ptr(self) -> int:
        """The device address of its first byte."""
    @property
    def route(self) -> str:
        """The GPUDirect route: "dmabuf", "peermem" or "off" (staged)."""
    @property
    def why(self) -> str:
        """Why that route."""
    @property
    def readonly(self) -> bool: ...
    @property
    def closed(self) -> bool: ...
    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        """Version 3: shape (len,), typestr "|u1", strides None, stream None."""
    def copy_from(self, data: Buffer, offset: int = 0) -> None:
        """Copies ``data`` into the memory at ``offset`` (host to device, by the driver)."""
    def to_bytes(self, offset: int = 0, length: int | None = None) -> bytes:
        """The bytes from ``offset`` (to the end by default), copied out by the driver."""
    def close(self) -> None:
        """Unpublishes it."""
    def __len__(self) -> int: ...
    def __enter__(self) -> Self: ...
    def __exit__(self, *args: object) -> None: ...

@final
class FileRegistration:
    """A published file segment. close() unpublishes it."""

    @property
    def name(self) -> str: ...
    @property
    def token(self) -> str: ...
    def close(self) -> None: ...
    def __len__(self) -> int: ...
    def __enter__(self) -> Self: ...
    def __exit__(self, *args: object) -> None: ...

@final
class Peer:
    """A connected peer incarnation and the segments it published at connection time."""

    @property
    def addr(self) -> str: ...
    @property
    def peer_id(self) -> str: ...
    @property
    def epoch(self) -> str: ...
    @property
    def transport(self) -> Literal["tcp", "uring", "rdma"]: ...
    @property
    def segments(self) -> list[dict[str, Any]]:
        """Dicts with ``name``, ``len``, ``access`` and ``token``."""
    def segment(self, name: str) -> RemoteSegment:
        """The segment published under ``name``; raises UnknownSegmentName."""
    def is_alive(self) -> bool: ...
    def close(self) -> None: ...

@final
class RemoteSegment:
    """A segment published by a peer, as the target of READs and WRITEs."""

    @property
    def name(self) -> str: ...
    @property
    def access(self) -> _AccessName: ...
    @property
    def token(self) -> str: ...
    def __len__(self) -> int: ...

@final
class Batch:
    """An ordered batch of READs and WRITEs to one peer, submitted as one request."""

    def __new__(cls, timeout: float | None = None) -> Self: ...
    def read(
        self,
        local: _Local,
        remote: RemoteSegment,
        local_offset: int = 0,
        remote_offset: int = 0,
        length: int | None = None,
    ) -> Self: ...
    def write(
        self,
        local: _Local,
        remote: RemoteSegment,
        local_offset: int = 0,
        remote_offset: int = 0,
        length: int | None = None,
    ) -> Self: ...
    def __len__(self) -> int: ...

@final
class Request:
    """A submitted request: wait() (GIL released) or await it for its Outcome."""

    def wait(self, timeout: float | None = None, check: bool = True) -> Outcome:
        """Blocks until the request ends; TimeoutError if not by ``timeout`` seconds. With
        ``check`` (the default) a failed request raises its FerryError (``e.outcome``)."""
    def wait_drained(self, timeout: float | None = None) -> Outcome:
        """Blocks until the local buffers are free again."""
    def drained(self) -> Future[Outcome]:
        """An asyncio future of the drained outcome."""
    def done(self) -> bool: ...
    def _plant_panic_for_tests(self) -> bool:
        """Test hook, not part of the API: the request's next poll panics (the watch is lost)."""
    def _plant_gate_for_tests(self) -> _TestGate | None:
        """Test hook, not part of the API: the request's next poll waits at the gate first."""
    @property
    def after_error(self) -> str | None:
        """Why the notification sent once the request completed failed (None if it did not)."""
    def cancel(self) -> None:
        """Ends the request logically; buffers stay in use until drained."""
    def __await__(self) -> Generator[Any, None, Outcome]: ...


@final
class _TestGate:
    """Test hook, not part of the API: where a planted poll waits until ``open()``."""

    def entered(self) -> bool: ...
    def open(self) -> None: ...
    def timed_out(self) -> bool: ...

@final
class RawEngine:
    """An Engine whose memory is named by raw virtual address (the layer under ferry.mooncake
    and ferry.nixl). Registrations are listed under opaque names (``raw#<id>/<location>``);
    their addresses go in an index segment published to the same peers: every peer, or with
    ``publish_to`` only those proving one of its key names."""

    def __new__(cls, engine: Engine, publish_to: Sequence[str] | None = None) -> Self: ...
    def register(
        self, addr: int, length: int, location: str = "cpu:0", access: _AccessName = "read+write"
    ) -> None: ...
    def unregister(self, addr: int) -> None: ...
    def registrations(self) -> list[tuple[int, int, str, str]]: ...
    def allocate(self, length: int, access: _AccessName = "read+write") -> int: ...
    def cuda_unavailable(self) -> str | None: ...
    def remote_registrations(self, peer: str) -> list[tuple[int, int, str]]: ...
    def check(self, peer: str | None, addrs: Sequence[int], lengths: Sequence[int]) -> None:
        """Raises UnknownAddress unless every range lies in one registration (None: local)."""
    def connect(self, peer: str) -> None: ...
    def forget(self, peer: str) -> None: ...
    def transfer(
        self,
        peer: str,
        op: Literal["read", "write"],
        local: Sequence[int],
        remote: Sequence[int],
        lengths: Sequence[int],
        timeout: float | None = None,
    ) -> Outcome:
        """One request of every (local, remote, length); returns once it ended and drained."""
    def submit(
        self,
        peer: str,
        op: Literal["read", "write"],
        local: Sequence[int],
        remote: Sequence[int],
        lengths: Sequence[int],
        timeout: float | None = None,
        notify: tuple[str, bytes] | None = None,
    ) -> Request:
        """Starts the request; with ``notify``, the message goes to the peer once it completed."""
    def notify(self, peer: str, name: str, message: bytes) -> None:
        """Sends ``message`` to ``peer``'s inbox under ``name``; returns once it holds it."""
    def take_notifications(self) -> list[tuple[str, bytes, str, str | None, str]]:
        """``(name, message, peer_id, key_name, epoch)`` of each notification received, oldest
        first: ``name`` as the sender claimed it, ``key_name`` the key it proved (None without
        keys), ``peer_id`` and ``epoch`` the incarnation its handshake named."""
    def key_names(self) -> list[str]:
        """The names of the keys this engine accepts (its keyring's); empty without keys."""

@final
class EtcdKv:
    """Plain records in etcd, bound to a lease this object keeps alive."""

    def __new__(cls, endpoint: str, ttl: float = 10.0) -> Self: ...
    def put(self, key: str, value: bytes) -> None: ...
    def get(self, key: str) -> bytes | None: ...
    def delete(self, key: str) -> None: ...
    def close(self) -> None: ...

@final
class AgentTelemetry:
    """A compatibility layer's agent telemetry (NIXL's Prometheus series), served by every
    metrics endpoint of this process while it lives; the agent name is taken once at a time."""

    def __new__(
        cls, agent: str, hostname: str, bounds_us: Sequence[int] | None = None
    ) -> Self: ...
    def transfer(self, write: bool, nbytes: int, xfer_us: int, post_us: int) -> None: ...
    def registered(self, nbytes: int) -> None: ...
    def deregistered(self, nbytes: int) -> None: ...
    def error(self, status: str) -> bool: ...
    def describe(self) -> dict[str, int]: ...

def metrics_endpoints() -> list[str]:
    """The addresses the engines of this process serve their metrics on now."""

def topology_json() -> str:
    """Ferry's topology of this machine as JSON (``ferry topology --json``)."""

@final
class Outcome:
    """How far a request got; never reports a byte that was not acknowledged."""

    @property
    def completed_ops(self) -> int: ...
    @property
    def completed_bytes(self) -> int: ...
    @property
    def failure(self) -> Failure | None: ...
    @property
    def remote_effect(self) -> Literal["none", "certain", "uncertain"]: ...
    @property
    def drained(self) -> bool: ...
    @property
    def ok(self) -> bool: ...
    def raise_for_failure(self) -> None:
        """Raises the FerryError subclass of the failure's kind (with ``.outcome``)."""
    def __bool__(self) -> bool: ...

@final
class Failure:
    """The first failed op of a request."""

    @property
    def op_index(self) -> int: ...
    @property
    def kind(
        self,
    ) -> Literal[
        "timeout",
        "cancelled",
        "peer_lost",
        "local",
        "unknown_segment",
        "out_of_bounds",
        "access_denied",
        "stale_epoch",
        "malformed",
        "other",
    ]: ...
    @property
    def remote(self) -> bool: ...
    @property
    def native_status(self) -> int | None: ...
    @property
    def message(self) -> str: ...

def doctor() -> dict[str, Any]:
    """The capability matrix, as ``ferry doctor --json`` prints it."""

# The native side of ferry.broadcast (private: use ferry.broadcast).
@final
class _Publisher:
    @property
    def addr(self) -> str: ...
    def digest(self) -> str: ...
    def versions(self) -> list[int]: ...
    def publish(self, version: int, tensors: list[tuple[Any, ...]]) -> None: ...
    def close(self) -> None: ...

@final
class _Puller:
    @property
    def version(self) -> int: ...
    def run(
        self, timeout: float | None = None, progress: Any = None, linger: float = 0.0
    ) -> dict[str, Any]: ...
    def commit(self) -> int: ...
    def bytes_copied(self) -> int: ...
    def close(self, timeout: float | None = None) -> None: ...

def _publish(
    engine: Engine,
    name: str,
    version: int,
    tensors: list[tuple[Any, ...]],
    chunk_size: int | None,
    listen: str,
    keep_versions: int,
    auth_key_file: str | os.PathLike[str] | None = None,
    discovery: str | None = None,
) -> _Publisher: ...
def _join(
    engine: Engine,
    source: str,
    into: list[tuple[Any, ...]],
    name: str | None,
    version: int | None,
    staging: list[tuple[Any, ...]] | None,
    rename: dict[str, str],
    subset: bool,
    relay: bool,
    shards: dict[str, int],
    verify_at_rest: bool,
    auth_key_file: str | os.PathLike[str] | None = None,
    expect_manifest: str | None = None,
    kinds: dict[str, tuple[str | None, list[int] | None]] | None = None,
) -> _Puller: ...
def _panic_for_tests(under: str) -> None: ...
def _runtime_tasks_for_tests() -> int:
    """Test hook, not part of the API: how many tasks of the shared runtime are alive now."""
