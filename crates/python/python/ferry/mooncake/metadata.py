"""Where a Mooncake-style name (``local_hostname``) is found: the three metadata modes of
``TransferEngine.initialize``.

- ``P2PHANDSHAKE``: no store; a peer's name is the address Ferry listens on (``host:port``).
- ``http://HOST:PORT/PATH``: Mooncake's HTTP metadata server protocol (``GET``/``PUT``/``DELETE``
  on ``PATH?key=KEY``; ``ferry metadata-server`` speaks it, as do Mooncake's own servers).
- ``etcd://HOST:PORT`` (or a bare ``HOST:PORT``, which Mooncake also takes as etcd): etcd, through
  Ferry's etcd client; records are bound to a lease this process keeps alive.

Each engine keeps one record under ``mooncake/[<MC_METADATA_CLUSTER_ID>/]ferry/<name>``: a JSON
object with the address Ferry listens on, its peer id and epoch, and its server identity. The
peer id and epoch are the incarnation that speaks for ``name`` in notifications
(``ferry._senders``). The server identity (``Engine.server_identity``) is what a keyed peer
expects the address to prove (``Engine.expect_server``): a server that holds the peer's key
but is not the one the record names is refused there (a redirected record reaches nothing). Mooncake's own keys (``ram/``,
``rpc_meta/``) are left alone, so a Mooncake engine and a Ferry engine can share one server
without reading each other's records.
"""

from __future__ import annotations

import json
import os
import secrets
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass

#: How long one HTTP metadata call may take, in seconds (Mooncake's client allows 3 s).
HTTP_TIMEOUT = 3.0

#: Ferry's addition to the HTTP protocol: ``ferry metadata-server`` lets only a PUT or DELETE
#: carrying the token a record was first PUT with change it (other servers ignore the header).
OWNER_TOKEN_HEADER = "Ferry-Owner-Token"


from ferry._ferry import FerryError


class MetadataError(FerryError):
    """A metadata store could not be reached, or holds no record of that name."""


@dataclass(frozen=True)
class Mode:
    """A parsed ``metadata_server``: ``kind`` is ``"p2p"``, ``"http"`` or ``"etcd"``;
    ``where`` the URL (http) or ``HOST:PORT`` (etcd)."""

    kind: str
    where: str


def parse(metadata_server: str, metadata_type: str | None = None) -> Mode:
    """Mooncake's reading of ``metadata_server`` (``initialize``) or of the pair
    ``(metadata_server, metadata_type)`` (``initialize_ext``)."""
    s = metadata_server.strip()
    if s == "P2PHANDSHAKE":
        return Mode("p2p", "")
    if "://" in s:
        scheme, _, rest = s.partition("://")
    elif metadata_type:
        scheme, rest = metadata_type, s
    else:
        scheme, rest = "etcd", s
    scheme = scheme.lower()
    if not rest:
        raise MetadataError(f"metadata server {metadata_server!r} names no host")
    if scheme in ("http", "https"):
        return Mode("http", f"{scheme}://{rest}")
    if scheme == "etcd":
        return Mode("etcd", rest.rstrip("/"))
    raise MetadataError(
        f"metadata server {metadata_server!r}: Ferry speaks P2PHANDSHAKE, http:// and etcd:// "
        f"(not {scheme}://)"
    )


def key_of(name: str) -> str:
    """The key of the record of engine ``name``."""
    cluster = os.environ.get("MC_METADATA_CLUSTER_ID", "")
    prefix = f"mooncake/{cluster}/" if cluster else "mooncake/"
    return f"{prefix}ferry/{name}"


class Store:
    """A metadata store's three calls. ``get`` returns None for an absent key."""

    def put(self, key: str, value: bytes) -> None:
        raise NotImplementedError

    def get(self, key: str) -> bytes | None:
        raise NotImplementedError

    def delete(self, key: str) -> None:
        raise NotImplementedError

    def close(self) -> None:
        pass


class HttpStore(Store):
    """Mooncake's HTTP metadata protocol at ``url`` (``http://HOST:PORT/metadata``). Its PUTs
    and DELETEs carry an owner token: ``FERRY_METADATA_TOKEN`` (16 to 256 visible ASCII
    characters; it lets a restarted engine take its record back), else one drawn per store."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.token = os.environ.get("FERRY_METADATA_TOKEN") or secrets.token_urlsafe(32)

    def _call(self, method: str, key: str, body: bytes | None = None) -> bytes | None:
        url = f"{self.url}?key={urllib.parse.quote(key, safe='')}"
        req = urllib.request.Request(url, data=body, method=method)
        if body is not None:
            req.add_header("Content-Type", "application/json")
        if method in ("PUT", "DELETE"):
            req.add_header(OWNER_TOKEN_HEADER, self.token)
        try:
            with urllib.request.urlopen(req, timeout=HTTP_TIMEOUT) as resp:
                return resp.read()
        except urllib.error.HTTPError as e:
            if e.code == 404 and method in ("GET", "DELETE"):
                return None
            said = e.read(256).decode("utf-8", "replace").strip()
            hint = (
                " (the name is another engine's, or an earlier run's: FERRY_METADATA_TOKEN "
                "keeps a token across restarts)"
                if e.code == 403
                else ""
            )
            raise MetadataError(f"{method} {url}: HTTP {e.code} {e.reason}: {said}{hint}") from e
        except (urllib.error.URLError, OSError) as e:
            raise MetadataError(f"{method} {url}: {e}") from e

    def put(self, key: str, value: bytes) -> None:
        self._call("PUT", key, value)

    def get(self, key: str) -> bytes | None:
        return self._call("GET", key)

    def delete(self, key: str) -> None:
        self._call("DELETE", key)


class EtcdStore(Store):
    """etcd at ``HOST:PORT`` through Ferry's etcd client (``ferry._ferry.EtcdKv``)."""

    def __init__(self, endpoint: str) -> None:
        from ferry._ferry import EtcdKv, FerryError

        self._error = FerryError
        try:
            self.kv = EtcdKv(endpoint)
        except FerryError as e:
            raise MetadataError(str(e)) from e

    def put(self, key: str, value: bytes) -> None:
        try:
            self.kv.put(key, value)
        except self._error as e:
            raise MetadataError(str(e)) from e

    def get(self, key: str) -> bytes | None:
        try:
            return self.kv.get(key)
        except self._error as e:
            raise MetadataError(str(e)) from e

    def delete(self, key: str) -> None:
        try:
            self.kv.delete(key)
        except self._error as e:
            raise MetadataError(str(e)) from e

    def close(self) -> None:
        try:
            self.kv.close()
        except self._error:
            pass


def open_store(mode: Mode) -> Store | None:
    """The store of ``mode`` (None in P2P mode)."""
    if mode.kind == "http":
        return HttpStore(mode.where)
    if mode.kind == "etcd":
        return EtcdStore(mode.where)
    return None


def record(addr: str, peer_id: str, epoch: str, name: str,
           server_identity: str | None = None) -> bytes:
    """The JSON record of an engine named ``name`` listening on ``addr`` (proving
    ``server_identity`` there, where given)."""
    rec = {"name": name, "protocol": "ferry", "ferry_addr": addr, "peer_id": peer_id, "epoch": epoch}
    if server_identity is not None:
        rec["server_identity"] = server_identity
    return json.dumps(rec, sort_keys=True).encode()


@dataclass(frozen=True)
class Record:
    """What an engine's record says: where it listens and which incarnation it is (the one
    that speaks for its name in notifications)."""

    addr: str
    peer_id: str
    epoch: str
    #: The server identity the address must prove (None in a record written before them).
    server_identity: str | None = None


def record_in(value: bytes, name: str) -> Record:
    """The record ``value`` of engine ``name`` (MetadataError if it is not Ferry's)."""
    try:
        rec = json.loads(value)
        addr, peer_id, epoch = rec["ferry_addr"], rec["peer_id"], rec["epoch"]
    except (ValueError, KeyError, TypeError) as e:
        raise MetadataError(f"the metadata record of {name!r} is not Ferry's: {e}") from e
    if not isinstance(addr, str) or ":" not in addr:
        raise MetadataError(f"the metadata record of {name!r} names no address: {addr!r}")
    if not isinstance(peer_id, str) or not isinstance(epoch, str):
        raise MetadataError(f"the metadata record of {name!r} names no incarnation")
    identity = rec.get("server_identity")
    if identity is not None and not isinstance(identity, str):
        raise MetadataError(f"the metadata record of {name!r} names no server identity: {identity!r}")
    return Record(addr, peer_id, epoch, identity)
