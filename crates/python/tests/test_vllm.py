"""vLLM's weight-transfer backend ``ferry`` (ferry.vllm) against the real vLLM 0.33, on CPU:
a trainer (this process) and receiver processes, each engine made by vLLM's own factories
after vLLM loaded the ``ferry`` plugin from the wheel's entry point.

Where the wheel is installed (CI's frameworks step), vLLM's ``load_general_plugins`` finds
its entry point; where the package is in place (a ``.pth`` file), the entry point is read from
``crates/python/pyproject.toml`` into a ``dist-info`` directory on the path, as an install
would write it. Each receiver stands for a vLLM worker: a CPU model of about 100
named parameters (bf16 and fp32) and the engine ``WeightTransferEngineFactory`` made for it,
driven over a pipe as vLLM's worker RPCs drive it.

Needs vLLM (``target/vllm-venv``: ``target/vllm-venv/bin/python -m pytest
crates/python/tests/test_vllm.py``); elsewhere the module skips with the reason, or fails under
``FERRY_REQUIRE_VLLM=1``. Run as a script (``test_vllm.py worker ...``) it is a receiver.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
PYPROJECT = HERE.parent / "pyproject.toml"
WAIT = 120.0  # seconds any one step may take before the test fails

try:
    import torch
    from vllm.distributed.weight_transfer.factory import (
        WeightTransferEngineFactory,
        WeightTransferTrainerFactory,
    )
except ImportError as e:  # pragma: no cover - depends on the environment
    if __name__ == "__main__" or os.environ.get("FERRY_REQUIRE_VLLM") == "1":
        raise
    pytest.skip(
        f"vLLM is needed for ferry.vllm ({e}; target/vllm-venv has it, docs/rl.md); set "
        "FERRY_REQUIRE_VLLM=1 to make this a failure",
        allow_module_level=True,
    )


# ---------------------------------------------------------------------------------------------
# The model both sides hold: 24 layers of 4 parameters, an embedding, a norm and a head (99).


def model_spec(mismatch: bool = False) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    spec = [("embed.weight", torch.bfloat16, (1024, 256))]
    for i in range(24):
        spec += [
            (f"layers.{i}.attn.weight", torch.bfloat16, (256, 256)),
            (f"layers.{i}.mlp.weight", torch.bfloat16, (512, 256)),
            (f"layers.{i}.mlp.bias", torch.float32, (512,)),
            (f"layers.{i}.norm.weight", torch.float32, (256,)),
        ]
    spec += [("norm.weight", torch.float32, (256,)), ("lm_head.weight", torch.float32, (1024, 256))]
    if mismatch:  # one parameter of another shape, one of another dtype
        spec[5] = (spec[5][0], spec[5][1], (256, 512))
        spec[8] = (spec[8][0], torch.bfloat16, spec[8][2])
    return spec


class Model(torch.nn.Module):
    def __init__(self, spec, seed: int | None):
        super().__init__()
        g = torch.Generator().manual_seed(seed or 0)
        self._names = []
        for name, dtype, shape in spec:
            t = torch.randn(shape, generator=g).to(dtype) if seed is not None else torch.zeros(shape, dtype=dtype)
            self.register_parameter(name.replace(".", "__"), torch.nn.Parameter(t, requires_grad=False))
            self._names.append(name)

    def named_parameters(self, *args, **kwargs):  # the dotted names a real model has
        for name in self._names:
            yield name, getattr(self, name.replace(".", "__"))

    def load_weights(self, weights):  # vLLM's checkpoint-format loader, by name
        params = dict(self.named_parameters())
        for name, t in weights:
            params[name].data.copy_(t)


def digests(model: torch.nn.Module) -> dict[str, str]:
    return {
        n: hashlib.sha256(p.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()
        for n, p in model.named_parameters()
    }


def plugin_path(root: Path) -> Path:
    """A dist-info under ``root`` holding the wheel's entry points, as an install would."""
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    info = root / "ferry_transfer-0.0.0.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {project['name']}\nVersion: 0.0.0\n")
    lines = []
    for group, eps in project.get("entry-points", {}).items():
        lines.append(f"[{group}]")
        lines += [f"{k} = {v}" for k, v in eps.items()]
    (info / "entry_points.txt").write_text("\n".join(lines) + "\n")
    return root


# ---------------------------------------------------------------------------------------------
# A receiver process: a vLLM worker's weight-transfer engine, driven over stdin/stdout.


def worker_main(mismatch: bool) -> None:
    from types import SimpleNamespace

    from vllm.config.parallel import ParallelConfig
    from vllm.config.weight_transfer import WeightTransferConfig
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    model = Model(model_spec(mismatch), seed=None)
    vllm_config = SimpleNamespace(parallel_config=ParallelConfig(), model_config=None)
    engine = WeightTransferEngineFactory.create_engine(
        WeightTransferConfig(backend="ferry"), vllm_config, torch.device("cpu"), model
    )
    print(json.dumps({"ready": type(engine).__module__ + "." + type(engine).__name__}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        op, arg = cmd["op"], cmd.get("arg")
        try:
            out = None
            if op == "init":
                engine.init_transfer_engine(engine.parse_init_info(arg))
            elif op == "start":
                engine.start_weight_update()
            elif op == "update":
                engine.update_weights(arg)
                s = engine.last_summary
                out = {"refetched": s.refetched, "from_relays": s.from_relays, "version": s.version}
            elif op == "finish":
                engine.finish_weight_update()
            elif op == "digests":
                out = digests(model)
            elif op == "die_at":  # SIGKILL itself once this many bytes of a pull are verified
                def die(done: int, total: int, at: int = arg) -> None:
                    if done >= at:
                        os.kill(os.getpid(), signal.SIGKILL)

                engine.progress = die
            elif op == "corrupt_staging":  # a fault of this relay's memory after verifying
                for t in engine.staging.values():
                    t.view(-1).view(torch.uint8)[0] ^= 0xFF
            elif op == "reset":  # for the next test: a new engine on a model of zeros
                engine.shutdown()
                with torch.no_grad():
                    for _, p in model.named_parameters():
                        p.zero_()
                engine = WeightTransferEngineFactory.create_engine(
                    WeightTransferConfig(backend="ferry"), vllm_config, torch.device("cpu"), model
                )
            elif op == "quit":
                engine.shutdown()
                print(json.dumps({"ok": True}), flush=True)
                return
            print(json.dumps({"ok": True, "out": out}), flush=True)
        except Exception as e:
            print(json.dumps({"ok": False, "error": type(e).__name__, "message": str(e)}), flush=True)


class ReceiverGone(ConnectionError):
    """The receiver process exited."""


class WorkerClient:
    """A ``VLLMWeightSyncClient`` for one receiver process (what vLLM's HTTP routes or Ray
    actors are to a real instance). ``ready()`` waits until the process has made its engine."""

    def __init__(self, env: dict, mismatch: bool = False):
        args = [sys.executable, str(Path(__file__).resolve()), "worker"] + (["mismatch"] if mismatch else [])
        self.mismatch = mismatch
        self.proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        self.engine_class = ""

    def ready(self) -> "WorkerClient":
        if not self.engine_class:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"the receiver exited before it was ready: {self.proc.wait()}")
            self.engine_class = json.loads(line)["ready"]
        return self

    def ask(self, op: str, arg=None):
        try:
            self.proc.stdin.write(json.dumps({"op": op, "arg": arg}) + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError as e:
            raise ReceiverGone(f"the receiver process exited ({self.proc.wait()})") from e
        line = self.proc.stdout.readline()
        if not line:
            raise ReceiverGone(f"the receiver process exited ({self.proc.wait()})")
        reply = json.loads(line)
        if not reply["ok"]:
            raise RuntimeError(f"{reply['error']}: {reply['message']}")
        return reply.get("out")

    def init_weight_transfer_engine(self, init_info):
        self.ask("init", init_info)

    def start_weight_update(self):
        self.ask("start")

    def update_weights(self, update_info):
        self.last = self.ask("update", update_info)

    def finish_weight_update(self, weight_version=None):
        self.ask("finish")

    def close(self):
        if self.proc.poll() is None:
            try:
                self.ask("quit")
                self.proc.wait(timeout=WAIT)
            except (ReceiverGone, RuntimeError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()


# ---------------------------------------------------------------------------------------------
# The trainer side, in this process.


@pytest.fixture(scope="module")
def vllm_env(tmp_path_factory):
    """vLLM's general plugins loaded here from the entry point; the environment for receivers."""
    from importlib.metadata import entry_points

    from vllm.plugins import load_general_plugins

    env = dict(os.environ)
    env.setdefault("FERRY_BIND_ADDRESS", "127.0.0.1")
    installed = any(ep.value == "ferry.vllm_plugin:register" for ep in entry_points(group="vllm.general_plugins"))
    if installed:  # the wheel (CI's frameworks step installs it): its own entry point
        load_general_plugins()
        yield env
        return
    root = plugin_path(tmp_path_factory.mktemp("ferry-vllm-plugin"))
    sys.path.insert(0, str(root))
    load_general_plugins()
    env["PYTHONPATH"] = os.pathsep.join([str(root)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    yield env
    sys.path.remove(str(root))


@pytest.fixture(scope="module")
def pool(vllm_env):
    """Receiver processes kept across the module's tests (each takes tens of seconds to import
    vLLM); a test's receivers are reset (their engines shut down) before the next one."""
    procs: list[WorkerClient] = []
    yield procs, vllm_env
    for c in procs:
        c.close()


@pytest.fixture
def receivers(pool):
    procs, env = pool
    taken: list[WorkerClient] = []

    def make(n: int, mismatch: set[int] = frozenset()) -> dict[str, WorkerClient]:
        free = [c for c in procs if c.proc.poll() is None and c not in taken]
        chosen = []
        for i in range(n):
            want = i in mismatch
            c = next((c for c in free if c.mismatch == want), None)
            if c is None:
                c = WorkerClient(env, mismatch=want)  # started together, waited for below
                procs.append(c)
            else:
                free.remove(c)
            chosen.append(c)
        taken.extend(chosen)
        return {f"r{i}": c.ready() for i, c in enumerate(chosen)}

    yield make
    for c in taken:
        if c.proc.poll() is None:
            c.ask("reset")


def trainer(client, **init):
    from vllm.distributed.weight_transfer import ModuleSource

    from ferry.vllm import FerryTrainerInitInfo

    model = Model(model_spec(), seed=1)
    info = FerryTrainerInitInfo(rank=0, listen="127.0.0.1:0", chunk_size=256 << 10, **init)
    return model, WeightTransferTrainerFactory.trainer_init(info, client=client, source=ModuleSource(model))


def test_the_plugin_registers_ferry_in_both_factories_and_imports_it_only_when_used(vllm_env):
    probe = (
        "import sys\n"
        "from vllm.plugins import load_general_plugins\n"
        "from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory as W, "
        "WeightTransferTrainerFactory as T\n"
        "load_general_plugins()\n"
        "print('ferry' in W._registry, 'ferry' in T._registry, 'ferry.vllm' in sys.modules)\n"
        "print(W._registry['ferry']().__name__, T._registry['ferry']().__name__)\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], env=vllm_env, capture_output=True, text=True, timeout=WAIT)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split("\n")[:2] == [
        "True True False",
        "FerryWeightTransferEngine FerryTrainerWeightTransferEngine",
    ]


class Recorder:
    """A client that only records what it was asked."""

    def __init__(self):
        self.calls = []

    def __getattr__(self, name):
        return lambda *a, **k: self.calls.append(name)


def test_a_non_sender_rank_only_iterates_the_source_and_bad_infos_are_refused(vllm_env):
    from functools import cached_property

    from vllm.distributed.weight_transfer import ModuleSource

    from ferry.vllm import FerryTrainerInitInfo, FerryWeightTransferInitInfo, FerryWeightTransferUpdateInfo

    class Counted(ModuleSource):
        passes = 0

        @cached_property
        def metadata(self):
            return ModuleSource.metadata.func(self)

        def iter_full(self):
            Counted.passes += 1
            yield from super().iter_full()

    client = Recorder()
    model = Model(model_spec(), seed=1)
    t = WeightTransferTrainerFactory.trainer_init(FerryTrainerInitInfo(rank=1), client=client, source=Counted(model))
    t.send_weights()
    assert (client.calls, Counted.passes, t.version) == ([], 1, 0), "rank 1 runs the collectives only"
    with pytest.raises(ValueError, match="mode must be one of"):
        FerryWeightTransferInitInfo(mode="sideways")
    with pytest.raises(ValueError, match="as long as one another"):
        FerryWeightTransferUpdateInfo(version=1, manifest="", source="", names=["a"], dtype_names=[], shapes=[])
    with pytest.raises(ValueError, match="whole number"):
        FerryWeightTransferUpdateInfo(version=-1, manifest="", source="")


@pytest.mark.parametrize("mode", ["in_place", "staged", "checkpoint"])
def test_four_receivers_take_version_1_then_version_2(receivers, mode):
    """Checkpoint mode hands the verified tensors to the model's ``load_weights`` (vLLM's
    layerwise reload, which needs a real vLLM model's layers, is off for this toy model)."""
    from ferry.vllm import FanoutClient

    rs = receivers(4)
    assert {c.engine_class for c in rs.values()} == {"ferry.vllm.FerryWeightTransferEngine"}
    extra = {"layerwise_reload": False} if mode == "checkpoint" else {}
    model, t = trainer(FanoutClient(rs), mode=mode, **extra)
    try:
        for version in (1, 2):
            if version == 2:
                with torch.no_grad():
                    for _, p in model.named_parameters():
                        p.add_(1)
            t.send_weights()
            want = digests(model)
            assert t.version == version
            assert t.outcomes == {n: "ok" for n in rs}
            # Published from the parameters' own memory, no copy.
            assert [x.data_ptr() for x in t._held[version]] == [p.data_ptr() for _, p in model.named_parameters()]
            for n, c in rs.items():
                assert c.last["version"] == version
                assert c.ask("digests") == want, f"{n} holds other bytes than version {version}"
        assert sum(c.last["from_relays"] for c in rs.values()) > 0, "receivers relay to each other"
    finally:
        t.shutdown()


def test_a_receiver_killed_mid_update_is_named_and_the_others_finish(receivers):
    from ferry.vllm import FanoutClient, ReceiversFailed

    rs = receivers(4)
    model, t = trainer(FanoutClient(rs), mode="staged")
    try:
        rs["r2"].ask("die_at", 1)
        with pytest.raises(ReceiversFailed) as e:
            t.send_weights()
        assert set(e.value.failed) == {"r2"}
        assert isinstance(e.value.failed["r2"], ReceiverGone)
        assert sorted(e.value.succeeded) == ["r0", "r1", "r3"]
        assert "r2" in str(e.value) and t.outcomes["r2"].startswith("ReceiverGone")
        assert rs["r2"].proc.wait(timeout=WAIT) == -signal.SIGKILL
        want = digests(model)
        for n in ("r0", "r1", "r3"):
            assert t.outcomes[n] == "ok"
            assert rs[n].ask("digests") == want
    finally:
        t.shutdown()


class Sequential:
    """Receivers one after another, with a step between two of them (the corrupting relay)."""

    def __init__(self, first, then, between):
        self.first, self.then, self.between = first, then, between

    def init_weight_transfer_engine(self, info):
        self.first.init_weight_transfer_engine(info)
        self.then.init_weight_transfer_engine(info)

    def start_weight_update(self):
        self.first.start_weight_update()
        self.then.start_weight_update()

    def update_weights(self, info):
        self.first.update_weights(info)
        self.between()
        self.then.update_weights(info)

    def finish_weight_update(self, weight_version=None):
        self.then.finish_weight_update()


def test_a_relay_that_serves_a_corrupted_chunk_is_caught(receivers):
    rs = receivers(2)
    a, b = rs["r0"], rs["r1"]
    model, t = trainer(Sequential(a, b, lambda: a.ask("corrupt_staging")), mode="staged")
    try:
        t.send_weights()
        # b, second to join, takes half the stripes from a: every chunk a served was corrupt.
        assert b.last["refetched"] > 0, b.last
        assert b.ask("digests") == digests(model)
    finally:
        t.shutdown()


def test_a_mismatched_parameter_is_refused_before_any_byte_lands(receivers):
    from ferry.vllm import FanoutClient, ReceiversFailed

    rs = receivers(3, mismatch={1})
    before = rs["r1"].ask("digests")
    model, t = trainer(FanoutClient(rs), mode="in_place")
    try:
        with pytest.raises(ReceiversFailed) as e:
            t.send_weights()
        assert set(e.value.failed) == {"r1"}
        msg = str(e.value.failed["r1"])
        assert msg.startswith("ParameterMismatch")
        assert "'layers.1.attn.weight': sent with shape [256, 256], the model's is [256, 512]" in msg
        assert "'layers.1.norm.weight': sent as float32, the model's is bfloat16" in msg
        assert rs["r1"].ask("digests") == before, "nothing landed in the refused receiver"
        want = digests(model)
        assert rs["r0"].ask("digests") == want and rs["r2"].ask("digests") == want
    finally:
        t.shutdown()


def test_a_keyed_update_reaches_keyed_receivers_and_refuses_a_keyless_one(receivers, tmp_path):
    from ferry.vllm import FanoutClient

    key = tmp_path / "keys"
    key.write_text("fleet " + os.urandom(16).hex() + "\n")
    key.chmod(0o600)
    rs = receivers(3)
    keyless = rs.pop("r2")
    model, t = trainer(FanoutClient(rs), mode="in_place", auth_key_file=str(key))
    try:
        t.send_weights()
        want = digests(model)
        assert rs["r0"].ask("digests") == want and rs["r1"].ask("digests") == want
        spec = model_spec()
        update = {
            "version": 1,
            "manifest": t._publisher.digest,
            "source": t._publisher.addr,
            "names": [n for n, _, _ in spec],
            "dtype_names": [str(d).removeprefix("torch.") for _, d, _ in spec],
            "shapes": [list(s) for _, _, s in spec],
        }
        before = keyless.ask("digests")
        keyless.init_weight_transfer_engine({"mode": "in_place", "timeout": 20, "linger": 0})
        keyless.start_weight_update()
        with pytest.raises(RuntimeError, match="BroadcastError|FerryError|Auth|refused|key"):
            keyless.update_weights(update)
        assert keyless.ask("digests") == before, "nothing landed without the key"
    finally:
        t.shutdown()


if __name__ == "__main__" and sys.argv[1:2] == ["worker"]:
    worker_main(mismatch=sys.argv[2:3] == ["mismatch"])
