"""The record every collective of the package exchanges (one SUM all-reduce of a fixed-length float64 record), and
the channel that numbers and exchanges it. A record holds :class:`Slot` values, then one slot per mark (each
:class:`~token_mean._problems.Problem` and :class:`Kind`): how many ranks set it. With the kind and a sequence number
in every record, ranks out of step learn it from the sum itself and all raise the same error. Only then, on the
failure path, do the ranks gather their records (one ``all_gather``) to name which rank had which problem. Per-rank
counts, when asked for, cost P more slots."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from enum import Enum, IntEnum
from functools import partial
from types import MappingProxyType
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from token_mean import _torch
from token_mean._layout import World
from token_mean._problems import Problem
from token_mean.errors import DenominatorError

_SUM = dist.ReduceOp.SUM if dist.is_available() else None


class Slot(IntEnum):
    """The scalar slots of a record, summed over ranks."""

    COUNT = 0  # this rank's valid items in the window: its share of N
    LOSS_SUM = 1  # Σ of the window's loss sums (micro-batches with items)
    AUX_SUM = 2  # Σ of the window's 'aux_loss' terms (real micro-batches)
    REAL = 3  # the window's micro-batches that are not zero-weight fillers
    LENGTH = 4  # the window's micro-batches, fillers included
    LENGTH_SQUARED = 5  # its square: all ranks ran as many exactly when Σl² · P = (Σl)²
    SEQUENCE = 6  # how many collectives this rank ran on the channel before this one
    SEQUENCE_SQUARED = 7
    MORE = 8  # 1: this rank holds a real batch after the window (a stream's end is agreed from it)
    NEXT_COUNT = 9  # lookahead: the next window's count, read ahead
    NEXT_REAL = 10  # lookahead: the next window's real micro-batches
    REPORTED = 11  # Σ 'num_items' over the micro-batches whose 'num_items' and count disagree
    COUNTED = 12  # Σ of the count over the same micro-batches
    FIRST_LABELS = 13  # Σ of the valid labels in the first position of a row over them (a shifted-labels hint)
    READ = 14  # lookahead: Σ of the count read ahead over micro-batches whose batch changed before training_step
    RECEIVED = 15  # lookahead: Σ of the count of the batch training_step received, over the same micro-batches
    EPOCH_LENGTH = 16  # the agreement on an epoch's length: this rank's batches (or -batches under MAX)
    EPOCH_LENGTH_SQUARED = 17  # ... its square (or, under MAX, its batches)
    UNSIZED = 18  # 1: this rank's training loader has no length
    END_UNREAD = 19  # 1: a rank could not look past the window before its last backward (refilled buffer, restart)
    BAD_COUNTS = 20  # micro-batches whose count on the device is negative or not finite (a diagnosis says whose)
    DIFFERENT = 21  # checked pairs whose two sides differ ('num_items' and the count, read ahead and received)


class Kind(Enum):
    """Which collective a record belongs to, as a message names it."""

    LENGTH = "the agreement on the length of an epoch (or of a Fabric pass)"
    BATCHES = "the check, at the start of an epoch, that the ranks' streams hold batches"
    FIRST_COUNTS = "the counts of an epoch's first window, or of the first after K changed (lookahead)"
    WINDOW = "the end of an accumulation window"
    STREAM_END = "the agreement, after a window's last backward, on whether a stream goes on (deferred mode)"
    PAST_END = "the check, after an epoch's last backward, that no loader yields more batches than its `len()`"
    PROVISIONAL = "the agreement on the first provisional denominator (deferred mode over a device mesh)"


Mark = Problem | Kind
MARKS: tuple[Mark, ...] = (*Problem, *Kind)
_MARK_INDEX = {mark: index for index, mark in enumerate(MARKS)}
_FIRST_KIND = len(Problem)  # the kinds' marks follow the problems'
RANKS = len(Slot)  # then one slot per mark: how many ranks set it
RECORD_SIZE = RANKS + len(MARKS)  # then, for a channel that publishes them, one slot per rank: that rank's COUNT


TERM_SLOTS = 3
TERM_COUNT, TERM_LOSS_SUM, TERM_NEXT_COUNT = range(TERM_SLOTS)
"""A term's slots: its count (this rank's share of N_t), its loss sum and, in lookahead, the next window's count."""

Slots = tuple[int, ...]
"""Several slots a 1-d device value adds to, one element each (:class:`Slot` members, or a per-rank slot)."""


NO_SLOTS: Mapping[Slot, float] = MappingProxyType({})
Device = Sequence[tuple["Slot | Slots", Tensor]]
"""Device values for a record (never read here): a 0-dim tensor for a slot, or a 1-d one for :data:`Slots`."""
Flags = Sequence[tuple[Problem, Tensor]]
"""Problems decided on the device, each true or false (a problem given twice is raised when either is)."""


class Channel:
    """The package's collectives over one :class:`World`: each a SUM all-reduce of a record, numbered in order.
    ``rank_counts`` adds the per-rank block to every record. ``join_backward`` runs when a blocking collective finds
    others at a window's end: their last backward's reduction would wait for this rank until the timeout, so it joins
    that backward (with zeros) before anyone raises."""

    def __init__(
        self,
        world: World,
        rank_counts: bool = False,
        join_backward: Callable[[], None] | None = None,
        terms: int = 0,
    ) -> None:
        self.world = world
        self.rank_counts = rank_counts
        self.terms = terms  # an objective of several terms: TERM_SLOTS more slots per term, at the record's end
        self._join_backward = join_backward
        self._sequence = 0
        self._indices: dict[tuple[int, ...], Tensor] = {}
        self._zero: Tensor | None = None
        # the per-rank block: each rank's count, or with several terms each rank's count of every term
        self._size = RECORD_SIZE + (world.size * max(terms, 1) if rank_counts else 0) + TERM_SLOTS * terms

    def term_slot(self, term: int, what: int) -> int:
        """Where term ``term``'s value ``what`` (:data:`TERM_COUNT`, ``TERM_LOSS_SUM`` or ``TERM_NEXT_COUNT``)
        goes in this channel's records."""
        return self._size - TERM_SLOTS * (self.terms - term) + what

    def zero(self) -> Tensor:
        """A float64 zero on the world's device, made once per channel (a fit); never written to."""
        if self._zero is None:
            self._zero = torch.zeros((), dtype=torch.float64, device=self.world.device)
        return self._zero

    @property
    def count_slots(self) -> Slots:
        """Where a rank's COUNT goes: its slot, and its own slot of the per-rank block where the channel has one."""
        return (Slot.COUNT, RECORD_SIZE + self.world.rank) if self.rank_counts and not self.terms else (Slot.COUNT,)

    def record(
        self,
        kind: Kind,
        host: Mapping[Slot, float] = NO_SLOTS,
        device: Device = (),
        flags: frozenset[Problem] = frozenset(),
        device_flags: Flags = (),
        *,
        sequence: int | None = None,
    ) -> Tensor:
        """This rank's record for a collective of ``kind``: ``host`` values in one host-to-device copy, ``device``
        values in one ``index_add``; ``flags`` and ``device_flags``: problems found on the host or device;
        ``sequence``: the collective's number (None: the next one's)."""
        world = self.world
        values = [0.0] * self._size
        for slot, value in host.items():
            values[slot] = value
        sequence = self._sequence if sequence is None else sequence
        values[Slot.SEQUENCE] = float(sequence)
        values[Slot.SEQUENCE_SQUARED] = float(sequence**2)
        marks: tuple[Mark, ...] = (kind, *flags)
        for mark in marks:
            values[RANKS + _MARK_INDEX[mark]] = 1.0
        if self.rank_counts and self.terms:  # this rank's count of each term, in its own slots of the per-rank block
            for term in range(self.terms):
                values[RECORD_SIZE + world.rank * self.terms + term] = values[self.term_slot(term, TERM_COUNT)]
        elif self.rank_counts:  # this rank's COUNT again, in its own slot of the per-rank block
            values[RECORD_SIZE + world.rank] = values[Slot.COUNT]
        record = _torch.to_device(values, torch.float64, world.device)
        index, source = self._device_part(device, flags, device_flags)
        if source is not None:
            record = record.index_add(0, self._index(index), source)
        return record

    def _device_part(
        self, device: Device, flags: frozenset[Problem], device_flags: Flags
    ) -> tuple[tuple[int, ...], Tensor | None]:
        """The slots the device values add to, and those values as one float64 vector (one vector alone: no kernel)."""
        scalar_slots: list[int] = []
        scalars: list[Tensor] = []
        vector_slots: list[int] = []
        vectors: list[Tensor] = []
        for slot, value in device:
            value = _float64(value)
            if isinstance(slot, tuple):  # a vector names its COUNT's slots itself (count_slots)
                vector_slots += slot
                vectors.append(value)
            else:
                for target in self.count_slots if slot is Slot.COUNT else (slot,):
                    scalar_slots.append(target)
                    scalars.append(value)
        # a problem flagged on the host is set already; one decided twice on the device counts once
        decided: dict[Problem, list[Tensor]] = {}
        for problem, flag in device_flags:
            if problem not in flags:
                decided.setdefault(problem, []).append(flag)
        for problem, found in decided.items():
            scalar_slots.append(RANKS + _MARK_INDEX[problem])
            scalars.append(_float64(found[0] if len(found) == 1 else torch.stack(found).any()))
        sources = ([torch.stack(scalars)] if scalars else []) + vectors
        if not sources:
            return (), None
        return (*scalar_slots, *vector_slots), sources[0] if len(sources) == 1 else torch.cat(sources)

    def _index(self, slots: tuple[int, ...]) -> Tensor:
        """The device index tensor of ``slots``, made once per set (a window's are the same every time)."""
        index = self._indices.get(slots)
        if index is None:
            index = self._indices[slots] = _torch.to_device(list(slots), torch.int64, self.world.device)
        return index

    def start(self, kind: Kind, *contents: Any, **named: Any) -> Exchange:
        """Start the collective of this rank's :meth:`record` (of these contents) without waiting for it."""
        return self._exchange(kind, _SUM, contents, named)

    def reduce(self, kind: Kind, *contents: Any, op: Any = None, **named: Any) -> Reduced:
        """A blocking collective of this rank's :meth:`record` (a host read), by default a SUM: only where no window's
        forward has run yet."""
        reduced = self._exchange(kind, op or _SUM, contents, named).read()
        if (
            op is None
            and self._join_backward is not None
            and not reduced.in_step()
            and kind is not Kind.WINDOW
            and reduced.ranks(Kind.WINDOW) > 0
        ):
            self._join_backward()
        return reduced

    def gather(self, kind: Kind, *contents: Any, sequence: int, **named: Any) -> Reduced:
        """The failure path: every rank's :meth:`record` of collective number ``sequence`` (one ``all_gather``, a
        host read), summed, with the rows that say which rank set which mark."""
        rows: list[list[float]] = self._all_gather(self.record(kind, *contents, sequence=sequence, **named)).tolist()
        return Reduced(kind, [sum(column) for column in zip(*rows, strict=True)], self.world, [], self.terms, rows)

    def _all_gather(self, record: Tensor) -> Tensor:
        """Every rank's ``record``, a row each (this rank's alone where no collective runs)."""
        if not self.world.distributed:
            return record.unsqueeze(0)
        rows = [torch.empty_like(record) for _ in range(self.world.size)]
        dist.all_gather(rows, record, group=self.world.group)
        return torch.stack(rows)

    def _exchange(self, kind: Kind, op: Any, contents: tuple[Any, ...], named: dict[str, Any]) -> Exchange:
        sequence = self._sequence
        record = self.record(kind, *contents, **named)
        self._sequence += 1
        # the failure path builds the same record again and gathers it, to name who had which problem
        regather = partial(self.gather, kind, *contents, sequence=sequence, **named)
        return Exchange(kind, record, self.world, op, sequence, self.terms, regather)


class Exchange:
    """One record's all-reduce, started at once: ``wait()`` gives the reduced record on the device without a host
    sync, ``read()`` copies it to the host (once per window, after its last backward)."""

    def __init__(
        self,
        kind: Kind,
        record: Tensor,
        world: World,
        op: Any,
        sequence: int = 0,
        terms: int = 0,
        gather: Callable[[], Reduced] | None = None,
    ) -> None:
        self.kind = kind
        self.record = record
        self.world = world
        self.terms = terms
        self.sequence = sequence  # its number on the channel
        self._gather = gather
        self._work = dist.all_reduce(record, op=op, group=world.group, async_op=True) if world.distributed else None

    def wait(self) -> Tensor:
        if self._work is not None:
            self._work.wait()
            self._work = None
        return self.record

    def read(self, extra: Tensor | None = None) -> Reduced:
        """The reduced record on the host, with ``extra`` local device values (1-d, float64) read in the same copy."""
        record = self.wait()
        if extra is None:
            return Reduced(self.kind, record.tolist(), self.world, [], self.terms, gather=self._gather)
        values: list[float] = torch.cat([record, extra]).tolist()
        local = values[record.numel() :]
        return Reduced(self.kind, values[: record.numel()], self.world, local, self.terms, gather=self._gather)


class Reduced:
    """A record summed over ranks, on the host (``local``: this rank's own values read with it). ``rows``: every
    rank's record, where they were gathered (the failure path); ``gather``: gathers them, once every rank saw the
    same sum show a problem."""

    def __init__(
        self,
        kind: Kind,
        values: list[float],
        world: World,
        local: list[float],
        terms: int = 0,
        rows: list[list[float]] | None = None,
        gather: Callable[[], Reduced] | None = None,
    ) -> None:
        self.kind, self.values, self.world, self.local, self.terms = kind, values, world, local, terms
        self.rows = rows
        self._gather = gather

    def __getitem__(self, slot: Slot | int) -> float:
        return self.values[slot]

    def rank_counts(self, term: int | None = None) -> tuple[float, ...] | None:
        """Every rank's count (None without the per-rank block); with several terms, of term ``term`` alone (None
        for the whole objective: its terms count unlike items)."""
        extra = self.values[RECORD_SIZE : len(self.values) - TERM_SLOTS * self.terms]
        if not extra or (self.terms and term is None):
            return None
        return tuple(extra) if term is None else tuple(extra[term :: self.terms])

    def term(self, term: int, what: int) -> float:
        """Term ``term``'s value ``what``, summed over ranks (:meth:`Channel.term_slot`)."""
        return self.values[len(self.values) - TERM_SLOTS * (self.terms - term) + what]

    def ranks(self, mark: Mark) -> int:
        """How many ranks set ``mark``."""
        return round(self.values[RANKS + _MARK_INDEX[mark]])

    def ranks_with(self, mark: Mark) -> tuple[int, list[int]]:
        """How many ranks set ``mark``, and which (those whose rows were gathered)."""
        column = RANKS + _MARK_INDEX[mark]
        return self.ranks(mark), [rank for rank, row in enumerate(self.rows or ()) if row[column] > 0]

    def in_step(self) -> bool:
        """Every rank ran this collective as its same-numbered one on the channel."""
        size, values = self.world.size, self.values
        kinds = values[RANKS + _FIRST_KIND : RANKS + _FIRST_KIND + len(Kind)]  # how many ranks were at each kind
        sequence, squares = values[Slot.SEQUENCE], values[Slot.SEQUENCE_SQUARED]
        return sum(kinds) == size and values[RANKS + _MARK_INDEX[self.kind]] == size and squares * size == sequence**2

    def lengths_agree(self) -> bool:
        """All ranks ran windows of one length (integers, exact in float64)."""
        total, squares = self[Slot.LENGTH], self[Slot.LENGTH_SQUARED]
        return squares * self.world.size == total * total

    def lines(self) -> list[str]:
        """One line per problem some rank raised: which ranks (or how many) and the fix (the ranks in step)."""
        lines = []
        for problem in Problem:
            ranks, named = self.ranks_with(problem)
            if ranks:
                what = problem.what + (self.num_items_note() if problem.name.startswith("NUM_ITEMS") else "")
                what += self.count_changed_note() if problem is Problem.COUNT_CHANGED else ""
                lines.append(f"{_who(ranks, named)}: {what}. Fix: {problem.fix}")
        if self.kind is Kind.WINDOW and not self.lengths_agree():
            lines.append(
                f"{Problem.UNEVEN.what} (total {self[Slot.LENGTH]:g} micro-batches over {self.world.size}"
                f" ranks). Fix: {Problem.UNEVEN.fix}"
            )
        return lines

    def _out_of_step(self) -> str:
        where = [f"{_who(*self.ranks_with(kind))} at {kind.value}" for kind in Kind if self.ranks_with(kind)[0]]
        if len(where) == 1:
            where = [f"all ranks at {self.kind.value}, but not as the same collective of their run"]
        return (
            f"token_mean: {Problem.OUT_OF_STEP.what}: {'; '.join(where)}. The ranks' collectives no longer"
            f" match, so none of their results can be trusted. Fix: {Problem.OUT_OF_STEP.fix}"
        )

    def num_items_note(self) -> str:
        """The numbers behind a 'num_items' mismatch, and the likeliest cause when they say it."""
        reported, counted, first = self[Slot.REPORTED], self[Slot.COUNTED], self[Slot.FIRST_LABELS]
        note = f" (over the micro-batches that disagree: 'num_items' sums to {reported:g}, the count to {counted:g}"
        if first > 0 and counted - reported == first:
            note += (
                f"; the count is higher by exactly the {first:g} valid labels in the first position of a row: the"
                " labels are shifted inside the model; use `count_fn=token_mean.count_shifted_labels`"
            )
        return note + ")"

    def count_changed_note(self) -> str:
        return (
            f" (over the micro-batches that changed: {self[Slot.READ]:g} valid items as the loader yielded them,"
            f" {self[Slot.RECEIVED]:g} in the batches `training_step` received)"
        )

    def clean(self) -> bool:
        """Every rank ran this collective as its same-numbered one and raised nothing (the cheap common case)."""
        size, values = self.world.size, self.values
        marks = values[RANKS:RECORD_SIZE]
        sequence, squares = values[Slot.SEQUENCE], values[Slot.SEQUENCE_SQUARED]
        return (
            sum(marks) == size
            and marks[_MARK_INDEX[self.kind]] == size
            and squares * size == sequence**2
            and (self.kind is not Kind.WINDOW or self.lengths_agree())
        )

    def check(self, where: str, detail: str = "", more: Sequence[str] = (), gather: bool = True) -> None:
        """Raise the same :class:`DenominatorError` on every rank if the ranks are out of step or any raised a problem
        (``more``: the caller's own lines); this rank's ``detail`` is a note, so the message is the same everywhere.
        Where the sum shows a problem, the ranks first gather their records to name who had it (unless ``gather`` is
        false: then the message counts them)."""
        clean = self.clean()
        if clean and not more:
            return
        named = self if clean or not gather or self.rows is not None or self._gather is None else self._gather()
        if not named.in_step():
            error = DenominatorError(named._out_of_step())
            error.add_note(f"On rank {self.world.rank}: at {where}" + (f"; {detail}" if detail else ""))
            raise error
        raise_lines([*named.lines(), *more], where, detail, self.world.rank)


def _float64(value: Tensor) -> Tensor:
    return value if value.dtype == torch.float64 else value.to(torch.float64)


def _who(ranks: int, named: list[int]) -> str:
    if len(named) == ranks:
        return ("rank " if ranks == 1 else "ranks ") + ", ".join(map(str, named))
    return f"{ranks} ranks" + (f" (among them {', '.join(map(str, named))})" if named else "")


def raise_lines(lines: list[str], where: str, detail: str, rank: int) -> None:
    """Raise the same :class:`DenominatorError` on every rank for ``lines`` (none: return). The first problem leads
    the first line, since that is the line read where ranks' tracebacks interleave; its fix and the rest follow."""
    if not lines:
        return
    cause, _, fix = lines[0].partition(". Fix: ")
    text = f"token_mean: {cause}, in {where}."
    text += f"\n  Fix: {fix}" if fix else ""
    error = DenominatorError(text + "".join(f"\n  Also: {line}" for line in lines[1:]))
    if detail:
        error.add_note(f"On rank {rank}: {detail}")
    raise error
