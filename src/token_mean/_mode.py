"""The interface of a normalization mode, and what both modes share: the ranks, the settings, a step's output.

A mode owns the window being trained and its one exchange. The strategy's hooks call it in this order:
``start_epoch`` (the fit loop's ``iter``), then per micro-batch ``begin`` → ``after_forward`` → ``scale`` (in
``backward``), and after the window's last backward ``finish``, which returns the window's :class:`WindowStats` or
raises the same :class:`DenominatorError` on every rank.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import Tensor

from token_mean._counting import CountFn
from token_mean._problems import PROBLEMS, Problem
from token_mean._reader import Reader
from token_mean._window import (
    COUNT,
    LENGTH,
    LENGTH_SQUARED,
    MORE,
    RECORD_SIZE,
    Exchange,
    Reduced,
    WindowStats,
    make_record,
    raise_problems,
)

LossReduction = Literal["mean", "sum"]


@dataclass(frozen=True)
class World:
    """The ranks that share one denominator, and where their collective tensors live.

    ``size`` and ``rank`` count the ranks that hold different batches (the data-parallel ones); ``group`` reduces the
    window's record over them. ``replica_group`` is set where other ranks train on this rank's very batches (the
    tensor-parallel group of a device mesh): they must count exactly the same items.
    """

    size: int
    rank: int
    device: torch.device
    group: Any | None  # None: the default process group
    distributed: bool
    replica_group: Any | None = None  # None: no other rank holds this rank's batches
    # True where the ranks' gradients are averaged with no hook of the mode in the reduction (FSDP2's
    # reduce-scatter): a scale that differs between ranks cannot be undone afterwards, so any provisional scale must
    # be the same on every rank, and the final one comes from `WindowMode.gradient_correction`.
    gradients_averaged: bool = False


@dataclass(frozen=True)
class Settings:
    """The user's choices, checked in the strategy's ``__init__``."""

    count_fn: CountFn
    count_fn_given: bool  # False: the default count, which changes the advice of a `num_items` mismatch
    loss_reduction: LossReduction
    pad_uneven_ranks: bool


@dataclass(frozen=True)
class StepOutput:
    """What one ``training_step`` returned, taken apart."""

    loss: Tensor | None  # the token-mean part (None: missing, a problem)
    aux_loss: Tensor | None
    num_items: Any  # None when not reported
    returned: Any  # what Lightning gets back (a stand-in loss where the user's was missing)

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


@dataclass
class Window:
    """The accumulation window being trained on this rank."""

    start: int  # position in the epoch of its first micro-batch
    stop: int  # one past its last (lookahead: known ahead; deferred: known when Lightning steps)
    accumulate: int  # K in force for the window
    trained: int = 0


class WindowMode(ABC):
    """One way of bringing the global count to the gradient. Holds the open window and its exchange."""

    name: str

    def __init__(self, world: World, settings: Settings) -> None:
        self.world = world
        self.settings = settings
        self.track_rank_counts = False
        self.reader: Reader | None = None
        self.window: Window | None = None
        self._flags = [0.0] * len(PROBLEMS)  # host-side problems of the open window
        self._detail = ""
        self._exchange: Exchange | None = None
        self.last_stats: WindowStats | None = None
        self.skipped_steps = 0

    # -------------------------------------------------------------------------------------------------------
    # the interface
    # -------------------------------------------------------------------------------------------------------

    def start_epoch(self, reader: Reader, length: int | None, resumed_exhausted: bool) -> None:
        """The fit loop starts (or resumes) a pass over the loader; ``length`` None for an unsized loader.

        An unsized epoch costs one blocking collective here, before any batch is fetched: do the ranks have a batch
        at all? The epoch's end is then agreed window by window, in each window's record.
        """
        self.reader = reader
        self.window = None
        self._exchange = None
        reader.counter = self._counter()
        reader.start_epoch(length, resumed_exhausted)
        if length is None:
            has_batch = reader.has_real_from(0)
            record = self._record_tensor([(MORE, float(has_batch))], problems=[])
            ranks_with_batches = round(self._reduce(record)[MORE])
            if 0 < ranks_with_batches < self.world.size:
                self._flag(Problem.NO_BATCH, "" if has_batch else "its training loader yielded nothing")
                missing = self.world.size - ranks_with_batches
                who = f"{missing} rank{'s' if missing > 1 else ''}"
                lines = [f"{who}: {Problem.NO_BATCH.what}. Fix: {Problem.NO_BATCH.fix}"]
                raise_problems(lines, "the epoch's first window", self._detail, self.world.rank)
            if ranks_with_batches == 0:
                reader.length = 0  # an empty epoch on every rank
            # otherwise the end stays unknown until the first window's length is (K may change per epoch)

    def attach(self, model: torch.nn.parallel.DistributedDataParallel) -> None:  # noqa: B027 (a no-op by default)
        """The DDP-wrapped model is built: install what the mode needs on it (nothing by default)."""

    @abstractmethod
    def begin(self, position: int, steps_now: bool, accumulate: int, step: str) -> bool:
        """A micro-batch at ``position`` is about to run its forward; returns whether it is a zero-weight filler.

        ``step`` names the optimizer step in errors ("optimizer step 3 (epoch 0").
        """

    @abstractmethod
    def after_forward(self, batch: Any, output: StepOutput, steps_now: bool) -> None:
        """Book-keeping after the forward; on the window's last micro-batch, start the window's exchange."""

    @abstractmethod
    def scale(self, closure_loss: Tensor, aux_loss: Tensor | None) -> Tensor:
        """The tensor to back-propagate instead of Lightning's ``loss / K``."""

    @abstractmethod
    def finish(self, step: str) -> tuple[WindowStats, int | None]:
        """After the window's last backward: its stats (or the same error on every rank), and the epoch's new end
        for an unsized loader (None: unchanged)."""

    def gradient_correction(self) -> Tensor | None:
        """After the window's last backward, before ``finish``: the factor by which gradients that were *averaged*
        over the world's ranks, with no hook of this mode in their reduction, still differ from the window's exact
        gradient (None: they are exact already). Called by strategies whose reduction the mode cannot hook (FSDP2).
        """
        return None

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps of the mode (identical on every rank)."""
        return {"skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.skipped_steps = int(state.get("skipped_steps", 0))

    def _counter(self) -> Callable[[Any], tuple[float, Problem | None, str]] | None:
        return None  # deferred counts after forward; lookahead overrides

    # -------------------------------------------------------------------------------------------------------
    # shared parts
    # -------------------------------------------------------------------------------------------------------

    def _flag(self, problem: Problem, detail: str = "") -> None:
        self._flags[PROBLEMS.index(problem)] = 1.0
        self._detail = self._detail or detail

    def _reset_flags(self) -> None:
        self._flags = [0.0] * len(PROBLEMS)
        self._detail = ""

    def _record_tensor(
        self,
        slots: list[tuple[int, float]],
        problems: list[Problem],
        device_scalars: Sequence[tuple[int, Tensor]] = (),
        device_flags: Sequence[tuple[Problem, Tensor]] = (),
    ) -> Tensor:
        flags = list(self._flags)
        for problem in problems:
            flags[PROBLEMS.index(problem)] = 1.0
        return make_record(
            slots, flags, device_scalars, device_flags, self.world.device, self.world.rank, self.world.size,
            self.track_rank_counts,
        )

    def _replica_flags(self, counts: Tensor) -> list[tuple[Problem, Tensor]]:
        """A device flag: do the ranks holding this rank's batches count each micro-batch of ``counts`` alike?

        Costs one MAX all-reduce of 2 × (micro-batches) float64 over the replica group, only where there is one.
        Exact for any float count: the group agrees exactly when max(n) = -max(-n) for every micro-batch. The flag is
        computed alike on every replica and travels in the window's record, so every rank raises.
        """
        group = self.world.replica_group
        if group is None:
            return []
        both = torch.cat([counts, -counts]).to(device=self.world.device, dtype=torch.float64)
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
        size = counts.numel()
        return [(Problem.REPLICA_COUNTS_DIFFER, (both[:size] != -both[size:]).any())]

    def _start_exchange(self, record: Tensor) -> Exchange:
        return Exchange(record, self.world.group, self.world.distributed)

    def _reduce(self, record: Tensor) -> Reduced:
        """A blocking exchange: only where no forward of a window has run yet."""
        return Reduced(self._start_exchange(record).read())

    def _problems(self, reduced: Reduced, check_lengths: bool) -> list[str]:
        lines = reduced.problems()
        if check_lengths and not reduced.lengths_agree(self.world.size):
            lines.append(f"{Problem.UNEVEN.what} (total {reduced[LENGTH]:g} micro-batches over {self.world.size}"
                         f" ranks). Fix: {Problem.UNEVEN.fix}")
        return lines

    def _skip(self, stats: WindowStats) -> WindowStats:
        if stats.skipped:
            self.skipped_steps += 1
            if self.skipped_steps == 1:
                from lightning.pytorch.utilities import rank_zero_warn

                rank_zero_warn(
                    "token_mean: an accumulation window had no valid items on any rank (N = 0); its optimizer step"
                    " was skipped, leaving parameters and optimizer state unchanged (Lightning's `global_step` and"
                    " step-wise LR schedulers still advance). `strategy.skipped_steps` counts them."
                )
        self.last_stats = stats
        return stats

    @staticmethod
    def _where(step: str, window: Window) -> str:
        return f"the accumulation window of {step}, batches {window.start}..{window.stop - 1})"

    @staticmethod
    def _length_slots(length: int) -> list[tuple[int, float]]:
        return [(LENGTH, float(length)), (LENGTH_SQUARED, float(length * length))]


__all__ = ["COUNT", "RECORD_SIZE", "LossReduction", "Settings", "StepOutput", "Window", "WindowMode", "World"]
