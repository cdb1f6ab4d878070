"""The epoch's length, agreed over ranks after Lightning sized it from each rank's own loaders."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import IterableDataset


def length_is_a_hint(loaders: list[Any]) -> bool:
    """An ``IterableDataset``'s ``__len__`` can overstate what it yields (padding the epoch with phantom optimizer
    steps): its end is agreed as the stream ends instead."""
    return any(isinstance(getattr(loader, "dataset", None), IterableDataset) for loader in loaders)


def agree_on_length(local: int | None, device: torch.device | None, pad_uneven_ranks: bool) -> int | None:
    """The longest rank's number of batches this epoch (one all-reduce per fit), or None when unsized.

    Lightning sizes the epoch (``num_training_batches``, validation intervals, the stepping rule) from each rank's own
    loaders, so ranks with shards of different sizes would step at different batches; every rank takes the longest
    and the reader pads the shorter ones with zero-weight fillers.
    """
    if device is None:
        return local
    extremes = torch.tensor([local or 0, -(local or 0), int(local is None)], dtype=torch.int64, device=device)
    dist.all_reduce(extremes, op=dist.ReduceOp.MAX)
    longest, shortest, unsized = int(extremes[0]), -int(extremes[1]), bool(extremes[2])
    if unsized:
        if local is not None:
            raise ValueError(
                "token_mean: the training loaders have a length on some ranks and none on others (an IterableDataset"
                " on some ranks only?); give every rank the same kind of loader."
            )
        return None
    if longest != shortest and (shortest == 0 or not pad_uneven_ranks):
        raise ValueError(
            f"token_mean: the ranks' training loaders have between {shortest} and {longest} batches this epoch (this"
            f" rank: {local}). "
            + (
                "A rank without any batch cannot take part in DDP's backward: give every rank at least one batch."
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
