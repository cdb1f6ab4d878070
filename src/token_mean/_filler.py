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


def in_filler_batch() -> bool:
    """True inside the ``training_step`` of a zero-weight filler under :class:`~token_mean.TokenMeanDDPStrategy`."""
    return _active
