"""A Mooncake-API peer in its own process, for the conformance tests (``test_mooncake.py``).

``python mooncake_peer.py HOSTNAME METADATA SIZE`` initializes ``ferry.mooncake.TransferEngine``
as ``HOSTNAME`` with ``METADATA`` (``P2PHANDSHAKE``, ``http://...`` or ``etcd://...``), allocates
a managed buffer of ``SIZE`` bytes, and prints one JSON line ``{"name", "buffer", "port"}``
(``name`` is what peers call it). Then it answers commands on stdin, one per line:

- ``fill SEED``: fills the buffer with ``pattern(SIZE, SEED)``; prints ``ok``.
- ``check SEED``: prints ``ok`` when the buffer holds ``pattern(SIZE, SEED)``, else ``bad``.
- ``hex OFFSET LEN``: prints the bytes there in hex.
- ``register SIZE``: registers a new host buffer of SIZE bytes (ctypes) and prints its address.
- ``quit``: closes the engine and exits.
"""

import ctypes
import json
import sys

from ferry.mooncake import TransferEngine


def pattern(n: int, seed: int) -> bytes:
    """``n`` bytes from ``seed``, the same in every process."""
    import random

    return random.Random(seed).randbytes(n)


def main() -> None:
    hostname, meta, size = sys.argv[1], sys.argv[2], int(sys.argv[3])
    te = TransferEngine()
    if te.initialize(hostname, meta, "tcp", "") != 0:
        print(json.dumps({"error": str(te.last_error())}), flush=True)
        sys.exit(1)
    name = hostname if meta != "P2PHANDSHAKE" else f"{hostname.rsplit(':', 1)[0]}:{te.get_rpc_port()}"
    buf = te.allocate_managed_buffer(size)
    extra = []
    print(json.dumps({"name": name, "buffer": buf, "port": te.get_rpc_port()}), flush=True)
    for line in sys.stdin:
        cmd = line.split()
        if not cmd:
            continue
        if cmd[0] == "fill":
            te.write_bytes_to_buffer(buf, pattern(size, int(cmd[1])), size)
            print("ok", flush=True)
        elif cmd[0] == "check":
            ok = te.read_bytes_from_buffer(buf, size) == pattern(size, int(cmd[1]))
            print("ok" if ok else "bad", flush=True)
        elif cmd[0] == "hex":
            print(te.read_bytes_from_buffer(buf + int(cmd[1]), int(cmd[2])).hex(), flush=True)
        elif cmd[0] == "register":
            b = ctypes.create_string_buffer(int(cmd[1]))
            extra.append(b)
            rc = te.register_memory(ctypes.addressof(b), int(cmd[1]), "cpu:0")
            print(ctypes.addressof(b) if rc == 0 else rc, flush=True)
        elif cmd[0] == "quit":
            break
    te.close()


if __name__ == "__main__":
    main()
