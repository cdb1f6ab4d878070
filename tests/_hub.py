"""Collectives for fake ranks in one process: each rank runs in a thread of its own over a ``World`` with
``distributed=False`` (no process group), and a channel subclass routes its collectives through a :class:`Hub`."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor


class Hub:
    """P threads meet at a barrier, each posts its record and takes the sum (MAX: the maximum) of all of them, or all
    of them as rows (a gather)."""

    def __init__(self, size: int) -> None:
        self.barrier = threading.Barrier(size, timeout=30)
        self.posted: list[Tensor] = [torch.zeros(0)] * size

    def _meet(self, rank: int, record: Tensor) -> Tensor:
        self.posted[rank] = record
        self.barrier.wait()
        stacked = torch.stack(self.posted)  # in rank order: the same result on every rank
        self.barrier.wait()  # nobody posts the next record before every rank has read this one
        return stacked

    def all_reduce(self, rank: int, record: Tensor, op: Any = None) -> Tensor:
        stacked = self._meet(rank, record)
        return stacked.amax(0) if op == dist.ReduceOp.MAX else stacked.sum(0)

    def all_gather(self, rank: int, record: Tensor) -> Tensor:
        return self._meet(rank, record)


def in_threads(ranks: list[Callable[[], Any]], hub: Hub, abort: bool = True) -> list[Any]:
    """Run each fake rank in a thread of its own: what each returned, or the exception it raised. With ``abort``, a
    rank that raises aborts the barrier, so the others fail rather than wait (not where every rank raises after its
    last collective: an abort could reach one still leaving the barrier)."""
    results: list[Any] = [None] * len(ranks)

    def run(rank: int) -> None:
        try:
            results[rank] = ranks[rank]()
        except BaseException as error:
            results[rank] = error
            if abort:
                hub.barrier.abort()

    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(len(ranks))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    return results
