"""The NIXL API workload, for ``cargo xtask bench nixl``: the same file runs on NIXL's own wheel
(``python nixl_bench.py ...``) and on Ferry's (``python -m ferry.nixl nixl_bench.py ...``),
since it only imports ``nixl._api``.

    nixl_bench.py target                          # registers a buffer; prints {"metadata", "buffer"}
    nixl_bench.py run METADATA_HEX BUFFER BLOCK [--blocks 64] [--bytes N] [--op READ|WRITE]
    nixl_bench.py memcpy BLOCK [--blocks 64] [--bytes N]   # one core's memcpy of the same blocks

Results are the stdout lines that start with ``BENCH `` (NIXL logs to stdout too). ``run`` prepares the local and remote lists of ``--blocks`` blocks once, makes one READ of all
of them by index (the KV-cache pattern of vLLM's NixlConnector), then posts it and polls
``check_xfer_state`` until it is done, again and again, until ``--bytes`` moved; it prints one
JSON line with the rate. Both ends use NIXL's default backend list (UCX); which transports UCX
uses is ``UCX_TLS``'s to say.
"""

import argparse
import json
import os
import sys
import time

import numpy as np
from nixl._api import nixl_agent, nixl_agent_config

SPAN = 64 << 20


def done() -> None:
    sys.stdout.flush()
    # NIXL 1.5.1's UCX agent crashes at interpreter exit; leave without tearing down.
    os._exit(0)


def target() -> None:
    agent = nixl_agent("bench-target", nixl_agent_config())
    buf = np.ones(SPAN, dtype=np.uint8)
    agent.register_memory([(buf.ctypes.data, SPAN, 0, "")], "DRAM")
    print("BENCH " + json.dumps({"metadata": agent.get_agent_metadata().hex(), "buffer": buf.ctypes.data}), flush=True)
    sys.stdin.read()  # until the driver closes our stdin
    done()


def run(args) -> None:
    agent = nixl_agent("bench-initiator", nixl_agent_config())
    n, block = args.blocks, args.block
    if n * block > SPAN:
        sys.exit(f"{n} blocks of {block} bytes do not fit in {SPAN} bytes")
    # A WRITE sends the target's own value, so that a READ after it still checks its bytes.
    buf = (np.ones if args.op == "WRITE" else np.zeros)(SPAN, dtype=np.uint8)
    agent.register_memory([(buf.ctypes.data, SPAN, 0, "")], "DRAM")
    name = agent.add_remote_agent(bytes.fromhex(args.metadata))
    local = agent.prep_xfer_dlist("NIXL_INIT_AGENT", [(buf.ctypes.data + i * block, block, 0) for i in range(n)], "DRAM")
    remote = agent.prep_xfer_dlist(name, [(args.buffer + i * block, block, 0) for i in range(n)], "DRAM")
    ids = np.arange(n, dtype=np.int64)
    handle = agent.make_prepped_xfer(args.op, local, ids, remote, ids)

    def once() -> None:
        state = agent.transfer(handle)
        while state == "PROC":
            state = agent.check_xfer_state(handle)
        if state != "DONE":
            sys.exit(f"transfer ended {state}")

    once()  # warm-up: connects
    per = n * block
    rounds = max(1, args.bytes // per)
    t0 = time.perf_counter()
    for _ in range(rounds):
        once()
    dt = time.perf_counter() - t0
    if args.op == "READ" and not (buf[:per] == 1).all():
        sys.exit("the READ did not bring the target's bytes")
    print("BENCH " + json.dumps({"block": block, "blocks": n, "bytes": rounds * per, "seconds": dt,
                      "gbps": rounds * per / dt / 1e9}), flush=True)
    done()


def memcpy(args) -> None:
    """The same blocks copied by this process, one core (numpy's copy is a memcpy)."""
    n, block = args.blocks, args.block
    src = np.ones(SPAN, dtype=np.uint8)
    dst = np.zeros(SPAN, dtype=np.uint8)
    per = n * block
    rounds = max(1, args.bytes // per)
    np.copyto(dst[:per], src[:per])  # warm-up: faults the pages in
    t0 = time.perf_counter()
    for _ in range(rounds):
        for i in range(n):
            np.copyto(dst[i * block:(i + 1) * block], src[i * block:(i + 1) * block])
    dt = time.perf_counter() - t0
    print("BENCH " + json.dumps({"block": block, "blocks": n, "bytes": rounds * per, "seconds": dt,
                      "gbps": rounds * per / dt / 1e9}), flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("target")
    r = sub.add_parser("run")
    r.add_argument("metadata")
    r.add_argument("buffer", type=int)
    r.add_argument("block", type=int)
    r.add_argument("--blocks", type=int, default=64)
    r.add_argument("--bytes", type=int, default=1 << 30)
    r.add_argument("--op", choices=["READ", "WRITE"], default="READ")
    m = sub.add_parser("memcpy")
    m.add_argument("block", type=int)
    m.add_argument("--blocks", type=int, default=64)
    m.add_argument("--bytes", type=int, default=1 << 30)
    args = p.parse_args()
    if args.cmd == "target":
        target()
    elif args.cmd == "memcpy":
        memcpy(args)
    else:
        run(args)


if __name__ == "__main__":
    main()
