"""The interface of a normalization mode, and what both modes share: the settings, a step's output, the counting.

A mode brings the window's global count N to the gradient. A front end (the Trainer strategies' hooks, or Fabric's
accumulator) drives it, with no other state shared: ``start_epoch`` with the epoch's :class:`~token_mean._reader.
Reader`, then per micro-batch ``begin`` → ``after_forward`` → ``scale`` (the loss to back-propagate) →
``after_backward``, which after the window's last backward returns the window's :class:`WindowResult` or raises the
same :class:`~token_mean.DenominatorError` on every rank. The two modes differ only in when a micro-batch's count is
known (lookahead: read ahead, before the window's first forward; deferred: after each forward) and in how the final
scale reaches the gradient (lookahead: in each loss; deferred: in the gradient reduction).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor

from token_mean._counting import CountFn, device_count, first_labels
from token_mean._problems import Problem
from token_mean._reader import Reader
from token_mean._record import Channel, Kind, Slot, Values, raise_lines
from token_mean._window import Closing, Window, WindowStats

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
    """What one ``training_step`` returned, taken apart."""

    loss: Tensor | None  # the token-mean part (None: missing, a problem)
    aux_loss: Tensor | None
    num_items: Any  # None when not reported
    returned: Any  # what the loop gets back (a stand-in loss where the user's was missing)

    @staticmethod
    def of(output: Any, stand_in: Callable[[], Tensor]) -> StepOutput:
        if isinstance(output, Tensor):
            return StepOutput(output, None, None, output)
        if isinstance(output, Mapping):
            loss = output.get("loss")
            aux = output.get("aux_loss")
            aux = aux if isinstance(aux, Tensor) else None
            if isinstance(loss, Tensor):
                return StepOutput(loss, aux, output.get("num_items"), output)
            # a stand-in keeps this rank in step until the window's collective, where every rank raises
            return StepOutput(None, aux, output.get("num_items"), {**output, "loss": stand_in()})
        return StepOutput(None, None, None, stand_in())


@dataclass(frozen=True)
class WindowResult:
    """What a window that just ended returns to its front end."""

    stats: WindowStats
    epoch_length: int | None  # a stream's agreed end after this window (None: a sized epoch, unchanged)


class WindowMode(ABC):
    """One way of bringing the global count to the gradient (see the module docstring)."""

    name: Mode

    def __init__(self, channel: Channel, settings: Settings, checks: Sequence[WindowCheck] = ()) -> None:
        self.channel = channel
        self.settings = settings
        self._checks = tuple(checks)
        self.skipped_steps = 0
        self._reader: Reader | None = None  # the epoch's batches, from `start_epoch` on
        self._accumulate: int | None = None  # K of the window opened last

    @property
    def world_size(self) -> int:
        return self.channel.world.size

    def start_epoch(self, reader: Reader) -> None:
        """A pass over the loader starts (or resumes); ``reader.start_epoch`` has run.

        A stream costs one blocking collective here, before any batch is fetched: do the ranks have a batch at all?
        Its end is then agreed window by window, in each window's record.
        """
        self._reader = reader
        self._reset()
        if reader.sized:
            return
        has_batch = reader.has_real_from(0, in_flight=False)
        reduced = self.channel.reduce(Kind.BATCHES, Values({Slot.MORE: float(has_batch)}))
        ranks_with_batches = round(reduced[Slot.MORE])
        lines = []
        if 0 < ranks_with_batches < self.world_size:
            missing = self.world_size - ranks_with_batches
            who = f"{missing} rank{'s' if missing > 1 else ''}"
            lines = [f"{who}: {Problem.NO_BATCH.what}. Fix: {Problem.NO_BATCH.fix}"]
        reduced.check("the epoch's first window", "" if has_batch else "its training loader yielded nothing", lines)
        if ranks_with_batches == 0:
            reader.extend_to(0)  # an empty epoch on every rank

    @abstractmethod
    def _reset(self) -> None:
        """Forget the previous epoch's windows."""

    @abstractmethod
    def begin(self, position: int, last: bool, accumulate: int, step: str) -> bool:
        """The micro-batch at ``position`` is about to run its forward; returns whether it is a zero-weight filler.

        ``last``: the loop steps the optimizer after it; ``step`` names the optimizer step in errors
        (``"optimizer step 3 (epoch 0"``).
        """

    @abstractmethod
    def after_forward(self, batch: Any, output: StepOutput) -> None:
        """The micro-batch's forward ran; on the window's last one, the window's exchange starts."""

    @abstractmethod
    def scale(self, loss: Tensor, divisor: float, aux_loss: Tensor | None) -> Tensor:
        """The tensor to back-propagate instead of ``loss`` (which the front end already divided by ``divisor``)."""

    @abstractmethod
    def after_backward(self) -> WindowResult | None:
        """The micro-batch's backward ran; after the window's last, its result (the window's one host read)."""

    def batch_starts_before_exchange(self, position: int, accumulate: int) -> int | None:
        """How many batches after ``position`` the other ranks still start before the exchange of the window that
        holds it (for a rank whose epoch ended at ``position``, untrained); None where their next collective comes
        before the forward of ``position``."""
        return min(self.reader.window_stop(position, accumulate), self.reader.length) - 1 - position

    def leave(self, position: int) -> None:
        """This rank's epoch ended at ``position``, which it did not train: one blocking collective, in step only
        where every rank ended there; otherwise it meets what the others are at, and every rank raises that the
        ranks are out of step."""
        self.channel.reduce(Kind.LEFT).check(f"the end of its epoch at batch {position}")

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps of the mode (identical on every rank)."""
        return {"skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.skipped_steps = int(state.get("skipped_steps", 0))

    # -------------------------------------------------------------------------------------------------------------
    # shared parts
    # -------------------------------------------------------------------------------------------------------------

    @property
    def reader(self) -> Reader:
        assert self._reader is not None, "start_epoch runs before the epoch's first micro-batch"
        return self._reader

    def _window(self, start: int, accumulate: int, step: str, judge_counts: bool = True) -> Window:
        self._opens_with(start, accumulate)
        return Window(self.channel, start, accumulate, step, self.settings.loss_reduction, judge_counts)

    def _opens_with(self, position: int, accumulate: int) -> None:
        """A window opens at ``position`` with K = ``accumulate``: refuse a change of K Lightning zeroes no gradient
        for (the loop zeroes it at batches whose index is a multiple of K)."""
        previous, self._accumulate = self._accumulate, accumulate
        if previous is not None and previous != accumulate and position % accumulate:
            raise ValueError(_k_changed(previous, accumulate, position, (
                f"where a window starts, but {position} is not a multiple of {accumulate}: Lightning zeroes the"
                " gradient only at batches whose index is a multiple of K, so this window's update would apply the"
                " gradient of the window before it a second time")))

    def _changed_inside(self, window: Window, position: int, accumulate: int, stop_kept: bool) -> None:
        """K changed to ``accumulate`` at ``position``, inside ``window``: accept it where Lightning still steps one
        window of the micro-batches the mode counts (``stop_kept``: the mode can follow Lightning's new end)."""
        if accumulate == window.accumulate:
            return
        old = window.accumulate
        if position % accumulate == 0:
            raise ValueError(_k_changed(old, accumulate, position, (
                f"inside {window.where}: {position} is a multiple of {accumulate}, so Lightning zeroes the gradient"
                f" there and drops the window's batches {window.start}..{position - 1} from its update")))
        if not stop_kept:
            raise ValueError(_k_changed(old, accumulate, position, (
                f"inside {window.where}: Lightning now steps after batch"
                f" {self.reader.window_stop(position, accumulate) - 1}, but `mode='lookahead'` normalized the"
                " window's first backward passes by the items of the window as it was planned. Use"
                " `mode='deferred'`, which follows the window Lightning steps")))
        window.accumulate = accumulate
        self._accumulate = accumulate

    def _close(self, window: Window, values: Values) -> Closing:
        """After the window's last forward: run the front end's checks, then start the window's exchange."""
        for check in self._checks:
            for problem, detail in check():
                window.flag(problem, detail)
        reader = self.reader
        if reader.sized and window.start + window.length >= reader.length and reader.yields_past_end():
            window.flag(Problem.LONGER_THAN_LEN, f"its loader yielded a batch past the epoch's {reader.length}")
        return window.close(values)

    def _count_received(self, window: Window, batch: Any, output: StepOutput, use_num_items: bool) -> Tensor:
        """The count of the batch ``training_step`` received, as a float64 device scalar (no host sync).

        With ``use_num_items``, a reported 'num_items' is the count (it takes precedence over the default count);
        whenever both 'num_items' and ``count_fn`` give a count, they are checked to agree.
        """
        device = self.channel.world.device
        reported = None if output.num_items is None else self._checked(window, output.num_items, "'num_items'")
        counted = None
        if self.settings.count_fn_given or output.num_items is None or not use_num_items:
            try:
                counted = self._checked(window, self.settings.count_fn(batch), "`count_fn`")
            except Exception as error:  # every rank must reach the collective to learn of it
                window.flag(Problem.COUNT_FAILED, f"`count_fn` raised {type(error).__name__} on the batch"
                            f" `training_step` received: {error}")
        if reported is not None and counted is not None:
            window.check_equal(self.settings.mismatch, reported, counted, first_labels(batch))
        chosen = reported if reported is not None and use_num_items else counted
        return chosen if chosen is not None else torch.zeros((), dtype=torch.float64, device=device)

    def _checked(self, window: Window, value: Any, source: str) -> Tensor | None:
        count, detail = device_count(value, source, self.channel.world.device)
        if count is None:
            window.flag(Problem.COUNT_FAILED, detail)
        return count

    def _count_skipped(self, stats: WindowStats) -> WindowStats:
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

    def _stream_end(self, window: Window, more: float) -> int | None:
        """A stream goes on by one window when any rank has a real batch after this one (``more``: ranks that do);
        returns its agreed end (None for a sized epoch)."""
        reader = self.reader
        if reader.sized:
            return None
        if not self.settings.pad_uneven_ranks and 0 < more < self.world_size:
            lines = [f"{Problem.UNEVEN.what}: the ranks' streams ended in different windows. Fix: {Problem.UNEVEN.fix}"]
            raise_lines(lines, window.where, "", self.channel.world.rank)
        end = window.start + window.length
        reader.extend_to(end + window.accumulate if more > 0 else end)
        return reader.length


def _k_changed(old: int, new: int, position: int, where: str) -> str:
    return (
        f"token_mean: `trainer.accumulate_grad_batches` changed from {old} to {new} at batch {position}, {where}."
        " Change K where a window starts, at a batch whose index is a multiple of the new K (in"
        " `on_train_batch_start` when `batch_idx % new_k == 0`, or in `on_train_epoch_start`, as"
        " `GradientAccumulationScheduler` does)."
    )


__all__ = ["LossReduction", "Mode", "Settings", "StepOutput", "WindowCheck", "WindowMode", "WindowResult"]
