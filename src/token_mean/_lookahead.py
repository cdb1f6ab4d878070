"""Lookahead mode: count each window's batches before its first backward, and scale every micro-batch's loss.

The counts of window w + 1 travel in window w's record: while window w trains, the reader takes one batch of window
w + 1 per micro-batch from the loader (a rolling read-ahead: the loader's workers keep pace, and at most K batches are
held), so when window w ends its one all-reduce carries w + 1's share of N with w's loss sum and problems, read on the
host once, after w's last backward. Only a pass's first window costs a collective of its own, before any forward.
The loss scale P·n/N is then a host float: one multiplication per micro-batch. Every micro-batch is also counted as
its forward received it, on the device, and checked against the count read ahead, so a hook that changes the labels
after the loader (``on_after_batch_transfer``) is an error before the update, not a silently wrong mean.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from torch import Tensor

from token_mean._counting import first_labels, read_count
from token_mean._mode import MicroBatch, StepOutput, Window, WindowMode, k_changed
from token_mean._problems import Problem
from token_mean._reader import Entry
from token_mean._record import Kind, Reduced, Slot, Values
from token_mean._window import Closing, Tally, check_global_count, scale_of
from token_mean.results import WindowStats

if TYPE_CHECKING:
    from token_mean._epoch import Epoch


class _Counts(NamedTuple):
    """A window's counts, known before its first forward: this rank's per position, and their sums over ranks."""

    stop: int
    local: list[float]  # this rank's count at each position of the window (0 for a filler)
    global_count: float  # N
    real: float  # the window's real micro-batches over all ranks (what 'aux_loss' is averaged over)


class Lookahead(WindowMode):
    name = "lookahead"
    judges_counts = False  # judged on the host as they are read ahead

    def _open(self, epoch: Epoch, tally: Tally, previous: Window | None) -> Window:
        start = tally.start
        stop = epoch.reach(start, tally.accumulate)
        counts = previous.next_counts if isinstance(previous, _LookaheadWindow) else None
        if counts is not None and counts.stop != stop:
            counts = None  # K changed where this window starts: the counts read ahead cover the old K's window
        if counts is None:  # the pass's first window (or the first after K changed): a collective of its own
            entries = epoch.entries(start, stop)
            local, host = self.announce(entries, tally)
            reduced = self.channel.reduce(Kind.FIRST_COUNTS, Values(host, flags=frozenset(tally.flags)))
            stop = start + len(entries)
            reduced.check(tally.where_until(stop), tally.detail)
            counts = self.accept(reduced, stop, local, tally, lambda: tally.where_until(stop))
        return _LookaheadWindow(self, epoch, tally, counts)

    def announce(self, entries: list[Entry], tally: Tally) -> tuple[list[float], dict[Slot, float]]:
        """Count ``entries`` as the loader yielded them (on the host), flagging their problems in ``tally``."""
        local, real = [], 0.0
        for entry in entries:
            real += not entry.filler
            if entry.aliased:
                tally.flag(Problem.ALIASED, f"the batch at position {entry.position} reuses the memory of a batch"
                           " held before it")
            count, problem, detail = (0.0, None, "") if entry.filler else read_count(self.settings.count_fn,
                                                                                     entry.batch)
            if problem is not None:
                tally.flag(problem, f"the batch at position {entry.position} (read ahead): {detail}")
            local.append(count)
        total = sum(local)
        if not math.isfinite(total):  # finite counts whose sum overflows float64
            tally.flag(Problem.COUNT_RANGE, f"this rank's counts of the window sum to {total}")
            total = 0.0
        return local, {Slot.NEXT_COUNT: total, Slot.NEXT_REAL: real, Slot.MORE: float(real > 0)}

    def accept(self, reduced: Reduced, stop: int, local: list[float], tally: Tally,
               where: Callable[[], str]) -> _Counts:
        """The announced counts of the window ``where`` that ends at ``stop`` (the record's problems raised already,
        ``tally`` the window whose record brought them), raising an N that cannot normalize before its use."""
        global_count = reduced[Slot.NEXT_COUNT]
        check_global_count(global_count, self.world_size * tally.accumulate, where, tally.detail,
                           self.channel.world.rank)
        return _Counts(stop, local, global_count, reduced[Slot.NEXT_REAL])

    def starts_before_exchange(self, epoch: Epoch, position: int, accumulate: int,
                               previous: Window | None) -> int | None:
        counts = previous.next_counts if isinstance(previous, _LookaheadWindow) else None
        if counts is None or counts.stop != epoch.window_stop(position, accumulate):
            return None  # the others first count the window in a collective of its own, before its first forward
        return counts.stop - 1 - position


class _LookaheadWindow(Window):
    mode: Lookahead

    def __init__(self, mode: Lookahead, epoch: Epoch, tally: Tally, counts: _Counts) -> None:
        super().__init__(mode, epoch, tally, counts.stop)
        self.counts = counts
        # the reduction averages over P: an item's share of 1/N, and the micro-batch's weight per count
        self._share = scale_of(mode.world_size, counts.global_count)
        self._mean = mode.settings.loss_reduction == "mean"
        self.next_counts: _Counts | None = None  # the next window's, announced in this window's record
        self._next_local: list[float] = []
        self._closing: Closing | None = None  # its exchange, from its last forward on
        self._ahead = epoch.window_stop(counts.stop, tally.accumulate)  # where the next window ends

    def _replan(self, position: int, accumulate: int) -> None:
        """Lightning must still step where the window was planned to end: its first backward passes were normalized
        by the window's items as planned."""
        stop = self.epoch.window_stop(position, accumulate)
        if stop != self.stop:
            raise ValueError(k_changed(self.accumulate, accumulate, position, (
                f"inside {self.where}: Lightning now steps after batch {stop - 1}, but `mode='lookahead'` normalized"
                " the window's first backward passes by the items of the window as it was planned. Use"
                " `mode='deferred'`, which follows the window Lightning steps")))
        self._ahead = self.epoch.window_stop(self.stop, accumulate)

    def _micro_batch(self, position: int, last: bool) -> MicroBatch:
        filler = self.epoch.entry(position).filler
        count = 0.0 if filler else self.counts.local[position - self.start]
        # rolling read-ahead: one batch of the next window now, the rest of it at this window's last micro-batch
        self.epoch.read_ahead(self._ahead, all_of_it=last)
        return MicroBatch(self, position, last, filler, count)

    def forward_done(self, micro: MicroBatch, output: StepOutput, batch: Any) -> Tensor:
        tally = self.tally
        if micro.filler:
            tally.add(0.0, None, filler=True)
        else:
            if self.epoch.reader.unchanged(batch):  # the very tensors counted as read: only 'num_items' to check
                if output.num_items is not None:
                    reported = self._checked(output.num_items, "'num_items'")
                    if reported is not None:
                        tally.check_equal(self.mode.settings.mismatch, reported, micro.count, first_labels(batch))
            else:  # moved to the device or changed by a hook: counted again as received, and the two must agree
                received = self._count_received(batch, output, use_num_items=False)
                tally.check_equal(Problem.COUNT_CHANGED, micro.count, received)
            if output.loss is None:
                tally.flag(Problem.NO_LOSS)
            tally.add(micro.count, output.loss, filler=False, aux=output.aux_loss)
        if micro.last:
            entries = self.epoch.entries(self.stop, self._ahead)
            self._next_local, host = self.mode.announce(entries, tally)
            self._closing = self._close(host, peek=False)
        return self._scaled(micro, output)

    def _scaled(self, micro: MicroBatch, output: StepOutput) -> Tensor:
        counts, loss = self.counts, output.backprop
        if micro.count > 0:
            scaled = loss * ((micro.count if self._mean else 1.0) * self._share)
        else:  # the mean of an empty micro-batch is 0/0 = NaN; its backward must still run for the reduction
            scaled = torch.nan_to_num(loss, nan=0.0, posinf=0.0, neginf=0.0) * 0.0
        if output.aux_loss is not None:
            weight = 0.0 if micro.filler or counts.real == 0 else self.mode.world_size / counts.real
            scaled = scaled + output.aux_loss * weight
        return scaled

    def end(self, micro: MicroBatch) -> WindowStats:
        """After the window's last backward: the one host read, which also brings the next window's counts."""
        closing = self._closing
        if closing is None:
            raise RuntimeError("token_mean: internal error: a window ended before its last forward was done.")
        result = closing.result()
        counts, reduced = self.counts, result.reduced
        # the next window's counts arrived with this window's record: every problem is raised before this update
        stop = counts.stop + len(self._next_local)
        self.next_counts = self.mode.accept(reduced, stop, self._next_local, self.tally,
                                            lambda: self.tally.where_next(stop))
        aux = reduced[Slot.AUX_SUM] / counts.real if self.tally.has_aux and counts.real else None
        stats = result.stats(counts.global_count, self.mode.name, aux)
        return self._finished(stats, reduced[Slot.MORE], reduced[Slot.UNSURE] > 0)


__all__ = ["Lookahead"]
