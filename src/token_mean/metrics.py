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

_STATES = ("loss_sum", "count")


class TokenMeanLoss(Metric):
    """The mean loss over every valid item seen, summed over batches and ranks before dividing.

    ``self.log("val_loss", loss, sync_dist=True)`` averages per-batch means within a rank (weighted by batch size) and
    then takes a plain mean of the rank means, so ranks and batches with few valid tokens weigh as much as full ones.
    This metric keeps two states, Σ loss sums and Σ counts, both reduced with SUM across ranks by torchmetrics, and
    divides once in ``compute``: the exact global token mean. The states are float64 whatever the module's precision
    (``Trainer(precision="bf16-true")`` moves modules to bfloat16, which counts exactly only up to 256), so integer
    counts stay exact up to 2**53.

    ``update`` never moves a value to the host, keeps no autograd graph, and lets an entry without valid items add
    nothing even though its mean loss is NaN (0/0). ``compute`` is NaN when no valid item was seen at all, like
    ``F.cross_entropy`` of a batch without targets.

    Exact across ranks only if every item is evaluated once: Lightning's default validation sampler
    (``DistributedSampler``) repeats items to even the ranks out, which counts them twice. See the README's
    "Validation loss" for the sampler to use.

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
        >>> metric.update(torch.tensor(float("nan")), 0)  # no valid token: adds nothing
        >>> metric.update(torch.tensor(6.0), 1)
        >>> metric.compute()  # (2·3 + 6·1) / 4, where a mean of batch means gives 4
        tensor(3., dtype=torch.float64)
        >>> metric.loss_sum, metric.count
        (tensor(12., dtype=torch.float64), tensor(4., dtype=torch.float64))
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
        """Add a batch: ``value`` is its loss (mean or sum, see ``loss_reduction``), ``weight`` its valid items.

        Both may be scalars, or tensors of one shape: one count per loss (e.g. per sequence). An entry whose count is
        0 adds nothing, whatever its loss. Inside the ``training_step`` of a zero-weight filler (the repeated batch of
        an exhausted rank under :class:`~token_mean.TokenMeanDDPStrategy`) the update is ignored.

        Raises:
            ValueError: if ``weight`` (the count) is missing or its shape differs from the loss's.
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
        # `Module.to(dtype)` reaches the states through torchmetrics (only .half()/.float()/... are guarded): move
        # them, but keep them float64 so the sums stay exact.
        module = super()._apply(fn, exclude_state)
        for name in _STATES:
            default = self._defaults.get(name)
            if isinstance(default, Tensor):  # absent while Metric.__init__ runs
                setattr(self, name, getattr(self, name).to(torch.float64))
                self._defaults[name] = default.to(torch.float64)
        return module


__all__ = ["TokenMeanLoss"]
