"""The pass: one epoch (a Fabric loop's pass) over the training batches, its length, its windows, its end.

An :class:`Epoch` owns what has the pass's lifetime: its reader, the length every rank runs and the window being
trained. It opens each window, hands it what it needs (lookahead: the next window's batches, read ahead; at its last
micro-batch, what the record says about the pass's end), and applies what the window's end returns: a stream goes on
by one window or ends there. A sized pass's last window also asks each loader for one item past its ``len()``, so
a length that understates what it yields raises before that window's update.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.distributed as dist
from torch.utils.data import IterableDataset

from token_mean._modes import Counts, Mode
from token_mean._problems import Problem
from token_mean._reader import Reader
from token_mean._record import Kind, Slot, raise_lines
from token_mean._window import MicroBatch, PassEnd, Window, k_changed, trained_twice_or_skipped
from token_mean.results import WindowStats

UNKNOWN_END = 2**62
"""A stream's length while it goes on: its end is only known once the ranks agree on it."""


class Epoch:
    """One pass over the training batches on this rank (see the module docstring).

    Args:
        reader: the pass's batches (restarted for this pass).
        mode: opens its windows.
        length: the batches every rank runs (a sized loader's agreed length), or None for a stream.
        label: how messages name the pass (``"epoch 2"``, ``"pass 1"``).
        own_length: this rank's loader's own length, where an understated one can be told (None: a limited epoch,
            a stream, or nothing to check).
        pad_uneven_ranks: whether streams may end in different windows on different ranks.
    """

    def __init__(
        self,
        reader: Reader,
        mode: Mode,
        length: int | None,
        label: str,
        own_length: int | None = None,
        pad_uneven_ranks: bool = True,
    ) -> None:
        self.reader = reader
        self.mode = mode
        self.sized = length is not None
        self.length = UNKNOWN_END if length is None else length
        self.label = label
        self._own_length = own_length
        self._pad = pad_uneven_ranks
        self._window: Window | None = None  # the window being trained, or the last one that ended
        self._next_counts: Counts | None = None  # lookahead: the next window's, counted in the last one's record

    def begin(self) -> Epoch:
        """The pass starts. A stream costs one blocking collective here, before any batch is fetched: do the ranks
        have a batch at all? Its end is then agreed window by window."""
        if self.sized:
            return self
        channel = self.mode.channel
        has_batch = self.reader.has_real_from(0, in_flight=False)  # before the first fetch: positions from 0
        reduced = channel.reduce(Kind.BATCHES, {Slot.MORE: float(has_batch)})
        ranks = round(reduced[Slot.MORE])
        lines = []
        if 0 < ranks < channel.world.size:
            missing = channel.world.size - ranks
            who = f"{missing} rank{'s' if missing > 1 else ''}"
            lines = [f"{who}: {Problem.NO_BATCH.what}. Fix: {Problem.NO_BATCH.fix}"]
        reduced.check("the epoch's first window", "" if has_batch else "its training loader yielded nothing", lines)
        if ranks == 0:
            self.length = 0  # an empty pass on every rank
        return self

    def next_item(self) -> Any:
        """The next item for the loop; ``StopIteration`` at the pass's end."""
        return self.reader.next_item(self.length)

    def window_stop(self, start: int, accumulate: int) -> int:
        """One past the last position of the window that holds ``start`` (windows are K apart from the pass's start;
        a sized pass's last one can be short)."""
        return self._clip(start + accumulate - start % accumulate)

    def _clip(self, stop: int) -> int:
        return min(stop, self.length) if self.sized else stop

    # ---- one window after the other ----

    def micro_batch(self, position: int, accumulate: int, step: Callable[[], int]) -> MicroBatch:
        """The micro-batch at ``position`` is about to run its forward with K = ``accumulate`` (its window opens
        here when the last one ended); ``step()`` numbers the window's optimizer step in messages."""
        if self.sized and position >= self.length:
            raise RuntimeError(
                f"token_mean: internal error: no batch at position {position} of a pass of"
                f" {self.length}. Please report this with your settings."
            )
        window = self._window
        if window is None or window.ended:
            window = self._window = self._open(position, accumulate, step())
        reader, stop = self.reader, window.stop
        entry = reader.entry(position)
        last = position == stop - 1
        reads_ahead = self.mode.reads_ahead
        if reads_ahead:  # the rolling read: one batch of the next window now, the rest of it with this window's last
            ahead = self.window_stop(stop, accumulate)
            reader.read_ahead(ahead, at_most=None if last else 1)
        if last:
            window.receive_following(
                reader.entries(stop, ahead) if reads_ahead else [], self.pass_end(stop, peek=not reads_ahead)
            )
        return window.micro_batch(entry, accumulate)

    def _open(self, start: int, accumulate: int, step: int) -> Window:
        previous = self._window
        expected = self.reader.start if previous is None else previous.stop
        if start != expected:
            raise trained_twice_or_skipped(
                f"the loop trains batch {start} where the next window opens at batch {expected}"
            )
        if previous is not None and previous.accumulate != accumulate and start % accumulate:
            raise ValueError(
                k_changed(
                    previous.accumulate,
                    accumulate,
                    start,
                    (
                        f"where a window starts, but {start} is not a multiple of {accumulate}: Lightning zeroes"
                        " the gradient only at batches whose index is a multiple of K, so this window's update would"
                        " apply the gradient of the window before it a second time"
                    ),
                )
            )
        self.mode.check_resumed_accumulate(start, accumulate)
        stop = self.window_stop(start, accumulate)
        counts = self._next_counts if self._next_counts is not None and self._next_counts.stop == stop else None
        return self.mode.open(start, stop, accumulate, f"optimizer step {step} ({self.label}", counts, self.reader)

    def inside_window(self) -> str | None:
        """Where this pass stands if some of its window's micro-batches trained and the window has not ended (what
        messages say of it), else None."""
        window = self._window
        if window is None or window.ended or window.length == 0:
            return None
        return f"{window.where}, after batch {window.start + window.length - 1}"

    def end_window(self) -> WindowStats:
        """After the window's last backward: its stats (the window's one host read; every rank's problems raised
        here), applied to the pass (a stream goes on by one window, or ends)."""
        window = self._window
        if window is None or window.ended:
            raise RuntimeError("token_mean: internal error: a window was ended twice, or before it opened.")
        ended = window.end()
        self._next_counts = ended.next_counts
        self.apply_window_end(window, ended.ranks_with_more, ended.end_unread)
        self.mode.count_skipped(ended.stats)
        return ended.stats

    def apply_window_end(self, window: Window, ranks_with_more: float, end_unread: bool) -> None:
        """The window ending at ``window.stop`` was read (its problems raised): ``ranks_with_more`` hold a real batch
        after it (a stream's); ``end_unread``: some rank could not tell before the backward, so the ranks agree now."""
        channel = self.mode.channel
        if self.sized:
            if end_unread:  # the pass's last window: whether a loader yields past its length, agreed after the backward
                problems = self._past_end() if self._checks_length() else []
                flags = frozenset(problem for problem, _ in problems)
                channel.reduce(Kind.PAST_END, flags=flags).check(window.where, _detail(problems))
            return
        if end_unread:  # a loader not known to yield fresh memory on some rank: a second collective, after the backward
            more = self.reader.has_real_from(window.stop, in_flight=False)
            reduced = channel.reduce(Kind.STREAM_END, {Slot.MORE: float(more)})
            reduced.check(window.where)
            ranks_with_more = reduced[Slot.MORE]
        if not self._pad and 0 < ranks_with_more < channel.world.size:
            lines = [f"{Problem.UNEVEN.what}: the ranks' streams ended in different windows. Fix: {Problem.UNEVEN.fix}"]
            raise_lines(lines, window.where, "", channel.world.rank)
        self.length = UNKNOWN_END if ranks_with_more > 0 else window.stop

    def pass_end(self, stop: int, peek: bool) -> PassEnd:
        """What the record of the window ending at ``stop`` carries about the pass's end: for a sized pass's last
        window, whether the loader yields past its length; with ``peek`` (deferred: lookahead counts the next window
        instead), whether this rank holds a real batch after a stream's window. Either is read before the last
        backward only from a loader known to yield fresh memory (one that refills a buffer would overwrite the batch
        in flight): such a rank says it is unsure, and the ranks agree after the backward."""
        reader = self.reader
        if self.sized:
            if stop < self.length or not self._checks_length():
                return PassEnd({}, [])
            if not reader.fresh or reader.resumed_without_state:  # a restarted loader is read past its first items
                return PassEnd({Slot.END_UNREAD: 1.0}, [])
            return PassEnd({}, self._past_end())
        if not peek:
            return PassEnd({}, [])
        if not reader.fresh:
            return PassEnd({Slot.END_UNREAD: 1.0}, [])
        problems = []
        if any(entry.aliased for entry in reader.entries(stop, stop + 1)):
            problems.append((Problem.ALIASED, f"the batch at position {stop} reuses the memory of the batch in flight"))
        return PassEnd({Slot.MORE: float(reader.has_real_from(stop))}, problems)

    def _checks_length(self) -> bool:
        return self._own_length is not None and not self.reader.exhausted

    def _past_end(self) -> list[tuple[Problem, str]]:
        """LONGER_THAN_LEN if this rank's loader yields more items than its length (the extra ones are dropped)."""
        own = self._own_length
        if own is None or not self.reader.yields_beyond(own - self.reader.undrawn_start):
            return []
        return [(Problem.LONGER_THAN_LEN, f"its loader yielded more than its `len()` of {own}")]


def _detail(problems: list[tuple[Problem, str]]) -> str:
    return problems[0][1] if problems else ""


class Passes:
    """The passes of one fit (or of one Fabric accumulator): their agreed length, and where each starts.

    Args:
        mode: opens the passes' windows.
        pad_uneven_ranks: ranks of different lengths are padded with fillers (False: an error).
        unit: how messages name a pass (``"epoch"``, ``"pass"``).
    """

    def __init__(self, mode: Mode, pad_uneven_ranks: bool, unit: str = "epoch") -> None:
        self.mode = mode
        self._pad = pad_uneven_ranks
        self._unit = unit
        self._length: int | None = None
        self._own_length: int | None = None
        self.limit: int | None = None
        self._resumed_exhausted = False
        self.current: Epoch | None = None  # the pass in progress, or the last one

    def agree(self, local: int | None, own: int | None = None) -> int | None:
        """Agree on the passes' length: ``local`` is this rank's (after Lightning's ``limit_train_batches``), ``own``
        its loader's own ``len()`` (None: a stream, or a length that is only a hint). Every rank takes the longest;
        a shorter rank pads with fillers after its own (its ``limit``). One collective, two for uneven ranks."""
        self._length = agree_on_length(self.mode, local, self._pad)
        limited = local is not None and own is not None and local < own
        self.limit = local if limited else None
        # a limit that cuts the loader short reads past its length by design: the length is only checked without one
        self._own_length = None if limited else own
        return self._length

    def check_loader(self, length: int | None) -> None:
        """A training loader of ``length`` batches (None: a stream) is about to be sized: refuse, on every rank at once,
        loaders with a length on some ranks only, or without a batch on some ranks only. One collective a loader."""
        channel = self.mode.channel
        reduced = channel.reduce(
            Kind.LENGTH, {Slot.UNSIZED: float(length is None), Slot.EPOCH_LENGTH: float(length == 0)}
        )
        reduced.check("the ranks' agreement on their training loaders")
        size = channel.world.size
        if 0 < round(reduced[Slot.UNSIZED]) < size:
            raise ValueError(_MIXED_LENGTHS)
        empty = round(reduced[Slot.EPOCH_LENGTH])
        if 0 < empty < size:
            raise ValueError(
                f"token_mean: the training loaders of {empty} of the {size} ranks have no batch (this rank's:"
                f" {length}). {_NO_BATCH}"
            )

    def resume(self, exhausted: bool) -> None:
        """The next pass resumes a checkpoint in which this rank's loader had run out (``exhausted``)."""
        self._resumed_exhausted = exhausted

    def begin(self, reader: Reader, index: int) -> Epoch:
        """Pass number ``index`` starts over ``reader``."""
        reader.restart(self._resumed_exhausted, self.limit)
        self._resumed_exhausted = False
        self.current = Epoch(reader, self.mode, self._length, f"{self._unit} {index}", self._own_length, self._pad)
        return self.current.begin()


def length_is_a_hint(loaders: list[Any]) -> bool:
    """An ``IterableDataset``'s ``__len__`` can overstate what it yields (padding the epoch with phantom optimizer
    steps): its end is agreed as the stream ends instead."""
    return any(isinstance(getattr(loader, "dataset", None), IterableDataset) for loader in loaders)


_NO_BATCH = "A rank without any batch cannot take part in the backward: give every rank at least one batch."
_MIXED_LENGTHS = (
    "token_mean: the training loaders have a length on some ranks and none on others (an IterableDataset on some"
    " ranks only?); give every rank the same kind of loader."
)


def agree_on_length(mode: Mode, local: int | None, pad_uneven_ranks: bool) -> int | None:
    """The longest rank's number of batches this pass, or None when unsized.

    One collective when the ranks agree (a SUM of each rank's length and its square: all lengths are equal exactly
    when Σl² · P = (Σl)²), a second (a MAX) for the longest when they do not. The loop sizes the epoch (the stepping
    rule, validation intervals) from each rank's own loaders, so ranks with shards of different sizes would step at
    different batches; every rank takes the longest and the reader pads the shorter ones with zero-weight fillers.
    """
    channel = mode.channel
    world = channel.world
    length = local or 0
    reduced = channel.reduce(
        Kind.LENGTH,
        {
            Slot.EPOCH_LENGTH: float(length),
            Slot.EPOCH_LENGTH_SQUARED: float(length * length),
            Slot.UNSIZED: float(local is None),
        },
    )
    reduced.check("the ranks' agreement on the epoch's length")
    unsized = round(reduced[Slot.UNSIZED])
    if unsized:
        if unsized < world.size:
            raise ValueError(_MIXED_LENGTHS)
        return None
    total, squares = reduced[Slot.EPOCH_LENGTH], reduced[Slot.EPOCH_LENGTH_SQUARED]
    if squares * world.size == total * total:
        return length
    extremes = {Slot.EPOCH_LENGTH: float(length), Slot.EPOCH_LENGTH_SQUARED: float(-length)}
    longest_of = channel.reduce(Kind.LENGTH, extremes, op=dist.ReduceOp.MAX)
    longest, shortest = round(longest_of[Slot.EPOCH_LENGTH]), -round(longest_of[Slot.EPOCH_LENGTH_SQUARED])
    if shortest == 0 or not pad_uneven_ranks:
        raise ValueError(
            f"token_mean: the ranks' training loaders have between {shortest} and {longest} batches this epoch (this"
            f" rank: {local}). "
            + (
                _NO_BATCH
                if shortest == 0
                else "With `pad_uneven_ranks=False` every rank needs the same number: set"
                " `pad_uneven_ranks=True` to let exhausted ranks contribute zero-weight batches, or balance the shards."
            )
        )
    return longest
