"""Lookahead mode: count each window's batches before its first backward, and scale every micro-batch's loss.

The counts of window w + 1 travel in window w's exchange: while window w trains, the reader takes one batch of
window w + 1 per micro-batch from the loader (a rolling read-ahead: the loader's workers keep pace, and at most K
batches are held), so when window w ends its record carries [N's share of w + 1, w's loss sum, problems] in one
all-reduce, read on the host once, after w's last backward. Only an epoch's first window costs a collective of its
own, before any forward. The loss scale K·P·n/N is then a host float: no kernel beyond one multiplication.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from token_mean._counting import check_count, first_labels, read_count
from token_mean._mode import StepOutput, Window, WindowMode
from token_mean._problems import Problem
from token_mean._reader import Entry
from token_mean._window import (
    AUX_SUM,
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


class Lookahead(WindowMode):
    name = "lookahead"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._global_count = 0.0  # N of the open window, announced by the previous exchange
        self._real_micro = 0.0  # M: the open window's real micro-batches over all ranks (for 'aux_loss')
        self._rank_counts: tuple[float, ...] | None = None
        self._entry: Entry | None = None
        self._losses: list[Tensor] = []  # detached, of micro-batches with items; summed once per window
        self._weights: list[float] = []
        self._aux: list[Tensor] = []
        self._num_items: list[tuple[Tensor | float, float, Tensor | None]] = []  # (reported, counted, first labels)
        self._local_count = 0.0
        self._next: list[Entry] = []

    def _counter(self) -> Any:
        count_fn = self.settings.count_fn
        return lambda batch: read_count(count_fn, batch)

    # -------------------------------------------------------------------------------------------------------

    def begin(self, position: int, steps_now: bool, accumulate: int, step: str) -> bool:
        reader = self.reader
        assert reader is not None
        window = self.window
        if window is None:  # the epoch's first window: its counts need a collective of their own
            window = self._open(position, accumulate)
            entries = reader.entries(window.start, window.stop)
            window.stop = window.start + len(entries)
            reduced = self._reduce(self._announce(entries))
            self._accept(reduced, window, reduced.problems(), self._where(step, window))
        elif position >= window.stop:
            window = self._open(position, accumulate, stop=position + len(self._next))
        if window.stop - window.start == 0 or not window.start <= position < window.stop:
            raise RuntimeError(self._disagreement(position, window))
        if steps_now != (position == window.stop - 1):
            raise RuntimeError(self._disagreement(position, window))
        self._entry = entry = reader.entry(position)
        # rolling read-ahead: one batch of the next window now, the rest of it at this window's last micro-batch
        next_stop = self._next_stop(window)
        reader.read_ahead(next_stop, at_most=None if position == window.stop - 1 else 1)
        return entry.filler

    def _open(self, position: int, accumulate: int, stop: int | None = None) -> Window:
        reader = self.reader
        assert reader is not None
        if stop is None:
            stop = position + accumulate - position % accumulate
            if reader.sized:
                stop = min(stop, reader.length)
        if not reader.sized:
            reader.length = stop  # the epoch reaches this window's end; the exchange may extend it
        self.window = Window(position, stop, accumulate)
        self._reset_flags()
        self._losses, self._weights, self._aux, self._num_items = [], [], [], []
        self._local_count = 0.0
        return self.window

    def _next_stop(self, window: Window) -> int:
        reader = self.reader
        assert reader is not None
        stop = window.stop + window.accumulate
        return min(stop, reader.length) if reader.sized else stop

    def _disagreement(self, position: int, window: Window) -> str:
        return (
            f"token_mean: internal error: Lightning trains batch {position} but the lookahead window is"
            f" {window.start}..{window.stop - 1}. Please report this with your Trainer settings."
        )

    # -------------------------------------------------------------------------------------------------------

    def after_forward(self, batch: Any, output: StepOutput, steps_now: bool) -> None:
        entry, window = self._entry, self.window
        assert entry is not None and window is not None
        window.trained += 1
        count = 0.0 if entry.filler else entry.count
        self._local_count += count
        if output.loss is None and not entry.filler:
            self._flag(Problem.NO_LOSS)
        elif output.loss is not None and count > 0:
            self._losses.append(output.loss.detach())
            self._weights.append(count if self.settings.loss_reduction == "mean" else 1.0)
        if output.aux_loss is not None and not entry.filler:
            self._aux.append(output.aux_loss.detach())
        if output.num_items is not None and not entry.filler:
            self._check_num_items(output.num_items, count, first_labels(batch))
        if steps_now:
            self._exchange = self._start_exchange(self._announce(self._next_entries(window), window))

    def _check_num_items(self, num_items: Any, count: float, first: Tensor | None) -> None:
        """A model that reports 'num_items' must agree with the count the window was already normalized by."""
        value, detail = check_count(num_items, "'num_items'")
        if value is None:
            self._flag(Problem.COUNT_FAILED, detail)
        else:  # compared on the device at the window's end: no sync here
            self._num_items.append((value, count, first))

    @property
    def _mismatch(self) -> Problem:
        given = self.settings.count_fn_given
        return Problem.NUM_ITEMS_MISMATCH_COUNT_FN if given else Problem.NUM_ITEMS_MISMATCH_DEFAULT

    def _next_entries(self, window: Window) -> list[Entry]:
        reader = self.reader
        assert reader is not None
        self._next = reader.entries(window.stop, self._next_stop(window))
        return self._next

    def _announce(self, entries: list[Entry], window: Window | None = None) -> Tensor:
        """A record announcing ``entries``' counts (and, when a window ends, carrying its loss and problems)."""
        if window is None:
            self._reset_flags()
        for entry in entries:
            if entry.problem is not None:
                self._flag(entry.problem, entry.detail)
        count = sum(entry.count for entry in entries if not entry.filler)
        if not math.isfinite(count):  # finite counts whose sum overflows float64
            self._flag(Problem.COUNT_RANGE, f"this rank's counts of the window sum to {count}")
            count = 0.0
        real = float(sum(not entry.filler for entry in entries))
        more = float(any(not entry.filler for entry in entries))
        slots = [(COUNT, count), (MICRO, real), (MORE, more)]
        device_scalars: list[tuple[int, Tensor]] = []
        device_flags: list[tuple[Problem, Tensor]] = []
        if entries and self.world.replica_group is not None:
            counts = torch.tensor([0.0 if entry.filler else entry.count for entry in entries], dtype=torch.float64)
            device_flags += self._replica_flags(counts)
        if window is not None:
            slots += self._length_slots(window.stop - window.start)
            if self._losses:
                weighted = torch.stack(self._losses).to(torch.float64) * torch.tensor(
                    self._weights, dtype=torch.float64, device=self.world.device
                )
                device_scalars.append((LOSS_SUM, weighted.sum()))
                finite_loss = torch.isfinite(torch.stack(self._losses))
                device_flags.append((Problem.BAD_LOSS, ~finite_loss.all()))
                # a finite loss times a huge count: the count's fault, not the model's
                device_flags.append((Problem.COUNT_RANGE, (finite_loss & ~torch.isfinite(weighted)).any()))
            if self._aux:
                aux = torch.stack(self._aux).to(torch.float64)
                device_scalars.append((AUX_SUM, aux.sum()))
                device_flags.append((Problem.BAD_AUX_LOSS, ~torch.isfinite(aux).all()))
            if self._num_items:
                device = self.world.device
                reported = torch.stack(
                    [torch.as_tensor(value, dtype=torch.float64).to(device) for value, _, _ in self._num_items]
                )
                counted = torch.tensor([count for _, count, _ in self._num_items], dtype=torch.float64, device=device)
                first = torch.stack([
                    torch.zeros((), device=device) if first is None else first.to(device, torch.float64)
                    for _, _, first in self._num_items
                ])
                device_scalars += mismatch_slots(reported, counted, first)
                device_flags.append((self._mismatch, (reported != counted).any()))
        return self._record_tensor(slots, [], device_scalars, device_flags)

    def _accept(self, reduced: Reduced, window: Window, lines: list[str], where: str) -> None:
        """Take the announced counts of the window after ``window``'s start, raising every problem before its use."""
        self._global_count = reduced[COUNT]
        self._real_micro = reduced[MICRO]
        self._rank_counts = reduced.rank_counts()
        factor = scale_of(self.world.size * window.accumulate, self._global_count)
        if not (math.isfinite(self._global_count) and math.isfinite(factor)):
            lines = [*lines, f"N = {self._global_count!r}: {Problem.COUNT_RANGE.what}. Fix: {Problem.COUNT_RANGE.fix}"]
        raise_problems(lines, where, self._detail, self.world.rank)

    # -------------------------------------------------------------------------------------------------------

    def scale(self, closure_loss: Tensor, aux_loss: Tensor | None) -> Tensor:
        entry, window = self._entry, self.window
        assert entry is not None and window is not None
        size, accumulate = self.world.size, window.accumulate
        count = 0.0 if entry.filler else entry.count
        if count > 0:
            items = count if self.settings.loss_reduction == "mean" else 1.0
            # Lightning divided by K and DDP will average over P: K·P·n/N gives this micro-batch its share of 1/N
            scaled = closure_loss * (accumulate * size * items / self._global_count)
        else:  # the mean of an empty micro-batch is 0/0 = NaN; its backward must still run for DDP
            scaled = torch.nan_to_num(closure_loss, nan=0.0, posinf=0.0, neginf=0.0) * 0.0
        if aux_loss is not None:
            weight = 0.0 if entry.filler or self._real_micro == 0 else size / self._real_micro
            scaled = scaled + aux_loss * weight
        return scaled

    def finish(self, step: str) -> tuple[WindowStats, int | None]:
        window, exchange = self.window, self._exchange
        assert window is not None and exchange is not None
        reduced = Reduced(exchange.read())
        self._exchange = None
        where = self._where(step, window)
        lines = self._problems(reduced, check_lengths=True)
        global_count, local_count, rank_counts, real_micro = (
            self._global_count, self._local_count, self._rank_counts, self._real_micro
        )
        # the next window's counts arrived with this window's record: every problem is raised before this update
        self._accept(reduced, window, lines, where)
        stats = self._skip(
            WindowStats(
                global_count=global_count,
                local_count=local_count,
                rank_counts=rank_counts,
                window_length=window.stop - window.start,
                loss=None if global_count == 0 else reduced[LOSS_SUM] / global_count,
                skipped=global_count == 0,
                mode=self.name,
                aux_loss=reduced[AUX_SUM] / real_micro if self._aux and real_micro else None,
            )
        )
        new_length = None
        reader = self.reader
        assert reader is not None
        if not reader.sized and reduced[MORE] > 0:
            new_length = window.stop + window.accumulate
            reader.length = new_length
        return stats, new_length

