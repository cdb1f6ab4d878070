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


def as_count(value: int | float | Tensor, argument: str) -> Tensor | float:
    """Validate the type of one count (not its value: that is checked on every rank at once, in the collective)."""
    if isinstance(value, Tensor):
        if value.numel() != 1 or value.is_complex():
            raise TypeError(
                f"`{argument}` must give one real number per micro-batch, got a tensor of shape"
                f" {tuple(value.shape)} and dtype {value.dtype}. Return `mask.sum()`, not `mask`."
            )
        return value.reshape(())
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(
            f"`{argument}` must return an int, a float or a one-element tensor, got {type(value).__name__}: {value!r}."
        )
    return float(value)


__all__ = ["IGNORE_INDEX", "CountFn", "as_count", "count_valid_labels"]
