"""NIXL's agent API on Ferry: code written against ``nixl._api`` (vLLM's NixlConnector, Dynamo,
PRIME-RL, SkyRL) runs on Ferry unchanged.

``from ferry.nixl import nixl_agent, nixl_agent_config`` gives the classes directly. To run code
that imports ``nixl`` itself:

- ``python -m ferry.nixl SCRIPT ARGS...`` runs ``SCRIPT`` with ``nixl``, ``nixl._api``,
  ``nixl._bindings`` and ``nixl.logging`` resolving to Ferry;
- ``FERRY_AS_NIXL=1`` does the same in every Python process of an environment where the
  ``ferry-transfer`` wheel is installed (a ``.pth`` hook);
- ``ferry.nixl.install()`` does it in the running process.

Without any of them nothing changes, and a real NIXL installed beside Ferry still imports.
Every call, what Ferry does and where it differs: docs/nixl.md.
"""

from ferry._alias import NIXL as _ALIAS
from ferry.nixl._bindings import *  # noqa: F401,F403  (first: _api's names below win, as in NIXL)
from ferry.nixl._api import (
    DEFAULT_COMM_PORT,
    nixl_agent,
    nixl_agent_config,
    nixl_backend_handle,
    nixl_prepped_dlist_handle,
    nixl_thread_sync_t,
    nixl_xfer_handle,
)
from ferry.nixl.logging import get_logger

__all__ = [
    "DEFAULT_COMM_PORT",
    "get_logger",
    "install",
    "installed",
    "nixl_agent",
    "nixl_agent_config",
    "nixl_backend_handle",
    "nixl_prepped_dlist_handle",
    "nixl_thread_sync_t",
    "nixl_xfer_handle",
]


def install() -> None:
    """Makes ``nixl`` and its modules the connector imports resolve to Ferry in this process."""
    _ALIAS.install()


def installed() -> bool:
    """Whether the alias is on in this process."""
    return _ALIAS.installed()
