"""vLLM's weight-transfer backend ``ferry``: a trainer's weights to vLLM workers over Ferry's
verified broadcast (relay plan, BLAKE3 per chunk bound to a manifest, versions, keys).

vLLM (0.33) creates weight-transfer engines by backend name: ``WeightTransferEngineFactory``
in every inference worker (``weight_transfer_config={"backend": "ferry"}``) and
``WeightTransferTrainerFactory`` in the trainer (from ``FerryTrainerInitInfo``, whose
``backend`` is ``"ferry"``). The wheel's ``vllm.general_plugins`` entry point
(``ferry.vllm_plugin:register``) names this module in both; vLLM loads it in every process::

    # trainer
    from vllm.distributed.weight_transfer import ModuleSource, WeightTransferTrainerFactory
    from ferry.vllm import FerryTrainerInitInfo
    trainer = WeightTransferTrainerFactory.trainer_init(
        FerryTrainerInitInfo(rank=0, listen="10.0.0.1:0"), client=client, source=ModuleSource(model))
    trainer.send_weights()      # every step: version 1, 2, ...

    # inference: LLM(..., weight_transfer_config=WeightTransferConfig(backend="ferry"))

Trainer side (``FerryTrainerWeightTransferEngine``): ``send_weights`` publishes the source's
tensors as the next version, straight from their memory where they are contiguous host or
CUDA memory (a copy otherwise), then drives the client's ``start_weight_update``,
``update_weights`` (the version, its manifest digest and the publisher's address) and
``finish_weight_update``. Each worker pulls the version from the trainer and from the workers
that already hold chunks of it, so the trainer sends each byte about once. With a
``FanoutClient`` (one client per vLLM instance), one receiver's failure does not stop the
others: they finish, and ``send_weights`` then raises ``ReceiversFailed`` naming it;
``outcomes`` says what each receiver did.

Worker side (``FerryWeightTransferEngine``): ``receive_weights`` checks the parameters the
update names against the model's (name, dtype, shape; every problem listed, before anything is
registered or moved) and pulls the version, every chunk checked against the manifest whose
digest the trainer sent, in the mode the init info names:

- ``"in_place"``: into the model's parameters, by name. A pull that fails after its first byte
  leaves them torn (``ferry.broadcast.TornError``).
- ``"staged"``: into staging tensors beside the parameters, which the worker relays from until
  ``finish_weight_update`` copies them into the parameters. A failed pull leaves the model on
  its old version.
- ``"checkpoint"`` (the default): into fresh tensors of the shapes the update names, in host
  memory (``staging_device``), handed once verified to the model's own ``load_weights`` (vLLM's
  checkpoint format: fused, renamed and sharded parameters), inside vLLM's layerwise reload
  where ``layerwise_reload`` (the default) is set.

Keys: ``auth_key_file`` in ``FerryTrainerInitInfo`` (the trainer's keyring) and
``worker_auth_key_file`` (the path of the same keyring on the workers; default: the same path)
make every control request and chunk authenticated; a worker without the key is refused.
"""

from __future__ import annotations

import os
import socket
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, ClassVar, Mapping, Self

import torch
from vllm.distributed.weight_transfer.base import (
    ParamMeta,
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    VLLMWeightSyncClient,
    WeightSource,
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

import ferry
from ferry._rl import ParameterMismatch, ReceiversFailed, as_broadcast, dtype_name, mismatches, torch_dtype
from ferry.broadcast import Publisher, PullSummary, pull
from ferry.vllm_plugin import BACKEND

__all__ = [
    "BACKEND",
    "FanoutClient",
    "FerryTrainerInitInfo",
    "FerryTrainerWeightTransferEngine",
    "FerryWeightTransferEngine",
    "FerryWeightTransferInitInfo",
    "FerryWeightTransferUpdateInfo",
    "ParameterMismatch",
    "ReceiversFailed",
]

MODES = ("in_place", "staged", "checkpoint")


@dataclass
class FerryWeightTransferInitInfo(WeightTransferInitInfo):
    """What a worker is told once (``init_weight_transfer_engine``); the trainer builds it
    from ``FerryTrainerInitInfo``."""

    name: str = "policy"
    """The broadcast's name (the trainer's ``FerryTrainerInitInfo.name``)."""
    mode: str = "checkpoint"
    """``"in_place"``, ``"staged"`` or ``"checkpoint"`` (the module's docs)."""
    staging_device: str = "cpu"
    """``"checkpoint"`` mode: where the version is staged before ``load_weights`` (host memory
    by default; ``"model"``: the model's device)."""
    auth_key_file: str | None = None
    """The keyring file on the worker (the trainer's keys); None: no key (or
    ``FERRY_AUTH_KEY_FILE``)."""
    listen: str | None = None
    """Where the worker's engine listens to relay (``HOST:PORT``); None: ``FERRY_BIND_ADDRESS``,
    else the address this host reaches the trainer from, any free port."""
    timeout: float | None = None
    """Seconds one pull may take; None: as long as it takes."""
    linger: float = 30.0
    """In place: seconds a worker that has the version keeps relaying to workers still pulling
    it (it returns as soon as none is)."""
    layerwise_reload: bool = True
    """``"checkpoint"`` mode: run vLLM's layerwise reload around ``load_weights``."""

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, not {self.mode!r}")


@dataclass
class FerryWeightTransferUpdateInfo(WeightTransferUpdateInfo):
    """One update: the version to pull, the digest of its manifest, where the trainer
    publishes it, and the parameters (name, dtype name, shape). Leave the three lists empty to
    reuse the previous update's parameters."""

    version: int
    manifest: str
    source: str
    names: list[str] = field(default_factory=list)
    dtype_names: list[str] = field(default_factory=list)
    shapes: list[list[int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if isinstance(self.version, bool) or not isinstance(self.version, int) or self.version < 0:
            raise ValueError(f"version must be a whole number, not {self.version!r}")
        n = len(self.names)
        if len(self.dtype_names) != n or len(self.shapes) != n:
            raise ValueError(
                f"names, dtype_names and shapes must be as long as one another: got "
                f"{n}, {len(self.dtype_names)} and {len(self.shapes)}"
            )


@dataclass
class FerryTrainerInitInfo(TrainerInitInfo):
    """The trainer's side: where it publishes, and what it tells the workers."""

    backend: ClassVar[str] = BACKEND

    name: str = "policy"
    """The broadcast's name."""
    listen: str = "127.0.0.1:0"
    """Where the trainer's engine listens (``HOST:PORT``): an address the workers reach."""
    mode: str = "checkpoint"
    """How workers apply a version (``FerryWeightTransferInitInfo.mode``)."""
    staging_device: str = "cpu"
    """``FerryWeightTransferInitInfo.staging_device``."""
    auth_key_file: str | None = None
    """The trainer's keyring file: control requests and chunks are authenticated. None:
    ``FERRY_AUTH_KEY_FILE`` where set."""
    worker_auth_key_file: str | None = None
    """The same keyring's path on the workers; None: ``auth_key_file``."""
    chunk_size: int | None = None
    """Bytes per chunk (each with its BLAKE3); None: the broadcast's default (1 MiB)."""
    worker_listen: str | None = None
    """``FerryWeightTransferInitInfo.listen`` for every worker."""
    timeout: float | None = None
    """``FerryWeightTransferInitInfo.timeout``."""
    linger: float = 30.0
    """``FerryWeightTransferInitInfo.linger``."""
    layerwise_reload: bool = True
    """``FerryWeightTransferInitInfo.layerwise_reload``."""

    def worker_init(self) -> FerryWeightTransferInitInfo:
        """The init info the workers are sent."""
        key = self.worker_auth_key_file if self.worker_auth_key_file is not None else self.auth_key_file
        return FerryWeightTransferInitInfo(
            name=self.name,
            mode=self.mode,
            staging_device=self.staging_device,
            auth_key_file=key,
            listen=self.worker_listen,
            timeout=self.timeout,
            linger=self.linger,
            layerwise_reload=self.layerwise_reload,
        )


def _key(path: str | None) -> str | None:
    """The keyring file: ``path``, else ``FERRY_AUTH_KEY_FILE`` where set and not empty (as the
    engine reads it), for the broadcast's control requests as much as the engine's."""
    return path or os.environ.get("FERRY_AUTH_KEY_FILE") or None


def _listen_towards(source: str) -> str:
    """``HOST:0`` for the address this host reaches ``source`` (``HOST:PORT``) from: a UDP
    socket's route lookup, nothing is sent."""
    host = source.rsplit(":", 1)[0].strip("[]")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect((host, 9))
        mine = s.getsockname()[0]
    return f"[{mine}]:0" if ":" in mine else f"{mine}:0"


class FerryWeightTransferEngine(WeightTransferEngine[FerryWeightTransferInitInfo, FerryWeightTransferUpdateInfo]):
    """The worker side (the module's docs). ``progress``, when set, is called as
    ``progress(bytes, total)`` while a pull verifies chunks; an exception it raises stops the
    pull. ``last_summary`` is the last pull's ``ferry.broadcast.PullSummary``; ``staging`` the
    staging tensors of a staged version not committed yet (empty otherwise)."""

    init_info_cls = FerryWeightTransferInitInfo
    update_info_cls = FerryWeightTransferUpdateInfo
    supports_draft_weight_update = True

    def __init__(self, config: Any, vllm_config: Any, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self.init_info: FerryWeightTransferInitInfo | None = None
        self.progress: Callable[[int, int], None] | None = None
        self.last_summary: PullSummary | None = None
        self.version: int | None = None
        self._engine: ferry.Engine | None = None
        self._meta: list[tuple[str, str, list[int]]] = []
        self._staged: tuple[PullSummary, int] | None = None
        self.staging: dict[str, torch.Tensor] = {}
        self._checkpoint_open = False

    def init_transfer_engine(self, init_info: FerryWeightTransferInitInfo) -> None:
        """Keeps the init info; the engine is made at the first update, when the trainer's
        address is known (to listen on the interface that reaches it)."""
        self.init_info = init_info

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """vLLM's ``update_weights`` (parse, ``receive_weights``, synchronize the device), whose
        synchronize is skipped where no accelerator is (a CPU worker; torch's CUDA build raises
        there)."""
        self.receive_weights(self.parse_update_info(update_info))
        if torch.accelerator.is_available():
            torch.accelerator.synchronize()

    def start_weight_update(self) -> None:
        """Checkpoint mode with layerwise reload: vLLM's ``initialize_layerwise_reload``."""
        info = self._info()
        self._drop_staged()
        if info.mode == "checkpoint" and info.layerwise_reload:
            from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

            initialize_layerwise_reload(self.model)
            self._checkpoint_open = True

    def receive_weights(self, update_info: FerryWeightTransferUpdateInfo) -> None:
        """Pulls ``update_info.version`` (module docs); refuses a parameter mismatch with
        ``ParameterMismatch`` before anything moves."""
        info = self._info()
        if update_info.names:
            self._meta = [
                (n, d, [int(x) for x in s])
                for n, d, s in zip(update_info.names, update_info.dtype_names, update_info.shapes)
            ]
        if not self._meta:
            raise ValueError("the update names no parameters and no earlier update named any")
        if info.mode == "checkpoint":
            where = self.device if info.staging_device == "model" else torch.device(info.staging_device)
            targets = {n: torch.empty(s, dtype=torch_dtype(d), device=where) for n, d, s in self._meta}
        else:
            params = dict(self.model.named_parameters())
            problems = mismatches(self._meta, params)
            if problems:
                raise ParameterMismatch(update_info.version, problems)
            targets = {n: params[n].data for n, _, _ in self._meta}
        views = {n: as_broadcast(t, name=n) for n, t in targets.items()}
        engine = self._engine_for(update_info.source)
        common = dict(
            name=info.name,
            version=update_info.version,
            timeout=info.timeout,
            progress=self.progress,
            auth_key_file=_key(info.auth_key_file),
            expect_manifest=update_info.manifest,
        )
        if info.mode == "staged":
            spare = {n: torch.empty_like(t) for n, t in targets.items()}
            staging = {n: as_broadcast(t, name=n) for n, t in spare.items()}
            self._drop_staged()
            # Relays from the staging until finish_weight_update commits it.
            summary = pull(engine, update_info.source, views, mode="staged", staging=staging, linger=0.0, **common)
            self._staged = (summary, update_info.version)
            self.staging = spare
        else:
            summary = pull(engine, update_info.source, views, linger=info.linger, **common)
        self.last_summary = summary
        if info.mode == "checkpoint":
            self.model.load_weights(list(targets.items()))
        if info.mode != "staged":
            self.version = update_info.version

    def finish_weight_update(self) -> None:
        """Staged: copies the verified staging into the parameters. Checkpoint mode with
        layerwise reload: vLLM's ``finalize_layerwise_reload``."""
        if self._staged is not None:
            summary, version = self._staged
            self._staged = None
            self.staging = {}
            summary.commit()
            self.version = version
        if self._checkpoint_open:
            from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

            self._checkpoint_open = False
            finalize_layerwise_reload(self.model, self.model_config)

    def shutdown(self) -> None:
        """Drops an uncommitted staged version and the engine."""
        self._drop_staged()
        if self._engine is not None:
            self._engine.shutdown()
            self._engine = None

    def _info(self) -> FerryWeightTransferInitInfo:
        if self.init_info is None:
            raise RuntimeError("the ferry weight transfer engine was not initialized: call init_weight_transfer_engine first")
        return self.init_info

    def _drop_staged(self) -> None:
        if self._staged is not None:
            self._staged[0].close()
            self._staged = None
        self.staging = {}

    def _engine_for(self, source: str) -> ferry.Engine:
        if self._engine is None:
            info = self._info()
            listen = info.listen or os.environ.get("FERRY_BIND_ADDRESS") or _listen_towards(source)
            if ":" not in listen.rsplit("]", 1)[-1]:
                listen = f"{listen}:0"
            self._engine = ferry.Engine(listen=listen, auth_key_file=_key(info.auth_key_file))
        return self._engine


class FerryTrainerWeightTransferEngine(TrainerWeightTransferEngine[FerryTrainerInitInfo]):
    """The trainer side (the module's docs). ``version`` is the last version published;
    ``outcomes`` maps each receiver a ``FanoutClient`` names to ``"ok"`` or what it raised, for
    the last ``send_weights``."""

    init_info_cls = FerryTrainerInitInfo

    def __init__(
        self,
        *,
        client: VLLMWeightSyncClient,
        source: WeightSource,
        init_info: FerryTrainerInitInfo,
        is_sender: bool = True,
        rank: int = 0,
    ) -> None:
        super().__init__(client=client, source=source, is_sender=is_sender, rank=rank)
        self.init_info = init_info
        self.version = 0
        self.outcomes: dict[str, str] = {}
        self._engine: ferry.Engine | None = None
        self._publisher: Publisher | None = None
        self._held: dict[int, list[torch.Tensor]] = {}
        self._sent_meta: list[ParamMeta] | None = None

    @classmethod
    def trainer_init(
        cls,
        init_info: FerryTrainerInitInfo,
        *,
        client: VLLMWeightSyncClient,
        source: WeightSource | None = None,
    ) -> Self:
        """Checks the source, makes the sender's engine (listening on ``init_info.listen``) and
        sends the workers their init info; other ranks only keep the source."""
        if source is None:
            raise ValueError("the ferry trainer weight transfer needs a WeightSource")
        if not source.implements_iter_full():
            raise TypeError(f"ferry publishes full tensors, but {type(source).__name__} does not implement iter_full()")
        if init_info.mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, not {init_info.mode!r}")
        for m in source.metadata:
            if m.owners is not None and m.owners[0] != 0:
                raise ValueError(
                    f"parameter {m.name!r} is owned first by rank {m.owners[0]}, but rank 0 "
                    "publishes every parameter: every parameter's owners must start at rank 0"
                )
        engine = cls(client=client, source=source, init_info=init_info, is_sender=init_info.is_sender, rank=init_info.rank)
        if engine.is_sender:
            engine._engine = ferry.Engine(listen=init_info.listen, auth_key_file=_key(init_info.auth_key_file))
            client.init_weight_transfer_engine(asdict(init_info.worker_init()))
        return engine

    def send_weights(self) -> None:
        """Publishes the next version and drives the update round trip (module docs)."""
        assert self.source is not None
        meta = self.source.metadata
        if not self.is_sender:
            for _ in self.source.iter_full():
                pass
            return
        version = self.version + 1
        tensors = self._collect(meta)
        views = {n: as_broadcast(t, name=n) for n, t in tensors.items()}
        info = self.init_info
        if self._publisher is None:
            assert self._engine is not None
            self._publisher = Publisher(
                self._engine,
                views,
                name=info.name,
                version=version,
                chunk_size=info.chunk_size,
                keep_versions=1,
                auth_key_file=_key(info.auth_key_file),
            )
        else:
            self._publisher.publish(views, version)
        # The tensors (and any contiguous copies) live while their version is served.
        self._held = {version: list(tensors.values())}
        self.version = version
        update = FerryWeightTransferUpdateInfo(
            version=version, manifest=self._publisher.digest, source=self._publisher.addr
        )
        if meta != self._sent_meta:
            update.names = [m.name for m in meta]
            update.dtype_names = [dtype_name(m.dtype) for m in meta]
            update.shapes = [list(m.shape) for m in meta]
        self._round(asdict(update), version)
        self._sent_meta = meta

    def _collect(self, meta: list[ParamMeta]) -> dict[str, torch.Tensor]:
        """The source's tensors in metadata order, checked against it; contiguous ones as they
        are, others copied."""
        out: dict[str, torch.Tensor] = {}
        it = iter(meta)
        for name, t in self.source.iter_full():  # type: ignore[union-attr]
            m = next(it, None)
            if m is None or m.name != name or m.dtype != t.dtype or tuple(t.shape) != tuple(m.shape):
                raise ValueError(
                    f"the WeightSource's metadata disagrees with its iteration at {name!r} "
                    f"({t.dtype}, {tuple(t.shape)}): declared {m}"
                )
            t = t.detach()
            out[name] = t if t.is_contiguous() else t.contiguous()
        left = [m.name for m in it]
        if left:
            raise ValueError(f"the WeightSource yielded no tensor for {left[:5]} ({len(left)} declared in metadata)")
        if any(t.is_cuda for t in out.values()):
            torch.cuda.synchronize()
        return out

    def _round(self, update: dict[str, Any], version: int) -> None:
        """start, update, finish through the client; with a ``FanoutClient``, receivers that
        fail a step are left out of the next ones and named at the end."""
        failed: dict[str, BaseException] = {}
        for stage, call in (
            ("start_weight_update", lambda: self.client.start_weight_update()),
            ("update_weights", lambda: self.client.update_weights(update)),
            ("finish_weight_update", lambda: self.client.finish_weight_update(str(version))),
        ):
            try:
                call()
            except ReceiversFailed as e:
                failed.update(e.failed)
                if not e.succeeded:
                    break
        names = getattr(self.client, "names", None) or []
        self.outcomes = {n: ("ok" if n not in failed else f"{type(failed[n]).__name__}: {failed[n]}") for n in names}
        if failed:
            ok = [n for n in names if n not in failed]
            raise ReceiversFailed(failed, ok, f"the weight update to version {version}", version)

    def shutdown(self) -> None:
        """Stops publishing and the engine."""
        if self._publisher is not None:
            self._publisher.close()
            self._publisher = None
        self._held.clear()
        if self._engine is not None:
            self._engine.shutdown()
            self._engine = None


class FanoutClient:
    """A ``VLLMWeightSyncClient`` over several named ones (one per vLLM instance: vLLM's
    ``HTTPVLLMWeightSyncClient`` or ``RayVLLMWeightSyncClient`` for each), called at once. A receiver that fails a call is left out of the rest of
    the round (until the next ``start_weight_update``); the call raises ``ReceiversFailed``
    naming it only after the others returned."""

    def __init__(self, clients: Mapping[str, VLLMWeightSyncClient]):
        if not clients:
            raise ValueError("FanoutClient needs at least one client")
        self.clients = dict(clients)
        self.names = list(self.clients)
        self._out: set[str] = set()
        self._lock = threading.Lock()

    def _all(self, stage: str, call: Callable[[VLLMWeightSyncClient], Any]) -> None:
        live = [n for n in self.names if n not in self._out]
        failed: dict[str, BaseException] = {}
        with ThreadPoolExecutor(max_workers=max(1, len(live))) as pool:
            futures = {n: pool.submit(call, self.clients[n]) for n in live}
            for n, f in futures.items():
                try:
                    f.result()
                except Exception as e:  # each receiver's failure is reported, not raised alone
                    failed[n] = e
        with self._lock:
            self._out.update(failed)
        if failed:
            raise ReceiversFailed(failed, [n for n in live if n not in failed], stage)

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._out.clear()
        self._all("init_weight_transfer_engine", lambda c: c.init_weight_transfer_engine(init_info))

    def start_weight_update(self) -> None:
        self._out.clear()
        self._all("start_weight_update", lambda c: c.start_weight_update())

    def update_weights(self, update_info: Any) -> None:
        self._all("update_weights", lambda c: c.update_weights(update_info))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._all("finish_weight_update", lambda c: c.finish_weight_update(weight_version))
