"""A 64-byte READ of another process's memory, submitted and polled with ``Request.done()`` until
it ends, as NIXL's ``check_xfer_state`` loops do: the p50 and p90 round trip in microseconds.

    python crates/python/benches/done_poll_ab.py [OPS] [--pair BEFORE AFTER] [--rounds N]

Alone it measures the ``ferry`` on ``sys.path``. With ``--pair`` it runs itself with each
package directory first on ``PYTHONPATH`` (a copy of ``crates/python/python`` with a release
``_ferry.abi3.so`` of each build), alternating, ``--rounds`` times (docs/performance.md, "The
Python request path without a watching task").
"""

import argparse
import os
import subprocess
import sys
import time

SERVER = r"""
import sys, ferry
e = ferry.Engine(listen="127.0.0.1:0")
buf = bytearray(1 << 20)
r = e.register(buf, name="seg", access="read+write")
print(e.listen_addr, flush=True)
sys.stdin.read()
"""


def measure(ops: int) -> tuple[float, float]:
    import ferry

    srv = subprocess.Popen(
        [sys.executable, "-c", SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        engine = ferry.Engine()
        seg = engine.connect(srv.stdout.readline().strip()).segment("seg")
        reg = engine.register(bytearray(4096))
        times = []
        for _ in range(ops):
            t = time.perf_counter()
            req = engine.read(reg, seg, length=64)
            while not req.done():
                pass
            times.append(time.perf_counter() - t)
    finally:
        srv.stdin.close()
        srv.wait()
    times.sort()
    return times[len(times) // 2] * 1e6, times[int(len(times) * 0.9)] * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("ops", nargs="?", type=int, default=20000)
    ap.add_argument("--pair", nargs=2, metavar=("BEFORE", "AFTER"))
    ap.add_argument("--rounds", type=int, default=6)
    a = ap.parse_args()
    if not a.pair:
        p50, p90 = measure(a.ops)
        print(f"p50 {p50:.2f} us  p90 {p90:.2f} us")
        return
    for r in range(a.rounds):
        for name, path in zip(("before", "after"), a.pair):
            env = dict(os.environ, PYTHONPATH=path)
            out = subprocess.run(
                [sys.executable, __file__, str(a.ops)], env=env, capture_output=True, text=True
            )
            print(f"round {r + 1} {name}: {out.stdout.strip() or out.stderr.strip()}", flush=True)


if __name__ == "__main__":
    main()
