"""``nixl.logging`` on Ferry: ``get_logger(name)`` gives a logger under ``ferry.nixl``."""

from __future__ import annotations

import logging as _logging


def get_logger(name: str) -> _logging.Logger:
    """A logger named under ``ferry.nixl`` (configure it with Python's ``logging``)."""
    return _logging.getLogger(f"ferry.nixl.{name}")


def setup_logging() -> None:
    """Nothing to set up: Ferry's NIXL layer logs through Python's ``logging``."""


def set_log_level_by_env() -> None:
    """``NIXL_LOG_LEVEL`` (``DEBUG``, ``INFO``, ``WARNING``, ``ERROR``) sets the level of ``ferry.nixl``."""
    import os

    level = os.environ.get("NIXL_LOG_LEVEL")
    if level:
        _logging.getLogger("ferry.nixl").setLevel(level.upper())
