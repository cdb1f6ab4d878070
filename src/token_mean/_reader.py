"""The epoch's training batches as the package sees them: read ahead on demand, padded so every rank runs as long.
Under the Trainer the fit loop's fetcher reads it, and it the ``CombinedLoader``, so it sees exactly the batches
``training_step`` receives; under Fabric it reads the accumulator's loader. It calls nothing above it."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any, NamedTuple

from torch import Tensor
from torch.utils._pytree import tree_flatten

from token_mean import _torch

Memory = tuple[tuple[tuple[int, int, int, int], ...], tuple[tuple[int, int], ...]]
"""Each tensor's ``(start, stop, id, version)`` of bytes covered, and all tensors' ``(id, version)`` in order. Memory
overlapping another batch's is a refilled buffer, unless it is the very same tensors, unchanged. ``id`` is compared
only against batches still held (alive: ids not reused)."""
_NO_MEMORY: Memory = ((), ())


class Entry(NamedTuple):
    """One batch handed (or to be handed) to the loop, by its position in the epoch."""

    position: int
    filler: bool  # a repeat of a real batch at weight zero, so an exhausted rank still joins every collective
    batch: Any = None  # the batch as the loader yielded it (None for a filler)
    aliased: bool = False  # it shares memory with a batch still held or in flight when it was read
    item: Any = None  # what the loader yielded, the batch first
    state: Any = None  # the loaders' state before it was read (a stateful loader's, read ahead)
    memory: Memory = _NO_MEMORY


def _overwrites(memory: Memory, others: list[Memory], same_tensors: bool = False) -> bool:
    """Whether ``memory`` overlaps that of one of ``others`` (``same_tensors``: even where it is the very same
    tensor, unchanged). Loops, not generators: this runs for every batch read, against every batch held."""
    for other in others:
        for start, stop, tensor, version in memory[0]:
            for other_start, other_stop, _, _ in other[0]:
                if start < other_stop and other_start < stop and (same_tensors or (tensor, version) not in other[1]):
                    return True
    return False


_LEAVES = (int, float, bool, str, bytes, type(None))


def _tensors(batch: Any) -> list[Tensor]:
    """The tensors in a batch: plain dicts, lists and tuples walked directly, other containers through pytree."""
    if isinstance(batch, Tensor):
        return [batch]
    kind = type(batch)
    if kind is dict or kind is list or kind is tuple:
        tensors: list[Tensor] = []
        for value in batch.values() if kind is dict else batch:
            if isinstance(value, Tensor):
                tensors.append(value)
            elif not isinstance(value, _LEAVES):
                tensors += _tensors(value)
        return tensors
    if isinstance(batch, _LEAVES):
        return []
    leaves, _ = tree_flatten(batch)
    return [leaf for leaf in leaves if isinstance(leaf, Tensor)]


class Reader:
    """Hands out one loader's batches in order, holding some ahead when asked, and never ends by itself.

    An item is what ``raw_next()`` returns, the batch first; positions count from the pass's start, which ends where
    the :class:`~token_mean._epoch.Epoch` says. Past the loader's end, or for a ``None`` batch, a rank repeats its
    last real batch at weight zero. A batch read while others are held or in flight is checked for shared memory.

    Args:
        raw_next: the next item of the loader; raises ``StopIteration`` at its end.
        snapshot: the loaders' ``state_dict``s (stateful loaders only), for a mid-epoch checkpoint.
        start: where the loop's epoch stands when the first batch is fetched (mid-epoch on resume).
        skipped: the items before ``start`` were drawn before the reader (Fabric skips them itself).
    """

    def __init__(
        self,
        raw_next: Callable[[], Any],
        snapshot: Callable[[], Any] | None = None,
        start: Callable[[], int] = int,
        skipped: bool = False,
    ) -> None:
        self._source = _Source(raw_next)
        self._snapshot = snapshot
        self._start = start
        self._skipped = skipped
        self._previous: Memory = _NO_MEMORY  # of the last real batch read
        self._reads = 0  # real batches read
        self.refills = False
        self.restart()

    def restart(self, resumed_exhausted: bool = False, limit: int | None = None) -> None:
        """A new pass; ``resumed_exhausted``: out of batches at the checkpoint; ``limit``: only ``limit`` batches."""
        self._limit = limit
        self.resumed_without_state = False  # resumed mid-pass, the loader restarted from its first batch
        self._position = 0  # of the next item handed out
        self.start = 0  # the pass's first position (after the batches a resumed pass trained before)
        self._started = False
        self._source.restart(resumed_exhausted)
        self._held: deque[Entry] = deque()  # read ahead of the loop
        self._entries: deque[Entry] = deque()  # handed out and held, in order
        self.current: Entry | None = None  # the entry handed out last (None before the pass's first)
        self._current: Memory = _NO_MEMORY  # of the batch handed out last

    def adopt(self, items: list[Any]) -> None:
        """Items the loop read before the reader was installed: they come first."""
        self._source.adopt(items)

    @property
    def exhausted(self) -> bool:
        """Whether the loader has run out this pass."""
        return self._source.exhausted

    def _shift(self, start: int) -> None:
        """Positions count from 0 until the first batch is fetched, then from where the loop's epoch stands."""
        self._started = True
        self.start = start
        # a loader without state resumed mid-epoch restarts: it yields its first batches again
        self.resumed_without_state = start > 0 and not self.stateful and not self._skipped
        self._position += start
        self._entries = deque(entry._replace(position=entry.position + start) for entry in self._entries)
        self._held = deque(held._replace(position=held.position + start) for held in self._held)

    @property
    def fresh(self) -> bool:
        """Whether the loader is known to yield fresh memory: two real reads, and no refilled buffer ever seen."""
        return self._reads >= 2 and not self.refills

    @property
    def stateful(self) -> bool:
        return self._snapshot is not None

    @property
    def position(self) -> int:
        return self._position

    @property
    def undrawn_start(self) -> int:
        """Items before :attr:`start` the reader never drew (the loader resumed past them), else 0."""
        return 0 if self.resumed_without_state else self.start

    # ---- the loop's side ----

    def next_item(self, end: int) -> Any:
        """The item at :attr:`position`; ``StopIteration`` at ``end``, where the epoch ends."""
        if not self._started:
            self._shift(self._start())
        if self._position >= end:
            self._held.clear()  # speculative reads past an end the ranks agreed on
            raise StopIteration
        if self._held:
            entry = self._held.popleft()
        else:  # the batch before it is done: only batches held ahead can be overwritten
            entry = self._read(self._position, in_flight=False)
            self._entries.append(entry)
        self._position += 1
        self.current = entry
        self._current = entry.memory
        return entry.item

    def consumed_state(self) -> Any:
        """The loaders' state after the batches handed out: batches held ahead are not consumed yet."""
        if self._snapshot is None:
            raise RuntimeError("token_mean: internal error: the state of a loader without `state_dict` was asked for.")
        return self._held[0].state if self._held else self._snapshot()

    @property
    def consumed_exhausted(self) -> bool:
        """Whether the loader had run out at the consumed position (not merely while reading ahead)."""
        return self.exhausted and (not self._held or self._held[0].filler)

    # ---- the modes' side ----

    def entry(self, position: int) -> Entry:
        """The entry at ``position``, reading ahead to it if needed; earlier entries are dropped."""
        if self._position + len(self._held) <= position:  # not held yet (lookahead holds it already)
            self.read_ahead(position + 1)
        while self._entries and self._entries[0].position < position:
            self._entries.popleft()
        if not self._entries or self._entries[0].position != position:
            raise RuntimeError(
                f"token_mean: internal error: no batch at position {position} (next: {self._position}). Please report"
                " this with your settings."
            )
        return self._entries[0]

    def entries(self, start: int, stop: int) -> list[Entry]:
        """Entries of positions [start, stop), reading ahead as needed (fewer if the loader yields nothing)."""
        self.read_ahead(stop)
        return [entry for entry in self._entries if start <= entry.position < stop]

    def read_ahead(self, stop: int, at_most: int | None = None, in_flight: bool = True) -> None:
        """Hold the batches before ``stop``, reading at most ``at_most`` now (``in_flight``: as in :meth:`_read`)."""
        reads = 0
        next_read = self._position + len(self._held)
        while next_read < stop and (at_most is None or reads < at_most):
            state = self._snapshot() if self._snapshot is not None else None  # before the read: not consumed yet
            try:
                entry = self._read(next_read, in_flight)._replace(state=state)
            except StopIteration:
                return
            self._held.append(entry)
            self._entries.append(entry)
            next_read += 1
            reads += 1

    def has_real_from(self, position: int, in_flight: bool = True) -> bool:
        """Whether a real batch is held or readable at ``position`` or later (reads at most one more batch)."""
        if any(not entry.filler for entry in self._entries if entry.position >= position):
            return True
        if self.exhausted:
            return False
        self.read_ahead(max(position, self._position + len(self._held)) + 1, in_flight=in_flight)
        return any(not entry.filler for entry in self._entries if entry.position >= position)

    def unchanged(self, batch: Any) -> bool:
        """Whether ``batch`` holds the very tensors handed out last, unchanged (no hook moved or wrote them)."""
        # the batch handed out last is held (in its entry and by the loop): its tensors' ids are not reused
        current = self._current[1]
        return bool(current) and _torch.fingerprint(_tensors(batch)) == current

    def yields_beyond(self, items: int) -> bool:
        """Whether the loader yields more than ``items`` items this pass (reads and drops them). Not under a limit."""
        return self._source.draws_beyond(items)

    def _read(self, position: int, in_flight: bool) -> Entry:
        """The entry at ``position`` (a filler past the loader's end); ``in_flight``: the last batch is in use."""
        if self._limit is not None and position >= self._limit:
            self._source.stop()
        item, filler = self._source.next()
        if filler:
            return Entry(position, filler=True, item=item)
        memory = _torch.memory(_tensors(item[0]))
        self.refills = self.refills or _overwrites(memory, [self._previous], same_tensors=True)
        self._previous = memory
        self._reads += 1
        held = [entry.memory for entry in self._held]
        aliased = _overwrites(memory, [*held, self._current] if in_flight else held)
        return Entry(position, False, item[0], aliased, item, memory=memory)


class _Source:
    """The loader's items, and what a filler repeats: the last real item (before any, the first real one)."""

    def __init__(self, raw_next: Callable[[], Any]) -> None:
        self._raw_next = raw_next
        self.pending: deque[Any] = deque()  # raw items read before the reader took over, or to read again
        self.restart(False)

    def restart(self, resumed_exhausted: bool) -> None:
        self.exhausted = False
        self._template: Any = None
        self._resumed_exhausted = resumed_exhausted
        self.drawn = len(self.pending)  # items drawn from the loader this pass (pending ones when adopted)

    def adopt(self, items: list[Any]) -> None:
        self.pending.extend(items)
        self.drawn += len(items)

    def stop(self) -> None:
        """The rank's limit is reached: nothing after it is trained."""
        self.exhausted = True
        self.pending.clear()

    def draws_beyond(self, items: int) -> bool:
        if self.exhausted:
            return self.drawn > items
        while self.drawn <= items:
            try:
                self._raw_next()
            except StopIteration:
                return False  # the source's own state is left as it was: the pass has ended
            self.drawn += 1
        return True

    def next(self) -> tuple[Any, bool]:
        """The next item and whether it is a filler; ``StopIteration`` for a loader that yielded nothing."""
        if self._resumed_exhausted:
            # ran out before the checkpoint: the restored loader starts over, its first batch a zero-weight filler
            self._resumed_exhausted = False
            self._template = self._next_raw()
            self.exhausted = True
        item = self._next_raw()
        if item is None or item[0] is None:
            if self._template is None:
                self._template = self._first_real(item)
            if self._template is None:
                raise StopIteration  # nothing to repeat: a rank without batches (the modes report it)
            return self._template, True
        self._template = item
        return item, False

    def _next_raw(self) -> Any:
        if self.pending:
            return self.pending.popleft()
        if self.exhausted:
            return None
        try:
            item = self._raw_next()
        except StopIteration:
            self.exhausted = True
            return None
        self.drawn += 1
        return item

    def _first_real(self, skipped: Any) -> Any:
        if skipped is None:
            return None
        found: list[Any] = []
        while (item := self._next_raw()) is not None:
            found.append(item)
            if item[0] is not None:
                break
        self.pending.extendleft(reversed(found))
        real = [item for item in found if item[0] is not None]
        return real[0] if real else None
