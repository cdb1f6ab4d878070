"""The epoch: one pass over the training loader, its length and, for a stream, its end.

An :class:`Epoch` lives for one pass and owns what has the pass's lifetime: its :class:`~token_mean._reader.Reader`,
the length every rank runs, the window being trained and the batch this rank started last. It is the only place the
length changes. A sized loader's length is agreed over the ranks before the pass (:class:`Epochs`); a stream's end is
agreed window by window: a window that opens reaches its stop, and a window that ends says how many ranks hold a
real batch after it, so the stream goes on by one window or ends there. Front ends take micro-batches from it
(:meth:`Epoch.micro_batch`) and hand its items to their loop (:meth:`Epoch.next_item`); Lightning's fetcher follows
its :attr:`~Epoch.length` (``_lightning.follow``).

A sized loader whose ``len()`` understates what it yields (a token-budget sampler's estimate) is caught at the
pass's last window: each rank with its loader's length at hand asks it for one item more than that length (before
the last backward from a loader known to yield fresh memory, in the window's record; after it otherwise, in one more
collective), and every rank raises before that window's update.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from token_mean._problems import Problem
from token_mean._reader import Entry, Reader
from token_mean._record import Channel, Kind, Slot, Values, raise_lines

if TYPE_CHECKING:
    from token_mean._mode import MicroBatch, Window, WindowMode

UNKNOWN_END = 2**62
"""A stream's end before its first window opens."""


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
        self, reader: Reader, mode: WindowMode, length: int | None, label: str, own_length: int | None = None,
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
        self._started: int | None = None  # the batch this rank started last (`on_train_batch_start`)
        self._trained: int | None = None  # the batch this rank trained last

    @property
    def channel(self) -> Channel:
        return self.mode.channel

    def begin(self) -> Epoch:
        """The pass starts. A stream costs one blocking collective here, before any batch is fetched: do the ranks
        have a batch at all? Its end is then agreed window by window."""
        if self.sized:
            return self
        has_batch = self.reader.has_real_from(0, in_flight=False)  # before the first fetch: positions from 0
        reduced = self.channel.reduce(Kind.BATCHES, Values({Slot.MORE: float(has_batch)}))
        ranks = round(reduced[Slot.MORE])
        lines = []
        if 0 < ranks < self.channel.world.size:
            missing = self.channel.world.size - ranks
            who = f"{missing} rank{'s' if missing > 1 else ''}"
            lines = [f"{who}: {Problem.NO_BATCH.what}. Fix: {Problem.NO_BATCH.fix}"]
        reduced.check("the epoch's first window", "" if has_batch else "its training loader yielded nothing", lines)
        if ranks == 0:
            self.length = 0  # an empty pass on every rank
        return self

    # ---- the loop's side ----

    def next_item(self) -> Any:
        """The next item for the loop; ``StopIteration`` at the pass's end."""
        return self.reader.next_item(self.length)

    def micro_batch(self, position: int, accumulate: int, step: Callable[[], int]) -> MicroBatch:
        """The micro-batch at ``position`` is about to run its forward with K = ``accumulate`` (its window opens
        here when the last one ended); ``step()`` is the optimizer step its window is, as messages number it (asked
        only when a window opens)."""
        self._trained = position
        window = self._window
        if window is None or window.ended:
            window = self._window = self.mode.open(self, position, accumulate, step(), window)
        return window.micro_batch(position, accumulate)

    def started(self, position: int) -> None:
        """The loop started the batch at ``position`` (it may still leave the epoch there, untrained)."""
        self._started = position

    def left_at(self) -> int | None:
        """The batch at which this rank's pass ended untrained (``on_train_batch_start`` returned -1), if it did."""
        started, self._started = self._started, None
        return None if started is None or started == self._trained else started

    # ---- the windows' side ----

    def window_stop(self, start: int, accumulate: int) -> int:
        """One past the last position of the window that holds ``start`` (windows are K apart from the pass's start;
        a sized pass's last one can be short)."""
        stop = start + accumulate - start % accumulate
        return min(stop, self.length) if self.sized else stop

    def reach(self, start: int, accumulate: int) -> int:
        """A window opens at ``start`` (or re-plans its end there) with K = ``accumulate``: its stop, which a stream
        reaches now (fillers pad it on ranks whose stream ended)."""
        stop = self.window_stop(start, accumulate)
        if not self.sized:
            self.length = stop
        return stop

    def entry(self, position: int) -> Entry:
        if self.sized and position >= self.length:
            raise RuntimeError(
                f"token_mean: internal error: no batch at position {position} of a pass of {self.length}. Please"
                " report this with your settings."
            )
        return self.reader.entry(position)

    def entries(self, start: int, stop: int) -> list[Entry]:
        return self.reader.entries(start, min(stop, self.length) if self.sized else stop)

    def read_ahead(self, stop: int, all_of_it: bool) -> None:
        """Lookahead's rolling read: one batch towards ``stop`` (all of them with ``all_of_it``)."""
        self.reader.read_ahead(min(stop, self.length) if self.sized else stop, at_most=None if all_of_it else 1)

    def at_close(self, stop: int, peek: bool) -> tuple[dict[Slot, float], list[tuple[Problem, str]]]:
        """What the record of the window ending at ``stop`` carries about the pass's end, after its last forward:
        for a sized pass's last window, whether the loader yields past its length; with ``peek`` (deferred mode:
        lookahead counts the next window instead), whether this rank holds a real batch after a stream's window.
        Either is read before the last backward only from a loader known to yield fresh memory (one that refills
        a buffer would overwrite the batch in flight): such a rank says it is unsure, and the ranks agree after the
        backward."""
        reader = self.reader
        if self.sized:
            if stop < self.length or not self._checks_length():
                return {}, []
            if not reader.fresh or reader.resumed_without_state:  # a restarted loader is read past its first items
                return {Slot.UNSURE: 1.0}, []
            return {}, self._past_end()
        if not peek:
            return {}, []
        if not reader.fresh:
            return {Slot.UNSURE: 1.0}, []
        problems = []
        if any(entry.aliased for entry in reader.entries(stop, stop + 1)):
            problems.append((Problem.ALIASED, f"the batch at position {stop} reuses the memory of the batch in flight"))
        return {Slot.MORE: float(reader.has_real_from(stop))}, problems

    def ended(self, window: Window, ranks_with_more: float, unsure: bool) -> None:
        """The window ending at ``window.stop`` was read (its problems raised): ``ranks_with_more`` hold a real batch
        after it (a stream's); ``unsure``: some rank could not tell before the backward, so the ranks agree now."""
        if self.sized:
            if unsure:  # the pass's last window: whether a loader yields past its length, agreed after the backward
                problems = self._past_end() if self._checks_length() else []
                flags = frozenset(problem for problem, _ in problems)
                self.channel.reduce(Kind.PAST_END, Values(flags=flags)).check(window.where, _detail(problems))
            return
        if unsure:  # a stream whose loader is not known to yield fresh memory on some rank: a second collective
            more = self.reader.has_real_from(window.stop, in_flight=False)
            reduced = self.channel.reduce(Kind.STREAM_END, Values({Slot.MORE: float(more)}))
            reduced.check(window.where)
            ranks_with_more = reduced[Slot.MORE]
        world = self.channel.world
        if not self._pad and 0 < ranks_with_more < world.size:
            lines = [f"{Problem.UNEVEN.what}: the ranks' streams ended in different windows. Fix: {Problem.UNEVEN.fix}"]
            raise_lines(lines, window.where, "", world.rank)
        self.length = window.stop + window.accumulate if ranks_with_more > 0 else window.stop

    def _checks_length(self) -> bool:
        return self._own_length is not None and not self.reader.exhausted

    def _past_end(self) -> list[tuple[Problem, str]]:
        """LONGER_THAN_LEN if this rank's loader yields more items than its length (the extra ones are dropped)."""
        own = self._own_length
        if own is None or not self.reader.yields_beyond(own - self.reader.undrawn_start):
            return []
        return [(Problem.LONGER_THAN_LEN, f"its loader yielded more than its `len()` of {own}")]

    # ---- a rank that left its pass early ----


    def batch_starts_before_exchange(self, position: int, accumulate: int) -> int | None:
        """How many batches after ``position`` the other ranks still start before the exchange of the window that
        holds it (for a rank whose pass ended at ``position``, untrained, with K = ``accumulate`` in force); None
        where their next collective comes before the forward of ``position``."""
        window = self._window
        if window is not None and not window.ended and window.start <= position < window.stop:
            return window.stop - 1 - position
        return self.mode.starts_before_exchange(self, position, accumulate, window)

    def leave(self, position: int) -> None:
        """This rank's pass ended at ``position``, which it did not train: one blocking collective, in step only
        where every rank ended there; otherwise it meets what the others are at, and every rank raises that the
        ranks are out of step."""
        self.channel.reduce(Kind.LEFT).check(f"the end of its epoch at batch {position}")


def _detail(problems: list[tuple[Problem, str]]) -> str:
    return problems[0][1] if problems else ""


class Epochs:
    """The passes of one fit (or of one Fabric accumulator): their agreed length, and where each starts.

    Args:
        mode: opens the passes' windows.
        pad_uneven_ranks: ranks of different lengths are padded with fillers (False: an error).
        unit: how messages name a pass (``"epoch"``, ``"pass"``).
        catch_up: what a rank whose pass ended early (untrained, at a batch the others train) runs before it leaves,
            given the pass and that batch (the others' batch starts before their window's exchange, what their
            forwards run). None: a front end where a pass never ends early.
    """

    def __init__(self, mode: WindowMode, pad_uneven_ranks: bool, unit: str = "epoch",
                 catch_up: Callable[[Epoch, int], None] | None = None) -> None:
        self.mode = mode
        self._pad = pad_uneven_ranks
        self._unit = unit
        self._catch_up = catch_up
        self._length: int | None = None
        self._own_length: int | None = None
        self.limit: int | None = None
        self._resumed_exhausted = False
        self.current: Epoch | None = None  # the pass in progress, or the last one

    def agree(self, local: int | None, own: int | None = None) -> int | None:
        """Agree on the passes' length: ``local`` is this rank's (after Lightning's ``limit_train_batches``), ``own``
        its loader's own ``len()`` (None: a stream, or a length that is only a hint). Every rank takes the longest;
        a shorter rank pads with fillers after its own (its ``limit``). One collective, two for uneven ranks."""
        from token_mean._loaders import agree_on_length

        self._length = agree_on_length(self.mode.channel, local, self._pad)
        limited = local is not None and own is not None and local < own
        self.limit = local if limited else None
        # a limit that cuts the loader short reads past its length by design: the length is only checked without one
        self._own_length = None if limited else own
        return self._length

    def resume(self, exhausted: bool) -> None:
        """The next pass resumes a checkpoint in which this rank's loader had run out (``exhausted``)."""
        self._resumed_exhausted = exhausted

    def begin(self, reader: Reader, index: int) -> Epoch:
        """Pass number ``index`` starts over ``reader`` (the previous one settled first)."""
        self.settle()
        reader.restart(self._resumed_exhausted, self.limit)
        self._resumed_exhausted = False
        epoch = Epoch(reader, self.mode, self._length, f"{self._unit} {index}", self._own_length, self._pad)
        self.current = epoch
        return epoch.begin()

    def settle(self) -> None:
        """The last pass is over: if this rank left it at a batch it did not train, meet the others where they are
        (their batch starts in that window, then its exchange), so that every rank raises the same error instead
        of waiting for the process group's timeout; no error where every rank ended there."""
        epoch = self.current
        position = None if epoch is None else epoch.left_at()
        if epoch is None or position is None or self._catch_up is None or not self.mode.channel.world.distributed:
            return
        self._catch_up(epoch, position)
        epoch.leave(position)


__all__ = ["UNKNOWN_END", "Epoch", "Epochs"]
