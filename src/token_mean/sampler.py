"""``ExactDistributedSampler``: every item on exactly one rank, none repeated to even the ranks out."""

from __future__ import annotations

import math
from collections.abc import Iterator, Sized

import torch
import torch.distributed as dist
from torch.utils.data import DistributedSampler


class ExactDistributedSampler(DistributedSampler[int]):
    """Give rank r the items ``r, r + P, r + 2P, ...`` of a sized dataset's (shuffled) order, repeating none.

    ``DistributedSampler`` repeats items to even the ranks out, counting them twice; here ranks differ by at most
    one item, which ``pad_uneven_ranks`` fills with zero-weight batches. Being a ``DistributedSampler``, Lightning
    keeps it as given. ``num_replicas`` and ``rank`` default to the process group's; ``shuffle`` reorders every
    epoch by ``seed`` and :meth:`set_epoch`. Raises ``ValueError`` if ``rank`` is not in ``[0, num_replicas)``.

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
