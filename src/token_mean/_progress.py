"""Where a Fabric loop's training stands across passes: what ``TokenMeanAccumulator.state_dict`` records and a
resume restores.

A pass is one ``accumulator.batches(...)``. It ends at its loader's end, or the loop leaves it (``break``, LitGPT's
``max_iters``): at a window boundary the pass records where it stopped, so that a checkpoint written then resumes
there; inside a window its partial gradient is neither saved nor to be added to the next update. A loader from
``fabric.setup_dataloaders`` orders its batches by its own pass counter (the epoch it gives its sampler), which
restarts at 0 in a new process: the checkpoint keeps it, and the resumed pass gives it back to the loader.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from token_mean._checkpoint import check_same_world


class Progress:
    """Passes and windows so far, and where the next pass starts (identical on every rank)."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size  # the ranks that read their own shard of the data
        self.passes = 0  # started, a resumed pass counted once
        self.windows = 0  # finished, over all passes
        self._epoch: int | None = None  # the loader's pass counter the pass reads with (None: not a Fabric loader)
        self._stopped: int | None = None  # the last pass was left at a window boundary: the position it trains next
        self._abandoned: int | None = None  # the last pass was left inside a window: its last batch's position
        self._partial: Any = None  # what the front end keeps of that window's partial gradient
        self._resume: tuple[int, int | None] | None = None  # (position, loader pass counter) from a checkpoint

    def start_pass(self) -> tuple[int, int | None]:
        """A pass starts: its first position (after the batches a resumed pass had trained) and the loader pass
        counter to give back to a Fabric loader (None: leave it)."""
        self.passes += 1
        self._stopped = None
        start, epoch = self._resume or (0, None)
        self._resume = None
        return start, epoch

    def reading(self, epoch: int | None) -> None:
        """The pass reads a Fabric loader whose pass counter (its sampler's epoch) is ``epoch``."""
        self._epoch = epoch

    def left(self, stopped: int | None, inside: int | None, partial: Any = None) -> None:
        """The pass ended: left at a window boundary before position ``stopped``, or inside a window at position
        ``inside`` with the ``partial`` gradient (both None: its loader ran out)."""
        self._stopped, self._abandoned, self._partial = stopped, inside, partial

    def take_abandoned(self) -> tuple[int, Any] | None:
        """Where the last pass left a window unfinished and its partial gradient (None: it did not); asked once, as
        the next pass starts."""
        abandoned = None if self._abandoned is None else (self._abandoned, self._partial)
        self._abandoned = self._partial = None
        return abandoned

    def state_dict(self, in_flight: int | None) -> dict[str, Any]:
        """``in_flight``: the position after the finished window of a pass in progress (None between passes)."""
        if in_flight is None and self._abandoned is not None:
            raise RuntimeError(
                f"`accumulator.state_dict()` after a pass of `accumulator.batches(...)` was left inside a window (at"
                f" batch {self._abandoned}): its partial gradient is not saved, and a resume could not continue where"
                " the pass stopped. Leave the loop at a window boundary (`break` after `accumulator.finish()` and the"
                " optimizer step, or before the next batch's forward), then save."
            )
        if self._resume is not None:  # loaded, and no pass since
            position, epoch = self._resume
            return self._state(self.passes, position, epoch)
        stopped = in_flight if in_flight is not None else self._stopped
        if stopped is not None:  # a resume goes on with this pass
            return self._state(self.passes - 1, stopped, self._epoch)
        return self._state(self.passes, 0, None if self._epoch is None else self._epoch + 1)

    def _state(self, passes: int, position: int, epoch: int | None) -> dict[str, Any]:
        return {"passes": passes, "windows": self.windows, "position": position, "loader_epoch": epoch,
                "world_size": self.world_size}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume from ``state``.

        Raises:
            ValueError: for a checkpoint written in the middle of a pass by another number of processes.
        """
        position = int(state["position"])
        saved_world = state.get("world_size")
        if position > 0 and saved_world is not None:
            check_same_world(int(saved_world), self.world_size, "a pass",
                             "a checkpoint written between passes (after `accumulator.batches(...)` ran to its end)")
        self.passes = int(state["passes"])
        self.windows = int(state["windows"])
        epoch = state.get("loader_epoch")
        self._resume = (position, None if epoch is None else int(epoch))
        self._stopped = self._abandoned = None


__all__ = ["Progress"]
