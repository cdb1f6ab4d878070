"""How many valid items a micro-batch holds: the denominator's unit."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import Tensor

# The named counts live in the public `counts` module; these names stay importable from here.
from token_mean.counts import IGNORE_INDEX, count_valid_labels

CountFn = Callable[[Any], "int | float | Tensor"]


def check_count(value: Any, source: str) -> tuple[Tensor | float | None, str]:
    """Check the type of one count: ``(count, "")``, or ``(None, what is wrong)``.

    Only the type: whether the value is negative or NaN is checked where it is already on the host (lookahead) or
    flagged on the device (deferred), so that no count costs a host sync of its own.
    """
    if isinstance(value, Tensor):
        if value.numel() != 1 or value.is_complex():
            return None, (
                f"{source} gave a tensor of shape {tuple(value.shape)} and dtype {value.dtype}, not one real number:"
                " return `mask.sum()`, not `mask`"
            )
        return value.detach().reshape(()), ""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None, f"{source} gave {type(value).__name__} {value!r}, not an int, a float or a one-element tensor"
    return float(value), ""


def as_count(value: Any, argument: str) -> Tensor | float:
    """:func:`check_count`, raising a ``TypeError`` for a count of the wrong type."""
    count, problem = check_count(value, f"`{argument}`")
    if count is None:
        raise TypeError(problem + ".")
    return count


__all__ = ["IGNORE_INDEX", "CountFn", "as_count", "check_count", "count_valid_labels"]
