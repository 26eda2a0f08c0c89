"""``benches/nixl_bench.py`` with its buffers allocated by Ferry, for the ``ferry-shared`` side of
``cargo xtask bench same-host --shared``: run as ``python -m ferry.nixl
crates/python/benches/nixl_shared_bench.py target|run ...`` (the same arguments as
``nixl_bench.py``).

The workload is ``nixl_bench.py``'s, unchanged, except where its 64 MiB buffer comes from: each
process allocates it with its agent's engine (``RawEngine.allocate``: a memfd that a same-host
peer maps, then copies one-sidedly in its own thread, docs/architecture.md 4.2), and the
script's ``register_memory`` of that range then counts one more use of the registration
``allocate`` made. NIXL's own wheel has no such call; this side measures what Ferry's shared
registrations give the same calls.
"""

import ctypes
import os
import sys
import types

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "benches"))
import nixl_bench  # noqa: E402  (the workload, from the repository's benches/)

_agents: list = []


class _Agent(nixl_bench.nixl_agent):
    """The workload's agent, remembered so that its buffer is allocated by its engine."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        _agents.append(self)


def _ferry_buffer(length: int, fill: int) -> np.ndarray:
    if not _agents:
        raise RuntimeError("nixl_shared_bench: a buffer before the agent")
    addr = _agents[-1]._raw.allocate(length)
    buf = np.ctypeslib.as_array((ctypes.c_uint8 * length).from_address(addr))
    buf[:] = fill
    return buf


# The script's `np.ones(SPAN)` / `np.zeros(SPAN)` (its only buffers) come from Ferry; numpy
# otherwise.
_np = types.SimpleNamespace(**{k: getattr(np, k) for k in dir(np) if not k.startswith("__")})
_np.ones = lambda n, dtype=None: _ferry_buffer(n, 1)
_np.zeros = lambda n, dtype=None: _ferry_buffer(n, 0)
nixl_bench.np = _np
nixl_bench.nixl_agent = _Agent

if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "memcpy":
        sys.exit("nixl_shared_bench: memcpy is nixl_bench.py's own")
    nixl_bench.main()
