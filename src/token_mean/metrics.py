"""TokenMeanLoss: the exact token-weighted mean loss over batches and ranks, as a torchmetrics ``MeanMetric``."""

from __future__ import annotations

from typing import Any, Literal

import torch
from torch import Tensor
from torchmetrics import MeanMetric
from typing_extensions import override


class TokenMeanLoss(MeanMetric):
    """The mean loss over every valid item seen, summed over batches and ranks before dividing.

    ``self.log("val_loss", loss, sync_dist=True)`` averages per-batch means within a rank (weighted by batch size) and
    then takes a plain mean of the rank means, so ranks and batches with few valid tokens weigh as much as full ones.
    This metric keeps Σ loss sums and Σ counts as ``MeanMetric``'s two states, both reduced with SUM across ranks by
    torchmetrics, and divides once in ``compute``: the exact global token mean. States are float64, so integer counts
    stay exact up to 2**53 (float32 stops at 2**24 tokens).

    ``update`` never moves a value to the host (no NaN check), and a batch without valid items adds nothing even
    though its mean loss is NaN (0/0). Note that ``MeanMetric(nan_strategy="disable").update(value, weight)`` ignores
    ``weight`` in torchmetrics 1.9; this class does not go through that path.

    Use it in place of the logged tensor, and Lightning computes (and syncs) it at the end of the epoch::

        def __init__(self):
            ...
            self.val_loss = TokenMeanLoss()

        def validation_step(self, batch, batch_idx):
            loss = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100)
            self.val_loss.update(loss, count_valid_labels(batch))
            self.log("val_loss", self.val_loss, on_epoch=True)

    Args:
        loss_reduction: ``"mean"`` if ``update`` gets mean losses, ``"sum"`` if it gets loss sums.
        kwargs: passed to :class:`torchmetrics.Metric` (``sync_on_compute``, ``process_group``, ...).

    Raises:
        ValueError: if ``loss_reduction`` is neither ``"mean"`` nor ``"sum"``.

    Example:
        >>> metric = TokenMeanLoss()
        >>> metric.update(torch.tensor(2.0), 3)  # three valid tokens with mean loss 2
        >>> metric.update(torch.tensor(float("nan")), 0)  # no valid token: ignored
        >>> metric.update(torch.tensor(6.0), 1)
        >>> metric.compute()  # (2·3 + 6·1) / 4, where a mean of batch means gives 4
        tensor(3., dtype=torch.float64)
    """

    def __init__(self, loss_reduction: Literal["mean", "sum"] = "mean", **kwargs: Any) -> None:
        if loss_reduction not in ("mean", "sum"):
            raise ValueError(
                f"`loss_reduction` must be 'mean' (update gets mean losses) or 'sum' (loss sums),"
                f" got {loss_reduction!r}."
            )
        super().__init__(nan_strategy="disable", **kwargs)
        self.set_dtype(torch.float64)
        self._loss_reduction = loss_reduction

    @override
    def update(self, value: float | Tensor, weight: float | Tensor | None = None) -> None:
        """Add a batch: ``value`` is its loss (mean or sum, see ``loss_reduction``), ``weight`` its valid items.

        Both may be scalars, or tensors of one shape: one count per loss (e.g. per sequence).

        Raises:
            ValueError: if ``weight`` (the count) is missing or its shape differs from the loss's.
        """
        if weight is None:
            raise ValueError(
                "`TokenMeanLoss.update(loss, count)` needs the count of valid items, e.g."
                " `count_valid_labels(batch)`; for a plain mean use `torchmetrics.MeanMetric`."
            )
        loss = torch.as_tensor(value, device=self.device).to(torch.float64)
        count = torch.as_tensor(weight, device=self.device).to(torch.float64)
        if loss.shape != count.shape:
            raise ValueError(
                f"`TokenMeanLoss.update` needs one count per loss, got losses of shape {tuple(loss.shape)} and counts"
                f" of shape {tuple(count.shape)}. Pass the batch's mean loss with its total count, or both per item."
            )
        loss_sum = loss if self._loss_reduction == "sum" else torch.where(count > 0, loss * count, 0.0)
        self.mean_value += loss_sum.sum()
        self.weight += count.sum()


__all__ = ["TokenMeanLoss"]
