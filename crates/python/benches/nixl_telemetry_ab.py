"""What NIXL's telemetry costs on Ferry: ``benches/nixl_bench.py`` (READ of 64 blocks by index,
posted and polled until done, again and again) with telemetry off, and with it on as a
Dynamo deployment turns it on (``NIXL_TELEMETRY_ENABLE=y``, ``NIXL_TELEMETRY_EXPORTER=prometheus``:
per-transfer telemetry, the series recorded, an endpoint served), in alternating rounds, the
order turning each round. Prints each run and the on/off ratio per round (docs/performance.md,
"NIXL's telemetry").

    python crates/python/benches/nixl_telemetry_ab.py [--block 65536] [--blocks 64] [--rounds 6] [--bytes N]

Both ends run under ``python -m ferry.nixl`` with the Python that runs this script.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
SCRIPT = REPO / "benches" / "nixl_bench.py"
ON = {"NIXL_TELEMETRY_ENABLE": "y", "NIXL_TELEMETRY_EXPORTER": "prometheus",
      "NIXL_TELEMETRY_PROMETHEUS_PORT": "0", "NIXL_TELEMETRY_PROMETHEUS_LOCAL": "y"}


def bench_line(proc: subprocess.Popen) -> dict:
    for line in proc.stdout:
        if line.startswith("BENCH "):
            return json.loads(line[len("BENCH "):])
    raise RuntimeError(f"no BENCH line; exit {proc.wait()}")


def once(on: bool, block: int, blocks: int, total: int) -> float:
    env = {k: v for k, v in os.environ.items() if not k.startswith("NIXL_TELEMETRY")}
    env.update(ON if on else {})
    env.setdefault("FERRY_BIND_ADDRESS", "127.0.0.1")
    cmd = [sys.executable, "-m", "ferry.nixl", str(SCRIPT)]
    target = subprocess.Popen(cmd + ["target"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True, env=env)
    try:
        t = bench_line(target)
        run = subprocess.run(cmd + ["run", t["metadata"], str(t["buffer"]), str(block),
                                    "--blocks", str(blocks), "--bytes", str(total)],
                             stdout=subprocess.PIPE, text=True, env=env, check=True)
        line = next(l for l in run.stdout.splitlines() if l.startswith("BENCH "))
        return json.loads(line[len("BENCH "):])["gbps"]
    finally:
        target.stdin.close()
        target.wait(timeout=60)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--block", type=int, default=64 << 10)
    p.add_argument("--blocks", type=int, default=64)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--bytes", type=int, default=512 << 20)
    args = p.parse_args()
    ratios, offs, ons = [], [], []
    for r in range(args.rounds):
        got = {}
        for on in ((False, True) if r % 2 == 0 else (True, False)):
            got[on] = once(on, args.block, args.blocks, args.bytes)
        offs.append(got[False])
        ons.append(got[True])
        ratios.append(got[True] / got[False])
        print(f"round {r + 1}: off {got[False]:.3f} GB/s, on {got[True]:.3f} GB/s, "
              f"on/off {ratios[-1]:.3f}", flush=True)
    print(json.dumps({
        "block": args.block, "blocks": args.blocks, "rounds": args.rounds,
        "off_median_gbps": statistics.median(offs), "on_median_gbps": statistics.median(ons),
        "ratio_median": statistics.median(ratios), "ratio_min": min(ratios),
        "ratio_max": max(ratios),
        "ratio_of_medians": statistics.median(ons) / statistics.median(offs)}))


if __name__ == "__main__":
    main()
