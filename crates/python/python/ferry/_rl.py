"""Torch tensors on Ferry's verified broadcast: what the RL adapters (``ferry.vllm``, and
``ferry.verl`` where it does the same thing) share.

``ferry.broadcast`` publishes and pulls NumPy arrays, GPU arrays (``__cuda_array_interface__``)
and registrations, and binds each tensor's dtype and shape into the manifest where the array
says them. Torch tensors are neither (no buffer protocol; a CUDA tensor's interface has no
typestr for bfloat16), so ``as_broadcast(t)`` gives a view of ``t``'s own memory, no copy,
that registers as its bytes and tells the broadcast its dtype name and shape. A receiver whose
tensor differs in name, dtype or shape is refused by the broadcast before any byte moves.

Imports torch lazily (the first call), so importing this module costs nothing.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

import numpy as np

__all__ = ["ParameterMismatch", "ReceiversFailed", "as_broadcast", "dtype_name", "mismatches", "torch_dtype"]


class ParameterMismatch(ValueError):
    """A receiver's parameters differ from the ones an update sends (``problems``, one line
    each, as ``mismatches`` writes them); nothing was registered or moved."""

    def __init__(self, version: int, problems: list[str]):
        self.version = version
        self.problems = list(problems)
        super().__init__(
            f"the update to version {version} was refused before any byte moved: " + "; ".join(self.problems)
        )


class ReceiversFailed(RuntimeError):
    """Some receivers failed an update (``failed``: receiver name to what it raised, or why);
    the others (``succeeded``) went on and finished it. ``what`` names the update."""

    def __init__(self, failed: Mapping[str, Any], succeeded: Iterable[str], what: str, version: int = 0):
        self.failed = dict(failed)
        self.succeeded = list(succeeded)
        self.what = what
        self.version = version

        def why(e: Any) -> str:
            return f"{type(e).__name__}: {e}" if isinstance(e, BaseException) else str(e)

        named = "; ".join(f"{n} ({why(e)})" for n, e in self.failed.items())
        super().__init__(
            f"{what}: {len(self.failed)} receiver(s) failed: {named}; {len(self.succeeded)} finished it"
        )

# Torch dtypes the broadcast's manifest names (ferry.broadcast's NumPy names).
_NAMES = (
    "float64",
    "float32",
    "float16",
    "bfloat16",
    "int64",
    "int32",
    "int16",
    "int8",
    "uint64",
    "uint32",
    "uint16",
    "uint8",
    "bool",
)


def dtype_name(dtype: Any) -> str:
    """The name of a torch dtype as vLLM's update infos and the manifest write it
    (``torch.bfloat16`` -> ``"bfloat16"``)."""
    return str(dtype).removeprefix("torch.")


def torch_dtype(name: str) -> Any:
    """The torch dtype named ``name`` (``"bfloat16"``); ``ValueError`` for any other name."""
    import torch

    dt = getattr(torch, name, None) if name in _NAMES else None
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"no torch dtype the broadcast carries is named {name!r}")
    return dt


class _HostBytes(np.ndarray):
    """A host tensor's bytes (a uint8 array over its memory) that report the tensor's dtype
    name and shape, which is all ``ferry.broadcast`` reads of them besides the buffer."""

    _kind: tuple[str, tuple[int, ...]] = ("uint8", ())

    @property  # type: ignore[override]
    def dtype(self) -> str:  # noqa: D401 - the broadcast reads str(dtype)
        return self._kind[0]

    @property  # type: ignore[override]
    def shape(self) -> tuple[int, ...]:
        return self._kind[1]


class _GpuBytes:
    """A CUDA tensor's bytes for ``register_gpu`` (its uint8 view's array interface), with the
    tensor's dtype name and shape. Holds the tensor, so its memory outlives the view."""

    def __init__(self, t: Any, flat: Any):
        self._t = t
        self.__cuda_array_interface__ = flat.__cuda_array_interface__
        self.dtype = dtype_name(t.dtype)
        self.shape = tuple(int(d) for d in t.shape)


def as_broadcast(t: Any, *, name: str = "") -> Any:
    """``t`` (a contiguous torch tensor, host or CUDA) as a tensor ``ferry.broadcast`` takes,
    over ``t``'s own memory (no copy): publish it, or pull into it. A non-contiguous tensor is
    refused with ``ValueError`` naming ``name`` (copy it with ``.contiguous()`` where a copy is
    what you want). A pull into the view writes ``t``'s memory in place."""
    import torch

    if not isinstance(t, torch.Tensor):
        raise TypeError(f"tensor {name!r}: expected a torch.Tensor, not {type(t).__name__}")
    if dtype_name(t.dtype) not in _NAMES:
        raise ValueError(f"tensor {name!r}: the broadcast does not carry {t.dtype}")
    if not t.is_contiguous():
        raise ValueError(f"tensor {name!r} is not contiguous: its bytes are not one range")
    flat = t.detach().reshape(-1)
    flat = flat if flat.dtype == torch.uint8 else flat.view(torch.uint8)
    if t.is_cuda:
        return _GpuBytes(t, flat)
    if t.device.type != "cpu":
        raise ValueError(f"tensor {name!r} lives on {t.device}, which the broadcast cannot reach")
    view = flat.numpy().view(_HostBytes)
    view._kind = (dtype_name(t.dtype), tuple(int(d) for d in t.shape))
    return view


def mismatches(
    expected: Iterable[tuple[str, str, Iterable[int]]], targets: Mapping[str, Any]
) -> list[str]:
    """Every way ``targets`` (name to torch tensor) differs from ``expected`` (name, dtype name,
    shape), one line each: a name missing from ``targets``, another dtype, another shape. Names
    of ``targets`` that ``expected`` leaves out are not problems (an update may be partial)."""
    problems = []
    for name, dtype, shape in expected:
        t = targets.get(name)
        if t is None:
            problems.append(f"parameter {name!r}: the model has no parameter of that name")
            continue
        have = dtype_name(t.dtype)
        if have != dtype:
            problems.append(f"parameter {name!r}: sent as {dtype}, the model's is {have}")
        want = [int(d) for d in shape]
        if list(t.shape) != want:
            problems.append(f"parameter {name!r}: sent with shape {want}, the model's is {list(t.shape)}")
    return problems
