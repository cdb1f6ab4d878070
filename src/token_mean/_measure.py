"""The denominator of a window that no token-mean strategy normalizes, measured by ``DenominatorMonitor`` (plain DDP,
FSDP, one device): each micro-batch counted as ``training_step`` received it, its loss undone from the loop's
division by K, and the window summed over the ranks that share N in one all-reduce at its end, read once.

A count that fails on any rank raises the same :class:`~token_mean.DenominatorError` on every rank (naming the ranks
and this rank's detail); a NaN loss is the strategy's to judge, not the measurement's: it adds nothing.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from token_mean._counts import check_count
from token_mean._layout import World
from token_mean.errors import DenominatorError
from token_mean.results import WindowStats


class MeasuredWindow:
    """One window's micro-batches from batch ``start`` on, measured on this rank for optimizer ``step`` (``mean``:
    each loss is a mean over its count)."""

    def __init__(self, world: World, mean: bool, step: int, start: int) -> None:
        self.world, self.mean, self.step, self.start = world, mean, step, start
        self._counts: list[Tensor] = []  # of the micro-batches with a loss (a skipped one has no items)
        self._naive: list[Tensor] = []  # what plain DDP differentiated: Lightning's closure loss, loss / K
        self._length = 0
        self._accumulate = 1
        self._failed = ""  # what this rank saw of its first failed count

    def add(self, batch: Any, loss: Any, count_fn: Any, accumulate: int) -> None:
        """One micro-batch: ``loss`` as the loop got it back (None: the step was skipped)."""
        self._length += 1
        if not isinstance(loss, Tensor):
            return
        try:
            count, detail = check_count(count_fn(batch), "`count_fn`")
        except Exception as error:  # every rank must reach the window's all-reduce to learn of it
            count, detail = None, f"`count_fn` raised {type(error).__name__}: {error}"
        if count is None:
            self._failed = self._failed or detail
            count = 0.0
        self._counts.append(torch.as_tensor(count, dtype=torch.float64, device=self.world.device))
        self._naive.append(loss.detach().reshape(()))
        self._accumulate = accumulate

    def end(self) -> tuple[WindowStats, float]:
        """The window's stats and plain DDP's loss (the mean over ranks of the summed closure losses): one
        all-reduce of [N, loss sum, naive sum, failed ranks, every rank's count], read once."""
        world = self.world
        zero = torch.zeros((), dtype=torch.float64, device=world.device)
        counts = torch.stack(self._counts or [zero])
        valid = torch.nan_to_num(counts.clamp(min=0.0), nan=0.0, posinf=0.0)
        naive = torch.stack(self._naive or [zero]).to(world.device, torch.float64)
        # a bad count counts nothing; a NaN loss is the strategy's to judge, not the measurement's
        weights = valid if self.mean else (valid > 0).to(valid.dtype)
        loss_sum = torch.nan_to_num(torch.where(valid > 0, naive * self._accumulate, zero) * weights).sum()
        local = valid.sum()
        per_rank = torch.zeros(2 * world.size, dtype=torch.float64, device=world.device)
        per_rank[world.rank] = local
        # a count that failed on the host, or is negative or not finite (NaN != NaN): its rank raises
        per_rank[world.size + world.rank] = (valid != counts).sum() + float(bool(self._failed))
        record = torch.cat([torch.stack([local, loss_sum, naive.sum()]), per_rank])
        if world.distributed:
            dist.all_reduce(record, group=world.group)
        values = torch.cat([record, local.reshape(1)]).tolist()  # this rank's count comes with the one read
        global_count, summed_loss, naive_sum = values[:3]
        rank_counts = tuple(values[3 : 3 + world.size])
        failed = [rank for rank, flag in enumerate(values[3 + world.size : 3 + 2 * world.size]) if flag]
        if failed:
            self._raise(failed)
        stats = WindowStats(
            global_count=global_count,
            local_count=values[-1],
            rank_counts=rank_counts,
            window_length=self._length,
            loss=None if global_count == 0 else summed_loss / global_count,
            skipped=global_count == 0,
            mode="none",
        )
        return stats, naive_sum / world.size

    def _raise(self, failed: list[int]) -> None:
        """The same error on every rank, naming the ranks whose count failed; what this rank saw, as a note."""
        who = f"rank{'s' if len(failed) > 1 else ''} {', '.join(map(str, failed))}"
        where = (
            f"the accumulation window of optimizer step {self.step} (measured by DenominatorMonitor, batches"
            f" {self.start}..{self.start + self._length - 1})"
        )
        error = DenominatorError(
            f"token_mean: {who}: `count_fn` failed, or returned something that is not a number, or a negative, NaN or"
            f" infinite count, in {where}.\n  Fix: make `count_fn(batch)` return an int, a float or a one-element"
            " tensor, a finite number of valid items or sum of non-negative weights, for every batch."
        )
        if self._failed:
            error.add_note(f"On rank {self.world.rank}: {self._failed}")
        raise error
