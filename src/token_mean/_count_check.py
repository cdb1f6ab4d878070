"""The count check: is the count what the loss divides by? (docs/counts.md)

The strategies compute exactly the objective they are told, and the audit proves the applied gradient is its
gradient; both take the count on trust. This check tests it. One micro-batch's valid labels are split into S and its
complement S', each kept in turn (the other set to -100), and the loss is replayed without gradient. A loss that is
the mean over the count c satisfies

    c(S)·ℓ(S) + c(S')·ℓ(S') = c·ℓ        (a sum-reduced one: ℓ(S) + ℓ(S') = ℓ)

A shift the count does not know, a sum returned as a mean, class weights or a mask the model decides break it; a term
that does not depend on the labels (a penalty, a router loss) or one per valid label (label smoothing, a z-loss)
keeps it. A half the count finds empty adds nothing, as in training. Row counts (examples, sequences) split the rows:
the first row, then the others. Cost: three forwards of one micro-batch per rank and one ``all_gather_object``, at a
fit's first window (and at each audited window).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor

from token_mean import _counts
from token_mean._counts import IGNORE_INDEX, read_count

ROWS = ""
"""The plan of a row count: split the rows, not the labels."""
TOLERANCE = {torch.float64: 1e-9, torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}
"""The largest relative mismatch of a right count: the three losses sum the same per-item terms in other orders."""

Replay = Callable[[Any, int], "tuple[Tensor | None, Any]"]
"""(batch, index in the window) → the replayed loss and the ``num_items`` reported with it (None if not), without
gradient and leaving parameters, buffers and RNG streams as they were."""
Result = tuple[float, float, int, str, tuple[str, ...]] | None
"""One rank's check: (relative mismatch, tolerance, the micro-batch's index, what was split, the named counts and
reductions that satisfy the identity); None: nothing checkable on this rank."""


def labels_key(count_fn: Any, batch: Any) -> str | None:
    """The batch key of the labels ``count_fn`` counts (:data:`ROWS` for a row count, or for labels that are not
    class indices, whose -100 no loss ignores: regression targets, boolean masks), None for a count it cannot check:
    a count of your own is checked when it names its labels in a ``labels_key`` attribute."""
    key = getattr(count_fn, "labels_key", None)
    key = key if isinstance(key, str) and key else None
    shifted = count_fn is _counts.count_shifted_labels
    if shifted and isinstance(batch, Mapping) and isinstance(batch.get("shift_labels"), Tensor):
        key = "shift_labels"
    elif shifted or count_fn is _counts.count_valid_labels or isinstance(count_fn, _counts.ClassWeightedCount):
        key = "labels"
    elif count_fn is _counts.count_examples or count_fn is _counts.count_sequences:
        return ROWS
    labels = batch.get(key) if key is not None and isinstance(batch, Mapping) else None
    if isinstance(labels, Tensor) and (labels.is_floating_point() or labels.dtype == torch.bool):
        return ROWS
    return key


def halves(batch: Any, key: str) -> tuple[Any, Any, str] | None:
    """The batch keeping S, the batch keeping S', and what S is; None if the batch has fewer than two valid labels
    (rows). S is the valid labels of the first position that holds any (a shift never predicts the first), or the
    first valid label alone where one position holds them all."""
    if key == ROWS:
        rows = _rows(batch)
        if rows is None or rows < 2:
            return None
        return _sliced(batch, slice(0, 1), rows), _sliced(batch, slice(1, rows), rows), "its first row"
    labels = batch.get(key) if isinstance(batch, Mapping) else None
    if not isinstance(labels, Tensor) or labels.dim() == 0:
        return None
    valid = labels != IGNORE_INDEX
    if int(valid.sum()) < 2:  # after the window's last backward: the host read costs no overlap
        return None
    position = int(valid.reshape(-1, labels.shape[-1]).any(0).nonzero()[0])
    kept = torch.zeros_like(valid)
    kept[..., position] = valid[..., position]
    what = f"the valid `{key}` at position {position} of the last dimension"
    if bool(kept.sum() == valid.sum()):
        kept = torch.zeros_like(valid).flatten()
        kept[int(valid.flatten().nonzero()[0])] = True
        kept, what = kept.view_as(valid), f"the first valid `{key}`"
    keeping, rest = labels.masked_fill(~kept, IGNORE_INDEX), labels.masked_fill(kept, IGNORE_INDEX)
    return _with(batch, key, keeping), _with(batch, key, rest), what


def _with(batch: Any, key: str, labels: Tensor) -> Any:
    changed = copy.copy(batch)  # a dict, or a UserDict such as Hugging Face's BatchEncoding, with its own data
    changed[key] = labels
    return changed


def _rows(batch: Any) -> int | None:
    found: list[int] = []
    apply_to_collection(batch, Tensor, lambda tensor: found.append(tensor.shape[0]) if tensor.dim() else None)
    return found[0] if found else None


def _sliced(batch: Any, rows: slice, length: int) -> Any:
    return apply_to_collection(batch, Tensor, lambda t: t[rows] if t.dim() and t.shape[0] == length else t)


def check(
    recorded: Sequence[tuple[Any, bool]],
    replay: Replay,
    count_fn: Any,
    reduction: str,
    num_items: bool,
    matched: bool,
    batch_statistics: bool = False,
) -> Result:
    """This rank's check of the first of its ``recorded`` (batch, filler) micro-batches that can be split.
    ``num_items``: a reported 'num_items' is the count (deferred); ``matched``: the forwards are collectives (FSDP2,
    tensor parallelism), so a rank with nothing to check replays its first micro-batch three times all the same;
    ``batch_statistics``: a layer normalizes over the batch (BatchNorm in training), so rows are not split."""
    for index, (batch, filler) in enumerate(recorded):
        key = None if filler else labels_key(count_fn, batch)
        key = None if key == ROWS and batch_statistics else key
        split = None if key is None else halves(batch, key)
        if split is not None:
            return _checked(index, batch, split, replay, count_fn, reduction, num_items, key == ROWS)
    if matched and recorded:
        for _ in range(3):
            replay(recorded[0][0], 0)
    return None


def _checked(
    index: int,
    batch: Any,
    split: tuple[Any, Any, str],
    replay: Replay,
    count_fn: Any,
    reduction: str,
    num_items: bool,
    rows: bool,
) -> Result:
    parts = (batch, split[0], split[1])
    outputs = [replay(part, index) for part in parts]
    losses = [math.nan if loss is None else float(loss.detach().double()) for loss, _ in outputs]
    dtype = next((loss.dtype for loss, _ in outputs if loss is not None), torch.float32)
    reported = [None if reported is None or not num_items else float(reported) for _, reported in outputs]
    counts = [
        value if value is not None else read_count(count_fn, part)[0]
        for value, part in zip(reported, parts, strict=True)
    ]
    mismatch = _mismatch(counts, losses, reduction)
    others = (
        (_counts.count_examples, _counts.count_sequences)
        if rows
        else (_counts.count_valid_labels, _counts.count_shifted_labels)
    )
    satisfied = []
    for other, other_reduction in [
        (count_fn, "sum" if reduction == "mean" else "mean"),
        *((other, reduction) for other in others if other is not count_fn),
    ]:
        other_counts = [read_count(other, part)[0] for part in parts]
        if _mismatch(other_counts, losses, other_reduction) <= TOLERANCE.get(dtype, 2e-5):
            satisfied.append(_fix(other, other_reduction, count_fn, reduction))
    return mismatch, TOLERANCE.get(dtype, 2e-5), index, split[2], tuple(satisfied)


def _mismatch(counts: Sequence[float], losses: Sequence[float], reduction: str) -> float:
    """|c(S)·ℓ(S) + c(S')·ℓ(S') − c·ℓ| relative to the terms (sum: without the counts); a half without items adds
    nothing; NaN where a half the count says holds items has no finite loss (inf)."""
    terms = [
        (count if reduction == "mean" else 1.0) * loss if count > 0 else 0.0
        for count, loss in zip(counts, losses, strict=True)
    ]
    if not all(math.isfinite(term) for term in terms):
        return math.inf
    whole, first, second = terms
    scale = abs(whole) + abs(first) + abs(second)
    return abs(first + second - whole) / scale if scale > 0 else 0.0


def _fix(count_fn: Any, reduction: str, user_count: Any, user_reduction: str) -> str:
    if count_fn is user_count and reduction != user_reduction:
        returns = "a sum" if reduction == "sum" else "a mean over the count"
        return f"`loss_reduction='{reduction}'` (`training_step` returns {returns})"
    return f"`count_fn=token_mean.{count_fn.__name__}`" + _WHY.get(count_fn.__name__, "")


_WHY = {
    "count_shifted_labels": " (the loss never predicts a row's first label: its labels are shifted, in"
    " `training_step` or inside the model)",
    "count_valid_labels": " (the loss scores every valid label as it lies: labels aligned with the logits)",
    "count_examples": " (a mean over the micro-batch's rows)",
    "count_sequences": " (a mean over sequences with a valid label)",
}


def describe(count_fn: Any) -> str:
    if count_fn is _counts.count_valid_labels:
        return "`count_fn=count_valid_labels` (the default)"
    return f"`count_fn={getattr(count_fn, '__name__', None) or type(count_fn).__name__}`"


def failure(results: Sequence[Result], count_fn: Any, reduction: str, where: str) -> str | None:
    """The error every rank raises for every rank's ``results`` (None: every checked rank passed)."""
    failed = [(rank, result) for rank, result in enumerate(results) if result is not None and result[0] > result[1]]
    if not failed:
        return None
    rank, (mismatch, tolerance, index, split, satisfied) = failed[0]
    figure = (
        "a part the count says holds items has no finite loss"
        if math.isinf(mismatch)
        else f"relative mismatch {mismatch:.1e} > {tolerance:.0e}"
    )
    text = (
        f"token_mean: the count check failed at {where}: the loss is not a {reduction} over {describe(count_fn)}"
        f" ({figure}; rank {rank}, micro-batch {index} of the window), so every update would follow another"
        " objective than the one written down, silently."
        f"\n  How: {split} kept, then the rest, and the loss replayed on each without gradient; with the loss's own"
        " denominator c, c(S)·loss(S) + c(rest)·loss(rest) = c·loss (a sum: loss(S) + loss(rest) = loss)."
    )
    if satisfied:
        return text + "\n  Fix: " + "; or ".join(satisfied) + " satisfies it."
    return text + (
        "\n  Fix: none of the named counts and reductions satisfies it. A loss that weighs classes"
        " (`F.cross_entropy(weight=w)`) takes `count_fn=token_mean.ClassWeightedCount(w)`; a loss over a mask the"
        " model decides takes `mode='deferred'` with `{'loss': ..., 'num_items': ...}` returned by `training_step`"
        " (or the loop); if the count is right and the loss does not split this way, pass `check_count=False`."
    )
