"""Named counts: the denominator of each objective, by the name a LightningCLI config can use.

The count is the objective. ``TokenMeanDDPStrategy(count_fn=...)`` divides the sum of the loss over an optimizer step
(all ranks, all micro-batches) by the sum of ``count_fn(batch)`` over the same micro-batches, so the count must be
the number (or weight) of the items the loss's own mean divides by:

==========================  ==================================================================================
count                       the loss it matches
==========================  ==================================================================================
``count_valid_labels``      ``F.cross_entropy(logits, labels, ignore_index=-100)``: labels as the batch holds them
``count_shifted_labels``    a causal LM that shifts inside the model (``self.model(**batch).loss`` in Hugging Face):
                            ``logits[:, :-1]`` against ``labels[:, 1:]``, or against ``batch["shift_labels"]``
``count_examples``          a mean over the rows of the micro-batch, whatever their labels hold
``ClassWeightedCount(w)``   ``F.cross_entropy(..., weight=w)``, whose mean divides by Σ w[y] over valid labels
``count_sequences``         a mean over sequences with at least one valid token (seq-mean aggregation, with
                            ``loss_reduction="sum"`` and :func:`sequence_token_sums` / :func:`sequence_token_means`)
==========================  ==================================================================================

Every count here works on a mapping batch with a ``"labels"`` tensor (``count_examples`` also on tuples) and stays on
the batch's device: nothing is read on the host, so a count costs no device sync. In a YAML config:
``count_fn: token_mean.count_shifted_labels``, or for a class-weighted count
``count_fn: {class_path: token_mean.ClassWeightedCount, init_args: {weight: [1.0, 2.0, 0.5]}}``.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy
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
    raise TypeError(
        f"`{count_name}` counts `batch['{key}']`, but the batch is {what}. Pass a `count_fn` that counts the valid"
        " items of your batch, for example `TokenMeanDDPStrategy(count_fn=lambda batch: (batch[1] != -100).sum())`"
        " for (inputs, targets) tuples, or `count_fn=token_mean.count_examples` to average over rows."
    )


def count_valid_labels(batch: Any) -> Tensor:
    """Count the labels of a mapping batch that are not ``-100``: the default ``count_fn``.

    Matches ``F.cross_entropy(logits, batch["labels"], ignore_index=-100)`` (mean reduction), and any per-token loss
    averaged over the positions where ``labels != -100``. For a causal LM that shifts the labels inside the model
    (Hugging Face's ``self.model(**batch).loss``) this counts one position too many in every row whose first label is
    valid: use :func:`count_shifted_labels` there.

    Args:
        batch: a mapping with a ``"labels"`` tensor of any shape.

    Returns:
        A 0-dim int64 tensor on the labels' device.

    Raises:
        TypeError: if the batch is not a mapping with a ``"labels"`` tensor; the message shows how to pass ``count_fn``.

    Example:
        >>> count_valid_labels({"labels": torch.tensor([[5, -100, 7], [-100, -100, 1]])})
        tensor(3)
    """
    return (_labels(batch, "count_valid_labels") != IGNORE_INDEX).sum()


def count_shifted_labels(batch: Any) -> Tensor:
    """Count the targets of a causal LM that shifts the labels inside the model.

    Matches Hugging Face's ``self.model(**batch).loss`` for ``...ForCausalLM`` models and any loss of
    ``logits[..., :-1, :]`` against ``labels[..., 1:]`` with ``ignore_index=-100``: the first label of every row is
    never a target. When the batch holds ``"shift_labels"`` (labels already shifted, as Hugging Face accepts them
    for context parallelism), those are the targets and are counted as they are.

    Args:
        batch: a mapping with a ``"labels"`` tensor whose last dimension is the sequence, or a ``"shift_labels"``
            tensor.

    Returns:
        A 0-dim int64 tensor on the labels' device.

    Raises:
        TypeError: if the batch is not a mapping with a ``"labels"`` or ``"shift_labels"`` tensor.

    Example:
        >>> labels = torch.tensor([[11, 12, 13, -100], [-100, 21, 22, 23]])
        >>> count_shifted_labels({"labels": labels}), count_valid_labels({"labels": labels})
        (tensor(5), tensor(6))
        >>> count_shifted_labels({"labels": labels, "shift_labels": torch.tensor([[12, 13, -100], [21, 22, 23]])})
        tensor(5)
    """
    shift_labels = batch.get("shift_labels") if isinstance(batch, Mapping) else None
    if isinstance(shift_labels, Tensor):
        return (shift_labels != IGNORE_INDEX).sum()
    return (_labels(batch, "count_shifted_labels")[..., 1:] != IGNORE_INDEX).sum()


def host_count(count_fn: Any, batch: Any) -> int | None:
    """What :func:`count_valid_labels` or :func:`count_shifted_labels` gives ``batch``, read on the host with numpy
    where the labels are a plain int64 or int32 tensor on the CPU (lookahead counts batches as the loader yields
    them, on the CPU): the same integer without three torch kernels and a scalar read, about 40,000 fewer
    instructions a batch. None for any other count or batch, which is counted by ``count_fn`` itself.

    Example:
        >>> host_count(count_shifted_labels, {"labels": torch.tensor([[11, 12, 13, -100], [-100, 21, 22, 23]])})
        5
    """
    if (count_fn is not count_valid_labels and count_fn is not count_shifted_labels) or type(batch) is not dict:
        return None
    key = "shift_labels" if count_fn is count_shifted_labels and "shift_labels" in batch else "labels"
    shifted = count_fn is count_shifted_labels and key == "labels"  # the model shifts: the first label is no target
    labels = batch.get(key)
    if (type(labels) is not Tensor or labels.dtype not in _HOST_DTYPES or not labels.is_cpu or not labels.dim()
            or labels.layout is not torch.strided):
        return None
    values = labels.numpy()
    return int(numpy.count_nonzero((values[..., 1:] if shifted else values) != IGNORE_INDEX))


_HOST_DTYPES = (torch.int64, torch.int32)  # signed: -100 compares as it does in torch


def count_examples(batch: Any) -> int:
    """Count the rows (examples) of a micro-batch: for a loss that is a mean over examples.

    Matches ``per_example_loss.mean()`` over the micro-batch's rows, every row counting once whatever its labels
    hold (a row of padding counts too; :func:`count_sequences` leaves out rows without a valid token). The rows are
    the first dimension of ``batch["labels"]`` when the batch is a mapping that holds one, else of the first tensor
    of the batch (a mapping's values in order, or a tuple's or list's items), so ``(inputs, targets)`` tuples work.
    The count is read from the shape: a host ``int`` that costs no device work and no sync.

    Args:
        batch: a mapping, tuple or list holding at least one tensor with a batch dimension.

    Returns:
        The number of rows, an ``int``.

    Raises:
        TypeError: if the batch holds no tensor, or the tensor it counts has no dimension.

    Example:
        >>> count_examples({"input_ids": torch.zeros(3, 8), "labels": torch.full((3, 8), -100)})
        3
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


def count_sequences(batch: Any) -> Tensor:
    """Count the sequences (rows) that hold at least one valid label: the seq-mean denominator.

    Matches a mean over sequences that skips sequences without a valid token, as verl's ``seq-mean-*`` loss
    aggregation modes do. With ``loss_reduction="sum"``, ``training_step`` returns the sum over its sequences of a
    per-sequence loss, for example ``sequence_token_means(loss_per_token, labels).sum()`` (seq-mean-token-mean) or
    ``sequence_token_sums(loss_per_token, labels).sum()`` (seq-mean-token-sum). The last dimension of the labels is
    the sequence; every other dimension indexes sequences.

    Args:
        batch: a mapping with a ``"labels"`` tensor of shape ``(sequences, tokens)`` (or more leading dimensions).

    Returns:
        A 0-dim int64 tensor on the labels' device.

    Raises:
        TypeError: if the batch is not a mapping with a ``"labels"`` tensor.
        ValueError: if the labels have fewer than two dimensions (no token dimension to reduce).

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
    """Count the class weights of the valid labels: Σ w[y], the denominator of class-weighted cross-entropy.

    Matches ``F.cross_entropy(logits, labels, weight=w, ignore_index=ignore_index)`` with mean reduction, which
    divides the weighted loss sum by the sum of ``w[y]`` over the valid labels, not by their number. The weights are
    copied once to each device the labels arrive on, so a count costs no host-to-device copy per micro-batch.

    Args:
        weight: one non-negative, finite weight per class (the ``weight`` passed to ``cross_entropy``). A list
            becomes a float64 tensor; a tensor keeps its dtype.
        ignore_index: the label that marks "not a target".

    Raises:
        ValueError: if ``weight`` is not a non-empty 1-D sequence of finite, non-negative numbers.
        TypeError: when called on a batch that is not a mapping with a ``"labels"`` tensor.

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
        # Indexing with the boolean mask would read its number of True values on the host (a sync); every label is
        # looked up instead, ignored ones as class 0, and zeroed.
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
    """The sum of each sequence's loss over its valid tokens (0 for a sequence without one).

    For seq-mean-token-sum (``count_sequences`` or ``count_examples``, ``loss_reduction="sum"``, ``training_step``
    returns ``sequence_token_sums(...).sum()``) and, divided by a constant horizon, Dr. GRPO's
    seq-mean-token-sum-norm. The loss at invalid positions is replaced, not multiplied, by zero, so a NaN or inf
    there reaches neither the sum nor the gradient.

    Args:
        loss_per_token: shape ``(sequences, tokens)`` (or more leading dimensions), e.g.
            ``F.cross_entropy(..., reduction="none")`` reshaped, or a policy-gradient loss per token.
        labels: the same shape: class labels, valid where ``!= ignore_index``, or a boolean mask, valid where True.
        ignore_index: the label that marks "not a target".

    Returns:
        A tensor of the leading shape (one value per sequence).

    Raises:
        ValueError: if the shapes differ.
        TypeError: if ``labels`` is a floating-point tensor (pass a 0/1 mask as ``mask.bool()``).

    Example:
        >>> loss = torch.tensor([[1.0, 2.0, 4.0], [8.0, float("nan"), 16.0]])
        >>> sequence_token_sums(loss, torch.tensor([[3, -100, 1], [-100, -100, -100]]))
        tensor([5., 0.])
    """
    valid = _valid(loss_per_token, labels, ignore_index, "sequence_token_sums")
    return torch.where(valid, loss_per_token, torch.zeros_like(loss_per_token)).sum(dim=-1)


def sequence_token_means(loss_per_token: Tensor, labels: Tensor, ignore_index: int = IGNORE_INDEX) -> Tensor:
    """The mean of each sequence's loss over its valid tokens; 0 for a sequence without one (never 0/0).

    For seq-mean-token-mean: ``training_step`` returns ``sequence_token_means(...).sum()`` with
    ``count_fn=count_sequences`` and ``loss_reduction="sum"``, so a sequence without a valid token adds nothing to
    the loss, is not counted, and puts no NaN into the gradient. Arguments, result and errors as for
    :func:`sequence_token_sums`.

    Example:
        >>> loss = torch.tensor([[1.0, 2.0, 4.0], [8.0, 3.0, 16.0]])
        >>> sequence_token_means(loss, torch.tensor([[True, False, True], [False, False, False]]))
        tensor([2.5000, 0.0000])
    """
    valid = _valid(loss_per_token, labels, ignore_index, "sequence_token_means")
    sums = torch.where(valid, loss_per_token, torch.zeros_like(loss_per_token)).sum(dim=-1)
    # clamp: an empty sequence divides 0 by 1, so neither its value nor its gradient is 0/0
    return sums / valid.sum(dim=-1).clamp(min=1).to(sums.dtype)


# ---- reading one count: what the modes, the monitor's measurement and the audit do with `count_fn(batch)` ----


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


def read_count(count_fn: Callable[[Any], Any], batch: Any) -> tuple[float, Problem | None, str]:
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



__all__ = [
    "IGNORE_INDEX",
    "ClassWeightedCount",
    "count_examples",
    "count_sequences",
    "count_shifted_labels",
    "count_valid_labels",
    "sequence_token_means",
    "sequence_token_sums",
]
