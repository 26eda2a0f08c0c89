"""``python -m ferry.nixl SCRIPT [ARGS...]``: runs SCRIPT as ``__main__`` with ``nixl`` resolving
to Ferry, and sets ``FERRY_AS_NIXL=1`` so that Python processes it starts do the same. ``-m
MODULE`` runs a module instead of a script."""

import sys

from ferry._alias import NIXL, run_main

if __name__ == "__main__":
    sys.exit(run_main(NIXL, "python -m ferry.nixl SCRIPT [ARGS...] | -m MODULE [ARGS...]"))
