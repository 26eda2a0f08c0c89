"""vLLM's plugin hook for Ferry: the wheel's ``vllm.general_plugins`` entry point ``ferry``.

vLLM calls ``register()`` in every process it starts (``vllm.plugins.load_general_plugins``).
It names the ``ferry`` weight-transfer backend in both of vLLM's factories by module path, so
``ferry.vllm`` (and torch with it) is imported only when a config names the backend
(``weight_transfer_config={"backend": "ferry"}``). Importing this module imports nothing of
vLLM or torch.
"""

from __future__ import annotations

__all__ = ["BACKEND", "register"]

BACKEND = "ferry"
"""The backend name vLLM's ``WeightTransferConfig.backend`` takes for Ferry."""


def register() -> None:
    """Registers ``ferry`` with ``WeightTransferEngineFactory`` (``FerryWeightTransferEngine``)
    and ``WeightTransferTrainerFactory`` (``FerryTrainerWeightTransferEngine``), lazily by module
    path. Calling it again (vLLM loads plugins once per process, a test may load them twice)
    changes nothing."""
    from vllm.distributed.weight_transfer.factory import (
        WeightTransferEngineFactory,
        WeightTransferTrainerFactory,
    )

    for factory, cls in (
        (WeightTransferEngineFactory, "FerryWeightTransferEngine"),
        (WeightTransferTrainerFactory, "FerryTrainerWeightTransferEngine"),
    ):
        if BACKEND not in factory._registry:
            factory.register_engine(BACKEND, "ferry.vllm", cls)
