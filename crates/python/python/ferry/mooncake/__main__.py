"""``python -m ferry.mooncake SCRIPT [ARGS...]``: runs SCRIPT as ``__main__`` with ``mooncake``
and ``mooncake.engine`` resolving to Ferry, and sets ``FERRY_AS_MOONCAKE=1`` so that Python
processes it starts do the same. ``-m MODULE`` runs a module instead of a script."""

import sys

from ferry._alias import MOONCAKE, run_main

if __name__ == "__main__":
    sys.exit(run_main(MOONCAKE, "python -m ferry.mooncake SCRIPT [ARGS...] | -m MODULE [ARGS...]"))
