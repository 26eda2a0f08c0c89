"""Where a compatibility layer's engine listens when its API names no address."""

from __future__ import annotations

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
