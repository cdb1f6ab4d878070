"""One accumulation window's record, the one collective that combines it over ranks, and what the step used.

Every window costs exactly one SUM all-reduce of a small float64 record, started without waiting after the window's
last forward. Its layout is fixed (:data:`SLOTS`); every problem takes two slots: how many ranks had it, and the sum
of 2**rank over those of the first 52 ranks, which names them exactly (distinct powers of two add up exactly in
float64). Per-rank counts cost P more slots and are only
added when something asked for them (:class:`~token_mean.DenominatorMonitor` does).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from token_mean._problems import PROBLEMS, DenominatorError, Problem

# The scalar slots of a record, in order. COUNT and MICRO belong to the window whose counts the record announces
# (lookahead: the next window; deferred: this one); the others to the window that just ended. REPORTED, COUNTED and
# FIRST sum, over micro-batches whose 'num_items' disagrees with the count, that number, the count, and the valid
# labels in the first position of a row (what a model that shifts labels never predicts), so that a mismatch is
# explained with the same numbers on every rank.
# NAIVE is only measured by DenominatorMonitor under plain DDP: the sum of Lightning's loss / K per micro-batch.
COUNT, MICRO, LOSS_SUM, AUX_SUM, LENGTH, LENGTH_SQUARED, MORE, REPORTED, COUNTED, FIRST, NAIVE = range(11)
SLOTS = 11
FLAGS = SLOTS  # then one slot per problem: the number of ranks that had it
RANK_SUMS = FLAGS + len(PROBLEMS)  # then one per problem: the sum of 2**rank over those ranks below NAMED_RANKS
NAMED_RANKS = 52
RECORD_SIZE = RANK_SUMS + len(PROBLEMS)  # then, when asked for, one slot per rank: that rank's COUNT


@dataclass(frozen=True)
class WindowStats:
    """The denominator and loss of one optimizer step.

    :class:`~token_mean.TokenMeanDDPStrategy` publishes one of these as ``strategy.last_window`` after the last
    micro-batch of each accumulation window (before ``on_before_optimizer_step``), so callbacks can log exactly what
    the update used. Every field but ``local_count`` is identical on every rank. Counts are floats because an item
    can be a sample weight; integer counts are exact in float64 up to 2**53.

    Attributes:
        global_count: N, the valid items of the window summed over all ranks and micro-batches.
        local_count: n_r, this rank's valid items in the window (differs between ranks).
        rank_counts: n_r for every rank, indexed by global rank; ``None`` unless asked for (they cost P floats per
            window in the collective: ``strategy.track_rank_counts()``, which ``DenominatorMonitor`` calls).
        window_length: micro-batches in the window (shorter than K for a partial last window), zero-weight
            fillers of exhausted ranks included.
        loss: the exact global mean loss of the window, Σ loss sums / N; ``None`` when N = 0.
        skipped: True when N = 0 on every rank: the optimizer step was skipped and no state changed.
        mode: ``"lookahead"`` or ``"deferred"`` (the strategy), or ``"measured"`` (``DenominatorMonitor`` without it).
        aux_loss: the mean of the ``"aux_loss"`` terms over the window's real micro-batches on all ranks, when
            ``training_step`` returns one; else ``None``.

    Example:
        >>> stats = WindowStats(8.0, 2.0, (2.0, 6.0), 1, 0.625, False, "lookahead")
        >>> stats.naive_weight_error
        0.5
    """

    global_count: float
    local_count: float
    rank_counts: tuple[float, ...] | None
    window_length: int
    loss: float | None
    skipped: bool
    mode: str
    aux_loss: float | None = None

    @property
    def world_size(self) -> int | None:
        """P, the number of ranks that took part (``None`` without ``rank_counts``)."""
        return None if self.rank_counts is None else len(self.rank_counts)

    @property
    def imbalance(self) -> float | None:
        """max n_r / mean n_r (1.0 is perfectly even; 0.0 when N = 0; ``None`` without ``rank_counts``)."""
        if self.rank_counts is None:
            return None
        if self.global_count == 0:
            return 0.0
        return max(self.rank_counts) * len(self.rank_counts) / self.global_count

    @property
    def naive_weight_error(self) -> float | None:
        """max_r |P·n_r/N − 1|: how far a plain mean of rank means would have mis-weighted a rank's items."""
        if self.rank_counts is None:
            return None
        if self.global_count == 0:
            return 0.0
        size = len(self.rank_counts)
        return max(abs(size * n / self.global_count - 1.0) for n in self.rank_counts)


class Exchange:
    """The window's one collective: a SUM all-reduce of every rank's record, in flight until read.

    ``wait()`` hands back the reduced record on the device without a host sync (on NCCL the current stream waits
    for the collective; gloo completes on the host). ``read()`` copies it to the host: once per window, after the
    window's last backward.
    """

    def __init__(self, record: Tensor, group: Any | None, distributed: bool) -> None:
        self.record = record
        self._work = dist.all_reduce(record, group=group, async_op=True) if distributed else None

    def wait(self) -> Tensor:
        if self._work is not None:
            self._work.wait()
            self._work = None
        return self.record

    def read(self, extra: Tensor | None = None) -> list[float]:
        """The reduced record on the host (``extra`` local values appended, read in the same copy)."""
        record = self.wait()
        if extra is not None:
            record = torch.cat([record, extra.to(record.dtype)])
        return record.tolist()  # type: ignore[no-any-return]


def build_record(
    scalars: Tensor,
    flags: Tensor,
    rank: int,
    rank_slot: int | None,
    world_size: int,
) -> Tensor:
    """Lay out one rank's record: ``scalars`` (the :data:`SLOTS` values), problem ``flags`` (0/1 per problem).

    ``rank_slot`` adds the per-rank count block, with this rank's COUNT at ``rank_slot``.
    """
    parts = [scalars, flags, flags * (2.0**rank if rank < NAMED_RANKS else 0.0)]
    if rank_slot is not None:
        one_hot = torch.zeros(world_size, dtype=scalars.dtype, device=scalars.device)
        one_hot[rank_slot] = scalars[COUNT]
        parts.append(one_hot)
    return torch.cat(parts)


def make_record(
    slots: Sequence[tuple[int, float]],
    flags: Sequence[float],
    device_scalars: Sequence[tuple[int, Tensor]],
    device_flags: Sequence[tuple[Problem, Tensor]],
    device: torch.device,
    rank: int,
    world_size: int,
    rank_counts: bool,
) -> Tensor:
    """One rank's record from host values (one host-to-device copy) and device values (never read on the host).

    ``slots`` and ``device_scalars`` fill scalar slots, ``flags`` are host-side problems (0/1 per problem) and
    ``device_flags`` problems decided on the device; ``rank_counts`` adds the per-rank count block.
    """
    host = [0.0] * SLOTS
    for slot, value in slots:
        host[slot] = value
    values = torch.tensor(host + list(flags), dtype=torch.float64).to(device, non_blocking=True)
    scalars, flag_tensor = values[:SLOTS], values[SLOTS:]
    if device_scalars:
        index = torch.tensor([slot for slot, _ in device_scalars], device=device)
        scalars = scalars.index_add(0, index, torch.stack([value.to(torch.float64) for _, value in device_scalars]))
    if device_flags:
        index = torch.tensor([PROBLEMS.index(problem) for problem, _ in device_flags], device=device)
        raised = torch.stack([condition.to(torch.float64) for _, condition in device_flags])
        raised_flags = torch.zeros_like(flag_tensor).index_add(0, index, raised).clamp(max=1)
        flag_tensor = torch.maximum(flag_tensor, raised_flags)
    return build_record(scalars, flag_tensor, rank, rank if rank_counts else None, world_size)


@dataclass(frozen=True)
class Reduced:
    """A window's record summed over ranks, on the host."""

    values: list[float]

    def __getitem__(self, slot: int) -> float:
        return self.values[slot]

    def rank_counts(self) -> tuple[float, ...] | None:
        extra = self.values[RECORD_SIZE:]
        return tuple(extra) if extra else None

    def problems(self) -> list[str]:
        """One line per problem some rank had: which rank (or how many) and the fix."""
        lines = []
        for index, problem in enumerate(PROBLEMS):
            ranks = round(self.values[FLAGS + index])
            if ranks == 0:
                continue
            bits = int(self.values[RANK_SUMS + index])
            named = [str(rank) for rank in range(NAMED_RANKS) if bits >> rank & 1]
            where = ("rank " if ranks == 1 else "ranks ") + ", ".join(named)
            if len(named) < ranks:
                where = f"{ranks} ranks" + (f" (among them {', '.join(named)})" if named else "")
            what = problem.what
            if problem.name.startswith("NUM_ITEMS_MISMATCH"):
                what += self.num_items_note()
            lines.append(f"{where}: {what}. Fix: {problem.fix}")
        return lines

    def num_items_note(self) -> str:
        """The numbers behind a 'num_items' mismatch, and the likeliest cause when they say it."""
        reported, counted, first = self.values[REPORTED], self.values[COUNTED], self.values[FIRST]
        note = f" (over the micro-batches that disagree: 'num_items' sums to {reported:g}, the count to {counted:g}"
        if first > 0 and counted - reported == first:
            note += (
                f"; the count is higher by exactly the {first:g} valid labels in the first position of a row: the"
                " labels are shifted inside the model; use `count_fn=token_mean.count_shifted_labels`"
            )
        return note + ")"

    def lengths_agree(self, world_size: int) -> bool:
        """All ranks ran windows of one length exactly when Σl² = (Σl)²/P (integers, exact in float64)."""
        total, squares = self.values[LENGTH], self.values[LENGTH_SQUARED]
        return squares * world_size == total * total


def mismatch_slots(reported: Tensor, counted: Tensor, first: Tensor) -> list[tuple[int, Tensor]]:
    """REPORTED, COUNTED and FIRST over the micro-batches whose 'num_items' and count disagree (on the device)."""
    disagree = reported != counted
    return [
        (slot, torch.where(disagree, values, torch.zeros_like(values)).sum())
        for slot, values in ((REPORTED, reported), (COUNTED, counted), (FIRST, first.to(reported.dtype)))
    ]


def raise_problems(lines: list[str], where: str, local_detail: str, rank: int) -> None:
    """Raise the same :class:`DenominatorError` on every rank (this rank's own detail as a note)."""
    if not lines:
        return
    error = DenominatorError(f"token_mean: cannot normalize {where}:\n  " + "\n  ".join(lines))
    if local_detail:  # a note, so that the message itself is the same on every rank
        error.add_note(f"On rank {rank}: {local_detail}")
    raise error


def scale_of(numerator: float, count: float) -> float:
    """numerator / count, 0 for an empty window; a non-finite result is the caller's COUNT_RANGE problem."""
    if count == 0:
        return 0.0
    try:
        return numerator / count
    except OverflowError:  # float division by a subnormal can overflow instead of giving inf
        return math.inf


__all__ = [
    "Exchange",
    "Problem",
    "Reduced",
    "WindowStats",
    "build_record",
    "make_record",
    "mismatch_slots",
    "raise_problems",
    "scale_of",
]
