"""The epoch's training batches as the package sees them: read ahead on demand, padded so every rank runs as long.

Under the Trainer the reader sits between Lightning's ``CombinedLoader`` and its data fetcher (``_lightning.
read_through``), so it sees exactly the batches ``training_step`` receives, several training loaders combined, and
nothing that user code draws from ``trainer.train_dataloader`` itself; under Fabric it reads the loader the
accumulator was given. It never calls anything above it: the modes pull entries from it, the front end hands
Lightning (or the loop) its items.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any, NamedTuple

from torch import Tensor
from torch.utils._pytree import tree_flatten

from token_mean import _torch

Memory = tuple[tuple[tuple[int, int, int, int], ...], tuple[tuple[int, int], ...]]
"""The bytes a batch's tensors cover, each tensor's ``(start, stop, id, version)``, and its tensors' ``(id,
version)`` in the batch's order. A batch whose memory overlaps another's is a refilled buffer, unless it is the very
same tensors there, unchanged since the other was read (a loader that yields one batch again without writing to it).
Tensors are told apart by ``id`` only against batches the reader or the loop still holds (alive: ids not reused)."""
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


def _memory_of(batch: Any) -> Memory:
    spans: list[tuple[int, int, int, int]] = []
    fingerprint: list[tuple[int, int]] = []
    for tensor in _tensors(batch):  # one pass, no intermediate lists: this runs for every batch read
        start, stop, version = _torch.memory(tensor)
        key = (id(tensor), version)
        fingerprint.append(key)
        if start != stop:
            spans.append((start, stop, *key))
    return tuple(spans), tuple(fingerprint)


def _shares(memory: Memory, other: Memory) -> bool:
    return any(start < other_stop and other_start < stop
               for start, stop, _, _ in memory[0] for other_start, other_stop, _, _ in other[0])


def _overwrites(memory: Memory, others: list[Memory]) -> bool:
    """Whether ``memory`` overlaps that of one of ``others`` where it is not the very same tensor."""
    return any(start < other_stop and other_start < stop and (tensor, version) not in other[1]
               for other in others for start, stop, tensor, version in memory[0]
               for other_start, other_stop, _, _ in other[0])


_LEAVES = (int, float, bool, str, bytes, type(None))


def _tensors(batch: Any) -> list[Tensor]:
    """The tensors in a batch: plain dicts, lists and tuples walked directly (a flat one in a single call), other
    containers through torch's pytree."""
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

    An item is what ``raw_next()`` returns; its first element is the batch (``(batch, batch_idx, dataloader_idx)``
    from Lightning's ``CombinedLoader``; ``(batch,)`` under Fabric). Positions count batches from the pass's start
    (from where the loop's epoch stands on resume). Where the pass ends is the :class:`~token_mean._epoch.Epoch`'s
    to say: past the end of its loader a rank repeats its last real batch as a zero-weight filler, and a ``None``
    batch becomes a filler too, so every rank can train the same positions. A batch read while others are held or in
    flight (read ahead, or prefetched from a stream) is checked for sharing their memory: a loader that refills one
    buffer would overwrite them.

    Args:
        raw_next: the next item of the loader; raises ``StopIteration`` at its end.
        snapshot: the loaders' own ``state_dict``s (stateful loaders only), for a mid-epoch checkpoint.
        start: where the loop's epoch stands when the first batch is fetched (mid-epoch on resume).
        skipped: the loader's items before ``start`` were drawn before the reader (Fabric skips them itself); else a
            resumed loader either restored its state (stateful) or restarts from its first item.
    """

    def __init__(
        self, raw_next: Callable[[], Any], snapshot: Callable[[], Any] | None = None, start: Callable[[], int] = int,
        skipped: bool = False,
    ) -> None:
        self._source = _Source(raw_next)
        self._snapshot = snapshot
        self._start = start
        self._skipped = skipped
        self._started = False
        self.start = 0  # the pass's first position (after the batches a resumed pass trained before)
        self._position = 0  # of the next item handed out
        self._held: deque[Entry] = deque()  # read ahead of the loop
        self._entries: deque[Entry] = deque()  # handed out and held, in order
        self._current: Memory = _NO_MEMORY  # of the batch handed out last
        self._previous: Memory = _NO_MEMORY  # of the last real batch read
        self._reads = 0  # real batches read
        # A loader is known to yield fresh memory after two real batches read of which none shared the previous one's
        # bytes; one that refills a buffer (or shares a tensor between batches) never is, once seen.
        self.refills = False
        self._limit: int | None = None
        self.resumed_without_state = False  # resumed mid-pass, the loader restarted from its first batch
        self.current: Entry | None = None  # the entry handed out last (None before the pass's first)

    def restart(self, resumed_exhausted: bool = False, limit: int | None = None) -> None:
        """A new pass over the loader; ``resumed_exhausted``: this rank's loader had run out when the checkpoint
        being resumed was written; ``limit``: this rank trains its first ``limit`` batches only (Lightning's
        ``limit_train_batches``), and repeats a filler after them."""
        self._limit = limit
        self.resumed_without_state = False
        self._position = 0
        self.start = 0
        self._started = False
        self._source.restart(resumed_exhausted)
        self._held.clear()
        self._entries.clear()
        self.current = None
        self._current = _NO_MEMORY

    def adopt(self, items: list[Any]) -> None:
        """Raw items the loop had read before the reader was installed: they come first."""
        self._source.adopt(items)

    @property
    def exhausted(self) -> bool:
        """Whether the loader has run out this pass."""
        return self._source.exhausted

    def _shift(self, start: int) -> None:
        """Positions count from 0 until the first batch is fetched, then from where the loop's epoch stands."""
        self._started = True
        self.start = start
        # resumed mid-epoch from a loader without a state (Lightning restarts it from its first batch): it yields its
        # first batches again, and its whole length after them
        self.resumed_without_state = start > 0 and not self.stateful and not self._skipped
        self._position += start
        self._entries = deque(entry._replace(position=entry.position + start) for entry in self._entries)
        self._held = deque(held._replace(position=held.position + start) for held in self._held)

    @property
    def fresh(self) -> bool:
        """Whether the loader is known to yield fresh memory."""
        return self._reads >= 2 and not self.refills

    @property
    def stateful(self) -> bool:
        return self._snapshot is not None

    @property
    def position(self) -> int:
        """The position of the next item handed out."""
        return self._position

    @property
    def undrawn_start(self) -> int:
        """The loader's items of this pass the reader never drew: those before :attr:`start`, where the loader
        resumed past them (its state restored, or skipped before the reader), else none."""
        return 0 if self.resumed_without_state else self.start

    # ---- the loop's side ----

    def next_item(self, end: int) -> Any:
        """The item at :attr:`position`; ``StopIteration`` at ``end``, where the epoch says the pass ends."""
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
        """Whether the loader had run out at the consumed position: one that only ran out while reading ahead
        still holds real batches to hand out."""
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
        """Entries of positions [start, stop), reading ahead as needed (fewer where a loader that yields nothing
        ends)."""
        self.read_ahead(stop)
        return [entry for entry in self._entries if start <= entry.position < stop]

    def read_ahead(self, stop: int, at_most: int | None = None, in_flight: bool = True) -> None:
        """Hold the batches up to position ``stop`` (exclusive), reading at most ``at_most`` of them now;
        ``in_flight``: the batch handed out last has not finished its backward."""
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
        """Whether this rank holds or can read a real batch at ``position`` or later (reads at most one batch past
        ``position`` or past what it already holds)."""
        if any(not entry.filler for entry in self._entries if entry.position >= position):
            return True
        if self.exhausted:
            return False
        self.read_ahead(max(position, self._position + len(self._held)) + 1, in_flight=in_flight)
        return any(not entry.filler for entry in self._entries if entry.position >= position)

    def unchanged(self, batch: Any) -> bool:
        """Whether ``batch`` holds the very tensors of the batch handed out last, unchanged since they were read (no
        hook between the loader and the forward moved, replaced or wrote them)."""
        # the batch handed out last is held (in its entry and by the loop): its tensors' ids are not reused
        current = self._current[1]
        tensors = _tensors(batch)
        if not current or len(tensors) != len(current):
            return False
        for tensor, (identity, version) in zip(tensors, current, strict=True):  # a loop: it runs for every batch
            if id(tensor) != identity or _torch.version(tensor) != version:
                return False
        return True

    def yields_beyond(self, items: int) -> bool:
        """Whether the loader yields more than ``items`` items this pass: it is read (and what it yields dropped)
        until it has drawn one more, or runs out. Not for a loader under a limit."""
        return self._source.draws_beyond(items)

    def _read(self, position: int, in_flight: bool) -> Entry:
        """The entry at ``position`` (a filler once the loader is done); ``in_flight``: the batch handed out last has
        not finished its backward, so a batch sharing its memory would overwrite it."""
        if self._limit is not None and position >= self._limit:
            self._source.stop()
        item, filler = self._source.next()
        if filler:
            return Entry(position, filler=True, item=item)
        memory = _memory_of(item[0])
        self.refills = self.refills or _shares(memory, self._previous)
        self._previous = memory
        self._reads += 1
        held = [entry.memory for entry in self._held]
        aliased = _overwrites(memory, [*held, self._current] if in_flight else held)
        return Entry(position, False, item[0], aliased, item, memory=memory)


class _Source:
    """The loader's items, and what a filler repeats: the last real item. A ``None`` batch before any real one
    repeats the first real batch, which is still handed out later."""

    def __init__(self, raw_next: Callable[[], Any]) -> None:
        self._raw_next = raw_next
        self.pending: deque[Any] = deque()  # raw items read before the reader took over, or to read again
        self.exhausted = False
        self._template: Any = None
        self._resumed_exhausted = False
        self.drawn = 0  # items drawn from the loader this pass (pending ones when adopted)

    def restart(self, resumed_exhausted: bool) -> None:
        self.exhausted = False
        self._template = None
        self._resumed_exhausted = resumed_exhausted
        self.drawn = len(self.pending)

    def adopt(self, items: list[Any]) -> None:
        self.pending.extend(items)
        self.drawn += len(items)

    def stop(self) -> None:
        """The rank's limit is reached: what the loader holds after it is not trained."""
        self.exhausted = True
        self.pending.clear()

    def draws_beyond(self, items: int) -> bool:
        """Whether the loader yields more than ``items`` items in all this pass (what is read here is dropped)."""
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
            # this rank had run out when the checkpoint was written: its loader, restored at its end, starts over,
            # and its first batch is only repeated at weight zero
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


__all__ = ["Entry", "Reader"]
