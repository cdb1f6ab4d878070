"""``ExactDistributedSampler``: every item on exactly one rank, none repeated to even the ranks out."""

from __future__ import annotations

import math
from collections.abc import Iterator, Sized

import torch
import torch.distributed as dist
from torch.utils.data import DistributedSampler


class ExactDistributedSampler(DistributedSampler[int]):
    """Split a map-style dataset over ranks without repeating items.

    :class:`torch.utils.data.DistributedSampler` evens the ranks out by repeating items from the start of the
    dataset, which silently counts them twice in the objective (or drops the tail with ``drop_last=True``). This
    sampler gives rank r the items ``r, r + P, r + 2P, ...`` of the (optionally shuffled) order, so the ranks'
    lengths differ by at most one item; :class:`~token_mean.TokenMeanDDPStrategy` (``pad_uneven_ranks=True``,
    the default) lets the shorter ranks contribute zero-weight batches, which keeps the objective exact.

    It is a :class:`~torch.utils.data.DistributedSampler`, so Lightning keeps it as it is under its default
    ``use_distributed_sampler=True`` (Lightning re-shards any other sampler, which would split the shards again):
    pass it to your ``DataLoader`` in ``train_dataloader`` (or ``val_dataloader``, for an exact validation mean with
    :class:`~token_mean.TokenMeanLoss`).

    Args:
        dataset: a sized dataset.
        num_replicas: P; defaults to the process group's world size.
        rank: this rank; defaults to the process group's rank.
        shuffle: shuffle the order every epoch (call :meth:`set_epoch`; Lightning does).
        seed: the shuffle's seed, identical on every rank.

    Raises:
        ValueError: if ``rank`` is not in ``[0, num_replicas)``.

    Example:
        >>> [list(ExactDistributedSampler(range(5), num_replicas=2, rank=r, shuffle=False)) for r in (0, 1)]
        [[0, 2, 4], [1, 3]]
    """

    def __init__(
        self,
        dataset: Sized,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
    ) -> None:
        if num_replicas is None:
            num_replicas = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        if rank is None:
            rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        if not 0 <= rank < num_replicas:
            raise ValueError(f"`rank` must be in [0, {num_replicas}) for `num_replicas={num_replicas}`, got {rank}.")
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed)  # type: ignore[arg-type]
        # DistributedSampler's own sizes assume padding; this rank's share has no repeats
        self.num_samples = len(self)
        self.total_size = len(dataset)

    def __iter__(self) -> Iterator[int]:
        if self.shuffle:
            generator = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(len(self.dataset), generator=generator).tolist()  # type: ignore[arg-type]
        else:
            order = list(range(len(self.dataset)))  # type: ignore[arg-type]
        return iter(order[self.rank :: self.num_replicas])

    def __len__(self) -> int:
        return max(0, math.ceil((len(self.dataset) - self.rank) / self.num_replicas))  # type: ignore[arg-type]
