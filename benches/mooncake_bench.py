"""The Mooncake API workload, for ``cargo xtask bench mooncake``: the same file runs on
Mooncake's own wheel (``python mooncake_bench.py ...``) and on Ferry's
(``python -m ferry.mooncake mooncake_bench.py ...``), since it only imports ``mooncake.engine``.

    mooncake_bench.py target                       # serves a buffer; prints {"name", "buffer"}
    mooncake_bench.py run NAME BUFFER OP BLOCK [--blocks 32] [--bytes N]
    mooncake_bench.py small NAME BUFFER [--ops N]  # one-block 4 KiB transfer_sync_write

``run`` loops ``batch_transfer_sync_{write,read}`` of ``--blocks`` blocks of BLOCK bytes (one
call per batch, as vLLM's and SGLang's connectors do) until ``--bytes`` moved, and prints one
JSON line with the rate. ``small`` times one-block 4 KiB ``transfer_sync_write`` calls and, on
Ferry, the same WRITE through Ferry's own Python API, and prints both (microseconds per op).
Both ends use P2PHANDSHAKE and TCP (``MC_FORCE_TCP=1`` for Mooncake).
"""

import argparse
import json
import sys
import time

from mooncake.engine import TransferEngine

SPAN = 64 << 20  # the target's buffer, and the initiator's


def init() -> TransferEngine:
    te = TransferEngine()
    if te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0:
        sys.exit("initialize failed")
    return te


def target() -> None:
    te = init()
    buf = te.allocate_managed_buffer(SPAN)
    print(json.dumps({"name": f"127.0.0.1:{te.get_rpc_port()}", "buffer": buf}), flush=True)
    sys.stdin.read()  # until the driver closes our stdin


def run(args) -> None:
    te = init()
    buf = te.allocate_managed_buffer(SPAN)
    n = args.blocks
    if n * args.block > SPAN:
        sys.exit(f"{n} blocks of {args.block} bytes do not fit in {SPAN} bytes")
    locs = [buf + i * args.block for i in range(n)]
    rems = [args.buffer + i * args.block for i in range(n)]
    lens = [args.block] * n
    call = te.batch_transfer_sync_write if args.op == "write" else te.batch_transfer_sync_read
    # One warm-up batch (connects, fills caches).
    if call(args.name, locs, rems, lens) != 0:
        sys.exit("warm-up batch failed")
    per = n * args.block
    rounds = max(1, args.bytes // per)
    t0 = time.perf_counter()
    for _ in range(rounds):
        if call(args.name, locs, rems, lens) != 0:
            sys.exit("batch failed")
    dt = time.perf_counter() - t0
    print(json.dumps({"op": args.op, "block": args.block, "blocks": n, "bytes": rounds * per,
                      "seconds": dt, "gbps": rounds * per / dt / 1e9}), flush=True)


def small(args) -> None:
    te = init()
    buf = te.allocate_managed_buffer(1 << 20)
    if te.transfer_sync_write(args.name, buf, args.buffer, 4096) != 0:
        sys.exit("warm-up write failed")
    out = {}
    t0 = time.perf_counter()
    for _ in range(args.ops):
        te.transfer_sync_write(args.name, buf, args.buffer, 4096)
    out["mooncake_api_us"] = (time.perf_counter() - t0) / args.ops * 1e6
    try:
        import ferry
    except ImportError:
        ferry = None
    if ferry is not None and getattr(sys.modules.get("mooncake"), "__ferry__", False):
        # The same WRITE through Ferry's own Python API, to the same peer and address.
        eng = ferry.Engine()
        src = bytearray(4096)
        reg = eng.register(src)
        peer = eng.connect(args.name)
        # The target's one registration (``raw#<id>/<location>``: its name carries no
        # address), which holds ``args.buffer``.
        seg = next(peer.segment(s["name"]) for s in peer.segments
                   if s["name"].startswith("raw#"))
        eng.write(reg, seg, length=4096).wait()
        t0 = time.perf_counter()
        for _ in range(args.ops):
            eng.write(reg, seg, length=4096).wait()
        out["ferry_api_us"] = (time.perf_counter() - t0) / args.ops * 1e6
    print(json.dumps(out), flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("target")
    r = sub.add_parser("run")
    r.add_argument("name")
    r.add_argument("buffer", type=int)
    r.add_argument("op", choices=["write", "read"])
    r.add_argument("block", type=int)
    r.add_argument("--blocks", type=int, default=32)
    r.add_argument("--bytes", type=int, default=2 << 30)
    s = sub.add_parser("small")
    s.add_argument("name")
    s.add_argument("buffer", type=int)
    s.add_argument("--ops", type=int, default=5000)
    args = p.parse_args()
    {"target": lambda: target(), "run": lambda: run(args), "small": lambda: small(args)}[args.cmd]()


if __name__ == "__main__":
    main()
