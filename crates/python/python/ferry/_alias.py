"""Making another project's module names give Ferry's modules: ``import mooncake.engine`` (and
``import nixl._api``) resolving to ``ferry.mooncake`` (and ``ferry.nixl``).

A finder at the front of ``sys.meta_path`` answers for exactly the names of an alias; other
submodules of the aliased package are refused with an ``ImportError`` saying so. Nothing is
imported until the program imports the aliased name.

Both aliases (``MOONCAKE``, ``NIXL``) are declared here, as names only: the layers import this
module, and it imports none of them, so the ``.pth`` hook (``from_env``) loads nothing else.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import os
import sys
import types


class _Loader(importlib.abc.Loader):
    def __init__(self, target: str | None, alias: "Alias") -> None:
        self.target = target
        self.alias = alias

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        if self.target is not None:
            return importlib.import_module(self.target)
        return None

    def exec_module(self, module: types.ModuleType) -> None:
        if self.target is None:
            module.__doc__ = f"{self.alias.package}, served by Ferry ({self.alias.served_by})."
            module.__path__ = []  # a package, so that its submodules are importable
            module.__ferry__ = True


class Alias(importlib.abc.MetaPathFinder):
    """The names of ``package`` that resolve to Ferry's modules: ``modules`` maps each full name
    to the module that serves it (``None``: the package itself, an empty namespace whose
    submodules are those listed). ``env`` turns it on in every process (the ``.pth`` hook)."""

    def __init__(self, package: str, modules: dict[str, str | None], env: str, served_by: str):
        self.package = package
        self.modules = modules
        self.env = env
        self.served_by = served_by

    def find_spec(self, fullname, path=None, target=None):  # type: ignore[no-untyped-def]
        if fullname in self.modules:
            t = self.modules[fullname]
            return importlib.machinery.ModuleSpec(
                fullname, _Loader(t, self), is_package=t is None or fullname == self.package
            )
        if fullname.startswith(self.package + "."):
            raise ImportError(
                f"{fullname} is part of {self.package} that Ferry does not provide (Ferry serves "
                f"{', '.join(sorted(m for m in self.modules if m != self.package))}; unset "
                f"{self.env} to use the real {self.package})",
                name=fullname,
            )
        return None

    def install(self) -> None:
        """Makes the names resolve to Ferry in this process (a module imported before stays what
        it is)."""
        if self not in sys.meta_path:
            sys.meta_path.insert(0, self)

    def installed(self) -> bool:
        """Whether the alias is on in this process."""
        return self in sys.meta_path

    def from_env(self) -> None:
        """Installs the alias when its variable is set (to anything but empty or 0)."""
        if os.environ.get(self.env, "").strip() not in ("", "0"):
            self.install()


def run_main(alias: Alias, usage: str) -> int:
    """``python -m ferry.<layer> SCRIPT [ARGS...]`` (or ``-m MODULE``): runs it as ``__main__``
    with ``alias`` on, its variable set for the processes it starts."""
    import runpy

    args = sys.argv[1:]
    if not args or args[0] in ("-h", "--help"):
        print(f"usage: {usage}", file=sys.stderr if not args else sys.stdout)
        return 2 if not args else 0
    os.environ[alias.env] = "1"
    alias.install()
    if args[0] == "-m":
        if len(args) < 2:
            print(f"usage: {usage}", file=sys.stderr)
            return 2
        sys.argv = args[1:]
        runpy.run_module(args[1], run_name="__main__", alter_sys=True)
    else:
        if not os.path.isfile(args[0]):
            prog = usage.split(" SCRIPT")[0]
            print(f"{prog}: no such script: {args[0]}", file=sys.stderr)
            return 2
        sys.argv = args
        sys.path.insert(0, os.path.dirname(os.path.abspath(args[0])))
        runpy.run_path(args[0], run_name="__main__")
    return 0


#: ``import mooncake`` and ``import mooncake.engine`` giving ``ferry.mooncake``.
MOONCAKE = Alias(
    "mooncake",
    {"mooncake": None, "mooncake.engine": "ferry.mooncake.engine"},
    "FERRY_AS_MOONCAKE",
    "ferry.mooncake",
)

#: ``import nixl``, ``nixl._api``, ``nixl._bindings``, ``nixl._utils`` and ``nixl.logging``
#: giving ``ferry.nixl``.
NIXL = Alias(
    "nixl",
    {
        "nixl": "ferry.nixl",
        "nixl._api": "ferry.nixl._api",
        "nixl._bindings": "ferry.nixl._bindings",
        "nixl._utils": "ferry.nixl._utils",
        "nixl.logging": "ferry.nixl.logging",
    },
    "FERRY_AS_NIXL",
    "ferry.nixl",
)


def from_env() -> None:
    """The ``.pth`` hook: turns on each alias whose variable is set."""
    for alias in (MOONCAKE, NIXL):
        alias.from_env()
