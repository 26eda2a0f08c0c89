"""``python -m ferry bench``: READ or WRITE throughput and op latency through the Python API.

It mirrors ``ferry bench`` (the Rust CLI): the same options and defaults, the same engine
settings (1 MiB chunks, 4 MiB socket buffers, ``depth`` ops in flight, local buffers cycling
through no more memory than the remote segment), and the same JSON report, so that
``cargo xtask bench python`` can run both against one ``ferry serve`` and compare. Without a
peer it serves a segment from an engine in this process (on loopback).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import deque

import ferry

_UNITS = {
    "": 1, "b": 1, "k": 1 << 10, "ki": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mi": 1 << 20,
    "mib": 1 << 20, "g": 1 << 30, "gi": 1 << 30, "gib": 1 << 30, "t": 1 << 40, "ti": 1 << 40,
    "tib": 1 << 40,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
}
_MAX_SIZE = 1 << 60
_DURATION_UNITS = {"": 1.0, "s": 1.0, "ms": 1e-3, "m": 60.0, "min": 60.0, "h": 3600.0}


def parse_size(s: str) -> int:
    """A byte size: ``4096``, ``64KiB``, ``1MiB``, ``8GiB``, ``1.5GB`` (the rules of ``ferry``'s
    flags: no negatives, no fractions of a byte, nothing above 1 EiB)."""
    t = s.strip()
    if t.startswith("-"):
        raise argparse.ArgumentTypeError("a size cannot be negative")
    i = 0
    while i < len(t) and (t[i].isdigit() or t[i] == "."):
        i += 1
    num, unit = t[:i], t[i:].strip().lower()
    if not num or unit not in _UNITS:
        raise argparse.ArgumentTypeError(f"bad size {s!r} (use B, KiB, MiB, GiB, TiB, KB, MB, GB, TB)")
    try:
        value = float(num) * _UNITS[unit] if "." in num else int(num) * _UNITS[unit]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{num!r} is not a number") from None
    if value > _MAX_SIZE:
        raise argparse.ArgumentTypeError(f"{t} is more than 1 EiB: not a size any machine has")
    if _UNITS[unit] == 1 and value != int(value):
        raise argparse.ArgumentTypeError(f"{t} is not a whole number of bytes")
    return round(value)


def nonzero_size(s: str) -> int:
    """A byte size of at least one byte."""
    n = parse_size(s)
    if n == 0:
        raise argparse.ArgumentTypeError("must be at least 1 byte")
    return n


def count(s: str) -> int:
    """A whole number of at least one."""
    try:
        n = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError("must be a whole number (at least 1)") from None
    if n < 1:
        raise argparse.ArgumentTypeError("must be at least 1")
    return n


def positive_duration(s: str) -> float:
    """A duration in seconds: ``10s``, ``1.5s``, ``500ms``, ``2m``, or a bare number of seconds."""
    t = s.strip()
    i = 0
    while i < len(t) and (t[i].isdigit() or t[i] in ".-+"):
        i += 1
    num, unit = t[:i], t[i:].strip()
    if unit not in _DURATION_UNITS:
        raise argparse.ArgumentTypeError(f"unknown duration unit {unit!r} (use ms, s, m or h)")
    try:
        v = float(num) * _DURATION_UNITS[unit]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{t!r} is not a duration (e.g. 10s, 1.5s, 500ms)") from None
    if not v > 0 or v == float("inf"):
        raise argparse.ArgumentTypeError("must be longer than zero")
    return v


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m ferry bench", description=__doc__.splitlines()[0])
    p.add_argument("peer", nargs="?", help="a `ferry serve` peer (HOST:PORT); default: loopback")
    p.add_argument("--segment", default="bench", help="the peer's segment to use")
    p.add_argument("--transport", default="auto", choices=["auto", "tcp", "uring"])
    p.add_argument("--op", default="write", choices=["read", "write"])
    p.add_argument("--op-size", type=nonzero_size, default=1 << 20)
    g = p.add_mutually_exclusive_group()
    g.add_argument("--total", type=nonzero_size, help="bytes to move [default: 4GiB]")
    g.add_argument("--duration", type=positive_duration, help="how long to run instead (10s, 500ms)")
    p.add_argument("--streams", type=count, default=1)
    p.add_argument("--depth", type=count, default=8, help="ops in flight")
    p.add_argument("--chunk-size", type=nonzero_size, default=1 << 20)
    p.add_argument("--socket-buffer", default="4MiB", help="bytes, or auto")
    p.add_argument("--segment-size", type=nonzero_size, help="loopback: the served segment's size")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def _percentile(sorted_us: list[float], q: float) -> float:
    if not sorted_us:
        return 0.0
    return sorted_us[min(len(sorted_us) - 1, int(q * len(sorted_us)))]


class _Refused(Exception):
    """Arguments that are wrong together (the CLI refuses them the same way, exit 1)."""


def _streams(n: int) -> str:
    return f"{n} stream" if n == 1 else f"{n} streams"


def run(args: argparse.Namespace) -> dict:
    """Runs the benchmark described by ``args``; returns the report as a dict."""
    if args.op_size <= 0:
        raise SystemExit("--op-size must be at least 1 byte")
    if args.total is not None and args.total < args.op_size:
        raise _Refused(
            f"--total {args.total} is less than one request: --op-size {args.op_size} = "
            f"{args.op_size} bytes"
        )
    depth, streams = args.depth, args.streams
    socket_buffer = 0 if args.socket_buffer == "auto" else parse_size(args.socket_buffer)
    settings = dict(
        data_plane=args.transport,
        streams=streams,
        chunk_size=max(1, args.chunk_size),
        socket_buffer=socket_buffer,
        io_threads=0,
        dead_peer_after=30.0,
    )
    server = served = None
    addr = args.peer
    if addr is None:
        seg_len = max(args.segment_size or args.op_size * depth, args.op_size * streams)
        server = ferry.Engine("127.0.0.1:0", **settings)
        # READs take their payload from here: real bytes, not the zero page.
        served = server.register(
            bytearray(os.urandom(seg_len)), name=args.segment, access="read+write"
        )
        addr = server.listen_addr
    engine = ferry.Engine(depth=max(2, depth), **settings)
    peer = engine.connect(addr)
    remote = peer.segment(args.segment)
    if len(remote) < args.op_size:
        raise SystemExit(f"segment {args.segment!r} has {len(remote)} bytes, fewer than one op")
    slots_remote = max(1, len(remote) // args.op_size)
    slots_local = min(slots_remote, depth)
    local = engine.register(bytearray(os.urandom(args.op_size * slots_local)), name="bench-local")
    total = args.total if args.total is not None else (None if args.duration else 4 << 30)
    budget = None if total is None else -(-total // args.op_size)
    start_op = engine.read if args.op == "read" else engine.write
    op_size = args.op_size

    lat_us: list[float] = []
    inflight: deque = deque()
    n = 0
    start = time.perf_counter()
    deadline = None if args.duration is None else start + args.duration

    def more() -> bool:
        if budget is not None and n >= budget:
            return False
        return deadline is None or time.perf_counter() < deadline

    while len(inflight) < depth and more():
        req = start_op(
            local, remote, local_offset=(n % slots_local) * op_size,
            remote_offset=(n % slots_remote) * op_size, length=op_size,
        )
        inflight.append((time.perf_counter(), req))
        n += 1
    while inflight:
        t0, req = inflight.popleft()
        outcome = req.wait()
        if not outcome.ok:
            outcome.raise_for_failure()
        lat_us.append((time.perf_counter() - t0) * 1e6)
        if more():
            req = start_op(
                local, remote, local_offset=(n % slots_local) * op_size,
                remote_offset=(n % slots_remote) * op_size, length=op_size,
            )
            inflight.append((time.perf_counter(), req))
            n += 1
    seconds = time.perf_counter() - start
    moved = len(lat_us) * op_size
    lat_us.sort()
    report = {
        "transport": peer.transport,
        "op": args.op,
        "op_bytes": op_size,
        "total_bytes": moved,
        "seconds": seconds,
        "gb_per_s": moved / seconds / 1e9,
        "ops_per_s": len(lat_us) / seconds,
        "p50_us": _percentile(lat_us, 0.50),
        "p99_us": _percentile(lat_us, 0.99),
        "streams": streams,
        "depth": depth,
        "peer": args.peer or "loopback",
    }
    local.close()
    if served is not None:
        served.close()
        server.shutdown()
    return report


def main(argv: list[str] | None = None) -> int:
    """``python -m ferry bench [options]``; returns the exit status."""
    args = _parser().parse_args(argv)
    try:
        r = run(args)
    except (ferry.FerryError, _Refused) as e:
        # As `ferry bench` says it: one line (one JSON object under --json), no traceback.
        kind = "connection_refused" if "Connection refused" in str(e) else "error"
        if args.json:
            print(json.dumps({"error": {"kind": kind, "message": str(e), "hint": None}}))
        print(f"ferry: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("ferry: stopped by SIGINT", file=sys.stderr)
        return 130
    if args.json:
        print(json.dumps(r))
    else:
        print(
            f"{r['transport']} {r['op']} {r['op_bytes']} B ops over {r['peer']} (python): "
            f"{r['gb_per_s']:.3f} GB/s, {r['ops_per_s']:.0f} ops/s, p50 {r['p50_us']:.0f} us, "
            f"p99 {r['p99_us']:.0f} us ({r['total_bytes']} bytes in {r['seconds']:.3f} s, "
            f"{_streams(r['streams'])}, depth {r['depth']})"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
