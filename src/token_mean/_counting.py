"""How many valid items a micro-batch holds: the denominator's unit."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from torch import Tensor

IGNORE_INDEX = -100
"""The label PyTorch's ``cross_entropy`` (and Hugging Face) treats as "not a target"."""

CountFn = Callable[[Any], "int | float | Tensor"]


def count_valid_labels(batch: Any) -> Tensor:
    """Count the targets of a mapping batch whose ``"labels"`` are not ``-100``.

    This is the default ``count_fn``: the number of tokens ``F.cross_entropy(..., ignore_index=-100)`` averages over.
    The count stays on the batch's device (no host sync).

    Args:
        batch: a mapping with a ``"labels"`` tensor.

    Returns:
        A 0-dim int64 tensor.

    Raises:
        TypeError: if the batch is not a mapping with a ``"labels"`` tensor; the message shows how to pass ``count_fn``.

    Example:
        >>> import torch
        >>> from token_mean import count_valid_labels
        >>> count_valid_labels({"labels": torch.tensor([[5, -100, 7], [-100, -100, 1]])})
        tensor(3)
    """
    labels = batch.get("labels") if isinstance(batch, Mapping) else None
    if not isinstance(labels, Tensor):
        raise TypeError(
            f"`count_fn` is required: the default counts `batch['labels'] != {IGNORE_INDEX}`, but the batch is a"
            f" {type(batch).__name__}{' without a `labels` tensor' if isinstance(batch, Mapping) else ''}."
            " Pass the number of valid items of one micro-batch, for example"
            " `TokenMeanDDPStrategy(count_fn=lambda batch: (batch[1] != -100).sum())` for (inputs, targets) tuples,"
            " or `count_fn=lambda batch: len(batch[0])` to average over examples."
        )
    return (labels != IGNORE_INDEX).sum()


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
