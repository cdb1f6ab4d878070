"""Every rank's outcome of a forked fit, so that "every rank raises" is checked on every rank.

Forked workers run ``Trainer._fit_impl`` directly: Lightning calls ``on_exception`` only in the launching process,
re-raises the first failed worker's error there, and stops the other workers as soon as one has failed. A test that
only looks at what ``trainer.fit`` raised therefore sees one rank. While :func:`outcomes_recorded` is active, every
worker writes ``error{rank}.txt`` (what it raised) or ``done{rank}.txt`` into a folder, and a worker that raised waits
until every rank has finished or raised before it re-raises.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from unittest import mock

import lightning.pytorch as pl
import pytest

# Seconds a rank that raised waits for the others to finish or raise. Longer than the collective timeout of the tests
# that record (``_harness.SHORT_TIMEOUT``, 15 s), so that a rank left waiting in a collective reports its own error.
WAIT_FOR_RANKS = 25.0
POLL = 0.05  # seconds between looks at the other ranks' outcome files


def _settled(out: Path, rank: int) -> bool:
    return any((out / f"{outcome}{rank}.txt").exists() for outcome in ("error", "done"))


@contextmanager
def outcomes_recorded(out: Path) -> Iterator[None]:
    """Every ``Trainer.fit`` started in the block (and the workers it forks) records each rank's outcome in `out`."""
    out.mkdir(parents=True, exist_ok=True)
    fit_impl = pl.Trainer._fit_impl

    def recorded(trainer: pl.Trainer, *args: Any, **kwargs: Any) -> Any:
        rank = int(os.environ.get("LOCAL_RANK", "0"))  # set by the launcher before the worker runs this
        try:
            result = fit_impl(trainer, *args, **kwargs)
        except BaseException as error:
            (out / f"error{rank}.txt").write_text(f"{type(error).__name__}: {error}")
            (out / f"notes{rank}.txt").write_text("\n".join(getattr(error, "__notes__", ())))  # this rank's own
            deadline = time.monotonic() + WAIT_FOR_RANKS
            while time.monotonic() < deadline and not all(_settled(out, r) for r in range(trainer.num_devices)):
                time.sleep(POLL)
            raise
        (out / f"done{rank}.txt").write_text("")
        return result

    with mock.patch.object(pl.Trainer, "_fit_impl", recorded):
        yield


def errors_of(out: Path, ranks: int = 2) -> list[str]:
    """Every rank's error message (``"ErrorType: message"``); fails naming the ranks that did not raise."""
    missing = {
        rank: "finished" if (out / f"done{rank}.txt").exists() else "was stopped"
        for rank in range(ranks)
        if not (out / f"error{rank}.txt").exists()
    }
    assert not missing, f"not every rank raised: {missing}"
    return [(out / f"error{rank}.txt").read_text() for rank in range(ranks)]


def notes_of(out: Path, ranks: int = 2) -> list[str]:
    """Every rank's notes on its error (what that rank saw itself: ``On rank r: ...``)."""
    return [(out / f"notes{rank}.txt").read_text() for rank in range(ranks)]


def raises_everywhere(out: Path, run: Callable[[], object], ranks: int = 2) -> list[str]:
    """Run a fit that must fail on every rank, and return every rank's error message."""
    with outcomes_recorded(out), pytest.raises(Exception):  # noqa: B017 - the launcher re-raises as its own type
        run()
    return errors_of(out, ranks)
