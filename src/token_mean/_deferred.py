"""Deferred mode: count each micro-batch after its forward, and bring the final scale into the gradient reduction.

Each micro-batch back-propagates its loss sum over D, a stand-in for N/P held on the device (the previous window's
N/P, or the run's first count times K). When the window's last forward is done, its record [count, loss sum,
problems] starts its all-reduce; the final factor D/N reaches the gradient on the device, with no host read, by one
of two :class:`GradientPath`: inside DDP's bucket all-reduce of the last backward (``_ddp.InReduction``), or by one
multiplication of the local gradient shards after it, where the reduction averaged them first (FSDP2,
``_fsdp.AfterReduction``). Nothing is read ahead, but for one case: on a stream, whose end the ranks agree on window
by window, the window's last micro-batch peeks one batch (as Lightning's fetcher does for every batch of a stream),
so the record also says whether the epoch goes on. Only a loader known to yield fresh memory is peeked before the
last backward; for one that refills a buffer the ranks agree after it, in a second collective.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from token_mean._mode import Settings, StepOutput, WindowCheck, WindowMode, WindowResult
from token_mean._problems import Problem
from token_mean._record import Channel, Kind, Slot, Values, raise_lines
from token_mean._window import Closing, Window, scale_of


class GradientPath(ABC):
    """How a deferred window's final factor reaches the gradient."""

    def attach(self, mode: Deferred) -> None:  # noqa: B027 (nothing by default)
        """The mode exists: hook into the reduction (nothing by default)."""

    @abstractmethod
    def after_backward(self, factor: Callable[[], Tensor]) -> None:
        """After the window's last backward: ``factor()`` is D/N on the device (it waits for the exchange there)."""


@dataclass
class _Open:
    """The window being trained."""

    window: Window
    last: bool = False  # the micro-batch in flight is the window's last
    filler: bool = False
    unit: Tensor | None = None  # divisor / D, computed at the window's first backward (again if K changes)
    divisor: float = 0.0  # the divisor `unit` was computed for
    closing: Closing | None = None  # its exchange, from its last forward on
    factor: Tensor | None = None  # D/N, computed once, during the last backward


class Deferred(WindowMode):
    name = "deferred"

    def __init__(
        self, channel: Channel, settings: Settings, gradients: GradientPath, checks: Sequence[WindowCheck] = ()
    ) -> None:
        super().__init__(channel, settings, checks)
        self._gradients = gradients
        # D on the device: the previous window's N/P, kept across windows and checkpoints; the run's first
        # micro-batch sizes it
        self._provisional: Tensor | None = None
        self._open: _Open | None = None
        gradients.attach(self)

    def _reset(self) -> None:
        self._open = None

    # -------------------------------------------------------------------------------------------------------------

    def begin(self, position: int, last: bool, accumulate: int, step: str) -> bool:
        open_ = self._open
        if open_ is None:
            if not self.reader.sized:  # the stream goes on by one window of the K in force (a callback may change it)
                self.reader.extend_to(self.reader.window_stop(position, accumulate))
            open_ = self._open = _Open(self._window(position, accumulate, step))
        else:  # a callback may change K inside the window: the window ends where Lightning steps
            self._changed_inside(open_.window, position, accumulate, stop_kept=True)
        window = open_.window
        if position != window.start + window.length:
            raise RuntimeError(
                f"token_mean: the loop trains batch {position} after batch {window.start + window.length - 1} of the"
                " window being trained: a batch was trained twice or skipped (an `optimizer_step` override that"
                " calls the closure twice does this). Call the closure once per batch."
            )
        entry = self.reader.entry(position)
        if entry.aliased:
            window.flag(Problem.ALIASED, f"the batch at position {position} reuses the memory of a batch in flight")
        open_.last, open_.filler = last, entry.filler
        return entry.filler

    def after_forward(self, batch: Any, output: StepOutput) -> None:
        open_ = self._open
        assert open_ is not None, "begin runs before after_forward"
        window = open_.window
        if output.aux_loss is not None:
            raise ValueError(
                "token_mean: an 'aux_loss' came with the loss, which `mode='deferred'` cannot normalize: its"
                " token scale is only known after the last backward, when both terms already share one gradient"
                " buffer. Use `mode='lookahead'` (the default), or add the auxiliary term to 'loss' yourself."
            )
        count = window.zero() if open_.filler else self._count_received(window, batch, output, use_num_items=True)
        if output.loss is None and not open_.filler:
            window.flag(Problem.NO_LOSS)
        window.add(count, None if open_.filler else output.loss, open_.filler)
        if self._provisional is None:
            self._provisional = self._first_provisional(count * window.accumulate)
        if open_.last:
            open_.closing = self._close(window, Values(self._peek(window)))

    def _first_provisional(self, estimate: Tensor) -> Tensor:
        """D for the run's first window from this rank's estimate of N/P (its first count times K).

        Where gradients are averaged before any per-rank factor (``World.gradients_averaged``), every rank must
        divide by the same D: the estimates are averaged over the ranks, one collective once per run (and not after
        a resume, which restores D), read on the device only. Under DDP the hook applies each rank's own D/N.
        """
        world = self.channel.world
        if world.gradients_averaged and world.distributed:
            exchange = self.channel.start(Kind.PROVISIONAL, Values(device=[(Slot.COUNT, estimate)]))
            estimate = exchange.wait()[Slot.COUNT] / world.size
        return torch.clamp(estimate.to(torch.float64), min=1.0)

    def _peek(self, window: Window) -> dict[Slot, float]:
        """A stream: does this rank hold a real batch after the window? Read before the last backward only from a
        loader known to yield fresh memory; a loader that refills one buffer would overwrite the batch in flight,
        so such a rank says it is unsure and the ranks agree after the backward instead."""
        reader = self.reader
        if reader.sized:
            return {}
        if not reader.fresh:
            return {Slot.UNSURE: 1.0}
        stop = window.start + window.length
        more = reader.has_real_from(stop)
        if any(entry.aliased for entry in reader.entries(stop, stop + 1)):
            window.flag(Problem.ALIASED, f"the batch at position {stop} reuses the memory of the batch in flight")
        return {Slot.MORE: float(more)}

    def _more_after_backward(self, window: Window) -> float:
        """The ranks that hold a real batch after the window, agreed after its last backward: a second, blocking
        collective, only for streams whose loader is not known to yield fresh memory on some rank."""
        more = self.reader.has_real_from(window.start + window.length, in_flight=False)
        reduced = self.channel.reduce(Kind.STREAM_END, Values({Slot.MORE: float(more)}))
        reduced.check(window.where)
        return reduced[Slot.MORE]

    def scale(self, loss: Tensor, divisor: float, aux_loss: Tensor | None) -> Tensor:
        open_ = self._open
        assert open_ is not None and self._provisional is not None, "after_forward runs before scale"
        if open_.unit is None or divisor != open_.divisor:  # D only changes between windows: once per window
            open_.unit, open_.divisor = divisor / self._provisional, divisor
        # An empty micro-batch's mean is 0/0 = NaN and its scale 0. The backward of `loss * scale` multiplies the
        # incoming gradient by the scale and never reads the loss, so its gradient is exactly zero without a guard
        # (the forward value stays NaN, as under plain DDP).
        count = open_.window.last_count
        items = count if self.settings.loss_reduction == "mean" else (count > 0).to(count.dtype)
        return loss * (items * open_.unit)

    def gradient_factor(self) -> Tensor | float:
        """D/N for the reduction of the window's last backward; waits for the exchange on the device."""
        open_ = self._open
        if open_ is None or open_.closing is None or self._provisional is None:
            return 1.0 / self.world_size  # outside a window (a user's own backward): the plain mean
        if open_.factor is None:
            global_count = open_.closing.global_count()
            ratio = self._provisional / global_count
            open_.factor = torch.where(global_count > 0, ratio, torch.zeros_like(ratio))
        return open_.factor

    def _device_factor(self) -> Tensor:
        factor = self.gradient_factor()
        assert isinstance(factor, Tensor), "called after the window's last forward"
        return factor

    def after_backward(self) -> WindowResult | None:
        open_ = self._open
        assert open_ is not None, "begin runs before after_backward"
        return None if open_.closing is None else self._end(open_.window, open_.closing)

    def _end(self, window: Window, closing: Closing) -> WindowResult:
        """After the window's last backward: the final factor into the gradient, then the window's one host read."""
        self._gradients.after_backward(self._device_factor)
        result = closing.result()
        self._open = None
        global_count = result.reduced[Slot.COUNT]
        if global_count > 0 and not (math.isfinite(global_count) and math.isfinite(scale_of(1.0, global_count))):
            lines = [f"N = {global_count!r}: {Problem.COUNT_RANGE.what}. Fix: {Problem.COUNT_RANGE.fix}"]
            raise_lines(lines, window.where, window.detail, self.channel.world.rank)
        if global_count > 0:  # the next windows' backward passes use this window's N/P as their D
            self._provisional = torch.full((), global_count / self.world_size, dtype=torch.float64,
                                           device=self.channel.world.device)
        stats = self._count_skipped(result.stats(global_count, self.name, None))
        unsure = result.reduced[Slot.UNSURE] > 0
        more = self._more_after_backward(window) if unsure else result.reduced[Slot.MORE]
        return WindowResult(stats, self._stream_end(window, more))

    # D only changes rounding, but restoring it keeps a resumed run bitwise identical (a host read per checkpoint)
    def state_dict(self) -> dict[str, Any]:
        provisional = None if self._provisional is None else float(self._provisional)
        return {**super().state_dict(), "provisional": provisional}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        super().load_state_dict(state)
        value = state.get("provisional")
        if value is not None:
            self._provisional = torch.full((), float(value), dtype=torch.float64, device=self.channel.world.device)
