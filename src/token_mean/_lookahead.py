"""The training loader, read one window ahead so that the window's counts are known before its first backward."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from typing import Any


class LookaheadLoader:
    """Wraps the training loader; everything but iteration is handed through to it.

    ``len()``, ``sampler`` (Lightning calls ``sampler.set_epoch``), ``dataset`` and every other attribute come from the
    wrapped loader. :class:`StatefulLookaheadLoader` adds ``state_dict``/``load_state_dict`` only where the wrapped
    loader has them, because Lightning decides whether a loader can resume mid-epoch by looking for those methods.
    """

    def __init__(
        self, loader: Any, count: Callable[[Any], Any], on_iter: Callable[[Any, LookaheadIterator], None]
    ) -> None:
        self.loader = loader
        self._count = count
        self._on_iter = on_iter

    def __iter__(self) -> LookaheadIterator:
        iterator = LookaheadIterator(iter(self.loader), self._count)
        self._on_iter(self, iterator)
        return iterator

    def __len__(self) -> int:
        # TypeError for loaders without __len__, which is what Lightning's `sized_len` expects
        return len(self.loader)

    def __getattr__(self, name: str) -> Any:
        # only called for names this wrapper does not define itself
        if name in ("loader", "_count", "_on_iter"):
            raise AttributeError(name)
        return getattr(self.loader, name)


class StatefulLookaheadLoader(LookaheadLoader):
    """A :class:`LookaheadLoader` over a loader that can save and restore its position."""

    def state_dict(self) -> dict[str, Any]:
        # Checkpoints are written between windows, when nothing is held ahead, so the wrapped loader's own state
        # is the position Lightning has consumed.
        return self.loader.state_dict()  # type: ignore[no-any-return]

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.loader.load_state_dict(state_dict)


def wrap_loader(
    loader: Any, count: Callable[[Any], Any], on_iter: Callable[[Any, LookaheadIterator], None]
) -> LookaheadLoader:
    stateful = callable(getattr(loader, "state_dict", None)) and callable(getattr(loader, "load_state_dict", None))
    cls = StatefulLookaheadLoader if stateful else LookaheadLoader
    return cls(loader, count, on_iter)


class LookaheadIterator(Iterator[Any]):
    """Yields the loader's batches in order; can read ahead and report the counts of batches not yet trained on.

    Every batch read gets its count at read time, on the host side of the loader (before it is moved to the device),
    and the count joins a FIFO of batches handed out but not yet trained on. The strategy pops that FIFO once per
    ``training_step`` and peeks at its head to learn the counts of a whole window.
    """

    def __init__(self, iterator: Iterator[Any], count: Callable[[Any], Any]) -> None:
        self._iterator = iterator
        self._count: Callable[[Any], Any] | None = count
        self._ahead: deque[Any] = deque()  # read from the loader, not yet handed to Lightning
        self._counts: deque[Any] = deque()  # counts of read batches whose training_step has not run yet
        self._exhausted = False

    def __next__(self) -> Any:
        if self._ahead:
            return self._ahead.popleft()
        return self._read()

    def _read(self) -> Any:
        if self._exhausted:
            raise StopIteration
        try:
            batch = next(self._iterator)
        except StopIteration:
            self._exhausted = True
            raise
        if batch is not None and self._count is not None:  # Lightning runs no training_step for a None batch
            self._counts.append(self._count(batch))
        return batch

    def passthrough(self) -> None:
        """Count nothing: this iterator feeds validation, not training."""
        self._count = None

    def peek_counts(self, length: int) -> list[Any]:
        """The counts of the next ``length`` batches to train on, reading ahead as needed (fewer at the end)."""
        while len(self._counts) < length and not self._exhausted:
            try:
                self._ahead.append(self._read())
            except StopIteration:
                break
        return list(self._counts)[:length]

    def pop_count(self) -> Any:
        """The count of the batch whose ``training_step`` runs now."""
        return self._counts.popleft()

    @property
    def held(self) -> int:
        """Batches read ahead of Lightning (at most K − 1 between two windows)."""
        return len(self._ahead)
