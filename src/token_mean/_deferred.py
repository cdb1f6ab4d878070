"""Deferred mode: count each micro-batch after its forward, and bring the final scale into the gradient reduction.

Each micro-batch back-propagates its loss sum over D, a stand-in for N/P held on the device (the previous window's
N/P, or the run's first count times K). When the window's last forward is done, its record [count, loss sum,
problems] starts its all-reduce; the final factor D/N reaches the gradient on the device, with no host read, by one
of two :class:`GradientPath`: inside DDP's bucket all-reduce of the last backward (``_ddp.InReduction``), or by one
multiplication of the local gradient shards after it, where the reduction averaged them first (FSDP2,
``_fsdp.AfterReduction``). Nothing is read ahead but, on a stream, one batch past the window (the epoch's
``at_close``), so the record also says whether the stream goes on.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor
from torch.nn import Module

from token_mean import _torch
from token_mean._mode import MicroBatch, Settings, StepOutput, Window, WindowCheck, WindowMode
from token_mean._problems import Problem
from token_mean._record import Channel, Kind, Slot, Values
from token_mean._window import Closing, Tally, check_global_count
from token_mean.results import WindowStats

if TYPE_CHECKING:
    from token_mean._epoch import Epoch


class GradientPath(ABC):
    """How a deferred window's final factor reaches the gradient."""

    def attach(self, mode: Deferred) -> None:  # noqa: B027 (nothing by default)
        """The mode exists: hook into the reduction (nothing by default)."""

    @abstractmethod
    def after_backward(self, factor: Callable[[], Tensor]) -> None:
        """After the window's last backward: ``factor()`` is D/N on the device (it waits for the exchange there)."""


class AfterReduction(GradientPath):
    """The reduce-scatter averages the gradients over P with no hook of the package, so the local shards,
    Σ∇(loss sums)/(P·D), are multiplied by P·D/N: one fused kernel over this rank's 1/P of the gradients."""

    def __init__(self, model: Module, world_size: int) -> None:
        self._model = model
        self._world_size = world_size

    def after_backward(self, factor: Callable[[], Tensor]) -> None:
        from torch.distributed.tensor import DTensor

        shards = [
            grad.to_local() if isinstance(grad, DTensor) else grad
            for grad in (parameter.grad for parameter in self._model.parameters())
            if grad is not None
        ]
        if shards:
            _torch.multiply_(shards, factor() * self._world_size)


class Deferred(WindowMode):
    name = "deferred"

    def __init__(
        self, channel: Channel, settings: Settings, gradients: GradientPath, checks: Sequence[WindowCheck] = ()
    ) -> None:
        super().__init__(channel, settings, checks)
        self.gradients = gradients
        # D on the device: the previous window's N/P, kept across windows and checkpoints; the run's first
        # micro-batch sizes it
        self._provisional: Tensor | None = None
        self.reducing: _DeferredWindow | None = None  # the window whose last backward reduces the gradient
        gradients.attach(self)

    def _open(self, epoch: Epoch, tally: Tally, previous: Window | None) -> Window:
        return _DeferredWindow(self, epoch, tally, epoch.reach(tally.start, tally.accumulate))

    def provisional(self, estimate: Callable[[], Tensor]) -> Tensor:
        """D, sized by the run's first micro-batch (``estimate()``: its count times K) when there is none yet.

        Where gradients are averaged before any per-rank factor (``World.gradients_averaged``), every rank must
        divide by the same D: the estimates are averaged over the ranks, one collective once per run (and not after
        a resume, which restores D), read on the device only. Under DDP the hook applies each rank's own D/N.
        """
        if self._provisional is None:
            world, first = self.channel.world, estimate()
            if world.gradients_averaged and world.distributed:
                exchange = self.channel.start(Kind.PROVISIONAL, Values(device=[(Slot.COUNT, first)]))
                first = exchange.wait()[Slot.COUNT] / world.size
            self._provisional = torch.clamp(first.to(torch.float64), min=1.0)
        return self._provisional

    def follow(self, global_count: float) -> None:
        """A window with ``global_count`` items ended: the next windows' backward passes use its N/P as their D."""
        if global_count > 0:
            self._provisional = torch.full((), global_count / self.world_size, dtype=torch.float64,
                                           device=self.channel.world.device)

    def gradient_factor(self) -> Tensor | float:
        """D/N for the reduction of the window's last backward; waits for the exchange on the device."""
        window = self.reducing
        return 1.0 / self.world_size if window is None else window.gradient_factor()  # outside: the plain mean

    # D only changes rounding, but restoring it keeps a resumed run bitwise identical (a host read per checkpoint)
    def state_dict(self) -> dict[str, Any]:
        provisional = None if self._provisional is None else float(self._provisional)
        return {**super().state_dict(), "provisional": provisional}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        super().load_state_dict(state)
        value = state.get("provisional")
        if value is not None:
            self._provisional = torch.full((), float(value), dtype=torch.float64, device=self.channel.world.device)


class _DeferredWindow(Window):
    mode: Deferred

    def __init__(self, mode: Deferred, epoch: Epoch, tally: Tally, stop: int) -> None:
        super().__init__(mode, epoch, tally, stop)
        self._provisional = tally.zero()  # D from the window's first forward on (the fit's zero until then: no op)
        self._closing: Closing | None = None  # its exchange, from its last forward on
        self._factor: Tensor | None = None  # D/N, computed once, during the last backward

    def _replan(self, position: int, accumulate: int) -> None:
        self.stop = self.epoch.reach(position, accumulate)  # the window ends where Lightning now steps

    def _micro_batch(self, position: int, last: bool) -> MicroBatch:
        entry = self.epoch.entry(position)
        if entry.aliased:
            self.tally.flag(Problem.ALIASED, f"the batch at position {position} reuses the memory of a batch in flight")
        return MicroBatch(self, position, last, entry.filler)

    def forward_done(self, micro: MicroBatch, output: StepOutput, batch: Any) -> Tensor:
        if output.aux_loss is not None:
            raise ValueError(
                "token_mean: an 'aux_loss' came with the loss, which `mode='deferred'` cannot normalize: its"
                " token scale is only known after the last backward, when both terms already share one gradient"
                " buffer. Use `mode='lookahead'` (the default), or add the auxiliary term to 'loss' yourself."
            )
        tally = self.tally
        count = tally.zero() if micro.filler else self._count_received(batch, output, use_num_items=True)
        if output.loss is None and not micro.filler:
            tally.flag(Problem.NO_LOSS)
        tally.add(count, None if micro.filler else output.loss, micro.filler)
        if micro.position == self.start:
            self._provisional = self.mode.provisional(lambda: count * self.accumulate)
        if micro.last:
            self._closing = self._close({}, peek=True)
            self.mode.reducing = self
        # An empty micro-batch's mean is 0/0 = NaN and its scale 0. The backward of `loss * scale` multiplies the
        # incoming gradient by the scale and never reads the loss, so its gradient is exactly zero without a guard
        # (the forward value stays NaN, as under plain DDP).
        items = count if self.mode.settings.loss_reduction == "mean" else (count > 0).to(count.dtype)
        return output.backprop * (items / self._provisional)

    def gradient_factor(self) -> Tensor:
        """D/N on the device, waiting for the exchange there (no host read)."""
        if self._factor is None:
            if self._closing is None:
                raise RuntimeError("token_mean: internal error: the gradient was reduced before the window closed.")
            # D >= 1, so D/N is +inf exactly when N = 0: that window changes nothing
            self._factor = torch.nan_to_num(self._provisional / self._closing.global_count(), posinf=0.0)
        return self._factor

    def end(self, micro: MicroBatch) -> WindowStats:
        """After the window's last backward: the final factor into the gradient, then the window's one host read."""
        self.mode.gradients.after_backward(self.gradient_factor)
        self.mode.reducing = None
        closing = self._closing
        if closing is None:
            raise RuntimeError("token_mean: internal error: a window ended before its last forward was done.")
        result = closing.result()
        global_count = result.reduced[Slot.COUNT]
        check_global_count(global_count, 1.0, lambda: self.where, self.tally.detail, self.mode.channel.world.rank)
        self.mode.follow(global_count)
        stats = result.stats(global_count, self.mode.name, None)
        return self._finished(stats, result.reduced[Slot.MORE], result.reduced[Slot.UNSURE] > 0)


__all__ = ["AfterReduction", "Deferred", "GradientPath"]
