"""Where a compatibility layer's engine listens when its API names no address."""

from __future__ import annotations

import ipaddress
import logging
import os
import socket


def bind_host(host: str) -> str:
    """An address of this machine for ``host``: ``host`` itself where it resolves to one, else
    this machine's first address (its host name's), else ``127.0.0.1``."""
    for candidate in (host, socket.gethostname()):
        if not candidate:
            continue
        try:
            infos = socket.getaddrinfo(candidate, None, type=socket.SOCK_STREAM)
        except OSError:
            continue
        for family, _, _, _, sa in infos:
            try:
                with socket.socket(family, socket.SOCK_STREAM) as s:
                    s.bind((sa[0], 0))
                return sa[0]
            except OSError:
                continue
    return "127.0.0.1"


def join(host: str, port: int) -> str:
    """``host:port``, with an IPv6 host in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def is_loopback(addr: str) -> bool:
    """Whether ``addr`` (``host:port``, ``[v6]:port`` or a bare host) is a loopback address."""
    host = addr.rsplit(":", 1)[0] if addr.count(":") == 1 or addr.startswith("[") else addr
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def warn_if_open(log: logging.Logger, what: str, listen: str | None, keyed: bool) -> None:
    """Logs a WARNING on ``log`` when ``what`` listens on ``listen``, off loopback, without
    keys: the compat layers' users read Python logging, not Ferry's ``tracing`` events."""
    if keyed or listen is None or is_loopback(listen):
        return
    log.warning(
        "%s listens on %s without authentication keys: any peer that reaches it can read and "
        "write every registration and send notifications under any name. Set "
        "FERRY_AUTH_KEY_FILE to a keyring (docs/security.md) before deploying.",
        what, listen,
    )


def publish_to() -> list[str] | None:
    """The key names ``FERRY_PUBLISH_TO`` lists (comma-separated): a compat layer's
    registrations, and the index of their addresses, are published to the peers proving one of
    them only (it needs ``FERRY_AUTH_KEY_FILE``). None when unset: every peer that may connect
    lists them."""
    names = [n.strip() for n in os.environ.get("FERRY_PUBLISH_TO", "").split(",") if n.strip()]
    return names or None
