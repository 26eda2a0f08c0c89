"""One sentence for a failed transfer, shared by the compatibility layers (``ferry.mooncake``,
``ferry.nixl``): the typed Ferry exception, what completed, and which WRITEs may have landed."""

from __future__ import annotations

from typing import Any


def effect(outcome: Any) -> str:
    """``"; WRITEs from op K on may have landed (uncertain)"``, or ``""`` when the outcome proves
    no byte of a failed WRITE landed (or there is no outcome)."""
    if outcome is None or outcome.remote_effect == "none":
        return ""
    return f"; WRITEs from op {outcome.completed_ops} on may have landed ({outcome.remote_effect})"


def sentence(e: BaseException) -> str:
    """``"Timeout: op 3 of the request failed: timeout; ...; WRITEs from op 3 on may have
    landed (uncertain)"``: the exception's type and message, and what its outcome (if any) says
    of the WRITEs."""
    return f"{type(e).__name__}: {e}{effect(getattr(e, 'outcome', None))}"


def of_outcome(outcome: Any) -> str:
    """The sentence of a failed ``Outcome`` (``outcome.raise_for_failure()``'s exception)."""
    try:
        outcome.raise_for_failure()
    except Exception as e:  # the typed FerryError the outcome names
        return sentence(e)
    return "completed"
