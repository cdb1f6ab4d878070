"""Deferred mode: count each micro-batch after its forward, and fix the scale inside DDP's gradient all-reduce.

Each micro-batch back-propagates its loss sum over D, a stand-in for N/P held on the device (the previous window's
N/P, or the first micro-batch's count times K). When the window's last forward is done, its record [count, loss sum,
problems] starts its all-reduce; the gradient buckets of the last backward wait for it on the device and are
multiplied by D/N on their way into DDP's SUM all-reduce, so the gradient is exact with no extra pass over it. The
record is read on the host once, after the last backward. Nothing is read ahead: a stream (a loader without a
length) costs one more small collective per window, after the last backward, to agree on whether the epoch goes on.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from token_mean._comm_hook import scaled_allreduce_hook
from token_mean._counting import device_count, first_labels
from token_mean._mode import StepOutput, Window, WindowMode
from token_mean._problems import Problem
from token_mean._window import (
    COUNT,
    LOSS_SUM,
    MICRO,
    MORE,
    Reduced,
    WindowStats,
    mismatch_slots,
    raise_problems,
    scale_of,
)


class Deferred(WindowMode):
    name = "deferred"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._provisional: Tensor | None = None  # D on the device; kept across windows (and checkpoints)
        self._filler = False
        self._counts: list[Tensor] = []  # per micro-batch, float64 on the device; summed once per window
        self._losses: list[Tensor] = []
        self._reported: list[Tensor] = []
        self._counted: list[Tensor] = []
        self._first: list[Tensor] = []
        self._micro_scale: Tensor | None = None  # the loss scale of the micro-batch in flight, on the device
        self._local_count = self._zero()
        self._factor: Tensor | None = None  # D/N of the window whose last backward runs
        self._unit: Tensor | None = None  # K/D of the open window: D only changes between windows
        self._real = 0

    def attach(self, model: torch.nn.parallel.DistributedDataParallel) -> None:
        # Registered on every device type: Lightning only registers `ddp_comm_hook` on CUDA.
        model.register_comm_hook(self, scaled_allreduce_hook)

    # -------------------------------------------------------------------------------------------------------

    def begin(self, position: int, steps_now: bool, accumulate: int, step: str) -> bool:
        reader = self.reader
        assert reader is not None
        if self.window is None:
            stop = position + accumulate - position % accumulate
            if reader.sized:
                stop = min(stop, reader.length)
            else:
                reader.length = stop  # the epoch reaches this window's end; its exchange may extend it
            self.window = Window(position, stop, accumulate)
            self._reset_flags()
            self._counts, self._losses, self._reported, self._counted = [], [], [], []
            self._first, self._real, self._factor, self._unit = [], 0, None, None
        self._filler = reader.entry(position).filler
        return self._filler

    def after_forward(self, batch: Any, output: StepOutput, steps_now: bool) -> None:
        window = self.window
        assert window is not None
        if output.aux_loss is not None:
            raise ValueError(
                "token_mean: `training_step` returned an 'aux_loss', which `mode='deferred'` cannot normalize: its"
                " token scale is only known after the last backward, when both terms already share one gradient"
                " buffer. Use `mode='lookahead'` (the default), or add the auxiliary term to 'loss' yourself."
            )
        window.trained += 1
        count = self._zero() if self._filler else self._count(batch, output)
        loss = None if self._filler else output.loss
        if loss is None and not self._filler:
            self._flag(Problem.NO_LOSS)
        self._real += not self._filler
        # kept detached, one pair per micro-batch, and summed once per window: no host sync, few kernels
        self._counts.append(count)
        self._losses.append(self._zero() if loss is None else loss.detach())
        if self._provisional is None:  # the first window of the run: D from its first micro-batch, on the device
            self._provisional = self._first_provisional(count * window.accumulate)
        if self._unit is None:  # once per window, not per micro-batch: three kernels fewer each
            self._unit = window.accumulate / self._provisional
        items = count if self.settings.loss_reduction == "mean" else (count > 0).to(count.dtype)
        self._micro_scale = items * self._unit
        if steps_now:
            window.stop = window.start + window.trained
            self._exchange = self._start_exchange(self._record(window))

    def _first_provisional(self, estimate: Tensor) -> Tensor:
        """D for the run's first window from this rank's estimate of N/P (its first count times K).

        Where gradients are averaged before any per-rank factor (``World.gradients_averaged``), every rank must
        divide by the same D: the estimates are averaged over the ranks, one SUM all-reduce of one float, once per
        run (and not after a resume, which restores D). Under DDP the comm hook applies each rank's own D/N.
        """
        world = self.world
        if world.gradients_averaged and world.distributed:
            estimate = estimate.clone()
            dist.all_reduce(estimate, group=world.group)
            estimate = estimate / world.size
        return torch.clamp(estimate, min=1.0)

    def _zero(self) -> Tensor:
        return torch.zeros((), dtype=torch.float64, device=self.world.device)

    def _count(self, batch: Any, output: StepOutput) -> Tensor:
        """This micro-batch's count on the device: 'num_items' if reported, else ``count_fn(batch)``."""
        reported = None if output.num_items is None else self._device_count(output.num_items, "'num_items'")
        from_fn = None
        if self.settings.count_fn_given or output.num_items is None:
            try:
                from_fn = self._device_count(self.settings.count_fn(batch), "`count_fn`")
            except Exception as error:  # every rank must reach the collective to learn of it
                self._flag(Problem.COUNT_FAILED, f"`count_fn` raised {type(error).__name__}: {error}")
        if reported is not None and from_fn is not None:
            self._reported.append(reported)
            self._counted.append(from_fn)
            first = first_labels(batch)
            self._first.append(self._zero() if first is None else first.to(torch.float64))
        chosen = reported if reported is not None else from_fn  # 'num_items' takes precedence
        return chosen if chosen is not None else self._zero()

    def _device_count(self, value: Any, source: str) -> Tensor | None:
        count, detail = device_count(value, source, self.world.device)
        if count is None:
            self._flag(Problem.COUNT_FAILED, detail)
        return count

    def _record(self, window: Window) -> Tensor:
        counts = torch.stack(self._counts)
        finite = torch.isfinite(counts)
        valid = torch.where(finite & (counts > 0), counts, torch.zeros_like(counts))
        self._local_count = valid.sum()
        losses = torch.stack(self._losses).to(torch.float64)
        values = losses * valid if self.settings.loss_reduction == "mean" else losses
        has_items = valid > 0
        device_scalars = [
            (COUNT, self._local_count),
            (LOSS_SUM, torch.where(has_items, values, torch.zeros_like(values)).sum()),
        ]
        finite_loss = torch.isfinite(losses)
        device_flags = [
            (Problem.COUNT_NEGATIVE, (counts < 0).any()),
            (Problem.COUNT_NONFINITE, (~finite).any()),
            (Problem.BAD_LOSS, (has_items & ~finite_loss).any()),
            # a finite loss times a huge count: the count's fault, not the model's
            (Problem.COUNT_RANGE, (has_items & finite_loss & ~torch.isfinite(values)).any()),
            *self._replica_flags(valid),
        ]
        slots = [(MICRO, float(self._real)), *self._length_slots(window.stop - window.start)]
        if self._reported:
            reported, counted = torch.stack(self._reported), torch.stack(self._counted)
            device_scalars += mismatch_slots(reported, counted, torch.stack(self._first))
            device_flags.append((self._mismatch, (reported != counted).any()))
        return self._record_tensor(slots, [], device_scalars, device_flags)

    @property
    def _mismatch(self) -> Problem:
        given = self.settings.count_fn_given
        return Problem.NUM_ITEMS_MISMATCH_COUNT_FN if given else Problem.NUM_ITEMS_MISMATCH_DEFAULT

    # -------------------------------------------------------------------------------------------------------

    def scale(self, closure_loss: Tensor, aux_loss: Tensor | None) -> Tensor:
        assert self._micro_scale is not None
        # An empty micro-batch's mean is 0/0 = NaN and its scale 0. The backward of `loss * scale` multiplies the
        # incoming gradient by the scale and never reads the loss, so its gradient is exactly zero without a guard
        # (the forward value stays NaN, as under plain DDP); a `torch.where` guard cost four kernels per micro-batch.
        return closure_loss * self._micro_scale

    def gradient_factor(self) -> Tensor | float:
        """D/N for the bucket all-reduce of the window's last backward; waits for the exchange on the device."""
        if self._factor is None:
            if self._exchange is None or self._provisional is None:
                return 1.0 / self.world.size  # outside a window (a user's own backward): DDP's plain mean
            global_count = self._exchange.wait()[COUNT]
            ratio = self._provisional / global_count
            self._factor = torch.where(global_count > 0, ratio, torch.zeros_like(ratio))
        return self._factor

    def gradient_correction(self) -> Tensor | None:
        """P·D/N on the device: gradients averaged over P ranks hold Σ∇(loss sums)/(P·D); one multiplication of the
        local gradient (or shard) by this makes them Σ∇(loss sums)/N. Waits for the exchange on the device only."""
        if self._exchange is None or self._provisional is None:
            return None  # no window is open: nothing to correct
        factor = self.gradient_factor()
        return factor * self.world.size if isinstance(factor, Tensor) else None

    def finish(self, step: str) -> tuple[WindowStats, int | None]:
        window, exchange = self.window, self._exchange
        assert window is not None and exchange is not None
        values = exchange.read(extra=self._local_count.reshape(1))
        reduced, local_count = Reduced(values[:-1]), values[-1]
        self._exchange, self.window = None, None
        global_count = reduced[COUNT]
        where = self._where(step, window)
        lines = self._problems(reduced, check_lengths=True)
        assert self._provisional is not None
        if global_count > 0 and not (math.isfinite(global_count) and math.isfinite(scale_of(1.0, global_count))):
            lines.append(f"N = {global_count!r}: {Problem.COUNT_RANGE.what}. Fix: {Problem.COUNT_RANGE.fix}")
        raise_problems(lines, where, self._detail, self.world.rank)
        if global_count > 0:  # the next windows' backward passes use this window's N/P as their D
            self._provisional = torch.full((), global_count / self.world.size, dtype=torch.float64,
                                           device=self.world.device)
        stats = self._skip(
            WindowStats(
                global_count=global_count,
                local_count=local_count,
                rank_counts=reduced.rank_counts(),
                window_length=window.stop - window.start,
                loss=None if global_count == 0 else reduced[LOSS_SUM] / global_count,
                skipped=global_count == 0,
                mode=self.name,
                aux_loss=None,
            )
        )
        return stats, self._agree_on_more(window, step)

    def _agree_on_more(self, window: Window, step: str) -> int | None:
        """A stream (no length, or an IterableDataset's): does any rank have a batch after this window?

        Peeks one batch ahead and costs one small blocking collective, here, after the window's last backward:
        peeking before it would let a loader that refills one buffer overwrite the batch still in flight (lookahead
        reads ahead anyway and carries the answer in its window's record instead).
        """
        reader = self.reader
        assert reader is not None
        if reader.sized:
            return None
        more = reader.has_real_from(window.stop)
        ranks_with_more = self._reduce(self._record_tensor([(MORE, float(more))], problems=[]))[MORE]
        if not self.settings.pad_uneven_ranks and 0 < ranks_with_more < self.world.size:
            lines = [f"{Problem.UNEVEN.what}: the ranks' loaders ended at different batches. Fix: {Problem.UNEVEN.fix}"]
            raise_problems(lines, self._where(step, window), "", self.world.rank)
        if ranks_with_more == 0:
            return None
        reader.length = window.stop + window.accumulate
        return reader.length

    # D only changes rounding, but restoring it keeps a resumed run bitwise identical (a host read per checkpoint)
    def state_dict(self) -> dict[str, Any]:
        provisional = None if self._provisional is None else float(self._provisional)
        return {**super().state_dict(), "provisional": provisional}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        super().load_state_dict(state)
        value = state.get("provisional")
        if value is not None:
            self._provisional = torch.full((), float(value), dtype=torch.float64, device=self.world.device)

