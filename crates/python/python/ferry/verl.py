"""verl's checkpoint engine ``ferry``: a trainer's weights to rollout workers over Ferry's
verified broadcast (relay plan, BLAKE3 per chunk bound to a manifest, versions, keys).

verl (0.9.1) builds checkpoint engines by backend name from ``CheckpointEngineRegistry``;
importing this module registers ``FerryCheckpointEngine`` there as ``ferry``. verl imports it
in every worker when the rollout config names it::

    actor_rollout_ref.rollout.checkpoint_engine.backend=ferry
    actor_rollout_ref.rollout.checkpoint_engine.custom_backend_module=ferry.verl
    # optional, the engine's own keywords:
    +actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.ferry.device=cpu

The contract of ``verl/checkpoint_engine/base.py``, method by method, as verl's
``CheckpointEngineManager`` drives it on every weight update:

- ``prepare()`` (every worker): starts this worker's Ferry engine (once) and returns its
  address and peer id.
- ``build_topology(actor_ws, rollout_ws, metadata)`` (classmethod): actor rank 0 (the
  ``is_master`` worker) is the broadcast's source, every other actor worker sits the update out
  (rank -1, it only walks its weight generator), and the rollout workers are receivers 1..N.
  Each worker is handed the relay plan (``RelayPlan``): the source, the receivers, and that
  every receiver relays what it verified. Which receiver feeds which is Ferry's: each derives
  the same striped trees from the broadcast's membership list, so a receiver that dies only
  moves its own children.
- ``init_process_group(rank, world_size, plan)``: keeps the plan; nothing to connect.
- ``send_weights(weights, global_steps)`` (async, the source): walks the generator into
  buckets of ``bucket_size`` bytes (a tensor larger than a bucket is a bucket of its own, and
  Ferry chunks it), casts floating tensors to ``rollout_dtype``, and publishes each bucket as
  the next version of the broadcast, straight from the tensors' memory where they are
  contiguous host (``device="cpu"``) or CUDA memory (a copy otherwise). Each receiver is told
  each bucket's names, dtypes, shapes and manifest digest by a Ferry notification (keyed when
  the engines are); at most two buckets are served at once, the next one waits until every
  live receiver has the oldest. It returns once every receiver has every bucket, or has
  failed: the others finish, then ``ReceiversFailed`` names the failed ones (rank, address
  and why); ``outcomes`` says what each receiver did.
- ``receive_weights(global_steps)`` (async generator, the receivers): pulls each bucket as it
  is published, every chunk checked against the manifest whose digest the source sent, and
  yields ``(name, tensor)`` for each of its tensors once the whole bucket is verified. Without
  destinations the tensors are the engine's receive buffers (on ``device``; the previous
  update's where a tensor kept its dtype and shape, so valid until the next update, as the
  buckets verl's nccl and mooncake engines yield from); with ``set_destinations(tensors)`` (the
  live model's parameters, by name) the pull writes them in place, and a name, dtype or shape
  that differs from what was sent is refused (``ParameterMismatch``, every problem listed)
  before any byte lands.
- ``finalize()``: stops serving the update (the published buckets are let go); with
  ``rebuild_group`` the engines are shut down too and start afresh at the next ``prepare``.

Keys: ``auth_key_file`` (default ``FERRY_AUTH_KEY_FILE``) is the keyring every worker's engine
and the broadcast's control service prove; a worker without the key is refused by all of them.
The address each engine listens on is ``listen`` (a host, or ``HOST:PORT``), else
``FERRY_BIND_ADDRESS``, else the Ray node's address, else 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
import zlib
from dataclasses import asdict, dataclass
from typing import Any, AsyncIterator, Mapping

import torch
from verl.checkpoint_engine.base import CheckpointEngine, CheckpointEngineRegistry

import ferry
from ferry import _ferry
from ferry import broadcast
from ferry._rl import ParameterMismatch, ReceiversFailed, as_broadcast, dtype_name, mismatches, torch_dtype

__all__ = [
    "BACKEND",
    "FerryCheckpointEngine",
    "ParameterMismatch",
    "ReceiversFailed",
    "RelayPlan",
]

BACKEND = "ferry"

# Notification names: a bucket's description (split into parts of at most _PART bytes, under
# the notification's 64 KiB) and a receiver's outcome for one bucket.
_BUCKET = "ferry.verl.bucket"
_ACK = "ferry.verl.ack"
_PART = 60 << 10
# Buckets served at once (the publisher's keep_versions): bucket k is published once every
# live receiver has bucket k - 2.
_KEEP = 2


@dataclass(frozen=True)
class RelayPlan:
    """What ``build_topology`` hands every worker: the source (actor rank 0's engine address
    and peer id) and the receivers (rank, address, peer id; rank 1.. in rollout order). Every
    receiver relays what it verified; which receiver feeds which, Ferry's broadcast derives
    from its membership list (striped trees dealt by join number)."""

    source_addr: str
    source_peer: str
    receivers: tuple[tuple[int, str, str], ...]
    relay: bool = True

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _bind_host(listen: str | None) -> str:
    """The ``HOST:PORT`` an engine listens on (port 0: any free port)."""
    host = listen or os.environ.get("FERRY_BIND_ADDRESS")
    if not host:
        host = "127.0.0.1"
        try:
            import ray

            if ray.is_initialized():
                host = ray.util.get_node_ip_address().strip("[]")
        except ImportError:
            pass
    if ":" not in host.rsplit("]", 1)[-1]:
        host = f"{host}:0"
    return host


def _rollout_dtype(value: Any) -> torch.dtype | None:
    if value is None or isinstance(value, torch.dtype):
        return value
    return torch_dtype(str(value).removeprefix("torch."))


async def _walk(weights: Any) -> AsyncIterator[tuple[str, torch.Tensor]]:
    """The ``(name, tensor)`` pairs of a generator, async generator or iterable."""
    if hasattr(weights, "__aiter__"):
        async for item in weights:
            yield item
    else:
        for item in weights:
            yield item


@CheckpointEngineRegistry.register(BACKEND)
class FerryCheckpointEngine(CheckpointEngine):
    """verl's ``CheckpointEngine`` on Ferry's verified broadcast (this module's docstring says
    how verl drives it).

    Args (verl's common ones first):
        bucket_size: bytes per published bucket (verl passes
            ``update_weights_bucket_megabytes << 20``).
        device: ``"cpu"`` or ``"cuda"``: where the source serves from (a tensor elsewhere is
            copied there) and where a receiver without destinations allocates.
        rollout_dtype: floating tensors are sent as this dtype (a torch dtype or its name;
            None: each as it is).
        is_master: this worker is the source (verl sets it on actor rank 0).
        rebuild_group: shut the engines down at every ``finalize``.
        name: the broadcast's name (one per trainer/rollout pair).
        auth_key_file: keyring file (default ``FERRY_AUTH_KEY_FILE``).
        listen: host or ``HOST:PORT`` this worker's engine listens on.
        timeout: seconds a whole update may take, on either side (None: no bound).
        relay: receivers relay what they verified to each other.
        verify_at_rest: receivers check every chunk again before a bucket counts as done.
        raise_on_failed_receivers: ``send_weights`` raises ``ReceiversFailed`` (else it only
            reports them in ``outcomes`` and its metrics).
        reuse_buffers: a receiver without destinations pulls each update into the buffers of
            the previous one where a tensor kept its dtype and shape (no fresh memory to fault
            in); what ``receive_weights`` yields is then valid until the next update, as the
            buckets verl's nccl and mooncake engines yield from. False: fresh tensors each time.
    """

    def __init__(
        self,
        bucket_size: int,
        device: str = "cpu",
        rollout_dtype: Any = torch.bfloat16,
        is_master: bool = False,
        rebuild_group: bool = False,
        *,
        name: str = "verl",
        auth_key_file: str | None = None,
        listen: str | None = None,
        timeout: float | None = None,
        relay: bool = True,
        verify_at_rest: bool = True,
        chunk_size: int | None = None,
        raise_on_failed_receivers: bool = True,
        reuse_buffers: bool = True,
    ) -> None:
        if isinstance(bucket_size, bool) or not isinstance(bucket_size, int) or bucket_size < 1:
            raise ValueError(f"bucket_size must be a positive number of bytes, not {bucket_size!r}")
        if str(device) not in ("cpu", "cuda") and not str(device).startswith("cuda:"):
            raise ValueError(f'device must be "cpu" or "cuda", not {device!r}')
        self.bucket_size = bucket_size
        self.device = str(device)
        self.rollout_dtype = _rollout_dtype(rollout_dtype)
        self.is_master = bool(is_master)
        self.rebuild_group = bool(rebuild_group)
        self.name = name
        self.auth_key_file = auth_key_file or os.environ.get("FERRY_AUTH_KEY_FILE") or None
        self.listen = listen
        self.timeout = timeout
        self.relay = relay
        self.verify_at_rest = verify_at_rest
        self.chunk_size = chunk_size
        self.raise_on_failed_receivers = raise_on_failed_receivers
        self.reuse_buffers = reuse_buffers
        self.rank: int | None = None
        self.world_size: int | None = None
        self.plan: RelayPlan | None = None
        self.outcomes: dict[str, str] = {}
        self.summaries: list[broadcast.PullSummary] = []  # a receiver's pulls, this update
        self._engine: ferry.Engine | None = None
        self._raw: Any = None
        self._publisher: broadcast.Publisher | None = None
        self._version = 0  # the newest broadcast version this source published
        self._update = 0  # this source's updates so far (send_weights calls)
        self._done_update = 0  # the newest update a receiver ended (its leftovers are dropped)
        self._parts: dict[int, dict[int, bytes]] = {}  # a receiver's bucket parts by version
        self._into: dict[str, torch.Tensor] | None = None
        # A receiver's buffers by (name, dtype, shape, device), kept for the next update.
        self._pool: dict[tuple, torch.Tensor] = {}
        self._used: set[tuple] = set()

    # -- the contract -----------------------------------------------------------------------

    def prepare(self) -> dict[str, Any]:
        """Starts this worker's engine (once) and returns what ``build_topology`` needs of it:
        ``{"addr", "peer_id", "is_master"}``."""
        if self._engine is None:
            self._engine = ferry.Engine(listen=_bind_host(self.listen), auth_key_file=self.auth_key_file)
            self._raw = _ferry.RawEngine(self._engine)
        return {"addr": self._engine.listen_addr, "peer_id": self._engine.peer_id, "is_master": self.is_master}

    @classmethod
    def build_topology(
        cls, actor_wg_world_size: int, rollout_world_size: int, metadata: list[dict]
    ) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
        """Actor rank 0 sources, the other actor workers sit out (rank -1), rollout workers
        receive as ranks 1..N; every worker gets the same ``RelayPlan`` (as a dict)."""
        if len(metadata) != actor_wg_world_size + rollout_world_size:
            raise ValueError(
                f"{len(metadata)} metadata for {actor_wg_world_size} actor and "
                f"{rollout_world_size} rollout workers"
            )
        source = metadata[0]
        if not source.get("is_master"):
            raise ValueError("actor rank 0 must be the checkpoint engine's master (is_master=True)")
        rollout = metadata[actor_wg_world_size:]
        plan = RelayPlan(
            source_addr=source["addr"],
            source_peer=source["peer_id"],
            receivers=tuple((i + 1, m["addr"], m["peer_id"]) for i, m in enumerate(rollout)),
        ).to_dict()
        world = rollout_world_size + 1
        actor_kwargs = {
            "rank": [0] + [-1] * (actor_wg_world_size - 1),
            "world_size": [world] * actor_wg_world_size,
            "plan": [plan] * actor_wg_world_size,
        }
        rollout_kwargs = {
            "rank": list(range(1, world)),
            "world_size": [world] * rollout_world_size,
            "plan": [plan] * rollout_world_size,
        }
        return actor_kwargs, rollout_kwargs

    def init_process_group(self, rank: int, world_size: int, plan: Mapping[str, Any] | RelayPlan) -> None:
        """Keeps this worker's rank and the plan; nothing connects until weights move."""
        if not isinstance(plan, RelayPlan):
            plan = RelayPlan(
                source_addr=plan["source_addr"],
                source_peer=plan["source_peer"],
                receivers=tuple(tuple(r) for r in plan["receivers"]),
                relay=bool(plan.get("relay", True)),
            )
        self.rank, self.world_size, self.plan = rank, world_size, plan

    def finalize(self) -> None:
        """Stops serving this update's buckets; with ``rebuild_group`` shuts the engine down."""
        if self._publisher is not None:
            self._publisher.close()
            self._publisher = None
        self._parts.clear()
        if self.rebuild_group:
            self.shutdown()
            self.rank = self.world_size = self.plan = None

    def shutdown(self) -> None:
        """Closes everything this engine holds (a later ``prepare`` starts afresh)."""
        if self._publisher is not None:
            self._publisher.close()
            self._publisher = None
        self._pool.clear()
        if self._engine is not None:
            self._engine.shutdown()
        self._engine = self._raw = None

    def set_destinations(self, tensors: Mapping[str, torch.Tensor] | None) -> None:
        """Receive into these tensors (the live model's parameters, by name) in place, instead
        of into fresh ones; every name, dtype and shape a bucket carries is checked against
        them before any byte lands. None: fresh tensors again."""
        self._into = None if tensors is None else dict(tensors)

    # -- source -----------------------------------------------------------------------------

    async def send_weights(self, weights: Any, global_steps: int | None = None) -> dict[str, Any]:
        """Publishes the weights in buckets and returns once every receiver has them all (or
        failed: ``ReceiversFailed`` after the others finished). Returns metrics for verl's
        trainer (``ferry/...``)."""
        plan = self._plan()
        if self.rank is None or self.rank < 0:
            async for _ in _walk(weights):  # producing each weight is collective over the actor group
                pass
            return {}
        if self.rank != 0 or not self.is_master:
            raise RuntimeError("only the master actor worker (rank 0) sends weights")
        start = time.perf_counter()
        self._update += 1
        live = {f"rank {r} ({addr})": addr for r, addr, _ in plan.receivers}
        self.outcomes = {}
        acked: dict[int, set[str]] = {}
        sent: list[int] = []
        bucket: dict[str, torch.Tensor] = {}
        size = total = 0
        index = 0
        async for name, tensor in _walk(weights):
            t = self._outgoing(name, tensor)
            if bucket and size + t.nbytes > self.bucket_size:
                await self._flush(bucket, index, False, global_steps, live, acked, sent, start)
                index += 1
                bucket, size = {}, 0
            bucket[name] = t
            size += t.nbytes
            total += t.nbytes
        await self._flush(bucket, index, True, global_steps, live, acked, sent, start)
        await self._wait_acks(sent, live, acked, start)
        ok = [r for r in live if r not in self.outcomes]
        for r in ok:
            self.outcomes[r] = "ok"
        seconds = time.perf_counter() - start
        failed = {r: why for r, why in self.outcomes.items() if why != "ok"}
        if failed and self.raise_on_failed_receivers:
            raise ReceiversFailed(failed, ok, f"weight update (step {global_steps})", self._version)
        return {
            "ferry/bytes": total,
            "ferry/seconds": seconds,
            "ferry/buckets": len(sent),
            "ferry/receivers_ok": len(ok),
            "ferry/receivers_failed": len(failed),
        }

    def _outgoing(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` as served: ``rollout_dtype`` if floating, contiguous, on ``device`` (no
        copy where it already is all three)."""
        t = tensor.detach()
        if self.rollout_dtype is not None and t.is_floating_point() and t.dtype != self.rollout_dtype:
            t = t.to(self.rollout_dtype)
        if self.device == "cpu" and t.device.type != "cpu":
            t = t.to("cpu")
        elif self.device.startswith("cuda") and t.device.type == "cpu" and torch.cuda.is_available():
            t = t.to(self.device)
        if t.device.type == "cuda":
            torch.cuda.current_stream(t.device).synchronize()
        return t.contiguous()

    async def _flush(
        self,
        bucket: dict[str, torch.Tensor],
        index: int,
        last: bool,
        step: int | None,
        live: dict[str, str],
        acked: dict[int, set[str]],
        sent: list[int],
        start: float,
    ) -> None:
        """Publishes ``bucket`` as the next version (after every live receiver has the one it
        replaces) and tells each live receiver what it holds. An empty bucket (no weights at
        all) is only told: the receivers end the update with nothing."""
        if len(sent) >= _KEEP:
            await self._wait_acks(sent[-_KEEP:-_KEEP + 1], live, acked, start)
        if bucket:
            await self._publish(bucket)
            sent.append(self._version)
            acked[self._version] = set()
        assert self._publisher is not None or not bucket
        desc = {
            "update": self._update,
            "step": step,
            "bucket": index,
            "version": self._version if bucket else 0,
            "name": self.name,
            "source": self._publisher.addr if bucket and self._publisher else "",
            "digest": self._publisher.digest if bucket and self._publisher else "",
            "last": last,
            "tensors": [[n, dtype_name(t.dtype), list(t.shape)] for n, t in bucket.items()],
        }
        await self._tell(desc, live)

    async def _publish(self, bucket: dict[str, torch.Tensor]) -> None:
        """Publishes ``bucket`` as the next version (the publisher starts with the first)."""
        self._version += 1
        version = self._version
        views = {n: as_broadcast(t, name=n) for n, t in bucket.items()}
        if self._publisher is None:
            self._publisher = await asyncio.to_thread(
                broadcast.Publisher,
                self._engine,
                views,
                name=self.name,
                version=version,
                chunk_size=self.chunk_size,
                keep_versions=_KEEP,
                auth_key_file=self.auth_key_file,
            )
        else:
            await asyncio.to_thread(self._publisher.publish, views, version)

    async def _tell(self, desc: dict[str, Any], live: dict[str, str]) -> None:
        """Sends ``desc`` (a bucket's description) to every receiver not yet failed, in parts
        that fit a notification; one that cannot be reached is failed (``outcomes``)."""
        assert self._raw is not None
        version = desc["version"]
        blob = zlib.compress(json.dumps(desc).encode())
        parts = [blob[i : i + _PART] for i in range(0, len(blob), _PART)] or [b""]
        for who, addr in list(live.items()):
            if who in self.outcomes:
                continue
            try:
                for i, p in enumerate(parts):
                    note = f"{_BUCKET}/{version}/{i}/{len(parts)}"
                    await asyncio.to_thread(self._raw.notify, addr, note, p)
            except ferry.FerryError as e:
                self.outcomes[who] = f"unreachable ({type(e).__name__}: {e})"

    async def _wait_acks(self, versions: list[int], live: dict[str, str], acked: dict[int, set[str]], start: float) -> None:
        """Waits until every receiver not yet failed has acknowledged every one of
        ``versions``; a receiver whose engine no longer answers, or that reports a failure,
        is failed (``outcomes``)."""
        assert self._raw is not None and self.plan is not None
        by_peer = {peer: f"rank {r} ({addr})" for r, addr, peer in self.plan.receivers}
        pause = 0.001
        last_probe = time.monotonic()
        while True:
            for note, message, peer, _key, _epoch in self._raw.take_notifications():
                who = by_peer.get(peer)
                if note != _ACK or who is None:
                    continue
                try:
                    ack = json.loads(message)
                except ValueError:
                    continue
                if ack.get("ok"):
                    acked.setdefault(int(ack.get("version", -1)), set()).add(who)
                else:
                    self.outcomes.setdefault(who, str(ack.get("error", "failed")))
            waiting = [
                who for who in live if who not in self.outcomes and any(who not in acked.get(v, ()) for v in versions)
            ]
            if not waiting:
                return
            if self.timeout is not None and time.perf_counter() - start > self.timeout:
                for who in waiting:
                    self.outcomes[who] = f"timed out after {self.timeout} s"
                return
            if time.monotonic() - last_probe > 0.5:
                last_probe = time.monotonic()
                for who in waiting:
                    why = await asyncio.to_thread(self._gone, live[who])
                    if why is not None:
                        self.outcomes[who] = why
                continue
            await asyncio.sleep(pause)
            pause = min(pause * 2, 0.02)

    def _gone(self, addr: str) -> str | None:
        """Why the receiver at ``addr`` is gone (its engine refuses a fresh connection), or
        None while it answers."""
        assert self._engine is not None
        try:
            self._engine.reresolve(addr).close()
            return None
        except ferry.FerryError as e:
            return f"gone mid-update ({type(e).__name__}: {e})"

    # -- receivers --------------------------------------------------------------------------

    async def receive_weights(self, global_steps: int | None = None) -> AsyncIterator[tuple[str, torch.Tensor]]:
        """Yields ``(name, tensor)`` for every tensor of every bucket, each bucket once it is
        pulled and verified."""
        plan = self._plan()
        if self.rank is None or self.rank < 1:
            raise RuntimeError("only rollout workers (rank 1..N) receive weights")
        start = time.perf_counter()
        self.summaries = []
        current = self._done_update
        try:
            while True:
                desc = await self._next_bucket(plan, start)
                current = max(current, int(desc.get("update", 0)))
                version = int(desc["version"])
                if desc["tensors"]:
                    try:
                        tensors = await self._pull_bucket(desc, start)
                    except BaseException as e:
                        await asyncio.to_thread(self._ack, plan, version, e)
                        raise
                    await asyncio.to_thread(self._ack, plan, version, None)
                    for item in tensors.items():
                        yield item
                if desc.get("last"):
                    return
        finally:
            # What is left of this update (a failed one's later buckets) is dropped as it comes.
            self._done_update = current
            # Buffers of tensors this update did not carry are let go.
            self._pool = {k: t for k, t in self._pool.items() if k in self._used}
            self._used = set()

    async def _next_bucket(self, plan: RelayPlan, start: float) -> dict[str, Any]:
        """The next bucket description the source sent (parts joined), oldest first."""
        assert self._raw is not None
        pause = 0.001
        while True:
            for note, message, peer, _key, _epoch in self._raw.take_notifications():
                if peer != plan.source_peer or not note.startswith(_BUCKET + "/"):
                    continue
                try:
                    version, i, n = (int(x) for x in note[len(_BUCKET) + 1 :].split("/"))
                except ValueError:
                    continue
                self._parts.setdefault(version, {})[i] = message
                self._parts[version]["n"] = n  # type: ignore[assignment]
            for version in sorted(self._parts):
                parts = self._parts[version]
                n = int(parts.get("n", 0))  # type: ignore[arg-type]
                if n and all(i in parts for i in range(n)):
                    del self._parts[version]
                    desc = json.loads(zlib.decompress(b"".join(parts[i] for i in range(n))))
                    if int(desc.get("update", 0)) > self._done_update:
                        return desc
            if self.timeout is not None and time.perf_counter() - start > self.timeout:
                raise TimeoutError(f"no weights from the source {plan.source_addr} within {self.timeout} s")
            await asyncio.sleep(pause)
            pause = min(pause * 2, 0.02)

    async def _pull_bucket(self, desc: Mapping[str, Any], start: float) -> dict[str, torch.Tensor]:
        version = int(desc["version"])
        wanted = [(str(n), str(d), [int(x) for x in s]) for n, d, s in desc["tensors"]]
        if self._into is not None:
            problems = mismatches(wanted, self._into)
            if problems:
                raise ParameterMismatch(version, problems)
            into = {n: self._into[n] for n, _, _ in wanted}
        else:
            device = "cpu" if self.device == "cpu" or not torch.cuda.is_available() else self.device
            into = {n: self._buffer(n, d, s, device) for n, d, s in wanted}
        left = None if self.timeout is None else max(self.timeout - (time.perf_counter() - start), 0.0)
        summary = await asyncio.to_thread(
            broadcast.pull,
            self._engine,
            desc["source"],
            {n: as_broadcast(t, name=n) for n, t in into.items()},
            name=desc["name"],
            version=version,
            relay=self.relay,
            timeout=left,
            verify_at_rest=self.verify_at_rest,
            auth_key_file=self.auth_key_file,
            expect_manifest=desc["digest"],
        )
        self.summaries.append(summary)
        return into

    def _buffer(self, name: str, dtype: str, shape: list[int], device: str) -> torch.Tensor:
        """A receive buffer for tensor ``name``: the previous update's where it had the same
        dtype and shape (``reuse_buffers``), else a new one."""
        key = (name, dtype, tuple(shape), device)
        self._used.add(key)
        t = self._pool.get(key) if self.reuse_buffers else None
        if t is None:
            t = torch.empty(shape, dtype=torch_dtype(dtype), device=device)
            if self.reuse_buffers:
                self._pool[key] = t
        return t

    def _ack(self, plan: RelayPlan, version: int, error: BaseException | None) -> None:
        """Tells the source how this receiver's pull of ``version`` ended."""
        assert self._raw is not None
        ack = {"version": version, "rank": self.rank, "ok": error is None}
        if error is not None:
            ack["error"] = f"{type(error).__name__}: {error}"[:4000]
        try:
            self._raw.notify(plan.source_addr, _ACK, json.dumps(ack).encode())
        except ferry.FerryError:
            pass  # the source is gone: it learns nothing more from this receiver

    def _plan(self) -> RelayPlan:
        if self.plan is None or self._engine is None:
            raise RuntimeError("prepare() and init_process_group() come before weights move")
        return self.plan

