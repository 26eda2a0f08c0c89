"""``ferry.lmcache``: a native ``ferry`` transfer channel for LMCache's P2P KV sharing
(``lmcache.v1.distributed.transfer_channel``, LMCache 0.5.6), registered through LMCache's
factory. ``import ferry.lmcache`` (or ``ferry.lmcache.register()``) registers it; LMCache then
makes it for ``transfer_channel_type="ferry"``. See docs/nixl.md, "LMCache".

Its contract is LMCache's ``TransferChannelContext``/``Server``/``Client`` (the ``nixl``
channel's behaviour, which LMCache's channel tests pin down), on Ferry's own API instead of
NIXL's:

- A context is a Ferry engine listening on ``listen_url``. Peers reach it at
  ``advertise_url``: the engine's own address, so no side channel (the ``nixl`` channel's ZMQ
  handshake) is needed.
- The L1 buffer (``L1MemoryDesc``: pointer, size) is one registration, published read-only as
  the segment ``lmcache-l1``; addresses are ``(offset, size)`` in it.
- ``submit_read`` is one Ferry request of all its objects (one READ each, by segment offset);
  ``query_read_status`` polls it, and a finished request that failed marks every object
  failed, as the ``nixl`` channel does.
- A client tells its peer who it is with a notification; the peer counts it among its
  connected clients (the reverse client of the ``nixl`` channel) when it next looks.
"""

from __future__ import annotations

import ctypes
import threading
from typing import Any, Optional

from ferry import _ferry

#: The segment the L1 buffer is published as.
SEGMENT = "lmcache-l1"
#: The notification a client sends its peer when it connects (the message: its url).
_HELLO = "lmcache-ferry-hello"


def _lmcache() -> Any:
    """LMCache's transfer-channel package (ImportError naming it when LMCache is missing)."""
    try:
        from lmcache.v1.distributed import transfer_channel
    except ImportError as e:
        raise ImportError(f"ferry.lmcache needs LMCache 0.5.6's transfer channels: {e}") from e
    return transfer_channel


_tc = _lmcache()
from lmcache.v1.distributed.transfer_channel.factory import (  # noqa: E402
    register_transfer_channel_factory,
)


class FerryTransferChannelClient(_tc.TransferChannelClient):
    """Reads from one peer's L1 buffer (segment ``lmcache-l1``)."""

    def __init__(self, context: "FerryTransferChannelContext", url: str) -> None:
        self._ctx = context
        self._url = url
        self._peer = context.engine.connect(url)
        self._segment = self._peer.segment(SEGMENT)
        self._tasks: dict[int, tuple[Any, int]] = {}
        self._ids = iter(range(1 << 62))
        self._lock = threading.Lock()

    def submit_read(self, local_addresses: list, remote_addresses: list) -> int:
        """One request of a READ per object; the task id for ``query_read_status``.
        ``ValueError`` when the lists differ in length, or an address lies outside its buffer."""
        if len(local_addresses) != len(remote_addresses):
            raise ValueError("local_addresses and remote_addresses must have equal length "
                             f"({len(local_addresses)} != {len(remote_addresses)})")
        batch = _ferry.Batch()
        for local, remote in zip(local_addresses, remote_addresses):
            if local.size != remote.size:
                raise ValueError(f"object sizes differ: local {local.size}, remote {remote.size}")
            if remote.offset < 0 or remote.offset + remote.size > len(self._segment):
                raise ValueError(f"remote object [{remote.offset:#x}, "
                                 f"{remote.offset + remote.size:#x}) is outside the peer's "
                                 f"L1 region [0x0, {len(self._segment):#x})")
            self._ctx.get_transfer_channel_address([(local.offset, local.size)])
            batch.read(self._ctx.registration, self._segment, local.offset, remote.offset,
                       local.size)
        request = self._ctx.engine.submit(batch)
        with self._lock:
            task = next(self._ids)
            self._tasks[task] = (request, len(remote_addresses))
        return task

    def query_read_status(self, task_id: int) -> Any:
        """Finished or not; once finished, the task is forgotten (``KeyError`` after)."""
        with self._lock:
            if task_id not in self._tasks:
                raise KeyError(f"Unknown read task id: {task_id}")
            request, n = self._tasks[task_id]
        if not request.done():
            return _tc.TransferChannelReadResult(finished=False, succeeded_mask=[])
        with self._lock:
            self._tasks.pop(task_id, None)
        ok = request.wait_drained().ok
        return _tc.TransferChannelReadResult(finished=True, succeeded_mask=[ok] * n)

    def close(self) -> None:
        """Cancels the reads still running and waits until none of their bytes can move."""
        with self._lock:
            tasks = list(self._tasks.values())
            self._tasks.clear()
        for request, _ in tasks:
            request.cancel()
            request.wait_drained()


class FerryTransferChannelServer(_tc.TransferChannelServer):
    """The context's engine serving its L1 buffer; nothing else to run."""

    def __init__(self, listen_url: str, advertise_url: str, l1_memory_desc: Any) -> None:
        self.listen_url, self.advertise_url = listen_url, advertise_url
        self.l1_memory_desc = l1_memory_desc

    def close(self) -> None:
        pass


class FerryTransferChannelContext(_tc.TransferChannelContext):
    """LMCache's transfer-channel context on a Ferry engine (module docstring)."""

    def __init__(self, l1_memory_desc: Any, listen_url: str, advertise_url: str,
                 auth_key_file: Optional[str] = None) -> None:
        self._l1 = l1_memory_desc
        self.listen_url, self.advertise_url = listen_url, advertise_url
        self.engine = _ferry.Engine(listen=listen_url, auth_key_file=auth_key_file)
        self._raw = _ferry.RawEngine(self.engine)
        view = (ctypes.c_ubyte * l1_memory_desc.size).from_address(l1_memory_desc.ptr)
        self.registration = self.engine.register(view, name=SEGMENT, access="read")
        self._server = FerryTransferChannelServer(listen_url, advertise_url, l1_memory_desc)
        self._clients: dict[str, Optional[FerryTransferChannelClient]] = {}
        self._lock = threading.Lock()

    def get_transfer_channel_address(self, lmcache_addresses: list) -> list:
        """``(offset, size)`` pairs in the L1 buffer; ``ValueError`` for one outside it."""
        out = []
        for offset, size in lmcache_addresses:
            if offset < 0 or offset + size > self._l1.size:
                raise ValueError(f"Object [{offset:#x}, {offset + size:#x}) is outside the "
                                 f"registered L1 region [0x0, {self._l1.size:#x})")
            out.append(_tc.TransferChannelAddress(offset=offset, size=size))
        return out

    def get_transfer_channel_server(self) -> FerryTransferChannelServer:
        return self._server

    def _take_hellos(self) -> None:
        """Peers that connected to us since we last looked: their reverse clients, made
        when first used."""
        for name, message, *_ in self._raw.take_notifications():
            if name == _HELLO:
                with self._lock:
                    self._clients.setdefault(message.decode(), None)

    def get_transfer_channel_client(self, peer_advertise_url: str) -> FerryTransferChannelClient:
        """The client of that peer (one per peer), connected on first use; the peer hears
        of it."""
        self._take_hellos()
        with self._lock:
            client = self._clients.get(peer_advertise_url)
        if client is not None:
            return client
        client = FerryTransferChannelClient(self, peer_advertise_url)
        with self._lock:
            known = self._clients.get(peer_advertise_url)
            if known is not None:
                return known
            self._clients[peer_advertise_url] = client
        self._raw.notify(peer_advertise_url, _HELLO, self.advertise_url.encode())
        return client

    def get_num_connected_clients(self) -> int:
        self._take_hellos()
        with self._lock:
            return len(self._clients)

    def remove_transfer_channel_client(self, peer_advertise_url: str) -> None:
        with self._lock:
            client = self._clients.pop(peer_advertise_url, None)
        if client is not None:
            client.close()

    def close(self) -> None:
        with self._lock:
            clients = [c for c in self._clients.values() if c is not None]
            self._clients.clear()
        for c in clients:
            c.close()
        self.registration.close()
        self.engine.shutdown()


def create_ferry_transfer_channel_context(l1_memory_desc: Any, listen_url: str,
                                          advertise_url: str, **kwargs: Any) -> Any:
    """LMCache's factory signature; ``auth_key_file`` (else ``FERRY_AUTH_KEY_FILE``) keys the
    peers. Other keyword arguments (the ``nixl`` channel's ``backends``) are ignored."""
    return FerryTransferChannelContext(l1_memory_desc, listen_url, advertise_url,
                                       kwargs.get("auth_key_file"))


_registered = False


def register() -> None:
    """Registers the ``ferry`` channel with LMCache's factory (once per process)."""
    global _registered
    if not _registered:
        register_transfer_channel_factory("ferry", create_ferry_transfer_channel_context)
        _registered = True


register()
