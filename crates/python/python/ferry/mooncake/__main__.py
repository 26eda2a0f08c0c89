"""``python -m ferry.mooncake SCRIPT [ARGS...]``: runs SCRIPT as ``__main__`` with ``mooncake``
and ``mooncake.engine`` resolving to Ferry, and sets ``FERRY_AS_MOONCAKE=1`` so that Python
processes it starts do the same. ``-m MODULE`` runs a module instead of a script."""

import os
import runpy
import sys

from ferry.mooncake._alias import ENV, install

USAGE = "usage: python -m ferry.mooncake SCRIPT [ARGS...] | -m MODULE [ARGS...]"


def main() -> int:
    args = sys.argv[1:]
    if not args or args[0] in ("-h", "--help"):
        print(USAGE, file=sys.stderr if not args else sys.stdout)
        return 2 if not args else 0
    os.environ[ENV] = "1"
    install()
    if args[0] == "-m":
        if len(args) < 2:
            print(USAGE, file=sys.stderr)
            return 2
        sys.argv = args[1:]
        runpy.run_module(args[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = args
        sys.path.insert(0, os.path.dirname(os.path.abspath(args[0])))
        runpy.run_path(args[0], run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main())
