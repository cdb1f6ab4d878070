"""A normalization mode, its windows and their micro-batches: the objects a front end drives.

A :class:`WindowMode` brings each window's global count N to the gradient. It lives for the fit and keeps only what
spans windows (deferred's provisional denominator, the steps skipped). An :class:`~token_mean._epoch.Epoch` opens a
:class:`Window` through it when a micro-batch finds the last window ended (``mode.open``: K, the step and the stop
fixed there), and the window hands out one :class:`MicroBatch` per position. A front end holds the current
micro-batch and nothing else about the window:

.. code-block:: python

    micro = epoch.micro_batch(position, accumulate, step)    # opens the window at its first position
    output = StepOutput(loss, aux_loss, num_items, loss)     # what the forward on `batch` gave
    micro.loss_to_backprop(output, batch).backward()         # its share of 1/N (the front end's own backward)
    micro.backward_done()
    if micro.last:
        stats = micro.window_result()                        # the window's WindowStats (its one host read)

The window's last micro-batch (:attr:`MicroBatch.last`) is the one source of where the optimizer steps; the filler
mark (:attr:`MicroBatch.is_filler`) lasts from the micro-batch's creation to its backward in every front end. After
the window's last backward its one host read raises the same :class:`~token_mean.DenominatorError` on every rank if
any rank had a problem. The modes differ in when a micro-batch's count is known (lookahead: read ahead, before the
window's first forward; deferred: after each forward) and in how the final scale reaches the gradient (lookahead: in
each loss; deferred: in the gradient reduction).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from torch import Tensor

from token_mean import _filler
from token_mean._counting import CountFn, device_count, first_labels
from token_mean._problems import Problem
from token_mean._record import Channel, Slot
from token_mean._window import Closing, Tally
from token_mean.results import WindowStats

if TYPE_CHECKING:
    from token_mean._epoch import Epoch

LossReduction = Literal["mean", "sum"]
Mode = Literal["lookahead", "deferred"]
WindowCheck = Callable[[], list[tuple[Problem, str]]]
"""A host-side check run as each window closes: the problems it found, each with this rank's detail."""


@dataclass(frozen=True)
class Settings:
    """The user's choices, checked where they are given."""

    count_fn: CountFn
    count_fn_given: bool  # False: the default count, which changes the advice of a `num_items` mismatch
    loss_reduction: LossReduction
    pad_uneven_ranks: bool

    @property
    def mismatch(self) -> Problem:
        """The problem a 'num_items' that disagrees with the count is."""
        return Problem.NUM_ITEMS_MISMATCH_COUNT_FN if self.count_fn_given else Problem.NUM_ITEMS_MISMATCH_DEFAULT


@dataclass(frozen=True)
class StepOutput:
    """What one micro-batch's forward gave, taken apart."""

    loss: Tensor | None  # the token-mean part (None: missing, a problem)
    aux_loss: Tensor | None
    num_items: Any  # None when not reported
    backprop: Tensor  # what its backward runs: the loss, or a stand-in that keeps this rank's collectives in step

    @staticmethod
    def of(output: Any, stand_in: Callable[[], Tensor]) -> tuple[StepOutput, Any]:
        """A ``training_step``'s output taken apart, and what the loop gets back (a stand-in loss where the user's
        was missing: every rank then reaches the window's collective, where all of them raise)."""
        if isinstance(output, Tensor):
            return StepOutput(output, None, None, output), output
        if isinstance(output, Mapping):
            loss, aux = output.get("loss"), output.get("aux_loss")
            aux = aux if isinstance(aux, Tensor) else None
            if isinstance(loss, Tensor):
                return StepOutput(loss, aux, output.get("num_items"), loss), output
            stand = stand_in()
            return StepOutput(None, aux, output.get("num_items"), stand), {**output, "loss": stand}
        stand = stand_in()
        return StepOutput(None, None, None, stand), stand


class MicroBatch:
    """One micro-batch of a window, from just before its forward to the end of its backward."""

    __slots__ = ("__weakref__", "_backward_done", "_stats", "backprop", "count", "filler", "last", "position", "window")

    def __init__(self, window: Window, position: int, last: bool, filler: bool, count: float = 0.0) -> None:
        self.window = window
        self.position = position
        self.last = last  # the window's last: the optimizer steps after its backward
        self.filler = filler  # a zero-weight repeat of an exhausted rank's batch
        self.count = count  # lookahead: its count, read ahead
        self._backward_done = False
        self._stats: WindowStats | None = None
        self.backprop: Tensor | None = None  # what its backward runs, from its forward to its backward
        _filler.track(self)

    @property
    def backward_ran(self) -> bool:
        return self._backward_done

    @property
    def is_filler(self) -> bool:
        """A zero-weight filler whose backward has not run yet: the mark covers its forward and backward and
        nothing else (what the loop runs after, a validation loop, is no filler's)."""
        return self.filler and not self._backward_done

    def loss_to_backprop(self, output: StepOutput, batch: Any) -> Tensor:
        """The forward on ``batch`` gave ``output``: what its backward must run instead of ``output.backprop`` (on the
        window's last micro-batch, the window's exchange starts here)."""
        self.backprop = self.window.forward_done(self, output, batch)
        return self.backprop

    def backward_done(self) -> None:
        """Its backward ran."""
        self._backward_done = True
        self.backprop = None

    def window_result(self) -> WindowStats:
        """The window's last micro-batch, after its backward: the window's stats (its one host read; every rank's
        problems raised here). Asked again, the same stats."""
        if not (self.last and self._backward_done):
            raise RuntimeError(
                f"token_mean: internal error: the result of the window was asked at batch {self.position}, before the"
                " backward of its last micro-batch."
            )
        if self._stats is None:
            self._stats = self.window.end(self)
        return self._stats


class Window(ABC):
    """The accumulation window being trained on this rank: created when it opens, ended by its last backward.

    Subclasses say how a micro-batch's count is known and how the scale reaches the gradient.
    """

    def __init__(self, mode: WindowMode, epoch: Epoch, tally: Tally, stop: int) -> None:
        self.mode = mode
        self.epoch = epoch
        self.tally = tally
        self.start = tally.start
        self.stop = stop
        self.ended = False
        self._next = self.start  # the position of the next micro-batch

    @property
    def accumulate(self) -> int:
        return self.tally.accumulate

    @property
    def where(self) -> str:
        """The window as messages name it."""
        return self.tally.where_until(self.stop)

    def micro_batch(self, position: int, accumulate: int) -> MicroBatch:
        if accumulate != self.accumulate:  # a callback changed K inside the window
            self._changed_inside(position, accumulate)
        if position != self._next:
            raise RuntimeError(
                f"token_mean: the loop trains batch {position} where {self.where} expects batch {self._next}: a batch"
                " was trained twice or skipped (an `optimizer_step` override that calls the closure twice, or an"
                " `on_train_batch_start` that returns -1 in the middle of a window, does this). Call the closure once"
                " per batch; if this is not such a case, please report it with your settings."
            )
        self._next = position + 1
        return self._micro_batch(position, position == self.stop - 1)

    @abstractmethod
    def _micro_batch(self, position: int, last: bool) -> MicroBatch:
        """The micro-batch at ``position`` (checked to be the next)."""

    @abstractmethod
    def forward_done(self, micro: MicroBatch, output: StepOutput, batch: Any) -> Tensor:
        """The micro-batch's forward on ``batch`` ran: the tensor to back-propagate for it; on the window's last
        one, the window's exchange starts."""

    @abstractmethod
    def end(self, micro: MicroBatch) -> WindowStats:
        """After the window's last backward: its stats (the window's one host read)."""

    def _changed_inside(self, position: int, accumulate: int) -> None:
        """K changed to ``accumulate`` at ``position``, inside the window: accept it where Lightning still steps one
        window of the micro-batches the mode counts (:meth:`_replan`)."""
        old = self.accumulate
        if position % accumulate == 0:
            raise ValueError(k_changed(old, accumulate, position, (
                f"inside {self.where}: {position} is a multiple of {accumulate}, so Lightning zeroes the gradient"
                f" there and drops the window's batches {self.start}..{position - 1} from its update")))
        self._replan(position, accumulate)
        self.tally.accumulate = accumulate

    @abstractmethod
    def _replan(self, position: int, accumulate: int) -> None:
        """Follow Lightning's new end of the window, K now ``accumulate`` from ``position`` on, or refuse it."""

    def _close(self, host: Mapping[Slot, float], peek: bool) -> Closing:
        """After the window's last forward: the front end's checks and the pass's end into the record, then the
        window's exchange starts (``peek``: a stream's next batch is looked at here)."""
        tally = self.tally
        for check in self.mode.checks:
            for problem, detail in check():
                tally.flag(problem, detail)
        end, problems = self.epoch.at_close(self.stop, peek)
        for problem, detail in problems:
            tally.flag(problem, detail)
        return tally.close({**host, **end})

    def _finished(self, stats: WindowStats, more: float, unsure: bool) -> WindowStats:
        """The window's record was read: the pass follows (a stream goes on or ends), the window is over."""
        self.ended = True
        self.epoch.ended(self, more, unsure)
        return self.mode.count_skipped(stats)

    # ---- counting ----

    def _count_received(self, batch: Any, output: StepOutput, use_num_items: bool) -> Tensor:
        """The count of the batch the forward received, as a float64 device scalar (no host sync).

        With ``use_num_items``, a reported 'num_items' is the count (it takes precedence over the default count);
        whenever both 'num_items' and ``count_fn`` give a count, they are checked to agree.
        """
        settings, tally = self.mode.settings, self.tally
        reported = None if output.num_items is None else self._checked(output.num_items, "'num_items'")
        counted = None
        if settings.count_fn_given or output.num_items is None or not use_num_items:
            try:
                counted = self._checked(settings.count_fn(batch), "`count_fn`")
            except Exception as error:  # every rank must reach the collective to learn of it
                tally.flag(Problem.COUNT_FAILED, f"`count_fn` raised {type(error).__name__} on the batch"
                           f" `training_step` received: {error}")
        if reported is not None and counted is not None:
            tally.check_equal(settings.mismatch, reported, counted, first_labels(batch))
        chosen = reported if reported is not None and use_num_items else counted
        return chosen if chosen is not None else tally.zero()

    def _checked(self, value: Any, source: str) -> Tensor | None:
        count, detail = device_count(value, source, self.mode.channel.world.device)
        if count is None:
            self.tally.flag(Problem.COUNT_FAILED, detail)
        return count


class WindowMode(ABC):
    """One way of bringing the global count to the gradient (see the module docstring)."""

    name: Mode
    judges_counts = True  # flag negative and non-finite counts in the record (False: judged where they were read)

    def __init__(self, channel: Channel, settings: Settings, checks: Sequence[WindowCheck] = ()) -> None:
        self.channel = channel
        self.settings = settings
        self.checks = tuple(checks)
        self.skipped_steps = 0
        self._saved_accumulate: int | None = None  # K in a checkpoint being resumed, until the first window opens

    @property
    def world_size(self) -> int:
        return self.channel.world.size

    def open(self, epoch: Epoch, start: int, accumulate: int, step: int, previous: Window | None) -> Window:
        """The window of optimizer step ``step`` opens at ``start`` with K = ``accumulate`` (``previous``: the
        pass's last window)."""
        expected = epoch.reader.start if previous is None else previous.stop
        if start != expected:
            raise RuntimeError(
                f"token_mean: the loop trains batch {start} where the next window opens at batch {expected}: a batch"
                " was trained twice or skipped (an `optimizer_step` override that calls the closure twice does this)."
                " Call the closure once per batch."
            )
        if previous is not None and previous.accumulate != accumulate and start % accumulate:
            raise ValueError(k_changed(previous.accumulate, accumulate, start, (
                f"where a window starts, but {start} is not a multiple of {accumulate}: Lightning zeroes the"
                " gradient only at batches whose index is a multiple of K, so this window's update would apply the"
                " gradient of the window before it a second time")))
        self._check_resumed_accumulate(start, accumulate)
        tally = Tally(self.channel, start, accumulate, f"optimizer step {step} ({epoch.label}",
                      self.settings.loss_reduction, judge_counts=self.judges_counts)
        return self._open(epoch, tally, previous)

    @abstractmethod
    def _open(self, epoch: Epoch, tally: Tally, previous: Window | None) -> Window:
        """The mode's window over ``tally`` (its start and K set)."""

    def starts_before_exchange(self, epoch: Epoch, position: int, accumulate: int,
                               previous: Window | None) -> int | None:
        """How many batches after ``position`` (the first of a window not opened yet, with K = ``accumulate``) the
        other ranks start before that window's exchange; None where their next collective comes before its first
        forward."""
        return min(epoch.window_stop(position, accumulate), epoch.length) - 1 - position

    def count_skipped(self, stats: WindowStats) -> WindowStats:
        if stats.skipped:
            self.skipped_steps += 1
            if self.skipped_steps == 1:
                from lightning.fabric.utilities import rank_zero_warn

                rank_zero_warn(
                    "token_mean: an accumulation window had no valid items on any rank (N = 0); its update was"
                    " skipped, leaving parameters and optimizer state unchanged (under the Trainer, `global_step` and"
                    " step-wise LR schedulers still advance). `skipped_steps` counts such windows."
                )
        return stats

    def _check_resumed_accumulate(self, start: int, accumulate: int) -> None:
        """The first window after a resume: a mid-epoch one whose K differs from the checkpoint's warns."""
        saved, self._saved_accumulate = self._saved_accumulate, None
        if saved is not None and start > 0 and saved != accumulate:
            from lightning.fabric.utilities import rank_zero_warn

            rank_zero_warn(
                f"token_mean: this run resumed in the middle of an epoch (at batch {start}) with"
                f" `accumulate_grad_batches` = {accumulate}, but the checkpoint was written with {saved}. Lightning"
                " skips `on_train_epoch_start` on a mid-epoch restart, so a `GradientAccumulationScheduler` (or a"
                " callback that sets K there) has not set this epoch's K: the rest of the epoch trains windows of"
                f" {accumulate} micro-batches (plain Lightning does the same), exact for those windows but not the"
                " uninterrupted run. Resume from a checkpoint written at the end of an epoch to keep the schedule."
            )

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps of the mode (identical on every rank)."""
        return {"skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.skipped_steps = int(state.get("skipped_steps", 0))
        saved = state.get("accumulate")
        self._saved_accumulate = None if saved is None else int(saved)


def k_changed(old: int, new: int, position: int, where: str) -> str:
    return (
        f"token_mean: `trainer.accumulate_grad_batches` changed from {old} to {new} at batch {position}, {where}."
        " Change K where a window starts, at a batch whose index is a multiple of the new K (in"
        " `on_train_batch_start` when `batch_idx % new_k == 0`, or in `on_train_epoch_start`, as"
        " `GradientAccumulationScheduler` does)."
    )


__all__ = [
    "LossReduction",
    "MicroBatch",
    "Mode",
    "Settings",
    "StepOutput",
    "Window",
    "WindowCheck",
    "WindowMode",
    "k_changed",
]
