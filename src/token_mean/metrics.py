"""TokenMeanLoss: the exact token-weighted mean loss over batches and ranks, as a torchmetrics ``Metric``."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch
from torch import Tensor
from torch.nn import Module
from torchmetrics import Metric
from typing_extensions import override

from token_mean._window import in_filler_batch


class TokenMeanLoss(Metric):
    """The mean loss over every valid item seen: Σ loss sums / Σ counts over batches and ranks.

    ``self.log(..., sync_dist=True)`` takes a plain mean of per-rank means, so sparse batches weigh as much as full
    ones; this metric keeps both sums as float64 states (exact counts up to 2**53 in any precision), SUM-reduced by
    torchmetrics, and divides once in ``compute`` (NaN if nothing was counted). ``update`` never syncs. Exact across
    ranks only if every item is evaluated once (``ExactDistributedSampler``, not ``DistributedSampler``). Log it as
    ``self.log("val_loss", self.val_loss, on_epoch=True)`` after ``self.val_loss.update(loss, count)``.

    ``loss_reduction`` says whether ``update`` gets mean losses or sums (``ValueError`` for anything else); other
    keyword arguments go to :class:`torchmetrics.Metric`.

    Example:
        >>> metric = TokenMeanLoss()
        >>> metric.update(torch.tensor(2.0), 3)  # three valid tokens with mean loss 2
        >>> metric.update(torch.tensor(float("nan")), 0)  # no valid token: adds nothing
        >>> metric.update(torch.tensor(6.0), 1)
        >>> metric.compute()  # (2·3 + 6·1) / 4, where a mean of batch means gives 4
        tensor(3., dtype=torch.float64)
    """

    is_differentiable = False
    higher_is_better = False
    full_state_update = False

    loss_sum: Tensor
    count: Tensor

    def __init__(self, loss_reduction: Literal["mean", "sum"] = "mean", **kwargs: Any) -> None:
        if loss_reduction not in ("mean", "sum"):
            raise ValueError(
                f"`loss_reduction` must be 'mean' (update gets mean losses) or 'sum' (loss sums),"
                f" got {loss_reduction!r}."
            )
        super().__init__(**kwargs)
        self._loss_reduction = loss_reduction
        # Sums, never means, so that torchmetrics' SUM over ranks gives the exact global numerator and denominator.
        self.add_state("loss_sum", default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("count", default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")

    @override
    def update(self, value: float | Tensor, weight: float | Tensor | None = None) -> None:
        """Add a batch's loss ``value`` (mean or sum) and its count ``weight``: scalars, or one count per loss.

        A count of 0 adds nothing, whatever its loss; a zero-weight filler batch is ignored. Raises ``ValueError``
        if the count is missing or its shape differs from the loss's.
        """
        if in_filler_batch():
            return  # a repeat of a real batch, already counted once
        if weight is None:
            raise ValueError(
                "`TokenMeanLoss.update(loss, count)` needs the count of valid items, e.g."
                " `count_valid_labels(batch)`; for a plain mean use `torchmetrics.MeanMetric`."
            )
        loss = torch.as_tensor(value, device=self.device).detach().to(torch.float64)
        count = torch.as_tensor(weight, device=self.device).detach().to(torch.float64)
        if loss.shape != count.shape:
            raise ValueError(
                f"`TokenMeanLoss.update` needs one count per loss, got losses of shape {tuple(loss.shape)} and counts"
                f" of shape {tuple(count.shape)}. Pass the batch's mean loss with its total count, or both per item."
            )
        loss_sum = loss if self._loss_reduction == "sum" else loss * count
        # torch.where, not a multiplication by 0: NaN (the mean of no item) times 0 is still NaN.
        self.loss_sum += torch.where(count > 0, loss_sum, 0.0).sum()
        self.count += count.sum()

    @override
    def compute(self) -> Tensor:
        """Σ loss sums / Σ counts over every update on every rank; NaN if the count is 0."""
        return torch.where(self.count > 0, self.loss_sum / self.count, torch.nan)

    @override
    def _apply(self, fn: Callable[[Tensor], Tensor], exclude_state: Sequence[str] = ()) -> Module:
        # `Module.to(dtype)` reaches the states (torchmetrics guards only .half()/...): keep them float64, exact.
        module = super()._apply(fn, exclude_state)
        for name in ("loss_sum", "count"):
            default = self._defaults.get(name)
            if isinstance(default, Tensor):  # absent while Metric.__init__ runs
                setattr(self, name, getattr(self, name).to(torch.float64))
                self._defaults[name] = default.to(torch.float64)
        return module


__all__ = ["TokenMeanLoss"]
