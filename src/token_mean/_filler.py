"""Whether the batch in flight is a zero-weight filler, for code that cannot reach the strategy (metrics)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

_active = False


@contextmanager
def filler_batch(active: bool) -> Iterator[None]:
    """Mark the ``training_step`` of a filler, so :class:`~token_mean.TokenMeanLoss` can leave it out."""
    global _active
    previous, _active = _active, active
    try:
        yield
    finally:
        _active = previous


def mark_filler_batch(active: bool) -> None:
    """Mark a Fabric loop's micro-batch as a filler (``True``, as ``accumulator.batches`` yields it) or end the mark
    (``False``, once its backward ran): code the loop runs after it, a validation loop, is no filler's."""
    global _active
    _active = active


def in_filler_batch() -> bool:
    """True inside the ``training_step`` of a zero-weight filler under :class:`~token_mean.TokenMeanDDPStrategy`,
    and in a Fabric loop from a filler's yield by ``accumulator.batches`` to its ``accumulator.backward``."""
    return _active
