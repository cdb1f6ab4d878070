"""Whether the micro-batch in flight is a zero-weight filler, for code that cannot reach the front end (metrics)."""

from __future__ import annotations

import weakref
from typing import Any

_current: weakref.ref[Any] | None = None  # the micro-batch created last (held by its front end)


def track(micro_batch: Any) -> None:
    """``micro_batch`` (a ``_mode.MicroBatch``, or None) is the one in flight from now on."""
    global _current
    _current = None if micro_batch is None else weakref.ref(micro_batch)


def in_filler_batch() -> bool:
    """True from the creation of a zero-weight filler micro-batch to its backward, in every front end: under the
    Trainer strategies its ``training_step`` and backward, in a Fabric loop from ``accumulator.batches`` yielding it
    to its ``accumulator.backward``. Code that runs for other batches (a validation loop) never sees it."""
    micro_batch = None if _current is None else _current()
    return micro_batch is not None and bool(micro_batch.is_filler)
