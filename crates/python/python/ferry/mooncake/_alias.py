"""Making ``import mooncake`` and ``import mooncake.engine`` give Ferry's modules.

A finder at the front of ``sys.meta_path`` answers for exactly those two names (and
``mooncake.*`` submodules Ferry does not provide are refused with an ``ImportError`` saying so),
so nothing is imported until the program imports ``mooncake``.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
import types

#: The environment variable that turns the alias on in every process (the ``.pth`` hook).
ENV = "FERRY_AS_MOONCAKE"


class _Loader(importlib.abc.Loader):
    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        if spec.name == "mooncake.engine":
            import ferry.mooncake.engine as engine

            return engine
        return None

    def exec_module(self, module: types.ModuleType) -> None:
        if module.__name__ == "mooncake":
            module.__doc__ = "Mooncake's transfer engine API, served by Ferry (ferry.mooncake)."
            module.__path__ = []  # a package, so that `mooncake.engine` is importable
            module.__ferry__ = True


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):  # type: ignore[no-untyped-def]
        if fullname == "mooncake":
            return importlib.machinery.ModuleSpec(fullname, _Loader(), is_package=True)
        if fullname == "mooncake.engine":
            return importlib.machinery.ModuleSpec(fullname, _Loader())
        if fullname.startswith("mooncake."):
            raise ImportError(
                f"{fullname} is part of Mooncake that Ferry does not provide (Ferry serves "
                "mooncake.engine; unset FERRY_AS_MOONCAKE to use a real Mooncake)",
                name=fullname,
            )
        return None


_FINDER = _Finder()


def install() -> None:
    """Makes ``mooncake`` and ``mooncake.engine`` resolve to Ferry in this process (a
    ``mooncake`` imported before stays what it is)."""
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)


def installed() -> bool:
    """Whether the alias is on in this process."""
    return _FINDER in sys.meta_path


def _from_env() -> None:
    """The ``.pth`` hook: installs the alias when ``FERRY_AS_MOONCAKE`` is set (to anything but
    empty or 0)."""
    if os.environ.get(ENV, "").strip() not in ("", "0"):
        install()
