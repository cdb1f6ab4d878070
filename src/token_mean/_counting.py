"""How many valid items a micro-batch holds: the denominator's unit."""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor

from token_mean import _torch
from token_mean._counts import IGNORE_INDEX, host_count
from token_mean._problems import Problem

CountFn = Callable[[Any], Any]  # -> int | float | one-element Tensor; `Any` so YAML can name an unannotated function


def first_labels(batch: Any) -> Tensor | None:
    """Valid labels in the first position of each row: by how much counting unshifted labels over-counts a model
    that shifts them itself (on the device; None for a batch without 2-d ``"labels"``)."""
    labels = batch.get("labels") if isinstance(batch, Mapping) else None
    if not isinstance(labels, Tensor) or labels.dim() < 2:
        return None
    return (labels[..., 0] != IGNORE_INDEX).sum()


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
        count = value.detach() if value.requires_grad else value  # no op dispatched for what is already plain
        return (count if count.dim() == 0 else count.reshape(())), ""
    # numbers.Real admits numpy's scalars (numpy.int64 from `.sum()` of an array) as well as int and float
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None, f"{source} gave {type(value).__name__} {value!r}, not an int, a float or a one-element tensor"
    return float(value), ""


def device_count(value: Any, source: str, device: Any) -> tuple[Tensor | None, str]:
    """One count as a 0-dim tensor on ``device`` (no host sync), or ``(None, what is wrong)`` for a bad type.

    Both a tensor (in the copy, or the conversion, it needs anyway) and a Python number become float64.
    """
    count, detail = check_count(value, source)
    if count is None:
        return None, detail
    if isinstance(count, Tensor):
        return count.to(device, torch.float64, non_blocking=True), ""
    return _torch.to_device([count], torch.float64, torch.device(device)).reshape(()), ""


def read_count(count_fn: CountFn, batch: Any) -> tuple[float, Problem | None, str]:
    """Count one batch on the host: ``(count, problem, this rank's detail)``; never raises (see ``Problem``).

    Lookahead counts batches as the loader yields them, on the host, so reading the count is free; a count_fn that
    moves the batch to an accelerator first would pay one sync per batch.
    """
    host = host_count(count_fn, batch)
    if host is not None:
        return float(host), None, ""
    try:
        value, detail = check_count(count_fn(batch), "`count_fn`")
    except Exception as error:  # every rank must reach the collective to learn of it
        return 0.0, Problem.COUNT_FAILED, f"`count_fn` raised {type(error).__name__}: {error}"
    if value is None:
        return 0.0, Problem.COUNT_FAILED, detail
    count = float(value.item()) if isinstance(value, Tensor) else value
    if not math.isfinite(count):
        return 0.0, Problem.COUNT_NONFINITE, f"`count_fn` returned {count}"
    if count < 0:
        return 0.0, Problem.COUNT_NEGATIVE, f"`count_fn` returned {count}"
    return count, None, ""


def as_count(value: Any, argument: str) -> Tensor | float:
    """:func:`check_count`, raising a ``TypeError`` for a count of the wrong type."""
    count, problem = check_count(value, f"`{argument}`")
    if count is None:
        raise TypeError(problem + ".")
    return count


__all__ = ["CountFn", "as_count", "check_count", "device_count", "first_labels", "read_count"]
