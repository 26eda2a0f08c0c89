"""A NIXL-API agent in its own process, for the conformance tests (``test_nixl.py``).

``python nixl_peer.py NAME SIZE [LISTEN_PORT]`` makes ``ferry.nixl.nixl_agent(NAME)`` (with
``enable_listen_thread`` on LISTEN_PORT when given), registers a NumPy buffer of SIZE bytes and
prints one JSON line ``{"metadata": hex, "buffer": address, "port": ...}``. Then, one command
per line on stdin:

- ``fill SEED`` / ``check SEED``: fill the buffer with ``pattern(SIZE, SEED)`` / print ``ok`` when
  it holds it (else ``bad``);
- ``wait TAG SEED``: wait for a notification starting with TAG, then print ``ok`` when the buffer
  already holds ``pattern(SIZE, SEED)`` (the notification came after the transfer's bytes);
- ``notifs``: print the notifications that arrived, as JSON {agent: [hex, ...]};
- ``quit``: deregister and exit.
"""

import json
import sys

import numpy as np

from ferry.nixl import nixl_agent, nixl_agent_config


def pattern(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=n, dtype=np.uint8)


def main() -> None:
    name, size = sys.argv[1], int(sys.argv[2])
    if len(sys.argv) > 3:
        cfg = nixl_agent_config(enable_listen_thread=True, listen_port=int(sys.argv[3]))
    else:
        cfg = nixl_agent_config(capture_telemetry=True)
    agent = nixl_agent(name, cfg)
    buf = np.zeros(size, dtype=np.uint8)
    reg = agent.register_memory([(buf.ctypes.data, size, 0, "")], "DRAM")
    print(json.dumps({"metadata": agent.get_agent_metadata().hex(), "buffer": buf.ctypes.data,
                      "port": int(agent._addr.rsplit(":", 1)[1])}), flush=True)
    for line in sys.stdin:
        cmd = line.split()
        if not cmd:
            continue
        if cmd[0] == "fill":
            buf[:] = pattern(size, int(cmd[1]))
            print("ok", flush=True)
        elif cmd[0] == "check":
            print("ok" if np.array_equal(buf, pattern(size, int(cmd[1]))) else "bad", flush=True)
        elif cmd[0] == "wait":
            tag = cmd[1].encode()
            while True:
                got = [m for ms in agent.get_new_notifs().values() for m in ms if m.startswith(tag)]
                if got:
                    break
            print("ok" if np.array_equal(buf, pattern(size, int(cmd[2]))) else "bad", flush=True)
        elif cmd[0] == "notifs":
            notifs = agent.get_new_notifs()
            print(json.dumps({k: [m.hex() for m in v] for k, v in notifs.items()}), flush=True)
        elif cmd[0] == "quit":
            break
    agent.deregister_memory(reg)


if __name__ == "__main__":
    main()
