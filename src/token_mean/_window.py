"""One accumulation window's tally on one rank: what its micro-batches contributed, its one exchange, and what the
step used.

A :class:`Tally` is created when a window opens and dropped when it ends. The window feeds it one micro-batch at a time
(:meth:`Tally.add`, with problems as they find them); after the window's last forward :meth:`Tally.close` builds
the window's record and starts its one collective, and after its last backward :meth:`Closing.result` reads it on the
host (the window's one host read) and raises the same :class:`~token_mean.DenominatorError` on every rank if any
rank raised a problem. Everything per micro-batch stays on the device, detached, and is summed once per window.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

from token_mean import _torch
from token_mean._problems import Problem
from token_mean._record import Channel, Exchange, Kind, Reduced, Slot, Slots, Values, raise_lines
from token_mean.results import WindowStats

# the slots that explain a failed check: the two sides, summed over the micro-batches where they differ
_NOTHING: Mapping[Slot, float] = MappingProxyType({})

_CHECK_SLOTS = {
    Problem.NUM_ITEMS_MISMATCH_COUNT_FN: (Slot.REPORTED, Slot.COUNTED),
    Problem.NUM_ITEMS_MISMATCH_DEFAULT: (Slot.REPORTED, Slot.COUNTED),
    Problem.COUNT_CHANGED: (Slot.READ, Slot.RECEIVED),
}


Check = tuple[Tensor | float, Tensor | float, Tensor | None]
"""Two sides that must agree, and the FIRST hint of a 'num_items' mismatch."""


class _Values:
    """What a window's micro-batches contributed on this rank, as they came: counts on the device (a tensor) or the
    host (a float), losses detached, 'aux_loss' terms, and pairs that must agree."""

    def __init__(self, channel: Channel, mean: bool) -> None:
        self.device = channel.world.device
        self.zero = channel.zero  # a float64 zero on the device, one per fit
        self.mean = mean  # each loss is a mean over its micro-batch's count (else a sum)
        self.counts: list[Tensor | float] = []
        self.on_host = True  # every count so far a host float (lookahead: counted on the host as read)
        self.losses: list[Tensor | None] = []
        self.aux: list[Tensor] = []
        self.checks: dict[Problem, list[Check]] = {}

    def counts_stacked(self) -> Tensor:
        return self.stack(self.counts)

    def losses_stacked(self) -> Tensor:
        return torch.stack([self.zero() if loss is None else loss for loss in self.losses]).to(torch.float64)

    def stack(self, values: list[Tensor | float]) -> Tensor:
        """float64 on the device: host floats in one copy, device values stacked. A host float among device values
        is filled in on the device (a kernel argument): a copy from pageable host memory, what ``torch.tensor(v)
        .to(device)`` makes, would wait for the device's queue inside the window on CUDA."""
        if all(type(value) is float for value in values):
            return _torch.to_device(values, torch.float64, self.device)  # type: ignore[arg-type]
        stacked = torch.stack([value.to(self.device) if isinstance(value, Tensor)
                               else torch.full((), value, dtype=torch.float64, device=self.device) for value in values])
        return stacked if stacked.dtype == torch.float64 else stacked.to(torch.float64)

    def sides(self, checks: list[Check]) -> tuple[Tensor, Tensor]:
        return self.stack([value for value, _, _ in checks]), self.stack([value for _, value, _ in checks])


class Tally:
    """What the accumulation window being trained on this rank contributed (see the module docstring).

    Args:
        channel: where the window's record is exchanged.
        start: the position of its first micro-batch in the epoch.
        accumulate: K, the micro-batches per window in force.
        step: what messages call the optimizer step, e.g. ``"optimizer step 3 (epoch 0"``.
        loss_reduction: ``"mean"`` (each loss is a mean over its micro-batch's count) or ``"sum"``.
        judge_counts: flag negative and non-finite counts (False where they were judged where they were taken).
        judge_losses: flag non-finite losses of micro-batches with items (False where the window only measures).
    """

    def __init__(
        self,
        channel: Channel,
        start: int,
        accumulate: int,
        step: str,
        loss_reduction: str,
        judge_counts: bool = True,
        judge_losses: bool = True,
    ) -> None:
        self.channel = channel
        self._judge_counts = judge_counts
        self._judge_losses = judge_losses
        self.start = start
        self.accumulate = accumulate
        self.step = step
        self._values = _Values(channel, loss_reduction == "mean")
        self._added: list[tuple[Slot, Tensor]] = []
        self._flags: set[Problem] = set()
        self._detail = ""
        self.length = 0
        self.real = 0

    @property
    def where(self) -> str:
        """The window as messages name it."""
        return self.where_until(self.start + self.length)

    def where_until(self, stop: int) -> str:
        """The window as messages name it, for the micro-batches up to ``stop`` (its planned end before any)."""
        return f"the accumulation window of {self.step}, batches {self.start}..{stop - 1})"

    def where_next(self, stop: int) -> str:
        """The window after this one, up to ``stop``, as messages name it (lookahead counts it during this one)."""
        return f"the accumulation window after that of {self.step}, batches {self.start + self.length}..{stop - 1})"

    @property
    def flags(self) -> set[Problem]:
        """The problems found on the host so far."""
        return set(self._flags)

    @property
    def has_aux(self) -> bool:
        """Whether a micro-batch returned an 'aux_loss'."""
        return bool(self._values.aux)

    @property
    def detail(self) -> str:
        """What this rank saw of its first host-side problem (a note of the error)."""
        return self._detail

    def zero(self) -> Tensor:
        """A float64 zero on the device (one per fit: never written to)."""
        return self.channel.zero()

    # ---- feeding ----

    def add(self, count: Tensor | float, loss: Tensor | None, filler: bool, aux: Tensor | None = None) -> None:
        """One micro-batch: its count (a 0-dim tensor on the device, or a host float judged where it was read), its
        loss as its forward returned it."""
        values = self._values
        self.length += 1
        self.real += not filler
        values.counts.append(count)
        values.on_host = values.on_host and type(count) is float
        values.losses.append(None if loss is None else loss.detach() if loss.requires_grad else loss)
        if aux is not None:
            values.aux.append(aux.detach())

    def flag(self, problem: Problem, detail: str = "") -> None:
        """A problem found on the host; ``detail`` says what this rank saw (a note of its error)."""
        self._flags.add(problem)
        self._detail = self._detail or detail

    def check_equal(self, problem: Problem, left: Tensor | float, right: Tensor | float,
                    hint: Tensor | None = None) -> None:
        """``problem`` unless ``left == right`` (decided on the device, at close); ``hint``: the FIRST slot."""
        self._values.checks.setdefault(problem, []).append((left, right, hint))

    def add_to(self, slot: Slot, value: Tensor) -> None:
        """Add a device value to ``slot`` of the record (``NAIVE``)."""
        self._added.append((slot, value))

    # ---- ending ----

    def close(self, host: Mapping[Slot, float] = _NOTHING) -> Closing:
        """After the window's last forward: start its exchange (``host``: what else the record carries, host values
        the mode and the epoch add).

        The record carries the window's sums and what tells a problem from them (a non-finite sum, a bad count, a
        check that differs): a handful of kernels. Which rank had which problem is only worked out when some sum
        says there is one (:meth:`Closing.result`); under tensor parallelism, where the replicas must share their
        problems before the record, it is worked out at once.
        """
        values = self._values
        length = float(self.length)
        sums = {**host, Slot.LENGTH: length, Slot.LENGTH_SQUARED: length * length, Slot.REAL: float(self.real)}
        device: list[tuple[Slot | Slots, Tensor]] = list(self._added)
        flags: set[Problem] = self._flags
        device_flags: list[tuple[Problem, Tensor]] = []
        if values.on_host:
            local: Tensor | float = self._host_sums(sums, device)
        else:
            local = self._device_sums(device)
        if values.aux:
            device.append((Slot.AUX_SUM, torch.stack(values.aux).to(torch.float64).sum()))
        for checks in values.checks.values():  # how many pairs differ (the diagnosis says by how much)
            left, right = values.sides(checks)
            device.append((Slot.DIFFERENT, (left != right).sum(dtype=torch.float64)))
        if self.channel.world.replica_group is not None:
            diagnosis = self.diagnosis()
            device_flags, flags = diagnosis.shared_with_replicas(self.channel, flags, diagnosis.flags()), set()
        return Closing(self, self.channel.start(Kind.WINDOW, Values(sums, device, frozenset(flags), device_flags)),
                       local)

    def _host_sums(self, host: dict[Slot, float], device: list[tuple[Slot | Slots, Tensor]]) -> float:
        """Counts known on the host (finite, non-negative): N's share is a host float, and the loss sum takes one
        multiplication of the losses that have items."""
        values = self._values
        counts = [float(count) for count in values.counts]
        local = math.fsum(counts)
        host[Slot.COUNT] = local
        kept = [(loss, count if values.mean else 1.0) for loss, count in zip(values.losses, counts, strict=True)
                if count > 0 and loss is not None]
        if len(kept) == 1:
            loss, weight = kept[0]
            device.append((Slot.LOSS_SUM, loss.to(torch.float64) * weight))
        elif kept:
            losses = torch.stack([loss for loss, _ in kept]).to(torch.float64)
            weights = _torch.to_device([weight for _, weight in kept], torch.float64, values.device)
            device.append((Slot.LOSS_SUM, losses @ weights))
        return local

    def _device_sums(self, device: list[tuple[Slot | Slots, Tensor]]) -> Tensor:
        """Counts on the device: a bad count (negative, NaN, infinite) counts nothing but shows in BAD_COUNTS; an
        empty micro-batch's mean loss (0/0 = NaN) adds nothing to the loss sum. The counts and losses go in one
        stack, the sums come out of one reduction, and go into the record as one vector."""
        values = self._values
        length = len(values.counts)
        both = values.stack([*values.counts, *(values.zero() if loss is None else loss for loss in values.losses)])
        counts, losses = torch.split(both, length)  # one view op (slicing twice takes two)
        valid = _valid(counts)
        has_items = valid > 0
        terms = torch.where(has_items, losses, values.zero()) * (valid if values.mean else has_items)
        if not self._judge_losses:  # an observer: a non-finite loss is the strategy's to judge, and adds nothing
            terms = torch.nan_to_num(terms, nan=0.0, posinf=0.0, neginf=0.0)
        count_slots = self.channel.count_slots
        rows, slots = [valid] * len(count_slots) + [terms], (*count_slots, Slot.LOSS_SUM)
        if self._judge_counts:  # NaN != NaN
            rows, slots = [*rows, valid != counts], (*slots, Slot.BAD_COUNTS)
        sums = torch.stack(rows).sum(dim=1)
        device.append((slots, sums))
        return sums  # this rank's count first

    def healthy(self, reduced: Reduced) -> bool:
        """Whether the summed record shows no problem of the device values (a non-finite sum, a bad count, a check
        that differs): then no rank had one."""
        values = reduced.values
        counted = math.isfinite(values[Slot.COUNT]) and values[Slot.BAD_COUNTS] == 0
        losses = not self._judge_losses or math.isfinite(values[Slot.LOSS_SUM])
        return counted and losses and math.isfinite(values[Slot.AUX_SUM]) and values[Slot.DIFFERENT] == 0

    def diagnosis(self) -> Diagnosis:
        """Which device problems this rank had (what a diagnosis, or the replicas of a tensor-parallel group,
        exchange)."""
        return Diagnosis(self._values, self._judge_counts, self._judge_losses)


class Diagnosis:
    """Which problems of its device values one rank's window had, worked out on the device (the record only carried
    their sums), and the numbers that explain a failed check."""

    def __init__(self, values: _Values, judge_counts: bool, judge_losses: bool) -> None:
        self._values = values
        self._judge_counts = judge_counts
        self._judge_losses = judge_losses

    def flags(self) -> list[tuple[Problem, Tensor]]:
        values = self._values
        flags: list[tuple[Problem, Tensor]] = []
        counts = values.counts_stacked()
        valid = _valid(counts)
        if self._judge_counts:
            flags += [(Problem.COUNT_NEGATIVE, (counts < 0).any()), (Problem.COUNT_NONFINITE, _nonfinite(counts).any())]
        if self._judge_losses:
            losses = values.losses_stacked()
            weighted = losses * (valid if values.mean else (valid > 0).to(torch.float64))
            bad_values = _nonfinite(weighted) & (valid > 0)
            bad_loss = _nonfinite(losses)
            # a finite loss times a huge count: the count's fault, not the model's
            flags += [(Problem.BAD_LOSS, (bad_values & bad_loss).any()),
                      (Problem.COUNT_RANGE, (bad_values & ~bad_loss).any())]
        if values.aux:
            flags.append((Problem.BAD_AUX_LOSS, _nonfinite(torch.stack(values.aux).to(torch.float64)).any()))
        for problem, checks in values.checks.items():
            left, right = values.sides(checks)
            flags.append((problem, (left != right).any()))
        return flags

    def check_slots(self) -> list[tuple[Slot, Tensor]]:
        """The two sides of each failed check, summed over the micro-batches where they differ (and the first labels
        there, a hint for 'num_items')."""
        values = self._values
        slots = []
        for problem, checks in values.checks.items():
            left, right = values.sides(checks)
            differ = left != right
            slots += [(slot, (side * differ).sum()) for slot, side in zip(_CHECK_SLOTS[problem], (left, right),
                                                                           strict=True)]
            hints = [hint for _, _, hint in checks]
            if any(hint is not None for hint in hints):
                first = torch.stack([values.zero() if h is None else h.to(values.device, torch.float64) for h in hints])
                slots.append((Slot.FIRST, (first * differ).sum()))
        return slots

    def shared_with_replicas(self, channel: Channel, flags: set[Problem],
                             device_flags: list[tuple[Problem, Tensor]]) -> list[tuple[Problem, Tensor]]:
        """The ranks holding this rank's batches (a tensor-parallel group) count alike, and share their problems.

        One MAX all-reduce of 2 × (micro-batches) + (problems) float64 over the replica group. Exact for any float
        count: the group agrees exactly when max(n) = -max(-n) for every micro-batch. A problem of any rank of the
        group becomes a problem of each (the window's record only sums over the data-parallel ranks), so every rank
        of the mesh raises, and none is left in a collective with a peer that raised.
        """
        device = self._values.device
        counts = _valid(self._values.counts_stacked())
        problems = list(Problem)
        index = {problem: position for position, problem in enumerate(problems)}
        raised = _torch.to_device([float(problem in flags) for problem in problems], torch.float64, device)
        if device_flags:
            where = _torch.to_device([index[problem] for problem, _ in device_flags], torch.int64, device)
            found = torch.stack([condition.to(torch.float64) for _, condition in device_flags])
            raised = raised.index_add(0, where, found)
        both = torch.cat([counts, -counts, raised])
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=channel.world.replica_group)
        size = counts.numel()
        shared = both[2 * size :].clamp(max=1.0)
        differ = (both[:size] != -both[size : 2 * size]).any()
        return [*((problem, shared[index[problem]]) for problem in problems), (Problem.REPLICA_COUNTS_DIFFER, differ)]


_COUNT = int(Slot.COUNT)  # a plain int indexes a tensor faster than the enum member


def _valid(counts: Tensor) -> Tensor:
    """A bad count (negative, NaN, infinite) counts nothing."""
    return torch.nan_to_num(counts.clamp(min=0.0), nan=0.0, posinf=0.0)


def _nonfinite(values: Tensor) -> Tensor:
    """NaN or ±inf, elementwise, in two kernels (``~isfinite`` takes five on the CPU): x - x is 0 exactly for every
    finite x, and NaN for NaN and ±inf."""
    return (values - values).ne(0)


class Closing:
    """A window after its last forward: its exchange is in flight; :meth:`result` reads it after the last backward."""

    def __init__(self, window: Tally, exchange: Exchange, local_count: Tensor | float) -> None:
        self.window = window
        self._exchange = exchange
        self._local_count = local_count

    def global_count(self) -> Tensor:
        """N on the device, waiting for the exchange on the device only (no host read)."""
        return self._exchange.wait()[_COUNT]

    def result(self) -> Result:
        """The reduced record and this rank's count (the window's one host read); raises every rank's problems.

        Where a sum shows a problem of the device values, every rank (each read the same sum) works out its own and
        exchanges them in one more collective, and all raise the same error naming the ranks.
        """
        window, local = self.window, self._local_count
        if isinstance(local, Tensor):
            reduced = self._exchange.read(extra=local)
            local = reduced.local[0]
        else:
            reduced = self._exchange.read()
        healthy = window.healthy(reduced)
        if not (healthy and reduced.clean()):  # the common case, told from a few slots
            if not healthy and reduced.in_step():
                diagnosis, length = window.diagnosis(), float(window.length)
                values = Values({Slot.LENGTH: length, Slot.LENGTH_SQUARED: length * length},
                                diagnosis.check_slots(), frozenset(window.flags), diagnosis.flags())
                window.channel.reduce(Kind.DIAGNOSIS, values).check(window.where, window.detail)
            reduced.check(window.where, window.detail)
        return Result(reduced, float(local), window.length)


class Result(NamedTuple):
    """What a window's exchange brought back, every problem already raised."""

    reduced: Reduced
    local_count: float
    length: int

    def stats(self, global_count: float, mode: str, aux: float | None) -> WindowStats:
        return WindowStats(
            global_count=global_count,
            local_count=self.local_count,
            rank_counts=self.reduced.rank_counts(),
            window_length=self.length,
            loss=None if global_count == 0 else self.reduced[Slot.LOSS_SUM] / global_count,
            skipped=global_count == 0,
            mode=mode,
            aux_loss=aux,
        )


def check_global_count(global_count: float, numerator: float, where: Callable[[], str], detail: str,
                       rank: int) -> None:
    """Raise COUNT_RANGE (the same error on every rank: all read the same N) where N cannot normalize the window
    ``where()`` names (asked only then): N itself, or ``numerator / N`` (the largest factor the mode makes of it),
    is not finite."""
    if math.isfinite(global_count) and math.isfinite(scale_of(numerator, global_count)):
        return
    lines = [f"N = {global_count!r}: {Problem.COUNT_RANGE.what}. Fix: {Problem.COUNT_RANGE.fix}"]
    raise_lines(lines, where(), detail, rank)


def scale_of(numerator: float, count: float) -> float:
    """numerator / count, 0 for an empty window; a non-finite result is the caller's COUNT_RANGE problem."""
    if count == 0:
        return 0.0
    try:
        return numerator / count
    except OverflowError:  # float division by a subnormal can overflow instead of giving inf
        return math.inf


__all__ = ["Closing", "Diagnosis", "Result", "Tally", "WindowStats", "check_global_count", "scale_of"]
