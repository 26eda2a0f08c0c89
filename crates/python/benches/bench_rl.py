"""RL weight sync on one host: 1 trainer to N receivers (docs/rl.md, *The bench*; figures in
docs/performance.md). Run by ``cargo xtask bench rl`` with the frameworks environment's
interpreter (verl 0.9.1, torch).

Rows, in alternating rounds (one of each per round, so a drift of the shared machine's speed
lands on all of them alike):

- ``ideal``: ``ferry.verl`` with one receiver alone (the trainer to one rollout worker);
- ``verl``: ``ferry.verl`` with N receivers (Ferry's broadcast: every receiver relays what it
  verified);
- ``chain``: a point-to-point chain over ``ferry.mooncake`` as verl's mooncake engine moves
  weights: rank i reads each bucket from rank i-1 once rank i-1 has it (RDMA-style reads into
  buffers registered beforehand, no verification), pipelined by bucket;
- ``vllm``: ``ferry.vllm`` to N receivers through vLLM's own weight-transfer engines, in place
  (``bench_rl_vllm.py``, run in vLLM's environment ``target/vllm-venv``; without it the row
  says it is missing).

Every receiver and chain rank is a process of its own; the trainer is this one. The payload is
``--mib`` MiB of bf16 weights in tensors of ``--tensor-mib`` MiB; buckets are ``--bucket-mib``
(verl's default, 2048: one bucket for 1 GiB). A row's time runs from the trainer's start until
the last receiver holds every byte (verl: ``receive_weights`` ended; chain: the last rank's
last read). Efficiency is ideal / time; "x chain" is chain / time. Each receiver's first and
last bytes of every tensor are checked after the round (outside the timing); ``ferry.verl``'s
receivers also verify every chunk against the manifest (BLAKE3), which the chain does not.
The ``ideal`` and ``verl`` rows also print the CPU seconds (all threads, ``time.process_time``)
of the trainer's process (from its start until every receiver answered: publishing, the
manifest's checksums, serving) and of each receiver's (until its own pull ended: relaying
after that is not counted), against the CPU-seconds the round's wall time offered: on a host
with fewer cores than processes, the steering figure.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import statistics
import sys
import time

WAIT = 600.0


def _payload(mib: int, tensor_mib: int, seed: int):
    import torch

    n = max(1, mib // tensor_mib)
    elems = tensor_mib * (1 << 20) // 2
    g = torch.Generator().manual_seed(seed)
    out = {}
    for i in range(n):
        t = torch.empty(elems, dtype=torch.bfloat16)
        t[:1024] = torch.randn(1024, generator=g).to(torch.bfloat16)
        t[-1024:] = torch.randn(1024, generator=g).to(torch.bfloat16)
        out[f"layers.{i}.weight"] = t
    return out


def _sample(t) -> tuple[bytes, bytes]:
    raw = t.view(-1).view(__import__("torch").uint8)
    return bytes(raw[:2048].numpy()), bytes(raw[-2048:].numpy())


# -- the receiver processes ------------------------------------------------------------------


def worker_main(conn, rank: int, sems, bucket: int) -> None:
    """One process: a ``ferry.verl`` receiver, or chain rank ``rank`` (1..N)."""
    import numpy as np
    from verl.checkpoint_engine import CheckpointEngineRegistry
    from verl.utils.import_utils import import_external_libs

    import_external_libs("ferry.verl")
    engine = CheckpointEngineRegistry.new("ferry", bucket_size=bucket, device="cpu", timeout=WAIT)
    chain = {}
    while True:
        cmd, arg = conn.recv()
        if cmd == "stop":
            engine.shutdown()
            return
        if cmd == "prepare":
            conn.send(engine.prepare())
        elif cmd == "init":
            engine.init_process_group(**arg)
            conn.send("ok")
        elif cmd == "recv":

            async def go():
                got = {}
                async for name, t in engine.receive_weights(global_steps=arg):
                    got[name] = _sample(t)
                return got

            cpu = time.process_time()
            try:
                got = asyncio.run(go())
                conn.send(("ok", got, time.process_time() - cpu))
            except Exception as e:  # the bench reports it
                conn.send(("err", f"{type(e).__name__}: {e}", 0.0))
            engine.finalize()
        elif cmd == "chain_init":
            from ferry.mooncake import TransferEngine

            size = arg
            te = TransferEngine()
            assert te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
            buf = np.empty(size, dtype=np.uint8)
            buf[:] = 0
            ptr = buf.ctypes.data
            assert te.register_memory(ptr, size) == 0
            chain.update(te=te, buf=buf, ptr=ptr)
            conn.send((f"127.0.0.1:{te.get_rpc_port()}", ptr))
        elif cmd == "chain_run":
            prev, prev_ptr, lengths = arg
            te, ptr = chain["te"], chain["ptr"]
            off = 0
            for n in lengths:
                assert sems[rank - 1].acquire(timeout=WAIT), f"rank {rank}: rank {rank - 1} never finished a bucket"
                assert te.transfer_sync_read(prev, ptr + off, prev_ptr + off, n) == 0, te.last_error()
                off += n
                if rank < len(sems):
                    sems[rank].release()
            conn.send(("ok", time.perf_counter()))
        elif cmd == "chain_sample":
            offsets = arg
            buf = chain["buf"]
            conn.send([(bytes(buf[o : o + 2048]), bytes(buf[e - 2048 : e])) for o, e in offsets])


class Fleet:
    def __init__(self, n: int, bucket: int):
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(["verl.checkpoint_engine", "ferry.verl", "ferry.mooncake", "numpy"])
        # sems[i] is released when rank i holds one more bucket (rank 0: the trainer).
        self.sems = [ctx.Semaphore(0) for _ in range(n)]
        self.conns, self.procs = [], []
        for r in range(1, n + 1):
            mine, theirs = ctx.Pipe()
            p = ctx.Process(target=worker_main, args=(theirs, r, self.sems, bucket), daemon=True)
            p.start()
            self.conns.append(mine)
            self.procs.append(p)

    def ask(self, i: int, cmd: str, arg=None):
        self.conns[i].send((cmd, arg))

    def get(self, i: int):
        if not self.conns[i].poll(WAIT):
            raise RuntimeError(f"worker {i + 1} did not answer within {WAIT} s")
        return self.conns[i].recv()

    def close(self):
        for i, p in enumerate(self.procs):
            if p.is_alive():
                self.ask(i, "stop")
        for p in self.procs:
            p.join(30)
            if p.is_alive():
                p.kill()


# -- rows --------------------------------------------------------------------------------------


def verl_round(fleet: Fleet, trainer, weights: dict, n: int, step: int) -> tuple[float, list[float]]:
    """One ``ferry.verl`` update to the first ``n`` workers, as verl's manager drives it: its
    seconds, and the CPU seconds (all threads) the trainer's process and each receiver's spent
    in it (the trainer's: from its start until every receiver answered)."""
    meta = [trainer.prepare()]
    for i in range(n):
        fleet.ask(i, "prepare")
    meta += [fleet.get(i) for i in range(n)]
    actor, rollout = type(trainer).build_topology(1, n, meta)
    trainer.init_process_group(**{k: v[0] for k, v in actor.items()})
    for i in range(n):
        fleet.ask(i, "init", {k: v[i] for k, v in rollout.items()})
    for i in range(n):
        assert fleet.get(i) == "ok"
    t0, cpu0 = time.perf_counter(), time.process_time()
    for i in range(n):
        fleet.ask(i, "recv", step)
    asyncio.run(trainer.send_weights(iter(weights.items()), global_steps=step))
    answers = [fleet.get(i) for i in range(n)]
    took, cpu = time.perf_counter() - t0, [time.process_time() - cpu0]
    trainer.finalize()
    want = {name: _sample(t) for name, t in weights.items()}
    for i, (status, got, spent) in enumerate(answers):
        if status != "ok":
            raise RuntimeError(f"receiver {i + 1}: {got}")
        if got != want:
            raise RuntimeError(f"receiver {i + 1} holds other bytes")
        cpu.append(spent)
    return took, cpu


class Chain:
    """verl's mooncake engine's movement over ``ferry.mooncake``: rank i reads from rank i-1."""

    def __init__(self, fleet: Fleet, weights: dict, n: int, bucket: int):
        import numpy as np

        from ferry.mooncake import TransferEngine

        self.fleet, self.n = fleet, n
        flat = [t.view(-1).view(__import__("torch").uint8).numpy() for t in weights.values()]
        self.size = sum(a.nbytes for a in flat)
        self.buf = np.concatenate(flat)  # the trainer's bucket buffers, filled once
        self.te = TransferEngine()
        assert self.te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
        self.ptr = self.buf.ctypes.data
        assert self.te.register_memory(self.ptr, self.size) == 0
        self.session = f"127.0.0.1:{self.te.get_rpc_port()}"
        self.lengths = [min(bucket, self.size - o) for o in range(0, self.size, bucket)]
        self.ranks = [(self.session, self.ptr)]
        for i in range(n):
            fleet.ask(i, "chain_init", self.size)
        self.ranks += [tuple(fleet.get(i)) for i in range(n)]
        ends, off = [], 0
        for a in flat:
            ends.append((off, off + a.nbytes))
            off += a.nbytes
        self.want = [(bytes(self.buf[o : o + 2048]), bytes(self.buf[e - 2048 : e])) for o, e in ends]
        self.ends = ends

    def round(self) -> float:
        t0 = time.perf_counter()
        for i in range(self.n):
            prev, prev_ptr = self.ranks[i]
            self.fleet.ask(i, "chain_run", (prev, prev_ptr, self.lengths))
        for _ in self.lengths:  # the trainer holds every bucket
            self.fleet.sems[0].release()
        last = max(self.fleet.get(i)[1] for i in range(self.n))
        took = last - t0
        for i in range(self.n):
            self.fleet.ask(i, "chain_sample", self.ends)
            if self.fleet.get(i) != self.want:
                raise RuntimeError(f"chain rank {i + 1} holds other bytes")
        return took


_VLLM: dict = {}


def vllm_round(args, n: int, step: int) -> float | None:
    """The hook for ``ferry.vllm``: one update of the same payload through vLLM's trainer and
    worker weight-transfer engines to ``n`` receivers, its time in seconds (as
    ``verl_round``), by ``bench_rl_vllm.py`` in vLLM's environment (``target/vllm-venv``,
    started once). None: the row is reported as missing (no such environment)."""
    import subprocess
    from pathlib import Path

    here = Path(__file__).resolve().parent
    py = here.parents[2] / "target" / "vllm-venv" / "bin" / "python"
    if not py.is_file():
        return None
    if n not in _VLLM:
        cmd = [str(py), str(here / "bench_rl_vllm.py"), "serve", str(args.mib), str(args.tensor_mib), str(n)]
        p = _VLLM[n] = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        if not p.stdout.readline():
            raise RuntimeError(f"bench_rl_vllm.py exited: {p.wait()}")
    p = _VLLM[n]
    p.stdin.write("round\n")
    p.stdin.flush()
    line = p.stdout.readline()
    if not line:
        raise RuntimeError(f"bench_rl_vllm.py exited: {p.wait()}")
    return json.loads(line)["seconds"]


# -- main ----------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=1024, help="payload, MiB of bf16 (default 1024)")
    ap.add_argument("--tensor-mib", type=int, default=16, help="MiB per tensor (default 16)")
    ap.add_argument("--bucket-mib", type=int, default=2048, help="bucket size, MiB (verl's default 2048)")
    ap.add_argument("--receivers", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--modes", default="ideal,verl,chain,vllm")
    ap.add_argument("--json", help="write the rounds and medians here")
    args = ap.parse_args()
    import torch
    from verl.checkpoint_engine import CheckpointEngineRegistry
    from verl.utils.import_utils import import_external_libs

    import_external_libs("ferry.verl")
    modes = [m for m in args.modes.split(",") if m]
    n, bucket = args.receivers, args.bucket_mib << 20
    weights = _payload(args.mib, args.tensor_mib, 0)
    size = sum(t.nbytes for t in weights.values())
    print(
        f"bench rl: {size / 2**20:.0f} MiB of bf16 in {len(weights)} tensors, buckets of "
        f"{args.bucket_mib} MiB, 1 trainer to N = {n} receivers on one host, {args.rounds} rounds; "
        f"load {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs",
        flush=True,
    )
    fleet = Fleet(n, bucket)
    trainer = CheckpointEngineRegistry.new(
        "ferry", bucket_size=bucket, device="cpu", rollout_dtype=torch.bfloat16, is_master=True, timeout=WAIT
    )
    chain = Chain(fleet, weights, n, bucket) if "chain" in modes else None
    times: dict[str, list[float]] = {m: [] for m in modes}
    cpus: dict[str, list[list[float]]] = {m: [] for m in modes}
    step = 0
    try:
        for r in range(args.rounds):
            for m in modes:
                step += 1
                cpu: list[float] = []
                if m == "ideal":
                    t, cpu = verl_round(fleet, trainer, weights, 1, step)
                elif m == "verl":
                    t, cpu = verl_round(fleet, trainer, weights, n, step)
                elif m == "chain":
                    assert chain is not None
                    t = chain.round()
                elif m == "vllm":
                    t = vllm_round(args, n, step)
                    if t is None:
                        continue
                else:
                    raise SystemExit(f"no mode {m!r}")
                times[m].append(t)
                cpus[m].append(cpu)
                said = ""
                if cpu:
                    said = f"  CPU s: trainer {cpu[0]:.2f}, receivers " + " ".join(f"{c:.2f}" for c in cpu[1:])
                    said += f" (sum {sum(cpu):.2f} for {t * (os.cpu_count() or 1):.2f} CPU-s of wall time)"
                print(f"  round {r + 1} {m:<6} {t:7.3f} s  {size / t / 1e9:6.2f} GB/s{said}", flush=True)
    finally:
        fleet.close()
        trainer.shutdown()
        for p in _VLLM.values():
            p.kill()
    med = {m: statistics.median(v) for m, v in times.items() if v}
    print(f"\n| row | N | median s | GB/s (per receiver) | of ideal | x chain |")
    print("|---|---|---|---|---|---|")
    for m in modes:
        if m not in med:
            print(f"| {m} | {n} | missing (no ferry.vllm round: `vllm_round` is the hook) | | | |")
            continue
        k = 1 if m == "ideal" else n
        of_ideal = med["ideal"] / med[m] if "ideal" in med else float("nan")
        x_chain = med["chain"] / med[m] if "chain" in med else float("nan")
        print(f"| {m} | {k} | {med[m]:.3f} | {size / med[m] / 1e9:.2f} | {of_ideal:.2f} | {x_chain:.2f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"bytes": size, "receivers": n, "rounds": times, "cpu": cpus, "median": med}, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
