"""The ``vllm`` row of ``bench_rl.py``: the same payload through vLLM's own weight-transfer
engines on Ferry (``ferry.vllm``), 1 trainer to N receivers on one host.

vLLM lives in its own environment (``target/vllm-venv``, docs/rl.md), apart from the frameworks
environment ``bench_rl.py`` runs in, so ``bench_rl.vllm_round`` starts this script there once
(``serve MIB TENSOR_MIB N``) and asks it for one round at a time over a pipe: it answers each
``round`` line with ``{"seconds": ...}`` once every receiver applied the version, the time
from ``send_weights``' start to its return (the trainer publishes, every receiver pulls it in
place into its model's parameters and reports back). The receivers' first and last bytes of
every tensor are checked after each round, outside the timing. Each receiver is a process of
its own (``worker``) holding a model of the payload's shapes and the engine vLLM's
``WeightTransferEngineFactory`` made for it.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_rl import _payload, _sample  # noqa: E402  (the same payload as the other rows)


class Params:
    """A module-like holder of named tensors (``named_parameters`` is all vLLM's
    ``ModuleSource`` and the worker engine read)."""

    def __init__(self, tensors):
        self.tensors = tensors

    def named_parameters(self, *args, **kwargs):
        return iter(self.tensors.items())


def worker(mib: int, tensor_mib: int) -> None:
    import torch
    from vllm.config.parallel import ParallelConfig
    from vllm.config.weight_transfer import WeightTransferConfig
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    import ferry.vllm_plugin

    ferry.vllm_plugin.register()
    model = Params({k: torch.zeros_like(v) for k, v in _payload(mib, tensor_mib, 0).items()})
    engine = WeightTransferEngineFactory.create_engine(
        WeightTransferConfig(backend="ferry"),
        SimpleNamespace(parallel_config=ParallelConfig(), model_config=None),
        torch.device("cpu"),
        model,
    )
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        op, arg = json.loads(line)
        try:
            out = None
            if op == "init":
                engine.init_transfer_engine(engine.parse_init_info(arg))
            elif op == "start":
                engine.start_weight_update()
            elif op == "update":
                engine.update_weights(arg)
            elif op == "finish":
                engine.finish_weight_update()
            elif op == "sample":
                out = [[x.hex() for x in _sample(t)] for t in model.tensors.values()]
            print(json.dumps({"ok": True, "out": out}), flush=True)
        except Exception as e:
            print(json.dumps({"ok": False, "error": f"{type(e).__name__}: {e}"}), flush=True)


class Pipe:
    """A ``VLLMWeightSyncClient`` for one worker process."""

    def __init__(self, mib: int, tensor_mib: int):
        import subprocess

        self.proc = subprocess.Popen(
            [sys.executable, __file__, "worker", str(mib), str(tensor_mib)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    def ready(self) -> "Pipe":
        if not self.proc.stdout.readline():
            raise RuntimeError(f"a receiver exited: {self.proc.wait()}")
        return self

    def ask(self, op: str, arg=None):
        self.proc.stdin.write(json.dumps([op, arg]) + "\n")
        self.proc.stdin.flush()
        reply = json.loads(self.proc.stdout.readline() or '{"ok": false, "error": "the receiver exited"}')
        if not reply["ok"]:
            raise RuntimeError(reply["error"])
        return reply["out"]

    def init_weight_transfer_engine(self, info):
        self.ask("init", info)

    def start_weight_update(self):
        self.ask("start")

    def update_weights(self, info):
        self.ask("update", info)

    def finish_weight_update(self, weight_version=None):
        self.ask("finish")


def serve(mib: int, tensor_mib: int, n: int) -> None:
    from vllm.distributed.weight_transfer import ModuleSource
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    import ferry.vllm_plugin

    ferry.vllm_plugin.register()
    from ferry.vllm import FanoutClient, FerryTrainerInitInfo

    pipes = [Pipe(mib, tensor_mib) for _ in range(n)]
    for p in pipes:
        p.ready()
    weights = _payload(mib, tensor_mib, 0)
    want = [[x.hex() for x in _sample(t)] for t in weights.values()]
    trainer = WeightTransferTrainerFactory.trainer_init(
        FerryTrainerInitInfo(rank=0, listen="127.0.0.1:0", mode="in_place", worker_listen="127.0.0.1:0"),
        client=FanoutClient({f"r{i}": p for i, p in enumerate(pipes)}),
        source=ModuleSource(Params(weights)),
    )
    print(json.dumps({"ready": True}), flush=True)
    try:
        for line in sys.stdin:
            if line.strip() != "round":
                break
            t0 = time.perf_counter()
            trainer.send_weights()
            took = time.perf_counter() - t0
            for i, p in enumerate(pipes):
                if p.ask("sample") != want:
                    raise RuntimeError(f"receiver {i} holds other bytes")
            print(json.dumps({"seconds": took}), flush=True)
    finally:
        trainer.shutdown()
        for p in pipes:
            p.proc.kill()


if __name__ == "__main__":
    if sys.argv[1] == "worker":
        worker(int(sys.argv[2]), int(sys.argv[3]))
    else:
        serve(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
