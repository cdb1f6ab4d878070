"""Lookahead mode: count each window's batches before its first backward, and scale every micro-batch's loss.

The counts of window w + 1 travel in window w's record: while window w trains, the reader takes one batch of window
w + 1 per micro-batch from the loader (a rolling read-ahead: the loader's workers keep pace, and at most K batches are
held), so when window w ends its one all-reduce carries w + 1's share of N with w's loss sum and problems, read on the
host once, after w's last backward. Only an epoch's first window costs a collective of its own, before any forward.
The loss scale K·P·n/N is then a host float: one multiplication per micro-batch. Every micro-batch is also counted as
``training_step`` receives it, on the device, and checked against the count read ahead, so a hook that changes the
labels after the loader (``on_after_batch_transfer``) is an error before the update, not a silently wrong mean.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from token_mean._counting import read_count
from token_mean._mode import StepOutput, WindowMode, WindowResult
from token_mean._problems import Problem
from token_mean._reader import Entry
from token_mean._record import Kind, Reduced, Slot, Values, raise_lines
from token_mean._window import Closing, Window, scale_of


@dataclass(frozen=True)
class _Counts:
    """A window's counts, known before its first forward: this rank's per position, and their sums over ranks."""

    stop: int
    local: list[float]  # this rank's count at each position of the window (0 for a filler)
    global_count: float  # N
    real: float  # the window's real micro-batches over all ranks (what 'aux_loss' is averaged over)


@dataclass
class _Open:
    """The window being trained."""

    window: Window
    counts: _Counts
    position: int = -1  # of the micro-batch in flight
    filler: bool = False
    closing: Closing | None = None  # its exchange, from its last forward on
    next_local: list[float] = field(default_factory=list)  # the next window's counts, announced in its record


class Lookahead(WindowMode):
    name = "lookahead"

    def _reset(self) -> None:
        self._open: _Open | None = None
        self._announced: dict[int, _Counts] = {}  # by start position: the next window's counts

    # -------------------------------------------------------------------------------------------------------------

    def begin(self, position: int, last: bool, accumulate: int, step: str) -> bool:
        open_ = self._open
        if open_ is None or position >= open_.counts.stop:
            open_ = self._open = self._open_window(position, accumulate, step)
        else:  # a callback may change K inside the window; its scale undoes Lightning's divisor per micro-batch
            stop = self.reader.window_stop(position, accumulate)
            self._changed_inside(open_.window, position, accumulate, stop_kept=stop == open_.counts.stop)
        counts = open_.counts
        window = open_.window
        if not (position == open_.position + 1 or (open_.position < 0 and position == window.start)):
            raise RuntimeError(self._disagreement(position, window.start, counts.stop))
        if last != (position == counts.stop - 1):
            raise RuntimeError(self._disagreement(position, window.start, counts.stop))
        open_.position = position
        open_.filler = self.reader.entry(position).filler
        # rolling read-ahead: one batch of the next window now, the rest of it at this window's last micro-batch
        self.reader.read_ahead(self.reader.window_stop(counts.stop, accumulate), at_most=None if last else 1)
        return open_.filler

    def _open_window(self, start: int, accumulate: int, step: str) -> _Open:
        # counts are judged on the host as they are read ahead; the batch `training_step` receives must match them
        window = self._window(start, accumulate, step, judge_counts=False)
        counts = self._announced.pop(start, None)
        if counts is not None and counts.stop != self.reader.window_stop(start, accumulate):
            counts = None  # K changed where this window starts: the counts read ahead cover the old K's window
        if counts is None:  # the epoch's first window (or the first after K changed): a collective of its own
            stop = self.reader.window_stop(start, accumulate)
            if not self.reader.sized:
                self.reader.extend_to(stop)  # the stream's epoch reaches this window's end, for now
            entries = self.reader.entries(start, stop)
            local, host = self._announce(entries, window)
            reduced = self.channel.reduce(Kind.FIRST_COUNTS, Values(host, flags=frozenset(window.flags)))
            reduced.check(window.where_until(start + len(entries)), window.detail)
            counts = self._accept(reduced, start + len(entries), local, window)
        return _Open(window, counts)

    def _announce(self, entries: list[Entry], window: Window) -> tuple[list[float], dict[Slot, float]]:
        """Count ``entries`` as the loader yielded them (on the host), flagging their problems in ``window``."""
        local = []
        for entry in entries:
            if entry.aliased:
                window.flag(Problem.ALIASED, f"the batch at position {entry.position} reuses the memory of a batch"
                            " held before it")
            count, problem, detail = (0.0, None, "") if entry.filler else read_count(self.settings.count_fn,
                                                                                     entry.batch)
            if problem is not None:
                window.flag(problem, f"the batch at position {entry.position} (read ahead): {detail}")
            local.append(count)
        total = sum(local)
        if not math.isfinite(total):  # finite counts whose sum overflows float64
            window.flag(Problem.COUNT_RANGE, f"this rank's counts of the window sum to {total}")
            total = 0.0
        real = float(sum(not entry.filler for entry in entries))
        return local, {Slot.NEXT_COUNT: total, Slot.NEXT_REAL: real, Slot.MORE: float(real > 0)}

    def _accept(self, reduced: Reduced, stop: int, local: list[float], window: Window) -> _Counts:
        """The announced counts of the window that ends at ``stop`` (the record's problems raised already), raising
        an N that cannot normalize before its use."""
        global_count = reduced[Slot.NEXT_COUNT]
        factor = scale_of(self.world_size * window.accumulate, global_count)
        if not (math.isfinite(global_count) and math.isfinite(factor)):
            lines = [f"N = {global_count!r}: {Problem.COUNT_RANGE.what}. Fix: {Problem.COUNT_RANGE.fix}"]
            raise_lines(lines, window.where, window.detail, self.channel.world.rank)
        return _Counts(stop, local, global_count, reduced[Slot.NEXT_REAL])

    def batch_starts_before_exchange(self, position: int, accumulate: int) -> int | None:
        open_ = self._open
        if open_ is not None and open_.window.start <= position < open_.counts.stop:
            return open_.counts.stop - 1 - position
        counts = self._announced.get(position)  # the next window's, if the rank left at its first batch
        if counts is None or counts.stop != self.reader.window_stop(position, accumulate):
            return None  # the others first count the window in a collective of its own, before its first forward
        return counts.stop - 1 - position

    @staticmethod
    def _disagreement(position: int, start: int, stop: int) -> str:
        return (
            f"token_mean: the loop trains batch {position} where the window being trained holds batches"
            f" {start}..{stop - 1}: a batch was trained twice or skipped (an `optimizer_step` override that calls"
            " the closure twice, or an `on_train_batch_start` that returns -1 in the middle of a window, does this)."
            " Call the closure once per batch; if this is not such a case, please report it with your settings."
        )

    # -------------------------------------------------------------------------------------------------------------

    def after_forward(self, batch: Any, output: StepOutput) -> None:
        open_ = self._open
        assert open_ is not None, "begin runs before after_forward"
        window, filler = open_.window, open_.filler
        if filler:
            window.add(window.zero(), None, filler=True)
        else:
            received = self._count_received(window, batch, output, use_num_items=False)
            read = open_.counts.local[open_.position - window.start]
            window.check_equal(Problem.COUNT_CHANGED, read, received)
            if output.loss is None:
                window.flag(Problem.NO_LOSS)
            window.add(received, output.loss, filler=False, aux=output.aux_loss)
        if open_.position == open_.counts.stop - 1:
            next_stop = self.reader.window_stop(open_.counts.stop, window.accumulate)
            entries = self.reader.entries(open_.counts.stop, next_stop)
            open_.next_local, host = self._announce(entries, window)
            open_.closing = self._close(window, Values(host))

    def scale(self, loss: Tensor, divisor: float, aux_loss: Tensor | None) -> Tensor:
        open_ = self._open
        assert open_ is not None, "begin runs before scale"
        counts = open_.counts
        count = 0.0 if open_.filler else counts.local[open_.position - open_.window.start]
        if count > 0:
            items = count if self.settings.loss_reduction == "mean" else 1.0
            # the front end divided by `divisor` and the reduction averages over P: this gives the micro-batch its
            # share of 1/N
            scaled = loss * (divisor * self.world_size * items / counts.global_count)
        else:  # the mean of an empty micro-batch is 0/0 = NaN; its backward must still run for the reduction
            scaled = torch.nan_to_num(loss, nan=0.0, posinf=0.0, neginf=0.0) * 0.0
        if aux_loss is not None:
            weight = 0.0 if open_.filler or counts.real == 0 else self.world_size / counts.real
            scaled = scaled + aux_loss * weight
        return scaled

    def after_backward(self) -> WindowResult | None:
        open_ = self._open
        assert open_ is not None, "begin runs before after_backward"
        return None if open_.closing is None else self._end(open_, open_.closing)

    def _end(self, open_: _Open, closing: Closing) -> WindowResult:
        """After the window's last backward: the one host read, which also brings the next window's counts."""
        result = closing.result()
        window, counts = open_.window, open_.counts
        # the next window's counts arrived with this window's record: every problem is raised before this update
        stop = counts.stop + len(open_.next_local)
        self._announced[counts.stop] = self._accept(result.reduced, stop, open_.next_local, window)
        self._open = None
        aux = result.reduced[Slot.AUX_SUM] / counts.real if window.has_aux and counts.real else None
        stats = self._count_skipped(result.stats(counts.global_count, self.name, aux))
        return WindowResult(stats, self._stream_end(window, result.reduced[Slot.MORE]))
