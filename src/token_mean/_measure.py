"""What a window's denominator and loss were under a strategy that does not publish them (plain DDP, one device).

The measurement is a :class:`~token_mean._window.Window` like the modes': per micro-batch it keeps detached device
values; per window it all-reduces one record, so a bad count raises the same :class:`~token_mean.DenominatorError`
on every rank, and the per-rank counts ride in the same collective.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from token_mean._counting import CountFn, device_count
from token_mean._problems import Problem
from token_mean._record import Channel, Slot, World
from token_mean._window import Window, WindowStats


def default_world(device: torch.device) -> World:
    """All ranks of the default process group (one process when there is none)."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return World(dist.get_world_size(), dist.get_rank(), device, distributed=True)
    return World.single(device)


class MeasuredWindow:
    """One window under a strategy that does not normalize it: ``add`` each micro-batch, then ``finish``."""

    def __init__(self, channel: Channel, count_fn: CountFn, loss_reduction: str, start: int, step: int) -> None:
        self._count_fn = count_fn
        # an observer: a NaN loss is the strategy's to judge, not the measurement's
        self._window = Window(channel, start, 1, f"optimizer step {step} (measured by DenominatorMonitor",
                              loss_reduction, judge_losses=False)

    def add(self, batch: Any, outputs: Any, accumulate: int) -> None:
        """One micro-batch; ``accumulate`` is what the loop divided its loss by."""
        window = self._window
        loss = outputs.get("loss") if isinstance(outputs, Mapping) else outputs
        if not isinstance(loss, Tensor):
            window.add(window.zero(), None, filler=True)  # a skipped micro-batch: no gradient, so no items either
            return
        try:
            count, detail = device_count(self._count_fn(batch), "`count_fn`", window.channel.world.device)
        except Exception as error:  # every rank must reach the window's collective to learn of it
            count, detail = None, f"`count_fn` raised {type(error).__name__}: {error}"
        if count is None:
            window.flag(Problem.COUNT_FAILED, detail)
            count = window.zero()
        naive = loss.detach().reshape(()).to(device=window.channel.world.device, dtype=torch.float64)
        window.add_to(Slot.NAIVE, naive)
        window.add(count, naive * accumulate, filler=False)  # the loop divided the loss by K: undo it

    def finish(self) -> tuple[WindowStats, float]:
        """The window's stats (the same error on every rank for a bad count) and plain DDP's own loss."""
        result = self._window.close().result()
        stats = result.stats(result.reduced[Slot.COUNT], "none", None)
        return stats, result.reduced[Slot.NAIVE] / self._window.channel.world.size


__all__ = ["MeasuredWindow", "default_world"]
