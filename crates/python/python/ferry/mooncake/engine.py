"""``ferry.mooncake.TransferEngine``: Mooncake's ``mooncake.engine.TransferEngine`` (0.3.13) on
Ferry. See docs/mooncake.md for every method, what Ferry does and where it differs.

Return conventions are Mooncake's: synchronous calls return 0 or a negative code, asynchronous
submits return a batch id (0 on failure). Every failure also logs one line on the logger
``ferry.mooncake`` naming the peer, address, length and reason, and ``last_error()`` returns
the typed Ferry exception behind it.
"""

from __future__ import annotations

import ctypes
import enum
import itertools
import json
import logging
import operator
import os
import re
import threading
import urllib.parse
from dataclasses import dataclass
from typing import Any, Sequence

from ferry import _failures, _ferry
from ferry._hosts import bind_host, join, publish_to, warn_if_open
from ferry._senders import Bindings, Sender
from ferry.mooncake import metadata

log = logging.getLogger("ferry.mooncake")

# Mooncake's error codes (mooncake-transfer-engine/include/error.h).
ERR_INVALID_ARGUMENT = -1
ERR_ADDRESS_NOT_REGISTERED = -3
ERR_ADDRESS_OVERLAPPED = -7
ERR_SOCKET = -102
ERR_REJECT_HANDSHAKE = -104
ERR_METADATA = -200
ERR_MEMORY = -302
ERR_NOT_IMPLEMENTED = -303

#: ``MC_TRANSFER_TIMEOUT``'s default and floor, in seconds (Mooncake's binding).
DEFAULT_TIMEOUT = 30.0
MIN_TIMEOUT = 5.0


class TransferOpcode(enum.IntEnum):
    """Mooncake's ``TransferOpcode``: ``Read`` (0) and ``Write`` (1)."""

    Read = 0
    Write = 1


Read = TransferOpcode.Read
Write = TransferOpcode.Write


class TransferNotify:
    """Mooncake's ``TransferNotify(name, msg)``."""

    def __init__(self, name: str = "", msg: str = "") -> None:
        self.name = name
        self.msg = msg

    def __repr__(self) -> str:
        return f"TransferNotify(name={self.name!r}, msg={self.msg!r})"


class BatchState(str, enum.Enum):
    """What ``TransferEngine.poll_batch`` says of a batch."""

    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"


@dataclass(frozen=True)
class CancelResult:
    """What ``TransferEngine.cancel_batch`` says once no byte of the batch can move any more.

    ``completed`` ops (from the first) are done; ``may_have_landed`` lists the indices of the
    WRITEs whose bytes may have reached the peer although they did not complete (empty for a
    READ batch, and when the outcome proves none landed); ``outcome`` is Ferry's ``Outcome``.
    """

    completed: int
    may_have_landed: tuple[int, ...]
    outcome: Any


def _timeout_env() -> float:
    raw = os.environ.get("MC_TRANSFER_TIMEOUT")
    if not raw:
        return DEFAULT_TIMEOUT
    try:
        return max(MIN_TIMEOUT, float(raw))
    except ValueError:
        log.warning("MC_TRANSFER_TIMEOUT=%r is not a number of seconds; using %s", raw, DEFAULT_TIMEOUT)
        return DEFAULT_TIMEOUT


def _flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() not in ("", "0", "false", "no", "off")


def _split_host(hostname: str) -> tuple[str, int | None]:
    """``host``, ``host:port`` or ``[v6]:port`` as (host, port)."""
    h = hostname.strip()
    if h.startswith("["):
        host, _, rest = h[1:].partition("]")
        return host, int(rest[1:]) if rest.startswith(":") and rest[1:].isdigit() else None
    if h.count(":") == 1:
        host, _, port = h.partition(":")
        return host, int(port) if port.isdigit() else None
    return h, None


def _metadata_hint(server: str, e: metadata.MetadataError) -> metadata.MetadataError:
    """``e`` as one sentence with a hint where the cause is a usual mistake: an HTTP URL whose
    path is not ``/metadata``, or an etcd nobody answers at (in place of the gRPC client's
    dump)."""
    try:
        mode = metadata.parse(server)
    except metadata.MetadataError:
        return e
    text = str(e)
    if mode.kind == "http":
        path = urllib.parse.urlparse(mode.where).path
        if path.rstrip("/") != "/metadata":
            return metadata.MetadataError(
                f"{text.splitlines()[0][:300]}; hint: Mooncake's HTTP metadata server answers at "
                f"http://HOST:PORT/metadata, and this URL's path is {path or '/'!r}")
        return e
    if mode.kind == "etcd" and ("grpc" in text or "tonic" in text or "connect" in text.lower()):
        said = re.search(r'message: "([^"]+)" \}', text) or re.search(r'message: "([^"]+)"', text)
        reason = said.group(1) if said else text.splitlines()[0][:200]
        return metadata.MetadataError(
            f"cannot reach etcd at {mode.where}: {reason}; hint: start etcd there, or pass "
            "P2PHANDSHAKE or an http://HOST:PORT/metadata server")
    return e


class _Batch:
    __slots__ = ("request", "peer", "op", "count", "bytes")

    def __init__(self, request: Any, peer: str, op: str, count: int, nbytes: int) -> None:
        self.request = request
        self.peer = peer
        self.op = op
        self.count = count
        self.bytes = nbytes


class TransferEngine:
    """Mooncake's ``TransferEngine`` on Ferry: ``initialize`` it, register memory by address,
    move bytes to and from peers named by ``host:port`` (P2P) or by their ``local_hostname``
    (http/etcd metadata)."""

    TransferOpcode = TransferOpcode

    def __init__(self) -> None:
        self._engine: Any = None
        self._raw: Any = None
        self._store: metadata.Store | None = None
        self._name = ""
        self._key: str | None = None
        self._mode: metadata.Mode | None = None
        self._addrs: dict[str, str] = {}
        self._senders = Bindings()
        self._order: list[int] = []
        self._batches: dict[int, _Batch] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._timeout = _timeout_env()
        self._last_error: BaseException | None = None
        self._closed = False

    # ----- set-up -------------------------------------------------------------------------

    def initialize(
        self, local_hostname: str, metadata_server: str, protocol: str, device_name: str
    ) -> int:
        """Starts the engine named ``local_hostname``: 0, or -1 (logged)."""
        return self.initialize_ext(local_hostname, metadata_server, protocol, device_name, "")

    def initialize_ext(
        self,
        local_hostname: str,
        metadata_server: str,
        protocol: str,
        device_name: str,
        metadata_type: str,
    ) -> int:
        """``initialize`` with the metadata type given apart (``"etcd"``, ``"http"``): 0 or -1."""
        if self._engine is not None:
            return self._fail(
                _ferry.InvalidArgument("this TransferEngine is already initialized"),
                "initialize", code=-1,
            )
        try:
            if protocol == "xgmi":
                raise _ferry.InvalidArgument('protocol "xgmi" is not supported: use "hip"')
            mode = metadata.parse(metadata_server, metadata_type or None)
            host, port = _split_host(local_hostname)
            if not host:
                raise _ferry.InvalidArgument(f"local_hostname {local_hostname!r} names no host")
            bind = os.environ.get("MC_TCP_BIND_ADDRESS") or bind_host(host)
            listen_port = port if (port is not None and _flag("MC_LEGACY_RPC_PORT_BINDING")) else 0
            force_tcp = _flag("MC_FORCE_TCP")
            transports = ["tcp"] if force_tcp else None
            # MC_FORCE_TCP: TCP sockets (not io_uring, not RDMA), even towards an engine on this
            # host (Mooncake's TCP transport goes through the network stack whatever the host).
            engine = _ferry.Engine(listen=join(bind, listen_port), transports=transports,
                                   data_plane="tcp" if force_tcp else "auto",
                                   same_host=not force_tcp)
            self._warn_protocol(protocol, device_name, engine, force_tcp)
            raw = _ferry.RawEngine(engine, publish_to())
            senders = Bindings(raw.key_names())
            listen = engine.listen_addr
            lport = int(listen.rsplit(":", 1)[1])
            store = metadata.open_store(mode)
            if mode.kind == "p2p":
                name = join(host, lport)
            else:
                name = local_hostname
                key = metadata.key_of(name)
                assert store is not None
                store.put(key, metadata.record(join(bind, lport), engine.peer_id, engine.epoch, name,
                                               engine.server_identity))
                self._key = key
        except metadata.MetadataError as e:
            return self._fail(_metadata_hint(metadata_server, e), "initialize",
                              peer=metadata_server, code=-1)
        except (_ferry.FerryError, OSError, ValueError) as e:
            return self._fail(e, "initialize", peer=metadata_server, code=-1)
        self._engine, self._raw, self._store, self._mode, self._name = engine, raw, store, mode, name
        senders.bind(name, engine.peer_id, engine.epoch)
        self._senders = senders
        self._rpc_port = lport
        self._addrs[name] = join(bind, lport)
        log.info("initialized %s (metadata %s, listening on %s, data plane %s)",
                 name, mode.kind, listen, engine.data_plane)
        warn_if_open(log, f"Mooncake engine {name!r}", listen, senders.keyed)
        return 0

    @staticmethod
    def _warn_protocol(protocol: str, device_name: str, engine: Any, force_tcp: bool) -> None:
        """A protocol or device this machine cannot give is said at WARNING, once, at
        ``initialize`` (Ferry runs on the plane it has: no failure, no silent fallback)."""
        plane = str(engine.data_plane)
        proto = (protocol or "").strip().lower()
        if proto == "rdma" and "rdma" not in plane.lower():
            log.warning(
                'protocol "rdma" asked, but %s: Ferry moves bytes over %s',
                "MC_FORCE_TCP is set" if force_tcp else "this machine has no usable RDMA device",
                plane,
            )
        if not device_name:
            return
        wanted = [d.strip() for d in device_name.split(",") if d.strip()]
        try:
            usable = {n["name"] for n in json.loads(_ferry.topology_json()).get("nics", [])
                      if n.get("usable")}
        except (_ferry.FerryError, ValueError):
            usable = set()
        missing = [d for d in wanted if d not in usable]
        if missing:
            log.warning(
                "device_name %r: no usable RDMA device named %s on this machine (usable: %s); "
                "Ferry chooses RDMA NICs by topology and moves bytes over %s",
                device_name, ", ".join(missing), ", ".join(sorted(usable)) or "none", plane,
            )
        else:
            log.info("device_name %r: Ferry chooses RDMA NICs by topology (FERRY's RDMA filters "
                     "apply); the name is recorded only", device_name)

    def get_rpc_port(self) -> int:
        """The port Ferry listens on (peers in P2P mode name this engine ``host:port``)."""
        return self._rpc_port if self._engine is not None else -1

    def close(self) -> None:
        """Extension: removes this engine's metadata record and stops serving. Also done when
        the process exits."""
        if self._engine is None:
            return
        try:
            if self._store is not None and self._key is not None:
                self._store.delete(self._key)
                self._store.close()
        except metadata.MetadataError as e:
            log.warning("removing the metadata record of %s: %s", self._name, e)
        self._engine.shutdown()
        self._engine = None
        self._closed = True

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    # ----- errors -------------------------------------------------------------------------

    def last_error(self) -> BaseException | None:
        """Extension: the typed Ferry exception behind the last failure (None if none yet)."""
        return self._last_error

    def _fail(
        self,
        e: BaseException,
        what: str,
        peer: str = "",
        addrs: Sequence[int] = (),
        lengths: Sequence[int] = (),
        code: int = -1,
    ) -> int:
        self._last_error = e
        where = ""
        if addrs:
            first = f"{addrs[0]:#x}"
            where = f" address {first}" + (f" (+{len(addrs) - 1} more)" if len(addrs) > 1 else "")
        if lengths:
            where += f" length {sum(lengths)}" + (f" in {len(lengths)} ops" if len(lengths) > 1 else "")
        log.error("%s %sfailed:%s %s", what, f"to {peer} " if peer else "", where,
                  _failures.sentence(e))
        return code

    def _ready(self) -> None:
        if self._closed:
            raise _ferry.InvalidArgument("the TransferEngine is closed (close() was called): "
                                         "make a new one and initialize it")
        if self._engine is None:
            raise _ferry.InvalidArgument("the TransferEngine is not initialized (call initialize)")

    def _peer(self, name: str) -> str:
        """The address Ferry reaches engine ``name`` at."""
        addr = self._addrs.get(name)
        if addr is not None:
            return addr
        self._ready()
        assert self._mode is not None
        if self._mode.kind == "p2p":
            host, port = _split_host(name)
            if not host or port is None:
                raise metadata.MetadataError(
                    f"{name!r} is not a peer name of P2P mode (host:port, the port its get_rpc_port() gives)"
                )
            addr = join(host, port)
        else:
            assert self._store is not None
            value = self._store.get(metadata.key_of(name))
            if value is None:
                raise metadata.MetadataError(f"no engine named {name!r} in the metadata store")
            rec = metadata.record_in(value, name)
            addr = rec.addr
            if rec.server_identity is not None and self._senders.keyed:
                # Keyed, the address must prove the identity the record names: another holder
                # of our key there (a redirected record) is refused (AuthenticationFailed).
                self._engine.expect_server(addr, rec.server_identity)
            # The record's incarnation speaks for the name in notifications from now on.
            with self._lock:
                self._senders.bind(name, rec.peer_id, rec.epoch)
        self._addrs[name] = addr
        return addr

    def _drop_peer(self, name: str) -> None:
        """After a failure towards ``name``: look its address up again next time."""
        if name != self._name:
            self._addrs.pop(name, None)

    def _code(self, e: BaseException) -> int:
        if isinstance(e, metadata.MetadataError):
            return ERR_METADATA
        if isinstance(e, _ferry.UnknownAddress):
            return ERR_ADDRESS_NOT_REGISTERED
        if isinstance(e, (_ferry.InvalidArgument, _ferry.InvalidRequest)):
            return ERR_INVALID_ARGUMENT
        if isinstance(e, (_ferry.HandshakeRefused, _ferry.AuthenticationFailed)):
            return ERR_REJECT_HANDSHAKE
        if isinstance(e, (_ferry.PeerLost, _ferry.IoError, _ferry.Timeout, OSError)):
            return ERR_SOCKET
        return -1

    # ----- memory -------------------------------------------------------------------------

    def register_memory(self, buffer_addr: int, capacity: int, location: str = "*") -> int:
        """Registers ``capacity`` bytes at ``buffer_addr`` (raw pointer: the caller's contract)."""
        try:
            self._ready()
            self._raw.register(buffer_addr, capacity, location)
        except _ferry.FerryError as e:
            return self._fail(e, "register_memory", addrs=[buffer_addr], lengths=[capacity],
                              code=self._register_code(e))
        with self._lock:
            if buffer_addr not in self._order:
                self._order.append(buffer_addr)
        return 0

    def _register_code(self, e: BaseException) -> int:
        if isinstance(e, _ferry.InvalidArgument) and "overlaps" in str(e):
            return ERR_ADDRESS_OVERLAPPED
        if isinstance(e, _ferry.Unavailable):
            return ERR_NOT_IMPLEMENTED
        if isinstance(e, _ferry.ResourceExhausted):
            return ERR_MEMORY
        return self._code(e)

    def unregister_memory(self, buffer_addr: int) -> int:
        """Unregisters the registration starting at ``buffer_addr``."""
        try:
            self._ready()
            self._raw.unregister(buffer_addr)
        except _ferry.FerryError as e:
            return self._fail(e, "unregister_memory", addrs=[buffer_addr], code=self._code(e))
        with self._lock:
            if buffer_addr in self._order and all(r[0] != buffer_addr for r in self._raw.registrations()):
                self._order.remove(buffer_addr)
        return 0

    def batch_register_memory(
        self, buffer_addresses: list[int], capacities: list[int], location: str = "*"
    ) -> int:
        """Registers each ``(address, capacity)``; on a failure, unregisters what this call
        registered and returns its code."""
        if len(buffer_addresses) != len(capacities):
            return self._fail(
                _ferry.InvalidArgument(
                    f"{len(buffer_addresses)} addresses but {len(capacities)} capacities"),
                "batch_register_memory", code=ERR_INVALID_ARGUMENT,
            )
        done: list[int] = []
        for addr, cap in zip(buffer_addresses, capacities):
            rc = self.register_memory(addr, cap, location)
            if rc != 0:
                for a in done:
                    self.unregister_memory(a)
                return rc
            done.append(addr)
        return 0

    def batch_unregister_memory(self, buffer_addresses: list[int]) -> int:
        """Unregisters each address; returns the first failure's code (the rest are still
        unregistered)."""
        rc = 0
        for addr in buffer_addresses:
            r = self.unregister_memory(addr)
            rc = rc or r
        return rc

    def allocate_managed_buffer(self, length: int) -> int:
        """Allocates and registers ``length`` bytes of host memory owned by Ferry; its address,
        or 0 on failure."""
        try:
            self._ready()
            addr = self._raw.allocate(length)
        except _ferry.FerryError as e:
            self._fail(e, "allocate_managed_buffer", lengths=[length])
            return 0
        with self._lock:
            self._order.append(addr)
        return addr

    def free_managed_buffer(self, buffer_addr: int, length: int) -> int:
        """Frees a buffer of ``allocate_managed_buffer`` (its memory goes once no request uses it)."""
        return self.unregister_memory(buffer_addr)

    def write_bytes_to_buffer(self, dest_address: int, src: bytes | str, length: int) -> int:
        """Copies ``length`` bytes of ``src`` to ``dest_address`` (a raw pointer)."""
        data = src.encode() if isinstance(src, str) else bytes(src)
        if length < 0 or length > len(data):
            return self._fail(
                _ferry.InvalidArgument(f"length {length} but the source holds {len(data)} bytes"),
                "write_bytes_to_buffer", addrs=[dest_address], lengths=[length],
                code=ERR_INVALID_ARGUMENT,
            )
        ctypes.memmove(dest_address, data, length)
        return 0

    def read_bytes_from_buffer(self, source_address: int, length: int) -> bytes:
        """The ``length`` bytes at ``source_address`` (a raw pointer)."""
        return ctypes.string_at(source_address, length)

    def get_first_buffer_address(self, segment_name: str) -> int:
        """The first registration of engine ``segment_name`` (this one or a peer), or 0."""
        try:
            self._ready()
            if segment_name == self._name:
                with self._lock:
                    return self._order[0] if self._order else 0
            regs = self._raw.remote_registrations(self._peer(segment_name))
        except (metadata.MetadataError, _ferry.FerryError) as e:
            self._drop_peer(segment_name)
            self._fail(e, "get_first_buffer_address", peer=segment_name)
            return 0
        return regs[0][0] if regs else 0

    # ----- transfers ----------------------------------------------------------------------

    def _deadline(self, lengths: Sequence[int]) -> float:
        # Mooncake's: MC_TRANSFER_TIMEOUT plus one nanosecond per byte.
        return self._timeout + sum(lengths) * 1e-9

    @staticmethod
    def _check_args(target: Any, buffers: Any, peers: Any,
                    lengths: Any) -> tuple[list[int], list[int], list[int]]:
        """Mooncake's argument types, checked before anything else: a ``str`` target and lists
        of ints (anything with ``__index__``, NumPy's included), returned as lists of ints;
        ``InvalidArgument`` (-1) naming the argument otherwise, never an internal exception."""
        if not isinstance(target, str):
            raise _ferry.InvalidArgument(
                f"target_hostname must be a str (the peer's name), not {type(target).__name__}"
                + (" (decode it first)" if isinstance(target, (bytes, bytearray)) else ""))
        out = []
        for name, values in (("buffers", buffers), ("peer_buffer_addresses", peers),
                             ("lengths", lengths)):
            if isinstance(values, (str, bytes, bytearray)) or not hasattr(values, "__len__"):
                raise _ferry.InvalidArgument(
                    f"{name} must be a list of ints, not {type(values).__name__}")
            ints = []
            for i, v in enumerate(values):
                try:
                    n = operator.index(v)
                except TypeError:
                    raise _ferry.InvalidArgument(
                        f"{name}[{i}] must be an int, not {type(v).__name__}") from None
                if n < 0:
                    raise _ferry.InvalidArgument(f"{name}[{i}] is negative ({n})")
                ints.append(n)
            out.append(ints)
        for i, n in enumerate(out[2]):
            if n == 0:
                raise _ferry.InvalidArgument(
                    f"lengths[{i}] is 0: a transfer moves at least one byte")
        return out[0], out[1], out[2]

    def _sync(self, what: str, op: str, target: str, buffers: list[int],
              peers: list[int], lengths: list[int]) -> int:
        try:
            buffers, peers, lengths = self._check_args(target, buffers, peers, lengths)
        except _ferry.InvalidArgument as e:
            return self._fail(e, what, peer=target if isinstance(target, str) else repr(target),
                              code=ERR_INVALID_ARGUMENT)
        try:
            self._ready()
            addr = self._addrs.get(target) or self._peer(target)
            self._raw.transfer(addr, op, buffers, peers, lengths, self._deadline(lengths))
            return 0
        except (metadata.MetadataError, _ferry.FerryError, OverflowError, TypeError) as e:
            if isinstance(e, (_ferry.PeerLost, _ferry.StaleEpoch, _ferry.IoError, _ferry.Timeout)):
                self._drop_peer(target)
            return self._fail(e, what, peer=target, addrs=peers, lengths=lengths, code=-1)

    def transfer_sync_write(self, target_hostname: str, buffer: int, peer_buffer_address: int,
                            length: int, transport_hint: str = "") -> int:
        """WRITEs ``length`` bytes from local ``buffer`` to the peer's ``peer_buffer_address``."""
        return self._sync("transfer_sync_write", "write", target_hostname, [buffer],
                          [peer_buffer_address], [length])

    def transfer_sync_read(self, target_hostname: str, buffer: int, peer_buffer_address: int,
                           length: int, transport_hint: str = "") -> int:
        """READs ``length`` bytes from the peer's ``peer_buffer_address`` into local ``buffer``."""
        return self._sync("transfer_sync_read", "read", target_hostname, [buffer],
                          [peer_buffer_address], [length])

    def batch_transfer_sync_write(self, target_hostname: str, buffers: list[int],
                                  peer_buffer_addresses: list[int], lengths: list[int],
                                  transport_hint: str = "") -> int:
        """WRITEs every ``(buffers[i], peer_buffer_addresses[i], lengths[i])`` as one request."""
        return self._sync("batch_transfer_sync_write", "write", target_hostname, buffers,
                          peer_buffer_addresses, lengths)

    def batch_transfer_sync_read(self, target_hostname: str, buffers: list[int],
                                 peer_buffer_addresses: list[int], lengths: list[int],
                                 transport_hint: str = "") -> int:
        """READs every ``(buffers[i], peer_buffer_addresses[i], lengths[i])`` as one request."""
        return self._sync("batch_transfer_sync_read", "read", target_hostname, buffers,
                          peer_buffer_addresses, lengths)

    @staticmethod
    def _opname(opcode: Any) -> str:
        return "read" if int(opcode) == int(TransferOpcode.Read) else "write"

    def _notify(self, what: str, target: str, notify: Any) -> int:
        """Sends ``notify`` (a ``TransferNotify``) to ``target`` after its transfer completed."""
        try:
            addr = self._addrs.get(target) or self._peer(target)
            msg = notify.msg.encode() if isinstance(notify.msg, str) else bytes(notify.msg)
            self._raw.notify(addr, str(notify.name), msg)
            return 0
        except (metadata.MetadataError, _ferry.FerryError) as e:
            return self._fail(e, f"{what} (its notification, after the transfer completed)",
                              peer=target, code=-1)

    def transfer_sync(self, target_hostname: str, buffer: int, peer_buffer_address: int,
                      length: int, opcode: Any, notify: Any = None, transport_hint: str = "") -> int:
        """One READ or WRITE (``opcode``); a ``notify`` goes to the peer once it completed."""
        rc = self._sync("transfer_sync", self._opname(opcode), target_hostname, [buffer],
                        [peer_buffer_address], [length])
        if rc != 0 or notify is None:
            return rc
        return self._notify("transfer_sync", target_hostname, notify)

    def batch_transfer_sync(self, target_hostname: str, buffers: list[int],
                            peer_buffer_addresses: list[int], lengths: list[int], opcode: Any,
                            notify: Any = None, transport_hint: str = "") -> int:
        """A batch of READs or WRITEs (``opcode``); a ``notify`` goes to the peer once it
        completed."""
        rc = self._sync("batch_transfer_sync", self._opname(opcode), target_hostname, buffers,
                        peer_buffer_addresses, lengths)
        if rc != 0 or notify is None:
            return rc
        return self._notify("batch_transfer_sync", target_hostname, notify)

    def _submit(self, what: str, op: str, target: str, buffers: list[int], peers: list[int],
                lengths: list[int]) -> int:
        try:
            buffers, peers, lengths = self._check_args(target, buffers, peers, lengths)
        except _ferry.InvalidArgument as e:
            self._fail(e, what, peer=target if isinstance(target, str) else repr(target))
            return 0
        try:
            self._ready()
            addr = self._addrs.get(target) or self._peer(target)
            req = self._raw.submit(addr, op, buffers, peers, lengths, self._deadline(lengths))
        except (metadata.MetadataError, _ferry.FerryError, OverflowError, TypeError) as e:
            if isinstance(e, (_ferry.PeerLost, _ferry.StaleEpoch, _ferry.IoError, _ferry.Timeout)):
                self._drop_peer(target)
            self._fail(e, what, peer=target, addrs=peers, lengths=lengths)
            return 0
        bid = next(self._ids)
        with self._lock:
            self._batches[bid] = _Batch(req, target, op, len(lengths), sum(lengths))
        return bid

    def batch_transfer_async_write(self, target_hostname: str, buffers: list[int],
                                   peer_buffer_addresses: list[int], lengths: list[int],
                                   transport_hint: str = "") -> int:
        """Starts a batch of WRITEs; its batch id, or 0."""
        return self._submit("batch_transfer_async_write", "write", target_hostname, buffers,
                            peer_buffer_addresses, lengths)

    def batch_transfer_async_read(self, target_hostname: str, buffers: list[int],
                                  peer_buffer_addresses: list[int], lengths: list[int],
                                  transport_hint: str = "") -> int:
        """Starts a batch of READs; its batch id, or 0."""
        return self._submit("batch_transfer_async_read", "read", target_hostname, buffers,
                            peer_buffer_addresses, lengths)

    def batch_transfer_async(self, target_hostname: str, buffers: list[int],
                             peer_buffer_addresses: list[int], lengths: list[int], opcode: Any,
                             transport_hint: str = "") -> int:
        """Starts a batch of READs or WRITEs (``opcode``); its batch id, or 0."""
        return self._submit("batch_transfer_async", self._opname(opcode), target_hostname,
                            buffers, peer_buffer_addresses, lengths)

    def transfer_submit_write(self, target_hostname: str, buffer: int, peer_buffer_address: int,
                              length: int, transport_hint: str = "") -> int:
        """Starts one WRITE; its batch id, or 0 (poll it with ``transfer_check_status``)."""
        return self._submit("transfer_submit_write", "write", target_hostname, [buffer],
                            [peer_buffer_address], [length])

    def _take(self, batch_id: int) -> _Batch | None:
        with self._lock:
            return self._batches.pop(batch_id, None)

    def _settle(self, b: _Batch, what: str, bid: int) -> int:
        """Waits until nothing of ``b`` moves any more; 0 if it completed, -1 (logged) if not."""
        outcome = b.request.wait_drained()
        if outcome.ok:
            return 0
        try:
            outcome.raise_for_failure()
        except _ferry.FerryError as e:
            if isinstance(e, (_ferry.PeerLost, _ferry.StaleEpoch, _ferry.Timeout)):
                self._drop_peer(b.peer)
            return self._fail(e, f"{what} (batch {bid}, {b.op} of {b.count} ops)", peer=b.peer,
                              lengths=[b.bytes])
        return -1

    def get_batch_transfer_status(self, batch_ids: list[int]) -> int:
        """Waits until every batch ended (and nothing of it moves any more): 0 if all
        completed, -1 otherwise. The ids are spent either way."""
        rc = 0
        for bid in batch_ids:
            b = self._take(bid)
            if b is None:
                rc = self._fail(_ferry.InvalidArgument(f"unknown batch id {bid}"),
                                "get_batch_transfer_status")
                continue
            if self._settle(b, "get_batch_transfer_status", bid) != 0:
                rc = -1
        return rc

    def transfer_check_status(self, batch_id: int) -> int:
        """Without waiting: 1 completed, 0 still running, -1 failed (-2 when it ran past its
        timeout). A batch that ended is spent."""
        with self._lock:
            b = self._batches.get(batch_id)
        if b is None:
            return self._fail(_ferry.InvalidArgument(f"unknown batch id {batch_id}"),
                              "transfer_check_status")
        if not b.request.done():
            return 0
        self._take(batch_id)
        outcome = b.request.wait(check=False)
        if outcome.ok:
            b.request.wait_drained()
            return 1
        rc = self._settle(b, "transfer_check_status", batch_id)
        if outcome.failure is not None and outcome.failure.kind == "timeout":
            return -2
        return rc

    def poll_batch(self, batch_id: int) -> BatchState:
        """Extension: the batch's state now, without waiting and without spending it."""
        with self._lock:
            b = self._batches.get(batch_id)
        if b is None:
            raise KeyError(f"unknown batch id {batch_id}")
        if not b.request.done():
            return BatchState.RUNNING
        return BatchState.DONE if b.request.wait(check=False).ok else BatchState.FAILED

    def cancel_batch(self, batch_id: int) -> CancelResult:
        """Extension: ends the batch and returns once no byte of it can still move, saying
        which WRITEs may have landed. The batch id is spent."""
        b = self._take(batch_id)
        if b is None:
            raise KeyError(f"unknown batch id {batch_id}")
        b.request.cancel()
        outcome = b.request.wait_drained()
        done = outcome.completed_ops
        maybe: tuple[int, ...] = ()
        if b.op == "write" and not outcome.ok and outcome.remote_effect != "none":
            maybe = tuple(range(done, b.count))
        if not outcome.ok:
            log.info("cancel_batch %d to %s: %d of %d ops completed; %s", batch_id, b.peer, done,
                     b.count, f"WRITEs {maybe[0]}..{maybe[-1]} may have landed" if maybe
                     else "no other op's bytes landed")
        return CancelResult(done, maybe, outcome)

    # ----- peers and the rest -------------------------------------------------------------

    def send_probe(self, peer_server_name: str) -> int:
        """0 when engine ``peer_server_name`` answers Ferry's handshake, non-zero otherwise."""
        try:
            self._ready()
            self._raw.remote_registrations(self._peer(peer_server_name))
            return 0
        except (metadata.MetadataError, _ferry.FerryError) as e:
            self._drop_peer(peer_server_name)
            return self._fail(e, "send_probe", peer=peer_server_name, code=self._code(e))

    def get_notifies(self) -> list[TransferNotify]:
        """The notifications peers sent with their transfers since the last call, oldest first
        (each arrived after its transfer's bytes). Only those from the engine their name
        speaks for (``ferry._senders``): the incarnation its metadata record names (or that
        first used the name), or a key named after it. The rest are dropped with a WARNING on
        ``ferry.mooncake``."""
        if self._raw is None:
            return []
        out = []
        for name, message, peer_id, key, epoch in self._raw.take_notifications():
            sender = Sender(peer_id, epoch, key)
            with self._lock:
                why = self._senders.check(name, sender)
            if why is not None:
                log.warning("dropped a notification naming %r from %s: %s", name, sender, why)
                continue
            out.append(TransferNotify(name, message.decode("utf-8", errors="replace")))
        return out

    def warmup_efa_segment(self, segment_name: str) -> int:
        """EFA warm-up: nothing to do on Ferry; 0."""
        return 0

    def get_local_topology(self, device_name: str | None = None) -> str:
        """Ferry's topology in Mooncake's JSON shape: ``{"cpu:N": [[NICs on node N], [the
        rest]], "cuda:N": [[NICs assigned to GPU N], [the rest]]}``."""
        try:
            topo = json.loads(_ferry.topology_json())
        except _ferry.FerryError as e:
            self._fail(e, "get_local_topology")
            return "{}"
        wanted = {d.strip() for d in (device_name or "").split(",") if d.strip()}
        nics = [n for n in topo.get("nics", []) if n.get("usable") and (not wanted or n["name"] in wanted)]
        names = [n["name"] for n in nics]
        out: dict[str, list[list[str]]] = {}
        for node in topo.get("numa_nodes", []) or [0]:
            near = [n["name"] for n in nics if n.get("numa_node") == node]
            out[f"cpu:{node}"] = [near, [m for m in names if m not in near]]
        for a in topo.get("assignment", []):
            near = [m for m in a.get("nics", []) if m in names]
            out[f"cuda:{a['gpu']}"] = [near, [m for m in names if m not in near]]
        return json.dumps(out, indent="\t") + "\n"

    def _cuda(self, what: str, target: str) -> int | None:
        try:
            self._ready()
        except _ferry.FerryError as e:
            return self._fail(e, what, peer=target)
        why = self._raw.cuda_unavailable()
        if why is not None:
            return self._fail(_ferry.Unavailable(why), what, peer=target, code=ERR_NOT_IMPLEMENTED)
        return None

    def transfer_write_on_cuda(self, target_hostname: str, buffer: int, peer_buffer_address: int,
                               length: int, stream_ptr: int = 0, transport_hint: str = "") -> int:
        """A WRITE of GPU memory through Ferry's GPU path (negative without a CUDA driver)."""
        rc = self._cuda("transfer_write_on_cuda", target_hostname)
        return rc if rc is not None else self.transfer_sync_write(
            target_hostname, buffer, peer_buffer_address, length)

    def transfer_read_on_cuda(self, target_hostname: str, buffer: int, peer_buffer_address: int,
                              length: int, stream_ptr: int = 0, transport_hint: str = "") -> int:
        """A READ into GPU memory through Ferry's GPU path (negative without a CUDA driver)."""
        rc = self._cuda("transfer_read_on_cuda", target_hostname)
        return rc if rc is not None else self.transfer_sync_read(
            target_hostname, buffer, peer_buffer_address, length)

    def batch_transfer_write_on_cuda(self, target_hostname: str, buffers: list[int],
                                     peer_buffer_addresses: list[int], lengths: list[int],
                                     stream_ptr: int = 0, transport_hint: str = "") -> int:
        """A batch of GPU WRITEs (negative without a CUDA driver)."""
        rc = self._cuda("batch_transfer_write_on_cuda", target_hostname)
        return rc if rc is not None else self.batch_transfer_sync_write(
            target_hostname, buffers, peer_buffer_addresses, lengths)

    def batch_transfer_read_on_cuda(self, target_hostname: str, buffers: list[int],
                                    peer_buffer_addresses: list[int], lengths: list[int],
                                    stream_ptr: int = 0, transport_hint: str = "") -> int:
        """A batch of GPU READs (negative without a CUDA driver)."""
        rc = self._cuda("batch_transfer_read_on_cuda", target_hostname)
        return rc if rc is not None else self.batch_transfer_sync_read(
            target_hostname, buffers, peer_buffer_addresses, lengths)

    def get_engine(self) -> Any:
        """Mooncake Store's handle on the C++ engine: not part of Ferry."""
        raise NotImplementedError(
            "get_engine returns Mooncake's C++ TransferEngine for Mooncake Store; Ferry has none "
            "(use Mooncake Store with Mooncake, or Ferry's own API)")

    def get_engine_ptr(self) -> int:
        """Mooncake Store's raw pointer to the C++ engine: not part of Ferry."""
        raise NotImplementedError(
            "get_engine_ptr returns a pointer to Mooncake's C++ TransferEngine for Mooncake "
            "Store; Ferry has none")

