"""Every rank's loader position in a mid-epoch checkpoint: Lightning saves rank 0's only.

Ranks with shards of different lengths (or a rank that ran out and repeats its last batch as a filler) stand at
different positions of their own loaders; resumed from rank 0's state, the others would train other batches.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from token_mean._loaders import gather_objects
from token_mean._reader import Reader


@dataclass(frozen=True)
class RankPosition:
    """Where one rank's loaders stood: their states after the batches handed out, and whether they had run out."""

    loaders: Any
    exhausted: bool


def every_rank(reader: Reader, world_size: int, distributed: bool) -> list[dict[str, Any]]:
    """Every rank's position, in rank order (an all-gather of small objects, at checkpoint time only)."""
    local = {"loaders": reader.consumed_state(), "exhausted": reader.consumed_exhausted}
    return gather_objects(local, world_size) if distributed else [local]


def this_rank(state: Mapping[str, Any], world_size: int, rank: int) -> RankPosition | None:
    """This rank's saved position (None when the checkpoint holds none).

    Raises:
        ValueError: for a checkpoint written mid-epoch by another number of processes.
    """
    ranks = state.get("loader_ranks")
    if ranks is None:
        return None
    check_same_world(len(ranks), world_size, "an epoch", "a checkpoint written at the end of an epoch")
    own = ranks[rank]
    return RankPosition(own["loaders"], bool(own["exhausted"]))


def check_same_world(saved: int, world_size: int, unit: str, instead: str) -> None:
    """Refuse a checkpoint written in the middle of ``unit`` (an epoch, a Fabric pass) by ``saved`` processes and
    resumed with ``world_size``: each rank stood at its own position in its own shard.

    Raises:
        ValueError: naming both numbers and the two ways to resume.
    """
    if saved != world_size:
        raise ValueError(
            f"token_mean: the checkpoint was written in the middle of {unit} by {saved} processes, each at its own"
            f" position in its shard, but it is resumed with {world_size} processes: the batches each rank skips"
            f" would not be the ones it trained. Resume with {saved} processes, or from {instead}."
        )


__all__ = ["RankPosition", "check_same_world", "every_rank", "this_rank"]
