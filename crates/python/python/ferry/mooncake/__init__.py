"""Mooncake's transfer engine API on Ferry: code written against ``mooncake.engine`` runs on
Ferry unchanged.

``from ferry.mooncake import TransferEngine`` gives the class directly. To run code that imports
``mooncake`` itself:

- ``python -m ferry.mooncake SCRIPT ARGS...`` runs ``SCRIPT`` with ``mooncake`` and
  ``mooncake.engine`` resolving to Ferry;
- ``FERRY_AS_MOONCAKE=1`` does the same in every Python process of an environment where the
  ``ferry-transfer`` wheel is installed (a ``.pth`` hook), so launchers that spawn workers pick
  it up;
- ``ferry.mooncake.install()`` does it in the running process.

Without any of them nothing changes, and a real Mooncake installed beside Ferry still imports.
Method by method, what Ferry does and where it differs: docs/mooncake.md.
"""

from ferry.mooncake.engine import (
    BatchState,
    CancelResult,
    Read,
    TransferEngine,
    TransferNotify,
    TransferOpcode,
    Write,
)
from ferry._alias import MOONCAKE as _ALIAS

__all__ = [
    "BatchState",
    "CancelResult",
    "Read",
    "TransferEngine",
    "TransferNotify",
    "TransferOpcode",
    "Write",
    "install",
    "installed",
]


def install() -> None:
    """Makes ``mooncake`` and ``mooncake.engine`` resolve to Ferry in this process (a
    ``mooncake`` imported before stays what it is)."""
    _ALIAS.install()


def installed() -> bool:
    """Whether the alias is on in this process."""
    return _ALIAS.installed()
