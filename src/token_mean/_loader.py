"""The training loader as the strategy sees it: read ahead by one window, and padded so every rank runs as long."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

Count = tuple[float, "int | None", str]  # (count, problem, detail): see strategy._read_count
ZERO: Count = (0.0, None, "")
# (this rank has a real batch, this rank has none to repeat) -> the same two flags OR-ed over all ranks
Agree = Callable[[bool, bool], tuple[bool, bool]]
# one picklable object per rank -> every rank's, in rank order (for the loader's per-rank state)
Gather = Callable[[Any], list[Any]]
_RANKS_KEY = "token_mean_ranks"


@dataclass(frozen=True)
class Entry:
    """A batch handed to Lightning whose ``training_step`` has not run yet."""

    count: Count  # lookahead: counted when read; deferred: ZERO (counted after forward)
    filler: bool  # a repeated batch at weight zero, so an exhausted rank still joins DDP's backward


class TrainLoader:
    """Wraps the training loader; everything but iteration and length is handed through to it.

    ``sampler`` (Lightning calls ``sampler.set_epoch``), ``dataset`` and every other attribute come from the wrapped
    loader. ``len()`` is the longest rank's length when ranks differ (see :class:`TrainIterator`).
    :class:`StatefulTrainLoader` adds ``state_dict``/``load_state_dict`` only where the wrapped loader has them,
    because Lightning decides whether it can resume mid-epoch by looking for those methods.
    """

    def __init__(
        self,
        loader: Any,
        count: Callable[[Any], Count] | None,
        on_iter: Callable[[TrainIterator], None],
        length: int | None,
        agree: Agree | None = None,
    ) -> None:
        self.loader = loader
        self._count = count
        self._on_iter = on_iter
        self._length = length
        self._agree = agree

    def __iter__(self) -> TrainIterator:
        snapshot = self.loader.state_dict if isinstance(self, StatefulTrainLoader) else None
        iterator = TrainIterator(iter(self.loader), self._count, self._length, self._agree, snapshot)
        if getattr(self, "_resumed_exhausted", False):
            iterator.resume_exhausted()
            self._resumed_exhausted = False
        self._iterator: TrainIterator | None = iterator
        self._on_iter(iterator)
        return iterator

    def __len__(self) -> int:
        # a TypeError for loaders without __len__ is what Lightning's `sized_len` expects
        return self._length if self._length is not None else len(self.loader)

    def __getattr__(self, name: str) -> Any:
        # only called for names this wrapper does not define itself
        if name in ("loader", "_count", "_on_iter", "_length", "_agree", "_iterator", "_resumed_exhausted", "_ranks"):
            raise AttributeError(name)
        return getattr(self.loader, name)


class StatefulTrainLoader(TrainLoader):
    """A :class:`TrainLoader` over a loader that can save and restore its position.

    Lightning writes rank 0's loader state into the checkpoint and loads it on every rank. Ranks whose shards differ
    are at different positions, so the state saved here holds every rank's (one small gather, while the checkpoint
    is built on every rank), and each rank loads its own.
    """

    _ranks: tuple[Gather, int] | None = None  # (gather, this rank) when distributed

    def state_dict(self) -> dict[str, Any]:
        iterator: TrainIterator | None = getattr(self, "_iterator", None)
        local = iterator.state() if iterator is not None else {"loader": self.loader.state_dict(), "exhausted": False}
        ranks = [local] if self._ranks is None else self._ranks[0](local)
        return {_RANKS_KEY: ranks}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if _RANKS_KEY not in state_dict:  # a checkpoint written without the strategy
            self.loader.load_state_dict(state_dict)
            return
        ranks = state_dict[_RANKS_KEY]
        rank = 0 if self._ranks is None else self._ranks[1]
        if rank >= len(ranks):
            raise ValueError(
                f"token_mean: the checkpoint holds the training loader's position for {len(ranks)} ranks, but this is"
                f" rank {rank}. Resume mid-epoch with the same number of processes, or from an epoch-end checkpoint."
            )
        self.loader.load_state_dict(ranks[rank]["loader"])
        self._resumed_exhausted = bool(ranks[rank]["exhausted"])


def wrap_loader(
    loader: Any,
    count: Callable[[Any], Count] | None,
    on_iter: Callable[[TrainIterator], None],
    length: int | None,
    agree: Agree | None = None,
    ranks: tuple[Gather, int] | None = None,
) -> TrainLoader:
    stateful = callable(getattr(loader, "state_dict", None)) and callable(getattr(loader, "load_state_dict", None))
    if not stateful:
        return TrainLoader(loader, count, on_iter, length, agree)
    wrapped = StatefulTrainLoader(loader, count, on_iter, length, agree)
    wrapped._ranks = ranks
    return wrapped


class TrainIterator(Iterator[Any]):
    """Yields the loader's batches in order, then zero-weight fillers until every rank is done; can read ahead.

    A sized loader is padded to ``length``, the longest rank's length. An unsized one cannot know when the other
    ranks run out, so each read asks ``agree`` (a two-flag collective) whether any rank still has a real batch: the
    epoch ends on all ranks at the same batch.

    Every batch read gets an :class:`Entry` in a FIFO of batches handed out but not yet trained on; the strategy pops
    it once per ``training_step`` and, in lookahead mode, peeks at the FIFO to learn a whole window's counts. Counts
    are taken at read time, on the host side of the loader, before Lightning moves the batch to the device.
    """

    def __init__(
        self,
        iterator: Iterator[Any],
        count: Callable[[Any], Count] | None,
        length: int | None,
        agree: Agree | None = None,
        snapshot: Callable[[], dict[str, Any]] | None = None,
    ) -> None:
        self._iterator = iterator
        self._count = count
        self._length = length
        self._agree = agree if length is None else None
        self._snapshot = snapshot  # a stateful loader's state_dict, taken around reads ahead
        self.consumed_state: dict[str, Any] | None = None  # the loader's state at Lightning's last batch, if held
        self._all_done = False
        # read from the loader, not yet handed to Lightning, with the loader's state after each read
        self._ahead: deque[tuple[Any, dict[str, Any] | None]] = deque()
        self._entries: deque[Entry] = deque()
        self._read_batches = 0
        self._exhausted = False
        self._last_real: Any = None

    def __next__(self) -> Any:
        if self._ahead:
            batch, state = self._ahead.popleft()
            self.consumed_state = state if self._ahead else None
            return batch
        return self._read()

    def _read(self) -> Any:
        if self._all_done or (self._length is not None and self._read_batches >= self._length):
            raise StopIteration
        filler = False
        if not self._exhausted:
            try:
                batch = next(self._iterator)
            except StopIteration:
                self._exhausted = True
        if self._agree is not None:
            any_real, any_unfillable = self._agree(not self._exhausted, self._exhausted and self._last_real is None)
            if not any_real:
                self._all_done = True
                raise StopIteration
            if any_unfillable:
                raise RuntimeError(
                    "token_mean: a rank's training loader yielded no batch at all this epoch while others did; it has"
                    " nothing to take part in DDP's backward with. Give every rank at least one batch."
                )
        if self._exhausted:
            if (self._length is None and self._agree is None) or self._last_real is None:
                raise StopIteration
            # this rank ran out before the others: repeat a real batch at weight zero so DDP's backward still fires
            batch, filler = self._last_real, True
        else:
            self._last_real = batch
        self._read_batches += 1
        if batch is not None:  # Lightning runs no training_step for a None batch
            count = ZERO if filler or self._count is None else self._count(batch)
            self._entries.append(Entry(count, filler))
        return batch

    def peek(self, length: int) -> list[Entry]:
        """The entries of the next ``length`` batches to train on, reading ahead as needed (fewer at the end)."""
        while len(self._entries) < length:
            if self._snapshot is not None and not self._ahead and self.consumed_state is None:
                self.consumed_state = self._live_state()  # what Lightning has taken so far
            try:
                batch = self._read()
            except StopIteration:
                break
            self._ahead.append((batch, self._live_state() if self._snapshot is not None else None))
        return list(self._entries)[:length]

    def _live_state(self) -> dict[str, Any]:
        assert self._snapshot is not None
        return {"loader": self._snapshot(), "exhausted": self._exhausted}

    def state(self) -> dict[str, Any]:
        """The position Lightning has consumed: the wrapped loader's own state counts batches read ahead."""
        return self.consumed_state if self.consumed_state is not None else self._live_state()

    def resume_exhausted(self) -> None:
        """This rank had run out when the checkpoint was written: it only contributes zero-weight batches.

        The loader, restored at its end, starts over; its first batch serves as the batch to repeat at weight zero.
        """
        self._exhausted = True
        try:
            self._last_real = next(self._iterator)
        except StopIteration:
            self._last_real = None

    def pop(self) -> Entry | None:
        """The entry of the batch whose ``training_step`` runs now (None if batches bypassed this iterator)."""
        return self._entries.popleft() if self._entries else None

    @property
    def held(self) -> int:
        """Batches read ahead of Lightning (at most K − 1 between two windows)."""
        return len(self._ahead)
