"""One accumulation window on one rank: opened by its pass, fed one micro-batch at a time, ended once.

A window is one object from its opening to its end, holding what only it has: its K, where it starts and stops,
what each micro-batch contributed and its one exchange. Read top to bottom, a window's life is:

.. code-block:: python

    window = mode.open(...)                                # K, start, stop fixed (lookahead: N known here)
    micro = window.micro_batch(entry, accumulate)           # one per position, in order
    loss = micro.loss_to_backprop(output, batch)            # its count, its share of 1/N; the last starts the exchange
    loss.backward(); micro.backward_done()                  # the front end's own backward
    ended = window.end()                                    # after the last backward: the one host read

``end()`` returns what the window produced (:data:`Ended`) to the pass that opened it, which applies it; nothing here
calls back into the
pass. The modes (``_modes``) say when a micro-batch's count is known and how the scale reaches the gradient; this
module holds what they share: the micro-batch, what the micro-batches contributed (detached, on the device, summed
once per window), and the reading of the exchange, which raises the same :class:`~token_mean.DenominatorError` on
every rank if any rank had a problem.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

from token_mean import _torch
from token_mean._counts import device_count, first_labels
from token_mean._layout import WindowCheck
from token_mean._problems import Problem
from token_mean._reader import Entry
from token_mean._record import NO_SLOTS, Channel, Device, Exchange, Flags, Kind, Reduced, Slot, raise_lines
from token_mean.results import WindowStats


class PassEnd(NamedTuple):
    """What a window's record carries about its pass's end, from the pass."""

    slots: Mapping[Slot, float]
    problems: Sequence[tuple[Problem, str]]


class Check(NamedTuple):
    """Two sides that must agree, and the FIRST hint of a 'num_items' mismatch."""

    left: Tensor | float
    right: Tensor | float
    hint: Tensor | None


_CHECK_SLOTS = {  # the slots that explain a failed check: its two sides, summed where they differ
    Problem.NUM_ITEMS_MISMATCH_COUNT_FN: (Slot.REPORTED, Slot.COUNTED),
    Problem.NUM_ITEMS_MISMATCH_DEFAULT: (Slot.REPORTED, Slot.COUNTED),
    Problem.COUNT_CHANGED: (Slot.READ, Slot.RECEIVED),
}


class StepOutput(NamedTuple):
    """What one micro-batch's forward gave, taken apart."""

    loss: Tensor | None  # the token-mean part (None: missing, a problem)
    aux_loss: Tensor | None
    num_items: Any  # None when not reported
    backprop: Tensor  # what its backward runs: the loss, or a stand-in that keeps this rank's collectives in step
    terms: Mapping[str, Any] | None = None  # an objective of several terms: the mapping the step returned

    @staticmethod
    def of(output: Any, stand_in: Callable[[], Tensor], terms: Sequence[str] = ()) -> tuple[StepOutput, Any]:
        """A ``training_step``'s output taken apart, and what the loop gets back (a stand-in loss where the user's
        was missing: every rank then reaches the window's collective, where all of them raise). With ``terms``, a
        mapping's term losses; the loop gets them back with their sum as its ``"loss"``."""
        if terms:
            mapping = output if isinstance(output, Mapping) else {}
            # a term without items is 0/0 = NaN: the loop gets the micro-batch's finite share, that term adding 0
            present = [
                torch.nan_to_num(value, nan=0.0, posinf=math.inf, neginf=-math.inf)
                for name in terms
                if isinstance(value := mapping.get(name), Tensor)
            ]
            total = sum(present[1:], present[0]) if present else stand_in()
            return StepOutput(None, None, mapping.get("num_items"), total, mapping), {**mapping, "loss": total}
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


_current: weakref.ref[MicroBatch] | None = None  # the micro-batch created last (held by its front end)


def in_filler_batch() -> bool:
    """True from the creation of a zero-weight filler micro-batch to its backward, in every front end: under the
    Trainer strategies its ``training_step`` and backward, in a Fabric loop from ``accumulator.batches`` yielding it
    to its ``accumulator.backward``. Code that runs for other batches (a validation loop) never sees it."""
    micro = None if _current is None else _current()
    return micro is not None and micro.is_filler


class MicroBatch:
    """One micro-batch of a window, from just before its forward to the end of its backward."""

    __slots__ = ("__weakref__", "backprop", "backward_ran", "count", "filler", "last", "position", "window")

    def __init__(self, window: Window, position: int, last: bool, filler: bool, count: float = 0.0) -> None:
        global _current
        self.window = window
        self.position = position
        self.last = last  # the window's last: the optimizer steps after its backward
        self.filler = filler  # a zero-weight repeat of an exhausted rank's batch
        self.count = count  # lookahead: its count, read ahead
        self.backward_ran = False
        self.backprop: Tensor | None = None  # what its backward runs, from its forward to its backward
        _current = weakref.ref(self)

    @property
    def is_filler(self) -> bool:
        """A filler whose backward has not run yet: the mark covers its forward and backward and nothing else."""
        return self.filler and not self.backward_ran

    def loss_to_backprop(self, output: StepOutput, batch: Any) -> Tensor:
        """The forward on ``batch`` gave ``output``: what its backward must run instead of ``output.backprop``."""
        self.backprop = self.window.forward_done(self, output, batch)
        return self.backprop

    def backward_done(self) -> None:
        self.backward_ran = True
        self.backprop = None


class Ended(NamedTuple):
    """What a window's end gives the pass that opened it."""

    stats: WindowStats
    ranks_with_more: float  # ranks holding a real batch after it (a stream's end is agreed from it)
    end_unread: bool  # some rank could not look past it before the last backward (the pass then agrees after it)
    next_counts: Any  # lookahead: the next window's counts, which came with this window's record


class Window:
    """One accumulation window on this rank (see the module docstring); the modes say how it counts and scales.

    Args:
        channel: where the window's record is exchanged.
        start, stop: its positions in the pass, ``[start, stop)``.
        accumulate: K, the micro-batches per window in force.
        step: what messages call its optimizer step, e.g. ``"optimizer step 3 (epoch 0"``.
        loss_reduction: ``"mean"`` (each loss is a mean over its micro-batch's count) or ``"sum"``.
        checks: host-side checks run as it closes (the layout's).
        judge_counts: flag negative and non-finite counts (False where they were judged as they were read).
    """

    mode = "none"

    def __init__(
        self,
        channel: Channel,
        start: int,
        stop: int,
        accumulate: int,
        step: str,
        loss_reduction: str,
        checks: Sequence[WindowCheck] = (),
        judge_counts: bool = True,
    ) -> None:
        self.channel = channel
        self.start, self.stop, self.accumulate, self.step = start, stop, accumulate, step
        self.mean = loss_reduction == "mean"
        self.judge_counts = judge_counts
        self.ended = False
        self._checks = checks
        self._next = start  # the position of the next micro-batch
        self.counts: list[Tensor | float] = []  # a 0-dim device tensor, or a host float judged where it was read
        self.losses: list[Tensor | None] = []  # detached, as the forwards returned them
        self.aux: list[Tensor] = []
        self.pairs: dict[Problem, list[Check]] = {}
        self._flags: set[Problem] = set()
        self.detail = ""  # what this rank saw of its first host-side problem (a note of the error)
        self.real = 0  # micro-batches that are not fillers
        self._following: Sequence[Entry] = ()  # lookahead: the next window's batches, counted in this record
        self._pass_end = PassEnd(NO_SLOTS, ())
        self._exchange: Exchange | None = None  # from the last forward on
        self._shared_flags: Flags | None = None  # the problems the replica group shared (tensor parallelism)
        self._local: Tensor | float = 0.0  # this rank's count, read with the record

    @property
    def length(self) -> int:
        return len(self.counts)

    @property
    def flags(self) -> frozenset[Problem]:
        """The problems found on the host so far."""
        return frozenset(self._flags)

    @property
    def where(self) -> str:
        """The window as messages name it."""
        return f"the accumulation window of {self.step}, batches {self.start}..{self.stop - 1})"

    def micro_batch(self, entry: Entry, accumulate: int) -> MicroBatch:
        """The micro-batch of ``entry`` is about to run its forward with K = ``accumulate``."""
        position = entry.position
        _check_order(self, position, accumulate)
        self._next = position + 1
        return MicroBatch(self, position, position == self.stop - 1, entry.filler, self._count_of(entry))

    def _count_of(self, entry: Entry) -> float:
        """The micro-batch's count where it is known before its forward (lookahead), else 0."""
        return 0.0

    def receive_following(self, following: Sequence[Entry], pass_end: PassEnd) -> None:
        """Before the last micro-batch: the next window's batches (lookahead counts them in this window's record)
        and what the record carries about the pass's end."""
        self._following, self._pass_end = following, pass_end

    def forward_done(self, micro: MicroBatch, output: StepOutput, batch: Any) -> Tensor:
        """The micro-batch's forward on ``batch`` ran: the tensor to back-propagate for it (the modes')."""
        raise NotImplementedError

    def end(self) -> Ended:
        """After the window's last backward: what it produced (the modes')."""
        raise NotImplementedError

    # ---- what the micro-batches contributed ----

    def add(self, count: Tensor | float, loss: Tensor | None, filler: bool, aux: Tensor | None = None) -> None:
        """One micro-batch: its count and its loss as its forward returned it."""
        self.real += not filler
        self.counts.append(count)
        self.losses.append(None if loss is None else loss.detach() if loss.requires_grad else loss)
        if aux is not None:
            self.aux.append(aux.detach())

    def flag(self, problem: Problem, detail: str = "") -> None:
        """A problem found on the host; ``detail`` says what this rank saw."""
        self._flags.add(problem)
        self.detail = self.detail or detail

    def check_equal(
        self, problem: Problem, left: Tensor | float, right: Tensor | float, hint: Tensor | None = None
    ) -> None:
        """``problem`` unless ``left == right`` (decided on the device, at close); ``hint``: the FIRST_LABELS slot."""
        self.pairs.setdefault(problem, []).append(Check(left, right, hint))

    def on_device(self, value: Any, source: str) -> Tensor | None:
        count, detail = device_count(value, source, self.channel.world.device)
        if count is None:
            self.flag(Problem.COUNT_FAILED, detail)
        return count

    # ---- the exchange ----

    def close(self, host: Mapping[Slot, float] = NO_SLOTS) -> None:
        """After the window's last forward: start its exchange (``host``: host slots the mode adds).

        The record carries the window's sums and what tells a problem from them (a non-finite sum, a bad count, a
        check that differs): a handful of kernels. Which rank had which problem is only worked out when some sum says
        there is one (:meth:`read`); under tensor parallelism, where the replicas must share their problems before
        the record, it is worked out at once.
        """
        for check in self._checks:
            for problem, detail in check():
                self.flag(problem, detail)
        for problem, detail in self._pass_end.problems:
            self.flag(problem, detail)
        length = float(self.length)
        sums = {
            **host,
            **self._pass_end.slots,
            Slot.LENGTH: length,
            Slot.LENGTH_SQUARED: length * length,
            Slot.REAL: float(self.real),
        }
        device: list[tuple[Slot | tuple[int, ...], Tensor]] = []
        flags: frozenset[Problem] = frozenset(self._flags)
        device_flags: Flags = ()
        self._local = self._sums(sums, device)
        if self.aux:
            device.append((Slot.AUX_SUM, torch.stack(self.aux).to(torch.float64).sum()))
        for pairs in self.pairs.values():  # how many pairs differ (the diagnosis says by how much)
            left, right = _sides(self, pairs)
            device.append((Slot.DIFFERENT, (left != right).sum(dtype=torch.float64)))
        if self.channel.world.replica_group is not None:
            device_flags, flags = _shared_with_replicas(self, flags, _device_flags(self)), frozenset()
            self._shared_flags = device_flags  # every problem of the replica group: what its failure path names
        self._exchange = self.channel.start(Kind.WINDOW, sums, device, flags, device_flags)

    def _sums(self, host: dict[Slot, float], device: list[tuple[Slot | tuple[int, ...], Tensor]]) -> Tensor | float:
        """The micro-batches' counts and loss sums into the record; this rank's count (host float or device)."""
        if all(type(count) is float for count in self.counts):
            return _host_sums(self, host, device)
        return _device_sums(self, device)

    def global_count(self) -> Tensor:
        """N on the device, waiting for the exchange on the device only (no host read)."""
        return self._started().wait()[Slot.COUNT]

    def read(self) -> tuple[Reduced, float]:
        """The reduced record and this rank's count: the window's one host read. Raises every rank's problems.

        Where the sum shows a problem, every rank (each read the same sum) works out its own and the ranks gather them
        in one more collective, so all raise the same error naming the ranks.
        """
        exchange, local = self._started(), self._local
        if isinstance(local, Tensor):
            reduced = exchange.read(extra=local)
            local = reduced.local[0]
        else:
            reduced = exchange.read()
        if not (_healthy(reduced) and reduced.clean()):  # the common case, told from a few slots
            _raise_problems(self, reduced)
        self.ended = True
        return reduced, float(local)

    def _started(self) -> Exchange:
        if self._exchange is None:
            raise RuntimeError("token_mean: internal error: a window ended before its last forward was done.")
        return self._exchange

    def stats(self, reduced: Reduced, local: float, global_count: float, aux: float | None = None) -> WindowStats:
        return WindowStats(
            global_count=global_count,
            local_count=local,
            rank_counts=reduced.rank_counts(),
            window_length=self.length,
            loss=None if global_count == 0 else reduced[Slot.LOSS_SUM] / global_count,
            skipped=global_count == 0,
            mode=self.mode,
            aux_loss=aux,
        )


def _check_order(window: Window, position: int, accumulate: int) -> None:
    """Refuse a micro-batch out of the window's order, or run with another K than the window was planned with."""
    if accumulate != window.accumulate:
        raise ValueError(
            k_changed(
                window.accumulate,
                accumulate,
                position,
                f"inside {window.where}: the window's"
                " first backward passes were normalized for the window as it was planned",
            )
        )
    if position != window._next:
        raise trained_twice_or_skipped(
            f"the loop trains batch {position} where {window.where} expects batch {window._next}"
        )


def _raise_problems(window: Window, reduced: Reduced) -> None:
    """Raise what the summed record shows. Where it shows a problem, every rank (each read the same sum) works out its
    own problems, the device values' included, and the ranks gather them in one ``all_gather``, so all raise the same
    error naming the ranks."""
    if not reduced.in_step():
        reduced.check(window.where, window.detail)  # the records gathered: which rank is at which collective
    length = float(window.length)
    shared = window._shared_flags  # under tensor parallelism, the replica group's problems (each rank has them)
    window.channel.gather(
        Kind.WINDOW,
        {Slot.LENGTH: length, Slot.LENGTH_SQUARED: length**2},
        _check_slots(window),
        frozenset() if shared is not None else frozenset(window.flags),
        _device_flags(window) if shared is None else shared,
        sequence=window._started().sequence,
    ).check(window.where, window.detail)
    reduced.check(window.where, window.detail, gather=False)  # what the rows did not name is raised from the sum


def count_received(
    window: Window, batch: Any, num_items: Any, count_fn: Callable[[Any], Any], given: bool, use_num_items: bool
) -> Tensor:
    """The count of the batch the forward received, a float64 device scalar (no host sync). With ``use_num_items``
    a reported 'num_items' is the count; where both it and ``count_fn`` (``given``: the user's own) give one, they
    are checked to agree."""
    reported = None if num_items is None else window.on_device(num_items, "'num_items'")
    counted: Tensor | None = None
    if given or num_items is None or not use_num_items:
        try:
            counted = window.on_device(count_fn(batch), "`count_fn`")
        except Exception as error:  # every rank must reach the collective to learn of it
            window.flag(
                Problem.COUNT_FAILED,
                f"`count_fn` raised {type(error).__name__} on the batch `training_step` received: {error}",
            )
    if reported is not None and counted is not None:
        window.check_equal(mismatch(given), reported, counted, first_labels(batch))
    chosen = reported if reported is not None and use_num_items else counted
    return chosen if chosen is not None else window.channel.zero()


# ---- the window's sums, and what tells its problems apart ----


def _host_sums(window: Window, host: dict[Slot, float], device: list[tuple[Slot | tuple[int, ...], Tensor]]) -> float:
    """Counts known on the host (finite, non-negative): N's share is a host float, and the loss sum takes one
    multiplication of the losses that have items."""
    counts = [float(count) for count in window.counts]
    local = math.fsum(counts)
    host[Slot.COUNT] = local
    kept = [
        (loss, count if window.mean else 1.0)
        for loss, count in zip(window.losses, counts, strict=True)
        if count > 0 and loss is not None
    ]
    if len(kept) == 1:
        loss, weight = kept[0]
        device.append((Slot.LOSS_SUM, loss.to(torch.float64) * weight))
    elif kept:
        losses = torch.stack([loss for loss, _ in kept]).to(torch.float64)
        weights = _torch.to_device([weight for _, weight in kept], torch.float64, window.channel.world.device)
        device.append((Slot.LOSS_SUM, losses @ weights))
    return local


def _device_sums(window: Window, device: list[tuple[Slot | tuple[int, ...], Tensor]]) -> Tensor:
    """Counts on the device: a bad count (negative, NaN, infinite) counts nothing but shows in BAD_COUNTS; an empty
    micro-batch's mean loss (0/0 = NaN) adds nothing to the loss sum. Counts and losses go in one stack, the sums
    come out of one reduction and go into the record as one vector (this rank's count first)."""
    zero = window.channel.zero()
    both = _stack(window, [*window.counts, *(zero if loss is None else loss for loss in window.losses)])
    counts, losses = torch.split(both, window.length)  # one view op (slicing twice takes two)
    valid = _valid(counts)
    has_items = valid > 0
    terms = torch.where(has_items, losses, zero) * (valid if window.mean else has_items)
    count_slots = window.channel.count_slots
    rows, slots = [valid] * len(count_slots) + [terms], (*count_slots, Slot.LOSS_SUM)
    if window.judge_counts:  # NaN != NaN
        rows, slots = [*rows, valid != counts], (*slots, Slot.BAD_COUNTS)
    sums = torch.stack(rows).sum(dim=1)
    device.append((slots, sums))
    return sums


def _healthy(reduced: Reduced) -> bool:
    """Whether the summed record shows no problem of the device values: then no rank had one."""
    values = reduced.values
    sums = all(math.isfinite(values[slot]) for slot in (Slot.COUNT, Slot.LOSS_SUM, Slot.AUX_SUM))
    return sums and values[Slot.BAD_COUNTS] == 0 and values[Slot.DIFFERENT] == 0


def _stack(window: Window, values: Sequence[Tensor | float]) -> Tensor:
    """float64 on the device: host floats in one copy, device values stacked. A host float among device values is
    filled in on the device (a kernel argument): a copy from pageable host memory would wait for the device's queue
    inside the window on CUDA."""
    device = window.channel.world.device
    if all(type(value) is float for value in values):
        return _torch.to_device(values, torch.float64, device)  # type: ignore[arg-type]
    stacked = torch.stack(
        [
            value.to(device) if isinstance(value, Tensor) else torch.full((), value, dtype=torch.float64, device=device)
            for value in values
        ]
    )
    return stacked if stacked.dtype == torch.float64 else stacked.to(torch.float64)


def _sides(window: Window, pairs: list[Check]) -> tuple[Tensor, Tensor]:
    return _stack(window, [check.left for check in pairs]), _stack(window, [check.right for check in pairs])


def _device_flags(window: Window) -> list[tuple[Problem, Tensor]]:
    """Which problems of its device values this rank had, worked out on the device."""
    counts = _stack(window, window.counts)
    valid = _valid(counts)
    flags: list[tuple[Problem, Tensor]] = []
    if window.judge_counts:
        flags += [
            (Problem.COUNT_NEGATIVE, (counts < 0).any()),
            (Problem.COUNT_NONFINITE, (~torch.isfinite(counts)).any()),
        ]
    zero = window.channel.zero()
    losses = torch.stack([zero if loss is None else loss for loss in window.losses]).to(torch.float64)
    bad_values = ~torch.isfinite(losses * (valid if window.mean else (valid > 0).to(torch.float64))) & (valid > 0)
    bad_loss = ~torch.isfinite(losses)
    # a finite loss times a huge count: the count's fault, not the model's
    flags += [
        (Problem.BAD_LOSS, (bad_values & bad_loss).any()),
        (Problem.COUNT_RANGE, (bad_values & ~bad_loss).any()),
    ]
    if window.aux:
        flags.append((Problem.BAD_AUX_LOSS, (~torch.isfinite(torch.stack(window.aux).to(torch.float64))).any()))
    for problem, pairs in window.pairs.items():
        left, right = _sides(window, pairs)
        flags.append((problem, (left != right).any()))
    return flags


def _check_slots(window: Window) -> Device:
    """The two sides of each failed check, summed over the micro-batches where they differ (and the first labels
    there, a hint for 'num_items')."""
    slots: list[tuple[Slot | tuple[int, ...], Tensor]] = []
    for problem, pairs in window.pairs.items():
        left, right = _sides(window, pairs)
        differ = left != right
        slots += [
            (slot, (side * differ).sum()) for slot, side in zip(_CHECK_SLOTS[problem], (left, right), strict=True)
        ]
        hints = [check.hint for check in pairs]
        if any(hint is not None for hint in hints):
            zero = window.channel.zero()
            first = torch.stack([zero if h is None else h.to(zero.device, torch.float64) for h in hints])
            slots.append((Slot.FIRST_LABELS, (first * differ).sum()))
    return slots


def _shared_with_replicas(window: Window, flags: frozenset[Problem], device_flags: Flags) -> Flags:
    """The ranks holding this rank's batches (a tensor-parallel group) count alike, and share their problems.

    One MAX all-reduce of 2 × (micro-batches) + (problems) float64 over the replica group. Exact for any float count:
    the group agrees exactly when max(n) = -max(-n) for every micro-batch. A problem of any rank of the group becomes
    a problem of each (the window's record only sums over the data-parallel ranks), so every rank of the mesh raises,
    and none is left in a collective with a peer that raised.
    """
    device = window.channel.world.device
    counts = _valid(_stack(window, window.counts))
    problems = list(Problem)
    index = {problem: position for position, problem in enumerate(problems)}
    raised = _torch.to_device([float(problem in flags) for problem in problems], torch.float64, device)
    if device_flags:
        where = _torch.to_device([index[problem] for problem, _ in device_flags], torch.int64, device)
        found = torch.stack([condition.to(torch.float64) for _, condition in device_flags])
        raised = raised.index_add(0, where, found)
    both = torch.cat([counts, -counts, raised])
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=window.channel.world.replica_group)
    size = counts.numel()
    shared = both[2 * size :].clamp(max=1.0)
    differ = (both[:size] != -both[size : 2 * size]).any()
    return [*((problem, shared[index[problem]]) for problem in problems), (Problem.REPLICA_COUNTS_DIFFER, differ)]


def _valid(counts: Tensor) -> Tensor:
    """A bad count (negative, NaN, infinite) counts nothing."""
    return torch.nan_to_num(counts.clamp(min=0.0), nan=0.0, posinf=0.0)


# ---- messages and helpers the modes and the pass share ----


def mismatch(count_fn_given: bool) -> Problem:
    """The problem a 'num_items' that disagrees with the count is."""
    return Problem.NUM_ITEMS_MISMATCH_COUNT_FN if count_fn_given else Problem.NUM_ITEMS_MISMATCH_DEFAULT


def check_global_count(window: Window, global_count: float, numerator: float, where: Callable[[], str]) -> None:
    """Raise COUNT_RANGE (the same error on every rank: all read the same N) where N cannot normalize the window
    ``where()`` names: N itself, or ``numerator / N`` (the largest factor the mode makes of it), is not finite."""
    if math.isfinite(global_count) and math.isfinite(scale_of(numerator, global_count)):
        return
    lines = [f"N = {global_count!r}: {Problem.COUNT_RANGE.what}. Fix: {Problem.COUNT_RANGE.fix}"]
    raise_lines(lines, where(), window.detail, window.channel.world.rank)


def scale_of(numerator: float, count: float) -> float:
    """numerator / count, 0 for an empty window; a non-finite result is the caller's COUNT_RANGE problem."""
    if count == 0:
        return 0.0
    try:
        return numerator / count
    except OverflowError:  # float division by a subnormal can overflow instead of giving inf
        return math.inf


def trained_twice_or_skipped(what: str) -> RuntimeError:
    """The loop trains or steps at another batch than the window's: one message wherever it is found."""
    return RuntimeError(
        f"token_mean: {what}: a batch was trained twice or skipped (an `optimizer_step` override that calls the"
        " closure twice does this). Call the closure once per batch; if this is not such a case, please report it"
        " with your settings."
    )


def k_changed(old: int, new: int, position: int, where: str) -> str:
    return (
        f"token_mean: `trainer.accumulate_grad_batches` changed from {old} to {new} at batch {position}, {where}."
        " Change K where a window starts, at a batch whose index is a multiple of the new K (in"
        " `on_train_batch_start` when `batch_idx % new_k == 0`, or in `on_train_epoch_start`, as"
        " `GradientAccumulationScheduler` does)."
    )
