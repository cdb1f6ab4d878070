"""The epoch's length, agreed over ranks after the loop sized it from each rank's own loaders."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch.utils.data import IterableDataset

from token_mean._record import Channel, Kind, Slot, Values


def length_is_a_hint(loaders: list[Any]) -> bool:
    """An ``IterableDataset``'s ``__len__`` can overstate what it yields (padding the epoch with phantom optimizer
    steps): its end is agreed as the stream ends instead."""
    return any(isinstance(getattr(loader, "dataset", None), IterableDataset) for loader in loaders)


def agree_on_length(channel: Channel, local: int | None, pad_uneven_ranks: bool) -> int | None:
    """The longest rank's number of batches this epoch, or None when unsized.

    One collective when the ranks agree (a SUM of each rank's length and its square: all lengths are equal exactly
    when Σl² · P = (Σl)²), a second (a MAX) for the longest when they do not. The loop sizes the epoch (the stepping
    rule, validation intervals) from each rank's own loaders, so ranks with shards of different sizes would step at
    different batches; every rank takes the longest and the reader pads the shorter ones with zero-weight fillers.
    """
    world = channel.world
    length = local or 0
    values = Values({Slot.EPOCH_LENGTH: float(length), Slot.EPOCH_LENGTH_SQUARED: float(length * length),
                     Slot.UNSIZED: float(local is None)})
    reduced = channel.reduce(Kind.LENGTH, values)
    reduced.check("the ranks' agreement on the epoch's length")
    unsized = round(reduced[Slot.UNSIZED])
    if unsized:
        if unsized < world.size:
            raise ValueError(
                "token_mean: the training loaders have a length on some ranks and none on others (an IterableDataset"
                " on some ranks only?); give every rank the same kind of loader."
            )
        return None
    total, squares = reduced[Slot.EPOCH_LENGTH], reduced[Slot.EPOCH_LENGTH_SQUARED]
    if squares * world.size == total * total:
        return length
    extremes = Values({Slot.EPOCH_LENGTH: float(length), Slot.EPOCH_LENGTH_SQUARED: float(-length)})
    longest_of = channel.reduce(Kind.LENGTH, extremes, op=dist.ReduceOp.MAX)
    longest, shortest = round(longest_of[Slot.EPOCH_LENGTH]), -round(longest_of[Slot.EPOCH_LENGTH_SQUARED])
    if shortest == 0 or not pad_uneven_ranks:
        raise ValueError(
            f"token_mean: the ranks' training loaders have between {shortest} and {longest} batches this epoch (this"
            f" rank: {local}). "
            + (
                "A rank without any batch cannot take part in the backward: give every rank at least one batch."
                if shortest == 0
                else "With `pad_uneven_ranks=False` every rank needs the same number: set `pad_uneven_ranks=True`"
                " to let exhausted ranks contribute zero-weight batches, or balance the shards."
            )
        )
    return longest


def gather_objects(value: Any, world_size: int) -> list[Any]:
    """Every rank's ``value``, in rank order (small picklable objects: per-rank loader positions)."""
    gathered: list[Any] = [None] * world_size
    dist.all_gather_object(gathered, value)
    return gathered
