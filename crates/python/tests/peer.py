"""A Ferry peer in its own process, for the tests: it serves three NumPy arrays and answers
commands on stdin, one per line.

Segments: ``src`` (read; ``pattern(N, 1)``), ``sink`` (read+write; zeros), ``small``
(read; 4096 bytes). It prints ``{"addr": ..., "pid": ...}`` once serving, then per command:
``check sink SEED`` prints ``ok`` when ``sink`` holds ``pattern(N, SEED)`` (else ``bad``);
``quit`` exits.
"""

import json
import sys

import numpy as np

import ferry


def pattern(n: int, seed: int) -> np.ndarray:
    """``n`` uint32 values from ``seed``: the same in every process."""
    return np.random.default_rng(seed).integers(0, 2**32, size=n, dtype=np.uint32)


def main() -> None:
    n = int(sys.argv[1])
    engine = ferry.Engine(listen="127.0.0.1:0")
    src = pattern(n, 1)
    sink = np.zeros(n, dtype=np.uint32)
    small = np.zeros(1024, dtype=np.uint32)
    regs = [
        engine.register(src, name="src", access="read"),
        engine.register(sink, name="sink", access="read+write"),
        engine.register(small, name="small", access="read"),
    ]
    print(json.dumps({"addr": engine.listen_addr}), flush=True)
    for line in sys.stdin:
        cmd = line.split()
        if cmd[:2] == ["check", "sink"]:
            ok = np.array_equal(sink, pattern(n, int(cmd[2])))
            print("ok" if ok else "bad", flush=True)
        elif cmd == ["quit"]:
            break
    for r in regs:
        r.close()


if __name__ == "__main__":
    main()
