"""Named counts: the denominator of each objective, by a name a LightningCLI config can use.

The strategy divides the step's loss sum by the sum of ``count_fn(batch)``, so the count must be what the loss's own
mean divides by (the table is in docs/counts.md). Every count stays on the batch's device: it costs no host sync.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from token_mean import _torch
from token_mean._problems import Problem

IGNORE_INDEX = -100
"""The label PyTorch's ``cross_entropy`` (and Hugging Face) treats as "not a target"."""


def _labels(batch: Any, count_name: str, key: str = "labels") -> Tensor:
    """``batch[key]``, or a ``TypeError`` naming the count and the fix."""
    labels = batch.get(key) if isinstance(batch, Mapping) else None
    if isinstance(labels, Tensor):
        return labels
    what = f"a {type(batch).__name__}" + (f" without a `{key}` tensor" if isinstance(batch, Mapping) else "")
    targets = "batch[1][..., 1:]" if count_name == "count_shifted_labels" else "batch[1]"  # the count chosen
    raise TypeError(
        f"`{count_name}` counts `batch['{key}']`, but the batch is {what}. Pass a `count_fn` that counts the valid"
        f" items of your batch, for example `TokenMeanDDPStrategy(count_fn=lambda batch: ({targets} != -100).sum())`"
        " for (inputs, targets) tuples, or `count_fn=token_mean.count_examples` to average over rows."
    )


def count_valid_labels(batch: Any) -> Tensor:
    """The default ``count_fn``: ``batch["labels"] != -100`` summed, a 0-dim int64 tensor; for unshifted cross-entropy.

    Raises ``TypeError`` for a batch that is not a mapping with a ``"labels"`` tensor.

    Example:
        >>> count_valid_labels({"labels": torch.tensor([[5, -100, 7], [-100, -100, 1]])})
        tensor(3)
    """
    return (_labels(batch, "count_valid_labels") != IGNORE_INDEX).sum()


def count_shifted_labels(batch: Any) -> Tensor:
    """Valid ``labels[..., 1:]`` (or ``"shift_labels"`` as they are), a 0-dim int64 tensor: for a model that shifts.

    Raises ``TypeError`` for a batch that is not a mapping with a ``"labels"`` or ``"shift_labels"`` tensor.

    Example:
        >>> labels = torch.tensor([[11, 12, 13, -100], [-100, 21, 22, 23]])
        >>> count_shifted_labels({"labels": labels}), count_valid_labels({"labels": labels})
        (tensor(5), tensor(6))
    """
    shift_labels = batch.get("shift_labels") if isinstance(batch, Mapping) else None
    if isinstance(shift_labels, Tensor):
        return (shift_labels != IGNORE_INDEX).sum()
    return (_labels(batch, "count_shifted_labels")[..., 1:] != IGNORE_INDEX).sum()


def count_examples(batch: Any) -> int:
    """The rows of ``batch["labels"]``, else of the batch's first tensor: an ``int``, for a mean over examples.

    Raises ``TypeError`` if the batch holds no tensor, or only a 0-dim one.

    Example:
        >>> count_examples((torch.zeros(5, 4), torch.zeros(5)))
        5
    """
    if isinstance(batch, Mapping):
        labels = batch.get("labels")
        candidates = [labels] if isinstance(labels, Tensor) else list(batch.values())
    elif isinstance(batch, (tuple, list)):
        candidates = list(batch)
    else:
        candidates = [batch]
    first = next((value for value in candidates if isinstance(value, Tensor)), None)
    if first is None or first.dim() == 0:
        found = "no tensor" if first is None else "a 0-dim tensor"
        raise TypeError(
            f"`count_examples` counts the first dimension of `batch['labels']` or of the batch's first tensor, but the"
            f" batch ({type(batch).__name__}) holds {found}. Pass a `count_fn` that returns the number of examples of"
            " one micro-batch, for example `count_fn=lambda batch: len(batch['ids'])`."
        )
    return first.shape[0]


def count_micro_batches(batch: Any) -> int:
    """1 for every micro-batch (a filler counts 0): the count of a term whose loss is averaged over the window's real
    micro-batches on all ranks, as ``"aux_loss"`` is (a router balancing loss in an objective of several terms).

    Example:
        >>> count_micro_batches({"labels": torch.zeros(3, 4)})
        1
    """
    return 1


def count_sequences(batch: Any) -> Tensor:
    """The rows of ``batch["labels"]`` (sequences, tokens) with a valid label, a 0-dim int64 tensor: for seq-mean.

    Raises ``TypeError`` without a ``"labels"`` tensor, ``ValueError`` for labels of fewer than two dimensions.

    Example:
        >>> count_sequences({"labels": torch.tensor([[5, -100, 7], [-100, -100, -100], [-100, 2, -100]])})
        tensor(2)
    """
    labels = _labels(batch, "count_sequences")
    if labels.dim() < 2:
        raise ValueError(
            f"`count_sequences` needs labels of shape (sequences, tokens), got shape {tuple(labels.shape)}. For one"
            " label per example use `count_valid_labels` or `count_examples`."
        )
    return (labels != IGNORE_INDEX).any(dim=-1).sum()


class ClassWeightedCount:
    """Σ w[y] over the valid labels: the denominator of ``F.cross_entropy(..., weight=w)``.

    ``weight``: one finite weight >= 0 per class (a list becomes float64), copied once to each device. Raises
    ``ValueError`` for bad weights, and ``TypeError`` when called on a batch without ``"labels"``.

    Example:
        >>> count = ClassWeightedCount([1.0, 2.0, 0.5])
        >>> count({"labels": torch.tensor([[0, 1, -100], [2, 1, 1]])})
        tensor(7.5000, dtype=torch.float64)
    """

    def __init__(self, weight: Sequence[float] | Tensor, ignore_index: int = IGNORE_INDEX) -> None:
        weights = (
            weight.detach().clone() if isinstance(weight, Tensor) else torch.tensor(list(weight), dtype=torch.float64)
        )
        values = weights.tolist() if weights.dim() == 1 else []
        if weights.dim() != 1 or not values or not all(math.isfinite(v) and v >= 0 for v in values):
            raise ValueError(
                "`ClassWeightedCount` needs one finite, non-negative weight per class (a 1-D list or tensor),"
                f" got {weight!r}."
            )
        self.weight = weights
        self.ignore_index = ignore_index
        self._on_device: dict[torch.device, Tensor] = {weights.device: weights}

    def __call__(self, batch: Any) -> Tensor:
        labels = _labels(batch, "ClassWeightedCount")
        weight = self._on_device.get(labels.device)
        if weight is None:
            weight = self._on_device[labels.device] = self.weight.to(labels.device)
        valid = labels != self.ignore_index
        # A boolean-mask index would sync to read its size: look every label up (ignored ones as class 0) and zero.
        per_label = weight[labels.masked_fill(~valid, 0)]
        return torch.where(valid, per_label, torch.zeros_like(per_label)).sum()

    def __repr__(self) -> str:
        return f"ClassWeightedCount(weight={self.weight.tolist()!r}, ignore_index={self.ignore_index})"


def _valid(loss_per_token: Tensor, labels: Tensor, ignore_index: int, helper: str) -> Tensor:
    if loss_per_token.shape != labels.shape:
        raise ValueError(
            f"`{helper}` needs `loss_per_token` and `labels` of one shape, got {tuple(loss_per_token.shape)} and"
            f" {tuple(labels.shape)}. For a causal LM, pass the labels the loss was computed against (`labels[:, 1:]`)."
        )
    if labels.is_floating_point():
        raise TypeError(
            f"`{helper}` reads `labels` as class labels (valid where != {ignore_index}) or as a boolean mask (valid"
            f" where True), got dtype {labels.dtype}: pass a float 0/1 mask as `mask.bool()`."
        )
    return labels if labels.dtype == torch.bool else labels != ignore_index


def sequence_token_sums(loss_per_token: Tensor, labels: Tensor, ignore_index: int = IGNORE_INDEX) -> Tensor:
    """Each sequence's loss summed over its valid tokens (0 without one): one value per row, for seq-mean-token-sum.

    ``labels`` has the shape of ``loss_per_token`` (sequences, tokens): class labels (valid where
    ``!= ignore_index``) or a boolean mask. Invalid positions are replaced by zero, so a NaN there never leaks.
    Raises ``ValueError`` if the shapes differ, ``TypeError`` for float labels (pass ``mask.bool()``).

    Example:
        >>> loss = torch.tensor([[1.0, 2.0, 4.0], [8.0, float("nan"), 16.0]])
        >>> sequence_token_sums(loss, torch.tensor([[3, -100, 1], [-100, -100, -100]]))
        tensor([5., 0.])
    """
    valid = _valid(loss_per_token, labels, ignore_index, "sequence_token_sums")
    return torch.where(valid, loss_per_token, torch.zeros_like(loss_per_token)).sum(dim=-1)


def sequence_token_means(loss_per_token: Tensor, labels: Tensor, ignore_index: int = IGNORE_INDEX) -> Tensor:
    """Each sequence's mean loss over its valid tokens, 0 without one (never 0/0): for seq-mean-token-mean.

    Arguments and errors as for :func:`sequence_token_sums`.

    Example:
        >>> loss = torch.tensor([[1.0, 2.0, 4.0], [8.0, 3.0, 16.0]])
        >>> sequence_token_means(loss, torch.tensor([[True, False, True], [False, False, False]]))
        tensor([2.5000, 0.0000])
    """
    valid = _valid(loss_per_token, labels, ignore_index, "sequence_token_means")
    sums = torch.where(valid, loss_per_token, torch.zeros_like(loss_per_token)).sum(dim=-1)
    # clamp: an empty sequence divides 0 by 1, so neither its value nor its gradient is 0/0
    return sums / valid.sum(dim=-1).clamp(min=1).to(sums.dtype)


# ---- reading one count (the modes, the monitor and the audit) ----


def first_labels(batch: Any) -> Tensor | None:
    """Valid first labels of the rows: what unshifted labels over-count for a model that shifts them (None without
    2-d ``"labels"``)."""
    labels = batch.get("labels") if isinstance(batch, Mapping) else None
    if not isinstance(labels, Tensor) or labels.dim() < 2:
        return None
    return (labels[..., 0] != IGNORE_INDEX).sum()


def check_count(value: Any, source: str) -> tuple[Tensor | float | None, str]:
    """Check the type of one count only (its value is checked where no sync is needed): ``(count, "")`` or
    ``(None, what is wrong)``."""
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
    """One count as a 0-dim float64 tensor on ``device`` (no host sync), or ``(None, what is wrong)``."""
    count, detail = check_count(value, source)
    if count is None:
        return None, detail
    if isinstance(count, Tensor):
        return count.to(device, torch.float64, non_blocking=True), ""
    return _torch.to_device([count], torch.float64, torch.device(device)).reshape(()), ""


def read_count(count_fn: Callable[[Any], Any], batch: Any) -> tuple[float, Problem | None, str]:
    """Count one batch on the host (free where the loader yields it): ``(count, problem, detail)``; never raises."""
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
