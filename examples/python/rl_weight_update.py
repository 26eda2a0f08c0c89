"""The RL weight update, end to end: one trainer process and three inference processes.

    python examples/python/rl_weight_update.py [--rounds 3] [--mb 32] [--etcd [etcd://HOST:PORT]]

The weights start as a ``.safetensors`` file written by PyPI's ``safetensors``; the trainer and
every inference process load it into NumPy arrays. Each round, the trainer changes its
weights (a training step, into new arrays so the version before stays servable) and publishes
the next version with ``ferry.broadcast.Publisher.publish``; the three inference processes pull
it at the same time, relaying to one another: two straight into the arrays they serve from
(``mode="in_place"``), one into a staging copy it then commits (``mode="staged"``). Every
inference process hashes every tensor and the parent checks the hashes against the trainer's.
It prints one row per round: version; seconds from the slowest receiver's first fetch to its
last verified chunk, and the payload GB/s over that; the staged receiver's commit time; the
share of received bytes that came from relays; and the longest ``pull()`` call (joining, and
lingering to serve receivers behind it, included).

With ``--etcd`` the processes meet in a real etcd instead of being handed the trainer's
address: the trainer publishes with ``discovery="etcd://HOST:PORT"`` and the inference
processes pull ``etcd://HOST:PORT/policy``. ``--etcd`` alone starts a throwaway etcd on
loopback ports (the ``etcd`` binary, Debian's ``etcd-server``); ``--etcd etcd://HOST:PORT``
uses a running one. Anyone who can write etcd could list a trainer there, so every pull is
bound to the trainer by the manifest digest it prints with each version
(``expect_manifest=``; a keyring, ``auth_key_file=``, would do as well).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

import ferry
from ferry.broadcast import Publisher, held, pull

NAME = "policy"


def shapes(mb: int) -> dict[str, tuple[int, ...]]:
    """Eight layers' worth of float32 tensors of about ``mb`` MiB in all."""
    per_layer = (mb << 20) // 8 // 4
    side = max(16, int((per_layer // 3) ** 0.5))
    out: dict[str, tuple[int, ...]] = {"embed.weight": (256, side)}
    for i in range(8):
        out[f"layers.{i}.attn.qkv"] = (side, side)
        out[f"layers.{i}.mlp.up"] = (side, 2 * side)
        out[f"layers.{i}.norm"] = (side,)
    return out


def digest(ws: dict[str, np.ndarray]) -> dict[str, str]:
    return {k: hashlib.sha256(np.ascontiguousarray(v).tobytes()).hexdigest()[:16] for k, v in ws.items()}


def send(proc: subprocess.Popen, msg: dict) -> None:
    assert proc.stdin is not None
    proc.stdin.write(json.dumps(msg) + "\n")
    proc.stdin.flush()


def recv(proc: subprocess.Popen) -> dict:
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line:
        raise SystemExit(f"a worker ({proc.args[2]}) exited: {proc.wait()}")
    return json.loads(line)


@contextlib.contextmanager
def local_etcd():
    """A throwaway etcd on loopback ports, its data in a temporary directory: yields
    ``etcd://127.0.0.1:PORT`` once it accepts connections."""
    binary = shutil.which("etcd")
    if binary is None:
        raise SystemExit("--etcd needs the etcd binary (Debian: apt-get install etcd-server), or give etcd://HOST:PORT")
    ports = []
    for _ in range(2):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
    client, peer = (f"http://127.0.0.1:{p}" for p in ports)
    with tempfile.TemporaryDirectory() as data, tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(
            [binary, "--data-dir", data, "--name", "example",
             "--listen-client-urls", client, "--advertise-client-urls", client,
             "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
             "--initial-cluster", f"example={peer}"],
            stdout=subprocess.DEVNULL,
            stderr=log,
        )
        try:
            deadline = time.monotonic() + 20
            while True:
                if proc.poll() is not None:
                    raise SystemExit(f"etcd exited with {proc.returncode}")
                try:
                    socket.create_connection(("127.0.0.1", ports[0]), timeout=1).close()
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        raise SystemExit("etcd did not listen within 20 s") from None
                    time.sleep(0.05)  # polling for its listener
            yield f"etcd://127.0.0.1:{ports[0]}"
        finally:
            proc.kill()
            proc.wait()


def trainer(path: str, etcd: str | None) -> None:
    from safetensors.numpy import load_file

    engine = ferry.Engine(listen="127.0.0.1:0")
    weights = load_file(path)
    pub = Publisher(engine, weights, name=NAME, version=1, chunk_size=1 << 20, discovery=etcd)
    # With etcd the receivers are given the etcd address and find the trainer there.
    source = pub.etcd_source or pub.addr
    # The manifest's digest binds each pull to this trainer (from etcd, a pull needs it).
    print(json.dumps({"addr": source, "version": 1, "hashes": digest(weights), "manifest": pub.digest}), flush=True)
    for line in sys.stdin:
        msg = json.loads(line)
        if msg["op"] == "quit":
            break
        # A training step: new arrays, so that the version still being pulled stays intact.
        rng = np.random.default_rng(msg["version"])
        weights = {k: v + rng.standard_normal(v.shape, dtype=np.float32) * 0.01 for k, v in weights.items()}
        pub.publish(weights, msg["version"])
        print(json.dumps({"version": msg["version"], "hashes": digest(weights), "manifest": pub.digest}), flush=True)
    pub.close()


def inference(path: str, mode: str) -> None:
    from safetensors.numpy import load_file

    engine = ferry.Engine(listen="127.0.0.1:0")
    live = load_file(path)  # the arrays this process "serves" from
    staging = {k: np.empty_like(v) for k, v in live.items()} if mode == "staged" else None
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        msg = json.loads(line)
        if msg["op"] == "quit":
            break
        t = time.perf_counter()
        s = pull(
            engine,
            msg["addr"],
            live,
            name=NAME,
            version=msg["version"],
            mode=mode,
            staging=staging,
            timeout=120,
            expect_manifest=msg["manifest"],
        )
        pulled = time.perf_counter() - t
        commit = s.commit() if mode == "staged" else 0.0
        versions = {held(v) for v in live.values()}
        print(
            json.dumps(
                {
                    "version": s.version,
                    "held": sorted(versions),
                    "seconds": s.seconds,
                    "wall": pulled,
                    "commit": commit,
                    "bytes": s.bytes,
                    "from_relays": s.from_relays,
                    "hashes": digest(live),
                }
            ),
            flush=True,
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--mb", type=int, default=32, help="payload size in MiB")
    ap.add_argument(
        "--etcd",
        nargs="?",
        const="start",
        metavar="etcd://HOST:PORT",
        help="meet in etcd: this one, or (no value) a throwaway etcd started here",
    )
    args = ap.parse_args()
    from safetensors.numpy import save_file

    with contextlib.ExitStack() as stack:
        etcd = args.etcd
        if etcd == "start":
            etcd = stack.enter_context(local_etcd())
        if etcd is not None:
            print(f"etcd: {etcd}", flush=True)
        run(args, etcd, save_file)


def run(args: argparse.Namespace, etcd: str | None, save_file) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = str(Path(tmp) / "policy.safetensors")
        rng = np.random.default_rng(0)
        save_file({k: rng.standard_normal(s, dtype=np.float32) for k, s in shapes(args.mb).items()}, path)
        me = [sys.executable, __file__]
        spawn = lambda *a: subprocess.Popen([*me, *a], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)  # noqa: E731
        t = spawn("trainer", path, *([etcd] if etcd else []))
        modes = ["in_place", "in_place", "staged"]
        workers = [spawn("inference", path, m) for m in modes]
        try:
            first = recv(t)
            addr = first["addr"]
            for w in workers:
                recv(w)
            payload = 0
            print(
                f"{'round':>5} {'version':>7} {'seconds':>8} {'GB/s':>6} {'commit s':>9} "
                f"{'relayed':>8} {'wall s':>7}"
            )
            for rnd in range(1, args.rounds + 1):
                version = rnd + 1
                send(t, {"op": "publish", "version": version})
                published = recv(t)
                want = published["hashes"]
                for w in workers:
                    send(w, {"op": "pull", "addr": addr, "version": version, "manifest": published["manifest"]})
                got = [recv(w) for w in workers]
                seconds = max(g["seconds"] for g in got)
                wall = max(g["wall"] for g in got)
                for mode, g in zip(modes, got):
                    assert g["version"] == version and g["held"] == [version], (mode, g)
                    bad = [k for k in want if g["hashes"].get(k) != want[k]]
                    assert not bad, f"{mode} receiver: tensors differ from the trainer's: {bad}"
                payload = got[0]["bytes"]
                relayed = sum(g["from_relays"] for g in got) / (3 * payload)
                commit = got[2]["commit"]
                print(
                    f"{rnd:>5} {version:>7} {seconds:>8.3f} {payload / seconds / 1e9:>6.2f} "
                    f"{commit:>9.4f} {relayed:>8.0%} {wall:>7.3f}",
                    flush=True,
                )
            print(f"every tensor of every round matched the trainer's ({payload / 1e6:.1f} MB, 3 receivers)")
        finally:
            for p in [t, *workers]:
                try:
                    send(p, {"op": "quit"})
                except (BrokenPipeError, OSError):
                    pass
            for p in [t, *workers]:
                p.wait(timeout=60)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "trainer":
        trainer(sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else None)
    elif len(sys.argv) > 1 and sys.argv[1] == "inference":
        inference(sys.argv[2], sys.argv[3])
    else:
        main()
