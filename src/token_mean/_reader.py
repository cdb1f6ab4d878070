"""The fit loop's training batches as the strategy sees them: read ahead on demand, padded so every rank runs as long.

The reader sits between Lightning's ``CombinedLoader`` and its data fetcher (see ``_lightning.install_reader``), so it
sees exactly the batches ``training_step`` receives, several training loaders combined, and nothing that user code
draws from ``trainer.train_dataloader`` itself. It never calls the strategy: the window modes pull from it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from torch import Tensor
from torch.utils._pytree import tree_flatten

from token_mean._problems import Problem

# count of a micro-batch as read: (count, problem or None, this rank's detail)
Counted = tuple[float, "Problem | None", str]
Counter = Callable[[Any], Counted]
NOT_COUNTED: Counted = (0.0, None, "")
UNKNOWN_END = 2**62  # an unsized epoch's length until the ranks agree on more


@dataclass(frozen=True)
class Entry:
    """One batch handed (or to be handed) to Lightning, by its position in the epoch."""

    position: int
    filler: bool  # a repeat of a real batch at weight zero, so an exhausted rank still joins DDP's backward
    count: float = 0.0  # counted at read time (lookahead); 0.0 when not counted or a filler
    problem: Problem | None = None
    detail: str = ""


@dataclass(frozen=True)
class _Held:
    item: Any
    entry: Entry
    state: Any  # the loaders' state before this item was read (stateful loaders only)
    storages: frozenset[int]  # of a real batch's tensors, to tell a loader that refills one buffer


def _storages(item: Any) -> frozenset[int]:
    leaves, _ = tree_flatten(item)
    return frozenset(
        leaf.untyped_storage().data_ptr() for leaf in leaves if isinstance(leaf, Tensor) and leaf.numel() > 0
    )


class Reader:
    """Hands Lightning the epoch's batches in order, holding some ahead when a mode asks for them.

    Positions count batches from the epoch's start. ``length`` is where the epoch ends on every rank: the longest
    rank's length for sized loaders, or a length the ranks agree on window by window for unsized ones (``extend``).
    A rank whose loader runs out before that repeats its last real batch as a zero-weight filler; a ``None`` batch
    becomes a filler too, so that every rank trains the same positions.
    """

    def __init__(
        self, raw_next: Callable[[], Any], snapshot: Callable[[], Any] | None, start: Callable[[], int]
    ) -> None:
        self._raw_next = raw_next
        self._start = start  # where Lightning's epoch stands when the first batch is fetched (mid-epoch on resume)
        self._started = False
        self._snapshot = snapshot  # the loaders' own state_dicts (stateful loaders only)
        self.counter: Counter | None = None
        self.length = 0
        self.sized = True
        self.exhausted = False
        self._position = 0  # of the next batch handed to Lightning
        self._held: deque[_Held] = deque()  # read ahead of Lightning
        self._entries: deque[Entry] = deque()  # handed out and held, in order
        self._template: Any = None  # the last real item, repeated by fillers
        self._pending: deque[Any] = deque()  # raw items read before the reader took over
        self._current_storages: frozenset[int] = frozenset()
        self._resumed_exhausted = False
        self.current: Entry | None = None

    # ---------------------------------------------------------------------------------------------------------
    # the epoch
    # ---------------------------------------------------------------------------------------------------------

    def start_epoch(self, length: int | None, resumed_exhausted: bool = False) -> None:
        """A new pass over the loader; ``length`` None: unsized (its end is agreed as it comes, see ``extend``).

        Positions count from 0 until the first batch is fetched; then they shift to where Lightning's epoch stands
        (batches Lightning already took before a mid-epoch resume), which is only settled by then.
        """
        self._position = 0
        self._started = False
        self.sized = length is not None
        self.length = length if length is not None else UNKNOWN_END
        self.exhausted = False
        self._resumed_exhausted = resumed_exhausted
        self._held.clear()
        self._entries.clear()
        self.current = None
        self._current_storages = frozenset()
        self._template = None

    def adopt(self, items: list[Any]) -> None:
        """Raw items Lightning's fetcher had read before the reader was installed: they come first."""
        self._pending.extend(items)

    def _shift(self, start: int) -> None:
        self._started = True
        self._position += start
        self._entries = deque(replace(entry, position=entry.position + start) for entry in self._entries)
        self._held = deque(replace(held, entry=replace(held.entry, position=held.entry.position + start))
                           for held in self._held)

    @property
    def stateful(self) -> bool:
        return self._snapshot is not None

    @property
    def position(self) -> int:
        return self._position

    # ---------------------------------------------------------------------------------------------------------
    # Lightning's side
    # ---------------------------------------------------------------------------------------------------------

    def next_item(self) -> Any:
        if not self._started:
            self._shift(self._start())
        if self._position >= self.length:
            self._held.clear()  # speculative reads past an end the ranks agreed on
            raise StopIteration
        if self._held:
            held = self._held.popleft()
            item, entry, storages = held.item, held.entry, held.storages
        else:
            item, entry = self._read(self._position)
            storages = _storages(item) if self._checks_aliasing and not entry.filler else frozenset()
            self._entries.append(entry)
        self._position += 1
        self.current = entry
        self._current_storages = storages
        return item

    @property
    def _checks_aliasing(self) -> bool:
        return self.counter is not None or not self.sized

    def consumed_state(self) -> Any:
        """The loaders' state after the batches handed to Lightning: batches held ahead are not consumed yet."""
        assert self._snapshot is not None
        return self._held[0].state if self._held else self._snapshot()

    @property
    def consumed_exhausted(self) -> bool:
        """Whether the loader had run out at the consumed position (see ``consumed_state``): a loader that only
        ran out while reading ahead still holds real batches for Lightning."""
        return self.exhausted and (not self._held or self._held[0].entry.filler)

    # ---------------------------------------------------------------------------------------------------------
    # the modes' side
    # ---------------------------------------------------------------------------------------------------------

    def entry(self, position: int) -> Entry:
        """The entry of the batch at ``position``, reading ahead to it if needed; earlier entries are dropped."""
        while self._entries and self._entries[0].position < position:
            self._entries.popleft()
        self.read_ahead(position + 1)
        if not self._entries or self._entries[0].position != position:
            raise RuntimeError(
                f"token_mean: internal error: no batch at position {position} (next: {self._position}). Please report"
                " this with your Trainer settings."
            )
        return self._entries[0]

    def entries(self, start: int, stop: int) -> list[Entry]:
        """Entries of positions [start, stop), reading ahead as needed (fewer where the epoch ends)."""
        self.read_ahead(stop)
        return [entry for entry in self._entries if start <= entry.position < stop]

    def read_ahead(self, stop: int, at_most: int | None = None) -> None:
        """Hold the batches up to position ``stop`` (exclusive), reading at most ``at_most`` of them now."""
        reads = 0
        next_read = self._position + len(self._held)
        while next_read < stop and (at_most is None or reads < at_most):
            if self.sized and next_read >= self.length:
                return
            state = self._snapshot() if self._snapshot is not None else None  # before the read: not consumed yet
            try:
                item, entry = self._read(next_read)
            except StopIteration:
                return
            storages = _storages(item) if self._checks_aliasing and not entry.filler else frozenset()
            self._held.append(_Held(item, entry, state, storages))
            self._entries.append(entry)
            next_read += 1
            reads += 1

    def has_real_from(self, position: int) -> bool:
        """Whether this rank holds or can read a real batch at ``position`` or later (peeks one batch ahead)."""
        if any(not entry.filler for entry in self._entries if entry.position >= position):
            return True
        if self.exhausted:
            return False
        self.read_ahead(max(position, self._position + len(self._held)) + 1)
        return any(not entry.filler for entry in self._entries if entry.position >= position)

    # ---------------------------------------------------------------------------------------------------------

    def _read(self, position: int) -> tuple[Any, Entry]:
        if self._resumed_exhausted:
            # this rank had run out when the checkpoint was written: its loader, restored at its end, starts over,
            # and its first batch is only repeated at weight zero
            self._resumed_exhausted = False
            self._template = self._next_raw()
            self.exhausted = True
        item = self._next_raw()
        if item is not None and item[0] is not None:
            self._template = item
            return item, self._entry(position, item)
        if self._template is None:
            self._template = self._first_real(item)
        if self._template is None:
            raise StopIteration  # nothing to repeat: a rank without batches (the modes report it)
        return self._template, Entry(position, filler=True)

    def _next_raw(self) -> Any:
        if self._pending:
            return self._pending.popleft()
        if self.exhausted:
            return None
        try:
            return self._raw_next()
        except StopIteration:
            self.exhausted = True
            return None

    def _first_real(self, skipped: Any) -> Any:
        """A ``None`` batch before any real one: find the first real batch to repeat (it is trained later)."""
        if skipped is None:
            return None
        found: list[Any] = []
        while (item := self._next_raw()) is not None:
            found.append(item)
            if item[0] is not None:
                break
        self._pending.extendleft(reversed(found))
        real = [item for item in found if item[0] is not None]
        return real[0] if real else None

    def _entry(self, position: int, item: Any) -> Entry:
        count, problem, detail = self.counter(item[0]) if self.counter is not None else NOT_COUNTED
        if problem is None and self._checks_aliasing:
            storages = _storages(item)
            if storages & self._current_storages or any(storages & held.storages for held in self._held):
                problem = Problem.ALIASED
                detail = f"the batch at position {position} reuses the memory of a batch held before it"
        return Entry(position, filler=False, count=count, problem=problem, detail=detail)
