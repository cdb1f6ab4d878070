"""What checkpoints keep of the package, and what a resume restores: Lightning saves rank 0's loader position only,
but each rank stands at its own (shards of different lengths, fillers), so the strategy saves every rank's and gives
each its own back. Under Fabric the checkpoint is the accumulator's :class:`Progress`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch.distributed as dist
from lightning.fabric.utilities import rank_zero_warn

from token_mean._epoch import Passes

CHECKPOINT_KEY = "token_mean"


def check_same_world(saved: int, world_size: int, unit: str, instead: str) -> None:
    """Raise a ``ValueError`` for a checkpoint written mid-``unit`` (an epoch, a Fabric pass) by ``saved`` processes
    and resumed with ``world_size``: each rank stood at its own position in its own shard."""
    if saved != world_size:
        raise ValueError(
            f"token_mean: the checkpoint was written in the middle of {unit} by {saved} processes, each at its own"
            f" position in its shard, but it is resumed with {world_size} processes: the batches each rank skips"
            f" would not be the ones it trained. Resume with {saved} processes, or from {instead}."
        )


def checkpoint_state(passes: Passes, accumulate: int, world_size: int) -> dict[str, Any]:
    """A Trainer strategy's checkpoint: the mode's counters, K and (stateful loaders) every rank's position; a
    checkpoint saved inside a window says where, and warns (a resume from it is refused: :func:`restore`)."""
    state: dict[str, Any] = passes.mode.state_dict()
    state["accumulate"] = accumulate
    epoch = passes.current
    if epoch is not None and epoch.reader.stateful:  # every rank's position, in rank order (an all-gather)
        local = {"loaders": epoch.reader.consumed_state(), "exhausted": epoch.reader.consumed_exhausted}
        ranks: list[Any] = [local]
        if world_size > 1 and dist.is_available() and dist.is_initialized():
            ranks = [None] * world_size
            dist.all_gather_object(ranks, local)
        state["loader_ranks"] = ranks
    inside = None if epoch is None else epoch.inside_window()
    if inside is not None:
        state["inside_window"] = inside
        rank_zero_warn(
            f"token_mean: saving a checkpoint inside {inside}: no checkpoint holds a window's partial gradient, so"
            " resuming from this one will be refused. Save at window boundaries: a `val_check_interval` that is a"
            f" multiple of `accumulate_grad_batches` (here {accumulate}), `ModelCheckpoint(every_n_train_steps=...)`,"
            " or at the end of an epoch."
        )
    return state


def restore(
    state: Mapping[str, Any] | None, passes: Passes, world_size: int, rank: int, has_loader_states: bool
) -> Any | None:
    """Restore the mode's counters (and whether this rank's loader had run out) from ``state``; returns this rank's
    own loader states to load instead of rank 0's (None: the checkpoint holds none). A ``ValueError`` for a
    checkpoint written mid-epoch by another number of processes."""
    if state is None:
        return None
    inside = state.get("inside_window")
    if inside is not None:
        raise ValueError(
            f"token_mean: the checkpoint being resumed was saved inside {inside}, and holds none of that window's"
            " partial gradient: the resumed run would train the window without the batches it had already trained"
            " (plain Lightning does so without a word). Resume from a checkpoint saved at a window boundary (a"
            " `val_check_interval` that is a multiple of `accumulate_grad_batches`,"
            " `ModelCheckpoint(every_n_train_steps=...)`, or the end of an epoch)."
        )
    passes.mode.load_state_dict(state)
    ranks = state.get("loader_ranks") if has_loader_states else None
    if ranks is None:
        return None
    check_same_world(len(ranks), world_size, "an epoch", "a checkpoint written at the end of an epoch")
    own = ranks[rank]
    passes.resume(bool(own["exhausted"]))
    return own["loaders"]


class Progress:
    """A Fabric accumulator's passes and windows so far, and where the next pass starts (the same on every rank)."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size  # the ranks that read their own shard of the data
        self.passes = 0  # started, a resumed pass counted once
        self.windows = 0  # finished, over all passes
        self.loader_epoch: int | None = None  # the Fabric loader's pass counter the pass reads with (None: no loader)
        self._stopped: int | None = None  # the last pass was left at a window boundary: the position it trains next
        self._abandoned: tuple[int, Any] | None = None  # it was left inside a window: its last batch, partial gradient
        self._resume: tuple[int, int | None] | None = None  # (position, loader pass counter) from a checkpoint

    def start_pass(self) -> tuple[int, int | None]:
        """A pass starts: its first position and the loader pass counter to restore (None: leave it)."""
        self.passes += 1
        self._stopped = None
        resume, self._resume = self._resume, None
        return resume or (0, None)

    def left(self, stopped: int | None, abandoned: tuple[int, Any] | None) -> None:
        """The pass ended at a window boundary before ``stopped``, or inside one; both None: its loader ran out."""
        self._stopped, self._abandoned = stopped, abandoned

    def take_abandoned(self) -> tuple[int, Any] | None:
        """Where the last pass left a window unfinished, and its partial gradient (None: it did not); asked once."""
        abandoned, self._abandoned = self._abandoned, None
        return abandoned

    def state_dict(self, in_flight: int | None) -> dict[str, Any]:
        """``in_flight``: the position after the finished window of a pass in progress (None between passes)."""
        if in_flight is None and self._abandoned is not None:
            raise RuntimeError(
                f"`accumulator.state_dict()` after a pass of `accumulator.batches(...)` was left inside a window (at"
                f" batch {self._abandoned[0]}): its partial gradient is not saved, and a resume could not continue"
                " where the pass stopped. Leave the loop at a window boundary (`break` after `accumulator.finish()`"
                " and the optimizer step, or before the next batch's forward), then save."
            )
        stopped = in_flight if in_flight is not None else self._stopped
        if self._resume is not None:  # loaded, and no pass since
            passes, (position, epoch) = self.passes, self._resume
        elif stopped is not None:  # a resume goes on with this pass
            passes, position, epoch = self.passes - 1, stopped, self.loader_epoch
        else:
            passes, position, epoch = self.passes, 0, None if self.loader_epoch is None else self.loader_epoch + 1
        return {
            "passes": passes,
            "windows": self.windows,
            "position": position,
            "loader_epoch": epoch,
            "world_size": self.world_size,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume from ``state``; a ``ValueError`` for a checkpoint written mid-pass by another number of processes."""
        position = int(state["position"])
        saved_world = state.get("world_size")
        if position > 0 and saved_world is not None:
            check_same_world(
                int(saved_world),
                self.world_size,
                "a pass",
                "a checkpoint written between passes (after `accumulator.batches(...)` ran to its end)",
            )
        self.passes = int(state["passes"])
        self.windows = int(state["windows"])
        epoch = state.get("loader_epoch")
        self._resume = (position, None if epoch is None else int(epoch))
        self._stopped = self._abandoned = None
