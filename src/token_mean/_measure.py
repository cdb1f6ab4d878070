"""Where the monitor takes each window's numbers from: a token-mean strategy's ``last_window`` (:class:`Published`),
or its own measurement under any other strategy (:class:`Measured`: plain DDP, FSDP2, one device).

The measurement is a :class:`~token_mean._window.Tally` like a mode's window: per micro-batch it keeps detached
device values; per window it all-reduces one record, so a bad count raises the same
:class:`~token_mean.DenominatorError` on every rank, and the per-rank counts ride in the same collective.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor

from token_mean import _ddp, _fsdp
from token_mean._counting import CountFn, device_count
from token_mean._exit import destroy_process_group_at_exit
from token_mean._problems import Problem
from token_mean._record import Channel, Slot, World
from token_mean._window import Tally
from token_mean.results import WindowStats
from token_mean.strategy import TokenMeanStrategy


class MeasuredWindow:
    """One window under a strategy that does not normalize it: ``add`` each micro-batch, then ``finish``."""

    def __init__(self, channel: Channel, count_fn: CountFn, loss_reduction: str, start: int, step: int) -> None:
        self._count_fn = count_fn
        # an observer: a NaN loss is the strategy's to judge, not the measurement's
        self._window = Tally(channel, start, 1, f"optimizer step {step} (measured by DenominatorMonitor",
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


class Windows(Protocol):
    """Where each window's numbers come from, fed by the monitor's hooks."""

    def start(self, trainer: Trainer, world: World) -> None: ...
    def reset(self) -> None: ...
    def add(self, trainer: Trainer, module: LightningModule, batch: Any, outputs: Any, position: int,
            step: int) -> None: ...
    def finish(self, step: int) -> tuple[WindowStats | None, float | None]: ...


class Published:
    """The windows a token-mean strategy publishes (P more floats in its record for the per-rank counts: nothing
    else, no collective of the monitor's own)."""

    def __init__(self, strategy: TokenMeanStrategy) -> None:
        self._strategy = strategy
        self._last: WindowStats | None = None
        self._warned = False

    def start(self, trainer: Trainer, world: World) -> None:
        self._last, self._warned = None, False

    def reset(self) -> None:
        pass

    def add(self, trainer: Trainer, module: LightningModule, batch: Any, outputs: Any, position: int,
            step: int) -> None:
        pass

    def finish(self, step: int) -> tuple[WindowStats | None, float | None]:
        """The strategy's stats of the window that just ended (None, with a warning once, if it published none)."""
        stats = self._strategy.last_window
        if stats is not None and stats is not self._last:
            self._last = stats
            return stats, None
        if not self._warned:
            self._warned = True
            rank_zero_warn(f"`{type(self._strategy).__name__}` published no `last_window` for optimizer step {step};"
                           " DenominatorMonitor logs nothing for such steps.")
        return None, None


class Measured:
    """The monitor's own measurement of each window, under a strategy that publishes none."""

    def __init__(self, count_fn: CountFn, loss_reduction: str) -> None:
        self._count_fn = count_fn
        self._loss_reduction = loss_reduction
        self._channel = Channel(World.single(), rank_counts=True)
        self._window: MeasuredWindow | None = None  # the window being measured

    def start(self, trainer: Trainer, world: World) -> None:
        """A fit starts; ``world``: :func:`measured_world`, the ranks whose windows are measured."""
        if world.distributed or trainer.world_size > 1:
            # the measurement's collectives run on the default group (or on DDP's own, a rank of a group of one
            # running none), which a plain strategy never destroys: a gloo group alive when the interpreter
            # finalizes can abort the exit (token_mean._exit)
            destroy_process_group_at_exit()
        self._channel = Channel(world, rank_counts=True)

    def reset(self) -> None:
        self._window = None

    def add(self, trainer: Trainer, module: LightningModule, batch: Any, outputs: Any, position: int,
            step: int) -> None:
        window = self._window
        if window is None:
            window = self._window = MeasuredWindow(self._channel, self._count_fn, self._loss_reduction, position, step)
        # Lightning divided the closure loss by K under automatic optimization
        window.add(batch, outputs, trainer.accumulate_grad_batches if module.automatic_optimization else 1)

    def finish(self, step: int) -> tuple[WindowStats | None, float | None]:
        window, self._window = self._window, None
        return (None, None) if window is None else window.finish()


def measured_world(trainer: Trainer) -> World:
    """The ranks that share the denominator, whose windows the monitor measures and audits: the layouts' worlds.

    One device trains alone, whatever default process group its process may have (independent processes launched
    by ``torchrun`` for other reasons: their sum would be no run's N); DDP's ranks are those of its process group; a
    device mesh's data-parallel ranks (its tensor-parallel ones train on the same batches); any other strategy's
    (FSDP1, DeepSpeed) the default group's."""
    from lightning.pytorch.strategies import ModelParallelStrategy, SingleDeviceStrategy

    strategy, device = trainer.strategy, trainer.strategy.root_device
    if isinstance(strategy, SingleDeviceStrategy):
        return World.single(device)
    if isinstance(strategy, ModelParallelStrategy):
        return _fsdp.mesh_world(strategy.device_mesh, device)
    return _ddp.model_world(strategy.model if strategy.model is not None else trainer.lightning_module, device)


__all__ = ["Measured", "MeasuredWindow", "Published", "Windows", "measured_world"]
