"""What a window's denominator and loss were under a strategy that does not publish them (plain DDP, one device).

The measurement uses the strategy's own window record and exchange (``_window``): per micro-batch it only keeps
detached device values; per window it all-reduces one record, so a bad count raises the same
:class:`~token_mean.DenominatorError` on every rank, and the per-rank counts ride in the same collective.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from token_mean._counting import CountFn, device_count
from token_mean._problems import PROBLEMS, Problem
from token_mean._window import COUNT, LOSS_SUM, NAIVE, Exchange, Reduced, WindowStats, make_record, raise_problems


class MeasuredWindow:
    """One window under plain DDP: ``add`` each micro-batch, then ``finish`` (one all-reduce) for its stats."""

    def __init__(self, count_fn: CountFn, loss_reduction: str, device: torch.device) -> None:
        self._count_fn = count_fn
        self._loss_reduction = loss_reduction
        self._device = device
        self._counts: list[Tensor] = []
        self._losses: list[Tensor] = []  # the micro-batch's own loss (Lightning's loss / K, times K)
        self._naive: list[Tensor] = []  # what plain DDP differentiated: Lightning's loss / K
        self._flags = [0.0] * len(PROBLEMS)
        self._detail = ""
        self.length = 0

    def add(self, batch: Any, outputs: Any, accumulate: int) -> None:
        self.length += 1
        loss = outputs.get("loss") if isinstance(outputs, Mapping) else outputs
        if not isinstance(loss, Tensor):
            return  # a skipped micro-batch (training_step returned None): no gradient, so no items either
        try:
            count, detail = device_count(self._count_fn(batch), "`count_fn`", self._device)
        except Exception as error:  # every rank must reach the window's collective to learn of it
            count, detail = None, f"`count_fn` raised {type(error).__name__}: {error}"
        if count is None:
            self._flags[PROBLEMS.index(Problem.COUNT_FAILED)] = 1.0
            self._detail = self._detail or detail
            count = torch.zeros((), dtype=torch.float64, device=self._device)
        naive = loss.detach().reshape(()).to(device=self._device, dtype=torch.float64)
        self._counts.append(count)
        self._naive.append(naive)
        self._losses.append(naive * accumulate)  # Lightning divided the closure loss by K: undo it

    def finish(self, step: int) -> tuple[WindowStats, float]:
        """The window's stats (the same error on every rank for a bad count) and plain DDP's own loss."""
        distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        world_size, rank = (dist.get_world_size(), dist.get_rank()) if distributed else (1, 0)
        device_scalars: list[tuple[int, Tensor]] = []
        device_flags: list[tuple[Problem, Tensor]] = []
        if self._counts:
            counts, losses = torch.stack(self._counts), torch.stack(self._losses)
            finite = torch.isfinite(counts)
            valid = torch.where(finite & (counts > 0), counts, torch.zeros_like(counts))
            values = losses if self._loss_reduction == "sum" else losses * valid
            # a micro-batch without valid items has a NaN mean loss (0/0), and NaN * 0 is still NaN
            loss_sum = torch.where(valid > 0, values, torch.zeros_like(values)).sum()
            device_scalars = [(COUNT, valid.sum()), (LOSS_SUM, loss_sum), (NAIVE, torch.stack(self._naive).sum())]
            device_flags = [(Problem.COUNT_NEGATIVE, (counts < 0).any()), (Problem.COUNT_NONFINITE, (~finite).any())]
        record = make_record(
            [], self._flags, device_scalars, device_flags, self._device, rank, world_size, rank_counts=True
        )
        local_count = device_scalars[0][1] if device_scalars else torch.zeros((), dtype=torch.float64)
        values_read = Exchange(record, None, distributed).read(extra=local_count.to(self._device).reshape(1))
        reduced, local = Reduced(values_read[:-1]), values_read[-1]
        where = f"the window of optimizer step {step} (as DenominatorMonitor measures it)"
        raise_problems(reduced.problems(), where, self._detail, rank)
        global_count = reduced[COUNT]
        stats = WindowStats(
            global_count=global_count,
            local_count=local,
            rank_counts=reduced.rank_counts(),
            window_length=self.length,
            loss=reduced[LOSS_SUM] / global_count if global_count > 0 else None,
            skipped=False,
            mode="measured",
        )
        return stats, reduced[NAIVE] / world_size


__all__ = ["MeasuredWindow"]
