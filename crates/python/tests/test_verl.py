"""verl's checkpoint engine ``ferry`` (ferry.verl) against the real verl 0.9.1: engines made by
verl's own ``CheckpointEngineRegistry`` after verl's ``import_external_libs`` loaded the
module (what ``custom_backend_module=ferry.verl`` does), a trainer (this process, actor rank 0)
and 4 rollout receiver processes driven through the contract in the order verl's
``CheckpointEngineManager`` drives it (prepare, build_topology, init_process_group,
send_weights with receive_weights, finalize), on 127.0.0.1.

Needs verl 0.9.1 and torch in the environment (``target/frameworks-venv``; docs/rl.md says
how to install verl there). Without them the module skips with the reason, or fails under
``FERRY_REQUIRE_VERL=1``.
"""

import asyncio
import hashlib
import multiprocessing
import os
import signal
import traceback

import pytest

try:
    import torch
    from verl.checkpoint_engine import CheckpointEngine, CheckpointEngineRegistry
    from verl.utils.import_utils import import_external_libs
except ImportError as e:  # pragma: no cover - depends on the environment
    if os.environ.get("FERRY_REQUIRE_VERL") == "1":
        raise
    pytest.skip(
        f"verl (0.9.1) and torch are needed for ferry.verl ({e}); set FERRY_REQUIRE_VERL=1 to "
        "make this a failure",
        allow_module_level=True,
    )

WAIT = 120.0  # seconds any awaited event may take before the test fails
N = 4  # receivers
BUCKET = 1 << 20  # several buckets per update


def model(version: int) -> dict[str, "torch.Tensor"]:
    """About 100 named parameters, bf16 and fp32, whose values depend on ``version``."""
    g = torch.Generator().manual_seed(version)
    params = {}
    for layer in range(24):
        params[f"layers.{layer}.attn.qkv.weight"] = torch.randn(96, 64, generator=g).to(torch.bfloat16)
        params[f"layers.{layer}.attn.out.weight"] = torch.randn(64, 64, generator=g).to(torch.bfloat16)
        params[f"layers.{layer}.mlp.weight"] = torch.randn(256, 64, generator=g)
        params[f"layers.{layer}.norm.weight"] = torch.randn(64, generator=g)
    params["embed.weight"] = torch.randn(1000, 64, generator=g).to(torch.bfloat16)
    params["lm_head.weight"] = torch.randn(1000, 64, generator=g)
    params["lm_head.bias"] = torch.randn(1000, generator=g)
    params["step"] = torch.tensor([version], dtype=torch.int64)
    return params


def as_sent(params: dict, rollout_dtype) -> dict:
    return {
        n: (t.to(rollout_dtype) if rollout_dtype is not None and t.is_floating_point() else t)
        for n, t in params.items()
    }


def digests(params: dict) -> dict:
    """name -> (dtype, shape, sha256 of the bytes)."""
    out = {}
    for n, t in params.items():
        raw = t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
        out[n] = (str(t.dtype), tuple(t.shape), hashlib.sha256(raw).hexdigest())
    return out


def new_engine(**kwargs) -> "CheckpointEngine":
    """An engine the way verl makes one: the custom module imported, then the registry."""
    import_external_libs("ferry.verl")
    return CheckpointEngineRegistry.new("ferry", **kwargs)


# -- the receiver processes ------------------------------------------------------------------


def _patch_pull(role: dict, sync) -> None:
    """Test-only behaviours, wrapped around ``ferry.broadcast.pull`` in this child:
    ``die_in_bucket`` (SIGKILL itself halfway through that bucket); ``corrupt`` (once its pull
    is whole, overwrite what it holds, open the gate, and go on relaying it once every other
    receiver has verified a first chunk); ``after_gate`` (pull only once the gate is open, and
    say when the first chunk is verified)."""
    import numpy as np

    import ferry.broadcast

    gate, started = sync
    real = ferry.broadcast.pull
    seen = {"buckets": 0}

    def pull(engine, source, into, **kw):
        seen["buckets"] += 1
        if role.get("die_in_bucket") == seen["buckets"]:

            def die(done, total):
                if done * 2 >= total:
                    os.kill(os.getpid(), signal.SIGKILL)

            kw["progress"] = die
        if role.get("after_gate"):
            assert gate.wait(WAIT), "the corrupting relay never finished"
            first = []

            def began(done, total):
                if done and not first:
                    first.append(done)
                    started.release()

            kw["progress"] = began
        if role.get("corrupt"):

            def corrupt(done, total):
                if done == total:  # whole and verified: now serve garbage
                    for v in into.values():
                        np.frombuffer(memoryview(v), dtype=np.uint8)[:] ^= 0xFF
                    gate.set()
                    for _ in range(role["corrupt"]):
                        assert started.acquire(timeout=WAIT), "the other receivers never began"

            kw["progress"] = corrupt
        return real(engine, source, into, **kw)

    ferry.broadcast.pull = pull


def receiver_main(conn, kwargs: dict, role: dict, sync) -> None:
    """One rollout worker: the contract's receiver side, driven by messages from the test."""
    try:
        engine = new_engine(**kwargs)
        _patch_pull(role, sync)
        if role.get("destinations") is not None:
            import ferry.verl

            if role.get("skip_precheck"):
                ferry.verl.mismatches = lambda expected, targets: []  # leave it to the broadcast
            dests = role["destinations"]
            engine.set_destinations(dests)
        conn.send(engine.prepare())
        while True:
            cmd, arg = conn.recv()
            if cmd == "init":
                engine.init_process_group(**arg)
                conn.send("ok")
            elif cmd == "recv":

                async def go():
                    return {n: t.clone() for n, t in [x async for x in engine.receive_weights(global_steps=arg)]}

                try:
                    got = asyncio.run(go())
                except Exception as e:  # reported to the test, which checks what it was
                    conn.send(("err", f"{type(e).__name__}: {e}", None))
                    continue
                stats = {
                    "refetched": sum(s.refetched for s in engine.summaries),
                    "from_relays": sum(s.from_relays for s in engine.summaries),
                    "buckets": len(engine.summaries),
                }
                conn.send(("ok", digests(got), stats))
            elif cmd == "dests":
                conn.send(digests(role["destinations"]))
            elif cmd == "finalize":
                engine.finalize()
                conn.send("ok")
            elif cmd == "stop":
                return
    except BaseException:
        conn.send(("crash", traceback.format_exc(), None))
        raise


def _context():
    """Children forked from a server that imported verl once (an import of verl takes seconds;
    forking this process instead would copy its Ferry runtime's threads' locks)."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["verl.checkpoint_engine", "ferry.verl", "numpy", "test_verl"])
    return ctx


class Rollout:
    """N receiver processes and the trainer engine, wired as verl's manager wires them."""

    def __init__(self, roles=None, kwargs=None, trainer_kwargs=None, receiver_kwargs=None):
        ctx = _context()
        self.sync = (ctx.Event(), ctx.Semaphore(0))
        roles = roles or [{} for _ in range(N)]
        base = {"bucket_size": BUCKET, "device": "cpu", "timeout": WAIT} | (kwargs or {})
        self.procs, self.conns = [], []
        for i, role in enumerate(roles):
            mine, theirs = ctx.Pipe()
            rk = dict(base, **(receiver_kwargs or {}).get(i, {}))
            p = ctx.Process(target=receiver_main, args=(theirs, rk, role, self.sync), daemon=True)
            p.start()
            self.procs.append(p)
            self.conns.append(mine)
        self.trainer = new_engine(is_master=True, **dict(base, **(trainer_kwargs or {})))
        meta = [self.trainer.prepare()] + [self._get(i) for i in range(len(roles))]
        actor_kwargs, rollout_kwargs = type(self.trainer).build_topology(1, len(roles), meta)
        for k, v in rollout_kwargs.items():  # what verl's manager asserts
            assert len(v) == len(roles), k
        self.trainer.init_process_group(**{k: v[0] for k, v in actor_kwargs.items()})
        for i, c in enumerate(self.conns):
            c.send(("init", {k: v[i] for k, v in rollout_kwargs.items()}))
        for i in range(len(roles)):
            assert self._get(i) == "ok"

    def _get(self, i: int):
        assert self.conns[i].poll(WAIT), f"receiver {i + 1} did not answer within {WAIT} s"
        msg = self.conns[i].recv()
        if isinstance(msg, tuple) and msg[0] == "crash":
            raise AssertionError(f"receiver {i + 1} crashed:\n{msg[1]}")
        return msg

    def update(self, params: dict, step: int, alive=None):
        """One weight update: send_weights here while every receiver runs receive_weights.
        Returns (what send_weights returned or raised, each receiver's answer or None if it
        died)."""
        alive = range(len(self.conns)) if alive is None else alive
        for i in alive:
            self.conns[i].send(("recv", step))

        async def send():
            try:
                return await self.trainer.send_weights(iter(params.items()), global_steps=step)
            except Exception as e:
                return e

        sent = asyncio.run(send())
        answers = {}
        for i in alive:
            if not self.conns[i].poll(WAIT):
                raise AssertionError(f"receiver {i + 1} did not report within {WAIT} s")
            try:
                answers[i] = self.conns[i].recv()
            except EOFError:
                answers[i] = None  # the process is gone
        self.trainer.finalize()
        for i in alive:
            if answers[i] is not None and self.procs[i].is_alive():
                self.conns[i].send(("finalize", None))
                assert self._get(i) == "ok"
        return sent, answers

    def close(self):
        for c, p in zip(self.conns, self.procs):
            if p.is_alive():
                try:
                    c.send(("stop", None))
                except OSError:
                    pass
        for p in self.procs:
            p.join(WAIT)
            if p.is_alive():
                p.kill()
        self.trainer.shutdown()


@pytest.fixture
def rollout():
    made = []

    def make(**kw):
        r = Rollout(**kw)
        made.append(r)
        return r

    yield make
    for r in made:
        r.close()


# -- the tests -------------------------------------------------------------------------------


def test_verls_registry_makes_it_as_its_other_engines():
    import_external_libs("ferry.verl")
    import ferry.verl

    assert CheckpointEngineRegistry.get("ferry") is ferry.verl.FerryCheckpointEngine
    e = CheckpointEngineRegistry.new("ferry", bucket_size=1 << 20, device="cpu")
    assert isinstance(e, CheckpointEngine) and e.bucket_size == 1 << 20 and e.device == "cpu"
    e = CheckpointEngineRegistry.new(
        "ferry", bucket_size=1 << 20, device="cpu", rollout_dtype=torch.float16, is_master=True, rebuild_group=True
    )
    assert e.is_master and e.rebuild_group and e.rollout_dtype == torch.float16
    with pytest.raises(ValueError, match="device"):
        CheckpointEngineRegistry.new("ferry", bucket_size=1 << 20, device="tpu")
    # build_topology: the master sources, other actor workers sit out, rollout ranks 1..N.
    meta = [
        {"addr": "127.0.0.1:1", "peer_id": "a", "is_master": True},
        {"addr": "127.0.0.1:2", "peer_id": "b", "is_master": False},
        {"addr": "127.0.0.1:3", "peer_id": "c", "is_master": False},
        {"addr": "127.0.0.1:4", "peer_id": "d", "is_master": False},
    ]
    actor, rollout = ferry.verl.FerryCheckpointEngine.build_topology(2, 2, meta)
    assert actor["rank"] == [0, -1] and rollout["rank"] == [1, 2]
    assert rollout["plan"][0]["source_addr"] == "127.0.0.1:1"
    assert [tuple(r) for r in rollout["plan"][0]["receivers"]] == [(1, "127.0.0.1:3", "c"), (2, "127.0.0.1:4", "d")]
    with pytest.raises(ValueError, match="master"):
        ferry.verl.FerryCheckpointEngine.build_topology(2, 2, meta[1:] + meta[:1])


@pytest.mark.parametrize("rollout_dtype", [torch.bfloat16, None], ids=["cast-to-bf16", "bf16-and-fp32-as-they-are"])
def test_version_2_after_version_1_to_four_receivers(rollout, rollout_dtype):
    r = rollout(kwargs={"rollout_dtype": rollout_dtype})
    for step in (1, 2):
        params = model(step)
        sent, answers = r.update(params, step)
        assert not isinstance(sent, Exception), sent
        want = digests(as_sent(params, rollout_dtype))
        for i, (status, got, stats) in answers.items():
            assert status == "ok", (i, got)
            assert got == want, f"receiver {i + 1} holds other weights than step {step}'s"
            assert stats["buckets"] > 1, "the update streams in several buckets"
        assert sent["ferry/receivers_ok"] == N and sent["ferry/buckets"] > 1
        assert set(r.trainer.outcomes.values()) == {"ok"}
    assert len(want) >= 100
    # An update with no weights at all ends on every receiver with nothing.
    sent, answers = r.update({}, 3)
    assert sent["ferry/buckets"] == 0 and sent["ferry/receivers_ok"] == N, sent
    assert all(a[0] == "ok" and a[1] == {} for a in answers.values()), answers
    if rollout_dtype is None:
        assert {d for d, _, _ in want.values()} >= {"torch.bfloat16", "torch.float32"}


def test_a_receiver_killed_mid_update_is_named_and_the_others_finish(rollout):
    roles = [{}, {"die_in_bucket": 2}, {}, {}]
    r = rollout(roles=roles)
    params = model(7)
    sent, answers = r.update(params, 7)
    assert isinstance(sent, Exception), "send_weights must say a receiver failed"
    import ferry.verl

    assert isinstance(sent, ferry.verl.ReceiversFailed)
    assert list(sent.failed) == [f"rank 2 ({r.trainer.plan.receivers[1][1]})"], sent
    assert len(sent.succeeded) == N - 1
    assert answers[1] is None, "the killed receiver answered"
    want = digests(as_sent(params, torch.bfloat16))
    for i in (0, 2, 3):
        status, got, _ = answers[i]
        assert status == "ok" and got == want, (i, status)


def test_a_relay_that_corrupts_a_chunk_is_caught(rollout):
    # Receiver 1 pulls alone, then flips every byte it holds and keeps relaying; the others
    # pull only then, from it (the plan) and the trainer, and must catch what it serves (and
    # still end with the trainer's bytes).
    roles = [{"corrupt": N - 1}] + [{"after_gate": True} for _ in range(N - 1)]
    r = rollout(roles=roles, kwargs={"bucket_size": 64 << 20})
    params = model(3)
    sent, answers = r.update(params, 3)
    assert not isinstance(sent, Exception), sent
    want = digests(as_sent(params, torch.bfloat16))
    refetched = 0
    for i in range(1, N):
        status, got, stats = answers[i]
        assert status == "ok" and got == want, f"receiver {i + 1} kept a corrupted chunk"
        refetched += stats["refetched"]
    assert refetched > 0, "no receiver fetched from the corrupting relay: the test did not test"


@pytest.mark.parametrize("where", ["engine", "broadcast"])
def test_a_mismatched_parameter_is_refused_before_any_byte_lands(rollout, where):
    # Receiver 3 receives in place into its live parameters, one of which has another shape
    # (and one another dtype): refused, nothing written; the trainer names it, the rest finish.
    live = {n: torch.zeros_like(t).to(torch.bfloat16) if t.is_floating_point() else torch.zeros_like(t) for n, t in model(1).items()}
    live["layers.5.mlp.weight"] = torch.zeros(64, 256, dtype=torch.bfloat16)
    live["lm_head.bias"] = torch.zeros(1000, dtype=torch.float32)
    roles = [{}, {}, {"destinations": live, "skip_precheck": where == "broadcast"}, {}]
    r = rollout(roles=roles, kwargs={"bucket_size": 64 << 20})
    before = digests(live)
    params = model(5)
    sent, answers = r.update(params, 5)
    import ferry.verl

    assert isinstance(sent, ferry.verl.ReceiversFailed), sent
    assert list(sent.failed) == [f"rank 3 ({r.trainer.plan.receivers[2][1]})"]
    status, why, _ = answers[2]
    assert status == "err"
    expected = "ParameterMismatch" if where == "engine" else "TensorMismatch"
    assert expected in why and "layers.5.mlp.weight" in why, why
    assert expected in sent.failed[list(sent.failed)[0]]
    r.conns[2].send(("dests", None))
    assert r._get(2) == before, "a byte landed in the refused receiver's parameters"
    want = digests(as_sent(params, torch.bfloat16))
    for i in (0, 1, 3):
        assert answers[i][0] == "ok" and answers[i][1] == want


def test_keyed_a_receiver_with_another_key_gets_nothing(rollout, tmp_path):
    key, other = tmp_path / "keys", tmp_path / "other"
    key.write_text("verl " + "11" * 32 + "\n")
    other.write_text("verl " + "22" * 32 + "\n")
    os.chmod(key, 0o600)
    os.chmod(other, 0o600)
    r = rollout(
        kwargs={"auth_key_file": str(key)},
        receiver_kwargs={3: {"auth_key_file": str(other), "timeout": 5.0}},
    )
    params = model(11)
    sent, answers = r.update(params, 11)
    import ferry.verl

    assert isinstance(sent, ferry.verl.ReceiversFailed), sent
    assert list(sent.failed) == [f"rank 4 ({r.trainer.plan.receivers[3][1]})"]
    assert "Authentication" in sent.failed[list(sent.failed)[0]] or "Handshake" in sent.failed[list(sent.failed)[0]], sent
    status, why, _ = answers[3]
    assert status == "err" and "TimeoutError" in why, why
    want = digests(as_sent(params, torch.bfloat16))
    for i in range(3):
        assert answers[i][0] == "ok" and answers[i][1] == want
